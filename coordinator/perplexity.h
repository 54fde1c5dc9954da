/*
 * perplexity: llama-perplexity's measurement on a text file: the text is
 * tokenized whole and cut into chunks of n_ctx tokens; each chunk is run
 * from an empty state and the negative log-likelihood of every token in its
 * second half is averaged. PPL = exp(mean NLL). Used to check the engine on
 * a real trained model against llama.cpp's figure.
 *
 * Called from the coordinator's main thread.
 */
#ifndef COORDINATOR_PERPLEXITY_H
#define COORDINATOR_PERPLEXITY_H

#include <stdbool.h>
#include <stdint.h>

#include "coordinator/cluster.h"

struct perplexity_config {
    const char *model_path;  /* GGUF */
    const char *text_path;   /* text file */
    uint32_t n_ctx;          /* chunk length (default 512) */
    uint32_t max_chunks;     /* 0: all */
    int n_threads;           /* <= 0: physical cores */
    bool print_chunks;       /* print the running estimate per chunk (stdout) */
    struct cluster_config *cluster; /* workers, or NULL: in-process */
    const char *record_heat; /* write the routing counts as a heat file here, or NULL */
};

struct perplexity_result {
    double ppl;              /* exp(mean nll) */
    double ppl_err;          /* standard error of the estimate (delta method) */
    uint32_t n_chunks;       /* chunks evaluated */
    uint64_t n_scored;       /* tokens scored */
    double seconds;          /* evaluation time */
};

/* Returns 0 or a negative errno (logged). */
int perplexity_run(const struct perplexity_config *cfg, struct perplexity_result *out);

#endif
