// Package wire converts between the engine-neutral stage types and the
// protobuf frames of proto/meshnode/v1 that stages exchange.
//
// Every Decode function treats its input as hostile: a frame comes from a
// peer, and nothing in it is used before it is checked against the frame's
// own shape and against Limits. A failed check returns an error wrapping
// ErrBadFrame; the caller then closes the stream and marks the peer suspect.
//
// Decoded values alias the frame's slices where the types allow (payload
// bytes, positions) to avoid copying large activations: keep the frame
// unchanged while the result is in use. Encoded frames likewise alias the
// batch; gRPC's Send serializes before returning, so the batch may be reused
// once Send has returned.
package wire

import (
	"errors"
	"fmt"
	"math"
	"math/bits"

	meshnodev1 "github.com/meshnode/meshnode/proto/meshnode/v1"
	"github.com/meshnode/meshnode/stage"
)

// Version is the Frame.version this package writes and accepts.
const Version = 1

var (
	// ErrBadFrame is wrapped by every error about a peer's malformed frame
	// or stage info.
	ErrBadFrame = errors.New("wire: bad frame")
	// ErrVersion is wrapped (besides ErrBadFrame) when a frame's version is
	// not Version, so that the reply can say CODE_UNSUPPORTED_VERSION.
	ErrVersion = errors.New("wire: unsupported protocol version")
	// ErrBadBatch is wrapped by errors about a local batch that cannot be
	// encoded; it is our bug, not the peer's.
	ErrBadBatch = errors.New("wire: cannot encode")
)

// Default limits: generous for any current model, small enough that a peer
// cannot make us allocate without bound.
const (
	DefaultMaxRows    = 1 << 16 // tokens per frame (a prefill chunk)
	DefaultMaxCols    = 1 << 16 // n_embd
	DefaultMaxVocab   = 1 << 20 // vocabulary size
	DefaultMaxPayload = stage.MaxActivationBytes
	DefaultMaxHistory = 1 << 20 // tokens of history an OPEN may carry
)

// Limits bound what a decoded frame may hold. A zero or negative field
// means its default, so the zero Limits is usable.
type Limits struct {
	MaxRows    int // rows (tokens) per frame
	MaxCols    int // columns (n_embd) of an activation
	MaxVocab   int // token ids must be below it; logits width
	MaxPayload int // bytes of an activation or logits payload
	MaxHistory int // tokens of history in an OPEN control
}

// DefaultLimits returns the limits used for zero fields.
func DefaultLimits() Limits {
	return Limits{
		MaxRows:    DefaultMaxRows,
		MaxCols:    DefaultMaxCols,
		MaxVocab:   DefaultMaxVocab,
		MaxPayload: DefaultMaxPayload,
		MaxHistory: DefaultMaxHistory,
	}
}

// resolved fills defaults and caps the payload at what stage.Activation
// accepts, so a decoded activation always passes its own Validate.
func (l Limits) resolved() Limits {
	d := DefaultLimits()
	if l.MaxRows <= 0 {
		l.MaxRows = d.MaxRows
	}
	if l.MaxCols <= 0 {
		l.MaxCols = d.MaxCols
	}
	if l.MaxVocab <= 0 {
		l.MaxVocab = d.MaxVocab
	}
	if l.MaxPayload <= 0 || l.MaxPayload > stage.MaxActivationBytes {
		l.MaxPayload = stage.MaxActivationBytes
	}
	if l.MaxHistory <= 0 {
		l.MaxHistory = d.MaxHistory
	}
	return l
}

// frameErr wraps the detail of a failed check with ErrBadFrame and says
// which frame it was about.
func frameErr(f *meshnodev1.Frame, what string, err error) error {
	return fmt.Errorf("%w: step %d %s: %w", ErrBadFrame, f.GetStep(), what, err)
}

func badBatch(format string, args ...any) error {
	return fmt.Errorf("%w: %s", ErrBadBatch, fmt.Sprintf(format, args...))
}

// checkFrame validates what every frame shares: presence and version.
func checkFrame(f *meshnodev1.Frame) error {
	if f == nil {
		return fmt.Errorf("%w: nil frame", ErrBadFrame)
	}
	if f.GetVersion() != Version {
		return fmt.Errorf("%w: %w: version %d, want %d", ErrBadFrame, ErrVersion, f.GetVersion(), Version)
	}
	return nil
}

// BodyKind names a frame's body for errors and logs: "activations",
// "tokens", "logits", "control", "error", "setup", "handed", or "empty" when none is
// set (also what a body kind newer than this code looks like).
func BodyKind(f *meshnodev1.Frame) string {
	switch f.GetBody().(type) {
	case *meshnodev1.Frame_Activations:
		return "activations"
	case *meshnodev1.Frame_Tokens:
		return "tokens"
	case *meshnodev1.Frame_Logits:
		return "logits"
	case *meshnodev1.Frame_Control:
		return "control"
	case *meshnodev1.Frame_Error:
		return "error"
	case *meshnodev1.Frame_Setup:
		return "setup"
	case *meshnodev1.Frame_Handed:
		return "handed"
	}
	return "empty"
}

func wrongBody(f *meshnodev1.Frame, want string) error {
	return fmt.Errorf("%w: step %d: body is %s, want %s", ErrBadFrame, f.GetStep(), BodyKind(f), want)
}

// DTypeToProto maps a stage dtype to the wire enum; unknown dtypes map to
// DTYPE_UNSPECIFIED.
func DTypeToProto(d stage.DType) meshnodev1.DType {
	switch d {
	case stage.F32:
		return meshnodev1.DType_DTYPE_F32
	case stage.F16:
		return meshnodev1.DType_DTYPE_F16
	case stage.BF16:
		return meshnodev1.DType_DTYPE_BF16
	}
	return meshnodev1.DType_DTYPE_UNSPECIFIED
}

// DTypeFromProto maps the wire enum to a stage dtype, failing with
// ErrBadFrame for DTYPE_UNSPECIFIED and values this code does not know.
func DTypeFromProto(d meshnodev1.DType) (stage.DType, error) {
	dt, err := dtypeFromProto(d)
	if err != nil {
		return 0, fmt.Errorf("%w: %w", ErrBadFrame, err)
	}
	return dt, nil
}

func dtypeFromProto(d meshnodev1.DType) (stage.DType, error) {
	switch d {
	case meshnodev1.DType_DTYPE_F32:
		return stage.F32, nil
	case meshnodev1.DType_DTYPE_F16:
		return stage.F16, nil
	case meshnodev1.DType_DTYPE_BF16:
		return stage.BF16, nil
	}
	return 0, fmt.Errorf("unknown dtype %d", int32(d))
}

// payloadSize returns rows*cols*elem, or ok=false if it overflows uint64.
// Computed in uint64 so that no shape can wrap an int, even on 32-bit.
func payloadSize(rows, cols, elem uint64) (uint64, bool) {
	hi, n := bits.Mul64(rows, cols)
	if hi != 0 {
		return 0, false
	}
	hi, n = bits.Mul64(n, elem)
	return n, hi == 0
}

// checkRows validates the per-row index arrays shared by activation and
// token frames: their lengths, non-negative positions, and output rows
// strictly ascending below rows.
func checkRows(rows, seqs int, pos []int32, outputs []uint32) error {
	if seqs != rows {
		return fmt.Errorf("%d rows but %d sequence ids", rows, seqs)
	}
	if len(pos) != rows {
		return fmt.Errorf("%d rows but %d positions", rows, len(pos))
	}
	for r, p := range pos {
		if p < 0 {
			return fmt.Errorf("row %d has negative position %d", r, p)
		}
	}
	return checkOutputs(rows, outputs)
}

func checkOutputs(rows int, outputs []uint32) error {
	if len(outputs) > rows {
		return fmt.Errorf("%d output rows in a batch of %d", len(outputs), rows)
	}
	for i, o := range outputs {
		if uint64(o) >= uint64(rows) {
			return fmt.Errorf("output row %d is %d, outside [0,%d)", i, o, rows)
		}
		if i > 0 && o <= outputs[i-1] {
			return fmt.Errorf("output rows not strictly ascending at %d: %d after %d", i, o, outputs[i-1])
		}
	}
	return nil
}

// checkTokenIDs validates token ids from a peer: each in [0, maxVocab).
func checkTokenIDs(ids []int32, maxVocab int) error {
	for r, id := range ids {
		if id < 0 || int64(id) >= int64(maxVocab) {
			return fmt.Errorf("row %d token id %d outside [0,%d)", r, id, maxVocab)
		}
	}
	return nil
}

// checkBatchRows is checkRows for a local batch about to be encoded.
func checkBatchRows(b *stage.Batch) error {
	n := len(b.Seqs)
	if n == 0 {
		return badBatch("empty batch")
	}
	if uint64(n) > math.MaxUint32 {
		return badBatch("%d rows do not fit the wire", n)
	}
	if len(b.Pos) != n {
		return badBatch("%d rows but %d positions", n, len(b.Pos))
	}
	for r, p := range b.Pos {
		if p < 0 {
			return badBatch("row %d has negative position %d", r, p)
		}
	}
	for i, o := range b.Outputs {
		if o < 0 || o >= n || (i > 0 && o <= b.Outputs[i-1]) {
			return badBatch("output rows must be strictly ascending in [0,%d), got %v", n, b.Outputs)
		}
	}
	return nil
}

func seqsToProto(s []stage.SeqID) []uint64 {
	out := make([]uint64, len(s))
	for i, v := range s {
		out[i] = uint64(v)
	}
	return out
}

func seqsFromProto(s []uint64) []stage.SeqID {
	out := make([]stage.SeqID, len(s))
	for i, v := range s {
		out[i] = stage.SeqID(v)
	}
	return out
}

func outputsToProto(o []int) []uint32 {
	if len(o) == 0 {
		return nil
	}
	out := make([]uint32, len(o))
	for i, v := range o {
		out[i] = uint32(v)
	}
	return out
}

func outputsFromProto(o []uint32) []int {
	if len(o) == 0 {
		return nil
	}
	out := make([]int, len(o))
	for i, v := range o {
		out[i] = int(v)
	}
	return out
}
