package planner

import (
	"cmp"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"testing"
)

// placement is one way of filling the gaps, in pipeline order.
type placement []seg

// key ranks a placement the way the policy does: stage count first (fewest,
// or most with split), then cost. It is computed from scratch, not by the
// search.
type key struct {
	count int
	cost  cost
}

func keyOf(m Model, pl placement) key {
	k := key{count: len(pl), cost: cost{reachable: true}}
	for i, s := range pl {
		for _, t := range pl[i+1:] {
			if s.node.id > t.node.id {
				k.cost.inv++
			}
		}
		// Work: layers, and on the last stage the head in layers of the
		// model's mean layer bytes.
		n := float64(s.end - s.start)
		if s.end == m.Layers && m.HeadBytes > 0 {
			var all uint64
			for l := range m.Layers {
				all += m.layerBytes(l)
			}
			if all > 0 {
				n += float64(m.HeadBytes) * float64(m.Layers) / float64(all)
			}
		}
		k.cost.balance += n * n / s.node.speed
		if mem := float64(m.StageMemory(s.start, s.end).Total(m.KVTokens)); mem > 0 {
			k.cost.spread += mem * mem / float64(s.node.usable)
		}
	}
	return k
}

func (a key) better(b key, split bool) bool {
	if a.count != b.count {
		return (a.count > b.count) == split
	}
	return a.cost.less(b.cost)
}

// brute enumerates every placement: every subset of free nodes, in every
// order, with every boundary, that fits the budgets and the stage cap.
func brute(m Model, free []cand, pins []Range, maxFree int, visit func(placement)) {
	pinEnd := map[int]int{}
	for _, r := range pins {
		pinEnd[r.Start] = r.End
	}
	var rec func(p int, used uint, pl placement)
	rec = func(p int, used uint, pl placement) {
		for pinEnd[p] > 0 {
			p = pinEnd[p]
		}
		if p == m.Layers {
			visit(slices.Clone(pl))
			return
		}
		if len(pl) >= maxFree {
			return
		}
		end := m.Layers
		for _, r := range pins {
			if r.Start > p {
				end = min(end, r.Start)
			}
		}
		for j, c := range free {
			if used&(1<<j) != 0 {
				continue
			}
			for e := p + 1; e <= end; e++ {
				if m.StageMemory(p, e).Total(m.KVTokens) <= c.usable {
					rec(e, used|1<<j, append(pl, seg{node: c, start: p, end: e}))
				}
			}
		}
	}
	rec(0, 0, nil)
}

// best is the policy's choice among all placements, by brute force.
func best(m Model, free []cand, pins []Range, maxFree int, split bool) (key, bool) {
	var b key
	found := false
	brute(m, free, pins, maxFree, func(pl placement) {
		if k := keyOf(m, pl); !found || k.better(b, split) {
			b, found = k, true
		}
	})
	return b, found
}

func randModel(r *rand.Rand, maxLayers int) Model {
	m := Model{ID: "m", Layers: 1 + r.IntN(maxLayers), LayerBytes: uint64(1 + r.IntN(10)), Engines: []string{"ggml"}}
	if r.IntN(3) == 0 {
		m.PerLayerBytes = make([]uint64, m.Layers)
		for i := range m.PerLayerBytes {
			m.PerLayerBytes[i] = uint64(r.IntN(13))
		}
	}
	m.EmbedBytes = uint64(r.IntN(16))
	m.HeadBytes = uint64(r.IntN(16))
	if r.IntN(2) == 0 {
		m.KVPerTokenPerLayer = uint64(r.IntN(3))
		m.KVTokens = r.IntN(4)
	}
	m.StageOverhead = uint64(r.IntN(6))
	return m
}

func randNodes(r *rand.Rand, m Model, n int, budget int) []Node {
	speeds := []float64{0, 0.5, 1, 1, 2, 3}
	ids := r.Perm(100)
	var nodes []Node
	for i := range n {
		nd := Node{
			ID:        fmt.Sprintf("n%02d", ids[i]),
			Engine:    "ggml",
			MemBudget: uint64(r.IntN(budget)),
			Speed:     speeds[r.IntN(len(speeds))],
			Ready:     r.IntN(8) != 0,
			HasFile:   r.IntN(2) == 0,
		}
		if r.IntN(10) == 0 {
			nd.Engine = "mlx"
		}
		if r.IntN(7) == 0 {
			s := r.IntN(m.Layers+1) - r.IntN(2)
			nd.Pin = &Range{s, s + r.IntN(m.Layers+1-max(s, 0)) + r.IntN(2)}
		}
		nodes = append(nodes, nd)
	}
	return nodes
}

func randOptions(r *rand.Rand) Options {
	var o Options
	o.Split = r.IntN(3) == 0
	if r.IntN(3) == 0 {
		o.MaxStages = 1 + r.IntN(4)
	}
	o.Headroom = []float64{0, 0, 0.1, 0.25}[r.IntN(4)]
	return o
}

// expect works out, independently of Place, which error it must return
// (nil when some placement exists), the candidates and the valid pins.
func expect(m Model, nodes []Node, o Options) ([]cand, []Range, error) {
	var free []cand
	var pins []Range
	someCand := false
	for _, n := range nodes {
		if !n.Ready || !slices.Contains(m.Engines, n.Engine) {
			continue
		}
		someCand = true
		c := cand{id: n.ID, usable: usable(n.MemBudget, o.Headroom), speed: speedOf(n.Speed)}
		if n.Pin == nil {
			free = append(free, c)
			continue
		}
		r := *n.Pin
		if r.Start < 0 || r.End > m.Layers || r.Start >= r.End || m.StageMemory(r.Start, r.End).Total(m.KVTokens) > c.usable {
			return nil, nil, ErrBadPin
		}
		pins = append(pins, r)
	}
	if !someCand {
		return nil, nil, ErrNoNodes
	}
	for i, a := range pins {
		for _, b := range pins[i+1:] {
			if a.Start < b.End && b.Start < a.End {
				return nil, nil, ErrBadPin
			}
		}
	}
	if o.MaxStages > 0 && len(pins) > o.MaxStages {
		return nil, nil, ErrBadPin
	}
	slices.SortFunc(free, func(a, b cand) int { return cmp.Compare(a.id, b.id) })
	return free, pins, nil
}

func maxFreeFor(o Options, pins []Range, free int) int {
	if o.MaxStages > 0 {
		return min(free, o.MaxStages-len(pins))
	}
	return free
}

// TestPlaceAgainstBruteForce: over random small meshes, Place returns a
// valid plan exactly when one exists, and the one the policy ranks first;
// its errors are the right ones, with the right shortfall.
func TestPlaceAgainstBruteForce(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	iters := 20000
	if testing.Short() {
		iters = 2000
	}
	counts := map[string]int{}
	for i := range iters {
		m := randModel(r, 7)
		nodes := randNodes(r, m, 1+r.IntN(5), 80)
		o := randOptions(r)
		name := fmt.Sprintf("case %d: model %+v nodes %+v opts %+v", i, m, nodes, o)
		p, err := Place(m, nodes, o)
		free, pins, wantErr := expect(m, nodes, o)
		if wantErr != nil {
			counts[wantErr.Error()]++
			if !errors.Is(err, wantErr) {
				t.Fatalf("%s\nPlace = %v, %v; want %v", name, p, err, wantErr)
			}
			continue
		}
		want, found := best(m, free, pins, maxFreeFor(o, pins, len(free)), o.Split)
		if !found {
			counts["no placement"]++
			var me *MemoryError
			if !errors.As(err, &me) {
				t.Fatalf("%s\nPlace = %v, %v; brute force finds no placement", name, p, err)
			}
			need := m.StageMemory(0, m.Layers).Total(m.KVTokens)
			var have uint64
			for _, c := range free {
				have += c.usable
			}
			for _, n := range nodes {
				if n.Pin != nil && n.Ready && n.Engine == "ggml" {
					have += usable(n.MemBudget, o.Headroom)
				}
			}
			if me.Need != need || me.Have != have {
				t.Fatalf("%s\nneed %d have %d, want %d %d", name, me.Need, me.Have, need, have)
			}
			if need > have && me.Shortfall != need-have || me.Shortfall == 0 && need > 0 {
				t.Fatalf("%s\nshortfall %d with need %d have %d", name, me.Shortfall, need, have)
			}
			continue
		}
		counts[fmt.Sprintf("placed %d stages", want.count+len(pins))]++
		if err != nil {
			t.Fatalf("%s\nPlace: %v; brute force places it: %+v", name, err, want)
		}
		if err := planErr(m, nodes, o, p); err != nil {
			t.Fatalf("%s\ninvalid plan %v: %v", name, p, err)
		}
		var pl placement
		for _, s := range p.Stages {
			if i := slices.IndexFunc(free, func(c cand) bool { return c.id == s.Node }); i >= 0 {
				pl = append(pl, seg{node: free[i], start: s.Start, end: s.End})
			}
		}
		if got := keyOf(m, pl); want.better(got, o.Split) {
			t.Fatalf("%s\nplan %v ranks %+v; brute force finds %+v", name, p, got, want)
		}
	}
	t.Logf("%v", counts)
}

// TestSearchesAgainstBruteForce checks both searches directly: exact
// against every placement, ordered against every placement in ID order.
// Larger meshes take the ordered search in Place.
func TestSearchesAgainstBruteForce(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	iters := 5000
	if testing.Short() {
		iters = 500
	}
	for i := range iters {
		m := randModel(r, 7)
		o := randOptions(r)
		nodes := randNodes(r, m, 1+r.IntN(5), 60)
		free, pins, wantErr := expect(m, nodes, o)
		if wantErr != nil {
			continue
		}
		pb := newProblem(m, o)
		var pinned []cand
		for _, rg := range pins {
			pinned = append(pinned, cand{pin: &rg})
		}
		slices.SortFunc(pinned, func(a, b cand) int { return a.pin.Start - b.pin.Start })
		pb.setPins(pinned)
		pb.maxFree = maxFreeFor(o, pins, len(free))
		name := fmt.Sprintf("case %d: model %+v free %+v pins %v opts %+v", i, m, free, pins, o)

		// Each search, with no target and (for Split) aiming at the most
		// stages conceivable, against the brute-force best of the
		// placements it may consider.
		t0 := min(len(pb.useful(free)), pb.maxFree, pb.coverLen)
		exact := func(f []cand, target int) ([]seg, int, bool) { return pb.exact(f, target, pb.maxFree) }
		for _, s := range []struct {
			name    string
			run     func([]cand, int) ([]seg, int, bool)
			ordered bool
			target  int
		}{
			{"exact", exact, false, 0},
			{"ordered", pb.ordered, true, 0},
			{"exact with target", exact, false, t0},
			{"ordered with target", pb.ordered, true, t0},
		} {
			if pb.next[0] == m.Layers || s.target > 0 && !o.Split || s.target < 0 {
				continue // Place handles full pins before searching
			}
			var want key
			found := false
			brute(m, free, pins, pb.maxFree, func(pl placement) {
				k := keyOf(m, pl)
				if s.ordered && k.cost.inv > 0 || s.target > 0 && k.count != s.target {
					return
				}
				if !found || k.better(want, o.Split) {
					want, found = k, true
				}
			})
			segs, reach, ok := s.run(free, s.target)
			if ok != found {
				t.Fatalf("%s\n%s: ok %v, brute force %v", name, s.name, ok, found)
			}
			if !ok {
				if reach >= m.Layers || pb.next[reach] != reach {
					t.Fatalf("%s\n%s: reach %d", name, s.name, reach)
				}
				continue
			}
			slices.SortFunc(segs, func(a, b seg) int { return a.start - b.start })
			got := keyOf(m, segs)
			if got.count != want.count || want.better(got, o.Split) {
				t.Fatalf("%s\n%s: %+v ranks %+v, brute force %+v", name, s.name, segs, got, want)
			}
		}
	}
}

// TestLargeMeshes runs meshes too large for brute force through Place (which
// then uses the ordered search): plans must be valid, and whenever nodes in
// ID order could each take what fits and cover the model, Place must find a
// plan, with no more stages than that greedy fill (without Split).
func TestLargeMeshes(t *testing.T) {
	r := rand.New(rand.NewPCG(5, 6))
	iters := 1000
	if testing.Short() {
		iters = 100
	}
	for i := range iters {
		m := randModel(r, 64)
		nodes := randNodes(r, m, 9+r.IntN(24), 40*m.Layers/8+40)
		for j := range nodes {
			nodes[j].Pin = nil
		}
		o := randOptions(r)
		o.MaxStages = 0
		name := fmt.Sprintf("case %d: model %+v nodes %+v opts %+v", i, m, nodes, o)
		p, err := Place(m, nodes, o)
		free, _, wantErr := expect(m, nodes, o)
		if wantErr != nil {
			if !errors.Is(err, wantErr) {
				t.Fatalf("%s\nPlace: %v, want %v", name, err, wantErr)
			}
			continue
		}
		// Greedy fill in ID order.
		at, stages := 0, 0
		for _, c := range free {
			e := at
			for e < m.Layers && m.StageMemory(at, e+1).Total(m.KVTokens) <= c.usable {
				e++
			}
			if e > at {
				at, stages = e, stages+1
			}
		}
		if at == m.Layers && err != nil {
			t.Fatalf("%s\nPlace: %v; greedy fill in ID order places it", name, err)
		}
		if err != nil {
			if !errors.Is(err, ErrNotEnoughMemory) {
				t.Fatalf("%s\nPlace: %v", name, err)
			}
			continue
		}
		if err := planErr(m, nodes, o, p); err != nil {
			t.Fatalf("%s\ninvalid plan %v: %v", name, p, err)
		}
		if at == m.Layers && !o.Split && len(p.Stages) > stages {
			t.Fatalf("%s\n%d stages, greedy fill needs %d", name, len(p.Stages), stages)
		}
		if o.Split && at == m.Layers && len(p.Stages) < min(stages, m.Layers) {
			t.Fatalf("%s\nsplit uses %d stages, greedy fill %d", name, len(p.Stages), stages)
		}
	}
}

// TestLargeMeshFallback: strict ID order cannot place the embedding, but
// reordering the largest nodes can.
func TestLargeMeshFallback(t *testing.T) {
	m := with(mdl(16, 10), func(m *Model) { m.EmbedBytes = 100 })
	var nodes []Node
	for i := range exactLimit + 4 {
		nodes = append(nodes, nd(fmt.Sprintf("n%02d", i), 60, 1)) // cannot hold the embedding
	}
	nodes = append(nodes, nd("z", 150, 1)) // can, but sorts last
	p, err := Place(m, nodes, Options{})
	if err != nil {
		t.Fatal(err)
	}
	checkPlan(t, m, nodes, Options{}, p)
	if p.Stages[0].Node != "z" {
		t.Errorf("plan %v: want z first", p)
	}
}

func benchNodes(n int, budget uint64) []Node {
	var nodes []Node
	for i := range n {
		nodes = append(nodes, nd(fmt.Sprintf("12D3KooW%04d", (i*37)%n), budget+uint64(i%5)*budget/4, float64(1+i%3)))
	}
	return nodes
}

// BenchmarkPlace64x128 places a 128-layer model on 64 nodes.
func BenchmarkPlace64x128(b *testing.B) {
	m := with(mdl(128, 100), func(m *Model) { m.EmbedBytes, m.HeadBytes, m.KVPerTokenPerLayer, m.KVTokens = 500, 500, 1, 10 })
	for _, bc := range []struct {
		name   string
		budget uint64
		opts   Options
	}{
		{"fewest", 1000, Options{}},
		{"split", 1000, Options{Split: true}},
		{"split big nodes", 100000, Options{Split: true}},
		{"split capped", 1000, Options{Split: true, MaxStages: 16}},
	} {
		b.Run(bc.name, func(b *testing.B) {
			nodes := benchNodes(64, bc.budget)
			var p Plan
			for b.Loop() {
				var err error
				if p, err = Place(m, nodes, bc.opts); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(len(p.Stages)), "stages")
		})
	}
}

// BenchmarkPlace8x128 covers the exact search, the one small meshes get.
func BenchmarkPlace8x128(b *testing.B) {
	m := with(mdl(128, 100), func(m *Model) { m.EmbedBytes, m.HeadBytes, m.KVPerTokenPerLayer, m.KVTokens = 500, 500, 1, 10 })
	for _, bc := range []struct {
		name   string
		budget uint64
		opts   Options
	}{
		{"fewest", 3000, Options{}},
		{"fewest, all needed", 1500, Options{}},
		{"split", 3000, Options{Split: true}},
		{"split big nodes", 100000, Options{Split: true}},
	} {
		b.Run(bc.name, func(b *testing.B) {
			nodes := benchNodes(exactLimit, bc.budget)
			var p Plan
			for b.Loop() {
				var err error
				if p, err = Place(m, nodes, bc.opts); err != nil {
					b.Fatal(err)
				}
			}
			b.ReportMetric(float64(len(p.Stages)), "stages")
		})
	}
}
