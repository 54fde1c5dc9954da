/*
 * arch: a loaded model's architecture: hyper-parameters read and validated
 * from GGUF metadata, and every tensor the forward pass uses, bound by
 * llama.cpp's names and checked for shape and type (model-spec sections 3-6).
 *
 * Supports qwen3moe, qwen3next (both the attn_qkv + attn_gate layout and the
 * legacy ssm_in layout) and qwen35moe (separate ssm_beta / ssm_alpha, tiled
 * value heads, multi-section rope, trailing MTP blocks skipped).
 *
 * Matrices stay in the GGUF mapping (borrowed from the gguf, which must outlive
 * the model). Small vectors (norm weights, ssm_a, dt bias, conv taps, the
 * shared-expert gate) are dequantized to owned f32 arrays at load. After
 * arch_load() the model is read-only and may be shared by threads.
 */
#ifndef MODEL_ARCH_H
#define MODEL_ARCH_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "model/gguf.h"

enum arch_kind {
    ARCH_KIND_QWEN3MOE = 0,
    ARCH_KIND_QWEN3NEXT = 1,
    ARCH_KIND_QWEN35MOE = 2,
};

/* A matrix (or stack of expert matrices) as stored: rows of ne[0] elements. */
struct arch_matrix {
    const uint8_t *data;  /* borrowed from the gguf mapping; NULL when absent */
    uint32_t type;        /* enum quant_type */
    uint64_t n_in;        /* ne[0]: input length */
    uint64_t n_out;       /* ne[1]: output length (rows per expert) */
    uint64_t n_mat;       /* ne[2]: experts in a stack, else 1 */
    size_t row_bytes;     /* bytes per row */
    size_t mat_bytes;     /* bytes per matrix (n_out * row_bytes) */
    const char *name;     /* tensor name, borrowed from the gguf */
};

struct arch_hparams {
    enum arch_kind kind;
    const char *arch_name;      /* "qwen3moe", ... (static string) */
    uint32_t n_layer;           /* layers the forward pass runs (MTP blocks excluded) */
    uint32_t n_nextn;           /* trailing MTP blocks present in the file, skipped */
    uint32_t n_embd;            /* hidden width */
    uint32_t n_vocab;           /* rows of token_embd */
    uint32_t n_ctx_train;       /* context_length */
    uint32_t n_head;            /* query heads of attention layers */
    uint32_t n_head_kv;         /* key/value heads */
    uint32_t head_dim;          /* key_length */
    uint32_t n_rot;             /* rope.dimension_count (<= head_dim, even) */
    int32_t rope_sections[4];   /* qwen35moe multi-section rope; zero elsewhere */
    float rope_base;            /* rope.freq_base */
    float attn_scale;           /* 1/sqrt(head_dim) unless attention.scale is set */
    float eps;                  /* layer_norm_rms_epsilon */
    bool attn_gated;            /* attention has the sigmoid output gate (hybrid archs) */
    uint32_t n_expert;          /* routed experts per layer */
    uint32_t n_expert_used;     /* top-k */
    uint32_t n_ff_exp;          /* routed expert width */
    uint32_t n_ff_shexp;        /* shared expert width, 0 when absent */
    uint32_t ssm_conv;          /* K: causal conv taps */
    uint32_t ssm_dk;            /* key head dim (state_size) */
    uint32_t ssm_dv;            /* value head dim (inner_size / nv) */
    uint32_t ssm_nk;            /* key heads (group_count) */
    uint32_t ssm_nv;            /* value heads (time_step_rank) */
    bool ssm_tiled;             /* v-head h uses k-head h % nk (qwen35moe), else h / (nv/nk) */
    uint32_t full_attn_interval;/* every interval-th layer is attention */
};

struct arch_layer {
    bool recurrent;                 /* gated DeltaNet layer, else attention */
    const float *attn_norm;         /* n_embd */
    const float *ffn_norm;          /* n_embd (ffn_norm or post_attention_norm) */
    /* attention */
    struct arch_matrix wq, wk, wv, wo;
    const float *q_norm, *k_norm;   /* head_dim */
    /* gated DeltaNet */
    struct arch_matrix wqkv, wz;    /* current layout: attn_qkv, attn_gate */
    struct arch_matrix win;         /* legacy layout: ssm_in (qkvz interleaved by group) */
    struct arch_matrix wba;         /* qwen3next ssm_ba (grouped) */
    struct arch_matrix wbeta, walpha; /* qwen35moe ssm_beta, ssm_alpha */
    struct arch_matrix wout;        /* ssm_out */
    const float *conv;              /* conv_dim x K taps, channel-major */
    const float *ssm_a;             /* nv: -exp(A_log) */
    const float *dt_bias;           /* nv */
    const float *ssm_norm;          /* dv */
    /* routed experts */
    struct arch_matrix router;      /* ffn_gate_inp: n_embd -> n_expert */
    struct arch_matrix gate_exps, up_exps, down_exps; /* stacks of n_expert */
    struct arch_matrix gate_up_exps;/* fused form: rows 0..F-1 gate, F..2F-1 up */
    /* shared expert */
    const float *shexp_gate;        /* n_embd: ffn_gate_inp_shexp, NULL when absent */
    struct arch_matrix gate_sh, up_sh, down_sh;
};

struct arch_config {
    const struct gguf *gguf; /* borrowed; must outlive the model */
};

struct arch_model {
    struct arch_hparams hp;
    struct arch_matrix tok_embd;    /* n_embd x n_vocab */
    struct arch_matrix output;      /* lm head (token_embd when tied) */
    const float *output_norm;       /* n_embd */
    struct arch_layer *layers;      /* n_layer entries */
    float **owned;                  /* the allocations behind every const float * above */
    size_t n_owned, cap_owned;      /* entries used and allocated in owned */
};

/* Reads hyper-parameters, binds and checks every tensor. Returns an owned
 * model or NULL after one error line naming the key or tensor. */
struct arch_model *arch_load(const struct arch_config *cfg);

/* Frees what arch_load allocated; accepts NULL. */
void arch_free(struct arch_model *m);

/* Name of an arch for messages. */
const char *arch_kind_name(enum arch_kind kind);

/* Pointer to expert e's matrix in a stack (ASSERTs e < n_mat). */
const uint8_t *arch_matrix_expert(const struct arch_matrix *m, uint32_t e);

/* Conv channels of a DeltaNet layer: 2 * nk * dk + nv * dv. */
uint32_t arch_conv_dim(const struct arch_hparams *hp);

#endif
