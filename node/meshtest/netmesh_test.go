package meshtest

// A mesh of node processes in network namespaces, built by the test itself
// (deploy/local-mesh.sh's layout), so that a test can signal each node,
// take its link down and delay the traffic between two of them.

import (
	"bytes"
	"context"
	"fmt"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strings"
	"syscall"
	"testing"
	"time"

	"github.com/libp2p/go-libp2p/core/peer"

	"github.com/meshnode/meshnode/node/host"
	"github.com/meshnode/meshnode/node/internal/netdelay"
)

// The chaos tests' network: a prefix and a subnet of their own, apart from
// TestNetns's (mnt-, 10.77.0) and deploy/local-mesh.sh's (mn-, 10.77.0).
const (
	chaosPrefix  = "mnc-"
	chaosNet     = "10.79.0"
	chaosP2PPort = 4001
	chaosAPIPort = 9337
	// Delay relays listen on the bridge's address, one port per ordered
	// pair of nodes: relayBase + 10*from + to (netdelay.Config.BasePort).
	relayBase = 41000
)

// needNetns skips a test that cannot build namespaces here, saying why.
func needNetns(t *testing.T, tools ...string) {
	t.Helper()
	if runtime.GOOS != "linux" {
		t.Skip("network namespaces are Linux only")
	}
	if os.Geteuid() != 0 {
		t.Skip("needs root to create network namespaces")
	}
	for _, tool := range append([]string{"ip"}, tools...) {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("needs %s: %v", tool, err)
		}
	}
}

// sh runs a command and returns an error that carries its output.
func sh(name string, args ...string) error {
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	out, err := exec.CommandContext(ctx, name, args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, bytes.TrimSpace(out))
	}
	return nil
}

// nsNet is a bridge in the root namespace (address <net>.1) and one
// namespace per node, linked to it by a veth pair: <prefix>vI on the
// bridge, eth0 with <net>.(10+I) inside.
type nsNet struct {
	prefix, net string
	n           int
}

func (nw *nsNet) bridge() string      { return nw.prefix + "br0" }
func (nw *nsNet) ns(i int) string     { return fmt.Sprintf("%snode%d", nw.prefix, i) }
func (nw *nsNet) link(i int) string   { return fmt.Sprintf("%sv%d", nw.prefix, i) } // the bridge's end
func (nw *nsNet) addr(i int) string   { return fmt.Sprintf("%s.%d", nw.net, 10+i) }
func (nw *nsNet) gateway() string     { return nw.net + ".1" }
func (nw *nsNet) api(i int) string    { return fmt.Sprintf("http://%s:%d", nw.addr(i), chaosAPIPort) }
func (nw *nsNet) listen(i int) string { return fmt.Sprintf("/ip4/%s/tcp/%d", nw.addr(i), chaosP2PPort) }

// newNSNet builds the network of n namespaces; it is taken down when the
// test ends (after the nodes, which are registered later and so killed
// first), and leftovers of a crashed run are taken down first.
func newNSNet(t *testing.T, prefix, subnet string, n int) *nsNet {
	t.Helper()
	nw := &nsNet{prefix: prefix, net: subnet, n: n}
	nw.down()
	t.Cleanup(func() {
		nw.down()
		if out, _ := exec.Command("ip", "netns", "list").Output(); strings.Contains(string(out), prefix+"node") {
			t.Errorf("namespaces left behind: %s", out)
		}
	})
	steps := [][]string{
		{"link", "add", nw.bridge(), "type", "bridge"},
		{"addr", "add", nw.gateway() + "/24", "dev", nw.bridge()},
		{"link", "set", nw.bridge(), "up"},
	}
	for i := 1; i <= n; i++ {
		ns, host, peer := nw.ns(i), nw.link(i), nw.link(i)+"n"
		steps = append(steps,
			[]string{"netns", "add", ns},
			[]string{"link", "add", host, "type", "veth", "peer", "name", peer},
			[]string{"link", "set", peer, "netns", ns},
			[]string{"link", "set", host, "master", nw.bridge(), "up"},
			[]string{"-n", ns, "link", "set", "lo", "up"},
			[]string{"-n", ns, "link", "set", peer, "name", "eth0"},
			[]string{"-n", ns, "addr", "add", nw.addr(i) + "/24", "dev", "eth0"},
			[]string{"-n", ns, "link", "set", "eth0", "up"},
		)
	}
	for _, s := range steps {
		if err := sh("ip", s...); err != nil {
			t.Fatalf("building the network: %v", err)
		}
	}
	return nw
}

// down deletes the namespaces, their links and the bridge; what is not
// there is skipped.
func (nw *nsNet) down() {
	out, _ := exec.Command("ip", "netns", "list").Output()
	for _, line := range strings.Split(string(out), "\n") {
		if f := strings.Fields(line); len(f) > 0 && strings.HasPrefix(f[0], nw.prefix+"node") {
			_ = sh("ip", "netns", "del", f[0])
		}
	}
	for i := 1; i <= max(nw.n, 8); i++ {
		if exec.Command("ip", "link", "show", nw.link(i)).Run() == nil {
			_ = sh("ip", "link", "del", nw.link(i))
		}
	}
	if exec.Command("ip", "link", "show", nw.bridge()).Run() == nil {
		_ = sh("ip", "link", "del", nw.bridge())
	}
}

// setLink takes node i's link (its end on the bridge) down or up: a
// partition that the node's own kernel does not see.
func (nw *nsNet) setLink(i int, up bool) error {
	state := "down"
	if up {
		state = "up"
	}
	return sh("ip", "link", "set", nw.link(i), state)
}

// ---- a mesh in the namespaces ----

// nsMesh is a mesh of node processes, node I in namespace I. Node 1 serves
// the model file (`serve --split`); the others join it and fetch their
// layers from it. Peer keys are made before the nodes start, so that node
// IDs ascend with the node numbers: the planner orders unpinned nodes by
// ID, so node 1 holds the first stage, node 2 the second, and so on.
type nsMesh struct {
	net    *nsNet
	model  *testModel
	nodes  []*meshNode // nodes[i-1] is node i
	apiKey string
	key    string // the mesh key
	join   string // node 1's address
	relays delayRelays
}

// chaosNodeArgs are the flags of every node: its namespace's address, one
// compute thread, f32 activations (bit-exact with the unsplit reference;
// f16 may turn a near tie of the greedy pick).
func chaosNodeArgs(nw *nsNet, i int, dataDir, keyFile string) []string {
	return []string{
		"--data-dir", dataDir, "--http", fmt.Sprintf("%s:%d", nw.addr(i), chaosAPIPort),
		"--listen", nw.listen(i), "--api-key-file", keyFile, "--threads", "1", "--wire-dtype", "f32",
	}
}

type nsMeshOptions struct {
	relays     bool // every node's libp2p traffic to the others through a delay relay
	pipelining bool // --pipelining=on: a micro-batch in flight on every stage
}

func startNSMesh(t *testing.T, model *testModel, n int, opts nsMeshOptions) *nsMesh {
	t.Helper()
	nw := newNSNet(t, chaosPrefix, chaosNet, n)
	m := &nsMesh{net: nw, model: model}
	if opts.relays {
		var err error
		if m.relays, err = startDelayRelays(t, nw); err != nil {
			t.Fatal(err)
		}
	}
	dir := t.TempDir()
	keyFile := filepath.Join(dir, "api-key")
	m.apiKey = "chaos-" + fmt.Sprint(time.Now().UnixNano())
	if err := os.WriteFile(keyFile, []byte(m.apiKey+"\n"), 0o600); err != nil {
		t.Fatal(err)
	}
	dirs := orderedDataDirs(t, dir, n)
	for i := 1; i <= n; i++ {
		nd := &meshNode{name: fmt.Sprintf("node%d", i), url: nw.api(i), apiKey: m.apiKey, dataDir: dirs[i-1]}
		m.nodes = append(m.nodes, nd)
	}
	var extra []string
	if opts.pipelining {
		// The namespaces share one machine, which auto would not pipeline.
		extra = []string{"--pipelining=on"}
	}
	serve := append([]string{"netns", "exec", nw.ns(1), binPath, "serve", "--split", "--model", model.path,
		"--ctx", fmt.Sprint(ctxLen)}, append(chaosNodeArgs(nw, 1, dirs[0], keyFile), extra...)...)
	m.nodes[0].proc = startProc(t, "node1", "ip", serve...)
	jm := m.nodes[0].proc.waitLine(t, joinRE, formTimeout)
	m.join, m.key = jm[1], jm[2]
	for i := 2; i <= n; i++ {
		args := append([]string{"netns", "exec", nw.ns(i), binPath, "join", m.join, "--mesh-key", m.key},
			append(chaosNodeArgs(nw, i, dirs[i-1], keyFile), extra...)...)
		m.nodes[i-1].proc = startProc(t, m.nodes[i-1].name, "ip", args...)
	}
	for _, nd := range m.nodes {
		nd.proc.waitLine(t, readyRE, formTimeout)
		st, err := nd.status(context.Background())
		if err != nil {
			t.Fatalf("%s: %v", nd.name, err)
		}
		nd.peer = st.Self
	}
	sts := waitSettled(t, model, m.nodes, formTimeout)
	for i, nd := range m.nodes {
		if s := sts[0].Plan[i]; s.Node != nd.peer {
			t.Fatalf("stage %d is on %s, want %s (peer IDs ascend with node numbers): plan %s", i, short(s.Node), nd.name, describePlan(sts[0].Plan))
		}
	}
	return m
}

// orderedDataDirs makes n data dirs with peer keys whose IDs ascend with
// the dir's number.
func orderedDataDirs(t *testing.T, dir string, n int) []string {
	t.Helper()
	type keyed struct {
		id  string
		dir string
	}
	var ks []keyed
	for i := range n {
		d := filepath.Join(dir, fmt.Sprintf("key%d", i))
		key, err := host.LoadOrCreateKey(d)
		if err != nil {
			t.Fatal(err)
		}
		id, err := peer.IDFromPrivateKey(key)
		if err != nil {
			t.Fatal(err)
		}
		ks = append(ks, keyed{id.String(), d})
	}
	slices.SortFunc(ks, func(a, b keyed) int { return strings.Compare(a.id, b.id) })
	var dirs []string
	for i, k := range ks {
		d := filepath.Join(dir, fmt.Sprintf("node%d", i+1))
		if err := os.Rename(k.dir, d); err != nil {
			t.Fatal(err)
		}
		dirs = append(dirs, d)
	}
	return dirs
}

// others are the mesh's nodes but the given ones.
func (m *nsMesh) others(skip ...*meshNode) []*meshNode {
	var out []*meshNode
	for _, nd := range m.nodes {
		if !slices.Contains(skip, nd) {
			out = append(out, nd)
		}
	}
	return out
}

// dumpStacks has every node still running print its goroutines and exit
// (SIGQUIT), so that the failure report shows where a stuck node waits.
func (m *nsMesh) dumpStacks(t *testing.T) {
	t.Helper()
	for _, nd := range m.nodes {
		select {
		case <-nd.proc.done:
			continue
		default:
		}
		_ = nd.proc.cmd.Process.Signal(syscall.SIGCONT) // a frozen node must run to dump
		_ = nd.proc.cmd.Process.Signal(syscall.SIGQUIT)
		if !nd.proc.exited(10 * time.Second) {
			t.Logf("%s did not exit on SIGQUIT", nd.name)
		}
	}
}

// ---- delay relays ----

// startDelayRelays puts a delay relay (netdelay.Start) on every ordered
// pair of the network's nodes, with no delay until set; it is closed when
// the test ends. The rules are in place before the nodes start, so that
// every libp2p connection between two nodes, whichever dialed, crosses a
// relay; the kernel's netem is not needed.
func startDelayRelays(t *testing.T, nw *nsNet) (delayRelays, error) {
	cfg := netdelay.Config{Gateway: nw.gateway(), Port: chaosP2PPort, BasePort: relayBase}
	for i := 1; i <= nw.n; i++ {
		cfg.Namespaces = append(cfg.Namespaces, nw.ns(i))
		cfg.Addrs = append(cfg.Addrs, nw.addr(i))
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	r, err := netdelay.Start(ctx, cfg)
	if err != nil {
		return delayRelays{}, fmt.Errorf("delay relays: %w", err)
	}
	t.Cleanup(r.Close)
	return delayRelays{r}, nil
}

// delayRelays are a mesh's relays, as the chaos tests set them.
type delayRelays struct{ *netdelay.Mesh }

// set makes the hop between nodes i and j (both ways) d slower.
func (r delayRelays) set(i, j int, d time.Duration) { r.Set(i, j, d) }
