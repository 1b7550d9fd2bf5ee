package meshtest

// The harness: the meshnode binary, node processes and their logs, the
// models and their greedy references, and the clients of the HTTP API.

import (
	"bufio"
	"bytes"
	"context"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"regexp"
	"slices"
	"strings"
	"sync"
	"syscall"
	"testing"
	"time"

	"github.com/meshnode/meshnode/ggufstage"
	"github.com/meshnode/meshnode/ggufstage/gguf"
	"github.com/meshnode/meshnode/ggufstage/synth"
	"github.com/meshnode/meshnode/node/childproc"
	"github.com/meshnode/meshnode/stage"
	"github.com/meshnode/meshnode/stage/stagetest"
)

const (
	storiesRelPath = "../../../shared/models/stories260K.gguf"
	// Every node and the reference run this context; the reference must
	// match the mesh's (positions are the same either way, but a request
	// over the context fails differently).
	ctxLen = 512
	// What the acceptance tests generate: 32 greedy tokens of a story.
	storyPrompt = "Once upon a time"
	genTokens   = 32
	// How long a mesh may take to form: processes start, hash the model,
	// fetch and load slices. On an idle machine it takes a few seconds.
	formTimeout = 90 * time.Second
)

var (
	binPath string     // the meshnode binary, built by TestMain
	stories *testModel // ../shared/models/stories260K.gguf: llama, 5 layers
	qwen3   *testModel // a tiny random qwen3 written by synth: 3 layers
)

func TestMain(m *testing.M) { os.Exit(runMain(m)) }

func runMain(m *testing.M) int {
	dir, err := os.MkdirTemp("", "meshnode-meshtest-")
	if err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}
	defer os.RemoveAll(dir)

	// One binary for every node, built with the caller's environment (make
	// test exports the cgo flags, so the build cache is warm).
	binPath = filepath.Join(dir, "meshnode")
	goTool, err := exec.LookPath("go") // go test puts GOROOT/bin first in PATH
	if err != nil {
		fmt.Fprintln(os.Stderr, "finding the go command:", err)
		return 1
	}
	build := exec.Command(goTool, "build", "-tags", "repack", "-o", binPath, "github.com/meshnode/meshnode/cmd/meshnode")
	build.Stdout, build.Stderr = os.Stderr, os.Stderr
	if err := build.Run(); err != nil {
		fmt.Fprintln(os.Stderr, "building meshnode:", err)
		return 1
	}

	path, err := filepath.Abs(storiesRelPath)
	if err == nil {
		stories, err = openModel(path)
	}
	if err != nil {
		fmt.Fprintln(os.Stderr, "the stories260K model (from ../shared/models):", err)
		return 1
	}
	qpath := filepath.Join(dir, "tiny-qwen3.gguf")
	if err := synth.Write(qpath, synth.Tiny("qwen3"), nil); err != nil {
		fmt.Fprintln(os.Stderr, "writing the random qwen3:", err)
		return 1
	}
	if qwen3, err = openModel(qpath); err != nil {
		fmt.Fprintln(os.Stderr, err)
		return 1
	}

	code := m.Run()
	stories.close()
	qwen3.close()
	return code
}

// ---- processes ----

// proc is a child process whose output (stdout and stderr together) is
// kept in memory and in a log file, and can be waited on line by line.
type proc struct {
	name    string
	cmd     *exec.Cmd
	logPath string

	mu      sync.Mutex
	lines   []string
	newLine chan struct{} // closed and replaced at every line
	done    chan struct{} // closed once the process has exited and its output is read
	waitErr error
}

// nodeEnv is the environment of a node: the test's, minus MESHNODE_*
// settings (a developer's MESHNODE_MESH_KEY or MESHNODE_DATA must not leak
// into the tests' nodes).
func nodeEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		if !strings.HasPrefix(kv, "MESHNODE_") {
			env = append(env, kv)
		}
	}
	return env
}

// startProc runs bin with args. The process is killed when the test ends,
// and its output is printed if the test failed.
func startProc(t *testing.T, name, bin string, args ...string) *proc {
	t.Helper()
	logDir := t.TempDir()
	p := &proc{name: name, logPath: filepath.Join(logDir, name+".log"), newLine: make(chan struct{}), done: make(chan struct{})}
	logFile, err := os.Create(p.logPath)
	if err != nil {
		t.Fatal(err)
	}
	pr, pw, err := os.Pipe()
	if err != nil {
		t.Fatal(err)
	}
	p.cmd = exec.Command(bin, args...)
	p.cmd.Env = nodeEnv()
	p.cmd.Stdout, p.cmd.Stderr = pw, pw
	// childproc: the node dies with the test binary, so that a crashed or
	// interrupted run leaves no node behind.
	child, err := childproc.Start(p.cmd)
	if err != nil {
		pr.Close()
		pw.Close()
		logFile.Close()
		t.Fatalf("starting %s: %v", name, err)
	}
	pw.Close()
	go func() {
		rd := bufio.NewReader(pr)
		for {
			line, err := rd.ReadString('\n')
			if line != "" {
				logFile.WriteString(line)
				p.mu.Lock()
				p.lines = append(p.lines, strings.TrimRight(line, "\n"))
				close(p.newLine)
				p.newLine = make(chan struct{})
				p.mu.Unlock()
			}
			if err != nil {
				break
			}
		}
		pr.Close()
		logFile.Close()
		err := child.Wait()
		p.mu.Lock()
		p.waitErr = err
		p.mu.Unlock()
		close(p.done)
	}()
	t.Cleanup(func() {
		p.kill()
		select {
		case <-p.done:
		case <-time.After(10 * time.Second):
			t.Errorf("%s (pid %d) did not exit after SIGKILL", name, p.cmd.Process.Pid)
		}
		if t.Failed() {
			t.Logf("---- %s: %s %s ----\n%s\n---- end of %s ----", name, filepath.Base(bin), redact(strings.Join(args, " ")), p.output(), name)
		}
	})
	return p
}

var meshKeyRE = regexp.MustCompile(`mk1_[A-Za-z0-9_-]+`)

// redact keeps mesh keys out of failure reports.
func redact(s string) string { return meshKeyRE.ReplaceAllString(s, "mk1_…") }

var ansiRE = regexp.MustCompile("\x1b\\[[0-9;]*m")

// output is what the process printed so far, readable: colors stripped and
// progress bars (redrawn with \r) reduced to their last state.
func (p *proc) output() string {
	p.mu.Lock()
	defer p.mu.Unlock()
	var b strings.Builder
	for _, l := range p.lines {
		l = strings.TrimRight(l, "\r ")
		if i := strings.LastIndexByte(l, '\r'); i >= 0 {
			l = l[i+1:]
		}
		b.WriteString(redact(ansiRE.ReplaceAllString(l, "")))
		b.WriteByte('\n')
	}
	return b.String()
}

// waitLine waits for a line matching re and returns its submatches. It
// fails the test when the process exits or time runs out first.
func (p *proc) waitLine(t *testing.T, re *regexp.Regexp, timeout time.Duration) []string {
	t.Helper()
	m, err := p.awaitLine(re, timeout)
	if err != nil {
		t.Fatalf("%s: %v", p.name, err)
	}
	return m
}

func (p *proc) awaitLine(re *regexp.Regexp, timeout time.Duration) ([]string, error) {
	deadline := time.After(timeout)
	seen := 0
	for {
		p.mu.Lock()
		lines, ch := p.lines[seen:], p.newLine
		seen = len(p.lines)
		p.mu.Unlock()
		for _, l := range lines {
			if m := re.FindStringSubmatch(ansiRE.ReplaceAllString(l, "")); m != nil {
				return m, nil
			}
		}
		select {
		case <-ch:
		case <-p.done:
			// The last lines may have come with the exit: look once more.
			p.mu.Lock()
			lines = p.lines[seen:]
			p.mu.Unlock()
			for _, l := range lines {
				if m := re.FindStringSubmatch(ansiRE.ReplaceAllString(l, "")); m != nil {
					return m, nil
				}
			}
			return nil, fmt.Errorf("exited (%v) before printing /%s/", p.exitErr(), re)
		case <-deadline:
			return nil, fmt.Errorf("no line matching /%s/ within %s", re, timeout)
		}
	}
}

// exited waits up to timeout for the process to exit.
func (p *proc) exited(timeout time.Duration) bool {
	select {
	case <-p.done:
		return true
	case <-time.After(timeout):
		return false
	}
}

func (p *proc) exitErr() error {
	p.mu.Lock()
	defer p.mu.Unlock()
	return p.waitErr
}

// kill sends SIGKILL: no shutdown, no goodbye to the mesh.
func (p *proc) kill() {
	select {
	case <-p.done:
	default:
		_ = p.cmd.Process.Signal(syscall.SIGKILL)
	}
}

// ---- models and references ----

// testModel is a GGUF the tests serve, and its greedy reference.
type testModel struct {
	id     string // the API's model id: the file name without .gguf
	path   string
	size   int64
	layers int
	file   *gguf.File

	once  sync.Once
	err   error
	mu    sync.Mutex
	stock *ggufstage.Stock
	tok   *ggufstage.Tokenizer
	seq   stage.SeqID
	memo  map[string]continuation
}

func openModel(path string) (*testModel, error) {
	f, err := os.Open(path)
	if err != nil {
		return nil, err
	}
	defer f.Close()
	st, err := f.Stat()
	if err != nil {
		return nil, err
	}
	g, err := gguf.Read(f, st.Size())
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	layers, err := g.BlockCount()
	if err != nil {
		return nil, fmt.Errorf("%s: %w", path, err)
	}
	return &testModel{
		id: strings.TrimSuffix(filepath.Base(path), ".gguf"), path: path, size: st.Size(),
		layers: layers, file: g,
	}, nil
}

// stageParts are the tensors a stage of layers [start,end) holds.
func (m *testModel) stageParts(t *testing.T, start, end int) []gguf.Part {
	t.Helper()
	parts, err := gguf.StageParts(m.file, start, end)
	if err != nil {
		t.Fatalf("%s [%d,%d): %v", m.id, start, end, err)
	}
	return parts
}

func (m *testModel) close() {
	if m != nil && m.stock != nil {
		m.stock.Close()
	}
}

// continuation is a greedy generation of at most n tokens.
type continuation struct {
	ids    []int32 // generated, EOS excluded
	text   string
	finish string // "stop" (EOS) or "length"
}

// greedy is the reference: ollama's own forward pass over the whole,
// unsplit model (ggufstage.OpenStock, no meshnode code in the loop), with
// an argmax, decoded by the model's tokenizer.
func (m *testModel) greedy(t *testing.T, prompt string, n int) continuation {
	t.Helper()
	m.once.Do(func() {
		opts := ggufstage.Options{Threads: 1, MaxSeqs: 1, Context: ctxLen, NoRepack: true}
		if m.stock, m.err = ggufstage.OpenStock(m.path, opts); m.err != nil {
			return
		}
		m.tok, m.err = ggufstage.LoadTokenizer(m.path)
		m.memo = map[string]continuation{}
	})
	if m.err != nil {
		t.Fatalf("reference for %s: %v", m.id, m.err)
	}
	m.mu.Lock()
	defer m.mu.Unlock()
	key := fmt.Sprintf("%q %d", prompt, n)
	if c, ok := m.memo[key]; ok {
		return c
	}
	ids, err := m.tok.Encode(prompt, true)
	if err != nil {
		t.Fatal(err)
	}
	m.seq++
	seq := m.seq
	defer m.stock.Release(seq)
	c := continuation{finish: "length"}
	b := stage.Batch{Outputs: []int{len(ids) - 1}}
	for i, id := range ids {
		b.Seqs, b.Pos, b.Tokens = append(b.Seqs, seq), append(b.Pos, int32(i)), append(b.Tokens, id)
	}
	for len(c.ids) < n && len(ids)+len(c.ids) < ctxLen {
		logits, err := m.stock.Forward(&b)
		if err != nil {
			t.Fatal(err)
		}
		next := stagetest.Argmax(logits)
		if m.tok.IsEOG(next) {
			c.finish = "stop"
			break
		}
		c.ids = append(c.ids, next)
		b = stage.Batch{Seqs: []stage.SeqID{seq}, Pos: []int32{int32(len(ids) + len(c.ids) - 1)}, Tokens: []int32{next}, Outputs: []int{0}}
	}
	if c.text, err = m.tok.Decode(c.ids); err != nil {
		t.Fatal(err)
	}
	m.memo[key] = c
	return c
}

// ---- the HTTP API ----

var httpClient = &http.Client{Timeout: 30 * time.Second}

// meshNode is a node as a client sees it: its API, and (when the test
// started it) its process.
type meshNode struct {
	name    string
	url     string // http://host:port
	apiKey  string
	dataDir string
	peer    string // peer ID, from /api/status
	proc    *proc  // nil when a script started the node
}

func (n *meshNode) request(ctx context.Context, method, path string, body []byte) (*http.Response, error) {
	req, err := http.NewRequestWithContext(ctx, method, n.url+path, bytes.NewReader(body))
	if err != nil {
		return nil, err
	}
	req.Header.Set("Content-Type", "application/json")
	if n.apiKey != "" {
		req.Header.Set("Authorization", "Bearer "+n.apiKey)
	}
	return httpClient.Do(req)
}

// status is GET /api/status, with the fields the tests read (declared
// here, not borrowed from package node, so that a changed field name
// breaks the tests as it would break any client).
type status struct {
	Self  string `json:"self"`
	Model *struct {
		ID     string `json:"id"`
		Name   string `json:"name"`
		Layers int    `json:"layers"`
	} `json:"model"`
	Plan  []planStage `json:"plan"`
	Ready bool        `json:"ready"`
	Nodes []struct {
		PeerID  string   `json:"peer_id"`
		State   string   `json:"state"`
		Addrs   []string `json:"addrs"`
		HasFile bool     `json:"has_file"`
	} `json:"nodes"`
	Local *struct {
		Start       int    `json:"start"`
		End         int    `json:"end"`
		WeightBytes uint64 `json:"weight_bytes"`
		SliceBytes  int64  `json:"slice_bytes"`
		Fetched     uint64 `json:"fetched_bytes"`
	} `json:"local"`
	Events []struct {
		Time time.Time `json:"time"`
		Kind string    `json:"kind"`
		Text string    `json:"text"`
	} `json:"events"`
}

type planStage struct {
	Node  string `json:"node"`
	Start int    `json:"start"`
	End   int    `json:"end"`
}

func (n *meshNode) status(ctx context.Context) (status, error) {
	var st status
	ctx, cancel := context.WithTimeout(ctx, 5*time.Second)
	defer cancel()
	resp, err := n.request(ctx, http.MethodGet, "/api/status", nil)
	if err != nil {
		return st, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return st, fmt.Errorf("/api/status: %s", resp.Status)
	}
	return st, json.NewDecoder(resp.Body).Decode(&st)
}

// lastEvent is the time of the newest event of a kind (zero if none).
func (st status) lastEvent(kind string) time.Time {
	var last time.Time
	for _, ev := range st.Events {
		if ev.Kind == kind && ev.Time.After(last) {
			last = ev.Time
		}
	}
	return last
}

// stageOf is the plan's stage of a peer.
func (st status) stageOf(peer string) (planStage, bool) {
	for _, s := range st.Plan {
		if s.Node == peer {
			return s, true
		}
	}
	return planStage{}, false
}

func describePlan(p []planStage) string {
	var parts []string
	for _, s := range p {
		parts = append(parts, fmt.Sprintf("%s [%d,%d)", short(s.Node), s.Start, s.End))
	}
	return "[" + strings.Join(parts, " → ") + "]"
}

func short(peer string) string {
	if len(peer) > 6 {
		return peer[len(peer)-6:]
	}
	return peer
}

// settled says why a node's view is not yet a served plan of exactly the
// given peers, or nil: the plan covers [0,layers) contiguously with one
// stage per peer, the node can serve requests, and its pipeline was built
// after the plan was made (ready alone may still describe the pipeline
// of the previous plan for a moment).
func settled(st status, layers int, peers []string) error {
	if len(st.Plan) != len(peers) {
		return fmt.Errorf("plan %s has %d stages, want %d", describePlan(st.Plan), len(st.Plan), len(peers))
	}
	next := 0
	for _, s := range st.Plan {
		if s.Start != next || s.End <= s.Start {
			return fmt.Errorf("plan %s is not contiguous", describePlan(st.Plan))
		}
		next = s.End
	}
	if next != layers {
		return fmt.Errorf("plan %s does not cover [0,%d)", describePlan(st.Plan), layers)
	}
	for _, p := range peers {
		if _, ok := st.stageOf(p); !ok {
			return fmt.Errorf("plan %s has no stage on %s", describePlan(st.Plan), short(p))
		}
	}
	if !st.Ready {
		return errors.New("not ready")
	}
	if plan, pipe := st.lastEvent("plan"), st.lastEvent("pipeline"); pipe.Before(plan) {
		return fmt.Errorf("pipeline (%s) older than the plan (%s)", pipe.Format(time.StampMilli), plan.Format(time.StampMilli))
	}
	return nil
}

// waitSettled waits until every node serves one and the same plan of
// exactly their peers, and returns each node's status.
func waitSettled(t *testing.T, model *testModel, nodes []*meshNode, timeout time.Duration) []status {
	t.Helper()
	sts, err := awaitSettled(model, nodes, timeout)
	if err != nil {
		t.Fatal(err)
	}
	return sts
}

func awaitSettled(model *testModel, nodes []*meshNode, timeout time.Duration) ([]status, error) {
	var peers []string
	for _, n := range nodes {
		peers = append(peers, n.peer)
	}
	deadline := time.Now().Add(timeout)
	var why error
	for {
		sts := make([]status, len(nodes))
		why = nil
		for i, n := range nodes {
			st, err := n.status(context.Background())
			if err == nil {
				err = settled(st, model.layers, peers)
			}
			if err == nil && i > 0 && !slices.Equal(st.Plan, sts[0].Plan) {
				err = fmt.Errorf("plan %s, but %s has %s", describePlan(st.Plan), nodes[0].name, describePlan(sts[0].Plan))
			}
			if err != nil {
				why = fmt.Errorf("%s: %w", n.name, err)
				break
			}
			sts[i] = st
		}
		if why == nil {
			return sts, nil
		}
		if time.Now().After(deadline) {
			return nil, fmt.Errorf("no settled plan of %d nodes within %s: %w", len(nodes), timeout, why)
		}
		time.Sleep(100 * time.Millisecond)
	}
}

// generation is a completion as the API returns it.
type generation struct {
	text   string
	finish string
	tokens int // usage.completion_tokens
}

// complete asks a node for a greedy completion.
func complete(n *meshNode, model, prompt string, maxTokens int) (generation, error) {
	body, _ := json.Marshal(map[string]any{"model": model, "prompt": prompt, "max_tokens": maxTokens, "temperature": 0})
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	resp, err := n.request(ctx, http.MethodPost, "/v1/completions", body)
	if err != nil {
		return generation{}, err
	}
	defer resp.Body.Close()
	data, err := io.ReadAll(resp.Body)
	if err != nil {
		return generation{}, err
	}
	if resp.StatusCode != http.StatusOK {
		return generation{}, fmt.Errorf("%s: %s", resp.Status, data)
	}
	var r struct {
		Model   string `json:"model"`
		Choices []struct {
			Text         string `json:"text"`
			FinishReason string `json:"finish_reason"`
		} `json:"choices"`
		Usage struct {
			CompletionTokens int `json:"completion_tokens"`
		} `json:"usage"`
	}
	if err := json.Unmarshal(data, &r); err != nil {
		return generation{}, fmt.Errorf("%v: %s", err, data)
	}
	if len(r.Choices) != 1 || r.Model != model {
		return generation{}, fmt.Errorf("unexpected response %s", data)
	}
	return generation{text: r.Choices[0].Text, finish: r.Choices[0].FinishReason, tokens: r.Usage.CompletionTokens}, nil
}

// checkGreedy: a greedy completion through node n is the reference's.
// The API returns text, not ids; equal text, equal token count and equal
// finish reason leave no room for a different token sequence in practice
// (a single wrong token changes the rest of a greedy generation). JSON
// strings cannot carry invalid UTF-8, which a random model's byte tokens
// produce: the API sends U+FFFD for each such byte, and so does the
// comparison.
func checkGreedy(t *testing.T, n *meshNode, model *testModel) {
	t.Helper()
	want := model.greedy(t, storyPrompt, genTokens)
	got, err := complete(n, model.id, storyPrompt, genTokens)
	if err != nil {
		t.Errorf("completion through %s: %v", n.name, err)
		return
	}
	if got.text != string([]rune(want.text)) || got.tokens != len(want.ids) || got.finish != want.finish {
		t.Errorf("completion through %s:\n got %q (%d tokens, %s)\nwant %q (%d tokens, %s)",
			n.name, got.text, got.tokens, got.finish, want.text, len(want.ids), want.finish)
	}
}

// ---- meshes of processes on loopback ----

// testMesh is a mesh of node processes on 127.0.0.1.
type testMesh struct {
	model *testModel
	wire  string
	extra []string // more flags for every node
	nodes []*meshNode
	join  string // node 1's libp2p address, as its join command prints it
	key   string // the mesh key, likewise
}

var (
	joinRE  = regexp.MustCompile(`meshnode join (\S+) --mesh-key (mk1_[A-Za-z0-9_-]+)`)
	readyRE = regexp.MustCompile(`meshnode is serving on (http://\S+)/v1`)
)

// nodeArgs are the flags every node of these tests gets: loopback only,
// any free ports, one compute thread (the machine is small and shared;
// ggml's workers busy-wait).
func nodeArgs(dataDir, wire string, extra ...string) []string {
	return append([]string{
		"--data-dir", dataDir, "--http", "127.0.0.1:0", "--listen", "/ip4/127.0.0.1/tcp/0",
		"--gossip-port", "-1", "--threads", "1", "--wire-dtype", wire,
	}, extra...)
}

// startMesh starts node1 (serve --split, the only one with the model
// file) and n-1 joiners, and waits until all of them serve a plan with a
// stage on each.
func startMesh(t *testing.T, model *testModel, n int, wire string, extra ...string) *testMesh {
	t.Helper()
	m := &testMesh{model: model, wire: wire, extra: extra}
	dir := t.TempDir()
	args := append([]string{"serve", "--split", "--model", model.path, "--ctx", fmt.Sprint(ctxLen)}, nodeArgs(filepath.Join(dir, "node1"), wire, extra...)...)
	first := &meshNode{name: "node1", dataDir: filepath.Join(dir, "node1")}
	first.proc = startProc(t, "node1", binPath, args...)
	jm := first.proc.waitLine(t, joinRE, formTimeout)
	m.join, m.key = jm[1], jm[2]
	m.nodes = append(m.nodes, first)
	for i := 2; i <= n; i++ {
		m.nodes = append(m.nodes, m.startJoiner(t, fmt.Sprintf("node%d", i)))
	}
	// A joiner is ready only once the whole plan is served, so all are
	// started before any is waited for.
	for _, nd := range m.nodes {
		m.waitReady(t, nd)
	}
	waitSettled(t, model, m.nodes, formTimeout)
	return m
}

// startJoiner starts `meshnode join` with node 1's printed command.
func (m *testMesh) startJoiner(t *testing.T, name string) *meshNode {
	t.Helper()
	nd := &meshNode{name: name, dataDir: filepath.Join(t.TempDir(), name)}
	args := append([]string{"join", m.join, "--mesh-key", m.key}, nodeArgs(nd.dataDir, m.wire, m.extra...)...)
	nd.proc = startProc(t, name, binPath, args...)
	return nd
}

// waitReady waits for the node's "serving" line and learns its peer ID.
func (m *testMesh) waitReady(t *testing.T, nd *meshNode) {
	t.Helper()
	nd.url = nd.proc.waitLine(t, readyRE, formTimeout)[1]
	st, err := nd.status(context.Background())
	if err != nil {
		t.Fatalf("%s: %v", nd.name, err)
	}
	nd.peer = st.Self
}
