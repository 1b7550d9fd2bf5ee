package sample

import (
	"bytes"
	"encoding/json"
	"math/rand/v2"
	"strings"
	"testing"
)

func TestJSONRecognizer(t *testing.T) {
	tests := []struct {
		text   string
		prefix bool // every byte accepted
		done   bool // a complete object
	}{
		{`{}`, true, true},
		{`{ "a" : 1 }`, true, true},
		{` {}`, false, false},      // the object comes first
		{`{"a":1} `, false, false}, // nothing after the object, not even a space
		{`{"a":[1,-2.5e+3,0,true,false,null,"x\"\\\u00e9"],"b":{"c":{}}}`, true, true},
		{`{"k":"é ü 你好"}`, true, true},
		{`{"a":1`, true, false},
		{`{"a":"unterminated`, true, false},
		{`{"a":-`, true, false},
		{`{"a":[`, true, false},
		{`[1]`, false, false},        // the top level must be an object
		{`"s"`, false, false},        // likewise
		{`{"a":1,}`, false, false},   // trailing comma
		{`{"a":[1,]}`, false, false}, // trailing comma
		{`{"a":01}`, false, false},   // leading zero
		{`{"a":1.}`, false, false},
		{`{"a":.5}`, false, false},
		{`{"a":1e}`, false, false},
		{`{"a":tru}`, false, false},
		{`{"a":"\x"}`, false, false},
		{`{"a":"\u12g4"}`, false, false},
		{"{\"a\":\"\n\"}", false, false}, // raw control character in a string
		{`{a:1}`, false, false},          // unquoted key
		{`{"a" 1}`, false, false},
		{`{"a":1}}`, false, false},
		{`{"a":1} x`, false, false}, // nothing after the object
		{`{"a":[}`, false, false},
		{"{\n" + strings.Repeat(" ", maxSpaces) + "}", true, true},
		{"{\r\n\t\"a\":1\n}", true, true},
		{"{" + strings.Repeat(" ", maxSpaces+1) + "}", false, false},
		{"{\n\n}", false, false},                                 // blank lines
		{`{"a":"` + strings.Repeat(" ", 100) + `"}`, true, true}, // spaces in strings are text
	}
	for _, tt := range tests {
		j := NewJSON()
		ok := j.Feed([]byte(tt.text))
		if ok != tt.prefix || ok && j.Done() != tt.done {
			t.Errorf("%q: accepted %v done %v, want %v %v", tt.text, ok, ok && j.Done(), tt.prefix, tt.done)
		}
	}
}

// Try never changes the recognizer, also when the bytes push and pop.
func TestJSONTry(t *testing.T) {
	j := NewJSON()
	if !j.Feed([]byte(`{"a":[[`)) {
		t.Fatal("prefix refused")
	}
	for _, b := range []string{`]]}`, `{"b":[]}]]}`, `1,2]`, `x`} {
		j.Try([]byte(b))
	}
	if !j.Feed([]byte(`1],[]]}`)) || !j.Done() {
		t.Fatal("Try changed the state")
	}
}

// randomJSON builds a random value of depth at most d, with random
// whitespace between tokens, through encoding/json for the scalars.
func randomJSON(r *rand.Rand, d int, object bool) string {
	ws := func() string { return []string{"", " ", "\n", "\n  ", "\t", "  "}[r.IntN(6)] }
	kind := r.IntN(7)
	if object {
		kind = 0
	}
	if d == 0 && kind < 2 {
		kind = 2 + r.IntN(5)
	}
	switch kind {
	case 0:
		var parts []string
		for range r.IntN(4) {
			k, _ := json.Marshal(string(rune('a' + r.IntN(26))))
			parts = append(parts, ws()+string(k)+ws()+":"+ws()+randomJSON(r, d-1, false)+ws())
		}
		if len(parts) == 0 {
			return "{" + ws() + "}"
		}
		return "{" + strings.Join(parts, ",") + "}"
	case 1:
		var parts []string
		for range r.IntN(4) {
			parts = append(parts, ws()+randomJSON(r, d-1, false)+ws())
		}
		if len(parts) == 0 {
			return "[" + ws() + "]"
		}
		return "[" + strings.Join(parts, ",") + "]"
	case 2:
		b, _ := json.Marshal(r.NormFloat64() * 1e3)
		return string(b)
	case 3:
		return []string{"true", "false", "null"}[r.IntN(3)]
	case 4:
		return []string{"0", "-0", "12", "-3.25", "1e5", "2E-3", "7.5e+2"}[r.IntN(7)]
	default:
		runes := []rune{'a', ' ', '"', '\\', '/', '\n', 'é', '你', 0x01}
		var s []rune
		for range r.IntN(6) {
			s = append(s, runes[r.IntN(len(runes))])
		}
		b, _ := json.Marshal(string(s))
		return string(b)
	}
}

// TestJSONAgreesWithEncodingJSON: random valid objects are accepted byte by
// byte and complete; random corruptions of them that the recognizer
// accepts whole are valid JSON objects by encoding/json.
func TestJSONAgreesWithEncodingJSON(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 4))
	for range 2000 {
		text := randomJSON(r, 4, true)
		j := NewJSON()
		for i := range len(text) {
			if !j.Feed([]byte{text[i]}) {
				t.Fatalf("%q refused at byte %d", text, i)
			}
		}
		if !j.Done() {
			t.Fatalf("%q not complete", text)
		}
		// Corrupt one byte: if the recognizer still takes it all, so must
		// encoding/json.
		b := []byte(text)
		b[r.IntN(len(b))] = "{}[]\",:0-e.tn \\x"[r.IntN(16)]
		j = NewJSON()
		if j.Feed(b) && j.Done() && !json.Valid(b) {
			t.Fatalf("%q accepted, but encoding/json refuses it", b)
		}
	}
}

// FuzzJSON checks the recognizer against encoding/json both ways: what it
// takes whole as a complete object is one, and a valid object (ending at
// its brace, no long runs of whitespace) is taken whole.
func FuzzJSON(f *testing.F) {
	for _, s := range []string{`{}`, `{"a":[1,2,{"b":null}]}`, `{"x":"\u00e9\n"}`, `{"n":-0.5e-7}`, `{"a" : "b"}`} {
		f.Add([]byte(s))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		j := NewJSON()
		ok := j.Feed(b) && j.Done()
		object := json.Valid(b) && len(b) > 0 && b[0] == '{'
		if ok && !object {
			t.Fatalf("%q accepted as an object; encoding/json disagrees", b)
		}
		long := bytes.Contains(b, bytes.Repeat([]byte{' '}, maxSpaces+1)) || bytes.ContainsAny(b, "\t\r\n") || bytes.Contains(b, []byte("\n\n"))
		if object && bytes.HasSuffix(b, []byte("}")) && !long && !ok {
			t.Fatalf("%q is an object, but the recognizer refused it", b)
		}
	})
}
