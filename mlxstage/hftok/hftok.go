// Package hftok reads Hugging Face tokenizer.json files (the "tokenizers"
// library's format) and encodes and decodes text with them, for the
// safetensors models mlxstage runs: BPE models, both SentencePiece-style
// (a ▁ word marker and byte fallback, as Llama 2 and TinyStories) and
// GPT-2 byte-level (Qwen, Llama 3, with their pre-tokenizer regex).
//
// What is implemented is the subset of the format those families use:
//
//   - model: BPE (merges as "a b" strings or [a, b] pairs; byte_fallback,
//     unk_token, fuse_unk, ignore_merges);
//   - normalizer: Sequence, Prepend, Replace (string patterns), Lowercase,
//     NFC (applied only through Options.NFC: see there);
//   - pre_tokenizer: Sequence, Split (regex or string; every split
//     behavior), ByteLevel, Metaspace, Digits;
//   - post_processor: TemplateProcessing (special tokens around the
//     sequence), ByteLevel, Sequence;
//   - decoder: Sequence, Replace, ByteFallback, Fuse, Strip, ByteLevel,
//     Metaspace.
//
// Anything else is refused with ErrUnsupported when the file is loaded,
// never silently ignored.
package hftok

import (
	"encoding/json"
	"errors"
	"fmt"
	"slices"
	"strconv"
	"strings"
	"unicode/utf8"

	"github.com/meshnode/meshnode/mlxstage/safetensors"
)

// ErrUnsupported is wrapped when a tokenizer.json uses a part of the format
// this package does not implement.
var ErrUnsupported = errors.New("unsupported tokenizer.json feature")

// ErrFormat is wrapped when a tokenizer.json is not valid.
var ErrFormat = errors.New("malformed tokenizer.json")

// Options adjust loading.
type Options struct {
	// NFC, if set, is Unicode NFC normalization (for instance
	// golang.org/x/text/unicode/norm's NFC.String), used where the
	// tokenizer asks for it (Qwen's do). Without it NFC is the identity,
	// which is exact for text already in NFC (nearly all text) and differs
	// from Hugging Face only on decomposed input (e + U+0301): the standard
	// library has no normalization tables.
	NFC func(string) string
}

// Tokenizer encodes and decodes text. It is safe for concurrent use.
type Tokenizer struct {
	vocab  map[string]int32
	tokens []string // id -> token text, added tokens included
	ranks  map[pairKey]int

	added   []added // longest first, for matching
	special map[int32]bool

	normalize func(string, bool) string // the bool says "first segment"
	pre       func(string, bool) ([]string, error)
	byteLevel bool // pieces go through GPT-2's byte-to-unicode map before BPE

	byteFallback, fuseUnk, ignoreMerges bool
	unk                                 int32 // -1 if none

	prefix, suffix []int32 // what the post-processor adds around a sequence

	decoders []decoder

	// From tokenizer_config.json (and generation_config.json).
	ChatTemplate string
	BOS, EOS     string // texts of the BOS / EOS tokens, for templates
	AddBOS       bool   // Encode with addSpecial adds the BOS
	eog          map[int32]bool
}

type added struct {
	id             int32
	content        string
	lstrip, rstrip bool
	special        bool
}

// Load reads tokenizer.json, and tokenizer_config.json and
// generation_config.json when present, through open.
func Load(open safetensors.Opener, opts Options) (*Tokenizer, error) {
	tj, err := safetensors.ReadFile(open, "tokenizer.json")
	if err != nil {
		return nil, fmt.Errorf("reading tokenizer.json: %w", err)
	}
	cfg, _ := safetensors.ReadFile(open, "tokenizer_config.json")
	gen, _ := safetensors.ReadFile(open, "generation_config.json")
	return Parse(tj, cfg, gen, opts)
}

// raw is the part of tokenizer.json this package reads.
type raw struct {
	AddedTokens []struct {
		ID         int32  `json:"id"`
		Content    string `json:"content"`
		LStrip     bool   `json:"lstrip"`
		RStrip     bool   `json:"rstrip"`
		Special    bool   `json:"special"`
		SingleWord bool   `json:"single_word"`
	} `json:"added_tokens"`
	Normalizer    json.RawMessage `json:"normalizer"`
	PreTokenizer  json.RawMessage `json:"pre_tokenizer"`
	PostProcessor json.RawMessage `json:"post_processor"`
	Decoder       json.RawMessage `json:"decoder"`
	Model         struct {
		Type         string           `json:"type"`
		Vocab        map[string]int32 `json:"vocab"`
		Merges       json.RawMessage  `json:"merges"`
		UnkToken     *string          `json:"unk_token"`
		ByteFallback bool             `json:"byte_fallback"`
		FuseUnk      bool             `json:"fuse_unk"`
		IgnoreMerges bool             `json:"ignore_merges"`
		Prefix       *string          `json:"continuing_subword_prefix"`
		Suffix       *string          `json:"end_of_word_suffix"`
		Dropout      *float64         `json:"dropout"`
	} `json:"model"`
}

// component is the common shape of normalizers, pre-tokenizers,
// post-processors and decoders: a type and its fields.
type component map[string]json.RawMessage

func (c component) kind() string {
	var s string
	json.Unmarshal(c["type"], &s)
	return s
}

func (c component) str(key string) string {
	var s string
	json.Unmarshal(c[key], &s)
	return s
}

func (c component) boolean(key string, def bool) bool {
	b := def
	if v, ok := c[key]; ok {
		json.Unmarshal(v, &b)
	}
	return b
}

func (c component) list(key string) ([]component, error) {
	var out []component
	if err := json.Unmarshal(c[key], &out); err != nil {
		return nil, fmt.Errorf("%w: %s: %w", ErrFormat, key, err)
	}
	return out, nil
}

// pattern reads a {"String": s} or {"Regex": r} pattern.
func (c component) pattern() (s string, regex bool, err error) {
	var p struct {
		String *string `json:"String"`
		Regex  *string `json:"Regex"`
	}
	if err := json.Unmarshal(c["pattern"], &p); err != nil {
		return "", false, fmt.Errorf("%w: pattern: %w", ErrFormat, err)
	}
	switch {
	case p.String != nil:
		return *p.String, false, nil
	case p.Regex != nil:
		return *p.Regex, true, nil
	}
	return "", false, fmt.Errorf("%w: pattern is neither String nor Regex", ErrFormat)
}

func isNull(m json.RawMessage) bool { return len(m) == 0 || string(m) == "null" }

// Parse builds a tokenizer from the bytes of tokenizer.json and, optionally
// (nil to skip), tokenizer_config.json and generation_config.json.
func Parse(tokenizerJSON, configJSON, generationJSON []byte, opts Options) (*Tokenizer, error) {
	var r raw
	if err := json.Unmarshal(tokenizerJSON, &r); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrFormat, err)
	}
	if r.Model.Type != "BPE" {
		return nil, fmt.Errorf("%w: model type %q (only BPE is implemented)", ErrUnsupported, r.Model.Type)
	}
	if (r.Model.Prefix != nil && *r.Model.Prefix != "") || (r.Model.Suffix != nil && *r.Model.Suffix != "") {
		return nil, fmt.Errorf("%w: BPE continuing_subword_prefix / end_of_word_suffix", ErrUnsupported)
	}
	if r.Model.Dropout != nil && *r.Model.Dropout != 0 {
		return nil, fmt.Errorf("%w: BPE dropout", ErrUnsupported)
	}
	t := &Tokenizer{
		vocab: r.Model.Vocab, special: map[int32]bool{}, unk: -1, eog: map[int32]bool{},
		byteFallback: r.Model.ByteFallback, fuseUnk: r.Model.FuseUnk, ignoreMerges: r.Model.IgnoreMerges,
	}
	if t.vocab == nil {
		t.vocab = map[string]int32{}
	}
	size := 0
	for s, id := range t.vocab {
		if id < 0 || id > 1<<24 {
			return nil, fmt.Errorf("%w: token %q has id %d", ErrFormat, s, id)
		}
		size = max(size, int(id)+1)
	}
	for _, a := range r.AddedTokens {
		if a.ID < 0 || a.ID > 1<<24 || a.Content == "" {
			return nil, fmt.Errorf("%w: added token %q with id %d", ErrFormat, a.Content, a.ID)
		}
		if a.SingleWord {
			return nil, fmt.Errorf("%w: single_word added token %q", ErrUnsupported, a.Content)
		}
		size = max(size, int(a.ID)+1)
		t.added = append(t.added, added{a.ID, a.Content, a.LStrip, a.RStrip, a.Special})
		if a.Special {
			t.special[a.ID] = true
		}
	}
	// Longest first, so that a token that is a prefix of another (<|im|>
	// and <|im_start|>) does not win where the longer one matches.
	slices.SortStableFunc(t.added, func(a, b added) int { return len(b.content) - len(a.content) })
	t.tokens = make([]string, size)
	for s, id := range t.vocab {
		t.tokens[id] = s
	}
	for _, a := range t.added {
		t.tokens[a.id] = a.content
	}
	if r.Model.UnkToken != nil {
		id, ok := t.lookup(*r.Model.UnkToken)
		if !ok {
			return nil, fmt.Errorf("%w: unk_token %q is not in the vocabulary", ErrFormat, *r.Model.UnkToken)
		}
		t.unk = id
	}
	var err error
	if t.ranks, err = parseMerges(r.Model.Merges); err != nil {
		return nil, err
	}
	if t.normalize, err = normalizer(r.Normalizer, opts); err != nil {
		return nil, err
	}
	if t.pre, t.byteLevel, err = preTokenizer(r.PreTokenizer); err != nil {
		return nil, err
	}
	if err := t.postProcessor(r.PostProcessor); err != nil {
		return nil, err
	}
	if t.decoders, err = decoders(r.Decoder); err != nil {
		return nil, err
	}
	if configJSON != nil {
		if err := t.readConfig(configJSON); err != nil {
			return nil, err
		}
	}
	if generationJSON != nil {
		var g struct {
			EOS json.RawMessage `json:"eos_token_id"`
		}
		if json.Unmarshal(generationJSON, &g) == nil {
			for _, id := range ids(g.EOS) {
				t.eog[id] = true
			}
		}
	}
	return t, nil
}

// ids reads a token id field: a number or a list of numbers.
func ids(m json.RawMessage) []int32 {
	var one int32
	if json.Unmarshal(m, &one) == nil {
		return []int32{one}
	}
	var many []int32
	json.Unmarshal(m, &many)
	return many
}

func parseMerges(m json.RawMessage) (map[pairKey]int, error) {
	ranks := map[pairKey]int{}
	if isNull(m) {
		return ranks, nil
	}
	var list []json.RawMessage
	if err := json.Unmarshal(m, &list); err != nil {
		return nil, fmt.Errorf("%w: merges: %w", ErrFormat, err)
	}
	for i, e := range list {
		var k pairKey
		var s string
		var pair []string
		switch {
		case json.Unmarshal(e, &s) == nil:
			a, b, ok := strings.Cut(s, " ")
			if !ok {
				return nil, fmt.Errorf("%w: merge %q is not two symbols", ErrFormat, s)
			}
			k = pairKey{a, b}
		case json.Unmarshal(e, &pair) == nil && len(pair) == 2:
			k = pairKey{pair[0], pair[1]}
		default:
			return nil, fmt.Errorf("%w: merge %d is %s", ErrFormat, i, e)
		}
		if _, dup := ranks[k]; !dup {
			ranks[k] = i
		}
	}
	return ranks, nil
}

// lookup finds a token's id, added tokens included.
func (t *Tokenizer) lookup(s string) (int32, bool) {
	if id, ok := t.vocab[s]; ok {
		return id, true
	}
	for _, a := range t.added {
		if a.content == s {
			return a.id, true
		}
	}
	return -1, false
}

// HasToken reports whether s is one token of the vocabulary.
func (t *Tokenizer) HasToken(s string) bool {
	_, ok := t.lookup(s)
	return ok
}

// VocabSize is the number of token ids.
func (t *Tokenizer) VocabSize() int { return len(t.tokens) }

// Token is the text of a token id as the vocabulary spells it.
func (t *Tokenizer) Token(id int32) (string, bool) {
	if id < 0 || int(id) >= len(t.tokens) {
		return "", false
	}
	return t.tokens[id], true
}

// IsSpecial reports whether id is a special added token.
func (t *Tokenizer) IsSpecial(id int32) bool { return t.special[id] }

// IsEOG reports whether id ends generation: the EOS token, or one of
// generation_config.json's eos_token_id.
func (t *Tokenizer) IsEOG(id int32) bool { return t.eog[id] }

// readConfig takes the chat template and the BOS/EOS settings from
// tokenizer_config.json.
func (t *Tokenizer) readConfig(b []byte) error {
	var c struct {
		AddBOS       *bool           `json:"add_bos_token"`
		BOS          json.RawMessage `json:"bos_token"`
		EOS          json.RawMessage `json:"eos_token"`
		ChatTemplate json.RawMessage `json:"chat_template"`
	}
	if err := json.Unmarshal(b, &c); err != nil {
		return fmt.Errorf("%w: tokenizer_config.json: %w", ErrFormat, err)
	}
	t.BOS, t.EOS = tokenText(c.BOS), tokenText(c.EOS)
	if c.AddBOS != nil && !*c.AddBOS && t.AddBOS {
		// transformers rebuilds the post-processor from this flag when it
		// loads the tokenizer, so an explicit false drops the BOS the
		// tokenizer.json template adds.
		t.prefix, t.AddBOS = nil, false
	}
	if id, ok := t.lookup(t.EOS); ok && t.EOS != "" {
		t.eog[id] = true
	}
	var s string
	if json.Unmarshal(c.ChatTemplate, &s) == nil {
		t.ChatTemplate = s
		return nil
	}
	// A list of named templates: the default one, else the first.
	var named []struct {
		Name     string `json:"name"`
		Template string `json:"template"`
	}
	if json.Unmarshal(c.ChatTemplate, &named) == nil {
		for _, n := range named {
			if n.Name == "default" || t.ChatTemplate == "" {
				t.ChatTemplate = n.Template
			}
		}
	}
	return nil
}

// tokenText reads a token given as a string or as {"content": ...}.
func tokenText(m json.RawMessage) string {
	var s string
	if json.Unmarshal(m, &s) == nil {
		return s
	}
	var o struct {
		Content string `json:"content"`
	}
	json.Unmarshal(m, &o)
	return o.Content
}

// Encode turns text into token ids; addSpecial adds what the post-processor
// adds (Llama's BOS).
func (t *Tokenizer) Encode(text string, addSpecial bool) ([]int32, error) {
	var out []int32
	if addSpecial {
		out = append(out, t.prefix...)
	}
	first := true
	for _, seg := range t.splitAdded(text) {
		if seg.id >= 0 {
			out = append(out, seg.id)
			continue
		}
		norm := t.normalize(seg.text, first)
		first = false
		pieces, err := t.pre(norm, seg.start)
		if err != nil {
			return nil, err
		}
		for _, p := range pieces {
			out = t.encodeWord(p, out)
		}
	}
	if addSpecial {
		out = append(out, t.suffix...)
	}
	return out, nil
}

// segment is a run of text between added tokens, or one added token.
type segment struct {
	text  string
	id    int32 // >= 0 for an added token
	start bool  // the segment starts the input
}

// splitAdded cuts the input at added tokens, honouring their lstrip and
// rstrip (which swallow the white space beside them).
func (t *Tokenizer) splitAdded(s string) []segment {
	var out []segment
	emit := func(text string, start bool) {
		if text != "" {
			out = append(out, segment{text: text, id: -1, start: start})
		}
	}
	from := 0
	for i := 0; i < len(s); {
		var hit *added
		for j := range t.added {
			if strings.HasPrefix(s[i:], t.added[j].content) {
				hit = &t.added[j]
				break
			}
		}
		if hit == nil {
			_, size := utf8.DecodeRuneInString(s[i:])
			i += size
			continue
		}
		before := s[from:i]
		if hit.lstrip {
			before = strings.TrimRightFunc(before, isSpace)
		}
		emit(before, from == 0)
		out = append(out, segment{id: hit.id})
		i += len(hit.content)
		if hit.rstrip {
			for i < len(s) {
				r, size := utf8.DecodeRuneInString(s[i:])
				if !isSpace(r) {
					break
				}
				i += size
			}
		}
		from = i
	}
	emit(s[from:], from == 0)
	return out
}

// encodeWord runs BPE on one pre-tokenized piece and appends its ids.
func (t *Tokenizer) encodeWord(piece string, out []int32) []int32 {
	if piece == "" {
		return out
	}
	if t.byteLevel {
		piece = toByteLevel(piece)
	}
	if t.ignoreMerges {
		if id, ok := t.vocab[piece]; ok {
			return append(out, id)
		}
	}
	var syms []string
	for _, r := range piece {
		syms = append(syms, string(r))
	}
	lastUnk := false
	for _, s := range merge(syms, t.ranks) {
		if id, ok := t.vocab[s]; ok {
			out = append(out, id)
			lastUnk = false
			continue
		}
		if t.byteFallback {
			ok := true
			var bytes []int32
			for _, b := range []byte(s) {
				id, found := t.vocab[fmt.Sprintf("<0x%02X>", b)]
				if !found {
					ok = false
					break
				}
				bytes = append(bytes, id)
			}
			if ok {
				out = append(out, bytes...)
				lastUnk = false
				continue
			}
		}
		if t.unk >= 0 && !(t.fuseUnk && lastUnk) {
			out = append(out, t.unk)
		}
		lastUnk = true
	}
	return out
}

// Decode turns ids into text as Hugging Face's decode does (special tokens
// kept): the decoder pipeline runs, and byte sequences that are not valid
// UTF-8 become U+FFFD.
func (t *Tokenizer) Decode(ids []int32) (string, error) {
	pieces, err := t.decode(ids, false)
	if err != nil {
		return "", err
	}
	return strings.ToValidUTF8(strings.Join(pieces, ""), "\uFFFD"), nil
}

// DecodePiece is the text ids contribute in the middle of a sequence, for
// streaming: the decoder pipeline without its sequence-start steps (the
// Strip of the ▁ a SentencePiece normalizer prepends, Metaspace's leading
// space), and bytes left as they are, so that a multi-byte character split
// over tokens arrives whole once its last byte does (node/text.Stream
// buffers the partial one).
func (t *Tokenizer) DecodePiece(ids []int32) (string, error) {
	pieces, err := t.decode(ids, true)
	if err != nil {
		return "", err
	}
	return strings.Join(pieces, ""), nil
}

func (t *Tokenizer) decode(ids []int32, piece bool) ([]string, error) {
	toks := make([]string, len(ids))
	for i, id := range ids {
		s, ok := t.Token(id)
		if !ok {
			return nil, fmt.Errorf("hftok: token id %d outside the vocabulary of %d", id, len(t.tokens))
		}
		toks[i] = s
	}
	// As in Hugging Face's decode, the decoder pipeline sees every token,
	// added ones included.
	for _, d := range t.decoders {
		toks = d(toks, piece)
	}
	return toks, nil
}

// hexByte parses a byte-fallback token "<0xAB>".
func hexByte(s string) (byte, bool) {
	if len(s) != 6 || !strings.HasPrefix(s, "<0x") || s[5] != '>' {
		return 0, false
	}
	v, err := strconv.ParseUint(s[3:5], 16, 8)
	return byte(v), err == nil
}
