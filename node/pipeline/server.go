package pipeline

import (
	"context"
	"errors"
	"fmt"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"
	"google.golang.org/grpc/codes"
	"google.golang.org/grpc/peer"
	"google.golang.org/grpc/status"

	"github.com/meshnode/meshnode/node/sample"
	"github.com/meshnode/meshnode/node/wire"
	meshnodev1 "github.com/meshnode/meshnode/proto/meshnode/v1"
	"github.com/meshnode/meshnode/stage"
)

// DefaultSetupTimeout bounds how long a stage waits for a stream's Setup
// and for the other half of a pipeline (the return stream, or the forward
// chain) to arrive.
const DefaultSetupTimeout = 30 * time.Second

// ServerConfig configures a stage server.
type ServerConfig struct {
	// Engine is the stage this server runs; required. The server opens,
	// trims and releases sequences on it under ids of its own.
	Engine stage.Engine
	// Dial reaches the next hop of a pipeline; required unless the engine
	// is the model's last stage.
	Dial Dialer
	// ModelID and ModelHash are reported by Info, so that an origin only
	// chains stages of one model.
	ModelID, ModelHash string
	// MaxFrameBytes is the largest message the grpc.Server accepts, as
	// advertised to upstream stages so they split to fit; 0 means
	// wire.MaxFrameBytes (what wire.ServerOptions sets).
	MaxFrameBytes int
	// Limits bound decoded frames; the engine's vocabulary and width
	// tighten them further.
	Limits wire.Limits
	// SetupTimeout: 0 means DefaultSetupTimeout.
	SetupTimeout time.Duration
	// OnBadPeer, if set, is called when a peer sends a malformed frame, so
	// that the node can mark it suspect. It must not block.
	OnBadPeer func(peer string, err error)
	// PeerOf names the remote peer of a stream for OnBadPeer; the default
	// is the transport address.
	PeerOf func(ctx context.Context) string
	// Vocab gives the model's token texts, which a last stage needs to
	// keep a sequence's output JSON (sample.Params.JSON); nil refuses
	// such sequences. It is called when one opens.
	Vocab func() (*sample.Vocab, error)
	// DeviceHandoff lets the engine hand hidden states to the next stage
	// of a pipeline on their shared GPU, where both stages' engines can
	// (HandoffEngine, handoff.go).
	DeviceHandoff bool
	Logger        *zap.Logger
}

// Server serves StageService over one engine, for any number of pipelines
// at once. Register it on a grpc.Server built with wire.ServerOptions.
type Server struct {
	meshnodev1.UnimplementedStageServiceServer

	cfg  ServerConfig
	info stage.Info
	lim  wire.Limits
	log  *zap.Logger

	// nextLocal numbers the engine sequences this server opens: origins
	// choose their own ids, which may collide between pipelines.
	nextLocal atomic.Uint64

	// ctx ends every stream when the server closes.
	ctx    context.Context
	cancel context.CancelFunc

	mu     sync.Mutex
	closed bool
	wg     sync.WaitGroup // stream handlers and the goroutines they start
	pipes  map[pipeKey]*rendezvous
}

// NewServer returns a server for cfg.Engine.
func NewServer(cfg ServerConfig) (*Server, error) {
	if cfg.Engine == nil {
		return nil, errors.New("pipeline: server needs an engine")
	}
	info := cfg.Engine.Info()
	if cfg.Dial == nil && !info.Last() {
		return nil, fmt.Errorf("pipeline: stage %s is not last, so its server needs a dialer", info.Range())
	}
	if cfg.MaxFrameBytes <= 0 {
		cfg.MaxFrameBytes = wire.MaxFrameBytes
	}
	if cfg.SetupTimeout <= 0 {
		cfg.SetupTimeout = DefaultSetupTimeout
	}
	if cfg.PeerOf == nil {
		cfg.PeerOf = addrOf
	}
	log := cfg.Logger
	if log == nil {
		log = zap.NewNop()
	}
	lim := wire.DefaultLimits()
	if cfg.Limits.MaxRows > 0 {
		lim.MaxRows = cfg.Limits.MaxRows
	}
	if cfg.Limits.MaxPayload > 0 {
		lim.MaxPayload = min(cfg.Limits.MaxPayload, lim.MaxPayload)
	}
	if cfg.Limits.MaxHistory > 0 {
		lim.MaxHistory = cfg.Limits.MaxHistory
	}
	lim.MaxCols = info.Embd
	lim.MaxVocab = info.Vocab
	if cfg.Limits.MaxVocab > 0 {
		lim.MaxVocab = min(lim.MaxVocab, cfg.Limits.MaxVocab)
	}
	ctx, cancel := context.WithCancel(context.Background())
	return &Server{
		cfg: cfg, info: info, lim: lim, log: log.With(zap.String("stage", info.Range())),
		ctx: ctx, cancel: cancel, pipes: map[pipeKey]*rendezvous{},
	}, nil
}

func addrOf(ctx context.Context) string {
	if p, ok := peer.FromContext(ctx); ok && p.Addr != nil {
		return p.Addr.String()
	}
	return "unknown"
}

// Close ends every stream the server is serving, releasing their
// sequences, and waits for their goroutines. It does not close the engine
// or stop the grpc.Server; streams that arrive later are refused.
func (s *Server) Close() error {
	s.mu.Lock()
	s.closed = true
	s.mu.Unlock()
	s.cancel()
	s.wg.Wait()
	return nil
}

// enter registers a stream handler, unless the server is closed. Adding to
// the wait group under the lock keeps Close's Wait from racing with it.
func (s *Server) enter() bool {
	s.mu.Lock()
	defer s.mu.Unlock()
	if s.closed {
		return false
	}
	s.wg.Add(1)
	return true
}

// Info describes the stage.
func (s *Server) Info(context.Context, *meshnodev1.InfoRequest) (*meshnodev1.StageInfo, error) {
	p, err := wire.EncodeInfo(wire.Info{
		Info: s.info, ModelID: s.cfg.ModelID, ModelHash: s.cfg.ModelHash,
		MaxFrameBytes: uint64(s.cfg.MaxFrameBytes),
	})
	if err != nil {
		return nil, status.Error(codes.Internal, err.Error())
	}
	return p, nil
}

// recvd is one result of a stream's Recv.
type recvd struct {
	f   *meshnodev1.Frame
	err error
}

// receive reads a server stream on its own goroutine, so that the handler
// can wait for frames and for other events at once. The goroutine belongs
// to the handler: it ends once the handler has returned (gRPC then fails
// Recv) or ctx is done, and it is counted in s.wg.
//
// A message over the size limit is reported here: gRPC has already ended
// the stream with ResourceExhausted (the peer gets no Error frame), and the
// handler may see only its cancelled context.
func (s *Server) receive(ctx context.Context, stream meshnodev1.StageService_ForwardServer, from string) <-chan recvd {
	ch := make(chan recvd)
	s.wg.Add(1) // the handler's own count is held, so this cannot race Wait
	go func() {
		defer s.wg.Done()
		for {
			f, err := s.recv(stream, from)
			select {
			case ch <- recvd{f, err}:
			case <-ctx.Done():
				return
			}
			if err != nil {
				return
			}
		}
	}()
	return ch
}

// recv receives a frame from stream, reporting the peer of a message over
// the size limit, which ends the stream (see receive).
func (s *Server) recv(stream meshnodev1.StageService_ForwardServer, from string) (*meshnodev1.Frame, error) {
	f, err := stream.Recv()
	if status.Code(err) == codes.ResourceExhausted {
		s.badPeer(from, err)
	}
	return f, err
}

// Forward serves one stream of a pipeline: its first frame (a Setup) says
// which pipeline and whether the stream brings work (forward) or takes the
// last stage's replies to the origin (return).
func (s *Server) Forward(stream meshnodev1.StageService_ForwardServer) error {
	if !s.enter() {
		return status.Error(codes.Unavailable, "stage server closed")
	}
	defer s.wg.Done()
	ctx, cancel := context.WithCancelCause(stream.Context())
	defer cancel(nil)
	stop := context.AfterFunc(s.ctx, func() { cancel(fmt.Errorf("%w: stage server closing", wire.ErrUnavailable)) })
	defer stop()

	from := s.cfg.PeerOf(stream.Context())
	direct, _ := stream.(recvCanceler)
	var in <-chan recvd
	var first recvd
	if direct != nil {
		var err error
		if first, err = s.recvSetup(ctx, stream, from, direct); err != nil {
			return err
		}
	} else {
		in = s.receive(ctx, stream, from)
		timer := time.NewTimer(s.cfg.SetupTimeout)
		defer timer.Stop()
		select {
		case first = <-in:
		case <-timer.C:
			return status.Errorf(codes.DeadlineExceeded, "no setup frame within %s", s.cfg.SetupTimeout)
		case <-ctx.Done():
			return status.FromContextError(context.Cause(ctx)).Err()
		}
	}
	if first.err != nil {
		return first.err
	}
	setup, err := wire.DecodeSetup(first.f)
	if err == nil {
		err = s.checkSetup(setup)
	}
	if err != nil {
		s.badPeer(from, err)
		// The peer learns why before the stream closes.
		_ = stream.Send(wire.EncodeError(first.f.GetStep(), err))
		return status.Error(statusCode(err), err.Error())
	}
	if setup.Role == wire.RoleReturn {
		if in == nil {
			// Nothing but its end is expected on a return stream: a
			// goroutine may watch for it.
			in = s.receive(ctx, stream, from)
		}
		return s.serveReturn(ctx, stream, from, setup, in)
	}
	if direct != nil {
		stop := direct.cancelRecv(ctx)
		defer stop()
		if l, ok := stream.(payloadLender); ok {
			l.lendPayloads()
		}
	}
	return s.serveForward(ctx, cancel, stream, from, setup, in)
}

// A payloadLender is a server stream that can lend a received frame's
// activations payload from its read buffer rather than copy it out: after
// lendPayloads, the payload is valid only until the next Recv. A forward
// stream's handler is done with each frame before it reads the next (the
// joiner copies the parts of a split step), so the socket streams that it
// reads itself lend.
type payloadLender interface{ lendPayloads() }

// A recvCanceler is a server stream whose Recv its handler may call
// itself, with no goroutine between them (Server.receive): after
// cancelRecv(ctx), a Recv fails once ctx ends, without breaking the
// stream's sending side. The socket and in-process streams are; gRPC's
// end a Recv only with the call. On a decode step's critical path the
// goroutine hand-off costs a thread's wake-up on a node that idled while
// the stages before it computed.
type recvCanceler interface {
	// cancelRecv returns a stop function that, like context.AfterFunc's,
	// says whether it stopped the cancellation before it began; after a
	// false, the stream receives nothing more.
	cancelRecv(ctx context.Context) (stop func() bool)
}

// recvSetup reads a stream's first frame on the handler's goroutine,
// within the setup timeout.
func (s *Server) recvSetup(ctx context.Context, stream meshnodev1.StageService_ForwardServer, from string, direct recvCanceler) (recvd, error) {
	sctx, scancel := context.WithTimeout(ctx, s.cfg.SetupTimeout)
	defer scancel()
	stop := direct.cancelRecv(sctx)
	f, err := s.recv(stream, from)
	stopped := !stop()
	if status.Code(err) == codes.ResourceExhausted {
		// The stream itself ended, and told the peer why.
		return recvd{f, err}, nil
	}
	if stopped {
		// The stream's reads were stopped, whether or not this one
		// returned a frame first.
		if ctx.Err() != nil {
			return recvd{}, status.FromContextError(context.Cause(ctx)).Err()
		}
		return recvd{}, status.Errorf(codes.DeadlineExceeded, "no setup frame within %s", s.cfg.SetupTimeout)
	}
	return recvd{f, err}, nil
}

// checkSetup checks that the Setup names this stage.
func (s *Server) checkSetup(st wire.Setup) error {
	h := st.Route[st.Hop]
	switch {
	case h.Start != s.info.Start || h.End != s.info.End:
		return fmt.Errorf("%w: setup names hop %d as layers [%d,%d), this stage holds %s", wire.ErrBadFrame, st.Hop, h.Start, h.End, s.info.Range())
	case st.Layers() != s.info.Layers:
		return fmt.Errorf("%w: setup route covers %d layers, the model has %d", wire.ErrBadFrame, st.Layers(), s.info.Layers)
	}
	return nil
}

func (s *Server) badPeer(from string, err error) {
	s.log.Warn("bad frame from peer", zap.String("peer", from), zap.Error(err))
	if s.cfg.OnBadPeer != nil {
		s.cfg.OnBadPeer(from, err)
	}
}

// statusCode is the gRPC status that ends a stream failed with err.
func statusCode(err error) codes.Code {
	switch wire.ErrorCode(err) {
	case meshnodev1.Error_CODE_BAD_FRAME, meshnodev1.Error_CODE_UNSUPPORTED_VERSION, meshnodev1.Error_CODE_UNKNOWN_SEQ:
		return codes.InvalidArgument
	case meshnodev1.Error_CODE_UNAVAILABLE:
		return codes.Unavailable
	}
	return codes.Aborted
}

// pipeKey names a pipeline on a stage: ids are the origin's to choose.
type pipeKey struct{ origin, id string }

// rendezvous joins a pipeline's two streams on its last stage: the
// forward stream that brings work and the return stream that takes the
// replies to the origin. Either may arrive first.
//
// The forward side sends its replies on the return stream itself (send),
// rather than through the return handler's goroutine: on a decode step's
// critical path, a goroutine hand-off on a node that idled while the other
// stages computed costs a thread's wake-up.
type rendezvous struct {
	fwd, ret bool // attached; guarded by Server.mu
	refs     int  // attached sides not yet gone; guarded by Server.mu

	retReady chan struct{} // closed when the return stream attaches
	fwdReady chan struct{} // closed when the forward stream attaches
	fwdDone  chan struct{} // closed when the forward side has sent its last reply

	// sendMu orders every send on the return stream, the forward side's
	// and the return handler's own, and keeps them from outliving it.
	sendMu sync.Mutex
	out    meshnodev1.StageService_ForwardServer // the return stream; set under Server.mu and sendMu
	gone   bool                                  // the return handler has returned
}

var errReturnGone = errors.New("the origin's return stream closed")

// send sends f to the origin on the return stream.
func (rv *rendezvous) send(f *meshnodev1.Frame) error {
	rv.sendMu.Lock()
	defer rv.sendMu.Unlock()
	if rv.gone || rv.out == nil {
		return errReturnGone
	}
	if err := rv.out.Send(f); err != nil {
		return fmt.Errorf("%w: %w", errReturnGone, err)
	}
	return nil
}

// retire marks the return handler gone: sends after it fail, and one in
// flight is waited for.
func (rv *rendezvous) retire() {
	rv.sendMu.Lock()
	rv.gone = true
	rv.sendMu.Unlock()
}

// attach joins a side to the pipeline's rendezvous, creating it if it is
// the first. A second stream of the same role is refused.
// ret is the return stream, when role is wire.RoleReturn.
func (s *Server) attach(key pipeKey, role wire.Role, ret meshnodev1.StageService_ForwardServer) (*rendezvous, error) {
	s.mu.Lock()
	defer s.mu.Unlock()
	rv := s.pipes[key]
	if rv == nil {
		rv = &rendezvous{
			retReady: make(chan struct{}),
			fwdReady: make(chan struct{}),
			fwdDone:  make(chan struct{}),
		}
		s.pipes[key] = rv
	}
	switch {
	case role == wire.RoleForward && !rv.fwd:
		rv.fwd = true
		close(rv.fwdReady)
	case role == wire.RoleReturn && !rv.ret:
		rv.ret = true
		rv.sendMu.Lock()
		rv.out = ret
		rv.sendMu.Unlock()
		close(rv.retReady)
	default:
		return nil, fmt.Errorf("%w: pipeline %q of %s already has a %s stream", wire.ErrBadFrame, key.id, key.origin, role)
	}
	rv.refs++
	return rv, nil
}

// detach lets go of a side; the last one out forgets the pipeline.
func (s *Server) detach(key pipeKey, rv *rendezvous) {
	s.mu.Lock()
	defer s.mu.Unlock()
	rv.refs--
	if rv.refs == 0 && s.pipes[key] == rv {
		delete(s.pipes, key)
	}
}

// serveReturn holds the return stream, on which the forward side sends
// the last stage's replies for one pipeline to its origin, until the
// forward side ends.
func (s *Server) serveReturn(ctx context.Context, stream meshnodev1.StageService_ForwardServer, from string, st wire.Setup, in <-chan recvd) error {
	key := pipeKey{st.Origin, st.PipelineID}
	rv, err := s.attach(key, wire.RoleReturn, stream)
	if err != nil {
		s.badPeer(from, err)
		_ = stream.Send(wire.EncodeHopError(0, -1, err))
		return status.Error(codes.InvalidArgument, err.Error())
	}
	defer s.detach(key, rv)
	defer rv.retire()

	timer := time.NewTimer(s.cfg.SetupTimeout)
	defer timer.Stop()
	select {
	case <-rv.fwdReady:
		timer.Stop()
	case <-timer.C:
		err := fmt.Errorf("%w: pipeline %q: no forward stream reached the last stage within %s", wire.ErrUnavailable, st.PipelineID, s.cfg.SetupTimeout)
		_ = rv.send(wire.EncodeHopError(0, st.Hop-1, err))
		return status.Error(codes.Unavailable, err.Error())
	case <-ctx.Done():
		return status.FromContextError(context.Cause(ctx)).Err()
	}
	for {
		select {
		case <-rv.fwdDone:
			return nil // the forward side ended; its last word was sent
		case r := <-in:
			if r.err != nil {
				// The origin closed its side (or the stream broke, which
				// ctx will show): replies still go out.
				in = nil
				continue
			}
			err := fmt.Errorf("%w: %s frame on a return stream", wire.ErrBadFrame, wire.BodyKind(r.f))
			s.badPeer(from, err)
			_ = rv.send(wire.EncodeHopError(r.f.GetStep(), -1, err))
			return status.Error(codes.InvalidArgument, err.Error())
		case <-ctx.Done():
			return status.FromContextError(context.Cause(ctx)).Err()
		}
	}
}
