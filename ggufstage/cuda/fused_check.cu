// Checks and times the fused decode path on random weights, without ggml:
//
//   fused_check check   one decode step of eleven small models (head sizes
//                       128 and 64, one to eight query heads per KV head,
//                       the cache in one split or several, Q6_K heads of
//                       n_embd 2048, 2560, 3072, 4096, 5120 and 6144, and two with
//                       qwen2's biases and NeoX rotation) against a float64
//                       reference on the host that quantizes activations as
//                       the kernels do; a split into two stages must give
//                       the same bits. Also greedy picks (one row, with
//                       ties, NaN and +Inf in the head; several rows),
//                       passes queued ahead against stepping, and passes
//                       of several sequences.
//   fused_check bench   an 8B-class llama (Q4_0, Q6_K head): copy bandwidth,
//                       each mat-vec's bandwidth, and whole decode steps
//                       (logits, greedy picks, greedy passes queued ahead)
//                       against the floor of model bytes ÷ copy bandwidth.
//   fused_check bench32 the same for a 32B-class model (64 layers of 5120,
//                       n_ff 27648).
//   fused_check split [a] the 8B-class model's greedy steps as two stages,
//                       layers [0, a) and [a, 32) (a 18 unless given) in
//                       this process, against the whole model on one engine.
//   fused_check handoff [a] the same two stages handing the hidden state
//                       over on the device (mf_launch_rows), against the
//                       host hand-off of split and the whole model.
//
// Built on a GPU machine, from the repository's root (sm_90 here; any sm_80+):
//   nvcc -O3 -std=c++17 -gencode arch=compute_90,code=sm_90 -o fused_check \
//     ggufstage/cuda/fused_check.cu ggufstage/cuda/fused.cu
#include "fused.h"

#include <cuda_fp16.h>
#include <cuda_runtime.h>
#include "../../deploy/gpu/cudacheck.h"

#include <algorithm>
#include <chrono>
#include <cfloat>
#include <cmath>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <numeric>
#include <random>
#include <string>
#include <vector>

extern "C" void mf_profile(mf_engine *e);
extern "C" void mf_profile_rows(mf_engine *e, int n);
extern "C" int mf_greedy_picks(const float *logits, int rows, int vocab, int *picks);

// greedyPick is node/sample's greedy pick: argmax of the sanitized logits
// (NaN as -Inf, +Inf as the largest finite float), the lowest index on ties.
static int greedyPick(const float *l, size_t n) {
	auto clean = [](float x) { return x != x ? -INFINITY : std::min(x, FLT_MAX); };
	size_t best = 0;
	for (size_t i = 1; i < n; i++)
		if (clean(l[i]) > clean(l[best])) best = i;
	return (int)best;
}

static size_t rowBytesOf(int type, int k) {
	switch (type) {
	case MF_Q4_0: return (size_t)k / 32 * 18;
	case MF_Q6_K: return (size_t)k / 256 * 210;
	case MF_F16: return (size_t)k * 2;
	}
	return (size_t)k * 4;
}

static std::mt19937_64 rng(42);

static uint16_t toHalf(float f) {
	__half h = __float2half(f);
	return *reinterpret_cast<uint16_t *>(&h);
}
static float fromHalf(uint16_t u) {
	__half h = *reinterpret_cast<__half *>(&u);
	return __half2float(h);
}

// Random quantized rows: scales of about scale, random nibbles / 6-bit values.
static std::vector<uint8_t> randomMatrix(int type, int rows, int k, float scale) {
	std::vector<uint8_t> m(rowBytesOf(type, k) * rows);
	std::uniform_int_distribution<int> byte(0, 255);
	std::uniform_real_distribution<float> u(0.5f, 1.5f);
	for (auto &b : m) b = (uint8_t)byte(rng);
	if (type == MF_Q4_0) {
		for (size_t off = 0; off < m.size(); off += 18) {
			uint16_t d = toHalf(scale * u(rng) / 8.f);
			memcpy(&m[off], &d, 2);
		}
	} else if (type == MF_Q6_K) {
		std::uniform_int_distribution<int> sc(-60, 60);
		for (size_t off = 0; off < m.size(); off += 210) {
			for (int i = 0; i < 16; i++) m[off + 192 + i] = (uint8_t)(int8_t)sc(rng);
			uint16_t d = toHalf(scale * u(rng) / 32.f / 40.f);
			memcpy(&m[off + 208], &d, 2);
		}
	}
	return m;
}

static void dequantRow(int type, const uint8_t *row, int k, std::vector<double> &out) {
	out.assign(k, 0);
	for (int i = 0; i < k; i++) {
		if (type == MF_Q4_0) {
			const uint8_t *b = row + (i / 32) * 18;
			int j = i % 32;
			uint16_t d;
			memcpy(&d, b, 2);
			int nib = j < 16 ? (b[2 + j] & 15) : (b[2 + j - 16] >> 4);
			out[i] = (double)fromHalf(d) * (nib - 8);
		} else {
			const uint8_t *b = row + (i / 256) * 210;
			int r = i % 256, hf = r / 128, w = r % 128, mm = w / 32, ll = w % 32;
			uint8_t qlb = b[64 * hf + ll + (mm & 1) * 32];
			int lo = mm >= 2 ? qlb >> 4 : qlb & 15;
			int hi = (b[128 + 32 * hf + ll] >> (2 * mm)) & 3;
			int8_t sc = (int8_t)b[192 + 8 * hf + ll / 16 + 2 * mm];
			uint16_t d;
			memcpy(&d, b + 208, 2);
			out[i] = (double)fromHalf(d) * sc * ((lo | (hi << 4)) - 32);
		}
	}
}

// The activations as the kernels see them: int8 blocks of 32 with a scale.
static std::vector<double> quantized(const std::vector<double> &x) {
	std::vector<double> q(x.size());
	for (size_t g = 0; g < x.size(); g += 32) {
		float amax = 0;
		for (int i = 0; i < 32; i++) amax = std::max(amax, std::fabs((float)x[g + i]));
		float d = amax / 127.f, id = d > 0 ? 1.f / d : 0.f;
		for (int i = 0; i < 32; i++) q[g + i] = (double)d * (double)std::nearbyint((float)x[g + i] * id);
	}
	return q;
}

static std::vector<double> matvec(int type, const std::vector<uint8_t> &w, int rows, int k, const std::vector<double> &x) {
	std::vector<double> y(rows), r;
	for (int i = 0; i < rows; i++) {
		dequantRow(type, &w[rowBytesOf(type, k) * i], k, r);
		double s = 0;
		for (int j = 0; j < k; j++) s += r[j] * x[j];
		y[i] = s;
	}
	return y;
}

static std::vector<double> rmsnorm(const std::vector<double> &x, const std::vector<float> &g, float eps) {
	float ss = 0;
	for (double v : x) ss += (float)v * (float)v;
	double sc = 1.0 / std::sqrt((double)ss / x.size() + eps);
	std::vector<double> y(x.size());
	for (size_t i = 0; i < x.size(); i++) y[i] = (double)(float)(x[i] * sc) * g[i];
	return y;
}

struct HostLayer {
	std::vector<float> attnNorm, ffnNorm;
	std::vector<uint8_t> wq, wk, wv, wo, gate, up, down;
	std::vector<uint16_t> k, v; // cache
	std::vector<float> bq, bk, bv; // empty: no biases
};

struct Model {
	int nLayer, embd, nHead, nKV, hd, ffn, vocab, cells;
	float eps = 1e-5f, base = 500000.f, freqScale = 1.f;
	bool neox = false;
	std::vector<uint8_t> tokEmbd, output;
	std::vector<float> outNorm;
	std::vector<HostLayer> L;
};

static std::vector<float> randomVec(int n, float lo, float hi) {
	std::uniform_real_distribution<float> u(lo, hi);
	std::vector<float> v(n);
	for (auto &x : v) x = u(rng);
	return v;
}

static Model makeModel(int nLayer, int embd, int nHead, int nKV, int hd, int ffn, int vocab, int cells, bool qwen2 = false) {
	Model m{nLayer, embd, nHead, nKV, hd, ffn, vocab, cells};
	const int qd = nHead * hd, kvd = nKV * hd;
	m.tokEmbd = randomMatrix(MF_Q4_0, vocab, embd, 1.0f);
	m.output = randomMatrix(MF_Q6_K, vocab, embd, 1.0f / std::sqrt((float)embd));
	m.outNorm = randomVec(embd, 0.8f, 1.2f);
	for (int i = 0; i < nLayer; i++) {
		HostLayer l;
		l.attnNorm = randomVec(embd, 0.8f, 1.2f);
		l.ffnNorm = randomVec(embd, 0.8f, 1.2f);
		const float s = 1.0f / std::sqrt((float)embd);
		l.wq = randomMatrix(MF_Q4_0, qd, embd, s);
		l.wk = randomMatrix(MF_Q4_0, kvd, embd, s);
		l.wv = randomMatrix(MF_Q4_0, kvd, embd, s);
		l.wo = randomMatrix(MF_Q4_0, embd, qd, 0.5f / std::sqrt((float)qd));
		l.gate = randomMatrix(MF_Q4_0, ffn, embd, s);
		l.up = randomMatrix(MF_Q4_0, ffn, embd, s);
		l.down = randomMatrix(MF_Q4_0, embd, ffn, 0.5f / std::sqrt((float)ffn));
		std::normal_distribution<float> nd(0.f, 1.f);
		l.k.resize((size_t)cells * kvd), l.v.resize((size_t)cells * kvd);
		for (auto &x : l.k) x = toHalf(nd(rng));
		for (auto &x : l.v) x = toHalf(nd(rng));
		if (qwen2) l.bq = randomVec(qd, -0.5f, 0.5f), l.bk = randomVec(kvd, -0.5f, 0.5f), l.bv = randomVec(kvd, -0.5f, 0.5f);
		m.L.push_back(std::move(l));
	}
	m.neox = qwen2;
	return m;
}

// The cache cell a step wrote on the device, per layer.
struct DeviceCell {
	std::vector<std::vector<uint16_t>> k, v;
};

// One decode step on the host, layers [a,b). x is the residual stream in and
// out. The new cell's K and V are rounded to f16; where the kernels' cell
// (dev) is given, the step notes how far it is from them (cacheErr) and then
// attends to the kernels' bits: a value on an f16 rounding boundary may round
// either way, and either is right.
static void reference(Model &m, int a, int b, std::vector<double> &x, int pos, int loc, const std::vector<int> &cells,
                      const DeviceCell *dev = nullptr, double *cacheErr = nullptr) {
	const int qd = m.nHead * m.hd, kvd = m.nKV * m.hd;
	for (int i = a; i < b; i++) {
		HostLayer &l = m.L[i];
		auto xn = quantized(rmsnorm(x, l.attnNorm, m.eps));
		auto q = matvec(MF_Q4_0, l.wq, qd, m.embd, xn), k = matvec(MF_Q4_0, l.wk, kvd, m.embd, xn),
		     v = matvec(MF_Q4_0, l.wv, kvd, m.embd, xn);
		for (size_t j = 0; j < l.bq.size(); j++) q[j] += l.bq[j];
		for (size_t j = 0; j < l.bk.size(); j++) k[j] += l.bk[j], v[j] += l.bv[j];
		auto rope = [&](std::vector<double> &t, int heads) {
			for (int h = 0; h < heads; h++)
				for (int j = 0; j < m.hd / 2; j++) {
					double th = pos * m.freqScale * std::pow((double)m.base, -2.0 * j / m.hd);
					const int i0 = h * m.hd + (m.neox ? j : 2 * j), i1 = h * m.hd + (m.neox ? j + m.hd / 2 : 2 * j + 1);
					double x0 = t[i0], x1 = t[i1];
					t[i0] = x0 * std::cos(th) - x1 * std::sin(th);
					t[i1] = x0 * std::sin(th) + x1 * std::cos(th);
				}
		};
		rope(q, m.nHead), rope(k, m.nKV);
		for (int j = 0; j < kvd; j++) {
			uint16_t kh = toHalf((float)k[j]), vh = toHalf((float)v[j]);
			if (dev) {
				const uint16_t dk = dev->k[i - a][j], dv = dev->v[i - a][j];
				*cacheErr = std::max(*cacheErr, (double)std::fabs(fromHalf(dk) - fromHalf(kh)));
				*cacheErr = std::max(*cacheErr, (double)std::fabs(fromHalf(dv) - fromHalf(vh)));
				kh = dk, vh = dv;
			}
			l.k[(size_t)loc * kvd + j] = kh;
			l.v[(size_t)loc * kvd + j] = vh;
		}
		std::vector<int> all = cells;
		all.push_back(loc);
		std::vector<double> att(qd);
		for (int h = 0; h < m.nHead; h++) {
			const int g = h / (m.nHead / m.nKV);
			std::vector<double> sc(all.size());
			double mx = -1e300;
			for (size_t j = 0; j < all.size(); j++) {
				double s = 0;
				for (int d = 0; d < m.hd; d++) s += q[h * m.hd + d] * fromHalf(l.k[((size_t)all[j] * m.nKV + g) * m.hd + d]);
				sc[j] = s / std::sqrt((double)m.hd);
				mx = std::max(mx, sc[j]);
			}
			double z = 0;
			for (auto &s : sc) z += (s = std::exp(s - mx));
			for (int d = 0; d < m.hd; d++) {
				double o = 0;
				for (size_t j = 0; j < all.size(); j++) o += sc[j] * fromHalf(l.v[((size_t)all[j] * m.nKV + g) * m.hd + d]);
				att[h * m.hd + d] = o / z;
			}
		}
		auto o = matvec(MF_Q4_0, l.wo, m.embd, qd, quantized(att));
		for (int j = 0; j < m.embd; j++) x[j] = (float)(x[j] + o[j]);
		auto xn2 = quantized(rmsnorm(x, l.ffnNorm, m.eps));
		auto gt = matvec(MF_Q4_0, l.gate, m.ffn, m.embd, xn2), up = matvec(MF_Q4_0, l.up, m.ffn, m.embd, xn2);
		std::vector<double> act(m.ffn);
		for (int j = 0; j < m.ffn; j++) act[j] = gt[j] / (1 + std::exp(-gt[j])) * up[j];
		auto dn = matvec(MF_Q4_0, l.down, m.embd, m.ffn, quantized(act));
		for (int j = 0; j < m.embd; j++) x[j] = (float)(x[j] + dn[j]);
	}
}

template <typename T> static T *upload(const std::vector<T> &v) {
	T *d;
	CHECK(cudaMalloc(&d, sizeof(T) * v.size()));
	CHECK(cudaMemcpy(d, v.data(), sizeof(T) * v.size(), cudaMemcpyHostToDevice));
	return d;
}

struct DeviceModel {
	std::vector<mf_layer> layers;
	void *tokEmbd, *output, *outNorm;
};

static DeviceModel uploadModel(const Model &m) {
	DeviceModel d;
	d.tokEmbd = upload(m.tokEmbd), d.output = upload(m.output), d.outNorm = upload(m.outNorm);
	for (auto &l : m.L) {
		mf_layer x{};
		x.attn_norm = upload(l.attnNorm), x.ffn_norm = upload(l.ffnNorm);
		x.wq = upload(l.wq), x.wk = upload(l.wk), x.wv = upload(l.wv), x.wo = upload(l.wo);
		x.gate = upload(l.gate), x.up = upload(l.up), x.down = upload(l.down);
		x.k = upload(l.k), x.v = upload(l.v);
		if (!l.bq.empty()) x.bq = upload(l.bq), x.bk = upload(l.bk), x.bv = upload(l.bv);
		d.layers.push_back(x);
	}
	return d;
}

static mf_config configOf(const Model &m, const DeviceModel &d, int a, int b) {
	mf_config c{};
	c.n_layer = b - a, c.embd = m.embd, c.n_head = m.nHead, c.n_kv_head = m.nKV, c.head_dim = m.hd;
	c.ffn = m.ffn, c.vocab = m.vocab, c.cells = m.cells, c.eps = m.eps, c.rope_base = m.base;
	c.rope_freq_scale = m.freqScale;
	c.rope_neox = m.neox;
	c.layers = d.layers.data() + a;
	if (a == 0) c.embd_type = MF_Q4_0, c.tok_embd = d.tokEmbd;
	if (b == m.nLayer) c.out_type = MF_Q6_K, c.output = d.output, c.out_norm = d.outNorm;
	return c;
}

static mf_engine *create(const mf_config &c) {
	char err[512];
	mf_engine *e;
	if (mf_create(&c, &e, err, sizeof err)) {
		fprintf(stderr, "mf_create: %s\n", err);
		exit(1);
	}
	return e;
}

static void step(mf_engine *e, int tok, const float *hidden, int pos, int loc, const std::vector<int> &cells, float *out) {
	char err[512];
	if (mf_step(e, tok, hidden, pos, loc, cells.data(), (int)cells.size(), out, 0, err, sizeof err)) {
		fprintf(stderr, "mf_step: %s\n", err);
		exit(1);
	}
}

// pickOf steps one row as step does, asking for its greedy pick instead of
// its logits.
static int pickOf(mf_engine *e, int tok, const float *hidden, int pos, int loc, const std::vector<int> &cells) {
	char err[512];
	int pick = -2, n = (int)cells.size();
	if (mf_step_rows_picks(e, 1, &tok, hidden, &pos, &loc, cells.data(), &n, nullptr, 0, &pick, err, sizeof err)) {
		fprintf(stderr, "mf_step_rows_picks: %s\n", err);
		exit(1);
	}
	return pick;
}

// queuedStep is the time a greedy one-row pass takes queued a pass ahead
// (mf_queue_picks), each pass's token the pick before it, at position n
// and cell loc after cells used: the best of 3 runs of 100, in seconds.
static double queuedStep(mf_engine *e, int n, int loc, const std::vector<int> &used) {
	char err[512];
	const int m = (int)used.size();
	int tok = 5, none = -1, pick = 0;
	double best = 1e9;
	for (int round = 0; round < 3; round++) {
		auto s = std::chrono::steady_clock::now();
		bool bad = mf_queue_picks(e, 1, &tok, &n, &loc, used.data(), &m, err, sizeof err);
		for (int i = 0; i < 100 && !bad; i++)
			bad = (i + 1 < 100 && mf_queue_picks(e, 1, &none, &n, &loc, used.data(), &m, err, sizeof err)) ||
			      mf_wait_picks(e, &pick, err, sizeof err);
		if (bad) {
			fprintf(stderr, "queued steps: %s\n", err);
			exit(1);
		}
		best = std::min(best, std::chrono::duration<double>(std::chrono::steady_clock::now() - s).count() / 100);
	}
	return best;
}

static int check(int embd, int nHead, int nKV, int hd, int n, bool qwen2 = false) {
	const int ffn = 5632, vocab = 3000, cells = 256, nLayer = 2;
	Model m = makeModel(nLayer, embd, nHead, nKV, hd, ffn, vocab, cells, qwen2);
	DeviceModel d = uploadModel(m);
	std::vector<int> perm(cells);
	for (int i = 0; i < cells; i++) perm[i] = i;
	std::shuffle(perm.begin(), perm.end(), rng);
	const int pos = n, loc = perm[n], tok = 1234;
	std::vector<int> used(perm.begin(), perm.begin() + n);

	mf_engine *whole = create(configOf(m, d, 0, nLayer));
	std::vector<float> logits(vocab), split(vocab), hidden(embd);
	// The step writes the new K/V into the device cache; run the split
	// second, on the same cache cell, which it rewrites with the same values.
	step(whole, tok, nullptr, pos, loc, used, logits.data());
	mf_engine *a = create(configOf(m, d, 0, 1)), *b = create(configOf(m, d, 1, nLayer));
	step(a, tok, nullptr, pos, loc, used, hidden.data());
	step(b, 0, hidden.data(), pos, loc, used, split.data());

	// The cache cell the step wrote, which the reference checks and then uses.
	double cacheErr = 0;
	const int kvd = nKV * hd;
	DeviceCell cell;
	for (int l = 0; l < nLayer; l++) {
		std::vector<uint16_t> kc(kvd), vc(kvd);
		CHECK(cudaMemcpy(kc.data(), (uint16_t *)d.layers[l].k + (size_t)loc * kvd, 2 * kvd, cudaMemcpyDeviceToHost));
		CHECK(cudaMemcpy(vc.data(), (uint16_t *)d.layers[l].v + (size_t)loc * kvd, 2 * kvd, cudaMemcpyDeviceToHost));
		cell.k.push_back(kc), cell.v.push_back(vc);
	}
	std::vector<double> x;
	dequantRow(MF_Q4_0, &m.tokEmbd[rowBytesOf(MF_Q4_0, embd) * tok], embd, x);
	for (auto &v : x) v = (float)v;
	reference(m, 0, nLayer, x, pos, loc, used, &cell, &cacheErr);
	auto ref = matvec(MF_Q6_K, m.output, vocab, embd, quantized(rmsnorm(x, m.outNorm, m.eps)));

	double num = 0, den = 0, worst = 0;
	int argRef = 0, argGot = 0, bitsDiffer = 0, nan = 0;
	for (int i = 0; i < vocab; i++) {
		if (!std::isfinite(logits[i])) nan++;
		num += (logits[i] - ref[i]) * (logits[i] - ref[i]), den += ref[i] * ref[i];
		worst = std::max(worst, std::fabs(logits[i] - ref[i]));
		if (ref[i] > ref[argRef]) argRef = i;
		if (logits[i] > logits[argGot]) argGot = i;
		if (memcmp(&logits[i], &split[i], 4)) bitsDiffer++;
	}
	const double rel = std::sqrt(num / den);
	// The same step again (it rewrites the same cell alike), asking for the
	// greedy pick, whole and split.
	const int pickWhole = pickOf(whole, tok, nullptr, pos, loc, used), pickSplit = pickOf(b, 0, hidden.data(), pos, loc, used);
	const int pickWant = greedyPick(logits.data(), vocab);
	const bool ok = nan == 0 && rel < 2e-3 && argRef == argGot && bitsDiffer == 0 && cacheErr < 2e-2 && pickWhole == pickWant &&
	                pickSplit == pickWant;
	printf("check %s n_embd %d, heads %d/%d of %d, %d cells: logits rel err %.2e (max abs %.2e), argmax %d vs %d, split differs in %d, cache err %.1e, nonfinite %d, greedy picks %d and %d (split), want %d: %s\n",
	       qwen2 ? "qwen2" : "llama", embd, nHead, nKV, hd, n, rel, worst, argGot, argRef, bitsDiffer, cacheErr, nan, pickWhole,
	       pickSplit, pickWant, ok ? "ok" : "FAIL");
	mf_destroy(whole), mf_destroy(a), mf_destroy(b);
	return ok ? 0 : 1;
}

static void stepRows(mf_engine *e, int rows, const int *toks, const float *hidden, const int *pos, const int *loc,
                     const std::vector<int> &cells, const int *ncells, float *out) {
	char err[512];
	if (mf_step_rows(e, rows, toks, hidden, pos, loc, cells.data(), ncells, out, 0, err, sizeof err)) {
		fprintf(stderr, "mf_step_rows: %s\n", err);
		exit(1);
	}
}

// checkRows decodes rows sequences (each its own cells and position) in one
// pass, in one stage and in two, and in reverse order: a row's logits must
// have the same bits in every such pass, and be near the row stepped alone
// with the same argmax. The one-row kernels sum in another order; their
// last-bit differences in q, k and v round a few cached f16 K and V values
// the other way, which moves the logits by up to about 2e-3 (run 74).
static int checkRows(int embd, int nHead, int nKV, int hd, int rows, const char *rowsSplits = nullptr, int ffn = 5632) {
	if (rowsSplits) setenv("MESHNODE_FUSED_ATTN_ROWS_SPLITS", rowsSplits, 1);
	const int vocab = 3000, nLayer = 2;
	int cells = 1024;
	for (int r = 0, need = 0; r < rows; r++) need += 6 + 23 * r, cells = std::max(cells, need);
	Model m = makeModel(nLayer, embd, nHead, nKV, hd, ffn, vocab, cells);
	DeviceModel d = uploadModel(m);
	std::vector<int> perm(cells);
	for (int i = 0; i < cells; i++) perm[i] = i;
	std::shuffle(perm.begin(), perm.end(), rng);
	// Row r attends to 5 + 23r cells of its own and writes one more.
	std::vector<int> toks(rows), pos(rows), loc(rows), ncells(rows), all;
	std::vector<std::vector<int>> own(rows);
	int next = 0;
	for (int r = 0; r < rows; r++) {
		ncells[r] = 5 + 23 * r;
		own[r].assign(perm.begin() + next, perm.begin() + next + ncells[r]);
		next += ncells[r];
		all.insert(all.end(), own[r].begin(), own[r].end());
		loc[r] = perm[next++];
		pos[r] = ncells[r];
		toks[r] = (int)((r * 977 + 31) % vocab);
	}
	if (next > cells) {
		fprintf(stderr, "checkRows: %d rows need %d cells\n", rows, next);
		return 1;
	}
	// The same rows in reverse order.
	std::vector<int> rtoks(toks.rbegin(), toks.rend()), rpos(pos.rbegin(), pos.rend()), rloc(loc.rbegin(), loc.rend());
	std::vector<int> rn(ncells.rbegin(), ncells.rend()), rall;
	for (int r = rows - 1; r >= 0; r--) rall.insert(rall.end(), own[r].begin(), own[r].end());
	mf_engine *whole = create(configOf(m, d, 0, nLayer));
	mf_engine *a = create(configOf(m, d, 0, 1)), *b = create(configOf(m, d, 1, nLayer));
	const int maxRows = mf_max_rows(whole);
	const size_t V = vocab;
	std::vector<float> alone(rows * V), together(rows * V), split(rows * V), reversed(rows * V), hidden((size_t)rows * embd);
	for (int r = 0; r < rows; r++) step(whole, toks[r], nullptr, pos[r], loc[r], own[r], alone.data() + r * V);
	std::vector<float> hiddenAlone((size_t)rows * embd);
	for (int r = 0; r < rows; r++) step(a, toks[r], nullptr, pos[r], loc[r], own[r], hiddenAlone.data() + (size_t)r * embd);
	int splitDiffer = 0, orderDiffer = 0, nan = 0, argDiffer = 0, pickDiffer = 0, halvesDiffer = 0;
	double num = 0, den = 0;
	if (rows <= maxRows) {
		stepRows(whole, rows, toks.data(), nullptr, pos.data(), loc.data(), all, ncells.data(), together.data());
		stepRows(whole, rows, rtoks.data(), nullptr, rpos.data(), rloc.data(), rall, rn.data(), reversed.data());
		stepRows(a, rows, toks.data(), nullptr, pos.data(), loc.data(), all, ncells.data(), hidden.data());
		stepRows(b, rows, toks.data(), hidden.data(), pos.data(), loc.data(), all, ncells.data(), split.data());
		// The same pass again (it writes the same cache cells alike), asking
		// for greedy picks instead of logits.
		std::vector<int> picks(rows, -2);
		char err[512];
		if (mf_step_rows_picks(b, rows, toks.data(), hidden.data(), pos.data(), loc.data(), all.data(), ncells.data(), nullptr, 0,
		                       picks.data(), err, sizeof err)) {
			fprintf(stderr, "mf_step_rows_picks: %s\n", err);
			exit(1);
		}
		for (int r = 0; r < rows; r++) pickDiffer += picks[r] != greedyPick(&split[r * V], V);
		// Past one tile of gemvMMA (eight rows), the same rows in two passes
		// of one tile each must have the same bits as in one.
		if (rows > 8) {
			std::vector<float> halves(rows * V);
			const int n0 = (rows + 1) / 2, c0 = std::accumulate(ncells.begin(), ncells.begin() + n0, 0);
			std::vector<int> all0(all.begin(), all.begin() + c0), all1(all.begin() + c0, all.end());
			stepRows(whole, n0, toks.data(), nullptr, pos.data(), loc.data(), all0, ncells.data(), halves.data());
			stepRows(whole, rows - n0, toks.data() + n0, nullptr, pos.data() + n0, loc.data() + n0, all1, ncells.data() + n0,
			         halves.data() + n0 * V);
			for (size_t i = 0; i < rows * V; i++) halvesDiffer += memcmp(&together[i], &halves[i], 4) != 0;
		}
		for (int r = 0; r < rows; r++) {
			int ga = 0, gt = 0;
			for (size_t i = 0; i < V; i++) {
				const size_t at = r * V + i;
				if (!std::isfinite(together[at])) nan++;
				if (memcmp(&together[at], &split[at], 4)) splitDiffer++;
				if (memcmp(&together[at], &reversed[(rows - 1 - r) * V + i], 4)) orderDiffer++;
				num += ((double)together[at] - alone[at]) * ((double)together[at] - alone[at]), den += (double)alone[at] * alone[at];
				if (alone[at] > alone[r * V + ga]) ga = (int)i;
				if (together[at] > together[r * V + gt]) gt = (int)i;
			}
			argDiffer += ga != gt;
		}
	}
	const double rel = den > 0 ? std::sqrt(num / den) : 1;
	// By row, the first layer's output and the logits against the row alone.
	std::string byRow;
	for (int r = 0; r < rows && rows <= maxRows; r++) {
		auto relOf = [](const float *x, const float *y, size_t n) {
			double nu = 0, de = 0;
			for (size_t i = 0; i < n; i++) nu += ((double)x[i] - y[i]) * ((double)x[i] - y[i]), de += (double)y[i] * y[i];
			return de > 0 ? std::sqrt(nu / de) : 0.0;
		};
		char buf[64];
		snprintf(buf, sizeof buf, " %d:%.0e/%.0e", r, relOf(&hidden[(size_t)r * embd], &hiddenAlone[(size_t)r * embd], embd),
		         relOf(&together[r * V], &alone[r * V], V));
		byRow += buf;
	}
	const bool ok = rows <= maxRows && splitDiffer == 0 && orderDiffer == 0 && halvesDiffer == 0 && nan == 0 && rel < 5e-3 &&
	                argDiffer == 0 && pickDiffer == 0;
	printf("check rows n_embd %d, heads %d/%d of %d, n_ff %d: %d rows (at most %d) in one pass: split differs in %d, reverse order in %d, two passes in %d; against each row alone rel err %.1e, argmax differs in %d rows; greedy picks differ in %d; nonfinite %d: %s\n    by row, first layer/logits:%s\n",
	       embd, nHead, nKV, hd, ffn, rows, maxRows, splitDiffer, orderDiffer, halvesDiffer, rel, argDiffer, pickDiffer, nan,
	       ok ? "ok" : "FAIL", byRow.c_str());
	mf_destroy(whole), mf_destroy(a), mf_destroy(b);
	if (rowsSplits) unsetenv("MESHNODE_FUSED_ATTN_ROWS_SPLITS"), printf("  (attention of several rows in up to %s splits)\n", rowsSplits);
	return ok ? 0 : 1;
}

// checkHeadPicks: one row's greedy pick (mf_step_rows_picks) against
// greedyPick of the same step's logits, on an output matrix with rows made
// to tie with the best (one before it, one after), rows whose first scale
// is NaN, and rows whose first scale is +Inf, some of which then give
// +Inf (ties of FLT_MAX, the first of which wins). With packed "0" the
// head runs through gemv, else through head6 where there is room.
static int checkHeadPicks(const char *packed) {
	setenv("MESHNODE_FUSED_PACKED_HEAD", packed, 1);
	if (!*packed) unsetenv("MESHNODE_FUSED_PACKED_HEAD");
	const int embd = 2048, vocab = 50000, cells = 64, n = 20, tok = 77;
	Model m = makeModel(1, embd, 16, 4, 128, 5632, vocab, cells);
	DeviceModel d = uploadModel(m);
	std::vector<int> used(n);
	for (int i = 0; i < n; i++) used[i] = i;
	const size_t rb = rowBytesOf(MF_Q6_K, embd);
	auto setScale = [&](int row, uint16_t h) { // the f16 d of the row's first super-block
		CHECK(cudaMemcpy((uint8_t *)d.output + rb * row + 208, &h, 2, cudaMemcpyHostToDevice));
	};
	std::vector<float> l(vocab);
	int bad = 0;
	for (int variant = 0; variant < 3; variant++) {
		mf_engine *e = create(configOf(m, d, 0, 1));
		step(e, tok, nullptr, n, n, used, l.data());
		const int want = greedyPick(l.data(), vocab), got = pickOf(e, tok, nullptr, n, n, used);
		int nan = 0, inf = 0;
		for (float x : l) nan += x != x, inf += x == INFINITY;
		printf("check head picks (%s), %s: pick %d, want %d (%d NaN, %d +Inf logits): %s\n",
		       *packed ? "through gemv" : "packed where there is room",
		       variant == 0 ? "random" : variant == 1 ? "ties" : "ties, NaN and +Inf", got, want, nan, inf, got == want ? "ok" : "FAIL");
		bad += got != want;
		mf_destroy(e);
		if (variant == 0) {
			// Two more rows as the best, one before it and one after (in other
			// blocks' units).
			const int early = want / 3, late = want + (vocab - want) / 2;
			CHECK(cudaMemcpy((uint8_t *)d.output + rb * early, (uint8_t *)d.output + rb * want, rb, cudaMemcpyDeviceToDevice));
			CHECK(cudaMemcpy((uint8_t *)d.output + rb * late, (uint8_t *)d.output + rb * want, rb, cudaMemcpyDeviceToDevice));
		} else if (variant == 1) {
			for (int r : {5, 4000, 31000}) setScale(r, 0x7e00);          // NaN
			for (int r = 20011; r < 20011 + 16 * 613; r += 613) setScale(r, 0x7c00); // +Inf
		}
	}
	unsetenv("MESHNODE_FUSED_PACKED_HEAD");
	return bad ? 1 : 0;
}

// checkQueue decodes rows sequences greedily for steps steps, each row's
// next token its last pick, once a step at a time (mf_step_rows_picks) and
// once queued a pass ahead (mf_queue_picks, tokens -1 from the second pass
// on): the picks must be the same. The two runs write the same cells with
// the same values, so each sees the cache the other did. Then a pass
// queued and dropped (waited for, its picks unread) must leave the engine
// able to step, and a step while a pass is queued must fail.
static int checkQueue(int rows, int steps) {
	const int vocab = 3000, nLayer = 2, cells = 512;
	Model m = makeModel(nLayer, 2048, 16, 4, 128, 5632, vocab, cells);
	DeviceModel d = uploadModel(m);
	std::vector<int> perm(cells);
	for (int i = 0; i < cells; i++) perm[i] = i;
	std::shuffle(perm.begin(), perm.end(), rng);
	// Row r holds 7 + 13r cells to begin with, then writes one a step.
	std::vector<std::vector<int>> own(rows), locs(rows);
	int next = 0;
	for (int r = 0; r < rows; r++) {
		own[r].assign(perm.begin() + next, perm.begin() + next + 7 + 13 * r);
		next += 7 + 13 * r;
	}
	for (int i = 0; i <= steps; i++)
		for (int r = 0; r < rows; r++) locs[r].push_back(perm[next++]);
	auto args = [&](int i, std::vector<int> &pos, std::vector<int> &loc, std::vector<int> &all, std::vector<int> &ncells) {
		pos.clear(), loc.clear(), all.clear(), ncells.clear();
		for (int r = 0; r < rows; r++) {
			all.insert(all.end(), own[r].begin(), own[r].end());
			all.insert(all.end(), locs[r].begin(), locs[r].begin() + i);
			ncells.push_back((int)own[r].size() + i), pos.push_back((int)own[r].size() + i), loc.push_back(locs[r][i]);
		}
	};
	std::vector<int> pos, loc, all, ncells, toks(rows), picks(rows);
	for (int r = 0; r < rows; r++) toks[r] = 100 + 37 * r;
	char err[512];
	mf_engine *e = create(configOf(m, d, 0, nLayer));
	std::vector<std::vector<int>> want(steps, std::vector<int>(rows)), got = want;
	std::vector<int> t = toks;
	for (int i = 0; i < steps; i++) {
		args(i, pos, loc, all, ncells);
		if (mf_step_rows_picks(e, rows, t.data(), nullptr, pos.data(), loc.data(), all.data(), ncells.data(), nullptr, 0,
		                       want[i].data(), err, sizeof err)) {
			fprintf(stderr, "mf_step_rows_picks: %s\n", err);
			exit(1);
		}
		t = want[i];
	}
	auto queue = [&](int i, const std::vector<int> &tk) {
		args(i, pos, loc, all, ncells);
		if (mf_queue_picks(e, rows, tk.data(), pos.data(), loc.data(), all.data(), ncells.data(), err, sizeof err)) {
			fprintf(stderr, "mf_queue_picks: %s\n", err);
			exit(1);
		}
	};
	auto wait = [&](int *into) {
		if (mf_wait_picks(e, into, err, sizeof err)) {
			fprintf(stderr, "mf_wait_picks: %s\n", err);
			exit(1);
		}
	};
	const std::vector<int> prev(rows, -1);
	queue(0, toks);
	for (int i = 0; i < steps; i++) {
		if (i + 1 < steps) queue(i + 1, prev);
		wait(got[i].data());
	}
	int differ = 0;
	for (int i = 0; i < steps; i++)
		for (int r = 0; r < rows; r++) differ += got[i][r] != want[i][r];
	// Dropped: queued ahead of a last step that never comes.
	queue(steps - 1, toks);
	queue(steps, prev);
	wait(picks.data());
	const bool stepWhileQueued =
	    mf_step_rows_picks(e, rows, toks.data(), nullptr, pos.data(), loc.data(), all.data(), ncells.data(), nullptr, 0,
	                       picks.data(), err, sizeof err) == 0;
	wait(nullptr);
	args(steps - 1, pos, loc, all, ncells);
	std::vector<int> again(rows);
	const bool stepAfter = mf_step_rows_picks(e, rows, toks.data(), nullptr, pos.data(), loc.data(), all.data(), ncells.data(),
	                                          nullptr, 0, again.data(), err, sizeof err) == 0;
	const bool ok = differ == 0 && !stepWhileQueued && stepAfter && again == picks;
	printf("check queued passes: %d rows, %d steps, %d picks differ from stepping; a step while queued %s, after dropping one %s: %s\n",
	       rows, steps, differ, stepWhileQueued ? "ran" : "failed", stepAfter && again == picks ? "gave the picks" : "did not",
	       ok ? "ok" : "FAIL");
	mf_destroy(e);
	return ok ? 0 : 1;
}

// checkPicks runs the greedy-pick kernel on rows with NaN, infinities, ties
// and maxima at the ends, at vocabulary sizes that are not multiples of its
// block, against greedyPick.
static int checkPicks() {
	int bad = 0, rowsChecked = 0;
	for (int vocab : {1, 7, 1000, 1025, 32000, 128256, 151936}) {
		const int rows = 12;
		std::vector<float> l((size_t)rows * vocab);
		std::normal_distribution<float> nd(0, 3);
		for (auto &x : l) x = nd(rng);
		auto row = [&](int r) { return &l[(size_t)r * vocab]; };
		std::uniform_int_distribution<int> any(0, vocab - 1);
		row(1)[any(rng)] = NAN, row(1)[any(rng)] = NAN;                       // NaN never wins
		row(2)[any(rng)] = INFINITY, row(2)[any(rng)] = FLT_MAX;              // +Inf ties FLT_MAX: the first wins
		for (int i = 0; i < vocab; i++) row(3)[i] = -INFINITY;                // all -Inf: 0
		for (int i = 0; i < vocab; i++) row(4)[i] = NAN;                      // all NaN: 0
		row(5)[vocab - 1] = 100;                                              // the last
		row(6)[0] = 100;                                                      // the first
		for (int i = 0; i < vocab; i++) row(7)[i] = 1.5f;                     // all equal: 0
		row(8)[any(rng)] = 50, row(8)[any(rng)] = 50, row(8)[any(rng)] = 50; // ties: the lowest
		row(9)[any(rng)] = -INFINITY, row(9)[0] = NAN;
		row(10)[any(rng)] = INFINITY, row(10)[any(rng)] = INFINITY;
		std::vector<int> picks(rows, -2);
		if (int ce = mf_greedy_picks(l.data(), rows, vocab, picks.data())) {
			fprintf(stderr, "mf_greedy_picks: CUDA error %d\n", ce);
			return 1;
		}
		for (int r = 0; r < rows; r++, rowsChecked++) {
			const int want = greedyPick(row(r), vocab);
			if (picks[r] != want) {
				bad++;
				printf("  greedy pick of row %d of %d logits: %d, want %d\n", r, vocab, picks[r], want);
			}
		}
	}
	printf("check greedy picks: %d rows, %d wrong: %s\n", rowsChecked, bad, bad ? "FAIL" : "ok");
	return bad ? 1 : 0;
}

// Fills device memory with random quantized blocks: no host round trip for
// gigabytes of weights.
__global__ void fillRandom(uint8_t *p, size_t n, int type, uint64_t seed, float scale) {
	for (size_t i = blockIdx.x * (size_t)blockDim.x + threadIdx.x; i < n; i += (size_t)gridDim.x * blockDim.x) {
		uint64_t z = (i + seed) * 0x9E3779B97F4A7C15ull;
		z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
		z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
		z ^= z >> 31;
		uint8_t b = (uint8_t)z;
		if (type == MF_Q4_0) {
			size_t o = i % 18;
			if (o < 2) {
				__half d = __float2half(scale * (0.5f + (float)((z >> 8) & 1023) / 1024.f) / 8.f);
				b = reinterpret_cast<uint8_t *>(&d)[o];
			}
		} else if (type == MF_Q6_K) {
			size_t o = i % 210;
			if (o >= 208) {
				__half d = __float2half(scale / 1280.f);
				b = reinterpret_cast<uint8_t *>(&d)[o - 208];
			} else if (o >= 192) {
				b = (uint8_t)(int8_t)((int)((z >> 8) % 121) - 60);
			}
		} else if (type == MF_F32) {
			// norms near one
			size_t o = i % 4;
			float f = 1.f;
			b = reinterpret_cast<uint8_t *>(&f)[o];
		} else if (type == MF_F16) {
			__half h = __float2half(((float)((z >> 8) & 2047) / 1024.f - 1.f));
			b = reinterpret_cast<uint8_t *>(&h)[i % 2];
		}
		p[i] = b;
	}
}

static void *randomDevice(int type, size_t bytes, float scale, uint64_t &seed, double *total) {
	void *p;
	CHECK(cudaMalloc(&p, bytes));
	fillRandom<<<1024, 256>>>((uint8_t *)p, bytes, type, seed, scale);
	CHECK(cudaGetLastError());
	seed += bytes;
	if (total) *total += (double)bytes;
	return p;
}

static const int kRowsMax = 16;
static double oneRow = 0;

// BenchModel is bench's model on the GPU: random weights of the 8B-class
// llama, or with big the 32B-class one (qwen2.5-32b's shapes without its
// biases), and the copy bandwidth measured beside it.
struct BenchModel {
	int nLayer, embd, nHead, nKV, hd, ffn, vocab, cells;
	std::vector<mf_layer> layers;
	void *tok, *outNorm, *output;
	double bytes = 0, embdBytes = 0, bw = 0; // read a step; the embedding; copy bandwidth
	mf_config config(int a, int b) const {
		mf_config c{};
		c.n_layer = b - a, c.embd = embd, c.n_head = nHead, c.n_kv_head = nKV, c.head_dim = hd, c.ffn = ffn;
		c.vocab = vocab, c.cells = cells, c.eps = 1e-5f, c.rope_base = 500000, c.rope_freq_scale = 1;
		c.embd_type = MF_Q4_0, c.tok_embd = a == 0 ? tok : nullptr, c.out_type = MF_Q6_K;
		c.out_norm = b == nLayer ? outNorm : nullptr, c.output = b == nLayer ? output : nullptr;
		c.layers = layers.data() + a;
		return c;
	}
};

static BenchModel benchModel(bool big) {
	BenchModel m;
	m.nLayer = big ? 64 : 32, m.embd = big ? 5120 : 4096, m.nHead = big ? 40 : 32, m.nKV = 8, m.hd = 128;
	m.ffn = big ? 27648 : 14336, m.vocab = big ? 152064 : 128256, m.cells = 4096;
	const int nLayer = m.nLayer, embd = m.embd, ffn = m.ffn, vocab = m.vocab, cells = m.cells;
	const int qd = m.nHead * m.hd, kvd = m.nKV * m.hd;
	uint64_t seed = 1;
	double &bytes = m.bytes;
	m.layers.resize(nLayer);
	for (auto &l : m.layers) {
		const float s = 1.f / std::sqrt((float)embd);
		l.attn_norm = randomDevice(MF_F32, 4 * embd, 1, seed, &bytes);
		l.ffn_norm = randomDevice(MF_F32, 4 * embd, 1, seed, &bytes);
		l.wq = randomDevice(MF_Q4_0, rowBytesOf(MF_Q4_0, embd) * qd, s, seed, &bytes);
		l.wk = randomDevice(MF_Q4_0, rowBytesOf(MF_Q4_0, embd) * kvd, s, seed, &bytes);
		l.wv = randomDevice(MF_Q4_0, rowBytesOf(MF_Q4_0, embd) * kvd, s, seed, &bytes);
		l.wo = randomDevice(MF_Q4_0, rowBytesOf(MF_Q4_0, qd) * embd, s, seed, &bytes);
		l.gate = randomDevice(MF_Q4_0, rowBytesOf(MF_Q4_0, embd) * ffn, s, seed, &bytes);
		l.up = randomDevice(MF_Q4_0, rowBytesOf(MF_Q4_0, embd) * ffn, s, seed, &bytes);
		l.down = randomDevice(MF_Q4_0, rowBytesOf(MF_Q4_0, ffn) * embd, 1.f / std::sqrt((float)ffn), seed, &bytes);
		l.k = randomDevice(MF_F16, (size_t)2 * cells * kvd, 1, seed, nullptr);
		l.v = randomDevice(MF_F16, (size_t)2 * cells * kvd, 1, seed, nullptr);
	}
	m.tok = randomDevice(MF_Q4_0, rowBytesOf(MF_Q4_0, embd) * vocab, 1, seed, &m.embdBytes);
	m.outNorm = randomDevice(MF_F32, 4 * embd, 1, seed, &bytes);
	m.output = randomDevice(MF_Q6_K, rowBytesOf(MF_Q6_K, embd) * vocab, 1.f / std::sqrt((float)embd), seed, &bytes);
	CHECK(cudaDeviceSynchronize());

	// Copy bandwidth: bytes read plus bytes written.
	const size_t cb = (size_t)2 << 30;
	void *s1, *s2;
	CHECK(cudaMalloc(&s1, cb));
	CHECK(cudaMalloc(&s2, cb));
	CHECK(cudaMemset(s1, 1, cb));
	cudaEvent_t e0, e1;
	CHECK(cudaEventCreate(&e0));
	CHECK(cudaEventCreate(&e1));
	std::vector<float> ms;
	for (int i = 0; i < 12; i++) {
		CHECK(cudaEventRecord(e0));
		CHECK(cudaMemcpy(s2, s1, cb, cudaMemcpyDeviceToDevice));
		CHECK(cudaEventRecord(e1));
		CHECK(cudaEventSynchronize(e1));
		float t;
		CHECK(cudaEventElapsedTime(&t, e0, e1));
		if (i >= 2) ms.push_back(t);
	}
	std::sort(ms.begin(), ms.end());
	m.bw = 2.0 * cb / (ms[ms.size() / 2] * 1e-3);
	CHECK(cudaFree(s1));
	CHECK(cudaFree(s2));
	return m;
}

// bench times one model's steps (benchModel).
static int bench(bool big) {
	BenchModel m = benchModel(big);
	const int vocab = m.vocab;
	const double bytes = m.bytes, embdBytes = m.embdBytes, bw = m.bw;
	const mf_config c = m.config(0, m.nLayer);
	mf_engine *e = create(c);
	std::vector<float> logits(vocab);
	const double fileBytes = bytes + embdBytes;
	printf("bench %s-class: %.3f GB read per token (file %.3f GB), copy bandwidth %.0f GB/s\n", big ? "32B" : "8B",
	       bytes / 1e9, fileBytes / 1e9, bw / 1e9);
	for (int n : {64, 192, 320, 2048, 576}) {
		std::vector<int> used(n);
		for (int i = 0; i < n; i++) used[i] = i;
		const int loc = n;
		for (int i = 0; i < 10; i++) step(e, i, nullptr, n, loc, used, logits.data());
		std::vector<double> t;
		for (int i = 0; i < 100; i++) {
			auto s = std::chrono::steady_clock::now();
			step(e, (i * 7919) % vocab, nullptr, n, loc, used, logits.data());
			t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - s).count());
		}
		std::sort(t.begin(), t.end());
		const double med = t[t.size() / 2];
		bool finite = true;
		uint64_t hash = 1469598103934665603ull; // FNV-1a of the last step's logits: runs of two builds should match
		for (float v : logits) {
			finite = finite && std::isfinite(v);
			uint32_t b;
			memcpy(&b, &v, 4);
			hash = (hash ^ b) * 1099511628211ull;
		}
		printf("  context %4d: step %.3f ms median (min %.3f), %.1f tok/s; %.2f of the file floor (%.1f tok/s), %.2f of the read floor; %.0f GB/s; logits %s, hash %016llx\n",
		       n, med * 1e3, t[0] * 1e3, 1 / med, (fileBytes / bw) / med, bw / fileBytes, (bytes / bw) / med,
		       bytes / med / 1e9, finite ? "finite" : "NOT FINITE", (unsigned long long)hash);
		// The same steps asking for the greedy pick, as meshnode's greedy
		// decoding does: no logits cross the bus.
		t.clear();
		int pick = 0;
		for (int i = 0; i < 100; i++) {
			auto s = std::chrono::steady_clock::now();
			pick = pickOf(e, (i * 7919) % vocab, nullptr, n, loc, used);
			t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - s).count());
		}
		std::sort(t.begin(), t.end());
		printf("  context %4d: greedy-pick step %.3f ms median (min %.3f), %.2f of the read floor; last pick %d, of the logits %d\n", n,
		       t[t.size() / 2] * 1e3, t[0] * 1e3, (bytes / bw) / t[t.size() / 2], pick, greedyPick(logits.data(), vocab));
		// And queued a pass ahead (mf_queue_picks), each pass's token the
		// last pick: the host's time between passes off the GPU's path.
		{
			const double best = queuedStep(e, n, loc, used);
			printf("  context %4d: queued greedy step %.3f ms (best of 3 runs of 100), %.2f of the read floor\n", n, best * 1e3,
			       (bytes / bw) / best);
			// Cell loc again as the logits' last step left it, which the
			// larger contexts after this one read: their hashes compare
			// across builds.
			step(e, (99 * 7919) % vocab, nullptr, n, loc, used, logits.data());
		}
	}
	// Several sequences at once, each at 576 cells: the cells are shared
	// (only reads), the cells written differ.
	{
		const int n = 576;
		std::vector<int> used(n);
		for (int i = 0; i < n; i++) used[i] = i;
		std::vector<float> out((size_t)kRowsMax * vocab);
		for (int rows = 1; rows <= mf_max_rows(e); rows *= 2) {
			std::vector<int> toks(rows), pos(rows, n), loc(rows), ncells(rows, n), all;
			for (int r = 0; r < rows; r++) loc[r] = n + r, all.insert(all.end(), used.begin(), used.end());
			std::vector<double> t;
			for (int i = 0; i < 60; i++) {
				for (int r = 0; r < rows; r++) toks[r] = (i * 7919 + r * 104729) % vocab;
				auto s = std::chrono::steady_clock::now();
				stepRows(e, rows, toks.data(), nullptr, pos.data(), loc.data(), all, ncells.data(), out.data());
				if (i >= 10) t.push_back(std::chrono::duration<double>(std::chrono::steady_clock::now() - s).count());
			}
			std::sort(t.begin(), t.end());
			const double med = t[t.size() / 2];
			printf("  rows %d at 576 cells: step %.3f ms median (min %.3f), %.1f tok/s, %.2fx one row's time\n", rows, med * 1e3,
			       t[0] * 1e3, rows / med, rows == 1 ? 1.0 : med / oneRow);
			if (rows == 1) oneRow = med;
		}
	}
	mf_profile(e);
	// The last pass above had mf_max_rows rows: their parameters hold.
	for (int rows = 2; rows <= mf_max_rows(e); rows *= 2) mf_profile_rows(e, rows);
	mf_destroy(e);
	return 0;
}

// median of t, in ms.
static double medianMs(std::vector<double> t) {
	std::sort(t.begin(), t.end());
	return t[t.size() / 2] * 1e3;
}

// SplitStages is the bench model whole on one engine and split at a layer
// into two, with pinned memory for the first stage's hidden state: what
// split and handoff time.
struct SplitStages {
	BenchModel m;
	mf_engine *whole = nullptr, *s1 = nullptr, *s2 = nullptr;
	float *hidden = nullptr;
	// firstStep steps the first stage at position n, in cell loc after the
	// cells used, its hidden state into hidden.
	void firstStep(int tok, int n, int loc, const std::vector<int> &used) const {
		char err[512];
		if (mf_step(s1, tok, nullptr, n, loc, used.data(), n, hidden, 1, err, sizeof err)) {
			fprintf(stderr, "mf_step (first stage): %s\n", err);
			exit(1);
		}
	}
	~SplitStages() {
		mf_host_free(hidden);
		mf_destroy(s2), mf_destroy(s1), mf_destroy(whole);
	}
};

// openSplit makes s for what (split, handoff), split at layer a; false,
// having said why, if it cannot.
static bool openSplit(const char *what, int a, SplitStages &s) {
	s.m = benchModel(false);
	const BenchModel &m = s.m;
	if (a <= 0 || a >= m.nLayer) {
		fprintf(stderr, "%s: layer %d outside 1..%d\n", what, a, m.nLayer - 1);
		return false;
	}
	s.whole = create(m.config(0, m.nLayer)), s.s1 = create(m.config(0, a)), s.s2 = create(m.config(a, m.nLayer));
	if (!(s.hidden = mf_host_alloc(m.embd))) {
		fprintf(stderr, "%s: no pinned memory\n", what);
		return false;
	}
	return true;
}

// split times the bench model's greedy steps as two stages, layers [0, a)
// and [a, nLayer) on two engines of this process stepping one after the
// other (the first's hidden state to pinned memory, as a mesh stage's),
// against the whole model on one engine, stepping and queued ahead: what
// a split costs inside the engines, without hops or other processes. The
// two stages' pick must be the whole model's.
static int split(int a) {
	SplitStages s;
	if (!openSplit("split", a, s)) return 1;
	const BenchModel &m = s.m;
	mf_engine *whole = s.whole, *s2 = s.s2;
	float *hidden = s.hidden;
	printf("split of the 8B-class model at layer %d; copy bandwidth %.0f GB/s, floor %.3f ms a step\n", a, m.bw / 1e9,
	       m.bytes / m.bw * 1e3);
	int bad = 0;
	for (int n : {64, 192, 320}) {
		std::vector<int> used(n);
		for (int i = 0; i < n; i++) used[i] = i;
		const int loc = n;
		auto stage1 = [&](int tok) { s.firstStep(tok, n, loc, used); };
		for (int i = 0; i < 10; i++) pickOf(whole, i, nullptr, n, loc, used), stage1(i), pickOf(s2, 0, hidden, n, loc, used);
		std::vector<double> tw, t1, t2, ts;
		int differ = 0;
		for (int i = 0; i < 100; i++) {
			const int tok = (i * 7919) % m.vocab;
			auto s = std::chrono::steady_clock::now();
			const int pw = pickOf(whole, tok, nullptr, n, loc, used);
			auto s0 = std::chrono::steady_clock::now();
			stage1(tok);
			auto s1t = std::chrono::steady_clock::now();
			const int ps = pickOf(s2, 0, hidden, n, loc, used);
			auto s2t = std::chrono::steady_clock::now();
			differ += pw != ps;
			tw.push_back(std::chrono::duration<double>(s0 - s).count());
			t1.push_back(std::chrono::duration<double>(s1t - s0).count());
			t2.push_back(std::chrono::duration<double>(s2t - s1t).count());
			ts.push_back(std::chrono::duration<double>(s2t - s0).count());
		}
		const double queued = queuedStep(whole, n, loc, used) * 1e3;
		const double w = medianMs(tw), st = medianMs(ts);
		printf("  context %4d: whole %.3f ms stepping, %.3f queued; split %.3f ms (first %.3f + last %.3f, medians), %.3fx queued, "
		       "%.3fx stepping; picks %s\n",
		       n, w, queued, st, medianMs(t1), medianMs(t2), queued / st, w / st, differ ? "DIFFER" : "equal");
		if (differ) fprintf(stderr, "split at %d, %d cells: %d of 100 picks differ from the whole model's\n", a, n, differ), bad = 1;
	}
	return bad;
}

// handoff times the two stages of split, the first stage's hidden state
// handed to the second on the device (mf_launch_rows): the second stage's
// pass is queued right behind the first's, waiting on an event for its
// input, so that no host stands between the two graphs. Against split's
// hand-off through the host, it is what a device hand-off between two
// stages of one GPU can win, without processes or hops on either side.
// Both hand-offs' picks must be the whole model's.
static int handoff(int a) {
	SplitStages s;
	if (!openSplit("handoff", a, s)) return 1;
	const BenchModel &m = s.m;
	mf_engine *whole = s.whole, *s1 = s.s1, *s2 = s.s2;
	float *hidden = s.hidden, *dev = mf_device_alloc(s1, m.embd);
	void *ev = mf_event_create(s1);
	if (!dev || !ev) {
		fprintf(stderr, "handoff: no device memory or event\n");
		return 1;
	}
	printf("hand-off of the 8B-class model's split at layer %d; copy bandwidth %.0f GB/s, floor %.3f ms a step\n", a, m.bw / 1e9,
	       m.bytes / m.bw * 1e3);
	int bad = 0;
	char err[512];
	for (int n : {64, 192, 320}) {
		std::vector<int> used(n);
		for (int i = 0; i < n; i++) used[i] = i;
		int loc = n, pos = n, ncells = n;
		auto viaHost = [&](int tok) {
			s.firstStep(tok, pos, loc, used);
			return pickOf(s2, 0, hidden, pos, loc, used);
		};
		auto viaDevice = [&](int tok) {
			int pick = -2, none = 0;
			if (mf_launch_rows(s1, 1, &tok, nullptr, nullptr, nullptr, &pos, &loc, used.data(), &ncells, dev, ev, err, sizeof err) ||
			    mf_launch_rows(s2, 1, &none, nullptr, dev, ev, &pos, &loc, used.data(), &ncells, nullptr, nullptr, err, sizeof err) ||
			    mf_finish_rows(s1, nullptr, nullptr, err, sizeof err) || mf_finish_rows(s2, &pick, nullptr, err, sizeof err)) {
				fprintf(stderr, "device hand-off: %s\n", err);
				exit(1);
			}
			return pick;
		};
		for (int i = 0; i < 10; i++) pickOf(whole, i, nullptr, pos, loc, used), viaHost(i), viaDevice(i);
		std::vector<double> tw, th, td;
		int differHost = 0, differDevice = 0;
		for (int i = 0; i < 100; i++) {
			const int tok = (i * 7919) % m.vocab;
			auto s = std::chrono::steady_clock::now();
			const int pw = pickOf(whole, tok, nullptr, pos, loc, used);
			auto s0 = std::chrono::steady_clock::now();
			const int ph = viaHost(tok);
			auto s1t = std::chrono::steady_clock::now();
			const int pd = viaDevice(tok);
			auto s2t = std::chrono::steady_clock::now();
			differHost += pw != ph, differDevice += pw != pd;
			tw.push_back(std::chrono::duration<double>(s0 - s).count());
			th.push_back(std::chrono::duration<double>(s1t - s0).count());
			td.push_back(std::chrono::duration<double>(s2t - s1t).count());
		}
		const double queued = queuedStep(whole, n, loc, used) * 1e3;
		const double h = medianMs(th), d = medianMs(td);
		printf("  context %4d: whole %.3f ms stepping, %.3f queued; split through the host %.3f ms (%.3fx queued), on the device %.3f "
		       "(%.3fx queued, %.3f ms less); picks %s\n",
		       n, medianMs(tw), queued, h, queued / h, d, queued / d, h - d, differHost || differDevice ? "DIFFER" : "equal");
		if (differHost || differDevice)
			fprintf(stderr, "handoff at %d, %d cells: %d (host) and %d (device) of 100 picks differ from the whole model's\n", a, n,
			        differHost, differDevice),
			    bad = 1;
	}
	mf_event_destroy(ev);
	mf_device_free(dev);
	return bad;
}

int main(int argc, char **argv) {
	const char *what = argc > 1 ? argv[1] : "check";
	int bad = 0;
	if (!strcmp(what, "check") || !strcmp(what, "all")) {
		// Query heads per KV head 4, 4, 5, 1, 8, 3; one split of the cache
		// and several (see AttnArgs.cellsPerSplit); the Q6_K head's rows
		// copied in pieces of 16, 4 and 8 bytes (copyWidth). Twice: with
		// the splits of a head merged in clusters where they may be
		// (mf_engine.execMerge) and without, on the same models; and the
		// head through gemv, not the packed copy (mf_engine.head6W).
		struct {
			const char *clusters, *packed;
		} runs[] = {{"0", ""}, {"", ""}, {"", "0"}};
		for (const auto &run : runs) {
			rng.seed(42);
			const char *clusters = run.clusters;
			setenv("MESHNODE_FUSED_ATTN_CLUSTER", clusters, 1);
			if (!*clusters) unsetenv("MESHNODE_FUSED_ATTN_CLUSTER");
			setenv("MESHNODE_FUSED_PACKED_HEAD", run.packed, 1);
			if (!*run.packed) unsetenv("MESHNODE_FUSED_PACKED_HEAD");
			printf("one-row checks, splits merged in clusters %s, the Q6_K head %s\n", *clusters ? "off" : "where they may be",
			       *run.packed ? "through gemv" : "packed where there is room");
			bad |= check(2048, 16, 4, 128, 100);
			bad |= check(2048, 32, 8, 64, 100);
			bad |= check(2560, 20, 4, 128, 200);
			bad |= check(2048, 8, 8, 64, 20);
			bad |= check(2048, 16, 2, 128, 150);
			bad |= check(3072, 24, 8, 128, 220);
			bad |= check(5120, 40, 8, 128, 90);
			bad |= check(4096, 32, 8, 128, 130); // the 8B model's rows (run 283)
			bad |= check(6144, 48, 8, 128, 70);
			// q, k and v biases and NeoX rotation (qwen2).
			bad |= check(2048, 16, 2, 128, 120, true);
			bad |= check(2048, 32, 4, 64, 40, true);
		}
		unsetenv("MESHNODE_FUSED_PACKED_HEAD");
		bad |= checkHeadPicks("");
		bad |= checkHeadPicks("0");
		bad |= checkQueue(1, 12);
		bad |= checkQueue(3, 9);
		// Several sequences in one pass.
		bad |= checkPicks();
		bad |= checkRows(2048, 16, 4, 128, 3);
		bad |= checkRows(2048, 32, 8, 64, 8);
		bad |= checkRows(5120, 40, 8, 128, 4);
		bad |= checkRows(4096, 32, 8, 128, 8);
		bad |= checkRows(2048, 16, 4, 128, 4);
		bad |= checkRows(2048, 16, 4, 128, 5);
		bad |= checkRows(2048, 16, 4, 128, 2);
		// Rows longer than kSplitK (down, 27648 columns): two launches.
		bad |= checkRows(5120, 40, 8, 128, 8, nullptr, 27648);
		bad |= checkRows(2048, 16, 4, 128, 3, nullptr, 17152); // 67 super-blocks: 34 + 33
		// Two tiles of eight rows; down of 14336 and 27648 columns in two
		// launches of one tile (9 rows: five and four).
		bad |= checkRows(2048, 16, 4, 128, 16);
		bad |= checkRows(2048, 32, 8, 64, 11);
		bad |= checkRows(4096, 32, 8, 128, 16, nullptr, 14336);
		bad |= checkRows(5120, 40, 8, 128, 9, nullptr, 27648);
		bad |= checkRows(5120, 40, 8, 128, 16, nullptr, 27648);
	}
	if (!strcmp(what, "bench") || !strcmp(what, "all")) bad |= bench(false);
	if (!strcmp(what, "bench32")) bad |= bench(true);
	if (!strcmp(what, "split")) bad |= split(argc > 2 ? atoi(argv[2]) : 18);
	if (!strcmp(what, "handoff")) bad |= handoff(argc > 2 ? atoi(argv[2]) : 18);
	return bad;
}
