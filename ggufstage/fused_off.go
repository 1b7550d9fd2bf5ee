//go:build !repack || !cgo

package ggufstage

import (
	"fmt"

	"github.com/ollama/ollama/ml"

	"github.com/meshnode/meshnode/ggufstage/gguf"
)

// FusedLibrary is the file name deploy/gpu/build-cuda.sh gives the fused
// path's library, beside ggml's CUDA backend.
const FusedLibrary = "libmeshnode-fused.so"

func newFused(*Engine, *gguf.File, bool, ml.DType) (fusedPath, error) {
	return nil, loadFusedLibrary()
}

func loadFusedLibrary() error {
	return fmt.Errorf("%w: not in this build (it needs cgo and the repack tag)", errFusedUnavailable)
}
