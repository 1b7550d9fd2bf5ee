package pipeline

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"sync"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/meshnode/meshnode/node/sample"
	"github.com/meshnode/meshnode/node/wire"
	meshnodev1 "github.com/meshnode/meshnode/proto/meshnode/v1"
	"github.com/meshnode/meshnode/stage"
)

// side says where a link's failure came from, which decides whom to tell.
type side uint8

const (
	fromHere side = iota // this stage: tell both neighbours
	fromUp               // the previous hop or its stream: tell the next
	fromDown             // the next hop or its stream: tell the previous
)

// failure ends a link. err wraps the sentinel that gives the wire code
// (wire.ErrBadFrame, wire.ErrUnavailable, stage.ErrUnknownSeq, or a
// relayed wire.RemoteError).
type failure struct {
	step uint64
	hop  int // the hop to blame, -1 for none
	from side
	bad  bool // the blamed peer sent a malformed frame
	err  error
	// code, when set, is the gRPC status the stream ends with instead of
	// the one err maps to: a message over the size limit keeps gRPC's
	// ResourceExhausted.
	code codes.Code
}

func (f *failure) Error() string { return f.err.Error() }
func (f *failure) Unwrap() error { return f.err }

// seqState is one of the pipeline's sequences on this stage.
type seqState struct {
	local stage.SeqID // the engine's id for it

	// Last stage only.
	sampler  *sample.Sampler
	history  []int32        // token at each position fed so far
	logprobs int            // -1: none; else the alternatives of each token's log-probability
	jsonFrom int            // -1: unconstrained; else where the JSON output starts in history
	schema   *sample.Schema // the JSON output's schema, if any
}

// record notes the token fed at pos: it replaces what the history held
// there, or extends it.
func (q *seqState) record(pos, tok int32) {
	if int(pos) < len(q.history) {
		q.history[pos] = tok
		return
	}
	q.history = append(q.history, tok)
}

// link is one pipeline's forward stream on this stage, with what hangs off
// it: the stream to the next hop, or on the last stage the rendezvous with
// the return stream. Its state belongs to the handler goroutine.
type link struct {
	s      *Server
	st     wire.Setup
	from   string // the upstream peer, as the transport names it
	up     meshnodev1.StageService_ForwardServer
	upMu   sync.Mutex   // the handler and the downstream watcher both send up
	in     <-chan recvd // nil: the handler reads up itself (recvCanceler)
	ctx    context.Context
	cancel context.CancelCauseFunc
	log    *zap.Logger

	first, last bool
	seqs        map[stage.SeqID]*seqState // by the origin's ids
	join        joiner

	// Not last: the stream to the next hop. out feeds the sender goroutine;
	// closing says no more. closing marks a graceful end, so that the
	// watcher takes the next hop's end of stream for what it is.
	down       meshnodev1.StageService_ForwardClient
	downCancel context.CancelFunc     // ends down; drain calls it last
	out        chan *meshnodev1.Frame // nil: the handler sends itself (direct)
	sent       chan struct{}          // closed when the sender is done
	watched    chan struct{}          // closed when the watcher is done
	closing    chan struct{}
	closeOnce  sync.Once
	nextPeer   string
	frameLimit int
	wireDType  stage.DType // the activations' dtype to the next hop

	// Last: where replies go.
	key pipeKey
	rv  *rendezvous

	// Hand-offs on the device (handoff.go): this stage's port to the next
	// hop, and the previous hop's, opened here; and how many steps came
	// through them, or from one through the host.
	handTo, handFrom stage.HandoffPort
	handed, fellBack int
	// answer carries the next hop's answer to this stage's offer from
	// the watcher; nil without an offer.
	answer chan wire.Setup
}

func (s *Server) serveForward(ctx context.Context, cancel context.CancelCauseFunc, stream meshnodev1.StageService_ForwardServer,
	from string, st wire.Setup, in <-chan recvd) error {
	l := &link{
		s: s, st: st, from: from, up: stream, in: in, ctx: ctx, cancel: cancel,
		log:   s.log.With(zap.String("pipeline", st.PipelineID), zap.String("origin", st.Origin), zap.Int("hop", st.Hop)),
		first: st.Hop == 0, last: st.Last(),
		seqs: map[stage.SeqID]*seqState{},
		join: joiner{lim: s.lim},
	}
	var err error
	if st.Handoff != nil && answerOffers {
		err = l.answerHandoff()
	}
	if err == nil {
		err = l.start()
	}
	if err == nil {
		err = l.loop()
	}
	return l.finish(err)
}

// start connects the link: to the next hop, or on the last stage to the
// origin's return stream, and on the last stage acknowledges the Setup,
// which tells the origin that the whole route is up.
func (l *link) start() error {
	if l.last {
		l.key = pipeKey{l.st.Origin, l.st.PipelineID}
		rv, err := l.s.attach(l.key, wire.RoleForward, nil)
		if err != nil {
			return &failure{hop: l.st.Hop - 1, from: fromUp, bad: true, err: err}
		}
		l.rv = rv
		timer := time.NewTimer(l.s.cfg.SetupTimeout)
		defer timer.Stop()
		select {
		case <-rv.retReady:
		case <-timer.C:
			return &failure{hop: -1, from: fromHere, err: fmt.Errorf("%w: pipeline %q: the origin opened no return stream within %s", wire.ErrUnavailable, l.st.PipelineID, l.s.cfg.SetupTimeout)}
		case <-l.ctx.Done():
			return context.Cause(l.ctx)
		}
		ack, err := wire.EncodeSetup(l.st)
		if err != nil {
			return &failure{hop: l.st.Hop, from: fromHere, err: err}
		}
		return l.emit(ack)
	}

	next := l.st.Hop + 1
	l.nextPeer = l.st.Route[next].Peer
	l.frameLimit = l.st.FrameLimit(next)
	unreachable := func(err error) error {
		return &failure{hop: next, from: fromDown, err: fmt.Errorf("%w: reaching hop %d (%s): %w", wire.ErrUnavailable, next, l.nextPeer, err)}
	}
	conn, err := l.s.cfg.Dial(l.ctx, l.nextPeer)
	if err != nil {
		return unreachable(err)
	}
	// The stream to the next hop lives on the server's context, not on
	// the upstream stream's: when the upstream hop dies, this link must
	// still tell the next hop whom to blame (drain sends that frame, then
	// ends the stream). On the upstream's context the stream died with it,
	// and the next hop blamed this one instead.
	dctx, dcancel := context.WithCancel(l.s.ctx)
	l.downCancel = dcancel
	down, err := meshnodev1.NewStageServiceClient(conn).Forward(dctx)
	if err != nil {
		return unreachable(err)
	}
	st := l.st
	st.Hop = next
	st.Handoff, st.HandoffTaken = nil, false
	var port stage.HandoffPort
	if socketOf(down) != nil {
		// Only a local stream: the next hop is on this machine, and may
		// share this stage's GPU.
		port, st.Handoff = l.offerHandoff()
	}
	f, err := wire.EncodeSetup(st)
	if err != nil {
		if port != nil {
			port.Close()
		}
		return &failure{hop: l.st.Hop, from: fromHere, err: err}
	}
	if err := down.Send(f); err != nil {
		if port != nil {
			port.Close()
		}
		return unreachable(err)
	}
	l.down = down
	if port != nil {
		l.answer = make(chan wire.Setup, 1)
	}
	l.wireDType = l.st.WireDType
	l.watched = make(chan struct{})
	l.closing = make(chan struct{})
	l.sent = make(chan struct{})
	if sock := socketOf(down); sock != nil {
		// Between stages of one machine, f32: the bytes cost a local
		// socket next to nothing, and f16 would cost a conversion each
		// way (32K floats a hop at eight rows of an 8B model) and the
		// split its exactness. And the handler writes its frames
		// itself: a socket write is a copy into the kernel's buffer,
		// and handing each frame to a sender goroutine cost a decode
		// step its wake-up (10 µs a token on an H200 host, run 209's
		// trace).
		l.wireDType = stage.F32
		// A write blocked on a next hop that stopped reading must not
		// keep the handler from ending; the stream lives on the
		// server's context (see above), so the link's end bounds it.
		sock.sendsEndWith(l.ctx, directSendGrace)
		close(l.sent)
		l.s.wg.Add(1)
		go l.watch()
		if port != nil {
			return l.awaitAnswer(port)
		}
		return nil
	}
	l.out = make(chan *meshnodev1.Frame, 4)
	l.s.wg.Add(2)
	go l.send()
	go l.watch()
	return nil
}

// direct says the next hop is over a socket stream, to which the handler
// sends its frames itself, with no sender goroutine.
func (l *link) direct() bool { return l.out == nil }

// sendFailed is the failure of a send to the next hop.
func (l *link) sendFailed(err error) *failure {
	return &failure{hop: l.st.Hop + 1, from: fromDown, err: fmt.Errorf("%w: sending to hop %d (%s): %w", wire.ErrUnavailable, l.st.Hop+1, l.nextPeer, err)}
}

// directSendGrace is how long a direct send may still take once the link
// has ended: long enough for its last frame to a live next hop.
const directSendGrace = time.Second

// sendDown sends f to the next hop on the handler's goroutine.
func (l *link) sendDown(f *meshnodev1.Frame) error {
	err := l.down.Send(f)
	if err == nil {
		return nil
	}
	if l.ctx.Err() != nil {
		return context.Cause(l.ctx)
	}
	if errors.Is(err, io.EOF) {
		// The stream is already gone; the watcher says why.
		wait := time.NewTimer(l.s.cfg.SetupTimeout)
		defer wait.Stop()
		select {
		case <-l.watched:
		case <-wait.C:
		}
		if l.ctx.Err() != nil {
			return context.Cause(l.ctx)
		}
	}
	return l.sendFailed(err)
}

// send passes queued frames to the next hop. Sending apart from compute
// lets this stage start on its next step while the last one's output is
// still on the wire.
func (l *link) send() {
	defer l.s.wg.Done()
	defer close(l.sent)
	for f := range l.out {
		if err := l.down.Send(f); err != nil {
			// io.EOF means the stream is already gone; the watcher
			// reports why.
			if !errors.Is(err, io.EOF) {
				l.cancel(l.sendFailed(err))
			}
			return
		}
	}
}

// watch reads what the next hop sends up: one frame, only ever a fatal
// error, which ends this link and goes on upstream. Its end of stream ends the link too,
// unless this side closed first.
func (l *link) watch() {
	defer l.s.wg.Done()
	defer close(l.watched)
	next := l.st.Hop + 1
	f, err := l.down.Recv()
	if err == nil && l.answer != nil && wire.BodyKind(f) == "setup" {
		// The answer to this stage's offer of a hand-off, which may come
		// late or not at all (a next hop from before hand-offs).
		st, derr := wire.DecodeSetup(f)
		if derr == nil && (st.PipelineID != l.st.PipelineID || st.Origin != l.st.Origin || st.Hop != next) {
			derr = fmt.Errorf("%w: answer for pipeline %q hop %d, want %q hop %d", wire.ErrBadFrame, st.PipelineID, st.Hop, l.st.PipelineID, next)
		}
		if derr != nil {
			l.s.badPeer(l.nextPeer, derr)
			l.cancel(&failure{hop: next, from: fromDown, bad: true, err: fmt.Errorf("%w: hop %d (%s) answered a hand-off with a bad frame: %w", wire.ErrBadFrame, next, l.nextPeer, derr)})
			return
		}
		l.answer <- st
		f, err = l.down.Recv()
	}
	if err != nil {
		select {
		case <-l.closing:
			return
		default:
		}
		if l.ctx.Err() == nil {
			l.cancel(&failure{hop: next, from: fromDown, err: fmt.Errorf("%w: stream to hop %d (%s) ended: %w", wire.ErrUnavailable, next, l.nextPeer, err)})
		}
		return
	}
	re, err := wire.DecodeError(f)
	if err != nil || re.Hop >= len(l.st.Route) {
		if err == nil {
			err = fmt.Errorf("%w: error names hop %d of %d", wire.ErrBadFrame, re.Hop, len(l.st.Route))
		}
		l.s.badPeer(l.nextPeer, err)
		l.cancel(&failure{hop: next, from: fromDown, err: fmt.Errorf("%w: hop %d (%s) sent a bad frame: %w", wire.ErrUnavailable, next, l.nextPeer, err)})
		return
	}
	if re.Hop < 0 {
		re.Hop = next
	}
	l.cancel(&failure{step: re.Step, hop: re.Hop, from: fromDown, err: re})
}

// next waits for the next frame from upstream, or its end; false once
// the link's context has ended.
func (l *link) next() (recvd, bool) {
	if l.in == nil {
		f, err := l.s.recv(l.up, l.from)
		if err != nil && l.ctx.Err() != nil {
			return recvd{}, false
		}
		return recvd{f, err}, true
	}
	select {
	case r := <-l.in:
		return r, true
	case <-l.ctx.Done():
		return recvd{}, false
	}
}

// loop runs the pipeline's frames in order until the upstream side ends.
func (l *link) loop() error {
	for {
		r, ok := l.next()
		switch {
		case !ok:
			return context.Cause(l.ctx)
		case r.err == nil:
			if err := l.handle(r.f); err != nil {
				return err
			}
		case errors.Is(r.err, io.EOF):
			return nil
		default:
			return l.recvFailed(0, r.err)
		}
	}
}

// bad blames the upstream peer for a frame that failed validation.
func (l *link) bad(step uint64, err error) error {
	return &failure{step: step, hop: l.st.Hop - 1, from: fromUp, bad: true, err: err}
}

// handle applies one frame from upstream.
func (l *link) handle(f *meshnodev1.Frame) error {
	step := f.GetStep()
	if _, ok := f.GetBody().(*meshnodev1.Frame_Activations); !ok && l.join.pending() {
		return l.bad(step, fmt.Errorf("%w: %s frame inside split step %d", wire.ErrBadFrame, wire.BodyKind(f), l.join.step))
	}
	switch f.GetBody().(type) {
	case *meshnodev1.Frame_Control:
		c, err := wire.DecodeControl(f, l.s.lim)
		if err != nil {
			return l.bad(step, err)
		}
		return l.control(step, c)
	case *meshnodev1.Frame_Tokens:
		if !l.first {
			return l.bad(step, fmt.Errorf("%w: token ids into stage %s, which does not embed", wire.ErrBadFrame, l.s.info.Range()))
		}
		b, err := wire.DecodeTokens(f, l.s.lim)
		if err != nil {
			return l.bad(step, err)
		}
		return l.run(step, b, f.GetTokens().GetAlone(), false)
	case *meshnodev1.Frame_Activations:
		if l.first {
			return l.bad(step, fmt.Errorf("%w: hidden states into stage %s, which embeds", wire.ErrBadFrame, l.s.info.Range()))
		}
		b, err := wire.DecodeBatch(f, l.s.lim)
		if err != nil {
			return l.bad(step, err)
		}
		if len(b.Tokens) == 0 {
			return l.bad(step, fmt.Errorf("%w: step %d activations carry no token ids", wire.ErrBadFrame, step))
		}
		if a := f.GetActivations(); a.GetOnDevice() {
			switch {
			case l.handFrom == nil:
				return l.bad(step, fmt.Errorf("%w: step %d's hidden states on the device, where no hand-off was set up", wire.ErrBadFrame, step))
			case l.join.pending():
				return l.bad(step, fmt.Errorf("%w: hidden states on the device inside split step %d", wire.ErrBadFrame, l.join.step))
			case a.GetCols() != uint32(l.s.info.Embd):
				return l.bad(step, fmt.Errorf("%w: step %d's hidden states on the device are %d wide, want %d", wire.ErrBadFrame, step, a.GetCols(), l.s.info.Embd))
			}
			return l.run(step, b, true, true)
		}
		alone := f.GetActivations().GetAlone()
		whole, err := l.join.add(step, b, f.GetActivations().GetMore())
		if err != nil {
			return l.bad(step, err)
		}
		if whole == nil {
			return nil
		}
		return l.run(step, whole, alone, false)
	case *meshnodev1.Frame_Error:
		re, err := l.upstreamError(step, f)
		if err != nil {
			return err
		}
		// A step that failed further up keeps its place in the order.
		return l.emit(wire.EncodeHopError(step, re.Hop, re))
	default:
		return l.bad(step, fmt.Errorf("%w: unexpected %s frame on a forward stream", wire.ErrBadFrame, wire.BodyKind(f)))
	}
}

// upstreamError decodes an error frame from upstream for step: the step's
// error (re), or the link's failure (err) where the frame is malformed or
// its error fatal, the previous hop's last word.
func (l *link) upstreamError(step uint64, f *meshnodev1.Frame) (re *wire.RemoteError, err error) {
	re, err = wire.DecodeError(f)
	if err == nil && re.Hop >= len(l.st.Route) {
		err = fmt.Errorf("%w: error names hop %d of %d", wire.ErrBadFrame, re.Hop, len(l.st.Route))
	}
	if err != nil {
		return nil, l.bad(step, err)
	}
	if re.Hop < 0 {
		re.Hop = l.st.Hop - 1
	}
	if wire.Fatal(re.Code) {
		return nil, &failure{step: step, hop: re.Hop, from: fromUp, err: re}
	}
	return re, nil
}

// recvFailed is the link's failure for an upstream read that failed with
// err other than a clean end of stream, while step (0: none) waited.
func (l *link) recvFailed(step uint64, err error) error {
	switch {
	case status.Code(err) == codes.ResourceExhausted:
		// Reported by whoever received it already.
		return &failure{step: step, hop: l.st.Hop - 1, from: fromUp, code: codes.ResourceExhausted,
			err: fmt.Errorf("%w: %w", wire.ErrBadFrame, err)}
	case l.ctx.Err() != nil:
		return context.Cause(l.ctx)
	}
	return &failure{step: step, hop: l.st.Hop - 1, from: fromUp, err: fmt.Errorf("%w: stream from hop %d ended: %w", wire.ErrUnavailable, l.st.Hop-1, err)}
}

// stepFailed reports a step this stage could not do, in its place.
func (l *link) stepFailed(step uint64, err error) error {
	l.log.Debug("step failed", zap.Uint64("step", step), zap.Error(err))
	return l.emit(wire.EncodeHopError(step, l.st.Hop, err))
}

// control applies a sequence operation and passes it on; the last stage's
// echo is the origin's acknowledgement.
func (l *link) control(step uint64, c wire.Control) error {
	e := l.s.cfg.Engine
	switch c.Op {
	case wire.OpOpen:
		if _, ok := l.seqs[c.Seq]; ok {
			return l.stepFailed(step, fmt.Errorf("%w: %d", stage.ErrSeqExists, c.Seq))
		}
		q := &seqState{local: stage.SeqID(l.s.nextLocal.Add(1)), jsonFrom: -1}
		if l.last {
			p, err := samplingFromWire(c.Sampling)
			if err != nil {
				return l.bad(step, err)
			}
			q.sampler = sample.New(p)
			q.history = append([]int32(nil), c.History...)
			q.logprobs = -1
			if p.Logprobs {
				q.logprobs = p.TopLogprobs
			}
			q.jsonFrom = -1
			if p.JSON {
				schema, err := p.Schema()
				if err != nil {
					return l.stepFailed(step, err)
				}
				jc, err := l.jsonConstraint(q.history, p.JSONFrom, schema)
				if err != nil {
					return l.stepFailed(step, err)
				}
				q.sampler.Constrain(jc)
				q.jsonFrom, q.schema = p.JSONFrom, schema
			}
		}
		if err := e.Open(q.local); err != nil {
			return l.stepFailed(step, err)
		}
		l.seqs[c.Seq] = q
	case wire.OpTrim:
		q, ok := l.seqs[c.Seq]
		if !ok {
			return l.bad(step, fmt.Errorf("%w: trim of sequence %d", stage.ErrUnknownSeq, c.Seq))
		}
		if err := e.Trim(q.local, c.Pos); err != nil {
			return l.stepFailed(step, err)
		}
		if int(c.Pos) < len(q.history) {
			q.history = q.history[:c.Pos]
			if q.jsonFrom >= 0 {
				// The output's state goes back with it.
				jc, err := l.jsonConstraint(q.history, q.jsonFrom, q.schema)
				if err != nil {
					return l.stepFailed(step, err)
				}
				q.sampler.Constrain(jc)
			}
		}
	case wire.OpRelease:
		// Releasing what is not open is not an error: after an OPEN that
		// failed part-way, the origin releases everywhere.
		if q, ok := l.seqs[c.Seq]; ok {
			delete(l.seqs, c.Seq)
			if err := e.Release(q.local); err != nil {
				l.log.Warn("releasing sequence", zap.Uint64("seq", uint64(c.Seq)), zap.Error(err))
			}
		}
	}
	// Re-encoded rather than passed through, so that only what was
	// validated goes on.
	f, err := wire.EncodeControl(step, c)
	if err != nil {
		return &failure{step: step, hop: l.st.Hop, from: fromHere, err: err}
	}
	return l.emit(f)
}

// jsonConstraint starts a sequence's JSON constraint (to schema, if not
// nil) after what it generated (history[from:]).
func (l *link) jsonConstraint(history []int32, from int, schema *sample.Schema) (*sample.JSONConstraint, error) {
	if l.s.cfg.Vocab == nil {
		return nil, errors.New("this stage cannot keep output JSON: it has no vocabulary")
	}
	v, err := l.s.cfg.Vocab()
	if err != nil {
		return nil, fmt.Errorf("keeping output JSON: %w", err)
	}
	return sample.NewJSONConstraint(v, schema, history[min(from, len(history)):])
}

// run sends one batch through the engine and its output on: hidden states
// to the next hop, or sampled tokens to the origin. alone: no other batch
// of the pipeline is in flight (Tokens.alone); onDevice: its hidden states
// wait in the previous hop's port (b.Hidden is nil).
func (l *link) run(step uint64, b *stage.Batch, alone, onDevice bool) error {
	local := *b
	local.Seqs = make([]stage.SeqID, len(b.Seqs))
	for r, q := range b.Seqs {
		st, ok := l.seqs[q]
		if !ok {
			return l.bad(step, fmt.Errorf("%w: step %d row %d names sequence %d", stage.ErrUnknownSeq, step, r, q))
		}
		local.Seqs[r] = st.local
	}
	validate := local.Validate
	if onDevice {
		validate = local.ValidateOnDevice
	}
	if err := validate(l.s.info); err != nil {
		if onDevice {
			// The previous hop's word on the buffer still comes.
			if _, err := l.awaitHanded(step); err != nil {
				return err
			}
		}
		return l.bad(step, fmt.Errorf("%w: step %d: %w", wire.ErrBadFrame, step, err))
	}
	// Known sequences only, checked above. sample checks the engine's
	// picks against b's.
	b.PicksOnly = l.last && l.greedy(b)
	local.PicksOnly = b.PicksOnly
	var in, out stage.HandoffPort
	if onDevice {
		in = l.handFrom
	}
	if alone && !l.last {
		out = l.handTo
	}
	if in != nil || out != nil {
		return l.runOnDevice(step, b, &local, in, out)
	}
	return l.forward(step, b, &local, alone)
}

// forward runs b (local: with the engine's sequence ids) through the
// engine and sends its output on, as run does.
func (l *link) forward(step uint64, b, local *stage.Batch, alone bool) error {
	out, err := l.s.cfg.Engine.Forward(l.ctx, local)
	if err != nil {
		if l.ctx.Err() != nil {
			return context.Cause(l.ctx)
		}
		return l.stepFailed(step, err)
	}
	// The engine may lend its output (Output.Free) until this step is
	// done with it.
	defer out.Release()
	if !l.last {
		// A direct send is done with the hidden states when it returns;
		// frames queued for the sender goroutine, and gRPC, which may
		// read a message after Send, get a copy of their own, unless
		// converting to the wire's dtype makes one anyway.
		hidden := out.Hidden
		if out.Free != nil && !l.direct() && hidden != nil && hidden.DType == l.wireDType {
			hidden = &stage.Activation{DType: hidden.DType, Rows: hidden.Rows, Cols: hidden.Cols, Data: slices.Clone(hidden.Data)}
		}
		next := &stage.Batch{Seqs: b.Seqs, Pos: b.Pos, Tokens: b.Tokens, Hidden: hidden, Outputs: b.Outputs}
		frames, err := splitFrames(step, next, l.wireDType, l.frameLimit)
		if err != nil {
			return l.stepFailed(step, err)
		}
		for _, f := range frames {
			f.GetActivations().Alone = alone
			if err := l.emit(f); err != nil {
				return err
			}
		}
		return nil
	}
	return l.sample(step, b, out)
}

// greedy says whether every output row of b is sampled greedily with
// nothing else asked of its logits, so that the engine's greedy picks
// (stage.Batch.PicksOnly) can stand for them.
func (l *link) greedy(b *stage.Batch) bool {
	if l.st.ReturnLogits || len(b.Outputs) == 0 {
		return false
	}
	for _, row := range b.Outputs {
		q := l.seqs[b.Seqs[row]]
		if q.logprobs >= 0 || !q.sampler.Greedy() {
			return false
		}
	}
	return true
}

// sample picks each output row's next token with its sequence's sampler
// (or takes the engine's greedy picks) and sends the tokens (and, if
// asked, the logits) to the origin.
func (l *link) sample(step uint64, b *stage.Batch, out *stage.Output) error {
	for r, q := range b.Seqs {
		l.seqs[q].record(b.Pos[r], b.Tokens[r])
	}
	vocab := l.s.info.Vocab
	if out.Picks != nil {
		return l.picked(step, b, out.Picks)
	}
	if len(out.Logits) != len(b.Outputs)*vocab {
		return l.stepFailed(step, fmt.Errorf("engine returned %d logits for %d output rows of %d", len(out.Logits), len(b.Outputs), vocab))
	}
	res := &wire.Sampled{
		Seqs:   make([]stage.SeqID, len(b.Outputs)),
		Pos:    make([]int32, len(b.Outputs)),
		Tokens: make([]int32, len(b.Outputs)),
	}
	for i, row := range b.Outputs {
		res.Seqs[i] = b.Seqs[row]
		res.Pos[i] = b.Pos[row] + 1
		if l.seqs[res.Seqs[i]].logprobs >= 0 && res.Logprobs == nil {
			res.Logprobs = make([]sample.Logprob, len(b.Outputs))
		}
	}
	sample.Rows(res.Seqs, vocab, func(i int) {
		q := l.seqs[res.Seqs[i]]
		// The history up to and including the row, as the origin would
		// have it when sampling this token.
		h := q.history[:min(len(q.history), int(res.Pos[i]))]
		logits := out.LogitsRow(i, vocab)
		res.Tokens[i] = q.sampler.Sample(logits, h)
		if q.logprobs >= 0 {
			res.Logprobs[i] = sample.LogprobOf(logits, res.Tokens[i], q.logprobs)
		}
	})
	if l.st.ReturnLogits && len(b.Outputs) > 0 {
		f, err := wire.EncodeLogits(step, len(b.Outputs), vocab, out.Logits)
		if err != nil {
			return l.stepFailed(step, err)
		}
		if err := l.emit(f); err != nil {
			return err
		}
	}
	f, err := wire.EncodeSampled(step, res)
	if err != nil {
		return l.stepFailed(step, err)
	}
	return l.emit(f)
}

// picked sends the engine's greedy picks of b's output rows to the
// origin as their sampled tokens.
func (l *link) picked(step uint64, b *stage.Batch, picks []int32) error {
	if err := stage.CheckPicks(picks, b, l.s.info.Vocab); err != nil {
		return l.stepFailed(step, err)
	}
	res := &wire.Sampled{
		Seqs:   make([]stage.SeqID, len(b.Outputs)),
		Pos:    make([]int32, len(b.Outputs)),
		Tokens: make([]int32, len(b.Outputs)),
	}
	for i, row := range b.Outputs {
		res.Seqs[i], res.Pos[i], res.Tokens[i] = b.Seqs[row], b.Pos[row]+1, picks[i]
	}
	f, err := wire.EncodeSampled(step, res)
	if err != nil {
		return l.stepFailed(step, err)
	}
	return l.emit(f)
}

// emit sends a frame on its way: to the next hop, or to the origin.
func (l *link) emit(f *meshnodev1.Frame) error {
	if l.last {
		if err := l.rv.send(f); err != nil {
			if l.ctx.Err() != nil {
				return context.Cause(l.ctx)
			}
			return &failure{hop: -1, from: fromHere, err: fmt.Errorf("%w: %w", wire.ErrUnavailable, err)}
		}
		return nil
	}
	if l.direct() {
		return l.sendDown(f)
	}
	select {
	case l.out <- f:
		return nil
	case <-l.ctx.Done():
		return context.Cause(l.ctx)
	}
}

// sendUp sends an error to the previous hop; the stream may already be
// gone, which is fine.
func (l *link) sendUp(f *meshnodev1.Frame) {
	l.upMu.Lock()
	defer l.upMu.Unlock()
	_ = l.up.Send(f)
}

// finish ends the link: a graceful end passes the end of stream on; a
// failure tells the neighbours that need to know. Either way the
// pipeline's sequences are released here, first.
func (l *link) finish(err error) error {
	// Slots first: draining may wait on the next hop, and a closed
	// pipeline's slots must be free by the time its close has travelled
	// down the route (the handler computes nothing more either way).
	l.release()
	if err == nil {
		l.drain(nil)
		l.closeHandoff()
		return nil
	}
	var fl *failure
	if !errors.As(err, &fl) {
		// The stream's context ended: the upstream peer went away, or
		// this server is closing.
		fl = &failure{hop: l.st.Hop - 1, from: fromUp, err: fmt.Errorf("%w: %w", wire.ErrUnavailable, err)}
		if l.s.ctx.Err() != nil {
			fl = &failure{hop: l.st.Hop, from: fromHere, err: err}
		}
	}
	if fl.hop < -1 || fl.hop >= len(l.st.Route) {
		fl.hop = -1
	}
	if fl.bad {
		peer := l.from
		if fl.hop >= 0 && fl.from == fromDown {
			peer = l.st.Route[fl.hop].Peer
		}
		l.s.badPeer(peer, fl.err)
	} else {
		l.log.Info("pipeline link ends", zap.Int("blame", fl.hop), zap.Error(fl.err))
	}
	last := wire.EncodeHopError(fl.step, fl.hop, fl.err)
	if fl.from != fromUp || fl.bad {
		l.sendUp(last)
	}
	if fl.from == fromDown {
		l.drain(nil)
	} else {
		l.drain(last)
	}
	l.closeHandoff()
	code := fl.code
	if code == codes.OK {
		code = statusCode(fl.err)
	}
	return status.Error(code, fl.err.Error())
}

// drain ends the link's downstream side, after a final frame if given:
// the queued frames and then end of stream go to the next hop, or the
// replies' end to the return stream. It waits a bounded time for the next
// hop to finish in turn, so that a graceful close travels down the route
// in order; then the link's context is cancelled.
func (l *link) drain(final *meshnodev1.Frame) {
	defer l.cancel(nil)
	if l.downCancel != nil {
		defer l.downCancel()
	}
	wait := time.NewTimer(l.s.cfg.SetupTimeout)
	defer wait.Stop()
	if l.last {
		if l.rv == nil {
			return
		}
		if final != nil {
			_ = l.rv.send(final) // a return stream already gone has nobody to tell
		}
		close(l.rv.fwdDone)
		l.s.detach(l.key, l.rv)
		return
	}
	if l.down == nil {
		return
	}
	switch {
	case l.direct():
		if final != nil {
			_ = l.down.Send(final) // a stream already gone has nobody to tell
		}
	case final != nil:
		select {
		case l.out <- final:
		case <-l.sent:
		case <-wait.C:
		}
	}
	if !l.direct() {
		close(l.out)
	}
	select {
	case <-l.sent:
	case <-wait.C:
		return
	}
	l.closeOnce.Do(func() { close(l.closing) })
	_ = l.down.CloseSend()
	select {
	case <-l.watched:
	case <-wait.C:
	}
}

// release frees the engine slots of the pipeline's sequences.
func (l *link) release() {
	for q, st := range l.seqs {
		if err := l.s.cfg.Engine.Release(st.local); err != nil {
			l.log.Warn("releasing sequence", zap.Uint64("seq", uint64(q)), zap.Error(err))
		}
	}
	clear(l.seqs)
}
