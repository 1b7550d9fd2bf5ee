package main

import (
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
		{"void k_bin_bcast<&(anonymous namespace)::op_add, float>(float const*)", "k_bin_bcast<&(anonymous namespace)::op_add, float>"},
		{"_Z3fooi", "_Z3fooi"}, // not demangled: as it is
	}
	for _, tt := range tests {
		if got := shortSignature(tt.in); got != tt.want {
			t.Errorf("shortSignature(%q) = %q, want %q", tt.in, got, tt.want)
		}
	}
}
