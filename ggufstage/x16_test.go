package ggufstage

import (
	"fmt"
	"testing"

	"github.com/meshnode/meshnode/ggufstage/gguf"
)

// x16Bound: the kernel quantizes activations exactly as ggml does for Q4_0
// and Q8_0 (Q8_0 blocks, f16 scales) and sums the same integers, so it
// differs from ggml's plain matmul only by float rounding in the per-block
// sums. A mis-laid weight or a wrong row gives errors of order 1.
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
	shapes := []struct {
		k, n, m, threads int
	}{
		{32, 16, 1, 1},
		{2048, 64, 1, 2},
		{160, 48, 3, 1},
		{256, 32, 8, 2},
		{256, 32, 15, 3},
		{4096, 32, 300, 2}, // 64 rows per block: five blocks and a tail of 44
		{8192, 16, 70, 1},  // 32 rows per block
		{2048, 256, 512, 2},
	}
	types := []struct {
		name string
		typ  uint32
	}{{"Q4_0", gguf.TypeQ4_0}, {"Q8_0", gguf.TypeQ8_0}}
	for _, ty := range types {
		for i, sh := range shapes {
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
