package main

import (
	"fmt"
	"strings"
	"testing"
)

// A ktrace file as deploy/gpu/ktrace.c writes it: two shapes of one
// kernel, another kernel, and 300 ms of buckets.
const sampleKernelTrace = `K 3000000 100 _Z13mul_mat_vec_qILi2ELi1EEvPKv|4096,1,1|32,4
K 1000000 400 _Z12quantize_q8_1PKfPv|16,1,1|256,1
K 6000000 200 _Z13mul_mat_vec_qILi2ELi1EEvPKv|14336,1,1|32,4
B 0 50000000 300
B 1 30000000 200
B 2 20000000 200
`

func TestKernelReport(t *testing.T) {
	var tr kernelTrace
	if err := readKernelTrace(strings.NewReader(sampleKernelTrace), &tr); err != nil {
		t.Fatal(err)
	}
	share, secs := tr.busyShare()
	if secs != 0.3 || share < 0.333 || share > 0.334 {
		t.Errorf("busy %.3f over %.1f s, want 0.333 over 0.3 s", share, secs)
	}
	var b strings.Builder
	identity := func(s []string) []string { return s }
	if err := writeKernelReport(&b, &tr, 100, 2, identity); err != nil {
		t.Fatal(err)
	}
	out := b.String()
	for _, want := range []string{
		"10.0 ms of GPU time in 700 kernels over 0.3 s of trace: busy 33%",
		"per one of 100: 100.0 µs in 7.0 kernels",
		// largest first, at most --top, with µs per call and per token
		"6.0  60.0%       200     30.00      60.0  14336,1,1      _Z13mul_mat_vec_qILi2ELi1EEvPKv",
		"3.0  30.0%       100     30.00      30.0  4096,1,1",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("report lacks %q:\n%s", want, out)
		}
	}
	if strings.Contains(out, "quantize") {
		t.Errorf("the third kernel is listed with --top 2:\n%s", out)
	}
}

func TestKernelTraceMalformed(t *testing.T) {
	for _, in := range []string{
		"K 10 notanumber name|1,1,1|1,1\n",
		"K 10 0 name|1,1,1|1,1\n", // no calls
		"B 1 2\n",
		"X 1 2 3\n",
		"R 10 5 name|1,1,1|1,1\n", // ends before it starts
		"R 10 20 name\n",          // no grid
		"B 99999999999 1 1\n",
	} {
		var tr kernelTrace
		if err := readKernelTrace(strings.NewReader(in), &tr); err == nil {
			t.Errorf("%q: no error", in)
		}
	}
	var empty kernelTrace
	if err := writeKernelReport(&strings.Builder{}, &empty, 0, 10, nil); err == nil || !strings.Contains(err.Error(), "CUDA_INJECTION64_PATH") {
		t.Errorf("an empty trace: %v, want a hint about loading the tracer", err)
	}
}

func TestShortSignature(t *testing.T) {
	tests := []struct{ in, want string }{
		{"void mul_mat_vec_q<(ggml_type)2, 1, true>(void const*, int)", "mul_mat_vec_q<(ggml_type)2, 1, true>"},
		{"quantize_q8_1(float const*, void*, long)", "quantize_q8_1"},
		{"void k_bin_bcast<&(anonymous namespace)::op_add, float>(float const*)", "k_bin_bcast<&op_add, float>"},
		{"_Z3fooi", "_Z3fooi"}, // not demangled: as it is
		{"void (anonymous namespace)::gemv<2, 256, 16>((anonymous namespace)::GemvArgs)", "gemv<2, 256, 16>"},
		{"(anonymous namespace)::embed(unsigned char const*, int)", "embed"},
	}
	for _, tt := range tests {
		if got := shortSignature(tt.in); got != tt.want {
			t.Errorf("shortSignature(%q) = %q, want %q", tt.in, got, tt.want)
		}
	}
}

// A step as the fused decode graph runs it: an embedding, three layers of
// two kernels where each starts before the one before ends (PDL), and a
// head; three such steps apart by idle gaps, and one shorter step.
func sampleSteps() string {
	var b strings.Builder
	at := uint64(1_000_000)
	for step := range 4 {
		fmt.Fprintf(&b, "R %d %d embed|16,1,1|256,1\n", at, at+1000)
		end := at + 1000
		layers := 3
		if step == 3 {
			layers = 1
		}
		for range layers {
			// mat-vec: starts 500 ns before the end before it, ends 7000 later
			fmt.Fprintf(&b, "R %d %d gemv|264,1,1|256,1\n", end-500, end+7000)
			end += 7000
			fmt.Fprintf(&b, "R %d %d attention|32,8,1|256,1\n", end-300, end+2000+uint64(step)*100)
			end += 2000 + uint64(step)*100
		}
		fmt.Fprintf(&b, "R %d %d head|132,1,1|512,1\n", end-200, end+100000)
		at = end + 100000 + 50000 // idle 50 µs
	}
	return b.String()
}

func TestKernelStepTimeline(t *testing.T) {
	var tr kernelTrace
	if err := readKernelTrace(strings.NewReader(sampleKernelTrace+sampleSteps()), &tr); err != nil {
		t.Fatal(err)
	}
	steps, span, shares := stepShares(tr.runs, 15000)
	if steps != 3 || len(shares) != 8 {
		t.Fatalf("%d steps of %d kernels, want the three of 8 (the short one left out)", steps, len(shares))
	}
	// The median step: 1000 + 3*(7000+2100) + 100000 ns.
	if span != 128300 {
		t.Errorf("step %.0f ns, want 128300", span)
	}
	tests := []struct {
		at         int
		key        string
		share, dur float64
	}{
		{0, "embed|16,1,1|256,1", 1000, 1000},
		{1, "gemv|264,1,1|256,1", 7000, 7500},
		{2, "attention|32,8,1|256,1", 2100, 2400}, // medians of 2000, 2100, 2200
		{7, "head|132,1,1|512,1", 100000, 100200},
	}
	for _, tt := range tests {
		if s := shares[tt.at]; s.key != tt.key || s.share != tt.share || s.dur != tt.dur {
			t.Errorf("place %d: %+v, want %s share %.0f dur %.0f", tt.at, s, tt.key, tt.share, tt.dur)
		}
	}
	var b strings.Builder
	identity := func(s []string) []string { return s }
	writeStepTimeline(&b, &tr, 15000, identity)
	out := b.String()
	for _, want := range []string{
		"3 steps of 8 kernels",
		"a step 128.3 µs",
		"3× these 2 (9.1 µs a time",
		"        7.00      7.50  264,1,1        gemv",
		"    100.00    100.20  132,1,1        head",
	} {
		if !strings.Contains(out, want) {
			t.Errorf("timeline lacks %q:\n%s", want, out)
		}
	}
	if strings.Count(out, "gemv") != 1 {
		t.Errorf("the layers are not folded into one:\n%s", out)
	}
}

func TestRepeats(t *testing.T) {
	tests := []struct {
		keys                string
		from, period, times int
	}{
		{"e a b a b a b h", 1, 2, 3},
		{"e a a a h", 1, 1, 3},
		{"e a b c h", 0, 0, 0},
		{"a b a b", 0, 2, 2},
		{"", 0, 0, 0},
	}
	for _, tt := range tests {
		from, period, times := repeats(strings.Fields(tt.keys))
		if from != tt.from || period != tt.period || times != tt.times {
			t.Errorf("repeats(%q) = %d, %d, %d; want %d, %d, %d", tt.keys, from, period, times, tt.from, tt.period, tt.times)
		}
	}
}
