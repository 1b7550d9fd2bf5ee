//go:build repack && cgo && amd64

// meshnode's CPU attention for a ggml FLASH_ATTN_EXT op (f32 queries, f16
// K and V, as ollama's KV cache holds them), on AVX-512. It is reached only
// through the X16 kernel's hook (x16_amd64.cpp), which registers only on
// CPUs with every instruction used here.
//
// ggml's own CPU kernel accumulates V in f16 and rescales as it walks the
// cells (online softmax), so its result depends on where in the cache a
// sequence's cells sit. A sequence replayed after a node failure sits in
// other cells and drifted from the uninterrupted text, which kept flash
// attention off on CPUs (and with it 1.4-1.8x decode at several streams).
// This kernel makes the result depend only on the sequence's own cells:
//   1. the cells the mask allows are listed, in cell order;
//   2. their scores are computed (the query rounded to f16, as ggml's
//      kernels and llama.cpp's round it; f32 products; each on its own)
//      and their maximum taken (exact in any order);
//   3. the weights exp(score - max) (each on its own) and the V rows they
//      weight are summed in f64 and rounded to f32 once, at the end.
// A masked cell never enters any sum, so moving a sequence's cells changes
// no bit; reordering them changes only f64 rounding, which the final f32
// rounding absorbs but for a rare last-bit case. The query heads that share
// a KV head (GQA) are done together, so each K and V row is read once for
// all of them.

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
#include "ggml-cpu/traits.h"

#include "attn.h"
#include "x16.h"

#define MN_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,f16c,fma")))

namespace {

constexpr int kMaxGroup = 16; // query heads per KV head handled together

// exp for x <= 0 (scores minus their maximum): 2^n * p(r), r in
// [-ln2/2, ln2/2], p the degree-6 Taylor polynomial (error < 2 ulp).
MN_TARGET inline __m512 exp_neg(__m512 x) {
	x = _mm512_max_ps(x, _mm512_set1_ps(-104.0f)); // exp underflows to 0 below
	const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)), _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
	__m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693145751953125f), x);
	r = _mm512_fnmadd_ps(n, _mm512_set1_ps(1.428606765330187045e-06f), r);
	__m512 p = _mm512_set1_ps(1.0f / 720);
	p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 120));
	p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 24));
	p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f / 6));
	p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(0.5f));
	p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
	p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.0f));
	return _mm512_scalef_ps(p, n);
}

// Head sizes need not be multiples of 16 (stories260K's is 8): rows are
// read in chunks of 16 with the tail masked, and scratch rows are padded.
inline int64_t pad16(int64_t n) { return (n + 15) / 16 * 16; }

inline __mmask16 lanes(int64_t left) { return left >= 16 ? (__mmask16)0xFFFF : (__mmask16)((1u << left) - 1); }

MN_TARGET inline __m512 load_f16(const void * p, __mmask16 m) {
	return _mm512_cvtph_ps(_mm256_maskz_loadu_epi16(m, p));
}

inline void prefetch(const char * p, int64_t bytes, int hint) {
	for (int64_t o = 0; o < bytes; o += 64) {
		if (hint == _MM_HINT_T0) {
			_mm_prefetch(p + o, _MM_HINT_T0);
		} else {
			_mm_prefetch(p + o, _MM_HINT_T1);
		}
	}
}

bool enabled = true; // meshnode_attn_enable; tests compare with ggml's kernel

// Per-thread scratch, in floats: the listed cells, then G rows of scores
// (n_kv each), then G queries of DK, then G f64 accumulators of DV.
size_t scratch_floats(int64_t n_kv, int64_t G, int64_t DK, int64_t DV) {
	return (size_t)n_kv + (size_t)G * n_kv + (size_t)G * pad16(DK) + 2 * (size_t)G * pad16(DV) + 32;
}

struct shape {
	int64_t DK, DV, n_q, n_head, n_head_kv, n_kv, ne3, G;
};

shape shape_of(const ggml_tensor * op) {
	const ggml_tensor *q = op->src[0], *k = op->src[1], *v = op->src[2];
	shape s;
	s.DK = k->ne[0];
	s.DV = v->ne[0];
	s.n_q = q->ne[1];
	s.n_head = q->ne[2];
	s.n_head_kv = k->ne[2];
	s.n_kv = k->ne[1];
	s.ne3 = q->ne[3];
	s.G = s.n_head / s.n_head_kv;
	return s;
}

// One query position, one KV head: the G query heads that share it.
MN_TARGET void attend(const ggml_tensor * op, const shape & sh, float scale, int64_t iq1, int64_t ik2, int64_t iq3, float * scratch) {
	const ggml_tensor *q = op->src[0], *k = op->src[1], *v = op->src[2], *mask = op->src[3];
	const int64_t G = sh.G, DK = sh.DK, DV = sh.DV, n_kv = sh.n_kv;
	int32_t * cells = (int32_t *)scratch;
	float * scores = scratch + n_kv;
	const int64_t DKp = pad16(DK), DVp = pad16(DV);
	float * qs = scores + G * n_kv;
	double * acc = (double *)(((uintptr_t)(qs + G * DKp) + 63) & ~(uintptr_t)63);

	// 1. The cells this query may see, in cell order.
	int64_t n = 0;
	const uint16_t * mp = mask ? (const uint16_t *)((const char *)mask->data + iq1 * mask->nb[1] + (iq3 % mask->ne[3]) * mask->nb[3]) : nullptr;
	if (mp == nullptr) {
		for (int64_t c = 0; c < n_kv; c++) cells[n++] = (int32_t)c;
	} else {
		int64_t c = 0;
		const __m512i ninf = _mm512_set1_epi16((short)0xFC00);
		for (; c + 32 <= n_kv; c += 32) {
			__mmask32 ok = ~_mm512_cmpeq_epi16_mask(_mm512_loadu_si512(mp + c), ninf);
			while (ok) {
				cells[n++] = (int32_t)(c + __builtin_ctz(ok));
				ok &= ok - 1;
			}
		}
		for (; c < n_kv; c++) {
			if (mp[c] != 0xFC00) cells[n++] = (int32_t)c;
		}
	}

	const char * qbase = (const char *)q->data + iq1 * q->nb[1] + iq3 * q->nb[3];
	const char * kbase = (const char *)k->data + ik2 * k->nb[2] + (iq3 % k->ne[3]) * k->nb[3];
	const char * vbase = (const char *)v->data + ik2 * v->nb[2] + (iq3 % v->ne[3]) * v->nb[3];
	const int64_t h0 = ik2 * G;

	// The queries, rounded to f16 as ggml's kernels (with and without
	// flash attention) and llama.cpp's round them before the K products.
	for (int64_t g = 0; g < G; g++) {
		const float * qr = (const float *)(qbase + (h0 + g) * q->nb[2]);
		for (int64_t i = 0; i < DK; i += 16) {
			const __m512 x = _mm512_maskz_loadu_ps(lanes(DK - i), qr + i); // zeros past DK
			_mm512_storeu_ps(qs + g * DKp + i, _mm512_cvtph_ps(_mm512_cvtps_ph(x, _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC)));
		}
	}

	// 2. Scores and their maximum per head.
	float maxs[kMaxGroup];
	for (int64_t g = 0; g < G; g++) maxs[g] = -INFINITY;
	// K and V rows are one head's slice of each cell, a cell's width apart:
	// a new page every few cells, where hardware prefetchers stop. So the
	// K rows ahead are fetched by hand, and each cell's V row is brought
	// into L2 for step 4 as its K row is read.
	constexpr int64_t ahead = 8;
	const int64_t kbytes = DK * (int64_t)sizeof(ggml_fp16_t), vbytes = DV * (int64_t)sizeof(ggml_fp16_t);
	for (int64_t j = 0; j < std::min(ahead, n); j++) prefetch(kbase + (int64_t)cells[j] * k->nb[1], kbytes, _MM_HINT_T0);
	for (int64_t j = 0; j < n; j++) {
		if (j + ahead < n) prefetch(kbase + (int64_t)cells[j + ahead] * k->nb[1], kbytes, _MM_HINT_T0);
		prefetch(vbase + (int64_t)cells[j] * v->nb[1], vbytes, _MM_HINT_T1);
		const ggml_fp16_t * kr = (const ggml_fp16_t *)(kbase + (int64_t)cells[j] * k->nb[1]);
		const float mv = mp ? _cvtsh_ss(mp[cells[j]]) : 0.0f;
		for (int64_t g = 0; g < G; g++) {
			const float * qr = qs + g * DKp;
			__m512 d = _mm512_setzero_ps();
			for (int64_t i = 0; i < DK; i += 16) d = _mm512_fmadd_ps(load_f16(kr + i, lanes(DK - i)), _mm512_loadu_ps(qr + i), d);
			const float s = _mm512_reduce_add_ps(d) * scale + mv;
			scores[g * n_kv + j] = s;
			maxs[g] = std::max(maxs[g], s);
		}
	}

	// 3. The weights, each on its own, and their sum in f64.
	double sums[kMaxGroup];
	for (int64_t g = 0; g < G; g++) {
		float * s = scores + g * n_kv;
		const __m512 m = _mm512_set1_ps(maxs[g]);
		int64_t j = 0;
		for (; j + 16 <= n; j += 16) _mm512_storeu_ps(s + j, exp_neg(_mm512_sub_ps(_mm512_loadu_ps(s + j), m)));
		if (j < n) {
			const __mmask16 tail = (__mmask16)((1u << (n - j)) - 1);
			_mm512_mask_storeu_ps(s + j, tail, exp_neg(_mm512_sub_ps(_mm512_maskz_loadu_ps(tail, s + j), m)));
		}
		double sum = 0;
		for (j = 0; j < n; j++) sum += s[j];
		sums[g] = sum;
	}

	// 4. The V rows, weighted, summed in f64.
	std::fill(acc, acc + G * DVp, 0.0);
	for (int64_t j = 0; j < n; j++) {
		if (j + ahead < n) prefetch(vbase + (int64_t)cells[j + ahead] * v->nb[1], vbytes, _MM_HINT_T0);
		const ggml_fp16_t * vr = (const ggml_fp16_t *)(vbase + (int64_t)cells[j] * v->nb[1]);
		for (int64_t i = 0; i < DV; i += 16) {
			const __m512 vv = load_f16(vr + i, lanes(DV - i));
			const __m512d lo = _mm512_cvtps_pd(_mm512_castps512_ps256(vv));
			const __m512d hi = _mm512_cvtps_pd(_mm256_castpd_ps(_mm512_extractf64x4_pd(_mm512_castps_pd(vv), 1)));
			for (int64_t g = 0; g < G; g++) {
				double * a = acc + g * DVp + i;
				const __m512d p = _mm512_set1_pd(scores[g * n_kv + j]);
				_mm512_store_pd(a, _mm512_fmadd_pd(p, lo, _mm512_load_pd(a)));
				_mm512_store_pd(a + 8, _mm512_fmadd_pd(p, hi, _mm512_load_pd(a + 8)));
			}
		}
	}

	// Output, laid out as ggml's kernel writes it (heads, then positions).
	const int64_t ne1 = op->ne[1], ne2 = op->ne[2];
	for (int64_t g = 0; g < G; g++) {
		const __m512d inv = _mm512_set1_pd(sums[g] == 0 ? 0.0 : 1.0 / sums[g]);
		float * out = (float *)((char *)op->data + (iq3 * ne2 * ne1 + (h0 + g) + iq1 * ne1) * op->nb[1]);
		for (int64_t i = 0; i < DV; i += 8) {
			const __m256 o = _mm512_cvtpd_ps(_mm512_mul_pd(_mm512_load_pd(acc + g * DVp + i), inv));
			_mm256_mask_storeu_ps(out + i, (__mmask8)(DV - i >= 8 ? 0xFF : (1u << (DV - i)) - 1), o);
		}
	}
}

class attn_traits : public ggml::cpu::tensor_traits {
	bool work_size(int n_threads, const ggml_tensor * op, size_t & size) override {
		const shape sh = shape_of(op);
		size = (size_t)n_threads * scratch_floats(sh.n_kv, sh.G, sh.DK, sh.DV) * sizeof(float) + 64 * (size_t)n_threads;
		return true;
	}

	bool compute_forward(ggml_compute_params * params, ggml_tensor * op) override {
		if (op->op != GGML_OP_FLASH_ATTN_EXT) return false;
		const shape sh = shape_of(op);
		float scale;
		memcpy(&scale, (const float *)op->op_params + 0, sizeof(float));
		const int ith = params->ith, nth = params->nth;
		const size_t per = (scratch_floats(sh.n_kv, sh.G, sh.DK, sh.DV) + 15) / 16 * 16;
		float * scratch = (float *)(((uintptr_t)params->wdata + 63) & ~(uintptr_t)63) + (size_t)ith * per;

		const int64_t ntasks = sh.n_q * sh.n_head_kv * sh.ne3;
		if (ith == 0) ggml_threadpool_chunk_set(params->threadpool, nth);
		ggml_barrier(params->threadpool);
		for (int64_t t = ith; t < ntasks; t = ggml_threadpool_chunk_add(params->threadpool, 1)) {
			const int64_t ik2 = t % sh.n_head_kv, iq1 = (t / sh.n_head_kv) % sh.n_q, iq3 = t / (sh.n_head_kv * sh.n_q);
			attend(op, sh, scale, iq1, ik2, iq3, scratch);
		}
		return true;
	}
};

attn_traits traits;

float op_param(const ggml_tensor * op, int i) {
	float f;
	memcpy(&f, (const float *)op->op_params + i, sizeof(float));
	return f;
}

} // namespace

ggml::cpu::tensor_traits * meshnode_attn_traits(const ggml_tensor * op) {
	if (!enabled || op->op != GGML_OP_FLASH_ATTN_EXT) return nullptr;
	const ggml_tensor *q = op->src[0], *k = op->src[1], *v = op->src[2], *mask = op->src[3];
	if (op->src[4] != nullptr) return nullptr; // attention sinks
	if (q->type != GGML_TYPE_F32 || k->type != GGML_TYPE_F16 || v->type != GGML_TYPE_F16 || op->type != GGML_TYPE_F32) return nullptr;
	if (mask && (mask->type != GGML_TYPE_F16 || mask->ne[2] != 1 || mask->nb[0] != sizeof(ggml_fp16_t))) return nullptr;
	if (op_param(op, 1) != 0.0f || op_param(op, 2) != 0.0f) return nullptr; // ALiBi, logit softcap
	for (const ggml_tensor * t : {q, k, v, mask}) {
		if (t && t->buffer && !ggml_backend_buft_is_host(t->buffer->buft)) return nullptr;
	}
	if (q->nb[0] != sizeof(float) || k->nb[0] != sizeof(ggml_fp16_t) || v->nb[0] != sizeof(ggml_fp16_t) || op->nb[0] != sizeof(float)) return nullptr;
	if (q->ne[0] != k->ne[0] || k->ne[0] == 0 || v->ne[0] == 0) return nullptr;
	if (k->ne[2] == 0 || q->ne[2] % k->ne[2] != 0 || q->ne[2] / k->ne[2] > kMaxGroup || v->ne[2] != k->ne[2] || v->ne[1] != k->ne[1]) return nullptr;
	return &traits;
}

extern "C" void meshnode_attn_enable(int on) { enabled = on != 0; }

namespace {

struct rng {
	uint64_t s;
	explicit rng(unsigned seed) : s(seed * 0x9E3779B97F4A7C15ull + 1) {}
	uint64_t next() {
		s ^= s << 13;
		s ^= s >> 7;
		s ^= s << 17;
		return s;
	}
	float uniform() { return (float)((int64_t)(next() % 2001) - 1000) / 1000.0f; }
};

// attention runs one FLASH_ATTN_EXT on ggml's CPU backend: q [DK, n_q, H],
// k and v [DK, n_kv, H_kv] (f16), mask [n_kv, n_q] (0 or -inf); returns
// out [DK, H, n_q], or an empty vector on failure.
std::vector<float> attention(int DK, int n_q, int H, int H_kv, int n_kv, int threads, const std::vector<float> & q,
                             const std::vector<ggml_fp16_t> & k, const std::vector<ggml_fp16_t> & v, const std::vector<ggml_fp16_t> & mask) {
	ggml_backend_t be = ggml_backend_cpu_init();
	if (be == nullptr) return {};
	ggml_backend_cpu_set_n_threads(be, threads);
	ggml_init_params ip = {ggml_tensor_overhead() * 8 + ggml_graph_overhead(), nullptr, true};
	ggml_context * ctx = ggml_init(ip);
	const int n_q_pad = n_q;
	ggml_tensor * tq = ggml_new_tensor_3d(ctx, GGML_TYPE_F32, DK, n_q, H);
	ggml_tensor * tk = ggml_new_tensor_3d(ctx, GGML_TYPE_F16, DK, n_kv, H_kv);
	ggml_tensor * tv = ggml_new_tensor_3d(ctx, GGML_TYPE_F16, DK, n_kv, H_kv);
	ggml_tensor * tm = ggml_new_tensor_2d(ctx, GGML_TYPE_F16, n_kv, n_q_pad);
	ggml_tensor * out = ggml_flash_attn_ext(ctx, tq, tk, tv, tm, 1.0f / std::sqrt((float)DK), 0.0f, 0.0f);
	ggml_flash_attn_ext_set_prec(out, GGML_PREC_F32);
	ggml_cgraph * g = ggml_new_graph(ctx);
	ggml_build_forward_expand(g, out);
	ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, be);
	std::vector<ggml_fp16_t> m(mask);
	m.resize((size_t)n_kv * n_q_pad, ggml_fp32_to_fp16(-INFINITY));
	ggml_backend_tensor_set(tq, q.data(), 0, q.size() * sizeof(float));
	ggml_backend_tensor_set(tk, k.data(), 0, k.size() * sizeof(ggml_fp16_t));
	ggml_backend_tensor_set(tv, v.data(), 0, v.size() * sizeof(ggml_fp16_t));
	ggml_backend_tensor_set(tm, m.data(), 0, m.size() * sizeof(ggml_fp16_t));
	std::vector<float> res;
	if (ggml_backend_graph_compute(be, g) == GGML_STATUS_SUCCESS) {
		res.resize((size_t)DK * H * n_q);
		ggml_backend_tensor_get(out, res.data(), 0, res.size() * sizeof(float));
	}
	ggml_backend_buffer_free(buf);
	ggml_free(ctx);
	ggml_backend_free(be);
	return res;
}

} // namespace

// meshnode_attn_check computes a random attention (causal-looking masks,
// some rows fully masked) with the kernel and in double precision (from the
// queries rounded to f16, as every kernel rounds them), and
// returns max|kernel - exact| / max|exact|; with ggml=1, ggml's own kernel
// instead of meshnode's. -1 when the kernel cannot run here.
extern "C" double meshnode_attn_check(int DK, int n_q, int H, int H_kv, int n_kv, int threads, unsigned seed, int ggml) {
	if (!meshnode_x16_register()) return -1; // the hook, and so the kernel, is not live
	rng r(seed);
	std::vector<float> q((size_t)DK * n_q * H);
	std::vector<ggml_fp16_t> k((size_t)DK * n_kv * H_kv), v(k.size()), mask((size_t)n_kv * n_q);
	for (auto & x : q) x = 2 * r.uniform();
	for (auto & x : k) x = ggml_fp32_to_fp16(r.uniform());
	for (auto & x : v) x = ggml_fp32_to_fp16(r.uniform());
	for (int i = 0; i < n_q; i++) {
		const int visible = i == n_q - 1 && n_q > 1 ? 0 : (int)(r.next() % (n_kv + 1)); // the last row sees nothing
		for (int c = 0; c < n_kv; c++) mask[(size_t)i * n_kv + c] = ggml_fp32_to_fp16(c < visible && r.next() % 4 != 0 ? 0.0f : -INFINITY);
	}
	enabled = ggml == 0;
	std::vector<float> got = attention(DK, n_q, H, H_kv, n_kv, threads, q, k, v, mask);
	enabled = true;
	if (got.empty()) return -1;
	double diff = 0, ref = 0;
	const float scale = 1.0f / std::sqrt((float)DK);
	for (int i = 0; i < n_q; i++) {
		for (int h = 0; h < H; h++) {
			const int hk = h / (H / H_kv);
			std::vector<double> s(n_kv, -INFINITY);
			double mx = -INFINITY;
			for (int c = 0; c < n_kv; c++) {
				if (ggml_fp16_to_fp32(mask[(size_t)i * n_kv + c]) == -INFINITY) continue;
				double d = 0;
				for (int j = 0; j < DK; j++) {
					const double qj = ggml_fp16_to_fp32(ggml_fp32_to_fp16(q[((size_t)h * n_q + i) * DK + j])); // as the kernels round it
					d += qj * ggml_fp16_to_fp32(k[((size_t)hk * n_kv + c) * DK + j]);
				}
				s[c] = d * scale;
				mx = std::max(mx, s[c]);
			}
			double sum = 0;
			std::vector<double> o(DK, 0.0);
			for (int c = 0; c < n_kv; c++) {
				if (s[c] == -INFINITY) continue;
				const double p = std::exp(s[c] - mx);
				sum += p;
				for (int j = 0; j < DK; j++) o[j] += p * ggml_fp16_to_fp32(v[((size_t)hk * n_kv + c) * DK + j]);
			}
			for (int j = 0; j < DK; j++) {
				const double want = sum > 0 ? o[j] / sum : 0;
				diff = std::max(diff, std::abs(want - got[((size_t)i * H + h) * DK + j]));
				ref = std::max(ref, std::abs(want));
			}
		}
	}
	return ref > 0 ? diff / ref : diff;
}

// meshnode_attn_moved computes one query over n visible cells twice: with
// the cells at 0..n-1 of an n-cell cache, and spread over a cache three
// times that size among masked cells of other content, in the same order,
// or with shuffle=1 in another order (as a sequence sits after a replay).
// It returns how many outputs differ in any bit; with ggml=1, for ggml's
// own kernel. -1 when it cannot run here.
extern "C" int meshnode_attn_moved(int DK, int H, int H_kv, int n, unsigned seed, int ggml, int shuffle) {
	if (!meshnode_x16_register()) return -1; // the hook, and so the kernel, is not live
	rng r(seed);
	std::vector<float> q((size_t)DK * H);
	for (auto & x : q) x = 2 * r.uniform();
	std::vector<ggml_fp16_t> k((size_t)DK * n * H_kv), v(k.size());
	for (auto & x : k) x = ggml_fp32_to_fp16(r.uniform());
	for (auto & x : v) x = ggml_fp32_to_fp16(r.uniform());
	const int wide = 3 * n;
	std::vector<ggml_fp16_t> k2((size_t)DK * wide * H_kv), v2(k2.size()), mask(n, ggml_fp32_to_fp16(0.0f)), mask2(wide, ggml_fp32_to_fp16(-INFINITY));
	for (auto & x : k2) x = ggml_fp32_to_fp16(r.uniform());
	for (auto & x : v2) x = ggml_fp32_to_fp16(r.uniform());
	std::vector<int> at(n);
	for (int c = 0, next = 0; c < n; c++) {
		next += 1 + (int)(r.next() % 2);
		at[c] = std::min(next, wide - (n - c));
		next = at[c];
	}
	if (shuffle) { // as decode fills holes: the cells' order is not the positions'
		for (int c = n - 1; c > 0; c--) std::swap(at[c], at[r.next() % (c + 1)]);
	}
	for (int h = 0; h < H_kv; h++) {
		for (int c = 0; c < n; c++) {
			memcpy(&k2[((size_t)h * wide + at[c]) * DK], &k[((size_t)h * n + c) * DK], DK * sizeof(ggml_fp16_t));
			memcpy(&v2[((size_t)h * wide + at[c]) * DK], &v[((size_t)h * n + c) * DK], DK * sizeof(ggml_fp16_t));
		}
	}
	for (int c = 0; c < n; c++) mask2[at[c]] = ggml_fp32_to_fp16(0.0f);
	enabled = ggml == 0;
	std::vector<float> a = attention(DK, 1, H, H_kv, n, 1, q, k, v, mask);
	std::vector<float> b = attention(DK, 1, H, H_kv, wide, 1, q, k2, v2, mask2);
	enabled = true;
	if (a.empty() || a.size() != b.size()) return -1;
	int differ = 0;
	for (size_t i = 0; i < a.size(); i++) differ += memcmp(&a[i], &b[i], sizeof(float)) != 0;
	return differ;
}
