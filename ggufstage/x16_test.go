package ggufstage

import (
	"fmt"
	"testing"
)

// q4x16Bound: the kernel quantizes activations exactly as ggml does for
// Q4_0 (Q8_0 blocks, f16 scales) and sums the same integers, so it differs
// from ggml's plain matmul only by float rounding in the per-block sums.
// A mis-laid weight or a wrong row gives errors of order 1.
const q4x16Bound = 1e-5

// TestQ4X16MatchesGGML checks meshnode's Q4_0 kernel against ggml's plain
// Q4_0 matmul on shapes that exercise its paths: a single row (decode), row
// tails of 1..7 past whole groups of 8, several blocks of rows, one and
// several threads, and a K that is not a multiple of 64.
func TestQ4X16MatchesGGML(t *testing.T) {
	if q4x16Check(32, 16, 1, 1, 1) < 0 {
		t.Skip("no Q4X16 kernel in this build or on this CPU (needs the repack build tag and AVX512-VNNI)")
	}
	tests := []struct {
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
	for i, tt := range tests {
		t.Run(fmt.Sprintf("k%d_n%d_m%d_t%d", tt.k, tt.n, tt.m, tt.threads), func(t *testing.T) {
			rel := q4x16Check(tt.k, tt.n, tt.m, tt.threads, uint32(i+1))
			if rel < 0 {
				t.Fatal("the kernel refused the shape")
			}
			t.Logf("max|q4x16 − ggml| / max|ggml| = %.3g", rel)
			if rel > q4x16Bound {
				t.Errorf("relative difference %.3g over %g", rel, q4x16Bound)
			}
		})
	}
}
