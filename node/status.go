package node

import (
	"encoding/json"
	"net/http"
	"os"
	"time"

	"github.com/meshnode/meshnode/node/membership"
	"github.com/meshnode/meshnode/node/planner"
)

// Status is the mesh as this node sees it (GET /api/status).
type Status struct {
	Self     string        `json:"self"`
	Model    *StatusModel  `json:"model,omitempty"`
	Plan     []StatusStage `json:"plan"`
	Ready    bool          `json:"ready"` // this node can serve requests
	Nodes    []StatusNode  `json:"nodes"`
	Local    *StatusLocal  `json:"local,omitempty"`
	Events   []MeshEvent   `json:"events"`
	Time     time.Time     `json:"time"`
	JoinHint string        `json:"join_command"`
}

// StatusModel names the mesh's model.
type StatusModel struct {
	ID     string `json:"id"`
	Name   string `json:"name"`
	Arch   string `json:"arch"`
	Layers int    `json:"layers"`
}

// StatusStage is one stage of the plan.
type StatusStage struct {
	Node  string `json:"node"`
	Start int    `json:"start"`
	End   int    `json:"end"`
}

// StatusNode is one member.
type StatusNode struct {
	PeerID  string             `json:"peer_id"`
	Name    string             `json:"name"`
	State   string             `json:"state"`
	Addrs   []string           `json:"addrs"`
	Engine  string             `json:"engine"`
	Backend string             `json:"backend"`
	MemFree uint64             `json:"mem_offered"`
	Speed   float64            `json:"speed"`
	Serving []membership.Serve `json:"serving"`
	HasFile bool               `json:"has_file"`
}

// StatusLocal is what this node holds.
type StatusLocal struct {
	Start       int    `json:"start"`
	End         int    `json:"end"`
	WeightBytes uint64 `json:"weight_bytes"`
	SliceBytes  int64  `json:"slice_bytes"`
	Fetched     uint64 `json:"fetched_bytes"`
}

func (m *mesh) status() Status {
	st := Status{Self: m.self, Time: time.Now(), JoinHint: m.host.JoinCommand()}
	m.mu.Lock()
	mm, plan, local, pipe := m.model, m.plan, m.local, m.pipe
	st.Events = append(st.Events, m.events...)
	m.mu.Unlock()
	if mm != nil {
		st.Model = &StatusModel{ID: mm.ref.ID, Name: mm.ref.Name, Arch: mm.info.Arch, Layers: mm.info.Layers}
	}
	st.Plan = planStages(plan)
	st.Ready = pipe != nil
	for _, mem := range sortedMembers(m.ml.Members()) {
		n := StatusNode{PeerID: mem.Meta.PeerID, Name: mem.Meta.Name, State: mem.Meta.State, Addrs: mem.Meta.Addrs,
			Engine: mem.Meta.Engine, Backend: mem.Meta.Backend, MemFree: mem.Meta.MemFree, Speed: mem.Meta.Speed, Serving: mem.Meta.Serving}
		for _, r := range mem.Meta.Models {
			n.HasFile = n.HasFile || r.HasFile
		}
		st.Nodes = append(st.Nodes, n)
	}
	if local != nil {
		sl := &StatusLocal{Start: local.start, End: local.end, WeightBytes: local.engine.WeightBytes(), Fetched: local.fetched}
		if fi, err := os.Stat(local.slice); err == nil {
			sl.SliceBytes = fi.Size()
		}
		st.Local = sl
	}
	return st
}

func planStages(p planner.Plan) []StatusStage {
	out := []StatusStage{}
	for _, s := range p.Stages {
		out = append(out, StatusStage{Node: s.Node, Start: s.Start, End: s.End})
	}
	return out
}

func (m *mesh) serveStatus(w http.ResponseWriter, r *http.Request) {
	if r.URL.Path != "/api/status" {
		http.NotFound(w, r)
		return
	}
	w.Header().Set("Content-Type", "application/json")
	enc := json.NewEncoder(w)
	enc.SetIndent("", "  ")
	enc.Encode(m.status())
}
