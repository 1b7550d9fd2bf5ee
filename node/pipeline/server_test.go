package pipeline

import (
	"context"
	"errors"
	"fmt"
	"io"
	"slices"
	"strings"
	"sync/atomic"
	"testing"
	"time"

	"google.golang.org/grpc"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/status"

	"github.com/meshnode/meshnode/node/sample"
	"github.com/meshnode/meshnode/node/wire"
	meshnodev1 "github.com/meshnode/meshnode/proto/meshnode/v1"
	"github.com/meshnode/meshnode/stage"
)

// rawPipeline is a hand-driven pipeline to the last stage of m: a fake
// route whose earlier hops do not exist, a return stream and a forward
// stream, with sequence 1 opened.
type rawPipeline struct {
	fwd, ret meshnodev1.StageService_ForwardClient
}

func openRaw(t *testing.T, ctx context.Context, m *mesh, name string) *rawPipeline {
	t.Helper()
	last := len(m.route) - 1
	conn, err := m.dialRaw(ctx, m.route[last].Peer)
	if err != nil {
		t.Fatal(err)
	}
	client := meshnodev1.NewStageServiceClient(conn)
	st := wire.Setup{Role: wire.RoleReturn, PipelineID: name, Origin: "raw", Hop: last, WireDType: stage.F16}
	for i, h := range m.route {
		st.Route = append(st.Route, wire.Hop{Peer: fmt.Sprintf("fake-%d", i), Start: h.Start, End: h.End})
	}
	st.Route[last].Peer = m.route[last].Peer
	r := &rawPipeline{}
	for _, role := range []wire.Role{wire.RoleReturn, wire.RoleForward} {
		s, err := client.Forward(ctx)
		if err != nil {
			t.Fatal(err)
		}
		st.Role = role
		f, err := wire.EncodeSetup(st)
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Send(f); err != nil {
			t.Fatal(err)
		}
		if role == wire.RoleReturn {
			r.ret = s
		} else {
			r.fwd = s
		}
	}
	if f, err := r.ret.Recv(); err != nil || wire.BodyKind(f) != "setup" {
		t.Fatalf("setup acknowledged with %v, %v", f, err)
	}
	open, err := wire.EncodeControl(1, wire.Control{Op: wire.OpOpen, Seq: 1})
	if err != nil {
		t.Fatal(err)
	}
	if err := r.fwd.Send(open); err != nil {
		t.Fatal(err)
	}
	if f, err := r.ret.Recv(); err != nil || wire.BodyKind(f) != "control" {
		t.Fatalf("open acknowledged with %v, %v", f, err)
	}
	return r
}

// goodActivations is a valid step for the last stage of stories260K:
// sequence 1, position 0, one output row.
func goodActivations(t *testing.T, step uint64) *meshnodev1.Frame {
	t.Helper()
	h, err := stage.NewActivation(stage.F16, 1, 64, make([]float32, 64))
	if err != nil {
		t.Fatal(err)
	}
	f, err := wire.EncodeBatch(step, &stage.Batch{Seqs: []stage.SeqID{1}, Pos: []int32{0}, Tokens: []int32{1}, Hidden: h, Outputs: []int{0}}, stage.F16)
	if err != nil {
		t.Fatal(err)
	}
	return f
}

// expectRejected reads the Error frame a stage answers a bad frame with,
// then the end of the stream.
func expectRejected(t *testing.T, s meshnodev1.StageService_ForwardClient, code meshnodev1.Error_Code, grpcCode codes.Code) {
	t.Helper()
	f, err := s.Recv()
	if err != nil {
		t.Fatalf("no error frame: %v", err)
	}
	re, err := wire.DecodeError(f)
	if err != nil {
		t.Fatalf("answer is not an error frame: %v", err)
	}
	if re.Code != code {
		t.Fatalf("error %s (%s), want %s", re.Code, re.Message, code)
	}
	if _, err := s.Recv(); status.Code(err) != grpcCode {
		t.Fatalf("stream ended with %v, want %s", err, grpcCode)
	}
}

func TestBadFrames(t *testing.T) {
	m := newMesh(t, threeStages, engineOpts)
	last := m.stages[len(m.stages)-1]
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	bad := meshnodev1.Error_CODE_BAD_FRAME
	for _, tc := range []struct {
		name string
		edit func(f *meshnodev1.Frame) *meshnodev1.Frame
		code meshnodev1.Error_Code
	}{
		{"wrong shape", func(f *meshnodev1.Frame) *meshnodev1.Frame {
			a := f.GetActivations()
			a.Cols, a.Payload = 32, a.Payload[:64] // consistent, but not n_embd
			return f
		}, bad},
		{"rows without ids", func(f *meshnodev1.Frame) *meshnodev1.Frame {
			a := f.GetActivations()
			a.Rows, a.Payload = 2, append(a.Payload, a.Payload...)
			return f
		}, bad},
		{"payload length", func(f *meshnodev1.Frame) *meshnodev1.Frame {
			a := f.GetActivations()
			a.Payload = a.Payload[:len(a.Payload)-1]
			return f
		}, bad},
		{"unknown dtype", func(f *meshnodev1.Frame) *meshnodev1.Frame { f.GetActivations().Dtype = 9; return f }, bad},
		{"unknown sequence", func(f *meshnodev1.Frame) *meshnodev1.Frame { f.GetActivations().SeqIds = []uint64{42}; return f }, meshnodev1.Error_CODE_UNKNOWN_SEQ},
		{"wrong version", func(f *meshnodev1.Frame) *meshnodev1.Frame { f.Version = 2; return f }, meshnodev1.Error_CODE_UNSUPPORTED_VERSION},
		{"no token ids", func(f *meshnodev1.Frame) *meshnodev1.Frame { f.GetActivations().TokenIds = nil; return f }, bad},
		{"position past context", func(f *meshnodev1.Frame) *meshnodev1.Frame { f.GetActivations().Positions = []int32{256}; return f }, bad},
		{"token ids into a later stage", func(*meshnodev1.Frame) *meshnodev1.Frame {
			f, _ := wire.EncodeTokens(2, &stage.Batch{Seqs: []stage.SeqID{1}, Pos: []int32{0}, Tokens: []int32{1}})
			return f
		}, bad},
		{"second setup", func(*meshnodev1.Frame) *meshnodev1.Frame {
			f, _ := wire.EncodeSetup(wire.Setup{Role: wire.RoleForward, PipelineID: "x", Origin: "o", Route: []wire.Hop{{Peer: "p", Start: 0, End: 5}}, WireDType: stage.F16})
			return f
		}, bad},
		{"logits on a forward stream", func(*meshnodev1.Frame) *meshnodev1.Frame {
			f, _ := wire.EncodeLogits(2, 1, 1, []float32{0})
			return f
		}, bad},
		{"empty body", func(f *meshnodev1.Frame) *meshnodev1.Frame { f.Body = nil; return f }, bad},
		{"trim of an unknown sequence", func(*meshnodev1.Frame) *meshnodev1.Frame {
			f, _ := wire.EncodeControl(2, wire.Control{Op: wire.OpTrim, Seq: 42})
			return f
		}, meshnodev1.Error_CODE_UNKNOWN_SEQ},
		{"split step interrupted", func(f *meshnodev1.Frame) *meshnodev1.Frame {
			f.GetActivations().More = true
			return f // the next frame (a control) breaks it up
		}, bad},
	} {
		t.Run(tc.name, func(t *testing.T) {
			before := len(last.badReports())
			r := openRaw(t, ctx, m, "raw-"+strings.ReplaceAll(tc.name, " ", "-"))
			if err := r.fwd.Send(tc.edit(goodActivations(t, 2))); err != nil {
				t.Fatal(err)
			}
			if tc.name == "split step interrupted" {
				f, _ := wire.EncodeControl(3, wire.Control{Op: wire.OpRelease, Seq: 1})
				if err := r.fwd.Send(f); err != nil {
					t.Fatal(err)
				}
			}
			expectRejected(t, r.fwd, tc.code, codes.InvalidArgument)
			// The origin hears of it too, and the pipeline ends.
			f, err := r.ret.Recv()
			if err != nil || wire.BodyKind(f) != "error" {
				t.Fatalf("return stream got %v, %v", f, err)
			}
			if _, err := r.ret.Recv(); !errors.Is(err, io.EOF) {
				t.Fatalf("return stream ended with %v", err)
			}
			if got := len(last.badReports()); got != before+1 {
				t.Fatalf("%d bad peer reports, want %d", got, before+1)
			}
		})
	}

	t.Run("no setup first", func(t *testing.T) {
		conn, _ := m.conns.Dial(ctx, last.addr)
		s, err := meshnodev1.NewStageServiceClient(conn).Forward(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Send(goodActivations(t, 1)); err != nil {
			t.Fatal(err)
		}
		expectRejected(t, s, bad, codes.InvalidArgument)
	})
	t.Run("setup for other layers", func(t *testing.T) {
		conn, _ := m.conns.Dial(ctx, last.addr)
		s, err := meshnodev1.NewStageServiceClient(conn).Forward(ctx)
		if err != nil {
			t.Fatal(err)
		}
		f, _ := wire.EncodeSetup(wire.Setup{Role: wire.RoleForward, PipelineID: "x", Origin: "o", WireDType: stage.F16,
			Route: []wire.Hop{{Peer: "a", Start: 0, End: 3}, {Peer: "b", Start: 3, End: 5}}, Hop: 1})
		if err := s.Send(f); err != nil {
			t.Fatal(err)
		}
		expectRejected(t, s, bad, codes.InvalidArgument)
	})

	// The stages still serve.
	p := m.pipeline(t, Config{})
	openAll(t, p, twoSeqs, func(int) sample.Params { return greedy() })
	want := referenceTrace(t, scenario{seqs: twoSeqs.seqs, prompts: twoSeqs.prompts, steps: 4})
	got := scenario{seqs: twoSeqs.seqs, prompts: twoSeqs.prompts, steps: 4}.run(t, pipelineForward(p))
	for i := range want.tokens {
		if !slices.Equal(got.tokens[i], want.tokens[i]) {
			t.Fatalf("after the bad frames, step %d: %v, want %v", i, got.tokens[i], want.tokens[i])
		}
	}
}

func TestOversizedMessage(t *testing.T) {
	for _, sockets := range []bool{false, true} {
		name := "grpc"
		if sockets {
			name = "sockets"
		}
		t.Run(name, func(t *testing.T) { oversizedMessage(t, sockets) })
	}
}

func oversizedMessage(t *testing.T, sockets bool) {
	const limit = 64 << 10
	so := []stageOpts{{}, {}, {maxFrame: limit}}
	var m *mesh
	cfg := Config{WireDType: stage.F32}
	if sockets {
		m = newSocketMesh(t, threeStages, engineOpts, so...)
		cfg.Dial = m.dialSockets()
	} else {
		m = newMesh(t, threeStages, engineOpts, so...)
	}
	last := m.stages[2]
	ctx, cancel := context.WithTimeout(context.Background(), time.Minute)
	defer cancel()
	huge, err := wire.EncodeLogits(2, 1, limit/4+16, make([]float32, limit/4+16))
	if err != nil {
		t.Fatal(err)
	}

	t.Run("first frame", func(t *testing.T) {
		conn, _ := m.dialRaw(ctx, last.addr)
		s, err := meshnodev1.NewStageServiceClient(conn).Forward(ctx)
		if err != nil {
			t.Fatal(err)
		}
		if err := s.Send(huge); err != nil {
			t.Fatal(err)
		}
		if _, err := s.Recv(); status.Code(err) != codes.ResourceExhausted {
			t.Fatalf("got %v, want ResourceExhausted", err)
		}
	})
	t.Run("in a pipeline", func(t *testing.T) {
		r := openRaw(t, ctx, m, "raw-huge")
		if err := r.fwd.Send(huge); err != nil {
			t.Fatal(err)
		}
		// gRPC ends the stream itself, before the stage could say more.
		if _, err := r.fwd.Recv(); status.Code(err) != codes.ResourceExhausted {
			t.Fatalf("got %v, want ResourceExhausted", err)
		}
		f, err := r.ret.Recv()
		if err != nil || wire.BodyKind(f) != "error" {
			t.Fatalf("return stream got %v, %v", f, err)
		}
	})
	// The stage reports a bad peer once its stream has failed, which the
	// client may see first: wait for both reports.
	for deadline := time.Now().Add(10 * time.Second); len(last.badReports()) < 2 && time.Now().Before(deadline); {
		time.Sleep(5 * time.Millisecond)
	}
	if len(last.badReports()) != 2 {
		t.Fatalf("bad peer reports: %v", last.badReports())
	}

	// The stage still serves, and pipelines split to fit its limit.
	p := m.pipeline(t, cfg)
	sc := scenario{seqs: []stage.SeqID{1}, prompts: [][]int32{make([]int32, 250)}, steps: 2} // over one 64 KiB frame at f32
	for i := range sc.prompts[0] {
		sc.prompts[0][i] = int32(1 + i%400)
	}
	openAll(t, p, sc, func(int) sample.Params { return greedy() })
	want := referenceTrace(t, sc)
	got := sc.run(t, pipelineForward(p))
	for i := range want.tokens {
		if !slices.Equal(got.tokens[i], want.tokens[i]) {
			t.Fatalf("step %d: %v, want %v", i, got.tokens[i], want.tokens[i])
		}
	}
}

// decodeUntilError runs decode steps of twoSeqs until one fails, calling
// kill after the third, and returns the error and how long it took to
// come after the kill.
func decodeUntilError(t *testing.T, p *Pipeline, kill func()) (time.Duration, error) {
	t.Helper()
	openAll(t, p, twoSeqs, func(int) sample.Params { return greedy() })
	b := twoSeqs.prefill()
	var killed time.Time
	for step := 0; step < 1000; step++ {
		if step == 3 {
			kill()
			killed = time.Now()
		}
		picked, err := p.Forward(context.Background(), b)
		toks := picked.Tokens
		if err != nil {
			if killed.IsZero() {
				t.Fatalf("step %d failed before the kill: %v", step, err)
			}
			return time.Since(killed), err
		}
		b = twoSeqs.decode(step, toks)
	}
	t.Fatal("no error after the kill")
	return 0, nil
}

// A stage whose process dies (every socket of it cut at once) fails the
// step in flight, names the hop, and breaks the pipeline.
func TestStageDies(t *testing.T) {
	for _, sockets := range []bool{false, true} {
		for hop := range 3 {
			name := fmt.Sprintf("hop %d", hop)
			if sockets {
				name += " over sockets"
			}
			t.Run(name, func(t *testing.T) { stageDies(t, hop, sockets) })
		}
	}
}

func stageDies(t *testing.T, hop int, sockets bool) {
	var m *mesh
	cfg := Config{StepTimeout: 5 * time.Second}
	if sockets {
		m = newSocketMesh(t, threeStages, engineOpts)
		cfg.Dial = m.dialSockets()
	} else {
		m = newMesh(t, threeStages, engineOpts)
	}
	p := m.pipeline(t, cfg)
	took, err := decodeUntilError(t, p, m.stages[hop].kill.kill)
	var he *HopError
	if !errors.As(err, &he) || he.Hop != hop || he.Peer != m.route[hop].Peer {
		t.Fatalf("error %v, want one naming hop %d", err, hop)
	}
	if took > 5*time.Second {
		t.Fatalf("error after %s", took)
	}
	if p.Err() == nil {
		t.Fatal("pipeline not broken")
	}
	if _, err := p.Forward(context.Background(), twoSeqs.decode(0, []int32{1, 1})); err == nil {
		t.Fatal("a broken pipeline ran a step")
	}
}

// grpc.Server.Stop mid-run: the origin's Forward fails within the step
// timeout, never hangs.
func TestStageStopped(t *testing.T) {
	for hop := range 3 {
		t.Run(fmt.Sprintf("hop %d", hop), func(t *testing.T) {
			m := newMesh(t, threeStages, engineOpts)
			p := m.pipeline(t, Config{StepTimeout: 5 * time.Second})
			took, err := decodeUntilError(t, p, m.stages[hop].gs.Stop)
			var he *HopError
			if !errors.As(err, &he) || took > 5*time.Second {
				t.Fatalf("error %v after %s", err, took)
			}
			t.Logf("hop %d stopped: %v", hop, err)
		})
	}
}

// gatedEngine blocks Forward while its gate is shut.
type gatedEngine struct {
	stage.Engine
	shut atomic.Bool
	gate chan struct{}
}

func (e *gatedEngine) Forward(ctx context.Context, b *stage.Batch) (*stage.Output, error) {
	if e.shut.Load() {
		<-e.gate
	}
	return e.Engine.Forward(ctx, b)
}

// A stage that stops answering (its engine stuck) breaks the pipeline
// after the step timeout.
func TestStall(t *testing.T) {
	g := &gatedEngine{gate: make(chan struct{})}
	m := newMesh(t, threeStages, engineOpts, stageOpts{}, stageOpts{wrap: func(e stage.Engine) stage.Engine {
		g.Engine = e
		return g
	}})
	defer close(g.gate) // before the stages' cleanup, which waits for the engine call
	const timeout = time.Second
	p := m.pipeline(t, Config{StepTimeout: timeout})
	took, err := decodeUntilError(t, p, func() { g.shut.Store(true) })
	if !errors.Is(err, ErrStalled) || took < timeout || took > timeout+3*time.Second {
		t.Fatalf("error %v after %s", err, took)
	}
}

// Abort breaks a pipeline whose stage is stuck at once: the step in
// flight fails with the reason given, long before the step timeout, and
// Close then returns without the graceful end that the stuck stage would
// hold up for its bounded wait.
func TestAbort(t *testing.T) {
	g := &gatedEngine{gate: make(chan struct{})}
	m := newMesh(t, threeStages, engineOpts, stageOpts{}, stageOpts{wrap: func(e stage.Engine) stage.Engine {
		g.Engine = e
		return g
	}})
	defer close(g.gate) // before the stages' cleanup, which waits for the engine call
	p := m.pipeline(t, Config{StepTimeout: 30 * time.Second})
	gone := errors.New("hop 1's node left the mesh")
	took, err := decodeUntilError(t, p, func() {
		g.shut.Store(true)
		time.AfterFunc(100*time.Millisecond, func() { p.Abort(gone) })
	})
	if !errors.Is(err, gone) || took > 5*time.Second {
		t.Fatalf("error %v after %s, want %q at once", err, took, gone)
	}
	if !errors.Is(p.Err(), gone) {
		t.Fatalf("pipeline error %v, want %q", p.Err(), gone)
	}
	start := time.Now()
	p.Close()
	if d := time.Since(start); d > time.Second {
		t.Errorf("Close after Abort took %s", d)
	}
}

// dialRaw reaches a stage as the mesh's origin does: over socket streams
// in a newSocketMesh, else over gRPC.
func (m *mesh) dialRaw(ctx context.Context, addr string) (grpc.ClientConnInterface, error) {
	if m.sockets != nil {
		return m.dialSockets()(ctx, addr)
	}
	return m.conns.Dial(ctx, addr)
}

// TestNoSetupFrame: a stream that sends nothing is ended within the setup
// timeout, whichever transport carries it (the socket and in-process
// streams are read by the handler itself, gRPC's by a goroutine).
func TestNoSetupFrame(t *testing.T) {
	m := newSocketMesh(t, []int{0, 5}, engineOpts, stageOpts{setupTimeout: 200 * time.Millisecond})
	st := m.stages[0]
	tests := []struct {
		name string
		conn func(ctx context.Context) (grpc.ClientConnInterface, error)
	}{
		{"grpc", func(ctx context.Context) (grpc.ClientConnInterface, error) { return m.conns.Dial(ctx, st.addr) }},
		{"socket", func(context.Context) (grpc.ClientConnInterface, error) {
			return OverSockets(SocketConfig{Dial: dialUnix(st.sock)}), nil
		}},
		{"in process", func(context.Context) (grpc.ClientConnInterface, error) { return InProcess(st.srv), nil }},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			ctx, cancel := context.WithTimeout(t.Context(), 10*time.Second)
			defer cancel()
			conn, err := tc.conn(ctx)
			if err != nil {
				t.Fatal(err)
			}
			s, err := meshnodev1.NewStageServiceClient(conn).Forward(ctx)
			if err != nil {
				t.Fatal(err)
			}
			start := time.Now()
			if _, err := s.Recv(); status.Code(err) != codes.DeadlineExceeded || !strings.Contains(err.Error(), "no setup frame") {
				t.Fatalf("got %v, want DeadlineExceeded for the missing setup frame", err)
			}
			if d := time.Since(start); d > 5*time.Second {
				t.Fatalf("the stream ended after %s, its setup timeout is 200ms", d)
			}
		})
	}
}
