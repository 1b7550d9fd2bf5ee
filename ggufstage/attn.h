// meshnode's CPU attention kernel (attn_amd64.cpp).
#ifndef MESHNODE_ATTN_H
#define MESHNODE_ATTN_H

#ifdef __cplusplus
namespace ggml { namespace cpu { class tensor_traits; } }
struct ggml_tensor;
// meshnode_attn_traits returns the kernel for a FLASH_ATTN_EXT op it can
// compute, else NULL (ggml's own kernel then runs).
ggml::cpu::tensor_traits * meshnode_attn_traits(const ggml_tensor * op);
extern "C" {
#endif

// meshnode_attn_enable turns the kernel on (1) or off (0); tests compare.
void meshnode_attn_enable(int on);
// Self-tests (see attn_amd64.cpp).
double meshnode_attn_check(int DK, int n_q, int H, int H_kv, int n_kv, int threads, unsigned seed, int ggml);
int meshnode_attn_moved(int DK, int H, int H_kv, int n, unsigned seed, int ggml, int shuffle);

#ifdef __cplusplus
}
#endif

#endif
