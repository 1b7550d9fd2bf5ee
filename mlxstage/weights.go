package mlxstage

import (
	"fmt"
	"strconv"
	"strings"

	"github.com/meshnode/meshnode/mlxstage/ops"
	"github.com/meshnode/meshnode/mlxstage/safetensors"
)

// Hugging Face tensor names of the llama family.
const (
	NameEmbed = "model.embed_tokens.weight"
	NameNorm  = "model.norm.weight"
	NameHead  = "lm_head.weight"
)

// LayerName is the name of a tensor of block i: LayerName(3,
// "self_attn.q_proj.weight") is "model.layers.3.self_attn.q_proj.weight".
func LayerName(i int, suffix string) string {
	return "model.layers." + strconv.Itoa(i) + "." + suffix
}

// LayerOf is the block index of a "model.layers.N.…" tensor, or -1.
func LayerOf(name string) int {
	rest, ok := strings.CutPrefix(name, "model.layers.")
	if !ok {
		return -1
	}
	num, _, ok := strings.Cut(rest, ".")
	if !ok {
		return -1
	}
	n, err := strconv.Atoi(num)
	if err != nil || n < 0 {
		return -1
	}
	return n
}

// blockTensor is one tensor of a block: its name suffix and shape.
type blockTensor struct {
	suffix string
	shape  []int
	field  func(*layerWeights) *ops.Tensor
}

// blockTensors lists, for a config, the tensors of one block with their
// expected shapes ([out, in] for a Linear weight) and where each goes.
func (c *Config) blockTensors() []blockTensor {
	E, Q, KV, D, F := c.Hidden, c.Heads*c.HeadDim, c.KVHeads*c.HeadDim, c.HeadDim, c.FFN
	ts := []blockTensor{
		{"input_layernorm.weight", []int{E}, func(l *layerWeights) *ops.Tensor { return &l.attnNorm }},
		{"self_attn.q_proj.weight", []int{Q, E}, func(l *layerWeights) *ops.Tensor { return &l.q }},
		{"self_attn.k_proj.weight", []int{KV, E}, func(l *layerWeights) *ops.Tensor { return &l.k }},
		{"self_attn.v_proj.weight", []int{KV, E}, func(l *layerWeights) *ops.Tensor { return &l.v }},
		{"self_attn.o_proj.weight", []int{E, Q}, func(l *layerWeights) *ops.Tensor { return &l.o }},
		{"post_attention_layernorm.weight", []int{E}, func(l *layerWeights) *ops.Tensor { return &l.ffnNorm }},
		{"mlp.gate_proj.weight", []int{F, E}, func(l *layerWeights) *ops.Tensor { return &l.gate }},
		{"mlp.up_proj.weight", []int{F, E}, func(l *layerWeights) *ops.Tensor { return &l.up }},
		{"mlp.down_proj.weight", []int{E, F}, func(l *layerWeights) *ops.Tensor { return &l.down }},
	}
	if c.QKVBias {
		ts = append(ts,
			blockTensor{"self_attn.q_proj.bias", []int{Q}, func(l *layerWeights) *ops.Tensor { return &l.qb }},
			blockTensor{"self_attn.k_proj.bias", []int{KV}, func(l *layerWeights) *ops.Tensor { return &l.kb }},
			blockTensor{"self_attn.v_proj.bias", []int{KV}, func(l *layerWeights) *ops.Tensor { return &l.vb }})
	}
	if c.OBias {
		ts = append(ts, blockTensor{"self_attn.o_proj.bias", []int{E}, func(l *layerWeights) *ops.Tensor { return &l.ob }})
	}
	if c.MLPBias {
		ts = append(ts,
			blockTensor{"mlp.gate_proj.bias", []int{F}, func(l *layerWeights) *ops.Tensor { return &l.gateB }},
			blockTensor{"mlp.up_proj.bias", []int{F}, func(l *layerWeights) *ops.Tensor { return &l.upB }},
			blockTensor{"mlp.down_proj.bias", []int{E}, func(l *layerWeights) *ops.Tensor { return &l.downB }})
	}
	if c.QKNorm {
		ts = append(ts,
			blockTensor{"self_attn.q_norm.weight", []int{D}, func(l *layerWeights) *ops.Tensor { return &l.qNorm }},
			blockTensor{"self_attn.k_norm.weight", []int{D}, func(l *layerWeights) *ops.Tensor { return &l.kNorm }})
	}
	return ts
}

// StageTensors lists the tensors a stage [start,end) loads, and nothing
// else: the embedding on the first stage, the blocks' tensors, and on the
// last stage the final norm and the head (the embedding again when tied,
// loaded once if the stage is also the first).
func (c *Config) StageTensors(start, end int) []string {
	var names []string
	if start == 0 || (end == c.Layers && c.Tied) {
		names = append(names, NameEmbed)
	}
	for i := start; i < end; i++ {
		for _, t := range c.blockTensors() {
			names = append(names, LayerName(i, t.suffix))
		}
	}
	if end == c.Layers {
		names = append(names, NameNorm)
		if !c.Tied {
			names = append(names, NameHead)
		}
	}
	return names
}

// QuantPolicy decides at load time which weights are quantized, and how.
//
// The policy follows MLX-LM's: the matrices of Linear layers (the seven
// projections of each block and an untied lm_head) are quantized when their
// rows are whole groups; norms and biases never are (they are tiny, and
// their precision matters most). The token embedding is quantized only when
// Embeddings is set: MLX-LM does (it is the largest single matrix of small
// models, and a tied head reads all of it every token), but the first stage
// then embeds tokens with rounded rows. Quantizing at load costs nothing at
// inference compared with pre-quantized files and keeps one set of weights
// (the HF original) for every engine, including a GGUF made from them.
//
// The zero policy loads every weight as stored (F32, F16 or BF16).
type QuantPolicy struct {
	ops.Quant
	Embeddings bool
}

// Preset policies.
var (
	QuantNone = QuantPolicy{}
	// Quant4 is MLX-LM's default: 4 bits, groups of 64, embedding included.
	Quant4 = QuantPolicy{Quant: ops.Quant{Bits: 4, GroupSize: 64}, Embeddings: true}
	// Quant8 keeps 8 bits for models that lose too much at 4.
	Quant8 = QuantPolicy{Quant: ops.Quant{Bits: 8, GroupSize: 64}, Embeddings: true}
)

// ParseQuant reads a policy name: "none", "q4", "q8", or "qB" with a group
// size, "q4g32"; a "-noembed" suffix keeps the embedding exact.
func ParseQuant(s string) (QuantPolicy, error) {
	if s == "" || s == "none" {
		return QuantNone, nil
	}
	p := QuantPolicy{Embeddings: true}
	if rest, ok := strings.CutSuffix(s, "-noembed"); ok {
		s, p.Embeddings = rest, false
	}
	body, ok := strings.CutPrefix(s, "q")
	if !ok {
		return p, fmt.Errorf("quantization %q: want none, or q<bits> with an optional g<group>, such as q4, q8 or q4g32", s)
	}
	bits, group, hasGroup := strings.Cut(body, "g")
	var err error
	if p.Bits, err = strconv.Atoi(bits); err != nil {
		return p, fmt.Errorf("quantization %q: bits: %w", s, err)
	}
	p.GroupSize = 64
	if hasGroup {
		if p.GroupSize, err = strconv.Atoi(group); err != nil {
			return p, fmt.Errorf("quantization %q: group size: %w", s, err)
		}
	}
	return p, p.Validate()
}

func (p QuantPolicy) String() string {
	if p.None() {
		return "none"
	}
	s := fmt.Sprintf("q%dg%d", p.Bits, p.GroupSize)
	if !p.Embeddings {
		s += "-noembed"
	}
	return s
}

// For is the quantization of one tensor.
func (p QuantPolicy) For(name string, shape []int) ops.Quant {
	if p.None() || len(shape) != 2 || shape[1]%p.GroupSize != 0 {
		return ops.Quant{}
	}
	if name == NameEmbed && !p.Embeddings {
		return ops.Quant{}
	}
	return p.Quant
}

// layerWeights are one block's tensors; absent biases and norms are nil.
type layerWeights struct {
	attnNorm, q, k, v, o, ffnNorm, gate, up, down ops.Tensor
	qb, kb, vb, ob, gateB, upB, downB             ops.Tensor
	qNorm, kNorm                                  ops.Tensor
}

// weights are everything a stage holds.
type weights struct {
	embed, norm, head ops.Tensor // nil where the stage does not own them
	layers            []layerWeights
	all               []ops.Tensor
	bytes             uint64
}

// load reads the stage's tensors, only those, and hands them to the backend.
func (c *Config) load(m *safetensors.Model, be ops.Backend, start, end int, policy QuantPolicy) (_ *weights, err error) {
	w := &weights{layers: make([]layerWeights, end-start)}
	defer func() {
		if err != nil {
			w.free(be)
		}
	}()
	var buf []byte
	get := func(name string, shape []int) (ops.Tensor, error) {
		raw, t, err := m.ReadTensor(name, buf)
		if err != nil {
			return nil, err
		}
		buf = raw[:0]
		if len(t.Shape) != len(shape) {
			return nil, fmt.Errorf("%w: %s has shape %v, want %v", ErrConfig, name, t.Shape, shape)
		}
		for i := range shape {
			if t.Shape[i] != int64(shape[i]) {
				return nil, fmt.Errorf("%w: %s has shape %v, want %v", ErrConfig, name, t.Shape, shape)
			}
		}
		dt, ok := t.DType.Stage()
		if !ok {
			return nil, fmt.Errorf("%w: %s is %s; mlxstage loads F32, F16 and BF16 weights", ErrUnsupported, name, t.DType)
		}
		x, n, err := be.Weight(raw, dt, shape, policy.For(name, shape))
		if err != nil {
			return nil, fmt.Errorf("loading %s: %w", name, err)
		}
		w.all = append(w.all, x)
		w.bytes += n
		return x, nil
	}
	for _, name := range c.StageTensors(start, end) {
		switch i := LayerOf(name); {
		case name == NameEmbed:
			if w.embed, err = get(name, []int{c.Vocab, c.Hidden}); err != nil {
				return nil, err
			}
		case name == NameNorm:
			if w.norm, err = get(name, []int{c.Hidden}); err != nil {
				return nil, err
			}
		case name == NameHead:
			if w.head, err = get(name, []int{c.Vocab, c.Hidden}); err != nil {
				return nil, err
			}
		case i >= start && i < end:
			suffix := strings.TrimPrefix(name, LayerName(i, ""))
			for _, bt := range c.blockTensors() {
				if bt.suffix == suffix {
					if *bt.field(&w.layers[i-start]), err = get(name, bt.shape); err != nil {
						return nil, err
					}
				}
			}
		}
	}
	if end == c.Layers && c.Tied {
		w.head = w.embed
	}
	return w, nil
}

func (w *weights) free(be ops.Backend) {
	for _, t := range w.all {
		be.FreeWeight(t)
	}
	w.all = nil
}
