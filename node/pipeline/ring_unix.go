//go:build unix && !linux

package pipeline

import (
	"fmt"
	"os"
	"syscall"
)

// ringCreate returns a descriptor of ringBytes of shared memory: a file
// removed as soon as it is open, which lives as long as its mappings.
func ringCreate() (int, error) {
	f, err := os.CreateTemp("", "meshnode-ring-*")
	if err != nil {
		return -1, fmt.Errorf("ring: %w", err)
	}
	defer f.Close()
	os.Remove(f.Name())
	if err := f.Truncate(ringBytes); err != nil {
		return -1, fmt.Errorf("ring: %w", err)
	}
	fd, err := syscall.Dup(int(f.Fd()))
	if err != nil {
		return -1, fmt.Errorf("ring: %w", err)
	}
	syscall.CloseOnExec(fd)
	return fd, nil
}
