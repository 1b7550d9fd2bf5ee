// handover measures what a GPU costs two processes that take turns on it,
// as two pipeline stages on one GPU do: each turn, one process runs a
// kernel of a fixed length and waits for it, then wakes the other through
// a pipe. The same turns in one process (two streams of one context), and
// the pipe alone, give the references measured in the same run:
//
//   nvcc -O2 -std=c++17 -o handover deploy/gpu/handover.cu && ./handover [kernel_us] [turns]
//
// The handover is what a turn of two processes costs beyond a turn of one
// and the pipe's hop between processes: the switch between the two
// processes' contexts, which the GPU time-slices (without MPS).
#include <cuda_runtime.h>
#include "cudacheck.h"

#include <algorithm>
#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <sys/wait.h>
#include <unistd.h>
#include <vector>

namespace {

// spin keeps every block busy for about ns nanoseconds.
__global__ void spin(long long ns, int *sink) {
	const long long t0 = clock64();
	// clock64 counts SM cycles: ~1.98 GHz on an H200 at its top clock; the
	// host side measures the real length (see kernelUs).
	while ((clock64() - t0) * 1000 / 1980 < ns) {
	}
	if (threadIdx.x == 0 && blockIdx.x == 0) *sink = 1;
}

using clk = std::chrono::steady_clock;

struct Gpu {
	cudaStream_t s;
	int *sink;
	int sms;
	long long ns;
	Gpu(long long ns_) : ns(ns_) {
		CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
		CHECK(cudaMalloc(&sink, sizeof(int)));
		CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, 0));
	}
	void turn() {
		spin<<<sms, 128, 0, s>>>(ns, sink);
		CHECK(cudaStreamSynchronize(s));
	}
};

void writeByte(int fd) {
	char c = 1;
	if (write(fd, &c, 1) != 1) exit(1);
}
void readByte(int fd) {
	char c;
	if (read(fd, &c, 1) != 1) exit(1);
}

} // namespace

int main(int argc, char **argv) {
	const double kernelUs = argc > 1 ? atof(argv[1]) : 200;
	const int turns = argc > 2 ? atoi(argv[2]) : 2000;
	const long long ns = (long long)(kernelUs * 1000);

	// The pipe alone: one turn is a write and a read in each direction / 2.
	int ab[2], ba[2];
	if (pipe(ab) || pipe(ba)) return 1;
	double pipeUs = 0;
	{
		pid_t pid = fork();
		if (pid == 0) {
			for (int i = 0; i < turns; i++) readByte(ab[0]), writeByte(ba[1]);
			_exit(0);
		}
		std::vector<double> t;
		for (int i = 0; i < turns; i++) {
			auto t0 = clk::now();
			writeByte(ab[1]), readByte(ba[0]);
			t.push_back(std::chrono::duration<double, std::micro>(clk::now() - t0).count() / 2);
		}
		waitpid(pid, nullptr, 0);
		pipeUs = median(t);
	}

	// Two processes, each its own context, taking turns. fork before any
	// CUDA call: a CUDA context does not survive fork.
	double twoUs = 0;
	{
		pid_t pid = fork();
		if (pid == 0) {
			Gpu g(ns);
			g.turn(); // warm
			writeByte(ba[1]);
			for (int i = 0; i < turns; i++) readByte(ab[0]), g.turn(), writeByte(ba[1]);
			_exit(0);
		}
		Gpu g(ns);
		g.turn();
		readByte(ba[0]); // the child is ready
		std::vector<double> t;
		for (int i = 0; i < turns; i++) {
			auto t0 = clk::now();
			g.turn();
			writeByte(ab[1]);
			readByte(ba[0]);
			t.push_back(std::chrono::duration<double, std::micro>(clk::now() - t0).count() / 2);
		}
		int st = 0;
		waitpid(pid, &st, 0);
		if (!WIFEXITED(st) || WEXITSTATUS(st) != 0) return fprintf(stderr, "child failed\n"), 1;
		twoUs = median(t);
	}

	// One process, two streams, the same turns and the same pipe hops (to
	// itself, through a thread-free write/read pair).
	double oneUs = 0, kernelReal = 0;
	{
		Gpu a(ns), b(ns);
		a.turn(), b.turn();
		std::vector<double> t, k;
		for (int i = 0; i < turns; i++) {
			auto t0 = clk::now();
			a.turn();
			auto t1 = clk::now();
			writeByte(ab[1]), readByte(ab[0]);
			b.turn();
			writeByte(ba[1]), readByte(ba[0]);
			t.push_back(std::chrono::duration<double, std::micro>(clk::now() - t0).count() / 2);
			k.push_back(std::chrono::duration<double, std::micro>(t1 - t0).count());
		}
		oneUs = median(t);
		kernelReal = median(k);
	}
	printf("turns of a %.0f us kernel (%d turns, medians): a kernel and its wait %.1f us in one process; pipe hop %.1f us\n",
	       kernelUs, turns, kernelReal, pipeUs);
	printf("  one process, two streams: %.1f us a turn\n", oneUs);
	printf("  two processes:            %.1f us a turn: %.1f us more than one process and the pipe hop, the GPU's handover between processes\n",
	       twoUs, twoUs - oneUs - pipeUs);
	return 0;
}
