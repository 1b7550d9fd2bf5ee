package ggufstage

import (
	"fmt"

	"github.com/ollama/ollama/model"
	"github.com/ollama/ollama/tokenizer"
)

// Tokenizer is a model's tokenizer built from its GGUF metadata
// (SentencePiece or byte-level BPE, as the file says), plus what a server
// needs around it: the chat template and the special tokens' text.
type Tokenizer struct {
	tokenizer.Tokenizer
	ChatTemplate string
	BOS, EOS     string // text of the first BOS / EOS token, for templates
	AddBOS       bool
}

// LoadTokenizer reads the tokenizer of a GGUF file (a whole model or any
// slice: every slice keeps the full metadata).
func LoadTokenizer(path string) (t *Tokenizer, err error) {
	defer recoverErr(&err, "loading tokenizer of "+path)
	meta, err := readHeader(path)
	if err != nil {
		return nil, err
	}
	if err := checkArch(meta.Arch()); err != nil {
		return nil, fmt.Errorf("loading tokenizer of %s: %w", path, err)
	}
	tp, err := model.NewTextProcessor(path)
	if err != nil {
		return nil, fmt.Errorf("loading tokenizer of %s: %w", path, err)
	}
	t = &Tokenizer{Tokenizer: tp, ChatTemplate: meta.String("tokenizer.chat_template")}
	v := tp.Vocabulary()
	if len(v.BOS) > 0 && v.BOS[0] >= 0 && int(v.BOS[0]) < len(v.Values) {
		t.BOS = v.Values[v.BOS[0]]
	}
	if len(v.EOS) > 0 && v.EOS[0] >= 0 && int(v.EOS[0]) < len(v.Values) {
		t.EOS = v.Values[v.EOS[0]]
	}
	t.AddBOS = v.AddBOS
	return t, nil
}

// IsEOG reports whether id ends generation.
func (t *Tokenizer) IsEOG(id int32) bool { return t.Is(id, tokenizer.SpecialEOS) }

// IsSpecial reports a control or unknown token (BOS, <unk>, …), or an id
// outside the vocabulary: tokens whose text is markup, not output.
func (t *Tokenizer) IsSpecial(id int32) bool {
	v := t.Vocabulary()
	if id < 0 || int(id) >= len(v.Types) {
		return true
	}
	switch v.Types[id] {
	case tokenizer.TOKEN_TYPE_CONTROL, tokenizer.TOKEN_TYPE_UNKNOWN:
		return true
	}
	return false
}

// HasToken reports whether s is a token of the vocabulary.
func (t *Tokenizer) HasToken(s string) bool {
	v := t.Vocabulary()
	return v.Encode(s) >= 0
}
