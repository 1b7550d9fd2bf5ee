//go:build !linux

package childproc

import "os/exec"

// dieWithParent: only Linux has a parent-death signal.
func dieWithParent(*exec.Cmd) {}
