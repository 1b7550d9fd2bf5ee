package mlx

import (
	"math"
	"math/rand/v2"
	"testing"

	"github.com/meshnode/meshnode/mlxstage/ops"
	"github.com/meshnode/meshnode/stage"
)

func randn(r *rand.Rand, n int) []float32 {
	v := make([]float32, n)
	for i := range v {
		v[i] = float32(r.NormFloat64())
	}
	return v
}

func maxDiff(a, b []float32) float64 {
	if len(a) != len(b) {
		return math.Inf(1)
	}
	var d float64
	for i := range a {
		d = max(d, math.Abs(float64(a[i]-b[i])))
	}
	return d
}

// TestOpsMatchReference runs the same sequence of operations on the
// emulated MLX backend and on the reference backend: grouped-query
// attention over two passes (the second continuing the cache, which has
// to grow), partial RoPE, a quantized embedding gather and a quantized
// Linear with a bias.
func TestOpsMatchReference(t *testing.T) {
	r := rand.New(rand.NewPCG(1, 2))
	const H, KVH, D, E, V = 4, 2, 8, 32, 10
	table := randn(r, V*E)
	wq := randn(r, H*D*E)
	bias := randn(r, H*D)
	pass := [][]float32{randn(r, 3*(H*D+2*KVH*D)), randn(r, 300*(H*D+2*KVH*D))}
	inv := []float32{1, 0.1, 0.01} // 6 of 8 dimensions rotate
	q := ops.Quant{Bits: 4, GroupSize: 32}

	run := func(be ops.Backend) [][]float32 {
		var out [][]float32
		ops.Run(be, func() {
			emb, _, err := be.Weight(f32Bytes(table), stage.F32, []int{V, E}, q)
			if err != nil {
				t.Fatal(err)
			}
			w, _, _ := be.Weight(f32Bytes(wq), stage.F32, []int{H * D, E}, q)
			b, _, _ := be.Weight(f32Bytes(bias), stage.F32, []int{H * D}, ops.Quant{})
			kv, _ := be.NewKV(KVH, D, 512)
			pos := 0
			for _, data := range pass {
				m := len(data) / (H*D + 2*KVH*D)
				c := be.NewContext()
				qs := c.Input(data[:m*H*D], m, H*D)
				ks := c.Input(data[m*H*D:m*(H*D+KVH*D)], m, KVH*D)
				vs := c.Input(data[m*(H*D+KVH*D):], m, KVH*D)
				p := make([]int32, m)
				for i := range p {
					p[i] = int32(pos + i)
				}
				pos += m
				qs = c.RoPE(qs, p, D, inv)
				ks = c.RoPE(ks, p, D, inv)
				a := c.Attend(kv, qs, ks, vs, H, 0.3)
				x := c.Embedding(emb, []int32{3, 0, 9})
				y := c.Linear(x, w, b)
				for _, tn := range []ops.Tensor{a, y, c.SiLU(y)} {
					f, err := c.Float32(tn)
					if err != nil {
						t.Fatal(err)
					}
					out = append(out, f)
				}
				c.Close()
			}
			if kv.Len() != pos {
				t.Errorf("cache holds %d positions, want %d", kv.Len(), pos)
			}
			kv.Free()
			for _, x := range []ops.Tensor{emb, w, b} {
				be.FreeWeight(x)
			}
		})
		return out
	}
	want := run(ops.Reference())
	be, live := Emulated()
	got := run(be)
	for i := range want {
		if d := maxDiff(got[i], want[i]); d > 1e-5 {
			t.Errorf("output %d differs by %g", i, d)
		}
	}
	if n := live(); n != 0 {
		t.Errorf("%d arrays alive at the end", n)
	}
}

func TestEmulatedErrors(t *testing.T) {
	be, live := Emulated()
	c := be.NewContext()
	a := c.Input([]float32{1, 2}, 1, 2)
	c.Add(a, c.Input([]float32{1, 2, 3}, 1, 3))
	if c.Err() == nil {
		t.Error("mismatched add accepted")
	}
	if _, err := c.Float32(a); err == nil {
		t.Error("Float32 after an error")
	}
	c.Close()
	if live() != 0 {
		t.Errorf("%d arrays alive after Close", live())
	}
	if _, err := New(); Available() == (err != nil) {
		t.Errorf("Available() = %v but New: %v", Available(), err)
	}
}
