package host

import (
	"bufio"
	"context"
	"errors"
	"io"
	"net"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"testing"
	"time"

	"github.com/libp2p/go-libp2p"
	"github.com/libp2p/go-libp2p/core/peer"
	"github.com/libp2p/go-libp2p/core/protocol"
	"go.uber.org/zap"
	"go.uber.org/zap/zaptest/observer"
	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"
	"google.golang.org/grpc/health"
	healthpb "google.golang.org/grpc/health/grpc_health_v1"
)

func mustMeshKey(t *testing.T) MeshKey {
	t.Helper()
	k, err := GenerateMeshKey()
	if err != nil {
		t.Fatal(err)
	}
	return k
}

// newTestHost starts a host on loopback with an OS-chosen port.
func newTestHost(t *testing.T, key MeshKey, log *zap.Logger, mod func(*Config)) *Host {
	t.Helper()
	cfg := Config{
		DataDir: t.TempDir(),
		Listen:  []string{"/ip4/127.0.0.1/tcp/0"},
		MeshKey: key,
		Logger:  log,
	}
	if mod != nil {
		mod(&cfg)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	h, err := New(ctx, cfg)
	if err != nil {
		t.Fatalf("New: %v", err)
	}
	t.Cleanup(func() { h.Close() })
	return h
}

func observed() (*zap.Logger, *observer.ObservedLogs) {
	core, logs := observer.New(zap.DebugLevel)
	return zap.New(core), logs
}

// waitLog waits until a log message containing snippet has been written.
func waitLog(t *testing.T, logs *observer.ObservedLogs, snippet string, within time.Duration) observer.LoggedEntry {
	t.Helper()
	deadline := time.Now().Add(within)
	for {
		if got := logs.FilterMessageSnippet(snippet).All(); len(got) > 0 {
			return got[0]
		}
		if time.Now().After(deadline) {
			t.Fatalf("no log containing %q within %v; have %d entries", snippet, within, logs.Len())
		}
		time.Sleep(20 * time.Millisecond)
	}
}

func TestMeshKeyText(t *testing.T) {
	k := mustMeshKey(t)
	s := k.String()
	if !strings.HasPrefix(s, "mk1_") {
		t.Fatalf("text form %q lacks prefix", s)
	}
	got, err := ParseMeshKey(" " + s + "\n")
	if err != nil || got != k {
		t.Fatalf("round trip: %v, equal=%v", err, got == k)
	}
	// Flip one character: the checksum must catch it.
	b := []byte(s)
	i := len("mk1_") + 3
	if b[i] == 'A' {
		b[i] = 'B'
	} else {
		b[i] = 'A'
	}
	if _, err := ParseMeshKey(string(b)); err == nil {
		t.Fatal("mistyped key parsed")
	}
	for _, bad := range []string{"", "mk1_", "nope", "mk1_!!!!", "mk2_" + s[4:]} {
		if _, err := ParseMeshKey(bad); err == nil {
			t.Errorf("ParseMeshKey(%q) succeeded", bad)
		}
	}
	if a, b := k.GossipKey(), mustMeshKey(t).GossipKey(); a == b {
		t.Error("different mesh keys give the same gossip key")
	}
	if len(multistreamHello) != proofLen {
		t.Errorf("multistream hello is %d bytes, proof %d: plain peers would not be recognized", len(multistreamHello), proofLen)
	}
	if gk := k.GossipKey(); string(k.derive("link v3", 32)) == string(gk[:]) {
		t.Error("link and gossip keys are not independent")
	}
}

func TestMeshKeyFile(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "data")
	k, created, err := LoadOrCreateMeshKey(dir)
	if err != nil || !created {
		t.Fatalf("create: %v created=%v", err, created)
	}
	k2, created, err := LoadOrCreateMeshKey(dir)
	if err != nil || created || k2 != k {
		t.Fatalf("reload: %v created=%v same=%v", err, created, k2 == k)
	}
	assertMode(t, filepath.Join(dir, MeshKeyFile), 0o600)
	assertMode(t, dir, 0o700)
}

func assertMode(t *testing.T, path string, want os.FileMode) {
	t.Helper()
	fi, err := os.Stat(path)
	if err != nil {
		t.Fatal(err)
	}
	if got := fi.Mode().Perm(); got != want {
		t.Errorf("%s: mode %o, want %o", path, got, want)
	}
}

func TestPeerKeyPersists(t *testing.T) {
	dir := filepath.Join(t.TempDir(), "data")
	k1, err := LoadOrCreateKey(dir)
	if err != nil {
		t.Fatal(err)
	}
	assertMode(t, filepath.Join(dir, PeerKeyFile), 0o600)
	assertMode(t, dir, 0o700)

	mk := mustMeshKey(t)
	start := func() peer.ID {
		h := newTestHost(t, mk, nil, func(c *Config) { c.DataDir = dir })
		id := h.ID()
		if err := h.Close(); err != nil {
			t.Fatal(err)
		}
		return id
	}
	id1, id2 := start(), start()
	if id1 != id2 {
		t.Fatalf("peer ID changed across restart: %s -> %s", id1, id2)
	}
	want, _ := peer.IDFromPrivateKey(k1)
	if id1 != want {
		t.Fatalf("host ID %s, key file says %s", id1, want)
	}
}

func TestConnectAndStream(t *testing.T) {
	mk := mustMeshKey(t)
	a := newTestHost(t, mk, nil, nil)
	b := newTestHost(t, mk, nil, nil)

	const proto protocol.ID = "/meshnode/test-echo/1"
	l := a.Listen(proto)
	done := make(chan struct{})
	go func() {
		defer close(done)
		c, err := l.Accept()
		if err != nil {
			return
		}
		defer c.Close()
		line, _ := bufio.NewReader(c).ReadString('\n')
		io.WriteString(c, "echo: "+line)
	}()
	t.Cleanup(func() { l.Close(); <-done })

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	id, err := b.Connect(ctx, a.Addrs()[0].String())
	if err != nil {
		t.Fatalf("Connect: %v", err)
	}
	if id != a.ID() {
		t.Fatalf("connected to %s, want %s", id, a.ID())
	}
	if ps := b.Peers(); len(ps) != 1 || ps[0] != a.ID() {
		t.Fatalf("Peers() = %v", ps)
	}
	c, err := b.Dial(ctx, a.ID(), proto)
	if err != nil {
		t.Fatalf("Dial: %v", err)
	}
	defer c.Close()
	io.WriteString(c, "hello\n")
	got, err := bufio.NewReader(c).ReadString('\n')
	if err != nil || got != "echo: hello\n" {
		t.Fatalf("read %q, %v", got, err)
	}
}

func TestWrongMeshKeyRefused(t *testing.T) {
	log, logs := observed()
	a := newTestHost(t, mustMeshKey(t), log, nil)
	target := a.Addrs()[0].String()

	t.Run("other key", func(t *testing.T) {
		blog, blogs := observed()
		b := newTestHost(t, mustMeshKey(t), blog, nil)
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		start := time.Now()
		_, err := b.Connect(ctx, target)
		took := time.Since(start)
		if !errors.Is(err, ErrMeshKey) {
			t.Fatalf("Connect with another key: err = %v, want ErrMeshKey", err)
		}
		t.Logf("refused after %v: %v", took.Round(time.Millisecond), err)
		if took > 2*time.Second {
			t.Errorf("refusal took %v; it should be immediate", took)
		}
		waitLog(t, blogs, "peer refused: wrong or missing mesh key", time.Second)
		e := waitLog(t, logs, "refused connection: wrong mesh key", 2*time.Second)
		if e.Level != zap.WarnLevel {
			t.Errorf("listener logged refusal at %v, want warn", e.Level)
		}
		if len(a.Peers()) != 0 || len(b.Peers()) != 0 {
			t.Fatalf("peers connected despite refusal: %v %v", a.Peers(), b.Peers())
		}
	})

	t.Run("no key", func(t *testing.T) {
		logs.TakeAll()
		plain, err := libp2p.New(libp2p.NoListenAddrs, libp2p.DisableMetrics())
		if err != nil {
			t.Fatal(err)
		}
		defer plain.Close()
		info, err := peer.AddrInfoFromString(target)
		if err != nil {
			t.Fatal(err)
		}
		ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
		defer cancel()
		if err := plain.Connect(ctx, *info); err == nil {
			t.Fatal("a host without mesh key connected")
		}
		waitLog(t, logs, "refused connection: peer has no mesh key", 2*time.Second)
	})
}

func TestAllowlist(t *testing.T) {
	mk := mustMeshKey(t)
	log, logs := observed()
	a := newTestHost(t, mk, log, func(c *Config) {
		c.Allow = func(peer.ID) bool { return false }
	})
	b := newTestHost(t, mk, nil, nil)
	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	// The dialer may finish its side of the handshake before the listener's
	// gater closes the connection, so Connect can succeed; what matters is
	// that the connection does not survive and no stream gets through.
	_, _ = b.Connect(ctx, a.Addrs()[0].String())
	e := waitLog(t, logs, "refused peer: not in allowlist", 5*time.Second)
	if len(a.Peers()) != 0 {
		t.Fatalf("refused peer connected: %v", a.Peers())
	}
	if _, err := b.Dial(ctx, a.ID(), "/meshnode/test-allow/1"); err == nil {
		t.Fatal("opened a stream to a host whose allowlist refuses us")
	}
	if got := e.ContextMap()["peer"]; got != b.ID().String() {
		t.Errorf("refusal names peer %v, want %s", got, b.ID())
	}
	if n := logs.FilterMessageSnippet("refused connection").Len(); n != 0 {
		t.Errorf("allowlist refusal also logged as a handshake failure (%d)", n)
	}
}

func TestGRPCOverStream(t *testing.T) {
	mk := mustMeshKey(t)
	a := newTestHost(t, mk, nil, nil)
	b := newTestHost(t, mk, nil, nil)
	const proto protocol.ID = "/meshnode/test-grpc/1"

	srv := grpc.NewServer()
	hs := health.NewServer()
	hs.SetServingStatus("stage", healthpb.HealthCheckResponse_SERVING)
	healthpb.RegisterHealthServer(srv, hs)
	served := make(chan error, 1)
	go func() { served <- srv.Serve(a.Listen(proto)) }()
	t.Cleanup(func() { srv.Stop(); <-served })

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := b.Connect(ctx, a.Addrs()[0].String()); err != nil {
		t.Fatal(err)
	}
	cc, err := grpc.NewClient("passthrough:///"+a.ID().String(),
		grpc.WithContextDialer(b.GRPCDialer(proto)),
		grpc.WithTransportCredentials(insecure.NewCredentials()))
	if err != nil {
		t.Fatal(err)
	}
	defer cc.Close()
	resp, err := healthpb.NewHealthClient(cc).Check(ctx, &healthpb.HealthCheckRequest{Service: "stage"})
	if err != nil {
		t.Fatalf("health check over libp2p: %v", err)
	}
	if resp.GetStatus() != healthpb.HealthCheckResponse_SERVING {
		t.Fatalf("status %v", resp.GetStatus())
	}
	if _, err := b.GRPCDialer(proto)(ctx, "not-a-peer"); err == nil {
		t.Fatal("dialer accepted a bad peer ID")
	}
}

func TestJoinInfo(t *testing.T) {
	mk := mustMeshKey(t)
	a := newTestHost(t, mk, nil, nil)
	b := newTestHost(t, mk, nil, nil)
	a.ServeGossipAddrs(4002, func() []string { return []string{"10.1.2.3:4002", "127.0.0.1:4002"} })

	ctx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	if _, err := b.Connect(ctx, a.Addrs()[0].String()); err != nil {
		t.Fatal(err)
	}
	got, err := b.FetchGossipAddrs(ctx, a.ID())
	if err != nil {
		t.Fatal(err)
	}
	want := []string{"127.0.0.1:4002", "10.1.2.3:4002"}
	if strings.Join(got, ",") != strings.Join(want, ",") {
		t.Fatalf("gossip addrs %v, want %v", got, want)
	}
	// A peer that does not serve the protocol gives an error, not a hang.
	if _, err := a.FetchGossipAddrs(ctx, b.ID()); err == nil {
		t.Fatal("fetch from a peer without the handler succeeded")
	}
}

func TestAddrsAndJoinCommand(t *testing.T) {
	mk := mustMeshKey(t)
	h := newTestHost(t, mk, nil, func(c *Config) { c.Listen = []string{"/ip4/0.0.0.0/tcp/0"} })
	addrs := h.Addrs()
	if len(addrs) == 0 {
		t.Fatal("no addresses")
	}
	for _, a := range addrs {
		if !strings.HasSuffix(a.String(), "/p2p/"+h.ID().String()) {
			t.Errorf("address %s lacks /p2p/<id>", a)
		}
	}
	cmd := h.JoinCommand()
	if !strings.HasPrefix(cmd, "meshnode join /ip") || !strings.HasSuffix(cmd, "--mesh-key "+mk.String()) {
		t.Fatalf("join command %q", cmd)
	}
	if len(addrs) > 1 && strings.Contains(cmd, "/ip4/127.0.0.1/") {
		t.Errorf("join command uses loopback although %v exist", addrs)
	}
	t.Log(cmd)
}

func TestDefaultPortFallback(t *testing.T) {
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	port := taken.Addr().(*net.TCPAddr).Port

	old := DefaultListen
	DefaultListen = []string{"/ip4/127.0.0.1/tcp/" + strconv.Itoa(port)}
	defer func() { DefaultListen = old }()

	log, logs := observed()
	h := newTestHost(t, mustMeshKey(t), log, func(c *Config) { c.Listen = nil })
	if strings.Contains(h.Addrs()[0].String(), "/tcp/"+strconv.Itoa(port)+"/") {
		t.Fatalf("listening on the taken port: %v", h.Addrs())
	}
	waitLog(t, logs, "port taken", time.Second)

	// An explicit address is not silently changed.
	_, err = New(context.Background(), Config{
		DataDir: t.TempDir(), MeshKey: mustMeshKey(t),
		Listen: []string{"/ip4/127.0.0.1/tcp/" + strconv.Itoa(port)},
	})
	if err == nil {
		t.Fatal("explicit taken port did not fail")
	}
}

func TestConfigErrors(t *testing.T) {
	ctx := context.Background()
	if _, err := New(ctx, Config{DataDir: t.TempDir()}); err == nil {
		t.Error("no mesh key accepted")
	}
	if _, err := New(ctx, Config{DataDir: t.TempDir(), MeshKey: mustMeshKey(t),
		Listen: []string{"/ip4/127.0.0.1/udp/0/quic-v1"}}); err == nil {
		t.Error("QUIC listen address accepted in a private mesh")
	}
}
