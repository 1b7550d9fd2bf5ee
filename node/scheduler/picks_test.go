package scheduler

import (
	"context"
	"slices"
	"strings"
	"testing"

	"github.com/meshnode/meshnode/node/sample"
	"github.com/meshnode/meshnode/stage"
	"github.com/meshnode/meshnode/stage/stagetest"
)

// TestLocalGreedyPicks: a batch whose every output row is sampled greedily,
// with no log-probabilities, asks the engine for greedy picks and takes
// them; any other batch asks for logits.
func TestLocalGreedyPicks(t *testing.T) {
	eng, tok := openStories(t, 4)
	defer eng.Close()
	prompt, _ := tok.Encode("Once upon a time", true)
	withLogprobs := greedy()
	withLogprobs.Logprobs, withLogprobs.TopLogprobs = true, 2
	penalized := greedy()
	penalized.RepeatPenalty = 1.1
	warm := sample.DefaultParams()
	warm.Temperature = 0.8
	tests := []struct {
		name  string
		seqs  []sample.Params
		picks bool
	}{
		{"one greedy", []sample.Params{greedy()}, true},
		{"two greedy", []sample.Params{greedy(), greedy()}, true},
		{"greedy with logprobs", []sample.Params{withLogprobs}, false},
		{"greedy with a repeat penalty", []sample.Params{penalized}, false},
		{"temperature", []sample.Params{warm}, false},
		{"greedy beside temperature", []sample.Params{greedy(), warm}, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			// shift 1: a pick differs from the logits' greedy token, so the
			// tokens say which one the pipeline took.
			eng := &stagetest.Picker{Engine: eng, Shift: 1}
			pipe := Local(eng, nil)
			b := &stage.Batch{}
			for i, p := range tc.seqs {
				seq := stage.SeqID(100 + i)
				if err := pipe.Open(seq, p, prompt); err != nil {
					t.Fatal(err)
				}
				defer pipe.Release(seq)
				for pos, id := range prompt {
					b.Seqs, b.Pos, b.Tokens = append(b.Seqs, seq), append(b.Pos, int32(pos)), append(b.Tokens, id)
				}
				b.Outputs = append(b.Outputs, len(b.Seqs)-1)
			}
			picked, err := pipe.Forward(context.Background(), b)
			if err != nil {
				t.Fatal(err)
			}
			if got := eng.LastAsked(); got != tc.picks {
				t.Fatalf("PicksOnly %v, want %v", got, tc.picks)
			}
			// The reference: the same batch's logits, sampled greedily.
			out, err := eng.Engine.Forward(context.Background(), &stage.Batch{Seqs: b.Seqs, Pos: b.Pos, Tokens: b.Tokens, Outputs: b.Outputs})
			if err != nil {
				t.Fatal(err)
			}
			defer out.Release()
			for i := range b.Outputs {
				g := stage.GreedyPick(out.LogitsRow(i, eng.Info().Vocab))
				switch {
				case tc.picks && picked.Tokens[i] != g+1:
					t.Errorf("row %d: token %d, want the engine's pick %d", i, picked.Tokens[i], g+1)
				case !tc.picks && tc.seqs[i].Temperature == 0 && picked.Tokens[i] != g:
					t.Errorf("row %d: token %d, want the greedy %d of the logits", i, picked.Tokens[i], g)
				}
			}
		})
	}
}

// TestLocalBadPicks: picks the batch did not ask for, or of the wrong
// count, or outside the vocabulary, are errors.
func TestLocalBadPicks(t *testing.T) {
	eng, tok := openStories(t, 2)
	defer eng.Close()
	prompt, _ := tok.Encode("Once upon a time", true)
	vocab := int32(eng.Info().Vocab)
	warm := sample.DefaultParams()
	warm.Temperature = 0.8
	tests := []struct {
		name   string
		params sample.Params
		picks  []int32
		want   string
	}{
		{"unasked", warm, []int32{1}, "unasked"},
		{"too many", greedy(), []int32{1, 2}, "2 greedy picks for 1 rows"},
		{"negative", greedy(), []int32{-1}, "outside the vocabulary"},
		{"past the vocabulary", greedy(), []int32{vocab}, "outside the vocabulary"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			pipe := Local(fixedPicks{Engine: eng, picks: tc.picks}, nil)
			if err := pipe.Open(7, tc.params, prompt); err != nil {
				t.Fatal(err)
			}
			defer pipe.Release(7)
			b := &stage.Batch{Outputs: []int{len(prompt) - 1}}
			for pos, id := range prompt {
				b.Seqs, b.Pos, b.Tokens = append(b.Seqs, 7), append(b.Pos, int32(pos)), append(b.Tokens, id)
			}
			_, err := pipe.Forward(context.Background(), b)
			if err == nil || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %v, want one saying %q", err, tc.want)
			}
		})
	}
}

// fixedPicks runs the pass, then answers with the given picks whatever was
// asked.
type fixedPicks struct {
	stage.Engine
	picks []int32
}

func (f fixedPicks) Forward(ctx context.Context, b *stage.Batch) (*stage.Output, error) {
	out, err := f.Engine.Forward(ctx, b)
	if err != nil {
		return nil, err
	}
	out.Release()
	return &stage.Output{Picks: slices.Clone(f.picks)}, nil
}

// TestGreedyPicksText: generation through the scheduler with an engine
// that answers greedy batches with picks gives the text of the engine that
// returns logits.
func TestGreedyPicksText(t *testing.T) {
	eng, tok := openStories(t, 4)
	defer eng.Close()
	ids, _ := tok.Encode("Once upon a time", true)
	generate := func(e stage.Engine) string {
		s := New(Local(e, nil), tok, Config{Parallel: 2}, nil)
		ctx, cancel := context.WithCancel(context.Background())
		done := make(chan struct{})
		go func() { s.Run(ctx); close(done) }()
		defer func() { cancel(); <-done }()
		ch, err := s.Submit(context.Background(), Request{Prompt: ids, MaxTokens: 40, Sampling: greedy()})
		if err != nil {
			t.Fatal(err)
		}
		text, _ := collect(t, ch)
		return text
	}
	want := generate(eng)
	p := &stagetest.Picker{Engine: eng}
	got := generate(p)
	if got != want {
		t.Errorf("with greedy picks %q, with logits %q", got, want)
	}
	if !slices.Contains(p.Asked(), true) {
		t.Error("no pass asked for greedy picks")
	}
	if len(want) < 40 {
		t.Errorf("text %q is too short to compare", want)
	}
}
