package sample

import (
	"math"
	"math/rand/v2"
	"slices"
	"testing"
)

// naiveLogprobs is the textbook log-softmax, sorted by a full sort: the
// reference LogprobOf is checked against.
func naiveLogprobs(logits []float32) (lp []float64, order []int) {
	clean := make([]float64, len(logits))
	for i, x := range logits {
		switch {
		case math.IsNaN(float64(x)):
			clean[i] = math.Inf(-1)
		case math.IsInf(float64(x), 1):
			clean[i] = math.MaxFloat32
		default:
			clean[i] = float64(x)
		}
	}
	m := slices.Max(clean)
	z := 0.0
	for _, x := range clean {
		z += math.Exp(x - m)
	}
	lp = make([]float64, len(clean))
	for i, x := range clean {
		lp[i] = x - m - math.Log(z)
	}
	order = make([]int, len(clean))
	for i := range order {
		order[i] = i
	}
	slices.SortStableFunc(order, func(a, b int) int {
		switch {
		case clean[a] > clean[b]:
			return -1
		case clean[a] < clean[b]:
			return 1
		}
		return 0
	})
	return lp, order
}

func TestLogprobOf(t *testing.T) {
	rng := rand.New(rand.NewPCG(1, 2))
	random := func(n int, scale float32) []float32 {
		l := make([]float32, n)
		for i := range l {
			l[i] = float32(rng.NormFloat64()) * scale
		}
		return l
	}
	ninf, inf, nan := float32(math.Inf(-1)), float32(math.Inf(1)), float32(math.NaN())
	tests := []struct {
		name   string
		logits []float32
		tok    int32
		top    int
	}{
		{"vocab of 32000, top 5", random(32000, 4), 17, 5},
		{"sharp distribution", random(1000, 40), 3, 20},
		{"top over the vocabulary", random(6, 1), 2, 20},
		{"no top", random(100, 2), 99, 0},
		{"ties go to the lower id", []float32{1, 3, 3, 0, 3}, 4, 3},
		{"NaN and -Inf are impossible", []float32{nan, 2, ninf, 1}, 0, 4},
		{"+Inf is the largest finite", []float32{inf, 1, 0}, 0, 2},
		{"large logits do not overflow", []float32{3e38, 2.9e38, -3e38}, 1, 3},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := LogprobOf(tt.logits, tt.tok, tt.top)
			want, order := naiveLogprobs(tt.logits)
			close := func(g float32, w float64) bool {
				if math.IsInf(w, -1) || w < -math.MaxFloat32 {
					return math.IsInf(float64(g), -1) || float64(g) < -math.MaxFloat32/2
				}
				return math.Abs(float64(g)-w) <= 1e-5*max(1, math.Abs(w))
			}
			if !close(got.Logprob, want[tt.tok]) {
				t.Errorf("logprob of %d = %v, want %v", tt.tok, got.Logprob, want[tt.tok])
			}
			if got.Logprob > 0 {
				t.Errorf("logprob %v is above 0", got.Logprob)
			}
			n := min(tt.top, len(tt.logits))
			if len(got.Top) != n {
				t.Fatalf("%d alternatives, want %d", len(got.Top), n)
			}
			for i, c := range got.Top {
				if int(c.Token) != order[i] || !close(c.Logprob, want[order[i]]) {
					t.Errorf("alternative %d is %d (%v), want %d (%v)", i, c.Token, c.Logprob, order[i], want[order[i]])
				}
			}
		})
	}
}

// The alternatives of a whole vocabulary are a distribution.
func TestLogprobOfSumsToOne(t *testing.T) {
	l := []float32{0.5, -1, 2, 2, -7, 0}
	lp := LogprobOf(l, 2, len(l))
	sum := 0.0
	for _, c := range lp.Top {
		sum += math.Exp(float64(c.Logprob))
	}
	if math.Abs(sum-1) > 1e-6 {
		t.Errorf("probabilities sum to %v, want 1", sum)
	}
	if lp.Top[0].Logprob != lp.Logprob || lp.Top[0].Token != 2 {
		t.Errorf("the top alternative %+v is not the sampled argmax (%v)", lp.Top[0], lp.Logprob)
	}
}

func TestLogprobOfDegenerate(t *testing.T) {
	ninf := float32(math.Inf(-1))
	tests := []struct {
		name   string
		logits []float32
		tok    int32
		top    int
	}{
		{"empty logits", nil, 0, 3},
		{"token out of range", []float32{1, 2}, 2, 1},
		{"negative token", []float32{1, 2}, -1, 1},
		{"nothing possible", []float32{ninf, ninf, ninf}, 1, 2},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := LogprobOf(tt.logits, tt.tok, tt.top)
			if !math.IsInf(float64(got.Logprob), -1) {
				t.Errorf("logprob %v, want -Inf", got.Logprob)
			}
			for _, c := range got.Top {
				if !math.IsInf(float64(c.Logprob), -1) {
					t.Errorf("alternative %+v, want -Inf", c)
				}
			}
		})
	}
}

func TestValidateTopLogprobs(t *testing.T) {
	tests := []struct {
		logprobs bool
		top      int
		ok       bool
	}{
		{false, 0, true},
		{true, 0, true},
		{true, MaxTopLogprobs, true},
		{true, MaxTopLogprobs + 1, false},
		{true, -1, false},
		{false, 2, false},
	}
	for _, tt := range tests {
		p := DefaultParams()
		p.Logprobs, p.TopLogprobs = tt.logprobs, tt.top
		if err := p.Validate(); (err == nil) != tt.ok {
			t.Errorf("logprobs %v top %d: %v, want ok %v", tt.logprobs, tt.top, err, tt.ok)
		}
	}
}
