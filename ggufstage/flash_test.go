package ggufstage

import "testing"

// TestFlashAttentionOn is the rule FlashAuto follows: on for a stage on a
// GPU, off on the CPU; on and off are what they say.
func TestFlashAttentionOn(t *testing.T) {
	tests := []struct {
		f        FlashAttention
		gpu, cpu bool
	}{
		{FlashAuto, true, false},
		{FlashOn, true, true},
		{FlashOff, false, false},
	}
	for _, tc := range tests {
		if got := tc.f.on(true); got != tc.gpu {
			t.Errorf("%v on a GPU: %v, want %v", tc.f, got, tc.gpu)
		}
		if got := tc.f.on(false); got != tc.cpu {
			t.Errorf("%v on the CPU: %v, want %v", tc.f, got, tc.cpu)
		}
		if p, err := ParseFlashAttention(tc.f.String()); err != nil || p != tc.f {
			t.Errorf("ParseFlashAttention(%q) = %v, %v", tc.f.String(), p, err)
		}
	}
}
