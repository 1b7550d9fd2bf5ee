//go:build repack && cgo && amd64

// X16: meshnode's own CPU matmul for Q4_0, Q8_0, Q4_K and Q6_K weights on
// AVX512-VNNI.
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
//
// K-quants work on super-blocks of 256 columns, with activations quantized
// as ggml's Q8_K (one float scale per 256, round to nearest even), so that
// the kernel sums exactly the integers ggml's own dot products sum. Weights
// are again unsigned: a Q4_K nibble is its value; a Q6_K six-bit q (value
// q-32) is q, and -32*sum(a) over each 16 columns starts that group's
// integer sum. The integer scales stay integers (vpmulld per sub-block), so
// each super-block meets floats once, as in ggml. Per tile and super-block:
//   Q4_K (2368 bytes, 2.8% over ggml's 2304, for unpacked 6-bit scales):
//     16 d (f16), 16 dmin (f16), the 8 sub-block scales as bytes [j][row],
//     the 8 mins as bytes [j/2][row][j%2] (vpdpwssd pairs), then per 64
//     columns c the 16 rows' native quant bytes 32c.. in 4-byte groups as
//     for Q4_0: low nibbles are sub-block 2c, high nibbles 2c+1;
//   Q6_K (3392 bytes: ggml's 3360 and a pad to whole cache lines): per 128
//     columns the native ql bytes (64 per row) and qh bytes (32 per row),
//     each in 4-byte groups of the 16 rows, laid out in the order the
//     one-row kernel reads them (namespace q6); 16 d (f16); the 16 group
//     scales as int8 [group][row].

#include <immintrin.h>
#include <stdint.h>
#include <string.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <vector>

#include "ggml.h"
#include "ggml-backend.h"
#include "ggml-backend-impl.h"
#include "ggml-cpu.h"
#include "ggml-cpu/traits.h" // and ggml-cpu-impl.h

#include "x16.h"
#include "attn.h"
#include "hugepage.h"

#define MN_TARGET __attribute__((target("avx512f,avx512bw,avx512vl,avx512dq,avx512vnni,f16c,fma")))

namespace {

constexpr int kTile = 16;  // weight rows per tile
constexpr int kBlock = 32; // columns per block of Q4_0 and Q8_0
constexpr int kRows = 8;   // activation rows per microkernel call

enum format { Q4, Q8, Q4K, Q6K };

constexpr bool kquant(format f) { return f == Q4K || f == Q6K; }
template <format F> constexpr int block_cols = kquant(F) ? 256 : kBlock;
template <format F> constexpr int tile_block_bytes = F == Q4 ? 288 : F == Q8 ? 544 : F == Q4K ? 2368 : 3392;
template <format F> constexpr size_t native_block_bytes = F == Q4 ? 18 : F == Q8 ? 34 : F == Q4K ? 144 : 210;
template <format F> constexpr float bias = F == Q4 ? 8.0f : 128.0f;

// What a K-quant kernel needs of one activation row's super-block besides
// its quants: ggml's Q8_K scale, the quants' sums per 32 columns (Q4_K's
// mins) and -32 times their sums per 16 columns (Q6_K's offset).
struct kinfo {
	float d;
	float pad[3];
	int16_t s32[8];
	int32_t b16[16];
};
static_assert(sizeof(kinfo) == 96, "kinfo layout");

// Where a Q6_K tile's super-block keeps its parts (see the top): quants
// first, so that their 64-byte loads are aligned, in the order the
// one-row kernel reads them; then the scales; padded to whole lines.
namespace q6 {
// ql group j (0..15: bytes 4j..4j+3 of the 16 rows' 64 ql bytes) of half n
inline const uint8_t * ql(const uint8_t * w, int n, int j) { return w + 1536 * n + 192 * (j % 8) + 64 * (j / 8); }
// qh group g (0..7) of half n
inline const uint8_t * qh(const uint8_t * w, int n, int g) { return w + 1536 * n + 192 * g + 128; }
constexpr int d = 3072;  // 16 f16
constexpr int sc = 3104; // [16 groups][16 rows] int8
} // namespace q6

// Activations are quantized into the work buffer: per row K int8 values,
// then per row and block the block's info: for Q4_0 and Q8_0 two floats
// (the scale d and bias*d*sum(q)), for K-quants a kinfo.
struct act_layout {
	int64_t rows, k, nb;
	size_t info_bytes; // per block
	size_t q_bytes() const { return (size_t)rows * k; }
	size_t size() const { return q_bytes() + (size_t)rows * nb * info_bytes + 64; }
	int8_t * q(void * w, int64_t r) const { return (int8_t *)w + (size_t)r * k; }
	void * info(void * w, int64_t r) const {
		uintptr_t base = ((uintptr_t)w + q_bytes() + 63) & ~(uintptr_t)63;
		return (char *)base + (size_t)r * nb * info_bytes;
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

// quantize_row_k quantizes a row as ggml's quantize_row_q8_K_ref does,
// except that max is taken as +|max|: that flips the signs of d and the
// quants of a block whose largest value is negative, which leaves every
// product d*q unchanged. ggml rounds iscale*x with its float trick
// (x + 1.5*2^23), which the compiler contracts into one FMA: the exact
// product is rounded once, to nearest even. Rounding the float product
// instead moves a value like 63.4999 to 64 (found by TestX16MatchesGGML).
MN_TARGET void quantize_row_k(const float * x, int64_t k, int8_t * q, kinfo * info) {
	const __m512 sign = _mm512_set1_ps(-0.0f);
	for (int64_t b = 0; b < k / 256; b++, x += 256, q += 256) {
		kinfo & ki = info[b];
		__m512 amax = _mm512_setzero_ps();
		for (int i = 0; i < 16; i++) amax = _mm512_max_ps(amax, _mm512_andnot_ps(sign, _mm512_loadu_ps(x + 16 * i)));
		const float m = _mm512_reduce_max_ps(amax);
		if (m == 0.0f) {
			memset(&ki, 0, sizeof ki);
			memset(q, 0, 256);
			continue;
		}
		const float iscale = -127.0f / m;
		ki.d = 1.0f / iscale;
		const __m512 vis = _mm512_set1_ps(iscale);
		const __m512 magic = _mm512_set1_ps(12582912.0f);
		const __m512i mant = _mm512_set1_epi32(0x007fffff), half = _mm512_set1_epi32(0x00400000);
		int32_t s16[16];
		for (int i = 0; i < 16; i++) {
			const __m512 t = _mm512_fmadd_ps(_mm512_loadu_ps(x + 16 * i), vis, magic);
			__m512i v = _mm512_sub_epi32(_mm512_and_si512(_mm512_castps_si512(t), mant), half);
			v = _mm512_min_epi32(v, _mm512_set1_epi32(127));
			_mm_storeu_si128((__m128i *)(q + 16 * i), _mm512_cvtsepi32_epi8(v));
			s16[i] = _mm512_reduce_add_epi32(v);
		}
		for (int i = 0; i < 16; i++) ki.b16[i] = -32 * s16[i];
		for (int j = 0; j < 8; j++) ki.s32[j] = (int16_t)(s16[2 * j] + s16[2 * j + 1]);
	}
}

MN_TARGET inline __m512i bcast(const void * p) { return _mm512_set1_epi32(*(const int32_t *)p); }

// tile computes out[r][0..15] for NR activation rows against one weight
// tile. a: the first row's quants (rows nb*cols bytes apart); info: the
// first row's block info (rows nb blocks apart); out[r]: row r's 16 outputs.
template <format F, int NR>
MN_TARGET void tile(int64_t nb, const uint8_t * w, const int8_t * a, const void * info, float * const * out) {
	const int64_t lda = nb * kBlock;
	const float * dm = (const float *)info;
	const int64_t ldd = nb * 2;
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

// tile_q4k: tile for Q4_K. Per super-block and row: d*sum_j sc_j*s_j -
// dmin*sum_j m_j*sum32_j, times the activation's d, where s_j is sub-block
// j's integer dot product.
template <int NR>
MN_TARGET void tile_q4k(int64_t nb, const uint8_t * w, const int8_t * a, const void * info, float * const * out) {
	const int64_t lda = nb * 256;
	const kinfo * ki = (const kinfo *)info;
	__m512 acc[NR];
	for (int r = 0; r < NR; r++) acc[r] = _mm512_setzero_ps();
	const __m512i m4 = _mm512_set1_epi8(0x0F);
	for (int64_t b = 0; b < nb; b++, w += tile_block_bytes<Q4K>) {
		__m512i isum[NR];
		for (int r = 0; r < NR; r++) isum[r] = _mm512_setzero_si512();
		const uint8_t * q = w + 320;
		for (int j = 0; j < 8; j++) {
			const uint8_t * qc = q + 512 * (j / 2);
			__m512i u[8];
			for (int g = 0; g < 8; g++) {
				const __m512i z = _mm512_loadu_si512(qc + 64 * g);
				u[g] = _mm512_and_si512(j % 2 ? _mm512_srli_epi16(z, 4) : z, m4);
			}
			const __m512i sc = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w + 64 + 16 * j)));
#pragma GCC unroll 8
			for (int r = 0; r < NR; r++) {
				const int8_t * g = a + r * lda + b * 256 + 32 * j;
				__m512i s = _mm512_dpbusd_epi32(_mm512_setzero_si512(), u[0], bcast(g));
				s = _mm512_dpbusd_epi32(s, u[1], bcast(g + 4));
				s = _mm512_dpbusd_epi32(s, u[2], bcast(g + 8));
				s = _mm512_dpbusd_epi32(s, u[3], bcast(g + 12));
				s = _mm512_dpbusd_epi32(s, u[4], bcast(g + 16));
				s = _mm512_dpbusd_epi32(s, u[5], bcast(g + 20));
				s = _mm512_dpbusd_epi32(s, u[6], bcast(g + 24));
				s = _mm512_dpbusd_epi32(s, u[7], bcast(g + 28));
				isum[r] = _mm512_add_epi32(isum[r], _mm512_mullo_epi32(s, sc));
			}
		}
		const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)w));
		const __m512 dmw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + 32)));
		__m512i mv[4];
		for (int p = 0; p < 4; p++) mv[p] = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(w + 192 + 32 * p)));
		for (int r = 0; r < NR; r++) {
			const kinfo & k = ki[r * nb + b];
			__m512i mn = _mm512_dpwssd_epi32(_mm512_setzero_si512(), mv[0], bcast(&k.s32[0]));
			mn = _mm512_dpwssd_epi32(mn, mv[1], bcast(&k.s32[2]));
			mn = _mm512_dpwssd_epi32(mn, mv[2], bcast(&k.s32[4]));
			mn = _mm512_dpwssd_epi32(mn, mv[3], bcast(&k.s32[6]));
			const __m512 da = _mm512_set1_ps(k.d);
			acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(dw, da), acc[r]);
			acc[r] = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mn), _mm512_mul_ps(dmw, da), acc[r]);
		}
	}
	for (int r = 0; r < NR; r++) _mm512_storeu_ps(out[r], acc[r]);
}

// tile_q4k_row: tile_q4k for a single activation row (decode), reading
// each quant byte once: both nibbles of a load feed their two sub-blocks.
MN_TARGET void tile_q4k_row(int64_t nb, const uint8_t * w, const int8_t * a, const void * info, float * const * out) {
	const kinfo * ki = (const kinfo *)info;
	__m512 acc = _mm512_setzero_ps();
	const __m512i m4 = _mm512_set1_epi8(0x0F);
	for (int64_t b = 0; b < nb; b++, w += tile_block_bytes<Q4K>) {
		const kinfo & k = ki[b];
		__m512i isum = _mm512_setzero_si512();
		for (int c = 0; c < 4; c++) {
			const uint8_t * qc = w + 320 + 512 * c;
			const int8_t * x = a + b * 256 + 64 * c;
			__m512i s0 = _mm512_setzero_si512(), s1 = _mm512_setzero_si512();
#pragma GCC unroll 8
			for (int g = 0; g < 8; g++) {
				const __m512i z = _mm512_loadu_si512(qc + 64 * g);
				s0 = _mm512_dpbusd_epi32(s0, _mm512_and_si512(z, m4), bcast(x + 4 * g));
				s1 = _mm512_dpbusd_epi32(s1, _mm512_and_si512(_mm512_srli_epi16(z, 4), m4), bcast(x + 32 + 4 * g));
			}
			const __m512i sc0 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w + 64 + 32 * c)));
			const __m512i sc1 = _mm512_cvtepu8_epi32(_mm_loadu_si128((const __m128i *)(w + 64 + 32 * c + 16)));
			isum = _mm512_add_epi32(isum, _mm512_add_epi32(_mm512_mullo_epi32(s0, sc0), _mm512_mullo_epi32(s1, sc1)));
		}
		__m512i mn = _mm512_setzero_si512();
		for (int p = 0; p < 4; p++) {
			const __m512i mv = _mm512_cvtepu8_epi16(_mm256_loadu_si256((const __m256i *)(w + 192 + 32 * p)));
			mn = _mm512_dpwssd_epi32(mn, mv, bcast(&k.s32[2 * p]));
		}
		const __m512 da = _mm512_set1_ps(k.d);
		const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)w));
		const __m512 dmw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + 32)));
		acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(dw, da), acc);
		acc = _mm512_fnmadd_ps(_mm512_cvtepi32_ps(mn), _mm512_mul_ps(dmw, da), acc);
	}
	_mm512_storeu_ps(out[0], acc);
}

// tile_q6k: tile for Q6_K. Per super-block and row: d*sum_g sc_g*(s_g -
// 32*sum16_g), times the activation's d, where s_g is the integer dot
// product of the unsigned quants over 16-column group g.
template <int NR>
MN_TARGET void tile_q6k(int64_t nb, const uint8_t * w, const int8_t * a, const void * info, float * const * out) {
	const int64_t lda = nb * 256;
	const kinfo * ki = (const kinfo *)info;
	__m512 acc[NR];
	for (int r = 0; r < NR; r++) acc[r] = _mm512_setzero_ps();
	const __m512i m4 = _mm512_set1_epi8(0x0F);
	const __m512i m30 = _mm512_set1_epi8(0x30);
	for (int64_t b = 0; b < nb; b++, w += tile_block_bytes<Q6K>) {
		__m512i isum[NR];
		for (int r = 0; r < NR; r++) isum[r] = _mm512_setzero_si512();
		// Quarter qq of half n: columns 128n+32qq.., low bits from ql's
		// low (qq 0, 1) or high (2, 3) nibbles of its first (0, 2) or
		// second (1, 3) 32 bytes, high bits from qh's bits 2qq, 2qq+1.
		for (int n = 0; n < 2; n++) {
			for (int qq = 0; qq < 4; qq++) {
				__m512i u[8];
				for (int g = 0; g < 8; g++) {
					__m512i lo = _mm512_loadu_si512(q6::ql(w, n, g + 8 * (qq & 1)));
					__m512i hi = _mm512_loadu_si512(q6::qh(w, n, g));
					if (qq >= 2) lo = _mm512_srli_epi16(lo, 4);
					switch (qq) {
					case 0: hi = _mm512_slli_epi16(hi, 4); break;
					case 1: hi = _mm512_slli_epi16(hi, 2); break;
					case 3: hi = _mm512_srli_epi16(hi, 2); break;
					}
					// (lo & 0x0F) | (hi & 0x30)
					u[g] = _mm512_or_si512(_mm512_and_si512(lo, m4), _mm512_and_si512(hi, m30));
				}
				const int g0 = 8 * n + 2 * qq;
				const __m512i sa = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + q6::sc + 16 * g0)));
				const __m512i sb = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + q6::sc + 16 * (g0 + 1))));
#pragma GCC unroll 8
				for (int r = 0; r < NR; r++) {
					const int8_t * g = a + r * lda + b * 256 + 128 * n + 32 * qq;
					const kinfo & k = ki[r * nb + b];
					__m512i s0 = _mm512_dpbusd_epi32(bcast(&k.b16[g0]), u[0], bcast(g));
					s0 = _mm512_dpbusd_epi32(s0, u[1], bcast(g + 4));
					s0 = _mm512_dpbusd_epi32(s0, u[2], bcast(g + 8));
					s0 = _mm512_dpbusd_epi32(s0, u[3], bcast(g + 12));
					__m512i s1 = _mm512_dpbusd_epi32(bcast(&k.b16[g0 + 1]), u[4], bcast(g + 16));
					s1 = _mm512_dpbusd_epi32(s1, u[5], bcast(g + 20));
					s1 = _mm512_dpbusd_epi32(s1, u[6], bcast(g + 24));
					s1 = _mm512_dpbusd_epi32(s1, u[7], bcast(g + 28));
					isum[r] = _mm512_add_epi32(isum[r], _mm512_add_epi32(_mm512_mullo_epi32(s0, sa), _mm512_mullo_epi32(s1, sb)));
				}
			}
		}
		const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + q6::d)));
		for (int r = 0; r < NR; r++) {
			const __m512 da = _mm512_set1_ps(ki[r * nb + b].d);
			acc[r] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum[r]), _mm512_mul_ps(dw, da), acc[r]);
		}
	}
	for (int r = 0; r < NR; r++) _mm512_storeu_ps(out[r], acc[r]);
}

// tile_q6k_row: tile_q6k for a single activation row (decode). It reads
// each quant byte once, in address order, and keeps eight sums (four
// quarters by two 16-column groups); tile_q6k instead unpacks a quarter at
// a time, so that many rows share the unpacking, and revisits each qh byte
// four times, which halved its speed from memory on one row.
MN_TARGET void tile_q6k_row(int64_t nb, const uint8_t * w, const int8_t * a, const void * info, float * const * out) {
	const kinfo * ki = (const kinfo *)info;
	__m512 acc = _mm512_setzero_ps();
	const __m512i m4 = _mm512_set1_epi8(0x0F);
	const __m512i m30 = _mm512_set1_epi8(0x30);
	// (x & 0x0F) | y, for y without bits in 0x0F
	constexpr int lo_or = 0xEC; // (A & C) | B, C = m4: bit a*4+b*2+c of the table
	for (int64_t b = 0; b < nb; b++, w += tile_block_bytes<Q6K>) {
		const kinfo & k = ki[b];
		__m512i isum = _mm512_setzero_si512();
		for (int n = 0; n < 2; n++) {
			const int8_t * x = a + b * 256 + 128 * n;
			__m512i s[8]; // [quarter][16-column group]
			for (int i = 0; i < 8; i++) s[i] = bcast(&k.b16[8 * n + i]);
#pragma GCC unroll 8
			for (int g = 0; g < 8; g++) {
				const __m512i lo0 = _mm512_loadu_si512(q6::ql(w, n, g));
				const __m512i lo1 = _mm512_loadu_si512(q6::ql(w, n, g + 8));
				const __m512i h = _mm512_loadu_si512(q6::qh(w, n, g));
				const __m512i u0 = _mm512_ternarylogic_epi32(lo0, _mm512_and_si512(_mm512_slli_epi16(h, 4), m30), m4, lo_or);
				const __m512i u1 = _mm512_ternarylogic_epi32(lo1, _mm512_and_si512(_mm512_slli_epi16(h, 2), m30), m4, lo_or);
				const __m512i u2 = _mm512_ternarylogic_epi32(_mm512_srli_epi16(lo0, 4), _mm512_and_si512(h, m30), m4, lo_or);
				const __m512i u3 = _mm512_ternarylogic_epi32(_mm512_srli_epi16(lo1, 4), _mm512_and_si512(_mm512_srli_epi16(h, 2), m30), m4, lo_or);
				const int half = g / 4;
				s[0 + half] = _mm512_dpbusd_epi32(s[0 + half], u0, bcast(x + 4 * g));
				s[2 + half] = _mm512_dpbusd_epi32(s[2 + half], u1, bcast(x + 32 + 4 * g));
				s[4 + half] = _mm512_dpbusd_epi32(s[4 + half], u2, bcast(x + 64 + 4 * g));
				s[6 + half] = _mm512_dpbusd_epi32(s[6 + half], u3, bcast(x + 96 + 4 * g));
			}
			for (int i = 0; i < 8; i++) {
				const __m512i sc = _mm512_cvtepi8_epi32(_mm_loadu_si128((const __m128i *)(w + q6::sc + 16 * (8 * n + i))));
				isum = _mm512_add_epi32(isum, _mm512_mullo_epi32(s[i], sc));
			}
		}
		const __m512 dw = _mm512_cvtph_ps(_mm256_loadu_si256((const __m256i *)(w + q6::d)));
		acc = _mm512_fmadd_ps(_mm512_cvtepi32_ps(isum), _mm512_mul_ps(dw, _mm512_set1_ps(k.d)), acc);
	}
	_mm512_storeu_ps(out[0], acc);
}

typedef void (*tile_fn)(int64_t, const uint8_t *, const int8_t *, const void *, float * const *);

template <format F, int NR>
constexpr tile_fn tile_of() {
	if constexpr (F == Q4K) return NR == 1 ? tile_q4k_row : tile_q4k<NR>;
	else if constexpr (F == Q6K) return NR == 1 ? tile_q6k_row : tile_q6k<NR>;
	else return tile<F, NR>;
}

template <format F>
const tile_fn tiles[kRows + 1] = {nullptr, tile_of<F, 1>(), tile_of<F, 2>(), tile_of<F, 3>(), tile_of<F, 4>(), tile_of<F, 5>(), tile_of<F, 6>(), tile_of<F, 7>(), tile_of<F, 8>()};

template <format F>
void quantize(const float * x, int64_t k, int8_t * q, void * info) {
	if constexpr (kquant(F)) quantize_row_k(x, k, q, (kinfo *)info);
	else quantize_row(x, k, bias<F>, q, (float *)info);
}

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

template <format F>
act_layout layout_of(const ggml_tensor * op) {
	const ggml_tensor * src1 = op->src[1];
	act_layout l;
	l.rows = src1->ne[1] * src1->ne[2] * src1->ne[3];
	l.k = src1->ne[0];
	l.nb = l.k / block_cols<F>;
	l.info_bytes = kquant(F) ? sizeof(kinfo) : 2 * sizeof(float);
	return l;
}

template <format F>
class x16_traits : public ggml::cpu::tensor_traits {
	bool work_size(int, const ggml_tensor * op, size_t & size) override {
		size = layout_of<F>(op).size();
		return true;
	}

	bool compute_forward(ggml_compute_params * params, ggml_tensor * op) override {
		if (op->op != GGML_OP_MUL_MAT) return false;
		const ggml_tensor * src0 = op->src[0];
		const ggml_tensor * src1 = op->src[1];
		const int ith = params->ith, nth = params->nth;
		const act_layout l = layout_of<F>(op);
		void * w = params->wdata;

		for (int64_t r = ith; r < l.rows; r += nth) {
			quantize<F>(src_row(src1, r), l.k, l.q(w, r), l.info(w, r));
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
		const size_t tbytes = (size_t)l.nb * tile_block_bytes<F>;
		float * outs[kRows];
		for (int64_t c = ith; c < nchunks; c = ggml_threadpool_chunk_add(params->threadpool, 1)) {
			const int64_t tc = c % ntc, rb = c / ntc;
			const int64_t t0 = tc * tiles_per_chunk, t1 = std::min(ntiles, t0 + tiles_per_chunk);
			const int64_t r0 = rb * rows_per_block, r1 = std::min(l.rows, r0 + rows_per_block);
			for (int64_t t = t0; t < t1; t++) {
				const uint8_t * wt = wbase + (size_t)t * tbytes;
				for (int64_t r = r0; r < r1; r += kRows) {
					const int nr = (int)std::min<int64_t>(kRows, r1 - r);
					for (int i = 0; i < nr; i++) outs[i] = dst_row(op, r + i) + t * kTile;
					tiles<F>[nr](l.nb, wt, l.q(w, r), l.info(w, r), outs);
				}
			}
		}
		return true;
	}
};

x16_traits<Q4> q4_traits;
x16_traits<Q8> q8_traits;
x16_traits<Q4K> q4k_traits;
x16_traits<Q6K> q6k_traits;

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
		case GGML_TYPE_Q4_K: return &q4k_traits;
		case GGML_TYPE_Q6_K: return &q6k_traits;
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

// pack writes t's ggml-layout bytes src into dst in the kernel's layout.
template <format F>
void pack(const ggml_tensor * t, const uint8_t * src, uint8_t * dst) {
	constexpr size_t native = native_block_bytes<F>;
	const int64_t k = t->ne[0], n = t->ne[1], nb = k / block_cols<F>;
	const size_t row_bytes = (size_t)nb * native;
	for (int64_t tt = 0; tt < n / kTile; tt++) {
		for (int64_t b = 0; b < nb; b++) {
			uint8_t * p = dst + ((size_t)tt * nb + b) * tile_block_bytes<F>;
			for (int r = 0; r < kTile; r++) {
				const uint8_t * s = src + (size_t)(tt * kTile + r) * row_bytes + (size_t)b * native;
				if constexpr (F == Q4) {
					memcpy(p + 2 * r, s, 2);
					for (int j = 0; j < 4; j++) memcpy(p + 32 + 64 * j + 4 * r, s + 2 + 4 * j, 4);
				} else if constexpr (F == Q8) {
					memcpy(p + 2 * r, s, 2);
					for (int j = 0; j < 8; j++) {
						for (int i = 0; i < 4; i++) p[32 + 64 * j + 4 * r + i] = (uint8_t)(s[2 + 4 * j + i] ^ 0x80);
					}
				} else if constexpr (F == Q4K) {
					// block_q4_K: d, dmin, 12 bytes of 6-bit scales and
					// mins (ggml's get_scale_min_k4), 128 quant bytes.
					memcpy(p + 2 * r, s, 2);
					memcpy(p + 32 + 2 * r, s + 2, 2);
					const uint8_t * sm = s + 4;
					for (int j = 0; j < 8; j++) {
						uint8_t sc, m;
						if (j < 4) {
							sc = sm[j] & 63;
							m = sm[j + 4] & 63;
						} else {
							sc = (sm[j + 4] & 0xF) | ((sm[j - 4] >> 6) << 4);
							m = (sm[j + 4] >> 4) | ((sm[j] >> 6) << 4);
						}
						p[64 + 16 * j + r] = sc;
						p[192 + 32 * (j / 2) + 2 * r + j % 2] = m;
					}
					for (int c = 0; c < 4; c++) {
						for (int g = 0; g < 8; g++) memcpy(p + 320 + 512 * c + 64 * g + 4 * r, s + 16 + 32 * c + 4 * g, 4);
					}
				} else {
					// block_q6_K: ql[128], qh[64], scales[16], d.
					memcpy(p + q6::d + 2 * r, s + 208, 2);
					for (int g = 0; g < 16; g++) p[q6::sc + 16 * g + r] = s[192 + g];
					for (int h = 0; h < 2; h++) {
						for (int j = 0; j < 16; j++) memcpy((uint8_t *)q6::ql(p, h, j) + 4 * r, s + 64 * h + 4 * j, 4);
						for (int g = 0; g < 8; g++) memcpy((uint8_t *)q6::qh(p, h, g) + 4 * r, s + 128 + 32 * h + 4 * g, 4);
					}
				}
			}
		}
	}
}

// packed_bytes is the size of t in the kernel's layout, 0 when t cannot
// take it.
template <format F>
size_t packed_bytes(const ggml_tensor * t) {
	if (ggml_n_dims(t) != 2 || t->ne[0] % block_cols<F> != 0 || t->ne[1] % kTile != 0) return 0;
	return (size_t)(t->ne[1] / kTile) * (size_t)(t->ne[0] / block_cols<F>) * tile_block_bytes<F>;
}

size_t packed_bytes(const ggml_tensor * t) {
	switch (t->type) {
	case GGML_TYPE_Q4_0: return packed_bytes<Q4>(t);
	case GGML_TYPE_Q8_0: return packed_bytes<Q8>(t);
	case GGML_TYPE_Q4_K: return packed_bytes<Q4K>(t);
	case GGML_TYPE_Q6_K: return packed_bytes<Q6K>(t);
	default: return 0;
	}
}

} // namespace

extern "C" {

int meshnode_x16_cpu(void) { return cpu_ok(); }

int meshnode_x16_register(void) { return registered(); }

int meshnode_x16_ok(const struct ggml_tensor * t) {
	return packed_bytes(t) != 0 && registered();
}

ggml_backend_buffer_t meshnode_x16_take(struct ggml_tensor * t, const void * data) {
	if (!meshnode_x16_ok(t)) return nullptr;
	ggml_backend_buffer_t buf = ggml_backend_buft_alloc_buffer(x16_buft(), packed_bytes(t));
	if (buf == nullptr) return nullptr;
	ggml_backend_buffer_set_usage(buf, GGML_BACKEND_BUFFER_USAGE_WEIGHTS);
	t->buffer = nullptr;
	t->data = nullptr;
	if (ggml_backend_tensor_alloc(buf, t, ggml_backend_buffer_get_base(buf)) != GGML_STATUS_SUCCESS) {
		ggml_backend_buffer_free(buf);
		return nullptr;
	}
	meshnode_advise_huge(t->data, packed_bytes(t));
	switch (t->type) {
	case GGML_TYPE_Q4_0: pack<Q4>(t, (const uint8_t *)data, (uint8_t *)t->data); break;
	case GGML_TYPE_Q8_0: pack<Q8>(t, (const uint8_t *)data, (uint8_t *)t->data); break;
	case GGML_TYPE_Q4_K: pack<Q4K>(t, (const uint8_t *)data, (uint8_t *)t->data); break;
	default: pack<Q6K>(t, (const uint8_t *)data, (uint8_t *)t->data); break;
	}
	return buf;
}

} // extern "C"

// meshnode_x16_check multiplies a random [k, n] weight of type (Q4_0,
// Q8_0, Q4_K or Q6_K) by a random [k, m] activation on ggml's CPU backend twice, once
// with the weight in X16 and once in ggml's plain layout, and returns
// max|a-b| / max|b|; -1 when the kernel cannot run here. Tests use it to check the kernel on shapes
// (row tails, several row blocks, thread counts) that models rarely hit.
// With iters > 0 it also times iters more computes of each after the
// first and writes the mean seconds per compute into secs[0] (X16) and
// secs[1] (ggml) for the benchmark.
extern "C" double meshnode_x16_check(int type, int k, int n, int m, int threads, unsigned seed, int iters, double * secs) {
	const ggml_type wt = (ggml_type)type;
	if (!registered() || (wt != GGML_TYPE_Q4_0 && wt != GGML_TYPE_Q8_0 && wt != GGML_TYPE_Q4_K && wt != GGML_TYPE_Q6_K)) return -1;
	if (k % ggml_blck_size(wt) != 0 || n % kTile != 0) return -1;
	const size_t native = ggml_type_size(wt);
	// Where each block keeps its f16 scales; any other bytes are valid.
	std::vector<size_t> halves = {0};
	if (wt == GGML_TYPE_Q4_K) halves = {0, 2};
	if (wt == GGML_TYPE_Q6_K) halves = {208};
	uint64_t state = seed * 0x9E3779B97F4A7C15ull + 1;
	auto next = [&state]() {
		state ^= state << 13;
		state ^= state >> 7;
		state ^= state << 17;
		return state;
	};
	const size_t nb = (size_t)k / ggml_blck_size(wt);
	std::vector<uint8_t> wq((size_t)n * nb * native);
	for (size_t i = 0; i < (size_t)n * nb; i++) {
		for (size_t j = 0; j < native; j++) {
			uint8_t v = (uint8_t)next();
			if (wt == GGML_TYPE_Q8_0 && v == 0x80) v = 0x81; // Q8_0 quants are -127..127
			wq[i * native + j] = v;
		}
		for (size_t h : halves) {
			const ggml_fp16_t d = ggml_fp32_to_fp16(0.001f + (float)(next() % 1000) * 1e-5f);
			memcpy(&wq[i * native + h], &d, 2);
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
		bool ok = (pass == 1 || own != nullptr) && ggml_backend_graph_compute(be, g) == GGML_STATUS_SUCCESS;
		if (ok && iters > 0) {
			const auto t0 = std::chrono::steady_clock::now();
			for (int i = 0; i < iters && ok; i++) ok = ggml_backend_graph_compute(be, g) == GGML_STATUS_SUCCESS;
			secs[pass] = std::chrono::duration<double>(std::chrono::steady_clock::now() - t0).count() / iters;
		}
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
