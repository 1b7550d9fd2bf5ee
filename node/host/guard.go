package host

import (
	"bytes"
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"errors"
	"fmt"
	"io"
	"sync"
	"sync/atomic"
	"time"

	"github.com/libp2p/go-libp2p/core/control"
	"github.com/libp2p/go-libp2p/core/network"
	"github.com/libp2p/go-libp2p/core/peer"
	"github.com/libp2p/go-libp2p/core/transport"
	ma "github.com/multiformats/go-multiaddr"
	manet "github.com/multiformats/go-multiaddr/net"
	"go.uber.org/zap"
)

// Errors a dial can wrap when the remote end turns the connection away before
// it is authenticated.
var (
	// ErrMeshKey: the remote end proved it holds another mesh key, or none.
	ErrMeshKey = errors.New("peer refused: wrong or missing mesh key")
	// ErrHandshake: the connection broke before authentication for a reason
	// we cannot pin down (e.g. the remote is not a meshnode).
	ErrHandshake = errors.New("peer refused: handshake failed (wrong or missing mesh key?)")
)

// Why this file exists. pnet alone gives no "wrong key" signal: both ends
// just read noise, and depending on what the noise decodes to, the first
// reader either fails at once or waits for bytes that never come until a
// timeout (5 s for a dial). So before pnet, each end of a TCP connection sends
// a 20-byte mesh-key proof, nonce[8] ‖ HMAC-SHA256(proofKey, nonce)[:12], and
// checks the other's before it writes anything more. A mismatch is then
// certain and immediate on both ends; since neither end has unread data at
// that point, the connection closes cleanly and both can report it. The proof
// is not replay-proof and need not be: it only makes refusals explicit, while
// pnet (and Noise/TLS inside it) still keeps out anyone without the key.
//
// The proof is applied by wrapping libp2p's upgrader for the TCP transport:
// Upgrade for dials, the gated listener for accepts. The connection gater
// marks proof connections that reached authentication, so a connection
// closing before that is known to be a refusal.
const (
	proofNonceLen = 8
	proofTagLen   = 12
	proofLen      = proofNonceLen + proofTagLen
	// proofWriteTimeout bounds sending our proof from the accept loop.
	proofWriteTimeout = 2 * time.Second
)

// proof states, set once the peer's proof has been read.
const (
	proofPending int32 = iota
	proofOK
	proofWrong   // a proof for another mesh key
	proofPlain   // the peer speaks libp2p without a PSK (no mesh key)
	proofMissing // the connection ended or failed before a full proof
)

// multistreamHello starts every libp2p connection without a PSK.
var multistreamHello = []byte("\x13/multistream/1.0.0\n")

type guard struct {
	log      *zap.Logger
	allow    func(peer.ID) bool
	proofKey []byte
}

func (g *guard) proof() ([]byte, error) {
	p := make([]byte, proofNonceLen, proofLen)
	if _, err := rand.Read(p); err != nil {
		return nil, fmt.Errorf("make mesh key proof: %w", err)
	}
	return append(p, g.tag(p)...), nil
}

func (g *guard) tag(nonce []byte) []byte {
	mac := hmac.New(sha256.New, g.proofKey)
	mac.Write(nonce)
	return mac.Sum(nil)[:proofTagLen]
}

// proofConn sends our proof when made and checks the peer's before the first
// Read or Write passes through.
type proofConn struct {
	manet.Conn
	g       *guard
	once    sync.Once
	err     error
	state   atomic.Int32
	secured atomic.Bool // the gater saw the peer authenticated
	refused atomic.Bool // the allowlist turned the peer away (already logged)
}

func newProofConn(c manet.Conn, g *guard) (*proofConn, error) {
	p, err := g.proof()
	if err != nil {
		return nil, err
	}
	_ = c.SetWriteDeadline(time.Now().Add(proofWriteTimeout))
	if _, err := c.Write(p); err != nil {
		return nil, fmt.Errorf("send mesh key proof: %w", err)
	}
	_ = c.SetWriteDeadline(time.Time{})
	return &proofConn{Conn: c, g: g}, nil
}

func (c *proofConn) check() error {
	c.once.Do(func() {
		buf := make([]byte, proofLen)
		if _, err := io.ReadFull(c.Conn, buf); err != nil {
			c.state.Store(proofMissing)
			c.err = fmt.Errorf("read mesh key proof: %w", err)
			return
		}
		switch {
		case hmac.Equal(buf[proofNonceLen:], c.g.tag(buf[:proofNonceLen])):
			c.state.Store(proofOK)
		case bytes.Equal(buf, multistreamHello):
			c.state.Store(proofPlain)
			c.err = c.reason()
		default:
			c.state.Store(proofWrong)
			c.err = c.reason()
		}
	})
	return c.err
}

// reason says why the proof failed, or nil; safe from any goroutine.
func (c *proofConn) reason() error {
	switch c.state.Load() {
	case proofPlain:
		return fmt.Errorf("%w: the peer has no mesh key", ErrMeshKey)
	case proofWrong:
		return fmt.Errorf("%w: the peer holds another mesh key", ErrMeshKey)
	case proofMissing:
		return errors.New("no mesh key proof from the peer")
	}
	return nil
}

func (c *proofConn) Read(b []byte) (int, error) {
	if err := c.check(); err != nil {
		return 0, err
	}
	return c.Conn.Read(b)
}

func (c *proofConn) Write(b []byte) (int, error) {
	if err := c.check(); err != nil {
		return 0, err
	}
	return c.Conn.Write(b)
}

// TCP options that libp2p sets on accepted connections through interface
// checks; pass them on to the socket.

func (c *proofConn) SetKeepAlive(on bool) error {
	if k, ok := c.Conn.(interface{ SetKeepAlive(bool) error }); ok {
		return k.SetKeepAlive(on)
	}
	return errors.ErrUnsupported
}

func (c *proofConn) SetKeepAlivePeriod(d time.Duration) error {
	if k, ok := c.Conn.(interface{ SetKeepAlivePeriod(time.Duration) error }); ok {
		return k.SetKeepAlivePeriod(d)
	}
	return errors.ErrUnsupported
}

func (c *proofConn) SetLinger(sec int) error {
	if k, ok := c.Conn.(interface{ SetLinger(int) error }); ok {
		return k.SetLinger(sec)
	}
	return errors.ErrUnsupported
}

// gater implements connmgr.ConnectionGater: it applies the optional allowlist
// and marks connections that reached authentication.
type gater struct{ g *guard }

func (gt gater) InterceptPeerDial(peer.ID) bool               { return true }
func (gt gater) InterceptAddrDial(peer.ID, ma.Multiaddr) bool { return true }
func (gt gater) InterceptAccept(network.ConnMultiaddrs) bool  { return true }

func (gt gater) InterceptSecured(dir network.Direction, p peer.ID, c network.ConnMultiaddrs) bool {
	allowed := gt.g.allow == nil || gt.g.allow(p)
	if pc, ok := c.(*proofConn); ok {
		pc.secured.Store(true)
		pc.refused.Store(!allowed)
	}
	if !allowed {
		gt.g.log.Warn("refused peer: not in allowlist",
			zap.Stringer("peer", p), zap.Stringer("remote", c.RemoteMultiaddr()), zap.Stringer("dir", dir))
	}
	return allowed
}

func (gt gater) InterceptUpgraded(network.Conn) (bool, control.DisconnectReason) { return true, 0 }

// guardUpgrader wraps libp2p's upgrader for the TCP transport.
type guardUpgrader struct {
	transport.Upgrader
	g *guard
}

func (u *guardUpgrader) GateMaListener(l manet.Listener) transport.GatedMaListener {
	return &guardListener{GatedMaListener: u.Upgrader.GateMaListener(l), g: u.g}
}

// Upgrade runs dials: the error goes back to the dialer, marked with
// ErrMeshKey or ErrHandshake when the peer was never authenticated.
func (u *guardUpgrader) Upgrade(ctx context.Context, tpt transport.Transport, c manet.Conn, dir network.Direction, p peer.ID, scope network.ConnManagementScope) (transport.CapableConn, error) {
	pc, err := newProofConn(c, u.g)
	if err != nil {
		c.Close()
		scope.Done()
		return nil, fmt.Errorf("%w: %w", ErrHandshake, err)
	}
	conn, err := u.Upgrader.Upgrade(ctx, tpt, pc, dir, p, scope)
	if err != nil && !pc.secured.Load() {
		if why := pc.reason(); errors.Is(why, ErrMeshKey) {
			return nil, fmt.Errorf("%w: %w", why, err)
		}
		return nil, fmt.Errorf("%w: %w", ErrHandshake, err)
	}
	return conn, err
}

type guardListener struct {
	transport.GatedMaListener
	g *guard
}

func (l *guardListener) Accept() (manet.Conn, network.ConnManagementScope, error) {
	for {
		c, scope, err := l.GatedMaListener.Accept()
		if err != nil {
			return c, scope, err
		}
		pc, err := newProofConn(c, l.g)
		if err != nil {
			// One broken connection must not stop the listener.
			l.g.log.Debug("drop incoming connection", zap.Stringer("remote", c.RemoteMultiaddr()), zap.Error(err))
			c.Close()
			scope.Done()
			continue
		}
		return pc, &guardScope{ConnManagementScope: scope, pc: pc, log: l.g.log}, nil
	}
}

// guardScope sees the two calls that settle an inbound connection: SetPeer
// (authenticated and accepted) or Done (closed: before SetPeer, a refusal).
type guardScope struct {
	network.ConnManagementScope
	pc   *proofConn
	log  *zap.Logger
	once sync.Once
}

func (s *guardScope) SetPeer(p peer.ID) error {
	s.once.Do(func() {})
	return s.ConnManagementScope.SetPeer(p)
}

func (s *guardScope) Done() {
	s.once.Do(func() {
		remote := zap.Stringer("remote", s.pc.RemoteMultiaddr())
		switch {
		case s.pc.secured.Load():
			// Authenticated; the gater logged an allowlist refusal itself.
		case s.pc.state.Load() == proofWrong:
			s.log.Warn("refused connection: wrong mesh key", remote)
		case s.pc.state.Load() == proofPlain:
			s.log.Warn("refused connection: peer has no mesh key", remote)
		default:
			s.log.Warn("refused connection: handshake failed (wrong or missing mesh key?)", remote, zap.Error(s.pc.reason()))
		}
	})
	s.ConnManagementScope.Done()
}
