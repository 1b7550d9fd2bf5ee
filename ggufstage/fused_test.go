package ggufstage

import (
	"errors"
	"fmt"
	"reflect"
	"slices"
	"testing"

	"github.com/ollama/ollama/kvcache"
	"github.com/ollama/ollama/model/input"

	"github.com/meshnode/meshnode/stage"
)

// TestCausalViewPlace checks that the fused path's own placement of a
// decode row in ollama's cache (causalView.place) leaves the cache's
// bookkeeping exactly as the cache's StartForward does: the same cell,
// the same position and sequence in it, the same cell ranges. Two engines
// go through the same history (prefills, a trim that leaves holes, two
// sequences interleaved, a full cache); one places rows with StartForward,
// the other with place.
func TestCausalViewPlace(t *testing.T) {
	opts := Options{Threads: 1, MaxSeqs: 3, Context: 24, Device: "cpu"}
	ref := openSplit(t, storiesPath, []int{0, 5}, opts)
	defer ref.close()
	got := openSplit(t, storiesPath, []int{0, 5}, opts)
	defer got.close()
	a, b := ref.stages[0], got.stages[0]
	va, err := newCausalView(a.cache)
	if err != nil {
		t.Fatal(err)
	}
	vb, err := newCausalView(b.cache)
	if err != nil {
		t.Fatal(err)
	}
	for _, p := range []*pipeline{ref, got} {
		p.open(t, 1, 2)
		for _, pr := range []struct {
			seq stage.SeqID
			n   int
		}{{1, 6}, {2, 3}} {
			var bt stage.Batch
			for i := range pr.n {
				bt.Seqs, bt.Pos, bt.Tokens = append(bt.Seqs, pr.seq), append(bt.Pos, int32(i)), append(bt.Tokens, int32(1+i))
			}
			bt.Outputs = []int{pr.n - 1}
			p.forward(t, bt)
		}
		if err := p.stages[0].Trim(1, 2); err != nil { // cells 2-5 free again
			t.Fatal(err)
		}
	}
	startForward := func(slot int, pos int32) error {
		ctx := a.backend.NewContext()
		defer ctx.Close()
		return a.cache.StartForward(ctx, input.Batch{Positions: []int32{pos}, Sequences: []int{slot}}, false)
	}
	next := map[stage.SeqID]int32{1: 2, 2: 3}
	for step := 0; ; step++ {
		seq := stage.SeqID(1 + step%2)
		pos := next[seq]
		next[seq]++
		errA := startForward(a.slots[seq], pos)
		_, errB := vb.place(b.slots[seq], pos)
		if errA != nil || errB != nil {
			if !errors.Is(errA, kvcache.ErrKvCacheFull) || !errors.Is(errB, kvcache.ErrKvCacheFull) {
				t.Fatalf("step %d: StartForward: %v; place: %v", step, errA, errB)
			}
			if step < 10 {
				t.Fatalf("the cache filled after %d steps", step)
			}
			break
		}
		if !reflect.DeepEqual(*va.cells, *vb.cells) {
			t.Fatalf("step %d (seq %d, pos %d): cells differ:\nStartForward %v\nplace        %v", step, seq, pos, *va.cells, *vb.cells)
		}
		if ra, rb := rangesOf(va), rangesOf(vb); !slices.Equal(ra, rb) {
			t.Fatalf("step %d (seq %d, pos %d): cell ranges differ:\nStartForward %v\nplace        %v", step, seq, pos, ra, rb)
		}
	}
}

// rangesOf lists the cache's cell ranges, sorted.
func rangesOf(v *causalView) []string {
	var out []string
	for _, k := range v.ranges.MapKeys() {
		r := v.ranges.MapIndex(k)
		out = append(out, fmt.Sprintf("%d:[%d,%d]", k.Int(), r.Field(0).Int(), r.Field(1).Int()))
	}
	slices.Sort(out)
	return out
}
