package hftok

import (
	"encoding/json"
	"fmt"
	"strings"
	"unicode"
)

// normalizer builds the normalizer function; first tells whether the text
// is the first segment of the input (Prepend applies to every segment, as
// in Hugging Face; the flag exists for Metaspace's "first" scheme).
func normalizer(m json.RawMessage, opts Options) (func(string, bool) string, error) {
	if isNull(m) {
		return func(s string, _ bool) string { return s }, nil
	}
	var c component
	if err := json.Unmarshal(m, &c); err != nil {
		return nil, fmt.Errorf("%w: normalizer: %w", ErrFormat, err)
	}
	switch k := c.kind(); k {
	case "Sequence":
		parts, err := c.list("normalizers")
		if err != nil {
			return nil, err
		}
		var fs []func(string, bool) string
		for _, p := range parts {
			b, _ := json.Marshal(p)
			f, err := normalizer(b, opts)
			if err != nil {
				return nil, err
			}
			fs = append(fs, f)
		}
		return func(s string, first bool) string {
			for _, f := range fs {
				s = f(s, first)
			}
			return s
		}, nil
	case "Prepend":
		pre := c.str("prepend")
		return func(s string, _ bool) string {
			if s == "" {
				return s
			}
			return pre + s
		}, nil
	case "Replace":
		pat, regex, err := c.pattern()
		if err != nil {
			return nil, err
		}
		if regex {
			return nil, fmt.Errorf("%w: Replace normalizer with a regex", ErrUnsupported)
		}
		content := c.str("content")
		return func(s string, _ bool) string { return strings.ReplaceAll(s, pat, content) }, nil
	case "Lowercase":
		return func(s string, _ bool) string { return strings.ToLower(s) }, nil
	case "NFC":
		if opts.NFC != nil {
			return func(s string, _ bool) string { return opts.NFC(s) }, nil
		}
		return func(s string, _ bool) string { return s }, nil
	default:
		return nil, fmt.Errorf("%w: normalizer %q", ErrUnsupported, k)
	}
}

// preTokenizer builds the pre-tokenizer: text to pieces. The flag reports
// a ByteLevel step, after which pieces are byte-level symbols.
func preTokenizer(m json.RawMessage) (func(string, bool) ([]string, error), bool, error) {
	if isNull(m) {
		return func(s string, _ bool) ([]string, error) { return []string{s}, nil }, false, nil
	}
	var c component
	if err := json.Unmarshal(m, &c); err != nil {
		return nil, false, fmt.Errorf("%w: pre_tokenizer: %w", ErrFormat, err)
	}
	switch k := c.kind(); k {
	case "Sequence":
		parts, err := c.list("pretokenizers")
		if err != nil {
			return nil, false, err
		}
		var fs []func(string, bool) ([]string, error)
		byteLevel := false
		for _, p := range parts {
			b, _ := json.Marshal(p)
			f, bl, err := preTokenizer(b)
			if err != nil {
				return nil, false, err
			}
			fs = append(fs, f)
			byteLevel = byteLevel || bl
		}
		return func(s string, first bool) ([]string, error) {
			pieces := []string{s}
			for _, f := range fs {
				var next []string
				for _, p := range pieces {
					out, err := f(p, first)
					if err != nil {
						return nil, err
					}
					next = append(next, out...)
				}
				pieces = next
			}
			return pieces, nil
		}, byteLevel, nil
	case "Split":
		pat, regex, err := c.pattern()
		if err != nil {
			return nil, false, err
		}
		if !regex {
			pat = quoteMeta(pat)
		}
		sp, err := newSplitter(pat)
		if err != nil {
			return nil, false, err
		}
		behavior, invert := c.str("behavior"), c.boolean("invert", false)
		if _, err := sp.split("", behavior, invert); err != nil {
			return nil, false, err
		}
		return func(s string, _ bool) ([]string, error) { return sp.split(s, behavior, invert) }, false, nil
	case "ByteLevel":
		prefix := c.boolean("add_prefix_space", true)
		var sp *splitter
		if c.boolean("use_regex", true) {
			var err error
			if sp, err = newSplitter(gpt2Pattern); err != nil {
				return nil, false, err
			}
		}
		// The byte-level mapping itself is done after the split, on each
		// piece (encodeWord), so the regex sees the real text.
		return func(s string, _ bool) ([]string, error) {
			if prefix && s != "" && !strings.HasPrefix(s, " ") {
				s = " " + s
			}
			if sp == nil {
				return []string{s}, nil
			}
			return sp.split(s, "Isolated", false)
		}, true, nil
	case "Metaspace":
		repl := c.str("replacement")
		if repl == "" {
			repl = "▁"
		}
		scheme := c.str("prepend_scheme")
		if scheme == "" {
			scheme = "always"
			if !c.boolean("add_prefix_space", true) {
				scheme = "never"
			}
		}
		split := c.boolean("split", true)
		return func(s string, first bool) ([]string, error) {
			s = strings.ReplaceAll(s, " ", repl)
			if (scheme == "always" || (scheme == "first" && first)) && !strings.HasPrefix(s, repl) {
				s = repl + s
			}
			if !split {
				return []string{s}, nil
			}
			// Each replacement character starts a new piece.
			var out []string
			for len(s) > 0 {
				i := strings.Index(s[1:], repl)
				if i < 0 {
					out = append(out, s)
					break
				}
				out = append(out, s[:1+i])
				s = s[1+i:]
			}
			return out, nil
		}, false, nil
	case "Digits":
		individual := c.boolean("individual_digits", false)
		return func(s string, _ bool) ([]string, error) {
			var out []string
			start := 0
			prevDigit := false
			for i, r := range s {
				d := unicode.IsDigit(r)
				if i > start && (d != prevDigit || (d && individual)) {
					out = append(out, s[start:i])
					start = i
				}
				prevDigit = d
			}
			if start < len(s) {
				out = append(out, s[start:])
			}
			return out, nil
		}, false, nil
	default:
		return nil, false, fmt.Errorf("%w: pre_tokenizer %q", ErrUnsupported, k)
	}
}

// gpt2Pattern is ByteLevel's own split when use_regex is true.
const gpt2Pattern = `'s|'t|'re|'ve|'m|'ll|'d| ?\p{L}+| ?\p{N}+| ?[^\s\p{L}\p{N}]+|\s+(?!\S)|\s+`

// quoteMeta escapes a literal string pattern for the splitter.
func quoteMeta(s string) string {
	var b strings.Builder
	for _, r := range s {
		if strings.ContainsRune(`\.+*?()|[]{}^$`, r) {
			b.WriteByte('\\')
		}
		b.WriteRune(r)
	}
	return b.String()
}

// postProcessor reads which special tokens wrap a single sequence.
func (t *Tokenizer) postProcessor(m json.RawMessage) error {
	if isNull(m) {
		return nil
	}
	var c component
	if err := json.Unmarshal(m, &c); err != nil {
		return fmt.Errorf("%w: post_processor: %w", ErrFormat, err)
	}
	switch k := c.kind(); k {
	case "ByteLevel":
		return nil // only offsets change
	case "Sequence":
		parts, err := c.list("processors")
		if err != nil {
			return err
		}
		for _, p := range parts {
			b, _ := json.Marshal(p)
			if err := t.postProcessor(b); err != nil {
				return err
			}
		}
		return nil
	case "TemplateProcessing":
		var single []struct {
			SpecialToken *struct {
				ID string `json:"id"`
			} `json:"SpecialToken"`
			Sequence *struct {
				ID string `json:"id"`
			} `json:"Sequence"`
		}
		if err := json.Unmarshal(c["single"], &single); err != nil {
			return fmt.Errorf("%w: TemplateProcessing single: %w", ErrFormat, err)
		}
		var specials map[string]struct {
			IDs []int32 `json:"ids"`
		}
		json.Unmarshal(c["special_tokens"], &specials)
		seen := false
		for _, p := range single {
			switch {
			case p.Sequence != nil:
				seen = true
			case p.SpecialToken != nil:
				st, ok := specials[p.SpecialToken.ID]
				if !ok {
					return fmt.Errorf("%w: TemplateProcessing names %q, which special_tokens lacks", ErrFormat, p.SpecialToken.ID)
				}
				if seen {
					t.suffix = append(t.suffix, st.IDs...)
				} else {
					t.prefix = append(t.prefix, st.IDs...)
				}
			}
		}
		t.AddBOS = len(t.prefix) > 0
		return nil
	default:
		return fmt.Errorf("%w: post_processor %q", ErrUnsupported, k)
	}
}

// decoder is one step of the decoding pipeline over token strings; piece
// says the output continues a sequence (DecodePiece), so steps that only
// concern its start are skipped.
type decoder func(toks []string, piece bool) []string

func decoders(m json.RawMessage) ([]decoder, error) {
	if isNull(m) {
		return nil, nil
	}
	var c component
	if err := json.Unmarshal(m, &c); err != nil {
		return nil, fmt.Errorf("%w: decoder: %w", ErrFormat, err)
	}
	switch k := c.kind(); k {
	case "Sequence":
		parts, err := c.list("decoders")
		if err != nil {
			return nil, err
		}
		var out []decoder
		for _, p := range parts {
			b, _ := json.Marshal(p)
			d, err := decoders(b)
			if err != nil {
				return nil, err
			}
			out = append(out, d...)
		}
		return out, nil
	case "Replace":
		pat, regex, err := c.pattern()
		if err != nil {
			return nil, err
		}
		if regex {
			return nil, fmt.Errorf("%w: Replace decoder with a regex", ErrUnsupported)
		}
		content := c.str("content")
		return []decoder{func(toks []string, _ bool) []string {
			for i, s := range toks {
				toks[i] = strings.ReplaceAll(s, pat, content)
			}
			return toks
		}}, nil
	case "ByteFallback":
		// Runs of <0xAB> tokens become their bytes. Hugging Face replaces
		// a run that is not valid UTF-8 by U+FFFD; Decode does the same on
		// the joined result, DecodePiece keeps the bytes for streaming.
		return []decoder{func(toks []string, _ bool) []string {
			out := toks[:0]
			var run []byte
			for _, s := range toks {
				if b, ok := hexByte(s); ok {
					run = append(run, b)
					continue
				}
				if run != nil {
					out = append(out, string(run))
					run = nil
				}
				out = append(out, s)
			}
			if run != nil {
				out = append(out, string(run))
			}
			return out
		}}, nil
	case "Fuse":
		return []decoder{func(toks []string, _ bool) []string { return []string{strings.Join(toks, "")} }}, nil
	case "Strip":
		content := c.str("content")
		var start, stop int
		json.Unmarshal(c["start"], &start)
		json.Unmarshal(c["stop"], &stop)
		return []decoder{func(toks []string, piece bool) []string {
			if piece {
				return toks
			}
			for i, s := range toks {
				for n := 0; n < start && strings.HasPrefix(s, content) && content != ""; n++ {
					s = s[len(content):]
				}
				for n := 0; n < stop && strings.HasSuffix(s, content) && content != ""; n++ {
					s = s[:len(s)-len(content)]
				}
				toks[i] = s
			}
			return toks
		}}, nil
	case "ByteLevel":
		return []decoder{func(toks []string, _ bool) []string {
			for i, s := range toks {
				toks[i] = fromByteLevel(s)
			}
			return toks
		}}, nil
	case "Metaspace":
		repl := c.str("replacement")
		if repl == "" {
			repl = "▁"
		}
		scheme := c.str("prepend_scheme")
		strip := scheme != "never" && c.boolean("add_prefix_space", true)
		return []decoder{func(toks []string, piece bool) []string {
			for i, s := range toks {
				s = strings.ReplaceAll(s, repl, " ")
				if i == 0 && strip && !piece {
					s = strings.TrimPrefix(s, " ")
				}
				toks[i] = s
			}
			return toks
		}}, nil
	default:
		return nil, fmt.Errorf("%w: decoder %q", ErrUnsupported, k)
	}
}

// GPT-2's byte-to-unicode table: printable bytes stand for themselves, the
// others are shifted to U+0100 and up in byte order, so that every byte is
// a visible character and BPE never sees raw control bytes or spaces.
var byteToRune, runeToByte = func() ([256]rune, map[rune]byte) {
	var fwd [256]rune
	back := map[rune]byte{}
	n := 0
	for b := range 256 {
		if (b >= '!' && b <= '~') || (b >= 0xA1 && b <= 0xAC) || (b >= 0xAE && b <= 0xFF) {
			fwd[b] = rune(b)
		} else {
			fwd[b] = rune(256 + n)
			n++
		}
		back[fwd[b]] = byte(b)
	}
	return fwd, back
}()

func toByteLevel(s string) string {
	var b strings.Builder
	for i := 0; i < len(s); i++ {
		b.WriteRune(byteToRune[s[i]])
	}
	return b.String()
}

// fromByteLevel maps symbols back to bytes; a token with a character
// outside the table (an added token's text) is kept as it is, as Hugging
// Face's decoder does.
func fromByteLevel(s string) string {
	out := make([]byte, 0, len(s))
	for _, r := range s {
		b, ok := runeToByte[r]
		if !ok {
			return s
		}
		out = append(out, b)
	}
	return string(out)
}
