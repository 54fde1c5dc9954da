/*
 * Process-level robustness of the wire protocol: 10,000 mutated messages sent to a real
 * lamina-worker's socket and 10,000 to the coordinator's (coordinator/cluster.c): no crash, no
 * sanitizer report, every reject counted, results unchanged.
 *
 * The oracle. Every mutated message is first sent through a PAIR socket in this process whose
 * wire_recv() applies exactly the checks of the receiving process; its verdict (rejected, and
 * why; or accepted, and as what) is tallied, so the MEASURE lines say how many of each reject
 * reason the targets were sent. A message the oracle accepts and that the target must act on
 * is not sent (the generator draws another): a STEP, SHUTDOWN or RESET to a worker (and an
 * ERROR while it waits for an expert reply); an ERROR, RESULT or EXPERT_REQUEST from an id the
 * coordinator takes for a worker's. Those are the trusted peer's words (see "Trust").
 *
 * Part A, a real worker. This binary plays the coordinator: a ROUTER in a fresh runtime
 * directory, fork+exec of lamina-worker --connect ENDPOINT --index 0 (argv[1], else
 * $LAMINA_WORKER_BIN, else lamina-worker in the parent of this binary's directory, else
 * build/lamina-worker; its stderr goes to /tmp/test-frames-PID-*.log, kept on failure or with
 * TEST_FRAMES_KEEP), HELLO, 20 malformed messages, a LOAD_PLAN for a synthetic qwen3next model
 * (shape tiny, q8_0: 4 layers of 8 experts, width 64, vocabulary 512) with half of each
 * layer's experts resident, READY. The other half is asked of us: expert requests are answered
 * with the coordinator's CPU pool (coordinator/expert_pool) over our shared-memory segment, so
 * the request/reply path is under fire too. Then 10,000 mutations (truncated envelopes, random
 * bytes, garbage payloads, wrong versions, unknown types, tensor frames whose size disagrees
 * with the declared one or with the shape, zero or overflowing shapes, expert replies for steps
 * not in flight, extra frames, byte flips, out-of-range fields, valid messages of the wrong
 * direction) go to routing id "w0" with raw zmq_send. Every 250 of them a valid step: RESET,
 * a 3-token prefill at position 0, 250 mutations, a 1-token step at position 3 that depends on
 * the KV and DeltaNet state of the first; both results must equal, bit for bit, those of a
 * clean run made before any mutation. While the worker waits for each expert reply it also gets
 * stale replies (wrong step, layer, row count, width) and two mutations, which it must drop.
 * Then SHUTDOWN: exit status 0. The worker's log must hold exactly one "dropped a malformed
 * message" line per reject reason sent, and no AddressSanitizer, LeakSanitizer or UBSan line.
 * Then four STEPs that wire accepts and the worker must refuse (width + 1, max_batch + 1
 * tokens, pos + n > n_ctx, pos 2^32 - 1), each to a fresh worker: an ERROR whose text names
 * the step, then either exit status 1 (the documented "non-zero on any error") or still
 * serving; never a signal.
 * Oversized frames (1 GiB + 1, over ZMQ_MAXMSGSIZE; mapped, never touched) go to another fresh
 * worker: see oversize_start() for what is asserted. Its wait overlaps part B.
 *
 * Part B, the coordinator. cluster_create() in this process, 2 spawned workers, half of the
 * experts resident; the endpoint is found by globbing this pid's runtime directories. A clean
 * sequence of 4 steps (3-token prefill, 1, 1, 2 tokens) gives the reference logits; its first
 * step must equal part A's bit for bit (same model, other split, our replies there). Then:
 *   B1: a thread sends 10,000 mutations from 11 DEALERs, 9 with ids no worker has ("stranger",
 *       "w", "w99", "W0", binary ids, one chosen by ZeroMQ ...) and 2 with ids that parse as a
 *       worker's without being one ("w00", "h01"), plus 20 raw junk connections on the unix
 *       socket, while the main thread runs the sequence over and over: every run must equal
 *       the reference. Each socket ends with a SHUTDOWN, which the coordinator logs as dropped;
 *       seeing all of them proves every mutation was read. One reject warning per reason.
 *   B2: two frames over ZMQ_MAXMSGSIZE from a stranger; the sequence after them must match.
 *   B3: 500 mutations from an impostor that takes over "w0", then a step (measured only).
 * Demonstrations on two more clusters, measured only: a forged ERROR, a forged RESULT, and an
 * idle gap of 2 s between steps (see part_b_demos()). At the end: no child process (waitpid),
 * no /dev/shm/lamina-PID-*, no runtime directory of this pid.
 *
 * Trust. The coordinator's ROUTER knows a peer by the routing id the peer chose;
 * ZMQ_ROUTER_HANDOVER lets a new connection take over an id, and cluster.c reads "w00" as
 * worker 0. Whoever can connect (ipc: the same user, through the 0700 runtime directory; tcp:
 * a CURVE key) can speak as a worker: a forged ERROR fails the step, a forged RESULT for the
 * step in flight is taken as its logits, and an impostor of "w0" leaves the real worker 0 cut
 * off for good. On ipc that is the boundary of one user's processes, which can already signal
 * or ptrace the coordinator, so the test sends only what a stranger's garbage can be and
 * measures, without asserting, what a worker's forged words do.
 */
#include <errno.h>
#include <fcntl.h>
#include <glob.h>
#include <math.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "common/log.h"
#include "coordinator/cluster.h"
#include "coordinator/expert_pool.h"
#include "ipc/shm.h"
#include "ipc/wire.h"
#include "model/arch.h"
#include "model/gguf.h"
#include "model/quant.h"
#include "model/synth.h"
#include "tests/check.h"

#define N_WORKER_MUT 10000   /* mutations to the worker (part A) */
#define N_STRANGER_MUT 10000 /* mutations from strangers to the coordinator (B1) */
#define N_SPOOF_MUT 500      /* mutations from an impostor of "w0" (B3) */
#define PROBE_EVERY 250      /* mutations between two valid steps */
#define N_CTX 256
#define MAX_BATCH 16
#define PREFILL 3            /* tokens of the first step of a probe */
#define N_OVERSIZE_WORKER 3
#define N_OVERSIZE_COORD 2
#define N_RAW_JUNK 20        /* raw unix-socket connections with junk bytes */
#define PAYLOAD_CAP (64u * 1024)
#define ENV_CAP (WIRE_ENVELOPE_MAX + 4096)
#define TENSOR_CAP (64u * 1024)
#define FRAMES_MAX 6
#define START_TIMEOUT_MS 30000 /* hello and ready, generous for sanitizer builds */
#define STEP_TIMEOUT_MS 30000

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static void sleep_ms(int ms)
{
    struct timespec ts = {ms / 1000, (long)(ms % 1000) * 1000000L};
    nanosleep(&ts, NULL);
}

static uint64_t rng_next(uint64_t *s)
{
    uint64_t z = (*s += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static uint32_t rng_below(uint64_t *s, uint32_t n)
{
    return (uint32_t)(rng_next(s) % n);
}

/* ---- a protobuf writer of our own (the generated code would refuse to write bad input) ---- */

struct pb {
    uint8_t *b;
    size_t n, cap;
};

static void pb_byte(struct pb *p, uint8_t v)
{
    if (p->n >= p->cap) {
        fprintf(stderr, "test_frames: protobuf buffer of %zu bytes too small\n", p->cap);
        abort();
    }
    p->b[p->n++] = v;
}

static void pb_varint(struct pb *p, uint64_t v)
{
    while (v >= 0x80) {
        pb_byte(p, (uint8_t)(v | 0x80));
        v >>= 7;
    }
    pb_byte(p, (uint8_t)v);
}

static void pb_u(struct pb *p, uint32_t field, uint64_t v)
{
    pb_varint(p, (uint64_t)field << 3);
    pb_varint(p, v);
}

static void pb_i32(struct pb *p, uint32_t field, int32_t v)
{
    pb_u(p, field, (uint64_t)(int64_t)v);
}

static void pb_bytes(struct pb *p, uint32_t field, const void *d, size_t n)
{
    pb_varint(p, (uint64_t)field << 3 | 2);
    pb_varint(p, n);
    for (size_t i = 0; i < n; i++)
        pb_byte(p, ((const uint8_t *)d)[i]);
}

static void pb_str(struct pb *p, uint32_t field, const char *s)
{
    pb_bytes(p, field, s, strlen(s));
}

static void pb_packed(struct pb *p, uint32_t field, const uint32_t *v, size_t n)
{
    size_t len = 0;
    for (size_t i = 0; i < n; i++) /* the length of the varints first */
        for (uint64_t x = v[i], k = 0; k == 0 || x; x >>= 7, k++)
            len++;
    pb_varint(p, (uint64_t)field << 3 | 2);
    pb_varint(p, len);
    for (size_t i = 0; i < n; i++)
        pb_varint(p, v[i]);
}

/* ---- messages and mutations ---- */

/* The data frames of one message (a ROUTER adds the identity in front). */
struct frames {
    int n;
    const uint8_t *p[FRAMES_MAX];
    size_t len[FRAMES_MAX];
};

enum mut {
    MUT_TRUNCATED,      /* a valid envelope cut short */
    MUT_RANDOM,         /* random bytes in 1..3 frames */
    MUT_GARBAGE,        /* valid envelope, payload no protobuf reader accepts */
    MUT_VERSION,        /* version other than WIRE_VERSION */
    MUT_TYPE,           /* unknown type */
    MUT_TENSOR_SIZE,    /* tensor frame size != declared tensor_bytes */
    MUT_SHAPE,          /* declared size != the shape, or a tensor on a type without one */
    MUT_STEP_BAD,       /* STEP of zero tokens, zero width, or an overflowing shape */
    MUT_STALE_REPLY,    /* a valid EXPERT_REPLY for no step in flight */
    MUT_EXTRA_FRAMES,   /* a valid message with frames after it */
    MUT_FLIP,           /* 1..3 bytes of a valid envelope changed */
    MUT_NO_TENSOR,      /* a declared tensor missing, or one nobody declared */
    MUT_ENVELOPE_SIZE,  /* an empty envelope, or one over WIRE_ENVELOPE_MAX */
    MUT_WRONG_WAY,      /* a valid message of any type */
    MUT_FIELDS,         /* fields out of range */
    MUT_FLIP_STEP,      /* 1..3 bytes of a valid STEP envelope changed */
    MUT_COUNT,
    MUT_COLLECT = MUT_COUNT, /* stale replies sent while the worker waits for one (tally) */
    MUT_TALLY,
};

static const char *const mut_names[MUT_TALLY] = {
    "truncated", "random", "garbage", "version", "type", "tensor_size", "shape", "step_bad",
    "stale_reply", "extra_frames", "flip", "no_tensor", "envelope_size", "wrong_way", "fields",
    "flip_step", "collect"};

struct gen {
    uint64_t rng;
    uint32_t n_embd, n_vocab, n_layer, n_expert;
    struct pb pl, env;
    uint8_t *tensor; /* TENSOR_CAP bytes of noise */
    uint8_t extra[3];
    struct frames fr;
};

static int gen_init(struct gen *g, uint64_t seed, const struct arch_hparams *hp)
{
    memset(g, 0, sizeof(*g));
    g->rng = seed;
    g->n_embd = hp->n_embd;
    g->n_vocab = hp->n_vocab;
    g->n_layer = hp->n_layer;
    g->n_expert = hp->n_expert;
    g->pl = (struct pb){.b = malloc(PAYLOAD_CAP), .cap = PAYLOAD_CAP};
    g->env = (struct pb){.b = malloc(ENV_CAP), .cap = ENV_CAP};
    g->tensor = malloc(TENSOR_CAP);
    if (!g->pl.b || !g->env.b || !g->tensor)
        return -ENOMEM;
    for (size_t i = 0; i < TENSOR_CAP; i++)
        g->tensor[i] = (uint8_t)rng_next(&g->rng);
    memcpy(g->extra, "xyz", 3);
    return 0;
}

static void gen_free(struct gen *g)
{
    free(g->pl.b);
    free(g->env.b);
    free(g->tensor);
}

static void gen_envelope(struct gen *g, uint64_t version, uint64_t type, uint64_t tensor_bytes)
{
    g->env.n = 0;
    pb_u(&g->env, 1, version);
    pb_u(&g->env, 2, type);
    pb_u(&g->env, 3, rng_next(&g->rng) & 0xffffff);
    pb_bytes(&g->env, 4, g->pl.b, g->pl.n);
    if (tensor_bytes)
        pb_u(&g->env, 5, tensor_bytes);
}

/* Frames: the envelope, then a tensor frame of tensor_len bytes when with_tensor. */
static void gen_frames(struct gen *g, bool with_tensor, size_t tensor_len)
{
    g->fr.n = 1;
    g->fr.p[0] = g->env.b;
    g->fr.len[0] = g->env.n;
    if (with_tensor) {
        g->fr.p[1] = g->tensor;
        g->fr.len[1] = tensor_len < TENSOR_CAP ? tensor_len : TENSOR_CAP;
        g->fr.n = 2;
    }
}

static void enc_step(struct pb *p, uint32_t pos, uint32_t n, uint64_t step, uint32_t n_embd)
{
    p->n = 0;
    pb_u(p, 1, 0);
    pb_u(p, 2, pos);
    pb_u(p, 3, n);
    pb_u(p, 4, step);
    pb_u(p, 5, 1);
    pb_u(p, 6, n_embd);
}

static void enc_reply(struct pb *p, uint64_t step, uint32_t layer, uint32_t rows, uint32_t n_embd)
{
    p->n = 0;
    pb_u(p, 1, step);
    pb_u(p, 2, layer);
    pb_u(p, 3, rows);
    pb_u(p, 4, n_embd);
}

static void enc_request(struct pb *p, uint64_t step, uint32_t layer, const uint32_t *experts,
                        size_t ne, const uint32_t *counts, size_t nc, uint32_t n_embd)
{
    p->n = 0;
    pb_u(p, 1, step);
    pb_u(p, 2, layer);
    pb_packed(p, 3, experts, ne);
    pb_packed(p, 4, counts, nc);
    pb_u(p, 5, n_embd);
}

static void enc_result(struct pb *p, uint64_t step, uint32_t rows, uint32_t n_vocab, int32_t tok)
{
    p->n = 0;
    pb_u(p, 1, 0);
    pb_u(p, 2, step);
    pb_u(p, 3, rows);
    pb_u(p, 4, n_vocab);
    pb_i32(p, 5, tok);
}

/* A LoadPlan; residency of layers res[0..n_res) with bitmaps of bitmap_len bytes. */
static void enc_plan(struct pb *p, uint32_t begin, uint32_t end, uint32_t total,
                     const uint32_t *res, size_t n_res, size_t bitmap_len, uint32_t n_embd)
{
    static const uint8_t bitmap[WIRE_BITMAP_MAX + 8] = {0x55, 0xaa};
    p->n = 0;
    pb_str(p, 1, "/nonexistent/model.gguf");
    pb_str(p, 2, "/lamina-0-0000000000000000-0");
    pb_u(p, 3, 4096);
    pb_u(p, 4, begin);
    pb_u(p, 5, end);
    pb_u(p, 6, total);
    for (size_t i = 0; i < n_res; i++) {
        uint8_t inner[WIRE_BITMAP_MAX + 32];
        struct pb r = {.b = inner, .cap = sizeof(inner)};
        pb_u(&r, 1, res[i]);
        pb_bytes(&r, 2, bitmap, bitmap_len);
        pb_bytes(p, 7, r.b, r.n);
    }
    pb_str(p, 8, "cpu");
    pb_u(p, 10, N_CTX);
    pb_u(p, 12, MAX_BATCH);
    pb_u(p, 16, 1);
    pb_u(p, 17, n_embd);
    pb_u(p, 18, 512);
}

/* A message of type t that wire_recv accepts. */
static void gen_valid(struct gen *g, uint32_t t)
{
    uint64_t *r = &g->rng;
    struct pb *p = &g->pl;
    uint64_t tb = 0;
    p->n = 0;
    switch (t) {
    case WIRE_TYPE_HELLO:
        pb_u(p, 1, rng_below(r, 4));
        pb_u(p, 2, rng_below(r, 100000));
        pb_str(p, 3, rng_below(r, 2) ? "cpu" : "NVIDIA H200");
        pb_u(p, 4, rng_next(r));
        break;
    case WIRE_TYPE_LOAD_PLAN: {
        const uint32_t res[4] = {0, 1, 2, 3};
        enc_plan(p, 0, g->n_layer, g->n_layer, res, g->n_layer, 1, g->n_embd);
        break;
    }
    case WIRE_TYPE_READY:
        pb_u(p, 1, rng_next(r));
        pb_u(p, 2, rng_below(r, 1000));
        break;
    case WIRE_TYPE_STEP: {
        uint32_t n = 1 + rng_below(r, 4);
        enc_step(p, rng_below(r, 300), n, rng_next(r) & 0xffff, g->n_embd);
        tb = (uint64_t)n * g->n_embd * 4;
        break;
    }
    case WIRE_TYPE_EXPERT_REQUEST: {
        uint32_t ne = 1 + rng_below(r, 3), ex[3], cnt[3], rows = 0;
        for (uint32_t i = 0; i < ne; i++) {
            ex[i] = i * 3 + rng_below(r, 3);
            cnt[i] = 1 + rng_below(r, 2);
            rows += cnt[i];
        }
        enc_request(p, rng_next(r) & 0xffff, rng_below(r, 6), ex, ne, cnt, ne, g->n_embd);
        tb = (uint64_t)rows * g->n_embd * 4;
        break;
    }
    case WIRE_TYPE_EXPERT_REPLY: {
        uint32_t rows = 1 + rng_below(r, 4);
        enc_reply(p, 1000000 + rng_below(r, 1000000), rng_below(r, 6), rows, g->n_embd);
        tb = (uint64_t)rows * g->n_embd * 4;
        break;
    }
    case WIRE_TYPE_RESULT:
        if (rng_below(r, 2)) {
            uint32_t rows = 1 + rng_below(r, 2);
            enc_result(p, 1000000 + rng_below(r, 1000), rows, g->n_vocab, -1);
            tb = (uint64_t)rows * g->n_vocab * 4;
        } else {
            enc_result(p, 1000000 + rng_below(r, 1000), 0, g->n_vocab,
                       (int32_t)rng_below(r, g->n_vocab));
        }
        break;
    case WIRE_TYPE_TIMING:
        pb_str(p, 1, rng_below(r, 2) ? "{\"worker\":0,\"ms\":{\"total\":1e308},\"tokens\":-7}"
                                     : "{\"tokens\":\"x\",\"hit\":18446744073709551615");
        break;
    case WIRE_TYPE_HEARTBEAT:
        pb_u(p, 1, rng_next(r));
        break;
    case WIRE_TYPE_ERROR:
        pb_i32(p, 1, -(int32_t)(1 + rng_below(r, 130)));
        pb_str(p, 2, "forged by test_frames");
        pb_u(p, 3, rng_below(r, 4));
        pb_u(p, 4, rng_next(r) & 0xffff);
        break;
    case WIRE_TYPE_RESET:
        pb_u(p, 1, rng_next(r));
        break;
    default: /* SHUTDOWN: no fields */
        break;
    }
    gen_envelope(g, WIRE_VERSION, t, tb);
    gen_frames(g, tb > 0, tb);
}

static uint32_t gen_type(struct gen *g)
{
    return WIRE_TYPE_FIRST + rng_below(&g->rng, WIRE_TYPE_LAST - WIRE_TYPE_FIRST + 1);
}

static uint32_t gen_tensor_type(struct gen *g)
{
    static const uint32_t t[] = {WIRE_TYPE_STEP, WIRE_TYPE_EXPERT_REQUEST,
                                 WIRE_TYPE_EXPERT_REPLY, WIRE_TYPE_RESULT};
    return t[rng_below(&g->rng, 4)];
}

/* A valid message with a tensor frame (a RESULT may come without one: draw again). */
static void gen_valid_tensor(struct gen *g)
{
    do
        gen_valid(g, gen_tensor_type(g));
    while (g->fr.n < 2);
}

static void gen_flip(struct gen *g, uint32_t type)
{
    gen_valid(g, type);
    for (uint32_t k = 1 + rng_below(&g->rng, 3); k; k--)
        g->env.b[rng_below(&g->rng, (uint32_t)g->env.n)] = (uint8_t)rng_next(&g->rng);
}

/* A payload no protobuf reader accepts: a bad wire type, a cut varint, a length past the end. */
static void gen_garbage(struct gen *g)
{
    uint64_t *r = &g->rng;
    struct pb *p = &g->pl;
    p->n = 0;
    switch (rng_below(r, 3)) {
    case 0:
        pb_varint(p, (uint64_t)(1 + rng_below(r, 20)) << 3 | (6 + rng_below(r, 2)));
        break;
    case 1:
        pb_varint(p, (uint64_t)(1 + rng_below(r, 20)) << 3);
        for (uint32_t i = 1 + rng_below(r, 10); i; i--)
            pb_byte(p, 0xff);
        break;
    default:
        pb_varint(p, (uint64_t)(1 + rng_below(r, 20)) << 3 | 2);
        pb_varint(p, 100 + rng_below(r, 1000));
        break;
    }
    for (uint32_t i = rng_below(r, 16); i; i--)
        pb_byte(p, (uint8_t)rng_next(r));
    gen_envelope(g, WIRE_VERSION, gen_type(g), 0);
    gen_frames(g, false, 0);
}

static void gen_fields_plan(struct gen *g, uint32_t which)
{
    const uint32_t L = g->n_layer, ok[2] = {0, 1}, same[2] = {1, 1}, out[1] = {L + 3};
    switch (which) {
    case 0: enc_plan(&g->pl, 2, 2, L, NULL, 0, 1, g->n_embd); break;     /* empty range */
    case 1: enc_plan(&g->pl, 0, L + 1, L, NULL, 0, 1, g->n_embd); break; /* past the total */
    case 2: enc_plan(&g->pl, 0, L, L, same, 2, 1, g->n_embd); break;     /* not increasing */
    case 3: enc_plan(&g->pl, 0, L, L, out, 1, 1, g->n_embd); break;      /* outside range */
    default: enc_plan(&g->pl, 0, L, L, ok, 2, WIRE_BITMAP_MAX + 1, g->n_embd); break;
    }
    gen_envelope(g, WIRE_VERSION, WIRE_TYPE_LOAD_PLAN, 0);
}

static void gen_fields(struct gen *g)
{
    static char big[WIRE_STRING_MAX + 2];
    static uint32_t many[WIRE_EXPERTS_MAX + 1];
    uint64_t *r = &g->rng;
    struct pb *p = &g->pl;
    memset(big, 'a', sizeof(big) - 1);
    uint32_t which = rng_below(r, 13), ex[3] = {1, 2, 3}, cnt[3] = {1, 1, 1};
    uint64_t type = WIRE_TYPE_HELLO, tb = 0;
    p->n = 0;
    if (which < 5) {
        gen_fields_plan(g, which);
        gen_frames(g, false, 0);
        return;
    }
    switch (which) {
    case 5: pb_str(p, 3, big); break; /* device name too long */
    case 6: {                          /* CURVE key of the wrong length */
        uint8_t key[WIRE_KEY_BYTES + 1] = {0};
        pb_bytes(p, 6, key, rng_below(r, 2) ? WIRE_KEY_BYTES - 1 : WIRE_KEY_BYTES + 1);
        break;
    }
    case 7:
        type = WIRE_TYPE_TIMING;
        pb_str(p, 1, "{\"a\":1}\n{\"b\":2}");
        break;
    case 8: /* token out of range, or neither token nor logits */
        type = WIRE_TYPE_RESULT;
        enc_result(p, 1, 0, g->n_vocab, rng_below(r, 2) ? (int32_t)g->n_vocab + 5 : -2);
        if (rng_below(r, 2))
            enc_result(p, 1, 0, g->n_vocab, -1);
        break;
    case 9: /* experts and counts of different lengths */
        type = WIRE_TYPE_EXPERT_REQUEST;
        enc_request(p, 1, 0, ex, 3, cnt, 2, g->n_embd);
        tb = 3ull * g->n_embd * 4;
        break;
    case 10: /* a zero count */
        type = WIRE_TYPE_EXPERT_REQUEST;
        cnt[1] = 0;
        enc_request(p, 1, 0, ex, 3, cnt, 3, g->n_embd);
        tb = 2ull * g->n_embd * 4;
        break;
    case 11: /* more than WIRE_EXPERTS_MAX experts, one row of width 1 each */
        type = WIRE_TYPE_EXPERT_REQUEST;
        for (size_t i = 0; i <= WIRE_EXPERTS_MAX; i++)
            many[i] = 1;
        enc_request(p, 1, 0, many, WIRE_EXPERTS_MAX + 1, many, WIRE_EXPERTS_MAX + 1, 1);
        tb = (WIRE_EXPERTS_MAX + 1) * 4ull;
        break;
    default: /* error text too long */
        type = WIRE_TYPE_ERROR;
        pb_i32(p, 1, -5);
        pb_str(p, 2, big);
        break;
    }
    gen_envelope(g, WIRE_VERSION, type, tb);
    gen_frames(g, tb > 0, tb);
}

/* A tensor-carrying message whose declared size disagrees with its shape. */
static void gen_shape(struct gen *g)
{
    uint64_t *r = &g->rng;
    uint32_t rows = 1 + rng_below(r, 3), off = 4 * (1 + rng_below(r, 3));
    uint64_t tb;
    uint32_t type = WIRE_TYPE_STEP;
    switch (rng_below(r, 4)) {
    case 0:
        enc_step(&g->pl, 0, rows, 1, g->n_embd);
        tb = (uint64_t)rows * g->n_embd * 4 + off;
        break;
    case 1:
        type = WIRE_TYPE_EXPERT_REPLY;
        enc_reply(&g->pl, 1, 0, rows, g->n_embd);
        tb = (uint64_t)rows * g->n_embd * 4 - off;
        break;
    case 2:
        type = WIRE_TYPE_RESULT;
        enc_result(&g->pl, 1, rows, g->n_vocab, -1);
        tb = (uint64_t)(rows + 1) * g->n_vocab * 4;
        break;
    default: /* a type that carries no tensor */
        type = rng_below(r, 2) ? WIRE_TYPE_HEARTBEAT : WIRE_TYPE_READY;
        g->pl.n = 0;
        pb_u(&g->pl, 1, 5);
        tb = 64;
        break;
    }
    gen_envelope(g, WIRE_VERSION, type, tb);
    gen_frames(g, true, tb);
}

static void gen_step_bad(struct gen *g)
{
    switch (rng_below(&g->rng, 3)) {
    case 0: /* zero tokens */
        enc_step(&g->pl, 0, 0, 1, g->n_embd);
        gen_envelope(g, WIRE_VERSION, WIRE_TYPE_STEP, 0);
        gen_frames(g, false, 0);
        break;
    case 1: /* zero width, with and without a tensor */
        enc_step(&g->pl, 0, 2, 1, 0);
        gen_envelope(g, WIRE_VERSION, WIRE_TYPE_STEP, 64);
        gen_frames(g, true, 64);
        break;
    default: /* rows x width x 4 overflows 64 bits */
        enc_step(&g->pl, 0, 0xffffffffu, 1, 0xffffffffu);
        gen_envelope(g, WIRE_VERSION, WIRE_TYPE_STEP, 64);
        gen_frames(g, true, 64);
        break;
    }
}

/* Builds mutation cls into g->fr. */
static void gen_mutation(struct gen *g, enum mut cls)
{
    uint64_t *r = &g->rng;
    switch (cls) {
    case MUT_TRUNCATED:
        gen_valid(g, gen_type(g));
        g->fr.len[0] = rng_below(r, (uint32_t)g->fr.len[0]);
        break;
    case MUT_RANDOM:
        g->env.n = 1 + rng_below(r, 300);
        for (size_t k = 0; k < g->env.n; k++)
            g->env.b[k] = (uint8_t)rng_next(r);
        gen_frames(g, rng_below(r, 2), rng_below(r, 300));
        if (rng_below(r, 3) == 0)
            g->fr.p[g->fr.n] = g->extra, g->fr.len[g->fr.n++] = 1 + rng_below(r, 3);
        break;
    case MUT_GARBAGE:
        gen_garbage(g);
        break;
    case MUT_VERSION: {
        static const uint64_t versions[] = {0, WIRE_VERSION + 1, 77, 0xffffffffu};
        gen_valid(g, gen_type(g));
        size_t tb = g->fr.n > 1 ? g->fr.len[1] : 0;
        gen_envelope(g, versions[rng_below(r, 4)], gen_type(g), tb);
        gen_frames(g, tb > 0, tb);
        break;
    }
    case MUT_TYPE: {
        static const uint64_t types[] = {0, WIRE_TYPE_LAST + 1, WIRE_TYPE_LAST + 2, 100,
                                         0xffff, 0xffffffffu};
        gen_valid(g, gen_type(g));
        size_t tb = g->fr.n > 1 ? g->fr.len[1] : 0;
        gen_envelope(g, WIRE_VERSION, types[rng_below(r, 6)], tb);
        gen_frames(g, tb > 0, tb);
        break;
    }
    case MUT_TENSOR_SIZE: {
        gen_valid_tensor(g);
        size_t tb = g->fr.len[1];
        g->fr.len[1] = rng_below(r, 2) ? tb + 1 + rng_below(r, 64) : rng_below(r, (uint32_t)tb);
        break;
    }
    case MUT_SHAPE:
        gen_shape(g);
        break;
    case MUT_STEP_BAD:
        gen_step_bad(g);
        break;
    case MUT_STALE_REPLY:
        gen_valid(g, WIRE_TYPE_EXPERT_REPLY);
        break;
    case MUT_EXTRA_FRAMES:
        gen_valid(g, gen_type(g));
        for (uint32_t k = 1 + rng_below(r, 3); k; k--) {
            g->fr.p[g->fr.n] = g->extra;
            g->fr.len[g->fr.n++] = rng_below(r, 4);
        }
        break;
    case MUT_FLIP:
        gen_flip(g, gen_type(g));
        break;
    case MUT_NO_TENSOR:
        if (rng_below(r, 2)) {
            gen_valid_tensor(g);
            g->fr.n = 1;
        } else {
            gen_valid(g, WIRE_TYPE_HEARTBEAT);
            gen_frames(g, true, 4 * (1 + rng_below(r, 8)));
        }
        break;
    case MUT_ENVELOPE_SIZE:
        g->env.n = rng_below(r, 8) == 0 ? WIRE_ENVELOPE_MAX + 1 + rng_below(r, 100) : 0;
        memset(g->env.b, 0x08, g->env.n);
        gen_frames(g, rng_below(r, 2), 16);
        break;
    case MUT_WRONG_WAY:
        gen_valid(g, gen_type(g));
        break;
    case MUT_FIELDS:
        gen_fields(g);
        break;
    default:
        gen_flip(g, WIRE_TYPE_STEP);
        break;
    }
}

/* ---- the oracle: wire_recv's verdict on a message, in this process ---- */

struct verdict {
    bool accepted;
    int reason;           /* enum wire_reject when rejected */
    uint32_t type;        /* when accepted */
    uint64_t step;        /* of an accepted EXPERT_REPLY */
};

struct oracle {
    struct wire_socket *rx;
    void *tx;
};

static int oracle_create(struct oracle *o, void *zctx, const char *name)
{
    char ep[64];
    snprintf(ep, sizeof(ep), "inproc://%s", name);
    o->rx = wire_socket_create(zctx, ZMQ_PAIR, NULL);
    o->tx = zmq_socket(zctx, ZMQ_PAIR);
    int zero = 0;
    if (!o->rx || !o->tx || wire_socket_bind(o->rx, ep) ||
        zmq_setsockopt(o->tx, ZMQ_LINGER, &zero, sizeof(zero)) || zmq_connect(o->tx, ep))
        return -EIO;
    return 0;
}

static void oracle_destroy(struct oracle *o)
{
    if (o->tx)
        zmq_close(o->tx);
    wire_socket_destroy(o->rx);
}

/* Sends frames on z, after the routing id when id is not NULL. The first frame is retried
 * while the peer's queue is full (each try blocks for the socket's ZMQ_SNDTIMEO); the others
 * cannot fail for that once it is in. Returns 0 or -errno. */
static int frames_send(void *z, const void *id, size_t id_len, const struct frames *f)
{
    for (int i = id ? -1 : 0; i < f->n; i++) {
        const void *p = i < 0 ? id : f->p[i];
        size_t n = i < 0 ? id_len : f->len[i];
        int more = i + 1 < f->n ? ZMQ_SNDMORE : 0;
        for (int tries = 0; zmq_send(z, p, n, more) < 0; tries++)
            if (zmq_errno() != EAGAIN || tries == 30 || i > (id ? -1 : 0))
                return -zmq_errno();
    }
    return 0;
}

static int oracle_judge(struct oracle *o, const struct frames *f, struct verdict *v)
{
    memset(v, 0, sizeof(*v));
    struct wire_stats before = *wire_socket_stats(o->rx);
    int rc = frames_send(o->tx, NULL, 0, f);
    struct wire_msg m;
    rc = rc ? rc : wire_recv(o->rx, &m, NULL, NULL, 2000);
    if (rc == -EPROTO) {
        const struct wire_stats *after = wire_socket_stats(o->rx);
        for (int k = 0; k < WIRE_REJECT_COUNT; k++)
            if (after->rejected_by[k] != before.rejected_by[k])
                v->reason = k;
        return 0;
    }
    if (rc)
        return rc;
    v->accepted = true;
    v->type = m.type;
    if (m.type == WIRE_TYPE_EXPERT_REPLY)
        v->step = m.expert_reply.step;
    wire_msg_free(&m);
    return 0;
}

/* Who a mutation goes to, which decides what an accepted one may be. */
enum target {
    TARGET_WORKER_IDLE,    /* a worker between steps */
    TARGET_WORKER_COLLECT, /* a worker waiting for an expert reply */
    TARGET_COORD_STRANGER, /* the coordinator, from an id no worker has */
    TARGET_COORD_SPOOF,    /* the coordinator, from an id it takes for a worker's */
};

/* May an accepted message of this verdict go to the target? (See "Trust" at the top.) */
static bool verdict_is_sendable(const struct verdict *v, enum target t)
{
    if (!v->accepted)
        return true;
    switch (t) {
    case TARGET_WORKER_IDLE:
        return v->type != WIRE_TYPE_STEP && v->type != WIRE_TYPE_SHUTDOWN &&
               v->type != WIRE_TYPE_RESET;
    case TARGET_WORKER_COLLECT: /* generated replies are for steps >= 1000000, none in
                                   flight; a flip could make one that is */
        return v->type != WIRE_TYPE_STEP && v->type != WIRE_TYPE_SHUTDOWN &&
               v->type != WIRE_TYPE_RESET && v->type != WIRE_TYPE_ERROR &&
               (v->type != WIRE_TYPE_EXPERT_REPLY || v->step >= 1000000);
    case TARGET_COORD_STRANGER: /* SHUTDOWN is kept for the end-of-burst marker */
        return v->type != WIRE_TYPE_SHUTDOWN;
    default:
        return v->type != WIRE_TYPE_SHUTDOWN && v->type != WIRE_TYPE_ERROR &&
               v->type != WIRE_TYPE_RESULT && v->type != WIRE_TYPE_EXPERT_REQUEST;
    }
}

/* What was sent, by class, verdict and reason. */
struct tally {
    uint64_t sent, accepted, rejected, skipped, oversize;
    uint64_t by_reason[WIRE_REJECT_COUNT];
    uint64_t by_class[MUT_TALLY];
    uint64_t accepted_by_type[WIRE_TYPE_LAST + 1];
};

static void tally_add(struct tally *t, const struct verdict *v, int cls)
{
    t->sent++;
    t->by_class[cls]++;
    if (v->accepted) {
        t->accepted++;
        t->accepted_by_type[v->type <= WIRE_TYPE_LAST ? v->type : 0]++;
    } else {
        t->rejected++;
        t->by_reason[v->reason]++;
    }
}

static void tally_merge(struct tally *a, const struct tally *b)
{
    a->sent += b->sent, a->accepted += b->accepted, a->rejected += b->rejected;
    a->skipped += b->skipped, a->oversize += b->oversize;
    for (int k = 0; k < WIRE_REJECT_COUNT; k++)
        a->by_reason[k] += b->by_reason[k];
    for (int k = 0; k < MUT_TALLY; k++)
        a->by_class[k] += b->by_class[k];
    for (int k = 0; k <= WIRE_TYPE_LAST; k++)
        a->accepted_by_type[k] += b->accepted_by_type[k];
}

static void tally_measure(const char *who, const struct tally *t)
{
    MEASURE("%s: %llu mutations sent (%llu rejected by wire, %llu valid but out of place), "
            "%llu drawn and not sent (a trusted peer's message), %llu over ZMQ_MAXMSGSIZE",
            who, (unsigned long long)t->sent, (unsigned long long)t->rejected,
            (unsigned long long)t->accepted, (unsigned long long)t->skipped,
            (unsigned long long)t->oversize);
    char line[512];
    int n = 0;
    for (int k = 0; k < WIRE_REJECT_COUNT; k++)
        n += snprintf(line + n, sizeof(line) - n, " %s %llu",
                      wire_reject_name((enum wire_reject)k),
                      (unsigned long long)t->by_reason[k]);
    MEASURE("%s: rejects by reason:%s", who, line);
    n = 0;
    for (int k = 0; k < MUT_TALLY; k++)
        n += snprintf(line + n, sizeof(line) - n, " %s %llu", mut_names[k],
                      (unsigned long long)t->by_class[k]);
    MEASURE("%s: by mutation:%s", who, line);
}

/* Draws mutations until one may go to target; leaves it in g->fr and tallies it. */
static int gen_next(struct gen *g, struct oracle *o, enum target t, struct tally *ty)
{
    for (;;) {
        enum mut cls = (enum mut)rng_below(&g->rng, MUT_COUNT);
        gen_mutation(g, cls);
        struct verdict v;
        int rc = oracle_judge(o, &g->fr, &v);
        if (rc)
            return rc;
        if (verdict_is_sendable(&v, t)) {
            tally_add(ty, &v, cls);
            return 0;
        }
        ty->skipped++;
    }
}

/* A frame of WIRE_MSG_MAX_DEFAULT + 1 bytes: mapped without reserve, never touched. */
static void oversize_free(void *data, void *hint)
{
    munmap(data, (size_t)(uintptr_t)hint);
}

static int send_oversize(void *z, const void *id, size_t id_len)
{
    const size_t n = (size_t)WIRE_MSG_MAX_DEFAULT + 1;
    void *p = mmap(NULL, n, PROT_READ, MAP_PRIVATE | MAP_ANONYMOUS | MAP_NORESERVE, -1, 0);
    if (p == MAP_FAILED)
        return -errno;
    zmq_msg_t msg;
    zmq_msg_init_data(&msg, p, n, oversize_free, (void *)(uintptr_t)n);
    if (id && zmq_send(z, id, id_len, ZMQ_SNDMORE) < 0) {
        zmq_msg_close(&msg);
        return -zmq_errno();
    }
    if (zmq_msg_send(&msg, z, 0) < 0) {
        int e = zmq_errno();
        zmq_msg_close(&msg);
        return -e;
    }
    return 0;
}

/* ---- files and processes ---- */

/* Removes a log of a passing run, unless TEST_FRAMES_KEEP is set. */
static void logs_remove(const char *path)
{
    if (!getenv("TEST_FRAMES_KEEP"))
        unlink(path);
}

static int count_lines(const char *path, const char *what)
{
    FILE *f = fopen(path, "r");
    if (!f)
        return -1;
    char line[4096];
    int n = 0;
    while (fgets(line, sizeof(line), f))
        n += strstr(line, what) != NULL;
    fclose(f);
    return n;
}

static int sanitizer_reports(const char *path)
{
    return count_lines(path, "AddressSanitizer") + count_lines(path, "LeakSanitizer") +
           count_lines(path, "runtime error:") + count_lines(path, "UndefinedBehaviorSanitizer");
}

/* Prints the lines of path that contain what, at most max of them, to stderr. */
static void print_lines(const char *path, const char *what, int max)
{
    FILE *f = fopen(path, "r");
    char line[4096];
    while (f && max > 0 && fgets(line, sizeof(line), f))
        if (!what || strstr(line, what))
            fputs(line, stderr), max--;
    if (f)
        fclose(f);
}

/* Waits at most timeout_ms for pid; returns true with *status when it exited. */
static bool wait_exit(pid_t pid, int *status, int timeout_ms)
{
    double end = now_s() + timeout_ms / 1000.0;
    do {
        pid_t r = waitpid(pid, status, WNOHANG);
        if (r == pid)
            return true;
        if (r < 0)
            return false;
        sleep_ms(5);
    } while (now_s() < end);
    return false;
}

static const char *worker_bin(int argc, char **argv, char *buf, size_t cap)
{
    if (argc > 1)
        return argv[1];
    const char *env = getenv("LAMINA_WORKER_BIN");
    if (env && *env)
        return env;
    ssize_t n = readlink("/proc/self/exe", buf, cap - 32);
    if (n > 0) { /* BUILD/tests/test_frames -> BUILD/lamina-worker */
        buf[n] = 0;
        for (int up = 0; up < 2; up++) {
            char *slash = strrchr(buf, '/');
            if (slash)
                *slash = 0;
        }
        strcat(buf, "/lamina-worker");
        if (access(buf, X_OK) == 0)
            return buf;
    }
    return "build/lamina-worker";
}

/*
 * cluster.c's cl_spawn() ignores the path cl_worker_bin() returns for cfg->worker_bin and
 * execs an uninitialised buffer (reported to the lead); its default, lamina-worker next to
 * this executable, works. Until that is fixed, part B leaves worker_bin NULL and makes that
 * default a link to bin (replacing a link left by an earlier run; a real file there is used as
 * it is). Returns true when the default can be used; *made: a link was made, remove it after.
 */
static bool worker_link(const char *bin, char *link, size_t cap, bool *made)
{
    char target[4096];
    struct stat st;
    *made = false;
    ssize_t n = readlink("/proc/self/exe", link, cap - 32);
    if (n <= 0 || !realpath(bin, target))
        return false;
    link[n] = 0;
    char *slash = strrchr(link, '/');
    strcpy(slash ? slash + 1 : link, "lamina-worker");
    if (lstat(link, &st) == 0 && !S_ISLNK(st.st_mode))
        return access(link, X_OK) == 0;
    unlink(link);
    *made = symlink(target, link) == 0;
    return *made;
}

/* ---- the model, the segment and the CPU pool ---- */

struct fixture {
    char path[128];
    struct gguf *g;
    struct arch_model *m;
    struct shm_segment *shm;
    struct expert_ref **refs;
    struct expert_pool *pool;
    float *h;  /* MAX_BATCH x n_embd inputs */
};

static int fixture_create(struct fixture *fx)
{
    memset(fx, 0, sizeof(*fx));
    snprintf(fx->path, sizeof(fx->path), "/tmp/test-frames-%d.gguf", (int)getpid());
    struct synth_config sc = {.arch = "qwen3next", .shape = "tiny", .type = QUANT_TYPE_Q8_0,
                              .seed = 11, .path = fx->path, .threads = 1};
    if (synth_write(&sc))
        return -EIO;
    struct gguf_config gc = {.path = fx->path};
    fx->g = gguf_open(&gc);
    struct arch_config ac = {.gguf = fx->g};
    fx->m = fx->g ? arch_load(&ac) : NULL;
    if (!fx->m)
        return -EIO;
    const struct arch_hparams *hp = &fx->m->hp;
    struct shm_create_config cc = {.model = fx->m, .gguf = fx->g, .instance = 1};
    fx->shm = shm_create(&cc);
    fx->refs = calloc(hp->n_layer, sizeof(*fx->refs));
    if (!fx->shm || !fx->refs)
        return -EIO;
    for (uint32_t l = 0; l < hp->n_layer; l++) {
        fx->refs[l] = calloc(hp->n_expert, sizeof(struct expert_ref));
        if (!fx->refs[l])
            return -ENOMEM;
        const bool fused = shm_entry(fx->shm, l, SHM_KIND_GATE) == NULL;
        for (uint32_t e = 0; e < hp->n_expert; e++) {
            struct expert_ref *r = &fx->refs[l][e];
            r->gate = shm_expert(fx->shm, l, fused ? SHM_KIND_GATE_UP : SHM_KIND_GATE, e, NULL,
                                 NULL);
            r->up = fused ? NULL : shm_expert(fx->shm, l, SHM_KIND_UP, e, NULL, NULL);
            r->down = shm_expert(fx->shm, l, SHM_KIND_DOWN, e, NULL, NULL);
        }
    }
    struct expert_pool_config pc = {.model = fx->m,
                                    .refs = (const struct expert_ref *const *)fx->refs,
                                    .n_threads = 1, .max_rows = MAX_BATCH * hp->n_expert_used};
    fx->pool = expert_pool_create(&pc);
    fx->h = malloc((size_t)MAX_BATCH * hp->n_embd * sizeof(float));
    if (!fx->pool || !fx->h)
        return -ENOMEM;
    uint64_t s = 5;
    for (size_t i = 0; i < (size_t)MAX_BATCH * hp->n_embd; i++)
        fx->h[i] = (float)((rng_next(&s) >> 11) * 0x1p-53 * 2.0 - 1.0);
    return 0;
}

/* Frees the pool, the refs and the segment (unlinked). */
static void fixture_release_shm(struct fixture *fx)
{
    expert_pool_destroy(fx->pool);
    fx->pool = NULL;
    for (uint32_t l = 0; fx->refs && l < fx->m->hp.n_layer; l++)
        free(fx->refs[l]);
    free(fx->refs);
    fx->refs = NULL;
    shm_destroy(fx->shm);
    fx->shm = NULL;
}

static void fixture_destroy(struct fixture *fx)
{
    fixture_release_shm(fx);
    arch_free(fx->m);
    gguf_close(fx->g);
    free(fx->h);
    unlink(fx->path);
}

static bool all_finite(const float *x, size_t n)
{
    for (size_t i = 0; i < n; i++)
        if (!isfinite(x[i]))
            return false;
    return true;
}

/* ---- part A: this process as the coordinator of one real worker ---- */

struct fake {
    const struct fixture *fx;
    const char *bin;
    void *zctx;
    struct wire_socket *router;
    void *zr; /* its ZeroMQ socket, for raw frames */
    char rundir[WIRE_PATH_MAX];
    char ep[WIRE_PATH_MAX + 16];
    char log[128];
    pid_t pid;
    uint64_t step;       /* step numbers sent */
    struct gen gen;
    struct oracle oracle;
    struct tally tally;
    float *logits;       /* MAX_BATCH x n_vocab */
    uint64_t requests, replies, timings, heartbeats, steps_ok;
    bool noise;          /* send stale replies and mutations while the worker waits */
};

static int fake_create(struct fake *f, const struct fixture *fx, const char *bin, const char *tag)
{
    memset(f, 0, sizeof(*f));
    f->fx = fx;
    f->bin = bin;
    snprintf(f->log, sizeof(f->log), "/tmp/test-frames-%d-%s.log", (int)getpid(), tag);
    unlink(f->log);
    f->zctx = zmq_ctx_new();
    f->logits = malloc((size_t)MAX_BATCH * fx->m->hp.n_vocab * sizeof(float));
    if (!f->zctx || !f->logits || gen_init(&f->gen, 0x5eed, &fx->m->hp) ||
        oracle_create(&f->oracle, f->zctx, tag))
        return -ENOMEM;
    if (wire_rundir_create(NULL, f->rundir, sizeof(f->rundir)) ||
        wire_endpoint_ipc(f->ep, sizeof(f->ep), f->rundir, "coord"))
        return -EIO;
    f->router = wire_socket_create(f->zctx, ZMQ_ROUTER, NULL);
    if (!f->router || wire_socket_bind(f->router, f->ep))
        return -EIO;
    f->zr = wire_socket_zmq(f->router);
    return 0;
}

static void fake_destroy(struct fake *f)
{
    if (f->pid > 0) {
        kill(f->pid, SIGKILL);
        waitpid(f->pid, NULL, 0);
    }
    oracle_destroy(&f->oracle);
    wire_socket_destroy(f->router);
    if (f->zctx)
        zmq_ctx_term(f->zctx);
    if (f->rundir[0])
        wire_rundir_remove(f->rundir);
    gen_free(&f->gen);
    free(f->logits);
}

/* The environment of a worker: ours with LAMINA_LOG=warn (the reject warnings are counted)
 * and without LAMINA_FAIL. Built before fork: the child only calls async-signal-safe
 * functions. Returns a malloc'd array (the strings are borrowed), or NULL. */
static char **worker_env(void)
{
    extern char **environ;
    size_t n = 0;
    while (environ[n])
        n++;
    char **env = calloc(n + 2, sizeof(*env));
    if (!env)
        return NULL;
    size_t k = 0;
    static char level[] = "LAMINA_LOG=warn";
    env[k++] = level;
    for (size_t i = 0; i < n; i++)
        if (strncmp(environ[i], "LAMINA_LOG=", 11) && strncmp(environ[i], "LAMINA_FAIL=", 12))
            env[k++] = environ[i];
    return env;
}

static int fake_spawn(struct fake *f)
{
    char **env = worker_env();
    int fd = open(f->log, O_WRONLY | O_CREAT | O_APPEND | O_CLOEXEC, 0600);
    if (!env || fd < 0) {
        free(env);
        if (fd >= 0)
            close(fd);
        return -EIO;
    }
    char *argv[] = {(char *)f->bin, "--connect", f->ep, "--index", "0", NULL};
    fflush(NULL);
    pid_t pid = fork();
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        dup2(fd, 1);
        dup2(fd, 2);
        execve(f->bin, argv, env);
        static const char msg[] = "test_frames: cannot exec the worker\n";
        ssize_t w = write(2, msg, sizeof(msg) - 1);
        (void)w;
        _exit(127);
    }
    int e = errno;
    close(fd);
    free(env);
    if (pid < 0)
        return -e;
    f->pid = pid;
    return 0;
}

/* Next message from the worker's main socket; heartbeats of its watchdog are counted. */
static int fake_recv(struct fake *f, struct wire_msg *m, int timeout_ms)
{
    double end = now_s() + timeout_ms / 1000.0;
    for (;;) {
        int left = (int)((end - now_s()) * 1000);
        if (left < 0)
            return -ETIMEDOUT;
        char id[WIRE_ID_MAX];
        size_t id_len = sizeof(id);
        int rc = wire_recv(f->router, m, id, &id_len, left < 200 ? left : 200);
        if (rc == -ETIMEDOUT) {
            int st;
            if (f->pid > 0 && waitpid(f->pid, &st, WNOHANG) == f->pid) {
                f->pid = 0;
                fprintf(stderr, "worker exited (status 0x%x) while we waited\n", st);
                return -ECONNRESET;
            }
            continue;
        }
        if (rc)
            return rc;
        if (id_len == 2 && !memcmp(id, "w0", 2))
            return 0;
        if (id_len == 2 && !memcmp(id, "h0", 2) && m->type == WIRE_TYPE_HEARTBEAT)
            f->heartbeats++;
        else
            fprintf(stderr, "unexpected %s from a peer of %zu-byte id\n",
                    wire_msg_type_name(m->type), id_len);
        wire_msg_free(m);
    }
}

static int fake_send(struct fake *f, struct wire_msg *m)
{
    m->seq_no = ++f->step;
    return wire_send(f->router, m, "w0", 2);
}

/* Sends mutations to the worker; target says what it is doing. */
static int fake_mutate(struct fake *f, int n, enum target t)
{
    for (int i = 0; i < n; i++) {
        int rc = gen_next(&f->gen, &f->oracle, t, &f->tally);
        rc = rc ? rc : frames_send(f->zr, "w0", 2, &f->gen.fr);
        if (rc)
            return rc;
    }
    return 0;
}

/* Residency: expert e of layer l is resident when (e + l) is even. */
static int fake_plan(struct fake *f)
{
    const struct arch_hparams *hp = &f->fx->m->hp;
    struct wire_layer_residency res[64];
    uint8_t bits[64][WIRE_BITMAP_MAX];
    for (uint32_t l = 0; l < hp->n_layer; l++) {
        memset(bits[l], 0, sizeof(bits[l]));
        for (uint32_t e = 0; e < hp->n_expert; e++)
            if ((e + l) % 2 == 0)
                bits[l][e / 8] |= (uint8_t)(1u << (e % 8));
        res[l] = (struct wire_layer_residency){.layer = l, .bitmap = bits[l],
                                               .bitmap_bytes = (hp->n_expert + 7) / 8};
    }
    struct wire_msg m = {.type = WIRE_TYPE_LOAD_PLAN};
    m.load_plan = (struct wire_load_plan){
        .model_path = f->fx->path, .shm_name = shm_name(f->fx->shm),
        .shm_bytes = shm_bytes(f->fx->shm), .layer_begin = 0, .layer_end = hp->n_layer,
        .n_layers_total = hp->n_layer, .residency = res, .n_residency = hp->n_layer,
        .backend = "cpu", .n_ctx = N_CTX, .max_batch = MAX_BATCH, .n_threads = 1,
        .next_endpoint = "", .listen_endpoint = "", .is_last = true, .n_embd = hp->n_embd,
        .n_vocab = hp->n_vocab};
    return fake_send(f, &m);
}

/* Starts a worker: hello (after some rejected noise), plan, ready. */
static int fake_start(struct fake *f)
{
    int rc = fake_spawn(f);
    struct wire_msg m;
    rc = rc ? rc : fake_recv(f, &m, START_TIMEOUT_MS);
    if (rc)
        return rc;
    bool hello = m.type == WIRE_TYPE_HELLO && m.hello.worker_index == 0;
    CHECK(hello, "first message: %s", wire_msg_type_name(m.type));
    wire_msg_free(&m);
    /* Malformed messages before the plan are dropped by its hello loop. */
    for (int i = 0; i < 20 && !rc; i++) {
        struct verdict v;
        do {
            gen_mutation(&f->gen, MUT_RANDOM);
            rc = oracle_judge(&f->oracle, &f->gen.fr, &v);
        } while (!rc && v.accepted);
        tally_add(&f->tally, &v, MUT_RANDOM);
        rc = rc ? rc : frames_send(f->zr, "w0", 2, &f->gen.fr);
    }
    rc = rc ? rc : fake_plan(f);
    rc = rc ? rc : fake_recv(f, &m, START_TIMEOUT_MS);
    if (rc)
        return rc;
    const struct arch_hparams *hp = &f->fx->m->hp;
    bool ready = m.type == WIRE_TYPE_READY &&
                 m.ready.resident_experts == hp->n_layer * hp->n_expert / 2;
    CHECK(ready, "after the plan: %s (%u experts resident, want %u)",
          wire_msg_type_name(m.type), m.ready.resident_experts, hp->n_layer * hp->n_expert / 2);
    wire_msg_free(&m);
    return hello && ready ? 0 : -EPROTO;
}

/* Stale replies for the request in flight, which the worker must drop. */
static int fake_collect_noise(struct fake *f, uint64_t step, uint32_t layer, uint32_t rows)
{
    struct gen *g = &f->gen;
    const uint32_t E = g->n_embd;
    for (int k = 0; k < 4; k++) {
        uint32_t w = E, r = rows, l = layer;
        uint64_t s = step;
        if (k == 0)
            s = step + 1;
        else if (k == 1)
            l = layer + 1;
        else if (k == 2)
            r = rows + 1;
        else
            w = E + 1;
        if ((uint64_t)r * w * 4 > TENSOR_CAP)
            continue;
        enc_reply(&g->pl, s, l, r, w);
        gen_envelope(g, WIRE_VERSION, WIRE_TYPE_EXPERT_REPLY, (uint64_t)r * w * 4);
        gen_frames(g, true, (size_t)r * w * 4);
        struct verdict v;
        int rc = oracle_judge(&f->oracle, &g->fr, &v);
        if (rc)
            return rc;
        tally_add(&f->tally, &v, MUT_COLLECT);
        rc = frames_send(f->zr, "w0", 2, &g->fr);
        if (rc)
            return rc;
    }
    return fake_mutate(f, 2, TARGET_WORKER_COLLECT);
}

static int fake_expert_request(struct fake *f, const struct wire_msg *m)
{
    const struct wire_expert_request *r = &m->expert_request;
    const struct arch_hparams *hp = &f->fx->m->hp;
    uint32_t rows = (uint32_t)(m->tensor_bytes / (hp->n_embd * sizeof(float)));
    f->requests++;
    if (r->step != f->step || r->layer >= hp->n_layer || r->n_embd != hp->n_embd) {
        CHECK(0, "expert request for step %llu layer %u width %u (step %llu in flight)",
              (unsigned long long)r->step, r->layer, r->n_embd, (unsigned long long)f->step);
        return -EPROTO;
    }
    for (size_t i = 0; i < r->n_experts; i++) /* only experts it does not hold */
        CHECK((r->experts[i] + r->layer) % 2 == 1, "request for resident expert %u of layer %u",
              r->experts[i], r->layer);
    static float y[MAX_BATCH * 8 * 4096];
    if ((size_t)rows * hp->n_embd > sizeof(y) / sizeof(y[0]))
        return -E2BIG;
    int rc = f->noise ? fake_collect_noise(f, r->step, r->layer, rows) : 0;
    rc = rc ? rc : expert_pool_run(f->fx->pool, r->layer, r->experts, r->counts,
                                   (uint32_t)r->n_experts, m->tensor, y);
    if (rc)
        return rc;
    struct wire_msg o = {.type = WIRE_TYPE_EXPERT_REPLY};
    o.expert_reply = (struct wire_expert_reply){.step = r->step, .layer = r->layer,
                                                .n_rows = rows, .n_embd = hp->n_embd};
    o.tensor = y;
    o.tensor_bytes = m->tensor_bytes;
    f->replies++;
    return wire_send(f->router, &o, "w0", 2);
}

/* Checks a RESULT of the step in flight; 1 when it is, 0 to keep waiting. */
static int fake_result(struct fake *f, const struct wire_msg *m, uint32_t rows)
{
    const uint32_t V = f->fx->m->hp.n_vocab;
    if (m->result.step != f->step) {
        CHECK(0, "result of step %llu while %llu is in flight", (unsigned long long)m->result.step,
              (unsigned long long)f->step);
        return 0;
    }
    bool ok = m->result.n_rows == rows && m->result.n_vocab == V &&
              m->tensor_bytes == (size_t)rows * V * sizeof(float);
    CHECK(ok, "result of step %llu: %u rows of %u, %zu bytes (want %u rows of %u)",
          (unsigned long long)f->step, m->result.n_rows, m->result.n_vocab, m->tensor_bytes,
          rows, V);
    if (!ok)
        return -EPROTO;
    memcpy(f->logits, m->tensor, m->tensor_bytes);
    CHECK(all_finite(f->logits, (size_t)rows * V), "step %llu: logits not finite",
          (unsigned long long)f->step);
    return 1;
}

/* One valid step; the logits land in f->logits. Returns 0, or -errno (logged by CHECK). */
static int fake_step(struct fake *f, uint32_t pos, uint32_t n, bool all)
{
    const struct arch_hparams *hp = &f->fx->m->hp;
    struct wire_msg m = {.type = WIRE_TYPE_STEP};
    m.step = (struct wire_step){.pos = pos, .n_tokens = n, .all_logits = all,
                                .n_embd = hp->n_embd};
    m.tensor = f->fx->h + (size_t)pos * hp->n_embd;
    m.tensor_bytes = (size_t)n * hp->n_embd * sizeof(float);
    m.step.step = f->step + 1; /* fake_send numbers it */
    int rc = fake_send(f, &m);
    const uint32_t rows = all ? n : 1;
    while (!rc) {
        struct wire_msg r;
        rc = fake_recv(f, &r, STEP_TIMEOUT_MS);
        if (rc)
            break;
        if (r.type == WIRE_TYPE_EXPERT_REQUEST)
            rc = fake_expert_request(f, &r);
        else if (r.type == WIRE_TYPE_TIMING)
            f->timings++;
        else if (r.type == WIRE_TYPE_RESULT)
            rc = fake_result(f, &r, rows);
        else if (r.type == WIRE_TYPE_ERROR) {
            CHECK(0, "worker failed step %llu: %s", (unsigned long long)f->step,
                  r.error.message);
            rc = -EIO;
        } else
            CHECK(0, "unexpected %s from the worker", wire_msg_type_name(r.type));
        wire_msg_free(&r);
    }
    if (rc == 1)
        f->steps_ok++;
    CHECK(rc == 1, "step %llu (pos %u, %u tokens): rc %d", (unsigned long long)f->step, pos, n,
          rc);
    return rc == 1 ? 0 : rc;
}

static int fake_reset(struct fake *f)
{
    struct wire_msg m = {.type = WIRE_TYPE_RESET};
    return fake_send(f, &m);
}

/* A probe: RESET, a prefill of PREFILL tokens at 0, between mutations, then one token at
 * PREFILL; both must equal ref_a / ref_b (or fill them when NULL is not given: first call). */
struct probe_refs {
    float *a, *b;
    bool have;
    int mismatches;
};

static int fake_probe_half(struct fake *f, struct probe_refs *pr, bool first)
{
    const uint32_t V = f->fx->m->hp.n_vocab;
    const size_t na = (size_t)PREFILL * V, nb = V;
    int rc = first ? fake_reset(f) : 0;
    rc = rc ? rc : first ? fake_step(f, 0, PREFILL, true) : fake_step(f, PREFILL, 1, false);
    if (rc)
        return rc;
    float *ref = first ? pr->a : pr->b;
    size_t n = first ? na : nb;
    if (!pr->have)
        memcpy(ref, f->logits, n * sizeof(float));
    else if (memcmp(ref, f->logits, n * sizeof(float)) != 0)
        pr->mismatches++;
    return 0;
}

/* After an oversized frame: waits for "w0" to go away (a raw send to it fails) and to come
 * back. Returns 0 when it came back, -ENOTCONN when it went away and stayed away for 2 s, 1
 * when it never went away. */
static int fake_until_reconnected(struct fake *f)
{
    gen_valid(&f->gen, WIRE_TYPE_HEARTBEAT);
    bool away = false;
    double end = now_s() + 2;
    while (now_s() < end) {
        int rc = frames_send(f->zr, "w0", 2, &f->gen.fr);
        if (rc == -EHOSTUNREACH && !away)
            away = true, end = now_s() + 2;
        else if (rc == 0 && away)
            return 0;
        sleep_ms(2);
    }
    return away ? -ENOTCONN : 1;
}

static void part_a_main(struct fake *f, struct probe_refs *pr)
{
    f->noise = false;
    int rc = fake_probe_half(f, pr, true);
    rc = rc ? rc : fake_probe_half(f, pr, false);
    pr->have = rc == 0;
    CHECK(rc == 0, "clean reference steps: rc %d", rc);
    f->noise = true;
    double t0 = now_s();
    uint64_t probes = 0;
    while (!rc && f->tally.sent < N_WORKER_MUT) {
        rc = fake_probe_half(f, pr, true);
        int n = (int)(N_WORKER_MUT - f->tally.sent);
        rc = rc ? rc : fake_mutate(f, n < PROBE_EVERY ? n : PROBE_EVERY, TARGET_WORKER_IDLE);
        rc = rc ? rc : fake_probe_half(f, pr, false);
        n = (int)(N_WORKER_MUT - f->tally.sent);
        if (n > 0 && !rc)
            rc = fake_mutate(f, n < PROBE_EVERY ? n : PROBE_EVERY, TARGET_WORKER_IDLE);
        probes++;
    }
    CHECK(rc == 0 && f->tally.sent >= N_WORKER_MUT, "worker mutations stopped at %llu: rc %d",
          (unsigned long long)f->tally.sent, rc);
    CHECK(pr->mismatches == 0, "%d probe steps differ from the clean run", pr->mismatches);
    MEASURE("worker: %llu mutations and %llu probe pairs in %.2f s; %llu valid steps answered "
            "(%d differ from the clean run), %llu expert requests answered",
            (unsigned long long)f->tally.sent, (unsigned long long)probes, now_s() - t0,
            (unsigned long long)f->steps_ok, pr->mismatches, (unsigned long long)f->requests);
}

/* The worker's own log: one warning per reject reason, no sanitizer report. */
static void part_a_log(const struct fake *f)
{
    int want = 0, bad = 0;
    for (int k = 0; k < WIRE_REJECT_COUNT; k++) {
        char what[96];
        snprintf(what, sizeof(what), "dropped a malformed message from '' (%s,",
                 wire_reject_name((enum wire_reject)k));
        int n = count_lines(f->log, what);
        want += f->tally.by_reason[k] > 0;
        if (n == (f->tally.by_reason[k] > 0))
            continue;
        bad++;
        CHECK(0, "worker log: %d warnings for reason %s, %llu rejects sent", n,
              wire_reject_name((enum wire_reject)k), (unsigned long long)f->tally.by_reason[k]);
    }
    int warned = count_lines(f->log, "dropped a malformed message");
    CHECK(warned == want, "worker log: %d reject warnings, want %d (one per reason)", warned,
          want);
    int san = sanitizer_reports(f->log);
    CHECK(san == 0, "worker log has %d sanitizer lines", san);
    if (san || bad)
        print_lines(f->log, NULL, 60);
    MEASURE("worker log: %d reject warnings for %d reasons seen, %d sanitizer lines, %d "
            "\"ignoring an unexpected\" lines for valid out-of-place messages", warned, want,
            san, count_lines(f->log, "ignoring an unexpected"));
}

static void part_a_shutdown(struct fake *f)
{
    struct wire_msg m = {.type = WIRE_TYPE_SHUTDOWN};
    int rc = fake_send(f, &m), st = 0;
    bool exited = rc == 0 && f->pid > 0 && wait_exit(f->pid, &st, 20000);
    if (exited)
        f->pid = 0;
    CHECK(exited && WIFEXITED(st) && WEXITSTATUS(st) == 0,
          "worker after SHUTDOWN: exited %d, status 0x%x", exited, st);
    MEASURE("worker: exit after SHUTDOWN: %s %d", !exited ? "still running"
            : WIFEXITED(st) ? "status" : "signal", WIFEXITED(st) ? WEXITSTATUS(st)
            : WTERMSIG(st));
}

/* A STEP that wire accepts and the worker must refuse, to a fresh worker. */
static void part_a_bad_step(struct fake *f, int kind, int *exits, int *survivals,
                            int *step_named)
{
    static const char *const what[] = {"width + 1", "max_batch + 1 tokens", "pos + n > n_ctx",
                                       "pos 2^32 - 1"};
    const struct arch_hparams *hp = &f->fx->m->hp;
    int rc = fake_start(f);
    CHECK(rc == 0, "bad step %s: worker did not start: %d", what[kind], rc);
    if (rc)
        return;
    static float h[(MAX_BATCH + 1) * 4096];
    struct wire_msg m = {.type = WIRE_TYPE_STEP};
    m.step = (struct wire_step){.pos = 0, .n_tokens = 1, .step = f->step + 1,
                                .n_embd = hp->n_embd};
    if (kind == 0)
        m.step.n_embd = hp->n_embd + 1;
    else if (kind == 1)
        m.step.n_tokens = MAX_BATCH + 1;
    else if (kind == 2)
        m.step.pos = N_CTX - 1, m.step.n_tokens = 2;
    else
        m.step.pos = 0xffffffffu;
    m.tensor = h;
    m.tensor_bytes = (size_t)m.step.n_tokens * m.step.n_embd * sizeof(float);
    rc = fake_send(f, &m);
    struct wire_msg r;
    rc = rc ? rc : fake_recv(f, &r, 10000);
    char named[48];
    snprintf(named, sizeof(named), "step %llu ", (unsigned long long)f->step);
    bool error = rc == 0 && r.type == WIRE_TYPE_ERROR && strstr(r.error.message, named);
    CHECK(error, "bad step %s: rc %d, reply %s (%s)", what[kind], rc,
          rc ? "none" : wire_msg_type_name(r.type), error ? "" : r.error.message);
    if (error && r.error.step == f->step)
        (*step_named)++;
    if (rc == 0)
        wire_msg_free(&r);
    int st = 0;
    if (f->pid > 0 && wait_exit(f->pid, &st, 3000)) {
        f->pid = 0;
        CHECK(WIFEXITED(st) && WEXITSTATUS(st) == 1, "bad step %s: exit status 0x%x", what[kind],
              st);
        (*exits)++;
        return;
    }
    rc = fake_reset(f); /* still serving? */
    rc = rc ? rc : fake_step(f, 0, 1, false);
    CHECK(rc == 0, "bad step %s: worker neither exited nor served", what[kind]);
    part_a_shutdown(f);
    (*survivals)++;
}

/*
 * Frames over ZMQ_MAXMSGSIZE to a fresh worker. ZeroMQ drops the connection before the frame
 * reaches the worker's code. What follows depends on libzmq: with 4.3 the connecting side
 * treats the oversized frame as a protocol error and does not reconnect, so the worker is cut
 * off from its coordinator (its watchdog socket still sends heartbeats). What is right, and
 * asserted: no crash; either the worker comes back and serves (then SHUTDOWN: status 0), or it
 * notices the silence and exits by itself with status 1 within its idle timeout (15 s). The
 * wait overlaps part B: oversize_start() before it, oversize_finish() after.
 */
struct oversize {
    struct fake f;
    bool ok;          /* the worker started */
    int sent, drops, returns;
    double t_cut;     /* when it was cut off */
};

static void oversize_start(struct oversize *o, const struct fixture *fx, const char *bin)
{
    memset(o, 0, sizeof(*o));
    int rc = fake_create(&o->f, fx, bin, "oversize");
    rc = rc ? rc : fake_start(&o->f);
    CHECK(rc == 0, "oversize: worker did not start: %d", rc);
    o->ok = rc == 0;
    for (int i = 0; i < N_OVERSIZE_WORKER && !rc; i++) {
        rc = send_oversize(o->f.zr, "w0", 2);
        CHECK(rc == 0, "oversized frame %d not sent: %d", i, rc);
        o->sent += rc == 0;
        int back = rc ? rc : fake_until_reconnected(&o->f);
        o->drops += back <= 0;
        o->returns += back == 0;
        if (back < 0) {
            o->t_cut = now_s();
            break;
        }
    }
}

static void oversize_finish(struct oversize *o)
{
    struct fake *f = &o->f;
    int st = 0;
    const char *outcome = "not started";
    if (o->ok && o->t_cut == 0) { /* it kept or got back its connection: still serving? */
        int rc = fake_reset(f);
        rc = rc ? rc : fake_step(f, 0, PREFILL, true);
        CHECK(rc == 0, "after %d oversized frames the connected worker does not serve", o->sent);
        part_a_shutdown(f);
        outcome = "served again, then exited 0 on SHUTDOWN";
    } else if (o->ok) {
        bool exited = f->pid > 0 && wait_exit(f->pid, &st, 25000);
        if (exited)
            f->pid = 0;
        bool clean = exited && WIFEXITED(st) && WEXITSTATUS(st) == 1;
        CHECK(clean, "worker cut off by an oversized frame: exited %d, status 0x%x", exited, st);
        int said = count_lines(f->log, "no word from the coordinator");
        CHECK(said == 1, "worker cut off: %d \"no word from the coordinator\" lines", said);
        outcome = clean ? "cut off, exited by itself with status 1" : "did not exit cleanly";
    }
    int san = sanitizer_reports(f->log);
    CHECK(san == 0, "oversize worker log has %d sanitizer lines", san);
    if (san)
        print_lines(f->log, NULL, 60);
    MEASURE("worker: %d oversized frames (%lld bytes) sent, connection dropped %d times, back %d "
            "times; worker %s (%.1f s after the cut)", o->sent,
            (long long)WIRE_MSG_MAX_DEFAULT + 1, o->drops, o->returns, outcome,
            o->t_cut > 0 ? now_s() - o->t_cut : 0.0);
    fake_destroy(f);
    if (!check_failures)
        logs_remove(f->log);
}

static void part_a(const struct fixture *fx, const char *bin, float *ref_prefill)
{
    struct fake f;
    const uint32_t V = fx->m->hp.n_vocab;
    struct probe_refs pr = {.a = malloc((size_t)PREFILL * V * sizeof(float)),
                            .b = malloc(V * sizeof(float))};
    int rc = pr.a && pr.b ? fake_create(&f, fx, bin, "worker") : -ENOMEM;
    CHECK(rc == 0, "part A setup: %d", rc);
    rc = rc ? rc : fake_start(&f);
    CHECK(rc == 0, "worker %s did not start: %d (log %s)", bin, rc, f.log);
    if (rc == 0) {
        part_a_main(&f, &pr);
        memcpy(ref_prefill, pr.a, (size_t)PREFILL * V * sizeof(float));
        tally_measure("worker", &f.tally);
        part_a_shutdown(&f);
        MEASURE("worker: %llu steps answered, %llu expert requests answered, %llu timings, %llu "
                "heartbeats", (unsigned long long)f.steps_ok, (unsigned long long)f.requests,
                (unsigned long long)f.timings, (unsigned long long)f.heartbeats);
        CHECK(f.requests > 0, "no expert request came: the request path was not exercised");
        part_a_log(&f);
        int exits = 0, survivals = 0, named = 0;
        for (int kind = 0; kind < 4; kind++)
            part_a_bad_step(&f, kind, &exits, &survivals, &named);
        MEASURE("worker: 4 steps it must refuse (width, batch, context, position): an ERROR "
                "naming the step in its text each; %d exits with status 1, %d kept serving; "
                "Error.step = the refused step in %d of 4", exits, survivals, named);
        CHECK(sanitizer_reports(f.log) == 0, "sanitizer report in %s", f.log);
    }
    fake_destroy(&f);
    if (!check_failures)
        logs_remove(f.log);
    free(pr.a);
    free(pr.b);
}

/* ---- part B: the coordinator ---- */

#define SEQ_STEPS 4
static const uint32_t seq_pos[SEQ_STEPS] = {0, PREFILL, PREFILL + 1, PREFILL + 2};
static const uint32_t seq_n[SEQ_STEPS] = {PREFILL, 1, 1, 2};
static const bool seq_all[SEQ_STEPS] = {true, false, false, true};

struct coord {
    const struct fixture *fx;
    struct cluster *c;
    char ep[WIRE_PATH_MAX + 16];
    float *ref[SEQ_STEPS], *out;
    uint64_t steps;     /* cluster_step calls */
    uint64_t sequences, mismatches, failures;
    struct tally tally; /* all mutations sent to the coordinator */
    const char *exclude; /* a runtime directory of this pid that is not the cluster's */
};

static size_t seq_floats(const struct coord *k, int s)
{
    return (size_t)(seq_all[s] ? seq_n[s] : 1) * k->fx->m->hp.n_vocab;
}

/* Runs the sequence; compares with the reference, or makes it when ref is not yet set. */
static int coord_sequence(struct coord *k, bool make_ref)
{
    int rc = 0;
    for (double end = now_s() + 3; now_s() < end;) { /* ids may be away after a handover */
        rc = cluster_reset(k->c);
        if (rc != -EHOSTUNREACH)
            break;
        sleep_ms(10);
    }
    const uint32_t E = k->fx->m->hp.n_embd;
    for (int s = 0; s < SEQ_STEPS && !rc; s++) {
        k->steps++;
        rc = cluster_step(k->c, k->fx->h + (size_t)seq_pos[s] * E, seq_n[s], seq_pos[s],
                          seq_all[s], k->out);
        if (rc)
            break;
        size_t n = seq_floats(k, s);
        if (make_ref)
            memcpy(k->ref[s], k->out, n * sizeof(float));
        else if (memcmp(k->ref[s], k->out, n * sizeof(float)) != 0)
            k->mismatches++;
    }
    k->sequences++;
    k->failures += rc != 0;
    return rc;
}

static int coord_find_endpoint(struct coord *k)
{
    const char *xdg = getenv("XDG_RUNTIME_DIR");
    const char *bases[2] = {xdg && xdg[0] == '/' ? xdg : "/tmp", "/tmp"};
    for (int b = 0; b < 2; b++) {
        char pat[WIRE_PATH_MAX + 64];
        snprintf(pat, sizeof(pat), "%s/lamina-%d-*/coord.sock", bases[b], (int)getpid());
        glob_t gl;
        int found = 0;
        if (glob(pat, 0, NULL, &gl) == 0)
            for (size_t i = 0; i < gl.gl_pathc; i++)
                if (!k->exclude || strncmp(gl.gl_pathv[i], k->exclude, strlen(k->exclude)))
                    found++, snprintf(k->ep, sizeof(k->ep), "ipc://%s", gl.gl_pathv[i]);
        globfree(&gl);
        if (found == 1)
            return 0;
    }
    return -ENOENT;
}

static int coord_create(struct coord *k, const struct fixture *fx, const char *bin,
                        const char *exclude)
{
    memset(k, 0, sizeof(*k));
    k->fx = fx;
    k->exclude = exclude;
    struct cluster_config cc = {.model_path = fx->path, .gguf = fx->g, .model = fx->m,
                                .n_workers = 2, .backends = {"cpu", "cpu"}, .layers = "auto",
                                .resident = "50%", .n_ctx = N_CTX, .max_batch = MAX_BATCH,
                                .worker_threads = 1, .pool_threads = 1, .spawn = true,
                                .worker_bin = bin, .hang_timeout_s = 30};
    k->c = cluster_create(&cc);
    if (!k->c)
        return -EIO;
    for (int s = 0; s < SEQ_STEPS; s++)
        if (!(k->ref[s] = malloc(seq_floats(k, s) * sizeof(float))))
            return -ENOMEM;
    k->out = malloc((size_t)MAX_BATCH * fx->m->hp.n_vocab * sizeof(float));
    if (!k->out)
        return -ENOMEM;
    return coord_find_endpoint(k);
}

static void coord_destroy(struct coord *k)
{
    cluster_destroy(k->c);
    k->c = NULL;
    for (int s = 0; s < SEQ_STEPS; s++)
        free(k->ref[s]);
    free(k->out);
}

/* A DEALER of this process to the coordinator, with routing id id (NULL: ZeroMQ's). */
static void *dealer_open(void *zctx, const char *ep, const void *id, size_t id_len, int linger)
{
    void *z = zmq_socket(zctx, ZMQ_DEALER);
    int timeout = 10000;
    if (!z || zmq_setsockopt(z, ZMQ_LINGER, &linger, sizeof(linger)) ||
        zmq_setsockopt(z, ZMQ_SNDTIMEO, &timeout, sizeof(timeout)) ||
        (id && zmq_setsockopt(z, ZMQ_ROUTING_ID, id, id_len)) || zmq_connect(z, ep)) {
        if (z)
            zmq_close(z);
        return NULL;
    }
    return z;
}

/* Raw bytes on the unix socket: not ZMTP, or a ZMTP greeting followed by junk. */
static int raw_junk(const char *ep, uint64_t *rng)
{
    struct sockaddr_un sa = {.sun_family = AF_UNIX};
    snprintf(sa.sun_path, sizeof(sa.sun_path), "%s", ep + strlen("ipc://"));
    int fd = socket(AF_UNIX, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -errno;
    if (connect(fd, (struct sockaddr *)&sa, sizeof(sa)) < 0) {
        int e = errno;
        close(fd);
        return -e;
    }
    uint8_t buf[2048];
    size_t n = 1 + rng_below(rng, sizeof(buf));
    for (size_t i = 0; i < n; i++)
        buf[i] = (uint8_t)rng_next(rng);
    if (rng_below(rng, 2)) { /* signature, version 3, then junk */
        static const uint8_t sig[11] = {0xff, 0, 0, 0, 0, 0, 0, 0, 1, 0x7f, 3};
        memcpy(buf, sig, n < sizeof(sig) ? n : sizeof(sig));
    }
    ssize_t w = send(fd, buf, n, MSG_NOSIGNAL);
    close(fd);
    return w < 0 ? -errno : 0;
}

#define N_STRANGERS 11
#define N_ALIASES 2 /* the last two of stranger_ids */
static const struct {
    const char *id;
    size_t len;
} stranger_ids[N_STRANGERS] = {
    {"stranger", 8}, {NULL, 0}, {"w", 1}, {"wx", 2}, {"w99", 3}, {"h-1", 3}, {"W0", 2},
    {"w0\x01", 3}, {"\xff\xfe", 2}, {"w00", 3}, {"h01", 3}};

struct stranger_job {
    const struct fixture *fx;
    const char *ep;
    struct tally tally;
    int junk_sent, errors;
    atomic_int done_flag;
};

static void *stranger_thread(void *arg)
{
    struct stranger_job *j = arg;
    void *zctx = zmq_ctx_new();
    struct gen g;
    struct oracle o = {0};
    void *z[N_STRANGERS] = {0};
    int rc = zctx && gen_init(&g, 0xb1, &j->fx->m->hp) == 0 ? 0 : -ENOMEM;
    rc = rc ? rc : oracle_create(&o, zctx, "oracle-b1");
    for (int i = 0; i < N_STRANGERS && !rc; i++)
        if (!(z[i] = dealer_open(zctx, j->ep, stranger_ids[i].id, stranger_ids[i].len, 10000)))
            rc = -EIO;
    for (int i = 0; i < N_RAW_JUNK && !rc; i++)
        j->junk_sent += raw_junk(j->ep, &g.rng) == 0;
    for (int i = 0; i < N_STRANGER_MUT && !rc; i++) {
        int s = i % N_STRANGERS;
        enum target t = s >= N_STRANGERS - N_ALIASES ? TARGET_COORD_SPOOF : TARGET_COORD_STRANGER;
        rc = gen_next(&g, &o, t, &j->tally);
        rc = rc ? rc : frames_send(z[s], NULL, 0, &g.fr);
    }
    for (int i = 0; i < N_STRANGERS && !rc; i++) { /* the end marker of each socket */
        gen_valid(&g, WIRE_TYPE_SHUTDOWN);
        rc = frames_send(z[i], NULL, 0, &g.fr);
    }
    j->errors = rc != 0;
    for (int i = 0; i < N_STRANGERS; i++)
        if (z[i])
            zmq_close(z[i]);
    oracle_destroy(&o);
    atomic_store(&j->done_flag, 1);
    if (zctx)
        zmq_ctx_term(zctx); /* waits until the coordinator has read what is queued */
    gen_free(&g);
    return NULL;
}

/* B1: strangers and aliases while the sequence runs; the markers prove all was read. */
static void part_b1(struct coord *k, const char *log)
{
    struct stranger_job j = {.fx = k->fx, .ep = k->ep};
    atomic_init(&j.done_flag, 0);
    pthread_t th;
    CHECK(pthread_create(&th, NULL, stranger_thread, &j) == 0, "stranger thread");
    /* look-alike ids (w00, h01) are not workers: the coordinator treats them as strangers */
    const int want_unknown = N_STRANGERS;
    double t0 = now_s(), end = t0 + 60;
    int unknown = 0, alias = 0;
    uint64_t seq0 = k->sequences;
    while (now_s() < end) {
        if (coord_sequence(k, false))
            break;
        unknown = count_lines(log, "dropping a shutdown message from an unknown peer");
        alias = count_lines(log, "dropping an unexpected shutdown message from worker");
        if (atomic_load(&j.done_flag) && unknown >= want_unknown)
            break;
    }
    pthread_join(th, NULL);
    CHECK(!j.errors, "stranger thread failed");
    CHECK(unknown == want_unknown && alias == 0,
          "end markers read: %d of %d as from unknown peers, %d taken for a worker's (want 0)",
          unknown, want_unknown, alias);
    CHECK(k->failures == 0 && k->mismatches == 0, "B1: %llu failed sequences, %llu mismatched "
          "steps", (unsigned long long)k->failures, (unsigned long long)k->mismatches);
    tally_measure("coordinator, strangers", &j.tally);
    MEASURE("coordinator, strangers: %d sockets (%d with worker-like ids w00/h01), %d raw junk "
            "connections; %llu sequences of %d steps during the traffic, all identical: %s; "
            "%.2f s", N_STRANGERS, N_ALIASES, j.junk_sent,
            (unsigned long long)(k->sequences - seq0), SEQ_STEPS,
            k->mismatches == 0 && k->failures == 0 ? "yes" : "no", now_s() - t0);
    tally_merge(&k->tally, &j.tally);
}

/* B2: frames over ZMQ_MAXMSGSIZE from a stranger; the coordinator drops that connection. */
static void part_b2(struct coord *k)
{
    void *zctx = zmq_ctx_new();
    void *z = zctx ? dealer_open(zctx, k->ep, "big", 3, 0) : NULL;
    int sent = 0;
    for (int i = 0; i < N_OVERSIZE_COORD && z; i++) {
        sent += send_oversize(z, NULL, 0) == 0;
        sleep_ms(100);
    }
    if (z)
        zmq_close(z);
    if (zctx)
        zmq_ctx_term(zctx);
    k->tally.oversize += (uint64_t)sent;
    uint64_t mis0 = k->mismatches;
    int rc = coord_sequence(k, false);
    CHECK(sent == N_OVERSIZE_COORD && rc == 0 && k->mismatches == mis0,
          "after %d oversized frames: rc %d, %llu mismatches", sent, rc,
          (unsigned long long)(k->mismatches - mis0));
    MEASURE("coordinator: %d frames of %lld bytes from a stranger, the sequence after them "
            "identical: %s", sent, (long long)WIRE_MSG_MAX_DEFAULT + 1,
            rc == 0 && k->mismatches == mis0 ? "yes" : "no");
}

/* B3 (measured, not asserted; last on this cluster): mutations from a DEALER that takes over
 * worker 0's own routing id "w0" (ZMQ_ROUTER_HANDOVER), then one step. (With "w1" the step
 * stalls instead: worker 1's expert requests go nowhere, until worker 0, idle for 15 s,
 * exits and the step fails naming worker 0.) */
static void part_b3(struct coord *k)
{
    struct tally t = {0};
    struct gen g;
    void *zctx = zmq_ctx_new();
    struct oracle o = {0};
    int rc = zctx && gen_init(&g, 0xb3, &k->fx->m->hp) == 0 ? 0 : -ENOMEM;
    rc = rc ? rc : oracle_create(&o, zctx, "oracle-b3");
    void *z = rc ? NULL : dealer_open(zctx, k->ep, "w0", 2, 100);
    for (int i = 0; i < N_SPOOF_MUT && z && !rc; i++) {
        rc = gen_next(&g, &o, TARGET_COORD_SPOOF, &t);
        rc = rc ? rc : frames_send(z, NULL, 0, &g.fr);
    }
    CHECK(z && rc == 0, "impostor w0: rc %d", rc);
    if (z)
        zmq_close(z);
    oracle_destroy(&o);
    if (zctx)
        zmq_ctx_term(zctx); /* the impostor is gone */
    sleep_ms(300);          /* time for worker 0 to come back, were it to */
    tally_merge(&k->tally, &t);
    tally_measure("coordinator, impostor w0", &t);
    int rr = cluster_reset(k->c);
    int rs = cluster_step(k->c, k->fx->h, 1, 0, false, k->out);
    MEASURE("trust (same user): after an impostor took over id w0 and left: cluster_reset rc %d, "
            "cluster_step rc %d (%s)", rr, rs, rs ? strerror(-rs) : "ok");
    if (zctx || !rc)
        gen_free(&g);
}

/* Sends the message in g->fr as id, through its own context (delivered on return). */
static int forge(const char *ep, const char *id, struct gen *g)
{
    void *zctx = zmq_ctx_new();
    void *z = zctx ? dealer_open(zctx, ep, id, strlen(id), 2000) : NULL;
    int rc = z ? frames_send(z, NULL, 0, &g->fr) : -EIO;
    if (z)
        zmq_close(z);
    if (zctx)
        zmq_ctx_term(zctx);
    sleep_ms(50); /* the coordinator's io thread has it queued */
    return rc;
}

static struct cluster *demo_cluster(struct coord *k, const struct fixture *fx, const char *bin,
                                    const char *resident, const char *exclude)
{
    memset(k, 0, sizeof(*k));
    k->fx = fx;
    k->exclude = exclude;
    struct cluster_config cc = {.model_path = fx->path, .gguf = fx->g, .model = fx->m,
                                .n_workers = 2, .backends = {"cpu", "cpu"}, .resident = resident,
                                .n_ctx = N_CTX, .max_batch = MAX_BATCH, .worker_threads = 1,
                                .pool_threads = 1, .spawn = true, .worker_bin = bin};
    k->c = cluster_create(&cc);
    k->out = calloc((size_t)MAX_BATCH * fx->m->hp.n_vocab, sizeof(float));
    int rc = k->c && k->out ? coord_find_endpoint(k) : -EIO;
    rc = rc ? rc : cluster_step(k->c, fx->h, 1, 0, false, k->out);
    CHECK(rc == 0, "demo cluster (%s resident): rc %d", resident, rc);
    if (rc) {
        cluster_destroy(k->c);
        free(k->out);
        k->c = NULL;
    }
    return k->c;
}

/*
 * The trust demonstrations (measured, not asserted; see the top of the file).
 * Cluster 1 (half of the experts resident): a forged ERROR from "w00", which the coordinator
 * takes for worker 0, fails the step; the step it abandons keeps running in the workers, and
 * its expert requests then meet the next step.
 * Cluster 2 (all resident, so an abandoned step leaves nothing waiting): a forged RESULT from
 * "w01" for the next step; then an idle gap of 2 s between two steps.
 */
static void part_b_demos(const struct fixture *fx, const char *bin, const char *exclude)
{
    struct coord k;
    const uint32_t V = fx->m->hp.n_vocab;
    struct gen g;
    if (gen_init(&g, 0xde, &fx->m->hp))
        return;
    if (demo_cluster(&k, fx, bin, "50%", exclude)) {
        gen_valid(&g, WIRE_TYPE_ERROR);
        forge(k.ep, "w00", &g);
        cluster_reset(k.c);
        int rc_error = cluster_step(k.c, fx->h, 1, 0, false, k.out);
        sleep_ms(100);
        cluster_reset(k.c);
        int rc_next = cluster_step(k.c, fx->h, 1, 0, false, k.out);
        MEASURE("trust (same user): forged ERROR from id w00 -> cluster_step rc %d (%s); the "
                "next step -> rc %d (%s)", rc_error, rc_error ? strerror(-rc_error) : "ok",
                rc_next, rc_next ? strerror(-rc_next) : "ok");
        cluster_destroy(k.c);
        free(k.out);
    }
    if (demo_cluster(&k, fx, bin, "all", exclude)) {
        enc_result(&g.pl, 2, 1, V, -1); /* the demo cluster's second step */
        memset(g.tensor, 0, (size_t)V * 4);
        gen_envelope(&g, WIRE_VERSION, WIRE_TYPE_RESULT, (uint64_t)V * 4);
        gen_frames(&g, true, (size_t)V * 4);
        forge(k.ep, "w01", &g);
        for (uint32_t i = 0; i < V; i++)
            k.out[i] = 1.0f;
        cluster_reset(k.c);
        int rc_result = cluster_step(k.c, fx->h, 1, 0, false, k.out);
        bool zeros = true;
        for (uint32_t i = 0; i < V; i++)
            zeros &= k.out[i] == 0.0f;
        sleep_ms(100);
        cluster_reset(k.c);
        int rc_clean = cluster_step(k.c, fx->h, 1, 0, false, k.out);
        CHECK(rc_clean == 0, "demo cluster: a clean step after the forged result: rc %d",
              rc_clean);
        MEASURE("trust (same user): forged RESULT from id w01 -> cluster_step rc %d, forged "
                "logits taken: %s; next step rc %d", rc_result,
                rc_result == 0 && zeros ? "yes" : "no", rc_clean);
        sleep_ms(2000); /* longer than the coordinator's 1.5 s heartbeat window */
        cluster_reset(k.c);
        int rc_idle = cluster_step(k.c, fx->h, 1, 0, false, k.out);
        MEASURE("idle: a step 2 s after the previous one -> rc %d (%s)", rc_idle,
                rc_idle ? strerror(-rc_idle) : "ok");
        cluster_destroy(k.c);
        free(k.out);
    }
    gen_free(&g);
}

static void part_b(const struct fixture *fx, const char *bin, const float *ref_prefill,
                   const char *exclude)
{
    struct coord k;
    int rc = coord_create(&k, fx, bin, exclude);
    CHECK(rc == 0, "cluster with 2 workers (%s): rc %d", bin, rc);
    rc = rc ? rc : coord_sequence(&k, true);
    CHECK(rc == 0, "clean reference sequence: rc %d", rc);
    if (rc == 0) {
        size_t n = (size_t)PREFILL * fx->m->hp.n_vocab;
        bool same = memcmp(ref_prefill, k.ref[0], n * sizeof(float)) == 0;
        CHECK(same, "2-worker cluster and part A's worker disagree on the prefill logits");
        MEASURE("coordinator: endpoint %s; prefill logits equal to part A's (1 worker, our "
                "expert replies): %s", k.ep, same ? "bit for bit" : "no");
    }
    const char *log = getenv("TEST_FRAMES_LOG");
    if (rc == 0 && log) {
        part_b1(&k, log);
        part_b2(&k);
        int distinct = 0;
        for (int r = 0; r < WIRE_REJECT_COUNT; r++)
            distinct += k.tally.by_reason[r] > 0;
        int warned = count_lines(log, "dropped a malformed message from '") -
                     count_lines(log, "dropped a malformed message from ''");
        CHECK(warned == distinct, "coordinator: %d reject warnings, want %d (one per reason)",
              warned, distinct);
        MEASURE("coordinator: %llu sequences (%llu steps), %llu failed, %llu steps differ; "
                "%d reject warnings for %d reasons; %d \"from an unknown peer\" lines",
                (unsigned long long)k.sequences, (unsigned long long)k.steps,
                (unsigned long long)k.failures, (unsigned long long)k.mismatches, warned,
                distinct, count_lines(log, "from an unknown peer"));
        part_b3(&k);
        tally_measure("coordinator, all", &k.tally);
    }
    coord_destroy(&k);
}

/* No child, no segment and no runtime directory of this process is left. */
static void check_clean(void)
{
    int st;
    pid_t r = waitpid(-1, &st, WNOHANG);
    CHECK(r == -1 && errno == ECHILD, "a child process is left (waitpid %d)", (int)r);
    char pat[WIRE_PATH_MAX + 64];
    snprintf(pat, sizeof(pat), "/dev/shm/lamina-%d-*", (int)getpid());
    glob_t gl;
    int found = glob(pat, 0, NULL, &gl) == 0 ? (int)gl.gl_pathc : 0;
    globfree(&gl);
    CHECK(found == 0, "%d shm segments of this pid left", found);
    const char *xdg = getenv("XDG_RUNTIME_DIR");
    snprintf(pat, sizeof(pat), "%s/lamina-%d-*", xdg && xdg[0] == '/' ? xdg : "/tmp",
             (int)getpid());
    int dirs = glob(pat, 0, NULL, &gl) == 0 ? (int)gl.gl_pathc : 0;
    globfree(&gl);
    CHECK(dirs == 0, "%d runtime directories of this pid left (%s)", dirs, pat);
    MEASURE("after destroy: child processes left 0, shm segments %d, runtime directories %d",
            found, dirs);
}

/* Part B with this process's stderr (and so the spawned workers') in a file, to read the
 * coordinator's warnings and any sanitizer report of a worker. */
static void part_b_logged(const struct fixture *fx, const char *bin, const float *ref_prefill,
                          const char *exclude)
{
    char log[128];
    snprintf(log, sizeof(log), "/tmp/test-frames-%d-coord.log", (int)getpid());
    printf("part B: stderr of the coordinator and its workers goes to %s\n", log);
    fflush(stdout);
    int fd = open(log, O_WRONLY | O_CREAT | O_TRUNC, 0600), saved = dup(2);
    CHECK(fd >= 0 && saved >= 0, "cannot capture stderr in %s", log);
    if (fd < 0 || saved < 0)
        return;
    if (!log_is_enabled(LOG_LEVEL_WARN))
        log_set_level(LOG_LEVEL_WARN);
    int failures0 = check_failures;
    fflush(stderr);
    dup2(fd, 2);
    setenv("TEST_FRAMES_LOG", log, 1);
    double t0 = now_s();
    part_b(fx, bin, ref_prefill, exclude);
    part_b_demos(fx, bin, exclude);
    fflush(stderr);
    dup2(saved, 2);
    close(saved);
    close(fd);
    int san = sanitizer_reports(log);
    CHECK(san == 0, "%d sanitizer lines in %s", san, log);
    if (check_failures != failures0) {
        print_lines(log, "check failed", 40);
        fprintf(stderr, "---- last lines of %s ----\n", log);
        print_lines(log, "error", 40);
    } else {
        logs_remove(log);
    }
    MEASURE("coordinator part: %.1f s, %d sanitizer lines", now_s() - t0, san);
}

int main(int argc, char **argv)
{
    log_init("test", -1);
    signal(SIGPIPE, SIG_IGN);
    char buf[4096];
    const char *bin = worker_bin(argc, argv, buf, sizeof(buf));
    printf("worker binary: %s\n", bin);
    struct fixture fx;
    int rc = fixture_create(&fx);
    CHECK(rc == 0, "fixture: %d", rc);
    if (rc == 0) {
        double t0 = now_s();
        float *ref = calloc((size_t)PREFILL * fx.m->hp.n_vocab, sizeof(float));
        part_a(&fx, bin, ref);
        MEASURE("worker part: %.1f s", now_s() - t0);
        struct oversize ov;
        oversize_start(&ov, &fx, bin);
        char link[4096];
        bool made, linked = worker_link(bin, link, sizeof(link), &made);
        part_b_logged(&fx, linked ? NULL : bin, ref, ov.f.rundir);
        if (made)
            unlink(link);
        oversize_finish(&ov);
        free(ref);
        MEASURE("total: %.1f s", now_s() - t0);
    }
    fixture_destroy(&fx);
    check_clean();
    return test_main_result("test_frames");
}
