package node

import (
	"testing"
	"time"
)

// TestBusyPollWindow: auto busy-polls on GPU nodes only; an explicit
// window or off applies wherever the layers run.
func TestBusyPollWindow(t *testing.T) {
	tests := []struct {
		configured time.Duration
		gpu        bool
		want       time.Duration
	}{
		{BusyPollAuto, true, DefaultBusyPoll},
		{BusyPollAuto, false, 0},
		{0, true, 0},
		{0, false, 0},
		{5 * time.Millisecond, false, 5 * time.Millisecond},
		{5 * time.Millisecond, true, 5 * time.Millisecond},
		{-time.Second, true, 0},
	}
	for _, tc := range tests {
		if got := busyPollWindow(tc.configured, tc.gpu); got != tc.want {
			t.Errorf("busyPollWindow(%v, gpu %v) = %v, want %v", tc.configured, tc.gpu, got, tc.want)
		}
	}
}
