// Package sample picks the next token from a model's logits.
//
// Order of operations in Sampler.Sample:
//
//  1. Penalties over the last RepeatLastN tokens of the history (prompt and
//     generated tokens): the repetition penalty, llama.cpp style (positive
//     logits divided by it, negative ones multiplied), then the frequency
//     and presence penalties, OpenAI style (logit -= count*frequency +
//     presence for every token seen).
//  2. Temperature 0: greedy argmax, ties to the lowest token id.
//  3. Otherwise top-k, softmax with the temperature, top-p (the smallest set
//     of most likely tokens whose mass reaches p), min-p (tokens at least
//     min_p times as likely as the most likely one, which always stays),
//     then one draw from a PCG generator seeded from Params.Seed. A mass or
//     ratio within 1e-6 (relative) of top_p or min_p counts as reaching it,
//     since float32 logits carry no more precision than that.
//
// NaN logits count as -Inf and +Inf as the largest finite logit. If no token
// has a logit above -Inf (a broken model, or a fully masked vocabulary) there
// is nothing to sample from; Sample then falls back to the deterministic
// argmax, which is token 0, and draws no random number.
//
// # Reproducibility
//
// The same Params (with a Seed), logits and history give the same tokens.
// The random number behind a token depends only on the seed and the token's
// position, so a request moved to another pipeline and replayed from its
// history continues the identical token stream: there is no sampler state
// to carry.
// The arithmetic avoids per-architecture math routines, so nodes of
// different architectures agree when their logits do.
//
// # Log-probabilities
//
// LogprobOf gives a sampled token's log-probability and the likeliest
// alternatives under the model's own distribution: the softmax of the raw
// logits, before penalties, temperature and filters, normalized in float64
// over the whole vocabulary. The last stage computes them beside the
// sampler for the sequences that ask (Params.Logprobs).
//
// # JSON output
//
// A Sampler constrained with a JSONConstraint (Params.JSON) samples only
// tokens that keep the output a prefix of one JSON object: before the
// penalties' result is filtered, every token whose text JSON (a byte-level
// recognizer) refuses gets -Inf, and once the object closes only an
// end-of-generation token may follow. The recognizer, not the model,
// decides what is JSON, so a model that never saw JSON writes valid JSON.
// With a Schema (ParseSchema: OpenAI's structured outputs), SchemaJSON
// recognizes only the objects the schema allows: the keys it names, the
// types, enums and required members it sets, following every branch of an
// anyOf until the bytes decide.
//
// A Sampler reuses its scratch space, so sampling does not allocate in the
// steady state, and it never sorts the vocabulary: top-k keeps a heap of the
// k best, top-p partitions like quickselect.
package sample
