//go:build repack && cgo

package ggufstage

// A pass's graph is run through ggml's scheduler directly rather than
// ollama's Context.Compute and Tensor.Floats, for two reasons:
//   - Splitting and allocating a graph is fixed host work per pass, and
//     ollama does it inside Compute, on the path from a pass's input to
//     its launch. Done here, it can run ahead, for a pass built ahead,
//     while the stage waits for its next input (see allocAhead).
//   - Floats allocates a fresh slice for every read; logits of 32 rows of
//     a 128K vocabulary are 16 MB a pass. Reading into the engine's own
//     buffers costs only the copy.
// The scheduler and graph live in unexported fields of ollama's context,
// whose layout is fixed by the exact ollama version pinned in go.mod; the
// split-equivalence and engine tests fail if reading them ever goes wrong.

/*
#include <stdlib.h>
#include "ggml.h"
#include "ggml-backend.h"

static int meshnode_sched_alloc(void * sched, void * graph, int batch) {
	ggml_backend_sched_reset((ggml_backend_sched_t) sched);
	ggml_backend_sched_set_batch_size((ggml_backend_sched_t) sched, batch);
	return ggml_backend_sched_alloc_graph((ggml_backend_sched_t) sched, (struct ggml_cgraph *) graph) ? 1 : 0;
}

// meshnode_sched_launch queues the graph; the scheduler splits and
// allocates it first unless meshnode_sched_alloc already did. The reset
// after leaves the scheduler free for the next graph's allocation while
// this one computes, as ollama's Compute does.
static int meshnode_sched_launch(void * sched, void * graph, int batch) {
	ggml_backend_sched_set_batch_size((ggml_backend_sched_t) sched, batch);
	enum ggml_status st = ggml_backend_sched_graph_compute_async((ggml_backend_sched_t) sched, (struct ggml_cgraph *) graph);
	ggml_backend_sched_reset((ggml_backend_sched_t) sched);
	return (int) st;
}

// meshnode_sched_clone makes a scheduler over the same devices as
// backends, with a new backend instance (its own stream and CUDA graph)
// for each device but the CPU, whose instance is shared. owned[i] gets
// the instances it made, for meshnode_sched_free_clone.
static void * meshnode_sched_clone(void ** backends, void ** bufts, int n, size_t graph_size, void ** owned) {
	ggml_backend_t bs[16];
	if (n > 16) return NULL;
	for (int i = 0; i < n; i++) {
		ggml_backend_t b = (ggml_backend_t) backends[i];
		ggml_backend_dev_t dev = ggml_backend_get_device(b);
		owned[i] = NULL;
		if (dev != NULL && ggml_backend_dev_type(dev) != GGML_BACKEND_DEVICE_TYPE_CPU) {
			ggml_backend_t nb = ggml_backend_dev_init(dev, NULL);
			if (nb == NULL) {
				for (int j = 0; j < i; j++) if (owned[j] != NULL) ggml_backend_free((ggml_backend_t) owned[j]);
				return NULL;
			}
			owned[i] = nb;
			b = nb;
		}
		bs[i] = b;
	}
	ggml_backend_sched_t s = ggml_backend_sched_new_ext(bs, (ggml_backend_buffer_type_t *) bufts, n, graph_size, false, true, true);
	if (s == NULL) {
		for (int i = 0; i < n; i++) if (owned[i] != NULL) ggml_backend_free((ggml_backend_t) owned[i]);
	}
	return s;
}

static void meshnode_sched_free_clone(void * sched, void ** owned, int n) {
	ggml_backend_sched_free((ggml_backend_sched_t) sched);
	for (int i = 0; i < n; i++) if (owned[i] != NULL) ggml_backend_free((ggml_backend_t) owned[i]);
}

static void meshnode_sched_reset(void * sched) {
	ggml_backend_sched_reset((ggml_backend_sched_t) sched);
}

// meshnode_sched_read waits for the graph and copies n bytes of t out
// (none when dst is NULL).
static int meshnode_sched_read(void * sched, void * t, void * dst, size_t n) {
	ggml_backend_sched_synchronize((ggml_backend_sched_t) sched);
	if (dst == NULL) return 1;
	if (ggml_nbytes((struct ggml_tensor *) t) != n) return 0;
	ggml_backend_tensor_get((struct ggml_tensor *) t, dst, 0, n);
	return 1;
}
*/
import "C"

import (
	"fmt"
	"reflect"
	"unsafe"

	"github.com/ollama/ollama/ml"
)

// directSched: this build runs graphs through ggml's scheduler itself.
const directSched = true

// schedGraph is a pass's graph, dug out of the ollama context it was built
// in, and the scheduler (a lane's) that runs it.
type schedGraph struct {
	sched, graph unsafe.Pointer
	// batch is the batch size hinted to ggml: 1 lets the CUDA backend
	// replay a graph for a pass of several rows, -1 leaves it to ggml.
	batch int
}

// graphOf returns the ggml graph behind gctx, once it exists (after
// gctx.Forward), or nil if the field is not there.
func graphOf(gctx ml.Context) unsafe.Pointer { return pointerField(gctx, "graph") }

// schedOf returns the scheduler ollama made for backend.
func schedOf(backend ml.Backend) unsafe.Pointer { return pointerField(backend, "sched") }

// pointerField returns the pointer in the unexported field name of the
// struct x points to, or nil when x is no such pointer, the field is not
// there or not a pointer, or it is nil. The fields' layout is fixed by the
// exact ollama version pinned in go.mod.
func pointerField(x any, name string) unsafe.Pointer {
	v := reflect.ValueOf(x)
	if v.Kind() != reflect.Pointer || v.Elem().Kind() != reflect.Struct {
		return nil
	}
	f := v.Elem().FieldByName(name)
	if !f.IsValid() || f.Kind() != reflect.Pointer || f.IsNil() {
		return nil
	}
	return f.UnsafePointer()
}

// A schedClone is a scheduler of its own over the devices of an ollama
// backend, sharing its weights (see meshnode_sched_clone).
type schedClone struct {
	sched unsafe.Pointer
	owned []unsafe.Pointer
}

// cloneSched makes a schedClone of backend's scheduler.
func cloneSched(backend ml.Backend) (*schedClone, error) {
	v := reflect.ValueOf(backend)
	if v.Kind() != reflect.Pointer || v.Elem().Kind() != reflect.Struct {
		return nil, fmt.Errorf("ggml scheduler: not an ollama ggml backend")
	}
	bs, bts, nodes := v.Elem().FieldByName("schedBackends"), v.Elem().FieldByName("schedBufts"), v.Elem().FieldByName("maxGraphNodes")
	if !bs.IsValid() || bs.Kind() != reflect.Slice || !bts.IsValid() || bts.Kind() != reflect.Slice || bs.Len() != bts.Len() || bs.Len() == 0 ||
		!nodes.IsValid() || nodes.Kind() != reflect.Int {
		return nil, fmt.Errorf("ggml scheduler: the backend's scheduler fields are not there")
	}
	n := bs.Len()
	// The arrays go to C, so they live in C memory: backends, buffer
	// types, then the backend instances the clone makes.
	cb := cPointers(3 * n)
	defer C.free(unsafe.Pointer(&cb[0]))
	for i := range n {
		cb[i], cb[n+i] = bs.Index(i).UnsafePointer(), bts.Index(i).UnsafePointer()
	}
	s := C.meshnode_sched_clone(&cb[0], &cb[n], C.int(n), C.size_t(nodes.Int()), &cb[2*n])
	if s == nil {
		return nil, fmt.Errorf("ggml scheduler: making a second scheduler failed")
	}
	return &schedClone{sched: s, owned: append([]unsafe.Pointer(nil), cb[2*n:]...)}, nil
}

// free frees the scheduler and the backend instances made for it.
func (c *schedClone) free() {
	if c == nil || c.sched == nil {
		return
	}
	owned := cPointers(len(c.owned))
	copy(owned, c.owned)
	C.meshnode_sched_free_clone(c.sched, &owned[0], C.int(len(c.owned)))
	C.free(unsafe.Pointer(&owned[0]))
	c.sched = nil
}

// cPointers returns an array of n pointers (at least one) in C memory,
// for the caller to free.
func cPointers(n int) []unsafe.Pointer {
	n = max(n, 1)
	return unsafe.Slice((*unsafe.Pointer)(C.calloc(C.size_t(n), C.size_t(unsafe.Sizeof(uintptr(0))))), n)
}

// alloc splits the graph over the backends and places its tensors in the
// scheduler's compute buffers, dropping whatever allocation it had.
func (g schedGraph) alloc() error {
	if C.meshnode_sched_alloc(g.sched, g.graph, C.int(g.batch)) == 0 {
		return fmt.Errorf("ggml scheduler: allocating the graph failed (out of memory?)")
	}
	return nil
}

// launch queues the graph on its backends.
func (g schedGraph) launch() error {
	if st := C.meshnode_sched_launch(g.sched, g.graph, C.int(g.batch)); st != C.GGML_STATUS_SUCCESS {
		return fmt.Errorf("ggml scheduler: computing the graph failed (status %d)", int(st))
	}
	return nil
}

// reset drops the scheduler's allocation.
func (g schedGraph) reset() { C.meshnode_sched_reset(g.sched) }

// read waits for the graph and copies t, len(dst) floats, into dst; with
// no dst it only waits.
func (g schedGraph) read(t ml.Tensor, dst []float32) error {
	ct := cTensor(t)
	if ct == nil {
		return fmt.Errorf("ggml scheduler: no ggml tensor behind the graph's output")
	}
	var p unsafe.Pointer
	if len(dst) > 0 {
		p = unsafe.Pointer(&dst[0])
	}
	if C.meshnode_sched_read(g.sched, unsafe.Pointer(ct), p, C.size_t(4*len(dst))) == 0 {
		return fmt.Errorf("ggml scheduler: the graph's output is not %d floats", len(dst))
	}
	return nil
}
