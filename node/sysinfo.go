package node

import (
	"bufio"
	"fmt"
	"hash/fnv"
	"os"
	"runtime"
	"strconv"
	"strings"
	"time"
)

// availableMemory is what the OS says can be allocated without swapping:
// MemAvailable on Linux; elsewhere a conservative share of total memory.
func availableMemory() uint64 {
	if runtime.GOOS == "linux" {
		if f, err := os.Open("/proc/meminfo"); err == nil {
			defer f.Close()
			sc := bufio.NewScanner(f)
			for sc.Scan() {
				fields := strings.Fields(sc.Text())
				if len(fields) >= 2 && fields[0] == "MemAvailable:" {
					if kb, err := strconv.ParseUint(fields[1], 10, 64); err == nil {
						return kb << 10
					}
				}
			}
		}
	}
	return totalMemory() / 2
}

// measureSpeed is a quick memory-bandwidth figure in GB/s: token decoding
// is bound by how fast weights stream from memory, so this ranks nodes the
// way decode speed does, in a few tens of milliseconds.
func measureSpeed() float64 {
	const size = 64 << 20
	src := make([]byte, size)
	dst := make([]byte, size)
	for i := range src {
		src[i] = byte(i)
	}
	best := 0.0
	for range 3 {
		start := time.Now()
		copy(dst, src)
		if s := time.Since(start).Seconds(); s > 0 {
			best = max(best, 2*size/s/1e9) // read + write
		}
	}
	return best
}

// computeID names the hardware a node's layers run on, device ("cpu", or
// a GPU's library and PCI address) on this machine, without revealing the
// machine's id: nodes that report the same value share that hardware.
func computeID(device string) string {
	h := fnv.New64a()
	fmt.Fprintf(h, "%s\x00%s", machineID(), device)
	return fmt.Sprintf("%016x", h.Sum64())
}

// socketHostID names who can reach this node's local socket: processes of
// its user (the socket's directory is theirs alone) on this machine,
// within one network namespace where the OS has them (nodes in two
// namespaces, as in the network tests, talk over their network, as nodes
// of two machines do).
func socketHostID() string {
	h := fnv.New64a()
	ns, _ := os.Readlink("/proc/self/ns/net") // "net:[4026531840]"; absent off Linux
	fmt.Fprintf(h, "%s\x00%s\x00%d", machineID(), ns, os.Getuid())
	return fmt.Sprintf("%016x", h.Sum64())
}

// machineID names this machine: the OS's machine id where there is one
// (systemd, D-Bus), else the hostname. Two machines cloned from one image
// may share it; they then count as one machine, which only costs them
// pipelining.
func machineID() string {
	for _, p := range []string{"/etc/machine-id", "/var/lib/dbus/machine-id"} {
		if b, err := os.ReadFile(p); err == nil {
			if id := strings.TrimSpace(string(b)); id != "" {
				return id
			}
		}
	}
	name, _ := os.Hostname()
	return name
}
