//go:build repack && cgo && linux

package ggufstage

import (
	"bufio"
	"os"
	"strconv"
	"strings"
	"syscall"
	"testing"
	"unsafe"
)

// vmFlags returns the VmFlags of the mapping of this process that holds
// addr, from /proc/self/smaps.
func vmFlags(t *testing.T, addr uintptr) []string {
	t.Helper()
	f, err := os.Open("/proc/self/smaps")
	if err != nil {
		t.Skipf("no smaps: %v", err)
	}
	defer f.Close()
	in := false
	sc := bufio.NewScanner(f)
	for sc.Scan() {
		line := sc.Text()
		fields := strings.Fields(line)
		if len(fields) > 0 && strings.Contains(fields[0], "-") && !strings.HasSuffix(fields[0], ":") {
			lo, hi, _ := strings.Cut(fields[0], "-")
			a, err1 := strconv.ParseUint(lo, 16, 64)
			b, err2 := strconv.ParseUint(hi, 16, 64)
			in = err1 == nil && err2 == nil && uint64(addr) >= a && uint64(addr) < b
			continue
		}
		if in && strings.HasPrefix(line, "VmFlags:") {
			return fields[1:]
		}
	}
	t.Fatalf("no mapping holds %#x", addr)
	return nil
}

// TestAdviseHuge: the weights' huge-page advice covers exactly the whole
// 2 MiB pages inside a range, so that writing a weight never makes
// resident the unwritten storage around it (see hugepage.c).
func TestAdviseHuge(t *testing.T) {
	if b, err := os.ReadFile("/sys/kernel/mm/transparent_hugepage/enabled"); err != nil || strings.Contains(string(b), "[never]") {
		t.Skip("transparent huge pages are off on this system")
	}
	const huge = 2 << 20
	mem, err := syscall.Mmap(-1, 0, 5*huge, syscall.PROT_READ|syscall.PROT_WRITE, syscall.MAP_ANON|syscall.MAP_PRIVATE)
	if err != nil {
		t.Fatal(err)
	}
	defer syscall.Munmap(mem)
	base := uintptr(unsafe.Pointer(&mem[0]))
	// A range that starts just past a huge-page boundary and ends just
	// before another: only the pages between are advised.
	first := (base+huge)&^(huge-1) + 1
	adviseHuge(unsafe.Pointer(&mem[first-base]), 3*huge-2)
	has := func(addr uintptr) bool {
		for _, f := range vmFlags(t, addr) {
			if f == "hg" {
				return true
			}
		}
		return false
	}
	lo := first - 1 + huge // the first whole page inside
	tests := []struct {
		addr uintptr
		want bool
	}{
		{first, false},        // a partial page at the start
		{lo, true},            // whole pages
		{lo + huge - 1, true}, //
		{lo + huge, false},    // a partial page at the end
	}
	for _, tt := range tests {
		if got := has(tt.addr); got != tt.want {
			t.Errorf("huge-page advice at base+%#x: %v, want %v", tt.addr-base, got, tt.want)
		}
	}
}
