package wire

import (
	"errors"
	"math"
	"math/rand/v2"
	"slices"
	"strings"
	"testing"

	"google.golang.org/protobuf/proto"

	meshnodev1 "github.com/meshnode/meshnode/proto/meshnode/v1"
	"github.com/meshnode/meshnode/stage"
)

// randFloats returns n values spread over several orders of magnitude,
// including some in f16's subnormal range, so conversions are exercised
// beyond the easy middle.
func randFloats(r *rand.Rand, n int) []float32 {
	f := make([]float32, n)
	for i := range f {
		mag := math.Pow(2, float64(r.IntN(30)-20)) // 2^-20 .. 2^9
		f[i] = float32((r.Float64()*2 - 1) * mag)
	}
	return f
}

func testBatch(t *testing.T, rows, cols int, dtype stage.DType, vals []float32) *stage.Batch {
	t.Helper()
	h, err := stage.NewActivation(dtype, rows, cols, vals)
	if err != nil {
		t.Fatal(err)
	}
	b := &stage.Batch{Hidden: h}
	for r := range rows {
		b.Seqs = append(b.Seqs, stage.SeqID(r%3)+1<<40) // ids above 32 bits
		b.Pos = append(b.Pos, int32(100+r))
	}
	b.Outputs = []int{rows - 1}
	if rows > 2 {
		b.Outputs = []int{0, rows / 2, rows - 1}
	}
	return b
}

// viaWire marshals and unmarshals f, as a real peer would see it.
func viaWire(t testing.TB, f *meshnodev1.Frame) *meshnodev1.Frame {
	t.Helper()
	data, err := proto.Marshal(f)
	if err != nil {
		t.Fatal(err)
	}
	var got meshnodev1.Frame
	if err := proto.Unmarshal(data, &got); err != nil {
		t.Fatal(err)
	}
	return &got
}

func TestBatchRoundTrip(t *testing.T) {
	const (
		f16Rel = 1.0 / (1 << 11) // half an f16 ulp, relative
		f16Abs = 1.0 / (1 << 25) // half the smallest f16 subnormal
		bfRel  = 1.0 / (1 << 8)  // half a bf16 ulp, relative
	)
	tests := []struct {
		name      string
		src, wire stage.DType
		rows      int
		cols      int
		rel, abs  float64 // tolerance against the source values; 0 means exact
	}{
		{"f32 as f32", stage.F32, stage.F32, 5, 7, 0, 0},
		{"f16 as f16", stage.F16, stage.F16, 3, 64, 0, 0},
		{"bf16 as bf16", stage.BF16, stage.BF16, 1, 33, 0, 0},
		{"f32 as f16", stage.F32, stage.F16, 17, 128, f16Rel, f16Abs},
		{"f32 as bf16", stage.F32, stage.BF16, 4, 4100, bfRel, 0}, // crosses a convert chunk
		{"f16 as f32", stage.F16, stage.F32, 2, 8, 0, 0},
		{"bf16 as f32", stage.BF16, stage.F32, 2, 8, 0, 0},
		{"one row", stage.F32, stage.F16, 1, 1, f16Rel, f16Abs},
	}
	r := rand.New(rand.NewPCG(1, 2))
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			vals := randFloats(r, tc.rows*tc.cols)
			b := testBatch(t, tc.rows, tc.cols, tc.src, vals)
			// What the source dtype holds is the reference: f16/bf16 sources
			// were already rounded by NewActivation.
			want, err := b.Hidden.Float32()
			if err != nil {
				t.Fatal(err)
			}
			f, err := EncodeBatch(42, b, tc.wire)
			if err != nil {
				t.Fatal(err)
			}
			got, err := DecodeBatch(viaWire(t, f), Limits{})
			if err != nil {
				t.Fatal(err)
			}
			if got.Hidden.DType != tc.wire || got.Hidden.Rows != tc.rows || got.Hidden.Cols != tc.cols {
				t.Fatalf("hidden is %s [%d,%d], want %s [%d,%d]", got.Hidden.DType, got.Hidden.Rows, got.Hidden.Cols, tc.wire, tc.rows, tc.cols)
			}
			if !slices.Equal(got.Seqs, b.Seqs) || !slices.Equal(got.Pos, b.Pos) || !slices.Equal(got.Outputs, b.Outputs) {
				t.Fatalf("rows changed: seqs %v pos %v outputs %v, want %v %v %v", got.Seqs, got.Pos, got.Outputs, b.Seqs, b.Pos, b.Outputs)
			}
			if got.Tokens != nil {
				t.Fatalf("activations frame decoded with tokens %v", got.Tokens)
			}
			if tc.src == tc.wire && string(got.Hidden.Data) != string(b.Hidden.Data) {
				t.Fatal("payload bytes changed without conversion")
			}
			gotF, err := got.Hidden.Float32()
			if err != nil {
				t.Fatal(err)
			}
			for i := range want {
				d := math.Abs(float64(gotF[i]) - float64(want[i]))
				if d > max(tc.rel*math.Abs(float64(want[i])), tc.abs) {
					t.Fatalf("element %d: %g became %g (error %g)", i, want[i], gotF[i], d)
				}
			}
			if err := got.Validate(stage.Info{Layers: 4, Start: 1, End: 4, Embd: tc.cols}); err != nil {
				t.Fatalf("decoded batch fails stage validation: %v", err)
			}
		})
	}
}

func TestEncodeBatchNoOutputs(t *testing.T) {
	b := testBatch(t, 2, 3, stage.F32, make([]float32, 6))
	b.Outputs = nil
	f, err := EncodeBatch(1, b, stage.F32)
	if err != nil {
		t.Fatal(err)
	}
	got, err := DecodeBatch(viaWire(t, f), Limits{})
	if err != nil {
		t.Fatal(err)
	}
	if got.Outputs != nil {
		t.Fatalf("outputs %v, want none", got.Outputs)
	}
}

func TestTokensRoundTrip(t *testing.T) {
	for _, b := range []*stage.Batch{
		// first-stage input: a prefill chunk of one sequence, last row out
		{Seqs: []stage.SeqID{7, 7, 7}, Pos: []int32{0, 1, 2}, Tokens: []int32{1, 15043, 0}, Outputs: []int{2}},
		// sampled tokens coming back: one per sequence, no outputs
		{Seqs: []stage.SeqID{1, math.MaxUint64}, Pos: []int32{9, math.MaxInt32}, Tokens: []int32{128000, 5}},
	} {
		f, err := EncodeTokens(3, b)
		if err != nil {
			t.Fatal(err)
		}
		got, err := DecodeTokens(viaWire(t, f), Limits{})
		if err != nil {
			t.Fatal(err)
		}
		if !slices.Equal(got.Seqs, b.Seqs) || !slices.Equal(got.Pos, b.Pos) || !slices.Equal(got.Tokens, b.Tokens) || !slices.Equal(got.Outputs, b.Outputs) {
			t.Fatalf("got %+v, want %+v", got, b)
		}
		if got.Hidden != nil {
			t.Fatal("tokens frame decoded with hidden states")
		}
	}
}

func TestEncodeRejectsBadBatch(t *testing.T) {
	good := func() *stage.Batch { return testBatch(t, 3, 2, stage.F32, make([]float32, 6)) }
	tests := []struct {
		name  string
		dtype stage.DType
		edit  func(b *stage.Batch) *stage.Batch
	}{
		{"nil batch", stage.F16, func(*stage.Batch) *stage.Batch { return nil }},
		{"unknown dtype", 9, func(b *stage.Batch) *stage.Batch { return b }},
		{"empty", stage.F16, func(*stage.Batch) *stage.Batch { return &stage.Batch{} }},
		{"positions short", stage.F16, func(b *stage.Batch) *stage.Batch { b.Pos = b.Pos[:2]; return b }},
		{"negative position", stage.F16, func(b *stage.Batch) *stage.Batch { b.Pos[1] = -1; return b }},
		{"outputs unordered", stage.F16, func(b *stage.Batch) *stage.Batch { b.Outputs = []int{2, 1}; return b }},
		{"output out of range", stage.F16, func(b *stage.Batch) *stage.Batch { b.Outputs = []int{3}; return b }},
		{"no hidden", stage.F16, func(b *stage.Batch) *stage.Batch { b.Hidden = nil; return b }},
		{"hidden rows differ", stage.F16, func(b *stage.Batch) *stage.Batch { b.Seqs = b.Seqs[:2]; b.Pos = b.Pos[:2]; b.Outputs = nil; return b }},
		{"hidden payload short", stage.F16, func(b *stage.Batch) *stage.Batch { b.Hidden.Data = b.Hidden.Data[1:]; return b }},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			_, err := EncodeBatch(1, tc.edit(good()), tc.dtype)
			if !errors.Is(err, ErrBadBatch) {
				t.Fatalf("got %v, want ErrBadBatch", err)
			}
		})
	}
	_, err := EncodeTokens(1, &stage.Batch{Seqs: []stage.SeqID{1}, Pos: []int32{0}, Tokens: []int32{-1}})
	if !errors.Is(err, ErrBadBatch) {
		t.Fatalf("negative token: got %v, want ErrBadBatch", err)
	}
	_, err = EncodeTokens(1, &stage.Batch{Seqs: []stage.SeqID{1}, Pos: []int32{0}})
	if !errors.Is(err, ErrBadBatch) {
		t.Fatalf("missing tokens: got %v, want ErrBadBatch", err)
	}
}

// validActivations is a 3x2 f16 frame that decodes, for the malformed
// table to break one field at a time.
func validActivations() *meshnodev1.Frame {
	return &meshnodev1.Frame{
		Version: Version,
		Step:    9,
		Body: &meshnodev1.Frame_Activations{Activations: &meshnodev1.Activations{
			SeqIds:     []uint64{1, 1, 2},
			Positions:  []int32{0, 1, 0},
			Dtype:      meshnodev1.DType_DTYPE_F16,
			Rows:       3,
			Cols:       2,
			Payload:    make([]byte, 3*2*2),
			OutputRows: []uint32{1, 2},
		}},
	}
}

func TestDecodeBatchRejects(t *testing.T) {
	huge := Limits{MaxRows: math.MaxInt, MaxCols: math.MaxInt, MaxPayload: math.MaxInt}
	act := func(f *meshnodev1.Frame) *meshnodev1.Activations { return f.GetActivations() }
	tests := []struct {
		name string
		lim  Limits
		edit func(f *meshnodev1.Frame) *meshnodev1.Frame
		want string // substring of the error
	}{
		{"nil frame", Limits{}, func(*meshnodev1.Frame) *meshnodev1.Frame { return nil }, "nil frame"},
		{"version 0", Limits{}, func(f *meshnodev1.Frame) *meshnodev1.Frame { f.Version = 0; return f }, "version 0"},
		{"version 2", Limits{}, func(f *meshnodev1.Frame) *meshnodev1.Frame { f.Version = 2; return f }, "version 2"},
		{"no body", Limits{}, func(f *meshnodev1.Frame) *meshnodev1.Frame { f.Body = nil; return f }, "body is empty"},
		{"tokens body", Limits{}, func(f *meshnodev1.Frame) *meshnodev1.Frame {
			f.Body = &meshnodev1.Frame_Tokens{Tokens: &meshnodev1.Tokens{}}
			return f
		}, "body is tokens"},
		{"dtype unspecified", Limits{}, func(f *meshnodev1.Frame) *meshnodev1.Frame {
			act(f).Dtype = meshnodev1.DType_DTYPE_UNSPECIFIED
			return f
		}, "unknown dtype 0"},
		{"dtype unknown", Limits{}, func(f *meshnodev1.Frame) *meshnodev1.Frame { act(f).Dtype = 99; return f }, "unknown dtype 99"},
		{"dtype negative", Limits{}, func(f *meshnodev1.Frame) *meshnodev1.Frame { act(f).Dtype = -1; return f }, "unknown dtype -1"},
		{"zero rows", Limits{}, func(f *meshnodev1.Frame) *meshnodev1.Frame { act(f).Rows = 0; return f }, "not positive"},
		{"zero cols", Limits{}, func(f *meshnodev1.Frame) *meshnodev1.Frame { act(f).Cols = 0; return f }, "not positive"},
		{"rows over limit", Limits{MaxRows: 2}, func(f *meshnodev1.Frame) *meshnodev1.Frame { return f }, "3 rows, over the limit of 2"},
		{"cols over limit", Limits{MaxCols: 1}, func(f *meshnodev1.Frame) *meshnodev1.Frame { return f }, "2 cols, over the limit of 1"},
		{"payload over limit", Limits{MaxPayload: 11}, func(f *meshnodev1.Frame) *meshnodev1.Frame { return f }, "over the payload limit of 11"},
		{"payload over default limit", Limits{}, func(f *meshnodev1.Frame) *meshnodev1.Frame {
			act(f).Rows, act(f).Cols = 1<<16, 1<<14 // 2 GiB in f16
			return f
		}, "over the payload limit"},
		// Each of these shapes overflows an int on 32-bit platforms, and
		// the last one uint64 as well; with the limits out of the way only
		// the payload arithmetic stands between them and a panic.
		{"shape overflows 32 bits", huge, func(f *meshnodev1.Frame) *meshnodev1.Frame {
			act(f).Rows, act(f).Cols = 1<<16, 1<<16
			return f
		}, "over the payload limit"},
		// (On 32-bit platforms the row limit, MaxInt, catches it first.)
		{"shape overflows 64 bits", huge, func(f *meshnodev1.Frame) *meshnodev1.Frame {
			act(f).Rows, act(f).Cols = math.MaxUint32, math.MaxUint32
			return f
		}, "over the"},
		{"payload short", Limits{}, func(f *meshnodev1.Frame) *meshnodev1.Frame { act(f).Payload = act(f).Payload[1:]; return f }, "needs 12 payload bytes, got 11"},
		{"payload long", Limits{}, func(f *meshnodev1.Frame) *meshnodev1.Frame {
			act(f).Payload = append(act(f).Payload, 0)
			return f
		}, "needs 12 payload bytes, got 13"},
		{"payload for f32", Limits{}, func(f *meshnodev1.Frame) *meshnodev1.Frame {
			act(f).Dtype = meshnodev1.DType_DTYPE_F32
			return f
		}, "needs 24 payload bytes, got 12"},
		{"rows disagree with payload", Limits{}, func(f *meshnodev1.Frame) *meshnodev1.Frame { act(f).Rows = 2; return f }, "needs 8 payload bytes"},
		{"seq ids short", Limits{}, func(f *meshnodev1.Frame) *meshnodev1.Frame { act(f).SeqIds = act(f).SeqIds[:2]; return f }, "3 rows but 2 sequence ids"},
		{"seq ids long", Limits{}, func(f *meshnodev1.Frame) *meshnodev1.Frame {
			act(f).SeqIds = append(act(f).SeqIds, 3)
			return f
		}, "3 rows but 4 sequence ids"},
		{"positions short", Limits{}, func(f *meshnodev1.Frame) *meshnodev1.Frame { act(f).Positions = nil; return f }, "3 rows but 0 positions"},
		{"negative position", Limits{}, func(f *meshnodev1.Frame) *meshnodev1.Frame { act(f).Positions[2] = -5; return f }, "row 2 has negative position -5"},
		{"output row out of range", Limits{}, func(f *meshnodev1.Frame) *meshnodev1.Frame { act(f).OutputRows = []uint32{3}; return f }, "outside [0,3)"},
		{"output row huge", Limits{}, func(f *meshnodev1.Frame) *meshnodev1.Frame {
			act(f).OutputRows = []uint32{math.MaxUint32}
			return f
		}, "outside [0,3)"},
		{"output rows descending", Limits{}, func(f *meshnodev1.Frame) *meshnodev1.Frame { act(f).OutputRows = []uint32{2, 1}; return f }, "not strictly ascending"},
		{"output rows repeated", Limits{}, func(f *meshnodev1.Frame) *meshnodev1.Frame { act(f).OutputRows = []uint32{1, 1}; return f }, "not strictly ascending"},
		{"too many output rows", Limits{}, func(f *meshnodev1.Frame) *meshnodev1.Frame {
			act(f).OutputRows = []uint32{0, 1, 2, 2}
			return f
		}, "4 output rows in a batch of 3"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f := tc.edit(validActivations())
			if f != nil {
				f = viaWire(t, f)
			}
			b, err := DecodeBatch(f, tc.lim)
			if err == nil {
				t.Fatalf("decoded %+v, want an error", b)
			}
			if !errors.Is(err, ErrBadFrame) {
				t.Fatalf("error %q does not wrap ErrBadFrame", err)
			}
			if !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("error %q does not say %q", err, tc.want)
			}
			if b != nil {
				t.Fatal("batch returned with an error")
			}
		})
	}
	if _, err := DecodeBatch(validActivations(), Limits{}); err != nil {
		t.Fatalf("the valid frame of the table fails: %v", err)
	}
	f := validActivations()
	f.Version = 7
	if _, err := DecodeBatch(f, Limits{}); !errors.Is(err, ErrVersion) {
		t.Fatalf("wrong version: %v does not wrap ErrVersion", err)
	}
}

func validTokens() *meshnodev1.Frame {
	return &meshnodev1.Frame{
		Version: Version,
		Step:    4,
		Body: &meshnodev1.Frame_Tokens{Tokens: &meshnodev1.Tokens{
			SeqIds:     []uint64{5, 5},
			Positions:  []int32{10, 11},
			TokenIds:   []int32{100, 200},
			OutputRows: []uint32{1},
		}},
	}
}

func TestDecodeTokensRejects(t *testing.T) {
	tok := func(f *meshnodev1.Frame) *meshnodev1.Tokens { return f.GetTokens() }
	tests := []struct {
		name string
		lim  Limits
		edit func(f *meshnodev1.Frame)
		want string
	}{
		{"version", Limits{}, func(f *meshnodev1.Frame) { f.Version = 3 }, "version 3"},
		{"activations body", Limits{}, func(f *meshnodev1.Frame) { f.Body = validActivations().Body }, "body is activations"},
		{"no rows", Limits{}, func(f *meshnodev1.Frame) { f.Body = &meshnodev1.Frame_Tokens{Tokens: &meshnodev1.Tokens{}} }, "no rows"},
		{"rows over limit", Limits{MaxRows: 1}, func(*meshnodev1.Frame) {}, "2 rows, over the limit of 1"},
		{"positions short", Limits{}, func(f *meshnodev1.Frame) { tok(f).Positions = tok(f).Positions[:1] }, "2 rows but 1 positions"},
		{"negative position", Limits{}, func(f *meshnodev1.Frame) { tok(f).Positions[0] = math.MinInt32 }, "negative position"},
		{"token ids short", Limits{}, func(f *meshnodev1.Frame) { tok(f).TokenIds = tok(f).TokenIds[:1] }, "2 rows but 1 token ids"},
		{"token ids long", Limits{}, func(f *meshnodev1.Frame) { tok(f).TokenIds = append(tok(f).TokenIds, 1) }, "2 rows but 3 token ids"},
		{"negative token", Limits{}, func(f *meshnodev1.Frame) { tok(f).TokenIds[1] = -1 }, "row 1 token id -1"},
		{"token over vocab", Limits{MaxVocab: 200}, func(*meshnodev1.Frame) {}, "row 1 token id 200 outside [0,200)"},
		{"output row out of range", Limits{}, func(f *meshnodev1.Frame) { tok(f).OutputRows = []uint32{2} }, "outside [0,2)"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f := validTokens()
			tc.edit(f)
			_, err := DecodeTokens(viaWire(t, f), tc.lim)
			if !errors.Is(err, ErrBadFrame) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want ErrBadFrame saying %q", err, tc.want)
			}
		})
	}
	if _, err := DecodeTokens(validTokens(), Limits{}); err != nil {
		t.Fatalf("the valid frame of the table fails: %v", err)
	}
}

func TestLimitsDefaults(t *testing.T) {
	got := Limits{MaxRows: -1, MaxPayload: math.MaxInt}.resolved()
	if got != DefaultLimits() {
		t.Fatalf("resolved %+v, want %+v", got, DefaultLimits())
	}
	if l := (Limits{MaxRows: 5}).resolved(); l.MaxRows != 5 {
		t.Fatalf("explicit MaxRows lost: %+v", l)
	}
}
