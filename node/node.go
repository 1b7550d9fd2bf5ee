// Package node runs a meshnode: it loads the model's stages, owns the
// scheduler, and serves the OpenAI-compatible API. cmd/meshnode only parses
// flags and calls Run.
package node

import (
	"context"
	"errors"
	"fmt"
	"net"
	"net/http"
	"os"
	"path/filepath"
	"strings"
	"time"

	"go.uber.org/zap"

	"github.com/meshnode/meshnode/ggufstage"
	"github.com/meshnode/meshnode/node/openai"
	"github.com/meshnode/meshnode/node/scheduler"
	"github.com/meshnode/meshnode/node/weights"
	"github.com/meshnode/meshnode/stage"
)

// Config is everything `meshnode serve` takes.
type Config struct {
	Model          string // path to a .gguf; "" = the default model
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
	FlashAttention bool
	NoRepack       bool
	Logger         *zap.Logger
	Progress       ggufstage.Progress
	// Ready, if set, is called with the HTTP address once the node serves.
	Ready func(addr string)
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
	if err := checkExposure(cfg.HTTPAddr, cfg.APIKey); err != nil {
		return err
	}
	if err := os.MkdirAll(cfg.DataDir, 0o700); err != nil {
		return fmt.Errorf("creating data dir: %w", err)
	}
	path := cfg.Model
	if path == "" {
		var err error
		path, err = weights.DefaultModel(ctx, cfg.CacheDir, weights.Progress(cfg.Progress))
		if err != nil {
			return err
		}
		log.Info("serving the default model", zap.String("path", path))
	}

	m, err := LoadModel(path, cfg)
	if err != nil {
		return err
	}
	defer m.Close()
	log.Info("model loaded", zap.String("model", m.id), zap.String("arch", m.info.Arch),
		zap.Int("layers", m.info.Layers), zap.Uint64("weight_bytes", m.engine.WeightBytes()),
		zap.Int("context", m.info.Context), zap.Int("parallel", m.info.MaxSeqs))

	m.sched = scheduler.New(scheduler.Local(m.engine), m.tok, scheduler.Config{
		Parallel: cfg.Parallel, BatchTokens: cfg.BatchTokens, QueueSize: cfg.QueueSize,
	}, log.Named("scheduler"))

	ln, err := net.Listen("tcp", cfg.HTTPAddr)
	if err != nil {
		return fmt.Errorf("listening on %s: %w", cfg.HTTPAddr, err)
	}
	handler := openai.NewHandler(backend{m}, openai.Config{
		APIKey:       cfg.APIKey,
		MaxTokensCap: cfg.MaxTokensCap,
		Logger:       log.Named("http"),
	})
	srv := &http.Server{Handler: handler, ReadHeaderTimeout: 10 * time.Second}

	runCtx, stop := context.WithCancel(ctx)
	defer stop()
	schedDone := make(chan error, 1)
	go func() { schedDone <- m.sched.Run(runCtx) }()
	srvDone := make(chan error, 1)
	go func() { srvDone <- srv.Serve(ln) }()

	addr := ln.Addr().String()
	log.Info("serving the OpenAI API", zap.String("url", "http://"+addr+"/v1"))
	if cfg.Ready != nil {
		cfg.Ready(addr)
	}

	var runErr error
	select {
	case <-ctx.Done():
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

// Model is one loaded model served by this node.
type Model struct {
	id      string
	created int64
	engine  stage.Engine
	info    stage.Info
	tok     *ggufstage.Tokenizer
	sched   *scheduler.Scheduler
}

// LoadModel loads every layer of a GGUF on this node.
func LoadModel(path string, cfg Config) (*Model, error) {
	tok, err := ggufstage.LoadTokenizer(path)
	if err != nil {
		return nil, err
	}
	meta, err := ggufstage.ReadInfo(path)
	if err != nil {
		return nil, err
	}
	slice, err := ggufstage.Slice(path, cfg.DataDir, 0, meta.Layers, cfg.Progress)
	if err != nil {
		return nil, err
	}
	parallel := cfg.Parallel
	if parallel <= 0 {
		parallel = 4
	}
	eng, err := ggufstage.Open(slice, 0, meta.Layers, ggufstage.Options{
		Threads: cfg.Threads, Context: cfg.Context, MaxSeqs: parallel,
		BatchSize: cfg.BatchTokens, FlashAttention: cfg.FlashAttention, NoRepack: cfg.NoRepack,
	})
	if err != nil {
		return nil, err
	}
	st, _ := os.Stat(path)
	created := time.Now().Unix()
	if st != nil {
		created = st.ModTime().Unix()
	}
	return &Model{
		id:      strings.TrimSuffix(filepath.Base(path), filepath.Ext(path)),
		created: created,
		engine:  eng,
		info:    eng.Info(),
		tok:     tok,
	}, nil
}

// Close frees the model's engine.
func (m *Model) Close() error { return m.engine.Close() }
