// meshnode's Q4_0, Q8_0, Q4_K and Q6_K matmul for AVX512-VNNI CPUs
// (x16_amd64.cpp).
#ifndef MESHNODE_X16_H
#define MESHNODE_X16_H

#include "ggml.h"
#include "ggml-backend.h"

#ifdef __cplusplus
extern "C" {
#endif

// meshnode_x16_cpu reports whether this CPU has the instructions.
int meshnode_x16_cpu(void);

// meshnode_x16_register adds the kernel's buffer type to ggml's CPU backend
// (once; later calls only report). Call before any graph computes: ggml
// reads that list during every compute. Returns whether the kernel is on.
int meshnode_x16_register(void);

// meshnode_x16_ok reports whether t can be computed by the kernel: a 2-D
// Q4_0, Q8_0, Q4_K or Q6_K weight of whole 16-row tiles, on a CPU with
// AVX512-VNNI.
int meshnode_x16_ok(const struct ggml_tensor * t);

// meshnode_x16_take moves t into a new buffer of the kernel's layout,
// filled from data (t's bytes in ggml's layout), and returns that buffer,
// or NULL when t is not eligible.
ggml_backend_buffer_t meshnode_x16_take(struct ggml_tensor * t, const void * data);

// meshnode_x16_check: a self-test of the kernel against ggml's plain
// matmul (see x16_amd64.cpp); -1 when the kernel cannot run here.
double meshnode_x16_check(int type, int k, int n, int m, int threads, unsigned seed, int iters, double * secs);

#ifdef __cplusplus
}
#endif

#endif
