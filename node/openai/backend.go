// Package openai serves models through an OpenAI-compatible HTTP API
// (/v1/models, /v1/chat/completions, /v1/completions). It only speaks HTTP:
// tokenization, scheduling and generation belong to the Backend.
package openai

import (
	"context"
	"errors"
)

// Backend is what the HTTP layer needs from the node: the models it serves.
type Backend interface {
	// Models lists the served models, for GET /v1/models.
	Models() []ModelInfo
	// Model looks a model up by the id a client sent; false gives a 404
	// model_not_found. Aliases are fine: responses carry Info().ID.
	Model(id string) (Model, bool)
}

// ModelInfo describes a served model.
type ModelInfo struct {
	ID            string
	Created       int64 // unix seconds
	OwnedBy       string
	ContextLength int // tokens; 0 if unknown
}

// Message is one chat turn. Role is "system", "user" or "assistant"
// ("developer" arrives as "system"); array content is already joined.
type Message struct {
	Role    string
	Content string
}

// Model is one served model.
type Model interface {
	Info() ModelInfo
	// ChatPrompt applies the model's chat template (with the generation
	// prompt for the assistant turn) and tokenizes the result.
	ChatPrompt(msgs []Message) ([]int32, error)
	// Prompt tokenizes a raw completion prompt, adding BOS as the model wants.
	Prompt(s string) ([]int32, error)
	// Generate starts generating. Errors known before the first token (queue
	// full, prompt too long, bad parameter) must be returned here, wrapping
	// the sentinels below, so that they become proper HTTP statuses.
	//
	// The channel delivers text pieces, then one final event with Done (or
	// one with Err), then closes. Cancelling ctx (client gone) must stop
	// generation and close the channel; sends must therefore select on
	// ctx.Done().
	Generate(ctx context.Context, req GenerateRequest) (<-chan Event, error)
}

// GenerateRequest is one generation, validated by the HTTP layer. Omitted
// sampling parameters arrive as OpenAI's defaults: Temperature 1, TopP 1,
// RepeatPenalty 1, penalties 0; TopK 0 and MinP 0 mean "filter disabled".
type GenerateRequest struct {
	RequestID string
	Prompt    []int32
	// MaxTokens is at least 1 and at most Config.MaxTokensCap. When the
	// client gave no limit it is the cap, lowered to the room left in the
	// context when ContextLength is known.
	MaxTokens   int
	Stop        []string // at most 4, none empty
	Temperature float32  // [0, 2]; 0 means greedy
	TopK        int      // >= 0
	TopP        float32  // (0, 1]
	MinP        float32  // [0, 1]
	Seed        *int64

	RepeatPenalty    float32 // > 0
	FrequencyPenalty float32 // [-2, 2]
	PresencePenalty  float32 // [-2, 2]

	// Logprobs asks for each generated token's log-probability, with
	// TopLogprobs (0..20) alternatives.
	Logprobs    bool
	TopLogprobs int
	// JSON keeps the reply one JSON object (response_format json_object):
	// tokens that would break it are never sampled, and it ends when the
	// object closes (or at MaxTokens, cut short). JSONSchema (json_schema)
	// is the schema the object must follow, as the client sent it; the
	// backend refuses one it cannot follow with ErrInvalidParam.
	JSON       bool
	JSONSchema string
}

// Event is one step of a generation.
type Event struct {
	Text string // valid UTF-8, stop strings already removed
	// Logprobs are those of the tokens behind Text (and of tokens of no
	// text), when the request asked for them; each token is listed once.
	Logprobs     []TokenLogprob
	Done         bool
	FinishReason string // "stop" or "length" when Done
	Usage        Usage  // set on the final event
	Err          error  // generation failed mid-way; the last event
}

// TokenLogprob is a generated token's log-probability (natural log, -Inf
// for an impossible token) and the likeliest alternatives, best first.
type TokenLogprob struct {
	Token   string // the token's bytes; may be part of a UTF-8 character
	Logprob float32
	Top     []TopLogprob
}

// TopLogprob is one of the likeliest tokens at a position.
type TopLogprob struct {
	Token   string
	Logprob float32
}

// Usage counts tokens as OpenAI reports them.
type Usage struct {
	PromptTokens     int
	CompletionTokens int
	TotalTokens      int
}

// Sentinel errors the backend wraps (fmt.Errorf("...: %w", ErrX)) so that
// the HTTP layer can pick the status; the wrapped message reaches the client.
var (
	// ErrOverloaded: the queue is full. 429 with Retry-After.
	ErrOverloaded = errors.New("server overloaded")
	// ErrContextLength: prompt (plus max_tokens) does not fit the context.
	// 400 with code context_length_exceeded.
	ErrContextLength = errors.New("context length exceeded")
	// ErrInvalidParam: a request the backend cannot serve as asked. 400.
	ErrInvalidParam = errors.New("invalid parameter")
	// ErrUnavailable: the model cannot serve now (loading, draining).
	// 503 with Retry-After.
	ErrUnavailable = errors.New("model unavailable")
)
