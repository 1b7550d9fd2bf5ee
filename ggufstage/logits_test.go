package ggufstage

import (
	"context"
	"slices"
	"testing"

	"github.com/meshnode/meshnode/stage"
)

// TestLogitsReleased runs one decode script through two engines: one
// hands every output back (Release) as soon as it has copied the logits,
// the other holds every output to the end. Both must give the same logits,
// and outputs held must not change while later passes run: a buffer
// reused too early would show up in either. In builds that read logits
// into the engine's own buffers, the releasing engine must also reuse them.
func TestLogitsReleased(t *testing.T) {
	opts := Options{Threads: 1, MaxSeqs: 2, Context: 64, Device: "cpu"}
	open := func() *Engine {
		e, err := Open(storiesPath, 0, 5, opts)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { e.Close() })
		for _, s := range []stage.SeqID{1, 2} {
			if err := e.Open(s); err != nil {
				t.Fatal(err)
			}
		}
		return e
	}
	releasing, holding := open(), open()
	ctx := context.Background()
	var held []*stage.Output
	var copies [][]float32
	reused := 0
	var last *float32
	for step := range 8 {
		b := stage.Batch{Seqs: []stage.SeqID{1, 2}, Pos: []int32{int32(step), int32(step)},
			Tokens: []int32{int32(1 + step*7), int32(2 + step*11)}, Outputs: []int{0, 1}}
		if step == 0 {
			b = stage.Batch{Seqs: []stage.SeqID{1}, Pos: []int32{0}, Tokens: []int32{1}, Outputs: []int{0}}
		}
		r, err := releasing.Forward(ctx, &b)
		if err != nil {
			t.Fatal(err)
		}
		h, err := holding.Forward(ctx, &b)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(r.Logits, h.Logits) {
			t.Fatalf("step %d: logits differ between an engine reusing its buffers and one not", step)
		}
		if &r.Logits[0] == last {
			reused++
		}
		last = &r.Logits[0]
		r.Release()
		r.Release() // twice is harmless
		if r.Logits != nil {
			t.Fatal("Release left the logits readable")
		}
		held = append(held, h)
		copies = append(copies, slices.Clone(h.Logits))
		for i, o := range held {
			if !slices.Equal(o.Logits, copies[i]) {
				t.Fatalf("step %d: the logits of step %d, not released, changed", step, i)
			}
		}
	}
	if directSched && reused == 0 {
		t.Error("the engine never reused a released logits buffer")
	}
	var nilOut *stage.Output
	nilOut.Release()
}
