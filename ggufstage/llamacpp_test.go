package ggufstage

import (
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"testing"

	"github.com/meshnode/meshnode/ggufstage/synth"
)

// llamaCppGreedy runs llama.cpp's own engine (deploy/llamacpp, built from
// the pinned module's sources: no code of ours in its forward pass) and
// returns the n tokens greedy decoding picks after token 1.
func llamaCppGreedy(t *testing.T, ref, model string, n int) []int32 {
	t.Helper()
	out, err := exec.Command(ref, "greedy", model, "1", strconv.Itoa(n), "1").Output()
	if err != nil {
		var stderr string
		if ee, ok := err.(*exec.ExitError); ok {
			stderr = string(ee.Stderr)
		}
		t.Fatalf("llamacpp-ref on %s: %v: %s", model, err, stderr)
	}
	var toks []int32
	for _, f := range strings.Fields(string(out)) {
		v, err := strconv.Atoi(f)
		if err != nil {
			t.Fatalf("llamacpp-ref printed %q", out)
		}
		toks = append(toks, int32(v))
	}
	if len(toks) != n {
		t.Fatalf("llamacpp-ref gave %d tokens, want %d", len(toks), n)
	}
	return toks
}

// TestGreedyMatchesLlamaCpp: meshnode's engine, whole and split in two,
// decodes the same 32 greedy tokens as llama.cpp's own engine, on the
// trained stories260K model and on a tiny model of every architecture.
// `make test` builds llamacpp-ref and names it in MESHNODE_LLAMACPP_REF.
func TestGreedyMatchesLlamaCpp(t *testing.T) {
	ref := os.Getenv("MESHNODE_LLAMACPP_REF")
	if ref == "" {
		t.Skip("MESHNODE_LLAMACPP_REF is not set: 'make llamacpp-ref' builds llama.cpp's engine (make test does)")
	}
	type model struct {
		name, path string
		layers     int
	}
	models := []model{{"stories260K", storiesPath, 5}}
	for _, arch := range Architectures {
		models = append(models, model{arch, writeTiny(t, arch, synth.F32), 3})
	}
	for _, m := range models {
		t.Run(m.name, func(t *testing.T) {
			want := llamaCppGreedy(t, ref, m.path, 32)
			if distinct := len(slices.Compact(slices.Sorted(slices.Values(want)))); distinct < 4 {
				t.Fatalf("llama.cpp's greedy run has only %d distinct tokens: %v", distinct, want)
			}
			for _, bounds := range [][]int{{0, m.layers}, {0, 1, m.layers}} {
				p := openSplit(t, m.path, bounds, tinyOpts)
				got := greedy(t, p, 32)
				p.close()
				if !slices.Equal(got, want) {
					t.Errorf("stages %v: greedy tokens differ from llama.cpp's:\n got %v\nwant %v", bounds, got, want)
				}
			}
		})
	}
}
