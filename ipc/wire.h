/*
 * wire: lamina's ZeroMQ sockets and the framing of every message between the coordinator and
 * its workers (schema: proto/lamina.proto; protobuf stays inside wire.c).
 *
 * Frames of one ZeroMQ message, as the receiving socket sees them:
 *
 *   frame        size                  meaning
 *   identity     1..255                only on a ROUTER: the peer's routing id (added by ZeroMQ)
 *   envelope     1..WIRE_ENVELOPE_MAX  protobuf Envelope{version, type, seq_no, payload,
 *                                      tensor_bytes}; payload is the inner message of type
 *   tensor       tensor_bytes          only when tensor_bytes > 0: raw little-endian f32 rows
 *                                      whose shape the inner message gives
 *
 * wire_recv() checks the framing and everything a message says about itself, and rejects (returns
 * -EPROTO, counts in struct wire_stats, logs once per kind) a message with: a wrong frame count; an
 * envelope that is too large or does not unpack; a version other than WIRE_VERSION; an unknown
 * type; a tensor frame whose size is not the declared tensor_bytes; an inner payload that does not
 * unpack; a tensor size that does not equal the inner message's shape (rows x width x 4, computed
 * without overflow), or a tensor on a type that has none; arrays of different lengths (experts vs
 * counts), zero counts or widths, or more than WIRE_EXPERTS_MAX experts; a LoadPlan whose layer
 * range is empty or past n_layers_total, whose residency is not by strictly increasing layer inside
 * the range, whose foreign entries are not by strictly increasing layer outside the range and
 * below n_layers_total, whose bitmaps exceed WIRE_BITMAP_MAX, or whose n_seq exceeds
 * WIRE_SEQ_MAX; CURVE keys of a length other than 0 or WIRE_KEY_BYTES; NCCL unique ids of a length other than 0 or
 * WIRE_NCCL_ID_BYTES, or an nccl_next_id on the last worker; a Step via_nccl that carries a tensor
 * frame or has zero rows or width; a Step that asks to sample together with all_logits, with a
 * sampler value out of range (temperature, top_k, top_p, min_p, repeat_penalty, presence_penalty as
 * in model/sampler.h; uniform outside [0, 1)), a window id below 0 or more than WIRE_WINDOW_MAX
 * ids, or a window without sample; strings longer than their limit; a Result with neither token nor
 * logits or a token outside [-1, n_vocab); a Timing line containing a newline; a State with an
 * unknown op, an empty layer range, or a frame other than `bytes` bytes on a SNAPSHOT (none on
 * the other ops).
 *
 * Left to the caller, which knows the model and the plan (check before use):
 *   - n_embd and n_vocab equal the model's; n_tokens <= max_batch; pos + n_tokens <= n_ctx;
 *   - layer inside the receiving worker's range; every expert id < n_experts; a residency
 *     bitmap of exactly ceil(n_experts / 8) bytes; an ExpertReply's n_rows equal to the
 *     request's sum(counts) and its step/layer those of a request in flight;
 *   - worker_index and step known; seq_id below the plan's n_seq; seq_no ordering per peer;
 *     backend a known name; endpoints, shm name and model path acceptable; the float values
 *     themselves (NaN, inf).
 *
 * A dead peer: a closed process is seen at once on ipc and tcp, and one that stops answering
 * is dropped after heartbeat_timeout_ms (ZeroMQ heartbeats, ipc and tcp only). From then a
 * ROUTER's wire_send to its id fails with -EHOSTUNREACH and a DEALER's (immediate) wire_send
 * times out. A peer that is alive but stuck is the caller's to notice (Heartbeat messages,
 * step deadlines).
 *
 * Threading: a wire_socket belongs to one thread (style habit 13), like the ZeroMQ socket in it.
 * The ZeroMQ context is made by main and passed in. No function here keeps process state.
 */
#ifndef IPC_WIRE_H
#define IPC_WIRE_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#define WIRE_VERSION 6                      /* Envelope.version of this build (2: NCCL hand-off;
                                               3: sampling on the last worker; 4: sequence
                                               slots, LoadPlan.n_seq; 5: foreign experts,
                                               LoadPlan.foreign and the expert tags; 6:
                                               sequence snapshots, State) */
#define WIRE_ENVELOPE_MAX (256u * 1024)     /* largest envelope frame accepted, bytes */
#define WIRE_MSG_MAX_DEFAULT (1ll << 30)    /* default ZMQ_MAXMSGSIZE per frame, bytes */
#define WIRE_ID_MAX 255                     /* largest ZeroMQ routing id, bytes */
#define WIRE_STRING_MAX 4096                /* longest path, endpoint, device or error text */
#define WIRE_TIMING_MAX (64u * 1024)        /* longest Timing JSON line, bytes */
#define WIRE_EXPERTS_MAX 4096               /* most experts in one ExpertRequest */
#define WIRE_BITMAP_MAX (WIRE_EXPERTS_MAX / 8) /* longest residency bitmap, bytes */
#define WIRE_TENSOR_ALIGN 4                 /* received tensors are aligned to this, bytes */
#define WIRE_KEY_BYTES 32                   /* CURVE public or secret key, binary */
#define WIRE_KEY_Z85_LEN 40                 /* CURVE key as Z85 text, without the NUL */
#define WIRE_PATH_MAX 108                   /* longest ipc socket path incl. NUL (sun_path) */
#define WIRE_NAME_MAX 32                    /* longest socket name in wire_endpoint_ipc */
#define WIRE_NCCL_ID_BYTES 128              /* an NCCL unique id (NCCL_COMM_ID_BYTES), binary */
#define WIRE_WINDOW_MAX 16384               /* most ids in a Step's penalty window */
#define WIRE_SEQ_MAX 64                     /* most sequence slots a LoadPlan asks for */

/* Envelope.type; values are those of MsgType in proto/lamina.proto. */
enum wire_type {
    WIRE_TYPE_HELLO = 1,          /* worker -> coordinator after connecting */
    WIRE_TYPE_LOAD_PLAN = 2,      /* coordinator -> worker */
    WIRE_TYPE_READY = 3,          /* worker -> coordinator, plan loaded */
    WIRE_TYPE_STEP = 4,           /* hidden states in; tensor n_tokens x n_embd */
    WIRE_TYPE_EXPERT_REQUEST = 5, /* tensor sum(counts) x n_embd */
    WIRE_TYPE_EXPERT_REPLY = 6,   /* tensor n_rows x n_embd */
    WIRE_TYPE_RESULT = 7,         /* token and/or tensor n_rows x n_vocab logits */
    WIRE_TYPE_TIMING = 8,         /* one JSON line */
    WIRE_TYPE_HEARTBEAT = 9,
    WIRE_TYPE_ERROR = 10,
    WIRE_TYPE_SHUTDOWN = 11,      /* no fields */
    WIRE_TYPE_RESET = 12,         /* start a sequence over */
    WIRE_TYPE_STATE = 13,         /* a sequence snapshot: asked for, carried, acknowledged */
};
#define WIRE_TYPE_FIRST WIRE_TYPE_HELLO
#define WIRE_TYPE_LAST WIRE_TYPE_STATE

/* Why wire_recv() dropped a message; indexes wire_stats.rejected_by. */
enum wire_reject {
    WIRE_REJECT_FRAMES = 0,   /* frame count, or tensor frame size != declared tensor_bytes */
    WIRE_REJECT_ENVELOPE = 1, /* envelope empty, too large, or does not unpack */
    WIRE_REJECT_VERSION = 2,  /* Envelope.version != WIRE_VERSION */
    WIRE_REJECT_TYPE = 3,     /* Envelope.type unknown */
    WIRE_REJECT_PAYLOAD = 4,  /* inner message does not unpack */
    WIRE_REJECT_SHAPE = 5,    /* tensor_bytes disagrees with the shape fields, or overflows */
    WIRE_REJECT_FIELDS = 6,   /* other fields inconsistent or out of range */
    WIRE_REJECT_COUNT = 7,
};

/*
 * Messages. On a message built for wire_send() every pointer is borrowed from the caller for the
 * call; a NULL string is sent as "". On a message filled by wire_recv() every pointer (strings,
 * arrays, tensor) is owned by the message until wire_msg_free(); strings are then never NULL.
 */
struct wire_hello {
    uint32_t worker_index;
    uint32_t pid;
    const char *device;        /* device name, <= WIRE_STRING_MAX bytes */
    uint64_t device_mem_bytes; /* bytes */
    uint32_t n_threads;
    bool has_curve_key; /* the worker's data socket listens on tcp:// with this CURVE key */
    uint8_t curve_public_key[WIRE_KEY_BYTES];
};

struct wire_layer_residency {
    uint32_t layer;
    const uint8_t *bitmap; /* bit e (byte e / 8, LSB first) set: expert e is resident */
    size_t bitmap_bytes;   /* <= WIRE_BITMAP_MAX */
    bool trunk;            /* the layer's projections are charged to the device */
    bool shexp;            /* its shared expert is charged to the device */
};

struct wire_load_plan {
    const char *model_path;
    const char *shm_name;
    uint64_t shm_bytes;
    uint32_t layer_begin; /* first layer of the worker */
    uint32_t layer_end;   /* one past the last; layer_begin < layer_end <= n_layers_total */
    uint32_t n_layers_total;
    const struct wire_layer_residency *residency; /* by strictly increasing layer in range */
    size_t n_residency;
    const struct wire_layer_residency *foreign; /* by strictly increasing layer outside the
                                                   range, < n_layers_total (experts_home any) */
    size_t n_foreign;
    const char *backend;        /* "cpu" or "cuda" (checked by the worker) */
    uint64_t device_mem_budget; /* bytes */
    uint32_t n_ctx;
    bool kv_f16;
    uint32_t max_batch; /* tokens per Step at most */
    uint32_t n_threads;
    const char *next_endpoint;   /* where hidden states go; "" for the last worker */
    const char *listen_endpoint; /* where the worker binds its data socket; "" for the first */
    bool is_last;
    uint32_t n_embd;
    uint32_t n_vocab;
    bool has_next_key; /* next_endpoint is tcp:// and its CURVE server key follows */
    uint8_t next_server_key[WIRE_KEY_BYTES];
    bool lmhead;       /* the output projection is charged to this device */
    bool has_nccl_prev; /* hidden states come from the previous worker over NCCL (rank 1) */
    uint8_t nccl_prev_id[WIRE_NCCL_ID_BYTES]; /* that pair's unique id */
    bool has_nccl_next; /* hidden states go to the next worker over NCCL (rank 0) */
    uint8_t nccl_next_id[WIRE_NCCL_ID_BYTES]; /* that pair's unique id */
    uint32_t n_seq;     /* sequence slots, <= WIRE_SEQ_MAX; 0 means 1 (received: >= 1) */
};

struct wire_ready {
    uint64_t device_mem_used; /* bytes */
    uint32_t resident_experts;
};

struct wire_step { /* tensor: n_tokens x n_embd f32, or none when via_nccl */
    uint64_t seq_id;
    uint32_t pos; /* position of the first token */
    uint32_t n_tokens;
    uint64_t step;
    bool all_logits;
    uint32_t n_embd;
    bool via_nccl; /* the rows come on the NCCL pair with the sender (no tensor frame) */
    /* last worker: sample the last row with these and return only the token (see
     * proto/lamina.proto); the rest is ignored when sample is false */
    bool sample;              /* never with all_logits */
    float temperature;        /* >= 0, finite */
    int32_t top_k;            /* >= 0 */
    float top_p;              /* [0, 1] */
    float min_p;              /* [0, 1] */
    float repeat_penalty;     /* >= 0, finite */
    float presence_penalty;   /* finite */
    double uniform;           /* [0, 1) */
    const int32_t *window;    /* n_window penalty ids, each >= 0 */
    size_t n_window;          /* <= WIRE_WINDOW_MAX; 0 when sample is false */
};

struct wire_expert_request { /* tensor: sum(counts) x n_embd f32, grouped by expert */
    uint64_t step;
    uint32_t layer;
    const uint32_t *experts; /* n_experts ids, 1..WIRE_EXPERTS_MAX of them */
    const uint32_t *counts;  /* rows of each expert, each >= 1 */
    size_t n_experts;
    uint32_t n_embd;
    uint64_t tag;            /* 0: a worker's own; else forwarded by the coordinator */
};

struct wire_expert_reply { /* tensor: n_rows x n_embd f32 */
    uint64_t step;
    uint32_t layer;
    uint32_t n_rows;
    uint32_t n_embd;
    uint64_t tag;             /* the forwarded request's tag, or 0 */
};

struct wire_result { /* tensor (optional): n_rows x n_vocab f32 logits */
    uint64_t seq_id;
    uint64_t step;
    uint32_t n_rows;
    uint32_t n_vocab;
    int32_t token; /* sampled token, or -1 when only logits come */
};

struct wire_timing {
    const char *json; /* one JSON object, no newline, <= WIRE_TIMING_MAX bytes */
};

struct wire_heartbeat {
    uint64_t step;
};

struct wire_error {
    int32_t code;        /* negative errno */
    const char *message; /* <= WIRE_STRING_MAX bytes */
    uint32_t worker_index;
    uint64_t step;
};

struct wire_reset {
    uint64_t seq_id;
};
enum wire_state_op {
    WIRE_STATE_SAVE = 1,     /* coordinator -> worker: send slot seq_id's snapshot; no frame */
    WIRE_STATE_SNAPSHOT = 2, /* a snapshot (raw frame of `bytes` bytes): the answer to SAVE,
                                or coordinator -> worker, one to load */
    WIRE_STATE_LOADED = 3,   /* worker -> coordinator: the snapshot is loaded; no frame */
};
struct wire_state { /* raw frame (SNAPSHOT only): bytes bytes, forward.h's snapshot layout */
    uint64_t seq_id;
    uint32_t op;          /* enum wire_state_op */
    uint32_t pos;         /* tokens the snapshot holds */
    uint32_t layer_begin; /* the range it covers: layer_begin < layer_end */
    uint32_t layer_end;
    uint64_t bytes;       /* the frame's size (SNAPSHOT), else 0 */
};

struct wire_msg_storage;

struct wire_msg {
    enum wire_type type;
    uint64_t seq_no; /* sender's counter, sent as given */
    union {          /* the member named by type; WIRE_TYPE_SHUTDOWN has none */
        struct wire_hello hello;
        struct wire_load_plan load_plan;
        struct wire_ready ready;
        struct wire_step step;
        struct wire_expert_request expert_request;
        struct wire_expert_reply expert_reply;
        struct wire_result result;
        struct wire_timing timing;
        struct wire_heartbeat heartbeat;
        struct wire_error error;
        struct wire_reset reset;
        struct wire_state state;
    };
    const void *tensor;  /* raw f32 rows, or NULL; received: WIRE_TENSOR_ALIGN-aligned */
    size_t tensor_bytes; /* 0 when there is no tensor frame */
    struct wire_msg_storage *storage; /* private to wire.c: what wire_recv allocated; leave
                                         NULL (zero the struct) on messages you build */
};

/* Frees what wire_recv() allocated for m (the received frame, strings, arrays) and zeroes m.
 * Accepts a zeroed or caller-built message (then only zeroes it). */
void wire_msg_free(struct wire_msg *m);

/* Lower-case name of a type ("step", "expert_request"), or "unknown"; static storage. */
const char *wire_msg_type_name(uint32_t type);

/* Lower-case name of a reject reason ("frames", "shape"), or "unknown"; static storage. */
const char *wire_reject_name(enum wire_reject why);

/* Counters of one wire_socket, updated by wire_send() and wire_recv(). */
struct wire_stats {
    uint64_t sent;           /* messages handed to ZeroMQ */
    uint64_t received;       /* messages accepted by wire_recv() */
    uint64_t rejected;       /* malformed messages dropped, all reasons */
    uint64_t rejected_by[WIRE_REJECT_COUNT];
    uint64_t bytes_sent;     /* envelope + tensor bytes */
    uint64_t bytes_received; /* envelope + tensor bytes of accepted messages */
    uint64_t tensors_copied; /* received tensors copied because ZeroMQ's data was misaligned */
};

struct wire_keypair {
    uint8_t public_key[WIRE_KEY_BYTES];
    uint8_t secret_key[WIRE_KEY_BYTES];
};

/* Socket options. Start from wire_socket_config_default(); NULL means the defaults. */
struct wire_socket_config {
    int linger_ms;            /* ZMQ_LINGER on close, ms, >= 0 (default 200) */
    int send_timeout_ms;      /* ZMQ_SNDTIMEO, ms, >= 0 (default 1000) */
    int recv_timeout_ms;      /* ZMQ_RCVTIMEO for raw zmq_recv, ms (default 1000); wire_recv
                                 takes its own timeout */
    int64_t max_msg_bytes;    /* ZMQ_MAXMSGSIZE per frame, bytes, > WIRE_ENVELOPE_MAX (default
                                 WIRE_MSG_MAX_DEFAULT); a peer sending more is disconnected */
    int heartbeat_ivl_ms;     /* ZMQ_HEARTBEAT_IVL, ms, 0 = off (default 500) */
    int heartbeat_timeout_ms; /* ZMQ_HEARTBEAT_TIMEOUT, ms (default 2000) */
    int heartbeat_ttl_ms;     /* ZMQ_HEARTBEAT_TTL asked of the peer, ms (default 2000) */
    bool immediate;           /* ZMQ_IMMEDIATE: queue only to finished connections, so a send
                                 with no live peer times out (default true) */
    bool no_handover;         /* ROUTER: leave ZMQ_ROUTER_HANDOVER off, so a second peer with
                                 a routing id in use is refused (default false: handover on) */
    int spin_us;              /* wire_recv busy-polls this long before sleeping, us (default
                                 0); for round trips expected within microseconds; ignored on
                                 machines of fewer than 8 CPUs, where it starves the peer */
    const char *routing_id;   /* ZMQ_ROUTING_ID of a DEALER, 1..WIRE_ID_MAX bytes, not starting
                                 with a zero byte; NULL: ZeroMQ picks (default) */
    const struct wire_keypair *curve_keys; /* own CURVE keys; NULL: no CURVE (default) */
    bool curve_server;                     /* with curve_keys: this side is the CURVE server */
    const uint8_t *curve_server_key;       /* CURVE client: the server's public key,
                                              WIRE_KEY_BYTES; required when curve_keys is set
                                              and curve_server is not */
};

struct wire_socket;

/* The defaults listed in struct wire_socket_config. */
struct wire_socket_config wire_socket_config_default(void);

/* Makes a ZeroMQ socket of zmq_type (ZMQ_ROUTER, ZMQ_DEALER, ZMQ_PUSH, ZMQ_PULL or ZMQ_PAIR)
 * in zmq_ctx (borrowed; must outlive the socket) and sets the options of cfg (borrowed for the
 * call); a ROUTER also gets ZMQ_ROUTER_MANDATORY (sending to an unknown peer fails) and
 * ZMQ_ROUTER_HANDOVER (a restarted worker reusing its routing id takes over). Returns an owned
 * socket, or NULL after logging the option or call that failed. */
struct wire_socket *wire_socket_create(void *zmq_ctx, int zmq_type,
                                       const struct wire_socket_config *cfg);

/* Closes the ZeroMQ socket (waiting at most linger_ms) and frees s; accepts NULL. */
void wire_socket_destroy(struct wire_socket *s);

/* Binds to endpoint. Refuses, with a logged reason: an ipc:// path that already exists
 * (-EADDRINUSE: a second bind would silently steal the endpoint), the abstract namespace
 * ipc://@ (-EINVAL), and tcp:// on anything but a loopback address without CURVE server keys
 * (-EPERM). Other failures return -errno of zmq_bind. */
int wire_socket_bind(struct wire_socket *s, const char *endpoint);

/* Connects to endpoint (tcp:// to a non-loopback address needs CURVE keys: -EPERM). Returns 0
 * or -errno of zmq_connect, logged. */
int wire_socket_connect(struct wire_socket *s, const char *endpoint);

/* Writes the last bound or connected endpoint (tcp://127.0.0.1:PORT after binding port *)
 * into buf. Returns 0, -ENOSPC when cap is too small, or -errno. */
int wire_socket_endpoint(const struct wire_socket *s, char *buf, size_t cap);

/* The ZeroMQ socket, for zmq_poll; borrowed while s lives; do not close it or change options. */
void *wire_socket_zmq(const struct wire_socket *s);

/* The counters of s; borrowed while s lives. */
const struct wire_stats *wire_socket_stats(const struct wire_socket *s);

/*
 * Checks m as a receiver would, then sends it. On a ROUTER, routing_id (id_len bytes, borrowed)
 * names the peer and is required; on other sockets it must be NULL. The envelope and the tensor
 * (m->tensor_bytes bytes, borrowed for the call) are copied into ZeroMQ's buffers, so the
 * caller may reuse them on return. Blocks at most send_timeout_ms. Returns 0; -EINVAL (logged)
 * when m would be rejected by its receiver; -ETIMEDOUT (not logged) when the peer cannot take
 * it in time (no peer yet with immediate, or its queue is full); -EHOSTUNREACH (logged) when a
 * ROUTER has no peer of that id; -ESHUTDOWN when the context is terminating; -ENOMEM; other
 * -errno (logged).
 */
int wire_send(struct wire_socket *s, const struct wire_msg *m, const void *routing_id,
              size_t id_len);

/*
 * Waits at most timeout_ms (-1: forever; use only in tests) for one message and reads it into
 * m, which is overwritten (free a previous message first). On a ROUTER, id_buf receives the
 * peer's routing id: *id_len is its capacity on entry (at least WIRE_ID_MAX, ASSERTed) and the
 * id's length on return; on other sockets pass NULL for both. Returns 0 with m filled (the
 * caller frees it with wire_msg_free); -ETIMEDOUT (not logged); -EPROTO when the message was
 * malformed (see the top of this file): it is dropped, counted in the socket's stats and
 * logged only the first time for each wire_reject reason; -EINTR when a signal interrupted the
 * wait; -ESHUTDOWN when the context is terminating; -ENOMEM. m is zeroed on every error.
 */
int wire_recv(struct wire_socket *s, struct wire_msg *m, void *id_buf, size_t *id_len,
              int timeout_ms);

/*
 * Runtime directory for ipc:// sockets. Makes a fresh directory, mode 0700, named
 * BASE/lamina-PID-XXXXXX (mkdtemp), where BASE is base, else $XDG_RUNTIME_DIR when it is set to
 * an absolute path, else /tmp. Writes its path into dir (cap bytes; WIRE_PATH_MAX is enough for
 * any path an ipc endpoint can use). Returns 0, -ENAMETOOLONG when the path would leave no room
 * for socket names, or -errno of mkdtemp (logged).
 */
int wire_rundir_create(const char *base, char *dir, size_t cap);

/* Removes every entry directly inside dir (sockets, files, links; not subdirectories) and dir
 * itself. Returns 0 or the first -errno (logged). */
int wire_rundir_remove(const char *dir);

/* Removes the runtime directories that dead processes left under base (NULL: as in
 * wire_rundir_create): directories of this user named lamina-PID-XXXXXX whose PID no longer
 * exists. Those of live processes and any other entry are kept; a PID reused since is taken as
 * alive. Call before wire_rundir_create. Returns how many were removed (each logged at info),
 * or -errno when base cannot be read (logged). */
int wire_rundir_sweep(const char *base);

/* Writes "ipc://DIR/NAME.sock" into buf. name is 1..WIRE_NAME_MAX characters of
 * [A-Za-z0-9_-]. Returns 0, -EINVAL for a bad name, or -ENAMETOOLONG when the path exceeds the
 * socket path limit (WIRE_PATH_MAX - 1 bytes) or cap; logged. */
int wire_endpoint_ipc(char *buf, size_t cap, const char *dir, const char *name);

/* Makes a fresh CURVE key pair. Returns 0, or -ENOTSUP (logged) when libzmq lacks CURVE. */
int wire_keypair_generate(struct wire_keypair *kp);

/* Writes key (WIRE_KEY_BYTES) as Z85 text into out (WIRE_KEY_Z85_LEN + 1 bytes, NUL-ended).
 * Returns 0. */
int wire_key_to_z85(const uint8_t *key, char *out);

/* Reads Z85 text (exactly WIRE_KEY_Z85_LEN characters of the Z85 alphabet, then the end of
 * the string) into key (WIRE_KEY_BYTES). Returns 0 or -EINVAL (logged) naming what is wrong. */
int wire_key_from_z85(const char *text, uint8_t *key);

#endif
