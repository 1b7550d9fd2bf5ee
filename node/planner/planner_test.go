package planner

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"testing"
)

// mdl is a model of uniform layers and no embedding, head, KV or overhead,
// so that tables can count bytes by hand.
func mdl(layers int, layerBytes uint64) Model {
	return Model{ID: "m", Layers: layers, LayerBytes: layerBytes, Engines: []string{"ggml"}}
}

func with(m Model, f func(*Model)) Model { f(&m); return m }

// nd is a ready ggml node.
func nd(id string, budget uint64, speed float64) Node {
	return Node{ID: id, Engine: "ggml", MemBudget: budget, Speed: speed, Ready: true}
}

func pin(n Node, start, end int) Node { n.Pin = &Range{start, end}; return n }

func notReady(n Node) Node { n.Ready = false; return n }

func engine(n Node, e string) Node { n.Engine = e; return n }

// checkPlan verifies every invariant a plan must hold, independently of how
// it was found.
func checkPlan(t *testing.T, m Model, nodes []Node, opts Options, p Plan) {
	t.Helper()
	if err := planErr(m, nodes, opts, p); err != nil {
		t.Fatalf("invalid plan %v: %v", p, err)
	}
}

func planErr(m Model, nodes []Node, opts Options, p Plan) error {
	byID := map[string]Node{}
	for _, n := range nodes {
		byID[n.ID] = n
	}
	if p.Model != m.ID {
		return fmt.Errorf("plan is for model %q", p.Model)
	}
	if len(p.Stages) == 0 {
		return errors.New("no stages")
	}
	if opts.MaxStages > 0 && len(p.Stages) > opts.MaxStages {
		return fmt.Errorf("%d stages, max %d", len(p.Stages), opts.MaxStages)
	}
	seen := map[string]bool{}
	at := 0
	for _, s := range p.Stages {
		if s.Start != at || s.End <= s.Start {
			return fmt.Errorf("stage %s=%s does not continue at %d", s.Range(), s.Node, at)
		}
		at = s.End
		n, ok := byID[s.Node]
		if !ok {
			return fmt.Errorf("unknown node %s", s.Node)
		}
		if seen[s.Node] {
			return fmt.Errorf("node %s has two stages", s.Node)
		}
		seen[s.Node] = true
		if !n.Ready || !slices.Contains(m.Engines, n.Engine) {
			return fmt.Errorf("node %s is not a candidate", s.Node)
		}
		if want := m.StageMemory(s.Start, s.End).Total(m.KVTokens); s.Memory != want {
			return fmt.Errorf("stage %s=%s says %d bytes, needs %d", s.Range(), s.Node, s.Memory, want)
		}
		if u := usable(n.MemBudget, opts.Headroom); s.Memory > u {
			return fmt.Errorf("stage %s=%s needs %d bytes, node offers %d", s.Range(), s.Node, s.Memory, u)
		}
		if n.Pin != nil && *n.Pin != s.Range() {
			return fmt.Errorf("node %s pinned to %s serves %s", s.Node, *n.Pin, s.Range())
		}
	}
	if at != m.Layers {
		return fmt.Errorf("stages end at %d of %d layers", at, m.Layers)
	}
	for _, n := range nodes {
		if n.Pin != nil && n.Ready && slices.Contains(m.Engines, n.Engine) && !seen[n.ID] {
			return fmt.Errorf("pinned node %s has no stage", n.ID)
		}
	}
	return nil
}

func TestPlace(t *testing.T) {
	m8 := mdl(8, 10)   // 80 bytes
	m12 := mdl(12, 10) // 120 bytes
	tests := []struct {
		name  string
		model Model
		nodes []Node
		opts  Options
		want  string // Plan.String(), or empty with err
		err   error
		short uint64 // for ErrNotEnoughMemory: the shortfall
	}{
		// Rule 1: one node when it fits.
		{name: "one node fits", model: m8, nodes: []Node{nd("a", 100, 1)}, want: "[0,8)=a"},
		{name: "fastest fitting node", model: m8,
			nodes: []Node{nd("a", 100, 1), nd("b", 100, 2), nd("c", 50, 9)}, want: "[0,8)=b"},
		{name: "equal speed: most memory", model: m8,
			nodes: []Node{nd("a", 100, 1), nd("b", 200, 1)}, want: "[0,8)=b"},
		{name: "equal speed and memory: smallest ID", model: m8,
			nodes: []Node{nd("b", 100, 1), nd("a", 100, 1)}, want: "[0,8)=a"},
		{name: "exactly fits", model: m8, nodes: []Node{nd("a", 80, 1)}, want: "[0,8)=a"},
		{name: "one byte short of a single node splits", model: m8,
			nodes: []Node{nd("a", 79, 1), nd("b", 79, 1)}, want: "[0,4)=a [4,8)=b"},
		{name: "speed 0 and NaN count as 1", model: m8,
			nodes: []Node{nd("a", 100, 0), nd("b", 100, math.NaN()), nd("c", 100, -1)}, want: "[0,8)=a"},

		// Rule 3: splitting.
		{name: "two equal halves", model: m8,
			nodes: []Node{nd("a", 50, 1), nd("b", 50, 1)}, want: "[0,4)=a [4,8)=b"},
		{name: "fewest nodes", model: m8,
			nodes: []Node{nd("a", 50, 1), nd("b", 50, 1), nd("c", 50, 1)}, want: "[0,4)=a [4,8)=b"},
		{name: "fewest nodes, fastest pair", model: m8,
			nodes: []Node{nd("a", 50, 1), nd("b", 50, 1), nd("c", 50, 3)}, want: "[0,3)=a [3,8)=c"},
		{name: "ID order along the pipeline", model: m8,
			nodes: []Node{nd("c", 30, 1), nd("a", 30, 1), nd("b", 30, 1)}, want: "[0,2)=a [2,5)=b [5,8)=c"},
		{name: "2x speed gets 2x layers", model: m12,
			nodes: []Node{nd("a", 100, 2), nd("b", 100, 1)}, want: "[0,8)=a [8,12)=b"},
		{name: "2x speed, memory caps the fast node", model: m12,
			nodes: []Node{nd("a", 50, 2), nd("b", 100, 1)}, want: "[0,5)=a [5,12)=b"},
		{name: "3:1 speed", model: m12, opts: Options{Split: true},
			nodes: []Node{nd("a", 1000, 1), nd("b", 1000, 3)}, want: "[0,3)=a [3,12)=b"},
		{name: "split three equal", model: m12, opts: Options{Split: true},
			nodes: []Node{nd("a", 1000, 1), nd("b", 1000, 1), nd("c", 1000, 1)}, want: "[0,4)=a [4,8)=b [8,12)=c"},
		{name: "split uses nodes that would not be needed", model: m8, opts: Options{Split: true},
			nodes: []Node{nd("a", 1000, 1), nd("b", 20, 1)}, want: "[0,6)=a [6,8)=b"},
		{name: "split, more nodes than layers: the fastest", model: mdl(3, 10), opts: Options{Split: true},
			nodes: []Node{nd("a", 100, 1), nd("b", 100, 5), nd("c", 100, 2), nd("d", 100, 4), nd("e", 100, 3)},
			want:  "[0,1)=b [1,2)=d [2,3)=e"},
		{name: "split skips a node that cannot hold a layer", model: m8, opts: Options{Split: true},
			nodes: []Node{nd("a", 100, 1), nd("b", 9, 1), nd("c", 100, 1)}, want: "[0,4)=a [4,8)=c"},
		{name: "split, one node", model: m8, opts: Options{Split: true},
			nodes: []Node{nd("a", 100, 1)}, want: "[0,8)=a"},
		{name: "split capped by MaxStages", model: m8, opts: Options{Split: true, MaxStages: 2},
			nodes: []Node{nd("a", 100, 1), nd("b", 100, 1), nd("c", 100, 1), nd("d", 100, 1)}, want: "[0,4)=a [4,8)=b"},
		{name: "MaxStages allows the split", model: m8, opts: Options{MaxStages: 3},
			nodes: []Node{nd("a", 30, 1), nd("b", 30, 1), nd("c", 30, 1)}, want: "[0,2)=a [2,5)=b [5,8)=c"},
		{name: "MaxStages too low", model: m8, opts: Options{MaxStages: 2},
			nodes: []Node{nd("a", 30, 1), nd("b", 30, 1), nd("c", 30, 1)}, err: ErrNotEnoughMemory, short: 20},
		{name: "fewest nodes beats ID order", model: mdl(10, 10),
			nodes: []Node{nd("a", 30, 1), nd("b", 80, 1), nd("c", 30, 1)}, want: "[0,3)=a [3,10)=b"},

		// Embedding, head, KV, overhead, uneven layers.
		// The head weighs three layers: the last stage's work is 1+3 against
		// the first's 3 (2+3 against 2 would be further from even).
		{name: "embedding and head: the head's stage takes fewer layers", model: with(mdl(4, 10), func(m *Model) { m.EmbedBytes, m.HeadBytes = 30, 30 }),
			nodes: []Node{nd("a", 60, 1), nd("b", 60, 1)}, want: "[0,3)=a [3,4)=b"},
		{name: "a head lighter than half a layer moves nothing", model: with(mdl(4, 10), func(m *Model) { m.HeadBytes = 4 }),
			nodes: []Node{nd("a", 40, 1), nd("b", 40, 1)}, want: "[0,2)=a [2,4)=b"},
		{name: "embedding too big for the first node by ID: reordered",
			model: with(mdl(4, 10), func(m *Model) { m.EmbedBytes = 50 }),
			nodes: []Node{nd("a", 30, 1), nd("b", 80, 1)}, want: "[0,2)=b [2,4)=a"},
		{name: "memory spread: the embedding stage takes fewer layers",
			model: with(mdl(5, 10), func(m *Model) { m.EmbedBytes = 20 }), opts: Options{Split: true},
			nodes: []Node{nd("a", 100, 1), nd("b", 100, 1)}, want: "[0,2)=a [2,5)=b"},
		{name: "memory spread: the larger budget takes the extra layer", model: mdl(5, 10), opts: Options{Split: true},
			nodes: []Node{nd("a", 1000, 1), nd("b", 100, 1)}, want: "[0,3)=a [3,5)=b"},
		{name: "memory spread, reversed", model: mdl(5, 10), opts: Options{Split: true},
			nodes: []Node{nd("a", 100, 1), nd("b", 1000, 1)}, want: "[0,2)=a [2,5)=b"},
		{name: "KV and overhead exactly fit",
			model: with(mdl(4, 10), func(m *Model) { m.KVPerTokenPerLayer, m.KVTokens, m.StageOverhead = 1, 5, 7 }),
			nodes: []Node{nd("a", 67, 1)}, want: "[0,4)=a"},
		{name: "KV and overhead one byte short",
			model: with(mdl(4, 10), func(m *Model) { m.KVPerTokenPerLayer, m.KVTokens, m.StageOverhead = 1, 5, 7 }),
			nodes: []Node{nd("a", 66, 1)}, err: ErrNotEnoughMemory, short: 1},
		{name: "overhead per stage counts twice when split",
			model: with(mdl(4, 10), func(m *Model) { m.StageOverhead = 5 }),
			nodes: []Node{nd("a", 25, 1), nd("b", 25, 1)}, want: "[0,2)=a [2,4)=b"},
		{name: "another order saves a stage",
			model: with(mdl(4, 0), func(m *Model) { m.PerLayerBytes, m.EmbedBytes, m.HeadBytes = []uint64{20, 40, 30, 30}, 10, 20 }),
			nodes: []Node{nd("a", 80, 1), nd("b", 50, 1), nd("c", 70, 1)}, want: "[0,2)=c [2,4)=a"},
		{name: "uneven layers", model: with(mdl(6, 0), func(m *Model) { m.PerLayerBytes = []uint64{40, 10, 10, 10, 10, 40} }),
			nodes: []Node{nd("a", 70, 1), nd("b", 70, 1)}, want: "[0,3)=a [3,6)=b"},
		{name: "uneven layers, exactly fits", model: with(mdl(3, 0), func(m *Model) { m.PerLayerBytes = []uint64{5, 50, 5} }),
			nodes: []Node{nd("a", 55, 1), nd("b", 5, 1)}, want: "[0,2)=a [2,3)=b"},

		// Memory.
		{name: "too little memory", model: m8,
			nodes: []Node{nd("a", 30, 1), nd("b", 30, 1)}, err: ErrNotEnoughMemory, short: 20},
		{name: "enough in total, but fragmented", model: m8,
			nodes: []Node{nd("a", 79, 1), nd("b", 9, 1)}, err: ErrNotEnoughMemory, short: 10},
		{name: "huge budgets do not overflow", model: m8,
			nodes: []Node{nd("a", math.MaxUint64, 1), nd("b", math.MaxUint64, 1)}, want: "[0,8)=a"},
		{name: "headroom still fits", model: m8, opts: Options{Headroom: 0.2},
			nodes: []Node{nd("a", 100, 1)}, want: "[0,8)=a"},
		{name: "headroom no longer fits", model: m8, opts: Options{Headroom: 0.25},
			nodes: []Node{nd("a", 100, 1)}, err: ErrNotEnoughMemory, short: 5},

		// Candidates.
		{name: "engine that cannot run the model is skipped", model: m8,
			nodes: []Node{engine(nd("a", 1000, 9), "mlx"), nd("b", 100, 1)}, want: "[0,8)=b"},
		{name: "several engines", model: with(m8, func(m *Model) { m.Engines = []string{"ggml", "mlx"} }),
			nodes: []Node{engine(nd("a", 1000, 9), "mlx"), nd("b", 100, 1)}, want: "[0,8)=a"},
		{name: "non-ready node is skipped", model: m8,
			nodes: []Node{notReady(nd("a", 1000, 9)), nd("b", 100, 1)}, want: "[0,8)=b"},
		{name: "no nodes", model: m8, err: ErrNoNodes},
		{name: "no ready nodes", model: m8, nodes: []Node{notReady(nd("a", 100, 1))}, err: ErrNoNodes},
		{name: "no node with the engine", model: m8, nodes: []Node{engine(nd("a", 100, 1), "mlx")}, err: ErrNoNodes},

		// Pins.
		{name: "one pin, rest filled", model: m8,
			nodes: []Node{pin(nd("a", 100, 1), 0, 2), nd("b", 100, 1), nd("c", 100, 1)}, want: "[0,2)=a [2,8)=b"},
		{name: "pin beats the single-node rule", model: m8,
			nodes: []Node{pin(nd("b", 100, 1), 6, 8), nd("a", 1000, 9)}, want: "[0,6)=a [6,8)=b"},
		{name: "two pins and a gap", model: m8,
			nodes: []Node{pin(nd("a", 100, 1), 0, 2), nd("b", 100, 1), pin(nd("c", 100, 1), 6, 8), nd("d", 100, 1)},
			want:  "[0,2)=a [2,6)=b [6,8)=c"},
		{name: "gaps on both sides", model: m8,
			nodes: []Node{nd("a", 30, 1), pin(nd("b", 100, 1), 3, 5), nd("c", 30, 1)}, want: "[0,3)=a [3,5)=b [5,8)=c"},
		{name: "gaps need nodes out of ID order", model: m8,
			nodes: []Node{nd("a", 50, 1), pin(nd("b", 100, 1), 1, 3), nd("c", 10, 1)}, want: "[0,1)=c [1,3)=b [3,8)=a"},
		{name: "pins cover everything", model: m8,
			nodes: []Node{pin(nd("a", 100, 1), 0, 4), pin(nd("b", 100, 1), 4, 8), nd("c", 1000, 9)}, want: "[0,4)=a [4,8)=b"},
		{name: "whole-model pin", model: m8,
			nodes: []Node{pin(nd("b", 100, 1), 0, 8), nd("a", 1000, 9)}, want: "[0,8)=b"},
		{name: "split with a pin", model: m8, opts: Options{Split: true},
			nodes: []Node{pin(nd("b", 100, 1), 0, 2), nd("a", 100, 1), nd("c", 100, 1)}, want: "[0,2)=b [2,5)=a [5,8)=c"},
		{name: "pin of a non-ready node is ignored", model: m8,
			nodes: []Node{notReady(pin(nd("a", 100, 1), 0, 2)), nd("b", 100, 1)}, want: "[0,8)=b"},
		{name: "pin of a node on another engine is ignored", model: m8,
			nodes: []Node{engine(pin(nd("a", 100, 1), 0, 2), "mlx"), nd("b", 100, 1)}, want: "[0,8)=b"},
		{name: "gap but no free node", model: m8,
			nodes: []Node{pin(nd("a", 100, 1), 0, 4)}, err: ErrNotEnoughMemory, short: 40},
		{name: "gap too big for the free nodes", model: m8,
			nodes: []Node{pin(nd("a", 100, 1), 0, 2), nd("b", 30, 1)}, err: ErrNotEnoughMemory, short: 30},
		{name: "overlapping pins", model: m8,
			nodes: []Node{pin(nd("a", 100, 1), 0, 4), pin(nd("b", 100, 1), 3, 6)}, err: ErrBadPin},
		{name: "identical pins", model: m8,
			nodes: []Node{pin(nd("a", 100, 1), 0, 4), pin(nd("b", 100, 1), 0, 4)}, err: ErrBadPin},
		{name: "pin past the last layer", model: m8, nodes: []Node{pin(nd("a", 100, 1), 6, 9)}, err: ErrBadPin},
		{name: "negative pin", model: m8, nodes: []Node{pin(nd("a", 100, 1), -1, 2)}, err: ErrBadPin},
		{name: "empty pin", model: m8, nodes: []Node{pin(nd("a", 100, 1), 3, 3)}, err: ErrBadPin},
		{name: "pin over the budget", model: m8, nodes: []Node{pin(nd("a", 79, 1), 0, 8)}, err: ErrBadPin},
		{name: "pin over the budget after headroom", model: m8, opts: Options{Headroom: 0.5},
			nodes: []Node{pin(nd("a", 100, 1), 0, 8)}, err: ErrBadPin},
		{name: "more pins than MaxStages", model: m8, opts: Options{MaxStages: 1},
			nodes: []Node{pin(nd("a", 100, 1), 0, 4), pin(nd("b", 100, 1), 4, 8)}, err: ErrBadPin},
		{name: "pins use up MaxStages", model: m8, opts: Options{MaxStages: 1},
			nodes: []Node{pin(nd("a", 100, 1), 0, 4), nd("b", 100, 1)}, err: ErrNotEnoughMemory, short: 40},

		// Bad input.
		{name: "no layers", model: mdl(0, 10), nodes: []Node{nd("a", 100, 1)}, err: ErrBadInput},
		{name: "too many layers", model: mdl(maxLayers+1, 10), nodes: []Node{nd("a", 1e9, 1)}, err: ErrBadInput},
		{name: "most layers", model: mdl(maxLayers, 10), nodes: []Node{nd("a", 10*maxLayers, 1)}, want: "[0,1024)=a"},
		{name: "layer sizes do not match", model: with(m8, func(m *Model) { m.PerLayerBytes = []uint64{1} }),
			nodes: []Node{nd("a", 100, 1)}, err: ErrBadInput},
		{name: "no engines", model: with(m8, func(m *Model) { m.Engines = nil }), nodes: []Node{nd("a", 100, 1)}, err: ErrBadInput},
		{name: "negative KV tokens", model: with(m8, func(m *Model) { m.KVTokens = -1 }), nodes: []Node{nd("a", 100, 1)}, err: ErrBadInput},
		{name: "overflow", model: with(m8, func(m *Model) { m.KVPerTokenPerLayer, m.KVTokens = 1<<62, 1 }),
			nodes: []Node{nd("a", 100, 1)}, err: ErrBadInput},
		{name: "headroom 1", model: m8, opts: Options{Headroom: 1}, nodes: []Node{nd("a", 100, 1)}, err: ErrBadInput},
		{name: "headroom NaN", model: m8, opts: Options{Headroom: math.NaN()}, nodes: []Node{nd("a", 100, 1)}, err: ErrBadInput},
		{name: "negative MaxStages", model: m8, opts: Options{MaxStages: -1}, nodes: []Node{nd("a", 100, 1)}, err: ErrBadInput},
		{name: "duplicate node", model: m8, nodes: []Node{nd("a", 100, 1), nd("a", 100, 1)}, err: ErrBadInput},
		{name: "empty node ID", model: m8, nodes: []Node{nd("", 100, 1)}, err: ErrBadInput},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			p, err := Place(tt.model, tt.nodes, tt.opts)
			if tt.err != nil {
				if !errors.Is(err, tt.err) {
					t.Fatalf("Place = %v, %v; want error %v", p, err, tt.err)
				}
				var me *MemoryError
				if errors.As(err, &me) && me.Shortfall != tt.short {
					t.Errorf("shortfall %d, want %d (%v)", me.Shortfall, tt.short, err)
				}
				if !strings.Contains(err.Error(), tt.err.Error()) {
					t.Errorf("message %q lacks %q", err, tt.err)
				}
				return
			}
			if err != nil {
				t.Fatalf("Place: %v", err)
			}
			checkPlan(t, tt.model, tt.nodes, tt.opts, p)
			if got := p.String(); got != tt.want {
				t.Errorf("plan %s, want %s", got, tt.want)
			}
		})
	}
}

func TestMemoryErrorMessage(t *testing.T) {
	_, err := Place(mdl(8, 10), []Node{nd("a", 30, 1), nd("b", 30, 1)}, Options{})
	if want := `planner: not enough memory: model "m" needs 80 bytes, ready nodes offer 60: short by 20 bytes`; err == nil || err.Error() != want {
		t.Errorf("got %v\nwant %s", err, want)
	}
	_, err = Place(mdl(8, 10), []Node{nd("a", 79, 1), nd("b", 9, 1)}, Options{MaxStages: 2})
	if want := `planner: not enough memory: model "m": ready nodes offer 88 of 80 bytes in total, but no split fits each node's budget with at most 2 stages: layers [7,8) need 10 more bytes`; err == nil || err.Error() != want {
		t.Errorf("got %v\nwant %s", err, want)
	}
}

// TestMembership replays joins, leaves and state changes, planning after
// each, as a node does on every membership event.
func TestMembership(t *testing.T) {
	m := mdl(12, 10) // 120 bytes
	type step struct {
		name  string
		apply func(map[string]Node)
		want  string
		diff  string // Diff from the previous plan, changes joined by "; "
	}
	join := func(n Node) func(map[string]Node) { return func(ns map[string]Node) { ns[n.ID] = n } }
	leave := func(id string) func(map[string]Node) { return func(ns map[string]Node) { delete(ns, id) } }
	update := func(id string, f func(*Node)) func(map[string]Node) {
		return func(ns map[string]Node) { n := ns[id]; f(&n); ns[id] = n }
	}
	tests := []struct {
		name  string
		opts  Options
		steps []step
	}{
		{name: "minimal", steps: []step{
			{name: "a alone", apply: join(nd("a", 100, 1)), want: "error"},
			{name: "b joins", apply: join(nd("b", 100, 1)), want: "[0,6)=a [6,12)=b", diff: "a gained [0,6); b gained [6,12)"},
			{name: "big c joins", apply: join(nd("c", 200, 1)), want: "[0,12)=c",
				diff: "a lost [0,6); b lost [6,12); c gained [0,12)"},
			{name: "faster d joins", apply: join(nd("d", 150, 2)), want: "[0,12)=d", diff: "c lost [0,12); d gained [0,12)"},
			{name: "d drains", apply: update("d", func(n *Node) { n.Ready = false }), want: "[0,12)=c",
				diff: "c gained [0,12); d lost [0,12)"},
			{name: "c leaves", apply: leave("c"), want: "[0,6)=a [6,12)=b", diff: "a gained [0,6); b gained [6,12); c lost [0,12)"},
			{name: "d back", apply: update("d", func(n *Node) { n.Ready = true }), want: "[0,12)=d",
				diff: "a lost [0,6); b lost [6,12); d gained [0,12)"},
			{name: "d leaves", apply: leave("d"), want: "[0,6)=a [6,12)=b", diff: "a gained [0,6); b gained [6,12); d lost [0,12)"},
			{name: "a leaves", apply: leave("a"), want: "error", diff: "a lost [0,6); b lost [6,12)"},
		}},
		{name: "split", opts: Options{Split: true}, steps: []step{
			{name: "a alone", apply: join(nd("a", 1000, 1)), want: "[0,12)=a", diff: "a gained [0,12)"},
			{name: "c joins", apply: join(nd("c", 1000, 1)), want: "[0,6)=a [6,12)=c", diff: "a moved [0,12) -> [0,6); c gained [6,12)"},
			{name: "b joins between", apply: join(nd("b", 1000, 1)), want: "[0,4)=a [4,8)=b [8,12)=c",
				diff: "a moved [0,6) -> [0,4); b gained [4,8); c moved [6,12) -> [8,12)"},
			{name: "b speeds up", apply: update("b", func(n *Node) { n.Speed = 4 }), want: "[0,2)=a [2,10)=b [10,12)=c",
				diff: "a moved [0,4) -> [0,2); b moved [4,8) -> [2,10); c moved [8,12) -> [10,12)"},
			{name: "b shrinks", apply: update("b", func(n *Node) { n.MemBudget = 50 }), want: "[0,3)=a [3,8)=b [8,12)=c",
				diff: "a moved [0,2) -> [0,3); b moved [2,10) -> [3,8); c moved [10,12) -> [8,12)"},
			{name: "a pins its layers", apply: update("a", func(n *Node) { n.Pin = &Range{0, 3} }), want: "[0,3)=a [3,8)=b [8,12)=c",
				diff: "a kept [0,3); b kept [3,8); c kept [8,12)"},
			{name: "c leaves", apply: leave("c"), want: "error", diff: "a lost [0,3); b lost [3,8); c lost [8,12)"},
			{name: "d joins", apply: join(nd("d", 1000, 1)), want: "[0,3)=a [3,8)=b [8,12)=d",
				diff: "a gained [0,3); b gained [3,8); d gained [8,12)"},
			{name: "a leaves, its pin with it", apply: leave("a"), want: "[0,5)=b [5,12)=d",
				diff: "a lost [0,3); b moved [3,8) -> [0,5); d moved [8,12) -> [5,12)"},
		}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			members := map[string]Node{}
			var prev Plan
			for _, st := range tt.steps {
				st.apply(members)
				var nodes []Node
				for _, n := range members {
					nodes = append(nodes, n) // map order: Place must not care
				}
				p, err := Place(m, nodes, tt.opts)
				got := "error"
				if err == nil {
					checkPlan(t, m, nodes, tt.opts, p)
					got = p.String()
				}
				if got != st.want {
					t.Fatalf("%s: plan %s (%v), want %s", st.name, got, err, st.want)
				}
				if err != nil {
					p = Plan{}
				}
				var changes []string
				for _, c := range Diff(prev, p) {
					changes = append(changes, c.String())
				}
				if got := strings.Join(changes, "; "); got != st.diff {
					t.Errorf("%s: diff %q, want %q", st.name, got, st.diff)
				}
				prev = p
			}
		})
	}
}

func TestDiff(t *testing.T) {
	p := func(stages ...Stage) Plan { return Plan{Model: "m", Stages: stages} }
	s := func(node string, a, b int) Stage { return Stage{Node: node, Start: a, End: b} }
	tests := []struct {
		name          string
		before, after Plan
		want          []Change
	}{
		{name: "both empty"},
		{name: "first plan", after: p(s("b", 0, 4), s("a", 4, 8)),
			want: []Change{{Node: "a", Kind: Gained, New: Range{4, 8}}, {Node: "b", Kind: Gained, New: Range{0, 4}}}},
		{name: "all lost", before: p(s("a", 0, 8)), want: []Change{{Node: "a", Kind: Lost, Old: Range{0, 8}}}},
		{name: "kept, moved, gained, lost",
			before: p(s("a", 0, 4), s("b", 4, 6), s("c", 6, 8)),
			after:  p(s("a", 0, 4), s("b", 4, 7), s("d", 7, 8)),
			want: []Change{
				{Node: "a", Kind: Kept, Old: Range{0, 4}, New: Range{0, 4}},
				{Node: "b", Kind: Moved, Old: Range{4, 6}, New: Range{4, 7}},
				{Node: "c", Kind: Lost, Old: Range{6, 8}},
				{Node: "d", Kind: Gained, New: Range{7, 8}},
			}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := Diff(tt.before, tt.after); !slices.Equal(got, tt.want) {
				t.Errorf("Diff = %v, want %v", got, tt.want)
			}
		})
	}
	for k, want := range map[ChangeKind]string{Kept: "kept", Gained: "gained", Lost: "lost", Moved: "moved", 9: "ChangeKind(9)"} {
		if got := k.String(); got != want {
			t.Errorf("ChangeKind(%d) prints %q, want %q", k, got, want)
		}
	}
}

func TestStageOf(t *testing.T) {
	p, err := Place(mdl(8, 10), []Node{nd("a", 50, 1), nd("b", 50, 1)}, Options{})
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		node string
		want Stage
		ok   bool
	}{
		{"a", Stage{Node: "a", Start: 0, End: 4, Memory: 40}, true},
		{"b", Stage{Node: "b", Start: 4, End: 8, Memory: 40}, true},
		{"c", Stage{}, false},
	}
	for _, tt := range tests {
		if got, ok := p.StageOf(tt.node); got != tt.want || ok != tt.ok {
			t.Errorf("StageOf(%s) = %v, %v; want %v, %v", tt.node, got, ok, tt.want, tt.ok)
		}
	}
}

func TestStageMemory(t *testing.T) {
	m := Model{Layers: 4, PerLayerBytes: []uint64{1, 2, 4, 8}, EmbedBytes: 100, HeadBytes: 1000,
		KVPerTokenPerLayer: 3, KVTokens: 10, StageOverhead: 10000, Engines: []string{"ggml"}}
	tests := []struct {
		start, end int
		weights    uint64
		total      uint64
	}{
		{0, 4, 100 + 15 + 1000, 100 + 15 + 1000 + 120 + 10000},
		{0, 1, 100 + 1, 100 + 1 + 30 + 10000},
		{1, 3, 6, 6 + 60 + 10000},
		{3, 4, 8 + 1000, 8 + 1000 + 30 + 10000},
	}
	pb := newProblem(m, Options{})
	for _, tt := range tests {
		sm := m.StageMemory(tt.start, tt.end)
		if sm.Weights != tt.weights || sm.Total(m.KVTokens) != tt.total {
			t.Errorf("StageMemory(%d,%d) = %+v (total %d), want weights %d total %d", tt.start, tt.end, sm, sm.Total(m.KVTokens), tt.weights, tt.total)
		}
		if got := pb.mem(tt.start, tt.end); got != tt.total {
			t.Errorf("mem(%d,%d) = %d, want %d", tt.start, tt.end, got, tt.total)
		}
	}
}

func TestUsable(t *testing.T) {
	tests := []struct {
		budget   uint64
		headroom float64
		want     uint64
	}{
		{100, 0, 100},
		{100, 0.1, 90},
		{1000, 0.1, 900},
		{99, 0.1, 90}, // keeps 9.9 → 9 bytes free, never less than the floor
		{0, 0.5, 0},
		{1, 0.999, 1},
		{math.MaxUint64, 0, math.MaxUint64},
		{math.MaxUint64, 0.5, 1<<63 - 1}, // float64 rounds the budget up to 2^64
	}
	for _, tt := range tests {
		if got := usable(tt.budget, tt.headroom); got != tt.want {
			t.Errorf("usable(%d, %v) = %d, want %d", tt.budget, tt.headroom, got, tt.want)
		}
	}
}

// TestPermutations places small meshes from every order of their nodes and
// expects the same plan (or error) each time.
func TestPermutations(t *testing.T) {
	emb := with(mdl(9, 10), func(m *Model) { m.EmbedBytes, m.HeadBytes = 15, 25 })
	tests := []struct {
		name  string
		model Model
		nodes []Node
		opts  Options
	}{
		{"equal nodes", mdl(8, 10), []Node{nd("a", 30, 1), nd("b", 30, 1), nd("c", 30, 1), nd("d", 30, 1)}, Options{}},
		{"mixed", emb, []Node{nd("a", 40, 1), nd("b", 70, 2), nd("c", 35, 0), nd("d", 60, 3), nd("e", 20, 1)}, Options{}},
		{"mixed split", emb, []Node{nd("a", 40, 1), nd("b", 70, 2), nd("c", 35, 0), nd("d", 60, 3), nd("e", 20, 1), nd("f", 90, 1)}, Options{Split: true}},
		{"pins", emb, []Node{pin(nd("a", 100, 1), 3, 5), nd("b", 70, 2), nd("c", 35, 0), pin(nd("d", 60, 3), 7, 9), nd("e", 60, 1)}, Options{}},
		{"skipped nodes", emb, []Node{notReady(nd("a", 1000, 9)), engine(nd("b", 1000, 9), "mlx"), nd("c", 60, 1), nd("d", 60, 1), nd("e", 60, 1)}, Options{Headroom: 0.1}},
		{"too little", emb, []Node{nd("a", 20, 1), nd("b", 20, 2), nd("c", 20, 3), nd("d", 20, 4)}, Options{}},
		{"bad pins", emb, []Node{pin(nd("a", 100, 1), 0, 3), pin(nd("b", 100, 1), 2, 4), pin(nd("c", 100, 1), 3, 5), nd("d", 100, 1)}, Options{}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			first, firstErr := Place(tt.model, tt.nodes, tt.opts)
			count := 0
			permute(slices.Clone(tt.nodes), 0, func(ns []Node) {
				count++
				p, err := Place(tt.model, ns, tt.opts)
				if fmt.Sprint(err) != fmt.Sprint(firstErr) || !slices.Equal(p.Stages, first.Stages) {
					t.Fatalf("order %v: %v, %v; first order gave %v, %v", ids(ns), p, err, first, firstErr)
				}
			})
			t.Logf("%d orders: %v %v", count, first, firstErr)
		})
	}
}

// permute calls f with every ordering of ns[k:] (Heap-free swap recursion).
func permute(ns []Node, k int, f func([]Node)) {
	if k == len(ns) {
		f(ns)
		return
	}
	for i := k; i < len(ns); i++ {
		ns[k], ns[i] = ns[i], ns[k]
		permute(ns, k+1, f)
		ns[k], ns[i] = ns[i], ns[k]
	}
}

func ids(ns []Node) []string {
	var out []string
	for _, n := range ns {
		out = append(out, n.ID)
	}
	return out
}

// TestInputUntouched: Place sorts a copy.
func TestInputUntouched(t *testing.T) {
	nodes := []Node{nd("c", 30, 1), nd("a", 30, 1), nd("b", 30, 1)}
	if _, err := Place(mdl(8, 10), nodes, Options{}); err != nil {
		t.Fatal(err)
	}
	if got := ids(nodes); !slices.Equal(got, []string{"c", "a", "b"}) {
		t.Errorf("input reordered to %v", got)
	}
}

func TestStageWork(t *testing.T) {
	tests := []struct {
		name       string
		model      Model
		start, end int
		want       float64
	}{
		{"a middle stage: its layers", with(mdl(4, 10), func(m *Model) { m.HeadBytes = 30 }), 1, 3, 2},
		{"the last stage: layers and the head in layers", with(mdl(4, 10), func(m *Model) { m.HeadBytes = 30 }), 2, 4, 5},
		{"the whole model", with(mdl(4, 10), func(m *Model) { m.EmbedBytes, m.HeadBytes = 99, 30 }), 0, 4, 7},
		{"uneven layers: the mean layer", with(mdl(4, 0), func(m *Model) { m.PerLayerBytes, m.HeadBytes = []uint64{20, 40, 30, 30}, 15 }), 3, 4, 1.5},
		{"no head", mdl(4, 10), 2, 4, 2},
		{"layers of unknown size", with(mdl(4, 0), func(m *Model) { m.HeadBytes = 30 }), 2, 4, 2},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := tc.model.StageWork(tc.start, tc.end); got != tc.want {
				t.Errorf("StageWork(%d, %d) = %v, want %v", tc.start, tc.end, got, tc.want)
			}
		})
	}
}
