//go:build repack && cgo

package ggufstage

/*
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include "ggml.h"
#include "ggml-alloc.h"
#include "ggml-backend.h"

static double meshnode_now(void) {
	struct timespec ts;
	clock_gettime(CLOCK_MONOTONIC, &ts);
	return ts.tv_sec + ts.tv_nsec * 1e-9;
}

// meshnode_dev_bandwidth copies an f32 tensor of n bytes into another on
// the device whose ggml id and library are given, runs times times, and
// returns the best rate in bytes read and written per second; 0 when no
// such device is registered, -1 when the device cannot hold the tensors.
static double meshnode_dev_bandwidth(const char * id, const char * library, size_t n, int runs) {
	ggml_backend_dev_t dev = NULL;
	for (size_t i = 0; i < ggml_backend_dev_count() && dev == NULL; i++) {
		ggml_backend_dev_t d = ggml_backend_dev_get(i);
		struct ggml_backend_dev_props p;
		memset(&p, 0, sizeof p);
		ggml_backend_dev_get_props(d, &p);
		if (p.id != NULL && p.library != NULL && strcmp(p.id, id) == 0 && strcasecmp(p.library, library) == 0) {
			dev = d;
		}
	}
	if (dev == NULL) return 0;
	ggml_backend_t be = ggml_backend_dev_init(dev, NULL);
	if (be == NULL) return -1;
	struct ggml_init_params ip = { 8 * ggml_tensor_overhead() + ggml_graph_overhead(), NULL, true };
	struct ggml_context * ctx = ggml_init(ip);
	struct ggml_tensor * src = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, (int64_t) (n / 4));
	struct ggml_tensor * dst = ggml_new_tensor_1d(ctx, GGML_TYPE_F32, (int64_t) (n / 4));
	struct ggml_cgraph * g = ggml_new_graph(ctx);
	ggml_build_forward_expand(g, ggml_cpy(ctx, src, dst));
	double best = -1;
	ggml_backend_buffer_t buf = ggml_backend_alloc_ctx_tensors(ctx, be);
	if (buf != NULL) {
		ggml_backend_buffer_clear(buf, 0);
		best = 1e30;
		for (int r = 0; r < runs; r++) {
			double t0 = meshnode_now();
			if (ggml_backend_graph_compute(be, g) != GGML_STATUS_SUCCESS) { best = 1e30; break; }
			double t = meshnode_now() - t0;
			if (t < best) best = t;
		}
		best = best < 1e30 && best > 0 ? 2.0 * (double) (n / 4 * 4) / best : -1;
		ggml_backend_buffer_free(buf);
	}
	ggml_free(ctx);
	ggml_backend_free(be);
	return best;
}
*/
import "C"

import (
	"fmt"
	"unsafe"

	"github.com/ollama/ollama/ml"
)

// DeviceBandwidth measures how fast the GPU dev streams memory, in bytes
// per second: the best of five copies of a 256 MiB tensor (read and
// written), run by ggml on the device. Decode reads every weight of a
// stage once per token, so this is what the planner should weigh a GPU
// node by; the host's CPU bandwidth says nothing about it. Call it after
// Devices, which loads the GPU backends, and before the device is busy.
func DeviceBandwidth(dev ml.DeviceInfo) (bw float64, err error) {
	backendMu.Lock()
	defer backendMu.Unlock()
	defer recoverErr(&err, "measuring "+dev.Library+" bandwidth")
	id, lib := C.CString(dev.ID), C.CString(dev.Library)
	defer C.free(unsafe.Pointer(id))
	defer C.free(unsafe.Pointer(lib))
	switch bw = float64(C.meshnode_dev_bandwidth(id, lib, 256<<20, 5)); {
	case bw == 0:
		return 0, fmt.Errorf("measuring bandwidth: ggml has no %s device %q", dev.Library, dev.ID)
	case bw < 0:
		return 0, fmt.Errorf("measuring bandwidth: %s device %q could not run a 512 MiB copy", dev.Library, dev.ID)
	}
	return bw, nil
}
