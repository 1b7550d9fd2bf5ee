package synth

import (
	"bytes"
	"cmp"
	"context"
	"fmt"
	"io"
	"math"
	"os"
	"path/filepath"
	"regexp"
	"slices"
	"testing"
	"time"

	fsggml "github.com/ollama/ollama/fs/ggml"
	"github.com/ollama/ollama/ml"
	"github.com/ollama/ollama/model"
	"github.com/ollama/ollama/model/input"
	_ "github.com/ollama/ollama/model/models/llama"
	_ "github.com/ollama/ollama/model/models/qwen2"
	_ "github.com/ollama/ollama/model/models/qwen3"
	"github.com/ollama/ollama/tokenizer"

	"github.com/meshnode/meshnode/stage/stagetest"
)

var testArchs = []string{"llama", "qwen2", "qwen3"}

// samples must survive Encode→Decode unchanged; the first needs byte
// fallback (llama) or multi-byte symbols (gpt2).
var samples = []string{
	"héllo wörld 你好 🙂",
	"The quick brown fox jumps over the lazy dog.",
	"  two  spaces, tabs\tand\nnew lines; ¿qué? 12345 Ω",
	"people of the world",
}

func decodeFile(t *testing.T, path string) *fsggml.GGML {
	t.Helper()
	f, err := os.Open(path)
	if err != nil {
		t.Fatal(err)
	}
	defer f.Close()
	g, err := fsggml.Decode(f, -1)
	if err != nil {
		t.Fatalf("decode %s: %v", path, err)
	}
	return g
}

// checkHeader verifies a decoded file against the spec it was written from.
func checkHeader(t *testing.T, g *fsggml.GGML, spec Spec) {
	t.Helper()
	s, a, err := spec.normalize()
	if err != nil {
		t.Fatal(err)
	}
	kv := g.KV()
	wantU := map[string]uint32{
		"block_count":             uint32(s.Layers),
		"embedding_length":        uint32(s.Embd),
		"feed_forward_length":     uint32(s.FFN),
		"context_length":          uint32(s.Context),
		"attention.head_count":    uint32(s.Heads),
		"attention.head_count_kv": uint32(s.KVHeads),
	}
	if kv.Architecture() != s.Arch {
		t.Errorf("architecture %q, want %q", kv.Architecture(), s.Arch)
	}
	for k, want := range wantU {
		if got := kv.Uint(k); got != want {
			t.Errorf("%s = %d, want %d", k, got, want)
		}
	}
	if got := kv.Float("attention.layer_norm_rms_epsilon"); got != a.eps {
		t.Errorf("eps %g, want %g", got, a.eps)
	}
	if got := kv.Float("rope.freq_base"); got != s.RopeBase || got == 0 {
		t.Errorf("rope.freq_base %g, want %g", got, s.RopeBase)
	}
	ft, _ := s.Type.llamaFileType()
	if kv.FileType() != ft && !(ft == fsggml.FileTypeF32 && kv.FileType() == fsggml.FileTypeUnknown) {
		t.Errorf("file type %v, want %v", kv.FileType(), ft)
	}
	if _, ok := kv["general.quantization_version"]; ok != s.Type.quantized() {
		t.Errorf("quantization_version present=%v for %v", ok, s.Type)
	}
	if got := kv.String("general.name"); got != s.Name {
		t.Errorf("name %q, want %q", got, s.Name)
	}
	if got := kv.Uint("attention.key_length"); got != 0 && got != uint32(s.HeadDim) {
		t.Errorf("key_length %d, want %d", got, s.HeadDim)
	}
	if s.Arch == "qwen3" && kv.Uint("attention.key_length") != uint32(s.HeadDim) {
		t.Errorf("qwen3 needs key_length")
	}
	if s.Arch == "llama" && kv.Uint("rope.dimension_count") != uint32(s.HeadDim) {
		t.Errorf("llama rope.dimension_count %d, want %d", kv.Uint("rope.dimension_count"), s.HeadDim)
	}

	toks := kv.Strings("tokenizer.ggml.tokens")
	types := kv.Ints("tokenizer.ggml.token_type")
	if len(toks) != s.Vocab || len(types) != s.Vocab {
		t.Errorf("%d tokens, %d types, want %d", len(toks), len(types), s.Vocab)
	}
	if len(slices.Compact(slices.Sorted(slices.Values(toks)))) != len(toks) {
		t.Errorf("duplicate tokens")
	}
	if a.bpe {
		if kv.String("tokenizer.ggml.model") != "gpt2" || kv.String("tokenizer.ggml.pre") != "qwen2" {
			t.Errorf("tokenizer %q/%q", kv.String("tokenizer.ggml.model"), kv.String("tokenizer.ggml.pre"))
		}
		if eos := kv.Uint("tokenizer.ggml.eos_token_id"); toks[eos] != "<|im_end|>" || types[eos] != tokControl {
			t.Errorf("eos %d = %q", eos, toks[eos])
		}
		if kv.Bool("tokenizer.ggml.add_bos_token", true) {
			t.Errorf("qwen must not add BOS")
		}
		if len(kv.Strings("tokenizer.ggml.merges")) < s.Vocab-minVocabBPE {
			t.Errorf("%d merges", len(kv.Strings("tokenizer.ggml.merges")))
		}
	} else {
		if kv.String("tokenizer.ggml.model") != "llama" {
			t.Errorf("tokenizer %q", kv.String("tokenizer.ggml.model"))
		}
		if toks[1] != "<s>" || toks[2] != "</s>" || toks[3] != "<0x00>" || toks[258] != "<0xFF>" || types[258] != tokByte {
			t.Errorf("bad llama specials/bytes: %q", toks[:5])
		}
		if len(kv.Floats("tokenizer.ggml.scores")) != s.Vocab {
			t.Errorf("scores missing")
		}
	}
	if kv.String("tokenizer.chat_template") == "" {
		t.Errorf("no chat template")
	}

	// The tensor table must be exactly the plan, and the plan must follow
	// llama.cpp's naming: check a few shapes independently.
	_, want, _ := plan(spec)
	got := g.Tensors().Items()
	if len(got) != len(want) {
		t.Fatalf("%d tensors, want %d", len(got), len(want))
	}
	byName := map[string]*fsggml.Tensor{}
	for _, tt := range got {
		byName[tt.Name] = tt
	}
	for _, w := range want {
		tt := byName[w.name]
		if tt == nil || !slices.Equal(tt.Shape, w.shape) || tt.Kind != uint32(w.kind) {
			t.Errorf("tensor %s = %+v, want shape %v kind %v", w.name, tt, w.shape, w.kind)
		}
	}
	E, V, F := uint64(s.Embd), uint64(s.Vocab), uint64(s.FFN)
	D := uint64(s.HeadDim)
	shapes := map[string][]uint64{
		"token_embd.weight":                               {E, V},
		"output_norm.weight":                              {E},
		"blk.0.attn_q.weight":                             {E, uint64(s.Heads) * D},
		"blk.0.attn_k.weight":                             {E, uint64(s.KVHeads) * D},
		"blk.0.attn_output.weight":                        {uint64(s.Heads) * D, E},
		"blk.0.ffn_down.weight":                           {F, E},
		"blk.0.ffn_norm.weight":                           {E},
		fmt.Sprintf("blk.%d.ffn_gate.weight", s.Layers-1): {E, F},
	}
	if !s.Tied {
		shapes["output.weight"] = []uint64{E, V}
	} else if byName["output.weight"] != nil {
		t.Errorf("tied model has output.weight")
	}
	if a.qkvBias {
		shapes["blk.0.attn_k.bias"] = []uint64{uint64(s.KVHeads) * D}
	}
	if a.qkNorm {
		shapes["blk.0.attn_q_norm.weight"] = []uint64{D}
	}
	for name, shape := range shapes {
		if tt := byName[name]; tt == nil || !slices.Equal(tt.Shape, shape) {
			t.Errorf("%s: %+v, want shape %v", name, tt, shape)
		}
	}
	for _, tt := range got {
		if len(tt.Shape) == 1 && tt.Kind != uint32(fsggml.TensorTypeF32) {
			t.Errorf("%s is %s, vectors must be F32", tt.Name, fsggml.TensorType(tt.Kind))
		}
	}
}

func checkTokenizer(t *testing.T, tp tokenizer.Tokenizer, spec Spec) {
	t.Helper()
	for _, s := range samples {
		ids, err := tp.Encode(s, false)
		if err != nil {
			t.Fatal(err)
		}
		back, err := tp.Decode(ids)
		if err != nil {
			t.Fatal(err)
		}
		if back != s {
			t.Errorf("round trip %q -> %v -> %q", s, ids, back)
		}
		for _, id := range ids {
			if id < 0 || int(id) >= spec.Vocab {
				t.Errorf("id %d out of range", id)
			}
		}
	}
	// The most common words must be single tokens, even in a tiny vocabulary.
	ids, _ := tp.Encode(" of the and to in", false)
	if len(ids) != 5 {
		t.Errorf("common words split into %d tokens: %v", len(ids), ids)
	}
	withSpecial, _ := tp.Encode("hello", true)
	plain, _ := tp.Encode("hello", false)
	if archs[spec.Arch].bpe {
		if len(withSpecial) != len(plain) {
			t.Errorf("gpt2 tokenizer added specials: %v", withSpecial)
		}
		ids, _ := tp.Encode("<|im_start|>user\nhi<|im_end|>", false)
		v := tp.Vocabulary()
		if len(ids) < 2 || v.Values[ids[0]] != "<|im_start|>" || v.Values[ids[len(ids)-1]] != "<|im_end|>" || !tp.Is(ids[len(ids)-1], tokenizer.SpecialEOS) {
			t.Errorf("ChatML control tokens not recognized: %v", ids)
		}
	} else if len(withSpecial) != len(plain)+1 || withSpecial[0] != 1 {
		t.Errorf("llama tokenizer must prepend BOS: %v", withSpecial)
	}
}

// session runs a model the way ollama's runner does: one sequence, KV
// cache, a batch per step, logits for the last position only.
type session struct {
	m   model.Model
	pos int32
}

func openSession(t *testing.T, path string) *session {
	t.Helper()
	// One thread: ggml's workers spin at every op barrier, so with two
	// threads on a busy two-core machine a tiny model runs ~100x slower.
	m, err := model.New(path, ml.BackendParams{AllocMemory: true, NumThreads: 1})
	if err != nil {
		t.Fatalf("model.New: %v", err)
	}
	b := m.Backend()
	t.Cleanup(b.Close)
	if err := b.Load(context.Background(), nil); err != nil {
		t.Fatalf("load: %v", err)
	}
	cache := m.Config().Cache
	cache.Init(b, ml.DTypeF16, 1, 256, 64)
	t.Cleanup(cache.Close)
	return &session{m: m}
}

func (s *session) step(t *testing.T, tokens []int32) []float32 {
	t.Helper()
	ctx := s.m.Backend().NewContext()
	defer ctx.Close()
	n := len(tokens)
	batch := input.Batch{
		Inputs:    ctx.Input().FromInts(tokens, n),
		Positions: make([]int32, n),
		Sequences: make([]int, n),
		Outputs:   ctx.Input().FromInts([]int32{int32(n - 1)}, 1),
	}
	for i := range batch.Positions {
		batch.Positions[i] = s.pos + int32(i)
	}
	out, err := model.Forward(ctx, s.m, batch)
	if err != nil {
		t.Fatalf("forward: %v", err)
	}
	ctx.Compute(out)
	s.pos += int32(n)
	return out.Floats()
}

func checkLogits(t *testing.T, logits []float32, vocab int) {
	t.Helper()
	if len(logits) != vocab {
		t.Fatalf("%d logits, want %d", len(logits), vocab)
	}
	lo, hi := float32(math.Inf(1)), float32(math.Inf(-1))
	for _, v := range logits {
		if math.IsNaN(float64(v)) || math.IsInf(float64(v), 0) {
			t.Fatalf("non-finite logit %v", v)
		}
		lo, hi = min(lo, v), max(hi, v)
	}
	if hi-lo < 1e-3 {
		t.Fatalf("degenerate logits: range [%g, %g]", lo, hi)
	}
}

func TestTiny(t *testing.T) {
	for _, arch := range testArchs {
		for _, ft := range FileTypes {
			t.Run(arch+"/"+ft.String(), func(t *testing.T) {
				spec := Tiny(arch)
				spec.Type = ft
				path := filepath.Join(t.TempDir(), "m.gguf")
				if err := Write(path, spec, nil); err != nil {
					t.Fatal(err)
				}
				st, err := os.Stat(path)
				if err != nil {
					t.Fatal(err)
				}
				if st.Size() != Size(spec) {
					t.Errorf("file is %d bytes, Size says %d", st.Size(), Size(spec))
				}
				g := decodeFile(t, path)
				checkHeader(t, g, spec)
				if ft == Q4_K {
					kinds := map[fsggml.TensorType]bool{}
					for _, tt := range g.Tensors().Items() {
						kinds[fsggml.TensorType(tt.Kind)] = true
					}
					if !kinds[fsggml.TensorTypeQ4_K] || !kinds[fsggml.TensorTypeQ6_K] {
						t.Errorf("Q4_K_M mix lacks Q4_K/Q6_K: %v", kinds)
					}
				}

				tp, err := model.NewTextProcessor(path)
				if err != nil {
					t.Fatal(err)
				}
				checkTokenizer(t, tp, spec)

				prompt, err := tp.Encode("the world", true)
				if err != nil {
					t.Fatal(err)
				}
				s := openSession(t, path)
				logits := s.step(t, prompt)
				checkLogits(t, logits, spec.Vocab)

				// Greedy decoding must wander over the vocabulary rather
				// than lock onto one token.
				seen := map[int32]bool{}
				next := stagetest.Argmax(logits)
				for range 12 {
					seen[next] = true
					logits = s.step(t, []int32{next})
					checkLogits(t, logits, spec.Vocab)
					next = stagetest.Argmax(logits)
				}
				if len(seen) < 4 {
					t.Errorf("greedy decoding visited only %v", seen)
				}
			})
		}
	}
}

func TestDeterministic(t *testing.T) {
	dir := t.TempDir()
	write := func(name string, seed uint64) []byte {
		spec := Tiny("qwen3")
		spec.Type = Q4_K
		spec.Seed = seed
		path := filepath.Join(dir, name)
		if err := Write(path, spec, nil); err != nil {
			t.Fatal(err)
		}
		b, err := os.ReadFile(path)
		if err != nil {
			t.Fatal(err)
		}
		return b
	}
	a, b, c := write("a.gguf", 7), write("b.gguf", 7), write("c.gguf", 8)
	if !bytes.Equal(a, b) {
		t.Error("same seed wrote different files")
	}
	if bytes.Equal(a, c) || len(a) != len(c) {
		t.Error("different seeds should change only the weights")
	}
	entries, _ := os.ReadDir(dir)
	if len(entries) != 3 {
		t.Errorf("temp files left behind: %v", entries)
	}
}

func TestProgress(t *testing.T) {
	spec := Tiny("llama")
	spec.Type = Q8_0
	var last, total, calls int64
	err := Write(filepath.Join(t.TempDir(), "m.gguf"), spec, func(done, tot int64) {
		if done < last || (total != 0 && tot != total) {
			t.Errorf("progress went %d/%d -> %d/%d", last, total, done, tot)
		}
		last, total = done, tot
		calls++
	})
	if err != nil {
		t.Fatal(err)
	}
	if calls == 0 || last != total || total <= 0 || total >= Size(spec) {
		t.Errorf("progress ended at %d/%d after %d calls (file %d)", last, total, calls, Size(spec))
	}
}

func TestInvalid(t *testing.T) {
	bad := []func(*Spec){
		func(s *Spec) { s.Arch = "gpt-j" },
		func(s *Spec) { s.Layers = 0 },
		func(s *Spec) { s.KVHeads = 3 },
		func(s *Spec) { s.Heads = 3 },
		func(s *Spec) { s.Vocab = 100 },
		func(s *Spec) { s.Type = FileType(fsggml.TensorTypeQ5_1) },
		func(s *Spec) { s.HeadDim = 7 },
	}
	for i, f := range bad {
		spec := Tiny("llama")
		f(&spec)
		if Size(spec) != -1 {
			t.Errorf("case %d: Size accepted %+v", i, spec)
		}
		path := filepath.Join(t.TempDir(), "m.gguf")
		if err := Write(path, spec, nil); err == nil {
			t.Errorf("case %d: Write accepted %+v", i, spec)
		}
		if _, err := os.Stat(path); !os.IsNotExist(err) {
			t.Errorf("case %d: file created", i)
		}
	}
}

// TestBigHeaders writes only the metadata and tensor table of the big presets
// into a sparse file of the full Size, then reads it back with ollama's
// decoder and tokenizer: the table must be llama.cpp's and fit Size exactly.
func TestBigHeaders(t *testing.T) {
	for _, arch := range testArchs {
		for _, spec := range []Spec{OneB(arch), func() Spec { s := OneB(arch); s.Type = F16; return s }()} {
			t.Run(arch+"/"+spec.Type.String(), func(t *testing.T) {
				kv, specs, err := plan(spec)
				if err != nil {
					t.Fatal(err)
				}
				ts := make([]*fsggml.Tensor, len(specs))
				for i, s := range specs {
					ts[i] = &fsggml.Tensor{Name: s.name, Kind: uint32(s.kind), Shape: s.shape, WriterTo: headerOnly{}}
				}
				path := filepath.Join(t.TempDir(), "m.gguf")
				f, err := os.Create(path)
				if err != nil {
					t.Fatal(err)
				}
				if err := fsggml.WriteGGUF(f, kv, ts); err != nil {
					t.Fatal(err)
				}
				size := Size(spec)
				if err := f.Truncate(size); err != nil {
					t.Fatal(err)
				}
				f.Close()

				g := decodeFile(t, path)
				checkHeader(t, g, spec)
				var end uint64
				for _, tt := range g.Tensors().Items() {
					end = max(end, g.Tensors().Offset+tt.Offset+tt.Size())
				}
				if int64(end) != size {
					t.Errorf("tensors end at %d, Size says %d", end, size)
				}
				params := g.KV().ParameterCount()
				if params < 1.0e9 || params > 1.25e9 {
					t.Errorf("%d parameters for a 1B spec", params)
				}
				kinds := map[string]fsggml.TensorType{}
				for _, tt := range g.Tensors().Items() {
					kinds[tt.Name] = fsggml.TensorType(tt.Kind)
				}
				if spec.Type == Q4_K {
					// llama.cpp's Q4_K_M: Q6_K head, Q6_K attn_v/ffn_down in
					// layers 0,1,4,7,10,13,14,15 of 16, Q4_K elsewhere.
					want := map[string]fsggml.TensorType{
						"output.weight":          fsggml.TensorTypeQ6_K,
						"token_embd.weight":      fsggml.TensorTypeQ4_K,
						"blk.0.attn_q.weight":    fsggml.TensorTypeQ4_K,
						"blk.1.attn_v.weight":    fsggml.TensorTypeQ6_K,
						"blk.2.attn_v.weight":    fsggml.TensorTypeQ4_K,
						"blk.4.ffn_down.weight":  fsggml.TensorTypeQ6_K,
						"blk.5.ffn_down.weight":  fsggml.TensorTypeQ4_K,
						"blk.15.ffn_down.weight": fsggml.TensorTypeQ6_K,
						"blk.9.ffn_up.weight":    fsggml.TensorTypeQ4_K,
					}
					for name, k := range want {
						if kinds[name] != k {
							t.Errorf("%s is %v, want %v", name, kinds[name], k)
						}
					}
				}

				tp, err := model.NewTextProcessor(path)
				if err != nil {
					t.Fatal(err)
				}
				checkTokenizer(t, tp, spec)
				t.Logf("%s %s: %d params, %.2f GB", arch, spec.Type, params, float64(size)/1e9)
			})
		}
	}
}

// headerOnly stands in for tensor data when only the header is wanted.
type headerOnly struct{}

func (headerOnly) WriteTo(io.Writer) (int64, error) { return 0, nil }

func TestSizes(t *testing.T) {
	// Real llama.cpp files of these shapes, for scale: Llama 3 8B Q4_K_M is
	// 4.92 GB, F16 16.1 GB; Qwen2.5 32B Q4_0 18.6 GB.
	cases := []struct {
		spec   Spec
		lo, hi float64
	}{
		{EightB("llama"), 4.6e9, 5.2e9},
		{func() Spec { s := EightB("llama"); s.Type = F16; return s }(), 15.9e9, 16.2e9},
		{func() Spec { s := OneB("llama"); s.Type = Q4_0; return s }(), 0.6e9, 0.75e9},
		{func() Spec { s := ThirtyTwoB("qwen2"); s.Type = Q4_0; return s }(), 17.5e9, 19.5e9},
	}
	for _, c := range cases {
		n := float64(Size(c.spec))
		if n < c.lo || n > c.hi {
			t.Errorf("%s %s: %.3g bytes, want %.3g..%.3g", c.spec.Name, c.spec.Type, n, c.lo, c.hi)
		}
	}
}

// TestWriteBig writes a full OneB file of the type in SYNTH_BIG (e.g.
// SYNTH_BIG=Q4_0, or F16) into SYNTH_BIG_DIR (default a test temp dir),
// reports the time, and runs one forward pass on it. Skipped by default: it
// writes gigabytes.
func TestWriteBig(t *testing.T) {
	name := os.Getenv("SYNTH_BIG")
	if name == "" {
		t.Skip("set SYNTH_BIG=F16|Q8_0|Q4_0|Q4_K_M to write a OneB file")
	}
	spec := OneB(cmp.Or(os.Getenv("SYNTH_BIG_ARCH"), "llama"))
	i := slices.IndexFunc(FileTypes, func(ft FileType) bool { return ft.String() == name })
	if i < 0 {
		t.Fatalf("unknown type %q", name)
	}
	spec.Type = FileTypes[i]
	path := filepath.Join(cmp.Or(os.Getenv("SYNTH_BIG_DIR"), t.TempDir()), "synth-1b-"+name+".gguf")
	t.Cleanup(func() { os.Remove(path) })
	start := time.Now()
	if err := Write(path, spec, nil); err != nil {
		t.Fatal(err)
	}
	st, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	status, _ := os.ReadFile("/proc/self/status")
	peak := regexp.MustCompile(`VmHWM:\s*(\d+ kB)`).FindSubmatch(status)
	t.Logf("wrote %s: %.2f GB in %v, peak RSS %s", path, float64(st.Size())/1e9, time.Since(start).Round(time.Millisecond), peak[len(peak)-1])
	if st.Size() != Size(spec) {
		t.Errorf("file is %d bytes, Size says %d", st.Size(), Size(spec))
	}
	start = time.Now()
	s := openSession(t, path)
	logits := s.step(t, []int32{1, 450, 3186})
	checkLogits(t, logits, spec.Vocab)
	t.Logf("loaded and ran 3 tokens in %v", time.Since(start).Round(time.Millisecond))
}
