/*
 * tokenizer: byte-level BPE (see tokenizer.h).
 *
 * BPE works on raw bytes, not on the byte-level unicode text: every token text and every merge
 * side is decoded from the GPT-2 bytes_to_unicode form once, at create. Each distinct byte string
 * that BPE can produce is a "symbol": symbol ids below n_vocab are tokens, the few strings that
 * merges name but the vocabulary lacks get ids from n_vocab up. Merges become a hash map from a
 * (left symbol, right symbol) pair to (rank, result symbol), so the merge loop touches only
 * integers. Symbol strings are interned in a second hash map (bytes -> symbol id).
 *
 * An encode call keeps a cache of the pieces it has already merged (pieces of 2..64 bytes,
 * keyed by their bytes, pointing at their ids earlier in the output): text repeats its words,
 * and a repeated piece always merges the same way.
 */
#define PCRE2_CODE_UNIT_WIDTH 8
#include "model/tokenizer.h"

#include <errno.h>
#include <pcre2.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "common/log.h"
#include "model/gguf.h"

#define BL_N_CP 324      /* bytes_to_unicode maps bytes to code points below 256 + 68 */
#define EOG_MAX 8        /* eos, eot and the five end-of-generation texts */

/* Pre-tokenizer regexes of model-spec 7.3, the (?i:) group expanded as llama.cpp does. */
static const char *const pre_regex_qwen2 =
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
    "|[^\\r\\n\\p{L}\\p{N}]?\\p{L}+|\\p{N}| ?[^\\s\\p{L}\\p{N}]+[\\r\\n]*|\\s*[\\r\\n]+"
    "|\\s+(?!\\S)|\\s+";
static const char *const pre_regex_qwen35 =
    "(?:'[sS]|'[tT]|'[rR][eE]|'[vV][eE]|'[mM]|'[lL][lL]|'[dD])"
    "|[^\\r\\n\\p{L}\\p{N}]?[\\p{L}\\p{M}]+|\\p{N}| ?[^\\s\\p{L}\\p{M}\\p{N}]+[\\r\\n]*"
    "|\\s*[\\r\\n]+|\\s+(?!\\S)|\\s+";

/* Texts that end generation when the vocabulary has them (model-spec 7.1). */
static const char *const eog_texts[] = {
    "<|endoftext|>", "<|im_end|>", "<|fim_pad|>", "<|repo_name|>", "<|file_sep|>",
};

/* Growable byte arena with offsets: string i is bytes[off[i] .. off[i + 1]). */
struct str_table {
    char *bytes;   /* concatenated strings */
    size_t len;    /* bytes used */
    size_t cap;    /* bytes allocated */
    uint32_t *off; /* n + 1 offsets */
    int32_t n;     /* strings stored */
    int32_t n_cap; /* offsets allocated, minus one */
};

/* Open-addressing map from a symbol's bytes to its id. */
struct sym_slot {
    uint32_t hash; /* hash of the bytes */
    int32_t id;    /* symbol id, -1 when the slot is empty */
};

/* Open-addressing map from a (left, right) symbol pair to its merge. */
struct pair_slot {
    uint64_t key;   /* left << 32 | right; UINT64_MAX when empty */
    int32_t rank;   /* index in tokenizer.ggml.merges */
    int32_t result; /* symbol id of left + right */
};

struct tokenizer {
    int32_t n_vocab;             /* tokens */
    enum tokenizer_pre pre;      /* regex family */
    int32_t eos, eot, bos, pad;  /* special ids, -1 when absent */
    bool add_bos;                /* tokenizer.ggml.add_bos_token */
    uint8_t *type;               /* n_vocab token types */
    struct str_table tok;        /* n_vocab entries: each token's output bytes */
    struct str_table sym;        /* symbol bytes (BPE space); empty for undecodable tokens */
    struct sym_slot *sym_map;    /* bytes -> symbol id */
    uint32_t sym_mask;           /* sym_map capacity - 1 (a power of two minus one) */
    uint32_t sym_used;           /* occupied sym_map slots */
    struct pair_slot *pair_map;  /* merges */
    uint32_t pair_mask;          /* pair_map capacity - 1 */
    int32_t byte_sym[256];       /* symbol of each single byte */
    int32_t byte_tok[256];       /* token of each single byte */
    int16_t cp_byte[BL_N_CP];    /* byte-level code point -> byte, -1 when unmapped */
    int32_t *special;            /* special token ids, longest text first, then lowest id */
    int32_t n_special;           /* entries in special */
    int32_t *by_byte;            /* indices into special grouped by first byte */
    int32_t by_byte_start[257];  /* group of byte b: by_byte[start[b] .. start[b + 1]) */
    int32_t eog[EOG_MAX];        /* end-of-generation ids */
    int n_eog;                   /* entries in eog */
    pcre2_code *re;              /* compiled pre-tokenizer, shared read-only by all threads */
};

/* ---------------------------------------------------------------------------------------- */
/* Strings and hashing                                                                       */

static int str_table_init(struct str_table *st, int32_t n_cap, size_t byte_cap)
{
    memset(st, 0, sizeof(*st));
    st->off = malloc(((size_t)n_cap + 1) * sizeof(*st->off));
    st->bytes = malloc(byte_cap ? byte_cap : 1);
    if (!st->off || !st->bytes)
        return -ENOMEM;
    st->off[0] = 0;
    st->n_cap = n_cap;
    st->cap = byte_cap ? byte_cap : 1;
    return 0;
}

static void str_table_free(struct str_table *st)
{
    free(st->bytes);
    free(st->off);
}

/* Appends one string; returns its index, or -ENOMEM / -E2BIG. */
static int32_t str_table_add(struct str_table *st, const char *s, size_t n)
{
    if (st->len + n > UINT32_MAX || st->n == INT32_MAX - 1)
        return -E2BIG;
    if (st->len + n > st->cap) {
        size_t cap = st->cap * 2 > st->len + n ? st->cap * 2 : st->len + n;
        char *b = realloc(st->bytes, cap);
        if (!b)
            return -ENOMEM;
        st->bytes = b;
        st->cap = cap;
    }
    if (st->n == st->n_cap) {
        int32_t n_cap = st->n_cap < INT32_MAX / 2 - 1 ? st->n_cap * 2 + 16 : INT32_MAX - 1;
        uint32_t *o = realloc(st->off, ((size_t)n_cap + 1) * sizeof(*o));
        if (!o)
            return -ENOMEM;
        st->off = o;
        st->n_cap = n_cap;
    }
    memcpy(st->bytes + st->len, s, n);
    st->len += n;
    st->off[++st->n] = (uint32_t)st->len;
    return st->n - 1;
}

static inline const char *str_at(const struct str_table *st, int32_t i, size_t *n)
{
    *n = st->off[i + 1] - st->off[i];
    return st->bytes + st->off[i];
}

static uint32_t hash_bytes(const char *s, size_t n)
{
    uint32_t h = 2166136261u; /* FNV-1a */
    for (size_t i = 0; i < n; i++)
        h = (h ^ (uint8_t)s[i]) * 16777619u;
    return h;
}

static uint64_t hash_u64(uint64_t x)
{
    x ^= x >> 33; /* murmur3 finalizer */
    x *= 0xff51afd7ed558ccdull;
    x ^= x >> 33;
    x *= 0xc4ceb9fe1a85ec53ull;
    return x ^ (x >> 33);
}

static uint32_t pow2_at_least(uint64_t n)
{
    uint32_t c = 16;
    while (c < n && c < (1u << 31))
        c <<= 1;
    return c;
}

/* Slot of the symbol with these bytes, or of the empty slot where it would go. */
static uint32_t sym_map_slot(const struct tokenizer *t, const char *s, size_t n, uint32_t h)
{
    uint32_t i = h & t->sym_mask;
    for (;; i = (i + 1) & t->sym_mask) {
        const struct sym_slot *sl = &t->sym_map[i];
        if (sl->id < 0)
            return i;
        size_t m;
        const char *p = str_at(&t->sym, sl->id, &m);
        if (sl->hash == h && m == n && memcmp(p, s, n) == 0)
            return i;
    }
}

/* Symbol id of these bytes, or -1. */
static int32_t sym_lookup(const struct tokenizer *t, const char *s, size_t n)
{
    return t->sym_map[sym_map_slot(t, s, n, hash_bytes(s, n))].id;
}

static int sym_map_grow(struct tokenizer *t)
{
    uint32_t cap = (t->sym_mask + 1) * 2;
    struct sym_slot *m = malloc((size_t)cap * sizeof(*m));
    if (!m)
        return -ENOMEM;
    for (uint32_t i = 0; i < cap; i++)
        m[i].id = -1;
    for (uint32_t i = 0; i <= t->sym_mask; i++) {
        struct sym_slot sl = t->sym_map[i];
        if (sl.id < 0)
            continue;
        uint32_t j = sl.hash & (cap - 1);
        while (m[j].id >= 0)
            j = (j + 1) & (cap - 1);
        m[j] = sl;
    }
    free(t->sym_map);
    t->sym_map = m;
    t->sym_mask = cap - 1;
    return 0;
}

/* Maps bytes to symbol id (an existing entry is replaced only when replace is set). */
static int sym_map_put(struct tokenizer *t, const char *s, size_t n, int32_t id, bool replace)
{
    if ((t->sym_used + 1) * 2 > t->sym_mask + 1 && sym_map_grow(t))
        return -ENOMEM;
    uint32_t h = hash_bytes(s, n);
    uint32_t i = sym_map_slot(t, s, n, h);
    if (t->sym_map[i].id < 0)
        t->sym_used++;
    else if (!replace)
        return 0;
    t->sym_map[i].hash = h;
    t->sym_map[i].id = id;
    return 0;
}

/* Symbol id of these bytes, adding a non-token symbol when new; negative errno on failure. */
static int32_t sym_intern(struct tokenizer *t, const char *s, size_t n)
{
    int32_t id = sym_lookup(t, s, n);
    if (id >= 0)
        return id;
    id = str_table_add(&t->sym, s, n);
    if (id < 0)
        return id;
    int rc = sym_map_put(t, s, n, id, false);
    return rc ? rc : id;
}

static inline const struct pair_slot *pair_find(const struct tokenizer *t, int32_t a, int32_t b)
{
    uint64_t key = (uint64_t)(uint32_t)a << 32 | (uint32_t)b;
    uint32_t i = (uint32_t)hash_u64(key) & t->pair_mask;
    for (;; i = (i + 1) & t->pair_mask) {
        const struct pair_slot *sl = &t->pair_map[i];
        if (sl->key == key)
            return sl;
        if (sl->key == UINT64_MAX)
            return NULL;
    }
}

/* Adds a merge unless the pair already has one (the first, lowest rank, wins). */
static void pair_put(struct tokenizer *t, int32_t a, int32_t b, int32_t rank, int32_t result)
{
    uint64_t key = (uint64_t)(uint32_t)a << 32 | (uint32_t)b;
    uint32_t i = (uint32_t)hash_u64(key) & t->pair_mask;
    while (t->pair_map[i].key != UINT64_MAX) {
        if (t->pair_map[i].key == key)
            return;
        i = (i + 1) & t->pair_mask;
    }
    t->pair_map[i] = (struct pair_slot){key, rank, result};
}

/* ---------------------------------------------------------------------------------------- */
/* Byte-level form and UTF-8                                                                 */

/* GPT-2 bytes_to_unicode: printable Latin-1 bytes map to themselves, the other 68 bytes to
 * 256, 257, ... in byte order. Fills the inverse table. */
static void byte_level_init(int16_t cp_byte[BL_N_CP])
{
    for (int c = 0; c < BL_N_CP; c++)
        cp_byte[c] = -1;
    int extra = 0;
    for (int b = 0; b < 256; b++) {
        bool keep = (b >= 33 && b <= 126) || (b >= 161 && b <= 172) || (b >= 174 && b <= 255);
        cp_byte[keep ? b : 256 + extra++] = (int16_t)b;
    }
}

/* Decodes byte-level text s into raw bytes at out (room for n bytes). Returns false when s has
 * a character outside the byte-level alphabet. */
static bool byte_level_decode(const int16_t cp_byte[BL_N_CP], const char *s, size_t n, char *out,
                              size_t *out_n)
{
    const uint8_t *u = (const uint8_t *)s;
    size_t k = 0;
    for (size_t i = 0; i < n;) {
        uint32_t cp;
        if (u[i] < 0x80) {
            cp = u[i++];
        } else if ((u[i] & 0xE0) == 0xC0 && i + 1 < n && (u[i + 1] & 0xC0) == 0x80) {
            cp = (uint32_t)(u[i] & 0x1F) << 6 | (u[i + 1] & 0x3F);
            i += 2;
        } else {
            return false; /* 3- and 4-byte characters are all above the alphabet */
        }
        if (cp >= BL_N_CP || cp_byte[cp] < 0)
            return false;
        out[k++] = (char)cp_byte[cp];
    }
    *out_n = k;
    return true;
}

enum utf8_status { UTF8_VALID, UTF8_INVALID, UTF8_INCOMPLETE };

/* Classifies the sequence at s (n >= 1 bytes). VALID: *adv is its length. INVALID: *adv is the
 * maximal subpart to replace by one U+FFFD (Unicode 3.9, table 3-7). INCOMPLETE: all n bytes are
 * a valid prefix. */
static enum utf8_status utf8_scan(const uint8_t *s, size_t n, size_t *adv)
{
    uint8_t b = s[0];
    size_t need;
    uint8_t lo = 0x80, hi = 0xBF; /* range of the second byte */
    if (b < 0x80) {
        *adv = 1;
        return UTF8_VALID;
    } else if (b >= 0xC2 && b <= 0xDF) {
        need = 2;
    } else if (b >= 0xE0 && b <= 0xEF) {
        need = 3;
        lo = b == 0xE0 ? 0xA0 : 0x80;
        hi = b == 0xED ? 0x9F : 0xBF;
    } else if (b >= 0xF0 && b <= 0xF4) {
        need = 4;
        lo = b == 0xF0 ? 0x90 : 0x80;
        hi = b == 0xF4 ? 0x8F : 0xBF;
    } else {
        *adv = 1;
        return UTF8_INVALID;
    }
    for (size_t j = 1; j < need; j++) {
        if (j == n) {
            *adv = n;
            return UTF8_INCOMPLETE;
        }
        bool ok = j == 1 ? s[j] >= lo && s[j] <= hi : (s[j] & 0xC0) == 0x80;
        if (!ok) {
            *adv = j;
            return UTF8_INVALID;
        }
    }
    *adv = need;
    return UTF8_VALID;
}

/* ---------------------------------------------------------------------------------------- */
/* Create: metadata                                                                          */

/* A STRING-array key; NULL (logged when required) when absent or of the wrong type. */
static const struct gguf_kv *get_str_array(const struct gguf *g, const char *key, bool required)
{
    const struct gguf_kv *kv = gguf_find_kv(g, key);
    if (!kv) {
        if (required)
            log_error("tokenizer: %s is missing", key);
        return NULL;
    }
    if (kv->type != GGUF_TYPE_ARRAY || kv->arr_type != GGUF_TYPE_STRING) {
        log_error("tokenizer: %s at offset %llu must be an array of string, not %s of %s", key,
                  (unsigned long long)kv->file_offset, gguf_type_name(kv->type),
                  gguf_type_name(kv->type == GGUF_TYPE_ARRAY ? kv->arr_type : kv->type));
        return NULL;
    }
    return kv;
}

static bool str_is(struct gguf_str s, const char *lit)
{
    return s.len == strlen(lit) && memcmp(s.ptr, lit, s.len) == 0;
}

static int read_model_and_pre(struct tokenizer *t, const struct gguf *g)
{
    struct gguf_str s;
    int rc = gguf_get_str(g, "tokenizer.ggml.model", &s);
    if (rc == -ENOENT)
        log_error("tokenizer: tokenizer.ggml.model is missing");
    if (rc)
        return -EINVAL;
    if (!str_is(s, "gpt2")) {
        log_error("tokenizer: tokenizer.ggml.model is \"%.*s\"; only \"gpt2\" (byte-level BPE) "
                  "is supported", (int)(s.len > 64 ? 64 : s.len), s.ptr);
        return -EINVAL;
    }
    rc = gguf_get_str(g, "tokenizer.ggml.pre", &s);
    if (rc == -ENOENT)
        log_error("tokenizer: tokenizer.ggml.pre is missing (need qwen2 or qwen35)");
    if (rc)
        return -EINVAL;
    if (str_is(s, "qwen2") || str_is(s, "deepseek-r1-qwen") || str_is(s, "kormo") ||
        str_is(s, "f2llmv2")) {
        t->pre = TOKENIZER_PRE_QWEN2;
    } else if (str_is(s, "qwen35")) {
        t->pre = TOKENIZER_PRE_QWEN35;
    } else {
        log_error("tokenizer: tokenizer.ggml.pre \"%.*s\" is not supported (supported: qwen2, "
                  "deepseek-r1-qwen, kormo, f2llmv2, qwen35)", (int)(s.len > 64 ? 64 : s.len),
                  s.ptr);
        return -EINVAL;
    }
    return 0;
}

/* Reads an optional special id; *id stays -1 when absent. */
static int read_special_id(const struct tokenizer *t, const struct gguf *g, const char *key,
                           int32_t *id)
{
    uint32_t v;
    int rc = gguf_get_u32(g, key, &v);
    if (rc == -ENOENT)
        return 0;
    if (rc)
        return -EINVAL;
    if (v >= (uint32_t)t->n_vocab) {
        log_error("tokenizer: %s = %u is not below the vocabulary size %d", key, v, t->n_vocab);
        return -EINVAL;
    }
    *id = (int32_t)v;
    return 0;
}

static int read_specials(struct tokenizer *t, const struct gguf *g)
{
    int32_t unk = -1, sep = -1;
    if (read_special_id(t, g, "tokenizer.ggml.eos_token_id", &t->eos) ||
        read_special_id(t, g, "tokenizer.ggml.eot_token_id", &t->eot) ||
        read_special_id(t, g, "tokenizer.ggml.bos_token_id", &t->bos) ||
        read_special_id(t, g, "tokenizer.ggml.padding_token_id", &t->pad) ||
        read_special_id(t, g, "tokenizer.ggml.unknown_token_id", &unk) ||
        read_special_id(t, g, "tokenizer.ggml.seperator_token_id", &sep))
        return -EINVAL;
    int rc = gguf_get_bool(g, "tokenizer.ggml.add_bos_token", &t->add_bos);
    if (rc == -ENOENT)
        t->add_bos = false;
    else if (rc)
        return -EINVAL;
    return 0;
}

static int read_types(struct tokenizer *t, const struct gguf *g)
{
    t->type = malloc((size_t)t->n_vocab);
    if (!t->type)
        return -ENOMEM;
    const char *key = "tokenizer.ggml.token_type";
    const struct gguf_kv *kv = gguf_find_kv(g, key);
    if (!kv) {
        memset(t->type, TOKENIZER_TOKEN_TYPE_NORMAL, (size_t)t->n_vocab);
        return 0;
    }
    if (kv->type != GGUF_TYPE_ARRAY || !gguf_type_is_int(kv->arr_type) ||
        kv->arr_type == GGUF_TYPE_BOOL) {
        log_error("tokenizer: %s at offset %llu must be an array of int32", key,
                  (unsigned long long)kv->file_offset);
        return -EINVAL;
    }
    if (kv->n != (uint64_t)t->n_vocab) {
        log_error("tokenizer: %s at offset %llu has %llu entries but there are %d tokens", key,
                  (unsigned long long)kv->file_offset, (unsigned long long)kv->n, t->n_vocab);
        return -EINVAL;
    }
    for (int32_t i = 0; i < t->n_vocab; i++) {
        int64_t v = gguf_arr_i64(kv, (uint64_t)i);
        if (v < 0 || v > TOKENIZER_TOKEN_TYPE_BYTE) {
            log_error("tokenizer: %s[%d] = %lld is not a token type (0..6)", key, i,
                      (long long)v);
            return -EINVAL;
        }
        t->type[i] = (uint8_t)v;
    }
    return 0;
}

static bool type_is_special(uint8_t type)
{
    return type == TOKENIZER_TOKEN_TYPE_CONTROL || type == TOKENIZER_TOKEN_TYPE_USER_DEFINED ||
           type == TOKENIZER_TOKEN_TYPE_UNKNOWN;
}

/* ---------------------------------------------------------------------------------------- */
/* Create: vocabulary, merges, special tokens                                                */

/* Stores each token's output bytes and symbol bytes and interns the symbols. */
static int build_vocab(struct tokenizer *t, const struct gguf_kv *kv, char *scratch)
{
    size_t total = 0;
    for (int32_t i = 0; i < t->n_vocab; i++)
        total += kv->strs[i].len;
    if (total > UINT32_MAX / 2) {
        log_error("tokenizer: tokenizer.ggml.tokens holds %zu bytes of text, too many", total);
        return -EINVAL;
    }
    if (str_table_init(&t->tok, t->n_vocab, total) ||
        str_table_init(&t->sym, t->n_vocab + 1024, total + 4096))
        return -ENOMEM;
    t->sym_mask = pow2_at_least((uint64_t)t->n_vocab * 2 + 1024) - 1;
    t->sym_map = malloc(((size_t)t->sym_mask + 1) * sizeof(*t->sym_map));
    if (!t->sym_map)
        return -ENOMEM;
    for (uint32_t i = 0; i <= t->sym_mask; i++)
        t->sym_map[i].id = -1;
    for (int32_t i = 0; i < t->n_vocab; i++) {
        struct gguf_str s = kv->strs[i];
        size_t n = 0;
        bool ok = byte_level_decode(t->cp_byte, s.ptr, s.len, scratch, &n);
        const char *out = ok && !type_is_special(t->type[i]) ? scratch : s.ptr;
        if (str_table_add(&t->tok, out, ok && out == scratch ? n : s.len) < 0 ||
            str_table_add(&t->sym, scratch, ok ? n : 0) < 0)
            return -ENOMEM;
        /* llama.cpp maps a text to the last token that has it */
        if (ok && n > 0 && sym_map_put(t, scratch, n, i, true))
            return -ENOMEM;
    }
    return 0;
}

static int build_bytes(struct tokenizer *t)
{
    for (int b = 0; b < 256; b++) {
        char c = (char)b;
        int32_t id = sym_lookup(t, &c, 1);
        if (id < 0) {
            log_error("tokenizer: no token for byte 0x%02x in tokenizer.ggml.tokens (a "
                      "byte-level BPE vocabulary has all 256)", b);
            return -EINVAL;
        }
        t->byte_sym[b] = id;
        t->byte_tok[b] = id;
    }
    return 0;
}

/* Decodes one merge "left right" and records it; merges with sides outside the byte-level
 * alphabet can never apply and are skipped. */
static int add_merge(struct tokenizer *t, struct gguf_str m, int32_t rank, char *scratch)
{
    const char *sp = m.len > 1 ? memchr(m.ptr + 1, ' ', m.len - 1) : NULL;
    if (!sp) {
        log_error("tokenizer: tokenizer.ggml.merges[%d] \"%.*s\" has no space separating two "
                  "parts", rank, (int)(m.len > 64 ? 64 : m.len), m.ptr);
        return -EINVAL;
    }
    size_t nl, nr;
    char *left = scratch, *right = scratch + m.len;
    if (!byte_level_decode(t->cp_byte, m.ptr, (size_t)(sp - m.ptr), left, &nl) ||
        !byte_level_decode(t->cp_byte, sp + 1, m.len - (size_t)(sp - m.ptr) - 1, right, &nr) ||
        nl == 0 || nr == 0)
        return 0;
    int32_t a = sym_intern(t, left, nl);
    int32_t b = a < 0 ? a : sym_intern(t, right, nr);
    if (b < 0)
        return -ENOMEM;
    memmove(left + nl, right, nr); /* left + right, contiguous */
    int32_t r = sym_intern(t, left, nl + nr);
    if (r < 0)
        return -ENOMEM;
    pair_put(t, a, b, rank, r);
    return 0;
}

static int build_merges(struct tokenizer *t, const struct gguf_kv *kv)
{
    if (kv->n > INT32_MAX) {
        log_error("tokenizer: tokenizer.ggml.merges has %llu entries, too many",
                  (unsigned long long)kv->n);
        return -EINVAL;
    }
    t->pair_mask = pow2_at_least(kv->n * 2 + 16) - 1;
    t->pair_map = malloc(((size_t)t->pair_mask + 1) * sizeof(*t->pair_map));
    if (!t->pair_map)
        return -ENOMEM;
    for (uint32_t i = 0; i <= t->pair_mask; i++)
        t->pair_map[i].key = UINT64_MAX;
    size_t longest = 0;
    for (uint64_t i = 0; i < kv->n; i++)
        longest = kv->strs[i].len > longest ? kv->strs[i].len : longest;
    char *scratch = malloc(2 * longest + 1);
    if (!scratch)
        return -ENOMEM;
    int rc = 0;
    for (uint64_t i = 0; i < kv->n && !rc; i++)
        rc = add_merge(t, kv->strs[i], (int32_t)i, scratch);
    free(scratch);
    return rc;
}

static int cmp_special(const void *pa, const void *pb, void *arg)
{
    const struct tokenizer *t = arg;
    int32_t a = *(const int32_t *)pa, b = *(const int32_t *)pb;
    size_t na = t->tok.off[a + 1] - t->tok.off[a], nb = t->tok.off[b + 1] - t->tok.off[b];
    if (na != nb)
        return na > nb ? -1 : 1;
    return a < b ? -1 : a > b;
}

/* Lists the special tokens by priority and groups them by first byte. */
static int build_special(struct tokenizer *t)
{
    int32_t n = 0;
    for (int32_t i = 0; i < t->n_vocab; i++)
        n += type_is_special(t->type[i]) && t->tok.off[i + 1] > t->tok.off[i];
    t->special = malloc(((size_t)n + 1) * sizeof(*t->special));
    t->by_byte = malloc(((size_t)n + 1) * sizeof(*t->by_byte));
    if (!t->special || !t->by_byte)
        return -ENOMEM;
    n = 0;
    for (int32_t i = 0; i < t->n_vocab; i++)
        if (type_is_special(t->type[i]) && t->tok.off[i + 1] > t->tok.off[i])
            t->special[n++] = i;
    t->n_special = n;
    qsort_r(t->special, (size_t)n, sizeof(*t->special), cmp_special, t);
    int32_t count[257] = {0};
    for (int32_t k = 0; k < n; k++)
        count[(uint8_t)t->tok.bytes[t->tok.off[t->special[k]]] + 1]++;
    for (int b = 0; b < 256; b++)
        count[b + 1] += count[b];
    memcpy(t->by_byte_start, count, sizeof(count));
    for (int32_t k = 0; k < n; k++)
        t->by_byte[count[(uint8_t)t->tok.bytes[t->tok.off[t->special[k]]]]++] = k;
    return 0;
}

static void build_eog(struct tokenizer *t)
{
    if (t->eot < 0)
        t->eot = tokenizer_find(t, "<|im_end|>");
    int32_t cand[EOG_MAX] = {t->eos, t->eot};
    int n = 2;
    for (size_t i = 0; i < sizeof(eog_texts) / sizeof(eog_texts[0]); i++)
        cand[n++] = tokenizer_find(t, eog_texts[i]);
    for (int i = 0; i < n; i++) {
        bool dup = cand[i] < 0;
        for (int j = 0; j < t->n_eog && !dup; j++)
            dup = t->eog[j] == cand[i];
        if (!dup)
            t->eog[t->n_eog++] = cand[i];
    }
}

static int build_regex(struct tokenizer *t)
{
    const char *pat = t->pre == TOKENIZER_PRE_QWEN35 ? pre_regex_qwen35 : pre_regex_qwen2;
    int err;
    PCRE2_SIZE at;
    t->re = pcre2_compile((PCRE2_SPTR)pat, PCRE2_ZERO_TERMINATED,
                          PCRE2_UTF | PCRE2_UCP | PCRE2_MATCH_INVALID_UTF, &err, &at, NULL);
    if (!t->re) {
        PCRE2_UCHAR msg[256];
        pcre2_get_error_message(err, msg, sizeof(msg));
        log_error("tokenizer: pcre2_compile of the pre-tokenizer failed at %zu: %s", (size_t)at,
                  (const char *)msg);
        return -EIO;
    }
    int rc = pcre2_jit_compile(t->re, PCRE2_JIT_COMPLETE);
    if (rc < 0 && rc != PCRE2_ERROR_JIT_BADOPTION)
        log_debug("tokenizer: pcre2 JIT unavailable (%d), using the interpreter", rc);
    return 0;
}

static int tokenizer_build(struct tokenizer *t, const struct gguf *g)
{
    int rc = read_model_and_pre(t, g);
    if (rc)
        return rc;
    const struct gguf_kv *toks = get_str_array(g, "tokenizer.ggml.tokens", true);
    const struct gguf_kv *merges = toks ? get_str_array(g, "tokenizer.ggml.merges", true) : NULL;
    if (!merges)
        return -EINVAL;
    if (toks->n < 256 || toks->n > INT32_MAX / 2) {
        log_error("tokenizer: tokenizer.ggml.tokens has %llu entries (need 256 .. %d)",
                  (unsigned long long)toks->n, INT32_MAX / 2);
        return -EINVAL;
    }
    t->n_vocab = (int32_t)toks->n;
    if ((rc = read_types(t, g)) || (rc = read_specials(t, g)))
        return rc;
    size_t longest = 0;
    for (int32_t i = 0; i < t->n_vocab; i++)
        longest = toks->strs[i].len > longest ? toks->strs[i].len : longest;
    char *scratch = malloc(longest + 1);
    if (!scratch)
        return -ENOMEM;
    rc = build_vocab(t, toks, scratch);
    free(scratch);
    if (rc || (rc = build_bytes(t)) || (rc = build_merges(t, merges)) ||
        (rc = build_special(t)) || (rc = build_regex(t)))
        return rc;
    build_eog(t);
    return 0;
}

struct tokenizer *tokenizer_create(const struct tokenizer_config *cfg)
{
    ASSERT(cfg && cfg->gguf);
    struct tokenizer *t = calloc(1, sizeof(*t));
    if (!t) {
        log_error("tokenizer: out of memory");
        return NULL;
    }
    t->eos = t->eot = t->bos = t->pad = -1;
    byte_level_init(t->cp_byte);
    int rc = tokenizer_build(t, cfg->gguf);
    if (rc) {
        if (rc == -ENOMEM)
            log_error("tokenizer: out of memory building the vocabulary");
        tokenizer_destroy(t);
        return NULL;
    }
    return t;
}

void tokenizer_destroy(struct tokenizer *t)
{
    if (!t)
        return;
    pcre2_code_free(t->re);
    free(t->by_byte);
    free(t->special);
    free(t->pair_map);
    free(t->sym_map);
    str_table_free(&t->sym);
    str_table_free(&t->tok);
    free(t->type);
    free(t);
}

/* ---------------------------------------------------------------------------------------- */
/* Encode                                                                                    */

/* Per-call state of one encode: the output and the scratch of the merge loop. */
/* A piece already encoded in this call: its ids are c->ids[ids_off .. ids_off + n_ids). */
struct piece_slot {
    const uint8_t *p; /* the piece in the caller's text; NULL when the slot is empty */
    uint32_t len;     /* bytes */
    uint32_t hash;    /* hash_bytes of the piece */
    size_t ids_off;   /* first id in the output */
    size_t n_ids;     /* ids */
};

struct encode_ctx {
    const struct tokenizer *t;
    int32_t *ids;       /* output */
    size_t n_ids;       /* ids written */
    size_t cap_ids;     /* ids allocated */
    size_t cap_piece;   /* bytes the arrays below can hold */
    int32_t *sym;       /* symbol id per start position */
    uint32_t *len;      /* symbol length in bytes, 0 once merged away */
    int32_t *prev;      /* previous live symbol start, -1 at the start */
    int32_t *next;      /* next live symbol start, n at the end */
    struct bpe_cand *heap; /* candidate merges, 3 per byte */
    size_t n_heap;      /* entries in heap */
    pcre2_match_data *md; /* match data of this call */
    struct piece_slot *cache; /* pieces seen in this call (text repeats its words) */
    uint32_t cache_mask;      /* cache capacity - 1; 0 while there is no cache */
    uint32_t cache_used;      /* occupied slots */
};

#define PIECE_CACHE_MAX_LEN 64   /* longer pieces are rare and not cached, bytes */
#define PIECE_CACHE_MAX (1u << 20) /* the cache stops growing here, slots */

/* A candidate merge of the symbols starting at left and next[left]. */
struct bpe_cand {
    int32_t rank;   /* merge rank: lower merges first */
    int32_t left;   /* start of the left symbol: lower merges first on equal rank */
    uint32_t size;  /* bytes of both symbols when queued, to detect stale entries */
    int32_t result; /* merged symbol */
};

static int emit(struct encode_ctx *c, int32_t id)
{
    if (c->n_ids == c->cap_ids) {
        size_t cap = c->cap_ids * 2 + 64;
        int32_t *p = realloc(c->ids, cap * sizeof(*p));
        if (!p)
            return -ENOMEM;
        c->ids = p;
        c->cap_ids = cap;
    }
    c->ids[c->n_ids++] = id;
    return 0;
}

static int ensure_piece(struct encode_ctx *c, size_t n)
{
    if (n <= c->cap_piece)
        return 0;
    size_t cap = n > 2 * c->cap_piece ? n : 2 * c->cap_piece;
    if (cap > INT32_MAX / 4) {
        log_error("tokenizer: a pre-tokenizer piece of %zu bytes is too long", n);
        return -ENOMEM;
    }
    free(c->sym);
    free(c->len);
    free(c->prev);
    free(c->next);
    free(c->heap);
    c->sym = malloc(cap * sizeof(*c->sym));
    c->len = malloc(cap * sizeof(*c->len));
    c->prev = malloc(cap * sizeof(*c->prev));
    c->next = malloc(cap * sizeof(*c->next));
    c->heap = malloc(3 * cap * sizeof(*c->heap));
    c->cap_piece = cap;
    if (!c->sym || !c->len || !c->prev || !c->next || !c->heap) {
        c->cap_piece = 0;
        return -ENOMEM;
    }
    return 0;
}

static inline bool cand_less(const struct bpe_cand *a, const struct bpe_cand *b)
{
    return a->rank < b->rank || (a->rank == b->rank && a->left < b->left);
}

static void heap_push(struct encode_ctx *c, struct bpe_cand e)
{
    size_t i = c->n_heap++;
    while (i > 0) {
        size_t p = (i - 1) / 2;
        if (!cand_less(&e, &c->heap[p]))
            break;
        c->heap[i] = c->heap[p];
        i = p;
    }
    c->heap[i] = e;
}

static struct bpe_cand heap_pop(struct encode_ctx *c)
{
    struct bpe_cand top = c->heap[0], last = c->heap[--c->n_heap];
    size_t i = 0, n = c->n_heap;
    for (;;) {
        size_t k = 2 * i + 1;
        if (k >= n)
            break;
        if (k + 1 < n && cand_less(&c->heap[k + 1], &c->heap[k]))
            k++;
        if (!cand_less(&c->heap[k], &last))
            break;
        c->heap[i] = c->heap[k];
        i = k;
    }
    c->heap[i] = last;
    return top;
}

/* Queues the merge of the symbols at a and b = next[a], if the vocabulary has one. */
static void bpe_try(struct encode_ctx *c, int32_t a, int32_t b)
{
    const struct pair_slot *m = pair_find(c->t, c->sym[a], c->sym[b]);
    if (m)
        heap_push(c, (struct bpe_cand){m->rank, a, c->len[a] + c->len[b], m->result});
}

/* BPE of one pre-tokenizer piece; appends its ids. */
static int bpe_piece(struct encode_ctx *c, const uint8_t *p, size_t n)
{
    const struct tokenizer *t = c->t;
    if (n == 1)
        return emit(c, t->byte_tok[p[0]]);
    int rc = ensure_piece(c, n);
    if (rc)
        return rc;
    for (size_t i = 0; i < n; i++) {
        c->sym[i] = t->byte_sym[p[i]];
        c->len[i] = 1;
        c->prev[i] = (int32_t)i - 1;
        c->next[i] = (int32_t)i + 1;
    }
    c->n_heap = 0;
    for (size_t i = 0; i + 1 < n; i++)
        bpe_try(c, (int32_t)i, (int32_t)i + 1);
    while (c->n_heap) {
        struct bpe_cand e = heap_pop(c);
        int32_t a = e.left, b = c->next[a];
        if (c->len[a] == 0 || (size_t)b >= n || c->len[a] + c->len[b] != e.size)
            continue; /* stale: one side changed since the candidate was queued */
        c->sym[a] = e.result;
        c->len[a] = e.size;
        c->len[b] = 0;
        c->next[a] = c->next[b];
        if ((size_t)c->next[a] < n)
            c->prev[c->next[a]] = a;
        if (c->prev[a] >= 0)
            bpe_try(c, c->prev[a], a);
        if ((size_t)c->next[a] < n)
            bpe_try(c, a, c->next[a]);
    }
    for (size_t i = 0; i < n && !rc; i = (size_t)c->next[i]) {
        if (c->sym[i] < t->n_vocab) {
            rc = emit(c, c->sym[i]);
            continue;
        }
        for (size_t j = i; j < i + c->len[i] && !rc; j++)
            rc = emit(c, t->byte_tok[p[j]]); /* not a token: fall back to its bytes */
    }
    return rc;
}

static int cache_grow(struct encode_ctx *c)
{
    uint32_t cap = c->cache_mask ? (c->cache_mask + 1) * 2 : 1024;
    struct piece_slot *m = calloc(cap, sizeof(*m));
    if (!m)
        return -ENOMEM;
    for (uint32_t i = 0; c->cache_mask && i <= c->cache_mask; i++) {
        if (!c->cache[i].p)
            continue;
        uint32_t j = c->cache[i].hash & (cap - 1);
        while (m[j].p)
            j = (j + 1) & (cap - 1);
        m[j] = c->cache[i];
    }
    free(c->cache);
    c->cache = m;
    c->cache_mask = cap - 1;
    return 0;
}

/* bpe_piece() through the per-call cache: a piece seen before copies its earlier ids. */
static int bpe_piece_cached(struct encode_ctx *c, const uint8_t *p, size_t n)
{
    if (n < 2 || n > PIECE_CACHE_MAX_LEN)
        return bpe_piece(c, p, n);
    if (c->cache_used * 2 >= c->cache_mask && c->cache_mask + 1 < PIECE_CACHE_MAX &&
        cache_grow(c))
        return -ENOMEM;
    uint32_t h = hash_bytes((const char *)p, n), i = h & c->cache_mask;
    for (; c->cache[i].p; i = (i + 1) & c->cache_mask) {
        const struct piece_slot *sl = &c->cache[i];
        if (sl->hash != h || sl->len != n || memcmp(sl->p, p, n) != 0)
            continue;
        int rc = 0;
        for (size_t k = 0; k < sl->n_ids && !rc; k++)
            rc = emit(c, c->ids[sl->ids_off + k]);
        return rc;
    }
    size_t start = c->n_ids;
    int rc = bpe_piece(c, p, n);
    if (rc || c->cache_used * 2 >= c->cache_mask)
        return rc; /* a full cache (at PIECE_CACHE_MAX) just stops learning */
    c->cache[i] = (struct piece_slot){p, (uint32_t)n, h, start, c->n_ids - start};
    c->cache_used++;
    return 0;
}

/* Byte length of the UTF-8 character starting at s (1 for an invalid byte). */
static size_t char_len(const uint8_t *s, size_t n)
{
    size_t adv;
    enum utf8_status st = utf8_scan(s, n, &adv);
    return st == UTF8_VALID ? adv : 1;
}

/* Splits one fragment without special tokens into pieces and encodes each. */
static int encode_fragment(struct encode_ctx *c, const uint8_t *s, size_t n)
{
    size_t off = 0;
    uint32_t opts = 0;
    while (off < n) {
        int rc = pcre2_match(c->t->re, s, n, off, opts, c->md, NULL);
        if (rc == PCRE2_ERROR_JIT_STACKLIMIT && !(opts & PCRE2_NO_JIT)) {
            opts |= PCRE2_NO_JIT;
            continue;
        }
        if (rc == PCRE2_ERROR_NOMATCH)
            return bpe_piece_cached(c, s + off, n - off); /* trailing invalid UTF-8 */
        if (rc < 0) {
            PCRE2_UCHAR msg[256];
            pcre2_get_error_message(rc, msg, sizeof(msg));
            log_error("tokenizer: pre-tokenizer match at byte %zu failed: %s", off,
                      (const char *)msg);
            return -EIO;
        }
        const PCRE2_SIZE *ov = pcre2_get_ovector_pointer(c->md);
        size_t start = ov[0], end = ov[1];
        if (start > off && (rc = bpe_piece_cached(c, s + off, start - off)))
            return rc; /* invalid UTF-8 the regex skipped */
        if (end == start) /* cannot happen with these regexes; keep moving */
            end = start + char_len(s + start, n - start);
        if ((rc = bpe_piece_cached(c, s + start, end - start)))
            return rc;
        off = end;
    }
    return 0;
}

/* A special-token occurrence: text[pos .. pos + len(special[prio])). */
struct special_hit {
    size_t pos;   /* byte offset in the text */
    int32_t prio; /* index into t->special */
};

static int cmp_hit_prio(const void *pa, const void *pb)
{
    const struct special_hit *a = pa, *b = pb;
    if (a->prio != b->prio)
        return a->prio < b->prio ? -1 : 1;
    return a->pos < b->pos ? -1 : a->pos > b->pos;
}

static int cmp_hit_pos(const void *pa, const void *pb)
{
    const struct special_hit *a = pa, *b = pb;
    return a->pos < b->pos ? -1 : a->pos > b->pos;
}

static size_t special_len(const struct tokenizer *t, int32_t prio)
{
    int32_t id = t->special[prio];
    return t->tok.off[id + 1] - t->tok.off[id];
}

/* Every position where an eligible special token's text occurs. */
static int find_hits(const struct tokenizer *t, const uint8_t *s, size_t n, bool parse_special,
                     struct special_hit **hits, size_t *n_hits)
{
    size_t cap = 0;
    *hits = NULL;
    *n_hits = 0;
    for (size_t i = 0; i < n; i++) {
        for (int32_t k = t->by_byte_start[s[i]]; k < t->by_byte_start[s[i] + 1]; k++) {
            int32_t prio = t->by_byte[k], id = t->special[prio];
            size_t m = special_len(t, prio);
            if (!parse_special && t->type[id] != TOKENIZER_TOKEN_TYPE_USER_DEFINED)
                continue;
            if (m > n - i || memcmp(s + i, t->tok.bytes + t->tok.off[id], m) != 0)
                continue;
            if (*n_hits == cap) {
                cap = cap * 2 + 16;
                struct special_hit *h = realloc(*hits, cap * sizeof(*h));
                if (!h)
                    return -ENOMEM;
                *hits = h;
            }
            (*hits)[(*n_hits)++] = (struct special_hit){i, prio};
        }
    }
    return 0;
}

/* Keeps the hits llama.cpp's partition keeps: tokens in priority order, each taking its
 * leftmost occurrences that overlap nothing taken before. Returns the kept count, sorted by
 * position, or -ENOMEM. */
static long select_hits(const struct tokenizer *t, struct special_hit *h, size_t n_h, size_t n)
{
    uint8_t *taken = calloc(n, 1);
    if (!taken)
        return -ENOMEM;
    qsort(h, n_h, sizeof(*h), cmp_hit_prio);
    size_t kept = 0;
    for (size_t k = 0; k < n_h; k++) {
        size_t m = special_len(t, h[k].prio);
        if (memchr(taken + h[k].pos, 1, m))
            continue;
        memset(taken + h[k].pos, 1, m);
        h[kept++] = h[k];
    }
    free(taken);
    qsort(h, kept, sizeof(*h), cmp_hit_pos);
    return (long)kept;
}

static int encode_text(struct encode_ctx *c, const uint8_t *s, size_t n, bool parse_special)
{
    struct special_hit *h;
    size_t n_h;
    int rc = find_hits(c->t, s, n, parse_special, &h, &n_h);
    long kept = rc ? rc : n_h ? select_hits(c->t, h, n_h, n) : 0;
    size_t off = 0;
    for (long k = 0; k < kept && !rc; k++) {
        if (h[k].pos > off)
            rc = encode_fragment(c, s + off, h[k].pos - off);
        if (!rc)
            rc = emit(c, c->t->special[h[k].prio]);
        off = h[k].pos + special_len(c->t, h[k].prio);
    }
    if (kept < 0)
        rc = (int)kept;
    if (!rc && off < n)
        rc = encode_fragment(c, s + off, n - off);
    free(h);
    return rc;
}

int tokenizer_encode(const struct tokenizer *t, const char *text, size_t len, bool parse_special,
                     int32_t **ids, size_t *n_ids)
{
    ASSERT(t && ids && n_ids && (text || len == 0));
    struct encode_ctx c = {.t = t, .cap_ids = len / 3 + 16};
    c.ids = malloc(c.cap_ids * sizeof(*c.ids));
    c.md = pcre2_match_data_create_from_pattern(t->re, NULL);
    int rc = c.ids && c.md ? 0 : -ENOMEM;
    if (!rc)
        rc = encode_text(&c, (const uint8_t *)text, len, parse_special);
    pcre2_match_data_free(c.md);
    free(c.cache);
    free(c.sym);
    free(c.len);
    free(c.prev);
    free(c.next);
    free(c.heap);
    if (rc) {
        if (rc == -ENOMEM)
            log_error("tokenizer: out of memory encoding %zu bytes", len);
        free(c.ids);
        *ids = NULL;
        *n_ids = 0;
        return rc;
    }
    *ids = c.ids;
    *n_ids = c.n_ids;
    return 0;
}

/* ---------------------------------------------------------------------------------------- */
/* Tokens and accessors                                                                      */

int tokenizer_token_bytes(const struct tokenizer *t, int32_t id, char *buf, size_t cap,
                          size_t *len)
{
    if (id < 0 || id >= t->n_vocab) {
        log_error("tokenizer: token id %d is outside the vocabulary (%d)", id, t->n_vocab);
        return -EINVAL;
    }
    const char *p = str_at(&t->tok, id, len);
    if (*len > cap)
        return -ENOSPC;
    memcpy(buf, p, *len);
    return 0;
}

int32_t tokenizer_n_vocab(const struct tokenizer *t)
{
    return t->n_vocab;
}

enum tokenizer_pre tokenizer_pre(const struct tokenizer *t)
{
    return t->pre;
}

int32_t tokenizer_eos(const struct tokenizer *t)
{
    return t->eos;
}

int32_t tokenizer_eot(const struct tokenizer *t)
{
    return t->eot;
}

int32_t tokenizer_bos(const struct tokenizer *t)
{
    return t->bos;
}

int32_t tokenizer_pad(const struct tokenizer *t)
{
    return t->pad;
}

bool tokenizer_add_bos(const struct tokenizer *t)
{
    return t->add_bos;
}

enum tokenizer_token_type tokenizer_token_type(const struct tokenizer *t, int32_t id)
{
    ASSERT(id >= 0 && id < t->n_vocab);
    return (enum tokenizer_token_type)t->type[id];
}

bool tokenizer_is_eog(const struct tokenizer *t, int32_t id)
{
    for (int i = 0; i < t->n_eog; i++)
        if (t->eog[i] == id)
            return true;
    return false;
}

int32_t tokenizer_find(const struct tokenizer *t, const char *text)
{
    size_t n = strlen(text);
    for (int32_t k = 0; k < t->n_special; k++) {
        size_t m;
        const char *p = str_at(&t->tok, t->special[k], &m);
        if (m == n && memcmp(p, text, n) == 0)
            return t->special[k];
    }
    char *raw = malloc(n + 1);
    size_t nr;
    int32_t id = -1;
    if (raw && byte_level_decode(t->cp_byte, text, n, raw, &nr) && nr > 0)
        id = sym_lookup(t, raw, nr);
    free(raw);
    return id < t->n_vocab ? id : -1;
}

/* ---------------------------------------------------------------------------------------- */
/* Streaming detokenizer                                                                     */

struct detok {
    const struct tokenizer *tok; /* borrowed vocabulary */
    bool skip_control;           /* CONTROL tokens produce no text */
    uint8_t pend[4];             /* incomplete UTF-8 sequence held back */
    size_t n_pend;               /* bytes in pend (0..3) */
    uint8_t *in;                 /* pend + the pushed token's bytes */
    char *out;                   /* chunk returned by the last call: 3 bytes per byte of in */
    size_t cap;                  /* bytes allocated at in (out has 3 * cap) */
};

struct detok *detok_create(const struct detok_config *cfg)
{
    ASSERT(cfg && cfg->tok);
    struct detok *d = calloc(1, sizeof(*d));
    if (!d) {
        log_error("detok: out of memory");
        return NULL;
    }
    d->tok = cfg->tok;
    d->skip_control = cfg->skip_control;
    return d;
}

void detok_destroy(struct detok *d)
{
    if (!d)
        return;
    free(d->in);
    free(d->out);
    free(d);
}

/* Makes room for n input bytes. */
static int detok_reserve(struct detok *d, size_t n)
{
    if (n <= d->cap)
        return 0;
    size_t cap = n > 2 * d->cap ? n : 2 * d->cap;
    uint8_t *in = realloc(d->in, cap);
    if (in)
        d->in = in;
    char *out = in ? realloc(d->out, 3 * cap) : NULL;
    if (!out) {
        log_error("detok: out of memory for a %zu-byte chunk", 3 * cap);
        return -ENOMEM;
    }
    d->out = out;
    d->cap = cap;
    return 0;
}

/* Turns pend + s into complete UTF-8 at d->out and returns its length; an incomplete tail is
 * held back in pend, or with final becomes U+FFFD. */
static size_t detok_feed(struct detok *d, const uint8_t *s, size_t n, bool final)
{
    size_t m = d->n_pend + n, k = 0;
    memcpy(d->in, d->pend, d->n_pend);
    if (n)
        memcpy(d->in + d->n_pend, s, n);
    d->n_pend = 0;
    for (size_t i = 0; i < m;) {
        size_t adv;
        enum utf8_status st = utf8_scan(d->in + i, m - i, &adv);
        if (st == UTF8_INCOMPLETE && !final) {
            memcpy(d->pend, d->in + i, adv);
            d->n_pend = adv;
            break;
        }
        if (st == UTF8_VALID) {
            memcpy(d->out + k, d->in + i, adv);
            k += adv;
        } else {
            memcpy(d->out + k, "\xEF\xBF\xBD", 3);
            k += 3;
        }
        i += adv;
    }
    return k;
}

int detok_push(struct detok *d, int32_t id, const char **out, size_t *out_len)
{
    const struct tokenizer *t = d->tok;
    *out = "";
    *out_len = 0;
    if (id < 0 || id >= t->n_vocab) {
        log_error("detok: token id %d is outside the vocabulary (%d)", id, t->n_vocab);
        return -EINVAL;
    }
    if (d->skip_control && t->type[id] == TOKENIZER_TOKEN_TYPE_CONTROL)
        return 0;
    if (t->type[id] == TOKENIZER_TOKEN_TYPE_UNUSED) /* "[PAD123]" fillers have no text */
        return 0;
    size_t n;
    const char *s = str_at(&t->tok, id, &n);
    if (detok_reserve(d, n + d->n_pend + 1))
        return -ENOMEM;
    *out_len = detok_feed(d, (const uint8_t *)s, n, false);
    *out = d->out;
    return 0;
}

int detok_flush(struct detok *d, const char **out, size_t *out_len)
{
    *out = "";
    *out_len = 0;
    if (detok_reserve(d, d->n_pend + 1))
        return -ENOMEM;
    *out_len = detok_feed(d, NULL, 0, true);
    *out = d->out;
    return 0;
}
