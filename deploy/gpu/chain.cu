// chain measures what the boundaries between a decode step's kernels cost
// at one row, and how much of it one persistent kernel could win back,
// before anyone writes the mat-vecs for one. Each of the 32 layers is five
// phases with the 8B Q4_0 model's bytes (QKV 14.2 MB, an attention-sized
// 256 KB, O 9.4, gate/up 66.1, down 33.0); a phase streams its bytes through
// shared memory with cp.async, as the fused kernels' warps do (4.6 KB a
// warp a step, two stages, two blocks of eight warps a multiprocessor), and
// every block first reads the whole output of the phase before (16 or 56 KB
// of floats), which the fused kernels must wait for. No dot products: the
// times are the copies' and the boundaries' alone. Variants, one run:
//
//   kernels, late    one kernel a phase, PDL, a graph; first copies after the input
//   kernels, early   the same with the first copies before the wait for the kernel before
//   ..., 2/SM        both with blocks as large as the fused kernels', two a multiprocessor
//   persistent B     one cooperative kernel, a grid barrier between phases: gen
//                    (gridSync), count (gridArrive), count/cl2 (gridArrive in clusters of two)
//   persistent B+pf  the same, each warp's first copy of the next phase in flight
//                    while it waits at the barrier (the weights do not depend on it)
//   one stream       all the bytes as one phase: the copies' floor
//
// each with weights and input, weights alone, and neither (the boundaries).
// ggufstage/cuda/README.md has what it measured on an H200 (runs 248-250).
//
//   nvcc -O3 -std=c++17 -gencode arch=compute_90,code=sm_90 -o chain deploy/gpu/chain.cu && ./chain [reps]
#include <cuda_runtime.h>
#include "cudacheck.h"

#include <algorithm>
#include <cstdint>
#include <cstdio>
#include <cstdlib>
#include <vector>

namespace {

constexpr int kWarps = 8, kThreads = 32 * kWarps;
constexpr int kChunk = 4608;              // bytes a warp copies a step: 256 Q4_0 blocks
constexpr int kPieces = kChunk / 16 / 32; // 16-byte copies a lane makes a step
constexpr int kStageBytes = kChunk * 2;   // a warp's two stages
constexpr int kSmem = kWarps * kStageBytes;
constexpr int kPadded = kSmem + 24 * 1024; // about QKV's one-row block in fused.cu
constexpr int kLayers = 32;

// Phase is one kernel's worth of a step: its bytes, and the input it waits for.
struct Phase {
	const uint8_t *w;
	int chunks;
	const float *in; // the phase before's output (the first k floats of its buffer)
	int k;
	float *out; // a float a chunk
};

__device__ __forceinline__ void cpAsync16(void *dst, const void *src) {
	const unsigned d = (unsigned)__cvta_generic_to_shared(dst);
	asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(d), "l"(src));
}
__device__ __forceinline__ void commit() { asm volatile("cp.async.commit_group;\n" ::); }
template <int N> __device__ __forceinline__ void waitGroup() { asm volatile("cp.async.wait_group %0;\n" ::"n"(N)); }
__device__ __forceinline__ void pdlWait() { asm volatile("griddepcontrol.wait;\n" ::: "memory"); }
__device__ __forceinline__ void pdlLaunch() { asm volatile("griddepcontrol.launch_dependents;\n" ::); }

// Warp is one warp's walk over a phase's chunks: chunk gw, gw+W, ...
struct Warp {
	int gw, W, lane;
	uint8_t *stages;
	__device__ int steps(const Phase &p) const { return gw < p.chunks ? (p.chunks - gw + W - 1) / W : 0; }
	__device__ void issue(const Phase &p, int k) const {
		if (k < steps(p)) {
			const uint8_t *src = p.w + (size_t)(gw + k * W) * kChunk;
			uint8_t *dst = stages + (k & 1) * kChunk;
#pragma unroll
			for (int i = 0; i < kPieces; i++) cpAsync16(dst + 16 * (lane + 32 * i), src + 16 * (lane + 32 * i));
		}
		commit();
	}
	// run streams the phase's chunks, the first already issued; each lane
	// sums the words it copied itself, so the wait needs no warp barrier.
	__device__ void run(const Phase &p, float bias) const {
		const int n = steps(p);
		for (int k = 0; k < n; k++) {
			issue(p, k + 1);
			waitGroup<1>();
			const uint4 *mine = reinterpret_cast<const uint4 *>(stages + (k & 1) * kChunk);
			unsigned s = 0;
#pragma unroll
			for (int i = 0; i < kPieces; i++) {
				const uint4 v = mine[lane + 32 * i];
				s += v.x ^ v.y ^ v.z ^ v.w;
			}
			for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
			if (lane == 0) p.out[gw + k * W] = (float)(s & 0xffff) * 1e-6f + bias;
		}
		waitGroup<0>(); // the copy issued past the end (an empty group) or none
	}
};

// inputSum reads the phase's whole input as every fused kernel's block does.
__device__ float inputSum(const Phase &p, float *red) {
	const float4 *in = reinterpret_cast<const float4 *>(p.in);
	float s = 0;
#pragma unroll 4
	for (int i = threadIdx.x; i < p.k / 4; i += kThreads) {
		const float4 v = in[i];
		s += v.x + v.y + v.z + v.w;
	}
	for (int o = 16; o; o >>= 1) s += __shfl_xor_sync(0xffffffffu, s, o);
	if ((threadIdx.x & 31) == 0) red[threadIdx.x >> 5] = s;
	__syncthreads();
	float t = 0;
	for (int w = 0; w < kWarps; w++) t += red[w];
	__syncthreads();
	return t * 1e-9f;
}

__device__ Warp warpOf(uint8_t *smem) {
	const int warp = threadIdx.x >> 5;
	return Warp{(int)blockIdx.x * kWarps + warp, (int)gridDim.x * kWarps, (int)threadIdx.x & 31, smem + warp * kStageBytes};
}

__global__ void __launch_bounds__(kThreads, 2) phaseKernel(Phase p, int early) {
	extern __shared__ __align__(16) uint8_t smem[];
	__shared__ float red[kWarps];
	const Warp w = warpOf(smem);
	pdlLaunch();
	if (early) w.issue(p, 0);
	pdlWait();
	const float bias = inputSum(p, red);
	if (!early) w.issue(p, 0);
	w.run(p, bias);
}

// gridSync is a sense-free barrier of all the grid's blocks: a count and a
// generation that the last arrival bumps.
__device__ void gridSync(unsigned *count, unsigned *gen) {
	__syncthreads();
	if (threadIdx.x == 0) {
		unsigned g, old;
		asm volatile("ld.acquire.gpu.u32 %0, [%1];\n" : "=r"(g) : "l"(gen) : "memory");
		__threadfence();
		asm volatile("atom.acq_rel.gpu.add.u32 %0, [%1], 1;\n" : "=r"(old) : "l"(count) : "memory");
		if (old == gridDim.x - 1) {
			asm volatile("st.relaxed.gpu.u32 [%0], 0;\n" ::"l"(count) : "memory");
			asm volatile("st.release.gpu.u32 [%0], %1;\n" ::"l"(gen), "r"(g + 1) : "memory");
		} else {
			unsigned v;
			do asm volatile("ld.acquire.gpu.u32 %0, [%1];\n" : "=r"(v) : "l"(gen) : "memory");
			while (v == g);
		}
	}
	__syncthreads();
}

// gridArrive is a barrier on one count that only grows: each block adds one
// without waiting for the answer, then polls, backing off, until all the
// blocks of this barrier (the target) have arrived. In clusters, a
// cluster's blocks meet in hardware first and one of them counts for all.
template <int CLUSTER> __device__ void gridArrive(unsigned *count, unsigned target) {
	if constexpr (CLUSTER > 1) asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
	else __syncthreads();
	unsigned rank = 0;
	if constexpr (CLUSTER > 1) asm volatile("mov.u32 %0, %%cluster_ctarank;\n" : "=r"(rank));
	if (threadIdx.x == 0 && rank == 0) {
		__threadfence();
		asm volatile("red.release.gpu.global.add.u32 [%0], 1;\n" ::"l"(count) : "memory");
		unsigned v;
		for (;;) {
			asm volatile("ld.acquire.gpu.u32 %0, [%1];\n" : "=r"(v) : "l"(count) : "memory");
			if ((int)(v - target) >= 0) break;
			__nanosleep(32);
		}
	}
	if constexpr (CLUSTER > 1) asm volatile("barrier.cluster.arrive.release.aligned;\nbarrier.cluster.wait.acquire.aligned;\n" ::: "memory");
	else __syncthreads();
}

// persistent runs every phase in one grid; BARRIER picks the grid barrier:
// 0 gridSync, 1 gridArrive, 2 gridArrive in clusters of two.
template <int BARRIER>
__global__ void __launch_bounds__(kThreads, 2) persistent(const Phase *phases, int n, unsigned *bar, unsigned base, int prefetch) {
	extern __shared__ __align__(16) uint8_t smem[];
	__shared__ float red[kWarps];
	const Warp w = warpOf(smem);
	const unsigned arrivals = BARRIER == 2 ? gridDim.x / 2 : gridDim.x;
	for (int i = 0; i < n; i++) {
		const Phase p = phases[i];
		const float bias = inputSum(p, red);
		if (i == 0 || !prefetch) w.issue(p, 0);
		w.run(p, bias);
		if (i + 1 == n) break;
		if (prefetch) w.issue(phases[i + 1], 0);
		if constexpr (BARRIER == 0) gridSync(bar, bar + 32);
		else gridArrive<BARRIER == 2 ? 2 : 1>(bar + 64, base + arrivals * (i + 1));
	}
}

} // namespace

int main(int argc, char **argv) {
	const int reps = argc > 1 ? atoi(argv[1]) : 20;
	int sms = 0;
	CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
	CHECK(cudaFuncSetAttribute(phaseKernel, cudaFuncAttributeMaxDynamicSharedMemorySize, kPadded));
	CHECK(cudaFuncSetAttribute(persistent<0>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
	CHECK(cudaFuncSetAttribute(persistent<1>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
	CHECK(cudaFuncSetAttribute(persistent<2>, cudaFuncAttributeMaxDynamicSharedMemorySize, kSmem));
	int perSM = 0;
	CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&perSM, persistent<0>, kThreads, kSmem));
	if (perSM < 2) {
		fprintf(stderr, "chain: %d blocks a multiprocessor fit, want 2\n", perSM);
		return 1;
	}
	const int grid = 2 * sms;

	// The layer's bytes, each matrix's rows of Q4_0 (18 bytes a block of 32).
	const size_t qkv = 6144ull * 4096 / 32 * 18, attn = 262144, o = 4096ull * 4096 / 32 * 18,
	             gu = 28672ull * 4096 / 32 * 18, down = 4096ull * 14336 / 32 * 18;
	const size_t sizes[] = {qkv, attn, o, gu, down};
	const int ks[] = {4096, 4096, 4096, 4096, 14336};
	size_t layer = 0;
	for (size_t s : sizes) layer += s;
	const size_t total = layer * kLayers;
	uint8_t *w;
	CHECK(cudaMalloc(&w, total));
	CHECK(cudaMemset(w, 7, total));
	const int maxOut = (int)(gu / kChunk);
	std::vector<float *> outs(5);
	for (auto &b : outs) {
		CHECK(cudaMalloc(&b, maxOut * sizeof(float)));
		CHECK(cudaMemset(b, 0, maxOut * sizeof(float)));
	}
	cudaStream_t s;
	CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
	cudaEvent_t e0, e1;
	CHECK(cudaEventCreate(&e0));
	CHECK(cudaEventCreate(&e1));
	auto timeIt = [&](auto &&launch) {
		launch();
		CHECK(cudaStreamSynchronize(s));
		std::vector<double> us;
		for (int r = 0; r < reps; r++) {
			CHECK(cudaEventRecord(e0, s));
			launch();
			CHECK(cudaEventRecord(e1, s));
			CHECK(cudaEventSynchronize(e1));
			float ms = 0;
			CHECK(cudaEventElapsedTime(&ms, e0, e1));
			us.push_back(ms * 1e3);
		}
		return median(us);
	};

	unsigned *bar;
	CHECK(cudaMalloc(&bar, 96 * sizeof(unsigned)));
	CHECK(cudaMemset(bar, 0, 96 * sizeof(unsigned)));
	unsigned arrived = 0; // gridArrive's count so far: each launch's targets start there
	Phase *dPhases;
	CHECK(cudaMalloc(&dPhases, kLayers * 5 * sizeof(Phase)));
	const double perLayer = 1.0 / kLayers;
	printf("chain: %d layers of %.1f MB in 5 phases, %d blocks of %d threads, %d reps (medians)\n", kLayers,
	       layer / 1e6, grid, kThreads, reps);
	// Three runs of the variants: the whole phases; without their input (what
	// waiting for it costs); with neither bytes nor input (the boundaries).
	for (int mode = 0; mode < 3; mode++) {
		const bool bytes = mode < 2, input = mode == 0;
		printf("%s\n", mode == 0 ? "weights and input:" : mode == 1 ? "weights, no input:" : "neither (the boundaries alone):");
		std::vector<Phase> phases;
		size_t off = 0;
		for (int l = 0; l < kLayers; l++)
			for (int j = 0; j < 5; j++) {
				const int prev = (j + 4) % 5;
				phases.push_back(Phase{w + off, bytes ? (int)(sizes[j] / kChunk) : 0, outs[prev], input ? ks[j] : 0, outs[j]});
				off += sizes[j] / kChunk * kChunk;
			}
		CHECK(cudaMemcpy(dPhases, phases.data(), phases.size() * sizeof(Phase), cudaMemcpyHostToDevice));

		auto graphOf = [&](int early, int smem) {
			cudaGraph_t g;
			CHECK(cudaStreamBeginCapture(s, cudaStreamCaptureModeThreadLocal));
			for (const Phase &p : phases) {
				cudaLaunchConfig_t cfg = {};
				cfg.gridDim = grid, cfg.blockDim = kThreads, cfg.dynamicSmemBytes = smem, cfg.stream = s;
				cudaLaunchAttribute attr = {};
				attr.id = cudaLaunchAttributeProgrammaticStreamSerialization;
				attr.val.programmaticStreamSerializationAllowed = 1;
				cfg.attrs = &attr, cfg.numAttrs = 1;
				CHECK(cudaLaunchKernelEx(&cfg, phaseKernel, p, early));
			}
			CHECK(cudaStreamEndCapture(s, &g));
			cudaGraphExec_t x;
			CHECK(cudaGraphInstantiateWithFlags(&x, g, 0));
			CHECK(cudaGraphDestroy(g));
			return x;
		};
		// kPadded: blocks as large as the fused kernels' (the norm's copy and
		// the quantized input beside the stages), so that the next kernel's
		// blocks cannot start beside two of this one's.
		for (int smem : {kSmem, kPadded})
			for (int early = 0; early < 2; early++) {
				cudaGraphExec_t x = graphOf(early, smem);
				const double us = timeIt([&] { CHECK(cudaGraphLaunch(x, s)); });
				printf("  kernels, %-5s%-7s    %8.1f us a step, %6.2f us a layer\n", early ? "early" : "late",
				       smem == kSmem ? "" : ", 2/SM", us, us * perLayer);
				CHECK(cudaGraphExecDestroy(x));
			}
		const char *barriers[] = {"gen", "count", "count/cl2"};
		for (int kind = 0; kind < 3; kind++)
			for (int prefetch = 0; prefetch < 2; prefetch++) {
				const int n = (int)phases.size();
				const double us = timeIt([&] {
					unsigned base = arrived;
					void *args[] = {&dPhases, (void *)&n, &bar, &base, &prefetch};
					cudaLaunchConfig_t cfg = {};
					cfg.gridDim = grid, cfg.blockDim = kThreads, cfg.dynamicSmemBytes = kSmem, cfg.stream = s;
					cudaLaunchAttribute attrs[2] = {};
					attrs[0].id = cudaLaunchAttributeCooperative;
					attrs[0].val.cooperative = 1;
					attrs[1].id = cudaLaunchAttributeClusterDimension;
					attrs[1].val.clusterDim.x = kind == 2 ? 2 : 1, attrs[1].val.clusterDim.y = 1, attrs[1].val.clusterDim.z = 1;
					cfg.attrs = attrs, cfg.numAttrs = 2;
					const void *fn = kind == 0 ? (const void *)persistent<0> : kind == 1 ? (const void *)persistent<1> : (const void *)persistent<2>;
					CHECK(cudaLaunchKernelExC(&cfg, fn, args));
					if (kind > 0) arrived += (unsigned)(kind == 2 ? grid / 2 : grid) * (n - 1);
				});
				printf("  persistent %-9s%-3s %8.1f us a step, %6.2f us a layer\n", barriers[kind], prefetch ? "+pf" : "", us, us * perLayer);
			}
		if (mode == 0) {
			Phase all{w, (int)(off / kChunk), outs[4], 4096, nullptr};
			float *big;
			CHECK(cudaMalloc(&big, (off / kChunk) * sizeof(float)));
			all.out = big;
			const double us = timeIt([&] {
				phaseKernel<<<grid, kThreads, kSmem, s>>>(all, 0);
				CHECK(cudaGetLastError());
			});
			printf("  one stream          %8.1f us a step, %6.2f us a layer, %.0f GB/s\n", us, us * perLayer,
			       off / (us * 1e-6) / 1e9);
		}
	}
	return 0;
}
