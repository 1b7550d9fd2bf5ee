package pipeline

import (
	"errors"
	"fmt"
)

var (
	// ErrClosed is returned for work submitted to, or still in flight on,
	// a pipeline that was closed.
	ErrClosed = errors.New("pipeline: closed")
	// ErrStalled is wrapped by the error of a pipeline whose oldest
	// request got no reply within the step timeout.
	ErrStalled = errors.New("pipeline: no reply within the step timeout")
)

// HopError is an error that one hop of the route is to blame for: it
// failed a step, sent a bad frame, could not be reached or stopped
// answering. errors.As finds the wire.RemoteError inside when the hop
// reported the error itself.
type HopError struct {
	Hop        int // index in the route; -1 when no hop could be named
	Peer       string
	Start, End int // the hop's layers
	Err        error
}

func (e *HopError) Error() string {
	if e.Hop < 0 {
		return fmt.Sprintf("pipeline: %v", e.Err)
	}
	return fmt.Sprintf("pipeline: hop %d (peer %s, layers [%d,%d)): %v", e.Hop, e.Peer, e.Start, e.End, e.Err)
}

func (e *HopError) Unwrap() error { return e.Err }
