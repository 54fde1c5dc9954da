/*
 * shm: the POSIX shared-memory segment that holds every routed expert tensor
 * of every layer of one model (architecture.md, "pinned shm" tier).
 *
 * Processes. The coordinator creates the segment (shm_create), copies each
 * expert stack into it byte for byte as stored in the GGUF, sets the READY
 * flag, makes its own mapping read-only and chmods the segment 0400; at exit
 * it calls shm_destroy (or shm_unlink_name from a signal handler). Workers and
 * tools map it read-only (shm_open_ro), which validates every header and
 * table field and refuses a segment that is not READY or was made from another
 * GGUF. A new coordinator removes segments of dead coordinators
 * (shm_cleanup_stale): the creator's pid is part of the name.
 *
 * Name: "/lamina-<creator pid>-<model hash, 16 hex>-<instance>", file
 * /dev/shm/lamina-... on Linux, mode 0600 while written, 0400 once READY.
 *
 * Layout (all integers little-endian, host order; written only by the
 * coordinator, and only before READY is set; read-only for everyone after):
 *
 *   struct shm_header, at offset 0 (128 bytes)
 *   | off | size | field           | meaning                                         | writer |
 *   |   0 |    8 | magic           | "LAMINASH"                                      | coord  |
 *   |   8 |    4 | version         | SHM_VERSION                                     | coord  |
 *   |  12 |    4 | header_bytes    | sizeof(struct shm_header) = 128                 | coord  |
 *   |  16 |    8 | total_bytes     | segment size, multiple of SHM_ALIGN             | coord  |
 *   |  24 |    4 | n_layers        | layers of the model (lookup index range)        | coord  |
 *   |  28 |    4 | n_entries       | entries in the table                            | coord  |
 *   |  32 |    4 | creator_pid     | pid of the coordinator that made it             | coord  |
 *   |  36 |    4 | flags           | SHM_FLAG_READY once every byte is copied        | coord  |
 *   |  40 |    8 | model_file_size | bytes of the GGUF file the tensors came from    | coord  |
 *   |  48 |    8 | model_hash      | shm_model_hash() of that GGUF                   | coord  |
 *   |  56 |    8 | data_offset     | first data byte: align_up(128 + 128 * n, 2 MiB) | coord  |
 *   |  64 |    4 | entry_bytes     | sizeof(struct shm_entry) = 128                  | coord  |
 *   |  68 |   60 | reserved        | zero                                            | coord  |
 *
 *   struct shm_entry[n_entries], at offset 128, sorted by offset (128 bytes each)
 *   | off | size | field            | meaning                                        | writer |
 *   |   0 |    4 | layer            | layer index, < n_layers                        | coord  |
 *   |   4 |    4 | kind             | enum shm_kind                                  | coord  |
 *   |   8 |    4 | type             | ggml type id (enum quant_type)                 | coord  |
 *   |  12 |    4 | n_expert         | matrices in the stack (GGUF ne[2])             | coord  |
 *   |  16 |    8 | n_in             | elements per row (ne[0])                       | coord  |
 *   |  24 |    8 | n_out            | rows per expert (ne[1])                        | coord  |
 *   |  32 |    8 | row_bytes        | quant_row_size(type, n_in)                     | coord  |
 *   |  40 |    8 | bytes_per_expert | n_out * row_bytes                              | coord  |
 *   |  48 |    8 | offset           | from segment start, multiple of SHM_ALIGN      | coord  |
 *   |  56 |    8 | bytes            | n_expert * bytes_per_expert                    | coord  |
 *   |  64 |   64 | name             | GGUF tensor name, NUL-terminated               | coord  |
 *
 *   data: entry i's bytes at [offset, offset + bytes), the GGUF bytes as
 *   stored; expert e of an entry at offset + e * bytes_per_expert. Entries
 *   do not overlap; the gaps up to each 2 MiB boundary are zero.
 *
 * Invariant readers may rely on after shm_open_ro(): every field above was
 * checked (magic, version, sizes, no overflow, every entry inside the segment,
 * aligned, not overlapping, row_bytes/bytes consistent with the type, names
 * NUL-terminated, no duplicate (layer, kind), READY set, hash equal).
 *
 * Threading: an open segment is read-only and may be read from any thread;
 * create/open/destroy are called by one thread. The copy in shm_create runs
 * on cfg->n_threads threads it starts and joins before returning.
 *
 * Trust: the segment is a file of the same user; a reader trusts that nobody
 * shrinks it while mapped (that would SIGBUS, as for any mapped file).
 */
#ifndef IPC_SHM_H
#define IPC_SHM_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

#include "model/arch.h"
#include "model/gguf.h"

#define SHM_MAGIC "LAMINASH"        /* 8 bytes, no NUL in the segment */
#define SHM_VERSION 1u              /* bumped on any layout change */
#define SHM_ALIGN (2u << 20)        /* bytes: alignment of the data section and of each tensor */
#define SHM_FLAG_READY 1u           /* header flags: every byte copied, segment read-only */
#define SHM_NAME_MAX 64             /* bytes of a segment name, NUL included */
#define SHM_ENTRY_NAME 64           /* bytes of shm_entry.name, NUL included */
#define SHM_MAX_LAYERS 65536u       /* n_layers accepted by readers (bounds the index) */

/* What a table entry holds. */
enum shm_kind {
    SHM_KIND_GATE = 0,    /* ffn_gate_exps: n_embd -> F per expert */
    SHM_KIND_UP = 1,      /* ffn_up_exps: n_embd -> F */
    SHM_KIND_DOWN = 2,    /* ffn_down_exps: F -> n_embd */
    SHM_KIND_GATE_UP = 3, /* ffn_gate_up_exps: n_embd -> 2F (rows 0..F-1 gate, F..2F-1 up) */
    SHM_KIND_COUNT = 4,
};

struct shm_header {
    uint8_t magic[8];
    uint32_t version;
    uint32_t header_bytes;
    uint64_t total_bytes;
    uint32_t n_layers;
    uint32_t n_entries;
    uint32_t creator_pid;
    uint32_t flags;
    uint64_t model_file_size;
    uint64_t model_hash;
    uint64_t data_offset;
    uint32_t entry_bytes;
    uint8_t reserved[60];
};

struct shm_entry {
    uint32_t layer;
    uint32_t kind;
    uint32_t type;
    uint32_t n_expert;
    uint64_t n_in;
    uint64_t n_out;
    uint64_t row_bytes;
    uint64_t bytes_per_expert;
    uint64_t offset;
    uint64_t bytes;
    char name[SHM_ENTRY_NAME];
};

_Static_assert(sizeof(struct shm_header) == 128, "shm_header is 128 bytes");
_Static_assert(offsetof(struct shm_header, version) == 8, "shm_header.version");
_Static_assert(offsetof(struct shm_header, header_bytes) == 12, "shm_header.header_bytes");
_Static_assert(offsetof(struct shm_header, total_bytes) == 16, "shm_header.total_bytes");
_Static_assert(offsetof(struct shm_header, n_layers) == 24, "shm_header.n_layers");
_Static_assert(offsetof(struct shm_header, n_entries) == 28, "shm_header.n_entries");
_Static_assert(offsetof(struct shm_header, creator_pid) == 32, "shm_header.creator_pid");
_Static_assert(offsetof(struct shm_header, flags) == 36, "shm_header.flags");
_Static_assert(offsetof(struct shm_header, model_file_size) == 40, "shm_header.model_file_size");
_Static_assert(offsetof(struct shm_header, model_hash) == 48, "shm_header.model_hash");
_Static_assert(offsetof(struct shm_header, data_offset) == 56, "shm_header.data_offset");
_Static_assert(offsetof(struct shm_header, entry_bytes) == 64, "shm_header.entry_bytes");
_Static_assert(offsetof(struct shm_header, reserved) == 68, "shm_header.reserved");
_Static_assert(sizeof(struct shm_entry) == 128, "shm_entry is 128 bytes");
_Static_assert(offsetof(struct shm_entry, kind) == 4, "shm_entry.kind");
_Static_assert(offsetof(struct shm_entry, type) == 8, "shm_entry.type");
_Static_assert(offsetof(struct shm_entry, n_expert) == 12, "shm_entry.n_expert");
_Static_assert(offsetof(struct shm_entry, n_in) == 16, "shm_entry.n_in");
_Static_assert(offsetof(struct shm_entry, n_out) == 24, "shm_entry.n_out");
_Static_assert(offsetof(struct shm_entry, row_bytes) == 32, "shm_entry.row_bytes");
_Static_assert(offsetof(struct shm_entry, bytes_per_expert) == 40, "shm_entry.bytes_per_expert");
_Static_assert(offsetof(struct shm_entry, offset) == 48, "shm_entry.offset");
_Static_assert(offsetof(struct shm_entry, bytes) == 56, "shm_entry.bytes");
_Static_assert(offsetof(struct shm_entry, name) == 64, "shm_entry.name");

/* ---- layout planning (pure) ---- */

/* Where each expert tensor of a model goes. entries[i] is the table entry as
 * it will be written; src[i] the tensor's bytes in the GGUF mapping. */
struct shm_layout {
    uint32_t n_layers;         /* model layers */
    uint32_t n_entries;        /* expert tensors */
    uint64_t data_offset;      /* bytes: first data byte, SHM_ALIGN-aligned */
    uint64_t total_bytes;      /* bytes: segment size, SHM_ALIGN-aligned */
    uint64_t payload_bytes;    /* bytes: sum of the entries' bytes (what is copied) */
    struct shm_entry *entries; /* n_entries, owned: freed by shm_layout_free */
    const void **src;          /* n_entries, owned array of pointers borrowed from the gguf */
};

/* Plans the segment for every routed expert stack of every layer of model, in
 * layer order, kinds GATE, UP, DOWN, GATE_UP (absent ones skipped), each at
 * the next SHM_ALIGN boundary. Allocates the two arrays; touches no tensor
 * byte. Returns 0, -EINVAL (logged: no expert tensors, a name too long, a
 * size overflow) or -ENOMEM. On error *out is zeroed. */
int shm_layout_plan(const struct arch_model *model, struct shm_layout *out);

/* Frees what shm_layout_plan allocated and zeroes *layout; accepts a zeroed one. */
void shm_layout_free(struct shm_layout *layout);

/* Bytes of the segment for this layout (habit 11): layout->total_bytes. */
size_t shm_size(const struct shm_layout *layout);

/* Writes the header (flags 0: not READY) and the table into base, which holds
 * shm_size(layout) bytes; data bytes are left untouched. */
void shm_init(void *base, const struct shm_layout *layout, uint64_t model_hash,
              uint64_t model_file_size, uint32_t creator_pid);

/* FNV-1a 64-bit hash identifying a GGUF for shm_open_ro: the file size, and
 * for every tensor its name, n_dims, ne, type, offset, nbytes and its first
 * 32 data bytes (so re-quantized or re-trained files of the same shape differ).
 * Reads at most 32 bytes per tensor. */
uint64_t shm_model_hash(const struct gguf *g);

/* Checks a segment image of size bytes at base as shm_open_ro does (every
 * header and table field, READY, model_hash == expected_hash). Returns 0 or
 * -EPROTO after logging the first problem with the field and its value
 * ("shm <what>: ..."). Reads only the header and table. */
int shm_validate(const void *base, uint64_t size, uint64_t expected_hash, const char *what);

/* ---- the segment ---- */

/* Progress of the copy: done of total payload bytes. */
typedef void (*shm_progress_fn)(void *ctx, uint64_t done, uint64_t total);

struct shm_create_config {
    const struct arch_model *model; /* borrowed: expert tensors to copy */
    const struct gguf *gguf;        /* borrowed: the file behind model (hash, size) */
    uint32_t instance;              /* last part of the name, to make several per process; 0 */
    uint32_t n_threads;             /* copy threads; 0 = min(8, online CPUs); at most 64 */
    shm_progress_fn progress;       /* optional: called on the calling thread as chunks finish
                                     * (about every 64 MiB) and once at the end; NULL = none */
    void *progress_ctx;             /* passed to progress */
};

struct shm_segment;

/* Creates the segment for cfg->model: shm_open(O_CREAT|O_EXCL, 0600), checks
 * the free space of its filesystem (and RLIMIT_FSIZE) and fails up front with
 * "need X bytes in /dev/shm, it has Y free", ftruncate, posix_fallocate of the
 * whole size (so a full tmpfs is ENOSPC now, never SIGBUS later), maps it
 * read-write, writes header and table, copies every tensor (multi-threaded),
 * sets READY, then mprotects the mapping read-only and chmods the file 0400.
 * Returns an owned segment (the caller destroys it, which unlinks the name),
 * or NULL after one error line; on every failure path the name is unlinked
 * (unless it already existed: -EEXIST leaves the other segment alone) and
 * nothing is left mapped or open. A GGUF truncated under its mapping during
 * the copy gives SIGBUS (the GGUF's own trap, see pitfalls.md). Blocks. */
struct shm_segment *shm_create(const struct shm_create_config *cfg);

/* Maps segment name ("/lamina-...") read-only and validates it
 * (shm_validate with expected_hash = shm_model_hash of the reader's GGUF).
 * Returns an owned segment (destroy unmaps, never unlinks) or NULL after one
 * error line naming the segment and the field. */
struct shm_segment *shm_open_ro(const char *name, uint64_t expected_hash);

/* Unmaps; the creator also unlinks the name. Accepts NULL. Pointers from the
 * segment are invalid afterwards. A forked child must not destroy a segment
 * its parent created (it would unlink the parent's name): exec, or _exit. */
void shm_destroy(struct shm_segment *seg);

/* ---- lookups (any thread; results borrowed until shm_destroy) ---- */

/* "/lamina-..." */
const char *shm_name(const struct shm_segment *seg);
/* The whole mapping (header first) and its size in bytes, e.g. to pin it. */
const void *shm_base(const struct shm_segment *seg);
uint64_t shm_bytes(const struct shm_segment *seg);
const struct shm_header *shm_header(const struct shm_segment *seg);
/* Table entry i < n_entries (in offset order). */
const struct shm_entry *shm_entry_at(const struct shm_segment *seg, uint32_t i);

/* The entry of (layer, kind), or NULL when the model has no such tensor
 * (e.g. GATE in a model with fused GATE_UP). ASSERTs layer < n_layers and a
 * valid kind. */
const struct shm_entry *shm_entry(const struct shm_segment *seg, uint32_t layer,
                                  enum shm_kind kind);

/* Expert e's matrix of (layer, kind): n_out rows of row_bytes bytes each, of
 * type *type. NULL when the entry is absent. ASSERTs e < n_expert.
 * row_bytes and type may be NULL. */
const void *shm_expert(const struct shm_segment *seg, uint32_t layer, enum shm_kind kind,
                       uint32_t e, size_t *row_bytes, uint32_t *type);

/* ---- cleanup ---- */

/* Removes every /dev/shm/lamina-<pid>-* whose pid is not alive
 * (kill(pid, 0) fails with ESRCH; EPERM counts as alive), logging one line
 * each. Names not of that form are left alone. Returns the count removed, or
 * a negative errno when /dev/shm cannot be read. Pids are those of this pid
 * namespace: containers sharing /dev/shm across pid namespaces must not run
 * it. */
int shm_cleanup_stale(void);

/* Removes the segment's name, for the coordinator's signal handler (which
 * keeps a copy of shm_name() made before installing it): builds
 * "/dev/shm/<name>" in a stack buffer by hand and calls unlink(2), which
 * POSIX lists as async-signal-safe (shm_unlink itself is not on that list);
 * errno is preserved. Does not unmap and does not log; mappings stay valid
 * until unmapped. Returns 0, -EINVAL (not "/..."), -ENAMETOOLONG, or the
 * unlink error (-ENOENT when already gone). */
int shm_unlink_name(const char *name);

#endif
