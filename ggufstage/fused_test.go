package ggufstage

import (
	"errors"
	"fmt"
	"math"
	"path/filepath"
	"reflect"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/ollama/ollama/kvcache"
	"github.com/ollama/ollama/ml"
	"github.com/ollama/ollama/model/input"

	"github.com/meshnode/meshnode/ggufstage/gguf"
	"github.com/meshnode/meshnode/ggufstage/synth"
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
		p.forward(t, promptBatch(1, countTo(6)))
		p.forward(t, promptBatch(2, countTo(3)))
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
		// Every third step places both sequences in one pass (placeRows),
		// the reference one row after the other.
		seqs := []stage.SeqID{stage.SeqID(1 + step%2)}
		if step%3 == 2 {
			seqs = []stage.SeqID{2, 1}
		}
		var slots []int
		var pos []int32
		var errA error
		for _, seq := range seqs {
			slots, pos = append(slots, b.slots[seq]), append(pos, next[seq])
			if errA == nil {
				errA = startForward(a.slots[seq], next[seq])
			}
			next[seq]++
		}
		_, errB := vb.placeRows(slots, pos, nil)
		if errA != nil || errB != nil {
			if !errors.Is(errA, kvcache.ErrKvCacheFull) || !errors.Is(errB, kvcache.ErrKvCacheFull) {
				t.Fatalf("step %d: StartForward: %v; placeRows: %v", step, errA, errB)
			}
			if step < 10 {
				t.Fatalf("the cache filled after %d steps", step)
			}
			break
		}
		if !reflect.DeepEqual(*va.cells, *vb.cells) {
			t.Fatalf("step %d (seqs %v, pos %v): cells differ:\nStartForward %v\nplaceRows    %v", step, seqs, pos, *va.cells, *vb.cells)
		}
		if ra, rb := rangesOf(va), rangesOf(vb); !slices.Equal(ra, rb) {
			t.Fatalf("step %d (seqs %v, pos %v): cell ranges differ:\nStartForward %v\nplaceRows    %v", step, seqs, pos, ra, rb)
		}
		// The cells each row attends to besides its own: those of its
		// sequence before its position, as the reference cache holds them;
		// a pass of several rows lists its rows' cells one after another.
		prev := []int32{-7}
		want, wantCounts := slices.Clone(prev), []int{5}
		for r, seq := range seqs {
			n := 0
			for i, c := range *va.cells {
				if c.pos < pos[r] && slices.Contains(c.sequences, a.slots[seq]) {
					want, n = append(want, int32(i)), n+1
				}
			}
			wantCounts = append(wantCounts, n)
		}
		got, counts, err := vb.rowsCells(slots, pos, prev, []int{5})
		if err != nil || !slices.Equal(got, want) || !slices.Equal(counts, wantCounts) {
			t.Fatalf("step %d (seqs %v, pos %v): earlier cells %v, counts %v (%v), want %v, %v", step, seqs, pos, got, counts, err, want, wantCounts)
		}
	}
}

// TestRowsCells lists the cells of passes of up to four rows in a cache
// where four sequences interleave and two share a prefix (ollama's
// CopyPrefix puts both in the prefix's cells), against a look at every
// cell for every row; and refuses slots that are negative, repeated or
// hold no cells.
func TestRowsCells(t *testing.T) {
	p := openSplit(t, storiesPath, []int{0, 5}, Options{Threads: 1, MaxSeqs: 5, Context: 40, Device: "cpu"})
	defer p.close()
	e := p.stages[0]
	v, err := newCausalView(e.cache)
	if err != nil {
		t.Fatal(err)
	}
	p.open(t, 1, 2, 3, 4, 5)
	slot := func(id stage.SeqID) int { return e.slots[id] }
	// Sequences 1-3 decode interleaved for 6 steps; 4 then takes 1's first
	// 4 positions as its own and goes on from there; 5 holds no cells.
	for step := range int32(6) {
		if _, err := v.placeRows([]int{slot(1), slot(2), slot(3)}, []int32{step, step, step}, nil); err != nil {
			t.Fatal(err)
		}
	}
	e.cache.(*kvcache.Causal).CopyPrefix(slot(1), slot(4), 4)
	shared := 0
	for _, c := range *v.cells {
		if len(c.sequences) > 1 {
			shared++
		}
	}
	if shared != 4 {
		t.Fatalf("%d cells shared after copying a prefix of 4", shared)
	}
	for step := int32(4); step < 7; step++ {
		if _, err := v.placeRows([]int{slot(4), slot(2)}, []int32{step, step + 2}, nil); err != nil {
			t.Fatal(err)
		}
	}
	brute := func(seqs []int, pos []int32) (want []int32, counts []int) {
		for r, seq := range seqs {
			n := 0
			for i, c := range *v.cells {
				if c.pos < pos[r] && slices.Contains(c.sequences, seq) {
					want, n = append(want, int32(i)), n+1
				}
			}
			counts = append(counts, n)
		}
		return want, counts
	}
	tests := []struct {
		name string
		ids  []stage.SeqID
		pos  []int32
		bad  string // the error's text, if the pass is refused
	}{
		{"one row", []stage.SeqID{2}, []int32{5}, ""},
		{"the prefix's owner", []stage.SeqID{1}, []int32{6}, ""},
		{"the prefix's sharer", []stage.SeqID{4}, []int32{7}, ""},
		{"four rows", []stage.SeqID{4, 3, 1, 2}, []int32{7, 6, 6, 9}, ""},
		{"early positions", []stage.SeqID{1, 4}, []int32{2, 3}, ""},
		{"position 0", []stage.SeqID{3}, []int32{0}, ""},
		{"a slot twice", []stage.SeqID{2, 2}, []int32{5, 5}, "twice"},
		{"a slot with no cells", []stage.SeqID{1, 5}, []int32{6, 0}, "holds no cells"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var seqs []int
			for _, id := range tc.ids {
				seqs = append(seqs, slot(id))
			}
			got, counts, err := v.rowsCells(seqs, tc.pos, []int32{-1}, nil)
			if tc.bad != "" {
				if err == nil || !strings.Contains(err.Error(), tc.bad) {
					t.Fatalf("error %v, want one saying %q", err, tc.bad)
				}
				return
			}
			want, wantCounts := brute(seqs, tc.pos)
			if err != nil || !slices.Equal(got, append([]int32{-1}, want...)) || !slices.Equal(counts, wantCounts) {
				t.Fatalf("cells %v, counts %v (%v); want %v, %v", got[1:], counts, err, want, wantCounts)
			}
		})
	}
	if _, _, err := v.rowsCells([]int{-1}, []int32{1}, nil, nil); err == nil {
		t.Fatal("a negative slot was taken")
	}
	// A refused pass leaves no slot marked: the next pass lists its cells.
	want, wantCounts := brute([]int{slot(2)}, []int32{5})
	if got, counts, err := v.rowsCells([]int{slot(2)}, []int32{5}, nil, nil); err != nil || !slices.Equal(got, want) || !slices.Equal(counts, wantCounts) {
		t.Fatalf("after refused passes: cells %v, counts %v (%v); want %v, %v", got, counts, err, want, wantCounts)
	}
}

// TestFusedTakes: the fused path takes decode passes (each row a sequence
// of its own) and, on the last stage, only passes that want every row's
// logits; a prefill chunk (one sequence, several rows) goes to ggml.
func TestFusedTakes(t *testing.T) {
	tests := []struct {
		name    string
		slots   []int
		outputs []int
		last    bool
		want    bool
	}{
		{"one row, middle stage", []int{0}, nil, false, true},
		{"one row with its logits", []int{3}, []int{0}, true, true},
		{"one row, no logits wanted", []int{3}, nil, true, false},
		{"three sequences", []int{0, 2, 1}, []int{0, 1, 2}, true, true},
		{"three sequences, middle stage", []int{0, 2, 1}, nil, false, true},
		{"logits of some rows only", []int{0, 2, 1}, []int{2}, true, false},
		{"a prefill chunk", []int{1, 1, 1}, []int{2}, true, false},
		{"a prefill chunk, middle stage", []int{1, 1}, nil, false, false},
		{"a sequence twice among others", []int{0, 1, 0}, []int{0, 1, 2}, true, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			b := &stage.Batch{Seqs: make([]stage.SeqID, len(tc.slots)), Pos: make([]int32, len(tc.slots)), Outputs: tc.outputs}
			if got := fusedTakes(b, tc.slots, tc.last); got != tc.want {
				t.Errorf("fusedTakes(slots %v, outputs %v, last %v) = %v, want %v", tc.slots, tc.outputs, tc.last, got, tc.want)
			}
		})
	}
}

// TestAheadContinuedBy: a batch takes the pass queued ahead only if it is
// exactly that pass: greedy, the same slots in order, each row one
// position on, each token the pick the queued pass took.
func TestAheadContinuedBy(t *testing.T) {
	ahead := &aheadPass{slots: []int{2, 0}, pos: []int32{7, 12}, after: []int32{401, 9}}
	tests := []struct {
		name   string
		slots  []int
		pos    []int32
		tokens []int32
		greedy bool
		want   bool
	}{
		{"the pass", []int{2, 0}, []int32{7, 12}, []int32{401, 9}, true, true},
		{"not greedy", []int{2, 0}, []int32{7, 12}, []int32{401, 9}, false, false},
		{"another token", []int{2, 0}, []int32{7, 12}, []int32{401, 10}, true, false},
		{"another position", []int{2, 0}, []int32{7, 13}, []int32{401, 9}, true, false},
		{"rows swapped", []int{0, 2}, []int32{12, 7}, []int32{9, 401}, true, false},
		{"a row fewer", []int{2}, []int32{7}, []int32{401}, true, false},
		{"a row more", []int{2, 0, 1}, []int32{7, 12, 3}, []int32{401, 9, 5}, true, false},
		{"another slot", []int{2, 1}, []int32{7, 12}, []int32{401, 9}, true, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			b := &stage.Batch{Seqs: make([]stage.SeqID, len(tc.slots)), Pos: tc.pos, Tokens: tc.tokens, PicksOnly: tc.greedy}
			if got := ahead.continuedBy(b, tc.slots); got != tc.want {
				t.Errorf("continuedBy(slots %v, pos %v, tokens %v, greedy %v) = %v, want %v", tc.slots, tc.pos, tc.tokens, tc.greedy, got, tc.want)
			}
		})
	}
	if (&aheadPass{slots: []int{2}, pos: []int32{7}}).continuedBy(&stage.Batch{Seqs: make([]stage.SeqID, 1), Pos: []int32{7}, Tokens: []int32{0}, PicksOnly: true}, []int{2}) {
		t.Error("a pass whose picks the host does not have yet was taken")
	}
}

// TestAheadPlan: a greedy batch takes the pass queued ahead where it is
// that pass; else the queued pass is settled and the batch runs as one
// step. A batch is queued (with the pass after it) only where it continues
// the last pass and nothing is queued: the second pass of a run of
// continuations, never one of batches that take turns.
func TestAheadPlan(t *testing.T) {
	slots := []int{3}
	b := &stage.Batch{Seqs: make([]stage.SeqID, 1), Pos: []int32{9}, Tokens: []int32{42}, PicksOnly: true}
	cont := &aheadPass{slots: []int{3}, pos: []int32{9}, after: []int32{42}}
	other := &aheadPass{slots: []int{1}, pos: []int32{4}, after: []int32{7}}
	tests := []struct {
		name          string
		pending, last *aheadPass
		eligible      bool
		act           aheadAction
		settle        bool
	}{
		{"a first pass", nil, nil, true, aheadStep, false},
		{"the second of a run", nil, cont, true, aheadQueue, false},
		{"the second of a run, not eligible", nil, cont, false, aheadStep, false},
		{"after another sequence's pass", nil, other, true, aheadStep, false},
		{"the pass queued ahead", cont, cont, true, aheadTake, false},
		{"the pass queued ahead, not eligible", cont, cont, false, aheadStep, true},
		{"another pass than the one queued", other, other, true, aheadStep, true},
		{"another pass, the last one's continuation", other, cont, true, aheadStep, true},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			act, settle := aheadPlan(tc.pending, tc.last, b, slots, tc.eligible)
			if act != tc.act || settle != tc.settle {
				t.Errorf("aheadPlan = %v, settle %v; want %v, settle %v", act, settle, tc.act, tc.settle)
			}
		})
	}
}

// TestAheadCellsFreed: the cells a pass queued ahead places (placeRows one
// position past each row's last) are freed by settle's Remove, leaving the
// cache's cells (which hold which sequences) and ranges as they were, so
// that the batch the caller sends instead finds them as ollama's cache
// would.
func TestAheadCellsFreed(t *testing.T) {
	p := openSplit(t, storiesPath, []int{0, 5}, Options{Threads: 1, MaxSeqs: 3, Context: 24, Device: "cpu"})
	defer p.close()
	e := p.stages[0]
	v, err := newCausalView(e.cache)
	if err != nil {
		t.Fatal(err)
	}
	p.open(t, 1, 2)
	p.forward(t, promptBatch(1, countTo(5)))
	p.forward(t, promptBatch(2, countTo(3)))
	cells, ranges := slices.Clone(*v.cells), rangesOf(v)
	for i := range cells {
		cells[i].sequences = slices.Clone(cells[i].sequences)
	}
	slots, pos := []int{e.slots[2], e.slots[1]}, []int32{3, 5}
	locs, err := v.placeRows(slots, pos, nil)
	if err != nil {
		t.Fatal(err)
	}
	if reflect.DeepEqual(*v.cells, cells) {
		t.Fatalf("placeRows at %v left the cells as they were", locs)
	}
	for r, s := range slots {
		if err := e.cache.Remove(s, pos[r], math.MaxInt32); err != nil {
			t.Fatal(err)
		}
	}
	// A free cell is one of no sequence, whatever position it last held
	// (ollama's Remove leaves that too).
	held := func(cs []causalCell) []causalCell {
		out := make([]causalCell, len(cs))
		for i, c := range cs {
			if len(c.sequences) > 0 {
				out[i] = c
			}
		}
		return out
	}
	if got, want := held(*v.cells), held(cells); !reflect.DeepEqual(got, want) {
		t.Errorf("cells after freeing %v:\n%v\nwant\n%v", locs, got, want)
	}
	if got := rangesOf(v); !slices.Equal(got, ranges) {
		t.Errorf("cell ranges after freeing %v: %v, want %v", locs, got, ranges)
	}
}

// TestFusedPassSizes: a batch runs in at most passes fused passes of at
// most maxRows rows, as even as they can be, else on ggml (nil).
func TestFusedPassSizes(t *testing.T) {
	tests := []struct {
		n, maxRows, passes int
		want               []int
	}{
		{1, 8, 2, []int{1}},
		{8, 8, 2, []int{8}},
		{9, 8, 2, []int{5, 4}},
		{15, 8, 2, []int{8, 7}},
		{16, 8, 2, []int{8, 8}},
		{17, 8, 2, nil},
		{32, 8, 2, nil},
		{32, 8, 4, []int{8, 8, 8, 8}},
		{25, 8, 4, []int{7, 6, 6, 6}},
		{33, 8, 4, nil},
		{4, 2, 2, []int{2, 2}},
		{3, 2, 2, []int{2, 1}},
		{5, 2, 2, nil},
		{7, 4, 2, []int{4, 3}},
		{8, 8, 1, []int{8}},
		{9, 8, 1, nil},
		{1, 1, 2, []int{1}},
		{2, 1, 2, nil},
		{0, 8, 2, nil},
	}
	for _, tc := range tests {
		got := fusedPassSizes(tc.n, tc.maxRows, tc.passes)
		if !slices.Equal(got, tc.want) {
			t.Errorf("fusedPassSizes(%d, %d, %d) = %v, want %v", tc.n, tc.maxRows, tc.passes, got, tc.want)
		}
		if len(got) > tc.passes {
			t.Errorf("fusedPassSizes(%d, %d, %d) took %d passes", tc.n, tc.maxRows, tc.passes, len(got))
		}
	}
}

// TestFusedPassLimit: MESHNODE_FUSED_PASSES sets the limit where it is a
// count from 1 to 64; anything else leaves the default: passes of sixteen
// rows take 32 rows, passes of eight 32 rows of a model of n_embd up to
// 4096 and 16 of a wider one; passes of fewer take two.
func TestFusedPassLimit(t *testing.T) {
	tests := []struct {
		env     string
		maxRows int
		embd    int
		want    int
	}{
		{"", 8, 4096, 4},
		{"", 8, 2048, 4},
		{"", 16, 4096, 2},
		{"", 16, 5120, 2},
		{"", 32, 5120, 1},
		{"", 32, 2048, 1},
		{"", 8, 5120, 2},
		{"", 8, 8192, 2},
		{"", 4, 4096, 2},
		{"", 1, 4096, 2},
		{"4", 4, 4096, 4},
		{"4", 8, 5120, 4},
		{"1", 8, 4096, 1},
		{"64", 8, 4096, 64},
		{"0", 8, 4096, 4},
		{"65", 4, 4096, 2},
		{"-2", 8, 5120, 2},
		{"four", 4, 4096, 2},
	}
	for _, tc := range tests {
		t.Setenv("MESHNODE_FUSED_PASSES", tc.env)
		if got := fusedPassLimit(tc.maxRows, tc.embd); got != tc.want {
			t.Errorf("MESHNODE_FUSED_PASSES=%q, passes of %d rows, n_embd %d: limit %d, want %d", tc.env, tc.maxRows, tc.embd, got, tc.want)
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

// TestFusedEligibleAlike checks that every stage of a model makes the same
// choice about the fused decode path as the whole model does. A split
// whose stages chose differently would decode differently from the whole
// model: on two H200s a 32B model's first stage ran fused while its last
// stage, whose Q6_K head the kernels could not take at n_embd 5120 then,
// ran ggml, and greedy text drifted from the one-GPU run's.
func TestFusedEligibleAlike(t *testing.T) {
	base := synth.Spec{Arch: "llama", Layers: 3, Embd: 2048, Heads: 16, KVHeads: 4, FFN: 2048, Vocab: 512, Type: synth.Q4_0, Seed: 3}
	tests := []struct {
		name string
		edit func(*synth.Spec)
		why  string // "" = eligible
	}{
		{"Q4_0 with a Q6_K head", func(*synth.Spec) {}, ""},
		{"Q6_K head at n_embd 2560", func(s *synth.Spec) { s.Embd, s.Heads, s.KVHeads = 2560, 20, 4 }, ""},
		{"Q6_K head at n_embd 1280", func(s *synth.Spec) { s.Embd, s.Heads, s.KVHeads = 1280, 10, 2 }, "multiple of 512"},
		{"tied head", func(s *synth.Spec) { s.Tied = true }, "tied output head"},
		{"qwen2: q, k and v biases, NeoX rotation", func(s *synth.Spec) { s.Arch = "qwen2" }, ""},
		{"qwen3", func(s *synth.Spec) { s.Arch = "qwen3" }, "llama and qwen2 only"},
		{"Q8_0 weights", func(s *synth.Spec) { s.Type = synth.Q8_0 }, "[Q4_0] only"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			spec := base
			tc.edit(&spec)
			dir := t.TempDir()
			src := filepath.Join(dir, "m.gguf")
			if err := synth.Write(src, spec, nil); err != nil {
				t.Fatal(err)
			}
			for _, r := range [][2]int{{0, 3}, {0, 1}, {1, 2}, {2, 3}, {1, 3}} {
				_, meta := sliceHeader(t, src, dir, r[0], r[1])
				_, err := fusedEligible(meta, true, ml.DTypeF16)
				switch {
				case tc.why == "" && err != nil:
					t.Errorf("layers [%d,%d): %v", r[0], r[1], err)
				case tc.why != "" && (err == nil || !strings.Contains(err.Error(), tc.why)):
					t.Errorf("layers [%d,%d): got %v, want an error saying %q", r[0], r[1], err, tc.why)
				}
			}
		})
	}
	t.Run("slice without the model's types", func(t *testing.T) {
		dir := t.TempDir()
		src := filepath.Join(dir, "m.gguf")
		if err := synth.Write(src, base, nil); err != nil {
			t.Fatal(err)
		}
		_, meta := sliceHeader(t, src, dir, 1, 2)
		meta.KVs = slices.DeleteFunc(meta.KVs, func(kv gguf.KV) bool { return kv.Key == gguf.KeySliceTypes })
		if _, err := fusedEligible(meta, true, ml.DTypeF16); err == nil || !strings.Contains(err.Error(), "older meshnode") {
			t.Errorf("got %v, want the slice refused as cut by an older meshnode", err)
		}
	})
}

// sliceHeader cuts layers [start,end) of src into dir and reads the
// slice's header back.
func sliceHeader(t *testing.T, src, dir string, start, end int) (string, *gguf.File) {
	t.Helper()
	path, err := Slice(src, dir, start, end, nil)
	if err != nil {
		t.Fatal(err)
	}
	meta, err := readHeader(path)
	if err != nil {
		t.Fatal(err)
	}
	return path, meta
}

// BenchmarkRowsCells lists the cells that a pass of eight rows attends to,
// in a cache of 16 sequences of 200 tokens each, placed a row of each at a
// time as decoding interleaves them: in one look over the cells
// (rowsCells), and in one look a row, as fused passes did before run 91.
// The second case reports its time as a multiple of the first's.
func BenchmarkRowsCells(b *testing.B) {
	const seqs, tokens, rows = 16, 200, 8
	p := openSplit(b, storiesPath, []int{0, 5}, Options{Threads: 1, MaxSeqs: seqs, Context: tokens + 8, Device: "cpu"})
	defer p.close()
	e := p.stages[0]
	v, err := newCausalView(e.cache)
	if err != nil {
		b.Fatal(err)
	}
	ids := make([]stage.SeqID, seqs)
	for i := range ids {
		ids[i] = stage.SeqID(i + 1)
	}
	p.open(b, ids...)
	slots := make([]int, seqs)
	for i, id := range ids {
		slots[i] = e.slots[id]
	}
	pos := make([]int32, seqs)
	for t := range tokens {
		for i := range pos {
			pos[i] = int32(t)
		}
		if _, err := v.placeRows(slots, pos, nil); err != nil {
			b.Fatal(err)
		}
	}
	for i := range pos {
		pos[i] = tokens
	}
	var cells []int32
	var counts []int
	var oneLook time.Duration
	b.Run("one-look", func(b *testing.B) {
		start := time.Now()
		for b.Loop() {
			if cells, counts, err = v.rowsCells(slots[:rows], pos[:rows], cells[:0], counts[:0]); err != nil {
				b.Fatal(err)
			}
		}
		if len(cells) != rows*tokens {
			b.Fatalf("%d cells for %d rows of %d tokens", len(cells), rows, tokens)
		}
		oneLook = time.Since(start) / time.Duration(b.N)
	})
	b.Run("a-look-a-row", func(b *testing.B) {
		start := time.Now()
		for b.Loop() {
			cells = cells[:0]
			for r := range rows {
				if cells, counts, err = v.rowsCells(slots[r:r+1], pos[r:r+1], cells, counts[:0]); err != nil {
					b.Fatal(err)
				}
			}
		}
		if oneLook > 0 {
			b.ReportMetric(float64(time.Since(start)/time.Duration(b.N))/float64(oneLook), "×one-look")
		}
	})
}
