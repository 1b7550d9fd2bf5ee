package ggufstage

import (
	"fmt"
	"reflect"
	"slices"
	"strings"
	"unsafe"

	"github.com/ollama/ollama/kvcache"
	"github.com/ollama/ollama/ml"
	"github.com/ollama/ollama/model"
	"github.com/ollama/ollama/model/models/llama"
	"github.com/ollama/ollama/model/models/qwen2"
	"github.com/ollama/ollama/model/models/qwen3"

	"github.com/meshnode/meshnode/ggufstage/gguf"
)

// Architectures lists what the engine runs. Mistral's dense models and
// TinyLlama / SmolLM are "llama" in GGUF.
var Architectures = []string{"llama", "qwen2", "qwen3"}

// ErrUnsupportedArch is wrapped when a file's architecture is not one of
// Architectures.
var ErrUnsupportedArch = fmt.Errorf("unsupported architecture")

func checkArch(arch string) error {
	if slices.Contains(Architectures, arch) {
		return nil
	}
	return fmt.Errorf("%w %q: meshnode's ggml engine supports %s", ErrUnsupportedArch, arch, strings.Join(Architectures, ", "))
}

// adapter exposes the three pieces of a decoder-only model that a stage
// needs, on top of ollama's per-architecture model code. The layers are
// ollama's own, so a split run computes exactly what the unsplit one does.
type adapter interface {
	embed(ctx ml.Context, tokens ml.Tensor) ml.Tensor
	layer(ctx ml.Context, i int, hidden, positions, outputs ml.Tensor, cache kvcache.Cache) ml.Tensor
	head(ctx ml.Context, hidden ml.Tensor) ml.Tensor
	// required lists the tensor names a stage [start,end) cannot run without.
	required(start, end, layers int) []string
}

func newAdapter(m model.Model, eps float32) (adapter, error) {
	switch m := m.(type) {
	case *llama.Model:
		return llamaAdapter{m, eps}, nil
	case *qwen2.Model:
		return qwen2Adapter{m, eps}, nil
	case *qwen3.Model:
		return qwen3Adapter{m, eps}, nil
	}
	return nil, fmt.Errorf("%w: no stage adapter for model type %T", ErrUnsupportedArch, m)
}

// commonRequired are the tensors of a llama-family block.
var commonRequired = []string{
	"attn_norm.weight", "attn_q.weight", "attn_k.weight", "attn_v.weight", "attn_output.weight",
	"ffn_norm.weight", "ffn_gate.weight", "ffn_up.weight", "ffn_down.weight",
}

// blockTensors are the tensors every block of an architecture needs.
var blockTensors = map[string][]string{
	"llama": commonRequired,
	"qwen2": commonRequired,
	"qwen3": append(slices.Clone(commonRequired), "attn_q_norm.weight", "attn_k_norm.weight"),
}

// checkTensors checks, from the header alone, that f holds every tensor
// layers [start,end) need (a tied head is the token embedding), so that a
// broken file is refused with the missing tensor's name before ollama or
// ggml sees it.
func checkTensors(f *gguf.File, start, end, layers int) error {
	if start < 0 || end > layers || start >= end {
		return fmt.Errorf("%w: layer range [%d,%d) is not inside the model's %d layers", gguf.ErrFormat, start, end, layers)
	}
	have := make(map[string]bool, len(f.Tensors))
	for i := range f.Tensors {
		have[f.Tensors[i].Name] = true
	}
	for _, name := range requiredTensors(start, end, layers, blockTensors[f.Arch()]) {
		if !have[name] && !(name == "output.weight" && have["token_embd.weight"]) {
			return fmt.Errorf("%w: no tensor %s, needed for layers [%d,%d)", gguf.ErrFormat, name, start, end)
		}
	}
	return nil
}

func requiredTensors(start, end, layers int, perBlock []string) []string {
	var names []string
	if start == 0 {
		names = append(names, "token_embd.weight")
	}
	for i := start; i < end; i++ {
		for _, n := range perBlock {
			names = append(names, fmt.Sprintf("blk.%d.%s", i, n))
		}
	}
	if end == layers {
		names = append(names, "output_norm.weight", "output.weight")
	}
	return names
}

type llamaAdapter struct {
	m   *llama.Model
	eps float32
}

func (a llamaAdapter) embed(ctx ml.Context, t ml.Tensor) ml.Tensor {
	return a.m.TokenEmbedding.Forward(ctx, t)
}

func (a llamaAdapter) layer(ctx ml.Context, i int, h, pos, out ml.Tensor, c kvcache.Cache) ml.Tensor {
	return a.m.Layers[i].Forward(ctx, h, pos, out, c, &a.m.Options)
}

func (a llamaAdapter) head(ctx ml.Context, h ml.Tensor) ml.Tensor {
	return a.m.Output.Forward(ctx, a.m.OutputNorm.Forward(ctx, h, a.eps))
}

func (a llamaAdapter) required(s, e, l int) []string { return requiredTensors(s, e, l, commonRequired) }

type qwen2Adapter struct {
	m   *qwen2.Model
	eps float32
}

func (a qwen2Adapter) embed(ctx ml.Context, t ml.Tensor) ml.Tensor {
	return a.m.TokenEmbedding.Forward(ctx, t)
}

func (a qwen2Adapter) layer(ctx ml.Context, i int, h, pos, out ml.Tensor, c kvcache.Cache) ml.Tensor {
	return a.m.Layers[i].Forward(ctx, h, pos, out, c, &a.m.Options)
}

func (a qwen2Adapter) head(ctx ml.Context, h ml.Tensor) ml.Tensor {
	return a.m.Output.Forward(ctx, a.m.OutputNorm.Forward(ctx, h, a.eps))
}

func (a qwen2Adapter) required(s, e, l int) []string { return requiredTensors(s, e, l, commonRequired) }

type qwen3Adapter struct {
	m   *qwen3.Model
	eps float32
}

func (a qwen3Adapter) embed(ctx ml.Context, t ml.Tensor) ml.Tensor {
	return a.m.TokenEmbedding.Forward(ctx, t)
}

func (a qwen3Adapter) layer(ctx ml.Context, i int, h, pos, out ml.Tensor, c kvcache.Cache) ml.Tensor {
	return a.m.Layers[i].Forward(ctx, h, pos, out, c, a.m.Options)
}

func (a qwen3Adapter) head(ctx ml.Context, h ml.Tensor) ml.Tensor {
	return a.m.Output.Forward(ctx, a.m.OutputNorm.Forward(ctx, h, a.eps))
}

func (a qwen3Adapter) required(s, e, l int) []string {
	return requiredTensors(s, e, l, blockTensors["qwen3"])
}

// defaultRopeBase is RoPE's frequency base where a GGUF does not give one:
// llama.cpp's default and the original Llama's (and llama2.c's, whose
// converted models, stories260K among them, carry no such key).
const defaultRopeBase = 10000

// fixRopeBase gives m llama.cpp's RoPE base when the file has none. ollama's
// model code defaults it to 1e5 (llama) or 0 (qwen2, qwen3), so such files
// would rotate positions at the wrong speed: stories260K then drifts from
// llama.cpp's greedy text after 30 tokens (TestGreedyMatchesLlamaCpp). The
// base sits in an unexported field of the pinned ollama version's model
// options; a model without it is an error, not a silent skip.
func fixRopeBase(m model.Model, meta *gguf.File) error {
	if _, ok := meta.Get(meta.Arch() + ".rope.freq_base"); ok {
		return nil
	}
	f := findField(reflect.ValueOf(m), "ropeBase", 3)
	if !f.IsValid() || f.Kind() != reflect.Float32 || !f.CanAddr() {
		return fmt.Errorf("%s has no rope.freq_base and model type %T has no RoPE base to set", meta.Arch(), m)
	}
	reflect.NewAt(f.Type(), unsafe.Pointer(f.UnsafeAddr())).Elem().SetFloat(defaultRopeBase)
	return nil
}

// findField looks for a field named name in v's struct and the structs it
// embeds, through pointers, depth levels down.
func findField(v reflect.Value, name string, depth int) reflect.Value {
	for v.Kind() == reflect.Pointer || v.Kind() == reflect.Interface {
		if v.IsNil() {
			return reflect.Value{}
		}
		v = v.Elem()
	}
	if v.Kind() != reflect.Struct || depth < 0 {
		return reflect.Value{}
	}
	if f := v.FieldByName(name); f.IsValid() {
		return f
	}
	for i := range v.NumField() {
		if v.Type().Field(i).Anonymous {
			if f := findField(v.Field(i), name, depth-1); f.IsValid() {
				return f
			}
		}
	}
	return reflect.Value{}
}
