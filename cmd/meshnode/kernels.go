package main

import (
	"bufio"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
)

// kernelStat is one kernel at one launch shape in a ktrace file
// (deploy/gpu/ktrace.c).
type kernelStat struct {
	name, grid string
	ns, calls  uint64
}

// kernelTrace is what one or more ktrace files hold.
type kernelTrace struct {
	kernels []kernelStat
	// busy is GPU time by 100 ms of the trace, from its first kernel.
	busy map[int]uint64
}

// readKernelTrace parses a ktrace file into t, adding to what t holds.
func readKernelTrace(r io.Reader, t *kernelTrace) error {
	if t.busy == nil {
		t.busy = map[int]uint64{}
	}
	sc := bufio.NewScanner(r)
	sc.Buffer(make([]byte, 64<<10), 1<<20)
	for line := 1; sc.Scan(); line++ {
		f := strings.SplitN(sc.Text(), " ", 4)
		bad := func(what string) error { return fmt.Errorf("line %d: %s: %q", line, what, sc.Text()) }
		if len(f) < 4 {
			return bad("want 4 fields")
		}
		a, errA := strconv.ParseUint(f[1], 10, 64)
		b, errB := strconv.ParseUint(f[2], 10, 64)
		switch f[0] {
		case "K":
			if errA != nil || errB != nil || b == 0 {
				return bad("want K <ns> <calls> <name>")
			}
			name, grid, _ := strings.Cut(f[3], "|")
			grid, _, _ = strings.Cut(grid, "|")
			t.kernels = append(t.kernels, kernelStat{name: name, grid: grid, ns: a, calls: b})
		case "B":
			if errA != nil || errB != nil || a > 1<<30 {
				return bad("want B <bucket> <ns> <calls>")
			}
			t.busy[int(a)] += b
		default:
			return bad("unknown record")
		}
	}
	return sc.Err()
}

// busyShare is the GPU's busy share from the first to the last 100 ms in
// which a kernel started (more than one GPU's files add up past 1).
func (t *kernelTrace) busyShare() (share float64, seconds float64) {
	if len(t.busy) == 0 {
		return 0, 0
	}
	lo, hi := int(^uint(0)>>1), -1
	var ns uint64
	for b, v := range t.busy {
		lo, hi = min(lo, b), max(hi, b)
		ns += v
	}
	seconds = float64(hi-lo+1) / 10
	return float64(ns) / 1e9 / seconds, seconds
}

func runKernelReport(_ context.Context, args []string) error {
	fs := newFlags("dev kernel-report [flags] FILE...", `Sums what deploy/gpu/ktrace.c recorded (CUDA_INJECTION64_PATH naming
libmeshnode-ktrace.so, KTRACE_DIR a folder; one k.<pid>.txt per process):
GPU time per kernel and launch grid, largest first, and how busy the GPU
was. With --per N every time is also divided by N (the tokens or steps the
traced run made). Kernel names are demangled with c++filt when it is on
the PATH. Tracing adds host time to every launch: read shares, not speed.`, `  KTRACE_DIR=/tmp/kt CUDA_INJECTION64_PATH=bin/lib/libmeshnode-ktrace.so \
    meshnode bench --model /tmp/8b.gguf --device cuda --streams 1 --decode 400 --no-reference
  meshnode dev kernel-report --per 400 --top 15 /tmp/kt/k.*.txt`)
	per := fs.Float64("per", 0, "divide times by this many tokens or steps (0: totals only)")
	top := fs.Int("top", 30, "kernels to list")
	// The files may come before, between or after the flags, all of which
	// take a value.
	var files, flags []string
	for i := 0; i < len(args); i++ {
		a := args[i]
		switch {
		case !strings.HasPrefix(a, "-"):
			files = append(files, a)
		case strings.Contains(a, "=") || a == "-h" || a == "-help" || a == "--help" || i+1 == len(args):
			flags = append(flags, a)
		default:
			flags = append(flags, a, args[i+1])
			i++
		}
	}
	if err := parse(fs, flags); err != nil {
		return err
	}
	if len(files) == 0 {
		fs.Usage()
		return errUsage
	}
	var t kernelTrace
	for _, path := range files {
		f, err := os.Open(path)
		if err != nil {
			return err
		}
		err = readKernelTrace(f, &t)
		f.Close()
		if err != nil {
			return fmt.Errorf("%s: %w", path, err)
		}
	}
	return writeKernelReport(os.Stdout, &t, *per, *top, demangle)
}

// writeKernelReport prints t, its names through names.
func writeKernelReport(w io.Writer, t *kernelTrace, per float64, top int, names func([]string) []string) error {
	if len(t.kernels) == 0 {
		return errors.New("no kernels recorded: did CUDA load the tracer (CUDA_INJECTION64_PATH), and did the process run long enough (0.5 s) to write?")
	}
	ks := slices.Clone(t.kernels)
	slices.SortFunc(ks, func(a, b kernelStat) int {
		if a.ns != b.ns {
			if a.ns > b.ns {
				return -1
			}
			return 1
		}
		return strings.Compare(a.name+a.grid, b.name+b.grid)
	})
	var total, calls uint64
	for _, k := range ks {
		total += k.ns
		calls += k.calls
	}
	share, secs := t.busyShare()
	fmt.Fprintf(w, "%.1f ms of GPU time in %d kernels over %.1f s of trace: busy %.0f%%\n", float64(total)/1e6, calls, secs, 100*share)
	if per > 0 {
		fmt.Fprintf(w, "per one of %g: %.1f µs in %.1f kernels\n", per, float64(total)/1e3/per, float64(calls)/per)
	}
	ks = ks[:min(top, len(ks))]
	raw := make([]string, len(ks))
	for i, k := range ks {
		raw[i] = k.name
	}
	shown := names(raw)
	head := fmt.Sprintf("%10s %6s %9s %9s", "ms", "share", "calls", "µs/call")
	if per > 0 {
		head += fmt.Sprintf(" %9s", "µs/one")
	}
	fmt.Fprintf(w, "%s  %-14s %s\n", head, "grid", "kernel")
	for i, k := range ks {
		line := fmt.Sprintf("%10.1f %5.1f%% %9d %9.2f", float64(k.ns)/1e6, 100*float64(k.ns)/float64(total), k.calls, float64(k.ns)/1e3/float64(k.calls))
		if per > 0 {
			line += fmt.Sprintf(" %9.1f", float64(k.ns)/1e3/per)
		}
		fmt.Fprintf(w, "%s  %-14s %s\n", line, k.grid, shown[i])
	}
	return nil
}

// demangle turns C++ symbols into names through c++filt, dropping the
// parameter lists; without c++filt the symbols stay as they are.
func demangle(syms []string) []string {
	out := slices.Clone(syms)
	path, err := exec.LookPath("c++filt")
	if err != nil {
		return out
	}
	cmd := exec.Command(path)
	cmd.Stdin = strings.NewReader(strings.Join(syms, "\n") + "\n")
	b, err := cmd.Output()
	if err != nil {
		return out
	}
	lines := strings.Split(strings.TrimSuffix(string(b), "\n"), "\n")
	if len(lines) != len(syms) {
		return out
	}
	for i, l := range lines {
		out[i] = shortSignature(l)
	}
	return out
}

// shortSignature drops a demangled function's parameter list and return
// type: "void f<int, 2>(float const*, int)" is "f<int, 2>".
func shortSignature(s string) string {
	depth := 0
	for i, r := range s {
		switch r {
		case '<':
			depth++
		case '>':
			depth--
		case '(':
			if depth == 0 && i > 0 {
				s = s[:i]
				if sp := strings.LastIndexByte(strings.SplitN(s, "<", 2)[0], ' '); sp >= 0 {
					s = s[sp+1:]
				}
				return s
			}
		}
	}
	return s
}
