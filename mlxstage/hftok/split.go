package hftok

import (
	"fmt"
	"regexp"
	"slices"
	"strings"
	"unicode"
	"unicode/utf8"
)

// Pre-tokenizer regular expressions are written for Oniguruma (what Hugging
// Face's tokenizers library runs): they use a negative lookahead, \s+(?!\S),
// that Go's RE2 engine does not have, and \s means Unicode White_Space where
// RE2's \s is ASCII only. splitter runs such a pattern with Go's regexp by
// taking it apart at its top-level alternatives and trying them in order at
// each position, which is exactly how a backtracking engine runs an
// alternation; the lookahead alternative is matched by hand.

// wsClass is Unicode White_Space, the meaning of \s in Oniguruma, written for
// use inside a character class.
const wsClass = `\t\n\v\f\r \x{85}\x{A0}\x{1680}\x{2000}-\x{200A}\x{2028}\x{2029}\x{202F}\x{205F}\x{3000}`

// isSpace is White_Space; unicode.IsSpace is the same set.
func isSpace(r rune) bool { return unicode.IsSpace(r) }

// alternative is one top-level branch of a pattern.
type alternative struct {
	re        *regexp.Regexp // anchored at the start of the remaining text
	spaceRun  bool           // the \s+(?!\S) branch, matched by hand
	canBeNull bool
}

type splitter struct {
	alts   []alternative
	source string
}

// newSplitter compiles an Oniguruma-style pattern.
func newSplitter(pattern string) (*splitter, error) {
	s := &splitter{source: pattern}
	for _, alt := range topLevel(pattern) {
		if alt == `\s+(?!\S)` {
			s.alts = append(s.alts, alternative{spaceRun: true})
			continue
		}
		if strings.Contains(alt, "(?=") || strings.Contains(alt, "(?!") || strings.Contains(alt, "(?<") {
			return nil, fmt.Errorf("%w: lookaround in pre-tokenizer pattern %q", ErrUnsupported, alt)
		}
		translated, err := translateSpaces(alt)
		if err != nil {
			return nil, err
		}
		re, err := regexp.Compile(`^(?:` + translated + `)`)
		if err != nil {
			return nil, fmt.Errorf("%w: pre-tokenizer pattern %q: %w", ErrUnsupported, alt, err)
		}
		s.alts = append(s.alts, alternative{re: re, canBeNull: re.MatchString("")})
	}
	return s, nil
}

// topLevel splits a pattern at the | that are outside groups and classes.
func topLevel(p string) []string {
	var out []string
	depth, class, start := 0, false, 0
	for i := 0; i < len(p); i++ {
		switch c := p[i]; {
		case c == '\\':
			i++ // the escaped character is literal
		case class:
			if c == ']' {
				class = false
			}
		case c == '[':
			class = true
			if i+1 < len(p) && p[i+1] == '^' {
				i++
			}
			if i+1 < len(p) && p[i+1] == ']' {
				i++ // a leading ] is literal
			}
		case c == '(':
			depth++
		case c == ')':
			depth--
		case c == '|' && depth == 0:
			out = append(out, p[start:i])
			start = i + 1
		}
	}
	return append(out, p[start:])
}

// translateSpaces rewrites \s and \S to Unicode White_Space classes.
func translateSpaces(p string) (string, error) {
	var b strings.Builder
	class := false
	for i := 0; i < len(p); i++ {
		c := p[i]
		if c == '\\' && i+1 < len(p) {
			switch n := p[i+1]; {
			case n == 's' && class:
				b.WriteString(wsClass)
			case n == 's':
				b.WriteString("[" + wsClass + "]")
			case n == 'S' && class:
				return "", fmt.Errorf("%w: \\S inside a character class in %q", ErrUnsupported, p)
			case n == 'S':
				b.WriteString("[^" + wsClass + "]")
			default:
				b.WriteByte(c)
				b.WriteByte(n)
			}
			i++
			continue
		}
		switch {
		case c == '[' && !class:
			class = true
			b.WriteByte(c)
			if i+1 < len(p) && p[i+1] == '^' {
				b.WriteByte('^')
				i++
			}
			if i+1 < len(p) && p[i+1] == ']' {
				b.WriteByte(']')
				i++
			}
			continue
		case c == ']' && class:
			class = false
		}
		b.WriteByte(c)
	}
	return b.String(), nil
}

// match returns the length of the first alternative that matches at the
// start of s, or -1.
func (sp *splitter) match(s string) int {
	for _, a := range sp.alts {
		if a.spaceRun {
			if n := spaceRun(s); n > 0 {
				return n
			}
			continue
		}
		if loc := a.re.FindStringIndex(s); loc != nil && loc[1] > 0 {
			return loc[1]
		}
	}
	return -1
}

// spaceRun matches \s+(?!\S): a run of white space that is not followed by
// a non-space; before a non-space the run gives back its last character
// (which a following alternative then attaches to the word).
func spaceRun(s string) int {
	n, last := 0, 0
	for n < len(s) {
		r, size := utf8.DecodeRuneInString(s[n:])
		if !isSpace(r) {
			break
		}
		last = size
		n += size
	}
	switch {
	case n == 0:
		return -1
	case n == len(s):
		return n
	case n == last: // one space before a non-space: no match
		return -1
	}
	return n - last
}

// matches yields the [start, end) spans of the successive matches in s.
func (sp *splitter) matches(s string) [][2]int {
	var out [][2]int
	for pos := 0; pos < len(s); {
		if n := sp.match(s[pos:]); n > 0 {
			out = append(out, [2]int{pos, pos + n})
			pos += n
			continue
		}
		_, size := utf8.DecodeRuneInString(s[pos:])
		pos += size
	}
	return out
}

// split cuts s by the pattern with Hugging Face's split behaviors:
// "Isolated" keeps matches and the text between them as separate pieces,
// "Removed" drops the matches, "MergedWithPrevious" / "MergedWithNext"
// attach each match to the piece before / after it, "Contiguous" merges
// runs of adjacent matches. invert swaps the roles of matches and gaps.
func (sp *splitter) split(s, behavior string, invert bool) ([]string, error) {
	type span struct {
		a, b  int
		match bool
	}
	var spans []span
	at := 0
	for _, m := range sp.matches(s) {
		if m[0] > at {
			spans = append(spans, span{at, m[0], invert})
		}
		spans = append(spans, span{m[0], m[1], !invert})
		at = m[1]
	}
	if at < len(s) {
		spans = append(spans, span{at, len(s), invert})
	}
	var out []string
	switch behavior {
	case "Isolated":
		for _, sp := range spans {
			out = append(out, s[sp.a:sp.b])
		}
	case "Removed":
		for _, sp := range spans {
			if !sp.match {
				out = append(out, s[sp.a:sp.b])
			}
		}
	case "MergedWithPrevious":
		// A match joins the piece before it, unless that piece is itself
		// a match: "a-b--c" splits into "a-", "b-", "-", "c".
		for i, sp := range spans {
			if sp.match && i > 0 && !spans[i-1].match {
				out[len(out)-1] += s[sp.a:sp.b]
				continue
			}
			out = append(out, s[sp.a:sp.b])
		}
	case "MergedWithNext":
		// The mirror image: "a-b--c" splits into "a", "-b", "-", "-c".
		for i := len(spans) - 1; i >= 0; i-- {
			sp := spans[i]
			if sp.match && i+1 < len(spans) && !spans[i+1].match {
				out[len(out)-1] = s[sp.a:sp.b] + out[len(out)-1]
				continue
			}
			out = append(out, s[sp.a:sp.b])
		}
		slices.Reverse(out)
	case "Contiguous":
		for i, sp := range spans {
			if sp.match && i > 0 && spans[i-1].match {
				out[len(out)-1] += s[sp.a:sp.b]
				continue
			}
			out = append(out, s[sp.a:sp.b])
		}
	default:
		return nil, fmt.Errorf("%w: split behavior %q", ErrUnsupported, behavior)
	}
	return out, nil
}
