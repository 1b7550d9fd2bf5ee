package pipeline

import (
	"fmt"
	"math/rand/v2"

	"github.com/meshnode/meshnode/node/sample"
	"github.com/meshnode/meshnode/node/wire"
)

// samplingToWire carries p to the last stage. A nil seed becomes a random
// one here, at the origin, so that the sequence's stream is fixed from now
// on and could be replayed elsewhere.
func samplingToWire(p sample.Params) *wire.Sampling {
	seed := rand.Uint64()
	if p.Seed != nil {
		seed = uint64(*p.Seed)
	}
	return &wire.Sampling{
		Temperature:      p.Temperature,
		TopK:             p.TopK,
		TopP:             p.TopP,
		MinP:             p.MinP,
		Seed:             seed,
		RepeatPenalty:    p.RepeatPenalty,
		RepeatLastN:      p.RepeatLastN,
		FrequencyPenalty: p.FrequencyPenalty,
		PresencePenalty:  p.PresencePenalty,
		Logprobs:         p.Logprobs,
		TopLogprobs:      p.TopLogprobs,
		JSON:             p.JSON,
		JSONFrom:         p.JSONFrom,
		JSONSchema:       p.JSONSchema,
	}
}

// samplingFromWire is the last stage's side: nil (no parameters sent) is
// greedy, and the wire's zero values for top_p and repeat_penalty mean off.
// The result is validated as the origin's API would.
func samplingFromWire(s *wire.Sampling) (sample.Params, error) {
	p := sample.DefaultParams()
	if s == nil {
		p.Temperature = 0
		return p, nil
	}
	seed := int64(s.Seed)
	p = sample.Params{
		Temperature:      s.Temperature,
		TopK:             s.TopK,
		TopP:             s.TopP,
		MinP:             s.MinP,
		Seed:             &seed,
		RepeatPenalty:    s.RepeatPenalty,
		RepeatLastN:      s.RepeatLastN,
		FrequencyPenalty: s.FrequencyPenalty,
		PresencePenalty:  s.PresencePenalty,
		Logprobs:         s.Logprobs,
		TopLogprobs:      s.TopLogprobs,
		JSON:             s.JSON,
		JSONFrom:         s.JSONFrom,
		JSONSchema:       s.JSONSchema,
	}
	if p.TopP == 0 {
		p.TopP = 1
	}
	if p.RepeatPenalty == 0 {
		p.RepeatPenalty = 1
	}
	if err := p.Validate(); err != nil {
		return sample.Params{}, fmt.Errorf("%w: sampling: %w", wire.ErrBadFrame, err)
	}
	return p, nil
}
