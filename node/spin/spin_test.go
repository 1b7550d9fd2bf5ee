package spin

import (
	"testing"
	"time"
)

func TestPacerMissed(t *testing.T) {
	defer func(d time.Duration) { Interval = d }(Interval)
	t0 := time.Unix(1000, 0)
	tests := []struct {
		name     string
		interval time.Duration
		misses   []time.Duration // each empty poll's time after t0
		want     []bool          // whether each yielded
	}{
		{"first miss yields", 20 * time.Microsecond, []time.Duration{0}, []bool{true}},
		{"then not within the interval", 20 * time.Microsecond, []time.Duration{0, 1000, 19999}, []bool{true, false, false}},
		{"then once it has passed", 20 * time.Microsecond, []time.Duration{0, 20000, 20001, 40000}, []bool{true, true, false, true}},
		{"the interval counts from the last yield", 20 * time.Microsecond, []time.Duration{5000, 30000, 45000, 50000}, []bool{true, true, false, true}},
		{"a late first miss still yields", 20 * time.Microsecond, []time.Duration{time.Hour}, []bool{true}},
		{"interval 0 yields every poll", 0, []time.Duration{0, 0, 1, 2}, []bool{true, true, true, true}},
	}
	for _, tc := range tests {
		t.Run(tc.name, func(t *testing.T) {
			Interval = tc.interval
			var p Pacer
			for i, d := range tc.misses {
				if got := p.Missed(t0.Add(d)); got != tc.want[i] {
					t.Errorf("miss %d at %v: yielded %v, want %v", i, d, got, tc.want[i])
				}
			}
		})
	}
}
