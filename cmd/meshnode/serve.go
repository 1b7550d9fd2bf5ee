package main

import (
	"context"
	"fmt"
	"os"

	"github.com/meshnode/meshnode/node"
)

func runServe(ctx context.Context, args []string) error {
	fs := newFlags("serve [flags]", `Loads a GGUF model and serves it through an OpenAI-compatible API
(/v1/chat/completions, /v1/completions, /v1/models, /health).

With no --model it serves the small default model, stories260K: from
../shared/models when present, else downloaded once from Hugging Face
(ggml-org/models) into the cache.`, `  meshnode serve
  meshnode serve --model ./qwen2.5-0.5b-instruct-q4_0.gguf --ctx 8192 --parallel 8
  meshnode serve --http 0.0.0.0:9337 --api-key "$(cat ~/.meshnode/api-key)"`)
	var cfg node.Config
	fs.StringVar(&cfg.Model, "model", "", "path to a GGUF model (llama, qwen2, qwen3 architectures); empty = the default model")
	fs.StringVar(&cfg.HTTPAddr, "http", node.DefaultHTTPAddr, "address of the HTTP API; beyond loopback it requires --api-key")
	fs.StringVar(&cfg.DataDir, "data-dir", node.DefaultDataDir(), "where slices, hashes and keys are kept")
	fs.StringVar(&cfg.APIKey, "api-key", "", "require this bearer key on /v1/* (required when --http is not loopback)")
	fs.IntVar(&cfg.Threads, "threads", 0, "CPU threads for compute; 0 = all cores")
	fs.IntVar(&cfg.Context, "ctx", 4096, "context length (positions) per sequence")
	fs.IntVar(&cfg.Parallel, "parallel", 4, "sequences generated at once (each gets --ctx positions of KV cache)")
	fs.IntVar(&cfg.BatchTokens, "batch", 512, "most tokens in one forward pass (prefill chunk size)")
	fs.IntVar(&cfg.QueueSize, "queue", 64, "requests that may wait for a free sequence before new ones get 429")
	fs.IntVar(&cfg.MaxTokensCap, "max-tokens", 4096, "upper bound on max_tokens of a request")
	fs.BoolVar(&cfg.FlashAttention, "flash-attn", false, "use ggml's fused attention kernel")
	fs.BoolVar(&cfg.NoRepack, "no-repack", false, "keep quantized weights in ggml's plain layout (slower on CPU)")
	logFormat := fs.String("log-format", "console", "log format: console or json")
	logLevel := fs.String("log-level", "info", "log level: debug, info, warn, error")
	if err := parse(fs, args); err != nil {
		return err
	}
	log, err := newLogger(*logFormat, *logLevel)
	if err != nil {
		return err
	}
	defer log.Sync()
	cfg.Logger = log
	cfg.Progress = newProgress(os.Stderr)
	cfg.Ready = func(addr string) {
		fmt.Fprintf(os.Stderr, "\nmeshnode is serving on http://%s/v1  (Ctrl-C to stop)\n\n", addr)
	}
	return node.Run(ctx, cfg)
}
