// Package mlxstage is the StageEngine for Hugging Face safetensors models
// (a directory with config.json and *.safetensors): it reads the headers,
// loads only the tensors of its layer range, and runs the llama, qwen2 and
// qwen3 decoder blocks in Hugging Face's conventions (rotate-half RoPE,
// [out, in] Linear weights, tied embeddings) on an ops.Backend: MLX on Apple
// Silicon (package mlxstage/mlx), or the pure-Go reference backend
// (ops.Reference) that the tests run everywhere.
//
// A stage exchanges the same engine-neutral stage.Activation as the ggml
// engine, so an mlxstage stage and a ggufstage stage of the same weights
// (a GGUF converted from the safetensors) sit in one pipeline.
package mlxstage

import (
	"errors"
	"fmt"
	"math"
	"sync"

	"github.com/meshnode/meshnode/mlxstage/mlx"
	"github.com/meshnode/meshnode/mlxstage/ops"
	"github.com/meshnode/meshnode/mlxstage/safetensors"
	"github.com/meshnode/meshnode/stage"
)

// Backend names for Options.Engine.
const (
	EngineMLX       = "mlx"
	EngineReference = "reference"
)

// ErrUnavailable is returned by Open for the MLX engine where MLX cannot
// run; it says what to do instead.
var ErrUnavailable = mlx.ErrUnavailable

// ErrLibrary is returned by Open for the MLX engine when the binary has the
// binding but libmlxc cannot be loaded; it names the paths tried.
var ErrLibrary = mlx.ErrLibrary

// Available reports whether this binary can run the MLX engine at all
// (darwin/arm64 built with -tags mlx); the planner uses it to say which
// engines a node offers. Loading libmlxc can still fail; Open says why.
func Available() bool { return mlx.Available() }

// Check reports whether the MLX engine can run here: nil, ErrUnavailable
// (no binding in this binary), or ErrLibrary (libmlxc cannot be loaded). A
// node asks it before it offers the engine, so that the planner never gives
// layers to a node that would fail to load them.
func Check() error {
	if !Available() {
		return ErrUnavailable
	}
	be, err := mlx.New()
	if err != nil {
		return err
	}
	return be.Close()
}

// Options configure an engine.
type Options struct {
	// Engine picks the backend: "mlx" (the default) or "reference".
	Engine string
	// Backend, if set, is used instead of Engine's; the engine does not
	// close it.
	Backend ops.Backend
	// Files opens the model's files; nil reads the directory given to Open.
	// A remote model (Hugging Face by HTTP range, a peer) plugs in here:
	// only headers and the stage's tensors are read through it.
	Files     safetensors.Opener
	Context   int         // positions per sequence; 0 = the model's, capped at 4096
	MaxSeqs   int         // sequences with KV at once; 0 = 4
	BatchSize int         // most tokens in one forward pass; 0 = 512
	WireDType stage.DType // 0 = f16, as the ggml engine
	Quant     QuantPolicy // load-time quantization; zero = none
}

// Engine runs layers [Start,End) of a safetensors model. It is safe for use
// by several goroutines; compute is serialized.
type Engine struct {
	mu      sync.Mutex
	info    stage.Info
	cfg     *Config
	be      ops.Backend
	ownBE   bool
	w       *weights
	invFreq []float32
	scale   float32
	seqs    map[stage.SeqID][]ops.KV // one cache per owned layer
	maxSeqs int
	batch   int
	loaded  safetensors.Stats
	closed  bool
}

var _ stage.Engine = (*Engine)(nil)

// ReadConfig reads and parses config.json through open.
func ReadConfig(open safetensors.Opener) (*Config, error) {
	b, err := safetensors.ReadFile(open, "config.json")
	if err != nil {
		return nil, fmt.Errorf("reading config.json: %w", err)
	}
	return ParseConfig(b)
}

// Open loads layers [start,end) of the model in dir.
func Open(dir string, start, end int, opts Options) (e *Engine, err error) {
	open := opts.Files
	if open == nil {
		open = safetensors.Dir(dir)
	}
	cfg, err := ReadConfig(open)
	if err != nil {
		return nil, fmt.Errorf("loading %s: %w", dir, err)
	}
	if start < 0 || end > cfg.Layers || start >= end {
		return nil, fmt.Errorf("layer range [%d,%d) is not inside the model's %d layers", start, end, cfg.Layers)
	}
	if err := opts.Quant.Validate(); err != nil {
		return nil, err
	}
	if opts.MaxSeqs <= 0 {
		opts.MaxSeqs = 4
	}
	if opts.BatchSize <= 0 {
		opts.BatchSize = 512
	}
	if opts.WireDType == 0 {
		opts.WireDType = stage.F16
	}
	if opts.Context <= 0 {
		opts.Context = min(max(cfg.MaxPositions, 1), 4096)
		if cfg.MaxPositions == 0 {
			opts.Context = 4096
		}
	}

	be, own := opts.Backend, false
	if be == nil {
		switch opts.Engine {
		case "", EngineMLX:
			if be, err = mlx.New(); err != nil {
				return nil, err
			}
		case EngineReference:
			be = ops.Reference()
		default:
			return nil, fmt.Errorf("unknown mlxstage engine %q (want %s or %s)", opts.Engine, EngineMLX, EngineReference)
		}
		own = true
	}
	// eng, not the named result: a failed return sets e to nil, and the
	// half-built engine must still be closed.
	eng := &Engine{
		cfg: cfg, be: be, ownBE: own, invFreq: cfg.InvFreq(),
		scale: float32(1 / math.Sqrt(float64(cfg.HeadDim))),
		seqs:  map[stage.SeqID][]ops.KV{}, maxSeqs: opts.MaxSeqs, batch: opts.BatchSize,
	}
	e = eng
	defer func() {
		if err != nil {
			eng.Close()
		}
	}()
	m, err := safetensors.OpenModel(open)
	if err != nil {
		return nil, fmt.Errorf("loading %s: %w", dir, err)
	}
	defer m.Close()
	ops.Run(be, func() { eng.w, err = cfg.load(m, be, start, end, opts.Quant) })
	if err != nil {
		return nil, fmt.Errorf("loading %s: %w", dir, err)
	}
	e.loaded = m.Stats()
	e.info = stage.Info{
		Arch: cfg.Arch, Layers: cfg.Layers, Embd: cfg.Hidden, Vocab: cfg.Vocab,
		Start: start, End: end, Context: opts.Context, MaxSeqs: opts.MaxSeqs,
		WireDType: opts.WireDType, Engine: be.Name(), Backend: be.Device(),
	}
	return e, nil
}

// Info describes the stage.
func (e *Engine) Info() stage.Info { return e.info }

// Config is the model's parsed config.json.
func (e *Engine) Config() *Config { return e.cfg }

// WeightBytes is the memory the backend holds for the stage's weights.
func (e *Engine) WeightBytes() uint64 {
	if e.w == nil {
		return 0
	}
	return e.w.bytes
}

// LoadStats counts the bytes read from the model's files while loading:
// the index, the headers of the shards the stage's tensors are in, and
// those tensors' data.
func (e *Engine) LoadStats() safetensors.Stats { return e.loaded }

// Open reserves cache space for seq.
func (e *Engine) Open(seq stage.SeqID) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return errors.New("stage: engine is closed")
	}
	if _, ok := e.seqs[seq]; ok {
		return fmt.Errorf("%w: %d", stage.ErrSeqExists, seq)
	}
	if len(e.seqs) >= e.maxSeqs {
		return fmt.Errorf("%w (%d sequences open)", stage.ErrNoSlot, len(e.seqs))
	}
	kvs := make([]ops.KV, e.info.End-e.info.Start)
	for i := range kvs {
		kv, err := e.be.NewKV(e.cfg.KVHeads, e.cfg.HeadDim, e.info.Context)
		if err != nil {
			for _, k := range kvs[:i] {
				k.Free()
			}
			return fmt.Errorf("allocating the KV cache: %w", err)
		}
		kvs[i] = kv
	}
	e.seqs[seq] = kvs
	return nil
}

// Trim drops seq's cached positions >= pos.
func (e *Engine) Trim(seq stage.SeqID, pos int32) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	kvs, ok := e.seqs[seq]
	if !ok {
		return fmt.Errorf("%w: %d", stage.ErrUnknownSeq, seq)
	}
	for _, kv := range kvs {
		kv.Trim(int(max(pos, 0)))
	}
	return nil
}

// Release frees seq's cache.
func (e *Engine) Release(seq stage.SeqID) error {
	e.mu.Lock()
	defer e.mu.Unlock()
	kvs, ok := e.seqs[seq]
	if !ok {
		return fmt.Errorf("%w: %d", stage.ErrUnknownSeq, seq)
	}
	ops.Run(e.be, func() {
		for _, kv := range kvs {
			kv.Free()
		}
	})
	delete(e.seqs, seq)
	return nil
}

// Close frees the engine's memory.
func (e *Engine) Close() error {
	e.mu.Lock()
	defer e.mu.Unlock()
	if e.closed {
		return nil
	}
	e.closed = true
	if e.be == nil {
		return nil
	}
	ops.Run(e.be, func() {
		for _, kvs := range e.seqs {
			for _, kv := range kvs {
				kv.Free()
			}
		}
		if e.w != nil {
			e.w.free(e.be)
		}
	})
	e.seqs = nil
	if e.ownBE && e.be != nil {
		return e.be.Close()
	}
	return nil
}
