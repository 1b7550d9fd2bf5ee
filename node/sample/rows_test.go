package sample

import (
	"slices"
	"sync"
	"sync/atomic"
	"testing"
)

func TestRows(t *testing.T) {
	tests := []struct {
		name   string
		keys   []int
		vocab  int
		serial bool // must run one row at a time, in order
	}{
		{"no rows", nil, 1 << 17, true},
		{"one row", []int{7}, 1 << 17, true},
		{"small work stays serial", []int{1, 2, 3}, 512, true},
		{"repeated key stays serial", []int{1, 2, 1, 3}, 1 << 17, true},
		{"many large rows", []int{5, 4, 3, 2, 1, 0, 9, 8, 7}, 1 << 17, false},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			var (
				mu            sync.Mutex
				order         []int
				active, worst atomic.Int32
			)
			Rows(tc.keys, tc.vocab, func(i int) {
				a := active.Add(1)
				defer active.Add(-1)
				for w := worst.Load(); a > w && !worst.CompareAndSwap(w, a); w = worst.Load() {
				}
				mu.Lock()
				order = append(order, i)
				mu.Unlock()
			})
			sorted := slices.Sorted(slices.Values(order))
			want := make([]int, len(tc.keys))
			for i := range want {
				want[i] = i
			}
			if !slices.Equal(sorted, want) {
				t.Fatalf("rows called %v, want each of %v once", order, want)
			}
			if tc.serial && (worst.Load() > 1 || !slices.Equal(order, want)) {
				t.Fatalf("rows ran %v with %d at once, want one at a time in order", order, worst.Load())
			}
		})
	}
}
