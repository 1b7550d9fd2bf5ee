package ggufstage

import (
	"fmt"
	"io"

	"github.com/meshnode/meshnode/ggufstage/gguf"
	"github.com/meshnode/meshnode/stage"
)

// ModelInfo is what a GGUF says about its model, read without loading it.
type ModelInfo struct {
	Arch     string
	Name     string
	Layers   int
	Embd     int
	Heads    int
	KVHeads  int
	HeadDim  int
	Vocab    int
	Context  int    // trained context length
	FileType string // dominant weight type, e.g. "Q4_0"
	header   *gguf.File
}

// ReadInfo reads and validates a GGUF's header.
func ReadInfo(path string) (ModelInfo, error) {
	f, err := readHeader(path)
	if err != nil {
		return ModelInfo{}, err
	}
	mi, err := infoOf(f)
	if err != nil {
		return ModelInfo{}, fmt.Errorf("reading %s: %w", path, err)
	}
	return mi, nil
}

func infoOf(f *gguf.File) (ModelInfo, error) {
	if err := checkArch(f.Arch()); err != nil {
		return ModelInfo{}, err
	}
	layers, err := f.BlockCount()
	if err != nil {
		return ModelInfo{}, err
	}
	u := func(k string) int { v, _ := f.ArchUint(k); return int(v) }
	mi := ModelInfo{
		Arch: f.Arch(), Name: f.String("general.name"), Layers: layers,
		Embd: u("embedding_length"), Heads: u("attention.head_count"), KVHeads: u("attention.head_count_kv"),
		HeadDim: u("attention.key_length"), Context: u("context_length"), header: f,
	}
	if mi.Embd == 0 || mi.Heads == 0 {
		return ModelInfo{}, fmt.Errorf("%w: embedding_length or head_count missing", gguf.ErrFormat)
	}
	// A slice holds the tensors of its own range; a model those of all.
	start, end := 0, layers
	if s, ok := f.Get(gguf.KeySliceStart); ok {
		e, _ := f.Get(gguf.KeySliceEnd)
		su, _ := s.Uint()
		eu, _ := e.Uint()
		start, end = int(su), int(eu)
	}
	if err := checkTensors(f, start, end, layers); err != nil {
		return ModelInfo{}, err
	}
	if mi.KVHeads == 0 {
		mi.KVHeads = mi.Heads
	}
	if mi.HeadDim == 0 {
		mi.HeadDim = mi.Embd / mi.Heads
	}
	if t, ok := f.Tensor("token_embd.weight"); ok && len(t.Shape) == 2 {
		mi.Vocab = int(t.Shape[1])
	}
	// The type holding most bytes names the file's quantization.
	bytes := map[string]uint64{}
	for i := range f.Tensors {
		bytes[f.Tensors[i].TypeName()] += f.Tensors[i].Size()
	}
	var best uint64
	for name, n := range bytes {
		if n > best {
			mi.FileType, best = name, n
		}
	}
	return mi, nil
}

// Memory estimates what a stage [start,end) costs: its tensors' bytes, K and
// V per cached token (f16) across its layers, and scratch for a forward pass
// of batch tokens.
func (mi ModelInfo) Memory(start, end, batch int) (stage.Memory, error) {
	parts, err := gguf.StageParts(mi.header, start, end)
	if err != nil {
		return stage.Memory{}, err
	}
	m := stage.Memory{Weights: gguf.PartsSize(parts)}
	m.KVPerToken = uint64(end-start) * 2 * uint64(mi.KVHeads*mi.HeadDim) * 2
	// Activations of the widest layer op (the FFN or the logits) in f32.
	ffn, _ := mi.header.ArchUint("feed_forward_length")
	width := max(uint64(mi.Embd)*4, ffn*2)
	if end == mi.Layers {
		width = max(width, uint64(mi.Vocab))
	}
	m.Compute = uint64(batch) * width * 4 * 2
	return m, nil
}

// Sizes breaks the model's bytes down the way a planner places them: each
// block's tensors, the embedding (first stage), the head (last stage; for
// a tied head, a copy of the embedding), and K+V bytes per cached token per
// layer in f16.
func (mi ModelInfo) Sizes() (perLayer []uint64, embed, head, kvPerTokenPerLayer uint64) {
	perLayer = make([]uint64, mi.Layers)
	hasOutput := false
	for i := range mi.header.Tensors {
		t := &mi.header.Tensors[i]
		switch b := gguf.Block(t.Name); {
		case b >= 0 && b < mi.Layers:
			perLayer[b] += t.Size()
		case t.Name == "token_embd.weight":
			embed += t.Size()
		case t.Name == "output.weight":
			hasOutput = true
			head += t.Size()
		case t.Name == "output_norm.weight":
			head += t.Size()
		}
	}
	if !hasOutput {
		head += embed
	}
	return perLayer, embed, head, 2 * uint64(mi.KVHeads*mi.HeadDim) * 2
}

// ReadInfoFrom reads a GGUF header from any source of its bytes (a peer, a
// remote file) of the given size.
func ReadInfoFrom(r io.ReaderAt, size int64) (ModelInfo, error) {
	f, err := gguf.Read(io.NewSectionReader(r, 0, size), size)
	if err != nil {
		return ModelInfo{}, err
	}
	return infoOf(f)
}

// InfoOf describes a header already read.
func InfoOf(f *gguf.File) (ModelInfo, error) { return infoOf(f) }
