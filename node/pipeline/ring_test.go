//go:build linux

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
	"sync/atomic"
	"testing"
	"time"
	"unsafe"

	"golang.org/x/sys/unix"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	meshnodev1 "github.com/meshnode/meshnode/proto/meshnode/v1"
)

// windowConn is a Unix connection with a busy-poll window, as the host's
// local connections have.
type windowConn struct {
	*net.UnixConn
	window time.Duration
}

func (c windowConn) BusyPollWindow() time.Duration { return c.window }

func dialWindow(path string, window time.Duration) func(context.Context) (net.Conn, error) {
	return func(ctx context.Context) (net.Conn, error) {
		c, err := (&net.Dialer{}).DialContext(ctx, "unix", path)
		if err != nil {
			return nil, err
		}
		return windowConn{c.(*net.UnixConn), window}, nil
	}
}

func payloadFrame(step uint64, n int) *meshnodev1.Frame {
	p := make([]byte, n)
	for i := range p {
		p[i] = byte(int(step)*7 + i*13)
	}
	return &meshnodev1.Frame{Step: step, Body: &meshnodev1.Frame_Activations{Activations: &meshnodev1.Activations{Rows: 1, Cols: uint32(n), Payload: p}}}
}

// TestRingMessages sends messages of every size through a stream's rings
// and back, many times round each ring, and messages too large for a ring
// beside them on the socket: all arrive whole, in order. The client polls
// its ring (a busy-poll window), the server sleeps on its socket between
// messages (none), so both bells and polling run.
func TestRingMessages(t *testing.T) {
	sizes := []int{0, 1, 100, 1 << 10, 16 << 10, 128 << 10, 300 << 10, ringMaxRecord, 600 << 10, 16 << 10, 7}
	for _, window := range []time.Duration{0, 25 * time.Millisecond} {
		t.Run("window "+window.String(), func(t *testing.T) {
			path, _ := serveSockets(t, echoStage(), SocketServerConfig{MaxRecvBytes: 4 << 20})
			conn := OverSockets(SocketConfig{Dial: dialWindow(path, window), MaxRecvBytes: 4 << 20})
			s, err := meshnodev1.NewStageServiceClient(conn).Forward(t.Context())
			if err != nil {
				t.Fatal(err)
			}
			if sc := socketOf(s); sc == nil || sc.ring == nil || sc.w.ring == nil {
				t.Fatal("the stream runs without a ring")
			}
			const rounds = 12 // about 17 MB each way: eight times round a ring
			n := rounds * len(sizes)
			got := make(chan error, 1)
			go func() {
				for i := range n {
					f, err := s.Recv()
					if err != nil {
						got <- err
						return
					}
					want := payloadFrame(uint64(i), sizes[i%len(sizes)])
					if f.GetStep() != uint64(i) || !bytes.Equal(f.GetActivations().GetPayload(), want.GetActivations().GetPayload()) {
						got <- errors.New("a message came back changed or out of order")
						return
					}
				}
				if _, err := s.Recv(); !errors.Is(err, io.EOF) {
					got <- err
					return
				}
				got <- nil
			}()
			for i := range n {
				if err := s.Send(payloadFrame(uint64(i), sizes[i%len(sizes)])); err != nil {
					t.Fatal(err)
				}
			}
			if err := s.CloseSend(); err != nil {
				t.Fatal(err)
			}
			select {
			case err := <-got:
				if err != nil {
					t.Fatal(err)
				}
			case <-time.After(30 * time.Second):
				t.Fatal("the messages did not all come back")
			}
		})
	}
}

// TestRingOldServer: a server from before rings refuses the offer as an
// unknown method; the client opens the stream again on the socket alone.
func TestRingOldServer(t *testing.T) {
	path := filepath.Join(t.TempDir(), "old.sock")
	ln, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	var offers atomic.Int32
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			go func() {
				defer c.Close()
				r := bufio.NewReader(c) // reads as the old server did: the descriptor is dropped
				var buf []byte
				kind, body, err := readSocketMsg(r, &buf, 1<<10)
				if err != nil || kind != socketOpen {
					return
				}
				if string(body) != meshnodev1.StageService_Forward_FullMethodName {
					offers.Add(1)
					c.Write(rawMessage(socketEnd, endBody(status.Error(codes.Unimplemented, "no stream"))))
					return
				}
				for { // echo frames until the client closes its side
					kind, body, err := readSocketMsg(r, &buf, 1<<20)
					if err != nil || kind != socketFrame {
						c.Write(rawMessage(socketEnd, endBody(nil)))
						return
					}
					c.Write(rawMessage(socketFrame, body))
				}
			}()
		}
	}()
	s, err := meshnodev1.NewStageServiceClient(OverSockets(SocketConfig{Dial: dialUnix(path)})).Forward(t.Context())
	if err != nil {
		t.Fatal(err)
	}
	if sc := socketOf(s); sc == nil || sc.ring != nil {
		t.Fatal("the stream should run on the socket alone")
	}
	if offers.Load() != 1 {
		t.Fatalf("%d ring offers, want 1", offers.Load())
	}
	for i := range uint64(3) {
		if err := s.Send(payloadFrame(i, 20<<10)); err != nil {
			t.Fatal(err)
		}
		f, err := s.Recv()
		if err != nil || f.GetStep() != i || len(f.GetActivations().GetPayload()) != 20<<10 {
			t.Fatalf("frame %d: %v", i, err)
		}
	}
	s.CloseSend()
	if _, err := s.Recv(); !errors.Is(err, io.EOF) {
		t.Fatalf("end: %v, want EOF", err)
	}
}

// dialRaw connects to a socket server at path, for a test that speaks the
// protocol by hand; it gives the connection 10 s.
func dialRaw(t *testing.T, path string) net.Conn {
	t.Helper()
	c, err := net.Dial("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { c.Close() })
	_ = c.SetDeadline(time.Now().Add(10 * time.Second))
	return c
}

// TestRingRefused: an offer without shared memory beside it is refused
// with a reason, and the stream goes on over the socket.
func TestRingRefused(t *testing.T) {
	path, _ := serveSockets(t, echoStage(), SocketServerConfig{})
	c := dialRaw(t, path)
	if _, err := c.Write(rawMessage(socketOpen, []byte(meshnodev1.StageService_Forward_FullMethodName+ringOffer))); err != nil {
		t.Fatal(err)
	}
	r := bufio.NewReader(c)
	var buf []byte
	kind, body, err := readSocketMsg(r, &buf, 1<<10)
	if err != nil || kind != socketRingAck || len(body) == 0 {
		t.Fatalf("answer: kind %d %q, %v; want a ring refused with a reason", kind, body, err)
	}
	frame := rawMessage(socketFrame, mustMarshal(t, tokensFrame(4, 3)))
	if _, err := c.Write(append(frame, rawMessage(socketCloseSend, nil)...)); err != nil {
		t.Fatal(err)
	}
	if kind, _, err := readSocketMsg(r, &buf, 1<<10); err != nil || kind != socketFrame {
		t.Fatalf("echo: kind %d, %v", kind, err)
	}
	if kind, body, err := readSocketMsg(r, &buf, 1<<10); err != nil || kind != socketEnd || binary.LittleEndian.Uint32(body) != uint32(codes.OK) {
		t.Fatalf("end: kind %d, %v", kind, err)
	}
}

// TestRingPeerGone: a server that takes the ring and then goes away
// without a word ends the client's stream, whether the client is polling
// its ring or asleep on the socket.
func TestRingPeerGone(t *testing.T) {
	for _, window := range []time.Duration{0, 50 * time.Millisecond} {
		t.Run("window "+window.String(), func(t *testing.T) {
			path := ringPeer(t, func(net.Conn, *ringSide) { time.Sleep(100 * time.Millisecond) })
			s, err := meshnodev1.NewStageServiceClient(OverSockets(SocketConfig{Dial: dialWindow(path, window)})).Forward(t.Context())
			if err != nil {
				t.Fatal(err)
			}
			start := time.Now()
			if _, err := s.Recv(); status.Code(err) != codes.Unavailable {
				t.Fatalf("Recv: %v, want Unavailable", err)
			}
			if d := time.Since(start); d > 5*time.Second {
				t.Fatalf("the stream ended %v after the peer left", d)
			}
		})
	}
}

// ringPeer listens on a Unix socket for one stream, takes its ring and
// answers it, runs peer, and then leaves without a word: the ring is
// unmapped and the connection closed. It returns the socket's path.
func ringPeer(t *testing.T, peer func(c net.Conn, side *ringSide)) string {
	path := filepath.Join(t.TempDir(), "peer.sock")
	ln, err := net.Listen("unix", path)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { ln.Close() })
	go func() {
		c, err := ln.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		side, err := takeRing(c)
		if side == nil || err != nil {
			t.Errorf("taking the stream's ring: %v", err)
			return
		}
		defer side.close()
		if _, err := c.Write(rawMessage(socketRingAck, nil)); err != nil {
			t.Errorf("answering the ring: %v", err)
			return
		}
		peer(c, side)
	}()
	return path
}

// TestRingCorrupt: a peer that scribbles on its ring ends the stream with
// a reason; nothing reads outside the shared memory.
func TestRingCorrupt(t *testing.T) {
	for _, tt := range []struct {
		name  string
		write func(h ringHalf)
	}{
		{"head not aligned", func(h ringHalf) { h.head.Store(13) }},
		{"head far ahead", func(h ringHalf) { h.head.Store(3 * ringData) }},
		{"record past the head", func(h ringHalf) { putHeader(h.data, socketFrame, 0, 4096); h.head.Store(16) }},
		{"record past the end", func(h ringHalf) { putHeader(h.data, socketFrame, 0, ringData); h.head.Store(ringData) }},
		{"padding too long", func(h ringHalf) { putHeader(h.data, socketFrame, 200, 8); h.head.Store(216) }},
	} {
		t.Run(tt.name, func(t *testing.T) {
			path := ringPeer(t, func(c net.Conn, side *ringSide) {
				tt.write(side.out)
				writeBell(c)
				time.Sleep(time.Second)
			})
			s, err := meshnodev1.NewStageServiceClient(OverSockets(SocketConfig{Dial: dialUnix(path)})).Forward(t.Context())
			if err != nil {
				t.Fatal(err)
			}
			if _, err := s.Recv(); err == nil || status.Code(err) == codes.OK {
				t.Fatalf("Recv: %v, want an error", err)
			}
		})
	}
}

func mustMarshal(t *testing.T, f *meshnodev1.Frame) []byte {
	t.Helper()
	b, err := proto.Marshal(f)
	if err != nil {
		t.Fatal(err)
	}
	return b
}

// TestRingPayloadAligned: a frame's payload (the second part of a
// message) lies at a multiple of 16 in the reader's memory whatever the
// head before it and wherever the record falls, so that it is lent as it
// lies; the bodies arrive whole.
func TestRingPayloadAligned(t *testing.T) {
	fd, err := ringCreate()
	if err != nil {
		t.Fatal(err)
	}
	m, err := mapRing(fd)
	closeFD(fd)
	if err != nil {
		t.Fatal(err)
	}
	defer m.close()
	w, r := newRingSide(m, true), newRingSide(m, false)
	rd := &ringReader{side: r, window: func() time.Duration { return time.Hour }}
	for i := range 400 { // about 2.5 times round the ring
		head := bytes.Repeat([]byte{byte(i)}, 1+i%37)
		payload := bytes.Repeat([]byte{byte(i * 3), byte(i)}, 1000+i%9)
		if err := w.write(socketFrame, [][]byte{head, payload}, nil, nil); err != nil {
			t.Fatal(err)
		}
		kind, body, err := rd.read(1 << 20)
		if err != nil || kind != socketFrame {
			t.Fatalf("message %d: kind %d, %v", i, kind, err)
		}
		if !bytes.Equal(body, append(head, payload...)) {
			t.Fatalf("message %d came back changed", i)
		}
		if addr := uintptr(unsafe.Pointer(&body[len(head)])); addr%16 != 0 {
			t.Fatalf("message %d: the payload lies at %#x", i, addr)
		}
	}
}

// TestRingUnsealed: memory that its client could shrink under the
// server's mapping (a fault there would kill the server) is refused with
// a reason; the stream stays on its socket.
func TestRingUnsealed(t *testing.T) {
	path, _ := serveSockets(t, echoStage(), SocketServerConfig{})
	c := dialRaw(t, path)
	fd, err := unix.MemfdCreate("unsealed", unix.MFD_CLOEXEC)
	if err != nil {
		t.Fatal(err)
	}
	defer unix.Close(fd)
	if err := unix.Ftruncate(fd, ringBytes); err != nil {
		t.Fatal(err)
	}
	open := rawMessage(socketOpen, []byte(meshnodev1.StageService_Forward_FullMethodName+ringOffer))
	if _, _, err := c.(*net.UnixConn).WriteMsgUnix(open, unix.UnixRights(fd), nil); err != nil {
		t.Fatal(err)
	}
	var buf []byte
	kind, body, err := readSocketMsg(bufio.NewReader(c), &buf, 1<<10)
	if err != nil || kind != socketRingAck || !strings.Contains(string(body), "shrink") {
		t.Fatalf("answer: kind %d %q, %v; want the ring refused as memory that could shrink", kind, body, err)
	}
}

// TestRingOutlivesHandler: a goroutine of the handler that goes on
// reading after the handler returned (as Server.receive does on a return
// stream) must not touch the stream's memory once it is gone, while the
// client keeps sending.
func TestRingOutlivesHandler(t *testing.T) {
	reading := fakeStage{forward: func(s meshnodev1.StageService_ForwardServer) error {
		first := make(chan struct{})
		go func() { // reads to the stream's end, as Server.receive does
			once := false
			for {
				if _, err := s.Recv(); err != nil {
					return
				}
				if !once {
					once = true
					close(first)
				}
			}
		}()
		<-first
		return status.Error(codes.InvalidArgument, "one frame was enough")
	}}
	for range 5 {
		path, _ := serveSockets(t, reading, SocketServerConfig{MaxRecvBytes: 1 << 20})
		s, err := meshnodev1.NewStageServiceClient(OverSockets(SocketConfig{Dial: dialUnix(path)})).Forward(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		for i := range 200 {
			if s.Send(payloadFrame(uint64(i), 480<<10)) != nil {
				break // the server ended the stream
			}
		}
		if _, err := s.Recv(); status.Code(err) != codes.InvalidArgument {
			t.Fatalf("Recv: %v, want the handler's InvalidArgument", err)
		}
	}
}

// ringMappings counts this process's mappings of stream memory.
func ringMappings(t *testing.T) int {
	b, err := os.ReadFile("/proc/self/maps")
	if err != nil {
		t.Fatal(err)
	}
	return strings.Count(string(b), "meshnode-ring")
}

// TestRingReleasedOnCancel: a stream whose context ends gives its memory
// back on both sides, even if nobody reads it again, and its sends fail
// as a socket stream's do.
func TestRingReleasedOnCancel(t *testing.T) {
	path, _ := serveSockets(t, echoStage(), SocketServerConfig{})
	before := ringMappings(t)
	var cancels []context.CancelFunc
	var streams []meshnodev1.StageService_ForwardClient
	for range 5 {
		ctx, cancel := context.WithCancel(t.Context())
		s, err := meshnodev1.NewStageServiceClient(OverSockets(SocketConfig{Dial: dialUnix(path)})).Forward(ctx)
		if err != nil {
			t.Fatal(err)
		}
		cancels, streams = append(cancels, cancel), append(streams, s)
	}
	if n := ringMappings(t); n < before+10 {
		t.Fatalf("%d stream mappings with five streams open, %d before", n, before)
	}
	for _, cancel := range cancels {
		cancel()
	}
	for _, s := range streams {
		if err := s.Send(tokensFrame(1, 1)); status.Code(err) != codes.Canceled {
			t.Fatalf("Send after the context ended: %v, want Canceled", err)
		}
	}
	deadline := time.Now().Add(10 * time.Second)
	for ringMappings(t) > before {
		if time.Now().After(deadline) {
			t.Fatalf("%d stream mappings left, %d before the streams", ringMappings(t), before)
		}
		time.Sleep(10 * time.Millisecond)
	}
}
