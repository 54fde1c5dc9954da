/*
 * quant: the ggml tensor types, their block formats, and conversion between
 * them and f32 (model-spec section 2).
 *
 * Pure functions, callable from any thread. A "row" is n elements along ne[0];
 * n must be a multiple of the type's block size (callers check with
 * quant_row_size(), which returns 0 when it is not).
 */
#ifndef MODEL_QUANT_H
#define MODEL_QUANT_H

#include <stdbool.h>
#include <stddef.h>
#include <stdint.h>

/* ggml_type ids as stored in GGUF tensor-info records. */
enum quant_type {
    QUANT_TYPE_F32 = 0,
    QUANT_TYPE_F16 = 1,
    QUANT_TYPE_Q4_0 = 2,
    QUANT_TYPE_Q4_1 = 3,
    QUANT_TYPE_Q5_0 = 6,
    QUANT_TYPE_Q5_1 = 7,
    QUANT_TYPE_Q8_0 = 8,
    QUANT_TYPE_Q8_1 = 9,
    QUANT_TYPE_Q2_K = 10,
    QUANT_TYPE_Q3_K = 11,
    QUANT_TYPE_Q4_K = 12,
    QUANT_TYPE_Q5_K = 13,
    QUANT_TYPE_Q6_K = 14,
    QUANT_TYPE_Q8_K = 15,
    QUANT_TYPE_IQ2_XXS = 16,
    QUANT_TYPE_IQ2_XS = 17,
    QUANT_TYPE_IQ3_XXS = 18,
    QUANT_TYPE_IQ1_S = 19,
    QUANT_TYPE_IQ4_NL = 20,
    QUANT_TYPE_IQ3_S = 21,
    QUANT_TYPE_IQ2_S = 22,
    QUANT_TYPE_IQ4_XS = 23,
    QUANT_TYPE_I8 = 24,
    QUANT_TYPE_I16 = 25,
    QUANT_TYPE_I32 = 26,
    QUANT_TYPE_I64 = 27,
    QUANT_TYPE_F64 = 28,
    QUANT_TYPE_IQ1_M = 29,
    QUANT_TYPE_BF16 = 30,
    QUANT_TYPE_TQ1_0 = 34,
    QUANT_TYPE_TQ2_0 = 35,
    QUANT_TYPE_MXFP4 = 39,
    QUANT_TYPE_NVFP4 = 40,
    QUANT_TYPE_Q1_0 = 41,
    QUANT_TYPE_Q2_0 = 42,
    QUANT_TYPE_COUNT = 43, /* one past the largest id known */
};

/* Name of a type id ("Q4_K"), or NULL when the id is not a ggml type. */
const char *quant_type_name(uint32_t type);

/* llama.cpp's name of a file's mixture, the GGUF key general.file_type (a
 * llama_ftype: 15 "Q4_K - Medium"), or NULL for one not known here. */
const char *quant_ftype_name(uint32_t ftype);

/* Elements per block and bytes per block; 0 when the id is unknown. */
uint32_t quant_block_elems(uint32_t type);
uint32_t quant_block_bytes(uint32_t type);

/* True when lamina can dequantize this type (the list of issue 2). */
bool quant_is_supported(uint32_t type);

/* Bytes of a row of n elements; 0 when the type is unknown or n is not a
 * multiple of its block size. */
size_t quant_row_size(uint32_t type, uint64_t n);

/* IEEE half and bfloat16 conversions (round to nearest even). */
float quant_f16_to_f32(uint16_t h);
uint16_t quant_f32_to_f16(float f);
float quant_bf16_to_f32(uint16_t h);
uint16_t quant_f32_to_bf16(float f);

/* Dequantizes one row of n elements of a supported type from src (GGUF block
 * bytes, any alignment) into dst. Returns 0, or -EINVAL for an unsupported
 * type or a bad n. */
int quant_dequantize_row(uint32_t type, const void *src, float *dst, uint64_t n);

/* Quantizes one row of n finite f32 values into dst (quant_row_size bytes,
 * any alignment). Supported targets: F32, F16, BF16 (round to nearest even),
 * Q8_0, Q4_0, Q4_1, Q5_0, Q5_1 (llama.cpp's reference rounding), Q4_K, Q5_K,
 * Q6_K (our own scale search, close to llama.cpp's reference quality).
 * Returns 0, or -EINVAL for another type or a bad n. */
int quant_quantize_row(uint32_t type, const float *src, void *dst, uint64_t n);

#endif
