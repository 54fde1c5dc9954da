/*
 * test_backend_seq: sequence slots of the cpu backend (backend_use_seq), on synthetic tiny
 * models (qwen3next: DeltaNet and attention layers; qwen3moe: attention only):
 *   - two sequences whose steps interleave one at a time on slots 0 and 1 give the same bits
 *     as each run alone on a one-slot backend (no state leaks between slots);
 *   - backend_reset_seq starts one slot over and leaves the other alone; backend_reset all;
 *   - a slot out of range is refused with -EINVAL and nothing changes;
 *   - the budget charges every slot's KV cache and state (a budget that fits one slot and
 *     not three refuses three slots);
 *   - sequence snapshots: slot 0's state after the prompt and two decode steps, loaded into
 *     slot 1, continues there with the same bits as the sequence run through; the snapshot is
 *     forward_state_bytes long and equals the CPU forward's own (forward_seq_save); a
 *     snapshot of another size, or past the context, is refused.
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "model/arch.h"
#include "model/gguf.h"
#include "model/quant.h"
#include "model/synth.h"
#include "worker/backend.h"
#include "worker/forward.h"
#include "tests/check.h"

#define BS_P 6   /* prefill tokens of each sequence */
#define BS_D 4   /* decode steps of each sequence */
#define BS_CTX 16

struct bs_model {
    char path[128];
    struct gguf *g;
    struct arch_model *m;
    struct threadpool *pool;
    struct forward *emb;
};

static int bs_open(struct bs_model *bm, const char *arch)
{
    snprintf(bm->path, sizeof(bm->path), "/tmp/test_backend_seq_%s_%d.gguf", arch,
             (int)getpid());
    struct synth_config sc = {.arch = arch, .shape = "tiny", .type = QUANT_TYPE_Q8_0,
                              .seed = 9, .path = bm->path, .threads = 1};
    if (synth_write(&sc))
        return -1;
    struct gguf_config gc = {.path = bm->path};
    bm->g = gguf_open(&gc);
    struct arch_config ac = {.gguf = bm->g};
    bm->m = bm->g ? arch_load(&ac) : NULL;
    struct threadpool_config pc = {.n_threads = 1};
    bm->pool = bm->m ? threadpool_create(&pc) : NULL;
    struct forward_config fc = {.model = bm->m, .pool = bm->pool, .layer_end = 1,
                                .n_ctx = BS_CTX, .max_batch = BS_P};
    bm->emb = bm->pool ? forward_create(&fc) : NULL;
    return bm->emb ? 0 : -1;
}

static void bs_close(struct bs_model *bm)
{
    forward_destroy(bm->emb);
    threadpool_destroy(bm->pool);
    arch_free(bm->m);
    gguf_close(bm->g);
    unlink(bm->path);
}

static struct backend *bs_backend(const struct bs_model *bm, uint32_t n_seq, uint64_t mem)
{
    struct backend_config bc = {.model = bm->m, .layer_begin = 0,
                                .layer_end = bm->m->hp.n_layer, .n_threads = 1,
                                .n_ctx = BS_CTX, .max_batch = BS_P, .n_seq = n_seq,
                                .device_mem = mem, .lmhead = true};
    return backend_create("cpu", &bc);
}

/* The ids of sequence s: a prompt of BS_P, then BS_D decode ids. */
static int32_t bs_id(uint32_t s, uint32_t i)
{
    return (int32_t)((s * 131 + i * 37 + 5) % 250);
}

/* Step k of sequence s (k 0: the prompt; k >= 1: one decode id) through b on slot s; its
 * output rows are appended to out. */
static int bs_step(const struct bs_model *bm, struct backend *b, uint32_t slot, uint32_t s,
                   uint32_t k, float *out)
{
    const uint32_t n = k ? 1 : BS_P, first = k ? BS_P + k - 1 : 0;
    const size_t w = bm->m->hp.n_embd;
    int32_t ids[BS_P];
    for (uint32_t i = 0; i < n; i++)
        ids[i] = bs_id(s, first + i);
    float *h = out + (size_t)first * w;
    int rc = forward_embed(bm->emb, ids, n, h);
    rc = rc ? rc : backend_use_seq(b, slot);
    return rc ? rc : backend_layers(b, h, n);
}

static void bs_model_checks(const char *arch)
{
    struct bs_model bm = {0};
    if (bs_open(&bm, arch)) {
        CHECK(0, "%s: cannot make the model", arch);
        bs_close(&bm);
        return;
    }
    const size_t rows = BS_P + BS_D, w = bm.m->hp.n_embd, bytes = rows * w * sizeof(float);
    float *alone[2], *inter[2];
    for (int s = 0; s < 2; s++) {
        alone[s] = calloc(rows, w * sizeof(float));
        inter[s] = calloc(rows, w * sizeof(float));
    }
    /* each alone on a one-slot backend */
    for (uint32_t s = 0; s < 2; s++) {
        struct backend *b = bs_backend(&bm, 1, 0);
        int rc = b ? 0 : -ENOMEM;
        for (uint32_t k = 0; k <= BS_D && !rc; k++)
            rc = bs_step(&bm, b, 0, s, k, alone[s]);
        CHECK(rc == 0, "%s: sequence %u alone: %d", arch, s, rc);
        backend_destroy(b);
    }
    /* interleaved on slots 1 and 0 of a three-slot backend */
    struct backend *b = bs_backend(&bm, 3, 0);
    CHECK(b && b->n_seq == 3, "%s: three slots", arch);
    int rc = b ? 0 : -ENOMEM;
    for (uint32_t k = 0; k <= BS_D && !rc; k++) {
        rc = bs_step(&bm, b, 1, 0, k, inter[0]);
        rc = rc ? rc : bs_step(&bm, b, 0, 1, k, inter[1]);
    }
    CHECK(rc == 0, "%s: interleaved: %d", arch, rc);
    CHECK(!memcmp(alone[0], inter[0], bytes) && !memcmp(alone[1], inter[1], bytes),
          "%s: interleaved sequences differ from each alone", arch);
    if (b) {
        /* out of range: refused, the current slot stays */
        CHECK(backend_use_seq(b, 3) == -EINVAL && b->seq == 0, "%s: slot 3 of 3 accepted", arch);
        CHECK(backend_reset_seq(b, 7) == -EINVAL, "%s: reset of slot 7 accepted", arch);
        /* reset slot 1 only: sequence 0 again there gives the same bits; slot 0 is untouched
         * (its next decode step continues sequence 1) */
        memset(inter[0], 0, bytes);
        CHECK(backend_reset_seq(b, 1) == 0, "%s: reset slot 1", arch);
        rc = 0;
        for (uint32_t k = 0; k <= BS_D && !rc; k++)
            rc = bs_step(&bm, b, 1, 0, k, inter[0]);
        CHECK(rc == 0 && !memcmp(alone[0], inter[0], bytes), "%s: after reset_seq: %d", arch,
              rc);
        float *h = calloc(w, sizeof(float));
        int32_t id = 3;
        rc = h ? forward_embed(bm.emb, &id, 1, h) : -ENOMEM;
        rc = rc ? rc : backend_use_seq(b, 0);
        rc = rc ? rc : backend_layers(b, h, 1);
        CHECK(rc == 0, "%s: slot 0 continues after slot 1's reset: %d", arch, rc);
        /* reset all: sequence 1 again on slot 0 gives the same bits */
        backend_reset(b);
        memset(inter[1], 0, bytes);
        rc = 0;
        for (uint32_t k = 0; k <= BS_D && !rc; k++)
            rc = bs_step(&bm, b, 0, 1, k, inter[1]);
        CHECK(rc == 0 && !memcmp(alone[1], inter[1], bytes), "%s: after reset: %d", arch, rc);
        /* the budget: what one slot needs, then three slots in it */
        const uint64_t one = b->mem_used;
        backend_destroy(b);
        b = bs_backend(&bm, 1, 0);
        const uint64_t single = b ? b->mem_used : 0;
        backend_destroy(b);
        b = bs_backend(&bm, 1, single);
        CHECK(b != NULL, "%s: one slot in its own budget refused", arch);
        backend_destroy(b);
        b = bs_backend(&bm, 3, single);
        CHECK(b == NULL && one > single, "%s: three slots in one slot's budget accepted "
              "(%llu vs %llu bytes)", arch, (unsigned long long)one, (unsigned long long)single);
        free(h);
    }
    backend_destroy(b);
    for (int s = 0; s < 2; s++) {
        free(alone[s]);
        free(inter[s]);
    }
    bs_close(&bm);
}

static void bs_snapshot_checks(const char *arch)
{
    struct bs_model bm = {0};
    if (bs_open(&bm, arch)) {
        CHECK(0, "%s: cannot make the model", arch);
        bs_close(&bm);
        return;
    }
    const size_t rows = BS_P + BS_D, w = bm.m->hp.n_embd, bytes = rows * w * sizeof(float);
    float *ref = calloc(rows, w * sizeof(float)), *got = calloc(rows, w * sizeof(float));
    struct backend *b = bs_backend(&bm, 2, 0);
    int rc = b && ref && got ? 0 : -ENOMEM;
    for (uint32_t k = 0; k <= BS_D && !rc; k++)
        rc = bs_step(&bm, b, 0, 0, k, ref);
    CHECK(rc == 0, "%s: the sequence run through: %d", arch, rc);
    rc = rc ? rc : backend_reset_seq(b, 0);
    for (uint32_t k = 0; k <= 2 && !rc; k++)
        rc = bs_step(&bm, b, 0, 0, k, got);
    const uint32_t pos = BS_P + 2;
    const size_t sb = forward_state_bytes(bm.m, 0, bm.m->hp.n_layer, pos, false);
    uint8_t *snap = malloc(sb + 8), *fwd = malloc(sb + 8);
    rc = rc ? rc : snap && fwd ? 0 : -ENOMEM;
    CHECK(rc || (backend_pos(b) == pos && backend_state_bytes(b) == sb), "%s: snapshot at %u "
          "tokens: pos %u, %zu bytes (want %zu)", arch, pos, rc ? 0 : backend_pos(b),
          rc ? 0 : backend_state_bytes(b), sb);
    rc = rc ? rc : backend_state_save(b, snap);
    /* the CPU forward run over the same tokens gives the same bytes */
    struct forward_config fc = {.model = bm.m, .pool = bm.pool, .n_ctx = BS_CTX,
                                .max_batch = BS_P};
    struct forward *fw = rc ? NULL : forward_create(&fc);
    struct forward_seq *fs = fw ? forward_seq_create(fw) : NULL;
    float *h = calloc(rows, w * sizeof(float));
    int32_t ids[BS_P + 2];
    for (uint32_t i = 0; i < pos; i++)
        ids[i] = bs_id(0, i);
    int frc = fs && h ? forward_embed(bm.emb, ids, pos, h) : -ENOMEM;
    frc = frc ? frc : forward_layers(fw, fs, h, BS_P);
    for (uint32_t i = BS_P; i < pos && !frc; i++)
        frc = forward_layers(fw, fs, h + (size_t)i * w, 1);
    if (!frc)
        forward_seq_save(fs, fwd);
    CHECK(rc || (frc == 0 && !memcmp(snap, fwd, sb)), "%s: the backend's snapshot differs from "
          "the CPU forward's (%d)", arch, frc);
    /* loaded into slot 1, the rest of the sequence continues there */
    rc = rc ? rc : backend_use_seq(b, 1);
    rc = rc ? rc : backend_state_load(b, snap, sb, pos);
    for (uint32_t k = 3; k <= BS_D && !rc; k++)
        rc = bs_step(&bm, b, 1, 0, k, got);
    CHECK(rc == 0 && !memcmp(ref, got, bytes), "%s: continued from a snapshot in slot 1: %d",
          arch, rc);
    if (b) {
        CHECK(backend_state_load(b, snap, sb - 1, pos) == -EINVAL, "%s: a short snapshot "
              "accepted", arch);
        const size_t past = forward_state_bytes(bm.m, 0, bm.m->hp.n_layer, BS_CTX + 1, false);
        uint8_t *big = calloc(1, past);
        CHECK(big && backend_state_load(b, big, past, BS_CTX + 1) == -ENOSPC, "%s: a snapshot "
              "past the context accepted", arch);
        free(big);
    }
    free(h);
    forward_seq_destroy(fs);
    forward_destroy(fw);
    free(snap);
    free(fwd);
    backend_destroy(b);
    free(ref);
    free(got);
    bs_close(&bm);
}

int main(void)
{
    bs_model_checks("qwen3next");
    bs_model_checks("qwen3moe");
    bs_snapshot_checks("qwen3next");
    bs_snapshot_checks("qwen3moe");
    return test_main_result("test_backend_seq");
}
