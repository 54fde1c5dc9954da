/*
 * bench: llama-bench's job for lamina: prompt processing (pp) and text
 * generation (tg) throughput of a model, repeated, with median and spread,
 * as a markdown table or one JSON object; plus the bytes read per generated
 * token and the host's measured read bandwidth, so that a figure can be
 * put against its roofline. Random token ids are fed (as llama-bench does)
 * so that expert routing varies from token to token.
 *
 * --parallel N (cluster only) runs N sequences at once through the workers' pipeline: each
 * prefills n_prompt random ids (its own stream: seed + its index) and then generates n_gen
 * tokens greedily, each fed back as the next input; every sequence keeps one step in flight,
 * so worker 0 runs one sequence's step while worker 1 runs another's. It reports prefill and
 * generation throughput in total and per sequence. Sequence s of a run with seed S sees the
 * same ids, and so generates the same tokens, as sequence 0 of a run with seed S + s.
 *
 * Called from the coordinator's main thread.
 */
#ifndef COORDINATOR_BENCH_H
#define COORDINATOR_BENCH_H

#include <stdbool.h>
#include <stdint.h>

#include "coordinator/cluster.h"

struct bench_config {
    const char *model_path;
    uint32_t n_prompt;     /* pp test length (default 512; 0: skip) */
    uint32_t n_gen;        /* tg test length (default 128; 0: skip) */
    uint32_t n_depth;      /* tokens already in the context when each test starts (prefilled,
                              not timed; llama-bench's -d; default 0) */
    uint32_t reps;         /* repetitions (default 5) */
    int n_threads;         /* <= 0: physical cores */
    uint32_t n_batch;      /* prefill tokens per pass (default 512) */
    bool kv_f16;
    bool json;             /* one JSON object on the last line instead of a table */
    bool membw;            /* measure host read bandwidth (default true) */
    uint64_t seed;         /* token ids */
    struct cluster_config *cluster; /* workers (--devices), or NULL: in-process */
    const char *backend;            /* in-process worker backend ("cuda:0"), or NULL: CPU */
    void (*on_cluster)(struct cluster *c);
    uint32_t parallel;     /* sequences in flight at once, 1..CLUSTER_SEQ_MAX (needs cluster);
                              0: the one-sequence pp and tg tests */
    const char *dump_tokens; /* --parallel: each sequence's generated tokens of the last rep,
                                one line per sequence ("seq S: T0 T1 ..."), with an FNV-1a
                                hash of its logits bytes when they came to this process
                                (--sample-on coordinator); NULL: none */
};

/* Runs and prints the results to stdout. Returns 0 or a negative errno. */
int bench_run(const struct bench_config *cfg);

#endif
