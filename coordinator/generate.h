/*
 * generate: one text-generation job in the coordinator process: load a
 * GGUF model (with a progress bar for large files), tokenize the prompt,
 * prefill, decode with the sampler, stream detokenized text, and report
 * timings. This is the single-process (--inproc) path that the
 * multi-process system must reproduce bit for bit.
 *
 * Called from the coordinator's main thread; owns its thread pool.
 */
#ifndef COORDINATOR_GENERATE_H
#define COORDINATOR_GENERATE_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "coordinator/cluster.h"
#include "model/sampler.h"

struct generate_config {
    const char *model_path;      /* GGUF file */
    const char *prompt;          /* prompt text, or NULL */
    const int32_t *prompt_ids;   /* or explicit ids (n_prompt_ids of them) */
    uint32_t n_prompt_ids;
    int32_t n_predict;           /* tokens to generate (default 128; 0: prompt only) */
    int n_threads;               /* compute threads; <= 0: physical cores */
    uint32_t n_ctx;              /* context; 0: min(train ctx, 4096) */
    uint32_t n_batch;            /* prefill tokens per pass; 0: 256 */
    bool kv_f16;                 /* f16 KV cache (default true in the CLI) */
    bool parse_special;          /* match special-token texts in the prompt (default true) */
    bool ignore_eos;             /* keep generating past end-of-generation tokens */
    bool echo_prompt;            /* print the prompt before the generated text */
    const char *dump_logits;     /* write prompt logits as .npy here, or NULL */
    const char *record_heat;     /* write the routing counts as a heat file here, or NULL */
    const char *prompt_cache;    /* --prompt-cache: the state after the prompt is kept here and
                                    a later prompt that starts with the same tokens continues
                                    from it (below), or NULL */
    bool prompt_cache_ro;        /* use the cache but never write it */
    const char *backend;         /* --inproc --backend: a worker backend ("cuda:0") runs every
                                    layer in this process; NULL: the CPU forward */
    struct sampler_config sampler;
    /* Multi-process: the cluster to build (model fields are filled in by
     * generate); NULL runs every layer in this process (--inproc). */
    struct cluster_config *cluster;
    void (*on_cluster)(struct cluster *c); /* called with the live cluster (or NULL at the end) */
    FILE *out;                   /* generated text goes here (stdout) */
};

/* Timings of one job. */
struct generate_stats {
    double load_s;               /* open, validate, touch weights */
    uint32_t n_prompt;           /* prompt tokens */
    uint32_t n_cached;           /* of them, loaded from the prompt cache */
    double prompt_s;             /* prefill time */
    uint32_t n_gen;              /* generated tokens */
    double gen_s;                /* decode time */
    long peak_rss_kb;            /* getrusage max RSS */
};

/*
 * The prompt cache (llama.cpp's --prompt-cache): a file holding a prompt's tokens, the logits
 * of its last token and the sequence snapshot after it (engine_state_save: KV rows and
 * DeltaNet state of every layer), for one model file (shm_model_hash) and KV type. When the
 * new prompt starts with the file's tokens, the snapshot is loaded and only the rest of the
 * prompt is run (nothing at all when the prompt is the same: the first token is picked from
 * the stored logits); then, unless read-only, the file is replaced (written to a temporary
 * name, then renamed) by the new prompt's. A file made for another model or KV type, a
 * different prompt, or a damaged one is named in a warning and recomputed; a file that is
 * not a prompt cache at all (no magic) is refused and never overwritten.
 *
 * Layout (little-endian): magic "LMNPCACH", u32 version (2), u32 kv_f16, u64 model hash,
 * u32 n_layer, u32 n_tokens, u32 n_vocab, u32 body checksum (generate.c's pc_body_sum over
 * the ids, logits and state), u64 state bytes; then n_tokens i32 ids,
 * n_vocab f32 logits, the state bytes.
 */

/* Runs the job. Returns 0 or a negative errno after logging the cause. */
int generate_run(const struct generate_config *cfg, struct generate_stats *stats);

/* Writes a float32 C-order .npy of rows x cols. Returns 0 or -errno (logged). */
int generate_write_npy(const char *path, const float *data, uint32_t rows, uint32_t cols);

#endif
