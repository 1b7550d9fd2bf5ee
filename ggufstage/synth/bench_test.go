package synth

import (
	"testing"

	fsggml "github.com/ollama/ollama/fs/ggml"
	"github.com/ollama/ollama/ml/backend/ggml"
)

// Throughput of the two halves of writing a tensor (SetBytes counts values).
func BenchmarkNormal(b *testing.B) {
	rng := newNormal(1, "x")
	buf := make([]float32, chunkElems)
	b.SetBytes(int64(len(buf)))
	for b.Loop() {
		rng.fill(buf, 0, 0.02)
	}
}

func BenchmarkQuantize(b *testing.B) {
	rng := newNormal(1, "x")
	buf := make([]float32, chunkElems)
	rng.fill(buf, 0, 1)
	for _, k := range []fsggml.TensorType{fsggml.TensorTypeF16, fsggml.TensorTypeQ8_0, fsggml.TensorTypeQ4_0, fsggml.TensorTypeQ4_K, fsggml.TensorTypeQ6_K} {
		b.Run(k.String(), func(b *testing.B) {
			b.SetBytes(int64(len(buf)))
			for b.Loop() {
				ggml.Quantize(k, buf, []uint64{2048, uint64(len(buf) / 2048)})
			}
		})
	}
}
