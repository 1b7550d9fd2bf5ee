// Package ggufstage is the StageEngine on llama.cpp's ggml, reached through
// the Go packages of ollama (pinned at v0.17.4): it loads a GGUF slice that
// holds only its layers and runs them with ollama's own layer code, so that
// a model split into stages computes what the unsplit model computes.
package ggufstage

import (
	"context"
	"errors"
	"fmt"
	"io"
	"math"
	"os"
	"runtime"
	"runtime/debug"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"github.com/ollama/ollama/kvcache"
	"github.com/ollama/ollama/ml"
	_ "github.com/ollama/ollama/ml/backend/ggml" // registers the ggml backend
	"github.com/ollama/ollama/model"

	"github.com/meshnode/meshnode/ggufstage/gguf"
	"github.com/meshnode/meshnode/stage"
)

// Options configure an engine.
type Options struct {
	Threads        int         // CPU threads; 0 = by the stage's size (defaultThreads)
	Context        int         // positions per sequence; 0 = the model's, capped at 4096
	MaxSeqs        int         // sequences with KV at once; 0 = 4
	BatchSize      int         // most tokens in one forward pass; 0 = 512
	FlashAttention Switch      // ggml's fused attention kernel; Auto: on GPUs (see Auto)
	BuildAhead     Switch      // build the next decode pass while one computes (see pass); Auto: on GPUs
	DecodeGraphs   Switch      // a scheduler per pipeline lane, and CUDA graphs for decode passes of several rows (see lane); Auto: off
	FusedDecode    Switch      // meshnode's own CUDA kernels for decode passes (see fused.go); Auto: on where they can run, On: Open fails where they cannot
	KVType         ml.DType    // 0 = f16
	WireDType      stage.DType // 0 = f16
	NoRepack       bool        // keep quantized weights in ggml's plain layout
	// Device places the stage: "cpu", "cuda" (or "rocm", "metal": any GPU
	// library ggml loaded), or "auto"/"" = the first GPU if there is one,
	// else the CPU. GPU backends are loaded at run time from
	// OLLAMA_LIBRARY_PATH (deploy/gpu builds them).
	Device string
}

// Switch is an engine feature's setting: Auto (on for a stage on a GPU,
// off on the CPU), On or Off.
type Switch int8

const (
	// Auto is on for a stage on a GPU, off on the CPU, with one exception.
	// For flash attention: the fused kernel is the faster on a GPU at
	// every batch size (8B Q4_0 on an H200: 1.09x decode at 1 stream,
	// 1.11x at 32). On the CPU, ggml's kernel accumulates in f16 in KV-cell
	// order, so a sequence replayed into other cells rounds differently
	// (see the README); Auto turns it on there only where meshnode's own
	// kernel (attn_amd64.cpp: f32, the same result wherever the cells sit)
	// replaces ggml's, with an f16 KV cache. For building passes ahead:
	// only a GPU leaves the host idle while a pass computes.
	Auto Switch = iota
	On
	Off
)

// on says whether the feature runs, for a stage on a GPU or not.
func (s Switch) on(gpu bool) bool { return s == On || (s == Auto && gpu) }

// ParseSwitch reads "auto", "on" or "off" (or a boolean).
func ParseSwitch(s string) (Switch, error) {
	switch strings.ToLower(s) {
	case "auto", "":
		return Auto, nil
	case "on", "true", "1":
		return On, nil
	case "off", "false", "0":
		return Off, nil
	}
	return Auto, fmt.Errorf("%q: want auto, on or off", s)
}

func (s Switch) String() string {
	switch s {
	case On:
		return "on"
	case Off:
		return "off"
	}
	return "auto"
}

// Engine runs layers [Start,End) of a GGUF model. It is safe for use by
// several goroutines; compute is serialized.
type Engine struct {
	mu      sync.Mutex
	info    stage.Info
	m       model.Model
	backend ml.Backend
	cache   kvcache.Cache
	arch    adapter
	slots   map[stage.SeqID]int
	free    []int
	weights uint64
	extra   io.Closer // repacked weight buffers, freed after the backend
	batch   int
	closed  bool
	// broken holds the error (wrapping ErrBroken) of the panic that
	// stopped the engine: ollama's cache and contexts may be half-changed
	// after one, and touching them again can end the process in a
	// GGML_ASSERT, which no recover catches. Atomic, so that Broken need
	// not wait for a forward pass.
	broken atomic.Value
	phases phaseClock
	// Building passes ahead (see pass): on GPUs, where the host is
	// otherwise idle while a pass computes. ahead holds the passes built
	// for the batches predicted next, of disjoint sequences.
	buildsAhead bool
	ahead       []*pass
	// lanes are the schedulers passes run on (see lane); lane 0 is
	// ollama's. Empty in builds that compute through ollama.
	lanes        []*lane
	decodeGraphs bool
	prep         sync.WaitGroup // allocAhead goroutines, waited for by Close
	// Read buffers: a pass's logits or hidden states go to the caller and
	// come back by Release (Output.Free).
	reads floatPool
	// fused runs decode passes on CUDA (see fused.go); fusedWhy
	// says why it does not, when it was wanted.
	fused    fusedPath
	fusedWhy string
}

// Fused reports whether the stage decodes through meshnode's fused CUDA
// kernels, and if not, why, where it was wanted.
func (e *Engine) Fused() (on bool, why string) {
	e.mu.Lock()
	defer e.mu.Unlock()
	return e.fused != nil, e.fusedWhy
}

// Phases is where an engine's forward passes spent their time, summed
// since it loaded. On a GPU the split tells host overhead (Graph, Launch)
// from device work (Wait); on a CPU ggml computes inside Launch.
type Phases struct {
	Passes    uint64
	Ahead     uint64        // passes that had been built ahead (see pass)
	Allocated uint64        // passes whose scheduler allocation was done ahead, while the stage waited for them
	Graph     time.Duration // building the graph in Go (the next pass's too, when built ahead while this one computes), placing rows in the KV cache, freeing the context
	Alloc     time.Duration // ggml's scheduler splitting the graph over the backends and placing its tensors, when not done ahead
	Launch    time.Duration // ggml's scheduler: copying inputs, queueing the graph (and splitting and allocating it, in builds that cannot separate that)
	Wait      time.Duration // waiting for the backend to finish and reading the result back
}

// phaseClock accumulates Phases without a lock: Phases is read by
// metrics scrapes while a pass runs.
type phaseClock struct {
	passes, ahead, allocated, graph, alloc, launch, wait atomic.Int64
}

func (c *phaseClock) read() Phases {
	return Phases{Passes: uint64(c.passes.Load()), Ahead: uint64(c.ahead.Load()), Allocated: uint64(c.allocated.Load()),
		Graph: time.Duration(c.graph.Load()), Alloc: time.Duration(c.alloc.Load()),
		Launch: time.Duration(c.launch.Load()), Wait: time.Duration(c.wait.Load())}
}

// Phases reports where forward passes spent their time.
func (e *Engine) Phases() Phases { return e.phases.read() }

var _ stage.Engine = (*Engine)(nil)

// ErrBroken is returned by every call after one that panicked inside ggml or
// ollama (an allocation that failed, say): the stage must be reloaded.
var ErrBroken = errors.New("stage engine unusable after an earlier failure; reload the stage")

// usable says why the engine must not be used; call with e.mu held.
func (e *Engine) usable() error {
	switch {
	case e.closed:
		return errors.New("stage: engine is closed")
	}
	return e.Broken()
}

// breakOnPanic is recoverErr for calls that change the engine's state: a
// panic also marks the engine broken. Defer it with e.mu held.
func (e *Engine) breakOnPanic(err *error, doing string) {
	if r := recover(); r != nil {
		e.broken.Store(fmt.Errorf("%w: %s: %v", ErrBroken, doing, r))
		*err = panicError(doing, r)
	}
}

// Broken returns why the engine refuses calls after a panic (wrapping
// ErrBroken), or nil.
func (e *Engine) Broken() error {
	err, _ := e.broken.Load().(error)
	return err
}

// testPanic, when set by a test, is called inside Forward where ggml runs.
var testPanic func()

// Open loads a stage from a GGUF file that holds (at least) the tensors of
// layers [start,end): a slice written by Slice, or a whole model.
func Open(path string, start, end int, opts Options) (e *Engine, err error) {
	backendMu.Lock()
	defer backendMu.Unlock()
	defer recoverErr(&err, "loading "+path)

	meta, err := readHeader(path)
	if err != nil {
		return nil, err
	}
	if err := checkArch(meta.Arch()); err != nil {
		return nil, fmt.Errorf("loading %s: %w", path, err)
	}
	layers, err := meta.BlockCount()
	if err != nil {
		return nil, fmt.Errorf("loading %s: %w", path, err)
	}
	if start < 0 || end > layers || start >= end {
		return nil, fmt.Errorf("layer range [%d,%d) is not inside the model's %d layers", start, end, layers)
	}
	if opts.Threads <= 0 {
		opts.Threads = DefaultThreads(path)
	}
	if opts.MaxSeqs <= 0 {
		opts.MaxSeqs = 4
	}
	if opts.BatchSize <= 0 {
		opts.BatchSize = 512
	}
	if opts.WireDType == 0 {
		opts.WireDType = stage.F16
	}
	if opts.KVType == ml.DTypeOther {
		opts.KVType = ml.DTypeF16
	}
	modelCtx, _ := meta.ArchUint("context_length")
	if opts.Context <= 0 {
		opts.Context = int(min(max(modelCtx, 1), 4096))
	}

	gpu, err := pickDevice(path, opts.Device) // backendMu is held
	if err != nil {
		return nil, err
	}
	flash := opts.FlashAttention.on(gpu != nil || (cpuAttention() && opts.KVType == ml.DTypeF16))
	if err := checkKVType(meta, opts.KVType, flash); err != nil {
		return nil, fmt.Errorf("loading %s: %w", path, err)
	}
	fa := ml.FlashAttentionDisabled
	if flash {
		fa = ml.FlashAttentionEnabled
	}
	params := ml.BackendParams{AllocMemory: true, NumThreads: opts.Threads, FlashAttention: fa}
	if gpu != nil {
		// Every layer of the stage, and the output layer (ollama numbers it
		// after the last block), on that device.
		params.GPULayers = gpuLayers(gpu, start, end, layers)
	}
	m, err := model.New(path, params)
	if err != nil {
		if errors.Is(err, model.ErrUnsupportedModel) {
			return nil, fmt.Errorf("loading %s: %w", path, checkArch("unknown"))
		}
		return nil, fmt.Errorf("loading %s: %w", path, err)
	}
	// eng, not the named result: a failed return sets e to nil, and the
	// half-built engine must still be closed.
	eng := &Engine{m: m, backend: m.Backend(), cache: m.Config().Cache, batch: opts.BatchSize}
	e = eng
	defer func() {
		if err != nil {
			eng.close() // backendMu is held
		}
	}()
	if err := fixRopeBase(m, meta); err != nil {
		return nil, fmt.Errorf("loading %s: %w", path, err)
	}
	eps, _ := meta.Get(meta.Arch() + ".attention.layer_norm_rms_epsilon")
	epsf, _ := eps.V.(float32)
	if e.arch, err = newAdapter(m, epsf); err != nil {
		return nil, err
	}
	for _, name := range e.arch.required(start, end, layers) {
		if e.backend.Get(name) == nil {
			return nil, fmt.Errorf("%w: %s has no tensor %s, needed for layers [%d,%d)", gguf.ErrFormat, path, name, start, end)
		}
	}
	if e.weights, e.extra, err = loadWeights(e.backend, path, meta, end == layers, !opts.NoRepack); err != nil {
		return nil, err
	}
	if e.cache == nil {
		return nil, fmt.Errorf("model %s has no KV cache", meta.Arch())
	}
	// Init takes the context of one sequence: it allocates MaxSeqs of them.
	e.cache.Init(e.backend, opts.KVType, opts.MaxSeqs, opts.Context, opts.BatchSize)

	vocab := 0
	if v, ok := meta.Get("tokenizer.ggml.tokens"); ok {
		if s, ok := v.V.([]string); ok {
			vocab = len(s)
		}
	}
	if out, ok := meta.Tensor("output.weight"); ok {
		vocab = int(out.Shape[1])
	} else if emb, ok := meta.Tensor("token_embd.weight"); ok {
		vocab = int(emb.Shape[1])
	}
	embd, _ := meta.ArchUint("embedding_length")
	e.info = stage.Info{
		Arch: meta.Arch(), Layers: layers, Embd: int(embd), Vocab: vocab,
		Start: start, End: end, Context: opts.Context, MaxSeqs: opts.MaxSeqs,
		WireDType: opts.WireDType, Engine: "ggml", Backend: "CPU",
	}
	if gpu != nil {
		e.info.Backend = gpu.Library
	}
	e.buildsAhead = opts.BuildAhead.on(gpu != nil)
	if s := schedOf(e.backend); directSched && s != nil {
		e.lanes = []*lane{{sched: s}}
		e.decodeGraphs = opts.DecodeGraphs.on(false)
	}
	switch {
	case gpu != nil && strings.EqualFold(gpu.Library, "CUDA") && opts.FusedDecode.on(true):
		f, err := newFused(e, meta, flash, opts.KVType)
		switch {
		case err == nil:
			// One-row decode passes build no ggml graph to build ahead.
			e.fused, e.buildsAhead = f, false
		case opts.FusedDecode == On:
			return nil, fmt.Errorf("loading %s: %w", path, err)
		default:
			e.fusedWhy = strings.TrimPrefix(err.Error(), errFusedUnavailable.Error()+": ")
		}
	case opts.FusedDecode == On:
		return nil, fmt.Errorf("loading %s: %w: it runs on CUDA devices only", path, errFusedUnavailable)
	}
	e.slots = make(map[stage.SeqID]int)
	for i := opts.MaxSeqs - 1; i >= 0; i-- {
		e.free = append(e.free, i)
	}
	return e, nil
}

// checkKVType rejects the KV cache types ggml would abort on (a C abort,
// which no recover catches): a quantized cache needs flash attention and
// whole 32-element blocks per head.
func checkKVType(meta *gguf.File, kv ml.DType, flash bool) error {
	switch kv {
	case ml.DTypeF16, ml.DTypeF32:
		return nil
	case ml.DTypeQ80, ml.DTypeQ40:
	default:
		return fmt.Errorf("KV cache type %v is not supported (f16, f32, q8_0, q4_0)", kv)
	}
	if !flash {
		return fmt.Errorf("a quantized KV cache (%v) needs flash attention", kv)
	}
	mi, err := infoOf(meta)
	if err != nil {
		return err
	}
	if mi.HeadDim%32 != 0 {
		return fmt.Errorf("a quantized KV cache (%v) needs a head dimension that is a multiple of 32; this model's is %d", kv, mi.HeadDim)
	}
	return nil
}

func readHeader(path string) (*gguf.File, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, fmt.Errorf("opening model: %w", err)
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, fmt.Errorf("opening model: %w", err)
	}
	switch {
	case st.IsDir():
		return nil, fmt.Errorf("opening model: %s is a directory, not a GGUF file", path)
	case st.Size() == 0:
		return nil, fmt.Errorf("reading %s: %w: the file is empty, not a GGUF file", path, gguf.ErrFormat)
	}
	meta, err := gguf.Read(f, st.Size())
	if err != nil {
		return nil, fmt.Errorf("reading %s: %w", path, err)
	}
	return meta, nil
}

// backendMu guards ggml's process-wide state against backend creation and
// teardown: ollama's ggml backend is not safe to create or free while
// another backend of the process computes (a load during a forward pass
// corrupted the running engine: SIGSEGV in ggml_backend_tensor_set, or
// GGML_ASSERT memset_tensor != NULL), and a mesh node loads its next
// layer range while it still serves the old one. Open, Close, OpenStock
// and Devices hold it exclusively; engine calls share it.
var backendMu sync.RWMutex

// computeMu serializes graph compute across every engine in the process:
// ollama creates one ggml CPU backend per device for the whole process and
// all models share it, work buffer included, so two graphs computing at
// once on it corrupt each other's results.
var computeMu sync.Mutex

// passTimes is where one pass's time went, outside building its graph.
type passTimes struct{ alloc, launch, wait time.Duration }

// compute runs p's graph and reads its result back. While a GPU computes,
// between runs on the host. The floats are a buffer from e.reads that
// free returns, or (free nil) the caller's to keep.
func (e *Engine) compute(p *pass, rows int, between func(), t *passTimes) (floats []float32, free func(), err error) {
	computeMu.Lock()
	defer computeMu.Unlock()
	if !p.direct {
		start := time.Now()
		p.gctx.Compute(p.out)
		t.launch = time.Since(start)
		between()
		start = time.Now()
		floats = p.out.Floats()
		t.wait = time.Since(start)
		return floats, nil, nil
	}
	start := time.Now()
	l := e.lanes[p.lane]
	if l.allocated == p {
		e.phases.allocated.Add(1)
	} else if err := e.place(p); err != nil {
		l.allocated = nil
		return nil, nil, err
	}
	l.allocated = nil
	t.alloc = time.Since(start)
	start = time.Now()
	if err := p.sg.launch(); err != nil {
		return nil, nil, err
	}
	t.launch = time.Since(start)
	between()
	start = time.Now()
	var dst []float32
	switch {
	case p.last:
		dst, free = e.reads.get(len(p.outputs) * e.info.Vocab)
	case !e.info.Last():
		// Lent to the caller, who sends it on (a hop of sixteen rows
		// of an 8B model is 256 KiB) and gives it back.
		dst, free = e.reads.get(rows * e.info.Embd)
	}
	err = p.sg.read(p.out, dst)
	t.wait = time.Since(start)
	if err != nil {
		if free != nil {
			free()
		}
		return nil, nil, err
	}
	return dst, free, nil
}

// recoverErr turns a panic from ggml or ollama into an error: ggml reports
// failures (out of memory, bad shapes) by panicking.
func recoverErr(err *error, doing string) {
	if r := recover(); r != nil {
		*err = panicError(doing, r)
	}
}

// panicError is the error of a recovered panic r, with the stack.
func panicError(doing string, r any) error {
	return fmt.Errorf("%s: engine panic: %v\n%s", doing, r, debug.Stack())
}

// Info describes the stage.
func (e *Engine) Info() stage.Info { return e.info }

// WeightBytes is the memory ggml allocated for this stage's weights.
func (e *Engine) WeightBytes() uint64 { return e.weights }

// settleFused ends a fused pass queued ahead that no caller took (see
// aheadPass), before anything else touches the cache or the GPU.
func (e *Engine) settleFused() error {
	if e.fused == nil {
		return nil
	}
	return e.fused.settle()
}

// Open reserves a cache slot for seq.
func (e *Engine) Open(seq stage.SeqID) error {
	backendMu.RLock()
	defer backendMu.RUnlock()
	e.mu.Lock()
	defer e.mu.Unlock()
	if err := e.usable(); err != nil {
		return err
	}
	if _, ok := e.slots[seq]; ok {
		return fmt.Errorf("%w: %d", stage.ErrSeqExists, seq)
	}
	if len(e.free) == 0 {
		return fmt.Errorf("%w (%d sequences open)", stage.ErrNoSlot, len(e.slots))
	}
	slot := e.free[len(e.free)-1]
	e.free = e.free[:len(e.free)-1]
	e.slots[seq] = slot
	return nil
}

// Trim drops seq's cached positions >= pos.
func (e *Engine) Trim(seq stage.SeqID, pos int32) (err error) {
	backendMu.RLock()
	defer backendMu.RUnlock()
	e.mu.Lock()
	defer e.mu.Unlock()
	if err := e.usable(); err != nil {
		return err
	}
	defer e.breakOnPanic(&err, "trimming cache")
	if err := e.settleFused(); err != nil {
		return err
	}
	e.unallocate()
	e.dropAheadOf(seq)
	slot, ok := e.slots[seq]
	if !ok {
		return fmt.Errorf("%w: %d", stage.ErrUnknownSeq, seq)
	}
	return e.cache.Remove(slot, max(pos, 0), math.MaxInt32)
}

// Release frees seq's slot and its cache.
func (e *Engine) Release(seq stage.SeqID) (err error) {
	backendMu.RLock()
	defer backendMu.RUnlock()
	e.mu.Lock()
	defer e.mu.Unlock()
	if err := e.usable(); err != nil {
		return err
	}
	defer e.breakOnPanic(&err, "releasing cache")
	if err := e.settleFused(); err != nil {
		return err
	}
	e.unallocate()
	e.dropAheadOf(seq)
	slot, ok := e.slots[seq]
	if !ok {
		return fmt.Errorf("%w: %d", stage.ErrUnknownSeq, seq)
	}
	delete(e.slots, seq)
	e.free = append(e.free, slot)
	return e.cache.Remove(slot, 0, math.MaxInt32)
}

// bytesPerThread is how much of a stage's file (its weights) earns a CPU
// thread, up to every core. ggml's threads meet at a barrier after every
// op, which for a small model costs more than the work, the more so when
// the node's HTTP and scheduling goroutines want the same cores: on a
// 2-core machine a one-stage mesh decoded stories260K (1.2 MB) at 2457
// tok/s on one thread and at 219-553 on two, while a 1B Q4_0 (609 MB)
// decodes at 16.7 tok/s on one and 31.7 on two.
const bytesPerThread = 32 << 20

// DefaultThreads is the thread count a stage of the GGUF file at path gets
// when Options.Threads is 0: a thread per bytesPerThread of the file, up to
// every core (every core if the file cannot be read).
func DefaultThreads(path string) int {
	st, err := os.Stat(path)
	if err != nil {
		return runtime.NumCPU()
	}
	return defaultThreads(st.Size(), runtime.NumCPU())
}

// defaultThreads is a stage's thread count for a file of size bytes on a
// machine of cores cores.
func defaultThreads(size int64, cores int) int {
	return int(max(1, min(int64(cores), size/bytesPerThread)))
}

// Forward runs the batch through the stage's layers.
func (e *Engine) Forward(ctx context.Context, b *stage.Batch) (out *stage.Output, err error) {
	hidden, err := stage.Prepare(ctx, b, e.info, e.batch)
	if err != nil {
		return nil, err
	}

	backendMu.RLock()
	defer backendMu.RUnlock()
	e.mu.Lock()
	defer e.mu.Unlock()
	if err := e.usable(); err != nil {
		return nil, err
	}
	defer e.breakOnPanic(&err, "forward pass")
	if testPanic != nil {
		testPanic()
	}

	slots, err := e.slotsOf(b)
	if err != nil {
		return nil, err
	}

	if e.fused != nil && fusedTakes(b, slots, e.info.Last()) {
		if out, ok, err := e.fused.step(b, slots, hidden); ok {
			return out, err
		}
	} else if err := e.settleFused(); err != nil {
		return nil, err
	}

	start := time.Now()
	var t passTimes
	p := e.takeAhead(b, slots)
	if p == nil {
		if p, err = e.build(b.Seqs, b.Pos, slots, b.Outputs, e.laneFor(b, slots)); err != nil {
			return nil, fmt.Errorf("placing batch in the KV cache: %w", err)
		}
	}
	defer func() {
		p.gctx.Close()
		e.phases.graph.Add(int64(time.Since(start) - t.alloc - t.launch - t.wait))
		e.phases.passes.Add(1)
	}()
	p.fill(b.Tokens, hidden)
	n, last := b.Rows(), p.last
	floats, free, err := e.compute(p, n, func() { e.buildAhead(b, slots, p.lane) }, &t)
	e.phases.alloc.Add(int64(t.alloc))
	e.phases.launch.Add(int64(t.launch))
	e.phases.wait.Add(int64(t.wait))
	if err != nil {
		return nil, fmt.Errorf("forward pass: %w", err)
	}
	e.kickAllocAhead()

	out = &stage.Output{}
	switch {
	case last:
		if len(floats) != len(b.Outputs)*e.info.Vocab {
			return nil, fmt.Errorf("stage: head produced %d logits, want %d×%d", len(floats), len(b.Outputs), e.info.Vocab)
		}
		out.Logits, out.Free = floats, free
	case e.info.Last():
		// A prefill chunk with no output rows: the cache is filled, nothing to return.
	default:
		if out.Hidden, err = stage.SharedActivation(n, e.info.Embd, floats); err != nil {
			if free != nil {
				free()
			}
			return nil, err
		}
		out.Free = free
	}
	return out, nil
}

// slotsOf is the cache slot of each row of b's sequence; e.mu is held.
func (e *Engine) slotsOf(b *stage.Batch) ([]int, error) {
	slots := make([]int, b.Rows())
	for r, s := range b.Seqs {
		slot, ok := e.slots[s]
		if !ok {
			return nil, fmt.Errorf("%w: %d (row %d)", stage.ErrUnknownSeq, s, r)
		}
		slots[r] = slot
	}
	return slots, nil
}

// Close frees the engine's memory.
func (e *Engine) Close() error {
	backendMu.Lock()
	err := e.close()
	backendMu.Unlock()
	e.prep.Wait()
	return err
}

func (e *Engine) close() (err error) {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return nil
	}
	e.closed = true
	defer recoverErr(&err, "closing engine")
	e.unallocate()
	for _, p := range e.ahead {
		p.gctx.Close()
	}
	e.ahead = nil
	for _, l := range e.lanes {
		l.clone.free()
	}
	e.lanes = nil
	if e.fused != nil {
		_ = e.fused.settle()
		e.fused.close()
		e.fused = nil
	}
	if e.cache != nil {
		e.cache.Close()
	}
	if e.backend != nil {
		e.backend.Close()
	}
	if e.extra != nil {
		e.extra.Close()
	}
	return nil
}
