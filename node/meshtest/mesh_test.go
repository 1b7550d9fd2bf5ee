package meshtest

import (
	"context"
	"encoding/json"
	"io"
	"io/fs"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"testing"
	"time"

	"github.com/meshnode/meshnode/ggufstage/gguf"
	"github.com/meshnode/meshnode/node/sample"
)

// TestSplitMesh: three processes, `serve --split` with the model file on
// node 1 only and two joiners that fetch their slices from it, serve the
// model as three stages; a greedy completion through each of the three
// entry nodes is token for token the unsplit reference, for stories260K
// (llama, 5 layers) and a random qwen3 (3 layers, tied head), with
// activations crossing the wire in f32 and in f16. Then each node's
// /api/status shows what it holds: exactly its stage's tensors, and for
// the joiners exactly those bytes fetched, not the model.
func TestSplitMesh(t *testing.T) {
	for _, model := range []*testModel{stories, qwen3} {
		for _, wire := range []string{"f32", "f16"} {
			t.Run(model.id+"/"+wire, func(t *testing.T) {
				m := startMesh(t, model, 3, wire)
				for _, n := range m.nodes {
					checkGreedy(t, n, model)
					checkHealth(t, n)
				}
				m.checkHoldings(t)
				// One machine, one network namespace: stages reach each
				// other over their local sockets.
				if n := localStreams(t, m.nodes); n == 0 {
					t.Error("no stage stream went over a local socket")
				}
				if model == stories && wire == "f32" {
					checkJSONAndLogprobs(t, m.nodes)
					checkChoices(t, m.nodes[len(m.nodes)-1])
				}
			})
		}
	}
	// Without local sockets every hop goes over libp2p, as between
	// machines.
	t.Run(stories.id+"/f32/local-hops=off", func(t *testing.T) {
		m := startMesh(t, stories, 3, "f32", "--local-hops=off")
		for _, n := range m.nodes {
			checkGreedy(t, n, stories)
		}
		if n := localStreams(t, m.nodes); n != 0 {
			t.Errorf("%v stage streams went over local sockets", n)
		}
	})
	// Stages on a GPU build each decode step's graph while the one before
	// computes; CI has no GPU, so the mesh does it on the CPU here.
	t.Run(stories.id+"/f32/build-ahead", func(t *testing.T) {
		m := startMesh(t, stories, 3, "f32", "--build-ahead=on")
		for _, n := range m.nodes {
			checkGreedy(t, n, stories)
		}
		for _, n := range m.nodes {
			if v, err := metricValue(n, "meshnode_stage_passes_built_ahead_total"); err != nil || v == 0 {
				t.Errorf("%s: passes built ahead %v (%v), want some", n.name, v, err)
			}
		}
	})
}

// localStreams is how many stage streams the nodes opened over local
// sockets.
func localStreams(t *testing.T, nodes []*meshNode) float64 {
	t.Helper()
	sum := 0.0
	for _, n := range nodes {
		v, err := metricValue(n, "meshnode_local_stage_streams_total")
		if err != nil && !strings.Contains(err.Error(), "has no") {
			t.Fatal(err)
		}
		sum += v
	}
	return sum
}

// checkJSONAndLogprobs: a greedy chat reply with response_format
// json_object and logprobs, through every node of a split mesh (whose last
// stage, another process, masks and measures the tokens), is a JSON
// object's prefix, the same through every node, and its listed tokens
// spell it.
func checkJSONAndLogprobs(t *testing.T, nodes []*meshNode) {
	t.Helper()
	body, _ := json.Marshal(map[string]any{
		"model": stories.id, "max_tokens": 40, "temperature": 0, "logprobs": true, "top_logprobs": 2,
		"response_format": map[string]string{"type": "json_object"},
		"messages":        []map[string]string{{"role": "user", "content": "A cat, as JSON."}},
	})
	var first string
	for _, n := range nodes {
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		resp, err := n.request(ctx, http.MethodPost, "/v1/chat/completions", body)
		if err != nil {
			cancel()
			t.Fatalf("%s: %v", n.name, err)
		}
		data, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		cancel()
		var r struct {
			Choices []struct {
				Message struct {
					Content string `json:"content"`
				} `json:"message"`
				Logprobs struct {
					Content []struct {
						Token   string  `json:"token"`
						Logprob float64 `json:"logprob"`
					} `json:"content"`
				} `json:"logprobs"`
			} `json:"choices"`
		}
		if resp.StatusCode != http.StatusOK || json.Unmarshal(data, &r) != nil || len(r.Choices) != 1 {
			t.Fatalf("%s: %s: %s", n.name, resp.Status, data)
		}
		content := r.Choices[0].Message.Content
		var spelled strings.Builder
		for _, lp := range r.Choices[0].Logprobs.Content {
			spelled.WriteString(lp.Token)
			if lp.Logprob > 0 {
				t.Errorf("%s: token %q has log-probability %v", n.name, lp.Token, lp.Logprob)
			}
		}
		if j := sample.NewJSON(); !strings.HasPrefix(content, "{") || !j.Feed([]byte(content)) {
			t.Errorf("%s: %q is not a JSON object's prefix", n.name, content)
		}
		if spelled.String() != content {
			t.Errorf("%s: the listed tokens spell %q, the reply is %q", n.name, spelled.String(), content)
		}
		if first == "" {
			first = content
		} else if content != first {
			t.Errorf("%s: %q, through %s %q", n.name, content, nodes[0].name, first)
		}
	}
}

// checkChoices: n sampled choices through a split mesh, batched together,
// are each what a request of its own seeded seed+i gives.
func checkChoices(t *testing.T, n *meshNode) {
	t.Helper()
	texts := func(choices int, seed int) []string {
		body, _ := json.Marshal(map[string]any{"model": stories.id, "prompt": "Once upon a time", "max_tokens": 24,
			"temperature": 1, "seed": seed, "n": choices})
		ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
		defer cancel()
		resp, err := n.request(ctx, http.MethodPost, "/v1/completions", body)
		if err != nil {
			t.Fatalf("%s: %v", n.name, err)
		}
		data, _ := io.ReadAll(resp.Body)
		resp.Body.Close()
		var r struct {
			Choices []struct {
				Text  string `json:"text"`
				Index int    `json:"index"`
			} `json:"choices"`
		}
		if resp.StatusCode != http.StatusOK || json.Unmarshal(data, &r) != nil || len(r.Choices) != choices {
			t.Fatalf("%s: %s: %s", n.name, resp.Status, data)
		}
		out := make([]string, choices)
		for _, c := range r.Choices {
			out[c.Index] = c.Text
		}
		return out
	}
	all := texts(3, 70)
	for i, text := range all {
		if alone := texts(1, 70+i)[0]; text != alone {
			t.Errorf("%s: choice %d %q, alone with seed %d %q", n.name, i, text, 70+i, alone)
		}
	}
}

// checkHealth: a node with a complete pipeline says so on /health.
func checkHealth(t *testing.T, n *meshNode) {
	t.Helper()
	resp, err := n.request(context.Background(), http.MethodGet, "/health", nil)
	if err != nil {
		t.Errorf("%s /health: %v", n.name, err)
		return
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Errorf("%s /health: %s", n.name, resp.Status)
	}
}

// checkHoldings checks each node's share of the model against the GGUF.
func (m *testMesh) checkHoldings(t *testing.T) {
	t.Helper()
	sts := waitSettled(t, m.model, m.nodes, 10*time.Second)
	// settled checked that the plan has one stage per node covering
	// [0,layers) and that every node sees the same plan.
	for i, n := range m.nodes {
		st := sts[i]
		want, _ := st.stageOf(n.peer)
		if st.Local == nil || st.Local.Start != want.Start || st.Local.End != want.End {
			t.Errorf("%s: local %+v, want layers [%d,%d)", n.name, st.Local, want.Start, want.End)
			continue
		}
		parts := m.model.stageParts(t, want.Start, want.End)
		partBytes := gguf.PartsSize(parts)
		t.Logf("%s [%d,%d): %d tensor bytes in the file; loaded %d, slice %d, fetched %d",
			n.name, want.Start, want.End, partBytes, st.Local.WeightBytes, st.Local.SliceBytes, st.Local.Fetched)
		// The engine reports what it loaded; ggml's per-tensor padding
		// and a tied head are the only reasons it may differ.
		if w := float64(st.Local.WeightBytes); w < 0.9*float64(partBytes) || w > 1.1*float64(partBytes) {
			t.Errorf("%s [%d,%d): %d weight bytes, want %d ± 10%%", n.name, want.Start, want.End, st.Local.WeightBytes, partBytes)
		}
		if st.Local.SliceBytes < int64(partBytes) {
			t.Errorf("%s: slice of %d bytes cannot hold its %d tensor bytes", n.name, st.Local.SliceBytes, partBytes)
		}
		if i == 0 {
			// Node 1 slices its own file: nothing comes over the network.
			if st.Local.Fetched != 0 {
				t.Errorf("%s holds the file but fetched %d bytes", n.name, st.Local.Fetched)
			}
			continue
		}
		// A joiner reads its tensors and the file's header (metadata
		// and tensor index) from node 1, nothing else. The header of
		// either model is far below 512 KiB.
		const headerAllowance = 512 << 10
		switch f := st.Local.Fetched; {
		case f < partBytes:
			t.Errorf("%s [%d,%d): fetched %d bytes, less than its %d tensor bytes", n.name, want.Start, want.End, f, partBytes)
		case f > partBytes+headerAllowance:
			t.Errorf("%s [%d,%d): fetched %d bytes, over its %d tensor bytes + %d", n.name, want.Start, want.End, f, partBytes, headerAllowance)
		case f >= uint64(m.model.size):
			t.Errorf("%s [%d,%d): fetched %d bytes, as much as the %d-byte model", n.name, want.Start, want.End, f, m.model.size)
		}
		checkNoModelCopy(t, n, m.model)
	}
}

// checkNoModelCopy: a joiner's data dir holds keys, the model's header
// (metadata, no tensors) and slices of the model, and no copy of it.
func checkNoModelCopy(t *testing.T, n *meshNode, model *testModel) {
	t.Helper()
	err := filepath.WalkDir(n.dataDir, func(path string, d fs.DirEntry, err error) error {
		if err != nil || d.IsDir() {
			return err
		}
		rel, _ := filepath.Rel(n.dataDir, path)
		info, err := d.Info()
		if err != nil {
			return err
		}
		g, gerr := readGGUF(path)
		switch dir := filepath.Dir(rel); {
		case dir == "slices":
			if gerr != nil {
				t.Errorf("%s: %s is not a GGUF: %v", n.name, rel, gerr)
				return nil
			}
			start, ok1 := g.Get(gguf.KeySliceStart)
			end, ok2 := g.Get(gguf.KeySliceEnd)
			s, _ := start.Uint()
			e, _ := end.Uint()
			if !ok1 || !ok2 {
				t.Errorf("%s: %s has no slice range", n.name, rel)
				return nil
			}
			if want := len(model.stageParts(t, int(s), int(e))); len(g.Tensors) != want || want >= len(model.file.Tensors) {
				t.Errorf("%s: slice %s [%d,%d) holds %d tensors, want %d of the model's %d", n.name, rel, s, e, len(g.Tensors), want, len(model.file.Tensors))
			}
		case gerr == nil:
			// The model's metadata, for the tokenizer: no tensors.
			if len(g.Tensors) != 0 {
				t.Errorf("%s: %s outside slices/ holds %d tensors", n.name, rel, len(g.Tensors))
			}
		case info.Size() > 64<<10:
			// Keys and small state only.
			t.Errorf("%s: unexpected %d-byte file %s", n.name, info.Size(), rel)
		}
		return nil
	})
	if err != nil {
		t.Errorf("%s: walking %s: %v", n.name, n.dataDir, err)
	}
}

func readGGUF(path string) (*gguf.File, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	return gguf.Read(f, st.Size())
}

// TestNodeLoss: a joiner killed while the mesh is idle (SIGKILL: no
// goodbye) is noticed through gossip; within about ten seconds the two
// survivors replan its layers among themselves and serve the reference
// again through node 1. A new joiner then takes a share: three stages
// again, the newcomer's among them, and every entry serves the reference.
func TestNodeLoss(t *testing.T) {
	m := startMesh(t, stories, 3, "f16")
	checkGreedy(t, m.nodes[0], stories)

	victim := m.nodes[2]
	victim.proc.kill()
	killed := time.Now()
	if !victim.proc.exited(10 * time.Second) {
		t.Fatal("the killed node did not exit")
	}
	survivors := m.nodes[:2]

	// Gossip declares a silent member dead after about 2 s (probe every
	// 0.5 s, suspicion 4 probes); 10 s leaves room for a loaded machine.
	deadline := killed.Add(10 * time.Second)
	for _, n := range survivors {
		for {
			st, err := n.status(context.Background())
			if err == nil {
				if _, has := st.stageOf(victim.peer); !has && len(st.Plan) == 2 {
					break
				}
			}
			if time.Now().After(deadline) {
				t.Fatalf("%s still plans %s %s after the kill (%v)", n.name, describePlan(st.Plan), short(victim.peer), err)
			}
			time.Sleep(100 * time.Millisecond)
		}
	}
	replanned := time.Since(killed)
	// The plan is made; loading the extra layers and rebuilding the
	// pipeline is quick, the slices are small.
	waitSettled(t, stories, survivors, 10*time.Second)
	t.Logf("replanned %s after the kill, serving after %s", replanned.Round(time.Millisecond), time.Since(killed).Round(time.Millisecond))
	checkGreedy(t, m.nodes[0], stories)
	checkGreedy(t, m.nodes[1], stories)

	newcomer := m.startJoiner(t, "node4")
	m.waitReady(t, newcomer)
	nodes := []*meshNode{m.nodes[0], m.nodes[1], newcomer}
	sts := waitSettled(t, stories, nodes, formTimeout)
	if s, _ := sts[0].stageOf(newcomer.peer); s.End <= s.Start {
		t.Errorf("the newcomer has no layers in %s", describePlan(sts[0].Plan))
	}
	// The dead node may be remembered, but only as gone.
	for _, st := range sts {
		for _, nd := range st.Nodes {
			if nd.PeerID == victim.peer && nd.State != "dead" {
				t.Errorf("%s lists the killed node as %q", short(st.Self), nd.State)
			}
		}
	}
	for _, n := range nodes {
		checkGreedy(t, n, stories)
	}
	if t.Failed() {
		return
	}
	// The newcomer's slice came from node 1 like any joiner's.
	if st := sts[2]; st.Local == nil || st.Local.Fetched == 0 || !strings.Contains(newcomer.proc.output(), "fetched layers") {
		t.Errorf("the newcomer did not fetch its layers: %+v", st.Local)
	}
}
