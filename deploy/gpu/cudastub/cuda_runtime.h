// Declarations of the CUDA runtime API and device intrinsics that
// meshnode's .cu files use, for a syntax and type check with clang's CUDA
// front end where no CUDA toolkit is installed (deploy/gpu/cuda-syntax.sh).
// Nothing here is a definition: it only lets clang parse and type-check
// both the host and the device side. Code that builds for a GPU uses the
// toolkit's own headers (nvcc, deploy/gpu/build-cuda.sh). Add a
// declaration here when the kernels start using a new call.
#pragma once
#include <stdlib.h>
#include <math.h>
#include <stddef.h>
#include <stdint.h>
#include <stddef.h>
#define __global__ __attribute__((global))
#define __device__ __attribute__((device))
#define __host__ __attribute__((host))
#define __shared__ __attribute__((shared))
#define __constant__ __attribute__((constant))
#define __forceinline__ inline __attribute__((always_inline))
#define __launch_bounds__(...) __attribute__((launch_bounds(__VA_ARGS__)))
#define __align__(n) __attribute__((aligned(n)))
#define __restrict__ __restrict
#include <__clang_cuda_builtin_vars.h>
struct dim3 { unsigned x, y, z; __host__ __device__ constexpr dim3(unsigned a = 1, unsigned b = 1, unsigned c = 1) : x(a), y(b), z(c) {} };
struct uint4 { unsigned x, y, z, w; }; struct uint2 { unsigned x, y; }; struct int4 { int x, y, z, w; }; struct uint3 { unsigned x, y, z; };
struct float2 { float x, y; }; struct float4 { float x, y, z, w; };
__host__ __device__ int4 make_int4(int, int, int, int); __host__ __device__ float2 make_float2(float, float); __host__ __device__ uint4 make_uint4(unsigned, unsigned, unsigned, unsigned);
typedef int cudaError_t; enum { cudaSuccess = 0, cudaErrorInvalidDevicePointer = 17, cudaErrorNotReady = 600 };
typedef struct CUst_st *cudaStream_t; typedef struct CUev_st *cudaEvent_t; typedef struct CUg_st *cudaGraph_t; typedef struct CUge_st *cudaGraphExec_t;
enum cudaMemcpyKind { cudaMemcpyHostToDevice = 1, cudaMemcpyDeviceToHost = 2, cudaMemcpyDeviceToDevice = 3 };
enum cudaDeviceAttr { cudaDevAttrMaxSharedMemoryPerBlockOptin = 97, cudaDevAttrMaxSharedMemoryPerMultiprocessor = 81, cudaDevAttrMultiProcessorCount = 16 };
enum cudaFuncAttribute { cudaFuncAttributeMaxDynamicSharedMemorySize = 8 };
enum { cudaStreamNonBlocking = 1, cudaHostAllocPortable = 1 };
enum cudaStreamCaptureMode { cudaStreamCaptureModeThreadLocal = 1 };
enum cudaMemoryType { cudaMemoryTypeDevice = 2 };
struct cudaPointerAttributes { cudaMemoryType type; int device; void *devicePointer; };
enum cudaLaunchAttributeID { cudaLaunchAttributeCooperative = 2, cudaLaunchAttributeClusterDimension = 4, cudaLaunchAttributeProgrammaticStreamSerialization = 5 };
struct cudaLaunchAttributeValue { struct { unsigned x, y, z; } clusterDim; int programmaticStreamSerializationAllowed; int cooperative; };
struct cudaLaunchAttribute { cudaLaunchAttributeID id; cudaLaunchAttributeValue val; };
struct cudaLaunchConfig_t { dim3 gridDim, blockDim; size_t dynamicSmemBytes; cudaStream_t stream; cudaLaunchAttribute *attrs; unsigned numAttrs; };
cudaError_t cudaFree(void *); cudaError_t cudaMalloc(void **, size_t); template <class T> cudaError_t cudaMalloc(T **p, size_t n) { return cudaMalloc((void **)p, n); }
cudaError_t cudaGetLastError(); const char *cudaGetErrorString(cudaError_t);
cudaError_t cudaEventRecord(cudaEvent_t, cudaStream_t = 0); cudaError_t cudaEventCreate(cudaEvent_t *); cudaError_t cudaEventDestroy(cudaEvent_t);
cudaError_t cudaEventElapsedTime(float *, cudaEvent_t, cudaEvent_t); cudaError_t cudaEventSynchronize(cudaEvent_t);
cudaError_t cudaEventCreateWithFlags(cudaEvent_t *, unsigned); constexpr unsigned cudaEventDisableTiming = 2;
cudaError_t cudaMemcpy(void *, const void *, size_t, cudaMemcpyKind); cudaError_t cudaMemcpyAsync(void *, const void *, size_t, cudaMemcpyKind, cudaStream_t = 0);
cudaError_t cudaFreeHost(void *); cudaError_t cudaMallocHost(void **, size_t); template <class T> cudaError_t cudaMallocHost(T **p, size_t n) { return cudaMallocHost((void **)p, n); }
cudaError_t cudaHostAlloc(void **, size_t, unsigned); cudaError_t cudaHostGetDevicePointer(void **, void *, unsigned);
cudaError_t cudaSetDevice(int); cudaError_t cudaDeviceGetAttribute(int *, cudaDeviceAttr, int);
template <class T> cudaError_t cudaOccupancyMaxActiveBlocksPerMultiprocessor(int *, T, int, size_t) { return 0; }
template <class T> cudaError_t cudaOccupancyMaxActiveClusters(int *, T, const cudaLaunchConfig_t *) { return 0; }
template <class T> cudaError_t cudaFuncSetAttribute(T, cudaFuncAttribute, int) { return 0; }
template <class K, class... A> cudaError_t cudaLaunchKernelEx(const cudaLaunchConfig_t *, K, A...) { return 0; }
cudaError_t cudaPointerGetAttributes(cudaPointerAttributes *, const void *); cudaError_t cudaMemset(void *, int, size_t); cudaError_t cudaMemsetAsync(void *, int, size_t, cudaStream_t = 0); cudaError_t cudaMemGetInfo(size_t *, size_t *);
cudaError_t cudaGraphExecDestroy(cudaGraphExec_t); cudaError_t cudaGraphDestroy(cudaGraph_t); cudaError_t cudaGraphLaunch(cudaGraphExec_t, cudaStream_t);
cudaError_t cudaGraphInstantiateWithFlags(cudaGraphExec_t *, cudaGraph_t, unsigned long long);
cudaError_t cudaStreamEndCapture(cudaStream_t, cudaGraph_t *); cudaError_t cudaStreamBeginCapture(cudaStream_t, cudaStreamCaptureMode);
cudaError_t cudaLaunchKernelExC(const cudaLaunchConfig_t *, const void *, void **);
cudaError_t cudaStreamDestroy(cudaStream_t); cudaError_t cudaStreamCreateWithFlags(cudaStream_t *, unsigned); cudaError_t cudaStreamSynchronize(cudaStream_t);
cudaError_t cudaStreamWaitEvent(cudaStream_t, cudaEvent_t, unsigned = 0);
cudaError_t cudaEventQuery(cudaEvent_t); cudaError_t cudaStreamQuery(cudaStream_t); constexpr unsigned cudaEventInterprocess = 4;
struct cudaIpcMemHandle_t { char reserved[64]; }; struct cudaIpcEventHandle_t { char reserved[64]; }; constexpr unsigned cudaIpcMemLazyEnablePeerAccess = 1;
cudaError_t cudaIpcGetMemHandle(cudaIpcMemHandle_t *, void *); cudaError_t cudaIpcOpenMemHandle(void **, cudaIpcMemHandle_t, unsigned); cudaError_t cudaIpcCloseMemHandle(void *);
cudaError_t cudaIpcGetEventHandle(cudaIpcEventHandle_t *, cudaEvent_t); cudaError_t cudaIpcOpenEventHandle(cudaEvent_t *, cudaIpcEventHandle_t);
cudaError_t cudaDeviceGetPCIBusId(char *, int, int); cudaError_t cudaGetDevice(int *);
extern "C" unsigned __cudaPushCallConfiguration(dim3, dim3, size_t = 0, cudaStream_t = 0);
__device__ void __syncthreads(); __device__ void __syncwarp(unsigned = 0xffffffffu); __device__ void __threadfence();
__device__ float __expf(float); __device__ float __fmul_rn(float, float); __device__ int __float2int_rn(float);
__device__ float __shfl_xor_sync(unsigned, float, int); __device__ int __shfl_xor_sync(unsigned, int, int); __device__ unsigned __shfl_xor_sync(unsigned, unsigned, int);
__device__ float __shfl_down_sync(unsigned, float, int); __device__ float __shfl_sync(unsigned, float, int); __device__ int __shfl_sync(unsigned, int, int);
__device__ int __dp4a(int, int, int); __device__ unsigned __vsubss4(unsigned, unsigned); __device__ unsigned __byte_perm(unsigned, unsigned, unsigned);
__device__ float __ldcg(const float *); __device__ uint2 __ldg(const uint2 *); __device__ unsigned __ldg(const unsigned *); __device__ uint4 __ldg(const uint4 *); __device__ float __ldg(const float *);
__device__ size_t __cvta_generic_to_shared(const void *);
__device__ int atomicAdd(int *, int); __device__ unsigned atomicAdd(unsigned *, unsigned);
__device__ float fmaxf(float, float); __device__ float fminf(float, float); __device__ float fabsf(float);
__device__ float fmaf(float, float, float); __device__ float rsqrtf(float); __device__ float sqrtf(float);
__device__ float powf(float, float); __device__ void sincosf(float, float *, float *);
__device__ int min(int, int); __device__ int max(int, int); __device__ unsigned min(unsigned, unsigned);
__host__ __device__ float4 make_float4(float, float, float, float);
cudaError_t cudaHostAlloc(void **, size_t, unsigned); template <class T> cudaError_t cudaHostAlloc(T **p, size_t n, unsigned f) { return cudaHostAlloc((void **)p, n, f); }
cudaError_t cudaConfigureCall(dim3, dim3, size_t = 0, cudaStream_t = 0);
__device__ float4 __ldcg(const float4 *); __device__ int __ldcg(const int *); __device__ void __nanosleep(unsigned);
cudaError_t cudaDeviceSynchronize();
__device__ long long clock64();
