package pipeline

import (
	"context"
	"errors"
	"slices"
	"sync"
	"testing"
	"time"

	"github.com/meshnode/meshnode/node/sample"
	"github.com/meshnode/meshnode/node/wire"
	"github.com/meshnode/meshnode/stage"
)

var threeStages = []int{0, 2, 4, 5}

// longSeqs' prefill is 170 rows, 42.5 KiB of f32 activations: socket
// streams write it out of line (outOfLineBytes) and lend it to the stage
// that reads it.
var longSeqs = scenario{
	seqs:    []stage.SeqID{1, 2},
	prompts: [][]int32{storyTokens(110, 3), storyTokens(60, 11)},
	steps:   8,
}

// storyTokens is a prompt of n token ids of stories260K's vocabulary, BOS
// first, spread over it by a stride.
func storyTokens(n, stride int) []int32 {
	p := []int32{1}
	for i := 1; i < n; i++ {
		p = append(p, int32(3+(i*stride*37)%500))
	}
	return p
}

func TestGreedyMatchesSingleEngine(t *testing.T) {
	wants := map[*scenario]trace{&twoSeqs: referenceTrace(t, twoSeqs), &longSeqs: referenceTrace(t, longSeqs)}
	for _, tc := range []struct {
		name   string
		dtype  stage.DType
		logits bool
		so     []stageOpts
		inproc bool      // the origin reaches hop 0 in process, as a node reaches its own stage
		socket bool      // every hop over socket streams, as between nodes of one machine
		sc     *scenario // nil: twoSeqs
	}{
		{name: "f32", dtype: stage.F32, logits: true},
		{name: "f16", dtype: stage.F16},
		// Frames of at most 1 KiB into hops 1 and 2: the prefill's
		// activations travel in parts of 5 rows.
		{name: "f16 split", dtype: stage.F16, so: []stageOpts{{}, {maxFrame: 1 << 10}, {maxFrame: 1 << 10}}},
		{name: "in-process hop 0", dtype: stage.F32, logits: true, inproc: true},
		{name: "sockets", dtype: stage.F32, logits: true, socket: true},
		{name: "sockets f16 split", dtype: stage.F16, socket: true, so: []stageOpts{{}, {maxFrame: 1 << 10}, {maxFrame: 1 << 10}}},
		{name: "sockets long", dtype: stage.F32, logits: true, socket: true, sc: &longSeqs},
		// A part of about 140 rows written out of line, lent until the
		// next is read: the joiner must have copied it by then.
		{name: "sockets long split", dtype: stage.F32, logits: true, socket: true, sc: &longSeqs,
			so: []stageOpts{{}, {maxFrame: 36 << 10}, {maxFrame: 36 << 10}}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			sc := tc.sc
			if sc == nil {
				sc = &twoSeqs
			}
			want := wants[sc]
			so := make([]stageOpts, len(threeStages)-1)
			copy(so, tc.so)
			seen := make([]*dtypesSeen, len(so))
			for i := range so {
				seen[i] = &dtypesSeen{}
				so[i].wrap = seen[i].wrap
			}
			var m *mesh
			cfg := Config{WireDType: tc.dtype, ReturnLogits: tc.logits}
			switch {
			case tc.socket:
				m = newSocketMesh(t, threeStages, engineOpts, so...)
				cfg.Dial = m.dialSockets()
			default:
				m = newMesh(t, threeStages, engineOpts, so...)
			}
			if tc.inproc {
				cfg.Dial = m.dialHop0InProcess()
			}
			p := m.pipeline(t, cfg)
			if info := p.Info(); info.Start != 0 || info.End != 5 || info.Layers != 5 || info.Vocab != 512 || info.Context != 256 || info.WireDType != tc.dtype {
				t.Fatalf("info %+v", info)
			}
			openAll(t, p, *sc, func(int) sample.Params { return greedy() })
			got := sc.run(t, pipelineForward(p))
			for i := range want.tokens {
				if !slices.Equal(got.tokens[i], want.tokens[i]) {
					t.Fatalf("step %d: tokens %v, want %v", i, got.tokens[i], want.tokens[i])
				}
				if tc.logits {
					if d := maxAbsDiff(got.logits[i], want.logits[i]); d > 1e-5 {
						t.Fatalf("step %d: max |pipeline - single| logits = %g", i, d)
					}
				} else if got.logits[i] != nil {
					t.Fatalf("step %d: logits returned without asking", i)
				}
			}
			for _, q := range sc.seqs {
				if err := p.Release(q); err != nil {
					t.Fatal(err)
				}
			}
			if err := p.Close(); err != nil {
				t.Fatal(err)
			}
			if !errors.Is(p.Err(), ErrClosed) {
				t.Fatalf("after close: %v", p.Err())
			}
			for i, s := range m.stages {
				if bad := s.badReports(); len(bad) > 0 {
					t.Errorf("stage %d reported bad peers: %v", i, bad)
				}
				if n := s.sockBytes.Load(); (n > 0) != tc.socket {
					t.Errorf("stage %d: %d bytes through its socket streams", i, n)
				}
			}
			// Hops over socket streams carry f32 whatever the
			// pipeline's wire dtype: exact, and no conversions.
			wantDType := tc.dtype
			if tc.socket {
				wantDType = stage.F32
			}
			for i, d := range seen[1:] {
				if got := d.all(); len(got) != 1 || got[0] != wantDType {
					t.Errorf("stage %d received activations as %v, want only %s", i+1, got, wantDType)
				}
			}
		})
	}
}

// Two micro-batches of two sequences each alternate, so that one is on a
// later stage while the other enters the first.
func TestPipelining(t *testing.T) {
	a := scenario{seqs: []stage.SeqID{1, 2}, prompts: twoSeqs.prompts, steps: 16}
	b := scenario{seqs: []stage.SeqID{3, 4}, prompts: [][]int32{{1, 22, 300}, {1, 403, 407, 261, 378}}, steps: 16}
	wantA, wantB := referenceTrace(t, a), referenceTrace(t, b)

	m := newMesh(t, threeStages, engineOpts)
	p := m.pipeline(t, Config{MaxInFlight: 2})
	greedyAll := func(int) sample.Params { return greedy() }
	openAll(t, p, a, greedyAll)
	openAll(t, p, b, greedyAll)
	ctx := context.Background()
	batchA, batchB := a.prefill(), b.prefill()
	for step := 0; step <= a.steps; step++ {
		ca, err := p.Submit(ctx, batchA)
		if err != nil {
			t.Fatal(err)
		}
		cb, err := p.Submit(ctx, batchB)
		if err != nil {
			t.Fatal(err)
		}
		if cb.Step() != ca.Step()+1 {
			t.Fatalf("steps %d then %d", ca.Step(), cb.Step())
		}
		ra, err := ca.Wait(ctx)
		if err != nil {
			t.Fatal(err)
		}
		rb, err := cb.Wait(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(ra.Tokens, wantA.tokens[step]) || !slices.Equal(rb.Tokens, wantB.tokens[step]) {
			t.Fatalf("step %d: tokens %v %v, want %v %v", step, ra.Tokens, rb.Tokens, wantA.tokens[step], wantB.tokens[step])
		}
		if !slices.Equal(ra.Seqs, a.seqs) || !slices.Equal(rb.Seqs, b.seqs) {
			t.Fatalf("step %d: results for %v %v", step, ra.Seqs, rb.Seqs)
		}
		batchA, batchB = a.decode(step, ra.Tokens), b.decode(step, rb.Tokens)
	}
}

// Two origins share the stages with the same sequence ids: each stage
// keeps them apart.
func TestPipelinesShareStages(t *testing.T) {
	want := referenceTrace(t, twoSeqs)
	m := newMesh(t, threeStages, engineOpts)
	p1 := m.pipeline(t, Config{Origin: "node-a"})
	p2 := m.pipeline(t, Config{Origin: "node-b"})
	var wg sync.WaitGroup
	for _, p := range []*Pipeline{p1, p2} {
		wg.Go(func() {
			openAll(t, p, twoSeqs, func(int) sample.Params { return greedy() })
			got := twoSeqs.run(t, pipelineForward(p))
			for i := range want.tokens {
				if !slices.Equal(got.tokens[i], want.tokens[i]) {
					t.Errorf("pipeline %s step %d: tokens %v, want %v", p.ID(), i, got.tokens[i], want.tokens[i])
					return
				}
			}
		})
	}
	wg.Wait()
}

func TestSamplingAtLastStage(t *testing.T) {
	params := func(i int) sample.Params {
		seed := int64(1234 + 1111*i)
		return sample.Params{
			Temperature: 0.9, TopK: 40, TopP: 0.95, MinP: 0.02, Seed: &seed,
			RepeatPenalty: 1.3, RepeatLastN: 16, FrequencyPenalty: 0.2, PresencePenalty: 0.1,
		}
	}
	sc := twoSeqs

	// The reference: one engine, node/sample on its logits, the history
	// being the prompt and the tokens generated so far.
	e := openEngines(t, []int{0, 5}, engineOpts)[0]
	vocab := e.Info().Vocab
	samplers := make([]*sample.Sampler, len(sc.seqs))
	history := make([][]int32, len(sc.seqs))
	for i, q := range sc.seqs {
		if err := e.Open(q); err != nil {
			t.Fatal(err)
		}
		samplers[i] = sample.New(params(i))
		history[i] = slices.Clone(sc.prompts[i])
	}
	want := sc.run(t, func(b *stage.Batch) ([]int32, []float32, error) {
		out, err := e.Forward(context.Background(), b)
		if err != nil {
			return nil, nil, err
		}
		toks := make([]int32, len(b.Outputs))
		for i := range toks {
			toks[i] = samplers[i].Sample(out.LogitsRow(i, vocab), history[i])
			history[i] = append(history[i], toks[i])
		}
		return toks, nil, nil
	})

	m := newMesh(t, threeStages, engineOpts)
	p := m.pipeline(t, Config{WireDType: stage.F32})
	openAll(t, p, sc, params)
	got := sc.run(t, pipelineForward(p))
	for i := range want.tokens {
		if !slices.Equal(got.tokens[i], want.tokens[i]) {
			t.Fatalf("step %d: tokens %v, want %v", i, got.tokens[i], want.tokens[i])
		}
	}
	// Not all greedy: the parameters did something.
	g := referenceTrace(t, sc)
	same := true
	for i := range g.tokens {
		same = same && slices.Equal(g.tokens[i], want.tokens[i])
	}
	if same {
		t.Fatal("sampled tokens equal the greedy ones")
	}
}

// A trim and a replay from the trimmed position give the same tokens, the
// penalties included: the last stage's history follows the trim.
func TestTrimReplay(t *testing.T) {
	m := newMesh(t, threeStages, engineOpts)
	p := m.pipeline(t, Config{})
	params := greedy()
	params.RepeatPenalty, params.RepeatLastN = 1.5, -1
	sc := scenario{seqs: []stage.SeqID{7}, prompts: [][]int32{{1, 403, 407}}, steps: 12}
	openAll(t, p, sc, func(int) sample.Params { return params })
	first := sc.run(t, pipelineForward(p))

	// Back to the position of decode step 5's token and on from there.
	const from = 5
	pos := int32(len(sc.prompts[0]) + from)
	if err := p.Trim(7, pos); err != nil {
		t.Fatal(err)
	}
	last := first.tokens[from]
	for step := from; step < sc.steps; step++ {
		picked, err := p.Forward(context.Background(), sc.decode(step, last))
		if err != nil {
			t.Fatal(err)
		}
		toks := picked.Tokens
		if !slices.Equal(toks, first.tokens[step+1]) {
			t.Fatalf("replayed step %d: %v, first time %v", step+1, toks, first.tokens[step+1])
		}
		last = toks
	}
	if err := p.Trim(8, 0); !errors.Is(err, stage.ErrUnknownSeq) {
		t.Fatalf("trim of a sequence never opened: %v", err)
	}
}

// An OPEN that one stage refuses fails with that stage's error and leaves
// no slot taken on the stages before it. Hop 0 has 3 slots and hop 1 only
// 2: if the refused opens leaked on hop 0, the second would fail there.
func TestOpenRefused(t *testing.T) {
	m := newMesh(t, threeStages, engineOpts, stageOpts{maxSeqs: 3}, stageOpts{maxSeqs: 2})
	p := m.pipeline(t, Config{})
	if got := p.Info().MaxSeqs; got != 2 {
		t.Fatalf("MaxSeqs %d, want the smallest hop's 2", got)
	}
	for q := range stage.SeqID(2) {
		if err := p.Open(q, greedy(), []int32{1}); err != nil {
			t.Fatal(err)
		}
	}
	for _, q := range []stage.SeqID{8, 9} {
		err := p.Open(q, greedy(), []int32{1})
		var he *HopError
		if !errors.Is(err, stage.ErrNoSlot) || !errors.As(err, &he) || he.Hop != 1 {
			t.Fatalf("open %d over the slots: %v", q, err)
		}
	}
	if p.Err() != nil {
		t.Fatalf("a refused open broke the pipeline: %v", p.Err())
	}
	if err := p.Open(1, greedy(), nil); !errors.Is(err, stage.ErrSeqExists) {
		t.Fatalf("open of an open sequence: %v", err)
	}
	if err := p.Release(1); err != nil {
		t.Fatal(err)
	}
	if err := p.Open(9, greedy(), []int32{1}); err != nil {
		t.Fatalf("open after a release: %v", err)
	}
	if _, err := p.Forward(context.Background(), &stage.Batch{Seqs: []stage.SeqID{9}, Pos: []int32{0}, Tokens: []int32{1}, Outputs: []int{0}}); err != nil {
		t.Fatal(err)
	}
	// A batch for a sequence this pipeline did not open never leaves.
	_, err := p.Forward(context.Background(), &stage.Batch{Seqs: []stage.SeqID{1}, Pos: []int32{0}, Tokens: []int32{1}})
	if !errors.Is(err, stage.ErrUnknownSeq) || p.Err() != nil {
		t.Fatalf("batch of a released sequence: %v (pipeline %v)", err, p.Err())
	}
}

// A step the engine fails (here: past the context) fails alone.
func TestStepErrorKeepsPipeline(t *testing.T) {
	opts := engineOpts
	opts.BatchSize = 4
	m := newMesh(t, threeStages, opts)
	p := m.pipeline(t, Config{})
	if err := p.Open(1, greedy(), nil); err != nil {
		t.Fatal(err)
	}
	big := &stage.Batch{}
	for i := range 6 { // over the engines' batch size of 4
		big.Seqs, big.Pos, big.Tokens = append(big.Seqs, 1), append(big.Pos, int32(i)), append(big.Tokens, 1)
	}
	_, err := p.Forward(context.Background(), big)
	var re *wire.RemoteError
	var he *HopError
	if !errors.As(err, &re) || !errors.As(err, &he) || he.Hop != 0 || p.Err() != nil {
		t.Fatalf("oversized batch: %v (pipeline %v)", err, p.Err())
	}
	picked, err := p.Forward(context.Background(), &stage.Batch{Seqs: []stage.SeqID{1}, Pos: []int32{0}, Tokens: []int32{1}, Outputs: []int{0}})
	if err != nil || len(picked.Tokens) != 1 {
		t.Fatalf("after a failed step: %v %v", picked.Tokens, err)
	}
}

// Closing a pipeline frees its sequences on every stage.
func TestCloseReleasesSlots(t *testing.T) {
	m := newMesh(t, threeStages, engineOpts)
	for range 3 {
		p := m.pipeline(t, Config{})
		for q := range stage.SeqID(4) {
			if err := p.Open(q, greedy(), nil); err != nil {
				t.Fatal(err)
			}
		}
		if _, err := p.Forward(context.Background(), &stage.Batch{Seqs: []stage.SeqID{0}, Pos: []int32{0}, Tokens: []int32{1}, Outputs: []int{0}}); err != nil {
			t.Fatal(err)
		}
		p.Close()
		if _, err := p.Forward(context.Background(), &stage.Batch{Seqs: []stage.SeqID{0}, Pos: []int32{1}, Tokens: []int32{1}}); !errors.Is(err, ErrClosed) {
			t.Fatalf("forward after close: %v", err)
		}
	}
}

func TestRouteChecks(t *testing.T) {
	m := newMesh(t, threeStages, engineOpts)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	for _, tc := range []struct {
		name  string
		route []Hop
		hash  string
	}{
		{"gap", []Hop{m.route[0], m.route[2]}, ""},
		{"wrong range", []Hop{{Peer: m.route[0].Peer, Start: 0, End: 3}, {Peer: m.route[2].Peer, Start: 3, End: 5}}, ""},
		{"short", m.route[:2], ""},
		{"other model", m.route, "other-hash"},
	} {
		if _, err := New(ctx, Config{Route: tc.route, Dial: m.conns.Dial, ModelHash: tc.hash}); err == nil {
			t.Errorf("%s: route accepted", tc.name)
		}
	}
}

// dtypesSeen records the dtypes of the activations an engine is given.
type dtypesSeen struct {
	mu     sync.Mutex
	dtypes []stage.DType
}

func (d *dtypesSeen) wrap(e stage.Engine) stage.Engine { return dtypeEngine{e, d} }

func (d *dtypesSeen) all() []stage.DType {
	d.mu.Lock()
	defer d.mu.Unlock()
	return slices.Clone(d.dtypes)
}

type dtypeEngine struct {
	stage.Engine
	seen *dtypesSeen
}

// Forward notes the dtype of b's hidden states, and lends its own hidden
// states as an engine may (Output.Free): poisoned with NaNs once released,
// so that a stage that sends them after Release sends garbage.
func (e dtypeEngine) Forward(ctx context.Context, b *stage.Batch) (*stage.Output, error) {
	if b.Hidden != nil {
		e.seen.mu.Lock()
		if !slices.Contains(e.seen.dtypes, b.Hidden.DType) {
			e.seen.dtypes = append(e.seen.dtypes, b.Hidden.DType)
		}
		e.seen.mu.Unlock()
	}
	out, err := e.Engine.Forward(ctx, b)
	if err != nil || out.Hidden == nil {
		return out, err
	}
	h := *out.Hidden
	h.Data = slices.Clone(h.Data)
	out.Release()
	lent := &stage.Output{Hidden: &h}
	lent.Free = func() {
		for i := range h.Data {
			h.Data[i] = 0xff
		}
	}
	return lent, nil
}
