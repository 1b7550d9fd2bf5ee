package wire

import (
	"google.golang.org/grpc"
	"google.golang.org/grpc/experimental"

	"github.com/meshnode/meshnode/stage"
)

// MaxFrameBytes is the largest gRPC message a stage sends or accepts.
// gRPC's 4 MiB default is far too small for prefill chunks (2048 tokens at
// n_embd 8192 in f16 is 32 MiB); 256 MiB fits 16k such tokens while keeping
// the memory one peer can make us buffer bounded. Larger batches are split
// into frames of RowsPerFrame rows.
const MaxFrameBytes = 256 << 20

// Flow-control windows of stage connections. Setting them turns off
// gRPC's bandwidth-delay estimation, which pings the peer as data comes
// and resizes the windows: extra frames both ways on every hop of every
// decode step, for windows that end no larger than these.
const (
	streamWindow = 16 << 20
	connWindow   = 64 << 20
)

// ServerOptions sets a StageService server's message size limits to
// MaxFrameBytes (a larger message fails its stream with ResourceExhausted
// and leaves the server serving), its flow-control windows and its buffer
// pool (see pool.go).
func ServerOptions() []grpc.ServerOption {
	return []grpc.ServerOption{
		experimental.BufferPool(stagePool),
		grpc.ForceServerCodecV2(codec{}),
		grpc.MaxRecvMsgSize(MaxFrameBytes),
		grpc.MaxSendMsgSize(MaxFrameBytes),
		grpc.InitialWindowSize(streamWindow),
		grpc.InitialConnWindowSize(connWindow),
	}
}

// DialOptions sets a StageService client's message size limits to
// MaxFrameBytes, its flow-control windows and its buffer pool.
func DialOptions() []grpc.DialOption {
	return []grpc.DialOption{
		experimental.WithBufferPool(stagePool),
		grpc.WithDefaultCallOptions(grpc.MaxCallRecvMsgSize(MaxFrameBytes), grpc.MaxCallSendMsgSize(MaxFrameBytes), grpc.ForceCodecV2(codec{})),
		grpc.WithInitialWindowSize(streamWindow),
		grpc.WithInitialConnWindowSize(connWindow),
	}
}

// Worst-case protobuf overhead of an activations frame: fixed fields and
// length prefixes, then per row a seq id (10-byte varint), a position
// (5 bytes, non-negative int32), an output row (5 bytes) and a token id
// (5 bytes, non-negative int32).
const (
	frameOverhead = 128
	rowOverhead   = 10 + 5 + 5 + 5
)

// RowsPerFrame returns the most rows of cols columns in dtype that fit one
// activations frame of at most maxFrame bytes (MaxFrameBytes when <= 0),
// within the default row and payload limits; 0 when not even one row fits.
// The pipeline splits prefill chunks by it.
func RowsPerFrame(cols int, dtype stage.DType, maxFrame int) int {
	if maxFrame <= 0 {
		maxFrame = MaxFrameBytes
	}
	size := dtype.Size()
	if cols <= 0 || size == 0 || cols > DefaultMaxCols || maxFrame <= frameOverhead {
		return 0
	}
	rowBytes := cols * size // cols <= 1<<16, so no overflow even on 32-bit
	rows := (maxFrame - frameOverhead) / (rowBytes + rowOverhead)
	rows = min(rows, DefaultMaxRows, DefaultMaxPayload/rowBytes)
	return rows
}
