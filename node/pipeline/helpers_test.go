package pipeline

import (
	"context"
	"errors"
	"fmt"
	"math"
	"net"
	"os"
	"path/filepath"
	"sync"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/meshnode/meshnode/ggufstage"
	"github.com/meshnode/meshnode/node/sample"
	"github.com/meshnode/meshnode/node/wire"
	meshnodev1 "github.com/meshnode/meshnode/proto/meshnode/v1"
	"github.com/meshnode/meshnode/stage"
	"github.com/meshnode/meshnode/stage/stagetest"
)

const storiesPath = "../../../shared/models/stories260K.gguf"

// engineOpts keeps the engines small and single-threaded: the test
// machine's cores are shared.
var engineOpts = ggufstage.Options{Threads: 1, MaxSeqs: 4, Context: 256}

// openEngines slices the model at bounds and opens one engine per range,
// with opts and, where given, each stage's changes to them.
func openEngines(t testing.TB, bounds []int, opts ggufstage.Options, so ...stageOpts) []*ggufstage.Engine {
	t.Helper()
	dir := t.TempDir()
	var es []*ggufstage.Engine
	for i := 0; i+1 < len(bounds); i++ {
		opts := opts
		if i < len(so) && so[i].maxSeqs > 0 {
			opts.MaxSeqs = so[i].maxSeqs
		}
		path, err := ggufstage.Slice(storiesPath, dir, bounds[i], bounds[i+1], nil)
		if err != nil {
			t.Fatal(err)
		}
		e, err := ggufstage.Open(path, bounds[i], bounds[i+1], opts)
		if err != nil {
			t.Fatal(err)
		}
		t.Cleanup(func() { e.Close() })
		es = append(es, e)
	}
	return es
}

// killSwitch tracks every socket of one stage, accepted or dialed, so that
// a test can cut them all at once, as the death of the stage's process
// would. grpc.Server.Stop alone leaves the stage's own client connections
// to the next hop up.
type killSwitch struct {
	mu    sync.Mutex
	dead  atomic.Bool
	conns []net.Conn
}

var errKilled = errors.New("stage killed")

func (k *killSwitch) track(c net.Conn) (net.Conn, error) {
	k.mu.Lock()
	defer k.mu.Unlock()
	if k.dead.Load() {
		c.Close()
		return nil, errKilled
	}
	k.conns = append(k.conns, c)
	return killConn{c, k}, nil
}

// kill cuts every connection of the stage. As with a process that dies,
// nothing more leaves it: closing the connections one by one would let
// the stage react to the first ones closed (its upstream, say) by telling
// the others.
func (k *killSwitch) kill() {
	k.mu.Lock()
	defer k.mu.Unlock()
	k.dead.Store(true)
	for _, c := range k.conns {
		c.Close()
	}
}

// killConn is a connection that a killed stage can no longer write to.
type killConn struct {
	net.Conn
	k *killSwitch
}

func (c killConn) Write(b []byte) (int, error) {
	if c.k.dead.Load() {
		return 0, errKilled
	}
	return c.Conn.Write(b)
}

type killListener struct {
	net.Listener
	k *killSwitch
}

func (l killListener) Accept() (net.Conn, error) {
	for {
		c, err := l.Listener.Accept()
		if err != nil {
			return nil, err
		}
		if c, err := l.k.track(c); err == nil {
			return c, nil
		}
	}
}

// processCompute serializes every engine call of the test process.
// ollama's ggml backend keeps one CPU backend for the whole process
// (ml/backend/ggml: the package-level backends map), and its compute
// scratch is not safe for two graphs at once, so engines in one process
// that compute concurrently corrupt each other's results. In a mesh each
// node runs one stage; here all of them share a process.
var processCompute sync.Mutex

type serialEngine struct{ stage.Engine }

func (e serialEngine) Forward(ctx context.Context, b *stage.Batch) (*stage.Output, error) {
	processCompute.Lock()
	defer processCompute.Unlock()
	return e.Engine.Forward(ctx, b)
}

func (e serialEngine) Open(q stage.SeqID) error {
	processCompute.Lock()
	defer processCompute.Unlock()
	return e.Engine.Open(q)
}

func (e serialEngine) Trim(q stage.SeqID, pos int32) error {
	processCompute.Lock()
	defer processCompute.Unlock()
	return e.Engine.Trim(q, pos)
}

func (e serialEngine) Release(q stage.SeqID) error {
	processCompute.Lock()
	defer processCompute.Unlock()
	return e.Engine.Release(q)
}

// stageOpts vary a test stage.
type stageOpts struct {
	maxFrame     int           // advertised and enforced on receive; 0 = default
	setupTimeout time.Duration // 0 = 5 s
	wrap         func(stage.Engine) stage.Engine
	maxSeqs      int                           // overrides the engine options' when > 0
	vocab        func() (*sample.Vocab, error) // for JSON output, on the last stage
	sockets      *socketRoutes                 // the stage dials its next hop over socket streams
	handoff      bool                          // ServerConfig.DeviceHandoff
}

// socketRoutes maps each test stage's address to its socket server's Unix
// socket, for Dialers that carry Forward streams over socket streams.
type socketRoutes struct {
	mu    sync.Mutex
	paths map[string]string
}

func (r *socketRoutes) add(addr, path string) {
	r.mu.Lock()
	defer r.mu.Unlock()
	if r.paths == nil {
		r.paths = map[string]string{}
	}
	r.paths[addr] = path
}

// dialer returns a Dialer whose Forward streams to a stage go over socket
// streams (tracked by kill, when set), its other calls through grpcDial.
func (r *socketRoutes) dialer(grpcDial Dialer, kill *killSwitch) Dialer {
	return func(ctx context.Context, addr string) (grpc.ClientConnInterface, error) {
		r.mu.Lock()
		path, ok := r.paths[addr]
		r.mu.Unlock()
		if !ok {
			return nil, fmt.Errorf("no socket for %s", addr)
		}
		other, err := grpcDial(ctx, addr)
		if err != nil {
			return nil, err
		}
		return OverSockets(SocketConfig{Other: other, Dial: func(ctx context.Context) (net.Conn, error) {
			c, err := (&net.Dialer{}).DialContext(ctx, "unix", path)
			if err != nil || kill == nil {
				return c, err
			}
			return kill.track(c)
		}}), nil
	}
}

// testStage is one stage served on loopback TCP by its own grpc.Server.
type testStage struct {
	addr string
	sock string // the socket server's Unix socket
	gs   *grpc.Server
	ss   *SocketServer
	// sockBytes counts the bytes of its socket streams, both ways.
	sockBytes atomic.Int64
	srv       *Server
	conns     *Conns
	kill      *killSwitch

	mu  sync.Mutex
	bad []string // OnBadPeer reports
}

func (s *testStage) badReports() []string {
	s.mu.Lock()
	defer s.mu.Unlock()
	return append([]string(nil), s.bad...)
}

func startStage(t testing.TB, e stage.Engine, o stageOpts) *testStage {
	t.Helper()
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		t.Fatal(err)
	}
	ts := &testStage{addr: ln.Addr().String(), kill: &killSwitch{}}
	ts.conns = NewConns(grpc.WithTransportCredentials(insecure.NewCredentials()),
		grpc.WithContextDialer(func(ctx context.Context, addr string) (net.Conn, error) {
			c, err := (&net.Dialer{}).DialContext(ctx, "tcp", addr)
			if err != nil {
				return nil, err
			}
			return ts.kill.track(c)
		}))
	if o.setupTimeout == 0 {
		o.setupTimeout = 5 * time.Second
	}
	e = serialEngine{e}
	if o.wrap != nil {
		e = o.wrap(e)
	}
	dial := ts.conns.Dial
	if o.sockets != nil {
		dial = o.sockets.dialer(ts.conns.Dial, ts.kill)
	}
	ts.srv, err = NewServer(ServerConfig{
		Engine: e, Dial: dial, ModelID: "stories260K", ModelHash: "test-hash",
		MaxFrameBytes: o.maxFrame, SetupTimeout: o.setupTimeout, Vocab: o.vocab, DeviceHandoff: o.handoff,
		OnBadPeer: func(peer string, err error) {
			ts.mu.Lock()
			defer ts.mu.Unlock()
			ts.bad = append(ts.bad, fmt.Sprintf("%s: %v", peer, err))
		},
	})
	if err != nil {
		t.Fatal(err)
	}
	opts := wire.ServerOptions()
	if o.maxFrame > 0 {
		opts = append(opts, grpc.MaxRecvMsgSize(o.maxFrame))
	}
	ts.gs = grpc.NewServer(opts...)
	meshnodev1.RegisterStageServiceServer(ts.gs, ts.srv)
	served := make(chan struct{})
	go func() {
		defer close(served)
		_ = ts.gs.Serve(killListener{ln, ts.kill})
	}()
	// The same server's streams over socket streams on a Unix socket.
	dir, err := os.MkdirTemp("", "mn") // short: a socket's path has at most 104-108 bytes
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { os.RemoveAll(dir) })
	ts.sock = filepath.Join(dir, "stage.sock")
	sln, err := net.Listen("unix", ts.sock)
	if err != nil {
		t.Fatal(err)
	}
	ts.ss = NewSocketServer(ts.srv, SocketServerConfig{MaxRecvBytes: o.maxFrame,
		Count: func(_, _ string, n int) { ts.sockBytes.Add(int64(n)) }})
	sserved := make(chan struct{})
	go func() {
		defer close(sserved)
		_ = ts.ss.Serve(killListener{sln, ts.kill})
	}()
	if o.sockets != nil {
		o.sockets.add(ts.addr, ts.sock)
	}
	t.Cleanup(func() {
		ts.ss.Stop()
		<-sserved
		ts.gs.Stop()
		<-served
		ts.srv.Close()
		ts.conns.Close()
	})
	return ts
}

// mesh is a route of test stages and an origin's connections to them.
type mesh struct {
	stages  []*testStage
	route   []Hop
	conns   *Conns
	sockets *socketRoutes // newSocketMesh's
}

// newSocketMesh is newMesh whose stages reach their next hops over socket
// streams; m.dialSockets does the same for the origin.
func newSocketMesh(t testing.TB, bounds []int, eo ggufstage.Options, so ...stageOpts) *mesh {
	t.Helper()
	routes := &socketRoutes{}
	all := make([]stageOpts, len(bounds)-1)
	copy(all, so)
	for i := range all {
		all[i].sockets = routes
	}
	m := newMesh(t, bounds, eo, all...)
	m.sockets = routes
	return m
}

// dialSockets is the origin's Dialer of a newSocketMesh.
func (m *mesh) dialSockets() Dialer { return m.sockets.dialer(m.conns.Dial, nil) }

func newMesh(t testing.TB, bounds []int, eo ggufstage.Options, so ...stageOpts) *mesh {
	t.Helper()
	m := &mesh{conns: NewConns(grpc.WithTransportCredentials(insecure.NewCredentials()))}
	t.Cleanup(func() { m.conns.Close() })
	for i, e := range openEngines(t, bounds, eo, so...) {
		var o stageOpts
		if i < len(so) {
			o = so[i]
		}
		s := startStage(t, e, o)
		m.stages = append(m.stages, s)
		m.route = append(m.route, Hop{Peer: s.addr, Start: bounds[i], End: bounds[i+1]})
	}
	return m
}

// dialHop0InProcess is a Dialer that reaches hop 0 in process, as a node
// reaches its own stage, and the other hops over TCP.
func (m *mesh) dialHop0InProcess() Dialer {
	local := InProcess(m.stages[0].srv)
	return func(ctx context.Context, peer string) (grpc.ClientConnInterface, error) {
		if peer == m.stages[0].addr {
			return local, nil
		}
		return m.conns.Dial(ctx, peer)
	}
}

func (m *mesh) pipeline(t testing.TB, cfg Config) *Pipeline {
	t.Helper()
	cfg.Route = m.route
	if cfg.Dial == nil {
		cfg.Dial = m.conns.Dial
	}
	if cfg.StepTimeout == 0 {
		cfg.StepTimeout = 10 * time.Second
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	p, err := New(ctx, cfg)
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { p.Close() })
	return p
}

func greedy() sample.Params {
	p := sample.DefaultParams()
	p.Temperature = 0
	return p
}

func maxAbsDiff(a, b []float32) float64 {
	if len(a) != len(b) {
		return math.Inf(1)
	}
	var d float64
	for i := range a {
		d = max(d, math.Abs(float64(a[i]-b[i])))
	}
	return d
}

// scenario is sequences that prefill together in one batch and then decode
// together, one token each per step.
type scenario struct {
	seqs    []stage.SeqID
	prompts [][]int32
	steps   int
}

var twoSeqs = scenario{
	seqs:    []stage.SeqID{1, 2},
	prompts: [][]int32{{1, 403, 407, 261, 378, 300, 58}, {1, 334, 280, 428}},
	steps:   32,
}

// trace is what a run produced: per step, the token of each sequence and
// (when known) the logits rows.
type trace struct {
	tokens [][]int32
	logits [][]float32
}

// forwardFunc runs a batch and returns a token per output row and, when
// available, the logits.
type forwardFunc func(b *stage.Batch) ([]int32, []float32, error)

func (sc scenario) prefill() *stage.Batch {
	b := &stage.Batch{}
	for i, q := range sc.seqs {
		for pos, tok := range sc.prompts[i] {
			b.Seqs, b.Pos, b.Tokens = append(b.Seqs, q), append(b.Pos, int32(pos)), append(b.Tokens, tok)
		}
		b.Outputs = append(b.Outputs, b.Rows()-1)
	}
	return b
}

func (sc scenario) decode(step int, last []int32) *stage.Batch {
	b := &stage.Batch{}
	for i, q := range sc.seqs {
		b.Seqs = append(b.Seqs, q)
		b.Pos = append(b.Pos, int32(len(sc.prompts[i])+step))
		b.Tokens = append(b.Tokens, last[i])
		b.Outputs = append(b.Outputs, i)
	}
	return b
}

func (sc scenario) run(t *testing.T, fwd forwardFunc) trace {
	t.Helper()
	var tr trace
	b := sc.prefill()
	for step := 0; ; step++ {
		toks, logits, err := fwd(b)
		if err != nil {
			t.Fatalf("step %d: %v", step, err)
		}
		tr.tokens = append(tr.tokens, toks)
		tr.logits = append(tr.logits, logits)
		if step == sc.steps {
			return tr
		}
		b = sc.decode(step, toks)
	}
}

// engineForward runs batches on a single engine and samples greedily.
func engineForward(t *testing.T, e stage.Engine) forwardFunc {
	vocab := e.Info().Vocab
	return func(b *stage.Batch) ([]int32, []float32, error) {
		out, err := e.Forward(context.Background(), b)
		if err != nil {
			return nil, nil, err
		}
		toks := make([]int32, len(b.Outputs))
		for i := range toks {
			toks[i] = stagetest.Argmax(out.LogitsRow(i, vocab))
		}
		return toks, out.Logits, nil
	}
}

func pipelineForward(p *Pipeline) forwardFunc {
	return func(b *stage.Batch) ([]int32, []float32, error) {
		c, err := p.Submit(context.Background(), b)
		if err != nil {
			return nil, nil, err
		}
		res, err := c.Result()
		if err != nil {
			return nil, nil, err
		}
		return res.Tokens, res.Logits, nil
	}
}

// referenceTrace runs sc on one engine holding every layer.
func referenceTrace(t *testing.T, sc scenario) trace {
	t.Helper()
	e := openEngines(t, []int{0, 5}, engineOpts)[0]
	for _, q := range sc.seqs {
		if err := e.Open(q); err != nil {
			t.Fatal(err)
		}
	}
	return sc.run(t, engineForward(t, e))
}

func openAll(t *testing.T, p *Pipeline, sc scenario, params func(i int) sample.Params) {
	t.Helper()
	for i, q := range sc.seqs {
		if err := p.Open(q, params(i), sc.prompts[i]); err != nil {
			t.Fatalf("open %d: %v", q, err)
		}
	}
}
