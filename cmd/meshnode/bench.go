package main

import (
	"context"
	"fmt"
	"os"
	"strconv"
	"strings"

	"github.com/meshnode/meshnode/node/bench"
)

func runBench(ctx context.Context, args []string) error {
	fs := newFlags("bench --model PATH [flags]", `Measures prefill tok/s (a 512-token prompt per sequence) and decode tok/s
(128 tokens) at 1 and 8 concurrent sequences, for meshnode's engine and for
ollama's stock engine on the same file in the same run, and prints the
ratio. Runs alternate between the engines; medians are reported.

Generate a model to measure with 'meshnode dev gen-model'.`, `  meshnode dev gen-model --preset 1b --type q4_0 --out /tmp/1b-q4_0.gguf
  meshnode bench --model /tmp/1b-q4_0.gguf --runs 3`)
	var cfg bench.Config
	fs.StringVar(&cfg.Model, "model", "", "GGUF model to measure (required)")
	fs.IntVar(&cfg.Threads, "threads", 0, "CPU threads; 0 = all cores")
	fs.IntVar(&cfg.PromptTokens, "prompt", 512, "prompt tokens per sequence")
	fs.IntVar(&cfg.DecodeTokens, "decode", 128, "decode steps")
	fs.IntVar(&cfg.Runs, "runs", 1, "repetitions (median reported)")
	fs.BoolVar(&cfg.FlashAttn, "flash-attn", false, "use the fused attention kernel in both engines")
	fs.BoolVar(&cfg.SkipReference, "no-reference", false, "skip ollama's stock engine")
	streams := fs.String("streams", "1,8", "comma-separated concurrent sequence counts")
	if err := parse(fs, args); err != nil {
		return err
	}
	if cfg.Model == "" {
		fs.Usage()
		return errUsage
	}
	for _, s := range strings.Split(*streams, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil || n < 1 {
			return fmt.Errorf("--streams: bad count %q", s)
		}
		cfg.Streams = append(cfg.Streams, n)
	}
	rows, err := bench.Run(ctx, cfg, os.Stderr)
	if err != nil {
		return err
	}
	bench.Print(os.Stdout, rows)
	return nil
}
