package stagetest

import (
	"context"
	"math"
	"slices"
	"testing"

	"github.com/meshnode/meshnode/stage"
)

// fixedLogits answers every pass with the same logits for each output row;
// its free counts the outputs released.
type fixedLogits struct {
	stage.Engine // nil: only Info and Forward are called
	rows         [][]float32
	freed        int
}

func (f *fixedLogits) Info() stage.Info { return stage.Info{Layers: 1, End: 1, Vocab: len(f.rows[0])} }

func (f *fixedLogits) Forward(_ context.Context, b *stage.Batch) (*stage.Output, error) {
	var logits []float32
	for i := range b.Outputs {
		logits = append(logits, f.rows[i%len(f.rows)]...)
	}
	return &stage.Output{Logits: logits, Free: func() { f.freed++ }}, nil
}

func TestPicker(t *testing.T) {
	nan, inf := float32(math.NaN()), float32(math.Inf(1))
	rows := [][]float32{
		{0.5, 2, 1, 2},   // a tie: the lowest index
		{nan, -1, -3, 0}, // NaN is -Inf
		{1, inf, 3, inf}, // +Inf is the largest
	}
	tests := []struct {
		name      string
		shift     int32
		picksOnly bool
		want      []int32 // nil: the logits pass through
	}{
		{"logits asked", 0, false, nil},
		{"picks", 0, true, []int32{1, 3, 1}},
		{"picks shifted", 1, true, []int32{2, 0, 2}}, // modulo the vocabulary of 4
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			eng := &fixedLogits{rows: rows}
			p := &Picker{Engine: eng, Shift: tc.shift}
			b := &stage.Batch{Seqs: []stage.SeqID{1, 2, 3}, Pos: []int32{0, 0, 0}, Tokens: []int32{1, 1, 1},
				Outputs: []int{0, 1, 2}, PicksOnly: tc.picksOnly}
			out, err := p.Forward(context.Background(), b)
			if err != nil {
				t.Fatal(err)
			}
			if tc.want == nil {
				if out.Picks != nil || len(out.Logits) != 3*4 {
					t.Fatalf("logits asked: got picks %v and %d logits", out.Picks, len(out.Logits))
				}
			} else {
				if !slices.Equal(out.Picks, tc.want) || out.Logits != nil {
					t.Fatalf("picks %v (logits %v), want %v", out.Picks, out.Logits, tc.want)
				}
				if eng.freed != 1 {
					t.Fatalf("the engine's logits were released %d times, want once", eng.freed)
				}
			}
			if got := p.Asked(); !slices.Equal(got, []bool{tc.picksOnly}) || p.LastAsked() != tc.picksOnly {
				t.Fatalf("Asked %v, LastAsked %v; want [%v]", got, p.LastAsked(), tc.picksOnly)
			}
		})
	}
	if (&Picker{}).LastAsked() {
		t.Fatal("LastAsked before any pass: true")
	}
}
