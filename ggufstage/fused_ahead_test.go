//go:build repack && cgo

package ggufstage

import (
	"path/filepath"
	"slices"
	"testing"

	"github.com/meshnode/meshnode/ggufstage/synth"
	"github.com/meshnode/meshnode/stage"
	"github.com/meshnode/meshnode/stage/stagetest"
)

// TestGPUFusedAhead decodes greedily through the fused kernels with each
// next pass queued ahead of the caller (aheadPass, mf_queue_picks), and
// step by step (MESHNODE_FUSED_AHEAD=0), through the same script: a
// steady run, a trim back and the same tokens again, another sequence's
// prefill (on ggml) while a pass is queued, both sequences in one pass,
// and one released while a pass of both is queued. Every pick must be the
// same: a pass queued ahead computes what the caller's would, and one the
// caller does not take leaves no trace. The passes queued ahead must have
// been taken and dropped both (from the second pass of each run of
// continuations on, see aheadPlan: 30 taken, 4 dropped).
func TestGPUFusedAhead(t *testing.T) {
	needGPU(t)
	if err := loadFusedLibrary(); err != nil {
		t.Skip(err)
	}
	path := filepath.Join(t.TempDir(), "q4.gguf")
	spec := synth.Spec{Arch: "llama", Layers: 4, Embd: 2048, Heads: 16, KVHeads: 4, FFN: 5632, Vocab: 2048, Context: 512,
		Type: synth.Q4_0, Seed: 11}
	if err := synth.Write(path, spec, nil); err != nil {
		t.Fatal(err)
	}
	opts := Options{Threads: 2, MaxSeqs: 3, Context: 256, Device: "cuda", FlashAttention: On, FusedDecode: On}
	script := func(p *pipeline) []int32 {
		var picks []int32
		p.open(t, 1, 2)
		prefill := func(seq stage.SeqID, prompt []int32) int32 {
			return stagetest.Argmax(p.forward(t, promptBatch(seq, prompt)))
		}
		// history[i] is sequence 1's token at position i.
		history := []int32{1, 17, 300, 42, 1024, 5, 77, 901}
		history = append(history, prefill(1, history))
		decode := func(steps int) {
			for range steps {
				pos := int32(len(history) - 1)
				got := p.forwardPicks(t, stage.Batch{Seqs: []stage.SeqID{1}, Pos: []int32{pos}, Tokens: []int32{history[pos]}, Outputs: []int{0}})
				picks, history = append(picks, got[0]), append(history, got[0])
			}
		}
		decode(20)
		// Back five positions, and the same tokens again.
		back := int32(len(history) - 6)
		if err := p.stages[0].Trim(1, back); err != nil {
			t.Fatal(err)
		}
		history = history[:back+1]
		decode(5)
		next2 := prefill(2, []int32{1, 9, 99, 999, 4, 44})
		decode(5)
		pos2 := int32(6)
		for range 5 { // both in one pass
			pos1 := int32(len(history) - 1)
			got := p.forwardPicks(t, stage.Batch{Seqs: []stage.SeqID{1, 2}, Pos: []int32{pos1, pos2},
				Tokens: []int32{history[pos1], next2}, Outputs: []int{0, 1}})
			picks, history, next2, pos2 = append(picks, got...), append(history, got[0]), got[1], pos2+1
		}
		if err := p.stages[0].Release(2); err != nil {
			t.Fatal(err)
		}
		decode(5)
		return picks
	}
	t.Setenv("MESHNODE_FUSED_AHEAD", "0")
	ref := openSplit(t, path, []int{0, 4}, opts)
	want := script(ref)
	if f := ref.stages[0].fused.(*cudaFused); f.queues || f.taken+f.dropped > 0 {
		t.Fatalf("with MESHNODE_FUSED_AHEAD=0 the stage queued passes ahead (%d taken, %d dropped)", f.taken, f.dropped)
	}
	ref.close()
	t.Setenv("MESHNODE_FUSED_AHEAD", "")
	p := openSplit(t, path, []int{0, 4}, opts)
	defer p.close()
	got := script(p)
	f := p.stages[0].fused.(*cudaFused)
	t.Logf("passes queued ahead: %d taken, %d dropped", f.taken, f.dropped)
	if !slices.Equal(got, want) {
		t.Fatalf("picks queued ahead:\n%v\nstep by step:\n%v", got, want)
	}
	if f.taken < 20 || f.dropped < 3 {
		t.Fatalf("passes queued ahead: %d taken, %d dropped; want at least 20 and 3", f.taken, f.dropped)
	}
}
