package weights

import (
	"bytes"
	"context"
	"encoding/binary"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"
)

// pipePeer serves files over net.Pipe: each dial is a new stream with its
// own ServeRanges, as a libp2p host would run one per incoming stream.
type pipePeer struct {
	files   *FileIndex
	wg      sync.WaitGroup
	dials   atomic.Int32
	mu      sync.Mutex
	errs    []error
	streams []net.Conn
}

func newPipePeer(t *testing.T, files *FileIndex) *pipePeer {
	p := &pipePeer{files: files}
	t.Cleanup(func() {
		p.mu.Lock()
		for _, c := range p.streams {
			c.Close()
		}
		p.mu.Unlock()
		p.wg.Wait() // every server goroutine ends
	})
	return p
}

func (p *pipePeer) dial(ctx context.Context) (Stream, error) {
	p.dials.Add(1)
	client, server := net.Pipe()
	p.mu.Lock()
	p.streams = append(p.streams, client)
	p.mu.Unlock()
	p.wg.Go(func() {
		if err := ServeRanges(server, p.files); err != nil {
			p.mu.Lock()
			p.errs = append(p.errs, err)
			p.mu.Unlock()
		}
	})
	return client, nil
}

func indexOf(t *testing.T, data []byte) (*FileIndex, string) {
	t.Helper()
	var x FileIndex
	id := sha256Hex(data)
	if err := x.Add(id, bytes.NewReader(data), int64(len(data))); err != nil {
		t.Fatal(err)
	}
	return &x, id
}

// TestPeerFetch fetches stages of the tied synthetic model from a peer over
// net.Pipe: identical to the local slices, verified per tensor, and only
// the stage's bytes cross the stream.
func TestPeerFetch(t *testing.T) {
	data := synth(t, true)
	files, id := indexOf(t, data)
	peer := newPipePeer(t, files)
	ctx := testCtx(t)
	dir := t.TempDir()
	for _, r := range [][2]int{{0, 2}, {2, 5}, {5, 8}} {
		src, err := OpenPeer(ctx, id, "12D3KooWTest", peer.dial)
		if err != nil {
			t.Fatal(err)
		}
		path, err := FetchSlice(ctx, src, dir, r[0], r[1], nil)
		if err != nil {
			t.Fatal(err)
		}
		sameFile(t, path, localSlice(t, data, r[0], r[1], id))
		need := partsSize(t, data, r[0], r[1])
		if got := src.Stats().BytesFetched; got < need || got > need+headerBound(t, data) {
			t.Errorf("[%d,%d): fetched %d bytes, tensors are %d", r[0], r[1], got, need)
		}
		src.Close()
	}
	// The hashes were computed once by the serving side, then kept.
	if h, err := files.TensorHashes(id); err != nil || len(h) != len(parseGGUF(t, data).Tensors) {
		t.Fatalf("hashes: %d %v", len(h), err)
	}
}

// TestPeerOverTCP runs the protocol over loopback TCP, several reads in
// parallel on pooled connections.
func TestPeerOverTCP(t *testing.T) {
	data := readStories(t)
	files, id := indexOf(t, data)
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	var wg sync.WaitGroup
	t.Cleanup(func() { ln.Close(); wg.Wait() })
	wg.Go(func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			wg.Go(func() { ServeRanges(c, files) })
		}
	})
	dial := func(ctx context.Context) (Stream, error) {
		var d net.Dialer
		return d.DialContext(ctx, "tcp", ln.Addr().String())
	}
	ctx := testCtx(t)
	src, err := OpenPeer(ctx, id, "tcp-peer", dial)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	if src.Size() != int64(len(data)) || src.ID() != id {
		t.Fatalf("size %d id %s", src.Size(), src.ID())
	}
	res, err := FetchSliceWith(ctx, src, t.TempDir(), 1, 4, FetchOptions{Concurrency: 4, ChunkSize: 8 << 10})
	if err != nil {
		t.Fatal(err)
	}
	sameFile(t, res.Path, localSlice(t, data, 1, 4, id))
	buf := make([]byte, 100)
	if n, err := src.ReadAt(buf, int64(len(data))-40); n != 40 || err != io.EOF || !bytes.Equal(buf[:40], data[len(data)-40:]) {
		t.Fatalf("read at the end: %d %v", n, err)
	}
}

func request(op byte, id string, args ...uint64) []byte {
	body := []byte{op, byte(len(id))}
	body = append(body, id...)
	for _, a := range args {
		body = binary.LittleEndian.AppendUint64(body, a)
	}
	return append(binary.LittleEndian.AppendUint32(nil, uint32(len(body))), body...)
}

func answer(t *testing.T, c net.Conn) (byte, []byte) {
	t.Helper()
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	var hdr [9]byte
	if _, err := io.ReadFull(c, hdr[:]); err != nil {
		t.Fatalf("reading answer: %v", err)
	}
	b := make([]byte, binary.LittleEndian.Uint64(hdr[1:]))
	if _, err := io.ReadFull(c, b); err != nil {
		t.Fatalf("reading answer: %v", err)
	}
	return hdr[0], b
}

func send(t *testing.T, c net.Conn, b []byte) {
	t.Helper()
	c.SetWriteDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Write(b); err != nil {
		t.Fatalf("sending: %v", err)
	}
}

// TestServeRangesBadRequests sends malformed and hostile requests by hand:
// each gets an error answer and the stream keeps serving; only a broken
// frame ends the stream, and the server still takes new ones.
func TestServeRangesBadRequests(t *testing.T) {
	data := readStories(t)
	files, id := indexOf(t, data)
	peer := newPipePeer(t, files)
	s, _ := peer.dial(context.Background())
	c := s.(net.Conn)
	other := strings.Repeat("ab", 32)
	size := uint64(len(data))
	bad := []struct {
		name string
		req  []byte
		want string
	}{
		{"unknown file", request(PeerOpRead, other, 0, 10), "unknown file"},
		{"unknown op", request(9, id), "unknown op"},
		{"negative offset", request(PeerOpRead, id, 1<<63, 10), "outside"},
		{"past the end", request(PeerOpRead, id, size-5, 10), "outside"},
		{"offset past the end", request(PeerOpRead, id, size+1, 0), "outside"},
		{"wrapping range", request(PeerOpRead, id, 100, ^uint64(0)-50), "over the"},
		{"oversized", request(PeerOpRead, id, 0, MaxPeerRead+1), "over the"},
		{"read without arguments", request(PeerOpRead, id), "16 bytes"},
		{"stat with arguments", request(PeerOpStat, id, 1), "no arguments"},
		{"id longer than the frame", append(binary.LittleEndian.AppendUint32(nil, 3), PeerOpStat, 200, 'x'), "too short"},
	}
	for _, tc := range bad {
		send(t, c, tc.req)
		status, msg := answer(t, c)
		if status != peerStatusError || !strings.Contains(string(msg), tc.want) {
			t.Errorf("%s: status %d %q, want an error with %q", tc.name, status, msg, tc.want)
		}
	}
	// Still serving on the same stream.
	send(t, c, request(PeerOpRead, id, 100, 50))
	if status, b := answer(t, c); status != peerStatusOK || !bytes.Equal(b, data[100:150]) {
		t.Fatalf("good read after bad ones: status %d", status)
	}
	send(t, c, request(PeerOpRead, id, size-5, 5))
	if status, b := answer(t, c); status != peerStatusOK || !bytes.Equal(b, data[size-5:]) {
		t.Fatalf("read of the last bytes: status %d", status)
	}

	// A frame length out of bounds: answered, then the stream ends.
	send(t, c, binary.LittleEndian.AppendUint32(nil, MaxPeerRequest+1))
	if status, msg := answer(t, c); status != peerStatusError || !strings.Contains(string(msg), "frame") {
		t.Fatalf("huge frame: %d %q", status, msg)
	}
	c.SetReadDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Read(make([]byte, 1)); err != io.EOF {
		t.Fatalf("stream after a bad frame: %v", err)
	}

	// A request cut short: the stream ends, the server does not hang.
	s2, _ := peer.dial(context.Background())
	send(t, s2.(net.Conn), request(PeerOpRead, id, 0, 10)[:7])
	s2.Close()

	// And a new stream is served as ever.
	src, err := OpenPeer(testCtx(t), id, "p", peer.dial)
	if err != nil {
		t.Fatal(err)
	}
	buf := make([]byte, 64)
	if _, err := src.ReadAt(buf, 0); err != nil || !bytes.Equal(buf, data[:64]) {
		t.Fatalf("read on a new stream: %v", err)
	}
	src.Close()
	c.Close()
	peer.wg.Wait()
	peer.mu.Lock()
	defer peer.mu.Unlock()
	var sawFrame, sawTruncated bool
	for _, err := range peer.errs {
		sawFrame = sawFrame || strings.Contains(err.Error(), "request frame")
		sawTruncated = sawTruncated || strings.Contains(err.Error(), "truncated request")
	}
	if !sawFrame || !sawTruncated {
		t.Errorf("server errors %v", peer.errs)
	}
}

func TestPeerSourceErrors(t *testing.T) {
	data := readStories(t)
	files, id := indexOf(t, data)
	peer := newPipePeer(t, files)
	ctx := testCtx(t)

	_, err := OpenPeer(ctx, strings.Repeat("cd", 32), "p1", peer.dial)
	var pe *PeerError
	if !errors.As(err, &pe) || !strings.Contains(err.Error(), "unknown file") || !strings.Contains(err.Error(), "p1") {
		t.Fatalf("unknown file: %v", err)
	}
	if _, err := OpenPeer(ctx, "nothex", "p1", peer.dial); err == nil {
		t.Fatal("bad id accepted")
	}
	if err := files.Add("ABC", bytes.NewReader(nil), 0); err == nil {
		t.Fatal("index took a bad id")
	}
	src, err := OpenPeer(ctx, id, "p1", peer.dial)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	if _, err := src.ReadAt(make([]byte, 4), -4); err == nil {
		t.Fatal("negative offset read")
	}
	if n, err := src.ReadAt(make([]byte, 4), int64(len(data))); n != 0 || err != io.EOF {
		t.Fatalf("read at the end: %d %v", n, err)
	}
	// A read split over several requests.
	peerReadChunk = 100000
	t.Cleanup(func() { peerReadChunk = MaxPeerRead })
	before := src.Stats().Requests
	big := make([]byte, len(data)-10)
	if n, err := src.ReadAt(big, 10); n != len(big) || err != nil || !bytes.Equal(big, data[10:]) {
		t.Fatalf("big read: %d %v", n, err)
	}
	if r := src.Stats().Requests - before; r != uint64(len(big)+99999)/100000 {
		t.Errorf("big read took %d requests", r)
	}

	// Removing the file: the peer answers with an error, not a hang.
	files.Remove(id)
	if _, err := src.ReadAt(make([]byte, 4), 0); !errors.As(err, &pe) || !strings.Contains(err.Error(), "unknown file") {
		t.Fatalf("removed file: %v", err)
	}
}

// TestPeerStalledCancel: a peer that accepts a request and never answers
// is left when the context ends, promptly.
func TestPeerStalledCancel(t *testing.T) {
	data := readStories(t)
	files, id := indexOf(t, data)
	peer := newPipePeer(t, files)
	ctx := testCtx(t)
	stall := false
	var streams []net.Conn
	var mu sync.Mutex
	dial := func(ctx context.Context) (Stream, error) {
		mu.Lock()
		defer mu.Unlock()
		if !stall {
			return peer.dial(ctx)
		}
		client, server := net.Pipe()
		streams = append(streams, client, server)
		go io.Copy(io.Discard, server) // reads requests, answers nothing
		return client, nil
	}
	src, err := OpenPeer(ctx, id, "slow", dial)
	if err != nil {
		t.Fatal(err)
	}
	src.dropIdle() // the next read dials, and gets the stalled stream
	mu.Lock()
	stall = true
	mu.Unlock()
	cctx, cancel := context.WithTimeout(ctx, 200*time.Millisecond)
	defer cancel()
	start := time.Now()
	_, err = src.ReadAtContext(cctx, make([]byte, 10), 0)
	if !errors.Is(err, context.DeadlineExceeded) {
		t.Fatalf("stalled read: %v", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("cancel took %v", d)
	}

	// Without a deadline, the stall timeout gives up on the peer.
	peerStallTimeout = 50 * time.Millisecond
	t.Cleanup(func() { peerStallTimeout = 30 * time.Second })
	start = time.Now()
	if _, err = src.ReadAtContext(ctx, make([]byte, 10), 0); err == nil || !strings.Contains(err.Error(), "slow") {
		t.Fatalf("stalled read: %v", err)
	}
	if d := time.Since(start); d > 5*time.Second {
		t.Fatalf("stall timeout took %v", d)
	}
	mu.Lock()
	for _, c := range streams {
		c.Close()
	}
	mu.Unlock()
}

// corruptAfter serves a file whose bytes go bad once armed, as a peer's
// disk might after it indexed the file (or as a malicious peer would).
type corruptAfter struct {
	data  []byte
	at    int64
	armed atomic.Bool
}

func (c *corruptAfter) ReadAt(p []byte, off int64) (int, error) {
	n, err := bytes.NewReader(c.data).ReadAt(p, off)
	if c.armed.Load() && off <= c.at && c.at < off+int64(n) {
		p[c.at-off] ^= 0x01
	}
	return n, err
}

// TestPeerCorruptTensor: a peer serving a byte that does not match its
// advertised tensor hash is caught, and the error names the tensor and
// the peer; no slice is left in place, and another peer completes it.
func TestPeerCorruptTensor(t *testing.T) {
	data := synth(t, false)
	id := sha256Hex(data)
	f := parseGGUF(t, data)
	victim, _ := f.Tensor("blk.3.ffn_up.weight")
	off, _ := f.Range(victim)
	bad := &corruptAfter{data: data, at: int64(off) + 12345}
	var evil FileIndex
	if err := evil.Add(id, bad, int64(len(data))); err != nil {
		t.Fatal(err)
	}
	if _, err := evil.TensorHashes(id); err != nil { // hashed while the bytes were good
		t.Fatal(err)
	}
	bad.armed.Store(true)

	ctx := testCtx(t)
	dir := t.TempDir()
	src, err := OpenPeer(ctx, id, "12D3KooWEvil", newPipePeer(t, &evil).dial)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	_, err = FetchSlice(ctx, src, dir, 2, 5, nil)
	if !errors.Is(err, ErrTensorHash) || !strings.Contains(err.Error(), "blk.3.ffn_up.weight") || !strings.Contains(err.Error(), "12D3KooWEvil") {
		t.Fatalf("corrupt tensor: %v", err)
	}
	path := filepath.Join(dir, SliceName(id, 2, 5))
	if _, err := os.Stat(path); err == nil {
		t.Fatal("a corrupt slice was put in place")
	}

	// An honest peer finishes the job, fetching only what is missing.
	files, _ := indexOf(t, data)
	good, err := OpenPeer(ctx, id, "12D3KooWGood", newPipePeer(t, files).dial)
	if err != nil {
		t.Fatal(err)
	}
	defer good.Close()
	res, err := FetchSliceWith(ctx, good, dir, 2, 5, FetchOptions{})
	if err != nil {
		t.Fatal(err)
	}
	sameFile(t, res.Path, localSlice(t, data, 2, 5, id))
	if res.Resumed == 0 {
		t.Error("the tensors the first peer delivered intact were fetched again")
	}

	// Hashes given by the caller are checked the same way, and take
	// precedence over what the source advertises.
	trusted, _ := files.TensorHashes(id)
	lying := &corruptAfter{data: data, at: int64(off) + 1}
	lying.armed.Store(true)
	var liar FileIndex
	liar.Add(id, lying, int64(len(data))) // its own hashes match its bad bytes
	src3, err := OpenPeer(ctx, id, "12D3KooWLiar", newPipePeer(t, &liar).dial)
	if err != nil {
		t.Fatal(err)
	}
	defer src3.Close()
	if _, err := FetchSliceWith(ctx, src3, t.TempDir(), 3, 4, FetchOptions{}); err != nil {
		t.Fatalf("a consistent liar passes its own hashes: %v", err)
	}
	_, err = FetchSliceWith(ctx, src3, t.TempDir(), 3, 4, FetchOptions{TensorHashes: trusted})
	if !errors.Is(err, ErrTensorHash) || !strings.Contains(err.Error(), "blk.3.ffn_up.weight") {
		t.Fatalf("trusted hashes: %v", err)
	}
}

// TestResumeAcrossSources: a fetch begun on the Hub resumes from a peer,
// since an LFS file's ETag and a peer's file id are the same SHA-256.
func TestResumeAcrossSources(t *testing.T) {
	data := synth(t, false)
	h := newFakeHub(t, data, false)
	dir := t.TempDir()
	first := interrupted(t, h, dir, 1, 4, FetchOptions{Concurrency: 2, ChunkSize: 256 << 10})
	files, id := indexOf(t, data)
	if first.ID() != id {
		t.Fatalf("hub ID %s, peer file id %s", first.ID(), id)
	}
	ctx := testCtx(t)
	src, err := OpenPeer(ctx, id, "p", newPipePeer(t, files).dial)
	if err != nil {
		t.Fatal(err)
	}
	defer src.Close()
	res, err := FetchSliceWith(ctx, src, dir, 1, 4, FetchOptions{})
	if err != nil {
		t.Fatal(err)
	}
	sameFile(t, res.Path, localSlice(t, data, 1, 4, id))
	if need := partsSize(t, data, 1, 4); res.Resumed < need/3 {
		t.Errorf("resumed %d of %d bytes", res.Resumed, need)
	}
}
