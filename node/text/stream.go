package text

import (
	"strings"
	"unicode/utf8"
)

// Stream turns the byte strings of decoded tokens into valid UTF-8. A token
// may end inside a multi-byte character (byte-fallback tokens like <0xE2>);
// Stream holds such a tail back until the next piece completes it, so a
// client never sees half a character. The zero value is ready to use; a
// Stream is not safe for concurrent use.
type Stream struct {
	pending [utf8.UTFMax - 1]byte // incomplete trailing sequence
	n       int
}

// Push adds a piece and returns the text that is now complete. Bytes that can
// never become valid UTF-8 are replaced with U+FFFD at once, one per maximal
// invalid subsequence (the Unicode recommendation Python follows).
func (s *Stream) Push(piece string) string {
	if s.n == 0 && utf8.ValidString(piece) {
		return piece // the usual case: no copy
	}
	buf := make([]byte, 0, s.n+len(piece))
	buf = append(buf, s.pending[:s.n]...)
	buf = append(buf, piece...)
	s.n = 0
	return s.decode(buf, false)
}

// Flush ends the stream: an incomplete sequence still held becomes U+FFFD.
func (s *Stream) Flush() string {
	if s.n == 0 {
		return ""
	}
	buf := append([]byte(nil), s.pending[:s.n]...)
	s.n = 0
	return s.decode(buf, true)
}

func (s *Stream) decode(buf []byte, final bool) string {
	var b strings.Builder
	b.Grow(len(buf))
	for i := 0; i < len(buf); {
		if buf[i] < utf8.RuneSelf {
			b.WriteByte(buf[i])
			i++
			continue
		}
		// FullRune is false only for a valid but unfinished prefix, which
		// is at most 3 bytes.
		if !final && !utf8.FullRune(buf[i:]) {
			s.n = copy(s.pending[:], buf[i:])
			break
		}
		r, size := utf8.DecodeRune(buf[i:])
		if r == utf8.RuneError && size == 1 {
			b.WriteRune(utf8.RuneError)
			i += validPrefixLen(buf[i:])
			continue
		}
		b.Write(buf[i : i+size])
		i += size
	}
	return b.String()
}

// validPrefixLen is the length (at least 1) of the longest prefix of p that
// starts a well-formed UTF-8 sequence: the maximal subpart that one U+FFFD
// replaces.
func validPrefixLen(p []byte) int {
	c := p[0]
	var need int
	lo, hi := byte(0x80), byte(0xBF) // allowed range of the second byte
	switch {
	case c >= 0xC2 && c <= 0xDF:
		need = 2
	case c >= 0xE0 && c <= 0xEF:
		need = 3
		if c == 0xE0 {
			lo = 0xA0 // no overlong forms
		} else if c == 0xED {
			hi = 0x9F // no surrogates
		}
	case c >= 0xF0 && c <= 0xF4:
		need = 4
		if c == 0xF0 {
			lo = 0x90
		} else if c == 0xF4 {
			hi = 0x8F // nothing above U+10FFFF
		}
	default:
		return 1
	}
	n := 1
	for n < need && n < len(p) {
		b := p[n]
		if n == 1 && (b < lo || b > hi) || n > 1 && (b < 0x80 || b > 0xBF) {
			break
		}
		n++
	}
	return n
}
