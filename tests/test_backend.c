/*
 * test_backend: kind lookup, dispatch and failure injection of the worker
 * backend (backend.c), on the cpu kind with a synthetic qwen3next tiny model.
 *
 *   - an unknown kind is refused (NULL) with a message naming it and the
 *     kinds this build has;
 *   - dispatch: backend_layers / backend_logits / backend_stats /
 *     backend_reset reach the cpu ops (results equal a direct forward, stats
 *     count tokens, reset starts over); calls counts every layers() call;
 *   - "step:2": the first call succeeds, the second returns -EIO without
 *     touching the hidden rows or the sequence, the third succeeds and
 *     continues the sequence where the first left it; "step:0", an unknown
 *     kind of failure and a malformed spec never fail;
 *   - "crash:1" aborts the process in its first layers call (child process,
 *     SIGABRT); "hang:2" returns from call 1 and never from call 2 (child
 *     process, killed after 300 ms).
 */
#include "worker/backend.h"

#include <errno.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#include "kernels/cpu/threadpool.h"
#include "model/gguf.h"
#include "model/quant.h"
#include "model/synth.h"
#include "tests/check.h"

struct tb_model {
    char path[128];
    struct gguf *g;
    struct arch_model *m;
};

static int tb_open(struct tb_model *bm)
{
    snprintf(bm->path, sizeof(bm->path), "/tmp/test_backend_%d.gguf", (int)getpid());
    struct synth_config sc = {.arch = "qwen3next", .shape = "tiny", .type = QUANT_TYPE_Q8_0,
                              .seed = 21, .path = bm->path, .threads = 1};
    if (synth_write(&sc))
        return -1;
    struct gguf_config gc = {.path = bm->path};
    bm->g = gguf_open(&gc);
    struct arch_config ac = {.gguf = bm->g};
    bm->m = bm->g ? arch_load(&ac) : NULL;
    return bm->m ? 0 : -1;
}

static void tb_close(struct tb_model *bm)
{
    arch_free(bm->m);
    gguf_close(bm->g);
    unlink(bm->path);
}

static const int32_t tb_ids[8] = {1, 200, 33, 404, 5, 60, 7, 480};

static struct backend *tb_create(const struct arch_model *m, const char *fail)
{
    struct backend_config bc = {.model = m, .layer_begin = 0, .layer_end = m->hp.n_layer,
                                .n_threads = 1, .n_ctx = 32, .max_batch = 8, .fail = fail};
    return backend_create("cpu", &bc);
}

static void tb_embed(const struct arch_model *m, const int32_t *ids, uint32_t n, float *h)
{
    const struct arch_matrix *te = &m->tok_embd;
    for (uint32_t i = 0; i < n; i++)
        quant_dequantize_row(te->type, te->data + (size_t)ids[i] * te->row_bytes,
                             h + (size_t)i * m->hp.n_embd, m->hp.n_embd);
}

/* Reference: the 8 tokens in two calls of 4 through a forward; logits of
 * token 7. */
static void tb_reference(const struct arch_model *m, float *logits)
{
    struct threadpool_config tc = {.n_threads = 1, .pin = false};
    struct threadpool *pool = threadpool_create(&tc);
    struct forward_config fc = {.model = m, .pool = pool, .n_ctx = 32, .max_batch = 8};
    struct forward *fw = forward_create(&fc);
    struct forward_seq *seq = fw ? forward_seq_create(fw) : NULL;
    float *h = malloc(8 * m->hp.n_embd * sizeof(float));
    tb_embed(m, tb_ids, 8, h);
    CHECK(seq && forward_layers(fw, seq, h, 4) == 0 &&
              forward_layers(fw, seq, h + 4 * m->hp.n_embd, 4) == 0 &&
              forward_logits(fw, h + 7 * m->hp.n_embd, 1, logits) == 0, "reference forward");
    free(h);
    forward_seq_destroy(seq);
    forward_destroy(fw);
    threadpool_destroy(pool);
}

static void tb_kinds(const struct arch_model *m)
{
    struct backend_config bc = {.model = m, .layer_end = m->hp.n_layer, .n_threads = 1,
                                .n_ctx = 32};
    CHECK(backend_create("tpu", &bc) == NULL, "kind 'tpu' accepted");
    const char *msg = log_last_error();
    CHECK(strstr(msg, "'tpu'") && strstr(msg, "available: cpu"), "message: %s", msg);
    CHECK(backend_create("", &bc) == NULL, "empty kind accepted");
    backend_destroy(NULL);
    /* host buffers: plain memory on the cpu backend (and with no backend), usable, 16-byte
     * aligned, freed by their own allocator */
    struct backend *b = backend_create("cpu", &bc);
    CHECK(b != NULL, "cpu backend");
    for (int k = 0; k < 2; k++) {
        float *p = backend_host_alloc(k ? NULL : b, 1000 * sizeof(float));
        CHECK(p && (uintptr_t)p % 16 == 0, "host buffer %d: %p", k, (void *)p);
        for (int i = 0; p && i < 1000; i++)
            p[i] = (float)i;
        CHECK(!p || p[999] == 999.0f, "host buffer %d not usable", k);
        backend_host_free(k ? NULL : b, p);
    }
    backend_host_free(b, NULL);
    backend_destroy(b);
}

/* Dispatch and step:N. */
static void tb_step(const struct arch_model *m, const float *ref)
{
    const size_t n = m->hp.n_embd, V = m->hp.n_vocab;
    struct backend *b = tb_create(m, "step:2");
    CHECK(b != NULL, "backend with step:2");
    if (!b)
        return;
    float *h = malloc(8 * n * sizeof(float)), *keep = malloc(4 * n * sizeof(float));
    float *lg = malloc(V * sizeof(float));
    tb_embed(m, tb_ids, 8, h);
    CHECK(backend_layers(b, h, 4) == 0 && b->calls == 1, "call 1");
    memcpy(keep, h + 4 * n, 4 * n * sizeof(float));
    CHECK(backend_layers(b, h + 4 * n, 4) == -EIO, "call 2 is not -EIO");
    CHECK(b->calls == 2, "calls %llu after the failure", (unsigned long long)b->calls);
    CHECK(strstr(log_last_error(), "injected failure at step 2"), "message: %s", log_last_error());
    CHECK(memcmp(keep, h + 4 * n, 4 * n * sizeof(float)) == 0, "failed call modified the rows");
    CHECK(backend_stats(b)->tokens == 4, "failed call advanced the stats: %llu tokens",
          (unsigned long long)backend_stats(b)->tokens);
    /* call 3 continues at position 4: the same as the reference's second call */
    CHECK(backend_layers(b, h + 4 * n, 4) == 0 && b->calls == 3, "call 3");
    CHECK(backend_logits(b, h + 7 * n, 1, lg) == 0, "logits");
    CHECK(memcmp(lg, ref, V * sizeof(float)) == 0,
          "after an injected failure the sequence does not continue where it was");
    CHECK(backend_stats(b)->tokens == 8, "stats %llu tokens",
          (unsigned long long)backend_stats(b)->tokens);
    /* reset: the same 8 tokens from position 0 */
    backend_reset(b);
    tb_embed(m, tb_ids, 8, h);
    CHECK(backend_layers(b, h, 4) == 0 && backend_layers(b, h + 4 * n, 4) == 0 &&
              backend_logits(b, h + 7 * n, 1, lg) == 0, "after reset");
    CHECK(memcmp(lg, ref, V * sizeof(float)) == 0, "reset does not start over");
    CHECK(b->calls == 5, "calls %llu", (unsigned long long)b->calls);
    backend_destroy(b);

    /* specs that never fail */
    static const char *const harmless[] = {"step:0", "oops:2", "step", "step:x", "", NULL};
    for (size_t i = 0; i < sizeof(harmless) / sizeof(harmless[0]); i++) {
        b = tb_create(m, harmless[i]);
        CHECK(b != NULL, "spec '%s' refused", harmless[i] ? harmless[i] : "(null)");
        if (!b)
            continue;
        int rc = 0;
        tb_embed(m, tb_ids, 8, h);
        for (int c = 0; c < 4; c++)
            rc |= backend_layers(b, h + (size_t)c * 2 * n, 2);
        CHECK(rc == 0 && b->calls == 4, "spec '%s' failed a call",
              harmless[i] ? harmless[i] : "(null)");
        backend_destroy(b);
    }
    free(h);
    free(keep);
    free(lg);
}

/* crash:N and hang:N in child processes (each builds its own backend: pool
 * threads do not survive fork). Returns the child's status; for hang the
 * child is killed after 300 ms and *alive says whether it was still there. */
static int tb_child(const struct arch_model *m, const char *fail, bool *alive)
{
    int fds[2];
    if (pipe(fds))
        return -1;
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        alarm(10);
        struct rlimit no_core = {0, 0};
        setrlimit(RLIMIT_CORE, &no_core);
        close(fds[0]);
        struct backend *b = tb_create(m, fail);
        float *h = malloc(8 * m->hp.n_embd * sizeof(float));
        tb_embed(m, tb_ids, 8, h);
        for (int c = 0; c < 4 && b; c++) {
            char ok = backend_layers(b, h + (size_t)c * 2 * m->hp.n_embd, 2) == 0 ? 'y' : 'n';
            if (write(fds[1], &ok, 1) != 1)
                _exit(4);
        }
        _exit(b ? 0 : 5);
    }
    close(fds[1]);
    char got[8] = {0};
    ssize_t k = 0, r;
    if (alive) {
        /* wait for call 1's byte, then give call 2 time to hang */
        r = read(fds[0], got, 1);
        k = r > 0 ? r : 0;
        struct timespec ts = {0, 300 * 1000 * 1000};
        nanosleep(&ts, NULL);
        int st;
        *alive = waitpid(pid, &st, WNOHANG) == 0;
        kill(pid, SIGKILL);
    }
    while ((r = read(fds[0], got + k, sizeof(got) - 1 - (size_t)k)) > 0)
        k += r;
    close(fds[0]);
    int status = 0;
    waitpid(pid, &status, 0);
    if (!alive)
        CHECK(k == 0, "crash:1: %zd calls returned before the crash", k);
    else
        CHECK(k == 1 && got[0] == 'y', "hang:2: call 1 returned '%s'", got);
    return status;
}

static void tb_crash_hang(const struct arch_model *m)
{
    int st = tb_child(m, "crash:1", NULL);
    CHECK(WIFSIGNALED(st) && WTERMSIG(st) == SIGABRT, "crash:1: child status %#x, want SIGABRT",
          st);
    bool alive = false;
    st = tb_child(m, "hang:2", &alive);
    CHECK(alive, "hang:2: the child was not hanging in call 2");
    CHECK(WIFSIGNALED(st) && WTERMSIG(st) == SIGKILL, "hang:2: child status %#x", st);
}

int main(void)
{
    log_init("test", -1);
    struct tb_model bm = {0};
    CHECK(tb_open(&bm) == 0, "tiny model: %s", log_last_error());
    if (bm.m) {
        float *ref = malloc(bm.m->hp.n_vocab * sizeof(float));
        tb_reference(bm.m, ref);
        tb_kinds(bm.m);
        tb_step(bm.m, ref);
        tb_crash_hang(bm.m);
        free(ref);
    }
    tb_close(&bm);
    return test_main_result("test_backend");
}
