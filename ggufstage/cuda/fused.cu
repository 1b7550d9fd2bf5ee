// The fused decode path (see fused.h). Built by deploy/gpu/build-cuda.sh
// into libmeshnode-fused.so, which ggufstage loads at run time.
#include "fused.h"

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <new>

namespace {

// The mat-vec kernels: a block or two per multiprocessor (see below). Each
// warp works alone after the input is quantized: it copies whole rows (or
// 32 super-blocks of one) into its own shared memory with coalesced 16-byte
// loads, all in flight together, and each lane then takes one super-block
// of 256 weights from there. Quantized blocks of 18 or 210 bytes cannot be
// read by lanes directly without splitting every load.
// Two shapes (run 50, 8B Q4_0 on an H200): two blocks of 256 threads for
// the mat-vecs of n_embd columns (qkv 7.4 against 8.4 us, o, gate+up);
// one block of 512, which halves the blocks that each quantize the input,
// for down's 14336 columns (12.1 against 13.2 us) and the Q6_K head (131
// against 138 us).
constexpr int kThreads = 256, kWideThreads = 512; // kThreads: the narrow shape
__host__ __device__ constexpr int blocksOf(int threads) { return 512 / threads; } // per multiprocessor
// Attention: up to kSplits blocks per head share a sequence's cells,
// kCellsPerSplit (MESHNODE_FUSED_ATTN_CELLS) or more each.
constexpr int kSplits = 32;
constexpr int kU = 8; // cells a warp loads at once
constexpr int kCellsPerSplit = 64;
constexpr int kAttnThreads = 256;
constexpr int kParams = 4; // pos, loc, n, token; then the cells

constexpr int kQ4Bytes = 18;   // Q4_0: f16 scale, 16 bytes of nibbles, 32 weights
constexpr int kQ6Bytes = 210;  // Q6_K: 128 ql, 64 qh, 16 scales, f16 d; 256 weights

void errf(char *err, int errlen, const char *fmt, ...) {
	if (!err || errlen <= 0) return;
	va_list ap;
	va_start(ap, fmt);
	vsnprintf(err, (size_t)errlen, fmt, ap);
	va_end(ap);
}

__host__ __device__ size_t rowBytes(int type, int k) {
	switch (type) {
	case MF_Q4_0: return (size_t)k / 32 * kQ4Bytes;
	case MF_Q6_K: return (size_t)k / 256 * kQ6Bytes;
	case MF_F16: return (size_t)k * 2;
	case MF_F32: return (size_t)k * 4;
	}
	return 0;
}

enum Epi { kStore, kAdd, kSwiGLU };

struct GemvArgs {
	const uint8_t *w[3]; // up to three matrices sharing the input (q, k, v)
	int rows[3];
	int nmat;
	int total;   // rows of all matrices; for kSwiGLU gate and up interleave
	int k;       // columns
	int rowBytes;
	int type;    // MF_Q4_0 or MF_Q6_K
	int sbBytes; // bytes of a super-block of 256 weights
	int spr;     // super-blocks per row
	int group;   // lanes per row: min(spr, 32)
	int rpp;     // rows a warp takes at once
	int passes;  // passes per row: spr over 32, rounded up
	int unitRows; // rows a warp takes per unit of work: rpp, or 2 for SwiGLU
	int stageBytes;
	int copyBytes; // 16, or for Q6_K rows that are not 16-byte aligned 8 or 4 (copyWidth)
	const float *x;
	const float *norm; // RMS norm weights applied to x first, or null
	const float *bias[3]; // kStore: each matrix's bias (q, k, v), or null
	int normDirect;    // read norm from global memory, not a shared copy (see placeNorm)
	int late;          // issue the first weight copies after the input's loads, not before pdlWait
	float eps;
	float *y;
	int epi;
	int threads; // the block's: kThreads or kWideThreads (gemvShape)
	int debug; // mf_profile: 1 skips the input's quantization, 2 the dot products
};

// Constant indices only: indexing the kernel's parameter arrays with a
// variable copies them to local memory, which the large shared-memory
// carve-out leaves no L1 to cache.
__device__ __forceinline__ const uint8_t *rowPtr(const GemvArgs &a, int r) {
	if (a.epi == kSwiGLU) return ((r & 1) ? a.w[1] : a.w[0]) + (size_t)(r >> 1) * a.rowBytes;
	if (r < a.rows[0]) return a.w[0] + (size_t)r * a.rowBytes;
	r -= a.rows[0];
	if (r < a.rows[1] || a.nmat < 3) return a.w[1] + (size_t)r * a.rowBytes;
	return a.w[2] + (size_t)(r - a.rows[1]) * a.rowBytes;
}

// The bias of row r of the matrices, 0 without biases (constant indices, as
// rowPtr).
__device__ __forceinline__ float biasAt(const GemvArgs &a, int r) {
	if (!a.bias[0]) return 0.f;
	if (r < a.rows[0]) return a.bias[0][r];
	r -= a.rows[0];
	if (r < a.rows[1]) return a.bias[1][r];
	return a.bias[2][r - a.rows[1]];
}

__device__ __forceinline__ float warpSum(float v) {
	for (int o = 16; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
	return v;
}

__device__ __forceinline__ float halfAt(const uint8_t *p) {
	return __half2float(*reinterpret_cast<const __half *>(p));
}

__device__ __forceinline__ uint32_t u32At2(const uint8_t *p) { // 2-byte aligned
	const uint16_t *h = reinterpret_cast<const uint16_t *>(p);
	return (uint32_t)h[0] | ((uint32_t)h[1] << 16);
}

// The quantized input in shared memory, a super-block (256 values, sixteen
// 16-byte chunks) at a time, with its chunks and block scales permuted by
// the super-block's index: the lanes of a warp read the same chunk of
// different super-blocks, which would otherwise all sit in one bank.
__device__ __forceinline__ const int8_t *xqChunk(const int8_t *xq, int sb, int c) {
	return xq + sb * 256 + ((c ^ (sb & 15)) << 4);
}
__device__ __forceinline__ float2 xdsAt(const float2 *xds, int sb, int b) { return xds[sb * 8 + (b ^ (sb & 7))]; }

// Programmatic dependent launch: a kernel may start while the one before it
// finishes; it copies weights (which nothing writes) before waiting for the
// earlier kernel's results.
__device__ __forceinline__ void pdlWait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }
__device__ __forceinline__ void pdlLaunchNext() { asm volatile("griddepcontrol.launch_dependents;\n" ::); }

constexpr int kHeld = 4; // half-blocks of 16 a thread holds while normalizing: embd <= 16384

// Quantizes 16 values, half hg of a block of 32 whose other half the
// neighbouring lane holds, as ggml's q8_1 does for its mat-vec.
__device__ __forceinline__ void quantizeHalf(const float (&v)[16], int hg, bool store, int8_t *xq, float2 *xds) {
	float amax = 0.f;
#pragma unroll
	for (int i = 0; i < 16; i++) amax = fmaxf(amax, fabsf(v[i]));
	amax = fmaxf(amax, __shfl_xor_sync(0xffffffffu, amax, 1));
	const float d = amax / 127.f;
	const float id = d > 0.f ? 1.f / d : 0.f;
	int sum = 0, packed[4];
#pragma unroll
	for (int i = 0; i < 4; i++) {
		const int q0 = __float2int_rn(v[4 * i] * id), q1 = __float2int_rn(v[4 * i + 1] * id);
		const int q2 = __float2int_rn(v[4 * i + 2] * id), q3 = __float2int_rn(v[4 * i + 3] * id);
		sum += q0 + q1 + q2 + q3;
		packed[i] = (q0 & 0xff) | ((q1 & 0xff) << 8) | ((q2 & 0xff) << 16) | ((q3 & 0xff) << 24);
	}
	sum += __shfl_xor_sync(0xffffffffu, sum, 1);
	if (!store) return;
	const int sb = hg >> 4, c = hg & 15;
	*reinterpret_cast<int4 *>(const_cast<int8_t *>(xqChunk(xq, sb, c))) = make_int4(packed[0], packed[1], packed[2], packed[3]);
	if (!(c & 1)) xds[sb * 8 + ((c >> 1) ^ (sb & 7))] = make_float2(d, d * (float)sum);
}

__device__ __forceinline__ void load16(const float *p, float (&v)[16]) {
#pragma unroll
	for (int i = 0; i < 4; i++) {
		const float4 t = *reinterpret_cast<const float4 *>(p + 4 * i);
		v[4 * i] = t.x, v[4 * i + 1] = t.y, v[4 * i + 2] = t.z, v[4 * i + 3] = t.w;
	}
}

// Quantizes the (RMS-normalized) input to int8 in blocks of 32 into shared
// memory: xq, and per block its scale and the scale times the sum of its
// integers. Each thread takes 16 contiguous values, so the loads coalesce.
// afterLoads runs once the input's loads are issued and before their
// values are used (see GemvArgs.late).
template <int THREADS, typename F>
__device__ void quantizeInput(const GemvArgs &a, int8_t *xq, float2 *xds, float *red, const float *normS, F afterLoads) {
	constexpr int kThreads = THREADS, kWarps = THREADS / 32;
	const int halves = a.k / 16;
	const int iters = (halves + kThreads - 1) / kThreads; // the same for every thread: the shuffles need all
	if (!a.norm) {
		// kHeld halves' loads in flight at once, not one L2 round trip each.
		for (int i0 = 0; i0 < iters; i0 += kHeld) {
			float v[kHeld][16];
#pragma unroll
			for (int i = 0; i < kHeld; i++) {
				const int hg = threadIdx.x + kThreads * (i0 + i);
				if (hg < halves) load16(a.x + hg * 16, v[i]);
			}
			if (i0 == 0) afterLoads();
#pragma unroll
			for (int i = 0; i < kHeld; i++) {
				if (i0 + i >= iters) break;
				const int hg = threadIdx.x + kThreads * (i0 + i);
				quantizeHalf(v[i], hg, hg < halves, xq, xds);
			}
		}
		__syncthreads();
		return;
	}
	float v[kHeld][16];
	float ss = 0.f;
#pragma unroll
	for (int i = 0; i < kHeld; i++) {
		const int hg = threadIdx.x + kThreads * i;
		if (hg < halves) load16(a.x + hg * 16, v[i]);
	}
	afterLoads();
#pragma unroll
	for (int i = 0; i < kHeld; i++) {
		const int hg = threadIdx.x + kThreads * i;
		if (hg < halves) {
#pragma unroll
			for (int j = 0; j < 16; j++) ss += v[i][j] * v[i][j];
		}
	}
	ss = warpSum(ss);
	if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = ss;
	__syncthreads();
	float total = 0.f;
#pragma unroll
	for (int w = 0; w < kWarps; w++) total += red[w];
	const float scale = rsqrtf(total / (float)a.k + a.eps);
#pragma unroll
	for (int i = 0; i < kHeld; i++) {
		if (i >= iters) break;
		const int hg = threadIdx.x + kThreads * i;
		float n[16] = {};
		if (hg < halves) load16(normS + hg * 16, n);
#pragma unroll
		for (int j = 0; j < 16; j++) v[i][j] = v[i][j] * scale * n[j];
		quantizeHalf(v[i], hg, hg < halves, xq, xds);
	}
	__syncthreads();
}

// A Q4_0 super-block (eight blocks, 144 bytes, W its 36 words) against
// super-block sb of the input.
__device__ __forceinline__ float dotQ4SB(const uint32_t (&W)[36], int sb, const int8_t *xq, const float2 *xds) {
	float acc = 0.f;
#pragma unroll
	for (int j = 0; j < 4; j++) { // blocks 2j (bytes 36j..) and 2j+1 (36j+18..)
		const uint32_t w0 = W[9 * j], w1 = W[9 * j + 1], w2 = W[9 * j + 2], w3 = W[9 * j + 3], w4 = W[9 * j + 4];
		const float d0 = __half2float(__ushort_as_half((unsigned short)(w0 & 0xffff)));
		const float d1 = __half2float(__ushort_as_half((unsigned short)(w4 >> 16)));
		const uint32_t qa[4] = {__byte_perm(w0, w1, 0x5432), __byte_perm(w1, w2, 0x5432), __byte_perm(w2, w3, 0x5432),
		                        __byte_perm(w3, w4, 0x5432)};
		const uint32_t qb[4] = {W[9 * j + 5], W[9 * j + 6], W[9 * j + 7], W[9 * j + 8]};
		const int4 xa = *reinterpret_cast<const int4 *>(xqChunk(xq, sb, 4 * j));
		const int4 xb = *reinterpret_cast<const int4 *>(xqChunk(xq, sb, 4 * j + 1));
		const int4 xc = *reinterpret_cast<const int4 *>(xqChunk(xq, sb, 4 * j + 2));
		const int4 xd = *reinterpret_cast<const int4 *>(xqChunk(xq, sb, 4 * j + 3));
		const int x0[8] = {xa.x, xa.y, xa.z, xa.w, xb.x, xb.y, xb.z, xb.w};
		const int x1[8] = {xc.x, xc.y, xc.z, xc.w, xd.x, xd.y, xd.z, xd.w};
		int s0 = 0, s1 = 0;
#pragma unroll
		for (int i = 0; i < 4; i++) {
			s0 = __dp4a((int)(qa[i] & 0x0f0f0f0fu), x0[i], s0);
			s0 = __dp4a((int)((qa[i] >> 4) & 0x0f0f0f0fu), x0[i + 4], s0);
			s1 = __dp4a((int)(qb[i] & 0x0f0f0f0fu), x1[i], s1);
			s1 = __dp4a((int)((qb[i] >> 4) & 0x0f0f0f0fu), x1[i + 4], s1);
		}
		const float2 e0 = xdsAt(xds, sb, 2 * j), e1 = xdsAt(xds, sb, 2 * j + 1);
		acc += d0 * (e0.x * (float)s0 - 8.f * e0.y) + d1 * (e1.x * (float)s1 - 8.f * e1.y);
	}
	return acc;
}

// Half (128 weights) of a Q6_K block against the input from weight base on.
__device__ __forceinline__ float dotQ6Half(const uint8_t *blk, int half, int sb, const int8_t *xq,
                                           const float2 *xds) {
	const uint8_t *ql = blk + 64 * half;
	const uint8_t *qh = blk + 128 + 32 * half;
	const int8_t *sc = reinterpret_cast<const int8_t *>(blk + 192 + 8 * half);
	const float d = halfAt(blk + 208);
	// The input's int at byte o of this half.
	auto xi = [&](int o) {
		o += 128 * half;
		return *reinterpret_cast<const int *>(xqChunk(xq, sb, o >> 4) + (o & 15));
	};
	int s[4][2] = {{0, 0}, {0, 0}, {0, 0}, {0, 0}};
#pragma unroll
	for (int l = 0; l < 32; l += 4) {
		const uint32_t qa = u32At2(ql + l), qb = u32At2(ql + l + 32), h = u32At2(qh + l);
		const int g = l >> 4;
		const int v0 = (int)__vsubss4((qa & 0x0f0f0f0fu) | ((h << 4) & 0x30303030u), 0x20202020u);
		const int v1 = (int)__vsubss4((qb & 0x0f0f0f0fu) | ((h << 2) & 0x30303030u), 0x20202020u);
		const int v2 = (int)__vsubss4(((qa >> 4) & 0x0f0f0f0fu) | (h & 0x30303030u), 0x20202020u);
		const int v3 = (int)__vsubss4(((qb >> 4) & 0x0f0f0f0fu) | ((h >> 2) & 0x30303030u), 0x20202020u);
		s[0][g] = __dp4a(v0, xi(l), s[0][g]);
		s[1][g] = __dp4a(v1, xi(32 + l), s[1][g]);
		s[2][g] = __dp4a(v2, xi(64 + l), s[2][g]);
		s[3][g] = __dp4a(v3, xi(96 + l), s[3][g]);
	}
	float acc = 0.f;
#pragma unroll
	for (int m = 0; m < 4; m++) {
		const float d8 = xdsAt(xds, sb, 4 * half + m).x;
		acc += d8 * ((float)sc[2 * m] * (float)s[m][0] + (float)sc[2 * m + 1] * (float)s[m][1]);
	}
	return d * acc;
}

__device__ __forceinline__ void cpAsync16(void *dst, const void *src) {
	const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
	asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src));
}
// Copies of 8 or 4 bytes (cached in L1 too: .cg takes only 16).
template <int N> __device__ __forceinline__ void cpAsyncCA(void *dst, const void *src) {
	const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
	asm volatile("cp.async.ca.shared.global [%0], [%1], %2;\n" ::"r"(d), "l"(src), "n"(N));
}
__device__ __forceinline__ void cpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cpAsyncWait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Each warp walks its steps (unit, round of rpp rows, pass over up to 32
// super-blocks of each) with the next step's copy in flight (cp.async into
// the warp's other stage buffer) while it computes the current one.
// COPY: the bytes of each copy (a.copyBytes), a template argument: one
// kernel with the three copy loops ran the Q6_K head at 192 us, not 131.
template <int TYPE, int THREADS, int COPY>
__global__ void __launch_bounds__(THREADS, blocksOf(THREADS)) gemv(GemvArgs a) {
	constexpr int kThreads = THREADS, kWarps = THREADS / 32;
	constexpr int kMaxChunks = TYPE == MF_Q4_0 ? 9 : 14; // 16-byte copies a lane makes per step
	extern __shared__ __align__(16) uint8_t smem[];
	const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
	uint8_t *stages = smem + warp * 2 * a.stageBytes;
	int8_t *xq = reinterpret_cast<int8_t *>(smem + kWarps * 2 * a.stageBytes);
	float2 *xds = reinterpret_cast<float2 *>(xq + a.k);
	float *red = reinterpret_cast<float *>(xds + a.k / 32);
	float *normS = red + 16; // the norm's weights, copied before the wait: k floats

	const int slotStride = a.group * a.sbBytes;
	const int units = (a.total + a.unitRows - 1) / a.unitRows;
	const int mySlot = lane / a.group, myIdx = lane % a.group;
	const int rounds = (a.unitRows + a.rpp - 1) / a.rpp;
	const int perUnit = rounds * a.passes;
	const int first = blockIdx.x * kWarps + warp, stride = gridDim.x * kWarps;
	const int mine0 = first < units ? (units - first + stride - 1) / stride : 0;
	const int steps = mine0 * perUnit;

	// Lane myIdx of slot mySlot's group copies chunks myIdx, myIdx+group, ...
	// of its row: a group's copies are contiguous, one add apart.
	auto issue = [&](int k) {
		if (k < steps && mySlot < a.rpp) {
			const int unit = first + (k / perUnit) * stride, rp = k % perUnit;
			const int round = rp / a.passes, pass = rp % a.passes;
			const int v = min(unit * a.unitRows + round * a.rpp + mySlot, a.total - 1);
			const int bytes = min(32, a.spr - pass * 32) * a.sbBytes;
			const uint8_t *src = rowPtr(a, v) + (size_t)pass * 32 * a.sbBytes;
			uint8_t *dst = stages + (k & 1) * a.stageBytes + mySlot * slotStride;
			if constexpr (COPY == 16) {
#pragma unroll
				for (int i = 0; i < kMaxChunks; i++) {
					const int c = myIdx + a.group * i;
					if (c < bytes / 16) cpAsync16(dst + 16 * c, src + 16 * c);
				}
			} else { // Q6_K rows that are not 16-byte aligned (copyWidth)
#pragma unroll
				for (int i = 0; i < (kQ6Bytes + COPY - 1) / COPY; i++) {
					const int c = myIdx + a.group * i;
					if (c < bytes / COPY) cpAsyncCA<COPY>(dst + COPY * c, src + COPY * c);
				}
			}
		}
		cpAsyncCommit();
	};
	const bool normShared = a.norm && !a.normDirect;
	if (normShared) {
		for (int i = threadIdx.x; i < a.k / 4; i += kThreads) cpAsync16(normS + 4 * i, a.norm + 4 * i);
		cpAsyncCommit();
	}
	// Step 0's copy goes in flight while the kernel before finishes, or
	// (late) only once the input's loads are issued, so that those do not
	// queue behind a multiprocessor's worth of weight copies.
	if (!a.late) issue(0);
	pdlLaunchNext();
	pdlWait();
	auto afterLoads = [&]() {
		if (a.late) issue(0);
		if (normShared) {
			cpAsyncWait<1>(); // the norm's copy, committed before step 0's
			__syncthreads();
		}
	};
	if (a.debug & 1)
		afterLoads();
	else
		quantizeInput<THREADS>(a, xq, xds, red, a.normDirect ? a.norm : normS, afterLoads);

	float acc = 0.f, mine = 0.f; // lane i ends a unit with the sum of its row i
	for (int k = 0; k < steps; k++) {
		issue(k + 1);
		cpAsyncWait<1>();
		__syncwarp();
		const int unit = first + (k / perUnit) * stride, rp = k % perUnit;
		const int round = rp / a.passes, pass = rp % a.passes;
		const int sbs = min(32, a.spr - pass * 32);
		if (mySlot < a.rpp && myIdx < sbs && !(a.debug & 2)) {
			const int sb = pass * 32 + myIdx;
			const uint8_t *w = stages + (k & 1) * a.stageBytes + mySlot * slotStride + myIdx * a.sbBytes;
			if constexpr (TYPE == MF_Q4_0) {
				uint32_t W[36];
#pragma unroll
				for (int i = 0; i < 9; i++) {
					const uint4 t = reinterpret_cast<const uint4 *>(w)[i];
					W[4 * i] = t.x, W[4 * i + 1] = t.y, W[4 * i + 2] = t.z, W[4 * i + 3] = t.w;
				}
				acc += dotQ4SB(W, sb, xq, xds);
			} else {
				acc += dotQ6Half(w, 0, sb, xq, xds) + dotQ6Half(w, 1, sb, xq, xds);
			}
		}
		__syncwarp(); // the stage is copied into again by the next step's issue
		if (pass < a.passes - 1) continue;
		for (int sl = 0; sl < a.rpp; sl++) {
			const float t = warpSum(mySlot == sl ? acc : 0.f);
			if (lane == round * a.rpp + sl) mine = t;
		}
		acc = 0.f;
		if (round < rounds - 1) continue;
		const int v = unit * a.unitRows + lane;
		if (a.epi == kSwiGLU) {
			const float up = __shfl_down_sync(0xffffffffu, mine, 1);
			if (lane < a.unitRows && !(lane & 1) && v < a.total) a.y[v >> 1] = mine / (1.f + __expf(-mine)) * up;
		} else if (lane < a.unitRows && v < a.total) {
			if (a.epi == kAdd)
				a.y[v] += mine;
			else
				a.y[v] = mine + biasAt(a, v);
		}
	}
	cpAsyncWait<0>();
}

// D consecutive halves (D*2 bytes, so aligned) as floats.
template <int D> __device__ __forceinline__ void loadHalves(const __half *p, float *out) {
	if constexpr (D == 4) {
		const uint2 t = __ldg(reinterpret_cast<const uint2 *>(p));
		const float2 a = __half22float2(*reinterpret_cast<const __half2 *>(&t.x));
		const float2 b = __half22float2(*reinterpret_cast<const __half2 *>(&t.y));
		out[0] = a.x, out[1] = a.y, out[2] = b.x, out[3] = b.y;
	} else {
		const unsigned t = __ldg(reinterpret_cast<const unsigned *>(p));
		const float2 a = __half22float2(*reinterpret_cast<const __half2 *>(&t));
		out[0] = a.x, out[1] = a.y;
	}
}

struct AttnArgs {
	const float *qkv; // q [n_head*hd], k, v [n_kv*hd]
	__half *kc, *vc;
	const int *params;
	float *out;
	float *part; // [n_head][kSplits][hd+2]
	int *counter;
	int nHead, nKV;
	int cellsPerSplit; // cells a block takes, until maxSplits blocks share a head
	int maxSplits;     // at most kSplits: by default as many as let all heads run at once
	int neox;          // mf_config.rope_neox
	float ropeBase, freqScale, scale;
};

// One block per (head, split). Ropes q and the new k, writes the new K and
// V to their cell (one block per KV head does), and attends over its share
// of the cells with an online softmax; the last split of a head to finish
// merges the partial results.
template <int HD> __global__ void __launch_bounds__(kAttnThreads) attention(AttnArgs a) {
	constexpr int D = HD / 32;
	__shared__ float q[HD], kn[HD], vn[HD];
	__shared__ float wm[kAttnThreads / 32], wl[kAttnThreads / 32], wacc[kAttnThreads / 32][HD];
	__shared__ int last;
	pdlLaunchNext();
	// The step's parameters (copied before the graph ran) and the earlier
	// cells' K and V (written by earlier steps) are ready before the
	// kernel before this one ends: a warp's first cells are loaded while
	// it does, leaving only q, k and v on the path after the wait.
	const int h = blockIdx.x, s = blockIdx.y, tid = threadIdx.x;
	const int g = h / (a.nHead / a.nKV);
	const int pos = a.params[0], loc = a.params[1], n = a.params[2];
	const int *cells = a.params + kParams;
	// Only as many splits as the cells need: each costs a partial result
	// and a share of the merge.
	const int active = min(a.maxSplits, max(1, (n + a.cellsPerSplit - 1) / a.cellsPerSplit));
	if (s >= active) return;
	const int warp = tid >> 5, lane = tid & 31;
	// kU cells per warp at a time: their loads are in flight together.
	const int j0 = (int)((long long)n * s / active), j1 = (int)((long long)n * (s + 1) / active);
	float kv[kU][D], vv[kU][D];
	auto load = [&](int j) {
#pragma unroll
		for (int u = 0; u < kU; u++) {
			const int c = j + u < j1 ? cells[j + u] : cells[j];
			const size_t off = ((size_t)c * a.nKV + g) * HD + lane * D;
			loadHalves<D>(a.kc + off, kv[u]);
			loadHalves<D>(a.vc + off, vv[u]);
		}
	};
	const int jFirst = j0 + warp * kU;
	if (jFirst < j1) load(jFirst);
	// The rotation depends on the position alone: worked out before the
	// wait too.
	float sn = 0.f, cs = 0.f;
	if (tid < HD / 2) sincosf((float)pos * a.freqScale * powf(a.ropeBase, -2.f * (float)tid / (float)HD), &sn, &cs);
	pdlWait();

	if (tid < HD / 2) {
		const int i = tid;
		const float *qh = a.qkv + h * HD;
		const float *kh = a.qkv + a.nHead * HD + g * HD;
		const float *vh = a.qkv + (a.nHead + a.nKV) * HD + g * HD;
		// The pair rotated together: 2i and 2i+1, or (NeoX) i and i+HD/2.
		const int i0 = a.neox ? i : 2 * i, i1 = a.neox ? i + HD / 2 : 2 * i + 1;
		float x0 = qh[i0], x1 = qh[i1];
		q[i0] = (x0 * cs - x1 * sn) * a.scale;
		q[i1] = (x0 * sn + x1 * cs) * a.scale;
		x0 = kh[i0], x1 = kh[i1];
		kn[i0] = __half2float(__float2half(x0 * cs - x1 * sn));
		kn[i1] = __half2float(__float2half(x0 * sn + x1 * cs));
		vn[2 * i] = __half2float(__float2half(vh[2 * i]));
		vn[2 * i + 1] = __half2float(__float2half(vh[2 * i + 1]));
	}
	__syncthreads();
	if (s == 0 && h % (a.nHead / a.nKV) == 0 && tid < HD) {
		const size_t off = ((size_t)loc * a.nKV + g) * HD + tid;
		a.kc[off] = __float2half(kn[tid]);
		a.vc[off] = __float2half(vn[tid]);
	}

	float qr[D], acc[D];
#pragma unroll
	for (int d = 0; d < D; d++) qr[d] = q[lane * D + d], acc[d] = 0.f;
	float m = -INFINITY, l = 0.f;
	auto add = [&](float sc, const float *v) {
		const float mn = fmaxf(m, sc);
		const float c = m == -INFINITY ? 0.f : __expf(m - mn);
		const float p = __expf(sc - mn);
		l = l * c + p;
#pragma unroll
		for (int d = 0; d < D; d++) acc[d] = acc[d] * c + p * v[d];
		m = mn;
	};
	if (s == 0 && warp == 0) {
		float sc = 0.f, v[D];
#pragma unroll
		for (int d = 0; d < D; d++) sc += qr[d] * kn[lane * D + d], v[d] = vn[lane * D + d];
		add(warpSum(sc), v);
	}
	for (int j = jFirst; j < j1; j += kAttnThreads / 32 * kU) {
		if (j != jFirst) load(j);
		float sc[kU];
#pragma unroll
		for (int u = 0; u < kU; u++) {
			float t = 0.f;
#pragma unroll
			for (int d = 0; d < D; d++) t += qr[d] * kv[u][d];
			sc[u] = t;
		}
#pragma unroll
		for (int o = 16; o > 0; o >>= 1)
#pragma unroll
			for (int u = 0; u < kU; u++) sc[u] += __shfl_xor_sync(0xffffffffu, sc[u], o);
		float mn = m;
#pragma unroll
		for (int u = 0; u < kU; u++) {
			if (j + u >= j1) sc[u] = -INFINITY;
			mn = fmaxf(mn, sc[u]);
		}
		const float c = m == -INFINITY ? 0.f : __expf(m - mn);
		l *= c;
#pragma unroll
		for (int d = 0; d < D; d++) acc[d] *= c;
#pragma unroll
		for (int u = 0; u < kU; u++) {
			const float p = sc[u] == -INFINITY ? 0.f : __expf(sc[u] - mn);
			l += p;
#pragma unroll
			for (int d = 0; d < D; d++) acc[d] += p * vv[u][d];
		}
		m = mn;
	}
	if (lane == 0) wm[warp] = m, wl[warp] = l;
#pragma unroll
	for (int d = 0; d < D; d++) wacc[warp][lane * D + d] = acc[d];
	__syncthreads();
	float *mine = a.part + ((size_t)h * kSplits + s) * (HD + 2);
	if (tid < HD) {
		float M = -INFINITY;
		for (int w = 0; w < kAttnThreads / 32; w++) M = fmaxf(M, wm[w]);
		float L = 0.f, A = 0.f;
		if (M != -INFINITY)
			for (int w = 0; w < kAttnThreads / 32; w++) {
				const float c = wm[w] == -INFINITY ? 0.f : __expf(wm[w] - M);
				L += wl[w] * c, A += wacc[w][tid] * c;
			}
		if (active == 1) {
			a.out[h * HD + tid] = A / L;
		} else {
			mine[2 + tid] = A;
			if (tid == 0) mine[0] = M, mine[1] = L;
		}
	}
	if (active == 1) return;
	__threadfence();
	__syncthreads();
	if (tid == 0) last = atomicAdd(a.counter + h, 1) == active - 1;
	__syncthreads();
	if (!last) return;
	__threadfence();
	// The merge, in two rounds of loads that are all in flight together. A
	// loop over the splits waited for each one's L2 load before the next:
	// with it and two waves of blocks, attention at 576 cells took 10.9 us,
	// 7.2 without (run 55).
	const float *all = a.part + (size_t)h * kSplits * (HD + 2);
	float *wsplit = &wacc[0][0]; // each split's weight; the warps' sums are read
	if (warp == 0) {
		const float mi = lane < active ? __ldcg(all + lane * (HD + 2)) : -INFINITY;
		const float li = lane < active ? __ldcg(all + lane * (HD + 2) + 1) : 0.f;
		float M = mi;
		for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
		const float c = mi == -INFINITY ? 0.f : __expf(mi - M);
		const float L = warpSum(li * c);
		if (lane < kSplits) wsplit[lane] = c / L;
	}
	__syncthreads();
	// Thread t sums output t % HD over the splits s = t / HD, t / HD + q, ...
	constexpr int kQ = kAttnThreads / HD;
	float *sums = wsplit + kSplits;
	{
		const int d = tid % HD, s0 = tid / HD;
		float A = 0.f;
#pragma unroll 4
		for (int i = s0; i < active; i += kQ) A += __ldcg(all + i * (HD + 2) + 2 + d) * wsplit[i];
		sums[tid] = A;
	}
	__syncthreads();
	if (tid < HD) {
		float A = 0.f;
#pragma unroll
		for (int i = 0; i < kQ; i++) A += sums[i * HD + tid];
		a.out[h * HD + tid] = A;
	}
	if (tid == 0) a.counter[h] = 0;
}

// The token's row of the embedding table, as floats.
__global__ void embed(const uint8_t *table, int type, int k, const int *params, float *x) {
	const uint8_t *row = table + (size_t)params[3] * rowBytes(type, k);
	for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < k; i += gridDim.x * blockDim.x) {
		float v = 0.f;
		switch (type) {
		case MF_F32: v = reinterpret_cast<const float *>(row)[i]; break;
		case MF_F16: v = __half2float(reinterpret_cast<const __half *>(row)[i]); break;
		case MF_Q4_0: {
			const uint8_t *b = row + (i / 32) * kQ4Bytes;
			const int j = i % 32;
			const int nib = j < 16 ? (b[2 + j] & 0xf) : (b[2 + j - 16] >> 4);
			v = halfAt(b) * (float)(nib - 8);
			break;
		}
		case MF_Q6_K: {
			const uint8_t *b = row + (i / 256) * kQ6Bytes;
			const int r = i % 256, hf = r / 128, w = r % 128, mm = w / 32, ll = w % 32;
			const uint8_t qlb = b[64 * hf + ll + (mm & 1) * 32];
			const int lo = (mm >= 2) ? (qlb >> 4) : (qlb & 0xf);
			const int hi = (b[128 + 32 * hf + ll] >> (2 * mm)) & 3;
			const int8_t sc = reinterpret_cast<const int8_t *>(b + 192)[8 * hf + ll / 16 + 2 * mm];
			v = halfAt(b + 208) * (float)sc * (float)((lo | (hi << 4)) - 32);
			break;
		}
		}
		x[i] = v;
	}
}

} // namespace

struct mf_engine {
	mf_config c;
	mf_layer *layers = nullptr;
	int sms = 0, first = 0, last = 0;
	cudaStream_t stream = nullptr;
	cudaGraphExec_t exec = nullptr;
	float *x = nullptr, *qkv = nullptr, *att = nullptr, *act = nullptr, *logits = nullptr, *part = nullptr;
	int *counter = nullptr, *params = nullptr;
	int *hostParams = nullptr; // pinned
	float *hostIO = nullptr;   // pinned: hidden in, and out
	int pdl = 1;
	int smemSM = 0; // shared memory per multiprocessor
	int late = 1;   // GemvArgs.late, from MESHNODE_FUSED_LATE (run 47: 1.5 us a layer)
	int attnCells = kCellsPerSplit; // AttnArgs.cellsPerSplit, from MESHNODE_FUSED_ATTN_CELLS
	// AttnArgs.maxSplits: splits per head that let every head's blocks run
	// in one wave (MESHNODE_FUSED_ATTN_WAVES=0: kSplits). Run 54, 576
	// cells: 9 splits of 64 cells (two waves) took 9.1 us, 6 of 96 6.7.
	int attnSplits = kSplits;
	// The mat-vecs' block shape, from MESHNODE_FUSED_THREADS: 0 the mix of
	// gemvShape, else every mat-vec in blocks of 256 or 512 threads.
	int threads = 0;
	// MESHNODE_FUSED_TIMING=N: every N steps, print how long the graph ran
	// on the GPU against how long mf_step took, to tell GPU time from
	// waiting (for a GPU shared with other processes, say).
	int timing = 0, timed = 0;
	cudaEvent_t ev0 = nullptr, ev1 = nullptr;
	double gpuMs = 0, wallMs = 0;
};

namespace {

// launch queues a kernel that may begin before the one before it ends
// (see pdlWait).
template <typename Args>
void launch(mf_engine *e, void (*kernel)(Args), dim3 grid, int threads, size_t smem, Args args) {
	cudaLaunchConfig_t cfg = {};
	cfg.gridDim = grid;
	cfg.blockDim = dim3(threads);
	cfg.dynamicSmemBytes = smem;
	cfg.stream = e->stream;
	cudaLaunchAttribute at[1];
	at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
	at[0].val.programmaticStreamSerializationAllowed = e->pdl;
	cfg.attrs = at;
	cfg.numAttrs = 1;
	cudaLaunchKernelEx(&cfg, kernel, args);
}

// copyWidth is the widest copy (16, 8 or 4 bytes) that every row's pieces
// and their places in shared memory are aligned to, or 0 if none is. A
// Q4_0 super-block is 144 bytes; a Q6_K one 210, so Q6_K rows take 16-byte
// copies only when a row is a multiple of eight super-blocks (n_embd of
// 2048: 8B), and 4-byte ones when its super-blocks are even (512).
int copyWidth(const GemvArgs &a) {
	const int last = (a.spr % 32 ? a.spr % 32 : 32) * a.sbBytes; // the last pass's bytes
	for (int w : {16, 8, 4})
		if (last % w == 0 && (a.group * a.sbBytes) % w == 0 && a.stageBytes % w == 0) return w;
	return 0;
}

// The kernel's shape for a matrix of k columns.
void gemvShape(GemvArgs &a, int type, int k, int epi, int threads) {
	a.type = type;
	a.k = k;
	a.rowBytes = (int)rowBytes(type, k);
	a.sbBytes = type == MF_Q4_0 ? 8 * kQ4Bytes : kQ6Bytes;
	a.spr = k / 256;
	a.group = a.spr < 32 ? a.spr : 32;
	a.rpp = 32 / a.group;
	a.passes = (a.spr + 31) / 32;
	// SwiGLU pairs rows: gate, up.
	a.unitRows = epi != kSwiGLU ? a.rpp : (a.rpp < 2 ? 2 : a.rpp & ~1);
	a.stageBytes = a.rpp * a.group * a.sbBytes;
	a.epi = epi;
	a.copyBytes = copyWidth(a);
	a.threads = type == MF_Q6_K || k > 8192 ? kWideThreads : kThreads;
	if (threads && type == MF_Q4_0) a.threads = threads; // the Q6_K head has only the wide kernel
}

size_t gemvSmem(const GemvArgs &a) {
	return (size_t)(a.threads / 32) * 2 * a.stageBytes + (size_t)a.k + (size_t)a.k / 32 * sizeof(float2) + 16 * sizeof(float) +
	       (a.norm && !a.normDirect ? (size_t)a.k * sizeof(float) : 0);
}

// placeNorm keeps the norm's shared copy (loaded while the kernel before
// finishes) only where the shape's blocks still fit on a multiprocessor with
// it: the Q6_K head's stage buffers are large, and one block per
// multiprocessor ran it at 2.7 TB/s.
void placeNorm(GemvArgs &a, int smemPerSM) {
	a.normDirect = 0;
	if (a.norm && (size_t)blocksOf(a.threads) * (gemvSmem(a) + 1024) > (size_t)smemPerSM) a.normDirect = 1;
}

int gemvDebug = 0;

__global__ void streamRead(const uint4 *p, size_t n, unsigned *sink) {
	unsigned acc = 0;
	for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
		uint4 v = __ldg(p + i);
		acc ^= v.x ^ v.y ^ v.z ^ v.w;
	}
	if (acc == 0x12345678u) *sink = acc;
}

void launchGemv(mf_engine *e, const void *w0, const void *w1, const void *w2, int r0, int r1, int r2, int k,
                int type, const float *x, const float *norm, float *y, int epi, const void *const *bias = nullptr) {
	GemvArgs a{};
	a.debug = gemvDebug;
	a.w[0] = (const uint8_t *)w0, a.w[1] = (const uint8_t *)w1, a.w[2] = (const uint8_t *)w2;
	a.rows[0] = r0, a.rows[1] = r1, a.rows[2] = r2;
	a.nmat = w2 ? 3 : (w1 ? 2 : 1);
	a.total = r0 + r1 + r2;
	gemvShape(a, type, k, epi, e->threads);
	a.x = x, a.norm = norm, a.eps = e->c.eps, a.y = y;
	for (int i = 0; bias && i < 3; i++) a.bias[i] = (const float *)bias[i];
	placeNorm(a, e->smemSM);
	a.late = e->late && type == MF_Q4_0; // the head measured 2 us slower late
	const int blocks = e->sms * blocksOf(a.threads);
	if (type == MF_Q6_K)
		launch(e, a.copyBytes == 16 ? gemv<MF_Q6_K, kWideThreads, 16> : a.copyBytes == 8 ? gemv<MF_Q6_K, kWideThreads, 8> : gemv<MF_Q6_K, kWideThreads, 4>,
		       blocks, a.threads, gemvSmem(a), a);
	else if (a.threads == kWideThreads)
		launch(e, gemv<MF_Q4_0, kWideThreads, 16>, blocks, a.threads, gemvSmem(a), a);
	else
		launch(e, gemv<MF_Q4_0, kThreads, 16>, blocks, a.threads, gemvSmem(a), a);
}

void launchAttention(mf_engine *e, const mf_layer &L) {
	AttnArgs a{};
	a.qkv = e->qkv, a.kc = (__half *)L.k, a.vc = (__half *)L.v, a.params = e->params, a.out = e->att;
	a.part = e->part, a.counter = e->counter, a.nHead = e->c.n_head, a.nKV = e->c.n_kv_head;
	a.cellsPerSplit = e->attnCells, a.maxSplits = e->attnSplits;
	a.neox = e->c.rope_neox;
	a.ropeBase = e->c.rope_base, a.freqScale = e->c.rope_freq_scale;
	a.scale = 1.f / sqrtf((float)e->c.head_dim);
	dim3 grid(e->c.n_head, kSplits);
	if (e->c.head_dim == 128)
		launch(e, attention<128>, grid, kAttnThreads, 0, a);
	else
		launch(e, attention<64>, grid, kAttnThreads, 0, a);
}

// The step's kernels, captured once into a graph.
void enqueue(mf_engine *e) {
	const mf_config &c = e->c;
	const int qd = c.n_head * c.head_dim, kvd = c.n_kv_head * c.head_dim;
	if (e->first) embed<<<(c.embd + 255) / 256, 256, 0, e->stream>>>((const uint8_t *)c.tok_embd, c.embd_type, c.embd, e->params, e->x);
	for (int i = 0; i < c.n_layer; i++) {
		const mf_layer &L = e->layers[i];
		const void *bias[3] = {L.bq, L.bk, L.bv};
		launchGemv(e, L.wq, L.wk, L.wv, qd, kvd, kvd, c.embd, MF_Q4_0, e->x, (const float *)L.attn_norm, e->qkv, kStore,
		           L.bq ? bias : nullptr);
		launchAttention(e, L);
		launchGemv(e, L.wo, nullptr, nullptr, c.embd, 0, 0, qd, MF_Q4_0, e->att, nullptr, e->x, kAdd);
		launchGemv(e, L.gate, L.up, nullptr, c.ffn, c.ffn, 0, c.embd, MF_Q4_0, e->x, (const float *)L.ffn_norm, e->act, kSwiGLU);
		launchGemv(e, L.down, nullptr, nullptr, c.embd, 0, 0, c.ffn, MF_Q4_0, e->act, nullptr, e->x, kAdd);
	}
	if (e->last)
		launchGemv(e, c.output, nullptr, nullptr, c.vocab, 0, 0, c.embd, c.out_type, e->x, (const float *)c.out_norm, e->logits, kStore);
}

#define CK(call)                                                                                                   \
	do {                                                                                                           \
		cudaError_t err_ = (call);                                                                                 \
		if (err_ != cudaSuccess) {                                                                                 \
			errf(err, errlen, "%s: %s", #call, cudaGetErrorString(err_));                                          \
			return 1;                                                                                              \
		}                                                                                                          \
	} while (0)

} // namespace

extern "C" int mf_supported(const mf_config *c, char *err, int errlen) {
	if (c->n_layer <= 0 || !c->layers) return errf(err, errlen, "no layers"), 1;
	if (c->head_dim != 64 && c->head_dim != 128) return errf(err, errlen, "head size %d (64 or 128 only)", c->head_dim), 1;
	if (c->n_kv_head <= 0 || c->n_head % c->n_kv_head) return errf(err, errlen, "%d heads over %d KV heads", c->n_head, c->n_kv_head), 1;
	const int qd = c->n_head * c->head_dim;
	for (int k : {c->embd, c->ffn, qd})
		if (k % 256) return errf(err, errlen, "a dimension of %d is not a multiple of 256", k), 1;
	if (c->tok_embd && c->embd_type != MF_F32 && c->embd_type != MF_F16 && c->embd_type != MF_Q4_0 && c->embd_type != MF_Q6_K)
		return errf(err, errlen, "token embedding type %d", c->embd_type), 1;
	if (c->output && c->out_type != MF_Q4_0 && c->out_type != MF_Q6_K)
		return errf(err, errlen, "output head type %d (Q4_0 or Q6_K only)", c->out_type), 1;
	if (c->output && (!c->out_norm || c->vocab <= 0)) return errf(err, errlen, "output head without norm or vocabulary"), 1;
	// Rows go to shared memory 16 bytes at a time.
	if (c->embd > 16 * kHeld * kThreads) return errf(err, errlen, "embedding size %d (16384 at most)", c->embd), 1;
	if (c->output) {
		GemvArgs a{};
		gemvShape(a, c->out_type, c->embd, kStore, 0);
		if (!a.copyBytes)
			return errf(err, errlen, "a Q6_K head needs an embedding size that is a multiple of 512, not %d", c->embd), 1;
		if ((uintptr_t)c->output % 16) return errf(err, errlen, "the output head is not 16-byte aligned"), 1;
	}
	if (c->cells <= 0) return errf(err, errlen, "no cache cells"), 1;
	for (int i = 0; i < c->n_layer; i++) {
		const mf_layer &L = c->layers[i];
		const void *ps[] = {L.attn_norm, L.wq, L.wk, L.wv, L.wo, L.ffn_norm, L.gate, L.up, L.down, L.k, L.v};
		for (const void *p : ps)
			if (!p) return errf(err, errlen, "layer %d has a missing tensor", i), 1;
		if ((L.bq || L.bk || L.bv) && !(L.bq && L.bk && L.bv))
			return errf(err, errlen, "layer %d has biases for some of q, k and v, not all", i), 1;
		for (const void *p : {L.wq, L.wk, L.wv, L.wo, L.gate, L.up, L.down})
			if ((uintptr_t)p % 16) return errf(err, errlen, "layer %d has a matrix not 16-byte aligned", i), 1;
	}
	return 0;
}

extern "C" int mf_create(const mf_config *cfg, mf_engine **out, char *err, int errlen) {
	*out = nullptr;
	if (mf_supported(cfg, err, errlen)) return 1;
	mf_engine *e = new (std::nothrow) mf_engine;
	if (!e) return errf(err, errlen, "out of memory"), 1;
	e->c = *cfg;
	if (const char *v = getenv("MESHNODE_FUSED_PDL")) e->pdl = atoi(v) != 0;
	if (const char *v = getenv("MESHNODE_FUSED_LATE")) e->late = atoi(v) != 0;
	if (const char *v = getenv("MESHNODE_FUSED_TIMING")) e->timing = atoi(v) > 0 ? atoi(v) : 0;
	if (const char *v = getenv("MESHNODE_FUSED_ATTN_CELLS")) e->attnCells = atoi(v) >= 1 ? atoi(v) : kCellsPerSplit;
	if (const char *v = getenv("MESHNODE_FUSED_THREADS")) e->threads = atoi(v) == kThreads || atoi(v) == kWideThreads ? atoi(v) : 0;
	e->first = cfg->tok_embd != nullptr;
	e->last = cfg->output != nullptr;
	e->layers = new (std::nothrow) mf_layer[cfg->n_layer];
	if (!e->layers) return delete e, errf(err, errlen, "out of memory"), 1;
	memcpy(e->layers, cfg->layers, sizeof(mf_layer) * cfg->n_layer);
	e->c.layers = e->layers;
	auto fail = [&]() {
		mf_destroy(e);
		return 1;
	};
	cudaError_t ce;
#define CE(call)                                                                                                   \
	if ((ce = (call)) != cudaSuccess) {                                                                            \
		errf(err, errlen, "%s: %s", #call, cudaGetErrorString(ce));                                                \
		return fail();                                                                                             \
	}
	if (e->c.device < 0) { // the device that holds the weights
		cudaPointerAttributes pa;
		CE(cudaPointerGetAttributes(&pa, cfg->layers[0].wq));
		e->c.device = pa.device;
	}
	CE(cudaSetDevice(e->c.device));
	CE(cudaDeviceGetAttribute(&e->sms, cudaDevAttrMultiProcessorCount, e->c.device));
	int smemOptin = 0;
	CE(cudaDeviceGetAttribute(&smemOptin, cudaDevAttrMaxSharedMemoryPerBlockOptin, e->c.device));
	CE(cudaDeviceGetAttribute(&e->smemSM, cudaDevAttrMaxSharedMemoryPerMultiprocessor, e->c.device));
	const mf_config &c = e->c;
	const int qd = c.n_head * c.head_dim, kvd = c.n_kv_head * c.head_dim;
	size_t need = 0;
	for (int k : {c.embd, c.ffn, qd}) {
		GemvArgs a{};
		gemvShape(a, MF_Q4_0, k, kSwiGLU, e->threads);
		a.norm = c.layers[0].ffn_norm ? (const float *)c.layers[0].ffn_norm : nullptr; // sizes with a norm
		placeNorm(a, e->smemSM);
		need = need > gemvSmem(a) ? need : gemvSmem(a);
	}
	if (e->last) {
		GemvArgs a{};
		gemvShape(a, c.out_type, c.embd, kStore, e->threads);
		a.norm = (const float *)c.out_norm;
		placeNorm(a, e->smemSM);
		need = need > gemvSmem(a) ? need : gemvSmem(a);
	}
	if (need > (size_t)smemOptin) {
		errf(err, errlen, "the mat-vec kernel needs %zu bytes of shared memory, the device gives %d", need, smemOptin);
		return fail();
	}
	CE(cudaFuncSetAttribute(gemv<MF_Q4_0, kThreads, 16>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)need));
	CE(cudaFuncSetAttribute(gemv<MF_Q4_0, kWideThreads, 16>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)need));
	CE(cudaFuncSetAttribute(gemv<MF_Q6_K, kWideThreads, 16>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)need));
	CE(cudaFuncSetAttribute(gemv<MF_Q6_K, kWideThreads, 8>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)need));
	CE(cudaFuncSetAttribute(gemv<MF_Q6_K, kWideThreads, 4>, cudaFuncAttributeMaxDynamicSharedMemorySize, (int)need));
	{
		int perSM = 0;
		CE(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&perSM, c.head_dim == 128 ? attention<128> : attention<64>, kAttnThreads, 0));
		int waves = 1;
		if (const char *v = getenv("MESHNODE_FUSED_ATTN_WAVES")) waves = atoi(v);
		if (waves > 0) e->attnSplits = std::max(1, std::min(kSplits, waves * perSM * e->sms / c.n_head));
	}
	CE(cudaStreamCreateWithFlags(&e->stream, cudaStreamNonBlocking));
	CE(cudaMalloc(&e->x, sizeof(float) * c.embd));
	CE(cudaMalloc(&e->qkv, sizeof(float) * (qd + 2 * kvd)));
	CE(cudaMalloc(&e->att, sizeof(float) * qd));
	CE(cudaMalloc(&e->act, sizeof(float) * c.ffn));
	CE(cudaMalloc(&e->part, sizeof(float) * c.n_head * kSplits * (c.head_dim + 2)));
	CE(cudaMalloc(&e->counter, sizeof(int) * c.n_head));
	CE(cudaMemset(e->counter, 0, sizeof(int) * c.n_head));
	CE(cudaMalloc(&e->params, sizeof(int) * (kParams + c.cells)));
	CE(cudaMallocHost(&e->hostParams, sizeof(int) * (kParams + c.cells)));
	const int io = e->last ? (c.vocab > c.embd ? c.vocab : c.embd) : c.embd;
	CE(cudaMallocHost(&e->hostIO, sizeof(float) * io));
	if (e->last) CE(cudaMalloc(&e->logits, sizeof(float) * c.vocab));

	cudaGraph_t graph;
	CE(cudaStreamBeginCapture(e->stream, cudaStreamCaptureModeThreadLocal));
	enqueue(e);
	ce = cudaGetLastError();
	cudaError_t endErr = cudaStreamEndCapture(e->stream, &graph);
	if (ce != cudaSuccess || endErr != cudaSuccess) {
		errf(err, errlen, "capturing the decode graph: %s", cudaGetErrorString(ce != cudaSuccess ? ce : endErr));
		return fail();
	}
	ce = cudaGraphInstantiate(&e->exec, graph, 0);
	cudaGraphDestroy(graph);
	if (ce != cudaSuccess) {
		errf(err, errlen, "instantiating the decode graph: %s", cudaGetErrorString(ce));
		return fail();
	}
#undef CE
	*out = e;
	return 0;
}

extern "C" int mf_step(mf_engine *e, int token, const float *hidden, int pos, int loc, const int32_t *cells, int n,
                       float *out, int out_pinned, char *err, int errlen) {
	const mf_config &c = e->c;
	if (n < 0 || n >= c.cells || loc < 0 || loc >= c.cells || pos < 0)
		return errf(err, errlen, "position %d, cell %d, %d cells: outside the cache's %d", pos, loc, n, c.cells), 1;
	if (e->first && (token < 0 || token >= c.vocab))
		return errf(err, errlen, "token %d outside the vocabulary of %d", token, c.vocab), 1;
	for (int i = 0; i < n; i++)
		if (cells[i] < 0 || cells[i] >= c.cells || cells[i] == loc)
			return errf(err, errlen, "cache cell %d (of %d) at %d is not an earlier cell", cells[i], c.cells, i), 1;
	const auto t0 = std::chrono::steady_clock::now();
	int *hp = e->hostParams;
	hp[0] = pos, hp[1] = loc, hp[2] = n, hp[3] = token;
	memcpy(hp + kParams, cells, sizeof(int) * n);
	CK(cudaSetDevice(c.device));
	CK(cudaMemcpyAsync(e->params, hp, sizeof(int) * (kParams + n), cudaMemcpyHostToDevice, e->stream));
	if (!e->first) {
		memcpy(e->hostIO, hidden, sizeof(float) * c.embd);
		CK(cudaMemcpyAsync(e->x, e->hostIO, sizeof(float) * c.embd, cudaMemcpyHostToDevice, e->stream));
	}
	if (e->timing && !e->ev0) {
		CK(cudaEventCreate(&e->ev0));
		CK(cudaEventCreate(&e->ev1));
	}
	if (e->timing) CK(cudaEventRecord(e->ev0, e->stream));
	CK(cudaGraphLaunch(e->exec, e->stream));
	if (e->timing) CK(cudaEventRecord(e->ev1, e->stream));
	const int nout = e->last ? c.vocab : c.embd;
	CK(cudaMemcpyAsync(out_pinned ? out : e->hostIO, e->last ? e->logits : e->x, sizeof(float) * nout,
	                   cudaMemcpyDeviceToHost, e->stream));
	CK(cudaStreamSynchronize(e->stream));
	if (!out_pinned) memcpy(out, e->hostIO, sizeof(float) * nout);
	if (e->timing) {
		float ms = 0;
		CK(cudaEventElapsedTime(&ms, e->ev0, e->ev1));
		e->gpuMs += ms;
		e->wallMs += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
		if (++e->timed == e->timing) {
			fprintf(stderr, "fused steps (%d layers): graph on the GPU %.3f ms, mf_step %.3f ms, mean of %d\n", c.n_layer,
			        e->gpuMs / e->timed, e->wallMs / e->timed, e->timed);
			e->timed = 0, e->gpuMs = e->wallMs = 0;
		}
	}
	return 0;
}

// mf_profile times each kind of kernel of a step, over all layers, on the
// engine's stream, and prints it: for fused_check, not for meshnode.
extern "C" void mf_profile(mf_engine *e) {
	const mf_config &c = e->c;
	const int qd = c.n_head * c.head_dim, kvd = c.n_kv_head * c.head_dim;
	cudaEvent_t t0, t1;
	cudaEventCreate(&t0), cudaEventCreate(&t1);
	auto time = [&](const char *name, double bytes, auto launch) {
		for (int w = 0; w < 2; w++) launch();
		cudaEventRecord(t0, e->stream);
		const int reps = 5;
		for (int r = 0; r < reps; r++) launch();
		cudaEventRecord(t1, e->stream);
		cudaEventSynchronize(t1);
		float ms = 0;
		cudaEventElapsedTime(&ms, t0, t1);
		const double per = ms / 1e3 / reps / c.n_layer;
		printf("    %-10s %8.2f us a launch, %7.1f GB/s (%s)\n", name, per * 1e6, bytes / per / 1e9,
		       cudaGetErrorString(cudaGetLastError()));
	};
	const double rq = (double)rowBytes(MF_Q4_0, c.embd), rf = (double)rowBytes(MF_Q4_0, c.ffn);
	time("qkv", rq * (qd + 2 * kvd), [&] {
		for (int i = 0; i < c.n_layer; i++) {
			const mf_layer &L = e->layers[i];
			launchGemv(e, L.wq, L.wk, L.wv, qd, kvd, kvd, c.embd, MF_Q4_0, e->x, (const float *)L.attn_norm, e->qkv, kStore);
		}
	});
	time("attention", 0, [&] {
		for (int i = 0; i < c.n_layer; i++) launchAttention(e, e->layers[i]);
	});
	time("o", (double)rowBytes(MF_Q4_0, qd) * c.embd, [&] {
		for (int i = 0; i < c.n_layer; i++)
			launchGemv(e, e->layers[i].wo, nullptr, nullptr, c.embd, 0, 0, qd, MF_Q4_0, e->att, nullptr, e->qkv, kStore);
	});
	time("gate+up", rq * 2 * c.ffn, [&] {
		for (int i = 0; i < c.n_layer; i++) {
			const mf_layer &L = e->layers[i];
			launchGemv(e, L.gate, L.up, nullptr, c.ffn, c.ffn, 0, c.embd, MF_Q4_0, e->x, (const float *)L.ffn_norm, e->act, kSwiGLU);
		}
	});
	for (int dbg = 1; dbg <= 3; dbg++) {
		gemvDebug = dbg;
		char name[32];
		snprintf(name, sizeof name, "gate+up/%d", dbg);
		time(name, rq * 2 * c.ffn, [&] {
			for (int i = 0; i < c.n_layer; i++) {
				const mf_layer &L = e->layers[i];
				launchGemv(e, L.gate, L.up, nullptr, c.ffn, c.ffn, 0, c.embd, MF_Q4_0, e->x, (const float *)L.ffn_norm, e->act, kSwiGLU);
			}
		});
	}
	gemvDebug = 0;
	time("read", rq * c.ffn, [&] {
		for (int i = 0; i < c.n_layer; i++)
			streamRead<<<e->sms * 4, 512, 0, e->stream>>>((const uint4 *)e->layers[i].gate, (size_t)(rq * c.ffn / 16), (unsigned *)e->counter);
	});
	time("down", rf * c.embd, [&] {
		for (int i = 0; i < c.n_layer; i++)
			launchGemv(e, e->layers[i].down, nullptr, nullptr, c.embd, 0, 0, c.ffn, MF_Q4_0, e->act, nullptr, e->qkv, kStore);
	});
	if (e->last)
		time("head", (double)rowBytes(c.out_type, c.embd) * c.vocab, [&] {
			for (int i = 0; i < c.n_layer; i++)
				launchGemv(e, c.output, nullptr, nullptr, c.vocab, 0, 0, c.embd, c.out_type, e->x, (const float *)c.out_norm, e->logits, kStore);
		});
	cudaEventDestroy(t0), cudaEventDestroy(t1);
}

extern "C" float *mf_host_alloc(size_t n) {
	float *p = nullptr;
	if (cudaHostAlloc(&p, sizeof(float) * n, cudaHostAllocPortable) != cudaSuccess) return nullptr;
	return p;
}

extern "C" void mf_host_free(float *p) {
	if (p) cudaFreeHost(p);
}

extern "C" void mf_destroy(mf_engine *e) {
	if (!e) return;
	if (e->stream) cudaStreamSynchronize(e->stream);
	if (e->exec) cudaGraphExecDestroy(e->exec);
	cudaFree(e->x), cudaFree(e->qkv), cudaFree(e->att), cudaFree(e->act), cudaFree(e->logits);
	cudaFree(e->part), cudaFree(e->counter), cudaFree(e->params);
	if (e->hostParams) cudaFreeHost(e->hostParams);
	if (e->hostIO) cudaFreeHost(e->hostIO);
	if (e->ev0) cudaEventDestroy(e->ev0);
	if (e->ev1) cudaEventDestroy(e->ev1);
	if (e->stream) cudaStreamDestroy(e->stream);
	delete[] e->layers;
	delete e;
}
