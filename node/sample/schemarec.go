package sample

// SchemaJSON recognizes the prefixes of JSON texts that a Schema allows,
// byte by byte, with the whitespace rules of JSON. Where the schema leaves
// a choice open until later bytes (anyOf), it follows every branch at once.
type SchemaJSON struct {
	configs []config
	scratch [2][]config // Try's, kept between calls
}

// config is one way of reading the text so far: the frame being read and
// the frames it is nested in (never written once pushed: a push copies).
type config struct {
	top  frame
	rest []frame
	done bool
	ws   spaceRun
}

type frameKind uint8

const (
	fValue   frameKind = iota // a value of schema s is to come
	fObject                   // in an object
	fArray                    // in an array
	fString                   // in a string value
	fNumber                   // in a number
	fLiteral                  // in true, false or null
	fEnum                     // in one of s.Enum's texts
)

// Object and array phases.
const (
	pFirst = iota // after '{' or '[': a key (value) or the close
	pNext         // after ',': a key (value)
	pKey          // in a key
	pColon        // after a key
	pChild        // a member's value is being read (a frame above)
	pAfter        // after a member: ',' or the close
)

type frame struct {
	kind  frameKind
	s     *Schema
	root  bool
	phase uint8
	// Objects: properties used, candidates for the key being read (and
	// whether it may be an additional one), its length so far, and the
	// property whose value comes.
	used, cand uint64
	extra      bool
	pos        int
	prop       int
	str        strState  // strings: how far into an escape
	num        jsonState // numbers: jsValue before the first byte, then as in numberStep
	integer    bool      // numbers: no fraction or exponent
	lit        string
}

// NewSchemaJSON starts recognizing a text that s allows (its root an
// object, whose brace comes first).
func NewSchemaJSON(s *Schema) *SchemaJSON {
	return &SchemaJSON{configs: []config{{top: frame{kind: fValue, s: s, root: true}}}}
}

// Done says whether the text read is a whole value the schema allows.
func (r *SchemaJSON) Done() bool {
	for _, c := range r.configs {
		if c.done {
			return true
		}
	}
	return false
}

// maxConfigs bounds the readings followed at once. A schema within
// ParseSchema's bounds stays far below it; past it, the extra readings are
// dropped, which may refuse a valid text but never accepts an invalid one.
const maxConfigs = 256

// Feed advances over b; on false r is unusable.
func (r *SchemaJSON) Feed(b []byte) bool {
	for _, c := range b {
		var next []config
		for _, cf := range r.configs {
			next = cf.step(c, next)
		}
		next = next[:min(len(next), maxConfigs)]
		if len(next) == 0 {
			r.configs = nil
			return false
		}
		r.configs = next
	}
	return true
}

// Try reports whether b would keep the text allowed, leaving r as it was.
// Its configurations live in scratch buffers kept in r, as masking a
// vocabulary calls Try once per token.
func (r *SchemaJSON) Try(b []byte) bool {
	if len(r.configs) == 1 && r.configs[0].top.kind == fString && r.configs[0].top.str == strText && plainText(b) {
		return true // most tokens, inside a string
	}
	cur := r.scratch[0][:0]
	for _, c := range r.configs {
		c.rest = c.rest[:len(c.rest):len(c.rest)] // a push copies
		cur = append(cur, c)
	}
	next := r.scratch[1][:0]
	ok := true
	for _, ch := range b {
		next = next[:0]
		for _, c := range cur {
			next = c.step(ch, next)
		}
		next = next[:min(len(next), maxConfigs)]
		if len(next) == 0 {
			ok = false
			break
		}
		cur, next = next, cur
	}
	r.scratch[0], r.scratch[1] = cur[:0], next[:0]
	return ok
}

// push nests a new frame: the current one goes onto the rest.
func (c *config) push(f frame) {
	c.rest = append(c.rest, c.top)
	c.top = f
}

// complete ends the value in the top frame: the enclosing frame takes over
// (or the text is done).
func (c *config) complete() {
	if len(c.rest) == 0 {
		c.done = true
		return
	}
	c.top = c.rest[len(c.rest)-1]
	c.rest = c.rest[:len(c.rest)-1]
	c.top.phase = pAfter
}

// space takes whitespace b between tokens into out (see spaceRun).
func (c config) space(b byte, out []config) []config {
	if !c.ws.take(b) {
		return out
	}
	return append(out, c)
}

// step reads byte b in configuration c and appends what follows to out.
func (c config) step(b byte, out []config) []config {
	if c.done {
		return out
	}
	inText := c.top.kind == fString || c.top.kind == fObject && c.top.phase == pKey || c.top.kind == fEnum
	if !inText && !isSpace(b) {
		c.ws = spaceRun{}
	}
	switch c.top.kind {
	case fValue:
		if isSpace(b) {
			if c.top.root {
				return out
			}
			return c.space(b, out)
		}
		return c.start(c.top.s, b, out)
	case fObject:
		return c.object(b, out)
	case fArray:
		return c.array(b, out)
	case fString:
		if c.stringByte(b) {
			return append(out, c)
		}
		return out
	case fNumber:
		ok, ended := c.numberByte(b)
		switch {
		case ended:
			c.complete()
			return c.step(b, out) // the byte after the number is the parent's
		case ok:
			return append(out, c)
		}
		return out
	case fLiteral:
		if b != c.top.lit[0] {
			return out
		}
		c.top.lit = c.top.lit[1:]
		if c.top.lit == "" {
			c.complete()
		}
		return append(out, c)
	case fEnum:
		return c.enumByte(b, out)
	}
	return out
}

// start begins a value of schema s at byte b (not whitespace).
func (c config) start(s *Schema, b byte, out []config) []config {
	if len(s.AnyOf) > 0 {
		for _, alt := range s.AnyOf {
			out = c.start(alt, b, out)
		}
		return out
	}
	root := c.top.root
	if s.Enum != nil {
		var cand uint64
		for i, e := range s.Enum {
			if e[0] == b {
				cand |= 1 << i
			}
		}
		if cand == 0 {
			return out
		}
		c.top = frame{kind: fEnum, s: s, root: root, cand: cand, pos: 1}
		return append(out, c)
	}
	switch {
	case b == '{' && s.allows("object"):
		c.top = frame{kind: fObject, s: s, root: root, phase: pFirst}
	case root:
		return out // the root is an object
	case b == '[' && s.allows("array"):
		c.top = frame{kind: fArray, s: s, phase: pFirst}
	case b == '"' && s.allows("string"):
		c.top = frame{kind: fString, s: s}
	case (b == '-' || isDigit(b)) && s.allows("integer"):
		c.top = frame{kind: fNumber, s: s, integer: !s.allows("number")}
		if ok, _ := c.numberByte(b); !ok {
			return out
		}
	case (b == 't' || b == 'f') && s.allows("boolean"), b == 'n' && s.allows("null"):
		rest, _ := literalRest(b)
		c.top = frame{kind: fLiteral, s: s, lit: rest}
	default:
		return out
	}
	return append(out, c)
}

// object reads byte b in an object.
func (c config) object(b byte, out []config) []config {
	f := &c.top
	s := f.s
	if isSpace(b) && f.phase != pKey && f.phase != pChild {
		return c.space(b, out)
	}
	switch f.phase {
	case pFirst, pNext:
		switch {
		case b == '"':
			f.phase, f.pos, f.extra = pKey, 0, s.Additional != nil
			f.cand = 0
			for i := range s.Properties {
				if f.used&(1<<i) == 0 {
					f.cand |= 1 << i
				}
			}
			if f.cand == 0 && !f.extra {
				return out
			}
			return append(out, c)
		case b == '}' && f.phase == pFirst:
			return c.closeObject(out)
		}
		return out
	case pKey:
		if b == '"' {
			f.prop = -2
			for i, p := range s.Properties {
				if f.cand&(1<<i) != 0 && len(p.name) == f.pos {
					f.prop = i
				}
			}
			if f.prop == -2 {
				if !f.extra {
					return out
				}
				f.prop = -1
			} else {
				f.used |= 1 << f.prop
			}
			f.phase = pColon
			return append(out, c)
		}
		if b < 0x20 || b == '\\' {
			return out // keys are plain text
		}
		for i, p := range s.Properties {
			if f.cand&(1<<i) != 0 && (f.pos >= len(p.name) || p.name[f.pos] != b) {
				f.cand &^= 1 << i
			}
		}
		f.pos++
		if f.cand == 0 && !f.extra {
			return out
		}
		return append(out, c)
	case pColon:
		if b != ':' {
			return out
		}
		child := s.Additional
		if f.prop >= 0 {
			child = s.Properties[f.prop].schema
		}
		f.phase = pChild
		c.push(frame{kind: fValue, s: child})
		return append(out, c)
	case pAfter:
		switch b {
		case ',':
			f.phase = pNext
			return append(out, c)
		case '}':
			return c.closeObject(out)
		}
	}
	return out
}

// closeObject ends an object if every required property came.
func (c config) closeObject(out []config) []config {
	for i, req := range c.top.s.Required {
		if req && c.top.used&(1<<i) == 0 {
			return out
		}
	}
	c.complete()
	return append(out, c)
}

// array reads byte b in an array.
func (c config) array(b byte, out []config) []config {
	f := &c.top
	if isSpace(b) {
		return c.space(b, out)
	}
	switch f.phase {
	case pFirst, pNext:
		if b == ']' && f.phase == pFirst {
			c.complete()
			return append(out, c)
		}
		items := f.s.Items
		if items == nil {
			items = &Schema{}
		}
		f.phase = pChild
		c.push(frame{kind: fValue, s: items})
		return c.step(b, out)
	case pAfter:
		switch b {
		case ',':
			f.phase = pNext
			return append(out, c)
		case ']':
			c.complete()
			return append(out, c)
		}
	}
	return out
}

// stringByte reads byte b in a string value.
func (c *config) stringByte(b byte) bool {
	next, closed, ok := stringStep(c.top.str, b)
	if !ok {
		return false
	}
	c.top.str = next
	if closed {
		c.complete()
	}
	return true
}

// numberByte reads byte b in a number: ok if it belongs to the number,
// ended if the number is complete and b is the next token's.
func (c *config) numberByte(b byte) (ok, ended bool) {
	next, ok, ended := numberStep(c.top.num, b, c.top.integer)
	c.top.num = next
	return ok, ended
}

// enumByte reads byte b in one of the schema's enum texts.
func (c config) enumByte(b byte, out []config) []config {
	f := &c.top
	var cand uint64
	complete := false
	for i, e := range f.s.Enum {
		if f.cand&(1<<i) == 0 {
			continue
		}
		if f.pos < len(e) && e[f.pos] == b {
			cand |= 1 << i
		}
		if f.pos == len(e) {
			complete = true
		}
	}
	if cand != 0 {
		f.cand, f.pos = cand, f.pos+1
		if c.top.root && c.enumDone() {
			c.complete()
		}
		return append(out, c)
	}
	if complete {
		c.complete()
		return c.step(b, out) // the byte after the value is the parent's
	}
	return out
}

// enumDone says whether a root enum value is complete (an object's text
// ends at its brace, so nothing can follow).
func (c *config) enumDone() bool {
	for i, e := range c.top.s.Enum {
		if c.top.cand&(1<<i) != 0 && c.top.pos == len(e) {
			return true
		}
	}
	return false
}
