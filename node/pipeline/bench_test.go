package pipeline

import (
	"context"
	"testing"

	"github.com/meshnode/meshnode/stage"
)

// BenchmarkDecodeStep measures one decode step of one sequence on
// stories260K, whose layers cost microseconds, so what it reports is the
// pipeline's own cost per step: framing, gRPC, goroutine hand-offs. The
// "engine" case is the reference: the same step on one in-process engine.
func BenchmarkDecodeStep(b *testing.B) {
	const seq, promptLen, maxPos = 1, 8, 200
	prompt := make([]int32, promptLen)
	for i := range prompt {
		prompt[i] = int32(1 + i)
	}
	decode := func(pos int32, tok int32) *stage.Batch {
		return &stage.Batch{Seqs: []stage.SeqID{seq}, Pos: []int32{pos}, Tokens: []int32{tok}, Outputs: []int{0}}
	}
	prefill := &stage.Batch{Outputs: []int{promptLen - 1}}
	for i, t := range prompt {
		prefill.Seqs, prefill.Pos, prefill.Tokens = append(prefill.Seqs, seq), append(prefill.Pos, int32(i)), append(prefill.Tokens, t)
	}

	b.Run("engine", func(b *testing.B) {
		e := openEngines(b, []int{0, 5}, engineOpts)[0]
		if err := e.Open(seq); err != nil {
			b.Fatal(err)
		}
		fwd := engineForward(nil, e)
		toks, _, err := fwd(prefill)
		if err != nil {
			b.Fatal(err)
		}
		pos := int32(promptLen)
		b.ResetTimer()
		for range b.N {
			if pos == maxPos {
				if err := e.Trim(seq, promptLen); err != nil {
					b.Fatal(err)
				}
				pos = promptLen
			}
			if toks, _, err = fwd(decode(pos, toks[0])); err != nil {
				b.Fatal(err)
			}
			pos++
		}
	})
	for _, tc := range []struct {
		name   string
		bounds []int
	}{
		{"1stage", []int{0, 5}},
		{"2stages", []int{0, 2, 5}},
		{"3stages", []int{0, 1, 3, 5}},
	} {
		b.Run(tc.name, func(b *testing.B) {
			m := newMesh(b, tc.bounds, engineOpts)
			p := m.pipeline(b, Config{})
			if err := p.Open(seq, greedy(), prompt); err != nil {
				b.Fatal(err)
			}
			toks, err := p.Forward(context.Background(), prefill)
			if err != nil {
				b.Fatal(err)
			}
			pos := int32(promptLen)
			b.ResetTimer()
			for range b.N {
				if pos == maxPos {
					if err := p.Trim(seq, promptLen); err != nil {
						b.Fatal(err)
					}
					pos = promptLen
				}
				if toks, err = p.Forward(context.Background(), decode(pos, toks[0])); err != nil {
					b.Fatal(err)
				}
				pos++
			}
		})
	}
}
