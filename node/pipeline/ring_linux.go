package pipeline

import (
	"fmt"

	"golang.org/x/sys/unix"
)

// ringSeals keep a stream's memory as it is: a peer that could shrink it
// would fault the other's next access (SIGBUS, which kills the process).
const ringSeals = unix.F_SEAL_SHRINK | unix.F_SEAL_GROW | unix.F_SEAL_SEAL

// ringCreate returns a descriptor of ringBytes of anonymous shared memory,
// sealed at that size.
func ringCreate() (int, error) {
	fd, err := unix.MemfdCreate("meshnode-ring", unix.MFD_CLOEXEC|unix.MFD_ALLOW_SEALING)
	if err != nil {
		return -1, fmt.Errorf("ring: %w", err)
	}
	if err := unix.Ftruncate(fd, ringBytes); err != nil {
		unix.Close(fd)
		return -1, fmt.Errorf("ring: %w", err)
	}
	if _, err := unix.FcntlInt(uintptr(fd), unix.F_ADD_SEALS, ringSeals); err != nil {
		unix.Close(fd)
		return -1, fmt.Errorf("ring: sealing its memory: %w", err)
	}
	return fd, nil
}

// checkSeals says whether the memory behind fd cannot shrink.
func checkSeals(fd int) error {
	seals, err := unix.FcntlInt(uintptr(fd), unix.F_GET_SEALS, 0)
	if err != nil {
		return fmt.Errorf("ring: the offered memory is no sealed memfd: %w", err)
	}
	if seals&unix.F_SEAL_SHRINK == 0 {
		return fmt.Errorf("ring: the offered memory could shrink under its mapping (seals %#x)", seals)
	}
	return nil
}
