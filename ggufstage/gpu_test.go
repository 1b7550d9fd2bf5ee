package ggufstage

import (
	"os"
	"slices"
	"testing"

	"github.com/meshnode/meshnode/stage"
)

// TestGPUSplitEquivalence runs stories260K whole and split on a GPU when
// one is there (OLLAMA_LIBRARY_PATH pointing at a backend built by
// deploy/gpu/build-cuda.sh): the split gives the same greedy tokens. CI
// machines have no GPU, so there it says so and skips.
func TestGPUSplitEquivalence(t *testing.T) {
	devs, err := Devices(storiesPath)
	if err != nil {
		t.Fatal(err)
	}
	if len(devs) == 0 {
		t.Skipf("no GPU backend loaded (OLLAMA_LIBRARY_PATH=%q): build one with deploy/gpu/build-cuda.sh on a machine with a GPU", os.Getenv("OLLAMA_LIBRARY_PATH"))
	}
	opts := Options{Threads: 1, MaxSeqs: 2, Context: 256, Device: "auto"}
	gen := func(p *pipeline) []int32 {
		p.open(t, 1)
		var out []int32
		b := stageBatchAt(0, 1)
		for i := range 32 {
			next := argmax(p.forward(t, b))
			out = append(out, next)
			b = stageBatchAt(int32(i+1), next)
		}
		return out
	}
	whole := openSplit(t, storiesPath, []int{0, 5}, opts)
	if whole.stages[0].Info().Backend == "CPU" {
		t.Fatalf("a GPU was found (%s) but the stage runs on the CPU", devs[0].Library)
	}
	want := gen(whole)
	whole.close()
	split := openSplit(t, storiesPath, []int{0, 2, 5}, opts)
	got := gen(split)
	split.close()
	if !slices.Equal(got, want) {
		t.Fatalf("GPU split tokens differ:\n got %v\nwant %v", got, want)
	}
}

func stageBatchAt(pos, tok int32) stage.Batch {
	return stage.Batch{Seqs: []stage.SeqID{1}, Pos: []int32{pos}, Tokens: []int32{tok}, Outputs: []int{0}}
}
