package node

import (
	"context"
	"errors"
	"fmt"

	"github.com/meshnode/meshnode/node/admin"
	"github.com/meshnode/meshnode/node/openai"
	"github.com/meshnode/meshnode/node/sample"
	"github.com/meshnode/meshnode/node/scheduler"
	"github.com/meshnode/meshnode/node/text"
)

// backend exposes the node's models to the HTTP layer.
type backend struct{ m *Model }

func (b backend) Models() []openai.ModelInfo { return []openai.ModelInfo{b.m.Info()} }

func (b backend) Model(id string) (openai.Model, bool) {
	if id == b.m.id || id == b.m.id+".gguf" {
		return b.m, true
	}
	return nil, false
}

// Info describes the model for /v1/models.
func (m *Model) Info() openai.ModelInfo {
	return openai.ModelInfo{ID: m.id, Created: m.created, OwnedBy: "meshnode", ContextLength: m.info.Context}
}

// ChatPrompt renders the chat template and tokenizes it. The tokenizer adds
// BOS itself when the model wants one, so the template must not.
func (m *Model) ChatPrompt(msgs []openai.Message) ([]int32, error) {
	tm := make([]text.Message, len(msgs))
	for i, msg := range msgs {
		tm[i] = text.Message{Role: msg.Role, Content: msg.Content}
	}
	prompt, _, err := text.Render(m.chat.template, tm, text.RenderOptions{
		BOS: m.chat.bos, EOS: m.chat.eos, EmitBOS: false,
		AddGenerationPrompt: true, HasToken: m.tok.HasToken,
	})
	if err != nil {
		return nil, fmt.Errorf("%w: %w", openai.ErrInvalidParam, err)
	}
	return m.tok.Encode(prompt, true)
}

// Prompt tokenizes a completion prompt.
func (m *Model) Prompt(s string) ([]int32, error) { return m.tok.Encode(s, true) }

// Generate submits to the scheduler and relays its events.
func (m *Model) Generate(ctx context.Context, req openai.GenerateRequest) (<-chan openai.Event, error) {
	obs := m.mesh.obs
	if err := m.admit(); err != nil {
		obs.metrics.Rejected("unavailable")
		return nil, fmt.Errorf("%w: %w", openai.ErrUnavailable, err)
	}
	tracked := obs.newRequest(len(req.Prompt))
	in, err := m.sched.Submit(ctx, scheduler.Request{
		ID: req.RequestID, Prompt: req.Prompt, MaxTokens: req.MaxTokens, Stop: req.Stop,
		Sampling: sample.Params{
			Temperature: req.Temperature, TopK: req.TopK, TopP: req.TopP, MinP: req.MinP, Seed: req.Seed,
			RepeatPenalty: req.RepeatPenalty, FrequencyPenalty: req.FrequencyPenalty, PresencePenalty: req.PresencePenalty,
			Logprobs: req.Logprobs, TopLogprobs: req.TopLogprobs, JSON: req.JSON, JSONSchema: req.JSONSchema,
		},
	})
	if err != nil {
		obs.metrics.Rejected(rejectKind(err))
	}
	switch {
	case errors.Is(err, scheduler.ErrOverloaded):
		return nil, fmt.Errorf("%w: %w", openai.ErrOverloaded, err)
	case errors.Is(err, scheduler.ErrContextLength):
		return nil, fmt.Errorf("%w: %w", openai.ErrContextLength, err)
	case errors.Is(err, scheduler.ErrClosed):
		return nil, fmt.Errorf("%w: %w", openai.ErrUnavailable, err)
	case err != nil:
		return nil, fmt.Errorf("%w: %w", openai.ErrInvalidParam, err)
	}
	out := make(chan openai.Event)
	go relay(ctx, in, out, tracked)
	return out, nil
}

// rejectKind names a refusal for meshnode_errors_total.
func rejectKind(err error) string {
	switch {
	case errors.Is(err, scheduler.ErrOverloaded):
		return "overloaded"
	case errors.Is(err, scheduler.ErrContextLength):
		return "context_length"
	case errors.Is(err, scheduler.ErrClosed):
		return "unavailable"
	}
	return "invalid_request"
}

// relay copies scheduler events to the HTTP layer until the scheduler
// closes its channel (which it does when ctx ends, too).
func relay(ctx context.Context, in <-chan scheduler.Event, out chan<- openai.Event, r *request) {
	defer close(out)
	recorded := false
	record := func(outcome string, completion int) {
		if !recorded {
			recorded = true
			r.done(outcome, completion)
		}
	}
	defer record(admin.OutcomeCancelled, 0)
	for ev := range in {
		r.token()
		// The end is recorded before the client sees it.
		switch {
		case ev.Done:
			record(admin.OutcomeOK, ev.CompletionTokens)
		case ev.Err != nil && ctx.Err() == nil && !errors.Is(ev.Err, context.Canceled):
			record(admin.OutcomeError, ev.CompletionTokens)
		case ev.Err != nil:
			record(admin.OutcomeCancelled, ev.CompletionTokens)
		}
		o := openai.Event{Text: ev.Text, Logprobs: apiLogprobs(ev.Logprobs), Done: ev.Done, FinishReason: ev.FinishReason, Err: ev.Err}
		if ev.Done || ev.Err != nil {
			o.Usage = openai.Usage{PromptTokens: ev.PromptTokens, CompletionTokens: ev.CompletionTokens,
				TotalTokens: ev.PromptTokens + ev.CompletionTokens}
		}
		select {
		case out <- o:
		case <-ctx.Done():
			for range in { // the scheduler closes it promptly once ctx is done
			}
			return
		}
	}
}

// apiLogprobs hands the scheduler's log-probabilities to the HTTP layer.
func apiLogprobs(lps []scheduler.TokenLogprob) []openai.TokenLogprob {
	if lps == nil {
		return nil
	}
	out := make([]openai.TokenLogprob, len(lps))
	for i, lp := range lps {
		out[i] = openai.TokenLogprob{Token: lp.Token, Logprob: lp.Logprob, Top: make([]openai.TopLogprob, len(lp.Top))}
		for k, t := range lp.Top {
			out[i].Top[k] = openai.TopLogprob(t)
		}
	}
	return out
}
