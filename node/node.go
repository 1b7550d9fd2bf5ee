// Package node runs a meshnode: it joins (or starts) a mesh, plans which
// node serves which layers, loads its own stage, and serves the OpenAI API
// for the whole mesh. cmd/meshnode only parses flags and calls Run.
package node

import (
	"context"
	"crypto/sha256"
	"crypto/subtle"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"time"

	"go.uber.org/zap"

	"github.com/meshnode/meshnode/ggufstage"
	"github.com/meshnode/meshnode/mlxstage"
	"github.com/meshnode/meshnode/mlxstage/hftok"
	"github.com/meshnode/meshnode/mlxstage/ops"
	"github.com/meshnode/meshnode/mlxstage/safetensors"
	"github.com/meshnode/meshnode/node/admin"
	"github.com/meshnode/meshnode/node/membership"
	"github.com/meshnode/meshnode/node/openai"
	"github.com/meshnode/meshnode/node/scheduler"
	"github.com/meshnode/meshnode/node/weights"
	"github.com/meshnode/meshnode/stage"
)

// Config is everything `meshnode serve` and `meshnode join` take.
type Config struct {
	Model          string // path to a .gguf or a safetensors directory (MLX); "" = the default model (serve) or the mesh's (join)
	HTTPAddr       string // default 127.0.0.1:9337
	DataDir        string // slices, hashes, keys
	CacheDir       string // downloaded models
	Threads        int
	Context        int // positions per sequence
	Parallel       int // sequences at once
	BatchTokens    int // tokens per forward pass
	QueueSize      int
	MaxTokensCap   int
	APIKey         string
	FlashAttention ggufstage.Switch // Auto: on for a stage on a GPU, off on the CPU
	BuildAhead     ggufstage.Switch // Auto: on for a stage on a GPU (see ggufstage.Options)
	DecodeGraphs   ggufstage.Switch // Auto: off (see ggufstage.Options)
	FusedDecode    ggufstage.Switch // Auto: on for a stage on CUDA that can run it (see ggufstage.Options)
	NoRepack       bool
	Device         string // cpu, cuda, auto: where this node's layers run
	Logger         *zap.Logger
	Progress       ggufstage.Progress

	// The mesh.
	Listen     []string // libp2p multiaddrs; default /ip4/0.0.0.0/tcp/4001
	GossipBind string   // gossip bind address; default all interfaces
	GossipPort int      // default 4002 (falls back to any); -1 = any
	MeshKey    string   // the mesh's key; serve creates one when empty
	Join       []string // multiaddrs of nodes to join
	MDNS       bool
	Split      bool   // split the model over every ready node even when it fits one
	Layers     string // "a:b" pins this node's layer range
	MaxMemory  uint64 // cap on what this node offers the planner
	WireDType  stage.DType
	// Pipelining keeps one micro-batch in flight per stage; Auto does when
	// no two stages share hardware (see meshPipe.Lanes).
	Pipelining ggufstage.Switch
	// MicroBatches is how many micro-batches a pipelined route keeps in
	// flight; 0 is one per stage.
	MicroBatches int
	// AllowPeers, when set, admits only these peer IDs to the mesh (on top
	// of the mesh key): --trust allowlist.
	AllowPeers []string
	// BusyPoll is how long this node's connections keep polling for the
	// next message after one before they sleep: lower latency per hop for
	// a CPU per busy connection. BusyPollAuto (serve's and join's
	// default) is DefaultBusyPoll on a node whose layers run on a GPU, off
	// elsewhere; 0 is off.
	BusyPoll time.Duration
	// LocalHops: stages of nodes on this machine (and network namespace)
	// reach each other over a Unix socket instead of TCP (host.ListenLocal,
	// pipeline.OverSockets). Auto: where the node can listen on one (a
	// warning says why not); On: the node fails to start without one; Off:
	// always TCP.
	LocalHops ggufstage.Switch
	// GPUHandoff: two stages of nodes on this machine that share a GPU
	// under MPS pass decode steps' hidden states in its memory where their
	// engines can (pipeline.HandoffEngine); false: always through the
	// hosts. serve's default is true.
	GPUHandoff bool

	// Ready, if set, is called with the HTTP address once the node serves.
	Ready func(addr string)
	// JoinCommand, if set, gets the command that adds a machine to the mesh.
	JoinCommand func(cmd string)
	// Version is meshnode's version, for status and metrics.
	Version string
	// DrainTimeout bounds a graceful leave (ctx cancelled or POST
	// /api/leave): how long the node waits for its requests to finish and
	// for the mesh to serve without it. 0 means 60 s; negative skips it.
	DrainTimeout time.Duration

	// mlxBackend, when set, is the backend this node's safetensors stages
	// run on instead of MLX, and makes the node offer the mlx engine where
	// MLX is unavailable. Only tests set it (export_test.go, with
	// mlx.Emulated), so that serving safetensors models is tested on
	// Linux; a real node never falls back to a slow Go backend by itself.
	mlxBackend func() (ops.Backend, error)

	// stageBroken, when set, replaces asking the local stage's engine
	// whether it is broken (brokenErr); only tests set it.
	stageBroken func(stage.Engine) error

	// kvF32, set only by tests, gives GGUF stages an f32 KV cache (the
	// planner still counts f16), to compare with engines that keep f32.
	kvF32 bool
}

// BusyPollAuto in Config.BusyPoll busy-polls on GPU nodes only.
const BusyPollAuto time.Duration = -1

// DefaultBusyPoll is the busy-poll window of a GPU node: longer than the
// gap between two decode steps' messages on a hop (a few ms at one stream,
// about 20 ms at 32 streams for an 8B model on an H200), so that a link
// that carries decode traffic never sleeps, and one that falls quiet does
// after this long.
const DefaultBusyPoll = 25 * time.Millisecond

// busyPollWindow is the busy-poll window of a node configured with
// configured (Config.BusyPoll) whose layers run on a GPU or not.
func busyPollWindow(configured time.Duration, gpu bool) time.Duration {
	switch {
	case configured == BusyPollAuto && gpu:
		return DefaultBusyPoll
	case configured < 0:
		return 0
	}
	return configured
}

// mlxDevice is where this node would run MLX stages ("metal", "emulated"
// under the test hook), or "" when it cannot.
func (c Config) mlxDevice() string {
	if c.mlxBackend != nil {
		be, err := c.mlxBackend()
		if err != nil {
			return ""
		}
		defer be.Close()
		return strings.ToLower(be.Device())
	}
	if mlxstage.Check() != nil {
		return ""
	}
	return "metal"
}

// DefaultHTTPAddr is loopback: exposing the API is an explicit choice.
const DefaultHTTPAddr = "127.0.0.1:9337"

// DefaultDataDir is ~/.meshnode, or $MESHNODE_DATA.
func DefaultDataDir() string {
	if d := os.Getenv("MESHNODE_DATA"); d != "" {
		return d
	}
	if h, err := os.UserHomeDir(); err == nil {
		return filepath.Join(h, ".meshnode")
	}
	return ".meshnode"
}

// pins parses --layers into the range this node announces.
func (c Config) pins() []membership.Serve {
	if c.Layers == "" {
		return nil
	}
	a, b, _ := strings.Cut(c.Layers, ":")
	start, err1 := strconv.Atoi(a)
	end, err2 := strconv.Atoi(b)
	if err1 != nil || err2 != nil {
		return nil
	}
	return []membership.Serve{{Start: start, End: end}}
}

func (c Config) validate() error {
	if c.Layers != "" {
		p := c.pins()
		if p == nil || p[0].Start < 0 || p[0].End <= p[0].Start {
			return fmt.Errorf("--layers %q: want START:END with 0 <= START < END", c.Layers)
		}
	}
	if c.MicroBatches < 0 {
		return fmt.Errorf("--micro-batches %d: want 0 (one per stage) or more", c.MicroBatches)
	}
	return checkExposure(c.HTTPAddr, c.APIKey)
}

// Run serves until ctx is cancelled, then shuts down gracefully.
func Run(ctx context.Context, cfg Config) error {
	log := cfg.Logger
	if log == nil {
		log = zap.NewNop()
	}
	if cfg.HTTPAddr == "" {
		cfg.HTTPAddr = DefaultHTTPAddr
	}
	if cfg.DataDir == "" {
		cfg.DataDir = DefaultDataDir()
	}
	if cfg.CacheDir == "" {
		cfg.CacheDir = weights.CacheDir()
	}
	if cfg.Context <= 0 {
		cfg.Context = 4096
	}
	if cfg.Parallel <= 0 {
		cfg.Parallel = 4
	}
	if cfg.WireDType == 0 {
		cfg.WireDType = stage.F16
	}
	if err := cfg.validate(); err != nil {
		return err
	}
	if err := os.MkdirAll(cfg.DataDir, 0o700); err != nil {
		return fmt.Errorf("creating data dir: %w", err)
	}

	if st, err := os.Stat(cfg.Model); err == nil && st.IsDir() && cfg.mlxBackend == nil {
		// A Hugging Face directory (config.json, safetensors) runs on MLX
		// alone: say so now rather than serve a model no layer can load.
		if err := mlxstage.Check(); err != nil {
			return fmt.Errorf("cannot serve %s, a safetensors model directory, which needs the MLX engine: %w", cfg.Model, err)
		}
	}
	m, err := startMesh(ctx, cfg, log.Named("mesh"))
	if err != nil {
		return err
	}
	defer m.close()

	if strings.HasPrefix(cfg.Model, "hf://") {
		if _, err := m.addRemoteModel(ctx, cfg.Model); err != nil {
			return fmt.Errorf("opening %s: %w", cfg.Model, err)
		}
		m.publish()
	} else if cfg.Model != "" || len(cfg.Join) == 0 {
		path := cfg.Model
		if path == "" {
			path, err = weights.DefaultModel(ctx, cfg.CacheDir, weights.Progress(cfg.Progress))
			if err != nil {
				return err
			}
			log.Info("serving the default model", zap.String("path", path))
		}
		if _, err := m.addLocalModel(path); err != nil {
			return err
		}
		m.publish()
	}
	if cfg.JoinCommand != nil {
		cfg.JoinCommand(m.host.JoinCommand())
	}
	log.Info("node up", zap.String("peer", m.self), zap.Strings("addrs", m.meta.Addrs),
		zap.String("offers", HumanBytes(m.budget)), zap.Float64("speed_gbps", m.speed))

	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	meshDone := make(chan struct{})
	go func() { defer close(meshDone); m.run(runCtx) }()
	defer func() { stop(); <-meshDone }()

	// Wait for the model: a joiner learns it from the mesh.
	var mm *meshModel
	for mm == nil {
		m.mu.Lock()
		mm = m.model
		m.mu.Unlock()
		if mm != nil {
			break
		}
		select {
		case <-ctx.Done():
			return nil
		case <-time.After(200 * time.Millisecond):
		}
	}
	served, err := newServed(ctx, m, mm, cfg, log)
	if err != nil {
		return err
	}

	ln, err := net.Listen("tcp", cfg.HTTPAddr)
	if err != nil {
		return fmt.Errorf("listening on %s: %w", cfg.HTTPAddr, err)
	}
	api := openai.NewHandler(backend{served}, openai.Config{
		APIKey:       cfg.APIKey,
		MaxTokensCap: cfg.MaxTokensCap,
		Logger:       log.Named("http"),
		Health:       served.health,
	})
	leave := make(chan struct{})
	var leaveOnce sync.Once
	mux := http.NewServeMux()
	m.obs.sched.Store(served.sched)
	mux.Handle("/", admin.Root(m.obs.metrics.CountHTTP(api))) // the dashboard for browsers at "/"
	mux.Handle("/api/", requireKey(cfg.APIKey, admin.New(admin.Config{Status: m.status, Stats: m.obs.selfStats})))
	mux.Handle("/metrics", requireKey(cfg.APIKey, m.obs.metrics.Handler()))
	mux.Handle("/debug/pprof/", requireKey(cfg.APIKey, admin.Profiles()))
	mux.Handle("POST /api/leave", requireKey(cfg.APIKey, http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		leaveOnce.Do(func() { close(leave) })
		w.Header().Set("Content-Type", "application/json")
		w.Write([]byte(`{"status":"draining"}` + "\n"))
	})))
	srv := &http.Server{Handler: mux, ReadHeaderTimeout: 10 * time.Second}

	schedDone := make(chan error, 1)
	go func() { schedDone <- served.sched.Run(runCtx) }()
	srvDone := make(chan error, 1)
	go func() { srvDone <- srv.Serve(ln) }()

	addr := ln.Addr().String()
	m.mu.Lock()
	m.meta.HTTP = addr
	m.mu.Unlock()
	m.publish()
	log.Info("serving the OpenAI API", zap.String("url", "http://"+addr+"/v1"), zap.String("model", mm.ref.Name))
	if cfg.Ready != nil {
		// Ready means requests can run: the mesh has a pipeline.
		go func() {
			for m.current() == nil {
				select {
				case <-runCtx.Done():
					return
				case <-time.After(50 * time.Millisecond):
				}
			}
			cfg.Ready(addr)
		}()
	}

	var runErr error
	select {
	case <-ctx.Done():
		served.drain(cfg.DrainTimeout, log)
	case <-leave:
		served.drain(cfg.DrainTimeout, log)
	case err := <-srvDone:
		runErr = fmt.Errorf("HTTP server: %w", err)
	case err := <-schedDone:
		runErr = fmt.Errorf("scheduler stopped: %w", err)
	}
	shutCtx, cancel := context.WithTimeout(context.Background(), 10*time.Second)
	defer cancel()
	stop() // ends generations in flight; their handlers then return
	if err := srv.Shutdown(shutCtx); err != nil && !errors.Is(err, http.ErrServerClosed) {
		log.Warn("HTTP shutdown", zap.Error(err))
	}
	<-schedDone
	return runErr
}

// checkExposure refuses to serve beyond loopback without an API key.
func checkExposure(addr, key string) error {
	host, _, err := net.SplitHostPort(addr)
	if err != nil {
		return fmt.Errorf("bad --http address %q: %w", addr, err)
	}
	if key != "" {
		return nil
	}
	if host == "localhost" {
		return nil
	}
	if ip := net.ParseIP(host); ip != nil && ip.IsLoopback() {
		return nil
	}
	return fmt.Errorf("--http %s listens beyond loopback: set --api-key (or MESHNODE_API_KEY) so that only your clients can use it", addr)
}

// Model is the mesh's model as this node serves it over HTTP.
type Model struct {
	id       string
	created  int64
	info     stage.Info
	tok      tokenizer
	chat     chatFormat
	sched    *scheduler.Scheduler
	mesh     *mesh
	draining atomic.Bool
}

// tokenizer is what serving needs of a model's tokenizer, whichever
// engine's: Decode gives one token's text in the middle of a sequence.
type tokenizer interface {
	scheduler.Tokenizer
	Encode(s string, addSpecial bool) ([]int32, error)
	HasToken(s string) bool
	// IsSpecial reports a control token (BOS, end of turn, …), whose text
	// is markup rather than output.
	IsSpecial(id int32) bool
}

// chatFormat is what the chat template needs besides the tokenizer.
type chatFormat struct {
	template, bos, eos string
}

// hfTokenizer is a safetensors model's tokenizer. The scheduler decodes one
// token at a time, so Decode is DecodePiece: Decode would strip the space
// a SentencePiece word starts with, as at the start of a text.
type hfTokenizer struct{ *hftok.Tokenizer }

func (t hfTokenizer) Decode(ids []int32) (string, error) { return t.DecodePiece(ids) }

// loadGGUFTokenizer reads the tokenizer of a GGUF (any slice or header).
func loadGGUFTokenizer(path string) (tokenizer, chatFormat, error) {
	tok, err := ggufstage.LoadTokenizer(path)
	if err != nil {
		return nil, chatFormat{}, err
	}
	return tok, chatFormat{template: tok.ChatTemplate, bos: tok.BOS, eos: tok.EOS}, nil
}

// loadHFTokenizer reads tokenizer.json and its companions.
func loadHFTokenizer(open safetensors.Opener) (tokenizer, chatFormat, error) {
	tok, err := hftok.Load(open, hftok.Options{})
	if err != nil {
		return nil, chatFormat{}, fmt.Errorf("loading the tokenizer: %w", err)
	}
	return hfTokenizer{tok}, chatFormat{template: tok.ChatTemplate, bos: tok.BOS, eos: tok.EOS}, nil
}

func newServed(ctx context.Context, m *mesh, mm *meshModel, cfg Config, log *zap.Logger) (*Model, error) {
	var (
		tok  tokenizer
		chat chatFormat
		err  error
	)
	if mm.st != nil {
		tok, chat, err = loadHFTokenizer(mm.st.files(ctx))
	} else {
		tok, chat, err = loadGGUFTokenizer(mm.header)
	}
	if err != nil {
		return nil, err
	}
	info := stage.Info{
		Arch: mm.info.Arch, Layers: mm.info.Layers, Embd: mm.info.Embd, Vocab: mm.info.Vocab,
		Start: 0, End: mm.info.Layers, Context: mm.ref.Context, MaxSeqs: max(mm.ref.Parallel, 1),
		WireDType: cfg.WireDType,
	}
	if info.Context <= 0 {
		info.Context = cfg.Context
	}
	pipe := &meshPipe{m: m, info: info, seqs: map[stage.SeqID]scheduler.Pipeline{}}
	sched := scheduler.New(pipe, tok, scheduler.Config{
		Parallel: cfg.Parallel, BatchTokens: cfg.BatchTokens, QueueSize: cfg.QueueSize,
	}, log.Named("scheduler"))
	created := time.Now().Unix()
	if mm.path != "" {
		if st, err := os.Stat(mm.path); err == nil {
			created = st.ModTime().Unix()
		}
	}
	return &Model{id: mm.ref.Name, created: created, info: info, tok: tok, chat: chat, sched: sched, mesh: m}, nil
}

func (s *Model) health() error {
	if s.draining.Load() {
		return errDraining
	}
	if s.mesh.current() == nil {
		return errNoPipeline
	}
	return nil
}

// admit says whether a request may queue. It may while the mesh is
// healthy, and also while it is only rebuilding the pipeline after a
// replan (a node left or came back): /health says 503 then, but the
// request waits for the new pipeline instead of failing, as the requests
// already running do.
func (s *Model) admit() error {
	err := s.health()
	if errors.Is(err, errNoPipeline) && s.mesh.replanning() {
		return nil
	}
	return err
}

var errDraining = errors.New("this node is leaving the mesh")

// drain leaves gracefully: no new requests, the mesh moves this node's
// layers elsewhere, requests in flight finish (or move with the layers),
// all within timeout.
func (s *Model) drain(timeout time.Duration, log *zap.Logger) {
	if timeout < 0 {
		return
	}
	if timeout == 0 {
		timeout = 60 * time.Second
	}
	s.draining.Store(true)
	s.mesh.drain()
	deadline := time.Now().Add(timeout)
	for time.Now().Before(deadline) {
		st := s.sched.Stats()
		if st.Active == 0 && st.Waiting == 0 && s.mesh.servableWithout() {
			log.Info("drained: leaving the mesh")
			return
		}
		time.Sleep(200 * time.Millisecond)
	}
	log.Warn("drain timed out; leaving anyway", zap.Duration("timeout", timeout))
}

// modelName is the model's API id: a GGUF's file name without .gguf, a
// directory's name (whole: "Qwen2.5-0.5B" has no extension).
func modelName(path string) string {
	if st, err := os.Stat(path); err == nil && st.IsDir() {
		return filepath.Base(filepath.Clean(path))
	}
	return strings.TrimSuffix(filepath.Base(path), filepath.Ext(path))
}

// requireKey guards the admin API like the OpenAI one.
func requireKey(key string, h http.Handler) http.Handler {
	if key == "" {
		return h
	}
	want := sha256.Sum256([]byte("Bearer " + key))
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		got := sha256.Sum256([]byte(r.Header.Get("Authorization")))
		if subtle.ConstantTimeCompare(got[:], want[:]) != 1 {
			http.Error(w, `{"error":{"message":"invalid api key","type":"invalid_request_error","code":"invalid_api_key"}}`, http.StatusUnauthorized)
			return
		}
		h.ServeHTTP(w, r)
	})
}

// LoadModel reads a model's tokenizer and chat template without loading
// any weights: enough to render and tokenize prompts as the node does.
// A safetensors directory works too.
func LoadModel(path string, cfg Config) (*Model, error) {
	if st, err := os.Stat(path); err == nil && st.IsDir() {
		open := safetensors.Dir(path)
		tok, chat, err := loadHFTokenizer(open)
		if err != nil {
			return nil, fmt.Errorf("loading %s: %w", path, err)
		}
		c, err := mlxstage.ReadConfig(open)
		if err != nil {
			return nil, fmt.Errorf("loading %s: %w", path, err)
		}
		return &Model{id: modelName(path), tok: tok, chat: chat, info: stage.Info{Arch: c.Arch, Layers: c.Layers, Vocab: c.Vocab, Context: cfg.Context}}, nil
	}
	tok, chat, err := loadGGUFTokenizer(path)
	if err != nil {
		return nil, err
	}
	info, err := ggufstage.ReadInfo(path)
	if err != nil {
		return nil, err
	}
	return &Model{id: modelName(path), tok: tok, chat: chat, info: stage.Info{Arch: info.Arch, Layers: info.Layers, Vocab: info.Vocab, Context: cfg.Context}}, nil
}

// Close releases nothing today; it keeps LoadModel's callers honest.
func (s *Model) Close() error { return nil }
