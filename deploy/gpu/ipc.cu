// ipc checks what a hand-off between two processes on one GPU through CUDA
// interprocess memory and events does, before meshnode's stages rely on it:
// a first process (the child, "A") writes each turn's values into a buffer
// it exported, records an event it exported and tells the second ("B",
// the parent) through a pipe without waiting for its GPU; B queues a wait
// on the event, a copy out of the buffer and a check of every value.
//
//   nvcc -O2 -std=c++17 -o ipc deploy/gpu/ipc.cu && ./ipc [turns] [landing|plain]
//
// It reports: the values B saw wrong (must be 0), a turn's time handed
// over on the device against through both hosts (the same spin kernels on
// either side), and what becomes of B's wait when A is killed after
// queueing a long kernel before its copy and the event's record: its copy
// into its own buffer, or with landing into one B exported. With plain,
// no IPC at all: what becomes of B's own kernels when A is killed in the
// middle of one of its own.
#include <cuda_runtime.h>
#include "cudacheck.h"

#include <chrono>
#include <cerrno>
#include <csignal>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <sys/wait.h>
#include <unistd.h>
#include <vector>

namespace {

constexpr int kFloats = 4096 * 8; // eight rows of an 8B model's hidden state

__global__ void spin(long long ns) {
	const long long t0 = clock64();
	while ((clock64() - t0) * 1000 / 1980 < ns) {
	}
}

__global__ void fill(float *p, int n, int turn) {
	for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x) p[i] = turn * 1000.0f + i;
}

__global__ void check(const float *p, int n, int turn, int *bad) {
	for (int i = blockIdx.x * blockDim.x + threadIdx.x; i < n; i += gridDim.x * blockDim.x)
		if (p[i] != turn * 1000.0f + i) atomicAdd(bad, 1);
}

void full(int fd, void *p, size_t n) {
	char *b = (char *)p;
	while (n) {
		ssize_t k = read(fd, b, n);
		if (k <= 0) {
			fprintf(stderr, "ipc: pipe read: %s\n", k == 0 ? "end of file" : strerror(errno));
			exit(1);
		}
		b += k, n -= k;
	}
}

void put(int fd, const void *p, size_t n) {
	const char *b = (const char *)p;
	while (n) {
		ssize_t k = write(fd, b, n);
		if (k <= 0) {
			fprintf(stderr, "ipc: pipe write: %s\n", strerror(errno));
			exit(1);
		}
		b += k, n -= k;
	}
}

double ms(std::chrono::steady_clock::time_point a) {
	return std::chrono::duration<double, std::milli>(std::chrono::steady_clock::now() - a).count();
}

// freshStream reports whether B's context still works after A's death: a
// fill and a check of y on a new stream (bad counts the values wrong).
cudaError_t freshStream(const char *who, float *y, int *bad) {
	cudaStream_t fresh;
	cudaError_t fe = cudaStreamCreateWithFlags(&fresh, cudaStreamNonBlocking);
	*bad = 0;
	if (fe == cudaSuccess) {
		fill<<<64, 256, 0, fresh>>>(y, kFloats, 7);
		check<<<64, 256, 0, fresh>>>(y, kFloats, 7, bad);
		fe = cudaStreamSynchronize(fresh);
	}
	printf("%s: then a fresh stream of B: %s, %d values wrong\n", who, cudaGetErrorString(fe), *bad);
	return fe;
}

// Commands A takes from B, one int each.
enum { cmdDevice = 1, cmdHost = 2, cmdKill = 3, cmdEnd = 4 };

// first is process A: it answers each command with its side of a turn.
void first(int in, int out) {
	CHECK(cudaSetDevice(0));
	cudaStream_t s;
	CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
	float *buf, *x, *host;
	CHECK(cudaMalloc(&buf, sizeof(float) * kFloats));
	CHECK(cudaMalloc(&x, sizeof(float) * kFloats));
	CHECK(cudaMallocHost(&host, sizeof(float) * kFloats));
	cudaEvent_t ev;
	CHECK(cudaEventCreateWithFlags(&ev, cudaEventDisableTiming | cudaEventInterprocess));
	cudaIpcMemHandle_t mh;
	cudaIpcEventHandle_t eh;
	CHECK(cudaIpcGetMemHandle(&mh, buf));
	CHECK(cudaIpcGetEventHandle(&eh, ev));
	put(out, &mh, sizeof mh);
	put(out, &eh, sizeof eh);
	// B's own buffer, which A writes into in the landing kill test.
	cudaIpcMemHandle_t lh;
	full(in, &lh, sizeof lh);
	void *landing;
	CHECK(cudaIpcOpenMemHandle(&landing, lh, cudaIpcMemLazyEnablePeerAccess));
	for (;;) {
		int cmd[4]; // command, turn, spin µs, into B's buffer
		full(in, cmd, sizeof cmd);
		const long long ns = cmd[2] * 1000LL;
		switch (cmd[0]) {
		case cmdDevice:
			spin<<<132, 32, 0, s>>>(ns);
			fill<<<64, 256, 0, s>>>(x, kFloats, cmd[1]);
			CHECK(cudaMemcpyAsync(buf, x, sizeof(float) * kFloats, cudaMemcpyDeviceToDevice, s));
			CHECK(cudaEventRecord(ev, s));
			put(out, &cmd[1], sizeof(int)); // before the GPU is done: B's wait orders it
			CHECK(cudaStreamSynchronize(s));
			break;
		case cmdHost:
			spin<<<132, 32, 0, s>>>(ns);
			fill<<<64, 256, 0, s>>>(x, kFloats, cmd[1]);
			CHECK(cudaMemcpyAsync(host, x, sizeof(float) * kFloats, cudaMemcpyDeviceToHost, s));
			CHECK(cudaStreamSynchronize(s));
			put(out, host, sizeof(float) * kFloats);
			break;
		case cmdKill:
			spin<<<132, 32, 0, s>>>(ns);
			fill<<<64, 256, 0, s>>>(x, kFloats, cmd[1]);
			CHECK(cudaMemcpyAsync(cmd[3] ? landing : buf, x, sizeof(float) * kFloats, cudaMemcpyDeviceToDevice, s));
			CHECK(cudaEventRecord(ev, s));
			put(out, &cmd[1], sizeof(int));
			kill(getpid(), SIGKILL);
			break;
		case cmdEnd:
			CHECK(cudaStreamSynchronize(s));
			return;
		}
	}
}

// second is process B: it drives the turns and checks them.
int second(int in, int out, int turns, pid_t child, bool intoB) {
	cudaIpcMemHandle_t mh;
	cudaIpcEventHandle_t eh;
	full(in, &mh, sizeof mh);
	full(in, &eh, sizeof eh);
	CHECK(cudaSetDevice(0));
	float *landing;
	CHECK(cudaMalloc(&landing, sizeof(float) * kFloats));
	cudaIpcMemHandle_t lh;
	CHECK(cudaIpcGetMemHandle(&lh, landing));
	put(out, &lh, sizeof lh);
	cudaStream_t s;
	CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
	void *remote;
	cudaEvent_t ev;
	CHECK(cudaIpcOpenMemHandle(&remote, mh, cudaIpcMemLazyEnablePeerAccess));
	CHECK(cudaIpcOpenEventHandle(&ev, eh));
	float *y, *host;
	int *bad;
	CHECK(cudaMalloc(&y, sizeof(float) * kFloats));
	CHECK(cudaMallocHost(&host, sizeof(float) * kFloats));
	CHECK(cudaMallocHost(&bad, sizeof(int)));
	*bad = 0;
	const int us = 800; // each side's spin: about a stage's pass of an 8B model
	int wrong = 0;
	std::vector<double> dev, hst;
	for (int t = 0; t < 2 * turns; t++) {
		const bool onDevice = t % 2 == 0;
		const int cmd[4] = {onDevice ? cmdDevice : cmdHost, t, us, 0};
		const auto t0 = std::chrono::steady_clock::now();
		put(out, cmd, sizeof cmd);
		if (onDevice) {
			int turn;
			full(in, &turn, sizeof turn);
			CHECK(cudaStreamWaitEvent(s, ev, 0));
			CHECK(cudaMemcpyAsync(y, remote, sizeof(float) * kFloats, cudaMemcpyDeviceToDevice, s));
		} else {
			full(in, host, sizeof(float) * kFloats);
			CHECK(cudaMemcpyAsync(y, host, sizeof(float) * kFloats, cudaMemcpyHostToDevice, s));
		}
		spin<<<132, 32, 0, s>>>(us * 1000LL);
		check<<<64, 256, 0, s>>>(y, kFloats, t, bad);
		CHECK(cudaStreamSynchronize(s));
		(onDevice ? dev : hst).push_back(ms(t0));
		if (*bad) {
			wrong += *bad;
			*bad = 0;
		}
	}
	printf("ipc: %d turns each way, each side spinning %d us: %d values wrong\n", turns, us, wrong);
	printf("ipc: a turn took %.3f ms handed over on the device, %.3f through both hosts (medians), %.3f ms less\n",
	       median(dev), median(hst), median(hst) - median(dev));
	// A killed with its record queued behind a half-second kernel, and
	// its copy into its own buffer or into B's.
	const int cmd[4] = {cmdKill, 2 * turns, 500000, intoB};
	put(out, cmd, sizeof cmd);
	int turn;
	full(in, &turn, sizeof turn);
	CHECK(cudaStreamWaitEvent(s, ev, 0));
	CHECK(cudaMemcpyAsync(y, intoB ? (void *)landing : remote, sizeof(float) * kFloats, cudaMemcpyDeviceToDevice, s));
	int status = 0;
	waitpid(child, &status, 0);
	const auto t0 = std::chrono::steady_clock::now();
	cudaError_t eq = cudaErrorNotReady, sq = cudaErrorNotReady;
	while (ms(t0) < 5000) {
		eq = cudaEventQuery(ev), sq = cudaStreamQuery(s);
		if (sq != cudaErrorNotReady) break;
		usleep(1000);
	}
	printf("ipc: A killed (%s) with its copy into %s buffer and its record queued: %.0f ms later B's event query says %s, its stream %s\n",
	       WIFSIGNALED(status) ? "by a signal" : "it exited", intoB ? "B's" : "its own", ms(t0), cudaGetErrorString(eq), cudaGetErrorString(sq));
	freshStream("ipc", y, bad);
	return wrong != 0;
}

// plainFirst is A without IPC: a long kernel, then its own death.
void plainFirst(int in, int out) {
	CHECK(cudaSetDevice(0));
	cudaStream_t s;
	CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
	int go = 0;
	full(in, &go, sizeof go);
	spin<<<132, 32, 0, s>>>(500000 * 1000LL);
	put(out, &go, sizeof go);
	usleep(20000); // the kernel is running
	kill(getpid(), SIGKILL);
}

// plainSecond is B without IPC: its own kernels run while A is killed in
// the middle of one of its own.
int plainSecond(int in, int out, pid_t child) {
	CHECK(cudaSetDevice(0));
	cudaStream_t s;
	CHECK(cudaStreamCreateWithFlags(&s, cudaStreamNonBlocking));
	float *y;
	int *bad;
	CHECK(cudaMalloc(&y, sizeof(float) * kFloats));
	CHECK(cudaMallocHost(&bad, sizeof(int)));
	*bad = 0;
	const int go = 1;
	put(out, &go, sizeof go);
	int back;
	full(in, &back, sizeof back);
	spin<<<8, 32, 0, s>>>(200000 * 1000LL);
	int status = 0;
	waitpid(child, &status, 0);
	const auto t0 = std::chrono::steady_clock::now();
	cudaError_t sq = cudaErrorNotReady;
	while (ms(t0) < 5000 && (sq = cudaStreamQuery(s)) == cudaErrorNotReady) usleep(1000);
	printf("ipc plain: A killed (%s) in the middle of its own kernel, no IPC: %.0f ms later B's stream says %s\n",
	       WIFSIGNALED(status) ? "by a signal" : "it exited", ms(t0), cudaGetErrorString(sq));
	return freshStream("ipc plain", y, bad) != cudaSuccess;
}

} // namespace

int main(int argc, char **argv) {
	setvbuf(stdout, nullptr, _IOLBF, 0);
	const int turns = argc > 1 ? atoi(argv[1]) : 200;
	const bool intoB = argc > 2 && strcmp(argv[2], "landing") == 0;
	const bool plain = argc > 2 && strcmp(argv[2], "plain") == 0;
	int a2b[2], b2a[2];
	if (pipe(a2b) || pipe(b2a)) return perror("pipe"), 1;
	// Fork before either process touches CUDA: a child of a process with
	// a CUDA context cannot use CUDA.
	const pid_t pid = fork();
	if (pid < 0) return perror("fork"), 1;
	if (pid == 0) {
		close(a2b[0]), close(b2a[1]);
		plain ? plainFirst(b2a[0], a2b[1]) : first(b2a[0], a2b[1]);
		_exit(0);
	}
	close(a2b[1]), close(b2a[0]);
	if (plain) return plainSecond(a2b[0], b2a[1], pid);
	return second(a2b[0], b2a[1], turns, pid, intoB);
}
