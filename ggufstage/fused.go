package ggufstage

// The fused CUDA decode path (cuda/fused.h): a stage on an NVIDIA GPU whose
// llama or qwen2 layers are Q4_0 runs decode passes (one token of each of
// up to eight sequences at once) through meshnode's own kernels, as a CUDA
// graph replayed every token, instead of a ggml graph built and captured
// anew each token. It reads the weights ggml loaded and writes the same KV
// cache cells ollama's cache hands out, so ggml passes (prefill) and fused
// ones mix freely on one cache.

import (
	"errors"
	"fmt"
	"os"
	"reflect"
	"slices"
	"strconv"
	"strings"
	"unsafe"

	fsggml "github.com/ollama/ollama/fs/ggml"
	"github.com/ollama/ollama/kvcache"
	"github.com/ollama/ollama/ml"

	"github.com/meshnode/meshnode/ggufstage/gguf"
	"github.com/meshnode/meshnode/stage"
)

// fusedPath runs decode passes: each row one token of its own sequence,
// slots[r] its cache slot. step reports ok false, with no change made, when
// it cannot take this pass (the cache has not been written through ggml
// yet, or the pass has more rows than the kernels take); the caller then
// runs it through ggml.
// settle ends any pass queued ahead of its caller that the caller did not
// take (see aheadPass): the engine calls it before anything else touches
// the cache or the GPU.
type fusedPath interface {
	step(b *stage.Batch, slots []int, hidden []float32) (out *stage.Output, ok bool, err error)
	settle() error
	close()
}

// aheadPass is a greedy pass queued ahead of its caller on a stage with both
// the embedding and the head (cuda/fused.h mf_queue_picks): the next
// step of the same rows, each row's token the pick of the pass before it,
// which the GPU takes from the pass before with no host in between. Its
// cache cells are placed when it is queued; if the caller asks for
// anything else, the pass is waited for and its cells freed (settle).
type aheadPass struct {
	slots []int   // the rows' cache slots, in order
	pos   []int32 // each row's position
	after []int32 // each row's token: the picks of the pass before, once the host has them
}

// continuedBy says whether batch b, whose rows use cache slots slots, is the
// pass p queued ahead: greedy, the same slots in the same order, each row
// at p's position, and each token the pick the queued pass took for it.
func (p *aheadPass) continuedBy(b *stage.Batch, slots []int) bool {
	if !b.PicksOnly || len(slots) != len(p.slots) || len(b.Tokens) != len(slots) || len(b.Pos) != len(slots) ||
		len(p.after) != len(slots) {
		return false
	}
	for r := range slots {
		if slots[r] != p.slots[r] || b.Pos[r] != p.pos[r] || b.Tokens[r] != p.after[r] {
			return false
		}
	}
	return true
}

// aheadAction is what a fused stage does with a batch (see aheadPlan).
type aheadAction int

const (
	aheadStep  aheadAction = iota // run it as one step, queueing nothing ahead
	aheadTake                     // it is the pass queued ahead: take that, and queue the next
	aheadQueue                    // queue it and the pass after it
)

// aheadPlan decides what a fused stage does with batch b (its rows in cache
// slots slots), given the pass queued ahead (pending, or nil) and the
// continuation of the last greedy pass it ran (last, or nil, which settle
// clears); eligible says whether b may be queued at all (greedy, one
// pass, a stage that queues). settle says to wait for pending and free its
// cells first. A stage queues ahead only from the second pass of a run of
// continuations: batches that take turns (micro-batches of a pipeline, a
// prompt's chunks between decode steps) would otherwise each leave a
// queued pass that nobody takes, a pass of GPU time lost every step.
func aheadPlan(pending, last *aheadPass, b *stage.Batch, slots []int, eligible bool) (act aheadAction, settle bool) {
	switch {
	case pending != nil && eligible && pending.continuedBy(b, slots):
		return aheadTake, false
	case pending != nil:
		return aheadStep, true
	case eligible && last != nil && last.continuedBy(b, slots):
		return aheadQueue, false
	}
	return aheadStep, false
}

// aheadEnabled is MESHNODE_FUSED_AHEAD: 0 turns queueing ahead off.
func aheadEnabled() bool { return os.Getenv("MESHNODE_FUSED_AHEAD") != "0" }

// fusedTakes says whether the fused path can run batch b, whose rows use
// cache slots slots: a decode pass, each row a token of a sequence of its
// own, and on the last stage logits for every row. The answer depends on
// the batch alone, so every stage of a mesh answers alike.
func fusedTakes(b *stage.Batch, slots []int, last bool) bool {
	if last && len(b.Outputs) != b.Rows() {
		return false // Outputs are ascending indices: all rows
	}
	for r, s := range slots {
		if slices.Contains(slots[:r], s) {
			return false
		}
	}
	return true
}

// fusedPassLimit is the most fused passes one batch takes; larger batches
// run on ggml. MESHNODE_FUSED_PASSES (a count from 1 to 64) sets it for
// experiments. A batch takes up to 32 rows in fused passes. On an H200 the
// 8B model at 32 streams decoded at 2322 tok/s in four passes of eight
// against ggml's 1694 (run 91), at 3331 in two of sixteen (run 124); the
// 32B model at 883 in two of sixteen against ggml's 785 (run 124). But a
// model wider than n_embd 4096 (embd) whose passes take only eight rows
// (maxRows) takes 16 rows: four passes of eight of the 32B model lost to
// ggml's pass of 32 (659 against 743 tok/s, run 108), whose larger
// matrices keep its kernels busier. Passes of fewer than eight rows take
// two: four of four rows lost to ggml's pass of 16 (665 against 807 tok/s,
// the 32B model pipelined on two GPUs).
func fusedPassLimit(maxRows, embd int) int {
	if n, err := strconv.Atoi(os.Getenv("MESHNODE_FUSED_PASSES")); err == nil && n >= 1 && n <= 64 {
		return n
	}
	if maxRows < 8 {
		return 2
	}
	rows := 32
	if embd > 4096 && maxRows < 16 {
		rows = 16
	}
	return max(1, rows/maxRows)
}

// fusedPassSizes splits a batch of n rows into fused passes of at most
// maxRows rows each, as even as they can be, or returns nil where ggml
// should run it: more than passes passes, or several rows where a pass
// takes one (one-row steps lose to ggml's pass of several).
func fusedPassSizes(n, maxRows, passes int) []int {
	if n < 1 || maxRows < 1 || n > passes*maxRows || (n > 1 && maxRows < 2) {
		return nil
	}
	k := (n + maxRows - 1) / maxRows
	sizes := make([]int, k)
	for i := range sizes {
		sizes[i] = n / k
		if i < n%k {
			sizes[i]++
		}
	}
	return sizes
}

// errFusedUnavailable wraps every reason the fused path cannot run a stage.
var errFusedUnavailable = errors.New("fused CUDA decode path unavailable")

// fusedShape is what the fused path needs to know of a stage's model,
// read from the GGUF header.
type fusedShape struct {
	embd, heads, kvHeads, headDim, ffn int
	eps, ropeBase, ropeScale           float32
	embdType, outType                  uint32
	neox                               bool // qwen2 rotates dimensions i and i+headDim/2
	qkvBias                            bool // q, k and v have biases (qwen2)
}

// fusedEligible says why the fused path cannot run a stage of the model
// meta is (a slice of), or returns the shape it needs. The answer is the
// same for every stage of one model.
func fusedEligible(meta *gguf.File, flash bool, kv ml.DType) (fusedShape, error) {
	var s fusedShape
	fail := func(format string, args ...any) (fusedShape, error) {
		return s, fmt.Errorf("%w: %s", errFusedUnavailable, fmt.Sprintf(format, args...))
	}
	// qwen2 is llama with q, k and v biases and NeoX rotation.
	switch meta.Arch() {
	case "llama":
	case "qwen2":
		s.neox = true
	default:
		return fail("architecture %s (llama and qwen2 only)", meta.Arch())
	}
	if !flash {
		return fail("flash attention is off (the path reads ggml's unpermuted V cache)")
	}
	if kv != ml.DTypeF16 {
		return fail("KV cache type %v (f16 only)", kv)
	}
	u := func(key string) int {
		v, _ := meta.ArchUint(key)
		return int(v)
	}
	s.embd, s.heads, s.kvHeads, s.ffn = u("embedding_length"), u("attention.head_count"), u("attention.head_count_kv"), u("feed_forward_length")
	if s.kvHeads == 0 {
		s.kvHeads = s.heads
	}
	if s.heads == 0 {
		return fail("no head count")
	}
	s.headDim = s.embd / s.heads
	if k := u("attention.key_length"); k != 0 && k != s.headDim {
		return fail("head size %d is not embedding/heads", k)
	}
	if r := u("rope.dimension_count"); r != 0 && r != s.headDim {
		return fail("rope over %d of %d dimensions", r, s.headDim)
	}
	f := func(key string, def float32) float32 {
		if v, ok := meta.Get(meta.Arch() + "." + key); ok {
			if x, ok := v.V.(float32); ok {
				return x
			}
		}
		return def
	}
	s.eps = f("attention.layer_norm_rms_epsilon", 1e-5)
	s.ropeBase = f("rope.freq_base", defaultRopeBase)
	s.ropeScale = f("rope.scaling.factor", 1)
	// Every stage of a mesh must choose alike, or a split would not decode
	// as the whole model does: each judges the whole model's tensor types
	// (a slice carries them), never only the tensors it holds. A last
	// stage of a tied model, say, holds the embedding as its output head.
	types, err := modelTypes(meta)
	if err != nil {
		return fail("%v", err)
	}
	only := func(kind string, want ...fsggml.TensorType) (fsggml.TensorType, error) {
		ts := types[kind]
		if len(ts) != 1 || !slices.Contains(want, ts[0]) {
			if len(ts) == 0 {
				return 0, fmt.Errorf("%w: the model has no %s", errFusedUnavailable, kind)
			}
			return 0, fmt.Errorf("%w: %s is %v (%v only)", errFusedUnavailable, kind, ts, want)
		}
		return ts[0], nil
	}
	if _, ok := types["rope_freqs.weight"]; ok {
		return fail("rope frequency factors")
	}
	biases := 0
	for _, n := range []string{"attn_q.bias", "attn_k.bias", "attn_v.bias"} {
		if _, ok := types[n]; ok {
			if _, err := only(n, fsggml.TensorTypeF32); err != nil {
				return s, err
			}
			biases++
		}
	}
	if biases != 0 && biases != 3 {
		return fail("biases on some of q, k and v, not all")
	}
	s.qkvBias = biases == 3
	if _, ok := types["attn_output.bias"]; ok {
		return fail("an attention output bias")
	}
	for _, n := range []string{"attn_q", "attn_k", "attn_v", "attn_output", "ffn_gate", "ffn_up", "ffn_down"} {
		if _, err := only(n+".weight", fsggml.TensorTypeQ4_0); err != nil {
			return s, err
		}
	}
	for _, n := range []string{"attn_norm.weight", "ffn_norm.weight", "output_norm.weight"} {
		if _, err := only(n, fsggml.TensorTypeF32); err != nil {
			return s, err
		}
	}
	et, err := only("token_embd.weight", fsggml.TensorTypeF32, fsggml.TensorTypeF16, fsggml.TensorTypeQ4_0, fsggml.TensorTypeQ6_K)
	if err != nil {
		return s, err
	}
	if _, ok := types["output.weight"]; !ok {
		return fail("a tied output head")
	}
	ot, err := only("output.weight", fsggml.TensorTypeQ4_0, fsggml.TensorTypeQ6_K)
	if err != nil {
		return s, err
	}
	if ot == fsggml.TensorTypeQ6_K && s.embd%512 != 0 {
		// The kernel copies a row's Q6_K super-blocks (210 bytes) to shared
		// memory in pieces of 16, 8 or 4 bytes: an even number of them.
		return fail("a Q6_K output head needs an embedding size that is a multiple of 512, not %d", s.embd)
	}
	s.embdType, s.outType = uint32(et), uint32(ot)
	return s, nil
}

// modelTypes returns the tensor types of the whole model meta belongs to,
// by kind (gguf.ModelTypes).
func modelTypes(meta *gguf.File) (map[string][]fsggml.TensorType, error) {
	if _, slice := meta.Get(gguf.KeySliceStart); slice {
		if _, ok := meta.Get(gguf.KeySliceTypes); !ok {
			return nil, errors.New("the slice was cut by an older meshnode and does not say what the whole model holds: remove it (the data folder's slices) to have it cut again")
		}
	}
	out := map[string][]fsggml.TensorType{}
	for _, e := range gguf.ModelTypes(meta) {
		kind, num, ok := strings.Cut(e, "=")
		t, err := strconv.ParseUint(num, 10, 32)
		if !ok || err != nil {
			return nil, fmt.Errorf("model type entry %q", e)
		}
		out[kind] = append(out[kind], fsggml.TensorType(t))
	}
	return out, nil
}

// causalView reads the bookkeeping of ollama's causal cache, which it does
// not export: which cell holds which position of which sequence, and the
// per-layer K and V tensors. Its layout is fixed by the exact ollama
// version pinned in go.mod; newCausalView checks it.
type causalView struct {
	c      reflect.Value // the *kvcache.Causal's struct
	cells  *[]causalCell
	keys   *map[int]ml.Tensor
	values *map[int]ml.Tensor
	ranges reflect.Value // cellRanges, settable: map[int]cellRange{min, max int}

	lo, hi []int     // rowsCells': each row's cell range, reused
	byRow  [][]int32 // rowsCells': each row's cells, reused
	rowOf  []int32   // rowsCells': 1 + the row of each slot in the pass, 0 for none; all 0 between calls
}

type causalCell struct {
	pos       int32
	sequences []int
}

func newCausalView(cache kvcache.Cache) (*causalView, error) {
	c, ok := cache.(*kvcache.Causal)
	if !ok {
		return nil, fmt.Errorf("%w: cache is a %T, not ollama's causal cache", errFusedUnavailable, cache)
	}
	v := reflect.ValueOf(c).Elem()
	cells, keys, values := v.FieldByName("cells"), v.FieldByName("keys"), v.FieldByName("values")
	if !cells.IsValid() || !keys.IsValid() || !values.IsValid() || !v.FieldByName("cellRanges").IsValid() {
		return nil, fmt.Errorf("%w: ollama's causal cache has changed shape", errFusedUnavailable)
	}
	ranges := v.FieldByName("cellRanges")
	if rt := ranges.Type(); rt.Kind() != reflect.Map || rt.Key().Kind() != reflect.Int || rt.Elem().Kind() != reflect.Struct ||
		rt.Elem().NumField() != 2 || rt.Elem().Field(0).Name != "min" || rt.Elem().Field(1).Name != "max" ||
		rt.Elem().Field(0).Type.Kind() != reflect.Int || rt.Elem().Field(1).Type.Kind() != reflect.Int {
		return nil, fmt.Errorf("%w: ollama's cache cell ranges have changed shape", errFusedUnavailable)
	}
	et := cells.Type().Elem()
	var probe causalCell
	if cells.Kind() != reflect.Slice || et.NumField() != 2 || et.Size() != unsafe.Sizeof(probe) ||
		et.Field(0).Type != reflect.TypeOf(probe.pos) || et.Field(0).Offset != unsafe.Offsetof(probe.pos) ||
		et.Field(1).Type != reflect.TypeOf(probe.sequences) || et.Field(1).Offset != unsafe.Offsetof(probe.sequences) ||
		keys.Type() != reflect.TypeOf(map[int]ml.Tensor(nil)) || values.Type() != keys.Type() {
		return nil, fmt.Errorf("%w: ollama's cache cells have changed shape", errFusedUnavailable)
	}
	return &causalView{
		c:      v,
		cells:  (*[]causalCell)(unsafe.Pointer(cells.UnsafeAddr())),
		keys:   (*map[int]ml.Tensor)(unsafe.Pointer(keys.UnsafeAddr())),
		values: (*map[int]ml.Tensor)(unsafe.Pointer(values.UnsafeAddr())),
		ranges: reflect.NewAt(ranges.Type(), unsafe.Pointer(ranges.UnsafeAddr())).Elem(),
	}, nil
}

// placeRows places each row of a pass (slot seqs[r] at position pos[r])
// in the first free cell in turn, as the cache's StartForward does for a
// batch of one row after another, with one look over the cells instead of
// one a row (a cache of 32 sequences of a few hundred tokens has thousands
// of cells before the first free one). StartForward also builds the
// inputs of a ggml graph (the cell indexes and the attention mask, in
// buffers of their own) that a fused step does not use: that costs tens
// of microseconds a step, and a step is a millisecond. The cache must have
// no sliding window (llama's and qwen2's have none). It appends the cells
// to locs. A cache without room for every row places none.
func (v *causalView) placeRows(seqs []int, pos []int32, locs []int) ([]int, error) {
	cells := *v.cells
	start := len(locs)
	for i := 0; i < len(cells) && len(locs)-start < len(seqs); i++ {
		if len(cells[i].sequences) == 0 {
			locs = append(locs, i)
		}
	}
	if len(locs)-start < len(seqs) {
		return locs[:start], fmt.Errorf("%w (cache: %d cells, batch: %d)", kvcache.ErrKvCacheFull, len(cells), len(seqs))
	}
	for r, loc := range locs[start:] {
		seq := seqs[r]
		cells[loc] = causalCell{pos: pos[r], sequences: []int{seq}}
		key := reflect.ValueOf(seq)
		rng := reflect.New(v.ranges.Type().Elem()).Elem()
		lo, hi := loc, loc
		if old := v.ranges.MapIndex(key); old.IsValid() {
			lo, hi = min(lo, int(old.Field(0).Int())), max(hi, int(old.Field(1).Int()))
		}
		reflect.NewAt(rng.Field(0).Type(), unsafe.Pointer(rng.Field(0).UnsafeAddr())).Elem().SetInt(int64(lo))
		reflect.NewAt(rng.Field(1).Type(), unsafe.Pointer(rng.Field(1).UnsafeAddr())).Elem().SetInt(int64(hi))
		v.ranges.SetMapIndex(key, rng)
	}
	return locs, nil
}

// layerKV returns layer i's K and V tensors, or nils before ggml has
// written the layer (the cache makes them on first use).
func (v *causalView) layerKV(i int) (k, val ml.Tensor) {
	return (*v.keys)[i], (*v.values)[i]
}

// rowsCells appends to into the cells that each row of a pass (slot
// seqs[r], the slots differing, at position pos[r]) attends to besides its
// own: those its slot holds at positions before pos[r], ascending, one row
// after another; and each row's count to counts. It looks over
// the cells once, not once a row: with many sequences in the cache, each
// sequence's cells spread over most of it. A cell's sequences lead to
// their rows through rowOf, so that a cell costs the same at one row and
// at eight (BenchmarkRowsCells, eight rows among 3200 cells: 78 -> 14 us).
func (v *causalView) rowsCells(seqs []int, pos []int32, into []int32, counts []int) ([]int32, []int, error) {
	cells := *v.cells
	if cap(v.lo) < len(seqs) {
		v.lo, v.hi, v.byRow = make([]int, len(seqs)), make([]int, len(seqs)), make([][]int32, len(seqs))
	}
	lo, hi, byRow := v.lo[:len(seqs)], v.hi[:len(seqs)], v.byRow[:len(seqs)]
	last := -1 // the largest slot
	for _, seq := range seqs {
		if seq < 0 {
			return into, counts, fmt.Errorf("cache slot %d in a pass", seq)
		}
		last = max(last, seq)
	}
	if len(v.rowOf) <= last {
		v.rowOf = append(v.rowOf, make([]int32, last+1-len(v.rowOf))...)
	}
	rowOf := v.rowOf
	defer func() {
		for _, seq := range seqs {
			rowOf[seq] = 0
		}
	}()
	for r, seq := range seqs {
		if rowOf[seq] != 0 {
			return into, counts, fmt.Errorf("cache slot %d twice in a pass", seq)
		}
		rowOf[seq] = int32(r + 1)
	}
	from, to := len(cells), -1
	for r, seq := range seqs {
		rng := v.ranges.MapIndex(reflect.ValueOf(seq))
		if !rng.IsValid() {
			return into, counts, fmt.Errorf("cache slot %d holds no cells", seq)
		}
		lo[r], hi[r] = int(rng.Field(0).Int()), int(rng.Field(1).Int())
		if lo[r] < 0 || hi[r] >= len(cells) || lo[r] > hi[r] {
			return into, counts, fmt.Errorf("cache slot %d has cell range [%d,%d] outside %d cells", seq, lo[r], hi[r], len(cells))
		}
		from, to = min(from, lo[r]), max(to, hi[r])
		byRow[r] = byRow[r][:0]
	}
	for i := from; i <= to; i++ {
		c := &cells[i]
		for _, seq := range c.sequences {
			if seq < 0 || seq > last {
				continue
			}
			if r := rowOf[seq] - 1; r >= 0 && i >= lo[r] && i <= hi[r] && c.pos < pos[r] {
				byRow[r] = append(byRow[r], int32(i))
			}
		}
	}
	for r := range seqs {
		into, counts = append(into, byRow[r]...), append(counts, len(byRow[r]))
	}
	return into, counts, nil
}
