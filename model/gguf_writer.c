/*
 * gguf_writer: the streaming GGUF v3 writer (see gguf_writer.h; format in
 * model-spec section 1).
 *
 * Phase 1 encodes every KV record straight into a growing byte buffer and
 * keeps the tensor infos in an array with their offsets already placed;
 * phase 2 writes both out; phase 3 tracks the current tensor and the bytes it
 * still needs. All output, headers and data, goes through out(), which
 * batches small pieces in one buffer and writes large ones directly.
 *
 * Invariant: err is 0 or the negative errno of the first I/O failure (or of a
 * failed finish); once set, nothing more is written.
 */
#include "model/gguf_writer.h"

#include <errno.h>
#include <fcntl.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/check.h"
#include "common/log.h"
#include "model/gguf.h"
#include "model/quant.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "gguf_writer.c writes host-order values: port it to big-endian hosts first"
#endif

#define GGUF_WRITER_MAGIC 0x46554747u /* "GGUF" as a little-endian uint32 */
#define GGUF_WRITER_DIRECT_ALIGN 4096u /* O_DIRECT buffer, offset and length unit, bytes */
#define GGUF_WRITER_VERSION 3u

enum gguf_writer_phase {
    GGUF_WRITER_PHASE_META = 0, /* adding KV records and tensor infos */
    GGUF_WRITER_PHASE_DATA = 1, /* header written, tensor bytes flowing */
    GGUF_WRITER_PHASE_DONE = 2, /* finished and closed successfully */
};

/* One declared tensor. */
struct gguf_writer_tensor {
    char name[GGUF_MAX_NAME];   /* NUL-terminated, 1..63 bytes */
    uint32_t type;              /* enum quant_type */
    uint32_t n_dims;            /* 1..4 */
    int64_t ne[GGUF_MAX_DIMS];  /* fastest first; unused dims are 1 */
    uint64_t offset;            /* relative to the data section */
    uint64_t nbytes;            /* data bytes, without padding */
};

struct gguf_writer {
    char *path;                 /* owned copy of cfg->path, for messages and unlink */
    int fd;                     /* the output file, -1 once closed */
    bool remove_on_fail;        /* path is a regular file we may unlink */
    bool direct;                /* fd has O_DIRECT: write whole aligned blocks from buf */
    uint32_t alignment;         /* power of two >= 8 */
    enum gguf_writer_phase phase;
    int err;                    /* first I/O failure, 0 if none */
    uint8_t *buf;               /* output buffer */
    size_t buf_cap;             /* bytes at buf */
    size_t buf_used;            /* bytes waiting in buf */
    uint64_t flushed;           /* bytes handed to the file so far */
    uint8_t *kv;                /* encoded KV records */
    size_t kv_len;              /* bytes used at kv */
    size_t kv_cap;              /* bytes allocated at kv */
    char **keys;                /* owned copies of the keys, for duplicate checks */
    uint64_t n_kv;              /* records in kv and keys */
    uint64_t keys_cap;          /* slots at keys */
    bool has_alignment_key;     /* general.alignment was added */
    struct gguf_writer_tensor *tensors; /* declared tensors, in file order */
    uint64_t n_tensors;         /* entries used at tensors */
    uint64_t tensors_cap;       /* entries allocated at tensors */
    uint64_t data_size;         /* padded bytes of all declared tensors */
    uint64_t data_left;         /* phase 3: unpadded bytes still to come */
    uint64_t cur;               /* phase 3: index of the tensor being written */
    uint64_t cur_done;          /* phase 3: bytes of tensor cur written */
};

/* Encoded size of a scalar metadata type; 0 for STRING, ARRAY and unknown. */
static size_t gguf_writer_scalar_size(uint32_t type)
{
    static const uint8_t sizes[GGUF_TYPE_COUNT] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};
    return type < GGUF_TYPE_COUNT ? sizes[type] : 0;
}

static uint64_t gguf_writer_pad(uint64_t n, uint64_t a)
{
    return (a - n % a) % a;
}

/* Turns O_DIRECT off (a refused or unaligned direct write); 0 or -errno. */
static int gguf_writer_undirect(struct gguf_writer *w)
{
    int flags = fcntl(w->fd, F_GETFL);
    if (flags < 0 || fcntl(w->fd, F_SETFL, flags & ~O_DIRECT) < 0) {
        int e = errno;
        log_error("gguf writer %s: cannot turn O_DIRECT off: %s", w->path, strerror(e));
        w->err = -e;
        return w->err;
    }
    w->direct = false;
    return 0;
}

/* Writes n bytes to the file, retrying short writes; fails the writer. */
static int gguf_writer_write_all(struct gguf_writer *w, const uint8_t *p, size_t n)
{
    while (n > 0) {
        ssize_t k = write(w->fd, p, n);
        if (k < 0 && errno == EINTR)
            continue;
        if (k < 0 && errno == EINVAL && w->direct) {
            if (gguf_writer_undirect(w))
                return w->err;
            continue;
        }
        if (k <= 0) {
            int e = k < 0 ? errno : EIO;
            log_error("gguf writer %s: write of %zu bytes at offset %llu failed: %s", w->path, n,
                      (unsigned long long)w->flushed, strerror(e));
            w->err = -e;
            return w->err;
        }
        p += k;
        n -= (size_t)k;
        w->flushed += (uint64_t)k;
    }
    return 0;
}

static int gguf_writer_flush(struct gguf_writer *w)
{
    if (w->buf_used == 0)
        return 0;
    int rc = gguf_writer_write_all(w, w->buf, w->buf_used);
    w->buf_used = 0;
    return rc;
}

/* O_DIRECT output: everything is copied into the aligned buffer, which is
 * written out whenever it is full (a whole number of aligned blocks). */
static int gguf_writer_out_direct(struct gguf_writer *w, const uint8_t *p, size_t n)
{
    while (n > 0) {
        size_t k = w->buf_cap - w->buf_used;
        k = k < n ? k : n;
        memcpy(w->buf + w->buf_used, p, k);
        w->buf_used += k;
        p += k;
        n -= k;
        if (w->buf_used == w->buf_cap) {
            int rc = gguf_writer_flush(w);
            if (rc)
                return rc;
        }
    }
    return 0;
}

/* Appends n bytes to the output: buffered when small, direct when large. */
static int gguf_writer_out(struct gguf_writer *w, const void *p, size_t n)
{
    if (w->err)
        return w->err;
    if (w->direct)
        return gguf_writer_out_direct(w, p, n);
    if (w->buf_used + n <= w->buf_cap) {
        memcpy(w->buf + w->buf_used, p, n);
        w->buf_used += n;
        return 0;
    }
    int rc = gguf_writer_flush(w);
    if (rc)
        return rc;
    if (n >= w->buf_cap)
        return gguf_writer_write_all(w, p, n);
    memcpy(w->buf, p, n);
    w->buf_used = n;
    return 0;
}

static int gguf_writer_out_zeros(struct gguf_writer *w, uint64_t n)
{
    static const uint8_t zeros[256];
    while (n > 0) {
        size_t k = n < sizeof(zeros) ? (size_t)n : sizeof(zeros);
        int rc = gguf_writer_out(w, zeros, k);
        if (rc)
            return rc;
        n -= k;
    }
    return 0;
}

struct gguf_writer *gguf_writer_create(const struct gguf_writer_config *cfg)
{
    uint32_t a = cfg->alignment ? cfg->alignment : GGUF_DEFAULT_ALIGNMENT;
    if (!cfg->path || !cfg->path[0]) {
        log_error("gguf writer: no output path given");
        return NULL;
    }
    if (a < 8 || (a & (a - 1)) != 0) {
        log_error("gguf writer %s: alignment %u is not a power of two >= 8", cfg->path, a);
        return NULL;
    }
    struct gguf_writer *w = calloc(1, sizeof(*w));
    if (!w)
        goto out_nomem;
    w->fd = -1;
    w->alignment = a;
    w->buf_cap = cfg->buffer_bytes ? cfg->buffer_bytes : GGUF_WRITER_DEFAULT_BUFFER;
    if (cfg->direct) /* O_DIRECT writes whole blocks */
        w->buf_cap = (w->buf_cap + GGUF_WRITER_DIRECT_ALIGN - 1) / GGUF_WRITER_DIRECT_ALIGN *
                     GGUF_WRITER_DIRECT_ALIGN;
    w->path = strdup(cfg->path);
    if (!w->path || posix_memalign((void **)&w->buf, GGUF_WRITER_DIRECT_ALIGN, w->buf_cap))
        goto out_free;
    int flags = O_WRONLY | O_CREAT | O_TRUNC | O_CLOEXEC;
    w->fd = cfg->direct ? open(cfg->path, flags | O_DIRECT, 0644) : -1;
    w->direct = w->fd >= 0;
    if (w->fd < 0)
        w->fd = open(cfg->path, flags, 0644);
    if (w->fd < 0) {
        log_error("gguf writer %s: cannot create the file: %s", cfg->path, strerror(errno));
        goto out_free_quiet;
    }
    struct stat st;
    w->remove_on_fail = fstat(w->fd, &st) == 0 && S_ISREG(st.st_mode);
    return w;

out_free:
    free(w->buf);
    free(w->path);
    free(w);
out_nomem:
    log_error("gguf writer %s: out of memory", cfg->path);
    return NULL;
out_free_quiet:
    free(w->buf);
    free(w->path);
    free(w);
    return NULL;
}

void gguf_writer_destroy(struct gguf_writer *w)
{
    if (!w)
        return;
    if (w->fd >= 0)
        close(w->fd);
    if (w->phase != GGUF_WRITER_PHASE_DONE && w->remove_on_fail)
        unlink(w->path);
    for (uint64_t i = 0; i < w->n_kv; i++)
        free(w->keys[i]);
    free(w->keys);
    free(w->kv);
    free(w->tensors);
    free(w->buf);
    free(w->path);
    free(w);
}

/* Grows the KV buffer to hold n more bytes. */
static int gguf_writer_kv_reserve(struct gguf_writer *w, size_t n)
{
    if (n <= w->kv_cap - w->kv_len)
        return 0;
    if (n > SIZE_MAX / 4 - w->kv_len) {
        log_error("gguf writer %s: metadata of %zu more bytes is too large", w->path, n);
        return -ENOMEM;
    }
    size_t cap = w->kv_cap ? w->kv_cap : 4096;
    while (cap - w->kv_len < n)
        cap *= 2;
    uint8_t *p = realloc(w->kv, cap);
    if (!p) {
        log_error("gguf writer %s: out of memory for %zu bytes of metadata", w->path, cap);
        return -ENOMEM;
    }
    w->kv = p;
    w->kv_cap = cap;
    return 0;
}

/* Appends bytes to the KV buffer (space reserved by the caller). */
static void gguf_writer_kv_put(struct gguf_writer *w, const void *p, size_t n)
{
    ASSERT(n <= w->kv_cap - w->kv_len);
    if (n == 0)
        return; /* p may be NULL (an empty array) */
    memcpy(w->kv + w->kv_len, p, n);
    w->kv_len += n;
}

static int gguf_writer_kv_str(struct gguf_writer *w, const char *s, size_t len)
{
    uint64_t n = len;
    int rc = gguf_writer_kv_reserve(w, sizeof(n) + len);
    if (rc)
        return rc;
    gguf_writer_kv_put(w, &n, sizeof(n));
    gguf_writer_kv_put(w, s, len);
    return 0;
}

/* Checks the key, and a general.alignment value (v: its scalar bytes). */
static int gguf_writer_check_key(struct gguf_writer *w, const char *key, uint32_t type,
                                 const void *v)
{
    ASSERT(w->phase == GGUF_WRITER_PHASE_META);
    if (w->err)
        return w->err;
    size_t len = key ? strlen(key) : 0;
    if (len == 0 || len > GGUF_WRITER_MAX_KEY) {
        log_error("gguf writer %s: key '%s' must be 1..%d bytes, not %zu", w->path,
                  key ? key : "(null)", GGUF_WRITER_MAX_KEY, len);
        return -EINVAL;
    }
    for (uint64_t i = 0; i < w->n_kv; i++) {
        if (strcmp(w->keys[i], key) == 0) {
            log_error("gguf writer %s: duplicate key '%s' (record %llu)", w->path, key,
                      (unsigned long long)i);
            return -EINVAL;
        }
    }
    if (strcmp(key, "general.alignment") == 0) {
        uint32_t a = 0;
        if (type == GGUF_TYPE_UINT32)
            memcpy(&a, v, sizeof(a));
        if (type != GGUF_TYPE_UINT32 || a != w->alignment) {
            log_error("gguf writer %s: general.alignment must be a uint32 equal to the "
                      "writer's alignment %u", w->path, w->alignment);
            return -EINVAL;
        }
    }
    return 0;
}

/* Records the key of a KV record just encoded (the record starts at start). */
static int gguf_writer_commit_key(struct gguf_writer *w, const char *key, size_t start)
{
    if (w->n_kv == w->keys_cap) {
        uint64_t cap = w->keys_cap ? w->keys_cap * 2 : 32;
        char **p = realloc(w->keys, cap * sizeof(*p));
        if (!p)
            goto out_nomem;
        w->keys = p;
        w->keys_cap = cap;
    }
    w->keys[w->n_kv] = strdup(key);
    if (!w->keys[w->n_kv])
        goto out_nomem;
    w->n_kv++;
    if (strcmp(key, "general.alignment") == 0)
        w->has_alignment_key = true;
    return 0;

out_nomem:
    log_error("gguf writer %s: out of memory for key '%s'", w->path, key);
    w->kv_len = start;
    return -ENOMEM;
}

/* Encodes key and type tag; on failure rolls the buffer back to start. */
static int gguf_writer_kv_begin(struct gguf_writer *w, const char *key, uint32_t type)
{
    int rc = gguf_writer_kv_str(w, key, strlen(key));
    if (!rc)
        rc = gguf_writer_kv_reserve(w, sizeof(type));
    if (rc)
        return rc;
    gguf_writer_kv_put(w, &type, sizeof(type));
    return 0;
}

static int gguf_writer_add_scalar(struct gguf_writer *w, const char *key, uint32_t type,
                                  const void *v)
{
    int rc = gguf_writer_check_key(w, key, type, v);
    if (rc)
        return rc;
    size_t start = w->kv_len, size = gguf_writer_scalar_size(type);
    rc = gguf_writer_kv_begin(w, key, type);
    if (!rc)
        rc = gguf_writer_kv_reserve(w, size);
    if (rc) {
        w->kv_len = start;
        return rc;
    }
    gguf_writer_kv_put(w, v, size);
    return gguf_writer_commit_key(w, key, start);
}

int gguf_writer_add_u8(struct gguf_writer *w, const char *key, uint8_t v)
{
    return gguf_writer_add_scalar(w, key, GGUF_TYPE_UINT8, &v);
}

int gguf_writer_add_i8(struct gguf_writer *w, const char *key, int8_t v)
{
    return gguf_writer_add_scalar(w, key, GGUF_TYPE_INT8, &v);
}

int gguf_writer_add_u16(struct gguf_writer *w, const char *key, uint16_t v)
{
    return gguf_writer_add_scalar(w, key, GGUF_TYPE_UINT16, &v);
}

int gguf_writer_add_i16(struct gguf_writer *w, const char *key, int16_t v)
{
    return gguf_writer_add_scalar(w, key, GGUF_TYPE_INT16, &v);
}

int gguf_writer_add_u32(struct gguf_writer *w, const char *key, uint32_t v)
{
    return gguf_writer_add_scalar(w, key, GGUF_TYPE_UINT32, &v);
}

int gguf_writer_add_i32(struct gguf_writer *w, const char *key, int32_t v)
{
    return gguf_writer_add_scalar(w, key, GGUF_TYPE_INT32, &v);
}

int gguf_writer_add_u64(struct gguf_writer *w, const char *key, uint64_t v)
{
    return gguf_writer_add_scalar(w, key, GGUF_TYPE_UINT64, &v);
}

int gguf_writer_add_i64(struct gguf_writer *w, const char *key, int64_t v)
{
    return gguf_writer_add_scalar(w, key, GGUF_TYPE_INT64, &v);
}

int gguf_writer_add_f32(struct gguf_writer *w, const char *key, float v)
{
    return gguf_writer_add_scalar(w, key, GGUF_TYPE_FLOAT32, &v);
}

int gguf_writer_add_f64(struct gguf_writer *w, const char *key, double v)
{
    return gguf_writer_add_scalar(w, key, GGUF_TYPE_FLOAT64, &v);
}

int gguf_writer_add_bool(struct gguf_writer *w, const char *key, bool v)
{
    uint8_t b = v ? 1 : 0;
    return gguf_writer_add_scalar(w, key, GGUF_TYPE_BOOL, &b);
}

int gguf_writer_add_str(struct gguf_writer *w, const char *key, const char *v)
{
    int rc = gguf_writer_check_key(w, key, GGUF_TYPE_STRING, NULL);
    if (rc)
        return rc;
    if (!v) {
        log_error("gguf writer %s: key '%s': NULL string", w->path, key);
        return -EINVAL;
    }
    size_t start = w->kv_len;
    rc = gguf_writer_kv_begin(w, key, GGUF_TYPE_STRING);
    if (!rc)
        rc = gguf_writer_kv_str(w, v, strlen(v));
    if (rc) {
        w->kv_len = start;
        return rc;
    }
    return gguf_writer_commit_key(w, key, start);
}

/* Encodes the array header: key, ARRAY, elem_type, n. */
static int gguf_writer_array_begin(struct gguf_writer *w, const char *key, uint32_t elem_type,
                                   uint64_t n)
{
    int rc = gguf_writer_kv_begin(w, key, GGUF_TYPE_ARRAY);
    if (!rc)
        rc = gguf_writer_kv_reserve(w, sizeof(elem_type) + sizeof(n));
    if (rc)
        return rc;
    gguf_writer_kv_put(w, &elem_type, sizeof(elem_type));
    gguf_writer_kv_put(w, &n, sizeof(n));
    return 0;
}

int gguf_writer_add_array(struct gguf_writer *w, const char *key, uint32_t elem_type,
                          const void *values, uint64_t n)
{
    int rc = gguf_writer_check_key(w, key, GGUF_TYPE_ARRAY, NULL);
    if (rc)
        return rc;
    size_t size = gguf_writer_scalar_size(elem_type);
    if (size == 0 || (n > 0 && !values)) {
        log_error("gguf writer %s: key '%s': bad array (element type %u, %llu elements)",
                  w->path, key, elem_type, (unsigned long long)n);
        return -EINVAL;
    }
    if (n > (SIZE_MAX / 4) / size) {
        log_error("gguf writer %s: key '%s': array of %llu elements is too large", w->path, key,
                  (unsigned long long)n);
        return -EINVAL;
    }
    for (uint64_t i = 0; elem_type == GGUF_TYPE_BOOL && i < n; i++) {
        if (((const uint8_t *)values)[i] > 1) {
            log_error("gguf writer %s: key '%s': bool element %llu is %u, not 0 or 1", w->path,
                      key, (unsigned long long)i, ((const uint8_t *)values)[i]);
            return -EINVAL;
        }
    }
    size_t start = w->kv_len, bytes = (size_t)n * size;
    rc = gguf_writer_array_begin(w, key, elem_type, n);
    if (!rc)
        rc = gguf_writer_kv_reserve(w, bytes);
    if (rc) {
        w->kv_len = start;
        return rc;
    }
    gguf_writer_kv_put(w, values, bytes);
    return gguf_writer_commit_key(w, key, start);
}

int gguf_writer_add_array_str(struct gguf_writer *w, const char *key, const char *const *strs,
                              uint64_t n)
{
    int rc = gguf_writer_check_key(w, key, GGUF_TYPE_ARRAY, NULL);
    if (rc)
        return rc;
    for (uint64_t i = 0; i < n; i++) {
        if (!strs || !strs[i]) {
            log_error("gguf writer %s: key '%s': string %llu is NULL", w->path, key,
                      (unsigned long long)i);
            return -EINVAL;
        }
    }
    size_t start = w->kv_len;
    rc = gguf_writer_array_begin(w, key, GGUF_TYPE_STRING, n);
    for (uint64_t i = 0; !rc && i < n; i++)
        rc = gguf_writer_kv_str(w, strs[i], strlen(strs[i]));
    if (rc) {
        w->kv_len = start;
        return rc;
    }
    return gguf_writer_commit_key(w, key, start);
}

/* Validates a tensor declaration and computes its byte size. */
static int gguf_writer_check_tensor(struct gguf_writer *w, const char *name, uint32_t type,
                                    uint32_t n_dims, const int64_t *ne, uint64_t *nbytes)
{
    size_t len = name ? strlen(name) : 0;
    if (len == 0 || len >= GGUF_MAX_NAME) {
        log_error("gguf writer %s: tensor name '%s' must be 1..%d bytes, not %zu", w->path,
                  name ? name : "(null)", GGUF_MAX_NAME - 1, len);
        return -EINVAL;
    }
    for (uint64_t i = 0; i < w->n_tensors; i++) {
        if (strcmp(w->tensors[i].name, name) == 0) {
            log_error("gguf writer %s: duplicate tensor name '%s' (tensor %llu)", w->path, name,
                      (unsigned long long)i);
            return -EINVAL;
        }
    }
    uint32_t block = quant_block_elems(type);
    if (block == 0 || quant_block_bytes(type) == 0) {
        log_error("gguf writer %s: tensor '%s': unknown type %u", w->path, name, type);
        return -EINVAL;
    }
    if (n_dims < 1 || n_dims > GGUF_MAX_DIMS || !ne) {
        log_error("gguf writer %s: tensor '%s': n_dims %u is not 1..%d", w->path, name, n_dims,
                  GGUF_MAX_DIMS);
        return -EINVAL;
    }
    for (uint32_t d = 0; d < n_dims; d++) {
        if (ne[d] < 1) {
            log_error("gguf writer %s: tensor '%s': ne[%u] = %lld is not positive", w->path, name,
                      d, (long long)ne[d]);
            return -EINVAL;
        }
    }
    if (ne[0] % block) {
        log_error("gguf writer %s: tensor '%s': ne[0] = %lld is not a multiple of the %s block "
                  "size %u", w->path, name, (long long)ne[0], quant_type_name(type), block);
        return -EINVAL;
    }
    /* Bytes = row_size * rows, checked by dividing before each multiply. */
    uint64_t size = (uint64_t)ne[0] / block * quant_block_bytes(type);
    uint64_t limit = UINT64_MAX / 4;
    for (uint32_t d = 1; d < n_dims; d++) {
        if (size > limit / (uint64_t)ne[d]) {
            log_error("gguf writer %s: tensor '%s': byte size overflows", w->path, name);
            return -EINVAL;
        }
        size *= (uint64_t)ne[d];
    }
    if (size > limit - w->data_size - w->alignment) {
        log_error("gguf writer %s: tensor '%s': data section size overflows", w->path, name);
        return -EINVAL;
    }
    *nbytes = size;
    return 0;
}

int gguf_writer_add_tensor(struct gguf_writer *w, const char *name, uint32_t type,
                           uint32_t n_dims, const int64_t *ne)
{
    ASSERT(w->phase == GGUF_WRITER_PHASE_META);
    if (w->err)
        return w->err;
    uint64_t nbytes;
    int rc = gguf_writer_check_tensor(w, name, type, n_dims, ne, &nbytes);
    if (rc)
        return rc;
    if (w->n_tensors == w->tensors_cap) {
        uint64_t cap = w->tensors_cap ? w->tensors_cap * 2 : 64;
        struct gguf_writer_tensor *p = realloc(w->tensors, cap * sizeof(*p));
        if (!p) {
            log_error("gguf writer %s: out of memory for %llu tensor infos", w->path,
                      (unsigned long long)cap);
            return -ENOMEM;
        }
        w->tensors = p;
        w->tensors_cap = cap;
    }
    struct gguf_writer_tensor *t = &w->tensors[w->n_tensors++];
    memset(t, 0, sizeof(*t));
    memcpy(t->name, name, strlen(name) + 1);
    t->type = type;
    t->n_dims = n_dims;
    for (uint32_t d = 0; d < GGUF_MAX_DIMS; d++)
        t->ne[d] = d < n_dims ? ne[d] : 1;
    t->offset = w->data_size;
    t->nbytes = nbytes;
    w->data_size += nbytes + gguf_writer_pad(nbytes, w->alignment);
    return 0;
}

uint64_t gguf_writer_n_tensors(const struct gguf_writer *w)
{
    return w->n_tensors;
}

uint64_t gguf_writer_tensor_nbytes(const struct gguf_writer *w, uint64_t i)
{
    ASSERT(i < w->n_tensors);
    return w->tensors[i].nbytes;
}

uint64_t gguf_writer_data_size(const struct gguf_writer *w)
{
    return w->data_size;
}

static int gguf_writer_out_u32(struct gguf_writer *w, uint32_t v)
{
    return gguf_writer_out(w, &v, sizeof(v));
}

static int gguf_writer_out_u64(struct gguf_writer *w, uint64_t v)
{
    return gguf_writer_out(w, &v, sizeof(v));
}

static int gguf_writer_out_info(struct gguf_writer *w, const struct gguf_writer_tensor *t)
{
    int rc = gguf_writer_out_u64(w, strlen(t->name));
    if (!rc)
        rc = gguf_writer_out(w, t->name, strlen(t->name));
    if (!rc)
        rc = gguf_writer_out_u32(w, t->n_dims);
    for (uint32_t d = 0; !rc && d < t->n_dims; d++)
        rc = gguf_writer_out_u64(w, (uint64_t)t->ne[d]);
    if (!rc)
        rc = gguf_writer_out_u32(w, t->type);
    if (!rc)
        rc = gguf_writer_out_u64(w, t->offset);
    return rc;
}

int gguf_writer_write_header(struct gguf_writer *w)
{
    ASSERT(w->phase == GGUF_WRITER_PHASE_META);
    if (w->err)
        return w->err;
    if (w->alignment != GGUF_DEFAULT_ALIGNMENT && !w->has_alignment_key) {
        int rc = gguf_writer_add_u32(w, "general.alignment", w->alignment);
        if (rc)
            return rc;
    }
    int rc = gguf_writer_out_u32(w, GGUF_WRITER_MAGIC);
    if (!rc)
        rc = gguf_writer_out_u32(w, GGUF_WRITER_VERSION);
    if (!rc)
        rc = gguf_writer_out_u64(w, w->n_tensors);
    if (!rc)
        rc = gguf_writer_out_u64(w, w->n_kv);
    if (!rc)
        rc = gguf_writer_out(w, w->kv, w->kv_len);
    for (uint64_t i = 0; !rc && i < w->n_tensors; i++)
        rc = gguf_writer_out_info(w, &w->tensors[i]);
    if (!rc)
        rc = gguf_writer_out_zeros(w, gguf_writer_pad(gguf_writer_file_offset(w), w->alignment));
    if (rc)
        return rc;
    free(w->kv);
    w->kv = NULL;
    w->kv_len = w->kv_cap = 0;
    w->phase = GGUF_WRITER_PHASE_DATA;
    w->data_left = 0;
    for (uint64_t i = 0; i < w->n_tensors; i++)
        w->data_left += w->tensors[i].nbytes;
    return 0;
}

int gguf_writer_write_data(struct gguf_writer *w, const void *data, uint64_t n)
{
    ASSERT(w->phase == GGUF_WRITER_PHASE_DATA);
    if (w->err)
        return w->err;
    if (n > w->data_left) {
        const char *name = w->cur < w->n_tensors ? w->tensors[w->cur].name : "(none)";
        log_error("gguf writer %s: %llu bytes of data given but the declared tensors hold only "
                  "%llu more (current tensor '%s')", w->path, (unsigned long long)n,
                  (unsigned long long)w->data_left, name);
        return -EINVAL;
    }
    const uint8_t *p = data;
    while (n > 0) {
        const struct gguf_writer_tensor *t = &w->tensors[w->cur];
        uint64_t take = t->nbytes - w->cur_done;
        take = take < n ? take : n;
        int rc = gguf_writer_out(w, p, (size_t)take);
        if (rc)
            return rc;
        p += take;
        n -= take;
        w->data_left -= take;
        w->cur_done += take;
        if (w->cur_done == t->nbytes) {
            rc = gguf_writer_out_zeros(w, gguf_writer_pad(t->nbytes, w->alignment));
            if (rc)
                return rc;
            w->cur++;
            w->cur_done = 0;
        }
    }
    return 0;
}

uint64_t gguf_writer_file_offset(const struct gguf_writer *w)
{
    return w->flushed + w->buf_used;
}

int gguf_writer_finish(struct gguf_writer *w)
{
    ASSERT(w->phase == GGUF_WRITER_PHASE_DATA);
    if (w->err)
        return w->err;
    if (w->cur < w->n_tensors) {
        const struct gguf_writer_tensor *t = &w->tensors[w->cur];
        log_error("gguf writer %s: tensor '%s' got %llu of its %llu bytes (%llu tensors "
                  "declared, %llu complete)", w->path, t->name, (unsigned long long)w->cur_done,
                  (unsigned long long)t->nbytes, (unsigned long long)w->n_tensors,
                  (unsigned long long)w->cur);
        w->err = -EINVAL;
        return w->err;
    }
    if (w->direct) { /* whole blocks directly, the tail through the page cache */
        size_t whole = w->buf_used / GGUF_WRITER_DIRECT_ALIGN * GGUF_WRITER_DIRECT_ALIGN;
        size_t tail = w->buf_used - whole;
        int rc = gguf_writer_write_all(w, w->buf, whole);
        if (!rc && tail && w->direct)
            rc = gguf_writer_undirect(w);
        if (!rc)
            rc = gguf_writer_write_all(w, w->buf + whole, tail);
        if (rc)
            return rc;
        w->buf_used = 0;
    }
    int rc = gguf_writer_flush(w);
    if (rc)
        return rc;
    int fd = w->fd;
    w->fd = -1;
    if (close(fd) != 0) {
        int e = errno;
        log_error("gguf writer %s: close after %llu bytes failed: %s", w->path,
                  (unsigned long long)w->flushed, strerror(e));
        w->err = -e;
        return w->err;
    }
    w->phase = GGUF_WRITER_PHASE_DONE;
    return 0;
}
