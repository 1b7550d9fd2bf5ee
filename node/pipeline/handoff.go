package pipeline

import (
	"context"
	"errors"
	"fmt"
	"io"
	"time"

	"go.uber.org/zap"

	"github.com/meshnode/meshnode/node/wire"
	meshnodev1 "github.com/meshnode/meshnode/proto/meshnode/v1"
	"github.com/meshnode/meshnode/stage"
)

// A hand-off on the device: two stages of one machine whose engines share
// a GPU pass a decode step's hidden states through GPU memory, and the
// second stage's pass is queued behind the first's before that one is
// done, so the GPU goes from one stage's pass to the next with neither
// host in between (through the hosts it waits for a copy off the GPU, two
// hosts' work and a copy back: about 0.06 ms of an 8B model's 1.7 ms step
// on an H200).
//
// The previous hop offers a port (a buffer and an event of its GPU) in its
// Setup; the next hop opens it and answers with a Setup saying whether it
// did. Then, for a batch that is alone in flight (Tokens.alone: so nothing
// else can be in the buffer), the previous hop queues its pass with its
// output into the port, sends the next hop an Activations frame with
// on_device and no payload at once, waits for its pass, and sends a Handed
// frame (or, if its pass failed, the step's Error). The next hop queues its
// pass behind the port's event on receipt, and waits for the Handed frame
// before it waits for its pass and answers: it never answers with what a
// failed pass left in the buffer.

// HandoffEngine is an engine that can hand a pass's hidden states to the
// next stage's engine on its GPU without either host in between
// (ggufstage's fused CUDA path). A server whose engine is one uses it
// between stages of one machine (ServerConfig.DeviceHandoff).
type HandoffEngine interface {
	// ExportHandoff makes a port for the hidden output of passes of up to
	// rows rows, and the bytes (at most wire.MaxHandoff) through which the
	// next stage's engine opens it. An error says why the engine cannot.
	ExportHandoff(rows int) (stage.HandoffPort, []byte, error)
	// ImportHandoff opens the previous stage's port from its offer; an
	// error says why it cannot (another GPU, say).
	ImportHandoff(offer []byte) (stage.HandoffPort, error)
	// LaunchHandoff queues b's pass and returns without waiting for it:
	// its hidden input from in (b.Hidden is then nil) once the port's
	// event is reached, if in is not nil; its hidden output into out, if
	// out is not nil. ok false: the engine cannot run b so (it would run
	// it through Forward) and did nothing. Until the pass is finished or
	// abandoned the engine takes no other call.
	LaunchHandoff(ctx context.Context, b *stage.Batch, in, out stage.HandoffPort) (p stage.LaunchedPass, ok bool, err error)
}

// handoffAnswerTimeout bounds the wait for the next hop's answer to an
// offer: it answers before it does anything else, unless it predates
// hand-offs.
var handoffAnswerTimeout = 10 * time.Second

// answerOffers is false only in a test standing in for a next hop from
// before hand-offs.
var answerOffers = true

// handoffEngine is the server's engine as a HandoffEngine, if it is one and
// hand-offs are on.
func (s *Server) handoffEngine() HandoffEngine {
	if !s.cfg.DeviceHandoff {
		return nil
	}
	h, _ := s.cfg.Engine.(HandoffEngine)
	return h
}

// offerHandoff makes this stage's port to the next hop, or nil (why not is
// logged: most engines cannot, and that is no fault).
func (l *link) offerHandoff() (stage.HandoffPort, []byte) {
	h := l.s.handoffEngine()
	if h == nil {
		return nil, nil
	}
	port, offer, err := h.ExportHandoff(l.s.lim.MaxRows)
	if err == nil && len(offer) > wire.MaxHandoff {
		port.Close()
		err = fmt.Errorf("an offer of %d bytes, over %d", len(offer), wire.MaxHandoff)
	}
	if err != nil {
		l.log.Debug("no hand-off on the device to the next hop", zap.Error(err))
		return nil, nil
	}
	return port, offer
}

// awaitAnswer waits for the next hop's answer to this stage's offer (the
// watcher passes it on), and keeps port if the next hop opened it. A next
// hop that does not answer in time (one from before hand-offs) gets the
// pipeline's frames through the hosts.
func (l *link) awaitAnswer(port stage.HandoffPort) error {
	timer := time.NewTimer(handoffAnswerTimeout)
	defer timer.Stop()
	select {
	case st := <-l.answer:
		if st.HandoffTaken {
			l.handTo = port
			return nil
		}
	case <-timer.C:
		l.log.Info("the next hop did not answer the offer of a hand-off on the device; its frames go through the hosts",
			zap.Int("hop", l.st.Hop+1), zap.Duration("waited", handoffAnswerTimeout))
	case <-l.ctx.Done():
		port.Close()
		return context.Cause(l.ctx)
	}
	port.Close()
	return nil
}

// answerHandoff opens the previous hop's offer, if this stage can, and
// tells it whether it did.
func (l *link) answerHandoff() error {
	taken := false
	if h := l.s.handoffEngine(); h != nil {
		port, err := h.ImportHandoff(l.st.Handoff)
		if err != nil {
			l.log.Info("no hand-off on the device from the previous hop", zap.Error(err))
		} else {
			l.handFrom, taken = port, true
		}
	}
	st := l.st
	st.Handoff, st.HandoffTaken = nil, taken
	f, err := wire.EncodeSetup(st)
	if err != nil {
		return &failure{hop: l.st.Hop, from: fromHere, err: err}
	}
	l.upMu.Lock()
	defer l.upMu.Unlock()
	if err := l.up.Send(f); err != nil {
		return &failure{hop: l.st.Hop - 1, from: fromUp, err: fmt.Errorf("%w: answering hop %d's offer of a hand-off: %w", wire.ErrUnavailable, l.st.Hop-1, err)}
	}
	return nil
}

// closeHandoff closes the link's ports once nothing more can use them.
func (l *link) closeHandoff() {
	for _, p := range []*stage.HandoffPort{&l.handTo, &l.handFrom} {
		if *p != nil {
			if err := (*p).Close(); err != nil {
				l.log.Warn("closing a hand-off port", zap.Error(err))
			}
			*p = nil
		}
	}
	if l.handed+l.fellBack > 0 {
		l.log.Info("steps handed over on the device", zap.Int("handed", l.handed), zap.Int("through the host", l.fellBack))
	}
}

// runOnDevice runs batch b (local: with the engine's sequence ids) with
// its hidden input from the previous hop's port (in) and/or its hidden
// output into this stage's (out), one of them set.
func (l *link) runOnDevice(step uint64, b, local *stage.Batch, in, out stage.HandoffPort) error {
	h := l.s.handoffEngine()
	p, ok, err := h.LaunchHandoff(l.ctx, local, in, out)
	if err != nil || !ok {
		if in != nil {
			// The previous hop's word on the buffer comes next, whatever
			// this stage does with the step.
			re, ferr := l.awaitHanded(step)
			switch {
			case ferr != nil:
				return ferr
			case re != nil:
				return l.emit(wire.EncodeHopError(step, re.Hop, re))
			case err != nil:
				return l.stepFailed(step, err)
			}
			// The engine cannot run it from the port: the hidden states
			// come to the host, and the step runs as any other.
			if local.Hidden, err = in.Read(local.Rows()); err != nil {
				return l.stepFailed(step, err)
			}
			l.fellBack++
		}
		if err != nil {
			return l.stepFailed(step, err)
		}
		return l.forward(step, b, local, false)
	}
	if out != nil {
		// The next hop queues its pass now, behind this one.
		next := &stage.Batch{Seqs: b.Seqs, Pos: b.Pos, Tokens: b.Tokens, Outputs: b.Outputs}
		f, err := wire.EncodeOnDevice(step, next, l.s.info.Embd)
		if err == nil {
			err = l.emit(f)
		}
		if err != nil {
			if aerr := p.Abandon(); aerr != nil {
				l.log.Warn("abandoning a pass", zap.Error(aerr))
			}
			return err
		}
	}
	if in != nil {
		re, ferr := l.awaitHanded(step)
		if ferr != nil || re != nil {
			if aerr := p.Abandon(); aerr != nil {
				l.log.Warn("abandoning a pass whose input never came", zap.Error(aerr))
			}
			if ferr != nil {
				return ferr
			}
			return l.emit(wire.EncodeHopError(step, re.Hop, re))
		}
	}
	res, err := p.Finish()
	if err != nil {
		// Where the next hop waits for a Handed frame, the step's Error
		// takes its place.
		return l.stepFailed(step, err)
	}
	defer res.Release()
	l.handed++
	if out != nil {
		return l.emit(wire.EncodeHanded(step))
	}
	return l.sample(step, b, res)
}

// awaitHanded reads the previous hop's word on step's hidden states on
// the device: nil, nil once they are written; the step's error, if that
// hop's pass failed (re); or the link's failure (err).
func (l *link) awaitHanded(step uint64) (re *wire.RemoteError, err error) {
	r, ok := l.next()
	switch {
	case !ok:
		return nil, context.Cause(l.ctx)
	case errors.Is(r.err, io.EOF):
		return nil, &failure{step: step, hop: l.st.Hop - 1, from: fromUp, err: fmt.Errorf("%w: stream from hop %d ended before step %d's hidden states were handed over", wire.ErrUnavailable, l.st.Hop-1, step)}
	case r.err != nil:
		return nil, l.recvFailed(step, r.err)
	}
	f := r.f
	if f.GetStep() != step {
		return nil, l.bad(f.GetStep(), fmt.Errorf("%w: %s frame for step %d while step %d's hidden states are on the device", wire.ErrBadFrame, wire.BodyKind(f), f.GetStep(), step))
	}
	switch f.GetBody().(type) {
	case *meshnodev1.Frame_Handed:
		return nil, nil
	case *meshnodev1.Frame_Error:
		return l.upstreamError(step, f)
	}
	return nil, l.bad(step, fmt.Errorf("%w: %s frame in place of step %d's hand-off", wire.ErrBadFrame, wire.BodyKind(f), step))
}
