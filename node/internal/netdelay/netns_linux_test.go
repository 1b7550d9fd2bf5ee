package netdelay

import (
	"bytes"
	"context"
	"errors"
	"fmt"
	"net"
	"os"
	"os/exec"
	"runtime"
	"strings"
	"testing"
	"time"

	"golang.org/x/sys/unix"
)

// This test's network, apart from the mesh tests' (10.77.0, 10.79.0) and
// the benchmark's (10.77.1).
const (
	tnPrefix = "mnd-"
	tnNet    = "10.78.9"
	tnPort   = 4001
)

func tnNS(i int) string   { return fmt.Sprintf("%snode%d", tnPrefix, i) }
func tnAddr(i int) string { return fmt.Sprintf("%s.%d", tnNet, 10+i) }
func tnLink(i int) string { return fmt.Sprintf("%sv%d", tnPrefix, i) }

const tnBridge = tnPrefix + "br0"

func ipCmd(args ...string) error {
	out, err := exec.Command("ip", args...).CombinedOutput()
	if err != nil {
		return fmt.Errorf("ip %s: %w: %s", strings.Join(args, " "), err, bytes.TrimSpace(out))
	}
	return nil
}

// tnDown deletes what tnUp made; what is not there is skipped.
func tnDown(n int) {
	for i := 1; i <= n; i++ {
		if exec.Command("ip", "netns", "pids", tnNS(i)).Run() == nil {
			_ = ipCmd("netns", "del", tnNS(i))
		}
		if exec.Command("ip", "link", "show", tnLink(i)).Run() == nil {
			_ = ipCmd("link", "del", tnLink(i))
		}
	}
	if exec.Command("ip", "link", "show", tnBridge).Run() == nil {
		_ = ipCmd("link", "del", tnBridge)
	}
}

// tnUp makes n namespaces on a bridge (address <net>.1), node i at
// <net>.(10+i), taken down when the test ends.
func tnUp(t *testing.T, n int) {
	t.Helper()
	tnDown(n)
	t.Cleanup(func() {
		tnDown(n)
		if out, _ := exec.Command("ip", "netns", "list").Output(); strings.Contains(string(out), tnPrefix) {
			t.Errorf("namespaces left behind: %s", out)
		}
	})
	steps := [][]string{
		{"link", "add", tnBridge, "type", "bridge"},
		{"addr", "add", tnNet + ".1/24", "dev", tnBridge},
		{"link", "set", tnBridge, "up"},
	}
	for i := 1; i <= n; i++ {
		steps = append(steps,
			[]string{"netns", "add", tnNS(i)},
			[]string{"link", "add", tnLink(i), "type", "veth", "peer", "name", tnLink(i) + "n"},
			[]string{"link", "set", tnLink(i) + "n", "netns", tnNS(i)},
			[]string{"link", "set", tnLink(i), "master", tnBridge, "up"},
			[]string{"-n", tnNS(i), "link", "set", "lo", "up"},
			[]string{"-n", tnNS(i), "addr", "add", tnAddr(i) + "/24", "dev", tnLink(i) + "n"},
			[]string{"-n", tnNS(i), "link", "set", tnLink(i) + "n", "up"},
		)
	}
	for _, s := range steps {
		if err := ipCmd(s...); err != nil {
			t.Fatalf("building the network: %v", err)
		}
	}
}

// inNetns runs fn on a thread in namespace ns: a socket fn opens stays in
// ns. Should the thread fail to come back, it stays locked and dies with
// the goroutine.
func inNetns(ns string, fn func() error) error {
	runtime.LockOSThread()
	self, err := os.Open("/proc/thread-self/ns/net")
	if err != nil {
		runtime.UnlockOSThread()
		return err
	}
	defer self.Close()
	target, err := os.Open("/var/run/netns/" + ns)
	if err != nil {
		runtime.UnlockOSThread()
		return err
	}
	defer target.Close()
	if err := setns(target); err != nil {
		runtime.UnlockOSThread()
		return fmt.Errorf("entering %s: %w", ns, err)
	}
	ferr := fn()
	if err := setns(self); err != nil {
		return errors.Join(ferr, fmt.Errorf("leaving %s: %w", ns, err))
	}
	runtime.UnlockOSThread()
	return ferr
}

func setns(f *os.File) error {
	return unix.Setns(int(f.Fd()), unix.CLONE_NEWNET)
}

// needNetns skips a test that creates network namespaces unless it runs as
// root and has the tools.
func needNetns(t *testing.T, tools ...string) {
	t.Helper()
	if os.Geteuid() != 0 {
		t.Skip("needs root to create network namespaces")
	}
	for _, tool := range tools {
		if _, err := exec.LookPath(tool); err != nil {
			t.Skipf("needs %s: %v", tool, err)
		}
	}
}

// TestMeshDelaysBetweenNamespaces builds three namespaces with delay
// relays and checks, for connections each way between them, that they
// cross the relay (the server sees the bridge's address, not the
// dialer's) and that each direction takes the pair's delay.
func TestMeshDelaysBetweenNamespaces(t *testing.T) {
	needNetns(t, "ip", "nft")
	const n = 3
	tnUp(t, n)
	// Every node serves pings on the relayed port, before the relays.
	srvs := make([]*pingServer, n+1)
	for i := 1; i <= n; i++ {
		err := inNetns(tnNS(i), func() error {
			ln, err := net.Listen("tcp", fmt.Sprintf("%s:%d", tnAddr(i), tnPort))
			if err != nil {
				return err
			}
			srvs[i] = startPingServer(t, ln)
			return nil
		})
		if err != nil {
			t.Fatal(err)
		}
	}
	ctx, cancel := context.WithTimeout(context.Background(), 30*time.Second)
	defer cancel()
	var nss, addrs []string
	for i := 1; i <= n; i++ {
		nss, addrs = append(nss, tnNS(i)), append(addrs, tnAddr(i))
	}
	m, err := Start(ctx, Config{Namespaces: nss, Addrs: addrs, Port: tnPort, Gateway: tnNet + ".1", BasePort: 42000,
		Delay: 40 * time.Millisecond})
	if err != nil {
		t.Fatal(err)
	}
	t.Cleanup(m.Close)
	m.Set(2, 3, 0)

	for _, tc := range []struct {
		from, to int
		delay    time.Duration
	}{
		{1, 2, 40 * time.Millisecond},
		{2, 1, 40 * time.Millisecond},
		{1, 3, 40 * time.Millisecond},
		{3, 2, 0},
		{2, 3, 0},
	} {
		t.Run(fmt.Sprintf("%d→%d", tc.from, tc.to), func(t *testing.T) {
			var c net.Conn
			err := inNetns(tnNS(tc.from), func() error {
				var err error
				c, err = net.DialTimeout("tcp", fmt.Sprintf("%s:%d", tnAddr(tc.to), tnPort), 5*time.Second)
				return err
			})
			if err != nil {
				t.Fatal(err)
			}
			defer c.Close()
			srv := srvs[tc.to]
			select {
			case a := <-srv.remote:
				if ip := a.(*net.TCPAddr).IP.String(); ip != tnNet+".1" {
					t.Errorf("node %d's server saw a connection from %s, want the relay's %s.1: the relay was bypassed", tc.to, ip, tnNet)
				}
			case <-time.After(5 * time.Second):
				t.Fatal("no connection reached the server")
			}
			for range 3 {
				there, back := srv.ping(t, c)
				checkDelay(t, "ping", tc.delay, there, back)
			}
		})
	}
	if st := m.Stats(); st.Conns != 5 {
		t.Errorf("the relays carried %d connections, want 5", st.Conns)
	}
}

// Netem either works or says that the kernel lacks it.
func TestNetemReportsMissingQdisc(t *testing.T) {
	needNetns(t, "ip", "tc")
	tnUp(t, 1)
	err := Netem(context.Background(), tnNS(1), tnLink(1)+"n", time.Millisecond)
	switch {
	case err == nil:
		t.Log("this kernel has netem")
		out, _ := exec.Command("ip", "netns", "exec", tnNS(1), "tc", "qdisc", "show", "dev", tnLink(1)+"n").CombinedOutput()
		if !strings.Contains(string(out), "netem") || !strings.Contains(string(out), "delay 1ms") {
			t.Errorf("no 1ms netem qdisc on the link: %s", out)
		}
	case errors.Is(err, ErrNoNetem):
		t.Logf("this kernel has no netem: %v", err)
	default:
		t.Errorf("Netem: %v, want nil or ErrNoNetem", err)
	}
}
