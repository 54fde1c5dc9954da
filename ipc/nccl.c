/*
 * nccl: NCCL loaded with dlopen, and two-rank non-blocking communicators polled under our own
 * deadlines (see ipc/nccl.h).
 *
 * Types come from the CUDA toolkit's nccl.h when it is installed; otherwise the few used here
 * are declared below as NCCL 2.18 declares them (the library reads a config by its size and
 * version fields, so an older layout is understood by newer libraries). Functions are reached
 * only through the pointers resolved in nccl_lib_open(); nothing links against NCCL.
 */
#include "ipc/nccl.h"

#include <dlfcn.h>
#include <errno.h>
#include <limits.h>
#include <sched.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/log.h"

#ifdef LAMINA_CUDA

#include <cuda_runtime.h>

#if __has_include(<nccl.h>)
#include <nccl.h>
#else
typedef enum {
    ncclSuccess = 0,
    ncclUnhandledCudaError = 1,
    ncclSystemError = 2,
    ncclInternalError = 3,
    ncclInvalidArgument = 4,
    ncclInvalidUsage = 5,
    ncclRemoteError = 6,
    ncclInProgress = 7,
} ncclResult_t;
typedef struct ncclComm *ncclComm_t;
#define NCCL_UNIQUE_ID_BYTES 128
typedef struct {
    char internal[NCCL_UNIQUE_ID_BYTES];
} ncclUniqueId;
typedef enum { ncclInt8 = 0 } ncclDataType_t;
typedef struct {
    size_t size;
    unsigned int magic;
    unsigned int version;
    int blocking;
    int cgaClusterSize;
    int minCTAs;
    int maxCTAs;
    const char *netName;
    int splitShare;
} ncclConfig_t;
#define NCCL_CONFIG_INITIALIZER                                                                    \
    {sizeof(ncclConfig_t), 0xcafebeef, 21800, INT_MIN, INT_MIN, INT_MIN, INT_MIN, NULL, INT_MIN}
#endif

_Static_assert(NCCL_COMM_ID_BYTES == NCCL_UNIQUE_ID_BYTES, "unique id size");
_Static_assert(sizeof(ncclUniqueId) == NCCL_COMM_ID_BYTES, "unique id layout");

#define NC_CUDA_LIB_DIR_PATH "/usr/local/cuda/lib64/libnccl.so.2"
#define NC_FINALIZE_TIMEOUT_S 2.0 /* a healthy finalize takes milliseconds */
#define NC_SPIN_S 1e-3            /* poll with sched_yield this long, then sleep */
#define NC_SLEEP_NS 20000         /* between polls after the spin */

struct nccl_lib {
    void *handle;    /* dlopen handle; never closed (NCCL's threads run its code) */
    char path[256];  /* what was opened */
    int version;     /* NCCL_VERSION_CODE */
    ncclResult_t (*get_version)(int *version);
    ncclResult_t (*get_unique_id)(ncclUniqueId *id);
    ncclResult_t (*comm_init_rank_config)(ncclComm_t *comm, int nranks, ncclUniqueId id,
                                          int rank, ncclConfig_t *config);
    ncclResult_t (*comm_get_async_error)(ncclComm_t comm, ncclResult_t *err);
    ncclResult_t (*comm_finalize)(ncclComm_t comm);
    ncclResult_t (*comm_destroy)(ncclComm_t comm);
    ncclResult_t (*comm_abort)(ncclComm_t comm);
    ncclResult_t (*send)(const void *buf, size_t count, ncclDataType_t type, int peer,
                         ncclComm_t comm, cudaStream_t stream);
    ncclResult_t (*recv)(void *buf, size_t count, ncclDataType_t type, int peer,
                         ncclComm_t comm, cudaStream_t stream);
    ncclResult_t (*group_start)(void);
    ncclResult_t (*group_end)(void);
    const char *(*get_error_string)(ncclResult_t result);
    const char *(*get_last_error)(ncclComm_t comm); /* NULL before NCCL 2.13 */
};

struct nccl_comm {
    const struct nccl_lib *lib; /* borrowed */
    ncclComm_t comm;            /* NCCL's communicator; freed by destroy or abort */
    int rank;                   /* NCCL_COMM_RANK_* */
    char name[64];              /* for messages */
    bool aborted;               /* ncclCommAbort was called: refuse work */
    cudaEvent_t ev[2];          /* recorded around the last send or receive */
    bool timed;                 /* ev hold an operation not read yet */
    double last_ms;             /* GPU time of the last completed operation */
};

static double nc_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

/* Yields for the first NC_SPIN_S of a wait that began at t0, then sleeps briefly. */
static void nc_pause(double t0)
{
    if (nc_now() - t0 < NC_SPIN_S) {
        sched_yield();
        return;
    }
    struct timespec ts = {0, NC_SLEEP_NS};
    nanosleep(&ts, NULL);
}

/* The NCCL_CHECK of style habit 6: ncclInProgress is not an error on a non-blocking
 * communicator (the caller polls). Logs NCCL's message and its last error text. */
static int nc_check(const struct nccl_lib *lib, ncclComm_t comm, ncclResult_t r, const char *what,
                    const char *file, int line)
{
    if (r == ncclSuccess || r == ncclInProgress)
        return 0;
    const char *last = lib->get_last_error ? lib->get_last_error(comm) : NULL;
    if (log_is_enabled(LOG_LEVEL_ERROR))
        log_write(LOG_LEVEL_ERROR, file, line, "%s failed: %s%s%s", what,
                  lib->get_error_string(r), last && *last ? ": " : "", last ? last : "");
    return r == ncclInvalidArgument || r == ncclInvalidUsage ? -EINVAL : -EIO;
}

#define NCCL_CHECK(lib, comm, expr) nc_check((lib), (comm), (expr), #expr, __FILE__, __LINE__)

/* The CUDA check of this file (calls of the CUDA runtime around NCCL's work). */
static int nc_cuda_check(cudaError_t e, const char *what, const char *file, int line)
{
    if (e == cudaSuccess)
        return 0;
    if (log_is_enabled(LOG_LEVEL_ERROR))
        log_write(LOG_LEVEL_ERROR, file, line, "%s failed: %s", what, cudaGetErrorString(e));
    return -EIO;
}

#define CUDA_CHECK(expr) nc_cuda_check((expr), #expr, __FILE__, __LINE__)

/* ---- library ---- */

static void *nc_dlopen(const char *path, bool quiet)
{
    void *h = dlopen(path, RTLD_NOW | RTLD_LOCAL);
    if (!h) {
        const char *why = dlerror();
        if (quiet)
            log_debug("nccl: cannot load %s: %s", path, why ? why : "?");
        else
            log_info("nccl: cannot load %s: %s", path, why ? why : "?");
    }
    return h;
}

/* Resolves name into *slot; false (logged) when it is missing and required. */
static bool nc_sym(struct nccl_lib *lib, void **slot, const char *name, bool required)
{
    *slot = dlsym(lib->handle, name);
    if (!*slot && required)
        log_error("nccl: %s has no symbol %s (NCCL 2.14 or later is needed)", lib->path, name);
    return *slot || !required;
}

static bool nc_resolve(struct nccl_lib *lib)
{
    bool ok = true;
#define NC_SYM(field, name) ok &= nc_sym(lib, (void **)&lib->field, name, true)
    NC_SYM(get_version, "ncclGetVersion");
    NC_SYM(get_unique_id, "ncclGetUniqueId");
    NC_SYM(comm_init_rank_config, "ncclCommInitRankConfig");
    NC_SYM(comm_get_async_error, "ncclCommGetAsyncError");
    NC_SYM(comm_finalize, "ncclCommFinalize");
    NC_SYM(comm_destroy, "ncclCommDestroy");
    NC_SYM(comm_abort, "ncclCommAbort");
    NC_SYM(send, "ncclSend");
    NC_SYM(recv, "ncclRecv");
    NC_SYM(group_start, "ncclGroupStart");
    NC_SYM(group_end, "ncclGroupEnd");
    NC_SYM(get_error_string, "ncclGetErrorString");
#undef NC_SYM
    nc_sym(lib, (void **)&lib->get_last_error, "ncclGetLastError", false);
    return ok;
}

struct nccl_lib *nccl_lib_open(bool quiet)
{
    const char *nvls = getenv("NCCL_NVLS_ENABLE");
    if (nvls && strcmp(nvls, "0"))
        log_warn("nccl: NCCL_NVLS_ENABLE=%s is set; this machine's owners require 0 (NVLink "
                 "multicast off)", nvls);
    setenv("NCCL_NVLS_ENABLE", "0", 0);
    struct nccl_lib *lib = calloc(1, sizeof(*lib));
    if (!lib)
        return NULL;
    const char *env = getenv("LAMINA_NCCL_LIB");
    const char *tried[] = {env && *env ? env : "libnccl.so.2", NC_CUDA_LIB_DIR_PATH};
    const int n_paths = env && *env ? 1 : 2;
    for (int i = 0; i < n_paths && !lib->handle; i++) {
        lib->handle = nc_dlopen(tried[i], quiet);
        snprintf(lib->path, sizeof(lib->path), "%s", tried[i]);
    }
    if (!lib->handle) {
        if (quiet)
            log_info("nccl: libnccl.so.2 not found (tried %s%s%s)", tried[0],
                     n_paths > 1 ? ", " : "", n_paths > 1 ? tried[1] : "");
        else
            log_error("nccl: libnccl.so.2 not found (tried %s%s%s)", tried[0],
                      n_paths > 1 ? ", " : "", n_paths > 1 ? tried[1] : "");
        free(lib);
        return NULL;
    }
    if (!nc_resolve(lib) || NCCL_CHECK(lib, NULL, lib->get_version(&lib->version))) {
        free(lib); /* the library stays mapped: dlclose of NCCL is not safe */
        return NULL;
    }
    log_debug("nccl: loaded %s, version %d", lib->path, lib->version);
    return lib;
}

void nccl_lib_close(struct nccl_lib *lib)
{
    free(lib);
}

int nccl_lib_version(const struct nccl_lib *lib)
{
    return lib->version;
}

int nccl_lib_unique_id(const struct nccl_lib *lib, uint8_t *id)
{
    ncclUniqueId uid;
    int rc = NCCL_CHECK(lib, NULL, lib->get_unique_id(&uid));
    if (!rc)
        memcpy(id, uid.internal, NCCL_COMM_ID_BYTES);
    return rc;
}

/* ---- communicators ---- */

/* Polls until the communicator leaves ncclInProgress. Returns 0 at ncclSuccess; -EIO on an
 * error, -ETIMEDOUT at deadline; both logged with what, and the communicator aborted. */
static int nc_poll(struct nccl_comm *c, double deadline, const char *what)
{
    const double t0 = nc_now();
    for (;;) {
        ncclResult_t st = ncclInProgress;
        int rc = NCCL_CHECK(c->lib, c->comm, c->lib->comm_get_async_error(c->comm, &st));
        if (!rc && st == ncclSuccess)
            return 0;
        if (!rc && st != ncclInProgress) {
            const char *last = c->lib->get_last_error ? c->lib->get_last_error(c->comm) : NULL;
            log_error("nccl %s: %s failed: %s%s%s", c->name, what, c->lib->get_error_string(st),
                      last && *last ? ": " : "", last ? last : "");
            rc = -EIO;
        }
        if (!rc && nc_now() > deadline) {
            log_error("nccl %s: %s still in progress after %.1f s: aborting", c->name, what,
                      nc_now() - t0);
            rc = -ETIMEDOUT;
        }
        if (rc) {
            nccl_comm_abort(c);
            return rc;
        }
        nc_pause(t0);
    }
}

struct nccl_comm *nccl_comm_create(const struct nccl_comm_config *cfg)
{
    if (cfg->rank != NCCL_COMM_RANK_SENDER && cfg->rank != NCCL_COMM_RANK_RECEIVER) {
        log_error("nccl %s: rank %d is neither %d (sender) nor %d (receiver)",
                  cfg->name ? cfg->name : "pair", cfg->rank, NCCL_COMM_RANK_SENDER,
                  NCCL_COMM_RANK_RECEIVER);
        return NULL;
    }
    struct nccl_comm *c = calloc(1, sizeof(*c));
    if (!c)
        return NULL;
    c->lib = cfg->lib;
    c->rank = cfg->rank;
    snprintf(c->name, sizeof(c->name), "%s", cfg->name ? cfg->name : "pair");
    if (CUDA_CHECK(cudaEventCreate(&c->ev[0])) || CUDA_CHECK(cudaEventCreate(&c->ev[1])))
        goto out_free;
    ncclConfig_t config = NCCL_CONFIG_INITIALIZER;
    config.blocking = 0;
    ncclUniqueId uid;
    memcpy(uid.internal, cfg->id, NCCL_COMM_ID_BYTES);
    const double t0 = nc_now();
    if (NCCL_CHECK(c->lib, NULL,
                   c->lib->comm_init_rank_config(&c->comm, 2, uid, c->rank, &config))) {
        if (c->comm)
            c->lib->comm_abort(c->comm);
        goto out_free;
    }
    if (nc_poll(c, t0 + cfg->init_timeout_s, "joining the pair"))
        goto out_free;
    log_info("nccl %s: joined as rank %d in %.0f ms (NCCL %d)", c->name, c->rank,
             1e3 * (nc_now() - t0), c->lib->version);
    return c;
out_free:
    for (int i = 0; i < 2; i++)
        if (c->ev[i])
            cudaEventDestroy(c->ev[i]);
    free(c);
    return NULL;
}

void nccl_comm_destroy(struct nccl_comm *c)
{
    if (!c)
        return;
    if (!c->aborted) {
        const double t0 = nc_now();
        int rc = NCCL_CHECK(c->lib, c->comm, c->lib->comm_finalize(c->comm));
        rc = rc ? rc : nc_poll(c, t0 + NC_FINALIZE_TIMEOUT_S, "finalizing");
        if (rc)
            nccl_comm_abort(c);
        else
            NCCL_CHECK(c->lib, c->comm, c->lib->comm_destroy(c->comm));
    }
    for (int i = 0; i < 2; i++)
        if (c->ev[i])
            cudaEventDestroy(c->ev[i]);
    free(c);
}

/* One send or receive: events around it, ncclGroupStart/End, then the wait until NCCL has
 * enqueued it on the stream (the first one also connects the pair). */
static int nc_enqueue(struct nccl_comm *c, bool send, void *d_buf, size_t bytes, void *stream)
{
    const int want = send ? NCCL_COMM_RANK_SENDER : NCCL_COMM_RANK_RECEIVER;
    if (c->rank != want) {
        log_error("nccl %s: rank %d cannot %s", c->name, c->rank, send ? "send" : "receive");
        return -EINVAL;
    }
    if (c->aborted) {
        log_error("nccl %s: the communicator was aborted after an earlier error", c->name);
        return -EIO;
    }
    cudaStream_t s = (cudaStream_t)stream;
    const int peer = 1 - c->rank;
    int rc = CUDA_CHECK(cudaEventRecord(c->ev[0], s));
    rc = rc ? rc : NCCL_CHECK(c->lib, c->comm, c->lib->group_start());
    if (rc)
        goto out_abort;
    ncclResult_t r = send ? c->lib->send(d_buf, bytes, ncclInt8, peer, c->comm, s)
                          : c->lib->recv(d_buf, bytes, ncclInt8, peer, c->comm, s);
    rc = NCCL_CHECK(c->lib, c->comm, r);
    const int rc_end = NCCL_CHECK(c->lib, c->comm, c->lib->group_end());
    rc = rc ? rc : rc_end;
    if (rc)
        goto out_abort;
    rc = nc_poll(c, nc_now() + NCCL_COMM_ENQUEUE_TIMEOUT_S, send ? "enqueueing a send"
                                                                  : "enqueueing a receive");
    if (rc)
        return rc; /* aborted there */
    rc = CUDA_CHECK(cudaEventRecord(c->ev[1], s));
    if (rc)
        goto out_abort;
    c->timed = true;
    return 0;
out_abort:
    nccl_comm_abort(c);
    return rc == -EINVAL ? -EINVAL : -EIO;
}

int nccl_comm_send(struct nccl_comm *c, const void *d_buf, size_t bytes, void *stream)
{
    return nc_enqueue(c, true, (void *)d_buf, bytes, stream);
}

int nccl_comm_recv(struct nccl_comm *c, void *d_buf, size_t bytes, void *stream)
{
    return nc_enqueue(c, false, d_buf, bytes, stream);
}

int nccl_comm_check(struct nccl_comm *c)
{
    if (c->aborted)
        return -EIO;
    ncclResult_t st = ncclSuccess;
    int rc = NCCL_CHECK(c->lib, c->comm, c->lib->comm_get_async_error(c->comm, &st));
    if (!rc && st != ncclSuccess && st != ncclInProgress) {
        const char *last = c->lib->get_last_error ? c->lib->get_last_error(c->comm) : NULL;
        log_error("nccl %s: asynchronous error: %s%s%s", c->name, c->lib->get_error_string(st),
                  last && *last ? ": " : "", last ? last : "");
        rc = -EIO;
    }
    if (rc)
        nccl_comm_abort(c);
    return rc;
}

int nccl_comm_wait(struct nccl_comm *c, void *stream, double timeout_s)
{
    const double t0 = nc_now();
    double next_check = t0;
    for (;;) {
        const cudaError_t e = cudaStreamQuery((cudaStream_t)stream);
        if (e == cudaSuccess)
            break;
        if (e != cudaErrorNotReady) {
            log_error("nccl %s: the stream failed while handing hidden states over: %s", c->name,
                      cudaGetErrorString(e));
            nccl_comm_abort(c);
            return -EIO;
        }
        const double now = nc_now();
        if (now >= next_check) {
            int rc = nccl_comm_check(c);
            if (rc)
                return rc;
            next_check = now + 1e-3;
        }
        if (now - t0 > timeout_s) {
            log_error("nccl %s: the %s has not finished after %.1f s (is the peer alive?): "
                      "aborting", c->name, c->rank == NCCL_COMM_RANK_SENDER ? "send" : "receive",
                      now - t0);
            nccl_comm_abort(c);
            return -ETIMEDOUT;
        }
        nc_pause(t0);
    }
    if (c->timed) {
        float ms = 0;
        c->last_ms = CUDA_CHECK(cudaEventElapsedTime(&ms, c->ev[0], c->ev[1])) ? 0.0 : ms;
        c->timed = false;
    }
    return 0;
}

void nccl_comm_abort(struct nccl_comm *c)
{
    if (!c || c->aborted)
        return;
    c->aborted = true;
    log_warn("nccl %s: aborting the communicator", c->name);
    NCCL_CHECK(c->lib, NULL, c->lib->comm_abort(c->comm));
}

double nccl_comm_last_ms(const struct nccl_comm *c)
{
    return c->last_ms;
}

bool nccl_comm_is_aborted(const struct nccl_comm *c)
{
    return c->aborted;
}

#else /* no CUDA in this build: NCCL cannot be used */

struct nccl_lib {
    int unused;
};

struct nccl_comm {
    int unused;
};

struct nccl_lib *nccl_lib_open(bool quiet)
{
    if (quiet)
        log_info("nccl: this build has no CUDA support");
    else
        log_error("nccl: this build has no CUDA support");
    return NULL;
}

void nccl_lib_close(struct nccl_lib *lib)
{
    free(lib);
}

int nccl_lib_version(const struct nccl_lib *lib)
{
    (void)lib;
    return 0;
}

int nccl_lib_unique_id(const struct nccl_lib *lib, uint8_t *id)
{
    (void)lib, (void)id;
    return -ENOTSUP;
}

struct nccl_comm *nccl_comm_create(const struct nccl_comm_config *cfg)
{
    (void)cfg;
    log_error("nccl: this build has no CUDA support");
    return NULL;
}

void nccl_comm_destroy(struct nccl_comm *c)
{
    free(c);
}

int nccl_comm_send(struct nccl_comm *c, const void *d_buf, size_t bytes, void *stream)
{
    (void)c, (void)d_buf, (void)bytes, (void)stream;
    return -ENOTSUP;
}

int nccl_comm_recv(struct nccl_comm *c, void *d_buf, size_t bytes, void *stream)
{
    (void)c, (void)d_buf, (void)bytes, (void)stream;
    return -ENOTSUP;
}

int nccl_comm_wait(struct nccl_comm *c, void *stream, double timeout_s)
{
    (void)c, (void)stream, (void)timeout_s;
    return -ENOTSUP;
}

int nccl_comm_check(struct nccl_comm *c)
{
    (void)c;
    return -ENOTSUP;
}

void nccl_comm_abort(struct nccl_comm *c)
{
    (void)c;
}

double nccl_comm_last_ms(const struct nccl_comm *c)
{
    (void)c;
    return 0;
}

bool nccl_comm_is_aborted(const struct nccl_comm *c)
{
    (void)c;
    return true;
}

#endif
