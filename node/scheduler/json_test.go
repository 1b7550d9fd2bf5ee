package scheduler

import (
	"context"
	"encoding/json"
	"strings"
	"testing"

	"github.com/meshnode/meshnode/ggufstage"
	"github.com/meshnode/meshnode/node/sample"
)

func storiesVocab(t *testing.T, tok *ggufstage.Tokenizer) func() (*sample.Vocab, error) {
	return func() (*sample.Vocab, error) {
		return sample.NewVocab(len(tok.Vocabulary().Values),
			func(id int32) (string, error) { return tok.Decode([]int32{id}) }, tok.IsSpecial, tok.IsEOG)
	}
}

// TestJSONOutput: with Sampling.JSON, stories260K (which has never seen
// JSON) writes a JSON object: complete when it stops, a prefix of one when
// it runs out of tokens; greedy and sampled alike. (It tells stories in
// its strings and rarely closes the object: completion is checked on a
// toy vocabulary in node/sample.)
func TestJSONOutput(t *testing.T) {
	eng, tok := openStories(t, 4)
	s := New(Local(eng, storiesVocab(t, tok)), tok, Config{Parallel: 4}, nil)
	ctx, cancel := context.WithCancel(context.Background())
	done := make(chan struct{})
	go func() { s.Run(ctx); close(done) }()
	defer func() { cancel(); <-done; eng.Close() }()

	prompt, err := tok.Encode("Once upon a time", true)
	if err != nil {
		t.Fatal(err)
	}
	for i, temp := range []float32{0, 1, 1, 1, 1.5, 1.5} {
		p := sample.DefaultParams()
		p.Temperature, p.Seed, p.JSON = temp, new(int64(i)), true
		ch, err := s.Submit(context.Background(), Request{Prompt: prompt, MaxTokens: 160, Sampling: p})
		if err != nil {
			t.Fatal(err)
		}
		text, last := collect(t, ch)
		if last.Err != nil {
			t.Fatal(last.Err)
		}
		j := sample.NewJSON()
		switch {
		case !j.Feed([]byte(text)) || !strings.Contains(text, ":"):
			t.Errorf("temperature %v: %q is not a JSON object's prefix with a member", temp, text)
		case last.FinishReason == "stop":
			var v map[string]any
			if err := json.Unmarshal([]byte(text), &v); err != nil {
				t.Errorf("temperature %v: stopped on %q: %v", temp, text, err)
			}
		}
		t.Logf("temperature %v, %s: %q", temp, last.FinishReason, text)
	}
}
