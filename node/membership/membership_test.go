package membership

import (
	"fmt"
	"net"
	"strconv"
	"strings"
	"testing"
	"time"

	"go.uber.org/zap"
	"go.uber.org/zap/zapcore"
	"go.uber.org/zap/zaptest/observer"
)

var testKey = [32]byte{1, 2, 3, 4, 5, 6, 7, 8, 9}

func sampleMeta(name string) Meta {
	return Meta{
		Name:    name,
		Addrs:   []string{"/ip4/127.0.0.1/tcp/4001/p2p/" + name},
		HTTP:    "127.0.0.1:8080",
		Engine:  "ggml",
		Backend: "cpu",
		Compute: "5f0c6e8a91d2b374",
		// Where nodes of this machine reach it: must travel too.
		LocalHost:   "9a1b2c3d4e5f6071",
		LocalSocket: "/tmp/meshnode-1000/0123456789abcdef.sock",
		MemTotal:    16 << 30,
		MemFree:     8 << 30,
		Speed:       12.5,
		Models:      []ModelRef{{ID: "qwen3-0.6b-q8", Name: "Qwen3 0.6B", HasFile: true}},
		Serving:     []Serve{{Model: "qwen3-0.6b-q8", Start: 0, End: 28}},
		State:       NodeReady,
	}
}

// bigMeta does not fit memberlist's 512-byte node meta.
func bigMeta(name string, models int) Meta {
	m := sampleMeta(name)
	m.Models = nil
	for i := range models {
		m.Models = append(m.Models, ModelRef{
			ID:   fmt.Sprintf("hf:some-org/some-rather-long-model-name-%02d-GGUF:Q4_K_M", i),
			Name: fmt.Sprintf("model %d", i),
		})
	}
	return m
}

type node struct {
	*Membership
	logs *observer.ObservedLogs
}

func newNode(t *testing.T, name string, key [32]byte, meta Meta) node {
	t.Helper()
	core, logs := observer.New(zapcore.DebugLevel)
	m, err := New(Config{
		Name:          name,
		BindAddr:      "127.0.0.1",
		AdvertiseAddr: "127.0.0.1",
		SecretKey:     key,
		Logger:        zap.New(core),
		Meta:          func() Meta { return meta },
	})
	if err != nil {
		t.Fatalf("New(%s): %v", name, err)
	}
	t.Cleanup(func() { m.Close() })
	return node{m, logs}
}

// eventually polls cond until it holds or within passes.
func eventually(t *testing.T, within time.Duration, what string, cond func() bool) time.Duration {
	t.Helper()
	start := time.Now()
	for !cond() {
		if time.Since(start) > within {
			t.Fatalf("%s: not within %v", what, within)
		}
		time.Sleep(10 * time.Millisecond)
	}
	return time.Since(start)
}

// waitEvent reads events until one of kind about peer arrives.
func waitEvent(t *testing.T, m *Membership, kind EventKind, peer string, within time.Duration) Event {
	t.Helper()
	timeout := time.After(within)
	for {
		select {
		case ev, ok := <-m.Events():
			if !ok {
				t.Fatal("events closed")
			}
			if ev.Kind == kind && ev.Member.Meta.PeerID == peer {
				return ev
			}
		case <-timeout:
			t.Fatalf("no %s event for %s within %v", kind, peer, within)
		}
	}
}

func member(m *Membership, peer string) (Member, bool) {
	for _, x := range m.Members() {
		if x.Meta.PeerID == peer {
			return x, true
		}
	}
	return Member{}, false
}

// cluster starts n nodes joined through the first.
func cluster(t *testing.T, metas ...Meta) []node {
	t.Helper()
	var nodes []node
	for i, meta := range metas {
		n := newNode(t, meta.Name, testKey, meta)
		if i > 0 {
			if got, err := n.Join([]string{nodes[0].LocalAddr()}); err != nil || got != 1 {
				t.Fatalf("join %s: %d, %v", meta.Name, got, err)
			}
		}
		nodes = append(nodes, n)
	}
	eventually(t, 5*time.Second, "all members see each other", func() bool {
		for _, n := range nodes {
			ms := n.Members()
			if len(ms) != len(nodes) {
				return false
			}
			for _, x := range ms {
				if !x.Complete {
					return false
				}
			}
		}
		return true
	})
	return nodes
}

func TestJoinMetaAndUpdate(t *testing.T) {
	nodes := cluster(t, sampleMeta("peer-a"), sampleMeta("peer-b"), sampleMeta("peer-c"))
	for _, n := range nodes {
		for _, x := range n.Members() {
			want := sampleMeta(x.Meta.PeerID)
			if x.Meta.Name != want.Name || x.Meta.HTTP != want.HTTP || x.Meta.MemTotal != want.MemTotal ||
				len(x.Meta.Models) != 1 || x.Meta.Models[0] != want.Models[0] ||
				len(x.Meta.Serving) != 1 || x.Meta.Serving[0] != want.Serving[0] ||
				x.State != StateAlive || x.Meta.Version == 0 {
				t.Fatalf("%s sees %+v", n.LocalAddr(), x)
			}
			if _, port, _ := net.SplitHostPort(x.Addr); port == "0" || port == "" {
				t.Fatalf("member address %q", x.Addr)
			}
		}
	}

	// A metadata change reaches the others quickly.
	upd := sampleMeta("peer-b")
	upd.LoadPct, upd.State = 0.75, NodeDraining
	upd.Serving = []Serve{{Model: "qwen3-0.6b-q8", Start: 14, End: 28}}
	start := time.Now()
	if err := nodes[1].UpdateMeta(upd); err != nil {
		t.Fatal(err)
	}
	for _, n := range []node{nodes[0], nodes[2]} {
		eventually(t, 2*time.Second, "update propagates", func() bool {
			x, ok := member(n.Membership, "peer-b")
			return ok && x.Meta.LoadPct == 0.75 && x.Meta.State == NodeDraining && x.Meta.Serving[0].Start == 14
		})
		ev := waitEvent(t, n.Membership, EventUpdate, "peer-b", time.Second)
		if ev.Member.Meta.LoadPct != 0.75 {
			t.Errorf("update event carries %+v", ev.Member.Meta)
		}
	}
	t.Logf("metadata update seen by both others after %v", time.Since(start).Round(time.Millisecond))
	if got := nodes[1].LocalMeta(); got.LoadPct != 0.75 || got.PeerID != "peer-b" {
		t.Errorf("LocalMeta = %+v", got)
	}
}

func TestLargeMetaFetchedByPushPull(t *testing.T) {
	big := bigMeta("peer-big", 20)
	if b, _ := encodeNodeMeta(big, false, 512); b[0] != tagSummary {
		t.Fatal("test meta fits in node meta; make it bigger")
	}
	nodes := cluster(t, sampleMeta("peer-a"), big, sampleMeta("peer-c"))
	for _, n := range []node{nodes[0], nodes[2]} {
		x, _ := member(n.Membership, "peer-big")
		if len(x.Meta.Models) != 20 || x.Meta.Models[19].ID != big.Models[19].ID || x.Meta.Name != "peer-big" {
			t.Fatalf("full metadata not fetched: %+v", x.Meta)
		}
	}

	// A hot field travels in the summary; no fetch needed.
	fetches := nodes[0].fetches.Load()
	upd := bigMeta("peer-big", 20)
	upd.Load = 3
	start := time.Now()
	if err := nodes[1].UpdateMeta(upd); err != nil {
		t.Fatal(err)
	}
	eventually(t, 2*time.Second, "hot field update", func() bool {
		x, _ := member(nodes[0].Membership, "peer-big")
		return x.Meta.Load == 3 && x.Complete && len(x.Meta.Models) == 20
	})
	t.Logf("hot update via summary: %v", time.Since(start).Round(time.Millisecond))
	if got := nodes[0].fetches.Load(); got != fetches {
		t.Errorf("hot field update caused %d fetches", got-fetches)
	}

	// A cold field change triggers a fetch.
	upd = bigMeta("peer-big", 21)
	start = time.Now()
	if err := nodes[1].UpdateMeta(upd); err != nil {
		t.Fatal(err)
	}
	eventually(t, 2*time.Second, "cold field update", func() bool {
		x, _ := member(nodes[2].Membership, "peer-big")
		return x.Complete && len(x.Meta.Models) == 21
	})
	t.Logf("cold update via push-pull fetch: %v", time.Since(start).Round(time.Millisecond))
}

func TestAbruptCloseDetected(t *testing.T) {
	nodes := cluster(t, sampleMeta("peer-a"), sampleMeta("peer-b"), sampleMeta("peer-c"))
	start := time.Now()
	nodes[2].Close() // no Leave: as if the machine died
	for _, n := range nodes[:2] {
		ev := waitEvent(t, n.Membership, EventFailed, "peer-c", 6*time.Second)
		took := time.Since(start)
		if ev.Member.State != StateDead {
			t.Errorf("failed member state %q", ev.Member.State)
		}
		if took > 6*time.Second {
			t.Fatalf("failure noticed after %v, want < 6s", took)
		}
		t.Logf("%s declared peer-c failed after %v", n.name, took.Round(time.Millisecond))
		if _, ok := member(n.Membership, "peer-c"); ok {
			t.Error("failed member still listed")
		}
	}
	if n := len(nodes[0].logs.FilterMessageSnippet("member failed").All()); n == 0 {
		t.Error("failure not logged")
	}
}

func TestGracefulLeave(t *testing.T) {
	nodes := cluster(t, sampleMeta("peer-a"), sampleMeta("peer-b"), sampleMeta("peer-c"))
	start := time.Now()
	if err := nodes[2].Leave(2 * time.Second); err != nil {
		t.Fatal(err)
	}
	nodes[2].Close()
	for _, n := range nodes[:2] {
		ev := waitEvent(t, n.Membership, EventLeave, "peer-c", 3*time.Second)
		if ev.Member.State != StateLeft || ev.Member.Meta.Name != "peer-c" {
			t.Errorf("leave event %+v", ev.Member)
		}
	}
	t.Logf("leave seen after %v", time.Since(start).Round(time.Millisecond))
	if got := len(nodes[0].Members()); got != 2 {
		t.Fatalf("%d members after leave", got)
	}
}

func TestWrongKeyCannotJoin(t *testing.T) {
	a := newNode(t, "peer-a", testKey, sampleMeta("peer-a"))
	other := testKey
	other[0] ^= 0xff
	x := newNode(t, "peer-x", other, sampleMeta("peer-x"))
	n, err := x.Join([]string{a.LocalAddr()})
	if err == nil || n != 0 {
		t.Fatalf("join with another key: %d, %v", n, err)
	}
	eventually(t, 2*time.Second, "refusal logged by the contacted node", func() bool {
		return a.logs.FilterMessageSnippet("refused gossip: wrong mesh key?").Len() > 0
	})
	time.Sleep(300 * time.Millisecond)
	if got := len(a.Members()); got != 1 {
		t.Fatalf("node with another key became a member: %v", a.Members())
	}
}

func TestMemberlistLogsGoThroughZap(t *testing.T) {
	nodes := cluster(t, sampleMeta("peer-a"), sampleMeta("peer-b"))
	ml := nodes[0].logs.Filter(func(e observer.LoggedEntry) bool { return e.LoggerName == "memberlist" })
	if ml.Len() == 0 {
		t.Fatal("no memberlist log lines captured")
	}
	for _, e := range ml.All() {
		if strings.HasPrefix(e.Message, "[") || strings.HasPrefix(e.Message, "memberlist:") {
			t.Errorf("prefix not parsed: %q", e.Message)
		}
	}
	t.Logf("%d memberlist lines, e.g. %v %q", ml.Len(), ml.All()[0].Level, ml.All()[0].Message)
}

func TestZapWriterLevels(t *testing.T) {
	core, logs := observer.New(zapcore.DebugLevel)
	w := &zapWriter{log: zap.New(core)}
	w.Write([]byte("[DEBUG] memberlist: a\n[WARN] memberlist: b\n"))
	w.Write([]byte("[ERR] memberlist: c\n"))
	w.Write([]byte("[INFO] memberlist: d\nplain\n"))
	w.Write([]byte("[ERR] memberlist: failed to receive: No installed keys could decrypt the message from=1.2.3.4:5\n"))
	want := []struct {
		lvl zapcore.Level
		msg string
	}{
		{zapcore.DebugLevel, "a"}, {zapcore.WarnLevel, "b"}, {zapcore.ErrorLevel, "c"},
		{zapcore.InfoLevel, "d"}, {zapcore.InfoLevel, "plain"}, {zapcore.WarnLevel, "refused gossip: wrong mesh key?"},
	}
	got := logs.All()
	if len(got) != len(want) {
		t.Fatalf("%d entries: %v", len(got), got)
	}
	for i, w := range want {
		if got[i].Level != w.lvl || !strings.HasPrefix(got[i].Message, w.msg) {
			t.Errorf("entry %d: %v %q, want %v %q", i, got[i].Level, got[i].Message, w.lvl, w.msg)
		}
	}
}

func TestEventsDropOldest(t *testing.T) {
	m := &Membership{name: "self", events: make(chan Event, 3)}
	for i := range 5 {
		m.emit(EventUpdate, Member{Meta: Meta{PeerID: "p", Load: float64(i)}})
	}
	m.emit(EventJoin, Member{Meta: Meta{PeerID: "self"}}) // never about ourselves
	if m.Dropped() != 2 {
		t.Fatalf("dropped %d, want 2", m.Dropped())
	}
	for want := 2.0; want < 5; want++ {
		if ev := <-m.events; ev.Member.Meta.Load != want {
			t.Fatalf("got load %v, want %v (oldest dropped first)", ev.Member.Meta.Load, want)
		}
	}
}

func TestMetaCodec(t *testing.T) {
	small := sampleMeta("p")
	small.Version = 7
	b, err := encodeNodeMeta(small, false, 512)
	if err != nil || b[0] != tagFull {
		t.Fatalf("small meta: %q %v", b, err)
	}
	nm, err := decodeNodeMeta(b)
	if err != nil || !nm.full || nm.meta.Name != "p" || nm.meta.Version != 7 || nm.meta.Serving[0].End != 28 {
		t.Fatalf("decode: %+v %v", nm, err)
	}
	if got := nm.meta; got.Compute != small.Compute || got.LocalHost != small.LocalHost || got.LocalSocket != small.LocalSocket {
		t.Fatalf("decode: compute %q, local %q %q", got.Compute, got.LocalHost, got.LocalSocket)
	}

	big := bigMeta("p", 200)
	big.State = strings.Repeat("x", 1000) // clamped, so the summary still fits
	b, err = encodeNodeMeta(big, false, 512)
	if err != nil || b[0] != tagSummary || len(b) > 512 {
		t.Fatalf("big meta: %d bytes, %v", len(b), err)
	}
	nm, err = decodeNodeMeta(b)
	if err != nil || nm.full || nm.coldHash != toCold(big).hash() {
		t.Fatalf("decode summary: %+v %v", nm, err)
	}

	st, err := encodeState("p", big)
	if err != nil {
		t.Fatal(err)
	}
	id, m, h, err := decodeState(st)
	if err != nil || id != "p" || len(m.Models) != 200 || h != nm.coldHash {
		t.Fatalf("state round trip: %s %d %v", id, len(m.Models), err)
	}
	for _, bad := range [][]byte{nil, {'F'}, {'Z', '{', '}'}, []byte("S{bad")} {
		if _, err := decodeNodeMeta(bad); err == nil {
			t.Errorf("decoded %q", bad)
		}
	}
}

func TestPortFallback(t *testing.T) {
	taken, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer taken.Close()
	port := taken.Addr().(*net.TCPAddr).Port
	cfg := Config{Name: "p", BindAddr: "127.0.0.1", BindPort: port, AdvertiseAddr: "127.0.0.1", SecretKey: testKey}
	if m, err := New(cfg); err == nil {
		m.Close()
		t.Fatal("bound a taken port")
	}
	cfg.PortFallback = true
	m, err := New(cfg)
	if err != nil {
		t.Fatal(err)
	}
	defer m.Close()
	if m.Port() == port || m.Port() == 0 || !strings.HasSuffix(m.LocalAddr(), ":"+strconv.Itoa(m.Port())) {
		t.Fatalf("port %d, addr %s", m.Port(), m.LocalAddr())
	}
}

func TestConfigErrors(t *testing.T) {
	if _, err := New(Config{SecretKey: testKey}); err == nil {
		t.Error("no name accepted")
	}
	if _, err := New(Config{Name: "p"}); err == nil {
		t.Error("no secret key accepted")
	}
}

// TestReconnectAfterLongPartition: memberlist gossips to a dead member only
// for GossipToTheDeadTime, so after a longer partition the sides never meet
// again on their own. The reconnect loop asks failed members to rejoin.
// Here a member fails, stays away longer than that time, and comes back on
// its address without joining anyone: with the loop, the survivor finds it;
// without (an interval of an hour), nobody does.
func TestReconnectAfterLongPartition(t *testing.T) {
	defer func(every, dead time.Duration) { reconnectEvery, gossipToTheDead = every, dead }(reconnectEvery, gossipToTheDead)
	gossipToTheDead = 300 * time.Millisecond
	tests := []struct {
		name  string
		every time.Duration
		heals bool
	}{
		{"reconnect loop", 200 * time.Millisecond, true},
		{"no reconnect loop", time.Hour, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			reconnectEvery = tt.every
			nodes := cluster(t, sampleMeta("peer-a"), sampleMeta("peer-b"))
			a, b := nodes[0], nodes[1]
			port := b.Port()
			b.Close() // no Leave: the partition
			waitEvent(t, a.Membership, EventFailed, "peer-b", 6*time.Second)
			time.Sleep(gossipToTheDead + time.Second) // past memberlist's own gossip to the dead

			back, err := New(Config{
				Name: "peer-b", BindAddr: "127.0.0.1", BindPort: port, AdvertiseAddr: "127.0.0.1",
				SecretKey: testKey, Meta: func() Meta { return sampleMeta("peer-b") },
			})
			if err != nil {
				t.Fatal(err)
			}
			defer back.Close()
			deadline := time.Now().Add(4 * time.Second)
			healed := false
			for time.Now().Before(deadline) && !healed {
				_, seesB := member(a.Membership, "peer-b")
				_, seesA := member(back, "peer-a")
				healed = seesA && seesB
				time.Sleep(50 * time.Millisecond)
			}
			if healed != tt.heals {
				t.Errorf("healed: %v, want %v", healed, tt.heals)
			}
		})
	}
}
