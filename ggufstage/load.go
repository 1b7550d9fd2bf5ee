package ggufstage

import (
	"fmt"
	"io"
	"os"
	"strconv"

	"github.com/ollama/ollama/ml"

	"github.com/meshnode/meshnode/ggufstage/gguf"
)

// loadWeights reads every tensor of the file into the backend's tensors,
// one whole tensor at a time. ollama's own loader writes 128 KiB pieces;
// whole-tensor writes are what lets quantized weights move into ggml's
// repacked (interleaved) CPU layout as they are loaded, so that they never
// sit in memory twice. It returns the bytes held and a closer for the
// buffers it allocated itself.
func loadWeights(b ml.Backend, path string, meta *gguf.File, last, repack bool) (uint64, io.Closer, error) {
	f, err := os.Open(path)
	if err != nil {
		return 0, nil, fmt.Errorf("opening weights: %w", err)
	}
	defer f.Close()

	var rp *repacker
	if repack {
		rp = newRepacker()
	}
	layers, _ := meta.BlockCount()
	_, hasOutput := meta.Tensor("output.weight")

	var held uint64
	var buf []byte
	for i := range meta.Tensors {
		t := &meta.Tensors[i]
		targets := loadTargets(b, t.Name, layers, last && !hasOutput)
		if len(targets) == 0 {
			return 0, rp, fmt.Errorf("tensor %s of %s has no place in the model", t.Name, path)
		}
		off, n := meta.Range(t)
		if uint64(cap(buf)) < n {
			buf = make([]byte, n)
		}
		buf = buf[:n]
		if _, err := f.ReadAt(buf, int64(off)); err != nil {
			return 0, rp, fmt.Errorf("reading tensor %s: %w", t.Name, err)
		}
		for _, target := range targets {
			if rp != nil && rp.take(target, buf) {
				held += n
				continue
			}
			advise(target)
			target.FromBytes(buf)
			held += n
		}
	}
	return held, rp, nil
}

// loadTargets maps a file tensor to the backend tensors it fills: usually
// one of the same name; for a tied head on the last stage the embedding
// fills output.weight too; global rope factors are copied into every block
// by ollama.
//
// ollama also allocates a tied output.weight on a first stage that never
// uses it; leaving it unwritten keeps its pages from ever becoming resident.
func loadTargets(b ml.Backend, name string, layers int, tiedHead bool) []ml.Tensor {
	var ts []ml.Tensor
	if t := b.Get(name); t != nil {
		ts = append(ts, t)
	}
	if name == "token_embd.weight" && tiedHead {
		if t := b.Get("output.weight"); t != nil {
			ts = append(ts, t)
		}
	}
	if len(ts) == 0 {
		for i := range layers {
			if t := b.Get("blk." + strconv.Itoa(i) + "." + name); t != nil {
				ts = append(ts, t)
			}
		}
	}
	return ts
}
