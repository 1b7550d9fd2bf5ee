package node

import (
	"testing"

	"github.com/meshnode/meshnode/node/weights"
)

// TestSliceCost: a slice made again from the data dir after a replan
// reports the bytes its first fetch in this run read, so that status says
// what came over the network for the stage, not 0.
func TestSliceCost(t *testing.T) {
	steps := []struct {
		name string
		res  weights.FetchResult
		want uint64
	}{
		{"first fetch of [1,2)", weights.FetchResult{Path: "a-1-2", Fetched: 600}, 600},
		{"fetch of [0,2) after a replan", weights.FetchResult{Path: "a-0-2", Fetched: 1200}, 1200},
		{"[1,2) again, reused", weights.FetchResult{Path: "a-1-2", Reused: true}, 600},
		{"a slice an earlier run made", weights.FetchResult{Path: "a-2-3", Reused: true}, 0},
		{"[1,2) fetched anew, resuming an interrupted fetch", weights.FetchResult{Path: "a-1-2", Fetched: 40, Resumed: 560}, 40},
		{"and reused after that", weights.FetchResult{Path: "a-1-2", Reused: true}, 40},
	}
	m := &mesh{}
	for _, s := range steps {
		if got := m.sliceCost(s.res); got != s.want {
			t.Errorf("%s: %d bytes, want %d", s.name, got, s.want)
		}
	}
}
