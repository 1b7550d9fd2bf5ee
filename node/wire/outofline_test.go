package wire

import (
	"math/rand/v2"
	"testing"
	"unsafe"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	meshnodev1 "github.com/meshnode/meshnode/proto/meshnode/v1"
	"github.com/meshnode/meshnode/stage"
)

func TestOutOfLine(t *testing.T) {
	r := rand.New(rand.NewPCG(7, 7))
	b := testBatch(t, 3, 1024, stage.F32, randFloats(r, 3*1024))
	b.Tokens = []int32{5, 6, 7}
	acts, err := EncodeBatch(41, b, stage.F32)
	if err != nil {
		t.Fatal(err)
	}
	acts.GetActivations().More = true
	withUnknown, err := EncodeBatch(42, b, stage.F16)
	if err != nil {
		t.Fatal(err)
	}
	withUnknown.ProtoReflect().SetUnknown(protowire.AppendVarint(protowire.AppendTag(nil, 99, protowire.VarintType), 3))
	withUnknown.GetActivations().ProtoReflect().SetUnknown(protowire.AppendBytes(protowire.AppendTag(nil, 77, protowire.BytesType), []byte("x")))
	tokens, err := EncodeTokens(43, &stage.Batch{Seqs: []stage.SeqID{1}, Pos: []int32{0}, Tokens: []int32{9}, Outputs: []int{0}})
	if err != nil {
		t.Fatal(err)
	}
	tests := []struct {
		name    string
		f       *meshnodev1.Frame
		outside bool // the payload goes out of line
	}{
		{"activations f32", acts, true},
		{"activations f16, unknown fields", withUnknown, true},
		{"activations, no payload", &meshnodev1.Frame{Version: Version, Step: 1, Body: &meshnodev1.Frame_Activations{Activations: &meshnodev1.Activations{Rows: 1}}}, false},
		{"tokens", tokens, false},
		{"error", EncodeError(44, stage.ErrNoSlot), false},
		{"empty", &meshnodev1.Frame{}, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			before := proto.Clone(tc.f)
			prefix := []byte("hdr")
			head, payload, err := AppendHead(prefix, tc.f)
			if err != nil {
				t.Fatal(err)
			}
			if !proto.Equal(tc.f, before) {
				t.Fatal("AppendHead changed the frame")
			}
			if string(head[:3]) != "hdr" {
				t.Fatal("AppendHead did not append to dst")
			}
			if got := payload != nil; got != tc.outside {
				t.Fatalf("payload out of line: %v, want %v", got, tc.outside)
			}
			if tc.outside && unsafe.SliceData(payload) != unsafe.SliceData(tc.f.GetActivations().GetPayload()) {
				t.Fatal("the payload out of line is a copy, not the frame's")
			}
			data := append(head[3:len(head):len(head)], payload...)
			var plain meshnodev1.Frame
			if err := proto.Unmarshal(data, &plain); err != nil {
				t.Fatalf("proto cannot read the encoding: %v", err)
			}
			if !proto.Equal(&plain, tc.f) {
				t.Fatalf("proto reads %v, want %v", &plain, tc.f)
			}
			var lent meshnodev1.Frame
			var scratch []byte
			if err := UnmarshalLent(data, &lent, &scratch); err != nil {
				t.Fatal(err)
			}
			if !proto.Equal(&lent, tc.f) {
				t.Fatalf("UnmarshalLent reads %v, want %v", &lent, tc.f)
			}
			if p := lent.GetActivations().GetPayload(); tc.outside && uintptr(unsafe.Pointer(unsafe.SliceData(p)))%4 != 0 {
				t.Fatal("the lent payload is not aligned for float32s")
			}
			if p := lent.GetActivations().GetPayload(); tc.outside {
				start := uintptr(unsafe.Pointer(unsafe.SliceData(data)))
				at := uintptr(unsafe.Pointer(unsafe.SliceData(p)))
				if at < start || at+uintptr(len(p)) > start+uintptr(len(data)) {
					t.Fatal("UnmarshalLent copied the payload")
				}
				if cap(p) != len(p) {
					t.Fatalf("lent payload has capacity %d beyond its %d bytes", cap(p), len(p))
				}
			}
		})
	}
}

// TestUnmarshalLentAligns: wherever the encoding lies in memory, the lent
// payload lands at a multiple of 16 bytes, or at least of 4, with its
// bytes intact.
func TestUnmarshalLentAligns(t *testing.T) {
	r := rand.New(rand.NewPCG(3, 3))
	b := testBatch(t, 2, 64, stage.F32, randFloats(r, 2*64))
	f, err := EncodeBatch(9, b, stage.F32)
	if err != nil {
		t.Fatal(err)
	}
	enc, err := proto.Marshal(f)
	if err != nil {
		t.Fatal(err)
	}
	at16 := 0
	for off := range 16 {
		buf := make([]byte, off+len(enc))
		data := buf[off:]
		copy(data, enc)
		var lent meshnodev1.Frame
		var scratch []byte
		if err := UnmarshalLent(data, &lent, &scratch); err != nil {
			t.Fatal(err)
		}
		if !proto.Equal(&lent, f) {
			t.Fatalf("offset %d: the lent frame differs", off)
		}
		p := lent.GetActivations().GetPayload()
		addr := uintptr(unsafe.Pointer(unsafe.SliceData(p)))
		if addr%4 != 0 {
			t.Fatalf("offset %d: payload at %#x", off, addr)
		}
		if addr%16 == 0 {
			at16++
		}
		got, err := (&stage.Activation{DType: stage.F32, Rows: 2, Cols: 64, Data: p}).Float32Shared()
		if err != nil || unsafe.SliceData(got) != (*float32)(unsafe.Pointer(unsafe.SliceData(p))) {
			t.Fatalf("offset %d: the payload is not read in place (%v)", off, err)
		}
	}
	if at16 == 0 {
		t.Error("no payload landed at a multiple of 16")
	}
}

// TestAppendHeadKeepsEveryField sets every field of a frame and of its
// activations, and checks that the out-of-line encoding keeps them all:
// AppendHead copies fields one by one, and a field added to the messages
// must be added there too.
func TestAppendHeadKeepsEveryField(t *testing.T) {
	a := &meshnodev1.Activations{}
	fill(t, a.ProtoReflect(), func(protoreflect.FieldDescriptor) bool { return true })
	if len(a.GetPayload()) == 0 {
		t.Fatal("no payload set")
	}
	f := &meshnodev1.Frame{}
	fill(t, f.ProtoReflect(), func(fd protoreflect.FieldDescriptor) bool { return fd.ContainingOneof() == nil })
	f.Body = &meshnodev1.Frame_Activations{Activations: a}
	head, payload, err := AppendHead(nil, f)
	if err != nil || payload == nil {
		t.Fatalf("AppendHead: payload %d bytes, %v", len(payload), err)
	}
	var back meshnodev1.Frame
	if err := proto.Unmarshal(append(head, payload...), &back); err != nil {
		t.Fatal(err)
	}
	if !proto.Equal(&back, f) {
		t.Fatalf("out of line %v, want %v", &back, f)
	}
}

// fill gives every field of m that want takes a value other than its zero.
func fill(t *testing.T, m protoreflect.Message, want func(protoreflect.FieldDescriptor) bool) {
	t.Helper()
	fields := m.Descriptor().Fields()
	for i := range fields.Len() {
		fd := fields.Get(i)
		if !want(fd) {
			continue
		}
		var v protoreflect.Value
		switch fd.Kind() {
		case protoreflect.BoolKind:
			v = protoreflect.ValueOfBool(true)
		case protoreflect.Int32Kind:
			v = protoreflect.ValueOfInt32(-3)
		case protoreflect.Uint32Kind:
			v = protoreflect.ValueOfUint32(5)
		case protoreflect.Uint64Kind:
			v = protoreflect.ValueOfUint64(1 << 40)
		case protoreflect.EnumKind:
			v = protoreflect.ValueOfEnum(1)
		case protoreflect.BytesKind:
			v = protoreflect.ValueOfBytes(make([]byte, 64))
		default:
			t.Fatalf("field %s: fill knows no %s", fd.FullName(), fd.Kind())
		}
		if fd.IsList() {
			l := m.NewField(fd).List()
			l.Append(v)
			l.Append(v)
			v = protoreflect.ValueOfList(l)
		}
		m.Set(fd, v)
	}
}

// TestUnmarshalLentAsProto covers encodings at the edges of the shape
// UnmarshalLent lends from: it must read them all as proto does.
func TestUnmarshalLentAsProto(t *testing.T) {
	act := func(fields ...[]byte) []byte {
		var in []byte
		for _, f := range fields {
			in = append(in, f...)
		}
		return protowire.AppendBytes(protowire.AppendTag(nil, activationsField, protowire.BytesType), in)
	}
	payload := func(s string) []byte {
		return protowire.AppendBytes(protowire.AppendTag(nil, payloadField, protowire.BytesType), []byte(s))
	}
	rows := protowire.AppendVarint(protowire.AppendTag(nil, 4, protowire.VarintType), 2)
	tokens := protowire.AppendBytes(protowire.AppendTag(nil, 11, protowire.BytesType), nil)
	cat := func(parts ...[]byte) []byte {
		var b []byte
		for _, p := range parts {
			b = append(b, p...)
		}
		return b
	}
	tests := []struct {
		name string
		data []byte
	}{
		{"two payloads: the last wins", act(payload("ab"), rows, payload("cd"))},
		{"body twice: merged", cat(act(payload("ab")), act(rows))},
		{"body twice, payload in each", cat(act(payload("ab")), act(payload("cd")))},
		{"tokens after the body: tokens win", cat(act(payload("ab")), tokens)},
		{"body after tokens", cat(tokens, act(payload("ab")))},
		{"empty payload", act(payload(""), rows)},
		{"truncated", act(payload("abcdef"))[:6]},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var want, got meshnodev1.Frame
			werr := proto.Unmarshal(tc.data, &want)
			var scratch []byte
			gerr := UnmarshalLent(tc.data, &got, &scratch)
			if (werr == nil) != (gerr == nil) {
				t.Fatalf("UnmarshalLent: %v; proto.Unmarshal: %v", gerr, werr)
			}
			if werr == nil && !proto.Equal(&got, &want) {
				t.Fatalf("UnmarshalLent reads %v, proto %v", &got, &want)
			}
		})
	}
}

// checkOutOfLine is FuzzDecodeFrame's check of the out-of-line codec on
// arbitrary bytes: UnmarshalLent reads them as proto.Unmarshal does
// (perr, fr), and a frame that decodes re-encodes by AppendHead to bytes
// that both read back as the same frame.
func checkOutOfLine(t *testing.T, data []byte, fr *meshnodev1.Frame, perr error) {
	t.Helper()
	var lent meshnodev1.Frame
	var scratch []byte
	err := UnmarshalLent(append([]byte(nil), data...), &lent, &scratch) // it moves the payload
	if (err == nil) != (perr == nil) {
		t.Fatalf("UnmarshalLent: %v; proto.Unmarshal: %v", err, perr)
	}
	if perr != nil {
		return
	}
	if !proto.Equal(&lent, fr) {
		t.Fatalf("UnmarshalLent reads %v, proto %v", &lent, fr)
	}
	head, payload, err := AppendHead(nil, fr)
	if err != nil {
		t.Fatalf("AppendHead: %v", err)
	}
	again := append(head, payload...)
	var back, backLent meshnodev1.Frame
	if err := proto.Unmarshal(again, &back); err != nil || !proto.Equal(&back, fr) {
		t.Fatalf("AppendHead's encoding reads back as %v (%v), want %v", &back, err, fr)
	}
	if err := UnmarshalLent(again, &backLent, &scratch); err != nil || !proto.Equal(&backLent, fr) {
		t.Fatalf("AppendHead's encoding reads back lent as %v (%v), want %v", &backLent, err, fr)
	}
}
