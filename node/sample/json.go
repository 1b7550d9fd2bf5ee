package sample

// JSON is a byte-level recognizer of the prefixes of one JSON object (RFC
// 8259, the top level an object, as OpenAI's json_object format asks). The
// zero value expects the object's opening brace, after optional
// whitespace. Feed reports whether bytes keep the text a prefix of some
// valid object; Done whether the object is complete. The text must begin
// with the object's brace.
//
// Whitespace between tokens is limited, as in llama.cpp's JSON grammar, to
// one line break and maxSpaces spaces, tabs or carriage returns in a row, so that a
// constrained model cannot pad its answer with blank lines forever.
type JSON struct {
	stack  []byte // open containers: '{' or '['
	state  jsonState
	lit    string // the rest of true, false or null being read
	hex    int8   // hex digits left in a \u escape
	spaces int8   // spaces and tabs between tokens, in a row
	broke  bool   // a line break in that run
}

type jsonState uint8

const (
	jsValue      jsonState = iota // a value must come (after whitespace)
	jsTop                         // the top-level object must come
	jsAfterValue                  // a value ended: ',' or the container's close
	jsKeyOrClose                  // after '{': a key or '}'
	jsKey                         // after ',' in an object: a key
	jsColon                       // after a key: ':'
	jsValueOrEnd                  // after '[': a value or ']'
	jsString                      // inside a string value
	jsKeyString                   // inside a key
	jsEscape                      // after '\' in a string
	jsKeyEscape                   // after '\' in a key
	jsLiteral                     // inside true, false or null
	jsMinus                       // after '-': a digit must come
	jsZero                        // a number's integer part is 0
	jsInt                         // in a number's integer part
	jsDot                         // after '.': a digit must come
	jsFrac                        // in a fraction
	jsExp                         // after 'e': a sign or digit
	jsExpSign                     // after the exponent's sign: a digit
	jsExpDigits                   // in the exponent
	jsDone                        // the object is complete
)

const maxSpaces = 20

// NewJSON returns a recognizer at the start of the text.
func NewJSON() *JSON { return &JSON{state: jsTop} }

// Done says whether the object is complete.
func (j *JSON) Done() bool { return j.state == jsDone }

// Feed advances over b; on false the recognizer is unusable (use Try to
// test without changing it).
func (j *JSON) Feed(b []byte) bool {
	for _, c := range b {
		if !j.step(c) {
			return false
		}
	}
	return true
}

// Try reports whether b would keep the text valid, leaving j as it was.
func (j *JSON) Try(b []byte) bool {
	if (j.state == jsString || j.state == jsKeyString) && plainText(b) {
		return true // most tokens, inside a string
	}
	t := *j
	// Pops shorten the copy's view; pushes reallocate it (cap == len), so
	// j's stack is never written.
	t.stack = j.stack[:len(j.stack):len(j.stack)]
	return t.Feed(b)
}

// Clone returns an independent copy.
func (j *JSON) Clone() *JSON {
	t := *j
	t.stack = append([]byte(nil), j.stack...)
	return &t
}

func isSpace(c byte) bool { return c == ' ' || c == '\t' || c == '\n' || c == '\r' }

func isDigit(c byte) bool { return c >= '0' && c <= '9' }

func isHex(c byte) bool { return isDigit(c) || c >= 'a' && c <= 'f' || c >= 'A' && c <= 'F' }

// space takes whitespace c between tokens.
func (j *JSON) space(c byte) bool {
	if c == '\n' {
		if j.broke {
			return false
		}
		j.broke = true
		return true
	}
	j.spaces++
	return j.spaces <= maxSpaces
}

func (j *JSON) step(c byte) bool {
	if j.state != jsString && j.state != jsKeyString && !isSpace(c) {
		j.spaces, j.broke = 0, false
	}
	switch j.state {
	case jsTop:
		// The object comes first: no whitespace before it, which a model
		// that does not want to write JSON would pad forever.
		switch {
		case c == '{':
			j.stack = append(j.stack, '{')
			j.state = jsKeyOrClose
			return true
		}
		return false
	case jsValue, jsValueOrEnd:
		switch {
		case isSpace(c):
			return j.space(c)
		case c == ']' && j.state == jsValueOrEnd:
			return j.close(']')
		case c == '{':
			j.stack = append(j.stack, '{')
			j.state = jsKeyOrClose
		case c == '[':
			j.stack = append(j.stack, '[')
			j.state = jsValueOrEnd
		case c == '"':
			j.state = jsString
		case c == '-':
			j.state = jsMinus
		case c == '0':
			j.state = jsZero
		case c >= '1' && c <= '9':
			j.state = jsInt
		case c == 't':
			j.state, j.lit = jsLiteral, "rue"
		case c == 'f':
			j.state, j.lit = jsLiteral, "alse"
		case c == 'n':
			j.state, j.lit = jsLiteral, "ull"
		default:
			return false
		}
		return true
	case jsKeyOrClose, jsKey:
		switch {
		case isSpace(c):
			return j.space(c)
		case c == '"':
			j.state = jsKeyString
			return true
		case c == '}' && j.state == jsKeyOrClose:
			return j.close('}')
		}
		return false
	case jsColon:
		switch {
		case isSpace(c):
			return j.space(c)
		case c == ':':
			j.state = jsValue
			return true
		}
		return false
	case jsString, jsKeyString:
		switch {
		case c == '"':
			if j.state == jsKeyString {
				j.state = jsColon
			} else {
				j.state = jsAfterValue
			}
		case c == '\\' && j.state == jsKeyString:
			j.state = jsKeyEscape
		case c == '\\':
			j.state = jsEscape
		case c < 0x20:
			return false
		}
		return true
	case jsEscape, jsKeyEscape:
		back := jsString
		if j.state == jsKeyEscape {
			back = jsKeyString
		}
		if j.hex > 0 {
			if !isHex(c) {
				return false
			}
			j.hex--
			if j.hex == 0 {
				j.state = back
			}
			return true
		}
		switch c {
		case '"', '\\', '/', 'b', 'f', 'n', 'r', 't':
			j.state = back
		case 'u':
			j.hex = 4
		default:
			return false
		}
		return true
	case jsLiteral:
		if c != j.lit[0] {
			return false
		}
		j.lit = j.lit[1:]
		if j.lit == "" {
			j.state = jsAfterValue
		}
		return true
	case jsMinus:
		switch {
		case c == '0':
			j.state = jsZero
		case c >= '1' && c <= '9':
			j.state = jsInt
		default:
			return false
		}
		return true
	case jsZero, jsInt:
		switch {
		case isDigit(c) && j.state == jsInt:
		case c == '.':
			j.state = jsDot
		case c == 'e' || c == 'E':
			j.state = jsExp
		default:
			return j.endNumber(c)
		}
		return true
	case jsDot:
		if !isDigit(c) {
			return false
		}
		j.state = jsFrac
		return true
	case jsFrac:
		switch {
		case isDigit(c):
		case c == 'e' || c == 'E':
			j.state = jsExp
		default:
			return j.endNumber(c)
		}
		return true
	case jsExp:
		switch {
		case c == '+' || c == '-':
			j.state = jsExpSign
		case isDigit(c):
			j.state = jsExpDigits
		default:
			return false
		}
		return true
	case jsExpSign:
		if !isDigit(c) {
			return false
		}
		j.state = jsExpDigits
		return true
	case jsExpDigits:
		if isDigit(c) {
			return true
		}
		return j.endNumber(c)
	case jsAfterValue:
		return j.afterValue(c)
	case jsDone:
		return false
	}
	return false
}

// endNumber ends a number at c, which the state after the value takes.
func (j *JSON) endNumber(c byte) bool {
	j.state = jsAfterValue
	return j.afterValue(c)
}

func (j *JSON) afterValue(c byte) bool {
	if isSpace(c) {
		return j.space(c)
	}
	if len(j.stack) == 0 {
		return false
	}
	top := j.stack[len(j.stack)-1]
	switch {
	case c == ',' && top == '{':
		j.state = jsKey
	case c == ',' && top == '[':
		j.state = jsValue
	case c == '}' && top == '{', c == ']' && top == '[':
		return j.close(c)
	default:
		return false
	}
	return true
}

// close pops the container c closes.
func (j *JSON) close(c byte) bool {
	open := byte('{')
	if c == ']' {
		open = '['
	}
	if len(j.stack) == 0 || j.stack[len(j.stack)-1] != open {
		return false
	}
	j.stack = j.stack[:len(j.stack)-1]
	j.state = jsAfterValue
	if len(j.stack) == 0 {
		j.state = jsDone
	}
	return true
}
