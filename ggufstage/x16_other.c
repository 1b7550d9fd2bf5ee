//go:build repack && cgo && !amd64

// No X16 kernel off amd64: ggml's own repacked kernels serve there.

#include "x16.h"
#include "attn.h"

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

double meshnode_x16_check(int type, int k, int n, int m, int threads, unsigned seed, int iters, double * secs) {
	(void)iters;
	(void)secs;
	(void)type;
	(void)k;
	(void)n;
	(void)m;
	(void)threads;
	(void)seed;
	return -1;
}

void meshnode_attn_enable(int on) { (void)on; }

double meshnode_attn_check(int DK, int n_q, int H, int H_kv, int n_kv, int threads, unsigned seed, int ggml) {
	(void)DK;
	(void)n_q;
	(void)H;
	(void)H_kv;
	(void)n_kv;
	(void)threads;
	(void)seed;
	(void)ggml;
	return -1;
}

int meshnode_attn_moved(int DK, int H, int H_kv, int n, unsigned seed, int ggml, int shuffle) {
	(void)shuffle;
	(void)DK;
	(void)H;
	(void)H_kv;
	(void)n;
	(void)seed;
	(void)ggml;
	return -1;
}
