// Package bench measures prefill and decode throughput of meshnode's engine
// against ollama's stock engine on the same file, in the same run, so that
// speed is reported as a ratio to a reference measured side by side.
package bench

import (
	"context"
	"fmt"
	"io"
	"math/rand/v2"
	"slices"
	"time"

	"github.com/meshnode/meshnode/ggufstage"
	"github.com/meshnode/meshnode/stage"
)

// Config of a benchmark.
type Config struct {
	Model         string
	Threads       int
	PromptTokens  int   // default 512
	DecodeTokens  int   // default 128
	Streams       []int // concurrent sequences; default 1 and 8
	Runs          int   // repetitions; the median is reported
	FlashAttn     ggufstage.Switch
	SkipReference bool   // measure only meshnode's engine
	Device        string // "cpu", "cuda", "auto" (see ggufstage.Options.Device)
	// LlamaCpp is the path of llamacpp-ref (deploy/llamacpp): llama.cpp's
	// own engine, built from the pinned module's sources, measured as a
	// third engine. Empty: not measured.
	LlamaCpp string
}

// Row is one measurement.
type Row struct {
	Engine     string
	Streams    int
	PrefillTPS float64
	DecodeTPS  float64
	// FloorTPS bounds one-stream decode: the memory bandwidth measured in
	// the same run (the CPU's reads, a GPU's copy) over the weight bytes
	// one step reads. 0 where not measured (several streams, a GPU whose
	// bandwidth could not be measured).
	FloorTPS float64
	// Prompt and Decode: each sequence's decode steps, from the position
	// after its prompt. Attention's share of a step grows with the
	// position; the floor counts only the weights.
	Prompt, Decode int
}

// runner is the common surface of the two engines.
type runner interface {
	forward(b *stage.Batch) ([]float32, error)
	// picks runs b, whose every output row is sampled greedily, and returns
	// each output row's pick.
	picks(b *stage.Batch) ([]int32, error)
	open(seq stage.SeqID) error
	release(seq stage.SeqID) error
	vocab() int
	close()
}

type meshRunner struct{ e *ggufstage.Engine }

func (r meshRunner) forward(b *stage.Batch) ([]float32, error) {
	out, err := r.e.Forward(context.Background(), b)
	if err != nil {
		return nil, err
	}
	return out.Logits, nil
}

// picks asks the engine for greedy picks, as serve's last stage does for
// greedy requests (stage.Batch.PicksOnly): a GPU engine then takes each
// row's argmax on the device, where host sampling of a 128K vocabulary
// costs about 0.1 ms a row.
func (r meshRunner) picks(b *stage.Batch) ([]int32, error) {
	b.PicksOnly = true
	out, err := r.e.Forward(context.Background(), b)
	if err != nil {
		return nil, err
	}
	defer out.Release()
	if out.Picks != nil {
		return out.Picks, stage.CheckPicks(out.Picks, b, r.e.Info().Vocab)
	}
	return greedyRows(out.Logits, r.e.Info().Vocab), nil
}

// greedyRows is each row's greedy pick.
func greedyRows(logits []float32, vocab int) []int32 {
	picks := make([]int32, len(logits)/vocab)
	for i := range picks {
		picks[i] = stage.GreedyPick(logits[i*vocab : (i+1)*vocab])
	}
	return picks
}

func (r meshRunner) open(s stage.SeqID) error    { return r.e.Open(s) }
func (r meshRunner) release(s stage.SeqID) error { return r.e.Release(s) }
func (r meshRunner) vocab() int                  { return r.e.Info().Vocab }
func (r meshRunner) close()                      { r.e.Close() }

type stockRunner struct{ s *ggufstage.Stock }

func (r stockRunner) forward(b *stage.Batch) ([]float32, error) { return r.s.Forward(b) }
func (r stockRunner) picks(b *stage.Batch) ([]int32, error) {
	logits, err := r.s.Forward(b)
	if err != nil {
		return nil, err
	}
	return greedyRows(logits, r.s.Vocab()), nil
}
func (r stockRunner) open(stage.SeqID) error      { return nil }
func (r stockRunner) release(s stage.SeqID) error { return r.s.Release(s) }
func (r stockRunner) vocab() int                  { return r.s.Vocab() }
func (r stockRunner) close()                      { r.s.Close() }

func (c *Config) defaults() {
	if c.PromptTokens <= 0 {
		c.PromptTokens = 512
	}
	if c.DecodeTokens <= 0 {
		c.DecodeTokens = 128
	}
	if len(c.Streams) == 0 {
		c.Streams = []int{1, 8}
	}
	if c.Runs <= 0 {
		c.Runs = 1
	}
}

// Run measures both engines and returns one row per engine and stream
// count, with medians over the runs. Runs of the two engines alternate so
// that machine drift hits both alike.
func Run(ctx context.Context, cfg Config, log io.Writer) ([]Row, error) {
	cfg.defaults()
	if cfg.Threads <= 0 {
		cfg.Threads = ggufstage.DefaultThreads(cfg.Model) // every engine alike, and the bandwidth
	}
	maxStreams := slices.Max(cfg.Streams)
	opts := ggufstage.Options{
		Threads: cfg.Threads, MaxSeqs: maxStreams, Context: cfg.PromptTokens + cfg.DecodeTokens + 8,
		BatchSize: cfg.PromptTokens, FlashAttention: cfg.FlashAttn, Device: cfg.Device,
	}
	info, err := ggufstage.ReadInfo(cfg.Model)
	if err != nil {
		return nil, err
	}
	fmt.Fprintf(log, "model %s: %s, %d layers, n_embd %d, vocab %d, %s\n", cfg.Model, info.Arch, info.Layers, info.Embd, info.Vocab, info.FileType)

	perLayer, _, head, _ := info.Sizes()
	step := head // the bytes of weights a one-stream decode step reads
	for _, b := range perLayer {
		step += b
	}
	// A GPU's bandwidth is measured before the engine loads, while the
	// device is idle (ggufstage.DeviceBandwidth).
	gpuBW, gpuWhy := gpuBandwidth(cfg)
	eng, err := ggufstage.Open(cfg.Model, 0, info.Layers, opts)
	if err != nil {
		return nil, err
	}
	var floor float64
	switch backend := eng.Info().Backend; {
	case backend == "CPU":
		bw := ggufstage.ReadBandwidth(cfg.Threads, 1<<30)
		floor = bw / float64(step)
		fmt.Fprintf(log, "memory read bandwidth, threads as the engines: %.1f GB/s; a decode step reads %.2f GB of weights: floor %.1f tok/s at 1 stream\n",
			bw/1e9, float64(step)/1e9, floor)
	case gpuBW > 0:
		floor = gpuBW / float64(step)
		fmt.Fprintf(log, "%s memory bandwidth (ggml copying 256 MiB on the device, bytes read and written): %.1f GB/s; a decode step reads %.2f GB of weights: floor %.1f tok/s at 1 stream\n",
			backend, gpuBW/1e9, float64(step)/1e9, floor)
	default:
		fmt.Fprintf(log, "%s memory bandwidth not measured (%s): no floor\n", backend, gpuWhy)
	}
	if cfg.LlamaCpp != "" && eng.Info().Backend != "CPU" {
		fmt.Fprintf(log, "llama.cpp: not measured; its reference build runs on the CPU and meshnode's engine on %s\n", eng.Info().Backend)
		cfg.LlamaCpp = ""
	}
	runners := []struct {
		name string
		r    runner
	}{{"meshnode", meshRunner{eng}}}
	if !cfg.SkipReference {
		st, err := ggufstage.OpenStock(cfg.Model, opts)
		if err != nil {
			eng.Close()
			return nil, err
		}
		runners = append(runners, struct {
			name string
			r    runner
		}{"ollama", stockRunner{st}})
	}
	defer func() {
		for _, r := range runners {
			r.r.close()
		}
	}()

	type key struct {
		engine  string
		streams int
	}
	// Every engine measured, in the order runs alternate between them.
	type engine struct {
		name    string
		measure func(streams int, seed uint64) (prefill, decode float64, err error)
	}
	var engines []engine
	for _, r := range runners {
		engines = append(engines, engine{r.name, func(n int, seed uint64) (float64, float64, error) { return measure(r.r, cfg, n, seed) }})
	}
	if cfg.LlamaCpp != "" {
		engines = append(engines, engine{LlamaCppEngine, func(n int, seed uint64) (float64, float64, error) { return measureLlamaCpp(ctx, cfg, n, seed) }})
	}
	pre := map[key][]float64{}
	dec := map[key][]float64{}
	for run := range cfg.Runs {
		for _, n := range cfg.Streams {
			for _, e := range engines {
				if err := ctx.Err(); err != nil {
					return nil, err
				}
				p, d, err := e.measure(n, uint64(run))
				if err != nil {
					return nil, fmt.Errorf("%s, %d streams: %w", e.name, n, err)
				}
				k := key{e.name, n}
				pre[k] = append(pre[k], p)
				dec[k] = append(dec[k], d)
				fmt.Fprintf(log, "run %d  %-9s streams %d  prefill %8.1f tok/s  decode %7.2f tok/s\n", run+1, e.name, n, p, d)
			}
		}
	}
	var rows []Row
	for _, n := range cfg.Streams {
		for _, e := range engines {
			k := key{e.name, n}
			row := Row{Engine: e.name, Streams: n, PrefillTPS: median(pre[k]), DecodeTPS: median(dec[k]),
				Prompt: cfg.PromptTokens, Decode: cfg.DecodeTokens}
			if n == 1 {
				row.FloorTPS = floor
			}
			rows = append(rows, row)
		}
	}
	return rows, nil
}

func median(xs []float64) float64 {
	s := slices.Clone(xs)
	slices.Sort(s)
	if len(s) == 0 {
		return 0
	}
	if len(s)%2 == 1 {
		return s[len(s)/2]
	}
	return (s[len(s)/2-1] + s[len(s)/2]) / 2
}

// measure prefills n sequences with PromptTokens each (one sequence per
// pass, as a server prefills a new request), then decodes DecodeTokens steps
// with all n sequences in each pass.
func measure(r runner, cfg Config, n int, seed uint64) (prefill, decode float64, err error) {
	rng := rand.New(rand.NewPCG(seed, 7))
	vocab := r.vocab()
	seqs := make([]stage.SeqID, n)
	for i := range seqs {
		seqs[i] = stage.SeqID(i + 1)
		if err := r.open(seqs[i]); err != nil {
			return 0, 0, err
		}
	}
	defer func() {
		for _, s := range seqs {
			r.release(s)
		}
	}()
	// Warm up with a pass of the sizes timed below (a prompt-sized one and a
	// decode-sized one), then drop it: first passes pay one-time costs
	// (GPU kernels and library handles, scheduler buffers) that are not speed.
	warm := stage.Batch{Outputs: []int{cfg.PromptTokens - 1}}
	for p := range cfg.PromptTokens {
		warm.Seqs = append(warm.Seqs, seqs[0])
		warm.Pos = append(warm.Pos, int32(p))
		warm.Tokens = append(warm.Tokens, int32(rng.IntN(vocab)))
	}
	if _, err := r.forward(&warm); err != nil {
		return 0, 0, err
	}
	step := stage.Batch{Seqs: seqs[:1], Pos: []int32{int32(cfg.PromptTokens)}, Tokens: []int32{1}, Outputs: []int{0}}
	if _, err := r.forward(&step); err != nil {
		return 0, 0, err
	}
	if err := r.release(seqs[0]); err != nil {
		return 0, 0, err
	}
	if err := r.open(seqs[0]); err != nil {
		return 0, 0, err
	}
	last := make([]int32, n)
	start := time.Now()
	for i, s := range seqs {
		b := stage.Batch{Outputs: []int{cfg.PromptTokens - 1}}
		for p := range cfg.PromptTokens {
			b.Seqs = append(b.Seqs, s)
			b.Pos = append(b.Pos, int32(p))
			b.Tokens = append(b.Tokens, int32(rng.IntN(vocab)))
		}
		logits, err := r.forward(&b)
		if err != nil {
			return 0, 0, err
		}
		last[i] = stage.GreedyPick(logits)
	}
	prefill = float64(n*cfg.PromptTokens) / time.Since(start).Seconds()

	start = time.Now()
	for step := range cfg.DecodeTokens {
		b := stage.Batch{}
		for i, s := range seqs {
			b.Seqs = append(b.Seqs, s)
			b.Pos = append(b.Pos, int32(cfg.PromptTokens+step))
			b.Tokens = append(b.Tokens, last[i])
			b.Outputs = append(b.Outputs, i)
		}
		picks, err := r.picks(&b)
		if err != nil {
			return 0, 0, err
		}
		if len(picks) != len(seqs) {
			return 0, 0, fmt.Errorf("decode step %d: %d picks for %d sequences", step, len(picks), len(seqs))
		}
		copy(last, picks)
	}
	decode = float64(n*cfg.DecodeTokens) / time.Since(start).Seconds()
	return prefill, decode, nil
}

// Print writes the table with meshnode's ratios to each reference engine
// (ollama's stock engine, llama.cpp) and, for one-stream CPU decode, to the
// memory-bandwidth floor.
func Print(w io.Writer, rows []Row) {
	refs := map[string]map[int]Row{}
	var order []string
	for _, r := range rows {
		if r.Engine == "meshnode" {
			continue
		}
		if refs[r.Engine] == nil {
			refs[r.Engine] = map[int]Row{}
			order = append(order, r.Engine)
		}
		refs[r.Engine][r.Streams] = r
	}
	fmt.Fprintf(w, "\n%-9s %7s %14s %14s", "engine", "streams", "prefill tok/s", "decode tok/s")
	for _, name := range order {
		fmt.Fprintf(w, " %22s", "× "+name+" (pre/dec)")
	}
	fmt.Fprintf(w, " %12s\n", "decode/floor")
	for _, r := range rows {
		fmt.Fprintf(w, "%-9s %7d %14.1f %14.2f", r.Engine, r.Streams, r.PrefillTPS, r.DecodeTPS)
		for _, name := range order {
			ratio := ""
			if o, ok := refs[name][r.Streams]; ok && r.Engine == "meshnode" && o.PrefillTPS > 0 && o.DecodeTPS > 0 {
				ratio = fmt.Sprintf("%.2f / %.2f", r.PrefillTPS/o.PrefillTPS, r.DecodeTPS/o.DecodeTPS)
			}
			fmt.Fprintf(w, " %22s", ratio)
		}
		fr := ""
		if r.FloorTPS > 0 {
			// Three places: a share near a goal such as 0.70 must not round onto it.
			fr = fmt.Sprintf("%.3f", r.DecodeTPS/r.FloorTPS)
		}
		fmt.Fprintf(w, " %12s\n", fr)
	}
	if len(rows) > 0 && rows[0].Decode > 0 {
		fmt.Fprintf(w, "(decode: %d steps a sequence from position %d, after its --prompt; the floor counts the weights a step reads, not its KV cache)\n",
			rows[0].Decode, rows[0].Prompt)
	}
}

// gpuBandwidth measures the memory bandwidth of the GPU that cfg's engine
// will run on, or says why it cannot: 0 and a reason on the CPU too.
func gpuBandwidth(cfg Config) (float64, string) {
	d, err := ggufstage.PickDevice(cfg.Model, cfg.Device)
	switch {
	case err != nil:
		return 0, err.Error()
	case d == nil:
		return 0, "the CPU"
	}
	bw, err := ggufstage.DeviceBandwidth(*d)
	if err != nil {
		return 0, err.Error()
	}
	return bw, ""
}
