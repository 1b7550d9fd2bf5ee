package pipeline

import (
	"context"
	"crypto/rand"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
	"sync"
	"time"

	"go.uber.org/zap"
	"google.golang.org/protobuf/proto"

	"github.com/meshnode/meshnode/node/sample"
	"github.com/meshnode/meshnode/node/wire"
	meshnodev1 "github.com/meshnode/meshnode/proto/meshnode/v1"
	"github.com/meshnode/meshnode/stage"
)

// Defaults of Config.
const (
	DefaultStepTimeout = 30 * time.Second
	DefaultMaxInFlight = 4
)

// Hop is one stage of a route: who serves it and which layers it holds.
type Hop struct {
	Peer       string
	Start, End int
}

// Config describes a pipeline to build.
type Config struct {
	// Route lists the stages in order; together they must cover the
	// model's layers from 0, each hop starting where the last one ended.
	Route []Hop
	// Dial reaches the hops; required.
	Dial Dialer
	// Origin is this node's peer id, which names the pipeline on the
	// stages together with a random id; "" means "origin".
	Origin string
	// WireDType is the activations' dtype between stages; 0 means f16.
	WireDType stage.DType
	// StepTimeout is how long the oldest request in flight may go without
	// a reply (counted from when it was sent or became the oldest) before
	// the pipeline is declared stalled and broken; 0 means
	// DefaultStepTimeout.
	StepTimeout time.Duration
	// MaxInFlight bounds the batches submitted and not yet answered;
	// Submit waits for room. 0 means DefaultMaxInFlight.
	MaxInFlight int
	// ModelHash, if set, must be every hop's.
	ModelHash string
	// ReturnLogits has the last stage send each step's logits too (tests
	// and debugging only: it is vocab floats per output row).
	ReturnLogits bool
	// OnBadPeer, if set, is told about a hop that sent the origin a
	// malformed frame. It must not block.
	OnBadPeer func(peer string, err error)
	Logger    *zap.Logger
}

// Result is the reply to one batch.
type Result struct {
	// Tokens holds the token sampled for each output row of the batch, in
	// its order; Seqs and Pos say whose it is and the position it takes.
	Seqs   []stage.SeqID
	Pos    []int32
	Tokens []int32
	// Logprobs holds the log-probabilities of the rows whose sequence was
	// opened asking for them (sample.Params.Logprobs), as sample.Picked.
	Logprobs []sample.Logprob
	// Logits holds len(Tokens) rows of vocab floats, with
	// Config.ReturnLogits only.
	Logits []float32
}

type callKind uint8

const (
	callSetup callKind = iota
	callControl
	callBatch
)

// Call is a request in flight: a batch from Submit, or a control
// operation.
type Call struct {
	step uint64
	kind callKind
	ctl  wire.Control // callControl
	// callBatch: what the reply must hold.
	seqs []stage.SeqID
	pos  []int32
	slot bool // holds room in the in-flight bound
	// async calls (releases) have nobody waiting; their failures are
	// logged.
	async bool

	since  time.Time // when it was sent or became the oldest
	logits []float32

	done chan struct{}
	res  *Result
	err  error
}

// Done is closed when the call has its result.
func (c *Call) Done() <-chan struct{} { return c.done }

// Step is the call's step id on the wire.
func (c *Call) Step() uint64 { return c.step }

// Result returns the call's result; valid once Done is closed.
func (c *Call) Result() (*Result, error) {
	<-c.done
	return c.res, c.err
}

// Wait waits for the result or for ctx. A call abandoned by ctx stays in
// flight; its result is dropped.
func (c *Call) Wait(ctx context.Context) (*Result, error) {
	select {
	case <-c.done:
		return c.res, c.err
	case <-ctx.Done():
		return nil, ctx.Err()
	}
}

// Pipeline drives a route of stages from the origin. Its methods are safe
// for concurrent use; requests are answered in the order they were sent.
type Pipeline struct {
	cfg   Config
	route []wire.Hop
	info  stage.Info
	lim   wire.Limits
	id    string
	log   *zap.Logger

	// ctx is the streams' lifetime; cancelled (with the reason) when the
	// pipeline breaks or closes.
	ctx    context.Context
	cancel context.CancelCauseFunc
	fwd    meshnodev1.StageService_ForwardClient
	ret    meshnodev1.StageService_ForwardClient
	wg     sync.WaitGroup
	retEnd chan struct{} // closed when the return reader is done
	slots  chan struct{} // in-flight batches

	// sendMu orders steps on the wire as they are numbered.
	sendMu sync.Mutex

	mu       sync.Mutex
	nextStep uint64
	pending  []*Call // sent and not yet answered, oldest first
	open     map[stage.SeqID]openSeq
	err      error // why the pipeline broke; set once
	closing  bool
	done     chan struct{} // closed when err is set
}

// New dials the route, checks that its stages chain into one model, and
// sets the pipeline up on every stage. ctx bounds the setup only.
func New(ctx context.Context, cfg Config) (*Pipeline, error) {
	if cfg.Dial == nil {
		return nil, errors.New("pipeline: no dialer")
	}
	if len(cfg.Route) == 0 || len(cfg.Route) > wire.MaxRouteHops {
		return nil, fmt.Errorf("pipeline: route of %d hops, want 1 to %d", len(cfg.Route), wire.MaxRouteHops)
	}
	next := 0
	for i, h := range cfg.Route {
		if h.Start != next || h.End <= h.Start {
			return nil, fmt.Errorf("pipeline: hop %d holds [%d,%d), want a range from %d", i, h.Start, h.End, next)
		}
		next = h.End
	}
	if cfg.Origin == "" {
		cfg.Origin = "origin"
	}
	if cfg.WireDType == 0 {
		cfg.WireDType = stage.F16
	}
	if cfg.WireDType.Size() == 0 {
		return nil, fmt.Errorf("pipeline: unknown wire dtype %s", cfg.WireDType)
	}
	if cfg.StepTimeout <= 0 {
		cfg.StepTimeout = DefaultStepTimeout
	}
	if cfg.MaxInFlight <= 0 {
		cfg.MaxInFlight = DefaultMaxInFlight
	}
	log := cfg.Logger
	if log == nil {
		log = zap.NewNop()
	}
	var idb [16]byte
	_, _ = rand.Read(idb[:])
	p := &Pipeline{
		cfg: cfg, id: hex.EncodeToString(idb[:]),
		retEnd: make(chan struct{}),
		slots:  make(chan struct{}, cfg.MaxInFlight),
		open:   map[stage.SeqID]openSeq{},
		done:   make(chan struct{}),
	}
	p.log = log.With(zap.String("pipeline", p.id))
	if err := p.describe(ctx); err != nil {
		return nil, err
	}
	p.ctx, p.cancel = context.WithCancelCause(context.Background())
	// Until the setup is acknowledged, ctx's end ends the streams too.
	stop := context.AfterFunc(ctx, func() { p.cancel(ctx.Err()) })
	defer stop()
	setup, err := p.connect()
	if err != nil {
		p.cancel(err)
		return nil, err
	}
	p.wg.Add(3)
	go p.readReplies()
	go p.watchForward()
	go p.watchdog()
	select {
	case <-setup.done:
	case <-ctx.Done():
		p.fail(ctx.Err())
	}
	if err := setup.err; err != nil {
		p.Close()
		return nil, err
	}
	p.log.Debug("pipeline up", zap.Int("hops", len(p.route)))
	return p, nil
}

// describe asks every hop what it holds and checks that the answers make
// one model, split as the route says.
func (p *Pipeline) describe(ctx context.Context) error {
	ctx, cancel := context.WithTimeout(ctx, p.cfg.StepTimeout)
	defer cancel()
	infos := make([]wire.Info, len(p.cfg.Route))
	for i, h := range p.cfg.Route {
		hopErr := func(err error) error { return p.hopErrorAt(h, i, err) }
		conn, err := p.cfg.Dial(ctx, h.Peer)
		if err != nil {
			return hopErr(err)
		}
		pi, err := meshnodev1.NewStageServiceClient(conn).Info(ctx, &meshnodev1.InfoRequest{})
		if err != nil {
			return hopErr(fmt.Errorf("%w: %w", wire.ErrUnavailable, err))
		}
		in, err := wire.DecodeInfo(pi, wire.Limits{})
		if err != nil {
			p.badPeer(h.Peer, err)
			return hopErr(err)
		}
		first := infos[0]
		switch {
		case in.Start != h.Start || in.End != h.End:
			return hopErr(fmt.Errorf("holds %s, the route wants [%d,%d)", in.Range(), h.Start, h.End))
		case in.Layers != p.cfg.Route[len(p.cfg.Route)-1].End:
			return hopErr(fmt.Errorf("model has %d layers, the route covers %d", in.Layers, p.cfg.Route[len(p.cfg.Route)-1].End))
		case p.cfg.ModelHash != "" && in.ModelHash != p.cfg.ModelHash:
			return hopErr(fmt.Errorf("serves model %q, want %q", in.ModelHash, p.cfg.ModelHash))
		case i > 0 && (in.ModelHash != first.ModelHash || in.Arch != first.Arch || in.Embd != first.Embd || in.Vocab != first.Vocab):
			return hopErr(fmt.Errorf("serves %s %q (embd %d, vocab %d), hop 0 serves %s %q (embd %d, vocab %d)",
				in.Arch, in.ModelHash, in.Embd, in.Vocab, first.Arch, first.ModelHash, first.Embd, first.Vocab))
		}
		infos[i] = in
	}
	p.info = stage.Info{
		Arch: infos[0].Arch, Layers: infos[0].Layers, Embd: infos[0].Embd, Vocab: infos[0].Vocab,
		Start: 0, End: infos[0].Layers, Context: infos[0].Context, MaxSeqs: infos[0].MaxSeqs,
		WireDType: p.cfg.WireDType, Engine: "pipeline",
	}
	var backends []string
	for i, in := range infos {
		p.info.Context = min(p.info.Context, in.Context)
		p.info.MaxSeqs = min(p.info.MaxSeqs, in.MaxSeqs)
		backends = append(backends, in.Backend)
		h := p.cfg.Route[i]
		p.route = append(p.route, wire.Hop{Peer: h.Peer, Start: h.Start, End: h.End, MaxFrameBytes: in.MaxFrameBytes})
	}
	p.info.Backend = strings.Join(backends, "+")
	p.lim = wire.Limits{MaxVocab: p.info.Vocab}
	return nil
}

// connect opens the return stream to the last hop and the forward stream
// to hop 0, and sends both Setups. It returns the call that the last
// stage's acknowledgement completes.
func (p *Pipeline) connect() (*Call, error) {
	last := len(p.route) - 1
	setup := wire.Setup{
		Role: wire.RoleReturn, PipelineID: p.id, Origin: p.cfg.Origin, Route: p.route,
		Hop: last, WireDType: p.cfg.WireDType, ReturnLogits: p.cfg.ReturnLogits,
	}
	open := func(hop int, st wire.Setup) (meshnodev1.StageService_ForwardClient, error) {
		conn, err := p.cfg.Dial(p.ctx, p.route[hop].Peer)
		if err != nil {
			return nil, p.hopError(hop, err)
		}
		s, err := meshnodev1.NewStageServiceClient(conn).Forward(p.ctx)
		if err != nil {
			return nil, p.hopError(hop, fmt.Errorf("%w: %w", wire.ErrUnavailable, err))
		}
		f, err := wire.EncodeSetup(st)
		if err != nil {
			return nil, err
		}
		if err := s.Send(f); err != nil {
			return nil, p.hopError(hop, fmt.Errorf("%w: sending setup: %w", wire.ErrUnavailable, err))
		}
		return s, nil
	}
	var err error
	if p.ret, err = open(last, setup); err != nil {
		return nil, err
	}
	setup.Role, setup.Hop = wire.RoleForward, 0
	if p.fwd, err = open(0, setup); err != nil {
		return nil, err
	}
	c := &Call{step: 0, kind: callSetup, since: time.Now(), done: make(chan struct{})}
	p.pending = append(p.pending, c)
	p.nextStep = 1
	return c, nil
}

// Info describes the whole model as the route serves it: layers [0,L),
// the smallest context and sequence count of its hops.
func (p *Pipeline) Info() stage.Info { return p.info }

// ID is the pipeline's id on its stages.
func (p *Pipeline) ID() string { return p.id }

// Err returns why the pipeline broke, or nil while it works.
func (p *Pipeline) Err() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.err
}

// Done is closed when the pipeline breaks or closes.
func (p *Pipeline) Done() <-chan struct{} { return p.done }

// Open starts a sequence on every stage; the last stage will sample it
// with params, the prompt counting for the repetition penalties. If a
// stage fails the open, the stages before it are released again.
func (p *Pipeline) Open(seq stage.SeqID, params sample.Params, prompt []int32) error {
	if err := params.Validate(); err != nil {
		return err
	}
	if len(prompt) > wire.DefaultMaxHistory {
		return fmt.Errorf("pipeline: prompt of %d tokens, over the %d a stage accepts", len(prompt), wire.DefaultMaxHistory)
	}
	for i, t := range prompt {
		if t < 0 || int(t) >= p.info.Vocab {
			return fmt.Errorf("pipeline: prompt token %d at %d is outside the vocabulary of %d", t, i, p.info.Vocab)
		}
	}
	p.mu.Lock()
	_, exists := p.open[seq]
	p.mu.Unlock()
	if exists {
		return fmt.Errorf("pipeline: %w: %d", stage.ErrSeqExists, seq)
	}
	c := wire.Control{Op: wire.OpOpen, Seq: seq, Sampling: samplingToWire(params), History: prompt}
	call, err := p.sendControl(c, false)
	if err == nil {
		_, err = call.Result()
	}
	if err != nil {
		if p.Err() == nil {
			// Stages before the one that failed hold the sequence.
			_, _ = p.sendControl(wire.Control{Op: wire.OpRelease, Seq: seq}, true)
		}
		return err
	}
	p.mu.Lock()
	p.open[seq] = openSeq{logprobs: params.Logprobs}
	p.mu.Unlock()
	return nil
}

// openSeq is what the origin keeps of an open sequence.
type openSeq struct {
	logprobs bool // its tokens come with log-probabilities
}

// Trim drops the sequence's positions >= pos on every stage, and from the
// last stage's history.
func (p *Pipeline) Trim(seq stage.SeqID, pos int32) error {
	if pos < 0 {
		return fmt.Errorf("pipeline: trim position %d is negative", pos)
	}
	if err := p.checkOpen(seq); err != nil {
		return err
	}
	call, err := p.sendControl(wire.Control{Op: wire.OpTrim, Seq: seq, Pos: pos}, false)
	if err != nil {
		return err
	}
	_, err = call.Result()
	return err
}

// Release frees the sequence on every stage. It does not wait for the
// stages: the release is ordered after everything sent before it, and a
// failure is logged. It returns an error only for a sequence that is not
// open or a pipeline that is broken (whose stages released everything).
func (p *Pipeline) Release(seq stage.SeqID) error {
	if err := p.checkOpen(seq); err != nil {
		return err
	}
	p.mu.Lock()
	delete(p.open, seq)
	p.mu.Unlock()
	_, err := p.sendControl(wire.Control{Op: wire.OpRelease, Seq: seq}, true)
	return err
}

// wantLogprobs says whether any of seqs asked for log-probabilities.
func (p *Pipeline) wantLogprobs(seqs []stage.SeqID) bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	for _, q := range seqs {
		if p.open[q].logprobs {
			return true
		}
	}
	return false
}

func (p *Pipeline) checkOpen(seq stage.SeqID) error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if _, ok := p.open[seq]; !ok {
		return fmt.Errorf("pipeline: %w: %d", stage.ErrUnknownSeq, seq)
	}
	return nil
}

func (p *Pipeline) sendControl(c wire.Control, async bool) (*Call, error) {
	f, err := wire.EncodeControl(0, c)
	if err != nil {
		return nil, err
	}
	call := &Call{kind: callControl, ctl: c, async: async, done: make(chan struct{})}
	return call, p.send(call, f)
}

// Forward runs the batch through every stage and returns the token
// sampled for each of its output rows, with the log-probabilities of the
// sequences that asked for them. It is Submit and Wait.
func (p *Pipeline) Forward(ctx context.Context, b *stage.Batch) (sample.Picked, error) {
	c, err := p.Submit(ctx, b)
	if err != nil {
		return sample.Picked{}, err
	}
	res, err := c.Wait(ctx)
	if err != nil {
		return sample.Picked{}, err
	}
	return res.Picked(), nil
}

// Picked is the result's tokens and log-probabilities.
func (r *Result) Picked() sample.Picked {
	return sample.Picked{Tokens: r.Tokens, Logprobs: r.Logprobs}
}

// Submit sends the batch (token ids into hop 0) and returns at once, so
// that several batches can be on different stages at the same time. It
// waits while MaxInFlight batches are unanswered. Every sequence must be
// open; the same sequence's next step can only be sent once this one's
// token is known, so micro-batches in flight together hold different
// sequences. b may be reused once Submit returns.
func (p *Pipeline) Submit(ctx context.Context, b *stage.Batch) (*Call, error) {
	if b == nil {
		return nil, errors.New("pipeline: nil batch")
	}
	if err := b.Validate(p.info); err != nil {
		return nil, fmt.Errorf("pipeline: %w", err)
	}
	p.mu.Lock()
	for _, q := range b.Seqs {
		if _, ok := p.open[q]; !ok {
			p.mu.Unlock()
			return nil, fmt.Errorf("pipeline: %w: %d", stage.ErrUnknownSeq, q)
		}
	}
	p.mu.Unlock()
	f, err := wire.EncodeTokens(0, b)
	if err != nil {
		return nil, err
	}
	if size, limit := proto.Size(f), p.frameLimit(0); size > limit {
		return nil, fmt.Errorf("pipeline: batch of %d rows is a %d-byte frame, over hop 0's %d", b.Rows(), size, limit)
	}
	c := &Call{kind: callBatch, done: make(chan struct{}), slot: true}
	for _, o := range b.Outputs {
		c.seqs = append(c.seqs, b.Seqs[o])
		c.pos = append(c.pos, b.Pos[o]+1)
	}
	select {
	case p.slots <- struct{}{}:
	case <-ctx.Done():
		return nil, ctx.Err()
	case <-p.done:
		return nil, p.Err()
	}
	if err := p.send(c, f); err != nil {
		return nil, err
	}
	return c, nil
}

func (p *Pipeline) frameLimit(hop int) int {
	st := wire.Setup{Route: p.route}
	return st.FrameLimit(hop)
}

// send numbers the call, queues it for its reply and puts its frame on
// the forward stream; numbering and sending under one lock keeps the wire
// in step order. The frame is encoded by the caller with step 0.
func (p *Pipeline) send(c *Call, f *meshnodev1.Frame) error {
	p.sendMu.Lock()
	defer p.sendMu.Unlock()
	p.mu.Lock()
	if err := p.refuse(); err != nil {
		p.mu.Unlock()
		p.freeSlot(c)
		return err
	}
	c.step = p.nextStep
	p.nextStep++
	f.Step = c.step
	c.since = time.Now()
	if t := f.GetTokens(); t != nil {
		// No other batch in flight: the stages may hand this one's hidden
		// states over through a buffer between them (handoff.go), which
		// nothing else can be using.
		t.Alone = !slices.ContainsFunc(p.pending, func(o *Call) bool { return o.kind == callBatch })
	}
	p.pending = append(p.pending, c)
	p.mu.Unlock()
	if err := p.fwd.Send(f); err != nil && !errors.Is(err, io.EOF) {
		// io.EOF says the stream is gone; watchForward reports why.
		p.fail(p.hopError(0, fmt.Errorf("%w: sending step %d: %w", wire.ErrUnavailable, c.step, err)))
	}
	return nil
}

// refuse says why nothing more may be sent; p.mu is held.
func (p *Pipeline) refuse() error {
	switch {
	case p.err != nil:
		return p.err
	case p.closing:
		return ErrClosed
	}
	return nil
}

func (p *Pipeline) freeSlot(c *Call) {
	if c.slot {
		c.slot = false
		<-p.slots
	}
}

// head returns the oldest call in flight, or nil.
func (p *Pipeline) head() *Call {
	p.mu.Lock()
	defer p.mu.Unlock()
	if len(p.pending) == 0 {
		return nil
	}
	return p.pending[0]
}

// complete answers the oldest call.
func (p *Pipeline) complete(c *Call, res *Result, err error) {
	p.mu.Lock()
	if len(p.pending) == 0 || p.pending[0] != c {
		p.mu.Unlock()
		return // failed meanwhile
	}
	p.pending = p.pending[1:]
	if len(p.pending) > 0 {
		p.pending[0].since = time.Now()
	}
	p.mu.Unlock()
	p.finishCall(c, res, err)
}

func (p *Pipeline) finishCall(c *Call, res *Result, err error) {
	c.res, c.err = res, err
	if err != nil && c.async {
		p.log.Warn("request failed", zap.Uint64("step", c.step), zap.Error(err))
	}
	p.freeSlot(c)
	close(c.done)
}

// fail breaks the pipeline: every call in flight fails with err, later
// ones are refused, and the streams are cancelled, which ends the
// pipeline on every stage.
func (p *Pipeline) fail(err error) {
	p.mu.Lock()
	if p.err != nil {
		p.mu.Unlock()
		return
	}
	p.err = err
	pend := p.pending
	p.pending = nil
	close(p.done)
	p.mu.Unlock()
	if !errors.Is(err, ErrClosed) {
		p.log.Warn("pipeline broken", zap.Error(err))
	}
	p.cancel(err)
	for _, c := range pend {
		p.finishCall(c, nil, err)
	}
}

// Abort breaks the pipeline at once with err, for a route known to be
// gone (a stage's node left the mesh): what is in flight fails now
// instead of at the step timeout, nothing more is sent, and a later
// Close skips the graceful end down the route, which a gone stage would
// hold up. It does not wait for the pipeline's goroutines; Close does.
func (p *Pipeline) Abort(err error) {
	if err == nil {
		err = ErrClosed
	}
	p.fail(err)
}

// Close ends the pipeline. What is in flight gets a bounded time to be
// answered while the end of stream travels down the route, so that the
// stages tear down in order; then anything left fails with ErrClosed.
func (p *Pipeline) Close() error {
	p.mu.Lock()
	already := p.closing
	p.closing = true
	healthy := p.err == nil
	p.mu.Unlock()
	if !already && healthy && p.sendMu.TryLock() {
		// A Send blocked on a stalled hop holds sendMu; then there is no
		// graceful way down the route, and cancelling is what is left.
		err := p.fwd.CloseSend()
		p.sendMu.Unlock()
		if err == nil {
			t := time.NewTimer(min(p.cfg.StepTimeout, 5*time.Second))
			select {
			case <-p.retEnd:
			case <-t.C:
			}
			t.Stop()
		}
	}
	p.fail(ErrClosed)
	p.wg.Wait()
	return nil
}

// hopError names hop i as the one to blame for err; i < 0 names none.
func (p *Pipeline) hopError(i int, err error) error {
	if i < 0 || i >= len(p.route) {
		return &HopError{Hop: -1, Err: err}
	}
	h := p.route[i]
	return &HopError{Hop: i, Peer: h.Peer, Start: h.Start, End: h.End, Err: err}
}

func (p *Pipeline) hopErrorAt(h Hop, i int, err error) error {
	return &HopError{Hop: i, Peer: h.Peer, Start: h.Start, End: h.End, Err: err}
}

func (p *Pipeline) badPeer(peer string, err error) {
	p.log.Warn("bad frame from peer", zap.String("peer", peer), zap.Error(err))
	if p.cfg.OnBadPeer != nil {
		p.cfg.OnBadPeer(peer, err)
	}
}

// readReplies takes the last stage's replies, in order, and answers the
// calls. A reply that breaks the protocol breaks the pipeline.
func (p *Pipeline) readReplies() {
	defer p.wg.Done()
	defer close(p.retEnd)
	last := len(p.route) - 1
	for {
		f, err := p.ret.Recv()
		if err != nil {
			p.mu.Lock()
			closing := p.closing
			p.mu.Unlock()
			if closing && errors.Is(err, io.EOF) {
				return
			}
			p.fail(p.hopError(last, fmt.Errorf("%w: return stream ended: %w", wire.ErrUnavailable, err)))
			return
		}
		if err := p.reply(f); err != nil {
			var he *HopError
			if !errors.As(err, &he) {
				p.badPeer(p.route[last].Peer, err)
				err = p.hopError(last, err)
			}
			p.fail(err)
			return
		}
	}
}

// reply matches one frame from the last stage with the oldest call. It
// returns a HopError for an error that breaks the pipeline, and a plain
// error for a frame that breaks the protocol.
func (p *Pipeline) reply(f *meshnodev1.Frame) error {
	if f.GetError() != nil {
		re, err := wire.DecodeError(f)
		if err != nil {
			return err
		}
		if wire.Fatal(re.Code) {
			// The route's last word, whichever step it came with: a
			// broken link belongs to no step.
			return p.hopError(re.Hop, re)
		}
	}
	c := p.head()
	if c == nil {
		return fmt.Errorf("%w: %s reply for step %d with nothing in flight", wire.ErrBadFrame, wire.BodyKind(f), f.GetStep())
	}
	if f.GetStep() != c.step {
		return fmt.Errorf("%w: %s reply for step %d, expected step %d", wire.ErrBadFrame, wire.BodyKind(f), f.GetStep(), c.step)
	}
	switch f.GetBody().(type) {
	case *meshnodev1.Frame_Error:
		re, err := wire.DecodeError(f)
		if err != nil {
			return err
		}
		p.complete(c, nil, p.hopError(re.Hop, re))
	case *meshnodev1.Frame_Setup:
		if c.kind != callSetup {
			return fmt.Errorf("%w: setup reply to step %d", wire.ErrBadFrame, c.step)
		}
		st, err := wire.DecodeSetup(f)
		if err != nil {
			return err
		}
		if st.PipelineID != p.id || st.Hop != len(p.route)-1 {
			return fmt.Errorf("%w: setup acknowledged for pipeline %q hop %d", wire.ErrBadFrame, st.PipelineID, st.Hop)
		}
		p.complete(c, nil, nil)
	case *meshnodev1.Frame_Control:
		if c.kind != callControl {
			return fmt.Errorf("%w: control reply to step %d", wire.ErrBadFrame, c.step)
		}
		got, err := wire.DecodeControl(f, p.lim)
		if err != nil {
			return err
		}
		if got.Op != c.ctl.Op || got.Seq != c.ctl.Seq || got.Pos != c.ctl.Pos {
			return fmt.Errorf("%w: step %d acknowledged as %s of %d, sent %s of %d", wire.ErrBadFrame, c.step, got.Op, got.Seq, c.ctl.Op, c.ctl.Seq)
		}
		p.complete(c, nil, nil)
	case *meshnodev1.Frame_Logits:
		if c.kind != callBatch || !p.cfg.ReturnLogits || c.logits != nil || len(c.seqs) == 0 {
			return fmt.Errorf("%w: unexpected logits for step %d", wire.ErrBadFrame, c.step)
		}
		l, rows, vocab, err := wire.DecodeLogits(f, p.lim)
		if err != nil {
			return err
		}
		if rows != len(c.seqs) || vocab != p.info.Vocab {
			return fmt.Errorf("%w: step %d logits are [%d,%d], want [%d,%d]", wire.ErrBadFrame, c.step, rows, vocab, len(c.seqs), p.info.Vocab)
		}
		c.logits = l // only this goroutine touches c until it completes
	case *meshnodev1.Frame_Tokens:
		if c.kind != callBatch {
			return fmt.Errorf("%w: tokens reply to step %d", wire.ErrBadFrame, c.step)
		}
		s, err := wire.DecodeSampled(f, p.lim)
		if err != nil {
			return err
		}
		if !slices.Equal(s.Seqs, c.seqs) || !slices.Equal(s.Pos, c.pos) {
			return fmt.Errorf("%w: step %d answered for sequences %v at %v, want %v at %v", wire.ErrBadFrame, c.step, s.Seqs, s.Pos, c.seqs, c.pos)
		}
		if p.cfg.ReturnLogits && len(c.seqs) > 0 && c.logits == nil {
			return fmt.Errorf("%w: step %d answered without its logits", wire.ErrBadFrame, c.step)
		}
		if len(s.Logprobs) == 0 && p.wantLogprobs(s.Seqs) {
			return fmt.Errorf("%w: step %d answered without the log-probabilities its sequences asked for (is the last stage an older meshnode?)", wire.ErrBadFrame, c.step)
		}
		p.complete(c, &Result{Seqs: s.Seqs, Pos: s.Pos, Tokens: s.Tokens, Logprobs: s.Logprobs, Logits: c.logits}, nil)
	default:
		return fmt.Errorf("%w: unexpected %s reply", wire.ErrBadFrame, wire.BodyKind(f))
	}
	return nil
}

// watchForward reads what hop 0 sends up the forward stream: only fatal
// errors, relayed from wherever in the route they happened.
func (p *Pipeline) watchForward() {
	defer p.wg.Done()
	f, err := p.fwd.Recv()
	if err != nil {
		p.mu.Lock()
		closing := p.closing
		p.mu.Unlock()
		if !closing || !errors.Is(err, io.EOF) {
			p.fail(p.hopError(0, fmt.Errorf("%w: forward stream ended: %w", wire.ErrUnavailable, err)))
		}
		return
	}
	re, err := wire.DecodeError(f)
	if err != nil || re.Hop >= len(p.route) {
		if err == nil {
			err = fmt.Errorf("%w: error names hop %d of %d", wire.ErrBadFrame, re.Hop, len(p.route))
		}
		p.badPeer(p.route[0].Peer, err)
		p.fail(p.hopError(0, err))
		return
	}
	hop := re.Hop
	if hop < 0 {
		hop = 0
	}
	p.fail(p.hopError(hop, re))
}

// watchdog breaks the pipeline when the oldest call goes without a reply
// for the step timeout. Before it gives up it asks every hop for its Info,
// to name one that does not answer. Nobody wakes it when the oldest call
// changes (that cost each decode step a goroutine's wake-up): a call's
// deadline is never earlier than the timer's, since a call becomes the
// oldest no earlier than the one before it, so the timer fires first and
// is set again for the oldest call then.
func (p *Pipeline) watchdog() {
	defer p.wg.Done()
	timeout := p.cfg.StepTimeout
	timer := time.NewTimer(timeout)
	defer timer.Stop()
	for {
		select {
		case <-p.done:
			return
		case <-timer.C:
		}
		p.mu.Lock()
		var c *Call
		var since time.Time
		if len(p.pending) > 0 {
			c, since = p.pending[0], p.pending[0].since
		}
		p.mu.Unlock()
		if c == nil {
			timer.Reset(timeout)
			continue
		}
		if wait := time.Until(since.Add(timeout)); wait > 0 {
			timer.Reset(wait)
			continue
		}
		hop := p.probe()
		if p.head() != c {
			timer.Reset(0) // answered while probing: look at the new oldest call now
			continue
		}
		p.fail(p.hopError(hop, fmt.Errorf("%w: step %d waited %s", ErrStalled, c.step, time.Since(since).Round(time.Millisecond))))
		return
	}
}

// probe asks every hop for its Info at once and returns the first that
// does not answer in time, or -1.
func (p *Pipeline) probe() int {
	ctx, cancel := context.WithTimeout(p.ctx, min(p.cfg.StepTimeout/4, 2*time.Second))
	defer cancel()
	failed := make([]bool, len(p.route))
	var wg sync.WaitGroup
	for i, h := range p.route {
		wg.Go(func() {
			conn, err := p.cfg.Dial(ctx, h.Peer)
			if err == nil {
				_, err = meshnodev1.NewStageServiceClient(conn).Info(ctx, &meshnodev1.InfoRequest{})
			}
			failed[i] = err != nil
		})
	}
	wg.Wait()
	return slices.Index(failed, true)
}

// Route is the pipeline's hops, in order.
func (p *Pipeline) Route() []Hop { return append([]Hop(nil), p.cfg.Route...) }
