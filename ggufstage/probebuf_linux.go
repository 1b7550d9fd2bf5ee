package ggufstage

import "syscall"

// probeBuffer returns n bytes of fresh memory for the bandwidth probe,
// backed by transparent huge pages where the system allows, as the
// engine's weights are (hugepage.c): with 4 KiB pages the probe measured
// less than decode then read. release unmaps it.
func probeBuffer(n int) (buf []byte, release func()) {
	b, err := syscall.Mmap(-1, 0, n, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
	if err != nil {
		return make([]byte, n), func() {}
	}
	_ = syscall.Madvise(b, syscall.MADV_HUGEPAGE) // advice only: 4 KiB pages still work
	return b, func() { _ = syscall.Munmap(b) }
}
