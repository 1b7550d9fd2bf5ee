package host

import (
	"bytes"
	"context"
	"crypto/aes"
	"crypto/cipher"
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

// Why this file exists. Every TCP connection between mesh nodes starts with
// each end sending a 20-byte mesh-key proof, nonce[12] ‖ HMAC-SHA256(
// proofKey, nonce)[:8], and checking the other's before anything more
// passes. A wrong key is then certain and immediate on both ends (a
// connection without it would just read noise, and a dial might hang until
// its timeout); since neither end has unread data at that point, the
// connection closes cleanly and both can report it. The proof can be
// replayed and need not be secret: it only makes refusals explicit.
//
// What keeps out anyone without the key is the link cipher that follows:
// every byte after the proofs, the whole libp2p handshake included, is
// encrypted with AES-256-CTR under a key derived from the mesh key and both
// ends' nonces (one key per direction). A peer without the mesh key can
// neither read the node's handshake (its peer ID, its protocols) nor write
// one the node can read. It plays the part of libp2p's private network
// (pnet), whose XSalsa20 took half the CPU of a loopback stream. Noise or
// TLS runs inside, and authenticates and protects the integrity of
// everything.
//
// Once this end's security handshake is done (the gater saw the peer
// authenticated), the link cipher has done its work: only a holder of the
// mesh key could have taken part in that handshake, and what follows is
// under the session keys it agreed, which only the two ends have. So each
// end then stops encrypting what it sends: a second cipher over every hop
// of every decode step cost a tenth to a fifth of a hop's time
// (BenchmarkWideStep and BenchmarkHop on a 2-core machine, up to 512 KiB
// of hidden state). To say where, its link stream is framed
// while encrypted, [length:2][bytes], and a frame of length 0 followed by a
// 16-byte switch tag, derived from the link key and both nonces, ends it;
// after the tag its bytes go as they are. Without the mesh key nobody can
// make a tag that decrypts right, so no one can end another's encryption
// early, and a wrong tag breaks the connection.
//
// The proof is applied by wrapping libp2p's upgrader for the TCP transport:
// Upgrade for dials, the gated listener for accepts. The connection gater
// marks proof connections that reached authentication, so a connection
// closing before that is known to be a refusal.
const (
	proofNonceLen = 12
	proofTagLen   = 8
	proofLen      = proofNonceLen + proofTagLen
	// proofWriteTimeout bounds sending our proof from the accept loop.
	proofWriteTimeout = 2 * time.Second
)

// proof states, set once the peer's proof has been read.
const (
	proofPending int32 = iota
	proofOK
	proofWrong   // a proof for another mesh key
	proofPlain   // the peer speaks libp2p without a mesh key
	proofMissing // the connection ended or failed before a full proof
	proofOld     // a v1 proof: meshnode from before the link cipher
)

// multistreamHello starts every plain libp2p connection.
var multistreamHello = []byte("\x13/multistream/1.0.0\n")

type guard struct {
	log         *zap.Logger
	allow       func(peer.ID) bool
	proofKey    []byte
	oldProofKey []byte       // v1 proofs: meshnode before the link cipher, which cannot talk to us
	v2ProofKey  []byte       // v2 proofs: meshnode whose link cipher never ended, which cannot talk to us either
	linkKey     []byte       // the link cipher's keys are derived from it and both proofs' nonces
	localKey    []byte       // local connections' handshake MACs (local.go)
	busyPoll    atomic.Int64 // the busy-poll window of every connection, ns (see busypoll.go)
}

// newGuard derives the guard's keys from the mesh key.
func newGuard(key MeshKey, allow func(peer.ID) bool, log *zap.Logger) *guard {
	return &guard{
		log: log, allow: allow,
		proofKey:    key.derive("conn proof v3", 32),
		oldProofKey: key.derive("conn proof v1", 32),
		v2ProofKey:  key.derive("conn proof v2", 32),
		linkKey:     key.derive("link v3", 32),
		localKey:    key.derive("local v1", 32),
	}
}

func (g *guard) proof() ([]byte, error) {
	p := make([]byte, proofNonceLen, proofLen)
	if _, err := rand.Read(p); err != nil {
		return nil, fmt.Errorf("make mesh key proof: %w", err)
	}
	return append(p, g.tag(p)...), nil
}

func (g *guard) tag(nonce []byte) []byte { return tagWith(g.proofKey, nonce, proofTagLen) }

func tagWith(key, nonce []byte, n int) []byte {
	mac := hmac.New(sha256.New, key)
	mac.Write(nonce)
	return mac.Sum(nil)[:n]
}

// linkStream is the cipher of the bytes one end sends: AES-256-CTR under a
// key of the mesh's link key and both ends' nonces, the sender's first.
// Each end's nonce is fresh, so no two connections share a key stream,
// even when a peer replays an old proof.
func (g *guard) linkStream(senderNonce, receiverNonce []byte) cipher.Stream {
	mac := hmac.New(sha256.New, g.linkKey)
	mac.Write(senderNonce)
	mac.Write(receiverNonce)
	block, err := aes.NewCipher(mac.Sum(nil))
	if err != nil {
		panic(fmt.Sprintf("link cipher: %v", err)) // a 32-byte key cannot fail
	}
	return cipher.NewCTR(block, make([]byte, aes.BlockSize))
}

// switchTag is what the sender of a link stream sends, encrypted, after a
// frame of length 0 to end its encryption.
func (g *guard) switchTag(senderNonce, receiverNonce []byte) []byte {
	mac := hmac.New(sha256.New, g.linkKey)
	mac.Write([]byte("switch"))
	mac.Write(senderNonce)
	mac.Write(receiverNonce)
	return mac.Sum(nil)[:switchTagLen]
}

// proofConn sends our proof when made and checks the peer's before the first
// Read or Write passes through.
type proofConn struct {
	manet.Conn
	g       *guard
	nonce   []byte // our proof's
	once    sync.Once
	err     error
	state   atomic.Int32
	secured atomic.Bool // the gater saw the peer authenticated
	refused atomic.Bool // the allowlist turned the peer away (already logged)

	// The link cipher, set by check once the proofs are good. The locks
	// keep each key stream in step with the bytes on the wire.
	rmu, wmu         sync.Mutex
	send, recv       cipher.Stream
	sendTag, recvTag []byte // the switch tags of each direction
	wbuf             []byte
	busy             *busyReader // nil: plain reads

	// Where each direction's link stream is: sent is set once our switch
	// tag is out, received once the peer's has been read; frameLeft is
	// what remains of the frame being read, rerr a broken stream's error.
	sent, received bool
	frameLeft      int
	rerr           error
}

const (
	// linkChunk bounds the encryption buffer of one Write.
	linkChunk = 32 << 10
	// linkFrame is the most bytes one frame of the link stream holds.
	linkFrame    = linkChunk - linkHeader
	linkHeader   = 2
	switchTagLen = 16
)

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
	return &proofConn{Conn: c, g: g, nonce: p[:proofNonceLen], busy: newBusyReader(c, &g.busyPoll)}, nil
}

func (c *proofConn) check() error {
	c.once.Do(func() {
		buf := make([]byte, proofLen)
		if _, err := io.ReadFull(c.Conn, buf); err != nil {
			c.state.Store(proofMissing)
			c.err = fmt.Errorf("read mesh key proof: %w", err)
			return
		}
		theirs := buf[:proofNonceLen]
		switch {
		case hmac.Equal(buf[proofNonceLen:], c.g.tag(theirs)) && !bytes.Equal(theirs, c.nonce):
			c.send = c.g.linkStream(c.nonce, theirs)
			c.recv = c.g.linkStream(theirs, c.nonce)
			c.sendTag = c.g.switchTag(c.nonce, theirs)
			c.recvTag = c.g.switchTag(theirs, c.nonce)
			c.state.Store(proofOK)
		case hmac.Equal(buf[8:], tagWith(c.g.oldProofKey, buf[:8], 12)), // v1: nonce[8] ‖ tag[12]
			hmac.Equal(buf[proofNonceLen:], tagWith(c.g.v2ProofKey, theirs, proofTagLen)):
			c.state.Store(proofOld)
			c.err = c.reason()
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
	case proofOld:
		return fmt.Errorf("%w: the peer runs an older meshnode, whose link protocol differs; upgrade it", ErrHandshake)
	}
	return nil
}

func (c *proofConn) Read(b []byte) (int, error) {
	if err := c.check(); err != nil {
		return 0, err
	}
	c.rmu.Lock()
	defer c.rmu.Unlock()
	if len(b) == 0 {
		return 0, nil
	}
	for !c.received {
		if c.rerr != nil {
			return 0, c.rerr
		}
		if c.frameLeft > 0 {
			n, err := c.rawRead(b[:min(len(b), c.frameLeft)])
			c.recv.XORKeyStream(b[:n], b[:n])
			c.frameLeft -= n
			return n, err
		}
		var hdr [linkHeader]byte
		if _, err := io.ReadFull(readerFunc(c.rawRead), hdr[:]); err != nil {
			return 0, err
		}
		c.recv.XORKeyStream(hdr[:], hdr[:])
		if c.frameLeft = int(hdr[0])<<8 | int(hdr[1]); c.frameLeft > 0 {
			continue
		}
		tag := make([]byte, switchTagLen)
		if _, err := io.ReadFull(readerFunc(c.rawRead), tag); err != nil {
			return 0, err
		}
		c.recv.XORKeyStream(tag, tag)
		if !hmac.Equal(tag, c.recvTag) {
			c.rerr = errors.New("link stream: bad switch tag from the peer")
			return 0, c.rerr
		}
		c.received = true
	}
	return c.rawRead(b)
}

// rawRead reads the socket, busy-polling when the host does.
func (c *proofConn) rawRead(b []byte) (int, error) {
	if c.busy != nil {
		return c.busy.Read(b)
	}
	return c.Conn.Read(b)
}

type readerFunc func([]byte) (int, error)

func (f readerFunc) Read(b []byte) (int, error) { return f(b) }

func (c *proofConn) Write(b []byte) (int, error) {
	if err := c.check(); err != nil {
		return 0, err
	}
	c.wmu.Lock()
	defer c.wmu.Unlock()
	if c.sent {
		return c.Conn.Write(b)
	}
	if c.wbuf == nil {
		c.wbuf = make([]byte, linkChunk)
	}
	if c.secured.Load() {
		// This end's handshake is done: end the link cipher, and send b
		// as it is in the same write.
		out := append(c.wbuf[:0], 0, 0)
		out = append(out, c.sendTag...)
		c.send.XORKeyStream(out, out)
		out = append(out, b...)
		c.sent = true
		n, err := c.Conn.Write(out)
		return max(0, n-linkHeader-switchTagLen), err
	}
	written := 0
	for len(b) > 0 {
		chunk := min(len(b), linkFrame)
		out := c.wbuf[:linkHeader+chunk]
		out[0], out[1] = byte(chunk>>8), byte(chunk)
		copy(out[linkHeader:], b[:chunk])
		c.send.XORKeyStream(out, out)
		n, err := c.Conn.Write(out)
		written += max(0, n-linkHeader)
		if err != nil {
			// The key stream ran ahead of the wire: the connection is
			// done, as it is after any failed write.
			return written, err
		}
		b = b[chunk:]
	}
	return written, nil
}

// Close ends a read that busy-polls at once, not at the end of its window.
func (c *proofConn) Close() error {
	if c.busy != nil {
		return c.busy.Close()
	}
	return c.Conn.Close()
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
		case s.pc.state.Load() == proofOld:
			s.log.Warn("refused connection: the peer runs an older meshnode, whose link protocol differs", remote)
		case s.pc.state.Load() == proofPlain:
			s.log.Warn("refused connection: peer has no mesh key", remote)
		default:
			s.log.Warn("refused connection: handshake failed (wrong or missing mesh key?)", remote, zap.Error(s.pc.reason()))
		}
	})
	s.ConnManagementScope.Done()
}
