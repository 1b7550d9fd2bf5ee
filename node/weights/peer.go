package weights

import (
	"context"
	"crypto/sha256"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"sync"
	"time"

	"github.com/meshnode/meshnode/ggufstage/gguf"
)

// The peer range protocol serves byte ranges of whole model files that a
// node holds, to nodes fetching their stage's slice. It runs over any
// ordered byte stream (a libp2p stream, a TCP connection) and carries any
// number of requests one after another, each answered before the next is
// read.
//
// Request:  u32 length L (1..MaxPeerRequest), then L bytes:
//
//	u8 op | u8 n | n bytes file id | op-specific fields
//
// where file id is the lowercase hex SHA-256 of the whole file and the ops
// are PeerOpStat (no fields), PeerOpRead (u64 offset, u64 length) and
// PeerOpHashes (no fields).
//
// Response: u8 status | u64 length N, then N bytes: for status 0 the
// answer (stat: u64 size; read: the raw bytes; hashes: u32 count, then per
// tensor u16 name length, name, 32-byte SHA-256 of its data), for status 1
// a UTF-8 error message of at most 4 KiB.
//
// All integers are little-endian. A request that is well framed but wrong
// (unknown file, range outside it, unknown op) gets an error answer and the
// stream stays usable; a frame whose length is out of bounds, or a stream
// that ends inside a frame, ends the stream since nothing after it can be
// trusted to be aligned.
const (
	PeerOpStat   = 1
	PeerOpRead   = 2
	PeerOpHashes = 3

	MaxPeerRequest = 1 << 10  // bytes of one request frame
	MaxPeerRead    = 64 << 20 // bytes one read may ask for; larger reads are split

	peerStatusOK    = 0
	peerStatusError = 1
	maxPeerError    = 4 << 10
	maxHashPayload  = 64 << 20
	peerIdleTimeout = 2 * time.Minute
	peerPiece       = 1 << 20 // bytes written or read between deadline pushes
)

// peerReadChunk is the most one read request asks for (a variable so
// tests can split small reads).
var peerReadChunk = MaxPeerRead

// peerStallTimeout bounds how long one read or write on a stream may make
// no progress before the stream is given up.
var peerStallTimeout = 30 * time.Second

// Stream is what the protocol runs over. net.Conn satisfies it, and so
// does a libp2p network.Stream.
type Stream interface {
	io.ReadWriteCloser
	SetReadDeadline(t time.Time) error
	SetWriteDeadline(t time.Time) error
}

// FileIndex is the set of whole files a node serves to peers, by file id.
// The zero value is empty and ready to use.
type FileIndex struct {
	mu    sync.RWMutex
	files map[string]*servedFile
}

type servedFile struct {
	r    io.ReaderAt
	size int64

	mu      sync.Mutex // held while hashing, so that peers asking together wait for one pass
	hashes  map[string][32]byte
	payload []byte // hashes encoded for the wire, kept since every joiner asks
}

// Add serves r (size bytes) under id, the lowercase hex SHA-256 of its
// content (ggufstage.ContentHash computes and caches it for a local file).
// The index does not rehash the file: a wrong id is the caller's bug.
func (x *FileIndex) Add(id string, r io.ReaderAt, size int64) error {
	if len(id) != 64 || !isHex(id) {
		return fmt.Errorf("file id %q is not a lowercase hex SHA-256", id)
	}
	if size < 0 {
		return fmt.Errorf("negative size %d", size)
	}
	x.mu.Lock()
	defer x.mu.Unlock()
	if x.files == nil {
		x.files = map[string]*servedFile{}
	}
	x.files[id] = &servedFile{r: r, size: size}
	return nil
}

// Remove stops serving id.
func (x *FileIndex) Remove(id string) {
	x.mu.Lock()
	defer x.mu.Unlock()
	delete(x.files, id)
}

func (x *FileIndex) lookup(id string) *servedFile {
	x.mu.RLock()
	defer x.mu.RUnlock()
	return x.files[id]
}

// TensorHashes returns the SHA-256 of each tensor's bytes in file id,
// computed on first use and kept. Calling it after Add hashes the file
// before the first peer asks. The map is shared: do not modify it.
func (x *FileIndex) TensorHashes(id string) (map[string][32]byte, error) {
	f := x.lookup(id)
	if f == nil {
		return nil, fmt.Errorf("unknown file %s", id)
	}
	if _, err := f.hashPayload(); err != nil {
		return nil, err
	}
	return f.hashes, nil
}

func (f *servedFile) hashPayload() ([]byte, error) {
	f.mu.Lock()
	defer f.mu.Unlock()
	if f.payload != nil {
		return f.payload, nil
	}
	g, err := gguf.Read(io.NewSectionReader(f.r, 0, f.size), f.size)
	if err != nil {
		return nil, fmt.Errorf("reading the file's header: %w", err)
	}
	hashes := make(map[string][32]byte, len(g.Tensors))
	payload := binary.LittleEndian.AppendUint32(nil, uint32(len(g.Tensors)))
	buf := make([]byte, 1<<20)
	for i := range g.Tensors {
		t := &g.Tensors[i]
		if len(t.Name) > 0xffff {
			return nil, fmt.Errorf("tensor name of %d bytes is too long", len(t.Name))
		}
		off, n := g.Range(t)
		h := sha256.New()
		if _, err := io.CopyBuffer(h, io.NewSectionReader(f.r, int64(off), int64(n)), buf); err != nil {
			return nil, fmt.Errorf("hashing tensor %q: %w", t.Name, err)
		}
		var sum [32]byte
		h.Sum(sum[:0])
		hashes[t.Name] = sum
		payload = binary.LittleEndian.AppendUint16(payload, uint16(len(t.Name)))
		payload = append(payload, t.Name...)
		payload = append(payload, sum[:]...)
	}
	if len(payload) > maxHashPayload {
		return nil, fmt.Errorf("tensor table of %d bytes is over the %d limit", len(payload), maxHashPayload)
	}
	f.hashes, f.payload = hashes, payload
	return payload, nil
}

func decodeHashes(b []byte) (map[string][32]byte, error) {
	if len(b) < 4 {
		return nil, errors.New("short hash table")
	}
	n := binary.LittleEndian.Uint32(b)
	b = b[4:]
	// Each entry takes at least 2+32 bytes: a count beyond that is a lie.
	if uint64(n) > uint64(len(b))/34 {
		return nil, fmt.Errorf("hash table claims %d tensors in %d bytes", n, len(b))
	}
	out := make(map[string][32]byte, n)
	for range n {
		if len(b) < 2 {
			return nil, errors.New("short hash table")
		}
		l := int(binary.LittleEndian.Uint16(b))
		b = b[2:]
		if len(b) < l+32 {
			return nil, errors.New("short hash table")
		}
		var sum [32]byte
		copy(sum[:], b[l:l+32])
		out[string(b[:l])] = sum
		b = b[l+32:]
	}
	if len(b) != 0 {
		return nil, fmt.Errorf("%d stray bytes after the hash table", len(b))
	}
	return out, nil
}

// ServeRanges answers requests on conn from files until the peer closes
// the stream, an idle timeout passes, or the stream breaks; it closes conn
// when it returns. A clean close by the peer returns nil.
func ServeRanges(conn Stream, files *FileIndex) error {
	defer conn.Close()
	w := &pushWriter{s: conn}
	var lenBuf [4]byte
	buf := make([]byte, MaxPeerRequest)
	for {
		_ = conn.SetReadDeadline(time.Now().Add(peerIdleTimeout))
		if _, err := io.ReadFull(conn, lenBuf[:]); err != nil {
			if errors.Is(err, io.EOF) {
				return nil
			}
			return fmt.Errorf("reading request: %w", err)
		}
		n := binary.LittleEndian.Uint32(lenBuf[:])
		if n == 0 || n > MaxPeerRequest {
			_ = w.error(fmt.Sprintf("request frame of %d bytes (want 1..%d)", n, MaxPeerRequest))
			return fmt.Errorf("request frame of %d bytes", n)
		}
		_ = conn.SetReadDeadline(time.Now().Add(peerStallTimeout))
		if _, err := io.ReadFull(conn, buf[:n]); err != nil {
			return fmt.Errorf("truncated request: %w", err)
		}
		if err := serveRequest(w, files, buf[:n]); err != nil {
			return err
		}
	}
}

// serveRequest answers one request. It returns only errors of the stream
// itself; a bad request is answered with an error message.
func serveRequest(w *pushWriter, files *FileIndex, req []byte) error {
	if len(req) < 2 || len(req) < 2+int(req[1]) {
		return w.error("request too short for its file id")
	}
	op, id, rest := req[0], string(req[2:2+int(req[1])]), req[2+int(req[1]):]
	f := files.lookup(id)
	switch {
	case op != PeerOpStat && op != PeerOpRead && op != PeerOpHashes:
		return w.error(fmt.Sprintf("unknown op %d", op))
	case f == nil:
		return w.error(fmt.Sprintf("unknown file %q", id))
	}
	switch op {
	case PeerOpStat:
		if len(rest) != 0 {
			return w.error("stat takes no arguments")
		}
		return w.ok(binary.LittleEndian.AppendUint64(nil, uint64(f.size)))
	case PeerOpHashes:
		if len(rest) != 0 {
			return w.error("hashes takes no arguments")
		}
		payload, err := f.hashPayload()
		if err != nil {
			return w.error(err.Error())
		}
		return w.ok(payload)
	}
	if len(rest) != 16 {
		return w.error(fmt.Sprintf("read wants 16 bytes of offset and length, got %d", len(rest)))
	}
	off, n := binary.LittleEndian.Uint64(rest), binary.LittleEndian.Uint64(rest[8:])
	switch {
	case n > MaxPeerRead:
		return w.error(fmt.Sprintf("read of %d bytes is over the %d limit", n, MaxPeerRead))
	case off > uint64(f.size) || n > uint64(f.size)-off:
		return w.error(fmt.Sprintf("range [%d,+%d) is outside the file's %d bytes", int64(off), n, f.size))
	}
	if err := w.header(peerStatusOK, n); err != nil {
		return err
	}
	// The status is already sent, so a failed disk read can only end the
	// stream: the client sees a short answer and tries elsewhere.
	buf := make([]byte, min(n, peerPiece))
	for n > 0 {
		chunk := buf[:min(n, uint64(len(buf)))]
		if k, err := f.r.ReadAt(chunk, int64(off)); k < len(chunk) {
			return fmt.Errorf("reading served file at %d: %w", off, err)
		}
		if err := w.write(chunk); err != nil {
			return err
		}
		off += uint64(len(chunk))
		n -= uint64(len(chunk))
	}
	return nil
}

// pushWriter writes responses, pushing the write deadline forward for each
// piece so a peer that stops reading is dropped but a slow one is not.
type pushWriter struct {
	s   Stream
	hdr [9]byte
}

func (w *pushWriter) write(b []byte) error {
	for len(b) > 0 {
		piece := b[:min(len(b), peerPiece)]
		_ = w.s.SetWriteDeadline(time.Now().Add(peerStallTimeout))
		if _, err := w.s.Write(piece); err != nil {
			return fmt.Errorf("writing response: %w", err)
		}
		b = b[len(piece):]
	}
	return nil
}

func (w *pushWriter) header(status byte, n uint64) error {
	w.hdr[0] = status
	binary.LittleEndian.PutUint64(w.hdr[1:], n)
	return w.write(w.hdr[:])
}

func (w *pushWriter) ok(payload []byte) error {
	if err := w.header(peerStatusOK, uint64(len(payload))); err != nil {
		return err
	}
	return w.write(payload)
}

func (w *pushWriter) error(msg string) error {
	if len(msg) > maxPeerError {
		msg = msg[:maxPeerError]
	}
	if err := w.header(peerStatusError, uint64(len(msg))); err != nil {
		return err
	}
	return w.write([]byte(msg))
}

// PeerError is an error a peer answered with.
type PeerError struct {
	Peer string
	Msg  string
}

func (e *PeerError) Error() string { return fmt.Sprintf("peer %s: %s", e.Peer, e.Msg) }

// errProtocol marks an answer that breaks the protocol: retrying the same
// peer would not help.
var errProtocol = errors.New("protocol violation")

// DialFunc opens a new stream to the peer.
type DialFunc func(ctx context.Context) (Stream, error)

// PeerSource reads a file from one peer through the range protocol. It
// keeps idle streams for reuse and opens more when reads run in parallel.
type PeerSource struct {
	id   string
	name string
	dial DialFunc
	size int64
	ctx  context.Context

	mu     sync.Mutex
	idle   []Stream
	closed bool
	hashes map[string][32]byte

	counters
}

// OpenPeer opens file id (the hex SHA-256 of the whole model) on a peer,
// named name in messages, and asks its size. ctx bounds the reads made
// through ReadAt (ReadAtContext takes its own context).
func OpenPeer(ctx context.Context, id, name string, dial DialFunc) (*PeerSource, error) {
	if len(id) != 64 || !isHex(id) {
		return nil, fmt.Errorf("file id %q is not a lowercase hex SHA-256", id)
	}
	if len(name) > 200 {
		name = name[:200]
	}
	p := &PeerSource{id: id, name: name, dial: dial, ctx: ctx}
	var size uint64
	err := p.do(ctx, PeerOpStat, nil, 8, func(r io.Reader, n uint64) error {
		var b [8]byte
		if n != 8 {
			return fmt.Errorf("%w: stat answer of %d bytes", errProtocol, n)
		}
		if _, err := io.ReadFull(r, b[:]); err != nil {
			return err
		}
		size = binary.LittleEndian.Uint64(b[:])
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("opening %s on peer %s: %w", id, name, err)
	}
	if size > 1<<50 {
		return nil, fmt.Errorf("peer %s claims a file of %d bytes", name, size)
	}
	p.size = int64(size)
	return p, nil
}

// Size is the file's size.
func (p *PeerSource) Size() int64 { return p.size }

// ID is the file id: the SHA-256 of the whole file.
func (p *PeerSource) ID() string { return p.id }

// Stats counts the bytes and requests sent so far.
func (p *PeerSource) Stats() Stats { return p.stats() }

func (p *PeerSource) String() string { return "peer " + p.name }

// Close closes the idle streams; reads in flight finish first.
func (p *PeerSource) Close() error {
	p.mu.Lock()
	p.closed = true
	p.mu.Unlock()
	p.dropIdle()
	return nil
}

// ReadAt reads with the context given to OpenPeer.
func (p *PeerSource) ReadAt(b []byte, off int64) (int, error) {
	return p.ReadAtContext(p.ctx, b, off)
}

// ReadAtContext reads len(b) bytes at off, in requests of at most
// MaxPeerRead bytes.
func (p *PeerSource) ReadAtContext(ctx context.Context, b []byte, off int64) (int, error) {
	want, eof := clampRange(off, len(b), p.size)
	done := 0
	for done < want {
		n := min(want-done, peerReadChunk)
		args := binary.LittleEndian.AppendUint64(nil, uint64(off)+uint64(done))
		args = binary.LittleEndian.AppendUint64(args, uint64(n))
		dst := b[done : done+n]
		err := p.do(ctx, PeerOpRead, args, uint64(n), func(r io.Reader, got uint64) error {
			if got != uint64(n) {
				return fmt.Errorf("%w: asked %d bytes, answer has %d", errProtocol, n, got)
			}
			k, err := io.ReadFull(r, dst)
			p.fetched.Add(uint64(k))
			return err
		})
		if err != nil {
			return done, fmt.Errorf("reading %d bytes at %d from peer %s: %w", n, off+int64(done), p.name, err)
		}
		done += n
	}
	return done, eof
}

// TensorHashes asks the peer for the SHA-256 of each tensor of the file
// (once; the answer is kept). The hashes come from the same peer as the
// bytes, so they catch a peer whose copy differs from what it indexed, not
// a peer that lies consistently: FetchOptions.TensorHashes takes hashes
// from a source the caller trusts more. The map is shared: do not modify
// it.
func (p *PeerSource) TensorHashes(ctx context.Context) (map[string][32]byte, error) {
	p.mu.Lock()
	h := p.hashes
	p.mu.Unlock()
	if h != nil {
		return h, nil
	}
	err := p.do(ctx, PeerOpHashes, nil, maxHashPayload, func(r io.Reader, n uint64) error {
		b := make([]byte, n)
		if _, err := io.ReadFull(r, b); err != nil {
			return err
		}
		var err error
		h, err = decodeHashes(b)
		if err != nil {
			return fmt.Errorf("%w: %w", errProtocol, err)
		}
		return nil
	})
	if err != nil {
		return nil, fmt.Errorf("tensor hashes of %s from peer %s: %w", p.id, p.name, err)
	}
	p.mu.Lock()
	p.hashes = h
	p.mu.Unlock()
	return h, nil
}

// do sends one request and hands an OK answer's payload to read, which
// must consume all n bytes. A stream that fails is closed and the request
// retried on a fresh one, since an idle stream may have been dropped by
// the peer's idle timeout; an error the peer answered is not retried.
func (p *PeerSource) do(ctx context.Context, op byte, args []byte, maxResp uint64, read func(r io.Reader, n uint64) error) error {
	req := make([]byte, 4, 4+2+len(p.id)+len(args))
	req = append(req, op, byte(len(p.id)))
	req = append(req, p.id...)
	req = append(req, args...)
	binary.LittleEndian.PutUint32(req, uint32(len(req)-4))
	var err error
	for range 3 {
		var s Stream
		if s, err = p.stream(ctx); err != nil {
			return err
		}
		p.requests.Add(1)
		err = exchange(ctx, s, p.name, req, maxResp, read)
		var pe *PeerError
		if err == nil || errors.As(err, &pe) {
			p.release(s)
			return err
		}
		s.Close()
		if ctx.Err() != nil {
			return ctx.Err()
		}
		// The likeliest cause is the peer's idle timeout, which has then
		// closed the other idle streams too.
		p.dropIdle()
		if errors.Is(err, errProtocol) {
			return err
		}
	}
	return err
}

func (p *PeerSource) stream(ctx context.Context) (Stream, error) {
	p.mu.Lock()
	if n := len(p.idle); n > 0 {
		s := p.idle[n-1]
		p.idle = p.idle[:n-1]
		p.mu.Unlock()
		return s, nil
	}
	closed := p.closed
	p.mu.Unlock()
	if closed {
		return nil, fmt.Errorf("peer %s: source closed", p.name)
	}
	s, err := p.dial(ctx)
	if err != nil {
		return nil, fmt.Errorf("dialing peer %s: %w", p.name, err)
	}
	return s, nil
}

func (p *PeerSource) dropIdle() {
	p.mu.Lock()
	idle := p.idle
	p.idle = nil
	p.mu.Unlock()
	for _, s := range idle {
		s.Close()
	}
}

func (p *PeerSource) release(s Stream) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed || len(p.idle) >= 8 {
		s.Close()
		return
	}
	p.idle = append(p.idle, s)
}

// exchange writes req and reads its answer under a guard that ends the
// exchange when ctx is done or the stream stalls.
func exchange(ctx context.Context, s Stream, peer string, req []byte, maxResp uint64, read func(r io.Reader, n uint64) error) (err error) {
	g := newGuard(ctx, s)
	defer func() {
		// A stream whose deadlines the cancellation moved to the past is
		// still aligned if the exchange completed: the next exchange pushes
		// them forward again.
		g.stop()
		if err != nil && ctx.Err() != nil {
			err = ctx.Err()
		}
	}()
	if _, err := g.Write(req); err != nil {
		return fmt.Errorf("sending request: %w", err)
	}
	var hdr [9]byte
	if _, err := io.ReadFull(g, hdr[:]); err != nil {
		return fmt.Errorf("reading answer: %w", err)
	}
	n := binary.LittleEndian.Uint64(hdr[1:])
	switch hdr[0] {
	case peerStatusOK:
		if n > maxResp {
			return fmt.Errorf("%w: answer of %d bytes, expected at most %d", errProtocol, n, maxResp)
		}
		return read(g, n)
	case peerStatusError:
		if n > maxPeerError {
			return fmt.Errorf("%w: error message of %d bytes", errProtocol, n)
		}
		msg := make([]byte, n)
		if _, err := io.ReadFull(g, msg); err != nil {
			return fmt.Errorf("reading error answer: %w", err)
		}
		return &PeerError{Peer: peer, Msg: string(msg)}
	}
	return fmt.Errorf("%w: status %d", errProtocol, hdr[0])
}

// guard ties a stream's deadlines to a context and a stall timeout: every
// read and write pushes the deadline forward unless the context is done,
// in which case the deadline is in the past and blocked calls return.
type guard struct {
	s         Stream
	mu        sync.Mutex
	cancelled bool
	stopf     func() bool
}

func newGuard(ctx context.Context, s Stream) *guard {
	g := &guard{s: s}
	g.stopf = context.AfterFunc(ctx, func() {
		g.mu.Lock()
		defer g.mu.Unlock()
		g.cancelled = true
		past := time.Unix(1, 0)
		_ = s.SetReadDeadline(past)
		_ = s.SetWriteDeadline(past)
	})
	return g
}

func (g *guard) push() {
	g.mu.Lock()
	defer g.mu.Unlock()
	if !g.cancelled {
		t := time.Now().Add(peerStallTimeout)
		_ = g.s.SetReadDeadline(t)
		_ = g.s.SetWriteDeadline(t)
	}
}

func (g *guard) Read(b []byte) (int, error) {
	g.push()
	return g.s.Read(b[:min(len(b), peerPiece)])
}

func (g *guard) Write(b []byte) (int, error) {
	g.push()
	return g.s.Write(b)
}

// stop detaches the guard from the context.
func (g *guard) stop() { g.stopf() }
