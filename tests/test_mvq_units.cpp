/*
 * test_mvq_units: the int8 decode products' weight units (kernels/cuda/mvq.cuh: load_block,
 * unit_x, unit_dot) run on the host, type by type, without a GPU. For Q4_0, Q8_0, Q4_K, Q5_K
 * and Q6_K: rows of random floats quantized by quant.c, activations rounded per block of 32 as
 * the kernels round them (tests/gpu/xq_check.h's xq_round: round_levels' expressions), and
 * each row's units walked as a kernel's lanes walk them (every unit once, the words read from
 * the row as stored, at a 4-byte aligned base and at a 2-byte offset, where a Q4_K or Q5_K
 * unit is read byte by byte; every other Q6_K super-block is 2-byte aligned either way). Checked:
 * the row's sum of unit dots (n / (32 XB) of them) is within 1e-5 of sum |w_i x_i| of the
 * exact dot of the dequantized row with the rounded activations. A wrong nibble order,
 * high-bit shift, scale or min decode, or sub-block pairing is off by far more.
 */
#include <math.h>
#include <stdlib.h>
#include <string.h>

#include "kernels/cuda/mvq.cuh"

extern "C" {
#include "model/quant.h"
}
#include "tests/check.h"
#include "tests/gpu/xq_check.h"

namespace {

uint32_t rnd(uint64_t *s)
{
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<uint32_t>(*s >> 33);
}

float unif(uint64_t *s, float lo, float hi)
{
    return lo + (hi - lo) * static_cast<float>(rnd(s) & 0xFFFFFF) / 16777216.0f;
}

/* One type: rows rows of n, each at offsets 0, 2, 4 and 6 from a 16-byte boundary; returns
 * the largest error relative to sum |w x|. */
template <int TYPE>
double check_type(uint32_t n, int rows, uint64_t *seed)
{
    constexpr int XB = mvq::Blk<TYPE>::XB;
    const size_t rb = quant_row_size(TYPE, n);
    /* 16-byte aligned room for the row at offset 0, 2, 4 or 6, plus slack */
    uint8_t *buf = static_cast<uint8_t *>(aligned_alloc(16, (rb + 32 + 15) / 16 * 16));
    float *x = static_cast<float *>(malloc(n * sizeof(float)));
    float *w = static_cast<float *>(malloc(n * sizeof(float)));
    float *xs = static_cast<float *>(malloc(n * sizeof(float)));
    /* the rounded row in the kernels' layout (xq_round): n levels, n / 32 scales, n / 32
     * scale x level sums */
    uint8_t *xq = static_cast<uint8_t *>(aligned_alloc(16, n + 8 * (n / 32)));
    const int8_t *q = reinterpret_cast<const int8_t *>(xq);
    const float *d = reinterpret_cast<const float *>(xq + n), *sm = d + n / 32;
    double worst = 0.0;
    for (int r = 0; r < rows; r++) {
        const float scale = unif(seed, 0.01f, 4.0f);
        for (uint32_t i = 0; i < n; i++) {
            xs[i] = unif(seed, -scale, scale) * (rnd(seed) % 17 == 0 ? 8.0f : 1.0f);
            x[i] = unif(seed, -3.0f, 3.0f) * (rnd(seed) % 29 == 0 ? 10.0f : 1.0f);
        }
        xq_round(x, xq, n);
        float got0 = 0.0f; /* the row at offset 0 */
        for (int off = 0; off <= 6; off += 2) {
            uint8_t *row = buf + off;
            memset(buf, 0xA5, rb + 32);
            CHECK(quant_quantize_row(TYPE, xs, row, n) == 0, "quantize %s", quant_type_name(TYPE));
            CHECK(quant_dequantize_row(TYPE, row, w, n) == 0, "dequantize %s",
                  quant_type_name(TYPE));
            double exact = 0.0, mag = 0.0;
            for (uint32_t i = 0; i < n; i++) {
                const double xq = static_cast<double>(q[i]) * static_cast<double>(d[i / 32]);
                exact += static_cast<double>(w[i]) * xq;
                mag += fabs(static_cast<double>(w[i]) * xq);
            }
            const uint32_t nu = n / 32 / XB;
            float got = 0.0f;
            for (uint32_t b = 0; b < nu; b++) {
                uint32_t v[mvq::Blk<TYPE>::WORDS], sh;
                mvq::load_block<TYPE>(row, b, v, &sh);
                got += mvq::unit_dot<TYPE>(v, sh, mvq::unit_x<TYPE>(q, d, sm, b));
            }
            const double err = fabs(static_cast<double>(got) - exact) / (mag + 1e-30);
            if (!(err <= 1e-5))
                CHECK(err <= 1e-5, "%s n %u row %d offset %d: units %.9g, exact %.9g (rel %.3g)",
                      quant_type_name(TYPE), n, r, off, static_cast<double>(got), exact, err);
            worst = err > worst || err != err ? err : worst;
            /* a 16-byte boundary (K types: 16-byte loads), 2 bytes past it (byte loads), 4
             * (word loads) and 6 (Q6_K's 8-byte loads from the word before the run): the same
             * words, the same sum */
            if (off == 0)
                got0 = got;
            else
                CHECK(got == got0, "%s n %u row %d: offset %d gives %.9g, offset 0 %.9g",
                      quant_type_name(TYPE), n, r, off, static_cast<double>(got),
                      static_cast<double>(got0));
        }
    }
    free(buf), free(x), free(w), free(xs), free(xq);
    return worst;
}

} /* namespace */

int main(void)
{
    uint64_t seed = 7;
    const uint32_t ns[] = {256, 512, 2048, 4096};
    for (uint32_t n : ns) {
        const double e0 = check_type<QUANT_TYPE_Q4_0>(n, 8, &seed);
        const double e8 = check_type<QUANT_TYPE_Q8_0>(n, 8, &seed);
        const double ek = check_type<QUANT_TYPE_Q4_K>(n, 8, &seed);
        const double e5 = check_type<QUANT_TYPE_Q5_K>(n, 8, &seed);
        const double e6 = check_type<QUANT_TYPE_Q6_K>(n, 8, &seed);
        MEASURE("units of rows of %u: max rel error Q4_0 %.3g, Q8_0 %.3g, Q4_K %.3g, Q5_K %.3g, "
                "Q6_K %.3g (rows at 16-byte boundaries, 2, 4 and 6 bytes past)", n, e0, e8, ek, e5,
                e6);
    }
    return test_main_result("test_mvq_units");
}
