package wire

import (
	"errors"
	"fmt"
	"math"

	"github.com/meshnode/meshnode/node/sample"
	meshnodev1 "github.com/meshnode/meshnode/proto/meshnode/v1"
	"github.com/meshnode/meshnode/stage"
)

// EncodeBatch builds an activations frame from b's sequence ids, positions,
// output rows and hidden states, converting the hidden states to dtype when
// they are held in another one. Which dtype to send (f16 in the default
// configuration) is the caller's choice, usually the receiver's
// StageInfo.wire_dtype. b.Tokens, when set, travel along as the rows' token
// ids (a pipeline's last stage keeps them as each sequence's history). The
// frame aliases b.Pos and b.Tokens, and b.Hidden.Data when no conversion is
// needed.
func EncodeBatch(step uint64, b *stage.Batch, dtype stage.DType) (*meshnodev1.Frame, error) {
	if b == nil {
		return nil, badBatch("nil batch")
	}
	if dtype.Size() == 0 {
		return nil, badBatch("unknown dtype %s", dtype)
	}
	if err := checkBatchRows(b); err != nil {
		return nil, err
	}
	h := b.Hidden
	if h == nil {
		return nil, badBatch("activations frame needs hidden states")
	}
	if err := h.Validate(); err != nil {
		return nil, fmt.Errorf("%w: %w", ErrBadBatch, err)
	}
	if h.Rows != len(b.Seqs) {
		return nil, badBatch("hidden states have %d rows for %d sequence ids", h.Rows, len(b.Seqs))
	}
	if err := checkRowTokens(b); err != nil {
		return nil, err
	}
	payload := h.Data
	if h.DType != dtype {
		var err error
		if payload, err = convert(h.Data, h.DType, dtype); err != nil {
			return nil, fmt.Errorf("%w: %w", ErrBadBatch, err)
		}
	}
	return &meshnodev1.Frame{
		Version: Version,
		Step:    step,
		Body: &meshnodev1.Frame_Activations{Activations: &meshnodev1.Activations{
			SeqIds:     seqsToProto(b.Seqs),
			Positions:  b.Pos,
			Dtype:      DTypeToProto(dtype),
			Rows:       uint32(h.Rows),
			Cols:       uint32(h.Cols),
			Payload:    payload,
			OutputRows: outputsToProto(b.Outputs),
			TokenIds:   tokensOrNil(b.Tokens),
		}},
	}, nil
}

// checkRowTokens checks the token ids an activations frame carries along,
// if any: one per row, none negative.
func checkRowTokens(b *stage.Batch) error {
	if len(b.Tokens) == 0 {
		return nil
	}
	if len(b.Tokens) != len(b.Seqs) {
		return badBatch("%d rows but %d token ids", len(b.Seqs), len(b.Tokens))
	}
	for r, t := range b.Tokens {
		if t < 0 {
			return badBatch("row %d has negative token id %d", r, t)
		}
	}
	return nil
}

func tokensOrNil(t []int32) []int32 {
	if len(t) == 0 {
		return nil
	}
	return t
}

// DecodeBatch validates an activations frame against lim and returns it as
// a batch for a stage that does not own layer 0. Hidden keeps the wire
// dtype, and is nil for hidden states on the device (on_device); Tokens
// holds the rows' token ids when the frame carries them (nil otherwise). Hidden.Data, Pos and Tokens alias the frame. The frame's more
// flag is the caller's business: it says a batch was split, not what a part
// holds.
func DecodeBatch(f *meshnodev1.Frame, lim Limits) (*stage.Batch, error) {
	if err := checkFrame(f); err != nil {
		return nil, err
	}
	a := f.GetActivations()
	if a == nil {
		return nil, wrongBody(f, "activations")
	}
	b, err := decodeActivations(a, lim.resolved())
	if err != nil {
		return nil, frameErr(f, "activations", err)
	}
	return b, nil
}

func decodeActivations(a *meshnodev1.Activations, lim Limits) (*stage.Batch, error) {
	dt, err := dtypeFromProto(a.GetDtype())
	if err != nil {
		return nil, err
	}
	rows, cols := a.GetRows(), a.GetCols()
	if rows == 0 || cols == 0 {
		return nil, fmt.Errorf("shape [%d,%d] is not positive", rows, cols)
	}
	if uint64(rows) > uint64(lim.MaxRows) {
		return nil, fmt.Errorf("%d rows, over the limit of %d", rows, lim.MaxRows)
	}
	if uint64(cols) > uint64(lim.MaxCols) {
		return nil, fmt.Errorf("%d cols, over the limit of %d", cols, lim.MaxCols)
	}
	want, ok := payloadSize(uint64(rows), uint64(cols), uint64(dt.Size()))
	if !ok || want > uint64(lim.MaxPayload) {
		return nil, fmt.Errorf("shape [%d,%d] %s is over the payload limit of %d bytes", rows, cols, dt, lim.MaxPayload)
	}
	if a.GetOnDevice() {
		switch {
		case len(a.GetPayload()) != 0:
			return nil, fmt.Errorf("hidden states on the device with %d payload bytes", len(a.GetPayload()))
		case !a.GetAlone():
			return nil, errors.New("hidden states on the device of a batch not alone in flight")
		case a.GetMore():
			return nil, errors.New("hidden states on the device in a split batch")
		}
		want = 0
	}
	if uint64(len(a.GetPayload())) != want {
		return nil, fmt.Errorf("shape [%d,%d] %s needs %d payload bytes, got %d", rows, cols, dt, want, len(a.GetPayload()))
	}
	// rows <= MaxRows, an int, so the conversions below cannot wrap.
	if err := checkRows(int(rows), len(a.GetSeqIds()), a.GetPositions(), a.GetOutputRows()); err != nil {
		return nil, err
	}
	ids := a.GetTokenIds()
	if len(ids) != 0 && len(ids) != int(rows) {
		return nil, fmt.Errorf("%d rows but %d token ids", rows, len(ids))
	}
	if err := checkTokenIDs(ids, lim.MaxVocab); err != nil {
		return nil, err
	}
	b := &stage.Batch{
		Seqs:    seqsFromProto(a.GetSeqIds()),
		Pos:     a.GetPositions(),
		Tokens:  tokensOrNil(ids),
		Outputs: outputsFromProto(a.GetOutputRows()),
	}
	if !a.GetOnDevice() {
		b.Hidden = &stage.Activation{DType: dt, Rows: int(rows), Cols: int(cols), Data: a.GetPayload()}
	}
	return b, nil
}

// EncodeOnDevice builds an activations frame of a batch whose hidden
// states (rows × cols f32) lie in the device buffer between two stages
// (Activations.on_device): b's sequence ids, positions, token ids and
// output rows travel, b.Hidden is ignored. The frame aliases b.Pos and
// b.Tokens.
func EncodeOnDevice(step uint64, b *stage.Batch, cols int) (*meshnodev1.Frame, error) {
	if b == nil {
		return nil, badBatch("nil batch")
	}
	if err := checkBatchRows(b); err != nil {
		return nil, err
	}
	if cols <= 0 || cols > math.MaxInt32 {
		return nil, badBatch("%d columns", cols)
	}
	if err := checkRowTokens(b); err != nil {
		return nil, err
	}
	return &meshnodev1.Frame{
		Version: Version,
		Step:    step,
		Body: &meshnodev1.Frame_Activations{Activations: &meshnodev1.Activations{
			SeqIds:     seqsToProto(b.Seqs),
			Positions:  b.Pos,
			Dtype:      DTypeToProto(stage.F32),
			Rows:       uint32(len(b.Seqs)),
			Cols:       uint32(cols),
			OutputRows: outputsToProto(b.Outputs),
			TokenIds:   tokensOrNil(b.Tokens),
			Alone:      true,
			OnDevice:   true,
		}},
	}, nil
}

// EncodeHanded builds the frame that confirms step's hidden states on the
// device (Activations.on_device) are written.
func EncodeHanded(step uint64) *meshnodev1.Frame {
	return &meshnodev1.Frame{Version: Version, Step: step, Body: &meshnodev1.Frame_Handed{Handed: &meshnodev1.Handed{}}}
}

// EncodeTokens builds a tokens frame from b's sequence ids, positions,
// token ids and output rows: the input of a first stage, or (with no output
// rows) the tokens that a last stage sampled. The frame aliases b.Pos and
// b.Tokens.
func EncodeTokens(step uint64, b *stage.Batch) (*meshnodev1.Frame, error) {
	if b == nil {
		return nil, badBatch("nil batch")
	}
	if err := checkBatchRows(b); err != nil {
		return nil, err
	}
	if len(b.Tokens) != len(b.Seqs) {
		return nil, badBatch("%d rows but %d token ids", len(b.Seqs), len(b.Tokens))
	}
	for r, t := range b.Tokens {
		if t < 0 {
			return nil, badBatch("row %d has negative token id %d", r, t)
		}
	}
	return &meshnodev1.Frame{
		Version: Version,
		Step:    step,
		Body: &meshnodev1.Frame_Tokens{Tokens: &meshnodev1.Tokens{
			SeqIds:     seqsToProto(b.Seqs),
			Positions:  b.Pos,
			TokenIds:   b.Tokens,
			OutputRows: outputsToProto(b.Outputs),
		}},
	}, nil
}

// DecodeTokens validates a tokens frame against lim (token ids must be
// below MaxVocab; the engine checks its exact vocabulary) and returns it as
// a batch. Pos and Tokens alias the frame.
func DecodeTokens(f *meshnodev1.Frame, lim Limits) (*stage.Batch, error) {
	if err := checkFrame(f); err != nil {
		return nil, err
	}
	t := f.GetTokens()
	if t == nil {
		return nil, wrongBody(f, "tokens")
	}
	b, err := decodeTokens(t, lim.resolved())
	if err != nil {
		return nil, frameErr(f, "tokens", err)
	}
	return b, nil
}

func decodeTokens(t *meshnodev1.Tokens, lim Limits) (*stage.Batch, error) {
	rows := len(t.GetSeqIds())
	if rows == 0 {
		return nil, errors.New("no rows")
	}
	if rows > lim.MaxRows {
		return nil, fmt.Errorf("%d rows, over the limit of %d", rows, lim.MaxRows)
	}
	if err := checkRows(rows, rows, t.GetPositions(), t.GetOutputRows()); err != nil {
		return nil, err
	}
	ids := t.GetTokenIds()
	if len(ids) != rows {
		return nil, fmt.Errorf("%d rows but %d token ids", rows, len(ids))
	}
	if err := checkTokenIDs(ids, lim.MaxVocab); err != nil {
		return nil, err
	}
	return &stage.Batch{
		Seqs:    seqsFromProto(t.GetSeqIds()),
		Pos:     t.GetPositions(),
		Tokens:  ids,
		Outputs: outputsFromProto(t.GetOutputRows()),
	}, nil
}

// convert re-encodes a validated payload from one dtype to another through
// f32, which holds f16 and bf16 exactly. It works in chunks so that the f32
// detour costs a small fixed buffer, not a copy of the whole activation.
func convert(data []byte, from, to stage.DType) ([]byte, error) {
	const chunk = 4096 // elements
	in, out := from.Size(), to.Size()
	n := len(data) / in
	if uint64(n) > math.MaxInt/uint64(out) {
		return nil, fmt.Errorf("%d elements of %s do not fit in memory", n, to)
	}
	dst := make([]byte, 0, n*out)
	buf := make([]float32, 0, chunk)
	var err error
	for off := 0; off < len(data); off += chunk * in {
		end := min(off+chunk*in, len(data))
		if buf, err = stage.Decode(from, data[off:end], buf[:0]); err != nil {
			return nil, err
		}
		if dst, err = stage.Encode(to, buf, dst); err != nil {
			return nil, err
		}
	}
	return dst, nil
}

// Sampled is a last stage's answer to one step: the token sampled for each
// output row of the step, in the step's order. Pos is the position each
// token will take (its row's position + 1). A step without output rows is
// answered with no rows. Logprobs is empty, or holds one entry per row
// (zero for the rows whose sequence did not ask for them).
type Sampled struct {
	Seqs     []stage.SeqID
	Pos      []int32
	Tokens   []int32
	Logprobs []sample.Logprob
}

// Rows is the number of sampled tokens.
func (s *Sampled) Rows() int { return len(s.Seqs) }

// EncodeSampled builds the tokens frame that answers step with s. Unlike
// EncodeTokens it accepts zero rows. The frame aliases s.Pos and s.Tokens.
func EncodeSampled(step uint64, s *Sampled) (*meshnodev1.Frame, error) {
	if s == nil {
		return nil, badBatch("nil sampled tokens")
	}
	n := len(s.Seqs)
	if len(s.Pos) != n || len(s.Tokens) != n {
		return nil, badBatch("%d sequence ids, %d positions, %d token ids", n, len(s.Pos), len(s.Tokens))
	}
	if uint64(n) > math.MaxUint32 {
		return nil, badBatch("%d rows do not fit the wire", n)
	}
	for r := range n {
		if s.Pos[r] < 0 || s.Tokens[r] < 0 {
			return nil, badBatch("row %d has position %d, token id %d", r, s.Pos[r], s.Tokens[r])
		}
	}
	if len(s.Logprobs) != 0 && len(s.Logprobs) != n {
		return nil, badBatch("%d rows but %d log-probabilities", n, len(s.Logprobs))
	}
	var lps []*meshnodev1.TokenLogprob
	for r, lp := range s.Logprobs {
		pb := &meshnodev1.TokenLogprob{Logprob: lp.Logprob}
		for _, c := range lp.Top {
			pb.TopTokenIds = append(pb.TopTokenIds, c.Token)
			pb.TopLogprobs = append(pb.TopLogprobs, c.Logprob)
		}
		if err := checkLogprob(pb, math.MaxInt32); err != nil {
			return nil, badBatch("row %d: %v", r, err)
		}
		lps = append(lps, pb)
	}
	return &meshnodev1.Frame{
		Version: Version,
		Step:    step,
		Body: &meshnodev1.Frame_Tokens{Tokens: &meshnodev1.Tokens{
			SeqIds:    seqsToProto(s.Seqs),
			Positions: tokensOrNil(s.Pos),
			TokenIds:  tokensOrNil(s.Tokens),
			Logprobs:  lps,
		}},
	}, nil
}

// checkLogprob validates one row's log-probabilities: values <= 0 (-Inf
// allowed, NaN not), at most sample.MaxTopLogprobs alternatives with ids
// below maxVocab.
func checkLogprob(lp *meshnodev1.TokenLogprob, maxVocab int) error {
	logprob := func(v float32) bool { return v <= 0 } // false for NaN
	if !logprob(lp.GetLogprob()) {
		return fmt.Errorf("log-probability %v is not <= 0", lp.GetLogprob())
	}
	ids, vals := lp.GetTopTokenIds(), lp.GetTopLogprobs()
	if len(ids) != len(vals) {
		return fmt.Errorf("%d alternative tokens but %d log-probabilities", len(ids), len(vals))
	}
	if len(ids) > sample.MaxTopLogprobs {
		return fmt.Errorf("%d alternatives, over the limit of %d", len(ids), sample.MaxTopLogprobs)
	}
	for i, v := range vals {
		if !logprob(v) {
			return fmt.Errorf("alternative %d has log-probability %v, not <= 0", i, v)
		}
	}
	if err := checkTokenIDs(ids, maxVocab); err != nil {
		return fmt.Errorf("alternatives: %w", err)
	}
	return nil
}

// DecodeSampled validates a tokens frame sent back by a last stage: any
// number of rows up to lim.MaxRows, no output rows, token ids below
// lim.MaxVocab. Pos and Tokens alias the frame.
func DecodeSampled(f *meshnodev1.Frame, lim Limits) (*Sampled, error) {
	if err := checkFrame(f); err != nil {
		return nil, err
	}
	t := f.GetTokens()
	if t == nil {
		return nil, wrongBody(f, "tokens")
	}
	lim = lim.resolved()
	check := func() error {
		rows := len(t.GetSeqIds())
		if rows > lim.MaxRows {
			return fmt.Errorf("%d rows, over the limit of %d", rows, lim.MaxRows)
		}
		if len(t.GetOutputRows()) != 0 {
			return errors.New("sampled tokens carry output rows")
		}
		if err := checkRows(rows, rows, t.GetPositions(), nil); err != nil {
			return err
		}
		if len(t.GetTokenIds()) != rows {
			return fmt.Errorf("%d rows but %d token ids", rows, len(t.GetTokenIds()))
		}
		if n := len(t.GetLogprobs()); n != 0 && n != rows {
			return fmt.Errorf("%d rows but %d log-probabilities", rows, n)
		}
		for r, lp := range t.GetLogprobs() {
			if err := checkLogprob(lp, lim.MaxVocab); err != nil {
				return fmt.Errorf("row %d: %w", r, err)
			}
		}
		return checkTokenIDs(t.GetTokenIds(), lim.MaxVocab)
	}
	if err := check(); err != nil {
		return nil, frameErr(f, "sampled tokens", err)
	}
	s := &Sampled{
		Seqs:   seqsFromProto(t.GetSeqIds()),
		Pos:    t.GetPositions(),
		Tokens: t.GetTokenIds(),
	}
	if lps := t.GetLogprobs(); len(lps) != 0 {
		s.Logprobs = make([]sample.Logprob, len(lps))
		for r, lp := range lps {
			s.Logprobs[r].Logprob = lp.GetLogprob()
			for i, id := range lp.GetTopTokenIds() {
				s.Logprobs[r].Top = append(s.Logprobs[r].Top, sample.TopLogprob{Token: id, Logprob: lp.GetTopLogprobs()[i]})
			}
		}
	}
	return s, nil
}
