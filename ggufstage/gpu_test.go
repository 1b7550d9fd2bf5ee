package ggufstage

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/ollama/ollama/ml"

	"github.com/meshnode/meshnode/ggufstage/synth"
	"github.com/meshnode/meshnode/stage"
	"github.com/meshnode/meshnode/stage/stagetest"
)

// TestGPUSplitEquivalence runs stories260K whole and split on a GPU when
// one is there (OLLAMA_LIBRARY_PATH pointing at a backend built by
// deploy/gpu/build-cuda.sh): the split gives the same greedy tokens. CI
// machines have no GPU, so there it says so and skips.
func TestGPUSplitEquivalence(t *testing.T) {
	devs := needGPU(t)
	opts := Options{Threads: 1, MaxSeqs: 2, Context: 256, Device: "auto"}
	gen := func(p *pipeline) []int32 {
		p.open(t, 1)
		var out []int32
		b := stageBatchAt(0, 1)
		for i := range 32 {
			next := stagetest.Argmax(p.forward(t, b))
			out = append(out, next)
			b = stageBatchAt(int32(i+1), next)
		}
		return out
	}
	whole := openSplit(t, storiesPath, []int{0, 5}, opts)
	if whole.stages[0].Info().Backend == "CPU" {
		t.Fatalf("a GPU was found (%s) but the stage runs on the CPU", devs[0].Library)
	}
	want := gen(whole)
	whole.close()
	split := openSplit(t, storiesPath, []int{0, 2, 5}, opts)
	got := gen(split)
	split.close()
	if !slices.Equal(got, want) {
		t.Fatalf("GPU split tokens differ:\n got %v\nwant %v", got, want)
	}
}

func stageBatchAt(pos, tok int32) stage.Batch {
	return stage.Batch{Seqs: []stage.SeqID{1}, Pos: []int32{pos}, Tokens: []int32{tok}, Outputs: []int{0}}
}

// TestGPUBatchedDecode decodes three sequences together on a GPU and
// checks each against the same sequence decoded alone, which replays a
// CUDA graph every pass. (Reporting steady multi-row decode passes to
// ggml as batch size 1, so that they replay a graph too, made this test
// and a node at 8 streams fail with an illegal memory access on an H200:
// ggml's kernels for several rows are not safe to capture.)
func TestGPUBatchedDecode(t *testing.T) {
	needGPU(t)
	const steps = 40
	starts := []int32{1, 100, 300} // first tokens: three different stories (the vocabulary has 512)
	opts := Options{Threads: 1, MaxSeqs: len(starts), Context: 256, Device: "auto"}
	p := openSplit(t, storiesPath, []int{0, 2, 5}, opts)
	defer p.close()

	// decode runs the sequences of seqs (indexes into starts) together
	// for steps passes and returns each one's greedy tokens.
	decode := func(seqs ...int) [][]int32 {
		for _, s := range seqs {
			p.open(t, stage.SeqID(s))
		}
		out := make([][]int32, len(seqs))
		next := make([]int32, len(seqs))
		for i, s := range seqs {
			next[i] = starts[s]
		}
		for pos := range int32(steps) {
			var b stage.Batch
			for i, s := range seqs {
				b.Seqs, b.Pos, b.Tokens, b.Outputs = append(b.Seqs, stage.SeqID(s)), append(b.Pos, pos), append(b.Tokens, next[i]), append(b.Outputs, i)
			}
			logits := p.forward(t, b)
			vocab := len(logits) / len(seqs)
			for i := range seqs {
				next[i] = stagetest.Argmax(logits[i*vocab : (i+1)*vocab])
				out[i] = append(out[i], next[i])
			}
		}
		for _, st := range p.stages {
			for _, s := range seqs {
				if err := st.Release(stage.SeqID(s)); err != nil {
					t.Fatal(err)
				}
			}
		}
		return out
	}
	together := decode(0, 1, 2)
	for i := range starts {
		alone := decode(i)[0]
		if !slices.Equal(together[i], alone) {
			t.Errorf("sequence %d decoded with two others:\n%v\nalone:\n%v", i, together[i], alone)
		}
	}
}

// needGPU returns the GPU devices ggml loaded, or skips the test where there
// are none, as on CI machines.
func needGPU(t *testing.T) []ml.DeviceInfo {
	t.Helper()
	devs, err := Devices(storiesPath)
	if err != nil {
		t.Fatal(err)
	}
	if len(devs) == 0 {
		t.Skipf("no GPU backend loaded (OLLAMA_LIBRARY_PATH=%q): build one with deploy/gpu/build-cuda.sh on a machine with a GPU", os.Getenv("OLLAMA_LIBRARY_PATH"))
	}
	return devs
}

// TestGPUBandwidth: ggml's copy on the GPU streams memory faster than the
// host's CPU threads read it (on an H200, about 4 TB/s against tens of
// GB/s): it is what the planner weighs a GPU node by.
func TestGPUBandwidth(t *testing.T) {
	devs := needGPU(t)
	gpu, err := DeviceBandwidth(devs[0])
	if err != nil {
		if strings.Contains(err.Error(), "repack tag") {
			t.Skip(err)
		}
		t.Fatal(err)
	}
	cpu := ReadBandwidth(0, 256<<20)
	t.Logf("%s %s: %.0f GB/s; CPU threads: %.0f GB/s", devs[0].Library, devs[0].Description, gpu/1e9, cpu/1e9)
	if gpu <= cpu {
		t.Errorf("the GPU copies at %.1f GB/s, no faster than the CPU reads (%.1f GB/s)", gpu/1e9, cpu/1e9)
	}
}

// TestGPUFusedDecode decodes a Q4_0 llama through meshnode's fused CUDA
// kernels (cuda/fused.cu), through ggml's CUDA graph and through ggml on
// the CPU, fed the same tokens. The fused logits must be as close to
// ggml's CUDA logits as ggml's own CPU kernels are (two independent kernel
// sets that both quantize activations to int8 blocks give the scale of
// honest rounding differences), and the fused path split over two stages
// must give the same bits as one stage. It needs the fused library beside
// ggml's CUDA backend (deploy/gpu/build-cuda.sh builds both). The shapes
// take the Q6_K head's rows in pieces of 16, 8 and 4 bytes (copyWidth in
// cuda/fused.cu) and have four, three and five query heads per KV head;
// the qwen2 model adds q, k and v biases and NeoX rotation.
func TestGPUFusedDecode(t *testing.T) {
	needGPU(t)
	if err := loadFusedLibrary(); err != nil {
		t.Skip(err)
	}
	tests := []struct {
		name                      string
		arch                      string
		embd, heads, kvHeads, ffn int
	}{
		{"n_embd 2048", "llama", 2048, 16, 4, 5632},
		{"n_embd 3072", "llama", 3072, 24, 8, 8192},
		{"n_embd 2560", "llama", 2560, 20, 4, 6912},
		{"qwen2", "qwen2", 2048, 16, 2, 5632},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			testFusedDecode(t, synth.Spec{Arch: tc.arch, Layers: 4, Embd: tc.embd, Heads: tc.heads, KVHeads: tc.kvHeads,
				FFN: tc.ffn, Vocab: 2048, Context: 512, Type: synth.Q4_0, Seed: 7})
		})
	}
}

func testFusedDecode(t *testing.T, spec synth.Spec) {
	path := filepath.Join(t.TempDir(), "q4.gguf")
	if err := synth.Write(path, spec, nil); err != nil {
		t.Fatal(err)
	}
	base := Options{Threads: 2, MaxSeqs: 2, Context: 256, Device: "cuda", FlashAttention: On}
	withFused := func(s Switch) Options { o := base; o.FusedDecode = s; return o }
	ggml := openSplit(t, path, []int{0, 4}, withFused(Off))
	defer ggml.close()
	fused := openSplit(t, path, []int{0, 4}, withFused(On))
	defer fused.close()
	split := openSplit(t, path, []int{0, 2, 4}, withFused(On))
	defer split.close()
	cpu := openSplit(t, path, []int{0, 4}, Options{Threads: 4, MaxSeqs: 2, Context: 256, Device: "cpu", NoRepack: true, FlashAttention: On})
	defer cpu.close()

	prompt := []int32{1, 17, 300, 42, 1024, 5, 77, 901, 13, 2000, 64, 3}
	prefill := promptBatch(1, prompt)
	var next int32
	for _, p := range []*pipeline{ggml, fused, split, cpu} {
		p.open(t, 1)
		next = stagetest.Argmax(p.forward(t, prefill))
	}
	worst, worstCPU := 0.0, 0.0
	for i := range 24 {
		b := stageBatchAt(int32(len(prompt)+i), next)
		want, got, parts, ref := ggml.forward(t, b), fused.forward(t, b), split.forward(t, b), cpu.forward(t, b)
		if !slices.Equal(got, parts) {
			t.Fatalf("step %d: fused logits split over two stages differ from one stage's", i)
		}
		one := func(x []float32) [][]float32 { return [][]float32{x} }
		rel, relCPU, fusedCPU := relErr(one(got), one(want)), relErr(one(ref), one(want)), relErr(one(got), one(ref))
		worst, worstCPU = max(worst, rel), max(worstCPU, relCPU)
		t.Logf("step %2d: relative L2 difference of the logits: fused-ggml CUDA %.2e, ggml CPU-ggml CUDA %.2e, fused-ggml CPU %.2e", i, rel, relCPU, fusedCPU)
		// A wrong layer or garbage is ~1.
		if !(rel < 0.1) {
			t.Fatalf("step %d: fused logits off ggml's by %.3g (relative L2)", i, rel)
		}
		next = stagetest.Argmax(got)
	}
	if worst > 2*worstCPU {
		t.Errorf("fused logits differ from ggml CUDA's by up to %.2e, more than twice ggml's CPU-CUDA difference %.2e", worst, worstCPU)
	}
	for _, p := range []*pipeline{fused, split} {
		for _, s := range p.stages {
			if on, why := s.Fused(); !on {
				t.Fatalf("stage [%d,%d) left the fused path: %s", s.Info().Start, s.Info().End, why)
			}
			if ph := s.Phases(); ph.Passes < 24 {
				t.Fatalf("stage [%d,%d) ran %d passes", s.Info().Start, s.Info().End, ph.Passes)
			}
		}
	}
	t.Logf("over 24 steps, the worst relative L2 difference of the logits: fused-ggml CUDA %.2e, ggml CPU-ggml CUDA %.2e", worst, worstCPU)
}

// TestGPUFusedRows decodes twelve sequences of different lengths together
// through the fused kernels: in one stage, in one pass of twelve rows (two
// of gemvMMA's tiles of eight); in two stages, in reverse order; and
// (MESHNODE_FUSED_ROWS=8) in two passes of six, one tile each. A row's
// logits must have the same bits in all three, and stay near the sequence
// decoded alone (one-row kernels, which sum in another order). ggml's own
// pass of twelve rows is the outside reference; with MESHNODE_FUSED_ROWS=1
// the pass is ggml's.
func TestGPUFusedRows(t *testing.T) {
	needGPU(t)
	if err := loadFusedLibrary(); err != nil {
		t.Skip(err)
	}
	path := filepath.Join(t.TempDir(), "q4.gguf")
	const vocab = 2048
	if err := synth.Write(path, synth.Spec{Arch: "llama", Layers: 4, Embd: 2048, Heads: 16, KVHeads: 4, FFN: 5632, Vocab: vocab,
		Context: 512, Type: synth.Q4_0, Seed: 11}, nil); err != nil {
		t.Fatal(err)
	}
	const seqs = 12
	outputs := make([]int, seqs)
	for i := range outputs {
		outputs[i] = i
	}
	opts := func(s Switch) Options {
		return Options{Threads: 2, MaxSeqs: seqs, Context: 256, Device: "cuda", FlashAttention: On, FusedDecode: s}
	}
	ggml := openSplit(t, path, []int{0, 4}, opts(Off))
	defer ggml.close()
	together := openSplit(t, path, []int{0, 4}, opts(On))
	defer together.close()
	split := openSplit(t, path, []int{0, 2, 4}, opts(On))
	defer split.close()
	alone := openSplit(t, path, []int{0, 4}, opts(On))
	defer alone.close()
	chunked := openSplit(t, path, []int{0, 4}, opts(On))
	defer chunked.close()
	capped := openSplit(t, path, []int{0, 4}, opts(On))
	defer capped.close()
	// Greedy picks instead of logits, of four rows over two stages and of
	// the first row alone.
	picking := openSplit(t, path, []int{0, 2, 4}, opts(On))
	defer picking.close()
	onePick := openSplit(t, path, []int{0, 4}, opts(On))
	defer onePick.close()
	all := []*pipeline{ggml, together, split, alone, chunked, capped, picking, onePick}

	ids := make([]stage.SeqID, seqs)
	pos := make([]int32, seqs)
	next := make([]int32, seqs)
	for s := range seqs {
		ids[s] = stage.SeqID(s + 1)
		prompt := make([]int32, 3+9*s) // prompts of 3 to 102 tokens
		for i := range prompt {
			prompt[i] = int32((s*131+i*17)%2000 + 1)
		}
		prefill := promptBatch(ids[s], prompt)
		for _, p := range all {
			p.open(t, ids[s])
			next[s] = stagetest.Argmax(p.forward(t, prefill))
		}
		pos[s] = int32(prefill.Rows())
	}
	rows := func(x []float32) [][]float32 {
		out := make([][]float32, len(x)/vocab)
		for s := range out {
			out[s] = x[s*vocab : (s+1)*vocab]
		}
		return out
	}
	reverse := func(x []int32) []int32 { y := slices.Clone(x); slices.Reverse(y); return y }
	worst, worstAlone := 0.0, 0.0
	for step := range 12 {
		b := stage.Batch{Seqs: slices.Clone(ids), Pos: slices.Clone(pos), Tokens: slices.Clone(next), Outputs: outputs}
		got := rows(together.forward(t, b))
		if len(got) != seqs {
			t.Fatalf("step %d: logits of %d rows for %d", step, len(got), seqs)
		}
		// Before MESHNODE_FUSED_ROWS changes below: its kernels start at this
		// first decode pass.
		picks := picking.forwardPicks(t, b)
		for s := range seqs {
			if want := stage.GreedyPick(got[s]); picks[s] != want {
				t.Fatalf("step %d: sequence %d's greedy pick %d, want %d, the greedy pick of its logits", step, s+1, picks[s], want)
			}
		}
		rb := stage.Batch{Seqs: slices.Clone(ids), Pos: reverse(pos), Tokens: reverse(next), Outputs: outputs}
		slices.Reverse(rb.Seqs)
		back := rows(split.forward(t, rb))
		// Read as a pipeline's kernels start, at its first decode pass.
		if step == 0 {
			t.Setenv("MESHNODE_FUSED_ROWS", "8")
		}
		in2 := rows(chunked.forward(t, b))
		if step == 0 {
			t.Setenv("MESHNODE_FUSED_ROWS", "1")
		}
		onGGML := rows(capped.forward(t, b))
		for s := range seqs {
			if !slices.Equal(back[seqs-1-s], got[s]) {
				t.Fatalf("step %d: sequence %d in reverse order over two stages differs from one stage's pass", step, s+1)
			}
			if !slices.Equal(in2[s], got[s]) {
				t.Fatalf("step %d: sequence %d in passes of six differs from one pass of twelve", step, s+1)
			}
			one := alone.forward(t, stage.Batch{Seqs: b.Seqs[s : s+1], Pos: b.Pos[s : s+1], Tokens: b.Tokens[s : s+1], Outputs: []int{0}})
			onePicks := onePick.forwardPicks(t, stage.Batch{Seqs: b.Seqs[s : s+1], Pos: b.Pos[s : s+1], Tokens: b.Tokens[s : s+1], Outputs: []int{0}})
			if want := stage.GreedyPick(one); onePicks[0] != want {
				t.Fatalf("step %d: sequence %d alone: greedy pick %d, want %d, the greedy pick of its logits", step, s+1, onePicks[0], want)
			}
			// A few cached f16 values round the other way (see fused_check's
			// checkRows): well under the 5e-2 that parts ggml CUDA's logits
			// from ggml CPU's here.
			rel := relErr([][]float32{got[s]}, [][]float32{one})
			if !(rel < 2e-2) {
				t.Fatalf("step %d: sequence %d decoded with eleven others is off it decoded alone by %.3g (relative L2)", step, s+1, rel)
			}
			worstAlone = max(worstAlone, rel)
		}
		ref := rows(ggml.forward(t, b))
		rel := relErr(got, ref)
		worst = max(worst, rel)
		if !(rel < 0.1) {
			t.Fatalf("step %d: fused logits of twelve rows off ggml's by %.3g (relative L2)", step, rel)
		}
		// With one row a pass it runs on ggml, as the reference does.
		if rel := relErr(onGGML, ref); !(rel < 1e-5) {
			t.Fatalf("step %d: a pass of twelve rows with MESHNODE_FUSED_ROWS=1 is off ggml's by %.3g: it did not run on ggml", step, rel)
		}
		for s := range seqs {
			next[s] = stagetest.Argmax(got[s])
			pos[s]++
		}
	}
	for _, p := range []*pipeline{together, split, chunked, capped, picking, onePick} {
		for _, s := range p.stages {
			if on, why := s.Fused(); !on {
				t.Fatalf("stage %s left the fused path: %s", s.Info().Range(), why)
			}
		}
	}
	t.Logf("12 steps of twelve rows: the same bits in one stage, in two and in passes of six; worst relative L2 difference from each sequence alone %.2e, from ggml's twelve-row pass %.2e", worstAlone, worst)
}
