/*
 * nccl: NCCL communicators between two consecutive GPU workers of one host, over which the
 * earlier worker hands its output hidden states to the later one device to device.
 *
 * NCCL is loaded at run time (dlopen of libnccl.so.2) and nothing links against it, so every
 * binary runs where the library is missing; nccl_lib_open() then fails and callers use ZeroMQ.
 * Search order: $LAMINA_NCCL_LIB alone when it is set (a path; tests point it at a missing
 * file to see the fallback), else "libnccl.so.2" on the loader's path, else
 * /usr/local/cuda/lib64/libnccl.so.2. Opening also sets NCCL_NVLS_ENABLE=0 unless the
 * environment sets it (the machines' owners require NVLink multicast off).
 *
 * A pair communicator has two ranks: rank 0 is the earlier worker (it sends), rank 1 the later
 * one (it receives). Both are non-blocking (config.blocking = 0): creation, enqueueing and
 * teardown return at once and are polled with ncclCommGetAsyncError under our own deadlines,
 * because NCCL never times out by itself (a dead peer leaves the survivor waiting forever).
 * After any error or timeout the communicator is aborted (ncclCommAbort) and refuses further
 * work; the caller then ends the process (style.md habit 8).
 *
 * Process and threads: the coordinator opens the library only to make unique ids (the NCCL
 * bootstrap root then runs on a thread inside the coordinator until both ranks have joined);
 * each worker opens it once and makes up to two communicators, on its main thread, with its
 * CUDA device already current. The library stays mapped until the process exits (NCCL's
 * threads may still run code from it). Builds without CUDA (no LAMINA_CUDA) keep the
 * functions, which fail with -ENOTSUP.
 */
#ifndef IPC_NCCL_H
#define IPC_NCCL_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define NCCL_COMM_ID_BYTES 128      /* a unique id, as NCCL makes it (NCCL_UNIQUE_ID_BYTES) */
#define NCCL_COMM_RANK_SENDER 0     /* the earlier worker of a pair */
#define NCCL_COMM_RANK_RECEIVER 1   /* the later worker of a pair */
#define NCCL_COMM_ENQUEUE_TIMEOUT_S 60.0 /* most a send or receive may take to be enqueued (the
                                            first one connects the pair), s */

/* The loaded library: its handle and the functions lamina uses. */
struct nccl_lib;

/* Loads NCCL (search order above) and resolves every function used here. Returns an owned
 * handle, or NULL after logging which path or symbol failed (at info level when quiet: the
 * caller logs the consequence, as --handoff auto does). */
struct nccl_lib *nccl_lib_open(bool quiet);

/* Frees the handle; accepts NULL. The library itself stays mapped (see above). */
void nccl_lib_close(struct nccl_lib *lib);

/* NCCL's version as NCCL_VERSION_CODE (22809 for 2.28.9). */
int nccl_lib_version(const struct nccl_lib *lib);

/* Makes a fresh unique id into id (NCCL_COMM_ID_BYTES) with ncclGetUniqueId, which starts
 * the bootstrap root of the pair on a thread of this process. Returns 0 or -EIO (logged). */
int nccl_lib_unique_id(const struct nccl_lib *lib, uint8_t *id);

struct nccl_comm_config {
    const struct nccl_lib *lib; /* borrowed; outlives the communicator */
    const uint8_t *id;          /* NCCL_COMM_ID_BYTES from the coordinator; borrowed for the
                                   call */
    int rank;                   /* NCCL_COMM_RANK_SENDER or NCCL_COMM_RANK_RECEIVER */
    double init_timeout_s;      /* the peer must join within this, s (it may still be loading) */
    const char *name;           /* for messages, e.g. "worker 0 -> 1" */
};

/* A two-rank non-blocking communicator. */
struct nccl_comm;

/* Joins the pair on the current CUDA device: ncclCommInitRankConfig with blocking = 0, then
 * polls ncclCommGetAsyncError every millisecond until it leaves ncclInProgress. Blocks until
 * the peer has joined too, at most init_timeout_s. Returns an owned communicator, or NULL after
 * logging why (library error, or the peer did not join in time: the half-made communicator is
 * aborted). */
struct nccl_comm *nccl_comm_create(const struct nccl_comm_config *cfg);

/* Tears the communicator down: when healthy, ncclCommFinalize polled for at most 2 s, then
 * ncclCommDestroy; after an error, or when the finalize does not finish, ncclCommAbort.
 * Accepts NULL. Work enqueued on a stream must be complete (or the stream abandoned). */
void nccl_comm_destroy(struct nccl_comm *c);

/* Enqueues the send of bytes from device buffer d_buf (borrowed until the stream has run it)
 * to the receiver, on stream (a cudaStream_t of this device), inside ncclGroupStart/End, with
 * a CUDA event on either side to time it. Returns at once: the data has left when the stream
 * has run past it (nccl_comm_wait). 0, or -EIO after logging (the communicator is aborted);
 * -EINVAL on the receiving rank. */
int nccl_comm_send(struct nccl_comm *c, const void *d_buf, size_t bytes, void *stream);

/* Enqueues the receive of bytes into device buffer d_buf (written when the stream runs past
 * it) from the sender, on stream; as nccl_comm_send otherwise. */
int nccl_comm_recv(struct nccl_comm *c, void *d_buf, size_t bytes, void *stream);

/* Waits until stream has run everything enqueued so far (cudaStreamQuery, yielding, then
 * sleeping 20 us between queries), checking ncclCommGetAsyncError every millisecond and giving
 * up after timeout_s. Returns 0; -EIO after an asynchronous NCCL error or a CUDA error;
 * -ETIMEDOUT. On either failure it logs what and for how long, and aborts the communicator,
 * which makes NCCL's kernels on the stream return. */
int nccl_comm_wait(struct nccl_comm *c, void *stream, double timeout_s);

/* Checks once for an asynchronous error (a peer's failure seen by NCCL's threads). Returns 0,
 * or -EIO after logging it and aborting. Never blocks. */
int nccl_comm_check(struct nccl_comm *c);

/* Aborts the communicator now (ncclCommAbort): NCCL work in flight on it returns, the
 * communicator refuses further work. Idempotent. Has been seen to hang in NCCL itself: a
 * process that must exit puts its own hard deadline around this call. */
void nccl_comm_abort(struct nccl_comm *c);

/* GPU time in ms of the last completed send or receive (between the events around it: the
 * transfer plus the wait for the peer to post its half), or 0 when none was timed. Call
 * after nccl_comm_wait returned 0. */
double nccl_comm_last_ms(const struct nccl_comm *c);

/* Whether the communicator was aborted (after an error, a timeout or nccl_comm_abort). */
bool nccl_comm_is_aborted(const struct nccl_comm *c);

#endif
