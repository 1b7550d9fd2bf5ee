package host

import (
	"bytes"
	"context"
	"crypto/rand"
	"errors"
	"io"
	"net"
	"strings"
	"sync"
	"testing"
	"time"
)

// tap forwards TCP connections to target and keeps every byte that
// crossed it, both ways.
type tap struct {
	ln     net.Listener
	mu     sync.Mutex
	stream bytes.Buffer
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
			for _, pair := range [][2]net.Conn{{c, d}, {d, c}} {
				go func() {
					defer pair[1].Close()
					io.Copy(io.MultiWriter(pair[1], tp), pair[0])
				}()
			}
		}
	}()
	return tp
}

func (tp *tap) Write(b []byte) (int, error) {
	tp.mu.Lock()
	defer tp.mu.Unlock()
	return tp.stream.Write(b)
}

func (tp *tap) seen() []byte {
	tp.mu.Lock()
	defer tp.mu.Unlock()
	return bytes.Clone(tp.stream.Bytes())
}

// TestLinkCipherOnTheWire: two hosts of a mesh talk through a tap, and no
// libp2p handshake text or stream payload shows on the wire: everything
// after the proofs is under the link cipher.
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
	secret := []byte("the activations of layer 7, in the clear")
	if _, err := c.Write(secret); err != nil {
		t.Fatal(err)
	}
	got := make([]byte, len(secret))
	if _, err := io.ReadFull(c, got); err != nil || !bytes.Equal(got, secret) {
		t.Fatalf("echo: %q, %v", got, err)
	}
	wire := tp.seen()
	if len(wire) < 2*proofLen+100 {
		t.Fatalf("only %d bytes crossed the tap", len(wire))
	}
	for _, clear := range [][]byte{[]byte("/multistream/1.0.0"), []byte("/tls/1.0.0"), []byte("/noise"), []byte("/yamux"), []byte("/meshnode/test-echo/1"), secret, []byte(a.ID().String())} {
		if bytes.Contains(wire, clear) {
			t.Errorf("%q crossed the wire in the clear", clear)
		}
	}
}

// TestLinkRefusals: a peer that replays a good proof without holding the
// mesh key gets nothing readable and no connection, and a v1 proof (a
// meshnode from before the link cipher) is refused with a reason.
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

	t.Run("v1 proof", func(t *testing.T) {
		logs.TakeAll()
		c, err := net.Dial("tcp", "127.0.0.1:"+port)
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		nonce := make([]byte, 8)
		rand.Read(nonce)
		c.Write(append(nonce, tagWith(g.oldProofKey, nonce, 12)...))
		io.ReadFull(c, make([]byte, proofLen))
		c.Write([]byte("x")) // the node reads our proof when it first needs to
		e := waitLog(t, logs, "older meshnode", 3*time.Second)
		if !strings.Contains(e.Message, "refused connection") {
			t.Errorf("log %q", e.Message)
		}
	})

	t.Run("v1 proof, as the dialer sees it", func(t *testing.T) {
		pc := &proofConn{g: g}
		pc.state.Store(proofOld)
		if err := pc.reason(); !errors.Is(err, ErrHandshake) || !strings.Contains(err.Error(), "upgrade") {
			t.Errorf("reason %v", err)
		}
	})
}
