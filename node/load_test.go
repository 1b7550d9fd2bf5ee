package node_test

// TestLoad is issue 5's load test: a two-node mesh on loopback (two
// node.Run in this process, the model split between them) takes rounds of
// 64 concurrent streaming clients. Every request either streams to [DONE]
// with exactly its greedy reference text, or is refused with the documented
// 429 and Retry-After; nothing else is allowed. Between rounds the test
// measures the heap, the process's RSS and the goroutines: none may grow
// from the second round (the first warms caches and pools) to the last.
// After both nodes stop, goleak checks that nothing they started is left.

import (
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"math"
	"net/http"
	"os"
	"runtime"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"go.uber.org/goleak"

	"github.com/meshnode/meshnode/node"
	"github.com/meshnode/meshnode/node/sse"
	"github.com/meshnode/meshnode/stage"
)

const (
	loadClients = 64
	// Each node runs loadParallel sequences and queues loadQueue more: 64
	// clients over two nodes are far more than the 2×(4+8) the mesh
	// admits, so the 429 path is part of every round.
	loadParallel = 4
	loadQueue    = 8
	// A request's own deadline: a queued stream of a few dozen tokens
	// takes well under a second even under -race.
	loadRequestTimeout = 30 * time.Second

	// The bounds between rounds, from the second round to the last. They
	// are generous on purpose: what they catch is growth that scales with
	// the number of requests (hundreds to thousands per round), not
	// allocator noise. The first round is not compared: besides pools and
	// caches, gRPC keeps up to 256 KiB of the frames sent on each stage
	// stream for a transparent retry until the stream commits (the
	// forward streams receive nothing, so they commit only when that
	// buffer is full), a few MiB in all that come back after a round or two.
	//
	// Live heap after a GC (HeapAlloc) may grow at most loadLiveSlack: a
	// leak of ~700 bytes per request shows over the ~1500 requests of
	// rounds 3 and 4 (it grows by 0-0.2 MiB here). Heap in use (HeapInuse:
	// spans, so also fragmentation) may grow at most loadHeapSlack.
	loadLiveSlack = 1 << 20
	loadHeapSlack = 8 << 20
	// RSS (Go heap, ggml's buffers, malloc arenas of the cgo threads) may
	// grow at most this much from the second round to the last. Not under
	// the race detector: its shadow memory and sync metadata grow with
	// every round (10-30 MiB a round here) and are never returned, so
	// there RSS measures the detector, not meshnode.
	loadRSSSlack = 64 << 20
	// Goroutines must come back to what the idle mesh had, give or take
	// this many (timers and gossip come and go).
	loadGoroutineSlack = 8
	// A round must complete at least this many streams: a mesh that
	// refuses everything would pass every other check. Rounds complete
	// 700-900 streams here, 150-300 under -race.
	loadMinCompleted = 32
)

// loadCase is one request a client sends; clients cycle through them.
type loadCase struct {
	chat      bool
	prompt    string
	maxTokens int
}

var loadCases = []loadCase{
	{prompt: storyPrompt, maxTokens: 16},
	{prompt: "The little dog", maxTokens: 12},
	{chat: true, prompt: "Tell me a story about a cat.", maxTokens: 16},
	{prompt: "Tom and Sue went to", maxTokens: 20},
	{prompt: "One day, a bird", maxTokens: 8},
	{chat: true, prompt: "Hi!", maxTokens: 10},
	{prompt: "Lily had a red ball", maxTokens: 24},
	{prompt: "Max liked to run", maxTokens: 14},
}

func (c loadCase) String() string {
	kind := "completions"
	if c.chat {
		kind = "chat"
	}
	return fmt.Sprintf("%s %q/%d", kind, c.prompt, c.maxTokens)
}

func (c loadCase) reference(t *testing.T) continuation {
	t.Helper()
	if c.chat {
		return ref.chat(t, c.prompt, c.maxTokens)
	}
	return ref.completion(t, c.prompt, c.maxTokens)
}

// errRejected is a 429 with a well-formed Retry-After and error body.
type errRejected struct{ retryAfter time.Duration }

func (e *errRejected) Error() string { return fmt.Sprintf("429, retry after %v", e.retryAfter) }

// streamOnce sends c as a streaming request to the node at url and checks
// the stream against want. It returns nil for a stream that matched,
// *errRejected for a documented 429, and any other error otherwise.
func streamOnce(ctx context.Context, hc *http.Client, url string, c loadCase, want continuation) error {
	req := map[string]any{"model": modelID, "max_tokens": c.maxTokens, "temperature": 0,
		"stream": true, "stream_options": map[string]any{"include_usage": true}}
	path := "/v1/completions"
	if c.chat {
		path = "/v1/chat/completions"
		req["messages"] = []map[string]string{{"role": "user", "content": c.prompt}}
	} else {
		req["prompt"] = c.prompt
	}
	body, err := json.Marshal(req)
	if err != nil {
		return err
	}
	hreq, err := http.NewRequestWithContext(ctx, http.MethodPost, url+path, bytes.NewReader(body))
	if err != nil {
		return err
	}
	hreq.Header.Set("Content-Type", "application/json")
	resp, err := hc.Do(hreq)
	if err != nil {
		return fmt.Errorf("%v: %w", c, err)
	}
	defer resp.Body.Close()
	if resp.StatusCode == http.StatusTooManyRequests {
		return rejected(resp)
	}
	if resp.StatusCode != http.StatusOK {
		data, _ := io.ReadAll(resp.Body)
		return fmt.Errorf("%v: status %d: %s", c, resp.StatusCode, data)
	}
	if ct := resp.Header.Get("Content-Type"); ct != "text/event-stream" {
		return fmt.Errorf("%v: stream content type %q", c, ct)
	}
	var (
		text, finish string
		u            *usage
	)
	err = sse.Each(resp.Body, func(data []byte) error {
		var ev struct {
			Choices []struct {
				Text         string  `json:"text"`
				FinishReason *string `json:"finish_reason"`
				Delta        struct {
					Content string `json:"content"`
				} `json:"delta"`
			} `json:"choices"`
			Usage *usage          `json:"usage"`
			Error json.RawMessage `json:"error"`
		}
		if err := json.Unmarshal(data, &ev); err != nil {
			return fmt.Errorf("event %q: %w", data, err)
		}
		if ev.Error != nil {
			return fmt.Errorf("error event after %q: %s", text, ev.Error)
		}
		if ev.Usage != nil {
			u = ev.Usage
		}
		for _, ch := range ev.Choices {
			text += ch.Text + ch.Delta.Content
			if ch.FinishReason != nil {
				finish = *ch.FinishReason
			}
		}
		return nil
	})
	switch {
	case err != nil:
		return fmt.Errorf("%v: stream after %q: %w", c, text, err)
	case text != want.text:
		return fmt.Errorf("%v: text differs from the greedy reference:\n got %q\nwant %q", c, text, want.text)
	case finish != want.finish:
		return fmt.Errorf("%v: finish_reason %q, want %q", c, finish, want.finish)
	case u == nil || *u != (usage{len(want.prompt), len(want.ids), len(want.prompt) + len(want.ids)}):
		return fmt.Errorf("%v: usage %+v, want prompt %d completion %d", c, u, len(want.prompt), len(want.ids))
	}
	return nil
}

// rejected checks that a 429 is the documented one: Retry-After in whole
// seconds and OpenAI's rate_limit_exceeded error object.
func rejected(resp *http.Response) error {
	data, _ := io.ReadAll(resp.Body)
	ra := resp.Header.Get("Retry-After")
	secs, err := strconv.Atoi(ra)
	if err != nil || secs < 1 {
		return fmt.Errorf("429 with Retry-After %q: %s", ra, data)
	}
	var e errorBody
	if err := json.Unmarshal(data, &e); err != nil || e.Error.Code == nil || *e.Error.Code != "rate_limit_exceeded" {
		return fmt.Errorf("429 with body %q, want a rate_limit_exceeded error", data)
	}
	return &errRejected{retryAfter: time.Duration(secs) * time.Second}
}

// tally counts what a round's clients saw.
type tally struct {
	completed, rejected, failed atomic.Int64
	mu                          sync.Mutex
	errs                        []error // the first few failures
}

func (t *tally) fail(err error) {
	t.failed.Add(1)
	t.mu.Lock()
	defer t.mu.Unlock()
	if len(t.errs) < 5 {
		t.errs = append(t.errs, err)
	}
}

// runRound runs loadClients clients until d has passed; each sends
// requests back to back, to node i%2, honouring Retry-After on a 429. A
// request started before the end runs to its own end.
func runRound(hc *http.Client, urls []string, wants []continuation, d time.Duration) *tally {
	var tl tally
	end := time.Now().Add(d)
	var wg sync.WaitGroup
	for i := range loadClients {
		wg.Go(func() {
			url := urls[i%len(urls)]
			for k := i; time.Now().Before(end); k++ {
				c := loadCases[k%len(loadCases)]
				ctx, cancel := context.WithTimeout(context.Background(), loadRequestTimeout)
				err := streamOnce(ctx, hc, url, c, wants[k%len(loadCases)])
				cancel()
				var rej *errRejected
				switch {
				case err == nil:
					tl.completed.Add(1)
				case errors.As(err, &rej):
					tl.rejected.Add(1)
					time.Sleep(min(rej.retryAfter, time.Until(end)))
				default:
					tl.fail(fmt.Errorf("client %d → %s: %w", i, url, err))
					time.Sleep(min(100*time.Millisecond, time.Until(end)))
				}
			}
		})
	}
	wg.Wait()
	return &tl
}

// sample is the process's footprint when idle.
type sample struct {
	heapAlloc, heapInuse, rss uint64
	goroutines                int
}

// vmRSS reads VmRSS from /proc/self/status; 0 where there is no /proc.
func vmRSS() (uint64, error) {
	data, err := os.ReadFile("/proc/self/status")
	if err != nil {
		if errors.Is(err, os.ErrNotExist) {
			return 0, nil
		}
		return 0, fmt.Errorf("reading /proc/self/status: %w", err)
	}
	for _, line := range strings.Split(string(data), "\n") {
		if v, ok := strings.CutPrefix(line, "VmRSS:"); ok {
			kb, err := strconv.ParseUint(strings.TrimSuffix(strings.TrimSpace(v), " kB"), 10, 64)
			if err != nil {
				return 0, fmt.Errorf("VmRSS %q: %w", v, err)
			}
			return kb << 10, nil
		}
	}
	return 0, errors.New("no VmRSS in /proc/self/status")
}

// measure waits (up to 5 s) for the goroutine count to come down to at
// most settle (settle < 0: half a second, for connections to close), then
// samples the heap after a GC (the least of three samples 200 ms apart: a
// leak stays in all three, a request still being torn down does not), the
// RSS and the goroutine count.
func measure(settle int) (sample, error) {
	if settle < 0 {
		time.Sleep(500 * time.Millisecond)
	}
	deadline := time.Now().Add(5 * time.Second)
	for settle >= 0 && runtime.NumGoroutine() > settle && time.Now().Before(deadline) {
		time.Sleep(50 * time.Millisecond)
	}
	s := sample{heapAlloc: math.MaxUint64, heapInuse: math.MaxUint64}
	for i := range 3 {
		if i > 0 {
			time.Sleep(200 * time.Millisecond)
		}
		runtime.GC()
		runtime.GC() // the second empties sync.Pool's victim cache
		var ms runtime.MemStats
		runtime.ReadMemStats(&ms)
		s.heapAlloc, s.heapInuse = min(s.heapAlloc, ms.HeapAlloc), min(s.heapInuse, ms.HeapInuse)
	}
	var err error
	s.rss, err = vmRSS()
	s.goroutines = runtime.NumGoroutine()
	return s, err
}

// loadMesh is two nodes of one mesh, each running node.Run in this process.
type loadMesh struct {
	urls   []string // each node's API
	cancel context.CancelFunc
	done   chan error // one value per node.Run
}

// startLoadMesh starts a node that serves the model split (--split) and
// a second one that joins it, and waits until both serve a two-stage plan.
func startLoadMesh(t *testing.T, hc *http.Client) *loadMesh {
	t.Helper()
	ctx, cancel := context.WithCancel(context.Background())
	m := &loadMesh{cancel: cancel, done: make(chan error, 2)}
	base := node.Config{
		HTTPAddr: "127.0.0.1:0", Threads: 1, Context: ctxLen,
		Parallel: loadParallel, QueueSize: loadQueue,
		Listen: []string{"/ip4/127.0.0.1/tcp/0"}, GossipPort: -1,
		// f32 activations: the split gives exactly the unsplit reference.
		WireDType:    stage.F32,
		DrainTimeout: 10 * time.Second,
	}
	joinCmd := make(chan string, 1)
	ready := make(chan string, 2)
	a := base
	a.Model, a.Split, a.DataDir = modelPath, true, t.TempDir()
	a.JoinCommand = func(cmd string) { joinCmd <- cmd }
	a.Ready = func(addr string) { ready <- addr }
	go func() { m.done <- node.Run(ctx, a) }()
	running := 1
	fail := func(format string, args ...any) {
		t.Helper()
		m.stop(t, running)
		t.Fatalf(format, args...)
	}

	var cmd string
	select {
	case cmd = <-joinCmd:
	case err := <-m.done:
		running--
		fail("first node: %v", err)
	case <-time.After(30 * time.Second):
		fail("the first node printed no join command in 30 s")
	}
	f := strings.Fields(cmd) // meshnode join ADDR --mesh-key KEY
	if len(f) != 5 {
		fail("join command %q", cmd)
	}
	b := base
	b.DataDir, b.Join, b.MeshKey = t.TempDir(), []string{f[2]}, f[4]
	b.Ready = func(addr string) { ready <- addr }
	go func() { m.done <- node.Run(ctx, b) }()
	running++

	addrs := map[string]bool{}
	for len(addrs) < 2 {
		select {
		case addr := <-ready:
			addrs[addr] = true
		case err := <-m.done:
			running--
			fail("a node stopped before serving: %v", err)
		case <-time.After(60 * time.Second):
			fail("the nodes did not become ready in 60 s")
		}
	}
	// Ready order is not node order; the order does not matter to the
	// test, only that both nodes are entry points.
	for addr := range addrs {
		m.urls = append(m.urls, "http://"+addr)
	}
	deadline := time.Now().Add(60 * time.Second)
	for _, u := range m.urls {
		for {
			err := twoStages(hc, u)
			if err == nil {
				break
			}
			if time.Now().After(deadline) {
				fail("%s: no two-stage pipeline in 60 s: %v", u, err)
			}
			time.Sleep(200 * time.Millisecond)
		}
	}
	return m
}

// twoStages checks that the node at url serves a two-stage plan, one
// stage per node, with its pipeline built after the plan.
func twoStages(hc *http.Client, url string) error {
	resp, err := hc.Get(url + "/api/status")
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	var st node.Status
	if err := json.NewDecoder(resp.Body).Decode(&st); err != nil {
		return fmt.Errorf("decoding /api/status: %w", err)
	}
	if !st.Ready || len(st.Plan) != 2 || st.Plan[0].Node == st.Plan[1].Node || st.Local == nil {
		return fmt.Errorf("ready %v, plan %+v, problem %q", st.Ready, st.Plan, st.Problem)
	}
	var plan, pipe time.Time
	for _, e := range st.Events {
		switch e.Kind {
		case "plan":
			plan = e.Time
		case "pipeline":
			pipe = e.Time
		}
	}
	if pipe.Before(plan) {
		return fmt.Errorf("pipeline (%v) older than the plan (%v)", pipe, plan)
	}
	return nil
}

// stop cancels the nodes and waits for the n still running to return.
func (m *loadMesh) stop(t *testing.T, n int) {
	t.Helper()
	m.cancel()
	timeout := time.After(30 * time.Second)
	for range n {
		select {
		case err := <-m.done:
			if err != nil {
				t.Errorf("node.Run returned %v after cancellation", err)
			}
		case <-timeout:
			t.Fatal("node.Run did not return within 30 s of cancellation")
		}
	}
}

func TestLoad(t *testing.T) {
	rounds, roundTime := 4, 5*time.Second
	if testing.Short() {
		rounds, roundTime = 3, 2*time.Second
	}
	wants := make([]continuation, len(loadCases))
	for i, c := range loadCases {
		wants[i] = c.reference(t)
		if len(wants[i].ids) == 0 {
			t.Fatalf("%v: empty reference", c)
		}
	}

	// Everything alive now (the runtime, TestMain's node) is not this
	// test's; what the mesh below starts must be gone once it stops.
	leakOpts := []goleak.Option{goleak.IgnoreCurrent()}

	tr := &http.Transport{MaxIdleConnsPerHost: loadClients}
	hc := &http.Client{Transport: tr}
	m := startLoadMesh(t, hc)
	running := 2
	defer func() {
		if running > 0 {
			m.stop(t, running)
		}
	}()

	tr.CloseIdleConnections()
	idle, err := measure(-1)
	if err != nil {
		t.Fatal(err)
	}
	t.Logf("idle mesh: %v", idle)

	samples := make([]sample, rounds)
	var served int64  // streams completed after round 2
	var refused int64 // 429s in all rounds
	for r := range rounds {
		tl := runRound(hc, m.urls, wants, roundTime)
		tr.CloseIdleConnections()
		s, err := measure(idle.goroutines + loadGoroutineSlack)
		if err != nil {
			t.Fatal(err)
		}
		samples[r] = s
		refused += tl.rejected.Load()
		if r >= 2 {
			served += tl.completed.Load()
		}
		t.Logf("round %d: %d streams completed, %d refused with 429, %d failed; %v",
			r+1, tl.completed.Load(), tl.rejected.Load(), tl.failed.Load(), s)
		for _, err := range tl.errs {
			t.Errorf("round %d: %v", r+1, err)
		}
		if n := tl.failed.Load(); n > 0 {
			t.Errorf("round %d: %d requests failed (the first ones above)", r+1, n)
		}
		if tl.completed.Load() < loadMinCompleted {
			t.Errorf("round %d: only %d streams completed: the mesh did not serve under load", r+1, tl.completed.Load())
		}
		if s.goroutines > idle.goroutines+loadGoroutineSlack {
			t.Errorf("round %d: %d goroutines after the clients left, the idle mesh had %d", r+1, s.goroutines, idle.goroutines)
		}
	}

	// 64 clients are more than the nodes run and queue: if none was ever
	// refused, the queue is not bounded.
	if refused == 0 {
		t.Errorf("no request was refused with 429: %d clients, %d nodes running %d and queueing %d each",
			loadClients, len(m.urls), loadParallel, loadQueue)
	}

	// From the second round (the first warmed pools and caches) to the last.
	first, last := samples[1], samples[rounds-1]
	tests := []struct {
		name        string
		first, last uint64
		slack       uint64
	}{
		{"live heap", first.heapAlloc, last.heapAlloc, loadLiveSlack},
		{"heap in use", first.heapInuse, last.heapInuse, loadHeapSlack},
		{"RSS", first.rss, last.rss, loadRSSSlack},
	}
	for _, tt := range tests {
		if tt.name == "RSS" && (raceEnabled || tt.first == 0) {
			continue
		}
		if tt.last > tt.first+tt.slack {
			t.Errorf("%s grew from %s (round 2) to %s (round %d, %d more streams served); the bound is +%s",
				tt.name, node.HumanBytes(tt.first), node.HumanBytes(tt.last), rounds, served, node.HumanBytes(tt.slack))
		}
	}

	running = 0
	m.stop(t, 2)
	tr.CloseIdleConnections()
	// A memberlist probe in flight when the mesh stops ends on its own
	// within a probe interval (Shutdown does not wait for it); under -race
	// that outlasts goleak's own retries. Give memberlist's goroutines a
	// few seconds to end first: one that stays is still reported.
	for deadline := time.Now().Add(5 * time.Second); time.Now().Before(deadline) && strings.Contains(allStacks(), "hashicorp/memberlist"); {
		time.Sleep(50 * time.Millisecond)
	}
	goleak.VerifyNone(t, leakOpts...)
}

// allStacks is every goroutine's stack.
func allStacks() string {
	buf := make([]byte, 1<<20)
	return string(buf[:runtime.Stack(buf, true)])
}

func (s sample) String() string {
	return fmt.Sprintf("live heap %s, heap in use %s, RSS %s, %d goroutines",
		node.HumanBytes(s.heapAlloc), node.HumanBytes(s.heapInuse), node.HumanBytes(s.rss), s.goroutines)
}
