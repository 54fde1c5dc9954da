/*
 * inspect: the report `lamina inspect FILE` prints about one GGUF file.
 *
 * The report shows the container (version, size, alignment, data offset), the
 * architecture, the metadata (general.* first, then {arch}.*, then the rest;
 * arrays abbreviated to type, length and first elements, tokenizer arrays only
 * summarised), the tensor table, and tensor bytes by category: embeddings
 * (token_embd*), output (output.weight, output_norm*), per-layer trunk
 * (blk.N.* that are not experts), routed experts (blk.N.ffn_{gate,up,down,
 * gate_up}_exps*), shared experts (blk.N.*_shexp*) and other, with a per-layer
 * table. Byte counts are printed both exactly and in binary units.
 *
 * Pure functions over a validated gguf; callable from any thread.
 */
#ifndef MODEL_INSPECT_H
#define MODEL_INSPECT_H

#include <stdint.h>
#include <stdio.h>

#include "model/gguf.h"

/* What a tensor is, for the byte breakdown. */
enum inspect_category {
    INSPECT_CATEGORY_EMBEDDINGS = 0, /* token_embd* */
    INSPECT_CATEGORY_OUTPUT = 1,     /* output.*, output_norm.* */
    INSPECT_CATEGORY_TRUNK = 2,      /* blk.N.* that are not experts */
    INSPECT_CATEGORY_EXPERTS = 3,    /* blk.N.ffn_{gate,up,down,gate_up}_exps.* */
    INSPECT_CATEGORY_SHARED = 4,     /* blk.N.*_shexp.* */
    INSPECT_CATEGORY_OTHER = 5,      /* everything else */
    INSPECT_CATEGORY_COUNT = 6,
};

/* Tensor bytes of a file, by category. */
struct inspect_bytes {
    uint64_t by_category[INSPECT_CATEGORY_COUNT]; /* bytes */
    uint64_t total;                               /* bytes of all tensors */
    uint32_t n_layers;                            /* 1 + the largest N in blk.N. names */
};

/* Category of a tensor name; sets *layer to N for blk.N.* names (N < 65536),
 * else to -1. layer may be NULL. */
enum inspect_category inspect_categorize(const char *name, int32_t *layer);

/* Short label of a category ("routed experts"), as printed in the report. */
const char *inspect_category_name(enum inspect_category c);

/* Sums every tensor's nbytes into its category. */
void inspect_count_bytes(const struct gguf *g, struct inspect_bytes *out);

/* Writes the whole report to out. Returns 0, -ENOMEM (logged) when the
 * per-layer table cannot be allocated, or -EIO (logged) when writing fails. */
int inspect_print(const struct gguf *g, FILE *out);

#endif
