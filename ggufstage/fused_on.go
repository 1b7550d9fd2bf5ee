//go:build repack && cgo

package ggufstage

/*
#cgo LDFLAGS: -ldl
#include <dlfcn.h>
#include <stdio.h>
#include <stdlib.h>
#include "ggml.h"
#include "ggml-backend.h"
#include "cuda/fused.h"

typedef int (*meshnode_mf_create_fn)(const mf_config *, mf_engine **, char *, int);
typedef int (*meshnode_mf_step_rows_picks_fn)(mf_engine *, int, const int *, const float *, const int *, const int *, const int32_t *, const int *, float *, int, int *, char *, int);
typedef int (*meshnode_mf_max_rows_fn)(const mf_engine *);
typedef void (*meshnode_mf_destroy_fn)(mf_engine *);
typedef float *(*meshnode_mf_host_alloc_fn)(size_t);
typedef void (*meshnode_mf_host_free_fn)(float *);
typedef void *(*meshnode_mf_device_copy_fn)(const void *, const void *, size_t, char *, int);
typedef void (*meshnode_mf_device_free_fn)(void *);
typedef int (*meshnode_mf_queue_picks_fn)(mf_engine *, int, const int *, const int *, const int *, const int32_t *, const int *, char *, int);
typedef int (*meshnode_mf_wait_picks_fn)(mf_engine *, int *, char *, int);
static meshnode_mf_create_fn meshnode_mf_create;
static meshnode_mf_step_rows_picks_fn meshnode_mf_step_rows_picks;
static meshnode_mf_max_rows_fn meshnode_mf_max_rows;
static meshnode_mf_destroy_fn meshnode_mf_destroy;
static meshnode_mf_host_alloc_fn meshnode_mf_host_alloc;
static meshnode_mf_host_free_fn meshnode_mf_host_free;
static meshnode_mf_device_copy_fn meshnode_mf_device_copy; // NULL in a library built before it
static meshnode_mf_device_free_fn meshnode_mf_device_free;
static meshnode_mf_queue_picks_fn meshnode_mf_queue_picks; // NULL in a library built before them
static meshnode_mf_wait_picks_fn meshnode_mf_wait_picks;
typedef int (*meshnode_mf_launch_rows_fn)(mf_engine *, int, const int *, const float *, const float *, void *, const int *, const int *, const int32_t *, const int *, float *, void *, char *, int);
typedef int (*meshnode_mf_finish_rows_fn)(mf_engine *, int *, float *, char *, int);
typedef int (*meshnode_mf_handoff_export_fn)(const void *, size_t, float **, void **, void *, void *, char *, char *, int);
typedef int (*meshnode_mf_handoff_import_fn)(const void *, const void *, const void *, const char *, float **, void **, char *, int);
typedef void (*meshnode_mf_handoff_close_fn)(const void *, float *, void *, int);
typedef int (*meshnode_mf_event_wait_fn)(void *, int, char *, int);
typedef int (*meshnode_mf_handoff_read_fn)(const void *, const float *, void *, size_t, float *, int, char *, int);
// NULL in a library built before hand-offs between processes.
static meshnode_mf_launch_rows_fn meshnode_mf_launch_rows;
static meshnode_mf_finish_rows_fn meshnode_mf_finish_rows;
static meshnode_mf_handoff_export_fn meshnode_mf_handoff_export;
static meshnode_mf_handoff_import_fn meshnode_mf_handoff_import;
static meshnode_mf_handoff_close_fn meshnode_mf_handoff_close;
static meshnode_mf_event_wait_fn meshnode_mf_event_wait;
static meshnode_mf_handoff_read_fn meshnode_mf_handoff_read;

// meshnode_mf_load opens the fused-path library: NULL, or why not.
static const char *meshnode_mf_load(const char *path) {
	void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
	if (!h) return dlerror();
	meshnode_mf_create = (meshnode_mf_create_fn) dlsym(h, "mf_create");
	meshnode_mf_step_rows_picks = (meshnode_mf_step_rows_picks_fn) dlsym(h, "mf_step_rows_picks");
	meshnode_mf_max_rows = (meshnode_mf_max_rows_fn) dlsym(h, "mf_max_rows");
	meshnode_mf_destroy = (meshnode_mf_destroy_fn) dlsym(h, "mf_destroy");
	meshnode_mf_host_alloc = (meshnode_mf_host_alloc_fn) dlsym(h, "mf_host_alloc");
	meshnode_mf_host_free = (meshnode_mf_host_free_fn) dlsym(h, "mf_host_free");
	meshnode_mf_device_copy = (meshnode_mf_device_copy_fn) dlsym(h, "mf_device_copy");
	meshnode_mf_device_free = (meshnode_mf_device_free_fn) dlsym(h, "mf_device_free");
	meshnode_mf_queue_picks = (meshnode_mf_queue_picks_fn) dlsym(h, "mf_queue_picks");
	meshnode_mf_wait_picks = (meshnode_mf_wait_picks_fn) dlsym(h, "mf_wait_picks");
	meshnode_mf_launch_rows = (meshnode_mf_launch_rows_fn) dlsym(h, "mf_launch_rows");
	meshnode_mf_finish_rows = (meshnode_mf_finish_rows_fn) dlsym(h, "mf_finish_rows");
	meshnode_mf_handoff_export = (meshnode_mf_handoff_export_fn) dlsym(h, "mf_handoff_export");
	meshnode_mf_handoff_import = (meshnode_mf_handoff_import_fn) dlsym(h, "mf_handoff_import");
	meshnode_mf_handoff_close = (meshnode_mf_handoff_close_fn) dlsym(h, "mf_handoff_close");
	meshnode_mf_event_wait = (meshnode_mf_event_wait_fn) dlsym(h, "mf_event_wait");
	meshnode_mf_handoff_read = (meshnode_mf_handoff_read_fn) dlsym(h, "mf_handoff_read");
	if (!meshnode_mf_create || !meshnode_mf_step_rows_picks || !meshnode_mf_max_rows || !meshnode_mf_destroy || !meshnode_mf_host_alloc || !meshnode_mf_host_free)
		return "the library lacks mf_create, mf_step_rows_picks, mf_max_rows, mf_destroy, mf_host_alloc or mf_host_free (built before meshnode's greedy picks?): rebuild it with deploy/gpu/build-cuda.sh";
	return NULL;
}

static int meshnode_mf_create_call(const mf_config *c, mf_engine **e, char *err, int n) { return meshnode_mf_create(c, e, err, n); }
static int meshnode_mf_step_rows_call(mf_engine *e, int rows, const int *tokens, const float *hidden, const int *pos, const int *loc, const int32_t *cells, const int *ncells, float *out, int pinned, int *picks, char *err, int errlen) {
	return meshnode_mf_step_rows_picks(e, rows, tokens, hidden, pos, loc, cells, ncells, out, pinned, picks, err, errlen);
}
static int meshnode_mf_can_queue(void) { return meshnode_mf_queue_picks && meshnode_mf_wait_picks; }
static int meshnode_mf_queue_picks_call(mf_engine *e, int rows, const int *tokens, const int *pos, const int *loc, const int32_t *cells, const int *ncells, char *err, int errlen) {
	return meshnode_mf_queue_picks(e, rows, tokens, pos, loc, cells, ncells, err, errlen);
}
static int meshnode_mf_wait_picks_call(mf_engine *e, int *picks, char *err, int errlen) { return meshnode_mf_wait_picks(e, picks, err, errlen); }
static int meshnode_mf_max_rows_call(mf_engine *e) { return meshnode_mf_max_rows(e); }
static int meshnode_mf_can_handoff(void) {
	return meshnode_mf_launch_rows && meshnode_mf_finish_rows && meshnode_mf_handoff_export && meshnode_mf_handoff_import &&
	       meshnode_mf_handoff_close && meshnode_mf_event_wait && meshnode_mf_handoff_read;
}
static int meshnode_mf_launch_rows_call(mf_engine *e, int rows, const int *tokens, const float *hidden, const float *in_dev, void *after, const int *pos, const int *loc, const int32_t *cells, const int *ncells, float *out_dev, void *done, char *err, int errlen) {
	return meshnode_mf_launch_rows(e, rows, tokens, hidden, in_dev, after, pos, loc, cells, ncells, out_dev, done, err, errlen);
}
static int meshnode_mf_finish_rows_call(mf_engine *e, int *picks, char *err, int errlen) { return meshnode_mf_finish_rows(e, picks, NULL, err, errlen); }
static int meshnode_mf_handoff_export_call(const void *like, size_t n, float **buf, void **ev, void *mem, void *evh, char *bus, char *err, int errlen) {
	return meshnode_mf_handoff_export(like, n, buf, ev, mem, evh, bus, err, errlen);
}
static int meshnode_mf_handoff_import_call(const void *like, const void *mem, const void *evh, const char *bus, float **buf, void **ev, char *err, int errlen) {
	return meshnode_mf_handoff_import(like, mem, evh, bus, buf, ev, err, errlen);
}
static void meshnode_mf_handoff_close_call(const void *like, float *buf, void *ev, int imported) { meshnode_mf_handoff_close(like, buf, ev, imported); }
static int meshnode_mf_event_wait_call(void *ev, int timeout_ms, char *err, int errlen) { return meshnode_mf_event_wait(ev, timeout_ms, err, errlen); }
static int meshnode_mf_handoff_read_call(const void *like, const float *buf, void *ev, size_t n, float *host, int timeout_ms, char *err, int errlen) {
	return meshnode_mf_handoff_read(like, buf, ev, n, host, timeout_ms, err, errlen);
}
static void meshnode_mf_destroy_call(mf_engine *e) { meshnode_mf_destroy(e); }
static float *meshnode_mf_host_alloc_call(size_t n) { return meshnode_mf_host_alloc(n); }
static void meshnode_mf_host_free_call(float *p) { meshnode_mf_host_free(p); }

// meshnode_embd_to_device copies host tensor t to the GPU that holds like;
// NULL (with the reason in err where there is one) if it cannot.
static void *meshnode_embd_to_device(void *t, const void *like, char *err, int n) {
	struct ggml_tensor *x = (struct ggml_tensor *) t;
	if (!meshnode_mf_device_copy || !meshnode_mf_device_free) {
		snprintf(err, n, "the fused library predates mf_device_copy");
		return NULL;
	}
	if (x == NULL || x->buffer == NULL || !ggml_backend_buffer_is_host(x->buffer) || !ggml_is_contiguous(x)) {
		snprintf(err, n, "the embedding is not a contiguous host tensor");
		return NULL;
	}
	return meshnode_mf_device_copy(like, x->data, ggml_nbytes(x), err, n);
}
static void meshnode_mf_device_free_call(void *p) { meshnode_mf_device_free(p); }

// meshnode_embed_row dequantizes row token of a host tensor into out.
static int meshnode_embed_row(void *t, int token, float *out) {
	struct ggml_tensor *x = (struct ggml_tensor *) t;
	if (x == NULL || x->buffer == NULL || !ggml_backend_buffer_is_host(x->buffer)) return -1;
	if (token < 0 || token >= x->ne[1]) return -2;
	const struct ggml_type_traits *tt = ggml_get_type_traits(x->type);
	if (tt->to_float == NULL) return -3;
	tt->to_float((const char *) x->data + (size_t) token * x->nb[1], out, x->ne[0]);
	return 0;
}

// The tensor's data when it lives in a device (not host) buffer, else NULL.
static void *meshnode_device_data(void *t) {
	struct ggml_tensor *x = (struct ggml_tensor *) t;
	if (x == NULL || x->buffer == NULL || ggml_backend_buffer_is_host(x->buffer)) return NULL;
	return x->data;
}
*/
import "C"

import (
	"bytes"
	"encoding/binary"
	"errors"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"sync"
	"time"
	"unsafe"

	"github.com/ollama/ollama/kvcache"
	"github.com/ollama/ollama/ml"

	"github.com/meshnode/meshnode/ggufstage/gguf"
	"github.com/meshnode/meshnode/stage"
)

// FusedLibrary is the file name deploy/gpu/build-cuda.sh gives the fused
// path's library, beside ggml's CUDA backend.
const FusedLibrary = "libmeshnode-fused.so"

var fusedLib struct {
	once sync.Once
	err  error
}

// loadFusedLibrary opens the library from MESHNODE_FUSED_LIB, else from the
// folders of OLLAMA_LIBRARY_PATH, else lib/ollama beside the executable.
func loadFusedLibrary() error {
	fusedLib.once.Do(func() {
		var tried []string
		try := func(p string) bool {
			cp := C.CString(p)
			defer C.free(unsafe.Pointer(cp))
			if msg := C.meshnode_mf_load(cp); msg != nil {
				tried = append(tried, C.GoString(msg))
				return false
			}
			return true
		}
		if p := os.Getenv("MESHNODE_FUSED_LIB"); p != "" {
			if !try(p) {
				fusedLib.err = fmt.Errorf("%w: MESHNODE_FUSED_LIB: %s", errFusedUnavailable, tried[0])
			}
			return
		}
		dirs := filepath.SplitList(os.Getenv("OLLAMA_LIBRARY_PATH"))
		if exe, err := os.Executable(); err == nil {
			dirs = append(dirs, filepath.Join(filepath.Dir(exe), "lib", "ollama"))
		}
		for _, d := range dirs {
			if p := filepath.Join(d, FusedLibrary); fileExists(p) && try(p) {
				return
			}
		}
		fusedLib.err = fmt.Errorf("%w: no %s in OLLAMA_LIBRARY_PATH or lib/ollama beside the binary (deploy/gpu/build-cuda.sh builds it) %v", errFusedUnavailable, FusedLibrary, tried)
	})
	return fusedLib.err
}

func fileExists(p string) bool {
	st, err := os.Stat(p)
	return err == nil && !st.IsDir()
}

// cudaFused is the fused path of one engine. Its C engine is made at the
// first step after ggml has made the stage's KV tensors.
type cudaFused struct {
	e      *Engine
	view   *causalView
	shape  fusedShape
	h      *C.mf_engine
	layers *C.mf_layer // C memory: the config points to it
	errBuf *C.char
	// maxRows is the most rows the C engine takes in one pass (16, fewer
	// where the mat-vecs' shared memory cannot hold more, or
	// MESHNODE_FUSED_ROWS); at 1, passes of several rows run on ggml.
	maxRows int
	passes  int // the most fused passes a batch takes (fusedPassLimit)
	// A pass's arguments, by row, reused: its tokens, positions, cells
	// written, earlier cells (one list after another) and their counts.
	tokens, pos, loc, ncells []C.int
	cells                    []int32
	locs, counts             []int // placeRows' and rowsCells' results, reused
	// hostEmbd is the token embedding where ggml keeps it in host memory
	// (ollama places the input layer on the CPU): the first stage looks
	// each token's row up here and hands the kernels hidden states.
	// devEmbd is the GPU's copy of a host embedding, whose rows the first
	// kernel then looks up: 4 to 7 µs a row on the host (an 8B model's
	// Q4_0 rows), the bulk of a first stage's host work before a pass.
	// Where the copy cannot be made (embdWhy says why) the host looks rows
	// up; MESHNODE_FUSED_HOST_EMBD=1 keeps them there.
	hostEmbd unsafe.Pointer
	devEmbd  unsafe.Pointer
	embdWhy  string
	embd     []float32
	// pinned holds the last stage's logits buffers, or another stage's
	// hidden states, in pinned host memory that the GPU copies into
	// directly: it saves copying 4 bytes per vocabulary entry again (half
	// a megabyte a token for Llama 3, 8 MB a batch of 16). A buffer holds
	// pinnedRows rows.
	pinned     pinnedPool
	pinnedRows int
	picks      []C.int // a pass's greedy picks (Batch.PicksOnly), reused
	// ahead is the pass queued ahead of the caller, if any (aheadPass),
	// and last the continuation of the last greedy pass (see aheadPlan);
	// queues says whether this stage queues passes ahead at all; taken and
	// dropped count the passes queued ahead that a caller took and that
	// settle waited for in vain.
	ahead, last    *aheadPass
	queues         bool
	taken, dropped int
}

// pinnedPool lends pinned host buffers of n floats, at most pinnedMax at
// once; beyond that the caller uses ordinary memory. Buffers may come back
// after the engine closed (a caller still held logits), and are freed then.
type pinnedPool struct {
	mu     sync.Mutex
	n      int
	free   []*C.float
	made   int
	closed bool
}

// pinnedMax is one buffer per pipeline lane in flight, with room to spare.
const pinnedMax = 4

// pinnedRowsMax bounds a pinned buffer (16 MB for a 128K vocabulary):
// batches of more rows take ordinary memory.
const pinnedRowsMax = 32

// get returns a buffer and the function that gives it back, or nil.
func (p *pinnedPool) get() ([]float32, func()) {
	p.mu.Lock()
	defer p.mu.Unlock()
	var buf *C.float
	switch {
	case p.closed || p.n == 0:
		return nil, nil
	case len(p.free) > 0:
		buf = p.free[len(p.free)-1]
		p.free = p.free[:len(p.free)-1]
	case p.made < pinnedMax:
		if buf = C.meshnode_mf_host_alloc_call(C.size_t(p.n)); buf == nil {
			return nil, nil
		}
		p.made++
	default:
		return nil, nil
	}
	var once sync.Once
	return unsafe.Slice((*float32)(unsafe.Pointer(buf)), p.n), func() {
		once.Do(func() {
			p.mu.Lock()
			defer p.mu.Unlock()
			if p.closed {
				C.meshnode_mf_host_free_call(buf)
				return
			}
			p.free = append(p.free, buf)
		})
	}
}

func (p *pinnedPool) close() {
	p.mu.Lock()
	defer p.mu.Unlock()
	p.closed = true
	for _, b := range p.free {
		C.meshnode_mf_host_free_call(b)
	}
	p.free = nil
}

const fusedErrLen = 512

func newFused(e *Engine, meta *gguf.File, flash bool, kv ml.DType) (fusedPath, error) {
	shape, err := fusedEligible(meta, flash, kv)
	if err != nil {
		return nil, err
	}
	if err := loadFusedLibrary(); err != nil {
		return nil, err
	}
	view, err := newCausalView(e.cache)
	if err != nil {
		return nil, err
	}
	f := &cudaFused{e: e, view: view, shape: shape, errBuf: (*C.char)(C.calloc(fusedErrLen, 1))}
	return f, nil
}

func (f *cudaFused) errText() string { return C.GoString(f.errBuf) }

// create makes the C engine; ok is false while ggml has not yet made every
// layer's KV tensors.
func (f *cudaFused) create() (ok bool, err error) {
	e := f.e
	dev := func(name string) (unsafe.Pointer, error) {
		t := e.backend.Get(name)
		if t == nil {
			return nil, fmt.Errorf("no tensor %s", name)
		}
		p := C.meshnode_device_data(pointerField(t, "t"))
		if p == nil {
			return nil, fmt.Errorf("tensor %s is not in GPU memory", name)
		}
		return p, nil
	}
	n := e.info.End - e.info.Start
	ls := make([]C.mf_layer, n)
	cells := 0
	for j := range ls {
		i := e.info.Start + j
		k, v := f.view.layerKV(i)
		if k == nil || v == nil {
			return false, nil
		}
		if k.DType() != ml.DTypeF16 || v.DType() != ml.DTypeF16 || k.Dim(0) != f.shape.headDim || k.Dim(1) != f.shape.kvHeads ||
			v.Dim(0) != f.shape.headDim || v.Dim(1) != f.shape.kvHeads || v.Dim(2) != k.Dim(2) {
			return false, fmt.Errorf("layer %d's KV cache is not f16 [%d,%d,cells]", i, f.shape.headDim, f.shape.kvHeads)
		}
		cells = k.Dim(2)
		l := &ls[j]
		type ptr struct {
			dst  *unsafe.Pointer
			name string
		}
		ptrs := []ptr{
			{&l.attn_norm, "attn_norm.weight"}, {&l.wq, "attn_q.weight"}, {&l.wk, "attn_k.weight"}, {&l.wv, "attn_v.weight"},
			{&l.wo, "attn_output.weight"}, {&l.ffn_norm, "ffn_norm.weight"}, {&l.gate, "ffn_gate.weight"},
			{&l.up, "ffn_up.weight"}, {&l.down, "ffn_down.weight"},
		}
		if f.shape.qkvBias {
			ptrs = append(ptrs, ptr{&l.bq, "attn_q.bias"}, ptr{&l.bk, "attn_k.bias"}, ptr{&l.bv, "attn_v.bias"})
		}
		for _, p := range ptrs {
			d, err := dev(fmt.Sprintf("blk.%d.%s", i, p.name))
			if err != nil {
				return false, err
			}
			*p.dst = d
		}
		if l.k = C.meshnode_device_data(pointerField(k, "t")); l.k == nil {
			return false, fmt.Errorf("layer %d's K cache is not in GPU memory", i)
		}
		if l.v = C.meshnode_device_data(pointerField(v, "t")); l.v == nil {
			return false, fmt.Errorf("layer %d's V cache is not in GPU memory", i)
		}
	}
	f.layers = (*C.mf_layer)(C.malloc(C.size_t(n) * C.size_t(unsafe.Sizeof(C.mf_layer{}))))
	copy(unsafe.Slice(f.layers, n), ls)
	s := f.shape
	cfg := C.mf_config{
		n_layer: C.int(n), embd: C.int(s.embd), n_head: C.int(s.heads), n_kv_head: C.int(s.kvHeads),
		head_dim: C.int(s.headDim), ffn: C.int(s.ffn), vocab: C.int(e.info.Vocab), cells: C.int(cells),
		eps: C.float(s.eps), rope_base: C.float(s.ropeBase), rope_freq_scale: C.float(1 / s.ropeScale), rope_neox: cBool(s.neox),
		layers: f.layers, device: -1,
	}
	var err2 error
	if e.info.First() {
		t := e.backend.Get("token_embd.weight")
		if t == nil {
			return false, fmt.Errorf("no tensor token_embd.weight")
		}
		ct := pointerField(t, "t")
		p := C.meshnode_device_data(ct)
		if p == nil && os.Getenv("MESHNODE_FUSED_HOST_EMBD") == "" {
			if f.devEmbd = C.meshnode_embd_to_device(ct, ls[0].wq, f.errBuf, fusedErrLen); f.devEmbd != nil {
				p = f.devEmbd
			} else {
				f.embdWhy = f.errText()
			}
		}
		if p != nil {
			cfg.embd_type, cfg.tok_embd = C.int(s.embdType), p
		} else {
			f.hostEmbd = ct
		}
	}
	if e.info.Last() {
		cfg.out_type = C.int(s.outType)
		if cfg.out_norm, err2 = dev("output_norm.weight"); err2 != nil {
			return false, err2
		}
		if cfg.output, err2 = dev("output.weight"); err2 != nil {
			return false, err2
		}
	}
	computeMu.Lock()
	rc := C.meshnode_mf_create_call(&cfg, &f.h, f.errBuf, fusedErrLen)
	computeMu.Unlock()
	if rc != 0 {
		f.h = nil
		return false, fmt.Errorf("%w: %s", errFusedUnavailable, f.errText())
	}
	f.maxRows = int(C.meshnode_mf_max_rows_call(f.h))
	f.passes = fusedPassLimit(f.maxRows, s.embd)
	f.pinnedRows = min(f.maxRows*f.passes, pinnedRowsMax)
	if e.info.Last() {
		f.pinned.n = f.pinnedRows * e.info.Vocab
	} else {
		f.pinned.n = f.pinnedRows * e.info.Embd
	}
	if f.hostEmbd != nil {
		f.embd = make([]float32, f.maxRows*s.embd)
	}
	// Queued ahead, a greedy step's host work (returning the picks, the
	// caller's next batch, placing it) leaves the GPU's path: the next
	// pass takes its tokens on the device.
	f.queues = e.info.First() && e.info.Last() && f.hostEmbd == nil && C.meshnode_mf_can_queue() != 0 && aheadEnabled()
	return true, nil
}

func (f *cudaFused) step(b *stage.Batch, slots []int, hidden []float32) (*stage.Output, bool, error) {
	e := f.e
	if f.h == nil {
		ok, err := f.create()
		if err != nil || !ok {
			// ggml runs the pass; a path that cannot start stays off.
			if err != nil {
				e.fused, e.fusedWhy = nil, err.Error()
				f.close()
			}
			return nil, false, nil
		}
	}
	n := b.Rows()
	sizes := fusedPassSizes(n, f.maxRows, f.passes)
	picksOnly := b.PicksOnly && e.info.Last()
	act, settle := aheadPlan(f.ahead, f.last, b, slots, picksOnly && len(sizes) == 1 && f.queues)
	if settle {
		if err := f.settle(); err != nil {
			return nil, true, err
		}
	}
	switch act {
	case aheadTake:
		f.taken++
		return f.stepQueued(b, slots, true)
	case aheadQueue:
		return f.stepQueued(b, slots, false)
	}
	f.last = nil
	if sizes == nil {
		return nil, false, nil // ggml runs it
	}
	start := time.Now()
	width := e.info.Embd // floats a row of the result
	var dst []float32
	var free func()
	pinned := C.int(0)
	if picksOnly {
		// Greedy picks instead of logits: no logits buffer.
		if cap(f.picks) < n {
			f.picks = make([]C.int, n)
		}
		f.picks = f.picks[:n]
	} else {
		// Logits or hidden states straight into pinned memory, not
		// through the engine's own pinned buffer and a host copy: the
		// logits of eight rows are 4 MB, their hidden states 128 KiB for
		// an 8B model. Either is lent to the caller.
		if e.info.Last() {
			width = e.info.Vocab
		}
		if n <= f.pinnedRows {
			if dst, free = f.pinned.get(); dst != nil {
				dst, pinned = dst[:n*width], 1
			}
		}
		if dst == nil {
			dst, free = e.reads.get(n * width)
		}
	}
	placed := 0
	// fail undoes the rows placed in the cache, so that the batch leaves
	// no trace and may be sent again.
	fail := func(err error) (*stage.Output, bool, error) {
		_ = f.unplace(slots[:placed], b.Pos[:placed])
		if free != nil {
			free()
		}
		return nil, true, err
	}
	var graph, wait time.Duration
	r0 := 0
	for _, rows := range sizes {
		ok, err := f.placePass(slots[r0:r0+rows], b.Pos[r0:r0+rows])
		if ok {
			placed += rows
		}
		if err != nil {
			return fail(err)
		}
		hp, err := f.passInput(b, r0, rows, hidden)
		if err != nil {
			return fail(err)
		}
		var out *C.float
		var picks *C.int
		if picksOnly {
			picks = &f.picks[r0]
		} else {
			out = (*C.float)(unsafe.Pointer(&dst[r0*width]))
		}
		graph += time.Since(start)
		computeMu.Lock()
		start = time.Now()
		rc := C.meshnode_mf_step_rows_call(f.h, C.int(rows), &f.tokens[0], hp, &f.pos[0], &f.loc[0], f.cellsArg(), &f.ncells[0],
			out, pinned, picks, f.errBuf, fusedErrLen)
		wait += time.Since(start)
		computeMu.Unlock()
		start = time.Now()
		if rc != 0 {
			// A CUDA error may leave the context unusable: reload the stage.
			err := fmt.Errorf("%w: fused decode step: %s", ErrBroken, f.errText())
			e.broken.Store(err)
			return fail(err)
		}
		r0 += rows
	}
	e.phases.passes.Add(1)
	e.phases.graph.Add(int64(graph))
	e.phases.wait.Add(int64(wait))
	out := &stage.Output{}
	if picksOnly {
		out.Picks = make([]int32, n)
		for i, p := range f.picks {
			out.Picks[i] = int32(p)
		}
		if len(sizes) == 1 {
			f.last = continuation(slots, b.Pos)
			f.last.after = slices.Clone(out.Picks)
		}
		return out, true, nil
	}
	if e.info.Last() {
		out.Logits, out.Free = dst, free
		return out, true, nil
	}
	// Lent to the caller until Release: a pipeline sends it from there to
	// the next stage's socket.
	h, err := stage.SharedActivation(n, e.info.Embd, dst)
	if err != nil {
		free()
		return nil, true, err
	}
	out.Hidden, out.Free = h, free
	return out, true, nil
}

// stepQueued runs greedy batch b as one queued pass (mf_queue_picks): the
// pass queued ahead already, if queued, else queued now; then it queues
// the pass after it, ahead of the caller, and waits for b's picks.
func (f *cudaFused) stepQueued(b *stage.Batch, slots []int, queued bool) (*stage.Output, bool, error) {
	e := f.e
	start := time.Now()
	if !queued {
		f.tokens = f.tokens[:0]
		for _, t := range b.Tokens {
			f.tokens = append(f.tokens, C.int(t))
		}
		if err := f.queue(slots, b.Pos, f.tokens); err != nil {
			return nil, true, err
		}
	}
	// The next pass's tokens are this one's picks (-1). Without room for
	// its cells there is none queued ahead.
	f.ahead, f.last = nil, nil
	next := continuation(slots, b.Pos)
	f.tokens = f.tokens[:0]
	for range slots {
		f.tokens = append(f.tokens, -1)
	}
	err := f.queue(slots, next.pos, f.tokens)
	switch {
	case err == nil:
		f.ahead = next
	case !errors.Is(err, kvcache.ErrKvCacheFull):
		_ = f.wait(nil)
		return nil, true, err
	}
	graph := time.Since(start)
	start = time.Now()
	if cap(f.picks) < len(slots) {
		f.picks = make([]C.int, len(slots))
	}
	f.picks = f.picks[:len(slots)]
	err = f.wait(f.picks)
	e.phases.passes.Add(1)
	e.phases.graph.Add(int64(graph))
	e.phases.wait.Add(int64(time.Since(start)))
	if err != nil {
		return nil, true, err
	}
	out := &stage.Output{Picks: make([]int32, len(slots))}
	for r, p := range f.picks {
		out.Picks[r] = int32(p)
	}
	next.after = slices.Clone(out.Picks)
	f.last = next
	return out, true, nil
}

// passInput sets f.tokens to the tokens of b's rows r0 to r0+rows (0 on a
// stage that does not embed) and returns the pass's hidden input on the
// host: the rows looked up in a host embedding, the rows' hidden states
// from hidden, or nil where the kernels embed or hidden is nil (the input
// lies on the device).
func (f *cudaFused) passInput(b *stage.Batch, r0, rows int, hidden []float32) (*C.float, error) {
	e := f.e
	f.tokens = f.tokens[:0]
	for r := r0; r < r0+rows; r++ {
		token := C.int(0)
		if e.info.First() {
			token = C.int(b.Tokens[r])
		}
		f.tokens = append(f.tokens, token)
	}
	switch {
	case f.hostEmbd != nil:
		for i := range rows {
			row := f.embd[i*e.info.Embd : (i+1)*e.info.Embd]
			if rc := C.meshnode_embed_row(f.hostEmbd, f.tokens[i], (*C.float)(unsafe.Pointer(&row[0]))); rc != 0 {
				return nil, fmt.Errorf("fused decode: looking up token %d in the embedding (%d)", int(f.tokens[i]), int(rc))
			}
		}
		return (*C.float)(unsafe.Pointer(&f.embd[0])), nil
	case !e.info.First() && hidden != nil:
		return (*C.float)(unsafe.Pointer(&hidden[r0*e.info.Embd])), nil
	}
	return nil, nil
}

// continuation is the pass that continues a pass of rows in cache slots
// slots at positions pos; its tokens (after) are the pass's picks, once
// known.
func continuation(slots []int, pos []int32) *aheadPass {
	next := make([]int32, len(pos))
	for r, p := range pos {
		next[r] = p + 1
	}
	return &aheadPass{slots: slices.Clone(slots), pos: next}
}

// placePass places one pass's rows (slots at positions pos) in the cache
// and sets its arguments: f.pos, f.loc, f.ncells and f.cells. Without room
// for every row nothing is placed; placed says whether the rows stay
// placed, for the caller to undo, when err is not nil.
func (f *cudaFused) placePass(slots []int, pos []int32) (placed bool, err error) {
	if f.locs, err = f.view.placeRows(slots, pos, f.locs[:0]); err != nil {
		return false, fmt.Errorf("placing batch in the KV cache: %w", err)
	}
	if f.cells, f.counts, err = f.view.rowsCells(slots, pos, f.cells[:0], f.counts[:0]); err != nil {
		return true, fmt.Errorf("fused decode: %w", err)
	}
	f.pos, f.loc, f.ncells = f.pos[:0], f.loc[:0], f.ncells[:0]
	for r := range slots {
		f.pos, f.loc, f.ncells = append(f.pos, C.int(pos[r])), append(f.loc, C.int(f.locs[r])), append(f.ncells, C.int(f.counts[r]))
	}
	return true, nil
}

// cellsArg is the pass's earlier cells (f.cells) for the C engine: NULL
// where there are none.
func (f *cudaFused) cellsArg() *C.int32_t {
	if len(f.cells) == 0 {
		return nil
	}
	return (*C.int32_t)(unsafe.Pointer(&f.cells[0]))
}

// queue places one pass's rows (slots at positions pos) in the cache and
// queues it; token -1 takes the pick of the pass queued before. On an
// error nothing stays placed; kvcache.ErrKvCacheFull says there was no
// room, anything else breaks the stage.
func (f *cudaFused) queue(slots []int, pos []int32, tokens []C.int) error {
	e := f.e
	if placed, err := f.placePass(slots, pos); err != nil {
		if placed {
			_ = f.unplace(slots, pos)
		}
		return err
	}
	computeMu.Lock()
	rc := C.meshnode_mf_queue_picks_call(f.h, C.int(len(slots)), &tokens[0], &f.pos[0], &f.loc[0], f.cellsArg(), &f.ncells[0], f.errBuf, fusedErrLen)
	computeMu.Unlock()
	if rc != 0 {
		_ = f.unplace(slots, pos)
		err := fmt.Errorf("%w: fused decode, queueing a pass: %s", ErrBroken, f.errText())
		e.broken.Store(err)
		return err
	}
	return nil
}

// wait waits for the oldest queued pass and writes its picks (nil: drops
// them).
func (f *cudaFused) wait(picks []C.int) error {
	var p *C.int
	if len(picks) > 0 {
		p = &picks[0]
	}
	computeMu.Lock()
	rc := C.meshnode_mf_wait_picks_call(f.h, p, f.errBuf, fusedErrLen)
	computeMu.Unlock()
	if rc != 0 {
		err := fmt.Errorf("%w: fused decode, waiting for a pass: %s", ErrBroken, f.errText())
		f.e.broken.Store(err)
		return err
	}
	return nil
}

// settle waits for the pass queued ahead, if any, and frees its cells: the
// caller asked for something else. The next greedy pass then runs as one
// step (see aheadPlan).
func (f *cudaFused) settle() error {
	f.last = nil
	p := f.ahead
	if p == nil {
		return nil
	}
	f.ahead = nil
	f.dropped++
	err := f.wait(nil)
	if rerr := f.unplace(p.slots, p.pos); rerr != nil && err == nil {
		err = fmt.Errorf("freeing the cells of a pass queued ahead: %w", rerr)
	}
	return err
}

// unplace frees the cells of rows placed in the cache (slots at
// positions pos, and everything after them), every row even after an
// error; it returns the first error.
func (f *cudaFused) unplace(slots []int, pos []int32) error {
	var err error
	for r, s := range slots {
		if rerr := f.e.cache.Remove(s, pos[r], math.MaxInt32); rerr != nil && err == nil {
			err = rerr
		}
	}
	return err
}

func (f *cudaFused) close() {
	f.pinned.close()
	if f.h != nil {
		computeMu.Lock()
		C.meshnode_mf_destroy_call(f.h)
		computeMu.Unlock()
		f.h = nil
	}
	if f.devEmbd != nil {
		C.meshnode_mf_device_free_call(f.devEmbd)
		f.devEmbd = nil
	}
	if f.layers != nil {
		C.free(unsafe.Pointer(f.layers))
		f.layers = nil
	}
	if f.errBuf != nil {
		C.free(unsafe.Pointer(f.errBuf))
		f.errBuf = nil
	}
}

// Hand-offs between processes on one GPU (handoff.go, cuda/fused.h
// mf_handoff_export).

// devicePort is a hand-off port: a buffer of rows × embd floats and an
// interprocess event on the stage's GPU, this process's (exported) or
// another's (imported).
type devicePort struct {
	like       unsafe.Pointer // a device pointer of the GPU: one of the stage's weights
	buf        *C.float
	ev         unsafe.Pointer
	imported   bool
	rows, embd int
	mu         sync.Mutex
	closed     bool
}

// portRowsMax is the most rows of a port: the most a fused pass takes.
const portRowsMax = 16

// handoffMagic starts an offer: the layout's version.
const handoffMagic = "mnh1"

// handoffReadTimeout bounds how long a port's reader, or an abandoned pass,
// waits for the previous stage's pass: a pass takes milliseconds, and one
// that never ends leaves nothing to wait for.
const handoffReadTimeout = 10_000 // ms

// offer is the port's handles for the next stage: magic, rows, embd
// (little-endian uint32s), the GPU's PCI bus id, the buffer's and the
// event's handles.
func (p *devicePort) offer(bus, mem, ev []byte) []byte {
	b := []byte(handoffMagic)
	b = binary.LittleEndian.AppendUint32(b, uint32(p.rows))
	b = binary.LittleEndian.AppendUint32(b, uint32(p.embd))
	b = append(b, bus...)
	b = append(b, mem...)
	return append(b, ev...)
}

func (p *devicePort) Read(rows int) (*stage.Activation, error) {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil, errors.New("reading a closed hand-off port")
	}
	if rows < 1 || rows > p.rows {
		return nil, fmt.Errorf("reading %d rows from a hand-off port of %d", rows, p.rows)
	}
	data := make([]float32, rows*p.embd)
	errBuf := (*C.char)(C.calloc(fusedErrLen, 1))
	defer C.free(unsafe.Pointer(errBuf))
	if C.meshnode_mf_handoff_read_call(p.like, p.buf, p.ev, C.size_t(len(data)), (*C.float)(unsafe.Pointer(&data[0])), handoffReadTimeout, errBuf, fusedErrLen) != 0 {
		return nil, fmt.Errorf("reading hidden states from the previous stage's port: %s", C.GoString(errBuf))
	}
	return stage.SharedActivation(rows, p.embd, data)
}

func (p *devicePort) Close() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	if p.closed {
		return nil
	}
	p.closed = true
	computeMu.Lock()
	C.meshnode_mf_handoff_close_call(p.like, p.buf, p.ev, cBool(p.imported))
	computeMu.Unlock()
	return nil
}

// stageDevicePointer is a device pointer of the stage's GPU, for the ports'
// calls: its first layer's Q weight.
func (f *cudaFused) stageDevicePointer() (unsafe.Pointer, error) {
	name := fmt.Sprintf("blk.%d.attn_q.weight", f.e.info.Start)
	t := f.e.backend.Get(name)
	if t == nil {
		return nil, fmt.Errorf("%w: no tensor %s", errNoHandoff, name)
	}
	p := C.meshnode_device_data(pointerField(t, "t"))
	if p == nil {
		return nil, fmt.Errorf("%w: the stage's weights are not in GPU memory", errNoHandoff)
	}
	return p, nil
}

func (f *cudaFused) exportPort(rows int) (stage.HandoffPort, []byte, error) {
	if C.meshnode_mf_can_handoff() == 0 {
		return nil, nil, fmt.Errorf("%w: %s predates hand-offs between processes (rebuild it with deploy/gpu/build-cuda.sh)", errNoHandoff, FusedLibrary)
	}
	like, err := f.stageDevicePointer()
	if err != nil {
		return nil, nil, err
	}
	if rows < 1 {
		return nil, nil, fmt.Errorf("%w: a port of %d rows", errNoHandoff, rows)
	}
	// No pass takes more rows (cuda/fused.cu kMaxRows); a pipeline's
	// frame may hold a prefill of 64K.
	rows = min(rows, portRowsMax)
	p := &devicePort{like: like, rows: rows, embd: f.e.info.Embd}
	mem, ev, bus := make([]byte, C.MF_IPC_HANDLE), make([]byte, C.MF_IPC_HANDLE), make([]byte, C.MF_BUS_ID)
	computeMu.Lock()
	rc := C.meshnode_mf_handoff_export_call(like, C.size_t(rows*p.embd), &p.buf, &p.ev, unsafe.Pointer(&mem[0]), unsafe.Pointer(&ev[0]),
		(*C.char)(unsafe.Pointer(&bus[0])), f.errBuf, fusedErrLen)
	computeMu.Unlock()
	if rc != 0 {
		return nil, nil, fmt.Errorf("%w: %s", errNoHandoff, f.errText())
	}
	return p, p.offer(bus, mem, ev), nil
}

func (f *cudaFused) importPort(offer []byte) (stage.HandoffPort, error) {
	if C.meshnode_mf_can_handoff() == 0 {
		return nil, fmt.Errorf("%w: %s predates hand-offs between processes (rebuild it with deploy/gpu/build-cuda.sh)", errNoHandoff, FusedLibrary)
	}
	const head = len(handoffMagic) + 8
	if len(offer) != head+C.MF_BUS_ID+2*C.MF_IPC_HANDLE || string(offer[:len(handoffMagic)]) != handoffMagic {
		return nil, fmt.Errorf("%w: an offer of %d bytes in another layout", errNoHandoff, len(offer))
	}
	rows := int(binary.LittleEndian.Uint32(offer[4:]))
	embd := int(binary.LittleEndian.Uint32(offer[8:]))
	if embd != f.e.info.Embd || rows < 1 || rows > 1<<16 {
		return nil, fmt.Errorf("%w: a port of %d rows of %d floats, this stage's rows are %d", errNoHandoff, rows, embd, f.e.info.Embd)
	}
	like, err := f.stageDevicePointer()
	if err != nil {
		return nil, err
	}
	bus := offer[head : head+C.MF_BUS_ID]
	mem := offer[head+C.MF_BUS_ID : head+C.MF_BUS_ID+C.MF_IPC_HANDLE]
	ev := offer[head+C.MF_BUS_ID+C.MF_IPC_HANDLE:]
	if bytes.IndexByte(bus, 0) < 0 {
		return nil, fmt.Errorf("%w: the offer's bus id is not terminated", errNoHandoff)
	}
	p := &devicePort{like: like, rows: rows, embd: embd, imported: true}
	computeMu.Lock()
	rc := C.meshnode_mf_handoff_import_call(like, unsafe.Pointer(&mem[0]), unsafe.Pointer(&ev[0]), (*C.char)(unsafe.Pointer(&bus[0])),
		&p.buf, &p.ev, f.errBuf, fusedErrLen)
	computeMu.Unlock()
	if rc != 0 {
		return nil, fmt.Errorf("%w: %s", errNoHandoff, f.errText())
	}
	return p, nil
}

// fusedLaunched is a pass mf_launch_rows queued.
type fusedLaunched struct {
	f     *cudaFused
	slots []int
	pos   []int32
	in    *devicePort
	graph time.Duration // the host's time to queue it
}

func (f *cudaFused) launch(b *stage.Batch, slots []int, hidden []float32, in, out stage.HandoffPort) (fusedLaunch, bool, error) {
	e := f.e
	if f.h == nil {
		ok, err := f.create()
		if err != nil || !ok {
			if err != nil {
				e.fused, e.fusedWhy = nil, err.Error()
				f.close()
			}
			return nil, false, nil
		}
	}
	var ip, op *devicePort
	if in != nil {
		var ok bool
		if ip, ok = in.(*devicePort); !ok || !ip.imported {
			return nil, false, fmt.Errorf("%w: an input port this engine did not open", errNoHandoff)
		}
	}
	if out != nil {
		var ok bool
		if op, ok = out.(*devicePort); !ok || op.imported {
			return nil, false, fmt.Errorf("%w: an output port this engine did not make", errNoHandoff)
		}
	}
	n := b.Rows()
	if n > f.maxRows || ip != nil && n > ip.rows || op != nil && n > op.rows {
		return nil, false, nil
	}
	start := time.Now()
	f.last = nil
	if placed, err := f.placePass(slots, b.Pos); err != nil {
		if placed {
			_ = f.unplace(slots, b.Pos)
		}
		return nil, false, err
	}
	// From a port, hidden is nil: the input is on the device.
	hp, err := f.passInput(b, 0, n, hidden)
	if err != nil {
		_ = f.unplace(slots, b.Pos)
		return nil, false, err
	}
	var inDev, outDev *C.float
	var after, done unsafe.Pointer
	if ip != nil {
		inDev, after = ip.buf, ip.ev
	}
	if op != nil {
		outDev, done = op.buf, op.ev
	}
	computeMu.Lock()
	rc := C.meshnode_mf_launch_rows_call(f.h, C.int(n), &f.tokens[0], hp, inDev, after, &f.pos[0], &f.loc[0], f.cellsArg(), &f.ncells[0],
		outDev, done, f.errBuf, fusedErrLen)
	computeMu.Unlock()
	if rc != 0 {
		err := fmt.Errorf("%w: fused decode, launching a pass: %s", ErrBroken, f.errText())
		e.broken.Store(err)
		_ = f.unplace(slots, b.Pos)
		return nil, false, err
	}
	return &fusedLaunched{f: f, slots: slices.Clone(slots), pos: slices.Clone(b.Pos), in: ip, graph: time.Since(start)}, true, nil
}

func (l *fusedLaunched) finish() (*stage.Output, error) {
	f, e := l.f, l.f.e
	n := len(l.slots)
	var picks *C.int
	if e.info.Last() {
		if cap(f.picks) < n {
			f.picks = make([]C.int, n)
		}
		f.picks = f.picks[:n]
		picks = &f.picks[0]
	}
	computeMu.Lock()
	start := time.Now()
	rc := C.meshnode_mf_finish_rows_call(f.h, picks, f.errBuf, fusedErrLen)
	wait := time.Since(start)
	computeMu.Unlock()
	if rc != 0 {
		err := fmt.Errorf("%w: fused decode, finishing a pass: %s", ErrBroken, f.errText())
		e.broken.Store(err)
		_ = f.unplace(l.slots, l.pos)
		return nil, err
	}
	e.phases.passes.Add(1)
	e.phases.graph.Add(int64(l.graph))
	e.phases.wait.Add(int64(wait))
	out := &stage.Output{}
	if picks != nil {
		out.Picks = make([]int32, n)
		for i, p := range f.picks {
			out.Picks[i] = int32(p)
		}
	}
	return out, nil
}

func (l *fusedLaunched) abandon() error {
	f, e := l.f, l.f.e
	if l.in != nil {
		// The pass waits on the previous stage's event: if that never
		// comes, neither does the end of this pass, and the stream stays
		// stuck behind it.
		rc := C.meshnode_mf_event_wait_call(l.in.ev, handoffReadTimeout, f.errBuf, fusedErrLen)
		if rc != 0 {
			why := "the previous stage's pass never ended"
			if rc < 0 {
				why = f.errText()
			}
			err := fmt.Errorf("%w: abandoning a pass: %s", ErrBroken, why)
			e.broken.Store(err)
			return err
		}
	}
	computeMu.Lock()
	rc := C.meshnode_mf_finish_rows_call(f.h, nil, f.errBuf, fusedErrLen)
	computeMu.Unlock()
	if rc != 0 {
		err := fmt.Errorf("%w: fused decode, abandoning a pass: %s", ErrBroken, f.errText())
		e.broken.Store(err)
		return err
	}
	return f.unplace(l.slots, l.pos)
}
