package synthst

import (
	"bytes"
	"encoding/json"
	"os"
	"path/filepath"
	"strings"
	"testing"

	"github.com/meshnode/meshnode/ggufstage/synth"
	"github.com/meshnode/meshnode/mlxstage/safetensors"
)

func TestUnpermute(t *testing.T) {
	// One head of d=4 rows of one byte: GGUF rows 0,1,2,3 hold HF rows
	// 0,2,1,3 (the halves interleaved).
	got := unpermute([]byte{'a', 'c', 'b', 'd', 'e', 'g', 'f', 'h'}, 2, 4)
	if string(got) != "abcdefgh" {
		t.Errorf("unpermute = %q", got)
	}
}

func TestTwinFiles(t *testing.T) {
	dir := t.TempDir()
	g, hf := filepath.Join(dir, "m.gguf"), filepath.Join(dir, "hf")
	if err := Write(g, hf, synth.Tiny("qwen3"), Options{Shards: 2}); err != nil {
		t.Fatal(err)
	}
	m, err := safetensors.OpenModel(safetensors.Dir(hf))
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	names, _ := m.Names()
	// 3 blocks of 11 tensors, the embedding and the final norm; tied head.
	if len(names) != 3*11+2 || !m.Sharded() {
		t.Errorf("%d tensors, sharded %v", len(names), m.Sharded())
	}
	for _, n := range names {
		if _, _, err := m.ReadTensor(n, nil); err != nil {
			t.Fatal(err)
		}
	}
	raw, _ := os.ReadFile(filepath.Join(hf, "config.json"))
	var cfg map[string]any
	json.Unmarshal(raw, &cfg)
	if cfg["tie_word_embeddings"] != true || cfg["head_dim"] != 32.0 || cfg["architectures"].([]any)[0] != "Qwen3ForCausalLM" {
		t.Errorf("config %s", raw)
	}
	tc, _ := os.ReadFile(filepath.Join(hf, "tokenizer_config.json"))
	if !bytes.Contains(tc, []byte("<|im_start|>")) {
		t.Error("chat template missing from tokenizer_config.json")
	}
}

func TestQuantizedRefused(t *testing.T) {
	dir := t.TempDir()
	spec := synth.Tiny("llama")
	spec.Type = synth.Q8_0
	g := filepath.Join(dir, "q.gguf")
	if err := synth.Write(g, spec, nil); err != nil {
		t.Fatal(err)
	}
	err := FromGGUF(g, filepath.Join(dir, "hf"), Options{})
	if err == nil || !strings.Contains(err.Error(), "only F32, F16 and BF16") {
		t.Errorf("Q8_0 GGUF: %v", err)
	}
}

// TestStoriesTwin transcodes the real stories260K.gguf and compares every
// tensor with the independently converted stories260K-hf: the names, the
// shapes and the bytes, q/k row order included.
func TestStoriesTwin(t *testing.T) {
	const gguf, ref = "../../../shared/models/stories260K.gguf", "../../../shared/models/stories260K-hf"
	if _, err := os.Stat(gguf); err != nil {
		t.Skip(err)
	}
	out := t.TempDir()
	if err := FromGGUF(gguf, out, Options{}); err != nil {
		t.Fatal(err)
	}
	got, err := safetensors.OpenModel(safetensors.Dir(out))
	if err != nil {
		t.Fatal(err)
	}
	defer got.Close()
	want, err := safetensors.OpenModel(safetensors.Dir(ref))
	if err != nil {
		t.Fatal(err)
	}
	defer want.Close()
	gn, _ := got.Names()
	wn, _ := want.Names()
	if strings.Join(gn, " ") != strings.Join(wn, " ") {
		t.Fatalf("names differ:\n got %v\nwant %v", gn, wn)
	}
	for _, n := range wn {
		a, ta, _ := got.ReadTensor(n, nil)
		b, tb, _ := want.ReadTensor(n, nil)
		if !bytes.Equal(a, b) || ta.DType != tb.DType || len(ta.Shape) != len(tb.Shape) {
			t.Errorf("%s differs", n)
		}
	}
	raw, _ := os.ReadFile(filepath.Join(out, "config.json"))
	var cfg map[string]any
	json.Unmarshal(raw, &cfg)
	if cfg["rope_theta"] != 10000.0 || cfg["rms_norm_eps"] != 1e-05 {
		t.Errorf("config %s", raw)
	}
}
