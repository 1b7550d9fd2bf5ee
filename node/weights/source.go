package weights

import (
	"context"
	"errors"
	"fmt"
	"io"
	"sync/atomic"
)

// RangeSource is a remote model file read by byte ranges: a file on
// Hugging Face, or a peer that holds the whole file. A stage reads only its
// layers' ranges from it, never the whole file.
type RangeSource interface {
	// ReadAt follows io.ReaderAt.
	ReadAt(p []byte, off int64) (int, error)
	// Size is the file's size in bytes.
	Size() int64
	// ID names the file's content, not its location: the same bytes get
	// the same ID wherever they come from, different bytes never do. For a
	// model it is the SHA-256 of the whole file where the source knows it
	// (a peer, an LFS file on the Hub), so that slices of one model made
	// from any source share a name.
	ID() string
}

// ContextReaderAt is implemented by sources whose reads can be cancelled.
// FetchSlice uses it when present so that its context bounds every read.
type ContextReaderAt interface {
	ReadAtContext(ctx context.Context, p []byte, off int64) (int, error)
}

// TensorHasher is implemented by sources that can advertise the SHA-256 of
// each tensor's bytes, keyed by the tensor's name in the source file. A
// source that serves part of a file cannot prove its bytes against the
// file's hash; per-tensor hashes let each tensor be checked as it lands.
type TensorHasher interface {
	TensorHashes(ctx context.Context) (map[string][32]byte, error)
}

// Stats counts what a source moved over the network.
type Stats struct {
	BytesFetched uint64 // payload bytes received, retries included
	Requests     uint64 // requests sent
}

// counters is embedded by sources to keep Stats without locks.
type counters struct {
	fetched  atomic.Uint64
	requests atomic.Uint64
}

func (c *counters) stats() Stats {
	return Stats{BytesFetched: c.fetched.Load(), Requests: c.requests.Load()}
}

var (
	// ErrSourceChanged means the remote file is no longer the one that was
	// pinned when the source was opened: its ETag or size changed.
	ErrSourceChanged = errors.New("remote file changed during download")
	// ErrUnauthorized means the server refused the credentials (or their
	// absence).
	ErrUnauthorized = errors.New("access denied")
	// ErrNotFound means the repository, revision or file does not exist.
	ErrNotFound = errors.New("no such file")
	// ErrTensorHash means a fetched tensor's bytes do not match the hash
	// its source advertised.
	ErrTensorHash = errors.New("tensor hash mismatch")
)

// readAt reads from src with ctx when src supports it.
func readAt(ctx context.Context, src RangeSource, p []byte, off int64) (int, error) {
	if err := ctx.Err(); err != nil {
		return 0, err
	}
	if c, ok := src.(ContextReaderAt); ok {
		return c.ReadAtContext(ctx, p, off)
	}
	return src.ReadAt(p, off)
}

// readFull reads exactly len(p) bytes at off, treating a short read as an
// error: the callers know the file's size and never ask past it.
func readFull(ctx context.Context, src RangeSource, p []byte, off int64) error {
	n, err := readAt(ctx, src, p, off)
	if n == len(p) {
		return nil
	}
	if err == nil || errors.Is(err, io.EOF) {
		err = io.ErrUnexpectedEOF
	}
	return fmt.Errorf("reading %d bytes at %d: %w", len(p), off, err)
}

// describe names a source for messages: its String if it has one.
func describe(src RangeSource) string {
	if s, ok := src.(fmt.Stringer); ok {
		return s.String()
	}
	return src.ID()
}

// clampRange applies io.ReaderAt's rules for a read of n bytes at off in a
// file of size bytes: how many bytes can be read, and io.EOF if fewer than
// asked.
func clampRange(off int64, n int, size int64) (int, error) {
	if off < 0 {
		return 0, fmt.Errorf("negative offset %d", off)
	}
	if off >= size {
		if n == 0 {
			return 0, nil
		}
		return 0, io.EOF
	}
	if int64(n) > size-off {
		return int(size - off), io.EOF
	}
	return n, nil
}
