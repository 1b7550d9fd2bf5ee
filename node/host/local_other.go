//go:build !unix

package host

import (
	"context"
	"errors"
	"net"

	"github.com/libp2p/go-libp2p/core/peer"
)

var errNoLocal = errors.New("local sockets need a Unix system")

// LocalAddr names the peer at the other end of a local connection.
type LocalAddr struct{ Peer peer.ID }

func (a LocalAddr) Network() string { return "unix" }
func (a LocalAddr) String() string  { return a.Peer.String() }

// ErrLocalAuth: see local.go.
var ErrLocalAuth = errors.New("local peer failed authentication: wrong mesh key or not the expected node")

// LocalListener is not available here: ListenLocal always fails.
type LocalListener struct{}

func (h *Host) ListenLocal() (*LocalListener, error) { return nil, errNoLocal }
func (l *LocalListener) Path() string                { return "" }
func (l *LocalListener) Addr() net.Addr              { return nil }
func (l *LocalListener) Accept() (net.Conn, error)   { return nil, errNoLocal }
func (l *LocalListener) Close() error                { return nil }

func (h *Host) DialLocal(context.Context, string, peer.ID) (net.Conn, error) { return nil, errNoLocal }
