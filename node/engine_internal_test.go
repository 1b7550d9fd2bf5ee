package node

import (
	"errors"
	"slices"
	"strings"
	"testing"

	"go.uber.org/zap"

	"github.com/meshnode/meshnode/mlxstage"
	"github.com/meshnode/meshnode/node/membership"
	"github.com/meshnode/meshnode/node/planner"
	"github.com/meshnode/meshnode/stage"
)

// TestEngineRouting: which members the planner gives a model's layers to,
// by the engines they announce, as reconcile asks it.
func TestEngineRouting(t *testing.T) {
	member := func(id string, engine string, engines ...string) membership.Member {
		return membership.Member{Complete: true, Meta: membership.Meta{
			PeerID: id, Engine: engine, Engines: engines, MemFree: 1 << 30, Speed: 1, State: membership.NodeReady,
		}}
	}
	mac := member("mac", "mlx", "ggml", "mlx")
	linux := member("linux", "ggml", "ggml")
	old := member("old", "ggml") // predates Engines: ggml alone
	bare := member("bare", "")   // announces nothing: ggml
	partial := member("partial", "ggml", "ggml", "mlx")
	partial.Complete = false // only the summary known: its engines are not

	cases := []struct {
		name    string
		engine  string // the model's ModelRef.Engine
		members []membership.Member
		split   bool
		want    []string // nodes with layers, pipeline order
		wantErr []string // substrings of the error, when no plan
	}{
		{name: "safetensors goes to the mlx node only", engine: "mlx", members: []membership.Member{mac, linux, old, bare}, split: true, want: []string{"mac"}},
		{name: "gguf splits over every node", engine: "ggml", members: []membership.Member{mac, linux, old, bare}, split: true, want: []string{"bare", "linux", "mac", "old"}},
		{name: "a ref without engine is a gguf", engine: "", members: []membership.Member{mac, linux}, split: true, want: []string{"linux", "mac"}},
		{name: "gguf fits one node", engine: "ggml", members: []membership.Member{mac, linux}, want: []string{"linux"}},
		{name: "incomplete metadata is not planned", engine: "mlx", members: []membership.Member{partial, mac}, split: true, want: []string{"mac"}},
		{name: "no node runs mlx", engine: "mlx", members: []membership.Member{linux, old, bare},
			wantErr: []string{"no node of the mesh can run the mlx engine that tiny needs", "Apple Silicon", "serve a GGUF", "3 nodes, 0 not ready, 3 on another engine"}},
		{name: "the mlx node is draining", engine: "mlx", members: []membership.Member{func() membership.Member {
			m := mac
			m.Meta.State = membership.NodeDraining
			return m
		}(), linux},
			wantErr: []string{"2 nodes, 1 not ready, 1 on another engine"}},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			mm := &meshModel{
				ref:  membership.ModelRef{ID: "m", Name: "tiny", Engine: c.engine, Split: c.split, Context: 16, Parallel: 1},
				info: modelInfo{Arch: "llama", Layers: 8, perLayer: slices.Repeat([]uint64{1 << 20}, 8), embed: 1 << 20, head: 1 << 20, kv: 64},
			}
			var members []membership.Member
			for _, m := range c.members {
				if m.Meta.PeerID == "mac" || m.Meta.PeerID == "linux" {
					m.Meta.Models = []membership.ModelRef{mm.ref} // split comes from a holder's ref
				}
				members = append(members, m)
			}
			nodes, split := plannerNodes(mm.ref, members)
			if split != c.split {
				t.Errorf("split = %v, want %v", split, c.split)
			}
			plan, err := planner.Place(planModel(mm), nodes, planner.Options{Split: split, Headroom: 0.05})
			if err != nil {
				err = explainPlanErr(err, mm.ref, nodes)
			}
			if c.wantErr != nil {
				if !errors.Is(err, planner.ErrNoNodes) {
					t.Fatalf("err = %v, want planner.ErrNoNodes", err)
				}
				for _, s := range c.wantErr {
					if !strings.Contains(err.Error(), s) {
						t.Errorf("error %q does not say %q", err, s)
					}
				}
				return
			}
			if err != nil {
				t.Fatal(err)
			}
			var got []string
			for _, s := range plan.Stages {
				got = append(got, s.Node)
			}
			if !slices.Equal(got, c.want) {
				t.Errorf("layers went to %v, want %v", got, c.want)
			}
		})
	}
}

// TestEnginesAdvertised: what a node says it can run, and the engine it
// announces once it knows the model.
func TestEnginesAdvertised(t *testing.T) {
	mlxHere := mlxstage.Check() == nil
	cases := []struct {
		name        string
		cfg         Config
		model       string // engine of the model set
		wantDevice  string
		wantEngines []string
		wantEngine  string // Meta.Engine / Backend once the model is set
	}{
		{name: "plain node, gguf", cfg: Config{}, model: "ggml", wantDevice: "", wantEngines: []string{"ggml"}, wantEngine: "ggml/cpu"},
		{name: "plain node, safetensors", cfg: Config{}, model: "mlx", wantDevice: "", wantEngines: []string{"ggml"}, wantEngine: "ggml/cpu"},
		{name: "test hook, gguf", cfg: EmulateMLX(Config{}), model: "ggml", wantDevice: "emulated", wantEngines: []string{"ggml", "mlx"}, wantEngine: "ggml/cpu"},
		{name: "test hook, safetensors", cfg: EmulateMLX(Config{}), model: "mlx", wantDevice: "emulated", wantEngines: []string{"ggml", "mlx"}, wantEngine: "mlx/emulated"},
	}
	for _, c := range cases {
		t.Run(c.name, func(t *testing.T) {
			if mlxHere && c.cfg.mlxBackend == nil {
				t.Skip("MLX runs here: a plain node offers it")
			}
			m := &mesh{cfg: c.cfg, log: zap.NewNop(), meta: membership.Meta{Engine: "ggml", Backend: "cpu"}}
			m.mlxDevice = c.cfg.mlxDevice()
			if m.mlxDevice != c.wantDevice {
				t.Errorf("mlxDevice = %q, want %q", m.mlxDevice, c.wantDevice)
			}
			m.meta.Engines = m.engines()
			if !slices.Equal(m.meta.Engines, c.wantEngines) {
				t.Errorf("engines = %v, want %v", m.meta.Engines, c.wantEngines)
			}
			m.setModel(&meshModel{ref: membership.ModelRef{ID: "m", Name: "tiny", Engine: c.model}})
			if got := m.meta.Engine + "/" + m.meta.Backend; got != c.wantEngine {
				t.Errorf("announces %s, want %s", got, c.wantEngine)
			}
			if len(m.meta.Models) != 1 || m.meta.Models[0].NeedsEngine() != c.model {
				t.Errorf("announces models %+v", m.meta.Models)
			}
		})
	}
}

// fusingEngine is an engine that reports a fused decode path.
type fusingEngine struct {
	stage.Engine // nil: only Info and Fused are called
	on           bool
	why          string
}

func (f fusingEngine) Info() stage.Info {
	return stage.Info{Start: 0, End: 2, Layers: 4, Context: 8, MaxSeqs: 1}
}
func (f fusingEngine) WeightBytes() uint64          { return 0 }
func (f fusingEngine) Fused() (on bool, why string) { return f.on, f.why }

// TestStageStatsDecodePath: a stage's stats say whether it decodes through
// fused kernels, and why not where it could have; an engine with no such
// choice says nothing.
func TestStageStatsDecodePath(t *testing.T) {
	tests := []struct {
		name      string
		e         stage.Engine
		path, why string
	}{
		{"fused", fusingEngine{on: true}, "fused", ""},
		{"refused", fusingEngine{why: "a tied output head"}, "ggml", "a tied output head"},
		{"not asked (a CPU)", fusingEngine{}, "", ""},
		{"no choice", plainEngine{}, "", ""},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			s := (&observer{}).wrapEngine(tc.e, stage.Memory{}).stats()
			if s.DecodePath != tc.path || s.DecodeWhy != tc.why {
				t.Errorf("decode path %q (%q), want %q (%q)", s.DecodePath, s.DecodeWhy, tc.path, tc.why)
			}
		})
	}
}

// plainEngine has no fused path to report.
type plainEngine struct{ stage.Engine }

func (plainEngine) Info() stage.Info    { return stage.Info{Start: 0, End: 2, Layers: 4} }
func (plainEngine) WeightBytes() uint64 { return 0 }
