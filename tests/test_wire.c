/*
 * Tests of ipc/wire: lamina's ZeroMQ sockets and message framing.
 *   - every message type (and the token-only Result, a LoadPlan with NULL strings) goes
 *     DEALER -> ROUTER and back over inproc:// and over ipc:// in a fresh runtime directory,
 *     with tensor frames; every field, the tensor bytes, the routing id and the stats compared;
 *   - socket options are set (read back), bad configs are refused, a message its receiver would
 *     reject is refused by wire_send;
 *   - timeouts: wire_recv and wire_send with no peer return -ETIMEDOUT in about the time asked;
 *     a ROUTER send to an unknown id fails with -EHOSTUNREACH;
 *   - runtime directory: mode 0700, endpoint names, a second bind of an existing ipc path is
 *     refused and the first socket keeps working, a closed peer makes the ROUTER's send fail,
 *     abstract and non-loopback tcp refused, the directory of a dead (forked) process swept,
 *     removal;
 *   - NCCL hand-off fields: LoadPlan unique ids of 128 bytes arrive intact, other lengths are
 *     refused, a last worker with a next id is refused; a Step via NCCL has no tensor frame;
 *   - CURVE over tcp://127.0.0.1: key generation and Z85 text, a client with the server's key
 *     gets through both ways, one with a wrong server key and a plain one do not;
 *   - ZMQ_MAXMSGSIZE: an oversized frame over ipc never reaches wire_recv;
 *   - fuzz: 10,000 malformed messages (truncated, tensor size off, wrong frame counts, random
 *     bytes, garbage payloads, unknown types, wrong versions, inconsistent expert arrays, bad
 *     shapes and fields, empty and oversized envelopes) are sent raw with zmq_send; each must be
 *     rejected with -EPROTO, with the expected reason where it is determined, and counted, with
 *     exactly one warning per reason naming the peer; then
 *     2,000 random byte flips of valid messages (accepted or rejected, counted either way); then
 *     a valid message, encoded by this file's own protobuf writer, comes through intact.
 */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "common/log.h"
#include "ipc/wire.h"
#include "tests/check.h"

#define N_EMBD 16
#define N_VOCAB 50
#define FUZZ_N 10000
#define FLIP_N 2000
#define FUZZ_CLASSES 16

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* ---- sample messages --------------------------------------------------------------------- */

struct samples {
    float hidden[3 * N_EMBD]; /* step: 3 tokens */
    float rows[6 * N_EMBD];   /* expert request and reply: counts 1 + 2 + 3 */
    float logits[2 * N_VOCAB];
    uint32_t experts[3];
    uint32_t counts[3];
    uint8_t bitmap0[4];
    uint8_t bitmap1[64];
    struct wire_layer_residency res[2];
    struct wire_layer_residency foreign[2]; /* experts of other workers' layers */
};

static void samples_init(struct samples *s)
{
    for (size_t i = 0; i < sizeof s->hidden / sizeof s->hidden[0]; i++)
        s->hidden[i] = (float)i * 0.25f - 3.0f;
    for (size_t i = 0; i < sizeof s->rows / sizeof s->rows[0]; i++)
        s->rows[i] = 1.0f / (float)(i + 1);
    for (size_t i = 0; i < sizeof s->logits / sizeof s->logits[0]; i++)
        s->logits[i] = (float)i * -0.5f + 7.0f;
    uint32_t experts[3] = {511, 3, 77}, counts[3] = {1, 2, 3};
    memcpy(s->experts, experts, sizeof experts);
    memcpy(s->counts, counts, sizeof counts);
    for (size_t i = 0; i < sizeof s->bitmap0; i++)
        s->bitmap0[i] = (uint8_t)(0xa5 ^ i);
    for (size_t i = 0; i < sizeof s->bitmap1; i++)
        s->bitmap1[i] = (uint8_t)(i * 37);
    s->res[0] = (struct wire_layer_residency){20, s->bitmap0, sizeof s->bitmap0, true, false};
    s->res[1] = (struct wire_layer_residency){23, s->bitmap1, sizeof s->bitmap1, false, true};
    s->foreign[0] = (struct wire_layer_residency){2, s->bitmap1, sizeof s->bitmap1, false, false};
    s->foreign[1] = (struct wire_layer_residency){45, s->bitmap0, sizeof s->bitmap0, false, false};
}

/* The sample of type t; variant 1 is a second shape where one exists (Result without logits,
 * LoadPlan of the last worker with NULL strings, no residency, no key and only a previous NCCL
 * pair, Hello without a key, Step via NCCL without a tensor). */
static struct wire_msg sample_msg(const struct samples *s, enum wire_type t, int variant,
                                  uint64_t seq)
{
    struct wire_msg m = {.type = t, .seq_no = seq};
    switch (t) {
    case WIRE_TYPE_HELLO:
        m.hello = (struct wire_hello){.worker_index = 3, .pid = 4242, .device = "NVIDIA H200",
                                      .device_mem_bytes = 150ull << 30, .n_threads = 16,
                                      .has_curve_key = !variant};
        for (int i = 0; i < WIRE_KEY_BYTES; i++)
            m.hello.curve_public_key[i] = variant ? 0 : (uint8_t)(i * 7 + 1);
        break;
    case WIRE_TYPE_LOAD_PLAN:
        m.load_plan = (struct wire_load_plan){
            .model_path = "/models/qwen3next-80b-a3b-q4_0.gguf",
            .shm_name = "/lamina-1234-experts",
            .shm_bytes = 45ull << 30,
            .layer_begin = 20,
            .layer_end = 40,
            .n_layers_total = 48,
            .residency = s->res,
            .n_residency = 2,
            .foreign = s->foreign,
            .n_foreign = 2,
            .backend = "cuda",
            .device_mem_budget = 120ull << 30,
            .n_ctx = 8192,
            .kv_f16 = true,
            .max_batch = 512,
            .n_threads = 8,
            .next_endpoint = "ipc:///run/user/1000/lamina-1/w2.sock",
            .listen_endpoint = "ipc:///run/user/1000/lamina-1/w1.sock",
            .is_last = false,
            .n_embd = 2048,
            .n_vocab = 151936,
            .has_next_key = true,
            .has_nccl_prev = true,
            .has_nccl_next = true,
        };
        for (int i = 0; i < WIRE_KEY_BYTES; i++)
            m.load_plan.next_server_key[i] = (uint8_t)(255 - i);
        for (int i = 0; i < WIRE_NCCL_ID_BYTES; i++) {
            m.load_plan.nccl_prev_id[i] = (uint8_t)(i * 3 + 1);
            m.load_plan.nccl_next_id[i] = (uint8_t)(200 - i);
        }
        if (variant) {
            m.load_plan.residency = NULL;
            m.load_plan.n_residency = 0;
            m.load_plan.next_endpoint = NULL;
            m.load_plan.listen_endpoint = NULL;
            m.load_plan.is_last = true;
            m.load_plan.kv_f16 = false;
            m.load_plan.has_next_key = false;
            memset(m.load_plan.next_server_key, 0, WIRE_KEY_BYTES);
            m.load_plan.has_nccl_next = false; /* the last worker: only a previous pair */
            memset(m.load_plan.nccl_next_id, 0, WIRE_NCCL_ID_BYTES);
        }
        break;
    case WIRE_TYPE_READY:
        m.ready = (struct wire_ready){(97ull << 30) + 5, 1234};
        break;
    case WIRE_TYPE_STEP:
        m.step = (struct wire_step){.seq_id = 0xfedcba9876543210ull, .pos = 4095, .n_tokens = 3,
                                    .step = 1ull << 40, .all_logits = true, .n_embd = N_EMBD,
                                    .via_nccl = variant != 0};
        m.tensor = variant ? NULL : s->hidden;
        m.tensor_bytes = variant ? 0 : sizeof s->hidden;
        break;
    case WIRE_TYPE_EXPERT_REQUEST:
        m.expert_request = (struct wire_expert_request){77, 31, s->experts, s->counts, 3, N_EMBD,
                                                        variant ? 0 : 0x123456789ull};
        m.tensor = s->rows;
        m.tensor_bytes = sizeof s->rows;
        break;
    case WIRE_TYPE_EXPERT_REPLY:
        m.expert_reply = (struct wire_expert_reply){77, 31, 6, N_EMBD, 0x123456789ull};
        m.tensor = s->rows;
        m.tensor_bytes = sizeof s->rows;
        break;
    case WIRE_TYPE_RESULT:
        m.result = (struct wire_result){9, 78, 2, N_VOCAB, variant ? 49 : -1};
        if (!variant) {
            m.tensor = s->logits;
            m.tensor_bytes = sizeof s->logits;
        }
        break;
    case WIRE_TYPE_TIMING:
        m.timing.json = "{\"worker\":1,\"step\":17,\"ms\":{\"attn\":0.25}}";
        break;
    case WIRE_TYPE_HEARTBEAT:
        m.heartbeat.step = 123456789;
        break;
    case WIRE_TYPE_ERROR:
        m.error = (struct wire_error){-EIO, "cuda: illegal memory access in layer 21", 1, 99};
        break;
    case WIRE_TYPE_SHUTDOWN:
        break;
    case WIRE_TYPE_RESET:
        m.reset.seq_id = 5;
        break;
    case WIRE_TYPE_STATE: /* a snapshot of 7 bytes (the frame need not be f32 rows) */
        m.state = (struct wire_state){.seq_id = 3, .op = WIRE_STATE_SNAPSHOT, .pos = 12,
                                      .layer_begin = 4, .layer_end = 9, .bytes = 7};
        m.tensor = s->hidden;
        m.tensor_bytes = 7;
        break;
    }
    return m;
}

#define SAME(f)                                                                                    \
    CHECK(a->f == b->f, "%s %s: field " #f " differs", where, wire_msg_type_name(a->type))
#define SAME_STR(f)                                                                                \
    CHECK(b->f && strcmp(a->f ? a->f : "", b->f) == 0, "%s %s: string " #f " differs: '%s'",       \
          where, wire_msg_type_name(a->type), b->f ? b->f : "(null)")

static void check_load_plan(const struct wire_msg *a, const struct wire_msg *b, const char *where)
{
    SAME_STR(load_plan.model_path);
    SAME_STR(load_plan.shm_name);
    SAME(load_plan.shm_bytes);
    SAME(load_plan.layer_begin);
    SAME(load_plan.layer_end);
    SAME(load_plan.n_layers_total);
    SAME(load_plan.n_residency);
    for (size_t i = 0; i < a->load_plan.n_residency && i < b->load_plan.n_residency; i++) {
        const struct wire_layer_residency *x = &a->load_plan.residency[i];
        const struct wire_layer_residency *y = &b->load_plan.residency[i];
        CHECK(x->layer == y->layer && x->bitmap_bytes == y->bitmap_bytes && x->trunk == y->trunk && x->shexp == y->shexp &&
                  memcmp(x->bitmap, y->bitmap, x->bitmap_bytes) == 0,
              "%s load_plan residency[%zu] differs", where, i);
    }
    SAME(load_plan.n_foreign);
    for (size_t i = 0; i < a->load_plan.n_foreign && i < b->load_plan.n_foreign; i++) {
        const struct wire_layer_residency *x = &a->load_plan.foreign[i];
        const struct wire_layer_residency *y = &b->load_plan.foreign[i];
        CHECK(x->layer == y->layer && x->bitmap_bytes == y->bitmap_bytes &&
                  memcmp(x->bitmap, y->bitmap, x->bitmap_bytes) == 0,
              "%s load_plan foreign[%zu] differs", where, i);
    }
    SAME_STR(load_plan.backend);
    SAME(load_plan.device_mem_budget);
    SAME(load_plan.n_ctx);
    SAME(load_plan.kv_f16);
    SAME(load_plan.max_batch);
    SAME(load_plan.n_threads);
    SAME_STR(load_plan.next_endpoint);
    SAME_STR(load_plan.listen_endpoint);
    SAME(load_plan.is_last);
    SAME(load_plan.n_embd);
    SAME(load_plan.n_vocab);
    SAME(load_plan.has_next_key);
    CHECK(!memcmp(a->load_plan.next_server_key, b->load_plan.next_server_key, WIRE_KEY_BYTES),
          "%s load_plan next_server_key differs", where);
    SAME(load_plan.has_nccl_prev);
    SAME(load_plan.has_nccl_next);
    CHECK(!memcmp(a->load_plan.nccl_prev_id, b->load_plan.nccl_prev_id, WIRE_NCCL_ID_BYTES) &&
              !memcmp(a->load_plan.nccl_next_id, b->load_plan.nccl_next_id, WIRE_NCCL_ID_BYTES),
          "%s load_plan nccl ids differ", where);
}

/* Checks that b (received) carries every field of a (sent). */
static void check_same(const struct wire_msg *a, const struct wire_msg *b, const char *where)
{
    SAME(type);
    SAME(seq_no);
    SAME(tensor_bytes);
    CHECK(!a->tensor_bytes || (b->tensor && memcmp(a->tensor, b->tensor, a->tensor_bytes) == 0),
          "%s %s: tensor bytes differ", where, wire_msg_type_name(a->type));
    CHECK((uintptr_t)b->tensor % WIRE_TENSOR_ALIGN == 0, "%s: tensor misaligned", where);
    switch (a->type) {
    case WIRE_TYPE_HELLO:
        SAME(hello.worker_index);
        SAME(hello.pid);
        SAME_STR(hello.device);
        SAME(hello.device_mem_bytes);
        SAME(hello.n_threads);
        SAME(hello.has_curve_key);
        CHECK(!memcmp(a->hello.curve_public_key, b->hello.curve_public_key, WIRE_KEY_BYTES),
              "%s hello curve key differs", where);
        break;
    case WIRE_TYPE_LOAD_PLAN:
        check_load_plan(a, b, where);
        break;
    case WIRE_TYPE_READY:
        SAME(ready.device_mem_used);
        SAME(ready.resident_experts);
        break;
    case WIRE_TYPE_STEP:
        SAME(step.seq_id);
        SAME(step.pos);
        SAME(step.n_tokens);
        SAME(step.step);
        SAME(step.all_logits);
        SAME(step.n_embd);
        SAME(step.via_nccl);
        break;
    case WIRE_TYPE_EXPERT_REQUEST:
        SAME(expert_request.step);
        SAME(expert_request.layer);
        SAME(expert_request.n_experts);
        SAME(expert_request.n_embd);
        SAME(expert_request.tag);
        CHECK(b->expert_request.n_experts == a->expert_request.n_experts &&
                  !memcmp(a->expert_request.experts, b->expert_request.experts,
                          a->expert_request.n_experts * 4) &&
                  !memcmp(a->expert_request.counts, b->expert_request.counts,
                          a->expert_request.n_experts * 4),
              "%s expert_request arrays differ", where);
        break;
    case WIRE_TYPE_EXPERT_REPLY:
        SAME(expert_reply.step);
        SAME(expert_reply.layer);
        SAME(expert_reply.n_rows);
        SAME(expert_reply.n_embd);
        SAME(expert_reply.tag);
        break;
    case WIRE_TYPE_RESULT:
        SAME(result.seq_id);
        SAME(result.step);
        SAME(result.n_rows);
        SAME(result.n_vocab);
        SAME(result.token);
        break;
    case WIRE_TYPE_TIMING:
        SAME_STR(timing.json);
        break;
    case WIRE_TYPE_HEARTBEAT:
        SAME(heartbeat.step);
        break;
    case WIRE_TYPE_ERROR:
        SAME(error.code);
        SAME_STR(error.message);
        SAME(error.worker_index);
        SAME(error.step);
        break;
    case WIRE_TYPE_SHUTDOWN:
        break;
    case WIRE_TYPE_RESET:
        SAME(reset.seq_id);
        break;
    case WIRE_TYPE_STATE:
        SAME(state.seq_id);
        SAME(state.op);
        SAME(state.pos);
        SAME(state.layer_begin);
        SAME(state.layer_end);
        SAME(state.bytes);
        break;
    }
}

/* ---- round trips ------------------------------------------------------------------------- */

static void round_trip_one(struct wire_socket *router, struct wire_socket *dealer,
                           const struct wire_msg *m, const char *where)
{
    struct wire_msg r;
    uint8_t id[WIRE_ID_MAX];
    size_t id_len = sizeof id;
    CHECK(wire_send(dealer, m, NULL, 0) == 0, "%s: dealer send %s", where,
          wire_msg_type_name(m->type));
    int rc = wire_recv(router, &r, id, &id_len, 2000);
    CHECK(rc == 0, "%s: router recv %s: %d", where, wire_msg_type_name(m->type), rc);
    if (rc)
        return;
    CHECK(id_len == 8 && !memcmp(id, "worker-0", 8), "%s: routing id %.*s", where, (int)id_len,
          (const char *)id);
    check_same(m, &r, where);
    wire_msg_free(&r);
    CHECK(r.storage == NULL && r.tensor == NULL, "wire_msg_free zeroes");
    CHECK(wire_send(router, m, id, id_len) == 0, "%s: router send %s", where,
          wire_msg_type_name(m->type));
    rc = wire_recv(dealer, &r, NULL, NULL, 2000);
    CHECK(rc == 0, "%s: dealer recv %s: %d", where, wire_msg_type_name(m->type), rc);
    if (rc)
        return;
    check_same(m, &r, where);
    wire_msg_free(&r);
}

/* A bound ROUTER and a DEALER "worker-0" connected to it. */
static void pair_create(void *ctx, const char *ep, struct wire_socket **router,
                        struct wire_socket **dealer)
{
    struct wire_socket_config cfg = wire_socket_config_default();
    cfg.routing_id = "worker-0";
    *router = wire_socket_create(ctx, ZMQ_ROUTER, NULL);
    *dealer = wire_socket_create(ctx, ZMQ_DEALER, &cfg);
    CHECK(*router && *dealer, "sockets for %s", ep);
    if (!*router || !*dealer)
        return;
    CHECK(wire_socket_bind(*router, ep) == 0, "bind %s", ep);
    CHECK(wire_socket_connect(*dealer, ep) == 0, "connect %s", ep);
}

static void measure_latency(struct wire_socket *router, struct wire_socket *dealer)
{
    static float h[2048 * 512];
    struct wire_msg m = {.type = WIRE_TYPE_STEP, .tensor = h};
    struct wire_msg r;
    uint8_t id[WIRE_ID_MAX];
    int sizes[2] = {1, 512}, reps[2] = {1000, 20};
    for (int k = 0; k < 2; k++) {
        m.step = (struct wire_step){.n_tokens = (uint32_t)sizes[k], .n_embd = 2048};
        m.tensor_bytes = (size_t)sizes[k] * 2048 * 4;
        int ok = 0;
        double t0 = now_s();
        for (int i = 0; i < reps[k]; i++) {
            size_t id_len = sizeof id;
            if (wire_send(dealer, &m, NULL, 0) || wire_recv(router, &r, id, &id_len, 2000))
                break;
            int rc = wire_send(router, &r, id, id_len);
            wire_msg_free(&r);
            if (rc || wire_recv(dealer, &r, NULL, NULL, 2000))
                break;
            ok += r.tensor_bytes == m.tensor_bytes;
            wire_msg_free(&r);
        }
        double dt = now_s() - t0;
        CHECK(ok == reps[k], "latency loop: %d of %d round trips", ok, reps[k]);
        MEASURE("ipc step round trip, %d x 2048 f32 (%zu bytes): %.1f us, %.2f GB/s each way",
                sizes[k], m.tensor_bytes, dt / reps[k] * 1e6,
                2.0 * (double)m.tensor_bytes * reps[k] / dt / 1e9);
    }
}

static void test_round_trips(void *ctx, const char *ep, const char *label, bool measure)
{
    struct samples s;
    samples_init(&s);
    struct wire_socket *router, *dealer;
    pair_create(ctx, ep, &router, &dealer);
    if (!router || !dealer)
        goto out;
    int n = 0;
    for (int t = WIRE_TYPE_FIRST; t <= WIRE_TYPE_LAST; t++) {
        for (int variant = 0; variant < 2; variant++) {
            if (variant && t != WIRE_TYPE_RESULT && t != WIRE_TYPE_LOAD_PLAN &&
                t != WIRE_TYPE_HELLO && t != WIRE_TYPE_STEP)
                continue;
            struct wire_msg m = sample_msg(&s, (enum wire_type)t, variant, 1000 + (uint64_t)t);
            round_trip_one(router, dealer, &m, label);
            n++;
        }
    }
    const struct wire_stats *rs = wire_socket_stats(router), *ds = wire_socket_stats(dealer);
    CHECK(rs->received == (uint64_t)n && rs->sent == (uint64_t)n && ds->sent == (uint64_t)n &&
              ds->received == (uint64_t)n && rs->rejected == 0 && ds->rejected == 0,
          "%s stats: router %llu/%llu dealer %llu/%llu (want %d each)", label,
          (unsigned long long)rs->received, (unsigned long long)rs->sent,
          (unsigned long long)ds->received, (unsigned long long)ds->sent, n);
    CHECK(rs->bytes_received == ds->bytes_sent && ds->bytes_received == rs->bytes_sent &&
              rs->bytes_received > sizeof s.hidden + sizeof s.rows * 2 + sizeof s.logits,
          "%s byte counters", label);
    MEASURE("%s: %d message kinds round-tripped both ways, %llu bytes each way, %llu tensors "
            "copied to align them", label, n, (unsigned long long)rs->bytes_received,
            (unsigned long long)(rs->tensors_copied + ds->tensors_copied));
    if (measure)
        measure_latency(router, dealer);
out:
    wire_socket_destroy(dealer);
    wire_socket_destroy(router);
}

/* ---- options, refusals, timeouts --------------------------------------------------------- */

static int getopt_int(struct wire_socket *s, int opt)
{
    int v = -12345;
    size_t len = sizeof v;
    zmq_getsockopt(wire_socket_zmq(s), opt, &v, &len);
    return v;
}

static void test_options(void *ctx)
{
    struct wire_socket *s = wire_socket_create(ctx, ZMQ_ROUTER, NULL);
    CHECK(s, "router with defaults");
    if (s) {
        int64_t max = 0;
        size_t len = sizeof max;
        zmq_getsockopt(wire_socket_zmq(s), ZMQ_MAXMSGSIZE, &max, &len);
        CHECK(getopt_int(s, ZMQ_LINGER) == 200, "linger %d", getopt_int(s, ZMQ_LINGER));
        CHECK(getopt_int(s, ZMQ_SNDTIMEO) == 1000 && getopt_int(s, ZMQ_RCVTIMEO) == 1000,
              "timeouts %d %d", getopt_int(s, ZMQ_SNDTIMEO), getopt_int(s, ZMQ_RCVTIMEO));
        CHECK(max == WIRE_MSG_MAX_DEFAULT, "maxmsgsize %lld", (long long)max);
        CHECK(getopt_int(s, ZMQ_IMMEDIATE) == 1, "immediate");
    }
    wire_socket_destroy(s);
    wire_socket_destroy(NULL);

    log_set_level(LOG_LEVEL_ERROR); /* expected errors below */
    struct wire_socket_config c = wire_socket_config_default();
    c.routing_id = "r";
    CHECK(!wire_socket_create(ctx, ZMQ_ROUTER, &c), "routing id on a ROUTER refused");
    c = wire_socket_config_default();
    c.send_timeout_ms = -1;
    CHECK(!wire_socket_create(ctx, ZMQ_DEALER, &c), "unbounded send timeout refused");
    c = wire_socket_config_default();
    c.max_msg_bytes = 1000;
    CHECK(!wire_socket_create(ctx, ZMQ_DEALER, &c), "max_msg_bytes below the envelope refused");
    struct wire_keypair kp;
    memset(&kp, 0, sizeof kp);
    c = wire_socket_config_default();
    c.curve_keys = &kp;
    CHECK(!wire_socket_create(ctx, ZMQ_DEALER, &c), "CURVE client without server key refused");
    CHECK(!wire_socket_create(ctx, ZMQ_REQ, NULL), "REQ refused");
    log_set_level(LOG_LEVEL_INFO);
}

static void test_timeouts_and_refusals(void *ctx, const char *dir)
{
    struct samples s;
    samples_init(&s);
    struct wire_socket_config c = wire_socket_config_default();
    c.send_timeout_ms = 50;
    struct wire_socket *router = wire_socket_create(ctx, ZMQ_ROUTER, NULL);
    struct wire_socket *lonely = wire_socket_create(ctx, ZMQ_DEALER, &c);
    CHECK(router && lonely, "sockets");
    if (!router || !lonely)
        goto out;
    CHECK(wire_socket_bind(router, "inproc://timeouts") == 0, "bind");
    char nobody[256];
    CHECK(wire_endpoint_ipc(nobody, sizeof nobody, dir, "nobody") == 0 &&
              wire_socket_connect(lonely, nobody) == 0,
          "connect to nothing");

    struct wire_msg r;
    uint8_t id[WIRE_ID_MAX];
    size_t id_len = sizeof id;
    double t0 = now_s();
    int rc = wire_recv(router, &r, id, &id_len, 80);
    double dt = now_s() - t0;
    CHECK(rc == -ETIMEDOUT && dt >= 0.075 && dt < 0.5, "recv timeout: rc %d after %.3f s", rc, dt);
    CHECK(r.storage == NULL && r.tensor == NULL, "timed-out message is zeroed");
    t0 = now_s();
    rc = wire_recv(lonely, &r, NULL, NULL, 0);
    CHECK(rc == -ETIMEDOUT && now_s() - t0 < 0.05, "recv timeout 0: %d", rc);

    struct wire_msg hb = sample_msg(&s, WIRE_TYPE_HEARTBEAT, 0, 1);
    t0 = now_s();
    rc = wire_send(lonely, &hb, NULL, 0);
    dt = now_s() - t0;
    CHECK(rc == -ETIMEDOUT && dt >= 0.045 && dt < 0.5, "send with no peer: rc %d after %.3f s",
          rc, dt);
    MEASURE("timeouts: recv 80 ms and send 50 ms returned -ETIMEDOUT on time");

    log_set_level(LOG_LEVEL_ERROR); /* expected errors below */
    rc = wire_send(router, &hb, "nobody", 6);
    CHECK(rc == -EHOSTUNREACH, "ROUTER send to unknown id: %d (want -EHOSTUNREACH)", rc);
    CHECK(strstr(log_last_error(), "no peer"), "logged: %s", log_last_error());
    CHECK(wire_socket_stats(router)->sent == 0, "nothing counted as sent");

    /* What its receiver would reject is not sent. */
    struct wire_msg bad = sample_msg(&s, WIRE_TYPE_STEP, 0, 2);
    bad.tensor_bytes -= 4;
    CHECK(wire_send(lonely, &bad, NULL, 0) == -EINVAL, "step with a short tensor refused");
    bad = sample_msg(&s, WIRE_TYPE_EXPERT_REQUEST, 0, 3);
    bad.expert_request.n_experts = 0;
    CHECK(wire_send(lonely, &bad, NULL, 0) == -EINVAL, "expert_request with no experts refused");
    bad = sample_msg(&s, WIRE_TYPE_HEARTBEAT, 0, 4);
    bad.tensor = s.hidden;
    bad.tensor_bytes = 16;
    CHECK(wire_send(lonely, &bad, NULL, 0) == -EINVAL, "heartbeat with a tensor refused");
    bad = sample_msg(&s, WIRE_TYPE_STATE, 0, 5);
    bad.state.bytes = 8;
    CHECK(wire_send(lonely, &bad, NULL, 0) == -EINVAL, "snapshot of 8 bytes in 7 refused");
    bad = sample_msg(&s, WIRE_TYPE_STATE, 0, 5);
    bad.state.op = WIRE_STATE_SAVE;
    CHECK(wire_send(lonely, &bad, NULL, 0) == -EINVAL, "state save with a frame refused");
    bad = sample_msg(&s, WIRE_TYPE_STATE, 0, 5);
    bad.state.op = 4;
    CHECK(wire_send(lonely, &bad, NULL, 0) == -EINVAL, "state op 4 refused");
    bad = sample_msg(&s, WIRE_TYPE_STATE, 0, 5);
    bad.state.layer_end = bad.state.layer_begin;
    CHECK(wire_send(lonely, &bad, NULL, 0) == -EINVAL, "snapshot of no layers refused");
    bad = (struct wire_msg){.type = (enum wire_type)99};
    CHECK(wire_send(lonely, &bad, NULL, 0) == -EINVAL, "unknown type refused");
    CHECK(wire_socket_stats(lonely)->sent == 0, "refused messages not counted as sent");

    CHECK(wire_socket_bind(router, "tcp://0.0.0.0:*") == -EPERM, "public tcp without CURVE");
    CHECK(wire_socket_connect(lonely, "tcp://10.1.2.3:5555") == -EPERM, "remote tcp without CURVE");
    CHECK(wire_socket_bind(router, "ipc://@lamina-abstract") == -EINVAL, "abstract ipc");
    CHECK(wire_socket_bind(router, "pgm://eth0;239.192.1.1:5555") == -EINVAL, "pgm refused");
    log_set_level(LOG_LEVEL_INFO);
out:
    wire_socket_destroy(lonely);
    wire_socket_destroy(router);
}

/* ---- runtime directory ------------------------------------------------------------------- */

static void test_rundir(void *ctx, char *dir, size_t cap)
{
    int rc = wire_rundir_create(NULL, dir, cap);
    CHECK(rc == 0, "rundir create: %d", rc);
    if (rc)
        return;
    struct stat st;
    char want[64];
    snprintf(want, sizeof want, "/lamina-%ld-", (long)getpid());
    CHECK(stat(dir, &st) == 0 && S_ISDIR(st.st_mode) && (st.st_mode & 0777) == 0700,
          "rundir %s is a 0700 directory (mode %o)", dir, st.st_mode & 0777);
    CHECK(strstr(dir, want), "rundir name %s has %s", dir, want);

    char ep[256], expect[256];
    CHECK(wire_endpoint_ipc(ep, sizeof ep, dir, "coord") == 0, "endpoint");
    snprintf(expect, sizeof expect, "ipc://%s/coord.sock", dir);
    CHECK(!strcmp(ep, expect), "endpoint %s", ep);
    log_set_level(LOG_LEVEL_ERROR); /* expected errors below */
    char buf[256];
    CHECK(wire_endpoint_ipc(buf, sizeof buf, dir, "") == -EINVAL, "empty name");
    CHECK(wire_endpoint_ipc(buf, sizeof buf, dir, "a/b") == -EINVAL, "slash in name");
    CHECK(wire_endpoint_ipc(buf, sizeof buf, dir, "../x") == -EINVAL, "dots in name");
    CHECK(wire_endpoint_ipc(buf, sizeof buf, dir, "abcdefghijklmnopqrstuvwxyz0123456") == -EINVAL,
          "33-character name");
    char longdir[200];
    memset(longdir, 'd', sizeof longdir);
    longdir[0] = '/';
    longdir[101] = '\0'; /* + "/x.sock" is 108 bytes: one over the limit */
    CHECK(wire_endpoint_ipc(buf, sizeof buf, longdir, "x") == -ENAMETOOLONG, "long ipc path");
    CHECK(wire_endpoint_ipc(buf, 20, dir, "coord") == -ENAMETOOLONG, "small buffer");
    CHECK(wire_rundir_create(longdir, buf, sizeof buf) == -ENAMETOOLONG, "long base");

    /* A second bind of the same path is refused and the first owner keeps it. */
    struct wire_socket *first, *dealer;
    pair_create(ctx, ep, &first, &dealer);
    struct wire_socket *second = wire_socket_create(ctx, ZMQ_ROUTER, NULL);
    if (first && dealer && second) {
        rc = wire_socket_bind(second, ep);
        CHECK(rc == -EADDRINUSE, "second bind of %s: %d", ep, rc);
        CHECK(strstr(log_last_error(), "exists"), "logged: %s", log_last_error());
        struct samples s;
        samples_init(&s);
        struct wire_msg m = sample_msg(&s, WIRE_TYPE_HELLO, 0, 7);
        round_trip_one(first, dealer, &m, "ipc after refused second bind");
        char got[256];
        CHECK(wire_socket_endpoint(first, got, sizeof got) == 0 && !strcmp(got, ep),
              "last endpoint %s", got);

        /* A peer that went away: sends to its id fail once ZeroMQ has seen the disconnect. */
        wire_socket_destroy(dealer);
        dealer = NULL;
        struct wire_msg hb = sample_msg(&s, WIRE_TYPE_HEARTBEAT, 0, 8);
        double t0 = now_s();
        int tries = 0;
        while ((rc = wire_send(first, &hb, "worker-0", 8)) == 0 && tries++ < 200)
            usleep(5000);
        CHECK(rc == -EHOSTUNREACH, "send to a closed peer: %d after %d tries", rc, tries);
        MEASURE("closed ipc peer noticed by the ROUTER's send after %.1f ms",
                (now_s() - t0) * 1e3);
    }
    log_set_level(LOG_LEVEL_INFO);
    wire_socket_destroy(second);
    wire_socket_destroy(dealer);
    wire_socket_destroy(first);
}

/* Directories of dead processes are swept; ours, live ones and other names stay. */
static void test_rundir_sweep(const char *base)
{
    char mine[WIRE_PATH_MAX], child_dir[WIRE_PATH_MAX], other[WIRE_PATH_MAX + 32];
    int fd[2];
    CHECK(pipe(fd) == 0, "pipe");
    pid_t pid = fork();
    if (pid == 0) { /* a coordinator that dies without cleaning up */
        char d[WIRE_PATH_MAX] = "";
        ssize_t w = wire_rundir_create(base, d, sizeof d) == 0 ? write(fd[1], d, sizeof d) : -1;
        _exit(w == (ssize_t)sizeof d ? 0 : 1);
    }
    close(fd[1]);
    int status = -1;
    ssize_t got = read(fd[0], child_dir, sizeof child_dir);
    close(fd[0]);
    waitpid(pid, &status, 0);
    CHECK(got == (ssize_t)sizeof child_dir && status == 0, "child made a runtime directory");
    if (got != (ssize_t)sizeof child_dir)
        return;
    CHECK(wire_rundir_create(base, mine, sizeof mine) == 0, "our runtime directory");
    snprintf(other, sizeof other, "%s/lamina-12x-abcdef", base);
    CHECK(mkdir(other, 0700) == 0, "a directory of another name");
    struct stat st;
    int n = wire_rundir_sweep(base);
    CHECK(n == 1, "swept %d directories, want 1", n);
    CHECK(stat(child_dir, &st) != 0 && errno == ENOENT, "dead child's %s removed", child_dir);
    CHECK(stat(mine, &st) == 0 && stat(other, &st) == 0, "ours and the foreign name kept");
    CHECK(wire_rundir_sweep(base) == 0, "second sweep removes nothing");
    rmdir(other);
    wire_rundir_remove(mine);
    MEASURE("rundir sweep: a dead process's directory removed, ours and a foreign name kept");
}

/* ---- CURVE ----------------------------------------------------------------------------------- */

static void test_keys(void)
{
    struct wire_keypair kp;
    CHECK(wire_keypair_generate(&kp) == 0, "keypair");
    char txt[WIRE_KEY_Z85_LEN + 1];
    uint8_t back[WIRE_KEY_BYTES];
    wire_key_to_z85(kp.public_key, txt);
    CHECK(strlen(txt) == WIRE_KEY_Z85_LEN, "z85 length");
    CHECK(wire_key_from_z85(txt, back) == 0 && !memcmp(back, kp.public_key, WIRE_KEY_BYTES),
          "z85 round trip");
    char zz[WIRE_KEY_Z85_LEN + 1];
    CHECK(zmq_z85_encode(zz, kp.secret_key, WIRE_KEY_BYTES) &&
              wire_key_to_z85(kp.secret_key, txt) == 0 && !strcmp(zz, txt),
          "our Z85 text equals libzmq's");
    /* The example of the Z85 spec (rfc.zeromq.org/spec/32): 86 4F D2 6F B5 59 F7 5B = HelloWorld */
    uint8_t spec[WIRE_KEY_BYTES] = {0x86, 0x4F, 0xD2, 0x6F, 0xB5, 0x59, 0xF7, 0x5B};
    wire_key_to_z85(spec, txt);
    CHECK(!strncmp(txt, "HelloWorld", 10), "Z85 spec vector: %s", txt);
    log_set_level(LOG_LEVEL_ERROR); /* expected errors below */
    CHECK(wire_key_from_z85("short", back) == -EINVAL, "short key");
    memset(zz, 'a', WIRE_KEY_Z85_LEN);
    zz[WIRE_KEY_Z85_LEN] = '\0';
    zz[7] = ' ';
    CHECK(wire_key_from_z85(zz, back) == -EINVAL, "space in key");
    memset(zz, '#', WIRE_KEY_Z85_LEN);
    CHECK(wire_key_from_z85(zz, back) == -EINVAL, "group over 2^32");
    char longer[WIRE_KEY_Z85_LEN + 2];
    memset(longer, 'a', sizeof longer - 1);
    longer[sizeof longer - 1] = '\0';
    CHECK(wire_key_from_z85(longer, back) == -EINVAL, "41-character key");
    log_set_level(LOG_LEVEL_INFO);
}

static struct wire_socket *curve_client(void *ctx, const char *ep, const char *id,
                                        const struct wire_keypair *own, const uint8_t *server_key)
{
    struct wire_socket_config c = wire_socket_config_default();
    c.routing_id = id;
    c.curve_keys = own;
    c.curve_server_key = server_key;
    c.send_timeout_ms = 300;
    struct wire_socket *s = wire_socket_create(ctx, ZMQ_DEALER, &c);
    CHECK(s && wire_socket_connect(s, ep) == 0, "curve client %s", id);
    return s;
}

static void test_curve(void *ctx)
{
    if (!zmq_has("curve")) {
        CHECK(0, "libzmq lacks CURVE: the tcp path cannot be secured");
        return;
    }
    test_keys();
    struct wire_keypair server_kp, client_kp, other_kp;
    CHECK(!wire_keypair_generate(&server_kp) && !wire_keypair_generate(&client_kp) &&
              !wire_keypair_generate(&other_kp),
          "keypairs");
    struct wire_socket_config sc = wire_socket_config_default();
    sc.curve_keys = &server_kp;
    sc.curve_server = true;
    struct wire_socket *server = wire_socket_create(ctx, ZMQ_ROUTER, &sc);
    char ep[256] = "";
    CHECK(server && wire_socket_bind(server, "tcp://127.0.0.1:*") == 0 &&
              wire_socket_endpoint(server, ep, sizeof ep) == 0,
          "curve server bound at %s", ep);
    struct wire_socket *good = curve_client(ctx, ep, "good", &client_kp, server_kp.public_key);
    struct wire_socket *bad = curve_client(ctx, ep, "bad", &client_kp, other_kp.public_key);
    struct wire_socket_config pc = wire_socket_config_default();
    pc.routing_id = "plain";
    pc.send_timeout_ms = 300;
    struct wire_socket *plain = wire_socket_create(ctx, ZMQ_DEALER, &pc);
    CHECK(plain && wire_socket_connect(plain, ep) == 0, "plain client");
    if (!server || !good || !bad || !plain)
        goto out;

    struct samples s;
    samples_init(&s);
    struct wire_msg m = sample_msg(&s, WIRE_TYPE_STEP, 0, 11), r;
    uint8_t id[WIRE_ID_MAX];
    size_t id_len = sizeof id;
    int rc = -1;
    for (int i = 0; i < 20 && rc; i++) /* the handshake may take a moment: retry the send */
        rc = wire_send(good, &m, NULL, 0);
    CHECK(rc == 0, "good client send: %d", rc);
    rc = wire_recv(server, &r, id, &id_len, 3000);
    CHECK(rc == 0 && id_len == 4 && !memcmp(id, "good", 4), "server got the good client: %d", rc);
    if (rc == 0) {
        check_same(&m, &r, "curve");
        wire_msg_free(&r);
        CHECK(wire_send(server, &m, id, id_len) == 0, "server reply");
        rc = wire_recv(good, &r, NULL, NULL, 3000);
        CHECK(rc == 0, "good client got the reply: %d", rc);
        if (rc == 0)
            check_same(&m, &r, "curve reply");
        wire_msg_free(&r);
    }

    rc = wire_send(bad, &m, NULL, 0);
    CHECK(rc == -ETIMEDOUT, "wrong-key client cannot send (no finished connection): %d", rc);
    rc = wire_send(plain, &m, NULL, 0);
    CHECK(rc == -ETIMEDOUT, "plain client cannot send: %d", rc);
    id_len = sizeof id;
    rc = wire_recv(server, &r, id, &id_len, 300);
    CHECK(rc == -ETIMEDOUT, "nothing from the wrong-key or plain client: %d (id %.*s)", rc,
          rc ? 0 : (int)id_len, (const char *)id);
    wire_msg_free(&r);
    MEASURE("curve: server-keyed client through both ways; wrong key and plain refused");
out:
    wire_socket_destroy(plain);
    wire_socket_destroy(bad);
    wire_socket_destroy(good);
    wire_socket_destroy(server);
}

/* ---- a protobuf writer of our own (the wire format, independent of protobuf-c) ------------ */

#define PB_CAP (300 * 1024)

struct pb {
    uint8_t b[PB_CAP];
    size_t n;
};

static void pb_raw(struct pb *p, uint64_t v)
{
    do {
        uint8_t byte = v & 0x7f;
        v >>= 7;
        p->b[p->n++] = byte | (v ? 0x80 : 0);
    } while (v);
}

static void pb_u(struct pb *p, unsigned field, uint64_t v)
{
    pb_raw(p, (uint64_t)field << 3);
    pb_raw(p, v);
}

static void pb_bytes(struct pb *p, unsigned field, const void *d, size_t n)
{
    pb_raw(p, (uint64_t)field << 3 | 2);
    pb_raw(p, n);
    memcpy(p->b + p->n, d, n);
    p->n += n;
}

static void pb_str(struct pb *p, unsigned field, const char *s)
{
    pb_bytes(p, field, s, strlen(s));
}

static void pb_packed(struct pb *p, unsigned field, const uint32_t *v, size_t n)
{
    static struct pb tmp;
    tmp.n = 0;
    for (size_t i = 0; i < n; i++)
        pb_raw(&tmp, v[i]);
    pb_bytes(p, field, tmp.b, tmp.n);
}

static void pb_envelope(struct pb *out, uint64_t version, uint64_t type, uint64_t seq,
                        const struct pb *payload, uint64_t tensor_bytes)
{
    out->n = 0;
    pb_u(out, 1, version);
    pb_u(out, 2, type);
    pb_u(out, 3, seq);
    pb_bytes(out, 4, payload->b, payload->n);
    pb_u(out, 5, tensor_bytes);
}

static void enc_step(struct pb *p, uint32_t n_tokens, uint32_t n_embd)
{
    p->n = 0;
    pb_u(p, 1, 42); /* seq_id */
    pb_u(p, 2, 7);  /* pos */
    pb_u(p, 3, n_tokens);
    pb_u(p, 4, 9); /* step */
    pb_u(p, 5, 1); /* all_logits */
    pb_u(p, 6, n_embd);
}

static void enc_expert_request(struct pb *p, const uint32_t *experts, size_t ne,
                               const uint32_t *counts, size_t nc, uint32_t n_embd)
{
    p->n = 0;
    pb_u(p, 1, 5);
    pb_u(p, 2, 3);
    pb_packed(p, 3, experts, ne);
    pb_packed(p, 4, counts, nc);
    pb_u(p, 5, n_embd);
}

static void enc_rows(struct pb *p, uint32_t n_rows, uint32_t n_embd) /* ExpertReply */
{
    p->n = 0;
    pb_u(p, 1, 5);
    pb_u(p, 2, 3);
    pb_u(p, 3, n_rows);
    pb_u(p, 4, n_embd);
}

static void enc_result(struct pb *p, uint32_t n_rows, uint32_t n_vocab, int32_t token)
{
    p->n = 0;
    pb_u(p, 1, 1);
    pb_u(p, 2, 2);
    pb_u(p, 3, n_rows);
    pb_u(p, 4, n_vocab);
    pb_u(p, 5, (uint64_t)(int64_t)token);
}

static void enc_load_plan(struct pb *p, uint32_t begin, uint32_t end, uint32_t total,
                          const uint32_t *res_layers, size_t n_res, size_t bitmap_bytes,
                          uint32_t n_embd, bool is_last, const char *next)
{
    static uint8_t bitmap[WIRE_BITMAP_MAX + 64];
    static struct pb r;
    p->n = 0;
    pb_str(p, 1, "/m.gguf");
    pb_str(p, 2, "/lamina-1-x");
    pb_u(p, 3, 1 << 20);
    pb_u(p, 4, begin);
    pb_u(p, 5, end);
    pb_u(p, 6, total);
    for (size_t i = 0; i < n_res; i++) {
        r.n = 0;
        pb_u(&r, 1, res_layers[i]);
        pb_bytes(&r, 2, bitmap, bitmap_bytes);
        pb_bytes(p, 7, r.b, r.n);
    }
    pb_str(p, 8, "cpu");
    pb_u(p, 10, 4096);     /* n_ctx */
    pb_u(p, 12, 64);       /* max_batch */
    pb_str(p, 14, next);   /* next_endpoint */
    pb_u(p, 16, is_last);
    pb_u(p, 17, n_embd);
    pb_u(p, 18, 1000);     /* n_vocab */
}

/* ---- fuzz ------------------------------------------------------------------------------------ */

struct raw {
    struct pb env;
    bool tensor_frame;  /* send a tensor frame of tensor_n bytes after the envelope */
    size_t tensor_n;
    int extra_frames;   /* one-byte frames after those */
    int expect;         /* the wire_reject reason, or -1 when any reason will do */
};

static uint64_t rng_next(uint64_t *s)
{
    *s ^= *s << 13;
    *s ^= *s >> 7;
    *s ^= *s << 17;
    return *s;
}

static uint32_t rng_below(uint64_t *s, uint32_t n)
{
    return (uint32_t)(rng_next(s) % n);
}

static void raw_send(void *z, const struct raw *r, const uint8_t *tensor)
{
    int frames = 1 + (r->tensor_frame ? 1 : 0) + r->extra_frames, k = 1;
    zmq_send(z, r->env.b, r->env.n, k++ < frames ? ZMQ_SNDMORE : 0);
    if (r->tensor_frame)
        zmq_send(z, tensor, r->tensor_n, k++ < frames ? ZMQ_SNDMORE : 0);
    for (int i = 0; i < r->extra_frames; i++)
        zmq_send(z, "x", 1, k++ < frames ? ZMQ_SNDMORE : 0);
}

/* A valid Step with a tensor: the base of several mutations. */
static void valid_step(struct raw *r, uint64_t *rng)
{
    static struct pb payload;
    uint32_t n_tokens = 1 + rng_below(rng, 4), n_embd = 1 + rng_below(rng, 64);
    enc_step(&payload, n_tokens, n_embd);
    r->tensor_n = (size_t)n_tokens * n_embd * 4;
    pb_envelope(&r->env, WIRE_VERSION, WIRE_TYPE_STEP, rng_next(rng), &payload, r->tensor_n);
    r->tensor_frame = true;
}

/* A payload no protobuf reader accepts: a bad wire type, a varint cut short, or a length past
 * the end. */
static void garbage_payload(struct pb *p, uint64_t *rng)
{
    p->n = 0;
    switch (rng_below(rng, 3)) {
    case 0:
        pb_raw(p, (uint64_t)(1 + rng_below(rng, 30)) << 3 | (6 + rng_below(rng, 2)));
        for (uint32_t i = rng_below(rng, 20); i; i--)
            p->b[p->n++] = (uint8_t)rng_next(rng);
        break;
    case 1:
        pb_raw(p, (uint64_t)(1 + rng_below(rng, 30)) << 3);
        for (uint32_t i = 1 + rng_below(rng, 9); i; i--)
            p->b[p->n++] = 0xff;
        break;
    default:
        pb_raw(p, (uint64_t)(1 + rng_below(rng, 30)) << 3 | 2);
        pb_raw(p, 1000 + rng_below(rng, 1000));
        for (uint32_t i = rng_below(rng, 50); i; i--)
            p->b[p->n++] = (uint8_t)rng_next(rng);
        break;
    }
}

static void fuzz_fields(struct raw *r, uint64_t *rng, struct pb *pl)
{
    static char big[WIRE_STRING_MAX + 100];
    memset(big, 'a', sizeof big - 1);
    uint32_t layers_ok[2] = {4, 6}, layers_bad[2] = {6, 6}, layers_out[1] = {9};
    r->expect = WIRE_REJECT_FIELDS;
    uint64_t type = WIRE_TYPE_LOAD_PLAN;
    switch (rng_below(rng, 12)) {
    case 0: enc_load_plan(pl, 5, 5, 8, NULL, 0, 0, 64, false, ""); break; /* empty range */
    case 1: enc_load_plan(pl, 4, 9, 8, NULL, 0, 0, 64, false, ""); break; /* past total */
    case 2: enc_load_plan(pl, 4, 8, 8, layers_bad, 2, 8, 64, false, ""); break;
    case 3: enc_load_plan(pl, 4, 8, 8, layers_out, 1, 8, 64, false, ""); break;
    case 4: enc_load_plan(pl, 4, 8, 8, layers_ok, 2, WIRE_BITMAP_MAX + 1, 64, false, ""); break;
    case 5: enc_load_plan(pl, 4, 8, 8, layers_ok, 2, 8, 0, false, ""); break; /* n_embd 0 */
    case 6: enc_load_plan(pl, 4, 8, 8, NULL, 0, 0, 64, true, "ipc:///x/y.sock"); break;
    case 7:
        type = WIRE_TYPE_HELLO;
        pl->n = 0;
        pb_str(pl, 3, big);
        break;
    case 11: { /* a CURVE key of the wrong length */
        static const uint8_t key[WIRE_KEY_BYTES + 1];
        type = WIRE_TYPE_HELLO;
        pl->n = 0;
        pb_bytes(pl, 6, key, rng_below(rng, 2) ? WIRE_KEY_BYTES - 1 : WIRE_KEY_BYTES + 1);
        break;
    }
    case 8:
        type = WIRE_TYPE_TIMING;
        pl->n = 0;
        pb_str(pl, 1, "{\"a\":1}\n{\"b\":2}");
        break;
    case 9:
        type = WIRE_TYPE_RESULT;
        enc_result(pl, 0, 100, rng_below(rng, 2) ? -2 - (int32_t)rng_below(rng, 1000)
                                                 : 100 + (int32_t)rng_below(rng, 1000));
        break;
    default:
        type = WIRE_TYPE_RESULT; /* neither token nor logits */
        enc_result(pl, 0, 100, -1);
        break;
    }
    pb_envelope(&r->env, WIRE_VERSION, type, 1, pl, 0);
}

static void fuzz_shape(struct raw *r, uint64_t *rng, struct pb *pl)
{
    r->expect = WIRE_REJECT_SHAPE;
    uint32_t rows = 1 + rng_below(rng, 4), width = 1 + rng_below(rng, 32);
    r->tensor_frame = true;
    r->tensor_n = (size_t)rows * width * 4 + 4 * (1 + rng_below(rng, 3)); /* always off */
    uint64_t type = WIRE_TYPE_STEP;
    switch (rng_below(rng, 6)) {
    case 0: enc_step(pl, rows, width); break;
    case 1: enc_step(pl, 0, width); break;
    case 2: enc_step(pl, rows, 0); break;
    case 3: type = WIRE_TYPE_EXPERT_REPLY; enc_rows(pl, rows, width); break;
    case 4: type = WIRE_TYPE_RESULT; enc_result(pl, rows, width, -1); break;
    default: /* a type that carries no tensor */
        type = rng_below(rng, 2) ? WIRE_TYPE_HEARTBEAT : WIRE_TYPE_READY;
        pl->n = 0;
        pb_u(pl, 1, 5);
        break;
    }
    pb_envelope(&r->env, WIRE_VERSION, type, 1, pl, r->tensor_n);
}

static void fuzz_experts(struct raw *r, uint64_t *rng, struct pb *pl, int cls)
{
    uint32_t experts[WIRE_EXPERTS_MAX + 1], counts[WIRE_EXPERTS_MAX + 1];
    size_t ne = 1 + rng_below(rng, 5), nc = ne;
    uint32_t n_embd = 1 + rng_below(rng, 16);
    uint64_t rows = 0;
    for (size_t i = 0; i < ne; i++) {
        experts[i] = rng_below(rng, 512);
        counts[i] = 1 + rng_below(rng, 3);
        rows += counts[i];
    }
    r->tensor_frame = true;
    r->tensor_n = rows * n_embd * 4;
    if (cls == 8) { /* arrays of different lengths */
        r->expect = WIRE_REJECT_FIELDS;
        nc = rng_below(rng, 2) ? ne - 1 : ne + 1;
        counts[ne] = 1;
    } else if (cls == 9) { /* rows x width disagree with the frame, or overflow */
        r->expect = WIRE_REJECT_SHAPE;
        if (rng_below(rng, 2)) {
            r->tensor_n += (size_t)n_embd * 4;
        } else {
            counts[0] = counts[1] = 0xffffffffu;
            experts[0] = experts[1] = 1;
            ne = nc = 2;
            n_embd = 0xffffffffu;
            r->tensor_n = 64;
        }
    } else { /* a zero count, or too many experts */
        r->expect = WIRE_REJECT_FIELDS;
        if (rng_below(rng, 2)) {
            counts[rng_below(rng, (uint32_t)ne)] = 0;
        } else {
            ne = nc = WIRE_EXPERTS_MAX + 1;
            for (size_t i = 0; i < ne; i++)
                experts[i] = counts[i] = 1;
            r->tensor_n = ne * n_embd * 4;
        }
    }
    enc_expert_request(pl, experts, ne, counts, nc, n_embd);
    pb_envelope(&r->env, WIRE_VERSION, WIRE_TYPE_EXPERT_REQUEST, 1, pl, r->tensor_n);
}

/* Fills r with malformed message number i. */
static void fuzz_case(struct raw *r, int i, uint64_t *rng)
{
    static struct pb pl;
    int cls = i % FUZZ_CLASSES;
    r->tensor_frame = false;
    r->tensor_n = 0;
    r->extra_frames = 0;
    r->expect = -1;
    switch (cls) {
    case 0: /* a valid step envelope cut short */
        valid_step(r, rng);
        r->env.n = rng_below(rng, (uint32_t)r->env.n);
        break;
    case 1: /* tensor frame size off the declared one */
        valid_step(r, rng);
        r->expect = WIRE_REJECT_FRAMES;
        r->tensor_n = rng_below(rng, 2) ? r->tensor_n + 1 + rng_below(rng, 64)
                                        : rng_below(rng, (uint32_t)r->tensor_n);
        break;
    case 2: /* declared tensor, no tensor frame */
        valid_step(r, rng);
        r->expect = WIRE_REJECT_FRAMES;
        r->tensor_frame = false;
        break;
    case 3: /* extra frames after a step or a heartbeat */
        r->expect = WIRE_REJECT_FRAMES;
        r->extra_frames = 1 + (int)rng_below(rng, 3);
        if (rng_below(rng, 2)) {
            valid_step(r, rng);
        } else {
            pl.n = 0;
            pb_u(&pl, 1, 3);
            pb_envelope(&r->env, WIRE_VERSION, WIRE_TYPE_HEARTBEAT, 1, &pl, 0);
        }
        break;
    case 4: /* random bytes, one or two frames */
        r->env.n = 1 + rng_below(rng, 300);
        for (size_t k = 0; k < r->env.n; k++)
            r->env.b[k] = (uint8_t)rng_next(rng);
        r->tensor_frame = rng_below(rng, 2);
        r->tensor_n = rng_below(rng, 64);
        break;
    case 5: /* valid envelope, garbage payload */
        r->expect = WIRE_REJECT_PAYLOAD;
        garbage_payload(&pl, rng);
        pb_envelope(&r->env, WIRE_VERSION, WIRE_TYPE_FIRST + rng_below(rng, WIRE_TYPE_LAST), 1,
                    &pl, 0);
        break;
    case 6: { /* unknown type */
        static const uint64_t types[] = {0, WIRE_TYPE_LAST + 1, 100, 0xffff, 0xffffffffu};
        r->expect = WIRE_REJECT_TYPE;
        pl.n = 0;
        pb_envelope(&r->env, WIRE_VERSION, types[rng_below(rng, 5)], 1, &pl, 0);
        break;
    }
    case 7: { /* wrong version */
        static const uint64_t versions[] = {0, WIRE_VERSION + 1, 77, 0xffffffffu};
        r->expect = WIRE_REJECT_VERSION;
        pl.n = 0;
        pb_u(&pl, 1, 1);
        pb_envelope(&r->env, versions[rng_below(rng, 4)], WIRE_TYPE_HEARTBEAT, 1, &pl, 0);
        break;
    }
    case 8:
    case 9:
    case 10:
        fuzz_experts(r, rng, &pl, cls);
        break;
    case 11:
    case 12:
        fuzz_shape(r, rng, &pl);
        break;
    case 13:
    case 14:
        fuzz_fields(r, rng, &pl);
        break;
    default: /* empty or oversized envelope */
        r->expect = WIRE_REJECT_ENVELOPE;
        r->env.n = (i / FUZZ_CLASSES) % 16 == 0 ? WIRE_ENVELOPE_MAX + 1 + rng_below(rng, 100) : 0;
        memset(r->env.b, 0x08, r->env.n);
        break;
    }
}

/* Lines of f (rewound) that contain what. */
static int count_lines(FILE *f, const char *what)
{
    char line[1024];
    int n = 0;
    if (!f)
        return -1;
    rewind(f);
    while (fgets(line, sizeof line, f))
        n += strstr(line, what) != NULL;
    return n;
}

/* The reason wire_recv counted between two stats snapshots, or -1. */
static int reject_reason(const struct wire_stats *before, const struct wire_stats *after)
{
    for (int k = 0; k < WIRE_REJECT_COUNT; k++)
        if (after->rejected_by[k] == before->rejected_by[k] + 1)
            return k;
    return -1;
}

static void fuzz_flips(struct wire_socket *router, void *raw, uint64_t *rng, const uint8_t *tensor)
{
    struct samples s;
    samples_init(&s);
    static struct raw r;
    static struct pb pl;
    int accepted = 0, rejected = 0, other = 0;
    uint64_t rej0 = wire_socket_stats(router)->rejected;
    uint64_t acc0 = wire_socket_stats(router)->received;
    for (int i = 0; i < FLIP_N; i++) {
        r.extra_frames = 0;
        r.expect = -1;
        if (i % 2) {
            valid_step(&r, rng);
        } else {
            uint32_t res[2] = {4, 6};
            enc_load_plan(&pl, 4, 8, 8, res, 2, 8, 64, false, "ipc:///a/b.sock");
            pb_envelope(&r.env, WIRE_VERSION, WIRE_TYPE_LOAD_PLAN, 1, &pl, 0);
            r.tensor_frame = false;
            r.tensor_n = 0;
        }
        for (uint32_t k = 1 + rng_below(rng, 3); k; k--)
            r.env.b[rng_below(rng, (uint32_t)r.env.n)] = (uint8_t)rng_next(rng);
        raw_send(raw, &r, tensor);
        struct wire_msg m;
        uint8_t id[WIRE_ID_MAX];
        size_t id_len = sizeof id;
        int rc = wire_recv(router, &m, id, &id_len, 1000);
        accepted += rc == 0;
        rejected += rc == -EPROTO;
        other += rc != 0 && rc != -EPROTO;
        wire_msg_free(&m);
    }
    const struct wire_stats *st = wire_socket_stats(router);
    CHECK(other == 0 && accepted + rejected == FLIP_N, "flips: %d other results", other);
    CHECK(st->rejected - rej0 == (uint64_t)rejected && st->received - acc0 == (uint64_t)accepted,
          "flip counters agree with the returns");
    MEASURE("byte flips of valid messages: %d accepted (flips in values), %d rejected, no crash",
            accepted, rejected);
}

static void test_fuzz(void *ctx)
{
    struct wire_socket *router = wire_socket_create(ctx, ZMQ_ROUTER, NULL);
    void *raw = zmq_socket(ctx, ZMQ_DEALER);
    int zero = 0;
    zmq_setsockopt(raw, ZMQ_LINGER, &zero, sizeof zero);
    zmq_setsockopt(raw, ZMQ_ROUTING_ID, "fuzzer", 6);
    CHECK(router && raw && wire_socket_bind(router, "inproc://fuzz") == 0 &&
              zmq_connect(raw, "inproc://fuzz") == 0,
          "fuzz sockets");
    uint8_t *tensor = calloc(1, 1 << 20);
    static struct raw r;
    /* The warnings of the fuzz go to a file, to count them: one per reason. */
    FILE *warnings = tmpfile();
    int saved_stderr = dup(2);
    if (!router || !raw || !tensor || !warnings || saved_stderr < 0)
        goto out;
    CHECK(dup2(fileno(warnings), 2) == 2, "stderr redirect");

    uint64_t rng = 0x9e3779b97f4a7c15ull;
    int rejected = 0, wrong_reason = 0;
    double t0 = now_s();
    for (int i = 0; i < FUZZ_N; i++) {
        fuzz_case(&r, i, &rng);
        struct wire_stats before = *wire_socket_stats(router);
        raw_send(raw, &r, tensor);
        struct wire_msg m;
        uint8_t id[WIRE_ID_MAX];
        size_t id_len = sizeof id;
        int rc = wire_recv(router, &m, id, &id_len, 1000);
        int why = reject_reason(&before, wire_socket_stats(router));
        if (rc == -EPROTO) {
            rejected++;
        } else {
            CHECK(0, "fuzz case %d (class %d): wire_recv returned %d, want -EPROTO", i,
                  i % FUZZ_CLASSES, rc);
        }
        if (rc == -EPROTO && r.expect >= 0 && why != r.expect && wrong_reason++ < 10)
            CHECK(0, "fuzz case %d (class %d): reason %s, want %s", i, i % FUZZ_CLASSES,
                  wire_reject_name((enum wire_reject)why),
                  wire_reject_name((enum wire_reject)r.expect));
        CHECK(rc != -EPROTO || (m.storage == NULL && m.tensor == NULL), "rejected msg zeroed");
        wire_msg_free(&m);
    }
    double dt = now_s() - t0;
    dup2(saved_stderr, 2);
    int warned = count_lines(warnings, "dropped a malformed message from 'fuzzer'");
    CHECK(warned == WIRE_REJECT_COUNT, "%d reject warnings logged, want one per reason (%d)",
          warned, WIRE_REJECT_COUNT);
    const struct wire_stats *st = wire_socket_stats(router);
    CHECK(rejected == FUZZ_N && st->rejected == FUZZ_N && st->received == 0,
          "fuzz: %d of %d rejected, stats rejected %llu received %llu", rejected, FUZZ_N,
          (unsigned long long)st->rejected, (unsigned long long)st->received);
    CHECK(wrong_reason == 0, "%d rejections for an unexpected reason", wrong_reason);
    uint64_t sum = 0;
    for (int k = 0; k < WIRE_REJECT_COUNT; k++) {
        CHECK(st->rejected_by[k] > 0, "no rejection counted as %s",
              wire_reject_name((enum wire_reject)k));
        sum += st->rejected_by[k];
    }
    CHECK(sum == st->rejected, "per-reason counts sum to the total");
    MEASURE("fuzz: %d malformed messages, all rejected in %.2f s (%.1f us each); by reason: "
            "frames %llu envelope %llu version %llu type %llu payload %llu shape %llu "
            "fields %llu", FUZZ_N, dt, dt / FUZZ_N * 1e6,
            (unsigned long long)st->rejected_by[0], (unsigned long long)st->rejected_by[1],
            (unsigned long long)st->rejected_by[2], (unsigned long long)st->rejected_by[3],
            (unsigned long long)st->rejected_by[4], (unsigned long long)st->rejected_by[5],
            (unsigned long long)st->rejected_by[6]);

    fuzz_flips(router, raw, &rng, tensor);

    /* A valid step written by our own protobuf writer, then one with an unknown extra field
     * (a newer peer's addition within the same version), still come through intact. */
    static struct pb pl;
    float *h = (float *)tensor;
    for (int k = 0; k < 3 * 8; k++)
        h[k] = (float)k - 0.5f;
    for (int extra = 0; extra < 2; extra++) {
        enc_step(&pl, 3, 8);
        if (extra)
            pb_u(&pl, 99, 12345);
        pb_envelope(&r.env, WIRE_VERSION, WIRE_TYPE_STEP, 31337, &pl, 3 * 8 * 4);
        r.tensor_frame = true;
        r.tensor_n = 3 * 8 * 4;
        r.extra_frames = 0;
        raw_send(raw, &r, tensor);
        struct wire_msg m;
        uint8_t id[WIRE_ID_MAX];
        size_t id_len = sizeof id;
        int rc = wire_recv(router, &m, id, &id_len, 1000);
        CHECK(rc == 0, "valid step after the fuzz (extra field %d): %d", extra, rc);
        if (rc == 0) {
            CHECK(m.type == WIRE_TYPE_STEP && m.seq_no == 31337 && m.step.seq_id == 42 &&
                      m.step.pos == 7 && m.step.n_tokens == 3 && m.step.step == 9 &&
                      m.step.all_logits && m.step.n_embd == 8 && m.tensor_bytes == 96 &&
                      !memcmp(m.tensor, h, 96) && id_len == 6 && !memcmp(id, "fuzzer", 6),
                  "valid step fields after the fuzz");
        }
        wire_msg_free(&m);
    }
out:
    if (saved_stderr >= 0)
        close(saved_stderr);
    if (warnings)
        fclose(warnings);
    free(tensor);
    if (raw)
        zmq_close(raw);
    wire_socket_destroy(router);
}

/* ---- NCCL hand-off fields ------------------------------------------------------------------ */

/* Sends one raw message and returns wire_recv's result; m is filled on 0 (caller frees). */
static int raw_round(struct wire_socket *router, void *raw, struct raw *r, const uint8_t *tensor,
                     struct wire_msg *m)
{
    uint8_t id[WIRE_ID_MAX];
    size_t id_len = sizeof id;
    raw_send(raw, r, tensor);
    return wire_recv(router, m, id, &id_len, 1000);
}

/* LoadPlan NCCL ids: 128 bytes arrive intact, any other non-zero length is refused (fields);
 * an nccl_next_id on the last worker is refused by wire_send; a Step via NCCL carries no
 * tensor frame (one that does is refused both ways), and arrives without one. */
static void test_nccl_fields(void *ctx)
{
    struct wire_socket *router = wire_socket_create(ctx, ZMQ_ROUTER, NULL);
    void *raw = zmq_socket(ctx, ZMQ_DEALER);
    int zero = 0;
    zmq_setsockopt(raw, ZMQ_LINGER, &zero, sizeof zero);
    CHECK(router && raw && wire_socket_bind(router, "inproc://nccl") == 0 &&
              zmq_connect(raw, "inproc://nccl") == 0,
          "nccl field sockets");
    static uint8_t tensor[4096], id[WIRE_NCCL_ID_BYTES + 8];
    static struct raw r;
    static struct pb pl;
    for (size_t i = 0; i < sizeof id; i++)
        id[i] = (uint8_t)(i ^ 0x5a);
    log_set_level(LOG_LEVEL_ERROR); /* the rejections below warn */
    const size_t sizes[] = {WIRE_NCCL_ID_BYTES, 0, 1, WIRE_NCCL_ID_BYTES - 1,
                            WIRE_NCCL_ID_BYTES + 1, 32};
    int refused = 0;
    for (int field = 21; field <= 22; field++) {
        for (size_t k = 0; k < sizeof sizes / sizeof sizes[0]; k++) {
            enc_load_plan(&pl, 4, 8, 8, NULL, 0, 0, 64, false, "ipc:///a/b.sock");
            pb_bytes(&pl, (unsigned)field, id, sizes[k]);
            pb_envelope(&r.env, WIRE_VERSION, WIRE_TYPE_LOAD_PLAN, 1, &pl, 0);
            r.tensor_frame = false;
            r.tensor_n = 0;
            r.extra_frames = 0;
            struct wire_stats before = *wire_socket_stats(router);
            struct wire_msg m;
            int rc = raw_round(router, raw, &r, tensor, &m);
            const bool good = sizes[k] == 0 || sizes[k] == WIRE_NCCL_ID_BYTES;
            const struct wire_load_plan *p = &m.load_plan;
            const bool has = field == 21 ? p->has_nccl_prev : p->has_nccl_next;
            const uint8_t *got = field == 21 ? p->nccl_prev_id : p->nccl_next_id;
            if (good)
                CHECK(rc == 0 && has == (sizes[k] != 0) &&
                          (!has || !memcmp(got, id, WIRE_NCCL_ID_BYTES)) &&
                          (field == 21 ? !p->has_nccl_next : !p->has_nccl_prev),
                      "nccl id field %d of %zu bytes: rc %d, has %d", field, sizes[k], rc, has);
            else
                CHECK(rc == -EPROTO && reject_reason(&before, wire_socket_stats(router)) ==
                                           WIRE_REJECT_FIELDS,
                      "nccl id field %d of %zu bytes refused: rc %d", field, sizes[k], rc);
            refused += !good && rc == -EPROTO;
            wire_msg_free(&m);
        }
    }
    struct samples s;
    samples_init(&s);
    struct wire_msg m = sample_msg(&s, WIRE_TYPE_LOAD_PLAN, 0, 1);
    struct wire_socket *dealer = wire_socket_create(ctx, ZMQ_DEALER, NULL);
    m.load_plan.is_last = true;
    m.load_plan.next_endpoint = NULL;
    CHECK(dealer && wire_send(dealer, &m, NULL, 0) == -EINVAL,
          "load_plan of the last worker with an nccl_next_id refused by wire_send");
    struct wire_layer_residency bad_foreign[3] = {s.foreign[0], s.foreign[1], s.foreign[1]};
    const uint32_t bad_layers[][2] = {{2, 25}, {45, 2}, {2, 48}, {2, 2}};
    for (size_t k = 0; k < sizeof bad_layers / sizeof bad_layers[0]; k++) {
        /* inside the range, decreasing, past the total, repeated */
        m = sample_msg(&s, WIRE_TYPE_LOAD_PLAN, 0, 1);
        bad_foreign[0].layer = bad_layers[k][0];
        bad_foreign[1].layer = bad_layers[k][1];
        m.load_plan.foreign = bad_foreign;
        CHECK(dealer && wire_send(dealer, &m, NULL, 0) == -EINVAL,
              "load_plan with foreign layers %u, %u refused by wire_send", bad_layers[k][0],
              bad_layers[k][1]);
    }
    m = sample_msg(&s, WIRE_TYPE_LOAD_PLAN, 0, 1);
    bad_foreign[0] = s.foreign[0];
    bad_foreign[0].trunk = true;
    m.load_plan.foreign = bad_foreign;
    CHECK(dealer && wire_send(dealer, &m, NULL, 0) == -EINVAL,
          "load_plan with a foreign entry claiming a trunk refused by wire_send");
    m = sample_msg(&s, WIRE_TYPE_LOAD_PLAN, 0, 1);
    m = sample_msg(&s, WIRE_TYPE_STEP, 1, 2);
    m.tensor = s.hidden;
    m.tensor_bytes = sizeof s.hidden;
    CHECK(dealer && wire_send(dealer, &m, NULL, 0) == -EINVAL,
          "step via nccl with a tensor refused by wire_send");
    wire_socket_destroy(dealer);
    for (int frame = 0; frame < 2; frame++) { /* raw: via_nccl with and without a frame */
        enc_step(&pl, 3, N_EMBD);
        pb_u(&pl, 7, 1);
        r.tensor_frame = frame;
        r.tensor_n = frame ? 3 * N_EMBD * 4 : 0;
        pb_envelope(&r.env, WIRE_VERSION, WIRE_TYPE_STEP, 1, &pl, r.tensor_n);
        struct wire_stats before = *wire_socket_stats(router);
        struct wire_msg got;
        int rc = raw_round(router, raw, &r, tensor, &got);
        if (frame)
            CHECK(rc == -EPROTO && reject_reason(&before, wire_socket_stats(router)) ==
                                       WIRE_REJECT_SHAPE,
                  "step via nccl with a tensor frame refused (shape): %d", rc);
        else
            CHECK(rc == 0 && got.step.via_nccl && got.step.n_tokens == 3 && !got.tensor &&
                      got.tensor_bytes == 0,
                  "step via nccl without a frame accepted: %d", rc);
        wire_msg_free(&got);
    }
    log_set_level(LOG_LEVEL_INFO);
    MEASURE("nccl fields: ids of 0 and %d bytes carried, %d wrong-size ids refused, step via "
            "nccl without a tensor only", WIRE_NCCL_ID_BYTES, refused);
    if (raw)
        zmq_close(raw);
    wire_socket_destroy(router);
}

/* ---- sampling on the last worker ----------------------------------------------------------- */

static void pb_f32(struct pb *p, unsigned field, float v)
{
    pb_raw(p, (uint64_t)field << 3 | 5);
    memcpy(p->b + p->n, &v, 4); /* little-endian hosts only, as the tensor frames */
    p->n += 4;
}

static void pb_f64(struct pb *p, unsigned field, double v)
{
    pb_raw(p, (uint64_t)field << 3 | 1);
    memcpy(p->b + p->n, &v, 8);
    p->n += 8;
}

struct step_sample {
    bool sample, all_logits;
    float temperature, top_p, min_p, repeat_penalty, presence_penalty;
    int32_t top_k;
    double uniform;
    const int32_t *window;
    size_t n_window;
};

/* A step of 2 x N_EMBD rows with the sampler fields of q (the window as packed varints). */
static void enc_step_sample(struct pb *p, const struct step_sample *q)
{
    static struct pb tmp;
    p->n = 0;
    pb_u(p, 1, 42);
    pb_u(p, 2, 7);
    pb_u(p, 3, 2);
    pb_u(p, 4, 9);
    pb_u(p, 5, q->all_logits);
    pb_u(p, 6, N_EMBD);
    pb_u(p, 8, q->sample);
    pb_f32(p, 9, q->temperature);
    pb_u(p, 10, (uint64_t)(int64_t)q->top_k); /* int32: negatives as 10-byte varints */
    pb_f32(p, 11, q->top_p);
    pb_f32(p, 12, q->min_p);
    pb_f32(p, 13, q->repeat_penalty);
    pb_f32(p, 14, q->presence_penalty);
    pb_f64(p, 15, q->uniform);
    tmp.n = 0;
    for (size_t i = 0; i < q->n_window; i++)
        pb_raw(&tmp, (uint64_t)(int64_t)q->window[i]);
    if (q->n_window)
        pb_bytes(p, 16, tmp.b, tmp.n);
}

/* Step sampler fields: carried through a round trip (raw protobuf in, our struct out, and
 * wire_send -> wire_recv), and each out-of-range value refused as a fields reject on receipt
 * and by wire_send. */
static void test_step_sample(void *ctx)
{
    struct wire_socket *router = wire_socket_create(ctx, ZMQ_ROUTER, NULL);
    struct wire_socket *dealer = wire_socket_create(ctx, ZMQ_DEALER, NULL);
    void *raw = zmq_socket(ctx, ZMQ_DEALER);
    int zero = 0;
    zmq_setsockopt(raw, ZMQ_LINGER, &zero, sizeof zero);
    CHECK(router && dealer && raw && wire_socket_bind(router, "inproc://sample") == 0 &&
              zmq_connect(raw, "inproc://sample") == 0 &&
              wire_socket_connect(dealer, "inproc://sample") == 0,
          "sample field sockets");
    static uint8_t tensor[2 * N_EMBD * 4];
    static int32_t window[WIRE_WINDOW_MAX + 1];
    static struct raw r;
    static struct pb pl;
    for (size_t i = 0; i < sizeof window / sizeof window[0]; i++)
        window[i] = (int32_t)(i * 7919 % 151936);
    const struct step_sample good = {.sample = true, .temperature = 0.8f, .top_k = 40,
                                     .top_p = 0.95f, .min_p = 0.05f, .repeat_penalty = 1.1f,
                                     .presence_penalty = -0.5f, .uniform = 0.999999999,
                                     .window = window, .n_window = 64};
    /* raw in: every field arrives as sent */
    enc_step_sample(&pl, &good);
    pb_envelope(&r.env, WIRE_VERSION, WIRE_TYPE_STEP, 1, &pl, sizeof tensor);
    r.tensor_frame = true;
    r.tensor_n = sizeof tensor;
    r.extra_frames = 0;
    struct wire_msg m;
    int rc = raw_round(router, raw, &r, tensor, &m);
    const struct wire_step *st = &m.step;
    CHECK(rc == 0 && st->sample && !st->all_logits && st->temperature == 0.8f &&
              st->top_k == 40 && st->top_p == 0.95f && st->min_p == 0.05f &&
              st->repeat_penalty == 1.1f && st->presence_penalty == -0.5f &&
              st->uniform == 0.999999999 && st->n_window == 64 && st->window &&
              !memcmp(st->window, window, 64 * sizeof(int32_t)),
          "step sampler fields carried: rc %d", rc);
    wire_msg_free(&m);
    /* wire_send -> wire_recv, the largest window, greedy */
    struct wire_msg o = {.type = WIRE_TYPE_STEP};
    o.step = (struct wire_step){.seq_id = 1, .pos = 3, .n_tokens = 2, .step = 5,
                                .n_embd = N_EMBD, .sample = true, .repeat_penalty = 1.5f,
                                .window = window, .n_window = WIRE_WINDOW_MAX};
    o.tensor = tensor;
    o.tensor_bytes = sizeof tensor;
    char id[WIRE_ID_MAX];
    size_t id_len = sizeof id;
    rc = dealer ? wire_send(dealer, &o, NULL, 0) : -EINVAL;
    rc = rc ? rc : wire_recv(router, &m, id, &id_len, 2000);
    CHECK(rc == 0 && m.step.sample && m.step.temperature == 0 && m.step.uniform == 0 &&
              m.step.repeat_penalty == 1.5f && m.step.n_window == WIRE_WINDOW_MAX &&
              !memcmp(m.step.window, window, WIRE_WINDOW_MAX * sizeof(int32_t)),
          "greedy step with a window of %d ids: rc %d", WIRE_WINDOW_MAX, rc);
    wire_msg_free(&m);
    /* rejects: one bad value at a time */
    log_set_level(LOG_LEVEL_ERROR); /* the rejections below warn */
    int refused = 0, n_bad = 0;
    for (int k = 0; k < 14; k++) {
        struct step_sample b = good;
        int32_t neg[3] = {5, -1, 9};
        switch (k) {
        case 0: b.temperature = -0.1f; break;
        case 1: b.temperature = INFINITY; break;
        case 2: b.top_k = -1; break;
        case 3: b.top_p = 1.5f; break;
        case 4: b.min_p = -0.01f; break;
        case 5: b.min_p = NAN; break;
        case 6: b.repeat_penalty = -1; break;
        case 7: b.presence_penalty = NAN; break;
        case 8: b.uniform = 1.0; break;
        case 9: b.uniform = -1e-9; break;
        case 10: b.window = neg; b.n_window = 3; break;
        case 11: b.n_window = WIRE_WINDOW_MAX + 1; break;
        case 12: b.all_logits = true; break;
        default: b.sample = false; break; /* a window without sample */
        }
        enc_step_sample(&pl, &b);
        pb_envelope(&r.env, WIRE_VERSION, WIRE_TYPE_STEP, 1, &pl, sizeof tensor);
        struct wire_stats before = *wire_socket_stats(router);
        rc = raw_round(router, raw, &r, tensor, &m);
        CHECK(rc == -EPROTO &&
                  reject_reason(&before, wire_socket_stats(router)) == WIRE_REJECT_FIELDS,
              "bad step sampler case %d refused on receipt: rc %d", k, rc);
        wire_msg_free(&m);
        o.step = (struct wire_step){.n_tokens = 2, .n_embd = N_EMBD, .sample = b.sample,
                                    .all_logits = b.all_logits, .temperature = b.temperature,
                                    .top_k = b.top_k, .top_p = b.top_p, .min_p = b.min_p,
                                    .repeat_penalty = b.repeat_penalty,
                                    .presence_penalty = b.presence_penalty,
                                    .uniform = b.uniform, .window = b.window,
                                    .n_window = b.n_window};
        int sr = dealer ? wire_send(dealer, &o, NULL, 0) : 0;
        CHECK(sr == -EINVAL, "bad step sampler case %d refused by wire_send: %d", k, sr);
        refused += rc == -EPROTO && sr == -EINVAL;
        n_bad++;
    }
    log_set_level(LOG_LEVEL_INFO);
    MEASURE("step sampler fields: carried (window up to %d ids), %d of %d bad values refused "
            "on receipt and by wire_send", WIRE_WINDOW_MAX, refused, n_bad);
    if (raw)
        zmq_close(raw);
    wire_socket_destroy(dealer);
    wire_socket_destroy(router);
}

/* ---- ZMQ_MAXMSGSIZE ------------------------------------------------------------------------ */

static void test_max_msg_size(void *ctx, const char *dir)
{
    char ep[256];
    if (wire_endpoint_ipc(ep, sizeof ep, dir, "maxmsg"))
        return;
    struct wire_socket_config c = wire_socket_config_default();
    c.max_msg_bytes = 1 << 20;
    struct wire_socket *router = wire_socket_create(ctx, ZMQ_ROUTER, &c);
    void *raw = zmq_socket(ctx, ZMQ_DEALER);
    int zero = 0;
    zmq_setsockopt(raw, ZMQ_LINGER, &zero, sizeof zero);
    size_t big = (2u << 20);
    uint8_t *tensor = calloc(1, big);
    CHECK(router && raw && tensor && wire_socket_bind(router, ep) == 0 && zmq_connect(raw, ep) == 0,
          "maxmsg sockets");
    if (!router || !raw || !tensor)
        goto out;
    static struct raw r;
    static struct pb pl;
    enc_step(&pl, 256, 2048);
    pb_envelope(&r.env, WIRE_VERSION, WIRE_TYPE_STEP, 1, &pl, big);
    r.tensor_frame = true;
    r.tensor_n = big;
    raw_send(raw, &r, tensor);
    struct wire_msg m;
    uint8_t id[WIRE_ID_MAX];
    size_t id_len = sizeof id;
    int rc = wire_recv(router, &m, id, &id_len, 300);
    CHECK(rc == -ETIMEDOUT, "2 MiB frame over a 1 MiB limit never arrives: %d", rc);
    wire_msg_free(&m);
    MEASURE("maxmsgsize: a 2 MiB frame to a 1 MiB-limit ROUTER was dropped by ZeroMQ");
out:
    free(tensor);
    if (raw)
        zmq_close(raw);
    wire_socket_destroy(router);
}

int main(void)
{
    log_init("test", -1);
    double t0 = now_s();
    void *ctx = zmq_ctx_new();
    CHECK(ctx, "zmq context");
    if (!ctx)
        return test_main_result("test_wire");

    CHECK(!strcmp(wire_msg_type_name(WIRE_TYPE_EXPERT_REQUEST), "expert_request") &&
              !strcmp(wire_msg_type_name(0), "unknown") &&
              !strcmp(wire_msg_type_name(WIRE_TYPE_LAST + 1), "unknown"),
          "type names");
    test_options(ctx);
    test_round_trips(ctx, "inproc://round-trip", "inproc", false);

    char dir[WIRE_PATH_MAX] = "";
    test_rundir(ctx, dir, sizeof dir);
    char ep[256];
    if (dir[0])
        test_rundir_sweep(dir);
    if (dir[0] && wire_endpoint_ipc(ep, sizeof ep, dir, "round-trip") == 0)
        test_round_trips(ctx, ep, "ipc", true);
    if (dir[0])
        test_max_msg_size(ctx, dir);
    if (dir[0])
        test_timeouts_and_refusals(ctx, dir);
    test_curve(ctx);
    test_nccl_fields(ctx);
    test_step_sample(ctx);
    test_fuzz(ctx);

    struct stat st;
    if (dir[0]) {
        CHECK(wire_rundir_remove(dir) == 0, "rundir remove");
        CHECK(stat(dir, &st) != 0 && errno == ENOENT, "rundir %s gone", dir);
    }
    zmq_ctx_term(ctx);
    MEASURE("test_wire ran in %.2f s", now_s() - t0);
    return test_main_result("test_wire");
}
