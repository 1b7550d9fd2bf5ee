package host

import (
	"fmt"
	"net"
	"os"
	"syscall"
)

// checkPeerUser refuses a local connection from another user's process:
// the socket's directory already keeps them out, this says so if it did not.
func checkPeerUser(c *net.UnixConn) error {
	raw, err := c.SyscallConn()
	if err != nil {
		return fmt.Errorf("local connection: %w", err)
	}
	var cred *syscall.Ucred
	var cerr error
	if err := raw.Control(func(fd uintptr) {
		cred, cerr = syscall.GetsockoptUcred(int(fd), syscall.SOL_SOCKET, syscall.SO_PEERCRED)
	}); err != nil {
		return fmt.Errorf("local connection: %w", err)
	}
	if cerr != nil {
		return fmt.Errorf("local connection: reading the peer's credentials: %w", cerr)
	}
	if int(cred.Uid) != os.Getuid() {
		return fmt.Errorf("local connection from process %d of user %d, not this node's user", cred.Pid, cred.Uid)
	}
	return nil
}
