package scheduler

import (
	"context"
	"errors"
	"fmt"

	"github.com/meshnode/meshnode/node/sample"
	"github.com/meshnode/meshnode/stage"
)

// Local turns an engine that covers every layer into a Pipeline, sampling
// in process as a mesh's last stage would. vocab gives the token texts
// for sequences whose output must be JSON; nil refuses them.
func Local(e stage.Engine, vocab func() (*sample.Vocab, error)) Pipeline {
	return &local{e: e, vocab: vocab, seqs: map[stage.SeqID]*localSeq{}}
}

type local struct {
	e     stage.Engine
	vocab func() (*sample.Vocab, error)
	seqs  map[stage.SeqID]*localSeq
}

type localSeq struct {
	sampler  *sample.Sampler
	history  []int32
	logprobs int // -1: none; else the alternatives of each token's log-probability
}

func (l *local) Info() stage.Info { return l.e.Info() }

func (l *local) Open(seq stage.SeqID, p sample.Params, prompt []int32) error {
	q := &localSeq{sampler: sample.New(p), history: append([]int32(nil), prompt...), logprobs: -1}
	if p.Logprobs {
		q.logprobs = p.TopLogprobs
	}
	if p.JSON {
		if l.vocab == nil {
			return errors.New("keeping output JSON: no vocabulary")
		}
		v, err := l.vocab()
		if err != nil {
			return fmt.Errorf("keeping output JSON: %w", err)
		}
		schema, err := p.Schema()
		if err != nil {
			return err
		}
		jc, err := sample.NewJSONConstraint(v, schema, prompt[min(p.JSONFrom, len(prompt)):])
		if err != nil {
			return err
		}
		q.sampler.Constrain(jc)
	}
	if err := l.e.Open(seq); err != nil {
		return err
	}
	l.seqs[seq] = q
	return nil
}

func (l *local) Forward(ctx context.Context, b *stage.Batch) (sample.Picked, error) {
	picked := sample.Picked{Tokens: make([]int32, len(b.Outputs))}
	seqs := make([]*localSeq, len(b.Outputs))
	ids := make([]stage.SeqID, len(b.Outputs))
	greedy := true
	for i, row := range b.Outputs {
		q, ok := l.seqs[b.Seqs[row]]
		if !ok {
			return sample.Picked{}, fmt.Errorf("%w: %d", stage.ErrUnknownSeq, b.Seqs[row])
		}
		seqs[i], ids[i] = q, b.Seqs[row]
		if q.logprobs >= 0 && picked.Logprobs == nil {
			picked.Logprobs = make([]sample.Logprob, len(b.Outputs))
		}
		greedy = greedy && q.logprobs < 0 && q.sampler.Greedy()
	}
	b.PicksOnly = greedy && len(b.Outputs) > 0
	out, err := l.e.Forward(ctx, b)
	if err != nil {
		return sample.Picked{}, err
	}
	defer out.Release()
	vocab := l.e.Info().Vocab
	if out.Picks != nil {
		if err := stage.CheckPicks(out.Picks, b, vocab); err != nil {
			return sample.Picked{}, err
		}
		for i, q := range seqs {
			picked.Tokens[i] = out.Picks[i]
			q.history = append(q.history, out.Picks[i])
		}
		return picked, nil
	}
	if len(out.Logits) != len(b.Outputs)*vocab {
		return sample.Picked{}, fmt.Errorf("engine returned %d logits for %d rows", len(out.Logits), len(b.Outputs))
	}
	sample.Rows(ids, vocab, func(i int) {
		q := seqs[i]
		logits := out.Logits[i*vocab : (i+1)*vocab]
		picked.Tokens[i] = q.sampler.Sample(logits, q.history)
		q.history = append(q.history, picked.Tokens[i])
		if q.logprobs >= 0 {
			picked.Logprobs[i] = sample.LogprobOf(logits, picked.Tokens[i], q.logprobs)
		}
	})
	return picked, nil
}

func (l *local) Release(seq stage.SeqID) error {
	delete(l.seqs, seq)
	return l.e.Release(seq)
}
