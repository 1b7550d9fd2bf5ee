package openai

import (
	"context"
	"crypto/rand"
	"encoding/json"
	"errors"
	"fmt"
	"net/http"
	"strings"
	"sync"
	"time"
)

func (s *server) chatCompletions(w http.ResponseWriter, r *http.Request) {
	data, e := readBody(r, s.cfg.MaxBodyBytes)
	if e != nil {
		s.writeError(w, r, e)
		return
	}
	req, e := parseChatRequest(data)
	if e != nil {
		s.writeError(w, r, e)
		return
	}
	m, ok := s.b.Model(req.model)
	if !ok {
		s.writeError(w, r, modelNotFound(req.model))
		return
	}
	prompt, err := m.ChatPrompt(req.messages)
	if err != nil {
		s.writeError(w, r, backendError(err, "chat prompt", "messages"))
		return
	}
	s.generate(w, r, m, &req.genParams, prompt, chatAPI)
}

func (s *server) completions(w http.ResponseWriter, r *http.Request) {
	data, e := readBody(r, s.cfg.MaxBodyBytes)
	if e != nil {
		s.writeError(w, r, e)
		return
	}
	req, e := parseCompletionRequest(data)
	if e != nil {
		s.writeError(w, r, e)
		return
	}
	m, ok := s.b.Model(req.model)
	if !ok {
		s.writeError(w, r, modelNotFound(req.model))
		return
	}
	prompt := req.tokens
	if prompt == nil {
		var err error
		if prompt, err = m.Prompt(req.text); err != nil {
			s.writeError(w, r, backendError(err, "prompt", "prompt"))
			return
		}
	}
	s.generate(w, r, m, &req.genParams, prompt, completionAPI)
}

// api tells the two endpoints' response shapes apart.
type api int

const (
	chatAPI api = iota
	completionAPI
)

func (a api) promptParam() string {
	if a == chatAPI {
		return "messages"
	}
	return "prompt"
}

// maxTokens turns the client's limit (0: none) into the backend's.
func (s *server) maxTokens(p *genParams, info ModelInfo, promptLen int, a api) (int, *apiError) {
	if info.ContextLength > 0 && promptLen >= info.ContextLength {
		return 0, invalidRequest(a.promptParam(), "context_length_exceeded",
			"This model's maximum context length is %d tokens, but the prompt is %d tokens.", info.ContextLength, promptLen)
	}
	if p.maxTokens > 0 {
		// Prompt plus max_tokens beyond the context is the backend's call:
		// it may refuse (ErrContextLength) or stop at the context end.
		return min(p.maxTokens, s.cfg.MaxTokensCap), nil
	}
	n := s.cfg.MaxTokensCap
	if info.ContextLength > 0 {
		n = min(n, info.ContextLength-promptLen)
	}
	return n, nil
}

func (s *server) generate(w http.ResponseWriter, r *http.Request, m Model, p *genParams, prompt []int32, a api) {
	info := m.Info()
	li := infoOf(r)
	li.model, li.stream, li.promptTokens = info.ID, p.stream, len(prompt)

	maxTok, e := s.maxTokens(p, info, len(prompt), a)
	if e != nil {
		s.writeError(w, r, e)
		return
	}
	// Our own cancel stops generation when a write fails, which the request
	// context alone would not notice until the handler returns.
	ctx, cancel := context.WithCancel(r.Context())
	defer cancel()
	req := GenerateRequest{
		RequestID:        li.id,
		Prompt:           prompt,
		MaxTokens:        maxTok,
		Stop:             p.stop,
		Temperature:      p.temperature,
		TopK:             p.topK,
		TopP:             p.topP,
		MinP:             p.minP,
		Seed:             p.seed,
		RepeatPenalty:    p.repeatPenalty,
		FrequencyPenalty: p.frequencyPenalty,
		PresencePenalty:  p.presencePenalty,
		Logprobs:         p.logprobs,
		TopLogprobs:      p.topLogprobs,
		JSON:             p.jsonObject,
		JSONSchema:       p.jsonSchema,
	}
	// Each of n choices is a generation of its own; with a seed, choice i
	// draws with seed+i, so that the choices differ and repeat alike.
	chans := make([]<-chan Event, 0, p.n)
	for i := range p.n {
		ri := req
		if p.seed != nil && i > 0 {
			ri.Seed = new(*p.seed + int64(i))
		}
		if p.n > 1 {
			ri.RequestID = fmt.Sprintf("%s/%d", li.id, i)
		}
		events, err := m.Generate(ctx, ri)
		if err != nil {
			cancel()
			for _, ch := range chans {
				go drain(ch)
			}
			if r.Context().Err() != nil {
				return // client gone; nobody to tell
			}
			s.writeError(w, r, backendError(err, "generate", a.promptParam()))
			return
		}
		chans = append(chans, events)
	}
	events := merge(chans)
	// Whatever way we leave, the backend must not block on a send nobody reads.
	defer func() { go drainIndexed(events) }()

	out := &responder{
		id:       idPrefix(a) + rand.Text(),
		created:  time.Now().Unix(),
		model:    info.ID,
		api:      a,
		logprobs: p.logprobs,
		offsets:  make([]int, p.n),
	}
	if p.stream {
		s.stream(ctx, w, r, events, p.n, out, p.includeUsage, len(prompt))
	} else {
		s.collect(ctx, w, r, events, p.n, out, len(prompt))
	}
}

// indexed is an event of choice i.
type indexed struct {
	i  int
	ev Event
}

// merge interleaves the choices' events in the order they come. Each
// forwarding goroutine ends when its channel closes, which the backend
// does once the request's context ends; merged closes after the last.
func merge(chans []<-chan Event) <-chan indexed {
	merged := make(chan indexed)
	var wg sync.WaitGroup
	for i, ch := range chans {
		wg.Go(func() {
			for ev := range ch {
				merged <- indexed{i, ev}
			}
		})
	}
	go func() { wg.Wait(); close(merged) }()
	return merged
}

func drain(events <-chan Event) {
	for range events {
	}
}

func drainIndexed(events <-chan indexed) {
	for range events {
	}
}

func idPrefix(a api) string {
	if a == chatAPI {
		return "chatcmpl-"
	}
	return "cmpl-"
}

var errNoFinalEvent = errors.New("generation ended without a final event")

// next waits for the next event; ok is false when the client is gone.
func next(ctx context.Context, events <-chan indexed) (ev indexed, ok bool) {
	select {
	case <-ctx.Done():
		return indexed{}, false
	case ev, open := <-events:
		if !open {
			if ctx.Err() != nil {
				return indexed{}, false
			}
			ev = indexed{ev: Event{Err: errNoFinalEvent}}
		}
		return ev, true
	}
}

// finish fills in what a backend may leave out of the final event.
func finish(ev Event, promptLen int) (string, Usage) {
	reason := ev.FinishReason
	if reason == "" {
		reason = "stop"
	}
	u := ev.Usage
	if u.PromptTokens == 0 {
		u.PromptTokens = promptLen
	}
	if u.TotalTokens == 0 {
		u.TotalTokens = u.PromptTokens + u.CompletionTokens
	}
	return reason, u
}

// usageOf sums the choices' usage: the prompt counts once.
func usageOf(us []Usage) Usage {
	var total Usage
	for _, u := range us {
		total.PromptTokens = max(total.PromptTokens, u.PromptTokens)
		total.CompletionTokens += u.CompletionTokens
	}
	total.TotalTokens = total.PromptTokens + total.CompletionTokens
	return total
}

func (s *server) collect(ctx context.Context, w http.ResponseWriter, r *http.Request, events <-chan indexed, n int, out *responder, promptLen int) {
	texts := make([]strings.Builder, n)
	lps := make([][]TokenLogprob, n)
	reasons := make([]string, n)
	usages := make([]Usage, n)
	li := infoOf(r)
	for left := n; left > 0; {
		ie, ok := next(ctx, events)
		if !ok {
			li.err = "client disconnected"
			return
		}
		ev := ie.ev
		if ev.Err != nil {
			s.writeError(w, r, backendError(ev.Err, "generate", out.api.promptParam()))
			return
		}
		texts[ie.i].WriteString(ev.Text)
		lps[ie.i] = append(lps[ie.i], ev.Logprobs...)
		if ev.Done {
			reasons[ie.i], usages[ie.i] = finish(ev, promptLen)
			left--
		}
	}
	u := usageOf(usages)
	li.completionTokens, li.finishReason = u.CompletionTokens, reasons[0]
	choices := make([]string, n)
	for i := range texts {
		choices[i] = texts[i].String()
	}
	s.writeJSON(w, http.StatusOK, out.full(choices, lps, reasons, u))
}

func (s *server) stream(ctx context.Context, w http.ResponseWriter, r *http.Request, events <-chan indexed, n int, out *responder, includeUsage bool, promptLen int) {
	li := infoOf(r)
	sse := &sseWriter{w: w, rc: http.NewResponseController(w), timeout: s.cfg.WriteTimeout}
	defer func() {
		if sse.failed != nil && li.err == "" {
			li.err = sse.failed.Error()
		}
	}()
	h := w.Header()
	h.Set("Content-Type", "text/event-stream")
	h.Set("Cache-Control", "no-cache")
	h.Set("X-Accel-Buffering", "no") // keep proxies from buffering the stream
	w.WriteHeader(http.StatusOK)

	out.includeUsage = includeUsage
	if out.api == chatAPI {
		for i := range n {
			if sse.send(out.chunk(i, new(""), nil, true, "")) != nil {
				return
			}
		}
	} else if sse.flush() != nil {
		// Completions have no opening chunk; send the headers now so the
		// client knows the request was taken before the first token comes.
		return
	}
	usages := make([]Usage, n)
	for left := n; left > 0; {
		ie, ok := next(ctx, events)
		if !ok {
			li.err = "client disconnected"
			return
		}
		ev := ie.ev
		if ev.Err != nil {
			// Headers are gone, so the error travels as an event; no [DONE]
			// follows, which tells clients the stream did not complete.
			e := backendError(ev.Err, "generate", out.api.promptParam())
			li.err = e.message
			_ = sse.send(e.body())
			return
		}
		if ev.Text != "" || len(ev.Logprobs) != 0 && out.logprobs {
			if sse.send(out.chunk(ie.i, &ev.Text, ev.Logprobs, false, "")) != nil {
				return
			}
		}
		if !ev.Done {
			continue
		}
		var reason string
		reason, usages[ie.i] = finish(ev, promptLen)
		li.finishReason = reason
		if sse.send(out.chunk(ie.i, nil, nil, false, reason)) != nil {
			return
		}
		left--
	}
	u := usageOf(usages)
	li.completionTokens = u.CompletionTokens
	if includeUsage && sse.send(out.usageChunk(u)) != nil {
		return
	}
	_ = sse.write([]byte("[DONE]"))
}

// sseWriter writes server-sent events, each flushed at once and each
// under its own write deadline.
type sseWriter struct {
	w       http.ResponseWriter
	rc      *http.ResponseController
	timeout time.Duration
	failed  error
}

func (s *sseWriter) send(v any) error {
	data, err := json.Marshal(v)
	if err != nil {
		return fmt.Errorf("encode event: %w", err)
	}
	return s.write(data)
}

func (s *sseWriter) write(data []byte) error {
	if s.failed != nil {
		return s.failed
	}
	// Not every ResponseWriter supports deadlines (httptest's does not);
	// without one the write simply has no bound.
	_ = s.rc.SetWriteDeadline(time.Now().Add(s.timeout))
	buf := make([]byte, 0, len(data)+8)
	buf = append(buf, "data: "...)
	buf = append(buf, data...)
	buf = append(buf, "\n\n"...)
	if _, err := s.w.Write(buf); err != nil {
		s.failed = fmt.Errorf("write event: %w", err)
		return s.failed
	}
	return s.flush()
}

func (s *sseWriter) flush() error {
	if s.failed != nil {
		return s.failed
	}
	if err := s.rc.Flush(); err != nil {
		s.failed = fmt.Errorf("flush event: %w", err)
		return s.failed
	}
	return nil
}

// responder builds one request's response objects.
type responder struct {
	id           string
	created      int64
	model        string
	api          api
	includeUsage bool
	logprobs     bool  // the request asked for log-probabilities
	offsets      []int // completions' text_offset of each choice's next token
}

type usageJSON struct {
	PromptTokens     int `json:"prompt_tokens"`
	CompletionTokens int `json:"completion_tokens"`
	TotalTokens      int `json:"total_tokens"`
}

func toUsageJSON(u Usage) usageJSON {
	return usageJSON(u)
}

// Response objects, fields in OpenAI's order. Logprobs is null unless the
// request asked for log-probabilities.
type (
	chatCompletionJSON struct {
		ID      string           `json:"id"`
		Object  string           `json:"object"`
		Created int64            `json:"created"`
		Model   string           `json:"model"`
		Choices []chatChoiceJSON `json:"choices"`
		Usage   usageJSON        `json:"usage"`
	}
	chatChoiceJSON struct {
		Index        int               `json:"index"`
		Message      chatMessageJSON   `json:"message"`
		Logprobs     *chatLogprobsJSON `json:"logprobs"`
		FinishReason string            `json:"finish_reason"`
	}
	chatMessageJSON struct {
		Role    string `json:"role"`
		Content string `json:"content"`
	}

	chatChunkJSON struct {
		ID      string                `json:"id"`
		Object  string                `json:"object"`
		Created int64                 `json:"created"`
		Model   string                `json:"model"`
		Choices []chatChunkChoiceJSON `json:"choices"`
		// Usage is null on every chunk but the last when include_usage
		// is set, and absent otherwise, as OpenAI does.
		Usage json.RawMessage `json:"usage,omitempty"`
	}
	chatChunkChoiceJSON struct {
		Index        int               `json:"index"`
		Delta        deltaJSON         `json:"delta"`
		Logprobs     *chatLogprobsJSON `json:"logprobs"`
		FinishReason *string           `json:"finish_reason"`
	}
	deltaJSON struct {
		Role    string  `json:"role,omitempty"`
		Content *string `json:"content,omitempty"`
	}

	// textCompletionJSON serves both the full response and stream chunks.
	textCompletionJSON struct {
		ID      string                 `json:"id"`
		Object  string                 `json:"object"`
		Created int64                  `json:"created"`
		Model   string                 `json:"model"`
		Choices []textCompletionChoice `json:"choices"`
		Usage   json.RawMessage        `json:"usage,omitempty"`
	}
	textCompletionChoice struct {
		Text         string            `json:"text"`
		Index        int               `json:"index"`
		Logprobs     *textLogprobsJSON `json:"logprobs"`
		FinishReason *string           `json:"finish_reason"`
	}
)

// Log-probabilities: chat's per-token objects, and the legacy completions
// arrays.
type (
	chatLogprobsJSON struct {
		Content []chatTokenLogprobJSON `json:"content"`
		Refusal *string                `json:"refusal"`
	}
	chatTokenLogprobJSON struct {
		Token       string               `json:"token"`
		Logprob     float64              `json:"logprob"`
		Bytes       []int                `json:"bytes"`
		TopLogprobs []chatTopLogprobJSON `json:"top_logprobs"`
	}
	chatTopLogprobJSON struct {
		Token   string  `json:"token"`
		Logprob float64 `json:"logprob"`
		Bytes   []int   `json:"bytes"`
	}
	textLogprobsJSON struct {
		Tokens        []string             `json:"tokens"`
		TokenLogprobs []float64            `json:"token_logprobs"`
		TopLogprobs   []map[string]float64 `json:"top_logprobs"`
		TextOffset    []int                `json:"text_offset"`
	}
)

// impossibleLogprob stands for -Inf, which JSON cannot carry; OpenAI's API
// uses the same value.
const impossibleLogprob = -9999.0

func logprobJSON(v float32) float64 {
	return max(float64(v), impossibleLogprob)
}

func bytesJSON(s string) []int {
	b := make([]int, len(s))
	for i := range len(s) {
		b[i] = int(s[i])
	}
	return b
}

// chatLogprobs is chat's logprobs object for lps, nil unless asked for.
func (o *responder) chatLogprobs(lps []TokenLogprob) *chatLogprobsJSON {
	if !o.logprobs {
		return nil
	}
	out := &chatLogprobsJSON{Content: make([]chatTokenLogprobJSON, len(lps))}
	for i, lp := range lps {
		c := chatTokenLogprobJSON{Token: lp.Token, Logprob: logprobJSON(lp.Logprob), Bytes: bytesJSON(lp.Token),
			TopLogprobs: make([]chatTopLogprobJSON, len(lp.Top))}
		for k, t := range lp.Top {
			c.TopLogprobs[k] = chatTopLogprobJSON{Token: t.Token, Logprob: logprobJSON(t.Logprob), Bytes: bytesJSON(t.Token)}
		}
		out.Content[i] = c
	}
	return out
}

// textLogprobs is completions' logprobs object for lps of choice i, nil
// unless asked for. text_offset counts characters from the start of the
// completion, across the chunks of a stream.
func (o *responder) textLogprobs(i int, lps []TokenLogprob) *textLogprobsJSON {
	if !o.logprobs {
		return nil
	}
	out := &textLogprobsJSON{
		Tokens: make([]string, len(lps)), TokenLogprobs: make([]float64, len(lps)),
		TopLogprobs: make([]map[string]float64, len(lps)), TextOffset: make([]int, len(lps)),
	}
	for k, lp := range lps {
		out.Tokens[k], out.TokenLogprobs[k], out.TextOffset[k] = lp.Token, logprobJSON(lp.Logprob), o.offsets[i]
		o.offsets[i] += len([]rune(lp.Token))
		top := make(map[string]float64, len(lp.Top))
		for _, t := range lp.Top {
			if _, dup := top[t.Token]; !dup { // two tokens of one spelling: the likelier
				top[t.Token] = logprobJSON(t.Logprob)
			}
		}
		out.TopLogprobs[k] = top
	}
	return out
}

var nullJSON = json.RawMessage("null")

func (o *responder) full(texts []string, lps [][]TokenLogprob, reasons []string, u Usage) any {
	if o.api == chatAPI {
		choices := make([]chatChoiceJSON, len(texts))
		for i, text := range texts {
			choices[i] = chatChoiceJSON{
				Index:        i,
				Message:      chatMessageJSON{Role: "assistant", Content: text},
				Logprobs:     o.chatLogprobs(lps[i]),
				FinishReason: reasons[i],
			}
		}
		return chatCompletionJSON{
			ID: o.id, Object: "chat.completion", Created: o.created, Model: o.model,
			Choices: choices, Usage: toUsageJSON(u),
		}
	}
	choices := make([]textCompletionChoice, len(texts))
	for i, text := range texts {
		choices[i] = textCompletionChoice{Text: text, Index: i, Logprobs: o.textLogprobs(i, lps[i]), FinishReason: &reasons[i]}
	}
	return textCompletionJSON{
		ID: o.id, Object: "text_completion", Created: o.created, Model: o.model,
		Choices: choices, Usage: mustJSON(toUsageJSON(u)),
	}
}

// chunk is one stream event of choice i: text (nil: none) with the
// log-probabilities of its tokens, the role opener, or the closing chunk
// when reason is set.
func (o *responder) chunk(i int, text *string, lps []TokenLogprob, role bool, reason string) any {
	var usage json.RawMessage
	if o.includeUsage {
		usage = nullJSON
	}
	var fr *string
	if reason != "" {
		fr = &reason
	}
	if o.api == chatAPI {
		d := deltaJSON{Content: text}
		if role {
			d.Role = "assistant"
		}
		c := chatChunkChoiceJSON{Index: i, Delta: d, FinishReason: fr}
		if text != nil && !role {
			c.Logprobs = o.chatLogprobs(lps)
		}
		return chatChunkJSON{
			ID: o.id, Object: "chat.completion.chunk", Created: o.created, Model: o.model,
			Choices: []chatChunkChoiceJSON{c},
			Usage:   usage,
		}
	}
	c := textCompletionChoice{Index: i, FinishReason: fr}
	if text != nil {
		c.Text, c.Logprobs = *text, o.textLogprobs(i, lps)
	}
	return textCompletionJSON{
		ID: o.id, Object: "text_completion", Created: o.created, Model: o.model,
		Choices: []textCompletionChoice{c},
		Usage:   usage,
	}
}

// usageChunk is the extra last chunk of include_usage: no choices, usage set.
func (o *responder) usageChunk(u Usage) any {
	usage := mustJSON(toUsageJSON(u))
	if o.api == chatAPI {
		return chatChunkJSON{
			ID: o.id, Object: "chat.completion.chunk", Created: o.created, Model: o.model,
			Choices: []chatChunkChoiceJSON{}, Usage: usage,
		}
	}
	return textCompletionJSON{
		ID: o.id, Object: "text_completion", Created: o.created, Model: o.model,
		Choices: []textCompletionChoice{}, Usage: usage,
	}
}

func mustJSON(v usageJSON) json.RawMessage {
	// A struct of three ints always marshals.
	data, _ := json.Marshal(v)
	return data
}
