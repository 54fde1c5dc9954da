/*
 * synth: synthetic model files. synth_write() writes a complete, valid GGUF
 * of a qwen3moe, qwen3next or qwen35moe model with llama.cpp's tensor names,
 * shapes, types and metadata keys (model-spec sections 4-7), random weights
 * scaled so that activations stay in range through every layer, a small
 * byte-level BPE vocabulary, and optionally routers skewed so that expert
 * popularity follows a Zipf law ("heat").
 *
 * Output is a pure function of the config minus threads/progress: the same
 * seed gives the same bytes. Weights are drawn per tensor row from a seeded
 * PRNG (norm weights 1 +- 0.02, matrices uniform with std 1/sqrt(fan_in),
 * output projections further scaled by 1/sqrt(2 * layers), ssm_a = -exp(U(-2,0)),
 * ssm_dt.bias std 0.1, conv taps std 1/sqrt(K), lm head std 2.5/sqrt(n_embd))
 * and quantized with quant_quantize_row. Plain matrices of a block type with
 * at least SYNTH_POOL_MIN_ELEMS elements (expert stacks of the big shapes, the
 * lm head) are, unless cfg->exact, built from a pool of 2^21 elements' worth
 * of blocks quantized the same way and picked at random per block: the same
 * distribution at memcpy speed (quant_quantize_row alone makes ~170 MB/s of
 * Q4_0 per core).
 *
 * Norms, routers (ffn_gate_inp), the shared-expert gate (ffn_gate_inp_shexp,
 * ne {n, 1}), ssm_conv1d, ssm_a, ssm_dt.bias and ssm_norm are F32, as the
 * converter writes them; every other matrix has cfg->type, or Q8_0 (F16 when
 * ne[0] % 32 != 0) where ne[0] is not a multiple of the type's block size.
 *
 * Heat S > 0: every token embedding gets a shared offset c (std 0.5 per
 * element against 1 for the token's own part); router row e of layer L is a
 * random unit vector orthogonal to c (so every expert sees logit noise of the
 * same spread and no per-expert constant) plus beta[rank_L(e)] * c/|c|, where
 * rank_L is a seeded permutation per layer and beta is calibrated once on
 * 1024 sample tokens (embedding -> RMSNorm -> router -> top-k, layer 0) so
 * that the share of routes of the expert of rank r follows p_r ~ 1/(r+1)^S,
 * capped at 0.9/top_k (an expert can be chosen at most once per token; the
 * cap keeps the top ones at 90% of tokens) with the excess spread over the
 * others. With heat_measure, popularity is then measured from the written
 * file on 1024 other tokens for evenly spaced layers (as many as 2^31
 * multiply-adds allow, layer 0 first). Deeper layers see the residual stream
 * rather than the embedding; the offset c persists in it (the output
 * projections are scaled down), so the skew carries over approximately.
 *
 * Threading: synth_write() runs cfg->threads generator threads plus the
 * calling thread, which writes. The functions are reentrant.
 */
#ifndef MODEL_SYNTH_H
#define MODEL_SYNTH_H

#include <stdbool.h>
#include <stdint.h>

#define SYNTH_MAX_EXPERTS 1024              /* largest expert count reported on */
#define SYNTH_POOL_MIN_ELEMS (64ull << 20)  /* matrices this large use the block pool */

/* Expert popularity measured from a written file. */
struct synth_heat_report {
    uint32_t n_expert;          /* experts per layer */
    uint32_t top_k;             /* experts used per token */
    uint32_t tokens;            /* sample tokens per measured layer */
    uint32_t layers;            /* layers measured (evenly spaced, layer 0 first) */
    float share[SYNTH_MAX_EXPERTS];  /* share of routes by popularity rank, descending, averaged
                                        over the measured layers; sums to 1 */
    float target[SYNTH_MAX_EXPERTS]; /* the share aimed for by rank (uniform when S = 0) */
    float layer0_top1;          /* layer 0: share of its most popular expert */
    float fitted_s;             /* least-squares slope of -log(share) vs log(rank + 1) */
    char summary[256];          /* one line: exponent, fit, top shares */
};

/* What synth_write() did. */
struct synth_report {
    uint64_t bytes;             /* file size */
    uint64_t n_tensors;         /* tensors written */
    uint64_t n_params;          /* elements over all tensors */
    double seconds;             /* wall time of the whole write */
    double mb_per_s;            /* bytes / seconds / 1e6 */
    struct synth_heat_report heat; /* filled when heat_measure is set */
};

struct synth_config {
    const char *arch;     /* "qwen3moe" | "qwen3next" | "qwen35moe" */
    const char *shape;    /* "tiny" | "30b-a3b" | "35b-a3b" | "80b-a3b" */
    uint32_t layers;      /* block count; 0 = the shape's */
    uint32_t type;        /* enum quant_type of the matrices: F32, F16, BF16, Q8_0, Q4_0, Q4_1,
                             Q5_0, Q5_1, Q4_K, Q5_K, Q6_K */
    bool k_m;             /* with type Q4_K or Q5_K: llama-quantize's Q4_K_M / Q5_K_M mixture
                             (synth_matrix_type_of) */
    float heat;           /* Zipf exponent S of expert popularity; 0 = no skew */
    uint64_t seed;        /* PRNG seed */
    const char *path;     /* output file (created or truncated) */
    uint32_t threads;     /* generator threads; 0 = 2; at most 1024 */
    bool exact;           /* quantize every row (no block pool): slower */
    bool progress;        /* log a progress line at most once per second (files > 256 MB) */
    bool heat_measure;    /* measure expert popularity from the file into report->heat (skipped,
                             with a note in its summary, when path is not a regular file) */
    struct synth_report *report; /* optional: filled on success; borrowed */
};

/* Writes the model file. Returns 0, -EINVAL (bad config: logged with the
 * field), -ENOMEM, or the writer's I/O error (ENOSPC, ...; the partial file
 * is removed). Blocks until the file is complete. */
int synth_write(const struct synth_config *cfg);

/* Parses a type name as the CLI gives it ("f32", "f16", "bf16", "q8_0", "q4_0",
 * "q4_1", "q5_0", "q5_1", "q4_k", "q5_k", "q6_k", and where k_m is not NULL the
 * mixtures "q4_k_m" and "q5_k_m"; any case) into *type and *k_m. Returns 0 or
 * -EINVAL (logged). */
int synth_parse_type(const char *name, uint32_t *type, bool *k_m);

/* The type cfg gives the matrix `name` ("attn_v.weight", "ffn_down_exps.weight",
 * "output.weight", ...) of layer il with rows of ne0: cfg->type, or, in a _K_M
 * mixture, Q6_K where llama-quantize puts it: the lm head; the value-like matrix
 * of a layer (attn_v, or a DeltaNet layer's attn_qkv; one a layer) and every
 * ffn_down matrix (the experts' and the shared expert's) in its "more bits"
 * layers (use_more_bits(i, n): i < n/8, i >= 7n/8, or (i - n/8) % 3 == 2, i the
 * layer and n the count of such matrices in the file, as it counts them). A type
 * whose blocks do not divide ne0 falls back to Q8_0 (or F16). 0 for a cfg that
 * synth_write refuses. */
uint32_t synth_matrix_type_of(const struct synth_config *cfg, const char *name, uint32_t il,
                              int64_t ne0);

/* Parses a heat spec: "zipf:S" with 0 <= S <= 8, or "none" (S = 0). Returns 0
 * or -EINVAL (logged). */
int synth_parse_heat(const char *spec, float *s);

#endif
