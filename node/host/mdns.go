package host

import (
	"context"
	"fmt"
	"time"

	"github.com/libp2p/go-libp2p/core/network"
	"github.com/libp2p/go-libp2p/core/peer"
	"github.com/libp2p/go-libp2p/p2p/discovery/mdns"
	"go.uber.org/zap"
)

// mdnsConnectTimeout bounds one auto-connect to a discovered peer.
const mdnsConnectTimeout = 10 * time.Second

// ServiceName is the mDNS service a mesh announces: it carries the mesh's
// ServiceTag so nodes only ever try to connect to nodes of their own mesh
// (a connection to another mesh would fail at the mesh-key proof anyway, noisily).
func ServiceName(k MeshKey) string { return "_meshnode-" + k.ServiceTag() + "._udp" }

// discovery runs libp2p's mDNS service and auto-connects to what it finds.
type discovery struct {
	h     *Host
	svc   mdns.Service
	found chan peer.AddrInfo
}

func startDiscovery(h *Host) (*discovery, error) {
	d := &discovery{h: h, found: make(chan peer.AddrInfo, 32)}
	d.svc = mdns.NewMdnsService(h.h, ServiceName(h.key), d)
	if err := d.svc.Start(); err != nil {
		return nil, fmt.Errorf("start mDNS: %w", err)
	}
	return d, nil
}

// HandlePeerFound is called by the mDNS service on a goroutine of its own;
// the connect runs under the host's WaitGroup so Close waits for it.
func (d *discovery) HandlePeerFound(info peer.AddrInfo) {
	h := d.h
	if info.ID == h.ID() {
		return
	}
	h.spawn(func(ctx context.Context) {
		// mDNS repeats its answers; a peer already connected is old news.
		if h.h.Network().Connectedness(info.ID) == network.Connected {
			return
		}
		cctx, cancel := context.WithTimeout(ctx, mdnsConnectTimeout)
		err := h.h.Connect(cctx, info)
		cancel()
		if err != nil {
			h.log.Info("mDNS: connect to discovered peer failed", zap.Stringer("peer", info.ID), zap.Error(err))
			return
		}
		h.log.Info("mDNS: connected to discovered peer", zap.Stringer("peer", info.ID))
		select {
		case d.found <- info:
		default:
			h.log.Debug("mDNS: discovery channel full, dropping", zap.Stringer("peer", info.ID))
		}
	})
}

func (d *discovery) close() error { return d.svc.Close() }
