package stagetest

import (
	"math"
	"testing"
)

// TestArgmax: the first of equal maxima, +Inf above MaxFloat32, NaN never
// winning after index 0.
func TestArgmax(t *testing.T) {
	inf, nan := float32(math.Inf(1)), float32(math.NaN())
	tests := []struct {
		name string
		x    []float32
		want int32
	}{
		{"one", []float32{-3}, 0},
		{"last", []float32{1, 2, 3}, 2},
		{"first of ties", []float32{1, 5, 2, 5}, 1},
		{"+Inf over MaxFloat32", []float32{math.MaxFloat32, inf, math.MaxFloat32}, 1},
		{"NaN after the maximum", []float32{1, 4, nan, 2}, 1},
		{"NaN first", []float32{nan, 7, 9}, 0},
		{"all -Inf", []float32{float32(math.Inf(-1)), float32(math.Inf(-1))}, 0},
	}
	for _, tt := range tests {
		if got := Argmax(tt.x); got != tt.want {
			t.Errorf("%s: Argmax(%v) = %d, want %d", tt.name, tt.x, got, tt.want)
		}
	}
}
