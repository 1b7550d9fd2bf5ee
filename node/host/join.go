package host

import (
	"context"
	"encoding/json"
	"fmt"
	"io"
	"net"
	"slices"
	"strconv"
	"time"

	"github.com/libp2p/go-libp2p/core/network"
	"github.com/libp2p/go-libp2p/core/peer"
	"github.com/libp2p/go-libp2p/core/protocol"
	manet "github.com/multiformats/go-multiaddr/net"
	"go.uber.org/zap"
)

// JoinProtocol answers "where do you gossip?", so a join command needs to
// carry only the libp2p address: the joiner connects, asks, and joins the
// membership at the returned host:port addresses.
const JoinProtocol protocol.ID = "/meshnode/join/1"

const (
	joinTimeout  = 10 * time.Second
	joinMaxBytes = 4 << 10
)

type joinInfo struct {
	Gossip []string `json:"gossip"`
}

// ServeGossipAddrs answers JoinProtocol. The first address returned is the IP
// the asking peer reached us on (it can reach that one) with gossipPort; the
// addresses from advertised (may be nil) follow.
func (h *Host) ServeGossipAddrs(gossipPort int, advertised func() []string) {
	h.h.SetStreamHandler(JoinProtocol, func(s network.Stream) {
		defer s.Close()
		_ = s.SetDeadline(time.Now().Add(joinTimeout))
		var addrs []string
		if ip, err := manet.ToIP(s.Conn().LocalMultiaddr()); err == nil && !ip.IsUnspecified() {
			addrs = append(addrs, net.JoinHostPort(ip.String(), strconv.Itoa(gossipPort)))
		}
		if advertised != nil {
			for _, a := range advertised() {
				if !slices.Contains(addrs, a) {
					addrs = append(addrs, a)
				}
			}
		}
		if err := json.NewEncoder(s).Encode(joinInfo{Gossip: addrs}); err != nil {
			h.log.Debug("answer join request", zap.Stringer("peer", s.Conn().RemotePeer()), zap.Error(err))
			_ = s.Reset()
		}
	})
}

// FetchGossipAddrs asks peer id (connected or in the peerstore) for its gossip
// addresses over JoinProtocol.
func (h *Host) FetchGossipAddrs(ctx context.Context, id peer.ID) ([]string, error) {
	ctx, cancel := context.WithTimeout(ctx, joinTimeout)
	defer cancel()
	s, err := h.h.NewStream(ctx, id, JoinProtocol)
	if err != nil {
		return nil, fmt.Errorf("ask %s for gossip address: %w", id, err)
	}
	defer s.Close()
	if dl, ok := ctx.Deadline(); ok {
		_ = s.SetDeadline(dl)
	}
	_ = s.CloseWrite() // the request is the stream itself
	raw, err := io.ReadAll(io.LimitReader(s, joinMaxBytes+1))
	if err != nil {
		return nil, fmt.Errorf("read gossip address from %s: %w", id, err)
	}
	if len(raw) > joinMaxBytes {
		return nil, fmt.Errorf("read gossip address from %s: answer over %d bytes", id, joinMaxBytes)
	}
	var info joinInfo
	if err := json.Unmarshal(raw, &info); err != nil {
		return nil, fmt.Errorf("decode gossip address from %s: %w", id, err)
	}
	out := info.Gossip[:0]
	for _, a := range info.Gossip {
		if _, _, err := net.SplitHostPort(a); err == nil {
			out = append(out, a)
		}
	}
	if len(out) == 0 {
		return nil, fmt.Errorf("ask %s for gossip address: no usable address in answer", id)
	}
	return out, nil
}
