package pipeline

import (
	"errors"
	"slices"
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/meshnode/meshnode/node/wire"
	"github.com/meshnode/meshnode/stage"
)

func splitBatch(t *testing.T, rows, cols int) *stage.Batch {
	t.Helper()
	vals := make([]float32, rows*cols)
	for i := range vals {
		vals[i] = float32(i%97) - 48
	}
	h, err := stage.NewActivation(stage.F32, rows, cols, vals)
	if err != nil {
		t.Fatal(err)
	}
	b := &stage.Batch{Hidden: h}
	for r := range rows {
		b.Seqs = append(b.Seqs, stage.SeqID(1+r%3))
		b.Pos = append(b.Pos, int32(r))
		b.Tokens = append(b.Tokens, int32(100+r))
	}
	for _, o := range []int{0, rows / 2, rows - 1} {
		if len(b.Outputs) == 0 || o > b.Outputs[len(b.Outputs)-1] {
			b.Outputs = append(b.Outputs, o)
		}
	}
	return b
}

func TestSplitAndJoin(t *testing.T) {
	for _, tc := range []struct {
		rows, maxFrame int
		dtype          stage.DType
		parts          int
	}{
		{rows: 11, maxFrame: 0, dtype: stage.F16, parts: 1},
		{rows: 11, maxFrame: 1 << 10, dtype: stage.F16, parts: 3},  // 5 rows a frame
		{rows: 10, maxFrame: 1 << 10, dtype: stage.F16, parts: 2},  // exactly two
		{rows: 11, maxFrame: 1 << 10, dtype: stage.F32, parts: 4},  // 3 rows a frame
		{rows: 1, maxFrame: 1 << 10, dtype: stage.F32, parts: 1},   // one row
		{rows: 64, maxFrame: 4 << 10, dtype: stage.BF16, parts: 3}, // 25 rows a frame
	} {
		b := splitBatch(t, tc.rows, 64)
		want, _ := stage.Encode(tc.dtype, mustFloats(t, b.Hidden), nil)
		frames, err := splitFrames(9, b, tc.dtype, tc.maxFrame)
		if err != nil {
			t.Fatal(err)
		}
		if len(frames) != tc.parts {
			t.Fatalf("%+v: %d frames", tc, len(frames))
		}
		j := joiner{lim: wire.DefaultLimits()}
		var whole *stage.Batch
		for i, f := range frames {
			if f.GetStep() != 9 || f.GetActivations().GetMore() != (i < len(frames)-1) {
				t.Fatalf("%+v: frame %d step %d more %v", tc, i, f.GetStep(), f.GetActivations().GetMore())
			}
			if tc.maxFrame > 0 && proto.Size(f) > tc.maxFrame {
				t.Fatalf("%+v: frame %d is %d bytes", tc, i, proto.Size(f))
			}
			part, err := wire.DecodeBatch(f, wire.Limits{})
			if err != nil {
				t.Fatal(err)
			}
			whole, err = j.add(f.GetStep(), part, f.GetActivations().GetMore())
			if err != nil {
				t.Fatal(err)
			}
			if (whole != nil) != (i == len(frames)-1) {
				t.Fatalf("%+v: joined after frame %d of %d", tc, i, len(frames))
			}
			if whole == nil {
				// As a stream that lent the payload does with its
				// buffer when it reads the next frame.
				clear(f.GetActivations().GetPayload())
			}
		}
		if j.pending() {
			t.Fatal("joiner still pending")
		}
		if !slices.Equal(whole.Seqs, b.Seqs) || !slices.Equal(whole.Pos, b.Pos) || !slices.Equal(whole.Tokens, b.Tokens) || !slices.Equal(whole.Outputs, b.Outputs) {
			t.Fatalf("%+v: rows changed: %+v", tc, whole)
		}
		if whole.Hidden.DType != tc.dtype || whole.Hidden.Rows != tc.rows || string(whole.Hidden.Data) != string(want) {
			t.Fatalf("%+v: hidden states changed", tc)
		}
	}
	if _, err := splitFrames(1, splitBatch(t, 2, 64), stage.F32, 200); err == nil {
		t.Fatal("a row larger than the frame was split")
	}
}

func mustFloats(t *testing.T, a *stage.Activation) []float32 {
	t.Helper()
	f, err := a.Float32()
	if err != nil {
		t.Fatal(err)
	}
	return f
}

func TestJoinRejects(t *testing.T) {
	part := func(rows, cols int, dtype stage.DType) *stage.Batch {
		b := splitBatch(t, rows, cols)
		f, err := wire.EncodeBatch(1, b, dtype)
		if err != nil {
			t.Fatal(err)
		}
		d, err := wire.DecodeBatch(f, wire.Limits{})
		if err != nil {
			t.Fatal(err)
		}
		return d
	}
	for _, tc := range []struct {
		name   string
		lim    wire.Limits
		second func() (uint64, *stage.Batch)
	}{
		{"other step", wire.DefaultLimits(), func() (uint64, *stage.Batch) { return 2, part(2, 8, stage.F16) }},
		{"other dtype", wire.DefaultLimits(), func() (uint64, *stage.Batch) { return 1, part(2, 8, stage.F32) }},
		{"other width", wire.DefaultLimits(), func() (uint64, *stage.Batch) { return 1, part(2, 4, stage.F16) }},
		{"too many rows", wire.Limits{MaxRows: 3, MaxPayload: 1 << 20}, func() (uint64, *stage.Batch) { return 1, part(2, 8, stage.F16) }},
		{"too many bytes", wire.Limits{MaxRows: 100, MaxPayload: 60}, func() (uint64, *stage.Batch) { return 1, part(2, 8, stage.F16) }},
	} {
		j := joiner{lim: tc.lim}
		if _, err := j.add(1, part(2, 8, stage.F16), true); err != nil {
			t.Fatalf("%s: first part: %v", tc.name, err)
		}
		step, b := tc.second()
		if _, err := j.add(step, b, false); !errors.Is(err, wire.ErrBadFrame) {
			t.Fatalf("%s: got %v", tc.name, err)
		}
	}
}
