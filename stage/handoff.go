package stage

// HandoffPort is one end of a hand-off between two stages whose engines
// share a device: a buffer on it that one stage's pass writes its hidden
// output into and the next one's reads its input from, and the event that
// says it is written. See node/pipeline's HandoffEngine.
type HandoffPort interface {
	// Read copies the hidden states of rows rows from a port opened by
	// the next stage to host memory once they are written, for a batch
	// its engine cannot launch from the port.
	Read(rows int) (*Activation, error)
	Close() error
}

// LaunchedPass is a pass an engine queued without waiting for it.
type LaunchedPass interface {
	// Finish waits for the pass: its greedy picks on the last stage
	// (Batch.PicksOnly), else nothing (its output went to a port).
	Finish() (*Output, error)
	// Abandon drops a pass whose input will never be right (the previous
	// stage's pass failed, or that stage is gone): it waits a bounded time
	// for the pass and frees what it placed in the cache. An error (the
	// pass never ended, say) leaves the engine broken.
	Abandon() error
}
