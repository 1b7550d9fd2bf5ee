package mlx

import (
	"encoding/binary"
	"fmt"
	"math"
	"slices"
	"sync"

	"github.com/meshnode/meshnode/mlxstage/ops"
	"github.com/meshnode/meshnode/stage"
)

// Emulated returns the MLX backend running on a pure-Go emulation of the
// mlx-c functions it calls, and a function that counts the arrays alive in
// the emulation. It exists to test the binding's logic (how the backend
// composes MLX primitives into the ops interface, and that it frees every
// array it makes) where MLX cannot run; it is slow and not a fast path.
// Each emulated primitive follows MLX's documented semantics (NumPy
// broadcasting, row-major shapes, affine quantization along the last axis);
// quantization stores the dequantized values, as ops.FakeQuantize does.
func Emulated() (ops.Backend, func() int) {
	e := &emu{arrays: map[arr]*earr{}}
	return newBackend(e, "mlx", "emulated", nil, nil), e.live
}

type earr struct {
	shape []int
	data  []float64
	dt    dtype
}

type emu struct {
	mu     sync.Mutex
	arrays map[arr]*earr
	next   arr
}

func (e *emu) live() int {
	e.mu.Lock()
	defer e.mu.Unlock()
	return len(e.arrays)
}

func (e *emu) put(a *earr) arr {
	e.mu.Lock()
	defer e.mu.Unlock()
	e.next++
	e.arrays[e.next] = a
	return e.next
}

func (e *emu) get(as ...arr) ([]*earr, error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	out := make([]*earr, len(as))
	for i, a := range as {
		x, ok := e.arrays[a]
		if !ok {
			return nil, fmt.Errorf("emulated mlx: array %d is not alive", a)
		}
		out[i] = x
	}
	return out, nil
}

// round stores a value as dt would hold it.
func round(v float64, dt dtype) float64 {
	switch dt {
	case f16:
		return float64(stage.F16ToFloat32(stage.Float32ToF16(float32(v))))
	case bf16:
		return float64(stage.BF16ToFloat32(stage.Float32ToBF16(float32(v))))
	case f32:
		return float64(float32(v))
	}
	return v
}

func (e *emu) newArr(shape []int, dt dtype, data []float64) arr {
	for i := range data {
		data[i] = round(data[i], dt)
	}
	return e.put(&earr{shape: slices.Clone(shape), data: data, dt: dt})
}

func (e *emu) fromData(data []byte, shape []int, dt dtype) (arr, error) {
	n := ops.Elements(shape)
	if len(data) != n*dt.size() {
		return 0, fmt.Errorf("emulated mlx: %d bytes for %v of %d-byte elements", len(data), shape, dt.size())
	}
	out := make([]float64, n)
	switch dt {
	case i32:
		for i := range out {
			out[i] = float64(int32(binary.LittleEndian.Uint32(data[4*i:])))
		}
	default:
		sd := map[dtype]stage.DType{f32: stage.F32, f16: stage.F16, bf16: stage.BF16}[dt]
		f, err := stage.Decode(sd, data, nil)
		if err != nil {
			return 0, err
		}
		for i, v := range f {
			out[i] = float64(v)
		}
	}
	return e.newArr(shape, dt, out), nil
}

func (e *emu) free(a arr) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if _, ok := e.arrays[a]; !ok {
		panic(fmt.Sprintf("emulated mlx: freeing array %d twice or never made", a))
	}
	delete(e.arrays, a)
}

func (e *emu) shape(a arr) []int {
	x, err := e.get(a)
	if err != nil {
		return nil
	}
	return slices.Clone(x[0].shape)
}

func (e *emu) dtype(a arr) dtype {
	x, err := e.get(a)
	if err != nil {
		return 0
	}
	return x[0].dt
}

func (e *emu) nbytes(a arr) uint64 {
	x, err := e.get(a)
	if err != nil {
		return 0
	}
	return uint64(len(x[0].data) * x[0].dt.size())
}

func (e *emu) eval(as ...arr) error {
	_, err := e.get(as...)
	return err
}

func (e *emu) float32s(a arr) ([]float32, error) {
	x, err := e.get(a)
	if err != nil {
		return nil, err
	}
	out := make([]float32, len(x[0].data))
	for i, v := range x[0].data {
		out[i] = float32(v)
	}
	return out, nil
}

// strides of a row-major shape.
func strides(shape []int) []int {
	s := make([]int, len(shape))
	n := 1
	for i := len(shape) - 1; i >= 0; i-- {
		s[i] = n
		n *= shape[i]
	}
	return s
}

// broadcastShape follows NumPy: shapes align at the right, and each pair of
// dimensions must agree or one be 1.
func broadcastShape(a, b []int) ([]int, error) {
	n := max(len(a), len(b))
	out := make([]int, n)
	for i := range n {
		da, db := 1, 1
		if j := len(a) - n + i; j >= 0 {
			da = a[j]
		}
		if j := len(b) - n + i; j >= 0 {
			db = b[j]
		}
		switch {
		case da == db || db == 1:
			out[i] = da
		case da == 1:
			out[i] = db
		default:
			return nil, fmt.Errorf("emulated mlx: shapes %v and %v do not broadcast", a, b)
		}
	}
	return out, nil
}

// index maps an output index (as coordinates) to a flat index of an input
// of shape in, broadcast to out.
func index(coord, in []int) int {
	off := len(coord) - len(in)
	st := strides(in)
	k := 0
	for i, d := range in {
		if d != 1 {
			k += coord[off+i] * st[i]
		}
	}
	return k
}

// each calls f with the coordinates of every element of shape, in order.
func each(shape []int, f func(coord []int)) {
	n := ops.Elements(shape)
	coord := make([]int, len(shape))
	for range n {
		f(coord)
		for i := len(coord) - 1; i >= 0; i-- {
			coord[i]++
			if coord[i] < shape[i] {
				break
			}
			coord[i] = 0
		}
	}
}

// promote is the result dtype of a binary op, as MLX promotes.
func promote(a, b dtype) dtype {
	if a == b {
		return a
	}
	if a == f32 || b == f32 {
		return f32
	}
	if a == i32 {
		return b
	}
	if b == i32 {
		return a
	}
	return f32 // f16 with bf16
}

func (e *emu) binary(a, b arr, f func(x, y float64) float64) (arr, error) {
	x, err := e.get(a, b)
	if err != nil {
		return 0, err
	}
	shape, err := broadcastShape(x[0].shape, x[1].shape)
	if err != nil {
		return 0, err
	}
	out := make([]float64, 0, ops.Elements(shape))
	each(shape, func(c []int) {
		out = append(out, f(x[0].data[index(c, x[0].shape)], x[1].data[index(c, x[1].shape)]))
	})
	return e.newArr(shape, promote(x[0].dt, x[1].dt), out), nil
}

func (e *emu) add(a, b arr) (arr, error) {
	return e.binary(a, b, func(x, y float64) float64 { return x + y })
}

func (e *emu) subtract(a, b arr) (arr, error) {
	return e.binary(a, b, func(x, y float64) float64 { return x - y })
}

func (e *emu) multiply(a, b arr) (arr, error) {
	return e.binary(a, b, func(x, y float64) float64 { return x * y })
}

func (e *emu) matmul(a, b arr) (arr, error) {
	x, err := e.get(a, b)
	if err != nil {
		return 0, err
	}
	as, bs := x[0].shape, x[1].shape
	if len(as) < 2 || len(bs) < 2 || as[len(as)-1] != bs[len(bs)-2] {
		return 0, fmt.Errorf("emulated mlx: matmul of %v and %v", as, bs)
	}
	m, k, n := as[len(as)-2], as[len(as)-1], bs[len(bs)-1]
	batch, err := broadcastShape(as[:len(as)-2], bs[:len(bs)-2])
	if err != nil {
		return 0, err
	}
	shape := append(slices.Clone(batch), m, n)
	out := make([]float64, 0, ops.Elements(shape))
	aBatch, bBatch := as[:len(as)-2], bs[:len(bs)-2]
	each(batch, func(c []int) {
		ao := index(c, aBatch) * m * k
		bo := index(c, bBatch) * k * n
		for i := range m {
			for j := range n {
				var s float64
				for l := range k {
					s += x[0].data[ao+i*k+l] * x[1].data[bo+l*n+j]
				}
				out = append(out, s)
			}
		}
	})
	return e.newArr(shape, promote(x[0].dt, x[1].dt), out), nil
}

func (e *emu) unary(a arr, f func(float64) float64) (arr, error) {
	x, err := e.get(a)
	if err != nil {
		return 0, err
	}
	out := make([]float64, len(x[0].data))
	for i, v := range x[0].data {
		out[i] = f(v)
	}
	return e.newArr(x[0].shape, x[0].dt, out), nil
}

func (e *emu) sigmoid(a arr) (arr, error) {
	return e.unary(a, func(v float64) float64 { return 1 / (1 + math.Exp(-v)) })
}

func (e *emu) astype(a arr, dt dtype) (arr, error) {
	x, err := e.get(a)
	if err != nil {
		return 0, err
	}
	return e.newArr(x[0].shape, dt, slices.Clone(x[0].data)), nil
}

func (e *emu) reshape(a arr, shape []int) (arr, error) {
	x, err := e.get(a)
	if err != nil {
		return 0, err
	}
	if ops.Elements(shape) != len(x[0].data) {
		return 0, fmt.Errorf("emulated mlx: reshape of %v to %v", x[0].shape, shape)
	}
	return e.newArr(shape, x[0].dt, slices.Clone(x[0].data)), nil
}

func (e *emu) transpose(a arr, axes []int) (arr, error) {
	x, err := e.get(a)
	if err != nil {
		return 0, err
	}
	in := x[0].shape
	if len(axes) != len(in) {
		return 0, fmt.Errorf("emulated mlx: transpose of %v by %v", in, axes)
	}
	shape := make([]int, len(in))
	for i, ax := range axes {
		shape[i] = in[ax]
	}
	st := strides(in)
	out := make([]float64, 0, len(x[0].data))
	each(shape, func(c []int) {
		k := 0
		for i, ax := range axes {
			k += c[i] * st[ax]
		}
		out = append(out, x[0].data[k])
	})
	return e.newArr(shape, x[0].dt, out), nil
}

func (e *emu) take(a, indices arr, axis int) (arr, error) {
	x, err := e.get(a, indices)
	if err != nil {
		return 0, err
	}
	in, idx := x[0].shape, x[1].data
	if len(x[1].shape) != 1 || axis < 0 || axis >= len(in) {
		return 0, fmt.Errorf("emulated mlx: take along %d of %v with indices %v", axis, in, x[1].shape)
	}
	shape := slices.Clone(in)
	shape[axis] = len(idx)
	st := strides(in)
	out := make([]float64, 0, ops.Elements(shape))
	var bad error
	each(shape, func(c []int) {
		k := 0
		for i, v := range c {
			if i == axis {
				j := int(idx[v])
				if j < 0 || j >= in[axis] {
					bad = fmt.Errorf("emulated mlx: index %d out of %d", j, in[axis])
					j = 0
				}
				v = j
			}
			k += v * st[i]
		}
		out = append(out, x[0].data[k])
	})
	if bad != nil {
		return 0, bad
	}
	return e.newArr(shape, x[0].dt, out), nil
}

func (e *emu) concatenate(as []arr, axis int) (arr, error) {
	x, err := e.get(as...)
	if err != nil {
		return 0, err
	}
	if len(x) == 0 {
		return 0, fmt.Errorf("emulated mlx: concatenate of nothing")
	}
	shape := slices.Clone(x[0].shape)
	shape[axis] = 0
	dt := x[0].dt
	for _, a := range x {
		for i := range shape {
			if i != axis && a.shape[i] != shape[i] {
				return 0, fmt.Errorf("emulated mlx: concatenate of %v and %v along %d", x[0].shape, a.shape, axis)
			}
		}
		shape[axis] += a.shape[axis]
		dt = promote(dt, a.dt)
	}
	out := make([]float64, 0, ops.Elements(shape))
	each(shape, func(c []int) {
		p := c[axis]
		for _, a := range x {
			if p < a.shape[axis] {
				cc := slices.Clone(c)
				cc[axis] = p
				out = append(out, a.data[index(cc, a.shape)])
				return
			}
			p -= a.shape[axis]
		}
	})
	return e.newArr(shape, dt, out), nil
}

func checkBox(in, start, stop []int) error {
	if len(start) != len(in) || len(stop) != len(in) {
		return fmt.Errorf("emulated mlx: box %v-%v of %v", start, stop, in)
	}
	for i := range in {
		if start[i] < 0 || stop[i] > in[i] || start[i] > stop[i] {
			return fmt.Errorf("emulated mlx: box %v-%v of %v", start, stop, in)
		}
	}
	return nil
}

func (e *emu) slice(a arr, start, stop []int) (arr, error) {
	x, err := e.get(a)
	if err != nil {
		return 0, err
	}
	if err := checkBox(x[0].shape, start, stop); err != nil {
		return 0, err
	}
	shape := make([]int, len(start))
	for i := range shape {
		shape[i] = stop[i] - start[i]
	}
	st := strides(x[0].shape)
	out := make([]float64, 0, ops.Elements(shape))
	each(shape, func(c []int) {
		k := 0
		for i, v := range c {
			k += (v + start[i]) * st[i]
		}
		out = append(out, x[0].data[k])
	})
	return e.newArr(shape, x[0].dt, out), nil
}

func (e *emu) sliceUpdate(src, update arr, start, stop []int) (arr, error) {
	x, err := e.get(src, update)
	if err != nil {
		return 0, err
	}
	if err := checkBox(x[0].shape, start, stop); err != nil {
		return 0, err
	}
	for i := range start {
		if x[1].shape[i] != stop[i]-start[i] {
			return 0, fmt.Errorf("emulated mlx: update %v into box %v-%v", x[1].shape, start, stop)
		}
	}
	out := slices.Clone(x[0].data)
	st := strides(x[0].shape)
	i := 0
	each(x[1].shape, func(c []int) {
		k := 0
		for d, v := range c {
			k += (v + start[d]) * st[d]
		}
		out[k] = x[1].data[i]
		i++
	})
	return e.newArr(x[0].shape, x[0].dt, out), nil
}

func (e *emu) zeros(shape []int, dt dtype) (arr, error) {
	return e.newArr(shape, dt, make([]float64, ops.Elements(shape))), nil
}

// lastAxis applies f to each row along the last axis.
func (e *emu) lastAxis(a arr, f func(row, out []float64)) (arr, error) {
	x, err := e.get(a)
	if err != nil {
		return 0, err
	}
	w := x[0].shape[len(x[0].shape)-1]
	out := make([]float64, len(x[0].data))
	for r := 0; r < len(out); r += w {
		f(x[0].data[r:r+w], out[r:r+w])
	}
	return e.newArr(x[0].shape, x[0].dt, out), nil
}

func (e *emu) softmax(a arr, axis int) (arr, error) {
	if axis != -1 {
		return 0, fmt.Errorf("emulated mlx: softmax along %d (only -1 is emulated)", axis)
	}
	return e.lastAxis(a, func(row, out []float64) {
		mx := math.Inf(-1)
		for _, v := range row {
			mx = max(mx, v)
		}
		var s float64
		for i, v := range row {
			out[i] = math.Exp(v - mx)
			s += out[i]
		}
		for i := range out {
			out[i] /= s
		}
	})
}

func (e *emu) rmsNorm(xa, wa arr, eps float32) (arr, error) {
	w, err := e.get(wa)
	if err != nil {
		return 0, err
	}
	return e.lastAxis(xa, func(row, out []float64) {
		var ss float64
		for _, v := range row {
			ss += v * v
		}
		inv := 1 / math.Sqrt(ss/float64(len(row))+float64(eps))
		for i, v := range row {
			out[i] = v * inv * w[0].data[i]
		}
	})
}

func (e *emu) quantize(wa arr, group, bits int) (arr, arr, arr, error) {
	x, err := e.get(wa)
	if err != nil {
		return 0, 0, 0, err
	}
	shape := x[0].shape
	if len(shape) != 2 || shape[1]%group != 0 {
		return 0, 0, 0, fmt.Errorf("emulated mlx: quantize %v in groups of %d", shape, group)
	}
	vals := make([]float32, len(x[0].data))
	for i, v := range x[0].data {
		vals[i] = float32(v)
	}
	ops.FakeQuantize(vals, ops.Quant{Bits: bits, GroupSize: group})
	q := make([]float64, len(vals))
	for i, v := range vals {
		q[i] = float64(v)
	}
	gs := []int{shape[0], shape[1] / group}
	// The codes stand in for MLX's packed uint32 words; scales and biases
	// keep their real shapes so that gathers along rows are exercised.
	wq := e.put(&earr{shape: slices.Clone(shape), data: q, dt: x[0].dt})
	s, _ := e.zeros(gs, x[0].dt)
	b, _ := e.zeros(gs, x[0].dt)
	return wq, s, b, nil
}

func (e *emu) dequantize(wq, scales, biases arr, group, bits int) (arr, error) {
	x, err := e.get(wq, scales, biases)
	if err != nil {
		return 0, err
	}
	if x[1].shape[0] != x[0].shape[0] || x[1].shape[1]*group != x[0].shape[1] || !slices.Equal(x[1].shape, x[2].shape) {
		return 0, fmt.Errorf("emulated mlx: dequantize %v with scales %v", x[0].shape, x[1].shape)
	}
	return e.newArr(x[0].shape, x[0].dt, slices.Clone(x[0].data)), nil
}

func (e *emu) quantizedMatmul(xa, wq, scales, biases arr, group, bits int) (arr, error) {
	w, err := e.dequantize(wq, scales, biases, group, bits)
	if err != nil {
		return 0, err
	}
	defer e.free(w)
	wt, err := e.transpose(w, []int{1, 0})
	if err != nil {
		return 0, err
	}
	defer e.free(wt)
	return e.matmul(xa, wt)
}
