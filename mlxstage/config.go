package mlxstage

import (
	"encoding/json"
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
)

// Architectures lists the Hugging Face model classes mlxstage runs, and the
// architecture name each one has in a GGUF (what stage.Info reports, so that
// the two engines name a model alike).
var Architectures = map[string]string{
	"LlamaForCausalLM": "llama",
	"Qwen2ForCausalLM": "qwen2",
	"Qwen3ForCausalLM": "qwen3",
}

// ErrUnsupported is wrapped by errors about models mlxstage cannot run.
var ErrUnsupported = errors.New("unsupported model")

// ErrConfig is wrapped by errors about a config.json that cannot be right.
var ErrConfig = errors.New("bad config.json")

// Config is what mlxstage needs from a model's config.json, with the
// defaults of the model class's transformers configuration filled in.
type Config struct {
	Class string // "LlamaForCausalLM", ...
	Arch  string // "llama", "qwen2", "qwen3"

	Hidden  int // hidden_size
	Layers  int // num_hidden_layers
	Heads   int // num_attention_heads
	KVHeads int // num_key_value_heads
	HeadDim int // head_dim
	FFN     int // intermediate_size
	Vocab   int // vocab_size

	Eps          float64 // rms_norm_eps
	RopeTheta    float64 // rope_theta
	RopeScaling  *RopeScaling
	MaxPositions int  // max_position_embeddings
	Tied         bool // tie_word_embeddings: the head is the embedding

	QKVBias bool // q/k/v projections have biases (Qwen2; attention_bias elsewhere)
	OBias   bool // o_proj has a bias (attention_bias in Llama and Qwen3)
	MLPBias bool // gate/up/down have biases (Llama's mlp_bias)
	QKNorm  bool // per-head RMS norms of q and k before RoPE (Qwen3)

	DType string // torch_dtype, informative: tensors carry their own
	BOS   []int
	EOS   []int
}

// RopeScaling is the rope_scaling object of the kinds supported: "linear"
// (positions divided by Factor) and "llama3" (Llama 3.1's frequency-
// dependent scaling).
type RopeScaling struct {
	Type                 string
	Factor               float64
	LowFreqFactor        float64
	HighFreqFactor       float64
	OriginalMaxPositions int
}

// rawConfig mirrors config.json; pointers tell absent from zero.
type rawConfig struct {
	Architectures      []string        `json:"architectures"`
	ModelType          string          `json:"model_type"`
	HiddenSize         *int            `json:"hidden_size"`
	Layers             *int            `json:"num_hidden_layers"`
	Heads              *int            `json:"num_attention_heads"`
	KVHeads            *int            `json:"num_key_value_heads"`
	HeadDim            *int            `json:"head_dim"`
	Intermediate       *int            `json:"intermediate_size"`
	VocabSize          *int            `json:"vocab_size"`
	RMSNormEps         *float64        `json:"rms_norm_eps"`
	RopeTheta          *float64        `json:"rope_theta"`
	RopeScaling        json.RawMessage `json:"rope_scaling"`
	MaxPositions       *int            `json:"max_position_embeddings"`
	Tie                *bool           `json:"tie_word_embeddings"`
	AttentionBias      *bool           `json:"attention_bias"`
	MLPBias            *bool           `json:"mlp_bias"`
	HiddenAct          string          `json:"hidden_act"`
	UseSlidingWindow   *bool           `json:"use_sliding_window"`
	TorchDType         string          `json:"torch_dtype"`
	DType              string          `json:"dtype"`
	BOS                json.RawMessage `json:"bos_token_id"`
	EOS                json.RawMessage `json:"eos_token_id"`
	PartialRotary      *float64        `json:"partial_rotary_factor"`
	QuantizationConfig json.RawMessage `json:"quantization_config"`
}

// classDefaults are the transformers configuration defaults that differ by
// class (LlamaConfig, Qwen2Config, Qwen3Config).
type classDefaults struct {
	eps, theta float64
	headDim    int // 0 = hidden/heads
	qkvBias    bool
	qkNorm     bool
}

var defaults = map[string]classDefaults{
	"LlamaForCausalLM": {eps: 1e-6, theta: 10000},
	// Qwen2's q/k/v projections always carry biases; the config has no key.
	"Qwen2ForCausalLM": {eps: 1e-6, theta: 10000, qkvBias: true},
	// Qwen3Config defaults head_dim to 128 rather than deriving it.
	"Qwen3ForCausalLM": {eps: 1e-6, theta: 10000, headDim: 128, qkNorm: true},
}

// modelTypes maps model_type to the class, for configs without
// "architectures".
var modelTypes = map[string]string{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

// ParseConfig reads a config.json and checks that mlxstage can run it.
func ParseConfig(data []byte) (*Config, error) {
	var r rawConfig
	if err := json.Unmarshal(data, &r); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrConfig, err)
	}
	class := ""
	for _, a := range r.Architectures {
		if _, ok := Architectures[a]; ok {
			class = a
			break
		}
	}
	if class == "" && len(r.Architectures) == 0 {
		class = modelTypes[r.ModelType]
	}
	if class == "" {
		names := slices.Sorted(func(yield func(string) bool) {
			for k := range Architectures {
				if !yield(k) {
					return
				}
			}
		})
		got := strings.Join(r.Architectures, ", ")
		if got == "" {
			got = "model_type " + r.ModelType
		}
		return nil, fmt.Errorf("%w %s: mlxstage runs %s", ErrUnsupported, got, strings.Join(names, ", "))
	}
	d := defaults[class]
	c := &Config{Class: class, Arch: Architectures[class], QKVBias: d.qkvBias, QKNorm: d.qkNorm}

	need := func(p *int, key string) (int, error) {
		if p == nil {
			return 0, fmt.Errorf("%w: no %s", ErrConfig, key)
		}
		if *p <= 0 {
			return 0, fmt.Errorf("%w: %s is %d", ErrConfig, key, *p)
		}
		return *p, nil
	}
	var err error
	if c.Hidden, err = need(r.HiddenSize, "hidden_size"); err != nil {
		return nil, err
	}
	if c.Layers, err = need(r.Layers, "num_hidden_layers"); err != nil {
		return nil, err
	}
	if c.Heads, err = need(r.Heads, "num_attention_heads"); err != nil {
		return nil, err
	}
	if c.FFN, err = need(r.Intermediate, "intermediate_size"); err != nil {
		return nil, err
	}
	if c.Vocab, err = need(r.VocabSize, "vocab_size"); err != nil {
		return nil, err
	}
	c.KVHeads = c.Heads
	if r.KVHeads != nil {
		if c.KVHeads, err = need(r.KVHeads, "num_key_value_heads"); err != nil {
			return nil, err
		}
	}
	if c.Heads%c.KVHeads != 0 {
		return nil, fmt.Errorf("%w: %d attention heads are not a multiple of %d key/value heads", ErrConfig, c.Heads, c.KVHeads)
	}
	switch {
	case r.HeadDim != nil:
		if c.HeadDim, err = need(r.HeadDim, "head_dim"); err != nil {
			return nil, err
		}
	case d.headDim != 0:
		c.HeadDim = d.headDim
	default:
		if c.Hidden%c.Heads != 0 {
			return nil, fmt.Errorf("%w: hidden_size %d is not a multiple of %d heads, and there is no head_dim", ErrConfig, c.Hidden, c.Heads)
		}
		c.HeadDim = c.Hidden / c.Heads
	}
	if c.HeadDim%2 != 0 {
		return nil, fmt.Errorf("%w: head_dim %d is odd; RoPE needs pairs", ErrConfig, c.HeadDim)
	}
	c.Eps, c.RopeTheta = d.eps, d.theta
	if r.RMSNormEps != nil {
		c.Eps = *r.RMSNormEps
	}
	if r.RopeTheta != nil {
		c.RopeTheta = *r.RopeTheta
	}
	if !(c.Eps > 0 && c.Eps < 1) || !(c.RopeTheta > 1) || math.IsInf(c.RopeTheta, 0) {
		return nil, fmt.Errorf("%w: rms_norm_eps %g or rope_theta %g out of range", ErrConfig, c.Eps, c.RopeTheta)
	}
	if r.MaxPositions != nil {
		c.MaxPositions = max(*r.MaxPositions, 0)
	}
	c.Tied = r.Tie != nil && *r.Tie
	if r.AttentionBias != nil && *r.AttentionBias {
		c.QKVBias, c.OBias = true, true
	}
	c.MLPBias = r.MLPBias != nil && *r.MLPBias
	if r.HiddenAct != "" && r.HiddenAct != "silu" {
		return nil, fmt.Errorf("%w: hidden_act %q (mlxstage implements silu)", ErrUnsupported, r.HiddenAct)
	}
	if r.UseSlidingWindow != nil && *r.UseSlidingWindow {
		return nil, fmt.Errorf("%w: sliding-window attention (use_sliding_window) is not implemented", ErrUnsupported)
	}
	if r.PartialRotary != nil && *r.PartialRotary != 1 {
		return nil, fmt.Errorf("%w: partial_rotary_factor %g is not implemented", ErrUnsupported, *r.PartialRotary)
	}
	if len(r.QuantizationConfig) > 0 && string(r.QuantizationConfig) != "null" {
		return nil, fmt.Errorf("%w: the weights are pre-quantized (quantization_config); mlxstage loads F32/F16/BF16 weights and quantizes at load time", ErrUnsupported)
	}
	if c.RopeScaling, err = parseRopeScaling(r.RopeScaling); err != nil {
		return nil, err
	}
	c.DType = r.TorchDType
	if c.DType == "" {
		c.DType = r.DType
	}
	if c.BOS, err = tokenIDs(r.BOS, "bos_token_id"); err != nil {
		return nil, err
	}
	if c.EOS, err = tokenIDs(r.EOS, "eos_token_id"); err != nil {
		return nil, err
	}
	return c, nil
}

// tokenIDs reads a token id field, which is a number, a list or null.
func tokenIDs(raw json.RawMessage, key string) ([]int, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return nil, nil
	}
	var one int
	if json.Unmarshal(raw, &one) == nil {
		return []int{one}, nil
	}
	var many []int
	if err := json.Unmarshal(raw, &many); err != nil {
		return nil, fmt.Errorf("%w: %s is neither an id nor a list of ids", ErrConfig, key)
	}
	return many, nil
}

func parseRopeScaling(raw json.RawMessage) (*RopeScaling, error) {
	if len(raw) == 0 || string(raw) == "null" {
		return nil, nil
	}
	var r struct {
		Type           string   `json:"type"`
		RopeType       string   `json:"rope_type"`
		Factor         *float64 `json:"factor"`
		LowFreqFactor  float64  `json:"low_freq_factor"`
		HighFreqFactor float64  `json:"high_freq_factor"`
		Original       int      `json:"original_max_position_embeddings"`
	}
	if err := json.Unmarshal(raw, &r); err != nil {
		return nil, fmt.Errorf("%w: rope_scaling: %w", ErrConfig, err)
	}
	s := &RopeScaling{Type: r.RopeType, LowFreqFactor: r.LowFreqFactor, HighFreqFactor: r.HighFreqFactor, OriginalMaxPositions: r.Original}
	if s.Type == "" {
		s.Type = r.Type
	}
	if s.Type == "default" || s.Type == "" {
		return nil, nil
	}
	if r.Factor == nil || !(*r.Factor > 0) {
		return nil, fmt.Errorf("%w: rope_scaling %s needs a positive factor", ErrConfig, s.Type)
	}
	s.Factor = *r.Factor
	switch s.Type {
	case "linear":
	case "llama3":
		if !(s.LowFreqFactor > 0) || !(s.HighFreqFactor > s.LowFreqFactor) || s.OriginalMaxPositions <= 0 {
			return nil, fmt.Errorf("%w: llama3 rope_scaling needs 0 < low_freq_factor < high_freq_factor and original_max_position_embeddings", ErrConfig)
		}
	default:
		return nil, fmt.Errorf("%w: rope_scaling type %q (mlxstage implements linear and llama3)", ErrUnsupported, s.Type)
	}
	return s, nil
}

// InvFreq is RoPE's inverse frequency of each rotated pair, base^(-2i/d)
// for i < d/2 with d the head dimension, rescaled as rope_scaling says.
// It is computed in float64 and rounded once.
func (c *Config) InvFreq() []float32 {
	d := c.HeadDim
	out := make([]float32, d/2)
	for i := range out {
		f := math.Pow(c.RopeTheta, -float64(2*i)/float64(d))
		if s := c.RopeScaling; s != nil {
			switch s.Type {
			case "linear":
				f /= s.Factor
			case "llama3":
				f = llama3Scale(f, s)
			}
		}
		out[i] = float32(f)
	}
	return out
}

// llama3Scale is Llama 3.1's rescaling of one frequency: wavelengths shorter
// than the original context over high_freq_factor are kept, those longer than
// it over low_freq_factor are divided by factor, and those between are
// interpolated linearly in context/wavelength.
func llama3Scale(f float64, s *RopeScaling) float64 {
	orig := float64(s.OriginalMaxPositions)
	wavelen := 2 * math.Pi / f
	switch {
	case wavelen < orig/s.HighFreqFactor:
		return f
	case wavelen > orig/s.LowFreqFactor:
		return f / s.Factor
	}
	smooth := (orig/wavelen - s.LowFreqFactor) / (s.HighFreqFactor - s.LowFreqFactor)
	return (1-smooth)*f/s.Factor + smooth*f
}
