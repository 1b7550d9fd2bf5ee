package wire

import (
	"errors"
	"flag"
	"fmt"
	"math"
	"os"
	"path/filepath"
	"slices"
	"testing"

	"google.golang.org/protobuf/proto"

	"github.com/meshnode/meshnode/node/sample"
	meshnodev1 "github.com/meshnode/meshnode/proto/meshnode/v1"
	"github.com/meshnode/meshnode/stage"
)

var updateCorpus = flag.Bool("update-corpus", false, "rewrite testdata/fuzz/FuzzDecodeFrame from fuzzSeeds")

// fuzzSeeds are marshalled frames, valid and broken, that start the fuzzer
// near the interesting edges. They are also committed as the seed corpus
// (go test -run TestFuzzCorpus -update-corpus rewrites it).
func fuzzSeeds(t testing.TB) map[string][]byte {
	t.Helper()
	seeds := map[string][]byte{}
	add := func(name string, f *meshnodev1.Frame, err error) {
		t.Helper()
		if err != nil {
			t.Fatal(err)
		}
		data, err := proto.Marshal(f)
		if err != nil {
			t.Fatal(err)
		}
		seeds[name] = data
	}
	h, err := stage.NewActivation(stage.F32, 2, 3, []float32{1, -2, 3, 0.5, 1e-6, -65504})
	if err != nil {
		t.Fatal(err)
	}
	b := &stage.Batch{Seqs: []stage.SeqID{1, 2}, Pos: []int32{0, 7}, Hidden: h, Outputs: []int{0, 1}}
	f, err := EncodeBatch(1, b, stage.F16)
	add("valid-activations-f16", f, err)
	f, err = EncodeBatch(2, b, stage.F32)
	add("valid-activations-f32", f, err)
	f, err = EncodeBatch(2, b, stage.BF16)
	add("valid-activations-bf16", f, err)
	f, err = EncodeTokens(3, &stage.Batch{Seqs: []stage.SeqID{9, 9}, Pos: []int32{0, 1}, Tokens: []int32{1, 2}, Outputs: []int{1}})
	add("valid-tokens", f, err)
	f, err = EncodeControl(4, Control{Op: OpOpen, Seq: 9, Sampling: &Sampling{Temperature: 0.8, TopK: 40, TopP: 0.95, Seed: 1}})
	add("valid-control-open", f, err)
	f, err = EncodeControl(5, Control{Op: OpTrim, Seq: 9, Pos: 12})
	add("valid-control-trim", f, err)
	add("valid-error", EncodeError(6, stage.ErrNoSlot), nil)
	f, err = EncodeLogits(7, 1, 4, []float32{0, 1, 2, 3})
	add("valid-logits", f, err)
	f, err = EncodeSetup(Setup{
		Role: RoleForward, PipelineID: "p1", Origin: "o", Hop: 1, WireDType: stage.F16,
		Route: []Hop{{Peer: "a", Start: 0, End: 2}, {Peer: "b", Start: 2, End: 5, MaxFrameBytes: 1 << 20}},
	})
	add("valid-setup", f, err)
	f, err = EncodeSampled(9, &Sampled{Seqs: []stage.SeqID{1, 2}, Pos: []int32{5, 9}, Tokens: []int32{3, 4}})
	add("valid-sampled", f, err)
	f, err = EncodeSampled(13, &Sampled{Seqs: []stage.SeqID{1}, Pos: []int32{5}, Tokens: []int32{3},
		Logprobs: []sample.Logprob{{Logprob: -0.5, Top: []sample.TopLogprob{{Token: 3, Logprob: -0.5}, {Token: 1, Logprob: -2}}}}})
	add("valid-sampled-logprobs", f, err)
	f, err = EncodeControl(10, Control{Op: OpOpen, Seq: 3, History: []int32{1, 2, 3}, Sampling: &Sampling{RepeatPenalty: 1.1, RepeatLastN: -1}})
	add("valid-control-history", f, err)
	add("valid-hop-error", EncodeHopError(11, 2, stage.ErrNoSlot), nil)
	tb := &stage.Batch{Seqs: b.Seqs, Pos: b.Pos, Tokens: []int32{7, 8}, Hidden: h, Outputs: b.Outputs}
	f, err = EncodeBatch(12, tb, stage.F16)
	if err == nil {
		f.GetActivations().More = true
	}
	add("valid-activations-tokens-more", f, err)

	broken := func(name string, edit func(a *meshnodev1.Activations, f *meshnodev1.Frame)) {
		f, err := EncodeBatch(8, b, stage.F16)
		if err != nil {
			t.Fatal(err)
		}
		edit(f.GetActivations(), f)
		add(name, f, nil)
	}
	broken("bad-version", func(_ *meshnodev1.Activations, f *meshnodev1.Frame) { f.Version = 2 })
	broken("bad-dtype", func(a *meshnodev1.Activations, _ *meshnodev1.Frame) { a.Dtype = 7 })
	broken("bad-payload-short", func(a *meshnodev1.Activations, _ *meshnodev1.Frame) { a.Payload = a.Payload[:5] })
	broken("bad-shape-overflow", func(a *meshnodev1.Activations, _ *meshnodev1.Frame) { a.Rows, a.Cols = math.MaxUint32, math.MaxUint32 })
	broken("bad-seq-ids", func(a *meshnodev1.Activations, _ *meshnodev1.Frame) { a.SeqIds = a.SeqIds[:1] })
	broken("bad-position", func(a *meshnodev1.Activations, _ *meshnodev1.Frame) { a.Positions = []int32{-1, 7} }) // a new slice: the frame aliases b.Pos
	broken("bad-outputs", func(a *meshnodev1.Activations, _ *meshnodev1.Frame) { a.OutputRows = []uint32{1, 0} })
	seeds["bad-truncated"] = seeds["valid-activations-f16"][:len(seeds["valid-activations-f16"])-3]
	seeds["bad-garbage"] = []byte("\xff\xff\xff\xff\x0f not a frame")
	return seeds
}

func TestFuzzCorpus(t *testing.T) {
	if !*updateCorpus {
		t.Skip("run with -update-corpus to rewrite the seed corpus")
	}
	dir := filepath.Join("testdata", "fuzz", "FuzzDecodeFrame")
	if err := os.MkdirAll(dir, 0o755); err != nil {
		t.Fatal(err)
	}
	for name, data := range fuzzSeeds(t) {
		body := fmt.Sprintf("go test fuzz v1\n[]byte(%q)\n", data)
		if err := os.WriteFile(filepath.Join(dir, name), []byte(body), 0o644); err != nil {
			t.Fatal(err)
		}
	}
}

// FuzzDecodeFrame feeds arbitrary bytes through proto.Unmarshal and every
// decoder: none may panic, every failure must wrap ErrBadFrame, and every
// success must be internally consistent and survive a re-encode. The
// out-of-line codec must read every input as proto does.
func FuzzDecodeFrame(f *testing.F) {
	for _, data := range fuzzSeeds(f) {
		f.Add(data)
	}
	small := Limits{MaxRows: 8, MaxCols: 8, MaxVocab: 64, MaxPayload: 256}
	f.Fuzz(func(t *testing.T, data []byte) {
		var fr meshnodev1.Frame
		perr := proto.Unmarshal(data, &fr)
		checkOutOfLine(t, data, &fr, perr)
		if perr != nil {
			return
		}
		for _, lim := range []Limits{{}, small} {
			fuzzBatch(t, &fr, lim)
			fuzzTokens(t, &fr, lim)
			if c, err := DecodeControl(&fr, lim); err == nil {
				if _, err := EncodeControl(fr.GetStep(), c); err != nil {
					t.Fatalf("decoded control %+v does not encode: %v", c, err)
				}
			} else {
				mustBeBad(t, err)
			}
			if l, rows, vocab, err := DecodeLogits(&fr, lim); err == nil {
				if len(l) != rows*vocab {
					t.Fatalf("%d logits for [%d,%d]", len(l), rows, vocab)
				}
			} else {
				mustBeBad(t, err)
			}
			if _, err := DecodeError(&fr); err != nil {
				mustBeBad(t, err)
			}
			if s, err := DecodeSetup(&fr); err == nil {
				if _, err := EncodeSetup(s); err != nil {
					t.Fatalf("decoded setup %+v does not encode: %v", s, err)
				}
			} else {
				mustBeBad(t, err)
			}
			if s, err := DecodeSampled(&fr, lim); err == nil {
				if _, err := EncodeSampled(fr.GetStep(), s); err != nil {
					t.Fatalf("decoded sampled tokens %+v do not encode: %v", s, err)
				}
			} else {
				mustBeBad(t, err)
			}
		}
	})
}

func mustBeBad(t *testing.T, err error) {
	t.Helper()
	if !errors.Is(err, ErrBadFrame) {
		t.Fatalf("decode error %q does not wrap ErrBadFrame", err)
	}
}

func fuzzBatch(t *testing.T, fr *meshnodev1.Frame, lim Limits) {
	b, err := DecodeBatch(fr, lim)
	if err != nil {
		mustBeBad(t, err)
		return
	}
	l := lim.resolved()
	if b.Rows() > l.MaxRows || b.Hidden.Cols > l.MaxCols || len(b.Hidden.Data) > l.MaxPayload {
		t.Fatalf("batch [%d,%d] of %d bytes passed limits %+v", b.Rows(), b.Hidden.Cols, len(b.Hidden.Data), l)
	}
	info := stage.Info{Layers: 2, Start: 1, End: 2, Embd: b.Hidden.Cols}
	if err := b.Validate(info); err != nil {
		t.Fatalf("decoded batch fails stage validation: %v", err)
	}
	again, err := EncodeBatch(fr.GetStep(), b, b.Hidden.DType)
	if err != nil {
		t.Fatalf("decoded batch does not encode: %v", err)
	}
	b2, err := DecodeBatch(again, lim)
	if err != nil {
		t.Fatalf("re-encoded batch does not decode: %v", err)
	}
	if !slices.Equal(b.Seqs, b2.Seqs) || !slices.Equal(b.Pos, b2.Pos) || !slices.Equal(b.Outputs, b2.Outputs) ||
		!slices.Equal(b.Tokens, b2.Tokens) || string(b.Hidden.Data) != string(b2.Hidden.Data) {
		t.Fatal("batch changed on a re-encode")
	}
}

func fuzzTokens(t *testing.T, fr *meshnodev1.Frame, lim Limits) {
	b, err := DecodeTokens(fr, lim)
	if err != nil {
		mustBeBad(t, err)
		return
	}
	if err := b.Validate(stage.Info{Layers: 2, Start: 0, End: 1, Vocab: lim.resolved().MaxVocab}); err != nil {
		t.Fatalf("decoded tokens fail stage validation: %v", err)
	}
	again, err := EncodeTokens(fr.GetStep(), b)
	if err != nil {
		t.Fatalf("decoded tokens do not encode: %v", err)
	}
	b2, err := DecodeTokens(again, lim)
	if err != nil || !slices.Equal(b.Tokens, b2.Tokens) || !slices.Equal(b.Outputs, b2.Outputs) {
		t.Fatalf("tokens changed on a re-encode (%v)", err)
	}
}
