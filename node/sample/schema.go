package sample

import (
	"bytes"
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"sort"
)

// ErrSchema is wrapped by ParseSchema's errors.
var ErrSchema = errors.New("unsupported JSON schema")

// Schema is the part of JSON Schema that constrained sampling follows:
// type (one or several), properties, required, additionalProperties,
// items, enum, const, anyOf and oneOf. Keywords that only describe
// (title, description, default, examples, $schema, strict) are ignored,
// and so are bounds this recognizer does not count (minLength, pattern,
// minimum, minItems, format, …): the output has the right shape, not
// every refinement. $ref and the rest are refused.
type Schema struct {
	Types      []string   // allowed types; empty: any JSON value
	Properties []property // object: known properties, sorted by name
	Required   []bool     // Required[i]: Properties[i] must appear
	Additional *Schema    // object: schema of other keys; nil: none allowed
	Items      *Schema    // array: each item's schema; nil: any
	Enum       [][]byte   // allowed values as compact JSON texts; nil: no enum
	AnyOf      []*Schema  // the value matches one of these (no other keywords beside)
}

type property struct {
	name   string
	schema *Schema
}

// maxProps and maxEnum bound a schema's objects and enums: the recognizer
// tracks them in 64-bit sets. maxDepth and maxAlternatives bound its
// nesting and its anyOf branches in all, so that a schema sent by a client
// cannot make the last stage follow more readings at once than
// maxConfigs.
const (
	maxProps        = 64
	maxEnum         = 64
	maxDepth        = 32
	maxAlternatives = 64
)

var ignoredKeywords = map[string]bool{
	"title": true, "description": true, "default": true, "examples": true, "$schema": true, "$id": true,
	"$comment": true, "strict": true, "name": true, "minLength": true, "maxLength": true, "pattern": true,
	"format": true, "minimum": true, "maximum": true, "exclusiveMinimum": true, "exclusiveMaximum": true,
	"multipleOf": true, "minItems": true, "maxItems": true, "uniqueItems": true, "minProperties": true,
	"maxProperties": true, "readOnly": true, "writeOnly": true, "deprecated": true,
}

var jsonTypes = []string{"object", "array", "string", "number", "integer", "boolean", "null"}

// ParseSchema reads a JSON Schema document. The root must describe
// objects (as OpenAI's structured outputs require).
func ParseSchema(doc []byte) (*Schema, error) {
	var raw any
	dec := json.NewDecoder(bytes.NewReader(doc))
	dec.UseNumber()
	if err := dec.Decode(&raw); err != nil {
		return nil, fmt.Errorf("%w: %v", ErrSchema, err)
	}
	var ps schemaParser
	s, err := ps.parse(raw, "schema", 0)
	if err != nil {
		return nil, err
	}
	if !s.onlyObjects() {
		return nil, fmt.Errorf("%w: the root must be an object schema (\"type\": \"object\")", ErrSchema)
	}
	return s, nil
}

// schemaParser counts what bounds a schema as it reads it.
type schemaParser struct {
	alternatives int
}

func (sp *schemaParser) parse(raw any, at string, depth int) (*Schema, error) {
	bad := func(format string, args ...any) error {
		return fmt.Errorf("%w: %s: %s", ErrSchema, at, fmt.Sprintf(format, args...))
	}
	if depth > maxDepth {
		return nil, bad("nested more than %d deep", maxDepth)
	}
	if b, ok := raw.(bool); ok {
		if !b {
			return nil, bad("false allows nothing")
		}
		return &Schema{}, nil // true: anything
	}
	m, ok := raw.(map[string]any)
	if !ok {
		return nil, bad("a schema is an object")
	}
	s := &Schema{}
	keys := make([]string, 0, len(m))
	for k := range m {
		keys = append(keys, k)
	}
	sort.Strings(keys)
	for _, k := range keys {
		v := m[k]
		switch k {
		case "type":
			switch t := v.(type) {
			case string:
				s.Types = []string{t}
			case []any:
				for _, x := range t {
					name, ok := x.(string)
					if !ok {
						return nil, bad("type lists strings")
					}
					s.Types = append(s.Types, name)
				}
			default:
				return nil, bad("type is a string or a list of strings")
			}
			for _, t := range s.Types {
				if !slices.Contains(jsonTypes, t) {
					return nil, bad("unknown type %q", t)
				}
			}
		case "properties":
			props, ok := v.(map[string]any)
			if !ok {
				return nil, bad("properties is an object")
			}
			names := make([]string, 0, len(props))
			for name := range props {
				names = append(names, name)
			}
			// The schema's own order is lost in a Go map; sorted names give
			// one that does not depend on it. The model writes keys in any
			// order anyway.
			sort.Strings(names)
			if len(names) > maxProps {
				return nil, bad("%d properties, more than %d", len(names), maxProps)
			}
			for _, name := range names {
				if name == "" || bytes.ContainsAny([]byte(name), "\"\\") || bytes.ContainsFunc([]byte(name), func(r rune) bool { return r < 0x20 }) {
					return nil, bad("property name %q needs escaping, which is not supported", name)
				}
				ps, err := sp.parse(props[name], at+".properties."+name, depth+1)
				if err != nil {
					return nil, err
				}
				s.Properties = append(s.Properties, property{name: name, schema: ps})
			}
		case "required", "additionalProperties", "items", "enum", "const", "anyOf", "oneOf":
			// After properties (sorted keys put them later only partly):
			// handled below.
		default:
			if !ignoredKeywords[k] {
				return nil, bad("keyword %q is not supported", k)
			}
		}
	}
	s.Required = make([]bool, len(s.Properties))
	if v, ok := m["required"]; ok {
		list, ok := v.([]any)
		if !ok {
			return nil, bad("required is a list of names")
		}
		for _, x := range list {
			name, _ := x.(string)
			i := slices.IndexFunc(s.Properties, func(p property) bool { return p.name == name })
			if i < 0 {
				return nil, bad("required property %q is not among the properties", name)
			}
			s.Required[i] = true
		}
	}
	if v, ok := m["additionalProperties"]; ok {
		if b, isBool := v.(bool); !isBool || b {
			extra, err := sp.parse(v, at+".additionalProperties", depth+1)
			if err != nil {
				return nil, err
			}
			s.Additional = extra
		}
	} else if len(s.Properties) == 0 {
		s.Additional = &Schema{} // {"type":"object"} alone: any object
	}
	if v, ok := m["items"]; ok {
		items, err := sp.parse(v, at+".items", depth+1)
		if err != nil {
			return nil, err
		}
		s.Items = items
	}
	addEnum := func(v any) error {
		b, err := json.Marshal(v)
		if err != nil {
			return bad("enum value: %v", err)
		}
		s.Enum = append(s.Enum, b)
		return nil
	}
	if v, ok := m["enum"]; ok {
		list, ok := v.([]any)
		if !ok || len(list) == 0 || len(list) > maxEnum {
			return nil, bad("enum is a list of 1 to %d values", maxEnum)
		}
		for _, x := range list {
			if err := addEnum(x); err != nil {
				return nil, err
			}
		}
	}
	if v, ok := m["const"]; ok {
		if s.Enum != nil {
			return nil, bad("both enum and const")
		}
		if err := addEnum(v); err != nil {
			return nil, err
		}
	}
	for _, k := range []string{"anyOf", "oneOf"} {
		v, ok := m[k]
		if !ok {
			continue
		}
		if len(s.Types) > 0 || len(s.Properties) > 0 || s.Enum != nil || s.Items != nil || s.AnyOf != nil {
			return nil, bad("%s beside other keywords is not supported", k)
		}
		list, ok := v.([]any)
		if !ok || len(list) == 0 {
			return nil, bad("%s is a list of schemas", k)
		}
		sp.alternatives += len(list)
		if sp.alternatives > maxAlternatives {
			return nil, bad("more than %d anyOf/oneOf branches in all", maxAlternatives)
		}
		for i, x := range list {
			alt, err := sp.parse(x, fmt.Sprintf("%s.%s[%d]", at, k, i), depth+1)
			if err != nil {
				return nil, err
			}
			s.AnyOf = append(s.AnyOf, alt)
		}
	}
	return s, nil
}

// onlyObjects says whether every value the schema allows is an object.
func (s *Schema) onlyObjects() bool {
	if len(s.AnyOf) > 0 {
		for _, a := range s.AnyOf {
			if !a.onlyObjects() {
				return false
			}
		}
		return true
	}
	if s.Enum != nil {
		for _, e := range s.Enum {
			if e[0] != '{' {
				return false
			}
		}
		return true
	}
	return len(s.Types) == 1 && s.Types[0] == "object"
}

// allows says whether the schema admits values of type t (ignoring anyOf).
func (s *Schema) allows(t string) bool {
	if len(s.Types) == 0 {
		return true
	}
	if slices.Contains(s.Types, t) {
		return true
	}
	return t == "integer" && slices.Contains(s.Types, "number")
}
