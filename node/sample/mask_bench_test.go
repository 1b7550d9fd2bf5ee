package sample

import (
	"math/rand/v2"
	"strings"
	"testing"
)

// benchVocab is a 32000-token vocabulary of word pieces and punctuation,
// shaped like a real BPE vocabulary's.
func benchVocab(b *testing.B) *Vocab {
	r := rand.New(rand.NewPCG(7, 7))
	const letters = "abcdefghijklmnopqrstuvwxyz"
	pieces := make([]string, 32000)
	for i := range pieces {
		switch {
		case i < 256:
			pieces[i] = string(rune(i)) // byte tokens
		case i%50 == 0:
			pieces[i] = []string{`":`, `",`, `{"`, `"}`, `},`, ` "`, "\n", "  ", `\"`, `[`, `]`, `1`, `0.`}[r.IntN(13)]
		default:
			var w strings.Builder
			if r.IntN(2) == 0 {
				w.WriteByte(' ')
			}
			for range 2 + r.IntN(7) {
				w.WriteByte(letters[r.IntN(len(letters))])
			}
			pieces[i] = w.String()
		}
	}
	v, err := NewVocab(len(pieces), func(id int32) (string, error) { return pieces[id], nil },
		func(int32) bool { return false }, func(id int32) bool { return id == 2 })
	if err != nil {
		b.Fatal(err)
	}
	return v
}

// BenchmarkMask times finding the tokens that may come next, over a
// 32000-token vocabulary, inside a string (nearly every token fits) and
// between members (few do), without and with a schema.
func BenchmarkMask(b *testing.B) {
	v := benchVocab(b)
	s, err := ParseSchema([]byte(personSchema))
	if err != nil {
		b.Fatal(err)
	}
	for _, bc := range []struct {
		name   string
		schema *Schema
		text   string
	}{
		{"object/in-string", nil, `{"name":"An`},
		{"object/between", nil, `{"name":"Ann"`},
		{"schema/in-string", s, `{"name":"An`},
		{"schema/between", s, `{"name":"Ann"`},
	} {
		b.Run(bc.name, func(b *testing.B) {
			c, err := NewJSONConstraint(v, bc.schema, nil)
			if err != nil {
				b.Fatal(err)
			}
			if !c.j.Feed([]byte(bc.text)) {
				b.Fatalf("%q refused", bc.text)
			}
			for b.Loop() {
				c.allowedSet()
			}
		})
	}
}
