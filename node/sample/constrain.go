package sample

import (
	"fmt"
	"math"
)

// Vocab is a vocabulary's token texts, what constrained sampling needs to
// know which tokens may come next.
type Vocab struct {
	pieces  [][]byte // nil for tokens that never appear in constrained text
	eog     []int32
	byFirst [256][]int32 // tokens with text, by their first byte
}

// NewVocab reads the texts of tokens [0, n) with piece. Tokens for which
// special is true (control tokens such as BOS, whose text is markup) and
// tokens of no text never appear in constrained output; eog marks those
// that end generation, the only ones allowed once the output is complete.
func NewVocab(n int, piece func(id int32) (string, error), special, eog func(id int32) bool) (*Vocab, error) {
	v := &Vocab{pieces: make([][]byte, n)}
	for id := range int32(n) {
		if eog(id) {
			v.eog = append(v.eog, id)
			continue
		}
		if special(id) {
			continue
		}
		p, err := piece(id)
		if err != nil {
			return nil, fmt.Errorf("reading the text of token %d: %w", id, err)
		}
		if p != "" {
			v.pieces[id] = []byte(p)
			v.byFirst[p[0]] = append(v.byFirst[p[0]], id)
		}
	}
	return v, nil
}

// Size is the number of tokens.
func (v *Vocab) Size() int { return len(v.pieces) }

// JSONConstraint keeps a sequence's output one JSON object (one that a
// schema allows, when it has one): tokens that would break it are masked
// before sampling, and once the object is complete only an
// end-of-generation token may follow.
type JSONConstraint struct {
	v       *Vocab
	j       recognizer
	scratch []bool // allowedSet's
}

// recognizer reads a text byte by byte: JSON, or SchemaJSON.
type recognizer interface {
	Feed(b []byte) bool
	Try(b []byte) bool
	Done() bool
}

// NewJSONConstraint starts a constraint to any JSON object (schema nil) or
// to those schema allows, after the tokens already generated (a replayed
// sequence's), which must be a valid prefix.
func NewJSONConstraint(v *Vocab, schema *Schema, generated []int32) (*JSONConstraint, error) {
	c := &JSONConstraint{v: v, j: NewJSON()}
	if schema != nil {
		c.j = NewSchemaJSON(schema)
	}
	for i, tok := range generated {
		if !c.allowed(tok) {
			return nil, fmt.Errorf("generated token %d (id %d) breaks the JSON output", i, tok)
		}
		c.accept(tok)
	}
	return c, nil
}

// allowed says whether tok may come next.
func (c *JSONConstraint) allowed(tok int32) bool {
	if tok < 0 || int(tok) >= len(c.v.pieces) {
		return false
	}
	if c.j.Done() {
		return c.isEOG(tok)
	}
	p := c.v.pieces[tok]
	return p != nil && c.j.Try(p)
}

func (c *JSONConstraint) isEOG(tok int32) bool {
	for _, e := range c.v.eog {
		if e == tok {
			return true
		}
	}
	return false
}

// mask sets the logits of tokens that may not come next to -Inf, and says
// whether any token is left. Tokens are tried by their first byte: where
// that byte is refused (most of them, between JSON tokens), none of its
// tokens is tried.
func (c *JSONConstraint) mask(l []float32) bool {
	ninf := float32(math.Inf(-1))
	allowed := c.allowedSet()
	left := false
	for i := range l {
		if l[i] == ninf {
			continue
		}
		if i >= len(allowed) || !allowed[i] {
			l[i] = ninf
			continue
		}
		left = true
	}
	return left
}

// allowedSet marks the tokens that may come next.
func (c *JSONConstraint) allowedSet() []bool {
	if cap(c.scratch) < len(c.v.pieces) {
		c.scratch = make([]bool, len(c.v.pieces))
	}
	allowed := c.scratch[:len(c.v.pieces)]
	clear(allowed)
	if c.j.Done() {
		for _, e := range c.v.eog {
			allowed[e] = true
		}
		return allowed
	}
	for first, ids := range c.v.byFirst {
		if len(ids) == 0 || !c.j.Try([]byte{byte(first)}) {
			continue
		}
		for _, id := range ids {
			p := c.v.pieces[id]
			allowed[id] = len(p) == 1 || c.j.Try(p)
		}
	}
	return allowed
}

// fallback is the token to end with when no token is allowed: the first
// end-of-generation token, or 0.
func (c *JSONConstraint) fallback() int32 {
	if len(c.v.eog) > 0 {
		return c.v.eog[0]
	}
	return 0
}

// accept moves past a sampled token.
func (c *JSONConstraint) accept(tok int32) {
	if c.j.Done() || tok < 0 || int(tok) >= len(c.v.pieces) || c.v.pieces[tok] == nil {
		return
	}
	c.j.Feed(c.v.pieces[tok])
}
