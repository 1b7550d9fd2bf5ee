package childproc

import (
	"bufio"
	"fmt"
	"os"
	"os/exec"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"time"
)

// TestChildDiesWithParent: a child that Start started dies when the
// process that started it is killed without stopping it. The test binary
// runs itself as that process, which starts a long sleep as its child (in
// a process group of its own, as the mesh bench starts its nodes), prints
// the child's pid and waits to be killed.
func TestChildDiesWithParent(t *testing.T) {
	if os.Getenv("MESHNODE_CHILDPROC_TEST_PARENT") == "1" {
		cmd := exec.Command("sleep", "300")
		cmd.SysProcAttr = &syscall.SysProcAttr{Setpgid: true}
		c, err := Start(cmd)
		if err != nil {
			fmt.Println("error", err)
			os.Exit(1)
		}
		fmt.Println("node", cmd.Process.Pid)
		c.Wait() // until killed
		os.Exit(0)
	}
	if _, err := exec.LookPath("sleep"); err != nil {
		t.Skip("no sleep(1) to stand in for a node")
	}
	parent := exec.Command(os.Args[0], "-test.run=^TestChildDiesWithParent$")
	parent.Env = append(os.Environ(), "MESHNODE_CHILDPROC_TEST_PARENT=1")
	out, err := parent.StdoutPipe()
	if err != nil {
		t.Fatal(err)
	}
	if err := parent.Start(); err != nil {
		t.Fatal(err)
	}
	defer parent.Process.Kill()
	line, err := bufio.NewReader(out).ReadString('\n')
	if err != nil {
		t.Fatalf("reading the node's pid: %v", err)
	}
	f := strings.Fields(line)
	if len(f) != 2 || f[0] != "node" {
		t.Fatalf("the parent said %q", line)
	}
	pid, err := strconv.Atoi(f[1])
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(func() { syscall.Kill(pid, syscall.SIGKILL) })
	if !alive(pid) {
		t.Fatalf("node %d is not running before its parent is killed", pid)
	}
	if err := parent.Process.Kill(); err != nil {
		t.Fatal(err)
	}
	parent.Wait()
	deadline := time.Now().Add(10 * time.Second)
	for alive(pid) {
		if time.Now().After(deadline) {
			t.Fatalf("node %d still runs 10 s after the process that started it was killed", pid)
		}
		time.Sleep(20 * time.Millisecond)
	}
}

// alive says whether pid runs: it exists and is no zombie (a killed
// orphan waits for whoever adopts it to reap it).
func alive(pid int) bool {
	if syscall.Kill(pid, 0) != nil {
		return false
	}
	stat, err := os.ReadFile(fmt.Sprintf("/proc/%d/stat", pid))
	if err != nil {
		return false
	}
	// pid (comm) state ...: comm may hold spaces, so the state follows the last ')'.
	s := string(stat)
	i := strings.LastIndexByte(s, ')')
	return i < 0 || i+2 >= len(s) || s[i+2] != 'Z'
}
