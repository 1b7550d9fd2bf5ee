package meshtest

import (
	"context"
	"errors"
	"fmt"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"strings"
	"testing"
	"time"
)

// The namespaces test's network: deploy/local-mesh.sh's layout under a
// prefix of its own, on the subnet the script uses by default.
const (
	netnsPrefix = "mnt-"
	netnsNet    = "10.77.0"
	netnsPort   = 9337
)

// TestNetns: the acceptance run of TestSplitMesh (stories260K, f16, three
// nodes, greedy through an entry node) with every node in a network
// namespace of its own, joined by veth pairs to a bridge, one shaped link
// per node (1ms delay: netem, or where the kernel has none the script's
// userspace delay relay; a tbf rate limit where that cannot run either),
// set up by deploy/local-mesh.sh. The nodes find each other by
// their 10.77.0.x addresses only, and the HTTP API, now beyond loopback,
// requires the API key. Needs root and iproute2; skipped otherwise.
func TestNetns(t *testing.T) {
	if runtime.GOOS != "linux" {
		t.Skip("network namespaces are Linux only")
	}
	if os.Geteuid() != 0 {
		t.Skip("needs root to create network namespaces")
	}
	for _, tool := range []string{"ip", "tc", "bash", "setsid"} {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("needs %s: %v", tool, err)
		}
	}
	script, err := filepath.Abs("../../deploy/local-mesh.sh")
	if err != nil {
		t.Fatal(err)
	}
	// deploy/local-mesh.sh's own mesh (prefix mn-) on the same subnet would
	// make the host's routes ambiguous.
	if exec.Command("ip", "link", "show", "mn-br0").Run() == nil {
		t.Skip("a local mesh of deploy/local-mesh.sh (bridge mn-br0) is up on 10.77.0.0/24; run it down first")
	}

	state := t.TempDir()
	env := append(nodeEnv(), "LOCAL_MESH_PREFIX="+netnsPrefix, "LOCAL_MESH_NET="+netnsNet,
		"LOCAL_MESH_DIR="+state, fmt.Sprintf("LOCAL_MESH_PORT=%d", netnsPort))
	run := func(timeout time.Duration, args ...string) (string, error) {
		ctx, cancel := context.WithTimeout(context.Background(), timeout)
		defer cancel()
		cmd := exec.CommandContext(ctx, "bash", append([]string{script}, args...)...)
		cmd.Env = env
		out, err := cmd.CombinedOutput()
		return string(out), err
	}
	// Leftovers of a run that crashed before its cleanup.
	if out, err := run(time.Minute, "down"); err != nil {
		t.Fatalf("local-mesh.sh down: %v\n%s", err, out)
	}
	var upOut string
	t.Cleanup(func() {
		if t.Failed() {
			t.Logf("---- local-mesh.sh up ----\n%s", redact(upOut))
			for i := 1; i <= 3; i++ {
				if b, err := os.ReadFile(filepath.Join(state, fmt.Sprintf("node%d.log", i))); err == nil {
					t.Logf("---- node%d ----\n%s---- end of node%d ----", i, redact(ansiRE.ReplaceAllString(string(b), "")), i)
				}
			}
		}
		if out, err := run(time.Minute, "down"); err != nil {
			t.Errorf("local-mesh.sh down: %v\n%s", err, out)
		}
		if out, _ := exec.Command("ip", "netns", "list").Output(); strings.Contains(string(out), netnsPrefix) {
			t.Errorf("namespaces left behind: %s", out)
		}
	})

	// Where the kernel has no netem, --delay goes through the script's
	// userspace delay relay (nft and python3); without those either, the
	// links get a tbf rate limit instead.
	shape, qdisc, relayed := []string{"--delay", "1ms"}, "netem", false
	if why := probeNetem(); why != nil {
		_, nftErr := exec.LookPath("nft")
		_, pyErr := exec.LookPath("python3")
		if nftErr == nil && pyErr == nil {
			t.Logf("no netem here (%v): --delay goes through the delay relay", why)
			qdisc, relayed = "", true
		} else {
			t.Logf("no netem here (%v), and no nft or python3 for the delay relay: shaping the links with tbf instead", why)
			shape, qdisc = []string{"--rate", "200mbit"}, "tbf"
		}
	}
	args := append([]string{"up", "3", "--model", stories.path, "--bin", binPath, "--threads", "1",
		"--ctx", fmt.Sprint(ctxLen), "--wire-dtype", "f16"}, shape...)
	upOut, err = run(3*time.Minute, args...)
	if err != nil {
		t.Fatalf("local-mesh.sh up: %v", err)
	}
	keyBytes, err := os.ReadFile(filepath.Join(state, "api-key"))
	if err != nil {
		t.Fatal(err)
	}
	apiKey := strings.TrimSpace(string(keyBytes))

	var nodes []*meshNode
	for i := 1; i <= 3; i++ {
		n := &meshNode{name: fmt.Sprintf("node%d", i), url: fmt.Sprintf("http://%s.%d:%d", netnsNet, 10+i, netnsPort), apiKey: apiKey}
		st, err := n.status(context.Background())
		if err != nil {
			t.Fatalf("%s: %v", n.name, err)
		}
		n.peer = st.Self
		nodes = append(nodes, n)
	}
	sts := waitSettled(t, stories, nodes, formTimeout)

	// The mesh runs over the namespaces' links: every member's address is
	// on the subnet (the nodes cannot reach each other's loopback).
	for _, nd := range sts[0].Nodes {
		for _, a := range nd.Addrs {
			if !strings.HasPrefix(a, "/ip4/"+netnsNet+".") {
				t.Errorf("member %s advertises %s", short(nd.PeerID), a)
			}
		}
	}
	for i := 1; i <= 3 && qdisc != ""; i++ {
		out, _ := exec.Command("tc", "qdisc", "show", "dev", fmt.Sprintf("%sv%d", netnsPrefix, i)).Output()
		if !strings.Contains(string(out), qdisc) {
			t.Errorf("link %d is not shaped: %s", i, out)
		}
	}

	// Beyond loopback the API wants its key.
	entry := nodes[1]
	anon := *entry
	anon.apiKey = ""
	if resp, err := anon.request(context.Background(), http.MethodGet, "/v1/models", nil); err != nil {
		t.Error(err)
	} else {
		resp.Body.Close()
		if resp.StatusCode != http.StatusUnauthorized {
			t.Errorf("/v1/models without the key: %s", resp.Status)
		}
	}
	// A joiner as the entry: the request crosses every namespace.
	checkGreedy(t, entry, stories)

	if relayed {
		// The nodes' libp2p connections to each other went through the
		// relay: the joiners' to node1, and the one between node2 and
		// node3 that the request's route needs, whichever dialed.
		b, err := os.ReadFile(filepath.Join(state, "relay.log"))
		if err != nil {
			t.Fatal(err)
		}
		to := func(i int) bool { return strings.Contains(string(b), fmt.Sprintf("-> %s.%d:4001", netnsNet, 10+i)) }
		if !to(1) || !to(2) && !to(3) {
			t.Errorf("the nodes' connections did not go through the delay relay:\n%s", b)
		}
	}
}

// probeNetem says why netem cannot shape a link here, or nil.
func probeNetem() error {
	a, b := netnsPrefix+"probe0", netnsPrefix+"probe1"
	exec.Command("ip", "link", "del", a).Run() // a leftover
	if out, err := exec.Command("ip", "link", "add", a, "type", "veth", "peer", "name", b).CombinedOutput(); err != nil {
		return fmt.Errorf("veth: %v: %s", err, out)
	}
	defer exec.Command("ip", "link", "del", a).Run()
	if out, err := exec.Command("tc", "qdisc", "add", "dev", a, "root", "netem", "delay", "1ms").CombinedOutput(); err != nil {
		return errors.New(strings.TrimSpace(string(out)))
	}
	return nil
}
