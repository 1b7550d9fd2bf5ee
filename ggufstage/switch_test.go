package ggufstage

import "testing"

// TestSwitch is the rule Auto follows: on for a stage on a GPU, off on
// the CPU; On and Off are what they say.
func TestSwitch(t *testing.T) {
	tests := []struct {
		f        Switch
		gpu, cpu bool
	}{
		{Auto, true, false},
		{On, true, true},
		{Off, false, false},
	}
	for _, tc := range tests {
		if got := tc.f.on(true); got != tc.gpu {
			t.Errorf("%v on a GPU: %v, want %v", tc.f, got, tc.gpu)
		}
		if got := tc.f.on(false); got != tc.cpu {
			t.Errorf("%v on the CPU: %v, want %v", tc.f, got, tc.cpu)
		}
		if p, err := ParseSwitch(tc.f.String()); err != nil || p != tc.f {
			t.Errorf("ParseSwitch(%q) = %v, %v", tc.f.String(), p, err)
		}
	}
}
