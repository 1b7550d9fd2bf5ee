//go:build repack && cgo

package ggufstage

// The fast CPU path: quantized matmul weights are moved into ggml's
// CPU_REPACK buffer type, whose set_tensor interleaves rows so that the
// AVX2/NEON kernels read them in one stream. ollama never asks for this
// buffer type; upstream llama.cpp does, and it is worth ~2x on Q4_0.
// Building it needs ggml's headers (CGO_CPPFLAGS from the Makefile) and
// ggml-cpu compiled with -DGGML_USE_CPU_REPACK.

/*
#include <stdlib.h>
#include <string.h>
#include "ggml.h"
#include "ggml-backend.h"
#include "ggml-backend-impl.h"
#include "ggml-cpu.h"
#include "x16.h"
#include "attn.h"
#include "hugepage.h"

static ggml_backend_buffer_type_t meshnode_repack_buft(void) {
	ggml_backend_dev_t dev = ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU);
	if (dev == NULL) return NULL;
	ggml_backend_reg_t reg = ggml_backend_dev_backend_reg(dev);
	ggml_backend_dev_get_extra_bufts_t get =
		(ggml_backend_dev_get_extra_bufts_t) ggml_backend_reg_get_proc_address(reg, "ggml_backend_dev_get_extra_bufts");
	if (get == NULL) return NULL;
	for (ggml_backend_buffer_type_t * b = get(dev); b != NULL && *b != NULL; b++) {
		if (strcmp(ggml_backend_buft_name(*b), "CPU_REPACK") == 0) return *b;
	}
	return NULL;
}

// meshnode_allow_alloc undoes what a scheduler made with alloc_buffers
// false (a dry-run load) leaves behind: ollama's ggml marks the buffer
// types it used, process-wide, as not allocating, and every later buffer of
// those types (another engine's compute buffers, a repacked weight) would
// get no memory until a real load cleared the mark.
static void meshnode_allow_alloc(void) {
	ggml_backend_cpu_buffer_type()->no_alloc = false;
	for (size_t i = 0; i < ggml_backend_dev_count(); i++) {
		ggml_backend_dev_t dev = ggml_backend_dev_get(i);
		ggml_backend_buffer_type_t b = ggml_backend_dev_buffer_type(dev);
		if (b != NULL) b->no_alloc = false;
		b = ggml_backend_dev_host_buffer_type(dev);
		if (b != NULL) b->no_alloc = false;
	}
}

// meshnode_host_matrix: a 2-D weight in host memory. Only those are
// re-homed; a GPU tensor stays on its GPU.
static int meshnode_host_matrix(const struct ggml_tensor * t) {
	return ggml_n_dims(t) == 2 && t->buffer != NULL && ggml_backend_buffer_is_host(t->buffer);
}

// meshnode_repack_ok mirrors the conditions under which ggml's repack code
// has a kernel for the tensor; set_tensor aborts on any other tensor.
static int meshnode_repack_ok(const struct ggml_tensor * t) {
	switch (t->type) {
	case GGML_TYPE_Q4_0:
		if (ggml_cpu_has_avx2()) return t->ne[1] % 8 == 0;
		if (ggml_cpu_has_neon() && (ggml_cpu_has_matmul_int8() || ggml_cpu_has_dotprod())) return t->ne[1] % 4 == 0;
		return 0;
	case GGML_TYPE_Q4_K:
		if (ggml_cpu_has_avx2()) return t->ne[1] % 8 == 0;
		if (ggml_cpu_has_neon() && (ggml_cpu_has_matmul_int8() || ggml_cpu_has_dotprod())) return t->ne[1] % 8 == 0;
		return 0;
	case GGML_TYPE_IQ4_NL:
		if (ggml_cpu_has_avx2()) return t->ne[1] % 8 == 0;
		if (ggml_cpu_has_neon() && ggml_cpu_has_dotprod()) return t->ne[1] % 4 == 0;
		return 0;
	default:
		return 0;
	}
}

// meshnode_repack_cpu reports whether this CPU has any of the kernels
// meshnode_repack_ok asks for.
static int meshnode_repack_cpu(void) {
	return ggml_cpu_has_avx2() || (ggml_cpu_has_neon() && (ggml_cpu_has_matmul_int8() || ggml_cpu_has_dotprod()));
}

// meshnode_repack re-homes t into a new repack buffer filled from data. The
// tensor's old storage (in ollama's weight buffer) is never written, so its
// pages are never made resident.
static ggml_backend_buffer_t meshnode_repack(ggml_backend_buffer_type_t buft, struct ggml_tensor * t, const void * data) {
	size_t size = ggml_backend_buft_get_alloc_size(buft, t);
	ggml_backend_buffer_t buf = ggml_backend_buft_alloc_buffer(buft, size);
	if (buf == NULL) return NULL;
	ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
	t->buffer = NULL;
	t->data = NULL;
	if (ggml_backend_tensor_alloc(buf, t, ggml_backend_buffer_get_base(buf)) != GGML_STATUS_SUCCESS) {
		ggml_backend_buffer_free(buf);
		return NULL;
	}
	meshnode_advise_huge(t->data, size);
	ggml_backend_tensor_set(t, data, 0, ggml_nbytes(t));
	return buf;
}

// meshnode_advise_plain: huge pages for a weight about to be written in
// place, where it is in host memory.
static void meshnode_advise_plain(struct ggml_tensor * t) {
	if (t->buffer != NULL && ggml_backend_buffer_is_host(t->buffer) && t->data != NULL) {
		meshnode_advise_huge(t->data, ggml_nbytes(t));
	}
}
*/
import "C"

import (
	"strings"
	"unsafe"

	"github.com/ollama/ollama/ml"
)

// RepackAvailable reports whether this build can repack weights.
const RepackAvailable = true

// useX16 selects meshnode's own Q4_0/Q8_0/Q4_K/Q6_K kernels
// (x16_amd64.cpp) where the CPU has AVX512-VNNI, over ggml's repacked
// Q4_0/Q4_K kernels and plain Q8_0/Q6_K; tests turn it off to compare.
var useX16 = true

// x16On: the kernel is registered with ggml's CPU backend. That list is read
// by every graph compute, so it is extended here, before any engine exists.
var x16On = C.meshnode_x16_register() != 0

// x16CPUHas reports whether the CPU has the kernel's instructions (whether
// or not registration worked).
func x16CPUHas() bool { return C.meshnode_x16_cpu() != 0 }

type repacker struct {
	buft C.ggml_backend_buffer_type_t
	bufs []C.ggml_backend_buffer_t
	own  int // of bufs, those in meshnode's X16 layout
}

func newRepacker() *repacker {
	buft := C.meshnode_repack_buft()
	if buft == nil {
		return nil // ggml-cpu was built without GGML_USE_CPU_REPACK
	}
	return &repacker{buft: buft}
}

// cTensor digs the ggml tensor out of ollama's ml.Tensor. The field is
// unexported; its layout is fixed by the exact ollama version pinned in
// go.mod, and TestRepackedMatchesPlain fails if this ever goes wrong.
func cTensor(t ml.Tensor) *C.struct_ggml_tensor {
	return (*C.struct_ggml_tensor)(pointerField(t, "t"))
}

// take re-homes target from data into a layout with a faster CPU kernel,
// meshnode's X16 or ggml's repacked one, and reports whether it did. The
// token embedding is read by row lookups, not matmuls, so it always stays
// plain.
func (r *repacker) take(target ml.Tensor, data []byte) bool {
	if r == nil || len(data) == 0 {
		return false
	}
	ct := cTensor(target)
	if ct == nil || C.meshnode_host_matrix(ct) == 0 {
		return false
	}
	if strings.HasPrefix(C.GoString(C.ggml_get_name(ct)), "token_embd") {
		return false
	}
	if uint64(C.ggml_nbytes(ct)) != uint64(len(data)) {
		return false
	}
	if useX16 && C.meshnode_x16_ok(ct) != 0 {
		if buf := C.meshnode_x16_take(ct, unsafe.Pointer(&data[0])); buf != nil {
			r.bufs = append(r.bufs, buf)
			r.own++
			return true
		}
	}
	if C.meshnode_repack_ok(ct) == 0 {
		return false
	}
	buf := C.meshnode_repack(r.buft, ct, unsafe.Pointer(&data[0]))
	if buf == nil {
		return false
	}
	r.bufs = append(r.bufs, buf)
	return true
}

// advise asks for huge pages under a weight that stays in ollama's own
// buffer, before it is written (see hugepage.c).
func advise(target ml.Tensor) {
	if ct := cTensor(target); ct != nil {
		C.meshnode_advise_plain(ct)
	}
}

// adviseHuge is meshnode_advise_huge, for tests.
func adviseHuge(p unsafe.Pointer, n int) { C.meshnode_advise_huge(p, C.size_t(n)) }

// count is the number of tensors repacked so far (tests check that
// repacking really happens).
func (r *repacker) count() int {
	if r == nil {
		return 0
	}
	return len(r.bufs)
}

// repackCPU reports whether the CPU has repacked kernels at all.
func repackCPU() bool { return C.meshnode_repack_cpu() != 0 }

// Close frees the repacked buffers; call it after the backend is closed.
func (r *repacker) Close() error {
	if r == nil {
		return nil
	}
	for _, b := range r.bufs {
		C.ggml_backend_buffer_free(b)
	}
	r.bufs = nil
	return nil
}

// x16Check runs the X16 self-test: max|X16 − plain| / max|plain| for a
// random [k,n] weight of type typ times a [k,m] activation, or -1 where the
// kernel cannot run.
func x16Check(typ uint32, k, n, m, threads int, seed uint32) float64 {
	return float64(C.meshnode_x16_check(C.int(typ), C.int(k), C.int(n), C.int(m), C.int(threads), C.uint(seed), 0, nil))
}

// x16Time times iters matmuls of a random [k,n] weight of type typ by a
// [k,m] activation, in X16 and in ggml's plain layout: seconds per matmul
// of each; -1s where the kernel cannot run.
func x16Time(typ uint32, k, n, m, threads, iters int) (x16, ggml float64) {
	var secs [2]C.double
	if C.meshnode_x16_check(C.int(typ), C.int(k), C.int(n), C.int(m), C.int(threads), 1, C.int(iters), &secs[0]) < 0 {
		return -1, -1
	}
	return float64(secs[0]), float64(secs[1])
}

// x16CPU reports whether this CPU runs the X16 kernel.
func x16CPU() bool { return x16On }

// cpuAttention reports whether meshnode's CPU attention kernel
// (attn_amd64.cpp) computes flash attention here: it is hooked in with the
// X16 kernel, on the CPUs that run X16.
func cpuAttention() bool { return x16On }

// attnCheck runs the attention self-test: max|kernel − exact| / max|exact|
// on a random attention; ggml: ggml's own kernel instead. -1 where the
// kernel cannot run.
func attnCheck(dk, nq, heads, kvHeads, nkv, threads int, seed uint32, ggml bool) float64 {
	return float64(C.meshnode_attn_check(C.int(dk), C.int(nq), C.int(heads), C.int(kvHeads), C.int(nkv), C.int(threads), C.uint(seed), cBool(ggml)))
}

// attnMoved counts the outputs that change in any bit when a query's n
// cells move to other places in a larger cache, in the same order or
// shuffled; ggml: for ggml's own kernel. -1 where the kernel cannot run.
func attnMoved(dk, heads, kvHeads, n int, seed uint32, ggml, shuffle bool) int {
	return int(C.meshnode_attn_moved(C.int(dk), C.int(heads), C.int(kvHeads), C.int(n), C.uint(seed), cBool(ggml), cBool(shuffle)))
}

func cBool(b bool) C.int {
	if b {
		return 1
	}
	return 0
}

// allowAlloc clears the no-allocation mark a dry-run load leaves on ggml's
// buffer types (see meshnode_allow_alloc). The caller holds backendMu.
func allowAlloc() { C.meshnode_allow_alloc() }

// setAttnKernel turns meshnode's CPU attention kernel on or off (ggml's own
// then runs); tests compare the two.
func setAttnKernel(on bool) { C.meshnode_attn_enable(cBool(on)) }
