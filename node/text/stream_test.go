package text

import (
	"math/rand/v2"
	"strings"
	"testing"
	"unicode/utf8"
)

var streamSamples = []string{
	"plain ascii",
	"é",                   // 2 bytes
	"€",                   // 3 bytes
	"😀",                   // 4 bytes
	"👨‍👩‍👧",               // emoji joined by ZWJ (U+200D, 3 bytes each)
	"naïve café – 東京 🇯🇵!", // mixed, with a flag (two regional indicators)
	"\ufffd literal replacement character",
	"x\u0301y\U0010ffff",
}

// collect pushes pieces and flushes, checking every output is valid UTF-8.
func collect(t *testing.T, pieces ...string) string {
	t.Helper()
	var s Stream
	var out strings.Builder
	for _, p := range pieces {
		o := s.Push(p)
		if !utf8.ValidString(o) {
			t.Fatalf("Push(%q) returned invalid UTF-8 %q", p, o)
		}
		if s.n > 3 {
			t.Fatalf("holding %d bytes", s.n)
		}
		out.WriteString(o)
	}
	f := s.Flush()
	if !utf8.ValidString(f) {
		t.Fatalf("Flush returned invalid UTF-8 %q", f)
	}
	out.WriteString(f)
	return out.String()
}

func TestStreamEverySplit(t *testing.T) {
	for _, in := range streamSamples {
		for i := 0; i <= len(in); i++ {
			for j := i; j <= len(in); j++ {
				if got := collect(t, in[:i], in[i:j], in[j:]); got != in {
					t.Fatalf("split %q at %d,%d: got %q", in, i, j, got)
				}
			}
		}
	}
}

func TestStreamByteAtATime(t *testing.T) {
	for _, in := range streamSamples {
		var s Stream
		var out strings.Builder
		for i := 0; i < len(in); i++ {
			o := s.Push(in[i : i+1])
			out.WriteString(o)
			// Everything up to the last complete character is out already.
			if done := out.Len(); !utf8.ValidString(in[:done]) || i+1-done > 3 {
				t.Fatalf("%q after byte %d: emitted %q", in, i, out.String())
			}
		}
		if f := s.Flush(); f != "" {
			t.Errorf("%q: Flush returned %q after a complete input", in, f)
		}
		if out.String() != in {
			t.Errorf("got %q, want %q", out.String(), in)
		}
	}
}

func TestStreamPushResults(t *testing.T) {
	tests := []struct {
		name   string
		pieces []string
		want   []string // per Push
		flush  string
	}{
		{"valid piece passes through", []string{"héllo"}, []string{"héllo"}, ""},
		{"euro across two pieces", []string{"a\xe2\x82", "\xacb"}, []string{"a", "€b"}, ""},
		{"emoji one byte at a time", []string{"\xf0", "\x9f", "\x98", "\x80"}, []string{"", "", "", "😀"}, ""},
		{"invalid byte replaced at once", []string{"a\xffb"}, []string{"a\ufffdb"}, ""},
		{"truncated sequence then ascii", []string{"\xe2\x82", "A"}, []string{"", "\ufffdA"}, ""},
		{"incomplete tail at the end", []string{"ok\xf0\x9f\x98"}, []string{"ok"}, "\ufffd"},
		{"surrogate is three errors", []string{"\xed\xa0\x80"}, []string{"\ufffd\ufffd\ufffd"}, ""},
		{"overlong", []string{"\xc0\xaf", "\xe0\x80\xaf"}, []string{"\ufffd\ufffd", "\ufffd\ufffd\ufffd"}, ""},
		{"above U+10FFFF", []string{"\xf4\x90\x80\x80"}, []string{"\ufffd\ufffd\ufffd\ufffd"}, ""},
		{"stray continuation after a rune", []string{"\xf0\x9f\x98\x80\x80"}, []string{"😀\ufffd"}, ""},
		{"maximal subparts", []string{"\xe1\x80\xe2\xf0\x91\x92\xf1\xbfA"}, []string{"\ufffd\ufffd\ufffd\ufffdA"}, ""},
		{"invalid lead byte", []string{"\xf5", "x"}, []string{"\ufffd", "x"}, ""},
		{"held bytes then invalid continuation", []string{"\xe2", "\x82", "\xff"}, []string{"", "", "\ufffd\ufffd"}, ""},
		{"empty pushes", []string{"", "\xc3", "", "\xa9"}, []string{"", "", "", "é"}, ""},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			var s Stream
			for i, p := range tt.pieces {
				if got := s.Push(p); got != tt.want[i] {
					t.Errorf("Push(%q) = %q, want %q", p, got, tt.want[i])
				}
			}
			if got := s.Flush(); got != tt.flush {
				t.Errorf("Flush() = %q, want %q", got, tt.flush)
			}
			if got := s.Flush(); got != "" {
				t.Errorf("second Flush() = %q", got)
			}
		})
	}
}

// TestStreamSplitInvariance checks that arbitrary bytes give the same text
// however they are split into pieces.
func TestStreamSplitInvariance(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	alphabet := []byte("a\x80\xbf\xc2\xc3\xe0\xe2\xed\xef\xf0\xf4\xf5\xff")
	for range 2000 {
		b := make([]byte, r.IntN(24))
		for i := range b {
			b[i] = alphabet[r.IntN(len(alphabet))]
		}
		whole := collect(t, string(b))
		var pieces []string
		for rest := string(b); rest != ""; {
			n := 1 + r.IntN(len(rest))
			pieces = append(pieces, rest[:n])
			rest = rest[n:]
		}
		if got := collect(t, pieces...); got != whole {
			t.Fatalf("%q split as %q: got %q, whole gives %q", b, pieces, got, whole)
		}
		if utf8.Valid(b) && whole != string(b) {
			t.Fatalf("valid %q came out as %q", b, whole)
		}
	}
}

func FuzzStream(f *testing.F) {
	f.Add("héllo 😀", uint8(3))
	f.Add("\xe2\x82\xff\xf0\x9f", uint8(1))
	f.Fuzz(func(t *testing.T, in string, step uint8) {
		whole := collect(t, in)
		n := int(step%8) + 1
		var pieces []string
		for i := 0; i < len(in); i += n {
			pieces = append(pieces, in[i:min(i+n, len(in))])
		}
		if got := collect(t, pieces...); got != whole {
			t.Fatalf("pieces of %d give %q, whole gives %q", n, got, whole)
		}
		if utf8.ValidString(in) && whole != in {
			t.Fatalf("valid input changed: %q", whole)
		}
	})
}

func BenchmarkStreamPush(b *testing.B) {
	pieces := []string{"Hello", ",", " wor", "ld", " \xe6\x9d", "\xb1\xe4\xba\xac", " 😀"}
	var s Stream
	for b.Loop() {
		for _, p := range pieces {
			s.Push(p)
		}
	}
}
