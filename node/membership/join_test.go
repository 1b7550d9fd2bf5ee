package membership

import (
	"context"
	"testing"
	"time"

	"github.com/meshnode/meshnode/node/host"
)

// TestJoinThroughLibp2p follows `meshnode join`: the command carries only a
// libp2p address and the mesh key; the gossip address comes over
// host.JoinProtocol and the gossip key from the mesh key.
func TestJoinThroughLibp2p(t *testing.T) {
	mk, err := host.GenerateMeshKey()
	if err != nil {
		t.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 15*time.Second)
	defer cancel()
	start := func(name string) (*host.Host, *Membership) {
		h, err := host.New(ctx, host.Config{DataDir: t.TempDir(), Listen: []string{"/ip4/127.0.0.1/tcp/0"}, MeshKey: mk})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { h.Close() })
		meta := sampleMeta(name)
		m, err := New(Config{
			Name: h.ID().String(), BindAddr: "127.0.0.1", AdvertiseAddr: "127.0.0.1",
			SecretKey: mk.GossipKey(), Meta: func() Meta { return meta },
		})
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { m.Close() })
		h.ServeGossipAddrs(m.Port(), nil)
		return h, m
	}
	ha, ma := start("first")
	hb, mb := start("second")

	id, err := hb.Connect(ctx, ha.Addrs()[0].String())
	if err != nil {
		t.Fatal(err)
	}
	addrs, err := hb.FetchGossipAddrs(ctx, id)
	if err != nil {
		t.Fatal(err)
	}
	if addrs[0] != ma.LocalAddr() {
		t.Fatalf("gossip addrs %v, want %s first", addrs, ma.LocalAddr())
	}
	if _, err := mb.Join(addrs); err != nil {
		t.Fatal(err)
	}
	eventually(t, 3*time.Second, "both members see each other", func() bool {
		x, ok := member(ma, hb.ID().String())
		return ok && x.Meta.Name == "second" && len(mb.Members()) == 2
	})
}
