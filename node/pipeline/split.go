package pipeline

import (
	"errors"
	"fmt"

	"github.com/meshnode/meshnode/node/wire"
	meshnodev1 "github.com/meshnode/meshnode/proto/meshnode/v1"
	"github.com/meshnode/meshnode/stage"
)

// splitFrames encodes a batch's hidden states as activations frames in
// dtype, each within maxFrame bytes: one frame when the batch fits,
// otherwise consecutive parts by rows, all but the last marked more. The
// frames alias b.
func splitFrames(step uint64, b *stage.Batch, dtype stage.DType, maxFrame int) ([]*meshnodev1.Frame, error) {
	h := b.Hidden
	if h == nil {
		return nil, errors.New("no hidden states to send")
	}
	per := wire.RowsPerFrame(h.Cols, dtype, maxFrame)
	if per <= 0 {
		return nil, fmt.Errorf("one row of %d %s values does not fit a %d-byte frame", h.Cols, dtype, maxFrame)
	}
	rows := b.Rows()
	if rows <= per {
		f, err := wire.EncodeBatch(step, b, dtype)
		if err != nil {
			return nil, err
		}
		return []*meshnodev1.Frame{f}, nil
	}
	rowBytes := h.Cols * h.DType.Size()
	frames := make([]*meshnodev1.Frame, 0, (rows+per-1)/per)
	next := 0 // index into b.Outputs
	for off := 0; off < rows; off += per {
		end := min(off+per, rows)
		part := &stage.Batch{
			Seqs:   b.Seqs[off:end],
			Pos:    b.Pos[off:end],
			Hidden: &stage.Activation{DType: h.DType, Rows: end - off, Cols: h.Cols, Data: h.Data[off*rowBytes : end*rowBytes]},
		}
		if len(b.Tokens) != 0 {
			part.Tokens = b.Tokens[off:end]
		}
		for next < len(b.Outputs) && b.Outputs[next] < end {
			part.Outputs = append(part.Outputs, b.Outputs[next]-off)
			next++
		}
		f, err := wire.EncodeBatch(step, part, dtype)
		if err != nil {
			return nil, err
		}
		f.GetActivations().More = end < rows
		frames = append(frames, f)
	}
	return frames, nil
}

// joiner gathers the parts of a split step. It bounds what a peer can make
// it hold by the decoding limits: no more rows or payload bytes in all the
// parts together than one frame could carry. It copies each part's hidden
// states as the part comes in, since a frame's payload may be lent by its
// stream only until the next frame is read (payloadLender).
type joiner struct {
	lim   wire.Limits
	step  uint64
	parts []*stage.Batch // without their hidden states, which are in data
	dtype stage.DType
	cols  int
	data  []byte
	rows  int
}

// pending reports whether a split step is waiting for more parts.
func (j *joiner) pending() bool { return len(j.parts) > 0 }

// add takes one decoded activations frame. It returns the whole batch once
// the last part is in, nil while more are due, and an error (wrapping
// wire.ErrBadFrame) for parts that do not belong together.
func (j *joiner) add(step uint64, b *stage.Batch, more bool) (*stage.Batch, error) {
	if !j.pending() && !more {
		return b, nil
	}
	if j.pending() {
		switch {
		case step != j.step:
			return nil, fmt.Errorf("%w: step %d arrived while step %d was still being joined", wire.ErrBadFrame, step, j.step)
		case b.Hidden.DType != j.dtype || b.Hidden.Cols != j.cols:
			return nil, fmt.Errorf("%w: step %d part is %s with %d cols, earlier parts %s with %d", wire.ErrBadFrame, step, b.Hidden.DType, b.Hidden.Cols, j.dtype, j.cols)
		}
	}
	j.step, j.dtype, j.cols = step, b.Hidden.DType, b.Hidden.Cols
	j.rows += b.Rows()
	if bytes := len(j.data) + len(b.Hidden.Data); j.rows > j.lim.MaxRows || bytes > j.lim.MaxPayload {
		return nil, fmt.Errorf("%w: step %d parts add up to %d rows, %d bytes, over the limits of %d, %d", wire.ErrBadFrame, step, j.rows, bytes, j.lim.MaxRows, j.lim.MaxPayload)
	}
	j.data = append(j.data, b.Hidden.Data...)
	part := *b
	part.Hidden = nil
	j.parts = append(j.parts, &part)
	if more {
		return nil, nil
	}
	whole := j.join()
	*j = joiner{lim: j.lim}
	return whole, nil
}

func (j *joiner) join() *stage.Batch {
	b := &stage.Batch{
		Seqs:   make([]stage.SeqID, 0, j.rows),
		Pos:    make([]int32, 0, j.rows),
		Hidden: &stage.Activation{DType: j.dtype, Rows: j.rows, Cols: j.cols, Data: j.data},
	}
	withTokens := true
	for _, p := range j.parts {
		withTokens = withTokens && len(p.Tokens) == p.Rows()
	}
	off := 0
	for _, p := range j.parts {
		b.Seqs = append(b.Seqs, p.Seqs...)
		b.Pos = append(b.Pos, p.Pos...)
		if withTokens {
			b.Tokens = append(b.Tokens, p.Tokens...)
		}
		for _, o := range p.Outputs {
			b.Outputs = append(b.Outputs, o+off)
		}
		off += p.Rows()
	}
	return b
}
