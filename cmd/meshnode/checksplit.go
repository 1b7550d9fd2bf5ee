package main

import (
	"context"
	"fmt"
	"math"
	"os"
	"path/filepath"

	"github.com/meshnode/meshnode/ggufstage"
	"github.com/meshnode/meshnode/stage"
)

// runCheckSplit checks split equivalence on a device: greedy tokens of a
// model split into stages (in one process, activations through the wire
// dtype) against the same model in one stage, and the one-stage logits
// against the CPU's.
func runCheckSplit(_ context.Context, args []string) error {
	fs := newFlags("dev check-split --model PATH [flags]", `Runs a model whole and split into stages on one device, in one process,
and compares: greedy tokens of the split run against the whole one for
--steps tokens (they must be equal), and the whole run's first logits
against the CPU's (relative L2 difference at most --logits-tol; the max
|difference| is reported too). For checking GPU backends.

The split's activations cross in f32 by default, as between the nodes of
one machine, so the split must give the same bits. --wire-dtype f16 shows
what the f16 wire between machines does instead: its rounding can flip a
greedy pick where two logits nearly tie, as they often do in random-weight
models (dev gen-model), so a split over f16 may part from the whole run
after some tokens there.`, `  meshnode dev check-split --model 1b-q4_0.gguf --device cuda --split 8 --steps 64`)
	path := fs.String("model", "", "GGUF model (required)")
	device := fs.String("device", "cuda", "device for both runs: cuda, cpu, auto")
	at := fs.Int("split", 0, "first layer of the second stage (default: half)")
	steps := fs.Int("steps", 64, "greedy tokens to compare")
	wire := fs.String("wire-dtype", "f32", "activations between the stages: f32 (exact) or f16 (the wire between machines)")
	cpu := fs.Bool("cpu-logits", true, "also compare the first logits with the CPU's")
	tol := fs.Float64("logits-tol", 0.1, "the largest relative L2 difference of the first logits from the CPU's that passes (ggml's own CPU and CUDA kernels differ by 3-5% on generated models)")
	if err := parse(fs, args); err != nil {
		return err
	}
	if *path == "" {
		fs.Usage()
		return errUsage
	}
	if !(*tol >= 0) {
		return fmt.Errorf("--logits-tol %v: want a relative difference of 0 or more", *tol)
	}
	dt, err := stage.ParseDType(*wire)
	if err != nil {
		return err
	}
	info, err := ggufstage.ReadInfo(*path)
	if err != nil {
		return err
	}
	if *at <= 0 || *at >= info.Layers {
		*at = info.Layers / 2
	}
	dir, err := os.MkdirTemp("", "meshnode-check-")
	if err != nil {
		return err
	}
	defer os.RemoveAll(dir)
	opts := ggufstage.Options{MaxSeqs: 1, Context: *steps + 64, Device: *device}
	open := func(start, end int, o ggufstage.Options) (*ggufstage.Engine, error) {
		p, err := ggufstage.Slice(*path, filepath.Join(dir, "data"), start, end, nil)
		if err != nil {
			return nil, err
		}
		return ggufstage.Open(p, start, end, o)
	}
	prompt := []int32{1}
	for i := 1; i < 8; i++ {
		prompt = append(prompt, int32(i*37%info.Vocab))
	}
	gen := func(stages []*ggufstage.Engine) ([]int32, []float32, error) {
		for _, s := range stages {
			if err := s.Open(1); err != nil {
				return nil, nil, err
			}
			defer s.Release(1)
		}
		var out []int32
		var first []float32
		b := stage.Batch{Seqs: make([]stage.SeqID, len(prompt)), Tokens: prompt, Outputs: []int{len(prompt) - 1}}
		for i := range prompt {
			b.Pos = append(b.Pos, int32(i))
			b.Seqs[i] = 1
		}
		for step := range *steps {
			var hidden *stage.Activation
			var logits []float32
			for i, s := range stages {
				sb := b
				if i > 0 {
					sb.Tokens, sb.Hidden = nil, hidden
				}
				o, err := s.Forward(context.Background(), &sb)
				if err != nil {
					return nil, nil, err
				}
				if o.Hidden != nil {
					f, _ := o.Hidden.Float32()
					hidden, _ = stage.NewActivation(dt, o.Hidden.Rows, o.Hidden.Cols, f)
					o.Release() // copied out: the engine may have it back
				}
				logits = o.Logits
			}
			if step == 0 {
				first = logits
			}
			next := int32(0)
			for j, v := range logits {
				if v > logits[next] {
					next = int32(j)
				}
			}
			out = append(out, next)
			b = stage.Batch{Seqs: []stage.SeqID{1}, Pos: []int32{int32(len(prompt) + step)}, Tokens: []int32{next}, Outputs: []int{0}}
		}
		return out, first, nil
	}
	whole, err := open(0, info.Layers, opts)
	if err != nil {
		return err
	}
	wantToks, wantLogits, err := gen([]*ggufstage.Engine{whole})
	backend := whole.Info().Backend
	whole.Close()
	if err != nil {
		return err
	}
	a, err := open(0, *at, opts)
	if err != nil {
		return err
	}
	b, err := open(*at, info.Layers, opts)
	if err != nil {
		return err
	}
	gotToks, _, err := gen([]*ggufstage.Engine{a, b})
	a.Close()
	b.Close()
	if err != nil {
		return err
	}
	var logitsErr error
	same := 0
	for same < len(wantToks) && gotToks[same] == wantToks[same] {
		same++
	}
	fmt.Printf("model %s on %s: split [0,%d)+[%d,%d) over %s wire: %d/%d greedy tokens equal the whole run\n",
		filepath.Base(*path), backend, *at, *at, info.Layers, dt, same, len(wantToks))
	if *cpu && backend != "CPU" {
		c, err := open(0, info.Layers, ggufstage.Options{MaxSeqs: 1, Context: *steps + 64, Device: "cpu", NoRepack: true})
		if err != nil {
			return err
		}
		opts := *steps
		*steps = 1
		_, cpuLogits, err := gen([]*ggufstage.Engine{c})
		*steps = opts
		c.Close()
		if err != nil {
			return err
		}
		var d, scale float64
		for i := range cpuLogits {
			d = max(d, math.Abs(float64(cpuLogits[i]-wantLogits[i])))
			scale = max(scale, math.Abs(float64(cpuLogits[i])))
		}
		rel := relativeL2(wantLogits, cpuLogits)
		fmt.Printf("first logits, %s vs CPU: relative L2 difference %.3g (at most %.3g passes), max |diff| %.3g (max |logit| %.3g)\n",
			backend, rel, *tol, d, scale)
		if !(rel <= *tol) {
			logitsErr = fmt.Errorf("the %s run's first logits are off the CPU's by %.3g (relative L2), more than --logits-tol %.3g", backend, rel, *tol)
		}
	}
	if same != len(wantToks) {
		if dt != stage.F32 {
			return fmt.Errorf("split run over the %s wire diverged at token %d (its rounding can flip near ties; --wire-dtype f32 checks the split itself)", dt, same)
		}
		return fmt.Errorf("split run diverged at token %d", same)
	}
	return logitsErr
}

// relativeL2 is |a-b| / |b| over the vectors (b the reference): 0 for equal
// vectors, +Inf where b is all zeros and a is not, NaN where either holds a
// NaN, which no tolerance passes.
func relativeL2(a, b []float32) float64 {
	if len(a) != len(b) {
		return math.Inf(1)
	}
	var num, den float64
	for i := range a {
		d := float64(a[i]) - float64(b[i])
		num += d * d
		den += float64(b[i]) * float64(b[i])
	}
	if num == 0 {
		return 0
	}
	return math.Sqrt(num / den)
}
