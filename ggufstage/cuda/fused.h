// meshnode's fused CUDA decode path: one token of each of up to eight
// sequences through a stage's llama or qwen2 layers as one CUDA graph of a few kernels per layer, reading
// the weights and the KV cache that ggml's CUDA backend already holds.
//
// ggml launches about fifteen kernels per layer and rebuilds its CUDA graph
// every token (the KV position changes); its 4-bit mat-vec reads weights 2
// bytes at a time. Here every per-token value lives in device memory, so the
// same graph replays each token, and the mat-vec kernels stream whole rows
// into shared memory 16 bytes at a time (cp.async), several tiles ahead.
#ifndef MESHNODE_FUSED_H
#define MESHNODE_FUSED_H

#include <stddef.h>
#include <stdint.h>

#ifdef __cplusplus
extern "C" {
#endif

// Tensor types, as ggml numbers them.
enum { MF_F32 = 0, MF_F16 = 1, MF_Q4_0 = 2, MF_Q6_K = 14 };

// One layer's device pointers: f32 norms, Q4_0 matrices, and the layer's f16
// KV cache as ggml lays it out ([head_dim, n_kv_head, cells], V not permuted).
// bq, bk, bv: f32 biases of q, k and v (qwen2), all three or none.
typedef struct {
	const void *attn_norm, *wq, *wk, *wv, *wo;
	const void *ffn_norm, *gate, *up, *down;
	void *k, *v;
	const void *bq, *bk, *bv;
} mf_layer;

typedef struct {
	int n_layer, embd, n_head, n_kv_head, head_dim, ffn, vocab, cells;
	float eps, rope_base, rope_freq_scale;
	int rope_neox;        // rotate dimensions i and i+head_dim/2 (qwen2), not 2i and 2i+1 (llama)
	int embd_type;        // type of tok_embd
	const void *tok_embd; // NULL unless the stage holds the first layer
	int out_type;         // type of output
	const void *out_norm, *output; // NULL unless the stage holds the last layer
	const mf_layer *layers;        // n_layer of them
	int device;
} mf_config;

typedef struct mf_engine mf_engine;

// mf_supported says whether the path can run this shape and these types:
// 0, or a message in err.
int mf_supported(const mf_config *c, char *err, int errlen);

// mf_create checks the device and the config, and allocates the engine's
// buffers. 0, or a message in err.
int mf_create(const mf_config *c, mf_engine **e, char *err, int errlen);

// mf_step runs one token at position pos through the stage: token on the
// first stage, else hidden (embd floats). Its K and V go to cache cell loc;
// it attends to cells[0..n) (the sequence's earlier positions, loc not among
// them) and to itself. out receives vocab logits on the last stage, else
// embd hidden floats; out_pinned says out came from mf_host_alloc, so that
// the result is copied there straight from the GPU. 0, or a message in err.
int mf_step(mf_engine *e, int token, const float *hidden, int pos, int loc,
            const int32_t *cells, int n, float *out, int out_pinned, char *err, int errlen);

// mf_step_rows runs one token of each of rows sequences (1 to
// mf_max_rows) through the stage at once, as mf_step does for one: row r's
// token (first stage) or hidden floats at r*embd, position pos[r], cell
// loc[r] (the rows' cells differ), and its ncells[r] earlier cells, the
// rows' lists one after another in cells. out receives rows × vocab logits
// or rows × embd hidden floats. A row's results have the same bits in any
// pass of two or more rows, whatever the others; the mat-vecs of such a
// pass run on the tensor cores and sum in another order than mf_step's, so
// they differ from a one-row step's in rounding. 0, or a message in err.
int mf_step_rows(mf_engine *e, int rows, const int *tokens, const float *hidden, const int *pos, const int *loc,
                 const int32_t *cells, const int *ncells, float *out, int out_pinned, char *err, int errlen);

// mf_step_rows_picks is mf_step_rows for a stage with the output layer
// whose caller samples greedily: instead of the logits (out is left alone),
// picks[r] receives row r's greedy pick, the index of its largest logit as
// node/sample's sampler takes it at temperature 0 with no penalties: NaN
// counts as -Inf and +Inf as the largest finite float, the lowest index
// wins ties, and a row of only -Inf picks 0. picks NULL: mf_step_rows.
int mf_step_rows_picks(mf_engine *e, int rows, const int *tokens, const float *hidden, const int *pos, const int *loc,
                       const int32_t *cells, const int *ncells, float *out, int out_pinned, int *picks, char *err,
                       int errlen);

// mf_queue_picks queues a greedy pass (as mf_step_rows_picks) of a stage
// with both the embedding and the output layer, without waiting for it, so
// that the GPU can go from one pass to the next with no host in between.
// A row's token -1 is the greedy pick of the same row of the pass queued
// just before (which must have had that row): a sequence's next token,
// before the host knows it. At most two passes are queued at once;
// mf_wait_picks waits for the oldest and writes its rows' picks (picks may
// be NULL). A pass queued ahead of its caller's next step writes its cache
// cells before the caller knows whether it wants them: the caller reserves
// them and, if it never takes the pass, waits for it and frees them. While
// passes are queued, mf_step_rows and mf_step_rows_picks fail. 0, or a
// message in err.
int mf_queue_picks(mf_engine *e, int rows, const int *tokens, const int *pos, const int *loc, const int32_t *cells,
                   const int *ncells, char *err, int errlen);
int mf_wait_picks(mf_engine *e, int *picks, char *err, int errlen);

// mf_launch_rows queues a pass of rows rows as mf_step_rows_picks does
// and returns without waiting for it, so that two stages on one device can
// hand a pass's hidden states over on the device, the host out of the
// way: a stage without the output layer copies its hidden output to
// device memory out_dev (if not NULL) and records event done after it (if
// not NULL); a stage that does not embed takes its hidden input from the
// host (hidden) or from device memory in_dev (rows × embd floats), read
// once event after is reached (if not NULL). Its caller queues the second
// stage's pass right after the first's, long before the first is done.
// mf_finish_rows waits for the pass and writes the greedy picks of a stage
// with the output layer (picks, if not NULL) or the hidden output of one
// without (out, if not NULL) to the host. Until then no other pass can be
// stepped, queued or launched. 0, or a message in err.
int mf_launch_rows(mf_engine *e, int rows, const int *tokens, const float *hidden, const float *in_dev, void *after,
                   const int *pos, const int *loc, const int32_t *cells, const int *ncells, float *out_dev, void *done,
                   char *err, int errlen);
int mf_finish_rows(mf_engine *e, int *picks, float *out, char *err, int errlen);

// mf_device_alloc returns n floats of memory on the engine's device (NULL
// if it cannot), which mf_device_free gives back; mf_event_create returns
// an event of the engine's device for mf_launch_rows (NULL if it cannot),
// which mf_event_destroy destroys.
float *mf_device_alloc(mf_engine *e, size_t n);
void *mf_event_create(mf_engine *e);
void mf_event_destroy(void *ev);

// A hand-off between two processes' engines on one device (CUDA IPC): the
// first exports a buffer and an interprocess event (mf_handoff_export),
// the second opens them from their handles (mf_handoff_import), and
// passes go through them with mf_launch_rows (out_dev and done on the
// first, in_dev and after on the second).
enum { MF_IPC_HANDLE = 64, MF_BUS_ID = 32 };

// mf_handoff_export makes n floats of memory on the device that holds the
// device pointer like and an interprocess event of it: *buf and *ev, their
// handles in mem and evh (MF_IPC_HANDLE bytes each), the device's PCI bus
// id in bus (MF_BUS_ID bytes). 0, or a message in err.
int mf_handoff_export(const void *like, size_t n, float **buf, void **ev, void *mem, void *evh, char *bus, char *err,
                      int errlen);

// mf_handoff_import opens another process's exported buffer and event
// from their handles on the device that holds like, which must be the one
// of PCI bus id bus. 0, or a message in err.
int mf_handoff_import(const void *like, const void *mem, const void *evh, const char *bus, float **buf, void **ev,
                      char *err, int errlen);

// mf_handoff_close frees an exported buffer and event, or closes imported
// ones.
void mf_handoff_close(const void *like, float *buf, void *ev, int imported);

// mf_event_wait waits up to timeout_ms for the work before event ev's
// last record: 0 once it is done, 1 if it is not by then, -1 on an error
// (in err).
int mf_event_wait(void *ev, int timeout_ms, char *err, int errlen);

// mf_handoff_read copies n floats of device memory buf to host, once
// event ev is reached (up to timeout_ms). 0, or a message in err.
int mf_handoff_read(const void *like, const float *buf, void *ev, size_t n, float *host, int timeout_ms, char *err,
                    int errlen);

// mf_max_rows is the most rows mf_step_rows takes: 8, fewer where the
// rows' inputs leave the mat-vecs too little shared memory (4 for a
// feed-forward of 27648, the 32B shape), or MESHNODE_FUSED_ROWS.
int mf_max_rows(const mf_engine *e);

// mf_host_alloc returns n floats of pinned host memory (NULL if it cannot),
// which mf_host_free gives back.
float *mf_host_alloc(size_t n);
void mf_host_free(float *p);

// mf_device_copy copies n bytes of host memory to a new allocation on the
// GPU that holds the device pointer like, and returns it; NULL, with the
// reason in err, if it cannot. mf_device_free gives it back. A first stage
// whose token embedding ggml keeps in host memory looks its rows up on the
// GPU from such a copy (mf_config.tok_embd).
void *mf_device_copy(const void *like, const void *host, size_t n, char *err, int errlen);
void mf_device_free(void *p);

void mf_destroy(mf_engine *e);

#ifdef __cplusplus
}
#endif

#endif
