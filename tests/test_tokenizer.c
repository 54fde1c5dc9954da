/*
 * test_tokenizer: byte-level BPE against llama.cpp's own vectors, the conformance prompts, the
 * streaming detokenizer, special tokens, and rejection of bad tokenizer metadata.
 *
 * (a) every string of tokenizer/qwen2-vocab.gguf.inp encodes (special tokens not parsed) to the
 *     ids of the matching .out line. The .inp file is a sequence of pieces separated by
 *     "\n__ggml_vocab_test__\n"; the file ends with that separator, so the last piece is empty,
 *     as is the last piece of .out split at "\n": 46 strings plus the empty tail, 47 pairs.
 * (b) the conformance prompts: prompt_ids decoded to text and re-encoded with parse_special
 *     give prompt_ids again, with each file's own 1024-token vocabulary.
 * (c) the streaming detokenizer emits only valid UTF-8 and reassembles multi-byte text.
 * (d) <|im_start|> / <|im_end|> become control ids only with parse_special.
 * (e) tiny GGUFs written with gguf_writer: one valid vocabulary, then one bad key at a time.
 * Measured: create time of the 151k vocabulary and encode throughput on eval.txt.
 */
#include "model/tokenizer.h"

#include <errno.h>
#include <pthread.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>
#include <unistd.h>

#include "common/log.h"
#include "model/gguf.h"
#include "model/gguf_writer.h"
#include "tests/check.h"
#include "tests/fixture.h"

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Opens path and builds its tokenizer; *g receives the gguf (caller closes). */
static struct tokenizer *open_tokenizer(const char *path, struct gguf **g)
{
    struct gguf_config gc = {.path = path};
    *g = gguf_open(&gc);
    if (!*g)
        return NULL;
    struct tokenizer_config tc = {.gguf = *g};
    return tokenizer_create(&tc);
}

/* Concatenated bytes of ids; caller frees. */
static char *decode_all(const struct tokenizer *t, const int32_t *ids, size_t n, size_t *len)
{
    size_t cap = 64, k = 0;
    char *out = malloc(cap);
    for (size_t i = 0; i < n && out; i++) {
        size_t m;
        int rc = tokenizer_token_bytes(t, ids[i], out + k, cap - k, &m);
        if (rc == -ENOSPC) {
            cap = (cap + m) * 2;
            out = realloc(out, cap);
            i--;
            continue;
        }
        if (rc) {
            free(out);
            return NULL;
        }
        k += m;
    }
    *len = k;
    return out;
}

static bool utf8_valid(const char *s, size_t n)
{
    const uint8_t *u = (const uint8_t *)s;
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        size_t m;
        if (u[i] < 0x80) {
            i++;
            continue;
        } else if ((u[i] & 0xE0) == 0xC0) {
            m = 2, cp = u[i] & 0x1F;
        } else if ((u[i] & 0xF0) == 0xE0) {
            m = 3, cp = u[i] & 0x0F;
        } else if ((u[i] & 0xF8) == 0xF0) {
            m = 4, cp = u[i] & 0x07;
        } else {
            return false;
        }
        if (i + m > n)
            return false;
        for (size_t j = 1; j < m; j++) {
            if ((u[i + j] & 0xC0) != 0x80)
                return false;
            cp = cp << 6 | (u[i + j] & 0x3F);
        }
        static const uint32_t min_cp[5] = {0, 0, 0x80, 0x800, 0x10000};
        if (cp < min_cp[m] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF))
            return false;
        i += m;
    }
    return true;
}

/* Splits buf in place at sep; returns the number of pieces (starts in p, lengths in n). */
static int split(char *buf, size_t len, const char *sep, char **p, size_t *n, int cap)
{
    size_t sl = strlen(sep);
    int k = 0;
    char *s = buf, *end = buf + len;
    while (k < cap) {
        char *hit = memmem(s, (size_t)(end - s), sep, sl);
        p[k] = s;
        n[k++] = hit ? (size_t)(hit - s) : (size_t)(end - s);
        if (!hit)
            break;
        s = hit + sl;
    }
    return k;
}

/* ---------------------------------------------------------------------------------------- */

/* First index where a and b differ (their common length when one is a prefix). */
static size_t first_diff(const int32_t *a, size_t na, const int32_t *b, size_t nb)
{
    size_t i = 0;
    while (i < na && i < nb && a[i] == b[i])
        i++;
    return i;
}

static void test_vectors(const struct tokenizer *t)
{
    char path[512];
    size_t li = 0, lo = 0;
    char *inp = fixture_read_all(test_fixture(path, sizeof(path),
                                              "tokenizer/qwen2-vocab.gguf.inp"), &li);
    char *out = fixture_read_all(test_fixture(path, sizeof(path),
                                              "tokenizer/qwen2-vocab.gguf.out"), &lo);
    CHECK(inp && out, "cannot read the .inp/.out vectors");
    if (!inp || !out) {
        free(inp);
        free(out);
        return;
    }
    char *ps[128], *po[128];
    size_t ns[128], no[128];
    int n_in = split(inp, li, "\n__ggml_vocab_test__\n", ps, ns, 128);
    int n_out = split(out, lo, "\n", po, no, 128);
    CHECK(n_in == 47 && n_out == 47, "expected 47 pieces, got %d inputs and %d outputs", n_in,
          n_out);
    CHECK(ns[n_in - 1] == 0 && no[n_out - 1] == 0, "the last pieces should be empty");
    int matched = 0, n = n_in < n_out ? n_in : n_out;
    for (int i = 0; i < n; i++) {
        int32_t want[1024];
        size_t n_want = 0;
        po[i][no[i]] = 0;
        for (char *s = po[i], *e; n_want < 1024; s = e) {
            long v = strtol(s, &e, 10);
            if (e == s)
                break;
            want[n_want++] = (int32_t)v;
        }
        int32_t *ids = NULL;
        size_t n_ids = 0;
        int rc = tokenizer_encode(t, ps[i], ns[i], false, &ids, &n_ids);
        bool same = rc == 0 && n_ids == n_want && !memcmp(ids, want, n_ids * sizeof(*ids));
        matched += same;
        CHECK(same, "vector %d '%.*s': rc %d, %zu ids (want %zu), first difference at %zu", i,
              (int)(ns[i] > 40 ? 40 : ns[i]), ps[i], rc, n_ids, n_want,
              first_diff(ids, n_ids, want, n_want));
        free(ids);
    }
    MEASURE("llama.cpp qwen2 vectors matched: %d of %d", matched, n);
    free(inp);
    free(out);
}

static void test_conformance(void)
{
    static const char *const arch[] = {"qwen3moe", "qwen3next", "qwen35moe"};
    char path[512];
    char *json = fixture_read_all(test_fixture(path, sizeof(path), "conformance/refs.json"),
                                  NULL);
    CHECK(json, "cannot read conformance/refs.json");
    for (int a = 0; a < 3 && json; a++) {
        char rel[128];
        snprintf(rel, sizeof(rel), "conformance/%s/%s-f32.gguf", arch[a], arch[a]);
        struct gguf *g;
        struct tokenizer *t = open_tokenizer(test_fixture(path, sizeof(path), rel), &g);
        CHECK(t, "%s: tokenizer_create failed", arch[a]);
        int32_t want[512];
        int n = fixture_refs_ints(json, arch[a], "prompt_ids", want, 512);
        CHECK(n > 0, "%s: no prompt_ids", arch[a]);
        if (t && n > 0) {
            CHECK(tokenizer_n_vocab(t) == 1024, "%s: vocab %d", arch[a], tokenizer_n_vocab(t));
            size_t len;
            char *text = decode_all(t, want, (size_t)n, &len);
            int32_t *ids = NULL;
            size_t n_ids = 0;
            int rc = text ? tokenizer_encode(t, text, len, true, &ids, &n_ids) : -1;
            CHECK(rc == 0 && n_ids == (size_t)n && !memcmp(ids, want, n_ids * sizeof(*ids)),
                  "%s: re-encoded prompt differs: %zu ids (want %d), first difference at %zu",
                  arch[a], n_ids, n, first_diff(ids, n_ids, want, (size_t)n));
            CHECK(tokenizer_is_eog(t, 0) && !tokenizer_is_eog(t, 1) && tokenizer_is_eog(t, 2),
                  "%s: <|endoftext|> (0) and <|im_end|> (2) end generation, <|im_start|> not",
                  arch[a]);
            free(ids);
            free(text);
        }
        tokenizer_destroy(t);
        gguf_close(g);
    }
    free(json);
}

/* Pushes ids one at a time; every chunk must be valid UTF-8 and the whole must equal want. */
static void check_stream(const struct tokenizer *t, const int32_t *ids, size_t n,
                         const char *want, size_t want_len, const char *what)
{
    struct detok_config dc = {.tok = t};
    struct detok *d = detok_create(&dc);
    char *all = malloc(4 * want_len + 64);
    size_t k = 0;
    int held = 0, bad = 0;
    for (size_t i = 0; i <= n && d && all; i++) {
        const char *chunk;
        size_t len;
        int rc = i < n ? detok_push(d, ids[i], &chunk, &len) : detok_flush(d, &chunk, &len);
        CHECK(rc == 0, "%s: detok rc %d at %zu", what, rc, i);
        bad += !utf8_valid(chunk, len);
        held += i < n && len == 0;
        if (k + len <= 4 * want_len + 64)
            memcpy(all + k, chunk, len);
        k += len;
    }
    CHECK(bad == 0, "%s: %d chunks were not valid UTF-8", what, bad);
    CHECK(k == want_len && all && memcmp(all, want, k) == 0, "%s: stream gives %zu bytes, want %zu",
          what, k, want_len);
    printf("%s: %zu tokens, %d pushes held everything back\n", what, n, held);
    free(all);
    detok_destroy(d);
}

static void test_detok(const struct tokenizer *t)
{
    static const char *const texts[] = {
        "日本語のテキストと中文字符，한국어 텍스트도 있습니다。",
        "emoji: 🚀🦙😶‍🌫️👨‍👩‍👧‍👦 and flags 🇯🇵🇫🇷, math ∑∫√ and Ünïcödé ñ",
        "ស្រីសុខា Cửa Việt ∀x∈ℝ: 𝔘𝔫𝔦𝔠𝔬𝔡𝔢 ⅷ ㈱ 〠",
    };
    int held_back = 0;
    for (int i = 0; i < 3; i++) {
        int32_t *ids;
        size_t n;
        size_t len = strlen(texts[i]);
        CHECK(tokenizer_encode(t, texts[i], len, false, &ids, &n) == 0, "encode %d", i);
        /* count ids whose own bytes are not complete UTF-8: the case the detok exists for */
        for (size_t j = 0; j < n; j++) {
            char b[256];
            size_t m;
            if (tokenizer_token_bytes(t, ids[j], b, sizeof(b), &m) == 0 && !utf8_valid(b, m))
                held_back++;
        }
        char what[32];
        snprintf(what, sizeof(what), "detok text %d", i);
        check_stream(t, ids, n, texts[i], len, what);
        free(ids);
    }
    CHECK(held_back > 10, "only %d tokens split a character; the test would prove little",
          held_back);

    /* invalid input: a lone continuation byte, a truncated 3-byte sequence at the end, and a
     * surrogate encoding, each replaced by U+FFFD per maximal subpart */
    static const char bad[] = "a\x80" "b\xE4\xBD" "c\xED\xA0\x80" "d\xE4";
    static const char fixed[] = "a\xEF\xBF\xBD" "b\xEF\xBF\xBD" "c\xEF\xBF\xBD\xEF\xBF\xBD"
                                "\xEF\xBF\xBD" "d\xEF\xBF\xBD";
    int32_t *ids;
    size_t n;
    CHECK(tokenizer_encode(t, bad, sizeof(bad) - 1, false, &ids, &n) == 0, "encode invalid");
    size_t len;
    char *round = decode_all(t, ids, n, &len);
    CHECK(round && len == sizeof(bad) - 1 && !memcmp(round, bad, len),
          "invalid UTF-8 must encode every byte");
    int32_t one[64]; /* one byte per push */
    size_t n1 = 0;
    for (size_t i = 0; i < sizeof(bad) - 1; i++) {
        int32_t *bi;
        size_t nb;
        if (tokenizer_encode(t, bad + i, 1, false, &bi, &nb) == 0 && nb == 1)
            one[n1++] = bi[0];
        free(bi);
    }
    CHECK(n1 == sizeof(bad) - 1, "every single byte has a token");
    check_stream(t, one, n1, fixed, sizeof(fixed) - 1, "detok invalid bytes");
    free(round);
    free(ids);
}

static void test_special(const struct tokenizer *t)
{
    const char *text = "<|im_start|>user\nhi<|im_end|>";
    int32_t start = tokenizer_find(t, "<|im_start|>"), end = tokenizer_find(t, "<|im_end|>");
    CHECK(start == 151644 && end == 151645, "find: %d %d", start, end);
    CHECK(tokenizer_token_type(t, start) == TOKENIZER_TOKEN_TYPE_CONTROL, "im_start is control");
    int32_t *ids;
    size_t n;
    CHECK(tokenizer_encode(t, text, strlen(text), true, &ids, &n) == 0, "encode special");
    static const int32_t want[] = {151644, 872, 198, 6023, 151645};
    CHECK(n == 5 && !memcmp(ids, want, sizeof(want)), "parse_special: %zu ids, first %d last %d",
          n, n ? ids[0] : -1, n ? ids[n - 1] : -1);
    free(ids);
    CHECK(tokenizer_encode(t, text, strlen(text), false, &ids, &n) == 0, "encode plain");
    bool plain = n > 5;
    for (size_t i = 0; i < n; i++)
        plain = plain && ids[i] < 151643;
    size_t len;
    char *round = decode_all(t, ids, n, &len);
    CHECK(plain && round && len == strlen(text) && !memcmp(round, text, len),
          "without parse_special the markers are plain BPE (%zu ids)", n);
    free(round);
    free(ids);
    /* USER_DEFINED tokens are matched even without parse_special */
    int32_t tc = tokenizer_find(t, "<tool_call>");
    CHECK(tc >= 0 && tokenizer_token_type(t, tc) == TOKENIZER_TOKEN_TYPE_USER_DEFINED,
          "<tool_call> is user-defined (%d)", tc);
    CHECK(tokenizer_encode(t, "x<tool_call>y", 13, false, &ids, &n) == 0 && n == 3 &&
          ids[1] == tc, "user-defined token matched without parse_special");
    free(ids);
    /* accessors */
    CHECK(tokenizer_n_vocab(t) == 151665 && tokenizer_eos(t) == 151643 &&
          tokenizer_pad(t) == 151643 && tokenizer_eot(t) == 151645 && !tokenizer_add_bos(t),
          "accessors: vocab %d eos %d pad %d eot %d", tokenizer_n_vocab(t), tokenizer_eos(t),
          tokenizer_pad(t), tokenizer_eot(t));
    int32_t eog[] = {151643, 151645, 151662, 151663, 151664};
    for (int i = 0; i < 5; i++)
        CHECK(tokenizer_is_eog(t, eog[i]), "%d ends generation", eog[i]);
    CHECK(!tokenizer_is_eog(t, 151644) && !tokenizer_is_eog(t, 9707) &&
          !tokenizer_is_eog(t, -1) && !tokenizer_is_eog(t, 1 << 30), "others do not");
    char b[32];
    CHECK(tokenizer_token_bytes(t, 21927, b, sizeof(b), &len) == 0 && len == 6 &&
          !memcmp(b, " Hello", 6), "token 21927 is ' Hello'");
    CHECK(tokenizer_token_bytes(t, 21927, b, 3, &len) == -ENOSPC && len == 6, "ENOSPC");
    CHECK(tokenizer_token_bytes(t, 151665, b, sizeof(b), &len) == -EINVAL, "EINVAL");
    /* an empty input gives no ids and a freeable array */
    CHECK(tokenizer_encode(t, "", 0, true, &ids, &n) == 0 && n == 0 && ids, "empty input");
    free(ids);
}

/* Encoding then decoding gives back any byte string, valid UTF-8 or not, special markers or
 * not; long runs of one class stay fast (no quadratic regex or merge behaviour). */
static void test_robust(const struct tokenizer *t)
{
    static const char *const parts[] = {
        " ", "  ", "\n", "\r\n", "\t", "a", "Hello", " world", "'s", "'LL", "123", "\xE4\xBD\xA0",
        "\xF0\x9F\x98\x81", "\xCC\x81", "<|im_start|>", "<|im_end", "|>", "<tool_call>", "\x80",
        "\xFF", "\xE4\xBD", "\xC0\xAF", "\x00", "!!", "\xC2\xA0", "\xE3\x80\x80",
    };
    const size_t n_parts = sizeof(parts) / sizeof(parts[0]);
    uint32_t x = 12345;
    char buf[2048];
    int bad = 0;
    for (int r = 0; r < 2000; r++) {
        size_t len = 0;
        int k = (int)((x = x * 1664525u + 1013904223u) >> 27);
        for (int j = 0; j < k; j++) {
            x = x * 1664525u + 1013904223u;
            const char *p = parts[(x >> 8) % n_parts];
            size_t m = p[0] ? strlen(p) : 1;
            if ((x >> 4) % 7 == 0) { /* a random byte */
                buf[len++] = (char)(x >> 20);
                continue;
            }
            memcpy(buf + len, p, m);
            len += m;
        }
        int32_t *ids;
        size_t n, back;
        bool special = r & 1;
        int rc = tokenizer_encode(t, buf, len, special, &ids, &n);
        char *round = rc ? NULL : decode_all(t, ids, n, &back);
        bad += !round || back != len || memcmp(round, buf, len) != 0;
        free(round);
        free(ids);
    }
    CHECK(bad == 0, "%d of 2000 random byte strings did not round-trip", bad);

    static const char fill[] = {' ', '\n', 'a', '!', '7'};
    const size_t big = 200000;
    char *s = malloc(big);
    for (int f = 0; f < 5; f++) {
        memset(s, fill[f], big);
        int32_t *ids;
        size_t n, back;
        double t0 = now_s();
        int rc = tokenizer_encode(t, s, big, false, &ids, &n);
        double dt = now_s() - t0;
        char *round = rc ? NULL : decode_all(t, ids, n, &back);
        CHECK(round && back == big && !memcmp(round, s, big) && dt < 1.0,
              "a run of %zu x 0x%02x: rc %d, %.2f s", big, fill[f], rc, dt);
        free(round);
        free(ids);
    }
    free(s);
}

/* ---------------------------------------------------------------------------------------- */
/* (e) bad metadata: tiny vocabularies written with gguf_writer                              */

enum bad_case {
    BAD_NONE,
    BAD_MODEL,        /* tokenizer.ggml.model = "llama" */
    BAD_PRE,          /* tokenizer.ggml.pre = "gpt-4o" */
    BAD_NO_PRE,       /* no tokenizer.ggml.pre */
    BAD_TYPE_LEN,     /* token_type one entry short */
    BAD_TYPE_KIND,    /* token_type is a float array */
    BAD_TYPE_VALUE,   /* token_type holds 9 */
    BAD_TOKENS_KIND,  /* tokens is an int32 array */
    BAD_NO_MERGES,    /* no tokenizer.ggml.merges */
    BAD_MERGE_SEP,    /* a merge without a space */
    BAD_EOS,          /* eos id = vocab size */
    BAD_MISSING_BYTE, /* the token of byte 0x41 renamed */
    BAD_COUNT,
};

static const char *const bad_expect[BAD_COUNT] = {
    "", "only \"gpt2\"", "not supported", "tokenizer.ggml.pre is missing", "entries",
    "array of int32", "not a token type", "array of string", "tokenizer.ggml.merges is missing",
    "no space", "not below the vocabulary size", "no token for byte 0x41",
};

/* GPT-2 byte-level form of byte b, NUL-terminated, into s (3 bytes). */
static void byte_level(int b, char *s)
{
    int extra = 0, cp = b;
    bool keep = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
    if (!keep) {
        for (int c = 0; c < b; c++)
            extra += !((c >= 33 && c <= 126) || (c >= 161 && c <= 172) || (c >= 174 && c <= 255));
        cp = 256 + extra;
    }
    if (cp < 0x80) {
        s[0] = (char)cp, s[1] = 0;
    } else {
        s[0] = (char)(0xC0 | cp >> 6), s[1] = (char)(0x80 | (cp & 0x3F)), s[2] = 0;
    }
}

#define TINY_N 262 /* tokens of the tiny vocabulary */

/* Writes the tiny vocabulary: 256 byte tokens (id = byte), 256 "ab", 257 "Ġab", 258 "abc" (no
 * merge builds it; type UNUSED), 259 "<|x|>" (control, eos), 260 "e\xCC" and 261 "e\xCC\x81" (e + U+0301
 * COMBINING ACUTE); merges "a b", "Ġ ab", "e \xCC", "e\xCC \x81" (all in byte-level form). */
static int write_vocab(const char *path, enum bad_case bc, const char *pre)
{
    char bytes[256][3], e_cc[8], e_cc_81[16], m_e_cc[8], m_e_cc_81[16];
    const char *toks[TINY_N];
    int32_t types[TINY_N];
    float ftypes[TINY_N];
    for (int b = 0; b < 256; b++) {
        byte_level(b, bytes[b]);
        toks[b] = bytes[b];
        types[b] = TOKENIZER_TOKEN_TYPE_NORMAL;
    }
    snprintf(e_cc, sizeof(e_cc), "e%s", bytes[0xCC]);
    snprintf(e_cc_81, sizeof(e_cc_81), "e%s%s", bytes[0xCC], bytes[0x81]);
    snprintf(m_e_cc, sizeof(m_e_cc), "e %s", bytes[0xCC]);
    snprintf(m_e_cc_81, sizeof(m_e_cc_81), "e%s %s", bytes[0xCC], bytes[0x81]);
    if (bc == BAD_MISSING_BYTE)
        toks['A'] = "AA";
    toks[256] = "ab", toks[257] = "\xC4\xA0" "ab", toks[258] = "abc", toks[259] = "<|x|>";
    toks[260] = e_cc, toks[261] = e_cc_81;
    for (int i = 256; i < TINY_N; i++)
        types[i] = TOKENIZER_TOKEN_TYPE_NORMAL;
    types[259] = bc == BAD_TYPE_VALUE ? 9 : TOKENIZER_TOKEN_TYPE_CONTROL;
    types[258] = TOKENIZER_TOKEN_TYPE_UNUSED; /* like the converter's "[PAD<id>]" fillers */
    for (int i = 0; i < TINY_N; i++)
        ftypes[i] = (float)types[i];
    const char *merges[] = {bc == BAD_MERGE_SEP ? "ab" : "a b", "\xC4\xA0 ab", m_e_cc, m_e_cc_81};
    struct gguf_writer_config wc = {.path = path};
    struct gguf_writer *w = gguf_writer_create(&wc);
    if (!w)
        return -EIO;
    int rc = gguf_writer_add_str(w, "general.architecture", "llama");
    rc |= gguf_writer_add_str(w, "tokenizer.ggml.model", bc == BAD_MODEL ? "llama" : "gpt2");
    if (bc != BAD_NO_PRE)
        rc |= gguf_writer_add_str(w, "tokenizer.ggml.pre", bc == BAD_PRE ? "gpt-4o" : pre);
    if (bc == BAD_TOKENS_KIND)
        rc |= gguf_writer_add_array(w, "tokenizer.ggml.tokens", GGUF_TYPE_INT32, types, TINY_N);
    else
        rc |= gguf_writer_add_array_str(w, "tokenizer.ggml.tokens", toks, TINY_N);
    if (bc == BAD_TYPE_KIND)
        rc |= gguf_writer_add_array(w, "tokenizer.ggml.token_type", GGUF_TYPE_FLOAT32, ftypes,
                                    TINY_N);
    else
        rc |= gguf_writer_add_array(w, "tokenizer.ggml.token_type", GGUF_TYPE_INT32, types,
                                    bc == BAD_TYPE_LEN ? TINY_N - 1 : TINY_N);
    if (bc != BAD_NO_MERGES)
        rc |= gguf_writer_add_array_str(w, "tokenizer.ggml.merges", merges, 4);
    rc |= gguf_writer_add_u32(w, "tokenizer.ggml.eos_token_id", bc == BAD_EOS ? TINY_N : 259);
    rc |= gguf_writer_write_header(w);
    rc |= gguf_writer_finish(w);
    gguf_writer_destroy(w);
    return rc ? -EIO : 0;
}

/* The valid tiny vocabulary under each pre-tokenizer name. */
static void test_tiny(const char *path)
{
    static const struct {
        const char *pre;
        enum tokenizer_pre want;
    } pres[] = {
        {"qwen2", TOKENIZER_PRE_QWEN2}, {"deepseek-r1-qwen", TOKENIZER_PRE_QWEN2},
        {"kormo", TOKENIZER_PRE_QWEN2}, {"f2llmv2", TOKENIZER_PRE_QWEN2},
        {"qwen35", TOKENIZER_PRE_QWEN35},
    };
    for (size_t i = 0; i < sizeof(pres) / sizeof(pres[0]); i++) {
        CHECK(write_vocab(path, BAD_NONE, pres[i].pre) == 0, "write %s", pres[i].pre);
        struct gguf *g;
        struct tokenizer *t = open_tokenizer(path, &g);
        CHECK(t && tokenizer_n_vocab(t) == TINY_N && tokenizer_eos(t) == 259 &&
              tokenizer_pre(t) == pres[i].want, "pre %s: the tiny vocabulary is accepted",
              pres[i].pre);
        if (!t) {
            gguf_close(g);
            continue;
        }
        int32_t *ids = NULL;
        size_t n = 0;
        /* "ab" merges; " abc" becomes "Ġab" + "c" ("abc" is a token, but no merge builds it) */
        int rc = tokenizer_encode(t, "ab abc<|x|>", 11, true, &ids, &n);
        CHECK(rc == 0 && n == 4 && ids[0] == 256 && ids[1] == 257 && ids[2] == 'c' &&
              ids[3] == 259, "pre %s: tiny encode: rc %d n %zu", pres[i].pre, rc, n);
        free(ids);
        /* an UNUSED token streams no text; the next token's text still comes */
        struct detok_config dc = {.tok = t};
        struct detok *d = detok_create(&dc);
        const char *o = NULL;
        size_t ol = 99;
        CHECK(d && detok_push(d, 258, &o, &ol) == 0 && ol == 0, "UNUSED token gave %zu bytes", ol);
        CHECK(d && detok_push(d, 256, &o, &ol) == 0 && ol == 2 && !memcmp(o, "ab", 2),
              "the token after an UNUSED one: %zu bytes", ol);
        detok_destroy(d);
        /* a combining mark joins the letter's piece only under qwen35 (\p{M} in the class) */
        rc = tokenizer_encode(t, "e\xCC\x81", 3, false, &ids, &n);
        if (pres[i].want == TOKENIZER_PRE_QWEN35)
            CHECK(rc == 0 && n == 1 && ids[0] == 261, "qwen35: e + U+0301 is one piece (%zu)",
                  n);
        else
            CHECK(rc == 0 && n == 3 && ids[0] == 'e' && ids[1] == 0xCC && ids[2] == 0x81,
                  "pre %s: the mark is its own piece (%zu ids)", pres[i].pre, n);
        free(ids);
        tokenizer_destroy(t);
        gguf_close(g);
    }
}

static void test_bad_metadata(void)
{
    char dir[] = "/tmp/test_tokenizer.XXXXXX";
    CHECK(mkdtemp(dir), "mkdtemp");
    char path[64];
    snprintf(path, sizeof(path), "%s/v.gguf", dir);
    test_tiny(path);
    for (int bc = BAD_NONE + 1; bc < BAD_COUNT; bc++) {
        CHECK(write_vocab(path, (enum bad_case)bc, "qwen2") == 0, "case %d: write failed", bc);
        struct gguf *g;
        struct tokenizer *t = open_tokenizer(path, &g);
        CHECK(g, "case %d: gguf_open failed", bc);
        CHECK(!t && strstr(log_last_error(), bad_expect[bc]),
              "case %d: want rejection naming '%s', got '%s'", bc, bad_expect[bc],
              t ? "(accepted)" : log_last_error());
        tokenizer_destroy(t);
        gguf_close(g);
    }
    unlink(path);
    rmdir(dir);
}

/* ---------------------------------------------------------------------------------------- */

struct enc_job {
    const struct tokenizer *t; /* shared tokenizer */
    const char *text;          /* input */
    size_t len;                /* bytes of input */
    int32_t *ids;              /* result */
    size_t n;                  /* ids in result */
    int rc;                    /* encode result */
};

static void *enc_thread(void *arg)
{
    struct enc_job *j = arg;
    j->rc = tokenizer_encode(j->t, j->text, j->len, true, &j->ids, &j->n);
    return NULL;
}

/* Copy r of the text: 0 as is, 1 rot13, 2 upper case, 3 rot7 (letters only), so the copies
 * share no words and the encoder's per-call piece cache cannot flatter the measurement. */
static void transform(char *dst, const char *src, size_t len, int r)
{
    static const int rot[4] = {0, 13, 0, 7};
    for (size_t i = 0; i < len; i++) {
        char ch = src[i];
        if (r == 2 && ch >= 'a' && ch <= 'z')
            ch = (char)(ch - 'a' + 'A');
        else if (ch >= 'a' && ch <= 'z')
            ch = (char)('a' + (ch - 'a' + rot[r]) % 26);
        else if (ch >= 'A' && ch <= 'Z')
            ch = (char)('A' + (ch - 'A' + rot[r]) % 26);
        dst[i] = ch;
    }
}

static void test_throughput(const struct tokenizer *t)
{
    char path[512];
    size_t len;
    char *eval = fixture_read_all(test_fixture(path, sizeof(path), "small-model/eval.txt"), &len);
    CHECK(eval, "cannot read eval.txt");
    if (!eval)
        return;
    const int reps = 4; /* about 285 KB */
    size_t total = len * reps;
    char *text = malloc(total);
    for (int r = 0; r < reps; r++)
        transform(text + r * len, eval, len, r);
    int32_t *ids;
    size_t n;
    double best = 1e9;
    for (int k = 0; k < 3; k++) {
        double t0 = now_s();
        int rc = tokenizer_encode(t, text, total, false, &ids, &n);
        double dt = now_s() - t0;
        best = dt < best ? dt : best;
        CHECK(rc == 0, "encode eval.txt: %d", rc);
        if (k < 2)
            free(ids);
    }
    size_t back;
    char *round = decode_all(t, ids, n, &back);
    CHECK(round && back == total && !memcmp(round, text, total), "eval.txt round trip");
    MEASURE("encode throughput: %.2f MB/s (%zu bytes of eval.txt in 4 letter-shifted copies -> "
            "%zu tokens, best of 3: %.1f ms)", (double)total / best / 1e6, total, n, best * 1e3);
    free(round);
    free(ids);

    /* eval.txt ends with "\n" and starts with "#": four identical copies encode to four
     * copies of one copy's ids, the later three served by the piece cache */
    for (int r = 0; r < reps; r++)
        memcpy(text + r * len, eval, len);
    CHECK(tokenizer_encode(t, text, total, false, &ids, &n) == 0, "encode 4 copies");
    /* concurrent encodes of one tokenizer give the single-thread result */
    struct enc_job jobs[4];
    pthread_t th[4];
    for (int i = 0; i < 4; i++) {
        jobs[i] = (struct enc_job){.t = t, .text = text, .len = len};
        pthread_create(&th[i], NULL, enc_thread, &jobs[i]);
    }
    for (int i = 0; i < 4; i++) {
        pthread_join(th[i], NULL);
        size_t m = jobs[i].n;
        CHECK(jobs[i].rc == 0 && m * reps == n && !memcmp(jobs[i].ids, ids + i * m,
                                                          m * sizeof(*ids)),
              "thread %d differs from quarter %d of the single-thread encode", i, i);
        free(jobs[i].ids);
    }
    free(ids);
    free(text);
    free(eval);
}

int main(void)
{
    log_init("test", -1);
    char path[512];
    struct gguf *g;
    double t0 = now_s();
    struct tokenizer *t = open_tokenizer(test_fixture(path, sizeof(path),
                                                      "tokenizer/qwen2-vocab.gguf"), &g);
    double dt = now_s() - t0;
    CHECK(t, "cannot build the qwen2 tokenizer");
    if (t) {
        MEASURE("qwen2 vocabulary (151665 tokens, 151387 merges) open + create: %.1f ms",
                dt * 1e3);
        CHECK(dt < 1.0, "building took %.2f s", dt);
        gguf_close(g); /* the tokenizer owns copies */
        g = NULL;
        test_vectors(t);
        test_detok(t);
        test_special(t);
        test_robust(t);
        test_throughput(t);
    }
    tokenizer_destroy(t);
    gguf_close(g);
    test_conformance();
    test_bad_metadata();
    return test_main_result("test_tokenizer");
}
