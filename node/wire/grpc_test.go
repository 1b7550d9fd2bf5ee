package wire

import (
	"context"
	"errors"
	"io"
	"math"
	"math/rand/v2"
	"net"
	"slices"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"

	meshnodev1 "github.com/meshnode/meshnode/proto/meshnode/v1"
	"github.com/meshnode/meshnode/stage"
)

// echoStage serves Forward by decoding every activations frame and sending
// it back re-encoded, so a round trip crosses the codec twice.
type echoStage struct {
	meshnodev1.UnimplementedStageServiceServer
}

func (echoStage) Forward(stream meshnodev1.StageService_ForwardServer) error {
	for {
		f, err := stream.Recv()
		if errors.Is(err, io.EOF) {
			return nil
		}
		if err != nil {
			return err
		}
		b, err := DecodeBatch(f, Limits{})
		if err != nil {
			// Tell the peer why, then drop the stream: it is suspect.
			if serr := stream.Send(EncodeError(f.GetStep(), err)); serr != nil {
				return serr
			}
			return status.Error(codes.InvalidArgument, err.Error())
		}
		out, err := EncodeBatch(f.GetStep(), b, b.Hidden.DType)
		if err != nil {
			return status.Error(codes.Internal, err.Error())
		}
		if err := stream.Send(out); err != nil {
			return err
		}
	}
}

func (echoStage) Info(context.Context, *meshnodev1.InfoRequest) (*meshnodev1.StageInfo, error) {
	return EncodeInfo(testInfo())
}

func startEcho(t *testing.T) meshnodev1.StageServiceClient {
	t.Helper()
	lis, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	srv := grpc.NewServer(ServerOptions()...)
	meshnodev1.RegisterStageServiceServer(srv, echoStage{})
	done := make(chan error, 1)
	go func() { done <- srv.Serve(lis) }()
	t.Cleanup(func() {
		srv.Stop()
		if err := <-done; err != nil {
			t.Errorf("serve: %v", err)
		}
	})
	conn, err := grpc.NewClient(lis.Addr().String(),
		append(DialOptions(), grpc.WithTransportCredentials(insecure.NewCredentials()))...)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return meshnodev1.NewStageServiceClient(conn)
}

// bigBatch is an n x n f16 activation of random bits (NaNs included: the
// codec must carry bytes, not reinterpret them) over a few sequences.
func bigBatch(n int) *stage.Batch {
	r := rand.New(rand.NewPCG(7, 8))
	data := make([]byte, n*n*2)
	for i := 0; i+8 <= len(data); i += 8 {
		v := r.Uint64()
		for j := range 8 {
			data[i+j] = byte(v >> (8 * j))
		}
	}
	b := &stage.Batch{Hidden: &stage.Activation{DType: stage.F16, Rows: n, Cols: n, Data: data}}
	for i := range n {
		b.Seqs = append(b.Seqs, stage.SeqID(i/512))
		b.Pos = append(b.Pos, int32(i%512))
		if i%512 == 511 {
			b.Outputs = append(b.Outputs, i)
		}
	}
	return b
}

func TestGRPCForward(t *testing.T) {
	client := startEcho(t)
	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	defer cancel()

	pi, err := client.Info(ctx, &meshnodev1.InfoRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if info, err := DecodeInfo(pi, Limits{}); err != nil || info.ModelHash != testInfo().ModelHash {
		t.Fatalf("info %+v, %v", info, err)
	}

	// roundTrip sends frames for steps 1..n of b pipelined (all before the
	// first reply is read) and checks each comes back intact, in order.
	roundTrip := func(t *testing.T, b *stage.Batch, n int) {
		t.Helper()
		stream, err := client.Forward(ctx)
		if err != nil {
			t.Fatal(err)
		}
		for step := range uint64(n) {
			f, err := EncodeBatch(step+1, b, stage.F16)
			if err != nil {
				t.Fatal(err)
			}
			if err := stream.Send(f); err != nil {
				t.Fatal(err)
			}
		}
		for step := range uint64(n) {
			f, err := stream.Recv()
			if err != nil {
				t.Fatal(err)
			}
			if f.GetStep() != step+1 {
				t.Fatalf("reply for step %d, want %d", f.GetStep(), step+1)
			}
			got, err := DecodeBatch(f, Limits{})
			if err != nil {
				t.Fatal(err)
			}
			if !slices.Equal(got.Seqs, b.Seqs) || !slices.Equal(got.Pos, b.Pos) || !slices.Equal(got.Outputs, b.Outputs) ||
				string(got.Hidden.Data) != string(b.Hidden.Data) {
				t.Fatal("activation came back changed")
			}
		}
		if err := stream.CloseSend(); err != nil {
			t.Fatal(err)
		}
		if _, err := stream.Recv(); !errors.Is(err, io.EOF) {
			t.Fatalf("stream end: %v, want EOF", err)
		}
	}

	big := bigBatch(2048) // 8 MiB: twice gRPC's default limit
	f, err := EncodeBatch(1, big, stage.F16)
	if err != nil {
		t.Fatal(err)
	}
	if size := proto.Size(f); size < 8<<20 {
		t.Fatalf("big frame is only %d bytes", size)
	}
	roundTrip(t, big, 2)

	// A bad frame gets an error frame with its step, then the stream ends.
	stream, err := client.Forward(ctx)
	if err != nil {
		t.Fatal(err)
	}
	bad := validActivations()
	bad.Version = 2
	if err := stream.Send(bad); err != nil {
		t.Fatal(err)
	}
	reply, err := stream.Recv()
	if err != nil {
		t.Fatal(err)
	}
	re, err := DecodeError(reply)
	if err != nil || re.Step != bad.GetStep() || !errors.Is(re, ErrVersion) {
		t.Fatalf("reply to a bad frame: %+v, %v", re, err)
	}
	if _, err := stream.Recv(); status.Code(err) != codes.InvalidArgument {
		t.Fatalf("stream after a bad frame: %v, want InvalidArgument", err)
	}

	// An oversize message: past our own send limit it fails locally; with
	// the client's limit raised, the server refuses it from its header.
	huge := &meshnodev1.Frame{Version: Version, Step: 99, Body: &meshnodev1.Frame_Activations{
		Activations: &meshnodev1.Activations{Payload: make([]byte, MaxFrameBytes)},
	}}
	for _, opts := range [][]grpc.CallOption{nil, {grpc.MaxCallSendMsgSize(math.MaxInt32)}} {
		stream, err := client.Forward(ctx, opts...)
		if err != nil {
			t.Fatal(err)
		}
		err = stream.Send(huge)
		if err == nil || errors.Is(err, io.EOF) {
			_, err = stream.Recv() // the server's verdict
		}
		if status.Code(err) != codes.ResourceExhausted {
			t.Fatalf("oversize message (call options %d): %v, want ResourceExhausted", len(opts), err)
		}
		t.Logf("oversize message: %v", err)
	}

	// The server still serves, streams and unary calls alike.
	roundTrip(t, bigBatch(64), 3)
	if _, err := client.Info(ctx, &meshnodev1.InfoRequest{}); err != nil {
		t.Fatal(err)
	}
}

func TestRowsPerFrame(t *testing.T) {
	payload := make([]byte, MaxFrameBytes) // shared: only its length matters
	for _, tc := range []struct {
		cols     int
		dtype    stage.DType
		maxFrame int
	}{
		{4096, stage.F16, 0},
		{8192, stage.F16, 0},
		{16384, stage.F32, 0},
		{1, stage.F16, 0}, // capped by DefaultMaxRows
		{896, stage.BF16, 1 << 20},
		{7, stage.F32, 1000},
	} {
		rows := RowsPerFrame(tc.cols, tc.dtype, tc.maxFrame)
		maxFrame := tc.maxFrame
		if maxFrame <= 0 {
			maxFrame = MaxFrameBytes
		}
		if rows <= 0 || rows > DefaultMaxRows {
			t.Fatalf("%+v: %d rows", tc, rows)
		}
		// The worst case for varints: every id, position and output row at
		// its largest.
		a := &meshnodev1.Activations{
			Dtype:   DTypeToProto(tc.dtype),
			Rows:    uint32(rows),
			Cols:    uint32(tc.cols),
			Payload: payload[:rows*tc.cols*tc.dtype.Size()],
		}
		for r := range rows {
			a.SeqIds = append(a.SeqIds, math.MaxUint64)
			a.Positions = append(a.Positions, math.MaxInt32)
			a.OutputRows = append(a.OutputRows, math.MaxUint32-uint32(rows)+uint32(r))
			a.TokenIds = append(a.TokenIds, math.MaxInt32)
		}
		a.More = true
		f := &meshnodev1.Frame{Version: math.MaxUint32, Step: math.MaxUint64, Body: &meshnodev1.Frame_Activations{Activations: a}}
		if size := proto.Size(f); size > maxFrame {
			t.Fatalf("%+v: %d rows make a %d-byte frame, over %d", tc, rows, size, maxFrame)
		}
	}
	if n := RowsPerFrame(8192, stage.F16, 100); n != 0 {
		t.Fatalf("tiny frame: %d rows, want 0", n)
	}
	if n := RowsPerFrame(0, stage.F16, 0); n != 0 {
		t.Fatalf("no cols: %d rows, want 0", n)
	}
}
