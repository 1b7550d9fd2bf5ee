package scheduler

import (
	"context"
	"fmt"

	"github.com/meshnode/meshnode/node/sample"
	"github.com/meshnode/meshnode/stage"
)

// Local turns an engine that covers every layer into a Pipeline, sampling
// in process as a mesh's last stage would.
func Local(e stage.Engine) Pipeline {
	return &local{e: e, seqs: map[stage.SeqID]*localSeq{}}
}

type local struct {
	e    stage.Engine
	seqs map[stage.SeqID]*localSeq
}

type localSeq struct {
	sampler *sample.Sampler
	history []int32
}

func (l *local) Info() stage.Info { return l.e.Info() }

func (l *local) Open(seq stage.SeqID, p sample.Params, prompt []int32) error {
	if err := l.e.Open(seq); err != nil {
		return err
	}
	l.seqs[seq] = &localSeq{sampler: sample.New(p), history: append([]int32(nil), prompt...)}
	return nil
}

func (l *local) Forward(ctx context.Context, b *stage.Batch) ([]int32, error) {
	out, err := l.e.Forward(ctx, b)
	if err != nil {
		return nil, err
	}
	defer out.Release()
	vocab := l.e.Info().Vocab
	if len(out.Logits) != len(b.Outputs)*vocab {
		return nil, fmt.Errorf("engine returned %d logits for %d rows", len(out.Logits), len(b.Outputs))
	}
	toks := make([]int32, len(b.Outputs))
	seqs := make([]*localSeq, len(b.Outputs))
	ids := make([]stage.SeqID, len(b.Outputs))
	for i, row := range b.Outputs {
		q, ok := l.seqs[b.Seqs[row]]
		if !ok {
			return nil, fmt.Errorf("%w: %d", stage.ErrUnknownSeq, b.Seqs[row])
		}
		seqs[i], ids[i] = q, b.Seqs[row]
	}
	sample.Rows(ids, vocab, func(i int) {
		q := seqs[i]
		toks[i] = q.sampler.Sample(out.Logits[i*vocab:(i+1)*vocab], q.history)
		q.history = append(q.history, toks[i])
	})
	return toks, nil
}

func (l *local) Release(seq stage.SeqID) error {
	delete(l.seqs, seq)
	return l.e.Release(seq)
}
