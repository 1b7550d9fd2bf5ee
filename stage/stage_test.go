package stage

import (
	"math"
	"strings"
	"testing"
)

func TestInfo(t *testing.T) {
	tests := []struct {
		start, end  int
		first, last bool
		rng         string
	}{
		{0, 5, true, true, "[0,5)"},
		{0, 2, true, false, "[0,2)"},
		{2, 4, false, false, "[2,4)"},
		{4, 5, false, true, "[4,5)"},
	}
	for _, tt := range tests {
		i := Info{Layers: 5, Start: tt.start, End: tt.end}
		if i.First() != tt.first || i.Last() != tt.last || i.Range() != tt.rng {
			t.Errorf("%+v: first %v last %v range %q", i, i.First(), i.Last(), i.Range())
		}
	}
}

func TestMemoryTotal(t *testing.T) {
	m := Memory{Weights: 1000, KVPerToken: 16, Compute: 24}
	if got := m.Total(0); got != 1024 {
		t.Errorf("Total(0) = %d", got)
	}
	if got := m.Total(100); got != 2624 {
		t.Errorf("Total(100) = %d", got)
	}
}

func TestLogitsRow(t *testing.T) {
	o := Output{Logits: []float32{0, 1, 2, 3, 4, 5}}
	if r := o.LogitsRow(1, 3); len(r) != 3 || r[0] != 3 || r[2] != 5 {
		t.Errorf("row 1 = %v", r)
	}
}

// TestBatchValidate walks every error path of Batch.Validate: engines rely
// on it to turn a bad batch (from a buggy scheduler or a hostile peer) into
// an error before any index is used, so each check must fire on its own.
func TestBatchValidate(t *testing.T) {
	const embd = 4
	first := Info{Layers: 4, Start: 0, End: 2, Embd: embd, Vocab: 10, Context: 8}
	middle := Info{Layers: 4, Start: 1, End: 3, Embd: embd, Vocab: 10, Context: 8}
	last := Info{Layers: 4, Start: 2, End: 4, Embd: embd, Vocab: 10, Context: 8}
	whole := Info{Layers: 4, Start: 0, End: 4, Embd: embd, Vocab: 10, Context: 8}
	unbounded := Info{Layers: 4, Start: 0, End: 4, Embd: embd} // no context or vocab known

	hidden := func(dt DType, rows, cols int) *Activation {
		return &Activation{DType: dt, Rows: rows, Cols: cols, Data: make([]byte, rows*cols*dt.Size())}
	}
	seqs := func(n int) []SeqID { return make([]SeqID, n) }

	tests := []struct {
		name  string
		info  Info
		batch Batch
		err   string // "" = valid
	}{
		// Valid batches of every stage kind.
		{"first stage", first, Batch{Seqs: seqs(2), Pos: []int32{0, 1}, Tokens: []int32{3, 9}}, ""},
		{"middle stage f16", middle, Batch{Seqs: seqs(2), Pos: []int32{0, 7}, Hidden: hidden(F16, 2, embd)}, ""},
		{"last stage", last, Batch{Seqs: seqs(3), Pos: []int32{0, 1, 2}, Hidden: hidden(F32, 3, embd), Outputs: []int{0, 2}}, ""},
		{"last stage no outputs", last, Batch{Seqs: seqs(1), Pos: []int32{0}, Hidden: hidden(BF16, 1, embd)}, ""},
		{"whole model", whole, Batch{Seqs: []SeqID{1, 2}, Pos: []int32{5, 0}, Tokens: []int32{0, 1}, Outputs: []int{1}}, ""},
		{"no context or vocab to check", unbounded, Batch{Seqs: seqs(1), Pos: []int32{1 << 30}, Tokens: []int32{1 << 30}}, ""},
		// Outputs matter only to the last stage; others ignore them.
		{"middle ignores outputs", middle, Batch{Seqs: seqs(1), Pos: []int32{0}, Hidden: hidden(F32, 1, embd), Outputs: []int{5, 1}}, ""},
		// The first stage embeds tokens and ignores any hidden states.
		{"first ignores hidden", first, Batch{Seqs: seqs(1), Pos: []int32{0}, Tokens: []int32{1}, Hidden: hidden(F32, 9, 9)}, ""},

		{"empty", whole, Batch{}, "empty batch"},
		{"positions missing", whole, Batch{Seqs: seqs(2), Pos: []int32{0}, Tokens: []int32{1, 2}}, "2 sequence ids but 1 positions"},
		{"too many positions", whole, Batch{Seqs: seqs(1), Pos: []int32{0, 1}, Tokens: []int32{1}}, "1 sequence ids but 2 positions"},
		{"negative position", whole, Batch{Seqs: seqs(2), Pos: []int32{0, -1}, Tokens: []int32{1, 2}}, "row 1 position -1 outside context"},
		{"position at context", whole, Batch{Seqs: seqs(1), Pos: []int32{8}, Tokens: []int32{1}}, "row 0 position 8 outside context [0,8)"},
		{"negative position unbounded", unbounded, Batch{Seqs: seqs(1), Pos: []int32{-3}, Tokens: []int32{1}}, "position -3"},
		{"tokens missing", first, Batch{Seqs: seqs(2), Pos: []int32{0, 1}, Tokens: []int32{1}}, "needs 2 token ids, got 1"},
		{"tokens absent", first, Batch{Seqs: seqs(1), Pos: []int32{0}, Hidden: hidden(F32, 1, embd)}, "needs 1 token ids, got 0"},
		{"negative token", first, Batch{Seqs: seqs(1), Pos: []int32{0}, Tokens: []int32{-1}}, "token id -1 outside vocabulary"},
		{"token at vocab", first, Batch{Seqs: seqs(2), Pos: []int32{0, 1}, Tokens: []int32{0, 10}}, "row 1 token id 10 outside vocabulary [0,10)"},
		{"negative token unbounded", unbounded, Batch{Seqs: seqs(1), Pos: []int32{0}, Tokens: []int32{-5}}, "token id -5"},
		{"hidden missing", middle, Batch{Seqs: seqs(1), Pos: []int32{0}, Tokens: []int32{1}}, "needs hidden states"},
		{"hidden bad dtype", middle, Batch{Seqs: seqs(1), Pos: []int32{0}, Hidden: &Activation{DType: 9, Rows: 1, Cols: embd}}, "unknown dtype"},
		{"hidden short payload", last, Batch{Seqs: seqs(1), Pos: []int32{0}, Hidden: &Activation{DType: F32, Rows: 1, Cols: embd, Data: make([]byte, 15)}}, "payload has 15"},
		{"hidden wrong rows", middle, Batch{Seqs: seqs(2), Pos: []int32{0, 1}, Hidden: hidden(F32, 1, embd)}, "hidden states are [1,4], want [2,4]"},
		{"hidden wrong cols", last, Batch{Seqs: seqs(1), Pos: []int32{0}, Hidden: hidden(F16, 1, embd+1)}, "hidden states are [1,5], want [1,4]"},
		{"output out of range", last, Batch{Seqs: seqs(2), Pos: []int32{0, 1}, Hidden: hidden(F32, 2, embd), Outputs: []int{2}}, "ascending indices in [0,2)"},
		{"negative output", whole, Batch{Seqs: seqs(2), Pos: []int32{0, 1}, Tokens: []int32{1, 2}, Outputs: []int{-1}}, "ascending indices"},
		{"outputs descending", whole, Batch{Seqs: seqs(3), Pos: []int32{0, 1, 2}, Tokens: []int32{1, 2, 3}, Outputs: []int{2, 1}}, "ascending indices"},
		{"output repeated", whole, Batch{Seqs: seqs(3), Pos: []int32{0, 1, 2}, Tokens: []int32{1, 2, 3}, Outputs: []int{1, 1}}, "ascending indices"},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			err := tt.batch.Validate(tt.info)
			switch {
			case tt.err == "" && err != nil:
				t.Fatalf("valid batch refused: %v", err)
			case tt.err != "" && err == nil:
				t.Fatalf("accepted, want error containing %q", tt.err)
			case tt.err != "" && !strings.Contains(err.Error(), tt.err):
				t.Fatalf("error %q does not contain %q", err, tt.err)
			}
		})
	}
}

func TestGreedyPick(t *testing.T) {
	nan, inf := float32(math.NaN()), float32(math.Inf(1))
	tests := []struct {
		name   string
		logits []float32
		want   int32
	}{
		{"empty", nil, -1},
		{"one", []float32{-3}, 0},
		{"largest", []float32{1, 5, 2}, 1},
		{"first of ties", []float32{1, 5, 5, 2}, 1},
		{"NaN never wins", []float32{nan, -100, nan}, 1},
		{"NaN first, then -Inf", []float32{nan, -inf}, 0},
		{"all -Inf", []float32{-inf, -inf, -inf}, 0},
		{"all NaN", []float32{nan, nan}, 0},
		{"+Inf ties the largest float", []float32{1, math.MaxFloat32, inf}, 1},
		{"+Inf before the largest float", []float32{1, inf, math.MaxFloat32}, 1},
		{"last", []float32{-1, -2, 7}, 2},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			if got := GreedyPick(tc.logits); got != tc.want {
				t.Errorf("GreedyPick(%v) = %d, want %d", tc.logits, got, tc.want)
			}
		})
	}
}
