package admin

import (
	"bytes"
	"encoding/json"
	"net/http"
	"net/http/httptest"
	"strings"
	"testing"
	"time"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"
)

func TestWindow(t *testing.T) {
	now := time.Unix(1000, 0)
	w := NewWindow(10 * time.Second)
	w.now = func() time.Time { return now }
	w.started = now.Add(-time.Hour)
	if w.Rate() != 0 || w.Mean() != 0 {
		t.Fatalf("empty window: rate %v mean %v", w.Rate(), w.Mean())
	}
	for i := range 10 {
		now = time.Unix(1000+int64(i), 0)
		w.Add(100)
		w.Add(50)
	}
	// 10 seconds of 150 each, seen at the start of the last one: the window
	// covers 9 seconds.
	if r := w.Rate(); r < 150*10/9.0-1 || r > 150*10/9.0+1 {
		t.Errorf("rate %v, want about %v", r, 150*10/9.0)
	}
	if m := w.Mean(); m != 75 {
		t.Errorf("mean %v, want 75", m)
	}
	now = now.Add(30 * time.Second)
	if w.Rate() != 0 || w.Mean() != 0 {
		t.Errorf("old samples still count: rate %v mean %v", w.Rate(), w.Mean())
	}
	// A young window divides by its age, not its span.
	y := NewWindow(10 * time.Second)
	y.Add(10)
	if r := y.Rate(); r != 10 {
		t.Errorf("young window rate %v, want 10 (one second at least)", r)
	}
}

func sampleStatus() Status {
	rtt := 0.25
	return Status{
		Schema: SchemaVersion, Self: "12D3KooWAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAaaaaaa",
		Model: &Model{ID: "abc", Name: "m", Arch: "llama", Layers: 8}, Ready: true,
		Plan: []Stage{{Node: "12D3KooWAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAaaaaaa", Start: 0, End: 4},
			{Node: "12D3KooWBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBbbbbbb", Start: 4, End: 8}},
		Hops: []Hop{},
		Nodes: []Node{
			{PeerID: "12D3KooWAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAAaaaaaa", ShortID: "aaaaaa", Self: true, State: StateReady},
			{PeerID: "12D3KooWBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBBbbbbbb", ShortID: "bbbbbb", State: StateReady, RTTMs: &rtt},
			{PeerID: "12D3KooWCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCCbbbbbb", ShortID: "bbbbbb", State: StateDead},
		},
		Events: []Event{
			{Time: time.Unix(100, 0).UTC(), Kind: "join", Text: "a"},
			{Time: time.Unix(200, 0).UTC(), Kind: "plan", Text: "b"},
		},
	}
}

func TestCanServe(t *testing.T) {
	st := sampleStatus()
	if !st.CanServe() {
		t.Fatal("a complete ready plan cannot serve")
	}
	for name, f := range map[string]func(*Status){
		"not ready": func(s *Status) { s.Ready = false },
		"no plan":   func(s *Status) { s.Plan = nil },
		"no model":  func(s *Status) { s.Model = nil },
		"gap":       func(s *Status) { s.Plan[1].Start = 5 },
		"short":     func(s *Status) { s.Plan = s.Plan[:1] },
	} {
		s := sampleStatus()
		f(&s)
		if s.CanServe() {
			t.Errorf("%s: CanServe", name)
		}
	}
}

func TestNodeByID(t *testing.T) {
	st := sampleStatus()
	if n, ok := st.NodeByID(st.Nodes[1].PeerID); !ok || n.PeerID != st.Nodes[1].PeerID {
		t.Errorf("full ID: %v %v", n, ok)
	}
	if n, ok := st.NodeByID("aaaaaa"); !ok || !n.Self {
		t.Errorf("short ID: %v %v", n, ok)
	}
	if _, ok := st.NodeByID("bbbbbb"); ok {
		t.Error("an ambiguous suffix matched")
	}
	if _, ok := st.NodeByID("aa"); ok {
		t.Error("a 2-character suffix matched")
	}
}

func TestHandler(t *testing.T) {
	h := New(Config{Status: sampleStatus, Stats: func() NodeStats { return NodeStats{QueueDepth: 3} }})
	get := func(path string) *httptest.ResponseRecorder {
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, httptest.NewRequest(http.MethodGet, path, nil))
		return rec
	}
	rec := get("/api/status")
	var st Status
	if err := json.Unmarshal(rec.Body.Bytes(), &st); err != nil || rec.Code != 200 || st.Schema != SchemaVersion {
		t.Fatalf("/api/status: %d %v %q", rec.Code, err, rec.Body.String())
	}

	rec = get("/api/events?since=" + time.Unix(150, 0).UTC().Format(time.RFC3339))
	var evs Events
	json.Unmarshal(rec.Body.Bytes(), &evs)
	if len(evs.Events) != 1 || evs.Events[0].Kind != "plan" {
		t.Errorf("events since: %+v", evs)
	}
	rec = get("/api/events?kind=join")
	json.Unmarshal(rec.Body.Bytes(), &evs)
	if len(evs.Events) != 1 || evs.Events[0].Kind != "join" {
		t.Errorf("events of a kind: %+v", evs)
	}
	if rec := get("/api/events?since=yesterday"); rec.Code != 400 {
		t.Errorf("bad since: %d", rec.Code)
	}

	rec = get("/api/nodes/aaaaaa")
	var n Node
	if json.Unmarshal(rec.Body.Bytes(), &n); rec.Code != 200 || !n.Self {
		t.Errorf("/api/nodes/aaaaaa: %d %s", rec.Code, rec.Body)
	}
	if rec := get("/api/nodes/zzzzzz"); rec.Code != 404 {
		t.Errorf("unknown node: %d", rec.Code)
	}
	rec = get("/api/nodes")
	var nodes struct{ Nodes []Node }
	if json.Unmarshal(rec.Body.Bytes(), &nodes); len(nodes.Nodes) != 3 {
		t.Errorf("/api/nodes: %s", rec.Body)
	}
	rec = get("/api/metrics")
	var ns NodeStats
	if json.Unmarshal(rec.Body.Bytes(), &ns); ns.QueueDepth != 3 {
		t.Errorf("/api/metrics: %s", rec.Body)
	}
	if rec := get("/api/nope"); rec.Code != 404 || !strings.Contains(rec.Body.String(), `"error"`) {
		t.Errorf("unknown endpoint: %d %s", rec.Code, rec.Body)
	}
	rec = httptest.NewRecorder()
	h.ServeHTTP(rec, httptest.NewRequest(http.MethodPost, "/api/status", nil))
	if rec.Code != http.StatusMethodNotAllowed {
		t.Errorf("POST: %d", rec.Code)
	}
}

func TestRoot(t *testing.T) {
	api := http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) { w.WriteHeader(http.StatusTeapot) })
	h := Root(api)
	for _, c := range []struct {
		method, path, accept string
		dashboard            bool
	}{
		{"GET", "/", "text/html,application/xhtml+xml,*/*;q=0.8", true},
		{"HEAD", "/", "text/html", true},
		{"GET", "/", "", false},
		{"GET", "/", "application/json", false},
		{"GET", "/v1/models", "text/html", false},
		{"POST", "/", "text/html", false},
	} {
		req := httptest.NewRequest(c.method, c.path, nil)
		if c.accept != "" {
			req.Header.Set("Accept", c.accept)
		}
		rec := httptest.NewRecorder()
		h.ServeHTTP(rec, req)
		got := rec.Code == 200 && strings.HasPrefix(rec.Header().Get("Content-Type"), "text/html")
		if got != c.dashboard {
			t.Errorf("%s %s Accept %q: status %d, dashboard %v, want %v", c.method, c.path, c.accept, rec.Code, got, c.dashboard)
		}
		if c.dashboard && c.method == "GET" && !bytes.Contains(rec.Body.Bytes(), []byte("/api/status")) {
			t.Error("the dashboard does not poll /api/status")
		}
	}
}

// TestMetrics checks that the registry's output parses with Prometheus's
// own text parser and that every documented family is there.
func TestMetrics(t *testing.T) {
	m := NewMetrics(func() Gauges {
		return Gauges{Peer: "p", Ready: true, QueueDepth: 2, GeneratedTokens: 42, Members: map[string]int{StateReady: 3}}
	})
	m.Request(OutcomeOK, 10, 20, 50*time.Millisecond, time.Second)
	m.Request(OutcomeError, 10, 0, 0, time.Second)
	m.Rejected("overloaded")
	m.Event("plan")
	m.Replan()
	m.Step(time.Millisecond)
	m.StageForward("0-4", time.Millisecond, 8, 2)
	m.StagePhases("0-4", 1, 1, 200*time.Microsecond, 50*time.Microsecond, 300*time.Microsecond, 400*time.Microsecond)
	m.PeerRTT("q", 200*time.Microsecond)
	m.HopBytes("q", "sent", 4096)
	m.LocalStream("q")
	m.StageHandoff("0-4", "out")

	rec := httptest.NewRecorder()
	m.Handler().ServeHTTP(rec, httptest.NewRequest("GET", "/metrics", nil))
	parser := expfmt.NewTextParser(model.LegacyValidation)
	fams, err := parser.TextToMetricFamilies(rec.Body)
	if err != nil {
		t.Fatalf("parsing /metrics: %v", err)
	}
	for _, name := range []string{
		"meshnode_requests_total", "meshnode_errors_total", "meshnode_events_total", "meshnode_replans_total",
		"meshnode_time_to_first_token_seconds", "meshnode_request_duration_seconds", "meshnode_prefill_tokens_per_second",
		"meshnode_decode_tokens_per_second", "meshnode_pipeline_step_seconds", "meshnode_stage_compute_seconds",
		"meshnode_stage_phase_seconds_total", "meshnode_stage_passes_built_ahead_total", "meshnode_stage_passes_allocated_ahead_total", "meshnode_stage_tokens_total", "meshnode_hop_rtt_seconds", "meshnode_hop_bytes_total", "meshnode_local_stage_streams_total", "meshnode_stage_handoffs_total", "meshnode_queue_depth",
		"meshnode_active_sequences", "meshnode_prompt_tokens_total", "meshnode_generated_tokens_total",
		"meshnode_kv_cache_tokens", "meshnode_kv_cache_capacity_tokens", "meshnode_kv_cache_used_bytes",
		"meshnode_memory_bytes", "meshnode_mesh_members", "meshnode_ready", "meshnode_pipeline_stages",
		"meshnode_loading_percent", "meshnode_node_info", "go_goroutines",
	} {
		if fams[name] == nil {
			t.Errorf("no %s", name)
		}
	}
	if v := value(fams, "meshnode_requests_total", "outcome", "ok"); v != 1 {
		t.Errorf("requests ok = %v", v)
	}
	if v := value(fams, "meshnode_errors_total", "kind", "generation"); v != 1 {
		t.Errorf("generation errors = %v", v)
	}
	if v := value(fams, "meshnode_errors_total", "kind", "overloaded"); v != 1 {
		t.Errorf("overloaded errors = %v", v)
	}
	if v := value(fams, "meshnode_stage_handoffs_total", "direction", "out"); v != 1 {
		t.Errorf("hand-offs out = %v", v)
	}
	if v := value(fams, "meshnode_generated_tokens_total", "", ""); v != 42 {
		t.Errorf("generated tokens = %v", v)
	}
	if v := value(fams, "meshnode_mesh_members", "state", "ready"); v != 3 {
		t.Errorf("ready members = %v", v)
	}
	if h := fams["meshnode_time_to_first_token_seconds"].Metric[0].Histogram; h.GetSampleCount() != 1 {
		t.Errorf("TTFT observed %d times, want 1 (the failed request has no first token)", h.GetSampleCount())
	}
}

// value reads a counter or gauge, optionally the one with a label value.
func value(fams map[string]*dto.MetricFamily, name, label, want string) float64 {
	f := fams[name]
	if f == nil {
		return -1
	}
	for _, m := range f.Metric {
		ok := label == ""
		for _, l := range m.Label {
			ok = ok || (l.GetName() == label && l.GetValue() == want)
		}
		if !ok {
			continue
		}
		switch {
		case m.Counter != nil:
			return m.Counter.GetValue()
		case m.Gauge != nil:
			return m.Gauge.GetValue()
		}
	}
	return -1
}
