package openai

// These tests drive the server with OpenAI's official Go SDK, so that the
// wire format is checked by a real client rather than by our own reading.

import (
	"context"
	"errors"
	"fmt"
	"net/http/httptest"
	"slices"
	"testing"
	"time"

	sdk "github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/option"
	"github.com/openai/openai-go/v3/packages/ssestream"
)

const sdkKey = "sk-meshnode-test"

func sdkSetup(t *testing.T, models ...*fakeModel) (sdk.Client, *httptest.Server) {
	t.Helper()
	srv := httptest.NewServer(NewHandler(newFake(models...), Config{APIKey: sdkKey}))
	t.Cleanup(srv.Close)
	return sdkClient(srv, sdkKey), srv
}

func sdkClient(srv *httptest.Server, key string) sdk.Client {
	return sdk.NewClient(
		option.WithBaseURL(srv.URL+"/v1/"),
		option.WithAPIKey(key),
		option.WithMaxRetries(0), // a retried 429 would hide the status under test
		option.WithRequestTimeout(10*time.Second),
	)
}

func userMsg(s string) []sdk.ChatCompletionMessageParamUnion {
	return []sdk.ChatCompletionMessageParamUnion{sdk.SystemMessage("be nice"), sdk.UserMessage(s)}
}

func TestSDKChat(t *testing.T) {
	m := newModel("llama", "Hello", ", ", "world")
	client, _ := sdkSetup(t, m)
	resp, err := client.Chat.Completions.New(context.Background(), sdk.ChatCompletionNewParams{
		Model:       "llama",
		Messages:    userMsg("hi"),
		MaxTokens:   sdk.Int(16),
		Temperature: sdk.Float(0.5),
		Seed:        sdk.Int(42),
		Stop:        sdk.ChatCompletionNewParamsStopUnion{OfStringArray: []string{"\n\n", "END"}},
	})
	if err != nil {
		t.Fatal(err)
	}
	if resp.Object != "chat.completion" || resp.Model != "llama" || len(resp.Choices) != 1 {
		t.Fatalf("response %+v", resp)
	}
	c := resp.Choices[0]
	if c.Message.Content != "Hello, world" || c.Message.Role != "assistant" || c.FinishReason != "stop" {
		t.Errorf("choice %+v", c)
	}
	if resp.Usage.CompletionTokens != 3 || resp.Usage.TotalTokens != resp.Usage.PromptTokens+3 || resp.Usage.PromptTokens == 0 {
		t.Errorf("usage %+v", resp.Usage)
	}
	req := m.lastReq()
	if req.MaxTokens != 16 || req.Temperature != 0.5 || req.Seed == nil || *req.Seed != 42 || len(req.Stop) != 2 {
		t.Errorf("generate request %+v", req)
	}
}

func TestSDKChatStream(t *testing.T) {
	m := newModel("llama", "Str", "eam", "ing ✓")
	client, _ := sdkSetup(t, m)
	stream := client.Chat.Completions.NewStreaming(context.Background(), sdk.ChatCompletionNewParams{
		Model:         "llama",
		Messages:      userMsg("hi"),
		StreamOptions: sdk.ChatCompletionStreamOptionsParam{IncludeUsage: sdk.Bool(true)},
	})
	var acc sdk.ChatCompletionAccumulator
	var deltas string
	chunks := 0
	for stream.Next() {
		chunk := stream.Current()
		chunks++
		acc.AddChunk(chunk)
		if len(chunk.Choices) > 0 {
			deltas += chunk.Choices[0].Delta.Content
		}
	}
	if err := stream.Err(); err != nil {
		t.Fatal(err)
	}
	// role opener, three pieces, the finish chunk, the usage chunk
	if chunks != 6 || deltas != "Streaming ✓" {
		t.Errorf("%d chunks, text %q", chunks, deltas)
	}
	if len(acc.Choices) != 1 || acc.Choices[0].Message.Content != "Streaming ✓" || acc.Choices[0].FinishReason != "stop" {
		t.Errorf("accumulated %+v", acc.Choices)
	}
	if acc.Usage.CompletionTokens != 3 || acc.Usage.PromptTokens == 0 {
		t.Errorf("usage %+v", acc.Usage)
	}
}

func TestSDKCompletions(t *testing.T) {
	m := newModel("llama", "once", " upon")
	m.finish = "length"
	client, _ := sdkSetup(t, m)
	resp, err := client.Completions.New(context.Background(), sdk.CompletionNewParams{
		Model:     "llama",
		Prompt:    sdk.CompletionNewParamsPromptUnion{OfString: sdk.String("Tell me")},
		MaxTokens: sdk.Int(2),
	})
	if err != nil {
		t.Fatal(err)
	}
	if resp.Object != "text_completion" || len(resp.Choices) != 1 ||
		resp.Choices[0].Text != "once upon" || resp.Choices[0].FinishReason != "length" {
		t.Errorf("response %+v", resp)
	}
	if resp.Usage.PromptTokens != int64(len("Tell me")+1) || resp.Usage.CompletionTokens != 2 {
		t.Errorf("usage %+v", resp.Usage)
	}

	// Token-id prompts go straight to the backend.
	if _, err := client.Completions.New(context.Background(), sdk.CompletionNewParams{
		Model:  "llama",
		Prompt: sdk.CompletionNewParamsPromptUnion{OfArrayOfTokens: []int64{9, 8, 7}},
	}); err != nil {
		t.Fatal(err)
	}
	if got := m.lastReq().Prompt; fmt.Sprint(got) != "[9 8 7]" {
		t.Errorf("token prompt %v", got)
	}

	stream := client.Completions.NewStreaming(context.Background(), sdk.CompletionNewParams{
		Model:  "llama",
		Prompt: sdk.CompletionNewParamsPromptUnion{OfArrayOfStrings: []string{"Tell me"}},
	})
	var text, finish string
	for stream.Next() {
		for _, c := range stream.Current().Choices {
			text += c.Text
			if c.FinishReason != "" {
				finish = string(c.FinishReason)
			}
		}
	}
	if err := stream.Err(); err != nil || text != "once upon" || finish != "length" {
		t.Errorf("stream: %q %q %v", text, finish, err)
	}
}

func TestSDKModels(t *testing.T) {
	a := newModel("alpha")
	a.info.ContextLength = 8192
	client, _ := sdkSetup(t, a, newModel("org/beta"))
	page, err := client.Models.List(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if len(page.Data) != 2 || page.Data[0].ID != "alpha" || page.Data[1].ID != "org/beta" ||
		page.Data[0].OwnedBy != "tester" || page.Data[0].Created != 1700000000 {
		t.Errorf("models %+v", page.Data)
	}
	got, err := client.Models.Get(context.Background(), "org/beta")
	if err != nil || got.ID != "org/beta" {
		t.Errorf("get: %+v %v", got, err)
	}
}

func sdkStatus(t *testing.T, err error, status int, code string) {
	t.Helper()
	var apiErr *sdk.Error
	if !errors.As(err, &apiErr) {
		t.Fatalf("error %v (%T) is not *openai.Error", err, err)
	}
	if apiErr.StatusCode != status || apiErr.Code != code || apiErr.Message == "" {
		t.Errorf("got %d %q %q, want %d %q", apiErr.StatusCode, apiErr.Code, apiErr.Message, status, code)
	}
}

func TestSDKErrors(t *testing.T) {
	busy := newModel("busy")
	busy.genErr = fmt.Errorf("queue full: %w", ErrOverloaded)
	client, srv := sdkSetup(t, newModel("llama", "x"), busy)
	ctx := context.Background()

	_, err := client.Chat.Completions.New(ctx, sdk.ChatCompletionNewParams{Model: "nope", Messages: userMsg("hi")})
	sdkStatus(t, err, 404, "model_not_found")

	_, err = client.Chat.Completions.New(ctx, sdk.ChatCompletionNewParams{Model: "busy", Messages: userMsg("hi")})
	sdkStatus(t, err, 429, "rate_limit_exceeded")

	_, err = client.Chat.Completions.New(ctx, sdk.ChatCompletionNewParams{Model: "llama", Messages: userMsg("hi"), N: sdk.Int(20)})
	sdkStatus(t, err, 400, "invalid_value")

	stream := client.Chat.Completions.NewStreaming(ctx, sdk.ChatCompletionNewParams{Model: "busy", Messages: userMsg("hi")})
	for stream.Next() {
	}
	sdkStatus(t, stream.Err(), 429, "rate_limit_exceeded")

	wrong := sdkClient(srv, "sk-wrong")
	_, err = wrong.Models.List(ctx)
	sdkStatus(t, err, 401, "invalid_api_key")
}

func TestSDKStreamMidError(t *testing.T) {
	m := newModel("llama", "part")
	m.midErr = errors.New("device lost")
	client, _ := sdkSetup(t, m)
	stream := client.Chat.Completions.NewStreaming(context.Background(), sdk.ChatCompletionNewParams{Model: "llama", Messages: userMsg("hi")})
	text := ""
	for stream.Next() {
		if ch := stream.Current().Choices; len(ch) > 0 {
			text += ch[0].Delta.Content
		}
	}
	var se *ssestream.StreamError
	if !errors.As(stream.Err(), &se) || text != "part" {
		t.Errorf("text %q, err %v (%T)", text, stream.Err(), stream.Err())
	}
}

// TestSDKLogprobs reads log-probabilities with the SDK's own types: chat's
// per-token objects (whole and streamed) and the completions arrays.
func TestSDKLogprobs(t *testing.T) {
	m := newModel("llama", "Hé", " yo")
	client, _ := sdkSetup(t, m)
	ctx := context.Background()

	resp, err := client.Chat.Completions.New(ctx, sdk.ChatCompletionNewParams{
		Model: "llama", Messages: userMsg("hi"), Logprobs: sdk.Bool(true), TopLogprobs: sdk.Int(2),
	})
	if err != nil {
		t.Fatal(err)
	}
	content := resp.Choices[0].Logprobs.Content
	if len(content) != 2 || content[0].Token != "Hé" || content[0].Logprob != -0.25 || fmt.Sprint(content[0].Bytes) != "[72 195 169]" ||
		len(content[0].TopLogprobs) != 2 || content[0].TopLogprobs[1].Token != "?" || content[0].TopLogprobs[1].Logprob != -9999 ||
		content[1].Token != " yo" || content[1].Logprob != -0.5 {
		t.Errorf("chat logprobs %+v", content)
	}

	stream := client.Chat.Completions.NewStreaming(ctx, sdk.ChatCompletionNewParams{
		Model: "llama", Messages: userMsg("hi"), Logprobs: sdk.Bool(true),
	})
	var tokens []string
	for stream.Next() {
		for _, c := range stream.Current().Choices {
			for _, lp := range c.Logprobs.Content {
				tokens = append(tokens, lp.Token)
			}
		}
	}
	if err := stream.Err(); err != nil || fmt.Sprint(tokens) != "[Hé  yo]" {
		t.Errorf("streamed logprob tokens %q, %v", tokens, err)
	}

	cresp, err := client.Completions.New(ctx, sdk.CompletionNewParams{
		Model: "llama", Prompt: sdk.CompletionNewParamsPromptUnion{OfString: sdk.String("Tell me")}, Logprobs: sdk.Int(1),
	})
	if err != nil {
		t.Fatal(err)
	}
	lp := cresp.Choices[0].Logprobs
	if fmt.Sprint(lp.Tokens) != "[Hé  yo]" || fmt.Sprint(lp.TokenLogprobs) != "[-0.25 -0.5]" ||
		fmt.Sprint(lp.TextOffset) != "[0 2]" || len(lp.TopLogprobs) != 2 || lp.TopLogprobs[1][" yo"] != -0.5 {
		t.Errorf("completion logprobs %+v", lp)
	}
}

// TestSDKChoices: n choices are n generations, each seeded with seed+i,
// read by the SDK whole and streamed (its accumulator sorts the chunks by
// index); usage counts the prompt once.
func TestSDKChoices(t *testing.T) {
	m := newModel("llama", "a", "b")
	client, _ := sdkSetup(t, m)
	ctx := context.Background()
	resp, err := client.Chat.Completions.New(ctx, sdk.ChatCompletionNewParams{
		Model: "llama", Messages: userMsg("hi"), N: sdk.Int(3), Seed: sdk.Int(10), Logprobs: sdk.Bool(true),
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Choices) != 3 {
		t.Fatalf("%d choices", len(resp.Choices))
	}
	for i, c := range resp.Choices {
		if c.Index != int64(i) || c.Message.Content != "ab" || c.FinishReason != "stop" || len(c.Logprobs.Content) != 2 {
			t.Errorf("choice %d: %+v", i, c)
		}
	}
	prompt := int64(len(m.lastReq().Prompt))
	if resp.Usage.PromptTokens != prompt || resp.Usage.CompletionTokens != 6 || resp.Usage.TotalTokens != prompt+6 {
		t.Errorf("usage %+v", resp.Usage)
	}
	m.mu.Lock()
	var seeds []int64
	for _, r := range m.reqs[len(m.reqs)-3:] {
		seeds = append(seeds, *r.Seed)
	}
	m.mu.Unlock()
	slices.Sort(seeds)
	if fmt.Sprint(seeds) != "[10 11 12]" {
		t.Errorf("seeds %v", seeds)
	}

	stream := client.Chat.Completions.NewStreaming(ctx, sdk.ChatCompletionNewParams{
		Model: "llama", Messages: userMsg("hi"), N: sdk.Int(2),
		StreamOptions: sdk.ChatCompletionStreamOptionsParam{IncludeUsage: sdk.Bool(true)},
	})
	var acc sdk.ChatCompletionAccumulator
	for stream.Next() {
		acc.AddChunk(stream.Current())
	}
	if err := stream.Err(); err != nil {
		t.Fatal(err)
	}
	if len(acc.Choices) != 2 || acc.Choices[0].Message.Content != "ab" || acc.Choices[1].Message.Content != "ab" ||
		acc.Choices[1].FinishReason != "stop" || acc.Usage.CompletionTokens != 4 {
		t.Errorf("accumulated %+v, usage %+v", acc.Choices, acc.Usage)
	}

	cresp, err := client.Completions.New(ctx, sdk.CompletionNewParams{
		Model: "llama", Prompt: sdk.CompletionNewParamsPromptUnion{OfString: sdk.String("x")}, N: sdk.Int(2), Logprobs: sdk.Int(0),
	})
	if err != nil {
		t.Fatal(err)
	}
	if len(cresp.Choices) != 2 || cresp.Choices[1].Index != 1 || cresp.Choices[1].Text != "ab" ||
		fmt.Sprint(cresp.Choices[1].Logprobs.TextOffset) != "[0 1]" {
		t.Errorf("completion choices %+v", cresp.Choices)
	}
}
