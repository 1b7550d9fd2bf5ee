//go:build !linux

package node

import (
	"encoding/binary"
	"syscall"
)

func totalMemory() uint64 {
	// macOS and the BSDs answer hw.memsize / hw.physmem as a raw integer.
	for _, name := range []string{"hw.memsize", "hw.physmem"} {
		if s, err := syscall.Sysctl(name); err == nil && len(s) >= 4 {
			b := append([]byte(s), make([]byte, 8)...)
			return binary.LittleEndian.Uint64(b[:8])
		}
	}
	return 8 << 30
}
