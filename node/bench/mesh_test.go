package bench

import (
	"bytes"
	"context"
	"fmt"
	"math"
	"os"
	"os/exec"
	"path/filepath"
	"strings"
	"testing"
	"time"
)

const meshTestModel = "../../../shared/models/stories260K.gguf"

// buildMeshnode builds the binary that a test mesh's nodes run.
func buildMeshnode(t *testing.T) string {
	t.Helper()
	bin := filepath.Join(t.TempDir(), "meshnode")
	build := exec.Command("go", "build", "-tags", "repack", "-o", bin, "github.com/meshnode/meshnode/cmd/meshnode")
	if out, err := build.CombinedOutput(); err != nil {
		t.Fatalf("building meshnode: %v\n%s", err, out)
	}
	return bin
}

// TestMeshLoopback forms meshes of 1 and 2 processes on stories260K and
// measures a few tokens through node 1's API.
func TestMeshLoopback(t *testing.T) {
	if testing.Short() {
		t.Skip("starts meshnode processes")
	}
	if _, err := os.Stat(meshTestModel); err != nil {
		t.Skipf("no test model: %v", err)
	}
	bin := buildMeshnode(t)

	ctx, cancel := context.WithTimeout(context.Background(), 3*time.Minute)
	defer cancel()
	var log bytes.Buffer
	start := time.Now()
	rows, err := RunMesh(ctx, MeshConfig{
		Model: meshTestModel, Binary: bin, Stages: []int{1, 2}, Streams: []int{1, 2},
		PromptTokens: 16, DecodeTokens: 8, Threads: 1, ReadyTimeout: time.Minute,
	}, &log)
	t.Logf("took %v; log:\n%s", time.Since(start).Round(time.Millisecond), log.String())
	if err != nil {
		t.Fatal(err)
	}
	var table bytes.Buffer
	PrintMesh(&table, rows)
	t.Logf("%s", table.String())

	if len(rows) != 4 {
		t.Fatalf("got %d rows, want 4 (2 stage counts × 2 stream counts)", len(rows))
	}
	i := 0
	for _, stages := range []int{1, 2} {
		for _, streams := range []int{1, 2} {
			r := rows[i]
			i++
			if r.Network != "loopback" || r.Stages != stages || r.Streams != streams {
				t.Errorf("row %d is %s/%d stages/%d streams, want loopback/%d/%d", i, r.Network, r.Stages, r.Streams, stages, streams)
			}
			if !(r.DecodeTPS > 0) || r.Tokens <= 0 {
				t.Errorf("row %d: decode %v tok/s over %d tokens, want both positive", i, r.DecodeTPS, r.Tokens)
			}
			if len(r.Plan) != stages {
				t.Errorf("row %d: node 1's plan has %d stages, want %d: %+v", i, len(r.Plan), stages, r.Plan)
			}
			if !(r.Ratio > 0) {
				t.Errorf("row %d: no ratio to the 1-stage row", i)
			}
		}
	}
	// The two stages cover the model's 5 layers between two distinct nodes.
	p := rows[2].Plan
	if len(p) == 2 && (p[0].Start != 0 || p[0].End != p[1].Start || p[1].End != 5 || p[0].Node == p[1].Node) {
		t.Errorf("2-stage plan %+v does not split layers [0,5) over two nodes", p)
	}
	if strings.Contains(log.String(), "node logs are kept") {
		t.Error("a successful run kept its logs")
	}
}

func TestDecodeRate(t *testing.T) {
	t0 := time.Now()
	at := func(ms ...int) []time.Time {
		var out []time.Time
		for _, m := range ms {
			out = append(out, t0.Add(time.Duration(m)*time.Millisecond))
		}
		return out
	}
	// One stream: 5 tokens, first at 100 ms, last at 500 ms: 4 tokens in 0.4 s.
	one := streamResult{first: at(100)[0], chunks: at(100, 200, 300, 400, 500), end: at(500)[0], tokens: 5}
	if got, err := decodeRate([]streamResult{one}); err != nil || abs(got-10) > 1e-6 {
		t.Errorf("one stream: %v, %v; want 10", got, err)
	}
	// Two streams: the second starts at 300 ms; the phase is (300, 500]:
	// the first has 2 tokens in it, the second 2 (at 400 and 500).
	two := streamResult{first: at(300)[0], chunks: at(300, 400, 500), end: at(500)[0], tokens: 3}
	if got, err := decodeRate([]streamResult{one, two}); err != nil || abs(got-20) > 1e-6 {
		t.Errorf("two streams: %v, %v; want 20", got, err)
	}
	// A token that came without a chunk of its own still counts.
	held := streamResult{first: at(100)[0], chunks: at(100, 300, 500), end: at(500)[0], tokens: 5}
	if got, err := decodeRate([]streamResult{held}); err != nil || abs(got-5*2.0/3/0.4) > 1e-6 {
		t.Errorf("held-back chunk: %v, %v", got, err)
	}
	if _, err := decodeRate([]streamResult{{first: t0, chunks: at(0), end: t0, tokens: 1}}); err == nil {
		t.Error("a single token gave a rate")
	}
}

func abs(x float64) float64 {
	if x < 0 {
		return -x
	}
	return x
}

// TestMergeRounds: rates are medians over rounds, and each ratio is the
// median of per-round ratios to that round's 1-stage mesh, so that drift
// between rounds cancels out.
func TestMergeRounds(t *testing.T) {
	row := func(stages, streams int, tps float64, greedy string) MeshRow {
		return MeshRow{Stages: stages, Streams: streams, DecodeTPS: tps, FirstToken: time.Duration(tps) * time.Millisecond, Greedy: greedy}
	}
	tests := []struct {
		name   string
		rounds [][]MeshRow
		want   []MeshRow // Stages, Streams, DecodeTPS, Ratio, Greedy checked
	}{
		{"one round", [][]MeshRow{{row(1, 1, 40, "a"), row(2, 1, 36, "a")}},
			[]MeshRow{{Stages: 1, Streams: 1, DecodeTPS: 40, Ratio: 1, Greedy: "a"}, {Stages: 2, Streams: 1, DecodeTPS: 36, Ratio: 0.9, Greedy: "a"}}},
		// The machine slows down by half in round 2: the ratio of medians
		// would say 30/30 = 1.0 or worse; per round it is 0.9 every time.
		{"drift", [][]MeshRow{
			{row(1, 8, 80, "a"), row(2, 8, 72, "a")},
			{row(1, 8, 40, "a"), row(2, 8, 36, "a")},
			{row(1, 8, 60, "a"), row(2, 8, 54, "a")},
		}, []MeshRow{{Stages: 1, Streams: 8, DecodeTPS: 60, Ratio: 1, Greedy: "a"}, {Stages: 2, Streams: 8, DecodeTPS: 54, Ratio: 0.9, Greedy: "a"}}},
		{"greedy differs", [][]MeshRow{{row(1, 1, 10, "a"), row(3, 1, 9, "a")}, {row(1, 1, 10, "a"), row(3, 1, 9, "b")}},
			[]MeshRow{{Stages: 1, Streams: 1, DecodeTPS: 10, Ratio: 1, Greedy: "a"}, {Stages: 3, Streams: 1, DecodeTPS: 9, Ratio: 0.9, Greedy: "(differs between rounds)"}}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := mergeRounds(tt.rounds)
			if len(got) != len(tt.want) {
				t.Fatalf("%d rows, want %d", len(got), len(tt.want))
			}
			for i, w := range tt.want {
				g := got[i]
				if g.Stages != w.Stages || g.Streams != w.Streams || math.Abs(g.DecodeTPS-w.DecodeTPS) > 1e-9 ||
					math.Abs(g.Ratio-w.Ratio) > 1e-9 || g.Greedy != w.Greedy {
					t.Errorf("row %d: got stages %d streams %d tps %g ratio %g greedy %q, want %+v", i, g.Stages, g.Streams, g.DecodeTPS, g.Ratio, g.Greedy, w)
				}
			}
		})
	}
}

func TestStepBreakdown(t *testing.T) {
	// scrape is one node's /metrics: its step and stage histograms, and
	// phase totals graph, launch, wait (none when phases is nil).
	scrape := func(step, stepN, compute, computeN float64, phases []float64) string {
		s := fmt.Sprintf(`# HELP meshnode_pipeline_step_seconds Forward passes.
# TYPE meshnode_pipeline_step_seconds histogram
meshnode_pipeline_step_seconds_bucket{le="0.0002"} 0
meshnode_pipeline_step_seconds_bucket{le="+Inf"} %[2]g
meshnode_pipeline_step_seconds_sum %[1]g
meshnode_pipeline_step_seconds_count %[2]g
# HELP meshnode_stage_compute_seconds Stage forward passes.
# TYPE meshnode_stage_compute_seconds histogram
meshnode_stage_compute_seconds_bucket{stage="0-2",le="+Inf"} %[4]g
meshnode_stage_compute_seconds_sum{stage="0-2"} %[3]g
meshnode_stage_compute_seconds_count{stage="0-2"} %[4]g
# TYPE meshnode_stage_tokens_total counter
meshnode_stage_tokens_total{stage="0-2",kind="input"} 12
`, step, stepN, compute, computeN)
		if phases != nil {
			s += fmt.Sprintf(`# TYPE meshnode_stage_phase_seconds_total counter
meshnode_stage_phase_seconds_total{stage="0-2",phase="graph"} %g
meshnode_stage_phase_seconds_total{stage="0-2",phase="alloc"} %g
meshnode_stage_phase_seconds_total{stage="0-2",phase="launch"} %g
meshnode_stage_phase_seconds_total{stage="0-2",phase="wait"} %g
# TYPE meshnode_stage_passes_built_ahead_total counter
meshnode_stage_passes_built_ahead_total{stage="0-2"} %g
# TYPE meshnode_stage_passes_allocated_ahead_total counter
meshnode_stage_passes_allocated_ahead_total{stage="0-2"} %g
`, phases[0], phases[1], phases[2], phases[3], phases[4], phases[5])
		}
		return s
	}
	ms := func(v float64) time.Duration { return time.Duration(v * float64(time.Millisecond)) }
	// as is a scrape of a node whose stage is layers instead of 0-2.
	as := func(layers, scrape string) string {
		return strings.ReplaceAll(scrape, `stage="0-2"`, `stage="`+layers+`"`)
	}
	// moved is a node that ran ten passes of 0-2 and then n of 2-5.
	moved := func(n float64) string {
		return fmt.Sprintf(`# TYPE meshnode_stage_compute_seconds histogram
meshnode_stage_compute_seconds_bucket{stage="0-2",le="+Inf"} 10
meshnode_stage_compute_seconds_sum{stage="0-2"} 0.5
meshnode_stage_compute_seconds_count{stage="0-2"} 10
meshnode_stage_compute_seconds_bucket{stage="2-5",le="+Inf"} %[1]g
meshnode_stage_compute_seconds_sum{stage="2-5"} %[2]g
meshnode_stage_compute_seconds_count{stage="2-5"} %[1]g
`, n, n*0.003)
	}
	tests := []struct {
		name          string
		before, after []string
		step          time.Duration
		compute       []StageTime
	}{
		{
			name:    "two nodes",
			before:  []string{scrape(1, 10, 0.5, 10, nil), as("2-5", scrape(0, 0, 0.2, 10, nil))},
			after:   []string{scrape(1.5, 110, 0.6, 110, nil), as("2-5", scrape(0, 0, 0.4, 110, nil))},
			step:    5 * time.Millisecond,
			compute: []StageTime{{Layers: "0-2", Total: time.Millisecond}, {Layers: "2-5", Total: 2 * time.Millisecond}},
		},
		{
			// The stage of most passes names the node; its mean covers both.
			name:    "a node that changed stages",
			before:  []string{moved(5)},
			after:   []string{moved(105)},
			compute: []StageTime{{Layers: "2-5", Total: 3 * time.Millisecond}},
		},
		{
			name:   "phases",
			before: []string{scrape(1, 10, 0.5, 10, []float64{0.1, 0.01, 0.2, 0.3, 5, 4}), scrape(0, 0, 0.2, 10, []float64{1, 1, 1, 1, 0, 0})},
			after:  []string{scrape(1.5, 110, 0.6, 110, []float64{0.11, 0.012, 0.23, 0.36, 95, 84}), scrape(0, 0, 0.4, 110, []float64{1.1, 1.02, 1.05, 1.05, 0, 0})},
			step:   5 * time.Millisecond,
			compute: []StageTime{
				{Layers: "0-2", Total: ms(1), Graph: ms(0.1), Alloc: ms(0.02), Launch: ms(0.3), Wait: ms(0.6), Ahead: 0.9, Allocated: 0.8},
				{Layers: "0-2", Total: ms(2), Graph: ms(1), Alloc: ms(0.2), Launch: ms(0.5), Wait: ms(0.5)},
			},
		},
		{
			name:    "no passes between the readings",
			before:  []string{scrape(1, 10, 0.5, 10, []float64{1, 2, 3, 4, 5, 6})},
			after:   []string{scrape(1, 10, 0.5, 10, []float64{1, 2, 3, 4, 5, 6})},
			compute: []StageTime{{Layers: "0-2"}},
		},
		{
			name:    "a node that did not answer",
			before:  []string{scrape(1, 10, 0.5, 10, nil), ""},
			after:   []string{scrape(2, 20, 0.6, 20, nil), ""},
			step:    100 * time.Millisecond,
			compute: []StageTime{{Layers: "0-2", Total: 10 * time.Millisecond}, {}},
		},
	}
	read := func(texts []string) []sums {
		var out []sums
		for _, s := range texts {
			out = append(out, parseSums(strings.NewReader(s)))
		}
		return out
	}
	near := func(a, b time.Duration) bool { return (a - b).Abs() < time.Microsecond }
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			step, compute := breakdown(read(tc.before), read(tc.after))
			if !near(step, tc.step) || len(compute) != len(tc.compute) {
				t.Fatalf("step %v, compute %v; want %v, %v", step, compute, tc.step, tc.compute)
			}
			for i, c := range compute {
				w := tc.compute[i]
				if c.Layers != w.Layers || !near(c.Total, w.Total) || !near(c.Graph, w.Graph) || !near(c.Alloc, w.Alloc) || !near(c.Launch, w.Launch) || !near(c.Wait, w.Wait) ||
					math.Abs(c.Ahead-w.Ahead) > 1e-9 || math.Abs(c.Allocated-w.Allocated) > 1e-9 {
					t.Fatalf("compute %+v, want %+v", compute, tc.compute)
				}
			}
		})
	}
	two := []StageTime{{Total: ms(1), Graph: ms(0.25), Launch: ms(0.25), Wait: ms(0.5), Ahead: 0.5}, {Total: ms(2), Graph: ms(0.5), Alloc: ms(0.1), Launch: ms(0.4), Wait: ms(1), Ahead: 1, Allocated: 0.98}}
	if got := stepText(5*time.Millisecond, two); got != "1.000 + 2.000, rest 2.000" {
		t.Fatalf("stepText = %q", got)
	}
	two[0].Layers, two[1].Layers = "18-32", "0-18"
	if got := stepText(5*time.Millisecond, two); got != "1.000 [18-32] + 2.000 [0-18], rest 2.000" {
		t.Fatalf("stepText with layers = %q", got)
	}
	if got := phaseText(two); got != "0.250/-/0.250/0.500 (50% ahead) + 0.500/0.100/0.400/1.000 (100% ahead, 98% allocated)" {
		t.Fatalf("phaseText = %q", got)
	}
	if got := phaseText([]StageTime{{Total: ms(1)}}); got != "" {
		t.Fatalf("phaseText without phases = %q, want empty", got)
	}
}

// TestPrintMeshPipelined: a mesh whose node 1 pipelined is marked, with a
// footnote; one that did not is not; more micro-batches than stages
// (serve --micro-batches) show their count.
func TestPrintMeshPipelined(t *testing.T) {
	var b strings.Builder
	PrintMesh(&b, []MeshRow{
		{Network: "loopback", Stages: 1, Streams: 8, DecodeTPS: 100, Ratio: 1, Lanes: 1},
		{Network: "loopback", Stages: 2, Streams: 8, DecodeTPS: 113, Ratio: 1.13, Lanes: 2},
	})
	out := b.String()
	if !strings.Contains(out, "loopback           2*") || !strings.Contains(out, "(*: pipelined") {
		t.Errorf("the pipelined mesh is not marked:\n%s", out)
	}
	if strings.Contains(out, "1*") {
		t.Errorf("the 1-stage mesh is marked:\n%s", out)
	}
	if strings.Contains(out, "*N") {
		t.Errorf("a micro-batch per stage is footnoted as --micro-batches:\n%s", out)
	}
	b.Reset()
	PrintMesh(&b, []MeshRow{{Network: "loopback", Stages: 2, Streams: 8, DecodeTPS: 90, Lanes: 1}})
	if strings.Contains(b.String(), "*") {
		t.Errorf("an unpipelined table has a mark:\n%s", b.String())
	}
	b.Reset()
	PrintMesh(&b, []MeshRow{{Network: "loopback", Stages: 2, Streams: 32, DecodeTPS: 90, Lanes: 4}})
	if out := b.String(); !strings.Contains(out, "loopback          2*4") || !strings.Contains(out, "(*N: pipelined, N micro-batches") || strings.Contains(out, "(*: pipelined, a micro-batch") {
		t.Errorf("four micro-batches through two stages are not marked:\n%s", out)
	}
}
