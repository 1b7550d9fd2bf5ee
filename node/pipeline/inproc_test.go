package pipeline

import (
	"context"
	"errors"
	"io"
	"testing"
	"time"

	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/encoding/protowire"
	"google.golang.org/protobuf/proto"

	meshnodev1 "github.com/meshnode/meshnode/proto/meshnode/v1"
)

// fakeStage is a StageService whose Forward handler is forward.
type fakeStage struct {
	meshnodev1.UnimplementedStageServiceServer
	forward func(meshnodev1.StageService_ForwardServer) error
}

func (f fakeStage) Forward(s meshnodev1.StageService_ForwardServer) error { return f.forward(s) }

func (fakeStage) Info(context.Context, *meshnodev1.InfoRequest) (*meshnodev1.StageInfo, error) {
	return &meshnodev1.StageInfo{Start: 2, End: 5}, nil
}

// echoStage sends every frame back until its client closes its side.
func echoStage() fakeStage {
	return fakeStage{forward: func(s meshnodev1.StageService_ForwardServer) error {
		for {
			f, err := s.Recv()
			if errors.Is(err, io.EOF) {
				return nil
			}
			if err != nil {
				return err
			}
			if err := s.Send(f); err != nil {
				return err
			}
		}
	}}
}

// TestInProcessStream checks that an in-process stream behaves as a gRPC
// one does for what the pipeline relies on: frames in order both ways,
// end of stream, the handler's error as a status, cancellation ending the
// handler, and the Info call.
func TestInProcessStream(t *testing.T) {
	echo := echoStage()
	t.Run("echo", func(t *testing.T) {
		s, err := meshnodev1.NewStageServiceClient(InProcess(echo)).Forward(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		for i := range uint64(3) {
			if err := s.Send(&meshnodev1.Frame{Step: i}); err != nil {
				t.Fatal(err)
			}
		}
		if err := s.CloseSend(); err != nil {
			t.Fatal(err)
		}
		for i := range uint64(3) {
			f, err := s.Recv()
			if err != nil || f.GetStep() != i {
				t.Fatalf("frame %d: %v, %v", i, f, err)
			}
		}
		if _, err := s.Recv(); !errors.Is(err, io.EOF) {
			t.Fatalf("after the handler returned: %v, want EOF", err)
		}
	})
	t.Run("handler error", func(t *testing.T) {
		bad := fakeStage{forward: func(meshnodev1.StageService_ForwardServer) error {
			return status.Error(codes.InvalidArgument, "bad frame")
		}}
		s, err := meshnodev1.NewStageServiceClient(InProcess(bad)).Forward(t.Context())
		if err != nil {
			t.Fatal(err)
		}
		if _, err := s.Recv(); status.Code(err) != codes.InvalidArgument {
			t.Fatalf("Recv: %v, want InvalidArgument", err)
		}
		if err := s.Send(&meshnodev1.Frame{}); !errors.Is(err, io.EOF) {
			t.Fatalf("Send after the handler returned: %v, want EOF", err)
		}
	})
	t.Run("cancel", func(t *testing.T) {
		ended := make(chan error, 1)
		blocked := fakeStage{forward: func(s meshnodev1.StageService_ForwardServer) error {
			_, err := s.Recv()
			ended <- err
			return err
		}}
		ctx, cancel := context.WithCancel(t.Context())
		s, err := meshnodev1.NewStageServiceClient(InProcess(blocked)).Forward(ctx)
		if err != nil {
			t.Fatal(err)
		}
		cancel()
		select {
		case err := <-ended:
			if status.Code(err) != codes.Canceled {
				t.Fatalf("the handler's Recv: %v, want Canceled", err)
			}
		case <-time.After(5 * time.Second):
			t.Fatal("the handler did not end when the client canceled")
		}
		if _, err := s.Recv(); status.Code(err) != codes.Canceled {
			t.Fatalf("client Recv: %v, want Canceled", err)
		}
	})
	t.Run("info", func(t *testing.T) {
		info, err := meshnodev1.NewStageServiceClient(InProcess(echo)).Info(t.Context(), &meshnodev1.InfoRequest{})
		if err != nil || info.GetStart() != 2 || info.GetEnd() != 5 {
			t.Fatalf("Info: %v, %v", info, err)
		}
	})
}

// TestCopyFrame: a frame received in process equals the one sent, body
// and unknown fields too, replaces what the receiving message held, and
// shares the sender's payload rather than copying it.
func TestCopyFrame(t *testing.T) {
	payload := []byte{1, 2, 3, 4}
	tests := []struct {
		name string
		f    *meshnodev1.Frame
	}{
		{"activations", &meshnodev1.Frame{Version: 1, Step: 7, Body: &meshnodev1.Frame_Activations{Activations: &meshnodev1.Activations{
			SeqIds: []uint64{3}, Positions: []int32{9}, Rows: 1, Cols: 1, Payload: payload}}}},
		{"tokens", &meshnodev1.Frame{Version: 1, Step: 8, Body: &meshnodev1.Frame_Tokens{Tokens: &meshnodev1.Tokens{SeqIds: []uint64{1}, TokenIds: []int32{5}}}}},
		{"empty", &meshnodev1.Frame{}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			tc.f.ProtoReflect().SetUnknown(protowire.AppendVarint(protowire.AppendTag(nil, 99, protowire.VarintType), 42))
			got := &meshnodev1.Frame{Version: 5, Step: 99, Body: &meshnodev1.Frame_Control{Control: &meshnodev1.SeqControl{}}}
			if err := copyFrame(got, tc.f); err != nil {
				t.Fatal(err)
			}
			if !proto.Equal(got, tc.f) {
				t.Fatalf("received %v, sent %v", got, tc.f)
			}
			if a := got.GetActivations(); a != nil && &a.Payload[0] != &payload[0] {
				t.Error("the payload was copied")
			}
		})
	}
}
