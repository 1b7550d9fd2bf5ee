package wire

import (
	"errors"
	"fmt"
	"math"
	"slices"
	"strings"
	"testing"
	"unicode/utf8"

	meshnodev1 "github.com/meshnode/meshnode/proto/meshnode/v1"
	"github.com/meshnode/meshnode/stage"
)

func TestControlRoundTrip(t *testing.T) {
	for _, c := range []Control{
		{Op: OpOpen, Seq: 1},
		{Op: OpOpen, Seq: math.MaxUint64, Sampling: &Sampling{Temperature: 0.7, TopK: 40, TopP: 0.9, MinP: 0.05, Seed: 12345}},
		{Op: OpOpen, Seq: 5, Sampling: &Sampling{Logprobs: true, TopLogprobs: 20}},
		{Op: OpOpen, Seq: 6, Sampling: &Sampling{JSON: true, JSONFrom: 12}},
		{Op: OpOpen, Seq: 7, Sampling: &Sampling{JSON: true, JSONSchema: `{"type":"object"}`}},
		{Op: OpTrim, Seq: 2, Pos: 0},
		{Op: OpTrim, Seq: 2, Pos: math.MaxInt32},
		{Op: OpRelease, Seq: 3},
	} {
		f, err := EncodeControl(11, c)
		if err != nil {
			t.Fatalf("%+v: %v", c, err)
		}
		got, err := DecodeControl(viaWire(t, f), Limits{})
		if err != nil {
			t.Fatalf("%+v: %v", c, err)
		}
		if got.Op != c.Op || got.Seq != c.Seq || got.Pos != c.Pos || (got.Sampling == nil) != (c.Sampling == nil) {
			t.Fatalf("got %+v, want %+v", got, c)
		}
		if c.Sampling != nil && *got.Sampling != *c.Sampling {
			t.Fatalf("sampling %+v, want %+v", *got.Sampling, *c.Sampling)
		}
	}
}

func TestControlRejects(t *testing.T) {
	nan := float32(math.NaN())
	tests := []struct {
		name string
		lim  Limits
		sc   *meshnodev1.SeqControl
		want string
	}{
		{"unspecified op", Limits{}, &meshnodev1.SeqControl{SeqId: 1}, "unknown op 0"},
		{"unknown op", Limits{}, &meshnodev1.SeqControl{Op: 42, SeqId: 1}, "unknown op 42"},
		{"trim negative", Limits{}, &meshnodev1.SeqControl{Op: meshnodev1.SeqControl_OP_TRIM, Position: -1}, "trim position -1"},
		{"open with position", Limits{}, &meshnodev1.SeqControl{Op: meshnodev1.SeqControl_OP_OPEN, Position: 3}, "open carries a position"},
		{"release with sampling", Limits{}, &meshnodev1.SeqControl{Op: meshnodev1.SeqControl_OP_RELEASE, Sampling: &meshnodev1.Sampling{}}, "release carries sampling"},
		{"NaN temperature", Limits{}, &meshnodev1.SeqControl{Op: meshnodev1.SeqControl_OP_OPEN, Sampling: &meshnodev1.Sampling{Temperature: nan}}, "temperature"},
		{"negative temperature", Limits{}, &meshnodev1.SeqControl{Op: meshnodev1.SeqControl_OP_OPEN, Sampling: &meshnodev1.Sampling{Temperature: -1}}, "temperature"},
		{"top_p over 1", Limits{}, &meshnodev1.SeqControl{Op: meshnodev1.SeqControl_OP_OPEN, Sampling: &meshnodev1.Sampling{TopP: 1.5}}, "top_p"},
		{"min_p infinite", Limits{}, &meshnodev1.SeqControl{Op: meshnodev1.SeqControl_OP_OPEN, Sampling: &meshnodev1.Sampling{MinP: float32(math.Inf(1))}}, "min_p"},
		{"top_k over vocab", Limits{MaxVocab: 100}, &meshnodev1.SeqControl{Op: meshnodev1.SeqControl_OP_OPEN, Sampling: &meshnodev1.Sampling{TopK: 101}}, "top_k 101"},
		{"top_k huge", Limits{}, &meshnodev1.SeqControl{Op: meshnodev1.SeqControl_OP_OPEN, Sampling: &meshnodev1.Sampling{TopK: math.MaxUint32}}, "top_k 4294967295"},
		{"top_logprobs over 20", Limits{}, &meshnodev1.SeqControl{Op: meshnodev1.SeqControl_OP_OPEN, Sampling: &meshnodev1.Sampling{Logprobs: true, TopLogprobs: 21}}, "top_logprobs 21"},
		{"top_logprobs huge", Limits{}, &meshnodev1.SeqControl{Op: meshnodev1.SeqControl_OP_OPEN, Sampling: &meshnodev1.Sampling{Logprobs: true, TopLogprobs: math.MaxUint32}}, "top_logprobs 4294967295"},
		{"top_logprobs without logprobs", Limits{}, &meshnodev1.SeqControl{Op: meshnodev1.SeqControl_OP_OPEN, Sampling: &meshnodev1.Sampling{TopLogprobs: 2}}, "without logprobs"},
		{"json_from huge", Limits{}, &meshnodev1.SeqControl{Op: meshnodev1.SeqControl_OP_OPEN, Sampling: &meshnodev1.Sampling{JsonObject: true, JsonFrom: math.MaxUint32}}, "json_from 4294967295"},
		{"json_from without json", Limits{}, &meshnodev1.SeqControl{Op: meshnodev1.SeqControl_OP_OPEN, Sampling: &meshnodev1.Sampling{JsonFrom: 3}}, "without json_object"},
		{"json_schema without json", Limits{}, &meshnodev1.SeqControl{Op: meshnodev1.SeqControl_OP_OPEN, Sampling: &meshnodev1.Sampling{JsonSchema: "{}"}}, "json_schema without json_object"},
		{"json_schema too long", Limits{}, &meshnodev1.SeqControl{Op: meshnodev1.SeqControl_OP_OPEN, Sampling: &meshnodev1.Sampling{JsonObject: true, JsonSchema: strings.Repeat(" ", MaxSchemaBytes+1)}}, "over the limit"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			f := &meshnodev1.Frame{Version: Version, Body: &meshnodev1.Frame_Control{Control: tc.sc}}
			_, err := DecodeControl(viaWire(t, f), tc.lim)
			if !errors.Is(err, ErrBadFrame) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want ErrBadFrame saying %q", err, tc.want)
			}
		})
	}
	if _, err := DecodeControl(validTokens(), Limits{}); !errors.Is(err, ErrBadFrame) {
		t.Fatalf("tokens frame as control: got %v", err)
	}
	if _, err := EncodeControl(1, Control{Op: OpRelease, Pos: 4}); !errors.Is(err, ErrBadBatch) {
		t.Fatalf("encoding a release with a position: got %v", err)
	}
}

func TestErrorFrames(t *testing.T) {
	tests := []struct {
		err  error
		code meshnodev1.Error_Code
		is   error // what the decoded error must match; nil for none
	}{
		{fmt.Errorf("open seq 4: %w", stage.ErrNoSlot), meshnodev1.Error_CODE_NO_SLOT, stage.ErrNoSlot},
		{stage.ErrUnknownSeq, meshnodev1.Error_CODE_UNKNOWN_SEQ, stage.ErrUnknownSeq},
		{stage.ErrSeqExists, meshnodev1.Error_CODE_SEQ_EXISTS, stage.ErrSeqExists},
		{fmt.Errorf("dial: %w", ErrUnavailable), meshnodev1.Error_CODE_UNAVAILABLE, ErrUnavailable},
		{checkFrame(&meshnodev1.Frame{Version: 9}), meshnodev1.Error_CODE_UNSUPPORTED_VERSION, ErrVersion},
		{checkFrame(nil), meshnodev1.Error_CODE_BAD_FRAME, nil},
		{errors.New("ggml: out of memory"), meshnodev1.Error_CODE_ENGINE, nil},
	}
	for _, tc := range tests {
		f := EncodeError(77, tc.err)
		re, err := DecodeError(viaWire(t, f))
		if err != nil {
			t.Fatal(err)
		}
		if re.Code != tc.code || re.Step != 77 || re.Message != tc.err.Error() {
			t.Fatalf("%v: decoded %+v", tc.err, re)
		}
		if tc.is != nil && !errors.Is(re, tc.is) {
			t.Fatalf("%v: decoded error does not match %v", tc.err, tc.is)
		}
		// Reporting a bad frame is not sending one.
		if errors.Is(re, ErrBadFrame) {
			t.Fatalf("%v: remote error matches ErrBadFrame", tc.err)
		}
		// Passed up another hop, the error keeps its code and message.
		again, err := DecodeError(viaWire(t, EncodeError(78, fmt.Errorf("stage 2: %w", re))))
		if err != nil || again.Code != tc.code || again.Message != re.Message {
			t.Fatalf("%v: forwarded as %+v, %v", tc.err, again, err)
		}
	}

	long := "a" + strings.Repeat("é", MaxErrorMessage) // the cut falls mid-rune
	re, err := DecodeError(EncodeError(1, errors.New(long)))
	if err != nil {
		t.Fatal(err)
	}
	if len(re.Message) > MaxErrorMessage || !utf8.ValidString(re.Message) || len(re.Message) < MaxErrorMessage-1 {
		t.Fatalf("long message cut to %d bytes, valid UTF-8 %v", len(re.Message), utf8.ValidString(re.Message))
	}
	if _, err := DecodeError(validTokens()); !errors.Is(err, ErrBadFrame) {
		t.Fatalf("tokens frame as error: got %v", err)
	}
}

func TestLogits(t *testing.T) {
	vals := []float32{1, -2, 3.5, float32(math.Inf(-1)), 0, 1e-30}
	f, err := EncodeLogits(5, 2, 3, vals)
	if err != nil {
		t.Fatal(err)
	}
	got, rows, vocab, err := DecodeLogits(viaWire(t, f), Limits{})
	if err != nil {
		t.Fatal(err)
	}
	if rows != 2 || vocab != 3 || !slices.Equal(got, vals) {
		t.Fatalf("got %v [%d,%d]", got, rows, vocab)
	}
	if _, err := EncodeLogits(5, 2, 2, vals); !errors.Is(err, ErrBadBatch) {
		t.Fatalf("logits of the wrong length: %v", err)
	}

	huge := Limits{MaxRows: math.MaxInt, MaxVocab: math.MaxInt, MaxPayload: math.MaxInt}
	for _, tc := range []struct {
		name        string
		lim         Limits
		rows, vocab uint32
		payload     int
		want        string
	}{
		{"zero rows", Limits{}, 0, 3, 0, "not positive"},
		{"payload short", Limits{}, 2, 3, 23, "needs 24 payload bytes, got 23"},
		{"vocab over limit", Limits{MaxVocab: 2}, 2, 3, 24, "over the limits"},
		{"shape overflows", huge, math.MaxUint32, math.MaxUint32, 24, "over the"}, // row limit first on 32-bit
	} {
		f := &meshnodev1.Frame{Version: Version, Body: &meshnodev1.Frame_Logits{Logits: &meshnodev1.Logits{
			Rows: tc.rows, Vocab: tc.vocab, Payload: make([]byte, tc.payload),
		}}}
		_, _, _, err := DecodeLogits(viaWire(t, f), tc.lim)
		if !errors.Is(err, ErrBadFrame) || !strings.Contains(err.Error(), tc.want) {
			t.Fatalf("%s: got %v, want ErrBadFrame saying %q", tc.name, err, tc.want)
		}
	}
}

func testInfo() Info {
	return Info{
		Info: stage.Info{
			Arch: "qwen3", Layers: 28, Embd: 1024, Vocab: 151936, Start: 14, End: 28,
			Context: 40960, MaxSeqs: 8, WireDType: stage.F16, Engine: "ggml", Backend: "CPU",
		},
		ModelID:   "Qwen/Qwen3-0.6B-GGUF",
		ModelHash: "sha256:" + strings.Repeat("ab", 32),
	}
}

func TestInfoRoundTrip(t *testing.T) {
	in := testInfo()
	p, err := EncodeInfo(in)
	if err != nil {
		t.Fatal(err)
	}
	got, err := DecodeInfo(p, Limits{})
	if err != nil {
		t.Fatal(err)
	}
	want := in
	want.ProtocolVersion, want.MaxFrameBytes = Version, MaxFrameBytes
	if got != want {
		t.Fatalf("got %+v\nwant %+v", got, want)
	}
}

func TestInfoRejects(t *testing.T) {
	tests := []struct {
		name string
		edit func(p *meshnodev1.StageInfo)
		want string
	}{
		{"no layers", func(p *meshnodev1.StageInfo) { p.Layers = 0 }, "layers 0"},
		{"empty range", func(p *meshnodev1.StageInfo) { p.Start = p.End }, "layer range"},
		{"range past layers", func(p *meshnodev1.StageInfo) { p.End = p.Layers + 1 }, "layer range"},
		{"no embd", func(p *meshnodev1.StageInfo) { p.Embd = 0 }, "embd 0"},
		{"embd over limit", func(p *meshnodev1.StageInfo) { p.Embd = DefaultMaxCols + 1 }, "embd"},
		{"vocab over limit", func(p *meshnodev1.StageInfo) { p.Vocab = DefaultMaxVocab + 1 }, "vocab"},
		{"context wraps int32", func(p *meshnodev1.StageInfo) { p.Context = math.MaxUint32 }, "context 4294967295 too large"},
		{"unknown dtype", func(p *meshnodev1.StageInfo) { p.WireDtype = 0 }, "wire dtype"},
		{"no protocol version", func(p *meshnodev1.StageInfo) { p.ProtocolVersion = 0 }, "protocol version 0"},
		{"long model id", func(p *meshnodev1.StageInfo) { p.ModelId = strings.Repeat("x", 300) }, "model id is 300 bytes"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			p, err := EncodeInfo(testInfo())
			if err != nil {
				t.Fatal(err)
			}
			tc.edit(p)
			_, err = DecodeInfo(p, Limits{})
			if !errors.Is(err, ErrBadFrame) || !strings.Contains(err.Error(), tc.want) {
				t.Fatalf("got %v, want ErrBadFrame saying %q", err, tc.want)
			}
		})
	}
	if _, err := DecodeInfo(nil, Limits{}); !errors.Is(err, ErrBadFrame) {
		t.Fatalf("nil info: %v", err)
	}
	bad := testInfo()
	bad.End = 29
	if _, err := EncodeInfo(bad); !errors.Is(err, ErrBadBatch) {
		t.Fatalf("encoding a bad range: %v", err)
	}
}
