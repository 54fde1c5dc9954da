/*
 * cluster: workers, shared memory, plans and steps (see cluster.h).
 *
 * Routing ids on the coordinator's ROUTER: "w<i>" is worker i's main socket
 * (hello, ready, expert requests, results, timings, errors), "h<i>" its
 * watchdog (heartbeats carrying its layer-progress counter).
 *
 * Foreign experts (--experts-home any, planner.h step 5): an expert request
 * whose groups include experts another worker holds is split. Each holder gets
 * its groups (rows gathered in group order) as an ExpertRequest with a fresh
 * non-zero tag, sent first so that it computes while the CPU pool runs the
 * remaining groups here; the rows of every part are put back at their groups'
 * places in the original order, and once every part has come the requester
 * gets one ExpertReply, as if the pool had run it all. A worker has at most one
 * request outstanding (it waits for its reply), so the coordinator keeps one
 * pending assembly per requesting worker. A holder that reports an error, dies
 * or does not answer within hang_timeout fails the step with an error naming it.
 */
#include "coordinator/cluster.h"

#include <dirent.h>
#include <errno.h>
#include <limits.h>
#include <sched.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>
#include <zmq.h>

#include "common/check.h"
#include "common/log.h"
#include "coordinator/expert_pool.h"
#include "coordinator/planner.h"
#include "ipc/nccl.h"
#include "ipc/shm.h"
#include "ipc/wire.h"
#include "kernels/cpu/threadpool.h"
#include "worker/forward.h"

#define CLUSTER_HELLO_TIMEOUT_S 30.0  /* spawn -> hello */
#define CLUSTER_READY_TIMEOUT_S 900.0 /* plan -> ready (large models load slowly) */
#define CLUSTER_DEAD_S 1.5            /* no heartbeat (sent every 0.25 s) for this long: dead */
#define CLUSTER_POLL_MS 50            /* step loop granularity */
#define CLUSTER_SHUTDOWN_WAIT_S 1.0   /* SHUTDOWN -> SIGKILL */
#define CLUSTER_TIMING_WAIT_S 2.0     /* the last steps' timing lines, before a summary */

_Static_assert(WIRE_NCCL_ID_BYTES == NCCL_COMM_ID_BYTES, "NCCL unique id size");

struct cluster_worker {
    int index;
    pid_t pid;                 /* spawned process, or 0 */
    bool exited;               /* reaped */
    int status;                /* wait status when exited */
    bool hello, ready;
    bool has_key;              /* tcp: the CURVE key of its data socket */
    uint8_t key[WIRE_KEY_BYTES];
    bool failed;               /* found dead or hung: killed at once on shutdown */
    bool reported_error;       /* sent an ERROR (it may be exiting on its own) */
    uint32_t l0, l1;           /* layer range */
    uint8_t **bitmaps;         /* per layer in range: residency bitmap */
    bool *trunk, *shexp;       /* per layer in range: projections / shared expert on device */
    bool lmhead;               /* output projection charged here */
    bool nccl_next;            /* hands hidden states to worker index + 1 over NCCL */
    uint8_t nccl_next_id[WIRE_NCCL_ID_BYTES]; /* that pair's unique id */
    uint32_t resident;         /* experts held, as reported */
    uint64_t mem_used;         /* bytes, as reported */
    double last_heartbeat;     /* time of the last heartbeat */
    uint64_t progress;         /* last progress counter seen */
    double progress_time;      /* when it last changed */
    /* summary of TIMING lines */
    uint64_t steps, tokens;
    double ms_total, ms_attn, ms_deltanet, ms_router, ms_experts, ms_cpu_wait, ms_shared;
    double ms_send, ms_recv_wait, ms_handoff;
    uint64_t experts_local, experts_cpu;
    uint8_t **foreign;         /* --experts-home any: per model layer, the foreign experts it
                                  holds (bitmap) or NULL; NULL: none */
    uint64_t served_req, served_rows; /* forwarded requests it answered, rows */
};

/* One expert request being assembled from forwarded parts (see the top of this file). */
struct cl_pending {
    bool busy;
    uint64_t step;
    uint32_t layer, rows, n_groups;
    uint32_t *off, *cnt;       /* per group: first row in the request, rows */
    int16_t *who;              /* per group: the worker holding it, or -1 (CPU pool) */
    float *out;                /* rows x n_embd: the reply */
    int n_wait;                /* parts not answered yet */
    double t_sent;
    uint64_t tag[CLUSTER_MAX_WORKERS]; /* per worker: its part's tag, 0 when none or answered */
    uint32_t part_rows[CLUSTER_MAX_WORKERS];
};

struct cluster {
    struct cluster_config cfg;
    int n;                              /* workers */
    struct cluster_worker w[CLUSTER_MAX_WORKERS];
    void *zctx;
    struct wire_socket *router;
    char rundir[WIRE_PATH_MAX];
    char endpoint[256];
    char data_ep[CLUSTER_MAX_WORKERS][WIRE_PATH_MAX + 16];
    struct wire_keypair keys;
    bool curve;
    struct shm_segment *shm;
    struct nccl_lib *nccl;              /* NCCL for the pairs' unique ids, or NULL */
    struct expert_ref **refs;           /* per layer, pool's view of shm */
    struct expert_pool *pool;
    float *reply;                       /* expert reply rows */
    int16_t **home;                     /* --experts-home any: per layer, per expert, the worker
                                           holding it when foreign, else -1; NULL: range */
    struct cl_pending pend[CLUSTER_MAX_WORKERS]; /* per requesting worker */
    float *gather;                      /* rows of one part of a split request */
    uint32_t *gx, *gc;                  /* its experts and counts */
    uint64_t next_tag;
    uint32_t reply_rows;
    uint64_t seq_no, step;
    FILE *timings;
    volatile sig_atomic_t interrupted;
    double pool_busy_prev;
    struct cl_flight {                  /* per sequence slot: its step in flight */
        bool busy;
        uint64_t step;                  /* the step number it was sent as */
        uint32_t n;                     /* rows */
        uint32_t want_rows;             /* logits rows expected (0: a sampled token) */
        float *logits;                  /* where they go: borrowed from cluster_submit */
        int32_t token;                  /* the token, once it came */
        double t_start;                 /* when it was sent */
    } fl[CLUSTER_SEQ_MAX];
    uint32_t n_seq;                     /* sequence slots of every worker */
    uint32_t n_flight;                  /* sequences with a step in flight */
    uint64_t results;                   /* steps that came back (each worker's timing line
                                           of each is owed) */
};

static double cl_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* ---- hand-off ---- */

/* Device index of a "cuda:N" worker, or -1 for any other backend. */
static int cl_cuda_device(const char *backend)
{
    if (!backend || strncmp(backend, "cuda:", 5))
        return -1;
    char *end;
    long v = strtol(backend + 5, &end, 10);
    return end != backend + 5 && !*end && v >= 0 && v < INT_MAX ? (int)v : -1;
}

/* Marks the pairs that hand hidden states over NCCL (cluster.h); why gets the reason a pair
 * does not, in words. Returns the number of pairs, or -EINVAL (logged) when "nccl" is asked of
 * two workers on one device. */
static int cl_handoff_pairs(struct cluster *c, bool required, char *why, size_t cap)
{
    int pairs = 0;
    snprintf(why, cap, "a single worker has no one to hand over to");
    for (int i = 0; i + 1 < c->n; i++) {
        const char *ba = c->cfg.backends[i], *bb = c->cfg.backends[i + 1];
        const int a = cl_cuda_device(ba), b = cl_cuda_device(bb);
        if (a < 0 || b < 0) {
            snprintf(why, cap, "workers %d and %d run on %s and %s", i, i + 1, ba ? ba : "cpu",
                     bb ? bb : "cpu");
        } else if (!c->cfg.spawn) {
            snprintf(why, cap, "workers started by hand may be on other hosts");
        } else if (a == b && required) {
            log_error("--handoff nccl: workers %d and %d are both on cuda:%d, and NCCL cannot "
                      "join two ranks of one device", i, i + 1, a);
            return -EINVAL;
        } else if (a == b) {
            snprintf(why, cap, "workers %d and %d share cuda:%d", i, i + 1, a);
        } else {
            c->w[i].nccl_next = true;
            pairs++;
        }
    }
    return pairs;
}

/* Decides the hand-off of every pair of consecutive workers and loads NCCL where it is used
 * (cluster.h). Returns 0, or -EINVAL / -ENOTSUP after logging why "nccl" cannot be had. */
static int cl_handoff_plan(struct cluster *c)
{
    const char *mode = c->cfg.handoff ? c->cfg.handoff : "zmq";
    const bool required = !strcmp(mode, "nccl");
    if (!required && strcmp(mode, "auto")) {
        if (strcmp(mode, "zmq")) {
            log_error("--handoff '%s' must be nccl, zmq or auto", mode);
            return -EINVAL;
        }
        return 0;
    }
    char why[192];
    int pairs = cl_handoff_pairs(c, required, why, sizeof(why));
    if (pairs < 0)
        return pairs;
    if (pairs == 0 && required) {
        log_error("--handoff nccl needs two consecutive workers on different CUDA devices of "
                  "this host (cuda:N, started by this coordinator), but %s", why);
        return -EINVAL;
    }
    if (pairs == 0) {
        log_info("hand-off: zmq (auto: %s)", why);
        return 0;
    }
    c->nccl = nccl_lib_open(!required);
    if (!c->nccl) {
        for (int i = 0; i < c->n; i++)
            c->w[i].nccl_next = false;
        if (required) {
            log_error("--handoff nccl: NCCL cannot be loaded (LAMINA_NCCL_LIB names the library "
                      "to use)");
            return -ENOTSUP;
        }
        log_warn("hand-off: zmq (auto: libnccl.so.2 cannot be loaded; LAMINA_NCCL_LIB names it)");
        return 0;
    }
    for (int i = 0; i + 1 < c->n; i++)
        log_info("hand-off worker %d -> %d: %s (%s -> %s)", i, i + 1,
                 c->w[i].nccl_next ? "nccl" : "zmq", c->cfg.backends[i], c->cfg.backends[i + 1]);
    return 0;
}

/* One unique id per NCCL pair, made once the workers have started (the id's bootstrap root
 * is a listening thread of this process, not to be inherited by them). */
static int cl_handoff_ids(struct cluster *c)
{
    for (int i = 0; i + 1 < c->n; i++) {
        if (!c->w[i].nccl_next)
            continue;
        int rc = nccl_lib_unique_id(c->nccl, c->w[i].nccl_next_id);
        if (rc)
            return rc;
    }
    return 0;
}

/* ---- layer split and residency ---- */

static double cl_layer_cost(const struct arch_model *m, uint32_t l)
{
    return (double)planner_layer_read_bytes(m, l);
}

/* "auto": contiguous ranges with about equal bytes read per token. */
static int cl_split_auto(struct cluster *c)
{
    const struct arch_model *m = c->cfg.model;
    const uint32_t L = m->hp.n_layer;
    if ((uint32_t)c->n > L) {
        log_error("%d workers for %u layers: every worker needs at least one layer", c->n, L);
        return -EINVAL;
    }
    double total = 0;
    for (uint32_t l = 0; l < L; l++)
        total += cl_layer_cost(m, l);
    double acc = 0;
    uint32_t l = 0;
    for (int i = 0; i < c->n; i++) {
        c->w[i].l0 = l;
        double target = total * (i + 1) / c->n;
        while (l < L - (uint32_t)(c->n - 1 - i) &&
               (l == c->w[i].l0 || acc + cl_layer_cost(m, l) / 2 <= target))
            acc += cl_layer_cost(m, l++);
        c->w[i].l1 = i == c->n - 1 ? L : l;
    }
    return 0;
}

static int cl_split_list(struct cluster *c, const char *spec)
{
    const uint32_t L = c->cfg.model->hp.n_layer;
    const char *p = spec;
    uint32_t next = 0;
    for (int i = 0; i < c->n; i++) {
        char *end;
        unsigned long a = strtoul(p, &end, 10), b;
        if (end == p || *end != '-')
            goto bad;
        p = end + 1;
        b = strtoul(p, &end, 10);
        if (end == p || (*end != ',' && *end) || a != next || b < a || b >= L)
            goto bad;
        c->w[i].l0 = (uint32_t)a;
        c->w[i].l1 = (uint32_t)b + 1;
        next = (uint32_t)b + 1;
        p = *end ? end + 1 : end;
    }
    if (next != L || *p)
        goto bad;
    return 0;
bad:
    log_error("--layers '%s' must list %d contiguous ranges covering layers 0-%u, like 0-3,4-7",
              spec, c->n, L - 1);
    return -EINVAL;
}

/* Experts of one layer a worker holds: count, or all (-1). */
static int cl_resident_count(struct cluster *c, int i)
{
    const char *r = c->cfg.resident ? c->cfg.resident : "all";
    const struct arch_model *m = c->cfg.model;
    const uint32_t E = m->hp.n_expert;
    if (!strcmp(r, "all"))
        return (int)E;
    if (!strcmp(r, "none"))
        return 0;
    if (!strcmp(r, "fit")) {
        /* as many experts per layer as fit in three quarters of the budget after the
         * trunk; the rest of the budget is for KV, state and scratch */
        const uint64_t budget = c->cfg.device_mem[i];
        if (!budget)
            return (int)E;
        double trunk = 0, one_expert_all_layers = 0;
        for (uint32_t l = c->w[i].l0; l < c->w[i].l1; l++) {
            double pe = (double)planner_expert_bytes(&m->layers[l]);
            trunk += cl_layer_cost(m, l) - pe * m->hp.n_expert_used;
            one_expert_all_layers += pe;
        }
        double room = budget * 0.75 - trunk;
        int k = room > 0 ? (int)(room / one_expert_all_layers) : 0;
        return k > (int)E ? (int)E : k;
    }
    char *end;
    double pct = strtod(r, &end);
    if (end != r && !strcmp(end, "%") && pct >= 0 && pct <= 100)
        return (int)(E * pct / 100.0 + 0.5);
    log_error("--resident '%s' must be all, none, fit or a percentage like 50%%", r);
    return -1;
}

/* Bitmaps: the first k experts of each layer, rotated by layer so that the
 * CPU pool's share is spread over expert ids. */
static int cl_plan_residency(struct cluster *c)
{
    const uint32_t E = c->cfg.model->hp.n_expert;
    for (int i = 0; i < c->n; i++) {
        struct cluster_worker *w = &c->w[i];
        int k = cl_resident_count(c, i);
        if (k < 0)
            return -EINVAL;
        w->bitmaps = calloc(w->l1 - w->l0, sizeof(*w->bitmaps));
        if (!w->bitmaps)
            return -ENOMEM;
        for (uint32_t l = w->l0; l < w->l1; l++) {
            uint8_t *b = calloc((E + 7) / 8, 1);
            if (!b)
                return -ENOMEM;
            for (int j = 0; j < k; j++) {
                uint32_t e = (uint32_t)(j + l) % E;
                b[e / 8] |= (uint8_t)(1u << (e % 8));
            }
            w->bitmaps[l - w->l0] = b;
        }
        log_info("worker %d: layers %u-%u, %d of %u experts per layer resident", i, w->l0,
                 w->l1 - 1, k, E);
    }
    return 0;
}

/* Trunk flags when there is no plan: everything of a worker's layers is on
 * its device, the output projection on the last one. */
static int cl_trunk_all(struct cluster *c)
{
    for (int i = 0; i < c->n; i++) {
        struct cluster_worker *w = &c->w[i];
        const uint32_t nl = w->l1 - w->l0;
        w->trunk = calloc(nl, sizeof(bool));
        w->shexp = calloc(nl, sizeof(bool));
        if (!w->trunk || !w->shexp)
            return -ENOMEM;
        for (uint32_t l = 0; l < nl; l++)
            w->trunk[l] = w->shexp[l] = true;
        w->lmhead = i == c->n - 1;
    }
    return 0;
}

static bool cl_use_planner(const struct cluster *c)
{
    if (c->cfg.place)
        return true;
    for (int i = 0; i < c->n; i++)
        if (!c->cfg.device_mem[i])
            return false;
    return !c->cfg.resident; /* an explicit --resident keeps the simple split */
}

/* --experts-home any: who holds which foreign expert, per layer and per worker. */
static int cl_plan_foreign(struct cluster *c, const struct planner_plan *plan)
{
    const uint32_t L = plan->n_layer, E = plan->n_expert, bm = (E + 7) / 8;
    c->home = calloc(L, sizeof(*c->home));
    if (!c->home)
        return -ENOMEM;
    for (uint32_t l = 0; l < L; l++) {
        c->home[l] = malloc(E * sizeof(**c->home));
        if (!c->home[l])
            return -ENOMEM;
        for (uint32_t e = 0; e < E; e++) {
            const int h = planner_holder(plan, l, e);
            const bool foreign = h >= 0 && h != plan->layers[l].device;
            c->home[l][e] = (int16_t)(foreign ? h : -1);
            if (!foreign)
                continue;
            struct cluster_worker *w = &c->w[h];
            if (!w->foreign && !(w->foreign = calloc(L, sizeof(*w->foreign))))
                return -ENOMEM;
            if (!w->foreign[l] && !(w->foreign[l] = calloc(bm, 1)))
                return -ENOMEM;
            w->foreign[l][e / 8] |= (uint8_t)(1u << (e % 8));
        }
    }
    for (int i = 0; i < c->n; i++)
        if (plan->dev[i].n_foreign)
            log_info("worker %d: holds %u experts of other workers' layers (%.1f MiB, "
                     "--experts-home any)", i, plan->dev[i].n_foreign,
                     plan->dev[i].foreign / 1048576.0);
    return 0;
}

/* Layer ranges, resident experts and trunk pieces from the placement planner. */
static int cl_plan(struct cluster *c)
{
    const struct arch_model *m = c->cfg.model;
    struct planner_heat *heat = NULL;
    if (c->cfg.heat_path && planner_heat_load(c->cfg.heat_path, &heat))
        return -EINVAL;
    struct planner_config pc = {.model = m, .n_devices = c->n, .heat = heat,
                                .place = c->cfg.place, .layers = c->cfg.layers,
                                .n_ctx = c->cfg.n_ctx, .kv_f16 = c->cfg.kv_f16,
                                .max_batch = c->cfg.max_batch, .n_seq = c->n_seq,
                                .experts_home = c->cfg.experts_home};
    for (int i = 0; i < c->n; i++) {
        pc.devices[i] = (struct planner_device){
            .name = c->cfg.backends[i], .budget = c->cfg.device_mem[i],
            .holds_trunk = cl_cuda_device(c->cfg.backends[i]) >= 0};
        pc.dense_miss_ratio |= strncmp(c->cfg.backends[i], "cpu", 3) != 0;
    }
    /* Measured speeds (the host for the CPU pool's threads; every card whose
     * worker this process starts), or the figures LAMINA_PROBE states
     * (planner_probe_devices: "off" or "cpu=20,cuda:0=3400:53" for plans
     * that do not depend on the machine). Nothing else runs yet, and this
     * process never uses a card itself, as a CUDA probe requires. */
    int rc = planner_probe_devices(&pc, getenv("LAMINA_PROBE"), c->cfg.pool_threads,
                                   c->cfg.spawn);
    struct planner_plan *plan = NULL;
    rc = rc ? rc : planner_build(&pc, &plan);
    planner_heat_destroy(heat);
    if (rc)
        return rc;
    if (log_is_enabled(LOG_LEVEL_INFO))
        planner_print_decisions(plan, stderr, false);
    const uint32_t bm = (m->hp.n_expert + 7) / 8;
    for (int i = 0; i < c->n && !rc; i++) {
        struct cluster_worker *w = &c->w[i];
        w->l0 = plan->dev[i].layer_begin;
        w->l1 = plan->dev[i].layer_end;
        w->lmhead = plan->lmhead_device == i;
        const uint32_t nl = w->l1 - w->l0;
        w->bitmaps = calloc(nl, sizeof(*w->bitmaps));
        w->trunk = calloc(nl, sizeof(bool));
        w->shexp = calloc(nl, sizeof(bool));
        if (!w->bitmaps || !w->trunk || !w->shexp) {
            rc = -ENOMEM;
            break;
        }
        for (uint32_t l = 0; l < nl && !rc; l++) {
            w->bitmaps[l] = malloc(bm);
            if (!w->bitmaps[l]) {
                rc = -ENOMEM;
                break;
            }
            memcpy(w->bitmaps[l], planner_bitmap(plan, w->l0 + l), bm);
            w->trunk[l] = plan->layers[w->l0 + l].proj;
            w->shexp[l] = plan->layers[w->l0 + l].shexp;
        }
        log_info("worker %d: layers %u-%u, %u experts resident, %.1f MiB trunk placed", i, w->l0,
                 w->l1 - 1, plan->dev[i].n_experts, plan->dev[i].trunk / 1048576.0);
    }
    if (!rc && plan->experts_any)
        rc = cl_plan_foreign(c, plan);
    planner_plan_destroy(plan);
    return rc;
}

/* ---- shared memory and the CPU pool ---- */

static void cl_shm_progress(void *ctx, uint64_t done, uint64_t total)
{
    (void)ctx;
    if (total >= (1ull << 30))
        log_info("copying experts to shared memory: %.1f of %.1f GiB", done / 1073741824.0,
                 total / 1073741824.0);
}

static int cl_setup_shm(struct cluster *c)
{
    const struct arch_model *m = c->cfg.model;
    int stale = shm_cleanup_stale();
    if (stale > 0)
        log_info("removed %d shared-memory segment(s) of dead coordinators", stale);
    struct shm_create_config sc = {.model = m, .gguf = c->cfg.gguf, .progress = cl_shm_progress};
    c->shm = shm_create(&sc);
    if (!c->shm)
        return -EIO;
    const uint32_t E = m->hp.n_expert, L = m->hp.n_layer;
    c->refs = calloc(L, sizeof(*c->refs));
    if (!c->refs)
        return -ENOMEM;
    for (uint32_t l = 0; l < L; l++) {
        c->refs[l] = calloc(E, sizeof(struct expert_ref));
        if (!c->refs[l])
            return -ENOMEM;
        int rc = expert_exec_shm_refs(c->shm, l, E, c->refs[l]);
        if (rc)
            return rc;
    }
    const uint32_t rows = c->cfg.max_batch * m->hp.n_expert_used;
    struct expert_pool_config pc = {.model = m, .refs = (const struct expert_ref *const *)c->refs,
                                    .n_threads = c->cfg.pool_threads, .max_rows = rows};
    c->pool = expert_pool_create(&pc);
    c->reply = malloc((size_t)rows * m->hp.n_embd * sizeof(float));
    if (!c->pool || !c->reply)
        return -ENOMEM;
    if (!c->home)
        return 0;
    c->gather = malloc((size_t)rows * m->hp.n_embd * sizeof(float));
    c->gx = malloc(E * sizeof(*c->gx));
    c->gc = malloc(E * sizeof(*c->gc));
    if (!c->gather || !c->gx || !c->gc)
        return -ENOMEM;
    for (int i = 0; i < c->n; i++) {
        struct cl_pending *pd = &c->pend[i];
        pd->off = malloc(E * sizeof(*pd->off));
        pd->cnt = malloc(E * sizeof(*pd->cnt));
        pd->who = malloc(E * sizeof(*pd->who));
        pd->out = malloc((size_t)rows * m->hp.n_embd * sizeof(float));
        if (!pd->off || !pd->cnt || !pd->who || !pd->out)
            return -ENOMEM;
    }
    return 0;
}

/* ---- sockets and processes ---- */

/* Removes runtime directories of coordinators that are gone. */
static void cl_cleanup_rundirs(const char *base)
{
    DIR *d = opendir(base);
    if (!d)
        return;
    struct dirent *e;
    while ((e = readdir(d))) {
        int pid;
        char rest[64];
        if (sscanf(e->d_name, "lamina-%d-%63s", &pid, rest) != 2 || pid <= 0)
            continue;
        if (kill(pid, 0) == 0 || errno != ESRCH)
            continue;
        char path[PATH_MAX];
        snprintf(path, sizeof(path), "%s/%s", base, e->d_name);
        if (wire_rundir_remove(path) == 0)
            log_info("removed the runtime directory %s of dead coordinator %d", path, pid);
    }
    closedir(d);
}

static int cl_setup_router(struct cluster *c)
{
    c->zctx = zmq_ctx_new();
    if (!c->zctx)
        return -ENOMEM;
    const char *xdg = getenv("XDG_RUNTIME_DIR");
    cl_cleanup_rundirs(xdg && xdg[0] == '/' ? xdg : "/tmp");
    int rc = wire_rundir_create(NULL, c->rundir, sizeof(c->rundir));
    if (rc)
        return rc;
    struct wire_socket_config sc = wire_socket_config_default();
    sc.send_timeout_ms = 5000;
    sc.spin_us = 100; /* expert requests arrive within microseconds of each other */
    sc.no_handover = true; /* a second peer must not take over a worker's routing id */
    if (c->cfg.listen) {
        rc = wire_keypair_generate(&c->keys);
        if (rc)
            return rc;
        c->curve = true;
        sc.curve_keys = &c->keys;
        sc.curve_server = true;
    }
    c->router = wire_socket_create(c->zctx, ZMQ_ROUTER, &sc);
    if (!c->router)
        return -EIO;
    if (c->cfg.listen) {
        rc = wire_socket_bind(c->router, c->cfg.listen);
        rc = rc ? rc : wire_socket_endpoint(c->router, c->endpoint, sizeof(c->endpoint));
        char z85[WIRE_KEY_Z85_LEN + 1];
        wire_key_to_z85(c->keys.public_key, z85);
        if (!rc) {
            char kp[WIRE_PATH_MAX + 32];
            snprintf(kp, sizeof(kp), "%s/server.key", c->rundir);
            FILE *f = fopen(kp, "w");
            if (f) {
                fprintf(f, "%s\n", z85);
                fclose(f);
            }
            log_info("listening on %s (CURVE); start workers with: lamina-worker --connect %s "
                     "--index I --server-key %s", c->endpoint, c->endpoint, z85);
        }
        return rc;
    }
    rc = wire_endpoint_ipc(c->endpoint, sizeof(c->endpoint), c->rundir, "coord");
    return rc ? rc : wire_socket_bind(c->router, c->endpoint);
}

static const char *cl_worker_bin(const struct cluster *c, char *buf, size_t cap)
{
    if (c->cfg.worker_bin)
        return c->cfg.worker_bin;
    ssize_t n = readlink("/proc/self/exe", buf, cap - 16);
    if (n <= 0)
        return "lamina-worker";
    buf[n] = 0;
    char *slash = strrchr(buf, '/');
    strcpy(slash ? slash + 1 : buf, "lamina-worker");
    return buf;
}

static int cl_spawn(struct cluster *c, int i)
{
    char buf[PATH_MAX], idx[16];
    const char *path = cl_worker_bin(c, buf, sizeof(buf));
    char bin[PATH_MAX];
    snprintf(bin, sizeof(bin), "%s", path);
    snprintf(idx, sizeof(idx), "%d", i);
    const pid_t parent = getpid();
    fflush(NULL);
    pid_t pid = fork();
    if (pid < 0)
        return SYS_CHECK(pid);
    if (pid == 0) {
        prctl(PR_SET_PDEATHSIG, SIGKILL);
        cpu_set_t all; /* not the coordinator's pinning: the worker pins its own threads */
        CPU_ZERO(&all);
        for (int k = 0; k < CPU_SETSIZE; k++)
            CPU_SET(k, &all);
        sched_setaffinity(0, sizeof(all), &all);
        if (getppid() != parent)
            _exit(127);
        char *argv[] = {bin, "--connect", c->endpoint, "--index", idx, NULL};
        execv(bin, argv);
        fprintf(stderr, "lamina: cannot start worker %s: %s\n", bin, strerror(errno));
        _exit(127);
    }
    c->w[i].pid = pid;
    log_info("started worker %d (pid %d): %s", i, (int)pid, bin);
    return 0;
}

/* Reaps exited workers; returns the index of one that exited, or -1. */
static int cl_reap(struct cluster *c)
{
    for (int i = 0; i < c->n; i++) {
        struct cluster_worker *w = &c->w[i];
        if (!w->pid || w->exited)
            continue;
        int st;
        if (waitpid(w->pid, &st, WNOHANG) == w->pid) {
            w->exited = true;
            w->status = st;
            return i;
        }
    }
    return -1;
}

static void cl_describe_exit(const struct cluster_worker *w, char *buf, size_t cap)
{
    if (WIFSIGNALED(w->status))
        snprintf(buf, cap, "killed by signal %d (%s)", WTERMSIG(w->status),
                 strsignal(WTERMSIG(w->status)));
    else
        snprintf(buf, cap, "exited with status %d", WEXITSTATUS(w->status));
}

/* Worker index from a routing id "w<i>" / "h<i>"; -1 if unknown. */
static int cl_worker_of(const struct cluster *c, const char *id, size_t len, bool *watchdog)
{
    if (len < 2 || len > 8 || (id[0] != 'w' && id[0] != 'h') || (len > 2 && id[1] == '0'))
        return -1; /* exactly "w<i>" / "h<i>": no look-alikes such as "w00" */
    int v = 0;
    for (size_t k = 1; k < len; k++) {
        if (id[k] < '0' || id[k] > '9')
            return -1;
        v = v * 10 + (id[k] - '0');
    }
    *watchdog = id[0] == 'h';
    return v < c->n ? v : -1;
}

static int cl_send(struct cluster *c, int i, struct wire_msg *m)
{
    char id[16];
    snprintf(id, sizeof(id), "w%d", i);
    m->seq_no = ++c->seq_no;
    return wire_send(c->router, m, id, strlen(id));
}

/* ---- timing ---- */

static double cl_json_num(const char *json, const char *key)
{
    char pat[48];
    snprintf(pat, sizeof(pat), "\"%s\":", key);
    const char *p = strstr(json, pat);
    return p ? strtod(p + strlen(pat), NULL) : 0.0;
}

static void cl_timing(struct cluster *c, int i, const char *json)
{
    struct cluster_worker *w = &c->w[i];
    w->steps++;
    w->tokens += (uint64_t)cl_json_num(json, "tokens");
    w->ms_total += cl_json_num(json, "total");
    w->ms_attn += cl_json_num(json, "attn");
    w->ms_deltanet += cl_json_num(json, "deltanet");
    w->ms_router += cl_json_num(json, "router");
    w->ms_experts += cl_json_num(json, "experts_gpu");
    w->ms_cpu_wait += cl_json_num(json, "experts_cpu_wait");
    w->ms_shared += cl_json_num(json, "shared_expert");
    w->ms_send += cl_json_num(json, "send");
    w->ms_recv_wait += cl_json_num(json, "recv_wait");
    w->ms_handoff += cl_json_num(json, "handoff");
    w->experts_local += (uint64_t)cl_json_num(json, "hit");
    w->experts_cpu += (uint64_t)cl_json_num(json, "cpu");
    if (c->timings)
        fprintf(c->timings, "%s\n", json);
}

static void cl_settle_timings(struct cluster *c);

void cluster_print_summary(struct cluster *c, FILE *out)
{
    cl_settle_timings(c);
    fprintf(out, "| worker | layers | steps | tokens | total ms | attn | deltanet | router | "
                 "experts | cpu wait | shared | send | recv wait | handoff | experts local/cpu "
                 "|\n");
    fprintf(out, "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---|\n");
    for (int i = 0; i < c->n; i++) {
        const struct cluster_worker *w = &c->w[i];
        char handoff[32] = "-"; /* the last worker hands nothing on */
        if (i + 1 < c->n)
            snprintf(handoff, sizeof(handoff), "%.1f %s", w->ms_handoff,
                     w->nccl_next ? "nccl" : "zmq");
        fprintf(out, "| %d | %u-%u | %llu | %llu | %.1f | %.1f | %.1f | %.1f | %.1f | %.1f | "
                     "%.1f | %.1f | %.1f | %s | %llu/%llu |\n",
                i, w->l0, w->l1 - 1, (unsigned long long)w->steps,
                (unsigned long long)w->tokens, w->ms_total, w->ms_attn, w->ms_deltanet,
                w->ms_router, w->ms_experts, w->ms_cpu_wait, w->ms_shared, w->ms_send,
                w->ms_recv_wait, handoff, (unsigned long long)w->experts_local,
                (unsigned long long)w->experts_cpu);
    }
    fprintf(out, "CPU expert pool: %.1f ms busy, %llu rows\n",
            1e3 * expert_pool_busy_s(c->pool), (unsigned long long)expert_pool_rows(c->pool));
}

/* ---- messages ---- */

/* Gathers the rows of the pending request's groups that worker h holds (h = -1: the CPU
 * pool's) into c->gather and their counts into c->gc (the caller fills c->gx); returns the
 * number of groups, *rows their rows. */
static uint32_t cl_gather(struct cluster *c, const struct cl_pending *pd, const float *X, int h,
                          uint32_t *rows)
{
    const size_t n_embd = c->cfg.model->hp.n_embd;
    uint32_t n = 0, at = 0;
    for (uint32_t g = 0; g < pd->n_groups; g++) {
        if (pd->who[g] != h)
            continue;
        memcpy(c->gather + (size_t)at * n_embd, X + (size_t)pd->off[g] * n_embd,
               (size_t)pd->cnt[g] * n_embd * sizeof(float));
        c->gc[n++] = pd->cnt[g];
        at += pd->cnt[g];
    }
    *rows = at;
    return n;
}

/* Puts rows Y of the groups worker h (or the pool, -1) computed back at their places. */
static void cl_scatter(struct cluster *c, struct cl_pending *pd, const float *Y, int h)
{
    const size_t n_embd = c->cfg.model->hp.n_embd;
    uint32_t at = 0;
    for (uint32_t g = 0; g < pd->n_groups; g++) {
        if (pd->who[g] != h)
            continue;
        memcpy(pd->out + (size_t)pd->off[g] * n_embd, Y + (size_t)at * n_embd,
               (size_t)pd->cnt[g] * n_embd * sizeof(float));
        at += pd->cnt[g];
    }
}

/* The assembled reply of worker i's split request, once every part has come. */
static int cl_pending_finish(struct cluster *c, int i)
{
    struct cl_pending *pd = &c->pend[i];
    struct wire_msg o = {.type = WIRE_TYPE_EXPERT_REPLY};
    o.expert_reply = (struct wire_expert_reply){.step = pd->step, .layer = pd->layer,
                                                .n_rows = pd->rows,
                                                .n_embd = c->cfg.model->hp.n_embd};
    o.tensor = pd->out;
    o.tensor_bytes = (size_t)pd->rows * c->cfg.model->hp.n_embd * sizeof(float);
    pd->busy = false;
    return cl_send(c, i, &o);
}

/* A request of worker i with experts other workers hold (see the top of this file). */
static int cl_expert_split(struct cluster *c, int i, const struct wire_msg *m)
{
    const struct wire_expert_request *r = &m->expert_request;
    const struct arch_hparams *hp = &c->cfg.model->hp;
    struct cl_pending *pd = &c->pend[i];
    if (pd->busy || r->n_experts > hp->n_expert) {
        log_error("worker %d sent an expert request for layer %u (%zu groups) while its request "
                  "for layer %u waits for other workers, or with more groups than %u experts",
                  i, r->layer, r->n_experts, pd->layer, hp->n_expert);
        return -EPROTO;
    }
    *pd = (struct cl_pending){.busy = true, .step = r->step, .layer = r->layer,
                              .n_groups = (uint32_t)r->n_experts, .off = pd->off, .cnt = pd->cnt,
                              .who = pd->who, .out = pd->out, .t_sent = cl_now()};
    for (uint32_t g = 0; g < pd->n_groups; g++) {
        if (r->experts[g] >= hp->n_expert) {
            log_error("worker %d asked for expert %u of layer %u (the model has %u)", i,
                      r->experts[g], r->layer, hp->n_expert);
            pd->busy = false;
            return -EPROTO;
        }
        pd->off[g] = pd->rows;
        pd->cnt[g] = r->counts[g];
        pd->who[g] = c->home[r->layer][r->experts[g]];
        pd->rows += r->counts[g];
        if (pd->rows > c->cfg.max_batch * hp->n_expert_used) {
            log_error("worker %d sent an expert request of more than %u rows (batch %u x top %u)",
                      i, c->cfg.max_batch * hp->n_expert_used, c->cfg.max_batch,
                      hp->n_expert_used);
            pd->busy = false;
            return -EPROTO;
        }
    }
    for (int h = 0; h < c->n; h++) { /* the holders first: they compute while the pool does */
        uint32_t rows, n = cl_gather(c, pd, m->tensor, h, &rows);
        if (!n)
            continue;
        for (uint32_t g = 0, k = 0; g < pd->n_groups; g++)
            if (pd->who[g] == h)
                c->gx[k++] = r->experts[g];
        struct wire_msg o = {.type = WIRE_TYPE_EXPERT_REQUEST};
        o.expert_request = (struct wire_expert_request){
            .step = r->step, .layer = r->layer, .experts = c->gx, .counts = c->gc,
            .n_experts = n, .n_embd = hp->n_embd, .tag = ++c->next_tag};
        o.tensor = c->gather;
        o.tensor_bytes = (size_t)rows * hp->n_embd * sizeof(float);
        int rc = cl_send(c, h, &o);
        if (rc) {
            log_error("cannot forward worker %d's experts of layer %u to worker %d: %s", i,
                      r->layer, h, strerror(-rc));
            return rc;
        }
        pd->tag[h] = c->next_tag;
        pd->part_rows[h] = rows;
        pd->n_wait++;
        c->w[h].served_req++;
        c->w[h].served_rows += rows;
    }
    uint32_t rows, n = cl_gather(c, pd, m->tensor, -1, &rows);
    if (n) {
        for (uint32_t g = 0, k = 0; g < pd->n_groups; g++)
            if (pd->who[g] < 0)
                c->gx[k++] = r->experts[g];
        int rc = expert_pool_run(c->pool, r->layer, c->gx, c->gc, n, c->gather, c->reply);
        if (rc)
            return rc;
        cl_scatter(c, pd, c->reply, -1);
    }
    return pd->n_wait ? 0 : cl_pending_finish(c, i);
}

/* Worker h's answer to a forwarded request: its rows go into the pending assembly. */
static int cl_expert_reply(struct cluster *c, int h, const struct wire_msg *m)
{
    const struct wire_expert_reply *r = &m->expert_reply;
    for (int i = 0; r->tag && c->home && i < c->n; i++) {
        struct cl_pending *pd = &c->pend[i];
        if (!pd->busy || pd->tag[h] != r->tag)
            continue;
        if (r->step != pd->step || r->layer != pd->layer || r->n_rows != pd->part_rows[h] ||
            r->n_embd != c->cfg.model->hp.n_embd) {
            log_error("worker %d answered forwarded request %llu with step %llu, layer %u, %u "
                      "rows of width %u; expected step %llu, layer %u, %u rows", h,
                      (unsigned long long)r->tag, (unsigned long long)r->step, r->layer,
                      r->n_rows, r->n_embd, (unsigned long long)pd->step, pd->layer,
                      pd->part_rows[h]);
            return -EPROTO;
        }
        cl_scatter(c, pd, m->tensor, h);
        pd->tag[h] = 0;
        return --pd->n_wait ? 0 : cl_pending_finish(c, i);
    }
    log_warn("dropping an expert reply from worker %d (tag %llu) that answers no forwarded "
             "request", h, (unsigned long long)r->tag);
    return 0;
}

/* A forwarded request not answered within hang_timeout: names the worker. */
static int cl_check_pending(struct cluster *c, double now)
{
    for (int i = 0; c->home && i < c->n; i++) {
        const struct cl_pending *pd = &c->pend[i];
        if (!pd->busy || now - pd->t_sent <= c->cfg.hang_timeout_s)
            continue;
        for (int h = 0; h < c->n; h++) {
            if (!pd->tag[h])
                continue;
            c->w[h].failed = true;
            log_error("worker %d did not answer the forwarded expert request %llu (experts of "
                      "layer %u for worker %d, step %llu) within %.1f s", h,
                      (unsigned long long)pd->tag[h], pd->layer, i,
                      (unsigned long long)pd->step, now - pd->t_sent);
            return -ETIMEDOUT;
        }
    }
    return 0;
}

static int cl_expert_request(struct cluster *c, int i, const struct wire_msg *m)
{
    const struct wire_expert_request *r = &m->expert_request;
    const struct cluster_worker *w = &c->w[i];
    const struct arch_hparams *hp = &c->cfg.model->hp;
    uint64_t rows = m->tensor_bytes / (hp->n_embd * sizeof(float));
    bool in_flight = false; /* any sequence's step: the request carries all it needs */
    for (uint32_t s = 0; s < c->n_seq; s++)
        in_flight |= c->fl[s].busy && c->fl[s].step == r->step;
    if (r->layer < w->l0 || r->layer >= w->l1 || r->n_embd != hp->n_embd || !in_flight) {
        log_error("worker %d sent an expert request for layer %u, step %llu, width %u; "
                  "expected its layers %u-%u, a step in flight (%u, the last %llu), width %u",
                  i, r->layer, (unsigned long long)r->step, r->n_embd, w->l0, w->l1 - 1,
                  c->n_flight, (unsigned long long)c->step, hp->n_embd);
        return -EPROTO;
    }
    if (r->tag) {
        log_error("worker %d sent an expert request with tag %llu: only the coordinator tags "
                  "(forwarded requests)", i, (unsigned long long)r->tag);
        return -EPROTO;
    }
    bool split = false;
    for (size_t g = 0; c->home && g < r->n_experts; g++)
        split |= r->experts[g] < hp->n_expert && c->home[r->layer][r->experts[g]] >= 0;
    if (split)
        return cl_expert_split(c, i, m);
    int rc = expert_pool_run(c->pool, r->layer, r->experts, r->counts, (uint32_t)r->n_experts,
                             m->tensor, c->reply);
    if (rc)
        return rc;
    struct wire_msg o = {.type = WIRE_TYPE_EXPERT_REPLY};
    o.expert_reply = (struct wire_expert_reply){.step = r->step, .layer = r->layer,
                                                .n_rows = (uint32_t)rows, .n_embd = hp->n_embd};
    o.tensor = c->reply;
    o.tensor_bytes = m->tensor_bytes;
    return cl_send(c, i, &o);
}

/* What one received message means for the step in flight. */
enum cl_event { CL_NONE, CL_RESULT, CL_FAIL };

/* A result of the last worker for sequence *seq's step in flight: stored in its slot. */
static enum cl_event cl_result(struct cluster *c, int i, const struct wire_msg *m,
                               uint32_t *seq)
{
    const struct wire_result *r = &m->result;
    struct cl_flight *f = r->seq_id < c->n_seq ? &c->fl[r->seq_id] : NULL;
    /* a token for a sampling step (wire.c checked it is below n_vocab), else logits */
    if (i != c->n - 1 || !f || !f->busy || r->step != f->step ||
        r->n_vocab != c->cfg.model->hp.n_vocab ||
        (!f->want_rows ? r->token < 0 || m->tensor : r->n_rows != f->want_rows || !m->tensor)) {
        log_warn("dropping a result from worker %d for sequence %llu, step %llu, that matches "
                 "no step in flight", i, (unsigned long long)r->seq_id,
                 (unsigned long long)r->step);
        return CL_NONE;
    }
    if (f->want_rows)
        memcpy(f->logits, m->tensor, m->tensor_bytes);
    else
        f->token = r->token;
    *seq = (uint32_t)r->seq_id;
    return CL_RESULT;
}

static enum cl_event cl_handle(struct cluster *c, const char *id, size_t id_len,
                               struct wire_msg *m, uint32_t *seq, int *rc)
{
    bool wd = false;
    int i = cl_worker_of(c, id, id_len, &wd);
    if (i < 0) {
        log_warn("dropping a %s message from an unknown peer", wire_msg_type_name(m->type));
        return CL_NONE;
    }
    struct cluster_worker *w = &c->w[i];
    w->last_heartbeat = cl_now();
    switch (m->type) {
    case WIRE_TYPE_HEARTBEAT:
        if (m->heartbeat.step != w->progress) {
            w->progress = m->heartbeat.step;
            w->progress_time = cl_now();
        }
        return CL_NONE;
    case WIRE_TYPE_TIMING:
        cl_timing(c, i, m->timing.json);
        return CL_NONE;
    case WIRE_TYPE_EXPERT_REQUEST:
        *rc = cl_expert_request(c, i, m);
        return *rc ? CL_FAIL : CL_NONE;
    case WIRE_TYPE_EXPERT_REPLY: /* a worker's answer to a forwarded request */
        *rc = cl_expert_reply(c, i, m);
        return *rc ? CL_FAIL : CL_NONE;
    case WIRE_TYPE_ERROR:
        w->reported_error = true;
        log_error("worker %d failed in step %llu: %s", i, (unsigned long long)m->error.step,
                  m->error.message);
        *rc = -EIO;
        return CL_FAIL;
    case WIRE_TYPE_RESULT:
        return cl_result(c, i, m, seq);
    default:
        log_warn("dropping an unexpected %s message from worker %d", wire_msg_type_name(m->type),
                 i);
        return CL_NONE;
    }
}

/* Waits up to CLUSTER_POLL_MS for one message from the workers and handles it (cl_handle):
 * CL_NONE also when none came or a malformed one was dropped; CL_FAIL with *rc the error of
 * the receive or of the handling. */
static enum cl_event cl_serve_one(struct cluster *c, uint32_t *seq, int *rc)
{
    char id[WIRE_ID_MAX];
    size_t id_len = sizeof(id);
    struct wire_msg r;
    *rc = wire_recv(c->router, &r, id, &id_len, CLUSTER_POLL_MS);
    if (*rc == -ETIMEDOUT || *rc == -EPROTO || *rc == -EINTR) {
        *rc = 0;
        return CL_NONE;
    }
    if (*rc)
        return CL_FAIL;
    const enum cl_event ev = cl_handle(c, id, id_len, &r, seq, rc);
    wire_msg_free(&r);
    return ev;
}

/* A worker sends its timing line of a step after handing the step on, so the last
 * worker's result can reach us before the earlier workers' lines of the same step: waits
 * (bounded) until every live worker's lines of the steps that came back have arrived, with
 * nothing in flight and no worker failed or in error; other messages (heartbeats) are handled
 * as usual. */
static void cl_settle_timings(struct cluster *c)
{
    if (c->n_flight || !c->router)
        return;
    const double deadline = cl_now() + CLUSTER_TIMING_WAIT_S;
    for (;;) {
        int owed = -1;
        for (int i = 0; i < c->n && owed < 0; i++)
            if (c->w[i].failed || c->w[i].exited || c->w[i].reported_error)
                return;
            else if (c->w[i].steps < c->results)
                owed = i;
        if (owed < 0)
            return;
        if (cl_now() > deadline) {
            log_warn("worker %d's timing lines of %llu of %llu steps did not arrive", owed,
                     (unsigned long long)(c->results - c->w[owed].steps),
                     (unsigned long long)c->results);
            return;
        }
        uint32_t seq;
        int rc;
        if (cl_serve_one(c, &seq, &rc) == CL_FAIL)
            return;
    }
}

/* Checks for dead or silent workers during a step; logs and returns an errno. */
static int cl_check_alive(struct cluster *c)
{
    int dead = cl_reap(c);
    if (dead >= 0) {
        char how[96];
        cl_describe_exit(&c->w[dead], how, sizeof(how));
        log_error("worker %d (pid %d, layers %u-%u) %s during step %llu", dead,
                  (int)c->w[dead].pid, c->w[dead].l0, c->w[dead].l1 - 1, how,
                  (unsigned long long)c->step);
        return -ECONNRESET;
    }
    const double now = cl_now();
    int rc = cl_check_pending(c, now);
    if (rc)
        return rc;
    for (int i = 0; i < c->n; i++) {
        const struct cluster_worker *w = &c->w[i];
        if (w->exited)
            continue;
        if (now - w->last_heartbeat > CLUSTER_DEAD_S) {
            c->w[i].failed = true;
            log_error("worker %d (%s %d) stopped answering: no heartbeat for %.1f s in step %llu",
                      i, w->pid ? "pid" : "started by hand, index", w->pid ? (int)w->pid : i,
                      now - w->last_heartbeat, (unsigned long long)c->step);
            return -ETIMEDOUT;
        }
        if (now - w->progress_time > c->cfg.hang_timeout_s) {
            c->w[i].failed = true;
            log_error("worker %d (%s %d) is stuck: no layer finished for %.1f s in step %llu",
                      i, w->pid ? "pid" : "started by hand, index", w->pid ? (int)w->pid : i,
                      now - w->progress_time, (unsigned long long)c->step);
            return -ETIMEDOUT;
        }
    }
    return c->interrupted ? -EINTR : 0;
}

/* The coordinator's timing line of a step that came back: wall time from its send, CPU pool
 * busy time since the previous result (with several steps in flight, for all of them), and
 * the rest (waiting for workers). */
static void cl_coordinator_timing(struct cluster *c, uint32_t seq, double now)
{
    const struct cl_flight *f = &c->fl[seq];
    const double busy = expert_pool_busy_s(c->pool);
    const double pool_s = busy - c->pool_busy_prev, step_s = now - f->t_start;
    c->pool_busy_prev = busy;
    if (!c->timings)
        return;
    fprintf(c->timings,
            "{\"coordinator\":true,\"step\":%llu,\"seq\":%u,\"tokens\":%u,\"ms\":{\"step\":%.3f,"
            "\"cpu_pool_busy\":%.3f,\"queue_wait\":%.3f}}\n",
            (unsigned long long)f->step, seq, f->n, 1e3 * step_s, 1e3 * pool_s,
            1e3 * (step_s > pool_s ? step_s - pool_s : 0.0));
}

/* A worker's connection vanished: wait briefly for its exit to name it. */
static int cl_wait_exit(struct cluster *c)
{
    for (int k = 0; k < 50; k++) {
        int rc = cl_check_alive(c);
        if (rc)
            return rc;
        struct timespec ts = {0, 10000000};
        nanosleep(&ts, NULL);
    }
    log_error("a worker's connection closed during step %llu", (unsigned long long)c->step);
    return -ECONNRESET;
}

/* Sends sequence seq's next step (cluster_submit). */
static int cl_submit(struct cluster *c, uint32_t seq, const float *h, uint32_t n, uint32_t pos,
                     bool all_logits, const struct cluster_sample *smp, float *logits)
{
    const struct arch_hparams *hp = &c->cfg.model->hp;
    if (n == 0 || n > c->cfg.max_batch)
        return -EINVAL;
    if (seq >= c->n_seq) {
        log_error("sequence %u refused: the cluster has %u sequence slot%s (0-%u)", seq, c->n_seq,
                  c->n_seq == 1 ? "" : "s", c->n_seq - 1);
        return -EINVAL;
    }
    ASSERT(!c->fl[seq].busy); /* a sequence's next step needs its previous result */
    c->step++;
    const double now = cl_now();
    for (int i = 0; i < c->n; i++) /* silence between steps is not a failure */
        c->w[i].progress_time = c->w[i].last_heartbeat = now;
    struct wire_msg m = {.type = WIRE_TYPE_STEP};
    m.step = (struct wire_step){.seq_id = seq, .pos = pos, .n_tokens = n, .step = c->step,
                                .all_logits = all_logits, .n_embd = hp->n_embd};
    if (smp) {
        ASSERT(!all_logits && smp->n_window <= CLUSTER_WINDOW_MAX);
        const struct sampler_config *sc = &smp->cfg;
        m.step.sample = true;
        m.step.temperature = sc->temperature;
        m.step.top_k = sc->top_k;
        m.step.top_p = sc->top_p;
        m.step.min_p = sc->min_p;
        m.step.repeat_penalty = sc->repeat_penalty;
        m.step.presence_penalty = sc->presence_penalty;
        m.step.uniform = smp->uniform;
        m.step.window = smp->window;
        m.step.n_window = smp->n_window;
    } else {
        ASSERT(logits);
    }
    m.tensor = h;
    m.tensor_bytes = (size_t)n * hp->n_embd * sizeof(float);
    int rc = cl_send(c, 0, &m);
    if (rc) {
        log_error("cannot send step %llu to worker 0: %s", (unsigned long long)c->step,
                  strerror(-rc));
        return rc;
    }
    c->fl[seq] = (struct cl_flight){.busy = true, .step = c->step, .n = n,
                                    .want_rows = smp ? 0 : all_logits ? n : 1,
                                    .logits = logits, .token = -1, .t_start = cl_now()};
    c->n_flight++;
    return 0;
}

/* Serves the workers (expert requests, timings, heartbeats) until a step in flight comes
 * back; *seq gets its sequence. */
static int cl_wait(struct cluster *c, uint32_t *seq)
{
    if (!c->n_flight) {
        log_error("no step in flight to wait for");
        return -EINVAL;
    }
    for (;;) {
        int rc = cl_check_alive(c);
        if (rc)
            return rc;
        const enum cl_event ev = cl_serve_one(c, seq, &rc);
        if (ev == CL_RESULT) {
            c->results++;
            cl_coordinator_timing(c, *seq, cl_now());
            c->fl[*seq].busy = false;
            c->n_flight--;
            return 0;
        }
        if (ev == CL_FAIL && rc == -EHOSTUNREACH) /* its connection is gone: name how it ended */
            return cl_wait_exit(c);
        if (ev == CL_FAIL)
            return rc;
    }
}

/* One step of sequence 0 with nothing else in flight: submit, then wait for it. */
static int cl_step(struct cluster *c, const float *h, uint32_t n, uint32_t pos, bool all_logits,
                   const struct cluster_sample *smp, float *logits, int32_t *token)
{
    ASSERT(c->n_flight == 0);
    uint32_t seq;
    int rc = cl_submit(c, 0, h, n, pos, all_logits, smp, logits);
    rc = rc ? rc : cl_wait(c, &seq);
    if (!rc && token)
        *token = c->fl[0].token;
    return rc;
}

int cluster_step(struct cluster *c, const float *h, uint32_t n, uint32_t pos, bool all_logits,
                 float *logits)
{
    return cl_step(c, h, n, pos, all_logits, NULL, logits, NULL);
}

int cluster_step_sample(struct cluster *c, const float *h, uint32_t n, uint32_t pos,
                        const struct cluster_sample *smp, int32_t *token)
{
    ASSERT(token);
    return cl_step(c, h, n, pos, false, smp, NULL, token);
}

int cluster_submit(struct cluster *c, uint32_t seq, const float *h, uint32_t n, uint32_t pos,
                   bool all_logits, const struct cluster_sample *smp, float *logits)
{
    if (seq < c->n_seq && c->fl[seq].busy) {
        log_error("sequence %u already has step %llu in flight", seq,
                  (unsigned long long)c->fl[seq].step);
        return -EBUSY;
    }
    return cl_submit(c, seq, h, n, pos, all_logits, smp, logits);
}

int cluster_wait(struct cluster *c, uint32_t *seq, int32_t *token)
{
    int rc = cl_wait(c, seq);
    if (!rc && token)
        *token = c->fl[*seq].token;
    return rc;
}

uint32_t cluster_in_flight(const struct cluster *c)
{
    return c->n_flight;
}

uint32_t cluster_n_seq(const struct cluster *c)
{
    return c->n_seq;
}

/* To worker 0 only: each worker passes the reset on to the next in order
 * with its hand-offs (worker/main.c), so no worker sees it out of order with
 * the steps. */
int cluster_reset(struct cluster *c)
{
    struct wire_msg m = {.type = WIRE_TYPE_RESET};
    return cl_send(c, 0, &m);
}

/* Sends worker i a State message m and serves the workers until its State answer of op
 * `want` for the same slot and its own range comes, into *r (the caller frees it). */
static int cl_state_exchange(struct cluster *c, int i, struct wire_msg *m, uint32_t want,
                             struct wire_msg *r)
{
    const struct cluster_worker *w = &c->w[i];
    const double now = cl_now();
    for (int k = 0; k < c->n; k++) /* silence before the request is not a failure */
        c->w[k].progress_time = c->w[k].last_heartbeat = now;
    int rc = cl_send(c, i, m);
    if (rc) {
        log_error("cannot send a sequence snapshot message to worker %d: %s", i, strerror(-rc));
        return rc;
    }
    for (;;) {
        rc = cl_check_alive(c);
        if (rc)
            return rc;
        char id[WIRE_ID_MAX];
        size_t id_len = sizeof(id);
        rc = wire_recv(c->router, r, id, &id_len, CLUSTER_POLL_MS);
        if (rc == -ETIMEDOUT || rc == -EPROTO || rc == -EINTR)
            continue;
        if (rc)
            return rc;
        bool wd = false;
        if (r->type == WIRE_TYPE_STATE && cl_worker_of(c, id, id_len, &wd) == i && !wd) {
            c->w[i].last_heartbeat = cl_now();
            if (r->state.op == want && r->state.seq_id == m->state.seq_id &&
                r->state.layer_begin == w->l0 && r->state.layer_end == w->l1)
                return 0;
            log_error("worker %d answered a sequence snapshot message with op %u for sequence "
                      "%llu, layers %u-%u (wanted op %u for %llu, layers %u-%u)", i,
                      r->state.op, (unsigned long long)r->state.seq_id, r->state.layer_begin,
                      r->state.layer_end - 1, want, (unsigned long long)m->state.seq_id, w->l0,
                      w->l1 - 1);
            wire_msg_free(r);
            return -EPROTO;
        }
        uint32_t seq;
        enum cl_event ev = cl_handle(c, id, id_len, r, &seq, &rc);
        wire_msg_free(r);
        if (ev == CL_FAIL && rc == -EHOSTUNREACH)
            return cl_wait_exit(c);
        if (ev == CL_FAIL)
            return rc;
    }
}

static int cl_state_check(const struct cluster *c, uint32_t seq)
{
    if (seq >= c->n_seq) {
        log_error("sequence %u refused: the cluster has %u sequence slot%s", seq, c->n_seq,
                  c->n_seq == 1 ? "" : "s");
        return -EINVAL;
    }
    if (c->n_flight) {
        log_error("a sequence snapshot needs the workers idle: %u steps are in flight",
                  c->n_flight);
        return -EBUSY;
    }
    return 0;
}

int cluster_state_save(struct cluster *c, uint32_t seq, void **blob, size_t *bytes,
                       uint32_t *pos)
{
    int rc = cl_state_check(c, seq);
    if (rc)
        return rc;
    uint8_t *out = NULL;
    size_t len = 0;
    for (int i = 0; i < c->n && !rc; i++) {
        struct wire_msg m = {.type = WIRE_TYPE_STATE}, r;
        m.state = (struct wire_state){.seq_id = seq, .op = WIRE_STATE_SAVE};
        rc = cl_state_exchange(c, i, &m, WIRE_STATE_SNAPSHOT, &r);
        if (rc)
            break;
        const struct wire_state *st = &r.state;
        const size_t want = forward_state_bytes(c->cfg.model, st->layer_begin, st->layer_end,
                                                st->pos, c->cfg.kv_f16);
        if ((i && st->pos != *pos) || st->bytes != want) {
            log_error("worker %d sent a snapshot of %llu bytes at %u tokens (layers %u-%u at "
                      "that position take %zu; worker 0 was at %u)", i,
                      (unsigned long long)st->bytes, st->pos, c->w[i].l0, c->w[i].l1 - 1, want,
                      i ? *pos : st->pos);
            rc = -EPROTO;
        }
        uint8_t *grown = rc ? NULL : realloc(out, len + st->bytes + 1);
        if (!rc && !grown)
            rc = -ENOMEM;
        if (!rc) {
            out = grown;
            memcpy(out + len, r.tensor, st->bytes);
            len += st->bytes;
            *pos = st->pos;
        }
        wire_msg_free(&r);
    }
    if (rc) {
        free(out);
        return rc;
    }
    *blob = out, *bytes = len;
    return 0;
}

int cluster_state_load(struct cluster *c, uint32_t seq, const void *blob, size_t bytes,
                       uint32_t pos)
{
    int rc = cl_state_check(c, seq);
    if (rc)
        return rc;
    const size_t total = forward_state_bytes(c->cfg.model, 0, c->cfg.model->hp.n_layer, pos,
                                             c->cfg.kv_f16);
    if (bytes != total || pos > c->cfg.n_ctx) {
        log_error("sequence snapshot refused: %zu bytes at %u tokens (the model's layers take "
                  "%zu there; the context holds %u)", bytes, pos, total, c->cfg.n_ctx);
        return -EINVAL;
    }
    size_t off = 0;
    for (int i = 0; i < c->n && !rc; i++) {
        const struct cluster_worker *w = &c->w[i];
        const size_t part = forward_state_bytes(c->cfg.model, w->l0, w->l1, pos, c->cfg.kv_f16);
        struct wire_msg m = {.type = WIRE_TYPE_STATE}, r;
        m.state = (struct wire_state){.seq_id = seq, .op = WIRE_STATE_SNAPSHOT, .pos = pos,
                                      .layer_begin = w->l0, .layer_end = w->l1,
                                      .bytes = part};
        m.tensor = (const uint8_t *)blob + off, m.tensor_bytes = part;
        rc = cl_state_exchange(c, i, &m, WIRE_STATE_LOADED, &r);
        if (!rc) {
            if (r.state.pos != pos) {
                log_error("worker %d loaded a snapshot at %u tokens, not %u", i, r.state.pos,
                          pos);
                rc = -EPROTO;
            }
            wire_msg_free(&r);
        }
        off += part;
    }
    return rc;
}

/* ---- start-up ---- */

/* Waits until pred holds for every worker, handling hello/ready/errors. */
static int cl_wait_all(struct cluster *c, bool ready, double timeout_s)
{
    const double deadline = cl_now() + timeout_s;
    for (;;) {
        int done = 0;
        for (int i = 0; i < c->n; i++)
            done += ready ? c->w[i].ready : c->w[i].hello;
        if (done == c->n)
            return 0;
        int dead = cl_reap(c);
        if (dead >= 0) {
            char how[96];
            cl_describe_exit(&c->w[dead], how, sizeof(how));
            log_error("worker %d (pid %d) %s while %s", dead, (int)c->w[dead].pid, how,
                      ready ? "loading" : "starting");
            return -ECONNRESET;
        }
        if (cl_now() > deadline || c->interrupted) {
            log_error("%s: %d of %d workers %s after %.0f s",
                      c->interrupted ? "interrupted" : "timed out", done, c->n,
                      ready ? "ready" : "connected", timeout_s);
            return c->interrupted ? -EINTR : -ETIMEDOUT;
        }
        char id[WIRE_ID_MAX];
        size_t id_len = sizeof(id);
        struct wire_msg m;
        int rc = wire_recv(c->router, &m, id, &id_len, 100);
        if (rc)
            continue;
        bool wd;
        int i = cl_worker_of(c, id, id_len, &wd);
        if (i >= 0 && !wd && m.type == WIRE_TYPE_HELLO && m.hello.worker_index == (uint32_t)i &&
            (!c->w[i].pid || m.hello.pid == (uint32_t)c->w[i].pid)) {
            c->w[i].hello = true;
            c->w[i].has_key = m.hello.has_curve_key;
            memcpy(c->w[i].key, m.hello.curve_public_key, WIRE_KEY_BYTES);
        }
        else if (i >= 0 && !wd && m.type == WIRE_TYPE_READY) {
            c->w[i].ready = true;
            c->w[i].resident = m.ready.resident_experts;
            c->w[i].mem_used = m.ready.device_mem_used;
        } else if (i >= 0 && m.type == WIRE_TYPE_ERROR) {
            log_error("worker %d failed to start: %s", i, m.error.message);
            wire_msg_free(&m);
            return -EIO;
        }
        wire_msg_free(&m);
    }
}

static int cl_send_plan(struct cluster *c, int i)
{
    const struct arch_model *m = c->cfg.model;
    struct cluster_worker *w = &c->w[i];
    const uint32_t nl = w->l1 - w->l0;
    struct wire_layer_residency *res = calloc(nl, sizeof(*res));
    if (!res)
        return -ENOMEM;
    for (uint32_t l = 0; l < nl; l++)
        res[l] = (struct wire_layer_residency){.layer = w->l0 + l, .bitmap = w->bitmaps[l],
                                               .bitmap_bytes = (m->hp.n_expert + 7) / 8,
                                               .trunk = w->trunk[l], .shexp = w->shexp[l]};
    struct wire_layer_residency *fr = calloc(m->hp.n_layer, sizeof(*fr));
    size_t nf = 0;
    if (!fr) {
        free(res);
        return -ENOMEM;
    }
    for (uint32_t l = 0; w->foreign && l < m->hp.n_layer; l++)
        if (w->foreign[l])
            fr[nf++] = (struct wire_layer_residency){.layer = l, .bitmap = w->foreign[l],
                                                     .bitmap_bytes = (m->hp.n_expert + 7) / 8};
    int threads = c->cfg.worker_threads;
    if (threads <= 0) {
        threads = threadpool_physical_cores() / c->n;
        threads = threads < 1 ? 1 : threads;
    }
    struct wire_msg msg = {.type = WIRE_TYPE_LOAD_PLAN};
    msg.load_plan = (struct wire_load_plan){
        .model_path = c->cfg.model_path, .shm_name = shm_name(c->shm),
        .shm_bytes = shm_bytes(c->shm), .layer_begin = w->l0, .layer_end = w->l1,
        .n_layers_total = m->hp.n_layer, .residency = res, .n_residency = nl,
        .foreign = fr, .n_foreign = nf,
        .backend = c->cfg.backends[i] ? c->cfg.backends[i] : "cpu",
        .device_mem_budget = c->cfg.device_mem[i], .n_ctx = c->cfg.n_ctx,
        .kv_f16 = c->cfg.kv_f16, .max_batch = c->cfg.max_batch, .n_seq = c->n_seq,
        .n_threads = (uint32_t)threads,
        .next_endpoint = i + 1 < c->n ? c->data_ep[i + 1] : "",
        .listen_endpoint = i > 0 ? c->data_ep[i] : "", .is_last = i == c->n - 1,
        .n_embd = m->hp.n_embd, .n_vocab = m->hp.n_vocab, .lmhead = w->lmhead};
    if (i + 1 < c->n && c->w[i + 1].has_key) {
        msg.load_plan.has_next_key = true;
        memcpy(msg.load_plan.next_server_key, c->w[i + 1].key, WIRE_KEY_BYTES);
    }
    if (i > 0 && c->w[i - 1].nccl_next) {
        msg.load_plan.has_nccl_prev = true;
        memcpy(msg.load_plan.nccl_prev_id, c->w[i - 1].nccl_next_id, WIRE_NCCL_ID_BYTES);
    }
    if (w->nccl_next) {
        msg.load_plan.has_nccl_next = true;
        memcpy(msg.load_plan.nccl_next_id, w->nccl_next_id, WIRE_NCCL_ID_BYTES);
    }
    int rc = cl_send(c, i, &msg);
    free(res);
    free(fr);
    return rc;
}

static int cl_data_endpoints(struct cluster *c)
{
    for (int i = 1; i < c->n; i++) {
        if (c->cfg.listen) {
            /* tcp: worker i listens next to the coordinator's port */
            const char *colon = strrchr(c->endpoint, ':');
            int port = colon ? atoi(colon + 1) : 0;
            snprintf(c->data_ep[i], sizeof(c->data_ep[i]), "%.*s:%d",
                     (int)(colon ? colon - c->endpoint : 0), c->endpoint, port + i);
            continue;
        }
        char name[16];
        snprintf(name, sizeof(name), "data%d", i);
        int rc = wire_endpoint_ipc(c->data_ep[i], sizeof(c->data_ep[i]), c->rundir, name);
        if (rc)
            return rc;
    }
    return 0;
}

static int cl_start(struct cluster *c)
{
    int rc = cl_handoff_plan(c);
    if (rc)
        return rc;
    const bool any = c->cfg.experts_home && !strcmp(c->cfg.experts_home, "any");
    if (any && !cl_use_planner(c)) {
        log_error("--experts-home any needs a placement plan: give every worker a --device-mem "
                  "budget (or --place), without --resident");
        return -EINVAL;
    }
    if (cl_use_planner(c)) {
        rc = cl_plan(c);
    } else {
        rc = c->cfg.layers && strcmp(c->cfg.layers, "auto") ? cl_split_list(c, c->cfg.layers)
                                                           : cl_split_auto(c);
        rc = rc ? rc : cl_plan_residency(c);
        rc = rc ? rc : cl_trunk_all(c);
    }
    rc = rc ? rc : cl_setup_shm(c);
    rc = rc ? rc : cl_setup_router(c);
    rc = rc ? rc : cl_data_endpoints(c);
    for (int i = 0; i < c->n && !rc && c->cfg.spawn; i++)
        rc = cl_spawn(c, i);
    rc = rc ? rc : cl_wait_all(c, false, c->cfg.spawn ? CLUSTER_HELLO_TIMEOUT_S : 3600);
    rc = rc ? rc : cl_handoff_ids(c);
    for (int i = 0; i < c->n && !rc; i++)
        rc = cl_send_plan(c, i);
    rc = rc ? rc : cl_wait_all(c, true, CLUSTER_READY_TIMEOUT_S);
    const double now = cl_now();
    for (int i = 0; i < c->n; i++)
        c->w[i].last_heartbeat = c->w[i].progress_time = now;
    if (!rc && c->cfg.timings_path) {
        c->timings = fopen(c->cfg.timings_path, "w");
        if (!c->timings) {
            log_error("cannot write timings to %s: %s", c->cfg.timings_path, strerror(errno));
            rc = -errno;
        }
    }
    return rc;
}

struct cluster *cluster_create(const struct cluster_config *cfg)
{
    if (cfg->n_workers < 1 || cfg->n_workers > CLUSTER_MAX_WORKERS || cfg->max_batch == 0 ||
        cfg->n_seq > CLUSTER_SEQ_MAX) {
        log_error("bad cluster config: %d workers, batch %u, %u sequences (at most %d)",
                  cfg->n_workers, cfg->max_batch, cfg->n_seq, CLUSTER_SEQ_MAX);
        return NULL;
    }
    struct cluster *c = calloc(1, sizeof(*c));
    if (!c)
        return NULL;
    c->cfg = *cfg;
    if (c->cfg.hang_timeout_s <= 0)
        c->cfg.hang_timeout_s = 30;
    c->n = cfg->n_workers;
    c->n_seq = cfg->n_seq ? cfg->n_seq : 1;
    for (int i = 0; i < c->n; i++)
        c->w[i].index = i;
    if (cl_start(c)) {
        cluster_destroy(c);
        return NULL;
    }
    return c;
}

/* Asks every live worker to stop, waits a bounded time, then kills. */
static void cl_stop_workers(struct cluster *c)
{
    for (int i = 0; i < c->n; i++) {
        struct cluster_worker *w = &c->w[i];
        if (w->failed && w->pid && !w->exited) {
            kill(w->pid, SIGKILL);
            waitpid(w->pid, &w->status, 0);
            w->exited = true;
        }
    }
    bool exiting = false; /* a worker that reported an error may be ending on its own */
    for (int i = 0; i < c->n; i++)
        exiting |= c->w[i].reported_error && !c->w[i].exited;
    struct timespec settle = {0, 20000000}; /* let it be reaped first */
    if (exiting)
        nanosleep(&settle, NULL);
    while (cl_reap(c) >= 0)
        ;
    for (int i = 0; i < c->n && c->router; i++) {
        if (c->w[i].exited || !c->w[i].hello)
            continue;
        struct wire_msg m = {.type = WIRE_TYPE_SHUTDOWN};
        cl_send(c, i, &m);
    }
    const double deadline = cl_now() + CLUSTER_SHUTDOWN_WAIT_S;
    for (;;) {
        cl_reap(c);
        int alive = 0;
        for (int i = 0; i < c->n; i++)
            alive += c->w[i].pid && !c->w[i].exited;
        if (!alive || cl_now() > deadline)
            break;
        struct timespec ts = {0, 10000000};
        nanosleep(&ts, NULL);
    }
    for (int i = 0; i < c->n; i++) {
        struct cluster_worker *w = &c->w[i];
        if (!w->pid || w->exited)
            continue;
        log_warn("worker %d (pid %d) did not stop: killing it", i, (int)w->pid);
        kill(w->pid, SIGKILL);
        waitpid(w->pid, &w->status, 0);
        w->exited = true;
    }
}

void cluster_destroy(struct cluster *c)
{
    if (!c)
        return;
    for (int i = 0; c->home && i < c->n; i++)
        if (c->w[i].served_req)
            log_info("worker %d served %llu forwarded expert requests (%llu rows) for other "
                     "workers", i, (unsigned long long)c->w[i].served_req,
                     (unsigned long long)c->w[i].served_rows);
    cl_settle_timings(c);
    cl_stop_workers(c);
    if (c->timings)
        fclose(c->timings);
    wire_socket_destroy(c->router);
    if (c->zctx)
        zmq_ctx_term(c->zctx);
    if (c->rundir[0])
        wire_rundir_remove(c->rundir);
    expert_pool_destroy(c->pool);
    free(c->reply);
    free(c->gather);
    free(c->gx);
    free(c->gc);
    for (int i = 0; i < c->n; i++) {
        free(c->pend[i].off);
        free(c->pend[i].cnt);
        free(c->pend[i].who);
        free(c->pend[i].out);
    }
    for (uint32_t l = 0; c->home && l < c->cfg.model->hp.n_layer; l++)
        free(c->home[l]);
    free(c->home);
    for (uint32_t l = 0; c->refs && l < c->cfg.model->hp.n_layer; l++)
        free(c->refs[l]);
    free(c->refs);
    shm_destroy(c->shm);
    nccl_lib_close(c->nccl);
    for (int i = 0; i < c->n; i++) {
        for (uint32_t l = 0; c->w[i].bitmaps && l < c->w[i].l1 - c->w[i].l0; l++)
            free(c->w[i].bitmaps[l]);
        free(c->w[i].bitmaps);
        for (uint32_t l = 0; c->w[i].foreign && l < c->cfg.model->hp.n_layer; l++)
            free(c->w[i].foreign[l]);
        free(c->w[i].foreign);
        free(c->w[i].trunk);
        free(c->w[i].shexp);
    }
    free(c);
}

void cluster_interrupt(struct cluster *c)
{
    c->interrupted = 1;
}

const char *cluster_shm_name(const struct cluster *c)
{
    return c->shm ? shm_name(c->shm) : NULL;
}
