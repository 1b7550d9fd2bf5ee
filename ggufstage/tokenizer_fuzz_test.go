package ggufstage

import (
	"path/filepath"
	"sync"
	"testing"
	"unicode/utf8"

	"github.com/meshnode/meshnode/ggufstage/synth"
)

var (
	fuzzToksOnce sync.Once
	fuzzToks     []*Tokenizer
	fuzzToksErr  error
)

// fuzzTokenizers loads a SentencePiece tokenizer (stories260K) and a
// byte-level BPE one (a synth qwen3) once per process.
func fuzzTokenizers(tb testing.TB) []*Tokenizer {
	fuzzToksOnce.Do(func() {
		sp, err := LoadTokenizer(storiesPath)
		if err != nil {
			fuzzToksErr = err
			return
		}
		path := filepath.Join(tb.TempDir(), "q3.gguf")
		if err := synth.Write(path, synth.Tiny("qwen3"), nil); err != nil {
			fuzzToksErr = err
			return
		}
		bpe, err := LoadTokenizer(path)
		if err != nil {
			fuzzToksErr = err
			return
		}
		fuzzToks = []*Tokenizer{sp, bpe}
	})
	if fuzzToksErr != nil {
		tb.Fatal(fuzzToksErr)
	}
	return fuzzToks
}

// FuzzTokenizer: any text encodes without panicking to ids inside the
// vocabulary, and valid UTF-8 without special tokens or C0 control
// characters decodes back to itself (both tokenizers have byte fallback).
// Control characters other than tab and newlines are not guaranteed: the
// GGUF tokenizers drop NUL, as llama.cpp's do (a committed seed records it).
func FuzzTokenizer(f *testing.F) {
	for _, s := range []string{"", "Once upon a time", "héllo wörld 你好 🙂", "<|im_start|>user\nhi<|im_end|>", "\x00\xff\xfe", "  leading", "a\n\nb\tc", "<s></s><unk>"} {
		f.Add(s)
	}
	f.Fuzz(func(t *testing.T, s string) {
		for _, tok := range fuzzTokenizers(t) {
			ids, err := tok.Encode(s, false)
			if err != nil {
				continue // a clear error is fine; a panic is not
			}
			n := int32(len(tok.Vocabulary().Values))
			for _, id := range ids {
				if id < 0 || id >= n {
					t.Fatalf("%q encodes to id %d outside the vocabulary of %d", s, id, n)
				}
			}
			out, err := tok.Decode(ids)
			if err != nil {
				t.Fatalf("decoding the encoding of %q: %v", s, err)
			}
			if utf8.ValidString(s) && !hasControl(s) && out != s && !hasSpecial(tok, s) {
				t.Fatalf("round trip changed %q into %q", s, out)
			}
		}
	})
}

func hasControl(s string) bool {
	for _, r := range s {
		if r < 0x20 && r != '\t' && r != '\n' && r != '\r' {
			return true
		}
	}
	return false
}

func hasSpecial(tok *Tokenizer, s string) bool {
	for _, sp := range tok.Vocabulary().SpecialVocabulary() {
		if sp != "" && len(sp) <= len(s) && contains(s, sp) {
			return true
		}
	}
	return false
}

func contains(s, sub string) bool {
	for i := 0; i+len(sub) <= len(s); i++ {
		if s[i:i+len(sub)] == sub {
			return true
		}
	}
	return false
}

// TestIsSpecial: control and unknown tokens are markup; text tokens and
// byte tokens are not; ids outside the vocabulary are not text either.
func TestIsSpecial(t *testing.T) {
	tok, err := LoadTokenizer(storiesPath)
	if err != nil {
		t.Fatal(err)
	}
	v := tok.Vocabulary()
	text, _ := tok.Encode(" cat", false)
	tests := []struct {
		name string
		id   int32
		want bool
	}{
		{"BOS", v.BOS[0], true},
		{"EOS", v.EOS[0], true},
		{"unknown", 0, true}, // <unk> in llama2.c vocabularies
		{"a word", text[len(text)-1], false},
		{"a byte token", int32(v.Encode("<0x7B>")), false},
		{"past the vocabulary", int32(len(v.Values)), true},
		{"negative", -1, true},
	}
	for _, tt := range tests {
		if got := tok.IsSpecial(tt.id); got != tt.want {
			t.Errorf("%s (id %d): IsSpecial %v, want %v", tt.name, tt.id, got, tt.want)
		}
	}
}
