package ops

import (
	"encoding/binary"
	"errors"
	"math"
	"testing"

	"github.com/meshnode/meshnode/stage"
)

func f32bytes(v ...float32) []byte {
	b := make([]byte, 0, 4*len(v))
	for _, x := range v {
		b = binary.LittleEndian.AppendUint32(b, math.Float32bits(x))
	}
	return b
}

func near(a, b []float32, tol float64) bool {
	if len(a) != len(b) {
		return false
	}
	for i := range a {
		if math.Abs(float64(a[i]-b[i])) > tol {
			return false
		}
	}
	return true
}

func weight(t *testing.T, be Backend, shape []int, v ...float32) Tensor {
	t.Helper()
	w, n, err := be.Weight(f32bytes(v...), stage.F32, shape, Quant{})
	if err != nil || n != uint64(4*len(v)) {
		t.Fatal(err, n)
	}
	return w
}

func TestLinearNormSiLU(t *testing.T) {
	be := Reference()
	c := be.NewContext()
	defer c.Close()
	x := c.Input([]float32{1, 2, 3, 4}, 2, 2)
	w := weight(t, be, []int{3, 2}, 1, 0, 0, 1, 1, 1) // [out 3, in 2]
	b := weight(t, be, []int{3}, 10, 20, 30)
	y, err := c.Float32(c.Linear(x, w, b))
	if err != nil || !near(y, []float32{11, 22, 33, 13, 24, 37}, 0) {
		t.Errorf("linear = %v %v", y, err)
	}
	g := weight(t, be, []int{2}, 1, 2)
	n, _ := c.Float32(c.RMSNorm(c.Input([]float32{3, 4}, 1, 2), g, 0))
	r := float32(math.Sqrt(12.5))
	if !near(n, []float32{3 / r, 8 / r}, 1e-6) {
		t.Errorf("rmsnorm = %v", n)
	}
	s, _ := c.Float32(c.SiLU(c.Input([]float32{0, 1}, 1, 2)))
	if !near(s, []float32{0, float32(1 / (1 + math.Exp(-1)))}, 1e-7) {
		t.Errorf("silu = %v", s)
	}
}

func TestRoPE(t *testing.T) {
	c := Reference().NewContext()
	// Two heads of 4: pairs (0,2) and (1,3) rotate by pos*f0 and pos*f1.
	x := c.Input([]float32{1, 0, 0, 1, 1, 2, 3, 4}, 1, 8)
	y, _ := c.Float32(c.RoPE(x, []int32{1}, 4, []float32{math.Pi / 2, 0}))
	// Pair (0,2) of head 0: (1,0) by 90 degrees is (0,1); pair (1,3) of
	// frequency 0 stays.
	want := []float32{0, 0, 1, 1, -3, 2, 1, 4}
	if !near(y, want, 1e-6) {
		t.Errorf("rope = %v, want %v", y, want)
	}
	z, _ := c.Float32(c.RoPE(x, []int32{0}, 4, []float32{1, 1}))
	if !near(z, []float32{1, 0, 0, 1, 1, 2, 3, 4}, 0) {
		t.Errorf("position 0 moved: %v", z)
	}
}

func TestAttend(t *testing.T) {
	be := Reference()
	kv, err := be.NewKV(1, 2, 8)
	if err != nil {
		t.Fatal(err)
	}
	c := be.NewContext()
	// Two query heads share the one KV head. Keys are orthogonal; values
	// distinct. Row 0 sees only position 0, so it returns v0 exactly.
	q := c.Input([]float32{1, 0, 0, 1, 1, 0, 0, 1}, 2, 4)
	k := c.Input([]float32{1, 0, 0, 1}, 2, 2)
	v := c.Input([]float32{10, 20, 30, 40}, 2, 2)
	o, err := c.Float32(c.Attend(kv, q, k, v, 2, 1))
	if err != nil {
		t.Fatal(err)
	}
	e := math.E
	p0 := float32(e / (e + 1)) // weight of the matching key
	want := []float32{10, 20, 10, 20,
		p0*10 + (1-p0)*30, p0*20 + (1-p0)*40, (1-p0)*10 + p0*30, (1-p0)*20 + p0*40}
	if !near(o, want, 1e-5) {
		t.Errorf("attend = %v, want %v", o, want)
	}
	if kv.Len() != 2 {
		t.Errorf("cache holds %d", kv.Len())
	}
	kv.Trim(1)
	if kv.Len() != 1 {
		t.Errorf("trimmed cache holds %d", kv.Len())
	}
	// Past capacity is an error, and the context stays failed.
	big := c.Input(make([]float32, 16), 8, 2)
	c.Attend(kv, c.Input(make([]float32, 32), 8, 4), big, big, 2, 1)
	if c.Err() == nil {
		t.Fatal("attending past the capacity")
	}
	if _, err := c.Float32(x(c)); err == nil {
		t.Error("a failed context evaluated")
	}
}

func x(c Context) Tensor { return c.Input([]float32{1}, 1, 1) }

func TestShapeErrorsStick(t *testing.T) {
	be := Reference()
	c := be.NewContext()
	a := c.Input([]float32{1, 2}, 1, 2)
	b := c.Input([]float32{1, 2, 3}, 1, 3)
	sum := c.Add(a, b)
	if !errors.Is(c.Err(), ErrShape) {
		t.Fatalf("add of mismatched shapes: %v", c.Err())
	}
	c.Mul(sum, a) // no-op after the first error
	if _, err := c.Float32(a); !errors.Is(err, ErrShape) {
		t.Errorf("Float32 after an error: %v", err)
	}
	c2 := be.NewContext()
	c2.Rows(a, []int32{1})
	if c2.Err() == nil {
		t.Error("row out of range")
	}
	if _, _, err := be.Weight(f32bytes(1, 2, 3), stage.F32, []int{2, 2}, Quant{}); err == nil {
		t.Error("weight of the wrong size")
	}
}

func TestFakeQuantize(t *testing.T) {
	vals := make([]float32, 64)
	for i := range vals {
		vals[i] = float32(math.Sin(float64(i)))
	}
	orig := append([]float32(nil), vals...)
	FakeQuantize(vals, Quant{Bits: 4, GroupSize: 32})
	for g := 0; g < 64; g += 32 {
		lo, hi := orig[g], orig[g]
		for _, v := range orig[g : g+32] {
			lo, hi = min(lo, v), max(hi, v)
		}
		step := (hi - lo) / 15
		levels := map[float32]bool{}
		for i := g; i < g+32; i++ {
			if d := math.Abs(float64(vals[i] - orig[i])); d > float64(step)/2+1e-6 {
				t.Errorf("value %d moved by %g, over half a step %g", i, d, step/2)
			}
			levels[vals[i]] = true
		}
		if len(levels) > 16 {
			t.Errorf("group %d has %d levels", g/32, len(levels))
		}
	}
	if err := (Quant{Bits: 5, GroupSize: 64}).Validate(); err == nil {
		t.Error("5 bits accepted")
	}
}
