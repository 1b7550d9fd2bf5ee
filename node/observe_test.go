package node_test

import (
	"encoding/json"
	"io"
	"net/http"
	"strings"
	"testing"

	dto "github.com/prometheus/client_model/go"
	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/meshnode/meshnode/node/admin"
)

// scrape reads the node's /metrics with Prometheus's own text parser.
func scrape(t *testing.T) map[string]*dto.MetricFamily {
	t.Helper()
	resp, err := http.Get(base + "/metrics")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != 200 {
		t.Fatalf("/metrics: %s", resp.Status)
	}
	p := expfmt.NewTextParser(model.LegacyValidation)
	fams, err := p.TextToMetricFamilies(resp.Body)
	if err != nil {
		t.Fatalf("/metrics does not parse: %v", err)
	}
	return fams
}

// metric is the value of a counter or gauge (the sample count of a
// histogram), summed over the series whose labels include want.
func metric(fams map[string]*dto.MetricFamily, name string, want ...string) float64 {
	f := fams[name]
	if f == nil {
		return 0
	}
	var sum float64
next:
	for _, m := range f.Metric {
		for i := 0; i+1 < len(want); i += 2 {
			found := false
			for _, l := range m.Label {
				found = found || (l.GetName() == want[i] && l.GetValue() == want[i+1])
			}
			if !found {
				continue next
			}
		}
		switch {
		case m.Counter != nil:
			sum += m.Counter.GetValue()
		case m.Gauge != nil:
			sum += m.Gauge.GetValue()
		case m.Histogram != nil:
			sum += float64(m.Histogram.GetSampleCount())
		}
	}
	return sum
}

// TestMetricsMove serves requests and checks that /metrics parses and its
// counters move by what was served.
func TestMetricsMove(t *testing.T) {
	before := scrape(t)
	if metric(before, "meshnode_ready") != 1 || metric(before, "meshnode_pipeline_stages") != 1 {
		t.Fatalf("ready %v, stages %v", metric(before, "meshnode_ready"), metric(before, "meshnode_pipeline_stages"))
	}
	const n = 3
	completion := 0
	for range n {
		res, err := generate(t.Context(), "/v1/completions", map[string]any{
			"model": modelID, "prompt": "Once upon a time", "max_tokens": 16, "temperature": 0,
		})
		if err != nil {
			t.Fatal(err)
		}
		completion += res.usage.CompletionTokens
	}
	after := scrape(t)
	delta := func(name string, labels ...string) float64 {
		return metric(after, name, labels...) - metric(before, name, labels...)
	}
	if d := delta("meshnode_requests_total", "outcome", "ok"); d != n {
		t.Errorf("requests_total{outcome=ok} moved by %v, want %d", d, n)
	}
	// Generated tokens count the sampled EOS too, which usage leaves out.
	if d := delta("meshnode_generated_tokens_total"); d < float64(completion) || d > float64(completion+n) {
		t.Errorf("generated_tokens_total moved by %v for %d completion tokens", d, completion)
	}
	if d := delta("meshnode_prompt_tokens_total"); d <= 0 {
		t.Errorf("prompt_tokens_total moved by %v", d)
	}
	for _, h := range []string{"meshnode_time_to_first_token_seconds", "meshnode_request_duration_seconds", "meshnode_prefill_tokens_per_second"} {
		if d := delta(h); d != n {
			t.Errorf("%s observed %v more times, want %d", h, d, n)
		}
	}
	if d := delta("meshnode_pipeline_step_seconds"); d < float64(completion) {
		t.Errorf("pipeline_step_seconds observed %v more times for %d tokens", d, completion)
	}
	if d := delta("meshnode_stage_compute_seconds"); d < float64(completion) {
		t.Errorf("stage_compute_seconds observed %v more times for %d tokens", d, completion)
	}
	// The engine's phases are parts of the stage's passes: each moved, and
	// together they are no more than the passes took.
	var phases float64
	for _, phase := range []string{"graph", "launch", "wait"} {
		d := delta("meshnode_stage_phase_seconds_total", "phase", phase)
		if d <= 0 {
			t.Errorf("stage_phase_seconds_total{phase=%s} moved by %v", phase, d)
		}
		phases += d
	}
	computeSum := func(fams map[string]*dto.MetricFamily) (s float64) {
		for _, m := range fams["meshnode_stage_compute_seconds"].GetMetric() {
			s += m.GetHistogram().GetSampleSum()
		}
		return s
	}
	if total := computeSum(after) - computeSum(before); phases > total {
		t.Errorf("phases add up to %.6f s, more than the %.6f s the stage's passes took", phases, total)
	}
	if metric(after, "meshnode_kv_cache_capacity_tokens") != ctxLen*parallel {
		t.Errorf("KV capacity %v, want %d", metric(after, "meshnode_kv_cache_capacity_tokens"), ctxLen*parallel)
	}
	if metric(after, "meshnode_memory_bytes", "kind", "weights") <= 0 {
		t.Error("no weight memory")
	}
	if metric(after, "meshnode_mesh_members", "state", "ready") != 1 {
		t.Errorf("ready members %v", metric(after, "meshnode_mesh_members", "state", "ready"))
	}

	if d := delta("meshnode_http_requests_total", "endpoint", "/v1/completions", "code", "200"); d != n {
		t.Errorf("http_requests_total{endpoint=/v1/completions,code=200} moved by %v, want %d", d, n)
	}

	// A refused request counts too, by its status.
	big := strings.Repeat("once upon a time ", ctxLen)
	if _, err := generate(t.Context(), "/v1/completions", map[string]any{"model": modelID, "prompt": big, "max_tokens": 4}); err == nil {
		t.Fatal("a prompt longer than the context was accepted")
	}
	last := scrape(t)
	if d := metric(last, "meshnode_http_requests_total", "code", "400") - metric(after, "meshnode_http_requests_total", "code", "400"); d != 1 {
		t.Errorf("http_requests_total{code=400} moved by %v", d)
	}
}

// TestAdminAPI checks the status of a one-node mesh and the dashboard route.
func TestAdminAPI(t *testing.T) {
	resp, err := http.Get(base + "/api/status")
	if err != nil {
		t.Fatal(err)
	}
	var st admin.Status
	json.NewDecoder(resp.Body).Decode(&st)
	resp.Body.Close()
	if st.Schema != admin.SchemaVersion || !st.CanServe() || len(st.Nodes) != 1 || !st.Nodes[0].Self {
		t.Fatalf("status: %+v", st)
	}
	n := st.Nodes[0]
	if n.State != admin.StateReady || n.Stats == nil || n.Stats.Stage == nil || n.MemUsed == 0 || n.HTTP == "" {
		t.Errorf("node: %+v stats %+v", n, n.Stats)
	}
	if len(st.Hops) != 2 || st.Hops[0].From != st.Self || st.Hops[0].RTTMs == nil || *st.Hops[0].RTTMs != 0 {
		t.Errorf("hops of a one-node mesh: %+v", st.Hops)
	}

	resp, err = http.Get(base + "/api/nodes/" + n.ShortID)
	if err != nil {
		t.Fatal(err)
	}
	var one admin.Node
	json.NewDecoder(resp.Body).Decode(&one)
	resp.Body.Close()
	if one.PeerID != n.PeerID {
		t.Errorf("/api/nodes/%s: %+v", n.ShortID, one)
	}

	// A browser gets the dashboard at "/"; API clients keep the JSON 404.
	req, _ := http.NewRequest("GET", base+"/", nil)
	req.Header.Set("Accept", "text/html,application/xhtml+xml,application/xml;q=0.9,*/*;q=0.8")
	resp, err = http.DefaultClient.Do(req)
	if err != nil {
		t.Fatal(err)
	}
	page, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 200 || !strings.Contains(string(page), "<title>meshnode</title>") {
		t.Errorf("dashboard: %s", resp.Status)
	}
	resp, err = http.Get(base + "/")
	if err != nil {
		t.Fatal(err)
	}
	body, _ := io.ReadAll(resp.Body)
	resp.Body.Close()
	if resp.StatusCode != 404 || !strings.Contains(string(body), `"unknown_url"`) {
		t.Errorf("GET / as an API client: %s %s", resp.Status, body)
	}
}
