package main

import (
	"bufio"
	"cmp"
	"context"
	"errors"
	"fmt"
	"io"
	"os"
	"os/exec"
	"slices"
	"strconv"
	"strings"
	"time"
)

// kernelStat is one kernel at one launch shape in a ktrace file
// (deploy/gpu/ktrace.c).
type kernelStat struct {
	name, grid string
	ns, calls  uint64
}

// kernelRun is one run of a kernel from a ktrace file's R records
// (KTRACE_RAW): its start and end on the GPU's clock, in ns, and its
// name|grid|block.
type kernelRun struct {
	start, end uint64
	key        string
}

// kernelTrace is what one or more ktrace files hold.
type kernelTrace struct {
	kernels []kernelStat
	// busy is GPU time by 100 ms of the trace, from its first kernel.
	busy map[int]uint64
	runs []kernelRun
}

// kernelKey splits a ktrace record's name|grid|block into its name and
// grid.
func kernelKey(key string) (name, grid string) {
	name, grid, _ = strings.Cut(key, "|")
	grid, _, _ = strings.Cut(grid, "|")
	return name, grid
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
			name, grid := kernelKey(f[3])
			t.kernels = append(t.kernels, kernelStat{name: name, grid: grid, ns: a, calls: b})
		case "B":
			if errA != nil || errB != nil || a > 1<<30 {
				return bad("want B <bucket> <ns> <calls>")
			}
			t.busy[int(a)] += b
		case "R":
			if errA != nil || errB != nil || b < a || !strings.Contains(f[3], "|") {
				return bad("want R <start ns> <end ns> <name>|<grid>|<block>")
			}
			t.runs = append(t.runs, kernelRun{start: a, end: b, key: f[3]})
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
the PATH. Tracing adds host time to every launch: read shares, not speed.
Where the tracer also kept each run (KTRACE_RAW=N: the first N kernels),
it splits them into steps at the GPU's idle gaps and shows the most common
step kernel by kernel: each kernel's share (its end after the end of the
one before; kernels overlap under programmatic dependent launch, so their
durations add up to more than a step), with a model's repeating layers
folded into one.`, `  KTRACE_DIR=/tmp/kt KTRACE_RAW=200000 CUDA_INJECTION64_PATH=bin/lib/libmeshnode-ktrace.so \
    meshnode bench --model /tmp/8b.gguf --device cuda --streams 1 --decode 400 --no-reference
  meshnode dev kernel-report --per 400 --top 15 /tmp/kt/k.*.txt`)
	per := fs.Float64("per", 0, "divide times by this many tokens or steps (0: totals only)")
	top := fs.Int("top", 30, "kernels to list")
	gap := fs.Duration("step-gap", 15*time.Microsecond, "with R records (KTRACE_RAW): the idle time of the GPU that ends a step")
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
	if err := writeKernelReport(os.Stdout, &t, *per, *top, demangle); err != nil {
		return err
	}
	writeStepTimeline(os.Stdout, &t, uint64(gap.Nanoseconds()), demangle)
	return nil
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

// stepShare is one place in a step: its kernel, and the medians over the
// steps of its share (its end minus the end of the kernel before it, the
// first kernel's whole run) and its duration, in ns. Kernels that overlap
// (programmatic dependent launch) start before the one before them ends,
// so their durations add up to more than a step; their shares add up to
// the step.
type stepShare struct {
	key        string
	share, dur float64
}

// stepShares splits runs into steps where the GPU stayed idle for at least
// gap ns, keeps the steps of the most common kernel sequence, and gives
// that sequence's shares, with how many steps it had and the median step
// (first start to last end).
func stepShares(runs []kernelRun, gap uint64) (steps int, step float64, shares []stepShare) {
	rs := slices.Clone(runs)
	slices.SortFunc(rs, func(a, b kernelRun) int {
		if c := cmp.Compare(a.start, b.start); c != 0 {
			return c
		}
		return strings.Compare(a.key, b.key)
	})
	var all [][]kernelRun
	var end uint64
	for i, r := range rs {
		if i == 0 || r.start > end+gap {
			all = append(all, nil)
		}
		all[len(all)-1] = append(all[len(all)-1], r)
		end = max(end, r.end)
	}
	// Each step's kernel sequence as one string, to count the steps alike.
	seqs := make([]string, len(all))
	count := map[string]int{}
	best := ""
	for i, s := range all {
		keys := make([]string, len(s))
		for j, r := range s {
			keys[j] = r.key
		}
		k := strings.Join(keys, "\n")
		seqs[i] = k
		count[k]++
		if count[k] > count[best] || (count[k] == count[best] && k < best) {
			best = k
		}
	}
	var kept [][]kernelRun
	for i, s := range all {
		if seqs[i] == best {
			kept = append(kept, s)
		}
	}
	if len(kept) == 0 {
		return 0, 0, nil
	}
	median := func(v []float64) float64 {
		slices.Sort(v)
		if len(v)%2 == 1 {
			return v[len(v)/2]
		}
		return (v[len(v)/2-1] + v[len(v)/2]) / 2
	}
	n := len(kept[0])
	shares = make([]stepShare, n)
	for p := range n {
		sh, du := make([]float64, len(kept)), make([]float64, len(kept))
		for i, s := range kept {
			prev := s[p].start
			if p > 0 {
				prev = s[p-1].end
			}
			sh[i], du[i] = float64(s[p].end)-float64(prev), float64(s[p].end-s[p].start)
		}
		shares[p] = stepShare{key: kept[0][p].key, share: median(sh), dur: median(du)}
	}
	spans := make([]float64, len(kept))
	for i, s := range kept {
		spans[i] = float64(s[len(s)-1].end - s[0].start)
	}
	return len(kept), median(spans), shares
}

// repeats finds the longest stretch of keys that repeats a period of one
// place or more at least twice (a model's layers): from, the period and
// how many times; times 0 where nothing repeats. Of equal stretches the
// shortest period wins.
func repeats(keys []string) (from, period, times int) {
	for p := 1; p <= len(keys)/2; p++ {
		for a := 0; a+2*p <= len(keys); a++ {
			k := 1
			for a+(k+1)*p <= len(keys) && slices.Equal(keys[a+(k-1)*p:a+k*p], keys[a+k*p:a+(k+1)*p]) {
				k++
			}
			if k >= 2 && k*p > times*period {
				from, period, times = a, p, k
			}
		}
	}
	return from, period, times
}

// writeStepTimeline prints the shares of the most common step in t.runs.
func writeStepTimeline(w io.Writer, t *kernelTrace, gap uint64, names func([]string) []string) {
	steps, span, shares := stepShares(t.runs, gap)
	if steps == 0 {
		return
	}
	keys := make([]string, len(shares))
	raw := make([]string, len(shares))
	for i, s := range shares {
		keys[i] = s.key
		raw[i], _ = kernelKey(s.key)
	}
	shown := names(raw)
	fmt.Fprintf(w, "\nsteps (R records, a step ending at an idle gap of %.0f µs): %d steps of %d kernels, the most common sequence; a step %.1f µs (median)\n",
		float64(gap)/1e3, steps, len(shares), span/1e3)
	fmt.Fprintf(w, "%10s %9s  %-14s %s\n", "share µs", "µs", "grid", "kernel (share: its end after the end of the one before)")
	line := func(prefix string, share, dur float64, i int) {
		_, grid := kernelKey(shares[i].key)
		fmt.Fprintf(w, "%s%10.2f %9.2f  %-14s %s\n", prefix, share/1e3, dur/1e3, grid, shown[i])
	}
	from, period, times := repeats(keys)
	for i := 0; i < len(shares); i++ {
		if times == 0 || i != from {
			line("", shares[i].share, shares[i].dur, i)
			continue
		}
		var sum float64
		for j := from; j < from+period*times; j++ {
			sum += shares[j].share
		}
		fmt.Fprintf(w, "%d× these %d (%.1f µs a time, means of the times):\n", times, period, sum/float64(times)/1e3)
		for q := range period {
			var sh, du float64
			for k := range times {
				sh += shares[from+k*period+q].share
				du += shares[from+k*period+q].dur
			}
			line("  ", sh/float64(times), du/float64(times), from+q)
		}
		i = from + period*times - 1
	}
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
	// Kernels in an unnamed namespace (fused.cu's): their names without it.
	s = strings.ReplaceAll(s, "(anonymous namespace)::", "")
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
