//go:build repack && cgo && amd64

// X16: meshnode's own CPU matmul for Q4_0 and Q8_0 weights on AVX512-VNNI.
//
// vpdpbusd multiplies unsigned by signed bytes. ggml's repacked Q4_0 kernel
// makes its signed nibbles fit by sign juggling (vpabsb, masked vpsubb) on
// every multiply; Q8_0 has no repacked x86 kernel at all. Here weights are
// stored unsigned: a Q4_0 nibble q (value q-8) as is, a Q8_0 byte w as
// w+128. Then sum(w*a) = sum(u*a) - bias*sum(a), and bias*d_a*sum(a) is
// computed once per activation block while quantizing. Sixteen weight rows
// are interleaved four bytes at a time, so one vpdpbusd with a broadcast
// activation dword does 64 multiply-adds for 16 rows.
//
// Hooked into ggml through the CPU backend's extension point for extra
// buffer types (ggml-cpu/traits.h): weights live in a buffer of type
// MESHNODE_X16, and ggml's CPU backend asks that type for the tensor traits
// that compute a MUL_MAT whose weights are in it.
//
// Layout of a [K, N] weight (N rows of K), N % 16 == 0, K % 32 == 0: for
// each tile of 16 rows and each 32-column block, the 16 rows' f16 scales
// (32 bytes), then the quants in 64-byte groups, each holding four bytes of
// every row (row r at bytes 4r..4r+3):
//   Q4_0: groups j = 0..3 hold the rows' native bytes 4j..4j+3 (low
//         nibbles: columns 4j..4j+3; high nibbles: columns 16+4j..);
//   Q8_0: groups j = 0..7 hold columns 4j..4j+3, each byte w+128.
// That is 288 (Q4_0) or 544 (Q8_0) bytes per tile and block, exactly what
// the 16 rows take in ggml's own layout.

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <cmath>
#include <vector>

#include "ggml.h"
#include "ggml-backend.h"
#include "ggml-backend-impl.h"
#include "ggml-cpu.h"
#include "ggml-cpu/traits.h" // and ggml-cpu-impl.h

#include "x16.h"
#include "attn.h"

#define MN_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c,fma")))

namespace {

constexpr int kTile = 16;  // weight rows per tile
constexpr int kBlock = 32; // columns per block (Q4_0 and Q8_0 alike)
constexpr int kRows = 8;   // activation rows per microkernel call

enum format { Q4, Q8 };

template <format F> constexpr int tile_block_bytes = F == Q4 ? 288 : 544;
template <format F> constexpr float bias = F == Q4 ? 8.0f : 128.0f;

// Activations are quantized into the work buffer: per row K int8 values,
// then per row and block two floats: the scale d and bias*d*sum(q).
struct act_layout {
	int64_t rows, k, nb;
	size_t q_bytes() const { return (size_t)rows * k; }
	size_t size() const { return q_bytes() + (size_t)rows * nb * 2 * sizeof(float) + 64; }
	int8_t * q(void * w, int64_t r) const { return (int8_t *)w + (size_t)r * k; }
	float * dm(void * w, int64_t r) const {
		uintptr_t base = ((uintptr_t)w + q_bytes() + 63) & ~(uintptr_t)63;
		return (float *)base + (size_t)r * nb * 2;
	}
};

MN_TARGET void quantize_row(const float * x, int64_t k, float bias, int8_t * q, float * dm) {
	const __m512 sign = _mm512_set1_ps(-0.0f);
	for (int64_t b = 0; b < k / kBlock; b++) {
		__m512 v0 = _mm512_loadu_ps(x + b * kBlock);
		__m512 v1 = _mm512_loadu_ps(x + b * kBlock + 16);
		__m512 amax = _mm512_max_ps(_mm512_andnot_ps(sign, v0), _mm512_andnot_ps(sign, v1));
		// As ggml quantizes for Q8_0 (scale rounded to f16, 127/max as the
		// inverse), so that results match ggml's plain Q4_0 path.
		const float m = _mm512_reduce_max_ps(amax);
		const float d = _cvtsh_ss(_cvtss_sh(m / 127.0f, 0));
		const float id = m != 0.0f ? 127.0f / m : 0.0f;
		__m512 vid = _mm512_set1_ps(id);
		__m512i i0 = _mm512_cvtps_epi32(_mm512_mul_ps(v0, vid)); // round to nearest even
		__m512i i1 = _mm512_cvtps_epi32(_mm512_mul_ps(v1, vid));
		int32_t sum = _mm512_reduce_add_epi32(_mm512_add_epi32(i0, i1));
		_mm_storeu_si128((__m128i *)(q + b * kBlock), _mm512_cvtsepi32_epi8(i0));
		_mm_storeu_si128((__m128i *)(q + b * kBlock + 16), _mm512_cvtsepi32_epi8(i1));
		dm[2 * b] = d;
		dm[2 * b + 1] = bias * d * (float)sum;
	}
}

// tile computes out[r][0..15] for NR activation rows against one weight
// tile. a: the first row's quants; stride between rows lda bytes; dm:
// the first row's scales, ldd floats apart; out[r]: row r's 16 outputs.
template <format F, int NR>
MN_TARGET void tile(int64_t nb, const uint8_t * w, const int8_t * a, int64_t lda, const float * dm, int64_t ldd, float * const * out) {
	__m512 acc[NR];
	for (int r = 0; r < NR; r++) acc[r] = _mm512_setzero_ps();
	const __m512i m4 = _mm512_set1_epi8(0x0F);
	__m512i u[8];
	for (int64_t b = 0; b < nb; b++, w += tile_block_bytes<F>) {
		const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)w));
		if constexpr (F == Q4) {
			for (int j = 0; j < 4; j++) {
				const __m512i z = _mm512_loadu_si512(w + 32 + 64 * j);
				u[j] = _mm512_and_si512(z, m4);
				u[j + 4] = _mm512_and_si512(_mm512_srli_epi16(z, 4), m4);
			}
		} else {
			for (int j = 0; j < 8; j++) u[j] = _mm512_loadu_si512(w + 32 + 64 * j);
		}
#pragma GCC unroll 8
		for (int r = 0; r < NR; r++) {
			// Each group of 4 activations is broadcast straight from
			// memory (a load-unit op); through a general register it would
			// take a vector port from vpdpbusd, and did: a third of the
			// kernel's time.
			const int8_t * g = a + r * lda + b * kBlock;
			__m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[0], _mm512_broadcastd_epi32(_mm_loadu_si32(g)));
			s = _mm512_dpbusd_epi32(s, u[1], _mm512_broadcastd_epi32(_mm_loadu_si32(g + 4)));
			s = _mm512_dpbusd_epi32(s, u[2], _mm512_broadcastd_epi32(_mm_loadu_si32(g + 8)));
			s = _mm512_dpbusd_epi32(s, u[3], _mm512_broadcastd_epi32(_mm_loadu_si32(g + 12)));
			s = _mm512_dpbusd_epi32(s, u[4], _mm512_broadcastd_epi32(_mm_loadu_si32(g + 16)));
			s = _mm512_dpbusd_epi32(s, u[5], _mm512_broadcastd_epi32(_mm_loadu_si32(g + 20)));
			s = _mm512_dpbusd_epi32(s, u[6], _mm512_broadcastd_epi32(_mm_loadu_si32(g + 24)));
			s = _mm512_dpbusd_epi32(s, u[7], _mm512_broadcastd_epi32(_mm_loadu_si32(g + 28)));
			const float * d = dm + r * ldd + 2 * b;
			const __m512 f = _mm512_fmsub_ps(_mm512_cvtepi32_ps(s), _mm512_set1_ps(d[0]), _mm512_set1_ps(d[1]));
			acc[r] = _mm512_fmadd_ps(f, dw, acc[r]);
		}
	}
	for (int r = 0; r < NR; r++) _mm512_storeu_ps(out[r], acc[r]);
}

typedef void (*tile_fn)(int64_t, const uint8_t *, const int8_t *, int64_t, const float *, int64_t, float * const *);
template <format F>
const tile_fn tiles[kRows + 1] = {nullptr, tile<F, 1>, tile<F, 2>, tile<F, 3>, tile<F, 4>, tile<F, 5>, tile<F, 6>, tile<F, 7>, tile<F, 8>};

bool cpu_ok() {
	static const bool ok = __builtin_cpu_supports("avx512f") && __builtin_cpu_supports("avx512bw") &&
	                       __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512dq") &&
	                       __builtin_cpu_supports("avx512vnni") && __builtin_cpu_supports("f16c") &&
	                       __builtin_cpu_supports("fma");
	return ok;
}

// Row r of src1/dst, with the batch dimensions flattened.
inline const float * src_row(const ggml_tensor * t, int64_t r) {
	const int64_t i11 = r % t->ne[1], i12 = (r / t->ne[1]) % t->ne[2], i13 = r / (t->ne[1] * t->ne[2]);
	return (const float *)((const char *)t->data + i11 * t->nb[1] + i12 * t->nb[2] + i13 * t->nb[3]);
}
inline float * dst_row(ggml_tensor * t, int64_t r) {
	const int64_t i1 = r % t->ne[1], i2 = (r / t->ne[1]) % t->ne[2], i3 = r / (t->ne[1] * t->ne[2]);
	return (float *)((char *)t->data + i1 * t->nb[1] + i2 * t->nb[2] + i3 * t->nb[3]);
}

act_layout layout_of(const ggml_tensor * op) {
	const ggml_tensor * src1 = op->src[1];
	act_layout l;
	l.rows = src1->ne[1] * src1->ne[2] * src1->ne[3];
	l.k = src1->ne[0];
	l.nb = l.k / kBlock;
	return l;
}

template <format F>
class x16_traits : public ggml::cpu::tensor_traits {
	bool work_size(int, const ggml_tensor * op, size_t & size) override {
		size = layout_of(op).size();
		return true;
	}

	bool compute_forward(ggml_compute_params * params, ggml_tensor * op) override {
		if (op->op != GGML_OP_MUL_MAT) return false;
		const ggml_tensor * src0 = op->src[0];
		const ggml_tensor * src1 = op->src[1];
		const int ith = params->ith, nth = params->nth;
		const act_layout l = layout_of(op);
		void * w = params->wdata;

		for (int64_t r = ith; r < l.rows; r += nth) {
			quantize_row(src_row(src1, r), l.k, bias<F>, l.q(w, r), l.dm(w, r));
		}

		// Work: chunks of weight tiles x blocks of activation rows. A
		// block's quants stay in L2 while each weight tile of the chunk is
		// read once for all of them.
		const int64_t ntiles = src0->ne[1] / kTile;
		const int64_t rows_per_block = l.rows <= kRows ? l.rows : std::max<int64_t>(kRows, ((256 << 10) / l.k) / kRows * kRows);
		const int64_t nrb = (l.rows + rows_per_block - 1) / rows_per_block;
		int64_t tiles_per_chunk = std::max<int64_t>(1, ntiles / (nth * 4));
		if (nrb > 1) tiles_per_chunk = std::max<int64_t>(tiles_per_chunk, 16);
		const int64_t ntc = (ntiles + tiles_per_chunk - 1) / tiles_per_chunk;
		const int64_t nchunks = ntc * nrb;

		if (ith == 0) ggml_threadpool_chunk_set(params->threadpool, nth);
		ggml_barrier(params->threadpool);

		const uint8_t * wbase = (const uint8_t *)src0->data;
		const size_t tile_bytes = (size_t)l.nb * tile_block_bytes<F>;
		float * outs[kRows];
		for (int64_t c = ith; c < nchunks; c = ggml_threadpool_chunk_add(params->threadpool, 1)) {
			const int64_t tc = c % ntc, rb = c / ntc;
			const int64_t t0 = tc * tiles_per_chunk, t1 = std::min(ntiles, t0 + tiles_per_chunk);
			const int64_t r0 = rb * rows_per_block, r1 = std::min(l.rows, r0 + rows_per_block);
			for (int64_t t = t0; t < t1; t++) {
				const uint8_t * wt = wbase + (size_t)t * tile_bytes;
				for (int64_t r = r0; r < r1; r += kRows) {
					const int nr = (int)std::min<int64_t>(kRows, r1 - r);
					for (int i = 0; i < nr; i++) outs[i] = dst_row(op, r + i) + t * kTile;
					tiles<F>[nr](l.nb, wt, l.q(w, r), l.k, l.dm(w, r), l.nb * 2, outs);
				}
			}
		}
		return true;
	}
};

x16_traits<Q4> q4_traits;
x16_traits<Q8> q8_traits;

ggml_backend_buffer_type_t x16_buft();

class x16_extra : public ggml::cpu::extra_buffer_type {
	bool supports_op(ggml_backend_dev_t, const ggml_tensor * op) override {
		return get_tensor_traits(op) != nullptr;
	}

	ggml::cpu::tensor_traits * get_tensor_traits(const ggml_tensor * op) override {
		// ggml offers every op of a CPU graph here, so attention is
		// hooked in the same way (attn_amd64.cpp).
		if (op->op == GGML_OP_FLASH_ATTN_EXT) return meshnode_attn_traits(op);
		if (op->op != GGML_OP_MUL_MAT) return nullptr;
		const ggml_tensor * src0 = op->src[0];
		const ggml_tensor * src1 = op->src[1];
		if (src0->buffer == nullptr || src0->buffer->buft != x16_buft()) return nullptr;
		if (src1->type != GGML_TYPE_F32 || src1->nb[0] != sizeof(float) || op->type != GGML_TYPE_F32 || op->nb[0] != sizeof(float)) return nullptr;
		if (src1->buffer && !ggml_backend_buft_is_host(src1->buffer->buft)) return nullptr;
		if (src0->ne[2] != 1 || src0->ne[3] != 1 || src1->ne[0] != src0->ne[0]) return nullptr;
		switch (src0->type) {
		case GGML_TYPE_Q4_0: return &q4_traits;
		case GGML_TYPE_Q8_0: return &q8_traits;
		default: return nullptr;
		}
	}
};

const char * buft_name(ggml_backend_buffer_type_t) { return "MESHNODE_X16"; }

ggml_backend_buffer_t buft_alloc(ggml_backend_buffer_type_t buft, size_t size) {
	ggml_backend_buffer_t b = ggml_backend_buft_alloc_buffer(ggml_backend_cpu_buffer_type(), size);
	if (b == nullptr) return nullptr;
	// ggml's own memory, our type: the CPU backend then asks q4x16_extra
	// how to compute with tensors in it. The data is not plain ggml layout,
	// so nobody may read or copy it as such.
	b->buft = buft;
	b->iface.init_tensor = nullptr;
	b->iface.get_tensor = nullptr;
	b->iface.cpy_tensor = nullptr;
	return b;
}

size_t buft_alignment(ggml_backend_buffer_type_t) { return 64; }

ggml_backend_buffer_type_t x16_buft() {
	static ggml_backend_buffer_type buft = {
		/* .iface = */ {
			/* .get_name       = */ buft_name,
			/* .alloc_buffer   = */ buft_alloc,
			/* .get_alignment  = */ buft_alignment,
			/* .get_max_size   = */ nullptr,
			/* .get_alloc_size = */ nullptr,
			/* .is_host        = */ nullptr,
			/* .noalloc_buffer = */ nullptr,
		},
		/* .device   = */ ggml_backend_dev_by_type(GGML_BACKEND_DEVICE_TYPE_CPU),
		/* .context  = */ new x16_extra(),
		/* .no_alloc = */ false,
	};
	return &buft;
}

// Registers the buffer type with the CPU backend once; ggml consults this
// list for every op whose weights are in an extra buffer type, so it must
// not change while a graph computes: the package registers it at init
// (meshnode_x16_register), before any engine exists.
bool registered() {
	static const bool ok = [] {
		if (!cpu_ok()) return false;
		ggml_backend_buffer_type_t buft = x16_buft();
		if (buft->device == nullptr) return false;
		ggml_backend_cpu_get_extra_buffer_types().push_back(buft);
		return true;
	}();
	return ok;
}

template <format F>
void pack(const ggml_tensor * t, const uint8_t * src, uint8_t * dst) {
	constexpr size_t native = F == Q4 ? 18 : 34; // bytes of one row's block
	const int64_t k = t->ne[0], n = t->ne[1], nb = k / kBlock;
	const size_t row_bytes = (size_t)nb * native;
	for (int64_t tt = 0; tt < n / kTile; tt++) {
		for (int64_t b = 0; b < nb; b++) {
			uint8_t * p = dst + ((size_t)tt * nb + b) * tile_block_bytes<F>;
			for (int r = 0; r < kTile; r++) {
				const uint8_t * s = src + (size_t)(tt * kTile + r) * row_bytes + (size_t)b * native;
				memcpy(p + 2 * r, s, 2);
				if constexpr (F == Q4) {
					for (int j = 0; j < 4; j++) memcpy(p + 32 + 64 * j + 4 * r, s + 2 + 4 * j, 4);
				} else {
					for (int j = 0; j < 8; j++) {
						for (int i = 0; i < 4; i++) p[32 + 64 * j + 4 * r + i] = (uint8_t)(s[2 + 4 * j + i] ^ 0x80);
					}
				}
			}
		}
	}
}

} // namespace

extern "C" {

int meshnode_x16_cpu(void) { return cpu_ok(); }

int meshnode_x16_register(void) { return registered(); }

int meshnode_x16_ok(const struct ggml_tensor * t) {
	return (t->type == GGML_TYPE_Q4_0 || t->type == GGML_TYPE_Q8_0) && ggml_n_dims(t) == 2 &&
	       t->ne[0] % kBlock == 0 && t->ne[1] % kTile == 0 && registered();
}

ggml_backend_buffer_t meshnode_x16_take(struct ggml_tensor * t, const void * data) {
	if (!meshnode_x16_ok(t)) return nullptr;
	ggml_backend_buffer_t buf = ggml_backend_buft_alloc_buffer(x16_buft(), ggml_nbytes(t));
	if (buf == nullptr) return nullptr;
	ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
	t->buffer = nullptr;
	t->data = nullptr;
	if (ggml_backend_tensor_alloc(buf, t, ggml_backend_buffer_get_base(buf)) != GGML_STATUS_SUCCESS) {
		ggml_backend_buffer_free(buf);
		return nullptr;
	}
	if (t->type == GGML_TYPE_Q4_0) {
		pack<Q4>(t, (const uint8_t *)data, (uint8_t *)t->data);
	} else {
		pack<Q8>(t, (const uint8_t *)data, (uint8_t *)t->data);
	}
	return buf;
}

} // extern "C"

// meshnode_x16_check multiplies a random [k, n] weight of type (Q4_0 or
// Q8_0) by a random [k, m] activation on ggml's CPU backend twice, once
// with the weight in X16 and once in ggml's plain layout, and returns
// max|a-b| / max|b|; -1 when the kernel cannot run here. Tests use it to check the kernel on shapes
// (row tails, several row blocks, thread counts) that models rarely hit.
extern "C" double meshnode_x16_check(int type, int k, int n, int m, int threads, unsigned seed) {
	const ggml_type wt = (ggml_type)type;
	if (!registered() || (wt != GGML_TYPE_Q4_0 && wt != GGML_TYPE_Q8_0) || k % kBlock != 0 || n % kTile != 0) return -1;
	const size_t native = wt == GGML_TYPE_Q4_0 ? 18 : 34;
	uint64_t state = seed * 0x9E3779B97F4A7C15ull + 1;
	auto next = [&state]() {
		state ^= state << 13;
		state ^= state >> 7;
		state ^= state << 17;
		return state;
	};
	const size_t nb = (size_t)k / kBlock;
	std::vector<uint8_t> wq((size_t)n * nb * native);
	for (size_t i = 0; i < (size_t)n * nb; i++) {
		const ggml_fp16_t d = ggml_fp32_to_fp16(0.001f + (float)(next() % 1000) * 1e-5f);
		memcpy(&wq[i * native], &d, 2);
		for (size_t j = 2; j < native; j++) {
			uint8_t v = (uint8_t)next();
			if (wt == GGML_TYPE_Q8_0 && v == 0x80) v = 0x81; // Q8_0 quants are -127..127
			wq[i * native + j] = v;
		}
	}
	std::vector<float> x((size_t)k * m);
	for (auto & v : x) v = (float)((int64_t)(next() % 2001) - 1000) / 1000.0f;

	ggml_backend_t be = ggml_backend_cpu_init();
	if (be == nullptr) return -1;
	ggml_backend_cpu_set_n_threads(be, threads);
	std::vector<float> out[2];
	for (int pass = 0; pass < 2; pass++) {
		ggml_init_params ip = {ggml_tensor_overhead() * 8 + ggml_graph_overhead(), nullptr, true};
		ggml_context * ctx = ggml_init(ip);
		ggml_tensor * w = ggml_new_tensor_2d(ctx, wt, k, n);
		ggml_tensor * a = ggml_new_tensor_2d(ctx, GGML_TYPE_F32, k, m);
		ggml_tensor * y = ggml_mul_mat(ctx, w, a);
		ggml_cgraph * g = ggml_new_graph(ctx);
		ggml_build_forward_expand(g, y);
		ggml_backend_buffer_t plain = ggml_backend_alloc_ctx_tensors(ctx, be);
		ggml_backend_buffer_t own = nullptr;
		if (pass == 0) {
			own = meshnode_x16_take(w, wq.data());
		} else {
			ggml_backend_tensor_set(w, wq.data(), 0, wq.size());
		}
		ggml_backend_tensor_set(a, x.data(), 0, x.size() * sizeof(float));
		const bool ok = (pass == 1 || own != nullptr) && ggml_backend_graph_compute(be, g) == GGML_STATUS_SUCCESS;
		if (ok) {
			out[pass].resize((size_t)n * m);
			ggml_backend_tensor_get(y, out[pass].data(), 0, out[pass].size() * sizeof(float));
		}
		ggml_backend_buffer_free(plain);
		if (own) ggml_backend_buffer_free(own);
		ggml_free(ctx);
		if (!ok) {
			ggml_backend_free(be);
			return -1;
		}
	}
	ggml_backend_free(be);
	double diff = 0, ref = 0;
	for (size_t i = 0; i < out[0].size(); i++) {
		diff = std::max(diff, (double)std::abs(out[0][i] - out[1][i]));
		ref = std::max(ref, (double)std::abs(out[1][i]));
	}
	return ref > 0 ? diff / ref : diff;
}
