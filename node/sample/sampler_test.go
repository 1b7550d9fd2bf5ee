package sample

import (
	"errors"
	"math"
	"math/rand/v2"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/meshnode/meshnode/stage"
	"github.com/meshnode/meshnode/stage/stagetest"
)

func seed(v int64) *int64 { return &v }

// params returns DefaultParams with a fixed seed, changed by fn.
func params(fn func(*Params)) Params {
	p := DefaultParams()
	p.Seed = seed(42)
	if fn != nil {
		fn(&p)
	}
	return p
}

// repeated returns first followed by n copies of filler.
func repeated(first, filler int32, n int) []int32 {
	h := []int32{first}
	for range n {
		h = append(h, filler)
	}
	return h
}

var (
	inf  = float32(math.Inf(1))
	ninf = float32(math.Inf(-1))
	nan  = float32(math.NaN())
)

// logitsOf returns log-probabilities, so softmax at temperature 1 gives back p.
func logitsOf(p ...float64) []float32 {
	l := make([]float32, len(p))
	for i, v := range p {
		l[i] = float32(math.Log(v))
	}
	return l
}

func TestValidate(t *testing.T) {
	nanf := float32(math.NaN())
	tests := []struct {
		name string
		fn   func(*Params)
		want string // parameter named in the error; "" for valid
	}{
		{"defaults", nil, ""},
		{"greedy", func(p *Params) { p.Temperature = 0 }, ""},
		{"all filters", func(p *Params) { p.TopK, p.TopP, p.MinP, p.Temperature = 40, 0.95, 0.05, 2 }, ""},
		{"penalties at the limits", func(p *Params) {
			p.RepeatPenalty, p.FrequencyPenalty, p.PresencePenalty, p.RepeatLastN = 0.5, -2, 2, -1
		}, ""},
		{"temperature negative", func(p *Params) { p.Temperature = -0.1 }, "temperature"},
		{"temperature too high", func(p *Params) { p.Temperature = 2.01 }, "temperature"},
		{"temperature NaN", func(p *Params) { p.Temperature = nanf }, "temperature"},
		{"top_k negative", func(p *Params) { p.TopK = -1 }, "top_k"},
		{"top_p zero", func(p *Params) { p.TopP = 0 }, "top_p"},
		{"top_p above 1", func(p *Params) { p.TopP = 1.5 }, "top_p"},
		{"top_p NaN", func(p *Params) { p.TopP = nanf }, "top_p"},
		{"min_p one", func(p *Params) { p.MinP = 1 }, "min_p"},
		{"min_p negative", func(p *Params) { p.MinP = -0.1 }, "min_p"},
		{"repeat_penalty zero", func(p *Params) { p.RepeatPenalty = 0 }, "repeat_penalty"},
		{"repeat_penalty Inf", func(p *Params) { p.RepeatPenalty = inf }, "repeat_penalty"},
		{"repeat_last_n", func(p *Params) { p.RepeatLastN = -2 }, "repeat_last_n"},
		{"frequency_penalty", func(p *Params) { p.FrequencyPenalty = 2.5 }, "frequency_penalty"},
		{"presence_penalty", func(p *Params) { p.PresencePenalty = -3 }, "presence_penalty"},
		{"presence_penalty NaN", func(p *Params) { p.PresencePenalty = nanf }, "presence_penalty"},
	}
	for _, tt := range tests {
		err := params(tt.fn).Validate()
		switch {
		case tt.want == "" && err != nil:
			t.Errorf("%s: unexpected error %v", tt.name, err)
		case tt.want != "" && err == nil:
			t.Errorf("%s: no error", tt.name)
		case tt.want != "" && (!strings.HasPrefix(err.Error(), tt.want+" is") || !errors.Is(err, ErrInvalidParams)):
			t.Errorf("%s: error %q should name %s and wrap ErrInvalidParams", tt.name, err, tt.want)
		}
	}
	if err := (Params{}).Validate(); err == nil {
		t.Error("zero Params validated; top_p 0 should be rejected")
	}
}

func TestGreedy(t *testing.T) {
	tests := []struct {
		name   string
		logits []float32
		want   int32
	}{
		{"argmax", []float32{0.1, 3, -2, 2.9}, 1},
		{"tie goes to the lowest id", []float32{1, 5, 5, 5}, 1},
		{"negative logits", []float32{-3, -1, -2}, 1},
		{"NaN is -Inf", []float32{nan, -5, nan}, 1},
		{"+Inf wins", []float32{1e30, inf, 2}, 1},
		{"two +Inf: lowest id", []float32{1, inf, inf}, 1},
		{"all -Inf falls back to token 0", []float32{ninf, ninf, ninf}, 0},
		{"all NaN falls back to token 0", []float32{nan, nan}, 0},
		{"single token", []float32{-1}, 0},
		{"empty", nil, -1},
	}
	for _, tt := range tests {
		s := New(params(func(p *Params) { p.Temperature = 0 }))
		if got := s.Sample(tt.logits, nil); got != tt.want {
			t.Errorf("%s: Sample = %d, want %d", tt.name, got, tt.want)
		}
	}
}

// TestFilters checks the candidate set and its probabilities on small
// hand-made distributions.
func TestFilters(t *testing.T) {
	// Token ids shuffled against probability so order by id means nothing.
	dist := logitsOf(0.1, 0.5, 0.05, 0.2, 0.15) // ids by rank: 1, 3, 4, 0, 2
	tests := []struct {
		name string
		fn   func(*Params)
		want []int32   // kept tokens, most likely first
		prob []float64 // their probabilities after renormalising, same order
	}{
		{"no filter keeps everything", nil, []int32{1, 3, 4, 0, 2}, []float64{0.5, 0.2, 0.15, 0.1, 0.05}},
		{"top_k 2", func(p *Params) { p.TopK = 2 }, []int32{1, 3}, []float64{0.5 / 0.7, 0.2 / 0.7}},
		{"top_k 1", func(p *Params) { p.TopK = 1 }, []int32{1}, []float64{1}},
		{"top_k larger than vocab", func(p *Params) { p.TopK = 10 }, []int32{1, 3, 4, 0, 2}, []float64{0.5, 0.2, 0.15, 0.1, 0.05}},
		{"top_p 0.6: 0.5 is not enough", func(p *Params) { p.TopP = 0.6 }, []int32{1, 3}, []float64{0.5 / 0.7, 0.2 / 0.7}},
		{"top_p 0.85: mass exactly p is enough", func(p *Params) { p.TopP = 0.85 }, []int32{1, 3, 4}, []float64{0.5 / 0.85, 0.2 / 0.85, 0.15 / 0.85}},
		{"top_p 0.86", func(p *Params) { p.TopP = 0.86 }, []int32{1, 3, 4, 0}, []float64{0.5 / 0.95, 0.2 / 0.95, 0.15 / 0.95, 0.1 / 0.95}},
		{"top_p 0.01 keeps the best", func(p *Params) { p.TopP = 0.01 }, []int32{1}, []float64{1}},
		// top-p measures mass after top-k: 0.85/0.95 = 0.895 >= 0.88.
		{"top_k then top_p", func(p *Params) { p.TopK, p.TopP = 4, 0.88 }, []int32{1, 3, 4}, []float64{0.5 / 0.85, 0.2 / 0.85, 0.15 / 0.85}},
		{"top_p 0.88 alone", func(p *Params) { p.TopP = 0.88 }, []int32{1, 3, 4, 0}, []float64{0.5 / 0.95, 0.2 / 0.95, 0.15 / 0.95, 0.1 / 0.95}},
		{"min_p 0.3: at least 0.15", func(p *Params) { p.MinP = 0.3 }, []int32{1, 3, 4}, []float64{0.5 / 0.85, 0.2 / 0.85, 0.15 / 0.85}},
		{"min_p 0.41", func(p *Params) { p.MinP = 0.41 }, []int32{1}, []float64{1}},
		{"min_p with top_k", func(p *Params) { p.MinP, p.TopK = 0.3, 2 }, []int32{1, 3}, []float64{0.5 / 0.7, 0.2 / 0.7}},
		{"top_p and min_p: the smaller set", func(p *Params) { p.MinP, p.TopP = 0.3, 0.6 }, []int32{1, 3}, []float64{0.5 / 0.7, 0.2 / 0.7}},
		// Temperature 0.5 squares the probabilities: 0.25 0.04 0.0225 0.01 0.0025.
		{"temperature sharpens before top_p", func(p *Params) { p.Temperature, p.TopP = 0.5, 0.8 }, []int32{1, 3}, []float64{0.25 / 0.29, 0.04 / 0.29}},
		{"temperature sharpens before min_p", func(p *Params) { p.Temperature, p.MinP = 0.5, 0.15 }, []int32{1, 3}, []float64{0.25 / 0.29, 0.04 / 0.29}},
		{"temperature 2 flattens", func(p *Params) { p.Temperature, p.TopK = 2, 2 }, []int32{1, 3}, []float64{math.Sqrt(0.5) / (math.Sqrt(0.5) + math.Sqrt(0.2)), math.Sqrt(0.2) / (math.Sqrt(0.5) + math.Sqrt(0.2))}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			s := New(params(tt.fn))
			cs, pick, sum := s.candidates(dist, nil)
			if pick != -1 {
				t.Fatalf("deterministic pick %d", pick)
			}
			// A sum it returns is the candidates' weights summed in their
			// order, as draw would sum them.
			inOrder := 0.0
			for _, c := range cs {
				inOrder += c.w
			}
			if sum >= 0 && sum != inOrder {
				t.Fatalf("candidates' sum %v, their weights sum to %v", sum, inOrder)
			}
			// The draw order is not by probability; compare as sets.
			slices.SortFunc(cs, compareCands)
			ids := make([]int32, len(cs))
			total := 0.0
			for i, c := range cs {
				ids[i] = c.id
				total += c.w
			}
			if !slices.Equal(ids, tt.want) {
				t.Fatalf("kept %v, want %v", ids, tt.want)
			}
			for i, c := range cs {
				if got := c.w / total; math.Abs(got-tt.prob[i]) > 1e-6 {
					t.Errorf("token %d probability %.7f, want %.7f", c.id, got, tt.prob[i])
				}
			}
		})
	}
}

func TestTopKTies(t *testing.T) {
	s := New(params(func(p *Params) { p.TopK = 2 }))
	cs, _, _ := s.candidates([]float32{1, 3, 3, 3, 0}, nil)
	if len(cs) != 2 || cs[0].id != 1 || cs[1].id != 2 {
		t.Errorf("top-2 of tied tokens = %+v, want ids 1 and 2", cs)
	}
}

// TestSelectionMatchesSort checks the heap selection and the growing
// nucleus against a full sort on a large random vocabulary.
func TestSelectionMatchesSort(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 7))
	const n = 5000
	l := make([]float32, n)
	for i := range l {
		l[i] = float32(r.NormFloat64() * 3)
		if i%97 == 0 {
			l[i] = l[i/2] // some ties
		}
	}
	sorted := make([]cand, n)
	for i, x := range l {
		sorted[i] = cand{id: int32(i), logit: x}
	}
	slices.SortFunc(sorted, compareCands)

	s := New(params(nil))
	s.candidates(l, nil) // sizes the scratch space
	for _, k := range []int{1, 2, 40, 1000, n - 1, n} {
		got := s.topK(l, k)
		for i := range got {
			if got[i].id != sorted[i].id {
				t.Fatalf("topK(%d)[%d] = %d, want %d", k, i, got[i].id, sorted[i].id)
			}
		}
	}
	for _, temp := range []float32{0.3, 1, 2} {
		for _, p := range []float32{0.1, 0.5, 0.9, 0.99, 0.999} {
			s := New(params(func(q *Params) { q.TopP, q.Temperature = p, temp }))
			cs, _, _ := s.candidates(l, nil)
			// Reference: cumulative softmax over the sorted vocabulary.
			w := make([]float64, n)
			total := 0.0
			invT := 1 / float64(temp)
			for i, c := range sorted {
				w[i] = math.Exp((float64(c.logit) - float64(sorted[0].logit)) * invT)
				total += w[i]
			}
			want, cum := 0, 0.0
			for want < n {
				cum += w[want]
				want++
				if cum >= float64(p)*total*(1-slack) {
					break
				}
			}
			if len(cs) != want {
				t.Errorf("T=%v top_p %v kept %d tokens, want %d", temp, p, len(cs), want)
			}
		}
	}
}

func TestSeedReproducible(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 1))
	l := make([]float32, 1000)
	for i := range l {
		l[i] = float32(r.NormFloat64())
	}
	run := func(p Params) []int32 {
		s := New(p)
		var out []int32
		for range 200 {
			out = append(out, s.Sample(l, out))
		}
		return out
	}
	for _, fn := range []func(*Params){
		nil,
		func(p *Params) { p.TopK = 40 },
		func(p *Params) { p.TopP, p.MinP = 0.9, 0.01 },
		func(p *Params) { p.RepeatPenalty, p.FrequencyPenalty = 1.3, 0.5 },
	} {
		a, b := run(params(fn)), run(params(fn))
		if !slices.Equal(a, b) {
			t.Errorf("same seed gave different tokens:\n%v\n%v", a, b)
		}
		other := params(fn)
		other.Seed = seed(43)
		if slices.Equal(a, run(other)) {
			t.Errorf("seeds 42 and 43 gave the same 200 tokens")
		}
	}
	random := params(nil)
	random.Seed = nil
	if slices.Equal(run(random), run(random)) {
		t.Errorf("two random seeds gave the same 200 tokens")
	}
}

func TestPenalties(t *testing.T) {
	tests := []struct {
		name    string
		fn      func(*Params)
		logits  []float32
		history []int32
		want    []float32 // logits after penalties
	}{
		{"off", nil, []float32{2, -1}, []int32{0, 1}, []float32{2, -1}},
		{"repeat divides positive", func(p *Params) { p.RepeatPenalty = 2 }, []float32{2, 1}, []int32{0}, []float32{1, 1}},
		{"repeat multiplies negative", func(p *Params) { p.RepeatPenalty = 2 }, []float32{-1, 1}, []int32{0, 0, 0}, []float32{-2, 1}},
		{"repeat below 1 rewards", func(p *Params) { p.RepeatPenalty = 0.5 }, []float32{2, -2}, []int32{0, 1}, []float32{4, -1}},
		{"frequency counts", func(p *Params) { p.FrequencyPenalty = 0.5 }, []float32{1, 1, 1}, []int32{0, 0, 0, 1}, []float32{-0.5, 0.5, 1}},
		{"presence once", func(p *Params) { p.PresencePenalty = 0.5 }, []float32{1, 1, 1}, []int32{0, 0, 0, 1}, []float32{0.5, 0.5, 1}},
		{"all three", func(p *Params) { p.RepeatPenalty, p.FrequencyPenalty, p.PresencePenalty = 2, 0.25, 1 }, []float32{4, -4}, []int32{0, 0, 1}, []float32{0.5, -9.25}},
		{"window of 2", func(p *Params) { p.RepeatLastN, p.PresencePenalty = 2, 1 }, []float32{0, 0, 0}, []int32{0, 1, 2}, []float32{0, -1, -1}},
		{"default window is 64", func(p *Params) { p.RepeatLastN, p.PresencePenalty = 0, 1 }, []float32{0, 0}, repeated(0, 1, 64), []float32{0, -1}},
		{"whole history", func(p *Params) { p.RepeatLastN, p.FrequencyPenalty = -1, 1 }, []float32{0, 0}, repeated(1, 0, 100), []float32{-100, -1}},
		{"out of range ids ignored", func(p *Params) { p.PresencePenalty = 1 }, []float32{0, 0}, []int32{-1, 2, 99}, []float32{0, 0}},
		{"overflow to +Inf is clamped", func(p *Params) { p.RepeatPenalty = 0.5 }, []float32{math.MaxFloat32, 0}, []int32{0}, []float32{math.MaxFloat32, 0}},
		{"-Inf stays -Inf", func(p *Params) { p.RepeatPenalty, p.PresencePenalty = 2, -1 }, []float32{ninf, 0}, []int32{0}, []float32{ninf, 0}},
	}
	for _, tt := range tests {
		s := New(params(tt.fn))
		l := slices.Clone(tt.logits)
		s.penalize(l, tt.history)
		if !slices.Equal(l, tt.want) {
			t.Errorf("%s: penalized logits %v, want %v", tt.name, l, tt.want)
		}
	}
}

// TestPenaltiesChangeChoice checks the greedy choice flips as the penalties
// say it should.
func TestPenaltiesChangeChoice(t *testing.T) {
	tests := []struct {
		name    string
		fn      func(*Params)
		logits  []float32
		history []int32
		want    int32
	}{
		{"no penalty", nil, []float32{2, 1.9}, []int32{0}, 0},
		{"repeat penalty 1.1 moves to token 1", func(p *Params) { p.RepeatPenalty = 1.1 }, []float32{2, 1.9}, []int32{0}, 1},
		{"repeat penalty on negative logits", func(p *Params) { p.RepeatPenalty = 1.1 }, []float32{-1, -1.05}, []int32{0}, 1},
		{"repeated token out of the window", func(p *Params) { p.RepeatPenalty, p.RepeatLastN = 1.1, 1 }, []float32{2, 1.9}, []int32{0, 1}, 0},
		{"frequency 0.2 x3", func(p *Params) { p.FrequencyPenalty = 0.2 }, []float32{1, 0.5}, []int32{0, 0, 0}, 1},
		{"frequency 0.1 x3", func(p *Params) { p.FrequencyPenalty = 0.1 }, []float32{1, 0.5}, []int32{0, 0, 0}, 0},
		{"presence 0.6", func(p *Params) { p.PresencePenalty = 0.6 }, []float32{1, 0.5}, []int32{0, 0, 0}, 1},
		{"presence 0.4", func(p *Params) { p.PresencePenalty = 0.4 }, []float32{1, 0.5}, []int32{0, 0, 0}, 0},
		{"negative presence encourages", func(p *Params) { p.PresencePenalty = -0.6 }, []float32{0.5, 1}, []int32{0}, 0},
	}
	for _, tt := range tests {
		s := New(params(func(p *Params) {
			p.Temperature = 0
			if tt.fn != nil {
				tt.fn(p)
			}
		}))
		if got := s.Sample(tt.logits, tt.history); got != tt.want {
			t.Errorf("%s: Sample = %d, want %d", tt.name, got, tt.want)
		}
	}
}

// TestReplayDrawsTheSameTokens: a new sampler with the same seed, given the
// same history, draws what the first one drew at that position, whatever
// the first one drew before: a generation can resume on another pipeline.
func TestReplayDrawsTheSameTokens(t *testing.T) {
	seed := int64(42)
	p := params(func(p *Params) { p.Seed = &seed })
	logits := logitsOf(0.4, 0.3, 0.2, 0.1)
	a := New(p)
	var history, drawn []int32
	for range 50 {
		tok := a.Sample(logits, history)
		drawn = append(drawn, tok)
		history = append(history, tok)
	}
	for cut := range 50 {
		b := New(p)
		if got := b.Sample(logits, history[:cut]); got != drawn[cut] {
			t.Fatalf("replay at position %d drew %d, the first run drew %d", cut, got, drawn[cut])
		}
	}
	distinct := map[int32]bool{}
	for _, d := range drawn {
		distinct[d] = true
	}
	if len(distinct) < 3 {
		t.Fatalf("50 draws from 4 tokens gave only %v", distinct)
	}
}

// TestDistribution draws 20000 tokens from known distributions.
func TestDistribution(t *testing.T) {
	const draws = 20000
	tests := []struct {
		name   string
		fn     func(*Params)
		logits []float32
		want   []float64
	}{
		{"temperature 1", nil, logitsOf(0.5, 0.3, 0.2), []float64{0.5, 0.3, 0.2}},
		{"temperature 0.5", func(p *Params) { p.Temperature = 0.5 }, logitsOf(0.5, 0.3, 0.2), []float64{25.0 / 38, 9.0 / 38, 4.0 / 38}},
		{"top_k path", func(p *Params) { p.TopK = 3 }, logitsOf(0.5, 0.3, 0.2, 1e-9), []float64{0.5, 0.3, 0.2, 0}},
		{"top_p path", func(p *Params) { p.TopP = 0.7 }, logitsOf(0.2, 0.3, 0.5), []float64{0, 0.375, 0.625}},
	}
	for _, tt := range tests {
		s := New(params(tt.fn))
		counts := make([]int, len(tt.logits))
		// Draws are keyed by position, so walk the position forward as a
		// generation does (the history's contents do not matter without
		// penalties).
		history := make([]int32, 0, draws)
		for range draws {
			counts[s.Sample(tt.logits, history)]++
			history = append(history, 0)
		}
		for i, c := range counts {
			// 0.015 is more than 4 standard deviations at p=0.5.
			if got := float64(c) / draws; math.Abs(got-tt.want[i]) > 0.015 {
				t.Errorf("%s: token %d drawn %.4f of the time, want %.4f", tt.name, i, got, tt.want[i])
			}
		}
	}
}

func TestNonFiniteLogits(t *testing.T) {
	tests := []struct {
		name   string
		logits []float32
		allow  []int32 // tokens that may be drawn
	}{
		{"NaN never drawn", []float32{nan, 0, nan, 0}, []int32{1, 3}},
		{"-Inf never drawn", []float32{ninf, 0, 0, ninf}, []int32{1, 2}},
		{"+Inf always drawn", []float32{1e30, inf, 3}, []int32{1}},
		{"several +Inf share", []float32{inf, 0, inf}, []int32{0, 2}},
		{"all -Inf: token 0", []float32{ninf, ninf}, []int32{0}},
		{"all NaN: token 0", []float32{nan, nan, nan}, []int32{0}},
	}
	for _, tt := range tests {
		for _, fn := range []func(*Params){nil, func(p *Params) { p.TopK = 2 }, func(p *Params) { p.TopP = 0.5 }, func(p *Params) { p.MinP = 0.5 }} {
			s := New(params(fn))
			for range 200 {
				if got := s.Sample(tt.logits, nil); !slices.Contains(tt.allow, got) {
					t.Fatalf("%s: drew %d, want one of %v", tt.name, got, tt.allow)
				}
			}
		}
	}
}

func TestDoesNotModifyLogits(t *testing.T) {
	l := []float32{nan, inf, ninf, 2, -3, 0.5}
	bits := func(l []float32) []uint32 {
		b := make([]uint32, len(l))
		for i, x := range l {
			b[i] = math.Float32bits(x)
		}
		return b
	}
	want := bits(l)
	s := New(params(func(p *Params) { p.TopK, p.RepeatPenalty, p.FrequencyPenalty = 3, 1.5, 1 }))
	for range 10 {
		s.Sample(l, []int32{0, 1, 2, 3, 4, 5})
	}
	if got := bits(l); !slices.Equal(got, want) {
		t.Errorf("logits changed: %v", l)
	}
}

// TestOddParams checks that unvalidated parameters do not panic.
func TestOddParams(t *testing.T) {
	l := logitsOf(0.5, 0.3, 0.2)
	for _, p := range []Params{
		{},
		{Temperature: float32(math.NaN())},
		{Temperature: inf, TopP: 1},
		{Temperature: 1e-30, TopP: -1},
		{Temperature: 1, TopK: -5, MinP: 2, RepeatPenalty: -1, RepeatLastN: -7},
		{Temperature: 1, TopP: float32(math.NaN()), FrequencyPenalty: float32(math.NaN())},
	} {
		s := New(p)
		for range 20 {
			if got := s.Sample(l, []int32{0, 1}); got < 0 || got > 2 {
				t.Errorf("%+v: drew %d", p, got)
			}
		}
	}
}

// BenchmarkSample measures one token at the vocabulary sizes of Llama 2 /
// Mistral (32000) and Qwen2 (151936). "flat" logits are normal with no clear
// winner, the worst case for top-p; "peaked" ones have a few clearly likely
// tokens, as language models usually do.
func BenchmarkSample(b *testing.B) {
	for _, n := range []int{32000, 151936} {
		r := rand.New(rand.NewPCG(9, 9))
		flat := make([]float32, n)
		for i := range flat {
			flat[i] = float32(r.NormFloat64() * 2.5)
		}
		peaked := slices.Clone(flat)
		for range 5 {
			peaked[r.IntN(n)] += 15 + 5*r.Float32()
		}
		history := make([]int32, 512)
		for i := range history {
			history[i] = int32(r.IntN(n))
		}
		for _, c := range []struct {
			name   string
			logits []float32
			fn     func(*Params)
		}{
			{"greedy", flat, func(p *Params) { p.Temperature = 0 }},
			{"plain", flat, nil},
			{"top_k=40", flat, func(p *Params) { p.TopK = 40 }},
			{"top_p=0.9/flat", flat, func(p *Params) { p.TopP = 0.9 }},
			{"top_p=0.9/peaked", peaked, func(p *Params) { p.TopP = 0.9 }},
			{"llama.cpp-defaults", peaked, func(p *Params) { p.Temperature, p.TopK, p.TopP, p.MinP, p.RepeatPenalty = 0.8, 40, 0.95, 0.05, 1.1 }},
		} {
			b.Run(c.name+"/vocab="+strconv.Itoa(n), func(b *testing.B) {
				s := New(params(c.fn))
				b.ReportAllocs()
				for b.Loop() {
					s.Sample(c.logits, history)
				}
			})
		}
	}
}

// TestArgmaxFiniteMatchesSanitized checks the one-pass greedy path against
// sanitizing a copy and taking argmax, on vectors of every length up to 40
// (every lane and tail) with ties, NaN and infinities sprinkled in.
func TestArgmaxFiniteMatchesSanitized(t *testing.T) {
	r := rand.New(rand.NewPCG(4, 2))
	specials := []float32{nan, inf, ninf, math.MaxFloat32, 3, 3}
	for n := 1; n <= 40; n++ {
		for trial := range 200 {
			l := sprinkled(r, n, 8, specials)
			clean := make([]float32, n)
			for i, x := range l {
				clean[i] = stage.SanitizeLogit(x)
			}
			want := stagetest.Argmax(clean)
			got, ok := argmaxFinite(l)
			if !ok {
				if !slices.Contains(l, inf) {
					t.Fatalf("n=%d trial %d: gave up without +Inf in %v", n, trial, l)
				}
				continue
			}
			if got != want {
				t.Fatalf("n=%d trial %d: argmaxFinite = %d, sanitized argmax = %d, logits %v", n, trial, got, want, l)
			}
		}
	}
}

// TestGreedyIsStagePick: a sampler that says it is Greedy picks
// stage.GreedyPick of any logits, the rule engines follow for
// stage.Output.Picks, and any other sampler says it is not.
func TestGreedyIsStagePick(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 1))
	specials := []float32{nan, inf, ninf, math.MaxFloat32, -math.MaxFloat32, 3, 3}
	history := []int32{1, 2, 3}
	g := params(func(p *Params) { p.Temperature = 0 })
	if !New(g).Greedy() {
		t.Fatal("a greedy sampler says it is not Greedy")
	}
	for n := 1; n <= 40; n++ {
		for trial := range 200 {
			l := sprinkled(r, n, 6, specials)
			if got, want := New(g).Sample(l, history), stage.GreedyPick(l); got != want {
				t.Fatalf("n=%d trial %d: Sample = %d, stage.GreedyPick = %d, logits %v", n, trial, got, want, l)
			}
		}
	}
	notGreedy := []func(*Params){
		func(p *Params) { p.Temperature = 0.7 },
		func(p *Params) { p.RepeatPenalty = 1.1 },
		func(p *Params) { p.FrequencyPenalty = 0.5 },
		func(p *Params) { p.PresencePenalty = -0.5 },
	}
	for i, f := range notGreedy {
		p := params(func(p *Params) { p.Temperature = 0 })
		f(&p)
		if New(p).Greedy() {
			t.Errorf("case %d: %+v says it is Greedy", i, p)
		}
	}
	constrained := New(params(func(p *Params) { p.Temperature = 0 }))
	constrained.Constrain(&JSONConstraint{})
	if constrained.Greedy() {
		t.Error("a sampler with a JSON constraint says it is Greedy")
	}
}

// TestExpNonPositive checks expNonPositive against math.Exp over the range
// sampling uses, at the edges of its table's steps and of the subnormals,
// and at the special values.
func TestExpNonPositive(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 5))
	worst := 0.0
	check := func(x float64) {
		got, want := expNonPositive(x), math.Exp(x)
		if want == 0 || want < 0x1p-1022 {
			// Subnormal results keep fewer bits; compare absolutely.
			if d := math.Abs(got - want); d > 1e-321 {
				t.Fatalf("exp(%v) = %v, want %v", x, got, want)
			}
			return
		}
		rel := math.Abs(got-want) / want
		worst = max(worst, rel)
		if !(rel < 1e-14) {
			t.Fatalf("exp(%v) = %v, want %v: relative error %.3g", x, got, want, rel)
		}
	}
	for range 200000 {
		check(-r.Float64() * 40)
		check(-r.Float64() * 745)
		check(-r.Float64() * 1e-3)
	}
	for k := range 40000 {
		// Around the points where the rounding of x·32/ln2 changes.
		x := -(float64(k) + 0.5) * math.Ln2 / expSteps
		for _, d := range []float64{-1e-12, 0, 1e-12} {
			check(x + d)
		}
	}
	for _, x := range []float64{-708.3, -708.4, -709, -744.4, -745} {
		check(x)
	}
	specials := []struct{ x, want float64 }{
		{0, 1}, {math.Copysign(0, -1), 1}, {-745.2, 0}, {-1000, 0}, {math.Inf(-1), 0}, {math.NaN(), 0},
	}
	for _, s := range specials {
		if got := expNonPositive(s.x); got != s.want {
			t.Errorf("exp(%v) = %v, want %v", s.x, got, s.want)
		}
	}
	t.Logf("worst relative error %.3g", worst)
}

// sprinkled returns n small integers as logits (many ties), about one in
// oneIn of them replaced by one of specials.
func sprinkled(r *rand.Rand, n, oneIn int, specials []float32) []float32 {
	l := make([]float32, n)
	for i := range l {
		l[i] = float32(r.IntN(7))
		if r.IntN(oneIn) == 0 {
			l[i] = specials[r.IntN(len(specials))]
		}
	}
	return l
}

// TestArgmax: argmax matches the plain loop on logits without NaN,
// infinities included (a penalty can overflow a logit to +Inf).
func TestArgmax(t *testing.T) {
	r := rand.New(rand.NewPCG(8, 8))
	specials := []float32{inf, ninf, math.MaxFloat32, 3, 3}
	for n := 1; n <= 40; n++ {
		for trial := range 200 {
			l := sprinkled(r, n, 6, specials)
			if got, want := argmax(l), stagetest.Argmax(l); got != want {
				t.Fatalf("n=%d trial %d: argmax = %d, want %d, logits %v", n, trial, got, want, l)
			}
		}
	}
}

// TestWeighParts: a large vocabulary's weights are each expNonPositive's,
// their sum is the parts' sums in order whatever the cores, and draws
// follow the weights.
func TestWeighParts(t *testing.T) {
	const n = weighInParts + 12345
	r := rand.New(rand.NewPCG(5, 9))
	l := make([]float32, n)
	for i := range l {
		l[i] = float32(r.NormFloat64() * 3)
	}
	l[77] = float32(math.Inf(-1))
	fresh := func() []cand {
		cs := make([]cand, n)
		for i, x := range l {
			cs[i] = cand{id: int32(i), logit: x}
		}
		return cs
	}
	const maxLogit, invT = 20.0, 1 / 0.7
	var want float64
	var partSums [parts]float64
	for p := range parts {
		for i := p * n / parts; i < (p+1)*n/parts; i++ {
			partSums[p] += expNonPositive((float64(l[i]) - maxLogit) * invT)
		}
	}
	for _, s := range partSums {
		want += s
	}
	for _, procs := range []int{1, 2, 8} {
		prev := runtime.GOMAXPROCS(procs)
		cs := fresh()
		got := weighParts(cs, maxLogit, invT)
		runtime.GOMAXPROCS(prev)
		if got != want {
			t.Fatalf("GOMAXPROCS %d: sum %v, want %v", procs, got, want)
		}
		for i, c := range cs {
			if w := expNonPositive((float64(l[i]) - maxLogit) * invT); c.w != w || c.id != int32(i) {
				t.Fatalf("GOMAXPROCS %d: candidate %d is %+v, want id %d weight %v", procs, i, c, i, w)
			}
		}
	}

	// Two likely tokens, 1:3, in a vocabulary of unlikely ones.
	for i := range l {
		l[i] = -40
	}
	l[7], l[n-3] = 0, float32(math.Log(3))
	s := New(params(nil))
	count := map[int32]int{}
	const draws = 1000
	history := make([]int32, 0, draws)
	for range draws {
		count[s.Sample(l, history)]++
		history = append(history, 1) // a new position: a new random number
	}
	if count[7]+count[n-3] != draws {
		t.Fatalf("draws %v, want only tokens 7 and %d", count, n-3)
	}
	if frac := float64(count[n-3]) / draws; math.Abs(frac-0.75) > 0.05 {
		t.Errorf("token %d drawn %.3f of the time, want 0.75", n-3, frac)
	}
}

// TestWholeVocabularyPath: sampling at a temperature with nothing to change
// the logits takes one pass over them (wholeVocabulary); it draws exactly
// the tokens of the general path, which a repeat penalty on a token whose
// logit is -Inf (so that no value changes) forces.
func TestWholeVocabularyPath(t *testing.T) {
	r := rand.New(rand.NewPCG(6, 6))
	specials := []float32{nan, inf, ninf, math.MaxFloat32, 3, 3}
	for _, fn := range []func(*Params){
		func(p *Params) { p.Temperature = 0.8 },
		func(p *Params) { p.Temperature, p.TopP = 1, 0.9 },
		func(p *Params) { p.Temperature, p.MinP = 1.3, 0.05 },
	} {
		for trial := range 100 {
			n := 1 + r.IntN(3000)
			l := make([]float32, n)
			for i := range l {
				l[i] = float32(r.NormFloat64() * 4)
				if r.IntN(50) == 0 {
					l[i] = specials[r.IntN(len(specials))]
				}
			}
			l[0] = ninf
			fast, general := New(params(fn)), New(params(func(p *Params) { fn(p); p.RepeatPenalty = 1.5 }))
			history := []int32{0}
			for step := range 5 {
				if got, want := fast.Sample(l, history), general.Sample(l, history); got != want {
					t.Fatalf("trial %d step %d (n=%d): one pass drew %d, the general path %d", trial, step, n, got, want)
				}
				history = append(history, 0)
			}
		}
	}
}
