package meshtest

import (
	"context"
	"crypto/rand"
	"errors"
	"io"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"testing"
	"time"

	"github.com/libp2p/go-libp2p"
	"github.com/libp2p/go-libp2p/core/crypto"
	"github.com/libp2p/go-libp2p/core/peer"
	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/credentials/insecure"
	grpcstatus "google.golang.org/grpc/status"

	"github.com/meshnode/meshnode/node"
	"github.com/meshnode/meshnode/node/host"
	"github.com/meshnode/meshnode/node/wire"
	meshnodev1 "github.com/meshnode/meshnode/proto/meshnode/v1"
)

// rawHost is a bare libp2p host of the mesh package's kind, not a node:
// what an intruder (another key) or a tool (the right key) would run.
func rawHost(t *testing.T, key host.MeshKey) *host.Host {
	t.Helper()
	id, _, err := crypto.GenerateEd25519Key(rand.Reader)
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	h, err := host.New(ctx, host.Config{Key: id, MeshKey: key, Listen: []string{"/ip4/127.0.0.1/tcp/0"}})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { h.Close() })
	return h
}

// p2pAddr is a node's libp2p address as its status lists it.
func p2pAddr(t *testing.T, n *meshNode) (string, peer.ID) {
	t.Helper()
	st, err := n.status(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	for _, nd := range st.Nodes {
		if nd.PeerID == st.Self && len(nd.Addrs) > 0 {
			info, err := peer.AddrInfoFromString(nd.Addrs[0])
			if err != nil {
				t.Fatal(err)
			}
			return nd.Addrs[0], info.ID
		}
	}
	t.Fatalf("%s lists no address of its own", n.name)
	return "", ""
}

// meshKeyWordRE finds the key named in an error: "mesh key" or its flag.
var meshKeyWordRE = regexp.MustCompile(`(?i)mesh[ -]key`)

func otherMeshKey(t *testing.T) host.MeshKey {
	t.Helper()
	k, err := host.GenerateMeshKey()
	if err != nil {
		t.Fatal(err)
	}
	return k
}

// TestMeshKey: the mesh is private. A node with another mesh key, or with
// none, cannot join (the process fails and says why, and node 1 logs the
// refusal); a bare libp2p host with another key cannot even open the stage
// protocol, while one with the right key can (so the refusal is the key's
// doing, not an unreachable protocol). Nobody gets into the membership.
func TestMeshKey(t *testing.T) {
	m := startMesh(t, stories, 1, "f16")
	n1 := m.nodes[0]
	addr, id := p2pAddr(t, n1)

	// A failed join must end the process, non-zero, and name the key.
	failedJoin := func(t *testing.T, name string, args ...string) {
		t.Helper()
		p := startProc(t, name, binPath, args...)
		if !p.exited(45 * time.Second) {
			t.Fatalf("%s still runs 45 s after joining with a bad key", name)
		}
		var ee interface{ ExitCode() int }
		if err := p.exitErr(); !errors.As(err, &ee) || ee.ExitCode() == 0 {
			t.Errorf("%s exited with %v, want a non-zero status", name, err)
		}
		out := strings.TrimSpace(p.output())
		if !meshKeyWordRE.MatchString(out) {
			t.Errorf("%s's error does not mention the mesh key:\n%s", name, out)
		}
		t.Logf("%s: %s", name, out[strings.LastIndexByte(out, '\n')+1:])
	}

	t.Run("other key", func(t *testing.T) {
		dir := filepath.Join(t.TempDir(), "intruder")
		failedJoin(t, "intruder", append([]string{"join", m.join, "--mesh-key", otherMeshKey(t).String()}, nodeArgs(dir, "f16")...)...)
		if _, err := n1.proc.awaitLine(regexp.MustCompile(`refused connection: wrong mesh key`), 5*time.Second); err != nil {
			t.Errorf("node1 did not log the refusal: %v", err)
		}
	})

	t.Run("no key", func(t *testing.T) {
		// A fresh data dir: no mesh.key to fall back on.
		dir := filepath.Join(t.TempDir(), "keyless")
		failedJoin(t, "keyless", append([]string{"join", m.join}, nodeArgs(dir, "f16")...)...)

		// meshnode refuses to even try without a key; a plain libp2p
		// host (no private network) shows what node 1 does with one.
		plain, err := libp2p.New(libp2p.NoListenAddrs, libp2p.DisableMetrics())
		if err != nil {
			t.Fatal(err)
		}
		defer plain.Close()
		info, err := peer.AddrInfoFromString(addr)
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := plain.Connect(ctx, *info); err == nil {
			t.Error("a libp2p host without the mesh key connected to node1")
		}
		if _, err := n1.proc.awaitLine(regexp.MustCompile(`refused connection: peer has no mesh key`), 5*time.Second); err != nil {
			t.Errorf("node1 did not log the refusal: %v", err)
		}
	})

	t.Run("raw host", func(t *testing.T) {
		ctx, cancel := context.WithTimeout(context.Background(), 20*time.Second)
		defer cancel()
		intruder := rawHost(t, otherMeshKey(t))
		info, err := peer.AddrInfoFromString(addr)
		if err != nil {
			t.Fatal(err)
		}
		intruder.LibP2P().Peerstore().AddAddrs(info.ID, info.Addrs, time.Minute)
		c, err := intruder.Dial(ctx, id, node.StageProtocol)
		if err == nil {
			c.Close()
			t.Fatal("a host with another mesh key opened node1's stage stream")
		}
		if !errors.Is(err, host.ErrMeshKey) {
			t.Errorf("stage stream with another key: %v, want a mesh key refusal", err)
		}

		// The control: the same protocol with the right key answers.
		key, err := host.ParseMeshKey(m.key)
		if err != nil {
			t.Fatal(err)
		}
		friend := rawHost(t, key)
		if _, err := friend.Connect(ctx, addr); err != nil {
			t.Fatal(err)
		}
		client := stageClient(t, friend, id)
		si, err := client.Info(ctx, &meshnodev1.InfoRequest{})
		if err != nil {
			t.Fatalf("Info with the mesh key: %v", err)
		}
		if si.GetStart() != 0 || int(si.GetEnd()) != stories.layers {
			t.Errorf("node1's stage: %v", si)
		}
	})

	// Nobody above became a member.
	st, err := n1.status(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if len(st.Nodes) != 1 || st.Nodes[0].PeerID != n1.peer {
		t.Errorf("node1's members: %+v", st.Nodes)
	}
	checkGreedy(t, n1, stories)
}

// stageClient is a StageService client over a libp2p stream to peer id.
func stageClient(t *testing.T, h *host.Host, id peer.ID) meshnodev1.StageServiceClient {
	t.Helper()
	conn, err := grpc.NewClient("passthrough:///"+id.String(),
		grpc.WithContextDialer(h.GRPCDialer(node.StageProtocol)),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { conn.Close() })
	return meshnodev1.NewStageServiceClient(conn)
}

// TestGarbageFrame: a peer with the mesh key that sends a frame of a
// protocol version nobody speaks to node 2's stage is answered with an
// error frame and a failed stream; bytes that are not even gRPC get the
// stream closed. Neither disturbs the mesh: node 2 reports the bad peer,
// and requests through every entry still get the reference.
// (Corrupt, truncated and oversized frames of every kind are covered by
// node/pipeline's and node/wire's tests in process.)
func TestGarbageFrame(t *testing.T) {
	m := startMesh(t, stories, 3, "f16")
	n2 := m.nodes[1]
	st, err := n2.status(context.Background())
	if err != nil {
		t.Fatal(err)
	}
	if st.Local == nil {
		t.Fatal("node2 serves no stage")
	}
	addr, id := p2pAddr(t, n2)
	key, err := host.ParseMeshKey(m.key)
	if err != nil {
		t.Fatal(err)
	}
	h := rawHost(t, key)
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	if _, err := h.Connect(ctx, addr); err != nil {
		t.Fatal(err)
	}
	client := stageClient(t, h, id)

	// Really node 2's stage at the other end.
	si, err := client.Info(ctx, &meshnodev1.InfoRequest{})
	if err != nil {
		t.Fatal(err)
	}
	if int(si.GetStart()) != st.Local.Start || int(si.GetEnd()) != st.Local.End {
		t.Fatalf("Info says [%d,%d), node2's status [%d,%d)", si.GetStart(), si.GetEnd(), st.Local.Start, st.Local.End)
	}

	// A Setup that would be valid but for its version.
	hop := slices.IndexFunc(st.Plan, func(s planStage) bool { return s.Node == n2.peer })
	var route []*meshnodev1.Hop
	for _, s := range st.Plan {
		route = append(route, &meshnodev1.Hop{Peer: s.Node, Start: uint32(s.Start), End: uint32(s.End)})
	}
	garbage := &meshnodev1.Frame{
		Version: wire.Version + 41, Step: 7,
		Body: &meshnodev1.Frame_Setup{Setup: &meshnodev1.Setup{
			Role: meshnodev1.Setup_ROLE_FORWARD, PipelineId: "garbage", Origin: h.ID().String(),
			Route: route, Hop: uint32(hop), WireDtype: meshnodev1.DType_DTYPE_F16,
		}},
	}
	stream, err := client.Forward(ctx)
	if err != nil {
		t.Fatal(err)
	}
	if err := stream.Send(garbage); err != nil {
		t.Fatal(err)
	}
	reply, err := stream.Recv()
	if err != nil {
		t.Fatalf("no error frame before the stream ended: %v", err)
	}
	re, err := wire.DecodeError(reply)
	if err != nil {
		t.Fatalf("reply %v is not an error frame: %v", reply, err)
	}
	if re.Code != meshnodev1.Error_CODE_UNSUPPORTED_VERSION || re.Step != 7 {
		t.Errorf("error frame %v, want UNSUPPORTED_VERSION for step 7", re)
	}
	if _, err := stream.Recv(); grpcstatus.Code(err) != codes.InvalidArgument {
		t.Errorf("stream ended with %v, want InvalidArgument", err)
	}

	// Not gRPC at all: the stage protocol stream is closed on us.
	c, err := h.Dial(ctx, id, node.StageProtocol)
	if err != nil {
		t.Fatal(err)
	}
	junk := make([]byte, 4096)
	rand.Read(junk)
	c.SetDeadline(time.Now().Add(10 * time.Second))
	if _, err := c.Write(junk); err == nil {
		_, err = io.Copy(io.Discard, c)
		if errors.Is(err, context.DeadlineExceeded) || isTimeout(err) {
			t.Error("node2 kept a stage stream of junk open for 10 s")
		}
	}
	c.Close()

	// Node 2 knows who misbehaved.
	if _, err := n2.proc.awaitLine(regexp.MustCompile(`bad frame from peer`), 5*time.Second); err != nil {
		t.Errorf("node2 did not log the bad frame: %v", err)
	}
	if st, err := n2.status(context.Background()); err != nil || !st.lastEvent("bad-peer").After(time.Time{}) {
		t.Errorf("node2's events have no bad-peer (%v)", err)
	}
	// And the mesh serves as before, through every entry.
	if _, err := awaitSettled(stories, m.nodes, 10*time.Second); err != nil {
		t.Fatal(err)
	}
	for _, n := range m.nodes {
		checkGreedy(t, n, stories)
	}
}

func isTimeout(err error) bool {
	var te interface{ Timeout() bool }
	return errors.As(err, &te) && te.Timeout()
}
