package node

import (
	"bufio"
	"os"
	"runtime"
	"strconv"
	"strings"
	"time"
)

// availableMemory is what the OS says can be allocated without swapping:
// MemAvailable on Linux; elsewhere a conservative share of total memory.
func availableMemory() uint64 {
	if runtime.GOOS == "linux" {
		if f, err := os.Open("/proc/meminfo"); err == nil {
			defer f.Close()
			sc := bufio.NewScanner(f)
			for sc.Scan() {
				fields := strings.Fields(sc.Text())
				if len(fields) >= 2 && fields[0] == "MemAvailable:" {
					if kb, err := strconv.ParseUint(fields[1], 10, 64); err == nil {
						return kb << 10
					}
				}
			}
		}
	}
	return totalMemory() / 2
}

// measureSpeed is a quick memory-bandwidth figure in GB/s: token decoding
// is bound by how fast weights stream from memory, so this ranks nodes the
// way decode speed does, in a few tens of milliseconds.
func measureSpeed() float64 {
	const size = 64 << 20
	src := make([]byte, size)
	dst := make([]byte, size)
	for i := range src {
		src[i] = byte(i)
	}
	best := 0.0
	for range 3 {
		start := time.Now()
		copy(dst, src)
		if s := time.Since(start).Seconds(); s > 0 {
			best = max(best, 2*size/s/1e9) // read + write
		}
	}
	return best
}
