/*
 * test_sampler: greedy and filtered sampling on inputs whose answers are exactly predictable,
 * seeded reproducibility, the empirical distribution against softmax (chi-square), and the
 * llama.cpp penalty rules; sampling with a given uniform and window (the last worker's twin)
 * against sampler_sample(). Measures the time of one sample on a 248k vocabulary.
 */
#include "model/sampler.h"

#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include "common/log.h"
#include "tests/check.h"

#define BIG_VOCAB 248320

static double now_s(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (double)ts.tv_sec + (double)ts.tv_nsec * 1e-9;
}

/* Deterministic pseudo-random logits in [-10, 10) (a test-local LCG, not the sampler's PRNG). */
static void fill_logits(float *l, int32_t n, uint32_t seed)
{
    uint32_t x = seed * 2654435761u + 1;
    for (int32_t i = 0; i < n; i++) {
        x = x * 1664525u + 1013904223u;
        l[i] = (float)(x >> 8) / (float)(1 << 24) * 20.0f - 10.0f;
    }
}

static int32_t argmax(const float *l, int32_t n)
{
    int32_t b = 0;
    for (int32_t i = 1; i < n; i++)
        if (l[i] > l[b])
            b = i;
    return b;
}

static struct sampler *make(float temp, int32_t top_k, float top_p, float min_p, uint64_t seed)
{
    struct sampler_config c = {.temperature = temp, .top_k = top_k, .top_p = top_p,
                               .min_p = min_p, .seed = seed};
    struct sampler *s = sampler_create(&c);
    CHECK(s, "sampler_create failed");
    if (!s)
        exit(1);
    return s;
}

/* Counts of n draws into hist[0 .. n_vocab). */
static void draws(struct sampler *s, const float *l, int32_t n_vocab, int n, int *hist)
{
    memset(hist, 0, (size_t)n_vocab * sizeof(*hist));
    for (int i = 0; i < n; i++) {
        int32_t id = sampler_sample(s, l, n_vocab);
        CHECK(id >= 0 && id < n_vocab, "draw %d gave %d", i, id);
        if (id >= 0 && id < n_vocab)
            hist[id]++;
    }
}

static void test_greedy(void)
{
    struct sampler *s = make(0, 0, 0, 0, 1);
    float ties[] = {1, 5, 3, 5, -2};
    CHECK(sampler_sample(s, ties, 5) == 1, "ties go to the lowest id");
    float nan_first[] = {NAN, 1, 2, NAN};
    CHECK(sampler_sample(s, nan_first, 4) == 2, "NaN never wins");
    float all_inf[] = {-INFINITY, -INFINITY, -INFINITY};
    CHECK(sampler_sample(s, all_inf, 3) == 0, "all -inf: id 0");
    float *l = malloc(BIG_VOCAB * sizeof(*l)), *copy = malloc(BIG_VOCAB * sizeof(*l));
    for (uint32_t k = 0; k < 5; k++) {
        fill_logits(l, BIG_VOCAB, k);
        memcpy(copy, l, BIG_VOCAB * sizeof(*l));
        int32_t want = argmax(l, BIG_VOCAB);
        CHECK(sampler_sample(s, l, BIG_VOCAB) == want, "greedy = argmax (seed %u)", k);
        CHECK(!memcmp(l, copy, BIG_VOCAB * sizeof(*l)), "logits unchanged");
    }
    sampler_destroy(s);

    /* top_k = 1 is greedy at any temperature */
    static const float temps[] = {0.1f, 0.8f, 1.0f, 5.0f, 100.0f};
    for (int t = 0; t < 5; t++) {
        s = make(temps[t], 1, 0, 0, (uint64_t)t * 77);
        for (uint32_t k = 0; k < 4; k++) {
            fill_logits(l, BIG_VOCAB, 100 + k);
            int32_t got = sampler_sample(s, l, BIG_VOCAB);
            CHECK(got == argmax(l, BIG_VOCAB), "top_k 1 at temperature %g gave %d",
                  (double)temps[t], got);
        }
        sampler_destroy(s);
    }
    free(copy);
    free(l);
}

static void test_seeds(void)
{
    float l[1000];
    fill_logits(l, 1000, 7);
    for (int i = 0; i < 1000; i++)
        l[i] *= 0.2f; /* flat enough that sequences are long-tailed */
    int32_t a[200], b[200], c[200], r[200];
    struct sampler *sa = make(1, 0, 0, 0, 42), *sb = make(1, 0, 0, 0, 42);
    struct sampler *sc = make(1, 0, 0, 0, 43);
    int same_ab = 0, same_ac = 0, same_r = 0;
    for (int i = 0; i < 200; i++) {
        a[i] = sampler_sample(sa, l, 1000);
        b[i] = sampler_sample(sb, l, 1000);
        c[i] = sampler_sample(sc, l, 1000);
        same_ab += a[i] == b[i];
        same_ac += a[i] == c[i];
    }
    sampler_reset(sa);
    for (int i = 0; i < 200; i++) {
        r[i] = sampler_sample(sa, l, 1000);
        same_r += r[i] == a[i];
    }
    CHECK(same_ab == 200, "same seed: %d of 200 equal", same_ab);
    CHECK(same_r == 200, "after reset: %d of 200 equal", same_r);
    CHECK(same_ac < 20, "different seeds: %d of 200 equal", same_ac);
    /* the first ids of seed 42 pin the PRNG and the draw across machines and builds */
    printf("seed 42 begins %d %d %d %d %d\n", a[0], a[1], a[2], a[3], a[4]);
    sampler_destroy(sa);
    sampler_destroy(sb);
    sampler_destroy(sc);
}

/* Pearson chi-square of hist against softmax(l / temp) over n draws. */
static double chi_square(const int *hist, const float *l, int n_vocab, float temp, int n)
{
    double z = 0, chi = 0, p[64];
    for (int i = 0; i < n_vocab; i++)
        z += p[i] = exp((double)l[i] / temp);
    for (int i = 0; i < n_vocab; i++) {
        double e = p[i] / z * n;
        chi += (hist[i] - e) * (hist[i] - e) / e;
    }
    return chi;
}

static void test_distribution(void)
{
    /* 7 degrees of freedom: P(chi2 > 24.32) = 0.001 for a correct sampler */
    const float l[8] = {0.0f, 0.5f, 1.0f, -1.0f, 2.0f, 0.3f, -0.5f, 1.5f};
    const int n = 200000;
    int hist[8];
    static const float temps[] = {1.0f, 0.5f, 2.0f};
    for (int t = 0; t < 3; t++) {
        struct sampler *s = make(temps[t], 0, 0, 0, 1000 + (uint64_t)t);
        draws(s, l, 8, n, hist);
        double chi = chi_square(hist, l, 8, temps[t], n);
        MEASURE("chi-square at temperature %.1f over %d draws: %.2f (7 dof, bound 24.32)",
                (double)temps[t], n, chi);
        CHECK(chi < 24.32, "temperature %g: chi-square %.2f", (double)temps[t], chi);
        /* the wrong temperature must be rejected by the same bound */
        double wrong = chi_square(hist, l, 8, temps[t] * 1.25f, n);
        CHECK(wrong > 100, "temperature %g: chi-square against a 25%% different temperature is "
              "only %.2f", (double)temps[t], wrong);
        sampler_destroy(s);
    }
}

/* Draws that must land only on ids with allowed[id], and hit each allowed id. */
static void check_support(struct sampler *s, const float *l, int32_t n_vocab,
                          const bool *allowed, const char *what)
{
    int hist[16], stray = 0, missed = 0;
    draws(s, l, n_vocab, 20000, hist);
    for (int32_t i = 0; i < n_vocab; i++) {
        stray += !allowed[i] && hist[i];
        missed += allowed[i] && !hist[i];
    }
    CHECK(stray == 0 && missed == 0, "%s: %d excluded ids drawn, %d kept ids never drawn", what,
          stray, missed);
}

static void test_filters(void)
{
    /* probabilities 0.5, 0.3, 0.15, 0.05 (cumulative 0.5, 0.8, 0.95, 1) */
    const float l[4] = {logf(0.5f), logf(0.3f), logf(0.15f), logf(0.05f)};
    struct {
        float temp, top_p, min_p;
        int32_t top_k;
        bool keep[4];
        const char *what;
    } cases[] = {
        {1, 0.7f, 0, 0, {1, 1, 0, 0}, "top_p 0.7"},
        {1, 0.9f, 0, 0, {1, 1, 1, 0}, "top_p 0.9"},
        {1, 0.4f, 0, 0, {1, 0, 0, 0}, "top_p 0.4"},
        {1, 0, 0.2f, 0, {1, 1, 1, 0}, "min_p 0.2 (p >= 0.1)"},
        {1, 0, 0.5f, 0, {1, 1, 0, 0}, "min_p 0.5 (p >= 0.25)"},
        {1, 0, 0, 3, {1, 1, 1, 0}, "top_k 3"},
        {10, 0.7f, 0, 0, {1, 1, 0, 0}, "top_p 0.7 before temperature 10"},
        {10, 0, 0.5f, 0, {1, 1, 0, 0}, "min_p 0.5 before temperature 10"},
        {1, 0.99f, 0.2f, 2, {1, 1, 0, 0}, "top_k 2 with loose top_p and min_p"},
        {1, 0, 0, 0, {1, 1, 1, 1}, "no filter"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        struct sampler *s = make(cases[i].temp, cases[i].top_k, cases[i].top_p, cases[i].min_p,
                                 i);
        check_support(s, l, 4, cases[i].keep, cases[i].what);
        sampler_destroy(s);
    }

    /* top_p without top_k on a large vocabulary: 200 ids with logit 5 at scattered positions,
     * the rest 0. The nucleus of 0.5 is the k lowest of the 200 (ties rank by id), k being the
     * least with k * e^5 >= 0.5 * total: 166.7 -> 167, past the first selection width (64). */
    const int32_t n_vocab = 20000;
    float *big = calloc((size_t)n_vocab, sizeof(*big));
    for (int i = 0; i < 200; i++)
        big[((int64_t)i * 7919 * 13 + 31) % n_vocab] = 5.0f;
    int n_high = 0;
    for (int32_t i = 0; i < n_vocab; i++)
        n_high += big[i] == 5.0f;
    double total = n_high * exp(5.0) + (n_vocab - n_high);
    int k = (int)ceil(0.5 * total / exp(5.0));
    int32_t *rank = malloc((size_t)n_vocab * sizeof(*rank)); /* rank among the high ids */
    for (int32_t i = 0, r = 0; i < n_vocab; i++)
        rank[i] = big[i] == 5.0f ? r++ : -1;
    struct sampler *s = make(1, 0, 0.5f, 0, 9);
    int *hist = calloc((size_t)n_vocab, sizeof(*hist));
    int stray = 0, distinct = 0, max_rank = -1;
    for (int i = 0; i < 3000; i++) {
        int32_t id = sampler_sample(s, big, n_vocab);
        if (id < 0 || rank[id] < 0 || rank[id] >= k) {
            stray++;
            continue;
        }
        distinct += !hist[id]++;
        max_rank = rank[id] > max_rank ? rank[id] : max_rank;
    }
    CHECK(n_high == 200 && k == 167, "setup: %d high ids, k %d", n_high, k);
    CHECK(stray == 0 && max_rank == k - 1 && distinct == k,
          "wide top_p: %d strays, highest rank %d (want %d), %d distinct (want %d)", stray,
          max_rank, k - 1, distinct, k);
    sampler_destroy(s);
    free(hist);
    free(rank);
    free(big);
}

static struct sampler *make_pen(float repeat, float presence, int32_t last_n)
{
    struct sampler_config c = {.repeat_penalty = repeat, .presence_penalty = presence,
                               .penalty_last_n = last_n};
    struct sampler *s = sampler_create(&c);
    CHECK(s, "sampler_create failed");
    if (!s)
        exit(1);
    return s;
}

static void test_penalties(void)
{
    /* logit > 0 is divided: 2.0 / 1.5 = 1.33 < 1.5 but 2.0 / 1.2 = 1.67 > 1.5 */
    const float pos[2] = {2.0f, 1.5f};
    struct sampler *s = make_pen(1.5f, 0, 0);
    CHECK(sampler_sample(s, pos, 2) == 0, "no history, no penalty");
    sampler_accept(s, 0);
    CHECK(sampler_sample(s, pos, 2) == 1, "repeat 1.5 divides 2.0 below 1.5");
    sampler_destroy(s);
    s = make_pen(1.2f, 0, 0);
    sampler_accept(s, 0);
    sampler_accept(s, 0);
    sampler_accept(s, 0);
    CHECK(sampler_sample(s, pos, 2) == 0, "repeat 1.2 applies once, whatever the count");
    sampler_destroy(s);

    /* logit <= 0 is multiplied: -1.0 * 2 = -2.0 < -1.5 (dividing would give -0.5 and keep it) */
    const float neg[2] = {-1.0f, -1.5f};
    s = make_pen(2.0f, 0, 0);
    sampler_accept(s, 0);
    CHECK(sampler_sample(s, neg, 2) == 1, "negative logit multiplied by the penalty");
    sampler_destroy(s);

    /* presence subtracts once: 2.0 - 0.4 = 1.6 > 1.5; 2.0 - 0.6 = 1.4 < 1.5; three repeats
     * with 0.3 stay 1.7 */
    s = make_pen(0, 0.4f, 0);
    sampler_accept(s, 0);
    CHECK(sampler_sample(s, pos, 2) == 0, "presence 0.4");
    sampler_destroy(s);
    s = make_pen(0, 0.6f, 0);
    sampler_accept(s, 0);
    CHECK(sampler_sample(s, pos, 2) == 1, "presence 0.6");
    sampler_destroy(s);
    s = make_pen(0, 0.3f, 0);
    for (int i = 0; i < 3; i++)
        sampler_accept(s, 0);
    CHECK(sampler_sample(s, pos, 2) == 0, "presence 0.3 subtracted once, not per repeat");
    sampler_destroy(s);

    /* both: (2.0 / 1.2) - 0.2 = 1.47 < 1.5 */
    s = make_pen(1.2f, 0.2f, 0);
    sampler_accept(s, 0);
    CHECK(sampler_sample(s, pos, 2) == 1, "repeat then presence");
    sampler_destroy(s);

    /* the window: id 0 leaves a window of 4 after four other tokens; reset forgets */
    s = make_pen(2.0f, 0, 4);
    sampler_accept(s, 0);
    for (int i = 0; i < 3; i++)
        sampler_accept(s, 5);
    CHECK(sampler_sample(s, pos, 2) == 1, "id 0 still in the window");
    sampler_accept(s, 5);
    CHECK(sampler_sample(s, pos, 2) == 0, "id 0 left the window");
    sampler_accept(s, 0);
    sampler_reset(s);
    CHECK(sampler_sample(s, pos, 2) == 0, "reset clears the history");
    sampler_destroy(s);

    /* unbounded history (-1) keeps everything */
    s = make_pen(2.0f, 0, -1);
    sampler_accept(s, 0);
    for (int i = 0; i < 1000; i++)
        CHECK(sampler_accept(s, 7) == 0, "accept");
    CHECK(sampler_sample(s, pos, 2) == 1, "unbounded window still has id 0");
    sampler_destroy(s);

    /* penalties also shape sampling: {3, 1, 0.5} with id 0 penalized by 2 draws from
     * softmax({1.5, 1, 0.5}); 2 degrees of freedom, P(chi2 > 13.82) = 0.001 */
    struct sampler_config c = {.temperature = 1, .repeat_penalty = 2, .seed = 3};
    s = sampler_create(&c);
    const float three[3] = {3.0f, 1.0f, 0.5f}, penalized[3] = {1.5f, 1.0f, 0.5f};
    sampler_accept(s, 0);
    int hist[3];
    draws(s, three, 3, 20000, hist);
    double chi = chi_square(hist, penalized, 3, 1, 20000);
    CHECK(chi < 13.82, "penalized sampling: chi-square %.2f (%d %d %d)", chi, hist[0], hist[1],
          hist[2]);
    CHECK(chi_square(hist, three, 3, 1, 20000) > 100, "penalty had no visible effect");
    sampler_destroy(s);
}

/* fill_logits' logits with ties and holes: where step > 0 each rounded down to a multiple of
 * step (levels); NaN at one entry in nan_every and -inf at one in inf_every, placed by an LCG
 * from x. */
static void fill_logits_holes(float *l, int32_t n, uint32_t seed, uint32_t x, float step,
                              uint32_t nan_every, uint32_t inf_every)
{
    fill_logits(l, n, seed);
    for (int32_t i = 0; i < n; i++) {
        x = x * 1664525u + 1013904223u;
        if (step > 0)
            l[i] = floorf(l[i] / step) * step;
        if (x % nan_every == 0)
            l[i] = NAN;
        else if (x % inf_every == 0)
            l[i] = -INFINITY;
    }
}

/* Ranks before: higher logit, then lower id (the sampler's order). */
struct ref_cand {
    float v;
    int32_t id;
};

static int ref_cmp(const void *pa, const void *pb)
{
    const struct ref_cand *a = pa, *b = pb;
    if (a->v != b->v)
        return a->v > b->v ? -1 : 1;
    return a->id < b->id ? -1 : a->id > b->id;
}

/* top_k's selection against a full sort: at a temperature of 1e30 every kept weight rounds to
 * 1 (expf of about -1e-29), so the draw at u = (i + 0.5) / k returns the i-th best of the k
 * kept, and k draws read the whole list in rank order. Vocabularies around the scan's runs
 * of 64, ties, NaN (never kept), -inf, a penalty window splitting the runs, k from 1 to
 * 200; the reference sorts the penalized logits (NaN as -inf, llama.cpp's rule, then
 * repeat 1.3 and presence 0.5) by logit, then id. */
static void test_top_k_exact(void)
{
    static const int32_t vocabs[] = {2, 63, 64, 65, 127, 1000, 5003, 151936};
    static const int32_t ks[] = {1, 2, 7, 40, 64, 200};
    const float rp = 1.3f, pp = 0.5f;
    int cases = 0;
    for (size_t vi = 0; vi < sizeof(vocabs) / sizeof(vocabs[0]); vi++) {
        const int32_t nv = vocabs[vi];
        float *l = malloc((size_t)nv * sizeof(*l));
        struct ref_cand *ref = malloc((size_t)nv * sizeof(*ref));
        int32_t win[24];
        if (!l || !ref)
            exit(1);
        for (int pattern = 0; pattern < 3; pattern++) {
            /* patterns 1 and 2: few levels, ties everywhere */
            uint32_t x = (uint32_t)nv * 40503u + (uint32_t)pattern;
            fill_logits_holes(l, nv, (uint32_t)(vi * 7 + (size_t)pattern + 1), x,
                              pattern == 0 ? 0.0f : pattern == 1 ? 2.0f : 20.0f, 97, 89);
            size_t n_win = 0;
            for (int i = 0; pattern == 2 && i < 24; i++) {
                x = x * 1664525u + 1013904223u;
                win[n_win++] = (int32_t)(x % (uint32_t)nv);
            }
            for (int32_t i = 0; i < nv; i++) {
                float v = l[i] != l[i] ? -INFINITY : l[i];
                bool in_win = false;
                for (size_t w = 0; w < n_win; w++)
                    in_win |= win[w] == i;
                if (in_win)
                    v = (v <= 0 ? v * rp : v / rp) - pp;
                ref[i] = (struct ref_cand){v, i};
            }
            qsort(ref, (size_t)nv, sizeof(*ref), ref_cmp);
            for (size_t ki = 0; ki < sizeof(ks) / sizeof(ks[0]); ki++) {
                const int32_t k = ks[ki];
                if (k >= nv)
                    continue;
                struct sampler_config c = {.temperature = 1e30f, .top_k = k, .seed = 1};
                if (n_win)
                    c.repeat_penalty = rp, c.presence_penalty = pp;
                struct sampler *s = sampler_create(&c);
                CHECK(s, "sampler_create");
                if (!s)
                    exit(1);
                int32_t finite = 0; /* the kept entries that can be drawn (weight 1) */
                for (int32_t i = 0; i < k; i++)
                    finite += isfinite(ref[i].v);
                int bad = -1;
                int32_t got = -1;
                for (int32_t i = 0; i < finite && bad < 0; i++) {
                    got = sampler_sample_given(s, l, nv, (i + 0.5) / finite, win, n_win);
                    if (got != ref[i].id)
                        bad = i;
                }
                CHECK(bad < 0, "top_k %d over %d logits (pattern %d): pick %d is id %d, the "
                      "sorted reference's is %d", k, nv, pattern, bad, got,
                      bad >= 0 ? ref[bad].id : -1);
                sampler_destroy(s);
                cases++;
            }
        }
        free(l);
        free(ref);
    }
    MEASURE("top_k selection equal to a full sort in %d cases", cases);
}

/* top_p over vocabularies past the sampler's histogram threshold (4096 unordered entries):
 * the kept set read back in rank order through draws at a temperature of 1e30 (every kept
 * weight 1, so the draw at u = (i + 0.5) / count returns the i-th best kept; 64 places of
 * it, the first and last 16 among them) against a full
 * sort and a cumulative scan of exp(logit - max) in rank order. Ties (levels), NaN and -inf
 * entries, nuclei of a few tokens to tens of thousands; with min_p after it too. */
static void test_top_p_wide(void)
{
    static const int32_t vocabs[] = {5000, 60000};
    static const float ps[] = {0.3f, 0.9f, 0.999f};
    int cases = 0;
    for (size_t vi = 0; vi < 2; vi++) {
        const int32_t nv = vocabs[vi];
        float *l = malloc((size_t)nv * sizeof(*l));
        struct ref_cand *ref = malloc((size_t)nv * sizeof(*ref));
        if (!l || !ref)
            exit(1);
        for (int pattern = 0; pattern < 3; pattern++) {
            /* pattern 1: levels, ties everywhere; 2: the same with every positive logit 0
             * (the top, half the entries tied), -0 at odd ids: it ranks as +0 */
            fill_logits_holes(l, nv, (uint32_t)(vi * 5 + (size_t)pattern + 3),
                              (uint32_t)nv * 2654435761u + (uint32_t)pattern,
                              pattern ? 0.5f : 0.0f, 101, 103);
            for (int32_t i = 0; pattern == 2 && i < nv; i++)
                if (l[i] >= 0.0f)
                    l[i] = (i & 1) ? -0.0f : 0.0f;
            float max = -INFINITY;
            for (int32_t i = 0; i < nv; i++) {
                ref[i] = (struct ref_cand){l[i] != l[i] ? -INFINITY : l[i], i};
                max = ref[i].v > max ? ref[i].v : max;
            }
            qsort(ref, (size_t)nv, sizeof(*ref), ref_cmp);
            double total = 0;
            for (int32_t i = 0; i < nv; i++)
                total += expf(ref[i].v - max);
            for (size_t pi = 0; pi < sizeof(ps) / sizeof(ps[0]); pi++) {
                for (int with_min_p = 0; with_min_p < 2; with_min_p++) {
                    /* the reference: the shortest rank prefix whose mass reaches top_p */
                    const double goal = (double)ps[pi] * total;
                    double acc = 0;
                    int32_t count = 0;
                    while (count < nv && acc < goal)
                        acc += expf(ref[count++].v - max);
                    const float floor = max + logf(0.01f);
                    int32_t kept = count;
                    if (with_min_p)
                        for (kept = 0; kept < count && ref[kept].v >= floor; kept++)
                            ;
                    struct sampler_config c = {.temperature = 1e30f, .top_p = ps[pi],
                                               .min_p = with_min_p ? 0.01f : 0.0f, .seed = 1};
                    struct sampler *s = sampler_create(&c);
                    if (!s)
                        exit(1);
                    /* the first and last 16 places and 32 between: a kept set of
                     * another size or order moves them */
                    int bad = -1;
                    int32_t got = -1;
                    for (int32_t j = 0; j < 64 && bad < 0; j++) {
                        const int32_t i = j < 16 ? j : j >= 48 ? kept - 64 + j
                                                            : 16 + (int32_t)((int64_t)(kept - 32) *
                                                                             (j - 16) / 32);
                        if (i < 0 || i >= kept)
                            continue;
                        got = sampler_sample_given(s, l, nv, (i + 0.5) / kept, NULL, 0);
                        if (got != ref[i].id)
                            bad = i;
                    }
                    CHECK(bad < 0, "top_p %g%s over %d logits (pattern %d, %d kept): pick %d is id "
                          "%d, the sorted scan's is %d", (double)ps[pi],
                          with_min_p ? " then min_p 0.01" : "", nv, pattern, kept, bad, got,
                          bad >= 0 ? ref[bad].id : -1);
                    sampler_destroy(s);
                    cases++;
                }
            }
        }
        free(l);
        free(ref);
    }
    MEASURE("top_p's kept tokens equal a sorted cumulative scan's in %d cases over 5000 and 60000 "
            "logits", cases);
}

static void test_config(void)
{
    struct sampler_config bad[] = {
        {.temperature = -1}, {.temperature = NAN}, {.top_k = -2}, {.top_p = 1.5f},
        {.min_p = -0.1f}, {.repeat_penalty = -1}, {.presence_penalty = INFINITY},
        {.penalty_last_n = -2},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        struct sampler *s = sampler_create(&bad[i]);
        CHECK(!s && strstr(log_last_error(), "bad config"), "bad config %zu accepted", i);
        sampler_destroy(s);
    }
}

static void test_speed(void)
{
    float *l = malloc(BIG_VOCAB * sizeof(*l));
    fill_logits(l, BIG_VOCAB, 5);
    struct {
        struct sampler_config c;
        const char *what;
    } cases[] = {
        {{.temperature = 0}, "greedy"},
        {{.temperature = 0.8f, .top_k = 40, .top_p = 0.95f, .min_p = 0.05f, .repeat_penalty = 1.1f,
          .seed = 1}, "llama.cpp defaults (top_k 40, top_p 0.95, min_p 0.05, temp 0.8, repeat 1.1)"},
        {{.temperature = 0.8f, .top_p = 0.95f, .seed = 1}, "top_p 0.95 alone"},
        {{.temperature = 1.0f, .seed = 1}, "temperature 1 alone"},
    };
    for (size_t i = 0; i < sizeof(cases) / sizeof(cases[0]); i++) {
        struct sampler *s = sampler_create(&cases[i].c);
        for (int j = 0; j < 64; j++)
            sampler_accept(s, j * 31);
        const int reps = 50;
        double t0 = now_s();
        int32_t sum = 0;
        for (int r = 0; r < reps; r++)
            sum += sampler_sample(s, l, BIG_VOCAB) >= 0;
        double us = (now_s() - t0) / reps * 1e6;
        CHECK(sum == reps, "samples failed");
        MEASURE("sample over %d logits, %s: %.0f us", BIG_VOCAB, cases[i].what, us);
        sampler_destroy(s);
    }
    free(l);
}

/* sampler_sample_given() with the owner's uniform and window picks what sampler_sample() picks:
 * one sequence sampled both ways (the owner's twin has its own config copy and history), over
 * the filter combinations, greedy and penalties, on a vocabulary with ties and NaN. */
static void test_given(void)
{
    const int32_t nv = 5000;
    float *l = malloc((size_t)nv * sizeof(*l));
    int32_t *win = malloc(4096 * sizeof(*win));
    CHECK(l && win, "no memory");
    if (!l || !win)
        exit(1);
    const struct sampler_config cfgs[] = {
        {.temperature = 0.8f, .top_k = 40, .top_p = 0.95f, .min_p = 0.05f, .seed = 7},
        {.temperature = 0.8f, .top_p = 0.9f, .seed = 8},
        {.temperature = 1.0f, .seed = 9},
        {.temperature = 0.7f, .min_p = 0.1f, .repeat_penalty = 1.3f, .presence_penalty = 0.5f,
         .penalty_last_n = 16, .seed = 10},
        {.temperature = 0.9f, .top_k = 20, .repeat_penalty = 1.1f, .penalty_last_n = -1,
         .seed = 11},
        {.repeat_penalty = 1.5f, .penalty_last_n = 8},
        {.temperature = 0},
    };
    for (size_t k = 0; k < sizeof(cfgs) / sizeof(cfgs[0]); k++) {
        struct sampler *own = sampler_create(&cfgs[k]);
        struct sampler *ref = sampler_create(&cfgs[k]);
        struct sampler_config wc = cfgs[k];
        wc.seed = 12345; /* the twin's seed and window length play no part */
        wc.penalty_last_n = 0;
        struct sampler *twin = sampler_create(&wc);
        CHECK(own && ref && twin, "sampler_create failed");
        if (!own || !ref || !twin)
            exit(1);
        int agree = 0, steps = 300;
        for (int i = 0; i < steps; i++) {
            fill_logits(l, nv, (uint32_t)(100 * k + i));
            l[(i * 7) % nv] = l[(i * 11) % nv]; /* a tie */
            if (i % 50 == 3)
                l[i] = NAN;
            int32_t want = sampler_sample(ref, l, nv);
            double u = sampler_next_uniform(own);
            size_t n_win = sampler_window(own, win, 4096);
            CHECK(n_win <= 4096, "window of %zu", n_win);
            int32_t got = sampler_sample_given(twin, l, nv, u, win, n_win);
            agree += got == want;
            CHECK(got == want, "config %zu step %d: given %d, sample %d", k, i, got, want);
            sampler_accept(ref, want);
            sampler_accept(own, want);
        }
        CHECK(agree == steps, "config %zu: %d of %d agree", k, agree, steps);
        sampler_destroy(own);
        sampler_destroy(ref);
        sampler_destroy(twin);
    }
    /* a window longer than the twin's own history capacity grows its scratch */
    struct sampler_config pc = {.temperature = 0.5f, .repeat_penalty = 2.0f, .seed = 3};
    struct sampler *twin = sampler_create(&pc);
    CHECK(twin, "sampler_create failed");
    if (!twin)
        exit(1);
    fill_logits(l, nv, 77);
    for (int32_t i = 0; i < 4096; i++)
        win[i] = i % nv;
    int32_t id = sampler_sample_given(twin, l, nv, 0.5, win, 4096);
    CHECK(id >= 0 && id < nv, "long window gave %d", id);
    sampler_destroy(twin);
    free(win);
    free(l);
}

int main(void)
{
    log_init("test", -1);
    test_greedy();
    test_seeds();
    test_distribution();
    test_filters();
    test_penalties();
    test_given();
    test_top_k_exact();
    test_top_p_wide();
    test_config();
    test_speed();
    return test_main_result("test_sampler");
}
