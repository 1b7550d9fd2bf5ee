// Package stagetest provides stage.Engine wrappers for tests of the code
// that drives engines (the scheduler, the pipeline's stages).
package stagetest

import (
	"context"
	"sync"

	"github.com/meshnode/meshnode/stage"
)

// Picker wraps an engine that answers with logits so that it answers a
// batch asking for greedy picks (stage.Batch.PicksOnly) as the fused CUDA
// path does: with stage.GreedyPick of each output row, plus Shift modulo
// the vocabulary. A Shift of 1 lets a test tell tokens taken from the picks
// from tokens sampled from the logits. It records whether each pass asked,
// and is safe for concurrent use if the engine is.
type Picker struct {
	stage.Engine
	Shift int32

	mu    sync.Mutex
	asked []bool
}

// Forward runs the batch on the wrapped engine and, when the batch asks for
// picks, answers with them instead of the logits.
func (p *Picker) Forward(ctx context.Context, b *stage.Batch) (*stage.Output, error) {
	p.mu.Lock()
	p.asked = append(p.asked, b.PicksOnly)
	p.mu.Unlock()
	out, err := p.Engine.Forward(ctx, b)
	if err != nil || !b.PicksOnly {
		return out, err
	}
	defer out.Release()
	vocab := p.Info().Vocab
	picks := make([]int32, len(b.Outputs))
	for i := range picks {
		picks[i] = (stage.GreedyPick(out.LogitsRow(i, vocab)) + p.Shift) % int32(vocab)
	}
	return &stage.Output{Picks: picks}, nil
}

// Asked returns, for every pass so far, whether it asked for picks.
func (p *Picker) Asked() []bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return append([]bool(nil), p.asked...)
}

// LastAsked says whether the latest pass asked for picks; false if none ran.
func (p *Picker) LastAsked() bool {
	p.mu.Lock()
	defer p.mu.Unlock()
	return len(p.asked) > 0 && p.asked[len(p.asked)-1]
}
