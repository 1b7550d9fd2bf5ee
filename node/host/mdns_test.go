package host

import (
	"context"
	"fmt"
	"net"
	"os"
	"os/exec"
	"strings"
	"testing"
	"time"
)

// inNetnsEnv is set when the test binary re-runs itself inside a network
// namespace made for the mDNS test.
const inNetnsEnv = "MESHNODE_TEST_IN_NETNS"

// TestMDNSDiscovery needs multicast. As root with iproute2 it re-runs itself
// in a fresh network namespace whose loopback has multicast on, which is
// isolated and deterministic (a shared LAN may filter or flood mDNS). Without
// that it uses the host's network if an interface can multicast, else skips.
func TestMDNSDiscovery(t *testing.T) {
	if os.Getenv(inNetnsEnv) == "" {
		err := runInNetns(t, "TestMDNSDiscovery")
		if err == nil {
			return
		}
		t.Logf("netns unavailable (%v); trying the host network", err)
		if !hasMulticastIface() {
			t.Skip("no up, multicast-capable interface and no network namespace (needs root and iproute2): mDNS cannot be tested here")
		}
	}
	testMDNS(t)
}

func testMDNS(t *testing.T) {
	mk := mustMeshKey(t)
	mdnsOn := func(c *Config) { c.MDNS = true }
	a := newTestHost(t, mk, nil, mdnsOn)
	b := newTestHost(t, mk, nil, mdnsOn)
	other := newTestHost(t, mustMeshKey(t), nil, mdnsOn) // another mesh on the same LAN

	select {
	case info := <-a.Discovered():
		if info.ID != b.ID() {
			t.Fatalf("a discovered %s, want %s", info.ID, b.ID())
		}
	case info := <-b.Discovered():
		if info.ID != a.ID() {
			t.Fatalf("b discovered %s, want %s", info.ID, a.ID())
		}
	case <-time.After(15 * time.Second):
		t.Fatal("no mDNS discovery within 15s")
	}
	deadline := time.Now().Add(5 * time.Second)
	for len(a.Peers()) == 0 || len(b.Peers()) == 0 {
		if time.Now().After(deadline) {
			t.Fatal("discovered peers not connected")
		}
		time.Sleep(20 * time.Millisecond)
	}
	// The other mesh announces under another service name, so nobody dials it.
	time.Sleep(500 * time.Millisecond)
	for _, h := range []*Host{a, b, other} {
		for _, p := range h.Peers() {
			if p == other.ID() || h == other {
				t.Fatalf("cross-mesh connection %s <-> %s", h.ID(), p)
			}
		}
	}
}

func hasMulticastIface() bool {
	ifs, err := net.Interfaces()
	if err != nil {
		return false
	}
	for _, i := range ifs {
		if i.Flags&net.FlagUp != 0 && i.Flags&net.FlagMulticast != 0 {
			return true
		}
	}
	return false
}

// runInNetns re-runs test in a new network namespace; an error means the
// namespace could not be made (the caller falls back), a failure inside it
// fails t.
func runInNetns(t *testing.T, test string) error {
	if os.Geteuid() != 0 {
		return fmt.Errorf("not root")
	}
	ip, err := exec.LookPath("ip")
	if err != nil {
		return fmt.Errorf("iproute2: %w", err)
	}
	ns := fmt.Sprintf("meshnode-test-%d", os.Getpid())
	if out, err := exec.Command(ip, "netns", "add", ns).CombinedOutput(); err != nil {
		return fmt.Errorf("ip netns add: %v: %s", err, out)
	}
	defer exec.Command(ip, "netns", "del", ns).Run()
	if out, err := exec.Command(ip, "netns", "exec", ns, ip, "link", "set", "lo", "up", "multicast", "on").CombinedOutput(); err != nil {
		return fmt.Errorf("set lo multicast in netns: %v: %s", err, out)
	}

	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	cmd := exec.CommandContext(ctx, ip, "netns", "exec", ns, os.Args[0],
		"-test.run=^"+test+"$", "-test.count=1", "-test.v", "-test.timeout=30s")
	cmd.Env = append(os.Environ(), inNetnsEnv+"=1")
	out, err := cmd.CombinedOutput()
	t.Logf("in netns %s:\n%s", ns, out)
	if err != nil {
		t.Fatalf("%s in netns: %v", test, err)
	}
	if strings.Contains(string(out), "--- SKIP") {
		t.Fatalf("%s skipped inside the netns", test)
	}
	return nil
}
