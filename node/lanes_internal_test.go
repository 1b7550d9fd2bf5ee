package node

import "testing"

// TestOwnHardware: --pipelining auto pipelines only a route whose stages
// each run on hardware no other stage uses.
func TestOwnHardware(t *testing.T) {
	tests := []struct {
		name    string
		compute []string
		want    bool
	}{
		{"two machines", []string{"a", "b"}, true},
		{"three GPUs", []string{"a", "b", "c"}, true},
		{"one machine's cores", []string{"a", "a"}, false},
		{"two of three share", []string{"a", "b", "a"}, false},
		{"a node that does not say", []string{"a", ""}, false},
	}
	for _, tt := range tests {
		if got := ownHardware(tt.compute); got != tt.want {
			t.Errorf("%s: ownHardware(%q) = %v, want %v", tt.name, tt.compute, got, tt.want)
		}
	}
}

// TestPipelinedLanes: --micro-batches where set, else one per stage.
func TestPipelinedLanes(t *testing.T) {
	tests := []struct {
		stages, microBatches, want int
	}{
		{2, 0, 2},
		{3, 0, 3},
		{2, 4, 4},
		{3, 1, 1},
		{2, -1, 2},
		{0, 0, 1},
	}
	for _, tt := range tests {
		if got := pipelinedLanes(tt.stages, tt.microBatches); got != tt.want {
			t.Errorf("pipelinedLanes(%d stages, --micro-batches %d) = %d, want %d", tt.stages, tt.microBatches, got, tt.want)
		}
	}
}

// TestComputeID: processes on one machine name the same device alike,
// and tell its CPU and two GPUs apart.
func TestComputeID(t *testing.T) {
	cpu, gpu0, gpu1 := computeID("cpu"), computeID("cuda:0000:19:00.0"), computeID("cuda:0000:3b:00.0")
	if cpu != computeID("cpu") {
		t.Errorf("the CPU is %s, then %s", cpu, computeID("cpu"))
	}
	if cpu == gpu0 || gpu0 == gpu1 || cpu == gpu1 {
		t.Errorf("cpu %s, GPUs %s and %s: want three names", cpu, gpu0, gpu1)
	}
}

// TestMicroBatchesFlag: serve refuses a negative --micro-batches.
func TestMicroBatchesFlag(t *testing.T) {
	tests := []struct {
		n    int
		fail bool
	}{{-1, true}, {0, false}, {4, false}}
	for _, tt := range tests {
		err := Config{MicroBatches: tt.n, HTTPAddr: "127.0.0.1:0"}.validate()
		if (err != nil) != tt.fail {
			t.Errorf("--micro-batches %d: err %v, want failure %v", tt.n, err, tt.fail)
		}
	}
}
