/*
 * tokenizer: the byte-level BPE vocabulary of a GGUF file (model-spec section 7), with encode,
 * per-token bytes and a streaming UTF-8 detokenizer.
 *
 * Built from the tokenizer.ggml.* keys of any GGUF (vocab-only files of any architecture too).
 * The keys are untrusted: tokenizer_create() checks the model name ("gpt2"), the pre-tokenizer
 * name, the types and lengths of the token, token_type and merges arrays and the special ids, and
 * rejects a bad file with one error line naming the key. The tokenizer copies what it needs: the
 * gguf may be closed after create.
 *
 * Encoding follows llama.cpp's gpt2/BPE path: special tokens (types CONTROL, USER_DEFINED,
 * UNKNOWN) are split out first, longest text first across the whole text; each remaining
 * fragment is split by the pre-tokenizer regex of model-spec 7.3 (PCRE2, UTF + UCP, JIT when
 * available); each piece is merged by BPE (lowest merge rank first, leftmost on ties), and a
 * final symbol that is not a token falls back to its single-byte tokens. Input bytes that are
 * not valid UTF-8 are never matched by the regex; each run of them becomes its own piece, so
 * every input byte is encoded (llama.cpp would substitute U+FFFD there instead).
 *
 * Threading: after create, every function taking a const tokenizer may be called from any
 * number of threads at once (each call uses its own scratch). A detok belongs to one thread.
 */
#ifndef MODEL_TOKENIZER_H
#define MODEL_TOKENIZER_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

struct gguf;

/* tokenizer.ggml.token_type values. */
enum tokenizer_token_type {
    TOKENIZER_TOKEN_TYPE_UNDEFINED = 0,
    TOKENIZER_TOKEN_TYPE_NORMAL = 1,
    TOKENIZER_TOKEN_TYPE_UNKNOWN = 2,
    TOKENIZER_TOKEN_TYPE_CONTROL = 3,
    TOKENIZER_TOKEN_TYPE_USER_DEFINED = 4,
    TOKENIZER_TOKEN_TYPE_UNUSED = 5,
    TOKENIZER_TOKEN_TYPE_BYTE = 6,
};

/* Pre-tokenizer regex families (tokenizer.ggml.pre). */
enum tokenizer_pre {
    TOKENIZER_PRE_QWEN2 = 0,  /* qwen2, deepseek-r1-qwen, kormo, f2llmv2 */
    TOKENIZER_PRE_QWEN35 = 1, /* qwen35: adds \p{M} to the letter classes */
};

struct tokenizer_config {
    const struct gguf *gguf; /* borrowed for the duration of tokenizer_create() only */
};

struct tokenizer;

/* Reads and validates the tokenizer keys, builds the vocabulary, the merge-rank table and the
 * special-token list, and compiles the pre-tokenizer regex. Returns an owned tokenizer, or NULL
 * after logging which key is bad (or that memory ran out). Takes well under a second for a
 * 151k-token, 151k-merge vocabulary. */
struct tokenizer *tokenizer_create(const struct tokenizer_config *cfg);

/* Frees everything; accepts NULL. */
void tokenizer_destroy(struct tokenizer *t);

/* Encodes len bytes of text (need not be NUL-terminated, may hold NUL bytes). With
 * parse_special, CONTROL and UNKNOWN token texts in the text become their ids; USER_DEFINED
 * token texts always do. No BOS/EOS is added (see tokenizer_add_bos()). On success *ids is a
 * malloc'd array of *n_ids ids that the caller frees (non-NULL even when *n_ids is 0).
 * Returns 0, -ENOMEM, or -EIO when the regex engine fails (logged). */
int tokenizer_encode(const struct tokenizer *t, const char *text, size_t len, bool parse_special,
                     int32_t **ids, size_t *n_ids);

/* Copies the raw bytes of token id into buf: the byte-level text decoded back to bytes for
 * ordinary tokens, the literal text for CONTROL, USER_DEFINED and UNKNOWN tokens (and for any
 * token whose text is not in byte-level form). *len receives the byte count even when it does
 * not fit. Returns 0, -EINVAL for an id outside the vocabulary, -ENOSPC when cap < *len. */
int tokenizer_token_bytes(const struct tokenizer *t, int32_t id, char *buf, size_t cap,
                          size_t *len);

/* Accessors. Ids are -1 when the file does not name them. */
int32_t tokenizer_n_vocab(const struct tokenizer *t);
enum tokenizer_pre tokenizer_pre(const struct tokenizer *t);
int32_t tokenizer_eos(const struct tokenizer *t); /* tokenizer.ggml.eos_token_id */
/* tokenizer.ggml.eot_token_id, else the id of <|im_end|> when present. */
int32_t tokenizer_eot(const struct tokenizer *t);
int32_t tokenizer_bos(const struct tokenizer *t); /* tokenizer.ggml.bos_token_id */
int32_t tokenizer_pad(const struct tokenizer *t); /* tokenizer.ggml.padding_token_id */
bool tokenizer_add_bos(const struct tokenizer *t); /* tokenizer.ggml.add_bos_token, default false */
/* Type of token id (NORMAL when the file has no token_type array); ASSERTs a valid id. */
enum tokenizer_token_type tokenizer_token_type(const struct tokenizer *t, int32_t id);
/* True when id ends generation: eos, eot, and <|endoftext|>, <|im_end|>, <|fim_pad|>,
 * <|repo_name|>, <|file_sep|> when the vocabulary has them. False for ids out of range. */
bool tokenizer_is_eog(const struct tokenizer *t, int32_t id);
/* Id of the token whose text (in the file's form) is exactly text, or -1. */
int32_t tokenizer_find(const struct tokenizer *t, const char *text);

/* detok: turns a stream of ids into text whose every chunk is complete, valid UTF-8. */
struct detok_config {
    const struct tokenizer *tok; /* borrowed; must outlive the detok */
    bool skip_control;           /* drop CONTROL tokens' text (default false: emit it) */
};

struct detok;

/* Returns an owned detok, or NULL (logged) when memory runs out. */
struct detok *detok_create(const struct detok_config *cfg);
void detok_destroy(struct detok *d); /* accepts NULL */

/* Appends token id and sets *out / *out_len to the bytes that are now complete UTF-8 (possibly
 * none; UNUSED tokens, the converter's "[PAD<id>]" fillers, produce none, as in llama.cpp).
 * An incomplete sequence at the end is held back for the next push; bytes that can never
 * become valid UTF-8 are replaced by U+FFFD (one per maximal invalid subpart). *out is borrowed
 * until the next call on this detok. Returns 0, -EINVAL for an id outside the vocabulary, or
 * -ENOMEM. */
int detok_push(struct detok *d, int32_t id, const char **out, size_t *out_len);

/* Emits whatever is held back (an incomplete sequence becomes U+FFFD) and resets the detok for
 * a new stream. *out is borrowed as for detok_push(). Returns 0 or -ENOMEM. */
int detok_flush(struct detok *d, const char **out, size_t *out_len);

#endif
