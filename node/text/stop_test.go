package text

import (
	"errors"
	"math/rand/v2"
	"strings"
	"testing"
)

func TestStopMatcher(t *testing.T) {
	tests := []struct {
		name    string
		stops   []string
		pieces  []string
		emits   []string // per Push
		stopped bool
		flush   string
	}{
		{
			name: "stop inside one piece", stops: []string{"END"},
			pieces: []string{"abcENDdef"}, emits: []string{"abc"}, stopped: true,
		},
		{
			name: "stop spanning many pushes", stops: []string{"<|end|>"},
			pieces: []string{"hello <", "|", "en", "d|", ">more", "ignored"},
			emits:  []string{"hello ", "", "", "", "", ""}, stopped: true,
		},
		{
			name: "held prefix that does not match", stops: []string{"STOP"},
			pieces: []string{"a ST", "AB", " S"}, emits: []string{"a ", "STAB", " "}, flush: "S",
		},
		{
			name: "prefix of a prefix released step by step", stops: []string{"aab"},
			pieces: []string{"a", "a", "a", "c"}, emits: []string{"", "", "a", "aac"},
		},
		{
			name: "stop at the very start", stops: []string{"###"},
			pieces: []string{"###", "x"}, emits: []string{"", ""}, stopped: true,
		},
		{
			name: "overlapping stops, first completed wins", stops: []string{"ab", "b c"},
			pieces: []string{"xa", "b c"}, emits: []string{"x", ""}, stopped: true,
		},
		{
			name: "overlapping stops, second one matches", stops: []string{"ab", "b c"},
			pieces: []string{"x", "b", " c"}, emits: []string{"x", "", ""}, stopped: true,
		},
		{
			name: "shorter stop inside a longer one ends first", stops: []string{"abcd", "bc"},
			pieces: []string{"xabcd"}, emits: []string{"xa"}, stopped: true,
		},
		{
			name: "stops ending together: the longer one", stops: []string{"bc", "abc"},
			pieces: []string{"xab", "c"}, emits: []string{"x", ""}, stopped: true,
		},
		{
			name: "multi-byte stop across pieces", stops: []string{"終わり"},
			pieces: []string{"これで終", "わ", "り。"}, emits: []string{"これで", "", ""}, stopped: true,
		},
		{
			name: "multi-byte stop split inside a character", stops: []string{"👋"},
			pieces: []string{"hi \xf0\x9f", "\x91\x8b bye"}, emits: []string{"hi ", ""}, stopped: true,
		},
		{
			name: "multi-byte prefix that does not match", stops: []string{"é!"},
			pieces: []string{"caf", "é", "s"}, emits: []string{"caf", "", "és"},
		},
		{
			name: "no stops pass through", stops: nil,
			pieces: []string{"a", "b"}, emits: []string{"a", "b"},
		},
		{
			name: "empty stops ignored", stops: []string{"", "x", ""},
			pieces: []string{"abc", "dxe"}, emits: []string{"abc", "d"}, stopped: true,
		},
		{
			name: "stop after a flushable tail", stops: []string{"\n\n"},
			pieces: []string{"line\n"}, emits: []string{"line"}, flush: "\n",
		},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			m, err := NewStopMatcher(tt.stops)
			if err != nil {
				t.Fatalf("NewStopMatcher: %v", err)
			}
			stopped := false
			for i, p := range tt.pieces {
				emit, st := m.Push(p)
				if emit != tt.emits[i] {
					t.Errorf("Push(%q) emitted %q, want %q", p, emit, tt.emits[i])
				}
				if stopped && !st {
					t.Errorf("Push(%q) after stopping reports not stopped", p)
				}
				stopped = st
			}
			if stopped != tt.stopped || m.Stopped() != tt.stopped {
				t.Errorf("stopped = %v (Stopped() %v), want %v", stopped, m.Stopped(), tt.stopped)
			}
			if got := m.Flush(); got != tt.flush {
				t.Errorf("Flush() = %q, want %q", got, tt.flush)
			}
		})
	}
}

func TestNewStopMatcherLimits(t *testing.T) {
	many := func(n int) []string {
		s := make([]string, n)
		for i := range s {
			s[i] = strings.Repeat("x", i+1)
		}
		return s
	}
	tests := []struct {
		name  string
		stops []string
		want  string // error text, "" for success
	}{
		{"sixteen", many(16), ""},
		{"seventeen", many(17), "17 stop sequences, over the limit of 16"},
		{"sixteen plus empties", append(many(16), "", ""), ""},
		{"longest allowed", []string{strings.Repeat("é", 128)}, ""},
		{"too long", []string{"ok", strings.Repeat("a", 257)}, "stop sequence 1 is 257 bytes"},
		{"invalid UTF-8", []string{"a\xff"}, "stop sequence 0 is not valid UTF-8"},
		{"nil", nil, ""},
	}
	for _, tt := range tests {
		_, err := NewStopMatcher(tt.stops)
		switch {
		case tt.want == "" && err != nil:
			t.Errorf("%s: unexpected error %v", tt.name, err)
		case tt.want != "" && err == nil:
			t.Errorf("%s: no error", tt.name)
		case tt.want != "" && (!strings.Contains(err.Error(), tt.want) || !errors.Is(err, ErrInvalidStop)):
			t.Errorf("%s: error %v, want %q wrapping ErrInvalidStop", tt.name, err, tt.want)
		}
	}
}

// stopReference finds the first position where some stop string is complete
// and returns the text before the longest stop ending there.
func stopReference(text string, stops []string) (string, bool) {
	for end := 1; end <= len(text); end++ {
		best := ""
		for _, s := range stops {
			if s != "" && strings.HasSuffix(text[:end], s) && len(s) > len(best) {
				best = s
			}
		}
		if best != "" {
			return text[:end-len(best)], true
		}
	}
	return text, false
}

// TestStopMatcherSplitInvariance compares random texts, split at random,
// with a brute-force reference.
func TestStopMatcherSplitInvariance(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	word := func(n int) string {
		b := make([]byte, n)
		for i := range b {
			b[i] = "abc"[r.IntN(3)]
		}
		return string(b)
	}
	for range 3000 {
		stops := make([]string, 1+r.IntN(3))
		for i := range stops {
			stops[i] = word(1 + r.IntN(4))
		}
		text := word(r.IntN(30))
		want, wantStopped := stopReference(text, stops)

		m, err := NewStopMatcher(stops)
		if err != nil {
			t.Fatal(err)
		}
		var out strings.Builder
		stopped := false
		for rest := text; rest != "" && !stopped; {
			n := 1 + r.IntN(len(rest))
			emit, st := m.Push(rest[:n])
			out.WriteString(emit)
			stopped = st
			rest = rest[n:]
			if len(m.held) >= m.maxLen {
				t.Fatalf("holding %q, longer than any proper prefix", m.held)
			}
		}
		out.WriteString(m.Flush())
		if out.String() != want || stopped != wantStopped {
			t.Fatalf("text %q stops %q: got %q stopped=%v, want %q stopped=%v", text, stops, out.String(), stopped, want, wantStopped)
		}
	}
}

func BenchmarkStopMatcherPush(b *testing.B) {
	m, err := NewStopMatcher([]string{"<|im_end|>", "\n\nUser:", "###"})
	if err != nil {
		b.Fatal(err)
	}
	pieces := strings.Fields("The quick brown fox jumps over the lazy dog and keeps running through the field")
	for b.Loop() {
		for _, p := range pieces {
			m.Push(p + " ")
		}
	}
}
