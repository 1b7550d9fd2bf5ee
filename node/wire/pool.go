package wire

import (
	"fmt"
	"math/bits"
	"sync"

	"google.golang.org/grpc/mem"
	"google.golang.org/protobuf/proto"
)

// Why a buffer pool of our own. gRPC's default pool zeroes every buffer it
// hands out, whole: its capacity, not the length asked for. Its classes
// jump from 32 KiB to 1 MiB, so a 256 KiB frame (a 16-row micro-batch of
// an 8B model's hidden state in f32) clears 1 MiB when it is marshaled
// and 1 MiB again when the receiver joins its HTTP/2 frames, on the path
// of every decode step. gRPC fills every buffer it takes before reading
// it (a frame is read in full, a message marshaled whole), so the zeroing
// protects nothing here. This pool neither zeroes nor rounds up by more
// than a power of two. gRPC's protobuf codec takes its buffers from the
// default pool whatever the connection's, so stage connections also use
// a codec of their own (codec), the same but for the pool.
const (
	minPoolClass = 8  // 256 B: smaller buffers come from this class
	maxPoolClass = 28 // 256 MiB, MaxFrameBytes: larger ones are not pooled
)

// bufferPool is a mem.BufferPool with a class for every power of two from
// 2^minPoolClass to 2^maxPoolClass bytes, whose buffers are not zeroed.
type bufferPool struct {
	classes [maxPoolClass + 1]sync.Pool
}

var stagePool = &bufferPool{}

// poolClass is the class whose buffers hold n bytes.
func poolClass(n int) int {
	if n <= 1<<minPoolClass {
		return minPoolClass
	}
	return bits.Len(uint(n - 1))
}

// Get returns a buffer of length n whose contents are undefined.
func (p *bufferPool) Get(n int) *[]byte {
	c := poolClass(n)
	if c > maxPoolClass {
		b := make([]byte, n)
		return &b
	}
	if b, ok := p.classes[c].Get().(*[]byte); ok {
		*b = (*b)[:n]
		return b
	}
	b := make([]byte, n, 1<<c)
	return &b
}

// Put keeps b for reuse if its capacity is one of the pool's classes.
func (p *bufferPool) Put(b *[]byte) {
	c := cap(*b)
	if c < 1<<minPoolClass || c > 1<<maxPoolClass || c&(c-1) != 0 {
		return
	}
	p.classes[bits.Len(uint(c))-1].Put(b)
}

var _ mem.BufferPool = (*bufferPool)(nil)

// codec is the protobuf codec of stage connections: gRPC's wire format,
// with its buffers from stagePool.
type codec struct{}

// Name is the content subtype, "proto", as gRPC's own codec: a peer sees
// no difference.
func (codec) Name() string { return "proto" }

func (codec) Marshal(v any) (mem.BufferSlice, error) {
	m, ok := v.(proto.Message)
	if !ok {
		return nil, fmt.Errorf("encode %T: not a protobuf message", v)
	}
	size := proto.Size(m)
	// Size just ran over m, so MarshalAppend may use the sizes it cached.
	opts := proto.MarshalOptions{UseCachedSize: true}
	if mem.IsBelowBufferPoolingThreshold(size) {
		b, err := opts.Marshal(m)
		if err != nil {
			return nil, fmt.Errorf("encode %T: %w", v, err)
		}
		return mem.BufferSlice{mem.SliceBuffer(b)}, nil
	}
	buf := stagePool.Get(size)
	b, err := opts.MarshalAppend((*buf)[:0], m)
	if err != nil {
		stagePool.Put(buf)
		return nil, fmt.Errorf("encode %T: %w", v, err)
	}
	*buf = b
	return mem.BufferSlice{mem.NewBuffer(buf, stagePool)}, nil
}

func (codec) Unmarshal(data mem.BufferSlice, v any) error {
	m, ok := v.(proto.Message)
	if !ok {
		return fmt.Errorf("decode into %T: not a protobuf message", v)
	}
	buf := data.MaterializeToBuffer(stagePool)
	defer buf.Free()
	return proto.Unmarshal(buf.ReadOnlyData(), m)
}
