//go:build darwin && arm64 && mlx && cgo

package mlx

// The cgo surface: the api interface on mlx-c. The library is not linked;
// it is opened with dlopen on first use and every function is looked up
// with dlsym into a pointer whose type comes from mlx-c's own header
// (__typeof__), so a header whose signatures differ from the calls below
// fails to compile instead of corrupting the stack at run time. Only the
// headers are needed to build.
//
// Written against the mlx-c headers whose mlx_quantize takes (mode,
// global_scale) and returns an mlx_vector_array (mlx-c 0.6.0 and later);
// the quantization calls are the ones that changed across mlx-c releases.
// mlxstage/README.md says what it was checked against and how to check it.

/*
#cgo CFLAGS: -I/opt/homebrew/include -I/usr/local/include
#include <dlfcn.h>
#include <pthread.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#if __has_include("mlx/c/mlx.h")
#include "mlx/c/mlx.h"
#else
#error "mlx-c headers not found: brew install mlx-c, or build mlx-c and set CGO_CFLAGS=-I<prefix>/include (see mlxstage/mlx/mlx.go)"
#endif

#define MLX_FUNCS(X) \
	X(mlx_set_error_handler) X(mlx_default_gpu_stream_new) X(mlx_stream_free) \
	X(mlx_array_new) X(mlx_array_new_data) X(mlx_array_free) X(mlx_array_ndim) \
	X(mlx_array_shape) X(mlx_array_dtype) X(mlx_array_nbytes) X(mlx_array_size) \
	X(mlx_array_data_float32) X(mlx_vector_array_new) X(mlx_vector_array_free) \
	X(mlx_vector_array_append_value) X(mlx_vector_array_get) X(mlx_vector_array_size) \
	X(mlx_eval) X(mlx_add) X(mlx_subtract) X(mlx_multiply) X(mlx_matmul) \
	X(mlx_sigmoid) X(mlx_astype) X(mlx_reshape) X(mlx_transpose_axes) \
	X(mlx_take_axis) X(mlx_concatenate_axis) X(mlx_slice) X(mlx_slice_update) \
	X(mlx_zeros) X(mlx_softmax_axis) X(mlx_contiguous) X(mlx_fast_rms_norm) \
	X(mlx_quantize) X(mlx_dequantize) X(mlx_quantized_matmul)

#define DECLARE(name) static __typeof__(&name) p_##name;
MLX_FUNCS(DECLARE)

static void* lib;
static mlx_stream stream;
static pthread_t owner;
static char last_error[2048];

static void on_error(const char* msg, void* data) {
	(void)data;
	strncpy(last_error, msg ? msg : "unknown MLX error", sizeof last_error - 1);
}

static void set_error(const char* msg) {
	strncpy(last_error, msg, sizeof last_error - 1);
}

// mlxs_open loads the library from path and binds this thread to it; it
// returns NULL or what went wrong.
static const char* mlxs_open(const char* path) {
	lib = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	if (!lib) {
		return dlerror();
	}
#define LOOKUP(name) \
	p_##name = (__typeof__(p_##name))dlsym(lib, #name); \
	if (!p_##name) { dlclose(lib); lib = NULL; return "libmlxc has no symbol " #name " (an mlx-c release other than the one this binding was written for?)"; }
	MLX_FUNCS(LOOKUP)
	// The default handler prints and exits the process; record instead.
	p_mlx_set_error_handler(on_error, NULL, NULL);
	owner = pthread_self();
	stream = p_mlx_default_gpu_stream_new();
	return NULL;
}

static const char* mlxs_error(void) { return last_error; }
static int mlxs_on_thread(void) { return lib && pthread_equal(owner, pthread_self()); }

#define A(h) ((mlx_array){(void*)(h)})
#define CHECK() \
	if (!pthread_equal(owner, pthread_self())) { set_error("MLX called off its thread"); return 1; } \
	last_error[0] = 0;
// FINISH hands the result out, freeing it on failure.
#define FINISH(r, rc, out) \
	if (rc != 0) { if (r.ctx) p_mlx_array_free(r); if (!last_error[0]) set_error("MLX call failed"); return rc; } \
	*(out) = (uintptr_t)r.ctx; return 0;

static mlx_dtype to_dtype(int d) {
	switch (d) {
	case 1: return MLX_FLOAT32;
	case 2: return MLX_FLOAT16;
	case 3: return MLX_BFLOAT16;
	default: return MLX_INT32;
	}
}

static int from_dtype(mlx_dtype d) {
	switch (d) {
	case MLX_FLOAT32: return 1;
	case MLX_FLOAT16: return 2;
	case MLX_BFLOAT16: return 3;
	case MLX_INT32: return 4;
	default: return 0;
	}
}

static int mlxs_from_data(const void* data, const int* shape, int ndim, int dt, uintptr_t* out) {
	CHECK();
	mlx_array r = p_mlx_array_new_data(data, shape, ndim, to_dtype(dt));
	if (!r.ctx) { set_error("mlx_array_new_data failed"); return 1; }
	*out = (uintptr_t)r.ctx;
	return 0;
}

static void mlxs_free(uintptr_t a) { if (a) p_mlx_array_free(A(a)); }
static int mlxs_ndim(uintptr_t a) { return (int)p_mlx_array_ndim(A(a)); }
static const int* mlxs_shape(uintptr_t a) { return p_mlx_array_shape(A(a)); }
static int mlxs_dtype(uintptr_t a) { return from_dtype(p_mlx_array_dtype(A(a))); }
static uint64_t mlxs_nbytes(uintptr_t a) { return (uint64_t)p_mlx_array_nbytes(A(a)); }

static int mlxs_eval(const uintptr_t* as, int n) {
	CHECK();
	mlx_vector_array v = p_mlx_vector_array_new();
	for (int i = 0; i < n; i++) p_mlx_vector_array_append_value(v, A(as[i]));
	int rc = p_mlx_eval(v);
	p_mlx_vector_array_free(v);
	return rc;
}

// mlxs_float32s copies a (any dtype, any layout) out as row-major float32
// into dst, which holds n floats.
static int mlxs_float32s(uintptr_t a, float* dst, size_t n) {
	CHECK();
	mlx_array f = p_mlx_array_new(), c = p_mlx_array_new();
	int rc = p_mlx_astype(&f, A(a), MLX_FLOAT32, stream);
	if (rc == 0) rc = p_mlx_contiguous(&c, f, false, stream);
	if (rc == 0) {
		mlx_vector_array v = p_mlx_vector_array_new();
		p_mlx_vector_array_append_value(v, c);
		rc = p_mlx_eval(v);
		p_mlx_vector_array_free(v);
	}
	if (rc == 0) {
		const float* p = p_mlx_array_data_float32(c);
		if (!p || p_mlx_array_size(c) != n) { set_error("MLX array data unavailable"); rc = 1; }
		else memcpy(dst, p, n * sizeof(float));
	}
	if (f.ctx) p_mlx_array_free(f);
	if (c.ctx) p_mlx_array_free(c);
	return rc;
}

#define BINARY(fn) \
	static int mlxs_##fn(uintptr_t a, uintptr_t b, uintptr_t* out) { \
		CHECK(); mlx_array r = p_mlx_array_new(); \
		int rc = p_mlx_##fn(&r, A(a), A(b), stream); FINISH(r, rc, out) }
BINARY(add)
BINARY(subtract)
BINARY(multiply)
BINARY(matmul)

static int mlxs_sigmoid(uintptr_t a, uintptr_t* out) {
	CHECK(); mlx_array r = p_mlx_array_new();
	int rc = p_mlx_sigmoid(&r, A(a), stream); FINISH(r, rc, out)
}

static int mlxs_astype(uintptr_t a, int dt, uintptr_t* out) {
	CHECK(); mlx_array r = p_mlx_array_new();
	int rc = p_mlx_astype(&r, A(a), to_dtype(dt), stream); FINISH(r, rc, out)
}

static int mlxs_reshape(uintptr_t a, const int* shape, int n, uintptr_t* out) {
	CHECK(); mlx_array r = p_mlx_array_new();
	int rc = p_mlx_reshape(&r, A(a), shape, (size_t)n, stream); FINISH(r, rc, out)
}

static int mlxs_transpose(uintptr_t a, const int* axes, int n, uintptr_t* out) {
	CHECK(); mlx_array r = p_mlx_array_new();
	int rc = p_mlx_transpose_axes(&r, A(a), axes, (size_t)n, stream); FINISH(r, rc, out)
}

static int mlxs_take(uintptr_t a, uintptr_t idx, int axis, uintptr_t* out) {
	CHECK(); mlx_array r = p_mlx_array_new();
	int rc = p_mlx_take_axis(&r, A(a), A(idx), axis, stream); FINISH(r, rc, out)
}

static int mlxs_concatenate(const uintptr_t* as, int n, int axis, uintptr_t* out) {
	CHECK(); mlx_array r = p_mlx_array_new();
	mlx_vector_array v = p_mlx_vector_array_new();
	for (int i = 0; i < n; i++) p_mlx_vector_array_append_value(v, A(as[i]));
	int rc = p_mlx_concatenate_axis(&r, v, axis, stream);
	p_mlx_vector_array_free(v);
	FINISH(r, rc, out)
}

static int mlxs_slice(uintptr_t a, const int* start, const int* stop, const int* strides, int n, uintptr_t* out) {
	CHECK(); mlx_array r = p_mlx_array_new();
	int rc = p_mlx_slice(&r, A(a), start, (size_t)n, stop, (size_t)n, strides, (size_t)n, stream); FINISH(r, rc, out)
}

static int mlxs_slice_update(uintptr_t src, uintptr_t upd, const int* start, const int* stop, const int* strides, int n, uintptr_t* out) {
	CHECK(); mlx_array r = p_mlx_array_new();
	int rc = p_mlx_slice_update(&r, A(src), A(upd), start, (size_t)n, stop, (size_t)n, strides, (size_t)n, stream); FINISH(r, rc, out)
}

static int mlxs_zeros(const int* shape, int n, int dt, uintptr_t* out) {
	CHECK(); mlx_array r = p_mlx_array_new();
	int rc = p_mlx_zeros(&r, shape, (size_t)n, to_dtype(dt), stream); FINISH(r, rc, out)
}

static int mlxs_softmax(uintptr_t a, int axis, uintptr_t* out) {
	CHECK(); mlx_array r = p_mlx_array_new();
	int rc = p_mlx_softmax_axis(&r, A(a), axis, true, stream); FINISH(r, rc, out)
}

static int mlxs_rms_norm(uintptr_t x, uintptr_t w, float eps, uintptr_t* out) {
	CHECK(); mlx_array r = p_mlx_array_new();
	int rc = p_mlx_fast_rms_norm(&r, A(x), A(w), eps, stream); FINISH(r, rc, out)
}

static mlx_optional_int opt(int v) { mlx_optional_int o = {v, true}; return o; }

static int mlxs_quantize(uintptr_t w, int group, int bits, uintptr_t* wq, uintptr_t* scales, uintptr_t* biases) {
	CHECK();
	mlx_vector_array v = p_mlx_vector_array_new();
	int rc = p_mlx_quantize(&v, A(w), opt(group), opt(bits), "affine", A(0), stream);
	if (rc == 0 && p_mlx_vector_array_size(v) != 3) { set_error("mlx_quantize did not return 3 arrays"); rc = 1; }
	uintptr_t* outs[3] = {wq, scales, biases};
	for (int i = 0; rc == 0 && i < 3; i++) {
		mlx_array r = p_mlx_array_new();
		rc = p_mlx_vector_array_get(&r, v, (size_t)i);
		*outs[i] = (uintptr_t)r.ctx;
	}
	p_mlx_vector_array_free(v);
	return rc;
}

static int mlxs_dequantize(uintptr_t wq, uintptr_t s, uintptr_t b, int group, int bits, uintptr_t* out) {
	CHECK(); mlx_array r = p_mlx_array_new();
	mlx_optional_dtype none = {MLX_FLOAT32, false};
	int rc = p_mlx_dequantize(&r, A(wq), A(s), A(b), opt(group), opt(bits), "affine", A(0), none, stream);
	FINISH(r, rc, out)
}

static int mlxs_quantized_matmul(uintptr_t x, uintptr_t wq, uintptr_t s, uintptr_t b, int group, int bits, uintptr_t* out) {
	CHECK(); mlx_array r = p_mlx_array_new();
	int rc = p_mlx_quantized_matmul(&r, A(x), A(wq), A(s), A(b), true, opt(group), opt(bits), "affine", stream);
	FINISH(r, rc, out)
}
*/
import "C"

import (
	"errors"
	"fmt"
	"os"
	"runtime"
	"strings"
	"sync"
	"unsafe"

	"github.com/meshnode/meshnode/mlxstage/ops"
)

const built = true

// The MLX thread: mlx-c's streams and Metal queues belong to the thread
// that uses them, and goroutines move between threads, so every call runs
// on one goroutine locked to one OS thread, shared by all backends of the
// process (there is one library and one GPU stream).
var (
	startOnce sync.Once
	startErr  error
	calls     chan func()
)

// libraryPaths are tried in order to dlopen libmlxc.
func libraryPaths() []string {
	var paths []string
	if p := os.Getenv("MLXC_LIBRARY"); p != "" {
		paths = append(paths, p)
	}
	return append(paths,
		"libmlxc.dylib", // DYLD_LIBRARY_PATH and the default search
		"/opt/homebrew/opt/mlx-c/lib/libmlxc.dylib",
		"/opt/homebrew/lib/libmlxc.dylib",
		"/usr/local/lib/libmlxc.dylib",
	)
}

func start() error {
	startOnce.Do(func() {
		calls = make(chan func())
		ready := make(chan error)
		go func() {
			runtime.LockOSThread() // for the life of the process
			var tried []string
			for _, p := range libraryPaths() {
				cp := C.CString(p)
				msg := C.mlxs_open(cp)
				C.free(unsafe.Pointer(cp))
				if msg == nil {
					ready <- nil
					for f := range calls {
						f()
					}
					return
				}
				tried = append(tried, p+": "+C.GoString(msg))
			}
			ready <- fmt.Errorf("%w (install it with `brew install mlx-c`, or set MLXC_LIBRARY to its path): tried %s", ErrLibrary, strings.Join(tried, "; "))
		}()
		startErr = <-ready
	})
	return startErr
}

// run calls f on the MLX thread; a panic in f is raised again here. Called
// from the MLX thread itself (a nested Run) it calls f directly: only the
// worker goroutine runs on that locked thread.
func run(f func()) {
	if C.mlxs_on_thread() != 0 {
		f()
		return
	}
	var p any
	done := make(chan struct{})
	calls <- func() {
		defer close(done)
		defer func() { p = recover() }()
		f()
	}
	<-done
	if p != nil {
		panic(p)
	}
}

// New loads libmlxc (once per process) and returns a backend on the GPU.
func New() (ops.Backend, error) {
	if err := start(); err != nil {
		return nil, err
	}
	return newBackend(capi{}, "mlx", "Metal", run, nil), nil
}

// capi implements api on mlx-c. Its methods must run on the MLX thread
// (inside Backend.Run); the C side checks and fails otherwise.
type capi struct{}

func lastError() error { return errors.New(C.GoString(C.mlxs_error())) }

func cints(v []int) []C.int {
	out := make([]C.int, len(v))
	for i, x := range v {
		out[i] = C.int(x)
	}
	return out
}

func ptr(v []C.int) *C.int {
	if len(v) == 0 {
		return nil
	}
	return &v[0]
}

func result(rc C.int, out C.uintptr_t) (arr, error) {
	if rc != 0 {
		return 0, lastError()
	}
	return arr(out), nil
}

func (capi) fromData(data []byte, shape []int, dt dtype) (arr, error) {
	s := cints(shape)
	var out C.uintptr_t
	var p unsafe.Pointer
	if len(data) > 0 {
		p = unsafe.Pointer(&data[0])
	}
	// mlx_array_new_data copies the buffer; Go memory is not kept.
	return result(C.mlxs_from_data(p, ptr(s), C.int(len(s)), C.int(dt), &out), out)
}

func (capi) free(a arr) { C.mlxs_free(C.uintptr_t(a)) }

func (capi) shape(a arr) []int {
	n := int(C.mlxs_ndim(C.uintptr_t(a)))
	if n == 0 {
		return []int{}
	}
	dims := unsafe.Slice(C.mlxs_shape(C.uintptr_t(a)), n)
	out := make([]int, n)
	for i, d := range dims {
		out[i] = int(d)
	}
	return out
}

func (capi) dtype(a arr) dtype   { return dtype(C.mlxs_dtype(C.uintptr_t(a))) }
func (capi) nbytes(a arr) uint64 { return uint64(C.mlxs_nbytes(C.uintptr_t(a))) }
func handles(as []arr) []C.uintptr_t {
	out := make([]C.uintptr_t, len(as))
	for i, a := range as {
		out[i] = C.uintptr_t(a)
	}
	return out
}

func (capi) eval(as ...arr) error {
	if len(as) == 0 {
		return nil
	}
	h := handles(as)
	if C.mlxs_eval(&h[0], C.int(len(h))) != 0 {
		return lastError()
	}
	return nil
}

func (c capi) float32s(a arr) ([]float32, error) {
	n := ops.Elements(c.shape(a))
	out := make([]float32, n)
	var p *C.float
	if n > 0 {
		p = (*C.float)(unsafe.Pointer(&out[0]))
	}
	if C.mlxs_float32s(C.uintptr_t(a), p, C.size_t(n)) != 0 {
		return nil, lastError()
	}
	return out, nil
}

func (capi) add(a, b arr) (arr, error) {
	var out C.uintptr_t
	return result(C.mlxs_add(C.uintptr_t(a), C.uintptr_t(b), &out), out)
}

func (capi) subtract(a, b arr) (arr, error) {
	var out C.uintptr_t
	return result(C.mlxs_subtract(C.uintptr_t(a), C.uintptr_t(b), &out), out)
}

func (capi) multiply(a, b arr) (arr, error) {
	var out C.uintptr_t
	return result(C.mlxs_multiply(C.uintptr_t(a), C.uintptr_t(b), &out), out)
}

func (capi) matmul(a, b arr) (arr, error) {
	var out C.uintptr_t
	return result(C.mlxs_matmul(C.uintptr_t(a), C.uintptr_t(b), &out), out)
}

func (capi) sigmoid(a arr) (arr, error) {
	var out C.uintptr_t
	return result(C.mlxs_sigmoid(C.uintptr_t(a), &out), out)
}

func (capi) astype(a arr, dt dtype) (arr, error) {
	var out C.uintptr_t
	return result(C.mlxs_astype(C.uintptr_t(a), C.int(dt), &out), out)
}

func (capi) reshape(a arr, shape []int) (arr, error) {
	s := cints(shape)
	var out C.uintptr_t
	return result(C.mlxs_reshape(C.uintptr_t(a), ptr(s), C.int(len(s)), &out), out)
}

func (capi) transpose(a arr, axes []int) (arr, error) {
	s := cints(axes)
	var out C.uintptr_t
	return result(C.mlxs_transpose(C.uintptr_t(a), ptr(s), C.int(len(s)), &out), out)
}

func (capi) take(a, indices arr, axis int) (arr, error) {
	var out C.uintptr_t
	return result(C.mlxs_take(C.uintptr_t(a), C.uintptr_t(indices), C.int(axis), &out), out)
}

func (capi) concatenate(as []arr, axis int) (arr, error) {
	h := handles(as)
	var out C.uintptr_t
	if len(h) == 0 {
		return 0, errors.New("concatenate of nothing")
	}
	return result(C.mlxs_concatenate(&h[0], C.int(len(h)), C.int(axis), &out), out)
}

func ones(n int) []C.int {
	s := make([]C.int, n)
	for i := range s {
		s[i] = 1
	}
	return s
}

func (capi) slice(a arr, start, stop []int) (arr, error) {
	s, e, st := cints(start), cints(stop), ones(len(start))
	var out C.uintptr_t
	return result(C.mlxs_slice(C.uintptr_t(a), ptr(s), ptr(e), ptr(st), C.int(len(s)), &out), out)
}

func (capi) sliceUpdate(src, update arr, start, stop []int) (arr, error) {
	s, e, st := cints(start), cints(stop), ones(len(start))
	var out C.uintptr_t
	return result(C.mlxs_slice_update(C.uintptr_t(src), C.uintptr_t(update), ptr(s), ptr(e), ptr(st), C.int(len(s)), &out), out)
}

func (capi) zeros(shape []int, dt dtype) (arr, error) {
	s := cints(shape)
	var out C.uintptr_t
	return result(C.mlxs_zeros(ptr(s), C.int(len(s)), C.int(dt), &out), out)
}

func (capi) softmax(a arr, axis int) (arr, error) {
	var out C.uintptr_t
	return result(C.mlxs_softmax(C.uintptr_t(a), C.int(axis), &out), out)
}

func (capi) rmsNorm(x, w arr, eps float32) (arr, error) {
	var out C.uintptr_t
	return result(C.mlxs_rms_norm(C.uintptr_t(x), C.uintptr_t(w), C.float(eps), &out), out)
}

func (capi) quantize(w arr, group, bits int) (arr, arr, arr, error) {
	var wq, s, b C.uintptr_t
	if C.mlxs_quantize(C.uintptr_t(w), C.int(group), C.int(bits), &wq, &s, &b) != 0 {
		for _, h := range []C.uintptr_t{wq, s, b} {
			C.mlxs_free(h)
		}
		return 0, 0, 0, lastError()
	}
	return arr(wq), arr(s), arr(b), nil
}

func (capi) dequantize(wq, scales, biases arr, group, bits int) (arr, error) {
	var out C.uintptr_t
	return result(C.mlxs_dequantize(C.uintptr_t(wq), C.uintptr_t(scales), C.uintptr_t(biases), C.int(group), C.int(bits), &out), out)
}

func (capi) quantizedMatmul(x, wq, scales, biases arr, group, bits int) (arr, error) {
	var out C.uintptr_t
	return result(C.mlxs_quantized_matmul(C.uintptr_t(x), C.uintptr_t(wq), C.uintptr_t(scales), C.uintptr_t(biases), C.int(group), C.int(bits), &out), out)
}
