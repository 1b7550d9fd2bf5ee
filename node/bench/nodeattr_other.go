//go:build !linux

package bench

import "syscall"

// nodeAttr puts a node in a process group of its own (stop signals the
// group). Only Linux can have a node die with the bench.
func nodeAttr() *syscall.SysProcAttr {
	return &syscall.SysProcAttr{Setpgid: true}
}
