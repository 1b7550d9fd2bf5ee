//go:build repack && cgo

// Decode streams every weight from memory once per token. With 4 KiB pages
// that is a TLB miss every 4 KiB, and on Linux, where transparent huge
// pages are commonly "madvise" only, ggml's posix_memalign'd buffers get
// 4 KiB pages (llama.cpp's mmap of a page-cached file may get large
// folios instead).

#include <stdint.h>
#include <sys/mman.h>

#include "hugepage.h"

void meshnode_advise_huge(void * p, size_t n) {
#ifdef MADV_HUGEPAGE
	const uintptr_t huge = (uintptr_t)2 << 20;
	const uintptr_t a = ((uintptr_t)p + huge - 1) & ~(huge - 1);
	const uintptr_t e = ((uintptr_t)p + n) & ~(huge - 1);
	// Only whole huge pages inside the range: touching one byte of a huge
	// page makes all of it resident, and the rest of a shared buffer may
	// hold storage that is never written (re-homed tensors).
	if (e > a) madvise((void *)a, e - a, MADV_HUGEPAGE);
#else
	(void)p;
	(void)n;
#endif
}
