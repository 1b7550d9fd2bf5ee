package ggufstage

import (
	"context"
	"errors"
	"strings"
	"testing"

	"github.com/meshnode/meshnode/stage"
	"github.com/meshnode/meshnode/stage/stagetest"
)

// TestBuildAhead runs one script of passes through a split built with
// passes ahead (as on a GPU; turned on here on the CPU) and through one
// without, and wants the same logits, bit for bit, after every pass. The
// script has predictions that hit (steady decoding, two lanes taking
// turns) and ones that miss (a sequence leaves, a trim, a prompt joins
// the batch): a missed
// prediction whose rows stayed in the KV cache would show up in the
// attention of later passes.
func TestBuildAhead(t *testing.T) {
	e, err := Open(storiesPath, 0, 5, Options{Threads: 1, MaxSeqs: 1, Context: 64, Device: "cpu"})
	if err != nil {
		t.Fatal(err)
	}
	if e.buildsAhead {
		t.Error("a CPU engine builds ahead by default: it has no idle host time to hide the work in")
	}
	e.Close()
	t.Run("one scheduler", func(t *testing.T) { checkBuildAhead(t, "cpu", Off) })
	t.Run("a scheduler per lane", func(t *testing.T) { checkBuildAhead(t, "cpu", On) })
}

// TestGPUBuildAhead is TestBuildAhead on a GPU, where engines build ahead
// by default; CI machines have no GPU, so there it says so and skips.
func TestGPUBuildAhead(t *testing.T) {
	needGPU(t)
	t.Run("one scheduler", func(t *testing.T) { checkBuildAhead(t, "auto", Off) })
	t.Run("a scheduler per lane", func(t *testing.T) { checkBuildAhead(t, "auto", On) })
}

func checkBuildAhead(t *testing.T, device string, perLane Switch) {
	opts := Options{Threads: 2, MaxSeqs: 3, Context: 128, Device: device, BuildAhead: On, DecodeGraphs: perLane}
	bounds := []int{0, 2, 5}
	ahead := openSplit(t, storiesPath, bounds, opts)
	defer ahead.close()
	opts.BuildAhead, opts.DecodeGraphs = Off, Off
	plain := openSplit(t, storiesPath, bounds, opts)
	defer plain.close()
	for i, s := range ahead.stages {
		if !s.buildsAhead || plain.stages[i].buildsAhead {
			t.Fatal("BuildAhead did not take")
		}
	}

	type row struct {
		seq stage.SeqID
		pos int32
		tok int32
	}
	batch := func(rows ...row) stage.Batch {
		var b stage.Batch
		for i, r := range rows {
			b.Seqs, b.Pos, b.Tokens, b.Outputs = append(b.Seqs, r.seq), append(b.Pos, r.pos), append(b.Tokens, r.tok), append(b.Outputs, i)
		}
		return b
	}
	prompt := func(seq stage.SeqID, from, n int32) []row {
		var rows []row
		for i := range n {
			rows = append(rows, row{seq, from + i, 1 + (int32(seq)*37+from+i)%500})
		}
		return rows
	}
	// step is one pass of the script, or an action between passes.
	type step struct {
		rows    []row
		release stage.SeqID
		trim    stage.SeqID
		trimTo  int32
	}
	var script []step
	next := map[stage.SeqID]int32{}
	decode := func(seqs ...stage.SeqID) {
		var rows []row
		for _, s := range seqs {
			rows = append(rows, row{s, next[s], 1 + (next[s]*13+int32(s))%500})
			next[s]++
		}
		script = append(script, step{rows: rows})
	}
	script = append(script, step{rows: append(prompt(1, 0, 5), prompt(2, 0, 3)...)})
	next[1], next[2] = 5, 3
	for range 6 {
		decode(1, 2)
	}
	script = append(script, step{release: 2})
	for range 3 {
		decode(1)
	}
	script = append(script, step{trim: 1, trimTo: next[1] - 2})
	next[1] -= 2
	for range 3 {
		decode(1)
	}
	// A prompt joins while sequence 1 decodes, then both decode.
	script = append(script, step{rows: append([]row{{1, next[1], 7}}, prompt(3, 0, 4)...)})
	next[1]++
	next[3] = 4
	for range 4 {
		decode(1, 3)
	}
	decode(3, 1) // the same sequences in another order
	decode(3, 1)
	// Two pipeline lanes take turns. A lane's pass built ahead holds a
	// cache cell while the other lane's pass runs, which then takes
	// another cell than without passes ahead: attention sums the same
	// terms in another order, so from here logits agree to rounding.
	lanes := len(script)
	for range 4 {
		decode(1)
		decode(3)
	}

	for _, p := range []*pipeline{ahead, plain} {
		p.open(t, 1, 2, 3)
	}
	for i, st := range script {
		switch {
		case st.release != 0:
			for _, p := range []*pipeline{ahead, plain} {
				for _, s := range p.stages {
					if err := s.Release(st.release); err != nil {
						t.Fatal(err)
					}
				}
			}
			continue
		case st.trim != 0:
			for _, p := range []*pipeline{ahead, plain} {
				for _, s := range p.stages {
					if err := s.Trim(st.trim, st.trimTo); err != nil {
						t.Fatal(err)
					}
				}
			}
			continue
		}
		b := batch(st.rows...)
		got, want := ahead.forward(t, b), plain.forward(t, b)
		for _, s := range ahead.stages {
			s.prep.Wait() // the allocation ahead, done as the next stage would run
		}
		tol := 0.0
		if i >= lanes {
			tol = 1e-4
			if !cpuAttention() {
				// ggml's attention rounds scores to f16 in cell order: on an
				// AVX2-only EPYC another cell moved stories260K's logits by
				// 7.8e-4. A row left in the cache moves them by tenths.
				tol = 2e-3
			}
		}
		if d := maxAbsDiff(got, want); d > tol || stagetest.Argmax(got) != stagetest.Argmax(want) {
			t.Fatalf("step %d (%v): logits differ by %g with passes built ahead", i, st.rows, d)
		}
	}
	var hits, passes, allocated uint64
	for _, s := range ahead.stages {
		hits += s.Phases().Ahead
		passes += s.Phases().Passes
		allocated += s.Phases().Allocated
		if want := map[bool]int{true: 2, false: 1}[perLane == On && directSched]; len(s.lanes) != want && directSched {
			t.Errorf("stage %s ran on %d schedulers, want %d", s.Info().Range(), len(s.lanes), want)
		}
	}
	// In builds that drive ggml's scheduler, every pass built ahead was
	// also allocated ahead: it was the oldest waiting when its stage went
	// idle.
	if want := map[bool]uint64{true: hits, false: 0}[directSched]; allocated != want {
		t.Errorf("%d passes were allocated ahead, want %d (of %d built ahead)", allocated, want, hits)
	}
	// Decode passes that followed a decode pass of the same sequences, in
	// the same order, with nothing of theirs between: 5+2+2+3+1, then 6
	// of the 8 passes of the lanes.
	if want := uint64(19 * len(ahead.stages)); hits != want {
		t.Errorf("%d of %d passes were built ahead, want %d", hits, passes, want)
	}
}

// TestAllocAheadTakenOver: a pass allocated ahead whose allocation another
// pass then took over (a different sequence came first) must be rebuilt,
// not allocated again: ggml keeps a tensor's first address, which the
// other allocation may have freed (on a GPU, an illegal memory access).
// allocAhead is kept from running, so the stale pass reaches Forward.
func TestAllocAheadTakenOver(t *testing.T) {
	if !directSched {
		t.Skip("this build computes through ollama's Context.Compute, which allocates each graph once")
	}
	opts := Options{Threads: 1, MaxSeqs: 2, Context: 64, Device: "cpu", BuildAhead: On}
	ahead := openSplit(t, storiesPath, []int{0, 5}, opts)
	defer ahead.close()
	opts.BuildAhead = Off
	plain := openSplit(t, storiesPath, []int{0, 5}, opts)
	defer plain.close()
	e := ahead.stages[0]
	for _, p := range []*pipeline{ahead, plain} {
		p.open(t, 1, 2)
	}
	one := func(seq stage.SeqID, pos, tok int32) stage.Batch {
		return stage.Batch{Seqs: []stage.SeqID{seq}, Pos: []int32{pos}, Tokens: []int32{tok}, Outputs: []int{0}}
	}
	steps := []struct {
		b    stage.Batch
		prep bool // let allocAhead run after the pass
	}{
		{one(1, 0, 5), true},  // allocates (1, 1) ahead
		{one(2, 0, 9), false}, // allocated in its turn: (1, 1) is stale
		{one(1, 1, 7), true},  // built ahead but stale: rebuilt
		{one(2, 1, 11), true}, // built and allocated ahead
		{one(1, 2, 13), true}, // built and allocated ahead
	}
	defer func() { testNoAllocAhead = false }()
	for i, st := range steps {
		testNoAllocAhead = !st.prep
		got, want := ahead.forward(t, st.b), plain.forward(t, st.b)
		e.prep.Wait()
		if d := maxAbsDiff(got, want); d > 1e-4 || stagetest.Argmax(got) != stagetest.Argmax(want) {
			t.Fatalf("step %d: logits differ by %g", i, d)
		}
	}
	if ph := e.Phases(); ph.Ahead != 2 || ph.Allocated != 2 {
		t.Errorf("%d passes built ahead and %d allocated ahead, want 2 and 2", ph.Ahead, ph.Allocated)
	}
}

// TestAllocAheadPanic: a panic in the goroutine that allocates ahead
// breaks the engine, which says so on the next call, and the process
// goes on.
func TestAllocAheadPanic(t *testing.T) {
	opts := Options{Threads: 1, MaxSeqs: 1, Context: 64, Device: "cpu", BuildAhead: On}
	p := openSplit(t, storiesPath, []int{0, 5}, opts)
	defer p.close()
	p.open(t, 1)
	e := p.stages[0]
	testAllocAheadPanic = func() { panic("boom") }
	defer func() { testAllocAheadPanic = nil }()
	b := stage.Batch{Seqs: []stage.SeqID{1}, Pos: []int32{0}, Tokens: []int32{1}, Outputs: []int{0}}
	if _, err := e.Forward(context.Background(), &b); err != nil {
		t.Fatal(err)
	}
	e.prep.Wait()
	if !directSched {
		if e.Broken() != nil {
			t.Fatal("the engine broke in a build that does not allocate ahead")
		}
		return
	}
	if err := e.Broken(); !errors.Is(err, ErrBroken) || !strings.Contains(err.Error(), "boom") {
		t.Fatalf("Broken() = %v, want ErrBroken with the panic", err)
	}
	b.Pos[0], b.Tokens[0] = 1, 2
	if _, err := e.Forward(context.Background(), &b); !errors.Is(err, ErrBroken) {
		t.Fatalf("Forward after the panic: %v, want ErrBroken", err)
	}
}
