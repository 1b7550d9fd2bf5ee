//go:build repack && cgo && !amd64

// No X16 kernel off amd64: ggml's own repacked kernels serve there.

#include "x16.h"

int meshnode_x16_cpu(void) { return 0; }

int meshnode_x16_register(void) { return 0; }

int meshnode_x16_ok(const struct ggml_tensor * t) {
	(void)t;
	return 0;
}

ggml_backend_buffer_t meshnode_x16_take(struct ggml_tensor * t, const void * data) {
	(void)t;
	(void)data;
	return NULL;
}

double meshnode_x16_check(int type, int k, int n, int m, int threads, unsigned seed) {
	(void)type;
	(void)k;
	(void)n;
	(void)m;
	(void)threads;
	(void)seed;
	return -1;
}
