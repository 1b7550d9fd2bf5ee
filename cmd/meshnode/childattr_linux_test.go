package main

import (
	"os/exec"
	"runtime"
	"syscall"
)

// startDying starts cmd so that it dies with the test binary (SIGKILL when
// its parent exits), so that a crashed or timed-out run leaves no node
// behind. The kernel sends that signal when the thread that started the
// child exits, and Go may retire threads: every child is started from one
// goroutine locked to its thread for the binary's life.
func startDying(cmd *exec.Cmd) error {
	cmd.SysProcAttr = &syscall.SysProcAttr{Pdeathsig: syscall.SIGKILL}
	done := make(chan error)
	spawns <- spawn{cmd, done}
	return <-done
}

type spawn struct {
	cmd  *exec.Cmd
	done chan error
}

var spawns = func() chan spawn {
	c := make(chan spawn)
	go func() {
		runtime.LockOSThread() // never unlocked: the thread lives as long as the binary
		for s := range c {
			s.done <- s.cmd.Start()
		}
	}()
	return c
}()
