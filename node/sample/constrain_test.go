package sample

import (
	"encoding/json"
	"errors"
	"math/rand/v2"
	"strings"
	"testing"
)

// toyVocab is a vocabulary of JSON pieces, a few that never fit, a control
// token and an end token.
var toyPieces = []string{"{", "}", `"a`, `"`, `":`, ":", "1", "2.5", ",", " ", "[", "]", "x", "true", `{"b":`, "<s>", "</s>", "\n"}

func toyVocab(t *testing.T) *Vocab {
	t.Helper()
	v, err := NewVocab(len(toyPieces),
		func(id int32) (string, error) { return toyPieces[id], nil },
		func(id int32) bool { return toyPieces[id] == "<s>" },
		func(id int32) bool { return toyPieces[id] == "</s>" })
	if err != nil {
		t.Fatal(err)
	}
	return v
}

// TestConstrainedSampling: whatever the logits, a constrained sampler
// writes a prefix of a JSON object at every step, and ends (samples the
// end token) only on a complete one.
func TestConstrainedSampling(t *testing.T) {
	v := toyVocab(t)
	eos := int32(len(toyPieces) - 2)
	completed := 0
	for seed := range uint64(200) {
		rng := rand.New(rand.NewPCG(seed, 9))
		p := DefaultParams()
		p.Seed = new(int64(seed))
		if seed%4 == 0 {
			p.Temperature = 0
		}
		s := New(p)
		c, err := NewJSONConstraint(v, nil, nil)
		if err != nil {
			t.Fatal(err)
		}
		s.Constrain(c)
		var text strings.Builder
		var history []int32
		ended := false
		for range 200 {
			logits := make([]float32, len(toyPieces))
			for i := range logits {
				logits[i] = float32(rng.NormFloat64() * 3)
			}
			logits[12] += 5 // "x" is the model's favourite and never fits
			tok := s.Sample(logits, history)
			history = append(history, tok)
			if tok == eos {
				ended = true
				break
			}
			if toyPieces[tok] == "<s>" {
				t.Fatalf("seed %d: sampled the control token", seed)
			}
			text.WriteString(toyPieces[tok])
			if j := NewJSON(); !j.Feed([]byte(text.String())) {
				t.Fatalf("seed %d: %q is no JSON object's prefix", seed, text.String())
			}
		}
		if ended {
			if !json.Valid([]byte(text.String())) {
				t.Fatalf("seed %d: ended on %q", seed, text.String())
			}
			completed++
		}
		// A replay resumes the constraint after what was generated.
		if _, err := NewJSONConstraint(v, nil, history[:len(history)-1]); err != nil && !ended {
			t.Fatalf("seed %d: resuming after %q: %v", seed, text.String(), err)
		}
	}
	if completed < 20 {
		t.Errorf("only %d of 200 runs completed an object", completed)
	}
}

func TestJSONConstraintResume(t *testing.T) {
	v := toyVocab(t)
	ids := func(pieces ...string) []int32 {
		var out []int32
		for _, p := range pieces {
			for i, q := range toyPieces {
				if q == p {
					out = append(out, int32(i))
				}
			}
		}
		return out
	}
	tests := []struct {
		name      string
		generated []int32
		ok        bool
		next      string // a token that must be allowed next
	}{
		{"nothing yet", nil, true, "{"},
		{"inside an object", ids("{", `"a`, `":`), true, "1"},
		{"complete", ids("{", "}"), true, "</s>"},
		{"broken", ids("{", "x"), false, ""},
	}
	for _, tt := range tests {
		c, err := NewJSONConstraint(v, nil, tt.generated)
		if (err == nil) != tt.ok {
			t.Errorf("%s: %v, want ok %v", tt.name, err, tt.ok)
			continue
		}
		if err != nil {
			continue
		}
		if next := ids(tt.next)[0]; !c.allowed(next) {
			t.Errorf("%s: %q not allowed next", tt.name, tt.next)
		}
	}
}

func TestNewVocabError(t *testing.T) {
	boom := errors.New("boom")
	_, err := NewVocab(3, func(id int32) (string, error) {
		if id == 2 {
			return "", boom
		}
		return "a", nil
	}, func(int32) bool { return false }, func(int32) bool { return false })
	if !errors.Is(err, boom) || !strings.Contains(err.Error(), "token 2") {
		t.Fatalf("got %v", err)
	}
}
