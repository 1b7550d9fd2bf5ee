// What the stand-alone CUDA programs (deploy/gpu/*.cu and
// ggufstage/cuda/fused_check.cu) share: CHECK, which ends the program on a
// failed CUDA call with where and why, and median.
#pragma once

#include <cuda_runtime.h>

#include <algorithm>
#include <cstdio>
#include <cstdlib>
#include <vector>

#define CHECK(call)                                                                                                \
	do {                                                                                                           \
		cudaError_t e_ = (call);                                                                                   \
		if (e_ != cudaSuccess) {                                                                                   \
			fprintf(stderr, "%s:%d %s: %s\n", __FILE__, __LINE__, #call, cudaGetErrorString(e_));                   \
			exit(1);                                                                                               \
		}                                                                                                          \
	} while (0)

inline double median(std::vector<double> v) {
	std::sort(v.begin(), v.end());
	return v[v.size() / 2];
}
