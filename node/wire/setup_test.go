package wire

import (
	"errors"
	"math"
	"reflect"
	"slices"
	"strings"
	"testing"

	"github.com/meshnode/meshnode/node/sample"
	meshnodev1 "github.com/meshnode/meshnode/proto/meshnode/v1"
	"github.com/meshnode/meshnode/stage"
)

func testSetup() Setup {
	return Setup{
		Role:       RoleForward,
		PipelineID: "0123456789abcdef",
		Origin:     "12D3KooWorigin",
		Route: []Hop{
			{Peer: "12D3KooWa", Start: 0, End: 10, MaxFrameBytes: 1 << 20},
			{Peer: "12D3KooWb", Start: 10, End: 20},
			{Peer: "12D3KooWc", Start: 20, End: 28, MaxFrameBytes: math.MaxUint64},
		},
		Hop:          1,
		WireDType:    stage.F16,
		ReturnLogits: true,
	}
}

func TestSetupRoundTrip(t *testing.T) {
	ret := testSetup()
	ret.Role, ret.Hop, ret.ReturnLogits, ret.WireDType = RoleReturn, 2, false, stage.F32
	for _, s := range []Setup{testSetup(), ret} {
		f, err := EncodeSetup(s)
		if err != nil {
			t.Fatal(err)
		}
		if BodyKind(f) != "setup" || f.GetStep() != 0 {
			t.Fatalf("frame is %s step %d", BodyKind(f), f.GetStep())
		}
		got, err := DecodeSetup(viaWire(t, f))
		if err != nil {
			t.Fatal(err)
		}
		if !reflect.DeepEqual(got, s) {
			t.Fatalf("got %+v\nwant %+v", got, s)
		}
	}
	s := testSetup()
	if s.Layers() != 28 || s.Last() || s.FrameLimit(0) != 1<<20 || s.FrameLimit(1) != MaxFrameBytes || s.FrameLimit(2) != MaxFrameBytes {
		t.Fatalf("layers %d last %v limits %d %d %d", s.Layers(), s.Last(), s.FrameLimit(0), s.FrameLimit(1), s.FrameLimit(2))
	}
}

func TestSetupRejects(t *testing.T) {
	tests := []struct {
		name string
		edit func(p *meshnodev1.Setup)
		want string
	}{
		{"no role", func(p *meshnodev1.Setup) { p.Role = 0 }, "unknown role 0"},
		{"unknown role", func(p *meshnodev1.Setup) { p.Role = 9 }, "unknown role 9"},
		{"no pipeline id", func(p *meshnodev1.Setup) { p.PipelineId = "" }, "pipeline id of 0 bytes"},
		{"long pipeline id", func(p *meshnodev1.Setup) { p.PipelineId = strings.Repeat("x", 129) }, "pipeline id of 129 bytes"},
		{"no origin", func(p *meshnodev1.Setup) { p.Origin = "" }, "origin of 0 bytes"},
		{"empty route", func(p *meshnodev1.Setup) { p.Route = nil }, "route of 0 hops"},
		{"long route", func(p *meshnodev1.Setup) {
			p.Route = nil
			for i := range MaxRouteHops + 1 {
				p.Route = append(p.Route, &meshnodev1.Hop{Peer: "p", Start: uint32(i), End: uint32(i + 1)})
			}
		}, "route of 65 hops"},
		{"hop outside route", func(p *meshnodev1.Setup) { p.Hop = 3 }, "hop 3 outside"},
		{"hop huge", func(p *meshnodev1.Setup) { p.Hop = math.MaxUint32 }, "hop 4294967295"},
		{"unknown dtype", func(p *meshnodev1.Setup) { p.WireDtype = 7 }, "unknown dtype 7"},
		{"return to a middle hop", func(p *meshnodev1.Setup) { p.Role = meshnodev1.Setup_ROLE_RETURN }, "not the last"},
		{"gap", func(p *meshnodev1.Setup) { p.Route[1].Start = 11 }, "hop 1 starts at layer 11, want 10"},
		{"not from 0", func(p *meshnodev1.Setup) { p.Route[0].Start = 1 }, "hop 0 starts at layer 1"},
		{"empty hop", func(p *meshnodev1.Setup) { p.Route[2].End = 20 }, "hop 2 layer range [20,20)"},
		{"range wraps", func(p *meshnodev1.Setup) { p.Route[2].End = math.MaxUint32 }, "too large"},
		{"nameless peer", func(p *meshnodev1.Setup) { p.Route[0].Peer = "" }, "hop 0 peer of 0 bytes"},
		{"nil hop", func(p *meshnodev1.Setup) { p.Route[1] = nil }, "hop 1"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f, err := EncodeSetup(testSetup())
			if err != nil {
				t.Fatal(err)
			}
			tc.edit(f.GetSetup())
			_, err = DecodeSetup(viaWire(t, f))
			if !errors.Is(err, ErrBadFrame) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want ErrBadFrame saying %q", err, tc.want)
			}
		})
	}
	if _, err := DecodeSetup(validTokens()); !errors.Is(err, ErrBadFrame) {
		t.Fatalf("tokens frame as setup: %v", err)
	}
	bad := testSetup()
	bad.Route[1].Start = 9
	if _, err := EncodeSetup(bad); !errors.Is(err, ErrBadBatch) {
		t.Fatalf("encoding a broken route: %v", err)
	}
}

func TestBatchTokenIDs(t *testing.T) {
	b := testBatch(t, 3, 4, stage.F32, make([]float32, 12))
	b.Tokens = []int32{5, 0, 511}
	f, err := EncodeBatch(9, b, stage.F16)
	if err != nil {
		t.Fatal(err)
	}
	got, err := DecodeBatch(viaWire(t, f), Limits{MaxVocab: 512})
	if err != nil {
		t.Fatal(err)
	}
	if !slices.Equal(got.Tokens, b.Tokens) {
		t.Fatalf("tokens %v, want %v", got.Tokens, b.Tokens)
	}
	if _, err := DecodeBatch(viaWire(t, f), Limits{MaxVocab: 511}); !errors.Is(err, ErrBadFrame) || !strings.Contains(err.Error(), "token id 511") {
		t.Fatalf("token over the vocabulary: %v", err)
	}
	f.GetActivations().TokenIds = []int32{1, 2}
	if _, err := DecodeBatch(viaWire(t, f), Limits{}); !errors.Is(err, ErrBadFrame) || !strings.Contains(err.Error(), "3 rows but 2 token ids") {
		t.Fatalf("short token ids: %v", err)
	}
	f.GetActivations().TokenIds = []int32{1, -2, 3}
	if _, err := DecodeBatch(viaWire(t, f), Limits{}); !errors.Is(err, ErrBadFrame) {
		t.Fatalf("negative token id: %v", err)
	}
	b.Tokens = []int32{1}
	if _, err := EncodeBatch(1, b, stage.F16); !errors.Is(err, ErrBadBatch) {
		t.Fatalf("encoding short token ids: %v", err)
	}
	b.Tokens = []int32{1, -1, 2}
	if _, err := EncodeBatch(1, b, stage.F16); !errors.Is(err, ErrBadBatch) {
		t.Fatalf("encoding a negative token id: %v", err)
	}
}

func TestSampled(t *testing.T) {
	for _, s := range []*Sampled{
		{},
		{Seqs: []stage.SeqID{3, math.MaxUint64}, Pos: []int32{8, math.MaxInt32}, Tokens: []int32{0, 151935}},
		{Seqs: []stage.SeqID{3, 4}, Pos: []int32{8, 2}, Tokens: []int32{0, 7}, Logprobs: []sample.Logprob{
			{Logprob: -0.25, Top: []sample.TopLogprob{{Token: 0, Logprob: -0.25}, {Token: 9, Logprob: float32(math.Inf(-1))}}},
			{}, // a row whose sequence did not ask
		}},
	} {
		f, err := EncodeSampled(4, s)
		if err != nil {
			t.Fatal(err)
		}
		got, err := DecodeSampled(viaWire(t, f), Limits{})
		if err != nil {
			t.Fatal(err)
		}
		if got.Rows() != s.Rows() || !slices.Equal(got.Seqs, s.Seqs) || !slices.Equal(got.Pos, s.Pos) || !slices.Equal(got.Tokens, s.Tokens) ||
			!slices.EqualFunc(got.Logprobs, s.Logprobs, func(a, b sample.Logprob) bool { return a.Logprob == b.Logprob && slices.Equal(a.Top, b.Top) }) {
			t.Fatalf("got %+v, want %+v", got, s)
		}
	}
	for _, tc := range []struct {
		name string
		tok  *meshnodev1.Tokens
		lim  Limits
		want string
	}{
		{"output rows", &meshnodev1.Tokens{SeqIds: []uint64{1}, Positions: []int32{1}, TokenIds: []int32{1}, OutputRows: []uint32{0}}, Limits{}, "output rows"},
		{"short positions", &meshnodev1.Tokens{SeqIds: []uint64{1, 2}, Positions: []int32{1}, TokenIds: []int32{1, 2}}, Limits{}, "positions"},
		{"short tokens", &meshnodev1.Tokens{SeqIds: []uint64{1, 2}, Positions: []int32{1, 2}, TokenIds: []int32{1}}, Limits{}, "token ids"},
		{"over vocab", &meshnodev1.Tokens{SeqIds: []uint64{1}, Positions: []int32{1}, TokenIds: []int32{64}}, Limits{MaxVocab: 64}, "token id 64"},
		{"too many rows", &meshnodev1.Tokens{SeqIds: []uint64{1, 2, 3}, Positions: []int32{1, 2, 3}, TokenIds: []int32{1, 2, 3}}, Limits{MaxRows: 2}, "over the limit"},
		{"logprobs for some rows", &meshnodev1.Tokens{SeqIds: []uint64{1, 2}, Positions: []int32{1, 2}, TokenIds: []int32{1, 2}, Logprobs: []*meshnodev1.TokenLogprob{{}}}, Limits{}, "1 log-probabilities"},
		{"positive logprob", &meshnodev1.Tokens{SeqIds: []uint64{1}, Positions: []int32{1}, TokenIds: []int32{1}, Logprobs: []*meshnodev1.TokenLogprob{{Logprob: 0.5}}}, Limits{}, "not <= 0"},
		{"NaN logprob", &meshnodev1.Tokens{SeqIds: []uint64{1}, Positions: []int32{1}, TokenIds: []int32{1}, Logprobs: []*meshnodev1.TokenLogprob{{Logprob: float32(math.NaN())}}}, Limits{}, "not <= 0"},
		{"NaN alternative", &meshnodev1.Tokens{SeqIds: []uint64{1}, Positions: []int32{1}, TokenIds: []int32{1}, Logprobs: []*meshnodev1.TokenLogprob{{TopTokenIds: []int32{1}, TopLogprobs: []float32{float32(math.NaN())}}}}, Limits{}, "alternative 0"},
		{"alternatives unpaired", &meshnodev1.Tokens{SeqIds: []uint64{1}, Positions: []int32{1}, TokenIds: []int32{1}, Logprobs: []*meshnodev1.TokenLogprob{{TopTokenIds: []int32{1, 2}, TopLogprobs: []float32{-1}}}}, Limits{}, "2 alternative tokens but 1"},
		{"alternative over vocab", &meshnodev1.Tokens{SeqIds: []uint64{1}, Positions: []int32{1}, TokenIds: []int32{1}, Logprobs: []*meshnodev1.TokenLogprob{{TopTokenIds: []int32{64}, TopLogprobs: []float32{-1}}}}, Limits{MaxVocab: 64}, "token id 64"},
		{"too many alternatives", &meshnodev1.Tokens{SeqIds: []uint64{1}, Positions: []int32{1}, TokenIds: []int32{1}, Logprobs: []*meshnodev1.TokenLogprob{{TopTokenIds: make([]int32, 21), TopLogprobs: make([]float32, 21)}}}, Limits{}, "21 alternatives"},
	} {
		f := &meshnodev1.Frame{Version: Version, Body: &meshnodev1.Frame_Tokens{Tokens: tc.tok}}
		if _, err := DecodeSampled(viaWire(t, f), tc.lim); !errors.Is(err, ErrBadFrame) || !strings.Contains(err.Error(), tc.want) {
			t.Fatalf("%s: got %v, want ErrBadFrame saying %q", tc.name, err, tc.want)
		}
	}
	if _, err := EncodeSampled(1, &Sampled{Seqs: []stage.SeqID{1}, Pos: []int32{1}}); !errors.Is(err, ErrBadBatch) {
		t.Fatalf("encoding without tokens: %v", err)
	}
	if _, err := EncodeSampled(1, &Sampled{Seqs: []stage.SeqID{1}, Pos: []int32{1}, Tokens: []int32{1}, Logprobs: []sample.Logprob{{Logprob: 1}}}); !errors.Is(err, ErrBadBatch) {
		t.Fatalf("encoding a positive log-probability: %v", err)
	}
}

func TestControlHistoryAndPenalties(t *testing.T) {
	c := Control{
		Op: OpOpen, Seq: 7, History: []int32{1, 2, 3, 151935},
		Sampling: &Sampling{Temperature: 0.5, TopP: 1, Seed: math.MaxUint64, RepeatPenalty: 1.1, RepeatLastN: -1, FrequencyPenalty: -2, PresencePenalty: 2},
	}
	f, err := EncodeControl(3, c)
	if err != nil {
		t.Fatal(err)
	}
	got, err := DecodeControl(viaWire(t, f), Limits{})
	if err != nil {
		t.Fatal(err)
	}
	if !reflect.DeepEqual(got, c) {
		t.Fatalf("got %+v %+v, want %+v %+v", got, *got.Sampling, c, *c.Sampling)
	}
	open := meshnodev1.SeqControl_OP_OPEN
	for _, tc := range []struct {
		name string
		sc   *meshnodev1.SeqControl
		lim  Limits
		want string
	}{
		{"history on trim", &meshnodev1.SeqControl{Op: meshnodev1.SeqControl_OP_TRIM, History: []int32{1}}, Limits{}, "trim carries history"},
		{"history over limit", &meshnodev1.SeqControl{Op: open, History: []int32{1, 2, 3}}, Limits{MaxHistory: 2}, "history of 3 tokens"},
		{"history over vocab", &meshnodev1.SeqControl{Op: open, History: []int32{1, 100}}, Limits{MaxVocab: 100}, "token id 100"},
		{"negative history", &meshnodev1.SeqControl{Op: open, History: []int32{-1}}, Limits{}, "token id -1"},
		{"negative repeat penalty", &meshnodev1.SeqControl{Op: open, Sampling: &meshnodev1.Sampling{RepeatPenalty: -1}}, Limits{}, "repeat_penalty"},
		{"NaN repeat penalty", &meshnodev1.SeqControl{Op: open, Sampling: &meshnodev1.Sampling{RepeatPenalty: float32(math.NaN())}}, Limits{}, "repeat_penalty"},
		{"repeat_last_n", &meshnodev1.SeqControl{Op: open, Sampling: &meshnodev1.Sampling{RepeatLastN: -2}}, Limits{}, "repeat_last_n -2"},
		{"frequency penalty", &meshnodev1.SeqControl{Op: open, Sampling: &meshnodev1.Sampling{FrequencyPenalty: 2.5}}, Limits{}, "frequency_penalty"},
		{"presence penalty", &meshnodev1.SeqControl{Op: open, Sampling: &meshnodev1.Sampling{PresencePenalty: -3}}, Limits{}, "presence_penalty"},
	} {
		f := &meshnodev1.Frame{Version: Version, Body: &meshnodev1.Frame_Control{Control: tc.sc}}
		if _, err := DecodeControl(viaWire(t, f), tc.lim); !errors.Is(err, ErrBadFrame) || !strings.Contains(err.Error(), tc.want) {
			t.Fatalf("%s: got %v, want ErrBadFrame saying %q", tc.name, err, tc.want)
		}
	}
	if _, err := EncodeControl(1, Control{Op: OpRelease, Seq: 1, History: []int32{1}}); !errors.Is(err, ErrBadBatch) {
		t.Fatalf("encoding a release with history: %v", err)
	}
}

func TestHopErrors(t *testing.T) {
	re, err := DecodeError(viaWire(t, EncodeHopError(5, 2, stage.ErrNoSlot)))
	if err != nil {
		t.Fatal(err)
	}
	if re.Hop != 2 || re.Code != meshnodev1.Error_CODE_NO_SLOT || re.Step != 5 || !errors.Is(re, stage.ErrNoSlot) {
		t.Fatalf("decoded %+v", re)
	}
	// Relayed by another stage, the hop and code stay.
	again, err := DecodeError(viaWire(t, EncodeHopError(5, re.Hop, re)))
	if err != nil || again.Hop != 2 || again.Code != re.Code || again.Message != re.Message {
		t.Fatalf("relayed as %+v, %v", again, err)
	}
	for _, f := range []*meshnodev1.Frame{EncodeError(1, stage.ErrNoSlot), EncodeHopError(1, -1, stage.ErrNoSlot)} {
		re, err := DecodeError(viaWire(t, f))
		if err != nil || re.Hop != -1 {
			t.Fatalf("no hop decoded as %+v, %v", re, err)
		}
	}
	f := EncodeError(1, stage.ErrNoSlot)
	huge := uint32(MaxRouteHops)
	f.GetError().Hop = &huge
	if _, err := DecodeError(viaWire(t, f)); !errors.Is(err, ErrBadFrame) {
		t.Fatalf("hop beyond any route: %v", err)
	}
	for code, fatal := range map[meshnodev1.Error_Code]bool{
		meshnodev1.Error_CODE_ENGINE:      false,
		meshnodev1.Error_CODE_NO_SLOT:     false,
		meshnodev1.Error_CODE_SEQ_EXISTS:  false,
		meshnodev1.Error_CODE_BAD_FRAME:   true,
		meshnodev1.Error_CODE_UNAVAILABLE: true,
		meshnodev1.Error_CODE_UNKNOWN_SEQ: true,
		meshnodev1.Error_CODE_UNSPECIFIED: true,
		meshnodev1.Error_Code(99):         true,
	} {
		if Fatal(code) != fatal {
			t.Errorf("Fatal(%s) = %v", code, !fatal)
		}
	}
}
