package sample

// JSON is a byte-level recognizer of the prefixes of one JSON object (RFC
// 8259, the top level an object, as OpenAI's json_object format asks);
// NewJSON makes one. Feed reports whether bytes keep the text a prefix of
// some valid object; Done whether the object is complete. The text must
// begin with the object's brace, and whitespace between tokens is limited
// (see spaceRun).
type JSON struct {
	stack []byte // open containers: '{' or '['
	state jsonState
	str   strState // in a string: how far into an escape
	lit   string   // the rest of true, false or null being read
	ws    spaceRun
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
	if (j.state == jsString || j.state == jsKeyString) && j.str == strText && plainText(b) {
		return true // most tokens, inside a string
	}
	t := *j
	// Pops shorten the copy's view; pushes reallocate it (cap == len), so
	// j's stack is never written.
	t.stack = j.stack[:len(j.stack):len(j.stack)]
	return t.Feed(b)
}

func (j *JSON) step(c byte) bool {
	if j.state != jsString && j.state != jsKeyString && !isSpace(c) {
		j.ws = spaceRun{}
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
			return j.ws.take(c)
		case c == ']' && j.state == jsValueOrEnd:
			return j.close(']')
		case c == '{':
			j.stack = append(j.stack, '{')
			j.state = jsKeyOrClose
		case c == '[':
			j.stack = append(j.stack, '[')
			j.state = jsValueOrEnd
		case c == '"':
			j.state, j.str = jsString, strText
		case c == '-' || isDigit(c):
			j.state, _, _ = numberStep(jsValue, c, false)
		default:
			rest, ok := literalRest(c)
			if !ok {
				return false
			}
			j.state, j.lit = jsLiteral, rest
		}
		return true
	case jsKeyOrClose, jsKey:
		switch {
		case isSpace(c):
			return j.ws.take(c)
		case c == '"':
			j.state, j.str = jsKeyString, strText
			return true
		case c == '}' && j.state == jsKeyOrClose:
			return j.close('}')
		}
		return false
	case jsColon:
		switch {
		case isSpace(c):
			return j.ws.take(c)
		case c == ':':
			j.state = jsValue
			return true
		}
		return false
	case jsString, jsKeyString:
		next, closed, ok := stringStep(j.str, c)
		if !ok {
			return false
		}
		j.str = next
		switch {
		case closed && j.state == jsKeyString:
			j.state = jsColon
		case closed:
			j.state = jsAfterValue
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
	case jsMinus, jsZero, jsInt, jsDot, jsFrac, jsExp, jsExpSign, jsExpDigits:
		next, ok, ended := numberStep(j.state, c, false)
		if ended {
			j.state = jsAfterValue
			return j.afterValue(c) // the byte after the number is the container's
		}
		j.state = next
		return ok
	case jsAfterValue:
		return j.afterValue(c)
	case jsDone:
		return false
	}
	return false
}

func (j *JSON) afterValue(c byte) bool {
	if isSpace(c) {
		return j.ws.take(c)
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
