// Package ops is the small tensor-operations interface that mlxstage's model
// code is written against, so that the same layer code runs on MLX (on Apple
// Silicon, package mlxstage/mlx) and on the pure-Go reference backend here
// (everywhere, for tests).
//
// The interface is shaped by what a decoder block of the llama family needs
// and by MLX's programming model: a Backend holds long-lived arrays (weights,
// KV caches); a Context is one forward pass, whose intermediate arrays it
// owns and frees on Close. Operations never fail in their signature: a
// Context records its first error and every later operation is a no-op, and
// Float32 (the only operation that forces evaluation, as MLX's graphs are
// lazy) or Err reports it. This keeps the model code reading like the math.
//
// Every activation is a row-major matrix [rows, cols], one row per token;
// attention heads are column blocks of headDim. Reshape exists for the few
// per-head operations (Qwen3's q/k norms).
package ops

import (
	"errors"
	"fmt"

	"github.com/meshnode/meshnode/stage"
)

// Tensor is a backend's handle on an array. Handles of one backend must not
// be given to another.
type Tensor interface {
	Shape() []int
}

// Quant is a load-time weight quantization: affine (scale and bias per group
// of GroupSize consecutive values along a row), Bits per value, as MLX's
// quantize does. The zero value keeps weights as stored.
type Quant struct {
	Bits      int // 0 = not quantized; else 2, 3, 4, 6 or 8
	GroupSize int // values per scale/bias group: 32, 64 or 128
}

// None reports whether q leaves weights unquantized.
func (q Quant) None() bool { return q.Bits == 0 }

func (q Quant) String() string {
	if q.None() {
		return "none"
	}
	return fmt.Sprintf("q%d/g%d", q.Bits, q.GroupSize)
}

// Validate checks q against the settings MLX supports.
func (q Quant) Validate() error {
	if q.None() {
		return nil
	}
	switch q.Bits {
	case 2, 3, 4, 6, 8:
	default:
		return fmt.Errorf("quantization to %d bits is not supported (2, 3, 4, 6 or 8)", q.Bits)
	}
	switch q.GroupSize {
	case 32, 64, 128:
	default:
		return fmt.Errorf("quantization group size %d is not supported (32, 64 or 128)", q.GroupSize)
	}
	return nil
}

// Backend creates and holds the arrays that outlive a forward pass.
type Backend interface {
	// Name is the engine name a stage reports ("reference", "mlx").
	Name() string
	// Device is where it computes ("CPU", "Metal").
	Device() string
	// Weight makes a weight from raw little-endian data of dtype with the
	// given shape ([n] for a vector, [out, in] for a matrix). Matrices are
	// quantized as q says; vectors never are. It returns the bytes the
	// weight holds in the backend.
	Weight(data []byte, dtype stage.DType, shape []int, q Quant) (Tensor, uint64, error)
	// FreeWeight releases a weight.
	FreeWeight(w Tensor)
	// NewKV makes an empty cache of one layer of one sequence: up to
	// capacity positions of kvHeads×headDim keys and values.
	NewKV(kvHeads, headDim, capacity int) (KV, error)
	// NewContext starts a forward pass.
	NewContext() Context
	// Close releases what the backend itself holds.
	Close() error
}

// Runner is implemented by backends whose library binds state to an OS
// thread (MLX's streams and Metal command queues). Users run every group of
// calls on such a backend and its tensors (loading, a forward pass,
// freeing) inside Run; Run calls f on that thread and returns when f does.
// Run may be nested.
type Runner interface {
	Run(f func())
}

// Run calls f through b's Runner if it has one, else directly.
func Run(b Backend, f func()) {
	if r, ok := b.(Runner); ok {
		r.Run(f)
		return
	}
	f()
}

// KV is the key/value cache of one layer of one sequence. Position p of the
// sequence is entry p: entries are dense from 0 to Len()-1.
type KV interface {
	Len() int
	// Trim keeps positions [0, n).
	Trim(n int)
	// Free releases the cache's memory.
	Free()
}

// Context is one forward pass. It is not safe for concurrent use.
type Context interface {
	// Input makes a [rows, cols] tensor of data.
	Input(data []float32, rows, cols int) Tensor
	// Embedding gathers rows ids of table [vocab, embd].
	Embedding(table Tensor, ids []int32) Tensor
	// Linear is x [n, in] times w [out, in] transposed, plus b [out] when b
	// is not nil: a PyTorch Linear layer.
	Linear(x, w, b Tensor) Tensor
	// RMSNorm normalizes each row of x by its root mean square (plus eps
	// inside the root) and scales it by w [cols].
	RMSNorm(x, w Tensor, eps float32) Tensor
	// RoPE rotates each headDim-wide column block of x [n, heads*headDim]
	// by the angles pos[r]*invFreq[i], in Hugging Face's rotate-half layout:
	// element i pairs with element i+len(invFreq). 2*len(invFreq) may be
	// less than headDim; the remaining columns pass through.
	RoPE(x Tensor, pos []int32, headDim int, invFreq []float32) Tensor
	// Add and Mul are elementwise over tensors of one shape.
	Add(a, b Tensor) Tensor
	Mul(a, b Tensor) Tensor
	// SiLU is x*sigmoid(x).
	SiLU(x Tensor) Tensor
	// Reshape views x with another shape of the same size.
	Reshape(x Tensor, shape ...int) Tensor
	// Rows gathers rows idx of x.
	Rows(x Tensor, idx []int32) Tensor
	// Concat stacks tensors of equal width by rows.
	Concat(ts ...Tensor) Tensor
	// Attend appends the m rows of k and v [m, kvHeads*headDim] to c at
	// positions c.Len() ... c.Len()+m-1, then returns causal softmax
	// attention of q [m, heads*headDim]: row i attends to positions
	// [0, c.Len()+i] (c.Len() as it was before the append). Query head h
	// reads key/value head h/(heads/kvHeads). Scores are scaled by scale.
	Attend(c KV, q, k, v Tensor, heads int, scale float32) Tensor
	// Float32 evaluates t and returns its values, row-major.
	Float32(t Tensor) ([]float32, error)
	// Err is the first error of any operation so far.
	Err() error
	// Close frees every array the context created.
	Close()
}

// ErrShape is wrapped by errors about operands of the wrong shape.
var ErrShape = errors.New("ops: shape mismatch")

// Elements is the product of a shape.
func Elements(shape []int) int {
	n := 1
	for _, d := range shape {
		n *= d
	}
	return n
}
