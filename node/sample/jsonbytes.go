package sample

// The byte-level rules that JSON and SchemaJSON share: whitespace between
// tokens, strings, numbers and the literals.

func isSpace(c byte) bool { return c == ' ' || c == '\t' || c == '\n' || c == '\r' }

func isDigit(c byte) bool { return c >= '0' && c <= '9' }

func isHex(c byte) bool { return isDigit(c) || c >= 'a' && c <= 'f' || c >= 'A' && c <= 'F' }

// maxSpaces bounds the spaces, tabs and carriage returns in a row between
// tokens.
const maxSpaces = 20

// spaceRun is the whitespace read since the last token: as in llama.cpp's
// JSON grammar, one line break and maxSpaces other whitespace bytes, so
// that a constrained model cannot pad its answer with blank lines forever.
type spaceRun struct {
	spaces int8
	broke  bool // a line break in the run
}

// take reads whitespace byte c.
func (r *spaceRun) take(c byte) bool {
	if c == '\n' {
		if r.broke {
			return false
		}
		r.broke = true
		return true
	}
	r.spaces++
	return r.spaces <= maxSpaces
}

// strState is how far a string is into an escape.
type strState uint8

const (
	strText   strState = iota // in text
	strEscape                 // after '\'
	strHex                    // the last hex digit of a \u escape comes; strHex+k: k more before it
)

// stringStep reads byte b of a string's body in state st: next is the
// state after it, closed says b was the closing quote, ok that b is
// allowed there.
func stringStep(st strState, b byte) (next strState, closed, ok bool) {
	switch {
	case st == strText:
		switch {
		case b == '"':
			return strText, true, true
		case b == '\\':
			return strEscape, false, true
		case b < 0x20:
			return st, false, false
		}
		return strText, false, true
	case st == strEscape:
		switch b {
		case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
			return strText, false, true
		case 'u':
			return strHex + 3, false, true
		}
		return st, false, false
	}
	if !isHex(b) {
		return st, false, false
	}
	if st == strHex {
		return strText, false, true
	}
	return st - 1, false, true
}

// plainText says whether b is string content that changes no state: no
// quote, backslash or control byte.
func plainText(b []byte) bool {
	for _, c := range b {
		if c == '"' || c == '\\' || c < 0x20 {
			return false
		}
	}
	return true
}

// numberStep reads byte b of a number in state st: jsValue before its
// first byte, then jsMinus … jsExpDigits. next is the state after b; ok
// says b belongs to the number; ended says the number was complete before
// b, which belongs to what follows. integer refuses a fraction or an
// exponent.
func numberStep(st jsonState, b byte, integer bool) (next jsonState, ok, ended bool) {
	switch st {
	case jsValue, jsMinus:
		switch {
		case b == '-' && st == jsValue:
			return jsMinus, true, false
		case b == '0':
			return jsZero, true, false
		case isDigit(b):
			return jsInt, true, false
		}
	case jsZero, jsInt:
		switch {
		case isDigit(b) && st == jsInt:
			return st, true, false
		case b == '.' && !integer:
			return jsDot, true, false
		case (b == 'e' || b == 'E') && !integer:
			return jsExp, true, false
		case !isDigit(b):
			return st, false, true
		}
	case jsDot:
		if isDigit(b) {
			return jsFrac, true, false
		}
	case jsFrac:
		switch {
		case isDigit(b):
			return st, true, false
		case b == 'e' || b == 'E':
			return jsExp, true, false
		}
		return st, false, true
	case jsExp:
		switch {
		case b == '+' || b == '-':
			return jsExpSign, true, false
		case isDigit(b):
			return jsExpDigits, true, false
		}
	case jsExpSign:
		if isDigit(b) {
			return jsExpDigits, true, false
		}
	case jsExpDigits:
		if isDigit(b) {
			return st, true, false
		}
		return st, false, true
	}
	return st, false, false
}

// literalRest is what follows the first byte c of true, false or null.
func literalRest(c byte) (string, bool) {
	switch c {
	case 't':
		return "rue", true
	case 'f':
		return "alse", true
	case 'n':
		return "ull", true
	}
	return "", false
}
