package ggufstage

import "testing"

// TestGraphHint follows a stage's passes and the batch size each reports
// to ggml: 1 (a CUDA graph may be captured and replayed) only for a
// single row, or for a decode pass of the same sequences as the pass
// before; never a capture request on every pass of alternating batches.
func TestGraphHint(t *testing.T) {
	tests := []struct {
		name   string
		passes [][]int // each pass's cache slots in row order
		want   []int
	}{
		{"one sequence decoding", [][]int{{3}, {3}, {3}}, []int{1, 1, 1}},
		{"steady batch of three", [][]int{{0, 1, 2}, {0, 1, 2}, {0, 1, 2}}, []int{3, 1, 1}},
		{"prefill chunk then decode", [][]int{{0, 0, 0, 0}, {0}, {0}}, []int{4, 1, 1}},
		{"a sequence joins", [][]int{{0, 1}, {0, 1}, {0, 1, 2}, {0, 1, 2}}, []int{2, 1, 3, 1}},
		{"mixed prefill and decode", [][]int{{0, 1}, {0, 1, 2, 2, 2}, {0, 1, 2}}, []int{2, 5, 3}},
		{"two lanes alternate", [][]int{{0, 1}, {2, 3}, {0, 1}, {2, 3}, {0, 1}}, []int{2, 2, 2, 2, 2}},
		{"same slots, other order", [][]int{{0, 1}, {1, 0}}, []int{2, 2}},
		{"prefill between decodes breaks the run", [][]int{{0, 1}, {0, 1}, {2, 2}, {0, 1}}, []int{2, 1, 2, 2}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var e Engine
			for i, slots := range tc.passes {
				if got := e.graphHint(slots); got != tc.want[i] {
					t.Fatalf("pass %d (slots %v): hint %d, want %d", i, slots, got, tc.want[i])
				}
			}
		})
	}
}
