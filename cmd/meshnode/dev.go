package main

import (
	"context"
	"fmt"
)

func runDev(ctx context.Context, args []string) error {
	if len(args) == 0 || args[0] == "-h" || args[0] == "--help" {
		fmt.Println(`Usage: meshnode dev <tool> [flags]

Tools:
  gen-model   write a random-weight GGUF of a real shape (llama, qwen2, qwen3;
              f32, f16, q8_0, q4_0, q4_k) with a working tokenizer, for tests
              and benchmarks
  check-split check that a split run gives the whole run's greedy tokens
  kernel-report
              GPU time per kernel from deploy/gpu/ktrace.c's records

Examples:
  meshnode dev gen-model --preset 1b --type q4_0 --out /tmp/1b-q4_0.gguf
  meshnode dev gen-model --help`)
		return nil
	}
	switch args[0] {
	case "gen-model":
		return runGenModel(ctx, args[1:])
	case "check-split":
		return runCheckSplit(ctx, args[1:])
	case "kernel-report":
		return runKernelReport(ctx, args[1:])
	}
	return fmt.Errorf("unknown dev tool %q (try: gen-model, check-split, kernel-report)", args[0])
}
