package node

import (
	"cmp"
	"os"
	"path/filepath"
	"strings"

	"github.com/meshnode/meshnode/node/pipeline"
)

// sharingGPU lists the peers of route, other than self, whose stages run
// on the GPU that self's stage runs on: compute is each hop's hardware
// (membership.Meta.Compute, "" where unknown), backend self's ("cpu",
// "cuda", "metal"). Cores of one CPU are no GPU to share.
func sharingGPU(self, backend string, route []pipeline.Hop, compute []string) []string {
	if backend == "" || backend == "cpu" {
		return nil
	}
	mine := ""
	for i, h := range route {
		if h.Peer == self {
			mine = compute[i]
		}
	}
	if mine == "" {
		return nil
	}
	var peers []string
	for i, h := range route {
		if h.Peer != self && compute[i] == mine {
			peers = append(peers, h.Peer)
		}
	}
	return peers
}

// mpsPipeDir is where NVIDIA's MPS control daemon keeps its pipes: as
// CUDA's clients look for it, CUDA_MPS_PIPE_DIRECTORY, else /tmp/nvidia-mps.
func mpsPipeDir() string {
	return cmp.Or(os.Getenv("CUDA_MPS_PIPE_DIRECTORY"), "/tmp/nvidia-mps")
}

// mpsRunning says whether NVIDIA's MPS control daemon looks up: its
// control pipe is there. (A daemon killed without `quit` may leave it
// behind; then this says yes and no hint is given.)
func mpsRunning() bool {
	_, err := os.Stat(filepath.Join(mpsPipeDir(), "control"))
	return err == nil
}

// gpuShareHint is what to tell the user of a node whose CUDA stage shares
// its GPU with the stages of peers, or "" when there is nothing to say:
// without MPS, the processes' kernels take turns on the GPU instead of
// running side by side, which costs every split step the turns (see the
// README's NVIDIA section).
func gpuShareHint(backend string, peers []string, mps bool) string {
	if backend != "cuda" || len(peers) == 0 || mps {
		return ""
	}
	short := make([]string, len(peers))
	for i, p := range peers {
		short[i] = "…" + shortID(p)
	}
	return "this node's stage shares its GPU with the stage of " + strings.Join(short, ", ") +
		", and NVIDIA's MPS daemon is not running (no " + filepath.Join(mpsPipeDir(), "control") +
		"): the processes take turns on the GPU, which slows every token. Start it before the nodes, as the user that runs them " +
		"(nvidia-cuda-mps-control -d), or run one node per GPU"
}

// deviceHandoff says whether this node's stages hand hidden states over on
// a GPU they share with the next stage (serve --gpu-handoff): only under
// MPS. Without it the processes take turns on the GPU, and a stage whose
// previous stage died in the middle of a hand-off waits on that stage's
// event for good (deploy/gpu/ipc.cu, run 307: its stream, and then a new
// one, never ended); under MPS that death leaves the other process's GPU
// context unusable with or without a hand-off (run 308: a process killed
// in the middle of its own kernel faults every other client of the GPU).
func (m *mesh) deviceHandoff() bool {
	return m.cfg.GPUHandoff && mpsRunning()
}
