package ggufstage

/*
#include <stddef.h>
#include <stdint.h>

// meshnode_read sums n bytes (a multiple of 512) as 64-bit words in eight
// independent lanes, so that the compiler vectorizes it and the loop runs
// at the speed of memory, not of a dependency chain.
static uint64_t meshnode_read(const uint64_t * p, size_t n) {
	uint64_t a[8] = {0};
	for (size_t i = 0; i < n / 8; i += 8) {
		for (int j = 0; j < 8; j++) a[j] ^= p[i + j];
	}
	return a[0] ^ a[1] ^ a[2] ^ a[3] ^ a[4] ^ a[5] ^ a[6] ^ a[7];
}
*/
import "C"

import (
	"runtime"
	"sync"
	"time"
	"unsafe"
)

// ReadBandwidth measures how fast threads CPU threads can read memory, in
// bytes per second: the best of three passes over a buffer of size bytes
// (make it several times the last-level cache). CPU decode reads every
// weight once per step, so this bounds its speed: a reference measured on
// the same machine in the same run.
func ReadBandwidth(threads int, size int) float64 {
	if threads <= 0 {
		threads = runtime.NumCPU()
	}
	per := size / threads / 512 * 512
	if per == 0 {
		return 0
	}
	mem, release := probeBuffer(per * threads)
	defer release()
	buf := unsafe.Slice((*uint64)(unsafe.Pointer(&mem[0])), len(mem)/8)
	for i := range buf {
		buf[i] = uint64(i) // touch every page before timing
	}
	var sink uint64
	best := time.Duration(1 << 62)
	for range 3 {
		var wg sync.WaitGroup
		sums := make([]uint64, threads)
		start := time.Now()
		for t := range threads {
			wg.Add(1)
			go func() {
				defer wg.Done()
				p := unsafe.Pointer(&buf[t*per/8])
				sums[t] = uint64(C.meshnode_read((*C.uint64_t)(p), C.size_t(per)))
			}()
		}
		wg.Wait()
		best = min(best, time.Since(start))
		for _, s := range sums {
			sink ^= s
		}
	}
	runtime.KeepAlive(sink)
	return float64(per*threads) / best.Seconds()
}
