// See cuda_runtime.h: declarations for deploy/gpu/cuda-syntax.sh only.
#pragma once
#include "cuda_runtime.h"
struct __half { unsigned short x; }; struct __half2 { __half x, y; };
__host__ __device__ __half __float2half(float); __host__ __device__ float __half2float(__half); __device__ float2 __half22float2(__half2);
__device__ __half __ushort_as_half(unsigned short);
