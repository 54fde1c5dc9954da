/*
 * test_backend_cpu: the host backend on a synthetic qwen3next tiny model
 * (synth_write, Q8_0, in /tmp), against a forward over the same layers.
 *
 *   - every expert resident: resident_experts = layers x experts; the
 *     layers + logits of a 10-token prefill and 3 decode steps equal the
 *     forward's bit for bit; backend_reset starts the sequence over (same
 *     bits); stats count the tokens;
 *   - two backends on [0,2) and [2,4) give the same bits as one on [0,4);
 *   - half the experts resident, the rest through remote callbacks (an
 *     expert_exec of the test's own): same bits; resident_experts halves and
 *     mem_used drops by exactly the bytes of the experts not held;
 *   - expert_src: resident experts are copied from there: copies of the
 *     model's weights give the same bits, a table that points expert e at
 *     expert e+1's weights changes the output;
 *   - an f16 KV cache is charged exactly half the f32 cache's bytes;
 *   - a budget of exactly mem_used is accepted, one byte less is refused
 *     (NULL) with a message giving the layer range and the sizes of resident
 *     experts, trunk, KV and state and scratch; a budget that only the
 *     half-resident plan fits accepts that plan and refuses the full one.
 *   - a NULL per-layer residency entry holds none of the layer's experts:
 *     not counted, refused without remote callbacks (child process), the
 *     same bits through them;
 *   - mem_used is exactly expert copies + projections + shared experts +
 *     KV and DeltaNet state + scratch; the lm head adds the output matrix,
 *     a layer's trunk or shared expert placed off the device is not charged.
 */
#include "worker/backend.h"

#include <errno.h>
#include <math.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <unistd.h>

#include "common/log.h"
#include "kernels/cpu/threadpool.h"
#include "model/gguf.h"
#include "model/quant.h"
#include "model/synth.h"
#include "tests/check.h"

#define BC_P 10   /* prefill tokens */
#define BC_D 3    /* decode steps */
#define BC_CTX 32 /* context of every backend here */

struct bc_model {
    char path[128];
    struct gguf *g;
    struct arch_model *m;
};

static int bc_open(struct bc_model *bm)
{
    snprintf(bm->path, sizeof(bm->path), "/tmp/test_backend_cpu_%d.gguf", (int)getpid());
    struct synth_config sc = {.arch = "qwen3next", .shape = "tiny", .type = QUANT_TYPE_Q8_0,
                              .seed = 3, .path = bm->path, .threads = 1};
    if (synth_write(&sc))
        return -1;
    struct gguf_config gc = {.path = bm->path};
    bm->g = gguf_open(&gc);
    struct arch_config ac = {.gguf = bm->g};
    bm->m = bm->g ? arch_load(&ac) : NULL;
    return bm->m ? 0 : -1;
}

static void bc_close(struct bc_model *bm)
{
    arch_free(bm->m);
    gguf_close(bm->g);
    unlink(bm->path);
}

static const int32_t bc_ids[BC_P + BC_D] = {5, 77, 301, 12, 499, 8, 8, 150, 42, 260, 3, 99, 511};

/* The remote experts: an expert_exec over the model's own weights. */
struct bc_remote {
    const struct arch_model *m;
    struct expert_exec *xx;
    uint32_t layer, n_groups, n_rows;
    uint32_t experts[64], counts[64];
    float *X;
    uint64_t rows;
};

static int bc_submit(void *ctx, uint32_t layer, const uint32_t *experts, const uint32_t *counts,
                     uint32_t n_groups, const float *X, uint32_t n_rows)
{
    struct bc_remote *r = ctx;
    if (n_groups > 64)
        return -EPROTO;
    r->layer = layer;
    r->n_groups = n_groups;
    r->n_rows = n_rows;
    memcpy(r->experts, experts, n_groups * sizeof(uint32_t));
    memcpy(r->counts, counts, n_groups * sizeof(uint32_t));
    memcpy(r->X, X, (size_t)n_rows * r->m->hp.n_embd * sizeof(float));
    r->rows += n_rows;
    return 0;
}

static int bc_collect(void *ctx, uint32_t layer, float *Y, uint32_t n_rows)
{
    struct bc_remote *r = ctx;
    struct expert_ref refs[64];
    for (uint32_t g = 0; g < r->n_groups; g++)
        refs[g] = expert_exec_model_ref(&r->m->layers[layer], r->experts[g]);
    if (n_rows != r->n_rows || layer != r->layer)
        return -EPROTO;
    return expert_exec_run(r->xx, &r->m->layers[layer], refs, r->counts, r->n_groups, r->X, Y);
}

/* Prefill BC_P tokens then BC_D decode steps through one or two backends;
 * logits of the last prefill token and of each decode step into out
 * (1 + BC_D rows). */
static int bc_run(const struct arch_model *m, struct backend *b1, struct backend *b2, float *out)
{
    const size_t n = m->hp.n_embd, V = m->hp.n_vocab;
    float *h = malloc((BC_P + BC_D) * n * sizeof(float));
    int rc = 0;
    for (uint32_t i = 0; i < BC_P + BC_D; i++) {
        const int32_t id = bc_ids[i];
        const struct arch_matrix *te = &m->tok_embd;
        rc |= quant_dequantize_row(te->type, te->data + (size_t)id * te->row_bytes, h + i * n, n);
    }
    rc = rc ? rc : backend_layers(b1, h, BC_P);
    rc = rc || !b2 ? rc : backend_layers(b2, h, BC_P);
    struct backend *last = b2 ? b2 : b1;
    rc = rc ? rc : backend_logits(last, h + (BC_P - 1) * n, 1, out);
    for (uint32_t t = BC_P; t < BC_P + BC_D && !rc; t++) {
        rc = backend_layers(b1, h + t * n, 1);
        rc = rc || !b2 ? rc : backend_layers(b2, h + t * n, 1);
        rc = rc ? rc : backend_logits(last, h + t * n, 1, out + (t - BC_P + 1) * V);
    }
    free(h);
    return rc;
}

/* The same through a forward over every layer. */
static int bc_reference(const struct arch_model *m, float *out)
{
    struct threadpool_config tc = {.n_threads = 2, .pin = false};
    struct threadpool *pool = threadpool_create(&tc);
    struct forward_config fc = {.model = m, .pool = pool, .n_ctx = BC_CTX};
    struct forward *fw = pool ? forward_create(&fc) : NULL;
    struct forward_seq *seq = fw ? forward_seq_create(fw) : NULL;
    const size_t n = m->hp.n_embd, V = m->hp.n_vocab;
    float *h = malloc((BC_P + BC_D) * n * sizeof(float));
    int rc = seq ? forward_embed(fw, bc_ids, BC_P + BC_D, h) : -ENOMEM;
    rc = rc ? rc : forward_layers(fw, seq, h, BC_P);
    rc = rc ? rc : forward_logits(fw, h + (BC_P - 1) * n, 1, out);
    for (uint32_t t = BC_P; t < BC_P + BC_D && !rc; t++) {
        rc = forward_layers(fw, seq, h + t * n, 1);
        rc = rc ? rc : forward_logits(fw, h + t * n, 1, out + (t - BC_P + 1) * V);
    }
    free(h);
    forward_seq_destroy(seq);
    forward_destroy(fw);
    threadpool_destroy(pool);
    return rc;
}

static uint64_t bc_expert_bytes(const struct arch_layer *ly)
{
    return ly->gate_exps.mat_bytes + ly->up_exps.mat_bytes + ly->down_exps.mat_bytes;
}

static uint64_t bc_mat(const struct arch_matrix *mm)
{
    return mm->data ? mm->mat_bytes : 0;
}

/* A layer's projections (attention or DeltaNet, and the router). */
static uint64_t bc_proj_bytes(const struct arch_layer *ly)
{
    return bc_mat(&ly->wq) + bc_mat(&ly->wk) + bc_mat(&ly->wv) + bc_mat(&ly->wo) +
           bc_mat(&ly->wqkv) + bc_mat(&ly->wz) + bc_mat(&ly->win) + bc_mat(&ly->wba) +
           bc_mat(&ly->wbeta) + bc_mat(&ly->walpha) + bc_mat(&ly->wout) + bc_mat(&ly->router);
}

static uint64_t bc_shexp_bytes(const struct arch_layer *ly)
{
    return bc_mat(&ly->gate_sh) + bc_mat(&ly->up_sh) + bc_mat(&ly->down_sh);
}

/* What backend.h says a plan of every layer, every expert and trunk piece
 * resident is charged: expert copies + projections + shared experts + KV
 * (f32 here) and DeltaNet state + scratch (max_batch x n_embd x (2 top_k +
 * 16) floats, planner.h). */
static uint64_t bc_expected_mem(const struct arch_model *m, uint32_t max_batch, bool kv_f16)
{
    const struct arch_hparams *hp = &m->hp;
    uint64_t b = 0;
    for (uint32_t l = 0; l < hp->n_layer; l++) {
        const struct arch_layer *ly = &m->layers[l];
        b += hp->n_expert * bc_expert_bytes(ly) + bc_proj_bytes(ly) + bc_shexp_bytes(ly);
        if (ly->recurrent)
            b += ((uint64_t)arch_conv_dim(hp) * (hp->ssm_conv - 1) +
                  (uint64_t)hp->ssm_nv * hp->ssm_dv * hp->ssm_dk) * 4;
        else
            b += 2ull * BC_CTX * hp->n_head_kv * hp->head_dim * (kv_f16 ? 2 : 4);
    }
    return b + (uint64_t)max_batch * hp->n_embd * (2 * hp->n_expert_used + 16) * 4;
}

static struct backend_config bc_config(const struct arch_model *m)
{
    return (struct backend_config){.model = m, .layer_begin = 0, .layer_end = m->hp.n_layer,
                                   .n_threads = 2, .n_ctx = BC_CTX, .max_batch = 16};
}

static void bc_all_resident(const struct arch_model *m, const float *ref, uint64_t *mem_all)
{
    const uint32_t L = m->hp.n_layer, E = m->hp.n_expert;
    const size_t V = m->hp.n_vocab, out_bytes = (1 + BC_D) * V * sizeof(float);
    struct backend_config bc = bc_config(m);
    struct backend *b = backend_create("cpu", &bc);
    CHECK(b != NULL, "all-resident backend: %s", log_last_error());
    if (!b)
        return;
    CHECK(b->resident_experts == L * E, "resident_experts %u, want %u", b->resident_experts,
          L * E);
    uint64_t experts = 0, kv = 0;
    for (uint32_t l = 0; l < L; l++) {
        experts += E * bc_expert_bytes(&m->layers[l]);
        if (!m->layers[l].recurrent)
            kv += 2ull * BC_CTX * m->hp.n_head_kv * m->hp.head_dim * 4;
    }
    const uint64_t want = bc_expected_mem(m, 16, false);
    CHECK(b->mem_used == want, "mem_used %llu, expected %llu (experts %llu, KV %llu)",
          (unsigned long long)b->mem_used, (unsigned long long)want, (unsigned long long)experts,
          (unsigned long long)kv);
    *mem_all = b->mem_used;
    CHECK(b->calls == 0 && !strcmp(b->ops->name, "cpu"), "fresh backend");
    float *out = malloc(out_bytes);
    CHECK(bc_run(m, b, NULL, out) == 0, "all-resident run");
    CHECK(memcmp(out, ref, out_bytes) == 0, "all-resident backend differs from the forward");
    const struct forward_stats *st = backend_stats(b);
    CHECK(st && st->tokens == BC_P + BC_D, "stats: %llu tokens",
          st ? (unsigned long long)st->tokens : 0ull);
    CHECK(b->calls == 1 + BC_D, "calls %llu", (unsigned long long)b->calls);
    backend_reset(b);
    memset(out, 0, out_bytes);
    CHECK(bc_run(m, b, NULL, out) == 0, "run after reset");
    CHECK(memcmp(out, ref, out_bytes) == 0, "reset does not start the sequence over");
    MEASURE("all resident: %u experts, mem_used %.2f MiB (experts %.2f MiB, KV %.2f MiB); logits "
            "bit-identical to the forward", b->resident_experts, b->mem_used / 1048576.0,
            experts / 1048576.0, kv / 1048576.0);
    free(out);
    backend_destroy(b);

    /* a split over two backends */
    struct backend_config c1 = bc, c2 = bc;
    c1.layer_end = 2;
    c2.layer_begin = 2;
    struct backend *b1 = backend_create("cpu", &c1), *b2 = backend_create("cpu", &c2);
    CHECK(b1 && b2, "split backends");
    if (b1 && b2) {
        CHECK(b1->resident_experts == 2 * E && b2->resident_experts == (L - 2) * E,
              "split resident counts %u %u", b1->resident_experts, b2->resident_experts);
        out = malloc(out_bytes);
        CHECK(bc_run(m, b1, b2, out) == 0, "split run");
        CHECK(memcmp(out, ref, out_bytes) == 0, "layers split over two backends differ");
        free(out);
    }
    backend_destroy(b1);
    backend_destroy(b2);
}

static void bc_half_resident(const struct arch_model *m, const float *ref, uint64_t mem_all)
{
    const uint32_t L = m->hp.n_layer, E = m->hp.n_expert;
    const size_t V = m->hp.n_vocab, out_bytes = (1 + BC_D) * V * sizeof(float);
    uint8_t bits[16] = {0};
    for (uint32_t e = 0; e < E; e++)
        if (e % 2 == 1)
            bits[e / 8] |= (uint8_t)(1u << (e % 8));
    const uint8_t *resident[16];
    for (uint32_t l = 0; l < L; l++)
        resident[l] = bits;
    struct threadpool_config tc = {.n_threads = 1, .pin = false};
    struct threadpool *rp = threadpool_create(&tc);
    struct expert_exec_config xc = {.pool = rp, .n_embd = m->hp.n_embd, .n_ff = m->hp.n_ff_exp,
                                    .max_rows = 16 * m->hp.n_expert_used};
    struct bc_remote r = {.m = m, .xx = expert_exec_create(&xc)};
    r.X = malloc((size_t)xc.max_rows * m->hp.n_embd * sizeof(float));
    struct backend_config bc = bc_config(m);
    bc.resident = resident;
    bc.remote = (struct forward_remote){.ctx = &r, .submit = bc_submit, .collect = bc_collect};
    struct backend *b = backend_create("cpu", &bc);
    CHECK(b != NULL, "half-resident backend");
    uint64_t not_held = 0;
    for (uint32_t l = 0; l < L; l++)
        not_held += (E / 2) * bc_expert_bytes(&m->layers[l]);
    if (b) {
        CHECK(b->resident_experts == L * E / 2, "half resident: %u experts", b->resident_experts);
        CHECK(mem_all - b->mem_used == not_held, "mem_used dropped by %llu, experts not held are "
              "%llu bytes", (unsigned long long)(mem_all - b->mem_used),
              (unsigned long long)not_held);
        float *out = malloc(out_bytes);
        CHECK(bc_run(m, b, NULL, out) == 0, "half-resident run");
        CHECK(memcmp(out, ref, out_bytes) == 0, "remote experts change the logits");
        CHECK(r.rows > 0 && r.rows == backend_stats(b)->remote_rows,
              "remote rows %llu vs stats %llu", (unsigned long long)r.rows,
              (unsigned long long)backend_stats(b)->remote_rows);
        MEASURE("half resident: %u experts held, %llu rows computed remotely, mem_used %.3f MiB "
                "(all resident %.3f MiB); logits bit-identical", b->resident_experts,
                (unsigned long long)r.rows, b->mem_used / 1048576.0, mem_all / 1048576.0);
        free(out);
        const uint64_t half_mem = b->mem_used;
        backend_destroy(b);
        /* a budget between the two plans: the half plan fits, the full one not */
        bc.device_mem = (half_mem + mem_all) / 2;
        b = backend_create("cpu", &bc);
        CHECK(b != NULL, "half plan refused under a budget of %llu",
              (unsigned long long)bc.device_mem);
        backend_destroy(b);
        struct backend_config full = bc_config(m);
        full.device_mem = bc.device_mem;
        b = backend_create("cpu", &full);
        CHECK(b == NULL, "full plan accepted under a budget it exceeds");
        backend_destroy(b);
    }
    free(r.X);
    expert_exec_destroy(r.xx);
    threadpool_destroy(rp);
}

static void bc_budget(const struct arch_model *m, uint64_t mem_all)
{
    struct backend_config bc = bc_config(m);
    bc.device_mem = mem_all;
    struct backend *b = backend_create("cpu", &bc);
    CHECK(b != NULL && b->mem_used == mem_all, "budget of exactly mem_used refused");
    backend_destroy(b);
    bc.device_mem = mem_all - 1;
    b = backend_create("cpu", &bc);
    CHECK(b == NULL, "budget one byte short accepted");
    backend_destroy(b);
    const char *msg = log_last_error();
    static const char *const parts[] = {"too small", "layers 0-3", "resident experts", "trunk",
                                        "KV and state", "scratch"};
    for (size_t i = 0; i < sizeof(parts) / sizeof(parts[0]); i++)
        CHECK(strstr(msg, parts[i]) != NULL, "budget message lacks '%s': %s", parts[i], msg);
    bc.device_mem = 1;
    CHECK(backend_create("cpu", &bc) == NULL, "1-byte budget accepted");
    /* f16 KV: the attention layers' cache is charged at half */
    bc = bc_config(m);
    bc.kv_f16 = true;
    b = backend_create("cpu", &bc);
    uint64_t kv32 = 0;
    for (uint32_t l = 0; l < m->hp.n_layer; l++)
        if (!m->layers[l].recurrent)
            kv32 += 2ull * BC_CTX * m->hp.n_head_kv * m->hp.head_dim * 4;
    CHECK(b && mem_all - b->mem_used == kv32 / 2, "f16 KV saves %llu bytes, want %llu",
          b ? (unsigned long long)(mem_all - b->mem_used) : 0ull, (unsigned long long)(kv32 / 2));
    backend_destroy(b);
    /* the plan's trunk pieces: the lm head adds the output matrix, a layer
     * whose projections (or shared expert) stay off the device is not charged
     * for them */
    bc = bc_config(m);
    bc.lmhead = true;
    b = backend_create("cpu", &bc);
    CHECK(b && b->mem_used - mem_all == m->output.mat_bytes, "lm head charged %llu, want %llu",
          b ? (unsigned long long)(b->mem_used - mem_all) : 0ull,
          (unsigned long long)m->output.mat_bytes);
    backend_destroy(b);
    bool trunk[16], shexp[16];
    for (uint32_t l = 0; l < m->hp.n_layer; l++)
        trunk[l] = shexp[l] = l != 2;
    bc = bc_config(m);
    bc.trunk_on_device = trunk;
    b = backend_create("cpu", &bc);
    const uint64_t proj2 = bc_proj_bytes(&m->layers[2]), sh2 = bc_shexp_bytes(&m->layers[2]);
    CHECK(b && mem_all - b->mem_used == proj2, "layer 2 trunk off the device saves %llu, want %llu",
          b ? (unsigned long long)(mem_all - b->mem_used) : 0ull, (unsigned long long)proj2);
    backend_destroy(b);
    bc.shexp_on_device = shexp;
    b = backend_create("cpu", &bc);
    CHECK(b && sh2 > 0 && mem_all - b->mem_used == proj2 + sh2,
          "layer 2 trunk and shared expert off the device save %llu, want %llu",
          b ? (unsigned long long)(mem_all - b->mem_used) : 0ull,
          (unsigned long long)(proj2 + sh2));
    backend_destroy(b);
}

/* expert_src: resident experts are copied from this table. */
static void bc_expert_src(const struct arch_model *m, const float *ref)
{
    const uint32_t L = m->hp.n_layer, E = m->hp.n_expert;
    const size_t V = m->hp.n_vocab, out_bytes = (1 + BC_D) * V * sizeof(float);
    struct expert_ref *tab = calloc((size_t)L * E, sizeof(*tab));
    const struct expert_ref *src[16];
    uint8_t **copies = calloc((size_t)L * E, sizeof(uint8_t *));
    for (uint32_t l = 0; l < L; l++) {
        const struct arch_layer *ly = &m->layers[l];
        const size_t gb = ly->gate_exps.mat_bytes, db = ly->down_exps.mat_bytes;
        for (uint32_t e = 0; e < E; e++) {
            struct expert_ref mr = expert_exec_model_ref(ly, e);
            uint8_t *c = copies[l * E + e] = malloc(2 * gb + db);
            memcpy(c, mr.gate, gb);
            memcpy(c + gb, mr.up, gb);
            memcpy(c + 2 * gb, mr.down, db);
            tab[l * E + e] = (struct expert_ref){.gate = c, .up = c + gb, .down = c + 2 * gb};
        }
        src[l] = tab + l * E;
    }
    struct backend_config bc = bc_config(m);
    bc.expert_src = src;
    struct backend *b = backend_create("cpu", &bc);
    float *out = malloc(out_bytes);
    CHECK(b && bc_run(m, b, NULL, out) == 0, "expert_src backend");
    CHECK(b && memcmp(out, ref, out_bytes) == 0, "copied expert_src weights differ");
    backend_destroy(b);
    /* expert e of layer 0 reads expert e+1's weights */
    struct expert_ref *shifted = malloc(E * sizeof(*shifted));
    for (uint32_t e = 0; e < E; e++)
        shifted[e] = tab[(e + 1) % E];
    src[0] = shifted;
    b = backend_create("cpu", &bc);
    CHECK(b && bc_run(m, b, NULL, out) == 0, "shifted expert_src backend");
    CHECK(b && memcmp(out, ref, out_bytes) != 0, "expert_src ignored: shifted experts give the "
          "model's output");
    backend_destroy(b);
    free(shifted);
    free(out);
    for (size_t i = 0; i < (size_t)L * E; i++)
        free(copies[i]);
    free(copies);
    free(tab);
}

/* A NULL residency entry holds none of that layer's experts: counted as
 * none, refused without remote callbacks (-EINVAL; run in a child so that
 * a crash, as in the version before forward.h's NULL-entry fix, fails the
 * check instead of the whole test), and computed remotely with the same
 * bits as all-resident. */
static void bc_null_entries(const struct arch_model *m, const float *ref)
{
    const uint32_t L = m->hp.n_layer, E = m->hp.n_expert;
    const size_t out_bytes = (1 + BC_D) * m->hp.n_vocab * sizeof(float);
    uint8_t all[16];
    memset(all, 0xff, sizeof(all));
    const uint8_t *resident[16] = {NULL};
    for (uint32_t l = 0; l < L; l++)
        resident[l] = l % 2 ? all : NULL; /* layers 0 and 2: none */
    struct backend_config bc = bc_config(m);
    bc.resident = resident;
    struct backend *b = backend_create("cpu", &bc);
    CHECK(b && b->resident_experts == L / 2 * E, "NULL entries: %u experts held, want %u",
          b ? b->resident_experts : 0, L / 2 * E);
    backend_destroy(b);
    fflush(NULL);
    pid_t pid = fork(); /* the child makes its own backend: pool threads do not survive fork */
    if (pid == 0) {
        alarm(10);
        struct rlimit no_core = {0, 0};
        setrlimit(RLIMIT_CORE, &no_core);
        struct backend *cb = backend_create("cpu", &bc);
        float *h = calloc(4 * m->hp.n_embd, sizeof(float));
        for (uint32_t i = 0; cb && i < 4 * m->hp.n_embd; i++)
            h[i] = 0.01f * (float)(i % 17);
        int rc = cb ? backend_layers(cb, h, 4) : -ENOMEM;
        _exit(rc == -EINVAL ? 0 : 3);
    }
    int status = 0;
    waitpid(pid, &status, 0);
    CHECK(WIFEXITED(status) && WEXITSTATUS(status) == 0, "NULL residency entries without remote "
          "callbacks: child %s %d, want a clean -EINVAL", WIFSIGNALED(status) ? "killed by signal"
          : "exited with", WIFSIGNALED(status) ? WTERMSIG(status) : WEXITSTATUS(status));
    /* with the callbacks: the logits of every expert resident */
    struct threadpool_config tc = {.n_threads = 1, .pin = false};
    struct threadpool *rp = threadpool_create(&tc);
    struct expert_exec_config xc = {.pool = rp, .n_embd = m->hp.n_embd, .n_ff = m->hp.n_ff_exp,
                                    .max_rows = 16 * m->hp.n_expert_used};
    struct bc_remote r = {.m = m, .xx = expert_exec_create(&xc)};
    r.X = malloc((size_t)xc.max_rows * m->hp.n_embd * sizeof(float));
    bc.remote = (struct forward_remote){.ctx = &r, .submit = bc_submit, .collect = bc_collect};
    b = backend_create("cpu", &bc);
    float *out = malloc(out_bytes);
    CHECK(b && bc_run(m, b, NULL, out) == 0, "run with NULL entries");
    CHECK(b && memcmp(out, ref, out_bytes) == 0 && r.rows > 0,
          "NULL entries computed remotely differ (%llu remote rows)", (unsigned long long)r.rows);
    backend_destroy(b);
    free(out);
    free(r.X);
    expert_exec_destroy(r.xx);
    threadpool_destroy(rp);
}

int main(void)
{
    log_init("test", -1);
    struct bc_model bm = {0};
    CHECK(bc_open(&bm) == 0, "tiny model: %s", log_last_error());
    if (bm.m) {
        const size_t out_bytes = (1 + BC_D) * bm.m->hp.n_vocab * sizeof(float);
        float *ref = malloc(out_bytes);
        CHECK(bc_reference(bm.m, ref) == 0, "forward reference");
        uint64_t mem_all = 0;
        bc_all_resident(bm.m, ref, &mem_all);
        if (mem_all) {
            bc_half_resident(bm.m, ref, mem_all);
            bc_budget(bm.m, mem_all);
        }
        bc_expert_src(bm.m, ref);
        bc_null_entries(bm.m, ref);
        free(ref);
    }
    bc_close(&bm);
    return test_main_result("test_backend_cpu");
}
