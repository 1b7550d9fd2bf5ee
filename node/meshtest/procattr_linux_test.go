package meshtest

import (
	"os/exec"
	"syscall"
)

// detachable sets what a node process needs beyond defaults: on Linux, a
// node dies with the test binary (SIGKILL when its parent exits), so that a
// crashed or interrupted run leaves no node behind.
func detachable(cmd *exec.Cmd) {
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
}
