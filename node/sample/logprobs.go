package sample

import (
	"math"
	"slices"

	"github.com/meshnode/meshnode/stage"
)

// MaxTopLogprobs is the most alternatives a token's log-probability may
// come with, as in OpenAI's API.
const MaxTopLogprobs = 20

// Logprob is a sampled token's log-probability under the model's own
// distribution, the softmax of the raw logits (before penalties,
// temperature and filters, as vLLM and OpenAI report it), with the most
// likely tokens of that distribution, best first.
type Logprob struct {
	Logprob float32
	Top     []TopLogprob
}

// TopLogprob is one of the likeliest tokens at a position.
type TopLogprob struct {
	Token   int32
	Logprob float32
}

// Picked are the tokens sampled for a batch's output rows, in row order,
// and the log-probabilities of the rows whose sequence asked for them
// (Params.Logprobs): Logprobs is empty when no row asked, else it has one
// entry per row, zero for the rows that did not ask.
type Picked struct {
	Tokens   []int32
	Logprobs []Logprob
}

// LogprobOf returns tok's log-probability in the softmax of logits and the
// top most likely tokens (best first; ties to the lower id). NaN logits
// count as -Inf and +Inf as the largest finite value, as in Sample. The
// normalizer is summed in float64 over the whole vocabulary.
func LogprobOf(logits []float32, tok int32, top int) Logprob {
	if len(logits) == 0 || tok < 0 || int(tok) >= len(logits) {
		return Logprob{Logprob: float32(math.Inf(-1))}
	}
	maxLogit := math.Inf(-1)
	for _, x := range logits {
		maxLogit = max(maxLogit, float64(stage.SanitizeLogit(x)))
	}
	if math.IsInf(maxLogit, -1) {
		// Nothing has any mass: every token is impossible alike.
		lp := Logprob{Logprob: float32(math.Inf(-1))}
		for i := range min(top, len(logits)) {
			lp.Top = append(lp.Top, TopLogprob{Token: int32(i), Logprob: lp.Logprob})
		}
		return lp
	}
	sum := 0.0
	for _, x := range logits {
		sum += expNonPositive(float64(stage.SanitizeLogit(x)) - maxLogit)
	}
	logZ := maxLogit + math.Log(sum) // sum >= 1: the maximum adds exp(0)
	of := func(x float32) float32 { return float32(min(float64(stage.SanitizeLogit(x))-logZ, 0)) }
	lp := Logprob{Logprob: of(logits[tok])}
	if top <= 0 {
		return lp
	}
	best := topN(logits, min(top, len(logits)))
	lp.Top = make([]TopLogprob, len(best))
	for i, c := range best {
		lp.Top[i] = TopLogprob{Token: c.id, Logprob: of(c.logit)}
	}
	return lp
}

// topN returns the n best tokens of logits (sanitized), best first, keeping
// a sorted list of the best so far: most tokens cost one comparison.
func topN(logits []float32, n int) []cand {
	best := make([]cand, 0, n+1)
	for i, x := range logits {
		c := cand{id: int32(i), logit: stage.SanitizeLogit(x)}
		if len(best) == n && !better(c, best[n-1]) {
			continue
		}
		at, _ := slices.BinarySearchFunc(best, c, compareCands)
		best = slices.Insert(best, at, c)
		if len(best) > n {
			best = best[:n]
		}
	}
	return best
}
