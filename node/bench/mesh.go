package bench

// The mesh benchmark: decode speed of a model split over 1, 2, 3… meshnode
// processes on one machine, measured end to end through node 1's OpenAI API.
// Every stage count runs in the same invocation on the same machine, so the
// ratio to the 1-stage row is what splitting costs (or gains) here.

import (
	"bytes"
	"context"
	"crypto/rand"
	"encoding/hex"
	"encoding/json"
	"errors"
	"fmt"
	"io"
	mrand "math/rand/v2"
	"net"
	"net/http"
	"os"
	"os/exec"
	"path/filepath"
	"runtime"
	"slices"
	"strconv"
	"strings"
	"sync"
	"sync/atomic"
	"syscall"
	"time"

	"github.com/prometheus/common/expfmt"
	"github.com/prometheus/common/model"

	"github.com/meshnode/meshnode/ggufstage"
	"github.com/meshnode/meshnode/node"
	"github.com/meshnode/meshnode/node/childproc"
	"github.com/meshnode/meshnode/node/internal/netdelay"
	"github.com/meshnode/meshnode/node/sse"
)

// MeshConfig of a mesh benchmark.
type MeshConfig struct {
	Model        string
	Binary       string // the meshnode executable to run nodes with; default os.Executable()
	Stages       []int  // stage (= process) counts; default 1, 2, 3
	Streams      []int  // concurrent streams; default 1 and 8
	PromptTokens int    // prompt length in tokens (sent as token ids); default 64
	// ProfileDir, when set, receives a CPU profile of every node (Go's
	// pprof format) taken while it decodes at the first and the last
	// stream count, after the measurements, which it does not disturb.
	ProfileDir string
	// Trace, with ProfileDir, also saves a Go execution trace of every
	// node (traceSeconds long, go tool trace), for where a hop's time goes.
	Trace bool
	// PrefillTokens is the prompt of each stream in the prefill
	// measurement (max_tokens 1); default 512, negative skips it.
	PrefillTokens int
	DecodeTokens  int           // max_tokens of every request; default 128
	Runs          int           // rounds, each forming every mesh once in turn; medians (of the rounds' ratios too) are reported
	Threads       int           // --threads of every node; 0 = the nodes' default (ggufstage.DefaultThreads)
	NodeArgs      []string      // extra flags for every node (e.g. --flash-attn)
	GPUPerNode    bool          // node i sees only GPU i-1 (CUDA_VISIBLE_DEVICES), as on a multi-GPU host
	SkipLoopback  bool          // measure only in network namespaces
	Netns         bool          // also measure with every node in its own network namespace
	NetnsDelay    time.Duration // one-way delay of every hop between two nodes (0: none); see setupNetns
	WorkDir       string        // data dirs and logs; default a temporary dir, removed unless a run fails
	ReadyTimeout  time.Duration // how long a mesh may take to form; default 10 minutes
	// Temperature of the timed requests (0, greedy, by default; the
	// greedy-text check stays at 0): above 0 the last stage samples
	// every token from its logits on the host.
	Temperature float64
}

// MeshRow is one measurement.
type MeshRow struct {
	Network    string  // "loopback" or "netns+1ms"
	Stages     int     // stages of node 1's plan
	Streams    int     // concurrent streams
	DecodeTPS  float64 // aggregate decode tokens per second (see decodeRate)
	PrefillTPS float64 // prompt tokens per second of Streams prompts sent at once (see prefillRate); 0 if skipped
	Ratio      float64 // DecodeTPS over the 1-stage row of the same network and streams; 0 if none
	Tokens     int     // completion tokens of all streams (last run)
	FirstToken time.Duration
	Plan       []node.StatusStage // node 1's plan while it was measured
	Lanes      int                // micro-batches node 1 kept in flight (status lanes)
	// Step is the mean forward pass through the whole pipeline as node 1's
	// scheduler waited for it, and Compute each node's mean stage pass
	// (from the nodes' /metrics): what is neither is hops, framing and
	// scheduling. Zero when a node did not report them.
	Step    time.Duration
	Compute []StageTime
	// Greedy is the text of one fixed greedy request through the mesh,
	// to check that every stage count generates the same tokens.
	Greedy string
}

// netns layout: a bridge on the host, one namespace per node, addresses
// 10.77.1.0/24 (the bridge .1, node i .10+i). In a namespace every node has
// the same ports: libp2p 4001 (which the delay relay's rules match), HTTP
// 9337.
const (
	netnsBridge    = "mnbench0"
	netnsPrefix    = "mnbench-"
	netnsSubnet    = "10.77.1."
	netnsHTTP      = 9337
	netnsP2P       = 4001
	netnsRelayBase = 43000 // the delay relay for node i's connections to node j listens on 10.77.1.1:(43000+10i+j)
	maxMeshNodes   = netdelay.MaxNodes
)

func (c *MeshConfig) defaults() error {
	if c.Binary == "" {
		exe, err := os.Executable()
		if err != nil {
			return fmt.Errorf("finding the meshnode binary: %w", err)
		}
		c.Binary = exe
	}
	if len(c.Stages) == 0 {
		c.Stages = []int{1, 2, 3}
	}
	if len(c.Streams) == 0 {
		c.Streams = []int{1, 8}
	}
	if c.PromptTokens <= 0 {
		c.PromptTokens = 64
	}
	if c.DecodeTokens <= 0 {
		c.DecodeTokens = 128
	}
	if c.PrefillTokens == 0 {
		c.PrefillTokens = 512
	}
	if c.Runs <= 0 {
		c.Runs = 1
	}
	if c.ReadyTimeout <= 0 {
		c.ReadyTimeout = 10 * time.Minute
	}
	for _, s := range c.Stages {
		if s < 1 || s > maxMeshNodes {
			return fmt.Errorf("stage count %d: want 1 to %d", s, maxMeshNodes)
		}
	}
	for _, n := range c.Streams {
		if n < 1 {
			return fmt.Errorf("stream count %d: want at least 1", n)
		}
	}
	if c.SkipLoopback && !c.Netns {
		return errors.New("nothing to measure: loopback skipped and no network namespaces")
	}
	return nil
}

// meshNetwork is where a mesh's nodes run.
type meshNetwork struct {
	name   string
	netns  bool
	apiKey string         // set when HTTP binds beyond loopback
	relay  *netdelay.Mesh // the delay relay between the namespaces, if the delay is not netem's
}

// RunMesh starts meshes of each stage count, measures decode speed through
// node 1's API, and returns one row per network, stage count and stream
// count. Node processes are always stopped before it returns, network
// namespaces removed.
func RunMesh(ctx context.Context, cfg MeshConfig, log io.Writer) (rows []MeshRow, err error) {
	if err := cfg.defaults(); err != nil {
		return nil, err
	}
	info, err := ggufstage.ReadInfo(cfg.Model)
	if err != nil {
		return nil, err
	}
	if cfg.Model, err = filepath.Abs(cfg.Model); err != nil {
		return nil, err
	}
	fmt.Fprintf(log, "model %s: %s, %d layers, n_embd %d, vocab %d, %s\n", cfg.Model, info.Arch, info.Layers, info.Embd, info.Vocab, info.FileType)
	for _, s := range cfg.Stages {
		if s > info.Layers {
			return nil, fmt.Errorf("%d stages: the model has only %d layers", s, info.Layers)
		}
	}
	fmt.Fprintf(log, "machine: %d cores, load average %s; nodes run %s with %s\n", runtime.NumCPU(), loadAverage(), cfg.Binary, threadsText(cfg.Threads))

	workDir := cfg.WorkDir
	removeWork := workDir == ""
	if workDir == "" {
		if workDir, err = os.MkdirTemp("", "meshnode-bench-mesh-"); err != nil {
			return nil, err
		}
	} else if err := os.MkdirAll(workDir, 0o755); err != nil {
		return nil, err
	}
	defer func() {
		// Data dirs hold slices of the model: never keep them. Logs stay
		// when something failed, or when the caller chose the directory.
		for i := 1; i <= maxMeshNodes; i++ {
			os.RemoveAll(filepath.Join(workDir, fmt.Sprintf("data%d", i)))
		}
		logs, _ := filepath.Glob(filepath.Join(workDir, "*", "node*.log"))
		switch {
		case err != nil && len(logs) > 0:
			fmt.Fprintf(log, "node logs are kept in %s\n", workDir)
		case removeWork:
			os.RemoveAll(workDir)
		}
	}()

	var nets []meshNetwork
	var lab *netnsLab
	if cfg.Netns {
		// Set up the namespaces first: a machine that cannot have them
		// fails before any measurement, not after the loopback ones.
		lab, err = setupNetns(ctx, slices.Max(cfg.Stages), cfg.NetnsDelay, log)
		if err != nil {
			return nil, err
		}
		defer lab.cleanup(log)
	}
	if !cfg.SkipLoopback {
		nets = append(nets, meshNetwork{name: "loopback"})
	}
	if cfg.Netns {
		name := "netns"
		if cfg.NetnsDelay > 0 {
			name += "+" + cfg.NetnsDelay.String()
		}
		nets = append(nets, meshNetwork{name: name, netns: true, apiKey: randomKey(), relay: lab.relay})
	}

	tokens := promptTokens(info.Vocab)
	client := &http.Client{Transport: &http.Transport{Proxy: nil, MaxIdleConnsPerHost: 64, DisableCompression: true}}
	defer client.CloseIdleConnections()

	for _, nw := range nets {
		nwRows, err := runNetwork(ctx, cfg, nw, info, tokens, client, workDir, log)
		if err != nil {
			return nil, err
		}
		rows = append(rows, nwRows...)
	}
	fmt.Fprintf(log, "load average at the end: %s\n", loadAverage())
	return rows, nil
}

func threadsText(n int) string {
	if n <= 0 {
		return "threads by stage size"
	}
	return fmt.Sprintf("%d threads each", n)
}

// runNetwork measures every stage count on one network. With several runs
// it measures in rounds, each forming every mesh once in turn, so that a
// machine whose speed drifts over minutes hits all stage counts alike:
// each round's ratios compare meshes measured minutes apart, not a whole
// run apart, and the reported ratio is their median.
func runNetwork(ctx context.Context, cfg MeshConfig, nw meshNetwork, info ggufstage.ModelInfo, tokens func(stream, run int, n int) []int32,
	client *http.Client, workDir string, log io.Writer) ([]MeshRow, error) {
	var rounds [][]MeshRow
	for round := range cfg.Runs {
		var rows []MeshRow
		for _, stages := range cfg.Stages {
			if err := ctx.Err(); err != nil {
				return nil, err
			}
			r, err := runStages(ctx, cfg, nw, stages, round, info, tokens, client, workDir, log)
			if err != nil {
				return nil, fmt.Errorf("%s, %d stages: %w", nw.name, stages, err)
			}
			rows = append(rows, r...)
		}
		rounds = append(rounds, rows)
	}
	return mergeRounds(rounds), nil
}

// mergeRounds folds rounds of measurements (each with the same rows in the
// same order) into one row per stage and stream count: median decode rate
// and first-token time, and as Ratio the median over rounds of the rate
// over that round's 1-stage rate.
func mergeRounds(rounds [][]MeshRow) []MeshRow {
	if len(rounds) == 0 {
		return nil
	}
	type key struct{ stages, streams int }
	ref := make([]map[int]float64, len(rounds)) // round -> streams -> 1-stage rate
	for i, rows := range rounds {
		ref[i] = map[int]float64{}
		for _, r := range rows {
			if r.Stages == 1 {
				ref[i][r.Streams] = r.DecodeTPS
			}
		}
	}
	var out []MeshRow
	for j, first := range rounds[0] {
		var tps, ft, ratios, steps, prefill []float64
		row := first
		for i, rows := range rounds {
			if j >= len(rows) || (key{rows[j].Stages, rows[j].Streams} != key{first.Stages, first.Streams}) {
				continue
			}
			r := rows[j]
			tps = append(tps, r.DecodeTPS)
			ft = append(ft, r.FirstToken.Seconds())
			if v := ref[i][r.Streams]; v > 0 {
				ratios = append(ratios, r.DecodeTPS/v)
			}
			if r.Greedy != first.Greedy {
				row.Greedy = "(differs between rounds)"
			}
			row.Plan, row.Lanes, row.Tokens, row.Compute = r.Plan, r.Lanes, r.Tokens, r.Compute
			steps = append(steps, r.Step.Seconds())
			prefill = append(prefill, r.PrefillTPS)
		}
		row.Step = time.Duration(median(steps) * float64(time.Second))
		row.PrefillTPS = median(prefill)
		row.DecodeTPS = median(tps)
		row.FirstToken = time.Duration(median(ft) * float64(time.Second))
		row.Ratio = median(ratios)
		out = append(out, row)
	}
	return out
}

// runStages forms one mesh of the given size and measures every stream
// count on it.
func runStages(ctx context.Context, cfg MeshConfig, nw meshNetwork, stages, round int, info ggufstage.ModelInfo,
	tokens func(stream, run int, n int) []int32, client *http.Client, workDir string, log io.Writer) (rows []MeshRow, err error) {
	logDir := filepath.Join(workDir, fmt.Sprintf("%s-%dstages-round%d", strings.ReplaceAll(nw.name, "+", "-"), stages, round+1))
	if err := os.MkdirAll(logDir, 0o755); err != nil {
		return nil, err
	}
	m := &meshRun{cfg: cfg, nw: nw, client: client, workDir: workDir, logDir: logDir}
	defer func() {
		m.stop()
		if err != nil {
			for _, p := range m.procs {
				err = fmt.Errorf("%w\n  node %d log: %s", err, p.index, p.logPath)
			}
		}
	}()
	fmt.Fprintf(log, "\n%s, %d stage(s): starting %d node(s), logs in %s\n", nw.name, stages, stages, logDir)
	var relayed netdelay.Stats
	if nw.relay != nil {
		relayed = nw.relay.Stats()
	}
	start := time.Now()
	if err := m.start(ctx, stages, info); err != nil {
		return nil, err
	}
	plan, lanes, err := m.waitReady(ctx, stages)
	if err != nil {
		return nil, err
	}
	fmt.Fprintf(log, "mesh ready in %.1f s: %s\n", time.Since(start).Seconds(), planText(plan))

	api := m.procs[0].url
	model := strings.TrimSuffix(filepath.Base(cfg.Model), filepath.Ext(cfg.Model))
	// Warm up every stage once so that first-use allocations are not timed.
	if _, err := runStreams(ctx, client, api, nw.apiKey, model, 1, 4, 0, func(int) []int32 { return tokens(99, 0, cfg.PromptTokens) }, nil); err != nil {
		return nil, fmt.Errorf("warm-up request: %w", err)
	}
	greedy, err := runStreams(ctx, client, api, nw.apiKey, model, 1, 32, 0, func(int) []int32 { return tokens(98, 0, cfg.PromptTokens) }, nil)
	if err != nil {
		return nil, fmt.Errorf("greedy check request: %w", err)
	}
	for _, n := range cfg.Streams {
		run := round
		if err := m.alive(); err != nil {
			return nil, err
		}
		var prefill float64
		if cfg.PrefillTokens > 0 {
			res, err := runStreams(ctx, client, api, nw.apiKey, model, n, 1, 0, func(i int) []int32 { return tokens(1000+i, run, cfg.PrefillTokens) }, nil)
			if err != nil {
				return nil, fmt.Errorf("%d stream(s), prefill: %w", n, err)
			}
			prefill = prefillRate(res, cfg.PrefillTokens)
		}
		// The breakdown covers decode passes only: from every stream's first
		// token (the prompts are in) to the end.
		var before []sums
		res, err := runStreams(ctx, client, api, nw.apiKey, model, n, cfg.DecodeTokens, cfg.Temperature,
			func(i int) []int32 { return tokens(i, run, cfg.PromptTokens) }, func() { before = m.timings(ctx) })
		if err != nil {
			return nil, fmt.Errorf("%d stream(s): %w", n, err)
		}
		step, compute := breakdown(before, m.timings(ctx))
		tps, err := decodeRate(res)
		if err != nil {
			return nil, fmt.Errorf("%d stream(s): %w", n, err)
		}
		total := 0
		var ft []float64
		for _, r := range res {
			total += r.tokens
			ft = append(ft, r.first.Sub(r.start).Seconds())
		}
		fmt.Fprintf(log, "round %d  %s  stages %d  streams %d  prefill %8.1f tok/s  decode %8.2f tok/s  (%d tokens, median first token %.2f s; load average %s)\n",
			run+1, nw.name, stages, n, prefill, tps, total, median(ft), loadAverage())
		rows = append(rows, MeshRow{Network: nw.name, Stages: stages, Streams: n, DecodeTPS: tps, Tokens: total,
			FirstToken: time.Duration(median(ft) * float64(time.Second)), Plan: plan, Lanes: lanes, Greedy: greedy[0].text,
			Step: step, Compute: compute, PrefillTPS: prefill})
	}
	if cfg.ProfileDir != "" {
		counts := []int{cfg.Streams[0]}
		if last := cfg.Streams[len(cfg.Streams)-1]; last != counts[0] {
			counts = append(counts, last)
		}
		for _, n := range counts {
			if err := m.profile(ctx, api, model, n, tokens, round, stages); err != nil {
				return nil, fmt.Errorf("profiling %d stream(s): %w", n, err)
			}
		}
	}
	// The plan must not have changed under the measurement.
	st, err := m.status(ctx)
	if err != nil {
		return nil, err
	}
	if planText(st.Plan) != planText(plan) {
		return nil, fmt.Errorf("node 1's plan changed during the measurement: %s, then %s", planText(plan), planText(st.Plan))
	}
	if nw.relay != nil {
		// The delay applies only to what crosses the relay: a split mesh
		// whose stages talked past it was not measured with the delay.
		now := nw.relay.Stats()
		conns, bytes := now.Conns-relayed.Conns, now.Bytes-relayed.Bytes
		fmt.Fprintf(log, "delay relay: %d connection(s), %.2f MB between the nodes\n", conns, float64(bytes)/1e6)
		if stages > 1 && (conns == 0 || bytes == 0) {
			return nil, fmt.Errorf("the delay relay carried nothing between the %d nodes: the delay did not apply", stages)
		}
	}
	return rows, nil
}

func millis(d time.Duration) string {
	if d <= 0 {
		return "-"
	}
	return fmt.Sprintf("%.3f", d.Seconds()*1e3)
}

// StageTime is a node's mean stage forward pass, and the part of it spent
// in each phase (zero where the engine does not report phases): building
// the graph on the host, the scheduler allocating it, launching it, and
// waiting for the backend.
type StageTime struct {
	// Layers is the node's stage as its metrics label it ("0-18"), empty
	// where it did not say: nodes are listed in their own order, node 1
	// (the API's) first, which need not be the plan's.
	Layers                            string
	Total, Graph, Alloc, Launch, Wait time.Duration
	Ahead                             float64 // the share of passes built ahead
	Allocated                         float64 // the share of passes allocated ahead
}

// stepText says where a step went: each stage's compute, then the rest.
func stepText(step time.Duration, compute []StageTime) string {
	if step <= 0 || len(compute) == 0 {
		return "-"
	}
	parts := make([]string, len(compute))
	rest := step
	for i, c := range compute {
		parts[i] = millis(c.Total)
		if c.Layers != "" {
			parts[i] += " [" + c.Layers + "]"
		}
		rest -= c.Total
	}
	return fmt.Sprintf("%s, rest %.3f", strings.Join(parts, " + "), rest.Seconds()*1e3)
}

// phaseText splits each stage's pass into its phases,
// graph/alloc/launch/wait.
func phaseText(compute []StageTime) string {
	var parts []string
	for _, c := range compute {
		if c.Graph+c.Alloc+c.Launch+c.Wait <= 0 {
			return ""
		}
		p := fmt.Sprintf("%s/%s/%s/%s", millis(c.Graph), millis(c.Alloc), millis(c.Launch), millis(c.Wait))
		switch {
		case c.Ahead > 0 && c.Allocated > 0:
			p += fmt.Sprintf(" (%.0f%% ahead, %.0f%% allocated)", 100*c.Ahead, 100*c.Allocated)
		case c.Ahead > 0:
			p += fmt.Sprintf(" (%.0f%% ahead)", 100*c.Ahead)
		}
		parts = append(parts, p)
	}
	return strings.Join(parts, " + ")
}

// sums is a node's histogram sums and counts, and counter totals, by
// metric name, labels dropped (a node runs one stage), except a phase
// label, which is kept as name/phase; and the stage label of its
// stage-compute histogram.
type sums struct {
	v     map[string][2]float64
	stage string
}

// The metrics that the step breakdown reads.
const (
	metricStep   = "meshnode_pipeline_step_seconds"
	metricStage  = "meshnode_stage_compute_seconds"
	metricPhases = "meshnode_stage_phase_seconds_total"
	metricAhead  = "meshnode_stage_passes_built_ahead_total"
	metricAlloc  = "meshnode_stage_passes_allocated_ahead_total"
)

// timings reads every node's step and stage-compute histograms; a node
// that does not answer gives an empty entry.
func (m *meshRun) timings(ctx context.Context) []sums {
	out := make([]sums, len(m.procs))
	for i, p := range m.procs {
		out[i] = sums{v: map[string][2]float64{}}
		resp, err := m.get(ctx, p.url+"/metrics")
		if err != nil {
			continue
		}
		if resp.StatusCode == http.StatusOK {
			out[i] = parseSums(resp.Body)
		}
		resp.Body.Close()
	}
	return out
}

// parseSums reads the sums and counts of the pipeline-step and
// stage-compute histograms from the Prometheus text format; unreadable
// text reads as no histograms.
func parseSums(r io.Reader) sums {
	s := sums{v: map[string][2]float64{}}
	parser := expfmt.NewTextParser(model.LegacyValidation)
	fams, err := parser.TextToMetricFamilies(r)
	if err != nil {
		return s
	}
	for _, name := range []string{metricStep, metricStage} {
		fam, ok := fams[name]
		if !ok {
			continue
		}
		var e [2]float64
		most := 0.0
		for _, m := range fam.GetMetric() {
			n := float64(m.GetHistogram().GetSampleCount())
			e[0] += m.GetHistogram().GetSampleSum()
			e[1] += n
			if name != metricStage || n <= most {
				continue
			}
			// A node that changed stages keeps the old one's series: the
			// stage it ran most passes of names it.
			for _, l := range m.GetLabel() {
				if l.GetName() == "stage" {
					s.stage, most = l.GetValue(), n
				}
			}
		}
		s.v[name] = e
	}
	for _, name := range []string{metricAhead, metricAlloc} {
		if fam, ok := fams[name]; ok {
			var e [2]float64
			for _, m := range fam.GetMetric() {
				e[0] += m.GetCounter().GetValue()
			}
			s.v[name] = e
		}
	}
	if fam, ok := fams[metricPhases]; ok {
		for _, m := range fam.GetMetric() {
			for _, l := range m.GetLabel() {
				if l.GetName() == "phase" {
					k := metricPhases + "/" + l.GetValue()
					e := s.v[k]
					e[0] += m.GetCounter().GetValue()
					s.v[k] = e
				}
			}
		}
	}
	return s
}

// breakdown turns two readings into node 1's mean step and every node's
// mean stage pass over the passes between them.
func breakdown(before, after []sums) (step time.Duration, compute []StageTime) {
	// per divides the growth of node i's sum of name by the growth of
	// count's count: a mean per pass (seconds, or a share for counters).
	per := func(i int, name, count string) float64 {
		if i >= len(before) || i >= len(after) {
			return 0
		}
		a, b := after[i].v, before[i].v
		if n := a[count][1] - b[count][1]; n > 0 {
			return (a[name][0] - b[name][0]) / n
		}
		return 0
	}
	secs := func(s float64) time.Duration { return time.Duration(s * float64(time.Second)) }
	step = secs(per(0, metricStep, metricStep))
	for i := range after {
		compute = append(compute, StageTime{
			Layers:    after[i].stage,
			Total:     secs(per(i, metricStage, metricStage)),
			Graph:     secs(per(i, metricPhases+"/graph", metricStage)),
			Alloc:     secs(per(i, metricPhases+"/alloc", metricStage)),
			Launch:    secs(per(i, metricPhases+"/launch", metricStage)),
			Wait:      secs(per(i, metricPhases+"/wait", metricStage)),
			Ahead:     per(i, metricAhead, metricStage),
			Allocated: per(i, metricAlloc, metricStage),
		})
	}
	return step, compute
}

func planText(p []node.StatusStage) string {
	var parts []string
	for _, s := range p {
		parts = append(parts, fmt.Sprintf("…%s [%d,%d)", shortPeer(s.Node), s.Start, s.End))
	}
	return strings.Join(parts, " → ")
}

func planLayers(p []node.StatusStage) string {
	var parts []string
	for _, s := range p {
		parts = append(parts, fmt.Sprintf("%d-%d", s.Start, s.End))
	}
	return strings.Join(parts, ",")
}

func shortPeer(id string) string {
	if len(id) > 6 {
		return id[len(id)-6:]
	}
	return id
}

// meshRun is one mesh's processes.
type meshRun struct {
	cfg     MeshConfig
	nw      meshNetwork
	client  *http.Client
	workDir string
	logDir  string
	procs   []*nodeProc
}

type nodeProc struct {
	index   int
	cmd     *exec.Cmd
	logPath string
	logFile *os.File
	url     string // http://host:port
	child   *childproc.Child
}

func (m *meshRun) nodeHost(i int) string {
	if m.nw.netns {
		return fmt.Sprintf("%s%d", netnsSubnet, 10+i)
	}
	return "127.0.0.1"
}

// start launches node 1 (serve) and, once it answers, the joiners.
func (m *meshRun) start(ctx context.Context, stages int, info ggufstage.ModelInfo) error {
	cfg := m.cfg
	common := func(i int) ([]string, error) {
		host := m.nodeHost(i)
		port, p2p := netnsHTTP, netnsP2P
		if !m.nw.netns {
			var err error
			if port, err = freePort(); err != nil {
				return nil, err
			}
			p2p = 0
		}
		args := []string{
			"--data-dir", filepath.Join(m.workDir, fmt.Sprintf("data%d", i)),
			"--http", net.JoinHostPort(host, strconv.Itoa(port)),
			"--listen", fmt.Sprintf("/ip4/%s/tcp/%d", host, p2p),
			"--gossip-port", "-1",
			"--log-format", "console",
			// Teardown stops every node at once: no node could take over
			// another's layers, so a graceful drain would only wait.
			"--drain-timeout", "-1s",
		}
		if m.nw.apiKey != "" {
			args = append(args, "--api-key", m.nw.apiKey)
		}
		if cfg.Threads > 0 {
			args = append(args, "--threads", strconv.Itoa(cfg.Threads))
		}
		return append(args, cfg.NodeArgs...), nil
	}
	args, err := common(1)
	if err != nil {
		return err
	}
	args = append([]string{"serve", "--split", "--model", cfg.Model,
		"--parallel", strconv.Itoa(slices.Max(cfg.Streams)),
		"--ctx", strconv.Itoa(max(cfg.PromptTokens, cfg.PrefillTokens) + cfg.DecodeTokens + 16)}, args...)
	if err := m.launch(1, args); err != nil {
		return err
	}
	if stages == 1 {
		return nil
	}
	// Node 1 answers /api/status once it has hashed the model; its status
	// carries the join command.
	var join string
	deadline := time.Now().Add(m.cfg.ReadyTimeout)
	for {
		st, err := m.status(ctx)
		if err == nil && st.JoinHint != "" {
			join = st.JoinHint
			break
		}
		if err := m.wait(ctx, deadline, "node 1 to answer /api/status"); err != nil {
			return err
		}
	}
	f := strings.Fields(join)
	if len(f) < 5 || f[0] != "meshnode" || f[1] != "join" || f[3] != "--mesh-key" {
		return fmt.Errorf("unexpected join command from node 1: %q", join)
	}
	for i := 2; i <= stages; i++ {
		args, err := common(i)
		if err != nil {
			return err
		}
		if err := m.launch(i, append([]string{"join", f[2], "--mesh-key", f[4]}, args...)); err != nil {
			return err
		}
	}
	return nil
}

func (m *meshRun) launch(i int, args []string) error {
	logPath := filepath.Join(m.logDir, fmt.Sprintf("node%d.log", i))
	lf, err := os.Create(logPath)
	if err != nil {
		return err
	}
	name, argv := m.cfg.Binary, args
	if m.nw.netns {
		name, argv = "ip", append([]string{"netns", "exec", netnsName(i), m.cfg.Binary}, args...)
	}
	fmt.Fprintf(lf, "$ %s %s\n\n", name, strings.Join(redact(argv, m.nw.apiKey), " "))
	cmd := exec.Command(name, argv...)
	cmd.Stdout, cmd.Stderr = lf, lf
	cmd.Env = nodeEnv()
	if m.cfg.GPUPerNode {
		cmd.Env = append(cmd.Env, fmt.Sprintf("CUDA_VISIBLE_DEVICES=%d", i-1))
	}
	// A group of its own: stop signals the group. The node dies with the
	// bench where the bench dies without stopping it (childproc).
	cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
	child, err := childproc.Start(cmd)
	if err != nil {
		lf.Close()
		return fmt.Errorf("starting node %d: %w", i, err)
	}
	p := &nodeProc{index: i, cmd: cmd, logPath: logPath, logFile: lf, child: child}
	host, port := m.nodeHost(i), ""
	for k, a := range args {
		if a == "--http" && k+1 < len(args) {
			_, port, _ = net.SplitHostPort(args[k+1])
		}
	}
	p.url = "http://" + net.JoinHostPort(host, port)
	m.procs = append(m.procs, p)
	return nil
}

func redact(args []string, key string) []string {
	out := slices.Clone(args)
	for i := range out {
		if key != "" && out[i] == key {
			out[i] = "…"
		}
	}
	return out
}

// nodeEnv is this process's environment without MESHNODE_* variables, which
// would otherwise set flags of the nodes (a pinned --layers, say).
func nodeEnv() []string {
	var env []string
	for _, kv := range os.Environ() {
		// The fused CUDA kernels' knobs (MESHNODE_FUSED_PDL, _TIMING, ...)
		// and the pollers' (MESHNODE_SPIN_YIELD) are no flags, unlike
		// --fused-decode: they pass.
		knob := strings.HasPrefix(kv, "MESHNODE_FUSED_") && !strings.HasPrefix(kv, "MESHNODE_FUSED_DECODE=") ||
			strings.HasPrefix(kv, "MESHNODE_SPIN_")
		if knob || !strings.HasPrefix(kv, "MESHNODE_") {
			env = append(env, kv)
		}
	}
	return env
}

// stop ends every node: SIGTERM (a graceful leave), then SIGKILL.
func (m *meshRun) stop() {
	for _, p := range m.procs {
		select {
		case <-p.child.Done():
		default:
			syscall.Kill(-p.cmd.Process.Pid, syscall.SIGTERM)
		}
	}
	deadline := time.After(10 * time.Second)
	for _, p := range m.procs {
		select {
		case <-p.child.Done():
		case <-deadline:
			syscall.Kill(-p.cmd.Process.Pid, syscall.SIGKILL)
			<-p.child.Done()
		}
	}
	for _, p := range m.procs {
		p.logFile.Close()
	}
}

// alive reports a node that exited.
func (m *meshRun) alive() error {
	for _, p := range m.procs {
		select {
		case <-p.child.Done():
			return fmt.Errorf("node %d exited: %v", p.index, p.child.Wait())
		default:
		}
	}
	return nil
}

// wait sleeps a poll interval, failing on cancellation, timeout or a dead
// node.
func (m *meshRun) wait(ctx context.Context, deadline time.Time, what string) error {
	if err := m.alive(); err != nil {
		return err
	}
	if time.Now().After(deadline) {
		return fmt.Errorf("timed out after %v waiting for %s", m.cfg.ReadyTimeout, what)
	}
	select {
	case <-ctx.Done():
		return ctx.Err()
	case <-time.After(250 * time.Millisecond):
		return nil
	}
}

func (m *meshRun) get(ctx context.Context, url string) (*http.Response, error) {
	return m.getWithin(ctx, url, 5*time.Second)
}

// getWithin GETs url from a node, with the API key, within timeout.
func (m *meshRun) getWithin(ctx context.Context, url string, timeout time.Duration) (*http.Response, error) {
	rctx, cancel := context.WithTimeout(ctx, timeout)
	req, err := http.NewRequestWithContext(rctx, http.MethodGet, url, nil)
	if err != nil {
		cancel()
		return nil, err
	}
	if m.nw.apiKey != "" {
		req.Header.Set("Authorization", "Bearer "+m.nw.apiKey)
	}
	resp, err := m.client.Do(req)
	if err != nil {
		cancel()
		return nil, err
	}
	resp.Body = cancelOnClose{resp.Body, cancel}
	return resp, nil
}

type cancelOnClose struct {
	io.ReadCloser
	cancel context.CancelFunc
}

func (c cancelOnClose) Close() error {
	err := c.ReadCloser.Close()
	c.cancel()
	return err
}

// profileSeconds is how long each node's CPU profile runs; traceSeconds
// how long its execution trace does (a trace grows by megabytes a second).
const profileSeconds, traceSeconds = 4, 1

// profile decodes n streams, over and over, while every node takes a CPU
// profile, and writes the profiles to the profile dir.
func (m *meshRun) profile(ctx context.Context, api, model string, n int, tokens func(stream, run, n int) []int32, round, stages int) error {
	if err := os.MkdirAll(m.cfg.ProfileDir, 0o755); err != nil {
		return err
	}
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	errs := make([]error, 2*len(m.procs)) // a CPU profile and a trace each
	var wg sync.WaitGroup
	for i, p := range m.procs {
		name := fmt.Sprintf("%s-%dstages-%dstreams-node%d.pprof", strings.ReplaceAll(m.nw.name, "+", "-"), stages, n, i+1)
		wg.Go(func() {
			errs[i] = m.fetch(ctx, fmt.Sprintf("%s/debug/pprof/profile?seconds=%d", p.url, profileSeconds), filepath.Join(m.cfg.ProfileDir, name))
		})
		if m.cfg.Trace {
			wg.Go(func() {
				// Start after the CPU profile, so that the trace holds its samples.
				select {
				case <-ctx.Done():
					return
				case <-time.After(time.Second):
				}
				trace := strings.TrimSuffix(name, ".pprof") + ".trace"
				errs[len(m.procs)+i] = m.fetch(ctx, fmt.Sprintf("%s/debug/pprof/trace?seconds=%d", p.url, traceSeconds), filepath.Join(m.cfg.ProfileDir, trace))
			})
		}
	}
	done := make(chan struct{})
	go func() { wg.Wait(); close(done) }()
	for run := 0; ; run++ {
		select {
		case <-done:
			return errors.Join(errs...)
		default:
		}
		if _, err := runStreams(ctx, m.client, api, m.nw.apiKey, model, n, m.cfg.DecodeTokens, m.cfg.Temperature, func(i int) []int32 { return tokens(2000+i, round*1000+run, m.cfg.PromptTokens) }, nil); err != nil {
			cancel()
			<-done
			return err
		}
	}
}

// fetch saves what a GET of url returns into path.
func (m *meshRun) fetch(ctx context.Context, url, path string) error {
	resp, err := m.getWithin(ctx, url, profileSeconds*time.Second+time.Minute)
	if err != nil {
		return err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return fmt.Errorf("GET %s: %s", url, resp.Status)
	}
	f, err := os.Create(path)
	if err != nil {
		return err
	}
	if _, err := io.Copy(f, resp.Body); err != nil {
		f.Close()
		return fmt.Errorf("reading %s: %w", url, err)
	}
	return f.Close()
}

// status is node 1's /api/status.
func (m *meshRun) status(ctx context.Context) (node.Status, error) {
	var st node.Status
	resp, err := m.get(ctx, m.procs[0].url+"/api/status")
	if err != nil {
		return st, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		return st, fmt.Errorf("/api/status: %s", resp.Status)
	}
	return st, json.NewDecoder(resp.Body).Decode(&st)
}

// waitReady waits until node 1's plan has exactly the given number of
// stages, every member serves its stage of it and is ready, node 1 has a
// pipeline, and every node's /health is 200 — twice in a row, half a second
// apart, so that a plan in the middle of changing is not taken as settled.
func (m *meshRun) waitReady(ctx context.Context, stages int) (plan []node.StatusStage, lanes int, err error) {
	deadline := time.Now().Add(m.cfg.ReadyTimeout)
	var last string
	settled := 0
	why := "node 1 to start"
	for {
		var reason string
		plan, lanes, reason = m.readyOnce(ctx, stages)
		if reason == "" {
			if p := planText(plan); p == last {
				settled++
			} else {
				last, settled = p, 1
			}
			if settled >= 2 {
				return plan, lanes, nil
			}
			reason = "the plan to stay put"
		} else {
			settled = 0
		}
		why = reason
		if err := m.wait(ctx, deadline, why); err != nil {
			return nil, 0, err
		}
		if settled > 0 {
			select {
			case <-ctx.Done():
				return nil, 0, ctx.Err()
			case <-time.After(250 * time.Millisecond):
			}
		}
	}
}

// readyOnce returns node 1's plan and lanes, or why the mesh is not ready
// yet.
func (m *meshRun) readyOnce(ctx context.Context, stages int) ([]node.StatusStage, int, string) {
	st, err := m.status(ctx)
	if err != nil {
		return nil, 0, "node 1's /api/status"
	}
	if len(st.Plan) != stages {
		return nil, 0, fmt.Sprintf("a plan of %d stages (node 1 has %d)", stages, len(st.Plan))
	}
	live := 0
	for _, n := range st.Nodes {
		if n.State != "dead" && n.State != "left" {
			live++
		}
	}
	if live != stages {
		return nil, 0, fmt.Sprintf("%d members (node 1 sees %d)", stages, live)
	}
	if !st.Ready {
		return nil, 0, "node 1's pipeline"
	}
	byPeer := map[string]node.StatusNode{}
	for _, n := range st.Nodes {
		byPeer[n.PeerID] = n
	}
	for _, s := range st.Plan {
		n, ok := byPeer[s.Node]
		if !ok || n.State != "ready" {
			return nil, 0, fmt.Sprintf("node …%s to be ready", shortPeer(s.Node))
		}
		serves := false
		for _, sv := range n.Serving {
			serves = serves || (sv.Start == s.Start && sv.End == s.End)
		}
		if !serves {
			return nil, 0, fmt.Sprintf("node …%s to load layers [%d,%d)", shortPeer(s.Node), s.Start, s.End)
		}
	}
	for _, p := range m.procs {
		resp, err := m.get(ctx, p.url+"/health")
		if err != nil {
			return nil, 0, fmt.Sprintf("node %d's /health", p.index)
		}
		io.Copy(io.Discard, resp.Body)
		resp.Body.Close()
		if resp.StatusCode != http.StatusOK {
			return nil, 0, fmt.Sprintf("node %d's /health (%s)", p.index, resp.Status)
		}
	}
	return st.Plan, st.Lanes, ""
}

func freePort() (int, error) {
	ln, err := net.Listen("tcp", "127.0.0.1:0")
	if err != nil {
		return 0, err
	}
	defer ln.Close()
	return ln.Addr().(*net.TCPAddr).Port, nil
}

func randomKey() string {
	b := make([]byte, 16)
	rand.Read(b)
	return "bench-" + hex.EncodeToString(b)
}

// promptTokens returns a deterministic prompt of n token ids for a stream
// and run (the same for every stage count and network), drawn from the
// middle of the vocabulary, away from control tokens at either end.
func promptTokens(vocab int) func(stream, run, n int) []int32 {
	lo, hi := vocab/8, vocab/2
	if hi <= lo {
		lo, hi = 0, vocab
	}
	return func(stream, run, n int) []int32 {
		rng := mrand.New(mrand.NewPCG(uint64(stream), uint64(run)+1))
		out := make([]int32, n)
		for i := range out {
			out[i] = int32(lo + rng.IntN(hi-lo))
		}
		return out
	}
}

// streamResult is one streamed completion as the client saw it.
type streamResult struct {
	text   string      // the completion
	start  time.Time   // request sent
	first  time.Time   // first text chunk
	chunks []time.Time // every text chunk, the first included
	end    time.Time   // the chunk with finish_reason
	tokens int         // usage.completion_tokens (else the text chunks)
	finish string
}

// runStreams sends n streaming completions at once, at the given
// temperature (each stream with a seed of its own), and reads them all.
// allFirst, if set, is called once every stream has its first token: from
// then on the passes are decode passes.
func runStreams(ctx context.Context, client *http.Client, api, key, model string, n, maxTokens int, temperature float64,
	prompt func(i int) []int32, allFirst func()) ([]streamResult, error) {
	ctx, cancel := context.WithCancel(ctx)
	defer cancel()
	res := make([]streamResult, n)
	errs := make([]error, n)
	var wg sync.WaitGroup
	gate := make(chan struct{})
	var firsts atomic.Int32
	first := func() {
		if firsts.Add(1) == int32(n) && allFirst != nil {
			allFirst()
		}
	}
	for i := range n {
		body, err := json.Marshal(map[string]any{
			"model": model, "prompt": prompt(i), "max_tokens": maxTokens, "temperature": temperature, "seed": 1000 + i,
			"stream": true, "stream_options": map[string]any{"include_usage": true},
		})
		if err != nil {
			return nil, err
		}
		wg.Add(1)
		go func() {
			defer wg.Done()
			<-gate
			res[i], errs[i] = runStream(ctx, client, api+"/v1/completions", key, body, first)
			if errs[i] != nil {
				cancel() // one failure spoils the measurement; stop the rest
			}
		}()
	}
	close(gate)
	wg.Wait()
	for i, err := range errs {
		if err != nil && !errors.Is(err, context.Canceled) {
			return nil, fmt.Errorf("stream %d: %w", i+1, err)
		}
	}
	if err := errors.Join(errs...); err != nil {
		return nil, err
	}
	return res, nil
}

// runStream sends one streaming completion and reads it, calling first
// at its first token.
func runStream(ctx context.Context, client *http.Client, url, key string, body []byte, first func()) (streamResult, error) {
	var r streamResult
	req, err := http.NewRequestWithContext(ctx, http.MethodPost, url, bytes.NewReader(body))
	if err != nil {
		return r, err
	}
	req.Header.Set("Content-Type", "application/json")
	req.Header.Set("Accept", "text/event-stream")
	if key != "" {
		req.Header.Set("Authorization", "Bearer "+key)
	}
	r.start = time.Now()
	resp, err := client.Do(req)
	if err != nil {
		return r, err
	}
	defer resp.Body.Close()
	if resp.StatusCode != http.StatusOK {
		msg, _ := io.ReadAll(io.LimitReader(resp.Body, 4096))
		return r, fmt.Errorf("%s: %s", resp.Status, strings.TrimSpace(string(msg)))
	}
	usage := -1
	err = sse.Each(resp.Body, func(data []byte) error {
		now := time.Now()
		var c sse.Chunk
		if err := json.Unmarshal(data, &c); err != nil {
			return fmt.Errorf("bad event %q: %w", data, err)
		}
		if c.Error != nil {
			return fmt.Errorf("server error mid-stream: %s", c.Error.Message)
		}
		for _, ch := range c.Choices {
			r.text += ch.Text
			if ch.Text != "" {
				if r.first.IsZero() {
					r.first = now
					first()
				}
				r.chunks = append(r.chunks, now)
			}
			if ch.FinishReason != nil {
				r.finish, r.end = *ch.FinishReason, now
			}
		}
		if c.Usage != nil {
			usage = c.Usage.CompletionTokens
		}
		return nil
	})
	if err != nil {
		return r, err
	}
	if r.end.IsZero() || len(r.chunks) == 0 {
		return r, errors.New("the stream carried no text or no finish_reason")
	}
	r.tokens = usage
	if r.tokens < 0 {
		r.tokens = len(r.chunks)
	}
	return r, nil
}

// decodeRate is the aggregate decode throughput of streams that ran at
// once. The decode phase is the interval from T0, the latest first token
// of any stream (from then on every stream is past its prefill), to T1,
// the latest end of any stream (its finish_reason chunk, which follows its
// last token at once). A stream's tokens inside (T0, T1] are its
// completion tokens times the share of its text chunks that arrived in
// that interval: exact when every token yields one chunk, as it does
// unless the server holds back an incomplete UTF-8 sequence or a possible
// stop string. The rate is those tokens summed over the streams, divided
// by T1 - T0. For one stream this is (tokens after the first) / (time from
// the first token to the last).
// prefillRate is the prompt tokens of every stream over the time from the
// first request sent to the last first token: the streams' prompts are
// processed together, as a server batches them.
func prefillRate(res []streamResult, promptTokens int) float64 {
	var t0, t1 time.Time
	for _, r := range res {
		if t0.IsZero() || r.start.Before(t0) {
			t0 = r.start
		}
		if r.first.After(t1) {
			t1 = r.first
		}
	}
	if span := t1.Sub(t0).Seconds(); span > 0 {
		return float64(len(res)*promptTokens) / span
	}
	return 0
}

func decodeRate(res []streamResult) (float64, error) {
	var t0, t1 time.Time
	for _, r := range res {
		if r.first.After(t0) {
			t0 = r.first
		}
		if r.end.After(t1) {
			t1 = r.end
		}
	}
	span := t1.Sub(t0).Seconds()
	if span <= 0 {
		return 0, errors.New("no decode phase: every stream ended with its first token (too few tokens?)")
	}
	var toks float64
	for _, r := range res {
		in := 0
		for _, c := range r.chunks {
			if c.After(t0) && !c.After(t1) {
				in++
			}
		}
		toks += float64(r.tokens) * float64(in) / float64(len(r.chunks))
	}
	if toks <= 0 {
		return 0, errors.New("no tokens in the decode phase")
	}
	return toks / span, nil
}

func loadAverage() string {
	b, err := os.ReadFile("/proc/loadavg")
	if err != nil {
		return "unknown"
	}
	f := strings.Fields(string(b))
	if len(f) < 3 {
		return "unknown"
	}
	return strings.Join(f[:3], " ")
}

// PrintMesh writes the mesh table.
func PrintMesh(w io.Writer, rows []MeshRow) {
	piped, other := false, false
	fmt.Fprintf(w, "\n%-14s %6s %-18s %7s %14s %13s %10s %12s %9s  %s\n", "network", "stages", "layers", "streams", "prefill tok/s", "decode tok/s", "×1-stage", "first tok s", "step ms", "stage compute ms, the rest")
	for _, r := range rows {
		ratio := ""
		if r.Ratio > 0 {
			ratio = fmt.Sprintf("%.2f", r.Ratio)
		}
		stages := fmt.Sprint(r.Stages)
		switch {
		case r.Lanes > 1 && r.Lanes == r.Stages:
			stages += "*"
			piped = true
		case r.Lanes > 1:
			stages += fmt.Sprintf("*%d", r.Lanes) // serve --micro-batches
			other = true
		}
		fmt.Fprintf(w, "%-14s %6s %-18s %7d %14.1f %13.2f %10s %12.2f %9s  %s\n", r.Network, stages, planLayers(r.Plan), r.Streams, r.PrefillTPS, r.DecodeTPS, ratio, r.FirstToken.Seconds(),
			millis(r.Step), stepText(r.Step, r.Compute))
	}
	if piped {
		fmt.Fprintln(w, "(*: pipelined, a micro-batch in flight on every stage)")
	}
	if other {
		fmt.Fprintln(w, "(*N: pipelined, N micro-batches in flight: serve --micro-batches)")
	}
	fmt.Fprintln(w, "(step: one forward pass through every stage as node 1 waits for it; stage compute: each node's, node 1 (the API's) first, its layers in brackets; the rest: hops, framing and scheduling, which overlap with compute when lanes pipeline)")
	header := false
	for _, r := range rows {
		p := phaseText(r.Compute)
		if p == "" {
			continue
		}
		if !header {
			fmt.Fprintf(w, "\n%-14s %6s %7s  %s\n", "network", "stages", "streams", "stage pass ms: graph/alloc/launch/wait (host builds the graph / ggml's scheduler allocates it / queues it / waits for the backend)")
			header = true
		}
		fmt.Fprintf(w, "%-14s %6d %7d  %s\n", r.Network, r.Stages, r.Streams, p)
	}
	// Greedy output must not depend on how the model is split.
	ref := map[string]string{}
	for _, r := range rows {
		if r.Stages == 1 {
			ref[r.Network] = r.Greedy
		}
	}
	for _, r := range rows {
		if want, ok := ref[r.Network]; ok && r.Stages > 1 && r.Streams == rows[0].Streams {
			verdict := "equal to"
			if r.Greedy != want {
				verdict = "DIFFERENT from"
			}
			fmt.Fprintf(w, "greedy text, %s %d stages: %s the 1-stage run's\n", r.Network, r.Stages, verdict)
		}
	}
}

// netnsLab is the namespaces, veths and bridge of a netns run, and the
// delay relay between the namespaces when the delay is not netem's.
type netnsLab struct {
	nodes int
	relay *netdelay.Mesh
}

func netnsName(i int) string { return fmt.Sprintf("%s%d", netnsPrefix, i) }

// setupNetns makes one namespace per node, each with a veth whose other end
// is on a bridge the host holds 10.77.1.1 on; node i gets 10.77.1.(10+i).
//
// With a delay, every hop between two nodes costs it one way (twice it
// for a round trip), in one of two ways. Where the kernel has netem, each
// node's veth gets a netem qdisc: every packet a node sends waits the
// delay (its HTTP answers to this process too). Otherwise a delay relay in
// this process carries the nodes' libp2p connections (port 4001: stage
// streams, gossip and weights; not HTTP): an nftables rule in each
// namespace sends a node's connections to another node's port 4001 to the
// relay for that pair on the bridge, which forwards every chunk the delay
// after reading it, both ways (netdelay.Start).
func setupNetns(ctx context.Context, nodes int, delay time.Duration, log io.Writer) (lab *netnsLab, err error) {
	if runtime.GOOS != "linux" {
		return nil, errors.New("--netns-delay needs Linux network namespaces")
	}
	if os.Geteuid() != 0 {
		return nil, errors.New("--netns-delay needs root (it creates network namespaces, veths and a bridge)")
	}
	if _, err := exec.LookPath("ip"); err != nil {
		return nil, errors.New("--netns-delay needs iproute2's ip command in PATH")
	}
	lab = &netnsLab{nodes: nodes}
	if err := lab.clearStale(); err != nil {
		return nil, err
	}
	if err := checkSubnetFree(); err != nil {
		return nil, err
	}
	fmt.Fprintf(log, "network namespaces: bridge %s at %s1/24, %d namespaces %s1…\n", netnsBridge, netnsSubnet, nodes, netnsPrefix)
	defer func() {
		if err != nil {
			lab.cleanup(log)
		}
	}()
	steps := [][]string{
		{"link", "add", netnsBridge, "type", "bridge"},
		{"addr", "add", netnsSubnet + "1/24", "dev", netnsBridge},
		{"link", "set", netnsBridge, "up"},
	}
	for i := 1; i <= nodes; i++ {
		ns, host, peer := netnsName(i), fmt.Sprintf("mnbh%d", i), netnsPeerLink(i)
		steps = append(steps,
			[]string{"netns", "add", ns},
			[]string{"link", "add", host, "type", "veth", "peer", "name", peer},
			[]string{"link", "set", host, "master", netnsBridge},
			[]string{"link", "set", host, "up"},
			[]string{"link", "set", peer, "netns", ns},
			[]string{"-n", ns, "link", "set", "lo", "up"},
			[]string{"-n", ns, "addr", "add", fmt.Sprintf("%s%d/24", netnsSubnet, 10+i), "dev", peer},
			[]string{"-n", ns, "link", "set", peer, "up"},
		)
	}
	for _, s := range steps {
		if err := runCmd("ip", s...); err != nil {
			return nil, err
		}
	}
	if delay <= 0 {
		fmt.Fprintf(log, "no delay between the namespaces\n")
		return lab, nil
	}
	if err := lab.addDelay(ctx, delay, log); err != nil {
		return nil, err
	}
	return lab, nil
}

// netnsPeerLink is node i's end of its veth, inside its namespace.
func netnsPeerLink(i int) string { return fmt.Sprintf("mnbn%d", i) }

// addDelay delays every hop between the nodes: netem on each node's veth
// where the kernel has it, else the delay relay.
func (l *netnsLab) addDelay(ctx context.Context, delay time.Duration, log io.Writer) error {
	if _, err := exec.LookPath("tc"); err == nil {
		err := netdelay.Netem(ctx, netnsName(1), netnsPeerLink(1), delay)
		if err == nil {
			for i := 2; i <= l.nodes && err == nil; i++ {
				err = netdelay.Netem(ctx, netnsName(i), netnsPeerLink(i), delay)
			}
			if err != nil {
				return fmt.Errorf("--netns-delay: %w", err)
			}
			fmt.Fprintf(log, "delay %v: netem qdisc on each node's veth (every packet a node sends waits %v)\n", delay, delay)
			return nil
		}
		if !errors.Is(err, netdelay.ErrNoNetem) {
			return fmt.Errorf("--netns-delay: %w", err)
		}
		fmt.Fprintf(log, "delay %v: this kernel has no netem qdisc (sch_netem); using the delay relay\n", delay)
	} else {
		fmt.Fprintf(log, "delay %v: no tc command for netem; using the delay relay\n", delay)
	}
	if _, err := exec.LookPath("nft"); err != nil {
		return fmt.Errorf("--netns-delay: without netem the delay relay needs nftables' nft command in PATH (or pass --netns-delay 0): %w", err)
	}
	cfg := netdelay.Config{Port: netnsP2P, Gateway: netnsSubnet + "1", BasePort: netnsRelayBase, Delay: delay}
	for i := 1; i <= l.nodes; i++ {
		cfg.Namespaces = append(cfg.Namespaces, netnsName(i))
		cfg.Addrs = append(cfg.Addrs, fmt.Sprintf("%s%d", netnsSubnet, 10+i))
	}
	r, err := netdelay.Start(ctx, cfg)
	if err != nil {
		return fmt.Errorf("--netns-delay: starting the delay relay: %w", err)
	}
	l.relay = r
	fmt.Fprintf(log, "delay relay: every node's libp2p connections (port %d: stages, gossip, weights; not HTTP) to another node go through this process at %s1:%d+10i+j, each chunk forwarded %v after it was read, both ways\n",
		netnsP2P, netnsSubnet, netnsRelayBase, delay)
	return nil
}

// clearStale removes namespaces and the bridge a killed earlier run left,
// refusing when a process still runs in one of them.
func (l *netnsLab) clearStale() error {
	out, _ := exec.Command("ip", "netns", "list").Output()
	for _, line := range strings.Split(string(out), "\n") {
		f := strings.Fields(line)
		if len(f) == 0 || !strings.HasPrefix(f[0], netnsPrefix) {
			continue
		}
		pids, _ := exec.Command("ip", "netns", "pids", f[0]).Output()
		if strings.TrimSpace(string(pids)) != "" {
			return fmt.Errorf("network namespace %s is in use (another 'meshnode bench --mesh' running?); processes: %s", f[0], strings.Join(strings.Fields(string(pids)), " "))
		}
		if err := runCmd("ip", "netns", "del", f[0]); err != nil {
			return err
		}
	}
	if exec.Command("ip", "link", "show", netnsBridge).Run() == nil {
		if err := runCmd("ip", "link", "del", netnsBridge); err != nil {
			return err
		}
	}
	for i := 1; i <= maxMeshNodes; i++ {
		if exec.Command("ip", "link", "show", fmt.Sprintf("mnbh%d", i)).Run() == nil {
			runCmd("ip", "link", "del", fmt.Sprintf("mnbh%d", i))
		}
	}
	return nil
}

// checkSubnetFree refuses to shadow an address of 10.77.1.0/24 that some
// interface of the host already has.
func checkSubnetFree() error {
	ifs, err := net.Interfaces()
	if err != nil {
		return err
	}
	for _, ifc := range ifs {
		addrs, _ := ifc.Addrs()
		for _, a := range addrs {
			if ipn, ok := a.(*net.IPNet); ok && strings.HasPrefix(ipn.IP.String(), netnsSubnet) {
				return fmt.Errorf("%s already has %s, in the subnet the benchmark uses (%s0/24)", ifc.Name, ipn, netnsSubnet)
			}
		}
	}
	return nil
}

// cleanup stops the delay relay and deletes the namespaces (which takes
// their veths and nftables rules along) and the bridge. It runs whatever
// happened before, so it only reports failures.
func (l *netnsLab) cleanup(log io.Writer) {
	if l.relay != nil {
		l.relay.Close()
	}
	for i := 1; i <= l.nodes; i++ {
		ns := netnsName(i)
		if exec.Command("ip", "netns", "pids", ns).Run() != nil {
			continue // never made
		}
		if err := runCmd("ip", "netns", "del", ns); err != nil {
			fmt.Fprintf(log, "cleanup: %v\n", err)
		}
		if exec.Command("ip", "link", "show", fmt.Sprintf("mnbh%d", i)).Run() == nil {
			runCmd("ip", "link", "del", fmt.Sprintf("mnbh%d", i))
		}
	}
	if exec.Command("ip", "link", "show", netnsBridge).Run() == nil {
		if err := runCmd("ip", "link", "del", netnsBridge); err != nil {
			fmt.Fprintf(log, "cleanup: %v\n", err)
		}
	}
}

func runCmd(name string, args ...string) error {
	out, err := exec.Command(name, args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("%s %s: %w: %s", name, strings.Join(args, " "), err, strings.TrimSpace(string(out)))
	}
	return nil
}
