/*
 * test_forward: the CPU forward pass on synthetic tiny models (synth_write,
 * qwen3next Q8_0: three DeltaNet layers then one attention layer; and
 * qwen3moe Q8_0, attention only), written to /tmp.
 *
 *   - chunking: a 40-token prompt in one call, in calls of 13+17+10, with
 *     max_batch 8 (internal passes), and token by token give the same logits
 *     within a stated tolerance. Not bit for bit: a pass of S >= 2 tokens
 *     takes matvec_rows_batch and the chunked DeltaNet form, a single token
 *     matvec_rows and the step recurrence, and chunk boundaries change the
 *     DeltaNet's order of operations (and which rows share an expert group);
 *   - thread count: 1 and 2 threads give the same bits;
 *   - layer ranges: [0,k) then [k,L) on the same hidden states, as two
 *     forwards with their own sequences, equals [0,L) bit for bit for every
 *     k, over a prefill and then decode steps;
 *   - residency: half the experts of each layer (odd ids; layer 1's entry
 *     NULL = none resident) computed through the remote callbacks with an
 *     expert_exec of their own gives the all-resident logits bit for bit;
 *     the callbacks see ascending non-resident experts, the row counts add
 *     up, stats count local and remote rows; a failing submit or collect
 *     fails the step with its errno; non-resident experts without callbacks
 *     are -EINVAL;
 *   - sequence: reset gives the fresh sequence's bits again; positions
 *     advance; overflowing the context is -ENOSPC and leaves the position;
 *   - forward_embed returns the dequantized token_embd rows and rejects ids
 *     < 0 or >= n_vocab; forward_create rejects bad layer ranges; the
 *     progress counter counts layers; an f16 KV cache stays close to f32.
 */
#include "worker/forward.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/log.h"
#include "kernels/cpu/threadpool.h"
#include "model/gguf.h"
#include "model/quant.h"
#include "model/synth.h"
#include "tests/check.h"

#define TF_N 40           /* prompt tokens */
#define TF_CHUNK_TOL 1e-4 /* max |logit diff| / max |logit| between chunkings (measured ~3e-7) */
#define TF_F16_TOL 2e-2   /* the same for an f16 KV cache against f32 */

struct tf_model {
    char path[128];
    struct gguf *g;
    struct arch_model *m;
};

static int tf_open(struct tf_model *tm, const char *arch)
{
    snprintf(tm->path, sizeof(tm->path), "/tmp/test_forward_%d_%s.gguf", (int)getpid(), arch);
    struct synth_config sc = {.arch = arch, .shape = "tiny", .type = QUANT_TYPE_Q8_0, .seed = 5,
                              .path = tm->path, .threads = 1};
    if (synth_write(&sc))
        return -1;
    struct gguf_config gc = {.path = tm->path};
    tm->g = gguf_open(&gc);
    struct arch_config ac = {.gguf = tm->g};
    tm->m = tm->g ? arch_load(&ac) : NULL;
    return tm->m ? 0 : -1;
}

static void tf_close(struct tf_model *tm)
{
    arch_free(tm->m);
    gguf_close(tm->g);
    unlink(tm->path);
}

static double tf_maxabs(const float *a, size_t n)
{
    double m = 0;
    for (size_t i = 0; i < n; i++)
        m = fmax(m, fabs(a[i]));
    return m;
}

static double tf_maxdiff(const float *a, const float *b, size_t n)
{
    double m = 0;
    for (size_t i = 0; i < n; i++)
        m = fmax(m, isfinite(a[i]) && isfinite(b[i]) ? fabs((double)a[i] - b[i]) : INFINITY);
    return m;
}

/* Runs ids through a forward built from cfg in calls of splits[] tokens
 * (0-terminated; NULL: one call) and writes every position's logits. */
static int tf_run(const struct forward_config *cfg, const int32_t *ids, uint32_t n,
                  const uint32_t *splits, float *logits)
{
    const struct arch_hparams *hp = &cfg->model->hp;
    struct forward *fw = forward_create(cfg);
    struct forward_seq *seq = fw ? forward_seq_create(fw) : NULL;
    float *h = malloc((size_t)n * hp->n_embd * sizeof(float));
    int rc = !seq || !h ? -ENOMEM : 0;
    uint32_t done = 0;
    for (int i = 0; !rc && done < n; i++) {
        uint32_t c = splits && splits[i] ? splits[i] : n - done;
        c = c > n - done ? n - done : c;
        float *hc = h + (size_t)done * hp->n_embd;
        rc = forward_embed(fw, ids + done, c, hc);
        rc = rc ? rc : forward_layers(fw, seq, hc, c);
        rc = rc ? rc : forward_logits(fw, hc, c, logits + (size_t)done * hp->n_vocab);
        done += c;
        if (!rc && forward_seq_pos(seq) != done)
            rc = -EPROTO;
    }
    free(h);
    forward_seq_destroy(seq);
    forward_destroy(fw);
    return rc;
}

static void tf_ids(const struct arch_model *m, int32_t *ids, uint32_t n)
{
    uint64_t s = 77;
    for (uint32_t i = 0; i < n; i++) {
        s = s * 6364136223846793005ull + 1442695040888963407ull;
        ids[i] = (int32_t)((s >> 33) % m->hp.n_vocab);
    }
}

/* ---- chunking and threads ---- */

static void tf_chunking(const char *arch, const struct arch_model *m, struct threadpool *p1,
                        struct threadpool *p2)
{
    const size_t V = m->hp.n_vocab;
    int32_t ids[TF_N];
    tf_ids(m, ids, TF_N);
    float *one = malloc(TF_N * V * sizeof(float)), *alt = malloc(TF_N * V * sizeof(float));
    struct forward_config fc = {.model = m, .pool = p2, .n_ctx = 64};
    CHECK(tf_run(&fc, ids, TF_N, NULL, one) == 0, "%s: one-call prefill", arch);
    const double scale = tf_maxabs(one, TF_N * V);

    fc.pool = p1;
    CHECK(tf_run(&fc, ids, TF_N, NULL, alt) == 0, "%s: 1-thread prefill", arch);
    CHECK(memcmp(one, alt, TF_N * V * sizeof(float)) == 0, "%s: 1 and 2 threads differ", arch);
    fc.pool = p2;

    static const uint32_t three[] = {13, 17, 10, 0};
    CHECK(tf_run(&fc, ids, TF_N, three, alt) == 0, "%s: 13+17+10 prefill", arch);
    double d3 = tf_maxdiff(one, alt, TF_N * V) / scale;
    CHECK(d3 <= TF_CHUNK_TOL, "%s: 13+17+10 calls differ from one call by %.3g", arch, d3);

    fc.max_batch = 8;
    CHECK(tf_run(&fc, ids, TF_N, NULL, alt) == 0, "%s: max_batch 8 prefill", arch);
    double db = tf_maxdiff(one, alt, TF_N * V) / scale;
    CHECK(db <= TF_CHUNK_TOL, "%s: max_batch 8 differs from one pass by %.3g", arch, db);
    /* passes of 8 in one call are the same computation as calls of 8 */
    float *alt2 = malloc(TF_N * V * sizeof(float));
    static const uint32_t eights[] = {8, 8, 8, 8, 8, 0};
    fc.max_batch = 0;
    CHECK(tf_run(&fc, ids, TF_N, eights, alt2) == 0, "%s: calls of 8", arch);
    CHECK(memcmp(alt, alt2, TF_N * V * sizeof(float)) == 0,
          "%s: max_batch 8 differs from calls of 8 tokens", arch);

    static const uint32_t ones[TF_N + 1] = {1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
                                            1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1,
                                            1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 1, 0};
    CHECK(tf_run(&fc, ids, TF_N, ones, alt) == 0, "%s: token by token", arch);
    double d1 = tf_maxdiff(one, alt, TF_N * V) / scale;
    CHECK(d1 <= TF_CHUNK_TOL, "%s: token by token differs from one call by %.3g", arch, d1);
    /* the first token alone is the same single-token computation */
    float *first = malloc(V * sizeof(float));
    CHECK(tf_run(&fc, ids, 1, NULL, first) == 0 && memcmp(first, alt, V * sizeof(float)) == 0,
          "%s: first token of the decode run differs from a one-token prefill", arch);
    free(first);

    fc.kv_f16 = true;
    CHECK(tf_run(&fc, ids, TF_N, NULL, alt) == 0, "%s: f16 kv prefill", arch);
    double dh = tf_maxdiff(one, alt, TF_N * V) / scale;
    CHECK(dh <= TF_F16_TOL, "%s: f16 KV cache differs by %.3g", arch, dh);
    MEASURE("%s: max |logit diff| / max |logit| vs one 40-token call: 13+17+10 calls %.2g, "
            "max_batch 8 %.2g, token by token %.2g (bound %.0e), f16 KV %.2g; 1 vs 2 threads "
            "bit-identical", arch, d3, db, d1, TF_CHUNK_TOL, dh);
    free(one);
    free(alt);
    free(alt2);
}

/* ---- layer ranges ---- */

static void tf_ranges(const char *arch, const struct arch_model *m, struct threadpool *pool)
{
    const uint32_t L = m->hp.n_layer, n = m->hp.n_embd;
    const uint32_t P = 12, D = 4; /* prefill tokens, then decode steps */
    int32_t ids[16];
    tf_ids(m, ids, P + D);
    struct forward_config fc = {.model = m, .pool = pool, .n_ctx = 32};
    struct forward *full = forward_create(&fc);
    struct forward_seq *sf = full ? forward_seq_create(full) : NULL;
    float *hf = malloc((P + D) * n * sizeof(float)), *hs = malloc((P + D) * n * sizeof(float));
    CHECK(sf && forward_embed(full, ids, P + D, hf) == 0, "%s: embed", arch);
    memcpy(hs, hf, (P + D) * n * sizeof(float));
    CHECK(forward_layers(full, sf, hf, P) == 0, "%s: full prefill", arch);
    for (uint32_t t = P; t < P + D; t++)
        CHECK(forward_layers(full, sf, hf + t * n, 1) == 0, "%s: full decode", arch);
    int exact = 0;
    for (uint32_t k = 1; k < L; k++) {
        struct forward_config a = fc, b = fc;
        a.layer_end = k;
        b.layer_begin = k;
        struct forward *fa = forward_create(&a), *fb = forward_create(&b);
        struct forward_seq *sa = fa ? forward_seq_create(fa) : NULL;
        struct forward_seq *sb = fb ? forward_seq_create(fb) : NULL;
        CHECK(sa && sb, "%s: split at %u", arch, k);
        if (!sa || !sb)
            continue;
        float *h = malloc((P + D) * n * sizeof(float));
        memcpy(h, hs, (P + D) * n * sizeof(float));
        int rc = forward_layers(fa, sa, h, P) | forward_layers(fb, sb, h, P);
        for (uint32_t t = P; t < P + D; t++)
            rc |= forward_layers(fa, sa, h + t * n, 1) | forward_layers(fb, sb, h + t * n, 1);
        CHECK(rc == 0, "%s: split at %u runs", arch, k);
        bool same = memcmp(h, hf, (P + D) * n * sizeof(float)) == 0;
        CHECK(same, "%s: layers [0,%u) + [%u,%u) differ from [0,%u) (max diff %g)", arch, k, k,
              L, L, tf_maxdiff(h, hf, (P + D) * n));
        exact += same;
        free(h);
        forward_seq_destroy(sa);
        forward_seq_destroy(sb);
        forward_destroy(fa);
        forward_destroy(fb);
    }
    MEASURE("%s: %d of %u layer splits bit-identical to the whole range (prefill %u + decode %u)",
            arch, exact, L - 1, P, D);
    free(hf);
    free(hs);
    forward_seq_destroy(sf);
    forward_destroy(full);
}

/* ---- residency and the remote callbacks ---- */

struct tf_remote {
    const struct arch_model *m;
    struct expert_exec *xx;
    const uint8_t *const *resident;
    uint32_t layer, n_groups, n_rows;
    uint32_t experts[64], counts[64];
    float *X;                 /* capacity rows of n_embd */
    uint32_t capacity;
    uint64_t submits, collects, rows;
    int bad;                  /* protocol violations seen */
    int fail_submit, fail_collect; /* errno to return once, or 0 */
};

static bool tf_bit(const uint8_t *bm, uint32_t e)
{
    return (bm[e / 8] >> (e % 8)) & 1;
}

static int tf_submit(void *ctx, uint32_t layer, const uint32_t *experts, const uint32_t *counts,
                     uint32_t n_groups, const float *X, uint32_t n_rows)
{
    struct tf_remote *r = ctx;
    if (r->fail_submit) {
        int e = r->fail_submit;
        r->fail_submit = 0;
        return e;
    }
    uint32_t sum = 0;
    for (uint32_t g = 0; g < n_groups; g++) {
        sum += counts[g];
        r->bad += counts[g] == 0 || (g && experts[g] <= experts[g - 1]);
        r->bad += r->resident[layer] != NULL && tf_bit(r->resident[layer], experts[g]);
    }
    r->bad += sum != n_rows || n_rows > r->capacity || n_groups > 64 || n_groups == 0;
    if (r->bad)
        return -EPROTO;
    r->layer = layer;
    r->n_groups = n_groups;
    r->n_rows = n_rows;
    memcpy(r->experts, experts, n_groups * sizeof(uint32_t));
    memcpy(r->counts, counts, n_groups * sizeof(uint32_t));
    memcpy(r->X, X, (size_t)n_rows * r->m->hp.n_embd * sizeof(float));
    r->submits++;
    r->rows += n_rows;
    return 0;
}

static int tf_collect(void *ctx, uint32_t layer, float *Y, uint32_t n_rows)
{
    struct tf_remote *r = ctx;
    if (r->fail_collect) {
        int e = r->fail_collect;
        r->fail_collect = 0;
        return e;
    }
    r->bad += layer != r->layer || n_rows != r->n_rows;
    struct expert_ref refs[64];
    for (uint32_t g = 0; g < r->n_groups; g++)
        refs[g] = expert_exec_model_ref(&r->m->layers[layer], r->experts[g]);
    r->collects++;
    return expert_exec_run(r->xx, &r->m->layers[layer], refs, r->counts, r->n_groups, r->X, Y);
}

static void tf_residency(const char *arch, const struct arch_model *m, struct threadpool *pool,
                         struct threadpool *rpool)
{
    const uint32_t L = m->hp.n_layer, E = m->hp.n_expert, V = m->hp.n_vocab;
    const uint32_t B = 64;
    int32_t ids[TF_N];
    tf_ids(m, ids, TF_N);
    uint8_t odd_out[16];
    memset(odd_out, 0, sizeof(odd_out));
    for (uint32_t e = 0; e < E; e += 2)
        odd_out[e / 8] |= (uint8_t)(1u << (e % 8)); /* even ids resident */
    const uint8_t *resident[16];
    for (uint32_t l = 0; l < L; l++)
        resident[l] = l == 1 ? NULL : odd_out; /* layer 1: NULL entry = none resident */
    struct expert_exec_config xc = {.pool = rpool, .n_embd = m->hp.n_embd,
                                    .n_ff = m->hp.n_ff_exp, .max_rows = B * m->hp.n_expert_used};
    struct tf_remote r = {.m = m, .xx = expert_exec_create(&xc), .resident = resident,
                          .capacity = B * m->hp.n_expert_used};
    r.X = malloc((size_t)r.capacity * m->hp.n_embd * sizeof(float));
    float *all = malloc((size_t)TF_N * V * sizeof(float));
    float *half = malloc((size_t)TF_N * V * sizeof(float));
    static const uint32_t splits[] = {20, 1, 1, 1, 17, 0};
    struct forward_config fc = {.model = m, .pool = pool, .n_ctx = 64, .max_batch = B};
    CHECK(tf_run(&fc, ids, TF_N, splits, all) == 0, "%s: all-resident run", arch);
    fc.resident = resident;
    fc.remote = (struct forward_remote){.ctx = &r, .submit = tf_submit, .collect = tf_collect};
    CHECK(tf_run(&fc, ids, TF_N, splits, half) == 0, "%s: half-resident run", arch);
    CHECK(r.bad == 0, "%s: %d protocol violations in the remote calls", arch, r.bad);
    CHECK(r.submits > 0 && r.submits == r.collects, "%s: %llu submits, %llu collects", arch,
          (unsigned long long)r.submits, (unsigned long long)r.collects);
    CHECK(memcmp(all, half, (size_t)TF_N * V * sizeof(float)) == 0,
          "%s: remote experts change the logits (max diff %g)", arch,
          tf_maxdiff(all, half, (size_t)TF_N * V));
    /* stats of a forward with remote experts */
    struct forward *fw = forward_create(&fc);
    struct forward_seq *seq = fw ? forward_seq_create(fw) : NULL;
    float *h = malloc((size_t)TF_N * m->hp.n_embd * sizeof(float));
    volatile uint64_t progress = 0;
    uint64_t rows0 = r.rows;
    if (seq) {
        CHECK(forward_embed(fw, ids, TF_N, h) == 0 && forward_layers(fw, seq, h, TF_N) == 0,
              "%s: stats run", arch);
        const struct forward_stats *st = forward_get_stats(fw);
        CHECK(st->tokens == TF_N && st->expert_rows + st->remote_rows ==
                  (uint64_t)TF_N * m->hp.n_expert_used * L,
              "%s: stats count %llu tokens, %llu local + %llu remote rows", arch,
              (unsigned long long)st->tokens, (unsigned long long)st->expert_rows,
              (unsigned long long)st->remote_rows);
        CHECK(st->remote_rows == r.rows - rows0 && st->remote_rows > 0 && st->expert_rows > 0,
              "%s: remote rows %llu, callbacks saw %llu", arch,
              (unsigned long long)st->remote_rows, (unsigned long long)(r.rows - rows0));
        MEASURE("%s: half the experts remote (odd ids; layer 1 all remote): %llu local rows, %llu "
                "remote rows, logits bit-identical to all-resident", arch,
                (unsigned long long)st->expert_rows, (unsigned long long)st->remote_rows);
        forward_stats_reset(fw);
        CHECK(forward_get_stats(fw)->tokens == 0, "stats reset");
        /* failures of the callbacks fail the step with their errno */
        forward_seq_reset(seq);
        CHECK(forward_embed(fw, ids, 4, h) == 0, "embed");
        r.fail_submit = -EHOSTUNREACH;
        CHECK(forward_layers(fw, seq, h, 4) == -EHOSTUNREACH, "%s: failed submit not passed up",
              arch);
        forward_seq_reset(seq);
        r.fail_collect = -ETIMEDOUT;
        CHECK(forward_layers(fw, seq, h, 4) == -ETIMEDOUT, "%s: failed collect not passed up",
              arch);
    }
    forward_seq_destroy(seq);
    forward_destroy(fw);
    /* non-resident experts and no callbacks */
    fc.remote = (struct forward_remote){0};
    fc.progress = &progress;
    fw = forward_create(&fc);
    seq = fw ? forward_seq_create(fw) : NULL;
    if (seq) {
        CHECK(forward_embed(fw, ids, 4, h) == 0, "embed");
        CHECK(forward_layers(fw, seq, h, 4) == -EINVAL, "%s: no remote pool accepted", arch);
        CHECK(strstr(log_last_error(), "not resident") != NULL, "message: %s", log_last_error());
    }
    forward_seq_destroy(seq);
    forward_destroy(fw);
    free(h);
    free(all);
    free(half);
    free(r.X);
    expert_exec_destroy(r.xx);
}

/* ---- sequence state, context, embed, config ---- */

static void tf_sequence(const char *arch, const struct arch_model *m, struct threadpool *pool)
{
    const uint32_t n = m->hp.n_embd, V = m->hp.n_vocab, L = m->hp.n_layer;
    int32_t ids[TF_N];
    tf_ids(m, ids, TF_N);
    volatile uint64_t progress = 0;
    struct forward_config fc = {.model = m, .pool = pool, .n_ctx = 16, .progress = &progress};
    struct forward *fw = forward_create(&fc);
    struct forward_seq *seq = fw ? forward_seq_create(fw) : NULL;
    CHECK(seq != NULL, "%s: create", arch);
    if (!seq) {
        forward_destroy(fw);
        return;
    }
    CHECK(forward_n_ctx(fw) == 16 && forward_seq_pos(seq) == 0, "%s: n_ctx/pos", arch);
    float *h = malloc(32 * n * sizeof(float)), *h2 = malloc(32 * n * sizeof(float));
    float *lg = malloc(16 * V * sizeof(float)), *lg2 = malloc(16 * V * sizeof(float));
    CHECK(forward_embed(fw, ids, 10, h) == 0, "embed");
    CHECK(forward_layers(fw, seq, h, 10) == 0 && forward_seq_pos(seq) == 10, "%s: 10 tokens",
          arch);
    CHECK(progress == L, "%s: progress %llu after one pass of %u layers", arch,
          (unsigned long long)progress, L);
    CHECK(forward_logits(fw, h, 10, lg) == 0, "logits");
    /* overflow: 10 + 7 > 16 */
    CHECK(forward_embed(fw, ids + 10, 7, h2) == 0, "embed 7");
    CHECK(forward_layers(fw, seq, h2, 7) == -ENOSPC, "%s: context overflow not -ENOSPC", arch);
    CHECK(forward_seq_pos(seq) == 10, "%s: position moved on overflow: %u", arch,
          forward_seq_pos(seq));
    CHECK(strstr(log_last_error(), "context") != NULL, "message: %s", log_last_error());
    CHECK(forward_layers(fw, seq, h2, 6) == 0 && forward_seq_pos(seq) == 16, "%s: fill to 16",
          arch);
    CHECK(forward_layers(fw, seq, h2, 1) == -ENOSPC, "%s: one past the end", arch);
    /* reset: the same 10 tokens give the fresh sequence's bits */
    forward_seq_reset(seq);
    CHECK(forward_seq_pos(seq) == 0, "reset pos");
    CHECK(forward_embed(fw, ids, 10, h) == 0 && forward_layers(fw, seq, h, 10) == 0 &&
              forward_logits(fw, h, 10, lg2) == 0, "%s: after reset", arch);
    CHECK(memcmp(lg, lg2, 10 * V * sizeof(float)) == 0, "%s: reset does not start over", arch);

    /* embed: rows of token_embd, range checks */
    const int32_t edge[3] = {0, (int32_t)V - 1, 17};
    CHECK(forward_embed(fw, edge, 3, h) == 0, "embed edge ids");
    float *row = malloc(n * sizeof(float));
    for (int i = 0; i < 3; i++) {
        quant_dequantize_row(m->tok_embd.type, m->tok_embd.data + (size_t)edge[i] *
                             m->tok_embd.row_bytes, row, n);
        CHECK(memcmp(row, h + (size_t)i * n, n * sizeof(float)) == 0, "embed row of id %d",
              edge[i]);
    }
    free(row);
    const int32_t bad1[2] = {3, (int32_t)V}, bad2[1] = {-1};
    CHECK(forward_embed(fw, bad1, 2, h) == -EINVAL, "%s: id n_vocab accepted", arch);
    CHECK(strstr(log_last_error(), "outside the vocabulary"), "message: %s", log_last_error());
    CHECK(forward_embed(fw, bad2, 1, h) == -EINVAL, "%s: id -1 accepted", arch);
    free(h);
    free(h2);
    free(lg);
    free(lg2);
    forward_seq_destroy(seq);
    forward_destroy(fw);

    /* bad layer ranges */
    struct forward_config bad = {.model = m, .pool = pool, .layer_begin = 2, .layer_end = 2};
    CHECK(forward_create(&bad) == NULL, "%s: empty layer range accepted", arch);
    bad.layer_begin = 0;
    bad.layer_end = L + 1;
    CHECK(forward_create(&bad) == NULL, "%s: range past the last layer accepted", arch);
    bad.layer_begin = L;
    bad.layer_end = 0;
    CHECK(forward_create(&bad) == NULL, "%s: begin at n_layer accepted", arch);
    /* defaults: n_ctx = min(train ctx, 4096) */
    struct forward_config dflt = {.model = m, .pool = pool};
    fw = forward_create(&dflt);
    uint32_t want = m->hp.n_ctx_train && m->hp.n_ctx_train < 4096 ? m->hp.n_ctx_train : 4096;
    CHECK(fw && forward_n_ctx(fw) == want, "%s: default n_ctx %u, want %u", arch,
          fw ? forward_n_ctx(fw) : 0, want);
    forward_destroy(fw);
    forward_destroy(NULL);
    forward_seq_destroy(NULL);
}

/* Routing counts (forward_config.heat): every layer of the range counts
 * top_k picks per token, prompt chunks and decode alike; other layers and a
 * forward without counters count nothing; counting leaves the logits alone. */
static void tf_heat(const char *arch, const struct arch_model *m, struct threadpool *pool)
{
    const uint32_t L = m->hp.n_layer, E = m->hp.n_expert, k = m->hp.n_expert_used;
    const size_t V = m->hp.n_vocab;
    int32_t ids[TF_N];
    tf_ids(m, ids, TF_N);
    uint64_t *heat = calloc((size_t)L * E, sizeof(uint64_t));
    float *a = malloc(TF_N * V * sizeof(float)), *b = malloc(TF_N * V * sizeof(float));
    const uint32_t splits[] = {17, 1, 1, 21, 0};
    struct forward_config fc = {.model = m, .pool = pool, .n_ctx = 64, .layer_begin = 1,
                                .layer_end = L};
    CHECK(heat && a && b && tf_run(&fc, ids, TF_N, splits, a) == 0, "%s: run without counts",
          arch);
    fc.heat = heat;
    CHECK(tf_run(&fc, ids, TF_N, splits, b) == 0, "%s: run with counts", arch);
    CHECK(!memcmp(a, b, TF_N * V * sizeof(float)), "%s: counting changes no logit", arch);
    bool ok = true;
    for (uint32_t l = 0; l < L; l++) {
        uint64_t sum = 0, most = 0;
        for (uint32_t e = 0; e < E; e++) {
            sum += heat[(size_t)l * E + e];
            most = heat[(size_t)l * E + e] > most ? heat[(size_t)l * E + e] : most;
        }
        ok &= sum == (l ? (uint64_t)TF_N * k : 0) && most <= TF_N;
    }
    CHECK(ok, "%s: each counted layer has %u x %u picks, at most %u per expert; layer 0 none",
          arch, TF_N, k, TF_N);
    MEASURE("%s routing counts: %u tokens x top-%u per layer in layers 1-%u, logits unchanged",
            arch, TF_N, k, L - 1);
    free(heat), free(a), free(b);
}

static void tf_arch(const char *arch, struct threadpool *p1, struct threadpool *p2)
{
    struct tf_model tm = {0};
    CHECK(tf_open(&tm, arch) == 0, "%s tiny model: %s", arch, log_last_error());
    if (tm.m) {
        tf_chunking(arch, tm.m, p1, p2);
        tf_ranges(arch, tm.m, p2);
        tf_residency(arch, tm.m, p2, p1);
        tf_sequence(arch, tm.m, p2);
        tf_heat(arch, tm.m, p2);
    }
    tf_close(&tm);
}

int main(void)
{
    log_init("test", -1);
    struct threadpool_config c1 = {.n_threads = 1, .pin = false};
    struct threadpool_config c2 = {.n_threads = 2, .pin = false};
    struct threadpool *p1 = threadpool_create(&c1), *p2 = threadpool_create(&c2);
    CHECK(p1 && p2, "pools");
    if (p1 && p2) {
        tf_arch("qwen3next", p1, p2);
        tf_arch("qwen3moe", p1, p2);
    }
    threadpool_destroy(p1);
    threadpool_destroy(p2);
    return test_main_result("test_forward");
}
