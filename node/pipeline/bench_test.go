package pipeline

import (
	"context"
	"fmt"
	"net"
	"os"
	"sync"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/credentials/insecure"

	"github.com/meshnode/meshnode/ggufstage"
	"github.com/meshnode/meshnode/node/host"
	"github.com/meshnode/meshnode/node/wire"
	meshnodev1 "github.com/meshnode/meshnode/proto/meshnode/v1"
	"github.com/meshnode/meshnode/stage"
)

// The sequence, prompt length and last position of BenchmarkDecodeStep.
const benchSeq, benchPrompt, benchMaxPos = 1, 8, 200

// BenchmarkDecodeStep measures one decode step of one sequence on
// stories260K, whose layers cost microseconds, so what it reports is the
// pipeline's own cost per step: framing, gRPC, goroutine hand-offs. The
// "engine" case is the reference: the same step on one in-process engine.
func BenchmarkDecodeStep(b *testing.B) {
	const seq, promptLen = benchSeq, benchPrompt
	prompt := make([]int32, promptLen)
	for i := range prompt {
		prompt[i] = int32(1 + i)
	}
	prefill := &stage.Batch{Outputs: []int{promptLen - 1}}
	for i, t := range prompt {
		prefill.Seqs, prefill.Pos, prefill.Tokens = append(prefill.Seqs, seq), append(prefill.Pos, int32(i)), append(prefill.Tokens, t)
	}

	b.Run("engine", func(b *testing.B) {
		e := openEngines(b, []int{0, 5}, engineOpts)[0]
		if err := e.Open(seq); err != nil {
			b.Fatal(err)
		}
		fwd := engineForward(nil, e)
		toks, _, err := fwd(prefill)
		if err != nil {
			b.Fatal(err)
		}
		decodeLoop(b, toks[0], func(b *stage.Batch) ([]int32, error) {
			toks, _, err := fwd(b)
			return toks, err
		}, func() error { return e.Trim(seq, promptLen) })
	})
	instant := stageOpts{wrap: func(e stage.Engine) stage.Engine { return instantEngine{Engine: e, bufs: &zeroBufs{}} }}
	for _, tc := range []struct {
		name   string
		bounds []int
		opts   []stageOpts
		inproc bool // hop 0 in process, as a node reaches its own stage
	}{
		{"1stage", []int{0, 5}, nil, false},
		{"2stages", []int{0, 2, 5}, nil, false},
		{"3stages", []int{0, 1, 3, 5}, nil, false},
		// The pipeline alone: stages that answer at once.
		{"2stages-instant", []int{0, 2, 5}, []stageOpts{instant, instant}, false},
		{"2stages-instant-inproc", []int{0, 2, 5}, []stageOpts{instant, instant}, true},
	} {
		b.Run(tc.name, func(b *testing.B) {
			m := newMesh(b, tc.bounds, engineOpts, tc.opts...)
			var cfg Config
			if tc.inproc {
				cfg.Dial = m.dialHop0InProcess()
			}
			p := m.pipeline(b, cfg)
			if err := p.Open(seq, greedy(), prompt); err != nil {
				b.Fatal(err)
			}
			picked, err := p.Forward(context.Background(), prefill)
			if err != nil {
				b.Fatal(err)
			}
			decodeLoop(b, picked.Tokens[0], func(b *stage.Batch) ([]int32, error) {
				picked, err := p.Forward(context.Background(), b)
				return picked.Tokens, err
			}, func() error { return p.Trim(seq, promptLen) })
		})
	}
}

// decodeLoop times b.N greedy decode steps of one sequence from the token
// after its prompt, trimming back to the prompt before the context ends.
func decodeLoop(b *testing.B, tok int32, step func(*stage.Batch) ([]int32, error), trim func() error) {
	pos := int32(benchPrompt)
	b.ResetTimer()
	for range b.N {
		if pos == benchMaxPos {
			if err := trim(); err != nil {
				b.Fatal(err)
			}
			pos = benchPrompt
		}
		toks, err := step(&stage.Batch{Seqs: []stage.SeqID{benchSeq}, Pos: []int32{pos}, Tokens: []int32{tok}, Outputs: []int{0}})
		if err != nil {
			b.Fatal(err)
		}
		tok = toks[0]
		pos++
	}
}

// instantEngine answers every pass at once with zeros (hidden state) or
// logits that pick token 1, so that a benchmark measures the pipeline
// without the engine's compute. With embd set, its hidden state is that
// wide (an 8B model's stages send each other n_embd 4096); with picks set,
// it answers a batch that asks only for greedy picks with them (token 1),
// as a GPU stage does. Its hidden states are lent from buffers it reuses,
// as ggufstage's are (Output.Free).
type instantEngine struct {
	stage.Engine
	embd  int // 0: the engine's
	picks bool
	bufs  *zeroBufs
	// compute, if set, is how long each pass spins before it answers, as
	// a GPU stage's host thread spins while its kernels run.
	compute time.Duration
}

// zeroBufs lends zeroed hidden-state buffers, as an engine's pool does.
type zeroBufs struct {
	mu   sync.Mutex
	free [][]float32
}

func (z *zeroBufs) get(n int) ([]float32, func()) {
	z.mu.Lock()
	defer z.mu.Unlock()
	var buf []float32
	if k := len(z.free); k > 0 && cap(z.free[k-1]) >= n {
		buf, z.free = z.free[k-1][:n], z.free[:k-1]
	} else {
		buf = make([]float32, n)
	}
	return buf, func() {
		z.mu.Lock()
		defer z.mu.Unlock()
		z.free = append(z.free, buf)
	}
}

func (e instantEngine) Info() stage.Info {
	info := e.Engine.Info()
	if e.embd > 0 {
		info.Embd = e.embd
	}
	return info
}

func (e instantEngine) Forward(_ context.Context, b *stage.Batch) (*stage.Output, error) {
	for start := time.Now(); time.Since(start) < e.compute; {
	}
	info := e.Info()
	if !info.Last() {
		if e.bufs == nil {
			h, err := stage.NewActivation(stage.F32, b.Rows(), info.Embd, make([]float32, b.Rows()*info.Embd))
			return &stage.Output{Hidden: h}, err
		}
		f, free := e.bufs.get(b.Rows() * info.Embd)
		h, err := stage.SharedActivation(b.Rows(), info.Embd, f)
		return &stage.Output{Hidden: h, Free: free}, err
	}
	if e.picks && b.PicksOnly {
		picks := make([]int32, len(b.Outputs))
		for i := range picks {
			picks[i] = 1
		}
		return &stage.Output{Picks: picks}, nil
	}
	logits := make([]float32, len(b.Outputs)*info.Vocab)
	for i := range b.Outputs {
		logits[i*info.Vocab+1] = 1
	}
	return &stage.Output{Logits: logits}, nil
}

// BenchmarkWideStep measures a pipeline's own cost per decode step with
// the hidden state of an 8B model (n_embd 4096, f32 on the wire: 16 KiB a
// row), for one row and for a 16-row micro-batch, through two stages that
// answer at once, hop 0 in process as on a node: over loopback TCP, and
// over libp2p between two hosts of one mesh (the mesh's transport: its
// link cipher, TLS and yamux), and between the same two hosts over the
// second's local socket (socket streams, as nodes of one machine use).
// Greedy sampling, so the last stage returns picks.
func BenchmarkWideStep(b *testing.B) {
	for _, tc := range []struct {
		via     string
		rows    int
		compute time.Duration
	}{
		{via: "tcp", rows: 1}, {via: "tcp", rows: 16}, {via: "libp2p", rows: 1}, {via: "libp2p", rows: 16},
		{via: "local", rows: 1}, {via: "local", rows: 16},
		// Stages that take about as long as an 8B model's halves on an
		// H200, their host threads spinning as CUDA's do.
		{via: "local", rows: 1, compute: 900 * time.Microsecond},
		{via: "local", rows: 8, compute: 1600 * time.Microsecond},
	} {
		via, rows := tc.via, tc.rows
		name := fmt.Sprintf("%s/rows=%d", via, rows)
		if tc.compute > 0 {
			name += fmt.Sprintf("/compute=%v", tc.compute)
		}
		{
			b.Run(name, func(b *testing.B) {
				var p *Pipeline
				if via == "tcp" {
					wide := stageOpts{wrap: func(e stage.Engine) stage.Engine {
						return instantEngine{Engine: e, embd: 4096, picks: true, bufs: &zeroBufs{}}
					}, maxSeqs: 16}
					m := newMesh(b, []int{0, 2, 5}, engineOpts, wide, wide)
					p = m.pipeline(b, Config{Dial: m.dialHop0InProcess(), WireDType: stage.F32})
				} else {
					p = libp2pPipeline(b, 4096, via == "local", tc.compute)
				}
				step := &stage.Batch{}
				for r := range rows {
					seq := stage.SeqID(r + 1)
					if err := p.Open(seq, greedy(), []int32{1}); err != nil {
						b.Fatal(err)
					}
					step.Seqs = append(step.Seqs, seq)
					step.Pos = append(step.Pos, 0)
					step.Tokens = append(step.Tokens, 1)
					step.Outputs = append(step.Outputs, r)
				}
				b.SetBytes(int64(rows * 4096 * 4))
				b.ResetTimer()
				for i := range b.N {
					for r := range step.Pos {
						step.Pos[r] = int32(i % 200)
					}
					if _, err := p.Forward(context.Background(), step); err != nil {
						b.Fatal(err)
					}
				}
			})
		}
	}
}

// libp2pPipeline is a two-stage pipeline of wide instantEngines on two libp2p
// hosts of one mesh, as two nodes run it: stage 0 and the origin share the
// first host (hop 0 in process), stage 1 is served by the second; with
// local, its streams go over the second host's local socket.
func libp2pPipeline(b *testing.B, embd int, local bool, compute time.Duration) *Pipeline {
	const proto = "/meshnode/bench-stage/1"
	key, err := host.GenerateMeshKey()
	if err != nil {
		b.Fatal(err)
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	hosts := make([]*host.Host, 2)
	for i := range hosts {
		if hosts[i], err = host.New(ctx, host.Config{DataDir: b.TempDir(), Listen: []string{"/ip4/127.0.0.1/tcp/0"}, MeshKey: key, BusyPoll: benchBusyPoll}); err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { hosts[i].Close() })
	}
	if _, err := hosts[0].Connect(ctx, hosts[1].Addrs()[0].String()); err != nil {
		b.Fatal(err)
	}
	conns := NewConns(grpc.WithContextDialer(hosts[0].GRPCDialer(proto)), grpc.WithTransportCredentials(insecure.NewCredentials()))
	b.Cleanup(func() { conns.Close() })
	engines := openEngines(b, []int{0, 2, 5}, ggufstage.Options{Threads: 1, MaxSeqs: 16, Context: 256})
	self := hosts[0].ID().String()
	var first *Server
	sockPath := ""
	dial := func(ctx context.Context, peer string) (grpc.ClientConnInterface, error) {
		if peer == self {
			return InProcess(first), nil
		}
		cc, err := conns.Dial(ctx, "passthrough:///"+peer)
		if err != nil || sockPath == "" {
			return cc, err
		}
		return OverSockets(SocketConfig{Other: cc, Dial: func(ctx context.Context) (net.Conn, error) {
			return hosts[0].DialLocal(ctx, sockPath, hosts[1].ID())
		}}), nil
	}
	srvs := make([]*Server, 2)
	for i, e := range engines {
		if srvs[i], err = NewServer(ServerConfig{Engine: instantEngine{Engine: serialEngine{e}, embd: embd, picks: true, bufs: &zeroBufs{}, compute: compute}, Dial: dial, ModelID: "stories260K", ModelHash: "test-hash"}); err != nil {
			b.Fatal(err)
		}
		b.Cleanup(func() { srvs[i].Close() })
	}
	first = srvs[0]
	gs := grpc.NewServer(wire.ServerOptions()...)
	meshnodev1.RegisterStageServiceServer(gs, srvs[1])
	go gs.Serve(hosts[1].Listen(proto))
	b.Cleanup(gs.Stop)
	if local {
		ln, err := hosts[1].ListenLocal()
		if err != nil {
			b.Fatal(err)
		}
		ss := NewSocketServer(srvs[1], SocketServerConfig{})
		go ss.Serve(ln)
		b.Cleanup(ss.Stop)
		sockPath = ln.Path()
	}
	p, err := New(ctx, Config{Dial: dial, WireDType: stage.F32, StepTimeout: 10 * time.Second, Route: []Hop{
		{Peer: self, Start: 0, End: 2}, {Peer: hosts[1].ID().String(), Start: 2, End: 5},
	}})
	if err != nil {
		b.Fatal(err)
	}
	b.Cleanup(func() { p.Close() })
	return p
}

// benchBusyPoll is the busy-poll window of libp2pPipeline's hosts
// (host.Config.BusyPoll), from MESHNODE_BENCH_BUSY_POLL (e.g. 25ms, as GPU
// nodes poll by default); none when unset.
var benchBusyPoll time.Duration

func init() {
	if d, err := time.ParseDuration(os.Getenv("MESHNODE_BENCH_BUSY_POLL")); err == nil {
		benchBusyPoll = d
	}
}
