package pipeline

import (
	"context"
	"math"
	"slices"
	"testing"

	"github.com/meshnode/meshnode/node/sample"
	"github.com/meshnode/meshnode/stage"
)

// TestPipelineLogprobs: across three stages over gRPC, the last stage
// returns the log-probabilities of the sequence that asked for them (and an
// empty entry for the one beside it in the batch that did not), equal to
// those of the unsplit engine's logits.
func TestPipelineLogprobs(t *testing.T) {
	const top = 3
	want := referenceTrace(t, twoSeqs)
	m := newMesh(t, threeStages, engineOpts)
	p := m.pipeline(t, Config{WireDType: stage.F32})
	openAll(t, p, twoSeqs, func(i int) sample.Params {
		q := greedy()
		if i == 0 {
			q.Logprobs, q.TopLogprobs = true, top
		}
		return q
	})
	vocab := p.Info().Vocab
	b := twoSeqs.prefill()
	for step := 0; step <= twoSeqs.steps; step++ {
		picked, err := p.Forward(context.Background(), b)
		if err != nil {
			t.Fatalf("step %d: %v", step, err)
		}
		if !slices.Equal(picked.Tokens, want.tokens[step]) {
			t.Fatalf("step %d: tokens %v, want %v", step, picked.Tokens, want.tokens[step])
		}
		if len(picked.Logprobs) != 2 {
			t.Fatalf("step %d: %d log-probabilities, want one per row", step, len(picked.Logprobs))
		}
		ref := sample.LogprobOf(want.logits[step][:vocab], want.tokens[step][0], top)
		got := picked.Logprobs[0]
		if math.Abs(float64(got.Logprob-ref.Logprob)) > 1e-5 || len(got.Top) != top {
			t.Fatalf("step %d: %+v, unsplit %+v", step, got, ref)
		}
		for k := range top {
			if got.Top[k].Token != ref.Top[k].Token || math.Abs(float64(got.Top[k].Logprob-ref.Top[k].Logprob)) > 1e-5 {
				t.Fatalf("step %d alternative %d: %+v, unsplit %+v", step, k, got.Top[k], ref.Top[k])
			}
		}
		if other := picked.Logprobs[1]; other.Logprob != 0 || other.Top != nil {
			t.Fatalf("step %d: the sequence that did not ask got %+v", step, other)
		}
		b = twoSeqs.decode(step, picked.Tokens)
	}
}
