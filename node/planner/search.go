package planner

import (
	"cmp"
	"math"
	"math/bits"
	"slices"

	"github.com/meshnode/meshnode/stage"
)

// problem holds what the search needs, precomputed so that the cost of a
// range is O(1).
type problem struct {
	layers   int
	prefix   []uint64 // prefix[l]: weight bytes of layers [0,l)
	model    Model
	split    bool
	maxFree  int      // most stages unpinned nodes may take
	next     []int    // next[p]: first position at or after p not inside a pin
	gapEnd   []int    // gapEnd[p]: where the unpinned gap starting at p ends
	coverLen int      // layers left to unpinned nodes
	freeFrom []int    // freeFrom[p]: unpinned layers in [p, L)
	pinned   []bool   // pinned[l]: layer l belongs to a pin
	memTab   []uint64 // memTab[s*(L+1)+e]: mem(s, e)
	head     float64  // the output head's work in layers (Model.StageWork)
}

func newProblem(m Model, o Options) *problem {
	pb := &problem{layers: m.Layers, model: m, split: o.Split, prefix: make([]uint64, m.Layers+1)}
	for l := range m.Layers {
		pb.prefix[l+1] = pb.prefix[l] + m.layerBytes(l)
	}
	pb.head = m.StageWork(0, m.Layers) - float64(m.Layers)
	pb.setPins(nil)
	w := m.Layers + 1
	pb.memTab = make([]uint64, w*w)
	for s := range m.Layers {
		for e := s + 1; e <= m.Layers; e++ {
			pb.memTab[s*w+e] = pb.mem(s, e)
		}
	}
	return pb
}

// work is Model.StageWork(s, e).
func (pb *problem) work(s, e int) float64 {
	if e == pb.layers {
		return float64(e-s) + pb.head
	}
	return float64(e - s)
}

// mem is the bytes [s,e) needs as one stage.
func (pb *problem) mem(s, e int) uint64 {
	w := pb.prefix[e] - pb.prefix[s]
	if s == 0 {
		w += pb.model.EmbedBytes
	}
	if e == pb.layers {
		w += pb.model.HeadBytes
	}
	m := stage.Memory{Weights: w, KVPerToken: pb.model.KVPerTokenPerLayer * uint64(e-s), Compute: pb.model.StageOverhead}
	return m.Total(pb.model.KVTokens)
}

// setPins records where the pinned ranges (sorted, disjoint) lie, so that
// unpinned stages only ever fill gaps.
func (pb *problem) setPins(pinned []cand) {
	L := pb.layers
	pinEnd := make([]int, L+1) // pinEnd[p] > 0: a pin starts at p and ends there
	for _, c := range pinned {
		pinEnd[c.pin.Start] = c.pin.End
	}
	pb.next = make([]int, L+1)
	pb.gapEnd = make([]int, L+1)
	pb.coverLen = L
	pb.pinned = make([]bool, L)
	for _, c := range pinned {
		pb.coverLen -= c.pin.Len()
		for l := c.pin.Start; l < c.pin.End; l++ {
			pb.pinned[l] = true
		}
	}
	pb.freeFrom = make([]int, L+1)
	pb.next[L], pb.gapEnd[L] = L, L
	end := L // start of the nearest pin after p, or L
	for p := L - 1; p >= 0; p-- {
		if pinEnd[p] > 0 {
			pb.next[p] = pb.next[pinEnd[p]]
			end = p
		} else {
			pb.next[p] = p
		}
		pb.gapEnd[p] = end
		pb.freeFrom[p] = pb.freeFrom[p+1]
		if !pb.pinned[p] {
			pb.freeFrom[p]++
		}
	}
}

// cost ranks placements; lower is better. Field order is the policy's order
// of preference after the stage count, which the searches handle themselves.
type cost struct {
	inv       int     // pairs of unpinned nodes out of ID order
	balance   float64 // Σ work²/speed (Model.StageWork)
	spread    float64 // Σ bytes²/budget
	reachable bool
}

func (a cost) less(b cost) bool {
	switch {
	case a.reachable != b.reachable:
		return a.reachable
	case a.inv != b.inv:
		return a.inv < b.inv
	case !near(a.balance, b.balance):
		return a.balance < b.balance
	default:
		return !near(a.spread, b.spread) && a.spread < b.spread
	}
}

// near treats sums that differ only by rounding as equal, so that equal
// placements tie (and the fixed search order decides) instead of the order
// of float additions deciding.
func near(x, y float64) bool {
	return math.Abs(x-y) <= 1e-9*max(math.Abs(x), math.Abs(y))
}

// plus adds a stage of the given work (Model.StageWork) and mem bytes on a
// node, given the node's 1/speed and 1/budget, with inv more inversions.
func (a cost) plus(work float64, mem uint64, perSpeed, perByte float64, inv int) cost {
	a.inv += inv
	a.balance += work * work * perSpeed
	if mem > 0 {
		a.spread += float64(mem) * float64(mem) * perByte
	}
	return a
}

// weights returns each node's 1/speed and 1/budget, so that the searches
// multiply instead of divide.
func weights(free []cand) (perSpeed, perByte []float64) {
	for _, c := range free {
		perSpeed = append(perSpeed, 1/c.speed)
		b := 0.0 // a zero budget only ever holds zero bytes
		if c.usable > 0 {
			b = 1 / float64(c.usable)
		}
		perByte = append(perByte, b)
	}
	return perSpeed, perByte
}

// seg is one unpinned stage.
type seg struct {
	node       cand
	start, end int
}

// single implements rule 1: the fastest node that holds the whole model.
func (pb *problem) single(free []cand) (cand, bool) {
	need := pb.mem(0, pb.layers)
	var best cand
	found := false
	for _, c := range free { // sorted by ID: the first of equals wins
		if c.usable < need {
			continue
		}
		if !found || c.speed > best.speed || (c.speed == best.speed && c.usable > best.usable) {
			best, found = c, true
		}
	}
	return best, found
}

// search places the gaps. It returns the stages, or the furthest position
// any partial placement reached.
func (pb *problem) search(free []cand) ([]seg, int, bool) {
	if pb.next[0] == pb.layers {
		return nil, pb.layers, true // the pins cover everything
	}
	free = pb.useful(free)
	most := min(len(free), pb.maxFree, pb.coverLen) // stages conceivable
	if len(free) <= exactLimit {
		return pb.small(free, most)
	}
	var segs []seg
	var reach int
	ok := false
	if pb.split && most > 0 {
		// Aiming at the most stages conceivable prunes most of the search.
		segs, reach, ok = pb.ordered(free, most)
	}
	if !ok {
		segs, reach, ok = pb.ordered(free, 0)
	}
	if ok {
		return segs, reach, true
	}
	// Strict ID order failed; any order may still work among the largest
	// nodes, which are the ones that can take the embedding or the head.
	big := slices.Clone(free)
	slices.SortStableFunc(big, func(a, b cand) int { return cmp.Compare(b.usable, a.usable) })
	big = big[:exactLimit]
	slices.SortFunc(big, func(a, b cand) int { return cmp.Compare(a.id, b.id) })
	segs, r, ok := pb.small(big, min(most, exactLimit))
	return segs, max(reach, r), ok
}

// small finds the best placement over any order of at most exactLimit
// nodes. The ordered search goes first, being much cheaper: a plan in ID
// order with the best conceivable stage count is already the best of all,
// since order is what the policy compares next. Only what it cannot settle
// is left to the exact search.
func (pb *problem) small(free []cand, most int) ([]seg, int, bool) {
	if most <= 0 {
		return pb.exact(free, 0, 0)
	}
	if pb.split {
		if segs, reach, ok := pb.ordered(free, most); ok {
			return segs, reach, true
		}
		if segs, reach, ok := pb.exact(free, most, most); ok {
			return segs, reach, true
		}
		return pb.exact(free, 0, most)
	}
	segs, reach, ok := pb.ordered(free, 0)
	if !ok {
		return pb.exact(free, 0, most)
	}
	// Fewer stages in another order would still win.
	if fewer, _, ok := pb.exact(free, 0, len(segs)-1); ok {
		return fewer, reach, true
	}
	return segs, reach, true
}

// useful drops nodes that cannot hold even one unpinned layer, so that they
// cost the searches nothing (and Split does not count on them).
func (pb *problem) useful(free []cand) []cand {
	least := uint64(math.MaxUint64)
	for l := range pb.layers {
		if !pb.pinned[l] {
			least = min(least, pb.mem(l, l+1))
		}
	}
	var out []cand
	for _, c := range free {
		if c.usable >= least {
			out = append(out, c)
		}
	}
	return out
}

// exactState is a partial placement: the unpinned nodes in a mask have
// covered every gap up to a position.
type exactState struct {
	cost
	node       int8  // the last node placed
	start, end int16 // its range
}

// exact searches every subset and order of free (at most exactLimit nodes,
// sorted by ID) with a dynamic program over (nodes used, position): the
// best way to reach a state does not depend on how the rest is placed.
// With target > 0 only placements of exactly target stages count; none has
// more than most.
func (pb *problem) exact(free []cand, target, most int) ([]seg, int, bool) {
	n, L := len(free), pb.layers
	width := L + 1
	perSpeed, perByte := weights(free)
	dp := make([]exactState, (1<<n)*width)
	dp[pb.next[0]].reachable = true
	reach := 0
	// Masks by number of nodes, so that a whole level is final before it
	// is extended: without Split the first level that covers the model is
	// the answer and no larger one need be built.
	masks := make([]int, 1<<n)
	for i := range masks {
		masks[i] = i
	}
	slices.SortStableFunc(masks, func(a, b int) int { return bits.OnesCount(uint(a)) - bits.OnesCount(uint(b)) })
	level := -1
	for _, mask := range masks {
		used := bits.OnesCount(uint(mask))
		if used != level {
			level = used
			if !pb.split && slices.ContainsFunc(masks, func(m int) bool {
				return bits.OnesCount(uint(m)) == used && dp[m*width+L].reachable
			}) {
				break
			}
		}
		for p := range L {
			st := dp[mask*width+p]
			if !st.reachable {
				continue
			}
			reach = max(reach, p)
			if used >= most || target > 0 && used >= target {
				continue
			}
			for j, c := range free {
				bit := 1 << j
				if mask&bit != 0 {
					continue
				}
				// Nodes already placed with larger IDs (higher j) precede j.
				inv := bits.OnesCount(uint(mask &^ (bit<<1 - 1)))
				to := (mask | bit) * width
				for e := p + 1; e <= pb.gapEnd[p]; e++ {
					m := pb.memTab[p*width+e]
					if m > c.usable {
						break // longer ranges only need more
					}
					q := pb.next[e]
					if target > 0 && pb.freeFrom[q] < target-used-1 {
						break // too few layers left for the other stages
					}
					nc := st.cost.plus(pb.work(p, e), m, perSpeed[j], perByte[j], inv)
					if nc.less(dp[to+q].cost) {
						dp[to+q] = exactState{cost: nc, node: int8(j), start: int16(p), end: int16(e)}
					}
				}
			}
		}
	}
	best, bestUsed := -1, 0
	for mask := range 1 << n {
		st := dp[mask*width+L]
		used := bits.OnesCount(uint(mask))
		if !st.reachable || target > 0 && used != target {
			continue
		}
		better := best < 0 || (pb.split && used > bestUsed) || (!pb.split && used < bestUsed) ||
			(used == bestUsed && st.cost.less(dp[best*width+L].cost))
		if better {
			best, bestUsed = mask, used
		}
	}
	if best < 0 {
		return nil, reach, false
	}
	var segs []seg
	for mask, p := best, L; mask != 0; {
		st := dp[mask*width+p]
		segs = append(segs, seg{node: free[st.node], start: int(st.start), end: int(st.end)})
		mask &^= 1 << st.node
		p = int(st.start)
	}
	return segs, L, true
}

// back points from a partial placement to the one it extends.
type back struct {
	prev       int32 // the node before, -1 for none
	start, end int16 // the last stage's range
}

// ordered places unpinned nodes in ID order only, which keeps the search
// polynomial for large meshes. Layer k of the program holds placements of
// exactly k unpinned stages, so both the fewest and (for Split, under
// MaxStages) the most stages can be read off. With target > 0 only
// placements of exactly target stages count, and node j can only be stage
// k if enough nodes follow it.
func (pb *problem) ordered(free []cand, target int) ([]seg, int, bool) {
	n, L := len(free), pb.layers
	width := L + 1
	kmax := min(pb.maxFree, n, pb.coverLen)
	perSpeed, perByte := weights(free)
	if target > 0 {
		kmax = min(kmax, target)
	}
	start := pb.next[0]
	reach := start
	// backs[k-1][(j-los[k-1])*width+p]: k stages, the last on node j, up
	// to p. Only nodes that can be stage k get a row.
	var backs [][]back
	var los []int
	type entry struct {
		cost
		node int32
	}
	front := make([]entry, width) // best over the nodes before j with k-1 stages
	prev := make([]cost, n*width)
	cur := make([]cost, n*width)
	bestK, bestJ := -1, -1
	for k := 1; k <= kmax; k++ {
		clear(cur)
		clear(front)
		if k == 1 {
			front[start] = entry{cost: cost{reachable: true}, node: -1}
		}
		grew := false
		lo, hi := 0, n
		if target > 0 {
			lo, hi = k-1, n-(target-k)
		}
		bk := make([]back, (hi-lo)*width)
		for j := range hi {
			c := free[j]
			for s := range L {
				f := front[s]
				if !f.reachable || j < lo {
					continue
				}
				for e := s + 1; e <= pb.gapEnd[s]; e++ {
					m := pb.memTab[s*width+e]
					if m > c.usable {
						break
					}
					q := pb.next[e]
					if target > 0 && pb.freeFrom[q] < target-k {
						break
					}
					nc := f.cost.plus(pb.work(s, e), m, perSpeed[j], perByte[j], 0)
					if nc.less(cur[j*width+q]) {
						cur[j*width+q] = nc
						bk[(j-lo)*width+q] = back{prev: f.node, start: int16(s), end: int16(e)}
						grew = true
						reach = max(reach, q)
					}
				}
			}
			if k > 1 {
				for p, pc := range prev[j*width : (j+1)*width] {
					if pc.reachable && pc.less(front[p].cost) {
						front[p] = entry{cost: pc, node: int32(j)}
					}
				}
			}
		}
		backs, los = append(backs, bk), append(los, lo)
		if !grew {
			break
		}
		done := -1
		for j := range n {
			if st := cur[j*width+L]; st.reachable && (done < 0 || st.less(cur[done*width+L])) {
				done = j
			}
		}
		if done >= 0 && (target == 0 || k == target) {
			bestK, bestJ = k, done
			if !pb.split {
				break // the fewest stages
			}
		}
		prev, cur = cur, prev
	}
	if bestK < 0 {
		return nil, reach, false
	}
	var segs []seg
	for k, j, p := bestK, bestJ, L; k > 0; k-- {
		b := backs[k-1][(j-los[k-1])*width+p]
		segs = append(segs, seg{node: free[j], start: int(b.start), end: int(b.end)})
		j, p = int(b.prev), int(b.start)
	}
	return segs, L, true
}
