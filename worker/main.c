/*
 * lamina-worker: one process per device. It connects to the coordinator,
 * receives its load plan (layer range, resident experts, backend and memory
 * budget, where hidden states come from and go to), maps the shared-memory
 * expert stacks read-only, loads its layers onto its backend, and then runs
 * the steps it is sent: hidden states in, its layers, hidden states out to
 * the next worker (or logits to the coordinator from the last one, or only the token it
 * sampled from them when the step asks: model/sampler.h, sampler_sample_given). Experts
 * it does not hold go to the coordinator's CPU pool, one request per layer.
 *
 * Foreign experts (--experts-home any): the plan may give a worker experts of other workers'
 * layers (LoadPlan.foreign) to hold on its backend. The coordinator forwards their rows as an
 * ExpertRequest with a non-zero tag; the worker runs them and answers an ExpertReply with the
 * same tag, both when idle and while it waits for its own expert reply (two workers could
 * otherwise wait on each other with several sequences in flight).
 *
 *   lamina-worker --connect ENDPOINT --index N [--server-key Z85]
 *   lamina-worker --probe DEVICE
 *
 * --probe measures a device (worker/probe.h: cpu or cuda:N, a Q4_0 GEMV)
 * and prints one line with the figures in the form LAMINA_PROBE states them
 * (cuda:0=3400.0:53.0), for a coordinator whose workers run on other hosts
 * and so cannot probe their cards itself.
 *
 * Hand-off: hidden states go to the next worker over ZeroMQ (the Step message's tensor
 * frame), or, when the plan gives an NCCL pair id (consecutive CUDA workers of one host),
 * device to device with ncclSend/ncclRecv on the backend's stream (ipc/nccl.h). Then the
 * Step message still goes over ZeroMQ, without rows and flagged via_nccl, and it goes first:
 * the backend's send hook tells the next worker to start the step and only then enqueues the
 * send, because an NCCL send completes only once the receiver has posted its receive, which
 * it does when it runs that step (its recv hook). Both hooks then wait for the stream while
 * polling NCCL for asynchronous errors under a deadline; on an error or timeout the worker
 * aborts its communicators (SIGALRM ends it if the abort hangs) and exits non-zero, and the
 * coordinator, seeing the exit, ends the cluster.
 *
 * Sequences: the plan gives n_seq slots (a KV cache and DeltaNet state each, in the backend);
 * a Step's seq_id picks one, and steps of different sequences may follow each other in any
 * order. Steps are run one at a time in the order they arrive (FIFO); a Step or Reset from
 * the coordinator that arrives while a step waits for its expert replies is kept in a queue
 * and run after it, so the coordinator can keep several sequences' steps in flight: worker 0
 * runs sequence B's step while worker 1 runs sequence A's. Every worker receives a
 * sequence's steps in the order the coordinator sent them, which also keeps the NCCL sends
 * and receives of each pair matched one for one.
 *
 * Threads: the main thread owns the coordinator, input and output sockets
 * and all compute; a watchdog thread owns a second coordinator socket and
 * sends a heartbeat every WORKER_HEARTBEAT_MS carrying the layer progress
 * counter, so the coordinator can tell a slow step from a hung one.
 * A worker never talks to the user. It exits 0 on SHUTDOWN, non-zero on any
 * error (a failed step is reported to the coordinator first), and when its
 * coordinator goes away (parent-death signal for spawned workers; silence
 * for hand-started ones).
 */
#include <errno.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "common/check.h"
#include "common/log.h"
#include "ipc/nccl.h"
#include "ipc/shm.h"
#include "ipc/wire.h"
#include "model/arch.h"
#include "model/gguf.h"
#include "model/quant.h"
#include "model/sampler.h"
#include "worker/backend.h"
#include "worker/probe.h"

#define WORKER_HEARTBEAT_MS 250     /* watchdog heartbeat period */
#define WORKER_PLAN_TIMEOUT_MS 30000 /* hello -> load plan */
#define WORKER_IDLE_EXIT_MS 15000   /* no word from the coordinator for this long: exit */
#define WORKER_REPLY_TIMEOUT_MS 60000 /* expert reply wait */
#define WORKER_NCCL_INIT_TIMEOUT_S 900.0 /* the NCCL peer joins once it has loaded (as READY) */
#define WORKER_NCCL_STEP_TIMEOUT_S 300.0 /* an NCCL hand-off (with the layers before it) */
#define WORKER_ABORT_DEADLINE_S 10       /* ncclCommAbort or teardown after it may hang: SIGALRM */
#define WORKER_QUEUE_MAX (4 * WIRE_SEQ_MAX) /* coordinator messages held back during a step */

_Static_assert(WIRE_NCCL_ID_BYTES == NCCL_COMM_ID_BYTES, "NCCL unique id size");

struct worker_args {
    const char *connect;     /* coordinator endpoint */
    int index;               /* worker index */
    const char *server_key;  /* CURVE server public key (Z85), for tcp:// */
    const char *probe;       /* --probe DEVICE: measure it, print, exit */
};

struct worker {
    struct worker_args args;
    void *zctx;
    struct wire_socket *coord;     /* DEALER to the coordinator */
    struct wire_socket *in;        /* PULL from the previous worker, or NULL */
    struct wire_socket *out;       /* PUSH to the next worker, or NULL */
    struct wire_keypair keys;      /* own CURVE keys (tcp only) */
    uint8_t server_key[WIRE_KEY_BYTES];
    bool curve;
    /* plan */
    uint32_t l0, l1, n_ctx, max_batch;
    bool is_last;
    bool device_argmax;            /* greedy steps take backend_argmax (LAMINA_DEVICE_ARGMAX) */
    struct gguf *g;
    struct arch_model *m;
    struct shm_segment *shm;
    struct expert_ref **src;       /* per model layer: refs into shm */
    uint8_t **resident;            /* per model layer bitmaps */
    uint8_t **foreign;             /* per model layer: foreign experts held, or NULL */
    bool has_foreign;              /* any */
    float *serve_y;                /* output rows of a forwarded request */
    uint64_t served_req, served_rows;  /* forwarded requests answered, and their rows */
    uint64_t served_rows_prev;     /* served_rows at the previous timing line */
    uint64_t served_waiting;       /* of served_req, answered while waiting for its own */
    bool *trunk_on, *shexp_on;     /* per model layer: placed on the device (plan) */
    struct backend *be;
    float *h, *logits;
    struct sampler *smp;           /* last worker: samples when a step asks, or NULL */
    struct sampler_config smp_cfg; /* the values smp was made with */
    struct nccl_lib *nccl;         /* NCCL, when the plan hands hidden states over it */
    struct nccl_comm *nccl_prev;   /* pair with the previous worker (we receive), or NULL */
    struct nccl_comm *nccl_next;   /* pair with the next worker (we send), or NULL */
    const struct wire_step *cur;   /* the step being run: borrowed for backend_layers */
    enum { WORKER_HEAD_NONE, WORKER_HEAD_ID, WORKER_HEAD_LOGITS } head; /* what the step's
                                      backend_layers_head left: head_id or w->logits, or none */
    int32_t head_id;
    bool announced;                /* the next worker was sent cur (NCCL hand-off) */
    double nccl_send_ms;           /* this step: GPU time of the NCCL sends */
    double nccl_recv_ms;           /* this step: GPU time of the NCCL receives */
    uint64_t nccl_bytes;           /* this step: bytes sent over NCCL */
    /* state */
    uint64_t seq_no;
    uint64_t step;                 /* step being run */
    uint32_t n_seq;                /* sequence slots of the plan */
    uint32_t *pos;                 /* per slot: next position of its sequence */
    struct wire_msg *queue;        /* coordinator messages that came during a step, FIFO ring
                                      of WORKER_QUEUE_MAX, owned until run */
    uint32_t q_head, q_len;
    char device[32];               /* backend name for timing lines ("cpu", "cuda:0") */
    uint32_t pending_layer, pending_rows;
    double last_coord;             /* time of the last message from the coordinator */
    volatile uint64_t progress;    /* layers run (watchdog) */
    atomic_int stop;               /* tells the watchdog to end */
    pthread_mutex_t stop_mu;       /* with stop_cv: wakes the watchdog's sleep at the end */
    pthread_cond_t stop_cv;
    pthread_t watchdog;
    bool watchdog_started;
    struct forward_stats prev;     /* stats at the end of the previous step */
};

static double worker_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static struct wire_socket_config worker_sock_cfg(struct worker *w, const char *id)
{
    struct wire_socket_config c = wire_socket_config_default();
    c.routing_id = id;
    c.send_timeout_ms = 5000;
    c.spin_us = id && id[0] == 'w' ? 100 : 0; /* expert replies and steps come back fast */
    if (w->curve) {
        c.curve_keys = &w->keys;
        c.curve_server_key = w->server_key;
    }
    return c;
}

static int worker_send(struct worker *w, struct wire_socket *s, struct wire_msg *m)
{
    m->seq_no = ++w->seq_no;
    return wire_send(s, m, NULL, 0);
}

static void worker_report_error(struct worker *w, int code, const char *what)
{
    struct wire_msg m = {.type = WIRE_TYPE_ERROR};
    m.error = (struct wire_error){.code = code, .message = what,
                                  .worker_index = (uint32_t)w->args.index, .step = w->step};
    worker_send(w, w->coord, &m);
}

/* ---- watchdog ---- */

static void *worker_watchdog(void *arg)
{
    struct worker *w = arg;
    char id[16];
    snprintf(id, sizeof(id), "h%d", w->args.index);
    struct wire_socket_config c = worker_sock_cfg(w, id);
    struct wire_socket *s = wire_socket_create(w->zctx, ZMQ_DEALER, &c);
    if (!s || wire_socket_connect(s, w->args.connect)) {
        wire_socket_destroy(s);
        return NULL;
    }
    uint64_t seq = 0;
    pthread_mutex_lock(&w->stop_mu);
    while (!atomic_load(&w->stop)) {
        pthread_mutex_unlock(&w->stop_mu);
        struct wire_msg m = {.type = WIRE_TYPE_HEARTBEAT, .seq_no = ++seq};
        m.heartbeat.step = __atomic_load_n(&w->progress, __ATOMIC_RELAXED);
        wire_send(s, &m, NULL, 0);
        /* until the next beat, or at once when the worker ends (a plain sleep held every
         * worker's exit back by up to a period) */
        struct timespec until;
        clock_gettime(CLOCK_MONOTONIC, &until);
        until.tv_nsec += WORKER_HEARTBEAT_MS * 1000000L;
        until.tv_sec += until.tv_nsec / 1000000000L;
        until.tv_nsec %= 1000000000L;
        pthread_mutex_lock(&w->stop_mu);
        while (!atomic_load(&w->stop) &&
               pthread_cond_timedwait(&w->stop_cv, &w->stop_mu, &until) != ETIMEDOUT)
            ;
    }
    pthread_mutex_unlock(&w->stop_mu);
    wire_socket_destroy(s);
    return NULL;
}

/* ---- remote experts ---- */

static int worker_submit(void *ctx, uint32_t layer, const uint32_t *experts,
                         const uint32_t *counts, uint32_t n_groups, const float *X,
                         uint32_t n_rows)
{
    struct worker *w = ctx;
    struct wire_msg m = {.type = WIRE_TYPE_EXPERT_REQUEST};
    m.expert_request = (struct wire_expert_request){
        .step = w->step, .layer = layer, .experts = experts, .counts = counts,
        .n_experts = n_groups, .n_embd = w->m->hp.n_embd};
    m.tensor = X;
    m.tensor_bytes = (size_t)n_rows * w->m->hp.n_embd * sizeof(float);
    w->pending_layer = layer;
    w->pending_rows = n_rows;
    int rc = worker_send(w, w->coord, &m);
    if (rc)
        log_error("cannot send the expert request of layer %u to the coordinator: %s", layer,
                  strerror(-rc));
    return rc;
}

/* Answers a forwarded request for foreign experts (tag != 0) with the same tag. Checks what
 * the wire could not: the layer and experts are foreign experts this worker holds, the width
 * is the model's. Returns 0 or an errno (logged; reported to the coordinator by the caller). */
static int worker_serve(struct worker *w, const struct wire_msg *m)
{
    const struct wire_expert_request *r = &m->expert_request;
    const uint32_t n_embd = w->m->hp.n_embd;
    if (!r->tag || r->layer >= w->m->hp.n_layer || !w->foreign || !w->foreign[r->layer] ||
        r->n_embd != n_embd) {
        log_error("forwarded expert request (tag %llu) for layer %u, width %u: this worker holds "
                  "no foreign experts of that layer, or the width is not %u",
                  (unsigned long long)r->tag, r->layer, r->n_embd, n_embd);
        return -EPROTO;
    }
    const uint32_t rows = (uint32_t)(m->tensor_bytes / (n_embd * sizeof(float)));
    int rc = backend_serve(w->be, r->layer, r->experts, r->counts, (uint32_t)r->n_experts,
                           m->tensor, w->serve_y);
    if (rc)
        return rc;
    struct wire_msg o = {.type = WIRE_TYPE_EXPERT_REPLY};
    o.expert_reply = (struct wire_expert_reply){.step = r->step, .layer = r->layer,
                                                .n_rows = rows, .n_embd = n_embd, .tag = r->tag};
    o.tensor = w->serve_y;
    o.tensor_bytes = m->tensor_bytes;
    rc = worker_send(w, w->coord, &o);
    if (rc) {
        log_error("cannot send the reply to forwarded request %llu: %s",
                  (unsigned long long)r->tag, strerror(-rc));
        return rc;
    }
    w->served_req++;
    w->served_rows += rows;
    return 0;
}

/* worker_serve, reporting a failure to the coordinator (which fails the step naming us).
 * A request that does not fit the plan (-EPROTO, -EINVAL) is answered with that error and the
 * worker goes on; a backend or socket failure ends it. */
static int worker_serve_report(struct worker *w, const struct wire_msg *m)
{
    int rc = worker_serve(w, m);
    if (rc) {
        char what[160];
        snprintf(what, sizeof(what), "serving foreign experts of layer %u (forwarded request "
                 "%llu) failed: %s", m->expert_request.layer,
                 (unsigned long long)m->expert_request.tag, strerror(-rc));
        worker_report_error(w, rc, what);
    }
    return rc == -EPROTO || rc == -EINVAL ? 0 : rc;
}

/* Keeps a coordinator message that came during a step (taking over *m, which is zeroed) for
 * the main loop to run after it. -EPROTO (logged) when WORKER_QUEUE_MAX are waiting already:
 * the coordinator keeps at most one step per sequence in flight. */
static int worker_defer(struct worker *w, struct wire_msg *m)
{
    if (w->q_len == WORKER_QUEUE_MAX) {
        log_error("%u messages from the coordinator wait behind step %llu: dropping a %s",
                  w->q_len, (unsigned long long)w->step, wire_msg_type_name(m->type));
        wire_msg_free(m);
        return -EPROTO;
    }
    w->queue[(w->q_head + w->q_len++) % WORKER_QUEUE_MAX] = *m;
    *m = (struct wire_msg){0};
    return 0;
}

static int worker_collect(void *ctx, uint32_t layer, float *Y, uint32_t n_rows)
{
    struct worker *w = ctx;
    double deadline = worker_now() + WORKER_REPLY_TIMEOUT_MS / 1000.0;
    while (worker_now() < deadline) {
        struct wire_msg m;
        int rc = wire_recv(w->coord, &m, NULL, NULL, 1000);
        if (rc == -ETIMEDOUT || rc == -EPROTO)
            continue;
        if (rc)
            return rc;
        w->last_coord = worker_now();
        if (m.type == WIRE_TYPE_EXPERT_REPLY && m.expert_reply.step == w->step &&
            m.expert_reply.layer == layer && m.expert_reply.n_rows == n_rows &&
            m.expert_reply.n_embd == w->m->hp.n_embd) {
            memcpy(Y, m.tensor, m.tensor_bytes);
            wire_msg_free(&m);
            return 0;
        }
        if (m.type == WIRE_TYPE_STEP || m.type == WIRE_TYPE_RESET || m.type == WIRE_TYPE_STATE) {
            rc = worker_defer(w, &m); /* the next sequence's step: after this one */
            if (rc)
                return rc;
            continue;
        }
        if (m.type == WIRE_TYPE_EXPERT_REQUEST && w->has_foreign) { /* a peer's: answer now */
            const uint64_t before = w->served_req;
            rc = worker_serve_report(w, &m);
            w->served_waiting += w->served_req - before;
            wire_msg_free(&m);
            if (rc)
                return rc;
            continue;
        }
        enum wire_type t = m.type;
        wire_msg_free(&m);
        if (t == WIRE_TYPE_SHUTDOWN) {
            log_info("shutdown received during step %llu", (unsigned long long)w->step);
            return -ECANCELED;
        }
        if (t == WIRE_TYPE_ERROR) {
            log_error("coordinator failed the expert request of layer %u", layer);
            return -EIO;
        }
        if (t != WIRE_TYPE_HEARTBEAT)
            log_warn("dropping a %s message while waiting for experts of layer %u",
                     wire_msg_type_name(t), layer);
    }
    log_error("no expert reply for layer %u of step %llu within %d ms", layer,
              (unsigned long long)w->step, WORKER_REPLY_TIMEOUT_MS);
    return -ETIMEDOUT;
}

/* ---- NCCL hand-off ---- */

/* After an NCCL or CUDA failure in a hand-off: aborts both communicators (the peers see the
 * coordinator end the cluster), with SIGALRM as the hard deadline behind an abort that hangs. */
static int worker_nccl_fail(struct worker *w, int rc)
{
    alarm(WORKER_ABORT_DEADLINE_S);
    nccl_comm_abort(w->nccl_prev);
    nccl_comm_abort(w->nccl_next);
    alarm(0);
    return rc == -ETIMEDOUT ? rc : -EIO;
}

/* Backend hook (backend_handoff.send), once per pass: the first call of a step sends the Step
 * message, flagged via_nccl, to the next worker, so that it starts the step and posts its
 * receive; then the send is enqueued on the backend's stream, after this pass's layers, and
 * the stream is waited for. */
static int worker_nccl_send(void *ctx, const void *d_buf, size_t bytes, void *stream)
{
    struct worker *w = ctx;
    if (!w->nccl_next || !w->cur) {
        log_error("nccl send hook called with no communicator or step");
        return -EIO;
    }
    if (!w->announced) {
        struct wire_msg o = {.type = WIRE_TYPE_STEP};
        o.step = *w->cur;
        o.step.via_nccl = true;
        int rc = worker_send(w, w->out, &o);
        if (rc) {
            log_error("cannot tell the next worker to start step %llu: %s",
                      (unsigned long long)w->cur->step, strerror(-rc));
            return rc;
        }
        w->announced = true;
    }
    int rc = nccl_comm_send(w->nccl_next, d_buf, bytes, stream);
    rc = rc ? rc : nccl_comm_wait(w->nccl_next, stream, WORKER_NCCL_STEP_TIMEOUT_S);
    if (rc)
        return worker_nccl_fail(w, rc);
    w->nccl_send_ms += nccl_comm_last_ms(w->nccl_next);
    w->nccl_bytes += bytes;
    return 0;
}

/* Backend hook (backend_handoff.recv), once per pass: posts the receive of this pass's rows
 * on the backend's stream and waits until they have arrived, so that a sender that died
 * ends in a deadline here rather than in the backend's stream synchronization. */
static int worker_nccl_recv(void *ctx, void *d_buf, size_t bytes, void *stream)
{
    struct worker *w = ctx;
    if (!w->nccl_prev) {
        log_error("nccl receive hook called with no communicator");
        return -EIO;
    }
    int rc = nccl_comm_recv(w->nccl_prev, d_buf, bytes, stream);
    rc = rc ? rc : nccl_comm_wait(w->nccl_prev, stream, WORKER_NCCL_STEP_TIMEOUT_S);
    if (rc)
        return worker_nccl_fail(w, rc);
    w->nccl_recv_ms += nccl_comm_last_ms(w->nccl_prev);
    return 0;
}

/* Joins the NCCL pairs of the plan, the previous one first: each waits for its peer, and in
 * this order the chain of workers joins without a cycle. The backend's device is current. */
static int worker_nccl_join(struct worker *w, const struct wire_load_plan *p)
{
    char name[64];
    struct nccl_comm_config cc = {.lib = w->nccl, .init_timeout_s = WORKER_NCCL_INIT_TIMEOUT_S,
                                  .name = name};
    if (p->has_nccl_prev) {
        snprintf(name, sizeof(name), "worker %d -> %d", w->args.index - 1, w->args.index);
        cc.id = p->nccl_prev_id;
        cc.rank = NCCL_COMM_RANK_RECEIVER;
        w->nccl_prev = nccl_comm_create(&cc);
        if (!w->nccl_prev)
            return -EIO;
    }
    if (p->has_nccl_next) {
        snprintf(name, sizeof(name), "worker %d -> %d", w->args.index, w->args.index + 1);
        cc.id = p->nccl_next_id;
        cc.rank = NCCL_COMM_RANK_SENDER;
        w->nccl_next = nccl_comm_create(&cc);
        if (!w->nccl_next)
            return -EIO;
    }
    return 0;
}

/* The hooks of the plan's NCCL pairs, after loading NCCL; refused on a backend without
 * device memory. */
static int worker_nccl_hooks(struct worker *w, const struct wire_load_plan *p, const char *kind,
                             struct backend_handoff *ho)
{
    if (!p->has_nccl_prev && !p->has_nccl_next)
        return 0;
    if (strcmp(kind, "cuda")) {
        log_error("load plan: hidden states over NCCL, but this worker's device is %s",
                  p->backend);
        return -EPROTO;
    }
    if (p->has_nccl_prev && p->layer_begin == 0) {
        log_error("load plan: the first worker has an NCCL pair with a previous one");
        return -EPROTO;
    }
    w->nccl = nccl_lib_open(false);
    if (!w->nccl)
        return -ENOTSUP;
    *ho = (struct backend_handoff){.recv = p->has_nccl_prev ? worker_nccl_recv : NULL,
                                   .send = p->has_nccl_next ? worker_nccl_send : NULL, .ctx = w};
    return 0;
}

/* ---- load plan ---- */

static int worker_build_refs(struct worker *w)
{
    const uint32_t E = w->m->hp.n_expert, L = w->m->hp.n_layer;
    w->src = calloc(L, sizeof(*w->src));
    if (!w->src)
        return -ENOMEM;
    for (uint32_t l = 0; l < L; l++) {
        if ((l < w->l0 || l >= w->l1) && !(w->foreign && w->foreign[l]))
            continue;
        w->src[l] = calloc(E, sizeof(struct expert_ref));
        if (!w->src[l])
            return -ENOMEM;
        int rc = expert_exec_shm_refs(w->shm, l, E, w->src[l]);
        if (rc)
            return rc;
    }
    return 0;
}

static int worker_build_residency(struct worker *w, const struct wire_load_plan *p)
{
    const uint32_t E = w->m->hp.n_expert, L = w->m->hp.n_layer;
    w->resident = calloc(L, sizeof(*w->resident));
    w->trunk_on = calloc(L, sizeof(bool));
    w->shexp_on = calloc(L, sizeof(bool));
    if (!w->resident || !w->trunk_on || !w->shexp_on)
        return -ENOMEM;
    for (size_t i = 0; i < p->n_residency; i++) {
        const struct wire_layer_residency *r = &p->residency[i];
        if (r->bitmap_bytes != (E + 7) / 8) {
            log_error("load plan: residency bitmap of layer %u has %zu bytes, expected %u",
                      r->layer, r->bitmap_bytes, (E + 7) / 8);
            return -EPROTO;
        }
        if (r->layer < w->l0 || r->layer >= w->l1) {
            log_error("load plan: residency of layer %u outside layers %u-%u", r->layer, w->l0,
                      w->l1 - 1);
            return -EPROTO;
        }
        w->trunk_on[r->layer] = r->trunk;
        w->shexp_on[r->layer] = r->shexp;
        w->resident[r->layer] = malloc(r->bitmap_bytes);
        if (!w->resident[r->layer])
            return -ENOMEM;
        memcpy(w->resident[r->layer], r->bitmap, r->bitmap_bytes);
    }
    w->foreign = calloc(L, sizeof(*w->foreign));
    if (!w->foreign)
        return -ENOMEM;
    for (size_t i = 0; i < p->n_foreign; i++) { /* wire.c checked the layers */
        const struct wire_layer_residency *r = &p->foreign[i];
        if (r->bitmap_bytes != (E + 7) / 8 || r->layer >= L ||
            (r->layer >= w->l0 && r->layer < w->l1)) {
            log_error("load plan: foreign experts of layer %u: bitmap of %zu bytes (expected "
                      "%u), or a layer of this worker's range %u-%u", r->layer, r->bitmap_bytes,
                      (E + 7) / 8, w->l0, w->l1 - 1);
            return -EPROTO;
        }
        if (E % 8 && r->bitmap[E / 8] >> (E % 8)) {
            log_error("load plan: foreign bitmap of layer %u names experts past %u", r->layer,
                      E - 1);
            return -EPROTO;
        }
        w->foreign[r->layer] = malloc(r->bitmap_bytes);
        if (!w->foreign[r->layer])
            return -ENOMEM;
        memcpy(w->foreign[r->layer], r->bitmap, r->bitmap_bytes);
        w->has_foreign = true;
    }
    return 0;
}

static int worker_check_plan(struct worker *w, const struct wire_load_plan *p)
{
    const struct arch_hparams *hp = &w->m->hp;
    if (p->n_layers_total != hp->n_layer || p->n_embd != hp->n_embd ||
        p->n_vocab != hp->n_vocab) {
        log_error("load plan does not match %s: plan has %u layers, width %u, vocab %u; file "
                  "has %u, %u, %u", p->model_path, p->n_layers_total, p->n_embd, p->n_vocab,
                  hp->n_layer, hp->n_embd, hp->n_vocab);
        return -EPROTO;
    }
    if (p->max_batch == 0 || p->max_batch > 65536 || p->n_ctx == 0 || p->n_ctx > (1u << 24)) {
        log_error("load plan: max_batch %u or n_ctx %u out of range", p->max_batch, p->n_ctx);
        return -EPROTO;
    }
    return 0;
}

static int worker_load(struct worker *w, const struct wire_load_plan *p)
{
    w->l0 = p->layer_begin;
    w->l1 = p->layer_end;
    w->n_ctx = p->n_ctx;
    w->max_batch = p->max_batch;
    w->is_last = p->is_last;
    const char *da = getenv("LAMINA_DEVICE_ARGMAX");
    w->device_argmax = !(da && !strcmp(da, "0"));
    w->n_seq = p->n_seq ? p->n_seq : 1;
    w->pos = calloc(w->n_seq, sizeof(*w->pos));
    w->queue = calloc(WORKER_QUEUE_MAX, sizeof(*w->queue));
    if (!w->pos || !w->queue)
        return -ENOMEM;
    struct gguf_config gc = {.path = p->model_path};
    w->g = gguf_open(&gc);
    struct arch_config ac = {.gguf = w->g};
    w->m = w->g ? arch_load(&ac) : NULL;
    if (!w->m)
        return -EINVAL;
    int rc = worker_check_plan(w, p);
    if (rc)
        return rc;
    w->shm = shm_open_ro(p->shm_name, shm_model_hash(w->g));
    if (!w->shm)
        return -EPROTO;
    rc = worker_build_residency(w, p);
    rc = rc ? rc : worker_build_refs(w);
    if (rc)
        return rc;
    struct backend_config bc = {
        .model = w->m, .layer_begin = w->l0, .layer_end = w->l1,
        .device_mem = p->device_mem_budget, .n_threads = (int)p->n_threads, .n_ctx = p->n_ctx,
        .kv_f16 = p->kv_f16, .max_batch = p->max_batch, .n_seq = p->n_seq,
        .resident = (const uint8_t *const *)w->resident,
        .trunk_on_device = w->trunk_on, .shexp_on_device = w->shexp_on, .lmhead = p->lmhead,
        .foreign = w->has_foreign ? (const uint8_t *const *)w->foreign : NULL,
        .expert_src = (const struct expert_ref *const *)w->src,
        .remote = {.ctx = w, .submit = worker_submit, .collect = worker_collect},
        .progress = &w->progress, .fail = getenv("LAMINA_FAIL")};
    const char *st = getenv("LAMINA_CUDA_STAGE_TIMES"); /* GPU stage times in the timing lines */
    bc.stage_times = st && !strcmp(st, "1");
    char want[16];
    snprintf(want, sizeof(want), "%d:", w->args.index);
    if (bc.fail && strncmp(bc.fail, want, strlen(want)) == 0)
        bc.fail += strlen(want); /* "INDEX:kind:N" targets one worker */
    else if (bc.fail && strchr(bc.fail, ':') != strrchr(bc.fail, ':'))
        bc.fail = NULL;
    snprintf(w->device, sizeof(w->device), "%s", p->backend);
    const char *kind = p->backend;
    if (!strncmp(kind, "cuda:", 5)) { /* the card, in PCI bus order as nvidia-smi numbers it */
        setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID", 1);
        setenv("LAMINA_CUDA_DEVICE", kind + 5, 1);
        kind = "cuda";
    }
    rc = worker_nccl_hooks(w, p, kind, &bc.handoff);
    if (rc)
        return rc;
    w->be = backend_create(kind, &bc);
    if (!w->be)
        return -ENOMEM;
    rc = worker_nccl_join(w, p);
    if (rc)
        return rc;
    if (w->has_foreign) {
        w->serve_y = malloc((size_t)w->be->serve_max_rows * w->m->hp.n_embd * sizeof(float));
        if (!w->serve_y)
            return -ENOMEM;
    }
    w->h = malloc((size_t)p->max_batch * w->m->hp.n_embd * sizeof(float));
    /* the last worker's logits come back from its backend: page-locked there (a GPU's copies
     * go straight into it); the others never fill it, so plain memory, never touched */
    w->logits = backend_host_alloc(w->is_last ? w->be : NULL,
                                   (size_t)p->max_batch * w->m->hp.n_vocab * sizeof(float));
    return w->h && w->logits ? 0 : -ENOMEM;
}

static int worker_connect_data(struct worker *w, const struct wire_load_plan *p)
{
    struct wire_socket_config c = worker_sock_cfg(w, NULL);
    c.send_timeout_ms = 30000;
    if (p->listen_endpoint[0]) {
        struct wire_socket_config ci = wire_socket_config_default();
        ci.spin_us = 100;
        if (w->curve) {
            ci.curve_keys = &w->keys;
            ci.curve_server = true;
        }
        w->in = wire_socket_create(w->zctx, ZMQ_PULL, &ci);
        if (!w->in || wire_socket_bind(w->in, p->listen_endpoint))
            return -EIO;
    }
    if (p->next_endpoint[0]) {
        if (w->curve && !p->has_next_key) {
            log_error("load plan: the next worker at %s has no CURVE key", p->next_endpoint);
            return -EPROTO;
        }
        if (w->curve)
            c.curve_server_key = p->next_server_key;
        w->out = wire_socket_create(w->zctx, ZMQ_PUSH, &c);
        if (!w->out || wire_socket_connect(w->out, p->next_endpoint))
            return -EIO;
    }
    return 0;
}

/* Hello, plan, load, ready. */
static int worker_start(struct worker *w)
{
    struct wire_msg m = {.type = WIRE_TYPE_HELLO};
    m.hello = (struct wire_hello){.worker_index = (uint32_t)w->args.index,
                                  .pid = (uint32_t)getpid(), .device = "host",
                                  .has_curve_key = w->curve};
    if (w->curve) /* the key of the data socket this worker may listen on */
        memcpy(m.hello.curve_public_key, w->keys.public_key, WIRE_KEY_BYTES);
    int rc = worker_send(w, w->coord, &m);
    if (rc) {
        log_error("cannot reach the coordinator at %s: %s", w->args.connect, strerror(-rc));
        return rc;
    }
    struct wire_msg plan;
    do {
        rc = wire_recv(w->coord, &plan, NULL, NULL, WORKER_PLAN_TIMEOUT_MS);
    } while (rc == -EPROTO || (!rc && plan.type == WIRE_TYPE_HEARTBEAT && (wire_msg_free(&plan), 1)));
    if (rc || plan.type != WIRE_TYPE_LOAD_PLAN) {
        log_error("no load plan from the coordinator (%s)",
                  rc ? strerror(-rc) : wire_msg_type_name(plan.type));
        wire_msg_free(&plan);
        return rc ? rc : -EPROTO;
    }
    rc = worker_load(w, &plan.load_plan);
    rc = rc ? rc : worker_connect_data(w, &plan.load_plan);
    wire_msg_free(&plan);
    if (rc) {
        worker_report_error(w, rc, "loading the plan failed (see the worker's log)");
        return rc;
    }
    struct wire_msg r = {.type = WIRE_TYPE_READY};
    r.ready = (struct wire_ready){.device_mem_used = w->be->mem_used,
                                  .resident_experts = w->be->resident_experts};
    log_info("layers %u-%u loaded: %u experts resident (%u of them foreign), %.1f MiB of device "
             "memory", w->l0, w->l1 - 1, w->be->resident_experts, w->be->foreign_experts,
             w->be->mem_used / 1048576.0);
    return worker_send(w, w->coord, &r);
}

/* ---- steps ---- */

/* The worker's timing line of a step (docs/timings.md). handoff: ZeroMQ, the send of the
 * step's rows to the next worker (as in send); NCCL, the GPU time of the sends. handoff_in:
 * the GPU time of the NCCL receives (with the wait for the previous worker's layers). */
static void worker_send_timing(struct worker *w, const struct wire_step *st, double recv_wait,
                               double send_s, double total_s, uint64_t sent)
{
    const struct forward_stats *s = backend_stats(w->be);
    const struct forward_stats *p = &w->prev;
    const char *via = w->is_last ? "none" : w->nccl_next ? "nccl" : "zmq";
    const double handoff_ms = w->is_last ? 0.0 : w->nccl_next ? w->nccl_send_ms : 1e3 * send_s;
    char json[1024];
    snprintf(json, sizeof(json),
             "{\"worker\":%d,\"device\":\"%s\",\"step\":%llu,\"seq\":%llu,\"tokens\":%u,"
             "\"layers\":[%u,%u],\"handoff_via\":\"%s\",\"ms\":{\"attn\":%.3f,"
             "\"deltanet\":%.3f,\"router\":%.3f,\"experts_gpu\":%.3f,\"experts_page_in\":0,"
             "\"experts_cpu_wait\":%.3f,\"shared_expert\":%.3f,\"send\":%.3f,"
             "\"recv_wait\":%.3f,\"total\":%.3f,\"handoff\":%.3f,\"handoff_in\":%.3f},"
             "\"experts\":{\"hit\":%llu,\"paged\":0,\"in_place\":0,\"cpu\":%llu,"
             "\"served\":%llu},"
             "\"bytes\":{\"h2d\":0,\"nccl\":%llu,\"sent\":%llu}}",
             w->args.index, w->device, (unsigned long long)st->step, (unsigned long long)st->seq_id,
             st->n_tokens, w->l0, w->l1, via, 1e3 * (s->attn - p->attn),
             1e3 * (s->deltanet - p->deltanet), 1e3 * (s->router - p->router),
             1e3 * (s->experts - p->experts), 1e3 * (s->remote_wait - p->remote_wait),
             1e3 * (s->shared_expert - p->shared_expert), 1e3 * send_s, 1e3 * recv_wait,
             1e3 * total_s, handoff_ms, w->nccl_recv_ms,
             (unsigned long long)(s->expert_rows - p->expert_rows),
             (unsigned long long)(s->remote_rows - p->remote_rows),
             (unsigned long long)(w->served_rows - w->served_rows_prev),
             (unsigned long long)w->nccl_bytes, (unsigned long long)sent);
    w->prev = *s;
    w->served_rows_prev = w->served_rows;
    struct wire_msg m = {.type = WIRE_TYPE_TIMING};
    m.timing.json = json;
    worker_send(w, w->coord, &m);
}

static int worker_check_step(struct worker *w, const struct wire_msg *m)
{
    const struct wire_step *st = &m->step;
    if (st->n_embd != w->m->hp.n_embd || st->n_tokens == 0 || st->n_tokens > w->max_batch ||
        (uint64_t)st->pos + st->n_tokens > w->n_ctx) {
        log_error("step %llu rejected: %u tokens of width %u at position %u (batch %u, width "
                  "%u, context %u)", (unsigned long long)st->step, st->n_tokens, st->n_embd,
                  st->pos, w->max_batch, w->m->hp.n_embd, w->n_ctx);
        return -EPROTO;
    }
    if (st->seq_id >= w->n_seq) {
        log_error("step %llu rejected: sequence %llu out of range, the plan has %u sequence "
                  "slot%s (0-%u)", (unsigned long long)st->step, (unsigned long long)st->seq_id,
                  w->n_seq, w->n_seq == 1 ? "" : "s", w->n_seq - 1);
        return -EINVAL;
    }
    return 0;
}

/* Samples the logits of the step's last row (w->logits, on the host for every backend) with
 * the coordinator's sampler values, uniform and window, into *id. The sampler is remade when
 * the values change (once per run in practice). */
static int worker_sample(struct worker *w, const struct wire_step *st, int32_t *id)
{
    const struct sampler_config sc = {.temperature = st->temperature, .top_k = st->top_k,
                                      .top_p = st->top_p, .min_p = st->min_p,
                                      .repeat_penalty = st->repeat_penalty,
                                      .presence_penalty = st->presence_penalty};
    const struct sampler_config *o = &w->smp_cfg;
    if (!w->smp || sc.temperature != o->temperature || sc.top_k != o->top_k ||
        sc.top_p != o->top_p || sc.min_p != o->min_p || sc.repeat_penalty != o->repeat_penalty ||
        sc.presence_penalty != o->presence_penalty) {
        sampler_destroy(w->smp);
        w->smp = sampler_create(&sc); /* the values were checked on receipt */
        if (!w->smp)
            return -ENOMEM;
        w->smp_cfg = sc;
    }
    int32_t r = sampler_sample_given(w->smp, w->logits, (int32_t)w->m->hp.n_vocab, st->uniform,
                                     st->window, st->n_window);
    if (r < 0)
        return r;
    *id = r;
    return 0;
}

/* Whether the last worker picks step st's token as the arg-max of one row's logits where
 * they are (greedy without penalties, LAMINA_DEVICE_ARGMAX not 0). */
static bool worker_greedy_here(const struct worker *w, const struct wire_step *st)
{
    return st->sample && !st->all_logits && st->temperature == 0 && st->repeat_penalty == 1 &&
           st->presence_penalty == 0 && w->device_argmax;
}

/* Hands the hidden states on, or (last worker) computes the logits, samples them when the
 * step asks, and fills *res (the token alone, or the logits) for the caller to send after its
 * timing line. */
static int worker_finish_step(struct worker *w, const struct wire_step *st, struct wire_msg *res)
{
    const size_t n = w->m->hp.n_embd;
    if (!w->is_last && w->nccl_next) { /* the send hook has handed the rows on */
        if (!w->announced) {
            log_error("step %llu: the backend never handed its rows to the NCCL send hook",
                      (unsigned long long)st->step);
            return -EIO;
        }
        return 0;
    }
    if (!w->is_last) {
        struct wire_msg o = {.type = WIRE_TYPE_STEP};
        o.step = *st;
        o.tensor = w->h;
        o.tensor_bytes = (size_t)st->n_tokens * n * sizeof(float);
        return worker_send(w, w->out, &o);
    }
    const uint32_t rows = st->all_logits ? st->n_tokens : 1;
    const float *hr = w->h + (size_t)(st->n_tokens - rows) * n;
    /* greedy without penalties: the arg-max where the logits are (a CUDA worker brings
     * back 4 bytes instead of the vocabulary's logits) */
    if (worker_greedy_here(w, st)) {
        int32_t id = w->head_id;
        int rc = w->head == WORKER_HEAD_ID ? 0 : backend_argmax(w->be, hr, 1, &id);
        if (rc != -ENOTSUP) {
            if (rc)
                return rc;
            *res = (struct wire_msg){.type = WIRE_TYPE_RESULT};
            res->result = (struct wire_result){.seq_id = st->seq_id, .step = st->step,
                                               .n_rows = 0, .n_vocab = w->m->hp.n_vocab,
                                               .token = id};
            return 0;
        }
    }
    int rc = w->head == WORKER_HEAD_LOGITS ? 0 : backend_logits(w->be, hr, rows, w->logits);
    if (rc)
        return rc;
    *res = (struct wire_msg){.type = WIRE_TYPE_RESULT};
    res->result = (struct wire_result){.seq_id = st->seq_id, .step = st->step, .n_rows = rows,
                                       .n_vocab = w->m->hp.n_vocab, .token = -1};
    if (st->sample) {
        int32_t id = 0;
        rc = worker_sample(w, st, &id);
        if (rc)
            return rc;
        res->result.n_rows = 0;
        res->result.token = id;
        return 0;
    }
    res->tensor = w->logits;
    res->tensor_bytes = (size_t)rows * w->m->hp.n_vocab * sizeof(float);
    return 0;
}

static int worker_step(struct worker *w, const struct wire_msg *m, double recv_wait)
{
    w->step = m->step.step; /* errors about this step name it */
    int rc = worker_check_step(w, m);
    if (rc)
        return rc;
    const struct wire_step *st = &m->step;
    const uint32_t seq = (uint32_t)st->seq_id;
    rc = backend_use_seq(w->be, seq);
    if (rc)
        return rc;
    if (st->pos == 0 && w->pos[seq] != 0) { /* a new sequence starts in this slot */
        rc = backend_reset_seq(w->be, seq);
        if (rc)
            return rc;
        w->pos[seq] = 0;
    }
    if (st->pos != w->pos[seq]) {
        log_error("step %llu starts sequence %u at position %u, but it is at %u",
                  (unsigned long long)st->step, seq, st->pos, w->pos[seq]);
        return -EPROTO;
    }
    if (st->via_nccl != (w->nccl_prev != NULL)) {
        log_error("step %llu came with its rows %s, but the plan hands them to this worker over "
                  "%s", (unsigned long long)st->step, st->via_nccl ? "over NCCL" : "over ZeroMQ",
                  w->nccl_prev ? "NCCL" : "ZeroMQ");
        return -EPROTO;
    }
    double t0 = worker_now();
    w->step = st->step;
    w->cur = st;
    w->announced = false;
    w->nccl_send_ms = w->nccl_recv_ms = 0;
    w->nccl_bytes = 0;
    if (!st->via_nccl)
        memcpy(w->h, m->tensor, m->tensor_bytes);
    /* the last worker's head follows its layers on the device where one row's token or
     * logits are wanted (backend_layers_head: no round trip of h through the host) */
    w->head = WORKER_HEAD_NONE;
    rc = -ENOTSUP;
    if (w->is_last && !st->all_logits && worker_greedy_here(w, st)) {
        rc = backend_layers_head(w->be, w->h, st->n_tokens, NULL, &w->head_id);
        w->head = rc ? WORKER_HEAD_NONE : WORKER_HEAD_ID;
    } else if (w->is_last && !st->all_logits) {
        rc = backend_layers_head(w->be, w->h, st->n_tokens, w->logits, NULL);
        w->head = rc ? WORKER_HEAD_NONE : WORKER_HEAD_LOGITS;
    }
    if (rc == -ENOTSUP)
        rc = backend_layers(w->be, w->h, st->n_tokens);
    w->cur = NULL;
    if (rc)
        return rc;
    w->pos[seq] += st->n_tokens;
    double t1 = worker_now();
    struct wire_msg res = {0};
    rc = worker_finish_step(w, st, &res);
    if (rc)
        return rc;
    double t2 = worker_now();
    /* the timing line goes first, so the coordinator has it when the result arrives */
    /* rows or logits this step sends over ZeroMQ: none after an NCCL hand-off, none but a
     * token after sampling here */
    const uint64_t sent = w->is_last ? res.tensor_bytes
                          : w->nccl_next ? 0
                                         : (uint64_t)st->n_tokens * w->m->hp.n_embd * sizeof(float);
    if (backend_injected_late(w->be)) { /* tests: a timing line behind the step's result */
        log_warn("injected delay of step %llu's timing line", (unsigned long long)st->step);
        struct timespec ts = {0, 300000000};
        nanosleep(&ts, NULL);
    }
    worker_send_timing(w, st, recv_wait, t2 - t1, t2 - t0 + recv_wait, sent);
    return res.type == WIRE_TYPE_RESULT ? worker_send(w, w->coord, &res) : 0;
}

/* A sequence snapshot from the coordinator (no step in flight): SAVE answers with slot
 * seq_id's snapshot of this range, SNAPSHOT loads one and answers LOADED. */
static int worker_state(struct worker *w, const struct wire_msg *m)
{
    const struct wire_state *st = &m->state;
    if (st->seq_id >= w->n_seq || st->op == WIRE_STATE_LOADED ||
        (st->op == WIRE_STATE_SNAPSHOT && (st->layer_begin != w->l0 || st->layer_end != w->l1))) {
        log_error("state message refused: op %u for sequence %llu of layers %u-%u (this worker "
                  "has layers %u-%u and %u slots)", st->op, (unsigned long long)st->seq_id,
                  st->layer_begin, st->layer_end ? st->layer_end - 1 : 0, w->l0, w->l1 - 1,
                  w->n_seq);
        return -EPROTO;
    }
    const uint32_t seq = (uint32_t)st->seq_id;
    int rc = backend_use_seq(w->be, seq);
    if (rc)
        return rc;
    struct wire_msg o = {.type = WIRE_TYPE_STATE};
    o.state = (struct wire_state){.seq_id = seq, .layer_begin = w->l0, .layer_end = w->l1};
    if (st->op == WIRE_STATE_SNAPSHOT) {
        rc = backend_state_load(w->be, m->tensor, m->tensor_bytes, st->pos);
        if (rc)
            return rc;
        w->pos[seq] = st->pos;
        o.state.op = WIRE_STATE_LOADED, o.state.pos = st->pos;
        return worker_send(w, w->coord, &o);
    }
    const size_t bytes = backend_state_bytes(w->be);
    void *buf = malloc(bytes ? bytes : 1);
    if (!buf) {
        log_error("no memory for a snapshot of %zu bytes", bytes);
        return -ENOMEM;
    }
    rc = backend_state_save(w->be, buf);
    o.state.op = WIRE_STATE_SNAPSHOT, o.state.pos = backend_pos(w->be), o.state.bytes = bytes;
    o.tensor = buf, o.tensor_bytes = bytes;
    rc = rc ? rc : worker_send(w, w->coord, &o);
    free(buf);
    return rc;
}

/* Handles one message; returns 1 to stop with success, 0 to go on, < 0 on error. */
static int worker_handle(struct worker *w, struct wire_msg *m, bool from_coord, double wait)
{
    if (from_coord)
        w->last_coord = worker_now();
    switch (m->type) {
    case WIRE_TYPE_STEP: {
        int rc = worker_step(w, m, wait);
        if (rc) {
            char what[160];
            snprintf(what, sizeof(what), "step %llu failed in layers %u-%u: %s",
                     (unsigned long long)m->step.step, w->l0, w->l1 - 1, strerror(-rc));
            worker_report_error(w, rc, what);
        }
        return rc;
    }
    case WIRE_TYPE_RESET: { /* every slot */
        backend_reset(w->be);
        memset(w->pos, 0, w->n_seq * sizeof(*w->pos));
        /* The reset travels down the pipeline like a step: the coordinator
         * sends it to worker 0 only, and each worker passes it on over its
         * hand-off socket, behind the steps it already handed on and ahead of
         * the next ones. Sent by the coordinator to every worker, it could
         * reach a later worker after the first step of the next sequence
         * (two sockets, no order between them) and wipe that step's state. */
        if (!w->out)
            return 0;
        struct wire_msg o = {.type = WIRE_TYPE_RESET};
        return worker_send(w, w->out, &o);
    }
    case WIRE_TYPE_STATE: {
        int rc = worker_state(w, m);
        if (rc) { /* the coordinator's request fails; only a device error ends the worker */
            char what[160];
            snprintf(what, sizeof(what), "sequence snapshot (op %u) failed in layers %u-%u: %s",
                     m->state.op, w->l0, w->l1 - 1, strerror(-rc));
            worker_report_error(w, rc, what);
        }
        return rc == -EIO ? rc : 0;
    }
    case WIRE_TYPE_SHUTDOWN:
        return 1;
    case WIRE_TYPE_HEARTBEAT:
        return 0;
    case WIRE_TYPE_EXPERT_REQUEST: /* a peer's, forwarded by the coordinator */
        if (w->has_foreign)
            return worker_serve_report(w, m);
        log_warn("ignoring an unexpected %s message (this worker holds no foreign experts)",
                 wire_msg_type_name(m->type));
        return 0;
    default:
        log_warn("ignoring an unexpected %s message", wire_msg_type_name(m->type));
        return 0;
    }
}

static int worker_loop(struct worker *w)
{
    w->last_coord = worker_now();
    double idle_since = worker_now();
    for (;;) {
        while (w->q_len) { /* what came from the coordinator during the last step, in order */
            struct wire_msg m = w->queue[w->q_head];
            w->q_head = (w->q_head + 1) % WORKER_QUEUE_MAX;
            w->q_len--;
            int rc = worker_handle(w, &m, true, 0.0);
            wire_msg_free(&m);
            idle_since = worker_now();
            if (rc)
                return rc > 0 ? 0 : rc;
        }
        zmq_pollitem_t items[2] = {{wire_socket_zmq(w->coord), 0, ZMQ_POLLIN, 0}};
        int n_items = 1;
        if (w->in)
            items[n_items++] = (zmq_pollitem_t){wire_socket_zmq(w->in), 0, ZMQ_POLLIN, 0};
        int r = zmq_poll(items, n_items, 1000);
        if (r < 0 && zmq_errno() != EINTR)
            return -EIO;
        for (int i = 0; i < n_items && r > 0; i++) {
            if (!(items[i].revents & ZMQ_POLLIN))
                continue;
            struct wire_msg m;
            int rc = wire_recv(i == 0 ? w->coord : w->in, &m, NULL, NULL, 0);
            if (rc == -ETIMEDOUT || rc == -EPROTO)
                continue;
            if (rc)
                return rc;
            rc = worker_handle(w, &m, i == 0, worker_now() - idle_since);
            wire_msg_free(&m);
            idle_since = worker_now();
            if (rc)
                return rc > 0 ? 0 : rc;
        }
        if (worker_now() - w->last_coord > WORKER_IDLE_EXIT_MS / 1000.0) {
            log_error("no word from the coordinator for %d s: exiting", WORKER_IDLE_EXIT_MS / 1000);
            return -ETIMEDOUT;
        }
    }
}

/* ---- process ---- */

static int worker_parse(int argc, char **argv, struct worker_args *a)
{
    a->index = -1;
    for (int i = 1; i < argc; i++) {
        const char *v = i + 1 < argc ? argv[i + 1] : NULL;
        if (!strcmp(argv[i], "--connect") && v)
            a->connect = v, i++;
        else if (!strcmp(argv[i], "--index") && v)
            a->index = atoi(v), i++;
        else if (!strcmp(argv[i], "--server-key") && v)
            a->server_key = v, i++;
        else if (!strcmp(argv[i], "--probe") && v)
            a->probe = v, i++;
        else {
            fprintf(stderr, "usage: lamina-worker --connect ENDPOINT --index N "
                            "[--server-key Z85] | --probe DEVICE\n(unknown or incomplete option "
                            "%s)\n", argv[i]);
            return -EINVAL;
        }
    }
    if (a->probe)
        return 0;
    if (!a->connect || a->index < 0 || a->index > 1023) {
        fprintf(stderr, "lamina-worker: --connect ENDPOINT and --index 0..1023 are required\n");
        return -EINVAL;
    }
    if (!a->server_key)
        a->server_key = getenv("LAMINA_SERVER_KEY");
    return 0;
}

/* Starts the watchdog with what ends its sleep (stop_mu, stop_cv on the monotonic clock);
 * false (nothing left to free) where any part cannot be made: the worker runs without it. */
static bool worker_watchdog_start(struct worker *w)
{
    pthread_condattr_t ca;
    if (pthread_condattr_init(&ca))
        return false;
    pthread_condattr_setclock(&ca, CLOCK_MONOTONIC);
    bool ok = pthread_cond_init(&w->stop_cv, &ca) == 0;
    pthread_condattr_destroy(&ca);
    if (!ok)
        return false;
    if (pthread_mutex_init(&w->stop_mu, NULL)) {
        pthread_cond_destroy(&w->stop_cv);
        return false;
    }
    if (pthread_create(&w->watchdog, NULL, worker_watchdog, w)) {
        pthread_mutex_destroy(&w->stop_mu);
        pthread_cond_destroy(&w->stop_cv);
        return false;
    }
    return true;
}

static void worker_cleanup(struct worker *w)
{
    if (w->watchdog_started) { /* under the lock: the watchdog sees it before it sleeps */
        pthread_mutex_lock(&w->stop_mu);
        atomic_store(&w->stop, 1);
        pthread_cond_signal(&w->stop_cv);
        pthread_mutex_unlock(&w->stop_mu);
        pthread_join(w->watchdog, NULL);
        pthread_cond_destroy(&w->stop_cv);
        pthread_mutex_destroy(&w->stop_mu);
    } else {
        atomic_store(&w->stop, 1);
    }
    for (; w->queue && w->q_len; w->q_len--, w->q_head = (w->q_head + 1) % WORKER_QUEUE_MAX)
        wire_msg_free(&w->queue[w->q_head]);
    free(w->queue);
    free(w->pos);
    wire_socket_destroy(w->in);
    wire_socket_destroy(w->out);
    wire_socket_destroy(w->coord);
    nccl_comm_destroy(w->nccl_prev); /* before the backend: their work is on its stream */
    nccl_comm_destroy(w->nccl_next);
    backend_host_free(w->be, w->logits); /* before the backend that allocated it */
    backend_destroy(w->be);
    nccl_lib_close(w->nccl);
    for (uint32_t l = 0; w->m && l < w->m->hp.n_layer; l++) {
        if (w->src)
            free(w->src[l]);
        if (w->resident)
            free(w->resident[l]);
        if (w->foreign)
            free(w->foreign[l]);
    }
    free(w->foreign);
    free(w->serve_y);
    if (w->served_req)
        log_info("served %llu forwarded expert requests (%llu rows) for other workers, %llu "
                 "of them while waiting for its own", (unsigned long long)w->served_req,
                 (unsigned long long)w->served_rows, (unsigned long long)w->served_waiting);
    free(w->src);
    free(w->resident);
    free(w->trunk_on);
    free(w->shexp_on);
    free(w->h);
    sampler_destroy(w->smp);
    shm_destroy(w->shm);
    arch_free(w->m);
    gguf_close(w->g);
    if (w->zctx)
        zmq_ctx_term(w->zctx);
}

/* --probe DEVICE: one line of figures on stdout. */
static int worker_probe(const char *device)
{
    log_init("worker", -1);
    struct probe_result r;
    int rc = probe_device(device, 0, QUANT_TYPE_Q4_0, &r);
    if (rc)
        return 1;
    char h2d[48] = "", fig[24] = "";
    if (r.h2d_bw > 0) {
        snprintf(h2d, sizeof(h2d), ", h2d %.1f GB/s", r.h2d_bw / 1e9);
        snprintf(fig, sizeof(fig), ":%.1f", r.h2d_bw / 1e9);
    }
    printf("[probe] device %s: gemv %.1f GB/s%s (%s, %.0f ms); LAMINA_PROBE figure: %s=%.1f%s\n",
           device, r.gemv_bw / 1e9, h2d, quant_type_name(r.type), r.ms, device, r.gemv_bw / 1e9,
           fig);
    return 0;
}

int main(int argc, char **argv)
{
    static struct worker w;
    if (worker_parse(argc, argv, &w.args))
        return 2;
    if (w.args.probe)
        return worker_probe(w.args.probe);
    log_init("worker", w.args.index);
    signal(SIGPIPE, SIG_IGN);
    w.zctx = zmq_ctx_new();
    int rc = w.zctx ? 0 : -ENOMEM;
    if (!rc && w.args.server_key) {
        w.curve = true;
        rc = wire_key_from_z85(w.args.server_key, w.server_key);
        rc = rc ? rc : wire_keypair_generate(&w.keys);
    }
    char id[16];
    snprintf(id, sizeof(id), "w%d", w.args.index);
    struct wire_socket_config c = worker_sock_cfg(&w, id);
    if (!rc) {
        w.coord = wire_socket_create(w.zctx, ZMQ_DEALER, &c);
        rc = w.coord ? wire_socket_connect(w.coord, w.args.connect) : -EIO;
    }
    rc = rc ? rc : worker_start(&w);
    if (!rc) {
        w.watchdog_started = worker_watchdog_start(&w);
        rc = worker_loop(&w);
    }
    if (rc && (w.nccl_prev || w.nccl_next))
        alarm(WORKER_ABORT_DEADLINE_S); /* teardown after an NCCL failure may hang */
    worker_cleanup(&w);
    if (rc)
        log_error("worker %d exits after an error: %s", w.args.index, strerror(-rc));
    return rc ? 1 : 0;
}
