package main

import (
	"context"
	"math"
	"strings"
	"testing"
)

func TestRelativeL2(t *testing.T) {
	nan := float32(math.NaN())
	tests := []struct {
		name string
		a, b []float32
		want float64 // NaN: want NaN
	}{
		{"equal", []float32{1, -2, 3}, []float32{1, -2, 3}, 0},
		{"both zero", []float32{0, 0}, []float32{0, 0}, 0},
		{"three over four", []float32{3, 4}, []float32{0, 4}, 0.75},
		{"one tenth", []float32{1.1, 0}, []float32{1, 0}, 0.1},
		{"reference zero", []float32{1, 0}, []float32{0, 0}, math.Inf(1)},
		{"lengths differ", []float32{1}, []float32{1, 2}, math.Inf(1)},
		{"NaN in a", []float32{nan, 1}, []float32{1, 1}, math.NaN()},
		{"NaN in b", []float32{1, 1}, []float32{1, nan}, math.NaN()},
	}
	for _, tc := range tests {
		got := relativeL2(tc.a, tc.b)
		switch {
		case math.IsNaN(tc.want):
			if !math.IsNaN(got) {
				t.Errorf("%s: relativeL2 = %v, want NaN", tc.name, got)
			}
		case math.IsInf(tc.want, 1):
			if !math.IsInf(got, 1) {
				t.Errorf("%s: relativeL2 = %v, want +Inf", tc.name, got)
			}
		case math.Abs(got-tc.want) > 1e-6:
			t.Errorf("%s: relativeL2 = %v, want %v", tc.name, got, tc.want)
		}
	}
}

// TestCheckSplitCPU runs dev check-split on the CPU: the split over the
// default (f32) wire must give the whole run's greedy tokens, and bad
// flags must be refused before any model is loaded.
func TestCheckSplitCPU(t *testing.T) {
	tests := []struct {
		name    string
		args    []string
		wantErr string // "" for success
	}{
		{"f32 wire, split after layer 2", []string{"--model", testModel, "--device", "cpu", "--split", "2", "--steps", "24"}, ""},
		{"f32 wire, default split", []string{"--model", testModel, "--device", "cpu", "--steps", "16"}, ""},
		{"unknown wire", []string{"--model", testModel, "--device", "cpu", "--wire-dtype", "f8"}, "f8"},
		{"negative tolerance", []string{"--model", testModel, "--device", "cpu", "--logits-tol", "-1"}, "--logits-tol"},
		{"missing model", []string{"--model", "/nonexistent/model.gguf", "--device", "cpu"}, "model.gguf"},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			err := runCheckSplit(context.Background(), tc.args)
			switch {
			case tc.wantErr == "" && err != nil:
				t.Fatalf("check-split %v: %v", tc.args, err)
			case tc.wantErr != "" && (err == nil || !strings.Contains(err.Error(), tc.wantErr)):
				t.Fatalf("check-split %v: error %v, want one that names %q", tc.args, err, tc.wantErr)
			}
		})
	}
}
