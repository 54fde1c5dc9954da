/*
 * gguf: a validated, read-only view of one GGUF file (model-spec section 1).
 *
 * The file is untrusted input. gguf_open() checks every count, length, type,
 * dimension, offset and extent before use (bounded reader, multiply only after
 * dividing) and rejects a bad file with one error line naming the field, the
 * tensor or key and the byte offset; nothing is allocated from an unchecked
 * number. After a successful open the whole file is mapped read-only and every
 * tensor's bytes lie inside it. Split shards (split.count > 1) are rejected
 * with a clear message. Versions 2 and 3 are accepted.
 *
 * Threading: after gguf_open() returns, all accessors are read-only and may be
 * called from any thread. Pointers returned point into the mapping or into the
 * gguf object and are borrowed until gguf_close().
 */
#ifndef MODEL_GGUF_H
#define MODEL_GGUF_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* GGUF metadata value types. */
enum gguf_type {
    GGUF_TYPE_UINT8 = 0,
    GGUF_TYPE_INT8 = 1,
    GGUF_TYPE_UINT16 = 2,
    GGUF_TYPE_INT16 = 3,
    GGUF_TYPE_UINT32 = 4,
    GGUF_TYPE_INT32 = 5,
    GGUF_TYPE_FLOAT32 = 6,
    GGUF_TYPE_BOOL = 7,
    GGUF_TYPE_STRING = 8,
    GGUF_TYPE_ARRAY = 9,
    GGUF_TYPE_UINT64 = 10,
    GGUF_TYPE_INT64 = 11,
    GGUF_TYPE_FLOAT64 = 12,
    GGUF_TYPE_COUNT = 13,
};

#define GGUF_MAX_DIMS 4         /* n_dims is 1..4 */
#define GGUF_MAX_NAME 64        /* tensor names are shorter than this */
#define GGUF_DEFAULT_ALIGNMENT 32

/* A string inside the mapping: not NUL-terminated. */
struct gguf_str {
    const char *ptr; /* borrowed, points into the mapping */
    uint64_t len;    /* bytes */
};

/* One metadata record. Scalars are decoded; strings and arrays point into the
 * mapping (array elements are little-endian and possibly unaligned: read them
 * with the gguf_arr_* helpers). */
struct gguf_kv {
    char *key;            /* NUL-terminated copy, owned by the gguf */
    uint32_t type;        /* enum gguf_type */
    uint32_t arr_type;    /* element type when type == ARRAY */
    uint64_t n;           /* element count when type == ARRAY */
    uint64_t file_offset; /* byte offset of the record's key in the file */
    union {
        uint64_t u64;     /* unsigned integer types and BOOL */
        int64_t i64;      /* signed integer types */
        double f64;       /* FLOAT32 and FLOAT64 */
    } v;
    struct gguf_str str;      /* STRING value */
    const uint8_t *arr;       /* ARRAY of numbers: first element, in the mapping */
    struct gguf_str *strs;    /* ARRAY of STRING: n entries, owned by the gguf */
};

/* One tensor-info record, validated. */
struct gguf_tensor {
    char name[GGUF_MAX_NAME]; /* NUL-terminated */
    uint32_t n_dims;          /* 1..4 */
    int64_t ne[GGUF_MAX_DIMS];/* fastest first, missing dims are 1 */
    uint32_t type;            /* enum quant_type */
    uint64_t offset;          /* relative to the data section */
    uint64_t nbytes;          /* row_size(type, ne[0]) * ne[1] * ne[2] * ne[3] */
    uint64_t file_offset;     /* byte offset of the record in the file */
    const void *data;         /* the tensor's bytes in the mapping */
};

struct gguf_config {
    const char *path;     /* file to map; or NULL with data/size below */
    const void *data;     /* an in-memory file (tests, fuzzing), borrowed */
    size_t size;          /* bytes at data */
    char *err;            /* optional: receives the rejection message */
    size_t err_len;       /* bytes at err */
    bool allow_split;     /* accept split.count > 1 (not yet used: default false) */
};

struct gguf;

/* Maps and validates the file. Returns an owned object, or NULL after logging
 * (and copying into cfg->err) why the file was rejected. Allocates the kv and
 * tensor tables; the data stays in the mapping. */
struct gguf *gguf_open(const struct gguf_config *cfg);

/* Unmaps and frees everything; accepts NULL. */
void gguf_close(struct gguf *g);

uint32_t gguf_version(const struct gguf *g);
uint64_t gguf_file_size(const struct gguf *g);
uint32_t gguf_alignment(const struct gguf *g);
uint64_t gguf_data_offset(const struct gguf *g); /* file offset of the data section */

uint64_t gguf_n_kv(const struct gguf *g);
const struct gguf_kv *gguf_kv_at(const struct gguf *g, uint64_t i);
const struct gguf_kv *gguf_find_kv(const struct gguf *g, const char *key); /* NULL if absent */

uint64_t gguf_n_tensors(const struct gguf *g);
const struct gguf_tensor *gguf_tensor_at(const struct gguf *g, uint64_t i);
const struct gguf_tensor *gguf_find_tensor(const struct gguf *g, const char *name);

/* Typed getters. Integer getters accept any integer (and BOOL) type and check
 * the range; float getters accept FLOAT32/FLOAT64 and integers. Return 0,
 * -ENOENT when the key is absent, -EINVAL (logged, with key and offset) when
 * the type or value does not fit. */
int gguf_get_u32(const struct gguf *g, const char *key, uint32_t *out);
int gguf_get_u64(const struct gguf *g, const char *key, uint64_t *out);
int gguf_get_f32(const struct gguf *g, const char *key, float *out);
int gguf_get_bool(const struct gguf *g, const char *key, bool *out);
/* out is borrowed (not NUL-terminated: use len). */
int gguf_get_str(const struct gguf *g, const char *key, struct gguf_str *out);

/* Element i of a numeric array as int64 / double; ASSERTs i < n and a numeric
 * element type (callers check kv->arr_type first). */
int64_t gguf_arr_i64(const struct gguf_kv *kv, uint64_t i);
double gguf_arr_f64(const struct gguf_kv *kv, uint64_t i);
bool gguf_type_is_int(uint32_t type);

/* Reads every page of the tensor data once, so that the first token does not
 * pay for page faults (or disk reads), with a progress bar on stderr when
 * progress is set and the data is large. Blocks. */
void gguf_prefault(const struct gguf *g, bool progress);

/* Name of a metadata type ("uint32"), or "?" */
const char *gguf_type_name(uint32_t type);

#endif
