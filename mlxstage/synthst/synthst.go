// Package synthst writes Hugging Face twins of GGUF models: a directory with
// config.json, safetensors weights (one file, or shards with an index),
// tokenizer.json and tokenizer_config.json that hold exactly the weights and
// vocabulary of the GGUF. With ggufstage/synth it makes random models of the
// supported architectures available to both engines, so that mlxstage can be
// checked against ggufstage on the same weights.
//
// Weights are transcoded, not regenerated: each tensor is read back from the
// GGUF and written under its Hugging Face name, unchanged except for the
// llama q/k projections, whose rows llama.cpp's converter interleaves for
// ggml's adjacent-pair RoPE and which are put back in the rotate-half order
// Hugging Face's RoPE expects. qwen2 and qwen3 GGUFs already use rotate-half
// (ggml's NeoX mode), so nothing is permuted for them.
package synthst

import (
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"os"
	"path/filepath"
	"slices"
	"strconv"
	"strings"

	"github.com/meshnode/meshnode/ggufstage/gguf"
	"github.com/meshnode/meshnode/ggufstage/synth"
	"github.com/meshnode/meshnode/mlxstage/safetensors"
)

// Options shape the output.
type Options struct {
	// Shards splits the weights into that many files with a
	// model.safetensors.index.json; 0 or 1 writes one model.safetensors.
	Shards int
}

// Write generates spec as a GGUF at ggufPath (with ggufstage/synth) and its
// Hugging Face twin in dir.
func Write(ggufPath, dir string, spec synth.Spec, opts Options) error {
	if err := synth.Write(ggufPath, spec, nil); err != nil {
		return err
	}
	return FromGGUF(ggufPath, dir, opts)
}

// classes maps GGUF architectures to Hugging Face model classes.
var classes = map[string]string{"llama": "LlamaForCausalLM", "qwen2": "Qwen2ForCausalLM", "qwen3": "Qwen3ForCausalLM"}

// names maps GGUF tensor names (without "blk.N.") to Hugging Face ones
// (without "model.layers.N.").
var names = map[string]string{
	"attn_norm.weight":   "input_layernorm.weight",
	"attn_q.weight":      "self_attn.q_proj.weight",
	"attn_k.weight":      "self_attn.k_proj.weight",
	"attn_v.weight":      "self_attn.v_proj.weight",
	"attn_output.weight": "self_attn.o_proj.weight",
	"attn_q.bias":        "self_attn.q_proj.bias",
	"attn_k.bias":        "self_attn.k_proj.bias",
	"attn_v.bias":        "self_attn.v_proj.bias",
	"attn_output.bias":   "self_attn.o_proj.bias",
	"attn_q_norm.weight": "self_attn.q_norm.weight",
	"attn_k_norm.weight": "self_attn.k_norm.weight",
	"ffn_norm.weight":    "post_attention_layernorm.weight",
	"ffn_gate.weight":    "mlp.gate_proj.weight",
	"ffn_up.weight":      "mlp.up_proj.weight",
	"ffn_down.weight":    "mlp.down_proj.weight",
}

// HFName is the Hugging Face name of a GGUF tensor, or "" if it has none.
func HFName(name string) string {
	switch name {
	case "token_embd.weight":
		return "model.embed_tokens.weight"
	case "output_norm.weight":
		return "model.norm.weight"
	case "output.weight":
		return "lm_head.weight"
	}
	b := gguf.Block(name)
	if b < 0 {
		return ""
	}
	rest := strings.TrimPrefix(name, "blk."+strconv.Itoa(b)+".")
	if hf, ok := names[rest]; ok {
		return "model.layers." + strconv.Itoa(b) + "." + hf
	}
	return ""
}

// dtypes are the GGUF tensor types that have a safetensors equivalent.
var dtypes = map[uint32]safetensors.DType{gguf.TypeF32: safetensors.F32, gguf.TypeF16: safetensors.F16, gguf.TypeBF16: safetensors.BF16}

// header is what FromGGUF needs from the GGUF metadata.
type header struct {
	arch                                  string
	layers, embd, ffn, heads, kvHeads, hd int
	vocab, ctx                            int
	eps, ropeBase                         float32
	hasRopeBase, tied                     bool
}

func readHeader(f *gguf.File) (header, error) {
	h := header{arch: f.Arch()}
	if _, ok := classes[h.arch]; !ok {
		return h, fmt.Errorf("synthst: architecture %q has no Hugging Face class here (llama, qwen2, qwen3)", h.arch)
	}
	u := func(k string) int { v, _ := f.ArchUint(k); return int(v) }
	var err error
	if h.layers, err = f.BlockCount(); err != nil {
		return h, err
	}
	h.embd, h.ffn, h.heads, h.kvHeads = u("embedding_length"), u("feed_forward_length"), u("attention.head_count"), u("attention.head_count_kv")
	h.hd, h.ctx = u("attention.key_length"), u("context_length")
	if h.embd == 0 || h.heads == 0 || h.ffn == 0 {
		return h, fmt.Errorf("synthst: %w: embedding_length, head_count or feed_forward_length missing", gguf.ErrFormat)
	}
	if h.kvHeads == 0 {
		h.kvHeads = h.heads
	}
	if h.hd == 0 {
		h.hd = h.embd / h.heads
	}
	if v, ok := f.Get(h.arch + ".attention.layer_norm_rms_epsilon"); ok {
		h.eps, _ = v.V.(float32)
	}
	if v, ok := f.Get(h.arch + ".rope.freq_base"); ok {
		h.ropeBase, h.hasRopeBase = v.V.(float32)
	}
	emb, ok := f.Tensor("token_embd.weight")
	if !ok || len(emb.Shape) != 2 {
		return h, fmt.Errorf("synthst: %w: no token_embd.weight", gguf.ErrFormat)
	}
	h.vocab = int(emb.Shape[1])
	_, hasOut := f.Tensor("output.weight")
	h.tied = !hasOut
	return h, nil
}

// FromGGUF writes the Hugging Face twin of the GGUF at src into dir, which
// is created if needed. The GGUF's tensors must be F32, F16 or BF16.
func FromGGUF(src, dir string, opts Options) error {
	in, err := os.Open(src)
	if err != nil {
		return fmt.Errorf("synthst: %w", err)
	}
	defer in.Close()
	st, err := in.Stat()
	if err != nil {
		return fmt.Errorf("synthst: %w", err)
	}
	meta, err := gguf.Read(in, st.Size())
	if err != nil {
		return fmt.Errorf("synthst: reading %s: %w", src, err)
	}
	h, err := readHeader(meta)
	if err != nil {
		return err
	}
	if err := os.MkdirAll(dir, 0o755); err != nil {
		return fmt.Errorf("synthst: %w", err)
	}

	// Plan the tensors in block order, so that shards hold whole layers
	// as real checkpoints do.
	type planned struct {
		src *gguf.TensorInfo
		dst safetensors.Tensor
	}
	var plan []planned
	for i := range meta.Tensors {
		t := &meta.Tensors[i]
		name := HFName(t.Name)
		if name == "" {
			return fmt.Errorf("synthst: tensor %s has no Hugging Face equivalent", t.Name)
		}
		dt, ok := dtypes[t.Type]
		if !ok {
			return fmt.Errorf("synthst: tensor %s is %s; only F32, F16 and BF16 transcode exactly", t.Name, t.TypeName())
		}
		shape := make([]int64, len(t.Shape))
		for j, d := range t.Shape {
			shape[len(shape)-1-j] = int64(d) // GGUF lists the innermost first
		}
		plan = append(plan, planned{t, safetensors.Tensor{Name: name, DType: dt, Shape: shape}})
	}
	slices.SortStableFunc(plan, func(a, b planned) int {
		ba, bb := gguf.Block(a.src.Name), gguf.Block(b.src.Name)
		if ba != bb {
			return ba - bb
		}
		return strings.Compare(a.dst.Name, b.dst.Name)
	})

	shards := max(opts.Shards, 1)
	if shards > len(plan) {
		return fmt.Errorf("synthst: %d shards for %d tensors", shards, len(plan))
	}
	weightMap := map[string]string{}
	var total int64
	for s := range shards {
		part := plan[s*len(plan)/shards : (s+1)*len(plan)/shards]
		file := safetensors.SingleName
		if shards > 1 {
			file = fmt.Sprintf("model-%05d-of-%05d.safetensors", s+1, shards)
		}
		ts := make([]safetensors.Tensor, len(part))
		for i, p := range part {
			ts[i] = p.dst
			weightMap[p.dst.Name] = file
		}
		hdr, laid, err := safetensors.Header(ts, map[string]string{"format": "pt"})
		if err != nil {
			return fmt.Errorf("synthst: %w", err)
		}
		err = writeFile(filepath.Join(dir, file), func(w io.Writer) error {
			if _, err := w.Write(hdr); err != nil {
				return err
			}
			for i, p := range part {
				off, n := meta.Range(p.src)
				if int64(n) != laid[i].Length {
					return fmt.Errorf("tensor %s: %d bytes in the GGUF, %d in safetensors", p.src.Name, n, laid[i].Length)
				}
				buf := make([]byte, n)
				if _, err := in.ReadAt(buf, int64(off)); err != nil {
					return fmt.Errorf("reading %s: %w", p.src.Name, err)
				}
				if h.arch == "llama" {
					rest := strings.TrimPrefix(p.src.Name, "blk."+strconv.Itoa(gguf.Block(p.src.Name))+".")
					switch rest {
					case "attn_q.weight", "attn_q.bias":
						buf = unpermute(buf, h.heads, h.hd)
					case "attn_k.weight", "attn_k.bias":
						buf = unpermute(buf, h.kvHeads, h.hd)
					}
				}
				if _, err := w.Write(buf); err != nil {
					return err
				}
				total += int64(n)
			}
			return nil
		})
		if err != nil {
			return err
		}
	}
	if shards > 1 {
		ix := safetensors.Index{Metadata: map[string]any{"total_size": total}, WeightMap: weightMap}
		if err := writeJSON(filepath.Join(dir, safetensors.IndexName), ix); err != nil {
			return err
		}
	}
	if err := writeJSON(filepath.Join(dir, "config.json"), config(h, meta)); err != nil {
		return err
	}
	gen := map[string]any{"do_sample": false}
	if v, ok := metaUint(meta, "tokenizer.ggml.bos_token_id"); ok {
		gen["bos_token_id"] = v
	}
	if v, ok := metaUint(meta, "tokenizer.ggml.eos_token_id"); ok {
		gen["eos_token_id"] = v
	}
	if err := writeJSON(filepath.Join(dir, "generation_config.json"), gen); err != nil {
		return err
	}
	return writeTokenizer(dir, meta, h)
}

// unpermute puts the rows of a llama q or k projection (or bias) back in
// Hugging Face's order. buf is heads*d rows of equal size. llama.cpp's
// converter stores, within each head, HF row p*d/2+j at row 2j+p (p = 0, 1;
// j < d/2): the two elements that rotate-half RoPE pairs become adjacent, as
// ggml's default RoPE pairs them.
func unpermute(buf []byte, heads, d int) []byte {
	rows := heads * d
	rb := len(buf) / rows
	out := make([]byte, len(buf))
	for h := range heads {
		for j := range d / 2 {
			for p := range 2 {
				src := h*d + 2*j + p
				dst := h*d + p*d/2 + j
				copy(out[dst*rb:(dst+1)*rb], buf[src*rb:(src+1)*rb])
			}
		}
	}
	return out
}

func metaUint(f *gguf.File, key string) (uint64, bool) {
	v, ok := f.Get(key)
	if !ok {
		return 0, false
	}
	return v.Uint()
}

// config is config.json for the model.
func config(h header, f *gguf.File) map[string]any {
	c := map[string]any{
		"architectures":           []string{classes[h.arch]},
		"model_type":              h.arch,
		"hidden_size":             h.embd,
		"intermediate_size":       h.ffn,
		"num_hidden_layers":       h.layers,
		"num_attention_heads":     h.heads,
		"num_key_value_heads":     h.kvHeads,
		"head_dim":                h.hd,
		"vocab_size":              h.vocab,
		"max_position_embeddings": h.ctx,
		"hidden_act":              "silu",
		"tie_word_embeddings":     h.tied,
		"torch_dtype":             "float32",
		// float32 values written with float32's shortest decimal, as a
		// converter from the float32 GGUF metadata would.
		"rms_norm_eps": json.Number(strconv.FormatFloat(float64(h.eps), 'g', -1, 32)),
	}
	// llama.cpp's default when the key is absent is 10000.
	base := "10000"
	if h.hasRopeBase {
		base = strconv.FormatFloat(float64(h.ropeBase), 'g', -1, 32)
	}
	c["rope_theta"] = json.Number(base)
	if h.arch == "llama" {
		c["attention_bias"] = false
		c["mlp_bias"] = false
	}
	if h.arch == "qwen2" {
		c["use_sliding_window"] = false
	}
	if v, ok := metaUint(f, "tokenizer.ggml.bos_token_id"); ok {
		c["bos_token_id"] = v
	}
	if v, ok := metaUint(f, "tokenizer.ggml.eos_token_id"); ok {
		c["eos_token_id"] = v
	}
	return c
}

// writeJSON writes v indented, with <, > and & as themselves (as Hugging
// Face's files have them) rather than Go's HTML-safe escapes.
func writeJSON(path string, v any) error {
	return writeFile(path, func(w io.Writer) error {
		enc := json.NewEncoder(w)
		enc.SetEscapeHTML(false)
		enc.SetIndent("", "  ")
		return enc.Encode(v)
	})
}

// writeFile writes path through a temporary file, so that a failed write
// leaves no partial file under the final name.
func writeFile(path string, fill func(io.Writer) error) (err error) {
	f, err := os.CreateTemp(filepath.Dir(path), "."+filepath.Base(path)+".*.tmp")
	if err != nil {
		return fmt.Errorf("synthst: %w", err)
	}
	defer func() {
		if err != nil {
			f.Close()
			os.Remove(f.Name())
		}
	}()
	if err := fill(f); err != nil {
		return fmt.Errorf("synthst: writing %s: %w", path, err)
	}
	if err := f.Chmod(0o644); err != nil {
		return fmt.Errorf("synthst: %w", err)
	}
	if err := f.Close(); err != nil {
		return fmt.Errorf("synthst: %w", err)
	}
	if err := os.Rename(f.Name(), path); err != nil {
		return fmt.Errorf("synthst: %w", err)
	}
	return nil
}

var errNoVocab = errors.New("synthst: the GGUF has no tokenizer.ggml.tokens")
