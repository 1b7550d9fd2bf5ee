package admin

import (
	"net/http"
	"strconv"
	"strings"
	"time"

	"github.com/prometheus/client_golang/prometheus"
	"github.com/prometheus/client_golang/prometheus/collectors"
	"github.com/prometheus/client_golang/prometheus/promhttp"
)

// Gauges is what a node reports at scrape time: levels, and totals it
// keeps itself.
type Gauges struct {
	Peer, Name, Version, Engine, Backend, Model string

	Ready          bool // a complete pipeline
	PipelineStages int
	LoadingPct     float64 // while loading its layers, else 0

	QueueDepth      int // requests waiting for a sequence slot
	Active          int // sequences generating
	PromptTokens    uint64
	GeneratedTokens uint64
	Replays         uint64 // sequences replayed after their pipeline broke

	KVTokens, KVCapacity int    // cached positions, and what the cache holds
	KVBytes, KVUsedBytes uint64 // KV cache reserved, and in use
	WeightBytes          uint64
	MemUsed              uint64 // weights + KV reserved + scratch
	MemOffered           uint64
	MemTotal             uint64

	// Members by state (ready, loading, draining, suspect, dead, left).
	Members map[string]int
}

// Metrics are a node's Prometheus metrics, in a registry of their own (no
// global state: several nodes can run in one process).
type Metrics struct {
	reg *prometheus.Registry

	requests     *prometheus.CounterVec
	errors       *prometheus.CounterVec
	events       *prometheus.CounterVec
	replans      prometheus.Counter
	ttft         prometheus.Histogram
	duration     prometheus.Histogram
	prefillTPS   prometheus.Histogram
	decodeTPS    prometheus.Histogram
	step         prometheus.Histogram
	stageCompute *prometheus.HistogramVec
	stageTokens  *prometheus.CounterVec
	stagePhase   *prometheus.CounterVec
	stageAhead   *prometheus.CounterVec
	stageAlloc   *prometheus.CounterVec
	peerRTT      *prometheus.HistogramVec
	hopBytes     *prometheus.CounterVec
	localStreams *prometheus.CounterVec
	handoffs     *prometheus.CounterVec
	http         *prometheus.CounterVec
}

// Request outcomes (label "outcome" of meshnode_requests_total).
const (
	OutcomeOK        = "ok"        // finished: stop or length
	OutcomeError     = "error"     // failed while generating
	OutcomeCancelled = "cancelled" // the client went away
	OutcomeRejected  = "rejected"  // refused before generating (queue full, bad request, no pipeline)
)

// NewMetrics makes the registry; gauges is called on every scrape.
func NewMetrics(gauges func() Gauges) *Metrics {
	m := &Metrics{reg: prometheus.NewRegistry()}
	f := factory{m.reg}
	m.requests = f.counterVec("meshnode_requests_total",
		"Generation requests that entered the mesh at this node, by outcome (ok, error, cancelled, rejected).", "outcome")
	m.errors = f.counterVec("meshnode_errors_total",
		"Errors by kind: request errors (overloaded, context_length, unavailable, invalid_request, generation) and mesh errors (bad_peer, stage_load, pipeline, no_placement).", "kind")
	m.events = f.counterVec("meshnode_events_total", "Mesh events by kind (join, leave, failed, plan, load, fetch, pipeline, error, ...).", "kind")
	m.replans = f.counter("meshnode_replans_total", "Times the mesh's plan changed, as this node saw it.")
	m.ttft = f.histogram("meshnode_time_to_first_token_seconds",
		"Time from a request's admission to its first generated token (queueing and prefill included).",
		prometheus.ExponentialBucketsRange(0.005, 60, 16))
	m.duration = f.histogram("meshnode_request_duration_seconds", "Time from a request's admission to its last token.",
		prometheus.ExponentialBucketsRange(0.01, 600, 16))
	m.prefillTPS = f.histogram("meshnode_prefill_tokens_per_second", "Prompt tokens per second of time to first token, per request.",
		prometheus.ExponentialBucketsRange(1, 100000, 16))
	m.decodeTPS = f.histogram("meshnode_decode_tokens_per_second", "Generated tokens per second after the first, per request.",
		prometheus.ExponentialBucketsRange(0.5, 10000, 16))
	m.step = f.histogram("meshnode_pipeline_step_seconds",
		"Forward passes of this node's requests through the whole pipeline (every stage and hop), as the scheduler waits for them.",
		prometheus.ExponentialBucketsRange(0.0002, 30, 18))
	m.stageCompute = f.histogramVec("meshnode_stage_compute_seconds",
		"Forward passes of this node's stage (its layer range, label stage=\"START-END\"), compute only.",
		prometheus.ExponentialBucketsRange(0.0001, 30, 18), "stage")
	m.stagePhase = f.counterVec("meshnode_stage_phase_seconds_total",
		"Where this node's stage forward passes spent their time: phase=\"graph\" (building it on the host, and the next pass's while this one computes when built ahead), \"alloc\" (the scheduler splitting and allocating it, when not done ahead), \"launch\" (copying inputs and queueing it), \"wait\" (the backend computing, and the read-back).",
		"stage", "phase")
	m.stageAhead = f.counterVec("meshnode_stage_passes_built_ahead_total",
		"Forward passes of this node's stage whose graph was built while the previous pass computed (GPU stages, steady decoding).", "stage")
	m.stageAlloc = f.counterVec("meshnode_stage_passes_allocated_ahead_total",
		"Forward passes of this node's stage whose graph the scheduler had split and allocated while the stage waited for its input.", "stage")
	m.stageTokens = f.counterVec("meshnode_stage_tokens_total", "Token rows that went through this node's stage.", "stage", "kind")
	m.peerRTT = f.histogramVec("meshnode_hop_rtt_seconds",
		"Round trips to each peer (libp2p ping), label peer=peer ID; a pipeline hop's latency is the RTT between its two nodes.",
		prometheus.ExponentialBucketsRange(0.00005, 2, 16), "peer")
	m.hopBytes = f.counterVec("meshnode_hop_bytes_total", "Stage traffic (wire bytes of gRPC, or of local sockets' frames) to and from each peer.", "peer", "direction")
	m.localStreams = f.counterVec("meshnode_local_stage_streams_total",
		"Stage streams this node opened to nodes on its machine over their local Unix socket (serve --local-hops), by peer.", "peer")
	m.handoffs = f.counterVec("meshnode_stage_handoffs_total",
		"Decode passes of this node's stage whose hidden states went to the next stage (direction=out) or came from the previous one (in) in their shared GPU's memory (serve --gpu-handoff).", "stage", "direction")
	m.http = f.counterVec("meshnode_http_requests_total", "HTTP requests to the OpenAI API by endpoint and status code.", "endpoint", "code")

	m.reg.MustRegister(gaugeCollector{gauges})
	m.reg.MustRegister(collectors.NewGoCollector())
	m.reg.MustRegister(collectors.NewProcessCollector(collectors.ProcessCollectorOpts{}))
	return m
}

// Registry is where the metrics live, for tests and extra collectors.
func (m *Metrics) Registry() *prometheus.Registry { return m.reg }

// Handler serves the Prometheus text format.
func (m *Metrics) Handler() http.Handler {
	return promhttp.HandlerFor(m.reg, promhttp.HandlerOpts{ErrorHandling: promhttp.ContinueOnError})
}

// Rejected counts a request refused before it generated anything.
func (m *Metrics) Rejected(kind string) {
	m.requests.WithLabelValues(OutcomeRejected).Inc()
	m.errors.WithLabelValues(kind).Inc()
}

// Request records a finished request. ttft is 0 when no token came.
func (m *Metrics) Request(outcome string, prompt, completion int, ttft, total time.Duration) {
	m.requests.WithLabelValues(outcome).Inc()
	if outcome == OutcomeError {
		m.errors.WithLabelValues("generation").Inc()
	}
	if completion == 0 || ttft <= 0 {
		return
	}
	m.ttft.Observe(ttft.Seconds())
	m.duration.Observe(total.Seconds())
	m.prefillTPS.Observe(float64(prompt) / ttft.Seconds())
	if decode := total - ttft; completion > 1 && decode > 0 {
		m.decodeTPS.Observe(float64(completion-1) / decode.Seconds())
	}
}

// Error counts an error of a kind.
func (m *Metrics) Error(kind string) { m.errors.WithLabelValues(kind).Inc() }

// Event counts a mesh event.
func (m *Metrics) Event(kind string) { m.events.WithLabelValues(kind).Inc() }

// Replan counts a change of plan.
func (m *Metrics) Replan() { m.replans.Inc() }

// Step records one forward pass through the whole pipeline.
func (m *Metrics) Step(d time.Duration) { m.step.Observe(d.Seconds()) }

// StageForward records one forward pass of this node's stage.
func (m *Metrics) StageForward(stage string, d time.Duration, rows, outputs int) {
	m.stageCompute.WithLabelValues(stage).Observe(d.Seconds())
	m.stageTokens.WithLabelValues(stage, "input").Add(float64(rows))
	m.stageTokens.WithLabelValues(stage, "output").Add(float64(outputs))
}

// StagePhases adds time that this node's stage spent in each phase of its
// forward passes, and how many of them had been built ahead.
func (m *Metrics) StagePhases(stage string, ahead, allocated uint64, graph, alloc, launch, wait time.Duration) {
	m.stageAhead.WithLabelValues(stage).Add(float64(ahead))
	m.stageAlloc.WithLabelValues(stage).Add(float64(allocated))
	m.stagePhase.WithLabelValues(stage, "graph").Add(graph.Seconds())
	m.stagePhase.WithLabelValues(stage, "alloc").Add(alloc.Seconds())
	m.stagePhase.WithLabelValues(stage, "launch").Add(launch.Seconds())
	m.stagePhase.WithLabelValues(stage, "wait").Add(wait.Seconds())
}

// PeerRTT records a round trip to a peer.
func (m *Metrics) PeerRTT(peer string, d time.Duration) {
	m.peerRTT.WithLabelValues(peer).Observe(d.Seconds())
}

// StageHandoff counts a pass of stage whose hidden states went out to the
// next stage, or came in from the previous one, on their GPU.
func (m *Metrics) StageHandoff(stage, direction string) {
	m.handoffs.WithLabelValues(stage, direction).Inc()
}

// LocalStream counts a stage stream opened to peer over its local socket.
func (m *Metrics) LocalStream(peer string) { m.localStreams.WithLabelValues(peer).Inc() }

// HopBytes counts stage traffic to ("sent") or from ("received") a peer.
func (m *Metrics) HopBytes(peer, direction string, n int) {
	m.hopBytes.WithLabelValues(peer, direction).Add(float64(n))
}

// CountHTTP counts the requests next answers, by endpoint and status code.
func (m *Metrics) CountHTTP(next http.Handler) http.Handler {
	return http.HandlerFunc(func(w http.ResponseWriter, r *http.Request) {
		cw := &codeWriter{ResponseWriter: w}
		defer func() {
			code := cw.code
			if code == 0 {
				code = 499 // nothing written: the client left first
			}
			m.http.WithLabelValues(endpoint(r.URL.Path), strconv.Itoa(code)).Inc()
		}()
		next.ServeHTTP(cw, r)
	})
}

// endpoint bounds the label's values to the API's routes.
func endpoint(path string) string {
	switch {
	case path == "/v1/chat/completions", path == "/v1/completions", path == "/v1/models", path == "/health", path == "/":
		return path
	case strings.HasPrefix(path, "/v1/models/"):
		return "/v1/models/{id}"
	}
	return "other"
}

// codeWriter records the status code; Unwrap keeps http.ResponseController
// (flushes, deadlines) working through it.
type codeWriter struct {
	http.ResponseWriter
	code int
}

func (w *codeWriter) WriteHeader(code int) {
	if w.code == 0 && code >= 200 {
		w.code = code
	}
	w.ResponseWriter.WriteHeader(code)
}

func (w *codeWriter) Write(p []byte) (int, error) {
	if w.code == 0 {
		w.code = http.StatusOK
	}
	return w.ResponseWriter.Write(p)
}

func (w *codeWriter) Flush() {
	if f, ok := w.ResponseWriter.(http.Flusher); ok {
		if w.code == 0 {
			w.code = http.StatusOK
		}
		f.Flush()
	}
}

func (w *codeWriter) Unwrap() http.ResponseWriter { return w.ResponseWriter }

type factory struct{ reg *prometheus.Registry }

func (f factory) counter(name, help string) prometheus.Counter {
	c := prometheus.NewCounter(prometheus.CounterOpts{Name: name, Help: help})
	f.reg.MustRegister(c)
	return c
}

func (f factory) counterVec(name, help string, labels ...string) *prometheus.CounterVec {
	c := prometheus.NewCounterVec(prometheus.CounterOpts{Name: name, Help: help}, labels)
	f.reg.MustRegister(c)
	return c
}

func (f factory) histogram(name, help string, buckets []float64) prometheus.Histogram {
	h := prometheus.NewHistogram(prometheus.HistogramOpts{Name: name, Help: help, Buckets: buckets})
	f.reg.MustRegister(h)
	return h
}

func (f factory) histogramVec(name, help string, buckets []float64, labels ...string) *prometheus.HistogramVec {
	h := prometheus.NewHistogramVec(prometheus.HistogramOpts{Name: name, Help: help, Buckets: buckets}, labels)
	f.reg.MustRegister(h)
	return h
}

// gaugeCollector turns a Gauges snapshot into metrics at scrape time.
type gaugeCollector struct{ f func() Gauges }

var (
	descInfo = prometheus.NewDesc("meshnode_node_info", "This node: peer ID, name, version, engine, backend and model (value 1).",
		[]string{"peer", "name", "version", "engine", "backend", "model"}, nil)
	descReady      = prometheus.NewDesc("meshnode_ready", "1 when this node can serve requests (a complete pipeline), else 0.", nil, nil)
	descStages     = prometheus.NewDesc("meshnode_pipeline_stages", "Stages in the mesh's plan (0: no placement).", nil, nil)
	descLoading    = prometheus.NewDesc("meshnode_loading_percent", "Progress of slicing or fetching this node's layers while it loads.", nil, nil)
	descQueue      = prometheus.NewDesc("meshnode_queue_depth", "Requests waiting for a sequence slot at this node.", nil, nil)
	descActive     = prometheus.NewDesc("meshnode_active_sequences", "Sequences generating for requests that entered at this node.", nil, nil)
	descPrompt     = prometheus.NewDesc("meshnode_prompt_tokens_total", "Prompt tokens prefilled for requests that entered at this node.", nil, nil)
	descGenerated  = prometheus.NewDesc("meshnode_generated_tokens_total", "Tokens generated for requests that entered at this node.", nil, nil)
	descReplays    = prometheus.NewDesc("meshnode_sequence_replays_total", "Sequences replayed on a new pipeline after theirs broke.", nil, nil)
	descKVTokens   = prometheus.NewDesc("meshnode_kv_cache_tokens", "Positions cached in this node's stage KV cache, all sequences.", nil, nil)
	descKVCap      = prometheus.NewDesc("meshnode_kv_cache_capacity_tokens", "Positions this node's stage KV cache holds.", nil, nil)
	descKVUsed     = prometheus.NewDesc("meshnode_kv_cache_used_bytes", "Bytes of this node's stage KV cache holding cached positions.", nil, nil)
	descMem        = prometheus.NewDesc("meshnode_memory_bytes", "Memory by kind: weights, kv (reserved), used (weights + kv + scratch), offered (to the planner), total (machine).", []string{"kind"}, nil)
	descMembers    = prometheus.NewDesc("meshnode_mesh_members", "Members of the mesh by state, as this node sees it.", []string{"state"}, nil)
	allStates      = []string{StateReady, StateLoading, StateDraining, StateSuspect, StateDead, StateLeft}
	gaugeDescslist = []*prometheus.Desc{descInfo, descReady, descStages, descLoading, descQueue, descActive, descPrompt, descGenerated, descReplays,
		descKVTokens, descKVCap, descKVUsed, descMem, descMembers}
)

func (c gaugeCollector) Describe(ch chan<- *prometheus.Desc) {
	for _, d := range gaugeDescslist {
		ch <- d
	}
}

func (c gaugeCollector) Collect(ch chan<- prometheus.Metric) {
	g := c.f()
	gauge := func(d *prometheus.Desc, v float64, labels ...string) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.GaugeValue, v, labels...)
	}
	counter := func(d *prometheus.Desc, v float64) {
		ch <- prometheus.MustNewConstMetric(d, prometheus.CounterValue, v)
	}
	gauge(descInfo, 1, g.Peer, g.Name, g.Version, g.Engine, g.Backend, g.Model)
	gauge(descReady, b2f(g.Ready))
	gauge(descStages, float64(g.PipelineStages))
	gauge(descLoading, g.LoadingPct)
	gauge(descQueue, float64(g.QueueDepth))
	gauge(descActive, float64(g.Active))
	counter(descPrompt, float64(g.PromptTokens))
	counter(descGenerated, float64(g.GeneratedTokens))
	counter(descReplays, float64(g.Replays))
	gauge(descKVTokens, float64(g.KVTokens))
	gauge(descKVCap, float64(g.KVCapacity))
	gauge(descKVUsed, float64(g.KVUsedBytes))
	gauge(descMem, float64(g.WeightBytes), "weights")
	gauge(descMem, float64(g.KVBytes), "kv")
	gauge(descMem, float64(g.MemUsed), "used")
	gauge(descMem, float64(g.MemOffered), "offered")
	gauge(descMem, float64(g.MemTotal), "total")
	for _, s := range allStates {
		gauge(descMembers, float64(g.Members[s]), s)
	}
}

func b2f(b bool) float64 {
	if b {
		return 1
	}
	return 0
}
