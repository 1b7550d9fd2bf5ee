package ggufstage

import (
	"context"
	"fmt"
	"math"

	"github.com/ollama/ollama/ml"
	"github.com/ollama/ollama/model"
	"github.com/ollama/ollama/model/input"

	"github.com/meshnode/meshnode/stage"
)

// Stock runs a whole model exactly as ollama's own runner does: ollama's
// loader, ollama's model.Forward, no slicing and no repacking. It is the
// reference that tests compare the engine against and that `meshnode bench`
// measures the engine against.
type Stock struct {
	m      model.Model
	vocab  int
	slots  map[stage.SeqID]int
	nslots int
}

// OpenStock loads path with ollama's stock path.
func OpenStock(path string, opts Options) (s *Stock, err error) {
	backendMu.Lock()
	defer backendMu.Unlock()
	defer recoverErr(&err, "loading "+path)
	if opts.Threads <= 0 {
		opts.Threads = DefaultThreads(path)
	}
	if opts.MaxSeqs <= 0 {
		opts.MaxSeqs = 4
	}
	if opts.BatchSize <= 0 {
		opts.BatchSize = 512
	}
	if opts.Context <= 0 {
		opts.Context = 2048
	}
	gpu, err := pickDevice(path, opts.Device)
	if err != nil {
		return nil, err
	}
	fa := ml.FlashAttentionDisabled
	if opts.FlashAttention.on(gpu != nil) {
		fa = ml.FlashAttentionEnabled
	}
	params := ml.BackendParams{AllocMemory: true, NumThreads: opts.Threads, FlashAttention: fa}
	if gpu != nil {
		info, err := ReadInfo(path)
		if err != nil {
			return nil, err
		}
		params.GPULayers = gpuLayers(gpu, 0, info.Layers, info.Layers)
	}
	m, err := model.New(path, params)
	if err != nil {
		return nil, fmt.Errorf("loading %s: %w", path, err)
	}
	if err := m.Backend().Load(context.Background(), nil); err != nil {
		m.Backend().Close()
		return nil, fmt.Errorf("loading %s: %w", path, err)
	}
	kv := opts.KVType
	if kv == ml.DTypeOther {
		kv = ml.DTypeF16
	}
	m.Config().Cache.Init(m.Backend(), kv, opts.MaxSeqs, opts.Context, opts.BatchSize) // Context per sequence
	meta, err := readHeader(path)
	if err == nil {
		// The same RoPE default as the engine's: this reference is for
		// speed and for the engine's loop, not for ollama's defaults.
		err = fixRopeBase(m, meta)
	}
	if err != nil {
		m.Backend().Close()
		return nil, fmt.Errorf("loading %s: %w", path, err)
	}
	vocab := 0
	if t, ok := meta.Tensor("output.weight"); ok {
		vocab = int(t.Shape[1])
	} else if t, ok := meta.Tensor("token_embd.weight"); ok {
		vocab = int(t.Shape[1])
	}
	return &Stock{m: m, vocab: vocab, slots: map[stage.SeqID]int{}, nslots: opts.MaxSeqs}, nil
}

// Vocab is the logit width.
func (s *Stock) Vocab() int { return s.vocab }

func (s *Stock) slot(seq stage.SeqID) (int, error) {
	if i, ok := s.slots[seq]; ok {
		return i, nil
	}
	if len(s.slots) >= s.nslots {
		return 0, stage.ErrNoSlot
	}
	used := map[int]bool{}
	for _, i := range s.slots {
		used[i] = true
	}
	for i := range s.nslots {
		if !used[i] {
			s.slots[seq] = i
			return i, nil
		}
	}
	return 0, stage.ErrNoSlot
}

// Forward runs token batch b (Tokens, Seqs, Pos, Outputs) through the whole
// model and returns the logits of the output rows.
func (s *Stock) Forward(b *stage.Batch) (logits []float32, err error) {
	backendMu.RLock()
	defer backendMu.RUnlock()
	defer recoverErr(&err, "stock forward")
	ctx := s.m.Backend().NewContext()
	defer ctx.Close()
	seqs := make([]int, len(b.Seqs))
	for i, q := range b.Seqs {
		if seqs[i], err = s.slot(q); err != nil {
			return nil, err
		}
	}
	outs := make([]int32, len(b.Outputs))
	for i, o := range b.Outputs {
		outs[i] = int32(o)
	}
	batch := input.Batch{
		Inputs:    ctx.Input().FromInts(b.Tokens, len(b.Tokens)),
		Positions: b.Pos,
		Sequences: seqs,
		Outputs:   ctx.Input().FromInts(outs, len(outs)),
	}
	t, err := model.Forward(ctx, s.m, batch)
	if err != nil {
		return nil, err
	}
	computeMu.Lock()
	defer computeMu.Unlock()
	ctx.Compute(t)
	return t.Floats(), nil
}

// Close frees the model.
func (s *Stock) Close() {
	backendMu.Lock()
	defer backendMu.Unlock()
	s.m.Config().Cache.Close()
	s.m.Backend().Close()
}

// Release frees a sequence's cache.
func (s *Stock) Release(seq stage.SeqID) (err error) {
	backendMu.RLock()
	defer backendMu.RUnlock()
	defer recoverErr(&err, "stock release")
	slot, ok := s.slots[seq]
	if !ok {
		return stage.ErrUnknownSeq
	}
	delete(s.slots, seq)
	return s.m.Config().Cache.Remove(slot, 0, math.MaxInt32)
}
