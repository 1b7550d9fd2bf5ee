package ggufstage

import (
	"fmt"
	"testing"
)

func needAttn(t *testing.T) {
	t.Helper()
	if !cpuAttention() {
		if x16CPUHas() {
			t.Fatal("the CPU has AVX-512 but meshnode's attention kernel is not hooked into ggml")
		}
		t.Skip("no meshnode attention kernel in this build or on this CPU (needs the repack build tag and AVX512-VNNI)")
	}
}

// TestAttentionExact checks meshnode's CPU attention against attention
// computed in double precision from the same f16 K and V (and queries
// rounded to f16, as ggml's kernels and llama.cpp's round them), on shapes with
// GQA groups of 1 to 8, head sizes of the supported models, prefill-sized
// query blocks, rows that see nothing, and one to three threads. The
// kernel computes in f32: 1e-5 is far above its rounding and far below
// any wrong cell, head or weight. ggml's kernel, which accumulates in f16,
// is measured alongside for comparison.
func TestAttentionExact(t *testing.T) {
	needAttn(t)
	shapes := []struct {
		dk, nq, heads, kvHeads, nkv, threads int
	}{
		{64, 1, 32, 8, 640, 2},
		{128, 1, 32, 8, 1000, 1},
		{128, 7, 28, 4, 77, 3},
		{64, 33, 8, 8, 33, 2},
		{16, 2, 8, 1, 5, 1},
		{8, 11, 8, 4, 40, 2}, // stories260K's heads
		{40, 3, 6, 3, 70, 2},
		{128, 64, 16, 2, 300, 2},
	}
	for i, sh := range shapes {
		t.Run(fmt.Sprintf("dk%d_q%d_h%d_kv%d_cells%d_t%d", sh.dk, sh.nq, sh.heads, sh.kvHeads, sh.nkv, sh.threads), func(t *testing.T) {
			got := attnCheck(sh.dk, sh.nq, sh.heads, sh.kvHeads, sh.nkv, sh.threads, uint32(i+1), false)
			ggml := attnCheck(sh.dk, sh.nq, sh.heads, sh.kvHeads, sh.nkv, sh.threads, uint32(i+1), true)
			if got < 0 {
				t.Fatal("the kernel did not run")
			}
			t.Logf("max error / max value: meshnode %.3g, ggml %.3g", got, ggml)
			if got > 1e-5 {
				t.Errorf("relative error %.3g over 1e-5", got)
			}
		})
	}
}

// TestAttentionWhereverCellsSit: a query's result must not change in any
// bit when its cells sit elsewhere in the cache, among other sequences'
// cells, in the same order or in another (as after a replay, which writes
// a sequence's history into other cells than decoding filled one by one).
// The seeds are fixed, so the outcome is too. ggml's kernel is shown to
// fail the reordered case, which kept flash attention off on CPUs before.
func TestAttentionWhereverCellsSit(t *testing.T) {
	needAttn(t)
	ggmlChanged := 0
	for i, sh := range []struct{ dk, heads, kvHeads, n int }{
		{64, 32, 8, 700}, {128, 32, 8, 300}, {64, 8, 8, 17}, {128, 28, 4, 1000}, {64, 32, 8, 3000}, {8, 8, 4, 300},
	} {
		for _, shuffle := range []bool{false, true} {
			if d := attnMoved(sh.dk, sh.heads, sh.kvHeads, sh.n, uint32(i+1), false, shuffle); d != 0 {
				t.Errorf("dk %d, %d heads / %d KV heads, %d cells, reordered %v: %d outputs changed when the cells moved", sh.dk, sh.heads, sh.kvHeads, sh.n, shuffle, d)
			}
			if shuffle {
				ggmlChanged += attnMoved(sh.dk, sh.heads, sh.kvHeads, sh.n, uint32(i+1), true, true)
			}
		}
	}
	t.Logf("ggml's kernel: %d outputs changed when the cells were reordered", ggmlChanged)
	if ggmlChanged == 0 {
		t.Error("ggml's kernel gave the same bits too: the cells were not really reordered, so this test shows nothing")
	}
}

// TestDevicesLeavesAllocation: probing devices (a dry-run load) must not
// leave ggml's CPU buffer type unable to allocate. It did: ollama's ggml
// marks the buffer types of a scheduler made without allocation
// process-wide, and the next buffer made outside a full load got no memory
// (this check then crashed on it).
func TestDevicesLeavesAllocation(t *testing.T) {
	needAttn(t)
	if _, err := Devices(storiesPath); err != nil {
		t.Fatal(err)
	}
	if got := attnCheck(64, 2, 8, 2, 40, 1, 9, false); got < 0 || got > 1e-5 {
		t.Fatalf("attention after probing devices: relative error %g", got)
	}
}
