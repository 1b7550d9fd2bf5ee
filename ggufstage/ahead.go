package ggufstage

import (
	"errors"
	"math"
	"slices"
	"sync"
	"time"
	"unsafe"

	"github.com/ollama/ollama/ml"
	"github.com/ollama/ollama/model/input"

	"github.com/meshnode/meshnode/stage"
)

// A pass is the graph of one forward pass, its rows placed in the KV
// cache, ready to compute once its input (token ids or hidden state) is
// written.
//
// Building a graph is host work that grows with the layers (0.4-0.65 ms
// for an 8B model's 16-32 layers), and on a GPU it would otherwise sit
// between the previous pass's result and this pass's launch. A decode
// pass is predictable: the same sequences, one position further. So
// while the GPU computes pass N, the engine builds pass N+1 (buildAhead),
// and when the batch it predicted comes, only writes its input (takeAhead).
// Pipeline lanes alternate batches of different sequences through a
// stage, so there is a pass ahead for each.
type pass struct {
	gctx    ml.Context
	seqs    []stage.SeqID
	pos     []int32
	slots   []int
	outputs []int
	in      ml.Tensor // token ids on the first stage, else the hidden state
	out     ml.Tensor // the graph's result: hidden state, or logits when last
	first   bool      // in is token ids
	last    bool      // out is logits
	// sg is ggml's scheduler and the graph, when this build runs them
	// directly (direct; see sched_on.go).
	sg     schedGraph
	direct bool
	// placed: the scheduler has allocated the graph, which gave its
	// tensors their addresses. ggml places a tensor only once (it skips
	// tensors that have data), so a graph must not be allocated again:
	// after another graph's allocation, its addresses may lie in freed
	// memory. A pass allocated ahead whose allocation another pass took
	// over is rebuilt (see takeAhead).
	placed bool
	lane   int // the scheduler it runs on, an index into Engine.lanes
}

// A lane is a scheduler of ggml's that passes run on. ggml's CUDA backend
// keeps one CUDA graph per backend instance and stops using graphs for
// good after four passes in a row that each needed a new one, which is
// what pipeline lanes taking turns on one scheduler do: their passes hold
// different sequences, so their graphs differ. With DecodeGraphs, a decode
// pass built afresh takes a lane no pass built ahead holds (a new one, up
// to maxAhead, on new backend instances sharing the weights), and the
// passes built ahead from it keep to it; every other pass runs on lane 0,
// ollama's own scheduler.
type lane struct {
	sched     unsafe.Pointer
	clone     *schedClone // nil for lane 0
	allocated *pass       // the pass built ahead the scheduler is allocated for (see allocAhead)
}

// maxGraphRows: decode passes of up to this many rows are hinted to ggml
// as batch size 1 with DecodeGraphs, so that they replay a CUDA graph.
const maxGraphRows = 32

// decodeShaped reports whether a batch is a decode pass: one row per
// sequence, every row an output.
func decodeShaped(slots, outputs []int) bool {
	if len(outputs) != len(slots) {
		return false
	}
	seen := make(map[int]bool, len(slots))
	for _, s := range slots {
		if seen[s] {
			return false
		}
		seen[s] = true
	}
	return true
}

// laneFor picks the lane of a pass built afresh for b (see lane).
// Call with e.mu held.
func (e *Engine) laneFor(b *stage.Batch, slots []int) int {
	if !e.decodeGraphs || len(e.lanes) == 0 || !decodeShaped(slots, b.Outputs) {
		return 0
	}
	held := make([]bool, len(e.lanes))
	for _, p := range e.ahead {
		held[p.lane] = true
	}
	for i, h := range held {
		if !h {
			return i
		}
	}
	if len(e.lanes) < maxAhead {
		computeMu.Lock()
		c, err := cloneSched(e.backend)
		computeMu.Unlock()
		if err == nil {
			e.lanes = append(e.lanes, &lane{sched: c.sched, clone: c})
			return len(e.lanes) - 1
		}
	}
	return 0
}

// build places rows (seqs at pos, in cache slots) in the KV cache and
// builds their graph, its input not yet written. If the cache has no room,
// it returns the error with the cache as it was.
func (e *Engine) build(seqs []stage.SeqID, pos []int32, slots []int, outputs []int, lane int) (*pass, error) {
	n := len(seqs)
	p := &pass{
		gctx: e.backend.NewContext(), seqs: slices.Clone(seqs), pos: slices.Clone(pos), slots: slices.Clone(slots),
		outputs: slices.Clone(outputs), first: e.info.First(), last: e.info.Last() && len(outputs) > 0,
	}
	batch := input.Batch{Positions: p.pos, Sequences: p.slots}
	if e.info.First() {
		p.in = p.gctx.Input().Empty(ml.DTypeI32, n)
		batch.Inputs = p.in
	}
	if p.last {
		outs := make([]int32, len(outputs))
		for i, o := range outputs {
			outs[i] = int32(o)
		}
		batch.Outputs = p.gctx.Input().FromInts(outs, len(outs))
	}
	if err := e.cache.StartForward(p.gctx, batch, false); err != nil {
		p.gctx.Close()
		return nil, err
	}
	positions := p.gctx.Input().FromInts(p.pos, n)

	var h ml.Tensor
	if e.info.First() {
		h = e.arch.embed(p.gctx, p.in)
	} else {
		p.in = p.gctx.Input().Empty(ml.DTypeF32, e.info.Embd, n)
		h = p.in
	}
	for i := e.info.Start; i < e.info.End; i++ {
		e.cache.SetLayer(i)
		var outs ml.Tensor
		if p.last && i == e.info.End-1 {
			outs = batch.Outputs
		}
		h = e.arch.layer(p.gctx, i, h, positions, outs, e.cache)
	}
	if p.last {
		h = e.arch.head(p.gctx, h)
	}
	p.out = h
	p.gctx.Forward(h)
	// Builds that run the scheduler themselves have lanes (lane 0 is
	// ollama's scheduler); the graph comes from ollama's context.
	if g := graphOf(p.gctx); g != nil && lane < len(e.lanes) {
		p.direct, p.lane = true, lane
		p.sg = schedGraph{sched: e.lanes[lane].sched, graph: g, batch: -1}
		if e.decodeGraphs && n <= maxGraphRows && decodeShaped(slots, outputs) {
			p.sg.batch = 1
		}
	}
	return p, nil
}

// fill writes the pass's input: token ids on the first stage, else the
// hidden state (rows × n_embd floats).
func (p *pass) fill(tokens []int32, hidden []float32) {
	if p.first {
		p.in.FromInts(tokens)
	} else {
		p.in.FromFloats(hidden)
	}
}

// matches reports whether b is the batch the pass was built for.
func (p *pass) matches(b *stage.Batch, slots []int) bool {
	return slices.Equal(p.seqs, b.Seqs) && slices.Equal(p.pos, b.Pos) && slices.Equal(p.slots, slots) &&
		slices.Equal(p.outputs, b.Outputs)
}

// maxAhead is the most passes built ahead at once: one per pipeline lane
// that decodes through this stage, each lane its own sequences.
const maxAhead = 4

// takeAhead returns the pass built ahead for b, if there is one. Passes
// built ahead for any of b's sequences that are not b's are dropped: their
// prediction failed. Call with e.mu held.
func (e *Engine) takeAhead(b *stage.Batch, slots []int) *pass {
	for i, p := range e.ahead {
		if p.matches(b, slots) {
			if p.placed && e.lanes[p.lane].allocated != p {
				// Allocated ahead, then the scheduler allocated another
				// graph: its tensor addresses are stale. Build it anew.
				e.dropAhead(func(q *pass) bool { return q == p })
				break
			}
			e.ahead = slices.Delete(e.ahead, i, i+1)
			e.phases.ahead.Add(1)
			return p
		}
	}
	e.dropAhead(func(p *pass) bool {
		return slices.ContainsFunc(b.Seqs, func(s stage.SeqID) bool { return slices.Contains(p.seqs, s) })
	})
	return nil
}

// buildAhead builds the pass predicted to follow b, when b is a decode
// pass (one row per sequence) and the engine builds ahead. A prediction
// that cannot be placed (the context or the cache is full) is skipped.
// Call with e.mu held, after takeAhead.
func (e *Engine) buildAhead(b *stage.Batch, slots []int, lane int) {
	if !e.buildsAhead || len(b.Seqs) == 0 {
		return
	}
	next := make([]int32, len(b.Pos))
	for i, s := range b.Seqs {
		if slices.Contains(b.Seqs[:i], s) || (e.info.Context > 0 && int(b.Pos[i])+1 >= e.info.Context) {
			return
		}
		next[i] = b.Pos[i] + 1
	}
	if len(e.ahead) == maxAhead {
		oldest := e.ahead[0]
		e.dropAhead(func(p *pass) bool { return p == oldest })
	}
	if p, err := e.build(b.Seqs, next, slots, b.Outputs, lane); err == nil {
		e.ahead = append(e.ahead, p)
	}
}

// dropAhead frees the passes built ahead that drop selects (all when drop
// is nil) and takes their rows back out of the KV cache: they are the
// last positions of their sequences, which nothing computed yet. Call
// with e.mu held.
func (e *Engine) dropAhead(drop func(*pass) bool) {
	keep := e.ahead[:0]
	for _, p := range e.ahead {
		if drop != nil && !drop(p) {
			keep = append(keep, p)
			continue
		}
		if p.direct && e.lanes[p.lane].allocated == p {
			e.lanes[p.lane].allocated = nil
			p.sg.reset()
		}
		p.gctx.Close()
		for i, slot := range p.slots {
			// Removing to the end never shifts cells, so it cannot fail.
			_ = e.cache.Remove(slot, p.pos[i], math.MaxInt32)
		}
	}
	clear(e.ahead[len(keep):])
	e.ahead = keep
}

// dropAheadOf drops the passes built ahead that hold seq.
func (e *Engine) dropAheadOf(seq stage.SeqID) {
	e.dropAhead(func(p *pass) bool { return slices.Contains(p.seqs, seq) })
}

// kickAllocAhead starts allocAhead in the background when a pass built
// ahead waits for its input: the stage returns its result first, and the
// scheduler work happens while the next stages (or the sampler) run.
// Call with e.mu held.
func (e *Engine) kickAllocAhead() {
	if testNoAllocAhead || e.nextToAllocate() < 0 {
		return
	}
	e.prep.Add(1)
	go func() {
		defer e.prep.Done()
		e.allocAhead()
	}()
}

// nextToAllocate returns the index in e.ahead of the oldest pass built
// ahead whose lane's scheduler is free (lanes take turns, so the oldest
// comes first), or -1.
func (e *Engine) nextToAllocate() int {
	for i, p := range e.ahead {
		if p.direct && e.lanes[p.lane].allocated == nil {
			return i
		}
	}
	return -1
}

// allocAhead splits and allocates, in ggml's schedulers, the passes built
// ahead that come next, one per lane, so that when their input comes only
// the launch is left. It must not run while a pass computes or before that
// pass's result is read: allocating may grow the scheduler's buffers and so
// free the memory the result is in. Forward holds e.mu until then.
func (e *Engine) allocAhead() {
	backendMu.RLock()
	defer backendMu.RUnlock()
	e.mu.Lock()
	defer e.mu.Unlock()
	// A panic here (ollama's, building the pass) must not end the
	// process: it breaks the engine, and the next call reports it.
	var err error
	defer e.breakOnPanic(&err, "allocating the next pass ahead")
	if testAllocAheadPanic != nil {
		testAllocAheadPanic()
	}
	if e.usable() != nil {
		return
	}
	start := time.Now()
	defer func() { e.phases.graph.Add(int64(time.Since(start))) }()
	for {
		i := e.nextToAllocate()
		if i < 0 {
			return
		}
		p := e.ahead[i]
		if p.placed {
			// Allocated ahead before, and another pass's allocation took
			// over: rebuild it now, while the stage is idle.
			e.dropAhead(func(q *pass) bool { return q == p })
			np, err := e.build(p.seqs, p.pos, p.slots, p.outputs, p.lane)
			if err != nil {
				continue
			}
			e.ahead = slices.Insert(e.ahead, i, np)
			p = np
		}
		computeMu.Lock()
		err := e.place(p)
		computeMu.Unlock()
		if err != nil {
			return
		}
		e.lanes[p.lane].allocated = p
	}
}

// testNoAllocAhead keeps allocAhead from running, as when a stage's next
// input comes before its goroutine does; testAllocAheadPanic, when set, is
// called where allocAhead builds.
var (
	testNoAllocAhead    bool
	testAllocAheadPanic func()
)

// errPlacedTwice: a bug, caught before it corrupts memory (see pass.placed).
var errPlacedTwice = errors.New("ggufstage: a pass's graph was allocated twice")

// place has the scheduler split and allocate p's graph; at most once.
// Call with computeMu held.
func (e *Engine) place(p *pass) error {
	if p.placed {
		return errPlacedTwice
	}
	if err := p.sg.alloc(); err != nil {
		return err
	}
	p.placed = true
	return nil
}

// unallocate drops the schedulers' allocations for passes built ahead, as
// anything that may compute other graphs, or free those passes, must
// first. Call with e.mu held.
func (e *Engine) unallocate() {
	for _, l := range e.lanes {
		if l.allocated != nil {
			l.allocated.sg.reset()
			l.allocated = nil
		}
	}
}

// floatPool recycles the engine's logits or hidden-state buffers: a pass
// at 32 rows of a 128K vocabulary returns 16 MB, which fresh from the heap
// must first be zeroed and later collected.
type floatPool struct {
	mu   sync.Mutex
	free [][]float32
}

// floatPoolSize: buffers kept; one per pipeline lane in flight is enough.
const floatPoolSize = 4

// get returns a buffer of n floats and the function that gives it back.
func (fp *floatPool) get(n int) ([]float32, func()) {
	fp.mu.Lock()
	var buf []float32
	for i := len(fp.free) - 1; i >= 0; i-- {
		if cap(fp.free[i]) >= n {
			buf = fp.free[i]
			fp.free = slices.Delete(fp.free, i, i+1)
			break
		}
	}
	fp.mu.Unlock()
	if buf == nil {
		buf = make([]float32, n)
	}
	buf = buf[:n]
	var once sync.Once
	return buf, func() {
		once.Do(func() {
			fp.mu.Lock()
			defer fp.mu.Unlock()
			if len(fp.free) == floatPoolSize {
				fp.free = fp.free[1:]
			}
			fp.free = append(fp.free, buf)
		})
	}
}
