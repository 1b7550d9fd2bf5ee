package node_test

import (
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"strings"
	"testing"

	sdk "github.com/openai/openai-go/v3"
	"github.com/openai/openai-go/v3/shared"

	smp "github.com/meshnode/meshnode/node/sample"
)

// TestLogprobsOverHTTP: a node serves log-probabilities through the OpenAI
// API, read by OpenAI's own SDK. For greedy generations the listed tokens
// are ollama's greedy continuation, token for token; each token is its
// own best alternative, with the same log-probability.
func TestLogprobsOverHTTP(t *testing.T) {
	const n = 24
	ctx := context.Background()
	c := sdkClient()
	pieces := func(ids []int32) []string {
		var out []string
		for _, id := range ids {
			p, err := ref.tok.Decode([]int32{id})
			if err != nil {
				t.Fatal(err)
			}
			out = append(out, p)
		}
		return out
	}

	t.Run("chat stream", func(t *testing.T) {
		want := ref.chat(t, "Tell me a story", n)
		stream := c.Chat.Completions.NewStreaming(ctx, sdk.ChatCompletionNewParams{
			Model: modelID, Messages: []sdk.ChatCompletionMessageParamUnion{sdk.UserMessage("Tell me a story")},
			MaxTokens: sdk.Int(n), Temperature: sdk.Float(0), Logprobs: sdk.Bool(true), TopLogprobs: sdk.Int(2),
		})
		var text strings.Builder
		var tokens []string
		for stream.Next() {
			for _, ch := range stream.Current().Choices {
				text.WriteString(ch.Delta.Content)
				for _, lp := range ch.Logprobs.Content {
					tokens = append(tokens, lp.Token)
					if lp.Logprob > 0 || len(lp.TopLogprobs) != 2 || lp.TopLogprobs[0].Token != lp.Token ||
						lp.TopLogprobs[0].Logprob != lp.Logprob || lp.TopLogprobs[1].Logprob > lp.Logprob {
						t.Errorf("token %q: %+v", lp.Token, lp)
					}
				}
			}
		}
		if err := stream.Err(); err != nil {
			t.Fatal(err)
		}
		if text.String() != want.text || fmt.Sprintf("%q", tokens) != fmt.Sprintf("%q", pieces(want.ids)) {
			t.Errorf("streamed %q with tokens %q, want %q with %q", text.String(), tokens, want.text, pieces(want.ids))
		}
	})

	t.Run("completion", func(t *testing.T) {
		want := ref.completion(t, "Once upon a time", n)
		resp, err := c.Completions.New(ctx, sdk.CompletionNewParams{
			Model: modelID, Prompt: sdk.CompletionNewParamsPromptUnion{OfString: sdk.String("Once upon a time")},
			MaxTokens: sdk.Int(n), Temperature: sdk.Float(0), Logprobs: sdk.Int(0),
		})
		if err != nil {
			t.Fatal(err)
		}
		lp := resp.Choices[0].Logprobs
		if fmt.Sprintf("%q", lp.Tokens) != fmt.Sprintf("%q", pieces(want.ids)) || len(lp.TokenLogprobs) != len(want.ids) || len(lp.TextOffset) != len(want.ids) {
			t.Fatalf("logprobs %+v, want tokens %q", lp, pieces(want.ids))
		}
		offset := 0
		for i, tok := range lp.Tokens {
			if lp.TextOffset[i] != int64(offset) || lp.TokenLogprobs[i] > 0 || math.IsNaN(lp.TokenLogprobs[i]) {
				t.Errorf("token %d %q: offset %d (want %d), logprob %v", i, tok, lp.TextOffset[i], offset, lp.TokenLogprobs[i])
			}
			offset += len([]rune(tok))
		}
	})
}

// TestJSONModeOverHTTP: response_format json_object keeps a node's reply
// one JSON object (a prefix of one when max_tokens cuts it short), read by
// OpenAI's SDK, whole and streamed.
func TestJSONModeOverHTTP(t *testing.T) {
	ctx := context.Background()
	c := sdkClient()
	params := sdk.ChatCompletionNewParams{
		Model: modelID, Messages: []sdk.ChatCompletionMessageParamUnion{sdk.UserMessage("Describe a cat as JSON.")},
		MaxTokens: sdk.Int(48), Temperature: sdk.Float(0.8), Seed: sdk.Int(5),
		ResponseFormat: sdk.ChatCompletionNewParamsResponseFormatUnion{OfJSONObject: &shared.ResponseFormatJSONObjectParam{}},
	}
	check := func(how, content, finish string) {
		j := smp.NewJSON()
		if !strings.HasPrefix(content, "{") || !j.Feed([]byte(content)) {
			t.Errorf("%s: %q is not a JSON object's prefix", how, content)
		}
		if finish == "stop" && !json.Valid([]byte(content)) {
			t.Errorf("%s: stopped on %q", how, content)
		}
	}
	resp, err := c.Chat.Completions.New(ctx, params)
	if err != nil {
		t.Fatal(err)
	}
	check("whole", resp.Choices[0].Message.Content, resp.Choices[0].FinishReason)

	stream := c.Chat.Completions.NewStreaming(ctx, params)
	var acc sdk.ChatCompletionAccumulator
	for stream.Next() {
		acc.AddChunk(stream.Current())
	}
	if err := stream.Err(); err != nil {
		t.Fatal(err)
	}
	check("streamed", acc.Choices[0].Message.Content, acc.Choices[0].FinishReason)
	if acc.Choices[0].Message.Content != resp.Choices[0].Message.Content {
		t.Errorf("streamed %q, whole %q (same seed)", acc.Choices[0].Message.Content, resp.Choices[0].Message.Content)
	}
}

// TestJSONSchemaOverHTTP: response_format json_schema keeps a node's reply
// to what the schema allows (the keys it names, their types), and a schema
// the node cannot follow is a 400 that says why.
func TestJSONSchemaOverHTTP(t *testing.T) {
	ctx := context.Background()
	c := sdkClient()
	const doc = `{"type":"object","properties":{"name":{"type":"string"},"legs":{"type":"integer"},"furry":{"type":"boolean"}},"required":["legs","furry"],"additionalProperties":false}`
	var schema map[string]any
	if err := json.Unmarshal([]byte(doc), &schema); err != nil {
		t.Fatal(err)
	}
	compiled, err := smp.ParseSchema([]byte(doc))
	if err != nil {
		t.Fatal(err)
	}
	for seed := range int64(3) {
		resp, err := c.Chat.Completions.New(ctx, sdk.ChatCompletionNewParams{
			Model: modelID, Messages: []sdk.ChatCompletionMessageParamUnion{sdk.UserMessage("A cat.")},
			MaxTokens: sdk.Int(64), Seed: sdk.Int(seed),
			ResponseFormat: sdk.ChatCompletionNewParamsResponseFormatUnion{OfJSONSchema: &shared.ResponseFormatJSONSchemaParam{
				JSONSchema: shared.ResponseFormatJSONSchemaJSONSchemaParam{Name: "animal", Schema: schema, Strict: sdk.Bool(true)},
			}},
		})
		if err != nil {
			t.Fatal(err)
		}
		content, finish := resp.Choices[0].Message.Content, resp.Choices[0].FinishReason
		r := smp.NewSchemaJSON(compiled)
		if !r.Feed([]byte(content)) || finish == "stop" && !r.Done() {
			t.Errorf("seed %d (%s): %q is not what the schema allows", seed, finish, content)
		}
		t.Logf("seed %d, %s: %q", seed, finish, content)
	}

	_, err = c.Chat.Completions.New(ctx, sdk.ChatCompletionNewParams{
		Model: modelID, Messages: []sdk.ChatCompletionMessageParamUnion{sdk.UserMessage("A cat.")},
		ResponseFormat: sdk.ChatCompletionNewParamsResponseFormatUnion{OfJSONSchema: &shared.ResponseFormatJSONSchemaParam{
			JSONSchema: shared.ResponseFormatJSONSchemaJSONSchemaParam{Name: "bad", Schema: map[string]any{"type": "object", "properties": map[string]any{"a": map[string]any{"$ref": "#/defs/a"}}}},
		}},
	})
	var apiErr *sdk.Error
	if !errors.As(err, &apiErr) {
		t.Fatalf("an unsupported schema: %v", err)
	}
	if apiErr.StatusCode != 400 || !strings.Contains(apiErr.Message, `"$ref" is not supported`) {
		t.Errorf("an unsupported schema: %d %s", apiErr.StatusCode, apiErr.RawJSON())
	}
	t.Logf("an unsupported schema: %s", apiErr.Message)
}

// TestChoicesOverHTTP: n choices run as n sequences batched together, and
// choice i is exactly what a request of its own seeded seed+i gives.
func TestChoicesOverHTTP(t *testing.T) {
	ctx := context.Background()
	c := sdkClient()
	params := func(n, seed int64) sdk.CompletionNewParams {
		return sdk.CompletionNewParams{
			Model: modelID, Prompt: sdk.CompletionNewParamsPromptUnion{OfString: sdk.String("Once upon a time")},
			MaxTokens: sdk.Int(24), Temperature: sdk.Float(1), Seed: sdk.Int(seed), N: sdk.Int(n),
		}
	}
	resp, err := c.Completions.New(ctx, params(3, 40))
	if err != nil {
		t.Fatal(err)
	}
	if len(resp.Choices) != 3 {
		t.Fatalf("%d choices", len(resp.Choices))
	}
	distinct := map[string]bool{}
	for i, ch := range resp.Choices {
		one, err := c.Completions.New(ctx, params(1, 40+int64(i)))
		if err != nil {
			t.Fatal(err)
		}
		if ch.Text != one.Choices[0].Text {
			t.Errorf("choice %d: %q, alone with seed %d: %q", i, ch.Text, 40+i, one.Choices[0].Text)
		}
		distinct[ch.Text] = true
	}
	if len(distinct) < 2 {
		t.Errorf("three sampled choices are one text: %q", resp.Choices[0].Text)
	}
}
