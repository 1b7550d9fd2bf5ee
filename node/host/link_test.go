package host

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"fmt"
	"io"
	mrand "math/rand/v2"
	"net"
	"strconv"
	"strings"
	"sync"
	"testing"
	"time"

	ma "github.com/multiformats/go-multiaddr"
	manet "github.com/multiformats/go-multiaddr/net"
)

// tap forwards TCP connections to target and keeps every byte that
// crossed it, each direction apart.
type tap struct {
	ln      net.Listener
	mu      sync.Mutex
	streams [2]bytes.Buffer // to target, from target
}

func newTap(t *testing.T, target string) *tap {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	tp := &tap{ln: ln}
	t.Cleanup(func() { ln.Close() })
	go func() {
		for {
			c, err := ln.Accept()
			if err != nil {
				return
			}
			d, err := net.Dial("tcp", target)
			if err != nil {
				c.Close()
				continue
			}
			for dir, pair := range [][2]net.Conn{{c, d}, {d, c}} {
				go func() {
					defer pair[1].Close()
					io.Copy(io.MultiWriter(pair[1], tapWriter{tp, dir}), pair[0])
				}()
			}
		}
	}()
	return tp
}

type tapWriter struct {
	tp  *tap
	dir int
}

func (w tapWriter) Write(b []byte) (int, error) {
	w.tp.mu.Lock()
	defer w.tp.mu.Unlock()
	return w.tp.streams[w.dir].Write(b)
}

// seen returns what crossed the tap: to the target, and from it.
func (tp *tap) seen() [2][]byte {
	tp.mu.Lock()
	defer tp.mu.Unlock()
	return [2][]byte{bytes.Clone(tp.streams[0].Bytes()), bytes.Clone(tp.streams[1].Bytes())}
}

// TestLinkCipherOnTheWire: two hosts of a mesh talk through a tap, and no
// libp2p handshake text or stream payload shows on the wire: the handshake
// is under the link cipher, and what follows under TLS's session keys,
// whose records then cross the wire as they are (the link cipher ends).
func TestLinkCipherOnTheWire(t *testing.T) {
	key := mustMeshKey(t)
	a := newTestHost(t, key, nil, nil)
	b := newTestHost(t, key, nil, nil)
	addr := a.Addrs()[0]
	port, err := addr.ValueForProtocol(6) // tcp
	if err != nil {
		t.Fatal(err)
	}
	tp := newTap(t, "127.0.0.1:"+port)
	_, tapPort, _ := net.SplitHostPort(tp.ln.Addr().String())
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := b.Connect(ctx, "/ip4/127.0.0.1/tcp/"+tapPort+"/p2p/"+a.ID().String()); err != nil {
		t.Fatal(err)
	}
	ln := a.Listen("/meshnode/test-echo/1")
	defer ln.Close()
	go echo(ln)
	c, err := b.Dial(ctx, a.ID(), "/meshnode/test-echo/1")
	if err != nil {
		t.Fatal(err)
	}
	defer c.Close()
	secret := bytes.Repeat([]byte("the activations of layer 7, in the clear "), 2000) // 80 KB: five TLS records or more
	go c.Write(secret)
	got := make([]byte, len(secret))
	if _, err := io.ReadFull(c, got); err != nil || !bytes.Equal(got, secret) {
		t.Fatalf("echo: %q, %v", got, err)
	}
	for dir, wire := range tp.seen() {
		if len(wire) < proofLen+100 {
			t.Fatalf("direction %d: only %d bytes crossed the tap", dir, len(wire))
		}
		for _, clear := range [][]byte{[]byte("/multistream/1.0.0"), []byte("/tls/1.0.0"), []byte("/noise"), []byte("/yamux"), []byte("/meshnode/test-echo/1"), secret[:41], []byte(a.ID().String()), []byte(b.ID().String())} {
			if bytes.Contains(wire, clear) {
				t.Errorf("direction %d: %q crossed the wire in the clear", dir, clear)
			}
		}
		// TLS 1.3 application data records, each headed 17 03 03, in the
		// clear: under the link cipher they would not show. 80 KB take
		// five or more.
		if n := bytes.Count(wire, []byte{0x17, 0x03, 0x03}); n < 5 {
			t.Errorf("direction %d: %d TLS record headers crossed the wire in the clear, want 5 or more: the link cipher did not end", dir, n)
		}
	}
}

// TestLinkRefusals: a peer that replays a good proof without holding the
// mesh key gets nothing readable and no connection, and v1 and v2 proofs
// (meshnodes from before the link cipher, and from before it ended after
// the handshake) are refused with a reason.
func TestLinkRefusals(t *testing.T) {
	key := mustMeshKey(t)
	log, logs := observed()
	a := newTestHost(t, key, log, nil)
	port, _ := a.Addrs()[0].ValueForProtocol(6)
	g := newGuard(key, nil, nil)

	t.Run("replayed proof", func(t *testing.T) {
		c, err := net.Dial("tcp", "127.0.0.1:"+port)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		p, _ := g.proof() // as if captured from the wire
		c.Write(p)
		theirs := make([]byte, proofLen)
		if _, err := io.ReadFull(c, theirs); err != nil {
			t.Fatal(err)
		}
		// Speak libp2p in the clear, as someone without the key must.
		c.Write(append([]byte(nil), multistreamHello...))
		c.SetReadDeadline(time.Now().Add(3 * time.Second))
		rest, _ := io.ReadAll(c)
		if bytes.Contains(rest, []byte("/multistream")) {
			t.Errorf("the node answered in the clear: %q", rest)
		}
		if len(a.Peers()) != 0 {
			t.Errorf("a peer without the key connected: %v", a.Peers())
		}
	})

	for _, tc := range []struct {
		name  string
		proof func() []byte
	}{
		{"v1 proof", func() []byte { // before the link cipher: nonce[8] ‖ tag[12]
			nonce := make([]byte, 8)
			rand.Read(nonce)
			return append(nonce, tagWith(g.oldProofKey, nonce, 12)...)
		}},
		{"v2 proof", func() []byte { // a link cipher that never ended
			nonce := make([]byte, proofNonceLen)
			rand.Read(nonce)
			return append(nonce, tagWith(g.v2ProofKey, nonce, proofTagLen)...)
		}},
	} {
		t.Run(tc.name, func(t *testing.T) {
			logs.TakeAll()
			c, err := net.Dial("tcp", "127.0.0.1:"+port)
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			c.Write(tc.proof())
			io.ReadFull(c, make([]byte, proofLen))
			c.Write([]byte("x")) // the node reads our proof when it first needs to
			e := waitLog(t, logs, "older meshnode", 3*time.Second)
			if !strings.Contains(e.Message, "refused connection") {
				t.Errorf("log %q", e.Message)
			}
		})
	}

	t.Run("v1 proof, as the dialer sees it", func(t *testing.T) {
		pc := &proofConn{g: g}
		pc.state.Store(proofOld)
		if err := pc.reason(); !errors.Is(err, ErrHandshake) || !strings.Contains(err.Error(), "upgrade") {
			t.Errorf("reason %v", err)
		}
	})
}

// proofPair is two proof connections of one mesh over loopback TCP, their
// proofs exchanged.
func proofPair(t *testing.T, g *guard) (a, b *proofConn) {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer ln.Close()
	accepted := make(chan *proofConn, 1)
	go func() {
		c, err := ln.Accept()
		if err != nil {
			accepted <- nil
			return
		}
		mc, err := manet.WrapNetConn(c)
		if err != nil {
			c.Close()
			accepted <- nil
			return
		}
		pc, err := newProofConn(mc, g)
		if err != nil {
			c.Close()
			accepted <- nil
			return
		}
		accepted <- pc
	}()
	addr, err := ma.NewMultiaddr("/ip4/127.0.0.1/tcp/" + strconv.Itoa(ln.Addr().(*net.TCPAddr).Port))
	if err != nil {
		t.Fatal(err)
	}
	raw, err := manet.Dial(addr)
	if err != nil {
		t.Fatal(err)
	}
	if a, err = newProofConn(raw, g); err != nil {
		t.Fatal(err)
	}
	if b = <-accepted; b == nil {
		t.Fatal("accept failed")
	}
	t.Cleanup(func() { a.Close(); b.Close() })
	for _, c := range []*proofConn{a, b} {
		if err := c.check(); err != nil {
			t.Fatal(err)
		}
	}
	return a, b
}

// TestLinkSwitch: what one end writes reaches the other whole, in writes
// of any size and reads of any size, across the end of its link cipher
// (once its handshake is done), after which its bytes cross as they are.
func TestLinkSwitch(t *testing.T) {
	g := newGuard(mustMeshKey(t), nil, nil)
	a, b := proofPair(t, g)
	var want []byte
	done := make(chan error, 1)
	go func() {
		rng := mrand.New(mrand.NewPCG(1, 2))
		var err error
		for i, size := range []int{1, 5, linkFrame, linkFrame + 1, 3 * linkChunk, 100, 70000, 2, 40000, 1} {
			if i == 5 {
				a.secured.Store(true) // the handshake is done: the tag goes with the next write
			}
			p := make([]byte, size)
			for j := range p {
				p[j] = byte(rng.Uint32())
			}
			want = append(want, p...)
			var n int
			if n, err = a.Write(p); err != nil || n != size {
				err = fmt.Errorf("write %d of %d bytes: %v", n, size, err)
				break
			}
		}
		done <- err
	}()
	rng := mrand.New(mrand.NewPCG(3, 4))
	var got []byte
	buf := make([]byte, 70001)
	total := 1 + 5 + linkFrame + linkFrame + 1 + 3*linkChunk + 100 + 70000 + 2 + 40000 + 1
	for len(got) < total {
		n, err := b.Read(buf[:1+rng.IntN(len(buf))])
		if err != nil {
			t.Fatalf("read after %d bytes: %v", len(got), err)
		}
		got = append(got, buf[:n]...)
	}
	if err := <-done; err != nil {
		t.Fatal(err)
	}
	if !bytes.Equal(got, want) {
		t.Fatal("the bytes read differ from those written")
	}
	if !a.sent || !b.received {
		t.Fatalf("link cipher still on: sent %v, received %v", a.sent, b.received)
	}
	// The other direction, never secured, stays encrypted and framed.
	go b.Write([]byte("still framed"))
	back := make([]byte, 12)
	if _, err := io.ReadFull(a, back); err != nil || string(back) != "still framed" || a.received {
		t.Fatalf("read back %q, %v, received %v", back, err, a.received)
	}
}

// TestLinkSwitchForged: a switch tag that is not the link's breaks the
// connection instead of ending its encryption.
func TestLinkSwitchForged(t *testing.T) {
	g := newGuard(mustMeshKey(t), nil, nil)
	a, b := proofPair(t, g)
	a.sendTag = bytes.Repeat([]byte{7}, switchTagLen) // not the tag b expects
	a.secured.Store(true)
	go a.Write([]byte("plain from here on"))
	if _, err := b.Read(make([]byte, 64)); err == nil || !strings.Contains(err.Error(), "switch tag") {
		t.Fatalf("read: %v, want a bad switch tag", err)
	}
	if _, err := b.Read(make([]byte, 64)); err == nil {
		t.Fatal("the broken link read again")
	}
}
