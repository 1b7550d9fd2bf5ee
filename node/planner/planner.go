// Package planner decides which node serves which layers of a model. It is a
// pure function of its inputs: no I/O, no goroutines, no clocks, no
// randomness. Every node computes the same plan from the same membership, so
// the mesh agrees on a pipeline without a coordinator.
//
// # Policy
//
// Candidates are the nodes that are Ready and whose Engine is one of the
// model's Engines; the rest get nothing. Each candidate offers its MemBudget
// minus Options.Headroom of it (rounded down). A stage needs the weights of
// its layers, plus the embedding if it owns layer 0 and the output head if it
// owns the last layer, plus KV cache for Model.KVTokens tokens across its
// layers, plus Model.StageOverhead (see Model.StageMemory). No node is ever
// given more than it offers.
//
//  1. One node: without pins and without Options.Split, if some candidate
//     can hold the whole model it gets it all, since a single stage pays no
//     network hop. The fastest such node wins; ties go to the most memory,
//     then to the smallest ID.
//  2. Pins: a ready candidate with a Pin serves exactly that range. Pins are
//     placed first; the gaps between them go to unpinned candidates, each
//     filling part of one gap.
//  3. Otherwise the model is split into contiguous stages.
//
// Splits are compared by, in order:
//
//   - the number of stages: as few as fit, or with Options.Split as many as
//     possible (every candidate that can hold a layer, at most one stage
//     per layer); never more than Options.MaxStages;
//   - pipeline order: unpinned nodes follow their IDs along the pipeline
//     whenever some split with that many stages allows it, which keeps the
//     order stable across replans;
//   - balance: the sum over stages of work²/speed, whose minimum gives
//     each node work in proportion to its speed, with memory as a hard
//     cap: a node whose share does not fit keeps what fits, and the others
//     take the rest in proportion to their speeds. A stage's work is its
//     layers, and the last stage's also its output head counted as the
//     layers of its bytes (Model.StageWork);
//   - memory spread: the sum over stages of bytes²/budget, which hands the
//     remaining ties to the nodes with more room;
//   - a fixed search order (IDs ascending), so that even exact ties give
//     one plan.
//
// Speed 0 (unknown) counts as 1, so nodes of unknown speed share layers
// evenly within their memory.
//
// The search is a dynamic program over layer boundaries. With at most 8
// unpinned candidates (exactLimit) it considers every pipeline order, so it
// finds a plan whenever one exists: it tries ID order first, then lets the
// exact search look for a plan with fewer stages (or, when ID order fails,
// for any plan). With more candidates it keeps unpinned nodes in ID order
// and, when that fails, tries any order among the 8 candidates with the
// most memory. Nodes that cannot hold even one layer are left out.
//
// When nothing fits, Place returns a *MemoryError (errors.Is
// ErrNotEnoughMemory) saying how many bytes are missing.
package planner

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"math/bits"
	"slices"
	"strings"

	"github.com/meshnode/meshnode/stage"
)

// Range is a half-open range of layers [Start, End).
type Range struct {
	Start, End int
}

// Len is the number of layers in the range.
func (r Range) Len() int { return r.End - r.Start }

func (r Range) String() string { return fmt.Sprintf("[%d,%d)", r.Start, r.End) }

// Model describes what has to be placed.
type Model struct {
	ID     string
	Layers int // transformer blocks

	// LayerBytes is the weight size of every layer, unless PerLayerBytes is
	// set (len Layers), which then wins.
	LayerBytes    uint64
	PerLayerBytes []uint64

	EmbedBytes         uint64 // token embedding, held by the first stage
	HeadBytes          uint64 // output norm and head, held by the last stage
	KVPerTokenPerLayer uint64 // K and V bytes of one cached token in one layer
	KVTokens           int    // tokens of KV to reserve: context × parallel sequences
	StageOverhead      uint64 // scratch every stage needs (compute graph buffers)

	// Engines lists the engines that can run the model ("ggml", "mlx").
	Engines []string
}

// StageMemory is what the range [start, end) costs as one stage; its
// Total(m.KVTokens) is the bytes the stage needs. The range must lie within
// [0, Layers).
func (m Model) StageMemory(start, end int) stage.Memory {
	var w uint64
	for l := start; l < end; l++ {
		w += m.layerBytes(l)
	}
	if start == 0 {
		w += m.EmbedBytes
	}
	if end == m.Layers {
		w += m.HeadBytes
	}
	return stage.Memory{
		Weights:    w,
		KVPerToken: m.KVPerTokenPerLayer * uint64(end-start),
		Compute:    m.StageOverhead,
	}
}

// StageWork is the work of the range [start, end) as one stage, in layers:
// its layers, plus on the last stage the output head, counted as the
// layers whose bytes it weighs (at the model's mean layer size). A decode
// pass reads every weight it holds once, so its time follows its bytes: an
// 8B model's head (128K rows) weighs 3.5 of its layers, and a last stage
// with as many layers as the first took 1.19x as long on an H200 (run 58,
// 16-row passes: 8.43 against 7.06 ms). The embedding costs the first stage
// one row per token, which counts as nothing.
func (m Model) StageWork(start, end int) float64 {
	w := float64(end - start)
	if end != m.Layers || m.HeadBytes == 0 {
		return w
	}
	var layers uint64
	for l := range m.Layers {
		layers += m.layerBytes(l)
	}
	if layers == 0 {
		return w
	}
	return w + float64(m.HeadBytes)*float64(m.Layers)/float64(layers)
}

func (m Model) layerBytes(l int) uint64 {
	if m.PerLayerBytes != nil {
		return m.PerLayerBytes[l]
	}
	return m.LayerBytes
}

// Node is one member of the mesh as the planner sees it.
type Node struct {
	ID        string // libp2p peer ID; the sort key
	Engine    string
	MemBudget uint64  // free memory offered, already capped by --max-memory
	Speed     float64 // measured throughput; 0 (or anything not finite and positive) = unknown = 1
	Ready     bool    // only ready nodes get layers; draining or suspect ones do not
	Pin       *Range  // --layers pin for this model: serve exactly this range
	HasFile   bool    // holds the whole model file; informative, not used by the policy
}

// Options tune the policy.
type Options struct {
	Split     bool    // spread over every candidate even when one node would do
	MaxStages int     // most stages in the pipeline; 0 = no cap
	Headroom  float64 // fraction of each budget kept free, in [0, 1)
}

// Stage is one node's part of the pipeline.
type Stage struct {
	Node       string
	Start, End int
	Memory     uint64 // bytes the stage needs (Model.StageMemory(...).Total(KVTokens))
}

// Range returns the stage's layers.
func (s Stage) Range() Range { return Range{s.Start, s.End} }

// Plan is a placement: stages ordered by Start, covering [0, Layers) without
// gaps or overlaps.
type Plan struct {
	Model  string
	Stages []Stage
}

// StageOf returns the stage that node serves.
func (p Plan) StageOf(node string) (Stage, bool) {
	for _, s := range p.Stages {
		if s.Node == node {
			return s, true
		}
	}
	return Stage{}, false
}

func (p Plan) String() string {
	var b strings.Builder
	for i, s := range p.Stages {
		if i > 0 {
			b.WriteByte(' ')
		}
		fmt.Fprintf(&b, "%s=%s", s.Range(), s.Node)
	}
	return b.String()
}

// Errors returned by Place. Each comes wrapped with details.
var (
	ErrBadInput        = errors.New("planner: invalid input")
	ErrNoNodes         = errors.New("planner: no ready node can run the model")
	ErrBadPin          = errors.New("planner: bad pin")
	ErrNotEnoughMemory = errors.New("planner: not enough memory")
)

// MemoryError reports a model that cannot be placed. It matches
// ErrNotEnoughMemory under errors.Is.
type MemoryError struct {
	Model     string
	Need      uint64 // bytes of the whole model as one stage
	Have      uint64 // bytes offered by all candidates, after headroom
	Shortfall uint64 // bytes missing: Need-Have, or, when the total would do, what the unplaceable part needs
	Unplaced  Range  // first layers no placement could reach
	MaxStages int    // the stage cap that applied; 0 = none
}

func (e *MemoryError) Error() string {
	capped := ""
	if e.MaxStages > 0 {
		capped = fmt.Sprintf(" with at most %d stages", e.MaxStages)
	}
	if e.Need > e.Have {
		return fmt.Sprintf("%v: model %q needs %d bytes, ready nodes offer %d: short by %d bytes",
			ErrNotEnoughMemory, e.Model, e.Need, e.Have, e.Shortfall)
	}
	return fmt.Sprintf("%v: model %q: ready nodes offer %d of %d bytes in total, but no split fits each node's budget%s: layers %s need %d more bytes",
		ErrNotEnoughMemory, e.Model, e.Have, e.Need, capped, e.Unplaced, e.Shortfall)
}

func (e *MemoryError) Unwrap() error { return ErrNotEnoughMemory }

// maxLayers bounds the model depth the searches accept: they keep a table
// of every range's bytes. Real models have a few hundred layers at most.
const maxLayers = 1024

// exactLimit is the most unpinned candidates for which every pipeline order
// is searched (the search grows as 2^n).
const exactLimit = 8

// cand is a candidate node, normalized.
type cand struct {
	id     string
	usable uint64
	speed  float64
	pin    *Range
}

// Place computes the plan for model over nodes. The order of nodes does not
// matter.
func Place(model Model, nodes []Node, opts Options) (Plan, error) {
	need, err := validate(model, opts)
	if err != nil {
		return Plan{}, err
	}
	sorted := slices.Clone(nodes)
	slices.SortFunc(sorted, func(a, b Node) int { return cmp.Compare(a.ID, b.ID) })
	var cands []cand
	notReady, wrongEngine := 0, 0
	for i, n := range sorted {
		if n.ID == "" {
			return Plan{}, fmt.Errorf("%w: node with an empty ID", ErrBadInput)
		}
		if i > 0 && sorted[i-1].ID == n.ID {
			return Plan{}, fmt.Errorf("%w: node %s listed twice", ErrBadInput, n.ID)
		}
		switch {
		case !n.Ready:
			notReady++
		case !slices.Contains(model.Engines, n.Engine):
			wrongEngine++
		default:
			cands = append(cands, cand{id: n.ID, usable: usable(n.MemBudget, opts.Headroom), speed: speedOf(n.Speed), pin: n.Pin})
		}
	}
	if len(cands) == 0 {
		return Plan{}, fmt.Errorf("%w: model %q on engines %v: %d nodes, %d not ready, %d on another engine",
			ErrNoNodes, model.ID, model.Engines, len(nodes), notReady, wrongEngine)
	}

	pb := newProblem(model, opts)
	var have uint64
	var free []cand
	var pinned []cand
	for _, c := range cands {
		have = satAdd(have, c.usable)
		if c.pin == nil {
			free = append(free, c)
			continue
		}
		r := *c.pin
		if r.Start < 0 || r.End > model.Layers || r.Start >= r.End {
			return Plan{}, fmt.Errorf("%w: node %s pins %s, outside model %q's layers [0,%d)", ErrBadPin, c.id, r, model.ID, model.Layers)
		}
		if m := pb.mem(r.Start, r.End); m > c.usable {
			return Plan{}, fmt.Errorf("%w: node %s pins %s, which needs %d bytes, but offers %d", ErrBadPin, c.id, r, m, c.usable)
		}
		pinned = append(pinned, c)
	}
	slices.SortStableFunc(pinned, func(a, b cand) int { return cmp.Compare(a.pin.Start, b.pin.Start) })
	for i := 1; i < len(pinned); i++ {
		if a, b := pinned[i-1], pinned[i]; b.pin.Start < a.pin.End {
			return Plan{}, fmt.Errorf("%w: node %s pins %s, overlapping node %s's %s", ErrBadPin, b.id, *b.pin, a.id, *a.pin)
		}
	}
	if opts.MaxStages > 0 && len(pinned) > opts.MaxStages {
		return Plan{}, fmt.Errorf("%w: %d nodes are pinned but at most %d stages are allowed", ErrBadPin, len(pinned), opts.MaxStages)
	}

	if len(pinned) == 0 && !opts.Split {
		if c, ok := pb.single(free); ok {
			return Plan{Model: model.ID, Stages: []Stage{{Node: c.id, Start: 0, End: model.Layers, Memory: pb.mem(0, model.Layers)}}}, nil
		}
	}

	pb.setPins(pinned)
	pb.maxFree = len(free)
	if opts.MaxStages > 0 {
		pb.maxFree = min(pb.maxFree, opts.MaxStages-len(pinned))
	}
	segs, reach, ok := pb.search(free)
	if !ok {
		gap := Range{reach, pb.gapEnd[reach]}
		e := &MemoryError{Model: model.ID, Need: need, Have: have, Unplaced: gap, MaxStages: opts.MaxStages}
		if need > have {
			e.Shortfall = need - have
		} else {
			e.Shortfall = pb.mem(gap.Start, gap.End)
		}
		return Plan{}, e
	}
	plan := Plan{Model: model.ID}
	for _, c := range pinned {
		plan.Stages = append(plan.Stages, Stage{Node: c.id, Start: c.pin.Start, End: c.pin.End, Memory: pb.mem(c.pin.Start, c.pin.End)})
	}
	for _, s := range segs {
		plan.Stages = append(plan.Stages, Stage{Node: s.node.id, Start: s.start, End: s.end, Memory: pb.mem(s.start, s.end)})
	}
	slices.SortFunc(plan.Stages, func(a, b Stage) int { return cmp.Compare(a.Start, b.Start) })
	return plan, nil
}

// validate checks the model and options and returns the bytes of the whole
// model as one stage, refusing sizes that overflow (every stage then fits in
// a uint64, since none is larger than the whole model).
func validate(m Model, o Options) (uint64, error) {
	switch {
	case m.Layers < 1 || m.Layers > maxLayers:
		return 0, fmt.Errorf("%w: model %q has %d layers, want 1 to %d", ErrBadInput, m.ID, m.Layers, maxLayers)
	case m.PerLayerBytes != nil && len(m.PerLayerBytes) != m.Layers:
		return 0, fmt.Errorf("%w: model %q has %d layers but %d layer sizes", ErrBadInput, m.ID, m.Layers, len(m.PerLayerBytes))
	case m.KVTokens < 0:
		return 0, fmt.Errorf("%w: model %q reserves %d KV tokens", ErrBadInput, m.ID, m.KVTokens)
	case len(m.Engines) == 0:
		return 0, fmt.Errorf("%w: model %q lists no engine that can run it", ErrBadInput, m.ID)
	case !(o.Headroom >= 0 && o.Headroom < 1):
		return 0, fmt.Errorf("%w: headroom %v outside [0,1)", ErrBadInput, o.Headroom)
	case o.MaxStages < 0:
		return 0, fmt.Errorf("%w: max stages %d", ErrBadInput, o.MaxStages)
	}
	var sum uint64
	var over bool
	add := func(x uint64) {
		var c uint64
		sum, c = bits.Add64(sum, x, 0)
		over = over || c != 0
	}
	mul := func(a, b uint64) uint64 {
		hi, lo := bits.Mul64(a, b)
		over = over || hi != 0
		return lo
	}
	for l := range m.Layers {
		add(m.layerBytes(l))
	}
	add(m.EmbedBytes)
	add(m.HeadBytes)
	add(mul(mul(m.KVPerTokenPerLayer, uint64(m.Layers)), uint64(m.KVTokens)))
	add(m.StageOverhead)
	if over {
		return 0, fmt.Errorf("%w: model %q's memory overflows 64 bits", ErrBadInput, m.ID)
	}
	return sum, nil
}

// usable is the budget minus the headroom, rounded so that at least the
// headroom fraction (down to a byte) stays free.
func usable(budget uint64, headroom float64) uint64 {
	keep := math.Floor(float64(budget) * headroom)
	if keep >= float64(budget) {
		return 0
	}
	return budget - uint64(keep)
}

// speedOf treats a missing or nonsensical figure as unknown, so one peer's
// bad metadata cannot stop everyone from planning.
func speedOf(s float64) float64 {
	if s > 0 && !math.IsInf(s, 1) {
		return s
	}
	return 1
}

func satAdd(a, b uint64) uint64 {
	s, c := bits.Add64(a, b, 0)
	if c != 0 {
		return math.MaxUint64
	}
	return s
}
