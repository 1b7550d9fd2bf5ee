//go:build !linux

package main

import "os/exec"

// startDying starts cmd; elsewhere than Linux t.Cleanup alone ends it.
func startDying(cmd *exec.Cmd) error { return cmd.Start() }
