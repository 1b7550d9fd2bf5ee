package main

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"os/exec"
	"os/signal"
	"path/filepath"
	"regexp"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/meshnode/meshnode/node"
	"github.com/meshnode/meshnode/node/admin"
	"github.com/meshnode/meshnode/node/childproc"
)

// childEnv makes the test binary run meshnode itself, with the arguments
// it holds (JSON), so that a test can kill a node the hard way.
const childEnv = "MESHNODE_TEST_CHILD_ARGS"

func TestMain(m *testing.M) {
	if a := os.Getenv(childEnv); a != "" {
		var args []string
		if err := json.Unmarshal([]byte(a), &args); err != nil {
			fmt.Fprintln(os.Stderr, err)
			os.Exit(2)
		}
		ctx, stop := signal.NotifyContext(context.Background(), os.Interrupt, syscall.SIGTERM)
		code := run(ctx, args)
		stop()
		os.Exit(code)
	}
	os.Exit(m.Run())
}

const testModel = "../../../shared/models/stories260K.gguf" // 5 layers

func needModel(t *testing.T) string {
	t.Helper()
	p, err := filepath.Abs(testModel)
	if err != nil {
		t.Fatal(err)
	}
	if _, err := os.Stat(p); err != nil {
		t.Skipf("the test model is not here: %v", err)
	}
	return p
}

// testNode is a node of a test mesh: in this process, or a child process.
type testNode struct {
	cancel context.CancelFunc
	done   chan error
	cmd    *exec.Cmd
	child  *childproc.Child // cmd's, for a child process
	args   []string
	log    *bytes.Buffer
}

// kill ends a child node with SIGKILL: no goodbye to the mesh.
func (n *testNode) kill() {
	if n.cmd == nil || n.cmd.Process == nil {
		return
	}
	n.cmd.Process.Kill()
	n.child.Wait()
	n.cmd = nil
}

func nodeConfig(t *testing.T) node.Config {
	return node.Config{
		HTTPAddr: "127.0.0.1:0", Threads: 1, Context: 256, Parallel: 2, DataDir: t.TempDir(),
		Listen: []string{"/ip4/127.0.0.1/tcp/0"}, GossipPort: -1, DrainTimeout: -1,
	}
}

// startInProcess runs node.Run in this process.
func startInProcess(t *testing.T, cfg node.Config) *testNode {
	ctx, cancel := context.WithCancel(context.Background())
	n := &testNode{cancel: cancel, done: make(chan error, 1)}
	go func() { n.done <- node.Run(ctx, cfg) }()
	t.Cleanup(func() {
		cancel()
		select {
		case <-n.done:
		case <-time.After(20 * time.Second):
		}
	})
	return n
}

// startChild runs `meshnode ARGS` as a child process of the test binary.
func startChild(t *testing.T, args []string) *testNode {
	t.Helper()
	enc, _ := json.Marshal(args)
	cmd := exec.Command(os.Args[0], "-test.run=^$")
	cmd.Env = append(os.Environ(), childEnv+"="+string(enc))
	var log bytes.Buffer
	cmd.Stdout, cmd.Stderr = &log, &log
	// childproc: the node dies with the test binary, so that a crashed or
	// timed-out run leaves no node behind.
	child, err := childproc.Start(cmd)
	if err != nil {
		t.Fatal(err)
	}
	n := &testNode{cmd: cmd, child: child, args: args, log: &log}
	t.Cleanup(n.kill)
	return n
}

func freePort(t *testing.T, network string) int {
	t.Helper()
	switch network {
	case "udp":
		c, err := net.ListenPacket("udp", "127.0.0.1:0")
		if err != nil {
			t.Fatal(err)
		}
		defer c.Close()
		return c.LocalAddr().(*net.UDPAddr).Port
	}
	l, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	defer l.Close()
	return l.Addr().(*net.TCPAddr).Port
}

// gossipPort finds a port free for both TCP and UDP.
func gossipPort(t *testing.T) int {
	for range 20 {
		p := freePort(t, "tcp")
		if c, err := net.ListenPacket("udp", fmt.Sprintf("127.0.0.1:%d", p)); err == nil {
			c.Close()
			return p
		}
	}
	t.Fatal("no port free for TCP and UDP")
	return 0
}

// statusRun runs `meshnode status ARGS` as the command does and returns its
// output and exit code.
func statusRun(ctx context.Context, args ...string) (string, int, string) {
	var out bytes.Buffer
	err := statusCommand(ctx, &out, args)
	var ee *exitError
	switch {
	case err == nil:
		return out.String(), 0, ""
	case errors.As(err, &ee):
		return out.String(), ee.code, ee.msg
	}
	return out.String(), -1, err.Error()
}

func statusJSON(t *testing.T, ctx context.Context, args ...string) (admin.Status, int) {
	t.Helper()
	out, code, msg := statusRun(ctx, append(args, "--json")...)
	var st admin.Status
	if code == exitUnreachable || code < 0 {
		t.Fatalf("meshnode status --json: exit %d: %s", code, msg)
	}
	if err := json.Unmarshal([]byte(out), &st); err != nil {
		t.Fatalf("meshnode status --json printed no status (%v): %q", err, out)
	}
	return st, code
}

// waitStatus polls until ok says the status is what the test waits for.
func waitStatus(t *testing.T, ctx context.Context, what string, timeout time.Duration, args []string, ok func(admin.Status, int) bool) admin.Status {
	t.Helper()
	deadline := time.Now().Add(timeout)
	var st admin.Status
	var code int
	for {
		st, code = statusJSON(t, ctx, args...)
		if ok(st, code) {
			return st
		}
		if time.Now().After(deadline) {
			b, _ := json.MarshalIndent(st, "", "  ")
			t.Fatalf("waited %s for %s; last status (exit %d):\n%s", timeout, what, code, b)
		}
		time.Sleep(250 * time.Millisecond)
	}
}

func nodeOf(st admin.Status, peer string) *admin.Node {
	n, _ := st.NodeByID(peer)
	return n
}

// TestStatusMesh starts a real 3-node mesh (two nodes in this process, one a
// child process), each node pinned to a layer range so that the model needs
// all three, and checks `meshnode status` (table and --json) against it:
// while it serves, after the child is killed (dead, exit code 1), and after
// it comes back (serving again, exit code 0).
func TestStatusMesh(t *testing.T) {
	model := needModel(t)
	ctx := t.Context()
	const key = "status-test-key"

	joinCmd := make(chan string, 1)
	ready := make(chan string, 1)
	a := nodeConfig(t)
	a.Model, a.Layers, a.APIKey, a.Version = model, "0:2", key, "test"
	a.JoinCommand = func(cmd string) { joinCmd <- cmd }
	a.Ready = func(addr string) { ready <- addr }
	startInProcess(t, a)
	var join []string
	select {
	case cmd := <-joinCmd:
		join = strings.Fields(cmd) // meshnode join ADDR --mesh-key KEY
	case <-time.After(60 * time.Second):
		t.Fatal("no join command from the first node")
	}
	b := nodeConfig(t)
	b.Join, b.MeshKey, b.Layers = []string{join[2]}, join[4], "2:4"
	startInProcess(t, b)

	// The third node is a process of its own, so that it can be killed; its
	// ports stay the same when it comes back.
	cArgs := []string{"join", join[2], "--mesh-key", join[4], "--layers", "4:5",
		"--data-dir", t.TempDir(), "--http", "127.0.0.1:0", "--threads", "1",
		"--listen", fmt.Sprintf("/ip4/127.0.0.1/tcp/%d", freePort(t, "tcp")),
		"--gossip-port", fmt.Sprint(gossipPort(t)), "--drain-timeout", "-1s", "--log-level", "warn"}
	c := startChild(t, cArgs)

	var addr string
	select {
	case addr = <-ready:
	case <-time.After(90 * time.Second):
		t.Fatalf("the mesh never served; third node's output:\n%s", c.log)
	}
	args := []string{"--node", addr, "--api-key", key}

	// No key: a clear refusal.
	if _, code, msg := statusRun(ctx, "--node", addr); code != exitUnreachable || !strings.Contains(msg, "API key") {
		t.Errorf("without the key: exit %d, %q", code, msg)
	}
	// No node: a clear message.
	if _, code, msg := statusRun(ctx, "--node", fmt.Sprintf("127.0.0.1:%d", freePort(t, "tcp"))); code != exitUnreachable || !strings.Contains(msg, "no meshnode answers") {
		t.Errorf("without a node: exit %d, %q", code, msg)
	}

	// Serving: three stages, every node ready, the hops measured.
	st := waitStatus(t, ctx, "three ready nodes and measured hops", 60*time.Second, args, func(st admin.Status, code int) bool {
		if code != 0 || len(st.Plan) != 3 || len(st.Nodes) != 3 || len(st.Hops) != 4 {
			return false
		}
		for _, n := range st.Nodes {
			if n.State != admin.StateReady || n.Stats == nil {
				return false
			}
		}
		for _, h := range st.Hops {
			if h.RTTMs == nil {
				return false
			}
		}
		return true
	})
	checkServing(t, st, a.Layers, b.Layers, "4:5")
	// The nodes share this machine's cores: --pipelining auto keeps one
	// batch in flight.
	if st.Lanes != 1 {
		t.Errorf("lanes %d, want 1 for stages on one machine", st.Lanes)
	}
	pa, pb, pc := st.Plan[0].Node, st.Plan[1].Node, st.Plan[2].Node
	if st.Self != pa || !nodeOf(st, pa).Self || st.Version != "test" {
		t.Errorf("self %s (version %q), plan starts at %s", st.Self, st.Version, pa)
	}

	// Requests through the first node move every node's numbers, as each
	// reports them to the one asked.
	for range 3 {
		resp, err := postCompletion(ctx, addr, key)
		if err != nil {
			t.Fatal(err)
		}
		if resp != http.StatusOK {
			t.Fatalf("completion: %d", resp)
		}
	}
	st = waitStatus(t, ctx, "stage counters from every node", 20*time.Second, args, func(st admin.Status, code int) bool {
		for _, p := range []string{pa, pb, pc} {
			n := nodeOf(st, p)
			if n == nil || n.Stats == nil || n.Stats.Stage == nil || n.Stats.Stage.Forwards == 0 {
				return false
			}
		}
		return nodeOf(st, pa).Stats.GeneratedTokens > 0 && st.Hops[1].Bytes != nil && *st.Hops[1].Bytes > 0
	})

	// The table says the same.
	out, code, _ := statusRun(ctx, args...)
	if code != 0 {
		t.Fatalf("status exit %d:\n%s", code, out)
	}
	t.Logf("meshnode status:\n%s", out)
	chain := fmt.Sprintf("…%s [0,2) → …%s [2,4) → …%s [4,5)", admin.ShortID(pa), admin.ShortID(pb), admin.ShortID(pc))
	for _, want := range []string{"serving", "stories260K", chain, "3 nodes (3 ready)", "hops", "NEXT HOP", "(local socket)"} {
		if !strings.Contains(out, want) {
			t.Errorf("the table lacks %q", want)
		}
	}
	for _, p := range []string{pa, pb, pc} {
		row := tableRow(out, admin.ShortID(p))
		if row == "" || !strings.Contains(row, "ready") || !strings.Contains(row, "ggml/cpu") || !strings.Contains(row, "/ip4/127.0.0.1/tcp/") {
			t.Errorf("row of …%s: %q", admin.ShortID(p), row)
		}
	}
	if row := tableRow(out, admin.ShortID(pa)); !strings.Contains(row, "[0,2)") || !strings.Contains(row, "→…"+admin.ShortID(pb)) {
		t.Errorf("the first node's row lacks its layers or next hop: %q", row)
	}

	// --format and MESHNODE_API_KEY.
	t.Setenv("MESHNODE_API_KEY", key)
	if out, code, msg := statusRun(ctx, "--node", addr, "--format", "{{.Self}}"); code != 0 || strings.TrimSpace(out) != pa {
		t.Errorf("--format {{.Self}}: exit %d %q %s", code, out, msg)
	}

	// --watch redraws in place: cursor home, each line cleared, the rest
	// of the screen cleared.
	wctx, wcancel := context.WithTimeout(ctx, 1500*time.Millisecond)
	wout, wcode, _ := statusRun(wctx, "--node", addr, "--watch", "--interval", "500ms")
	wcancel()
	if frames := strings.Count(wout, "\x1b[H"); frames < 2 || !strings.Contains(wout, "\x1b[K\n") || !strings.Contains(wout, "\x1b[J") || wcode != 0 {
		t.Errorf("--watch: %d frames, exit %d: %q", frames, wcode, wout)
	}
	t.Setenv("MESHNODE_API_KEY", "")

	// Kill the third node: it is shown dead, and the model cannot be
	// served without its layers.
	c.kill()
	st = waitStatus(t, ctx, "the killed node shown dead", 30*time.Second, args, func(st admin.Status, code int) bool {
		n := nodeOf(st, pc)
		return code == exitNotServing && n != nil && n.State == admin.StateDead
	})
	if st.Ready || st.CanServe() || st.Problem == "" || len(st.Plan) != 0 {
		t.Errorf("after the kill: ready %v, plan %v, problem %q", st.Ready, st.Plan, st.Problem)
	}
	out, code, _ = statusRun(ctx, args...)
	t.Logf("meshnode status after the kill (exit %d):\n%s", code, out)
	if code != exitNotServing || !strings.Contains(out, "NOT SERVING") || !strings.Contains(tableRow(out, admin.ShortID(pc)), "dead") {
		t.Errorf("after the kill: exit %d\n%s", code, out)
	}

	// It comes back (same data dir, so the same peer ID; same ports).
	startChild(t, cArgs)
	st = waitStatus(t, ctx, "the mesh serving again", 60*time.Second, args, func(st admin.Status, code int) bool {
		n := nodeOf(st, pc)
		return code == 0 && n != nil && n.State == admin.StateReady && len(st.Nodes) == 3
	})
	checkServing(t, st, a.Layers, b.Layers, "4:5")
	out, code, _ = statusRun(ctx, args...)
	t.Logf("meshnode status after the rejoin:\n%s", out)
	if code != 0 || !strings.Contains(out, chain) || strings.Contains(out, "dead") {
		t.Errorf("after the rejoin: exit %d\n%s", code, out)
	}
	if resp, err := postCompletion(ctx, addr, key); err != nil || resp != http.StatusOK {
		t.Errorf("completion after the rejoin: %d %v", resp, err)
	}
}

// checkServing checks a serving 3-stage status against the pins.
func checkServing(t *testing.T, st admin.Status, pins ...string) {
	t.Helper()
	if st.Schema != admin.SchemaVersion || !st.Ready || !st.CanServe() || st.Problem != "" {
		t.Errorf("not serving: ready %v problem %q", st.Ready, st.Problem)
	}
	if st.Model == nil || st.Model.Name != "stories260K" || st.Model.Layers != 5 {
		t.Errorf("model %+v", st.Model)
	}
	for i, s := range st.Plan {
		if got := fmt.Sprintf("%d:%d", s.Start, s.End); got != pins[i] || !s.Up {
			t.Errorf("stage %d: %s up %v, want %s", i, got, s.Up, pins[i])
		}
		n := nodeOf(st, s.Node)
		if n == nil || len(n.Serving) != 1 || n.Serving[0].Start != s.Start || n.Engine != "ggml" || n.MemOffered == 0 {
			t.Errorf("stage %d's node: %+v", i, n)
		}
	}
	if len(st.Hops) == 4 {
		if st.Hops[0].From != st.Self || st.Hops[3].To != st.Self {
			t.Errorf("hops do not start and end at the node asked: %+v", st.Hops)
		}
		for i := 1; i < 3; i++ {
			if st.Hops[i].From != st.Plan[i-1].Node || st.Hops[i].To != st.Plan[i].Node {
				t.Errorf("hop %d: %s→%s", i, st.Hops[i].From, st.Hops[i].To)
			}
		}
		// Nodes of one machine: every hop between two of them over a
		// local socket, the one into the node's own stage in memory.
		for i, h := range st.Hops {
			want := admin.ViaLocal
			if h.From == h.To {
				want = admin.ViaNode
			}
			if h.Via != want {
				t.Errorf("hop %d (%s→%s) via %q, want %q", i, admin.ShortID(h.From), admin.ShortID(h.To), h.Via, want)
			}
		}
	}
}

func tableRow(out, short string) string {
	for _, line := range strings.Split(out, "\n") {
		if strings.HasPrefix(line, "…"+short) {
			return line
		}
	}
	return ""
}

func postCompletion(ctx context.Context, addr, key string) (int, error) {
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, "http://"+addr+"/v1/completions",
		strings.NewReader(`{"model":"stories260K","prompt":"Once upon a time","max_tokens":24,"temperature":0}`))
	if err != nil {
		return 0, err
	}
	if key != "" {
		req.Header.Set("Authorization", "Bearer "+key)
	}
	resp, err := http.DefaultClient.Do(req)
	if err != nil {
		return 0, err
	}
	resp.Body.Close()
	return resp.StatusCode, nil
}

// TestDashboard loads the dashboard of a running 2-node mesh in headless
// chromium (Debian's package: apt-get install chromium) while requests run,
// checks that it shows both nodes and the pipeline and that it updates, and
// saves a screenshot ($TMPDIR/meshnode-dashboard.png).
func TestDashboard(t *testing.T) {
	browser := ""
	for _, b := range []string{"chromium", "chromium-browser", "google-chrome"} {
		if p, err := exec.LookPath(b); err == nil {
			browser = p
			break
		}
	}
	if browser == "" {
		t.Skip("no headless browser: apt-get install -y chromium")
	}
	model := needModel(t)
	ctx := t.Context()
	joinCmd := make(chan string, 1)
	ready := make(chan string, 2)
	a := nodeConfig(t)
	a.Model, a.Split = model, true
	a.JoinCommand = func(cmd string) { joinCmd <- cmd }
	startInProcess(t, a)
	var join []string
	select {
	case cmd := <-joinCmd:
		join = strings.Fields(cmd)
	case <-time.After(60 * time.Second):
		t.Fatal("no join command")
	}
	b := nodeConfig(t)
	b.Join, b.MeshKey = []string{join[2]}, join[4]
	b.Ready = func(addr string) { ready <- addr }
	startInProcess(t, b)
	var addr string
	select {
	case addr = <-ready:
	case <-time.After(90 * time.Second):
		t.Fatal("the joiner never served")
	}
	st := waitStatus(t, ctx, "a 2-stage pipeline", 60*time.Second, []string{"--node", addr}, func(st admin.Status, code int) bool {
		return code == 0 && len(st.Plan) == 2 && len(st.Nodes) == 2
	})

	// Keep the mesh busy while the page watches it.
	lctx, stopLoad := context.WithCancel(ctx)
	var wg sync.WaitGroup
	for range 2 {
		wg.Go(func() {
			for lctx.Err() == nil {
				postCompletion(lctx, addr, "")
			}
		})
	}
	defer func() { stopLoad(); wg.Wait() }()
	time.Sleep(2 * time.Second)

	dir := t.TempDir()
	chrome := func(extra ...string) ([]byte, error) {
		args := append([]string{"--headless", "--no-sandbox", "--disable-gpu", "--disable-dev-shm-usage",
			"--no-first-run", "--hide-scrollbars", "--user-data-dir=" + filepath.Join(dir, "profile"),
			"--window-size=1400,1000"}, extra...)
		cctx, cancel := context.WithTimeout(ctx, 90*time.Second)
		defer cancel()
		var stdout, stderr bytes.Buffer
		cmd := exec.CommandContext(cctx, browser, append(args, "http://"+addr+"/")...)
		cmd.Stdout, cmd.Stderr = &stdout, &stderr
		err := cmd.Run()
		if err != nil {
			return nil, fmt.Errorf("%s: %v\n%s", browser, err, stderr.String())
		}
		return stdout.Bytes(), nil
	}
	dom, err := chrome("--virtual-time-budget=6000", "--dump-dom")
	if err != nil {
		t.Fatal(err)
	}
	page := string(dom)
	updates := 0
	if m := regexp.MustCompile(`data-updates="(\d+)"`).FindStringSubmatch(page); m != nil {
		fmt.Sscan(m[1], &updates)
	}
	if updates < 3 {
		t.Errorf("the page polled the status %d times in 6 s, want at least 3", updates)
	}
	for _, n := range st.Nodes {
		if !strings.Contains(page, `data-peer="`+n.PeerID+`"`) || !strings.Contains(page, "…"+n.ShortID) {
			t.Errorf("the page does not show node …%s", n.ShortID)
		}
	}
	if got := strings.Count(page, `class="stage"`); got != 2 {
		t.Errorf("the pipeline shows %d stages, want 2", got)
	}
	if !strings.Contains(page, ">serving<") {
		t.Error("the page does not say the mesh is serving")
	}
	// The throughput legend reads the last sample: the mesh was busy.
	if m := regexp.MustCompile(`generated \(all entry nodes\): ([0-9.]+)`).FindStringSubmatch(page); m == nil || m[1] == "0.0" {
		t.Errorf("no throughput on the page: %v", m)
	}

	// A fixed place, for review: $TMPDIR/meshnode-dashboard.png, or
	// $MESHNODE_SCREENSHOT.
	shot := os.Getenv("MESHNODE_SCREENSHOT")
	if shot == "" {
		shot = filepath.Join(os.TempDir(), "meshnode-dashboard.png")
	}
	os.Remove(shot)
	if _, err := chrome("--virtual-time-budget=8000", "--screenshot="+shot); err != nil {
		t.Fatal(err)
	}
	if fi, err := os.Stat(shot); err != nil || fi.Size() < 10000 {
		t.Fatalf("no screenshot at %s: %v", shot, err)
	}
	t.Logf("dashboard screenshot: %s", shot)
}

// TestRenderPipelined: the pipeline line says when the node pipelines.
func TestRenderPipelined(t *testing.T) {
	for _, tt := range []struct {
		lanes int
		want  string
	}{
		{1, ""},
		{2, " · pipelined: 2 micro-batches in flight"},
	} {
		st := &admin.Status{Schema: admin.SchemaVersion, Self: "peerA", Ready: true, Lanes: tt.lanes,
			Plan: []admin.Stage{{Node: "peerA", Start: 0, End: 3, Up: true}, {Node: "peerB", Start: 3, End: 5, Up: true}},
			Nodes: []admin.Node{{PeerID: "peerA", ShortID: "peerA", Name: "a", Self: true, State: admin.StateReady},
				{PeerID: "peerB", ShortID: "peerB", Name: "b", State: admin.StateReady}}}
		var b strings.Builder
		renderStatus(&b, "http://127.0.0.1:8080", st, false)
		var line string
		for _, l := range strings.Split(b.String(), "\n") {
			if strings.HasPrefix(strings.TrimSpace(l), "pipeline ") {
				line = l
			}
		}
		if line == "" || !strings.HasSuffix(line, "[3,5)"+tt.want) {
			t.Errorf("lanes %d: pipeline line %q, want it to end %q", tt.lanes, line, "[3,5)"+tt.want)
		}
	}
}

// TestRenderDecodePath: a GPU node decoding through the fused kernels says
// so in its engine cell; one that could not says why under the table.
func TestRenderDecodePath(t *testing.T) {
	stats := func(path, why string) *admin.NodeStats {
		return &admin.NodeStats{Stage: &admin.StageStats{Start: 0, End: 3, DecodePath: path, DecodeWhy: why}}
	}
	st := &admin.Status{Schema: admin.SchemaVersion, Self: "peerA", Ready: true,
		Plan: []admin.Stage{{Node: "peerA", Start: 0, End: 3, Up: true}, {Node: "peerB", Start: 3, End: 5, Up: true}},
		Nodes: []admin.Node{
			{PeerID: "peerA", ShortID: "peerA", Name: "a", Self: true, State: admin.StateReady, Engine: "ggml", Backend: "CUDA", Stats: stats("fused", "")},
			{PeerID: "peerB", ShortID: "peerB", Name: "b", State: admin.StateReady, Engine: "ggml", Backend: "CUDA",
				Stats: stats("ggml", "a tied output head")},
			{PeerID: "peerC", ShortID: "peerC", Name: "c", State: admin.StateReady, Engine: "ggml", Backend: "CPU", Stats: stats("", "")},
		}}
	var b strings.Builder
	renderStatus(&b, "http://127.0.0.1:8080", st, false)
	out := b.String()
	row := func(peer string) string {
		for _, l := range strings.Split(out, "\n") {
			if f := strings.Fields(l); len(f) > 1 && strings.Contains(f[0], peer) {
				return l
			}
		}
		return ""
	}
	if r := row("peerA"); !strings.Contains(r, "ggml/CUDA fused") {
		t.Errorf("node a's row %q does not say it decodes fused:\n%s", r, out)
	}
	if r := row("peerB"); strings.Contains(r, "fused") || !strings.Contains(r, "ggml/CUDA") {
		t.Errorf("node b's row %q", r)
	}
	if !strings.Contains(out, "b decodes on ggml, not meshnode's fused kernels: a tied output head") {
		t.Errorf("no note on why b does not decode fused:\n%s", out)
	}
	if strings.Count(out, "decodes on ggml") != 1 {
		t.Errorf("notes for nodes with nothing to say:\n%s", out)
	}
}
