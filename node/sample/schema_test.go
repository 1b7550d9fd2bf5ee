package sample

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"
)

const personSchema = `{
  "type": "object",
  "properties": {
    "name": {"type": "string", "description": "who"},
    "age": {"type": "integer", "minimum": 0},
    "height": {"type": "number"},
    "pets": {"type": "array", "items": {"type": "object", "properties": {"kind": {"enum": ["cat", "dog", 3]}}, "required": ["kind"]}},
    "nick": {"anyOf": [{"type": "string"}, {"type": "null"}]},
    "ok": {"type": "boolean"},
    "tags": {"type": ["array", "null"], "items": {"type": "string"}}
  },
  "required": ["name", "age"],
  "additionalProperties": false
}`

func TestSchemaRecognizer(t *testing.T) {
	s, err := ParseSchema([]byte(personSchema))
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		text         string
		prefix, done bool
	}{
		{`{"name":"Ann","age":7}`, true, true},
		{`{"age":7,"name":"Ann"}`, true, true}, // any order
		{"{\n  \"name\": \"Ann\",\n  \"age\": 7,\n  \"height\": 1.25e0\n}", true, true},
		{`{"name":"A\"n\u00e9","age":-0,"pets":[{"kind":"cat"},{"kind":3}],"nick":null,"ok":true,"tags":["x"]}`, true, true},
		{`{"name":"Ann","age":7,"tags":null,"nick":"Annie"}`, true, true},
		{`{"name":"Ann"`, true, false},
		{`{"name":"Ann"}`, false, false},           // age is required
		{`{"name":"Ann","age":7.5}`, false, false}, // an integer
		{`{"name":"Ann","age":1e3}`, false, false},
		{`{"name":7}`, false, false},
		{`{"nam":"x"}`, false, false}, // no such property
		{`{"name":"Ann","age":7,"x":1}`, false, false},
		{`{"name":"A","age":1,"pets":[{"kind":"cow"}]}`, false, false},
		{`{"name":"A","age":1,"pets":[{"kind":"cat","x":1}]}`, false, false},
		{`{"name":"A","age":1,"pets":[{}]}`, false, false}, // kind is required
		{`{"name":"A","age":1,"pets":[{"kind":3}]}`, true, true},
		{`{"name":"A","age":1,"pets":[{"kind":35}]}`, false, false},
		{`{"name":"A","age":1,"nick":5}`, false, false},
		{`{"name":"A","age":1,"ok":nul}`, false, false},
		{`{"name":"A","age":1,"tags":[1]}`, false, false},
		{`[]`, false, false},
		{` {"name":"A","age":1}`, false, false},
		{`{"name":"A","age":1} `, false, false},
		{`{"name":"A","age":1,}`, false, false},
	}
	for _, tt := range tests {
		r := NewSchemaJSON(s)
		ok := r.Feed([]byte(tt.text))
		if ok != tt.prefix || ok && r.Done() != tt.done {
			t.Errorf("%s: accepted %v done %v, want %v %v", tt.text, ok, ok && r.Done(), tt.prefix, tt.done)
		}
	}
}

func TestParseSchemaErrors(t *testing.T) {
	tests := []struct{ schema, want string }{
		{`{"type":"string"}`, "root must be an object"},
		{`{"type":"object","properties":{"a":{"$ref":"#/x"}}}`, `keyword "$ref"`},
		{`{"type":"object","properties":{"a":{"type":"text"}}}`, `unknown type "text"`},
		{`{"type":"object","required":["b"],"properties":{"a":{}}}`, `required property "b"`},
		{`{"type":"object","properties":{"a\"b":{}}}`, "needs escaping"},
		{`{"type":"object","properties":{"a":{"type":"string","anyOf":[{}]}}}`, "beside other keywords"},
		{`{"type":"object","properties":{"a":false}}`, "allows nothing"},
		{`{"type":`, "unsupported JSON schema"},
		{`{"type":"object","properties":{"a":{"enum":[]}}}`, "enum"},
		{`{"type":"object","properties":{"a":` + strings.Repeat(`{"type":"array","items":`, 40) + `{}` + strings.Repeat(`}`, 40) + `}}`, "nested more than 32 deep"},
		{`{"type":"object","properties":{"a":{"anyOf":[` + strings.Repeat(`{"type":"string"},`, 64) + `{"type":"null"}]}}}`, "more than 64 anyOf/oneOf branches"},
	}
	for _, tt := range tests {
		_, err := ParseSchema([]byte(tt.schema))
		if !errors.Is(err, ErrSchema) || !strings.Contains(err.Error(), tt.want) {
			t.Errorf("%s: %v, want an error saying %q", tt.schema, err, tt.want)
		}
	}
}

// TestSchemaBranchesStayBounded: anyOf branches that all read the same
// text (the worst case for following every reading) within ParseSchema's
// bounds stay within maxConfigs, and the recognizer still accepts.
func TestSchemaBranchesStayBounded(t *testing.T) {
	// Five levels of two identical branches (62 in all): 32 readings of
	// one text.
	inner := `{"type":"string"}`
	for range 5 {
		inner = `{"anyOf":[` + inner + `,` + inner + `]}`
	}
	s, err := ParseSchema([]byte(`{"type":"object","properties":{"a":` + inner + `},"required":["a"]}`))
	if err != nil {
		t.Fatal(err)
	}
	r := NewSchemaJSON(s)
	if !r.Feed([]byte(`{"a":"x`)) || len(r.configs) != 32 {
		t.Fatalf("%d readings, want 32", len(r.configs))
	}
	if !r.Feed([]byte(`"}`)) || !r.Done() {
		t.Fatal("refused")
	}
}

// validate is an independent check of a decoded value against s.
func validate(s *Schema, v any) bool {
	if len(s.AnyOf) > 0 {
		for _, a := range s.AnyOf {
			if validate(a, v) {
				return true
			}
		}
		return false
	}
	if s.Enum != nil {
		b, _ := json.Marshal(v)
		return slices.ContainsFunc(s.Enum, func(e []byte) bool { return bytes.Equal(e, b) })
	}
	typeOf := func(v any) string {
		switch x := v.(type) {
		case map[string]any:
			return "object"
		case []any:
			return "array"
		case string:
			return "string"
		case json.Number:
			if !strings.ContainsAny(x.String(), ".eE") {
				return "integer"
			}
			return "number"
		case bool:
			return "boolean"
		}
		return "null"
	}
	if !s.allows(typeOf(v)) {
		return false
	}
	switch x := v.(type) {
	case map[string]any:
		for i, p := range s.Properties {
			pv, ok := x[p.name]
			if s.Required[i] && !ok || ok && !validate(p.schema, pv) {
				return false
			}
		}
		for k, kv := range x {
			if slices.ContainsFunc(s.Properties, func(p property) bool { return p.name == k }) {
				continue
			}
			if s.Additional == nil || !validate(s.Additional, kv) {
				return false
			}
		}
	case []any:
		for _, item := range x {
			if s.Items != nil && !validate(s.Items, item) {
				return false
			}
		}
	}
	return true
}

// generate writes a random value that s allows.
func generate(r *rand.Rand, s *Schema, depth int) string {
	if len(s.AnyOf) > 0 {
		return generate(r, s.AnyOf[r.IntN(len(s.AnyOf))], depth)
	}
	if s.Enum != nil {
		return string(s.Enum[r.IntN(len(s.Enum))])
	}
	types := s.Types
	if len(types) == 0 {
		types = []string{"string", "integer", "boolean", "null"}
		if depth > 0 {
			types = append(types, "object", "array")
		}
	}
	ws := func() string { return []string{"", " ", "\n  "}[r.IntN(3)] }
	switch types[r.IntN(len(types))] {
	case "object":
		var parts []string
		for i, p := range s.Properties {
			if s.Required[i] || r.IntN(2) == 0 {
				parts = append(parts, fmt.Sprintf("%s%q:%s%s", ws(), p.name, ws(), generate(r, p.schema, depth-1)))
			}
		}
		if s.Additional != nil && r.IntN(3) == 0 {
			parts = append(parts, fmt.Sprintf("%q:%s", fmt.Sprintf("extra%d", r.IntN(9)), generate(r, s.Additional, depth-1)))
		}
		r.Shuffle(len(parts), func(i, j int) { parts[i], parts[j] = parts[j], parts[i] })
		return "{" + strings.Join(parts, ",") + "}"
	case "array":
		items := s.Items
		if items == nil {
			items = &Schema{}
		}
		var parts []string
		for range r.IntN(3) {
			parts = append(parts, generate(r, items, depth-1))
		}
		return "[" + strings.Join(parts, ","+ws()) + "]"
	case "string":
		b, _ := json.Marshal([]string{"", "a b", `q"\`, "é", "\n"}[r.IntN(5)])
		return string(b)
	case "integer":
		return []string{"0", "-3", "42"}[r.IntN(3)]
	case "number":
		return []string{"0.5", "-1e3", "7", "2.5E-2"}[r.IntN(4)]
	case "boolean":
		return []string{"true", "false"}[r.IntN(2)]
	}
	return "null"
}

// TestSchemaAgreesWithValidator: values generated from the schema are
// accepted whole; corruptions the recognizer accepts whole are values the
// independent validator accepts too.
func TestSchemaAgreesWithValidator(t *testing.T) {
	s, err := ParseSchema([]byte(personSchema))
	if err != nil {
		t.Fatal(err)
	}
	r := rand.New(rand.NewPCG(5, 6))
	accepted := 0
	for range 3000 {
		text := generate(r, s, 4)
		rec := NewSchemaJSON(s)
		for i := range len(text) {
			if !rec.Feed([]byte{text[i]}) {
				t.Fatalf("%s refused at byte %d", text, i)
			}
		}
		if !rec.Done() {
			t.Fatalf("%s not complete", text)
		}
		b := []byte(text)
		b[r.IntN(len(b))] = `{}[]",:0.-e1tn"aA`[r.IntN(17)]
		rec = NewSchemaJSON(s)
		if rec.Feed(b) && rec.Done() {
			accepted++
			dec := json.NewDecoder(bytes.NewReader(b))
			dec.UseNumber()
			var v any
			if err := dec.Decode(&v); err != nil || dec.More() || !validate(s, v) {
				t.Fatalf("%s accepted, but it is not a valid instance (%v)", b, err)
			}
		}
	}
	t.Logf("%d corrupted texts were still valid", accepted)
}

// FuzzSchema: whatever the recognizer takes whole under personSchema is a
// value the independent validator takes.
func FuzzSchema(f *testing.F) {
	s, err := ParseSchema([]byte(personSchema))
	if err != nil {
		f.Fatal(err)
	}
	for _, seed := range []string{`{"name":"Ann","age":7}`, `{"age":1,"name":"","pets":[{"kind":3}],"nick":null}`, `{"name":"x","age":-0,"tags":["a"]}`} {
		f.Add([]byte(seed))
	}
	f.Fuzz(func(t *testing.T, b []byte) {
		r := NewSchemaJSON(s)
		if !r.Feed(b) || !r.Done() {
			return
		}
		dec := json.NewDecoder(bytes.NewReader(b))
		dec.UseNumber()
		var v any
		if err := dec.Decode(&v); err != nil || dec.More() || !validate(s, v) {
			t.Fatalf("%q accepted, but it is not a valid instance (%v)", b, err)
		}
	})
}
