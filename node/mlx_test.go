package node_test

// Serving a safetensors directory: the node runs it on the mlx engine,
// here through the test hook (node.EmulateMLX: the MLX binding's logic on
// a pure-Go emulation of mlx-c), and the planner gives its layers only to
// nodes that offer that engine.

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"maps"
	"net/http"
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/meshnode/meshnode/ggufstage/synth"
	"github.com/meshnode/meshnode/mlxstage"
	"github.com/meshnode/meshnode/mlxstage/hftok"
	"github.com/meshnode/meshnode/mlxstage/safetensors"
	"github.com/meshnode/meshnode/mlxstage/synthst"
	"github.com/meshnode/meshnode/node"
	"github.com/meshnode/meshnode/node/sse"
	"github.com/meshnode/meshnode/stage"
	"github.com/meshnode/meshnode/stage/stagetest"
)

// hfModelPath is stories260K's Hugging Face twin: the same weights as
// modelPath, as config.json, model.safetensors and tokenizer.json.
const (
	hfModelPath = "../../shared/models/stories260K-hf"
	hfModelID   = "stories260K-hf"
)

// hfDir is the shared stories260K-hf directory, as an absolute path.
func hfDir(t *testing.T) string {
	t.Helper()
	dir, err := filepath.Abs(hfModelPath)
	if err != nil {
		t.Fatal(err)
	}
	return dir
}

// meshNode is a node a test started with node.Run.
type meshNode struct {
	url  string // http://ADDR
	join string // the command that adds a machine to its mesh
}

// startNode runs a node on loopback until the test ends (then checks that
// Run returned nil) and returns once it serves: its mesh has a pipeline.
func startNode(t *testing.T, cfg node.Config) meshNode {
	t.Helper()
	cfg.HTTPAddr, cfg.DataDir, cfg.Threads = "127.0.0.1:0", t.TempDir(), 1
	cfg.Context, cfg.Parallel = ctxLen, 2
	cfg.Listen, cfg.GossipPort = []string{"/ip4/127.0.0.1/tcp/0"}, -1
	joinCmd := make(chan string, 1)
	ready := make(chan string, 1)
	cfg.JoinCommand = func(cmd string) { joinCmd <- cmd }
	cfg.Ready = func(addr string) { ready <- addr }
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan error, 1)
	go func() { done <- node.Run(ctx, cfg) }()
	t.Cleanup(func() {
		cancel()
		select {
		case err := <-done:
			if err != nil {
				t.Errorf("node.Run: %v", err)
			}
		case <-time.After(15 * time.Second):
			t.Error("node.Run did not return within 15 s of cancellation")
		}
	})
	var n meshNode
	for n.url == "" || n.join == "" {
		select {
		case cmd := <-joinCmd:
			n.join = cmd
		case addr := <-ready:
			n.url = "http://" + addr
		case err := <-done:
			done <- err // for the cleanup
			t.Fatalf("node.Run: %v", err)
		case <-time.After(60 * time.Second):
			t.Fatal("the node did not serve within 60 s")
		}
	}
	return n
}

// joinTo sets cfg to join the mesh of n.
func joinTo(cfg node.Config, n meshNode) node.Config {
	f := strings.Fields(n.join) // meshnode join ADDR --mesh-key KEY
	cfg.Join, cfg.MeshKey = []string{f[2]}, f[4]
	return cfg
}

// complete asks url for a temperature-0 completion of prompt (a string or
// token ids), as one JSON answer or streamed.
func complete(t *testing.T, url, model string, prompt any, maxTokens int, stream bool) result {
	t.Helper()
	return generateAt(t, url, model, "/v1/completions", map[string]any{"prompt": prompt, "max_tokens": maxTokens, "stream": stream})
}

// generateAt sends req to path on url for model, at temperature 0 (and 32
// tokens unless req says), and returns the text (of a completion, a chat
// message, or the deltas of a stream), the finish reason and the usage.
func generateAt(t *testing.T, url, model, path string, req map[string]any) result {
	t.Helper()
	req = maps.Clone(req)
	req["model"], req["temperature"] = model, 0
	if req["max_tokens"] == nil {
		req["max_tokens"] = 32
	}
	stream, _ := req["stream"].(bool)
	if stream {
		req["stream_options"] = map[string]any{"include_usage": true}
	}
	body, _ := json.Marshal(req)
	resp, err := httpClient.Post(url+path, "application/json", strings.NewReader(string(body)))
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		b, _ := io.ReadAll(resp.Body)
		t.Fatalf("%s: status %d: %s", url, resp.StatusCode, b)
	}
	type chunk struct {
		Model   string `json:"model"`
		Choices []struct {
			Text    string `json:"text"`
			Message struct {
				Content string `json:"content"`
			} `json:"message"`
			Delta struct {
				Content string `json:"content"`
			} `json:"delta"`
			FinishReason *string `json:"finish_reason"`
		} `json:"choices"`
		Usage *usage `json:"usage"`
	}
	var r result
	add := func(c chunk) {
		if c.Model != model {
			t.Fatalf("%s answered for model %q, want %q", url, c.Model, model)
		}
		for _, ch := range c.Choices {
			r.text += ch.Text + ch.Message.Content + ch.Delta.Content
			if ch.FinishReason != nil {
				r.finish = *ch.FinishReason
			}
		}
		if c.Usage != nil {
			r.usage = c.Usage
		}
	}
	if !stream {
		var c chunk
		if err := json.NewDecoder(resp.Body).Decode(&c); err != nil {
			t.Fatal(err)
		}
		add(c)
		return r
	}
	err = sse.Each(resp.Body, func(data []byte) error {
		var c chunk
		if err := json.Unmarshal(data, &c); err != nil {
			return fmt.Errorf("event %q: %v", data, err)
		}
		r.chunks++
		add(c)
		return nil
	})
	if err != nil {
		t.Fatal(err)
	}
	return r
}

func sameUsage(a, b *usage) bool { return a != nil && b != nil && *a == *b }

// status reads a node's /api/status.
func status(t *testing.T, url string) node.Status {
	t.Helper()
	resp, err := httpClient.Get(url + "/api/status")
	if err != nil {
		t.Fatal(err)
	}
	defer resp.Body.Close()
	var st node.Status
	if err := json.NewDecoder(resp.Body).Decode(&st); err != nil {
		t.Fatal(err)
	}
	return st
}

// waitStatus polls url's status until ok says yes.
func waitStatus(t *testing.T, url, what string, ok func(node.Status) bool) node.Status {
	t.Helper()
	deadline := time.Now().Add(60 * time.Second)
	for {
		st := status(t, url)
		if ok(st) {
			return st
		}
		if time.Now().After(deadline) {
			t.Fatalf("%s: never %s; plan %+v, problem %q", url, what, st.Plan, st.Problem)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// engineOf is how the node with peer ID id announces its engine.
func engineOf(st node.Status, id string) string {
	for _, n := range st.Nodes {
		if n.PeerID == id {
			return n.Engine + "/" + n.Backend
		}
	}
	return "absent"
}

// ggufPrompts are the cases the safetensors node must answer as the GGUF
// node does. ollama's SentencePiece leaves out the "▁" that SentencePiece
// (and Hugging Face) put before a text, so the GGUF node gets the space
// that becomes it (see mlxstage.TestTokenizerMatchesGGUF): both then see
// the same tokens, which the prompt_tokens of their answers check.
func ggufPrompts(t *testing.T) []struct {
	name      string
	hf, gguf  any
	maxTokens int
	stream    bool
} {
	t.Helper()
	tok, err := hftok.Load(safetensors.Dir(hfModelPath), hftok.Options{})
	if err != nil {
		t.Fatal(err)
	}
	ids, err := tok.Encode("The little dog saw a big", true)
	if err != nil {
		t.Fatal(err)
	}
	// Greedy stories260K never says EOS within its context: every case
	// ends at max_tokens.
	return []struct {
		name      string
		hf, gguf  any
		maxTokens int
		stream    bool
	}{
		{name: "text", hf: storyPrompt, gguf: " " + storyPrompt, maxTokens: 64},
		{name: "text streamed", hf: "Lily and Tom", gguf: " Lily and Tom", maxTokens: 48, stream: true},
		{name: "token ids", hf: ids, gguf: ids, maxTokens: 64},
		{name: "long", hf: "One day", gguf: " One day", maxTokens: 200},
	}
}

// TestSafetensorsMatchesGGUF serves stories260K-hf on the mlx engine
// through node.Run and checks that greedy completions over HTTP are those
// of a GGUF node, token for token. Both keep an f32 KV cache: with ggml's
// default f16 cache the 200-token case meets a near tie after 79 tokens.
func TestSafetensorsMatchesGGUF(t *testing.T) {
	hf := startNode(t, node.EmulateMLX(node.Config{Model: hfDir(t)}))
	gg := startNode(t, node.KVF32(node.Config{Model: modelPath}))
	st := status(t, hf.url)
	if st.Model == nil || st.Model.Name != hfModelID || st.Model.Layers != 5 || st.Model.Arch != "llama" {
		t.Fatalf("status model %+v", st.Model)
	}
	if e := engineOf(st, st.Self); e != "mlx/emulated" {
		t.Errorf("the node announces engine %s, want mlx/emulated", e)
	}
	if len(st.Plan) != 1 || st.Local == nil || st.Local.WeightBytes == 0 {
		t.Errorf("plan %+v, local stage %+v: want the whole model on the node", st.Plan, st.Local)
	}
	for _, c := range ggufPrompts(t) {
		t.Run(c.name, func(t *testing.T) {
			got := complete(t, hf.url, hfModelID, c.hf, c.maxTokens, c.stream)
			want := complete(t, gg.url, modelID, c.gguf, c.maxTokens, c.stream)
			if got.text != want.text || got.finish != want.finish {
				t.Errorf("safetensors node:\n got %q (%s)\nGGUF node:\nwant %q (%s)", got.text, got.finish, want.text, want.finish)
			}
			if !sameUsage(got.usage, want.usage) {
				t.Errorf("usage %+v, GGUF node's %+v", got.usage, want.usage)
			}
			if want.text == "" || want.finish != "length" || want.usage == nil || want.usage.CompletionTokens != c.maxTokens {
				t.Errorf("the GGUF node gave %q (%s): the case does not test what it says", want.text, want.finish)
			}
			if c.stream && got.chunks < 2 {
				t.Errorf("%d chunks streamed", got.chunks)
			}
		})
	}
}

// TestSafetensorsStockDir serves ../shared/models/stories260K-hf as it is
// and checks its greedy text against mlxstage's pure-Go reference backend
// run in process on the same directory: the node adds nothing (tokenizer,
// scheduler, HTTP) that changes a token.
func TestSafetensorsStockDir(t *testing.T) {
	hf := startNode(t, node.EmulateMLX(node.Config{Model: hfModelPath}))
	tok, err := hftok.Load(safetensors.Dir(hfModelPath), hftok.Options{})
	if err != nil {
		t.Fatal(err)
	}
	e, err := mlxstage.Open(hfModelPath, 0, 5, mlxstage.Options{Engine: mlxstage.EngineReference, MaxSeqs: 1, Context: ctxLen})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	for i, prompt := range []string{storyPrompt, "The cat sat on the"} {
		ids, err := tok.Encode(prompt, true)
		if err != nil {
			t.Fatal(err)
		}
		want := greedyOn(t, e, tok, stage.SeqID(i+1), ids, 64)
		got := complete(t, hf.url, hfModelID, prompt, 64, false)
		if got.text != want || got.usage == nil || got.usage.PromptTokens != len(ids) {
			t.Errorf("%q: node gave %q (usage %+v)\nreference engine %q (%d prompt tokens)", prompt, got.text, got.usage, want, len(ids))
		}
	}
}

// greedyOn is the argmax continuation of prompt on a whole-model engine,
// decoded as a stream is (each token's text mid-sequence).
func greedyOn(t *testing.T, e stage.Engine, tok *hftok.Tokenizer, seq stage.SeqID, prompt []int32, n int) string {
	t.Helper()
	if err := e.Open(seq); err != nil {
		t.Fatal(err)
	}
	defer e.Release(seq)
	b := stage.Batch{Outputs: []int{len(prompt) - 1}}
	for i, id := range prompt {
		b.Seqs, b.Pos, b.Tokens = append(b.Seqs, seq), append(b.Pos, int32(i)), append(b.Tokens, id)
	}
	var out []int32
	for len(out) < n {
		o, err := e.Forward(context.Background(), &b)
		if err != nil {
			t.Fatal(err)
		}
		next := stagetest.Argmax(o.Logits)
		if tok.IsEOG(next) {
			break
		}
		out = append(out, next)
		b = stage.Batch{Seqs: []stage.SeqID{seq}, Pos: []int32{int32(len(prompt) + len(out) - 1)}, Tokens: []int32{next}, Outputs: []int{0}}
	}
	text, err := tok.DecodePiece(out)
	if err != nil {
		t.Fatal(err)
	}
	return text
}

// TestSafetensorsJoinerWithoutMLX: a node that cannot run mlx joins a mesh
// serving a safetensors model. Even with --split it gets no layers; it
// still serves the API (its tokenizer copied from the holder), through the
// node that can.
func TestSafetensorsJoinerWithoutMLX(t *testing.T) {
	a := startNode(t, node.EmulateMLX(node.Config{Model: hfModelPath, Split: true}))
	b := startNode(t, joinTo(node.Config{}, a))
	st := waitStatus(t, b.url, "sees both nodes", func(st node.Status) bool { return len(st.Nodes) == 2 })
	aID := status(t, a.url).Self
	if len(st.Plan) != 1 || st.Plan[0].Node != aID || st.Plan[0].Start != 0 || st.Plan[0].End != 5 {
		t.Errorf("plan %+v: want all 5 layers on the mlx node %s", st.Plan, aID)
	}
	if st.Local != nil {
		t.Errorf("the joiner without mlx serves layers %+v", st.Local)
	}
	for id, want := range map[string]string{aID: "mlx/emulated", st.Self: "ggml/cpu"} {
		if got := engineOf(st, id); got != want {
			t.Errorf("node %s announces %s, want %s", id, got, want)
		}
	}
	if !slices.ContainsFunc(st.Events, func(ev node.MeshEvent) bool {
		return ev.Kind == "engine" && strings.Contains(ev.Text, "cannot run the mlx engine")
	}) {
		t.Errorf("no event says why the joiner gets no layers: %+v", st.Events)
	}
	want := complete(t, a.url, hfModelID, storyPrompt, 48, false)
	got := complete(t, b.url, hfModelID, storyPrompt, 48, true)
	if got.text != want.text || !sameUsage(got.usage, want.usage) {
		t.Errorf("through the joiner %q %+v, through the holder %q %+v", got.text, got.usage, want.text, want.usage)
	}
}

// TestSafetensorsSplitOverMLXNodes: two nodes that run mlx split the
// model; the joiner reads only its stage's tensors from the holder (and
// the small files, hash-checked), and the split gives the GGUF's text.
func TestSafetensorsSplitOverMLXNodes(t *testing.T) {
	dir := hfDir(t)
	a := startNode(t, node.EmulateMLX(node.Config{Model: dir, Split: true}))
	b := startNode(t, node.EmulateMLX(joinTo(node.Config{}, a)))
	st := waitStatus(t, b.url, "serving a 2-stage split", func(st node.Status) bool {
		return len(st.Plan) == 2 && st.Ready && st.Local != nil
	})
	weights, err := os.Stat(filepath.Join(hfModelPath, "model.safetensors"))
	if err != nil {
		t.Fatal(err)
	}
	if f := st.Local.Fetched; f == 0 || f >= uint64(weights.Size()) {
		t.Errorf("the joiner read %d bytes for layers [%d,%d) of a %d-byte model", f, st.Local.Start, st.Local.End, weights.Size())
	}
	for _, n := range st.Nodes {
		if n.Engine != "mlx" {
			t.Errorf("node %s announces engine %s", n.ShortID, n.Engine)
		}
	}
	for _, c := range ggufPrompts(t)[:2] {
		got := complete(t, b.url, hfModelID, c.hf, c.maxTokens, c.stream)
		want := complete(t, base, modelID, c.gguf, c.maxTokens, c.stream)
		if got.text != want.text || !sameUsage(got.usage, want.usage) {
			t.Errorf("%s: split safetensors %q %+v, GGUF %q %+v", c.name, got.text, got.usage, want.text, want.usage)
		}
	}
}

// TestServeDirWithoutMLX: where MLX cannot run, serving a directory stops
// at once, saying why and what to serve instead.
func TestServeDirWithoutMLX(t *testing.T) {
	why := mlxstage.Check()
	if why == nil {
		t.Skip("MLX runs here")
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err := node.Run(ctx, node.Config{Model: hfModelPath, HTTPAddr: "127.0.0.1:0", DataDir: t.TempDir(), GossipPort: -1,
		Listen: []string{"/ip4/127.0.0.1/tcp/0"}})
	if !errors.Is(err, why) {
		t.Fatalf("node.Run = %v, want %v", err, why)
	}
	says := []string{hfModelPath, "safetensors", "MLX"}
	if errors.Is(why, mlxstage.ErrUnavailable) { // no binding (rather than a Mac build without libmlxc)
		says = append(says, "MLX is unavailable on this machine", "use a GGUF of the model")
	}
	for _, want := range says {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}
	if ctx.Err() != nil {
		t.Error("node.Run ran until the deadline")
	}
}

// TestSafetensorsChatMatchesGGUF: a synthetic qwen2 model (byte-level BPE,
// a chat template with special tokens, q/k/v biases, a tied head), written
// as a GGUF and as its sharded safetensors twin, answers chat and
// completion requests alike from a GGUF node and a safetensors node.
func TestSafetensorsChatMatchesGGUF(t *testing.T) {
	dir := t.TempDir()
	ggufPath, hfDir := filepath.Join(dir, "qwen2.gguf"), filepath.Join(dir, "qwen2-hf")
	if err := synthst.Write(ggufPath, hfDir, synth.Tiny("qwen2"), synthst.Options{Shards: 2}); err != nil {
		t.Fatal(err)
	}
	gg := startNode(t, node.Config{Model: ggufPath})
	hf := startNode(t, node.EmulateMLX(node.Config{Model: hfDir}))
	for _, c := range []struct {
		name string
		path string
		req  map[string]any
	}{
		{"chat", "/v1/chat/completions", map[string]any{"messages": []map[string]string{{"role": "system", "content": "Be brief."}, {"role": "user", "content": "héllo wörld 你好 🙂"}}}},
		{"chat streamed", "/v1/chat/completions", map[string]any{"stream": true, "messages": []map[string]string{{"role": "user", "content": "Tell me a story"}}}},
		{"completion", "/v1/completions", map[string]any{"prompt": "<|im_start|>user\nhi<|im_end|>\n"}},
	} {
		t.Run(c.name, func(t *testing.T) {
			got := generateAt(t, hf.url, "qwen2-hf", c.path, c.req)
			want := generateAt(t, gg.url, "qwen2", c.path, c.req)
			if got.text != want.text || got.finish != want.finish || !sameUsage(got.usage, want.usage) {
				t.Errorf("safetensors node:\n got %q %s %+v\nGGUF node:\nwant %q %s %+v", got.text, got.finish, got.usage, want.text, want.finish, want.usage)
			}
			if want.text == "" || want.usage == nil || want.usage.PromptTokens < 5 {
				t.Errorf("the GGUF node gave %q %+v: the case does not test what it says", want.text, want.usage)
			}
		})
	}
}
