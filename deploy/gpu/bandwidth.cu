// bandwidth measures device-to-device copy bandwidth: the physical floor of
// decode time is model bytes / this (decode streams every weight once per
// token). Build: nvcc -O2 -o bandwidth bandwidth.cu
#include <cstdio>
#include <cuda_runtime.h>

int main() {
    const size_t n = size_t(4) << 30; // 4 GiB, far beyond L2
    void *a, *b;
    if (cudaMalloc(&a, n) != cudaSuccess || cudaMalloc(&b, n) != cudaSuccess) {
        fprintf(stderr, "cudaMalloc failed\n");
        return 1;
    }
    cudaMemset(a, 1, n);
    cudaEvent_t s, e;
    cudaEventCreate(&s);
    cudaEventCreate(&e);
    cudaMemcpy(b, a, n, cudaMemcpyDeviceToDevice); // warm up
    const int reps = 10;
    cudaEventRecord(s);
    for (int i = 0; i < reps; i++) cudaMemcpy(b, a, n, cudaMemcpyDeviceToDevice);
    cudaEventRecord(e);
    cudaEventSynchronize(e);
    float ms = 0;
    cudaEventElapsedTime(&ms, s, e);
    // a copy reads n bytes and writes n bytes
    printf("%.1f GB/s\n", 2.0 * n * reps / (ms / 1e3) / 1e9);
    return 0;
}
