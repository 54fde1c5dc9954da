/*
 * shm: the expert segment (see shm.h for the layout and the process rules).
 *
 * Creation order matters for the failure model: the name is created with
 * O_EXCL (so a segment we did not make is never touched), the space is
 * checked and then reserved with posix_fallocate before anything is mapped
 * (so a small /dev/shm is one error line, never a SIGBUS), READY is stored
 * with release order after every copy thread has been joined, and only then
 * is the mapping made read-only. Every failure after the name exists goes
 * through shm_create_fail, which unmaps, closes and unlinks.
 *
 * Reading order: shm_validate checks the header before it reads any entry,
 * bounds n_entries by the mapped bytes before walking the table, and divides
 * before it multiplies; entries must ascend in (layer, kind) and in offset,
 * which rules out duplicates and overlaps without an allocation.
 */
#include "ipc/shm.h"

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <inttypes.h>
#include <pthread.h>
#include <signal.h>
#include <stdatomic.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/resource.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <time.h>
#include <unistd.h>

#include "common/check.h"
#include "common/log.h"
#include "model/quant.h"

#define SHM_DIR "/dev/shm"            /* where glibc keeps POSIX shm objects on Linux */
#define SHM_PREFIX "lamina-"          /* file-name prefix of our segments */
#define SHM_COPY_CHUNK (64ull << 20)  /* bytes one copy task moves */
#define SHM_MAX_THREADS 8u            /* default copy threads: memcpy saturates DRAM early */
#define SHM_HASH_SAMPLE 32u           /* leading data bytes of each tensor in the model hash */
#define SHM_FNV_OFFSET 0xcbf29ce484222325ull
#define SHM_FNV_PRIME 0x100000001b3ull

struct shm_segment {
    char name[SHM_NAME_MAX];          /* "/lamina-..." */
    uint8_t *base;                    /* the mapping, read-only once returned */
    uint64_t size;                    /* bytes mapped */
    bool owner;                       /* made by shm_create: destroy unlinks */
    const struct shm_header *hdr;     /* base */
    const struct shm_entry *table;    /* base + header_bytes */
    const struct shm_entry **index;   /* n_layers * SHM_KIND_COUNT, NULL where absent; owned */
};

/* One copy task: len bytes of entry's tensor starting at off. */
struct shm_chunk {
    uint32_t entry; /* index into the layout */
    uint64_t off;   /* bytes into the tensor */
    uint64_t len;   /* bytes */
};

/* State shared by the copy threads. */
struct shm_copy {
    const struct shm_layout *layout; /* what goes where */
    uint8_t *base;                   /* destination mapping */
    const struct shm_chunk *chunks;  /* n_chunks tasks */
    uint64_t n_chunks;               /* tasks */
    atomic_uint_fast64_t next;       /* next task to take */
    atomic_uint_fast64_t done;       /* bytes copied so far */
};

/* ---- small helpers ---- */

/* x rounded up to SHM_ALIGN; false on overflow. */
static bool shm_align_up(uint64_t x, uint64_t *out)
{
    if (x > UINT64_MAX - (SHM_ALIGN - 1))
        return false;
    *out = (x + SHM_ALIGN - 1) & ~(uint64_t)(SHM_ALIGN - 1);
    return true;
}

static uint64_t shm_fnv(uint64_t h, const void *p, size_t n)
{
    const uint8_t *b = p;
    for (size_t i = 0; i < n; i++) {
        h ^= b[i];
        h *= SHM_FNV_PRIME;
    }
    return h;
}

static uint64_t shm_fnv_u64(uint64_t h, uint64_t v)
{
    return shm_fnv(h, &v, sizeof(v));
}

static double shm_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + 1e-9 * (double)ts.tv_nsec;
}

/* ---- layout planning ---- */

/* The matrix of a layer that an entry kind stores. */
static const struct arch_matrix *shm_layer_matrix(const struct arch_layer *ly, enum shm_kind k)
{
    switch (k) {
    case SHM_KIND_GATE:
        return &ly->gate_exps;
    case SHM_KIND_UP:
        return &ly->up_exps;
    case SHM_KIND_DOWN:
        return &ly->down_exps;
    case SHM_KIND_GATE_UP:
        return &ly->gate_up_exps;
    default:
        ASSERT(0);
        return NULL;
    }
}

/* Fills e (all but offset) from matrix m of layer l. */
static int shm_entry_fill(struct shm_entry *e, uint32_t l, enum shm_kind k,
                          const struct arch_matrix *m)
{
    const char *name = m->name ? m->name : "?";
    memset(e, 0, sizeof(*e));
    if (strlen(name) >= SHM_ENTRY_NAME) {
        log_error("shm layout: tensor name %s is longer than %d bytes", name,
                  SHM_ENTRY_NAME - 1);
        return -EINVAL;
    }
    size_t row = quant_row_size(m->type, m->n_in);
    if (m->n_mat == 0 || m->n_mat > UINT32_MAX || m->n_out == 0 || row == 0 ||
        row != m->row_bytes || m->n_out > UINT64_MAX / row || m->n_out * row != m->mat_bytes ||
        m->n_mat > UINT64_MAX / m->mat_bytes) {
        log_error("shm layout: tensor %s has an unusable shape (type %u, %" PRIu64 " x %" PRIu64
                  " x %" PRIu64 ", row %zu bytes)", name, m->type, m->n_in, m->n_out, m->n_mat,
                  m->row_bytes);
        return -EINVAL;
    }
    e->layer = l;
    e->kind = (uint32_t)k;
    e->type = m->type;
    e->n_expert = (uint32_t)m->n_mat;
    e->n_in = m->n_in;
    e->n_out = m->n_out;
    e->row_bytes = row;
    e->bytes_per_expert = m->mat_bytes;
    e->bytes = m->n_mat * m->mat_bytes;
    memcpy(e->name, name, strlen(name) + 1);
    return 0;
}

/* Places entries from data_offset on, each at the next SHM_ALIGN boundary. */
static int shm_layout_place(struct shm_layout *out)
{
    uint64_t table_end = sizeof(struct shm_header) +
                         (uint64_t)out->n_entries * sizeof(struct shm_entry);
    uint64_t cur;
    if (!shm_align_up(table_end, &cur))
        return -EINVAL;
    out->data_offset = cur;
    for (uint32_t i = 0; i < out->n_entries; i++) {
        struct shm_entry *e = &out->entries[i];
        e->offset = cur;
        if (e->bytes > UINT64_MAX - cur || !shm_align_up(cur + e->bytes, &cur) ||
            out->payload_bytes > UINT64_MAX - e->bytes) {
            log_error("shm layout: segment size overflows at tensor %s", e->name);
            return -EINVAL;
        }
        out->payload_bytes += e->bytes;
    }
    out->total_bytes = cur;
    return 0;
}

int shm_layout_plan(const struct arch_model *model, struct shm_layout *out)
{
    memset(out, 0, sizeof(*out));
    uint32_t n = 0;
    for (uint32_t l = 0; l < model->hp.n_layer; l++)
        for (int k = 0; k < SHM_KIND_COUNT; k++)
            n += shm_layer_matrix(&model->layers[l], (enum shm_kind)k)->data != NULL;
    if (n == 0) {
        log_error("shm layout: the model has no routed expert tensors");
        return -EINVAL;
    }
    out->n_layers = model->hp.n_layer;
    out->n_entries = n;
    out->entries = calloc(n, sizeof(*out->entries));
    out->src = calloc(n, sizeof(*out->src));
    if (!out->entries || !out->src) {
        log_error("shm layout: out of memory for %u entries", n);
        shm_layout_free(out);
        return -ENOMEM;
    }
    uint32_t i = 0;
    for (uint32_t l = 0; l < model->hp.n_layer; l++) {
        for (int k = 0; k < SHM_KIND_COUNT; k++) {
            const struct arch_matrix *m = shm_layer_matrix(&model->layers[l], (enum shm_kind)k);
            if (!m->data)
                continue;
            if (shm_entry_fill(&out->entries[i], l, (enum shm_kind)k, m)) {
                shm_layout_free(out);
                return -EINVAL;
            }
            out->src[i++] = m->data;
        }
    }
    if (shm_layout_place(out)) {
        shm_layout_free(out);
        return -EINVAL;
    }
    return 0;
}

void shm_layout_free(struct shm_layout *layout)
{
    free(layout->entries);
    free(layout->src);
    memset(layout, 0, sizeof(*layout));
}

size_t shm_size(const struct shm_layout *layout)
{
    return (size_t)layout->total_bytes;
}

void shm_init(void *base, const struct shm_layout *layout, uint64_t model_hash,
              uint64_t model_file_size, uint32_t creator_pid)
{
    ASSERT(layout->data_offset >= sizeof(struct shm_header) +
                                      (uint64_t)layout->n_entries * sizeof(struct shm_entry));
    memset(base, 0, (size_t)layout->data_offset);
    struct shm_header *h = base;
    memcpy(h->magic, SHM_MAGIC, sizeof(h->magic));
    h->version = SHM_VERSION;
    h->header_bytes = sizeof(struct shm_header);
    h->total_bytes = layout->total_bytes;
    h->n_layers = layout->n_layers;
    h->n_entries = layout->n_entries;
    h->creator_pid = creator_pid;
    h->flags = 0;
    h->model_file_size = model_file_size;
    h->model_hash = model_hash;
    h->data_offset = layout->data_offset;
    h->entry_bytes = sizeof(struct shm_entry);
    memcpy((uint8_t *)base + sizeof(*h), layout->entries,
           (size_t)layout->n_entries * sizeof(struct shm_entry));
}

uint64_t shm_model_hash(const struct gguf *g)
{
    uint64_t h = shm_fnv_u64(SHM_FNV_OFFSET, gguf_file_size(g));
    uint64_t n = gguf_n_tensors(g);
    h = shm_fnv_u64(h, n);
    for (uint64_t i = 0; i < n; i++) {
        const struct gguf_tensor *t = gguf_tensor_at(g, i);
        h = shm_fnv(h, t->name, strlen(t->name) + 1);
        h = shm_fnv_u64(h, t->n_dims);
        for (int d = 0; d < GGUF_MAX_DIMS; d++)
            h = shm_fnv_u64(h, (uint64_t)t->ne[d]);
        h = shm_fnv_u64(h, t->type);
        h = shm_fnv_u64(h, t->offset);
        h = shm_fnv_u64(h, t->nbytes);
        h = shm_fnv(h, t->data, t->nbytes < SHM_HASH_SAMPLE ? t->nbytes : SHM_HASH_SAMPLE);
    }
    return h;
}

/* ---- validation ---- */

static int shm_validate_header(const struct shm_header *h, uint64_t size, uint64_t expected_hash,
                               const char *what)
{
    static const uint8_t zero[sizeof(h->reserved)];
    /* READY first, with acquire order: what it publishes is read after it */
    uint32_t flags = __atomic_load_n(&h->flags, __ATOMIC_ACQUIRE);
    if (memcmp(h->magic, SHM_MAGIC, sizeof(h->magic)) != 0) {
        log_error("shm %s: bad magic (not a lamina expert segment)", what);
        return -EPROTO;
    }
    if (h->version != SHM_VERSION) {
        log_error("shm %s: layout version %u, this build reads version %u", what, h->version,
                  SHM_VERSION);
        return -EPROTO;
    }
    if (h->header_bytes != sizeof(*h) || h->entry_bytes != sizeof(struct shm_entry)) {
        log_error("shm %s: header_bytes %u / entry_bytes %u, expected %zu / %zu", what,
                  h->header_bytes, h->entry_bytes, sizeof(*h), sizeof(struct shm_entry));
        return -EPROTO;
    }
    if (h->total_bytes != size || size % SHM_ALIGN) {
        log_error("shm %s: header total_bytes %" PRIu64 ", the segment has %" PRIu64
                  " bytes (must be equal and a multiple of %u)", what, h->total_bytes, size,
                  SHM_ALIGN);
        return -EPROTO;
    }
    if (memcmp(h->reserved, zero, sizeof(zero)) != 0) {
        log_error("shm %s: reserved header bytes are not zero", what);
        return -EPROTO;
    }
    if (flags & ~SHM_FLAG_READY) {
        log_error("shm %s: unknown flags 0x%x", what, flags);
        return -EPROTO;
    }
    if (!(flags & SHM_FLAG_READY)) {
        log_error("shm %s: not ready (creator pid %u has not finished copying)", what,
                  h->creator_pid);
        return -EPROTO;
    }
    if (h->n_layers == 0 || h->n_layers > SHM_MAX_LAYERS || h->n_entries == 0 ||
        h->n_entries > (uint64_t)h->n_layers * SHM_KIND_COUNT) {
        log_error("shm %s: n_layers %u / n_entries %u out of range (1..%u layers, 1..%u entries "
                  "per layer)", what, h->n_layers, h->n_entries, SHM_MAX_LAYERS, SHM_KIND_COUNT);
        return -EPROTO;
    }
    uint64_t data_offset;
    shm_align_up(sizeof(*h) + (uint64_t)h->n_entries * sizeof(struct shm_entry), &data_offset);
    if (h->data_offset != data_offset || data_offset > size) {
        log_error("shm %s: data_offset %" PRIu64 ", expected %" PRIu64 " inside %" PRIu64
                  " bytes", what, h->data_offset, data_offset, size);
        return -EPROTO;
    }
    if (h->model_hash != expected_hash) {
        log_error("shm %s: made from another model file (hash %016" PRIx64 ", file size %" PRIu64
                  "; this GGUF hashes to %016" PRIx64 ")", what, h->model_hash,
                  h->model_file_size, expected_hash);
        return -EPROTO;
    }
    return 0;
}

/* Entry i; prev_end is where the previous entry ended (data_offset for i = 0)
 * and prev_key its layer * SHM_KIND_COUNT + kind (-1 for i = 0). */
static int shm_validate_entry(const struct shm_entry *e, uint32_t i, uint32_t n_layers,
                              uint64_t size, uint64_t *prev_end, int64_t *prev_key,
                              const char *what)
{
    if (!memchr(e->name, 0, sizeof(e->name)) || e->name[0] == 0) {
        log_error("shm %s: entry %u has no NUL-terminated name", what, i);
        return -EPROTO;
    }
    int64_t key = (int64_t)e->layer * SHM_KIND_COUNT + e->kind;
    if (e->layer >= n_layers || e->kind >= SHM_KIND_COUNT || key <= *prev_key) {
        log_error("shm %s: entry %u (%s): layer %u / kind %u out of range or out of order", what,
                  i, e->name, e->layer, e->kind);
        return -EPROTO;
    }
    if (!quant_type_name(e->type)) {
        log_error("shm %s: entry %u (%s): unknown type %u", what, i, e->name, e->type);
        return -EPROTO;
    }
    uint64_t row = quant_row_size(e->type, e->n_in);
    if (row == 0 || e->row_bytes != row || e->n_expert == 0 || e->n_out == 0) {
        log_error("shm %s: entry %u (%s): type %s, n_in %" PRIu64 ", row_bytes %" PRIu64
                  ", n_out %" PRIu64 ", n_expert %u are inconsistent", what, i, e->name,
                  quant_type_name(e->type), e->n_in, e->row_bytes, e->n_out, e->n_expert);
        return -EPROTO;
    }
    if (e->n_out > UINT64_MAX / row || e->bytes_per_expert != e->n_out * row ||
        e->n_expert > UINT64_MAX / e->bytes_per_expert ||
        e->bytes != e->n_expert * e->bytes_per_expert) {
        log_error("shm %s: entry %u (%s): bytes_per_expert %" PRIu64 " / bytes %" PRIu64
                  " do not match %" PRIu64 " rows x %" PRIu64 " bytes x %u experts", what, i,
                  e->name, e->bytes_per_expert, e->bytes, e->n_out, row, e->n_expert);
        return -EPROTO;
    }
    if (e->offset % SHM_ALIGN) {
        log_error("shm %s: entry %u (%s): offset %" PRIu64 " is not a multiple of %u", what, i,
                  e->name, e->offset, SHM_ALIGN);
        return -EPROTO;
    }
    if (e->offset < *prev_end) {
        log_error("shm %s: entry %u (%s): offset %" PRIu64 " overlaps the previous entry or the "
                  "table, which end at %" PRIu64, what, i, e->name, e->offset, *prev_end);
        return -EPROTO;
    }
    if (e->offset > size || e->bytes > size - e->offset) {
        log_error("shm %s: entry %u (%s): offset %" PRIu64 " + %" PRIu64 " bytes ends past the "
                  "segment's %" PRIu64 " bytes", what, i, e->name, e->offset, e->bytes, size);
        return -EPROTO;
    }
    *prev_end = e->offset + e->bytes;
    *prev_key = key;
    return 0;
}

int shm_validate(const void *base, uint64_t size, uint64_t expected_hash, const char *what)
{
    const struct shm_header *h = base;
    if (size < sizeof(*h)) {
        log_error("shm %s: %" PRIu64 " bytes, smaller than the %zu-byte header", what, size,
                  sizeof(*h));
        return -EPROTO;
    }
    int rc = shm_validate_header(h, size, expected_hash, what);
    if (rc)
        return rc;
    const struct shm_entry *table = (const void *)((const uint8_t *)base + sizeof(*h));
    uint64_t prev_end = h->data_offset;
    int64_t prev_key = -1;
    for (uint32_t i = 0; i < h->n_entries; i++) {
        rc = shm_validate_entry(&table[i], i, h->n_layers, size, &prev_end, &prev_key, what);
        if (rc)
            return rc;
    }
    return 0;
}

/* ---- the segment object ---- */

/* Builds the (layer, kind) index of a validated mapping. */
static int shm_segment_index(struct shm_segment *seg)
{
    seg->hdr = (const struct shm_header *)seg->base;
    seg->table = (const struct shm_entry *)(seg->base + sizeof(struct shm_header));
    seg->index = calloc((size_t)seg->hdr->n_layers * SHM_KIND_COUNT, sizeof(*seg->index));
    if (!seg->index) {
        log_error("shm %s: out of memory for the index of %u layers", seg->name,
                  seg->hdr->n_layers);
        return -ENOMEM;
    }
    for (uint32_t i = 0; i < seg->hdr->n_entries; i++) {
        const struct shm_entry *e = &seg->table[i];
        seg->index[(size_t)e->layer * SHM_KIND_COUNT + e->kind] = e;
    }
    return 0;
}

static bool shm_name_ok(const char *name)
{
    size_t n = strnlen(name, SHM_NAME_MAX);
    return n > 1 && n < SHM_NAME_MAX && name[0] == '/' && !strchr(name + 1, '/');
}

/* ---- copying ---- */

static void shm_copy_one(struct shm_copy *cp, const struct shm_chunk *c)
{
    const struct shm_entry *e = &cp->layout->entries[c->entry];
    memcpy(cp->base + e->offset + c->off, (const uint8_t *)cp->layout->src[c->entry] + c->off,
           (size_t)c->len);
    atomic_fetch_add(&cp->done, c->len);
}

static void *shm_copy_thread(void *arg)
{
    struct shm_copy *cp = arg;
    for (uint64_t i; (i = atomic_fetch_add(&cp->next, 1)) < cp->n_chunks;)
        shm_copy_one(cp, &cp->chunks[i]);
    return NULL;
}

/* Splits every entry into chunks of at most SHM_COPY_CHUNK bytes. */
static struct shm_chunk *shm_copy_chunks(const struct shm_layout *layout, uint64_t *n_chunks)
{
    uint64_t n = 0;
    for (uint32_t i = 0; i < layout->n_entries; i++)
        n += (layout->entries[i].bytes + SHM_COPY_CHUNK - 1) / SHM_COPY_CHUNK;
    struct shm_chunk *chunks = calloc(n ? n : 1, sizeof(*chunks));
    if (!chunks) {
        log_error("shm: out of memory for %" PRIu64 " copy tasks", n);
        return NULL;
    }
    uint64_t k = 0;
    for (uint32_t i = 0; i < layout->n_entries; i++) {
        for (uint64_t off = 0; off < layout->entries[i].bytes; off += SHM_COPY_CHUNK) {
            uint64_t left = layout->entries[i].bytes - off;
            chunks[k++] = (struct shm_chunk){i, off, left < SHM_COPY_CHUNK ? left : SHM_COPY_CHUNK};
        }
    }
    *n_chunks = n;
    return chunks;
}

/* Copies every tensor into base with n_threads threads (the caller's included),
 * calling progress on the calling thread. */
static int shm_copy_all(const struct shm_layout *layout, uint8_t *base, uint32_t n_threads,
                        const struct shm_create_config *cfg)
{
    struct shm_copy cp = {.layout = layout, .base = base};
    struct shm_chunk *chunks = shm_copy_chunks(layout, &cp.n_chunks);
    if (!chunks)
        return -ENOMEM;
    cp.chunks = chunks;
    atomic_init(&cp.next, 0);
    atomic_init(&cp.done, 0);
    if (n_threads > cp.n_chunks)
        n_threads = cp.n_chunks ? (uint32_t)cp.n_chunks : 1;
    pthread_t tids[SHM_MAX_THREADS * 8];
    uint32_t started = 0;
    if (n_threads > sizeof(tids) / sizeof(tids[0]))
        n_threads = sizeof(tids) / sizeof(tids[0]);
    for (; started + 1 < n_threads; started++) {
        int e = pthread_create(&tids[started], NULL, shm_copy_thread, &cp);
        if (e) {
            log_warn("shm: copy thread %u not started (%s); copying with %u", started + 1,
                     strerror(e), started + 1);
            break;
        }
    }
    for (uint64_t i; (i = atomic_fetch_add(&cp.next, 1)) < cp.n_chunks;) {
        shm_copy_one(&cp, &chunks[i]);
        if (cfg->progress)
            cfg->progress(cfg->progress_ctx, atomic_load(&cp.done), layout->payload_bytes);
    }
    for (uint32_t t = 0; t < started; t++)
        pthread_join(tids[t], NULL);
    if (cfg->progress)
        cfg->progress(cfg->progress_ctx, atomic_load(&cp.done), layout->payload_bytes);
    free(chunks);
    return 0;
}

/* ---- creation ---- */

/* Fails up front when the filesystem behind fd (or RLIMIT_FSIZE) cannot hold need bytes. */
static int shm_check_space(int fd, const char *name, uint64_t need)
{
    struct statvfs vfs;
    if (SYS_CHECK(fstatvfs(fd, &vfs)))
        return -EIO;
    uint64_t free_bytes = (uint64_t)vfs.f_bavail * vfs.f_frsize;
    if (need > free_bytes) {
        log_error("shm %s: need %" PRIu64 " bytes in " SHM_DIR ", it has %" PRIu64 " free "
                  "(enlarge the tmpfs, e.g. docker --shm-size, or free it)", name, need,
                  free_bytes);
        return -ENOSPC;
    }
    struct rlimit rl;
    if (getrlimit(RLIMIT_FSIZE, &rl) == 0 && rl.rlim_cur != RLIM_INFINITY && need > rl.rlim_cur) {
        log_error("shm %s: need %" PRIu64 " bytes in " SHM_DIR ", but the file size limit "
                  "(RLIMIT_FSIZE, ulimit -f) is %" PRIu64 " bytes", name, need,
                  (uint64_t)rl.rlim_cur);
        return -EFBIG;
    }
    return 0;
}

/* Sizes and reserves the whole segment. */
static int shm_reserve(int fd, const char *name, uint64_t need)
{
    int rc = shm_check_space(fd, name, need);
    if (rc)
        return rc;
    if (SYS_CHECK(ftruncate(fd, (off_t)need)))
        return -EIO;
    int e;
    do
        e = posix_fallocate(fd, 0, (off_t)need);
    while (e == EINTR);
    if (e == ENOSPC || e == EFBIG) {
        struct statvfs vfs;
        uint64_t free_bytes = fstatvfs(fd, &vfs) ? 0 : (uint64_t)vfs.f_bavail * vfs.f_frsize;
        log_error("shm %s: need %" PRIu64 " bytes in " SHM_DIR ", it has %" PRIu64 " free "
                  "(posix_fallocate: %s)", name, need, free_bytes, strerror(e));
        return -e;
    }
    if (e) {
        log_error("shm %s: posix_fallocate of %" PRIu64 " bytes failed: %s", name, need,
                  strerror(e));
        return -e;
    }
    return 0;
}

/* Undoes a partial shm_create: the mapping, the fd, the name, the object. */
static void shm_create_fail(struct shm_segment *seg, int fd, struct shm_layout *layout)
{
    if (seg->base)
        munmap(seg->base, seg->size);
    if (fd >= 0)
        close(fd);
    if (seg->owner)
        shm_unlink(seg->name);
    shm_layout_free(layout);
    free(seg->index);
    free(seg);
}

static uint32_t shm_default_threads(uint32_t requested)
{
    if (requested)
        return requested;
    long n = sysconf(_SC_NPROCESSORS_ONLN);
    return n < 1 ? 1 : n > (long)SHM_MAX_THREADS ? SHM_MAX_THREADS : (uint32_t)n;
}

/* Maps seg read-write, fills it and seals it; fd is the sized segment. */
static int shm_fill(struct shm_segment *seg, int fd, const struct shm_layout *layout,
                    uint64_t hash, const struct shm_create_config *cfg)
{
    void *p = mmap(NULL, seg->size, PROT_READ | PROT_WRITE, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
        int e = errno;
        log_error("shm %s: mmap of %" PRIu64 " bytes failed: %s", seg->name, seg->size,
                  strerror(e));
        return -e;
    }
    seg->base = p;
    madvise(p, seg->size, MADV_HUGEPAGE); /* best effort: tmpfs may refuse huge pages */
    shm_init(p, layout, hash, gguf_file_size(cfg->gguf), (uint32_t)getpid());
    uint32_t n_threads = shm_default_threads(cfg->n_threads);
    double t0 = shm_now();
    int rc = shm_copy_all(layout, seg->base, n_threads, cfg);
    if (rc)
        return rc;
    double secs = shm_now() - t0;
    __atomic_store_n(&((struct shm_header *)p)->flags, SHM_FLAG_READY, __ATOMIC_RELEASE);
    if (SYS_CHECK(mprotect(p, seg->size, PROT_READ)) || SYS_CHECK(fchmod(fd, 0400)))
        return -EIO;
    log_info("shm %s: %u expert tensors of %u layers, %" PRIu64 " bytes copied in %.3f s "
             "(%.2f GB/s, %u threads), segment %" PRIu64 " bytes", seg->name, layout->n_entries,
             layout->n_layers, layout->payload_bytes, secs,
             secs > 0 ? (double)layout->payload_bytes / secs / 1e9 : 0.0, n_threads, seg->size);
    return 0;
}

struct shm_segment *shm_create(const struct shm_create_config *cfg)
{
    ASSERT(cfg && cfg->model && cfg->gguf);
    struct shm_layout layout;
    if (shm_layout_plan(cfg->model, &layout))
        return NULL;
    struct shm_segment *seg = calloc(1, sizeof(*seg));
    if (!seg) {
        log_error("shm: out of memory");
        shm_layout_free(&layout);
        return NULL;
    }
    uint64_t hash = shm_model_hash(cfg->gguf);
    snprintf(seg->name, sizeof(seg->name), "/" SHM_PREFIX "%d-%016" PRIx64 "-%u", (int)getpid(),
             hash, cfg->instance);
    seg->size = layout.total_bytes;
    int fd = shm_open(seg->name, O_CREAT | O_EXCL | O_RDWR | O_CLOEXEC, 0600);
    if (fd < 0) {
        if (errno == EEXIST)
            log_error("shm %s: already exists (made earlier by this process with the same "
                      "instance, or left by a dead process whose pid was reused)", seg->name);
        else
            log_error("shm %s: shm_open failed: %s", seg->name, strerror(errno));
        shm_create_fail(seg, -1, &layout);
        return NULL;
    }
    seg->owner = true;
    if (shm_reserve(fd, seg->name, seg->size) || shm_fill(seg, fd, &layout, hash, cfg) ||
        shm_segment_index(seg)) {
        shm_create_fail(seg, fd, &layout);
        return NULL;
    }
    close(fd);
    shm_layout_free(&layout);
    return seg;
}

struct shm_segment *shm_open_ro(const char *name, uint64_t expected_hash)
{
    if (!name || !shm_name_ok(name)) {
        log_error("shm: bad segment name %s (want \"/lamina-...\", under %d bytes)",
                  name ? name : "(null)", SHM_NAME_MAX);
        return NULL;
    }
    struct shm_segment *seg = calloc(1, sizeof(*seg));
    if (!seg) {
        log_error("shm %s: out of memory", name);
        return NULL;
    }
    snprintf(seg->name, sizeof(seg->name), "%s", name);
    int fd = shm_open(name, O_RDONLY | O_CLOEXEC, 0);
    struct stat st;
    if (fd < 0) {
        log_error("shm %s: cannot open: %s", name, strerror(errno));
        goto out_free;
    }
    if (fstat(fd, &st)) {
        log_error("shm %s: fstat failed: %s", name, strerror(errno));
        goto out_close;
    }
    if ((uint64_t)st.st_size < sizeof(struct shm_header)) {
        log_error("shm %s: %lld bytes, smaller than the %zu-byte header", name,
                  (long long)st.st_size, sizeof(struct shm_header));
        goto out_close;
    }
    seg->size = (uint64_t)st.st_size;
    void *p = mmap(NULL, seg->size, PROT_READ, MAP_SHARED, fd, 0);
    if (p == MAP_FAILED) {
        log_error("shm %s: mmap of %" PRIu64 " bytes failed: %s", name, seg->size,
                  strerror(errno));
        goto out_close;
    }
    seg->base = p;
    close(fd);
    if (shm_validate(p, seg->size, expected_hash, name) || shm_segment_index(seg)) {
        shm_destroy(seg);
        return NULL;
    }
    return seg;
out_close:
    close(fd);
out_free:
    free(seg);
    return NULL;
}

void shm_destroy(struct shm_segment *seg)
{
    if (!seg)
        return;
    if (seg->base)
        munmap(seg->base, seg->size);
    if (seg->owner && shm_unlink(seg->name) && errno != ENOENT)
        log_warn("shm %s: shm_unlink failed: %s", seg->name, strerror(errno));
    free(seg->index);
    free(seg);
}

/* ---- lookups ---- */

const char *shm_name(const struct shm_segment *seg)
{
    return seg->name;
}

const void *shm_base(const struct shm_segment *seg)
{
    return seg->base;
}

uint64_t shm_bytes(const struct shm_segment *seg)
{
    return seg->size;
}

const struct shm_header *shm_header(const struct shm_segment *seg)
{
    return seg->hdr;
}

const struct shm_entry *shm_entry_at(const struct shm_segment *seg, uint32_t i)
{
    ASSERT(i < seg->hdr->n_entries);
    return &seg->table[i];
}

const struct shm_entry *shm_entry(const struct shm_segment *seg, uint32_t layer,
                                  enum shm_kind kind)
{
    ASSERT(layer < seg->hdr->n_layers && (unsigned)kind < SHM_KIND_COUNT);
    return seg->index[(size_t)layer * SHM_KIND_COUNT + kind];
}

const void *shm_expert(const struct shm_segment *seg, uint32_t layer, enum shm_kind kind,
                       uint32_t e, size_t *row_bytes, uint32_t *type)
{
    const struct shm_entry *en = shm_entry(seg, layer, kind);
    if (!en)
        return NULL;
    ASSERT(e < en->n_expert);
    if (row_bytes)
        *row_bytes = (size_t)en->row_bytes;
    if (type)
        *type = en->type;
    return seg->base + en->offset + (uint64_t)e * en->bytes_per_expert;
}

/* ---- cleanup ---- */

/* The pid in "lamina-<pid>-...", or 0 when the name is not of that form. */
static pid_t shm_name_pid(const char *file)
{
    size_t plen = strlen(SHM_PREFIX);
    if (strncmp(file, SHM_PREFIX, plen) != 0)
        return 0;
    const char *p = file + plen;
    long long pid = 0;
    int digits = 0;
    for (; *p >= '0' && *p <= '9' && digits < 10; p++, digits++)
        pid = pid * 10 + (*p - '0');
    if (digits == 0 || *p != '-' || pid <= 0 || pid > INT32_MAX)
        return 0;
    return (pid_t)pid;
}

int shm_cleanup_stale(void)
{
    DIR *d = opendir(SHM_DIR);
    if (!d) {
        int e = errno;
        log_error("shm: cannot read " SHM_DIR " to remove stale segments: %s", strerror(e));
        return -e;
    }
    int removed = 0;
    struct dirent *de;
    while ((de = readdir(d))) {
        pid_t pid = shm_name_pid(de->d_name);
        if (pid == 0 || kill(pid, 0) == 0 || errno != ESRCH)
            continue;
        char name[NAME_MAX + 2];
        snprintf(name, sizeof(name), "/%s", de->d_name);
        struct stat st;
        long long bytes = fstatat(dirfd(d), de->d_name, &st, 0) ? -1 : (long long)st.st_size;
        if (shm_unlink(name)) {
            if (errno != ENOENT)
                log_warn("shm %s: stale segment of dead pid %d not removed: %s", name, (int)pid,
                         strerror(errno));
            continue;
        }
        log_info("shm %s: removed stale segment of dead pid %d (%lld bytes)", name, (int)pid,
                 bytes);
        removed++;
    }
    closedir(d);
    return removed;
}

int shm_unlink_name(const char *name)
{
    /* Only unlink(2) and plain loops: this runs inside signal handlers. */
    static const char dir[] = SHM_DIR;
    char path[sizeof(dir) + SHM_NAME_MAX];
    size_t d = sizeof(dir) - 1, n = 0;
    if (!name || name[0] != '/')
        return -EINVAL;
    for (size_t i = 0; i < d; i++)
        path[i] = dir[i];
    for (; name[n]; n++) {
        if (n + 1 >= SHM_NAME_MAX)
            return -ENAMETOOLONG;
        path[d + n] = name[n];
    }
    path[d + n] = 0;
    int saved = errno;
    int rc = unlink(path) ? -errno : 0;
    errno = saved;
    return rc;
}
