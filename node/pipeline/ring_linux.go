package pipeline

import (
	"fmt"

	"golang.org/x/sys/unix"
)

// ringCreate returns a descriptor of ringBytes of anonymous shared memory.
func ringCreate() (int, error) {
	fd, err := unix.MemfdCreate("meshnode-ring", unix.MFD_CLOEXEC)
	if err != nil {
		return -1, fmt.Errorf("ring: %w", err)
	}
	if err := unix.Ftruncate(fd, ringBytes); err != nil {
		unix.Close(fd)
		return -1, fmt.Errorf("ring: %w", err)
	}
	return fd, nil
}
