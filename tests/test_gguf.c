/*
 * test_gguf: the GGUF reader accepts well-formed files with exact values and
 * rejects malformed ones with a message naming what is wrong.
 *
 * Files are built in memory by a small byte builder (struct bld). Each
 * rejection case must fail with its expected substring and a byte offset;
 * every strict prefix of a valid file must be rejected; random byte mutations
 * must never crash (run under ASan+UBSan to check reads stay in bounds), and
 * the accepted mutants also go through inspect_print().
 */
#include "model/gguf.h"

#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/check.h"
#include "common/log.h"
#include "model/inspect.h"
#include "model/quant.h"
#include "tests/check.h"

/* A growable byte buffer with little-endian writers. */
struct bld {
    uint8_t *buf;
    size_t len;
    size_t cap;
};

static void bld_bytes(struct bld *b, const void *p, size_t n)
{
    if (b->len + n > b->cap) {
        b->cap = (b->len + n) * 2 + 64;
        b->buf = realloc(b->buf, b->cap);
        if (!b->buf)
            abort();
    }
    memcpy(b->buf + b->len, p, n);
    b->len += n;
}

static void bld_u8(struct bld *b, uint8_t v) { bld_bytes(b, &v, 1); }
static void bld_u16(struct bld *b, uint16_t v) { bld_bytes(b, &v, 2); }
static void bld_u32(struct bld *b, uint32_t v) { bld_bytes(b, &v, 4); }
static void bld_u64(struct bld *b, uint64_t v) { bld_bytes(b, &v, 8); }
static void bld_f32(struct bld *b, float v) { bld_bytes(b, &v, 4); }
static void bld_f64(struct bld *b, double v) { bld_bytes(b, &v, 8); }

static void bld_str(struct bld *b, const char *s)
{
    bld_u64(b, strlen(s));
    bld_bytes(b, s, strlen(s));
}

static void bld_zeros(struct bld *b, size_t n)
{
    for (size_t i = 0; i < n; i++)
        bld_u8(b, 0);
}

static void bld_pad(struct bld *b, size_t align)
{
    bld_zeros(b, (align - b->len % align) % align);
}

static void bld_hdr(struct bld *b, uint32_t version, uint64_t n_tensors, uint64_t n_kv)
{
    bld_bytes(b, "GGUF", 4);
    bld_u32(b, version);
    bld_u64(b, n_tensors);
    bld_u64(b, n_kv);
}

static void bld_kv_head(struct bld *b, const char *key, uint32_t type)
{
    bld_str(b, key);
    bld_u32(b, type);
}

static void bld_kv_u32(struct bld *b, const char *key, uint32_t v)
{
    bld_kv_head(b, key, GGUF_TYPE_UINT32);
    bld_u32(b, v);
}

static void bld_kv_str(struct bld *b, const char *key, const char *v)
{
    bld_kv_head(b, key, GGUF_TYPE_STRING);
    bld_str(b, v);
}

/* A tensor-info record; ne has n_dims entries. */
static void bld_ti(struct bld *b, const char *name, uint32_t n_dims, const uint64_t *ne,
                   uint32_t type, uint64_t offset)
{
    bld_str(b, name);
    bld_u32(b, n_dims);
    for (uint32_t i = 0; i < n_dims; i++)
        bld_u64(b, ne[i]);
    bld_u32(b, type);
    bld_u64(b, offset);
}

/* One tensor "t" of the given shape and type at offset, then padding and
 * data bytes of the given size. */
static void bld_one_tensor(struct bld *b, uint32_t n_dims, const uint64_t *ne, uint32_t type,
                           uint64_t offset, size_t data)
{
    bld_hdr(b, 3, 1, 0);
    bld_ti(b, "t", n_dims, ne, type, offset);
    bld_pad(b, 32);
    bld_zeros(b, data);
}

/* The reference valid file: three kvs, three tensors (F32, Q8_0, F32) whose
 * bytes are a pattern; the file ends exactly where the last tensor ends, so
 * every strict prefix is invalid. */
static void bld_valid(struct bld *b)
{
    bld_hdr(b, 3, 3, 3);
    bld_kv_str(b, "general.architecture", "test");
    bld_kv_u32(b, "general.alignment", 32);
    bld_kv_u32(b, "test.block_count", 2);
    bld_ti(b, "a", 2, (uint64_t[]){8, 2}, QUANT_TYPE_F32, 0);    /* 64 bytes */
    bld_ti(b, "b", 2, (uint64_t[]){32, 3}, QUANT_TYPE_Q8_0, 64); /* 102, padded 128 */
    bld_ti(b, "c", 1, (uint64_t[]){5}, QUANT_TYPE_F32, 192);     /* 20 bytes */
    bld_pad(b, 32);
    for (size_t i = 0; i < 192 + 20; i++)
        bld_u8(b, (uint8_t)(i * 7 + 1));
}

/* A kv of every scalar type, arrays of every element type, alignment 64 and
 * two tensors (F16 2-D, Q4_0 3-D). */
static void bld_rich(struct bld *b, uint32_t version)
{
    bld_hdr(b, version, 2, 29);
    bld_kv_head(b, "t.u8", GGUF_TYPE_UINT8), bld_u8(b, 250);
    bld_kv_head(b, "t.i8", GGUF_TYPE_INT8), bld_u8(b, (uint8_t)-100);
    bld_kv_head(b, "t.u16", GGUF_TYPE_UINT16), bld_u16(b, 65000);
    bld_kv_head(b, "t.i16", GGUF_TYPE_INT16), bld_u16(b, (uint16_t)-30000);
    bld_kv_head(b, "t.u32", GGUF_TYPE_UINT32), bld_u32(b, 4000000000u);
    bld_kv_head(b, "t.i32", GGUF_TYPE_INT32), bld_u32(b, (uint32_t)-2000000000);
    bld_kv_head(b, "t.f32", GGUF_TYPE_FLOAT32), bld_f32(b, 0.25f);
    bld_kv_head(b, "t.bool", GGUF_TYPE_BOOL), bld_u8(b, 1);
    bld_kv_str(b, "t.str", "h\xc3\xa9llo");
    bld_kv_head(b, "t.u64", GGUF_TYPE_UINT64), bld_u64(b, 1ull << 40);
    bld_kv_head(b, "t.i64", GGUF_TYPE_INT64), bld_u64(b, (uint64_t)-5);
    bld_kv_head(b, "t.f64", GGUF_TYPE_FLOAT64), bld_f64(b, 3.5);
    bld_kv_head(b, "t.f64big", GGUF_TYPE_FLOAT64), bld_f64(b, 1e300);
    bld_kv_u32(b, "t.one", 1);
    bld_kv_u32(b, "general.alignment", 64);
    bld_kv_head(b, "split.count", GGUF_TYPE_UINT16), bld_u16(b, 1);
    bld_kv_head(b, "a.u8", GGUF_TYPE_ARRAY), bld_u32(b, GGUF_TYPE_UINT8), bld_u64(b, 3);
    bld_u8(b, 1), bld_u8(b, 2), bld_u8(b, 255);
    bld_kv_head(b, "a.i8", GGUF_TYPE_ARRAY), bld_u32(b, GGUF_TYPE_INT8), bld_u64(b, 3);
    bld_u8(b, 0xff), bld_u8(b, 0), bld_u8(b, 127);
    bld_kv_head(b, "a.u16", GGUF_TYPE_ARRAY), bld_u32(b, GGUF_TYPE_UINT16), bld_u64(b, 2);
    bld_u16(b, 7), bld_u16(b, 65535);
    bld_kv_head(b, "a.i16", GGUF_TYPE_ARRAY), bld_u32(b, GGUF_TYPE_INT16), bld_u64(b, 2);
    bld_u16(b, (uint16_t)-32768), bld_u16(b, 300);
    bld_kv_head(b, "a.u32", GGUF_TYPE_ARRAY), bld_u32(b, GGUF_TYPE_UINT32), bld_u64(b, 2);
    bld_u32(b, 0), bld_u32(b, 4294967295u);
    bld_kv_head(b, "a.i32", GGUF_TYPE_ARRAY), bld_u32(b, GGUF_TYPE_INT32), bld_u64(b, 3);
    bld_u32(b, (uint32_t)-7), bld_u32(b, 8), bld_u32(b, (uint32_t)INT32_MIN);
    bld_kv_head(b, "a.f32", GGUF_TYPE_ARRAY), bld_u32(b, GGUF_TYPE_FLOAT32), bld_u64(b, 2);
    bld_f32(b, 0.5f), bld_f32(b, -2.0f);
    bld_kv_head(b, "a.bool", GGUF_TYPE_ARRAY), bld_u32(b, GGUF_TYPE_BOOL), bld_u64(b, 3);
    bld_u8(b, 1), bld_u8(b, 0), bld_u8(b, 1);
    bld_kv_head(b, "a.str", GGUF_TYPE_ARRAY), bld_u32(b, GGUF_TYPE_STRING), bld_u64(b, 3);
    bld_str(b, "x"), bld_str(b, ""), bld_str(b, "yz");
    bld_kv_head(b, "a.u64", GGUF_TYPE_ARRAY), bld_u32(b, GGUF_TYPE_UINT64), bld_u64(b, 2);
    bld_u64(b, 1ull << 50), bld_u64(b, 9);
    bld_kv_head(b, "a.i64", GGUF_TYPE_ARRAY), bld_u32(b, GGUF_TYPE_INT64), bld_u64(b, 2);
    bld_u64(b, (uint64_t)INT64_MIN), bld_u64(b, 42);
    bld_kv_head(b, "a.f64", GGUF_TYPE_ARRAY), bld_u32(b, GGUF_TYPE_FLOAT64), bld_u64(b, 2);
    bld_f64(b, -0.125), bld_f64(b, 1e100);
    bld_kv_head(b, "a.empty", GGUF_TYPE_ARRAY), bld_u32(b, GGUF_TYPE_UINT32), bld_u64(b, 0);
    bld_ti(b, "w", 2, (uint64_t[]){4, 2}, QUANT_TYPE_F16, 0);        /* 16 bytes, padded 64 */
    bld_ti(b, "e", 3, (uint64_t[]){64, 1, 2}, QUANT_TYPE_Q4_0, 64);  /* 4 blocks: 72 bytes */
    bld_pad(b, 64);
    for (size_t i = 0; i < 64 + 72; i++)
        bld_u8(b, (uint8_t)(i * 13 + 5));
}

/* An in-memory file: a heap copy of exactly the file's bytes (so ASan sees a
 * read one past the end), and the gguf opened on it. */
struct memfile {
    uint8_t *bytes;
    struct gguf *g;
};

static struct memfile mem_open(const uint8_t *p, size_t len, char *err, size_t err_len)
{
    struct memfile m = {.bytes = malloc(len ? len : 1)};
    if (!m.bytes)
        abort();
    memcpy(m.bytes, p, len);
    struct gguf_config cfg = {.data = len ? m.bytes : NULL, .size = len, .err = err,
                              .err_len = err_len};
    m.g = gguf_open(&cfg);
    return m;
}

static void mem_close(struct memfile *m)
{
    gguf_close(m->g);
    free(m->bytes);
}

/* Under UBSan a finding must fail the run even while stderr is silenced. */
const char *__ubsan_default_options(void);
const char *__ubsan_default_options(void)
{
    return "halt_on_error=1:print_stacktrace=1";
}

static int stderr_saved = -1;

/* Sends stderr to /dev/null around loops that log thousands of expected errors. */
static void quiet(bool on)
{
    fflush(stderr);
    if (on) {
        stderr_saved = dup(2);
        FILE *f = freopen("/dev/null", "w", stderr);
        (void)f;
    } else if (stderr_saved >= 0) {
        dup2(stderr_saved, 2);
        close(stderr_saved);
        stderr_saved = -1;
    }
}

static bool has(const char *s, const char *sub)
{
    return strstr(s, sub) != NULL;
}

/* The malformed files: name, expected substring of the rejection message. */
struct bad_case {
    const char *name;
    const char *expect;
};

static const struct bad_case bad_cases[] = {
    {"bad magic", "bad magic"},
    {"version 1", "version 1 is not supported"},
    {"version 4", "version 4 is not supported"},
    {"big-endian version", "big-endian"},
    {"tensor_count 2^63", "tensor_count 9223372036854775808 cannot fit"},
    {"kv_count 2^63", "kv_count 9223372036854775808 cannot fit"},
    {"kv_count 2^64-1", "kv_count 18446744073709551615"},
    {"key length 2^63", "key length 9223372036854775808 exceeds"},
    {"string value length 2^63", "string value length"},
    {"49-byte file, array count 2^63", "array count 9223372036854775808"},
    {"string array count 2^62", "array count 4611686018427387904"},
    {"string array element too long", "array string length 1000 exceeds"},
    {"unknown value type 13", "value type 13 is not a known"},
    {"unknown value type 2^32-1", "value type 4294967295"},
    {"unknown array element type", "array element type 13 is not a known"},
    {"nested array", "nested arrays"},
    {"bool value 2", "bool value is 2"},
    {"bool array element 5", "bool array element 1 is 5"},
    {"duplicate key", "duplicate key 'test.x'"},
    {"duplicate tensor name", "duplicate tensor name 'a'"},
    {"alignment as uint64", "general.alignment must be uint32, not uint64"},
    {"alignment as int32", "general.alignment must be uint32, not int32"},
    {"alignment 0", "general.alignment 0 is not a non-zero power of two"},
    {"alignment 48", "general.alignment 48 is not a non-zero power of two"},
    {"n_dims 0", "n_dims 0 is not in 1..4"},
    {"n_dims 5", "n_dims 5 is not in 1..4"},
    {"ne 0", "ne[1] = 0 must be >= 1"},
    {"ne -5", "ne[0] = -5 must be >= 1"},
    {"ne 2^63", "ne[2] = -9223372036854775808 must be >= 1"},
    {"dims product overflow", "ne[1] = 4294967296 makes the element count overflow"},
    {"dims product overflow, 4 dims", "ne[3] = 3 makes the element count overflow"},
    {"byte size overflow", "byte size of 4611686018427387904 F32 blocks overflows"},
    {"unknown tensor type 4", "type 4 is not a known ggml type"},
    {"unknown tensor type 1000", "type 1000 is not a known ggml type"},
    {"Q8_0 ne[0] 33", "ne[0] = 33 is not a multiple of the Q8_0 block size 32"},
    {"Q4_K ne[0] 128", "ne[0] = 128 is not a multiple of the Q4_K block size 256"},
    {"misaligned offset", "offset 8 is not a multiple of the alignment 32"},
    {"overlapping tensors", "offset 32 overlaps the previous tensor, which ends at 64"},
    {"same offset twice", "tensor 1 'b': offset 0 overlaps"},
    {"hole between tensors", "offset 128 leaves a hole after the previous tensor, expected 64"},
    {"first tensor not at 0", "tensor 0 't': offset 32 leaves a hole"},
    {"tensor one byte past end", "runs past the end of the file"},
    {"huge tensor past end", "data [0, +4398046511104) runs past the end"},
    {"data section past end", "runs past the end of the file"},
    {"tensor name 64 bytes", "tensor name length 64 is not in 1..63"},
    {"tensor name with NUL", "tensor name contains a NUL byte"},
    {"empty tensor name", "tensor name length 0"},
    {"empty key", "key length 0 is not in 1..255"},
    {"key with newline", "key byte 3 is control byte 0x0a"},
    {"key 300 bytes", "key length 300 is not in 1..255"},
    {"split.count 2", "split GGUF files are not supported yet; merge the shards with "
                      "llama-gguf-split --merge"},
    {"split.count 3 as uint32", "split.count 3: split GGUF"},
    {"kv_count larger than the kvs", "kv 1: file truncated: key needs 8 bytes"},
    {"tensor_count larger than the infos", "tensor 1: file truncated: tensor name needs 8"},
    {"header cut at 20 bytes", "file truncated: kv_count needs 8 bytes, 4 left"},
    {"split.count as string", "split.count must be an integer, not string"},
};

#define N_BAD (sizeof(bad_cases) / sizeof(bad_cases[0]))

/* Two F32 [16] tensors (64 bytes each) at offsets 0 and off1. */
static void bld_two_tensors(struct bld *b, const char *n1, uint64_t off1, size_t data)
{
    bld_hdr(b, 3, 2, 0);
    bld_ti(b, "a", 1, (uint64_t[]){16}, QUANT_TYPE_F32, 0);
    bld_ti(b, n1, 1, (uint64_t[]){16}, QUANT_TYPE_F32, off1);
    bld_pad(b, 32);
    bld_zeros(b, data);
}

/* One kv (header included) whose value follows. */
static void bld_one_kv(struct bld *b, const char *key, uint32_t type)
{
    bld_hdr(b, 3, 0, 1);
    bld_kv_head(b, key, type);
}

/* Header, metadata and count cases (ids 0..23). */
static void bld_bad_kv(struct bld *b, int id)
{
    switch (id) {
    case 0: bld_bytes(b, "GGUX", 4), bld_u32(b, 3), bld_u64(b, 0), bld_u64(b, 0); break;
    case 1: bld_hdr(b, 1, 0, 0); break;
    case 2: bld_hdr(b, 4, 0, 0); break;
    case 3: bld_hdr(b, 0x03000000u, 0, 0); break;
    case 4: bld_hdr(b, 3, 1ull << 63, 0), bld_zeros(b, 64); break;
    case 5: bld_hdr(b, 3, 0, 1ull << 63), bld_zeros(b, 64); break;
    case 6: bld_hdr(b, 3, 0, UINT64_MAX), bld_zeros(b, 64); break;
    case 7: bld_hdr(b, 3, 0, 1), bld_u64(b, 1ull << 63), bld_zeros(b, 16); break;
    case 8: bld_one_kv(b, "k", GGUF_TYPE_STRING), bld_u64(b, 1ull << 63); break;
    case 9:
        bld_one_kv(b, "a", GGUF_TYPE_ARRAY), bld_u32(b, GGUF_TYPE_UINT8);
        bld_u64(b, 1ull << 63);
        break;
    case 10:
        bld_one_kv(b, "k", GGUF_TYPE_ARRAY), bld_u32(b, GGUF_TYPE_STRING);
        bld_u64(b, 1ull << 62), bld_zeros(b, 64);
        break;
    case 11:
        bld_one_kv(b, "k", GGUF_TYPE_ARRAY), bld_u32(b, GGUF_TYPE_STRING), bld_u64(b, 2);
        bld_str(b, "ok"), bld_u64(b, 1000), bld_zeros(b, 100);
        break;
    case 12: bld_one_kv(b, "k", 13), bld_u32(b, 0); break;
    case 13: bld_one_kv(b, "k", UINT32_MAX), bld_u32(b, 0); break;
    case 14: bld_one_kv(b, "k", GGUF_TYPE_ARRAY), bld_u32(b, 13), bld_u64(b, 0); break;
    case 15:
        bld_one_kv(b, "k", GGUF_TYPE_ARRAY), bld_u32(b, GGUF_TYPE_ARRAY), bld_u64(b, 1);
        bld_u32(b, GGUF_TYPE_UINT8), bld_u64(b, 0);
        break;
    case 16: bld_one_kv(b, "k", GGUF_TYPE_BOOL), bld_u8(b, 2); break;
    case 17:
        bld_one_kv(b, "k", GGUF_TYPE_ARRAY), bld_u32(b, GGUF_TYPE_BOOL), bld_u64(b, 2);
        bld_u8(b, 1), bld_u8(b, 5);
        break;
    case 18:
        bld_hdr(b, 3, 0, 3), bld_kv_u32(b, "test.x", 1), bld_kv_u32(b, "test.y", 2);
        bld_kv_str(b, "test.x", "again");
        break;
    case 20: bld_one_kv(b, "general.alignment", GGUF_TYPE_UINT64), bld_u64(b, 32); break;
    case 21: bld_one_kv(b, "general.alignment", GGUF_TYPE_INT32), bld_u32(b, 32); break;
    case 22: bld_hdr(b, 3, 0, 1), bld_kv_u32(b, "general.alignment", 0); break;
    case 23: bld_hdr(b, 3, 0, 1), bld_kv_u32(b, "general.alignment", 48); break;
    default: ASSERT(!"no such metadata case");
    }
}

/* Tensor-info cases (ids 19 and 24..46). */
static void bld_bad_tensor(struct bld *b, int id)
{
    const uint64_t big = 1ull << 32;
    switch (id) {
    case 19: bld_two_tensors(b, "a", 64, 128); break;
    case 24: bld_one_tensor(b, 0, (uint64_t[]){4}, QUANT_TYPE_F32, 0, 16); break;
    case 25: bld_one_tensor(b, 5, (uint64_t[]){1, 1, 1, 1, 1}, QUANT_TYPE_F32, 0, 4); break;
    case 26: bld_one_tensor(b, 2, (uint64_t[]){4, 0}, QUANT_TYPE_F32, 0, 16); break;
    case 27: bld_one_tensor(b, 1, (uint64_t[]){(uint64_t)-5}, QUANT_TYPE_F32, 0, 16); break;
    case 28: bld_one_tensor(b, 3, (uint64_t[]){1, 1, 1ull << 63}, QUANT_TYPE_F32, 0, 16); break;
    case 29: bld_one_tensor(b, 2, (uint64_t[]){big, big}, QUANT_TYPE_F32, 0, 16); break;
    case 30:
        bld_one_tensor(b, 4, (uint64_t[]){1ull << 21, 1ull << 21, 1ull << 20, 3},
                       QUANT_TYPE_F32, 0, 16);
        break;
    case 31: bld_one_tensor(b, 1, (uint64_t[]){1ull << 62}, QUANT_TYPE_F32, 0, 16); break;
    case 32: bld_one_tensor(b, 1, (uint64_t[]){32}, 4, 0, 128); break;
    case 33: bld_one_tensor(b, 1, (uint64_t[]){32}, 1000, 0, 128); break;
    case 34: bld_one_tensor(b, 1, (uint64_t[]){33}, QUANT_TYPE_Q8_0, 0, 64); break;
    case 35: bld_one_tensor(b, 1, (uint64_t[]){128}, QUANT_TYPE_Q4_K, 0, 256); break;
    case 36: bld_one_tensor(b, 1, (uint64_t[]){4}, QUANT_TYPE_F32, 8, 64); break;
    case 37: bld_two_tensors(b, "b", 32, 128); break;
    case 38: bld_two_tensors(b, "b", 0, 128); break;
    case 39: bld_two_tensors(b, "b", 128, 256); break;
    case 40: bld_one_tensor(b, 1, (uint64_t[]){4}, QUANT_TYPE_F32, 32, 64); break;
    case 41: bld_two_tensors(b, "b", 64, 127); break;
    case 42: bld_one_tensor(b, 1, (uint64_t[]){1ull << 40}, QUANT_TYPE_F32, 0, 64); break;
    case 43:
        bld_hdr(b, 3, 1, 0), bld_ti(b, "t", 1, (uint64_t[]){4}, QUANT_TYPE_F32, 0);
        break; /* no padding, no data: the data section starts past the end */
    case 44: {
        char name[65];
        memset(name, 'n', 64);
        name[64] = '\0';
        bld_hdr(b, 3, 1, 0), bld_ti(b, name, 1, (uint64_t[]){4}, QUANT_TYPE_F32, 0);
        bld_pad(b, 32), bld_zeros(b, 16);
        break;
    }
    case 45:
        bld_hdr(b, 3, 1, 0), bld_u64(b, 3), bld_bytes(b, "a\0b", 3), bld_u32(b, 1);
        bld_u64(b, 4), bld_u32(b, QUANT_TYPE_F32), bld_u64(b, 0), bld_pad(b, 32);
        bld_zeros(b, 16);
        break;
    case 46: bld_hdr(b, 3, 1, 0), bld_ti(b, "", 1, (uint64_t[]){4}, 0, 0), bld_zeros(b, 64); break;
    default: ASSERT(!"no such tensor case");
    }
}

/* Key, split and truncation cases (ids 47..55). */
static void bld_bad_misc(struct bld *b, int id)
{
    char key[301];
    switch (id) {
    case 47: bld_hdr(b, 3, 0, 1), bld_kv_u32(b, "", 1); break;
    case 48: bld_hdr(b, 3, 0, 1), bld_kv_u32(b, "abc\nd", 1); break;
    case 49:
        memset(key, 'k', 300);
        key[300] = '\0';
        bld_hdr(b, 3, 0, 1), bld_kv_u32(b, key, 1);
        break;
    case 50: bld_one_kv(b, "split.count", GGUF_TYPE_UINT16), bld_u16(b, 2); break;
    case 51: bld_hdr(b, 3, 0, 1), bld_kv_u32(b, "split.count", 3); break;
    case 52: bld_hdr(b, 3, 0, 2), bld_kv_str(b, "general.architecture", "test"); break;
    case 53: /* a 40-byte name makes room for two records, so the count passes */
        bld_hdr(b, 3, 2, 0);
        bld_ti(b, "tttttttttttttttttttttttttttttttttttttttt", 1, (uint64_t[]){4}, 0, 0);
        bld_zeros(b, 4);
        break;
    case 54: bld_hdr(b, 3, 0, 0), b->len = 20; break;
    case 55: bld_hdr(b, 3, 0, 1), bld_kv_str(b, "split.count", "2"); break;
    default: ASSERT(!"no such misc case");
    }
}

static void bld_bad(struct bld *b, int id)
{
    if (id == 19 || (id >= 24 && id <= 46))
        bld_bad_tensor(b, id);
    else if (id < 24)
        bld_bad_kv(b, id);
    else
        bld_bad_misc(b, id);
}

/* Every malformed file is rejected, with its expected message, a byte offset,
 * and the same text as the one error line logged. */
static void test_rejections(void)
{
    int rejected = 0;
    for (size_t i = 0; i < N_BAD; i++) {
        struct bld b = {0};
        bld_bad(&b, (int)i);
        char err[512] = "";
        quiet(true);
        struct memfile m = mem_open(b.buf, b.len, err, sizeof(err));
        quiet(false);
        CHECK(!m.g, "case %zu '%s' was accepted", i, bad_cases[i].name);
        CHECK(has(err, bad_cases[i].expect), "case %zu '%s': message '%s' lacks '%s'", i,
              bad_cases[i].name, err, bad_cases[i].expect);
        CHECK(has(err, "(byte offset "), "case %zu: no byte offset in '%s'", i, err);
        CHECK(strcmp(err, log_last_error()) == 0, "case %zu: logged '%s' but err '%s'", i,
              log_last_error(), err);
        rejected += !m.g && has(err, bad_cases[i].expect);
        mem_close(&m);
        free(b.buf);
    }
    MEASURE("gguf rejection cases: %d of %zu rejected with the expected message", rejected, N_BAD);
}

/* The 49-byte file declaring 2^63 array elements is rejected at once. */
static void test_huge_array_fast(void)
{
    struct bld b = {0};
    bld_bad(&b, 9);
    CHECK(b.len == 49, "huge-array file is %zu bytes", b.len);
    struct timespec t0, t1;
    clock_gettime(CLOCK_MONOTONIC, &t0);
    quiet(true);
    struct memfile m = mem_open(b.buf, b.len, NULL, 0);
    quiet(false);
    clock_gettime(CLOCK_MONOTONIC, &t1);
    double us = (t1.tv_sec - t0.tv_sec) * 1e6 + (t1.tv_nsec - t0.tv_nsec) / 1e3;
    CHECK(!m.g && us < 10000, "huge array: accepted=%d in %.0f us", m.g != NULL, us);
    mem_close(&m);
    free(b.buf);
}

/* Every strict prefix of a valid file is rejected; the whole file is accepted. */
static int truncations(const struct bld *b, const char *what)
{
    int bad = 0;
    quiet(true);
    for (size_t len = 0; len < b->len; len++) {
        char err[512] = "";
        struct memfile m = mem_open(b->buf, len, err, sizeof(err));
        if (m.g || !has(err, "(byte offset "))
            bad++;
        mem_close(&m);
    }
    quiet(false);
    struct memfile m = mem_open(b->buf, b->len, NULL, 0);
    CHECK(m.g, "%s: the full file is rejected", what);
    mem_close(&m);
    CHECK(bad == 0, "%s: %d prefixes of %zu were accepted or had no offset", what, bad, b->len);
    return (int)b->len;
}

static void test_truncations(void)
{
    struct bld v = {0}, r = {0};
    bld_valid(&v);
    bld_rich(&r, 3);
    int n = truncations(&v, "valid") + truncations(&r, "rich");
    MEASURE("gguf truncation: all %d strict prefixes of two valid files rejected", n);
    free(v.buf);
    free(r.buf);
}

/* Scalars of every type read back exactly, through the kv and the getters. */
static void check_rich_scalars(const struct gguf *g)
{
    uint32_t u32 = 0;
    uint64_t u64 = 0;
    float f = 0;
    bool bo = false;
    struct gguf_str s = {0};
    CHECK(gguf_find_kv(g, "t.i8")->v.i64 == -100, "i8");
    CHECK(gguf_find_kv(g, "t.i16")->v.i64 == -30000, "i16");
    CHECK(gguf_find_kv(g, "t.i32")->v.i64 == -2000000000, "i32");
    CHECK(gguf_find_kv(g, "t.u16")->v.u64 == 65000, "u16");
    CHECK(gguf_find_kv(g, "t.i64")->v.i64 == -5, "i64");
    CHECK(gguf_get_u32(g, "t.u8", &u32) == 0 && u32 == 250, "u32 of u8: %u", u32);
    CHECK(gguf_get_u32(g, "t.u32", &u32) == 0 && u32 == 4000000000u, "u32: %u", u32);
    CHECK(gguf_get_u32(g, "t.bool", &u32) == 0 && u32 == 1, "u32 of bool");
    CHECK(gguf_get_u64(g, "t.u64", &u64) == 0 && u64 == 1ull << 40, "u64");
    CHECK(gguf_get_f32(g, "t.f32", &f) == 0 && f == 0.25f, "f32 %g", f);
    CHECK(gguf_get_f32(g, "t.f64", &f) == 0 && f == 3.5f, "f32 of f64 %g", f);
    CHECK(gguf_get_f32(g, "t.i16", &f) == 0 && f == -30000.0f, "f32 of i16 %g", f);
    CHECK(gguf_get_f32(g, "t.u32", &f) == 0 && f == 4e9f, "f32 of u32 %g", f);
    CHECK(gguf_get_bool(g, "t.bool", &bo) == 0 && bo, "bool");
    CHECK(gguf_get_bool(g, "t.one", &bo) == 0 && bo, "bool of u32 1");
    CHECK(gguf_get_str(g, "t.str", &s) == 0 && s.len == 6 && memcmp(s.ptr, "h\xc3\xa9llo", 6) == 0,
          "str len %llu", (unsigned long long)s.len);
    CHECK(gguf_get_u32(g, "general.alignment", &u32) == 0 && u32 == 64, "alignment kv");
}

/* Getters reject what does not fit with -EINVAL and absent keys with -ENOENT. */
static void check_rich_getter_errors(const struct gguf *g)
{
    uint32_t u32 = 0;
    uint64_t u64 = 0;
    float f = 0;
    bool bo = false;
    struct gguf_str s = {0};
    CHECK(gguf_get_u32(g, "t.i8", &u32) == -EINVAL, "negative i8 as u32");
    CHECK(gguf_get_u32(g, "t.u64", &u32) == -EINVAL, "2^40 as u32");
    CHECK(gguf_get_u64(g, "t.i64", &u64) == -EINVAL, "negative i64 as u64");
    CHECK(gguf_get_u32(g, "t.f32", &u32) == -EINVAL, "float as u32");
    CHECK(gguf_get_u32(g, "t.str", &u32) == -EINVAL, "string as u32");
    CHECK(gguf_get_u32(g, "a.u8", &u32) == -EINVAL, "array as u32");
    CHECK(gguf_get_f32(g, "t.f64big", &f) == -EINVAL, "1e300 as f32");
    CHECK(gguf_get_f32(g, "t.str", &f) == -EINVAL, "string as f32");
    CHECK(gguf_get_bool(g, "t.u8", &bo) == -EINVAL, "250 as bool");
    CHECK(gguf_get_str(g, "t.u32", &s) == -EINVAL, "u32 as string");
    CHECK(has(log_last_error(), "t.u32") && has(log_last_error(), "byte offset"),
          "getter error names key and offset: '%s'", log_last_error());
    CHECK(gguf_get_u32(g, "t.nope", &u32) == -ENOENT, "absent u32");
    CHECK(gguf_get_u64(g, "t.nope", &u64) == -ENOENT, "absent u64");
    CHECK(gguf_get_f32(g, "t.nope", &f) == -ENOENT, "absent f32");
    CHECK(gguf_get_bool(g, "t.nope", &bo) == -ENOENT, "absent bool");
    CHECK(gguf_get_str(g, "", &s) == -ENOENT, "absent str");
}

static void check_rich_arrays(const struct gguf *g)
{
    const struct gguf_kv *kv;
    kv = gguf_find_kv(g, "a.u8");
    CHECK(kv && kv->arr_type == GGUF_TYPE_UINT8 && kv->n == 3 && gguf_arr_i64(kv, 2) == 255,
          "a.u8");
    kv = gguf_find_kv(g, "a.i8");
    CHECK(kv && gguf_arr_i64(kv, 0) == -1 && gguf_arr_i64(kv, 2) == 127, "a.i8");
    kv = gguf_find_kv(g, "a.u16");
    CHECK(kv && gguf_arr_i64(kv, 1) == 65535, "a.u16");
    kv = gguf_find_kv(g, "a.i16");
    CHECK(kv && gguf_arr_i64(kv, 0) == -32768 && gguf_arr_i64(kv, 1) == 300, "a.i16");
    kv = gguf_find_kv(g, "a.u32");
    CHECK(kv && gguf_arr_i64(kv, 1) == 4294967295ll, "a.u32");
    kv = gguf_find_kv(g, "a.i32");
    CHECK(kv && kv->n == 3 && gguf_arr_i64(kv, 0) == -7 && gguf_arr_i64(kv, 2) == INT32_MIN,
          "a.i32");
    kv = gguf_find_kv(g, "a.f32");
    CHECK(kv && gguf_arr_f64(kv, 0) == 0.5 && gguf_arr_f64(kv, 1) == -2.0, "a.f32");
    kv = gguf_find_kv(g, "a.bool");
    CHECK(kv && gguf_arr_i64(kv, 0) == 1 && gguf_arr_i64(kv, 1) == 0, "a.bool");
    kv = gguf_find_kv(g, "a.u64");
    CHECK(kv && gguf_arr_i64(kv, 0) == 1ll << 50 && gguf_arr_f64(kv, 1) == 9.0, "a.u64");
    kv = gguf_find_kv(g, "a.i64");
    CHECK(kv && gguf_arr_i64(kv, 0) == INT64_MIN && gguf_arr_f64(kv, 1) == 42.0, "a.i64");
    kv = gguf_find_kv(g, "a.f64");
    CHECK(kv && gguf_arr_f64(kv, 0) == -0.125 && gguf_arr_f64(kv, 1) == 1e100, "a.f64");
    kv = gguf_find_kv(g, "a.i16");
    CHECK(kv && gguf_arr_f64(kv, 0) == -32768.0, "a.i16 as f64");
    kv = gguf_find_kv(g, "a.empty");
    CHECK(kv && kv->n == 0 && kv->arr_type == GGUF_TYPE_UINT32, "a.empty");
    kv = gguf_find_kv(g, "a.str");
    CHECK(kv && kv->arr_type == GGUF_TYPE_STRING && kv->n == 3 && kv->strs, "a.str");
    if (kv && kv->strs)
        CHECK(kv->strs[0].len == 1 && kv->strs[0].ptr[0] == 'x' && kv->strs[1].len == 0 &&
              kv->strs[2].len == 2 && memcmp(kv->strs[2].ptr, "yz", 2) == 0, "a.str values");
}

static void check_rich_tensors(const struct gguf *g, const uint8_t *base, size_t len)
{
    CHECK(gguf_alignment(g) == 64 && gguf_data_offset(g) % 64 == 0, "alignment %u data %llu",
          gguf_alignment(g), (unsigned long long)gguf_data_offset(g));
    CHECK(gguf_file_size(g) == len && gguf_data_offset(g) + 64 + 72 == len, "sizes");
    CHECK(gguf_n_tensors(g) == 2 && gguf_n_kv(g) == 29, "counts");
    const struct gguf_tensor *w = gguf_find_tensor(g, "w"), *e = gguf_find_tensor(g, "e");
    CHECK(w && e && w == gguf_tensor_at(g, 0) && e == gguf_tensor_at(g, 1), "find tensors");
    if (!w || !e)
        return;
    CHECK(w->n_dims == 2 && w->ne[0] == 4 && w->ne[1] == 2 && w->ne[2] == 1 && w->ne[3] == 1 &&
          w->type == QUANT_TYPE_F16 && w->nbytes == 16 && w->offset == 0, "w info");
    CHECK(e->n_dims == 3 && e->ne[0] == 64 && e->ne[2] == 2 && e->nbytes == 72 &&
          e->offset == 64, "e info: nbytes %llu", (unsigned long long)e->nbytes);
    CHECK(w->data == base + gguf_data_offset(g) && e->data == base + gguf_data_offset(g) + 64,
          "data pointers");
    CHECK(((const uint8_t *)e->data)[71] == (uint8_t)(135 * 13 + 5), "last data byte");
    CHECK(gguf_find_tensor(g, "x") == NULL && gguf_find_kv(g, "x") == NULL, "absent names");
    CHECK(strcmp(gguf_kv_at(g, 0)->key, "t.u8") == 0 && gguf_kv_at(g, 0)->file_offset == 24,
          "kv 0 '%s' at %llu", gguf_kv_at(g, 0)->key,
          (unsigned long long)gguf_kv_at(g, 0)->file_offset);
}

/* A valid file of each version with every metadata type reads back exactly. */
static void test_rich(uint32_t version)
{
    struct bld b = {0};
    bld_rich(&b, version);
    char err[512] = "";
    struct memfile m = mem_open(b.buf, b.len, err, sizeof(err));
    CHECK(m.g, "rich v%u rejected: %s", version, err);
    if (m.g) {
        CHECK(gguf_version(m.g) == version, "version %u", gguf_version(m.g));
        check_rich_scalars(m.g);
        quiet(true);
        check_rich_getter_errors(m.g);
        quiet(false);
        check_rich_arrays(m.g);
        check_rich_tensors(m.g, m.bytes, b.len);
    }
    mem_close(&m);
    free(b.buf);
}

/* Files that look odd but are valid: an unsupported-but-known tensor type,
 * split.count 2 with allow_split, no tensors at all. */
static void test_accepted_edges(void)
{
    struct bld b = {0};
    bld_one_tensor(&b, 2, (uint64_t[]){256, 2}, QUANT_TYPE_IQ2_XXS, 0, 2 * 66);
    char err[512] = "";
    struct memfile m = mem_open(b.buf, b.len, err, sizeof(err));
    CHECK(m.g && gguf_tensor_at(m.g, 0)->nbytes == 132, "IQ2_XXS tensor: %s", err);
    mem_close(&m);
    b.len = 0;
    bld_one_kv(&b, "split.count", GGUF_TYPE_UINT16), bld_u16(&b, 2);
    uint8_t *copy = malloc(b.len);
    memcpy(copy, b.buf, b.len);
    struct gguf_config cfg = {.data = copy, .size = b.len, .allow_split = true};
    struct gguf *g = gguf_open(&cfg);
    CHECK(g && gguf_n_tensors(g) == 0, "split.count 2 with allow_split rejected");
    gguf_close(g);
    free(copy);
    b.len = 0;
    bld_hdr(&b, 2, 0, 0);
    m = mem_open(b.buf, b.len, err, sizeof(err));
    CHECK(m.g && gguf_n_kv(m.g) == 0 && gguf_version(m.g) == 2, "empty v2 file: %s", err);
    mem_close(&m);
    free(b.buf);
}

static void write_file(const char *path, const void *p, size_t len)
{
    FILE *f = fopen(path, "wb");
    CHECK(f && fwrite(p, 1, len, f) == len, "write %s", path);
    if (f)
        fclose(f);
}

/* Opening through a real path: valid, truncated, empty, missing. */
static void test_paths(void)
{
    char path[] = "/tmp/test_gguf_XXXXXX";
    int fd = mkstemp(path);
    CHECK(fd >= 0, "mkstemp");
    if (fd < 0)
        return;
    close(fd);
    struct bld b = {0};
    bld_valid(&b);
    write_file(path, b.buf, b.len);
    char err[512] = "";
    struct gguf_config cfg = {.path = path, .err = err, .err_len = sizeof(err)};
    struct gguf *g = gguf_open(&cfg);
    CHECK(g && gguf_n_tensors(g) == 3 && gguf_file_size(g) == b.len, "path open: %s", err);
    if (g) {
        const struct gguf_tensor *c = gguf_find_tensor(g, "c");
        CHECK(c && memcmp(c->data, b.buf + b.len - 20, 20) == 0, "tensor c bytes via mmap");
    }
    gguf_close(g);
    quiet(true);
    write_file(path, b.buf, b.len - 1);
    g = gguf_open(&cfg);
    CHECK(!g && has(err, path) && has(err, "runs past the end"), "truncated path: %s", err);
    write_file(path, b.buf, 0);
    g = gguf_open(&cfg);
    CHECK(!g && has(err, "empty"), "empty path: %s", err);
    write_file(path, "GGUF\1\0\0\0", 8);
    g = gguf_open(&cfg);
    CHECK(!g && has(err, "version 1"), "v1 path: %s", err);
    unlink(path);
    g = gguf_open(&cfg);
    CHECK(!g && has(err, "cannot open"), "missing path: %s", err);
    quiet(false);
    free(b.buf);
}

/* Reads every byte an accepted file exposes (ASan checks it is in bounds). */
static unsigned touch_all(const struct gguf *g)
{
    unsigned sum = 0;
    for (uint64_t i = 0; i < gguf_n_kv(g); i++) {
        const struct gguf_kv *kv = gguf_kv_at(g, i);
        sum += (unsigned)strlen(kv->key);
        for (uint64_t j = 0; kv->strs && j < kv->n; j++)
            for (uint64_t k = 0; k < kv->strs[j].len; k++)
                sum += (uint8_t)kv->strs[j].ptr[k];
        bool numeric = kv->type == GGUF_TYPE_ARRAY && kv->arr_type != GGUF_TYPE_STRING;
        for (uint64_t j = 0; numeric && j < kv->n; j++)
            sum += (unsigned)gguf_arr_f64(kv, j);
        for (uint64_t k = 0; kv->type == GGUF_TYPE_STRING && k < kv->str.len; k++)
            sum += (uint8_t)kv->str.ptr[k];
    }
    for (uint64_t i = 0; i < gguf_n_tensors(g); i++) {
        const struct gguf_tensor *t = gguf_tensor_at(g, i);
        for (uint64_t k = 0; k < t->nbytes; k++)
            sum += ((const uint8_t *)t->data)[k];
    }
    return sum;
}

/* One random edit: a byte, a bit, or a 64-bit value likely to matter. */
static void mutate(uint8_t *p, size_t len, unsigned *seed)
{
    static const uint64_t values[] = {0, 1, 2, 5, 13, 64, 255, 1ull << 31, 1ull << 32,
                                      1ull << 62, 1ull << 63, UINT64_MAX};
    size_t at = (size_t)rand_r(seed) % len;
    switch (rand_r(seed) % 4) {
    case 0: p[at] = (uint8_t)rand_r(seed); break;
    case 1: p[at] ^= (uint8_t)(1u << (rand_r(seed) % 8)); break;
    case 2: p[at] = (uint8_t)(rand_r(seed) % 3 ? 0xff : 0); break;
    default: {
        uint64_t v = values[rand_r(seed) % (sizeof(values) / sizeof(values[0]))];
        size_t n = len - at < 8 ? len - at : 8;
        memcpy(p + at, &v, n);
    }
    }
}

/* Random mutations of the two valid files never crash or read out of bounds. */
static void test_fuzz(void)
{
    const char *env = getenv("LAMINA_FUZZ_SEED");
    unsigned seed = env ? (unsigned)strtoul(env, NULL, 10) : 20261129u;
    const int iters = 20000;
    MEASURE("gguf fuzz seed %u (LAMINA_FUZZ_SEED reproduces)", seed);
    struct bld v = {0}, r = {0};
    bld_valid(&v);
    bld_rich(&r, 3);
    int accepted = 0, printed = 0;
    unsigned sum = 0;
    FILE *devnull = fopen("/dev/null", "w");
    quiet(true);
    for (int i = 0; i < iters; i++) {
        const struct bld *src = i % 2 ? &v : &r;
        uint8_t *p = malloc(src->len);
        memcpy(p, src->buf, src->len);
        int edits = 1 + rand_r(&seed) % 4;
        for (int e = 0; e < edits; e++)
            mutate(p, src->len, &seed);
        size_t len = rand_r(&seed) % 8 ? src->len : (size_t)rand_r(&seed) % src->len;
        struct gguf_config cfg = {.data = p, .size = len};
        struct gguf *g = gguf_open(&cfg);
        if (g) {
            accepted++;
            sum += touch_all(g);
            printed += devnull && inspect_print(g, devnull) == 0;
        }
        gguf_close(g);
        free(p);
    }
    quiet(false);
    if (devnull)
        fclose(devnull);
    MEASURE("gguf fuzz: %d mutated files, %d accepted, fully read and inspected, %d rejected, "
            "no crash (checksum %u)", iters, accepted, iters - accepted, sum);
    CHECK(accepted > 0 && accepted < iters, "fuzz accepted %d of %d", accepted, iters);
    CHECK(printed == accepted, "inspect_print failed on %d accepted files", accepted - printed);
    free(v.buf);
    free(r.buf);
}

/* The shared fixtures parse with the expected counts. */
static void test_fixtures(void)
{
    char path[512];
    struct gguf_config cfg = {.path = test_fixture(path, sizeof(path),
                                                   "tokenizer/qwen2-vocab.gguf")};
    struct gguf *g = gguf_open(&cfg);
    CHECK(g, "open %s", path);
    if (g) {
        const struct gguf_kv *tok = gguf_find_kv(g, "tokenizer.ggml.tokens");
        const struct gguf_kv *mer = gguf_find_kv(g, "tokenizer.ggml.merges");
        CHECK(tok && tok->arr_type == GGUF_TYPE_STRING && tok->n == 151665, "tokens %llu",
              tok ? (unsigned long long)tok->n : 0ull);
        CHECK(mer && mer->n == 151387, "merges %llu", mer ? (unsigned long long)mer->n : 0ull);
        CHECK(gguf_n_tensors(g) == 0, "vocab file has tensors");
        MEASURE("qwen2-vocab.gguf: %llu tokens, %llu merges, %llu kvs",
                tok ? (unsigned long long)tok->n : 0ull, mer ? (unsigned long long)mer->n : 0ull,
                (unsigned long long)gguf_n_kv(g));
    }
    gguf_close(g);
    cfg.path = test_fixture(path, sizeof(path), "conformance/qwen3moe/qwen3moe-f32.gguf");
    g = gguf_open(&cfg);
    CHECK(g, "open %s", path);
    if (g) {
        struct gguf_str arch = {0};
        uint32_t experts = 0;
        CHECK(gguf_get_str(g, "general.architecture", &arch) == 0 && arch.len == 8 &&
              memcmp(arch.ptr, "qwen3moe", 8) == 0, "architecture");
        CHECK(gguf_get_u32(g, "qwen3moe.expert_count", &experts) == 0 && experts > 1,
              "expert_count %u", experts);
        const struct gguf_tensor *last = gguf_tensor_at(g, gguf_n_tensors(g) - 1);
        uint64_t end = gguf_data_offset(g) + last->offset + last->nbytes;
        CHECK(end <= gguf_file_size(g) && gguf_file_size(g) - end < gguf_alignment(g),
              "data ends at %llu of %llu", (unsigned long long)end,
              (unsigned long long)gguf_file_size(g));
        MEASURE("qwen3moe-f32.gguf: %llu tensors, %llu kvs, %u experts",
                (unsigned long long)gguf_n_tensors(g), (unsigned long long)gguf_n_kv(g), experts);
    }
    gguf_close(g);
}

int main(void)
{
    log_init("test", -1);
    CHECK(strcmp(gguf_type_name(GGUF_TYPE_UINT32), "uint32") == 0 &&
          strcmp(gguf_type_name(99), "?") == 0, "gguf_type_name");
    CHECK(gguf_type_is_int(GGUF_TYPE_INT64) && !gguf_type_is_int(GGUF_TYPE_BOOL) &&
          !gguf_type_is_int(GGUF_TYPE_FLOAT32), "gguf_type_is_int");
    test_rejections();
    test_huge_array_fast();
    test_truncations();
    test_rich(3);
    test_rich(2);
    test_accepted_edges();
    test_paths();
    test_fixtures();
    test_fuzz();
    return test_main_result("test_gguf");
}
