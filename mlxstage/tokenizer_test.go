package mlxstage

import (
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/meshnode/meshnode/ggufstage"
	"github.com/meshnode/meshnode/ggufstage/synth"
	"github.com/meshnode/meshnode/mlxstage/hftok"
	"github.com/meshnode/meshnode/mlxstage/safetensors"
	"github.com/meshnode/meshnode/mlxstage/synthst"
)

// multilingual covers byte fallback (SentencePiece) and multi-byte symbols
// (byte-level BPE): accents, CJK, Cyrillic, Arabic, Hindi, emoji, digits,
// runs of spaces, tabs and newlines, contractions and punctuation.
var multilingual = []string{
	"Once upon a time, there was a little girl named Lily.",
	"héllo wörld, ça va? Ærøskøbing",
	"你好，世界！今天天气很好。",
	"Привет, мир! Как дела?",
	"مرحبا بالعالم",
	"नमस्ते दुनिया",
	"emoji 🙂👍🏽 and ZWJ 👩‍👩‍👧",
	"  two  spaces,\ttabs\tand\nnew lines\n\n  indented",
	"It's 12345 o'clock; we'll see—they've gone... (really?) [x] {y}",
	"The quick brown fox jumps over the lazy dog 3.14159 1,000,000",
	"trailing space ",
	"x",
}

func TestTokenizerMatchesGGUF(t *testing.T) {
	dir := t.TempDir()
	cases := []struct {
		name, gguf, hf string
		// ollama's SentencePiece omits the ▁ that SentencePiece (and
		// llama.cpp, and the HF normalizer) put before the text, so its
		// input gets the space that becomes that ▁.
		spaceFirst bool
	}{{"stories260K", storiesGGUF, storiesHF, true}}
	for _, arch := range []string{"llama", "qwen2"} {
		g, hf := filepath.Join(dir, arch+".gguf"), filepath.Join(dir, arch+"-hf")
		spec := synth.Tiny(arch)
		spec.Vocab = 2000
		if err := synthst.Write(g, hf, spec, synthst.Options{}); err != nil {
			t.Fatal(err)
		}
		cases = append(cases, struct {
			name, gguf, hf string
			spaceFirst     bool
		}{"synth-" + arch, g, hf, arch == "llama"})
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			gt, err := ggufstage.LoadTokenizer(c.gguf)
			if err != nil {
				t.Fatal(err)
			}
			ht, err := hftok.Load(safetensors.Dir(c.hf), hftok.Options{})
			if err != nil {
				t.Fatal(err)
			}
			if ht.BOS != gt.BOS || ht.EOS != gt.EOS || ht.AddBOS != gt.AddBOS {
				t.Errorf("BOS %q/%q EOS %q/%q AddBOS %v/%v", ht.BOS, gt.BOS, ht.EOS, gt.EOS, ht.AddBOS, gt.AddBOS)
			}
			total := 0
			for _, s := range multilingual {
				in := s
				if c.spaceFirst {
					in = " " + s
				}
				want, err := gt.Encode(in, true)
				if err != nil {
					t.Fatal(err)
				}
				got, err := ht.Encode(s, true)
				if err != nil {
					t.Fatal(err)
				}
				total += len(got)
				if !slices.Equal(got, want) {
					t.Errorf("Encode(%q):\n got %v\nwant %v", s, got, want)
					continue
				}
				// Decode: HF strips the ▁ its normalizer added; the
				// GGUF tokenizer returns it as a space.
				wantText, _ := gt.Decode(want)
				if c.spaceFirst {
					wantText = strings.TrimPrefix(wantText, " ")
				}
				gotText, err := ht.Decode(got)
				if err != nil {
					t.Fatal(err)
				}
				if gotText != wantText {
					t.Errorf("Decode(Encode(%q)) = %q, GGUF tokenizer %q", s, gotText, wantText)
				}
				// Token by token, pieces are what the GGUF tokenizer
				// gives (the scheduler streams this way).
				var pieces strings.Builder
				for _, id := range got {
					p, err := ht.DecodePiece([]int32{id})
					if err != nil {
						t.Fatal(err)
					}
					pieces.WriteString(p)
				}
				whole, _ := gt.Decode(want)
				if pieces.String() != whole {
					t.Errorf("pieces of %q join to %q, GGUF %q", s, pieces.String(), whole)
				}
			}
			t.Logf("%d samples, %d tokens, identical", len(multilingual), total)
		})
	}
}

func TestTokenizerSpecials(t *testing.T) {
	dir := t.TempDir()
	g, hf := filepath.Join(dir, "q.gguf"), filepath.Join(dir, "q-hf")
	if err := synthst.Write(g, hf, synth.Tiny("qwen2"), synthst.Options{}); err != nil {
		t.Fatal(err)
	}
	gt, _ := ggufstage.LoadTokenizer(g)
	ht, err := hftok.Load(safetensors.Dir(hf), hftok.Options{})
	if err != nil {
		t.Fatal(err)
	}
	s := "<|im_start|>user\nhello there<|im_end|>\n<|im_start|>assistant\n"
	want, _ := gt.Encode(s, true)
	got, _ := ht.Encode(s, true)
	if !slices.Equal(got, want) {
		t.Errorf("chat prompt:\n got %v\nwant %v", got, want)
	}
	end := int32(-1)
	for _, id := range got {
		if tok, _ := ht.Token(id); tok == "<|im_end|>" {
			end = id
		}
	}
	if !ht.IsSpecial(end) || !ht.IsEOG(end) || !gt.IsEOG(end) {
		t.Errorf("<|im_end|> (%d): special %v, EOG %v / GGUF %v", end, ht.IsSpecial(end), ht.IsEOG(end), gt.IsEOG(end))
	}
	if ht.ChatTemplate == "" || ht.ChatTemplate != gt.ChatTemplate {
		t.Error("chat template not carried over")
	}
}
