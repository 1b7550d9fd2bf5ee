package membership

import (
	"context"
	"errors"
	"fmt"
	"log"
	"slices"
	"sync"
	"sync/atomic"
	"time"

	"github.com/hashicorp/memberlist"
	"go.uber.org/zap"
)

// DefaultPort is the gossip port a node tries first (UDP and TCP).
const DefaultPort = 4002

// Failure detection, tuned for a LAN. A node probes one member every
// ProbeInterval (0.5 s) and waits ProbeTimeout (0.25 s) for the ack before
// asking others to probe indirectly; a member that fails the round becomes
// suspect, and dead after SuspicionMult×ProbeInterval×max(1, log10 n) (2 s
// below 10 nodes, 4 s at 100), or up to SuspicionMaxTimeoutMult (2) times that
// while the expected independent confirmations have not arrived. Gossip runs
// every 100 ms, so the verdict spreads in a few hundred ms. A dead node is
// thus announced about 2.5–4 s after it stops (the test asserts < 6 s).
const (
	probeInterval    = 500 * time.Millisecond
	probeTimeout     = 250 * time.Millisecond
	suspicionMult    = 4
	suspicionMaxMult = 2
	gossipInterval   = 100 * time.Millisecond
	// pushPullInterval is the full state sync that repairs anything gossip
	// missed (including a fetch of large metadata that was dropped).
	pushPullInterval = 15 * time.Second
	// tcpTimeout bounds push-pull and fetch exchanges; generous for a LAN, and
	// the longest Close can wait on an in-flight fetch.
	tcpTimeout = 3 * time.Second
	// deadReclaim lets a node that died come back under the same name (its
	// peer ID) on a new address, e.g. after a restart on a fallback port.
	deadReclaim = 10 * time.Second
	// reconnectFor: memberlist gossips to a dead member only for
	// GossipToTheDeadTime (30 s), so the two sides of a longer partition
	// would never find each other again. Like Serf, we keep asking failed
	// members to rejoin, every reconnectEvery for reconnectFor. Members
	// that left on purpose are not asked.
	reconnectFor = 24 * time.Hour
	// updateWait bounds how long UpdateMeta waits for the update to be handed
	// to gossip.
	updateWait = time.Second
	// DefaultEventBuffer is the Events channel capacity when unset.
	DefaultEventBuffer = 256
)

// State is a member's liveness.
type State string

// Member states. Suspicion is not reported: memberlist v0.7 does not expose
// it (the State of the Nodes it hands out is never updated, because its
// internal nodeState.State shadows Node.State), so a suspect member stays
// StateAlive until it is declared dead.
const (
	StateAlive State = "alive"
	StateDead  State = "dead"
	StateLeft  State = "left"
)

// Member is one node of the mesh as this node sees it.
type Member struct {
	Meta  Meta
	State State
	// Addr is the member's gossip address (host:port).
	Addr string
	// Complete is false while only the summary of a large Meta is known (its
	// Name, Addrs, Models, Serving … are missing or stale); an EventUpdate
	// follows when the full metadata arrives.
	Complete bool
}

// EventKind says what happened to a member.
type EventKind string

// Event kinds.
const (
	EventJoin   EventKind = "join"
	EventLeave  EventKind = "leave"  // left gracefully
	EventFailed EventKind = "failed" // declared dead by failure detection
	EventUpdate EventKind = "update" // metadata changed
)

// Event reports a change to another member (never to the local node).
type Event struct {
	Kind   EventKind
	Member Member
}

// Config configures New.
type Config struct {
	// Name is the node's unique name in the mesh: its libp2p peer ID.
	Name string
	// BindAddr and BindPort are where gossip listens (UDP and TCP). Port 0
	// picks a free port.
	BindAddr string
	BindPort int
	// PortFallback retries on an OS-chosen port when BindPort is taken.
	PortFallback bool
	// AdvertiseAddr and AdvertisePort are what other nodes use to reach this
	// one; empty and 0 mean: derived from the bind address (a private IP when
	// binding to 0.0.0.0) and the bound port.
	AdvertiseAddr string
	AdvertisePort int
	// SecretKey encrypts and authenticates all gossip (AES-256-GCM); derive it
	// from the mesh key. Required.
	SecretKey [32]byte
	// Logger receives memberlist's logs (as logger "memberlist") and ours.
	Logger *zap.Logger
	// Meta, when set, supplies the initial metadata; later changes go through
	// UpdateMeta.
	Meta func() Meta
	// EventBuffer is the capacity of Events; 0 means DefaultEventBuffer.
	EventBuffer int
}

// Membership is this node's view of, and voice in, the mesh's gossip.
type Membership struct {
	name string
	log  *zap.Logger
	ml   *memberlist.Memberlist
	// addr and port are read once after Create: memberlist's LocalNode returns
	// a pointer into its table that is unsafe to read later.
	addr string
	port int
	// fetches counts push-pull fetches of full metadata (tests, diagnostics).
	fetches atomic.Uint64

	mu      sync.Mutex
	local   Meta
	leaving bool // Leave was called: our metadata says goodbye
	members map[string]*entry

	evMu    sync.Mutex
	events  chan Event
	evDone  bool
	dropped uint64

	// lost are members that failed (not left), by name: their last gossip
	// address and when they failed. reconnectLoop asks them to rejoin.
	lost map[string]lostMember

	fetchMu   sync.Mutex
	fetching  map[string]bool // queued names, to coalesce requests
	fetchKick chan struct{}
	cancel    context.CancelFunc
	wg        sync.WaitGroup
	closeOnce sync.Once
}

type lostMember struct {
	addr  string
	since time.Time
}

// Variables, not constants, so that tests can shorten them.
var (
	reconnectEvery = 10 * time.Second // see reconnectFor
	// gossipToTheDead is memberlist's GossipToTheDeadTime (its default).
	gossipToTheDead = 30 * time.Second
)

// entry is what we hold about one member.
type entry struct {
	m Member
	// coldHash identifies the large fields we hold; wantHash those the member
	// last announced. They differ while a fetch is due.
	coldHash, wantHash uint64
	known              bool // memberlist announced the node (not only push-pull state)
	leaving            bool // its last metadata said goodbye
}

// New starts gossip on the configured address. It does not contact anyone:
// call Join.
func New(cfg Config) (*Membership, error) {
	if cfg.Name == "" {
		return nil, errors.New("start membership: name required")
	}
	if cfg.SecretKey == ([32]byte{}) {
		return nil, errors.New("start membership: secret key required")
	}
	zl := cfg.Logger
	if zl == nil {
		zl = zap.NewNop()
	}
	n := cfg.EventBuffer
	if n <= 0 {
		n = DefaultEventBuffer
	}
	ctx, cancel := context.WithCancel(context.Background())
	m := &Membership{
		name:      cfg.Name,
		log:       zl,
		members:   map[string]*entry{},
		lost:      map[string]lostMember{},
		events:    make(chan Event, n),
		fetching:  map[string]bool{},
		fetchKick: make(chan struct{}, 1),
		cancel:    cancel,
	}
	if cfg.Meta != nil {
		m.local = cloneMeta(cfg.Meta())
	}
	m.local.PeerID = cfg.Name
	m.local.Version = uint64(time.Now().UnixNano()) // grows across restarts

	mc := memberlist.DefaultLANConfig()
	mc.Name = cfg.Name
	mc.BindAddr = cfg.BindAddr
	if mc.BindAddr == "" {
		mc.BindAddr = "0.0.0.0"
	}
	mc.BindPort = cfg.BindPort
	mc.AdvertiseAddr = cfg.AdvertiseAddr
	mc.AdvertisePort = cfg.AdvertisePort
	key := cfg.SecretKey
	mc.SecretKey = key[:]
	mc.Delegate = (*delegate)(m)
	mc.Events = (*events)(m)
	mc.Logger = log.New(&zapWriter{log: zl.Named("memberlist")}, "", 0)
	mc.ProbeInterval = probeInterval
	mc.ProbeTimeout = probeTimeout
	mc.SuspicionMult = suspicionMult
	mc.SuspicionMaxTimeoutMult = suspicionMaxMult
	mc.GossipInterval = gossipInterval
	mc.PushPullInterval = pushPullInterval
	mc.TCPTimeout = tcpTimeout
	mc.DeadNodeReclaimTime = deadReclaim
	mc.GossipToTheDeadTime = gossipToTheDead

	ml, err := memberlist.Create(mc)
	if err != nil && cfg.PortFallback && cfg.BindPort != 0 {
		m.log.Warn("gossip port taken, using an OS-chosen port", zap.Int("wanted", cfg.BindPort), zap.Error(err))
		mc.BindPort = 0
		if mc.AdvertisePort == cfg.BindPort {
			mc.AdvertisePort = 0
		}
		ml, err = memberlist.Create(mc)
	}
	if err != nil {
		cancel()
		return nil, fmt.Errorf("start membership on %s:%d: %w", mc.BindAddr, cfg.BindPort, err)
	}
	m.ml = ml
	local := ml.LocalNode()
	m.addr, m.port = local.Address(), int(local.Port)
	m.wg.Add(2)
	go m.fetchLoop(ctx)
	go m.reconnectLoop(ctx)
	m.log.Info("membership started", zap.String("addr", m.LocalAddr()))
	return m, nil
}

// LocalAddr is the gossip address other nodes should join (host:port).
func (m *Membership) LocalAddr() string { return m.addr }

// Port is the advertised gossip port (the bound one unless AdvertisePort).
func (m *Membership) Port() int { return m.port }

// Join contacts the given gossip addresses (host:port) and returns how many
// answered. One is enough: the rest of the mesh follows through gossip.
func (m *Membership) Join(addrs []string) (int, error) {
	n, err := m.ml.Join(addrs)
	if err != nil {
		return n, fmt.Errorf("join mesh via %v: %w", addrs, err)
	}
	return n, nil
}

// UpdateMeta replaces the local metadata and gossips it at once. It returns
// when the update has been handed to gossip (normally within one gossip
// interval, at most about a second).
func (m *Membership) UpdateMeta(meta Meta) error {
	meta = cloneMeta(meta) // the caller may reuse its slices
	m.mu.Lock()
	meta.PeerID = m.name
	meta.Version = max(m.local.Version+1, uint64(time.Now().UnixNano()))
	m.local = meta
	m.mu.Unlock()
	if err := m.ml.UpdateNode(updateWait); err != nil {
		// Only a timeout: the update is queued and goes out with gossip.
		m.log.Debug("metadata update still queued", zap.Error(err))
	}
	return nil
}

// LocalMeta returns the metadata this node announces.
func (m *Membership) LocalMeta() Meta {
	m.mu.Lock()
	defer m.mu.Unlock()
	return cloneMeta(m.local)
}

// Members returns the live members, the local node included, sorted by name.
func (m *Membership) Members() []Member {
	m.mu.Lock()
	defer m.mu.Unlock()
	out := make([]Member, 0, len(m.members))
	for _, e := range m.members {
		if e.known && e.m.State == StateAlive {
			mm := e.m
			mm.Meta = cloneMeta(mm.Meta)
			if e.m.Meta.PeerID == m.name {
				mm.Meta = cloneMeta(m.local)
			}
			out = append(out, mm)
		}
	}
	slices.SortFunc(out, func(a, b Member) int {
		switch {
		case a.Meta.PeerID < b.Meta.PeerID:
			return -1
		case a.Meta.PeerID > b.Meta.PeerID:
			return 1
		}
		return 0
	})
	return out
}

// Events delivers changes to other members. The channel is bounded and never
// blocks gossip: when it is full the oldest event is dropped (Dropped counts
// them), so a slow reader sees the latest news and can rebuild the rest from
// Members. It is closed by Close.
func (m *Membership) Events() <-chan Event { return m.events }

// Dropped returns how many events were dropped because Events was full.
func (m *Membership) Dropped() uint64 {
	m.evMu.Lock()
	defer m.evMu.Unlock()
	return m.dropped
}

// Leave tells the mesh this node is going away and waits up to timeout in
// all for the messages to spread. Call Close afterwards.
func (m *Membership) Leave(timeout time.Duration) error {
	deadline := time.Now().Add(timeout)
	// Say goodbye in the metadata first, so others report a leave rather
	// than a failure (see hot.X).
	m.mu.Lock()
	m.leaving = true
	m.local.Version++
	m.mu.Unlock()
	if err := m.ml.UpdateNode(timeout / 2); err != nil {
		m.log.Debug("goodbye metadata still queued", zap.Error(err))
	}
	if err := m.ml.Leave(max(time.Until(deadline), time.Millisecond)); err != nil {
		return fmt.Errorf("leave mesh: %w", err)
	}
	return nil
}

// Close stops gossip without a goodbye (others will declare this node failed;
// call Leave first for a graceful exit), stops the fetch worker and closes
// Events.
func (m *Membership) Close() error {
	var err error
	m.closeOnce.Do(func() {
		if e := m.ml.Shutdown(); e != nil {
			err = fmt.Errorf("stop gossip: %w", e)
		}
		m.cancel()
		m.wg.Wait()
		m.evMu.Lock()
		m.evDone = true
		close(m.events)
		m.evMu.Unlock()
	})
	return err
}

// emit queues an event, dropping the oldest one when the buffer is full.
func (m *Membership) emit(kind EventKind, mem Member) {
	if mem.Meta.PeerID == m.name {
		return
	}
	mem.Meta = cloneMeta(mem.Meta)
	ev := Event{Kind: kind, Member: mem}
	m.evMu.Lock()
	defer m.evMu.Unlock()
	if m.evDone {
		return
	}
	for {
		select {
		case m.events <- ev:
			return
		default:
		}
		select {
		case <-m.events:
			m.dropped++
		default:
		}
	}
}

// requestFetch queues a fetch of name's full metadata; never blocks.
func (m *Membership) requestFetch(name string) {
	m.fetchMu.Lock()
	m.fetching[name] = true
	m.fetchMu.Unlock()
	select {
	case m.fetchKick <- struct{}{}:
	default:
	}
}

// fetchLoop pulls full metadata from members that announced a summary we do
// not match. A push-pull (memberlist's Join with that one address) carries
// the member's LocalState to our MergeRemoteState.
// reconnectLoop asks failed members to rejoin until they do, or for
// reconnectFor. A push-pull (memberlist's Join) with a member that is back
// merges the two sides' views.
func (m *Membership) reconnectLoop(ctx context.Context) {
	defer m.wg.Done()
	t := time.NewTicker(reconnectEvery)
	defer t.Stop()
	for {
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
		m.mu.Lock()
		var addrs []string
		for name, l := range m.lost {
			if time.Since(l.since) > reconnectFor {
				delete(m.lost, name)
				continue
			}
			addrs = append(addrs, l.addr)
		}
		leaving := m.leaving
		m.mu.Unlock()
		if leaving {
			return
		}
		for _, a := range addrs {
			if ctx.Err() != nil {
				return
			}
			if _, err := m.ml.Join([]string{a}); err == nil {
				m.log.Info("reached a failed member again", zap.String("addr", a))
			}
		}
	}
}

func (m *Membership) fetchLoop(ctx context.Context) {
	defer m.wg.Done()
	for {
		select {
		case <-ctx.Done():
			return
		case <-m.fetchKick:
		}
		m.fetchMu.Lock()
		names := make([]string, 0, len(m.fetching))
		for n := range m.fetching {
			names = append(names, n)
		}
		clear(m.fetching)
		m.fetchMu.Unlock()
		for _, name := range names {
			if ctx.Err() != nil {
				return
			}
			m.mu.Lock()
			e, ok := m.members[name]
			due := ok && e.known && e.m.State == StateAlive && e.coldHash != e.wantHash
			addr := ""
			if ok {
				addr = e.m.Addr
			}
			m.mu.Unlock()
			if !due {
				continue
			}
			m.fetches.Add(1)
			if _, err := m.ml.Join([]string{addr}); err != nil {
				// The periodic push-pull or the next announcement retries.
				m.log.Debug("fetch full metadata", zap.String("peer", name), zap.String("addr", addr), zap.Error(err))
			}
		}
	}
}

func cloneMeta(x Meta) Meta {
	x.Addrs = slices.Clone(x.Addrs)
	x.Models = slices.Clone(x.Models)
	x.Serving = slices.Clone(x.Serving)
	return x
}

// delegate implements memberlist.Delegate.
type delegate Membership

func (d *delegate) NodeMeta(limit int) []byte {
	m := (*Membership)(d)
	m.mu.Lock()
	local, bye := m.local, m.leaving
	m.mu.Unlock()
	b, err := encodeNodeMeta(local, bye, limit)
	if err != nil {
		m.log.Error("encode node metadata", zap.Error(err))
		return nil
	}
	return b
}

func (d *delegate) NotifyMsg([]byte) {}

func (d *delegate) GetBroadcasts(overhead, limit int) [][]byte { return nil }

func (d *delegate) LocalState(join bool) []byte {
	m := (*Membership)(d)
	m.mu.Lock()
	local := m.local
	m.mu.Unlock()
	b, err := encodeState(m.name, local)
	if err != nil {
		m.log.Error("encode local state", zap.Error(err))
		return nil
	}
	return b
}

func (d *delegate) MergeRemoteState(buf []byte, join bool) {
	m := (*Membership)(d)
	if len(buf) == 0 {
		return
	}
	name, meta, hash, err := decodeState(buf)
	if err != nil {
		m.log.Debug("ignoring remote state", zap.Error(err))
		return
	}
	if name == m.name {
		return
	}
	m.mu.Lock()
	e := m.members[name]
	if e == nil {
		e = &entry{m: Member{Meta: Meta{PeerID: name}}}
		m.members[name] = e
	}
	changed := false
	switch {
	case meta.Version >= e.m.Meta.Version:
		// Newer than anything gossiped: take it whole.
		changed = meta.Version > e.m.Meta.Version || e.coldHash != hash
		e.m.Meta = meta
		e.coldHash, e.wantHash = hash, hash
	case hash == e.wantHash && e.coldHash != hash:
		// Older counters, but exactly the large fields last announced.
		toCold(meta).apply(&e.m.Meta)
		e.coldHash = hash
		changed = true
	}
	e.m.Complete = e.coldHash == e.wantHash
	mem, emitIt := e.m, changed && e.known && e.m.State == StateAlive
	m.mu.Unlock()
	if emitIt {
		m.emit(EventUpdate, mem)
	}
}

// events implements memberlist.EventDelegate. memberlist calls it with its
// node table locked: it must not call back into memberlist, and must not
// block (emit never does).
type events Membership

func (v *events) NotifyJoin(n *memberlist.Node)   { (*Membership)(v).noteNode(n, EventJoin) }
func (v *events) NotifyUpdate(n *memberlist.Node) { (*Membership)(v).noteNode(n, EventUpdate) }

func (v *events) NotifyLeave(n *memberlist.Node) {
	m := (*Membership)(v)
	m.mu.Lock()
	e := m.members[n.Name]
	kind, st := EventFailed, StateDead
	if n.State == memberlist.StateLeft || (e != nil && e.leaving) {
		kind, st = EventLeave, StateLeft
	}
	var mem Member
	if e != nil {
		mem = e.m
		delete(m.members, n.Name)
	} else {
		mem.Meta.PeerID = n.Name
	}
	if kind == EventFailed && n.Name != m.name {
		m.lost[n.Name] = lostMember{addr: n.Address(), since: time.Now()}
	} else {
		delete(m.lost, n.Name)
	}
	m.mu.Unlock()
	mem.State, mem.Addr = st, n.Address()
	if kind == EventLeave {
		m.log.Info("member left", zap.String("peer", n.Name), zap.String("addr", mem.Addr))
	} else {
		m.log.Warn("member failed", zap.String("peer", n.Name), zap.String("addr", mem.Addr))
	}
	m.emit(kind, mem)
}

// noteNode records a node's address and metadata from memberlist.
func (m *Membership) noteNode(n *memberlist.Node, kind EventKind) {
	nm, err := decodeNodeMeta(n.Meta)
	if err != nil && n.Name != m.name {
		m.log.Warn("ignoring metadata of member", zap.String("peer", n.Name), zap.Error(err))
	}
	m.mu.Lock()
	e := m.members[n.Name]
	if e == nil {
		e = &entry{m: Member{Meta: Meta{PeerID: n.Name}}}
		m.members[n.Name] = e
	}
	e.known = true
	e.m.State = StateAlive
	e.m.Addr = n.Address()
	delete(m.lost, n.Name)
	fetch := false
	switch {
	case n.Name == m.name:
		// Ourselves: the local copy is authoritative and always complete.
		e.m.Meta = cloneMeta(m.local)
		e.coldHash, e.wantHash = 1, 1
	case err != nil:
	case nm.meta.Version < e.m.Meta.Version:
		// Older than what a push-pull already gave us.
	case nm.full:
		nm.meta.PeerID = n.Name
		e.m.Meta = nm.meta
		e.coldHash, e.wantHash = nm.coldHash, nm.coldHash
	default:
		hotOnly := toHot(nm.meta)
		hotOnly.apply(&e.m.Meta)
		e.wantHash = nm.coldHash
		fetch = e.coldHash != e.wantHash
	}
	if err == nil && n.Name != m.name {
		e.leaving = nm.bye
	}
	e.m.Complete = e.coldHash == e.wantHash
	mem, bye := e.m, e.leaving
	m.mu.Unlock()
	if bye {
		return // the leave event follows; the goodbye itself is no news
	}
	if fetch {
		m.requestFetch(n.Name)
	}
	if kind == EventJoin {
		m.log.Info("member joined", zap.String("peer", n.Name), zap.String("addr", mem.Addr))
	}
	m.emit(kind, mem)
}

// Compile-time checks.
var (
	_ memberlist.Delegate      = (*delegate)(nil)
	_ memberlist.EventDelegate = (*events)(nil)
)
