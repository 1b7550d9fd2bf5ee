//go:build repack && cgo && !amd64

// No Q4X16 kernel off amd64: ggml's own repacked kernels serve there.

#include "q4x16.h"

int meshnode_q4x16_ok(const struct ggml_tensor * t) { (void)t; return 0; }

ggml_backend_buffer_t meshnode_q4x16_take(struct ggml_tensor * t, const void * data) {
	(void)t;
	(void)data;
	return NULL;
}

double meshnode_q4x16_check(int k, int n, int m, int threads, unsigned seed) {
	(void)k;
	(void)n;
	(void)m;
	(void)threads;
	(void)seed;
	return -1;
}
