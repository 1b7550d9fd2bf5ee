package main

import (
	"context"
	"fmt"
	"os"
	"strings"

	"github.com/meshnode/meshnode/ggufstage/synth"

	"github.com/meshnode/meshnode/node"
)

func runGenModel(_ context.Context, args []string) error {
	fs := newFlags("dev gen-model --out PATH [flags]", `Writes a GGUF with random weights of a real model's shape and a working
tokenizer in its metadata. Outputs are meaningless text; shapes, sizes and
speed are real. For tests and benchmarks: no weights are ever downloaded.

Presets: tiny (3 layers, n_embd 128), 1b (Llama 3.2 1B shape, vocab 32000),
8b (Llama 3 8B shape), 32b (Qwen2.5 32B shape, about 18 GB in Q4_0).`, `  meshnode dev gen-model --preset 1b --type q4_0 --out /tmp/1b-q4_0.gguf
  meshnode dev gen-model --arch qwen3 --preset tiny --type f16 --out /tmp/q3.gguf`)
	out := fs.String("out", "", "output path (required)")
	arch := fs.String("arch", "llama", "architecture: llama, qwen2, qwen3")
	preset := fs.String("preset", "tiny", "shape: tiny, 1b, 8b, 32b")
	typ := fs.String("type", "f16", "weights: f32, f16, q8_0, q4_0, q4_k (Q4_K_M mix)")
	layers := fs.Int("layers", 0, "override the preset's layer count")
	seed := fs.Uint64("seed", 1, "random seed (same seed, same file)")
	tied := fs.String("tied", "", "tie the output head to the embedding: true/false (default: per preset)")
	if err := parse(fs, args); err != nil {
		return err
	}
	if *out == "" {
		fs.Usage()
		return errUsage
	}
	var spec synth.Spec
	switch *preset {
	case "tiny":
		spec = synth.Tiny(*arch)
	case "1b":
		spec = synth.OneB(*arch)
	case "8b":
		spec = synth.EightB(*arch)
	case "32b":
		spec = synth.ThirtyTwoB(*arch)
	default:
		return fmt.Errorf("--preset %q: want tiny, 1b, 8b or 32b", *preset)
	}
	ft, ok := map[string]synth.FileType{"f32": synth.F32, "f16": synth.F16, "q8_0": synth.Q8_0, "q4_0": synth.Q4_0, "q4_k": synth.Q4_K, "q4_k_m": synth.Q4_K}[strings.ToLower(*typ)]
	if !ok {
		return fmt.Errorf("--type %q: want f32, f16, q8_0, q4_0 or q4_k", *typ)
	}
	spec.Type, spec.Seed = ft, *seed
	if *layers > 0 {
		spec.Layers = *layers
	}
	switch *tied {
	case "true":
		spec.Tied = true
	case "false":
		spec.Tied = false
	case "":
	default:
		return fmt.Errorf("--tied %q: want true or false", *tied)
	}
	progress := newProgress(os.Stderr)
	what := fmt.Sprintf("writing %s (%s %s %s)", *out, *arch, *preset, ft)
	if err := synth.Write(*out, spec, func(done, total int64) { progress(what, uint64(done), uint64(total)) }); err != nil {
		return err
	}
	fmt.Printf("wrote %s (%s)\n", *out, node.HumanBytes(uint64(synth.Size(spec))))
	return nil
}
