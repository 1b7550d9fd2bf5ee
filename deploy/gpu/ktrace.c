// ktrace: where a process's GPU time goes, kernel by kernel, without a
// profiler. CUDA loads it into a process through CUDA_INJECTION64_PATH and
// it records every kernel with CUPTI's activity API:
//
//   export KTRACE_DIR=/tmp/kt CUDA_INJECTION64_PATH=bin/lib/libmeshnode-ktrace.so
//   meshnode bench --model M --device cuda --streams 1 --no-reference
//   meshnode dev kernel-report --per 128 /tmp/kt/k.*.txt
//
// Every 0.5 s it writes KTRACE_DIR/k.<pid>.txt (a whole file each time, by
// rename: a Go program exits without running atexit handlers):
//
//   K <ns> <calls> <name>|<grid x,y,z>|<block x,y>   time per kernel and launch shape
//   B <i> <ns> <calls>                               GPU time of kernels started in the i-th 100 ms
//
// With KTRACE_RAW=N it also keeps the first N kernels' own times, for a
// timeline (kernels that overlap under PDL show it; the gaps between their
// ends are each kernel's share of a step):
//
//   R <start ns> <end ns> <name>|<grid>|<block>                  in CUPTI's order
//
// deploy/gpu/build-cuda.sh builds it where the CUDA toolkit has CUPTI;
// by hand: gcc -O2 -shared -fPIC -DKREC=CUpti_ActivityKernelN (the newest
// its cupti_activity.h defines) -I<cupti include> ktrace.c -lcupti.
// Tracing adds a little host time to every launch.
#include <cupti.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#ifndef KREC
#error "define KREC as the newest CUpti_ActivityKernelN of this CUPTI"
#endif

#define NKERNELS 8192   // distinct (name, shape) pairs kept
#define NBUCKETS 36000  // 100 ms buckets: an hour

static struct {
  char *key;
  unsigned long long ns, calls;
} kernels[NKERNELS];
static unsigned long long busy[NBUCKETS], started[NBUCKETS];
static unsigned long long first;  // CUPTI timestamp of the first kernel
static pthread_mutex_t mu = PTHREAD_MUTEX_INITIALIZER;
static struct raw {
  unsigned long long start, end;
  const char *key;  // kernels[].key: kept for the process's life
} *raws;
static long nraw, maxraw;

static void CUPTIAPI give_buffer(uint8_t **buf, size_t *size, size_t *max_records) {
  *size = 8 << 20;
  *buf = aligned_alloc(8, *size);
  *max_records = 0;
}

static unsigned fnv(const char *s) {
  unsigned h = 2166136261u;
  while (*s) h = (h ^ (unsigned char)*s++) * 16777619u;
  return h;
}

// record adds one kernel run; a full table drops new kinds, never counts.
static void record(const char *key, unsigned long long start, unsigned long long end) {
  unsigned h = fnv(key) % NKERNELS;
  for (int i = 0; i < NKERNELS; i++, h = (h + 1) % NKERNELS) {
    if (!kernels[h].key) kernels[h].key = strdup(key);
    if (kernels[h].key && !strcmp(kernels[h].key, key)) {
      kernels[h].ns += end - start;
      kernels[h].calls++;
      if (nraw < maxraw) raws[nraw++] = (struct raw){start, end, kernels[h].key};
      break;
    }
  }
  if (!first) first = start;
  if (start >= first) {
    unsigned long long b = (start - first) / 100000000ull;
    if (b < NBUCKETS) {
      busy[b] += end - start;
      started[b]++;
    }
  }
}

static void CUPTIAPI take_buffer(CUcontext ctx, uint32_t stream, uint8_t *buf, size_t size, size_t valid) {
  CUpti_Activity *r = NULL;
  char key[4096];
  pthread_mutex_lock(&mu);
  while (cuptiActivityGetNextRecord(buf, valid, &r) == CUPTI_SUCCESS) {
    if (r->kind != CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL && r->kind != CUPTI_ACTIVITY_KIND_KERNEL) continue;
    KREC *k = (KREC *)r;
    snprintf(key, sizeof key, "%s|%d,%d,%d|%d,%d", k->name ? k->name : "?", k->gridX, k->gridY, k->gridZ,
             k->blockX, k->blockY);
    record(key, k->start, k->end);
  }
  pthread_mutex_unlock(&mu);
  free(buf);
}

static void dump(void) {
  const char *dir = getenv("KTRACE_DIR");
  char path[4096], tmp[4200];
  snprintf(path, sizeof path, "%s/k.%d.txt", dir && *dir ? dir : "/tmp", (int)getpid());
  snprintf(tmp, sizeof tmp, "%s.tmp", path);
  FILE *f = fopen(tmp, "w");
  if (!f) return;
  pthread_mutex_lock(&mu);
  for (int i = 0; i < NKERNELS; i++)
    if (kernels[i].key) fprintf(f, "K %llu %llu %s\n", kernels[i].ns, kernels[i].calls, kernels[i].key);
  for (int b = 0; b < NBUCKETS; b++)
    if (started[b]) fprintf(f, "B %d %llu %llu\n", b, busy[b], started[b]);
  for (long i = 0; i < nraw; i++) fprintf(f, "R %llu %llu %s\n", raws[i].start, raws[i].end, raws[i].key);
  pthread_mutex_unlock(&mu);
  if (fclose(f) == 0) rename(tmp, path);
}

static void *flusher(void *arg) {
  (void)arg;
  for (;;) {
    usleep(500000);
    cuptiActivityFlushAll(0);
    dump();
  }
  return NULL;
}

// finish writes what is left at a C program's exit (Go's skip it).
static void finish(void) {
  cuptiActivityFlushAll(1);
  dump();
}

// InitializeInjection is what CUDA calls in a library named by
// CUDA_INJECTION64_PATH, when the process first initializes CUDA.
int InitializeInjection(void) {
  if (cuptiActivityRegisterCallbacks(give_buffer, take_buffer) != CUPTI_SUCCESS ||
      cuptiActivityEnable(CUPTI_ACTIVITY_KIND_CONCURRENT_KERNEL) != CUPTI_SUCCESS) {
    fprintf(stderr, "ktrace: CUPTI refused to trace kernels\n");
    return 0;
  }
  const char *raw = getenv("KTRACE_RAW");
  if (raw && atol(raw) > 0 && (raws = calloc((size_t)atol(raw), sizeof *raws))) maxraw = atol(raw);
  atexit(finish);
  pthread_t t;
  if (pthread_create(&t, NULL, flusher, NULL) != 0) return 0;
  pthread_detach(t);
  return 1;
}
