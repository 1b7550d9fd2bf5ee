package wire

import (
	"unsafe"

	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	meshnodev1 "github.com/meshnode/meshnode/proto/meshnode/v1"
)

// An activations frame's payload out of line: a transport that owns its
// framing (node/pipeline's socket streams) writes the encoding of a frame
// up to its payload, then the payload straight from the batch, and reads
// the payload back as a slice of its read buffer. On a hop of eight rows
// of an 8B model that spares two copies of 128 KiB and a 128 KiB
// allocation a step, for bytes that are proto's own encoding of the frame,
// which any decoder reads.

var (
	// frameBodies are the members of Frame's body oneof.
	frameBodies = (&meshnodev1.Frame{}).ProtoReflect().Descriptor().Oneofs().ByName("body").Fields()
	// Field numbers of the frame's activations body and of its payload,
	// from the descriptors, as frameBodies.
	activationsField = frameBodies.ByName("activations").Number()
	payloadField     = (&meshnodev1.Activations{}).ProtoReflect().Descriptor().Fields().ByName("payload").Number()
)

// AppendHead appends to dst the encoding of f but for its activations
// payload, which it returns: the bytes appended and then the payload are
// an encoding of f (the payload is its last field). A frame without a
// payload is appended whole, and the payload is nil.
func AppendHead(dst []byte, f *meshnodev1.Frame) (head, payload []byte, err error) {
	a := f.GetActivations()
	if len(a.GetPayload()) == 0 {
		head, err = proto.MarshalOptions{}.MarshalAppend(dst, f)
		return head, nil, err
	}
	payload = a.GetPayload()
	// Shallow copies without the body, and the body without its payload:
	// they share f's memory, and f is not changed. Field by field, not
	// through protoreflect, which cost a 16 KiB frame more than copying
	// its payload (TestAppendHeadKeepsEveryField fails on a field added
	// to the messages and not here).
	rest := &meshnodev1.Frame{Version: f.GetVersion(), Step: f.GetStep()}
	body := &meshnodev1.Activations{
		SeqIds: a.GetSeqIds(), Positions: a.GetPositions(), Dtype: a.GetDtype(), Rows: a.GetRows(), Cols: a.GetCols(),
		OutputRows: a.GetOutputRows(), TokenIds: a.GetTokenIds(), More: a.GetMore(), Alone: a.GetAlone(), OnDevice: a.GetOnDevice(),
	}
	if u := f.ProtoReflect().GetUnknown(); len(u) > 0 {
		rest.ProtoReflect().SetUnknown(u)
	}
	if u := a.ProtoReflect().GetUnknown(); len(u) > 0 {
		body.ProtoReflect().SetUnknown(u)
	}
	if head, err = (proto.MarshalOptions{}).MarshalAppend(dst, rest); err != nil {
		return nil, nil, err
	}
	n := proto.Size(body)
	head = protowire.AppendTag(head, activationsField, protowire.BytesType)
	head = protowire.AppendVarint(head, uint64(n+protowire.SizeTag(payloadField)+protowire.SizeBytes(len(payload))))
	// The size just taken is the body's to reuse.
	if head, err = (proto.MarshalOptions{UseCachedSize: true}).MarshalAppend(head, body); err != nil {
		return nil, nil, err
	}
	head = protowire.AppendTag(head, payloadField, protowire.BytesType)
	head = protowire.AppendVarint(head, uint64(len(payload)))
	return head, payload, nil
}

// UnmarshalLent decodes data into f as proto.Unmarshal does, except that
// an activations payload is not copied: f's payload is a slice of data,
// valid as long as data is. The payload is first moved back over the
// bytes before it (which decoding has done with) to an address that is a
// multiple of 16, or failing that of 4, so that f32 hidden states can be
// read in place (stage.Activation.Float32Shared). scratch holds the rest
// of the frame while it is decoded, and is reused from call to call. Only
// data that proto's own rules would read as one activations body with one
// payload field is decoded this way; anything else (a body given twice,
// another body beside it) goes to proto.Unmarshal as it is.
func UnmarshalLent(data []byte, f *meshnodev1.Frame, scratch *[]byte) error {
	actStart, actEnd, inner, ok := findField(data, activationsField)
	if !ok {
		return proto.Unmarshal(data, f)
	}
	payStart, payEnd, payload, ok := findField(inner, payloadField)
	if !ok {
		return proto.Unmarshal(data, f)
	}
	m := append((*scratch)[:0], data[:actStart]...)
	m = protowire.AppendTag(m, activationsField, protowire.BytesType)
	m = protowire.AppendVarint(m, uint64(len(inner)-(payEnd-payStart)))
	m = append(m, inner[:payStart]...)
	m = append(m, inner[payEnd:]...)
	m = append(m, data[actEnd:]...)
	*scratch = m
	if err := proto.Unmarshal(m, f); err != nil {
		return err
	}
	if len(payload) == 0 {
		return nil
	}
	// A length-delimited value ends its field: where the payload starts.
	at := actEnd - len(inner) + payEnd - len(payload)
	addr := uintptr(unsafe.Pointer(unsafe.SliceData(data))) + uintptr(at)
	shift := int(addr % 16)
	if shift > at {
		shift = int(addr % 4) // at >= 4: two tags and two lengths
	}
	if shift > 0 {
		at -= shift
		copy(data[at:], payload)
	}
	// Full slice expression: an append to the payload must not write over
	// what follows it in data.
	f.GetActivations().Payload = data[at : at+len(payload) : at+len(payload)]
	return nil
}

// findField finds the one occurrence of field num in the message encoded
// by data: where its bytes start and end in data, and its value. ok is
// false unless data is a sequence of well-formed fields in which num
// occurs exactly once, as a length-delimited field, and, when num is the
// activations body, with no other member of Frame's body oneof beside it:
// the cases where cutting the field out and putting its value back after
// decoding the rest means what decoding the whole would.
func findField(data []byte, num protowire.Number) (start, end int, value []byte, ok bool) {
	found := false
	for off := 0; off < len(data); {
		n, typ, tn := protowire.ConsumeTag(data[off:])
		if tn < 0 {
			return 0, 0, nil, false
		}
		vn := protowire.ConsumeFieldValue(n, typ, data[off+tn:])
		if vn < 0 {
			return 0, 0, nil, false
		}
		switch {
		case n == num:
			if found || typ != protowire.BytesType {
				return 0, 0, nil, false
			}
			v, _ := protowire.ConsumeBytes(data[off+tn:])
			found, start, end, value = true, off, off+tn+vn, v
		case num == activationsField && frameBodies.ByNumber(n) != nil:
			return 0, 0, nil, false
		}
		off += tn + vn
	}
	return start, end, value, found
}
