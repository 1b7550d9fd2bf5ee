package pipeline

import (
	"context"
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"github.com/meshnode/meshnode/node/sample"
	"github.com/meshnode/meshnode/stage"
)

// The hand-off protocol (handoff.go) over real engines on the CPU, with a
// simulated device between them: ports are buffers of this process, their
// events channels closed when a pass reaches its record, and a launched
// pass computes on a goroutine of its own, as a GPU does while the host
// goes on. What a GPU adds (CUDA IPC, the fused kernels' launches) is
// ggufstage's, tested on one (TestGPUHandoff... and meshnode bench --mesh).

// simPorts holds the ports of the simulated device, by offer.
var simPorts struct {
	mu sync.Mutex
	n  int
	m  map[string]*simPort
}

type simPort struct {
	mu         sync.Mutex
	rows, cols int
	data       []float32
	ev         chan struct{} // closed once the last record is reached
	closed     bool
}

// simEnd is one stage's end of a port.
type simEnd struct {
	p        *simPort
	imported bool
}

func (e *simEnd) Read(rows int) (*stage.Activation, error) {
	p := e.p
	p.mu.Lock()
	ev := p.ev
	p.mu.Unlock()
	select {
	case <-ev:
	case <-time.After(simTimeout):
		return nil, errors.New("sim: the port's event never came")
	}
	p.mu.Lock()
	defer p.mu.Unlock()
	return stage.NewActivation(stage.F32, rows, p.cols, slices.Clone(p.data[:rows*p.cols]))
}

func (e *simEnd) Close() error {
	e.p.mu.Lock()
	defer e.p.mu.Unlock()
	e.p.closed = true
	return nil
}

// simTimeout is how long a simulated pass waits for its input's event.
const simTimeout = 2 * time.Second

// handoffSim is an engine with hand-offs on the simulated device.
type handoffSim struct {
	stage.Engine
	mu sync.Mutex // held from a launch to its end, as ggufstage's engine is

	decline  bool          // launches with an input port say ok false
	failNext atomic.Bool   // the next finish fails
	hold     chan struct{} // if set, a finish waits for it to close

	launchedIn, launchedOut, forwards, abandoned atomic.Int32
	alone                                        []bool // what each launch or forward saw: a launch true
	aloneMu                                      sync.Mutex
}

func (h *handoffSim) Forward(ctx context.Context, b *stage.Batch) (*stage.Output, error) {
	h.forwards.Add(1)
	h.aloneMu.Lock()
	h.alone = append(h.alone, false)
	h.aloneMu.Unlock()
	return h.Engine.Forward(ctx, b)
}

func (h *handoffSim) ExportHandoff(rows int) (stage.HandoffPort, []byte, error) {
	ev := make(chan struct{})
	close(ev)
	p := &simPort{rows: rows, cols: h.Info().Embd, data: make([]float32, rows*h.Info().Embd), ev: ev}
	simPorts.mu.Lock()
	defer simPorts.mu.Unlock()
	if simPorts.m == nil {
		simPorts.m = map[string]*simPort{}
	}
	simPorts.n++
	key := fmt.Sprintf("sim-port-%d", simPorts.n)
	simPorts.m[key] = p
	return &simEnd{p: p}, []byte(key), nil
}

func (h *handoffSim) ImportHandoff(offer []byte) (stage.HandoffPort, error) {
	simPorts.mu.Lock()
	defer simPorts.mu.Unlock()
	p, ok := simPorts.m[string(offer)]
	if !ok {
		return nil, fmt.Errorf("sim: no port %q", offer)
	}
	return &simEnd{p: p, imported: true}, nil
}

type simResult struct {
	out *stage.Output
	err error
}

type simPass struct {
	h    *handoffSim
	b    *stage.Batch
	done chan simResult
	once sync.Once
}

func (h *handoffSim) LaunchHandoff(ctx context.Context, b *stage.Batch, in, out stage.HandoffPort) (stage.LaunchedPass, bool, error) {
	// As the fused path: decode passes only, one row a sequence, and on
	// the last stage greedy picks.
	for r, q := range b.Seqs {
		if slices.Contains(b.Seqs[:r], q) {
			return nil, false, nil
		}
	}
	if h.Info().Last() && !b.PicksOnly || in != nil && h.decline {
		return nil, false, nil
	}
	h.mu.Lock()
	var inEv chan struct{}
	var ip, op *simPort
	if in != nil {
		ip = in.(*simEnd).p
		ip.mu.Lock()
		inEv = ip.ev // the record before this launch
		ip.mu.Unlock()
		h.launchedIn.Add(1)
	}
	var outEv chan struct{}
	if out != nil {
		op = out.(*simEnd).p
		outEv = make(chan struct{})
		op.mu.Lock()
		op.ev = outEv // recorded now, reached when the pass is done
		op.mu.Unlock()
		h.launchedOut.Add(1)
	}
	h.aloneMu.Lock()
	h.alone = append(h.alone, true)
	h.aloneMu.Unlock()
	lb := *b
	lb.Seqs, lb.Pos, lb.Tokens = slices.Clone(b.Seqs), slices.Clone(b.Pos), slices.Clone(b.Tokens)
	p := &simPass{h: h, b: &lb, done: make(chan simResult, 1)}
	go func() {
		res := simResult{}
		defer func() {
			if outEv != nil {
				close(outEv)
			}
			p.done <- res
		}()
		if ip != nil {
			select {
			case <-inEv:
			case <-time.After(simTimeout):
				res.err = errors.New("sim: the input's event never came")
				return
			}
			ip.mu.Lock()
			a, err := stage.NewActivation(stage.F32, lb.Rows(), ip.cols, slices.Clone(ip.data[:lb.Rows()*ip.cols]))
			ip.mu.Unlock()
			if err != nil {
				res.err = err
				return
			}
			lb.Hidden = a
		}
		o, err := h.Engine.Forward(ctx, &lb)
		if err != nil {
			res.err = err
			return
		}
		if op != nil {
			f, err := o.Hidden.Float32()
			o.Release()
			if err != nil {
				res.err = err
				return
			}
			op.mu.Lock()
			copy(op.data, f)
			op.mu.Unlock()
			o = &stage.Output{}
		}
		res.out = o
	}()
	return p, true, nil
}

// undo trims the pass's rows from the cache, as ggufstage's fused path
// frees the cells of a pass that failed or was abandoned.
func (p *simPass) undo() {
	for r, q := range p.b.Seqs {
		_ = p.h.Engine.Trim(q, p.b.Pos[r])
	}
}

func (p *simPass) Finish() (out *stage.Output, err error) {
	err = errors.New("sim: pass already finished")
	p.once.Do(func() {
		defer p.h.mu.Unlock()
		if p.h.hold != nil {
			<-p.h.hold
		}
		r := <-p.done
		out, err = r.out, r.err
		if err == nil && p.h.failNext.CompareAndSwap(true, false) {
			out.Release()
			out, err = nil, errors.New("sim: the pass failed on the device")
		}
		if err != nil {
			p.undo()
		}
	})
	return out, err
}

func (p *simPass) Abandon() (err error) {
	err = errors.New("sim: pass already finished")
	p.once.Do(func() {
		defer p.h.mu.Unlock()
		p.h.abandoned.Add(1)
		r := <-p.done
		if r.out != nil {
			r.out.Release()
		}
		err = r.err
		p.undo()
	})
	return err
}

// handoffMesh is a two-stage socket mesh of stories260K whose stages hand
// off through the simulated device.
func handoffMesh(t *testing.T, first, last *handoffSim) *mesh {
	t.Helper()
	wrap := func(h *handoffSim) func(stage.Engine) stage.Engine {
		return func(e stage.Engine) stage.Engine { h.Engine = e; return h }
	}
	return newSocketMesh(t, []int{0, 2, 5}, engineOpts,
		stageOpts{wrap: wrap(first), handoff: true}, stageOpts{wrap: wrap(last), handoff: true})
}

// handoffPipeline is a pipeline of cfg from an origin over handoffMesh's
// sockets, with twoSeqs' sequences open and greedy.
func handoffPipeline(t *testing.T, first, last *handoffSim, cfg Config) (*mesh, *Pipeline) {
	t.Helper()
	m := handoffMesh(t, first, last)
	cfg.Dial = m.dialSockets()
	p := m.pipeline(t, cfg)
	openAll(t, p, twoSeqs, func(int) sample.Params { return greedy() })
	return m, p
}

func TestHandoffMatchesHost(t *testing.T) {
	tests := []struct {
		name         string
		decline      bool // the last stage reads the port to the host instead
		returnLogits bool // the last stage returns logits: it cannot launch (greedy picks only)
	}{
		{name: "launched on both stages"},
		{name: "the last stage reads the port", decline: true},
		{name: "logits through the port's reader", returnLogits: true},
	}
	sc := twoSeqs
	want := referenceTrace(t, sc)
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			first, last := &handoffSim{}, &handoffSim{decline: tc.decline}
			m, p := handoffPipeline(t, first, last, Config{ReturnLogits: tc.returnLogits})
			got := sc.run(t, pipelineForward(p))
			for step := range want.tokens {
				if !slices.Equal(got.tokens[step], want.tokens[step]) {
					t.Fatalf("step %d: tokens %v, want %v (one engine)", step, got.tokens[step], want.tokens[step])
				}
				if tc.returnLogits && maxAbsDiff(got.logits[step], want.logits[step]) != 0 {
					t.Fatalf("step %d: logits differ from one engine's by %g", step, maxAbsDiff(got.logits[step], want.logits[step]))
				}
			}
			// Every decode step goes through the port; the prefill, which
			// the fused path does not take, through the hosts.
			decodes := int32(sc.steps)
			if n := first.launchedOut.Load(); n != decodes {
				t.Errorf("the first stage launched %d passes into its port, want %d", n, decodes)
			}
			if n := first.forwards.Load(); n != 1 {
				t.Errorf("the first stage ran %d passes through Forward, want 1 (the prefill)", n)
			}
			wantIn, wantForwards := decodes, int32(1)
			if tc.decline || tc.returnLogits {
				wantIn, wantForwards = 0, decodes+1
			}
			if n := last.launchedIn.Load(); n != wantIn {
				t.Errorf("the last stage launched %d passes from the port, want %d", n, wantIn)
			}
			if n := last.forwards.Load(); n != wantForwards {
				t.Errorf("the last stage ran %d passes through Forward, want %d", n, wantForwards)
			}
			for _, s := range m.stages {
				if bad := s.badReports(); len(bad) > 0 {
					t.Errorf("bad-peer reports: %v", bad)
				}
			}
		})
	}
}

// A first stage whose pass fails after it has told the next stage its
// hidden states are on the device: the step fails in its place, the next
// stage drops its pass (and its cache cells), and the same step sent again
// gives the one engine's tokens.
func TestHandoffFirstStageFails(t *testing.T) {
	sc := twoSeqs
	want := referenceTrace(t, sc)
	first, last := &handoffSim{}, &handoffSim{}
	_, p := handoffPipeline(t, first, last, Config{})
	fwd := pipelineForward(p)
	b := sc.prefill()
	for step := 0; step <= sc.steps; step++ {
		if step == 5 {
			first.failNext.Store(true)
			if _, _, err := fwd(b); err == nil || !strings.Contains(err.Error(), "failed on the device") {
				t.Fatalf("step %d with the first stage's pass failing: %v, want its error", step, err)
			}
			if n := last.abandoned.Load(); n != 1 {
				t.Fatalf("the last stage abandoned %d passes, want 1", n)
			}
		}
		toks, _, err := fwd(b)
		if err != nil {
			t.Fatalf("step %d: %v", step, err)
		}
		if !slices.Equal(toks, want.tokens[step]) {
			t.Fatalf("step %d: tokens %v, want %v (one engine)", step, toks, want.tokens[step])
		}
		b = sc.decode(step, toks)
	}
}

// Only a batch alone in flight goes through the port: the origin's second
// batch, sent while the first is still on the stages, goes through the
// hosts.
func TestHandoffOnlyAlone(t *testing.T) {
	sc := twoSeqs
	want := referenceTrace(t, sc)
	first, last := &handoffSim{}, &handoffSim{}
	_, p := handoffPipeline(t, first, last, Config{})
	fwd := pipelineForward(p)
	toks, _, err := fwd(sc.prefill())
	if err != nil {
		t.Fatal(err)
	}
	// The two sequences' first decode steps as two batches in flight at
	// once; the first stage's first pass is held until both are sent.
	both := sc.decode(0, toks)
	first.hold = make(chan struct{})
	var calls []*Call
	for i := range both.Seqs {
		c, err := p.Submit(context.Background(), &stage.Batch{
			Seqs: both.Seqs[i : i+1], Pos: both.Pos[i : i+1], Tokens: both.Tokens[i : i+1], Outputs: []int{0},
		})
		if err != nil {
			t.Fatal(err)
		}
		calls = append(calls, c)
	}
	close(first.hold)
	for i, c := range calls {
		res, err := c.Result()
		if err != nil {
			t.Fatal(err)
		}
		if res.Tokens[0] != want.tokens[1][i] {
			t.Errorf("sequence %d: token %d, want %d", both.Seqs[i], res.Tokens[0], want.tokens[1][i])
		}
	}
	first.aloneMu.Lock()
	seen := slices.Clone(first.alone)
	first.aloneMu.Unlock()
	// The prefill (Forward), then the first batch launched, the second
	// through Forward.
	if !slices.Equal(seen, []bool{false, true, false}) {
		t.Errorf("the first stage's passes launched into its port: %v, want [false true false]", seen)
	}
}

// A first stage that dies while the next stage's pass waits for its
// hidden states: the next stage abandons the pass, and the step fails.
func TestHandoffFirstStageDies(t *testing.T) {
	sc := twoSeqs
	first, last := &handoffSim{}, &handoffSim{}
	m, p := handoffPipeline(t, first, last, Config{})
	fwd := pipelineForward(p)
	toks, _, err := fwd(sc.prefill())
	if err != nil {
		t.Fatal(err)
	}
	first.hold = make(chan struct{})
	c, err := p.Submit(context.Background(), sc.decode(0, toks))
	if err != nil {
		t.Fatal(err)
	}
	deadline := time.Now().Add(5 * time.Second)
	for last.launchedIn.Load() == 0 {
		if time.Now().After(deadline) {
			t.Fatal("the last stage never launched the step")
		}
		time.Sleep(time.Millisecond)
	}
	m.stages[0].kill.kill()
	if _, err := c.Result(); err == nil {
		t.Fatal("the step succeeded though its first stage died")
	}
	close(first.hold)
	for last.abandoned.Load() == 0 {
		if time.Now().After(deadline) {
			t.Fatal("the last stage never abandoned its pass")
		}
		time.Sleep(time.Millisecond)
	}
}

// A next hop that never answers the offer (one from before hand-offs)
// costs the pipeline the wait for the answer, and then its frames go
// through the hosts.
func TestHandoffUnanswered(t *testing.T) {
	answerOffers = false
	handoffAnswerTimeout = 200 * time.Millisecond
	t.Cleanup(func() { answerOffers, handoffAnswerTimeout = true, 10*time.Second })
	sc := twoSeqs
	want := referenceTrace(t, sc)
	first, last := &handoffSim{}, &handoffSim{}
	_, p := handoffPipeline(t, first, last, Config{})
	got := sc.run(t, pipelineForward(p))
	for step := range want.tokens {
		if !slices.Equal(got.tokens[step], want.tokens[step]) {
			t.Fatalf("step %d: tokens %v, want %v (one engine)", step, got.tokens[step], want.tokens[step])
		}
	}
	if n := first.launchedOut.Load() + last.launchedIn.Load(); n != 0 {
		t.Errorf("%d passes launched through a port nobody opened", n)
	}
}
