package node_test

// These tests run the real node (model, engine, scheduler, HTTP) on
// loopback and talk to it as clients do: with plain net/http and with
// OpenAI's official Go SDK. Greedy output is checked token for token
// against an independent reference: ollama's own unsplit forward pass
// (ggufstage.OpenStock) with an argmax loop, decoded by the model's
// tokenizer. stories260K is tiny, so a full generation takes milliseconds.

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net"
	"net/http"
	"os"
	"slices"
	"strings"
	"sync"
	"testing"
	"time"

	sdk "github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"

	"github.com/meshnode/meshnode/ggufstage"
	"github.com/meshnode/meshnode/node"
	"github.com/meshnode/meshnode/node/openai"
	"github.com/meshnode/meshnode/node/sse"
	"github.com/meshnode/meshnode/stage"
	"github.com/meshnode/meshnode/stage/stagetest"
)

const (
	modelPath = "../../shared/models/stories260K.gguf"
	modelID   = "stories260K"
	// The node's configuration; the tests depend on these numbers.
	ctxLen   = 512
	parallel = 8
)

// base is the URL of the node every test shares, set by TestMain.
var base string

func TestMain(m *testing.M) { os.Exit(runMain(m)) }

func runMain(m *testing.M) int {
	dir, err := os.MkdirTemp("", "meshnode-node-test-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer os.RemoveAll(dir)

	ctx, cancel := context.WithCancel(context.Background())
	defer cancel()
	ready := make(chan string, 1)
	done := make(chan error, 1)
	go func() {
		done <- node.Run(ctx, node.Config{
			Model: modelPath, HTTPAddr: "127.0.0.1:0", DataDir: dir,
			// One thread: ggml's workers busy-wait, which costs more than
			// it gives on a small shared machine.
			Threads: 1, Context: ctxLen, Parallel: parallel,
			Ready: func(addr string) { ready <- addr },
		})
	}()
	select {
	case addr := <-ready:
		base = "http://" + addr
	case err := <-done:
		fmt.Fprintln(os.Stderr, "node.Run failed to start:", err)
		return 1
	case <-time.After(60 * time.Second):
		fmt.Fprintln(os.Stderr, "node.Run did not become ready in 60 s")
		return 1
	}

	code := m.Run()

	// Shutting down must be prompt and clean: Run returns nil once ctx ends.
	cancel()
	select {
	case err := <-done:
		if err != nil {
			fmt.Fprintln(os.Stderr, "node.Run returned", err)
			code = 1
		}
	case <-time.After(15 * time.Second):
		fmt.Fprintln(os.Stderr, "node.Run did not return within 15 s of cancellation")
		code = 1
	}
	ref.close()
	return code
}

// reference computes greedy continuations with ollama's own forward pass.
type reference struct {
	once  sync.Once
	err   error
	mu    sync.Mutex
	stock *ggufstage.Stock
	tok   *ggufstage.Tokenizer
	model *node.Model // for ChatPrompt: the node's own template rendering
	seq   stage.SeqID
	memo  map[string]continuation
}

var ref reference

// continuation is what a greedy generation of at most n tokens gives.
type continuation struct {
	prompt []int32
	ids    []int32 // generated, EOS excluded
	text   string
	finish string // "stop" (EOS) or "length"
}

func (r *reference) init(t *testing.T) {
	t.Helper()
	r.once.Do(func() {
		opts := ggufstage.Options{Threads: 1, MaxSeqs: 1, Context: ctxLen, NoRepack: true}
		if r.stock, r.err = ggufstage.OpenStock(modelPath, opts); r.err != nil {
			return
		}
		if r.tok, r.err = ggufstage.LoadTokenizer(modelPath); r.err != nil {
			return
		}
		dir, err := os.MkdirTemp("", "meshnode-node-ref-")
		if err != nil {
			r.err = err
			return
		}
		defer os.RemoveAll(dir)
		r.model, r.err = node.LoadModel(modelPath, node.Config{DataDir: dir, Threads: 1, Context: 64, Parallel: 1})
		r.memo = map[string]continuation{}
	})
	if r.err != nil {
		t.Fatal("reference:", r.err)
	}
}

func (r *reference) close() {
	if r.stock != nil {
		r.stock.Close()
	}
	if r.model != nil {
		r.model.Close()
	}
}

// completion is the greedy continuation of a completion prompt.
func (r *reference) completion(t *testing.T, prompt string, n int) continuation {
	t.Helper()
	r.init(t)
	ids, err := r.tok.Encode(prompt, true)
	if err != nil {
		t.Fatal(err)
	}
	return r.greedy(t, ids, n)
}

// chat is the greedy continuation of one user message.
func (r *reference) chat(t *testing.T, user string, n int) continuation {
	t.Helper()
	r.init(t)
	ids, err := r.model.ChatPrompt([]openai.Message{{Role: "user", Content: user}})
	if err != nil {
		t.Fatal(err)
	}
	return r.greedy(t, ids, n)
}

func (r *reference) greedy(t *testing.T, prompt []int32, n int) continuation {
	t.Helper()
	r.mu.Lock()
	defer r.mu.Unlock()
	key := fmt.Sprint(prompt, n)
	if c, ok := r.memo[key]; ok {
		return c
	}
	r.seq++
	seq := r.seq
	defer r.stock.Release(seq)
	c := continuation{prompt: prompt, finish: "length"}
	b := stage.Batch{Outputs: []int{len(prompt) - 1}}
	for i, id := range prompt {
		b.Seqs, b.Pos, b.Tokens = append(b.Seqs, seq), append(b.Pos, int32(i)), append(b.Tokens, id)
	}
	for len(c.ids) < n && len(prompt)+len(c.ids) < ctxLen {
		logits, err := r.stock.Forward(&b)
		if err != nil {
			t.Fatal(err)
		}
		next := stagetest.Argmax(logits)
		if r.tok.IsEOG(next) {
			c.finish = "stop"
			break
		}
		c.ids = append(c.ids, next)
		b = stage.Batch{Seqs: []stage.SeqID{seq}, Pos: []int32{int32(len(prompt) + len(c.ids) - 1)}, Tokens: []int32{next}, Outputs: []int{0}}
	}
	text, err := r.tok.Decode(c.ids)
	if err != nil {
		t.Fatal(err)
	}
	c.text = text
	r.memo[key] = c
	return c
}

// tokensUntil is how many generated tokens it takes for the text to
// contain s (what the server has generated when a stop string matches).
func (r *reference) tokensUntil(t *testing.T, c continuation, s string) int {
	t.Helper()
	for k := 1; k <= len(c.ids); k++ {
		text, err := r.tok.Decode(c.ids[:k])
		if err != nil {
			t.Fatal(err)
		}
		if strings.Contains(text, s) {
			return k
		}
	}
	t.Fatalf("%q never appears in %q", s, c.text)
	return 0
}

// ---- raw HTTP client ----

type usage struct {
	PromptTokens     int `json:"prompt_tokens"`
	CompletionTokens int `json:"completion_tokens"`
	TotalTokens      int `json:"total_tokens"`
}

// result is one generation as a client sees it, from either endpoint and
// either mode.
type result struct {
	text   string
	finish string
	usage  *usage
	chunks int // stream events before [DONE]; 0 when not streaming
}

// errorBody is OpenAI's error object.
type errorBody struct {
	Error struct {
		Message string  `json:"message"`
		Type    string  `json:"type"`
		Param   *string `json:"param"`
		Code    *string `json:"code"`
	} `json:"error"`
}

// apiError is a non-200 answer to a generation request.
type apiError struct {
	status int
	body   errorBody
}

var httpClient = &http.Client{Timeout: 60 * time.Second}

func post(ctx context.Context, path string, body []byte) (*http.Response, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, base+path, bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	return httpClient.Do(req)
}

// generate sends a request to /v1/completions or /v1/chat/completions and
// parses the JSON response or the SSE stream. A non-200 status is returned
// as *apiError.
func generate(ctx context.Context, path string, req map[string]any) (result, error) {
	body, _ := json.Marshal(req)
	resp, err := post(ctx, path, body)
	if err != nil {
		return result{}, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		e := &apiError{status: resp.StatusCode}
		data, _ := io.ReadAll(resp.Body)
		if err := json.Unmarshal(data, &e.body); err != nil {
			return result{}, fmt.Errorf("status %d with a body that is not an error object: %q", resp.StatusCode, data)
		}
		return result{}, e
	}
	chat := path == "/v1/chat/completions"
	type choice struct {
		Text         string  `json:"text"`
		FinishReason *string `json:"finish_reason"`
		Message      struct {
			Role    string `json:"role"`
			Content string `json:"content"`
		} `json:"message"`
		Delta struct {
			Content *string `json:"content"`
		} `json:"delta"`
	}
	type object struct {
		Object  string          `json:"object"`
		Model   string          `json:"model"`
		Choices []choice        `json:"choices"`
		Usage   json.RawMessage `json:"usage"`
		Error   json.RawMessage `json:"error"`
	}
	var r result
	if stream, _ := req["stream"].(bool); !stream {
		var o object
		if err := json.NewDecoder(resp.Body).Decode(&o); err != nil {
			return r, err
		}
		want := map[bool]string{true: "chat.completion", false: "text_completion"}[chat]
		if o.Object != want || o.Model != modelID || len(o.Choices) != 1 || o.Choices[0].FinishReason == nil {
			return r, fmt.Errorf("response %+v", o)
		}
		c := o.Choices[0]
		r.text, r.finish = c.Text, *c.FinishReason
		if chat {
			if c.Message.Role != "assistant" {
				return r, fmt.Errorf("message role %q", c.Message.Role)
			}
			r.text = c.Message.Content
		}
		if err := json.Unmarshal(o.Usage, &r.usage); err != nil {
			return r, fmt.Errorf("usage %s: %v", o.Usage, err)
		}
		return r, nil
	}

	if ct := resp.Header.Get("Content-Type"); ct != "text/event-stream" {
		return r, fmt.Errorf("stream content type %q", ct)
	}
	includeUsage := false
	if so, ok := req["stream_options"].(map[string]any); ok {
		includeUsage, _ = so["include_usage"].(bool)
	}
	err = sse.Each(resp.Body, func(data []byte) error {
		r.chunks++
		var o object
		if err := json.Unmarshal(data, &o); err != nil {
			return fmt.Errorf("event %q: %v", data, err)
		}
		if o.Error != nil {
			return fmt.Errorf("error event after %q: %s", r.text, o.Error)
		}
		// OpenAI's include_usage: usage is null on every chunk but a last
		// one with no choices; without it, usage is absent.
		switch {
		case !includeUsage && o.Usage != nil:
			return fmt.Errorf("usage in a stream without include_usage: %s", data)
		case includeUsage && len(o.Choices) > 0 && string(o.Usage) != "null":
			return fmt.Errorf("chunk with choices has usage %s", o.Usage)
		case includeUsage && len(o.Choices) == 0:
			if r.finish == "" || r.usage != nil {
				return fmt.Errorf("usage chunk out of place: %s", data)
			}
			if err := json.Unmarshal(o.Usage, &r.usage); err != nil {
				return fmt.Errorf("usage %s: %v", o.Usage, err)
			}
			return nil
		}
		if len(o.Choices) != 1 {
			return fmt.Errorf("chunk %s", data)
		}
		if r.finish != "" {
			return fmt.Errorf("chunk after the finish chunk: %s", data)
		}
		c := o.Choices[0]
		if chat && c.Delta.Content != nil {
			r.text += *c.Delta.Content
		} else if !chat {
			r.text += c.Text
		}
		if c.FinishReason != nil {
			r.finish = *c.FinishReason
		}
		return nil
	})
	return r, err
}

func (e *apiError) Error() string {
	return fmt.Sprintf("status %d: %s (type %s)", e.status, e.body.Error.Message, e.body.Error.Type)
}

// ---- SDK client ----

func sdkClient() sdk.Client {
	return sdk.NewClient(
		option.WithBaseURL(base+"/v1/"),
		option.WithAPIKey("unused"),
		option.WithMaxRetries(0),
		option.WithRequestTimeout(60*time.Second),
	)
}

// sdkGenerate runs the same request through the SDK.
func sdkGenerate(ctx context.Context, chat, stream bool, prompt string, maxTokens int, stop []string) (result, error) {
	c := sdkClient()
	var r result
	if chat {
		p := sdk.ChatCompletionNewParams{
			Model:       modelID,
			Messages:    []sdk.ChatCompletionMessageParamUnion{sdk.UserMessage(prompt)},
			MaxTokens:   sdk.Int(int64(maxTokens)),
			Temperature: sdk.Float(0),
		}
		if stop != nil {
			p.Stop = sdk.ChatCompletionNewParamsStopUnion{OfStringArray: stop}
		}
		if !stream {
			resp, err := c.Chat.Completions.New(ctx, p)
			if err != nil {
				return r, err
			}
			if len(resp.Choices) != 1 || resp.Model != modelID {
				return r, fmt.Errorf("response %+v", resp)
			}
			return result{text: resp.Choices[0].Message.Content, finish: resp.Choices[0].FinishReason,
				usage: &usage{int(resp.Usage.PromptTokens), int(resp.Usage.CompletionTokens), int(resp.Usage.TotalTokens)}}, nil
		}
		p.StreamOptions = sdk.ChatCompletionStreamOptionsParam{IncludeUsage: sdk.Bool(true)}
		s := c.Chat.Completions.NewStreaming(ctx, p)
		var acc sdk.ChatCompletionAccumulator
		for s.Next() {
			r.chunks++
			acc.AddChunk(s.Current())
		}
		if err := s.Err(); err != nil {
			return r, err
		}
		if len(acc.Choices) != 1 {
			return r, fmt.Errorf("accumulated %+v", acc.Choices)
		}
		return result{text: acc.Choices[0].Message.Content, finish: acc.Choices[0].FinishReason, chunks: r.chunks,
			usage: &usage{int(acc.Usage.PromptTokens), int(acc.Usage.CompletionTokens), int(acc.Usage.TotalTokens)}}, nil
	}
	p := sdk.CompletionNewParams{
		Model:       modelID,
		Prompt:      sdk.CompletionNewParamsPromptUnion{OfString: sdk.String(prompt)},
		MaxTokens:   sdk.Int(int64(maxTokens)),
		Temperature: sdk.Float(0),
	}
	if stop != nil {
		p.Stop = sdk.CompletionNewParamsStopUnion{OfStringArray: stop}
	}
	if !stream {
		resp, err := c.Completions.New(ctx, p)
		if err != nil {
			return r, err
		}
		if len(resp.Choices) != 1 || resp.Model != modelID {
			return r, fmt.Errorf("response %+v", resp)
		}
		return result{text: resp.Choices[0].Text, finish: string(resp.Choices[0].FinishReason),
			usage: &usage{int(resp.Usage.PromptTokens), int(resp.Usage.CompletionTokens), int(resp.Usage.TotalTokens)}}, nil
	}
	p.StreamOptions = sdk.ChatCompletionStreamOptionsParam{IncludeUsage: sdk.Bool(true)}
	s := c.Completions.NewStreaming(ctx, p)
	for s.Next() {
		r.chunks++
		ch := s.Current()
		for _, c := range ch.Choices {
			r.text += c.Text
			if c.FinishReason != "" {
				r.finish = string(c.FinishReason)
			}
		}
		if len(ch.Choices) == 0 && ch.Usage.TotalTokens > 0 {
			r.usage = &usage{int(ch.Usage.PromptTokens), int(ch.Usage.CompletionTokens), int(ch.Usage.TotalTokens)}
		}
	}
	return r, s.Err()
}

// ---- requests ----

// genCase is one generation request and the way it is sent.
type genCase struct {
	chat         bool
	stream       bool
	sdk          bool
	includeUsage bool // raw streams only; SDK streams always ask for usage
	prompt       string
	maxTokens    int
	stop         []string
}

func (c genCase) String() string {
	return fmt.Sprintf("%s/%s/%s/%d", map[bool]string{true: "chat", false: "completions"}[c.chat],
		map[bool]string{true: "stream", false: "json"}[c.stream], map[bool]string{true: "sdk", false: "http"}[c.sdk], c.maxTokens)
}

func (c genCase) send(ctx context.Context) (result, error) {
	if c.sdk {
		return sdkGenerate(ctx, c.chat, c.stream, c.prompt, c.maxTokens, c.stop)
	}
	req := map[string]any{"model": modelID, "max_tokens": c.maxTokens, "temperature": 0}
	path := "/v1/completions"
	if c.chat {
		path = "/v1/chat/completions"
		req["messages"] = []map[string]string{{"role": "user", "content": c.prompt}}
	} else {
		req["prompt"] = c.prompt
	}
	if c.stream {
		req["stream"] = true
		if c.includeUsage {
			req["stream_options"] = map[string]any{"include_usage": true}
		}
	}
	if c.stop != nil {
		req["stop"] = c.stop
	}
	return generate(ctx, path, req)
}

func (c genCase) reference(t *testing.T) continuation {
	t.Helper()
	if c.chat {
		return ref.chat(t, c.prompt, c.maxTokens)
	}
	return ref.completion(t, c.prompt, c.maxTokens)
}

// check compares a result with the greedy reference (cut at stop strings).
func (c genCase) check(t *testing.T, got result, want continuation) {
	t.Helper()
	text, finish, completion := want.text, want.finish, len(want.ids)
	cut := -1
	for _, s := range c.stop {
		if i := strings.Index(want.text, s); i >= 0 && (cut < 0 || i < cut) {
			cut = i
		}
	}
	if cut >= 0 {
		text, finish = want.text[:cut], "stop"
		completion = 0
		for _, s := range c.stop {
			if strings.Contains(want.text, s) {
				k := ref.tokensUntil(t, want, s)
				if completion == 0 || k < completion {
					completion = k
				}
			}
		}
	}
	if got.text != text {
		t.Errorf("%v: text differs from ollama's greedy continuation:\n got %q\nwant %q", c, got.text, text)
	}
	if got.finish != finish {
		t.Errorf("%v: finish_reason %q, want %q", c, got.finish, finish)
	}
	if finish == "length" && completion != c.maxTokens {
		t.Fatalf("%v: reference stopped at %d tokens (finish %s): pick a prompt that does not reach the context end", c, completion, finish)
	}
	wantUsage := c.sdk || !c.stream || c.includeUsage
	switch {
	case !wantUsage && got.usage != nil:
		t.Errorf("%v: usage %+v without include_usage", c, got.usage)
	case wantUsage && got.usage == nil:
		t.Errorf("%v: no usage", c)
	case wantUsage && *got.usage != usage{len(want.prompt), completion, len(want.prompt) + completion}:
		t.Errorf("%v: usage %+v, want prompt %d completion %d", c, *got.usage, len(want.prompt), completion)
	}
}

const storyPrompt = "Once upon a time"

// TestGreedyMatchesOllama: temperature 0 on both endpoints, streamed and
// not, through raw HTTP and the SDK, gives exactly the tokens ollama's own
// forward pass predicts, with OpenAI's usage and finish_reason.
func TestGreedyMatchesOllama(t *testing.T) {
	const chatPrompt = "Tell me a story about a cat."
	var cases []genCase
	for _, chat := range []bool{false, true} {
		for _, stream := range []bool{false, true} {
			for _, viaSDK := range []bool{false, true} {
				p := storyPrompt
				if chat {
					p = chatPrompt
				}
				cases = append(cases, genCase{chat: chat, stream: stream, sdk: viaSDK, prompt: p, maxTokens: 40})
			}
		}
	}
	// max_tokens at its smallest, and long runs, with and without usage.
	cases = append(cases,
		genCase{prompt: storyPrompt, maxTokens: 1},
		genCase{prompt: storyPrompt, maxTokens: 1, stream: true, includeUsage: true},
		genCase{chat: true, prompt: chatPrompt, maxTokens: 7, stream: true},
		genCase{prompt: "The little dog", maxTokens: 200, stream: true, includeUsage: true},
		genCase{chat: true, prompt: "Hi!", maxTokens: 150},
	)
	for _, c := range cases {
		t.Run(c.String(), func(t *testing.T) {
			want := c.reference(t)
			if len(want.ids) == 0 {
				t.Fatalf("empty reference continuation for %q", c.prompt)
			}
			t.Logf("ollama's greedy continuation (%s): %q", want.finish, want.text)
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			got, err := c.send(ctx)
			if err != nil {
				t.Fatal(err)
			}
			c.check(t, got, want)
			if c.stream && got.chunks < min(len(want.ids), 2) {
				t.Errorf("%d stream chunks for %d tokens: the text did not stream", got.chunks, len(want.ids))
			}
		})
	}
	// The story must be English a reader can check, not noise.
	if want := ref.completion(t, storyPrompt, 40); !strings.Contains(want.text, " was ") {
		t.Errorf("reference continuation does not read as a story: %q", want.text)
	}
}

// TestStopStrings: generation ends where a stop string first appears in
// what greedy decoding writes; the text is cut before it and finish_reason
// is "stop".
func TestStopStrings(t *testing.T) {
	want := ref.completion(t, storyPrompt, 60)
	words := strings.Fields(want.text)
	if len(words) < 12 {
		t.Fatalf("reference too short: %q", want.text)
	}
	// A word well into the text, so that the cut is visibly not at 0.
	word := " " + words[8]
	later := " " + words[11]
	tests := []struct {
		name string
		stop []string
	}{
		{"one word", []string{word}},
		{"earliest of two", []string{later, word}},
		{"absent", []string{"zebra-xylophone"}},
		{"newline or word", []string{"\n\n", word}},
	}
	for _, tt := range tests {
		for _, c := range []genCase{
			{prompt: storyPrompt, maxTokens: 60, stop: tt.stop},
			{prompt: storyPrompt, maxTokens: 60, stop: tt.stop, stream: true, includeUsage: true},
			{prompt: storyPrompt, maxTokens: 60, stop: tt.stop, sdk: true},
			{prompt: storyPrompt, maxTokens: 60, stop: tt.stop, sdk: true, stream: true},
		} {
			t.Run(tt.name+"/"+c.String(), func(t *testing.T) {
				ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
				defer cancel()
				got, err := c.send(ctx)
				if err != nil {
					t.Fatal(err)
				}
				c.check(t, got, want)
				if tt.name != "absent" && (got.finish != "stop" || len(got.text) >= len(want.text)) {
					t.Errorf("stop %q did not cut %q", tt.stop, got.text)
				}
			})
		}
	}
}

// TestConcurrentRequests: eight requests at once (the node's parallel),
// mixed endpoints and modes, are batched together and each still gets
// exactly its own greedy continuation.
func TestConcurrentRequests(t *testing.T) {
	prompts := []string{storyPrompt, "The little dog", "Tom and Sue went to", "One day, a bird",
		"Lily had a red ball", "The sun was hot", "Max liked to run", "Once upon a time"}
	var cases []genCase
	for i, p := range prompts {
		cases = append(cases, genCase{chat: i%3 == 1, stream: i%2 == 0, sdk: i%4 == 3, includeUsage: i%4 == 0,
			prompt: p, maxTokens: 30 + 10*i})
	}
	wants := make([]continuation, len(cases))
	for i, c := range cases {
		wants[i] = c.reference(t)
	}
	runConcurrently(t, cases, wants)
}

func runConcurrently(t *testing.T, cases []genCase, wants []continuation) {
	t.Helper()
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	results := make([]result, len(cases))
	errs := make([]error, len(cases))
	var wg sync.WaitGroup
	for i, c := range cases {
		wg.Go(func() { results[i], errs[i] = c.send(ctx) })
	}
	wg.Wait()
	for i, c := range cases {
		if errs[i] != nil {
			t.Errorf("request %d (%v): %v", i, c, errs[i])
			continue
		}
		c.check(t, results[i], wants[i])
	}
}

// TestClientDisconnect: clients that go away mid-stream free their slots.
// All eight slots are taken by streams that would run to the end of the
// context, each dropped after its first chunk; then the node must serve
// eight requests at once, which it can only do if every slot came back.
func TestClientDisconnect(t *testing.T) {
	var wg sync.WaitGroup
	errs := make(chan error, parallel)
	for i := range parallel {
		wg.Go(func() {
			ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
			defer cancel()
			body, _ := json.Marshal(map[string]any{
				"model": modelID, "prompt": fmt.Sprintf("Story %d: once upon a time", i), "stream": true,
				"max_tokens": ctxLen, "temperature": 1, "seed": i,
			})
			resp, err := post(ctx, "/v1/completions", body)
			if err != nil {
				errs <- err
				return
			}
			defer resp.Body.Close()
			if resp.StatusCode != http.StatusOK {
				errs <- fmt.Errorf("status %d", resp.StatusCode)
				return
			}
			sc := bufio.NewScanner(resp.Body)
			for sc.Scan() {
				if strings.HasPrefix(sc.Text(), "data: {") {
					cancel() // first chunk seen: hang up
					return
				}
			}
			errs <- fmt.Errorf("stream ended before its first chunk: %v", sc.Err())
		})
	}
	wg.Wait()
	close(errs)
	for err := range errs {
		t.Error(err)
	}

	// The node still serves, and all eight slots are free again.
	var cases []genCase
	var wants []continuation
	for i := range parallel {
		c := genCase{prompt: storyPrompt, maxTokens: 20 + i, stream: i%2 == 1, chat: i%4 == 2}
		if c.chat {
			c.prompt = "Tell me a story about a cat."
		}
		cases = append(cases, c)
		wants = append(wants, c.reference(t))
	}
	runConcurrently(t, cases, wants)
}

// TestErrors: bad requests get OpenAI's error objects with the right
// status, type, code and param, from raw HTTP and through the SDK, and the
// node keeps serving afterwards.
func TestErrors(t *testing.T) {
	long := strings.Repeat("Once upon a time there was a dog. ", 60) // far over 512 tokens
	ref.init(t)
	if n, _ := ref.tok.Encode(long, true); len(n) <= ctxLen {
		t.Fatalf("long prompt is only %d tokens", len(n))
	}
	tests := []struct {
		name   string
		path   string
		body   string
		status int
		typ    string
		code   string // "" = not checked
		param  string // "" = not checked
	}{
		{"malformed JSON", "/v1/completions", `{"model": "stories260K", "prompt": `, 400, "invalid_request_error", "", ""},
		{"not an object", "/v1/chat/completions", `[1, 2]`, 400, "invalid_request_error", "", ""},
		{"empty body", "/v1/completions", ``, 400, "invalid_request_error", "", ""},
		{"unknown model", "/v1/completions", `{"model": "gpt-9", "prompt": "hi"}`, 404, "invalid_request_error", "model_not_found", "model"},
		{"unknown chat model", "/v1/chat/completions", `{"model": "gpt-9", "messages": [{"role": "user", "content": "hi"}]}`, 404, "invalid_request_error", "model_not_found", "model"},
		{"temperature 3", "/v1/completions", `{"model": "stories260K", "prompt": "hi", "temperature": 3}`, 400, "invalid_request_error", "invalid_value", "temperature"},
		{"top_p 0", "/v1/chat/completions", `{"model": "stories260K", "messages": [{"role": "user", "content": "hi"}], "top_p": 0}`, 400, "invalid_request_error", "invalid_value", "top_p"},
		{"n 17", "/v1/completions", `{"model": "stories260K", "prompt": "hi", "n": 17}`, 400, "invalid_request_error", "invalid_value", "n"},
		{"max_tokens 0", "/v1/completions", `{"model": "stories260K", "prompt": "hi", "max_tokens": 0}`, 400, "invalid_request_error", "invalid_value", "max_tokens"},
		{"temperature a string", "/v1/completions", `{"model": "stories260K", "prompt": "hi", "temperature": "hot"}`, 400, "invalid_request_error", "invalid_type", "temperature"},
		{"no messages", "/v1/chat/completions", `{"model": "stories260K"}`, 400, "invalid_request_error", "missing_required_parameter", "messages"},
		{"prompt over the context", "/v1/completions", mustJSON(map[string]any{"model": modelID, "prompt": long}), 400, "invalid_request_error", "context_length_exceeded", "prompt"},
		{"chat over the context", "/v1/chat/completions", mustJSON(map[string]any{"model": modelID, "messages": []map[string]string{{"role": "user", "content": long}}, "stream": true}), 400, "invalid_request_error", "context_length_exceeded", "messages"},
		{"token prompt outside the vocabulary", "/v1/completions", `{"model": "stories260K", "prompt": [1, 99999]}`, 400, "invalid_request_error", "", ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			resp, err := post(context.Background(), tt.path, []byte(tt.body))
			if err != nil {
				t.Fatal(err)
			}
			defer resp.Body.Close()
			data, _ := io.ReadAll(resp.Body)
			var e errorBody
			if err := json.Unmarshal(data, &e); err != nil || e.Error.Message == "" {
				t.Fatalf("status %d, body %q is not an OpenAI error", resp.StatusCode, data)
			}
			if resp.StatusCode != tt.status || e.Error.Type != tt.typ {
				t.Errorf("status %d type %q, want %d %q (%s)", resp.StatusCode, e.Error.Type, tt.status, tt.typ, e.Error.Message)
			}
			if ct := resp.Header.Get("Content-Type"); ct != "application/json" {
				t.Errorf("content type %q", ct)
			}
			if tt.code != "" && (e.Error.Code == nil || *e.Error.Code != tt.code) {
				t.Errorf("code %v, want %q (%s)", deref(e.Error.Code), tt.code, e.Error.Message)
			}
			if tt.param != "" && (e.Error.Param == nil || *e.Error.Param != tt.param) {
				t.Errorf("param %v, want %q (%s)", deref(e.Error.Param), tt.param, e.Error.Message)
			}
		})
	}

	t.Run("sdk", func(t *testing.T) {
		ctx := context.Background()
		c := sdkClient()
		msgs := []sdk.ChatCompletionMessageParamUnion{sdk.UserMessage("hi")}
		_, err := c.Chat.Completions.New(ctx, sdk.ChatCompletionNewParams{Model: "gpt-9", Messages: msgs})
		sdkError(t, err, 404, "model_not_found", "model")
		_, err = c.Chat.Completions.New(ctx, sdk.ChatCompletionNewParams{Model: modelID, Messages: msgs, Temperature: sdk.Float(3)})
		sdkError(t, err, 400, "invalid_value", "temperature")
		_, err = c.Completions.New(ctx, sdk.CompletionNewParams{Model: modelID, Prompt: sdk.CompletionNewParamsPromptUnion{OfString: sdk.String("hi")}, N: sdk.Int(17)})
		sdkError(t, err, 400, "invalid_value", "n")
		_, err = c.Completions.New(ctx, sdk.CompletionNewParams{Model: modelID, Prompt: sdk.CompletionNewParamsPromptUnion{OfString: sdk.String(long)}})
		sdkError(t, err, 400, "context_length_exceeded", "prompt")
		s := c.Chat.Completions.NewStreaming(ctx, sdk.ChatCompletionNewParams{Model: modelID, Messages: msgs, TopP: sdk.Float(0)})
		for s.Next() {
		}
		sdkError(t, s.Err(), 400, "invalid_value", "top_p")
	})

	// After all that, a normal request is served as before.
	c := genCase{prompt: storyPrompt, maxTokens: 25, stream: true, includeUsage: true}
	got, err := c.send(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	c.check(t, got, c.reference(t))
}

func sdkError(t *testing.T, err error, status int, code, param string) {
	t.Helper()
	var e *sdk.Error
	if !errors.As(err, &e) {
		t.Fatalf("error %v (%T) is not an *openai.Error", err, err)
	}
	if e.StatusCode != status || e.Code != code || e.Param != param || e.Type != "invalid_request_error" {
		t.Errorf("got %d %q param %q type %q, want %d %q param %q", e.StatusCode, e.Code, e.Param, e.Type, status, code, param)
	}
}

func mustJSON(v any) string {
	b, err := json.Marshal(v)
	if err != nil {
		panic(err)
	}
	return string(b)
}

func deref(p *string) any {
	if p == nil {
		return nil
	}
	return *p
}

func TestModelsAndHealth(t *testing.T) {
	resp, err := httpClient.Get(base + "/health")
	if err != nil {
		t.Fatal(err)
	}
	resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		t.Errorf("/health: %d", resp.StatusCode)
	}

	resp, err = httpClient.Get(base + "/v1/models")
	if err != nil {
		t.Fatal(err)
	}
	var list struct {
		Object string `json:"object"`
		Data   []struct {
			ID            string `json:"id"`
			Object        string `json:"object"`
			OwnedBy       string `json:"owned_by"`
			ContextLength int    `json:"context_length"`
		} `json:"data"`
	}
	err = json.NewDecoder(resp.Body).Decode(&list)
	resp.Body.Close()
	if err != nil || resp.StatusCode != http.StatusOK {
		t.Fatalf("/v1/models: %d %v", resp.StatusCode, err)
	}
	if list.Object != "list" || len(list.Data) != 1 || list.Data[0].ID != modelID || list.Data[0].Object != "model" ||
		list.Data[0].ContextLength != ctxLen {
		t.Errorf("/v1/models: %+v", list)
	}

	client := sdkClient()
	page, err := client.Models.List(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	ids := []string{}
	for _, m := range page.Data {
		ids = append(ids, m.ID)
	}
	if !slices.Equal(ids, []string{modelID}) {
		t.Errorf("SDK lists %v", ids)
	}
	if m, err := client.Models.Get(context.Background(), modelID); err != nil || m.ID != modelID {
		t.Errorf("SDK get: %+v %v", m, err)
	}
}

// TestExposure: beyond loopback the node refuses to start without an API
// key, and with one it requires the key on the API.
func TestExposure(t *testing.T) {
	cfg := node.Config{Model: modelPath, HTTPAddr: "0.0.0.0:0", DataDir: t.TempDir(), Threads: 1, Context: 64, Parallel: 1}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	err := node.Run(ctx, cfg)
	if err == nil || !strings.Contains(err.Error(), "--api-key") {
		t.Fatalf("Run on 0.0.0.0 without a key: %v, want an error that mentions --api-key", err)
	}

	const key = "sk-test-exposure"
	cfg.APIKey = key
	ready := make(chan string, 1)
	cfg.Ready = func(addr string) { ready <- addr }
	runCtx, stop := context.WithCancel(ctx)
	done := make(chan error, 1)
	go func() { done <- node.Run(runCtx, cfg) }()
	var addr string
	select {
	case addr = <-ready:
	case err := <-done:
		t.Fatalf("Run with a key: %v", err)
	case <-ctx.Done():
		t.Fatal("node not ready")
	}
	_, port, err := net.SplitHostPort(addr)
	if err != nil {
		t.Fatal(err)
	}
	url := "http://127.0.0.1:" + port
	get := func(path, auth string) int {
		req, _ := http.NewRequestWithContext(ctx, http.MethodGet, url+path, nil)
		if auth != "" {
			req.Header.Set("Authorization", auth)
		}
		resp, err := httpClient.Do(req)
		if err != nil {
			t.Fatal(err)
		}
		resp.Body.Close()
		return resp.StatusCode
	}
	tests := []struct {
		path, auth string
		status     int
	}{
		{"/v1/models", "", 401},
		{"/v1/models", "Bearer wrong", 401},
		{"/v1/models", "Basic " + key, 401},
		{"/v1/models", "Bearer " + key, 200},
		{"/health", "", 200}, // health checks need no key
	}
	for _, tt := range tests {
		if got := get(tt.path, tt.auth); got != tt.status {
			t.Errorf("GET %s with %q: %d, want %d", tt.path, tt.auth, got, tt.status)
		}
	}
	client := sdk.NewClient(option.WithBaseURL(url+"/v1/"), option.WithAPIKey(key), option.WithMaxRetries(0))
	resp, err := client.Completions.New(ctx, sdk.CompletionNewParams{Model: modelID,
		Prompt: sdk.CompletionNewParamsPromptUnion{OfString: sdk.String(storyPrompt)}, MaxTokens: sdk.Int(5), Temperature: sdk.Float(0)})
	if err != nil {
		t.Fatal(err)
	}
	if want := ref.completion(t, storyPrompt, 5); resp.Choices[0].Text != want.text {
		t.Errorf("text %q, want %q", resp.Choices[0].Text, want.text)
	}

	stop()
	select {
	case err := <-done:
		if err != nil {
			t.Errorf("Run returned %v after cancellation", err)
		}
	case <-time.After(15 * time.Second):
		t.Error("Run did not return after cancellation")
	}
}
