/*
 * bench_ipc: the multi-process system's own costs, measured with the real
 * sockets and framing (ipc/wire) between two real processes:
 *   - CPU-fallback round trip: an ExpertRequest with 8 KiB of hidden state
 *     out (one 2048-wide row), an ExpertReply with 8 KiB back;
 *   - worker-to-worker hand-off: a Step with 8 KiB of hidden state over
 *     PUSH/PULL, answered the same way (round trip; one hand-off is half);
 * each 10,000 times after 1,000 warm-up rounds, median and p99 in us.
 * With -m MODEL it also measures the coordinator's CPU expert pool: requests
 * of top_k experts x B tokens for every layer, bytes of expert weights read
 * per second against the host's read bandwidth.
 *
 *   build/tools/bench_ipc [-n 10000] [-w 2048] [-m MODEL.gguf] [-t THREADS] [-b TOKENS]
 */
#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "common/log.h"
#include "common/stats.h"
#include "coordinator/expert_pool.h"
#include "ipc/wire.h"
#include "kernels/cpu/threadpool.h"
#include "model/arch.h"
#include "model/gguf.h"

static double bench_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int bench_cmp_u32(const void *a, const void *b)
{
    uint32_t x = *(const uint32_t *)a, y = *(const uint32_t *)b;
    return x < y ? -1 : x > y;
}

/* The echo side: answers every request (expert request -> reply, step -> step). */
static void bench_echo(const char *ep, int type, int width, int rounds)
{
    void *ctx = zmq_ctx_new();
    struct wire_socket_config c = wire_socket_config_default();
    c.routing_id = "w0";
    c.spin_us = 200;
    struct wire_socket *in = NULL, *out = NULL;
    char ep_in[272], ep_out[272]; /* the caller's 256 and "-a.sock" */
    if (type == ZMQ_DEALER) {
        in = out = wire_socket_create(ctx, ZMQ_DEALER, &c);
        wire_socket_connect(in, ep);
    } else { /* PUSH/PULL pair: pull on ep.a, push to ep.b */
        snprintf(ep_in, sizeof(ep_in), "%s-a.sock", ep);
        snprintf(ep_out, sizeof(ep_out), "%s-b.sock", ep);
        c.routing_id = NULL;
        in = wire_socket_create(ctx, ZMQ_PULL, &c);
        out = wire_socket_create(ctx, ZMQ_PUSH, NULL);
        wire_socket_bind(in, ep_in);
        wire_socket_connect(out, ep_out);
    }
    for (int r = 0; r < rounds; r++) {
        struct wire_msg m;
        if (wire_recv(in, &m, NULL, NULL, 10000))
            break;
        struct wire_msg o = {.type = m.type == WIRE_TYPE_STEP ? WIRE_TYPE_STEP
                                                              : WIRE_TYPE_EXPERT_REPLY};
        if (o.type == WIRE_TYPE_STEP)
            o.step = m.step;
        else
            o.expert_reply = (struct wire_expert_reply){.step = m.expert_request.step,
                                                        .layer = m.expert_request.layer,
                                                        .n_rows = 1, .n_embd = (uint32_t)width};
        o.tensor = m.tensor;
        o.tensor_bytes = m.tensor_bytes;
        wire_send(out, &o, NULL, 0);
        wire_msg_free(&m);
    }
    if (out != in)
        wire_socket_destroy(out);
    wire_socket_destroy(in);
    zmq_ctx_term(ctx);
}

static void bench_report(const char *what, double *v, int n)
{
    qsort(v, (size_t)n, sizeof(double), stats_cmp_double);
    printf("%-44s median %7.1f us   p99 %7.1f us   (n = %d)\n", what, v[n / 2] * 1e6,
           v[(int)(n * 0.99)] * 1e6, n);
}

/* Round trips between this process and a forked echo process. */
static int bench_rtt(const char *dir, bool handoff, int width, int n)
{
    const int warm = 1000, rounds = warm + n;
    char ep[256];
    wire_endpoint_ipc(ep, sizeof(ep), dir, handoff ? "hand" : "coord");
    if (handoff)
        ep[strlen(ep) - 5] = 0; /* drop ".sock": the echo side adds -a/-b */
    void *ctx = zmq_ctx_new();
    struct wire_socket *tx = NULL, *rx = NULL;
    char ep_a[300], ep_b[300];
    struct wire_socket_config sc = wire_socket_config_default();
    sc.spin_us = 200;
    if (!handoff) {
        rx = tx = wire_socket_create(ctx, ZMQ_ROUTER, &sc);
        wire_socket_bind(tx, ep);
    } else {
        snprintf(ep_a, sizeof(ep_a), "%s-a.sock", ep);
        snprintf(ep_b, sizeof(ep_b), "%s-b.sock", ep);
        rx = wire_socket_create(ctx, ZMQ_PULL, &sc);
        wire_socket_bind(rx, ep_b);
        tx = wire_socket_create(ctx, ZMQ_PUSH, NULL);
    }
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        bench_echo(ep, handoff ? ZMQ_PUSH : ZMQ_DEALER, width, rounds);
        _exit(0);
    }
    if (handoff)
        wire_socket_connect(tx, ep_a);
    float *row = calloc((size_t)width, sizeof(float));
    double *t = malloc(sizeof(double) * (size_t)n);
    uint32_t expert = 3, count = 1;
    char id[WIRE_ID_MAX];
    size_t id_len = 0;
    if (!handoff) { /* learn the peer: the first request goes after a hello-less wait */
        struct timespec ts = {0, 200000000};
        nanosleep(&ts, NULL);
    }
    int rc = 0;
    for (int r = 0; r < rounds && !rc; r++) {
        struct wire_msg m = {.type = handoff ? WIRE_TYPE_STEP : WIRE_TYPE_EXPERT_REQUEST};
        if (handoff)
            m.step = (struct wire_step){.n_tokens = 1, .step = (uint64_t)r, .n_embd = (uint32_t)width};
        else
            m.expert_request = (struct wire_expert_request){
                .step = (uint64_t)r, .layer = 0, .experts = &expert, .counts = &count,
                .n_experts = 1, .n_embd = (uint32_t)width};
        m.tensor = row;
        m.tensor_bytes = (size_t)width * sizeof(float);
        double t0 = bench_now();
        /* the ROUTER sends to the DEALER's id "w0"; the DEALER's reply comes back on it */
        rc = wire_send(tx, &m, handoff ? NULL : "w0", handoff ? 0 : 2);
        struct wire_msg back;
        id_len = sizeof(id);
        rc = rc ? rc : wire_recv(rx, &back, handoff ? NULL : id, handoff ? NULL : &id_len, 10000);
        if (!rc)
            wire_msg_free(&back);
        if (r >= warm)
            t[r - warm] = bench_now() - t0;
    }
    int st;
    waitpid(pid, &st, 0);
    if (!rc)
        bench_report(handoff ? "worker-to-worker hand-off (round trip)"
                             : "CPU-fallback request (8 KiB out, 8 KiB back)", t, n);
    else
        fprintf(stderr, "bench_ipc: round trip failed: %s\n", strerror(-rc));
    free(row);
    free(t);
    if (tx != rx)
        wire_socket_destroy(tx);
    wire_socket_destroy(rx);
    zmq_ctx_term(ctx);
    return rc;
}

/* CPU expert pool: every layer, top_k distinct experts x tokens rows each. */
static int bench_pool(const char *path, int threads, int tokens)
{
    struct gguf_config gc = {.path = path};
    struct gguf *g = gguf_open(&gc);
    struct arch_config ac = {.gguf = g};
    struct arch_model *m = g ? arch_load(&ac) : NULL;
    if (!m)
        return -EINVAL;
    gguf_prefault(g, false);
    const struct arch_hparams *hp = &m->hp;
    const uint32_t k = hp->n_expert_used;
    struct expert_pool_config pc = {.model = m, .n_threads = threads,
                                    .max_rows = k * (uint32_t)tokens};
    struct expert_pool *p = expert_pool_create(&pc);
    float *X = calloc((size_t)k * tokens * hp->n_embd, sizeof(float));
    float *Y = calloc((size_t)k * tokens * hp->n_embd, sizeof(float));
    uint32_t experts[64], counts[64];
    for (size_t i = 0; i < (size_t)k * tokens * hp->n_embd; i++)
        X[i] = (float)((i * 2654435761u) % 1000) / 1000.0f - 0.5f;
    const struct arch_layer *ly0 = &m->layers[0];
    const double per_expert = (double)ly0->down_exps.mat_bytes +
                              (ly0->gate_exps.data ? ly0->gate_exps.mat_bytes + ly0->up_exps.mat_bytes
                                                   : ly0->gate_up_exps.mat_bytes);
    double bytes = 0, t0 = 0;
    int rc = 0;
    for (int pass = 0; pass < 4 && !rc; pass++) {
        if (pass == 1) { /* pass 0 warms up */
            t0 = bench_now();
            bytes = 0;
        }
        for (uint32_t l = 0; l < hp->n_layer && !rc; l++) {
            for (uint32_t i = 0; i < k; i++) {
                experts[i] = (uint32_t)((i * 7 + l * 13 + pass * 29) % hp->n_expert);
                counts[i] = (uint32_t)tokens;
            }
            /* groups must be ascending and distinct */
            qsort(experts, k, sizeof(uint32_t), bench_cmp_u32);
            rc = expert_pool_run(p, l, experts, counts, k, X, Y);
            bytes += per_expert * k;
        }
    }
    double dt = bench_now() - t0;
    if (!rc)
        printf("CPU expert pool: %s, %d token(s) x top-%u per layer: %.2f GB/s of expert "
               "weights\n", path, tokens, k, bytes / dt / 1e9);
    free(X);
    free(Y);
    expert_pool_destroy(p);
    arch_free(m);
    gguf_close(g);
    return rc;
}

int main(int argc, char **argv)
{
    log_init("bench", -1);
    int n = 10000, width = 2048, threads = 0, tokens = 1;
    const char *model = NULL;
    for (int i = 1; i + 1 < argc; i += 2) {
        if (!strcmp(argv[i], "-n"))
            n = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "-w"))
            width = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "-m"))
            model = argv[i + 1];
        else if (!strcmp(argv[i], "-t"))
            threads = atoi(argv[i + 1]);
        else if (!strcmp(argv[i], "-b"))
            tokens = atoi(argv[i + 1]);
    }
    if (n < 100 || width < 1 || tokens < 1) {
        fprintf(stderr, "usage: bench_ipc [-n N>=100] [-w WIDTH] [-m MODEL] [-t THREADS] [-b TOKENS]\n");
        return 2;
    }
    char dir[WIRE_PATH_MAX];
    if (wire_rundir_create(NULL, dir, sizeof(dir)))
        return 1;
    int rc = bench_rtt(dir, false, width, n);
    rc = rc ? rc : bench_rtt(dir, true, width, n);
    wire_rundir_remove(dir);
    if (!rc && model)
        rc = bench_pool(model, threads, tokens);
    return rc ? 1 : 0;
}
