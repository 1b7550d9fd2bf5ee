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
#include "ggml.h"
#include "ggml-backend.h"

static int meshnode_sched_alloc(void * sched, void * graph) {
	ggml_backend_sched_reset((ggml_backend_sched_t) sched);
	return ggml_backend_sched_alloc_graph((ggml_backend_sched_t) sched, (struct ggml_cgraph *) graph) ? 1 : 0;
}

// meshnode_sched_launch queues the graph; the scheduler splits and
// allocates it first unless meshnode_sched_alloc already did. The reset
// after leaves the scheduler free for the next graph's allocation while
// this one computes, as ollama's Compute does.
static int meshnode_sched_launch(void * sched, void * graph) {
	enum ggml_status st = ggml_backend_sched_graph_compute_async((ggml_backend_sched_t) sched, (struct ggml_cgraph *) graph);
	ggml_backend_sched_reset((ggml_backend_sched_t) sched);
	return (int) st;
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

// schedGraph is ggml's scheduler and a pass's graph, dug out of the ollama
// context the pass was built in.
type schedGraph struct {
	sched, graph unsafe.Pointer
}

// schedGraphOf returns the scheduler and graph behind gctx, once the graph
// exists (after gctx.Forward); ok is false if the fields are not there.
func schedGraphOf(gctx ml.Context) (g schedGraph, ok bool) {
	v := reflect.ValueOf(gctx)
	if v.Kind() != reflect.Pointer || v.Elem().Kind() != reflect.Struct {
		return g, false
	}
	graph := v.Elem().FieldByName("graph")
	b := v.Elem().FieldByName("b")
	if !graph.IsValid() || graph.Kind() != reflect.Pointer || graph.IsNil() || !b.IsValid() || b.Kind() != reflect.Pointer || b.IsNil() {
		return g, false
	}
	sched := b.Elem().FieldByName("sched")
	if !sched.IsValid() || sched.Kind() != reflect.Pointer || sched.IsNil() {
		return g, false
	}
	return schedGraph{sched: sched.UnsafePointer(), graph: graph.UnsafePointer()}, true
}

// alloc splits the graph over the backends and places its tensors in the
// scheduler's compute buffers, dropping whatever allocation it had.
func (g schedGraph) alloc() error {
	if C.meshnode_sched_alloc(g.sched, g.graph) == 0 {
		return fmt.Errorf("ggml scheduler: allocating the graph failed (out of memory?)")
	}
	return nil
}

// launch queues the graph on its backends.
func (g schedGraph) launch() error {
	if st := C.meshnode_sched_launch(g.sched, g.graph); st != C.GGML_STATUS_SUCCESS {
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
