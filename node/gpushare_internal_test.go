package node

import (
	"os"
	"path/filepath"
	"slices"
	"strings"
	"testing"

	"github.com/meshnode/meshnode/node/pipeline"
)

// TestSharingGPU: the peers whose stages run on this node's GPU, and
// none for a CPU or for hardware a peer does not name.
func TestSharingGPU(t *testing.T) {
	route := func(peers ...string) []pipeline.Hop {
		var r []pipeline.Hop
		for i, p := range peers {
			r = append(r, pipeline.Hop{Peer: p, Start: i, End: i + 1})
		}
		return r
	}
	tests := []struct {
		name    string
		backend string
		route   []pipeline.Hop
		compute []string
		want    []string
	}{
		{"two nodes on one GPU", "cuda", route("me", "peerB"), []string{"g0", "g0"}, []string{"peerB"}},
		{"this node last", "cuda", route("peerA", "me"), []string{"g0", "g0"}, []string{"peerA"}},
		{"a GPU each", "cuda", route("me", "peerB"), []string{"g0", "g1"}, nil},
		{"two of three share, not this one", "cuda", route("me", "peerB", "peerC"), []string{"g0", "g1", "g1"}, nil},
		{"three on one GPU", "cuda", route("peerA", "me", "peerC"), []string{"g0", "g0", "g0"}, []string{"peerA", "peerC"}},
		{"one machine's cores", "cpu", route("me", "peerB"), []string{"c", "c"}, nil},
		{"this node's hardware unknown", "cuda", route("me", "peerB"), []string{"", ""}, nil},
		{"not in the route", "cuda", route("peerA", "peerB"), []string{"g0", "g0"}, nil},
		{"metal", "metal", route("me", "peerB"), []string{"m", "m"}, []string{"peerB"}},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			if got := sharingGPU("me", tt.backend, tt.route, tt.compute); !slices.Equal(got, tt.want) {
				t.Errorf("sharingGPU = %v, want %v", got, tt.want)
			}
		})
	}
}

// TestGPUShareHint: a hint only for CUDA stages that share a GPU while
// MPS is down, naming the peers and how to start MPS.
func TestGPUShareHint(t *testing.T) {
	tests := []struct {
		name    string
		backend string
		peers   []string
		mps     bool
		want    bool
	}{
		{"shared, no MPS", "cuda", []string{"12D3KooWabcdef"}, false, true},
		{"shared, MPS up", "cuda", []string{"12D3KooWabcdef"}, true, false},
		{"alone on the GPU", "cuda", nil, false, false},
		{"Metal shares without MPS", "metal", []string{"12D3KooWabcdef"}, false, false},
	}
	for _, tt := range tests {
		t.Run(tt.name, func(t *testing.T) {
			got := gpuShareHint(tt.backend, tt.peers, tt.mps)
			if (got != "") != tt.want {
				t.Fatalf("hint %q, want one: %v", got, tt.want)
			}
			if tt.want && (!strings.Contains(got, "…abcdef") || !strings.Contains(got, "nvidia-cuda-mps-control -d")) {
				t.Errorf("hint %q names neither the peer nor how to start MPS", got)
			}
		})
	}
}

// TestMPSRunning looks for the control pipe where CUDA's clients do.
func TestMPSRunning(t *testing.T) {
	dir := t.TempDir()
	t.Setenv("CUDA_MPS_PIPE_DIRECTORY", dir)
	if mpsRunning() {
		t.Fatal("MPS running with no control pipe")
	}
	if err := os.WriteFile(filepath.Join(dir, "control"), nil, 0o600); err != nil {
		t.Fatal(err)
	}
	if !mpsRunning() {
		t.Fatal("MPS not running with a control pipe")
	}
	if h := gpuShareHint("cuda", []string{"p"}, false); !strings.Contains(h, filepath.Join(dir, "control")) {
		t.Errorf("hint %q does not say where it looked", h)
	}
}

func TestDeviceHandoff(t *testing.T) {
	tests := []struct {
		name      string
		flag, mps bool
		want      bool
	}{
		{name: "on, under MPS", flag: true, mps: true, want: true},
		{name: "on, no MPS", flag: true},
		{name: "off, under MPS", mps: true},
		{name: "off"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			dir := t.TempDir()
			t.Setenv("CUDA_MPS_PIPE_DIRECTORY", dir)
			if tc.mps {
				if err := os.WriteFile(filepath.Join(dir, "control"), nil, 0o600); err != nil {
					t.Fatal(err)
				}
			}
			m := &mesh{cfg: Config{GPUHandoff: tc.flag}}
			if got := m.deviceHandoff(); got != tc.want {
				t.Errorf("deviceHandoff() = %v, want %v", got, tc.want)
			}
		})
	}
}
