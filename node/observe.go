package node

import (
	"context"
	"encoding/json"
	"errors"
	"io"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/libp2p/go-libp2p/core/network"
	"github.com/libp2p/go-libp2p/core/peer"
	"github.com/libp2p/go-libp2p/core/protocol"
	"github.com/libp2p/go-libp2p/p2p/protocol/ping"
	"go.uber.org/zap"
	"google.golang.org/grpc/stats"

	"github.com/meshnode/meshnode/ggufstage"
	"github.com/meshnode/meshnode/node/admin"
	"github.com/meshnode/meshnode/node/membership"
	"github.com/meshnode/meshnode/node/pipeline"
	"github.com/meshnode/meshnode/node/scheduler"
	"github.com/meshnode/meshnode/stage"
)

// StatsProtocol carries a node's live numbers (admin.NodeStats, JSON) to
// the other members, so that every node can show the whole mesh.
const StatsProtocol protocol.ID = "/meshnode/stats/1"

const (
	observeEvery   = time.Second      // how often peers are pinged and asked for stats
	statsFresh     = 10 * time.Second // older peer stats are not shown
	suspectAfter   = 2                // rounds without an answer before a live member is suspect
	departedFor    = time.Hour        // how long dead and left members stay listed
	maxStatsBytes  = 1 << 20
	rateWindow     = 10 * time.Second
	rttSmoothing   = 0.3 // weight of a new RTT sample
	peerAskTimeout = 2 * time.Second
)

// observer measures the node for status and metrics: requests, its stage,
// round trips to peers, stage traffic, and what the other nodes report.
type observer struct {
	m       *mesh
	metrics *admin.Metrics
	start   time.Time

	gen  *admin.Window // tokens generated for requests entering here
	ttft *admin.Window // ms
	step *admin.Window // ms per pipeline step

	sched atomic.Pointer[scheduler.Scheduler]

	mu       sync.Mutex
	rtt      map[string]float64 // ms, smoothed
	fails    map[string]int     // rounds a peer did not answer
	peers    map[string]peerStats
	departed map[string]departedMember
	sent     map[string]uint64
	recv     map[string]uint64
}

// peerStats are a peer's numbers and when they arrived (by this node's
// clock: the peer's may differ).
type peerStats struct {
	stats admin.NodeStats
	at    time.Time
}

type departedMember struct {
	meta  membership.Meta
	state string
	since time.Time
}

func newObserver(m *mesh) *observer {
	o := &observer{
		m: m, start: time.Now(),
		gen: admin.NewWindow(rateWindow), ttft: admin.NewWindow(60 * time.Second), step: admin.NewWindow(rateWindow),
		rtt: map[string]float64{}, fails: map[string]int{}, peers: map[string]peerStats{},
		departed: map[string]departedMember{}, sent: map[string]uint64{}, recv: map[string]uint64{},
	}
	o.metrics = admin.NewMetrics(m.gauges)
	return o
}

// onEvent feeds a mesh event to the metrics.
func (o *observer) onEvent(kind, text string) {
	o.metrics.Event(kind)
	switch kind {
	case "plan":
		if strings.HasPrefix(text, "no placement") {
			o.metrics.Error("no_placement")
		} else {
			o.metrics.Replan()
		}
	case "bad-peer":
		o.metrics.Error("bad_peer")
	case "error":
		switch {
		case strings.HasPrefix(text, "loading layers"):
			o.metrics.Error("stage_load")
		case strings.HasPrefix(text, "building the pipeline"):
			o.metrics.Error("pipeline")
		default:
			o.metrics.Error("mesh")
		}
	}
}

// onMember remembers members that died or left, and forgets them when
// they come back.
func (o *observer) onMember(ev membership.Event) {
	o.mu.Lock()
	defer o.mu.Unlock()
	id := ev.Member.Meta.PeerID
	switch ev.Kind {
	case membership.EventJoin:
		delete(o.departed, id)
	case membership.EventLeave, membership.EventFailed:
		st := admin.StateDead
		if ev.Kind == membership.EventLeave {
			st = admin.StateLeft
		}
		o.departed[id] = departedMember{meta: ev.Member.Meta, state: st, since: time.Now()}
		delete(o.peers, id)
		delete(o.rtt, id)
		delete(o.fails, id)
	}
}

// request tracks one generation for the metrics.
type request struct {
	o      *observer
	start  time.Time
	prompt int
	first  time.Duration
}

func (o *observer) newRequest(prompt int) *request {
	return &request{o: o, start: time.Now(), prompt: prompt}
}

// token notes an event of the generation; the first one is its first token.
func (r *request) token() {
	if r.first == 0 {
		r.first = max(time.Since(r.start), time.Nanosecond)
	}
}

// done records the generation's end.
func (r *request) done(outcome string, completion int) {
	if completion > 0 && r.first > 0 {
		r.o.ttft.Add(float64(r.first) / 1e6)
	}
	r.o.metrics.Request(outcome, r.prompt, completion, r.first, time.Since(r.start))
}

// stepDone records one forward pass of this node's requests.
func (o *observer) stepDone(d time.Duration, tokens int) {
	o.metrics.Step(d)
	o.step.Add(float64(d) / 1e6)
	o.gen.Add(float64(tokens))
}

// observedEngine times a stage's forward passes and follows its KV use.
type observedEngine struct {
	stage.Engine
	o       *observer
	label   string
	mem     stage.Memory
	reserve int // positions the KV cache holds

	rate     *admin.Window // output rows
	compute  *admin.Window // ms per pass
	forwards atomic.Uint64

	mu     sync.Mutex
	pos    map[stage.SeqID]int32
	phases ggufstage.Phases // the engine's totals at the last pass
}

// phased is an engine that says where its passes spend their time.
type phased interface{ Phases() ggufstage.Phases }

// fusing is an engine that may decode through fused kernels (ggufstage's).
type fusing interface{ Fused() (on bool, why string) }

func (o *observer) wrapEngine(e stage.Engine, mem stage.Memory) *observedEngine {
	info := e.Info()
	return &observedEngine{
		Engine: e, o: o, label: strings.Trim(strings.ReplaceAll(info.Range(), ",", "-"), "[)"), mem: mem,
		reserve: info.Context * max(info.MaxSeqs, 1),
		rate:    admin.NewWindow(rateWindow), compute: admin.NewWindow(rateWindow),
		pos: map[stage.SeqID]int32{},
	}
}

func (e *observedEngine) Forward(ctx context.Context, b *stage.Batch) (*stage.Output, error) {
	start := time.Now()
	out, err := e.Engine.Forward(ctx, b)
	d := time.Since(start)
	if err != nil {
		return out, err
	}
	e.passDone(b, d)
	return out, nil
}

// passDone records a pass of b that took d.
func (e *observedEngine) passDone(b *stage.Batch, d time.Duration) {
	e.forwards.Add(1)
	e.o.metrics.StageForward(e.label, d, b.Rows(), len(b.Outputs))
	e.rate.Add(float64(len(b.Outputs)))
	e.compute.Add(float64(d) / 1e6)
	e.mu.Lock()
	for r, s := range b.Seqs {
		if p := b.Pos[r] + 1; p > e.pos[s] {
			e.pos[s] = p
		}
	}
	if pe, ok := e.Engine.(phased); ok {
		now := pe.Phases()
		last := e.phases
		e.phases = now
		e.o.metrics.StagePhases(e.label, now.Ahead-last.Ahead, now.Allocated-last.Allocated,
			now.Graph-last.Graph, now.Alloc-last.Alloc, now.Launch-last.Launch, now.Wait-last.Wait)
	}
	e.mu.Unlock()
}

func (e *observedEngine) Open(seq stage.SeqID) error {
	if err := e.Engine.Open(seq); err != nil {
		return err
	}
	e.mu.Lock()
	e.pos[seq] = 0
	e.mu.Unlock()
	return nil
}

func (e *observedEngine) Trim(seq stage.SeqID, pos int32) error {
	err := e.Engine.Trim(seq, pos)
	e.mu.Lock()
	if p, ok := e.pos[seq]; ok && pos < p {
		e.pos[seq] = max(pos, 0)
	}
	e.mu.Unlock()
	return err
}

func (e *observedEngine) Release(seq stage.SeqID) error {
	err := e.Engine.Release(seq)
	e.mu.Lock()
	delete(e.pos, seq)
	e.mu.Unlock()
	return err
}

func (e *observedEngine) stats() *admin.StageStats {
	info := e.Info()
	e.mu.Lock()
	tokens := 0
	for _, p := range e.pos {
		tokens += int(p)
	}
	e.mu.Unlock()
	s := &admin.StageStats{
		Start: info.Start, End: info.End, Forwards: e.forwards.Load(),
		TokensPerSecond: e.rate.Rate(), ComputeMs: e.compute.Mean(),
		WeightBytes: e.WeightBytes(), KVTokens: tokens, KVCapacity: e.reserve,
		KVBytes: e.mem.KVPerToken * uint64(e.reserve), KVUsedBytes: e.mem.KVPerToken * uint64(tokens),
	}
	s.MemUsed = s.WeightBytes + s.KVBytes + e.mem.Compute
	if f, ok := e.Engine.(fusing); ok {
		switch on, why := f.Fused(); {
		case on:
			s.DecodePath = "fused"
		case why != "":
			s.DecodePath, s.DecodeWhy = "ggml", why
		}
	}
	return s
}

// selfStats are this node's live numbers.
func (o *observer) selfStats() admin.NodeStats {
	s := admin.NodeStats{
		Time: time.Now(), Version: o.m.cfg.Version, Uptime: time.Since(o.start).Seconds(),
		TokensPerSecond: o.gen.Rate(), TTFTMs: o.ttft.Mean(), StepMs: o.step.Mean(),
	}
	if sched := o.sched.Load(); sched != nil {
		ss := sched.Stats()
		s.QueueDepth, s.Active = ss.Waiting, ss.Active
		s.Requests, s.Failed = ss.Requests, ss.Failed
		s.PromptTokens, s.GeneratedTokens = ss.PromptTokens, ss.GeneratedTokens
	}
	o.m.mu.Lock()
	local := o.m.local
	o.m.mu.Unlock()
	if local != nil && local.observed != nil {
		s.Stage = local.observed.stats()
	}
	o.mu.Lock()
	if len(o.rtt) > 0 {
		s.RTTMs = make(map[string]float64, len(o.rtt))
		for k, v := range o.rtt {
			s.RTTMs[k] = v
		}
	}
	if len(o.sent) > 0 {
		s.BytesSent = make(map[string]uint64, len(o.sent))
		for k, v := range o.sent {
			s.BytesSent[k] = v
		}
	}
	if len(o.recv) > 0 {
		s.BytesReceived = make(map[string]uint64, len(o.recv))
		for k, v := range o.recv {
			s.BytesReceived[k] = v
		}
	}
	o.mu.Unlock()
	return s
}

// serveStats answers a peer's StatsProtocol stream.
func (o *observer) serveStats(s network.Stream) {
	defer s.Close()
	s.SetDeadline(time.Now().Add(peerAskTimeout))
	if err := json.NewEncoder(s).Encode(o.selfStats()); err != nil {
		o.m.log.Debug("sending stats", zap.Error(err))
	}
}

// loop pings the members and asks them for their numbers until ctx ends.
func (o *observer) loop(ctx context.Context) {
	t := time.NewTicker(observeEvery)
	defer t.Stop()
	for {
		o.round(ctx)
		select {
		case <-ctx.Done():
			return
		case <-t.C:
		}
	}
}

func (o *observer) round(ctx context.Context) {
	members := o.m.ml.Members()
	alive := map[string]bool{}
	var wg sync.WaitGroup
	for _, mem := range members {
		id := mem.Meta.PeerID
		alive[id] = true
		if id == o.m.self {
			continue
		}
		pid, err := peer.Decode(id)
		if err != nil {
			continue
		}
		wg.Go(func() { o.ask(ctx, id, pid) })
	}
	wg.Wait()
	o.mu.Lock()
	defer o.mu.Unlock()
	for id := range o.rtt {
		if !alive[id] {
			delete(o.rtt, id)
		}
	}
	for id := range o.fails {
		if !alive[id] {
			delete(o.fails, id)
		}
	}
	for id := range o.peers {
		if !alive[id] {
			delete(o.peers, id)
		}
	}
	for id, d := range o.departed {
		if alive[id] || time.Since(d.since) > departedFor {
			delete(o.departed, id)
		}
	}
}

// ask pings one peer and fetches its stats.
func (o *observer) ask(ctx context.Context, id string, pid peer.ID) {
	ctx, cancel := context.WithTimeout(ctx, peerAskTimeout)
	defer cancel()
	h := o.m.host.LibP2P()

	// Two pings on one stream: the first may pay for opening it.
	var best time.Duration
	pctx, pcancel := context.WithCancel(ctx)
	results := ping.Ping(pctx, h, pid)
	for range 2 {
		res, ok := <-results
		if !ok || res.Error != nil {
			break
		}
		if best == 0 || res.RTT < best {
			best = res.RTT
		}
	}
	pcancel()
	for range results { // drain: the pinger closes it once cancelled
	}

	st, err := fetchStats(ctx, h, pid)

	o.mu.Lock()
	defer o.mu.Unlock()
	if best > 0 {
		o.metrics.PeerRTT(id, best)
		ms := float64(best) / 1e6
		if old, ok := o.rtt[id]; ok {
			ms = old + rttSmoothing*(ms-old)
		}
		o.rtt[id] = ms
	}
	if err == nil {
		o.peers[id] = peerStats{stats: st, at: time.Now()}
	}
	if best == 0 && err != nil {
		o.fails[id]++
	} else {
		o.fails[id] = 0
	}
}

func fetchStats(ctx context.Context, h interface {
	NewStream(context.Context, peer.ID, ...protocol.ID) (network.Stream, error)
}, pid peer.ID) (admin.NodeStats, error) {
	var st admin.NodeStats
	s, err := h.NewStream(ctx, pid, StatsProtocol)
	if err != nil {
		return st, err
	}
	defer s.Close()
	if d, ok := ctx.Deadline(); ok {
		s.SetDeadline(d)
	}
	s.CloseWrite()
	err = json.NewDecoder(io.LimitReader(s, maxStatsBytes)).Decode(&st)
	return st, err
}

// snapshot is what status needs from the observer, copied under its lock.
type observation struct {
	rtt      map[string]float64
	fails    map[string]int
	peers    map[string]admin.NodeStats
	departed map[string]departedMember
}

func (o *observer) snapshot() observation {
	o.mu.Lock()
	defer o.mu.Unlock()
	ob := observation{rtt: map[string]float64{}, fails: map[string]int{}, peers: map[string]admin.NodeStats{}, departed: map[string]departedMember{}}
	for k, v := range o.rtt {
		ob.rtt[k] = v
	}
	for k, v := range o.fails {
		ob.fails[k] = v
	}
	now := time.Now()
	for k, v := range o.peers {
		if now.Sub(v.at) < statsFresh {
			ob.peers[k] = v.stats
		}
	}
	for k, v := range o.departed {
		ob.departed[k] = v
	}
	return ob
}

// hopStats counts the wire bytes of stage traffic per peer, on the stage
// server and on the pipeline's client connections. Traffic to this node's
// own stage (in memory) is not counted.
type hopStats struct{ o *observer }

type rpcPeerKey struct{}

type rpcPeer struct{ id atomic.Pointer[string] }

func (h hopStats) TagRPC(ctx context.Context, _ *stats.RPCTagInfo) context.Context {
	return context.WithValue(ctx, rpcPeerKey{}, &rpcPeer{})
}

func (h hopStats) HandleRPC(ctx context.Context, s stats.RPCStats) {
	p, _ := ctx.Value(rpcPeerKey{}).(*rpcPeer)
	if p == nil {
		return
	}
	switch s := s.(type) {
	case *stats.InHeader:
		h.setPeer(p, s.RemoteAddr)
	case *stats.OutHeader:
		h.setPeer(p, s.RemoteAddr)
	case *stats.InPayload:
		h.add(p, "received", s.WireLength)
	case *stats.OutPayload:
		h.add(p, "sent", s.WireLength)
	}
}

func (h hopStats) setPeer(p *rpcPeer, a interface{ String() string }) {
	if a == nil || p.id.Load() != nil {
		return
	}
	id := a.String()
	if _, err := peer.Decode(id); err != nil {
		return // the in-memory listener of this node's own stage
	}
	p.id.Store(&id)
}

func (h hopStats) add(p *rpcPeer, dir string, n int) {
	if id := p.id.Load(); id != nil {
		h.o.hopBytes(*id, dir, n)
	}
}

// hopBytes counts n bytes of stage traffic sent to or received from peer
// (dir "sent" or "received"), over gRPC or a local socket.
func (o *observer) hopBytes(peer, dir string, n int) {
	if n <= 0 {
		return
	}
	o.metrics.HopBytes(peer, dir, n)
	o.mu.Lock()
	if dir == "sent" {
		o.sent[peer] += uint64(n)
	} else {
		o.recv[peer] += uint64(n)
	}
	o.mu.Unlock()
}

func (h hopStats) TagConn(ctx context.Context, _ *stats.ConnTagInfo) context.Context { return ctx }
func (h hopStats) HandleConn(context.Context, stats.ConnStats)                       {}

// loadProgress reports slicing and fetching to the operator's progress
// callback and, as a percentage, to the mesh (Meta.LoadPct).
func (m *mesh) loadProgress() ggufstage.Progress {
	var last time.Time
	return func(what string, done, total uint64) {
		if m.cfg.Progress != nil {
			m.cfg.Progress(what, done, total)
		}
		if total == 0 {
			return
		}
		pct := float32(100 * float64(min(done, total)) / float64(total))
		m.mu.Lock()
		m.meta.LoadPct = pct
		m.mu.Unlock()
		if now := time.Now(); now.Sub(last) >= time.Second || done >= total {
			last = now
			m.publish()
		}
	}
}

// The engine's hand-offs on the device (pipeline.HandoffEngine), where it
// has them; a pass launched so is timed from its launch to its end.

var errNoHandoff = errors.New("the stage's engine has no hand-off on the device")

func (e *observedEngine) ExportHandoff(rows int) (stage.HandoffPort, []byte, error) {
	h, ok := e.Engine.(pipeline.HandoffEngine)
	if !ok {
		return nil, nil, errNoHandoff
	}
	return h.ExportHandoff(rows)
}

func (e *observedEngine) ImportHandoff(offer []byte) (stage.HandoffPort, error) {
	h, ok := e.Engine.(pipeline.HandoffEngine)
	if !ok {
		return nil, errNoHandoff
	}
	return h.ImportHandoff(offer)
}

func (e *observedEngine) LaunchHandoff(ctx context.Context, b *stage.Batch, in, out stage.HandoffPort) (stage.LaunchedPass, bool, error) {
	h, ok := e.Engine.(pipeline.HandoffEngine)
	if !ok {
		return nil, false, nil
	}
	start := time.Now()
	p, ok, err := h.LaunchHandoff(ctx, b, in, out)
	if err != nil || !ok {
		return p, ok, err
	}
	return &observedPass{LaunchedPass: p, e: e, b: b, launch: time.Since(start), in: in != nil, out: out != nil}, true, nil
}

// observedPass times a launched pass as its queueing and its finish, not
// the time between: the next stage launches as soon as its input is on
// its way, and then waits for the previous stage's pass before its
// caller finishes it, which a stage's compute should not count.
type observedPass struct {
	stage.LaunchedPass
	e       *observedEngine
	b       *stage.Batch
	launch  time.Duration
	in, out bool // its hidden input came from a port, its output went to one
}

func (p *observedPass) Finish() (*stage.Output, error) {
	start := time.Now()
	out, err := p.LaunchedPass.Finish()
	if err == nil {
		p.e.passDone(p.b, p.launch+time.Since(start))
		if p.in {
			p.e.o.metrics.StageHandoff(p.e.label, "in")
		}
		if p.out {
			p.e.o.metrics.StageHandoff(p.e.label, "out")
		}
	}
	return out, err
}
