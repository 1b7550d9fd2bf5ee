package sample

import (
	"math"
	"math/rand/v2"
	"slices"
	"sync"

	"github.com/meshnode/meshnode/stage"
)

// Sampler draws tokens for one sequence. It keeps scratch space between
// calls, so sampling a token allocates nothing but, for a large
// vocabulary, the goroutines that weigh it; it is not safe for concurrent
// use.
type Sampler struct {
	p      Params
	window int // penalty window; -1 is the whole history
	seed   uint64
	src    *rand.PCG
	rng    *rand.Rand

	logits []float32       // working copy: the caller's slice is never written
	cands  []cand          // candidate tokens
	counts map[int32]int32 // token counts in the penalty window

	json *JSONConstraint // nil: unconstrained
}

// Constrain keeps the tokens sampled from here on one JSON object (see
// JSONConstraint); c holds the state, advanced by each token Sample returns.
func (s *Sampler) Constrain(c *JSONConstraint) { s.json = c }

type cand struct {
	id    int32
	logit float32
	w     float64 // unnormalised probability, exp((logit-max)/T)
}

// pcgStream is the fixed second word of the PCG seed, so that one int64 seed
// names one stream.
const pcgStream = 0x6d6573686e6f6465 // "meshnode"

// New returns a sampler for p. It does not validate p (call Params.Validate
// first); out-of-range values do not make it panic.
func New(p Params) *Sampler {
	seed := rand.Uint64()
	if p.Seed != nil {
		seed = uint64(*p.Seed)
	}
	window := p.RepeatLastN
	if window == 0 {
		window = DefaultRepeatLastN
	}
	src := rand.NewPCG(seed, pcgStream)
	return &Sampler{p: p, window: window, seed: seed, src: src, rng: rand.New(src), counts: map[int32]int32{}}
}

// Sample returns the next token given the logits over the vocabulary and the
// sequence's tokens so far (prompt and generated), which feed the penalties.
// It returns -1 for empty logits. Each call that is not greedy consumes
// exactly one number from the random stream, whatever the logits, so the
// stream stays aligned with the token count.
//
// The random number for a token is a function of the seed and the token's
// position (len(history)) alone: a generation replayed from its history on
// another pipeline, by a new Sampler with the same seed, draws exactly the
// tokens the first run drew.
func (s *Sampler) Sample(logits []float32, history []int32) int32 {
	tok := s.sample(logits, history)
	if s.json != nil {
		s.json.accept(tok)
	}
	return tok
}

// Greedy says whether every Sample is the greedy pick of its logits
// (stage.GreedyPick) whatever the history, and changes nothing in the
// sampler: temperature 0, no penalties, no JSON constraint. A caller may
// then take an engine's picks (stage.Output.Picks) instead of sampling.
func (s *Sampler) Greedy() bool {
	rp := s.p.RepeatPenalty
	return !(s.p.Temperature > 0) && s.json == nil && !(rp > 0 && rp != 1) && s.p.FrequencyPenalty == 0 && s.p.PresencePenalty == 0
}

func (s *Sampler) sample(logits []float32, history []int32) int32 {
	cs, pick, total := s.candidates(logits, history)
	if pick >= 0 || len(cs) == 0 {
		return pick
	}
	s.src.Seed(s.seed, pcgStream^uint64(len(history)))
	return s.draw(cs, total)
}

// candidates applies penalties and filters. It returns either a
// deterministic pick (>= 0, or -1 for empty logits, with no candidates) or
// the candidates to draw from, in a fixed order, with the sum of their
// weights (-1 where filters left it to draw to sum): in that order, or by
// weighParts for a whole large vocabulary (see weigh).
func (s *Sampler) candidates(logits []float32, history []int32) ([]cand, int32, float64) {
	n := len(logits)
	if n == 0 {
		return nil, -1, 0
	}
	if !(s.p.Temperature > 0) && !s.penalizes(history) && s.json == nil {
		// Greedy with nothing to change: no copy, one pass.
		if top, ok := argmaxFinite(logits); ok {
			return nil, top, 0
		}
	}
	if cap(s.logits) < n {
		s.logits = make([]float32, n)
		s.cands = make([]cand, 0, n)
	}
	if k := s.p.TopK; (k <= 0 || k >= n) && !s.penalizes(history) && s.json == nil && s.p.Temperature > 0 {
		return s.wholeVocabulary(logits)
	}
	l := s.logits[:n]
	for i, x := range logits {
		l[i] = stage.SanitizeLogit(x)
	}
	s.penalize(l, history)
	if s.json != nil {
		if !(s.p.Temperature > 0) {
			// Greedy: the best token, if it fits, is the answer, with no
			// need to try the vocabulary.
			if top := argmax(l); s.json.allowed(top) && !math.IsInf(float64(l[top]), -1) {
				return nil, top, 0
			}
		}
		if !s.json.mask(l) {
			return nil, s.json.fallback(), 0
		}
	}

	top := argmax(l)
	if !(s.p.Temperature > 0) || math.IsInf(float64(l[top]), -1) {
		return nil, top, 0
	}
	maxLogit := float64(l[top])
	invT := 1 / float64(s.p.Temperature)

	var cs []cand
	if k := s.p.TopK; k > 0 && k < n {
		cs = s.topK(l, k)
	} else {
		cs = s.cands[:n]
		for i, x := range l {
			cs[i] = cand{id: int32(i), logit: x}
		}
	}
	return s.weigh(cs, maxLogit, invT)
}

// wholeVocabulary is candidates at a temperature with nothing to change the
// logits and no top-k: every token is a candidate, which one pass over the
// logits sanitizes, lists and finds the best of, where the general path
// takes three (BenchmarkSample/plain).
func (s *Sampler) wholeVocabulary(logits []float32) ([]cand, int32, float64) {
	cs := s.cands[:len(logits)]
	top, best := 0, stage.SanitizeLogit(logits[0])
	for i, x := range logits {
		x = stage.SanitizeLogit(x)
		cs[i] = cand{id: int32(i), logit: x}
		if x > best {
			top, best = i, x
		}
	}
	if math.IsInf(float64(best), -1) {
		return nil, int32(top), 0
	}
	return s.weigh(cs, float64(best), 1/float64(s.p.Temperature))
}

// weigh weighs the candidates against the best logit, maxLogit, at the
// inverse temperature invT, and applies top-p and min-p.
func (s *Sampler) weigh(cs []cand, maxLogit, invT float64) ([]cand, int32, float64) {
	if invT == 0 {
		invT = math.SmallestNonzeroFloat64 // so that -Inf*invT is -Inf, not NaN
	}
	topP := float64(s.p.TopP)
	// While weighing for top-p, move the likely tokens (weight >=
	// headWeight) to the front. They are the best tokens, so when they hold
	// the top-p mass the nucleus is among them and the rest of the
	// vocabulary need not be searched.
	total, head, headMass := 0.0, 0, 0.0
	if topP >= 1 && len(cs) >= weighInParts {
		total = weighParts(cs, maxLogit, invT)
	} else {
		for i := range cs {
			w := expNonPositive((float64(cs[i].logit) - maxLogit) * invT) // 0 for -Inf
			cs[i].w = w
			total += w
			if topP < 1 && w >= headWeight {
				cs[head], cs[i] = cs[i], cs[head]
				head++
				headMass += w
			}
		}
	}
	if topP < 1 {
		target := topP * total * (1 - slack)
		if headMass >= target {
			cs = cs[:nucleus(cs[:head], target)]
		} else {
			cs = cs[:nucleus(cs, target)]
		}
		total = -1 // another set, in another order
	}
	// min-p compares with the best token, whose weight is 1; the best stays
	// whatever min_p says.
	if minP := float64(s.p.MinP) * (1 - slack); minP > 0 {
		kept := cs[:0]
		for _, c := range cs {
			if c.w >= minP || c.w == 1 {
				kept = append(kept, c)
			}
		}
		cs, total = kept, -1
	}
	return cs, -1, total
}

// weighInParts is the size of a vocabulary (a Llama 3's 128K, a Qwen2's
// 152K) whose weights weighParts computes on several cores.
const weighInParts = 1 << 16

// parts is how many slices weighParts cuts the candidates into: a
// constant, so that the sum has the same bits on any machine.
const parts = 8

// weighParts sets every candidate's weight, e^((logit-maxLogit)·invT), and
// returns their sum: each of parts slices summed in order on a core of its
// own, then the slices' sums in order. At temperature 1 with no top-k or
// top-p (the OpenAI default) every token of the vocabulary is weighed
// each step, which took a core about a millisecond for 152K tokens, as
// long as an 8B model's decode step on an H200. On the H200 host (8B, 128K
// vocabulary, temperature 1) one GPU decoded 301 / 1462 tok/s at 1 / 8
// streams with a goroutine a part (run 93), 246 / 1216 with every part on
// the caller's (run 97), and 328-359 / 1259-1267 with workers that kept
// polling between tokens (runs 95-96), which also cost two GPUs a fifth
// of their speed at 8 streams.
func weighParts(cs []cand, maxLogit, invT float64) float64 {
	var sums [parts]float64
	var wg sync.WaitGroup
	for p := range parts {
		part := cs[p*len(cs)/parts : (p+1)*len(cs)/parts]
		wg.Go(func() {
			sum := 0.0
			for i := range part {
				w := expNonPositive((float64(part[i].logit) - maxLogit) * invT)
				part[i].w = w
				sum += w
			}
			sums[p] = sum
		})
	}
	wg.Wait()
	total := 0.0
	for _, sum := range sums {
		total += sum
	}
	return total
}

// headWeight is the weight, relative to the best token's, above which a
// token is likely enough to be looked at first for top-p.
const headWeight = 1e-4

// slack lets a mass or ratio that equals top_p or min_p up to the precision
// of float32 logits count as reaching it, so boundaries behave as the
// arithmetic says rather than flipping on rounding noise.
const slack = 1e-6

// nucleus reorders cs so that cs[:k] is the smallest set of best candidates
// (in the order of better) whose weights sum to at least target, and returns
// k, at least 1. It partitions like quickselect, so it takes linear time
// however large the nucleus is; cs[:k] is left in no particular, but
// deterministic, order.
func nucleus(cs []cand, target float64) int {
	if len(cs) == 0 {
		return 0
	}
	if target <= 0 {
		best := 0
		for i := range cs {
			if better(cs[i], cs[best]) {
				best = i
			}
		}
		cs[0], cs[best] = cs[best], cs[0]
		return 1
	}
	// cs[:lo] is in the nucleus with mass acc < target; it ends in cs[lo:hi].
	lo, hi, acc := 0, len(cs), 0.0
	for hi-lo > 16 {
		p := partition(cs[lo:hi]) + lo
		mass := 0.0
		for _, c := range cs[lo:p] {
			mass += c.w
		}
		switch {
		case acc+mass >= target:
			hi = p
		case acc+mass+cs[p].w >= target:
			return p + 1
		default:
			acc += mass + cs[p].w
			lo = p + 1
		}
	}
	slices.SortFunc(cs[lo:hi], compareCands)
	for i := lo; i < hi; i++ {
		acc += cs[i].w
		if acc >= target {
			return i + 1
		}
	}
	return max(hi, 1) // rounding: the whole range was needed
}

// partition moves the candidates better than a pivot before it and the
// worse ones after it, and returns the pivot's index. The pivot is the
// median of three, so sorted input does not make it quadratic.
func partition(cs []cand) int {
	last := len(cs) - 1
	mid := last / 2
	if better(cs[mid], cs[0]) {
		cs[0], cs[mid] = cs[mid], cs[0]
	}
	if better(cs[last], cs[0]) {
		cs[0], cs[last] = cs[last], cs[0]
	}
	if better(cs[last], cs[mid]) {
		cs[mid], cs[last] = cs[last], cs[mid]
	}
	cs[mid], cs[last] = cs[last], cs[mid] // the median is the pivot, at the end
	pivot, store := cs[last], 0
	for i := range last {
		if better(cs[i], pivot) {
			cs[i], cs[store] = cs[store], cs[i]
			store++
		}
	}
	cs[store], cs[last] = cs[last], cs[store]
	return store
}

// expNonPositive is e^x for x <= 0, with relative error below 1e-14
// (absolute below 1e-321 where e^x is subnormal). It is
// pure arithmetic with explicit rounding and a table of constants, so
// every platform computes the same bits (math.Exp has per-architecture
// assembly), which keeps a request resumed on another node on the same
// tokens. Sampling at a temperature computes one a vocabulary entry (152K
// for Qwen2), so it must be cheap: x = (k/32)·ln2 + r with |r| <= ln2/64
// takes a polynomial of degree 5 and a table of 2^(j/32), where ln2/2
// took degree 11 (2.2 ms a token for 152K entries then, on a 2-core
// machine; see BenchmarkSample).
func expNonPositive(x float64) float64 {
	if !(x >= -745) { // also -Inf and NaN
		return 0
	}
	// ln2/32 split in two for accuracy: k·ln2Hi/32 is exact for the k
	// that occur here (|k| < 2^16).
	const (
		ln2Hi   = 6.93147180369123816490e-01
		ln2Lo   = 1.90821492927058770002e-10
		toSteps = expSteps / math.Ln2
	)
	// k = round(x·32/ln2), ties up; x <= 0, so truncating x·32/ln2 - 0.5
	// is rounding up from it.
	k := int64(float64(x*toSteps) - 0.5)
	kf := float64(k)
	r := float64(x-float64(kf*(ln2Hi/expSteps))) - float64(kf*(ln2Lo/expSteps))
	// Taylor series to r^5, the remainder below 3e-15 for |r| <= ln2/64,
	// evaluated by Estrin's scheme; the conversions stop the compiler
	// fusing multiply-adds on some platforms only.
	r2 := float64(r * r)
	p := float64(1+r) + float64(r2*float64(0.5+float64(r*(1.0/6)))) + float64(float64(r2*r2)*float64(1.0/24+float64(r*(1.0/120))))
	v := float64(p * expTable[k&(expSteps-1)])
	// Scale by 2^m, m = floor(k/32), through the exponent bits;
	// math.Ldexp handles cases that cannot occur here and costs as much as
	// the polynomial.
	m := k >> expShift
	if m < -1022 {
		return math.Ldexp(v, int(m)) // the result is subnormal
	}
	return v * math.Float64frombits(uint64(m+1023)<<52)
}

// expSteps is the steps per octave of expNonPositive's table.
const (
	expShift = 5
	expSteps = 1 << expShift
)

// expTable[j] is 2^(j/32), correctly rounded.
var expTable = [expSteps]float64{
	0x1.0000000000000p+0, // 2^(0/32)
	0x1.059b0d3158574p+0, // 2^(1/32)
	0x1.0b5586cf9890fp+0, // 2^(2/32)
	0x1.11301d0125b51p+0, // 2^(3/32)
	0x1.172b83c7d517bp+0, // 2^(4/32)
	0x1.1d4873168b9aap+0, // 2^(5/32)
	0x1.2387a6e756238p+0, // 2^(6/32)
	0x1.29e9df51fdee1p+0, // 2^(7/32)
	0x1.306fe0a31b715p+0, // 2^(8/32)
	0x1.371a7373aa9cbp+0, // 2^(9/32)
	0x1.3dea64c123422p+0, // 2^(10/32)
	0x1.44e086061892dp+0, // 2^(11/32)
	0x1.4bfdad5362a27p+0, // 2^(12/32)
	0x1.5342b569d4f82p+0, // 2^(13/32)
	0x1.5ab07dd485429p+0, // 2^(14/32)
	0x1.6247eb03a5585p+0, // 2^(15/32)
	0x1.6a09e667f3bcdp+0, // 2^(16/32)
	0x1.71f75e8ec5f74p+0, // 2^(17/32)
	0x1.7a11473eb0187p+0, // 2^(18/32)
	0x1.82589994cce13p+0, // 2^(19/32)
	0x1.8ace5422aa0dbp+0, // 2^(20/32)
	0x1.93737b0cdc5e5p+0, // 2^(21/32)
	0x1.9c49182a3f090p+0, // 2^(22/32)
	0x1.a5503b23e255dp+0, // 2^(23/32)
	0x1.ae89f995ad3adp+0, // 2^(24/32)
	0x1.b7f76f2fb5e47p+0, // 2^(25/32)
	0x1.c199bdd85529cp+0, // 2^(26/32)
	0x1.cb720dcef9069p+0, // 2^(27/32)
	0x1.d5818dcfba487p+0, // 2^(28/32)
	0x1.dfc97337b9b5fp+0, // 2^(29/32)
	0x1.ea4afa2a490dap+0, // 2^(30/32)
	0x1.f50765b6e4540p+0, // 2^(31/32)
}

// draw picks one candidate with probability proportional to its weight;
// total is the sum of the weights in the candidates' order, or negative for
// draw to sum them (a full vocabulary is a pass of its own).
func (s *Sampler) draw(cs []cand, total float64) int32 {
	if total < 0 {
		total = 0
		for _, c := range cs {
			total += c.w
		}
	}
	u := s.rng.Float64() * total
	acc, last := 0.0, cs[0].id
	for _, c := range cs {
		if c.w <= 0 {
			continue
		}
		acc += c.w
		last = c.id
		if u < acc {
			return c.id
		}
	}
	return last // u rounded up to total
}

// penalizes says whether penalize would change any logit.
func (s *Sampler) penalizes(history []int32) bool {
	rp := s.p.RepeatPenalty
	return len(history) > 0 && ((rp > 0 && rp != 1) || s.p.FrequencyPenalty != 0 || s.p.PresencePenalty != 0)
}

// penalize applies the repetition, frequency and presence penalties for the
// tokens in the window.
func (s *Sampler) penalize(l []float32, history []int32) {
	rp, fp, pp := s.p.RepeatPenalty, s.p.FrequencyPenalty, s.p.PresencePenalty
	repeat := rp > 0 && rp != 1
	if (!repeat && fp == 0 && pp == 0) || len(history) == 0 {
		return
	}
	if s.window >= 0 && len(history) > s.window {
		history = history[len(history)-s.window:]
	}
	clear(s.counts)
	for _, t := range history {
		if t >= 0 && int(t) < len(l) {
			s.counts[t]++
		}
	}
	// Each token is changed once, so the map's order does not matter.
	for t, c := range s.counts {
		v := l[t]
		if repeat {
			if v > 0 {
				v /= rp
			} else {
				v *= rp
			}
		}
		v -= float32(float32(c)*fp) + pp // no fused multiply-add: same bits everywhere
		l[t] = stage.SanitizeLogit(v)
	}
}

// argmax returns the index of the largest of logits without NaN, the
// lowest index on ties. argmaxFinite's lanes take it four times as fast as
// a plain loop's compare chain, except where the largest is +Inf (a
// penalty overflowed a sanitized logit).
func argmax(l []float32) int32 {
	if top, ok := argmaxFinite(l); ok {
		return top
	}
	best := 0
	for i, x := range l {
		if x > l[best] {
			best = i
		}
	}
	return int32(best)
}

// argmaxFinite is argmax over sanitized logits without writing them: NaN
// never wins, ties go to the lowest index. Four lanes, each keeping its
// first maximum, break the compare chain; merging them by value, then by
// index, gives the first maximum overall. It gives up (false) when the
// maximum is +Inf, which stage.SanitizeLogit would tie with MaxFloat32.
func argmaxFinite(l []float32) (int32, bool) {
	ninf := float32(math.Inf(-1))
	var best [4]float32
	var at [4]int
	for j := range best {
		best[j], at[j] = ninf, -1
	}
	i := 0
	for ; i+4 <= len(l); i += 4 {
		x := l[i : i+4 : i+4]
		if x[0] > best[0] {
			best[0], at[0] = x[0], i
		}
		if x[1] > best[1] {
			best[1], at[1] = x[1], i+1
		}
		if x[2] > best[2] {
			best[2], at[2] = x[2], i+2
		}
		if x[3] > best[3] {
			best[3], at[3] = x[3], i+3
		}
	}
	for ; i < len(l); i++ {
		if l[i] > best[0] {
			best[0], at[0] = l[i], i
		}
	}
	top, v := -1, ninf
	for j := range best {
		if at[j] >= 0 && (best[j] > v || (best[j] == v && at[j] < top)) {
			top, v = at[j], best[j]
		}
	}
	if top < 0 {
		return 0, true // every logit NaN or -Inf: all sanitize to -Inf, the first wins
	}
	if math.IsInf(float64(v), 1) {
		return 0, false
	}
	return int32(top), true
}

// better orders candidates: higher logit first, then lower id, so that the
// order is total and the selection deterministic.
func better(a, b cand) bool {
	return a.logit > b.logit || (a.logit == b.logit && a.id < b.id)
}

func compareCands(a, b cand) int {
	switch {
	case better(a, b):
		return -1
	case better(b, a):
		return 1
	}
	return 0
}

// topK returns the k best tokens, best first, in s.cands. A heap of the k
// best so far costs one comparison for most tokens, instead of sorting the
// vocabulary.
func (s *Sampler) topK(l []float32, k int) []cand {
	h := s.cands[:0]
	if k >= len(l) {
		for i, x := range l {
			h = append(h, cand{id: int32(i), logit: x})
		}
		slices.SortFunc(h, compareCands)
		return h
	}
	// h is a min-heap: its root is the worst of the best k so far.
	for i, x := range l {
		c := cand{id: int32(i), logit: x}
		if len(h) < k {
			h = append(h, c)
			for j := len(h) - 1; j > 0; {
				parent := (j - 1) / 2
				if !better(h[parent], h[j]) {
					break
				}
				h[parent], h[j] = h[j], h[parent]
				j = parent
			}
			continue
		}
		if x < h[0].logit || !better(c, h[0]) {
			continue
		}
		h[0] = c
		for j := 0; ; {
			worst, left, right := j, 2*j+1, 2*j+2
			if left < k && better(h[worst], h[left]) {
				worst = left
			}
			if right < k && better(h[worst], h[right]) {
				worst = right
			}
			if worst == j {
				break
			}
			h[j], h[worst] = h[worst], h[j]
			j = worst
		}
	}
	slices.SortFunc(h, compareCands)
	return h
}
