package host

import (
	"context"
	"fmt"
	"net"
	"testing"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/meshnode/meshnode/node/wire"
)

// rawCodec passes []byte messages through gRPC as they are, so that the
// benchmark below measures gRPC's framing and hand-offs, not protobuf.
type rawCodec struct{}

func (rawCodec) Marshal(v any) ([]byte, error) { return *v.(*[]byte), nil }
func (rawCodec) Unmarshal(b []byte, v any) error {
	*v.(*[]byte) = append((*v.(*[]byte))[:0], b...)
	return nil
}
func (rawCodec) Name() string { return "meshnode-bench-raw" }

var echoDesc = grpc.ServiceDesc{
	ServiceName: "meshnode.bench.Echo",
	HandlerType: (*any)(nil),
	Streams: []grpc.StreamDesc{{
		StreamName: "Echo", ServerStreams: true, ClientStreams: true,
		Handler: func(_ any, s grpc.ServerStream) error {
			var m []byte
			for {
				if err := s.RecvMsg(&m); err != nil {
					return nil
				}
				// The first byte asks for a reply of 64 bytes instead of
				// the message back, as a hop's picks answer its hidden state.
				if len(m) > 64 && m[0] == 1 {
					m = m[:64]
				}
				if err := s.SendMsg(&m); err != nil {
					return err
				}
			}
		},
	}},
}

// BenchmarkGRPCRoundTrip is BenchmarkRoundTrip through a gRPC
// bidirectional stream, as a pipeline hop sends its frames: over plain
// loopback TCP and over a libp2p stream (the mesh's transport). The
// "-64B" sizes get 64 bytes back, as a micro-batch's hidden state of 16
// rows of n_embd 4096 in f32 (256 KiB) is answered by its greedy picks.
func BenchmarkGRPCRoundTrip(b *testing.B) {
	for _, tc := range []struct {
		size  int
		small bool // answered with 64 bytes
	}{{64, false}, {8 << 10, false}, {16 << 10, false}, {256 << 10, true}} {
		size, name := tc.size, fmt.Sprintf("%dB", tc.size)
		if tc.small {
			name += "-64B"
		}
		for _, via := range []string{"tcp", "libp2p"} {
			b.Run(fmt.Sprintf("%s/%s", via, name), func(b *testing.B) {
				srv := grpc.NewServer(append(wire.ServerOptions(), grpc.ForceServerCodec(rawCodec{}))...)
				srv.RegisterService(&echoDesc, struct{}{})
				b.Cleanup(srv.Stop)
				serve := func(ln net.Listener) { srv.Serve(ln) }
				var c net.Conn
				if via == "tcp" {
					c = tcpStream(b, serve)
				} else {
					c = benchStream(b, serve)
				}
				cc, err := grpc.NewClient("passthrough:///bench", append(wire.DialOptions(), grpc.WithTransportCredentials(insecure.NewCredentials()),
					grpc.WithContextDialer(func(context.Context, string) (net.Conn, error) { return c, nil }),
					grpc.WithDefaultCallOptions(grpc.ForceCodec(rawCodec{})))...)
				if err != nil {
					b.Fatal(err)
				}
				b.Cleanup(func() { cc.Close() })
				st, err := cc.NewStream(context.Background(), &echoDesc.Streams[0], "/meshnode.bench.Echo/Echo")
				if err != nil {
					b.Fatal(err)
				}
				msg, in := make([]byte, size), []byte(nil)
				if tc.small {
					msg[0] = 1
				}
				b.SetBytes(int64(size))
				b.ResetTimer()
				for range b.N {
					if err := st.SendMsg(&msg); err != nil {
						b.Fatal(err)
					}
					if err := st.RecvMsg(&in); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}
