package stage

import (
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"slices"
	"unsafe"
)

// DType is the element type of an activation on the wire.
type DType uint8

const (
	F32  DType = 1
	F16  DType = 2
	BF16 DType = 3
)

// Size is the number of bytes of one element.
func (d DType) Size() int {
	switch d {
	case F32:
		return 4
	case F16, BF16:
		return 2
	}
	return 0
}

func (d DType) String() string {
	switch d {
	case F32:
		return "f32"
	case F16:
		return "f16"
	case BF16:
		return "bf16"
	}
	return fmt.Sprintf("dtype(%d)", uint8(d))
}

// ParseDType parses "f32", "f16" or "bf16".
func ParseDType(s string) (DType, error) {
	switch s {
	case "f32", "F32", "float32":
		return F32, nil
	case "f16", "F16", "float16":
		return F16, nil
	case "bf16", "BF16", "bfloat16":
		return BF16, nil
	}
	return 0, fmt.Errorf("unknown activation dtype %q (want f32, f16 or bf16)", s)
}

// MaxActivationBytes bounds one activation so a peer cannot make us allocate
// without limit: 1 GiB is a 64k-token prefill chunk at n_embd 8192 in f16.
const MaxActivationBytes = 1 << 30

// Activation is a [Rows, Cols] matrix of hidden states, row-major,
// little-endian, in DType.
type Activation struct {
	DType DType
	Rows  int
	Cols  int
	Data  []byte
}

// Validate checks that dtype, shape and payload agree.
func (a *Activation) Validate() error {
	if a.DType.Size() == 0 {
		return fmt.Errorf("stage: activation has unknown dtype %d", uint8(a.DType))
	}
	if a.Rows <= 0 || a.Cols <= 0 {
		return fmt.Errorf("stage: activation shape [%d,%d] is not positive", a.Rows, a.Cols)
	}
	// Bound each factor first so that the product cannot wrap around.
	if a.Rows > MaxActivationBytes || a.Cols > MaxActivationBytes {
		return fmt.Errorf("stage: activation [%d,%d] %s is over the %d byte limit", a.Rows, a.Cols, a.DType, MaxActivationBytes)
	}
	want := uint64(a.Rows) * uint64(a.Cols) * uint64(a.DType.Size())
	if want > MaxActivationBytes {
		return fmt.Errorf("stage: activation [%d,%d] %s is %d bytes, over the %d limit", a.Rows, a.Cols, a.DType, want, MaxActivationBytes)
	}
	if uint64(len(a.Data)) != want {
		return fmt.Errorf("stage: activation [%d,%d] %s needs %d bytes, payload has %d", a.Rows, a.Cols, a.DType, want, len(a.Data))
	}
	return nil
}

// NewActivation encodes f (len rows*cols) as dtype.
func NewActivation(dtype DType, rows, cols int, f []float32) (*Activation, error) {
	if len(f) != rows*cols {
		return nil, fmt.Errorf("stage: %d floats do not fill [%d,%d]", len(f), rows, cols)
	}
	a := &Activation{DType: dtype, Rows: rows, Cols: cols}
	var err error
	a.Data, err = Encode(dtype, f, nil)
	return a, err
}

// SharedActivation is an F32 activation of f (len rows*cols) that shares
// f's memory, for an engine that lends its output (Output.Free): on a
// little-endian host, as every host meshnode runs on, no copy; elsewhere
// NewActivation's.
func SharedActivation(rows, cols int, f []float32) (*Activation, error) {
	if !littleEndian || len(f) != rows*cols {
		return NewActivation(F32, rows, cols, f)
	}
	return &Activation{DType: F32, Rows: rows, Cols: cols, Data: floatBytes(f)}, nil
}

// Float32 decodes the activation to float32s.
func (a *Activation) Float32() ([]float32, error) {
	if err := a.Validate(); err != nil {
		return nil, err
	}
	return Decode(a.DType, a.Data, nil)
}

// Float32Shared is Float32 without its copy where none is needed: an F32
// activation on a little-endian host, its Data aligned for float32s, is
// returned as the float32s it holds, sharing a's memory (a hop's 16-row
// micro-batch of an 8B model is 256 KiB). Neither the result nor a.Data
// may be changed while the other is in use.
func (a *Activation) Float32Shared() ([]float32, error) {
	if err := a.Validate(); err != nil {
		return nil, err
	}
	if f, ok := f32View(a.DType, a.Data); ok {
		return f, nil
	}
	return Decode(a.DType, a.Data, nil)
}

// f32View is data as the float32s it holds, sharing its memory, when it is
// F32 on a little-endian host and aligned for float32s.
func f32View(dtype DType, data []byte) ([]float32, bool) {
	p := unsafe.SliceData(data)
	if dtype != F32 || !littleEndian || uintptr(unsafe.Pointer(p))%4 != 0 {
		return nil, false
	}
	return unsafe.Slice((*float32)(unsafe.Pointer(p)), len(data)/4), true
}

// Encode appends f encoded as dtype to dst.
func Encode(dtype DType, f []float32, dst []byte) ([]byte, error) {
	n := len(dst)
	size := dtype.Size()
	if size == 0 {
		return nil, fmt.Errorf("stage: cannot encode dtype %d", uint8(dtype))
	}
	if dtype == F32 && littleEndian {
		// append copies into the new memory without clearing it first,
		// as slices.Grow does (a 16-row micro-batch of an 8B model is 256
		// KiB a hop).
		return append(dst, floatBytes(f)...), nil
	}
	dst = slices.Grow(dst, len(f)*size)[:n+len(f)*size]
	out := dst[n:]
	switch dtype {
	case F32:
		for i, v := range f {
			binary.LittleEndian.PutUint32(out[4*i:], math.Float32bits(v))
		}
	case F16:
		encodeF16(out, f)
	case BF16:
		for i, v := range f {
			binary.LittleEndian.PutUint16(out[2*i:], Float32ToBF16(v))
		}
	}
	return dst, nil
}

// Decode appends the float32 values of data (encoded as dtype) to dst.
func Decode(dtype DType, data []byte, dst []float32) ([]float32, error) {
	size := dtype.Size()
	if size == 0 {
		return nil, fmt.Errorf("stage: cannot decode dtype %d", uint8(dtype))
	}
	if len(data)%size != 0 {
		return nil, errors.New("stage: payload is not a whole number of elements")
	}
	n := len(data) / size
	if f, ok := f32View(dtype, data); ok {
		// data is float32s already: append them, which does not clear
		// the new memory first.
		return append(dst, f...), nil
	}
	base := len(dst)
	dst = slices.Grow(dst, n)[:base+n]
	out := dst[base:]
	switch dtype {
	case F32:
		if littleEndian { // data is not aligned for float32s
			copy(floatBytes(out), data)
			break
		}
		for i := range out {
			out[i] = math.Float32frombits(binary.LittleEndian.Uint32(data[4*i:]))
		}
	case F16:
		decodeF16(out, data)
	case BF16:
		for i := range out {
			out[i] = BF16ToFloat32(binary.LittleEndian.Uint16(data[2*i:]))
		}
	}
	return dst, nil
}

// littleEndian says the host lays a float32 out as F32 does on the wire,
// so that F32 crosses with one copy each way instead of a loop over its
// elements (16 rows of an 8B model's hidden state: 67 -> 6 us on a 2-core
// machine; at 32 streams on two H200s the loops took 3% of each node's CPU
// time, most of it for prefill, run 102).
var littleEndian = binary.NativeEndian.Uint16([]byte{1, 0}) == 1

// floatBytes is f's memory as bytes.
func floatBytes(f []float32) []byte {
	return unsafe.Slice((*byte)(unsafe.Pointer(unsafe.SliceData(f))), 4*len(f))
}

// encodeF16 writes f as F16 into out (2 bytes each). A value whose half is
// normal takes one add to round (to nearest even, its carry moving into the
// exponent and up to Inf as Float32ToF16's does); the rest take
// Float32ToF16.
func encodeF16(out []byte, f []float32) {
	out = out[:2*len(f)]
	for i, v := range f {
		b := math.Float32bits(v)
		var h uint16
		if e := b >> 23 & 0xff; e-113 <= 142-113 { // exponents -14..15: e-113 wraps below 113
			r := b&0x7fffffff - 112<<23
			r += 0xfff + r>>13&1
			h = uint16(b>>16)&0x8000 | uint16(r>>13)
		} else {
			h = Float32ToF16(v)
		}
		out[2*i], out[2*i+1] = byte(h), byte(h>>8)
	}
}

// decodeF16 writes the values of data (F16) into out: a normal half is
// rebiased in place, the rest take F16ToFloat32.
func decodeF16(out []float32, data []byte) {
	data = data[:2*len(out)]
	for i := range out {
		h := uint32(data[2*i]) | uint32(data[2*i+1])<<8
		if e := h & 0x7c00; e != 0 && e != 0x7c00 {
			out[i] = math.Float32frombits(h&0x8000<<16 | (h&0x7fff+112<<10)<<13)
		} else {
			out[i] = F16ToFloat32(uint16(h))
		}
	}
}

// Float32ToBF16 rounds to nearest even; NaN stays NaN.
func Float32ToBF16(f float32) uint16 {
	b := math.Float32bits(f)
	if b&0x7fffffff > 0x7f800000 { // NaN: keep it quiet and non-zero
		return uint16(b>>16) | 0x40
	}
	b += 0x7fff + (b>>16)&1
	return uint16(b >> 16)
}

// BF16ToFloat32 is exact.
func BF16ToFloat32(h uint16) float32 { return math.Float32frombits(uint32(h) << 16) }

// Float32ToF16 converts to IEEE 754 half precision, rounding to nearest even,
// with overflow to infinity and gradual underflow to subnormals.
func Float32ToF16(f float32) uint16 {
	b := math.Float32bits(f)
	sign := uint16(b>>16) & 0x8000
	exp := int32(b>>23) & 0xff
	mant := b & 0x7fffff

	switch {
	case exp == 0xff: // Inf or NaN
		if mant != 0 {
			return sign | 0x7e00
		}
		return sign | 0x7c00
	case exp-127 > 15: // overflow
		return sign | 0x7c00
	case exp-127 >= -14: // normal half
		e := uint32(exp-127+15) << 10
		m := mant >> 13
		h := e | m
		// round to nearest even on the 13 dropped bits
		rest := mant & 0x1fff
		if rest > 0x1000 || (rest == 0x1000 && h&1 == 1) {
			h++ // may carry into the exponent, which is the right answer (up to Inf)
		}
		return sign | uint16(h)
	case exp-127 >= -25: // subnormal half
		m := mant | 0x800000 // implicit leading one
		shift := uint32(-(exp - 127) - 14 + 13)
		h := m >> shift
		rest := m & (1<<shift - 1)
		half := uint32(1) << (shift - 1)
		if rest > half || (rest == half && h&1 == 1) {
			h++
		}
		return sign | uint16(h)
	default: // underflow to signed zero
		return sign
	}
}

// F16ToFloat32 is exact.
func F16ToFloat32(h uint16) float32 {
	sign := uint32(h&0x8000) << 16
	exp := uint32(h>>10) & 0x1f
	mant := uint32(h & 0x3ff)
	switch {
	case exp == 0x1f:
		return math.Float32frombits(sign | 0x7f800000 | mant<<13)
	case exp != 0:
		return math.Float32frombits(sign | (exp+127-15)<<23 | mant<<13)
	case mant == 0:
		return math.Float32frombits(sign)
	default: // subnormal: normalize
		e := uint32(127 - 15 + 1)
		for mant&0x400 == 0 {
			mant <<= 1
			e--
		}
		return math.Float32frombits(sign | e<<23 | (mant&0x3ff)<<13)
	}
}
