package admin

import "time"

// SchemaVersion names the JSON layout of Status (GET /api/status and
// `meshnode status --json`). Within one version fields are only ever added;
// a field that is renamed, removed or changes meaning gets a new version.
const SchemaVersion = "meshnode.status/v1"

// Node states in Node.State. The first three are what a node announces about
// itself; the others are what the answering node concludes.
const (
	StateLoading  = "loading"  // taking or loading its layers (see Node.LoadingPct)
	StateReady    = "ready"    // serving its layers, or ready to take some
	StateDraining = "draining" // leaving: it gets no new layers
	StateSuspect  = "suspect"  // gossip says alive, but it stopped answering
	StateDead     = "dead"     // failed: gossip declared it dead
	StateLeft     = "left"     // left the mesh gracefully
)

// Status is the whole mesh as one node sees it.
type Status struct {
	// Schema is SchemaVersion.
	Schema string `json:"schema"`
	// Time is when the answering node took this snapshot.
	Time time.Time `json:"time"`
	// Self is the peer ID of the node that answered.
	Self string `json:"self"`
	// Version is the answering node's meshnode version.
	Version string `json:"version,omitempty"`
	// Model is the mesh's model; absent until the node knows it.
	Model *Model `json:"model,omitempty"`
	// Ready is true when the answering node can serve requests now: the
	// plan is complete and every stage of its pipeline is up.
	Ready bool `json:"ready"`
	// Problem says why the node cannot serve, when Ready is false.
	Problem string `json:"problem,omitempty"`
	// Plan is the pipeline: the stages in order, covering every layer.
	// Empty when no placement exists (not enough nodes or memory).
	Plan []Stage `json:"plan"`
	// Lanes is how many micro-batches a request's node keeps in flight
	// through the pipeline: one per stage when it pipelines (serve
	// --pipelining), else 1; 0 when there is no pipeline.
	Lanes int `json:"lanes,omitempty"`
	// Hops are the network legs of a request that enters at the answering
	// node: to the first stage, between stages, and from the last stage
	// back (the sampled token). A hop within one node has From == To.
	Hops []Hop `json:"hops"`
	// Nodes are the members: those in the plan first (in pipeline order),
	// then the other live ones, then those that died or left recently.
	Nodes []Node `json:"nodes"`
	// Local is the stage the answering node holds, if any.
	Local *Local `json:"local,omitempty"`
	// Events are the answering node's recent events, oldest first.
	Events []Event `json:"events"`
	// JoinHint is the command that adds a machine to this mesh. It holds
	// the mesh key: the admin API is protected like the OpenAI one.
	JoinHint string `json:"join_command"`
}

// Model names the mesh's model.
type Model struct {
	ID       string `json:"id"` // content hash (SHA-256) of the GGUF
	Name     string `json:"name"`
	Arch     string `json:"arch"`
	Layers   int    `json:"layers"`
	Context  int    `json:"context,omitempty"`  // positions per sequence
	Parallel int    `json:"parallel,omitempty"` // sequences at once
}

// Stage is one stage of the plan.
type Stage struct {
	Node  string  `json:"node"` // peer ID
	Name  string  `json:"name"` // the node's name (host name)
	Start int     `json:"start"`
	End   int     `json:"end"` // exclusive
	Share float64 `json:"share"`
	// Up is true when the node announces that it serves exactly this range.
	Up bool `json:"up"`
	// ComputeMs is the stage's mean forward-pass time over the last few
	// seconds, as the node measures it; 0 when idle or unknown.
	ComputeMs float64 `json:"compute_ms"`
	// TokensPerSecond is how many tokens the stage produced per second
	// (output rows of its forward passes) over the last few seconds.
	TokensPerSecond float64 `json:"tokens_per_second"`
}

// Hop is one network leg of the pipeline.
type Hop struct {
	From string `json:"from"` // peer ID
	To   string `json:"to"`   // peer ID
	// RTTMs is the round trip between the two nodes (libp2p ping, smoothed)
	// as From measures it; null when unknown, 0 within one node.
	RTTMs *float64 `json:"rtt_ms"`
	// Bytes is the stage traffic From has sent To since From started
	// (gRPC wire bytes, or local sockets' frames); null when unknown.
	Bytes *uint64 `json:"bytes"`
	// Via is how the hop's streams travel: ViaNode, ViaLocal or ViaLibp2p.
	Via string `json:"via"`
}

// How a hop's streams travel (Hop.Via).
const (
	ViaNode   = "node"   // within one node, in memory
	ViaLocal  = "local"  // between nodes of one machine, over a Unix socket (serve --local-hops)
	ViaLibp2p = "libp2p" // gRPC over libp2p
)

// Serve is a layer range a node serves.
type Serve struct {
	Model string `json:"model"`
	Start int    `json:"start"`
	End   int    `json:"end"`
}

// Node is one member of the mesh.
type Node struct {
	PeerID  string `json:"peer_id"`
	ShortID string `json:"short_id"` // last 6 characters of the peer ID
	Name    string `json:"name"`
	Self    bool   `json:"self"` // the answering node
	// State is one of the State* constants.
	State string `json:"state"`
	// LoadingPct is the progress of slicing or fetching layers while the
	// node is loading.
	LoadingPct *float64 `json:"loading_pct,omitempty"`
	// Since is when the node died or left (State dead or left).
	Since   *time.Time `json:"since,omitempty"`
	Addrs   []string   `json:"addrs"`
	HTTP    string     `json:"http,omitempty"` // its HTTP API address, as it announces it
	Engine  string     `json:"engine"`
	Backend string     `json:"backend"`
	// MemTotal is the machine's memory; MemOffered what the node offers
	// the planner; MemUsed what its stage takes (weights, KV cache
	// reserved, scratch); 0 when it holds no stage or cannot be asked.
	MemTotal   uint64  `json:"mem_total"`
	MemOffered uint64  `json:"mem_offered"`
	MemUsed    uint64  `json:"mem_used"`
	Speed      float64 `json:"speed"` // measured memory bandwidth, GB/s
	Serving    []Serve `json:"serving"`
	HasFile    bool    `json:"has_file"` // holds the whole model file
	// RTTMs is the round trip from the answering node; null when unknown.
	RTTMs *float64 `json:"rtt_ms"`
	// Stats are the node's own live numbers, as it last reported them to
	// the answering node; null when it could not be asked.
	Stats *NodeStats `json:"stats"`
}

// NodeStats are a node's live numbers. Nodes exchange them over the mesh
// (libp2p protocol /meshnode/stats/1), so every node can show all of them.
type NodeStats struct {
	Time    time.Time `json:"time"`
	Version string    `json:"version,omitempty"`
	Uptime  float64   `json:"uptime_s"`

	// Requests that entered the mesh at this node.
	QueueDepth      int     `json:"queue_depth"` // waiting for a sequence slot
	Active          int     `json:"active"`      // generating now
	Requests        uint64  `json:"requests"`
	Failed          uint64  `json:"failed"`
	PromptTokens    uint64  `json:"prompt_tokens"`
	GeneratedTokens uint64  `json:"generated_tokens"`
	TokensPerSecond float64 `json:"tokens_per_second"` // generated, last few seconds
	TTFTMs          float64 `json:"ttft_ms"`           // mean time to first token, recent requests
	StepMs          float64 `json:"step_ms"`           // mean pipeline step (all stages and hops)

	// Stage is the node's own stage; absent when it serves none.
	Stage *StageStats `json:"stage,omitempty"`

	// RTTMs is the smoothed round trip to each peer (by peer ID).
	RTTMs map[string]float64 `json:"rtt_ms,omitempty"`
	// BytesSent and BytesReceived are stage traffic to and from each peer.
	BytesSent     map[string]uint64 `json:"bytes_sent,omitempty"`
	BytesReceived map[string]uint64 `json:"bytes_received,omitempty"`
}

// StageStats describe the stage a node runs.
type StageStats struct {
	Start           int     `json:"start"`
	End             int     `json:"end"`
	Forwards        uint64  `json:"forwards"`          // forward passes so far
	TokensPerSecond float64 `json:"tokens_per_second"` // output rows, last few seconds
	ComputeMs       float64 `json:"compute_ms"`        // mean forward pass, last few seconds
	WeightBytes     uint64  `json:"weight_bytes"`
	KVBytes         uint64  `json:"kv_bytes"`      // KV cache reserved
	KVUsedBytes     uint64  `json:"kv_used_bytes"` // of which holds cached tokens
	KVTokens        int     `json:"kv_tokens"`     // cached positions, all sequences
	KVCapacity      int     `json:"kv_capacity"`   // positions the cache holds
	MemUsed         uint64  `json:"mem_used"`      // weights + KV reserved + scratch
	// DecodePath is how one-row decode passes run where there is a
	// choice (an NVIDIA GPU): "fused" (meshnode's CUDA kernels) or "ggml";
	// DecodeWhy says why not fused. Empty where there is no choice.
	DecodePath string `json:"decode_path,omitempty"`
	DecodeWhy  string `json:"decode_why,omitempty"`
}

// Local is the stage the answering node holds.
type Local struct {
	Start       int    `json:"start"`
	End         int    `json:"end"`
	WeightBytes uint64 `json:"weight_bytes"`
	SliceBytes  int64  `json:"slice_bytes"`   // the slice file on disk
	Fetched     uint64 `json:"fetched_bytes"` // read from peers or the hub to make the slice, by this run of the node
}

// Event is something that happened: a join, a leave, a plan, an error.
type Event struct {
	Time time.Time `json:"time"`
	Kind string    `json:"kind"`
	Text string    `json:"text"`
}

// Events is the body of GET /api/events.
type Events struct {
	Schema string  `json:"schema"`
	Events []Event `json:"events"`
}

// ShortID is the tail of a peer ID, enough to tell nodes of a mesh apart.
func ShortID(id string) string {
	if len(id) > 12 {
		return id[len(id)-6:]
	}
	return id
}

// NodeByID finds a node by its peer ID, or by a suffix of it of at least 4
// characters (the short ID).
func (s *Status) NodeByID(id string) (*Node, bool) {
	for i := range s.Nodes {
		if s.Nodes[i].PeerID == id {
			return &s.Nodes[i], true
		}
	}
	if len(id) < 4 {
		return nil, false
	}
	var found *Node
	for i := range s.Nodes {
		p := s.Nodes[i].PeerID
		if len(p) >= len(id) && p[len(p)-len(id):] == id {
			if found != nil {
				return nil, false // ambiguous
			}
			found = &s.Nodes[i]
		}
	}
	return found, found != nil
}

// CanServe reports whether the mesh, as this status shows it, can serve its
// model: the answering node is ready and the plan covers every layer.
func (s *Status) CanServe() bool {
	if !s.Ready || s.Model == nil || len(s.Plan) == 0 {
		return false
	}
	next := 0
	for _, st := range s.Plan {
		if st.Start != next {
			return false
		}
		next = st.End
	}
	return next == s.Model.Layers
}
