package mlxstage

import (
	"context"
	"errors"
	"fmt"

	"github.com/meshnode/meshnode/mlxstage/ops"
	"github.com/meshnode/meshnode/stage"
)

// group is the rows of one sequence in a batch.
type group struct {
	kvs   []ops.KV
	rows  []int32 // batch rows, in batch order
	start int     // position of the first row = the cache length before
}

// groups splits a batch by sequence and checks that each sequence's rows
// continue its cache: consecutive positions from the cache's length. The
// caches are dense by position, so a row elsewhere is refused (Trim first to
// replay from an earlier position) rather than silently attending to a gap
// or to stale entries.
func (e *Engine) groups(b *stage.Batch) ([]group, error) {
	var gs []group
	index := map[stage.SeqID]int{}
	for r, s := range b.Seqs {
		gi, ok := index[s]
		if !ok {
			kvs, open := e.seqs[s]
			if !open {
				return nil, fmt.Errorf("%w: %d (row %d)", stage.ErrUnknownSeq, s, r)
			}
			gi = len(gs)
			index[s] = gi
			gs = append(gs, group{kvs: kvs, start: kvs[0].Len()})
		}
		g := &gs[gi]
		want := g.start + len(g.rows)
		if int(b.Pos[r]) != want {
			return nil, fmt.Errorf("stage: row %d of sequence %d is at position %d, but the sequence continues at %d (Trim to replay from an earlier position)", r, s, b.Pos[r], want)
		}
		g.rows = append(g.rows, int32(r))
	}
	for _, g := range gs {
		if end := g.start + len(g.rows); end > e.info.Context {
			return nil, fmt.Errorf("stage: sequence would reach position %d, past the context of %d", end, e.info.Context)
		}
	}
	return gs, nil
}

// Forward runs the batch through the stage's layers.
func (e *Engine) Forward(ctx context.Context, b *stage.Batch) (out *stage.Output, err error) {
	hidden, err := stage.Prepare(ctx, b, e.info, e.batch)
	if err != nil {
		return nil, err
	}

	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return nil, errors.New("stage: engine is closed")
	}
	gs, err := e.groups(b)
	if err != nil {
		return nil, err
	}
	// A failed pass may have appended to some caches; put them back so the
	// sequences stay usable.
	defer func() {
		if err != nil {
			for _, g := range gs {
				for _, kv := range g.kvs {
					kv.Trim(g.start)
				}
			}
		}
	}()

	last := e.info.Last() && len(b.Outputs) > 0
	var floats []float32
	ops.Run(e.be, func() { floats, err = e.compute(b, hidden, gs, last) })
	if err != nil {
		return nil, fmt.Errorf("forward pass on %s: %w", e.be.Name(), err)
	}

	out = &stage.Output{}
	switch {
	case last:
		if len(floats) != len(b.Outputs)*e.info.Vocab {
			return nil, fmt.Errorf("stage: head produced %d logits, want %d×%d", len(floats), len(b.Outputs), e.info.Vocab)
		}
		out.Logits = floats
	case e.info.Last():
		// A prefill chunk with no output rows: the caches are filled.
	default:
		if out.Hidden, err = stage.NewActivation(stage.F32, b.Rows(), e.info.Embd, floats); err != nil {
			return nil, err
		}
	}
	return out, nil
}

// compute builds and evaluates the pass: embedding or input, the layers,
// and on the last stage the head over the output rows.
func (e *Engine) compute(b *stage.Batch, hidden []float32, gs []group, last bool) ([]float32, error) {
	c := e.be.NewContext()
	defer c.Close()
	n := b.Rows()
	var h ops.Tensor
	if e.info.First() {
		h = c.Embedding(e.w.embed, b.Tokens)
	} else {
		h = c.Input(hidden, n, e.info.Embd)
	}
	for i := range e.w.layers {
		h = e.block(c, i, h, b.Pos, gs)
	}
	if last {
		if len(b.Outputs) != n {
			idx := make([]int32, len(b.Outputs))
			for i, o := range b.Outputs {
				idx[i] = int32(o)
			}
			h = c.Rows(h, idx)
		}
		h = c.Linear(c.RMSNorm(h, e.w.norm, float32(e.cfg.Eps)), e.w.head, nil)
	}
	// Evaluating the result also fills the caches (MLX evaluates lazily).
	return c.Float32(h)
}

// block is one decoder layer in Hugging Face's llama/qwen2/qwen3 form:
//
//	h += o_proj(attention(rope(q_norm(q_proj(x))), rope(k_norm(k_proj(x))), v_proj(x)))  x = rmsnorm(h)
//	h += down_proj(silu(gate_proj(x)) * up_proj(x))                                        x = rmsnorm(h)
//
// with biases where the config has them and q/k norms only for Qwen3.
func (e *Engine) block(c ops.Context, i int, h ops.Tensor, pos []int32, gs []group) ops.Tensor {
	l := &e.w.layers[i]
	cfg := e.cfg
	eps := float32(cfg.Eps)
	n, H, KV, D := len(pos), cfg.Heads, cfg.KVHeads, cfg.HeadDim

	x := c.RMSNorm(h, l.attnNorm, eps)
	q := c.Linear(x, l.q, l.qb)
	k := c.Linear(x, l.k, l.kb)
	v := c.Linear(x, l.v, l.vb)
	if l.qNorm != nil {
		q = c.Reshape(c.RMSNorm(c.Reshape(q, n*H, D), l.qNorm, eps), n, H*D)
		k = c.Reshape(c.RMSNorm(c.Reshape(k, n*KV, D), l.kNorm, eps), n, KV*D)
	}
	q = c.RoPE(q, pos, D, e.invFreq)
	k = c.RoPE(k, pos, D, e.invFreq)
	a := e.attend(c, i, q, k, v, gs, n)
	h = c.Add(h, c.Linear(a, l.o, l.ob))

	x = c.RMSNorm(h, l.ffnNorm, eps)
	g := c.SiLU(c.Linear(x, l.gate, l.gateB))
	u := c.Linear(x, l.up, l.upB)
	return c.Add(h, c.Linear(c.Mul(g, u), l.down, l.downB))
}

// attend runs attention sequence by sequence, each against its own cache,
// and puts the rows back in batch order.
func (e *Engine) attend(c ops.Context, layer int, q, k, v ops.Tensor, gs []group, n int) ops.Tensor {
	if len(gs) == 1 {
		return c.Attend(gs[0].kvs[layer], q, k, v, e.cfg.Heads, e.scale)
	}
	parts := make([]ops.Tensor, len(gs))
	inv := make([]int32, n) // batch row -> row of the concatenation
	at := int32(0)
	for gi, g := range gs {
		parts[gi] = c.Attend(g.kvs[layer], c.Rows(q, g.rows), c.Rows(k, g.rows), c.Rows(v, g.rows), e.cfg.Heads, e.scale)
		for _, r := range g.rows {
			inv[r] = at
			at++
		}
	}
	return c.Rows(c.Concat(parts...), inv)
}
