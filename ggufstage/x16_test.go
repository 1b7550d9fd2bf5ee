package ggufstage

import (
	"fmt"
	"testing"

	"github.com/meshnode/meshnode/ggufstage/gguf"
)

// x16Bound: the kernel quantizes activations exactly as ggml does (Q8_0
// blocks with f16 scales for Q4_0 and Q8_0, Q8_K for Q4_K and Q6_K) and sums
// the same integers, so it differs from ggml's plain matmul only by float
// rounding in the per-block sums. A mis-laid weight or a wrong row gives
// errors of order 1.
const x16Bound = 1e-5

// TestX16MatchesGGML checks meshnode's kernel against ggml's plain matmul
// on shapes that exercise its paths: a single row (decode), row tails of
// 1..7 past whole groups of 8, several blocks of rows, one and several
// threads, and a K that is not a multiple of 64.
func TestX16MatchesGGML(t *testing.T) {
	if !x16CPU() {
		if x16CPUHas() {
			t.Fatal("the CPU has AVX512-VNNI but the X16 kernel did not register with ggml's CPU backend")
		}
		t.Skip("no X16 kernel in this build or on this CPU (needs the repack build tag and AVX512-VNNI)")
	}
	type shape struct{ k, n, m, threads int }
	shapes := []shape{
		{32, 16, 1, 1},
		{2048, 64, 1, 2},
		{160, 48, 3, 1},
		{256, 32, 8, 2},
		{256, 32, 15, 3},
		{4096, 32, 300, 2}, // 64 rows per block: five blocks and a tail of 44
		{8192, 16, 70, 1},  // 32 rows per block
		{2048, 256, 512, 2},
	}
	kShapes := []shape{
		{256, 16, 1, 1},
		{2048, 64, 1, 2},
		{768, 48, 3, 1},
		{256, 32, 15, 3},
		{4096, 32, 300, 2},
		{8192, 16, 70, 1},
		{2048, 256, 512, 2},
	}
	types := []struct {
		name   string
		typ    uint32
		shapes []shape
	}{
		{"Q4_0", gguf.TypeQ4_0, shapes},
		{"Q8_0", gguf.TypeQ8_0, shapes},
		{"Q4_K", gguf.TypeQ4_K, kShapes},
		{"Q6_K", gguf.TypeQ6_K, kShapes},
	}
	for _, ty := range types {
		for i, sh := range ty.shapes {
			t.Run(fmt.Sprintf("%s/k%d_n%d_m%d_t%d", ty.name, sh.k, sh.n, sh.m, sh.threads), func(t *testing.T) {
				rel := x16Check(ty.typ, sh.k, sh.n, sh.m, sh.threads, uint32(i+1))
				if rel < 0 {
					t.Fatal("the kernel refused the shape")
				}
				t.Logf("max|x16 − ggml| / max|ggml| = %.3g", rel)
				if rel > x16Bound {
					t.Errorf("relative difference %.3g over %g", rel, x16Bound)
				}
			})
		}
	}
}

// BenchmarkX16 times meshnode's kernel against ggml's plain matmul, for one
// row (a decode step: its weight, 8192 × 16384, is larger than L3, so this
// measures streaming from memory) and 64 rows (prefill: the 1B model's
// ffn_down shape, 8192 → 2048), and reports weight GB/s of each and their
// ratio.
func BenchmarkX16(b *testing.B) {
	if !x16CPU() {
		b.Skip("no X16 kernel in this build or on this CPU")
	}
	types := []struct {
		name string
		typ  uint32
		bpw  float64 // bytes per weight in ggml's layout
	}{
		{"Q4_0", gguf.TypeQ4_0, 18.0 / 32}, {"Q8_0", gguf.TypeQ8_0, 34.0 / 32},
		{"Q4_K", gguf.TypeQ4_K, 144.0 / 256}, {"Q6_K", gguf.TypeQ6_K, 210.0 / 256},
	}
	shapes := []struct{ k, n, m int }{{8192, 16384, 1}, {8192, 2048, 64}}
	for _, ty := range types {
		for _, sh := range shapes {
			k, n, m := sh.k, sh.n, sh.m
			b.Run(fmt.Sprintf("%s/m%d", ty.name, m), func(b *testing.B) {
				iters := max(b.N, 3)
				own, ref := x16Time(ty.typ, k, n, m, 2, iters)
				if own <= 0 || ref <= 0 {
					b.Fatal("the kernel refused the shape")
				}
				gb := float64(k*n) * ty.bpw / 1e9
				b.ReportMetric(gb/own, "x16-GB/s")
				b.ReportMetric(gb/ref, "ggml-GB/s")
				b.ReportMetric(ref/own, "x16/ggml")
			})
		}
	}
}
