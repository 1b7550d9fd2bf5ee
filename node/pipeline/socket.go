package pipeline

import (
	"bufio"
	"context"
	"encoding/binary"
	"errors"
	"fmt"
	"io"
	"net"
	"slices"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/meshnode/meshnode/node/wire"
	meshnodev1 "github.com/meshnode/meshnode/proto/meshnode/v1"
)

// Forward streams over plain connections. Between two nodes of one machine
// (host.DialLocal's authenticated Unix sockets) gRPC's HTTP/2 framing, its
// flow control and the goroutines its transport hands each message
// through are pure cost: a 16 KiB round trip took 69 µs through gRPC on
// loopback TCP against 20 on the bare socket (BenchmarkGRPCRoundTrip).
// A socket stream is one connection per stream carrying length-prefixed
// messages, read and written by the stream's own callers:
//
//	kind (1 byte), length (4 bytes, little-endian), body
//
// The client opens with the method's name (socketOpen), then sends frames
// (socketFrame) and at most one socketCloseSend; the server sends frames
// and ends with socketEnd (a gRPC status code, 4 bytes, and its message),
// after which it closes the connection.
const (
	socketOpen byte = iota + 1
	socketFrame
	socketCloseSend
	socketEnd
)

const (
	socketHeader = 5
	// socketOpenTimeout bounds how long an accepted connection may take to
	// name its method.
	socketOpenTimeout = 10 * time.Second
	socketReadBuffer  = 64 << 10
)

var errSocketTooLarge = errors.New("message larger than the limit")

// readSocketMsg reads one message into *buf, which it grows as needed.
func readSocketMsg(r *bufio.Reader, buf *[]byte, limit int) (byte, []byte, error) {
	var hdr [socketHeader]byte
	if _, err := io.ReadFull(r, hdr[:]); err != nil {
		return 0, nil, err
	}
	n := binary.LittleEndian.Uint32(hdr[1:])
	if uint64(n) > uint64(limit) {
		return hdr[0], nil, fmt.Errorf("%w: %d bytes, at most %d", errSocketTooLarge, n, limit)
	}
	// The buffer grows as the body arrives, by at most what has come so
	// far: a length that lies costs the liar what it sent, not the limit.
	b := (*buf)[:0]
	for len(b) < int(n) {
		chunk := min(int(n)-len(b), max(len(b), socketReadBuffer))
		b = slices.Grow(b, chunk)
		if _, err := io.ReadFull(r, b[len(b):len(b)+chunk]); err != nil {
			if errors.Is(err, io.EOF) {
				err = io.ErrUnexpectedEOF
			}
			*buf = b
			return 0, nil, err
		}
		b = b[:len(b)+chunk]
	}
	*buf = b
	return hdr[0], b, nil
}

// socketWriter writes whole messages, one Write each, or one writev for
// a frame whose activations payload is written from where it lies.
type socketWriter struct {
	mu   sync.Mutex
	conn net.Conn
	buf  []byte
	ring *ringSide // set: messages go through the stream's ring
}

// outOfLineBytes is the smallest activations payload that a socket
// stream writes out of line (wire.AppendHead): two rows of an 8B model.
// One row (16 KiB) costs about as much to copy into the message (0.7 µs
// on a 2-core machine here) as to write out of line (0.4 µs for the head,
// and a second iovec).
const outOfLineBytes = 32 << 10

// ringOutOfLineBytes is outOfLineBytes for a stream on a ring, where a
// payload is copied once either way, straight into the ring.
const ringOutOfLineBytes = 1 << 10

// msgReader reads a stream's messages: from the socket (socketReader) or
// from the stream's ring (ringReader). A body is valid until the next read.
type msgReader interface {
	read(limit int) (kind byte, body []byte, err error)
}

type socketReader struct {
	r   *bufio.Reader
	buf []byte
}

func (s *socketReader) read(limit int) (byte, []byte, error) {
	return readSocketMsg(s.r, &s.buf, limit)
}

// write sends a message of kind whose body is m marshaled (m a
// proto.Message) or raw; it returns the bytes written.
func (w *socketWriter) write(kind byte, m proto.Message, raw []byte) (int, error) {
	w.mu.Lock()
	defer w.mu.Unlock()
	b := append(w.buf[:0], kind, 0, 0, 0, 0)
	var payload []byte
	outOfLine := outOfLineBytes
	if w.ring != nil {
		outOfLine = ringOutOfLineBytes
	}
	if f, ok := m.(*meshnodev1.Frame); ok && len(f.GetActivations().GetPayload()) >= outOfLine {
		var err error
		if b, payload, err = wire.AppendHead(b, f); err != nil {
			return 0, status.Errorf(codes.Internal, "encoding a frame: %v", err)
		}
	} else if m != nil {
		var err error
		if b, err = (proto.MarshalOptions{}).MarshalAppend(b, m); err != nil {
			return 0, status.Errorf(codes.Internal, "encoding a frame: %v", err)
		}
	} else {
		b = append(b, raw...)
	}
	binary.LittleEndian.PutUint32(b[1:], uint32(len(b)+len(payload)-socketHeader))
	w.buf = b
	if w.ring != nil {
		err := w.ring.write(kind, [][]byte{b[socketHeader:], payload}, w.conn, func() error {
			_, err := w.send(b, payload)
			return err
		})
		return len(b) + len(payload), err
	}
	return w.send(b, payload)
}

// send writes a message, its payload out of line if there is one.
func (w *socketWriter) send(b, payload []byte) (int, error) {
	if payload == nil {
		return w.conn.Write(b)
	}
	// One writev on the Unix and TCP connections of package net (and the
	// types that embed them); two writes on others.
	bufs := net.Buffers{b, payload}
	n, err := bufs.WriteTo(w.conn)
	return int(n), err
}

// endBody is socketEnd's body for a handler's result.
func endBody(err error) []byte {
	st := status.Convert(toStatusOrNil(err))
	b := binary.LittleEndian.AppendUint32(nil, uint32(st.Code()))
	return append(b, st.Message()...)
}

func toStatusOrNil(err error) error {
	if err == nil {
		return nil
	}
	return toStatus(err)
}

// SocketConfig configures OverSockets.
type SocketConfig struct {
	// Dial opens a connection to the stage's node for one stream.
	Dial func(ctx context.Context) (net.Conn, error)
	// Other serves unary calls, and streams when Dial fails (OnFallback is
	// then told why); nil: neither.
	Other grpc.ClientConnInterface
	// OnFallback, if set, is told why a stream went through Other.
	OnFallback func(error)
	// MaxRecvBytes bounds a received message; 0 is wire.MaxFrameBytes.
	MaxRecvBytes int
	// Count, if set, is told the bytes of every frame sent and received
	// ("sent", "received"), as gRPC's stats handlers are.
	Count func(dir string, n int)
	// NoRing keeps streams on their sockets alone, without the shared
	// memory rings a Unix socket otherwise brings (see ring.go).
	NoRing bool
}

// OverSockets returns a connection whose Forward streams each run over a
// connection of their own from cfg.Dial, as described above, and whose
// other calls go to cfg.Other.
func OverSockets(cfg SocketConfig) grpc.ClientConnInterface {
	if cfg.MaxRecvBytes <= 0 {
		cfg.MaxRecvBytes = wire.MaxFrameBytes
	}
	return socketConn{cfg}
}

type socketConn struct{ cfg SocketConfig }

func (c socketConn) Invoke(ctx context.Context, method string, args, reply any, opts ...grpc.CallOption) error {
	if c.cfg.Other == nil {
		return status.Errorf(codes.Unimplemented, "socket stage connection: no method %s", method)
	}
	return c.cfg.Other.Invoke(ctx, method, args, reply, opts...)
}

func (c socketConn) NewStream(ctx context.Context, desc *grpc.StreamDesc, method string, opts ...grpc.CallOption) (grpc.ClientStream, error) {
	if method != meshnodev1.StageService_Forward_FullMethodName {
		if c.cfg.Other == nil {
			return nil, status.Errorf(codes.Unimplemented, "socket stage connection: no stream %s", method)
		}
		return c.cfg.Other.NewStream(ctx, desc, method, opts...)
	}
	conn, err := c.cfg.Dial(ctx)
	if err != nil {
		if ctx.Err() != nil {
			return nil, toStatus(context.Cause(ctx))
		}
		if c.cfg.Other == nil {
			return nil, status.Errorf(codes.Unavailable, "opening a stage stream: %v", err)
		}
		if c.cfg.OnFallback != nil {
			c.cfg.OnFallback(err)
		}
		return c.cfg.Other.NewStream(ctx, desc, method, opts...)
	}
	s, err := c.open(ctx, conn, method)
	if errors.Is(err, errRingRefusedByOld) {
		// A server from before rings: the stream again, on the socket.
		if conn, err = c.cfg.Dial(ctx); err == nil {
			s, err = c.openPlain(ctx, conn, method)
		}
	}
	if err != nil {
		if ctx.Err() != nil {
			return nil, toStatus(context.Cause(ctx))
		}
		return nil, status.Errorf(codes.Unavailable, "opening a stage stream: %v", err)
	}
	return s, nil
}

// ringAnswerTimeout bounds the wait for a server's answer to a ring: a
// live one answers at once.
const ringAnswerTimeout = 3 * time.Second

// errRingRefusedByOld says that the server does not know rings.
var errRingRefusedByOld = errors.New("the server predates rings")

func (c socketConn) newClient(ctx context.Context, conn net.Conn) *socketClient {
	r := bufio.NewReaderSize(conn, socketReadBuffer)
	return &socketClient{
		ctx: ctx, conn: conn, r: r, in: &socketReader{r: r},
		w: socketWriter{conn: conn}, max: c.cfg.MaxRecvBytes, count: c.cfg.Count,
	}
}

// open opens the stream on conn, with a ring where the connection can
// pass one and the server takes it.
func (c socketConn) open(ctx context.Context, conn net.Conn, method string) (*socketClient, error) {
	if c.cfg.NoRing {
		return c.openPlain(ctx, conn, method)
	}
	mem, err := offerRing(conn, method)
	if err != nil {
		conn.Close()
		return nil, err
	}
	if mem == nil {
		return c.openPlain(ctx, conn, method)
	}
	s := c.newClient(ctx, conn)
	side := newRingSide(mem, true)
	s.ring = side
	// As with gRPC, the stream ends when its context does. The memory
	// goes once no read is under way: RecvMsg decodes from it.
	s.stop = context.AfterFunc(ctx, func() { side.shut(conn, &s.readMu) })
	fail := func(err error) (*socketClient, error) {
		s.stop()
		conn.Close()
		mem.close()
		return nil, err
	}
	_ = conn.SetReadDeadline(time.Now().Add(ringAnswerTimeout))
	kind, body, err := s.in.read(1 << 10)
	_ = conn.SetReadDeadline(time.Time{})
	switch {
	case err != nil:
		return fail(fmt.Errorf("waiting for the ring's answer: %w", err))
	case kind == socketEnd && len(body) >= 4 && codes.Code(binary.LittleEndian.Uint32(body)) == codes.Unimplemented:
		return fail(errRingRefusedByOld)
	case kind != socketRingAck:
		return fail(fmt.Errorf("unexpected message kind %d for the ring's answer", kind))
	case len(body) > 0:
		// Refused: the stream runs on the socket alone.
		mem.close()
		s.ring = nil
		return s, nil
	}
	s.in = &ringReader{side: side, sock: s.r, window: busyWindow(conn)}
	s.w.ring = side
	return s, nil
}

func (c socketConn) openPlain(ctx context.Context, conn net.Conn, method string) (*socketClient, error) {
	s := c.newClient(ctx, conn)
	s.stop = context.AfterFunc(ctx, func() { conn.Close() })
	if _, err := s.w.write(socketOpen, nil, []byte(method)); err != nil {
		s.stop()
		conn.Close()
		return nil, err
	}
	return s, nil
}

// socketOf is the socket stream under a Forward stream, or nil when it
// runs over gRPC.
func socketOf(s meshnodev1.StageService_ForwardClient) *socketClient {
	g, ok := s.(*grpc.GenericClientStream[meshnodev1.Frame, meshnodev1.Frame])
	if !ok {
		return nil
	}
	c, _ := g.ClientStream.(*socketClient)
	return c
}

// socketClient is the client's end of a socket stream. As with gRPC, one
// goroutine may send while another receives.
type socketClient struct {
	ctx    context.Context
	conn   net.Conn
	r      *bufio.Reader
	in     msgReader
	ring   *ringSide  // the stream's ring, or nil
	readMu sync.Mutex // held by RecvMsg: the ring's memory stays while it reads
	w      socketWriter
	max    int
	count  func(dir string, n int)
	stop   func() bool

	end error // the stream's end, once RecvMsg saw it
}

func (s *socketClient) Header() (metadata.MD, error) { return nil, nil }
func (s *socketClient) Trailer() metadata.MD         { return nil }
func (s *socketClient) Context() context.Context     { return s.ctx }

func (s *socketClient) SendMsg(m any) error {
	if s.ring != nil && s.ctx.Err() != nil {
		// As on the socket, whose connection is closed by now: a ring
		// would still take the frame.
		return toStatus(context.Cause(s.ctx))
	}
	n, err := s.w.write(socketFrame, m.(proto.Message), nil)
	if err != nil {
		if s.ctx.Err() != nil {
			return toStatus(context.Cause(s.ctx))
		}
		if status.Code(err) == codes.Internal {
			return err
		}
		return io.EOF // as with gRPC: RecvMsg says why
	}
	if s.count != nil {
		s.count("sent", n)
	}
	return nil
}

// sendsEndWith makes sends fail within grace once ctx ends, so that a
// sender blocked on a peer that stopped reading is freed, while one that
// is not still gets its last frames out.
func (s *socketClient) sendsEndWith(ctx context.Context, grace time.Duration) (stop func() bool) {
	return context.AfterFunc(ctx, func() { _ = s.conn.SetWriteDeadline(time.Now().Add(grace)) })
}

func (s *socketClient) CloseSend() error {
	_, _ = s.w.write(socketCloseSend, nil, nil) // a broken stream shows in RecvMsg
	return nil
}

func (s *socketClient) RecvMsg(m any) error {
	s.readMu.Lock()
	defer s.readMu.Unlock()
	if s.end != nil {
		return s.end
	}
	kind, body, err := s.in.read(s.max)
	switch {
	case errors.Is(err, errSocketTooLarge):
		return s.finish(status.Errorf(codes.ResourceExhausted, "stage stream: received %v", err))
	case err != nil:
		if s.ctx.Err() != nil {
			return s.finish(toStatus(context.Cause(s.ctx)))
		}
		return s.finish(status.Errorf(codes.Unavailable, "stage connection lost: %v", err))
	}
	switch kind {
	case socketFrame:
		if err := proto.Unmarshal(body, m.(proto.Message)); err != nil {
			return s.finish(status.Errorf(codes.Internal, "stage stream: decoding a frame: %v", err))
		}
		if s.count != nil {
			s.count("received", socketHeader+len(body))
		}
		return nil
	case socketEnd:
		if len(body) < 4 {
			return s.finish(status.Error(codes.Internal, "stage stream: short end message"))
		}
		code := codes.Code(binary.LittleEndian.Uint32(body))
		if code == codes.OK {
			return s.finish(io.EOF)
		}
		return s.finish(status.Error(code, string(body[4:])))
	default:
		return s.finish(status.Errorf(codes.Internal, "stage stream: unknown message kind %d", kind))
	}
}

// finish ends the stream with err, which every later RecvMsg returns.
func (s *socketClient) finish(err error) error {
	s.end = err
	s.stop()
	s.conn.Close()
	if s.ring != nil {
		// Bodies were copied out (proto.Unmarshal); a sender blocked on
		// a full ring fails on the closed connection.
		s.ring.stopRead.Store(true)
		s.ring.close()
	}
	return err
}

// SocketServerConfig configures a SocketServer.
type SocketServerConfig struct {
	// MaxRecvBytes bounds a received message; 0 is wire.MaxFrameBytes.
	MaxRecvBytes int
	// Count, if set, is told the bytes of every frame sent to and
	// received from a peer (the connection's remote address).
	Count func(peer, dir string, n int)
}

// SocketServer serves srv's Forward streams on the connections of its
// listeners, one stream a connection. Like grpc.Server it owns a
// goroutine per connection, and Stop ends them all.
type SocketServer struct {
	srv meshnodev1.StageServiceServer
	cfg SocketServerConfig

	ctx    context.Context
	cancel context.CancelFunc
	mu     sync.Mutex
	lns    map[net.Listener]struct{}
	wg     sync.WaitGroup
}

// NewSocketServer returns a server of srv's streams.
func NewSocketServer(srv meshnodev1.StageServiceServer, cfg SocketServerConfig) *SocketServer {
	if cfg.MaxRecvBytes <= 0 {
		cfg.MaxRecvBytes = wire.MaxFrameBytes
	}
	ctx, cancel := context.WithCancel(context.Background())
	return &SocketServer{srv: srv, cfg: cfg, ctx: ctx, cancel: cancel, lns: map[net.Listener]struct{}{}}
}

// Serve accepts connections on ln until it fails or Stop is called (then
// it returns nil), and closes ln.
func (s *SocketServer) Serve(ln net.Listener) error {
	s.mu.Lock()
	if s.ctx.Err() != nil {
		s.mu.Unlock()
		ln.Close()
		return nil
	}
	s.lns[ln] = struct{}{}
	s.wg.Add(1)
	s.mu.Unlock()
	defer s.wg.Done()
	defer func() {
		s.mu.Lock()
		delete(s.lns, ln)
		s.mu.Unlock()
		ln.Close()
	}()
	for {
		c, err := ln.Accept()
		if err != nil {
			if s.ctx.Err() != nil {
				return nil
			}
			return fmt.Errorf("accepting stage connections: %w", err)
		}
		s.mu.Lock()
		if s.ctx.Err() != nil {
			s.mu.Unlock()
			c.Close()
			return nil
		}
		s.wg.Add(1)
		s.mu.Unlock()
		go func() {
			defer s.wg.Done()
			s.serveConn(c)
		}()
	}
}

// Stop closes the listeners and every connection, ends the streams'
// contexts, and waits for their handlers to return.
func (s *SocketServer) Stop() {
	s.mu.Lock()
	s.cancel()
	for ln := range s.lns {
		ln.Close()
	}
	s.mu.Unlock()
	s.wg.Wait()
}

func (s *SocketServer) serveConn(c net.Conn) {
	defer c.Close()
	stop := context.AfterFunc(s.ctx, func() { c.Close() })
	defer stop()
	// The open message may bring a ring's descriptor beside it.
	open := newOpenReader(c)
	sr := &socketReader{r: bufio.NewReaderSize(open, socketReadBuffer)}
	ss := &socketServerStream{
		conn: c, r: sr.r, in: sr, w: socketWriter{conn: c},
		max: s.cfg.MaxRecvBytes, peer: c.RemoteAddr().String(), count: s.cfg.Count,
	}
	_ = c.SetReadDeadline(time.Now().Add(socketOpenTimeout))
	kind, body, err := sr.read(1 << 10)
	fd := open.done()
	if err != nil || kind != socketOpen {
		closeFD(fd)
		return // not a stream: nothing to answer
	}
	_ = c.SetReadDeadline(time.Time{})
	method, offered := strings.CutSuffix(string(body), ringOffer)
	if method != meshnodev1.StageService_Forward_FullMethodName {
		closeFD(fd)
		_, _ = ss.w.write(socketEnd, nil, endBody(status.Errorf(codes.Unimplemented, "socket stage server: no stream %s", method)))
		return
	}
	if offered {
		side, err := acceptRing(fd)
		var answer []byte
		if err != nil {
			answer = []byte(err.Error())
		}
		if _, err := ss.w.write(socketRingAck, nil, answer); err != nil {
			side.close()
			return
		}
		if side != nil {
			// The handler is done with its frames when it returns, but a
			// goroutine of its may still be reading (Server.receive):
			// the memory goes once the connection is closed, which ends
			// that read, and the read has let go of it.
			defer side.shut(c, &ss.readMu)
			ss.ring = side
			ss.in = &ringReader{side: side, sock: ss.r, window: busyWindow(c)}
			ss.w.ring = side
			stopRing := context.AfterFunc(s.ctx, func() { side.stopRead.Store(true) })
			defer stopRing()
		}
	} else {
		closeFD(fd)
	}
	ctx, cancel := context.WithCancelCause(peer.NewContext(s.ctx, &peer.Peer{Addr: c.RemoteAddr()}))
	defer cancel(nil)
	ss.ctx, ss.cancel = ctx, cancel
	err = s.srv.Forward(ss)
	if ss.broken.Load() {
		return
	}
	_, _ = ss.w.write(socketEnd, nil, endBody(err))
}

// socketServerStream is the stage's end of a socket stream. Recv reads
// the connection itself: a frame goes from the socket to the handler
// without a goroutine between them.
type socketServerStream struct {
	ctx    context.Context
	cancel context.CancelCauseFunc
	conn   net.Conn
	r      *bufio.Reader
	in     msgReader
	ring   *ringSide  // the stream's ring, or nil
	readMu sync.Mutex // held by RecvMsg: the ring's memory stays while it reads
	w      socketWriter
	max    int
	peer   string
	count  func(peer, dir string, n int)

	mbuf    []byte      // UnmarshalLent's scratch
	lend    bool        // frames' payloads are lent from the read buffer or the ring (lendPayloads)
	closed  bool        // the client closed its side
	rerr    error       // the read side's end, once seen
	broken  atomic.Bool // the connection cannot carry the end message
	stopped atomic.Bool // cancelRecv ended the reads; writes go on
}

// cancelRecv ends the stream's reads once ctx ends, leaving its writes
// (the handler's last frames, socketEnd) to go on: the connection's read
// side is shut, which also ends a busy-polling read at once.
func (s *socketServerStream) cancelRecv(ctx context.Context) func() bool {
	return context.AfterFunc(ctx, func() {
		s.stopped.Store(true)
		if s.ring != nil {
			s.ring.stopRead.Store(true)
		}
		if cr, ok := s.conn.(interface{ CloseRead() error }); ok && cr.CloseRead() == nil {
			return
		}
		_ = s.conn.SetReadDeadline(time.Unix(1, 0))
	})
}

func (s *socketServerStream) lendPayloads() { s.lend = true }

var _ meshnodev1.StageService_ForwardServer = (*socketServerStream)(nil)

func (s *socketServerStream) SetHeader(metadata.MD) error  { return nil }
func (s *socketServerStream) SendHeader(metadata.MD) error { return nil }
func (s *socketServerStream) SetTrailer(metadata.MD)       {}
func (s *socketServerStream) Context() context.Context     { return s.ctx }

func (s *socketServerStream) Recv() (*meshnodev1.Frame, error) {
	f := new(meshnodev1.Frame)
	if err := s.RecvMsg(f); err != nil {
		return nil, err
	}
	return f, nil
}

func (s *socketServerStream) RecvMsg(m any) error {
	s.readMu.Lock()
	defer s.readMu.Unlock()
	if s.closed {
		return io.EOF
	}
	if s.rerr != nil {
		return s.rerr
	}
	kind, body, err := s.in.read(s.max)
	switch {
	case errors.Is(err, errSocketTooLarge):
		// As gRPC does: the stream ends, and the client is told why.
		s.rerr = status.Errorf(codes.ResourceExhausted, "stage stream: received %v", err)
		_, _ = s.w.write(socketEnd, nil, endBody(s.rerr))
		s.broken.Store(true)
		s.cancel(s.rerr)
		return s.rerr
	case err != nil && s.stopped.Load():
		s.rerr = status.Error(codes.Canceled, "stage stream: receiving stopped")
		return s.rerr
	case err != nil:
		if s.ctx.Err() != nil {
			s.rerr = toStatus(context.Cause(s.ctx))
		} else {
			s.rerr = status.Errorf(codes.Canceled, "stage stream: the peer's connection ended: %v", err)
		}
		s.broken.Store(true)
		s.cancel(s.rerr)
		return s.rerr
	}
	switch kind {
	case socketFrame:
		var err error
		if f, ok := m.(*meshnodev1.Frame); ok && s.lend {
			err = wire.UnmarshalLent(body, f, &s.mbuf)
		} else {
			err = proto.Unmarshal(body, m.(proto.Message))
		}
		if err != nil {
			s.rerr = status.Errorf(codes.Internal, "stage stream: decoding a frame: %v", err)
			return s.rerr
		}
		if s.count != nil {
			s.count(s.peer, "received", socketHeader+len(body))
		}
		return nil
	case socketCloseSend:
		s.closed = true
		return io.EOF
	default:
		s.rerr = status.Errorf(codes.Internal, "stage stream: unexpected message kind %d", kind)
		return s.rerr
	}
}

func (s *socketServerStream) Send(f *meshnodev1.Frame) error { return s.SendMsg(f) }

func (s *socketServerStream) SendMsg(m any) error {
	if err := s.ctx.Err(); err != nil {
		return toStatus(context.Cause(s.ctx))
	}
	n, err := s.w.write(socketFrame, m.(proto.Message), nil)
	if err != nil {
		if status.Code(err) == codes.Internal {
			return err
		}
		err = status.Errorf(codes.Unavailable, "stage stream: sending to the peer: %v", err)
		s.broken.Store(true)
		s.cancel(err)
		return err
	}
	if s.count != nil {
		s.count(s.peer, "sent", n)
	}
	return nil
}
