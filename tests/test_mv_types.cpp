/*
 * test_mv_types: the f32-activation products' weight decoders (kernels/cuda/mv_types.cuh)
 * run on the host against the CPU's dequantization (model/quant.c), type by type, without a
 * GPU. For each type: rows of whole 256-element groups (quantized from random floats where
 * quant.c quantizes the type, else random bytes with finite scales), every group decoded by
 * the 32 lanes as matvec.cu's kernel does (the aligned and the unaligned word reads), each
 * lane's unit turned into element values as unit_dot weighs them (PLAIN: q; SAME: FIN sa
 * (q + K); MIN: FIN (s q + c); else FIN s (q + K) per run), and checked: the 32 units cover
 * the group's 256 elements once each, and every value is within 2e-6 of the largest magnitude
 * of its group from the dequantized one (the levels trick's cancellation costs a few ulps).
 */
#include <math.h>
#include <stdlib.h>

#include "kernels/cuda/mv_types.cuh"

extern "C" {
#include "model/quant.h"
}
#include "tests/check.h"

using namespace mv;

namespace {

constexpr int kGroups = 6; /* groups a row */

uint32_t rnd(uint64_t *s)
{
    *s = *s * 6364136223846793005ull + 1442695040888963407ull;
    return static_cast<uint32_t>(*s >> 33);
}

float unif(uint64_t *s, float lo, float hi)
{
    return lo + (hi - lo) * static_cast<float>(rnd(s) & 0xFFFFFF) / 16777216.0f;
}

/* A finite half in +-[lo, hi] (the sign random where neg) at p. */
void put_half(uint8_t *p, uint64_t *s, float lo, float hi, bool neg)
{
    float v = unif(s, lo, hi);
    if (neg && (rnd(s) & 1))
        v = -v;
    const uint16_t h = quant_f32_to_f16(v);
    memcpy(p, &h, 2);
}

/* The value of lane l's element i (0..7: run A's four, then run B's) of unit u. */
template <class T>
float elem(const Unit &u, int i)
{
    const bool a = i < 4;
    const float q = u.q[i];
    if (T::PLAIN)
        return q;
    if (T::SAME)
        return T::FIN * (u.sa * (q + T::K));
    if (T::MIN)
        return T::FIN * ((a ? u.sa : u.sb) * q + (a ? u.ca : u.cb));
    return T::FIN * ((a ? u.sa : u.sb) * (q + T::K));
}

/* One row of the type in buf (kGroups groups): quantized from random floats where quant.c
 * can, else random bytes whose half-precision scales fix() makes finite. */
template <class T>
void make_row(uint32_t type, uint8_t *buf, uint64_t *s, void (*fix)(uint8_t *, uint64_t *))
{
    const size_t bytes = static_cast<size_t>(kGroups) * T::GB;
    if (!fix) {
        float x[kGroups * 256];
        const float scale = unif(s, 0.01f, 4.0f);
        for (int i = 0; i < kGroups * 256; i++)
            x[i] = unif(s, -scale, scale) * (rnd(s) % 17 == 0 ? 8.0f : 1.0f);
        CHECK(quant_quantize_row(type, x, buf, kGroups * 256) == 0, "quantize %s",
              quant_type_name(type));
        return;
    }
    for (size_t i = 0; i < bytes; i++)
        buf[i] = static_cast<uint8_t>(rnd(s));
    for (int b = 0; b < kGroups * 256 / T::EE; b++)
        fix(buf + static_cast<size_t>(b) * T::EB, s);
}

template <class T>
void check_type(uint32_t type, void (*fix)(uint8_t *, uint64_t *))
{
    static_assert(T::GB % T::EB == 0, "a group is whole blocks");
    uint64_t s = 0x9E3779B97F4A7C15ull ^ type;
    /* 4-byte aligned base; groups of a GB that is no multiple of 4 start misaligned */
    alignas(16) static uint8_t buf[kGroups * 1024 + 64];
    float ref[kGroups * 256];
    double worst = 0;
    int bad = 0, rows = 0;
    for (int r = 0; r < 40; r++, rows++) {
        make_row<T>(type, buf, &s, fix);
        CHECK(quant_dequantize_row(type, buf, ref, kGroups * 256) == 0, "dequantize %s",
              quant_type_name(type));
        for (int gi = 0; gi < kGroups; gi++) {
            const uint8_t *g = buf + static_cast<size_t>(gi) * T::GB;
            const float *rg = ref + gi * 256;
            float mag = 0;
            for (int i = 0; i < 256; i++)
                mag = fmaxf(mag, fabsf(rg[i]));
            int seen[256] = {0};
            for (int al = 0; al < 2; al++) {
                const bool aligned = (reinterpret_cast<uintptr_t>(g) & 3) == 0;
                if (al && !aligned)
                    continue; /* unit<true> needs a 4-byte aligned group */
                for (int l = 0; l < 32; l++) {
                    Unit u;
                    memset(&u, 0, sizeof(u));
                    if (al)
                        T::template unit<true>(g, l, u);
                    else
                        T::template unit<false>(g, l, u);
                    for (int i = 0; i < 8; i++) {
                        const int at = T::pa(l) + (i < 4 ? i : T::DPB + i - 4);
                        if (at < 0 || at >= 256) {
                            bad++;
                            continue;
                        }
                        seen[at] += !al;
                        const double d = fabs(static_cast<double>(elem<T>(u, i)) - rg[at]);
                        worst = fmax(worst, mag > 0 ? d / mag : d);
                        if (!(d <= 2e-6 * mag) && bad++ < 5)
                            fprintf(stderr, "%s row %d group %d lane %d element %d (%s reads): "
                                    "%.9g, dequantized %.9g\n", quant_type_name(type), r, gi, l,
                                    at, al ? "aligned" : "unaligned", elem<T>(u, i), rg[at]);
                    }
                }
            }
            for (int i = 0; i < 256; i++)
                if (seen[i] != 1 && bad++ < 5)
                    fprintf(stderr, "%s: element %d of a group is decoded by %d lanes\n",
                            quant_type_name(type), i, seen[i]);
        }
    }
    CHECK(bad == 0, "%s: %d decoded elements differ from quant.c's (worst %.3g of the group's "
          "largest)", quant_type_name(type), bad, worst);
    MEASURE("%s: %d rows of %d groups, every lane's unit within %.3g of the group's largest "
            "magnitude from quant.c's dequantization", quant_type_name(type), rows, kGroups, worst);
}

/* Finite half-precision scales for blocks of random bytes. */
void fix_q2_k(uint8_t *b, uint64_t *s)
{
    put_half(b + 80, s, 0.001f, 2.0f, true);
    put_half(b + 82, s, 0.001f, 2.0f, true);
}

void fix_q3_k(uint8_t *b, uint64_t *s)
{
    put_half(b + 108, s, 0.001f, 2.0f, true);
}

void fix_iq4(uint8_t *b, uint64_t *s)
{
    put_half(b, s, 0.001f, 2.0f, true);
}

} /* namespace */

int main(void)
{
    check_type<TQ8_0>(QUANT_TYPE_Q8_0, nullptr);
    check_type<TQ4_0>(QUANT_TYPE_Q4_0, nullptr);
    check_type<TQ4_K>(QUANT_TYPE_Q4_K, nullptr);
    check_type<TQ5_K>(QUANT_TYPE_Q5_K, nullptr);
    check_type<TQ6_K>(QUANT_TYPE_Q6_K, nullptr);
    check_type<TF16>(QUANT_TYPE_F16, nullptr);
    check_type<TBF16>(QUANT_TYPE_BF16, nullptr);
    check_type<TF32>(QUANT_TYPE_F32, nullptr);
    check_type<TQ4_1>(QUANT_TYPE_Q4_1, nullptr);
    check_type<TQ5_0>(QUANT_TYPE_Q5_0, nullptr);
    check_type<TQ5_1>(QUANT_TYPE_Q5_1, nullptr);
    check_type<TIQ4_NL>(QUANT_TYPE_IQ4_NL, fix_iq4);
    check_type<TIQ4_XS>(QUANT_TYPE_IQ4_XS, fix_iq4);
    check_type<TQ2_K>(QUANT_TYPE_Q2_K, fix_q2_k);
    check_type<TQ3_K>(QUANT_TYPE_Q3_K, fix_q3_k);
    return test_main_result("test_mv_types");
}
