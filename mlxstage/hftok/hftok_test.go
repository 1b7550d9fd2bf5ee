package hftok

import (
	"errors"
	"fmt"
	"slices"
	"strings"
	"sync"
	"testing"

	"github.com/meshnode/meshnode/mlxstage/safetensors"
)

const storiesHF = "../../../shared/models/stories260K-hf"

const qwenPattern = `(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+`

func TestQwenSplit(t *testing.T) {
	sp, err := newSplitter(qwenPattern)
	if err != nil {
		t.Fatal(err)
	}
	for in, want := range map[string][]string{
		"Hello world":    {"Hello", " world"},
		"I'M here":       {"I", "'M", " here"},
		"a  b":           {"a", " ", " b"},
		"a   \n\nb":      {"a", "   \n\n", "b"},
		"x 123":          {"x", " ", "1", "2", "3"},
		"end  ":          {"end", "  "},
		"(hi)!!":         {"(hi", ")!!"},
		"你好，世界":          {"你好", "，世界"},
		"tab\tsep":       {"tab", "\tsep"},
		"a\u3000\u3000b": {"a", "\u3000", "\u3000b"},
		"...\n":          {"...\n"},
		"e\u0301t\u00e9": {"e", "\u0301t\u00e9"}, // a combining mark is not \p{L}
		" \u00a0x":       {" ", "\u00a0x"},
		"":               nil,
	} {
		got, err := sp.split(in, "Isolated", false)
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(got, want) {
			t.Errorf("split(%q) = %q, want %q", in, got, want)
		}
	}
}

func TestSplitBehaviors(t *testing.T) {
	sp, _ := newSplitter("-")
	for b, want := range map[string]string{
		"Isolated":           `["a" "-" "b" "-" "-" "c"]`,
		"Removed":            `["a" "b" "c"]`,
		"MergedWithPrevious": `["a-" "b-" "-" "c"]`,
		"MergedWithNext":     `["a" "-b" "-" "-c"]`,
		"Contiguous":         `["a" "-" "b" "--" "c"]`,
	} {
		got, err := sp.split("a-b--c", b, false)
		if err != nil || fmt.Sprintf("%q", got) != want {
			t.Errorf("%s: %q %v, want %s", b, got, err, want)
		}
	}
	if _, err := sp.split("x", "Sideways", false); !errors.Is(err, ErrUnsupported) {
		t.Errorf("unknown behavior: %v", err)
	}
	if _, err := newSplitter(`a(?=b)`); !errors.Is(err, ErrUnsupported) {
		t.Errorf("lookahead: %v", err)
	}
}

func TestMergeOrder(t *testing.T) {
	ranks := map[pairKey]int{{"a", "b"}: 0, {"b", "c"}: 1, {"ab", "c"}: 2, {"a", "a"}: 3}
	for in, want := range map[string]string{
		"abc":  "[abc]",
		"bc":   "[bc]",
		"abab": "[ab ab]",
		"aaa":  "[aa a]",
		"xbc":  "[x bc]",
		"":     "[]",
	} {
		var syms []string
		for _, r := range in {
			syms = append(syms, string(r))
		}
		if got := fmt.Sprint(merge(syms, ranks)); got != want {
			t.Errorf("merge(%q) = %s, want %s", in, got, want)
		}
	}
}

func TestStoriesRoundTrip(t *testing.T) {
	tok, err := Load(safetensors.Dir(storiesHF), Options{})
	if err != nil {
		t.Fatal(err)
	}
	if !tok.AddBOS || tok.BOS != "<s>" || tok.EOS != "</s>" || !tok.IsEOG(2) || tok.VocabSize() != 512 {
		t.Errorf("bos %q eos %q add %v vocab %d", tok.BOS, tok.EOS, tok.AddBOS, tok.VocabSize())
	}
	ids, err := tok.Encode("Once upon a time", true)
	if err != nil {
		t.Fatal(err)
	}
	if ids[0] != 1 {
		t.Errorf("no BOS: %v", ids)
	}
	for s, want := range map[string]string{
		"Once upon a time, Lily saw a cat.": "Once upon a time, Lily saw a cat.",
		"héllo 你好 🙂":                        "héllo 你好 🙂",
		"  spaced  out  ":                   "  spaced  out  ",
		// The Prepend normalizer runs on each segment between special
		// tokens, so the text after <s> gains a ▁, as in Hugging Face.
		"<s>inside</s>": "<s> inside</s>",
	} {
		ids, _ := tok.Encode(s, false)
		back, err := tok.Decode(ids)
		if err != nil || back != want {
			t.Errorf("round trip of %q gave %q (%v), want %q; ids %v", s, back, err, want, ids)
		}
	}
	// A lone continuation byte is not UTF-8: Decode replaces it, as
	// Hugging Face does; DecodePiece keeps it for the streamer.
	b, _ := tok.lookup("<0x80>")
	if s, _ := tok.Decode([]int32{b}); s != "\uFFFD" {
		t.Errorf("Decode(<0x80>) = %q", s)
	}
	if s, _ := tok.DecodePiece([]int32{b}); s != "\x80" {
		t.Errorf("DecodePiece(<0x80>) = %q", s)
	}
	if _, err := tok.Decode([]int32{9999}); err == nil {
		t.Error("out-of-vocabulary id decoded")
	}
}

// byteLevelJSON is a tiny GPT-2-style tokenizer: byte symbols for a few
// letters and the space, two merges, one special token.
const byteLevelJSON = `{
 "added_tokens": [{"id": 6, "content": "<|end|>", "special": true}],
 "normalizer": null,
 "pre_tokenizer": {"type": "ByteLevel", "add_prefix_space": false, "use_regex": true},
 "post_processor": {"type": "ByteLevel"},
 "decoder": {"type": "ByteLevel"},
 "model": {"type": "BPE", "vocab": {"h": 0, "i": 1, "Ġ": 2, "hi": 3, "Ġhi": 4, "!": 5},
           "merges": ["h i", ["Ġ", "hi"]]}
}`

func TestByteLevel(t *testing.T) {
	tok, err := Parse([]byte(byteLevelJSON), []byte(`{"eos_token": {"content": "<|end|>"}}`), nil, Options{})
	if err != nil {
		t.Fatal(err)
	}
	ids, _ := tok.Encode("hi hi!<|end|>", true)
	if fmt.Sprint(ids) != "[3 4 5 6]" {
		t.Errorf("ids %v", ids)
	}
	if s, _ := tok.Decode(ids); s != "hi hi!<|end|>" {
		t.Errorf("decoded %q", s)
	}
	if !tok.IsEOG(6) || tok.AddBOS {
		t.Error("eos from an AddedToken object")
	}
}

func TestUnsupported(t *testing.T) {
	for name, js := range map[string]string{
		"wordpiece":  `{"model": {"type": "WordPiece", "vocab": {}}}`,
		"normalizer": `{"normalizer": {"type": "BertNormalizer"}, "model": {"type": "BPE", "vocab": {}}}`,
		"pre":        `{"pre_tokenizer": {"type": "BertPreTokenizer"}, "model": {"type": "BPE", "vocab": {}}}`,
		"decoder":    `{"decoder": {"type": "WordPiece"}, "model": {"type": "BPE", "vocab": {}}}`,
		"post":       `{"post_processor": {"type": "RobertaProcessing"}, "model": {"type": "BPE", "vocab": {}}}`,
		"dropout":    `{"model": {"type": "BPE", "vocab": {}, "dropout": 0.1}}`,
	} {
		if _, err := Parse([]byte(js), nil, nil, Options{}); !errors.Is(err, ErrUnsupported) {
			t.Errorf("%s: %v", name, err)
		}
	}
	for name, js := range map[string]string{
		"not json":  `{`,
		"bad merge": `{"model": {"type": "BPE", "vocab": {}, "merges": ["ab"]}}`,
		"bad unk":   `{"model": {"type": "BPE", "vocab": {}, "unk_token": "<unk>"}}`,
		"neg id":    `{"model": {"type": "BPE", "vocab": {"a": -1}}}`,
	} {
		if _, err := Parse([]byte(js), nil, nil, Options{}); !errors.Is(err, ErrFormat) {
			t.Errorf("%s: %v", name, err)
		}
	}
}

func TestMetaspace(t *testing.T) {
	js := `{"pre_tokenizer": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first", "split": true},
	 "decoder": {"type": "Metaspace", "replacement": "▁", "prepend_scheme": "first"},
	 "model": {"type": "BPE", "vocab": {"▁a": 0, "▁b": 1, "▁": 2, "a": 3, "b": 4}, "merges": ["▁ a", "▁ b"]}}`
	tok, err := Parse([]byte(js), nil, nil, Options{})
	if err != nil {
		t.Fatal(err)
	}
	ids, _ := tok.Encode("a b", false)
	if fmt.Sprint(ids) != "[0 1]" {
		t.Errorf("ids %v", ids)
	}
	if s, _ := tok.Decode(ids); s != "a b" {
		t.Errorf("decoded %q", s)
	}
	if s, _ := tok.DecodePiece(ids[1:]); s != " b" {
		t.Errorf("piece %q", s)
	}
}

func TestConcurrentEncode(t *testing.T) {
	tok, err := Load(safetensors.Dir(storiesHF), Options{})
	if err != nil {
		t.Fatal(err)
	}
	want, _ := tok.Encode(strings.Repeat("Lily and Tom played. ", 20), true)
	var wg sync.WaitGroup
	for range 4 {
		wg.Go(func() {
			got, _ := tok.Encode(strings.Repeat("Lily and Tom played. ", 20), true)
			if !slices.Equal(got, want) {
				t.Error("concurrent encodes differ")
			}
		})
	}
	wg.Wait()
}
