package ggufstage

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"github.com/meshnode/meshnode/stage"
)

// Hand-offs on the device (node/pipeline's HandoffEngine): two stages of one
// GPU in two processes pass a decode pass's hidden states through a buffer
// of the GPU that the first exports and the second opens (CUDA IPC), and
// the second's pass is queued behind the first's before that one is done.
// Only the fused CUDA path can (cuda/fused.h mf_handoff_export).

// errNoHandoff says the engine cannot hand passes over on its device.
var errNoHandoff = errors.New("no hand-off on the device")

// handoffPath is a fused path that hands passes over on its device.
type handoffPath interface {
	exportPort(rows int) (stage.HandoffPort, []byte, error)
	importPort(offer []byte) (stage.HandoffPort, error)
	// launch queues one pass of b (rows in cache slots slots, hidden
	// input from the host unless in is set) as LaunchHandoff does.
	launch(b *stage.Batch, slots []int, hidden []float32, in, out stage.HandoffPort) (fusedLaunch, bool, error)
}

// fusedLaunch is a pass the fused path queued.
type fusedLaunch interface {
	finish() (*stage.Output, error)
	abandon() error
}

// handoff is the engine's fused path as a handoffPath, or why not.
func (e *Engine) handoff() (handoffPath, error) {
	if e.fused == nil {
		why := e.fusedWhy
		if why == "" {
			why = "the stage does not decode through the fused CUDA kernels"
		}
		return nil, fmt.Errorf("%w: %s", errNoHandoff, why)
	}
	h, ok := e.fused.(handoffPath)
	if !ok {
		return nil, fmt.Errorf("%w: not in this build", errNoHandoff)
	}
	return h, nil
}

// ExportHandoff makes a port on the stage's GPU for the hidden output of
// passes of up to rows rows, and the offer through which the next stage's
// engine, in another process on the same GPU, opens it.
func (e *Engine) ExportHandoff(rows int) (stage.HandoffPort, []byte, error) {
	backendMu.RLock()
	defer backendMu.RUnlock()
	e.mu.Lock()
	defer e.mu.Unlock()
	if err := e.usable(); err != nil {
		return nil, nil, err
	}
	if e.info.Last() {
		return nil, nil, fmt.Errorf("%w: the last stage has no hidden output", errNoHandoff)
	}
	h, err := e.handoff()
	if err != nil {
		return nil, nil, err
	}
	return h.exportPort(rows)
}

// ImportHandoff opens the previous stage's port from its offer.
func (e *Engine) ImportHandoff(offer []byte) (stage.HandoffPort, error) {
	backendMu.RLock()
	defer backendMu.RUnlock()
	e.mu.Lock()
	defer e.mu.Unlock()
	if err := e.usable(); err != nil {
		return nil, err
	}
	if e.info.First() {
		return nil, fmt.Errorf("%w: the first stage takes no hidden states", errNoHandoff)
	}
	h, err := e.handoff()
	if err != nil {
		return nil, err
	}
	return h.importPort(offer)
}

// LaunchHandoff queues b's pass through the fused kernels, its hidden input
// from port in (if set; b.Hidden is then nil) and its hidden output into
// port out (if set), and returns without waiting for it. ok is false,
// with nothing done, where the fused path cannot run b as one pass (a
// prefill chunk, more rows than a pass takes, logits asked of the last
// stage): the caller runs it through Forward. The engine takes no other
// call until the pass is finished or abandoned.
func (e *Engine) LaunchHandoff(ctx context.Context, b *stage.Batch, in, out stage.HandoffPort) (lp stage.LaunchedPass, ok bool, err error) {
	var hidden []float32
	if in != nil {
		err = stage.PrepareOnDevice(ctx, b, e.info, e.batch)
	} else {
		hidden, err = stage.Prepare(ctx, b, e.info, e.batch)
	}
	if err != nil {
		return nil, false, err
	}
	if out != nil && e.info.Last() {
		return nil, false, fmt.Errorf("%w: hidden output asked of the last stage", errNoHandoff)
	}

	backendMu.RLock()
	e.mu.Lock()
	held := true
	unlock := func() {
		if held {
			held = false
			e.mu.Unlock()
			backendMu.RUnlock()
		}
	}
	defer func() {
		if lp == nil {
			unlock()
		}
	}()
	if err := e.usable(); err != nil {
		return nil, false, err
	}
	defer e.breakOnPanic(&err, "launching a pass")
	h, herr := e.handoff()
	if herr != nil {
		return nil, false, nil
	}
	slots, err := e.slotsOf(b)
	if err != nil {
		return nil, false, err
	}
	if !fusedTakes(b, slots, e.info.Last()) || e.info.Last() && !b.PicksOnly {
		return nil, false, nil
	}
	if err := e.settleFused(); err != nil {
		return nil, false, err
	}
	fl, ok, err := h.launch(b, slots, hidden, in, out)
	if err != nil || !ok {
		return nil, ok, err
	}
	return &launchedPass{e: e, fl: fl, unlock: unlock}, true, nil
}

// launchedPass holds the engine until its pass is finished or abandoned.
type launchedPass struct {
	e      *Engine
	fl     fusedLaunch
	unlock func()
	once   sync.Once
}

func (p *launchedPass) Finish() (out *stage.Output, err error) {
	err = errors.New("stage: pass already finished")
	p.once.Do(func() {
		defer p.unlock()
		defer p.e.breakOnPanic(&err, "finishing a pass")
		out, err = p.fl.finish()
	})
	return out, err
}

func (p *launchedPass) Abandon() (err error) {
	err = errors.New("stage: pass already finished")
	p.once.Do(func() {
		defer p.unlock()
		defer p.e.breakOnPanic(&err, "abandoning a pass")
		err = p.fl.abandon()
	})
	return err
}
