package host

import (
	"context"
	"errors"
	"fmt"
	"net"
	"slices"
	"strings"
	"sync"
	"time"

	"github.com/libp2p/go-libp2p"
	"github.com/libp2p/go-libp2p/core/crypto"
	lphost "github.com/libp2p/go-libp2p/core/host"
	"github.com/libp2p/go-libp2p/core/network"
	"github.com/libp2p/go-libp2p/core/peer"
	"github.com/libp2p/go-libp2p/core/protocol"
	"github.com/libp2p/go-libp2p/core/transport"
	"github.com/libp2p/go-libp2p/p2p/net/gostream"
	"github.com/libp2p/go-libp2p/p2p/transport/tcp"
	ma "github.com/multiformats/go-multiaddr"
	manet "github.com/multiformats/go-multiaddr/net"
	"go.uber.org/zap"
)

// DefaultPort is the libp2p TCP port a node tries first.
const DefaultPort = 4001

// DefaultListen is used when Config.Listen is empty. A taken port falls back
// to an OS-chosen one (only for these defaults: explicit addresses are the
// operator's intent and fail loudly).
var DefaultListen = []string{"/ip4/0.0.0.0/tcp/4001"}

// Config configures New.
type Config struct {
	// DataDir holds peer.key (the identity). Required unless Key is set.
	DataDir string
	// Key overrides the identity from DataDir (tests, embedding).
	Key crypto.PrivKey
	// Listen are TCP multiaddrs to listen on; empty means DefaultListen.
	Listen []string
	// MeshKey is the mesh's shared secret. Required: a node is always in a
	// private mesh.
	MeshKey MeshKey
	// Logger receives the host's logs; nil discards them.
	Logger *zap.Logger
	// MDNS turns on LAN discovery of nodes of the same mesh.
	MDNS bool
	// Allow, when set, admits only the peers it returns true for.
	Allow func(peer.ID) bool
	// BusyPoll, when positive, keeps a connection's reader spinning for
	// this long after each message instead of sleeping (see busypoll.go):
	// lower hop latency for a CPU per busy connection.
	BusyPoll time.Duration
}

// Host is a node's libp2p endpoint: identity, listeners, private-mesh
// enforcement, and the streams that other packages (gRPC, join) run over.
type Host struct {
	h     lphost.Host
	key   MeshKey
	log   *zap.Logger
	guard *guard

	// ctx is canceled by Close; it bounds work started on behalf of the host
	// (mDNS auto-connects), which wg tracks.
	ctx    context.Context
	cancel context.CancelFunc
	wg     sync.WaitGroup

	mu     sync.Mutex
	closed bool
	mdns   *discovery
}

// New starts a host; it lives until Close (ctx only aborts the start and
// passes its values on). Only TCP is enabled: the mesh key's proof and link
// cipher (guard.go, in place of libp2p's private-network PSK) wrap the TCP
// transport's upgrader, and libp2p's QUIC (and WebRTC, WebTransport)
// transports take no such wrapper (they refuse a PSK too: "QUIC doesn't
// support private networks yet"); a mesh that any key-less peer can
// handshake with is worse than one without QUIC. Security is libp2p's
// default Noise and TLS, inside the link cipher.
func New(ctx context.Context, cfg Config) (*Host, error) {
	if err := ctx.Err(); err != nil {
		return nil, fmt.Errorf("start host: %w", err)
	}
	if cfg.MeshKey.IsZero() {
		return nil, errors.New("start host: mesh key required")
	}
	log := cfg.Logger
	if log == nil {
		log = zap.NewNop()
	}
	key := cfg.Key
	if key == nil {
		if cfg.DataDir == "" {
			return nil, errors.New("start host: data dir or key required")
		}
		var err error
		if key, err = LoadOrCreateKey(cfg.DataDir); err != nil {
			return nil, fmt.Errorf("start host: %w", err)
		}
	}
	listen, fallback := cfg.Listen, false
	if len(listen) == 0 {
		listen, fallback = DefaultListen, true
	}
	addrs := make([]ma.Multiaddr, 0, len(listen))
	for _, s := range listen {
		a, err := ma.NewMultiaddr(s)
		if err != nil {
			return nil, fmt.Errorf("start host: listen address %q: %w", s, err)
		}
		if _, err := a.ValueForProtocol(ma.P_TCP); err != nil {
			return nil, fmt.Errorf("start host: listen address %s: only TCP works in a private mesh (the mesh key guards TCP connections; libp2p's QUIC cannot carry it)", a)
		}
		addrs = append(addrs, a)
	}

	g := newGuard(cfg.MeshKey, cfg.Allow, log)
	g.busyPoll.Store(int64(cfg.BusyPoll))
	// Reuseport off: with SO_REUSEPORT a second node on the same machine would
	// silently share port 4001 (the kernel splits connections between them)
	// instead of falling back to a free port.
	newTCP := func(up transport.Upgrader, rcmgr network.ResourceManager) (*tcp.TcpTransport, error) {
		return tcp.NewTCPTransport(&guardUpgrader{Upgrader: up, g: g}, rcmgr, nil, tcp.DisableReuseport())
	}
	h, err := libp2p.New(
		libp2p.Identity(key),
		libp2p.Transport(newTCP),
		libp2p.ConnectionGater(gater{g: g}),
		libp2p.NoListenAddrs, // listen below, one address at a time, to fall back per address
		libp2p.DisableRelay(),
		libp2p.DisableMetrics(), // avoid the global Prometheus registry; admin owns metrics
	)
	if err != nil {
		return nil, fmt.Errorf("start libp2p host: %w", err)
	}
	for _, a := range addrs {
		if err := listenOne(h, a, fallback, log); err != nil {
			h.Close()
			return nil, fmt.Errorf("start host: %w", err)
		}
	}
	if err := ctx.Err(); err != nil {
		h.Close()
		return nil, fmt.Errorf("start host: %w", err)
	}

	hctx, cancel := context.WithCancel(context.WithoutCancel(ctx))
	host := &Host{h: h, key: cfg.MeshKey, log: log, ctx: hctx, cancel: cancel, guard: g}
	if cfg.MDNS {
		d, err := startDiscovery(host)
		if err != nil {
			host.Close()
			return nil, fmt.Errorf("start host: %w", err)
		}
		host.mdns = d
	}
	log.Info("libp2p host started", zap.Stringer("peer", h.ID()), zap.Stringers("addrs", host.Addrs()))
	return host, nil
}

// SetBusyPoll sets how long every connection's reader keeps polling its
// socket after a message before it sleeps (Config.BusyPoll); 0 turns it
// off. It applies to connections open now and later.
func (h *Host) SetBusyPoll(d time.Duration) { h.guard.busyPoll.Store(int64(max(d, 0))) }

func listenOne(h lphost.Host, a ma.Multiaddr, fallback bool, log *zap.Logger) error {
	err := h.Network().Listen(a)
	if err == nil {
		return nil
	}
	if !fallback {
		return fmt.Errorf("listen on %s: %w", a, err)
	}
	// Port 0 asks the OS for any free port.
	anyPort, perr := ma.NewMultiaddr("/tcp/0")
	if perr != nil {
		return fmt.Errorf("listen on %s: %w", a, perr)
	}
	ip, _ := ma.SplitFirst(a)
	if ip == nil {
		return fmt.Errorf("listen on %s: %w", a, err)
	}
	alt := ma.Multiaddr{*ip}.Encapsulate(anyPort)
	if err2 := h.Network().Listen(alt); err2 != nil {
		return fmt.Errorf("listen on %s (%v) and fallback %s: %w", a, err, alt, err2)
	}
	log.Warn("port taken, listening on an OS-chosen port", zap.Stringer("wanted", a), zap.Error(err))
	return nil
}

// ID is the node's peer ID, its name everywhere in the mesh.
func (h *Host) ID() peer.ID { return h.h.ID() }

// LibP2P exposes the underlying host for packages that need raw streams.
func (h *Host) LibP2P() lphost.Host { return h.h }

// MeshKey returns the mesh key the host was started with.
func (h *Host) MeshKey() MeshKey { return h.key }

// Addrs returns the host's dialable addresses with /p2p/<id>, LAN addresses
// first, then loopback. Wildcard listeners are expanded per interface.
func (h *Host) Addrs() []ma.Multiaddr {
	ifaddrs, err := h.h.Network().InterfaceListenAddresses()
	if err != nil {
		ifaddrs = h.h.Addrs()
	}
	p2p, err := ma.NewComponent("p2p", h.h.ID().String())
	if err != nil {
		return nil
	}
	out := make([]ma.Multiaddr, 0, len(ifaddrs))
	for _, a := range ifaddrs {
		if manet.IsIP6LinkLocal(a) {
			continue // needs a zone to dial; useless in a join command
		}
		out = append(out, a.Encapsulate(p2p.Multiaddr()))
	}
	slices.SortStableFunc(out, func(a, b ma.Multiaddr) int {
		return addrRank(a) - addrRank(b)
	})
	return out
}

// addrRank orders addresses by how useful they are to another machine.
func addrRank(a ma.Multiaddr) int {
	switch {
	case manet.IsIPLoopback(a):
		return 3
	case strings.HasPrefix(a.String(), "/ip6/"):
		return 1
	case manet.IsPrivateAddr(a):
		return 0
	default:
		return 2 // public IPv4: may be behind NAT, prefer the LAN address
	}
}

// JoinCommand is the command another machine runs to join this mesh. It
// contains the mesh key: show it only to the operator.
func (h *Host) JoinCommand() string {
	addrs := h.Addrs()
	target := "/p2p/" + h.ID().String()
	if len(addrs) > 0 {
		target = addrs[0].String()
	}
	return fmt.Sprintf("meshnode join %s --mesh-key %s", target, h.key)
}

// Connect dials a full multiaddr ending in /p2p/<id> and returns that peer's
// ID. A refusal comes back wrapping ErrMeshKey (the peer has another mesh key
// or none) or ErrHandshake (it broke off before authentication).
func (h *Host) Connect(ctx context.Context, addr string) (peer.ID, error) {
	info, err := peer.AddrInfoFromString(addr)
	if err != nil {
		return "", fmt.Errorf("connect %s: %w", addr, err)
	}
	if err := h.h.Connect(ctx, *info); err != nil {
		switch {
		case errors.Is(err, ErrMeshKey):
			h.log.Warn("peer refused: wrong or missing mesh key", zap.String("addr", addr), zap.Stringer("peer", info.ID))
		case errors.Is(err, ErrHandshake):
			h.log.Warn("peer refused: handshake failed (wrong or missing mesh key?)", zap.String("addr", addr), zap.Stringer("peer", info.ID))
		}
		return "", fmt.Errorf("connect %s: %w", addr, err)
	}
	return info.ID, nil
}

// Listen accepts streams of protocol p as net.Conns (e.g. for a gRPC server).
// Closing the listener removes the protocol handler.
func (h *Host) Listen(p protocol.ID) net.Listener {
	l, err := gostream.Listen(h.h, p)
	if err != nil {
		// gostream.Listen fails only on a bad ListenerOption; we pass none.
		panic(fmt.Sprintf("listen on %s: %v", p, err))
	}
	return l
}

// Dial opens a stream of protocol p to peer id as a net.Conn.
func (h *Host) Dial(ctx context.Context, id peer.ID, p protocol.ID) (net.Conn, error) {
	c, err := gostream.Dial(ctx, h.h, id, p)
	if err != nil {
		return nil, fmt.Errorf("open %s stream to %s: %w", p, id, err)
	}
	return c, nil
}

// GRPCDialer returns a dialer for grpc.WithContextDialer whose address is a
// peer ID. Use it with a "passthrough:///<peer-id>" target so gRPC hands the
// ID through unresolved.
func (h *Host) GRPCDialer(p protocol.ID) func(ctx context.Context, addr string) (net.Conn, error) {
	return func(ctx context.Context, addr string) (net.Conn, error) {
		id, err := peer.Decode(addr)
		if err != nil {
			return nil, fmt.Errorf("grpc dial %q: not a peer ID: %w", addr, err)
		}
		return h.Dial(ctx, id, p)
	}
}

// Peers returns the peers with an open connection, sorted.
func (h *Host) Peers() []peer.ID {
	ps := h.h.Network().Peers()
	slices.Sort(ps)
	return ps
}

// Discovered returns the channel of peers found through mDNS (nil without
// MDNS). It is buffered; when the reader falls behind, discoveries are
// dropped (the peer is still connected, and mDNS repeats itself).
func (h *Host) Discovered() <-chan peer.AddrInfo {
	if h.mdns == nil {
		return nil
	}
	return h.mdns.found
}

// Close stops discovery and the host and waits for work it started.
func (h *Host) Close() error {
	h.mu.Lock()
	if h.closed {
		h.mu.Unlock()
		return nil
	}
	h.closed = true
	h.mu.Unlock()

	h.cancel()
	var errs []error
	if h.mdns != nil {
		if err := h.mdns.close(); err != nil {
			errs = append(errs, fmt.Errorf("stop mDNS: %w", err))
		}
	}
	h.wg.Wait()
	if err := h.h.Close(); err != nil {
		errs = append(errs, fmt.Errorf("close libp2p host: %w", err))
	}
	return errors.Join(errs...)
}

// spawn runs f under the host's WaitGroup unless the host is closing.
func (h *Host) spawn(f func(ctx context.Context)) bool {
	h.mu.Lock()
	defer h.mu.Unlock()
	if h.closed {
		return false
	}
	h.wg.Add(1)
	go func() {
		defer h.wg.Done()
		f(h.ctx)
	}()
	return true
}
