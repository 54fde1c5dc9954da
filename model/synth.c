/*
 * synth: the synthetic model generator (see synth.h).
 *
 * synth_write() builds a plan (model dimensions, the list of tensors with how
 * each is drawn, the block pools, the heat vectors), calibrates the router
 * bias for the requested heat, writes metadata and tensor infos, then runs a
 * pipeline: generator threads claim chunks of rows in file order, fill them
 * into a ring of slot buffers, and the calling thread streams finished slots
 * to the gguf_writer in sequence. Every row is drawn from a PRNG keyed by
 * (seed, tensor index, row), so the bytes do not depend on which thread made
 * them or on the chunking.
 *
 * The tokenizer (synth_vocab_*) is a byte-level BPE trained at run time on a
 * built-in list of common English words, so merges are real and consistent.
 */
#include "model/synth.h"

#include <errno.h>
#include <math.h>
#include <pthread.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <strings.h>
#include <sys/stat.h>
#include <time.h>

#include "common/check.h"
#include "common/log.h"
#include "model/gguf.h"
#include "model/gguf_writer.h"
#include "model/quant.h"

#define SYNTH_CHUNK_BYTES (4u << 20)     /* target bytes per pipeline chunk */
#define SYNTH_POOL_ELEMS (1u << 21)      /* elements quantized into a block pool */
#define SYNTH_MAX_POOLS 8                /* distinct (type, amplitude) pools */
#define SYNTH_SAMPLE_TOKENS 1024         /* tokens for heat calibration and measurement */
#define SYNTH_CALIB_ITERS 100            /* bias refinement rounds */
#define SYNTH_MEASURE_MACS (1ull << 31)  /* multiply-adds allowed for measuring heat */
#define SYNTH_MAX_MERGES 400             /* BPE merges for large vocabularies */
#define SYNTH_PROGRESS_BYTES (256ull << 20) /* files above this log progress */
#define SYNTH_MAX_THREADS 1024           /* generator threads accepted */
#define SYNTH_EPS 1e-6f                  /* layer_norm_rms_epsilon */
#define SYNTH_SQRT3 1.7320508f           /* std of U(-1,1) is 1/sqrt(3) */

/* Key domains: separate PRNG streams for separate purposes. */
#define SYNTH_DOMAIN_ROW 0x726f77ull
#define SYNTH_DOMAIN_POOL 0x706f6f6cull
#define SYNTH_DOMAIN_HEAT 0x68656174ull
#define SYNTH_DOMAIN_PERM 0x7065726dull
#define SYNTH_DOMAIN_CALIB 0x63616cull
#define SYNTH_DOMAIN_MEASURE 0x6d6561ull

/* 4-lane vectors: SSE2-sized, so passing them by value keeps the base ABI. */
typedef uint32_t synth_u32x4 __attribute__((vector_size(16)));
typedef int32_t synth_i32x4 __attribute__((vector_size(16)));
typedef float synth_f32x4 __attribute__((vector_size(16)));

/* Eight xorshift32 lanes. */
struct synth_rng {
    synth_u32x4 a, b;
};

enum synth_arch {
    SYNTH_ARCH_QWEN3MOE = 0,
    SYNTH_ARCH_QWEN3NEXT = 1,
    SYNTH_ARCH_QWEN35MOE = 2,
};

/* Model sizes of one shape name (model-spec sections 4.1, 5.1, 6). */
struct synth_shape {
    const char *name;
    uint32_t n_layer;       /* default block count */
    uint32_t n_embd;        /* hidden width */
    uint32_t n_head;        /* attention query heads */
    uint32_t n_head_kv;     /* attention kv heads */
    uint32_t head_dim;      /* key/value length */
    uint32_t n_rot;         /* rotated dims of the hybrid archs (qwen3moe rotates head_dim) */
    int32_t sections[4];    /* qwen35moe rope.dimension_sections */
    float rope_base;        /* rope.freq_base */
    uint32_t ctx;           /* context_length */
    uint32_t vocab;         /* tokens */
    uint32_t n_ff;          /* feed_forward_length (informational) */
    uint32_t n_expert;      /* routed experts */
    uint32_t top_k;         /* experts used per token */
    uint32_t ff_exp;        /* routed expert width */
    uint32_t ff_shexp;      /* shared expert width (hybrid archs) */
    uint32_t nk, nv;        /* DeltaNet key heads (group_count), value heads (time_step_rank) */
    uint32_t dk, dv;        /* DeltaNet key and value head dims */
    uint32_t conv;          /* DeltaNet conv taps */
};

static const struct synth_shape synth_shapes[] = {
    {"tiny", 4, 64, 4, 2, 16, 8, {2, 1, 1, 0}, 1e6f, 4096, 512, 128, 8, 2, 32, 32,
     2, 4, 16, 16, 4},
    {"30b-a3b", 48, 2048, 32, 4, 128, 64, {11, 11, 10, 0}, 1e6f, 40960, 151936, 6144, 128, 8,
     768, 768, 16, 32, 128, 128, 4},
    {"35b-a3b", 40, 2048, 16, 2, 256, 64, {11, 11, 10, 0}, 1e7f, 262144, 248320, 5120, 256, 8,
     512, 512, 16, 32, 128, 128, 4},
    {"80b-a3b", 48, 2048, 16, 2, 256, 64, {11, 11, 10, 0}, 1e7f, 262144, 151936, 5120, 512, 10,
     512, 512, 16, 32, 128, 128, 4},
};

static const char *const synth_arch_names[] = {"qwen3moe", "qwen3next", "qwen35moe"};

/* How a tensor's values are drawn, per row. */
enum synth_gen {
    SYNTH_GEN_UNIFORM = 0,  /* offset + amp * U(-1,1) */
    SYNTH_GEN_EMBD = 1,     /* UNIFORM + the heat offset c */
    SYNTH_GEN_ROUTER = 2,   /* UNIFORM + beta[rank of the row's expert] * c/|c| */
    SYNTH_GEN_NEG_EXP = 3,  /* -exp(offset + amp * U(-1,1)) */
};

struct synth_tensor {
    char name[GGUF_MAX_NAME];
    uint32_t type;          /* enum quant_type as written */
    uint32_t n_dims;
    int64_t ne[GGUF_MAX_DIMS];
    enum synth_gen gen;
    float amp;              /* half-width of the uniform draw */
    float offset;           /* centre of the uniform draw */
    uint32_t layer;         /* block index (routers) */
    int pool;               /* index into plan pools, or -1: quantize every row */
    uint64_t rows;          /* ne[1] * ne[2] * ne[3] */
    size_t row_bytes;       /* bytes of one row */
};

/* Blocks quantized once, copied at random into large expert stacks. */
struct synth_pool {
    uint32_t type;          /* enum quant_type */
    float amp;              /* amplitude the blocks were drawn with */
    uint8_t *blocks;        /* n_blocks quantized blocks */
    uint32_t log2_blocks;   /* n_blocks = 1 << log2_blocks */
    size_t block_bytes;     /* bytes per block */
    uint32_t block_elems;   /* elements per block */
};

struct synth_plan {
    const struct synth_config *cfg;
    enum synth_arch arch;
    struct synth_shape sh;  /* the shape with the layer override applied */
    bool hybrid;            /* DeltaNet + shared expert archs */
    struct synth_tensor *tensors;
    size_t n_tensors, cap_tensors;
    struct synth_pool pools[SYNTH_MAX_POOLS];
    int n_pools;
    float *c;               /* n_embd: heat offset of every embedding (zeros without heat) */
    float *u;               /* n_embd: c / |c| */
    float *beta;            /* n_expert: router bias along u, by popularity rank */
    float *target;          /* n_expert: target share of routes by rank */
    uint32_t *rank;         /* n_layer * n_expert: popularity rank of each expert */
    uint32_t max_ne0;       /* longest row, elements */
    uint64_t n_params;      /* elements of all tensors */
};

/* ---- PRNG ---------------------------------------------------------------- */

static uint64_t synth_mix64(uint64_t z)
{
    z += 0x9E3779B97F4A7C15ull;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static uint64_t synth_key(uint64_t seed, uint64_t domain, uint64_t a, uint64_t b)
{
    return synth_mix64(synth_mix64(synth_mix64(seed ^ domain) + a) + b);
}

/* Seeds the lanes from one key; a lane is never zero. */
static void synth_rng_init(struct synth_rng *r, uint64_t key)
{
    for (int l = 0; l < 4; l++) {
        r->a[l] = (uint32_t)synth_mix64(key + (uint64_t)l) | 1u;
        r->b[l] = (uint32_t)synth_mix64(key + 4 + (uint64_t)l) | 1u;
    }
}

static inline synth_u32x4 synth_xorshift(synth_u32x4 x)
{
    x ^= x << 13;
    x ^= x >> 17;
    x ^= x << 5;
    return x;
}

/* Advances all lanes; the new values are in r->a and r->b. */
static inline void synth_rng_next(struct synth_rng *r)
{
    r->a = synth_xorshift(r->a);
    r->b = synth_xorshift(r->b);
}

/* out[i] = offset + amp * U(-1, 1), n values from the stream of key. */
static void synth_uniform(uint64_t key, float *out, uint64_t n, float amp, float offset)
{
    struct synth_rng r;
    synth_rng_init(&r, key);
    synth_f32x4 scale = {0}, off = {0};
    scale += amp * (1.0f / 2147483648.0f);
    off += offset;
    float tail[8];
    for (uint64_t i = 0; i < n; i += 8) {
        synth_rng_next(&r);
        synth_f32x4 fa = __builtin_convertvector((synth_i32x4)r.a, synth_f32x4) * scale + off;
        synth_f32x4 fb = __builtin_convertvector((synth_i32x4)r.b, synth_f32x4) * scale + off;
        float *dst = i + 8 <= n ? out + i : tail;
        memcpy(dst, &fa, sizeof(fa));
        memcpy(dst + 4, &fb, sizeof(fb));
        if (dst == tail)
            memcpy(out + i, tail, (size_t)(n - i) * sizeof(float));
    }
}

/* Dot product with eight partial sums. */
static float synth_dot(const float *a, const float *b, uint64_t n)
{
    float acc[8] = {0};
    uint64_t i = 0;
    for (; i + 8 <= n; i += 8)
        for (int l = 0; l < 8; l++)
            acc[l] += a[i + l] * b[i + l];
    float s = 0.0f;
    for (; i < n; i++)
        s += a[i] * b[i];
    for (int l = 0; l < 8; l++)
        s += acc[l];
    return s;
}

/* A uniform integer below n (n > 0) from a one-off key. */
static uint32_t synth_below(uint64_t key, uint32_t n)
{
    return (uint32_t)(((synth_mix64(key) >> 32) * (uint64_t)n) >> 32);
}

/* ---- plan: shapes and tensors -------------------------------------------- */

static int synth_find_arch(const char *name, enum synth_arch *out)
{
    for (int i = 0; i < 3; i++) {
        if (name && strcmp(name, synth_arch_names[i]) == 0) {
            *out = (enum synth_arch)i;
            return 0;
        }
    }
    log_error("synth: unknown arch '%s' (qwen3moe, qwen3next, qwen35moe)", name ? name : "");
    return -EINVAL;
}

static const struct synth_shape *synth_find_shape(const char *name)
{
    for (size_t i = 0; i < sizeof(synth_shapes) / sizeof(synth_shapes[0]); i++)
        if (name && strcmp(name, synth_shapes[i].name) == 0)
            return &synth_shapes[i];
    log_error("synth: unknown shape '%s' (tiny, 30b-a3b, 35b-a3b, 80b-a3b)", name ? name : "");
    return NULL;
}

static bool synth_type_ok(uint32_t type)
{
    switch (type) {
    case QUANT_TYPE_F32: case QUANT_TYPE_F16: case QUANT_TYPE_BF16:
    case QUANT_TYPE_Q8_0: case QUANT_TYPE_Q4_0: case QUANT_TYPE_Q4_1:
    case QUANT_TYPE_Q5_0: case QUANT_TYPE_Q5_1:
    case QUANT_TYPE_Q4_K: case QUANT_TYPE_Q5_K: case QUANT_TYPE_Q6_K:
        return true;
    default:
        return false;
    }
}

/* llama_ftype of a file whose matrices have this type (k_m: that _K_M mixture). */
static uint32_t synth_file_type(uint32_t type, bool k_m)
{
    if (k_m)
        return type == QUANT_TYPE_Q4_K ? 15 : 17; /* Q4_K_M, Q5_K_M */
    switch (type) {
    case QUANT_TYPE_F32: return 0;
    case QUANT_TYPE_F16: return 1;
    case QUANT_TYPE_Q4_0: return 2;
    case QUANT_TYPE_Q4_1: return 3;
    case QUANT_TYPE_Q8_0: return 7;
    case QUANT_TYPE_Q5_0: return 8;
    case QUANT_TYPE_Q5_1: return 9;
    case QUANT_TYPE_Q4_K: return 14;  /* Q4_K_S */
    case QUANT_TYPE_Q5_K: return 16;  /* Q5_K_S */
    case QUANT_TYPE_Q6_K: return 18;
    case QUANT_TYPE_BF16: return 32;
    default: return 0;
    }
}

/* The type a matrix with rows of ne0 gets: cfg->type when ne0 fits its blocks. */
static uint32_t synth_matrix_type(uint32_t type, int64_t ne0)
{
    if (ne0 % quant_block_elems(type) == 0)
        return type;
    return ne0 % 32 == 0 ? QUANT_TYPE_Q8_0 : QUANT_TYPE_F16;
}

/* llama-quantize's use_more_bits: the first and last eighth of n, every third between. */
static bool synth_more_bits(int64_t i, int64_t n)
{
    return i < n / 8 || i >= 7 * n / 8 || (i - n / 8) % 3 == 2;
}

/* The type of matrix name (without "blk.N.") of layer il in a file of n_layer
 * layers (hybrid: DeltaNet + shared expert archs), cfg's mixture applied. */
static uint32_t synth_mix_type(const struct synth_config *cfg, bool hybrid, uint32_t n_layer,
                               const char *name, uint32_t il, int64_t ne0)
{
    uint32_t type = cfg->type;
    if (cfg->k_m) {
        /* one value-like matrix a layer; ffn_down: the experts' and, hybrid, the shared one's */
        const bool v_like = !strcmp(name, "attn_v.weight") || !strcmp(name, "attn_qkv.weight");
        const bool down = !strncmp(name, "ffn_down", 8);
        if (!strcmp(name, "output.weight") ||
            (v_like && synth_more_bits(il, n_layer)) ||
            (down && synth_more_bits(il, (int64_t)n_layer * (hybrid ? 2 : 1))))
            type = QUANT_TYPE_Q6_K;
    }
    return synth_matrix_type(type, ne0);
}

/* Appends a tensor; name is a printf format. Returns the new entry or NULL. */
static struct synth_tensor *synth_add(struct synth_plan *p, uint32_t type, uint32_t n_dims,
                                      int64_t ne0, int64_t ne1, int64_t ne2, const char *fmt, ...)
    __attribute__((format(printf, 7, 8)));

static struct synth_tensor *synth_add(struct synth_plan *p, uint32_t type, uint32_t n_dims,
                                      int64_t ne0, int64_t ne1, int64_t ne2, const char *fmt, ...)
{
    if (p->n_tensors == p->cap_tensors) {
        size_t cap = p->cap_tensors ? p->cap_tensors * 2 : 256;
        struct synth_tensor *t = realloc(p->tensors, cap * sizeof(*t));
        if (!t) {
            log_error("synth: out of memory for %zu tensor plans", cap);
            return NULL;
        }
        p->tensors = t;
        p->cap_tensors = cap;
    }
    struct synth_tensor *t = &p->tensors[p->n_tensors++];
    memset(t, 0, sizeof(*t));
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(t->name, sizeof(t->name), fmt, ap);
    va_end(ap);
    t->type = type;
    t->n_dims = n_dims;
    t->ne[0] = ne0;
    t->ne[1] = ne1;
    t->ne[2] = ne2;
    t->ne[3] = 1;
    t->rows = (uint64_t)ne1 * (uint64_t)ne2;
    t->row_bytes = quant_row_size(type, (uint64_t)ne0);
    t->gen = SYNTH_GEN_UNIFORM;
    t->amp = SYNTH_SQRT3 / sqrtf((float)ne0);
    t->pool = -1;
    if ((uint32_t)ne0 > p->max_ne0)
        p->max_ne0 = (uint32_t)ne0;
    p->n_params += (uint64_t)ne0 * t->rows;
    return t;
}

/* A matrix {ne0, ne1[, ne2]} of the configured type with std scale/sqrt(ne0). */
static struct synth_tensor *synth_matrix(struct synth_plan *p, int64_t ne0, int64_t ne1,
                                         int64_t ne2, float scale, const char *name, uint32_t il)
{
    uint32_t type = synth_mix_type(p->cfg, p->hybrid, p->sh.n_layer, name, il, ne0);
    struct synth_tensor *t = synth_add(p, type, ne2 > 1 ? 3 : 2, ne0, ne1, ne2, "blk.%u.%s", il,
                                       name);
    if (t)
        t->amp *= scale;
    return t;
}

/* An F32 vector {ne0} drawn as offset + std * U. */
static struct synth_tensor *synth_vector(struct synth_plan *p, int64_t ne0, float offset,
                                         float std, const char *name, uint32_t il)
{
    struct synth_tensor *t = synth_add(p, QUANT_TYPE_F32, 1, ne0, 1, 1, "blk.%u.%s", il, name);
    if (t) {
        t->offset = offset;
        t->amp = std * SYNTH_SQRT3;
    }
    return t;
}

static int synth_plan_attention(struct synth_plan *p, uint32_t il, float out_scale)
{
    const struct synth_shape *s = &p->sh;
    int64_t n = s->n_embd, q = (int64_t)s->n_head * s->head_dim;
    int64_t kv = (int64_t)s->n_head_kv * s->head_dim;
    bool ok = synth_matrix(p, n, p->hybrid ? 2 * q : q, 1, 1.0f, "attn_q.weight", il) &&
              synth_matrix(p, n, kv, 1, 1.0f, "attn_k.weight", il) &&
              synth_matrix(p, n, kv, 1, 1.0f, "attn_v.weight", il) &&
              synth_matrix(p, q, n, 1, out_scale, "attn_output.weight", il) &&
              synth_vector(p, s->head_dim, 1.0f, 0.02f, "attn_q_norm.weight", il) &&
              synth_vector(p, s->head_dim, 1.0f, 0.02f, "attn_k_norm.weight", il);
    return ok ? 0 : -ENOMEM;
}

static int synth_plan_deltanet(struct synth_plan *p, uint32_t il, float out_scale)
{
    const struct synth_shape *s = &p->sh;
    int64_t n = s->n_embd, key_dim = (int64_t)s->nk * s->dk, value_dim = (int64_t)s->nv * s->dv;
    int64_t conv_dim = 2 * key_dim + value_dim;
    bool ok = synth_matrix(p, n, conv_dim, 1, 1.0f, "attn_qkv.weight", il) &&
              synth_matrix(p, n, value_dim, 1, 1.0f, "attn_gate.weight", il);
    if (ok && p->arch == SYNTH_ARCH_QWEN3NEXT)
        ok = synth_matrix(p, n, 2 * (int64_t)s->nv, 1, 1.0f, "ssm_ba.weight", il);
    else if (ok)
        ok = synth_matrix(p, n, s->nv, 1, 1.0f, "ssm_beta.weight", il) &&
             synth_matrix(p, n, s->nv, 1, 1.0f, "ssm_alpha.weight", il);
    struct synth_tensor *conv = ok ? synth_add(p, QUANT_TYPE_F32, 2, s->conv, conv_dim, 1,
                                               "blk.%u.ssm_conv1d.weight", il) : NULL;
    struct synth_tensor *a = conv ? synth_vector(p, s->nv, -1.0f, 0.0f, "ssm_a", il) : NULL;
    if (a) {
        a->gen = SYNTH_GEN_NEG_EXP;
        a->amp = 1.0f; /* ssm_a = -exp(U(-2, 0)) */
    }
    ok = a && synth_vector(p, s->nv, 0.0f, 0.1f, "ssm_dt.bias", il) &&
         synth_vector(p, s->dv, 1.0f, 0.02f, "ssm_norm.weight", il) &&
         synth_matrix(p, value_dim, n, 1, out_scale, "ssm_out.weight", il);
    return ok ? 0 : -ENOMEM;
}

static int synth_plan_ffn(struct synth_plan *p, uint32_t il, float out_scale)
{
    const struct synth_shape *s = &p->sh;
    int64_t n = s->n_embd, E = s->n_expert, F = s->ff_exp;
    struct synth_tensor *r = synth_add(p, QUANT_TYPE_F32, 2, n, E, 1, "blk.%u.ffn_gate_inp.weight",
                                       il);
    if (!r)
        return -ENOMEM;
    r->gen = SYNTH_GEN_ROUTER;
    r->layer = il;
    bool ok = synth_matrix(p, n, F, E, 1.0f, "ffn_gate_exps.weight", il) &&
              synth_matrix(p, n, F, E, 1.0f, "ffn_up_exps.weight", il) &&
              synth_matrix(p, F, n, E, out_scale, "ffn_down_exps.weight", il);
    if (ok && p->hybrid) {
        int64_t Fs = s->ff_shexp;
        ok = synth_add(p, QUANT_TYPE_F32, 2, n, 1, 1, "blk.%u.ffn_gate_inp_shexp.weight", il) &&
             synth_matrix(p, n, Fs, 1, 1.0f, "ffn_gate_shexp.weight", il) &&
             synth_matrix(p, n, Fs, 1, 1.0f, "ffn_up_shexp.weight", il) &&
             synth_matrix(p, Fs, n, 1, out_scale, "ffn_down_shexp.weight", il);
    }
    return ok ? 0 : -ENOMEM;
}

static int synth_plan_layer(struct synth_plan *p, uint32_t il)
{
    const struct synth_shape *s = &p->sh;
    float out_scale = 1.0f / sqrtf(2.0f * (float)s->n_layer);
    if (!synth_vector(p, s->n_embd, 1.0f, 0.02f, "attn_norm.weight", il))
        return -ENOMEM;
    int rc;
    if (p->hybrid && (il + 1) % 4 != 0)
        rc = synth_plan_deltanet(p, il, out_scale);
    else
        rc = synth_plan_attention(p, il, out_scale);
    if (rc)
        return rc;
    const char *norm = p->hybrid ? "post_attention_norm.weight" : "ffn_norm.weight";
    if (!synth_vector(p, s->n_embd, 1.0f, 0.02f, norm, il))
        return -ENOMEM;
    return synth_plan_ffn(p, il, out_scale);
}

/* Marks large plain matrices of block types (expert stacks, the lm head) to be
 * built from pools. */
static int synth_plan_pools(struct synth_plan *p)
{
    for (size_t i = 0; i < p->n_tensors && !p->cfg->exact; i++) {
        struct synth_tensor *t = &p->tensors[i];
        if (t->gen != SYNTH_GEN_UNIFORM || quant_block_elems(t->type) < 32 ||
            (uint64_t)t->ne[0] * t->rows < SYNTH_POOL_MIN_ELEMS)
            continue;
        int k = 0;
        while (k < p->n_pools && !(p->pools[k].type == t->type && p->pools[k].amp == t->amp))
            k++;
        if (k == SYNTH_MAX_POOLS)
            continue;
        if (k == p->n_pools) {
            struct synth_pool *pl = &p->pools[p->n_pools++];
            pl->type = t->type;
            pl->amp = t->amp;
        }
        t->pool = k;
    }
    return 0;
}

static int synth_plan_build(struct synth_plan *p)
{
    const struct synth_shape *s = &p->sh;
    struct synth_tensor *t = synth_add(p, synth_matrix_type(p->cfg->type, s->n_embd), 2,
                                       s->n_embd, s->vocab, 1, "token_embd.weight");
    if (!t)
        return -ENOMEM;
    t->gen = SYNTH_GEN_EMBD;
    t->amp = SYNTH_SQRT3; /* std 1 */
    for (uint32_t il = 0; il < s->n_layer; il++) {
        int rc = synth_plan_layer(p, il);
        if (rc)
            return rc;
    }
    t = synth_add(p, QUANT_TYPE_F32, 1, s->n_embd, 1, 1, "output_norm.weight");
    if (!t)
        return -ENOMEM;
    t->offset = 1.0f;
    t->amp = 0.02f * SYNTH_SQRT3;
    t = synth_add(p, synth_mix_type(p->cfg, p->hybrid, s->n_layer, "output.weight", 0, s->n_embd),
                  2, s->n_embd, s->vocab, 1, "output.weight");
    if (!t)
        return -ENOMEM;
    t->amp *= 2.5f; /* logits with std ~2.5 */
    return synth_plan_pools(p);
}

/* Fills the blocks of every pool with quantized uniform rows. */
static int synth_pools_fill(struct synth_plan *p)
{
    enum { ROW = 4096 };
    float *row = malloc(ROW * sizeof(float));
    if (!row)
        return -ENOMEM;
    for (int k = 0; k < p->n_pools; k++) {
        struct synth_pool *pl = &p->pools[k];
        pl->block_elems = quant_block_elems(pl->type);
        pl->block_bytes = quant_block_bytes(pl->type);
        uint32_t n_blocks = SYNTH_POOL_ELEMS / pl->block_elems;
        pl->log2_blocks = 0;
        while ((1u << (pl->log2_blocks + 1)) <= n_blocks)
            pl->log2_blocks++;
        size_t row_bytes = quant_row_size(pl->type, ROW);
        pl->blocks = malloc((size_t)SYNTH_POOL_ELEMS / ROW * row_bytes);
        if (!pl->blocks) {
            free(row);
            log_error("synth: out of memory for a block pool");
            return -ENOMEM;
        }
        for (uint32_t r = 0; r < SYNTH_POOL_ELEMS / ROW; r++) {
            uint64_t key = synth_key(p->cfg->seed, SYNTH_DOMAIN_POOL, (uint64_t)k, r);
            synth_uniform(key, row, ROW, pl->amp, 0.0f);
            int rc = quant_quantize_row(pl->type, row, pl->blocks + r * row_bytes, ROW);
            ASSERT(rc == 0);
        }
    }
    free(row);
    return 0;
}

/* ---- row generation ------------------------------------------------------- */

/* Writes one row of t built from random pool blocks. */
static void synth_pool_row(const struct synth_pool *pl, uint64_t key, uint8_t *dst, int64_t ne0)
{
    struct synth_rng r;
    synth_rng_init(&r, key);
    uint32_t shift = 32 - pl->log2_blocks;
    uint64_t n_blocks = (uint64_t)ne0 / pl->block_elems;
    size_t bb = pl->block_bytes;
    for (uint64_t b = 0; b < n_blocks; b += 8) {
        synth_rng_next(&r);
        uint32_t idx[8];
        synth_u32x4 va = r.a >> shift, vb = r.b >> shift;
        memcpy(idx, &va, sizeof(va));
        memcpy(idx + 4, &vb, sizeof(vb));
        for (int l = 0; l < 8 && b + (uint64_t)l < n_blocks; l++)
            memcpy(dst + (b + (uint64_t)l) * bb, pl->blocks + (size_t)idx[l] * bb, bb);
    }
}

/* The token-dependent part of router row r of tensor ti: a uniform draw made
 * orthogonal to u (so it adds no per-expert constant to the logits of tokens
 * that share the offset c) and scaled to norm 1, so that every expert of every
 * layer sees logit noise of the same spread and only beta sets popularity. */
static void synth_router_noise(const struct synth_plan *p, uint64_t ti, uint64_t r, float *out)
{
    const struct synth_tensor *t = &p->tensors[ti];
    uint64_t n = (uint64_t)t->ne[0];
    synth_uniform(synth_key(p->cfg->seed, SYNTH_DOMAIN_ROW, ti, r), out, n, t->amp, 0.0f);
    float d = synth_dot(out, p->u, n);
    for (uint64_t i = 0; i < n; i++)
        out[i] -= d * p->u[i];
    float norm = sqrtf(synth_dot(out, out, n));
    for (uint64_t i = 0; i < n && norm > 0.0f; i++)
        out[i] /= norm;
}

/* The f32 values of row r of tensor ti, before quantization. */
static void synth_row_values(const struct synth_plan *p, uint64_t ti, uint64_t r, float *out)
{
    const struct synth_tensor *t = &p->tensors[ti];
    uint64_t n = (uint64_t)t->ne[0];
    uint64_t key = synth_key(p->cfg->seed, SYNTH_DOMAIN_ROW, ti, r);
    synth_uniform(key, out, n, t->amp, t->offset);
    switch (t->gen) {
    case SYNTH_GEN_UNIFORM:
        break;
    case SYNTH_GEN_EMBD:
        for (uint64_t i = 0; i < n; i++)
            out[i] += p->c[i];
        break;
    case SYNTH_GEN_ROUTER: {
        float b = p->beta[p->rank[(uint64_t)t->layer * p->sh.n_expert + r]];
        synth_router_noise(p, ti, r, out);
        for (uint64_t i = 0; i < n; i++)
            out[i] += b * p->u[i];
        break;
    }
    case SYNTH_GEN_NEG_EXP:
        for (uint64_t i = 0; i < n; i++)
            out[i] = -expf(out[i]);
        break;
    }
}

/* Writes rows [r0, r0 + nr) of tensor ti to dst; scratch holds max_ne0 floats. */
static void synth_gen_rows(const struct synth_plan *p, uint64_t ti, uint64_t r0, uint64_t nr,
                           uint8_t *dst, float *scratch)
{
    const struct synth_tensor *t = &p->tensors[ti];
    for (uint64_t r = r0; r < r0 + nr; r++, dst += t->row_bytes) {
        if (t->pool >= 0) {
            uint64_t key = synth_key(p->cfg->seed, SYNTH_DOMAIN_ROW, ti, r);
            synth_pool_row(&p->pools[t->pool], key, dst, t->ne[0]);
            continue;
        }
        synth_row_values(p, ti, r, scratch);
        int rc = quant_quantize_row(t->type, scratch, dst, (uint64_t)t->ne[0]);
        ASSERT(rc == 0);
    }
}

/* ---- heat: targets, calibration, measurement ------------------------------ */

/* target[r] ~ 1/(r+1)^S, capped at 0.9/k (chosen by 90% of tokens) with the
 * excess spread over the rest. */
static void synth_heat_target(float s, uint32_t E, uint32_t k, float *target)
{
    double cap = 0.9 / k, fixed = 0.0;
    uint32_t n_capped = 0;
    for (;;) {
        double sum = 0.0;
        for (uint32_t r = n_capped; r < E; r++)
            sum += pow(r + 1.0, -(double)s);
        double scale = (1.0 - fixed) / sum;
        if (pow(n_capped + 1.0, -(double)s) * scale <= cap + 1e-12 || n_capped + 1 >= E) {
            for (uint32_t r = n_capped; r < E; r++)
                target[r] = (float)(pow(r + 1.0, -(double)s) * scale);
            return;
        }
        target[n_capped++] = (float)cap;
        fixed += cap;
    }
}

/* x <- x / rms(x) * w (w may be NULL for 1). */
static void synth_rms_norm(float *x, const float *w, uint64_t n)
{
    double ss = 0.0;
    for (uint64_t i = 0; i < n; i++)
        ss += (double)x[i] * x[i];
    float scale = 1.0f / sqrtf((float)(ss / (double)n) + SYNTH_EPS);
    for (uint64_t i = 0; i < n; i++)
        x[i] = x[i] * scale * (w ? w[i] : 1.0f);
}

/* Adds one count to each of the k largest logits' experts. */
static void synth_count_topk(const float *logits, uint32_t E, uint32_t k, uint32_t *counts)
{
    uint32_t best[64];
    uint32_t nb = 0;
    for (uint32_t e = 0; e < E; e++) {
        if (nb == k && logits[e] <= logits[best[nb - 1]])
            continue;
        uint32_t j = nb < k ? nb++ : nb - 1;
        while (j > 0 && logits[best[j - 1]] < logits[e]) {
            best[j] = best[j - 1];
            j--;
        }
        best[j] = e;
    }
    for (uint32_t j = 0; j < nb; j++)
        counts[best[j]]++;
}

/* Draws c, u and the per-layer popularity permutations. */
static int synth_heat_vectors(struct synth_plan *p)
{
    const struct synth_shape *s = &p->sh;
    uint32_t n = s->n_embd, E = s->n_expert;
    p->c = calloc(n, sizeof(float));
    p->u = calloc(n, sizeof(float));
    p->beta = calloc(E, sizeof(float));
    p->target = calloc(E, sizeof(float));
    p->rank = malloc((size_t)s->n_layer * E * sizeof(uint32_t));
    if (!p->c || !p->u || !p->beta || !p->target || !p->rank) {
        log_error("synth: out of memory for heat vectors");
        return -ENOMEM;
    }
    for (uint32_t il = 0; il < s->n_layer; il++) {
        uint32_t *rk = p->rank + (size_t)il * E;
        for (uint32_t e = 0; e < E; e++)
            rk[e] = e;
        for (uint32_t e = E - 1; e > 0; e--) { /* Fisher-Yates */
            uint32_t j = synth_below(synth_key(p->cfg->seed, SYNTH_DOMAIN_PERM, il, e), e + 1);
            uint32_t tmp = rk[e];
            rk[e] = rk[j];
            rk[j] = tmp;
        }
    }
    synth_heat_target(p->cfg->heat, E, s->top_k, p->target);
    if (p->cfg->heat <= 0.0f)
        return 0;
    synth_uniform(synth_key(p->cfg->seed, SYNTH_DOMAIN_HEAT, 0, 0), p->c, n, 0.5f * SYNTH_SQRT3,
                  0.0f);
    float norm = sqrtf(synth_dot(p->c, p->c, n));
    for (uint32_t i = 0; i < n; i++)
        p->u[i] = p->c[i] / norm;
    return 0;
}

/* Router noise N[t][e] and projection K[t] = u . x^ for sample tokens of layer 0. */
static int synth_calib_inputs(const struct synth_plan *p, uint64_t router_ti, float *N, float *K)
{
    const struct synth_shape *s = &p->sh;
    uint32_t n = s->n_embd, E = s->n_expert;
    float *x = malloc(n * sizeof(float));
    float *w = malloc((size_t)E * n * sizeof(float));
    if (!x || !w) {
        free(x);
        free(w);
        log_error("synth: out of memory for heat calibration");
        return -ENOMEM;
    }
    for (uint32_t e = 0; e < E; e++)
        synth_router_noise(p, router_ti, e, w + (size_t)e * n);
    for (uint32_t j = 0; j < SYNTH_SAMPLE_TOKENS; j++) {
        uint32_t tok = synth_below(synth_key(p->cfg->seed, SYNTH_DOMAIN_CALIB, j, 0), s->vocab);
        synth_row_values(p, 0, tok, x);
        synth_rms_norm(x, NULL, n);
        K[j] = synth_dot(p->u, x, n);
        for (uint32_t e = 0; e < E; e++)
            N[(size_t)j * E + e] = synth_dot(w + (size_t)e * n, x, n);
    }
    free(x);
    free(w);
    return 0;
}

/* Route shares by rank for biases beta; returns the L1 distance to the target. */
static double synth_calib_measure(const struct synth_plan *p, const float *N, const float *K,
                                  float *logits, uint32_t *counts, float *meas)
{
    uint32_t E = p->sh.n_expert, k = p->sh.top_k;
    const uint32_t *rk = p->rank; /* layer 0 */
    memset(counts, 0, E * sizeof(*counts));
    for (uint32_t j = 0; j < SYNTH_SAMPLE_TOKENS; j++) {
        for (uint32_t e = 0; e < E; e++)
            logits[e] = N[(size_t)j * E + e] + p->beta[rk[e]] * K[j];
        synth_count_topk(logits, E, k, counts);
    }
    double err = 0.0;
    for (uint32_t e = 0; e < E; e++) {
        meas[rk[e]] = (float)counts[e] / (float)(SYNTH_SAMPLE_TOKENS * k);
        err += fabs(meas[rk[e]] - p->target[rk[e]]);
    }
    return err;
}

/* Fits beta so that layer 0's measured shares follow the target. */
static int synth_heat_calibrate(struct synth_plan *p, uint64_t router_ti)
{
    uint32_t E = p->sh.n_expert;
    float *N = malloc((size_t)SYNTH_SAMPLE_TOKENS * E * sizeof(float));
    float *K = malloc(SYNTH_SAMPLE_TOKENS * sizeof(float));
    float *logits = malloc(E * sizeof(float)), *meas = malloc(E * sizeof(float));
    float *best = malloc(E * sizeof(float));
    uint32_t *counts = malloc(E * sizeof(uint32_t));
    int rc = -ENOMEM;
    if (!N || !K || !logits || !meas || !best || !counts) {
        log_error("synth: out of memory for heat calibration");
        goto out_free;
    }
    rc = synth_calib_inputs(p, router_ti, N, K);
    if (rc)
        goto out_free;
    double kmean = 0.0;
    for (uint32_t j = 0; j < SYNTH_SAMPLE_TOKENS; j++)
        kmean += K[j] / SYNTH_SAMPLE_TOKENS;
    float floor = 0.5f / (float)(SYNTH_SAMPLE_TOKENS * p->sh.top_k);
    for (uint32_t r = 0; r < E; r++) /* start from the log target (exact for Gumbel noise) */
        p->beta[r] = (float)(log(p->target[r]) / kmean);
    double best_err = INFINITY;
    for (int it = 0; it < SYNTH_CALIB_ITERS; it++) {
        double err = synth_calib_measure(p, N, K, logits, counts, meas);
        if (err < best_err) {
            best_err = err;
            memcpy(best, p->beta, E * sizeof(float));
        }
        for (uint32_t r = 0; r < E; r++) { /* damped, clipped step in logit units */
            double step = 0.5 * (log(p->target[r]) - log(fmaxf(meas[r], floor)));
            step = step > 1.0 ? 1.0 : step < -1.0 ? -1.0 : step;
            p->beta[r] += (float)(step / kmean);
        }
    }
    memcpy(p->beta, best, E * sizeof(float));
    log_debug("synth: heat calibration L1 error %.4f (kappa %.2f)", best_err, kmean);
    rc = 0;
out_free:
    free(N);
    free(K);
    free(logits);
    free(meas);
    free(best);
    free(counts);
    return rc;
}

/* Dequantizes row r of a file tensor into out (ne[0] floats). */
static int synth_file_row(const struct gguf_tensor *t, uint64_t r, float *out)
{
    size_t rb = quant_row_size(t->type, (uint64_t)t->ne[0]);
    return quant_dequantize_row(t->type, (const uint8_t *)t->data + r * rb, out,
                                (uint64_t)t->ne[0]);
}

/* Counts top-k routes of layer il over the sample tokens, from the file. */
static int synth_measure_layer(const struct synth_plan *p, const struct gguf *g, uint32_t il,
                               float *x, float *w, float *router, float *logits, uint32_t *counts)
{
    const struct synth_shape *s = &p->sh;
    uint32_t n = s->n_embd, E = s->n_expert;
    char name[GGUF_MAX_NAME];
    snprintf(name, sizeof(name), "blk.%u.%s", il,
             p->hybrid ? "post_attention_norm.weight" : "ffn_norm.weight");
    const struct gguf_tensor *tn = gguf_find_tensor(g, name);
    snprintf(name, sizeof(name), "blk.%u.ffn_gate_inp.weight", il);
    const struct gguf_tensor *tr = gguf_find_tensor(g, name);
    const struct gguf_tensor *te = gguf_find_tensor(g, "token_embd.weight");
    if (!tn || !tr || !te)
        return -EINVAL;
    int rc = synth_file_row(tn, 0, w);
    for (uint32_t e = 0; !rc && e < E; e++)
        rc = synth_file_row(tr, e, router + (size_t)e * n);
    for (uint32_t j = 0; !rc && j < SYNTH_SAMPLE_TOKENS; j++) {
        uint32_t tok = synth_below(synth_key(p->cfg->seed, SYNTH_DOMAIN_MEASURE, j, 0), s->vocab);
        rc = synth_file_row(te, tok, x);
        synth_rms_norm(x, w, n);
        for (uint32_t e = 0; e < E; e++)
            logits[e] = synth_dot(router + (size_t)e * n, x, n);
        synth_count_topk(logits, E, s->top_k, counts);
    }
    return rc;
}

static int synth_cmp_desc(const void *a, const void *b)
{
    float x = *(const float *)a, y = *(const float *)b;
    return (x < y) - (x > y);
}

/* Slope of -log(share) against log(rank + 1) over ranks with a share. */
static float synth_fit_exponent(const float *share, uint32_t E)
{
    double sx = 0, sy = 0, sxx = 0, sxy = 0;
    uint32_t m = 0;
    for (uint32_t r = 0; r < E; r++) {
        if (share[r] <= 0.0f)
            continue;
        double x = log(r + 1.0), y = -log(share[r]);
        sx += x;
        sy += y;
        sxx += x * x;
        sxy += x * y;
        m++;
    }
    double det = m * sxx - sx * sx;
    return m >= 2 && det > 0 ? (float)((m * sxy - sx * sy) / det) : 0.0f;
}

static void synth_heat_summary(const struct synth_plan *p, struct synth_heat_report *h)
{
    int len = snprintf(h->summary, sizeof(h->summary),
                       "heat zipf:%.2f on %u tokens x %u layers: fitted S %.2f, top shares",
                       p->cfg->heat, h->tokens, h->layers, h->fitted_s);
    for (uint32_t r = 0; r < 4 && r < h->n_expert && len < (int)sizeof(h->summary); r++)
        len += snprintf(h->summary + len, sizeof(h->summary) - (size_t)len, " %.1f%%",
                        100.0f * h->share[r]);
    if (len < (int)sizeof(h->summary))
        len += snprintf(h->summary + len, sizeof(h->summary) - (size_t)len,
                        " (target %.1f%%, uniform %.1f%%)", 100.0f * h->target[0],
                        100.0f / (float)h->n_expert);
}

/* Measures expert popularity of evenly spaced layers from the written file. */
static int synth_heat_measure(const struct synth_plan *p, struct synth_heat_report *h)
{
    const struct synth_shape *s = &p->sh;
    uint32_t n = s->n_embd, E = s->n_expert, L = s->n_layer;
    memset(h, 0, sizeof(*h));
    if (E > SYNTH_MAX_EXPERTS)
        return 0;
    uint64_t per_layer = (uint64_t)SYNTH_SAMPLE_TOKENS * E * n;
    uint64_t m = SYNTH_MEASURE_MACS / per_layer;
    m = m < 1 ? 1 : m > L ? L : m;
    struct gguf_config gc = {.path = p->cfg->path};
    struct gguf *g = gguf_open(&gc);
    float *x = malloc(n * sizeof(float)), *w = malloc(n * sizeof(float));
    float *router = malloc((size_t)E * n * sizeof(float)), *logits = malloc(E * sizeof(float));
    float *share = malloc(E * sizeof(float));
    uint32_t *counts = malloc(E * sizeof(uint32_t));
    int rc = g ? -ENOMEM : -EIO;
    if (!g || !x || !w || !router || !logits || !share || !counts)
        goto out_free;
    h->n_expert = E;
    h->top_k = s->top_k;
    h->tokens = SYNTH_SAMPLE_TOKENS;
    for (uint64_t i = 0; i < m; i++) {
        uint32_t il = m > 1 ? (uint32_t)(i * (L - 1) / (m - 1)) : 0;
        memset(counts, 0, E * sizeof(*counts));
        rc = synth_measure_layer(p, g, il, x, w, router, logits, counts);
        if (rc)
            goto out_free;
        for (uint32_t e = 0; e < E; e++)
            share[e] = (float)counts[e] / (float)(SYNTH_SAMPLE_TOKENS * s->top_k);
        qsort(share, E, sizeof(float), synth_cmp_desc);
        for (uint32_t r = 0; r < E; r++)
            h->share[r] += share[r] / (float)m;
        if (i == 0)
            h->layer0_top1 = share[0];
        h->layers++;
    }
    memcpy(h->target, p->target, E * sizeof(float));
    h->fitted_s = synth_fit_exponent(h->share, E);
    synth_heat_summary(p, h);
    rc = 0;
out_free:
    if (rc)
        log_error("synth %s: cannot measure expert popularity from the written file (%d)",
                  p->cfg->path, rc);
    gguf_close(g);
    free(x);
    free(w);
    free(router);
    free(logits);
    free(share);
    free(counts);
    return rc;
}

/* ---- tokenizer ------------------------------------------------------------- */

/* Common English words, most frequent first; the BPE is trained on them. */
static const char synth_words[] =
    "the of and to in is it you that he was for on are with as his they be at one have this "
    "from or had by word but what some we can out other were all there when up use your how "
    "said an each she which do their time if will way about many then them write would like "
    "so these her long make thing see him two has look more day could go come did number "
    "sound no most people my over know water than call first who may down side been now find "
    "any new work part take get place made live where after back little only round man year "
    "came show every good me give our under name very through just form sentence great think "
    "say help low line differ turn cause much mean before move right boy old too same tell "
    "does set three want air well also play small end put home read hand port large spell add "
    "even land here must big high such follow act why ask men change went light kind off need "
    "house picture try us again animal point mother world near build self earth father head "
    "stand own page should country found answer school grow study still learn plant cover food "
    "sun four between state keep eye never last let thought city tree cross farm hard start "
    "might story saw far sea draw left late run while press close night real life few north "
    "open seem together next white children begin got walk example ease paper group always "
    "music those both mark often letter until mile river car feet care second book carry took "
    "science eat room friend began idea fish mountain stop once base hear horse cut sure watch "
    "color face wood main enough plain girl usual young ready above ever red list though feel "
    "talk bird soon body dog family direct leave song measure door product black short class "
    "wind question happen complete ship area half rock order fire south problem piece told knew "
    "pass since top whole king space heard best hour better true during hundred five remember "
    "step early hold west ground interest reach fast sing listen six table travel less morning "
    "ten simple several toward war lay against pattern slow center love person money serve "
    "appear road map rain rule govern pull cold notice voice unit power town fine certain fly "
    "fall lead cry dark machine note wait plan figure star box field rest correct able done "
    "drive stood contain front teach week final gave green quick develop ocean warm free minute "
    "strong special mind behind clear produce fact street nothing course stay wheel full force "
    "blue object decide surface deep moon island foot system busy test record boat common gold "
    "possible plane dry wonder laugh thousand ago ran check game shape hot miss brought heat "
    "snow bring yes distant fill east paint language among function return value string";

/* Byte b in GPT-2's byte-to-unicode form, UTF-8 encoded into out (2..3 bytes + NUL). */
static void synth_byte_utf8(uint8_t b, char *out)
{
    uint32_t cp = b;
    bool printable = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || b >= 174;
    if (!printable) /* the others map to 256.. in byte order */
        cp = 256 + (b <= 32 ? b : b <= 160 ? b - 127 + 33 : 67);
    if (cp < 0x80) {
        out[0] = (char)cp;
        out[1] = '\0';
    } else {
        out[0] = (char)(0xC0 | (cp >> 6));
        out[1] = (char)(0x80 | (cp & 0x3F));
        out[2] = '\0';
    }
}

/* A vocabulary under construction. */
struct synth_vocab {
    char **tokens;        /* n_tokens owned strings */
    int32_t *types;       /* token types (1 normal, 3 control, 5 unused) */
    char **merges;        /* n_merges owned "left right" strings */
    uint32_t n_tokens, n_merges;
    uint32_t cap;         /* vocab size: slots at tokens/types */
    uint32_t first_special; /* id of <|endoftext|>; <|im_start|>, <|im_end|> follow */
};

static void synth_vocab_free(struct synth_vocab *v)
{
    for (uint32_t i = 0; v->tokens && i < v->n_tokens; i++)
        free(v->tokens[i]);
    for (uint32_t i = 0; v->merges && i < v->n_merges; i++)
        free(v->merges[i]);
    free(v->tokens);
    free(v->types);
    free(v->merges);
}

static int synth_vocab_push(struct synth_vocab *v, const char *s, int32_t type)
{
    ASSERT(v->n_tokens < v->cap);
    v->tokens[v->n_tokens] = strdup(s);
    if (!v->tokens[v->n_tokens])
        return -ENOMEM;
    v->types[v->n_tokens++] = type;
    return 0;
}

/* The training words as token-id sequences (" word" byte-encoded), 0-terminated. */
struct synth_bpe {
    uint16_t *syms;       /* all words' symbols, each word ends with 0xFFFF */
    uint32_t *weight;     /* per word */
    size_t n_syms;
    uint32_t n_words;
    uint32_t *pair_count; /* cap x cap counts */
    uint32_t *touched;    /* pair indices with a count */
    size_t n_touched;
};

static int synth_bpe_words(struct synth_bpe *b)
{
    size_t len = sizeof(synth_words);
    b->syms = malloc((len * 2 + 2) * sizeof(uint16_t));
    b->weight = malloc(len * sizeof(uint32_t));
    if (!b->syms || !b->weight)
        return -ENOMEM;
    const char *w = synth_words;
    while (*w) {
        size_t n = strcspn(w, " ");
        b->syms[b->n_syms++] = ' '; /* the qwen2 pre-tokenizer keeps the leading space */
        for (size_t i = 0; i < n; i++)
            b->syms[b->n_syms++] = (uint8_t)w[i];
        b->syms[b->n_syms++] = 0xFFFF;
        b->weight[b->n_words] = 4000 / (b->n_words + 20) + 1;
        b->n_words++;
        w += n;
        w += *w == ' ';
    }
    return 0;
}

/* Finds the heaviest adjacent pair (ties: lowest ids); false when none. */
static bool synth_bpe_best(struct synth_bpe *b, uint32_t cap, uint32_t *left, uint32_t *right)
{
    for (size_t i = 0; i < b->n_touched; i++)
        b->pair_count[b->touched[i]] = 0;
    b->n_touched = 0;
    uint32_t word = 0;
    for (size_t i = 0; i + 1 < b->n_syms; i++) {
        if (b->syms[i] == 0xFFFF) {
            word++;
            continue;
        }
        if (b->syms[i + 1] == 0xFFFF)
            continue;
        uint32_t idx = b->syms[i] * cap + b->syms[i + 1];
        if (b->pair_count[idx] == 0)
            b->touched[b->n_touched++] = idx;
        b->pair_count[idx] += b->weight[word];
    }
    uint32_t best = UINT32_MAX, best_count = 0;
    for (size_t i = 0; i < b->n_touched; i++) {
        uint32_t idx = b->touched[i], c = b->pair_count[idx];
        if (c > best_count || (c == best_count && idx < best)) {
            best = idx;
            best_count = c;
        }
    }
    if (best_count < 2)
        return false;
    *left = best / cap;
    *right = best % cap;
    return true;
}

/* Replaces every (left, right) by id. */
static void synth_bpe_apply(struct synth_bpe *b, uint32_t left, uint32_t right, uint32_t id)
{
    size_t o = 0;
    for (size_t i = 0; i < b->n_syms; i++) {
        if (i + 1 < b->n_syms && b->syms[i] == left && b->syms[i + 1] == right) {
            b->syms[o++] = (uint16_t)id;
            i++;
        } else {
            b->syms[o++] = b->syms[i];
        }
    }
    b->n_syms = o;
}

/* Adds one merge: its string and, unless already present, its token. */
static int synth_vocab_merge(struct synth_vocab *v, uint32_t left, uint32_t right, uint32_t *id)
{
    const char *l = v->tokens[left], *r = v->tokens[right];
    size_t ll = strlen(l), rl = strlen(r);
    char *m = malloc(ll + rl + 2), *t = malloc(ll + rl + 1);
    if (!m || !t) {
        free(m);
        free(t);
        return -ENOMEM;
    }
    snprintf(m, ll + rl + 2, "%s %s", l, r);
    snprintf(t, ll + rl + 1, "%s%s", l, r);
    v->merges[v->n_merges++] = m;
    for (*id = 0; *id < v->n_tokens; (*id)++) {
        if (strcmp(v->tokens[*id], t) == 0) {
            free(t);
            return 0;
        }
    }
    v->tokens[v->n_tokens] = t;
    v->types[v->n_tokens++] = 1;
    return 0;
}

static int synth_vocab_train(struct synth_vocab *v, uint32_t max_merges)
{
    struct synth_bpe b = {0};
    uint32_t cap = 256 + max_merges;
    int rc = synth_bpe_words(&b);
    b.pair_count = calloc((size_t)cap * cap, sizeof(uint32_t));
    b.touched = malloc(sizeof(synth_words) * sizeof(uint32_t));
    if (rc || !b.pair_count || !b.touched)
        rc = -ENOMEM;
    uint32_t left, right, id;
    while (!rc && v->n_merges < max_merges && synth_bpe_best(&b, cap, &left, &right)) {
        rc = synth_vocab_merge(v, left, right, &id);
        if (!rc)
            synth_bpe_apply(&b, left, right, id);
    }
    free(b.syms);
    free(b.weight);
    free(b.pair_count);
    free(b.touched);
    return rc;
}

/* Bytes, trained merges, specials, then [PAD<id>] up to the vocab size. */
static int synth_vocab_build(struct synth_vocab *v, uint32_t vocab)
{
    uint32_t max_merges = vocab - 256 - 3 - vocab / 32; /* leave a few [PAD] tokens */
    max_merges = max_merges > SYNTH_MAX_MERGES ? SYNTH_MAX_MERGES : max_merges;
    v->cap = vocab;
    v->tokens = calloc(vocab, sizeof(char *));
    v->types = calloc(vocab, sizeof(int32_t));
    v->merges = calloc(max_merges ? max_merges : 1, sizeof(char *));
    if (!v->tokens || !v->types || !v->merges)
        return -ENOMEM;
    char s[32];
    int rc = 0;
    for (uint32_t b = 0; !rc && b < 256; b++) {
        synth_byte_utf8((uint8_t)b, s);
        rc = synth_vocab_push(v, s, 1);
    }
    if (!rc)
        rc = synth_vocab_train(v, max_merges);
    static const char *const specials[] = {"<|endoftext|>", "<|im_start|>", "<|im_end|>"};
    v->first_special = v->n_tokens;
    for (int i = 0; !rc && i < 3; i++)
        rc = synth_vocab_push(v, specials[i], 3);
    while (!rc && v->n_tokens < vocab) {
        snprintf(s, sizeof(s), "[PAD%u]", v->n_tokens);
        rc = synth_vocab_push(v, s, 5);
    }
    return rc;
}

/* ---- metadata ------------------------------------------------------------- */

static const char synth_chat_template[] =
    "{% for message in messages %}{{ '<|im_start|>' + message['role'] + '\\n' + "
    "message['content'] + '<|im_end|>' + '\\n' }}{% endfor %}{% if add_generation_prompt %}"
    "{{ '<|im_start|>assistant\\n' }}{% endif %}";

static int synth_meta_tokenizer(const struct synth_plan *p, struct gguf_writer *w)
{
    struct synth_vocab v = {0};
    int rc = synth_vocab_build(&v, p->sh.vocab);
    if (rc) {
        log_error("synth: out of memory for the vocabulary");
        synth_vocab_free(&v);
        return rc;
    }
    uint32_t first_special = v.first_special;
    rc = gguf_writer_add_str(w, "tokenizer.ggml.model", "gpt2");
    rc = rc ? rc : gguf_writer_add_str(w, "tokenizer.ggml.pre",
                                       p->arch == SYNTH_ARCH_QWEN35MOE ? "qwen35" : "qwen2");
    rc = rc ? rc : gguf_writer_add_array_str(w, "tokenizer.ggml.tokens",
                                             (const char *const *)v.tokens, v.n_tokens);
    rc = rc ? rc : gguf_writer_add_array(w, "tokenizer.ggml.token_type", GGUF_TYPE_INT32, v.types,
                                         v.n_tokens);
    rc = rc ? rc : gguf_writer_add_array_str(w, "tokenizer.ggml.merges",
                                             (const char *const *)v.merges, v.n_merges);
    rc = rc ? rc : gguf_writer_add_u32(w, "tokenizer.ggml.eos_token_id", first_special + 2);
    rc = rc ? rc : gguf_writer_add_u32(w, "tokenizer.ggml.padding_token_id", first_special);
    rc = rc ? rc : gguf_writer_add_bool(w, "tokenizer.ggml.add_bos_token", false);
    rc = rc ? rc : gguf_writer_add_str(w, "tokenizer.chat_template", synth_chat_template);
    synth_vocab_free(&v);
    return rc;
}

/* Writes "{arch}.{suffix}" = v as uint32. */
static int synth_meta_u32(const struct synth_plan *p, struct gguf_writer *w, const char *suffix,
                          uint32_t v)
{
    char key[128];
    snprintf(key, sizeof(key), "%s.%s", synth_arch_names[p->arch], suffix);
    return gguf_writer_add_u32(w, key, v);
}

static int synth_meta_f32(const struct synth_plan *p, struct gguf_writer *w, const char *suffix,
                          float v)
{
    char key[128];
    snprintf(key, sizeof(key), "%s.%s", synth_arch_names[p->arch], suffix);
    return gguf_writer_add_f32(w, key, v);
}

static int synth_meta_ssm(const struct synth_plan *p, struct gguf_writer *w)
{
    const struct synth_shape *s = &p->sh;
    int rc = synth_meta_u32(p, w, "expert_shared_feed_forward_length", s->ff_shexp);
    rc = rc ? rc : synth_meta_u32(p, w, "ssm.conv_kernel", s->conv);
    rc = rc ? rc : synth_meta_u32(p, w, "ssm.state_size", s->dk);
    rc = rc ? rc : synth_meta_u32(p, w, "ssm.group_count", s->nk);
    rc = rc ? rc : synth_meta_u32(p, w, "ssm.time_step_rank", s->nv);
    rc = rc ? rc : synth_meta_u32(p, w, "ssm.inner_size", s->nv * s->dv);
    rc = rc ? rc : synth_meta_u32(p, w, "full_attention_interval", 4);
    rc = rc ? rc : synth_meta_u32(p, w, "rope.dimension_count", s->n_rot);
    return rc;
}

/* The model's metadata in the converter's order (model-spec 4.1, 5.1, 6, 7). */
static int synth_meta(const struct synth_plan *p, struct gguf_writer *w)
{
    const struct synth_shape *s = &p->sh;
    char name[96];
    snprintf(name, sizeof(name), "lamina synthetic %s %s", synth_arch_names[p->arch], s->name);
    int rc = gguf_writer_add_str(w, "general.architecture", synth_arch_names[p->arch]);
    rc = rc ? rc : gguf_writer_add_str(w, "general.type", "model");
    rc = rc ? rc : gguf_writer_add_str(w, "general.name", name);
    rc = rc ? rc : gguf_writer_add_u32(w, "general.alignment", GGUF_DEFAULT_ALIGNMENT);
    rc = rc ? rc : synth_meta_u32(p, w, "block_count", s->n_layer);
    rc = rc ? rc : synth_meta_u32(p, w, "context_length", s->ctx);
    rc = rc ? rc : synth_meta_u32(p, w, "embedding_length", s->n_embd);
    if (!rc && p->arch != SYNTH_ARCH_QWEN35MOE)
        rc = synth_meta_u32(p, w, "feed_forward_length", s->n_ff);
    rc = rc ? rc : synth_meta_u32(p, w, "attention.head_count", s->n_head);
    rc = rc ? rc : synth_meta_u32(p, w, "attention.head_count_kv", s->n_head_kv);
    if (!rc && p->arch == SYNTH_ARCH_QWEN35MOE)
        rc = gguf_writer_add_array(w, "qwen35moe.rope.dimension_sections", GGUF_TYPE_INT32,
                                   s->sections, 4);
    rc = rc ? rc : synth_meta_f32(p, w, "rope.freq_base", s->rope_base);
    rc = rc ? rc : synth_meta_f32(p, w, "attention.layer_norm_rms_epsilon", SYNTH_EPS);
    rc = rc ? rc : synth_meta_u32(p, w, "expert_count", s->n_expert);
    rc = rc ? rc : synth_meta_u32(p, w, "expert_used_count", s->top_k);
    rc = rc ? rc : synth_meta_u32(p, w, "attention.key_length", s->head_dim);
    rc = rc ? rc : synth_meta_u32(p, w, "attention.value_length", s->head_dim);
    rc = rc ? rc : gguf_writer_add_u32(w, "general.file_type",
                                       synth_file_type(p->cfg->type, p->cfg->k_m));
    rc = rc ? rc : synth_meta_u32(p, w, "expert_feed_forward_length", s->ff_exp);
    if (!rc && p->hybrid)
        rc = synth_meta_ssm(p, w);
    rc = rc ? rc : gguf_writer_add_u32(w, "general.quantization_version", 2);
    rc = rc ? rc : gguf_writer_add_u64(w, "lamina.synth.seed", p->cfg->seed);
    rc = rc ? rc : gguf_writer_add_f32(w, "lamina.synth.heat", p->cfg->heat);
    return rc ? rc : synth_meta_tokenizer(p, w);
}

/* ---- pipeline ------------------------------------------------------------- */

/* Generator threads and the writing thread share this. */
struct synth_pipe {
    const struct synth_plan *plan;
    pthread_mutex_t mu;
    pthread_cond_t cv_free;     /* a slot was written out (or stop) */
    pthread_cond_t cv_ready;    /* a slot was filled */
    uint32_t n_slots;
    uint8_t **slots;            /* n_slots buffers of slot_bytes */
    uint64_t *slot_seq;         /* chunk held by each slot, UINT64_MAX when empty */
    size_t *slot_len;           /* bytes filled */
    size_t slot_bytes;
    uint64_t next_seq;          /* chunks claimed */
    uint64_t written;           /* chunks written out */
    uint64_t cur_t, cur_r;      /* next row to claim: tensor, row */
    bool stop;                  /* writer failed: generators exit */
};

static uint64_t synth_chunk_rows(const struct synth_tensor *t)
{
    uint64_t r = SYNTH_CHUNK_BYTES / t->row_bytes;
    return r < 1 ? 1 : r;
}

/* Claims the next chunk under the lock; false when all are claimed or stopping. */
static bool synth_pipe_claim(struct synth_pipe *q, uint64_t *seq, uint64_t *t, uint64_t *r0,
                             uint64_t *nr)
{
    const struct synth_plan *p = q->plan;
    while (!q->stop && q->next_seq - q->written >= q->n_slots)
        pthread_cond_wait(&q->cv_free, &q->mu);
    if (q->stop || q->cur_t >= p->n_tensors)
        return false;
    const struct synth_tensor *tt = &p->tensors[q->cur_t];
    uint64_t n = synth_chunk_rows(tt);
    n = n < tt->rows - q->cur_r ? n : tt->rows - q->cur_r;
    *seq = q->next_seq++;
    *t = q->cur_t;
    *r0 = q->cur_r;
    *nr = n;
    q->cur_r += n;
    if (q->cur_r == tt->rows) {
        q->cur_t++;
        q->cur_r = 0;
    }
    return true;
}

static void *synth_pipe_worker(void *arg)
{
    struct synth_pipe *q = arg;
    float *scratch = malloc(q->plan->max_ne0 * sizeof(float));
    ASSERT(scratch != NULL); /* small; the pipeline cannot run without it */
    uint64_t seq, t, r0, nr;
    pthread_mutex_lock(&q->mu);
    while (synth_pipe_claim(q, &seq, &t, &r0, &nr)) {
        pthread_mutex_unlock(&q->mu);
        uint32_t slot = (uint32_t)(seq % q->n_slots);
        synth_gen_rows(q->plan, t, r0, nr, q->slots[slot], scratch);
        pthread_mutex_lock(&q->mu);
        q->slot_len[slot] = nr * q->plan->tensors[t].row_bytes;
        q->slot_seq[slot] = seq;
        pthread_cond_broadcast(&q->cv_ready);
    }
    pthread_mutex_unlock(&q->mu);
    free(scratch);
    return NULL;
}

static uint64_t synth_n_chunks(const struct synth_plan *p)
{
    uint64_t n = 0;
    for (size_t i = 0; i < p->n_tensors; i++) {
        uint64_t per = synth_chunk_rows(&p->tensors[i]);
        n += (p->tensors[i].rows + per - 1) / per;
    }
    return n;
}

static void synth_progress(const struct synth_plan *p, uint64_t done, uint64_t total,
                           double t0, double *last)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    double now = (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
    if (!p->cfg->progress || total < SYNTH_PROGRESS_BYTES || now - *last < 1.0)
        return;
    *last = now;
    log_info("synth %s: %.2f of %.2f GB written (%.0f%%), %.0f MB/s", p->cfg->path, done / 1e9,
             total / 1e9, 100.0 * (double)done / (double)total, done / 1e6 / (now - t0));
}

/* Writes chunk after chunk as the generators finish them. */
static int synth_pipe_drain(struct synth_pipe *q, struct gguf_writer *w, double t0)
{
    uint64_t n = synth_n_chunks(q->plan), total = gguf_writer_data_size(w);
    double last = t0;
    for (uint64_t seq = 0; seq < n; seq++) {
        uint32_t slot = (uint32_t)(seq % q->n_slots);
        pthread_mutex_lock(&q->mu);
        while (q->slot_seq[slot] != seq)
            pthread_cond_wait(&q->cv_ready, &q->mu);
        pthread_mutex_unlock(&q->mu);
        int rc = gguf_writer_write_data(w, q->slots[slot], q->slot_len[slot]);
        pthread_mutex_lock(&q->mu);
        q->slot_seq[slot] = UINT64_MAX;
        q->written = seq + 1;
        q->stop = rc != 0;
        pthread_cond_broadcast(&q->cv_free);
        pthread_mutex_unlock(&q->mu);
        if (rc)
            return rc;
        synth_progress(q->plan, gguf_writer_file_offset(w), total, t0, &last);
    }
    return 0;
}

static void synth_pipe_free(struct synth_pipe *q)
{
    for (uint32_t i = 0; q->slots && i < q->n_slots; i++)
        free(q->slots[i]);
    free(q->slots);
    free(q->slot_seq);
    free(q->slot_len);
}

static int synth_pipe_init(struct synth_pipe *q, const struct synth_plan *p, uint32_t threads)
{
    q->plan = p;
    q->n_slots = 2 * threads + 2;
    q->slot_bytes = SYNTH_CHUNK_BYTES;
    for (size_t i = 0; i < p->n_tensors; i++)
        if (p->tensors[i].row_bytes > q->slot_bytes)
            q->slot_bytes = p->tensors[i].row_bytes;
    q->slots = calloc(q->n_slots, sizeof(*q->slots));
    q->slot_seq = malloc(q->n_slots * sizeof(*q->slot_seq));
    q->slot_len = calloc(q->n_slots, sizeof(*q->slot_len));
    if (!q->slots || !q->slot_seq || !q->slot_len)
        return -ENOMEM;
    for (uint32_t i = 0; i < q->n_slots; i++) {
        q->slot_seq[i] = UINT64_MAX;
        q->slots[i] = malloc(q->slot_bytes);
        if (!q->slots[i])
            return -ENOMEM;
    }
    return 0;
}

/* Runs the generator threads and streams their chunks to w. */
static int synth_pipe_run(const struct synth_plan *p, struct gguf_writer *w, uint32_t threads,
                          double t0)
{
    struct synth_pipe q = {0};
    pthread_t tid[SYNTH_MAX_THREADS];
    uint32_t started = 0;
    int rc = synth_pipe_init(&q, p, threads);
    if (rc) {
        log_error("synth: out of memory for %u pipeline slots", q.n_slots);
        goto out_free;
    }
    pthread_mutex_init(&q.mu, NULL);
    pthread_cond_init(&q.cv_free, NULL);
    pthread_cond_init(&q.cv_ready, NULL);
    for (; started < threads; started++) {
        int e = pthread_create(&tid[started], NULL, synth_pipe_worker, &q);
        if (e) {
            log_error("synth: cannot start generator thread %u: %s", started, strerror(e));
            rc = -e;
            break;
        }
    }
    if (!rc)
        rc = synth_pipe_drain(&q, w, t0);
    pthread_mutex_lock(&q.mu);
    q.stop = true;
    pthread_cond_broadcast(&q.cv_free);
    pthread_mutex_unlock(&q.mu);
    for (uint32_t i = 0; i < started; i++)
        pthread_join(tid[i], NULL);
    pthread_cond_destroy(&q.cv_ready);
    pthread_cond_destroy(&q.cv_free);
    pthread_mutex_destroy(&q.mu);
out_free:
    synth_pipe_free(&q);
    return rc;
}

/* ---- public --------------------------------------------------------------- */

static void synth_plan_free(struct synth_plan *p)
{
    for (int k = 0; k < p->n_pools; k++)
        free(p->pools[k].blocks);
    free(p->tensors);
    free(p->c);
    free(p->u);
    free(p->beta);
    free(p->target);
    free(p->rank);
}

static int synth_check_config(const struct synth_config *cfg, struct synth_plan *p)
{
    const struct synth_shape *sh = synth_find_shape(cfg->shape);
    if (synth_find_arch(cfg->arch, &p->arch) || !sh)
        return -EINVAL;
    if (!synth_type_ok(cfg->type)) {
        log_error("synth: matrix type %u (%s) is not one synth can write", cfg->type,
                  quant_type_name(cfg->type) ? quant_type_name(cfg->type) : "unknown");
        return -EINVAL;
    }
    if (cfg->k_m && cfg->type != QUANT_TYPE_Q4_K && cfg->type != QUANT_TYPE_Q5_K) {
        log_error("synth: a _K_M mixture is of Q4_K or Q5_K matrices, not %s",
                  quant_type_name(cfg->type));
        return -EINVAL;
    }
    if (!(cfg->heat >= 0.0f && cfg->heat <= 8.0f)) {
        log_error("synth: heat exponent %g is not in [0, 8]", cfg->heat);
        return -EINVAL;
    }
    if (!cfg->path || !cfg->path[0] || cfg->layers > 4096 ||
        cfg->threads > SYNTH_MAX_THREADS) {
        log_error("synth: bad config (path '%s', layers %u, threads %u)",
                  cfg->path ? cfg->path : "", cfg->layers, cfg->threads);
        return -EINVAL;
    }
    p->cfg = cfg;
    p->sh = *sh;
    p->sh.n_layer = cfg->layers ? cfg->layers : sh->n_layer;
    p->hybrid = p->arch != SYNTH_ARCH_QWEN3MOE;
    ASSERT(p->sh.top_k <= 64 && p->sh.top_k <= p->sh.n_expert); /* shape table invariant */
    if (!p->hybrid)
        p->sh.n_rot = p->sh.head_dim;
    return 0;
}

static double synth_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* Declares every tensor of the plan to the writer. */
static int synth_declare(const struct synth_plan *p, struct gguf_writer *w)
{
    int rc = 0;
    for (size_t i = 0; !rc && i < p->n_tensors; i++) {
        const struct synth_tensor *t = &p->tensors[i];
        rc = gguf_writer_add_tensor(w, t->name, t->type, t->n_dims, t->ne);
    }
    return rc;
}

/* Index of layer 0's router in the plan. */
static uint64_t synth_router0(const struct synth_plan *p)
{
    for (size_t i = 0; i < p->n_tensors; i++)
        if (p->tensors[i].gen == SYNTH_GEN_ROUTER)
            return i;
    ASSERT(!"plan has no router");
    return 0;
}

static int synth_write_file(const struct synth_plan *p, double t0)
{
    const struct synth_config *cfg = p->cfg;
    struct gguf_writer_config wc = {.path = cfg->path, .buffer_bytes = 8u << 20, .direct = true};
    struct gguf_writer *w = gguf_writer_create(&wc);
    if (!w)
        return -EIO;
    int rc = synth_meta(p, w);
    rc = rc ? rc : synth_declare(p, w);
    rc = rc ? rc : gguf_writer_write_header(w);
    rc = rc ? rc : synth_pipe_run(p, w, cfg->threads ? cfg->threads : 2, t0);
    rc = rc ? rc : gguf_writer_finish(w);
    if (!rc && cfg->report) {
        cfg->report->bytes = gguf_writer_file_offset(w);
        cfg->report->n_tensors = p->n_tensors;
        cfg->report->n_params = p->n_params;
    }
    gguf_writer_destroy(w);
    return rc;
}

int synth_write(const struct synth_config *cfg)
{
    double t0 = synth_now();
    struct synth_plan p = {0};
    int rc = synth_check_config(cfg, &p);
    rc = rc ? rc : synth_plan_build(&p);
    rc = rc ? rc : synth_heat_vectors(&p);
    if (!rc && cfg->heat > 0.0f)
        rc = synth_heat_calibrate(&p, synth_router0(&p));
    rc = rc ? rc : synth_pools_fill(&p);
    rc = rc ? rc : synth_write_file(&p, t0);
    if (!rc && cfg->report) {
        struct synth_report *r = cfg->report;
        r->seconds = synth_now() - t0;
        r->mb_per_s = (double)r->bytes / 1e6 / (r->seconds > 0 ? r->seconds : 1e-9);
        memset(&r->heat, 0, sizeof(r->heat));
        struct stat st;
        bool regular = stat(cfg->path, &st) == 0 && S_ISREG(st.st_mode);
        if (cfg->heat_measure && regular)
            rc = synth_heat_measure(&p, &r->heat);
        else if (cfg->heat_measure)
            snprintf(r->heat.summary, sizeof(r->heat.summary), "not measured: %s is not a "
                     "regular file", cfg->path);
    }
    if (!rc)
        log_info("synth %s: %s %s, %u layers, %s%s, %llu tensors, %.2f GB in %.2f s", cfg->path,
                 cfg->arch, cfg->shape, p.sh.n_layer, quant_type_name(cfg->type),
                 cfg->k_m ? "_M (Q6_K where llama-quantize puts it)" : "",
                 (unsigned long long)p.n_tensors,
                 cfg->report ? cfg->report->bytes / 1e9 : 0.0, synth_now() - t0);
    synth_plan_free(&p);
    return rc;
}

uint32_t synth_matrix_type_of(const struct synth_config *cfg, const char *name, uint32_t il,
                              int64_t ne0)
{
    struct synth_plan p = {0};
    if (!cfg || !name || ne0 <= 0 || synth_check_config(cfg, &p))
        return 0;
    return synth_mix_type(cfg, p.hybrid, p.sh.n_layer, name, il, ne0);
}

int synth_parse_type(const char *name, uint32_t *type, bool *k_m)
{
    if (k_m)
        *k_m = false;
    if (k_m && name && (!strcasecmp(name, "q4_k_m") || !strcasecmp(name, "q5_k_m"))) {
        *type = name[1] == '4' ? QUANT_TYPE_Q4_K : QUANT_TYPE_Q5_K;
        *k_m = true;
        return 0;
    }
    static const uint32_t types[] = {
        QUANT_TYPE_F32, QUANT_TYPE_F16, QUANT_TYPE_BF16, QUANT_TYPE_Q8_0, QUANT_TYPE_Q4_0,
        QUANT_TYPE_Q4_1, QUANT_TYPE_Q5_0, QUANT_TYPE_Q5_1, QUANT_TYPE_Q4_K, QUANT_TYPE_Q5_K,
        QUANT_TYPE_Q6_K,
    };
    for (size_t i = 0; name && i < sizeof(types) / sizeof(types[0]); i++) {
        if (strcasecmp(name, quant_type_name(types[i])) == 0) {
            *type = types[i];
            return 0;
        }
    }
    log_error("synth: unknown type '%s' (f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, "
              "q5_k, q6_k%s)", name ? name : "", k_m ? ", q4_k_m, q5_k_m" : "");
    return -EINVAL;
}

int synth_parse_heat(const char *spec, float *s)
{
    if (spec && (strcmp(spec, "none") == 0 || strcmp(spec, "0") == 0)) {
        *s = 0.0f;
        return 0;
    }
    char *end = NULL;
    float v = -1.0f;
    if (spec && strncmp(spec, "zipf:", 5) == 0)
        v = strtof(spec + 5, &end);
    if (!end || end == spec + 5 || *end != '\0' || !(v >= 0.0f && v <= 8.0f)) {
        log_error("synth: bad heat '%s' (want zipf:S with 0 <= S <= 8, or none)",
                  spec ? spec : "");
        return -EINVAL;
    }
    *s = v;
    return 0;
}
