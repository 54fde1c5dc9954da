/*
 * wire: ZeroMQ sockets with lamina's options, and the packing, framing checks and unpacking of
 * every message (see ipc/wire.h for the frame table and the checks).
 *
 * The generated protobuf-c types never leave this file: wire_send() builds them from our
 * structs on the stack, and wire_recv() unpacks, copies into one allocation owned by the
 * message (struct wire_msg_storage) and frees the unpacked message before returning. The
 * received tensor frame is kept as a zmq_msg_t in that storage, so it is not copied unless its
 * data is misaligned. A wire_socket is used by one thread; nothing here is process-wide.
 */
#include "ipc/wire.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <signal.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "common/check.h"
#include "common/log.h"
#include "proto/lamina.pb-c.h"

#define WIRE_STATIC_TYPE(ours, theirs)                                                             \
    _Static_assert((int)(ours) == (int)LAMINA__MSG_TYPE__MSG_TYPE_##theirs, #ours " mismatch")
WIRE_STATIC_TYPE(WIRE_TYPE_HELLO, HELLO);
WIRE_STATIC_TYPE(WIRE_TYPE_LOAD_PLAN, LOAD_PLAN);
WIRE_STATIC_TYPE(WIRE_TYPE_READY, READY);
WIRE_STATIC_TYPE(WIRE_TYPE_STEP, STEP);
WIRE_STATIC_TYPE(WIRE_TYPE_EXPERT_REQUEST, EXPERT_REQUEST);
WIRE_STATIC_TYPE(WIRE_TYPE_EXPERT_REPLY, EXPERT_REPLY);
WIRE_STATIC_TYPE(WIRE_TYPE_RESULT, RESULT);
WIRE_STATIC_TYPE(WIRE_TYPE_TIMING, TIMING);
WIRE_STATIC_TYPE(WIRE_TYPE_HEARTBEAT, HEARTBEAT);
WIRE_STATIC_TYPE(WIRE_TYPE_ERROR, ERROR);
WIRE_STATIC_TYPE(WIRE_TYPE_SHUTDOWN, SHUTDOWN);
WIRE_STATIC_TYPE(WIRE_TYPE_RESET, RESET);
WIRE_STATIC_TYPE(WIRE_TYPE_STATE, STATE);
_Static_assert(WIRE_ENVELOPE_MAX < WIRE_MSG_MAX_DEFAULT, "envelope limit above frame limit");

#define WIRE_CURVE_NONE 0
#define WIRE_CURVE_SERVER 1
#define WIRE_CURVE_CLIENT 2
#define WIRE_DETAIL_MAX 160 /* bytes of a reject's explanation */

struct wire_socket {
    void *zsock;                              /* the ZeroMQ socket, owned */
    int type;                                 /* ZMQ_ROUTER, ZMQ_DEALER, ... */
    int curve;                                /* WIRE_CURVE_* role of this socket */
    struct wire_stats stats;                  /* counters shown to the caller */
    bool reject_logged[WIRE_REJECT_COUNT];    /* each reject reason is logged once */
    int spin_us;                              /* busy-poll this long before sleeping */
};

struct wire_msg_storage {
    zmq_msg_t frame;               /* the received tensor frame, when has_frame */
    bool has_frame;                /* frame is initialised and must be closed */
    void *tensor_copy;             /* the tensor, when the frame's data was misaligned */
    _Alignas(8) char arena[];      /* strings and arrays the message points to */
};

/* A bump allocator over storage->arena. With base NULL it only measures. */
struct wire_arena {
    char *base;  /* NULL on the measuring pass */
    size_t used; /* bytes handed out, including alignment */
};

static int wire_errno(int e)
{
    if (e == ETERM)
        return -ESHUTDOWN;
    if (e == EAGAIN)
        return -ETIMEDOUT;
    if (e <= 0 || e >= ZMQ_HAUSNUMERO)
        return -EIO;
    return -e;
}

/* The ZMQ_CHECK of style habit 6, kept here until common/check.h has one. */
static int wire_zmq_check(int rc, const char *what, const char *file, int line)
{
    if (rc >= 0)
        return 0;
    int e = zmq_errno();
    if (log_is_enabled(LOG_LEVEL_ERROR))
        log_write(LOG_LEVEL_ERROR, file, line, "%s failed: %s", what, zmq_strerror(e));
    return wire_errno(e);
}

#define ZMQ_CHECK(expr) wire_zmq_check((expr), #expr, __FILE__, __LINE__)

static int64_t wire_now_ms(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000 + ts.tv_nsec / 1000000;
}

static bool wire_type_is_known(uint32_t type)
{
    return type >= WIRE_TYPE_FIRST && type <= WIRE_TYPE_LAST;
}

/* ---- messages ------------------------------------------------------------------------- */

void wire_msg_free(struct wire_msg *m)
{
    if (!m)
        return;
    struct wire_msg_storage *st = m->storage;
    if (st) {
        if (st->has_frame)
            zmq_msg_close(&st->frame);
        free(st->tensor_copy);
        free(st);
    }
    memset(m, 0, sizeof *m);
}

const char *wire_msg_type_name(uint32_t type)
{
    static const char *const names[] = {
        [WIRE_TYPE_HELLO] = "hello",
        [WIRE_TYPE_LOAD_PLAN] = "load_plan",
        [WIRE_TYPE_READY] = "ready",
        [WIRE_TYPE_STEP] = "step",
        [WIRE_TYPE_EXPERT_REQUEST] = "expert_request",
        [WIRE_TYPE_EXPERT_REPLY] = "expert_reply",
        [WIRE_TYPE_RESULT] = "result",
        [WIRE_TYPE_TIMING] = "timing",
        [WIRE_TYPE_HEARTBEAT] = "heartbeat",
        [WIRE_TYPE_ERROR] = "error",
        [WIRE_TYPE_SHUTDOWN] = "shutdown",
        [WIRE_TYPE_RESET] = "reset",
        [WIRE_TYPE_STATE] = "state",
    };
    return wire_type_is_known(type) ? names[type] : "unknown";
}

const char *wire_reject_name(enum wire_reject why)
{
    static const char *const names[WIRE_REJECT_COUNT] = {
        [WIRE_REJECT_FRAMES] = "frames",   [WIRE_REJECT_ENVELOPE] = "envelope",
        [WIRE_REJECT_VERSION] = "version", [WIRE_REJECT_TYPE] = "type",
        [WIRE_REJECT_PAYLOAD] = "payload", [WIRE_REJECT_SHAPE] = "shape",
        [WIRE_REJECT_FIELDS] = "fields",
    };
    return (unsigned)why < WIRE_REJECT_COUNT ? names[why] : "unknown";
}

/* ---- checks shared by send and receive --------------------------------------------------- */

/* rows x width f32 in bytes, or false on overflow. */
static bool wire_f32_bytes(uint64_t rows, uint64_t width, uint64_t *bytes)
{
    uint64_t n;
    return !__builtin_mul_overflow(rows, width, &n) && !__builtin_mul_overflow(n, 4, bytes);
}

static bool wire_str_fits(const char *s, size_t max)
{
    return !s || strnlen(s, max + 1) <= max;
}

struct wire_verdict {
    enum wire_reject why;         /* set when the check failed */
    char detail[WIRE_DETAIL_MAX]; /* what failed, with the values */
};

static bool wire_fail(struct wire_verdict *v, enum wire_reject why, const char *fmt, ...)
    __attribute__((format(printf, 3, 4)));

static bool wire_fail(struct wire_verdict *v, enum wire_reject why, const char *fmt, ...)
{
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(v->detail, sizeof v->detail, fmt, ap);
    va_end(ap);
    v->why = why;
    return false;
}

/* tensor_bytes must be rows x width x 4 (and rows, width >= 1). */
static bool wire_check_rows(const struct wire_msg *m, uint64_t rows, uint64_t width,
                            const char *what, struct wire_verdict *v)
{
    uint64_t bytes;
    if (rows == 0 || width == 0)
        return wire_fail(v, WIRE_REJECT_SHAPE, "%s tensor of %llu x %llu rows", what,
                         (unsigned long long)rows, (unsigned long long)width);
    if (!wire_f32_bytes(rows, width, &bytes))
        return wire_fail(v, WIRE_REJECT_SHAPE, "%s tensor of %llu x %llu f32 overflows", what,
                         (unsigned long long)rows, (unsigned long long)width);
    if (bytes != m->tensor_bytes)
        return wire_fail(v, WIRE_REJECT_SHAPE, "%s of %llu x %llu f32 needs %llu bytes, "
                         "frame has %zu", what, (unsigned long long)rows,
                         (unsigned long long)width, (unsigned long long)bytes, m->tensor_bytes);
    return true;
}

static bool wire_check_load_plan(const struct wire_load_plan *p, struct wire_verdict *v)
{
    if (!wire_str_fits(p->model_path, WIRE_STRING_MAX) ||
        !wire_str_fits(p->shm_name, WIRE_STRING_MAX) ||
        !wire_str_fits(p->backend, WIRE_STRING_MAX) ||
        !wire_str_fits(p->next_endpoint, WIRE_STRING_MAX) ||
        !wire_str_fits(p->listen_endpoint, WIRE_STRING_MAX))
        return wire_fail(v, WIRE_REJECT_FIELDS, "load_plan string longer than %d bytes",
                         WIRE_STRING_MAX);
    if (p->layer_begin >= p->layer_end || p->layer_end > p->n_layers_total)
        return wire_fail(v, WIRE_REJECT_FIELDS, "load_plan layers [%u, %u) of %u", p->layer_begin,
                         p->layer_end, p->n_layers_total);
    if (p->n_embd == 0 || p->n_vocab == 0 || p->n_ctx == 0 || p->max_batch == 0)
        return wire_fail(v, WIRE_REJECT_FIELDS, "load_plan n_embd %u n_vocab %u n_ctx %u "
                         "max_batch %u: none may be 0", p->n_embd, p->n_vocab, p->n_ctx,
                         p->max_batch);
    if (p->n_seq > WIRE_SEQ_MAX)
        return wire_fail(v, WIRE_REJECT_FIELDS, "load_plan n_seq %u: at most %d sequence slots",
                         p->n_seq, WIRE_SEQ_MAX);
    if (p->is_last && p->next_endpoint && p->next_endpoint[0])
        return wire_fail(v, WIRE_REJECT_FIELDS, "load_plan is_last with a next_endpoint");
    if (p->is_last && p->has_nccl_next)
        return wire_fail(v, WIRE_REJECT_FIELDS, "load_plan is_last with an nccl_next_id");
    if (p->n_residency && !p->residency)
        return wire_fail(v, WIRE_REJECT_FIELDS, "load_plan residency array missing");
    for (size_t i = 0; i < p->n_residency; i++) {
        const struct wire_layer_residency *r = &p->residency[i];
        if (r->layer < p->layer_begin || r->layer >= p->layer_end ||
            (i && r->layer <= p->residency[i - 1].layer))
            return wire_fail(v, WIRE_REJECT_FIELDS, "load_plan residency[%zu] layer %u not "
                             "increasing inside [%u, %u)", i, r->layer, p->layer_begin,
                             p->layer_end);
        if (r->bitmap_bytes > WIRE_BITMAP_MAX || (r->bitmap_bytes && !r->bitmap))
            return wire_fail(v, WIRE_REJECT_FIELDS, "load_plan residency[%zu] bitmap of %zu "
                             "bytes (at most %d)", i, r->bitmap_bytes, WIRE_BITMAP_MAX);
    }
    if (p->n_foreign && !p->foreign)
        return wire_fail(v, WIRE_REJECT_FIELDS, "load_plan foreign array missing");
    if (p->n_foreign > p->n_layers_total)
        return wire_fail(v, WIRE_REJECT_FIELDS, "load_plan with %zu foreign layers of %u",
                         p->n_foreign, p->n_layers_total);
    for (size_t i = 0; i < p->n_foreign; i++) {
        const struct wire_layer_residency *r = &p->foreign[i];
        if (r->layer >= p->n_layers_total ||
            (r->layer >= p->layer_begin && r->layer < p->layer_end) ||
            (i && r->layer <= p->foreign[i - 1].layer))
            return wire_fail(v, WIRE_REJECT_FIELDS, "load_plan foreign[%zu] layer %u not "
                             "increasing outside [%u, %u) below %u", i, r->layer,
                             p->layer_begin, p->layer_end, p->n_layers_total);
        if (r->bitmap_bytes > WIRE_BITMAP_MAX || (r->bitmap_bytes && !r->bitmap) ||
            r->trunk || r->shexp)
            return wire_fail(v, WIRE_REJECT_FIELDS, "load_plan foreign[%zu] bitmap of %zu "
                             "bytes (at most %d) or with trunk/shexp set", i, r->bitmap_bytes,
                             WIRE_BITMAP_MAX);
    }
    return true;
}

static bool wire_check_expert_request(const struct wire_msg *m, struct wire_verdict *v)
{
    const struct wire_expert_request *r = &m->expert_request;
    if (r->n_experts == 0 || r->n_experts > WIRE_EXPERTS_MAX || !r->experts || !r->counts)
        return wire_fail(v, WIRE_REJECT_FIELDS, "expert_request with %zu experts (1..%d)",
                         r->n_experts, WIRE_EXPERTS_MAX);
    uint64_t rows = 0;
    for (size_t i = 0; i < r->n_experts; i++) {
        if (r->counts[i] == 0)
            return wire_fail(v, WIRE_REJECT_FIELDS, "expert_request count[%zu] is 0", i);
        rows += r->counts[i]; /* at most WIRE_EXPERTS_MAX * 2^32: no overflow */
    }
    return wire_check_rows(m, rows, r->n_embd, "expert_request", v);
}

static bool wire_check_result(const struct wire_msg *m, struct wire_verdict *v)
{
    const struct wire_result *r = &m->result;
    if (r->token < -1 || (r->n_vocab && r->token >= 0 && (uint32_t)r->token >= r->n_vocab))
        return wire_fail(v, WIRE_REJECT_FIELDS, "result token %d outside [-1, %u)", r->token,
                         r->n_vocab);
    if (m->tensor_bytes == 0 && r->token < 0)
        return wire_fail(v, WIRE_REJECT_FIELDS, "result with neither token nor logits");
    if (m->tensor_bytes == 0)
        return true;
    return wire_check_rows(m, r->n_rows, r->n_vocab, "result logits", v);
}

/* A Step's sampler request: values in model/sampler.h's ranges, a bounded window of ids
 * >= 0, and nothing of it without sample. */
static bool wire_check_step_sample(const struct wire_step *st, struct wire_verdict *v)
{
    if (!st->sample) {
        if (st->n_window)
            return wire_fail(v, WIRE_REJECT_FIELDS, "step with a window of %zu ids but no "
                             "sample", st->n_window);
        return true;
    }
    if (st->all_logits)
        return wire_fail(v, WIRE_REJECT_FIELDS, "step asks to sample and for all logits");
    if (!(st->temperature >= 0 && isfinite(st->temperature)) || st->top_k < 0 ||
        !(st->top_p >= 0 && st->top_p <= 1) || !(st->min_p >= 0 && st->min_p <= 1) ||
        !(st->repeat_penalty >= 0 && isfinite(st->repeat_penalty)) ||
        !isfinite(st->presence_penalty) || !(st->uniform >= 0 && st->uniform < 1))
        return wire_fail(v, WIRE_REJECT_FIELDS, "step sampler out of range: temperature %g "
                         "top_k %d top_p %g min_p %g repeat_penalty %g presence_penalty %g "
                         "uniform %g", (double)st->temperature, st->top_k, (double)st->top_p,
                         (double)st->min_p, (double)st->repeat_penalty,
                         (double)st->presence_penalty, st->uniform);
    if (st->n_window > WIRE_WINDOW_MAX || (st->n_window && !st->window))
        return wire_fail(v, WIRE_REJECT_FIELDS, "step window of %zu ids (at most %d)",
                         st->n_window, WIRE_WINDOW_MAX);
    for (size_t i = 0; i < st->n_window; i++)
        if (st->window[i] < 0)
            return wire_fail(v, WIRE_REJECT_FIELDS, "step window[%zu] is %d", i,
                             st->window[i]);
    return true;
}

/* Everything a message says about itself; true when it is well-formed. */
static bool wire_msg_check(const struct wire_msg *m, struct wire_verdict *v)
{
    if (!wire_type_is_known(m->type))
        return wire_fail(v, WIRE_REJECT_TYPE, "type %u unknown", (unsigned)m->type);
    if (m->tensor_bytes && !m->tensor)
        return wire_fail(v, WIRE_REJECT_FIELDS, "tensor_bytes %zu without a tensor",
                         m->tensor_bytes);
    bool tensor_ok = m->type == WIRE_TYPE_STEP || m->type == WIRE_TYPE_EXPERT_REQUEST ||
                     m->type == WIRE_TYPE_EXPERT_REPLY || m->type == WIRE_TYPE_RESULT ||
                     m->type == WIRE_TYPE_STATE;
    if (!tensor_ok && m->tensor_bytes)
        return wire_fail(v, WIRE_REJECT_SHAPE, "%s carries no tensor, got %zu bytes",
                         wire_msg_type_name(m->type), m->tensor_bytes);
    switch (m->type) {
    case WIRE_TYPE_HELLO:
        if (!wire_str_fits(m->hello.device, WIRE_STRING_MAX))
            return wire_fail(v, WIRE_REJECT_FIELDS, "hello device name over %d bytes",
                             WIRE_STRING_MAX);
        return true;
    case WIRE_TYPE_LOAD_PLAN:
        return wire_check_load_plan(&m->load_plan, v);
    case WIRE_TYPE_STEP:
        if (!wire_check_step_sample(&m->step, v))
            return false;
        if (!m->step.via_nccl)
            return wire_check_rows(m, m->step.n_tokens, m->step.n_embd, "step", v);
        if (m->tensor_bytes || m->step.n_tokens == 0 || m->step.n_embd == 0)
            return wire_fail(v, WIRE_REJECT_SHAPE, "step via nccl of %u x %u rows with a "
                             "%zu-byte tensor frame (rows and width >= 1, no frame)",
                             m->step.n_tokens, m->step.n_embd, m->tensor_bytes);
        return true;
    case WIRE_TYPE_EXPERT_REQUEST:
        return wire_check_expert_request(m, v);
    case WIRE_TYPE_EXPERT_REPLY:
        return wire_check_rows(m, m->expert_reply.n_rows, m->expert_reply.n_embd,
                               "expert_reply", v);
    case WIRE_TYPE_RESULT:
        return wire_check_result(m, v);
    case WIRE_TYPE_TIMING:
        if (!wire_str_fits(m->timing.json, WIRE_TIMING_MAX) ||
            (m->timing.json && strchr(m->timing.json, '\n')))
            return wire_fail(v, WIRE_REJECT_FIELDS, "timing line over %u bytes or with a newline",
                             WIRE_TIMING_MAX);
        return true;
    case WIRE_TYPE_ERROR:
        if (!wire_str_fits(m->error.message, WIRE_STRING_MAX))
            return wire_fail(v, WIRE_REJECT_FIELDS, "error message over %d bytes",
                             WIRE_STRING_MAX);
        return true;
    case WIRE_TYPE_STATE: {
        const struct wire_state *st = &m->state;
        const uint64_t want = st->op == WIRE_STATE_SNAPSHOT ? st->bytes : 0;
        if (st->op < WIRE_STATE_SAVE || st->op > WIRE_STATE_LOADED)
            return wire_fail(v, WIRE_REJECT_FIELDS, "state op %u unknown", st->op);
        if (st->layer_begin >= st->layer_end && st->op != WIRE_STATE_SAVE)
            return wire_fail(v, WIRE_REJECT_FIELDS, "state of layers [%u, %u): empty range",
                             st->layer_begin, st->layer_end);
        if (want != m->tensor_bytes || (st->op != WIRE_STATE_SNAPSHOT && st->bytes))
            return wire_fail(v, WIRE_REJECT_SHAPE, "state op %u of %llu bytes with a %zu-byte "
                             "frame", st->op, (unsigned long long)st->bytes, m->tensor_bytes);
        return true;
    }
    case WIRE_TYPE_READY:
    case WIRE_TYPE_HEARTBEAT:
    case WIRE_TYPE_SHUTDOWN:
    case WIRE_TYPE_RESET:
        return true;
    }
    return true;
}

/* ---- packing ------------------------------------------------------------------------------- */

static char *wire_pb_str(const char *s)
{
    return (char *)(s ? s : "");
}

/* The protobuf-c form of every inner message; the member named by the type is used. */
union wire_pb {
    ProtobufCMessage base;
    Lamina__Hello hello;
    Lamina__LoadPlan load_plan;
    Lamina__Ready ready;
    Lamina__Step step;
    Lamina__ExpertRequest expert_request;
    Lamina__ExpertReply expert_reply;
    Lamina__Result result;
    Lamina__Timing timing;
    Lamina__Heartbeat heartbeat;
    Lamina__Error error;
    Lamina__Shutdown shutdown;
    Lamina__Reset reset;
    Lamina__State state;
};

/* Fills q from p; the residency entries go to res and res_ptrs (n_residency each), then the
 * foreign ones (n_foreign more). */
static void wire_build_load_plan(Lamina__LoadPlan *q, const struct wire_load_plan *p,
                                 Lamina__LayerResidency *res, Lamina__LayerResidency **res_ptrs)
{
    lamina__load_plan__init(q);
    for (size_t i = 0; i < p->n_residency + p->n_foreign; i++) {
        const struct wire_layer_residency *r = i < p->n_residency
                                                   ? &p->residency[i]
                                                   : &p->foreign[i - p->n_residency];
        lamina__layer_residency__init(&res[i]);
        res[i].layer = r->layer;
        res[i].bitmap.data = (uint8_t *)r->bitmap;
        res[i].bitmap.len = r->bitmap_bytes;
        res[i].trunk = r->trunk;
        res[i].shexp = r->shexp;
        res_ptrs[i] = &res[i];
    }
    q->n_foreign = p->n_foreign;
    q->foreign = res_ptrs + p->n_residency;
    q->model_path = wire_pb_str(p->model_path);
    q->shm_name = wire_pb_str(p->shm_name);
    q->shm_bytes = p->shm_bytes;
    q->layer_begin = p->layer_begin;
    q->layer_end = p->layer_end;
    q->n_layers_total = p->n_layers_total;
    q->n_residency = p->n_residency;
    q->residency = res_ptrs;
    q->backend = wire_pb_str(p->backend);
    q->device_mem_budget = p->device_mem_budget;
    q->n_ctx = p->n_ctx;
    q->kv_f16 = p->kv_f16;
    q->max_batch = p->max_batch;
    q->n_seq = p->n_seq;
    q->n_threads = p->n_threads;
    q->next_endpoint = wire_pb_str(p->next_endpoint);
    q->listen_endpoint = wire_pb_str(p->listen_endpoint);
    q->is_last = p->is_last;
    q->n_embd = p->n_embd;
    q->n_vocab = p->n_vocab;
    if (p->has_next_key)
        q->next_server_key = (ProtobufCBinaryData){WIRE_KEY_BYTES, (uint8_t *)p->next_server_key};
    q->lmhead = p->lmhead;
    if (p->has_nccl_prev)
        q->nccl_prev_id = (ProtobufCBinaryData){WIRE_NCCL_ID_BYTES, (uint8_t *)p->nccl_prev_id};
    if (p->has_nccl_next)
        q->nccl_next_id = (ProtobufCBinaryData){WIRE_NCCL_ID_BYTES, (uint8_t *)p->nccl_next_id};
}

/* Fills u from m for every type but LoadPlan. */
static void wire_build(union wire_pb *u, const struct wire_msg *m)
{
    switch (m->type) {
    case WIRE_TYPE_HELLO:
        lamina__hello__init(&u->hello);
        u->hello.worker_index = m->hello.worker_index;
        u->hello.pid = m->hello.pid;
        u->hello.device = wire_pb_str(m->hello.device);
        u->hello.device_mem_bytes = m->hello.device_mem_bytes;
        u->hello.n_threads = m->hello.n_threads;
        if (m->hello.has_curve_key)
            u->hello.curve_public_key =
                (ProtobufCBinaryData){WIRE_KEY_BYTES, (uint8_t *)m->hello.curve_public_key};
        break;
    case WIRE_TYPE_READY:
        lamina__ready__init(&u->ready);
        u->ready.device_mem_used = m->ready.device_mem_used;
        u->ready.resident_experts = m->ready.resident_experts;
        break;
    case WIRE_TYPE_STEP:
        lamina__step__init(&u->step);
        u->step.seq_id = m->step.seq_id;
        u->step.pos = m->step.pos;
        u->step.n_tokens = m->step.n_tokens;
        u->step.step = m->step.step;
        u->step.all_logits = m->step.all_logits;
        u->step.n_embd = m->step.n_embd;
        u->step.via_nccl = m->step.via_nccl;
        u->step.sample = m->step.sample;
        u->step.temperature = m->step.temperature;
        u->step.top_k = m->step.top_k;
        u->step.top_p = m->step.top_p;
        u->step.min_p = m->step.min_p;
        u->step.repeat_penalty = m->step.repeat_penalty;
        u->step.presence_penalty = m->step.presence_penalty;
        u->step.uniform = m->step.uniform;
        u->step.n_window = m->step.n_window;
        u->step.window = (int32_t *)m->step.window;
        break;
    case WIRE_TYPE_EXPERT_REQUEST:
        lamina__expert_request__init(&u->expert_request);
        u->expert_request.step = m->expert_request.step;
        u->expert_request.layer = m->expert_request.layer;
        u->expert_request.n_experts = m->expert_request.n_experts;
        u->expert_request.experts = (uint32_t *)m->expert_request.experts;
        u->expert_request.n_counts = m->expert_request.n_experts;
        u->expert_request.counts = (uint32_t *)m->expert_request.counts;
        u->expert_request.n_embd = m->expert_request.n_embd;
        u->expert_request.tag = m->expert_request.tag;
        break;
    case WIRE_TYPE_EXPERT_REPLY:
        lamina__expert_reply__init(&u->expert_reply);
        u->expert_reply.step = m->expert_reply.step;
        u->expert_reply.layer = m->expert_reply.layer;
        u->expert_reply.n_rows = m->expert_reply.n_rows;
        u->expert_reply.n_embd = m->expert_reply.n_embd;
        u->expert_reply.tag = m->expert_reply.tag;
        break;
    case WIRE_TYPE_RESULT:
        lamina__result__init(&u->result);
        u->result.seq_id = m->result.seq_id;
        u->result.step = m->result.step;
        u->result.n_rows = m->result.n_rows;
        u->result.n_vocab = m->result.n_vocab;
        u->result.token = m->result.token;
        break;
    case WIRE_TYPE_TIMING:
        lamina__timing__init(&u->timing);
        u->timing.json = wire_pb_str(m->timing.json);
        break;
    case WIRE_TYPE_HEARTBEAT:
        lamina__heartbeat__init(&u->heartbeat);
        u->heartbeat.step = m->heartbeat.step;
        break;
    case WIRE_TYPE_ERROR:
        lamina__error__init(&u->error);
        u->error.code = m->error.code;
        u->error.message = wire_pb_str(m->error.message);
        u->error.worker_index = m->error.worker_index;
        u->error.step = m->error.step;
        break;
    case WIRE_TYPE_RESET:
        lamina__reset__init(&u->reset);
        u->reset.seq_id = m->reset.seq_id;
        break;
    case WIRE_TYPE_STATE:
        lamina__state__init(&u->state);
        u->state.seq_id = m->state.seq_id;
        u->state.op = m->state.op;
        u->state.pos = m->state.pos;
        u->state.layer_begin = m->state.layer_begin;
        u->state.layer_end = m->state.layer_end;
        u->state.bytes = m->state.bytes;
        break;
    case WIRE_TYPE_SHUTDOWN:
        lamina__shutdown__init(&u->shutdown);
        break;
    case WIRE_TYPE_LOAD_PLAN: /* needs arrays: wire_build_load_plan */
        ASSERT(m->type != WIRE_TYPE_LOAD_PLAN);
        break;
    }
}

/* Packs the inner message of m (already checked) into a malloc'd buffer. Returns 0 or
 * -ENOMEM (logged). */
static int wire_pack_payload(const struct wire_msg *m, uint8_t **out, size_t *len)
{
    union wire_pb u;
    Lamina__LayerResidency *res = NULL, **res_ptrs = NULL;
    int rc = 0;
    if (m->type == WIRE_TYPE_LOAD_PLAN) {
        size_t n = m->load_plan.n_residency + m->load_plan.n_foreign;
        res = calloc(n ? n : 1, sizeof *res);
        res_ptrs = calloc(n ? n : 1, sizeof *res_ptrs);
        if (!res || !res_ptrs) {
            log_error("wire: no memory for a load_plan of %zu residency entries", n);
            rc = -ENOMEM;
            goto out_free_res;
        }
        wire_build_load_plan(&u.load_plan, &m->load_plan, res, res_ptrs);
    } else {
        wire_build(&u, m);
    }
    *len = protobuf_c_message_get_packed_size(&u.base);
    *out = malloc(*len ? *len : 1);
    if (!*out) {
        log_error("wire: no memory for a %zu-byte %s payload", *len, wire_msg_type_name(m->type));
        rc = -ENOMEM;
        goto out_free_res;
    }
    size_t packed = protobuf_c_message_pack(&u.base, *out);
    ASSERT(packed == *len);
out_free_res:
    free(res_ptrs);
    free(res);
    return rc;
}

/* Packs the envelope of m around payload into an initialised zmq frame. */
static int wire_pack_envelope(const struct wire_msg *m, const uint8_t *payload, size_t len,
                              zmq_msg_t *frame)
{
    Lamina__Envelope env = LAMINA__ENVELOPE__INIT;
    env.version = WIRE_VERSION;
    env.type = m->type;
    env.seq_no = m->seq_no;
    env.payload.data = (uint8_t *)payload;
    env.payload.len = len;
    env.tensor_bytes = m->tensor_bytes;
    size_t size = lamina__envelope__get_packed_size(&env);
    if (size > WIRE_ENVELOPE_MAX) {
        log_error("wire: %s envelope of %zu bytes exceeds the %u-byte limit",
                  wire_msg_type_name(m->type), size, WIRE_ENVELOPE_MAX);
        return -EINVAL;
    }
    if (zmq_msg_init_size(frame, size) != 0) {
        log_error("wire: no memory for a %zu-byte envelope", size);
        return -ENOMEM;
    }
    size_t packed = lamina__envelope__pack(&env, zmq_msg_data(frame));
    ASSERT(packed == size);
    return 0;
}

/* ---- unpacking ----------------------------------------------------------------------------- */

static void *wire_arena_take(struct wire_arena *a, size_t n)
{
    size_t at = (a->used + 7) & ~(size_t)7;
    a->used = at + n;
    return a->base ? a->base + at : NULL;
}

static const void *wire_arena_copy(struct wire_arena *a, const void *src, size_t n)
{
    void *d = wire_arena_take(a, n);
    if (d && n)
        memcpy(d, src, n);
    return d;
}

static const char *wire_arena_str(struct wire_arena *a, const char *s)
{
    s = s ? s : "";
    return wire_arena_copy(a, s, strlen(s) + 1);
}

static void wire_fill_load_plan(struct wire_load_plan *p, const Lamina__LoadPlan *q,
                                struct wire_arena *a)
{
    struct wire_layer_residency *r = wire_arena_take(a, q->n_residency * sizeof *r);
    for (size_t i = 0; i < q->n_residency; i++) {
        const Lamina__LayerResidency *qr = q->residency[i];
        const uint8_t *bitmap = wire_arena_copy(a, qr->bitmap.data, qr->bitmap.len);
        if (r)
            r[i] = (struct wire_layer_residency){qr->layer, bitmap, qr->bitmap.len, qr->trunk,
                                                 qr->shexp};
    }
    struct wire_layer_residency *f = wire_arena_take(a, q->n_foreign * sizeof *f);
    for (size_t i = 0; i < q->n_foreign; i++) {
        const Lamina__LayerResidency *qr = q->foreign[i];
        const uint8_t *bitmap = wire_arena_copy(a, qr->bitmap.data, qr->bitmap.len);
        if (f)
            f[i] = (struct wire_layer_residency){qr->layer, bitmap, qr->bitmap.len, qr->trunk,
                                                 qr->shexp};
    }
    *p = (struct wire_load_plan){
        .model_path = wire_arena_str(a, q->model_path),
        .shm_name = wire_arena_str(a, q->shm_name),
        .shm_bytes = q->shm_bytes,
        .layer_begin = q->layer_begin,
        .layer_end = q->layer_end,
        .n_layers_total = q->n_layers_total,
        .residency = r,
        .n_residency = q->n_residency,
        .foreign = f,
        .n_foreign = q->n_foreign,
        .backend = wire_arena_str(a, q->backend),
        .device_mem_budget = q->device_mem_budget,
        .n_ctx = q->n_ctx,
        .kv_f16 = q->kv_f16,
        .max_batch = q->max_batch,
        .n_seq = q->n_seq ? q->n_seq : 1,
        .n_threads = q->n_threads,
        .next_endpoint = wire_arena_str(a, q->next_endpoint),
        .listen_endpoint = wire_arena_str(a, q->listen_endpoint),
        .is_last = q->is_last,
        .n_embd = q->n_embd,
        .n_vocab = q->n_vocab,
        .has_next_key = q->next_server_key.len == WIRE_KEY_BYTES,
        .lmhead = q->lmhead,
        .has_nccl_prev = q->nccl_prev_id.len == WIRE_NCCL_ID_BYTES,
        .has_nccl_next = q->nccl_next_id.len == WIRE_NCCL_ID_BYTES,
    };
    if (p->has_next_key)
        memcpy(p->next_server_key, q->next_server_key.data, WIRE_KEY_BYTES);
    if (p->has_nccl_prev)
        memcpy(p->nccl_prev_id, q->nccl_prev_id.data, WIRE_NCCL_ID_BYTES);
    if (p->has_nccl_next)
        memcpy(p->nccl_next_id, q->nccl_next_id.data, WIRE_NCCL_ID_BYTES);
}

/* Copies the unpacked inner message pm into m's union; strings and arrays go to a. */
static void wire_fill(struct wire_msg *m, const ProtobufCMessage *pm, struct wire_arena *a)
{
    switch (m->type) {
    case WIRE_TYPE_HELLO: {
        const Lamina__Hello *q = (const Lamina__Hello *)pm;
        m->hello = (struct wire_hello){q->worker_index, q->pid, wire_arena_str(a, q->device),
                                       q->device_mem_bytes, q->n_threads,
                                       q->curve_public_key.len == WIRE_KEY_BYTES, {0}};
        if (m->hello.has_curve_key)
            memcpy(m->hello.curve_public_key, q->curve_public_key.data, WIRE_KEY_BYTES);
        break;
    }
    case WIRE_TYPE_LOAD_PLAN:
        wire_fill_load_plan(&m->load_plan, (const Lamina__LoadPlan *)pm, a);
        break;
    case WIRE_TYPE_READY: {
        const Lamina__Ready *q = (const Lamina__Ready *)pm;
        m->ready = (struct wire_ready){q->device_mem_used, q->resident_experts};
        break;
    }
    case WIRE_TYPE_STEP: {
        const Lamina__Step *q = (const Lamina__Step *)pm;
        m->step = (struct wire_step){
            .seq_id = q->seq_id, .pos = q->pos, .n_tokens = q->n_tokens, .step = q->step,
            .all_logits = q->all_logits != 0, .n_embd = q->n_embd, .via_nccl = q->via_nccl != 0,
            .sample = q->sample != 0, .temperature = q->temperature, .top_k = q->top_k,
            .top_p = q->top_p, .min_p = q->min_p, .repeat_penalty = q->repeat_penalty,
            .presence_penalty = q->presence_penalty, .uniform = q->uniform,
            .window = wire_arena_copy(a, q->window, q->n_window * sizeof(int32_t)),
            .n_window = q->n_window};
        break;
    }
    case WIRE_TYPE_EXPERT_REQUEST: {
        const Lamina__ExpertRequest *q = (const Lamina__ExpertRequest *)pm;
        size_t n = q->n_experts * sizeof(uint32_t);
        m->expert_request = (struct wire_expert_request){
            q->step, q->layer, wire_arena_copy(a, q->experts, n), wire_arena_copy(a, q->counts, n),
            q->n_experts, q->n_embd, q->tag};
        break;
    }
    case WIRE_TYPE_EXPERT_REPLY: {
        const Lamina__ExpertReply *q = (const Lamina__ExpertReply *)pm;
        m->expert_reply = (struct wire_expert_reply){q->step, q->layer, q->n_rows, q->n_embd,
                                                     q->tag};
        break;
    }
    case WIRE_TYPE_RESULT: {
        const Lamina__Result *q = (const Lamina__Result *)pm;
        m->result = (struct wire_result){q->seq_id, q->step, q->n_rows, q->n_vocab, q->token};
        break;
    }
    case WIRE_TYPE_TIMING:
        m->timing.json = wire_arena_str(a, ((const Lamina__Timing *)pm)->json);
        break;
    case WIRE_TYPE_HEARTBEAT:
        m->heartbeat.step = ((const Lamina__Heartbeat *)pm)->step;
        break;
    case WIRE_TYPE_ERROR: {
        const Lamina__Error *q = (const Lamina__Error *)pm;
        m->error = (struct wire_error){q->code, wire_arena_str(a, q->message), q->worker_index,
                                       q->step};
        break;
    }
    case WIRE_TYPE_SHUTDOWN:
        break;
    case WIRE_TYPE_RESET:
        m->reset.seq_id = ((const Lamina__Reset *)pm)->seq_id;
        break;
    case WIRE_TYPE_STATE: {
        const Lamina__State *q = (const Lamina__State *)pm;
        m->state = (struct wire_state){q->seq_id, q->op, q->pos, q->layer_begin, q->layer_end,
                                       q->bytes};
        break;
    }
    }
}

static const ProtobufCMessageDescriptor *wire_descriptor(enum wire_type type)
{
    static const ProtobufCMessageDescriptor *const d[] = {
        [WIRE_TYPE_HELLO] = &lamina__hello__descriptor,
        [WIRE_TYPE_LOAD_PLAN] = &lamina__load_plan__descriptor,
        [WIRE_TYPE_READY] = &lamina__ready__descriptor,
        [WIRE_TYPE_STEP] = &lamina__step__descriptor,
        [WIRE_TYPE_EXPERT_REQUEST] = &lamina__expert_request__descriptor,
        [WIRE_TYPE_EXPERT_REPLY] = &lamina__expert_reply__descriptor,
        [WIRE_TYPE_RESULT] = &lamina__result__descriptor,
        [WIRE_TYPE_TIMING] = &lamina__timing__descriptor,
        [WIRE_TYPE_HEARTBEAT] = &lamina__heartbeat__descriptor,
        [WIRE_TYPE_ERROR] = &lamina__error__descriptor,
        [WIRE_TYPE_SHUTDOWN] = &lamina__shutdown__descriptor,
        [WIRE_TYPE_RESET] = &lamina__reset__descriptor,
        [WIRE_TYPE_STATE] = &lamina__state__descriptor,
    };
    return d[type];
}

/* What must hold before an unpacked message can be copied into our structs: one count for
 * experts and counts, CURVE keys of 0 or WIRE_KEY_BYTES bytes, NCCL ids of 0 or
 * WIRE_NCCL_ID_BYTES bytes. */
static bool wire_pb_is_copyable(enum wire_type type, const ProtobufCMessage *pm,
                                struct wire_verdict *v)
{
    if (type == WIRE_TYPE_EXPERT_REQUEST) {
        const Lamina__ExpertRequest *q = (const Lamina__ExpertRequest *)pm;
        if (q->n_experts != q->n_counts)
            return wire_fail(v, WIRE_REJECT_FIELDS, "expert_request has %zu experts but %zu "
                             "counts", q->n_experts, q->n_counts);
    }
    size_t key = 0;
    if (type == WIRE_TYPE_HELLO)
        key = ((const Lamina__Hello *)pm)->curve_public_key.len;
    if (type == WIRE_TYPE_LOAD_PLAN)
        key = ((const Lamina__LoadPlan *)pm)->next_server_key.len;
    if (key != 0 && key != WIRE_KEY_BYTES)
        return wire_fail(v, WIRE_REJECT_FIELDS, "%s CURVE key of %zu bytes (0 or %d)",
                         wire_msg_type_name(type), key, WIRE_KEY_BYTES);
    if (type == WIRE_TYPE_LOAD_PLAN) {
        const Lamina__LoadPlan *q = (const Lamina__LoadPlan *)pm;
        const size_t ids[2] = {q->nccl_prev_id.len, q->nccl_next_id.len};
        for (int i = 0; i < 2; i++)
            if (ids[i] != 0 && ids[i] != WIRE_NCCL_ID_BYTES)
                return wire_fail(v, WIRE_REJECT_FIELDS, "load_plan nccl_%s_id of %zu bytes "
                                 "(0 or %d)", i ? "next" : "prev", ids[i], WIRE_NCCL_ID_BYTES);
    }
    return true;
}

/*
 * Unpacks the inner message of m->type from payload into m, with one storage allocation for
 * its strings and arrays (m->storage, also returned when there is nothing to copy so that the
 * tensor frame has a home). Returns 0, -EPROTO with v filled, or -ENOMEM (logged).
 */
static int wire_decode_payload(struct wire_msg *m, const ProtobufCBinaryData *payload,
                               struct wire_verdict *v)
{
    ProtobufCMessage *pm =
        protobuf_c_message_unpack(wire_descriptor(m->type), NULL, payload->len, payload->data);
    if (!pm) {
        wire_fail(v, WIRE_REJECT_PAYLOAD, "%s payload of %zu bytes does not unpack",
                  wire_msg_type_name(m->type), payload->len);
        return -EPROTO;
    }
    int rc = 0;
    if (!wire_pb_is_copyable(m->type, pm, v)) {
        rc = -EPROTO;
        goto out_free_pm;
    }
    struct wire_arena a = {NULL, 0};
    wire_fill(m, pm, &a);
    struct wire_msg_storage *st = calloc(1, sizeof *st + a.used);
    if (!st) {
        log_error("wire: no memory for a received %s of %zu bytes", wire_msg_type_name(m->type),
                  a.used);
        rc = -ENOMEM;
        goto out_free_pm;
    }
    a = (struct wire_arena){st->arena, 0};
    wire_fill(m, pm, &a);
    m->storage = st;
out_free_pm:
    protobuf_c_message_free_unpacked(pm, NULL);
    return rc;
}

/* Makes the received tensor frame part of m: kept in m->storage, or copied when misaligned. */
static int wire_adopt_tensor(struct wire_msg *m, zmq_msg_t *frame)
{
    struct wire_msg_storage *st = m->storage;
    size_t n = zmq_msg_size(frame);
    zmq_msg_init(&st->frame);
    zmq_msg_move(&st->frame, frame);
    st->has_frame = true;
    const void *data = zmq_msg_data(&st->frame);
    if ((uintptr_t)data % WIRE_TENSOR_ALIGN) {
        st->tensor_copy = malloc(n);
        if (!st->tensor_copy) {
            log_error("wire: no memory to align a %zu-byte tensor", n);
            return -ENOMEM;
        }
        memcpy(st->tensor_copy, data, n);
        zmq_msg_close(&st->frame);
        st->has_frame = false;
        data = st->tensor_copy;
    }
    m->tensor = data;
    m->tensor_bytes = n;
    return 0;
}

/* ---- sockets ------------------------------------------------------------------------------- */

struct wire_socket_config wire_socket_config_default(void)
{
    return (struct wire_socket_config){
        .linger_ms = 200,
        .send_timeout_ms = 1000,
        .recv_timeout_ms = 1000,
        .max_msg_bytes = WIRE_MSG_MAX_DEFAULT,
        .heartbeat_ivl_ms = 500,
        .heartbeat_timeout_ms = 2000,
        .heartbeat_ttl_ms = 2000,
        .immediate = true,
    };
}

static bool wire_config_is_valid(int type, const struct wire_socket_config *c)
{
    if (type != ZMQ_ROUTER && type != ZMQ_DEALER && type != ZMQ_PUSH && type != ZMQ_PULL &&
        type != ZMQ_PAIR) {
        log_error("wire: socket type %d is not ROUTER, DEALER, PUSH, PULL or PAIR", type);
        return false;
    }
    if (c->linger_ms < 0 || c->send_timeout_ms < 0 || c->recv_timeout_ms < 0 ||
        c->heartbeat_ivl_ms < 0 || c->heartbeat_timeout_ms < 0 || c->heartbeat_ttl_ms < 0 ||
        c->heartbeat_ttl_ms > 6553599) {
        log_error("wire: linger %d, send timeout %d, recv timeout %d, heartbeat %d/%d/%d ms: "
                  "each must be >= 0 (no unbounded waits), ttl <= 6553599",
                  c->linger_ms, c->send_timeout_ms, c->recv_timeout_ms, c->heartbeat_ivl_ms,
                  c->heartbeat_timeout_ms, c->heartbeat_ttl_ms);
        return false;
    }
    if (c->max_msg_bytes <= (int64_t)WIRE_ENVELOPE_MAX) {
        log_error("wire: max_msg_bytes %lld must exceed the envelope limit %u",
                  (long long)c->max_msg_bytes, WIRE_ENVELOPE_MAX);
        return false;
    }
    if (c->routing_id && (type != ZMQ_DEALER || !c->routing_id[0] ||
                          strlen(c->routing_id) > WIRE_ID_MAX)) {
        log_error("wire: routing id must be 1..%d bytes on a DEALER", WIRE_ID_MAX);
        return false;
    }
    if (c->curve_keys && !c->curve_server && !c->curve_server_key) {
        log_error("wire: a CURVE client needs the server's public key");
        return false;
    }
    return true;
}

static int wire_setopt(void *z, int opt, const void *val, size_t len, const char *name)
{
    if (zmq_setsockopt(z, opt, val, len) == 0)
        return 0;
    int e = zmq_errno();
    log_error("wire: setting %s failed: %s", name, zmq_strerror(e));
    return wire_errno(e);
}

/* A connect made before its peer binds (a worker handing on to one still loading) is retried
 * after ZMQ_RECONNECT_IVL, doubling up to the max: ZeroMQ's 100 ms first retry held the first
 * hand-off of a step back by up to 175 ms (docs/perf.md, fourteenth session). */
#define WIRE_RECONNECT_MS 5
#define WIRE_RECONNECT_MAX_MS 1000

#define WIRE_SETOPT_INT(z, opt, v) wire_setopt((z), (opt), &(int){(v)}, sizeof(int), #opt)

static int wire_apply_curve(struct wire_socket *s, const struct wire_socket_config *c)
{
    if (!c->curve_keys)
        return 0;
    if (!zmq_has("curve")) {
        log_error("wire: CURVE keys given but libzmq was built without CURVE");
        return -ENOTSUP;
    }
    void *z = s->zsock;
    const struct wire_keypair *k = c->curve_keys;
    if (c->curve_server) {
        s->curve = WIRE_CURVE_SERVER;
        if (WIRE_SETOPT_INT(z, ZMQ_CURVE_SERVER, 1) ||
            wire_setopt(z, ZMQ_CURVE_SECRETKEY, k->secret_key, WIRE_KEY_BYTES,
                        "ZMQ_CURVE_SECRETKEY"))
            return -EINVAL;
        return 0;
    }
    s->curve = WIRE_CURVE_CLIENT;
    if (wire_setopt(z, ZMQ_CURVE_SERVERKEY, c->curve_server_key, WIRE_KEY_BYTES,
                    "ZMQ_CURVE_SERVERKEY") ||
        wire_setopt(z, ZMQ_CURVE_PUBLICKEY, k->public_key, WIRE_KEY_BYTES, "ZMQ_CURVE_PUBLICKEY") ||
        wire_setopt(z, ZMQ_CURVE_SECRETKEY, k->secret_key, WIRE_KEY_BYTES, "ZMQ_CURVE_SECRETKEY"))
        return -EINVAL;
    return 0;
}

static int wire_apply_options(struct wire_socket *s, const struct wire_socket_config *c)
{
    void *z = s->zsock;
    int64_t max = c->max_msg_bytes;
    if (WIRE_SETOPT_INT(z, ZMQ_LINGER, c->linger_ms) ||
        WIRE_SETOPT_INT(z, ZMQ_SNDTIMEO, c->send_timeout_ms) ||
        WIRE_SETOPT_INT(z, ZMQ_RCVTIMEO, c->recv_timeout_ms) ||
        wire_setopt(z, ZMQ_MAXMSGSIZE, &max, sizeof max, "ZMQ_MAXMSGSIZE") ||
        WIRE_SETOPT_INT(z, ZMQ_IMMEDIATE, c->immediate ? 1 : 0) ||
        WIRE_SETOPT_INT(z, ZMQ_RECONNECT_IVL, WIRE_RECONNECT_MS) ||
        WIRE_SETOPT_INT(z, ZMQ_RECONNECT_IVL_MAX, WIRE_RECONNECT_MAX_MS))
        return -EINVAL;
    if (c->heartbeat_ivl_ms &&
        (WIRE_SETOPT_INT(z, ZMQ_HEARTBEAT_IVL, c->heartbeat_ivl_ms) ||
         WIRE_SETOPT_INT(z, ZMQ_HEARTBEAT_TIMEOUT, c->heartbeat_timeout_ms) ||
         WIRE_SETOPT_INT(z, ZMQ_HEARTBEAT_TTL, c->heartbeat_ttl_ms)))
        return -EINVAL;
    if (s->type == ZMQ_ROUTER && (WIRE_SETOPT_INT(z, ZMQ_ROUTER_MANDATORY, 1) ||
                                  WIRE_SETOPT_INT(z, ZMQ_ROUTER_HANDOVER, c->no_handover ? 0 : 1)))
        return -EINVAL;
    if (c->routing_id &&
        wire_setopt(z, ZMQ_ROUTING_ID, c->routing_id, strlen(c->routing_id), "ZMQ_ROUTING_ID"))
        return -EINVAL;
    return wire_apply_curve(s, c);
}

struct wire_socket *wire_socket_create(void *zmq_ctx, int zmq_type,
                                       const struct wire_socket_config *cfg)
{
    struct wire_socket_config defaults = wire_socket_config_default();
    const struct wire_socket_config *c = cfg ? cfg : &defaults;
    ASSERT(zmq_ctx);
    if (!wire_config_is_valid(zmq_type, c))
        return NULL;
    struct wire_socket *s = calloc(1, sizeof *s);
    if (!s) {
        log_error("wire: no memory for a socket");
        return NULL;
    }
    s->type = zmq_type;
    /* spinning only pays when the peer's and ZeroMQ's threads have cores of their own */
    s->spin_us = c->spin_us > 0 && sysconf(_SC_NPROCESSORS_ONLN) >= 8 ? c->spin_us : 0;
    s->zsock = zmq_socket(zmq_ctx, zmq_type);
    if (!s->zsock) {
        log_error("wire: zmq_socket failed: %s", zmq_strerror(zmq_errno()));
        goto out_free;
    }
    if (wire_apply_options(s, c))
        goto out_close;
    return s;
out_close:
    zmq_close(s->zsock);
out_free:
    free(s);
    return NULL;
}

void wire_socket_destroy(struct wire_socket *s)
{
    if (!s)
        return;
    zmq_close(s->zsock);
    free(s);
}

static bool wire_host_is_loopback(const char *addr)
{
    const char *semi = strchr(addr, ';'); /* "source;destination" form: check the destination */
    if (semi)
        addr = semi + 1;
    return !strncmp(addr, "127.", 4) || !strncmp(addr, "localhost:", 10) ||
           !strncmp(addr, "[::1]:", 6);
}

/* The transport rules of wire_socket_bind/connect. */
static int wire_endpoint_is_allowed(const struct wire_socket *s, const char *ep, bool bind)
{
    if (!strncmp(ep, "inproc://", 9))
        return 0;
    if (!strncmp(ep, "ipc://", 6)) {
        const char *path = ep + 6;
        if (path[0] == '@' || path[0] == '\0') {
            log_error("wire: refusing %s: abstract or empty ipc path", ep);
            return -EINVAL;
        }
        if (strlen(path) >= WIRE_PATH_MAX) {
            log_error("wire: ipc path %s is over %d bytes", path, WIRE_PATH_MAX - 1);
            return -ENAMETOOLONG;
        }
        struct stat st;
        if (bind && lstat(path, &st) == 0) {
            log_error("wire: refusing to bind %s: the path exists (another process may own it)",
                      ep);
            return -EADDRINUSE;
        }
        return 0;
    }
    if (!strncmp(ep, "tcp://", 6)) {
        bool curve = s->curve == (bind ? WIRE_CURVE_SERVER : WIRE_CURVE_CLIENT);
        if (!curve && !wire_host_is_loopback(ep + 6)) {
            log_error("wire: refusing %s: tcp beyond loopback needs CURVE keys", ep);
            return -EPERM;
        }
        return 0;
    }
    log_error("wire: refusing %s: only inproc://, ipc:// and tcp:// are used", ep);
    return -EINVAL;
}

int wire_socket_bind(struct wire_socket *s, const char *endpoint)
{
    int rc = wire_endpoint_is_allowed(s, endpoint, true);
    if (rc)
        return rc;
    if (zmq_bind(s->zsock, endpoint) != 0) {
        int e = zmq_errno();
        log_error("wire: bind %s failed: %s", endpoint, zmq_strerror(e));
        return wire_errno(e);
    }
    return 0;
}

int wire_socket_connect(struct wire_socket *s, const char *endpoint)
{
    int rc = wire_endpoint_is_allowed(s, endpoint, false);
    if (rc)
        return rc;
    if (zmq_connect(s->zsock, endpoint) != 0) {
        int e = zmq_errno();
        log_error("wire: connect %s failed: %s", endpoint, zmq_strerror(e));
        return wire_errno(e);
    }
    return 0;
}

int wire_socket_endpoint(const struct wire_socket *s, char *buf, size_t cap)
{
    char ep[1024];
    size_t len = sizeof ep;
    int rc = ZMQ_CHECK(zmq_getsockopt(s->zsock, ZMQ_LAST_ENDPOINT, ep, &len));
    if (rc)
        return rc;
    if (len == 0 || len > cap)
        return -ENOSPC;
    memcpy(buf, ep, len); /* len counts the NUL */
    buf[len - 1] = '\0';
    return 0;
}

void *wire_socket_zmq(const struct wire_socket *s)
{
    return s->zsock;
}

const struct wire_stats *wire_socket_stats(const struct wire_socket *s)
{
    return &s->stats;
}

/* ---- send ---------------------------------------------------------------------------------- */

/* Logs a failed zmq send unless it is a timeout, and maps its errno. */
static int wire_send_failed(const struct wire_socket *s, const struct wire_msg *m, int e)
{
    if (e == EHOSTUNREACH)
        log_error("wire: %s not sent: no peer with that routing id (ROUTER_MANDATORY)",
                  wire_msg_type_name(m->type));
    else if (e != EAGAIN && e != ETERM)
        log_error("wire: sending %s on socket type %d failed: %s", wire_msg_type_name(m->type),
                  s->type, zmq_strerror(e));
    return wire_errno(e);
}

int wire_send(struct wire_socket *s, const struct wire_msg *m, const void *routing_id,
              size_t id_len)
{
    bool router = s->type == ZMQ_ROUTER;
    ASSERT(m);
    ASSERT(router ? routing_id && id_len >= 1 && id_len <= WIRE_ID_MAX : routing_id == NULL);
    struct wire_verdict v;
    if (!wire_msg_check(m, &v)) {
        log_error("wire: refusing to send a malformed %s (%s): %s", wire_msg_type_name(m->type),
                  wire_reject_name(v.why), v.detail);
        return -EINVAL;
    }
    uint8_t *payload;
    size_t len;
    int rc = wire_pack_payload(m, &payload, &len);
    if (rc)
        return rc;
    zmq_msg_t env;
    rc = wire_pack_envelope(m, payload, len, &env);
    free(payload);
    if (rc)
        return rc;
    size_t env_bytes = zmq_msg_size(&env);
    bool more = m->tensor_bytes > 0;
    if (router && zmq_send(s->zsock, routing_id, id_len, ZMQ_SNDMORE) < 0)
        goto out_failed;
    if (zmq_msg_send(&env, s->zsock, more ? ZMQ_SNDMORE : 0) < 0)
        goto out_failed;
    if (more && zmq_send(s->zsock, m->tensor, m->tensor_bytes, 0) < 0)
        return wire_send_failed(s, m, zmq_errno()); /* env now belongs to ZeroMQ */
    s->stats.sent++;
    s->stats.bytes_sent += env_bytes + m->tensor_bytes;
    return 0;
out_failed:
    rc = wire_send_failed(s, m, zmq_errno());
    zmq_msg_close(&env);
    return rc;
}

/* ---- receive ------------------------------------------------------------------------------- */

#define WIRE_FRAMES_KEPT 3 /* identity, envelope, tensor */

/* The frames of one received message; frames past the kept ones are only counted. */
struct wire_frames {
    zmq_msg_t f[WIRE_FRAMES_KEPT]; /* initialised: f[0 .. kept) */
    size_t kept;
    size_t total; /* frames in the message */
};

static void wire_frames_close(struct wire_frames *fr)
{
    for (size_t i = 0; i < fr->kept; i++)
        zmq_msg_close(&fr->f[i]);
    fr->kept = 0;
}

/* Reads one whole message without blocking. Returns 0, -EAGAIN when none is queued, or the
 * mapped error. */
static int wire_read_frames(struct wire_socket *s, struct wire_frames *fr)
{
    fr->kept = fr->total = 0;
    for (;;) {
        zmq_msg_t part;
        zmq_msg_init(&part);
        if (zmq_msg_recv(&part, s->zsock, ZMQ_DONTWAIT) < 0) {
            int e = zmq_errno();
            zmq_msg_close(&part);
            if (e == EAGAIN && fr->total == 0)
                return -EAGAIN;
            wire_frames_close(fr);
            if (e == EINTR)
                return -EINTR;
            if (e != ETERM)
                log_error("wire: receiving frame %zu failed: %s", fr->total, zmq_strerror(e));
            return e == EAGAIN ? -EIO : wire_errno(e);
        }
        bool more = zmq_msg_more(&part);
        fr->total++;
        if (fr->kept < WIRE_FRAMES_KEPT) {
            zmq_msg_init(&fr->f[fr->kept]);
            zmq_msg_move(&fr->f[fr->kept++], &part);
        }
        zmq_msg_close(&part);
        if (!more)
            return 0;
    }
}

/* Counts a malformed message and logs the first of each reason, naming the peer when known. */
static int wire_reject(struct wire_socket *s, const struct wire_verdict *v, uint32_t type,
                       const uint8_t *id, size_t id_len)
{
    s->stats.rejected++;
    s->stats.rejected_by[v->why]++;
    if (s->reject_logged[v->why])
        return -EPROTO;
    s->reject_logged[v->why] = true;
    char peer[33] = "";
    size_t n = id_len < sizeof peer - 1 ? id_len : sizeof peer - 1;
    for (size_t i = 0; i < n; i++) /* ids are bytes: show printable ones */
        peer[i] = id[i] >= 0x20 && id[i] < 0x7f ? (char)id[i] : '.';
    peer[n] = '\0';
    log_warn("wire: dropped a malformed message from '%s' (%s, type %s): %s; further ones of "
             "this kind are only counted", peer, wire_reject_name(v->why),
             wire_msg_type_name(type), v->detail);
    return -EPROTO;
}

/* Checks the envelope and frames and fills m. Returns 0, -EPROTO with v, or -ENOMEM. */
static int wire_decode(struct wire_msg *m, zmq_msg_t *env_frame, zmq_msg_t *tensor_frame,
                       size_t data_frames, struct wire_verdict *v)
{
    size_t env_len = zmq_msg_size(env_frame);
    if (data_frames == 0 || data_frames > 2) {
        wire_fail(v, WIRE_REJECT_FRAMES, "%zu data frames (1 or 2)", data_frames);
        return -EPROTO;
    }
    if (env_len == 0 || env_len > WIRE_ENVELOPE_MAX) {
        wire_fail(v, WIRE_REJECT_ENVELOPE, "envelope of %zu bytes (1..%u)", env_len,
                  WIRE_ENVELOPE_MAX);
        return -EPROTO;
    }
    Lamina__Envelope *env = lamina__envelope__unpack(NULL, env_len, zmq_msg_data(env_frame));
    if (!env) {
        wire_fail(v, WIRE_REJECT_ENVELOPE, "envelope of %zu bytes does not unpack", env_len);
        return -EPROTO;
    }
    int rc = -EPROTO;
    m->type = env->type;
    m->seq_no = env->seq_no;
    size_t tensor_len = tensor_frame ? zmq_msg_size(tensor_frame) : 0;
    if (env->version != WIRE_VERSION)
        wire_fail(v, WIRE_REJECT_VERSION, "version %u, this build speaks %d", env->version,
                  WIRE_VERSION);
    else if (!wire_type_is_known(env->type))
        wire_fail(v, WIRE_REJECT_TYPE, "type %u unknown", env->type);
    else if ((env->tensor_bytes != 0) != (data_frames == 2) || env->tensor_bytes != tensor_len)
        wire_fail(v, WIRE_REJECT_FRAMES, "tensor_bytes %llu declared, %zu data frames, tensor "
                  "frame of %zu bytes", (unsigned long long)env->tensor_bytes, data_frames,
                  tensor_len);
    else
        rc = wire_decode_payload(m, &env->payload, v);
    lamina__envelope__free_unpacked(env, NULL);
    if (rc)
        return rc;
    if (tensor_frame) {
        rc = wire_adopt_tensor(m, tensor_frame);
        if (rc)
            return rc;
    }
    return wire_msg_check(m, v) ? 0 : -EPROTO;
}

/* Turns one read message into m (or a rejection). */
static int wire_accept(struct wire_socket *s, struct wire_frames *fr, struct wire_msg *m,
                       void *id_buf, size_t *id_len)
{
    bool router = s->type == ZMQ_ROUTER;
    size_t first = router ? 1 : 0;
    struct wire_verdict v = {0};
    int rc;
    if (router) {
        size_t n = zmq_msg_size(&fr->f[0]);
        ASSERT(n <= *id_len); /* ZeroMQ ids are at most WIRE_ID_MAX bytes */
        memcpy(id_buf, zmq_msg_data(&fr->f[0]), n);
        *id_len = n;
    }
    size_t data_frames = fr->total - first;
    if (fr->total <= first) {
        wire_fail(&v, WIRE_REJECT_FRAMES, "no data frame after the identity");
        rc = -EPROTO;
    } else {
        zmq_msg_t *tensor = data_frames == 2 ? &fr->f[first + 1] : NULL;
        rc = wire_decode(m, &fr->f[first], tensor, data_frames, &v);
    }
    uint32_t type = m->type;
    if (rc) {
        wire_msg_free(m);
        return rc == -EPROTO ? wire_reject(s, &v, type, id_buf, router ? *id_len : 0) : rc;
    }
    s->stats.received++;
    for (size_t i = first; i < fr->kept; i++)
        s->stats.bytes_received += zmq_msg_size(&fr->f[i]);
    s->stats.bytes_received += m->tensor_bytes;
    s->stats.tensors_copied += m->storage && m->storage->tensor_copy;
    return 0;
}

static int wire_wait(struct wire_socket *s, int64_t deadline)
{
    int left = -1;
    if (deadline >= 0) {
        int64_t now = wire_now_ms();
        left = now >= deadline ? 0 : (int)(deadline - now);
    }
    zmq_pollitem_t item = {.socket = s->zsock, .events = ZMQ_POLLIN};
    if (s->spin_us > 0 && left != 0) { /* a reply due in microseconds: skip the wake-up */
        struct timespec t0, t;
        clock_gettime(CLOCK_MONOTONIC, &t0);
        do {
            int r = zmq_poll(&item, 1, 0);
            if (r != 0)
                break;
            clock_gettime(CLOCK_MONOTONIC, &t);
        } while ((t.tv_sec - t0.tv_sec) * 1000000 + (t.tv_nsec - t0.tv_nsec) / 1000 < s->spin_us);
    }
    int rc = zmq_poll(&item, 1, left);
    if (rc > 0)
        return 0;
    if (rc == 0)
        return -ETIMEDOUT;
    int e = zmq_errno();
    if (e == EINTR)
        return -EINTR;
    if (e != ETERM)
        log_error("wire: zmq_poll failed: %s", zmq_strerror(e));
    return wire_errno(e);
}

int wire_recv(struct wire_socket *s, struct wire_msg *m, void *id_buf, size_t *id_len,
              int timeout_ms)
{
    bool router = s->type == ZMQ_ROUTER;
    ASSERT(m);
    ASSERT(router ? id_buf && id_len && *id_len >= WIRE_ID_MAX : !id_buf && !id_len);
    memset(m, 0, sizeof *m);
    int64_t deadline = timeout_ms < 0 ? -1 : wire_now_ms() + timeout_ms;
    struct wire_frames fr;
    for (;;) {
        int rc = wire_read_frames(s, &fr);
        if (rc == 0)
            break;
        if (rc != -EAGAIN)
            return rc;
        rc = wire_wait(s, deadline);
        if (rc)
            return rc;
    }
    int rc = wire_accept(s, &fr, m, id_buf, id_len);
    wire_frames_close(&fr);
    return rc;
}

/* ---- runtime directory and endpoints -------------------------------------------------------- */

/* base, else $XDG_RUNTIME_DIR when absolute, else /tmp; *from_env tells which. */
static const char *wire_rundir_base(const char *base, bool *from_env)
{
    const char *xdg = getenv("XDG_RUNTIME_DIR");
    *from_env = !base && xdg && xdg[0] == '/';
    if (base)
        return base;
    return *from_env ? xdg : "/tmp";
}

int wire_rundir_create(const char *base, char *dir, size_t cap)
{
    bool from_env;
    base = wire_rundir_base(base, &from_env);
    char tmpl[WIRE_PATH_MAX];
    int n = snprintf(tmpl, sizeof tmpl, "%s/lamina-%ld-XXXXXX", base, (long)getpid());
    /* room for "/NAME.sock" of the longest name */
    if (n < 0 || (size_t)n + 1 + WIRE_NAME_MAX + 5 >= WIRE_PATH_MAX || (size_t)n >= cap) {
        log_error("wire: runtime directory under %s would leave no room for socket names "
                  "(ipc paths are limited to %d bytes)", base, WIRE_PATH_MAX - 1);
        return -ENAMETOOLONG;
    }
    if (!mkdtemp(tmpl)) {
        int e = errno;
        if (from_env) {
            log_warn("wire: cannot make a runtime directory in $XDG_RUNTIME_DIR %s: %s; using "
                     "/tmp", base, strerror(e));
            return wire_rundir_create("/tmp", dir, cap);
        }
        log_error("wire: mkdtemp %s failed: %s", tmpl, strerror(e));
        return -e;
    }
    memcpy(dir, tmpl, (size_t)n + 1);
    return 0;
}

int wire_rundir_remove(const char *dir)
{
    DIR *d = opendir(dir);
    if (!d) {
        int e = errno;
        log_error("wire: opening runtime directory %s failed: %s", dir, strerror(e));
        return -e;
    }
    int rc = 0;
    struct dirent *de;
    while ((de = readdir(d))) {
        if (!strcmp(de->d_name, ".") || !strcmp(de->d_name, ".."))
            continue;
        if (unlinkat(dirfd(d), de->d_name, 0) != 0 && !rc) {
            rc = -errno;
            log_error("wire: removing %s/%s failed: %s", dir, de->d_name, strerror(-rc));
        }
    }
    closedir(d);
    if (rmdir(dir) != 0 && !rc) {
        rc = -errno;
        log_error("wire: removing runtime directory %s failed: %s", dir, strerror(-rc));
    }
    return rc;
}

/* The pid in a name "lamina-PID-XXXXXX" that mkdtemp made, or 0 for any other name. */
static long wire_rundir_pid(const char *name)
{
    if (strncmp(name, "lamina-", 7) != 0 || name[7] < '1' || name[7] > '9')
        return 0;
    char *end;
    long pid = strtol(name + 7, &end, 10);
    if (*end != '-' || strlen(end + 1) != 6 ||
        strspn(end + 1, "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNOPQRSTUVWXYZ0123456789") != 6)
        return 0;
    return pid;
}

int wire_rundir_sweep(const char *base)
{
    bool from_env;
    base = wire_rundir_base(base, &from_env);
    DIR *d = opendir(base);
    if (!d) {
        int e = errno;
        log_error("wire: opening %s to sweep old runtime directories failed: %s", base,
                  strerror(e));
        return -e;
    }
    int removed = 0;
    struct dirent *de;
    while ((de = readdir(d))) {
        long pid = wire_rundir_pid(de->d_name);
        struct stat st;
        if (pid <= 0 || pid > INT32_MAX || kill((pid_t)pid, 0) == 0 || errno != ESRCH)
            continue; /* not ours by name, or its process lives (EPERM: someone else's) */
        if (fstatat(dirfd(d), de->d_name, &st, AT_SYMLINK_NOFOLLOW) != 0 ||
            !S_ISDIR(st.st_mode) || st.st_uid != getuid())
            continue;
        char path[2 * WIRE_PATH_MAX + 64];
        snprintf(path, sizeof path, "%s/%s", base, de->d_name);
        if (wire_rundir_remove(path) == 0) {
            removed++;
            log_info("wire: removed runtime directory %s of dead process %ld", path, pid);
        }
    }
    closedir(d);
    return removed;
}

int wire_endpoint_ipc(char *buf, size_t cap, const char *dir, const char *name)
{
    size_t len = strlen(name);
    if (len == 0 || len > WIRE_NAME_MAX || strspn(name, "abcdefghijklmnopqrstuvwxyz"
                                                        "ABCDEFGHIJKLMNOPQRSTUVWXYZ"
                                                        "0123456789_-") != len) {
        log_error("wire: socket name '%.40s' must be 1..%d of [A-Za-z0-9_-]", name,
                  WIRE_NAME_MAX);
        return -EINVAL;
    }
    int n = snprintf(buf, cap, "ipc://%s/%s.sock", dir, name);
    if (n < 0 || (size_t)n >= cap || (size_t)n - 6 >= WIRE_PATH_MAX) {
        log_error("wire: ipc path %s/%s.sock is too long (limit %d bytes)", dir, name,
                  WIRE_PATH_MAX - 1);
        return -ENAMETOOLONG;
    }
    return 0;
}

/* ---- CURVE keys ---------------------------------------------------------------------------- */

static const char wire_z85_alphabet[] = "0123456789abcdefghijklmnopqrstuvwxyz"
                                        "ABCDEFGHIJKLMNOPQRSTUVWXYZ.-:+=^!/*?&<>()[]{}@%$#";

int wire_keypair_generate(struct wire_keypair *kp)
{
    if (!zmq_has("curve")) {
        log_error("wire: cannot make CURVE keys: libzmq was built without CURVE");
        return -ENOTSUP;
    }
    char pub[WIRE_KEY_Z85_LEN + 1], sec[WIRE_KEY_Z85_LEN + 1];
    int rc = ZMQ_CHECK(zmq_curve_keypair(pub, sec));
    if (rc == 0)
        rc = wire_key_from_z85(pub, kp->public_key);
    if (rc == 0)
        rc = wire_key_from_z85(sec, kp->secret_key);
    explicit_bzero(sec, sizeof sec);
    return rc;
}

int wire_key_to_z85(const uint8_t *key, char *out)
{
    for (size_t g = 0; g < WIRE_KEY_BYTES / 4; g++) {
        uint32_t v = (uint32_t)key[4 * g] << 24 | (uint32_t)key[4 * g + 1] << 16 |
                     (uint32_t)key[4 * g + 2] << 8 | key[4 * g + 3];
        for (int i = 4; i >= 0; i--) {
            out[5 * g + (size_t)i] = wire_z85_alphabet[v % 85];
            v /= 85;
        }
    }
    out[WIRE_KEY_Z85_LEN] = '\0';
    return 0;
}

int wire_key_from_z85(const char *text, uint8_t *key)
{
    if (strnlen(text, WIRE_KEY_Z85_LEN + 1) != WIRE_KEY_Z85_LEN) {
        log_error("wire: a CURVE key in Z85 must be exactly %d characters", WIRE_KEY_Z85_LEN);
        return -EINVAL;
    }
    for (size_t g = 0; g < WIRE_KEY_BYTES / 4; g++) {
        uint64_t v = 0;
        for (size_t i = 0; i < 5; i++) {
            char c = text[5 * g + i];
            const char *p = c ? strchr(wire_z85_alphabet, c) : NULL;
            if (!p) {
                log_error("wire: CURVE key character %zu (0x%02x) is not Z85", 5 * g + i,
                          (unsigned char)c);
                return -EINVAL;
            }
            v = v * 85 + (uint64_t)(p - wire_z85_alphabet);
        }
        if (v > UINT32_MAX) {
            log_error("wire: CURVE key group %zu overflows 32 bits", g);
            return -EINVAL;
        }
        key[4 * g] = (uint8_t)(v >> 24);
        key[4 * g + 1] = (uint8_t)(v >> 16);
        key[4 * g + 2] = (uint8_t)(v >> 8);
        key[4 * g + 3] = (uint8_t)v;
    }
    return 0;
}
