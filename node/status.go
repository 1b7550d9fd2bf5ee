package node

import (
	"fmt"
	"os"
	"sort"
	"strings"
	"time"

	"github.com/meshnode/meshnode/node/admin"
	"github.com/meshnode/meshnode/node/membership"
	"github.com/meshnode/meshnode/node/pipeline"
)

// The status types are admin's (GET /api/status); these names remain for
// the code that used them before.
type (
	Status      = admin.Status
	StatusModel = admin.Model
	StatusStage = admin.Stage
	StatusNode  = admin.Node
	StatusLocal = admin.Local
)

// status is the mesh as this node sees it. It reads only memory: the
// observer asks the peers in the background.
func (m *mesh) status() Status {
	st := Status{
		Schema: admin.SchemaVersion, Self: m.self, Time: time.Now(), Version: m.cfg.Version, JoinHint: m.host.JoinCommand(),
		Plan: []admin.Stage{}, Hops: []admin.Hop{}, Nodes: []admin.Node{}, Events: []admin.Event{},
	}
	m.mu.Lock()
	mm, plan, local, pipe, planErr := m.model, m.plan, m.local, m.pipe, m.planErr
	st.Events = append(st.Events, m.events...)
	m.mu.Unlock()
	if mm != nil {
		st.Model = &admin.Model{ID: mm.ref.ID, Name: mm.ref.Name, Arch: mm.info.Arch, Layers: mm.info.Layers,
			Context: mm.ref.Context, Parallel: mm.ref.Parallel}
	}
	st.Ready = pipe != nil
	switch r := pipe.(type) {
	case *pipeline.Pipeline:
		st.Lanes = m.lanesOf(r)
	case nil:
	default:
		st.Lanes = 1 // the whole model in this process
	}
	ob := m.obs.snapshot()
	self := m.obs.selfStats()

	members := sortedMembers(m.ml.Members())
	byID := map[string]membership.Member{}
	for _, mem := range members {
		byID[mem.Meta.PeerID] = mem
	}
	statsOf := func(id string) *admin.NodeStats {
		if id == m.self {
			return &self
		}
		if s, ok := ob.peers[id]; ok {
			return &s
		}
		return nil
	}

	// The plan, in pipeline order.
	layers := 0
	if mm != nil {
		layers = mm.info.Layers
	}
	inPlan := map[string]int{}
	for i, s := range plan.Stages {
		mem := byID[s.Node]
		stg := admin.Stage{Node: s.Node, Name: mem.Meta.Name, Start: s.Start, End: s.End}
		if layers > 0 {
			stg.Share = float64(s.End-s.Start) / float64(layers)
		}
		if mem.Meta.State == membership.NodeReady {
			for _, sv := range mem.Meta.Serving {
				stg.Up = stg.Up || (sv.Start == s.Start && sv.End == s.End && (mm == nil || sv.Model == mm.ref.ID))
			}
		}
		if ns := statsOf(s.Node); ns != nil && ns.Stage != nil && ns.Stage.Start == s.Start && ns.Stage.End == s.End {
			stg.ComputeMs, stg.TokensPerSecond = ns.Stage.ComputeMs, ns.Stage.TokensPerSecond
		}
		st.Plan = append(st.Plan, stg)
		if _, ok := inPlan[s.Node]; !ok {
			inPlan[s.Node] = i
		}
	}

	// The hops of a request entering here: in, between stages, back.
	if n := len(plan.Stages); n > 0 {
		path := []string{m.self}
		for _, s := range plan.Stages {
			path = append(path, s.Node)
		}
		path = append(path, m.self)
		for i := 0; i+1 < len(path); i++ {
			h := m.hop(path[i], path[i+1], statsOf(path[i]))
			h.Via = hopVia(byID[path[i]].Meta, byID[path[i+1]].Meta, path[i] == path[i+1])
			st.Hops = append(st.Hops, h)
		}
	}

	// The members: plan order, then the others, then the departed.
	for _, mem := range members {
		st.Nodes = append(st.Nodes, m.statusNode(mem, ob, statsOf(mem.Meta.PeerID)))
	}
	sort.SliceStable(st.Nodes, func(i, j int) bool {
		pi, iok := inPlan[st.Nodes[i].PeerID]
		pj, jok := inPlan[st.Nodes[j].PeerID]
		if iok != jok {
			return iok
		}
		return iok && pi < pj
	})
	var gone []admin.Node
	for id, d := range ob.departed {
		if _, alive := byID[id]; alive {
			continue
		}
		n := nodeFromMeta(d.meta)
		n.State = d.state
		since := d.since
		n.Since = &since
		gone = append(gone, n)
	}
	sort.Slice(gone, func(i, j int) bool { return gone[i].PeerID < gone[j].PeerID })
	st.Nodes = append(st.Nodes, gone...)

	if local != nil {
		sl := &admin.Local{Start: local.start, End: local.end, WeightBytes: local.engine.WeightBytes(), Fetched: local.fetched}
		if fi, err := os.Stat(local.slice); err == nil {
			sl.SliceBytes = fi.Size()
		}
		st.Local = sl
	}
	st.Problem = m.problem(&st, planErr, byID)
	return st
}

// problem says why the node cannot serve, or "".
func (m *mesh) problem(st *Status, planErr error, byID map[string]membership.Member) string {
	switch {
	case st.Ready:
		return ""
	case st.Model == nil:
		return "this node does not know the mesh's model yet (hashing it, or learning it from a peer)"
	case len(st.Plan) == 0 && planErr != nil:
		return fmt.Sprintf("no placement for %s: %v", st.Model.Name, planErr)
	case len(st.Plan) == 0:
		return "no plan yet"
	}
	var waiting []string
	for _, s := range st.Plan {
		if s.Up {
			continue
		}
		state := "gone"
		if mem, ok := byID[s.Node]; ok {
			state = mem.Meta.State
			if mem.Meta.State == membership.NodeLoading && mem.Meta.LoadPct > 0 {
				state = fmt.Sprintf("loading %.0f%%", mem.Meta.LoadPct)
			}
		}
		waiting = append(waiting, fmt.Sprintf("…%s [%d,%d) %s", shortID(s.Node), s.Start, s.End, state))
	}
	if len(waiting) > 0 {
		return "waiting for stages: " + strings.Join(waiting, ", ")
	}
	return "building the pipeline"
}

// hop describes the leg from one node to the next; from's stats say what
// it measured.
func (m *mesh) hop(from, to string, fromStats *admin.NodeStats) admin.Hop {
	h := admin.Hop{From: from, To: to}
	if from == to {
		zero := 0.0
		h.RTTMs = &zero
		return h
	}
	if fromStats != nil {
		if v, ok := fromStats.RTTMs[to]; ok {
			h.RTTMs = &v
		}
		if b, ok := fromStats.BytesSent[to]; ok {
			h.Bytes = &b
		}
	}
	return h
}

// hopVia is how streams from one node to another travel, as both announce
// themselves: within a node, over the next node's local socket when the
// two share a machine's kernel, network namespace and user (mesh.dial),
// else over libp2p.
func hopVia(from, to membership.Meta, same bool) string {
	switch {
	case same:
		return admin.ViaNode
	case from.LocalHost != "" && from.LocalHost == to.LocalHost && to.LocalSocket != "":
		return admin.ViaLocal
	}
	return admin.ViaLibp2p
}

func nodeFromMeta(md membership.Meta) admin.Node {
	n := admin.Node{
		PeerID: md.PeerID, ShortID: admin.ShortID(md.PeerID), Name: md.Name, State: md.State,
		Addrs: md.Addrs, HTTP: md.HTTP, Engine: md.Engine, Backend: md.Backend,
		MemTotal: md.MemTotal, MemOffered: md.MemFree, Speed: md.Speed, Serving: []admin.Serve{},
	}
	if n.Addrs == nil {
		n.Addrs = []string{}
	}
	for _, s := range md.Serving {
		n.Serving = append(n.Serving, admin.Serve{Model: s.Model, Start: s.Start, End: s.End})
	}
	for _, r := range md.Models {
		n.HasFile = n.HasFile || r.HasFile
	}
	return n
}

func (m *mesh) statusNode(mem membership.Member, ob observation, stats *admin.NodeStats) admin.Node {
	n := nodeFromMeta(mem.Meta)
	n.Self = mem.Meta.PeerID == m.self
	if n.State == membership.NodeLoading && mem.Meta.LoadPct > 0 {
		pct := float64(mem.Meta.LoadPct)
		n.LoadingPct = &pct
	}
	if !n.Self {
		if v, ok := ob.rtt[n.PeerID]; ok {
			n.RTTMs = &v
		}
		if ob.fails[n.PeerID] >= suspectAfter {
			n.State = admin.StateSuspect
		}
	}
	n.Stats = stats
	if stats != nil && stats.Stage != nil {
		n.MemUsed = stats.Stage.MemUsed
	}
	return n
}

// gauges are the node's levels for /metrics.
func (m *mesh) gauges() admin.Gauges {
	st := m.status()
	m.mu.Lock()
	meta := m.meta
	m.mu.Unlock()
	g := admin.Gauges{
		Peer: m.self, Name: meta.Name, Version: m.cfg.Version, Engine: meta.Engine, Backend: meta.Backend,
		Ready: st.Ready, PipelineStages: len(st.Plan), MemOffered: m.budget, MemTotal: meta.MemTotal,
		Members: map[string]int{},
	}
	if st.Model != nil {
		g.Model = st.Model.Name
	}
	if meta.State == membership.NodeLoading {
		g.LoadingPct = float64(meta.LoadPct)
	}
	if sched := m.obs.sched.Load(); sched != nil {
		g.Replays = sched.Stats().Replays
	}
	for _, n := range st.Nodes {
		g.Members[n.State]++
		if !n.Self || n.Stats == nil {
			continue
		}
		s := n.Stats
		g.QueueDepth, g.Active, g.PromptTokens, g.GeneratedTokens = s.QueueDepth, s.Active, s.PromptTokens, s.GeneratedTokens
		if s.Stage != nil {
			g.KVTokens, g.KVCapacity, g.KVBytes, g.KVUsedBytes = s.Stage.KVTokens, s.Stage.KVCapacity, s.Stage.KVBytes, s.Stage.KVUsedBytes
			g.WeightBytes, g.MemUsed = s.Stage.WeightBytes, s.Stage.MemUsed
		}
	}
	return g
}
