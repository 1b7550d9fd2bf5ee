package ggufstage

// Split equivalence on random-weight models of every supported
// architecture. stories260K (engine_test.go) is one llama with an untied
// head; the synth models add qwen2 (q/k/v biases, byte-level BPE) and qwen3
// (q/k norms), both with a tied head, whose last-stage slice must carry the
// embedding renamed to output.weight.

import (
	"fmt"
	"math"
	"path/filepath"
	"slices"
	"testing"

	"github.com/meshnode/meshnode/ggufstage/gguf"
	"github.com/meshnode/meshnode/ggufstage/synth"
	"github.com/meshnode/meshnode/stage"
	"github.com/meshnode/meshnode/stage/stagetest"
)

// writeTiny writes synth's tiny preset of arch in file type ft.
func writeTiny(t *testing.T, arch string, ft synth.FileType) string {
	t.Helper()
	spec := synth.Tiny(arch)
	spec.Type = ft
	path := filepath.Join(t.TempDir(), fmt.Sprintf("%s-%s.gguf", arch, ft))
	if err := synth.Write(path, spec, nil); err != nil {
		t.Fatal(err)
	}
	return path
}

// synthScenario mixes a 7-token and a 4-token prompt in one prefill batch,
// then decodes both together; token ids are anywhere in the 512 vocabulary.
var synthScenario = scenario{
	promptA: []int32{1, 17, 250, 33, 400, 78, 5},
	promptB: []int32{2, 300, 42, 128},
	steps:   3,
}

// tinyOpts keeps tests light on a shared machine: one thread (ggml threads
// busy-wait), two sequences, a short context.
var tinyOpts = Options{Threads: 1, MaxSeqs: 2, Context: 64}

func runScenario(t *testing.T, p *pipeline, sc scenario) [][]float32 {
	t.Helper()
	p.open(t, 1, 2)
	return sc.run(t, func(b stage.Batch) []float32 { return p.forward(t, b) }, p.stages[len(p.stages)-1].Info().Vocab)
}

// TestSynthSplitEquivalence: every 2-way split and a 3-way split compute
// the logits of the one-stage run, for each architecture. The hidden states
// cross stages in f32, so only summation order could differ: 1e-5 is far
// below any change a wrong tensor, position or cache slot would cause.
func TestSynthSplitEquivalence(t *testing.T) {
	splits := [][]int{{0, 1, 3}, {0, 2, 3}, {0, 1, 2, 3}}
	for _, arch := range Architectures {
		t.Run(arch, func(t *testing.T) {
			src := writeTiny(t, arch, synth.F32)
			ref := openSplit(t, src, []int{0, 3}, tinyOpts)
			want := runScenario(t, ref, synthScenario)
			ref.close()
			if vocab := len(want[0]) / 2; vocab != 512 {
				t.Fatalf("one-stage logits are %d wide, want 512", vocab)
			}
			for _, bounds := range splits {
				t.Run(fmt.Sprint(bounds), func(t *testing.T) {
					p := openSplit(t, src, bounds, tinyOpts)
					defer p.close()
					got := runScenario(t, p, synthScenario)
					for i := range want {
						if d := maxAbsDiff(got[i], want[i]); d > 1e-5 {
							t.Errorf("step %d: max |split - whole| = %g, want <= 1e-5", i, d)
						}
					}
				})
			}
		})
	}
}

// greedy generates n tokens from token 1 by argmax, one sequence.
func greedy(t *testing.T, p *pipeline, n int) []int32 {
	t.Helper()
	p.open(t, 1)
	out := []int32{1}
	for i := range n {
		b := stage.Batch{Seqs: []stage.SeqID{1}, Pos: []int32{int32(i)}, Tokens: []int32{out[i]}, Outputs: []int{0}}
		out = append(out, stagetest.Argmax(p.forward(t, b)))
	}
	return out[1:]
}

// TestSynthGreedyThroughF16Wire: with activations rounded to f16 between
// stages (what the mesh sends by default), greedy decoding still picks the
// same 32 tokens as the unsplit model.
func TestSynthGreedyThroughF16Wire(t *testing.T) {
	for _, arch := range Architectures {
		t.Run(arch, func(t *testing.T) {
			src := writeTiny(t, arch, synth.F32)
			whole := openSplit(t, src, []int{0, 3}, tinyOpts)
			want := greedy(t, whole, 32)
			whole.close()
			split := openSplit(t, src, []int{0, 1, 2, 3}, tinyOpts)
			defer split.close()
			split.wire = stage.F16
			got := greedy(t, split, 32)
			if !slices.Equal(got, want) {
				t.Fatalf("f16 wire tokens differ:\n got %v\nwant %v", got, want)
			}
			// A model stuck on one token would make this test vacuous.
			if distinct := len(slices.Compact(slices.Sorted(slices.Values(want)))); distinct < 4 {
				t.Errorf("greedy run has only %d distinct tokens: %v", distinct, want)
			}
		})
	}
}

// TestSynthOneStageMatchesStock: the engine's own loop over ollama's layers
// (embed, blocks, head) computes what ollama's model.Forward computes, on
// F32 and F16 weights, for each architecture, with and without flash
// attention (the same on both sides). Repacking is off so that the weights
// are the same bytes in the same layout on both sides.
func TestSynthOneStageMatchesStock(t *testing.T) {
	for _, arch := range Architectures {
		for _, c := range []struct {
			ft synth.FileType
			fa Switch
		}{{synth.F32, Off}, {synth.F16, Off}, {synth.F32, On}, {synth.F16, On}} {
			opts := tinyOpts
			opts.NoRepack, opts.FlashAttention = true, c.fa
			ft := c.ft
			t.Run(fmt.Sprintf("%s/%s/flash-attn-%s", arch, ft, c.fa), func(t *testing.T) {
				checkMatchesStock(t, writeTiny(t, arch, ft), 3, opts, synthScenario)
			})
		}
	}
}

// relErr is ‖a−b‖/‖b‖ over all steps.
func relErr(a, b [][]float32) float64 {
	var num, den float64
	for i := range b {
		for j := range b[i] {
			d := float64(a[i][j] - b[i][j])
			num += d * d
			den += float64(b[i][j]) * float64(b[i][j])
		}
	}
	return math.Sqrt(num / den)
}

// repackable counts the tensors of a file that take a fast CPU layout: on
// AVX512-VNNI meshnode's X16 (Q4_0, Q8_0, Q4_K and Q6_K matrices of whole
// 16-row tiles), else ggml's CPU_REPACK (see meshnode_repack_ok: 2-D Q4_0
// or Q4_K matrices whose row count is a multiple of 8 (AVX2; NEON needs 4
// or 8, which these also meet)); the token embedding excepted since it is
// read by row lookups.
func repackable(t *testing.T, path string) int {
	t.Helper()
	meta, err := readHeader(path)
	if err != nil {
		t.Fatal(err)
	}
	_, hasOutput := meta.Tensor("output.weight")
	n := 0
	for _, ti := range meta.Tensors {
		if len(ti.Shape) != 2 {
			continue
		}
		// The embedding stays plain for its row lookups; with a tied head,
		// its copy in output.weight is a matmul weight like any other.
		if ti.Name == "token_embd.weight" && hasOutput {
			continue
		}
		switch {
		case (ti.Type == gguf.TypeQ4_0 || ti.Type == gguf.TypeQ8_0 || ti.Type == gguf.TypeQ4_K || ti.Type == gguf.TypeQ6_K) && x16CPU() && ti.Shape[1]%16 == 0:
			n++ // meshnode's X16
		case (ti.Type == gguf.TypeQ4_0 || ti.Type == gguf.TypeQ4_K) && ti.Shape[1]%8 == 0:
			n++ // ggml's repacked layout
		}
	}
	return n
}

// repackBound bounds ‖repacked − plain‖/‖plain‖ of the logits over the
// scenario. The two are not the same computation: both quantize each
// activation row to Q8_0 (Q8_K for K-quants) before the matmul, but the
// repacked kernels work on four interleaved rows and columns at once and so
// quantize and sum in another order. Their outputs differ in the last bit,
// which is usually absorbed when the next matmul quantizes its input to 8
// bits, but now and then moves a value across a rounding boundary of that
// quantization; from there the difference is of the size of one Q8 step
// and travels through the remaining layers. Measured here (AVX-512 CPU, one
// thread, deterministic): llama Q4_0 and every Q4_K_M file bit-identical,
// qwen2 Q4_0 8.6e-3, qwen3 Q4_0 6.4e-3 (1.3e-2 on its worst step). 2e-2
// leaves margin for other CPUs' kernels while a mis-laid or unwritten
// weight gives errors of order 1 (zeroing the repacked data gives
// logits off by 5 to 14).
const repackBound = 2e-2

// TestRepackedMatchesPlain loads quantized files with and without the fast
// CPU layouts (meshnode's X16 for Q4_0/Q8_0/Q4_K/Q6_K on AVX512-VNNI,
// ggml's repacked one otherwise) and checks that the logits agree to
// repackBound, that in a repack build exactly the qualifying tensors were
// re-homed, and that X16 agrees with ggml's kernels to well within a Q8
// step. (Bit-identical logits do not prove that nothing was repacked: see
// repackBound. The count does, since a re-homed tensor's plain storage is
// never written.) Tiny's Q4_K_M takes the fast path only for its ffn_down
// (two Q4_K, one Q6_K) and its Q8_0 matrices: the others fall back to Q5_0
// since their 128-wide rows are not whole K-quant blocks. Attention is ggml's plain path here: it rounds
// scores and weights to f16, which hides the last-bit differences of the
// matmuls that these bounds are about; meshnode's f32 attention lets a
// random tiny model amplify them (to 7.5e-4 on qwen3 Q8_0).
func TestRepackedMatchesPlain(t *testing.T) {
	tinyOpts := tinyOpts
	tinyOpts.FlashAttention = Off
	for _, arch := range Architectures {
		for _, ft := range []synth.FileType{synth.Q4_0, synth.Q8_0, synth.Q4_K} {
			t.Run(fmt.Sprintf("%s/%s", arch, ft), func(t *testing.T) {
				src := writeTiny(t, arch, ft)
				plainOpts := tinyOpts
				plainOpts.NoRepack = true
				plain := openSplit(t, src, []int{0, 3}, plainOpts)
				want := runScenario(t, plain, synthScenario)
				plain.close()

				fast := openSplit(t, src, []int{0, 3}, tinyOpts)
				defer fast.close()
				got := runScenario(t, fast, synthScenario)

				rel := relErr(got, want)
				t.Logf("‖repacked − plain‖/‖plain‖ = %.3g", rel)
				if !(rel <= repackBound) {
					t.Errorf("repacked logits differ from plain by %.3g relative, over %g", rel, repackBound)
				}
				if a, b := stagetest.Argmax(got[0]), stagetest.Argmax(want[0]); a != b {
					t.Logf("first greedy token differs (%d vs %d): a near tie", a, b)
				}

				done := fast.stages[0].extra.(*repacker).count()
				expect := 0
				if RepackAvailable && repackCPU() {
					expect = repackable(t, src)
					if expect == 0 && !x16CPU() {
						// ggml repacks only Q4_0 and Q4_K; meshnode's X16 takes the
						// rest where the CPU has AVX512-VNNI.
						t.Skipf("no %s tensor takes a fast layout on this CPU (X16 needs AVX512-VNNI)", ft)
					}
					if expect == 0 {
						t.Fatalf("%s has no repackable tensors: the test would check nothing", ft)
					}
				}
				if done != expect {
					t.Errorf("%d tensors repacked, want %d (repack build: %v, CPU kernels: %v)", done, expect, RepackAvailable, repackCPU())
				}
				identical := true
				for i := range got {
					identical = identical && slices.Equal(got[i], want[i])
				}
				t.Logf("%d tensors repacked; logits bit-identical: %v", done, identical)
				// meshnode's Q4_0 kernel sums the same integers as ggml's
				// repacked one, from identically quantized activations.
				if r := fast.stages[0].extra.(*repacker); r != nil && r.own > 0 {
					useX16 = false
					defer func() { useX16 = true }()
					ggmlFast := openSplit(t, src, []int{0, 3}, tinyOpts)
					defer ggmlFast.close()
					if rp := ggmlFast.stages[0].extra.(*repacker); rp.own != 0 {
						t.Fatalf("with X16 off, %d tensors are in X16", rp.own)
					}
					ref := runScenario(t, ggmlFast, synthScenario)
					rel := relErr(got, ref)
					t.Logf("%d tensors in meshnode's X16 layout: ‖x16 − ggml‖/‖ggml‖ = %.3g", r.own, rel)
					if !(rel <= x16Bound*10) {
						t.Errorf("X16 logits differ from ggml's by %.3g relative, over %g", rel, x16Bound*10)
					}
				}
				// With nothing repacked the two engines are the same computation.
				if done == 0 && !identical {
					t.Error("no tensor was repacked, yet the logits differ from the plain engine's")
				}
			})
		}
	}
}

// TestSynthWeightBytes: each stage of a split holds about the bytes of its
// slice's tensors (ggml adds alignment only), and the slices of a tied model
// hold the embedding once per stage that needs it: as token_embd on the
// first, renamed output.weight on the last.
func TestSynthWeightBytes(t *testing.T) {
	cases := []struct {
		arch string
		ft   synth.FileType
	}{
		{"llama", synth.F32}, {"qwen2", synth.Q4_0}, {"qwen3", synth.F16}, {"llama", synth.Q4_K},
	}
	for _, c := range cases {
		t.Run(fmt.Sprintf("%s/%s", c.arch, c.ft), func(t *testing.T) {
			src := writeTiny(t, c.arch, c.ft)
			srcMeta, err := readHeader(src)
			if err != nil {
				t.Fatal(err)
			}
			emb, _ := srcMeta.Tensor("token_embd.weight")
			_, untied := srcMeta.Tensor("output.weight")
			dir := t.TempDir()
			for _, r := range [][2]int{{0, 1}, {1, 3}, {0, 2}, {2, 3}, {1, 2}} {
				path, meta := sliceHeader(t, src, dir, r[0], r[1])
				var own uint64
				for i := range meta.Tensors {
					own += meta.Tensors[i].Size()
				}
				_, hasEmb := meta.Tensor("token_embd.weight")
				out, hasOut := meta.Tensor("output.weight")
				if hasEmb != (r[0] == 0) {
					t.Errorf("[%d,%d): token_embd.weight present %v", r[0], r[1], hasEmb)
				}
				if hasOut != (r[1] == 3) {
					t.Errorf("[%d,%d): output.weight present %v", r[0], r[1], hasOut)
				}
				if hasOut && !untied && (out.Type != emb.Type || !slices.Equal(out.Shape, emb.Shape)) {
					t.Errorf("[%d,%d): tied head is %s %v, embedding %s %v", r[0], r[1], out.TypeName(), out.Shape, emb.TypeName(), emb.Shape)
				}

				// ReadInfo checks a slice for the tensors of its own range.
				if mi, err := ReadInfo(path); err != nil || mi.Layers != 3 {
					t.Errorf("ReadInfo of slice [%d,%d): %+v %v", r[0], r[1], mi, err)
				}
				e, err := Open(path, r[0], r[1], tinyOpts)
				if err != nil {
					t.Fatal(err)
				}
				held := e.WeightBytes()
				e.Close()
				if held < own || float64(held) > 1.1*float64(own) {
					t.Errorf("[%d,%d): holds %d weight bytes, its slice's tensors are %d", r[0], r[1], held, own)
				}
			}
		})
	}
}
