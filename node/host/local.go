//go:build unix

package host

import (
	"context"
	"crypto/hmac"
	"crypto/rand"
	"crypto/sha256"
	"encoding/hex"
	"errors"
	"fmt"
	"io"
	"net"
	"os"
	"path/filepath"
	"sync"
	"syscall"
	"time"

	"github.com/libp2p/go-libp2p/core/peer"
	"go.uber.org/zap"
)

// Local connections. Two nodes on one machine (one per GPU, or a test's
// stages) would otherwise carry every hop through TCP, the link cipher,
// TLS and yamux, then gRPC's HTTP/2: each 10-50 µs, 0.27-0.31 ms of a
// one-stream token on an H200 split in two. A Unix socket skips them all.
// Its guard is the operating system's (the socket lives in a directory
// only this user may enter) plus a handshake in which each end proves it
// holds the mesh key and names its peer ID, bound into the proof so that
// neither end can be swapped for another node of the mesh; what crosses
// the socket afterwards is not encrypted, since it never leaves the
// machine's kernel.

// LocalAddr names the peer at the other end of a local connection.
type LocalAddr struct{ Peer peer.ID }

func (a LocalAddr) Network() string { return "unix" }

// String is the peer ID, as a libp2p stream's remote address gives it.
func (a LocalAddr) String() string { return a.Peer.String() }

// localMagic starts both ends' first message; a version bump changes it.
var localMagic = []byte("MNL1")

const (
	localNonceLen = 32
	localMACLen   = 32
	// localHandshakeTimeout bounds a handshake: both ends are on this
	// machine, so anything slower is a stuck or hostile process.
	localHandshakeTimeout = 5 * time.Second
	localAccepted         = 0
	localRefused          = 1
)

// LocalListener accepts local connections that completed the handshake.
// Close stops it and removes its socket.
type LocalListener struct {
	h    *Host
	ln   *net.UnixListener
	path string

	conns  chan net.Conn
	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup
}

// localDir is where this user's nodes keep their sockets: a directory of
// the system's temporary one that only the user may enter, created if
// missing and refused if anyone else could (a socket's own permissions do
// not stop connects on every system). Short, since a socket path is at
// most 104 bytes on macOS.
func localDir() (string, error) {
	dir := filepath.Join(os.TempDir(), fmt.Sprintf("meshnode-%d", os.Getuid()))
	if len(dir) > 80 {
		dir = filepath.Join("/tmp", fmt.Sprintf("meshnode-%d", os.Getuid()))
	}
	if err := os.Mkdir(dir, 0o700); err != nil && !errors.Is(err, os.ErrExist) {
		return "", fmt.Errorf("create local socket directory: %w", err)
	}
	fi, err := os.Lstat(dir)
	if err != nil {
		return "", fmt.Errorf("local socket directory: %w", err)
	}
	st, ok := fi.Sys().(*syscall.Stat_t)
	switch {
	case !fi.IsDir():
		return "", fmt.Errorf("local socket directory %s is not a directory", dir)
	case !ok || int(st.Uid) != os.Getuid():
		return "", fmt.Errorf("local socket directory %s belongs to another user", dir)
	case fi.Mode().Perm()&0o077 != 0:
		return "", fmt.Errorf("local socket directory %s is open to other users (mode %v): remove it or chmod 700 it", dir, fi.Mode().Perm())
	}
	return dir, nil
}

// ListenLocal listens for local connections from other nodes of the mesh on
// this machine, on a Unix socket named after this node's peer ID.
func (h *Host) ListenLocal() (*LocalListener, error) {
	dir, err := localDir()
	if err != nil {
		return nil, err
	}
	sum := sha256.Sum256([]byte(h.ID()))
	path := filepath.Join(dir, hex.EncodeToString(sum[:8])+".sock")
	// A socket left by a node of this identity that did not close cleanly
	// is removed; one that answers belongs to a running node.
	if c, err := net.DialTimeout("unix", path, time.Second); err == nil {
		c.Close()
		return nil, fmt.Errorf("listen on local socket %s: another node with this identity (%s) is running", path, h.ID())
	}
	if err := os.Remove(path); err != nil && !errors.Is(err, os.ErrNotExist) {
		return nil, fmt.Errorf("remove stale local socket: %w", err)
	}
	ln, err := net.ListenUnix("unix", &net.UnixAddr{Name: path, Net: "unix"})
	if err != nil {
		return nil, fmt.Errorf("listen on local socket: %w", err)
	}
	ln.SetUnlinkOnClose(true)
	if err := os.Chmod(path, 0o600); err != nil {
		ln.Close()
		return nil, fmt.Errorf("listen on local socket: %w", err)
	}
	ctx, cancel := context.WithCancel(h.ctx)
	l := &LocalListener{h: h, ln: ln, path: path, conns: make(chan net.Conn), ctx: ctx, cancel: cancel}
	l.wg.Add(1)
	go l.acceptLoop()
	return l, nil
}

// Path is the socket's file name, which peers dial (DialLocal).
func (l *LocalListener) Path() string { return l.path }

// Addr is the socket's address.
func (l *LocalListener) Addr() net.Addr { return l.ln.Addr() }

// Accept returns the next connection whose peer proved the mesh key; its
// RemoteAddr is the peer's LocalAddr.
func (l *LocalListener) Accept() (net.Conn, error) {
	select {
	case c := <-l.conns:
		return c, nil
	case <-l.ctx.Done():
		return nil, net.ErrClosed
	}
}

// Close stops accepting, removes the socket and waits for handshakes in
// progress to end. Connections already accepted stay open.
func (l *LocalListener) Close() error {
	l.cancel()
	err := l.ln.Close()
	l.wg.Wait()
	if errors.Is(err, net.ErrClosed) {
		return nil
	}
	return err
}

func (l *LocalListener) acceptLoop() {
	defer l.wg.Done()
	for {
		c, err := l.ln.AcceptUnix()
		if err != nil {
			if l.ctx.Err() == nil {
				l.h.log.Warn("local socket stopped accepting", zap.Error(err))
				l.cancel()
			}
			return
		}
		l.wg.Add(1)
		go func() {
			defer l.wg.Done()
			stop := context.AfterFunc(l.ctx, func() { c.Close() })
			lc, err := l.h.serverHandshake(c)
			stop()
			if err != nil {
				l.h.log.Warn("refused local connection", zap.Error(err))
				c.Close()
				return
			}
			select {
			case l.conns <- lc:
			case <-l.ctx.Done():
				c.Close()
			}
		}()
	}
}

// DialLocal connects to the node with peer ID id through its local socket
// at path; the node must prove it holds the mesh key and is id.
func (h *Host) DialLocal(ctx context.Context, path string, id peer.ID) (net.Conn, error) {
	var d net.Dialer
	c, err := d.DialContext(ctx, "unix", path)
	if err != nil {
		return nil, fmt.Errorf("dial %s's local socket: %w", id, err)
	}
	stop := context.AfterFunc(ctx, func() { c.Close() })
	lc, err := h.clientHandshake(c.(*net.UnixConn), id)
	if !stop() {
		err = errors.Join(err, ctx.Err())
	}
	if err != nil {
		c.Close()
		return nil, fmt.Errorf("dial %s's local socket: %w", id, err)
	}
	return lc, nil
}

// The handshake, after which both ends know the other holds the mesh key
// and which peer it is:
//
//	client: magic, client nonce, len(client id), client id
//	server: magic, server nonce, MAC("s", ...)
//	client: MAC("c", ...)
//	server: one byte, accepted or refused (the allowlist)
//
// Each MAC is HMAC-SHA256 under a key derived from the mesh key, over both
// nonces and both peer IDs: a proof cannot be replayed on another
// connection nor taken for another pair of nodes.
func localMAC(key []byte, side string, cn, sn []byte, server, client peer.ID) []byte {
	m := hmac.New(sha256.New, key)
	m.Write([]byte(side))
	m.Write(cn)
	m.Write(sn)
	m.Write([]byte(server))
	m.Write([]byte{0})
	m.Write([]byte(client))
	return m.Sum(nil)
}

// ErrLocalAuth is wrapped by a local handshake whose peer did not prove
// the mesh key or is not the expected node.
var ErrLocalAuth = errors.New("local peer failed authentication: wrong mesh key or not the expected node")

func (h *Host) clientHandshake(c *net.UnixConn, want peer.ID) (net.Conn, error) {
	_ = c.SetDeadline(time.Now().Add(localHandshakeTimeout))
	self := []byte(h.ID())
	hello := make([]byte, 0, len(localMagic)+localNonceLen+1+len(self))
	hello = append(hello, localMagic...)
	cn := make([]byte, localNonceLen)
	if _, err := rand.Read(cn); err != nil {
		return nil, err
	}
	hello = append(append(hello, cn...), byte(len(self)))
	hello = append(hello, self...)
	if _, err := c.Write(hello); err != nil {
		return nil, fmt.Errorf("local handshake: %w", err)
	}
	reply := make([]byte, len(localMagic)+localNonceLen+localMACLen)
	if _, err := io.ReadFull(c, reply); err != nil {
		return nil, fmt.Errorf("local handshake: reading the node's proof: %w", err)
	}
	if !hmac.Equal(reply[:len(localMagic)], localMagic) {
		return nil, fmt.Errorf("local handshake: not a meshnode local socket, or another version")
	}
	sn := reply[len(localMagic) : len(localMagic)+localNonceLen]
	key := h.guard.localKey
	if !hmac.Equal(reply[len(localMagic)+localNonceLen:], localMAC(key, "s", cn, sn, want, h.ID())) {
		return nil, ErrLocalAuth
	}
	if _, err := c.Write(localMAC(key, "c", cn, sn, want, h.ID())); err != nil {
		return nil, fmt.Errorf("local handshake: %w", err)
	}
	var verdict [1]byte
	if _, err := io.ReadFull(c, verdict[:]); err != nil {
		return nil, fmt.Errorf("local handshake: the node closed the connection: %w", ErrLocalAuth)
	}
	if verdict[0] != localAccepted {
		return nil, errors.New("local handshake: the node refused this peer (not in its allowlist)")
	}
	_ = c.SetDeadline(time.Time{})
	return h.newLocalConn(c, want), nil
}

func (h *Host) serverHandshake(c *net.UnixConn) (net.Conn, error) {
	if err := checkPeerUser(c); err != nil {
		return nil, err
	}
	_ = c.SetDeadline(time.Now().Add(localHandshakeTimeout))
	head := make([]byte, len(localMagic)+localNonceLen+1)
	if _, err := io.ReadFull(c, head); err != nil {
		return nil, fmt.Errorf("local handshake: %w", err)
	}
	if !hmac.Equal(head[:len(localMagic)], localMagic) {
		return nil, errors.New("local handshake: not a meshnode peer, or another version")
	}
	cn := head[len(localMagic) : len(localMagic)+localNonceLen]
	rawID := make([]byte, head[len(head)-1])
	if _, err := io.ReadFull(c, rawID); err != nil {
		return nil, fmt.Errorf("local handshake: %w", err)
	}
	client, err := peer.IDFromBytes(rawID)
	if err != nil {
		return nil, fmt.Errorf("local handshake: bad peer ID: %w", err)
	}
	sn := make([]byte, localNonceLen)
	if _, err := rand.Read(sn); err != nil {
		return nil, err
	}
	key := h.guard.localKey
	reply := append(append(append([]byte{}, localMagic...), sn...), localMAC(key, "s", cn, sn, h.ID(), client)...)
	if _, err := c.Write(reply); err != nil {
		return nil, fmt.Errorf("local handshake: %w", err)
	}
	mac := make([]byte, localMACLen)
	if _, err := io.ReadFull(c, mac); err != nil {
		return nil, fmt.Errorf("local handshake with %s: %w", client, err)
	}
	if !hmac.Equal(mac, localMAC(key, "c", cn, sn, h.ID(), client)) {
		return nil, fmt.Errorf("local handshake: %w", ErrLocalAuth)
	}
	if h.guard.allow != nil && !h.guard.allow(client) {
		_, _ = c.Write([]byte{localRefused})
		return nil, fmt.Errorf("local peer %s is not in the allowlist", client)
	}
	if _, err := c.Write([]byte{localAccepted}); err != nil {
		return nil, fmt.Errorf("local handshake with %s: %w", client, err)
	}
	_ = c.SetDeadline(time.Time{})
	return h.newLocalConn(c, client), nil
}

// localConn is an authenticated local connection; its reads busy-poll as
// the host's TCP connections do (Config.BusyPoll).
type localConn struct {
	*net.UnixConn
	remote LocalAddr
	busy   *busyReader
}

func (h *Host) newLocalConn(c *net.UnixConn, remote peer.ID) *localConn {
	return &localConn{UnixConn: c, remote: LocalAddr{remote}, busy: newBusyReader(c, &h.guard.busyPoll)}
}

func (c *localConn) Read(b []byte) (int, error) {
	if c.busy != nil {
		return c.busy.Read(b)
	}
	return c.UnixConn.Read(b)
}

func (c *localConn) Close() error {
	if c.busy != nil {
		return c.busy.Close()
	}
	return c.UnixConn.Close()
}

func (c *localConn) RemoteAddr() net.Addr { return c.remote }

// BusyPollWindow is how long a read of the connection polls for data
// after the last (Config.BusyPoll, 0: off); a stream's ring over the
// connection polls its memory as long (package pipeline).
func (c *localConn) BusyPollWindow() time.Duration {
	if c.busy == nil {
		return 0
	}
	return time.Duration(c.busy.window.Load())
}
