// Package childproc starts child processes (mesh nodes, for a benchmark or
// a test) that die with the process that started them: on Linux the
// kernel sends them SIGKILL when their parent exits without stopping
// them, by a crash, a SIGKILL or a test's timeout, so that none is left
// holding its ports and its GPU. Elsewhere they start as exec.Cmd starts
// them.
package childproc

import (
	"os/exec"
	"runtime"
)

// Child is a started process.
type Child struct {
	done chan struct{}
	err  error
}

// Start starts cmd, keeping cmd.SysProcAttr's other settings, and waits
// for it (cmd.Wait) on a goroutine of its own: call Child's Wait, not
// cmd's. That goroutine holds its thread until cmd exits, because the
// kernel sends the parent-death signal when the thread that started the
// child exits, and Go may retire a thread that no goroutine holds.
func Start(cmd *exec.Cmd) (*Child, error) {
	dieWithParent(cmd)
	c := &Child{done: make(chan struct{})}
	started := make(chan error, 1)
	go func() {
		runtime.LockOSThread()
		defer runtime.UnlockOSThread()
		if err := cmd.Start(); err != nil {
			started <- err
			return
		}
		started <- nil
		c.err = cmd.Wait()
		close(c.done)
	}()
	if err := <-started; err != nil {
		return nil, err
	}
	return c, nil
}

// Done is closed once the process has exited and been waited for.
func (c *Child) Done() <-chan struct{} { return c.done }

// Wait waits for the process to exit and returns what cmd.Wait returned.
func (c *Child) Wait() error {
	<-c.done
	return c.err
}
