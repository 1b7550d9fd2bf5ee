package scheduler

// minPromptChunk is the smallest prompt chunk a pipelined round cuts: below
// it a stage's fixed cost per batch outweighs the overlap.
const minPromptChunk = 32

// want describes one active sequence to the batch policy.
type want struct {
	prefill int // prompt tokens not yet fed through the model
}

// planBatch decides how many tokens each active sequence puts into the next
// forward pass, given a budget of tokens per pass. It is a pure function so
// that the policy is tested on its own.
//
// Decoding sequences go first, one token each: they are what users watch,
// and a decode token costs the same pass as a prefill token. What budget is
// left goes to prefilling sequences in order of arrival, in chunks, so a
// long prompt cannot stall everyone else's stream (chunked prefill).
func planBatch(ws []want, budget int) []int {
	take := make([]int, len(ws))
	for i, w := range ws {
		if w.prefill == 0 && budget > 0 {
			take[i] = 1
			budget--
		}
	}
	for i, w := range ws {
		if w.prefill > 0 && budget > 0 {
			n := min(w.prefill, budget)
			take[i] = n
			budget -= n
		}
	}
	return take
}
