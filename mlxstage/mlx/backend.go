package mlx

import (
	"fmt"
	"math"
	"slices"

	"github.com/meshnode/meshnode/mlxstage/ops"
	"github.com/meshnode/meshnode/stage"
)

// backend implements ops.Backend on an api. Its logic is platform-neutral
// Go; only the api underneath is cgo.
type backend struct {
	api    api
	name   string
	device string
	run    func(func()) // runs f on the thread MLX is bound to; nil = inline
	close  func() error
	// act is the dtype activations are computed in: that of the first
	// matrix loaded (the model's), as MLX-LM computes in the weights' type.
	act dtype
}

var (
	_ ops.Backend = (*backend)(nil)
	_ ops.Runner  = (*backend)(nil)
)

func newBackend(a api, name, device string, run func(func()), close func() error) *backend {
	return &backend{api: a, name: name, device: device, run: run, close: close}
}

func (b *backend) Name() string   { return b.name }
func (b *backend) Device() string { return b.device }

// Run runs f on the OS thread the MLX binding is bound to.
func (b *backend) Run(f func()) {
	if b.run == nil {
		f()
		return
	}
	b.run(f)
}

func (b *backend) Close() error {
	if b.close != nil {
		return b.close()
	}
	return nil
}

// tensor is an array with its shape, or the three arrays of a quantized
// matrix.
type tensor struct {
	a     arr
	shape []int
	q     *quantized
}

type quantized struct {
	wq, scales, biases arr
	group, bits        int
}

func (t *tensor) Shape() []int { return slices.Clone(t.shape) }

func dtypeOf(d stage.DType) (dtype, error) {
	switch d {
	case stage.F32:
		return f32, nil
	case stage.F16:
		return f16, nil
	case stage.BF16:
		return bf16, nil
	}
	return 0, fmt.Errorf("mlx: weights of dtype %v", d)
}

func (b *backend) Weight(data []byte, dt stage.DType, shape []int, q ops.Quant) (ops.Tensor, uint64, error) {
	d, err := dtypeOf(dt)
	if err != nil {
		return nil, 0, err
	}
	if len(shape) == 0 || len(shape) > 2 || len(data) != ops.Elements(shape)*d.size() {
		return nil, 0, fmt.Errorf("%w: %d bytes of %s as %v", ops.ErrShape, len(data), dt, shape)
	}
	a, err := b.api.fromData(data, shape, d)
	if err != nil {
		return nil, 0, err
	}
	if len(shape) == 2 && b.act == 0 {
		b.act = d
	}
	t := &tensor{a: a, shape: slices.Clone(shape)}
	if len(shape) == 2 && !q.None() {
		if err := q.Validate(); err != nil {
			b.api.free(a)
			return nil, 0, err
		}
		wq, s, bi, err := b.api.quantize(a, q.GroupSize, q.Bits)
		b.api.free(a)
		if err != nil {
			return nil, 0, err
		}
		t.a, t.q = 0, &quantized{wq, s, bi, q.GroupSize, q.Bits}
		// Evaluated now, so the unquantized copy is gone before the next
		// weight loads.
		if err := b.api.eval(wq, s, bi); err != nil {
			b.FreeWeight(t)
			return nil, 0, err
		}
		return t, b.api.nbytes(wq) + b.api.nbytes(s) + b.api.nbytes(bi), nil
	}
	if err := b.api.eval(a); err != nil {
		b.api.free(a)
		return nil, 0, err
	}
	return t, b.api.nbytes(a), nil
}

func (b *backend) FreeWeight(w ops.Tensor) {
	t, ok := w.(*tensor)
	if !ok || t == nil {
		return
	}
	if t.q != nil {
		b.api.free(t.q.wq)
		b.api.free(t.q.scales)
		b.api.free(t.q.biases)
		t.q = nil
	}
	if t.a != 0 {
		b.api.free(t.a)
		t.a = 0
	}
}

// kvStep is how many positions a cache grows by at a time, so that decode
// does not reallocate it every token (MLX-LM grows by the same step).
const kvStep = 256

// kv holds keys and values as [kvHeads, alloc, headDim] arrays; positions
// [0, n) are valid.
type kv struct {
	b                  *backend
	k, v               arr
	heads, dim         int
	n, alloc, capacity int
}

func (b *backend) NewKV(kvHeads, headDim, capacity int) (ops.KV, error) {
	if kvHeads <= 0 || headDim <= 0 || capacity <= 0 {
		return nil, fmt.Errorf("mlx: KV cache of %d heads × %d for %d positions", kvHeads, headDim, capacity)
	}
	return &kv{b: b, heads: kvHeads, dim: headDim, capacity: capacity}, nil
}

func (c *kv) Len() int   { return c.n }
func (c *kv) Trim(n int) { c.n = min(max(n, 0), c.n) }
func (c *kv) Free() {
	if c.k != 0 {
		c.b.api.free(c.k)
		c.b.api.free(c.v)
	}
	c.k, c.v, c.n, c.alloc = 0, 0, 0, 0
}

func (b *backend) NewContext() ops.Context { return &context{b: b, api: b.api} }

// context records every array it makes, to free them on Close, and the
// caches it appended to, to evaluate them with the result.
type context struct {
	b       *backend
	api     api
	err     error
	owned   []arr
	touched []*kv
}

func (c *context) Err() error { return c.err }

func (c *context) Close() {
	for _, a := range c.owned {
		c.api.free(a)
	}
	c.owned = nil
}

func (c *context) fail(err error) {
	if c.err == nil {
		c.err = err
	}
}

// keep records a new array and wraps it; an error fails the context.
func (c *context) keep(a arr, err error) arr {
	if err != nil {
		c.fail(fmt.Errorf("mlx: %w", err))
		return 0
	}
	c.owned = append(c.owned, a)
	return a
}

func (c *context) wrap(a arr) ops.Tensor {
	if c.err != nil || a == 0 {
		return nil
	}
	return &tensor{a: a, shape: c.api.shape(a)}
}

// ts unwraps operands, failing on a foreign or missing one.
func (c *context) ts(op string, in ...ops.Tensor) []*tensor {
	if c.err != nil {
		return nil
	}
	out := make([]*tensor, len(in))
	for i, t := range in {
		mt, ok := t.(*tensor)
		if !ok || mt == nil || (mt.a == 0 && mt.q == nil) {
			c.fail(fmt.Errorf("mlx: %s: operand %d is %T, not an MLX tensor", op, i, t))
			return nil
		}
		out[i] = mt
	}
	return out
}

// act is the activation dtype, f32 until a matrix is loaded.
func (c *context) act() dtype {
	if c.b.act == 0 {
		return f32
	}
	return c.b.act
}

func f32Bytes(v []float32) []byte {
	out := make([]byte, 4*len(v))
	for i, x := range v {
		u := math.Float32bits(x)
		out[4*i], out[4*i+1], out[4*i+2], out[4*i+3] = byte(u), byte(u>>8), byte(u>>16), byte(u>>24)
	}
	return out
}

func i32Bytes(v []int32) []byte {
	out := make([]byte, 4*len(v))
	for i, x := range v {
		out[4*i], out[4*i+1], out[4*i+2], out[4*i+3] = byte(x), byte(x>>8), byte(x>>16), byte(x>>24)
	}
	return out
}

// floats makes an array of float32 values in the activation dtype.
func (c *context) floats(v []float32, shape ...int) arr {
	a := c.keep(c.api.fromData(f32Bytes(v), shape, f32))
	if c.err != nil || c.act() == f32 {
		return a
	}
	return c.keep(c.api.astype(a, c.act()))
}

func (c *context) ints(v []int32) arr {
	return c.keep(c.api.fromData(i32Bytes(v), []int{len(v)}, i32))
}

func (c *context) Input(data []float32, rows, cols int) ops.Tensor {
	if c.err != nil {
		return nil
	}
	if rows <= 0 || cols <= 0 || len(data) != rows*cols {
		c.fail(fmt.Errorf("%w: input of %d values as [%d,%d]", ops.ErrShape, len(data), rows, cols))
		return nil
	}
	return c.wrap(c.floats(data, rows, cols))
}

func (c *context) Embedding(table ops.Tensor, ids []int32) ops.Tensor {
	return c.Rows(table, ids)
}

func (c *context) Rows(x ops.Tensor, idx []int32) ops.Tensor {
	t := c.ts("rows", x)
	if t == nil {
		return nil
	}
	n := t[0].shape[0]
	for _, i := range idx {
		if i < 0 || int(i) >= n {
			c.fail(fmt.Errorf("%w: row %d of a %d-row tensor", ops.ErrShape, i, n))
			return nil
		}
	}
	ix := c.ints(idx)
	if q := t[0].q; q != nil {
		// A quantized table: gather the rows' codes, scales and biases,
		// then dequantize just those rows.
		wq := c.keep(c.api.take(q.wq, ix, 0))
		s := c.keep(c.api.take(q.scales, ix, 0))
		bi := c.keep(c.api.take(q.biases, ix, 0))
		if c.err != nil {
			return nil
		}
		return c.wrap(c.keep(c.api.dequantize(wq, s, bi, q.group, q.bits)))
	}
	return c.wrap(c.keep(c.api.take(t[0].a, ix, 0)))
}

func (c *context) Linear(x, w, b ops.Tensor) ops.Tensor {
	in := []ops.Tensor{x, w}
	if b != nil {
		in = append(in, b)
	}
	t := c.ts("linear", in...)
	if t == nil {
		return nil
	}
	xs, ws := t[0], t[1]
	if len(ws.shape) != 2 || xs.shape[len(xs.shape)-1] != ws.shape[1] {
		c.fail(fmt.Errorf("%w: linear of x %v by weight %v", ops.ErrShape, xs.shape, ws.shape))
		return nil
	}
	var y arr
	if q := ws.q; q != nil {
		y = c.keep(c.api.quantizedMatmul(xs.a, q.wq, q.scales, q.biases, q.group, q.bits))
	} else {
		wt := c.keep(c.api.transpose(ws.a, []int{1, 0}))
		if c.err != nil {
			return nil
		}
		y = c.keep(c.api.matmul(xs.a, wt))
	}
	if b != nil && c.err == nil {
		y = c.keep(c.api.add(y, t[2].a))
	}
	return c.wrap(y)
}

func (c *context) RMSNorm(x, w ops.Tensor, eps float32) ops.Tensor {
	t := c.ts("rmsnorm", x, w)
	if t == nil {
		return nil
	}
	if t[1].shape[0] != t[0].shape[len(t[0].shape)-1] {
		c.fail(fmt.Errorf("%w: rmsnorm of %v by %v", ops.ErrShape, t[0].shape, t[1].shape))
		return nil
	}
	return c.wrap(c.keep(c.api.rmsNorm(t[0].a, t[1].a, eps)))
}

// RoPE rotates with cos/sin tables computed here, in float64 per row
// position, rather than with mlx_fast_rope, whose single offset cannot
// express a batch of sequences at different positions.
func (c *context) RoPE(x ops.Tensor, pos []int32, headDim int, invFreq []float32) ops.Tensor {
	t := c.ts("rope", x)
	if t == nil {
		return nil
	}
	n, w := t[0].shape[0], t[0].shape[len(t[0].shape)-1]
	half := len(invFreq)
	if len(t[0].shape) != 2 || headDim <= 0 || w%headDim != 0 || 2*half > headDim || n != len(pos) || half == 0 {
		c.fail(fmt.Errorf("%w: rope of %v with %d positions, head dim %d, %d frequencies", ops.ErrShape, t[0].shape, len(pos), headDim, half))
		return nil
	}
	heads := w / headDim
	cos, sin := make([]float32, n*half), make([]float32, n*half)
	for r, p := range pos {
		for i, f := range invFreq {
			s, co := math.Sincos(float64(p) * float64(f))
			cos[r*half+i], sin[r*half+i] = float32(co), float32(s)
		}
	}
	ca, sa := c.floats(cos, n, 1, half), c.floats(sin, n, 1, half)
	x3 := c.keep(c.api.reshape(t[0].a, []int{n, heads, headDim}))
	if c.err != nil {
		return nil
	}
	x1 := c.keep(c.api.slice(x3, []int{0, 0, 0}, []int{n, heads, half}))
	x2 := c.keep(c.api.slice(x3, []int{0, 0, half}, []int{n, heads, 2 * half}))
	if c.err != nil {
		return nil
	}
	mul := func(a, b arr) arr { return c.keep(c.api.multiply(a, b)) }
	o1 := c.keep(c.api.subtract(mul(x1, ca), mul(x2, sa)))
	o2 := c.keep(c.api.add(mul(x2, ca), mul(x1, sa)))
	parts := []arr{o1, o2}
	if 2*half < headDim {
		parts = append(parts, c.keep(c.api.slice(x3, []int{0, 0, 2 * half}, []int{n, heads, headDim})))
	}
	if c.err != nil {
		return nil
	}
	y := c.keep(c.api.concatenate(parts, 2))
	if c.err != nil {
		return nil
	}
	return c.wrap(c.keep(c.api.reshape(y, []int{n, w})))
}

func (c *context) binary(op string, a, b ops.Tensor, f func(a, b arr) (arr, error)) ops.Tensor {
	t := c.ts(op, a, b)
	if t == nil {
		return nil
	}
	if !slices.Equal(t[0].shape, t[1].shape) {
		c.fail(fmt.Errorf("%w: %s of %v and %v", ops.ErrShape, op, t[0].shape, t[1].shape))
		return nil
	}
	return c.wrap(c.keep(f(t[0].a, t[1].a)))
}

func (c *context) Add(a, b ops.Tensor) ops.Tensor { return c.binary("add", a, b, c.api.add) }
func (c *context) Mul(a, b ops.Tensor) ops.Tensor { return c.binary("mul", a, b, c.api.multiply) }

func (c *context) SiLU(x ops.Tensor) ops.Tensor {
	t := c.ts("silu", x)
	if t == nil {
		return nil
	}
	s := c.keep(c.api.sigmoid(t[0].a))
	if c.err != nil {
		return nil
	}
	return c.wrap(c.keep(c.api.multiply(t[0].a, s)))
}

func (c *context) Reshape(x ops.Tensor, shape ...int) ops.Tensor {
	t := c.ts("reshape", x)
	if t == nil {
		return nil
	}
	if len(shape) == 0 || ops.Elements(shape) != ops.Elements(t[0].shape) || slices.Min(shape) <= 0 {
		c.fail(fmt.Errorf("%w: reshape of %v to %v", ops.ErrShape, t[0].shape, shape))
		return nil
	}
	return c.wrap(c.keep(c.api.reshape(t[0].a, shape)))
}

func (c *context) Concat(in ...ops.Tensor) ops.Tensor {
	t := c.ts("concat", in...)
	if t == nil {
		return nil
	}
	if len(t) == 0 {
		c.fail(fmt.Errorf("%w: concat of nothing", ops.ErrShape))
		return nil
	}
	as := make([]arr, len(t))
	for i, x := range t {
		if len(x.shape) != 2 || x.shape[1] != t[0].shape[1] {
			c.fail(fmt.Errorf("%w: concat of %v and %v", ops.ErrShape, t[0].shape, x.shape))
			return nil
		}
		as[i] = x.a
	}
	return c.wrap(c.keep(c.api.concatenate(as, 0)))
}

// grow makes room for need positions, keeping what is cached.
func (c *context) grow(kv *kv, need int, dt dtype) {
	if need <= kv.alloc {
		return
	}
	alloc := min((need+kvStep-1)/kvStep*kvStep, kv.capacity)
	for _, p := range []*arr{&kv.k, &kv.v} {
		z, err := c.api.zeros([]int{kv.heads, alloc, kv.dim}, dt)
		if err != nil {
			c.fail(fmt.Errorf("mlx: %w", err))
			return
		}
		if *p != 0 && kv.n > 0 {
			old := c.keep(c.api.slice(*p, []int{0, 0, 0}, []int{kv.heads, kv.n, kv.dim}))
			if c.err != nil {
				c.api.free(z)
				return
			}
			nz, err := c.api.sliceUpdate(z, old, []int{0, 0, 0}, []int{kv.heads, kv.n, kv.dim})
			c.api.free(z)
			if err != nil {
				c.fail(fmt.Errorf("mlx: %w", err))
				return
			}
			z = nz
		}
		if *p != 0 {
			c.api.free(*p)
		}
		*p = z
	}
	kv.alloc = alloc
}

// Attend stores the new keys and values in the cache buffers with
// slice_update, then computes attention with grouped heads as a batched
// matmul: queries [kvHeads, group, m, d] against keys [kvHeads, 1, d, T].
// mlx_fast_scaled_dot_product_attention would be faster; this composition
// keeps to calls whose signatures have been stable across mlx-c releases.
func (c *context) Attend(cache ops.KV, q, k, v ops.Tensor, heads int, scale float32) ops.Tensor {
	t := c.ts("attend", q, k, v)
	if t == nil {
		return nil
	}
	kvc, ok := cache.(*kv)
	if !ok {
		c.fail(fmt.Errorf("mlx: attend: cache is %T, not an MLX cache", cache))
		return nil
	}
	m, H, D := t[0].shape[0], heads, kvc.dim
	KV := kvc.heads
	if H%KV != 0 || t[0].shape[1] != H*D || t[1].shape[0] != m || t[1].shape[1] != KV*D || t[2].shape[0] != m || t[2].shape[1] != KV*D {
		c.fail(fmt.Errorf("%w: attend of q %v, k %v, v %v with %d heads on a cache of %d×%d", ops.ErrShape, t[0].shape, t[1].shape, t[2].shape, heads, KV, D))
		return nil
	}
	L := kvc.n
	T := L + m
	if T > kvc.capacity {
		c.fail(fmt.Errorf("mlx: attend: %d positions past the cache's %d", T, kvc.capacity))
		return nil
	}
	G := H / KV
	dt := c.api.dtype(t[1].a)
	c.grow(kvc, T, dt)
	// [m, KV*D] -> [KV, m, D]
	heads3 := func(a arr) arr {
		r := c.keep(c.api.reshape(a, []int{m, KV, D}))
		if c.err != nil {
			return 0
		}
		return c.keep(c.api.transpose(r, []int{1, 0, 2}))
	}
	k3, v3 := heads3(t[1].a), heads3(t[2].a)
	if c.err != nil {
		return nil
	}
	for _, p := range []struct {
		buf *arr
		upd arr
	}{{&kvc.k, k3}, {&kvc.v, v3}} {
		nb, err := c.api.sliceUpdate(*p.buf, p.upd, []int{0, L, 0}, []int{KV, T, D})
		if err != nil {
			c.fail(fmt.Errorf("mlx: %w", err))
			return nil
		}
		c.api.free(*p.buf)
		*p.buf = nb
	}
	kvc.n = T
	if !slices.Contains(c.touched, kvc) {
		c.touched = append(c.touched, kvc)
	}

	keys := c.keep(c.api.slice(kvc.k, []int{0, 0, 0}, []int{KV, T, D}))
	vals := c.keep(c.api.slice(kvc.v, []int{0, 0, 0}, []int{KV, T, D}))
	q4 := c.keep(c.api.reshape(t[0].a, []int{m, KV, G, D}))
	if c.err != nil {
		return nil
	}
	q4 = c.keep(c.api.transpose(q4, []int{1, 2, 0, 3})) // [KV, G, m, D]
	k4 := c.keep(c.api.reshape(keys, []int{KV, 1, T, D}))
	if c.err != nil {
		return nil
	}
	kT := c.keep(c.api.transpose(k4, []int{0, 1, 3, 2})) // [KV, 1, D, T]
	scores := c.keep(c.api.matmul(q4, kT))               // [KV, G, m, T]
	if c.err != nil {
		return nil
	}
	// Scale and causal mask in float32: row i sees positions [0, L+i].
	mask := make([]float32, m*T)
	for i := range m {
		for p := L + i + 1; p < T; p++ {
			mask[i*T+p] = float32(math.Inf(-1))
		}
	}
	s32 := c.keep(c.api.astype(scores, f32))
	sc := c.keep(c.api.fromData(f32Bytes([]float32{scale}), []int{1}, f32))
	mk := c.keep(c.api.fromData(f32Bytes(mask), []int{m, T}, f32))
	if c.err != nil {
		return nil
	}
	s32 = c.keep(c.api.add(c.keep(c.api.multiply(s32, sc)), mk))
	if c.err != nil {
		return nil
	}
	p := c.keep(c.api.softmax(s32, -1))
	if c.err != nil {
		return nil
	}
	if dt != f32 {
		p = c.keep(c.api.astype(p, dt))
	}
	v4 := c.keep(c.api.reshape(vals, []int{KV, 1, T, D}))
	if c.err != nil {
		return nil
	}
	o := c.keep(c.api.matmul(p, v4)) // [KV, G, m, D]
	if c.err != nil {
		return nil
	}
	o = c.keep(c.api.transpose(o, []int{2, 0, 1, 3})) // [m, KV, G, D]
	if c.err != nil {
		return nil
	}
	return c.wrap(c.keep(c.api.reshape(o, []int{m, H * D})))
}

// Float32 evaluates t together with the caches the pass appended to, so
// that a cache never holds a growing chain of lazy updates.
func (c *context) Float32(x ops.Tensor) ([]float32, error) {
	t := c.ts("float32", x)
	if t == nil {
		return nil, c.err
	}
	outs := []arr{t[0].a}
	for _, kv := range c.touched {
		outs = append(outs, kv.k, kv.v)
	}
	if err := c.api.eval(outs...); err != nil {
		c.fail(fmt.Errorf("mlx: %w", err))
		return nil, c.err
	}
	c.touched = nil
	f, err := c.api.float32s(t[0].a)
	if err != nil {
		c.fail(fmt.Errorf("mlx: %w", err))
		return nil, c.err
	}
	return f, nil
}
