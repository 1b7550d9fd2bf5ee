package ops

import (
	"fmt"
	"math"
	"slices"

	"github.com/meshnode/meshnode/stage"
)

// Reference returns the pure-Go float32 backend. It is the test reference,
// not a fast path: every operation is the textbook loop, sums and softmax
// are accumulated in float64, nothing is vectorized or parallel, and the
// intent is that each function can be checked against its documentation by
// reading it. Quantized weights are stored dequantized (quantize then
// dequantize at load), which reproduces the rounding error of an affine
// group quantization without a quantized kernel.
func Reference() Backend { return refBackend{} }

type refBackend struct{}

// refTensor is a dense row-major float32 array.
type refTensor struct {
	shape []int
	data  []float32
}

func (t *refTensor) Shape() []int { return slices.Clone(t.shape) }

// rows and cols view a tensor as a matrix: the last dimension is the row.
func (t *refTensor) cols() int { return t.shape[len(t.shape)-1] }
func (t *refTensor) rows() int { return len(t.data) / max(t.cols(), 1) }

func (refBackend) Name() string   { return "reference" }
func (refBackend) Device() string { return "CPU" }
func (refBackend) Close() error   { return nil }

func (refBackend) Weight(data []byte, dtype stage.DType, shape []int, q Quant) (Tensor, uint64, error) {
	if len(shape) == 0 || len(shape) > 2 || Elements(shape) <= 0 {
		return nil, 0, fmt.Errorf("%w: weight shape %v is not a vector or matrix", ErrShape, shape)
	}
	if len(data) != Elements(shape)*dtype.Size() {
		return nil, 0, fmt.Errorf("%w: %d bytes of %s for shape %v", ErrShape, len(data), dtype, shape)
	}
	vals, err := stage.Decode(dtype, data, nil)
	if err != nil {
		return nil, 0, err
	}
	if len(shape) == 2 && !q.None() {
		if err := q.Validate(); err != nil {
			return nil, 0, err
		}
		if shape[1]%q.GroupSize != 0 {
			return nil, 0, fmt.Errorf("%w: rows of %d values are not whole groups of %d", ErrShape, shape[1], q.GroupSize)
		}
		FakeQuantize(vals, q)
	}
	return &refTensor{shape: slices.Clone(shape), data: vals}, uint64(4 * len(vals)), nil
}

// FakeQuantize replaces each group of q.GroupSize values by its affine
// quantization: with lo and hi the group's extremes, scale (hi-lo)/(2^bits-1),
// each value becomes lo + scale*round((v-lo)/scale). This is the scheme MLX's
// affine quantize implements; MLX additionally nudges the scale so that the
// group's extreme of larger magnitude is exact, so values can differ by a
// rounding step, but the error bound (scale/2 per value) is the same.
func FakeQuantize(vals []float32, q Quant) {
	levels := float64(int(1)<<q.Bits - 1)
	for g := 0; g+q.GroupSize <= len(vals); g += q.GroupSize {
		grp := vals[g : g+q.GroupSize]
		lo, hi := float64(slices.Min(grp)), float64(slices.Max(grp))
		scale := (hi - lo) / levels
		if scale == 0 {
			continue
		}
		for i, v := range grp {
			grp[i] = float32(lo + scale*math.Round((float64(v)-lo)/scale))
		}
	}
}

func (refBackend) FreeWeight(Tensor) {}

func (refBackend) NewKV(kvHeads, headDim, capacity int) (KV, error) {
	if kvHeads <= 0 || headDim <= 0 || capacity <= 0 {
		return nil, fmt.Errorf("ops: KV cache of %d heads × %d for %d positions", kvHeads, headDim, capacity)
	}
	return &refKV{width: kvHeads * headDim, heads: kvHeads, capacity: capacity}, nil
}

// refKV holds position p's keys at k[p*width:(p+1)*width].
type refKV struct {
	k, v         []float32
	width, heads int
	capacity     int
}

func (c *refKV) Len() int { return len(c.k) / c.width }

func (c *refKV) Trim(n int) {
	n = min(max(n, 0), c.Len())
	c.k, c.v = c.k[:n*c.width], c.v[:n*c.width]
}

func (c *refKV) Free() { c.k, c.v = nil, nil }

func (refBackend) NewContext() Context { return &refContext{} }

type refContext struct{ err error }

func (c *refContext) Err() error { return c.err }
func (c *refContext) Close()     {}

func (c *refContext) fail(err error) {
	if c.err == nil {
		c.err = err
	}
}

func (c *refContext) failf(format string, args ...any) {
	c.fail(fmt.Errorf("%w: %s", ErrShape, fmt.Sprintf(format, args...)))
}

// ts unwraps operands; a missing or foreign one is an error.
func (c *refContext) ts(op string, in ...Tensor) []*refTensor {
	if c.err != nil {
		return nil
	}
	out := make([]*refTensor, len(in))
	for i, t := range in {
		rt, ok := t.(*refTensor)
		if !ok || rt == nil {
			c.fail(fmt.Errorf("ops: %s: operand %d is %T, not a reference tensor", op, i, t))
			return nil
		}
		out[i] = rt
	}
	return out
}

func newRef(rows, cols int) *refTensor {
	return &refTensor{shape: []int{rows, cols}, data: make([]float32, rows*cols)}
}

func (c *refContext) Input(data []float32, rows, cols int) Tensor {
	if c.err != nil {
		return nil
	}
	if rows <= 0 || cols <= 0 || len(data) != rows*cols {
		c.failf("input of %d values as [%d,%d]", len(data), rows, cols)
		return nil
	}
	return &refTensor{shape: []int{rows, cols}, data: slices.Clone(data)}
}

func (c *refContext) Embedding(table Tensor, ids []int32) Tensor {
	t := c.ts("embedding", table)
	if t == nil {
		return nil
	}
	tab := t[0]
	if len(tab.shape) != 2 {
		c.failf("embedding table of shape %v", tab.shape)
		return nil
	}
	return c.gather(tab, ids)
}

func (c *refContext) Rows(x Tensor, idx []int32) Tensor {
	t := c.ts("rows", x)
	if t == nil {
		return nil
	}
	return c.gather(t[0], idx)
}

func (c *refContext) gather(x *refTensor, idx []int32) Tensor {
	n, w := x.rows(), x.cols()
	out := newRef(len(idx), w)
	for r, i := range idx {
		if i < 0 || int(i) >= n {
			c.failf("row %d of a %d-row tensor", i, n)
			return nil
		}
		copy(out.data[r*w:(r+1)*w], x.data[int(i)*w:(int(i)+1)*w])
	}
	return out
}

func (c *refContext) Linear(x, w, b Tensor) Tensor {
	in := []Tensor{x, w}
	if b != nil {
		in = append(in, b)
	}
	t := c.ts("linear", in...)
	if t == nil {
		return nil
	}
	xs, ws := t[0], t[1]
	if len(ws.shape) != 2 || xs.cols() != ws.shape[1] {
		c.failf("linear of x %v by weight %v", xs.shape, ws.shape)
		return nil
	}
	n, k, m := xs.rows(), ws.shape[1], ws.shape[0]
	var bias []float32
	if b != nil {
		if bias = t[2].data; len(bias) != m {
			c.failf("bias of %d for %d outputs", len(bias), m)
			return nil
		}
	}
	out := newRef(n, m)
	for r := range n {
		xr := xs.data[r*k : (r+1)*k]
		for o := range m {
			var s float64
			for i, wv := range ws.data[o*k : (o+1)*k] {
				s += float64(xr[i]) * float64(wv)
			}
			if bias != nil {
				s += float64(bias[o])
			}
			out.data[r*m+o] = float32(s)
		}
	}
	return out
}

func (c *refContext) RMSNorm(x, w Tensor, eps float32) Tensor {
	t := c.ts("rmsnorm", x, w)
	if t == nil {
		return nil
	}
	xs, ws := t[0], t[1]
	k := xs.cols()
	if len(ws.data) != k {
		c.failf("rmsnorm of rows of %d by a weight of %d", k, len(ws.data))
		return nil
	}
	out := &refTensor{shape: slices.Clone(xs.shape), data: make([]float32, len(xs.data))}
	for r := range xs.rows() {
		row := xs.data[r*k : (r+1)*k]
		var ss float64
		for _, v := range row {
			ss += float64(v) * float64(v)
		}
		inv := 1 / math.Sqrt(ss/float64(k)+float64(eps))
		for i, v := range row {
			out.data[r*k+i] = float32(float64(v) * inv * float64(ws.data[i]))
		}
	}
	return out
}

func (c *refContext) RoPE(x Tensor, pos []int32, headDim int, invFreq []float32) Tensor {
	t := c.ts("rope", x)
	if t == nil {
		return nil
	}
	xs := t[0]
	half := len(invFreq)
	if headDim <= 0 || xs.cols()%headDim != 0 || 2*half > headDim || xs.rows() != len(pos) {
		c.failf("rope of %v with %d positions, head dim %d, %d frequencies", xs.shape, len(pos), headDim, half)
		return nil
	}
	out := &refTensor{shape: slices.Clone(xs.shape), data: slices.Clone(xs.data)}
	w := xs.cols()
	for r, p := range pos {
		for i, f := range invFreq {
			ang := float64(p) * float64(f)
			cos, sin := math.Cos(ang), math.Sin(ang)
			for h := 0; h < w; h += headDim {
				a := r*w + h + i
				x1, x2 := float64(xs.data[a]), float64(xs.data[a+half])
				out.data[a] = float32(x1*cos - x2*sin)
				out.data[a+half] = float32(x2*cos + x1*sin)
			}
		}
	}
	return out
}

func (c *refContext) elementwise(op string, a, b Tensor, f func(x, y float32) float32) Tensor {
	t := c.ts(op, a, b)
	if t == nil {
		return nil
	}
	if !slices.Equal(t[0].shape, t[1].shape) {
		c.failf("%s of %v and %v", op, t[0].shape, t[1].shape)
		return nil
	}
	out := &refTensor{shape: slices.Clone(t[0].shape), data: make([]float32, len(t[0].data))}
	for i := range out.data {
		out.data[i] = f(t[0].data[i], t[1].data[i])
	}
	return out
}

func (c *refContext) Add(a, b Tensor) Tensor {
	return c.elementwise("add", a, b, func(x, y float32) float32 { return x + y })
}

func (c *refContext) Mul(a, b Tensor) Tensor {
	return c.elementwise("mul", a, b, func(x, y float32) float32 { return x * y })
}

func (c *refContext) SiLU(x Tensor) Tensor {
	t := c.ts("silu", x)
	if t == nil {
		return nil
	}
	out := &refTensor{shape: slices.Clone(t[0].shape), data: make([]float32, len(t[0].data))}
	for i, v := range t[0].data {
		out.data[i] = float32(float64(v) / (1 + math.Exp(-float64(v))))
	}
	return out
}

func (c *refContext) Reshape(x Tensor, shape ...int) Tensor {
	t := c.ts("reshape", x)
	if t == nil {
		return nil
	}
	if len(shape) == 0 || Elements(shape) != len(t[0].data) || slices.Min(shape) <= 0 {
		c.failf("reshape of %v to %v", t[0].shape, shape)
		return nil
	}
	return &refTensor{shape: slices.Clone(shape), data: t[0].data}
}

func (c *refContext) Concat(in ...Tensor) Tensor {
	t := c.ts("concat", in...)
	if t == nil {
		return nil
	}
	if len(t) == 0 {
		c.failf("concat of nothing")
		return nil
	}
	w, rows := t[0].cols(), 0
	for _, x := range t {
		if x.cols() != w {
			c.failf("concat of rows of %d and %d", w, x.cols())
			return nil
		}
		rows += x.rows()
	}
	out := newRef(rows, w)
	at := 0
	for _, x := range t {
		at += copy(out.data[at:], x.data)
	}
	return out
}

func (c *refContext) Attend(kv KV, q, k, v Tensor, heads int, scale float32) Tensor {
	t := c.ts("attend", q, k, v)
	if t == nil {
		return nil
	}
	cache, ok := kv.(*refKV)
	if !ok {
		c.fail(fmt.Errorf("ops: attend: cache is %T, not a reference cache", kv))
		return nil
	}
	qs, ks, vs := t[0], t[1], t[2]
	m, kvw := qs.rows(), cache.width
	hd := kvw / cache.heads
	if ks.rows() != m || vs.rows() != m || ks.cols() != kvw || vs.cols() != kvw || heads%cache.heads != 0 || qs.cols() != heads*hd {
		c.failf("attend of q %v, k %v, v %v with %d heads on a cache of %d×%d", qs.shape, ks.shape, vs.shape, heads, cache.heads, hd)
		return nil
	}
	start := cache.Len()
	if start+m > cache.capacity {
		c.fail(fmt.Errorf("ops: attend: %d positions past the cache's %d", start+m, cache.capacity))
		return nil
	}
	cache.k = append(cache.k, ks.data...)
	cache.v = append(cache.v, vs.data...)

	group := heads / cache.heads
	out := newRef(m, heads*hd)
	scores := make([]float64, start+m)
	for i := range m {
		n := start + i + 1 // positions this row sees
		for h := range heads {
			g := h / group
			qr := qs.data[i*heads*hd+h*hd : i*heads*hd+(h+1)*hd]
			mx := math.Inf(-1)
			for p := range n {
				kr := cache.k[p*kvw+g*hd : p*kvw+(g+1)*hd]
				var s float64
				for d := range hd {
					s += float64(qr[d]) * float64(kr[d])
				}
				scores[p] = s * float64(scale)
				mx = max(mx, scores[p])
			}
			var sum float64
			for p := range n {
				scores[p] = math.Exp(scores[p] - mx)
				sum += scores[p]
			}
			o := out.data[i*heads*hd+h*hd : i*heads*hd+(h+1)*hd]
			for d := range hd {
				var s float64
				for p := range n {
					s += scores[p] * float64(cache.v[p*kvw+g*hd+d])
				}
				o[d] = float32(s / sum)
			}
		}
	}
	return out
}

func (c *refContext) Float32(x Tensor) ([]float32, error) {
	t := c.ts("float32", x)
	if t == nil {
		return nil, c.err
	}
	return slices.Clone(t[0].data), nil
}
