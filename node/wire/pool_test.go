package wire

import (
	"testing"

	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"

	meshnodev1 "github.com/meshnode/meshnode/proto/meshnode/v1"
)

func TestBufferPoolClasses(t *testing.T) {
	tests := []struct {
		n, cap int
	}{
		{0, 256}, {1, 256}, {256, 256}, {257, 512}, {16 << 10, 16 << 10},
		{256<<10 + 1, 512 << 10}, {1 << 28, 1 << 28}, {1<<28 + 1, 1<<28 + 1},
	}
	p := &bufferPool{}
	for _, tc := range tests {
		b := p.Get(tc.n)
		if len(*b) != tc.n || cap(*b) != tc.cap {
			t.Errorf("Get(%d): len %d cap %d, want len %d cap %d", tc.n, len(*b), cap(*b), tc.n, tc.cap)
		}
	}
}

// TestBufferPoolReuse: a buffer put back comes out again, dirty, for any
// length of its class; one whose capacity is not a class is dropped.
func TestBufferPoolReuse(t *testing.T) {
	p := &bufferPool{}
	b := p.Get(300 << 10)
	(*b)[0] = 7
	// sync.Pool may drop what is put (a GC; at random under the race
	// detector), so put it back each time.
	reused := false
	for range 100 {
		p.Put(b)
		c := p.Get(257 << 10)
		if cap(*c) != 512<<10 || len(*c) != 257<<10 {
			t.Fatalf("Get(257 KiB): len %d cap %d", len(*c), cap(*c))
		}
		if &(*c)[:1][0] == &(*b)[:1][0] {
			reused = true
			if (*c)[0] != 7 {
				t.Fatal("reused buffer was cleared")
			}
			break
		}
	}
	if !reused {
		t.Error("a buffer put back never came out again")
	}
	odd := make([]byte, 1000)
	p.Put(&odd) // not a class: dropped, not handed out for 1024 bytes
	if c := p.Get(1000); cap(*c) != 1024 {
		t.Fatalf("Get(1000) after putting a 1000-byte buffer: cap %d", cap(*c))
	}
}

// TestCodecRoundTrip: the stage codec's bytes are protobuf's, small and
// pooled alike, and it refuses what is not a protobuf message.
func TestCodecRoundTrip(t *testing.T) {
	for _, payload := range []int{16, 256 << 10} {
		f := &meshnodev1.Frame{Version: Version, Step: 9, Body: &meshnodev1.Frame_Activations{Activations: &meshnodev1.Activations{
			SeqIds: []uint64{3}, Positions: []int32{5}, Dtype: meshnodev1.DType_DTYPE_F32,
			Rows: 1, Cols: uint32(payload / 4), Payload: make([]byte, payload),
		}}}
		f.GetActivations().Payload[payload-1] = 0xab
		data, err := codec{}.Marshal(f)
		if err != nil {
			t.Fatal(err)
		}
		want, err := proto.Marshal(f)
		if err != nil {
			t.Fatal(err)
		}
		if got := data.Materialize(); string(got) != string(want) {
			t.Fatalf("%d-byte payload: codec bytes differ from proto.Marshal's", payload)
		}
		var back meshnodev1.Frame
		if err := (codec{}).Unmarshal(data, &back); err != nil {
			t.Fatal(err)
		}
		data.Free()
		if !proto.Equal(&back, f) {
			t.Fatalf("%d-byte payload: round trip changed the frame", payload)
		}
	}
	if _, err := (codec{}).Marshal(struct{}{}); err == nil {
		t.Error("Marshal of a non-message: no error")
	}
	if err := (codec{}).Unmarshal(mem.BufferSlice{mem.SliceBuffer([]byte{1})}, new(int)); err == nil {
		t.Error("Unmarshal into a non-message: no error")
	}
}
