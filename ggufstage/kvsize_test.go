package ggufstage

import (
	"context"
	"testing"

	"github.com/meshnode/meshnode/stage"
)

// TestKVCacheSize checks the KV cache the backend really allocates: one
// context of positions per sequence, MaxSeqs of them, not MaxSeqs times
// more (ollama's Causal.Init multiplies the capacity it is given by the
// sequence count itself).
func TestKVCacheSize(t *testing.T) {
	info, err := ReadInfo(storiesPath)
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct{ seqs, ctx int }{{1, 64}, {3, 64}, {4, 256}}
	for _, tc := range tests {
		e, err := Open(storiesPath, 0, info.Layers, Options{Threads: 1, MaxSeqs: tc.seqs, Context: tc.ctx})
		if err != nil {
			t.Fatal(err)
		}
		if err := e.Open(1); err != nil {
			t.Fatal(err)
		}
		// The cache allocates its tensors on first use.
		b := &stage.Batch{Seqs: []stage.SeqID{1}, Pos: []int32{0}, Tokens: []int32{1}, Outputs: []int{0}}
		if _, err := e.Forward(context.Background(), b); err != nil {
			t.Fatal(err)
		}
		mem := e.backend.BackendMemory()
		var got uint64
		for _, c := range mem.CPU.Cache {
			got += c
		}
		// K and V, f16, per position and layer; the cells are padded to
		// the CPU backend's 256.
		perPos := uint64(2 * 2 * info.KVHeads * info.HeadDim * info.Layers)
		cells := (tc.seqs*tc.ctx + 255) / 256 * 256
		if want := perPos * uint64(cells); got != want {
			t.Errorf("%d seqs x %d positions: KV cache of %d bytes, want %d (%d cells)", tc.seqs, tc.ctx, got, want, cells)
		}
		e.Close()
	}
}
