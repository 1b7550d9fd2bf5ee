// Package stage defines the StageEngine contract: a component that owns a
// contiguous range [Start, End) of a model's transformer layers and runs it.
//
// A pipeline is a chain of stages. The first stage turns token ids into
// hidden states (embedding), every stage runs its layers, and the last stage
// applies the output norm and head and returns logits for the rows asked for.
// Between stages only an Activation travels: one n_embd vector per token.
//
// The package is engine-neutral: it imports no engine and no network code.
package stage

import (
	"context"
	"errors"
	"fmt"
	"math"
)

// SeqID names a sequence (one request's token stream) across the whole
// pipeline. Engines map it to their own cache slots.
type SeqID uint64

// Info describes what an engine holds.
type Info struct {
	Arch      string // GGUF/HF architecture name, e.g. "llama", "qwen3"
	Layers    int    // total transformer blocks in the model
	Embd      int    // hidden size (n_embd)
	Vocab     int    // vocabulary size (logit width)
	Start     int    // first layer owned (inclusive)
	End       int    // last layer owned (exclusive)
	Context   int    // max positions per sequence
	MaxSeqs   int    // sequences that can hold KV at once
	WireDType DType  // activation dtype this stage prefers to send/receive
	Engine    string // "ggml", "mlx", "reference"
	Backend   string // device library, e.g. "CPU", "CUDA", "Metal"
}

// First reports whether the stage embeds tokens (owns layer 0).
func (i Info) First() bool { return i.Start == 0 }

// Last reports whether the stage produces logits (owns the final layer).
func (i Info) Last() bool { return i.End == i.Layers }

// Range formats the owned layer range as "[a,b)".
func (i Info) Range() string { return fmt.Sprintf("[%d,%d)", i.Start, i.End) }

// Batch is one forward pass over tokens of possibly many sequences: prefill
// chunks and decode tokens mixed. Row r belongs to sequence Seqs[r] at
// position Pos[r].
type Batch struct {
	Seqs []SeqID
	Pos  []int32

	// Tokens holds one token id per row; set for the first stage only.
	Tokens []int32
	// Hidden holds the previous stage's output, [rows, Embd]; set for every
	// stage but the first.
	Hidden *Activation

	// Outputs lists the rows (ascending indices into the batch) for which
	// the last stage must return logits. Ignored by other stages.
	Outputs []int

	// PicksOnly says that the caller samples every output row greedily
	// and needs only each row's greedy pick, not its logits: the last
	// stage's engine may then return Output.Picks instead of Logits (a
	// GPU engine then copies 4 bytes a row off the device instead of the
	// vocabulary's logits, and the host scans none). Engines that cannot
	// return logits as usual. Ignored by other stages.
	PicksOnly bool
}

// Rows is the number of tokens in the batch.
func (b *Batch) Rows() int { return len(b.Seqs) }

// Validate checks the batch's shape against the engine that will run it.
// Engines call it first so that a bad batch is an error, never a crash.
func (b *Batch) Validate(info Info) error { return b.validate(info, false) }

// ValidateOnDevice is Validate for a batch of a stage that does not embed
// whose hidden states lie in device memory, not in b.Hidden (which must be
// nil): it checks everything else.
func (b *Batch) ValidateOnDevice(info Info) error {
	if info.First() {
		return errors.New("stage: hidden states on a device into a stage that embeds")
	}
	if b.Hidden != nil {
		return errors.New("stage: hidden states both on a device and in the batch")
	}
	return b.validate(info, true)
}

func (b *Batch) validate(info Info, onDevice bool) error {
	n := len(b.Seqs)
	if n == 0 {
		return errors.New("stage: empty batch")
	}
	if len(b.Pos) != n {
		return fmt.Errorf("stage: batch has %d sequence ids but %d positions", n, len(b.Pos))
	}
	for r, p := range b.Pos {
		if p < 0 || (info.Context > 0 && int(p) >= info.Context) {
			return fmt.Errorf("stage: row %d position %d outside context [0,%d)", r, p, info.Context)
		}
	}
	if info.First() {
		if len(b.Tokens) != n {
			return fmt.Errorf("stage: first stage needs %d token ids, got %d", n, len(b.Tokens))
		}
		for r, t := range b.Tokens {
			if t < 0 || (info.Vocab > 0 && int(t) >= info.Vocab) {
				return fmt.Errorf("stage: row %d token id %d outside vocabulary [0,%d)", r, t, info.Vocab)
			}
		}
	} else if !onDevice {
		if b.Hidden == nil {
			return errors.New("stage: non-first stage needs hidden states")
		}
		if err := b.Hidden.Validate(); err != nil {
			return err
		}
		if b.Hidden.Rows != n || b.Hidden.Cols != info.Embd {
			return fmt.Errorf("stage: hidden states are [%d,%d], want [%d,%d]", b.Hidden.Rows, b.Hidden.Cols, n, info.Embd)
		}
	}
	if info.Last() {
		prev := -1
		for _, o := range b.Outputs {
			if o <= prev || o >= n {
				return fmt.Errorf("stage: output rows must be ascending indices in [0,%d), got %v", n, b.Outputs)
			}
			prev = o
		}
	}
	return nil
}

// Output is the result of a forward pass.
type Output struct {
	// Hidden is set by every stage but the last: [rows, Embd].
	Hidden *Activation
	// Logits is set by the last stage: len(Outputs) rows of Vocab floats,
	// row-major, in the order of Batch.Outputs.
	Logits []float32
	// Picks, which an engine may set instead of Logits for a batch with
	// PicksOnly, holds each output row's greedy pick, in the order of
	// Batch.Outputs: the index of the row's largest logit as
	// node/sample's greedy sampler takes it (GreedyPick).
	Picks []int32
	// Free, when set, hands the memory of Logits or of Hidden back to the
	// engine for its next pass; Release calls it. A caller that does not
	// release just leaves the memory to the garbage collector.
	Free func()
}

// CheckPicks checks an engine's greedy picks for b: asked for (PicksOnly),
// one per output row, each in a vocabulary of vocab tokens.
func CheckPicks(picks []int32, b *Batch, vocab int) error {
	if !b.PicksOnly {
		return errors.New("engine returned greedy picks unasked")
	}
	if len(picks) != len(b.Outputs) {
		return fmt.Errorf("engine returned %d greedy picks for %d rows", len(picks), len(b.Outputs))
	}
	for i, t := range picks {
		if t < 0 || int(t) >= vocab {
			return fmt.Errorf("engine's greedy pick %d for row %d is outside the vocabulary of %d", t, i, vocab)
		}
	}
	return nil
}

// GreedyPick is the greedy pick of one row of logits, the rule an engine
// that returns Output.Picks must follow: the index of the largest logit,
// NaN counting as -Inf and +Inf as the largest finite float32, the lowest
// index on ties; 0 when every logit is NaN or -Inf, and -1 for none.
func GreedyPick(logits []float32) int32 {
	if len(logits) == 0 {
		return -1
	}
	best, v := 0, SanitizeLogit(logits[0])
	for i, x := range logits[1:] {
		if c := SanitizeLogit(x); c > v {
			best, v = i+1, c
		}
	}
	return int32(best)
}

// SanitizeLogit makes NaN the lowest logit and +Inf the highest finite one:
// the order GreedyPick and node/sample's samplers rank logits in, and
// softmax then never computes Inf-Inf.
func SanitizeLogit(x float32) float32 {
	switch {
	case x != x:
		return float32(math.Inf(-1))
	case x > math.MaxFloat32:
		return math.MaxFloat32
	}
	return x
}

// LogitsRow returns row i of the logits.
func (o *Output) LogitsRow(i, vocab int) []float32 { return o.Logits[i*vocab : (i+1)*vocab] }

// Release gives the output's logits or hidden states back to the engine
// that wrote them; they must not be read after. It is safe to call on nil
// and more than once.
func (o *Output) Release() {
	if o == nil {
		return
	}
	free := o.Free
	o.Free, o.Logits = nil, nil
	if free != nil {
		o.Hidden = nil
		free()
	}
}

// Engine runs a contiguous range of layers. Implementations serialize their
// own compute; callers may still prefer a single owning goroutine.
type Engine interface {
	Info() Info

	// Forward runs the batch through the engine's layers, appending each
	// row's keys and values to its sequence's cache. It is done with b
	// when it returns: neither the engine nor its output may hold on to
	// b's memory (a pipeline stage's b.Hidden is lent by the stream it
	// came on, until the next frame).
	Forward(ctx context.Context, b *Batch) (*Output, error)

	// Open reserves cache space for a new sequence. It fails with
	// ErrNoSlot when every slot is taken.
	Open(seq SeqID) error
	// Trim drops the sequence's cached positions >= pos, so that generation
	// can resume (or be replayed) from pos.
	Trim(seq SeqID, pos int32) error
	// Release frees the sequence's cache slot.
	Release(seq SeqID) error

	// Weights reports the bytes of weights the engine holds in memory.
	WeightBytes() uint64

	Close() error
}

// Errors an engine returns for sequence bookkeeping.
var (
	ErrNoSlot     = errors.New("stage: no free sequence slot")
	ErrUnknownSeq = errors.New("stage: unknown sequence")
	ErrSeqExists  = errors.New("stage: sequence already open")
)

// Memory is what a layer range costs, for placing stages on nodes.
type Memory struct {
	Weights    uint64 // bytes of the range's tensors (plus embedding / head when owned)
	KVPerToken uint64 // bytes of K and V per cached token across the range
	Compute    uint64 // rough scratch for a forward pass (graph buffers)
}

// Total is the memory needed to hold the range with tokens cached positions.
func (m Memory) Total(tokens int) uint64 {
	return m.Weights + m.KVPerToken*uint64(tokens) + m.Compute
}

// Prepare is what every engine does before a forward pass: it validates the
// batch against the engine (info, at most maxRows rows), decodes the
// incoming hidden states (nil for the first stage), and checks ctx. The
// hidden states may share b.Hidden's memory (Activation.Float32Shared):
// engines read them, never write them.
func Prepare(ctx context.Context, b *Batch, info Info, maxRows int) (hidden []float32, err error) {
	if err := b.Validate(info); err != nil {
		return nil, err
	}
	if err := checkMaxRows(b, maxRows); err != nil {
		return nil, err
	}
	if !info.First() {
		if hidden, err = b.Hidden.Float32Shared(); err != nil {
			return nil, err
		}
	}
	return hidden, ctx.Err()
}

// PrepareOnDevice is Prepare for a batch whose hidden states lie on a
// device (ValidateOnDevice): there is nothing to decode.
func PrepareOnDevice(ctx context.Context, b *Batch, info Info, maxRows int) error {
	if err := b.ValidateOnDevice(info); err != nil {
		return err
	}
	if err := checkMaxRows(b, maxRows); err != nil {
		return err
	}
	return ctx.Err()
}

func checkMaxRows(b *Batch, maxRows int) error {
	if b.Rows() > maxRows {
		return fmt.Errorf("stage: batch of %d rows is over the engine's %d", b.Rows(), maxRows)
	}
	return nil
}
