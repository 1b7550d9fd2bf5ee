package bench

import "syscall"

// nodeAttr puts a node in a process group of its own (stop signals the
// group) and, on Linux, has the kernel kill it when the bench dies without
// stopping it (SIGKILL, a crash, a test's timeout), so that no node is left
// holding its ports and the GPU.
func nodeAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true, Pdeathsig: syscall.SIGKILL}
}
