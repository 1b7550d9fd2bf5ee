package synthst

import (
	"cmp"
	"fmt"
	"path/filepath"
	"slices"
	"strings"

	"github.com/meshnode/meshnode/ggufstage/gguf"
)

// Token types as llama.cpp numbers them in tokenizer.ggml.token_type.
const (
	typeNormal  = 1
	typeUnknown = 2
	typeControl = 3
	typeByte    = 6
)

// Pre-tokenizer patterns of the GGUF tokenizer.ggml.pre values, as the
// upstream tokenizer.json files write them.
var prePatterns = map[string]string{
	"qwen2":     `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`,
	"llama-bpe": `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}{1,3}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`,
}

type addedToken struct {
	ID         int    `json:"id"`
	Content    string `json:"content"`
	SingleWord bool   `json:"single_word"`
	LStrip     bool   `json:"lstrip"`
	RStrip     bool   `json:"rstrip"`
	Normalized bool   `json:"normalized"`
	Special    bool   `json:"special"`
}

func ints(v gguf.Value) []int32 {
	switch x := v.V.(type) {
	case []int32:
		return x
	case []uint32:
		out := make([]int32, len(x))
		for i, u := range x {
			out[i] = int32(u)
		}
		return out
	}
	return nil
}

// writeTokenizer writes tokenizer.json and tokenizer_config.json for the
// GGUF's vocabulary: SentencePiece vocabularies ("llama") become BPE with
// byte fallback and merges derived from the scores, as transformers'
// converter does for Llama; GPT-2 byte-level ones ("gpt2") keep their merges
// and get the pre-tokenizer their tokenizer.ggml.pre names.
func writeTokenizer(dir string, f *gguf.File, h header) error {
	tv, _ := f.Get("tokenizer.ggml.tokens")
	tokens, _ := tv.V.([]string)
	if len(tokens) == 0 {
		return errNoVocab
	}
	typv, _ := f.Get("tokenizer.ggml.token_type")
	types := ints(typv)
	if len(types) != len(tokens) {
		return fmt.Errorf("synthst: %d token types for %d tokens", len(types), len(tokens))
	}
	text := func(key string) any {
		if id, ok := metaUint(f, key); ok && int(id) < len(tokens) {
			return tokens[id]
		}
		return nil
	}
	addBOS := true
	if v, ok := f.Get("tokenizer.ggml.add_bos_token"); ok {
		addBOS, _ = v.V.(bool)
	}
	var added []addedToken
	for id, t := range types {
		if t == typeControl || t == typeUnknown {
			added = append(added, addedToken{ID: id, Content: tokens[id], Special: true})
		}
	}

	var tok map[string]any
	class := ""
	switch model := f.String("tokenizer.ggml.model"); model {
	case "llama":
		tok, class = spmTokenizer(f, tokens, types, added, addBOS), "LlamaTokenizerFast"
	case "gpt2":
		pre := f.String("tokenizer.ggml.pre")
		pat, ok := prePatterns[pre]
		if !ok {
			return fmt.Errorf("synthst: no pre-tokenizer pattern for tokenizer.ggml.pre %q", pre)
		}
		mv, _ := f.Get("tokenizer.ggml.merges")
		merges, _ := mv.V.([]string)
		vocab := map[string]int{}
		for id, t := range tokens {
			if types[id] != typeControl {
				vocab[t] = id
			}
		}
		pairs := make([][2]string, 0, len(merges))
		for _, m := range merges {
			a, b, ok := strings.Cut(m, " ")
			if !ok || a == "" || b == "" {
				return fmt.Errorf("synthst: merge %q is not two symbols", m)
			}
			pairs = append(pairs, [2]string{a, b})
		}
		byteLevel := map[string]any{"type": "ByteLevel", "add_prefix_space": false, "trim_offsets": false, "use_regex": false}
		tok = map[string]any{
			"version": "1.0", "truncation": nil, "padding": nil,
			"added_tokens": added,
			"normalizer":   map[string]any{"type": "NFC"},
			"pre_tokenizer": map[string]any{"type": "Sequence", "pretokenizers": []any{
				map[string]any{"type": "Split", "pattern": map[string]any{"Regex": pat}, "behavior": "Isolated", "invert": false},
				byteLevel,
			}},
			"post_processor": byteLevel,
			"decoder":        map[string]any{"type": "ByteLevel", "add_prefix_space": true, "trim_offsets": true, "use_regex": true},
			"model": map[string]any{
				"type": "BPE", "dropout": nil, "unk_token": nil, "continuing_subword_prefix": nil,
				"end_of_word_suffix": nil, "fuse_unk": false, "byte_fallback": false, "ignore_merges": false,
				"vocab": vocab, "merges": pairs,
			},
		}
		class = "Qwen2TokenizerFast"
	default:
		return fmt.Errorf("synthst: tokenizer model %q is not supported", model)
	}
	if err := writeJSON(filepath.Join(dir, "tokenizer.json"), tok); err != nil {
		return err
	}
	cfg := map[string]any{
		"add_bos_token": addBOS, "add_eos_token": false,
		"bos_token": text("tokenizer.ggml.bos_token_id"), "eos_token": text("tokenizer.ggml.eos_token_id"),
		"unk_token": text("tokenizer.ggml.unknown_token_id"), "pad_token": text("tokenizer.ggml.padding_token_id"),
		"model_max_length": h.ctx, "tokenizer_class": class, "clean_up_tokenization_spaces": false,
	}
	if tmpl := f.String("tokenizer.chat_template"); tmpl != "" {
		cfg["chat_template"] = tmpl
	}
	return writeJSON(filepath.Join(dir, "tokenizer_config.json"), cfg)
}

// spmTokenizer is a SentencePiece vocabulary as a Hugging Face BPE model
// with byte fallback. BPE needs merges where SentencePiece has scores:
// every split of a piece into two pieces of the vocabulary is a merge,
// ranked by the merged piece's score (higher first), so that BPE's
// lowest-rank-first merging replays SentencePiece's highest-score-first.
func spmTokenizer(f *gguf.File, tokens []string, types []int32, added []addedToken, addBOS bool) map[string]any {
	sv, _ := f.Get("tokenizer.ggml.scores")
	scores, _ := sv.V.([]float32)
	vocab := make(map[string]int, len(tokens))
	for id, t := range tokens {
		vocab[t] = id
	}
	normal := func(s string) (int, bool) {
		id, ok := vocab[s]
		return id, ok && types[id] == typeNormal
	}
	type merge struct {
		l, r       string
		id, li, ri int
	}
	var ms []merge
	for id, t := range tokens {
		if types[id] != typeNormal {
			continue
		}
		runes := []rune(t)
		for k := 1; k < len(runes); k++ {
			l, r := string(runes[:k]), string(runes[k:])
			li, okl := normal(l)
			ri, okr := normal(r)
			if okl && okr {
				ms = append(ms, merge{l, r, id, li, ri})
			}
		}
	}
	score := func(id int) float32 {
		if id < len(scores) {
			return scores[id]
		}
		return 0
	}
	slices.SortFunc(ms, func(a, b merge) int {
		return cmp.Or(cmp.Compare(score(b.id), score(a.id)), cmp.Compare(a.id, b.id), cmp.Compare(a.li, b.li), cmp.Compare(a.ri, b.ri))
	})
	pairs := make([][2]string, len(ms))
	for i, m := range ms {
		pairs[i] = [2]string{m.l, m.r}
	}
	unk := any(nil)
	if id, ok := metaUint(f, "tokenizer.ggml.unknown_token_id"); ok && int(id) < len(tokens) {
		unk = tokens[id]
	}
	var post any
	if bos, ok := metaUint(f, "tokenizer.ggml.bos_token_id"); ok && addBOS && int(bos) < len(tokens) {
		b := tokens[bos]
		post = map[string]any{
			"type":   "TemplateProcessing",
			"single": []any{map[string]any{"SpecialToken": map[string]any{"id": b, "type_id": 0}}, map[string]any{"Sequence": map[string]any{"id": "A", "type_id": 0}}},
			"pair": []any{
				map[string]any{"SpecialToken": map[string]any{"id": b, "type_id": 0}}, map[string]any{"Sequence": map[string]any{"id": "A", "type_id": 0}},
				map[string]any{"SpecialToken": map[string]any{"id": b, "type_id": 1}}, map[string]any{"Sequence": map[string]any{"id": "B", "type_id": 1}},
			},
			"special_tokens": map[string]any{b: map[string]any{"id": b, "ids": []uint64{bos}, "tokens": []string{b}}},
		}
	}
	return map[string]any{
		"version": "1.0", "truncation": nil, "padding": nil,
		"added_tokens": added,
		"normalizer": map[string]any{"type": "Sequence", "normalizers": []any{
			map[string]any{"type": "Prepend", "prepend": "▁"},
			map[string]any{"type": "Replace", "pattern": map[string]any{"String": " "}, "content": "▁"},
		}},
		"pre_tokenizer":  nil,
		"post_processor": post,
		"decoder": map[string]any{"type": "Sequence", "decoders": []any{
			map[string]any{"type": "Replace", "pattern": map[string]any{"String": "▁"}, "content": " "},
			map[string]any{"type": "ByteFallback"},
			map[string]any{"type": "Fuse"},
			map[string]any{"type": "Strip", "content": " ", "start": 1, "stop": 0},
		}},
		"model": map[string]any{
			"type": "BPE", "dropout": nil, "unk_token": unk, "continuing_subword_prefix": nil,
			"end_of_word_suffix": nil, "fuse_unk": true, "byte_fallback": true, "ignore_merges": false,
			"vocab": vocab, "merges": pairs,
		},
	}
}
