// llamacpp-ref: llama.cpp's own engine (libllama, built from the sources of
// the ollama module pinned in go.mod) driven the way meshnode's bench and
// tests drive meshnode's engine, so that "on par with llama.cpp" is a ratio
// measured in the same run on the same file, and greedy tokens can be
// checked against a forward pass nobody here wrote.
//
//   llamacpp-ref bench  MODEL THREADS PROMPT DECODE STREAMS SEED
//       prints "prefill_tps decode_tps": STREAMS sequences, each prefilled
//       with PROMPT random tokens in its own pass, then DECODE steps with
//       all sequences in one pass each (as meshnode bench measures).
//   llamacpp-ref greedy MODEL THREADS N TOKEN...
//       prints the N tokens greedy decoding picks after the given prompt.

#include <chrono>
#include <cstdio>
#include <cstdlib>
#include <cstring>
#include <random>
#include <string>
#include <vector>

#include "llama.h"

namespace {

void quiet(enum ggml_log_level level, const char * text, void *) {
	if (level >= GGML_LOG_LEVEL_ERROR || getenv("LLAMACPP_REF_LOG")) fputs(text, stderr);
}

struct engine {
	llama_model * model = nullptr;
	llama_context * ctx = nullptr;
	int vocab = 0;

	bool open(const char * path, int threads, int n_ctx, int n_batch, int n_seq) {
		llama_model_params mp = llama_model_default_params();
		mp.n_gpu_layers = 0;
		mp.progress_callback = [](float, void *) { return true; }; // no dots
		model = llama_model_load_from_file(path, mp);
		if (model == nullptr) return false;
		llama_context_params cp = llama_context_default_params();
		cp.n_ctx = (uint32_t)(n_ctx * n_seq);
		cp.n_batch = cp.n_ubatch = (uint32_t)n_batch;
		cp.n_seq_max = (uint32_t)n_seq;
		cp.n_threads = cp.n_threads_batch = threads;
		if (const char * fa = getenv("LLAMACPP_REF_FLASH_ATTN")) {
			cp.flash_attn_type = strcmp(fa, "on") == 0 ? LLAMA_FLASH_ATTN_TYPE_ENABLED
			                   : strcmp(fa, "off") == 0 ? LLAMA_FLASH_ATTN_TYPE_DISABLED
			                                           : LLAMA_FLASH_ATTN_TYPE_AUTO;
		}
		ctx = llama_init_from_model(model, cp);
		if (ctx == nullptr) return false;
		vocab = llama_vocab_n_tokens(llama_model_get_vocab(model));
		return true;
	}

	~engine() {
		if (ctx) llama_free(ctx);
		if (model) llama_model_free(model);
	}

	// argmax of the logits of batch row i.
	int pick(int i) const {
		const float * l = llama_get_logits_ith(ctx, i);
		int best = 0;
		for (int t = 1; t < vocab; t++) {
			if (l[t] > l[best]) best = t;
		}
		return best;
	}
};

void add(llama_batch & b, int tok, int pos, int seq, bool logits) {
	b.token[b.n_tokens] = tok;
	b.pos[b.n_tokens] = pos;
	b.n_seq_id[b.n_tokens] = 1;
	b.seq_id[b.n_tokens][0] = seq;
	b.logits[b.n_tokens] = logits;
	b.n_tokens++;
}

double seconds_since(std::chrono::steady_clock::time_point t) {
	return std::chrono::duration<double>(std::chrono::steady_clock::now() - t).count();
}

int bench(const char * path, int threads, int prompt, int decode, int streams, unsigned seed) {
	engine e;
	if (!e.open(path, threads, prompt + decode + 8, prompt, streams)) {
		fprintf(stderr, "llamacpp-ref: cannot load %s\n", path);
		return 1;
	}
	std::mt19937 rng(seed);
	std::uniform_int_distribution<int> any(0, e.vocab - 1);
	llama_batch b = llama_batch_init(prompt > streams ? prompt : streams, 0, 1);
	llama_memory_t mem = llama_get_memory(e.ctx);

	// Warm-up pass of each size, then an empty cache, as meshnode bench.
	b.n_tokens = 0;
	for (int p = 0; p < prompt; p++) add(b, any(rng), p, 0, p == prompt - 1);
	if (llama_decode(e.ctx, b) != 0) return 2;
	b.n_tokens = 0;
	add(b, 1, prompt, 0, true);
	if (llama_decode(e.ctx, b) != 0) return 2;
	llama_memory_clear(mem, true);

	std::vector<int> last(streams);
	auto start = std::chrono::steady_clock::now();
	for (int s = 0; s < streams; s++) {
		b.n_tokens = 0;
		for (int p = 0; p < prompt; p++) add(b, any(rng), p, s, p == prompt - 1);
		if (llama_decode(e.ctx, b) != 0) return 2;
		last[s] = e.pick(prompt - 1);
	}
	const double prefill = (double)streams * prompt / seconds_since(start);

	start = std::chrono::steady_clock::now();
	for (int step = 0; step < decode; step++) {
		b.n_tokens = 0;
		for (int s = 0; s < streams; s++) add(b, last[s], prompt + step, s, true);
		if (llama_decode(e.ctx, b) != 0) return 2;
		for (int s = 0; s < streams; s++) last[s] = e.pick(s);
	}
	const double dec = (double)streams * decode / seconds_since(start);
	llama_batch_free(b);
	printf("%.3f %.3f\n", prefill, dec);
	return 0;
}

int greedy(const char * path, int threads, int n, const std::vector<int> & prompt) {
	engine e;
	if (prompt.empty() || !e.open(path, threads, (int)prompt.size() + n + 8, (int)prompt.size(), 1)) {
		fprintf(stderr, "llamacpp-ref: cannot load %s\n", path);
		return 1;
	}
	llama_batch b = llama_batch_init((int)prompt.size(), 0, 1);
	for (size_t p = 0; p < prompt.size(); p++) add(b, prompt[p], (int)p, 0, p + 1 == prompt.size());
	int pos = (int)prompt.size();
	for (int i = 0; i < n; i++) {
		if (llama_decode(e.ctx, b) != 0) return 2;
		const int t = e.pick(b.n_tokens - 1);
		printf(i ? " %d" : "%d", t);
		b.n_tokens = 0;
		add(b, t, pos++, 0, true);
	}
	printf("\n");
	llama_batch_free(b);
	return 0;
}

} // namespace

int main(int argc, char ** argv) {
	llama_log_set(quiet, nullptr);
	llama_backend_init();
	int rc = 64;
	if (argc == 8 && strcmp(argv[1], "bench") == 0) {
		rc = bench(argv[2], atoi(argv[3]), atoi(argv[4]), atoi(argv[5]), atoi(argv[6]), (unsigned)atoi(argv[7]));
	} else if (argc >= 6 && strcmp(argv[1], "greedy") == 0) {
		std::vector<int> prompt;
		for (int i = 5; i < argc; i++) prompt.push_back(atoi(argv[i]));
		rc = greedy(argv[2], atoi(argv[3]), atoi(argv[4]), prompt);
	} else {
		fprintf(stderr, "usage: llamacpp-ref bench MODEL THREADS PROMPT DECODE STREAMS SEED\n"
		                "       llamacpp-ref greedy MODEL THREADS N TOKEN...\n");
	}
	llama_backend_free();
	return rc;
}
