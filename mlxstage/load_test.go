package mlxstage

import (
	"context"
	"errors"
	"math"
	"strings"
	"sync/atomic"
	"testing"

	"github.com/meshnode/meshnode/mlxstage/safetensors"
	"github.com/meshnode/meshnode/stage"
)

// countingOpener counts, independently of the safetensors package's own
// statistics, every byte read from the model's weight files.
type countingOpener struct {
	open   safetensors.Opener
	weight atomic.Int64
	files  map[string]bool
}

type countingSource struct {
	safetensors.Source
	n *atomic.Int64
}

func (c countingSource) ReadAt(p []byte, off int64) (int, error) {
	n, err := c.Source.ReadAt(p, off)
	c.n.Add(int64(n))
	return n, err
}

func (c countingSource) Close() error {
	if cl, ok := c.Source.(interface{ Close() error }); ok {
		return cl.Close()
	}
	return nil
}

func (c *countingOpener) Open(name string) (safetensors.Source, error) {
	src, err := c.open(name)
	if err != nil || !strings.HasSuffix(name, ".safetensors") {
		return src, err
	}
	c.files[name] = true
	return countingSource{src, &c.weight}, nil
}

// stageBytes is the data size of a stage's tensors and the header sizes of
// the files they are in, from the headers alone.
func stageBytes(t *testing.T, open safetensors.Opener, cfg *Config, start, end int) (tensors, headers int64, files map[string]bool) {
	t.Helper()
	m, err := safetensors.OpenModel(open)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	files = map[string]bool{}
	for _, name := range cfg.StageTensors(start, end) {
		file, tn, err := m.Locate(name)
		if err != nil {
			t.Fatal(err)
		}
		tensors += tn.Length
		files[file] = true
	}
	return tensors, m.Stats().HeaderBytes, files
}

func TestStageLoadsOnlyItsBytes(t *testing.T) {
	_, qwen := writeTwin(t, "qwen2", 3)
	for _, c := range []struct {
		dir        string
		start, end int
	}{
		{storiesHF, 0, 5}, {storiesHF, 0, 2}, {storiesHF, 2, 5}, {storiesHF, 1, 3},
		{qwen, 0, 1}, {qwen, 1, 2}, {qwen, 2, 3}, {qwen, 0, 3},
	} {
		co := &countingOpener{open: safetensors.Dir(c.dir), files: map[string]bool{}}
		opts := refOpts
		opts.Files = co.Open
		e, err := Open(c.dir, c.start, c.end, opts)
		if err != nil {
			t.Fatal(err)
		}
		cfg := e.Config()
		e.Close()
		tensors, headers, files := stageBytes(t, safetensors.Dir(c.dir), cfg, c.start, c.end)
		st := e.LoadStats()
		if st.TensorBytes != tensors || st.HeaderBytes != headers || len(co.files) != len(files) {
			t.Errorf("%s [%d,%d): read %+v from %d files, want %d tensor bytes and %d header bytes from %d files",
				c.dir, c.start, c.end, st, len(co.files), tensors, headers, len(files))
		}
		if got := co.weight.Load(); got != tensors+headers {
			t.Errorf("%s [%d,%d): %d bytes read from the weight files, want exactly %d (%d of tensors + %d of headers)",
				c.dir, c.start, c.end, got, tensors+headers, tensors, headers)
		}
		t.Logf("%s [%d,%d): %d tensor + %d header bytes from %d of the files", c.dir, c.start, c.end, tensors, headers, len(files))
	}
}

// A tied head on a last stage that is not the first loads the embedding
// for the head, and nothing else of the first stage.
func TestTiedHeadTensors(t *testing.T) {
	cfg := &Config{Layers: 3, Tied: true}
	got := strings.Join(cfg.StageTensors(2, 3), " ")
	if !strings.HasPrefix(got, NameEmbed+" ") || !strings.HasSuffix(got, NameNorm) || strings.Contains(got, NameHead) || strings.Contains(got, "layers.1.") {
		t.Errorf("tied last stage loads %s", got)
	}
	cfg.Tied = false
	got = strings.Join(cfg.StageTensors(1, 2), " ")
	if strings.Contains(got, NameEmbed) || strings.Contains(got, NameNorm) || strings.Contains(got, NameHead) {
		t.Errorf("middle stage loads %s", got)
	}
}

func TestSequenceBookkeeping(t *testing.T) {
	e, err := Open(storiesHF, 0, 5, refOpts)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	info := e.Info()
	if info.Engine != "reference" || info.Backend != "CPU" || info.Arch != "llama" || info.Vocab != 512 || info.Context != 256 {
		t.Errorf("info %+v", info)
	}
	if err := e.Open(1); err != nil {
		t.Fatal(err)
	}
	if err := e.Open(1); !errors.Is(err, stage.ErrSeqExists) {
		t.Errorf("reopening: %v", err)
	}
	e.Open(2)
	if err := e.Open(3); !errors.Is(err, stage.ErrNoSlot) {
		t.Errorf("third sequence of two slots: %v", err)
	}
	ctx := context.Background()
	prompt := []int32{1, 403, 407, 261}
	b := stage.Batch{Seqs: []stage.SeqID{1, 1, 1, 1}, Pos: []int32{0, 1, 2, 3}, Tokens: prompt, Outputs: []int{3}}
	first, err := e.Forward(ctx, &b)
	if err != nil {
		t.Fatal(err)
	}
	// A gap, a replay without Trim, and an unknown sequence are refused and
	// leave the cache as it was.
	for _, bad := range []stage.Batch{
		{Seqs: []stage.SeqID{1}, Pos: []int32{5}, Tokens: []int32{9}, Outputs: []int{0}},
		{Seqs: []stage.SeqID{1}, Pos: []int32{2}, Tokens: []int32{9}, Outputs: []int{0}},
		{Seqs: []stage.SeqID{1, 1}, Pos: []int32{4, 6}, Tokens: []int32{9, 9}, Outputs: []int{1}},
		{Seqs: []stage.SeqID{9}, Pos: []int32{0}, Tokens: []int32{9}, Outputs: []int{0}},
	} {
		if _, err := e.Forward(ctx, &bad); err == nil {
			t.Errorf("batch %+v accepted", bad)
		}
	}
	// Trim and replay the last prompt token: the same logits.
	if err := e.Trim(1, 3); err != nil {
		t.Fatal(err)
	}
	again, err := e.Forward(ctx, &stage.Batch{Seqs: []stage.SeqID{1}, Pos: []int32{3}, Tokens: prompt[3:], Outputs: []int{0}})
	if err != nil {
		t.Fatal(err)
	}
	if d := maxAbsDiff(first.Logits, again.Logits); d > 1e-6 {
		t.Errorf("replay after Trim differs by %g", d)
	}
	// A prefill chunk without outputs on the last stage fills the cache.
	out, err := e.Forward(ctx, &stage.Batch{Seqs: []stage.SeqID{2, 2}, Pos: []int32{0, 1}, Tokens: prompt[:2]})
	if err != nil || out.Logits != nil || out.Hidden != nil {
		t.Fatalf("no-output chunk: %+v %v", out, err)
	}
	rest, err := e.Forward(ctx, &stage.Batch{Seqs: []stage.SeqID{2, 2}, Pos: []int32{2, 3}, Tokens: prompt[2:], Outputs: []int{1}})
	if err != nil {
		t.Fatal(err)
	}
	if d := maxAbsDiff(first.Logits, rest.Logits); d > 1e-5 {
		t.Errorf("chunked prefill differs from one-shot by %g", d)
	}
	if err := e.Release(1); err != nil {
		t.Fatal(err)
	}
	if err := e.Release(1); !errors.Is(err, stage.ErrUnknownSeq) {
		t.Errorf("double release: %v", err)
	}
	if err := e.Open(3); err != nil {
		t.Errorf("slot not freed: %v", err)
	}
	e.Close()
	if _, err := e.Forward(ctx, &b); err == nil {
		t.Error("forward on a closed engine")
	}
}

func TestContextLimit(t *testing.T) {
	opts := refOpts
	opts.Context = 4
	e, err := Open(storiesHF, 0, 5, opts)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	e.Open(1)
	b := stage.Batch{Seqs: []stage.SeqID{1, 1, 1, 1}, Pos: []int32{0, 1, 2, 3}, Tokens: []int32{1, 2, 3, 4}, Outputs: []int{3}}
	if _, err := e.Forward(context.Background(), &b); err != nil {
		t.Fatal(err)
	}
	b = stage.Batch{Seqs: []stage.SeqID{1}, Pos: []int32{4}, Tokens: []int32{5}, Outputs: []int{0}}
	if _, err := e.Forward(context.Background(), &b); err == nil {
		t.Error("position past the context accepted")
	}
}

func TestMLXUnavailableHere(t *testing.T) {
	if Available() {
		t.Skip("built with the MLX binding")
	}
	if err := Check(); !errors.Is(err, ErrUnavailable) {
		t.Errorf("Check() = %v, want ErrUnavailable", err)
	}
	_, err := Open(storiesHF, 0, 5, Options{})
	if !errors.Is(err, ErrUnavailable) {
		t.Fatalf("default engine off Apple Silicon: %v", err)
	}
	for _, want := range []string{"MLX is unavailable on this machine", "Apple Silicon", "-tags mlx", "use a GGUF of the model", "ggml engine"} {
		if !strings.Contains(err.Error(), want) {
			t.Errorf("error %q does not say %q", err, want)
		}
	}
}

func TestBadModels(t *testing.T) {
	if _, err := Open(t.TempDir(), 0, 1, refOpts); err == nil || !strings.Contains(err.Error(), "config.json") {
		t.Errorf("empty directory: %v", err)
	}
	if _, err := Open(storiesHF, 3, 9, refOpts); err == nil {
		t.Error("range past the model accepted")
	}
	// A config whose shapes disagree with the weights.
	opts := refOpts
	opts.Files = withConfig(t, storiesHF, map[string]any{"intermediate_size": 100})
	if _, err := Open(storiesHF, 0, 1, opts); !errors.Is(err, ErrConfig) {
		t.Errorf("wrong intermediate_size: %v", err)
	}
	opts.Files = withConfig(t, storiesHF, map[string]any{"architectures": []string{"GPT2LMHeadModel"}})
	if _, err := Open(storiesHF, 0, 1, opts); !errors.Is(err, ErrUnsupported) {
		t.Errorf("gpt2: %v", err)
	}
}

// Load-time quantization on the reference backend: the logits move by a
// small fraction of their range at 8 bits, more at 4, and never not at all
// (the policy really applied). Greedy choices are not compared: the random
// models have near-ties that any rounding may flip.
func TestQuantPolicyReference(t *testing.T) {
	_, hf := writeTwin(t, "qwen3", 1)
	run := func(p QuantPolicy) ([][]float32, uint64) {
		opts := refOpts
		opts.Quant = p
		e, err := Open(hf, 0, 3, opts)
		if err != nil {
			t.Fatal(err)
		}
		p2 := &pipeline{stages: []stage.Engine{e}, wire: stage.F32}
		defer p2.close()
		return synthScenario.run(t, p2), e.WeightBytes()
	}
	exact, _ := run(QuantNone)
	var spread float64
	for _, v := range exact[0] {
		spread = max(spread, math.Abs(float64(v)))
	}
	prev := 0.0
	for _, c := range []struct {
		p   QuantPolicy
		tol float64
	}{{Quant8, 0.05}, {Quant4, 0.5}} {
		got, _ := run(c.p)
		d := maxAbsDiff(got[0], exact[0]) / spread
		t.Logf("%s: prefill logits move by up to %.3g of their largest magnitude (%.3g)", c.p, d, spread)
		if d > c.tol || d == 0 {
			t.Errorf("%s: logits move by %.3g of their range, want (0, %g]", c.p, d, c.tol)
		}
		if d <= prev {
			t.Errorf("%s moves the logits less than more bits did", c.p)
		}
		prev = d
	}
}

func TestParseQuant(t *testing.T) {
	for s, want := range map[string]string{"": "none", "none": "none", "q4": "q4g64", "q8g32": "q8g32", "q4-noembed": "q4g64-noembed"} {
		p, err := ParseQuant(s)
		if err != nil || p.String() != want {
			t.Errorf("ParseQuant(%q) = %v, %v; want %s", s, p, err, want)
		}
	}
	for _, bad := range []string{"q5", "q4g48", "int4", "qx"} {
		if _, err := ParseQuant(bad); err == nil {
			t.Errorf("ParseQuant(%q) accepted", bad)
		}
	}
	p := Quant4
	if q := p.For(NameEmbed, []int{512, 64}); q.None() {
		t.Error("q4 leaves the embedding")
	}
	if q := p.For("model.layers.0.mlp.down_proj.weight", []int{64, 172}); !q.None() {
		t.Error("rows of 172 are not whole groups of 64")
	}
	if q := p.For("model.layers.0.input_layernorm.weight", []int{64}); !q.None() {
		t.Error("a norm quantized")
	}
}

func TestReadInfo(t *testing.T) {
	mi, err := ReadInfo(safetensors.Dir(storiesHF), QuantNone)
	if err != nil {
		t.Fatal(err)
	}
	per, embed, head, kv := mi.Sizes()
	if len(per) != 5 || embed != 512*64*4 || head != 64*4+512*64*4 || kv != 2*4*8*4 || mi.DType != safetensors.F32 {
		t.Errorf("sizes %v %d %d %d %s", per, embed, head, kv, mi.DType)
	}
	// Memory of the whole model is what the engine holds.
	opts := refOpts
	e, err := Open(storiesHF, 0, 5, opts)
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	mem, _ := mi.Memory(0, 5, 1)
	if mem.Weights != e.WeightBytes() {
		t.Errorf("estimate %d bytes, engine holds %d", mem.Weights, e.WeightBytes())
	}
	// Four bits with groups of 64: a 64-wide row of f32 becomes 32 bytes of
	// codes and two 4-byte numbers.
	q4, _ := ReadInfo(safetensors.Dir(storiesHF), Quant4)
	_, qe, _, _ := q4.Sizes()
	if qe != 512*(32+8) {
		t.Errorf("q4 embedding %d bytes", qe)
	}
}
