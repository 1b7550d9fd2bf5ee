package meshtest

import (
	"context"
	"fmt"
	"io"
	"net/http"
	"regexp"
	"strings"
	"syscall"
	"testing"
	"text/tabwriter"
	"time"
)

// The chaos load: a few clients streaming greedy stories through node 1,
// one request after another, each compared with the unsplit reference.
var chaosPrompts = []string{"Once upon a time", "One day, a little girl", "Tom and his dog", "The sun was"}

const (
	chaosClients   = 3
	chaosMaxTokens = 48
	// recoverGoal bounds the longest silence of the token streams after a
	// fault (the time to the first token after it).
	recoverGoal = 10 * time.Second
)

// chaosFault is one fault of TestChaos: it breaks the mesh m (node 1 is
// the entry and holds the model file; node 2 holds the middle stage), waits
// for what must follow, and undoes what can be undone.
type chaosFault struct {
	name       string
	relays     bool // the mesh's hops go through delay relays
	pipelining bool // every stage holds a micro-batch: a fault finds several in flight
	// inject breaks the mesh; t0 is when.
	inject func(t *testing.T, m *nsMesh) (t0 time.Time)
	// after waits for the mesh to take the fault in, then undoes it where
	// it can, and waits for the mesh to heal; l is the load in flight.
	after func(t *testing.T, m *nsMesh, l *load, t0 time.Time) string
}

type chaosRow struct {
	name               string
	started, completed int
	failed, lost, dup  int
	inflight           int           // requests in flight once the fault was in place
	stall              time.Duration // longest silence after the fault
	note               string
}

// TestChaos: a 3-node mesh of stories260K, every node in a network
// namespace of its own, under a stream of concurrent greedy streaming
// requests through node 1, while the test (a) kills the middle stage with
// SIGKILL (also with --pipelining on, so that the fault finds a batch on
// every stage), (b) freezes it with SIGSTOP (then SIGCONT), (c) cuts its link
// (ip link set down, then up), (d) delays the hop between the first two
// stages by 50 ms each way (a userspace relay: this kernel may have no
// netem). Each fault gets a fresh mesh. Every request must complete with
// exactly the reference text (no token lost or repeated, none failed),
// and the token streams must resume within 10 s of the fault. The table
// of what each fault did is printed (go test -v) for the closing note.
// Needs root and ip (and nft for the delay); skipped otherwise.
func TestChaos(t *testing.T) {
	needNetns(t)
	faults := []chaosFault{
		{name: "SIGKILL middle stage", inject: injectSignal(syscall.SIGKILL), after: afterLoss(nil)},
		{name: "SIGKILL middle stage, pipelined", pipelining: true, inject: injectSignal(syscall.SIGKILL), after: afterLoss(nil)},
		{name: "SIGSTOP middle stage", inject: injectSignal(syscall.SIGSTOP), after: afterLoss(func(m *nsMesh) error {
			return m.nodes[1].proc.cmd.Process.Signal(syscall.SIGCONT)
		})},
		{name: "link down middle stage", inject: injectLinkDown, after: afterLoss(func(m *nsMesh) error {
			return m.net.setLink(2, true)
		})},
		{name: "50 ms delay on hop 1→2", relays: true, inject: injectDelay, after: afterDelay},
	}
	var rows []chaosRow
	defer func() { t.Log("chaos table:\n" + chaosTable(rows)) }()
	for _, f := range faults {
		t.Run(strings.ReplaceAll(f.name, " ", "_"), func(t *testing.T) {
			rows = append(rows, runChaos(t, f))
		})
	}
}

func runChaos(t *testing.T, f chaosFault) chaosRow {
	if f.relays {
		needNetns(t, "nft")
	}
	m := startNSMesh(t, stories, 3, nsMeshOptions{relays: f.relays, pipelining: f.pipelining})
	entry := m.nodes[0]
	for _, p := range chaosPrompts {
		stories.greedy(t, p, chaosMaxTokens) // the references, before the clock runs
	}
	hard, cancel := context.WithCancel(context.Background())
	l := startLoad(hard, entry, stories, chaosClients, chaosPrompts, chaosMaxTokens)
	defer func() { cancel(); l.finish() }()
	// Requests flow before the fault; the clients go on at once, so the
	// fault finds streams in flight.
	l.waitDone(t, time.Time{}, chaosClients, 30*time.Second)
	t0 := f.inject(t, m)
	// Counted once the fault is surely in place: a fault that takes a
	// command to inject (ip link) may take longer than a whole request on
	// a loaded machine, so the requests running at t0 may all have ended
	// before it bit; those running now run under it.
	row := chaosRow{name: f.name, inflight: l.inFlight()}
	row.note = f.after(t, m, l, t0)
	// The mesh serves on: every client completes a request started now.
	l.waitDone(t, time.Now(), chaosClients, 60*time.Second)
	results := l.finish()
	tl := account(t, stories, results, chaosMaxTokens)
	row.started, row.completed, row.failed, row.lost, row.dup = tl.started, tl.completed, tl.failed, tl.lost, tl.dup
	var resumed time.Time
	row.stall, resumed = longestStall(results, t0, time.Now())
	t.Logf("%s: %d requests, %d in flight at the fault; longest stall %s (resumed %s after the fault)",
		f.name, tl.started, row.inflight, row.stall.Round(time.Millisecond), resumed.Sub(t0).Round(time.Millisecond))
	for _, e := range tl.errs {
		t.Errorf("failed request: %s", e)
	}
	for _, w := range tl.wrong {
		t.Errorf("wrong text: %s", w)
	}
	if tl.lost != 0 || tl.dup != 0 {
		t.Errorf("%d tokens lost, %d duplicated", tl.lost, tl.dup)
	}
	if row.stall >= recoverGoal || resumed.IsZero() {
		t.Errorf("the streams stalled %s after the fault, want under %s", row.stall.Round(time.Millisecond), recoverGoal)
	}
	if row.inflight == 0 {
		t.Errorf("no request was in flight when the fault came: the fault tested nothing")
	}
	return row
}

// drainedRE is what a node logs when its graceful leave completed.
var drainedRE = regexp.MustCompile(`drained: leaving the mesh`)

// injectSignal sends sig to node 2, the middle stage.
func injectSignal(sig syscall.Signal) func(*testing.T, *nsMesh) time.Time {
	return func(t *testing.T, m *nsMesh) time.Time {
		t0 := time.Now()
		if err := m.nodes[1].proc.cmd.Process.Signal(sig); err != nil {
			t.Fatalf("%s to node2: %v", sig, err)
		}
		return t0
	}
}

func injectLinkDown(t *testing.T, m *nsMesh) time.Time {
	t0 := time.Now()
	if err := m.net.setLink(2, false); err != nil {
		t.Fatal(err)
	}
	return t0
}

// afterLoss waits until nodes 1 and 3 serve the model without node 2,
// then undoes the fault (when undo is set) and waits for node 2 to take a
// stage again.
func afterLoss(undo func(*nsMesh) error) func(*testing.T, *nsMesh, *load, time.Time) string {
	return func(t *testing.T, m *nsMesh, l *load, t0 time.Time) string {
		survivors := m.others(m.nodes[1])
		if _, err := awaitSettled(m.model, survivors, 30*time.Second); err != nil {
			m.dumpStacks(t)
			t.Fatalf("after the fault: %v", err)
		}
		note := fmt.Sprintf("replanned without node2 in %s", time.Since(t0).Round(100*time.Millisecond))
		if undo == nil {
			return note
		}
		t1 := time.Now()
		if err := undo(m); err != nil {
			t.Fatal(err)
		}
		if _, err := awaitSettled(m.model, m.nodes, 60*time.Second); err != nil {
			t.Errorf("node2 did not come back: %v", err)
			m.dumpStacks(t)
			return note + "; node2 did not come back"
		}
		return note + fmt.Sprintf("; back in 3 stages %s after the undo", time.Since(t1).Round(100*time.Millisecond))
	}
}

// injectDelay slows the hop between the first two stages by 50 ms each way.
func injectDelay(t *testing.T, m *nsMesh) time.Time {
	t0 := time.Now()
	m.relays.set(1, 2, 50*time.Millisecond)
	return t0
}

// afterDelay checks that the delay is real: a request started under it
// takes at least 50 ms per token, the time one token's activations now
// spend on the slowed hop.
func afterDelay(t *testing.T, m *nsMesh, l *load, t0 time.Time) string {
	l.waitDone(t, t0, chaosClients, 2*time.Minute)
	var per []time.Duration
	for _, r := range l.snapshot() {
		if r.start.After(t0) && r.err == nil && r.tokens > 1 {
			per = append(per, r.end.Sub(r.start)/time.Duration(r.tokens))
		}
	}
	if len(per) == 0 {
		t.Fatal("no request completed under the delay")
	}
	slowest := per[0]
	for _, p := range per {
		slowest = max(slowest, p)
	}
	for _, p := range per {
		if p < 50*time.Millisecond {
			t.Errorf("a request under the delay took %s per token, less than the hop's 50 ms", p)
		}
	}
	return fmt.Sprintf("%s per token under the delay (slowest)", slowest.Round(time.Millisecond))
}

func chaosTable(rows []chaosRow) string {
	var b strings.Builder
	w := tabwriter.NewWriter(&b, 0, 0, 2, ' ', 0)
	fmt.Fprintln(w, "fault\tstarted\tcompleted\tfailed\tlost\tdup\tin flight\trecover\tnote")
	for _, r := range rows {
		fmt.Fprintf(w, "%s\t%d\t%d\t%d\t%d\t%d\t%d\t%s\t%s\n", r.name, r.started, r.completed, r.failed, r.lost, r.dup,
			r.inflight, r.stall.Round(10*time.Millisecond), r.note)
	}
	w.Flush()
	return b.String()
}

// TestSigtermMidRequest: SIGTERM to the node holding the middle stage of
// a 3-node mesh while a streaming request runs through it. The node
// drains (the mesh moves its layers to the other two, the request moves
// with them) and exits with status 0 on its own; the request completes
// with exactly the reference text, and it was still streaming when the
// node had gone. The hop into the middle stage is slowed by 50 ms (a
// delay relay) so that the request outlasts the drain. Needs root, ip and
// nft, like TestChaos.
func TestSigtermMidRequest(t *testing.T) {
	needNetns(t, "nft")
	const maxTokens = 96
	want := stories.greedy(t, storyPrompt, maxTokens)
	m := startNSMesh(t, stories, 3, nsMeshOptions{relays: true})
	victim := m.nodes[1]
	m.relays.set(1, 2, 50*time.Millisecond)

	ctx, cancel := context.WithTimeout(context.Background(), 2*time.Minute)
	pieces := make(chan int, maxTokens+1)
	done := make(chan struct{})
	var r streamResult
	go func() {
		defer close(done)
		r = streamComplete(ctx, m.nodes[0], stories.id, storyPrompt, maxTokens, func(n int) { pieces <- n })
	}()
	defer func() { cancel(); <-done }()
	// SIGTERM once the stream is under way through node2.
	for n := 0; n < 8; {
		select {
		case n = <-pieces:
		case <-done:
			t.Fatalf("the request ended before it streamed 8 pieces: %v", r.err)
		case <-time.After(30 * time.Second):
			t.Fatal("the request streamed fewer than 8 pieces in 30 s")
		}
	}
	replays0, err := metricValue(m.nodes[0], "meshnode_sequence_replays_total")
	if err != nil {
		t.Fatal(err)
	}
	termAt := time.Now()
	if err := victim.proc.cmd.Process.Signal(syscall.SIGTERM); err != nil {
		t.Fatal(err)
	}
	if !victim.proc.exited(60 * time.Second) {
		t.Fatal("node2 did not exit within 60 s of SIGTERM")
	}
	exitedAt := time.Now()
	if err := victim.proc.exitErr(); err != nil {
		t.Errorf("node2 exited with %v, want status 0", err)
	}
	if _, err := victim.proc.awaitLine(drainedRE, time.Second); err != nil {
		t.Errorf("node2 did not say it drained: %v", err)
	}
	<-done // bounded by ctx
	t.Logf("SIGTERM %s after the request started; node2 exited %s later; the request ended %s after the SIGTERM",
		termAt.Sub(r.start).Round(time.Millisecond), exitedAt.Sub(termAt).Round(time.Millisecond), r.end.Sub(termAt).Round(time.Millisecond))
	if r.err != nil {
		t.Fatalf("the request failed: %v", r.err)
	}
	if r.text != want.text || r.tokens != len(want.ids) || r.finish != want.finish {
		t.Errorf("the request:\n got %q (%d tokens, %s)\nwant %q (%d tokens, %s)", r.text, r.tokens, r.finish, want.text, len(want.ids), want.finish)
	}
	// The request moved: the entry replayed it on the pipeline without
	// node2 (it was the only sequence).
	if n, err := metricValue(m.nodes[0], "meshnode_sequence_replays_total"); err != nil {
		t.Error(err)
	} else if n <= replays0 {
		t.Errorf("node1 replayed %v sequences in all, %v before the SIGTERM: the request never moved off node2", n, replays0)
	}
	// The two that stay serve on.
	waitSettled(t, stories, m.others(victim), 30*time.Second)
	checkGreedy(t, m.nodes[2], stories)
}

// metricValue reads a metric from a node's /metrics, summed over its
// label sets.
func metricValue(n *meshNode, name string) (float64, error) {
	ctx, cancel := context.WithTimeout(context.Background(), 5*time.Second)
	defer cancel()
	resp, err := n.request(ctx, http.MethodGet, "/metrics", nil)
	if err != nil {
		return 0, fmt.Errorf("%s /metrics: %w", n.name, err)
	}
	defer resp.Body.Close()
	body, err := io.ReadAll(resp.Body)
	if err != nil {
		return 0, fmt.Errorf("%s /metrics: %w", n.name, err)
	}
	sum, found := 0.0, false
	for _, line := range strings.Split(string(body), "\n") {
		if !strings.HasPrefix(line, name+" ") && !strings.HasPrefix(line, name+"{") {
			continue
		}
		fields := strings.Fields(line)
		var f float64
		if _, err := fmt.Sscan(fields[len(fields)-1], &f); err != nil {
			return 0, fmt.Errorf("%s /metrics: %s: %w", n.name, line, err)
		}
		sum, found = sum+f, true
	}
	if !found {
		return 0, fmt.Errorf("%s /metrics has no %s", n.name, name)
	}
	return sum, nil
}
