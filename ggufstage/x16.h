// meshnode's Q4_0 matmul for AVX512-VNNI CPUs (q4x16_amd64.cpp).
#ifndef MESHNODE_Q4X16_H
#define MESHNODE_Q4X16_H

#include "ggml.h"
#include "ggml-backend.h"

#ifdef __cplusplus
extern "C" {
#endif

// meshnode_q4x16_ok reports whether t can be computed by the kernel: a 2-D
// Q4_0 weight of whole 16-row tiles, on a CPU with AVX512-VNNI.
int meshnode_q4x16_ok(const struct ggml_tensor * t);

// meshnode_q4x16_take moves t into a new buffer of the kernel's layout,
// filled from data (t's plain Q4_0 bytes), and returns that buffer, or NULL
// when t is not eligible.
ggml_backend_buffer_t meshnode_q4x16_take(struct ggml_tensor * t, const void * data);

// meshnode_q4x16_check: a self-test of the kernel against ggml's plain
// Q4_0 matmul (see q4x16_amd64.cpp); -1 when the kernel cannot run here.
double meshnode_q4x16_check(int k, int n, int m, int threads, unsigned seed);

#ifdef __cplusplus
}
#endif

#endif
