package ggufstage

import (
	"context"
	"fmt"
	"math"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/ollama/ollama/ml"

	"github.com/meshnode/meshnode/stage"
	"github.com/meshnode/meshnode/stage/stagetest"
)

const storiesPath = "../../shared/models/stories260K.gguf"

// pipeline chains in-process stages the way the mesh chains remote ones:
// token ids into the first, activations (through the wire dtype) between.
type pipeline struct {
	stages []*Engine
	wire   stage.DType
}

func (p *pipeline) open(t testing.TB, seqs ...stage.SeqID) {
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
	return p.run(t, b).Logits
}

// forwardPicks runs b through the stages asking the last for greedy picks
// (Batch.PicksOnly), which it must give.
func (p *pipeline) forwardPicks(t *testing.T, b stage.Batch) []int32 {
	t.Helper()
	b.PicksOnly = true // ignored by all but the last stage
	out := p.run(t, b)
	if out.Picks == nil || out.Logits != nil {
		t.Fatalf("asked for greedy picks, the last stage returned %d picks and %d logits", len(out.Picks), len(out.Logits))
	}
	return out.Picks
}

// run passes b through the stages, each stage's hidden state on to the
// next in the pipeline's wire type, and returns the last stage's output.
func (p *pipeline) run(t *testing.T, b stage.Batch) *stage.Output {
	t.Helper()
	ctx := context.Background()
	var hidden *stage.Activation
	var prev *stage.Output
	for i, s := range p.stages {
		sb := b
		if i > 0 {
			sb.Tokens = nil
			sb.Hidden = hidden
		}
		out, err := s.Forward(ctx, &sb)
		if err != nil {
			t.Fatalf("stage %s: %v", s.Info().Range(), err)
		}
		// The hidden states it ran on go back to the stage that lent
		// them, for its next pass, as a pipeline gives them back.
		prev.Release()
		prev = out
		if i == len(p.stages)-1 {
			return out
		}
		hidden = out.Hidden
		if p.wire != stage.F32 {
			f, _ := hidden.Float32()
			hidden, _ = stage.NewActivation(p.wire, hidden.Rows, hidden.Cols, f)
		}
	}
	return nil
}

// promptBatch is sequence seq's prompt from position 0 as one batch, with
// the logits of its last token.
func promptBatch(seq stage.SeqID, prompt []int32) stage.Batch {
	b := stage.Batch{Outputs: []int{len(prompt) - 1}}
	for i, tok := range prompt {
		b.Seqs, b.Pos, b.Tokens = append(b.Seqs, seq), append(b.Pos, int32(i)), append(b.Tokens, tok)
	}
	return b
}

// countTo is the tokens 1 to n.
func countTo(n int) []int32 {
	out := make([]int32, n)
	for i := range out {
		out[i] = int32(1 + i)
	}
	return out
}

func (p *pipeline) close() {
	for _, s := range p.stages {
		s.Close()
	}
}

func openSplit(t testing.TB, src string, bounds []int, opts Options) *pipeline {
	t.Helper()
	dir := t.TempDir()
	p := &pipeline{wire: stage.F32}
	for i := 0; i+1 < len(bounds); i++ {
		path, err := Slice(src, dir, bounds[i], bounds[i+1], nil)
		if err != nil {
			t.Fatal(err)
		}
		e, err := Open(path, bounds[i], bounds[i+1], opts)
		if err != nil {
			t.Fatal(err)
		}
		p.stages = append(p.stages, e)
	}
	return p
}

// scenario drives two sequences of different lengths through one mixed
// prefill batch and then decode steps where both advance together, and
// returns the logits of every step (two rows each).
type scenario struct {
	promptA, promptB []int32
	steps            int
}

func (sc scenario) run(t *testing.T, fwd func(b stage.Batch) []float32, vocab int) [][]float32 {
	t.Helper()
	var b stage.Batch
	for i, tok := range sc.promptA {
		b.Seqs, b.Pos, b.Tokens = append(b.Seqs, 1), append(b.Pos, int32(i)), append(b.Tokens, tok)
	}
	for i, tok := range sc.promptB {
		b.Seqs, b.Pos, b.Tokens = append(b.Seqs, 2), append(b.Pos, int32(i)), append(b.Tokens, tok)
	}
	b.Outputs = []int{len(sc.promptA) - 1, len(b.Seqs) - 1}
	var all [][]float32
	logits := fwd(b)
	all = append(all, logits)
	posA, posB := int32(len(sc.promptA)), int32(len(sc.promptB))
	for range sc.steps {
		next := stage.Batch{
			Seqs:    []stage.SeqID{1, 2},
			Pos:     []int32{posA, posB},
			Tokens:  []int32{stagetest.Argmax(logits[:vocab]), stagetest.Argmax(logits[vocab:])},
			Outputs: []int{0, 1},
		}
		logits = fwd(next)
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
	steps:   3,
}

// checkMatchesStock runs sc through ollama's model.Forward (the stock
// engine) and through the engine holding all layers of path, and checks
// that their logits agree within 1e-5 at every step.
func checkMatchesStock(t *testing.T, path string, layers int, opts Options, sc scenario) {
	t.Helper()
	stock, err := OpenStock(path, opts)
	if err != nil {
		t.Fatal(err)
	}
	defer stock.Close()
	want := sc.run(t, func(b stage.Batch) []float32 {
		l, err := stock.Forward(&b)
		if err != nil {
			t.Fatal(err)
		}
		return l
	}, stock.Vocab())

	p := openSplit(t, path, []int{0, layers}, opts)
	defer p.close()
	got := runScenario(t, p, sc)
	for i := range want {
		if d := maxAbsDiff(got[i], want[i]); d > 1e-5 {
			t.Errorf("step %d: max |engine - ollama| = %g, want <= 1e-5", i, d)
		}
	}
}

// TestHiddenLent: a stage that does not own the head lends its hidden
// states (Output.Free), and does not write over them until they are given
// back.
func TestHiddenLent(t *testing.T) {
	p := openSplit(t, storiesPath, []int{0, 2, 5}, Options{Threads: 1, MaxSeqs: 1, Context: 64})
	defer p.close()
	p.open(t, 1)
	e := p.stages[0]
	pass := func(pos int32, tok int32) *stage.Output {
		t.Helper()
		out, err := e.Forward(context.Background(), &stage.Batch{Seqs: []stage.SeqID{1}, Pos: []int32{pos}, Tokens: []int32{tok}})
		if err != nil {
			t.Fatal(err)
		}
		if out.Hidden == nil || out.Free == nil {
			t.Fatalf("pass at %d: hidden %v, lent %v", pos, out.Hidden != nil, out.Free != nil)
		}
		return out
	}
	held := pass(0, 1)
	was := slices.Clone(held.Hidden.Data)
	for pos := int32(1); pos < 6; pos++ {
		out := pass(pos, 100+pos)
		if string(out.Hidden.Data) == string(was) {
			t.Fatalf("pass at %d gave the hidden states of pass 0", pos)
		}
		out.Release()
	}
	if string(held.Hidden.Data) != string(was) {
		t.Fatal("hidden states changed while lent")
	}
	heldAt := &held.Hidden.Data[0]
	held.Release()
	if held.Hidden != nil || held.Free != nil {
		t.Fatal("Release left the output's hidden states")
	}
	// The pool hands out what came back last first.
	if again := pass(6, 7); &again.Hidden.Data[0] != heldAt {
		t.Error("the engine did not reuse the hidden states given back")
	}
}

// TestOneStageMatchesStock: on stories260K the engine computes what
// ollama's model.Forward computes, with flash attention off (ollama's
// setting for llama on a CPU) and on (meshnode's, where its kernel runs).
func TestOneStageMatchesStock(t *testing.T) {
	for _, fa := range []Switch{Off, On} {
		t.Run("flash-attn-"+fa.String(), func(t *testing.T) {
			checkMatchesStock(t, storiesPath, 5, Options{Threads: 1, MaxSeqs: 2, Context: 256, NoRepack: true, FlashAttention: fa}, storiesScenario)
		})
	}
}

func TestSplitEquivalence(t *testing.T) {
	opts := Options{Threads: 1, MaxSeqs: 2, Context: 256}
	ref := openSplit(t, storiesPath, []int{0, 5}, opts)
	ref.open(t, 1, 2)
	vocab := ref.stages[0].Info().Vocab
	want := storiesScenario.run(t, func(b stage.Batch) []float32 { return ref.forward(t, b) }, vocab)
	ref.close()

	splits := [][]int{{0, 1, 5}, {0, 2, 5}, {0, 3, 5}, {0, 4, 5}, {0, 2, 4, 5}}
	for _, bounds := range splits {
		t.Run(fmt.Sprint(bounds), func(t *testing.T) {
			p := openSplit(t, storiesPath, bounds, opts)
			defer p.close()
			p.open(t, 1, 2)
			got := storiesScenario.run(t, func(b stage.Batch) []float32 { return p.forward(t, b) }, vocab)
			for i := range want {
				if d := maxAbsDiff(got[i], want[i]); d > 1e-5 {
					t.Errorf("step %d: max |split - whole| = %g", i, d)
				}
			}
		})
	}
}

func TestSliceHoldsOnlyItsTensors(t *testing.T) {
	dir := t.TempDir()
	for _, r := range [][2]int{{0, 2}, {2, 4}, {4, 5}} {
		path, err := Slice(storiesPath, dir, r[0], r[1], nil)
		if err != nil {
			t.Fatal(err)
		}
		again, err := Slice(storiesPath, dir, r[0], r[1], nil)
		if err != nil || again != path {
			t.Fatalf("slice not reused: %s vs %s (%v)", again, path, err)
		}
		meta, err := readHeader(path)
		if err != nil {
			t.Fatal(err)
		}
		var own uint64
		for i := range meta.Tensors {
			own += meta.Tensors[i].Size()
		}
		e, err := Open(path, r[0], r[1], Options{Threads: 1, MaxSeqs: 1, Context: 64})
		if err != nil {
			t.Fatal(err)
		}
		held := e.WeightBytes()
		e.Close()
		if held < own || float64(held) > 1.1*float64(own) {
			t.Errorf("[%d,%d): holds %d weight bytes, own tensors are %d", r[0], r[1], held, own)
		}
		if filepath.Dir(path) != filepath.Join(dir, "slices") {
			t.Errorf("slice written to %s", path)
		}
	}
}

func TestGreedyThroughF16Wire(t *testing.T) {
	opts := Options{Threads: 1, MaxSeqs: 2, Context: 256}
	gen := func(p *pipeline) []int32 {
		p.open(t, 1)
		toks := []int32{1}
		var out []int32
		for i := range 32 {
			var b stage.Batch
			if i == 0 {
				b = stage.Batch{Seqs: []stage.SeqID{1}, Pos: []int32{0}, Tokens: toks, Outputs: []int{0}}
			} else {
				b = stage.Batch{Seqs: []stage.SeqID{1}, Pos: []int32{int32(i)}, Tokens: []int32{out[len(out)-1]}, Outputs: []int{0}}
			}
			out = append(out, stagetest.Argmax(p.forward(t, b)))
		}
		return out
	}
	whole := openSplit(t, storiesPath, []int{0, 5}, opts)
	want := gen(whole)
	whole.close()
	split := openSplit(t, storiesPath, []int{0, 2, 5}, opts)
	split.wire = stage.F16
	got := gen(split)
	split.close()
	if !slices.Equal(got, want) {
		t.Fatalf("f16 wire tokens differ:\n got %v\nwant %v", got, want)
	}
}

// TestDeviceBandwidthUnknownDevice: a device ggml has not registered is an
// error that names it, not a crash or a zero speed.
func TestDeviceBandwidthUnknownDevice(t *testing.T) {
	if _, err := Devices(storiesPath); err != nil { // loads the backends
		t.Fatal(err)
	}
	_, err := DeviceBandwidth(ml.DeviceInfo{DeviceID: ml.DeviceID{ID: "GPU-none", Library: "CUDA"}})
	if err == nil || !(strings.Contains(err.Error(), "GPU-none") || strings.Contains(err.Error(), "repack tag")) {
		t.Fatalf("measuring a device that is not there: %v", err)
	}
}

// TestDefaultThreads: a stage gets a thread per bytesPerThread of its file,
// at least one and at most every core.
func TestDefaultThreads(t *testing.T) {
	tests := []struct {
		size  int64
		cores int
		want  int
	}{
		{0, 8, 1},
		{1200 << 10, 2, 1}, // stories260K
		{bytesPerThread, 16, 1},
		{2*bytesPerThread + 1, 16, 2},
		{609 << 20, 2, 2}, // 1B Q4_0
		{609 << 20, 64, 19},
		{5 << 30, 16, 16},
		{5 << 30, 1, 1},
	}
	for _, tc := range tests {
		if got := defaultThreads(tc.size, tc.cores); got != tc.want {
			t.Errorf("defaultThreads(%d, %d) = %d, want %d", tc.size, tc.cores, got, tc.want)
		}
	}
}
