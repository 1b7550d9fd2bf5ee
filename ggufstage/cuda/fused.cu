// The fused decode path (see fused.h). Built by deploy/gpu/build-cuda.sh
// into libmeshnode-fused.so, which ggufstage loads at run time.
#include "fused.h"

#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <algorithm>
#include <chrono>
#include <cfloat>
#include <cmath>
#include <cstdarg>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <initializer_list>
#include <new>
#include <thread>

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
// for the Q6_K head (131 against 138 us) and a 32B model's down (27648
// columns). The 8B model's down (14336) is faster alone in one block of
// 512 (11.8 against 12.7 us, run 141), but a step with it in two of 256
// took 1.662 against 1.695 ms at 64 cells, 1.810 against 1.849 at 576
// (runs 140 and 141 alike): a block of 512 waits for both of gate/up's
// blocks on its multiprocessor to leave, and QKV's for it. The 32B
// model's steps were within 1% either way.
constexpr int kThreads = 256, kWideThreads = 512; // kThreads: the narrow shape
constexpr int kNarrowMaxK = 16384;                // the most columns of a Q4_0 mat-vec in the narrow shape
// The one-row down projection, where it has at least this many columns,
// shares its input's quantization between the two blocks of a cluster
// (GemvArgs.cluster): each block reads and quantizes half of the input and
// writes it to both, where every block read all of it (56 KB of floats
// for the 8B model's 14336 columns). Run 158, steps at 64 / 2048 / 576
// cells: 8B 1.663-1.680 / 1.949-1.974 / 1.806-1.807 ms against
// 1.631-1.643 / 1.907-1.924 / 1.772-1.794 with clusters; 32B
// 7.263-7.285 / 7.995-8.001 / 7.556-7.564 against 7.125-7.126 /
// 7.808-7.839 / 7.367-7.386; the same bits. O's 4096 columns ran slower
// with them (6.2 against 5.9 us), and clusters of four or eight blocks
// ran down slower (16.0-18.6 against 12.8 us, run 157). QKV's and
// gate/up's 16 KB, normalized in clusters of two (each block summing the
// squares its threads would have, the sums exchanged, so the same bits),
// ran slower too: 9.35-9.41 against 7.96-7.99 us and 21.05-21.06 against
// 19.72-19.73 (run 162).
constexpr int kClusterMinK = 8192;
__host__ __device__ constexpr int blocksOf(int threads) { return 512 / threads; } // per multiprocessor
// Attention: up to kSplits blocks per head share a sequence's cells,
// kCellsPerSplit (MESHNODE_FUSED_ATTN_CELLS) or more each.
constexpr int kSplits = 32;
constexpr int kU = 8; // cells a warp loads at once
constexpr int kCellsPerSplit = 64;
constexpr int kAttnThreads = 256;
constexpr int kClusterSplits = 8; // the most blocks of a portable cluster
// Per row (sequence) of a pass: pos, loc, n, token, and where its cells
// start, counted from the first row's parameters. The rows' cells, one
// list after another, end where the parameters begin, and a stage's
// hidden input follows them (kParamInts on), so that one copy takes a
// pass's input to the GPU: a stage's two copies took 0.020 ms of the GPU
// where one process's one took 0.012 (run 205).
constexpr int kParams = 5;
// Rows a pass takes at once: each sequence's own token. A weight is read
// once for all of them (see gemvMMA): on an H200 a pass of eight rows of
// the 8B model took 3.8 times one row's (run 76), not eight. gemvMMA's
// mma takes eight input rows (kTileRows) at once; a pass of more takes
// them in two tiles against each weight it loads, and a matrix whose
// sixteen rows of input do not fit a block's shared memory (the down
// projections of 14336 and 27648 columns) runs as two launches of eight.
// A row's sums are the same in either, so its bits do not depend on the
// pass.
constexpr int kMaxRows = 16, kTileRows = 8;
// The parameters' ints, in 256 bytes' steps so that the input after them
// is aligned as cudaMalloc's is.
constexpr int kParamInts = (kMaxRows * kParams + 63) / 64 * 64;
// Passes queued at once (mf_queue_picks): the one running and the next.
constexpr int kStaging = 2;
constexpr int kRed = 64; // floats of the norms' reduction space in shared memory
// gemvMMA holds its whole input in shared memory: eight rows of up to
// 16384 columns fit beside its stages in an H100's or H200's 227 KB a
// block. Longer rows (a 32B model's down projection: 27648) are taken in
// two halves of their columns, each by half of the blocks, so that its
// passes still take eight rows, where they took four (see
// GemvArgs.kParts). The split depends on the matrix alone, so a row's
// sums do not depend on the rows beside it. Parts small enough for two
// blocks a multiprocessor (at most 5120 columns) were slower, the counts
// and partial sums of more parts costing more than the loads in flight
// won: eight rows' down projection of the 32B model in six parts took 85
// us against 53 in halves, the 8B's in three 31.4 against 21.8 unsplit
// (run 110).
constexpr int kSplitK = 16384;

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
	// gemv, late: the first l2first steps of a warp's weights asked of L2
	// before pdlWait (prefetchL2), in bulk or (l2lines) a line a lane.
	int l2first, l2lines;
	int cluster;       // one row without a norm: the blocks of a cluster of this many share the input's quantization
	float eps;
	float *y;
	int epi;
	int threads; // the block's: kThreads or kWideThreads (gemvShape)
	int rowsCap; // the input rows the kernel's buffers hold: 1, or for gemvMMA 2, 4 or kMaxRows
	int nrows;   // input rows (sequences), at most rowsCap
	int mma;     // gemvMMA runs it
	int xqRow;   // bytes from one row of the quantized input to the next
	int xdsRow;  // its scales' float2s from one row to the next
	int xStride, yStride; // floats from one row of x, y to the next
	uint8_t *img; // gemvMMA: the quantized input as quantizeImage wrote it (xq's rows, then xds's)
	// gemvMMA of a matrix of more than kSplitK columns: kParts (2) halves
	// of every row's super-blocks, the even blocks taking the first and the
	// odd the second, each with its half of the input in shared memory
	// (rows sxqRow and sxdsRow apart there). Both store a unit's sums in
	// kpart ([part][row][total]); the second of a unit's two to count
	// itself in kcount (one per unit, left at 0) adds them and applies the
	// epilogue.
	int kParts;
	int sxqRow, sxdsRow;
	int groups;    // gemvMMA: 1, or for two tiles where it fits 2 (see gemvMMA)
	int mmaStages; // gemvMMA: stages in flight a warp
	float *kpart;
	int *kcount;
	int unitBytes; // head6: bytes from one unit of the packed head to the next
	int debug; // mf_profile: 1 skips the input's quantization (gemvMMA: its copy), 2 the dot products, 4 quantizeImage,
	           // 8 gemvMMA's shares and sums of each unit
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
// 16-byte chunks) at a time, with its chunks permuted by the super-block's
// index and its block scales by half of it (xdsSwizzle): the lanes of a
// warp read the same chunk of different super-blocks, which would
// otherwise all sit in one bank.
__device__ __forceinline__ const int8_t *xqChunk(const int8_t *xq, int sb, int c) {
	return xq + sb * 256 + ((c ^ (sb & 15)) << 4);
}
// A super-block's eight scales (float2s) are permuted by sb / 2: the 16
// lanes of a half-warp's 8-byte loads, on super-blocks sb..sb+15, then
// find them in 16 different pairs of banks. Permuted by sb % 8, lanes sb
// and sb + 8 met in one (ncu: 13% of gate/up's shared wavefronts excess);
// the same bits, and one-row steps 0.4-1.0% faster (run 289).
__device__ __forceinline__ int xdsSwizzle(int sb) { return (sb >> 1) & 7; }
__device__ __forceinline__ float2 xdsAt(const float2 *xds, int sb, int b) { return xds[sb * 8 + (b ^ xdsSwizzle(sb))]; }
// The int4 of super-block sb's sums of 16 quantized inputs (head6's xs16)
// that holds its chunks 4q to 4q+3: swizzled, so that the lanes of a warp,
// each on a super-block of its own, read fewer of the same banks.
__device__ __forceinline__ int xs16At(int sb, int q) { return sb * 4 + (q ^ (sb & 3)); }

// Programmatic dependent launch: a kernel may start while the one before it
// finishes; it copies weights (which nothing writes) before waiting for the
// earlier kernel's results. Hopper (sm_90) and later: code built for an
// older target (sm_80 to sm_89, or their PTX run on a newer GPU) has none,
// and mf_create then launches kernels without it (codeArch).
#if defined(__CUDA_ARCH__) && __CUDA_ARCH__ >= 900
#define MF_HOPPER 1
#endif
__device__ __forceinline__ void pdlWait() {
#ifdef MF_HOPPER
	asm volatile("griddepcontrol.wait;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void pdlLaunchNext() {
#ifdef MF_HOPPER
	asm volatile("griddepcontrol.launch_dependents;\n" ::);
#endif
}

constexpr int kHeld = 4; // half-blocks of 16 a thread holds while normalizing: embd <= 16384

// Thread block clusters (sm_90): a block's rank in its cluster, the
// generic address of the same place in block rank's shared memory, and a
// barrier of all the cluster's threads that orders their shared-memory
// writes before its reads (arrive releases, wait acquires). Code for older
// targets is never launched in clusters (codeArch); there a block is its
// own cluster.
__device__ __forceinline__ unsigned clusterRank() {
	unsigned r = 0;
#ifdef MF_HOPPER
	asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(r));
#endif
	return r;
}
template <typename T> __device__ __forceinline__ T *inBlock(T *p, unsigned rank) {
#ifdef MF_HOPPER
	uint64_t q;
	asm volatile("mapa.u64 %0, %1, %2;\n" : "=l"(q) : "l"(reinterpret_cast<uint64_t>(p)), "r"(rank));
	return reinterpret_cast<T *>(q);
#else
	return p;
#endif
}
__device__ __forceinline__ void clusterArrive() {
#ifdef MF_HOPPER
	asm volatile("barrier.cluster.arrive.aligned;\n" ::: "memory");
#endif
}
__device__ __forceinline__ void clusterWait() {
#ifdef MF_HOPPER
	asm volatile("barrier.cluster.wait.aligned;\n" ::: "memory");
#else
	__syncthreads();
#endif
}
__device__ __forceinline__ void clusterSync() { clusterArrive(), clusterWait(); }

// codeArch writes the target the device code was built for (__CUDA_ARCH__):
// a library built for sm_80 runs as PTX compiled at load on a newer GPU,
// without the Hopper instructions the device itself would have.
__global__ void codeArch(int *out) {
#ifdef __CUDA_ARCH__
	*out = __CUDA_ARCH__;
#endif
}

// Quantizes 16 values, half hg of a block of 32 whose other half the
// neighbouring lane holds, as ggml's q8_1 does for its mat-vec. PLAIN
// stores them unpermuted (see gemvMMA), else as xqChunk and xdsAt read them.
// xs16 (head6), where not null, takes the half's sum of integers as
// xs16At reads it.
template <bool PLAIN = false>
__device__ __forceinline__ void quantizeHalf(const float (&v)[16], int hg, bool store, int8_t *xq, float2 *xds, int ranks = 1,
                                             int *xs16 = nullptr) {
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
	if (xs16 && store) xs16[xs16At(hg >> 4, (hg & 15) >> 2) * 4 + (hg & 3)] = sum;
	sum += __shfl_xor_sync(0xffffffffu, sum, 1);
	if (!store) return;
	const int sb = hg >> 4, c = hg & 15;
	int8_t *chunk = PLAIN ? xq + 16 * hg : const_cast<int8_t *>(xqChunk(xq, sb, c));
	float2 *ds = xds + (PLAIN ? hg >> 1 : sb * 8 + ((c >> 1) ^ xdsSwizzle(sb)));
	const int4 q = make_int4(packed[0], packed[1], packed[2], packed[3]);
	const float2 e = make_float2(d, d * (float)sum);
	if (ranks == 1) {
		*reinterpret_cast<int4 *>(chunk) = q;
		if (!(c & 1)) *ds = e;
		return;
	}
	for (int r = 0; r < ranks; r++) { // every block of the cluster (GemvArgs.cluster)
		*reinterpret_cast<int4 *>(inBlock(chunk, r)) = q;
		if (!(c & 1)) *inBlock(ds, r) = e;
	}
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
__device__ void quantizeInput(const GemvArgs &a, int8_t *xq, float2 *xds, float *red, const float *normS, F afterLoads,
                              int *xs16 = nullptr) {
	constexpr int kThreads = THREADS, kWarps = THREADS / 32;
	const int halves = a.k / 16;
	const int iters = (halves + kThreads - 1) / kThreads; // the same for every thread: the shuffles need all
	if (!a.norm) {
		// With a cluster, each block quantizes its share of the halves (an
		// even number, so a block of 32 stays with one pair of lanes) into
		// every block's shared memory: a down projection's blocks each read
		// 56 KB of input from L2 otherwise. Each half's arithmetic is its
		// own, so the bits are the same.
		const int ranks = a.cluster > 1 ? a.cluster : 1;
		const int share = ranks > 1 ? ((halves + ranks - 1) / ranks + 1) & ~1 : halves;
		const int start = ranks > 1 ? (int)clusterRank() * share : 0, end = min(halves, start + share);
		const int its = (share + kThreads - 1) / kThreads;
		// kHeld halves' loads in flight at once, not one L2 round trip each.
		for (int i0 = 0; i0 < its; i0 += kHeld) {
			float v[kHeld][16];
#pragma unroll
			for (int i = 0; i < kHeld; i++) {
				const int hg = start + threadIdx.x + kThreads * (i0 + i);
				if (hg < end) load16(a.x + hg * 16, v[i]);
			}
			if (i0 == 0) {
				afterLoads();
				// Every block of the cluster has started (gemv arrived at
				// the kernel's start) before any writes to another's memory.
				if (ranks > 1) clusterWait();
			}
#pragma unroll
			for (int i = 0; i < kHeld; i++) {
				if (i0 + i >= its) break;
				const int hg = start + threadIdx.x + kThreads * (i0 + i);
				quantizeHalf(v[i], hg, hg < end, xq, xds, ranks, ranks == 1 ? xs16 : nullptr);
			}
		}
		if (ranks > 1)
			clusterSync();
		else
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
			for (int j = 0; j < 16; j++) ss = fmaf(v[i][j], v[i][j], ss); // as quantizeRows
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
		quantizeHalf(v[i], hg, hg < halves, xq, xds, 1, xs16);
	}
	__syncthreads();
}

// quantizeInput for a.nrows input rows, row r of x at r*a.xStride, into
// xq and xds at r*a.xqRow and r*a.xdsRow. Without a norm every half of every row is
// one item of work. With one, each row is normalized with the arithmetic
// quantizeInput does for it alone (thread t sums halves t, t+THREADS, ...
// of the row, in that order, then the warps' sums in order), so that a row
// quantizes to the same bits in a pass of any number of rows; several rows
// share a thread's kHeld slots when a row needs fewer. PLAIN: see
// quantizeHalf.
template <int THREADS, bool PLAIN = false, typename F>
__device__ void quantizeRows(const GemvArgs &a, int8_t *xq, float2 *xds, float *red, const float *normS, F afterLoads) {
	constexpr int kWarps = THREADS / 32;
	const int halves = a.k / 16, warp = threadIdx.x >> 5;
	const size_t rowQ = a.xqRow, rowD = a.xdsRow;
	if (!a.norm) {
		const int total = halves * a.nrows;
		const int iters = (total + THREADS - 1) / THREADS;
		for (int i0 = 0; i0 < iters; i0 += kHeld) {
			float v[kHeld][16];
#pragma unroll
			for (int i = 0; i < kHeld; i++) {
				const int hg = threadIdx.x + THREADS * (i0 + i), r = hg / halves;
				if (hg < total) load16(a.x + (size_t)r * a.xStride + (hg - r * halves) * 16, v[i]);
			}
			if (i0 == 0) afterLoads();
#pragma unroll
			for (int i = 0; i < kHeld; i++) {
				if (i0 + i >= iters) break;
				const int hg = threadIdx.x + THREADS * (i0 + i);
				const int r = hg < total ? hg / halves : 0;
				quantizeHalf<PLAIN>(v[i], hg - r * halves, hg < total, xq + r * rowQ, xds + r * rowD);
			}
		}
		__syncthreads();
		return;
	}
	const int iters = (halves + THREADS - 1) / THREADS; // slots a row takes
	const int group = max(1, kHeld / iters);              // rows at once
	for (int r0 = 0; r0 < a.nrows; r0 += group) {
		// Slot s holds half threadIdx.x + THREADS * (s % iters) of row r0 + s / iters.
		float v[kHeld][16];
#pragma unroll
		for (int s = 0; s < kHeld; s++) {
			const int rr = s / iters, hg = threadIdx.x + THREADS * (s % iters);
			if (rr < group && r0 + rr < a.nrows && hg < halves) load16(a.x + (size_t)(r0 + rr) * a.xStride + hg * 16, v[s]);
		}
		if (r0 == 0) afterLoads();
		float ss[kHeld];
#pragma unroll
		for (int c = 0; c < kHeld; c++) ss[c] = 0.f;
#pragma unroll
		for (int s = 0; s < kHeld; s++) {
			const int rr = s / iters, hg = threadIdx.x + THREADS * (s % iters);
			if (rr >= group || r0 + rr >= a.nrows || hg >= halves) continue;
#pragma unroll
			for (int c = 0; c < kHeld; c++)
				if (c == rr)
#pragma unroll
					for (int j = 0; j < 16; j++) ss[c] = fmaf(v[s][j], v[s][j], ss[c]);
		}
#pragma unroll
		for (int c = 0; c < kHeld; c++) {
			if (c >= group) break;
			const float t = warpSum(ss[c]);
			if ((threadIdx.x & 31) == 0) red[c * kWarps + warp] = t;
		}
		__syncthreads();
		float scale[kHeld];
#pragma unroll
		for (int c = 0; c < kHeld; c++) {
			float total = 0.f;
			if (c < group)
#pragma unroll
				for (int w = 0; w < kWarps; w++) total += red[c * kWarps + w];
			scale[c] = rsqrtf(total / (float)a.k + a.eps);
		}
#pragma unroll
		for (int s = 0; s < kHeld; s++) {
			const int rr = s / iters, hg = threadIdx.x + THREADS * (s % iters);
			if (rr >= group) break;
			const bool ok = r0 + rr < a.nrows && hg < halves;
			float sc = 0.f;
#pragma unroll
			for (int c = 0; c < kHeld; c++)
				if (c == rr) sc = scale[c];
			float n[16] = {};
			if (ok) load16(normS + hg * 16, n);
#pragma unroll
			for (int j = 0; j < 16; j++) v[s][j] = v[s][j] * sc * n[j];
			const int r = ok ? r0 + rr : 0;
			quantizeHalf<PLAIN>(v[s], hg, ok, xq + r * rowQ, xds + r * rowD);
		}
		__syncthreads(); // red is written again for the next rows
	}
}

// Two Q4_0 blocks' share of a dot product: weight scales d0, d1; the
// input blocks' scales and scaled sums e0, e1; the integer dot products s0,
// s1. One function for one row and for several, its multiplies and adds
// fused by hand: left to the compiler, they fused differently in the two
// kernels, and a row's result must have the same bits in a pass of any
// number of rows.
__device__ __forceinline__ float q4Term(float d0, float d1, float2 e0, float2 e1, int s0, int s1) {
	const float t0 = fmaf(e0.x, (float)s0, -8.f * e0.y), t1 = fmaf(e1.x, (float)s1, -8.f * e1.y);
	return fmaf(d0, t0, d1 * t1);
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
		acc += q4Term(d0, d1, e0, e1, s0, s1);
	}
	return acc;
}

// The float part of half a Q6_K block's dot product: its integer sums s
// by sub-block, their scales sc, the block's scale d. One expression for
// one row and for several, fused by hand (see q4Term).
__device__ __forceinline__ float q6Sum(const int (&s)[4][2], const int8_t *sc, float d, int half, int sb, const float2 *xds) {
	float acc = 0.f;
#pragma unroll
	for (int m = 0; m < 4; m++) {
		const float d8 = xdsAt(xds, sb, 4 * half + m).x;
		acc = fmaf(d8, fmaf((float)sc[2 * m], (float)s[m][0], (float)sc[2 * m + 1] * (float)s[m][1]), acc);
	}
	return __fmul_rn(d, acc); // never fused into the caller's add of the two halves
}

// Weights l..l+3 of each 32-weight quarter m of half a Q6_K block (ql, qh
// its low and high bits), as signed bytes in v[m].
__device__ __forceinline__ void q6QuadsW(uint32_t qa, uint32_t qb, uint32_t h, int (&v)[4]) {
	v[0] = (int)__vsubss4((qa & 0x0f0f0f0fu) | ((h << 4) & 0x30303030u), 0x20202020u);
	v[1] = (int)__vsubss4((qb & 0x0f0f0f0fu) | ((h << 2) & 0x30303030u), 0x20202020u);
	v[2] = (int)__vsubss4(((qa >> 4) & 0x0f0f0f0fu) | (h & 0x30303030u), 0x20202020u);
	v[3] = (int)__vsubss4(((qb >> 4) & 0x0f0f0f0fu) | ((h >> 2) & 0x30303030u), 0x20202020u);
}
// The same weights unbiased, 0 to 63 (q6HalfSums then subtracts 32 times
// the input's sums): no per-byte subtraction (see head6).
__device__ __forceinline__ void q6QuadsU(uint32_t qa, uint32_t qb, uint32_t h, int (&v)[4]) {
	v[0] = (int)((qa & 0x0f0f0f0fu) | ((h << 4) & 0x30303030u));
	v[1] = (int)((qb & 0x0f0f0f0fu) | ((h << 2) & 0x30303030u));
	v[2] = (int)(((qa >> 4) & 0x0f0f0f0fu) | (h & 0x30303030u));
	v[3] = (int)(((qb >> 4) & 0x0f0f0f0fu) | ((h >> 2) & 0x30303030u));
}
__device__ __forceinline__ void q6Quads(const uint8_t *ql, const uint8_t *qh, int l, int (&v)[4]) {
	q6QuadsW(u32At2(ql + l), u32At2(ql + l + 32), u32At2(qh + l), v);
}

// The integer sums s of half a Q6_K block against the input, by quarter
// and 16 weights: words(l) gives the block's low bits of weights l..l+3
// and l+32..l+35 of the half, and their high bits (q6QuadsW's qa, qb, h),
// from shared memory (gemv) or registers (head6). With xs16 (the input's
// sums of 16, see xs16At) it takes the weights unbiased and subtracts 32
// times those sums from each sum of 16: the same integers.
template <bool kUnbiased = false, typename Words>
__device__ __forceinline__ void q6HalfSums(Words words, int half, int sb, const int8_t *xq, int (&s)[4][2],
                                           const int *xs16 = nullptr) {
	// The input's int at byte o of this half.
	auto xi = [&](int o) {
		o += 128 * half;
		return *reinterpret_cast<const int *>(xqChunk(xq, sb, o >> 4) + (o & 15));
	};
#pragma unroll
	for (int m = 0; m < 4; m++) s[m][0] = s[m][1] = 0;
#pragma unroll
	for (int l = 0; l < 32; l += 4) {
		const uint3 q = words(l);
		int v[4];
		if constexpr (kUnbiased)
			q6QuadsU(q.x, q.y, q.z, v);
		else
			q6QuadsW(q.x, q.y, q.z, v);
		const int g = l >> 4;
#pragma unroll
		for (int m = 0; m < 4; m++) s[m][g] = __dp4a(v[m], xi(32 * m + l), s[m][g]);
	}
	if constexpr (kUnbiased) {
		// Chunks 8 half + 2m + g: the int4s of quarters 2 half and 2 half + 1.
		const int4 t0 = reinterpret_cast<const int4 *>(xs16)[xs16At(sb, 2 * half)];
		const int4 t1 = reinterpret_cast<const int4 *>(xs16)[xs16At(sb, 2 * half + 1)];
		s[0][0] -= 32 * t0.x, s[0][1] -= 32 * t0.y, s[1][0] -= 32 * t0.z, s[1][1] -= 32 * t0.w;
		s[2][0] -= 32 * t1.x, s[2][1] -= 32 * t1.y, s[3][0] -= 32 * t1.z, s[3][1] -= 32 * t1.w;
	}
}

// Half (128 weights) of a Q6_K block against the input from weight base on.
// The one-row head spends 35 us of its 138 here (102.6 without, run 160),
// but loading the half's weights as aligned words and its input 16 bytes
// at a time, fewer loads for the same sums, took it to 142.7 (run 161).
__device__ __forceinline__ float dotQ6Half(const uint8_t *blk, int half, int sb, const int8_t *xq,
                                           const float2 *xds) {
	const uint8_t *ql = blk + 64 * half;
	const uint8_t *qh = blk + 128 + 32 * half;
	const int8_t *sc = reinterpret_cast<const int8_t *>(blk + 192 + 8 * half);
	const float d = halfAt(blk + 208);
	int s[4][2];
	q6HalfSums([&](int l) { return uint3{u32At2(ql + l), u32At2(ql + l + 32), u32At2(qh + l)}; }, half, sb, xq, s);
	return q6Sum(s, sc, d, half, sb, xds);
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
// Asks L2 for bytes from p on, which nothing on this multiprocessor waits
// for: one bulk request (sm_90) where p and bytes are 16-byte aligned.
__device__ __forceinline__ void prefetchL2(const void *p, int bytes) {
#ifdef MF_HOPPER
	if ((reinterpret_cast<uintptr_t>(p) | (unsigned)bytes) & 15) return;
	asm volatile("cp.async.bulk.prefetch.L2.global [%0], %1;\n" ::"l"(p), "r"(bytes) : "memory");
#endif
}
__device__ __forceinline__ void prefetchLineL2(const void *p) { asm volatile("prefetch.global.L2 [%0];\n" ::"l"(p)); }

__device__ __forceinline__ void cpAsyncCommit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void cpAsyncWait() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }

// Each warp walks its steps (unit, round of rpp rows, pass over up to 32
// super-blocks of each) with the next step's copy in flight (cp.async into
// the warp's other stage buffer) while it computes the current one.
// COPY: the bytes of each copy (a.copyBytes), a template argument: one
// kernel with the three copy loops ran the Q6_K head at 192 us, not 131.
// One input row: passes of several run on gemvMMA.
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
	float *normS = red + kRed; // the norm's weights, copied before the wait: k floats

	const int slotStride = a.group * a.sbBytes;
	const int units = (a.total + a.unitRows - 1) / a.unitRows;
	const int mySlot = lane / a.group, myIdx = lane % a.group;
	const int rounds = (a.unitRows + a.rpp - 1) / a.rpp;
	const int perUnit = rounds * a.passes;
	const int first = blockIdx.x * kWarps + warp, stride = gridDim.x * kWarps;
	const int mine0 = first < units ? (units - first + stride - 1) / stride : 0;
	const int steps = mine0 * perUnit;

	// Where step k's weights for slot (a row of its round) start, and
	// their bytes.
	auto stepSrc = [&](int k, int slot, int &bytes) {
		const int unit = first + (k / perUnit) * stride, rp = k % perUnit;
		const int round = rp / a.passes, pass = rp % a.passes;
		const int v = min(unit * a.unitRows + round * a.rpp + slot, a.total - 1);
		bytes = min(32, a.spr - pass * 32) * a.sbBytes;
		return rowPtr(a, v) + (size_t)pass * 32 * a.sbBytes;
	};
	// Lane myIdx of slot mySlot's group copies chunks myIdx, myIdx+group, ...
	// of its row: a group's copies are contiguous, one add apart.
	auto issue = [&](int k) {
		if (k < steps && mySlot < a.rpp) {
			int bytes;
			const uint8_t *src = stepSrc(k, mySlot, bytes);
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
	if (a.cluster > 1) clusterArrive(); // see quantizeInput
	const bool normShared = a.norm && !a.normDirect;
	if (normShared) {
		for (int i = threadIdx.x; i < a.k / 4; i += kThreads) cpAsync16(normS + 4 * i, a.norm + 4 * i);
		cpAsyncCommit();
	}
	// Step 0's copy goes in flight while the kernel before finishes, or
	// (late) only once the input's loads are issued, so that those do not
	// queue behind a multiprocessor's worth of weight copies.
	if (!a.late) issue(0);
	// Late, its first steps' weights are asked of L2 here instead (one bulk
	// prefetch a row), which no load of this multiprocessor waits behind:
	// the bytes come from DRAM while the kernel before drains, and the
	// copies after the input's loads find them in L2. A step at 192 / 320
	// / 576 cells took 1.582 / 1.593 / 1.690 ms against 1.597-1.599 /
	// 1.618-1.619 / 1.710-1.713 without (fused_check, run 271); two steps
	// each, 1.664-1.666 / 1.671-1.674 / 1.763-1.764 (run 270).
	for (int k = 0; k < a.l2first && k < steps; k++) {
		int bytes;
		if (a.l2lines) {
			stepSrc(k, 0, bytes);
			for (int o = lane * 128; o < a.rpp * bytes; o += 32 * 128) prefetchLineL2(stepSrc(k, o / bytes, bytes) + o % bytes);
		} else if (lane < a.rpp) {
			const uint8_t *src = stepSrc(k, lane, bytes);
			prefetchL2(src, bytes);
		}
	}
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

	// Lane i ends a unit with the sum of its matrix row i.
	float acc = 0.f, mine = 0.f;
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

// The one-row Q6_K head, from a copy of the output matrix packed for loads
// straight into registers (mf_engine.head6W). gemv's lanes read each
// super-block from shared memory 2 bytes at a time (a super-block is 210
// bytes, so only 2-byte aligned), and the dot products cost 35 of its 138
// us (run 160). A unit is gemv's step of a warp: rpp rows of group
// super-blocks, lane slot*group+sb taking super-block sb of row
// unit*rpp+slot. Packed, a unit's L = rpp*group super-blocks lie as
// kHeadPieces pieces of 16 bytes, piece j of every lane's 208 bytes of quants
// and scales at j*16*L + 16*lane, then the lanes' f16 scales; units are
// GemvArgs.unitBytes apart (L*210 rounded up to 16). So a warp's loads of
// a piece coalesce, and the arithmetic is gemv's: the same bits where
// each thread of either kernel normalizes at most one group of 16 input
// values (n_embd up to 6144). Each warp has its next unit's loads in
// flight while it works on one.
// fused_check, 8B (runs 256-257, alternating): the head 119.5-120.7 us
// against 137.4-138.0, a step at 64 cells 1.613-1.657 ms against
// 1.634-1.667 (medians of nine 1.632 and 1.649). Blocks of 256 threads
// with two units in flight (250 registers) took 129 us, two blocks of 256
// or one of 512 with one in flight (128 registers, spilling) 122-130 in
// the head but 1.661-1.697 ms a step; 16-byte loads of the input
// changed nothing.
// Its weights go into the dot products unbiased (0 to 63), 32 times the
// input's sums of 16 subtracted from each sum of 16 afterwards, where
// gemv subtracts 32 from every byte with __vsubss4, which sm_80 and later
// emulate in several instructions: the same integers, so the same bits
// (fused_check's logits hashes), and the head took 98.0 us against
// 120.7-120.9, a greedy step at 64 cells 1.556-1.564 ms against
// 1.590-1.593 (run 262, alternating).
constexpr int kHeadPieces = 13, kHeadThreads = 384;

__global__ void packHead6(const uint8_t *src, uint8_t *dst, int rows, int rowBytes, int spr, int rpp, int unitBytes) {
	const long long i = blockIdx.x * (long long)blockDim.x + threadIdx.x;
	if (i >= (long long)rows * spr) return;
	const int r = (int)(i / spr), sb = (int)(i % spr);
	const int L = rpp * spr, lane = (r % rpp) * spr + sb;
	const uint16_t *s = reinterpret_cast<const uint16_t *>(src + (size_t)r * rowBytes + (size_t)sb * kQ6Bytes);
	uint8_t *u = dst + (size_t)(r / rpp) * unitBytes;
	for (int j = 0; j < kHeadPieces; j++) {
		uint32_t w[4];
		for (int q = 0; q < 4; q++) w[q] = (uint32_t)s[8 * j + 2 * q] | ((uint32_t)s[8 * j + 2 * q + 1] << 16);
		*reinterpret_cast<uint4 *>(u + (size_t)j * 16 * L + 16 * lane) = make_uint4(w[0], w[1], w[2], w[3]);
	}
	*reinterpret_cast<uint16_t *>(u + (size_t)kHeadPieces * 16 * L + 2 * lane) = s[104];
}

// Loads of weights read once a step: not kept in L1.
__device__ __forceinline__ uint4 ldStream16(const void *p) {
	uint4 v;
	asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0,%1,%2,%3}, [%4];\n"
	             : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w)
	             : "l"(p));
	return v;
}
__device__ __forceinline__ uint32_t ldStream2(const void *p) {
	unsigned short v;
	asm volatile("ld.global.nc.L1::no_allocate.u16 %0, [%1];\n" : "=h"(v) : "l"(p));
	return v;
}

// dotQ6Half on a super-block's 208 bytes in registers (w).
__device__ __forceinline__ float dotQ6HalfR(const uint32_t (&w)[4 * kHeadPieces], float d, int half, int sb, const int8_t *xq,
                                            const float2 *xds, const int *xs16) {
	int s[4][2];
	q6HalfSums<true>([&](int l) { return uint3{w[16 * half + l / 4], w[16 * half + 8 + l / 4], w[32 + 8 * half + l / 4]}; },
	                      half, sb, xq, s, xs16);
	int8_t sc[8];
#pragma unroll
	for (int i = 0; i < 8; i++) sc[i] = (int8_t)(w[48 + 2 * half + i / 4] >> (8 * (i & 3)));
	return q6Sum(s, sc, d, half, sb, xds);
}

// Shared memory: the quantized input, its scales, the norm's reduction
// space, the norm's weights and the input's sums of 16 (xs16).
__host__ __device__ size_t head6Smem(int k) {
	return (size_t)k + (size_t)k / 32 * sizeof(float2) + (kRed + (size_t)k) * sizeof(float) + (size_t)k / 16 * sizeof(int);
}

__global__ void __launch_bounds__(kHeadThreads, 1) head6(GemvArgs a) {
	constexpr int kWarps = kHeadThreads / 32;
	extern __shared__ __align__(16) uint8_t smem[];
	int8_t *xq = reinterpret_cast<int8_t *>(smem);
	float2 *xds = reinterpret_cast<float2 *>(xq + a.k);
	float *red = reinterpret_cast<float *>(xds + a.k / 32);
	float *normS = red + kRed;
	int *xs16 = reinterpret_cast<int *>(normS + a.k);
	const int warp = threadIdx.x >> 5, lane = threadIdx.x & 31;
	const int L = a.rpp * a.group, mySlot = lane / a.group, myIdx = lane % a.group;
	const int units = (a.total + a.rpp - 1) / a.rpp;
	const int first = blockIdx.x * kWarps + warp, stride = gridDim.x * kWarps;
	const int steps = first < units ? (units - first + stride - 1) / stride : 0;
	const bool active = lane < L;
	// Two units' registers, the loop unrolled by two so that their indices
	// are constants (a variable index would put them in local memory).
	uint4 W[2][kHeadPieces];
	uint32_t D[2];
	auto load = [&](int k, uint4 (&w)[kHeadPieces], uint32_t &d) {
		if (k < steps && active) {
			const uint8_t *u = a.w[0] + (size_t)(first + k * stride) * a.unitBytes;
#pragma unroll
			for (int j = 0; j < kHeadPieces; j++) w[j] = ldStream16(u + (size_t)j * 16 * L + 16 * lane);
			d = ldStream2(u + (size_t)kHeadPieces * 16 * L + 2 * lane);
		}
	};
	load(0, W[0], D[0]); // weights, which nothing writes, before the wait
	for (int i = threadIdx.x; i < a.k / 4; i += kHeadThreads) cpAsync16(normS + 4 * i, a.norm + 4 * i);
	cpAsyncCommit();
	pdlLaunchNext();
	pdlWait();
	auto afterLoads = [&]() {
		cpAsyncWait<0>();
		__syncthreads();
	};
	if (a.debug & 1)
		afterLoads();
	else
		quantizeInput<kHeadThreads>(a, xq, xds, red, normS, afterLoads, xs16);
	for (int k0 = 0; k0 < steps; k0 += 2) {
#pragma unroll
		for (int p = 0; p < 2; p++) {
			const int k = k0 + p;
			load(k + 1, W[p ^ 1], D[p ^ 1]);
			if (k >= steps) break;
			float acc = 0.f, mine = 0.f;
			if (active && !(a.debug & 2)) {
				uint32_t w[4 * kHeadPieces];
#pragma unroll
				for (int j = 0; j < kHeadPieces; j++)
					w[4 * j] = W[p][j].x, w[4 * j + 1] = W[p][j].y, w[4 * j + 2] = W[p][j].z, w[4 * j + 3] = W[p][j].w;
				const float d = __half2float(__ushort_as_half((unsigned short)D[p]));
				acc += dotQ6HalfR(w, d, 0, myIdx, xq, xds, xs16) + dotQ6HalfR(w, d, 1, myIdx, xq, xds, xs16); // as gemv sums
			}
			for (int sl = 0; sl < a.rpp; sl++) {
				const float t = warpSum(mySlot == sl ? acc : 0.f);
				if (lane == sl) mine = t;
			}
			const int v = (first + k * stride) * a.rpp + lane;
			if (lane < a.rpp && v < a.total) a.y[v] = mine + biasAt(a, v);
		}
	}
}

// The mat-vec of several rows (2 to kMaxRows) for Q4_0 and Q6_K matrices,
// on the tensor cores: for 16 matrix rows and each block of 32 columns, one int8
// mma.m16n8k32 multiplies them by the block of a tile of eight input rows
// (columns of B), once for each of the pass's one or two tiles (NT); the
// integer sums are exact, and each
// is scaled as dotQ4SB scales its own. dp4a, with a lane's sums for every
// row, left the weights' bytes behind: at eight rows the mat-vecs ran at
// 400-800 GB/s (run 71). A row's result does not depend on the other rows
// of the pass; the order of its sums differs from the one-row kernel's.
// Weights come into shared memory as in gemv: a stage is 16 rows × 256
// columns (8 blocks, 144 bytes a row), kMmaStages of them in flight a warp.
// Passes of two tiles (sixteen rows), whose input takes so much shared
// memory that one block fits a multiprocessor, ran no faster with six
// (run 116). Where the time goes (mf_profile's debug bits, 8B gate/up,
// run 117): at eight rows 32.2 us, 26.3 without quantizeImage before it,
// 20.8 without that, the input's copy or the dot products, 18.3 without
// the shares and sums of each unit either, against 10.9 for a plain read
// of the weights; at sixteen rows 61.2, 55.9, 46.8 and 19.4: with one block to a
// multiprocessor, the warps that meet at each unit's barrier leave it
// idle. Giving the two tiles to the two blocks of a pair instead, one
// tile of input each, two blocks to a multiprocessor, taking the same
// units at about the same time so that the second's weights might come
// from L2, hardly helped: gate/up 57.3 against 59.5 us, down 35.7 against
// 41.9, the pass 6.87 against 6.89 ms (run 121). What did help: blocks of
// two groups of eight warps (gemvMMA's GROUPS), each group taking units of
// its own and meeting at barriers of its own, over one copy of the input,
// so that one group streams while the other waits: gate/up 46.3 against
// 60.7 us, a pass of sixteen rows of the 8B model 6.03 against 6.89 ms, of
// the 32B model 20.8 against 23.2 (run 122; three stages a warp for the
// 8B model, two for the 32B's wider input).
constexpr int kMmaRows = 16, kMmaStageBytes = kMmaRows * 8 * kQ4Bytes, kMmaStages = 3;
// The Q6_K head's passes of several rows: dp4a with a sum per row took 793
// us at eight rows of the 8B model (137 at one, run 77), mma 302 (run 79).
// A Q6_K super-block (210 bytes) starts at an even byte,
// never 16-byte aligned throughout a row, so a stage row holds the 14
// aligned 16-byte pieces that cover it, and reads start at its offset.
// Stage rows are 240 bytes apart, so that the eight rows a warp's lanes
// read at once sit in different banks.
constexpr int kMma6Pieces = 14, kMma6RowBytes = 240, kMma6StageBytes = kMmaRows * kMma6RowBytes;

__device__ __forceinline__ void mma16x8x32(const uint32_t (&A)[4], uint32_t b0, uint32_t b1, int (&C)[4]) {
	asm volatile("mma.sync.aligned.m16n8k32.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5,%6,%7}, {%8,%9}, {%10,%11,%12,%13};\n"
	             : "=r"(C[0]), "=r"(C[1]), "=r"(C[2]), "=r"(C[3])
	             : "r"(A[0]), "r"(A[1]), "r"(A[2]), "r"(A[3]), "r"(b0), "r"(b1), "r"(0), "r"(0), "r"(0), "r"(0));
}

// Q6_K's sub-blocks of 16 weights have scales of their own: one mma a
// sub-block (see mma16x8x32 for the fragments; here k is 16).
__device__ __forceinline__ void mma16x8x16(uint32_t a0, uint32_t a1, uint32_t b0, int (&C)[4]) {
	asm volatile("mma.sync.aligned.m16n8k16.row.col.s32.s8.s8.s32 {%0,%1,%2,%3}, {%4,%5}, {%6}, {%7,%8,%9,%10};\n"
	             : "=r"(C[0]), "=r"(C[1]), "=r"(C[2]), "=r"(C[3])
	             : "r"(a0), "r"(a1), "r"(b0), "r"(0), "r"(0), "r"(0), "r"(0));
}

// quantizeImage quantizes input row blockIdx.x of a gemvMMA pass into
// a.img, laid out as gemvMMA's shared memory holds it: once for the pass,
// where each of gemvMMA's blocks had quantized every row itself, reading
// 128 KB of floats a block at eight rows of 4096 (11 of gate/up's 50 us,
// run 75). The arithmetic is quantizeRows', so the bits are the same. The
// layout is plain, not permuted by super-block: a gemvMMA warp's lanes all
// read one super-block, and working out the permuted places took as many
// instructions as the dot products. Its own kernel costs about 6 us a
// mat-vec of eight rows (run 117), but gemvMMA's first blocks quantizing
// a row each and all of them then meeting at a barrier of the grid cost
// more: a pass of eight rows of the 8B model took 3.94 ms against 3.77
// (run 119).
template <int THREADS>
__global__ void __launch_bounds__(THREADS) quantizeImage(GemvArgs a) {
	__shared__ float red[kRed];
	pdlLaunchNext();
	pdlWait();
	const int r = blockIdx.x;
	GemvArgs one = a;
	one.nrows = 1, one.x = a.x + (size_t)r * a.xStride;
	int8_t *xq = reinterpret_cast<int8_t *>(a.img) + (size_t)r * a.xqRow;
	float2 *xds = reinterpret_cast<float2 *>(a.img + (size_t)a.rowsCap * a.xqRow) + (size_t)r * a.xdsRow;
	quantizeRows<THREADS, true>(one, xq, xds, red, a.norm, [] {});
}

// One Q6_K super-block of matrix rows g and g+8 (w0, w1 in shared memory)
// against a super-block of the input, for each of NT tiles of eight input
// rows (xs[t]: its bytes 4q.. of the tile's row g; e0[t], e1[t]: its block
// scales of the tile's rows 2q, 2q+1), added to acc[t] as gemvMMA keeps
// it. Each sub-block's integer sums are scaled by its 8-bit scale in
// integers, and the two of a 32-weight block, which share the input's
// scale, are added before turning to floats. A tile's sums are the same
// whatever tiles are beside it.
template <int NT>
__device__ __forceinline__ void dotQ6MMA(const uint8_t *w0, const uint8_t *w1, int q, const int8_t *const (&xs)[NT],
                                         const float2 *const (&e0)[NT], const float2 *const (&e1)[NT], float (&acc)[NT][4]) {
	float f[NT][4] = {};
#pragma unroll
	for (int h = 0; h < 2; h++) {
		const uint8_t *ql0 = w0 + 64 * h, *qh0 = w0 + 128 + 32 * h, *ql1 = w1 + 64 * h, *qh1 = w1 + 128 + 32 * h;
		// The half's eight sub-block scales of each row, a byte each.
		const uint32_t sa0 = u32At2(w0 + 192 + 8 * h), sb0 = u32At2(w0 + 196 + 8 * h);
		const uint32_t sa1 = u32At2(w1 + 192 + 8 * h), sb1 = u32At2(w1 + 196 + 8 * h);
		auto scale = [](uint32_t lo, uint32_t hi, int i) { // sub-block i of the half: signed byte
			return (int)(int8_t)((i < 4 ? lo : hi) >> (8 * (i & 3)));
		};
		int is[NT][4][4] = {}; // by tile, quarter m: rows g, g+8 × inputs 2q, 2q+1, as C
#pragma unroll
		for (int s = 0; s < 2; s++) {
			int v0[4], v1[4];
			q6Quads(ql0, qh0, 16 * s + 4 * q, v0);
			q6Quads(ql1, qh1, 16 * s + 4 * q, v1);
#pragma unroll
			for (int m = 0; m < 4; m++) {
				const int c0 = scale(sa0, sb0, 2 * m + s), c1 = scale(sa1, sb1, 2 * m + s);
#pragma unroll
				for (int t = 0; t < NT; t++) {
					const uint32_t b = *reinterpret_cast<const uint32_t *>(xs[t] + 16 * (8 * h + 2 * m + s));
					int C[4];
					mma16x8x16((uint32_t)v0[m], (uint32_t)v1[m], b, C);
					is[t][m][0] += c0 * C[0], is[t][m][1] += c0 * C[1], is[t][m][2] += c1 * C[2], is[t][m][3] += c1 * C[3];
				}
			}
		}
#pragma unroll
		for (int t = 0; t < NT; t++)
#pragma unroll
			for (int m = 0; m < 4; m++) {
				const float x0 = e0[t][4 * h + m].x, x1 = e1[t][4 * h + m].x;
				f[t][0] = fmaf(x0, (float)is[t][m][0], f[t][0]), f[t][1] = fmaf(x1, (float)is[t][m][1], f[t][1]);
				f[t][2] = fmaf(x0, (float)is[t][m][2], f[t][2]), f[t][3] = fmaf(x1, (float)is[t][m][3], f[t][3]);
			}
	}
	const float d0 = halfAt(w0 + 208), d1 = halfAt(w1 + 208);
#pragma unroll
	for (int t = 0; t < NT; t++) {
		acc[t][0] = fmaf(d0, f[t][0], acc[t][0]), acc[t][1] = fmaf(d0, f[t][1], acc[t][1]);
		acc[t][2] = fmaf(d1, f[t][2], acc[t][2]), acc[t][3] = fmaf(d1, f[t][3], acc[t][3]);
	}
}

// The bytes of a gemvMMA pass's quantized input (quantizeImage).
__host__ __device__ size_t imageBytes(const GemvArgs &a) { return (size_t)a.rowsCap * (a.xqRow + a.xdsRow * sizeof(float2)); }

// GROUPS 2 (where a block of one group would be alone on its
// multiprocessor, and two fit: see fitShape): the block is two groups of
// eight warps that take units each of their own and meet at barriers of
// their own, sharing one copy of the input.
template <int THREADS, int TYPE, int NT, int GROUPS, int STAGES>
__global__ void __launch_bounds__(THREADS, blocksOf(THREADS)) gemvMMA(GemvArgs a) {
	static_assert(TYPE == MF_Q4_0 || TYPE == MF_Q6_K, "gemvMMA takes Q4_0 and Q6_K");
	constexpr bool kQ6 = TYPE == MF_Q6_K;
	constexpr int kWarps = THREADS / 32 / GROUPS; // a group's
	constexpr int kRowBytes = kQ6 ? kMma6RowBytes : 8 * kQ4Bytes, kStageBytes = kQ6 ? kMma6StageBytes : kMmaStageBytes;
	constexpr int kPieces = kQ6 ? kMma6Pieces : kRowBytes / 16;
	extern __shared__ __align__(16) uint8_t smem[];
	const int wid = threadIdx.x >> 5, warp = wid % kWarps, grp = wid / kWarps, lane = threadIdx.x & 31;
	const int g = lane >> 2, q = lane & 3; // the mma's groupID and thread in group
	uint8_t *stages = smem + wid * STAGES * kStageBytes;
	int8_t *xq = reinterpret_cast<int8_t *>(smem + GROUPS * kWarps * STAGES * kStageBytes);
	float2 *xds = reinterpret_cast<float2 *>(xq + a.rowsCap * a.sxqRow);
	float *red = reinterpret_cast<float *>(xds + a.rowsCap * a.sxdsRow);
	// [2][kWarps][NT][32]: each warp's share of a unit, by the unit's parity.
	float4 *parts = reinterpret_cast<float4 *>(red + kRed) + grp * 2 * kWarps * NT * 32; // the group's

	// A block takes units of 16 matrix rows; its warps share each unit's
	// columns, a super-block (256) a step, each warp a run of steps of its
	// own, and their sums meet in shared memory in warp order. One warp a
	// unit left most warps idle (a matrix of 4096 rows is 256 units): QKV,
	// O and down ran at 220-410 GB/s (run 72). Copying two super-blocks a
	// step, or keeping six steps in flight, changed nothing (run 75).
	// Split (kParts 2): the block's half of the columns, and its place
	// among the blocks of that half.
	const int kp = a.kParts > 1 ? (int)(blockIdx.x & 1) : 0;
	// bi0 and grid count groups.
	const int bi0 = (a.kParts > 1 ? (int)(blockIdx.x >> 1) : (int)blockIdx.x) * GROUPS + grp;
	const int grid = (a.kParts > 1 ? (int)(gridDim.x >> 1) : (int)gridDim.x) * GROUPS;
	const int firstHalf = a.spr - a.spr / 2;
	const int kb0 = kp ? firstHalf : 0, S = a.kParts > 1 ? (kp ? a.spr - firstHalf : firstHalf) : a.spr; // S: steps a unit takes
	const int s0 = warp * S / kWarps, per = (warp + 1) * S / kWarps - s0;
	const int units = (a.total + kMmaRows - 1) / kMmaRows;
	const int nu = bi0 < units ? (units - bi0 + grid - 1) / grid : 0;
	const int steps = nu * per;
	auto issue = [&](int k) {
		if (k < steps) {
			const int unit = bi0 + (k / per) * grid, sb = s0 + k % per;
			uint8_t *dst = stages + (k % STAGES) * kStageBytes;
#pragma unroll
			for (int i = 0; i < (kMmaRows * kPieces + 31) / 32; i++) {
				const int c = lane + 32 * i;
				if (c < kMmaRows * kPieces) {
					const int row = c / kPieces, piece = c % kPieces;
					const int v = min(unit * kMmaRows + row, a.total - 1);
					const uint8_t *src = rowPtr(a, v) + (size_t)(kb0 + sb) * (kQ6 ? kQ6Bytes : 8 * kQ4Bytes);
					// Q6_K: from the aligned piece that holds its first byte. A
					// piece holding any of a row's bytes lies on that row's
					// allocation's pages, so the bytes read past its end are
					// harmless.
					if constexpr (kQ6) src = reinterpret_cast<const uint8_t *>(reinterpret_cast<uintptr_t>(src) & ~uintptr_t(15));
					cpAsync16(dst + row * kRowBytes + piece * 16, src + piece * 16);
				}
			}
		}
		cpAsyncCommit();
	};
	// The first weights go in flight while quantizeImage runs; the input's
	// image comes once it is written.
#pragma unroll
	for (int k = 0; k < STAGES - 1; k++) issue(k);
	pdlLaunchNext();
	pdlWait();
	if (!(a.debug & 1) && a.kParts == 1) {
		const int n16 = (int)(imageBytes(a) / 16);
		for (int i = threadIdx.x; i < n16; i += THREADS) cpAsync16(reinterpret_cast<uint8_t *>(xq) + 16 * i, a.img + 16 * i);
	} else if (!(a.debug & 1)) { // the block's half of each row: S super-blocks of bytes, then of float2 scales
		const int q16 = S * 16, d16 = S * 4;
		const uint8_t *ds = a.img + (size_t)a.rowsCap * a.xqRow;
		for (int i = threadIdx.x; i < a.nrows * q16; i += THREADS) {
			const int r = i / q16, c = i % q16;
			cpAsync16(reinterpret_cast<uint8_t *>(xq) + r * a.sxqRow + 16 * c, a.img + (size_t)r * a.xqRow + 256 * kb0 + 16 * c);
		}
		for (int i = threadIdx.x; i < a.nrows * d16; i += THREADS) {
			const int r = i / d16, c = i % d16;
			cpAsync16(reinterpret_cast<uint8_t *>(xds + r * a.sxdsRow) + 16 * c, ds + (size_t)r * a.xdsRow * sizeof(float2) + 64 * kb0 + 16 * c);
		}
	}
	cpAsyncCommit();
	cpAsyncWait<0>();
	__syncthreads();

	// Tile t's B: column g is input row 8t+g; C's columns are input rows
	// 8t+2q, 8t+2q+1. Columns past the pass's rows compute on its last row
	// and are never stored: each column's sums are its own.
	const int last = a.nrows - 1;
	const int8_t *xg[NT];
	const float2 *xd0[NT], *xd1[NT];
#pragma unroll
	for (int t = 0; t < NT; t++) {
		xg[t] = xq + min(kTileRows * t + g, last) * a.sxqRow + 4 * q; // rows a.sxqRow apart: the eight rows' words in different banks
		xd0[t] = xds + min(kTileRows * t + 2 * q, last) * a.sxdsRow, xd1[t] = xds + min(kTileRows * t + 2 * q + 1, last) * a.sxdsRow;
	}
	for (int u = 0; u < nu; u++) {
		float acc[NT][4] = {}; // by tile: rows g, g+8 of the unit × input rows 2q, 2q+1
		// Q6_K: where rows g and g+8 start in their stage rows, less the
		// super-block's share (see issue).
		int off0 = 0, off1 = 0;
		if constexpr (kQ6) {
			const int unit = bi0 + u * grid;
			off0 = (int)(reinterpret_cast<uintptr_t>(rowPtr(a, min(unit * kMmaRows + g, a.total - 1))) & 15);
			off1 = (int)(reinterpret_cast<uintptr_t>(rowPtr(a, min(unit * kMmaRows + g + 8, a.total - 1))) & 15);
		}
		for (int j = 0; j < per; j++) {
			const int k = u * per + j;
			issue(k + STAGES - 1);
			cpAsyncWait<STAGES - 1>();
			__syncwarp();
			const uint8_t *st = stages + (k % STAGES) * kStageBytes;
			const int sb = s0 + j;
			if constexpr (kQ6) {
				if (!(a.debug & 2)) {
					const uint8_t *w0 = st + g * kRowBytes + ((off0 + (kb0 + sb) * kQ6Bytes) & 15);
					const uint8_t *w1 = st + (g + 8) * kRowBytes + ((off1 + (kb0 + sb) * kQ6Bytes) & 15);
					const int8_t *xs[NT];
					const float2 *e0[NT], *e1[NT];
#pragma unroll
					for (int t = 0; t < NT; t++) xs[t] = xg[t] + 256 * sb, e0[t] = xd0[t] + 8 * sb, e1[t] = xd1[t] + 8 * sb;
					dotQ6MMA<NT>(w0, w1, q, xs, e0, e1, acc);
				}
			} else {
#pragma unroll
			for (int bi = 0; bi < 8; bi++) {
				if (a.debug & 2) break;
				const uint8_t *w0 = st + g * kRowBytes + bi * kQ4Bytes, *w1 = w0 + 8 * kRowBytes;
				// An odd block's nibbles are 4-byte aligned (stage rows are 144
				// bytes, blocks 18): one load, not two halves.
				const uint32_t q0 = bi & 1 ? *reinterpret_cast<const uint32_t *>(w0 + 2 + 4 * q) : u32At2(w0 + 2 + 4 * q);
				const uint32_t q1 = bi & 1 ? *reinterpret_cast<const uint32_t *>(w1 + 2 + 4 * q) : u32At2(w1 + 2 + 4 * q);
				const uint32_t A[4] = {q0 & 0x0f0f0f0fu, q1 & 0x0f0f0f0fu, (q0 >> 4) & 0x0f0f0f0fu, (q1 >> 4) & 0x0f0f0f0fu};
				const float d0 = halfAt(w0), d1 = halfAt(w1);
#pragma unroll
				for (int t = 0; t < NT; t++) {
					const uint32_t b0 = *reinterpret_cast<const uint32_t *>(xg[t] + 256 * sb + 32 * bi);
					const uint32_t b1 = *reinterpret_cast<const uint32_t *>(xg[t] + 256 * sb + 32 * bi + 16);
					int C[4];
					mma16x8x32(A, b0, b1, C);
					const float2 e0 = xd0[t][8 * sb + bi], e1 = xd1[t][8 * sb + bi];
					acc[t][0] = fmaf(d0, fmaf(e0.x, (float)C[0], -8.f * e0.y), acc[t][0]);
					acc[t][1] = fmaf(d0, fmaf(e1.x, (float)C[1], -8.f * e1.y), acc[t][1]);
					acc[t][2] = fmaf(d1, fmaf(e0.x, (float)C[2], -8.f * e0.y), acc[t][2]);
					acc[t][3] = fmaf(d1, fmaf(e1.x, (float)C[3], -8.f * e1.y), acc[t][3]);
				}
			}
			}
			__syncwarp(); // the stage is copied into again
		}
		// One barrier a unit: the warps go on to the next unit while one of
		// them, a different one each unit, sums this one's shares. Shares
		// alternate between two buffers; the barrier of the next unit, which
		// the summing warp reaches only when it is done, keeps a buffer from
		// being written again too soon. With no barrier at all (each warp
		// counting its share in shared memory, the summing warp spinning on
		// the count, writers on the buffer's release) gate/up was slower:
		// 35.3 us at eight rows, 66.1 at sixteen (run 118).
		if (a.debug & 8) continue;
		float4 *part = parts + (u & 1) * kWarps * NT * 32;
#pragma unroll
		for (int t = 0; t < NT; t++) part[(warp * NT + t) * 32 + lane] = make_float4(acc[t][0], acc[t][1], acc[t][2], acc[t][3]);
		if constexpr (GROUPS == 1)
			__syncthreads();
		else
			asm volatile("bar.sync %0, %1;\n" ::"r"(1 + grp), "n"(THREADS / GROUPS) : "memory");
		if (warp == u % kWarps) {
			float sum[NT][4];
#pragma unroll
			for (int t = 0; t < NT; t++) {
				float4 s4 = part[t * 32 + lane];
				for (int w = 1; w < kWarps; w++) {
					const float4 o = part[(w * NT + t) * 32 + lane];
					s4.x += o.x, s4.y += o.y, s4.z += o.z, s4.w += o.w;
				}
				sum[t][0] = s4.x, sum[t][1] = s4.y, sum[t][2] = s4.z, sum[t][3] = s4.w;
			}
			const int unit = bi0 + u * grid;
			bool done = true; // the unit's sums are whole
			if (a.kParts > 1) {
				// Store this half's sums; the second half to arrive adds the
				// other's. Float addition commutes, so the bits do not depend
				// on which that is.
				float *mine = a.kpart + (size_t)kp * kMaxRows * a.total;
				const float *other = a.kpart + (size_t)(1 - kp) * kMaxRows * a.total;
#pragma unroll
				for (int t = 0; t < NT; t++)
#pragma unroll
					for (int i = 0; i < 4; i++) {
						const int v = unit * kMmaRows + g + 8 * (i >> 1), n = kTileRows * t + 2 * q + (i & 1);
						if (n < a.nrows && v < a.total) mine[(size_t)n * a.total + v] = sum[t][i];
					}
				__threadfence();
				__syncwarp();
				int arrived = 0;
				if (lane == 0) arrived = atomicAdd(a.kcount + unit, 1);
				done = __shfl_sync(0xffffffffu, arrived, 0) == 1;
				if (done) {
					__threadfence();
					if (lane == 0) a.kcount[unit] = 0; // for the next split matrix
#pragma unroll
					for (int t = 0; t < NT; t++)
#pragma unroll
						for (int i = 0; i < 4; i++) {
							const int v = unit * kMmaRows + g + 8 * (i >> 1), n = kTileRows * t + 2 * q + (i & 1);
							if (n < a.nrows && v < a.total) sum[t][i] += __ldcg(other + (size_t)n * a.total + v);
						}
				}
			}
#pragma unroll
			for (int t = 0; t < NT && done; t++)
#pragma unroll
				for (int hh = 0; hh < 2; hh++) {
					const int v = unit * kMmaRows + g + 8 * hh;
#pragma unroll
					for (int jj = 0; jj < 2; jj++) {
						const int n = kTileRows * t + 2 * q + jj;
						const float r = sum[t][2 * hh + jj];
						float *y = a.y + (size_t)n * a.yStride;
						if (a.epi == kSwiGLU) {
							const float up = __shfl_down_sync(0xffffffffu, r, 4); // row v+1: lane + 4
							if (!(g & 1) && n < a.nrows && v < a.total) y[v >> 1] = r / (1.f + __expf(-r)) * up;
						} else if (n < a.nrows && v < a.total) {
							if (a.epi == kAdd)
								y[v] += r;
							else
								y[v] = r + biasAt(a, v);
						}
					}
				}
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
	const float *qkv; // by row: q [n_head*hd], k, v [n_kv*hd]
	__half *kc, *vc;
	const int *params;
	float *out;  // by row: [n_head*hd]
	float *part; // by row: [n_head][kSplits][hd+2]
	int *counter; // by row: [n_head]
	int nHead, nKV;
	int cellsPerSplit; // cells a block takes, until maxSplits blocks share a head
	int maxSplits;     // at most kSplits: by default as many as let all heads run at once
	int neox;          // mf_config.rope_neox
	// attention: the splits of a head are one cluster (at most
	// kClusterSplits), and they merge through its first block's shared
	// memory, not global memory (see attention).
	int clusterMerge;
	float ropeBase, freqScale, scale;
	// attentionRows: where the O projection's gemvMMA reads its quantized
	// input (GemvArgs.img, with its xqRow, xdsRow and rowsCap), or null.
	uint8_t *img;
	int xqRow, xdsRow, rowsCap;
};

// attentionRows' last step where img is set: quantizes the group's n
// outputs of row, just written to out, into O's input image as
// quantizeImage would (the same arithmetic on the same blocks of 32, so
// the same bits), so that O needs no quantizeImage before it. Threads
// 2j and 2j+1 take the two halves of a block; whole warps take part for
// quantizeHalf's shuffles.
__device__ void quantizeOut(const AttnArgs &a, const float *out, int first, int n, int row) {
	__syncthreads(); // out is written
	const int halves = n / 16;
	if ((int)threadIdx.x >= (halves + 31) / 32 * 32) return;
	const int h = threadIdx.x;
	float v[16] = {};
	if (h < halves) load16(out + first + 16 * h, v);
	int8_t *xq = reinterpret_cast<int8_t *>(a.img) + (size_t)row * a.xqRow;
	float2 *xds = reinterpret_cast<float2 *>(a.img + (size_t)a.rowsCap * a.xqRow) + (size_t)row * a.xdsRow;
	quantizeHalf<true>(v, first / 16 + h, h < halves, xq, xds);
}

// A split's weight in a head's merge, for the warp whose lane i holds
// split i's running max mi and sum li (-inf and 0 past the splits): its
// share of the softmax's denominator over all of them.
__device__ __forceinline__ float splitWeight(float mi, float li) {
	float M = mi;
	for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
	const float c = mi == -INFINITY ? 0.f : __expf(mi - M);
	const float L = warpSum(li * c);
	return c / L;
}

// One block per (head, split, row). Ropes q and the new k, writes the new K and
// V to their cell (one block per KV head does), and attends over its share
// of the cells with an online softmax; the last split of a head to finish
// merges the partial results.
template <int HD> __global__ void __launch_bounds__(kAttnThreads) attention(AttnArgs a) {
	constexpr int D = HD / 32;
	__shared__ float q[HD], kn[HD], vn[HD];
	__shared__ float wm[kAttnThreads / 32], wl[kAttnThreads / 32], wacc[kAttnThreads / 32][HD];
	__shared__ float cpart[kClusterSplits][HD + 2]; // clusterMerge: each split's M, L and sums, in rank 0's
	__shared__ int last;
	pdlLaunchNext();
	// The step's parameters (copied before the graph ran) and the earlier
	// cells' K and V (written by earlier steps) are ready before the
	// kernel before this one ends: a warp's first cells are loaded while
	// it does, leaving only q, k and v on the path after the wait.
	const int h = blockIdx.x, s = blockIdx.y, tid = threadIdx.x, row = blockIdx.z;
	const int g = h / (a.nHead / a.nKV);
	const int *prm = a.params + row * kParams;
	const int pos = prm[0], loc = prm[1], n = prm[2];
	const int *cells = a.params + prm[4];
	const float *qkv = a.qkv + (size_t)row * (a.nHead + 2 * a.nKV) * HD;
	float *out = a.out + (size_t)row * a.nHead * HD;
	float *part = a.part + (size_t)row * a.nHead * kSplits * (HD + 2);
	int *counter = a.counter + row * a.nHead;
	// Only as many splits as the cells need: each costs a partial result
	// and a share of the merge.
	const int active = min(a.maxSplits, max(1, (n + a.cellsPerSplit - 1) / a.cellsPerSplit));
	if (s >= active) return;
	const int warp = tid >> 5, lane = tid & 31;
	// kU cells per warp at a time: their loads are in flight together.
	const int j0 = (int)((long long)n * s / active), j1 = (int)((long long)n * (s + 1) / active);
	float kv[kU][D], vv[kU][D];
	// The cells of a warp's next kU are fetched while it works on these:
	// K and V's loads then wait on one round trip, not two.
	int cell[kU];
	auto fetch = [&](int j) {
#pragma unroll
		for (int u = 0; u < kU; u++) cell[u] = j + u < j1 ? cells[j + u] : cells[j];
	};
	auto load = [&]() {
#pragma unroll
		for (int u = 0; u < kU; u++) {
			const size_t off = ((size_t)cell[u] * a.nKV + g) * HD + lane * D;
			loadHalves<D>(a.kc + off, kv[u]);
			loadHalves<D>(a.vc + off, vv[u]);
		}
	};
	constexpr int kStride = kAttnThreads / 32 * kU; // cells a block takes at once
	const int jFirst = j0 + warp * kU;
	if (jFirst < j1) {
		fetch(jFirst);
		load();
		if (jFirst + kStride < j1) fetch(jFirst + kStride);
	}
	// The rotation depends on the position alone: worked out before the
	// wait too.
	float sn = 0.f, cs = 0.f;
	if (tid < HD / 2) sincosf((float)pos * a.freqScale * powf(a.ropeBase, -2.f * (float)tid / (float)HD), &sn, &cs);
	pdlWait();

	if (tid < HD / 2) {
		const int i = tid;
		const float *qh = qkv + h * HD;
		const float *kh = qkv + a.nHead * HD + g * HD;
		const float *vh = qkv + (a.nHead + a.nKV) * HD + g * HD;
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
	for (int j = jFirst; j < j1; j += kStride) {
		if (j != jFirst) {
			load();
			if (j + kStride < j1) fetch(j + kStride);
		}
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
	float *mine = part + ((size_t)h * kSplits + s) * (HD + 2);
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
			out[h * HD + tid] = A / L;
		} else if (a.clusterMerge) {
			float *to = inBlock(&cpart[s][0], 0);
			to[2 + tid] = A;
			if (tid == 0) to[0] = M, to[1] = L;
		} else {
			mine[2 + tid] = A;
			if (tid == 0) mine[0] = M, mine[1] = L;
		}
	}
	if (active == 1) return;
	if (a.clusterMerge) {
		// A cluster barrier orders the splits' writes to rank 0's shared
		// memory before its reads; blocks past active have exited, which
		// releases it.
		clusterSync();
		if (s != 0) return;
		if (warp == 0) {
			const float w = splitWeight(lane < active ? cpart[lane][0] : -INFINITY, lane < active ? cpart[lane][1] : 0.f);
			if (lane < kClusterSplits) wm[lane] = w;
		}
		__syncthreads();
		if (tid < HD) {
			float A = 0.f;
			for (int i = 0; i < active; i++) A += cpart[i][2 + tid] * wm[i];
			out[h * HD + tid] = A;
		}
		return;
	}
	__threadfence();
	__syncthreads();
	if (tid == 0) last = atomicAdd(counter + h, 1) == active - 1;
	__syncthreads();
	if (!last) return;
	__threadfence();
	// The merge, in two rounds of loads that are all in flight together. A
	// loop over the splits waited for each one's L2 load before the next:
	// with it and two waves of blocks, attention at 576 cells took 10.9 us,
	// 7.2 without (run 55).
	const float *all = part + (size_t)h * kSplits * (HD + 2);
	float *wsplit = &wacc[0][0]; // each split's weight; the warps' sums are read
	if (warp == 0) {
		const float mi = lane < active ? __ldcg(all + lane * (HD + 2)) : -INFINITY;
		const float li = lane < active ? __ldcg(all + lane * (HD + 2) + 1) : 0.f;
		const float w = splitWeight(mi, li);
		if (lane < kSplits) wsplit[lane] = w;
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
		out[h * HD + tid] = A;
	}
	if (tid == 0) counter[h] = 0;
}

// attentionRows is attention for passes of several rows: one block per
// (KV head, split, row) takes every query head of its group, so each K and
// V is read once, not once per query head. With a block per query head an
// eight-row pass of the 8B model read its 19 MB of K and V four times from
// L2, and attention took 21.7 us a layer (run 81). GMAX: the most query
// heads a group may have (4 or 8). Its sums run in another order than
// attention's, the same in every pass of several rows.
template <int HD, int GMAX> __global__ void __launch_bounds__(kAttnThreads) attentionRows(AttnArgs a) {
	constexpr int D = HD / 32, kWarps = kAttnThreads / 32;
	__shared__ float q[GMAX][HD], kn[HD], vn[HD], sn[HD / 2], cs[HD / 2];
	__shared__ float wm[kWarps][GMAX], wl[kWarps][GMAX], wacc[kWarps][GMAX][HD];
	__shared__ int last;
	pdlLaunchNext();
	const int g = blockIdx.x, s = blockIdx.y, tid = threadIdx.x, row = blockIdx.z;
	const int G = a.nHead / a.nKV, h0 = g * G; // the group's query heads: h0 .. h0+G-1
	const int *prm = a.params + row * kParams;
	const int pos = prm[0], loc = prm[1], n = prm[2];
	const int *cells = a.params + prm[4];
	const float *qkv = a.qkv + (size_t)row * (a.nHead + 2 * a.nKV) * HD;
	float *out = a.out + (size_t)row * a.nHead * HD;
	float *part = a.part + (size_t)row * a.nHead * kSplits * (HD + 2);
	int *counter = a.counter + row * a.nHead + h0;
	const int active = min(a.maxSplits, max(1, (n + a.cellsPerSplit - 1) / a.cellsPerSplit));
	if (s >= active) return;
	const int warp = tid >> 5, lane = tid & 31;
	const int j0 = (int)((long long)n * s / active), j1 = (int)((long long)n * (s + 1) / active);
	float kv[kU][D], vv[kU][D];
	int cell[kU];
	auto fetch = [&](int j) {
#pragma unroll
		for (int u = 0; u < kU; u++) cell[u] = j + u < j1 ? cells[j + u] : cells[j];
	};
	auto load = [&]() {
#pragma unroll
		for (int u = 0; u < kU; u++) {
			const size_t off = ((size_t)cell[u] * a.nKV + g) * HD + lane * D;
			loadHalves<D>(a.kc + off, kv[u]);
			loadHalves<D>(a.vc + off, vv[u]);
		}
	};
	constexpr int kStride = kWarps * kU;
	const int jFirst = j0 + warp * kU;
	if (jFirst < j1) {
		fetch(jFirst);
		load();
		if (jFirst + kStride < j1) fetch(jFirst + kStride);
	}
	if (tid < HD / 2) sincosf((float)pos * a.freqScale * powf(a.ropeBase, -2.f * (float)tid / (float)HD), &sn[tid], &cs[tid]);
	pdlWait();
	__syncthreads(); // sn, cs
	// Rotate the group's q (G heads) and the new k; round k and v to f16 as
	// the cache holds them.
	for (int i = tid; i < (G + 1) * (HD / 2); i += kAttnThreads) {
		const int hh = i / (HD / 2), p = i % (HD / 2);
		const int i0 = a.neox ? p : 2 * p, i1 = a.neox ? p + HD / 2 : 2 * p + 1;
		const float c = cs[p], sv = sn[p];
		if (hh < G) {
			const float *qh = qkv + (h0 + hh) * HD;
			const float x0 = qh[i0], x1 = qh[i1];
			q[hh][i0] = (x0 * c - x1 * sv) * a.scale;
			q[hh][i1] = (x0 * sv + x1 * c) * a.scale;
		} else {
			const float *kh = qkv + a.nHead * HD + g * HD;
			const float *vh = qkv + (a.nHead + a.nKV) * HD + g * HD;
			const float x0 = kh[i0], x1 = kh[i1];
			kn[i0] = __half2float(__float2half(x0 * c - x1 * sv));
			kn[i1] = __half2float(__float2half(x0 * sv + x1 * c));
			vn[2 * p] = __half2float(__float2half(vh[2 * p]));
			vn[2 * p + 1] = __half2float(__float2half(vh[2 * p + 1]));
		}
	}
	__syncthreads();
	if (s == 0 && tid < HD) {
		const size_t off = ((size_t)loc * a.nKV + g) * HD + tid;
		a.kc[off] = __float2half(kn[tid]);
		a.vc[off] = __float2half(vn[tid]);
	}

	float m[GMAX], l[GMAX], acc[GMAX][D];
#pragma unroll
	for (int hh = 0; hh < GMAX; hh++) {
		m[hh] = -INFINITY, l[hh] = 0.f;
#pragma unroll
		for (int d = 0; d < D; d++) acc[hh][d] = 0.f;
	}
	// Adds cells' scores sc (-INFINITY: none) and values v to head hh.
	auto add = [&](int hh, const float (&sc)[kU], const float (&v)[kU][D], int nu) {
		float mn = m[hh];
#pragma unroll
		for (int u = 0; u < kU; u++)
			if (u < nu) mn = fmaxf(mn, sc[u]);
		const float c = m[hh] == -INFINITY ? 0.f : __expf(m[hh] - mn);
		l[hh] *= c;
#pragma unroll
		for (int d = 0; d < D; d++) acc[hh][d] *= c;
#pragma unroll
		for (int u = 0; u < kU; u++) {
			if (u >= nu) break;
			const float p = sc[u] == -INFINITY ? 0.f : __expf(sc[u] - mn);
			l[hh] += p;
#pragma unroll
			for (int d = 0; d < D; d++) acc[hh][d] += p * v[u][d];
		}
		m[hh] = mn;
	};
	if (s == 0 && warp == 0) { // the new cell
		float v[kU][D], sc[kU];
#pragma unroll
		for (int d = 0; d < D; d++) v[0][d] = vn[lane * D + d];
#pragma unroll
		for (int hh = 0; hh < GMAX; hh++) {
			if (hh >= G) break;
			float t = 0.f;
#pragma unroll
			for (int d = 0; d < D; d++) t += q[hh][lane * D + d] * kn[lane * D + d];
			sc[0] = warpSum(t);
			add(hh, sc, v, 1);
		}
	}
	for (int j = jFirst; j < j1; j += kStride) {
		if (j != jFirst) {
			load();
			if (j + kStride < j1) fetch(j + kStride);
		}
#pragma unroll
		for (int hh = 0; hh < GMAX; hh++) {
			if (hh >= G) break;
			float qr[D], sc[kU];
#pragma unroll
			for (int d = 0; d < D; d++) qr[d] = q[hh][lane * D + d];
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
#pragma unroll
			for (int u = 0; u < kU; u++)
				if (j + u >= j1) sc[u] = -INFINITY;
			add(hh, sc, vv, kU);
		}
	}
	if (lane == 0)
#pragma unroll
		for (int hh = 0; hh < GMAX; hh++) wm[warp][hh] = m[hh], wl[warp][hh] = l[hh];
#pragma unroll
	for (int hh = 0; hh < GMAX; hh++)
#pragma unroll
		for (int d = 0; d < D; d++) wacc[warp][hh][lane * D + d] = acc[hh][d];
	__syncthreads();
	// The block's result by head: one thread an output of a head.
	for (int i = tid; i < G * HD; i += kAttnThreads) {
		const int hh = i / HD, d = i % HD;
		float M = -INFINITY;
		for (int w = 0; w < kWarps; w++) M = fmaxf(M, wm[w][hh]);
		float L = 0.f, A = 0.f;
		if (M != -INFINITY)
			for (int w = 0; w < kWarps; w++) {
				const float c = wm[w][hh] == -INFINITY ? 0.f : __expf(wm[w][hh] - M);
				L += wl[w][hh] * c, A += wacc[w][hh][d] * c;
			}
		if (active == 1) {
			out[(h0 + hh) * HD + d] = A / L;
		} else {
			float *mine = part + ((size_t)(h0 + hh) * kSplits + s) * (HD + 2);
			mine[2 + d] = A;
			if (d == 0) mine[0] = M, mine[1] = L;
		}
	}
	if (active == 1) {
		if (a.img) quantizeOut(a, out, h0 * HD, G * HD, row);
		return;
	}
	__threadfence();
	__syncthreads();
	if (tid == 0) last = atomicAdd(counter, 1) == active - 1;
	__syncthreads();
	if (!last) return;
	__threadfence();
	// The merge: warp hh weighs head hh's splits, then each output sums
	// them in split order, its loads in flight together.
	float (*wsplit)[32] = reinterpret_cast<float (*)[32]>(&wacc[0][0][0]); // [GMAX][32]: the warps' sums are read
	if (warp < G) {
		const float *all = part + (size_t)(h0 + warp) * kSplits * (HD + 2);
		const float mi = lane < active ? __ldcg(all + lane * (HD + 2)) : -INFINITY;
		const float li = lane < active ? __ldcg(all + lane * (HD + 2) + 1) : 0.f;
		float M = mi;
		for (int o = 16; o > 0; o >>= 1) M = fmaxf(M, __shfl_xor_sync(0xffffffffu, M, o));
		const float c = mi == -INFINITY ? 0.f : __expf(mi - M);
		const float L = warpSum(li * c);
		wsplit[warp][lane] = c / L;
	}
	__syncthreads();
	for (int i = tid; i < G * HD; i += kAttnThreads) {
		const int hh = i / HD, d = i % HD;
		const float *all = part + (size_t)(h0 + hh) * kSplits * (HD + 2);
		float A = 0.f;
#pragma unroll 4
		for (int sp = 0; sp < active; sp++) A += __ldcg(all + sp * (HD + 2) + 2 + d) * wsplit[hh][sp];
		out[(h0 + hh) * HD + d] = A;
	}
	if (tid == 0) *counter = 0;
	if (a.img) quantizeOut(a, out, h0 * HD, G * HD, row);
}

// Each row's token's row of the embedding table, as floats.
// A row's token -1 is the greedy pick of the same row of the pass before
// (prev, which greedyPicks wrote; see mf_queue_picks).
__global__ void embed(const uint8_t *table, int type, int k, const int *params, const int *prev, float *x, int nrows) {
	for (int at = blockIdx.x * blockDim.x + threadIdx.x; at < nrows * k; at += gridDim.x * blockDim.x) {
		const int i = at % k, token = params[(at / k) * kParams + 3];
		const uint8_t *row = table + (size_t)(token < 0 ? prev[at / k] : token) * rowBytes(type, k);
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
		x[at] = v;
	}
}

} // namespace

// greedyPicks splits each row's logits over kPickBlocks blocks of
// kPickThreads threads, whose best candidates greedyReduce then takes. One
// block a row, as before, read its 513 KB of 128K logits in 28 µs (run
// 135); on every token of a decode step that is 1.6% of the step.
constexpr int kPickBlocks = 32;
constexpr int kPickThreads = 256;

// takeBetter keeps the better of two (value, index) candidates for a greedy
// pick: the higher value, then the lower index; index -1 is no candidate.
__device__ __forceinline__ void takeBetter(float &v, int &at, float ov, int oat) {
	if (oat >= 0 && (at < 0 || ov > v || (ov == v && oat < at))) v = ov, at = oat;
}

// warpBest leaves every lane of a warp with the best of their candidates.
__device__ __forceinline__ void warpBest(float &v, int &at) {
	for (int o = 16; o > 0; o >>= 1) takeBetter(v, at, __shfl_xor_sync(~0u, v, o), __shfl_xor_sync(~0u, at, o));
}

// pickValue is a logit as the sampler weighs it: NaN as -Inf, +Inf as the
// largest finite float (sample.sanitize).
__device__ __forceinline__ float pickValue(float x) { return x != x ? -INFINITY : fminf(x, FLT_MAX); }

// greedyPartials: block (g, r) writes the best candidate of its slice of
// row r's logits to pv/pat[r * gridDim.x + g] (index -1: none better than
// -Inf). Slices are whole float4s, read as such where the row allows. Each
// thread takes its indices in ascending order and keeps the first of
// equal values; takeBetter settles the rest by index, so the pick does not
// depend on how the row is split.
__global__ void greedyPartials(const float *__restrict__ logits, int vocab, float *__restrict__ pv, int *__restrict__ pat) {
	const int r = blockIdx.y, g = blockIdx.x;
	const float *l = logits + (size_t)r * vocab;
	const int slice = ((vocab + gridDim.x - 1) / gridDim.x + 3) & ~3;
	const int lo = min(vocab, g * slice), hi = min(vocab, lo + slice);
	float v = -INFINITY;
	int at = -1;
	int from = lo;
	if ((reinterpret_cast<uintptr_t>(l + lo) & 15) == 0) {
		const int n4 = (hi - lo) / 4;
		const float4 *l4 = reinterpret_cast<const float4 *>(l + lo);
#pragma unroll 4
		for (int i = threadIdx.x; i < n4; i += blockDim.x) {
			const float4 q = l4[i];
			const float xs[4] = {pickValue(q.x), pickValue(q.y), pickValue(q.z), pickValue(q.w)};
#pragma unroll
			for (int k = 0; k < 4; k++)
				if (xs[k] > v) v = xs[k], at = lo + 4 * i + k;
		}
		from = lo + 4 * n4;
	}
	for (int i = from + threadIdx.x; i < hi; i += blockDim.x) {
		const float x = pickValue(l[i]);
		if (x > v) v = x, at = i;
	}
	warpBest(v, at);
	__shared__ float sv[kPickThreads / 32];
	__shared__ int sat[kPickThreads / 32];
	const int warp = threadIdx.x / 32, lane = threadIdx.x % 32;
	if (lane == 0) sv[warp] = v, sat[warp] = at;
	__syncthreads();
	if (warp != 0) return;
	const int warps = blockDim.x / 32;
	v = lane < warps ? sv[lane] : -INFINITY;
	at = lane < warps ? sat[lane] : -1;
	warpBest(v, at);
	if (lane == 0) pv[r * gridDim.x + g] = v, pat[r * gridDim.x + g] = at;
}

// greedyReduce: one warp a row takes the best of the row's parts
// candidates and writes the row's pick, 0 when no logit beat -Inf.
// dev, where not null, takes a copy on the device for the next pass's
// tokens (embed).
__global__ void greedyReduce(const float *__restrict__ pv, const int *__restrict__ pat, int parts, int *__restrict__ picks,
                             int *__restrict__ dev) {
	const int r = blockIdx.x, lane = threadIdx.x;
	float v = -INFINITY;
	int at = -1;
	for (int i = lane; i < parts; i += 32) takeBetter(v, at, pv[r * parts + i], pat[r * parts + i]);
	warpBest(v, at);
	if (lane == 0) {
		picks[r] = at < 0 ? 0 : at;
		if (dev) dev[r] = picks[r];
	}
}

// greedyPicks queues the kernels that write each row's greedy pick as
// node/sample's sampler takes it at temperature 0 with nothing else to
// apply: the index of the row's largest logit, NaN counting as -Inf and +Inf
// as the largest finite float (sample.sanitize), the lowest index on ties,
// 0 when every logit is -Inf. pv and pat hold rows × kPickBlocks candidates.
static cudaError_t greedyPicks(const float *logits, int rows, int vocab, float *pv, int *pat, int *picks, int *dev,
                               cudaStream_t s) {
	greedyPartials<<<dim3(kPickBlocks, rows), kPickThreads, 0, s>>>(logits, vocab, pv, pat);
	greedyReduce<<<rows, 32, 0, s>>>(pv, pat, kPickBlocks, picks, dev);
	return cudaGetLastError();
}

struct mf_engine {
	mf_config c;
	mf_layer *layers = nullptr;
	int sms = 0, first = 0, last = 0;
	cudaStream_t stream = nullptr;
	// exec[n]: the graph of a pass of n rows, made at its first use.
	cudaGraphExec_t exec[kMaxRows + 1] = {};
	// maxRows: the most rows a pass takes, by the shared memory the
	// mat-vecs' inputs need (see fitShape), or MESHNODE_FUSED_ROWS.
	int maxRows = 1;
	float *x = nullptr, *qkv = nullptr, *att = nullptr, *act = nullptr, *logits = nullptr, *part = nullptr;
	uint8_t *img = nullptr; // GemvArgs.img
	float *kpart = nullptr; // GemvArgs.kpart: the halves' sums of a matrix split by columns
	int *kcount = nullptr;  // GemvArgs.kcount
	int *counter = nullptr;
	// A pass's input, on the device and its pinned twin on the host: the
	// rows' cells (up to cellInts, ending at params), the parameters, and
	// a stage's hidden input (x, inside the device's).
	// The host's twin has kStaging slots of inputInts, one for each pass
	// queued at once (mf_queue_picks); a step takes slot 0.
	int *input = nullptr, *hostInput = nullptr;
	size_t cellInts = 0, inputInts = 0;
	int *params = nullptr;
	float *hostIO = nullptr; // pinned: out
	int *hostPicks = nullptr;    // greedy picks of a pass's rows (last stage), pinned: kStaging slots of kMaxRows
	int *hostPicksDev = nullptr; // its device address: greedyPicks writes there
	int *devPicks = nullptr;     // the last picks on the device, for tokens -1 (embed)
	// Passes queued by mf_queue_picks and not yet waited for: queued of
	// them, the oldest in staging slot qOldest, of qRows[slot] rows, done
	// at event qDone[slot]. prevRows: the rows of the last pass whose picks
	// devPicks holds (0: none, or not the pass before).
	int queued = 0, qOldest = 0, qRows[kStaging] = {}, prevRows = 0;
	// launched: the rows of a pass mf_launch_rows queued and
	// mf_finish_rows has not waited for (0: none).
	int launched = 0;
	cudaEvent_t qDone[kStaging] = {};
	float *pickV = nullptr;      // greedyPicks' candidates: rows × kPickBlocks values
	int *pickAt = nullptr;       // and their indices
	int pdl = 1;
	int codeArch = 0; // the target the device code was built for (codeArch): below 900 no PDL or clusters
	int quantO = 1; // MESHNODE_FUSED_QUANT_O=0: O's input quantized by quantizeImage, not by attention
	int smemSM = 0;    // shared memory per multiprocessor
	int smemOptin = 0; // shared memory a block may have
	int late = 1;   // GemvArgs.late, from MESHNODE_FUSED_LATE (run 47: 1.5 us a layer)
	int l2first = 1, l2lines = 0; // GemvArgs.l2first, l2lines: MESHNODE_FUSED_L2FIRST, MESHNODE_FUSED_L2LINES
	// MESHNODE_FUSED_L2KINDS: the kinds whose first steps L2 prefetches, 1
	// QKV, 2 O, 4 gate/up, 8 down, 16 a Q4_0 head. QKV ran slower with it
	// (7.90-7.96 against 7.25-7.29 us alone), and a step with all of them
	// slower than without QKV (run 271, below).
	int l2kinds = 14;
	int cluster = 2; // GemvArgs.cluster, from MESHNODE_FUSED_CLUSTER (1: none)
	bool clusterFfn = false; // down's one-row mat-vecs take clusters (clustersFit)
	int attnCells = kCellsPerSplit; // AttnArgs.cellsPerSplit, from MESHNODE_FUSED_ATTN_CELLS
	// One-row passes whose cells take k splits of one round each, k from
	// 2 to attnSplits, run graph execMerge[k], whose k splits of a head
	// merge in a cluster of k (AttnArgs.clusterMerge);
	// MESHNODE_FUSED_ATTN_CLUSTER=0 turns it off. Attention's share of an
	// 8B step (the gap between its end and QKV's, run 234): 4.11 and 4.84
	// us at 192 and 320 cells in clusters (of eight then), 4.93 and 5.46
	// merged through global memory. Clusters start later than lone blocks
	// (their blocks must fit at once), so other passes keep them out: 3.09
	// against 2.40 us at 64 cells, 16.4 against 10.7 at 2048. Clusters of
	// eight whose blocks past a step's splits exit start later still:
	// fused_check's steps at 192 / 320 cells took 1.688-1.717 /
	// 1.734-1.760 ms with them, 1.667-1.672 / 1.687-1.689 with clusters of
	// k, the same bits (run 240).
	bool mergeInClusters = false;
	bool mergeFit = true; // MESHNODE_FUSED_ATTN_CLUSTER_FIT=0: clusters of attnSplits, blocks past a step's splits exiting
	cudaGraphExec_t execMerge[kClusterSplits + 1] = {};
	// AttnArgs.maxSplits: splits per head that let every head's blocks run
	// in one wave (MESHNODE_FUSED_ATTN_WAVES=0: kSplits). Run 54, 576
	// cells: 9 splits of 64 cells (two waves) took 9.1 us, 6 of 96 6.7.
	int attnSplits = kSplits;
	// attnSplitsRows: the same for passes of several rows, whose blocks
	// take a KV head's group of query heads (attentionRows): as many as
	// let a pass of kTileRows run in one wave (one of kMaxRows takes two), or
	// MESHNODE_FUSED_ATTN_ROWS_SPLITS. Every such pass splits alike, so
	// that a row's result does not depend on the rows beside it.
	int attnSplitsRows = kSplits;
	// The mat-vecs' block shape, from MESHNODE_FUSED_THREADS: 0 the mix of
	// gemvShape, else every mat-vec in blocks of 256 or 512 threads.
	int threads = 0;
	// MESHNODE_FUSED_TIMING=N: every N steps, print how long the graph ran
	// on the GPU against how long mf_step took, to tell GPU time from
	// waiting (for a GPU shared with other processes, say).
	int timing = 0, timed = 0;
	// Around a timed step: evIn before its input's copies, ev0 and ev1
	// around the graph, evOut after its result's copy.
	cudaEvent_t evIn = nullptr, ev0 = nullptr, ev1 = nullptr, evOut = nullptr;
	double inMs = 0, gpuMs = 0, outMs = 0, launchMs = 0, wallMs = 0;
	// The last stage's one-row Q6_K head runs head6 on head6W, a packed
	// copy of the output matrix (head6Unit bytes a unit), in head6Grid
	// blocks, where mf_create found the memory for it
	// (MESHNODE_FUSED_PACKED_HEAD=0: gemv on the matrix itself).
	uint8_t *head6W = nullptr;
	int head6Unit = 0, head6Grid = 0;
};

namespace {

// launch queues a kernel that may begin before the one before it ends
// (see pdlWait).
// clusterAttr is the launch attribute of clusters of n blocks.
cudaLaunchAttribute clusterAttr(dim3 n) {
	cudaLaunchAttribute at;
	at.id = cudaLaunchAttributeClusterDimension;
	at.val.clusterDim.x = n.x, at.val.clusterDim.y = n.y, at.val.clusterDim.z = n.z;
	return at;
}

template <typename Args>
void launch(mf_engine *e, void (*kernel)(Args), dim3 grid, int threads, size_t smem, Args args, dim3 cluster = dim3(1, 1, 1)) {
	cudaLaunchConfig_t cfg = {};
	cfg.gridDim = grid;
	cfg.blockDim = dim3(threads);
	cfg.dynamicSmemBytes = smem;
	cfg.stream = e->stream;
	cudaLaunchAttribute at[2];
	at[0].id = cudaLaunchAttributeProgrammaticStreamSerialization;
	at[0].val.programmaticStreamSerializationAllowed = e->pdl;
	at[1] = clusterAttr(cluster);
	cfg.attrs = at;
	cfg.numAttrs = cluster.x * cluster.y * cluster.z > 1 ? 2 : 1;
	cudaLaunchKernelEx(&cfg, kernel, args);
}

// gemvMMA's most groups a block (MESHNODE_FUSED_GROUPS, 1 or 2).
int mmaGroupsMax = 2;

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

// The kernel's shape for a matrix of k columns and up to rows input rows.
void gemvShape(GemvArgs &a, int type, int k, int epi, int threads, int rows = 1) {
	a.rowsCap = rows <= 1 ? 1 : rows <= 2 ? 2 : rows <= 4 ? 4 : rows <= kTileRows ? kTileRows : kMaxRows;
	a.nrows = rows < 1 ? 1 : rows;
	a.mma = rows > 1 && (type == MF_Q4_0 || type == MF_Q6_K);
	// gemvMMA's rows of the input, padded: the eight rows' words, and four
	// rows' scales, then sit in different banks.
	a.xqRow = a.mma ? k + 16 : k;
	a.xdsRow = a.mma ? k / 32 + 2 : k / 32;
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
	a.threads = type == MF_Q6_K || k > kNarrowMaxK ? kWideThreads : kThreads;
	if (threads && type == MF_Q4_0) a.threads = threads; // the Q6_K head has only the wide kernel
	if (a.mma) a.threads = kThreads, a.stageBytes = type == MF_Q6_K ? kMma6StageBytes : kMmaStageBytes;
	a.groups = 1, a.mmaStages = kMmaStages; // see fitShape
	a.kParts = a.mma && k > kSplitK ? 2 : 1;
	const int most = a.spr - a.spr / a.kParts * (a.kParts - 1); // the first half's super-blocks, the most
	a.sxqRow = a.mma ? 256 * most + 16 : a.xqRow;
	a.sxdsRow = a.mma ? 8 * most + 2 : a.xdsRow;
}

// gemvMMA's tiles of eight input rows (kTileRows).
int tilesOf(const GemvArgs &a) { return a.rowsCap > kTileRows ? 2 : 1; }

size_t gemvSmem(const GemvArgs &a) {
	return (size_t)(a.threads / 32) *
	           (a.mma ? a.mmaStages * a.stageBytes + 2 * tilesOf(a) * 32 * sizeof(float4) : 2 * a.stageBytes) +
	       (size_t)a.rowsCap * (a.sxqRow + a.sxdsRow * sizeof(float2)) + kRed * sizeof(float) +
	       (a.norm && !a.normDirect && !a.mma ? (size_t)a.k * sizeof(float) : 0); // gemvMMA's norm is quantizeImage's
}

// placeNorm keeps the norm's shared copy (loaded while the kernel before
// finishes) only where the shape's blocks still fit on a multiprocessor with
// it: the Q6_K head's stage buffers are large, and one block per
// multiprocessor ran it at 2.7 TB/s.
void placeNorm(GemvArgs &a, int smemPerSM) {
	a.normDirect = 0;
	if (a.norm && (size_t)blocksOf(a.threads) * (gemvSmem(a) + 1024) > (size_t)smemPerSM) a.normDirect = 1;
}

// fitShape places the norm and says whether the shape fits in a block's
// shared memory. It also picks gemvMMA's shape for Q4_0: one group of eight warps
// with three stages a warp where two such blocks fit a multiprocessor and
// the pass is one tile; else two groups (see gemvMMA) of three stages, or
// of two, whichever fits first; else one group. Run 125: two groups took
// the 32B model's down projection of eight rows (two stages) from 53.2 to
// 50.2 us; for the 8B model's, whose input only fit beside one buffer of
// shares and two barriers a unit, they took 21.5 against 21.1.
bool fitShape(GemvArgs &a, int smemPerSM, int optin) {
	auto fits = [&] {
		placeNorm(a, smemPerSM);
		if (a.norm && gemvSmem(a) > (size_t)optin) a.normDirect = 1;
		return gemvSmem(a) <= (size_t)optin;
	};
	auto shape = [&](int groups, int stages) { a.groups = groups, a.threads = groups * kThreads, a.mmaStages = stages; };
	if (!a.mma || a.type != MF_Q4_0 || mmaGroupsMax < 2) return fits();
	shape(1, kMmaStages);
	if (a.rowsCap <= kTileRows && fits() && 2 * (gemvSmem(a) + 1024) <= (size_t)smemPerSM) return true;
	for (int stages : {3, 2}) {
		shape(2, stages);
		if (fits()) return true;
	}
	shape(1, kMmaStages);
	return fits();
}

// Blocks of the shape a multiprocessor holds at once.
int blocksPerSM(const GemvArgs &a, int smemPerSM) {
	return std::max(1, std::min(blocksOf(a.threads), smemPerSM / (int)(gemvSmem(a) + 1024)));
}

// The one-row kernel for a type, block size and copy width.
template <int THREADS> void (*gemvByType(const GemvArgs &a))(GemvArgs) {
	if (a.type == MF_Q4_0) return gemv<MF_Q4_0, THREADS, 16>;
	if (a.copyBytes == 16) return gemv<MF_Q6_K, THREADS, 16>;
	if (a.copyBytes == 8) return gemv<MF_Q6_K, THREADS, 8>;
	return gemv<MF_Q6_K, THREADS, 4>;
}
void (*gemvFor(const GemvArgs &a))(GemvArgs) {
	if (a.mma && a.groups == 2 && tilesOf(a) == 2)
		return a.mmaStages == 3 ? gemvMMA<kWideThreads, MF_Q4_0, 2, 2, 3> : gemvMMA<kWideThreads, MF_Q4_0, 2, 2, 2>;
	if (a.mma && a.groups == 2)
		return a.mmaStages == 3 ? gemvMMA<kWideThreads, MF_Q4_0, 1, 2, 3> : gemvMMA<kWideThreads, MF_Q4_0, 1, 2, 2>;
	if (a.mma && tilesOf(a) == 2)
		return a.type == MF_Q6_K ? gemvMMA<kThreads, MF_Q6_K, 2, 1, kMmaStages> : gemvMMA<kThreads, MF_Q4_0, 2, 1, kMmaStages>;
	if (a.mma) return a.type == MF_Q6_K ? gemvMMA<kThreads, MF_Q6_K, 1, 1, kMmaStages> : gemvMMA<kThreads, MF_Q4_0, 1, 1, kMmaStages>;
	return a.threads == kWideThreads ? gemvByType<kWideThreads>(a) : gemvByType<kThreads>(a);
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

// fitsRows says whether one launch of the mat-vec takes rows input rows
// within a block's shared memory.
bool fitsRows(int type, int k, const void *norm, int threads, int rows, int smemSM, int optin) {
	GemvArgs a{};
	gemvShape(a, type, k, kStore, threads, rows);
	a.norm = (const float *)norm;
	return fitShape(a, smemSM, optin);
}

// oneLaunch says whether launchGemv takes a pass of nrows rows in one
// launch, not two of one tile each (see kMaxRows).
bool oneLaunch(const mf_engine *e, int type, int k, const void *norm, int nrows) {
	return nrows <= kTileRows || fitsRows(type, k, norm, e->threads, nrows, e->smemSM, e->smemOptin);
}

// clustersFit says whether the one-row down projection (k columns) takes
// clusters (GemvArgs.cluster): wide enough, and all its clusters fit on the
// device at once, as its blocks do without them.
bool clustersFit(mf_engine *e, int k) {
	if (e->cluster < 2 || k < kClusterMinK) return false;
	GemvArgs a{};
	gemvShape(a, MF_Q4_0, k, kAdd, e->threads, 1);
	fitShape(a, e->smemSM, e->smemOptin);
	cudaLaunchConfig_t cfg = {};
	cfg.gridDim = dim3(e->sms * blocksPerSM(a, e->smemSM));
	cfg.blockDim = dim3(a.threads);
	cfg.dynamicSmemBytes = gemvSmem(a);
	cudaLaunchAttribute at = clusterAttr(dim3(e->cluster));
	cfg.attrs = &at, cfg.numAttrs = 1;
	int clusters = 0;
	if (cudaOccupancyMaxActiveClusters(&clusters, gemvFor(a), &cfg) != cudaSuccess) {
		cudaGetLastError(); // clear it: the engine works without clusters
		return false;
	}
	return (int)cfg.gridDim.x % e->cluster == 0 && clusters * e->cluster >= (int)cfg.gridDim.x;
}

// launchGemv queues y = W x for nrows inputs: row r of x at r*k, of y at
// r*yStride.
// quantized: the pass's input is in e->img already (see launchAttention).
void launchGemv(mf_engine *e, int nrows, const void *w0, const void *w1, const void *w2, int r0, int r1, int r2, int k,
                int type, const float *x, const float *norm, float *y, int yStride, int epi, const void *const *bias = nullptr,
                bool quantized = false) {
	if (!oneLaunch(e, type, k, norm, nrows)) {
		// Two launches of one tile each (see kMaxRows), both of at least
		// two rows, so that both run gemvMMA.
		const int n0 = (nrows + 1) / 2;
		launchGemv(e, n0, w0, w1, w2, r0, r1, r2, k, type, x, norm, y, yStride, epi, bias);
		launchGemv(e, nrows - n0, w0, w1, w2, r0, r1, r2, k, type, x + (size_t)n0 * k, norm, y + (size_t)n0 * yStride, yStride, epi,
		           bias);
		return;
	}
	GemvArgs a{};
	a.debug = gemvDebug;
	a.w[0] = (const uint8_t *)w0, a.w[1] = (const uint8_t *)w1, a.w[2] = (const uint8_t *)w2;
	a.rows[0] = r0, a.rows[1] = r1, a.rows[2] = r2;
	a.nmat = w2 ? 3 : (w1 ? 2 : 1);
	a.total = r0 + r1 + r2;
	gemvShape(a, type, k, epi, e->threads, nrows);
	a.x = x, a.norm = norm, a.eps = e->c.eps, a.y = y;
	a.xStride = k, a.yStride = yStride;
	for (int i = 0; bias && i < 3; i++) a.bias[i] = (const float *)bias[i];
	fitShape(a, e->smemSM, e->smemOptin); // mf_create checked that it fits (maxRows)
	a.late = e->late && type == MF_Q4_0; // the head measured 2 us slower late
	{
		const int kind = w0 == e->c.output ? 16 : epi == kSwiGLU ? 4 : norm ? 1 : k == e->c.ffn ? 8 : 2;
		if (a.late && nrows == 1 && (e->l2kinds & kind)) a.l2first = e->l2first, a.l2lines = e->l2lines;
	}
	if (e->head6W && nrows == 1 && w0 == e->c.output) {
		a.w[0] = e->head6W, a.unitBytes = e->head6Unit;
		launch(e, head6, e->head6Grid, kHeadThreads, head6Smem(k), a);
		return;
	}
	if (a.mma) {
		a.img = e->img;
		if (!(a.debug & 4) && !quantized) launch(e, quantizeImage<kThreads>, nrows, kThreads, 0, a);
	}
	// QKV and gate/up (the Q4_0 mat-vecs with a norm) of a pass of fewer
	// rows than the engine's most ask for the shared memory of the most:
	// with less, the next kernel's blocks fit beside theirs and start
	// early (PDL), and gate/up at two rows took 43 us against 34.5 at eight
	// (39.4 at both without PDL, run 86). O, down and the head ran faster
	// with early neighbours (run 87).
	// A pass of one tile asks for the most of one tile: passes of two
	// tiles hold twice the input, and their blocks fit one to a
	// multiprocessor.
	size_t smem = gemvSmem(a);
	if (a.mma && a.norm && type == MF_Q4_0) {
		GemvArgs most = a;
		gemvShape(most, type, k, epi, e->threads, nrows <= kTileRows ? std::min(e->maxRows, kTileRows) : e->maxRows);
		most.norm = a.norm;
		if (fitShape(most, e->smemSM, e->smemOptin)) smem = std::max(smem, gemvSmem(most));
	}
	int grid = e->sms * blocksPerSM(a, e->smemSM);
	if (a.kParts > 1) a.kpart = e->kpart, a.kcount = e->kcount, grid = std::max(2, grid & ~1); // even: a half each
	if (nrows == 1 && type == MF_Q4_0 && !norm && k == e->c.ffn && e->clusterFfn && grid % e->cluster == 0 && !(a.debug & 1))
		a.cluster = e->cluster;
	launch(e, gemvFor(a), grid, a.threads, smem, a, dim3(a.cluster > 1 ? a.cluster : 1));
}

// launchAttention queues a layer's attention; with quantizeO (a pass of
// several rows whose O projection is one gemvMMA launch), attentionRows
// also writes O's quantized input, and it says whether it did.
bool launchAttention(mf_engine *e, const mf_layer &L, int nrows, bool quantizeO = false, int mergeSplits = 0) {
	AttnArgs a{};
	a.qkv = e->qkv, a.kc = (__half *)L.k, a.vc = (__half *)L.v, a.params = e->params, a.out = e->att;
	a.part = e->part, a.counter = e->counter, a.nHead = e->c.n_head, a.nKV = e->c.n_kv_head;
	a.cellsPerSplit = e->attnCells, a.maxSplits = nrows > 1 ? e->attnSplitsRows : e->attnSplits;
	a.neox = e->c.rope_neox;
	a.ropeBase = e->c.rope_base, a.freqScale = e->c.rope_freq_scale;
	a.scale = 1.f / sqrtf((float)e->c.head_dim);
	// No more splits than a head may use: blocks past them would only
	// return, and at eight rows they were seven in eight of the grid.
	// One row stays on attention: attentionRows took 10.0 us a layer of the
	// 8B model at 576 cells against its 6.6 (run 103).
	const int group = e->c.n_head / e->c.n_kv_head;
	if (nrows > 1 && group <= 8) {
		dim3 grid(e->c.n_kv_head, a.maxSplits, nrows);
		auto k = e->c.head_dim == 128 ? (group <= 4 ? attentionRows<128, 4> : attentionRows<128, 8>)
		                              : (group <= 4 ? attentionRows<64, 4> : attentionRows<64, 8>);
		if (quantizeO) {
			GemvArgs o{};
			gemvShape(o, MF_Q4_0, e->c.n_head * e->c.head_dim, kAdd, e->threads, nrows);
			a.img = e->img, a.xqRow = o.xqRow, a.xdsRow = o.xdsRow, a.rowsCap = o.rowsCap;
		}
		launch(e, k, grid, kAttnThreads, 0, a);
		return quantizeO;
	}
	a.clusterMerge = mergeSplits > 1 && nrows == 1;
	if (a.clusterMerge) a.maxSplits = mergeSplits;
	const dim3 grid(e->c.n_head, a.maxSplits, nrows), cluster(1, a.clusterMerge ? a.maxSplits : 1, 1);
	launch(e, e->c.head_dim == 128 ? attention<128> : attention<64>, grid, kAttnThreads, 0, a, cluster);
	return false;
}

// A pass's kernels for n rows, captured once into a graph. A one-row pass
// of the 8B model spends about 50 us a layer against 29 of DRAM time
// (run 98): qkv, attention and o wait mostly on their chains (the kernel
// before, the input, its norm), not on weights. Asking L2 to prefetch the
// next kernels' weights did not fill those gaps (runs 99-100, 8B on an
// H200): 8 MB ahead changed nothing, 16 to 64 MB made a step 7-19% slower,
// and prefetching from the attention kernels alone 0-7% slower.
void enqueue(mf_engine *e, int n, int mergeSplits) {
	const mf_config &c = e->c;
	const int qd = c.n_head * c.head_dim, kvd = c.n_kv_head * c.head_dim;
	if (e->first)
		embed<<<(n * c.embd + 255) / 256, 256, 0, e->stream>>>((const uint8_t *)c.tok_embd, c.embd_type, c.embd, e->params,
		                                                     e->devPicks, e->x, n);
	for (int i = 0; i < c.n_layer; i++) {
		const mf_layer &L = e->layers[i];
		const void *bias[3] = {L.bq, L.bk, L.bv};
		launchGemv(e, n, L.wq, L.wk, L.wv, qd, kvd, kvd, c.embd, MF_Q4_0, e->x, (const float *)L.attn_norm, e->qkv, qd + 2 * kvd,
		           kStore, L.bq ? bias : nullptr);
		// O's input is quantized by attention where O is one gemvMMA launch:
		// passes of eight rows of the 8B model 3.62 against 3.65 ms, of
		// sixteen 6.10 against 6.21; of the 32B model 11.52 against 11.70
		// and 19.88 against 20.11 (run 126).
		const bool oneO = n > 1 && oneLaunch(e, MF_Q4_0, qd, nullptr, n);
		const bool quantized = launchAttention(e, L, n, oneO && e->quantO, mergeSplits);
		launchGemv(e, n, L.wo, nullptr, nullptr, c.embd, 0, 0, qd, MF_Q4_0, e->att, nullptr, e->x, c.embd, kAdd, nullptr, quantized);
		launchGemv(e, n, L.gate, L.up, nullptr, c.ffn, c.ffn, 0, c.embd, MF_Q4_0, e->x, (const float *)L.ffn_norm, e->act, c.ffn,
		           kSwiGLU);
		launchGemv(e, n, L.down, nullptr, nullptr, c.embd, 0, 0, c.ffn, MF_Q4_0, e->act, nullptr, e->x, c.embd, kAdd);
	}
	if (e->last)
		launchGemv(e, n, c.output, nullptr, nullptr, c.vocab, 0, 0, c.embd, c.out_type, e->x, (const float *)c.out_norm, e->logits,
		           c.vocab, kStore);
}

// graphFor returns the graph of a pass of n rows, capturing it at first
// use; mergeSplits: the one-row graph whose attention takes that many
// splits a head and merges them in clusters (mf_engine.execMerge).
cudaError_t graphFor(mf_engine *e, int n, cudaGraphExec_t *out, int mergeSplits = 0) {
	const bool merge = mergeSplits > 1 && mergeSplits <= kClusterSplits && n == 1;
	cudaGraphExec_t &slot = merge ? e->execMerge[mergeSplits] : e->exec[n];
	if (!slot) {
		cudaGraph_t graph;
		cudaError_t ce = cudaStreamBeginCapture(e->stream, cudaStreamCaptureModeThreadLocal);
		if (ce != cudaSuccess) return ce;
		enqueue(e, n, merge ? mergeSplits : 0);
		ce = cudaGetLastError();
		const cudaError_t endErr = cudaStreamEndCapture(e->stream, &graph);
		if (ce != cudaSuccess || endErr != cudaSuccess) return ce != cudaSuccess ? ce : endErr;
		ce = cudaGraphInstantiateWithFlags(&slot, graph, 0);
		cudaGraphDestroy(graph);
		if (ce != cudaSuccess) {
			slot = nullptr;
			return ce;
		}
	}
	*out = slot;
	return cudaSuccess;
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
	if (const char *v = getenv("MESHNODE_FUSED_QUANT_O")) e->quantO = atoi(v) != 0;
	if (const char *v = getenv("MESHNODE_FUSED_GROUPS")) mmaGroupsMax = atoi(v) == 1 ? 1 : 2;
	if (const char *v = getenv("MESHNODE_FUSED_LATE")) e->late = atoi(v) != 0;
	if (const char *v = getenv("MESHNODE_FUSED_L2FIRST")) e->l2first = std::max(0, atoi(v));
	if (const char *v = getenv("MESHNODE_FUSED_L2LINES")) e->l2lines = atoi(v) != 0;
	if (const char *v = getenv("MESHNODE_FUSED_L2KINDS")) e->l2kinds = atoi(v);
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
	CE(cudaDeviceGetAttribute(&e->smemOptin, cudaDevAttrMaxSharedMemoryPerBlockOptin, e->c.device));
	CE(cudaDeviceGetAttribute(&e->smemSM, cudaDevAttrMaxSharedMemoryPerMultiprocessor, e->c.device));
	{
		// The target the kernels were built for (codeArch) decides whether
		// they may use PDL and clusters; if they cannot run here at all
		// (built for another GPU), say so now.
		int *d = nullptr;
		CE(cudaMalloc(&d, sizeof(int)));
		codeArch<<<1, 1>>>(d);
		cudaError_t pe = cudaGetLastError();
		if (pe == cudaSuccess) pe = cudaMemcpy(&e->codeArch, d, sizeof(int), cudaMemcpyDeviceToHost);
		cudaFree(d);
		if (pe != cudaSuccess) {
			cudaGetLastError();
			errf(err, errlen, "the fused kernels do not run on this GPU (%s): rebuild them for it with deploy/gpu/build-cuda.sh",
			     cudaGetErrorString(pe));
			return fail();
		}
		if (e->codeArch < 900) e->pdl = 0;
	}
	const mf_config &c = e->c;
	const int qd = c.n_head * c.head_dim, kvd = c.n_kv_head * c.head_dim;
	// Every mat-vec's shape, with a norm where it has one, must fit a
	// block's shared memory: for one row, or the engine fails; for more,
	// maxRows is the most that fit.
	auto fits = [&](int rows) {
		struct {
			int type, k;
			const void *norm;
		} shapes[] = {{MF_Q4_0, c.embd, c.layers[0].attn_norm}, {MF_Q4_0, qd, nullptr}, {MF_Q4_0, c.ffn, nullptr},
		              {c.out_type, c.embd, c.out_norm}};
		// Past one tile, a shape that does not fit runs as two launches
		// (launchGemv).
		for (int i = 0; i < (e->last ? 4 : 3); i++) {
			auto fit = [&](int n) { return fitsRows(shapes[i].type, shapes[i].k, shapes[i].norm, e->threads, n, e->smemSM, e->smemOptin); };
			if (!fit(rows) && !(rows > kTileRows && fit(kTileRows))) return false;
		}
		return true;
	};
	if (!fits(1)) {
		errf(err, errlen, "the mat-vec kernel needs more shared memory than the device's %d bytes a block", e->smemOptin);
		return fail();
	}
	int rowsWanted = kMaxRows;
	if (const char *v = getenv("MESHNODE_FUSED_ROWS")) rowsWanted = std::max(1, std::min(kMaxRows, atoi(v)));
	for (int rows : {kMaxRows, kTileRows, 4, 2})
		if (rows <= rowsWanted && fits(rows)) {
			e->maxRows = rows;
			break;
		}
	for (auto k : {gemv<MF_Q4_0, kThreads, 16>, gemv<MF_Q4_0, kWideThreads, 16>, gemv<MF_Q6_K, kThreads, 16>,
	               gemv<MF_Q6_K, kThreads, 8>, gemv<MF_Q6_K, kThreads, 4>, gemv<MF_Q6_K, kWideThreads, 16>,
	               gemv<MF_Q6_K, kWideThreads, 8>, gemv<MF_Q6_K, kWideThreads, 4>})
		CE(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, e->smemOptin));
	for (auto k : {gemvMMA<kThreads, MF_Q4_0, 1, 1, kMmaStages>, gemvMMA<kThreads, MF_Q6_K, 1, 1, kMmaStages>,
	               gemvMMA<kThreads, MF_Q4_0, 2, 1, kMmaStages>, gemvMMA<kThreads, MF_Q6_K, 2, 1, kMmaStages>,
	               gemvMMA<kWideThreads, MF_Q4_0, 2, 2, 3>, gemvMMA<kWideThreads, MF_Q4_0, 2, 2, 2>,
	               gemvMMA<kWideThreads, MF_Q4_0, 1, 2, 3>, gemvMMA<kWideThreads, MF_Q4_0, 1, 2, 2>})
		CE(cudaFuncSetAttribute(k, cudaFuncAttributeMaxDynamicSharedMemorySize, e->smemOptin));
	if (const char *v = getenv("MESHNODE_FUSED_CLUSTER")) e->cluster = std::max(1, std::min(2, atoi(v)));
	if (e->codeArch < 900) e->cluster = 1; // no clusters in the code (MF_HOPPER)
	e->clusterFfn = clustersFit(e, c.ffn);
	{
		int perSM = 0;
		CE(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&perSM, c.head_dim == 128 ? attention<128> : attention<64>, kAttnThreads, 0));
		int waves = 1;
		if (const char *v = getenv("MESHNODE_FUSED_ATTN_WAVES")) waves = atoi(v);
		if (waves > 0) e->attnSplits = std::max(1, std::min(kSplits, waves * perSM * e->sms / c.n_head));
		const int group = c.n_head / c.n_kv_head;
		auto rowsKernel = c.head_dim == 128 ? (group <= 4 ? attentionRows<128, 4> : attentionRows<128, 8>)
		                                    : (group <= 4 ? attentionRows<64, 4> : attentionRows<64, 8>);
		int perSMRows = 0;
		CE(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&perSMRows, rowsKernel, kAttnThreads, 0));
		e->attnSplitsRows = group <= 8 ? std::max(1, std::min(kSplits, perSMRows * e->sms / (c.n_kv_head * kTileRows)))
		                               : std::max(1, e->attnSplits / 4);
		if (const char *v = getenv("MESHNODE_FUSED_ATTN_ROWS_SPLITS")) e->attnSplitsRows = std::max(1, std::min(kSplits, atoi(v)));
		// Clusters of a head's splits, where the code has them, a split of
		// attnCells takes one round of its warps' loads, and the device
		// takes clusters of that many of its blocks.
		if (const char *f = getenv("MESHNODE_FUSED_ATTN_CLUSTER_FIT")) e->mergeFit = atoi(f) != 0;
		const char *v = getenv("MESHNODE_FUSED_ATTN_CLUSTER");
		if (e->codeArch >= 900 && e->attnSplits >= 2 && e->attnSplits <= kClusterSplits && e->attnCells <= kU * kAttnThreads / 32 &&
		    !(v && atoi(v) == 0)) {
			cudaLaunchConfig_t cfg = {};
			cfg.gridDim = dim3(c.n_head, e->attnSplits, 1), cfg.blockDim = dim3(kAttnThreads);
			cudaLaunchAttribute at = clusterAttr(dim3(1, e->attnSplits, 1));
			cfg.attrs = &at, cfg.numAttrs = 1;
			int clusters = 0;
			if (cudaOccupancyMaxActiveClusters(&clusters, c.head_dim == 128 ? attention<128> : attention<64>, &cfg) == cudaSuccess)
				e->mergeInClusters = clusters > 0;
			cudaGetLastError(); // an error only means no clusters
		}
	}
	const int R = kMaxRows;
	CE(cudaStreamCreateWithFlags(&e->stream, cudaStreamNonBlocking));
	e->cellInts = ((size_t)R * c.cells + 63) / 64 * 64;
	const size_t inputBytes = sizeof(int) * (e->cellInts + kParamInts) + sizeof(float) * R * c.embd;
	e->inputInts = inputBytes / sizeof(int);
	CE(cudaMalloc(&e->input, inputBytes));
	CE(cudaMallocHost(&e->hostInput, inputBytes * kStaging));
	e->params = e->input + e->cellInts;
	e->x = (float *)(e->params + kParamInts);
	CE(cudaMalloc(&e->qkv, sizeof(float) * R * (qd + 2 * kvd)));
	CE(cudaMalloc(&e->att, sizeof(float) * R * qd));
	CE(cudaMalloc(&e->act, sizeof(float) * R * c.ffn));
	CE(cudaMalloc(&e->part, sizeof(float) * R * c.n_head * kSplits * (c.head_dim + 2)));
	CE(cudaMalloc(&e->counter, sizeof(int) * R * c.n_head));
	{
		size_t img = 0;
		for (int k : {c.embd, c.ffn, qd}) {
			GemvArgs a{};
			gemvShape(a, MF_Q4_0, k, kStore, e->threads, kMaxRows);
			img = std::max(img, imageBytes(a));
		}
		CE(cudaMalloc(&e->img, img));
		// Sums of the matrices that gemvMMA splits by columns (kParts):
		// the most rows of any.
		struct {
			int type, k, total;
		} mats[] = {{MF_Q4_0, c.embd, qd + 2 * kvd}, {MF_Q4_0, qd, c.embd}, {MF_Q4_0, c.embd, 2 * c.ffn}, {MF_Q4_0, c.ffn, c.embd},
		            {c.out_type, c.embd, e->last ? c.vocab : 0}};
		size_t kpart = 0;
		for (const auto &m : mats) {
			GemvArgs a{};
			gemvShape(a, m.type, m.k, kStore, e->threads, kTileRows);
			if (a.kParts > 1) kpart = std::max<size_t>(kpart, m.total);
		}
		if (kpart) {
			CE(cudaMalloc(&e->kpart, sizeof(float) * 2 * R * kpart));
			CE(cudaMalloc(&e->kcount, sizeof(int) * (kpart / kMmaRows + 1)));
			CE(cudaMemset(e->kcount, 0, sizeof(int) * (kpart / kMmaRows + 1)));
		}
	}
	CE(cudaMemset(e->counter, 0, sizeof(int) * R * c.n_head));
	const int io = e->last ? (c.vocab > c.embd ? c.vocab : c.embd) : c.embd;
	CE(cudaMallocHost(&e->hostIO, sizeof(float) * R * io));
	if (e->last) {
		CE(cudaMalloc(&e->logits, sizeof(float) * R * c.vocab));
		CE(cudaMallocHost(&e->hostPicks, sizeof(int) * R * kStaging));
		CE(cudaHostGetDevicePointer((void **)&e->hostPicksDev, e->hostPicks, 0));
		CE(cudaMalloc(&e->devPicks, sizeof(int) * R));
		for (cudaEvent_t &ev : e->qDone) CE(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming));
		CE(cudaMalloc(&e->pickV, sizeof(float) * R * kPickBlocks));
		CE(cudaMalloc(&e->pickAt, sizeof(int) * R * kPickBlocks));
	}

	if (const char *v = getenv("MESHNODE_FUSED_PACKED_HEAD"); e->last && c.out_type == MF_Q6_K && !(v && atoi(v) == 0)) {
		// The packed copy (head6) costs the head's bytes again (431 MB for
		// the 8B model), so it is made only where the GPU keeps at least 1
		// GiB, and a sixteenth of its memory, free beside it.
		GemvArgs a{};
		gemvShape(a, MF_Q6_K, c.embd, kStore, 0, 1);
		const int unit = (a.rpp * a.group * kQ6Bytes + 15) / 16 * 16;
		const size_t units = (c.vocab + a.rpp - 1) / a.rpp, bytes = units * unit;
		// Without the memory, or its count, the head stays on gemv: the
		// engine works either way.
		size_t free = 0, total = 0;
		const bool counted = cudaMemGetInfo(&free, &total) == cudaSuccess;
		const size_t keep = std::max<size_t>((size_t)1 << 30, total / 16);
		if (a.passes == 1 && counted && free > bytes + keep && cudaMalloc(&e->head6W, bytes) != cudaSuccess) e->head6W = nullptr;
		cudaGetLastError(); // a failed count or allocation only means gemv
		if (e->head6W) {
			CE(cudaMemsetAsync(e->head6W, 0, bytes, e->stream)); // a last unit's missing rows
			const long long n = (long long)c.vocab * a.spr;
			packHead6<<<(unsigned)((n + 255) / 256), 256, 0, e->stream>>>((const uint8_t *)c.output, e->head6W, c.vocab, a.rowBytes,
			                                                             a.spr, a.rpp, unit);
			CE(cudaGetLastError());
			CE(cudaStreamSynchronize(e->stream));
			int perSM = 0;
			CE(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&perSM, head6, kHeadThreads, head6Smem(c.embd)));
			e->head6Unit = unit, e->head6Grid = e->sms * std::max(1, perSM);
		}
	}

	cudaGraphExec_t one;
	ce = graphFor(e, 1, &one);
	for (int k = e->mergeFit ? 2 : e->attnSplits; e->mergeInClusters && ce == cudaSuccess && k <= e->attnSplits; k++)
		ce = graphFor(e, 1, &one, k);
	if (ce != cudaSuccess) {
		errf(err, errlen, "making the decode graph: %s", cudaGetErrorString(ce));
		return fail();
	}
#undef CE
	*out = e;
	return 0;
}

extern "C" int mf_max_rows(const mf_engine *e) { return e->maxRows; }

extern "C" int mf_step(mf_engine *e, int token, const float *hidden, int pos, int loc, const int32_t *cells, int n,
                       float *out, int out_pinned, char *err, int errlen) {
	return mf_step_rows(e, 1, &token, hidden, &pos, &loc, cells, &n, out, out_pinned, err, errlen);
}

extern "C" int mf_step_rows(mf_engine *e, int rows, const int *tokens, const float *hidden, const int *pos, const int *loc,
                            const int32_t *cells, const int *ncells, float *out, int out_pinned, char *err, int errlen) {
	return mf_step_rows_picks(e, rows, tokens, hidden, pos, loc, cells, ncells, out, out_pinned, nullptr, err, errlen);
}

namespace {

// stagePass checks a pass's input and writes it into staging slot slot:
// the rows' cells, then their parameters, then (not a first stage) their
// hidden states. Tokens -1 take the picks of the pass before, which must
// have had prevRows rows or more. It sets *total to the cells' count and
// *inBytes to the bytes to copy. 0, or 1 with err.
int stagePass(mf_engine *e, int slot, int rows, const int *tokens, const float *hidden, const int *pos, const int *loc,
              const int32_t *cells, const int *ncells, int prevRows, int *totalOut, size_t *inBytes, char *err, int errlen) {
	const mf_config &c = e->c;
	if (rows < 1 || rows > e->maxRows) return errf(err, errlen, "%d rows in a pass (1 to %d)", rows, e->maxRows), 1;
	int total = 0;
	for (int r = 0; r < rows; r++) {
		const int n = ncells[r];
		if (n < 0 || n >= c.cells || loc[r] < 0 || loc[r] >= c.cells || pos[r] < 0)
			return errf(err, errlen, "row %d: position %d, cell %d, %d cells: outside the cache's %d", r, pos[r], loc[r], n, c.cells), 1;
		if (e->first && !(tokens[r] == -1 && r < prevRows) && (tokens[r] < 0 || tokens[r] >= c.vocab))
			return errf(err, errlen, "row %d: token %d outside the vocabulary of %d", r, tokens[r], c.vocab), 1;
		total += n;
	}
	// A cell a row attends to must not be one the pass writes.
	for (int i = 0; i < total; i++) {
		if (cells[i] < 0 || cells[i] >= c.cells)
			return errf(err, errlen, "cache cell %d (of %d) at %d is outside the cache", cells[i], c.cells, i), 1;
		for (int r = 0; r < rows; r++)
			if (cells[i] == loc[r]) return errf(err, errlen, "cache cell %d (of %d) at %d is not an earlier cell", cells[i], c.cells, i), 1;
	}
	for (int r = 0; r < rows; r++)
		for (int q = 0; q < r; q++)
			if (loc[q] == loc[r]) return errf(err, errlen, "rows %d and %d both write cache cell %d", q, r, loc[r]), 1;
	int *hp = e->hostInput + (size_t)slot * e->inputInts + e->cellInts;
	for (int r = 0, off = 0; r < rows; off += ncells[r], r++) {
		int *p = hp + r * kParams;
		p[0] = pos[r], p[1] = loc[r], p[2] = ncells[r], p[3] = e->first ? tokens[r] : 0, p[4] = off - total;
	}
	memcpy(hp - total, cells, sizeof(int) * total);
	*inBytes = sizeof(int) * (total + kParamInts);
	// No hidden states: they come from the device (mf_launch_rows).
	if (!e->first && hidden) {
		memcpy(hp + kParamInts, hidden, sizeof(float) * rows * c.embd);
		*inBytes += sizeof(float) * rows * c.embd;
	}
	*totalOut = total;
	return 0;
}

// launchPass queues a staged pass's input copy and its graph; ncells0 is
// its first row's cells (which pick the graph). With timing, events
// around both.
int launchPass(mf_engine *e, int slot, int rows, int total, size_t inBytes, int ncells0, bool timing, char *err, int errlen,
               const float *inDev = nullptr, cudaEvent_t after = nullptr) {
	CK(cudaSetDevice(e->c.device));
	cudaGraphExec_t exec;
	// The splits a head takes, as attention counts them: two or more of
	// one round each merge in clusters (mf_engine.execMerge).
	const int splits = std::min(e->attnSplits, std::max(1, (ncells0 + e->attnCells - 1) / e->attnCells));
	const bool merge = rows == 1 && e->mergeInClusters && splits > 1 && ncells0 <= e->attnCells * e->attnSplits;
	CK(graphFor(e, rows, &exec, merge ? (e->mergeFit ? splits : e->attnSplits) : 0));
	if (timing && !e->ev0) {
		CK(cudaEventCreate(&e->evIn));
		CK(cudaEventCreate(&e->ev0));
		CK(cudaEventCreate(&e->ev1));
		CK(cudaEventCreate(&e->evOut));
	}
	if (timing) CK(cudaEventRecord(e->evIn, e->stream));
	// A copy, not a first kernel of the graph that reads the pinned
	// buffers over the bus: that kernel took as long (run 148).
	const int *hp = e->hostInput + (size_t)slot * e->inputInts + e->cellInts;
	CK(cudaMemcpyAsync(e->params - total, hp - total, inBytes, cudaMemcpyHostToDevice, e->stream));
	// The hidden states from another stage's pass on this device, once it
	// has written them (mf_launch_rows).
	if (after) CK(cudaStreamWaitEvent(e->stream, after, 0));
	if (inDev) CK(cudaMemcpyAsync(e->x, inDev, sizeof(float) * rows * e->c.embd, cudaMemcpyDeviceToDevice, e->stream));
	if (timing) CK(cudaEventRecord(e->ev0, e->stream));
	std::chrono::steady_clock::time_point tLaunch;
	if (timing) tLaunch = std::chrono::steady_clock::now();
	CK(cudaGraphLaunch(exec, e->stream));
	if (timing) {
		e->launchMs += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - tLaunch).count();
		CK(cudaEventRecord(e->ev1, e->stream));
	}
	return 0;
}

} // namespace

extern "C" int mf_step_rows_picks(mf_engine *e, int rows, const int *tokens, const float *hidden, const int *pos,
                                  const int *loc, const int32_t *cells, const int *ncells, float *out, int out_pinned,
                                  int *picks, char *err, int errlen) {
	const mf_config &c = e->c;
	if (picks && !e->last) return errf(err, errlen, "greedy picks asked of a stage without the output layer"), 1;
	if (e->queued) return errf(err, errlen, "a step while %d queued passes are not waited for", e->queued), 1;
	if (e->launched) return errf(err, errlen, "a step while a launched pass is not finished"), 1;
	if (!e->first && !hidden) return errf(err, errlen, "no hidden states for a stage that does not embed"), 1;
	int total = 0;
	size_t inBytes = 0;
	if (stagePass(e, 0, rows, tokens, hidden, pos, loc, cells, ncells, 0, &total, &inBytes, err, errlen)) return 1;
	const auto t0 = std::chrono::steady_clock::now();
	e->prevRows = 0;
	if (launchPass(e, 0, rows, total, inBytes, ncells[0], e->timing, err, errlen)) return 1;
	const size_t nout = (size_t)rows * (e->last ? c.vocab : c.embd);
	if (picks) {
		// 4 bytes a row cross the bus instead of the vocabulary's logits,
		// and the host scans nothing (128K logits took the host longer
		// than their D2H copy: about 0.1 ms a row on the H200 host).
		// The picks go straight to the pinned buffer, which the host
		// reads once the stream is done: the picks and their copy took
		// 0.014-0.015 ms on the GPU, the picks alone 0.010 (runs 139,
		// 148).
		CK(greedyPicks(e->logits, rows, c.vocab, e->pickV, e->pickAt, e->hostPicksDev, nullptr, e->stream));
	} else {
		CK(cudaMemcpyAsync(out_pinned ? out : e->hostIO, e->last ? e->logits : e->x, sizeof(float) * nout,
		                   cudaMemcpyDeviceToHost, e->stream));
	}
	if (e->timing) CK(cudaEventRecord(e->evOut, e->stream));
	CK(cudaStreamSynchronize(e->stream));
	if (picks)
		memcpy(picks, e->hostPicks, sizeof(int) * rows);
	else if (!out_pinned)
		memcpy(out, e->hostIO, sizeof(float) * nout);
	if (e->timing) {
		float in = 0, ms = 0, outMs = 0;
		CK(cudaEventElapsedTime(&in, e->evIn, e->ev0));
		CK(cudaEventElapsedTime(&ms, e->ev0, e->ev1));
		CK(cudaEventElapsedTime(&outMs, e->ev1, e->evOut));
		e->inMs += in, e->gpuMs += ms, e->outMs += outMs;
		e->wallMs += std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - t0).count();
		if (++e->timed == e->timing) {
			const double n = e->timed;
			fprintf(stderr,
			        "fused steps (%d layers, %d rows last): on the GPU, input copies %.3f ms, graph %.3f ms, then picks or output copy "
			        "%.3f ms; cudaGraphLaunch %.3f ms on the host; mf_step %.3f ms, mean of %d\n",
			        c.n_layer, rows, e->inMs / n, e->gpuMs / n, e->outMs / n, e->launchMs / n, e->wallMs / n, e->timed);
			e->timed = 0, e->inMs = e->gpuMs = e->outMs = e->launchMs = e->wallMs = 0;
		}
	}
	return 0;
}

extern "C" int mf_queue_picks(mf_engine *e, int rows, const int *tokens, const int *pos, const int *loc, const int32_t *cells,
                              const int *ncells, char *err, int errlen) {
	if (!e->first || !e->last) return errf(err, errlen, "passes queued on a stage without both the embedding and the output layer"), 1;
	if (e->launched) return errf(err, errlen, "a pass queued while a launched pass is not finished"), 1;
	if (e->queued == kStaging) return errf(err, errlen, "%d passes queued already", e->queued), 1;
	const int slot = (e->qOldest + e->queued) % kStaging;
	int total = 0;
	size_t inBytes = 0;
	if (stagePass(e, slot, rows, tokens, nullptr, pos, loc, cells, ncells, e->prevRows, &total, &inBytes, err, errlen)) return 1;
	if (launchPass(e, slot, rows, total, inBytes, ncells[0], false, err, errlen)) return 1;
	CK(greedyPicks(e->logits, rows, e->c.vocab, e->pickV, e->pickAt, e->hostPicksDev + slot * kMaxRows, e->devPicks, e->stream));
	CK(cudaEventRecord(e->qDone[slot], e->stream));
	e->qRows[slot] = rows, e->prevRows = rows, e->queued++;
	return 0;
}

extern "C" int mf_wait_picks(mf_engine *e, int *picks, char *err, int errlen) {
	if (!e->queued) return errf(err, errlen, "no queued pass to wait for"), 1;
	const int slot = e->qOldest;
	e->qOldest = (slot + 1) % kStaging, e->queued--;
	CK(cudaEventSynchronize(e->qDone[slot]));
	if (picks) memcpy(picks, e->hostPicks + slot * kMaxRows, sizeof(int) * e->qRows[slot]);
	return 0;
}

extern "C" int mf_launch_rows(mf_engine *e, int rows, const int *tokens, const float *hidden, const float *in_dev, void *after,
                              const int *pos, const int *loc, const int32_t *cells, const int *ncells, float *out_dev,
                              void *done, char *err, int errlen) {
	const mf_config &c = e->c;
	if (e->queued || e->launched) return errf(err, errlen, "a launch while another pass is not waited for"), 1;
	if (e->first && (hidden || in_dev)) return errf(err, errlen, "hidden states into a stage that embeds"), 1;
	if (!e->first && !hidden == !in_dev) return errf(err, errlen, "a stage that does not embed takes its hidden states from the host or the device, one of them"), 1;
	if (!in_dev && after) return errf(err, errlen, "an event to wait for without hidden states on the device"), 1;
	if (e->last && (out_dev || done)) return errf(err, errlen, "hidden states asked of the stage with the output layer"), 1;
	int total = 0;
	size_t inBytes = 0;
	if (stagePass(e, 0, rows, tokens, hidden, pos, loc, cells, ncells, 0, &total, &inBytes, err, errlen)) return 1;
	e->prevRows = 0;
	if (launchPass(e, 0, rows, total, inBytes, ncells[0], false, err, errlen, in_dev, (cudaEvent_t)after)) return 1;
	if (e->last) {
		CK(greedyPicks(e->logits, rows, c.vocab, e->pickV, e->pickAt, e->hostPicksDev, nullptr, e->stream));
	} else if (out_dev) {
		CK(cudaMemcpyAsync(out_dev, e->x, sizeof(float) * rows * c.embd, cudaMemcpyDeviceToDevice, e->stream));
	}
	if (done) CK(cudaEventRecord((cudaEvent_t)done, e->stream));
	e->launched = rows;
	return 0;
}

extern "C" int mf_finish_rows(mf_engine *e, int *picks, float *out, char *err, int errlen) {
	const int rows = e->launched;
	if (!rows) return errf(err, errlen, "no launched pass to finish"), 1;
	if (picks && !e->last) return errf(err, errlen, "greedy picks asked of a stage without the output layer"), 1;
	if (out && e->last) return errf(err, errlen, "hidden states asked of the stage with the output layer"), 1;
	e->launched = 0;
	CK(cudaSetDevice(e->c.device));
	if (out) CK(cudaMemcpyAsync(e->hostIO, e->x, sizeof(float) * rows * e->c.embd, cudaMemcpyDeviceToHost, e->stream));
	CK(cudaStreamSynchronize(e->stream));
	if (picks) memcpy(picks, e->hostPicks, sizeof(int) * rows);
	if (out) memcpy(out, e->hostIO, sizeof(float) * rows * e->c.embd);
	return 0;
}

extern "C" float *mf_device_alloc(mf_engine *e, size_t n) {
	float *p = nullptr;
	if (cudaSetDevice(e->c.device) != cudaSuccess || cudaMalloc(&p, sizeof(float) * n) != cudaSuccess) return nullptr;
	return p;
}

extern "C" void *mf_event_create(mf_engine *e) {
	cudaEvent_t ev = nullptr;
	if (cudaSetDevice(e->c.device) != cudaSuccess || cudaEventCreateWithFlags(&ev, cudaEventDisableTiming) != cudaSuccess) return nullptr;
	return ev;
}

extern "C" void mf_event_destroy(void *ev) {
	if (ev) cudaEventDestroy((cudaEvent_t)ev);
}

namespace {

// setDeviceOf makes the device that holds device pointer like current, and
// says which it is.
cudaError_t setDeviceOf(const void *like, int *device) {
	cudaPointerAttributes pa;
	cudaError_t ce = cudaPointerGetAttributes(&pa, like);
	if (ce == cudaSuccess && pa.type != cudaMemoryTypeDevice) ce = cudaErrorInvalidDevicePointer;
	if (ce == cudaSuccess) ce = cudaSetDevice(pa.device);
	if (ce == cudaSuccess) *device = pa.device;
	return ce;
}

// onDeviceOf makes the device that holds like current: 0, or 1 with err.
int onDeviceOf(const void *like, int *device, char *err, int errlen) {
	const cudaError_t ce = setDeviceOf(like, device);
	if (ce != cudaSuccess) {
		cudaGetLastError();
		return errf(err, errlen, "finding the stage's device: %s", cudaGetErrorString(ce)), 1;
	}
	return 0;
}

} // namespace

extern "C" int mf_handoff_export(const void *like, size_t n, float **buf, void **ev, void *mem, void *evh, char *bus,
                                 char *err, int errlen) {
	*buf = nullptr, *ev = nullptr;
	int device = 0;
	if (onDeviceOf(like, &device, err, errlen)) return 1;
	float *b = nullptr;
	cudaEvent_t e = nullptr;
	const char *doing = "reading the device's PCI bus id";
	cudaError_t ce = cudaDeviceGetPCIBusId(bus, MF_BUS_ID, device);
	if (ce == cudaSuccess) doing = "allocating the buffer", ce = cudaMalloc(&b, sizeof(float) * n);
	if (ce == cudaSuccess) doing = "making the event", ce = cudaEventCreateWithFlags(&e, cudaEventDisableTiming | cudaEventInterprocess);
	if (ce == cudaSuccess) doing = "exporting the buffer", ce = cudaIpcGetMemHandle((cudaIpcMemHandle_t *)mem, b);
	if (ce == cudaSuccess) doing = "exporting the event", ce = cudaIpcGetEventHandle((cudaIpcEventHandle_t *)evh, e);
	if (ce != cudaSuccess) {
		if (e) cudaEventDestroy(e);
		if (b) cudaFree(b);
		cudaGetLastError();
		return errf(err, errlen, "hand-off port: %s: %s", doing, cudaGetErrorString(ce)), 1;
	}
	*buf = b, *ev = e;
	return 0;
}

extern "C" int mf_handoff_import(const void *like, const void *mem, const void *evh, const char *bus, float **buf,
                                 void **ev, char *err, int errlen) {
	*buf = nullptr, *ev = nullptr;
	int device = 0;
	if (onDeviceOf(like, &device, err, errlen)) return 1;
	char own[MF_BUS_ID] = {};
	cudaError_t ce = cudaDeviceGetPCIBusId(own, MF_BUS_ID, device);
	if (ce != cudaSuccess) {
		cudaGetLastError();
		return errf(err, errlen, "hand-off port: reading the device's PCI bus id: %s", cudaGetErrorString(ce)), 1;
	}
	if (strncmp(own, bus, MF_BUS_ID) != 0) return errf(err, errlen, "hand-off port of the GPU at %.32s, this stage's is at %s", bus, own), 1;
	void *b = nullptr;
	cudaEvent_t e = nullptr;
	cudaIpcMemHandle_t mh;
	cudaIpcEventHandle_t eh;
	memcpy(&mh, mem, sizeof mh);
	memcpy(&eh, evh, sizeof eh);
	const char *doing = "opening the buffer";
	ce = cudaIpcOpenMemHandle(&b, mh, cudaIpcMemLazyEnablePeerAccess);
	if (ce == cudaSuccess) doing = "opening the event", ce = cudaIpcOpenEventHandle(&e, eh);
	if (ce != cudaSuccess) {
		if (b) cudaIpcCloseMemHandle(b);
		cudaGetLastError();
		return errf(err, errlen, "hand-off port: %s: %s", doing, cudaGetErrorString(ce)), 1;
	}
	*buf = (float *)b, *ev = e;
	return 0;
}

extern "C" void mf_handoff_close(const void *like, float *buf, void *ev, int imported) {
	int device = 0;
	char err[8];
	if (onDeviceOf(like, &device, err, sizeof err)) return;
	if (ev) cudaEventDestroy((cudaEvent_t)ev);
	if (buf) imported ? cudaIpcCloseMemHandle(buf) : cudaFree(buf);
	cudaGetLastError();
}

extern "C" int mf_event_wait(void *ev, int timeout_ms, char *err, int errlen) {
	const auto t0 = std::chrono::steady_clock::now();
	for (;;) {
		const cudaError_t ce = cudaEventQuery((cudaEvent_t)ev);
		if (ce == cudaSuccess) return 0;
		if (ce != cudaErrorNotReady) {
			cudaGetLastError();
			return errf(err, errlen, "waiting for a hand-off's event: %s", cudaGetErrorString(ce)), -1;
		}
		if (std::chrono::steady_clock::now() - t0 > std::chrono::milliseconds(timeout_ms)) return 1;
		std::this_thread::sleep_for(std::chrono::microseconds(50));
	}
}

extern "C" int mf_handoff_read(const void *like, const float *buf, void *ev, size_t n, float *host, int timeout_ms,
                               char *err, int errlen) {
	int device = 0;
	if (onDeviceOf(like, &device, err, errlen)) return 1;
	switch (mf_event_wait(ev, timeout_ms, err, errlen)) {
	case 1:
		return errf(err, errlen, "the previous stage's hidden states were not written within %d ms", timeout_ms), 1;
	case -1:
		return 1;
	}
	const cudaError_t ce = cudaMemcpy(host, buf, sizeof(float) * n, cudaMemcpyDeviceToHost);
	if (ce != cudaSuccess) {
		cudaGetLastError();
		return errf(err, errlen, "copying a hand-off's hidden states to the host: %s", cudaGetErrorString(ce)), 1;
	}
	return 0;
}

// mf_profile_rows times each kind of kernel of a pass of n rows (the last
// mf_step_rows's), over all layers, on the engine's stream, and prints it:
// for fused_check, not for meshnode. mf_profile: one row.
extern "C" void mf_profile_rows(mf_engine *e, int n) {
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
		printf("    %d× %-10s %8.2f us a launch, %7.1f GB/s (%s)\n", n, name, per * 1e6, bytes / per / 1e9,
		       cudaGetErrorString(cudaGetLastError()));
	};
	const double rq = (double)rowBytes(MF_Q4_0, c.embd), rf = (double)rowBytes(MF_Q4_0, c.ffn);
	// A kind of kernel timed as it runs, then with gemvDebug's bits 1, 2 and
	// both: without quantizing its input, without its dot products, without
	// either.
	auto timeParts = [&](const char *name, double bytes, auto launch) {
		char label[32];
		for (int dbg : {0, 1, 2, 3}) {
			gemvDebug = dbg;
			snprintf(label, sizeof label, dbg ? "%s/%d" : "%s", name, dbg);
			time(label, bytes, launch);
		}
		gemvDebug = 0;
	};
	timeParts("qkv", rq * (qd + 2 * kvd), [&] {
		for (int i = 0; i < c.n_layer; i++) {
			const mf_layer &L = e->layers[i];
			launchGemv(e, n, L.wq, L.wk, L.wv, qd, kvd, kvd, c.embd, MF_Q4_0, e->x, (const float *)L.attn_norm, e->qkv, qd + 2 * kvd, kStore);
		}
	});
	time("attention", 0, [&] {
		for (int i = 0; i < c.n_layer; i++) launchAttention(e, e->layers[i], n);
	});
	time("o", (double)rowBytes(MF_Q4_0, qd) * c.embd, [&] {
		for (int i = 0; i < c.n_layer; i++)
			launchGemv(e, n, e->layers[i].wo, nullptr, nullptr, c.embd, 0, 0, qd, MF_Q4_0, e->att, nullptr, e->qkv, c.embd, kStore);
	});
	time("gate+up", rq * 2 * c.ffn, [&] {
		for (int i = 0; i < c.n_layer; i++) {
			const mf_layer &L = e->layers[i];
			launchGemv(e, n, L.gate, L.up, nullptr, c.ffn, c.ffn, 0, c.embd, MF_Q4_0, e->x, (const float *)L.ffn_norm, e->act, c.ffn, kSwiGLU);
		}
	});
	for (int dbg : {1, 2, 3, 4, 7, 15}) {
		gemvDebug = dbg;
		char name[32];
		snprintf(name, sizeof name, "gate+up/%d", dbg);
		time(name, rq * 2 * c.ffn, [&] {
			for (int i = 0; i < c.n_layer; i++) {
				const mf_layer &L = e->layers[i];
				launchGemv(e, n, L.gate, L.up, nullptr, c.ffn, c.ffn, 0, c.embd, MF_Q4_0, e->x, (const float *)L.ffn_norm, e->act, c.ffn, kSwiGLU);
			}
		});
	}
	gemvDebug = 0;
	time("read", rq * c.ffn, [&] {
		for (int i = 0; i < c.n_layer; i++)
			streamRead<<<e->sms * 4, 512, 0, e->stream>>>((const uint4 *)e->layers[i].gate, (size_t)(rq * c.ffn / 16), (unsigned *)e->counter);
	});
	timeParts("down", rf * c.embd, [&] {
		for (int i = 0; i < c.n_layer; i++)
			launchGemv(e, n, e->layers[i].down, nullptr, nullptr, c.embd, 0, 0, c.ffn, MF_Q4_0, e->act, nullptr, e->qkv, c.embd, kStore);
	});
	if (e->last)
		timeParts("head", (double)rowBytes(c.out_type, c.embd) * c.vocab, [&] {
			for (int i = 0; i < c.n_layer; i++)
				launchGemv(e, n, c.output, nullptr, nullptr, c.vocab, 0, 0, c.embd, c.out_type, e->x, (const float *)c.out_norm, e->logits, c.vocab, kStore);
		});
	cudaEventDestroy(t0), cudaEventDestroy(t1);
}

extern "C" void mf_profile(mf_engine *e) { mf_profile_rows(e, 1); }

// mf_greedy_picks runs greedyPicks on rows × vocab host logits: for
// fused_check, not for meshnode. 0, or a CUDA error.
extern "C" int mf_greedy_picks(const float *logits, int rows, int vocab, int *picks) {
	float *d = nullptr, *pv = nullptr;
	int *dp = nullptr, *pat = nullptr;
	cudaError_t ce = cudaMalloc(&d, sizeof(float) * rows * vocab);
	if (ce == cudaSuccess) ce = cudaMalloc(&dp, sizeof(int) * rows);
	if (ce == cudaSuccess) ce = cudaMalloc(&pv, sizeof(float) * rows * kPickBlocks);
	if (ce == cudaSuccess) ce = cudaMalloc(&pat, sizeof(int) * rows * kPickBlocks);
	if (ce == cudaSuccess) ce = cudaMemcpy(d, logits, sizeof(float) * rows * vocab, cudaMemcpyHostToDevice);
	if (ce == cudaSuccess) ce = greedyPicks(d, rows, vocab, pv, pat, dp, nullptr, nullptr);
	if (ce == cudaSuccess) ce = cudaMemcpy(picks, dp, sizeof(int) * rows, cudaMemcpyDeviceToHost);
	cudaFree(d), cudaFree(dp), cudaFree(pv), cudaFree(pat);
	return ce;
}

extern "C" float *mf_host_alloc(size_t n) {
	float *p = nullptr;
	if (cudaHostAlloc(&p, sizeof(float) * n, cudaHostAllocPortable) != cudaSuccess) return nullptr;
	return p;
}

extern "C" void mf_host_free(float *p) {
	if (p) cudaFreeHost(p);
}

extern "C" void *mf_device_copy(const void *like, const void *host, size_t n, char *err, int errlen) {
	int device = 0;
	cudaError_t ce = setDeviceOf(like, &device);
	void *d = nullptr;
	if (ce == cudaSuccess) ce = cudaMalloc(&d, n);
	if (ce == cudaSuccess) ce = cudaMemcpy(d, host, n, cudaMemcpyHostToDevice);
	if (ce != cudaSuccess) {
		if (d) cudaFree(d);
		cudaGetLastError();
		errf(err, errlen, "copying %zu bytes to the GPU: %s", n, cudaGetErrorString(ce));
		return nullptr;
	}
	return d;
}

extern "C" void mf_device_free(void *p) {
	if (p) cudaFree(p);
}

extern "C" void mf_destroy(mf_engine *e) {
	if (!e) return;
	if (e->stream) cudaStreamSynchronize(e->stream);
	for (cudaGraphExec_t x : e->exec)
		if (x) cudaGraphExecDestroy(x);
	for (cudaGraphExec_t x : e->execMerge)
		if (x) cudaGraphExecDestroy(x);
	cudaFree(e->input), cudaFree(e->qkv), cudaFree(e->att), cudaFree(e->act), cudaFree(e->logits);
	cudaFree(e->part), cudaFree(e->counter), cudaFree(e->img), cudaFree(e->kpart), cudaFree(e->kcount);
	cudaFree(e->pickV), cudaFree(e->pickAt), cudaFree(e->head6W), cudaFree(e->devPicks);
	for (cudaEvent_t ev : e->qDone)
		if (ev) cudaEventDestroy(ev);
	if (e->hostInput) cudaFreeHost(e->hostInput);
	if (e->hostPicks) cudaFreeHost(e->hostPicks);
	if (e->hostIO) cudaFreeHost(e->hostIO);
	for (cudaEvent_t ev : {e->evIn, e->ev0, e->ev1, e->evOut})
		if (ev) cudaEventDestroy(ev);
	if (e->stream) cudaStreamDestroy(e->stream);
	delete[] e->layers;
	delete e;
}
