package main

import (
	"context"
	"flag"
	"fmt"
	"os"
	"strings"
	"time"

	"github.com/meshnode/meshnode/ggufstage"
	"github.com/meshnode/meshnode/node"
	"github.com/meshnode/meshnode/stage"
)

// nodeFlags are the flags serve and join share.
type nodeFlags struct {
	cfg       node.Config
	listen    string
	maxMemory string
	wire      string
	logFormat string
	logLevel  string
	keyFile   string
	trust     string
	allow     string
}

func (f *nodeFlags) register(fs *flag.FlagSet) {
	c := &f.cfg
	fs.String("config", "", "read flags from this file: NAME = VALUE lines, [serve] and [join] sections (see deploy/meshnode.conf)")
	fs.StringVar(&c.HTTPAddr, "http", node.DefaultHTTPAddr, "address of the OpenAI API; beyond loopback it requires --api-key")
	fs.StringVar(&c.APIKey, "api-key", "", "require this bearer key on /v1/* and /api/* (required when --http is not loopback)")
	fs.StringVar(&f.keyFile, "api-key-file", "", "read the API key from this file (keeps it out of the process list)")
	fs.StringVar(&f.trust, "trust", "mesh-key", "who may join: mesh-key (anyone with the key) or allowlist (key holders listed in --allow-peer)")
	fs.StringVar(&f.allow, "allow-peer", "", "comma-separated peer IDs admitted with --trust allowlist")
	fs.StringVar(&c.DataDir, "data-dir", node.DefaultDataDir(), "where the peer key, mesh key, slices and hashes are kept")
	fs.StringVar(&f.listen, "listen", "", "comma-separated libp2p multiaddrs to listen on (default /ip4/0.0.0.0/tcp/4001, any free port if taken)")
	fs.IntVar(&c.GossipPort, "gossip-port", 0, "UDP+TCP port for membership gossip (default 4002, any free port if taken)")
	fs.StringVar(&c.MeshKey, "mesh-key", "", "the mesh's key (serve makes one and prints it; join needs it)")
	fs.BoolVar(&c.MDNS, "mdns", false, "find nodes of the same mesh on the LAN without addresses")
	fs.StringVar(&c.Layers, "layers", "", "pin this node to layers START:END of the model")
	fs.StringVar(&f.maxMemory, "max-memory", "", "cap the memory this node offers the planner, e.g. 6GiB or 512MB")
	fs.StringVar(&f.wire, "wire-dtype", "f16", "activation type between stages of different machines: f16 or f32 (stages of one machine, over local sockets, always exchange f32)")
	fs.Var(switchFlag{&c.Pipelining}, "pipelining", "keep a micro-batch in flight on every stage, so that several streams keep all stages busy: auto (when every stage has a machine or GPU of its own), on, off. Stages that share a GPU or a machine's cores are slower pipelined")
	fs.IntVar(&c.MicroBatches, "micro-batches", 0, "with pipelining: how many micro-batches the streams are split into, all in flight at once; 0 = one per stage. More than the stages can hide the hops between them, at the cost of smaller passes")
	fs.IntVar(&c.Threads, "threads", 0, "CPU threads for compute; 0 = a thread per 32 MiB of the stage's weights, up to all cores (a small model runs fastest on one)")
	fs.IntVar(&c.BatchTokens, "batch", 512, "most tokens in one forward pass (prefill chunk size)")
	fs.IntVar(&c.QueueSize, "queue", 64, "requests that may wait for a free sequence before new ones get 429")
	fs.IntVar(&c.MaxTokensCap, "max-tokens", 4096, "upper bound on max_tokens of a request")
	fs.Var(switchFlag{&c.BuildAhead}, "build-ahead", "on a decode step, build the next step's graph while this one computes: auto (on for layers on a GPU, where the host is otherwise idle), on, off")
	fs.Var(switchFlag{&c.FusedDecode}, "fused-decode", "decode passes (up to eight sequences at once) through meshnode's own CUDA kernels (deploy/gpu builds them): auto (on for a stage on an NVIDIA GPU of a llama or qwen2 model whose layers are all Q4_0, with an untied Q4_0 or Q6_K head; the log says why not), on (loading fails where they cannot run), off")
	fs.Var(switchFlag{&c.DecodeGraphs}, "decode-graphs", "a scheduler of its own for each pipeline lane's decode passes, and CUDA graphs for decode passes of several rows (ggml's are off for them): on, off, auto (off: experimental)")
	fs.Var(switchFlag{&c.FlashAttention}, "flash-attn", "fused attention: auto (on for layers on a GPU, and on a CPU where meshnode's own kernel runs: AVX512-VNNI, f16 KV cache), on, off. Elsewhere on a CPU, on gets ggml's kernel, with which a replay after a node failure may differ from the uninterrupted text (see README)")
	fs.BoolVar(&c.NoRepack, "no-repack", false, "keep quantized weights in ggml's plain layout (slower on CPU)")
	fs.StringVar(&c.Device, "device", "auto", "where layers run: auto (a GPU if ggml has one), cpu, cuda, metal")
	c.BusyPoll = node.BusyPollAuto
	fs.Var(busyPollFlag{&c.BusyPoll}, "busy-poll", "how long a connection keeps polling for the next message before it sleeps, e.g. 10ms: lower latency per hop for a CPU per busy connection; auto (25ms on a node whose layers run on a GPU, off elsewhere), off")
	fs.BoolVar(&c.GPUHandoff, "gpu-handoff", true, "two stages of this machine's nodes on one GPU, under NVIDIA's MPS daemon, hand a decode step's hidden states over in GPU memory (CUDA IPC) instead of through both hosts, the second stage's pass queued behind the first's (where both decode through the fused CUDA kernels, over --local-hops); --gpu-handoff=false: always through the hosts")
	fs.Var(switchFlag{&c.LocalHops}, "local-hops", "stages of nodes on this machine (one per GPU, say) reach each other over a Unix socket instead of TCP, libp2p and gRPC: auto (where the node can listen on one; a warning says why not), on (the node fails to start without one), off")
	fs.DurationVar(&c.DrainTimeout, "drain-timeout", 60*time.Second, "on SIGTERM or 'meshnode leave', how long to wait for requests to finish and the mesh to take this node's layers")
	fs.StringVar(&f.logFormat, "log-format", "console", "log format: console or json")
	fs.StringVar(&f.logLevel, "log-level", "info", "log level: debug, info, warn, error")
}

func (f *nodeFlags) run(ctx context.Context) error {
	if f.keyFile != "" {
		b, err := os.ReadFile(f.keyFile)
		if err != nil {
			return fmt.Errorf("--api-key-file: %w", err)
		}
		f.cfg.APIKey = strings.TrimSpace(string(b))
		if f.cfg.APIKey == "" {
			return fmt.Errorf("--api-key-file %s is empty", f.keyFile)
		}
	}
	switch f.trust {
	case "mesh-key":
		if f.allow != "" {
			return fmt.Errorf("--allow-peer needs --trust allowlist")
		}
	case "allowlist":
		for _, p := range strings.Split(f.allow, ",") {
			if p = strings.TrimSpace(p); p != "" {
				f.cfg.AllowPeers = append(f.cfg.AllowPeers, p)
			}
		}
		if len(f.cfg.AllowPeers) == 0 {
			return fmt.Errorf("--trust allowlist needs --allow-peer ID[,ID...]")
		}
	default:
		return fmt.Errorf("--trust %q: want mesh-key or allowlist", f.trust)
	}
	if f.listen != "" {
		for _, a := range strings.Split(f.listen, ",") {
			f.cfg.Listen = append(f.cfg.Listen, strings.TrimSpace(a))
		}
	}
	if f.maxMemory != "" {
		n, err := parseBytes(f.maxMemory)
		if err != nil {
			return fmt.Errorf("--max-memory: %w", err)
		}
		f.cfg.MaxMemory = n
	}
	dt, err := stage.ParseDType(f.wire)
	if err != nil || dt == stage.BF16 {
		return fmt.Errorf("--wire-dtype %q: want f16 or f32", f.wire)
	}
	f.cfg.WireDType = dt
	log, err := newLogger(f.logFormat, f.logLevel)
	if err != nil {
		return err
	}
	defer log.Sync()
	f.cfg.Logger = log
	f.cfg.Version = version
	f.cfg.Progress = newProgress(os.Stderr)
	f.cfg.JoinCommand = func(cmd string) {
		fmt.Fprintf(os.Stderr, "\nTo add a machine to this mesh, run on it:\n\n    %s\n\n", cmd)
	}
	f.cfg.Ready = func(addr string) {
		fmt.Fprintf(os.Stderr, "\nmeshnode is serving on http://%s/v1  (Ctrl-C to stop)\n\n", addr)
	}
	return node.Run(ctx, f.cfg)
}

func runServe(ctx context.Context, args []string) error {
	fs := newFlags("serve [flags]", `Starts a mesh (or a node of one) that serves a GGUF model through an
OpenAI-compatible API (/v1/chat/completions, /v1/completions, /v1/models,
/health) and prints the command that adds another machine.

With no --model it serves the small default model, stories260K: from
../shared/models when present, else downloaded once from Hugging Face
(ggml-org/models) into the cache.

--model DIR serves a Hugging Face safetensors directory (config.json,
*.safetensors, tokenizer.json) with MLX: on a Mac with Apple Silicon and a
meshnode built with -tags mlx. Only nodes that run MLX get its layers; the
others serve its API. Where MLX is unavailable it stops with an error: serve
a GGUF of the model there instead.

The mesh places layers by itself: one node when the model fits it, else
contiguous layer ranges in proportion to each node's memory and speed.
--split spreads the model over every node even when it fits one.`, `  meshnode serve
  meshnode serve --model ./qwen2.5-0.5b-instruct-q4_0.gguf --ctx 8192 --parallel 8
  meshnode serve --model ./llama-3.1-8b-q4_0.gguf --split --max-memory 6GiB
  meshnode serve --model ./Qwen2.5-0.5B-Instruct        # a safetensors directory, on MLX
  meshnode serve --http 0.0.0.0:9337 --api-key "$(cat ~/.meshnode/api-key)"`)
	var f nodeFlags
	f.register(fs)
	fs.StringVar(&f.cfg.Model, "model", "", "path to a GGUF model, or (MLX only) a safetensors model directory; llama, qwen2, qwen3 architectures; empty = the default model")
	fs.IntVar(&f.cfg.Context, "ctx", 4096, "context length (positions) per sequence")
	fs.IntVar(&f.cfg.Parallel, "parallel", 4, "sequences generated at once (each gets --ctx positions of KV cache)")
	fs.BoolVar(&f.cfg.Split, "split", false, "split the model across all ready nodes even when it fits on one")
	if err := parse(fs, args); err != nil {
		return err
	}
	return f.run(ctx)
}

func runJoin(ctx context.Context, args []string) error {
	fs := newFlags("join PEER-MULTIADDR --mesh-key KEY [flags]", `Joins this machine to a running mesh. The node learns the mesh's model from
its peers, takes the layers the planner gives it, fetches exactly those
layers' bytes from a peer that holds the model file (verified by hash,
resumable), and serves the same OpenAI API as every other node.

'meshnode serve' prints the exact command to run.`, `  meshnode join /ip4/192.168.1.5/tcp/4001/p2p/12D3KooW... --mesh-key mk1_...
  meshnode join /ip4/192.168.1.5/tcp/4001/p2p/12D3KooW... --mesh-key mk1_... --layers 16:32`)
	var f nodeFlags
	f.register(fs)
	// The peer address comes first, as printed by serve; flags follow it.
	var peers []string
	for len(args) > 0 && !strings.HasPrefix(args[0], "-") {
		peers = append(peers, args[0])
		args = args[1:]
	}
	if err := parse(fs, args); err != nil {
		return err
	}
	if len(peers) == 0 && !f.cfg.MDNS {
		fs.Usage()
		return errUsage
	}
	f.cfg.Join = peers
	return f.run(ctx)
}

// parseBytes reads sizes like 512MB, 6GiB, 1.5G or a plain byte count.
func parseBytes(s string) (uint64, error) {
	s = strings.TrimSpace(strings.ToUpper(s))
	mult := uint64(1)
	for _, u := range []struct {
		suffix string
		mult   uint64
	}{{"TIB", 1 << 40}, {"GIB", 1 << 30}, {"MIB", 1 << 20}, {"KIB", 1 << 10}, {"TB", 1e12}, {"GB", 1e9}, {"MB", 1e6}, {"KB", 1e3}, {"T", 1 << 40}, {"G", 1 << 30}, {"M", 1 << 20}, {"K", 1 << 10}, {"B", 1}} {
		if strings.HasSuffix(s, u.suffix) {
			s, mult = strings.TrimSuffix(s, u.suffix), u.mult
			break
		}
	}
	var v float64
	if _, err := fmt.Sscanf(strings.TrimSpace(s), "%g", &v); err != nil || v <= 0 {
		return 0, fmt.Errorf("%q is not a size", s)
	}
	return uint64(v * float64(mult)), nil
}

// switchFlag is a flag of auto, on or off (--flash-attn, --build-ahead).
// A bare --flash-attn, as before the flag took a value, means on.
type switchFlag struct{ v *ggufstage.Switch }

func (f switchFlag) String() string {
	if f.v == nil {
		return ggufstage.Auto.String()
	}
	return f.v.String()
}

func (f switchFlag) Set(s string) error {
	v, err := ggufstage.ParseSwitch(s)
	if err != nil {
		return err
	}
	*f.v = v
	return nil
}

func (f switchFlag) IsBoolFlag() bool { return true }

// busyPollFlag is --busy-poll: auto, off, or a duration.
type busyPollFlag struct{ d *time.Duration }

func (f busyPollFlag) String() string {
	switch {
	case f.d == nil:
		return "" // the flag package's zero value, so that --help shows the default
	case *f.d == node.BusyPollAuto:
		return "auto"
	case *f.d == 0:
		return "off"
	}
	return f.d.String()
}

func (f busyPollFlag) Set(s string) error {
	switch strings.ToLower(s) {
	case "auto":
		*f.d = node.BusyPollAuto
		return nil
	case "off", "0":
		*f.d = 0
		return nil
	}
	d, err := time.ParseDuration(s)
	if err != nil || d < 0 {
		return fmt.Errorf("%q: want auto, off or a duration such as 10ms", s)
	}
	*f.d = d
	return nil
}
