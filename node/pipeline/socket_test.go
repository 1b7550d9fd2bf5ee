package pipeline

import (
	"bufio"
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

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	"github.com/meshnode/meshnode/ggufstage"
	"github.com/meshnode/meshnode/node/wire"
	meshnodev1 "github.com/meshnode/meshnode/proto/meshnode/v1"
	"github.com/meshnode/meshnode/stage"
)

// serveSockets serves srv's streams on a new Unix socket and returns its
// path and the server.
func serveSockets(t *testing.T, srv meshnodev1.StageServiceServer, cfg SocketServerConfig) (string, *SocketServer) {
	t.Helper()
	dir, err := os.MkdirTemp("", "mn")
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	path := filepath.Join(dir, "s.sock")
	ln, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	s := NewSocketServer(srv, cfg)
	done := make(chan error, 1)
	go func() { done <- s.Serve(ln) }()
	t.Cleanup(func() {
		s.Stop()
		if err := <-done; err != nil {
			t.Errorf("Serve: %v", err)
		}
	})
	return path, s
}

func dialUnix(path string) func(context.Context) (net.Conn, error) {
	return func(ctx context.Context) (net.Conn, error) { return (&net.Dialer{}).DialContext(ctx, "unix", path) }
}

// tokensFrame is a frame of step with n token ids of 3 bytes each.
func tokensFrame(step uint64, n int) *meshnodev1.Frame {
	ids := make([]int32, n)
	for i := range ids {
		ids[i] = 100000
	}
	return &meshnodev1.Frame{Step: step, Body: &meshnodev1.Frame_Tokens{Tokens: &meshnodev1.Tokens{TokenIds: ids}}}
}

// rawMessage is one socket stream message as the wire has it.
func rawMessage(kind byte, body []byte) []byte {
	b := []byte{kind, 0, 0, 0, 0}
	binary.LittleEndian.PutUint32(b[1:], uint32(len(body)))
	return append(b, body...)
}

// TestSocketStream checks that a socket stream behaves as a gRPC one does
// for what the pipeline relies on, as TestInProcessStream does for
// in-process streams, and that bad input from either end ends only its
// stream, with a reason.
func TestSocketStream(t *testing.T) {
	for _, tc := range []struct {
		name   string
		noRing bool
	}{{"ring", false}, {"socket alone", true}} {
		t.Run(tc.name, func(t *testing.T) { testSocketStream(t, tc.noRing) })
	}
}

func testSocketStream(t *testing.T, noRing bool) {
	over := func(cfg SocketConfig) grpc.ClientConnInterface {
		cfg.NoRing = noRing
		return OverSockets(cfg)
	}
	var named atomic.Bool // the handler's context names its peer
	echo := fakeStage{forward: func(s meshnodev1.StageService_ForwardServer) error {
		if p, ok := peer.FromContext(s.Context()); ok && p.Addr != nil {
			named.Store(true)
		}
		for {
			f, err := s.Recv()
			if errors.Is(err, io.EOF) {
				return nil
			}
			if err != nil {
				return err
			}
			if err := s.Send(f); err != nil {
				return err
			}
		}
	}}
	var sent, received atomic.Int64
	path, _ := serveSockets(t, echo, SocketServerConfig{MaxRecvBytes: 1 << 10})
	conn := over(SocketConfig{Dial: dialUnix(path), Other: InProcess(echo), MaxRecvBytes: 1 << 10,
		Count: func(dir string, n int) {
			if dir == "sent" {
				sent.Add(int64(n))
			} else {
				received.Add(int64(n))
			}
		}})

	t.Run("echo", func(t *testing.T) {
		s, err := meshnodev1.NewStageServiceClient(conn).Forward(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		for i := range uint64(3) {
			if err := s.Send(tokensFrame(i, 10)); err != nil {
				t.Fatal(err)
			}
		}
		if err := s.CloseSend(); err != nil {
			t.Fatal(err)
		}
		for i := range uint64(3) {
			f, err := s.Recv()
			if err != nil || f.GetStep() != i || len(f.GetTokens().GetTokenIds()) != 10 {
				t.Fatalf("frame %d: %v, %v", i, f, err)
			}
		}
		if _, err := s.Recv(); !errors.Is(err, io.EOF) {
			t.Fatalf("after the handler returned: %v, want EOF", err)
		}
		if sent.Load() == 0 || sent.Load() != received.Load() {
			t.Fatalf("counted %d bytes sent, %d received", sent.Load(), received.Load())
		}
		if !named.Load() {
			t.Fatal("the handler's context does not name its peer")
		}
	})
	t.Run("handler error", func(t *testing.T) {
		bad := fakeStage{forward: func(meshnodev1.StageService_ForwardServer) error {
			return status.Error(codes.InvalidArgument, "bad frame")
		}}
		path, _ := serveSockets(t, bad, SocketServerConfig{})
		s, err := meshnodev1.NewStageServiceClient(over(SocketConfig{Dial: dialUnix(path)})).Forward(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		if _, err := s.Recv(); status.Code(err) != codes.InvalidArgument || !strings.Contains(err.Error(), "bad frame") {
			t.Fatalf("Recv: %v, want InvalidArgument", err)
		}
		if err := s.Send(&meshnodev1.Frame{}); !errors.Is(err, io.EOF) {
			t.Fatalf("Send after the handler returned: %v, want EOF", err)
		}
	})
	t.Run("cancel", func(t *testing.T) {
		ended := make(chan error, 1)
		blocked := fakeStage{forward: func(s meshnodev1.StageService_ForwardServer) error {
			_, err := s.Recv()
			ended <- err
			return err
		}}
		path, _ := serveSockets(t, blocked, SocketServerConfig{})
		ctx, cancel := context.WithCancel(t.Context())
		s, err := meshnodev1.NewStageServiceClient(over(SocketConfig{Dial: dialUnix(path)})).Forward(ctx)
		if err != nil {
			t.Fatal(err)
		}
		time.Sleep(50 * time.Millisecond) // the handler is in Recv
		cancel()
		select {
		case err := <-ended:
			if status.Code(err) != codes.Canceled {
				t.Fatalf("the handler's Recv: %v, want Canceled", err)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("the handler did not end when the client canceled")
		}
		if _, err := s.Recv(); status.Code(err) != codes.Canceled {
			t.Fatalf("client Recv: %v, want Canceled", err)
		}
	})
	t.Run("info goes to the other connection", func(t *testing.T) {
		info, err := meshnodev1.NewStageServiceClient(conn).Info(t.Context(), &meshnodev1.InfoRequest{})
		if err != nil || info.GetStart() != 2 || info.GetEnd() != 5 {
			t.Fatalf("Info: %v, %v", info, err)
		}
		if _, err := meshnodev1.NewStageServiceClient(over(SocketConfig{Dial: dialUnix(path)})).Info(t.Context(), &meshnodev1.InfoRequest{}); status.Code(err) != codes.Unimplemented {
			t.Fatalf("Info without another connection: %v", err)
		}
	})
	t.Run("fallback", func(t *testing.T) {
		var why error
		c := over(SocketConfig{Dial: dialUnix(path + ".gone"), Other: InProcess(echo), OnFallback: func(err error) { why = err }})
		s, err := meshnodev1.NewStageServiceClient(c).Forward(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Send(&meshnodev1.Frame{Step: 7}); err != nil {
			t.Fatal(err)
		}
		if f, err := s.Recv(); err != nil || f.GetStep() != 7 {
			t.Fatalf("Recv: %v, %v", f, err)
		}
		if why == nil {
			t.Fatal("OnFallback not told")
		}
		s.CloseSend()
		if _, err := meshnodev1.NewStageServiceClient(over(SocketConfig{Dial: dialUnix(path + ".gone")})).Forward(t.Context()); status.Code(err) != codes.Unavailable {
			t.Fatalf("no socket and no other connection: %v", err)
		}
	})
	t.Run("oversized, client to server", func(t *testing.T) {
		s, err := meshnodev1.NewStageServiceClient(conn).Forward(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Send(tokensFrame(0, 1000)); err != nil {
			t.Fatal(err)
		}
		if _, err := s.Recv(); status.Code(err) != codes.ResourceExhausted {
			t.Fatalf("Recv: %v, want ResourceExhausted", err)
		}
	})
	t.Run("oversized, server to client", func(t *testing.T) {
		big := fakeStage{forward: func(s meshnodev1.StageService_ForwardServer) error {
			return s.Send(tokensFrame(0, 1000))
		}}
		path, _ := serveSockets(t, big, SocketServerConfig{})
		s, err := meshnodev1.NewStageServiceClient(over(SocketConfig{Dial: dialUnix(path), MaxRecvBytes: 1 << 10})).Forward(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		if _, err := s.Recv(); status.Code(err) != codes.ResourceExhausted {
			t.Fatalf("Recv: %v, want ResourceExhausted", err)
		}
	})

	// A peer that writes what it likes: each stream ends with a reason,
	// the server goes on serving.
	handlerErr := make(chan error, 8)
	recorder := fakeStage{forward: func(s meshnodev1.StageService_ForwardServer) error {
		_, err := s.Recv()
		handlerErr <- err
		return err
	}}
	rpath, _ := serveSockets(t, recorder, SocketServerConfig{})
	open := rawMessage(socketOpen, []byte(meshnodev1.StageService_Forward_FullMethodName))
	for _, tt := range []struct {
		name     string
		send     []byte
		wantCode codes.Code // the handler's Recv; OK: the handler never runs
		wantEnd  codes.Code // the end message the peer gets
	}{
		{name: "not a frame", send: append(open, rawMessage(socketFrame, []byte{0xff, 0xff, 0xff})...), wantCode: codes.Internal, wantEnd: codes.Internal},
		{name: "unknown kind", send: append(open, rawMessage(9, nil)...), wantCode: codes.Internal, wantEnd: codes.Internal},
		{name: "cut mid-message", send: append(open, rawMessage(socketFrame, make([]byte, 100))[:50]...), wantCode: codes.Canceled},
		{name: "unknown method", send: rawMessage(socketOpen, []byte("/x.Y/Z")), wantEnd: codes.Unimplemented},
		{name: "no open", send: rawMessage(socketFrame, nil)},
	} {
		t.Run(tt.name, func(t *testing.T) {
			c, err := net.Dial("unix", rpath)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			if _, err := c.Write(tt.send); err != nil {
				t.Fatal(err)
			}
			c.(*net.UnixConn).CloseWrite()
			if tt.wantCode != codes.OK {
				select {
				case err := <-handlerErr:
					if status.Code(err) != tt.wantCode {
						t.Fatalf("handler's Recv: %v, want %v", err, tt.wantCode)
					}
				case <-time.After(5 * time.Second):
					t.Fatal("the handler did not end")
				}
			}
			_ = c.SetReadDeadline(time.Now().Add(5 * time.Second))
			reply, err := io.ReadAll(c)
			if err != nil {
				t.Fatalf("reading the server's reply: %v", err)
			}
			switch {
			case tt.wantEnd == codes.OK && len(reply) > 0:
				t.Fatalf("the server answered %q", reply)
			case tt.wantEnd != codes.OK && (len(reply) < socketHeader+4 || reply[0] != socketEnd || codes.Code(binary.LittleEndian.Uint32(reply[socketHeader:])) != tt.wantEnd):
				t.Fatalf("the server answered %q, want an end with %v", reply, tt.wantEnd)
			}
		})
	}
	select {
	case err := <-handlerErr:
		t.Fatalf("a handler ran for nothing: %v", err)
	default:
	}
	// ... and still serves.
	s, err := meshnodev1.NewStageServiceClient(conn).Forward(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Send(&meshnodev1.Frame{Step: 1}); err != nil {
		t.Fatal(err)
	}
	if f, err := s.Recv(); err != nil || f.GetStep() != 1 {
		t.Fatalf("after the bad peers: %v, %v", f, err)
	}
}

// TestSocketServerStop: Stop ends every stream's handler and Serve.
func TestSocketServerStop(t *testing.T) {
	got, ended := make(chan struct{}), make(chan error, 1)
	blocked := fakeStage{forward: func(s meshnodev1.StageService_ForwardServer) error {
		if _, err := s.Recv(); err != nil {
			return err
		}
		close(got)
		_, err := s.Recv()
		ended <- err
		return err
	}}
	path, srv := serveSockets(t, blocked, SocketServerConfig{})
	s, err := meshnodev1.NewStageServiceClient(OverSockets(SocketConfig{Dial: dialUnix(path)})).Forward(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if err := s.Send(&meshnodev1.Frame{}); err != nil {
		t.Fatal(err)
	}
	<-got // the handler's next Recv blocks until Stop
	stopped := make(chan struct{})
	go func() { srv.Stop(); close(stopped) }()
	select {
	case <-stopped:
	case <-time.After(5 * time.Second):
		t.Fatal("Stop did not return")
	}
	if err := <-ended; status.Code(err) != codes.Canceled {
		t.Fatalf("the handler's Recv at Stop: %v, want Canceled", err)
	}
	if _, err := s.Recv(); err == nil || errors.Is(err, io.EOF) {
		t.Fatalf("client Recv after Stop: %v", err)
	}
	if _, err := net.Dial("unix", path); err == nil {
		t.Fatal("the socket still accepts after Stop")
	}
}

// TestReadSocketMsg: whole messages come back; a body cut short is an
// error; a length that lies costs memory for what was sent, not for what
// it claims.
func TestReadSocketMsg(t *testing.T) {
	tests := []struct {
		name    string
		claim   uint32 // the header's length
		send    int    // body bytes that follow
		limit   int
		wantErr error
		maxCap  int // the buffer's capacity afterwards, at most
	}{
		{name: "empty", claim: 0, send: 0, limit: 1 << 20, maxCap: 0},
		{name: "16 KiB", claim: 16 << 10, send: 16 << 10, limit: 1 << 20, maxCap: 64 << 10},
		{name: "3 MiB", claim: 3 << 20, send: 3 << 20, limit: 8 << 20, maxCap: 6 << 20},
		{name: "over the limit", claim: 2 << 20, send: 0, limit: 1 << 20, wantErr: errSocketTooLarge, maxCap: 0},
		{name: "a lying length", claim: 200 << 20, send: 100, limit: 256 << 20, wantErr: io.ErrUnexpectedEOF, maxCap: 1 << 20},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			msg := []byte{socketFrame, 0, 0, 0, 0}
			binary.LittleEndian.PutUint32(msg[1:], tt.claim)
			body := make([]byte, tt.send)
			for i := range body {
				body[i] = byte(i)
			}
			var buf []byte
			kind, got, err := readSocketMsg(bufio.NewReader(bytes.NewReader(append(msg, body...))), &buf, tt.limit)
			if !errors.Is(err, tt.wantErr) {
				t.Fatalf("error %v, want %v", err, tt.wantErr)
			}
			if err == nil && (kind != socketFrame || !bytes.Equal(got, body)) {
				t.Fatalf("kind %d, %d bytes back of %d", kind, len(got), len(body))
			}
			if cap(buf) > tt.maxCap {
				t.Fatalf("the buffer grew to %d bytes", cap(buf))
			}
		})
	}
}

// FuzzSocketStream: whatever a peer writes to a socket server, the server
// answers only with well-formed messages (frames, then at most one end,
// last), ends the stream, and goes on serving; nothing panics.
func FuzzSocketStream(f *testing.F) {
	open := rawMessage(socketOpen, []byte(meshnodev1.StageService_Forward_FullMethodName))
	frame, err := proto.Marshal(tokensFrame(3, 4))
	if err != nil {
		f.Fatal(err)
	}
	huge := []byte{socketFrame, 0xff, 0xff, 0xff, 0x0f}
	for _, seed := range [][]byte{
		append(append(append([]byte{}, open...), rawMessage(socketFrame, frame)...), rawMessage(socketCloseSend, nil)...),
		open,
		append(append([]byte{}, open...), rawMessage(socketFrame, []byte{0xff, 0xff})...),
		append(append([]byte{}, open...), huge...),
		rawMessage(socketOpen, []byte("/nope")),
		[]byte("GET / HTTP/1.1\r\n\r\n"),
	} {
		f.Add(seed)
	}
	echo := echoStage()
	dir, err := os.MkdirTemp("", "mn")
	if err != nil {
		f.Fatal(err)
	}
	f.Cleanup(func() { os.RemoveAll(dir) })
	path := filepath.Join(dir, "s.sock")
	ln, err := net.Listen("unix", path)
	if err != nil {
		f.Fatal(err)
	}
	srv := NewSocketServer(echo, SocketServerConfig{MaxRecvBytes: 1 << 20})
	go srv.Serve(ln)
	f.Cleanup(srv.Stop)

	f.Fuzz(func(t *testing.T, data []byte) {
		c, err := net.Dial("unix", path)
		if err != nil {
			t.Fatalf("the server stopped accepting: %v", err)
		}
		defer c.Close()
		if _, err := c.Write(data); err != nil {
			return // the server closed early: fine
		}
		c.(*net.UnixConn).CloseWrite()
		_ = c.SetReadDeadline(time.Now().Add(10 * time.Second))
		r := bufio.NewReader(c)
		var buf []byte
		ended := false
		for {
			kind, body, err := readSocketMsg(r, &buf, 2<<20)
			if errors.Is(err, io.EOF) {
				return
			}
			if err != nil {
				t.Fatalf("reading the server's reply: %v", err)
			}
			switch {
			case ended:
				t.Fatalf("message of kind %d after the end", kind)
			case kind == socketEnd:
				if len(body) < 4 {
					t.Fatalf("end of %d bytes", len(body))
				}
				ended = true
			case kind == socketFrame:
				if err := proto.Unmarshal(body, new(meshnodev1.Frame)); err != nil {
					t.Fatalf("the server sent a bad frame: %v", err)
				}
			default:
				t.Fatalf("the server sent a message of kind %d", kind)
			}
		}
	})
}

// TestDirectSendStuckNextHop: a stage writes its frames to a next hop over
// a socket stream itself (link.direct). When that hop stops reading, the
// writes block; when the stage's upstream then goes away, its link must
// still end, within the grace its last writes get, and free its
// sequences' slots.
func TestDirectSendStuckNextHop(t *testing.T) {
	path := stuckListener(t)
	const rows = 16 // 256 KiB of hidden state a step
	e := openEngines(t, []int{0, 2, 5}, ggufstage.Options{Threads: 1, MaxSeqs: rows, Context: 256})[0]
	srv, err := NewServer(ServerConfig{
		Engine: instantEngine{Engine: e, embd: 4096}, SetupTimeout: time.Second, ModelID: "stories260K", ModelHash: "test-hash",
		Dial: func(context.Context, string) (grpc.ClientConnInterface, error) {
			return OverSockets(SocketConfig{Dial: dialUnix(path)}), nil
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	defer srv.Close()
	upCtx, upGone := context.WithCancel(t.Context())
	up, err := meshnodev1.NewStageServiceClient(InProcess(srv)).Forward(upCtx)
	if err != nil {
		t.Fatal(err)
	}
	st := wire.Setup{Role: wire.RoleForward, PipelineID: "stuck", Origin: "test", WireDType: stage.F32,
		Route: []wire.Hop{{Peer: "self", Start: 0, End: 2}, {Peer: "stuck", Start: 2, End: 5}}}
	send := func(f *meshnodev1.Frame, err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		if err := up.Send(f); err != nil {
			t.Fatal(err)
		}
	}
	send(wire.EncodeSetup(st))
	for r := range rows {
		send(wire.EncodeControl(uint64(r+1), wire.Control{Op: wire.OpOpen, Seq: stage.SeqID(r + 1)}))
	}
	for step := range 8 { // more than the socket's buffers hold
		// A batch of its own each: in process, a frame shares its slices.
		b := &stage.Batch{Outputs: []int{rows - 1}}
		for r := range rows {
			b.Seqs, b.Pos, b.Tokens = append(b.Seqs, stage.SeqID(r+1)), append(b.Pos, int32(step)), append(b.Tokens, 1)
		}
		send(wire.EncodeTokens(uint64(100+step), b))
	}
	// The stage is blocked writing with every slot of its engine taken.
	time.Sleep(200 * time.Millisecond)
	if err := e.Open(1000); err == nil {
		t.Fatal("a slot is free while the stage holds every sequence")
	}
	upGone()
	deadline := time.Now().Add(directSendGrace + 5*time.Second)
	for e.Open(1000) != nil {
		if time.Now().After(deadline) {
			t.Fatal("the stage's link did not end: it is stuck writing to a next hop that stopped reading")
		}
		time.Sleep(10 * time.Millisecond)
	}
	if err := e.Release(1000); err != nil {
		t.Fatal(err)
	}
}

// takeRing reads a stream's open message from c as a socket server does
// and maps the ring offered with it, if any (nil, nil: none).
func takeRing(c net.Conn) (*ringSide, error) {
	open := newOpenReader(c)
	var buf []byte
	_, body, err := readSocketMsg(bufio.NewReader(open), &buf, 1<<10)
	fd := open.done()
	if err != nil || !strings.HasSuffix(string(body), ringOffer) {
		closeFD(fd)
		return nil, err
	}
	return acceptRing(fd)
}

// stuckListener listens on a Unix socket whose connections are accepted
// and never read past their open message, and returns its path. A
// stream's ring is taken and never read either.
func stuckListener(t *testing.T) string {
	path := filepath.Join(t.TempDir(), "stuck.sock")
	ln, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	var mu sync.Mutex
	var held []net.Conn
	var rings []*ringSide
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			mu.Lock()
			held = append(held, c)
			mu.Unlock()
			side, err := takeRing(c)
			if err != nil {
				t.Errorf("taking a stream's ring: %v", err)
			}
			if side == nil {
				continue
			}
			mu.Lock()
			rings = append(rings, side)
			mu.Unlock()
			if _, err := c.Write(rawMessage(socketRingAck, nil)); err != nil {
				t.Errorf("answering a ring: %v", err)
			}
		}
	}()
	t.Cleanup(func() {
		ln.Close()
		mu.Lock()
		defer mu.Unlock()
		for _, c := range held {
			c.Close()
		}
		for _, r := range rings {
			r.close()
		}
	})
	return path
}

// TestCloseIdleSocketUpstream: a stage's handler reads its socket stream
// itself (recvCanceler); closing the stage server must end a link whose
// upstream is connected but sends nothing.
func TestCloseIdleSocketUpstream(t *testing.T) {
	next := stuckListener(t)
	e := openEngines(t, []int{0, 2, 5}, engineOpts)[0]
	srv, err := NewServer(ServerConfig{
		Engine: e, ModelID: "stories260K", ModelHash: "test-hash",
		Dial: func(context.Context, string) (grpc.ClientConnInterface, error) {
			return OverSockets(SocketConfig{Dial: dialUnix(next)}), nil
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	path, _ := serveSockets(t, srv, SocketServerConfig{})
	up, err := meshnodev1.NewStageServiceClient(OverSockets(SocketConfig{Dial: dialUnix(path)})).Forward(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	f, err := wire.EncodeSetup(wire.Setup{Role: wire.RoleForward, PipelineID: "idle", Origin: "test", WireDType: stage.F32,
		Route: []wire.Hop{{Peer: "self", Start: 0, End: 2}, {Peer: "next", Start: 2, End: 5}}})
	if err != nil {
		t.Fatal(err)
	}
	if err := up.Send(f); err != nil {
		t.Fatal(err)
	}
	open, err := wire.EncodeControl(1, wire.Control{Op: wire.OpOpen, Seq: 1})
	if err != nil {
		t.Fatal(err)
	}
	if err := up.Send(open); err != nil {
		t.Fatal(err)
	}
	time.Sleep(100 * time.Millisecond) // the link is up and waits for frames
	closed := make(chan struct{})
	go func() {
		srv.Close()
		close(closed)
	}()
	select {
	case <-closed:
	case <-time.After(5 * time.Second):
		t.Fatal("the stage server did not close: a link still waits on its idle upstream")
	}
	// The upstream is told why, then its stream ends.
	f, err = up.Recv()
	if err != nil || wire.BodyKind(f) != "error" {
		t.Fatalf("upstream received %v, %v; want an error frame", f, err)
	}
	if _, err := up.Recv(); err == nil {
		t.Fatal("the upstream's stream goes on after the server closed")
	}
}
