package pipeline

import (
	"context"
	"testing"

	"github.com/meshnode/meshnode/node/sample"
	"github.com/meshnode/meshnode/stage"
	"github.com/meshnode/meshnode/stage/stagetest"
)

// TestLastStageGreedyPicks: the last stage asks its engine for greedy picks
// when every output row is sampled greedily with no log-probabilities, and
// sends them to the origin as the tokens; otherwise it samples logits.
func TestLastStageGreedyPicks(t *testing.T) {
	withLogprobs := greedy()
	withLogprobs.Logprobs, withLogprobs.TopLogprobs = true, 1
	warm := sample.DefaultParams()
	warm.Temperature = 0.9
	tests := []struct {
		name  string
		p     sample.Params
		picks bool
	}{
		{"greedy", greedy(), true},
		{"greedy with logprobs", withLogprobs, false},
		{"temperature", warm, false},
	}
	prompt := []int32{1, 403, 407, 261, 378}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var last *stagetest.Picker
			wrap := stageOpts{wrap: func(e stage.Engine) stage.Engine { last = &stagetest.Picker{Engine: e, Shift: 1}; return last }}
			m := newMesh(t, []int{0, 2, 5}, engineOpts, stageOpts{}, wrap)
			p := m.pipeline(t, Config{})
			if err := p.Open(1, tc.p, prompt); err != nil {
				t.Fatal(err)
			}
			b := &stage.Batch{Outputs: []int{len(prompt) - 1}}
			for pos, id := range prompt {
				b.Seqs, b.Pos, b.Tokens = append(b.Seqs, 1), append(b.Pos, int32(pos)), append(b.Tokens, id)
			}
			picked, err := p.Forward(context.Background(), b)
			if err != nil {
				t.Fatal(err)
			}
			if got := last.LastAsked(); got != tc.picks {
				t.Fatalf("PicksOnly %v, want %v", got, tc.picks)
			}
			// The reference: the whole model in one engine, sampled greedily.
			whole := openEngines(t, []int{0, 5}, engineOpts)[0]
			if err := whole.Open(9); err != nil {
				t.Fatal(err)
			}
			ref := &stage.Batch{Seqs: make([]stage.SeqID, len(prompt)), Pos: b.Pos, Tokens: b.Tokens, Outputs: b.Outputs}
			for i := range ref.Seqs {
				ref.Seqs[i] = 9
			}
			out, err := whole.Forward(context.Background(), ref)
			if err != nil {
				t.Fatal(err)
			}
			g := stage.GreedyPick(out.Logits)
			switch {
			case tc.picks && picked.Tokens[0] != g+1:
				t.Errorf("token %d, want the engine's pick %d", picked.Tokens[0], g+1)
			case !tc.picks && tc.p.Temperature == 0 && picked.Tokens[0] != g:
				t.Errorf("token %d, want the greedy %d of the logits", picked.Tokens[0], g)
			}
			if tc.p.Logprobs && len(picked.Logprobs) != 1 {
				t.Errorf("%d log-probabilities, want 1", len(picked.Logprobs))
			}
		})
	}
}
