// Package synth writes random-weight GGUF models of realistic shapes, with a
// working tokenizer in the metadata, for tests and benchmarks. Nothing is
// downloaded: weights are generated from a seed while the file is written.
package synth

import (
	"cmp"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"
	"sync"

	fsggml "github.com/ollama/ollama/fs/ggml"
	"github.com/ollama/ollama/ml/backend/ggml"
)

// FileType is the quantization of a file, named by the tensor type of its
// matrices. Norms and biases are always F32, as llama.cpp stores them.
type FileType fsggml.TensorType

const (
	F32  = FileType(fsggml.TensorTypeF32)
	F16  = FileType(fsggml.TensorTypeF16)
	Q8_0 = FileType(fsggml.TensorTypeQ8_0)
	// Q4_0 also gives the output head Q6_K, as llama.cpp does.
	Q4_0 = FileType(fsggml.TensorTypeQ4_0)
	// Q4_K is llama.cpp's Q4_K_M mix: Q4_K matrices, Q6_K for the output
	// head and for attn_v/ffn_down in the layers that get more bits.
	Q4_K = FileType(fsggml.TensorTypeQ4_K)
)

// FileTypes lists every supported FileType.
var FileTypes = []FileType{F32, F16, Q8_0, Q4_0, Q4_K}

func (t FileType) String() string {
	if t == Q4_K {
		return "Q4_K_M"
	}
	return fsggml.TensorType(t).String()
}

// llamaFileType is the general.file_type value (llama_ftype) of the mix.
func (t FileType) llamaFileType() (fsggml.FileType, error) {
	switch t {
	case F32:
		return fsggml.FileTypeF32, nil
	case F16:
		return fsggml.FileTypeF16, nil
	case Q8_0:
		return fsggml.FileTypeQ8_0, nil
	case Q4_0:
		return 2, nil // LLAMA_FTYPE_MOSTLY_Q4_0, unexported by fsggml
	case Q4_K:
		return fsggml.FileTypeQ4_K_M, nil
	}
	return 0, fmt.Errorf("synth: unsupported file type %d", uint32(t))
}

func (t FileType) quantized() bool { return t != F32 && t != F16 }

// Spec describes a model to generate.
type Spec struct {
	Arch    string // "llama", "qwen2" or "qwen3"
	Layers  int
	Embd    int
	Heads   int
	KVHeads int // 0 = Heads
	HeadDim int // 0 = Embd/Heads
	FFN     int
	Vocab   int // embedding rows; the tokenizer is padded to exactly this
	Context int // 0 = 4096

	RopeBase float32 // 0 = the architecture's usual base
	Type     FileType
	Tied     bool // output head shares token_embd; no output.weight
	Seed     uint64
	Name     string // general.name; "" = derived from the spec
}

// archInfo holds what differs between the supported architectures.
type archInfo struct {
	eps      float32
	ropeBase float32
	bpe      bool // GPT-2 byte-level BPE tokenizer rather than SentencePiece
	qkvBias  bool // attn_q/k/v carry biases (qwen2)
	qkNorm   bool // per-head RMS norm on q and k (qwen3)
	// Keys llama.cpp writes only for some architectures.
	ropeDimKey, vocabSizeKey, headDimKeys bool
}

var archs = map[string]archInfo{
	"llama": {eps: 1e-5, ropeBase: 500000, ropeDimKey: true, vocabSizeKey: true},
	"qwen2": {eps: 1e-6, ropeBase: 1000000, bpe: true, qkvBias: true},
	"qwen3": {eps: 1e-6, ropeBase: 1000000, bpe: true, qkNorm: true, headDimKeys: true},
}

// Tiny is a 3-layer model that loads and runs in milliseconds. FFN is 256 so
// that ffn_down rows are whole K-quant blocks and Q4_K files really contain
// Q4_K and Q6_K tensors; narrower rows fall back as in llama.cpp. The qwen
// variants tie the output head like the small Qwen models.
func Tiny(arch string) Spec {
	return Spec{
		Arch: arch, Layers: 3, Embd: 128, Heads: 4, KVHeads: 2, FFN: 256,
		Vocab: 512, Context: 512, Type: F32, Tied: arch != "llama", Seed: 1,
		Name: "synth-" + arch + "-tiny",
	}
}

// OneB has the shape of Llama 3.2 1B with a 32000-token vocabulary; the qwen
// variants keep the same dimensions so benchmarks compare like with like.
func OneB(arch string) Spec {
	return Spec{
		Arch: arch, Layers: 16, Embd: 2048, Heads: 32, KVHeads: 8, FFN: 8192,
		Vocab: 32000, Context: 4096, Type: Q4_K, Seed: 1,
		Name: "synth-" + arch + "-1b",
	}
}

// EightB has the shape of Llama 3 8B, vocabulary included.
func EightB(arch string) Spec {
	return Spec{
		Arch: arch, Layers: 32, Embd: 4096, Heads: 32, KVHeads: 8, FFN: 14336,
		Vocab: 128256, Context: 8192, Type: Q4_K, Seed: 1,
		Name: "synth-" + arch + "-8b",
	}
}

// ThirtyTwoB has the shape of Qwen2.5 32B (64 layers, n_embd 5120, 40
// heads over 8 KV heads, FFN 27648, vocabulary 152064): a model that fills
// most of a 24-48 GB card in Q4_0, for pipelines that must split it.
func ThirtyTwoB(arch string) Spec {
	return Spec{
		Arch: arch, Layers: 64, Embd: 5120, Heads: 40, KVHeads: 8, FFN: 27648,
		Vocab: 152064, Context: 8192, Type: Q4_K, Seed: 1,
		Name: "synth-" + arch + "-32b",
	}
}

// normalize fills defaults and rejects specs ggml could not run.
func (s Spec) normalize() (Spec, archInfo, error) {
	a, ok := archs[s.Arch]
	if !ok {
		return s, a, fmt.Errorf("synth: unsupported architecture %q", s.Arch)
	}
	if s.KVHeads == 0 {
		s.KVHeads = s.Heads
	}
	if s.Layers <= 0 || s.Embd <= 0 || s.Heads <= 0 || s.KVHeads <= 0 || s.FFN <= 0 || s.Vocab <= 0 || s.HeadDim < 0 || s.Context < 0 {
		return s, a, fmt.Errorf("synth: spec sizes must be positive: %+v", s)
	}
	if s.Heads%s.KVHeads != 0 {
		return s, a, fmt.Errorf("synth: %d heads not divisible by %d KV heads", s.Heads, s.KVHeads)
	}
	if s.HeadDim == 0 {
		if s.Embd%s.Heads != 0 {
			return s, a, fmt.Errorf("synth: embedding %d not divisible by %d heads", s.Embd, s.Heads)
		}
		s.HeadDim = s.Embd / s.Heads
	}
	if s.HeadDim%2 != 0 {
		return s, a, fmt.Errorf("synth: head dimension %d must be even for RoPE", s.HeadDim)
	}
	if s.Context == 0 {
		s.Context = 4096
	}
	if s.RopeBase == 0 {
		s.RopeBase = a.ropeBase
	}
	if s.Name == "" {
		s.Name = fmt.Sprintf("synth-%s-%dL-%d", s.Arch, s.Layers, s.Embd)
	}
	if _, err := s.Type.llamaFileType(); err != nil {
		return s, a, err
	}
	return s, a, nil
}

// dist is the distribution of a tensor's values: mean + std*N(0,1).
type dist struct{ mean, std float32 }

// tensorSpec is one tensor of the plan, before any data exists.
type tensorSpec struct {
	name  string
	shape []uint64 // ggml order: shape[0] is the row length
	kind  fsggml.TensorType
	dist  dist
}

func (t tensorSpec) rows() uint64 {
	n := uint64(1)
	for _, d := range t.shape[1:] {
		n *= d
	}
	return n
}

func (t tensorSpec) size() uint64 { return t.rows() * t.kind.RowSize(t.shape[0]) }

// role decides a tensor's type in a quantized mix.
type role int

const (
	roleVector role = iota // norms and biases
	roleMatrix
	roleOutput // output head, or token_embd when tied
	roleAttnV
	roleFFNDown
)

// useMoreBits is llama.cpp's choice of the layers whose attn_v and ffn_down
// get Q6_K in a Q4_K_M file: the first and last eighth and every third one
// in between.
func useMoreBits(i, n int) bool {
	return i < n/8 || i >= 7*n/8 || (i-n/8)%3 == 2
}

// tensorType mirrors llama.cpp's per-tensor choices for the supported mixes.
func tensorType(ft FileType, r role, ne0 uint64, layer, layers int) fsggml.TensorType {
	if r == roleVector {
		return fsggml.TensorTypeF32
	}
	t := fsggml.TensorType(ft)
	if !ft.quantized() {
		return t
	}
	switch r {
	case roleOutput:
		if t != fsggml.TensorTypeQ8_0 {
			t = fsggml.TensorTypeQ6_K
		}
	case roleAttnV, roleFFNDown:
		if ft == Q4_K && useMoreBits(layer, layers) {
			t = fsggml.TensorTypeQ6_K
		}
	}
	// Rows that are not whole blocks fall back the way llama.cpp's do.
	if ne0%t.BlockSize() != 0 {
		switch t {
		case fsggml.TensorTypeQ4_K:
			t = fsggml.TensorTypeQ5_0
		case fsggml.TensorTypeQ6_K:
			t = fsggml.TensorTypeQ8_0
		}
		if ne0%t.BlockSize() != 0 {
			t = fsggml.TensorTypeF16
		}
	}
	return t
}

// plan builds the metadata and tensor list of a spec without generating data.
func plan(spec Spec) (fsggml.KV, []tensorSpec, error) {
	s, a, err := spec.normalize()
	if err != nil {
		return nil, nil, err
	}
	voc, err := getVocab(a.bpe, s.Vocab)
	if err != nil {
		return nil, nil, err
	}
	ftype, _ := s.Type.llamaFileType()

	p := s.Arch + "."
	kv := fsggml.KV{
		"general.architecture":                 s.Arch,
		"general.type":                         "model",
		"general.name":                         s.Name,
		"general.file_type":                    uint32(ftype),
		p + "block_count":                      uint32(s.Layers),
		p + "context_length":                   uint32(s.Context),
		p + "embedding_length":                 uint32(s.Embd),
		p + "feed_forward_length":              uint32(s.FFN),
		p + "attention.head_count":             uint32(s.Heads),
		p + "attention.head_count_kv":          uint32(s.KVHeads),
		p + "attention.layer_norm_rms_epsilon": a.eps,
		p + "rope.freq_base":                   s.RopeBase,
		"tokenizer.ggml.tokens":                voc.tokens,
		"tokenizer.ggml.token_type":            voc.types,
		"tokenizer.ggml.bos_token_id":          voc.bos,
		"tokenizer.ggml.eos_token_id":          voc.eos,
		"tokenizer.ggml.add_bos_token":         !a.bpe,
		"tokenizer.ggml.add_eos_token":         false,
	}
	if s.Type.quantized() {
		kv["general.quantization_version"] = ggml.QuantizationVersion()
	}
	if a.ropeDimKey {
		kv[p+"rope.dimension_count"] = uint32(s.HeadDim)
	}
	if a.vocabSizeKey {
		kv[p+"vocab_size"] = uint32(s.Vocab)
	}
	if a.headDimKeys || s.HeadDim != s.Embd/s.Heads {
		kv[p+"attention.key_length"] = uint32(s.HeadDim)
		kv[p+"attention.value_length"] = uint32(s.HeadDim)
	}
	if a.bpe {
		kv["tokenizer.ggml.model"] = "gpt2"
		kv["tokenizer.ggml.pre"] = "qwen2"
		kv["tokenizer.ggml.merges"] = voc.merges
		kv["tokenizer.ggml.padding_token_id"] = voc.pad
		kv["tokenizer.ggml.eos_token_ids"] = voc.eosIDs
		kv["tokenizer.chat_template"] = chatTemplateQwen25
	} else {
		kv["tokenizer.ggml.model"] = "llama"
		kv["tokenizer.ggml.scores"] = voc.scores
		kv["tokenizer.ggml.unknown_token_id"] = voc.unk
		kv["tokenizer.chat_template"] = chatTemplateLlama2
	}

	E, V, F := uint64(s.Embd), uint64(s.Vocab), uint64(s.FFN)
	Q, KV, D := uint64(s.Heads*s.HeadDim), uint64(s.KVHeads*s.HeadDim), uint64(s.HeadDim)
	var ts []tensorSpec
	add := func(name string, r role, layer int, d dist, shape ...uint64) {
		ts = append(ts, tensorSpec{
			name:  name,
			shape: shape,
			kind:  tensorType(s.Type, r, shape[0], layer, s.Layers),
			dist:  d,
		})
	}
	// Scales: matrices keep activations at unit RMS (std 1/sqrt(fan_in));
	// the projections back into the residual stream are further divided by
	// sqrt(2*layers) so depth does not blow the stream up. The embedding is
	// small (0.02) so the residual is dominated by what the layers compute,
	// which keeps a tied head from simply predicting the input token.
	fanIn := func(n uint64) float32 { return float32(1 / math.Sqrt(float64(n))) }
	resid := float32(1 / math.Sqrt(float64(2*s.Layers)))
	norm := dist{1, 0.02}

	embRole := roleMatrix
	if s.Tied {
		embRole = roleOutput
	}
	add("token_embd.weight", embRole, 0, dist{0, 0.02}, E, V)
	outNorm := norm
	if s.Tied {
		// The small embedding would make a tied head's logits nearly flat
		// (std 0.02*sqrt(E)); a larger final-norm gain, as trained tied
		// models have, brings them to about unit spread.
		g := max(1, 1/(0.02*float32(math.Sqrt(float64(E)))))
		outNorm = dist{g, 0.02 * g}
	}
	add("output_norm.weight", roleVector, 0, outNorm, E)
	if !s.Tied {
		add("output.weight", roleOutput, 0, dist{0, fanIn(E)}, E, V)
	}
	for i := range s.Layers {
		b := "blk." + strconv.Itoa(i) + "."
		add(b+"attn_norm.weight", roleVector, i, norm, E)
		add(b+"attn_q.weight", roleMatrix, i, dist{0, fanIn(E)}, E, Q)
		add(b+"attn_k.weight", roleMatrix, i, dist{0, fanIn(E)}, E, KV)
		add(b+"attn_v.weight", roleAttnV, i, dist{0, fanIn(E)}, E, KV)
		add(b+"attn_output.weight", roleMatrix, i, dist{0, fanIn(Q) * resid}, Q, E)
		if a.qkvBias {
			add(b+"attn_q.bias", roleVector, i, dist{0, 0.1}, Q)
			add(b+"attn_k.bias", roleVector, i, dist{0, 0.1}, KV)
			add(b+"attn_v.bias", roleVector, i, dist{0, 0.1}, KV)
		}
		if a.qkNorm {
			add(b+"attn_q_norm.weight", roleVector, i, norm, D)
			add(b+"attn_k_norm.weight", roleVector, i, norm, D)
		}
		add(b+"ffn_norm.weight", roleVector, i, norm, E)
		add(b+"ffn_gate.weight", roleMatrix, i, dist{0, fanIn(E)}, E, F)
		add(b+"ffn_up.weight", roleMatrix, i, dist{0, fanIn(E)}, E, F)
		add(b+"ffn_down.weight", roleFFNDown, i, dist{0, fanIn(F) * resid}, F, E)
	}
	return kv, ts, nil
}

// blockOf is the layer number WriteGGUF sorts tensors by (MaxInt for none).
func blockOf(name string) int {
	rest, ok := strings.CutPrefix(name, "blk.")
	if !ok {
		return math.MaxInt
	}
	n, err := strconv.Atoi(rest[:max(strings.IndexByte(rest, '.'), 0)])
	if err != nil {
		return math.MaxInt
	}
	return n
}

// sortLikeWriteGGUF orders tensors as fsggml.WriteGGUF lays them out.
func sortLikeWriteGGUF(ts []tensorSpec) {
	slices.SortStableFunc(ts, func(a, b tensorSpec) int {
		return cmp.Or(cmp.Compare(blockOf(a.name), blockOf(b.name)), cmp.Compare(a.name, b.name))
	})
}

const ggufAlignment = 32 // WriteGGUF's default; we never set general.alignment

func pad(n int64) int64 { return (ggufAlignment - n%ggufAlignment) % ggufAlignment }

// kvBytes is the encoded size of one metadata entry, as WriteGGUF writes it.
func kvBytes(k string, v any) (int64, error) {
	n := int64(8 + len(k) + 4) // key length, key, value type
	switch v := v.(type) {
	case uint32, int32, float32:
		return n + 4, nil
	case bool:
		return n + 1, nil
	case string:
		return n + 8 + int64(len(v)), nil
	case []int32:
		return n + 4 + 8 + 4*int64(len(v)), nil
	case []float32:
		return n + 4 + 8 + 4*int64(len(v)), nil
	case []string:
		n += 4 + 8
		for _, s := range v {
			n += 8 + int64(len(s))
		}
		return n, nil
	}
	return 0, fmt.Errorf("synth: no size for metadata %s of type %T", k, v)
}

// fileSize is the length of the file WriteGGUF produces for a plan: header,
// tensor table, padding, then the tensors, each aligned, with no padding
// after the last one.
func fileSize(kv fsggml.KV, ts []tensorSpec) (int64, error) {
	n := int64(4 + 4 + 8 + 8) // magic, version, tensor count, KV count
	for k, v := range kv {
		b, err := kvBytes(k, v)
		if err != nil {
			return 0, err
		}
		n += b
	}
	for _, t := range ts {
		n += 8 + int64(len(t.name)) + 4 + 8*int64(len(t.shape)) + 4 + 8
	}
	n += pad(n)

	sorted := slices.Clone(ts)
	sortLikeWriteGGUF(sorted)
	var off, end int64
	for _, t := range sorted {
		end = off + int64(t.size())
		off = end + pad(end)
	}
	return n + end, nil
}

// Size returns the exact length of the file Write produces for spec, or -1
// if the spec is invalid. It generates no weights, so it is cheap even for
// big specs.
func Size(spec Spec) int64 {
	kv, ts, err := plan(spec)
	if err != nil {
		return -1
	}
	n, err := fileSize(kv, ts)
	if err != nil {
		return -1
	}
	return n
}

// Write generates spec's model into path. Weights are produced tensor by
// tensor in bounded chunks while writing, so memory stays small even for
// multi-GB files; the file appears under path only once complete. progress,
// if not nil, gets the tensor bytes written so far and their total; calls are
// serialized.
func Write(path string, spec Spec, progress func(done, total int64)) (err error) {
	kv, specs, err := plan(spec)
	if err != nil {
		return err
	}
	tr := &tracker{fn: progress}
	for _, t := range specs {
		tr.total += int64(t.size())
	}
	ts := make([]*fsggml.Tensor, len(specs))
	for i, t := range specs {
		ts[i] = &fsggml.Tensor{
			Name:     t.name,
			Kind:     uint32(t.kind),
			Shape:    t.shape,
			WriterTo: &generator{t: t, seed: spec.Seed, progress: tr},
		}
	}

	f, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".*.tmp")
	if err != nil {
		return fmt.Errorf("synth: %w", err)
	}
	defer func() {
		if err != nil {
			f.Close()
			os.Remove(f.Name())
		}
	}()
	if err := fsggml.WriteGGUF(f, kv, ts); err != nil {
		return fmt.Errorf("synth: writing %s: %w", path, err)
	}
	// CreateTemp makes the file private; models are ordinary readable files.
	if err := f.Chmod(0o644); err != nil {
		return fmt.Errorf("synth: %w", err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("synth: closing %s: %w", f.Name(), err)
	}
	if err := os.Rename(f.Name(), path); err != nil {
		return fmt.Errorf("synth: %w", err)
	}
	return nil
}

// tracker serializes progress reports from WriteGGUF's parallel writers.
type tracker struct {
	mu          sync.Mutex
	done, total int64
	fn          func(done, total int64)
}

func (t *tracker) add(n int) {
	if t.fn == nil {
		return
	}
	t.mu.Lock()
	defer t.mu.Unlock()
	t.done += int64(n)
	t.fn(t.done, t.total)
}

var errShortTensor = errors.New("tensor data size does not match its type and shape")
