//go:build !linux

package ggufstage

// probeBuffer returns n bytes of fresh memory for the bandwidth probe.
func probeBuffer(n int) (buf []byte, release func()) { return make([]byte, n), func() {} }
