package membership

import (
	"encoding/json"
	"errors"
	"fmt"
	"hash/fnv"
	"slices"
)

// Node states a node announces in Meta.State.
const (
	NodeLoading  = "loading"
	NodeReady    = "ready"
	NodeDraining = "draining"
)

// Engine families, as models need them and nodes offer them.
const (
	EngineGGML = "ggml" // GGUF files; every node runs it
	EngineMLX  = "mlx"  // safetensors directories; Apple Silicon with MLX
)

// NeedsEngine is the engine family the model needs; a ref without one
// (from a node that predates the field) is a GGUF's.
func (r ModelRef) NeedsEngine() string {
	if r.Engine == "" {
		return EngineGGML
	}
	return r.Engine
}

// Offers reports whether the node can run engine: one of its Engines, or
// for a node that does not list them, its Engine (ggml when unset).
func (m Meta) Offers(engine string) bool {
	if len(m.Engines) > 0 {
		return slices.Contains(m.Engines, engine)
	}
	if m.Engine == "" {
		return engine == EngineGGML
	}
	return m.Engine == engine
}

// ModelRef is a model a node knows about.
type ModelRef struct {
	ID      string
	Name    string
	HasFile bool // the weights are on this node's disk
	// Placement settings, announced by the node that brought the model so
	// that every node plans with the same inputs.
	Split    bool // spread over every ready node even when it fits one
	Context  int  // positions per sequence
	Parallel int  // sequences at once
	// Source is where nodes without the file fetch it from when no peer
	// holds it, e.g. hf://ORG/REPO/FILE.gguf.
	Source string
	// Engine is the engine family the model needs: "" or "ggml" for a GGUF
	// file, "mlx" for a safetensors directory (ID is then its manifest's).
	Engine string
}

// Serve is a slice of a model a node serves: layers [Start, End).
type Serve struct {
	Model      string
	Start, End int
}

// Meta is what each node tells the mesh about itself.
type Meta struct {
	PeerID string // filled from the member's name; senders need not set it
	Name   string // human name (hostname)
	Addrs  []string
	HTTP   string
	// Engine is the engine this node's layers run on now ("ggml", "mlx").
	Engine string
	// Engines lists the engines the node can run, which the planner
	// matches against a model's; empty (a node from before it was
	// announced) means Engine alone.
	Engines []string
	// Backend is the compute backend (cpu, metal, cuda, …).
	Backend string
	// Compute names the hardware this node's layers run on (a hash of
	// its machine and device): stages with equal values take turns on it.
	Compute string
	// LocalHost and LocalSocket say where nodes that share this machine's
	// kernel and network namespace reach this node's stages without TCP:
	// LocalHost is a hash of the two (equal values can reach each other's
	// Unix sockets), LocalSocket the socket's path. Empty: not offered.
	LocalHost, LocalSocket string
	MemTotal               uint64
	MemFree                uint64
	Speed                  float64
	Models                 []ModelRef
	Serving                []Serve
	Pins                   []Serve // layer ranges this node was told to serve (--layers)
	Load                   float64 // queued + active requests
	State                  string  // NodeLoading, NodeReady, NodeDraining
	LoadPct                float32
	// Version is assigned by UpdateMeta (it grows on every update, across
	// restarts too); a value set by the caller is ignored.
	Version uint64
}

// Wire format. memberlist's node meta is limited to 512 bytes and is what
// gossip carries in every alive message, so it holds the whole Meta when the
// JSON fits ('F'), else a summary of the small, fast-changing ("hot") fields
// plus a hash of the rest ('S'). Receivers of a summary whose hash differs from
// what they hold fetch the full metadata with a push-pull exchange, which
// carries LocalState ('P': the full Meta, no size limit). Load changes thus
// cost one gossip message; a changed model list costs one TCP round trip per
// receiver.
const (
	tagFull    = 'F'
	tagSummary = 'S'
	tagState   = 'P'
)

// maxStateLen bounds a decoded push-pull state (a hostile or broken member
// could otherwise make us allocate freely).
const maxStateLen = 1 << 20

type wireModel struct {
	I string `json:"i"`
	N string `json:"n,omitempty"`
	F bool   `json:"f,omitempty"`
	S bool   `json:"s,omitempty"`
	C int    `json:"c,omitempty"`
	P int    `json:"p,omitempty"`
	U string `json:"u,omitempty"`
	E string `json:"e,omitempty"`
}

type wireServe struct {
	M string `json:"m"`
	S int    `json:"s"`
	E int    `json:"e"`
}

// cold holds the fields that rarely change and can be large.
type cold struct {
	N  string      `json:"n,omitempty"`
	A  []string    `json:"a,omitempty"`
	H  string      `json:"h,omitempty"`
	E  string      `json:"e,omitempty"`
	B  string      `json:"b,omitempty"`
	CO string      `json:"co,omitempty"`
	ES []string    `json:"es,omitempty"`
	LH string      `json:"lh,omitempty"`
	LS string      `json:"ls,omitempty"`
	M  []wireModel `json:"m,omitempty"`
	SV []wireServe `json:"sv,omitempty"`
	PN []wireServe `json:"pn,omitempty"`
}

// hot holds small numbers and the state string.
type hot struct {
	MT uint64  `json:"mt,omitempty"`
	MF uint64  `json:"mf,omitempty"`
	SP float64 `json:"sp,omitempty"`
	L  float64 `json:"l,omitempty"`
	ST string  `json:"st,omitempty"`
	LP float32 `json:"lp,omitempty"`
	V  uint64  `json:"v"`
	// X is set while the node leaves gracefully. memberlist does tell left
	// from dead apart internally, but the Node it hands to NotifyLeave carries
	// a stale State (its nodeState shadows Node.State), so the leaving node
	// says goodbye in its metadata first.
	X bool `json:"x,omitempty"`
}

type wireFull struct {
	P string `json:"p,omitempty"` // peer ID, only in push-pull state
	cold
	hot
}

type wireSummary struct {
	hot
	CH uint64 `json:"ch"` // hash of the cold fields
}

// maxStateStr caps Meta.State so a summary always fits the meta limit.
const maxStateStr = 32

func toCold(m Meta) cold {
	c := cold{N: m.Name, A: m.Addrs, H: m.HTTP, E: m.Engine, B: m.Backend, CO: m.Compute, ES: m.Engines, LH: m.LocalHost, LS: m.LocalSocket}
	for _, x := range m.Models {
		c.M = append(c.M, wireModel{I: x.ID, N: x.Name, F: x.HasFile, S: x.Split, C: x.Context, P: x.Parallel, U: x.Source, E: x.Engine})
	}
	for _, s := range m.Serving {
		c.SV = append(c.SV, wireServe{M: s.Model, S: s.Start, E: s.End})
	}
	for _, s := range m.Pins {
		c.PN = append(c.PN, wireServe{M: s.Model, S: s.Start, E: s.End})
	}
	return c
}

func toHot(m Meta) hot { return toHotBye(m, false) }

func toHotBye(m Meta, bye bool) hot {
	st := m.State
	if len(st) > maxStateStr {
		st = st[:maxStateStr]
	}
	return hot{MT: m.MemTotal, MF: m.MemFree, SP: m.Speed, L: m.Load, ST: st, LP: m.LoadPct, V: m.Version, X: bye}
}

func (c cold) apply(m *Meta) {
	m.Name, m.Addrs, m.HTTP, m.Engine, m.Backend, m.Compute, m.Engines = c.N, c.A, c.H, c.E, c.B, c.CO, c.ES
	m.LocalHost, m.LocalSocket = c.LH, c.LS
	m.Models, m.Serving, m.Pins = nil, nil, nil
	for _, x := range c.M {
		m.Models = append(m.Models, ModelRef{ID: x.I, Name: x.N, HasFile: x.F, Split: x.S, Context: x.C, Parallel: x.P, Source: x.U, Engine: x.E})
	}
	for _, s := range c.SV {
		m.Serving = append(m.Serving, Serve{Model: s.M, Start: s.S, End: s.E})
	}
	for _, s := range c.PN {
		m.Pins = append(m.Pins, Serve{Model: s.M, Start: s.S, End: s.E})
	}
}

func (h hot) apply(m *Meta) {
	m.MemTotal, m.MemFree, m.Speed, m.Load, m.State, m.LoadPct, m.Version = h.MT, h.MF, h.SP, h.L, h.ST, h.LP, h.V
}

// hash identifies the cold fields; equal hashes mean nothing to fetch.
func (c cold) hash() uint64 {
	raw, _ := json.Marshal(c) // plain data: cannot fail
	f := fnv.New64a()
	f.Write(raw)
	return f.Sum64() | 1 // never 0, which means "unknown"
}

// encodeNodeMeta returns the gossip form of m, at most limit bytes.
func encodeNodeMeta(m Meta, bye bool, limit int) ([]byte, error) {
	c := toCold(m)
	full, err := json.Marshal(wireFull{cold: c, hot: toHotBye(m, bye)})
	if err != nil {
		return nil, fmt.Errorf("encode node meta: %w", err)
	}
	if 1+len(full) <= limit {
		return append([]byte{tagFull}, full...), nil
	}
	sum, err := json.Marshal(wireSummary{hot: toHotBye(m, bye), CH: c.hash()})
	if err != nil {
		return nil, fmt.Errorf("encode node meta summary: %w", err)
	}
	if 1+len(sum) > limit {
		return nil, fmt.Errorf("encode node meta: summary is %d bytes, limit %d", 1+len(sum), limit)
	}
	return append([]byte{tagSummary}, sum...), nil
}

// nodeMeta is a decoded node meta: either full, or hot fields plus a hash.
type nodeMeta struct {
	full     bool
	bye      bool // the node is leaving gracefully
	meta     Meta // hot fields only when !full
	coldHash uint64
}

func decodeNodeMeta(b []byte) (nodeMeta, error) {
	if len(b) == 0 {
		return nodeMeta{}, errors.New("decode node meta: empty")
	}
	switch b[0] {
	case tagFull:
		var w wireFull
		if err := json.Unmarshal(b[1:], &w); err != nil {
			return nodeMeta{}, fmt.Errorf("decode node meta: %w", err)
		}
		var m Meta
		w.cold.apply(&m)
		w.hot.apply(&m)
		return nodeMeta{full: true, bye: w.X, meta: m, coldHash: w.cold.hash()}, nil
	case tagSummary:
		var w wireSummary
		if err := json.Unmarshal(b[1:], &w); err != nil {
			return nodeMeta{}, fmt.Errorf("decode node meta summary: %w", err)
		}
		var m Meta
		w.hot.apply(&m)
		return nodeMeta{bye: w.X, meta: m, coldHash: w.CH}, nil
	default:
		return nodeMeta{}, fmt.Errorf("decode node meta: unknown format %q", b[0])
	}
}

func encodeState(peerID string, m Meta) ([]byte, error) {
	raw, err := json.Marshal(wireFull{P: peerID, cold: toCold(m), hot: toHot(m)})
	if err != nil {
		return nil, fmt.Errorf("encode local state: %w", err)
	}
	return append([]byte{tagState}, raw...), nil
}

func decodeState(b []byte) (peerID string, m Meta, coldHash uint64, err error) {
	if len(b) == 0 || b[0] != tagState {
		return "", Meta{}, 0, errors.New("decode remote state: unknown format")
	}
	if len(b) > maxStateLen {
		return "", Meta{}, 0, fmt.Errorf("decode remote state: %d bytes, limit %d", len(b), maxStateLen)
	}
	var w wireFull
	if err := json.Unmarshal(b[1:], &w); err != nil {
		return "", Meta{}, 0, fmt.Errorf("decode remote state: %w", err)
	}
	if w.P == "" {
		return "", Meta{}, 0, errors.New("decode remote state: no peer ID")
	}
	w.cold.apply(&m)
	w.hot.apply(&m)
	m.PeerID = w.P
	return w.P, m, w.cold.hash(), nil
}
