/*
 * gguf: the validating GGUF reader (see gguf.h; format in model-spec section 1).
 *
 * Every byte read goes through struct gguf_rd, a bounded cursor over the file
 * that checks the bytes left before each read. Counts and lengths taken from
 * the file are compared with the bytes left (divided by the smallest possible
 * record) before anything is allocated from them, and tensor sizes are built
 * by dividing before multiplying. The first problem found is reported once, as
 * one line naming the field, the key or tensor, and the byte offset.
 *
 * Invariants after gguf_open(): keys are unique, NUL-free copies; tensor names
 * are unique, 1..63 bytes; every tensor lies inside the file at
 * data_offset + offset, its offset equal to the padded sizes of the tensors
 * before it. Lookups go through name-sorted index arrays (binary search).
 */
#include "model/gguf.h"

#include <errno.h>
#include <fcntl.h>
#include <float.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/check.h"
#include "common/log.h"
#include "model/quant.h"

#if defined(__BYTE_ORDER__) && __BYTE_ORDER__ != __ORDER_LITTLE_ENDIAN__
#error "gguf.c decodes little-endian values with memcpy: port it to big-endian hosts first"
#endif

#define GGUF_MAGIC 0x46554747u  /* "GGUF" read as a little-endian uint32 */
#define GGUF_MAX_KEY 256        /* longest key accepted, bytes */
#define GGUF_MIN_KV_BYTES 13    /* key length + 1 key byte + type + 1-byte value */
#define GGUF_MIN_TENSOR_BYTES 33 /* name length + 1 name byte + n_dims + ne[0] + type + offset */

struct gguf {
    const uint8_t *base;          /* the file's bytes: the mapping or cfg->data */
    uint64_t size;                /* bytes at base */
    bool mapped;                  /* base was mmap()ed by us and is unmapped on close */
    uint32_t version;             /* 2 or 3 */
    uint32_t alignment;           /* general.alignment or 32; a power of two */
    uint64_t data_offset;         /* file offset of the data section */
    uint64_t n_kv;                /* entries in kvs */
    struct gguf_kv *kvs;          /* in file order */
    uint64_t *kv_sorted;          /* indices into kvs, sorted by key */
    uint64_t n_tensors;           /* entries in tensors */
    struct gguf_tensor *tensors;  /* in file order */
    uint64_t *tensor_sorted;      /* indices into tensors, sorted by name */
};

/* A bounded cursor over the file, plus where to report a rejection. */
struct gguf_rd {
    const uint8_t *base;  /* file bytes */
    uint64_t size;        /* file size */
    uint64_t pos;         /* next byte to read */
    const char *src;      /* file name for messages */
    char *err;            /* optional copy of the rejection message */
    size_t err_len;       /* bytes at err */
    char ctx[128];        /* the record being read, e.g. "kv 3 'general.name'" */
};

static const char *const gguf_type_names[GGUF_TYPE_COUNT] = {
    "uint8", "int8", "uint16", "int16", "uint32", "int32", "float32",
    "bool", "string", "array", "uint64", "int64", "float64",
};

/* Encoded size of a scalar type; 0 for STRING, ARRAY and unknown types. */
static uint64_t gguf_scalar_size(uint32_t type)
{
    static const uint8_t sizes[GGUF_TYPE_COUNT] = {1, 1, 2, 2, 4, 4, 4, 1, 0, 0, 8, 8, 8};
    return type < GGUF_TYPE_COUNT ? sizes[type] : 0;
}

static bool gguf_type_is_signed(uint32_t type)
{
    return type == GGUF_TYPE_INT8 || type == GGUF_TYPE_INT16 || type == GGUF_TYPE_INT32 ||
           type == GGUF_TYPE_INT64;
}

/* Logs "gguf SRC: CTX: MESSAGE (byte offset OFF)" once, copies it into the
 * caller's err buffer, and returns -EINVAL. */
__attribute__((format(printf, 3, 4)))
static int gguf_rd_fail(struct gguf_rd *r, uint64_t off, const char *fmt, ...)
{
    char what[320];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof(what), fmt, ap);
    va_end(ap);
    char msg[480];
    snprintf(msg, sizeof(msg), "gguf %s: %s%s%s (byte offset %llu)", r->src, r->ctx,
             r->ctx[0] ? ": " : "", what, (unsigned long long)off);
    log_error("%s", msg);
    if (r->err && r->err_len)
        snprintf(r->err, r->err_len, "%s", msg);
    return -EINVAL;
}

static uint64_t gguf_rd_left(const struct gguf_rd *r)
{
    return r->size - r->pos;
}

/* Copies n bytes at the cursor into out and advances, or rejects as truncated. */
static int gguf_rd_bytes(struct gguf_rd *r, const char *what, void *out, uint64_t n)
{
    if (gguf_rd_left(r) < n)
        return gguf_rd_fail(r, r->pos, "file truncated: %s needs %llu bytes, %llu left", what,
                            (unsigned long long)n, (unsigned long long)gguf_rd_left(r));
    memcpy(out, r->base + r->pos, n);
    r->pos += n;
    return 0;
}

static int gguf_rd_u32(struct gguf_rd *r, const char *what, uint32_t *out)
{
    return gguf_rd_bytes(r, what, out, sizeof(*out));
}

static int gguf_rd_u64(struct gguf_rd *r, const char *what, uint64_t *out)
{
    return gguf_rd_bytes(r, what, out, sizeof(*out));
}

/* Reads a length-prefixed string; its bytes stay in the file. */
static int gguf_rd_str(struct gguf_rd *r, const char *what, struct gguf_str *out)
{
    uint64_t at = r->pos;
    uint64_t len = 0;
    if (gguf_rd_u64(r, what, &len))
        return -EINVAL;
    if (len > gguf_rd_left(r))
        return gguf_rd_fail(r, at, "%s length %llu exceeds the %llu bytes left in the file", what,
                            (unsigned long long)len, (unsigned long long)gguf_rd_left(r));
    out->ptr = (const char *)r->base + r->pos;
    out->len = len;
    r->pos += len;
    return 0;
}

/* Decodes one scalar of a known fixed-size type into kv->v. */
static int gguf_rd_scalar(struct gguf_rd *r, uint32_t type, struct gguf_kv *kv)
{
    uint64_t at = r->pos;
    uint8_t b[8] = {0};
    if (gguf_rd_bytes(r, gguf_type_names[type], b, gguf_scalar_size(type)))
        return -EINVAL;
    switch (type) {
    case GGUF_TYPE_UINT8: kv->v.u64 = b[0]; break;
    case GGUF_TYPE_INT8: kv->v.i64 = (int8_t)b[0]; break;
    case GGUF_TYPE_UINT16: { uint16_t x; memcpy(&x, b, 2); kv->v.u64 = x; break; }
    case GGUF_TYPE_INT16: { int16_t x; memcpy(&x, b, 2); kv->v.i64 = x; break; }
    case GGUF_TYPE_UINT32: { uint32_t x; memcpy(&x, b, 4); kv->v.u64 = x; break; }
    case GGUF_TYPE_INT32: { int32_t x; memcpy(&x, b, 4); kv->v.i64 = x; break; }
    case GGUF_TYPE_FLOAT32: { float x; memcpy(&x, b, 4); kv->v.f64 = x; break; }
    case GGUF_TYPE_UINT64: memcpy(&kv->v.u64, b, 8); break;
    case GGUF_TYPE_INT64: memcpy(&kv->v.i64, b, 8); break;
    case GGUF_TYPE_FLOAT64: memcpy(&kv->v.f64, b, 8); break;
    case GGUF_TYPE_BOOL:
        if (b[0] > 1)
            return gguf_rd_fail(r, at, "bool value is %u, must be 0 or 1", b[0]);
        kv->v.u64 = b[0];
        break;
    default:
        ASSERT(!"gguf_rd_scalar called with a non-scalar type");
    }
    return 0;
}

/* Reads an ARRAY value: element type, count, elements. Numeric elements stay
 * in the file; string elements get a table sized only after the count has
 * been checked against the bytes left. */
static int gguf_rd_array(struct gguf_rd *r, struct gguf_kv *kv)
{
    uint64_t at = r->pos;
    if (gguf_rd_u32(r, "array element type", &kv->arr_type))
        return -EINVAL;
    if (kv->arr_type == GGUF_TYPE_ARRAY)
        return gguf_rd_fail(r, at, "array element type: nested arrays are not supported");
    if (kv->arr_type >= GGUF_TYPE_COUNT)
        return gguf_rd_fail(r, at, "array element type %u is not a known metadata type",
                            kv->arr_type);
    at = r->pos;
    if (gguf_rd_u64(r, "array count", &kv->n))
        return -EINVAL;
    uint64_t esize = gguf_scalar_size(kv->arr_type);
    uint64_t min = esize ? esize : sizeof(uint64_t); /* a string is at least its length */
    if (kv->n > gguf_rd_left(r) / min)
        return gguf_rd_fail(r, at, "array count %llu of %s needs at least %llu bytes each, "
                            "only %llu bytes left", (unsigned long long)kv->n,
                            gguf_type_names[kv->arr_type], (unsigned long long)min,
                            (unsigned long long)gguf_rd_left(r));
    kv->arr = r->base + r->pos;
    if (esize) {
        if (kv->arr_type == GGUF_TYPE_BOOL)
            for (uint64_t i = 0; i < kv->n; i++)
                if (kv->arr[i] > 1)
                    return gguf_rd_fail(r, r->pos + i, "bool array element %llu is %u, must "
                                        "be 0 or 1", (unsigned long long)i, kv->arr[i]);
        r->pos += kv->n * esize;
        return 0;
    }
    kv->arr = NULL;
    kv->strs = calloc(kv->n ? kv->n : 1, sizeof(*kv->strs));
    if (!kv->strs) {
        log_error("gguf %s: out of memory for %llu strings of %s", r->src,
                  (unsigned long long)kv->n, kv->key);
        return -ENOMEM;
    }
    for (uint64_t i = 0; i < kv->n; i++)
        if (gguf_rd_str(r, "array string", &kv->strs[i]))
            return -EINVAL;
    return 0;
}

/* Checks a key's bytes: 1..GGUF_MAX_KEY-1 bytes, no NUL or control bytes. */
static int gguf_check_key(struct gguf_rd *r, uint64_t at, const struct gguf_str *s)
{
    if (s->len == 0 || s->len >= GGUF_MAX_KEY)
        return gguf_rd_fail(r, at, "key length %llu is not in 1..%d", (unsigned long long)s->len,
                            GGUF_MAX_KEY - 1);
    for (uint64_t i = 0; i < s->len; i++) {
        unsigned char c = (unsigned char)s->ptr[i];
        if (c < 0x20 || c == 0x7f)
            return gguf_rd_fail(r, at, "key byte %llu is control byte 0x%02x",
                                (unsigned long long)i, c);
    }
    return 0;
}

/* Keys whose type and value the container itself depends on. */
static int gguf_check_known_kv(struct gguf_rd *r, const struct gguf_kv *kv, bool allow_split)
{
    if (strcmp(kv->key, "general.alignment") == 0) {
        if (kv->type != GGUF_TYPE_UINT32)
            return gguf_rd_fail(r, kv->file_offset, "general.alignment must be uint32, not %s",
                                gguf_type_name(kv->type));
        uint64_t a = kv->v.u64;
        if (a == 0 || (a & (a - 1)))
            return gguf_rd_fail(r, kv->file_offset, "general.alignment %llu is not a non-zero "
                                "power of two", (unsigned long long)a);
    }
    if (strcmp(kv->key, "split.count") == 0 && !gguf_type_is_int(kv->type))
        return gguf_rd_fail(r, kv->file_offset, "split.count must be an integer, not %s",
                            gguf_type_name(kv->type));
    if (strcmp(kv->key, "split.count") == 0 && !allow_split) {
        bool is_signed = gguf_type_is_signed(kv->type);
        bool many = gguf_type_is_int(kv->type) && (is_signed ? kv->v.i64 > 1 : kv->v.u64 > 1);
        if (many)
            return gguf_rd_fail(r, kv->file_offset, "split.count %s%llu: split GGUF files are "
                                "not supported yet; merge the shards with "
                                "llama-gguf-split --merge FIRST-SHARD OUT.gguf", "",
                                (unsigned long long)kv->v.u64);
    }
    return 0;
}

static int gguf_rd_kv(struct gguf_rd *r, uint64_t i, struct gguf_kv *kv, bool allow_split)
{
    kv->file_offset = r->pos;
    snprintf(r->ctx, sizeof(r->ctx), "kv %llu", (unsigned long long)i);
    struct gguf_str key;
    if (gguf_rd_str(r, "key", &key) || gguf_check_key(r, kv->file_offset, &key))
        return -EINVAL;
    kv->key = malloc(key.len + 1);
    if (!kv->key) {
        log_error("gguf %s: out of memory for a key", r->src);
        return -ENOMEM;
    }
    memcpy(kv->key, key.ptr, key.len);
    kv->key[key.len] = '\0';
    snprintf(r->ctx, sizeof(r->ctx), "kv %llu '%s'", (unsigned long long)i, kv->key);
    uint64_t at = r->pos;
    if (gguf_rd_u32(r, "value type", &kv->type))
        return -EINVAL;
    if (kv->type >= GGUF_TYPE_COUNT)
        return gguf_rd_fail(r, at, "value type %u is not a known metadata type", kv->type);
    int rc;
    if (kv->type == GGUF_TYPE_STRING)
        rc = gguf_rd_str(r, "string value", &kv->str);
    else if (kv->type == GGUF_TYPE_ARRAY)
        rc = gguf_rd_array(r, kv);
    else
        rc = gguf_rd_scalar(r, kv->type, kv);
    if (rc)
        return rc;
    return gguf_check_known_kv(r, kv, allow_split);
}

/* Reads and validates one tensor-info record (offset checked later). */
static int gguf_rd_tensor(struct gguf_rd *r, uint64_t i, struct gguf_tensor *t)
{
    t->file_offset = r->pos;
    snprintf(r->ctx, sizeof(r->ctx), "tensor %llu", (unsigned long long)i);
    struct gguf_str name;
    if (gguf_rd_str(r, "tensor name", &name))
        return -EINVAL;
    if (name.len == 0 || name.len >= GGUF_MAX_NAME)
        return gguf_rd_fail(r, t->file_offset, "tensor name length %llu is not in 1..%d",
                            (unsigned long long)name.len, GGUF_MAX_NAME - 1);
    if (memchr(name.ptr, '\0', name.len))
        return gguf_rd_fail(r, t->file_offset, "tensor name contains a NUL byte");
    memcpy(t->name, name.ptr, name.len);
    t->name[name.len] = '\0';
    snprintf(r->ctx, sizeof(r->ctx), "tensor %llu '%s'", (unsigned long long)i, t->name);
    uint64_t at = r->pos;
    if (gguf_rd_u32(r, "n_dims", &t->n_dims))
        return -EINVAL;
    if (t->n_dims < 1 || t->n_dims > GGUF_MAX_DIMS)
        return gguf_rd_fail(r, at, "n_dims %u is not in 1..%d", t->n_dims, GGUF_MAX_DIMS);
    int64_t elems = 1;
    for (uint32_t d = 0; d < GGUF_MAX_DIMS; d++) {
        uint64_t ne = 1;
        at = r->pos;
        if (d < t->n_dims && gguf_rd_u64(r, "ne", &ne))
            return -EINVAL;
        if (ne < 1 || ne > (uint64_t)INT64_MAX)
            return gguf_rd_fail(r, at, "ne[%u] = %lld must be >= 1", d, (long long)ne);
        if ((int64_t)ne > INT64_MAX / elems)
            return gguf_rd_fail(r, at, "ne[%u] = %llu makes the element count overflow int64",
                                d, (unsigned long long)ne);
        t->ne[d] = (int64_t)ne;
        elems *= (int64_t)ne;
    }
    at = r->pos;
    if (gguf_rd_u32(r, "type", &t->type))
        return -EINVAL;
    uint32_t block = quant_block_elems(t->type);
    uint64_t block_bytes = quant_block_bytes(t->type);
    if (!quant_type_name(t->type) || block == 0 || block_bytes == 0)
        return gguf_rd_fail(r, at, "type %u is not a known ggml type", t->type);
    if (t->ne[0] % block)
        return gguf_rd_fail(r, at, "ne[0] = %lld is not a multiple of the %s block size %u",
                            (long long)t->ne[0], quant_type_name(t->type), block);
    /* nbytes = (elems / block) * block_bytes; elems is a multiple of block. */
    uint64_t blocks = (uint64_t)elems / block;
    if (blocks > UINT64_MAX / block_bytes)
        return gguf_rd_fail(r, at, "byte size of %llu %s blocks overflows",
                            (unsigned long long)blocks, quant_type_name(t->type));
    t->nbytes = blocks * block_bytes;
    return gguf_rd_u64(r, "offset", &t->offset);
}

/* Places the data section and checks each tensor's offset and extent. */
static int gguf_check_offsets(struct gguf_rd *r, struct gguf *g)
{
    uint64_t a = g->alignment;
    g->data_offset = r->pos + (a - r->pos % a) % a;
    uint64_t expect = 0;
    for (uint64_t i = 0; i < g->n_tensors; i++) {
        struct gguf_tensor *t = &g->tensors[i];
        snprintf(r->ctx, sizeof(r->ctx), "tensor %llu '%s'", (unsigned long long)i, t->name);
        uint64_t at = t->file_offset;
        unsigned long long off = t->offset, exp = expect;
        if (t->offset % a)
            return gguf_rd_fail(r, at, "offset %llu is not a multiple of the alignment %u", off,
                                g->alignment);
        if (t->offset < expect)
            return gguf_rd_fail(r, at, "offset %llu overlaps the previous tensor, which ends "
                                "at %llu", off, exp);
        if (t->offset > expect)
            return gguf_rd_fail(r, at, "offset %llu leaves a hole after the previous tensor, "
                                "expected %llu", off, exp);
        uint64_t room = g->data_offset <= r->size ? r->size - g->data_offset : 0;
        if (t->offset > room || t->nbytes > room - t->offset)
            return gguf_rd_fail(r, at, "data [%llu, +%llu) runs past the end of the file "
                                "(data section at %llu, file size %llu)", off,
                                (unsigned long long)t->nbytes,
                                (unsigned long long)g->data_offset,
                                (unsigned long long)r->size);
        t->data = g->base + g->data_offset + t->offset;
        expect += t->nbytes + (a - t->nbytes % a) % a; /* nbytes <= file size: no overflow */
    }
    r->ctx[0] = '\0';
    return 0;
}

/* qsort_r comparators over the index arrays. */
static int gguf_cmp_kv(const void *x, const void *y, void *arg)
{
    const struct gguf_kv *kvs = arg;
    return strcmp(kvs[*(const uint64_t *)x].key, kvs[*(const uint64_t *)y].key);
}

static int gguf_cmp_tensor(const void *x, const void *y, void *arg)
{
    const struct gguf_tensor *ts = arg;
    return strcmp(ts[*(const uint64_t *)x].name, ts[*(const uint64_t *)y].name);
}

/* Builds the sorted index of n records and rejects a repeated name, reporting
 * the later of the two records. */
static int gguf_index(struct gguf_rd *r, uint64_t n, uint64_t **out, bool tensors,
                      const struct gguf *g)
{
    uint64_t *idx = malloc((n ? n : 1) * sizeof(*idx));
    if (!idx) {
        log_error("gguf %s: out of memory for an index of %llu entries", r->src,
                  (unsigned long long)n);
        return -ENOMEM;
    }
    for (uint64_t i = 0; i < n; i++)
        idx[i] = i;
    *out = idx;
    if (tensors)
        qsort_r(idx, n, sizeof(*idx), gguf_cmp_tensor, g->tensors);
    else
        qsort_r(idx, n, sizeof(*idx), gguf_cmp_kv, g->kvs);
    r->ctx[0] = '\0';
    for (uint64_t i = 1; i < n; i++) {
        uint64_t p = idx[i - 1] < idx[i] ? idx[i - 1] : idx[i];
        uint64_t q = idx[i - 1] < idx[i] ? idx[i] : idx[i - 1];
        if (tensors && strcmp(g->tensors[p].name, g->tensors[q].name) == 0)
            return gguf_rd_fail(r, g->tensors[q].file_offset, "duplicate tensor name '%s' "
                                "(tensors %llu and %llu)", g->tensors[q].name,
                                (unsigned long long)p, (unsigned long long)q);
        if (!tensors && strcmp(g->kvs[p].key, g->kvs[q].key) == 0)
            return gguf_rd_fail(r, g->kvs[q].file_offset, "duplicate key '%s' (kvs %llu and "
                                "%llu)", g->kvs[q].key, (unsigned long long)p,
                                (unsigned long long)q);
    }
    return 0;
}

/* Header: magic, version, counts bounded by the bytes left. */
static int gguf_rd_header(struct gguf_rd *r, struct gguf *g)
{
    uint32_t magic = 0;
    if (gguf_rd_u32(r, "magic", &magic))
        return -EINVAL;
    if (magic != GGUF_MAGIC)
        return gguf_rd_fail(r, 0, "bad magic 0x%08x, not a GGUF file", magic);
    if (gguf_rd_u32(r, "version", &g->version))
        return -EINVAL;
    if (g->version != 2 && g->version != 3) {
        bool swapped = g->version == 0x02000000u || g->version == 0x03000000u;
        return gguf_rd_fail(r, 4, "version %u is not supported (need 2 or 3)%s", g->version,
                            swapped ? "; this looks like a big-endian GGUF" : "");
    }
    if (gguf_rd_u64(r, "tensor_count", &g->n_tensors) || gguf_rd_u64(r, "kv_count", &g->n_kv))
        return -EINVAL;
    uint64_t left = gguf_rd_left(r);
    if (g->n_kv > left / GGUF_MIN_KV_BYTES)
        return gguf_rd_fail(r, 16, "kv_count %llu cannot fit in the %llu bytes left",
                            (unsigned long long)g->n_kv, (unsigned long long)left);
    left -= g->n_kv * GGUF_MIN_KV_BYTES;
    if (g->n_tensors > left / GGUF_MIN_TENSOR_BYTES)
        return gguf_rd_fail(r, 8, "tensor_count %llu cannot fit in the %llu bytes left",
                            (unsigned long long)g->n_tensors, (unsigned long long)left);
    return 0;
}

static int gguf_parse(struct gguf_rd *r, struct gguf *g, bool allow_split)
{
    int rc = gguf_rd_header(r, g);
    if (rc)
        return rc;
    g->kvs = calloc(g->n_kv ? g->n_kv : 1, sizeof(*g->kvs));
    g->tensors = calloc(g->n_tensors ? g->n_tensors : 1, sizeof(*g->tensors));
    if (!g->kvs || !g->tensors) {
        log_error("gguf %s: out of memory for %llu kvs and %llu tensors", r->src,
                  (unsigned long long)g->n_kv, (unsigned long long)g->n_tensors);
        return -ENOMEM;
    }
    g->alignment = GGUF_DEFAULT_ALIGNMENT;
    for (uint64_t i = 0; i < g->n_kv; i++) {
        if ((rc = gguf_rd_kv(r, i, &g->kvs[i], allow_split)))
            return rc;
        if (strcmp(g->kvs[i].key, "general.alignment") == 0)
            g->alignment = (uint32_t)g->kvs[i].v.u64;
    }
    if ((rc = gguf_index(r, g->n_kv, &g->kv_sorted, false, g)))
        return rc;
    for (uint64_t i = 0; i < g->n_tensors; i++)
        if ((rc = gguf_rd_tensor(r, i, &g->tensors[i])))
            return rc;
    if ((rc = gguf_index(r, g->n_tensors, &g->tensor_sorted, true, g)))
        return rc;
    return gguf_check_offsets(r, g);
}

/* Maps cfg->path read-only into g. */
static int gguf_map(struct gguf *g, struct gguf_rd *r, const char *path)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) {
        int e = errno;
        log_error("gguf %s: cannot open: %s", path, strerror(e));
        if (r->err && r->err_len)
            snprintf(r->err, r->err_len, "gguf %s: cannot open: %s", path, strerror(e));
        return -e;
    }
    struct stat st;
    int rc = SYS_CHECK(fstat(fd, &st));
    if (rc)
        goto out_close;
    if (st.st_size <= 0) {
        rc = gguf_rd_fail(r, 0, "file truncated: the file is empty");
        goto out_close;
    }
    void *p = mmap(NULL, (size_t)st.st_size, PROT_READ, MAP_PRIVATE, fd, 0);
    if (p == MAP_FAILED) {
        rc = SYS_CHECK(-1);
        goto out_close;
    }
    g->base = p;
    g->size = (uint64_t)st.st_size;
    g->mapped = true;
out_close:
    close(fd);
    return rc;
}

struct gguf *gguf_open(const struct gguf_config *cfg)
{
    ASSERT(cfg && (cfg->path || cfg->data || cfg->size == 0));
    struct gguf *g = calloc(1, sizeof(*g));
    if (!g) {
        log_error("gguf: out of memory");
        return NULL;
    }
    struct gguf_rd r = {.src = cfg->path ? cfg->path : "<memory>", .err = cfg->err,
                        .err_len = cfg->err_len};
    if (cfg->err && cfg->err_len)
        cfg->err[0] = '\0';
    if (cfg->path) {
        if (gguf_map(g, &r, cfg->path))
            goto out_fail;
    } else {
        g->base = cfg->data;
        g->size = cfg->size;
    }
    r.base = g->base;
    r.size = g->size;
    if (gguf_parse(&r, g, cfg->allow_split))
        goto out_fail;
    return g;
out_fail:
    gguf_close(g);
    return NULL;
}

void gguf_close(struct gguf *g)
{
    if (!g)
        return;
    if (g->kvs) {
        for (uint64_t i = 0; i < g->n_kv; i++) {
            free(g->kvs[i].key);
            free(g->kvs[i].strs);
        }
    }
    free(g->kvs);
    free(g->kv_sorted);
    free(g->tensors);
    free(g->tensor_sorted);
    if (g->mapped)
        munmap((void *)g->base, g->size);
    free(g);
}

uint32_t gguf_version(const struct gguf *g)
{
    return g->version;
}

uint64_t gguf_file_size(const struct gguf *g)
{
    return g->size;
}

uint32_t gguf_alignment(const struct gguf *g)
{
    return g->alignment;
}

uint64_t gguf_data_offset(const struct gguf *g)
{
    return g->data_offset;
}

uint64_t gguf_n_kv(const struct gguf *g)
{
    return g->n_kv;
}

const struct gguf_kv *gguf_kv_at(const struct gguf *g, uint64_t i)
{
    ASSERT(i < g->n_kv);
    return &g->kvs[i];
}

const struct gguf_kv *gguf_find_kv(const struct gguf *g, const char *key)
{
    uint64_t lo = 0, hi = g->n_kv;
    while (lo < hi) {
        uint64_t mid = lo + (hi - lo) / 2;
        const struct gguf_kv *kv = &g->kvs[g->kv_sorted[mid]];
        int c = strcmp(kv->key, key);
        if (c == 0)
            return kv;
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return NULL;
}

uint64_t gguf_n_tensors(const struct gguf *g)
{
    return g->n_tensors;
}

const struct gguf_tensor *gguf_tensor_at(const struct gguf *g, uint64_t i)
{
    ASSERT(i < g->n_tensors);
    return &g->tensors[i];
}

const struct gguf_tensor *gguf_find_tensor(const struct gguf *g, const char *name)
{
    uint64_t lo = 0, hi = g->n_tensors;
    while (lo < hi) {
        uint64_t mid = lo + (hi - lo) / 2;
        const struct gguf_tensor *t = &g->tensors[g->tensor_sorted[mid]];
        int c = strcmp(t->name, name);
        if (c == 0)
            return t;
        if (c < 0)
            lo = mid + 1;
        else
            hi = mid;
    }
    return NULL;
}

/* Logs a getter's type or range mismatch and returns -EINVAL. */
__attribute__((format(printf, 2, 3)))
static int gguf_get_fail(const struct gguf_kv *kv, const char *fmt, ...)
{
    char what[256];
    va_list ap;
    va_start(ap, fmt);
    vsnprintf(what, sizeof(what), fmt, ap);
    va_end(ap);
    log_error("gguf key '%s' (%s, byte offset %llu): %s", kv->key, gguf_type_name(kv->type),
              (unsigned long long)kv->file_offset, what);
    return -EINVAL;
}

/* Reads an integer or BOOL key as an unsigned value not above max. */
static int gguf_get_uint(const struct gguf *g, const char *key, uint64_t max, uint64_t *out)
{
    const struct gguf_kv *kv = gguf_find_kv(g, key);
    if (!kv)
        return -ENOENT;
    if (!gguf_type_is_int(kv->type) && kv->type != GGUF_TYPE_BOOL)
        return gguf_get_fail(kv, "expected an integer");
    if (gguf_type_is_signed(kv->type) && kv->v.i64 < 0)
        return gguf_get_fail(kv, "value %lld is negative", (long long)kv->v.i64);
    if (kv->v.u64 > max)
        return gguf_get_fail(kv, "value %llu exceeds %llu", (unsigned long long)kv->v.u64,
                             (unsigned long long)max);
    *out = kv->v.u64;
    return 0;
}

int gguf_get_u32(const struct gguf *g, const char *key, uint32_t *out)
{
    uint64_t v;
    int rc = gguf_get_uint(g, key, UINT32_MAX, &v);
    if (rc == 0)
        *out = (uint32_t)v;
    return rc;
}

int gguf_get_u64(const struct gguf *g, const char *key, uint64_t *out)
{
    return gguf_get_uint(g, key, UINT64_MAX, out);
}

int gguf_get_f32(const struct gguf *g, const char *key, float *out)
{
    const struct gguf_kv *kv = gguf_find_kv(g, key);
    if (!kv)
        return -ENOENT;
    if (kv->type == GGUF_TYPE_FLOAT32 || kv->type == GGUF_TYPE_FLOAT64) {
        if (isfinite(kv->v.f64) && (kv->v.f64 > FLT_MAX || kv->v.f64 < -FLT_MAX))
            return gguf_get_fail(kv, "value %g does not fit a float32", kv->v.f64);
        *out = (float)kv->v.f64;
    } else if (gguf_type_is_signed(kv->type))
        *out = (float)kv->v.i64;
    else if (gguf_type_is_int(kv->type))
        *out = (float)kv->v.u64;
    else
        return gguf_get_fail(kv, "expected a number");
    return 0;
}

int gguf_get_bool(const struct gguf *g, const char *key, bool *out)
{
    uint64_t v;
    int rc = gguf_get_uint(g, key, 1, &v);
    if (rc == 0)
        *out = v != 0;
    return rc;
}

int gguf_get_str(const struct gguf *g, const char *key, struct gguf_str *out)
{
    const struct gguf_kv *kv = gguf_find_kv(g, key);
    if (!kv)
        return -ENOENT;
    if (kv->type != GGUF_TYPE_STRING)
        return gguf_get_fail(kv, "expected a string");
    *out = kv->str;
    return 0;
}

int64_t gguf_arr_i64(const struct gguf_kv *kv, uint64_t i)
{
    ASSERT(kv->type == GGUF_TYPE_ARRAY && i < kv->n && kv->arr);
    uint64_t size = gguf_scalar_size(kv->arr_type);
    const uint8_t *p = kv->arr + i * size;
    switch (kv->arr_type) {
    case GGUF_TYPE_UINT8: case GGUF_TYPE_UINT16: case GGUF_TYPE_UINT32: case GGUF_TYPE_UINT64:
    case GGUF_TYPE_BOOL: {
        uint64_t x = 0;
        memcpy(&x, p, size);
        return (int64_t)x;
    }
    case GGUF_TYPE_INT8: { int8_t x; memcpy(&x, p, 1); return x; }
    case GGUF_TYPE_INT16: { int16_t x; memcpy(&x, p, 2); return x; }
    case GGUF_TYPE_INT32: { int32_t x; memcpy(&x, p, 4); return x; }
    case GGUF_TYPE_INT64: { int64_t x; memcpy(&x, p, 8); return x; }
    default:
        ASSERT(!"gguf_arr_i64 on a non-integer array");
        return 0;
    }
}

double gguf_arr_f64(const struct gguf_kv *kv, uint64_t i)
{
    ASSERT(kv->type == GGUF_TYPE_ARRAY && i < kv->n && kv->arr);
    const uint8_t *p = kv->arr + i * gguf_scalar_size(kv->arr_type);
    if (kv->arr_type == GGUF_TYPE_FLOAT32) {
        float x;
        memcpy(&x, p, 4);
        return x;
    }
    if (kv->arr_type == GGUF_TYPE_FLOAT64) {
        double x;
        memcpy(&x, p, 8);
        return x;
    }
    if (kv->arr_type == GGUF_TYPE_UINT64) {
        uint64_t x;
        memcpy(&x, p, 8);
        return (double)x;
    }
    return (double)gguf_arr_i64(kv, i);
}

bool gguf_type_is_int(uint32_t type)
{
    switch (type) {
    case GGUF_TYPE_UINT8: case GGUF_TYPE_INT8: case GGUF_TYPE_UINT16: case GGUF_TYPE_INT16:
    case GGUF_TYPE_UINT32: case GGUF_TYPE_INT32: case GGUF_TYPE_UINT64: case GGUF_TYPE_INT64:
        return true;
    default:
        return false;
    }
}

const char *gguf_type_name(uint32_t type)
{
    return type < GGUF_TYPE_COUNT ? gguf_type_names[type] : "?";
}

#define GGUF_PROGRESS_MIN_BYTES (256u << 20) /* smaller files load silently */

void gguf_prefault(const struct gguf *g, bool progress)
{
    const uint64_t n = gguf_n_tensors(g);
    uint64_t total = 0, done = 0;
    for (uint64_t i = 0; i < n; i++)
        total += gguf_tensor_at(g, i)->nbytes;
    const bool show = progress && total >= GGUF_PROGRESS_MIN_BYTES;
    const bool tty = isatty(STDERR_FILENO);
    volatile uint8_t sink = 0;
    int last = -1;
    for (uint64_t i = 0; i < n; i++) {
        const struct gguf_tensor *t = gguf_tensor_at(g, i);
        const uint8_t *p = t->data;
        for (uint64_t off = 0; off < t->nbytes; off += 4096)
            sink ^= p[off];
        done += t->nbytes;
        int pct = total ? (int)(done * 100 / total) : 100;
        if (!show || pct == last || (!tty && pct % 10 && pct != 100))
            continue;
        last = pct;
        char bar[41];
        memset(bar, '#', (size_t)pct * 40 / 100);
        memset(bar + pct * 40 / 100, ' ', 40 - (size_t)pct * 40 / 100);
        bar[40] = 0;
        fprintf(stderr, "%sloading [%s] %3d%% %.1f/%.1f GiB%s", tty ? "\r" : "", bar, pct,
                done / 1073741824.0, total / 1073741824.0, tty ? "" : "\n");
    }
    if (show && tty)
        fputc('\n', stderr);
    (void)sink;
}

