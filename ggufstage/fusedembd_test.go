//go:build repack && cgo

package ggufstage

import (
	"path/filepath"
	"slices"
	"testing"

	"github.com/meshnode/meshnode/ggufstage/synth"
	"github.com/meshnode/meshnode/stage/stagetest"
)

// TestGPUFusedDeviceEmbedding: a fused first stage looks token rows up on
// the GPU, in its copy of the embedding ggml keeps in host memory, and its
// logits have the bits of the host's lookup (MESHNODE_FUSED_HOST_EMBD=1):
// both dequantize a Q4_0 row as d·(q-8) in float.
func TestGPUFusedDeviceEmbedding(t *testing.T) {
	needGPU(t)
	if err := loadFusedLibrary(); err != nil {
		t.Skip(err)
	}
	path := filepath.Join(t.TempDir(), "q4.gguf")
	spec := synth.Spec{Arch: "llama", Layers: 2, Embd: 2048, Heads: 16, KVHeads: 4, FFN: 5632, Vocab: 2048, Context: 512, Type: synth.Q4_0, Seed: 11}
	if err := synth.Write(path, spec, nil); err != nil {
		t.Fatal(err)
	}
	opts := Options{Threads: 2, MaxSeqs: 2, Context: 256, Device: "cuda", FlashAttention: On, FusedDecode: On}
	run := func(wantDevice bool) [][]float32 {
		p := openSplit(t, path, []int{0, 2}, opts)
		defer p.close()
		p.open(t, 1)
		prompt := []int32{1, 900, 12, 77, 1500, 3}
		next := stagetest.Argmax(p.forward(t, promptBatch(1, prompt)))
		var steps [][]float32
		for i := range 8 {
			got := p.forward(t, stageBatchAt(int32(len(prompt)+i), next))
			steps = append(steps, got)
			next = stagetest.Argmax(got)
		}
		f, ok := p.stages[0].fused.(*cudaFused)
		switch {
		case !ok || f.h == nil:
			t.Fatalf("the stage did not decode on the fused path: %s", p.stages[0].fusedWhy)
		case wantDevice && f.devEmbd == nil:
			t.Fatalf("token rows looked up on the host: %s", f.embdWhy)
		case !wantDevice && f.hostEmbd == nil:
			t.Fatal("token rows looked up on the GPU with MESHNODE_FUSED_HOST_EMBD=1")
		}
		return steps
	}
	dev := run(true)
	t.Setenv("MESHNODE_FUSED_HOST_EMBD", "1")
	host := run(false)
	for i := range dev {
		if !slices.Equal(dev[i], host[i]) {
			t.Fatalf("step %d: logits with the GPU's embedding lookup differ from the host's", i)
		}
	}
}
