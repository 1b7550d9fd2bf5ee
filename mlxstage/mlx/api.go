package mlx

// arr is an mlx_array handle (the ctx pointer of mlx-c's struct), opaque to
// Go. 0 is no array.
type arr uintptr

// dtype names the element types the binding uses; the cgo layer maps them
// to mlx_dtype.
type dtype uint8

const (
	f32 dtype = iota + 1
	f16
	bf16
	i32
)

func (d dtype) size() int {
	switch d {
	case f32, i32:
		return 4
	}
	return 2
}

// api is the part of mlx-c the backend uses: one method per C function (or
// per small group), each returning the error MLX reported. It is the whole
// cgo surface; capi_darwin.go implements it on mlx-c, emulate.go in pure
// Go, so that the backend's composition of these primitives is tested where
// MLX cannot run. Shapes are outermost first, as in MLX.
type api interface {
	// fromData copies data (little-endian, of dt) into a new array.
	fromData(data []byte, shape []int, dt dtype) (arr, error)
	free(a arr)
	shape(a arr) []int
	dtype(a arr) dtype
	nbytes(a arr) uint64
	// eval computes the arrays' graphs.
	eval(as ...arr) error
	// float32s evaluates a and copies it out as float32.
	float32s(a arr) ([]float32, error)

	add(a, b arr) (arr, error)
	subtract(a, b arr) (arr, error)
	multiply(a, b arr) (arr, error)
	matmul(a, b arr) (arr, error)
	sigmoid(a arr) (arr, error)
	astype(a arr, dt dtype) (arr, error)
	reshape(a arr, shape []int) (arr, error)
	transpose(a arr, axes []int) (arr, error)
	take(a, indices arr, axis int) (arr, error)
	concatenate(as []arr, axis int) (arr, error)
	slice(a arr, start, stop []int) (arr, error)
	sliceUpdate(src, update arr, start, stop []int) (arr, error)
	zeros(shape []int, dt dtype) (arr, error)
	softmax(a arr, axis int) (arr, error) // precise: accumulates in float32
	rmsNorm(x, w arr, eps float32) (arr, error)

	// Affine group quantization along the last axis (mode "affine").
	quantize(w arr, group, bits int) (wq, scales, biases arr, err error)
	dequantize(wq, scales, biases arr, group, bits int) (arr, error)
	// quantizedMatmul is x times w transposed, w given quantized.
	quantizedMatmul(x, wq, scales, biases arr, group, bits int) (arr, error)
}
