package pipeline

import (
	"context"
	"io"
	"net"
	"sync"
	"sync/atomic"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/metadata"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"
	"google.golang.org/protobuf/proto"
	"google.golang.org/protobuf/reflect/protoreflect"

	meshnodev1 "github.com/meshnode/meshnode/proto/meshnode/v1"
)

// InProcess returns a connection to srv in this process, for a node whose
// own stage is a hop of its pipeline. A stream on it hands frames to the
// server through channels: no HTTP/2 framing, no encoding, no copies, and
// two goroutine hand-offs fewer per frame than gRPC over an in-memory
// listener, which on a decode step's critical path is worth having.
//
// Frames are passed by pointer, so, as gRPC's SendMsg asks, a sender must
// not change a frame after sending it.
func InProcess(srv meshnodev1.StageServiceServer) grpc.ClientConnInterface {
	return inProcess{srv}
}

type inProcess struct{ srv meshnodev1.StageServiceServer }

// inProcessAddr names the caller to the server (peer.FromContext).
type inProcessAddr struct{}

func (inProcessAddr) Network() string { return "inprocess" }
func (inProcessAddr) String() string  { return "this node" }

var _ net.Addr = inProcessAddr{}

func (c inProcess) Invoke(ctx context.Context, method string, args, reply any, _ ...grpc.CallOption) error {
	if method != meshnodev1.StageService_Info_FullMethodName {
		return status.Errorf(codes.Unimplemented, "in-process stage connection: no method %s", method)
	}
	out, err := c.srv.Info(peer.NewContext(ctx, &peer.Peer{Addr: inProcessAddr{}}), args.(*meshnodev1.InfoRequest))
	if err != nil {
		return toStatus(err)
	}
	r := reply.(proto.Message)
	proto.Reset(r)
	proto.Merge(r, out)
	return nil
}

// inProcessQueue is how many frames wait in each direction before a
// sender blocks, as gRPC's flow-control window would make it.
const inProcessQueue = 64

func (c inProcess) NewStream(ctx context.Context, _ *grpc.StreamDesc, method string, _ ...grpc.CallOption) (grpc.ClientStream, error) {
	if method != meshnodev1.StageService_Forward_FullMethodName {
		return nil, status.Errorf(codes.Unimplemented, "in-process stage connection: no stream %s", method)
	}
	s := &inProcessStream{
		ctx:      ctx,
		toServer: make(chan *meshnodev1.Frame, inProcessQueue),
		toClient: make(chan *meshnodev1.Frame, inProcessQueue),
		done:     make(chan struct{}),
	}
	// The handler runs until the client closes its side or the client's
	// context ends; as behind a gRPC server, its own context ends when it
	// returns.
	sctx, cancel := context.WithCancel(peer.NewContext(ctx, &peer.Peer{Addr: inProcessAddr{}}))
	go func() {
		defer cancel()
		s.err = c.srv.Forward(serverSide{s, sctx})
		close(s.done)
	}()
	return clientSide{s}, nil
}

// inProcessStream is one Forward stream: frames to the server, frames
// back, and the handler's result once done is closed.
type inProcessStream struct {
	ctx       context.Context // the client's
	toServer  chan *meshnodev1.Frame
	toClient  chan *meshnodev1.Frame
	closeSend sync.Once
	done      chan struct{}
	err       error // the handler's, readable once done is closed

	recvStop atomic.Pointer[context.Context] // the server's Recv also ends with it (cancelRecv)
}

// toStatus is err as gRPC would give it to a client.
func toStatus(err error) error {
	if _, ok := status.FromError(err); ok {
		return err
	}
	if ctxErr := status.FromContextError(err); ctxErr.Code() != codes.Unknown {
		return ctxErr.Err()
	}
	return status.Error(codes.Unknown, err.Error())
}

// clientSide is the stream as the pipeline holds it.
type clientSide struct{ s *inProcessStream }

func (c clientSide) Header() (metadata.MD, error) { return nil, nil }
func (c clientSide) Trailer() metadata.MD         { return nil }
func (c clientSide) Context() context.Context     { return c.s.ctx }

func (c clientSide) CloseSend() error {
	c.s.closeSend.Do(func() { close(c.s.toServer) })
	return nil
}

func (c clientSide) SendMsg(m any) error {
	select {
	case <-c.s.done:
		return io.EOF // as with gRPC: RecvMsg says why
	default:
	}
	select {
	case c.s.toServer <- m.(*meshnodev1.Frame):
		return nil
	case <-c.s.done:
		return io.EOF // as with gRPC: RecvMsg says why
	case <-c.s.ctx.Done():
		return toStatus(context.Cause(c.s.ctx))
	}
}

func (c clientSide) RecvMsg(m any) error {
	var f *meshnodev1.Frame
	select { // frames already sent come first
	case f = <-c.s.toClient:
		return copyFrame(m, f)
	default:
	}
	select {
	case f = <-c.s.toClient:
	case <-c.s.done:
		select { // frames sent before the handler returned come first
		case f = <-c.s.toClient:
		default:
			if c.s.err != nil {
				return toStatus(c.s.err)
			}
			return io.EOF
		}
	case <-c.s.ctx.Done():
		return toStatus(context.Cause(c.s.ctx))
	}
	return copyFrame(m, f)
}

// copyFrame makes m, a *Frame that a generated stream allocated, hold f's
// fields, sharing their memory, as a sender does not change a frame it
// sent (see InProcess). proto.Merge's deep copy cost a reply microseconds
// on a decode step's critical path, and copied a frame of logits whole.
func copyFrame(m any, f *meshnodev1.Frame) error {
	r := m.(*meshnodev1.Frame)
	proto.Reset(r)
	dst, src := r.ProtoReflect(), f.ProtoReflect()
	src.Range(func(fd protoreflect.FieldDescriptor, v protoreflect.Value) bool {
		dst.Set(fd, v)
		return true
	})
	if u := src.GetUnknown(); len(u) > 0 {
		dst.SetUnknown(u)
	}
	return nil
}

// serverSide is the stream as the stage's handler holds it.
type serverSide struct {
	s   *inProcessStream
	ctx context.Context
}

var _ meshnodev1.StageService_ForwardServer = serverSide{}

func (s serverSide) SetHeader(metadata.MD) error  { return nil }
func (s serverSide) SendHeader(metadata.MD) error { return nil }
func (s serverSide) SetTrailer(metadata.MD)       {}
func (s serverSide) Context() context.Context     { return s.ctx }

func (s serverSide) Recv() (*meshnodev1.Frame, error) {
	var stop <-chan struct{}
	if c := s.s.recvStop.Load(); c != nil {
		stop = (*c).Done()
	}
	select {
	case f, ok := <-s.s.toServer:
		if !ok {
			return nil, io.EOF
		}
		return f, nil
	case <-s.ctx.Done():
		return nil, toStatus(context.Cause(s.ctx))
	case <-stop:
		return nil, status.Error(codes.Canceled, "in-process stage stream: receiving stopped")
	}
}

// cancelRecv makes Recv end once ctx does (recvCanceler). Unlike a
// socket's, an in-process stream's reads may go on after stop.
func (s serverSide) cancelRecv(ctx context.Context) func() bool {
	s.s.recvStop.Store(&ctx)
	return func() bool {
		s.s.recvStop.Store(nil)
		return ctx.Err() == nil
	}
}

func (s serverSide) Send(f *meshnodev1.Frame) error {
	select {
	case s.s.toClient <- f:
		return nil
	case <-s.ctx.Done():
		return toStatus(context.Cause(s.ctx))
	}
}

func (s serverSide) RecvMsg(m any) error {
	f, err := s.Recv()
	if err != nil {
		return err
	}
	return copyFrame(m, f)
}

func (s serverSide) SendMsg(m any) error { return s.Send(m.(*meshnodev1.Frame)) }
