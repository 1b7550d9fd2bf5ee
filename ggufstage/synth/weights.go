package synth

import (
	"encoding/binary"
	"fmt"
	"hash/fnv"
	"io"
	"math"
	"math/rand/v2"

	fsggml "github.com/ollama/ollama/fs/ggml"
	"github.com/ollama/ollama/ml/backend/ggml"
)

// chunkElems bounds the floats generated at once per tensor (4 MiB), which
// with WriteGGUF's one writer per CPU bounds Write's memory.
const chunkElems = 1 << 20

// normal draws approximately standard normal values: the sum of four 16-bit
// uniforms from one PCG output (Irwin-Hall). One generator call and no
// branches per value matters for billions of weights; the tails stopping at
// ±3.46σ does not matter for synthetic ones.
type normal struct{ src *rand.PCG }

// newNormal seeds a stream per tensor, so values depend only on the seed and
// the tensor name: files write the same regardless of scheduling, and all
// file types of one seed quantize the same underlying weights.
func newNormal(seed uint64, name string) normal {
	h := fnv.New64a()
	h.Write([]byte(name))
	return normal{rand.NewPCG(seed, h.Sum64())}
}

// irwinHallStd is the standard deviation of a sum of four uniform 16-bit
// integers: 2 * 65536/sqrt(12).
const irwinHallStd = 37837.23

// fill sets vals to mean + std*N(0,1) draws. The centering and scaling are
// folded into one integer subtraction and one multiply per value.
func (n normal) fill(vals []float32, mean, std float32) {
	scale := std / irwinHallStd
	for i := range vals {
		u := n.src.Uint64()
		s := int64(u&0xffff + u>>16&0xffff + u>>32&0xffff + u>>48)
		vals[i] = mean + float32(s-2*65535)*scale
	}
}

// generator produces one tensor's data on demand for WriteGGUF.
type generator struct {
	t        tensorSpec
	seed     uint64
	progress *tracker
}

func (g *generator) WriteTo(w io.Writer) (int64, error) {
	ne0, rows := g.t.shape[0], g.t.rows()
	chunkRows := max(1, chunkElems/ne0)
	rng := newNormal(g.seed, g.t.name)
	f32 := make([]float32, min(chunkRows, rows)*ne0)
	var raw []byte
	var written int64
	for r := uint64(0); r < rows; r += chunkRows {
		k := min(chunkRows, rows-r)
		vals := f32[:k*ne0]
		rng.fill(vals, g.t.dist.mean, g.t.dist.std)
		var b []byte
		if g.t.kind == fsggml.TensorTypeF32 {
			raw = raw[:0]
			for _, v := range vals {
				raw = binary.LittleEndian.AppendUint32(raw, math.Float32bits(v))
			}
			b = raw
		} else {
			b = ggml.Quantize(g.t.kind, vals, []uint64{ne0, k})
		}
		n, err := w.Write(b)
		written += int64(n)
		if err != nil {
			return written, fmt.Errorf("synth: %s: %w", g.t.name, err)
		}
		g.progress.add(n)
	}
	if uint64(written) != g.t.size() {
		return written, fmt.Errorf("synth: %s: wrote %d bytes, want %d: %w", g.t.name, written, g.t.size(), errShortTensor)
	}
	return written, nil
}
