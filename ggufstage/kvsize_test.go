package ggufstage

import (
	"context"
	"errors"
	"strings"
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

// TestBrokenAfterPanic: once a call panics inside the engine, every later
// call says so instead of running ggml on half-changed state, and Close
// still works.
func TestBrokenAfterPanic(t *testing.T) {
	e, err := Open(storiesPath, 0, 5, Options{Threads: 1, MaxSeqs: 2, Context: 64})
	if err != nil {
		t.Fatal(err)
	}
	defer e.Close()
	if err := e.Open(1); err != nil {
		t.Fatal(err)
	}
	b := &stage.Batch{Seqs: []stage.SeqID{1}, Pos: []int32{0}, Tokens: []int32{1}, Outputs: []int{0}}
	if err := e.Broken(); err != nil {
		t.Fatalf("a fresh engine says it is broken: %v", err)
	}
	testPanic = func() { panic("cudaMalloc failed: out of memory") }
	_, err = e.Forward(context.Background(), b)
	testPanic = nil
	if err == nil || !strings.Contains(err.Error(), "engine panic: cudaMalloc failed") {
		t.Fatalf("forward: %v, want the panic as an error", err)
	}
	if err := e.Broken(); !errors.Is(err, ErrBroken) {
		t.Errorf("Broken() = %v after the panic, want ErrBroken", err)
	}
	calls := []struct {
		name string
		call func() error
	}{
		{"forward", func() error { _, err := e.Forward(context.Background(), b); return err }},
		{"open", func() error { return e.Open(2) }},
		{"trim", func() error { return e.Trim(1, 0) }},
		{"release", func() error { return e.Release(1) }},
	}
	for _, c := range calls {
		err := c.call()
		if !errors.Is(err, ErrBroken) || !strings.Contains(err.Error(), "out of memory") {
			t.Errorf("%s after the panic: %v, want ErrBroken naming the cause", c.name, err)
		}
	}
	if err := e.Close(); err != nil {
		t.Errorf("close: %v", err)
	}
}
