// Package admin is a node's operator surface: the admin API's JSON schema,
// its Prometheus metrics, and the dashboard page. Package node feeds it;
// `meshnode status` reads it.
//
// # Endpoints
//
// Every node serves them on its HTTP port, beside the OpenAI API. When the
// node has an API key (required when it listens beyond loopback), /api/* and
// /metrics want it as "Authorization: Bearer KEY", like /v1/*.
//
//	GET /                  the dashboard, for a browser (Accept: text/html);
//	                       other clients get the OpenAI API's 404 as before
//	GET /api/status        Status: the whole mesh as this node sees it
//	GET /api/events        Events: recent events; ?since=RFC3339, ?kind=K
//	GET /api/nodes         {"schema", "nodes": [Node...]}
//	GET /api/nodes/{id}    Node, by peer ID or a suffix of it (the short ID)
//	GET /api/metrics       NodeStats: this node's live numbers, as JSON
//	GET /metrics           Prometheus text format
//
// # The status schema
//
// Status, Node, Stage, Hop, NodeStats, StageStats, Local and Event define
// the JSON of /api/status and of `meshnode status --json`; their field
// comments are the documentation. Status.Schema is SchemaVersion
// ("meshnode.status/v1"): within a version fields are only added, never
// renamed, removed or given another meaning. Sizes are bytes, durations
// milliseconds (fields ending in _ms) or seconds (_s), times RFC 3339.
// An example, trimmed:
//
//	{
//	  "schema": "meshnode.status/v1",
//	  "time": "2026-01-02T15:04:05.123Z",
//	  "self": "12D3KooWQ…x7Yz2a",
//	  "model": {"id": "5c8e…", "name": "stories260K", "arch": "llama", "layers": 5},
//	  "ready": true,
//	  "plan": [
//	    {"node": "12D3KooWQ…x7Yz2a", "name": "mac-1", "start": 0, "end": 3, "share": 0.6,
//	     "up": true, "compute_ms": 0.4, "tokens_per_second": 212.5},
//	    {"node": "12D3KooWR…k3Pq9b", "name": "mac-2", "start": 3, "end": 5, "share": 0.4,
//	     "up": true, "compute_ms": 0.3, "tokens_per_second": 212.4}
//	  ],
//	  "lanes": 2,
//	  "hops": [
//	    {"from": "…x7Yz2a", "to": "…x7Yz2a", "rtt_ms": 0, "bytes": null, "via": "node"},
//	    {"from": "…x7Yz2a", "to": "…k3Pq9b", "rtt_ms": 0.21, "bytes": 1048576, "via": "libp2p"},
//	    {"from": "…k3Pq9b", "to": "…x7Yz2a", "rtt_ms": 0.23, "bytes": 20480, "via": "libp2p"}
//	  ],
//	  "nodes": [{"peer_id": "…", "short_id": "x7Yz2a", "name": "mac-1", "self": true,
//	             "state": "ready", "addrs": ["/ip4/192.168.1.5/tcp/4001/p2p/…"],
//	             "engine": "ggml", "backend": "cpu", "mem_total": 17179869184,
//	             "mem_offered": 8589934592, "mem_used": 75497472, "speed": 61.2,
//	             "serving": [{"model": "5c8e…", "start": 0, "end": 3}], "has_file": true,
//	             "rtt_ms": null, "stats": {"queue_depth": 0, "active": 1, "tokens_per_second": 212.5, …}}],
//	  "events": [{"time": "…", "kind": "plan", "text": "plan for stories260K: …"}],
//	  "join_command": "meshnode join /ip4/…/p2p/… --mesh-key mk1_…"
//	}
//
// A node's state is loading (with loading_pct), ready or draining, as it
// announces itself; suspect when gossip still lists it but it stopped
// answering the answering node; dead when gossip declared it failed; left
// when it said goodbye. Dead and left nodes stay listed for an hour, or
// until they come back.
//
// # Metrics
//
// All names start with meshnode_: requests_total{outcome}, errors_total{kind},
// http_requests_total{endpoint,code}, events_total{kind}, replans_total,
// sequence_replays_total, time_to_first_token_seconds,
// request_duration_seconds, prefill_tokens_per_second,
// decode_tokens_per_second, pipeline_step_seconds,
// stage_compute_seconds{stage}, stage_tokens_total{stage,kind},
// hop_rtt_seconds{peer}, hop_bytes_total{peer,direction}, queue_depth,
// active_sequences, prompt_tokens_total, generated_tokens_total,
// kv_cache_tokens, kv_cache_capacity_tokens, kv_cache_used_bytes,
// memory_bytes{kind}, mesh_members{state}, ready, pipeline_stages,
// loading_percent, node_info{...}; plus Go's and the process's standard
// collectors (go_*, process_*).
package admin
