/*
 * test_gguf_writer: files written by gguf_writer read back through gguf_open
 * with every metadata value, tensor info and data byte exactly as written, for
 * several alignments and output buffer sizes; bad inputs are rejected with
 * -EINVAL and the writer stays usable; short data fails finish and leaves no
 * file; a full disk (/dev/full) reports -ENOSPC.
 */
#include "model/gguf_writer.h"

#include <errno.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/log.h"
#include "model/gguf.h"
#include "model/quant.h"
#include "tests/check.h"

/* One tensor of the round-trip file and its bytes. */
struct tw_tensor {
    const char *name;
    uint32_t type;
    uint32_t n_dims;
    int64_t ne[4];
    uint8_t *data;
    uint64_t nbytes;
};

static struct tw_tensor tw_tensors[] = {
    {"token_embd.weight", QUANT_TYPE_Q8_0, 2, {64, 3, 1, 1}, NULL, 0},
    {"odd.f32", QUANT_TYPE_F32, 1, {5, 1, 1, 1}, NULL, 0},
    {"blk.0.ffn_gate_exps.weight", QUANT_TYPE_Q4_0, 3, {32, 2, 3, 1}, NULL, 0},
    {"half", QUANT_TYPE_F16, 2, {3, 7, 1, 1}, NULL, 0},
    {"kquant", QUANT_TYPE_Q4_K, 4, {256, 1, 2, 1}, NULL, 0},
    {"one", QUANT_TYPE_F32, 1, {1, 1, 1, 1}, NULL, 0},
    {"bytes.i8", QUANT_TYPE_I8, 2, {13, 1, 1, 1}, NULL, 0},
};
#define TW_N (sizeof(tw_tensors) / sizeof(tw_tensors[0]))

static const char *const tw_strs[] = {"", "a", "Ġhello", "<|im_end|>", "x y"};
static const int32_t tw_i32[] = {-5, 0, 7, 2147483647, -2147483647 - 1};
static const float tw_f32[] = {1.5f, -0.0f, 3.25e-7f, 1e30f};
static const uint8_t tw_bools[] = {1, 0, 1};
static const uint16_t tw_u16[] = {0, 65535, 12};
static const double tw_f64[] = {3.141592653589793, -1e-300};
static const int64_t tw_i64[] = {-9000000000000000000LL, 42};

static uint64_t tw_rng(uint64_t *s)
{
    *s += 0x9E3779B97F4A7C15ull;
    uint64_t z = *s;
    z = (z ^ (z >> 30)) * 0xBF58476D1CE4E5B9ull;
    z = (z ^ (z >> 27)) * 0x94D049BB133111EBull;
    return z ^ (z >> 31);
}

static void tw_fill(uint64_t seed)
{
    for (size_t i = 0; i < TW_N; i++) {
        struct tw_tensor *t = &tw_tensors[i];
        t->nbytes = quant_row_size(t->type, (uint64_t)t->ne[0]) * t->ne[1] * t->ne[2] * t->ne[3];
        free(t->data);
        t->data = malloc(t->nbytes);
        for (uint64_t b = 0; b < t->nbytes; b++)
            t->data[b] = (uint8_t)tw_rng(&seed);
    }
}

static int tw_add_meta(struct gguf_writer *w)
{
    int rc = 0;
    rc |= gguf_writer_add_str(w, "general.architecture", "qwen3moe");
    rc |= gguf_writer_add_u8(w, "t.u8", 250);
    rc |= gguf_writer_add_i8(w, "t.i8", -120);
    rc |= gguf_writer_add_u16(w, "t.u16", 65000);
    rc |= gguf_writer_add_i16(w, "t.i16", -32000);
    rc |= gguf_writer_add_u32(w, "t.u32", 4000000000u);
    rc |= gguf_writer_add_i32(w, "t.i32", -2000000000);
    rc |= gguf_writer_add_u64(w, "t.u64", 18000000000000000000ull);
    rc |= gguf_writer_add_i64(w, "t.i64", -9000000000000000000LL);
    rc |= gguf_writer_add_f32(w, "t.f32", 1e-6f);
    rc |= gguf_writer_add_f64(w, "t.f64", -2.5e100);
    rc |= gguf_writer_add_bool(w, "t.bool", true);
    rc |= gguf_writer_add_bool(w, "t.false", false);
    rc |= gguf_writer_add_str(w, "t.str", "héllo wörld");
    rc |= gguf_writer_add_str(w, "t.empty", "");
    rc |= gguf_writer_add_array_str(w, "t.arr_str", tw_strs, 5);
    rc |= gguf_writer_add_array(w, "t.arr_i32", GGUF_TYPE_INT32, tw_i32, 5);
    rc |= gguf_writer_add_array(w, "t.arr_f32", GGUF_TYPE_FLOAT32, tw_f32, 4);
    rc |= gguf_writer_add_array(w, "t.arr_bool", GGUF_TYPE_BOOL, tw_bools, 3);
    rc |= gguf_writer_add_array(w, "t.arr_u16", GGUF_TYPE_UINT16, tw_u16, 3);
    rc |= gguf_writer_add_array(w, "t.arr_f64", GGUF_TYPE_FLOAT64, tw_f64, 2);
    rc |= gguf_writer_add_array(w, "t.arr_i64", GGUF_TYPE_INT64, tw_i64, 2);
    rc |= gguf_writer_add_array(w, "t.arr_empty", GGUF_TYPE_UINT32, NULL, 0);
    return rc;
}

static void tw_check_str(const struct gguf_str *s, const char *want, const char *what)
{
    CHECK(s->len == strlen(want) && memcmp(s->ptr, want, s->len) == 0, "%s: got '%.*s' want '%s'",
          what, (int)s->len, s->ptr, want);
}

static const struct gguf_kv *tw_kv(const struct gguf *g, const char *key, uint32_t type)
{
    const struct gguf_kv *kv = gguf_find_kv(g, key);
    CHECK(kv != NULL, "key %s missing", key);
    if (kv)
        CHECK(kv->type == type, "key %s type %u want %u", key, kv->type, type);
    return kv && kv->type == type ? kv : NULL;
}

static void tw_check_arrays(const struct gguf *g)
{
    const struct gguf_kv *kv = tw_kv(g, "t.arr_str", GGUF_TYPE_ARRAY);
    if (kv && kv->arr_type == GGUF_TYPE_STRING && kv->n == 5) {
        for (int i = 0; i < 5; i++)
            tw_check_str(&kv->strs[i], tw_strs[i], "arr_str");
    } else {
        CHECK(0, "t.arr_str has the wrong element type or count");
    }
    kv = tw_kv(g, "t.arr_i32", GGUF_TYPE_ARRAY);
    CHECK(kv && kv->arr_type == GGUF_TYPE_INT32 && kv->n == 5, "arr_i32 shape");
    for (uint64_t i = 0; kv && kv->n == 5 && i < 5; i++)
        CHECK(gguf_arr_i64(kv, i) == tw_i32[i], "arr_i32[%llu]", (unsigned long long)i);
    kv = tw_kv(g, "t.arr_f32", GGUF_TYPE_ARRAY);
    CHECK(kv && kv->arr_type == GGUF_TYPE_FLOAT32 && kv->n == 4, "arr_f32 shape");
    for (uint64_t i = 0; kv && kv->n == 4 && i < 4; i++)
        CHECK(memcmp(kv->arr + 4 * i, &tw_f32[i], 4) == 0, "arr_f32[%llu] bits",
              (unsigned long long)i);
    kv = tw_kv(g, "t.arr_bool", GGUF_TYPE_ARRAY);
    CHECK(kv && kv->arr_type == GGUF_TYPE_BOOL && kv->n == 3 && memcmp(kv->arr, tw_bools, 3) == 0,
          "arr_bool");
    kv = tw_kv(g, "t.arr_u16", GGUF_TYPE_ARRAY);
    CHECK(kv && kv->arr_type == GGUF_TYPE_UINT16 && kv->n == 3 && gguf_arr_i64(kv, 1) == 65535,
          "arr_u16");
    kv = tw_kv(g, "t.arr_f64", GGUF_TYPE_ARRAY);
    CHECK(kv && kv->arr_type == GGUF_TYPE_FLOAT64 && kv->n == 2 &&
          gguf_arr_f64(kv, 0) == tw_f64[0] && gguf_arr_f64(kv, 1) == tw_f64[1], "arr_f64");
    kv = tw_kv(g, "t.arr_i64", GGUF_TYPE_ARRAY);
    CHECK(kv && kv->arr_type == GGUF_TYPE_INT64 && kv->n == 2 && gguf_arr_i64(kv, 0) == tw_i64[0],
          "arr_i64");
    kv = tw_kv(g, "t.arr_empty", GGUF_TYPE_ARRAY);
    CHECK(kv && kv->arr_type == GGUF_TYPE_UINT32 && kv->n == 0, "arr_empty");
}

static void tw_check_meta(const struct gguf *g, uint32_t alignment)
{
    const struct gguf_kv *kv;
    kv = tw_kv(g, "t.u8", GGUF_TYPE_UINT8);
    CHECK(kv && kv->v.u64 == 250, "u8");
    kv = tw_kv(g, "t.i8", GGUF_TYPE_INT8);
    CHECK(kv && kv->v.i64 == -120, "i8");
    kv = tw_kv(g, "t.u16", GGUF_TYPE_UINT16);
    CHECK(kv && kv->v.u64 == 65000, "u16");
    kv = tw_kv(g, "t.i16", GGUF_TYPE_INT16);
    CHECK(kv && kv->v.i64 == -32000, "i16");
    kv = tw_kv(g, "t.u32", GGUF_TYPE_UINT32);
    CHECK(kv && kv->v.u64 == 4000000000u, "u32");
    kv = tw_kv(g, "t.i32", GGUF_TYPE_INT32);
    CHECK(kv && kv->v.i64 == -2000000000, "i32");
    kv = tw_kv(g, "t.u64", GGUF_TYPE_UINT64);
    CHECK(kv && kv->v.u64 == 18000000000000000000ull, "u64");
    kv = tw_kv(g, "t.i64", GGUF_TYPE_INT64);
    CHECK(kv && kv->v.i64 == -9000000000000000000LL, "i64");
    kv = tw_kv(g, "t.f32", GGUF_TYPE_FLOAT32);
    CHECK(kv && (float)kv->v.f64 == 1e-6f, "f32");
    kv = tw_kv(g, "t.f64", GGUF_TYPE_FLOAT64);
    CHECK(kv && kv->v.f64 == -2.5e100, "f64");
    kv = tw_kv(g, "t.bool", GGUF_TYPE_BOOL);
    CHECK(kv && kv->v.u64 == 1, "bool");
    kv = tw_kv(g, "t.false", GGUF_TYPE_BOOL);
    CHECK(kv && kv->v.u64 == 0, "false");
    kv = tw_kv(g, "t.str", GGUF_TYPE_STRING);
    if (kv)
        tw_check_str(&kv->str, "héllo wörld", "str");
    kv = tw_kv(g, "t.empty", GGUF_TYPE_STRING);
    CHECK(kv && kv->str.len == 0, "empty str");
    tw_check_arrays(g);
    /* Records come back in the order added (general.alignment last, when added). */
    CHECK(strcmp(gguf_kv_at(g, 0)->key, "general.architecture") == 0, "first key");
    CHECK(strcmp(gguf_kv_at(g, 1)->key, "t.u8") == 0, "second key");
    uint32_t a = 0;
    int rc = gguf_get_u32(g, "general.alignment", &a);
    if (alignment == GGUF_DEFAULT_ALIGNMENT)
        CHECK(rc == -ENOENT, "general.alignment written for the default alignment");
    else
        CHECK(rc == 0 && a == alignment, "general.alignment %u want %u", a, alignment);
    CHECK(gguf_n_kv(g) == 23 + (alignment != GGUF_DEFAULT_ALIGNMENT), "n_kv %llu",
          (unsigned long long)gguf_n_kv(g));
}

static void tw_check_tensors(const struct gguf *g, uint32_t alignment)
{
    CHECK(gguf_n_tensors(g) == TW_N, "n_tensors %llu", (unsigned long long)gguf_n_tensors(g));
    uint64_t off = 0;
    for (uint64_t i = 0; i < TW_N && i < gguf_n_tensors(g); i++) {
        const struct tw_tensor *w = &tw_tensors[i];
        const struct gguf_tensor *t = gguf_tensor_at(g, i);
        CHECK(strcmp(t->name, w->name) == 0, "tensor %llu name %s", (unsigned long long)i,
              t->name);
        CHECK(t->type == w->type && t->n_dims == w->n_dims, "%s type/dims", w->name);
        for (int d = 0; d < 4; d++)
            CHECK(t->ne[d] == w->ne[d], "%s ne[%d] %lld", w->name, d, (long long)t->ne[d]);
        CHECK(t->offset == off, "%s offset %llu want %llu", w->name,
              (unsigned long long)t->offset, (unsigned long long)off);
        CHECK(t->nbytes == w->nbytes && memcmp(t->data, w->data, w->nbytes) == 0,
              "%s data differs", w->name);
        off += w->nbytes + (alignment - w->nbytes % alignment) % alignment;
    }
    CHECK(gguf_data_offset(g) % alignment == 0, "data offset %llu",
          (unsigned long long)gguf_data_offset(g));
    CHECK(gguf_file_size(g) == gguf_data_offset(g) + off, "file size %llu want %llu",
          (unsigned long long)gguf_file_size(g), (unsigned long long)(gguf_data_offset(g) + off));
}

/* Writes the round-trip file with the data in pieces of up to max_piece bytes. */
static int tw_write(const char *path, uint32_t alignment, size_t buffer, uint64_t max_piece,
                    uint64_t seed, bool direct)
{
    struct gguf_writer_config cfg = {.path = path, .alignment = alignment, .buffer_bytes = buffer,
                                     .direct = direct};
    struct gguf_writer *w = gguf_writer_create(&cfg);
    CHECK(w != NULL, "create %s", path);
    if (!w)
        return -1;
    int rc = tw_add_meta(w);
    CHECK(rc == 0, "metadata rc %d", rc);
    uint64_t total = 0;
    for (size_t i = 0; i < TW_N; i++) {
        struct tw_tensor *t = &tw_tensors[i];
        CHECK(gguf_writer_add_tensor(w, t->name, t->type, t->n_dims, t->ne) == 0, "add %s",
              t->name);
        total += t->nbytes;
    }
    CHECK(gguf_writer_n_tensors(w) == TW_N, "n_tensors");
    CHECK(gguf_writer_write_header(w) == 0, "header");
    /* Concatenate the data and stream it in random pieces that cross tensors. */
    uint8_t *all = malloc(total), *p = all;
    for (size_t i = 0; i < TW_N; i++) {
        memcpy(p, tw_tensors[i].data, tw_tensors[i].nbytes);
        p += tw_tensors[i].nbytes;
    }
    for (uint64_t at = 0; at < total;) {
        uint64_t n = tw_rng(&seed) % (max_piece + 1);
        n = n < total - at ? n : total - at;
        rc = gguf_writer_write_data(w, all + at, n);
        CHECK(rc == 0, "write_data rc %d", rc);
        at += n;
    }
    free(all);
    rc = gguf_writer_finish(w);
    CHECK(rc == 0, "finish rc %d", rc);
    gguf_writer_destroy(w);
    return rc;
}

static void test_round_trip(const char *path, uint32_t alignment, size_t buffer,
                            uint64_t max_piece, bool direct)
{
    tw_fill(alignment * 1000 + max_piece);
    if (tw_write(path, alignment, buffer, max_piece, alignment + buffer, direct))
        return;
    char err[512] = "";
    struct gguf_config gc = {.path = path, .err = err, .err_len = sizeof(err)};
    struct gguf *g = gguf_open(&gc);
    CHECK(g != NULL, "gguf_open(%s): %s", path, err);
    if (g) {
        uint32_t want = alignment ? alignment : GGUF_DEFAULT_ALIGNMENT;
        CHECK(gguf_version(g) == 3, "version %u", gguf_version(g));
        CHECK(gguf_alignment(g) == want, "alignment %u", gguf_alignment(g));
        tw_check_meta(g, want);
        tw_check_tensors(g, want);
    }
    gguf_close(g);
    unlink(path);
}

static void test_bad_inputs(const char *path)
{
    struct gguf_writer_config cfg = {.path = path};
    struct gguf_writer *w = gguf_writer_create(&cfg);
    CHECK(w != NULL, "create");
    if (!w)
        return;
    CHECK(gguf_writer_add_u32(w, "a.key", 1) == 0, "first key");
    CHECK(gguf_writer_add_f32(w, "a.key", 1) == -EINVAL, "duplicate key accepted");
    CHECK(strstr(log_last_error(), "duplicate key 'a.key'") != NULL, "msg: %s", log_last_error());
    CHECK(gguf_writer_add_u32(w, "", 1) == -EINVAL, "empty key accepted");
    CHECK(gguf_writer_add_u16(w, "general.alignment", 32) == -EINVAL, "u16 alignment accepted");
    CHECK(gguf_writer_add_u32(w, "general.alignment", 64) == -EINVAL, "wrong alignment accepted");
    CHECK(gguf_writer_add_u32(w, "general.alignment", 32) == 0, "matching alignment rejected");
    uint8_t bad_bool[2] = {1, 2};
    CHECK(gguf_writer_add_array(w, "b", GGUF_TYPE_BOOL, bad_bool, 2) == -EINVAL, "bool 2");
    CHECK(gguf_writer_add_array(w, "c", GGUF_TYPE_STRING, bad_bool, 2) == -EINVAL, "str type");
    CHECK(gguf_writer_add_array(w, "c", GGUF_TYPE_ARRAY, bad_bool, 2) == -EINVAL, "nested");
    const char *strs[] = {"x", NULL};
    CHECK(gguf_writer_add_array_str(w, "d", strs, 2) == -EINVAL, "NULL string");

    int64_t ne[4] = {64, 2, 1, 1};
    CHECK(gguf_writer_add_tensor(w, "t", QUANT_TYPE_Q8_0, 2, ne) == 0, "first tensor");
    CHECK(gguf_writer_add_tensor(w, "t", QUANT_TYPE_F32, 2, ne) == -EINVAL, "duplicate name");
    CHECK(strstr(log_last_error(), "duplicate tensor name 't'") != NULL, "msg: %s",
          log_last_error());
    int64_t bad0[2] = {48, 2};
    CHECK(gguf_writer_add_tensor(w, "u", QUANT_TYPE_Q8_0, 2, bad0) == -EINVAL, "ne[0] 48 q8_0");
    CHECK(strstr(log_last_error(), "not a multiple") != NULL, "msg: %s", log_last_error());
    CHECK(gguf_writer_add_tensor(w, "u", QUANT_TYPE_Q4_K, 2, ne) == -EINVAL, "ne[0] 64 q4_k");
    char long_name[80];
    memset(long_name, 'n', 64);
    long_name[64] = '\0';
    CHECK(gguf_writer_add_tensor(w, long_name, QUANT_TYPE_F32, 1, ne) == -EINVAL, "64-byte name");
    long_name[63] = '\0';
    CHECK(gguf_writer_add_tensor(w, long_name, QUANT_TYPE_F32, 1, ne) == 0, "63-byte name");
    CHECK(gguf_writer_add_tensor(w, "v", 4, 1, ne) == -EINVAL, "removed type 4");
    CHECK(gguf_writer_add_tensor(w, "v", 99, 1, ne) == -EINVAL, "type 99");
    CHECK(gguf_writer_add_tensor(w, "v", QUANT_TYPE_F32, 0, ne) == -EINVAL, "n_dims 0");
    CHECK(gguf_writer_add_tensor(w, "v", QUANT_TYPE_F32, 5, ne) == -EINVAL, "n_dims 5");
    int64_t zero[2] = {32, 0};
    CHECK(gguf_writer_add_tensor(w, "v", QUANT_TYPE_F32, 2, zero) == -EINVAL, "ne[1] 0");
    int64_t huge[4] = {1LL << 40, 1LL << 40, 1LL << 40, 1};
    CHECK(gguf_writer_add_tensor(w, "v", QUANT_TYPE_F32, 3, huge) == -EINVAL, "overflow");
    CHECK(gguf_writer_n_tensors(w) == 2, "rejected tensors were added");
    /* 2 rows of q8_0 (2 x 68 bytes) + 64 f32 (256 bytes) = 392 bytes declared. */
    uint64_t want = gguf_writer_tensor_nbytes(w, 0) + gguf_writer_tensor_nbytes(w, 1);
    CHECK(want == 392, "declared %llu", (unsigned long long)want);
    CHECK(gguf_writer_write_header(w) == 0, "header");
    uint8_t data[400] = {0};
    CHECK(gguf_writer_write_data(w, data, 100) == 0, "first piece");
    CHECK(gguf_writer_write_data(w, data, 300) == -EINVAL, "more data than declared accepted");
    CHECK(strstr(log_last_error(), "hold only 292 more") != NULL, "msg: %s", log_last_error());
    CHECK(gguf_writer_write_data(w, data, 200) == 0, "writer failed after an oversized piece");
    CHECK(gguf_writer_finish(w) == -EINVAL, "finish with 92 bytes missing succeeded");
    CHECK(strstr(log_last_error(), "got 164 of its 256 bytes") != NULL, "msg: %s",
          log_last_error());
    CHECK(gguf_writer_finish(w) == -EINVAL, "failure is not sticky");
    gguf_writer_destroy(w);
    CHECK(access(path, F_OK) != 0, "partial file %s left behind", path);
}

static void test_io_errors(void)
{
    struct gguf_writer_config cfg = {.path = "/nonexistent-dir/x.gguf"};
    CHECK(gguf_writer_create(&cfg) == NULL, "create in a missing directory");
    CHECK(strstr(log_last_error(), "/nonexistent-dir/x.gguf") != NULL, "msg: %s",
          log_last_error());
    cfg.path = "/tmp/x.gguf";
    cfg.alignment = 24;
    CHECK(gguf_writer_create(&cfg) == NULL, "alignment 24 accepted");

    /* /dev/full accepts open and fails every write with ENOSPC. */
    struct gguf_writer_config full = {.path = "/dev/full", .buffer_bytes = 64};
    struct gguf_writer *w = gguf_writer_create(&full);
    CHECK(w != NULL, "open /dev/full");
    if (!w)
        return;
    int64_t ne[1] = {1024};
    CHECK(gguf_writer_add_str(w, "general.name", "full") == 0, "kv");
    CHECK(gguf_writer_add_tensor(w, "t", QUANT_TYPE_F32, 1, ne) == 0, "tensor");
    int rc = gguf_writer_write_header(w);
    CHECK(rc == -ENOSPC, "header on a full disk: rc %d", rc);
    CHECK(strstr(log_last_error(), "/dev/full") && strstr(log_last_error(), "No space"),
          "msg: %s", log_last_error());
    struct stat st;
    gguf_writer_destroy(w);
    CHECK(stat("/dev/full", &st) == 0 && S_ISCHR(st.st_mode), "/dev/full was removed");
}

int main(void)
{
    log_init("test", -1);
    char path[64];
    snprintf(path, sizeof(path), "/tmp/test_gguf_writer_%d.gguf", (int)getpid());
    test_round_trip(path, 0, 0, 1000, false);          /* default 32, big buffer */
    test_round_trip(path, 64, 100, 37, false);         /* small buffer, small pieces */
    test_round_trip(path, 8, 16, 5000, false);         /* pieces bypassing the buffer */
    test_round_trip(path, 4096, 1 << 20, 3, false);    /* padding larger than data */
    test_round_trip(path, 32, 4096, 777, true);        /* O_DIRECT, many 4 KiB blocks + tail */
    test_round_trip(path, 64, 0, 100000, true);        /* O_DIRECT, all in the tail */
    test_round_trip("/dev/shm/test_gguf_writer.gguf", 32, 4096, 333, true); /* tmpfs */
    test_bad_inputs(path);
    test_io_errors();
    for (size_t i = 0; i < TW_N; i++)
        free(tw_tensors[i].data);
    unlink(path);
    return test_main_result("test_gguf_writer");
}
