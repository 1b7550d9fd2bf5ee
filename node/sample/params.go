package sample

import (
	"errors"
	"fmt"
	"math"
)

// ErrInvalidParams is wrapped by every Validate error; the HTTP layer maps it
// to 400.
var ErrInvalidParams = errors.New("invalid sampling parameters")

// DefaultRepeatLastN is the penalty window used when RepeatLastN is 0.
const DefaultRepeatLastN = 64

// Params are the sampling parameters of one request. The zero value is not
// valid (TopP and RepeatPenalty must be set); start from DefaultParams.
type Params struct {
	Temperature float32 // 0..2; 0 is greedy
	TopK        int     // 0 is off
	TopP        float32 // (0, 1]; 1 is off
	MinP        float32 // [0, 1); 0 is off
	Seed        *int64  // nil: a random seed

	RepeatPenalty float32 // > 0; 1 is off
	// RepeatLastN is how many of the latest history tokens the penalties
	// look at: 0 means DefaultRepeatLastN, -1 the whole history.
	RepeatLastN      int
	FrequencyPenalty float32 // -2..2
	PresencePenalty  float32 // -2..2

	// Logprobs asks for each sampled token's log-probability (see
	// LogprobOf), with TopLogprobs (0..MaxTopLogprobs) alternatives.
	Logprobs    bool
	TopLogprobs int

	// JSON keeps the output one JSON object (OpenAI's response_format
	// json_object; see JSONConstraint). JSONFrom is where in the history
	// the output starts (the prompt's length), so that a replayed
	// sequence's constraint resumes after what it already generated.
	JSON     bool
	JSONFrom int
	// JSONSchema, with JSON, is a JSON Schema the object must follow (see
	// ParseSchema); empty: any object.
	JSONSchema string
}

// Schema parses JSONSchema; nil when there is none.
func (p Params) Schema() (*Schema, error) {
	if p.JSONSchema == "" {
		return nil, nil
	}
	return ParseSchema([]byte(p.JSONSchema))
}

// DefaultParams are OpenAI's defaults: temperature 1, no filters, no
// penalties.
func DefaultParams() Params {
	return Params{Temperature: 1, TopP: 1, RepeatPenalty: 1, RepeatLastN: DefaultRepeatLastN}
}

// Validate checks the ranges OpenAI's API and llama.cpp accept. The error
// names the parameter as the API spells it.
func (p Params) Validate() error {
	// Comparisons are written so that NaN fails them.
	bad := func(name string, v any, want string) error {
		return fmt.Errorf("%s is %v, want %s: %w", name, v, want, ErrInvalidParams)
	}
	switch {
	case !(p.Temperature >= 0 && p.Temperature <= 2):
		return bad("temperature", p.Temperature, "0 to 2")
	case p.TopK < 0:
		return bad("top_k", p.TopK, "0 (off) or more")
	case !(p.TopP > 0 && p.TopP <= 1):
		return bad("top_p", p.TopP, "above 0 and at most 1")
	case !(p.MinP >= 0 && p.MinP < 1):
		return bad("min_p", p.MinP, "at least 0 and below 1")
	case !(p.RepeatPenalty > 0) || math.IsInf(float64(p.RepeatPenalty), 1):
		return bad("repeat_penalty", p.RepeatPenalty, "above 0 (1 is off)")
	case p.RepeatLastN < -1:
		return bad("repeat_last_n", p.RepeatLastN, "-1 (whole history), 0 (default 64) or more")
	case !(p.FrequencyPenalty >= -2 && p.FrequencyPenalty <= 2):
		return bad("frequency_penalty", p.FrequencyPenalty, "-2 to 2")
	case !(p.PresencePenalty >= -2 && p.PresencePenalty <= 2):
		return bad("presence_penalty", p.PresencePenalty, "-2 to 2")
	case p.TopLogprobs < 0 || p.TopLogprobs > MaxTopLogprobs:
		return bad("top_logprobs", p.TopLogprobs, fmt.Sprintf("0 to %d", MaxTopLogprobs))
	case p.TopLogprobs > 0 && !p.Logprobs:
		return bad("top_logprobs", p.TopLogprobs, "0 unless logprobs is set")
	case p.JSONFrom < 0:
		return bad("json_from", p.JSONFrom, "0 or more")
	case p.JSONSchema != "" && !p.JSON:
		return bad("json_schema", "set", "only with JSON output")
	}
	if _, err := p.Schema(); err != nil {
		return fmt.Errorf("response_format json_schema: %w: %w", err, ErrInvalidParams)
	}
	return nil
}
