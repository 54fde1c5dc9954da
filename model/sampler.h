/*
 * sampler: picks the next token from a row of logits, with llama.cpp's chain of filters and a
 * private, seeded PRNG.
 *
 * Order (as llama.cpp's default chain): repetition and presence penalties over the last
 * penalty_last_n accepted tokens -> top_k -> top_p -> min_p -> temperature -> draw. top_p and
 * min_p therefore see the probabilities before temperature. temperature 0 is greedy: the arg-max
 * of the penalized logits, ties to the lowest id (the filters never remove the arg-max, so they
 * do not matter then). NaN logits count as -inf.
 *
 * Sampling draws one PRNG number u in [0, 1) per call (before looking at the logits) and picks by
 * the inverse CDF: the first token whose cumulative weight passes u * total, cumulating in rank
 * order when top_k or top_p is active and in id order otherwise. The GPU twin
 * (kernels/cuda/sample.h) takes u from sampler_next_uniform() and picks the same way.
 *
 * Ranking is a strict total order (higher logit first, lower id first on ties) and the PRNG is
 * xoshiro256** seeded through splitmix64, so one seed gives one sequence on every machine (up to
 * the libm's expf). Nothing sorts the whole vocabulary: top_k keeps a heap of k (O(n log k)),
 * and top_p without top_k finds the nucleus by a quickselect on probability mass (expected
 * O(n)), which matters for 150k-250k vocabularies.
 *
 * Threading: a sampler belongs to one sequence and one thread at a time.
 */
#ifndef MODEL_SAMPLER_H
#define MODEL_SAMPLER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define SAMPLER_DEFAULT_LAST_N 64 /* penalty window when penalty_last_n is 0, tokens */

/* A zeroed config is greedy with no penalties. Values llama.cpp uses by default, for callers
 * that want sampling: temperature 0.8, top_k 40, top_p 0.95, min_p 0.05, repeat_penalty 1.0,
 * presence_penalty 0, penalty_last_n 64. */
struct sampler_config {
    float temperature;      /* >= 0; 0 = greedy (default) */
    int32_t top_k;          /* >= 0; keep the k highest logits; 0 = off (default) */
    float top_p;            /* 0..1; keep the smallest most-probable set whose probability
                               reaches top_p; 0 or 1 = off (default 0) */
    float min_p;            /* 0..1; drop tokens with p < min_p * p_max; 0 = off (default) */
    float repeat_penalty;   /* >= 0; a penalized logit > 0 is divided by it, else multiplied;
                               0 or 1 = off (default 0) */
    float presence_penalty; /* subtracted once from each penalized logit; 0 = off (default) */
    int32_t penalty_last_n; /* accepted tokens the penalties look back over; 0 = 64 (default),
                               -1 = every token since create or reset */
    uint64_t seed;          /* PRNG seed (default 0, itself a valid seed) */
};

struct sampler;

/* Validates cfg and allocates the history; the logit scratch grows on first use. Returns an
 * owned sampler, or NULL after logging which field is out of range (or that memory ran out). */
struct sampler *sampler_create(const struct sampler_config *cfg);

/* Frees everything; accepts NULL. */
void sampler_destroy(struct sampler *s);

/* Picks a token from logits[0 .. n_vocab) (borrowed for the call, never modified). Returns the
 * id, or -ENOMEM (logged) when the scratch cannot grow. Draws one PRNG number unless greedy.
 * Does not record the token: call sampler_accept() with the token actually used. */
int32_t sampler_sample(struct sampler *s, const float *logits, int32_t n_vocab);

/* Records id (>= 0, ASSERTed) in the penalty history; ids at or above a later call's n_vocab
 * are ignored by that call. Returns 0, or -ENOMEM (logged) when an unbounded history
 * (penalty_last_n -1) cannot grow. */
int sampler_accept(struct sampler *s, int32_t id);

/* The same pick as sampler_sample(), for a twin that samples in another process (the last
 * worker): u is the number sampler_next_uniform() drew on the sampler that owns the sequence
 * (in [0, 1), ASSERTed; ignored when greedy) and window[0 .. n_window) the ids its
 * sampler_window() gave (borrowed for the call; ignored without penalties; ids outside
 * [0, n_vocab) are ignored). Uses s only for its config (seed and penalty_last_n play no part)
 * and its scratch; draws nothing and leaves its history alone. With the same config, logits, u
 * and window it returns the token sampler_sample() returns. Returns the id, or -ENOMEM
 * (logged). */
int32_t sampler_sample_given(struct sampler *s, const float *logits, int32_t n_vocab, double u,
                             const int32_t *window, size_t n_window);

/* The validated config; borrowed while s lives. */
const struct sampler_config *sampler_get_config(const struct sampler *s);

/* True when a penalty is configured, so that the window matters to the pick. */
bool sampler_penalizes(const struct sampler *s);

/* For a twin that samples elsewhere (the GPU): consumes and returns the PRNG number in [0, 1)
 * that sampler_sample() would draw now, or 0 without consuming one when greedy. */
double sampler_next_uniform(struct sampler *s);

/* Copies the ids the penalties look back over (the window of accepted ids, in no particular
 * order, repeats kept) into ids[0 .. cap) and returns how many the window holds (when more than
 * cap, only cap were copied). */
size_t sampler_window(const struct sampler *s, int32_t *ids, size_t cap);

/* Clears the history and reseeds the PRNG: the sampler behaves as just created. */
void sampler_reset(struct sampler *s);

#endif
