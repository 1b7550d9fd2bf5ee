package mlxstage

// Acceptance tests against the ggml engine: the same weights as a GGUF
// (ggufstage) and as safetensors (mlxstage with the reference ops) give the
// same logits, split or not, and stages of the two engines chain.

import (
	"bytes"
	"context"
	"encoding/json"
	"fmt"
	"maps"
	"math"
	"path/filepath"
	"slices"
	"testing"

	"github.com/ollama/ollama/ml"

	"github.com/meshnode/meshnode/ggufstage"
	"github.com/meshnode/meshnode/ggufstage/synth"
	"github.com/meshnode/meshnode/mlxstage/mlx"
	"github.com/meshnode/meshnode/mlxstage/ops"
	"github.com/meshnode/meshnode/mlxstage/safetensors"
	"github.com/meshnode/meshnode/mlxstage/synthst"
	"github.com/meshnode/meshnode/stage"
	"github.com/meshnode/meshnode/stage/stagetest"
)

const (
	storiesGGUF = "../../shared/models/stories260K.gguf"
	storiesHF   = "../../shared/models/stories260K-hf"
)

// ggmlOpts keeps ggml light (one thread) and exact enough to compare with:
// an f32 KV cache, since the default f16 cache alone moves logits by ~1e-3.
var ggmlOpts = ggufstage.Options{Threads: 1, MaxSeqs: 2, Context: 256, KVType: ml.DTypeF32, WireDType: stage.F32}

var refOpts = Options{Engine: EngineReference, MaxSeqs: 2, Context: 256, WireDType: stage.F32}

// withConfig serves dir's files with config.json's keys overridden.
func withConfig(t testing.TB, dir string, set map[string]any) safetensors.Opener {
	t.Helper()
	local := safetensors.Dir(dir)
	raw, err := safetensors.ReadFile(local, "config.json")
	if err != nil {
		t.Fatal(err)
	}
	var cfg map[string]any
	if err := json.Unmarshal(raw, &cfg); err != nil {
		t.Fatal(err)
	}
	maps.Copy(cfg, set)
	patched, _ := json.Marshal(cfg)
	return func(name string) (safetensors.Source, error) {
		if name == "config.json" {
			return bytesSource{bytes.NewReader(patched)}, nil
		}
		return local(name)
	}
}

type bytesSource struct{ *bytes.Reader }

func (b bytesSource) Size() int64 { return b.Reader.Size() }

// pipeline chains in-process stages of any engine the way the mesh chains
// remote ones: token ids into the first, activations between, through the
// wire dtype.
type pipeline struct {
	stages []stage.Engine
	wire   stage.DType
}

func (p *pipeline) open(t *testing.T, seqs ...stage.SeqID) {
	t.Helper()
	for _, s := range p.stages {
		for _, q := range seqs {
			if err := s.Open(q); err != nil {
				t.Fatal(err)
			}
		}
	}
}

func (p *pipeline) forward(t *testing.T, b stage.Batch) []float32 {
	t.Helper()
	var hidden *stage.Activation
	for i, s := range p.stages {
		sb := b
		if i > 0 {
			sb.Tokens = nil
			sb.Hidden = hidden
		}
		out, err := s.Forward(context.Background(), &sb)
		if err != nil {
			t.Fatalf("stage %s %s: %v", s.Info().Engine, s.Info().Range(), err)
		}
		if i == len(p.stages)-1 {
			return out.Logits
		}
		hidden = out.Hidden
		if hidden.DType != p.wire {
			f, _ := hidden.Float32()
			hidden, _ = stage.NewActivation(p.wire, hidden.Rows, hidden.Cols, f)
		}
	}
	return nil
}

func (p *pipeline) close() {
	for _, s := range p.stages {
		s.Close()
	}
}

func (p *pipeline) vocab() int { return p.stages[len(p.stages)-1].Info().Vocab }

// stageSpec is one stage of a test pipeline: which engine, which layers.
type stageSpec struct {
	ggml       bool
	start, end int
}

func (s stageSpec) String() string {
	if s.ggml {
		return fmt.Sprintf("ggml%d-%d", s.start, s.end)
	}
	return fmt.Sprintf("ref%d-%d", s.start, s.end)
}

// build opens a pipeline of ggml stages on gguf (sliced) and reference
// stages on the safetensors directory hf.
func build(t *testing.T, gguf, hf string, specs ...stageSpec) *pipeline {
	t.Helper()
	p := &pipeline{wire: stage.F32}
	dir := t.TempDir()
	for _, s := range specs {
		var e stage.Engine
		var err error
		if s.ggml {
			var path string
			if path, err = ggufstage.Slice(gguf, dir, s.start, s.end, nil); err == nil {
				e, err = ggufstage.Open(path, s.start, s.end, ggmlOpts)
			}
		} else {
			e, err = Open(hf, s.start, s.end, refOpts)
		}
		if err != nil {
			p.close()
			t.Fatalf("opening %v: %v", s, err)
		}
		p.stages = append(p.stages, e)
	}
	return p
}

// scenario drives two sequences of different lengths through one mixed
// prefill batch, then decode steps where both advance together; it returns
// the logits of every step (two rows each).
type scenario struct {
	promptA, promptB []int32
	steps            int
}

func (sc scenario) run(t *testing.T, p *pipeline) [][]float32 {
	t.Helper()
	p.open(t, 1, 2)
	vocab := p.vocab()
	var b stage.Batch
	// Interleave the two prompts so that the engine's per-sequence
	// grouping is exercised, not just contiguous blocks.
	for i := range max(len(sc.promptA), len(sc.promptB)) {
		if i < len(sc.promptA) {
			b.Seqs, b.Pos, b.Tokens = append(b.Seqs, 1), append(b.Pos, int32(i)), append(b.Tokens, sc.promptA[i])
		}
		if i < len(sc.promptB) {
			b.Seqs, b.Pos, b.Tokens = append(b.Seqs, 2), append(b.Pos, int32(i)), append(b.Tokens, sc.promptB[i])
		}
	}
	lastA, lastB := -1, -1
	for r, s := range b.Seqs {
		if s == 1 {
			lastA = r
		} else {
			lastB = r
		}
	}
	b.Outputs = []int{min(lastA, lastB), max(lastA, lastB)}
	swap := lastB < lastA
	logits := p.forward(t, b)
	if swap {
		logits = append(slices.Clone(logits[vocab:]), logits[:vocab]...)
	}
	all := [][]float32{logits}
	posA, posB := int32(len(sc.promptA)), int32(len(sc.promptB))
	for range sc.steps {
		next := stage.Batch{
			Seqs:    []stage.SeqID{1, 2},
			Pos:     []int32{posA, posB},
			Tokens:  []int32{stagetest.Argmax(logits[:vocab]), stagetest.Argmax(logits[vocab:])},
			Outputs: []int{0, 1},
		}
		logits = p.forward(t, next)
		all = append(all, logits)
		posA++
		posB++
	}
	return all
}

func maxAbsDiff(a, b []float32) float64 {
	if len(a) != len(b) {
		return math.Inf(1)
	}
	var d float64
	for i := range a {
		d = max(d, math.Abs(float64(a[i]-b[i])))
	}
	return d
}

var storiesScenario = scenario{
	promptA: []int32{1, 403, 407, 261, 378, 300, 58},
	promptB: []int32{1, 334, 280, 428},
	steps:   8,
}

// compare runs sc on both pipelines and checks every step's logits agree
// within tol; it returns the largest difference of the prefill step and of
// the decode steps.
func compare(t *testing.T, want, got *pipeline, sc scenario, tol float64) (prefill, decode float64) {
	t.Helper()
	w := sc.run(t, want)
	g := sc.run(t, got)
	for i := range w {
		d := maxAbsDiff(g[i], w[i])
		if i == 0 {
			prefill = d
		} else {
			decode = max(decode, d)
		}
		if d > tol {
			t.Errorf("step %d: max |logit difference| = %g, want <= %g", i, d, tol)
		}
	}
	return prefill, decode
}

func TestStoriesMatchesGGUF(t *testing.T) {
	ggml := build(t, storiesGGUF, storiesHF, stageSpec{true, 0, 5})
	defer ggml.close()
	if info := ggml.stages[0].Info(); info.Vocab != 512 || info.Embd != 64 {
		t.Fatalf("ggml info %+v", info)
	}
	for _, split := range [][]stageSpec{
		{{false, 0, 5}},
		{{false, 0, 2}, {false, 2, 5}},
		{{false, 0, 3}, {false, 3, 5}},
	} {
		t.Run(fmt.Sprint(split), func(t *testing.T) {
			ref := build(t, storiesGGUF, storiesHF, split...)
			defer ref.close()
			ggml.close()
			ggml = build(t, storiesGGUF, storiesHF, stageSpec{true, 0, 5})
			pre, dec := compare(t, ggml, ref, storiesScenario, 1e-4)
			t.Logf("max |reference - ggml| logit: prefill %.3g, decode %.3g", pre, dec)
		})
	}
}

// greedy generates n tokens from BOS, one token per step.
func greedy(t *testing.T, p *pipeline, n int) []int32 {
	t.Helper()
	p.open(t, 7)
	tok := int32(1)
	var out []int32
	for i := range n {
		b := stage.Batch{Seqs: []stage.SeqID{7}, Pos: []int32{int32(i)}, Tokens: []int32{tok}, Outputs: []int{0}}
		tok = stagetest.Argmax(p.forward(t, b))
		out = append(out, tok)
	}
	return out
}

func TestMixedPipelineGreedy(t *testing.T) {
	const steps = 64
	run := func(specs ...stageSpec) []int32 {
		p := build(t, storiesGGUF, storiesHF, specs...)
		defer p.close()
		return greedy(t, p, steps)
	}
	ggml := run(stageSpec{true, 0, 5})
	ref := run(stageSpec{false, 0, 5})
	mixed := run(stageSpec{true, 0, 3}, stageSpec{false, 3, 5})
	back := run(stageSpec{false, 0, 3}, stageSpec{true, 3, 5})
	t.Logf("greedy tokens: %v", ggml)
	if !slices.Equal(ref, ggml) {
		t.Errorf("reference alone differs from ggml alone:\n ref %v\nggml %v", ref, ggml)
	}
	if !slices.Equal(mixed, ggml) {
		t.Errorf("ggml[0,3) -> reference[3,5) differs:\n got %v\nwant %v", mixed, ggml)
	}
	if !slices.Equal(back, ggml) {
		t.Errorf("reference[0,3) -> ggml[3,5) differs:\n got %v\nwant %v", back, ggml)
	}
}

// writeTwin writes synth's tiny preset of arch as a GGUF and its safetensors
// twin (the latter in shards files when shards > 1).
func writeTwin(t *testing.T, arch string, shards int) (gguf, hf string) {
	t.Helper()
	dir := t.TempDir()
	gguf, hf = filepath.Join(dir, arch+".gguf"), filepath.Join(dir, arch+"-hf")
	if err := synthst.Write(gguf, hf, synth.Tiny(arch), synthst.Options{Shards: shards}); err != nil {
		t.Fatal(err)
	}
	return gguf, hf
}

// synthScenario mixes a 7-token and a 4-token prompt in one prefill batch,
// then decodes both together; token ids are anywhere in the 512 vocabulary.
var synthScenario = scenario{
	promptA: []int32{1, 17, 250, 33, 400, 78, 5},
	promptB: []int32{2, 300, 42, 128},
	steps:   8,
}

// TestSynthMatchesGGUF: random llama, qwen2 (q/k/v biases, tied head) and
// qwen3 (q/k norms, tied head) models as safetensors agree with their GGUF
// versions, whole and split. The qwen2 twin is sharded, so loading through
// the index is covered too.
func TestSynthMatchesGGUF(t *testing.T) {
	for _, arch := range []string{"llama", "qwen2", "qwen3"} {
		t.Run(arch, func(t *testing.T) {
			shards := 1
			if arch == "qwen2" {
				shards = 3
			}
			gguf, hf := writeTwin(t, arch, shards)
			for _, split := range [][]stageSpec{
				{{false, 0, 3}},
				{{false, 0, 1}, {false, 1, 3}},
				{{false, 0, 2}, {false, 2, 3}},
				{{true, 0, 2}, {false, 2, 3}},
			} {
				t.Run(fmt.Sprint(split), func(t *testing.T) {
					ggml := build(t, gguf, hf, stageSpec{true, 0, 3})
					defer ggml.close()
					ref := build(t, gguf, hf, split...)
					defer ref.close()
					pre, dec := compare(t, ggml, ref, synthScenario, 1e-4)
					t.Logf("max |reference - ggml| logit: prefill %.3g, decode %.3g", pre, dec)
				})
			}
		})
	}
}

// TestEmulatedMLX runs the MLX binding's Go logic (the ops interface
// composed from mlx-c primitives) on the pure-Go emulation of those
// primitives: it must reproduce the reference backend, unquantized and
// with load-time 4-bit quantization, split or not, and free every array it
// made once the engines close. What this cannot check is mlx-c itself.
func TestEmulatedMLX(t *testing.T) {
	_, qwen := writeTwin(t, "qwen3", 1)
	for _, c := range []struct {
		name string
		dir  string
		q    QuantPolicy
		sc   scenario
	}{
		{"stories", storiesHF, QuantNone, storiesScenario},
		{"qwen3", qwen, QuantNone, synthScenario},
		{"qwen3-q4", qwen, Quant4, synthScenario},
	} {
		t.Run(c.name, func(t *testing.T) {
			cfg, err := ReadConfig(safetensors.Dir(c.dir))
			if err != nil {
				t.Fatal(err)
			}
			open := func(backend ops.Backend, bounds ...int) *pipeline {
				p := &pipeline{wire: stage.F32}
				for i := 0; i+1 < len(bounds); i++ {
					opts := refOpts
					opts.Backend, opts.Quant = backend, c.q
					e, err := Open(c.dir, bounds[i], bounds[i+1], opts)
					if err != nil {
						t.Fatal(err)
					}
					p.stages = append(p.stages, e)
				}
				return p
			}
			ref := open(nil, 0, cfg.Layers)
			want := c.sc.run(t, ref)
			ref.close()

			be, live := mlx.Emulated()
			got := open(be, 0, 1, cfg.Layers)
			if info := got.stages[0].Info(); info.Engine != "mlx" || info.Backend != "emulated" {
				t.Errorf("info %+v", info)
			}
			g := c.sc.run(t, got)
			var worst float64
			for i := range want {
				worst = max(worst, maxAbsDiff(g[i], want[i]))
			}
			t.Logf("max |emulated MLX - reference| logit: %.3g", worst)
			if worst > 1e-5 {
				t.Errorf("emulated MLX differs from the reference by %g", worst)
			}
			got.close()
			if n := live(); n != 0 {
				t.Errorf("%d arrays still alive after Close", n)
			}
		})
	}
}

// TestHalfPrecision loads F16 weights (a synth F16 GGUF's twin): the
// reference backend computes in float32 from them, the emulated MLX backend
// in float16 as MLX would, so they agree only to half precision; the ggml
// engine, which rounds activations to f16 for its f16 matmuls, sits between.
func TestHalfPrecision(t *testing.T) {
	dir := t.TempDir()
	spec := synth.Tiny("qwen2")
	spec.Type = synth.F16
	g, hf := filepath.Join(dir, "f16.gguf"), filepath.Join(dir, "f16-hf")
	if err := synthst.Write(g, hf, spec, synthst.Options{}); err != nil {
		t.Fatal(err)
	}
	m, err := safetensors.OpenModel(safetensors.Dir(hf))
	if err != nil {
		t.Fatal(err)
	}
	_, q, _ := m.Locate("model.layers.0.self_attn.q_proj.weight")
	m.Close()
	if q.DType != safetensors.F16 {
		t.Fatalf("q_proj is %s, want F16", q.DType)
	}
	ref := build(t, g, hf, stageSpec{false, 0, 3})
	want := synthScenario.run(t, ref)
	ref.close()
	ggml := build(t, g, hf, stageSpec{true, 0, 3})
	viaGGML := synthScenario.run(t, ggml)
	ggml.close()

	be, live := mlx.Emulated()
	opts := refOpts
	opts.Backend = be
	e, err := Open(hf, 0, 3, opts)
	if err != nil {
		t.Fatal(err)
	}
	emu := &pipeline{stages: []stage.Engine{e}, wire: stage.F32}
	got := synthScenario.run(t, emu)
	emu.close()
	if live() != 0 {
		t.Errorf("%d arrays alive after Close", live())
	}
	var spread, dEmu, dGGML float64
	for _, v := range want[0] {
		spread = max(spread, math.Abs(float64(v)))
	}
	dEmu, dGGML = maxAbsDiff(got[0], want[0])/spread, maxAbsDiff(viaGGML[0], want[0])/spread
	t.Logf("prefill logits relative to the f32 reference: emulated MLX in f16 %.3g, ggml %.3g", dEmu, dGGML)
	if dEmu > 0.01 || dGGML > 0.01 {
		t.Errorf("half-precision runs stray by %.3g (MLX) and %.3g (ggml) of the logit range", dEmu, dGGML)
	}
}
