package mlxstage

import (
	"errors"
	"math"
	"testing"
)

func TestParseConfigDefaults(t *testing.T) {
	c, err := ParseConfig([]byte(`{"architectures":["Qwen2ForCausalLM"],"hidden_size":896,"num_hidden_layers":24,
		"num_attention_heads":14,"num_key_value_heads":2,"intermediate_size":4864,"vocab_size":151936,
		"rope_theta":1000000.0,"rms_norm_eps":1e-06,"tie_word_embeddings":true,"use_sliding_window":false,
		"max_position_embeddings":32768,"torch_dtype":"bfloat16","eos_token_id":151643,"hidden_act":"silu"}`))
	if err != nil {
		t.Fatal(err)
	}
	if c.Arch != "qwen2" || c.HeadDim != 64 || !c.QKVBias || c.OBias || c.QKNorm || !c.Tied || c.KVHeads != 2 || c.RopeTheta != 1e6 || len(c.EOS) != 1 {
		t.Errorf("qwen2: %+v", c)
	}
	// Qwen3: head_dim defaults to 128 rather than hidden/heads, q/k norms.
	c, err = ParseConfig([]byte(`{"model_type":"qwen3","hidden_size":1024,"num_hidden_layers":28,
		"num_attention_heads":16,"num_key_value_heads":8,"intermediate_size":3072,"vocab_size":151936,"eos_token_id":[1,2]}`))
	if err != nil {
		t.Fatal(err)
	}
	if c.Arch != "qwen3" || c.HeadDim != 128 || !c.QKNorm || c.QKVBias || c.Eps != 1e-6 || c.RopeTheta != 10000 || len(c.EOS) != 2 {
		t.Errorf("qwen3: %+v", c)
	}
	// Llama: no kv heads means MHA; attention_bias adds all four biases.
	c, err = ParseConfig([]byte(`{"architectures":["LlamaForCausalLM"],"hidden_size":64,"num_hidden_layers":2,
		"num_attention_heads":8,"intermediate_size":172,"vocab_size":512,"attention_bias":true,"mlp_bias":true}`))
	if err != nil {
		t.Fatal(err)
	}
	if c.KVHeads != 8 || c.HeadDim != 8 || !c.QKVBias || !c.OBias || !c.MLPBias || c.Tied {
		t.Errorf("llama: %+v", c)
	}
}

func TestParseConfigErrors(t *testing.T) {
	base := `"hidden_size":64,"num_hidden_layers":2,"num_attention_heads":8,"intermediate_size":172,"vocab_size":512`
	for name, c := range map[string]struct {
		json string
		want error
	}{
		"not json":       {`{`, ErrConfig},
		"gpt2":           {`{"architectures":["GPT2LMHeadModel"],` + base + `}`, ErrUnsupported},
		"no hidden":      {`{"architectures":["LlamaForCausalLM"],"num_hidden_layers":2}`, ErrConfig},
		"gqa":            {`{"architectures":["LlamaForCausalLM"],` + base + `,"num_key_value_heads":3}`, ErrConfig},
		"gelu":           {`{"architectures":["LlamaForCausalLM"],` + base + `,"hidden_act":"gelu"}`, ErrUnsupported},
		"sliding":        {`{"architectures":["Qwen2ForCausalLM"],` + base + `,"use_sliding_window":true}`, ErrUnsupported},
		"yarn":           {`{"architectures":["Qwen3ForCausalLM"],` + base + `,"rope_scaling":{"rope_type":"yarn","factor":4}}`, ErrUnsupported},
		"prequantized":   {`{"architectures":["LlamaForCausalLM"],` + base + `,"quantization_config":{"bits":4}}`, ErrUnsupported},
		"odd head":       {`{"architectures":["LlamaForCausalLM"],` + base + `,"head_dim":7}`, ErrConfig},
		"negative layer": {`{"architectures":["LlamaForCausalLM"],"hidden_size":64,"num_hidden_layers":-2,"num_attention_heads":8,"intermediate_size":172,"vocab_size":512}`, ErrConfig},
		"eps":            {`{"architectures":["LlamaForCausalLM"],` + base + `,"rms_norm_eps":0}`, ErrConfig},
	} {
		if _, err := ParseConfig([]byte(c.json)); !errors.Is(err, c.want) {
			t.Errorf("%s: %v, want %v", name, err, c.want)
		}
	}
}

func TestInvFreq(t *testing.T) {
	c := &Config{HeadDim: 8, RopeTheta: 10000}
	f := c.InvFreq()
	want := []float64{1, 0.1, 0.01, 0.001}
	for i := range f {
		if math.Abs(float64(f[i])-want[i]) > 1e-7*want[i] {
			t.Errorf("inv freq %d = %g, want %g", i, f[i], want[i])
		}
	}
	// Llama 3.1's scaling keeps short wavelengths, divides long ones by
	// the factor and interpolates between.
	c = &Config{HeadDim: 128, RopeTheta: 500000, RopeScaling: &RopeScaling{Type: "llama3", Factor: 8, LowFreqFactor: 1, HighFreqFactor: 4, OriginalMaxPositions: 8192}}
	plain := (&Config{HeadDim: 128, RopeTheta: 500000}).InvFreq()
	scaled := c.InvFreq()
	if scaled[0] != plain[0] {
		t.Errorf("highest frequency changed: %g vs %g", scaled[0], plain[0])
	}
	last := len(plain) - 1
	if math.Abs(float64(scaled[last]*8-plain[last])) > 1e-6*float64(plain[last]) {
		t.Errorf("lowest frequency %g, want %g/8", scaled[last], plain[last])
	}
	for i := range plain {
		if r := plain[i] / scaled[i]; r < 1-1e-6 || r > 8+1e-5 {
			t.Errorf("frequency %d scaled by 1/%g", i, r)
		}
	}
}
