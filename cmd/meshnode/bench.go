package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"strconv"
	"strings"
	"time"

	"github.com/meshnode/meshnode/ggufstage"
	"github.com/meshnode/meshnode/node/bench"
)

func runBench(ctx context.Context, args []string) error {
	fs := newFlags("bench --model PATH [flags]", `Measures prefill tok/s (a 512-token prompt per sequence) and decode tok/s
(128 tokens) at 1 and 8 concurrent sequences, for meshnode's engine, for
ollama's stock engine, and for llama.cpp's own engine (llamacpp-ref, built
by 'make llamacpp-ref' from the llama.cpp sources of the pinned ollama
module with upstream's default CPU build) on the same file in the same run,
and prints meshnode's ratio to each. Runs alternate between the engines;
medians are reported. The decode/floor column is one-stream decode over the
memory-bandwidth ceiling: the bandwidth (the CPU's with the engines'
threads, or a GPU's from a copy on the device) over the weight bytes a
decode step reads.

With --mesh it measures the mesh instead: for each stage count of --stages
it starts that many meshnode processes on this machine (serve --split, then
join), waits for a plan of exactly that many stages, and measures, through
node 1's API, prefill tok/s of --streams concurrent --prefill-token prompts
(max_tokens 1) and decode tok/s of --streams concurrent streaming
completions (a --prompt of 64 token ids, --decode tokens, temperature 0 unless --temperature),
with the decode ratio to the 1-stage mesh. From the nodes' /metrics it
also shows where a step went: each stage's compute and the rest (hops,
framing, scheduling). --netns-delay D also runs every node in its own
network namespace (root and iproute2; a bridge on 10.77.1.0/24) with a
one-way delay D on every hop between two nodes: a netem qdisc on each
node's veth where the kernel has netem (sch_netem), else a delay relay in
this process (needs nft) that the nodes' libp2p connections (port 4001)
go through, each chunk forwarded D after it was read, both ways; the log
says which. 0 gives namespaces without delay.

Generate a model to measure with 'meshnode dev gen-model'.`, `  meshnode dev gen-model --preset 1b --type q4_0 --out /tmp/1b-q4_0.gguf
  meshnode bench --model /tmp/1b-q4_0.gguf --runs 3
  meshnode bench --mesh --model /tmp/1b-q4_0.gguf
  sudo meshnode bench --mesh --model /tmp/1b-q4_0.gguf --stages 1,2,3 --netns-delay 1ms`)
	var cfg bench.Config
	fs.StringVar(&cfg.Model, "model", "", "GGUF model to measure (required)")
	fs.IntVar(&cfg.Threads, "threads", 0, "CPU threads; 0 = as serve: a thread per 32 MiB of a stage's weights, up to all cores")
	fs.IntVar(&cfg.PromptTokens, "prompt", 512, "prompt tokens per sequence; decode steps start after them, and attention's share of a step grows with the position")
	fs.IntVar(&cfg.DecodeTokens, "decode", 128, "decode steps")
	fs.IntVar(&cfg.Runs, "runs", 1, "repetitions, medians reported; with --mesh, rounds that form every mesh in turn, so drift hits all stage counts alike")
	fs.Var(switchFlag{&cfg.FlashAttn}, "flash-attn", "the fused attention kernel in both engines (and every node): auto (on GPUs), on, off")
	fs.BoolVar(&cfg.SkipReference, "no-reference", false, "skip ollama's stock engine")
	fs.StringVar(&cfg.Device, "device", "auto", "where both engines run: auto, cpu, cuda")
	llamacpp := fs.String("llamacpp", "auto", "llamacpp-ref program (make llamacpp-ref): llama.cpp's own engine, measured as a third engine on the CPU; auto = the one beside this executable, if any; none = skip")
	streams := fs.String("streams", "1,8", "comma-separated concurrent sequence counts")
	mesh := fs.Bool("mesh", false, "measure meshes of --stages processes on this machine through the OpenAI API")
	stages := fs.String("stages", "1,2,3", "with --mesh: comma-separated stage (process) counts")
	netnsDelay := fs.String("netns-delay", "", "with --mesh: also run each node in its own network namespace, each hop between nodes delayed this much (netem, else a delay relay; e.g. 1ms; 0 = none; needs root)")
	netnsOnly := fs.Bool("netns-only", false, "with --mesh and --netns-delay: skip the loopback meshes")
	gpuPerNode := fs.Bool("gpu-per-node", false, "with --mesh: node i sees only GPU i-1 (CUDA_VISIBLE_DEVICES)")
	workDir := fs.String("work-dir", "", "with --mesh: the folder for the nodes' data and logs, whose logs stay after the run (default: a temporary one, removed unless a run fails)")
	profileDir := fs.String("profile-dir", "", "with --mesh: after measuring, save a CPU profile of every node (go tool pprof) decoding at the first and last --streams count into this folder")
	trace := fs.Bool("trace", false, "with --profile-dir: also save a one-second Go execution trace of every node (go tool trace)")
	var pipelining ggufstage.Switch
	fs.Var(switchFlag{&pipelining}, "pipelining", "with --mesh: the nodes' serve --pipelining: auto (their default: when every stage has a GPU of its own, as with --gpu-per-node), on, off")
	prefill := fs.Int("prefill", 512, "with --mesh: prompt tokens per stream of the prefill measurement; -1 skips it")
	wire := fs.String("wire-dtype", "", "with --mesh: activations between stages (f16 or f32; default the nodes')")
	busyPoll := fs.String("busy-poll", "", "with --mesh: the nodes' --busy-poll (auto, off or a duration; default the nodes')")
	temperature := fs.Float64("temperature", 0, "with --mesh: the timed requests' temperature (0: greedy; above 0 the last stage samples every token from its logits on the host, as for OpenAI's default of 1)")
	var nodeArgs repeated
	fs.Var(&nodeArgs, "node-arg", "with --mesh: one more flag for every node's serve or join, e.g. --node-arg=--decode-graphs=on (repeatable)")
	if err := parse(fs, args); err != nil {
		return err
	}
	if cfg.Model == "" {
		fs.Usage()
		return errUsage
	}
	var err error
	if cfg.Streams, err = parseCounts("--streams", *streams); err != nil {
		return err
	}
	switch *llamacpp {
	case "none", "":
	case "auto":
		if cfg.LlamaCpp = bench.FindLlamaCpp(); cfg.LlamaCpp == "" && !*mesh {
			fmt.Fprintln(os.Stderr, "llama.cpp: not measured; 'make llamacpp-ref' builds its reference engine beside meshnode")
		}
	default:
		if _, err := os.Stat(*llamacpp); err != nil {
			return fmt.Errorf("--llamacpp: %w", err)
		}
		cfg.LlamaCpp = *llamacpp
	}
	if *mesh {
		mc := bench.MeshConfig{
			Model: cfg.Model, Streams: cfg.Streams, DecodeTokens: cfg.DecodeTokens, Runs: cfg.Runs,
			Threads: cfg.Threads, SkipLoopback: *netnsOnly, PrefillTokens: *prefill,
			ProfileDir: *profileDir, Trace: *trace, WorkDir: *workDir, Temperature: *temperature,
		}
		if !(*temperature >= 0 && *temperature <= 2) {
			return fmt.Errorf("--temperature %v: want 0 to 2", *temperature)
		}
		set := map[string]bool{}
		fs.Visit(func(f *flag.Flag) { set[f.Name] = true })
		if set["prompt"] {
			mc.PromptTokens = cfg.PromptTokens // else the mesh's own default, 64
		}
		if cfg.FlashAttn != ggufstage.Auto {
			mc.NodeArgs = append(mc.NodeArgs, "--flash-attn="+cfg.FlashAttn.String())
		}
		if cfg.Device != "" && cfg.Device != "auto" {
			mc.NodeArgs = append(mc.NodeArgs, "--device", cfg.Device)
		}
		if pipelining != ggufstage.Auto {
			mc.NodeArgs = append(mc.NodeArgs, "--pipelining="+pipelining.String())
		}
		if *wire != "" {
			mc.NodeArgs = append(mc.NodeArgs, "--wire-dtype", *wire)
		}
		if *busyPoll != "" {
			var d time.Duration
			if err := (busyPollFlag{&d}).Set(*busyPoll); err != nil {
				return fmt.Errorf("--busy-poll %w", err)
			}
			mc.NodeArgs = append(mc.NodeArgs, "--busy-poll", *busyPoll)
		}
		mc.NodeArgs = append(mc.NodeArgs, nodeArgs...)
		mc.GPUPerNode = *gpuPerNode
		if mc.Stages, err = parseCounts("--stages", *stages); err != nil {
			return err
		}
		if *netnsDelay != "" {
			d, err := time.ParseDuration(*netnsDelay)
			if *netnsDelay == "0" {
				d, err = 0, nil
			}
			if err != nil || d < 0 {
				return fmt.Errorf("--netns-delay %q: want a duration such as 1ms, or 0", *netnsDelay)
			}
			mc.Netns, mc.NetnsDelay = true, d
		} else if *netnsOnly {
			return fmt.Errorf("--netns-only needs --netns-delay")
		}
		rows, err := bench.RunMesh(ctx, mc, os.Stderr)
		if err != nil {
			return err
		}
		bench.PrintMesh(os.Stdout, rows)
		return nil
	}
	rows, err := bench.Run(ctx, cfg, os.Stderr)
	if err != nil {
		return err
	}
	bench.Print(os.Stdout, rows)
	return nil
}

// parseCounts reads a comma-separated list of positive counts.
func parseCounts(name, list string) ([]int, error) {
	var out []int
	for _, s := range strings.Split(list, ",") {
		n, err := strconv.Atoi(strings.TrimSpace(s))
		if err != nil || n < 1 {
			return nil, fmt.Errorf("%s: bad count %q", name, s)
		}
		out = append(out, n)
	}
	return out, nil
}

// repeated is a flag that may be given several times.
type repeated []string

func (r *repeated) String() string     { return strings.Join(*r, " ") }
func (r *repeated) Set(v string) error { *r = append(*r, v); return nil }
