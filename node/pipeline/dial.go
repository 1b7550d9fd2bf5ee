package pipeline

import (
	"context"
	"errors"
	"fmt"
	"sync"

	"google.golang.org/grpc"

	"github.com/meshnode/meshnode/node/wire"
)

// Dialer returns a client connection to a peer: a host:port for plain gRPC
// over TCP (Conns), a peer id for the node's libp2p transport. The
// connection stays the Dialer's: pipelines and servers open streams on it
// but never close it, so one connection may serve many pipelines.
type Dialer func(ctx context.Context, peer string) (grpc.ClientConnInterface, error)

// Conns dials peers as gRPC targets and keeps one connection per peer
// until Close.
type Conns struct {
	opts []grpc.DialOption

	mu     sync.Mutex
	conns  map[string]*grpc.ClientConn
	closed bool
}

// NewConns returns a connection cache that dials with wire.DialOptions
// (raised message limits) followed by opts, which must choose the
// transport credentials.
func NewConns(opts ...grpc.DialOption) *Conns {
	return &Conns{opts: append(wire.DialOptions(), opts...), conns: map[string]*grpc.ClientConn{}}
}

var errConnsClosed = errors.New("pipeline: connections closed")

// Dial is a Dialer.
func (c *Conns) Dial(_ context.Context, peer string) (grpc.ClientConnInterface, error) {
	c.mu.Lock()
	defer c.mu.Unlock()
	if c.closed {
		return nil, errConnsClosed
	}
	if cc, ok := c.conns[peer]; ok {
		return cc, nil
	}
	// NewClient connects lazily, so holding the lock costs nothing.
	cc, err := grpc.NewClient(peer, c.opts...)
	if err != nil {
		return nil, fmt.Errorf("dialing %s: %w", peer, err)
	}
	c.conns[peer] = cc
	return cc, nil
}

// Close closes every connection; streams on them fail.
func (c *Conns) Close() error {
	c.mu.Lock()
	defer c.mu.Unlock()
	c.closed = true
	var errs []error
	for peer, cc := range c.conns {
		if err := cc.Close(); err != nil {
			errs = append(errs, fmt.Errorf("closing connection to %s: %w", peer, err))
		}
	}
	c.conns = nil
	return errors.Join(errs...)
}
