/*
 * sampler: penalties, top-k, top-p, min-p, temperature and a seeded draw (see sampler.h).
 *
 * A sampling call (temperature > 0) copies the penalized logits into a candidate array of
 * (logit, id) pairs, all of them or, with top_k, only the k best (through a heap); the filters
 * then shrink it from the end, so the survivors are always cand[0 .. n). Once a filter has
 * sorted cand[0 .. n) best first, the later ones keep that order. Greedy calls only scan.
 */
#include "model/sampler.h"

#include <errno.h>
#include <math.h>
#include <stdbool.h>
#include <stdlib.h>
#include <string.h>

#include "common/check.h"
#include "common/log.h"

#define SMALL_RANGE 16 /* selections sort ranges this short, tokens */
#define MASS_BITS 12   /* mass_prefix_wide: key bits a histogram level takes */
#define MASS_BUCKETS (1u << MASS_BITS)
#define MASS_WIDE 4096 /* unordered ranges longer than this: mass_prefix_wide */

struct sampler_cand {
    float logit; /* logit after the filters so far */
    float w;     /* top_p: exp(logit - max) */
    int32_t id;  /* token id */
};

struct sampler {
    struct sampler_config cfg;  /* validated config */
    int32_t last_n;             /* penalty window, tokens; -1 = unbounded */
    bool penalize;              /* a penalty is configured */
    uint64_t rng[4];            /* xoshiro256** state */
    int32_t *hist;              /* accepted ids: a ring of last_n, or a growing list */
    size_t n_hist;              /* ids stored (<= cap_hist) */
    size_t cap_hist;            /* ids allocated */
    size_t head;                /* ring: where the next id goes */
    struct sampler_cand *cand;  /* scratch: one candidate per vocabulary entry */
    size_t cap_cand;            /* candidates allocated */
    int32_t *pen;               /* scratch: distinct penalized ids, ascending */
    size_t cap_pen;             /* entries allocated in pen (>= cap_hist) */
    size_t n_pen;               /* entries in pen for the current call */
    double *mass;               /* scratch: MASS_BUCKETS masses (mass_prefix_wide) */
};

/* ---------------------------------------------------------------------------------------- */
/* PRNG: xoshiro256**, seeded through splitmix64                                             */

static uint64_t splitmix64(uint64_t *x)
{
    uint64_t z = (*x += 0x9e3779b97f4a7c15ull);
    z = (z ^ (z >> 30)) * 0xbf58476d1ce4e5b9ull;
    z = (z ^ (z >> 27)) * 0x94d049bb133111ebull;
    return z ^ (z >> 31);
}

static inline uint64_t rotl(uint64_t x, int k)
{
    return (x << k) | (x >> (64 - k));
}

static uint64_t rng_next(uint64_t st[4])
{
    uint64_t out = rotl(st[1] * 5, 7) * 9, t = st[1] << 17;
    st[2] ^= st[0];
    st[3] ^= st[1];
    st[1] ^= st[2];
    st[0] ^= st[3];
    st[2] ^= t;
    st[3] = rotl(st[3], 45);
    return out;
}

/* Uniform in [0, 1) with 53 random bits. */
static double rng_uniform(uint64_t st[4])
{
    return (double)(rng_next(st) >> 11) * 0x1.0p-53;
}

static void rng_seed(uint64_t st[4], uint64_t seed)
{
    for (int i = 0; i < 4; i++)
        st[i] = splitmix64(&seed);
}

/* ---------------------------------------------------------------------------------------- */
/* Lifecycle                                                                                 */

static int check_config(const struct sampler_config *c)
{
    const char *bad = NULL;
    if (!(c->temperature >= 0 && isfinite(c->temperature)))
        bad = "temperature must be a finite value >= 0";
    else if (c->top_k < 0)
        bad = "top_k must be >= 0";
    else if (!(c->top_p >= 0 && c->top_p <= 1))
        bad = "top_p must be in [0, 1]";
    else if (!(c->min_p >= 0 && c->min_p <= 1))
        bad = "min_p must be in [0, 1]";
    else if (!(c->repeat_penalty >= 0 && isfinite(c->repeat_penalty)))
        bad = "repeat_penalty must be a finite value >= 0";
    else if (!isfinite(c->presence_penalty))
        bad = "presence_penalty must be finite";
    else if (c->penalty_last_n < -1)
        bad = "penalty_last_n must be >= -1";
    if (!bad)
        return 0;
    log_error("sampler: bad config: %s (temperature %g, top_k %d, top_p %g, min_p %g, "
              "repeat_penalty %g, presence_penalty %g, penalty_last_n %d)", bad,
              (double)c->temperature, c->top_k, (double)c->top_p, (double)c->min_p,
              (double)c->repeat_penalty, (double)c->presence_penalty, c->penalty_last_n);
    return -EINVAL;
}

struct sampler *sampler_create(const struct sampler_config *cfg)
{
    ASSERT(cfg);
    if (check_config(cfg))
        return NULL;
    struct sampler *s = calloc(1, sizeof(*s));
    if (!s)
        goto out_nomem;
    s->cfg = *cfg;
    s->last_n = cfg->penalty_last_n ? cfg->penalty_last_n : SAMPLER_DEFAULT_LAST_N;
    s->penalize = (cfg->repeat_penalty != 0 && cfg->repeat_penalty != 1) ||
                  cfg->presence_penalty != 0;
    s->cap_hist = s->last_n > 0 ? (size_t)s->last_n : 256;
    s->hist = malloc(s->cap_hist * sizeof(*s->hist));
    s->pen = malloc(s->cap_hist * sizeof(*s->pen));
    s->cap_pen = s->cap_hist;
    s->mass = malloc(MASS_BUCKETS * sizeof(*s->mass));
    if (!s->hist || !s->pen || !s->mass)
        goto out_free;
    rng_seed(s->rng, cfg->seed);
    return s;

out_free:
    sampler_destroy(s);
out_nomem:
    log_error("sampler: out of memory");
    return NULL;
}

void sampler_destroy(struct sampler *s)
{
    if (!s)
        return;
    free(s->cand);
    free(s->pen);
    free(s->mass);
    free(s->hist);
    free(s);
}

int sampler_accept(struct sampler *s, int32_t id)
{
    ASSERT(id >= 0);
    if (s->last_n < 0 && s->n_hist == s->cap_hist) {
        size_t cap = s->cap_hist * 2;
        int32_t *h = realloc(s->hist, cap * sizeof(*h));
        if (h)
            s->hist = h;
        int32_t *p = !h ? NULL : cap > s->cap_pen ? realloc(s->pen, cap * sizeof(*p)) : s->pen;
        if (!p) {
            log_error("sampler: out of memory for a history of %zu tokens", cap);
            return -ENOMEM;
        }
        s->pen = p;
        s->cap_pen = cap > s->cap_pen ? cap : s->cap_pen;
        s->cap_hist = cap;
    }
    if (s->last_n < 0) {
        s->hist[s->n_hist++] = id;
        return 0;
    }
    s->hist[s->head] = id;
    s->head = (s->head + 1) % s->cap_hist;
    if (s->n_hist < s->cap_hist)
        s->n_hist++;
    return 0;
}

void sampler_reset(struct sampler *s)
{
    s->n_hist = 0;
    s->head = 0;
    rng_seed(s->rng, s->cfg.seed);
}

/* ---------------------------------------------------------------------------------------- */
/* Penalties                                                                                 */

static int cmp_i32(const void *pa, const void *pb)
{
    int32_t a = *(const int32_t *)pa, b = *(const int32_t *)pb;
    return a < b ? -1 : a > b;
}

/* Fills s->pen with the distinct ids of win[0 .. n_win) that are below n_vocab, ascending;
 * s->pen holds at least n_win entries. */
static void collect_penalized(struct sampler *s, const int32_t *win, size_t n_win,
                              int32_t n_vocab)
{
    size_t n = 0;
    for (size_t i = 0; s->penalize && i < n_win; i++)
        if (win[i] >= 0 && win[i] < n_vocab)
            s->pen[n++] = win[i];
    qsort(s->pen, n, sizeof(*s->pen), cmp_i32);
    size_t k = 0;
    for (size_t i = 0; i < n; i++)
        if (k == 0 || s->pen[k - 1] != s->pen[i])
            s->pen[k++] = s->pen[i];
    s->n_pen = k;
}

/* The logit of a token in the window, as llama.cpp's penalties leave it (NaN counts as -inf). */
static inline float penalize(const struct sampler *s, float v)
{
    float r = s->cfg.repeat_penalty;
    if (v != v)
        v = -INFINITY;
    if (r != 0 && r != 1)
        v = v <= 0 ? v * r : v / r;
    return v - s->cfg.presence_penalty;
}

/* ---------------------------------------------------------------------------------------- */
/* Ranking and selection                                                                     */

/* True when a ranks before b: higher logit, then lower id. */
static inline bool cand_better(const struct sampler_cand *a, const struct sampler_cand *b)
{
    return a->logit > b->logit || (a->logit == b->logit && a->id < b->id);
}

static int cmp_cand(const void *pa, const void *pb)
{
    const struct sampler_cand *a = pa, *b = pb;
    return cand_better(a, b) ? -1 : cand_better(b, a);
}

static inline void cand_swap(struct sampler_cand *a, struct sampler_cand *b)
{
    struct sampler_cand t = *a;
    *a = *b;
    *b = t;
}

/* Partitions c[lo .. hi) (hi - lo >= 3) around a median-of-three pivot: better entries first.
 * Returns the pivot's final index. */
static size_t partition(struct sampler_cand *c, size_t lo, size_t hi)
{
    size_t mid = lo + (hi - lo) / 2, last = hi - 1;
    if (cand_better(&c[mid], &c[lo]))
        cand_swap(&c[mid], &c[lo]);
    if (cand_better(&c[last], &c[lo]))
        cand_swap(&c[last], &c[lo]);
    if (cand_better(&c[mid], &c[last]))
        cand_swap(&c[mid], &c[last]); /* c[last] is now the median */
    size_t p = lo;
    for (size_t j = lo; j < last; j++)
        if (cand_better(&c[j], &c[last]))
            cand_swap(&c[p++], &c[j]);
    cand_swap(&c[p], &c[last]);
    return p;
}

/* Min-heap on rank (root = worst kept) of h[0 .. k): sinks entry i. */
static void heap_sink(struct sampler_cand *h, size_t k, size_t i)
{
    for (;;) {
        size_t c = 2 * i + 1;
        if (c >= k)
            return;
        if (c + 1 < k && cand_better(&h[c], &h[c + 1]))
            c++;
        if (!cand_better(&h[i], &h[c]))
            return;
        cand_swap(&h[i], &h[c]);
        i = c;
    }
}

/* Offers candidate (v, id) to the heap h[0 .. k); ids arrive in increasing order, so an equal
 * logit never displaces the (lower-id) root. */
static inline void heap_offer(struct sampler_cand *h, size_t k, float v, int32_t id)
{
    if (v > h[0].logit) {
        h[0] = (struct sampler_cand){v, 0, id};
        heap_sink(h, k, 0);
    }
}

/* ---------------------------------------------------------------------------------------- */
/* Passes over the logits. Penalized ids (s->pen, ascending) split the vocabulary into plain
 * runs, scanned by tight loops, and single penalized entries.                               */

/* Largest of l[from .. to), ignoring NaN; eight running maxima keep the loop free of a
 * serial dependency. */
static float range_max(const float *l, int32_t from, int32_t to)
{
    float m[8];
    for (int k = 0; k < 8; k++)
        m[k] = -INFINITY;
    int32_t i = from;
    for (; i + 8 <= to; i += 8)
        for (int k = 0; k < 8; k++)
            m[k] = l[i + k] > m[k] ? l[i + k] : m[k];
    for (; i < to; i++)
        m[0] = l[i] > m[0] ? l[i] : m[0];
    for (int k = 1; k < 8; k++)
        m[0] = m[k] > m[0] ? m[k] : m[0];
    return m[0];
}

/* Arg-max of the penalized logits (ties to the lowest id); *best_v receives its logit. Two
 * passes: the maximum, then the first id that has it. */
static int32_t pass_argmax(const struct sampler *s, const float *l, int32_t n, float *best_v)
{
    float m = -INFINITY;
    int32_t from = 0;
    for (size_t j = 0; j <= s->n_pen; j++) {
        int32_t to = j < s->n_pen ? s->pen[j] : n;
        float v = range_max(l, from, to);
        m = v > m ? v : m;
        if (j == s->n_pen)
            break;
        v = penalize(s, l[to]);
        m = v > m ? v : m;
        from = to + 1;
    }
    *best_v = m;
    from = 0;
    for (size_t j = 0; j <= s->n_pen; j++) {
        int32_t to = j < s->n_pen ? s->pen[j] : n;
        for (int32_t i = from; i < to; i++)
            if (l[i] == m)
                return i;
        if (j == s->n_pen)
            break;
        if (penalize(s, l[to]) == m)
            return to;
        from = to + 1;
    }
    return 0; /* every logit is NaN */
}

/* Every token as a candidate, in id order. */
static void pass_all(const struct sampler *s, const float *l, int32_t n, struct sampler_cand *c)
{
    int32_t from = 0;
    for (size_t j = 0; j <= s->n_pen; j++) {
        int32_t to = j < s->n_pen ? s->pen[j] : n;
        for (int32_t i = from; i < to; i++)
            c[i] = (struct sampler_cand){l[i] != l[i] ? -INFINITY : l[i], 0, i};
        if (j == s->n_pen)
            break;
        c[to] = (struct sampler_cand){penalize(s, l[to]), 0, to};
        from = to + 1;
    }
}

/* Offers l[from .. to) to the heap c[0 .. k) in id order. A run of OFFER_RUN logits none of
 * which passes the root as the run starts is skipped whole (its maximum, range_max, is one
 * loop without a serial dependency): the root only rises, so heap_offer would have refused
 * each of them; the others are offered one by one, so the heap ends the same. */
#define OFFER_RUN 64
static void offer_range(struct sampler_cand *c, size_t k, const float *l, int32_t from,
                        int32_t to)
{
    int32_t i = from;
    for (; to - i >= OFFER_RUN; i += OFFER_RUN)
        if (range_max(l, i, i + OFFER_RUN) > c[0].logit)
            for (int32_t j = i; j < i + OFFER_RUN; j++)
                heap_offer(c, k, l[j], j);
    for (; i < to; i++)
        heap_offer(c, k, l[i], i);
}

/* The k best tokens (0 < k < n) into c[0 .. k), sorted best first. */
static void pass_top_k(const struct sampler *s, const float *l, int32_t n, size_t k,
                       struct sampler_cand *c)
{
    for (size_t i = 0; i < k; i++)
        c[i] = (struct sampler_cand){-INFINITY, 0, INT32_MAX};
    int32_t from = 0;
    for (size_t j = 0; j <= s->n_pen; j++) {
        int32_t to = j < s->n_pen ? s->pen[j] : n;
        offer_range(c, k, l, from, to);
        if (j == s->n_pen)
            break;
        heap_offer(c, k, penalize(s, l[to]), to);
        from = to + 1;
    }
    /* with fewer than k finite logits the heap still holds -inf placeholders; they sort last
     * and draw() never picks a zero-weight entry */
    qsort(c, k, sizeof(*c), cmp_cand);
}

/* ---------------------------------------------------------------------------------------- */
/* Filters on c[0 .. n)                                                                      */

/* True when the running mass acc has reached goal (strict: passed it). */
static inline bool mass_reaches(double acc, double goal, bool strict)
{
    return strict ? acc > goal : acc >= goal;
}

/* A logit's place as an unsigned key: a larger logit has a larger key, -0 the key of +0 (they
 * rank as equals, by id), -inf the smallest of all (pass_all and pass_top_k leave no NaN). */
static inline uint32_t logit_key(float v)
{
    const float z = v + 0.0f; /* -0 + 0 is +0 */
    uint32_t b;
    memcpy(&b, &z, sizeof(b));
    return (b & 0x80000000u) ? ~b : b | 0x80000000u;
}

static inline uint32_t key_bucket(const struct sampler_cand *c, int sh)
{
    return (logit_key(c->logit) >> sh) & (MASS_BUCKETS - 1);
}

/* mass_prefix of an unordered range by histograms of mass over the logits' keys instead of a
 * quickselect: a pass sums the weights of c[lo .. hi) into MASS_BUCKETS buckets of key bits
 * sh .. sh + MASS_BITS - 1 (the higher bits are equal in the range), walks them from the top
 * while the running mass stays short of the goal, and moves the entries of the buckets above
 * the one where it reaches the goal to the front (they are in the prefix, in no particular
 * order) and that bucket's entries after them: the next range, at the next bits. After two
 * levels (24 key bits) the range left is sorted and scanned. The sum runs in bucket order,
 * then in rank order, so the cut is the rank-order scan's but for rounding; where rounding
 * keeps the sum short of the goal, the entries below the range follow in rank order. */
static size_t mass_prefix_wide(double *mass, struct sampler_cand *c, size_t n, double goal,
                               bool strict)
{
    double acc = 0; /* mass of c[0 .. lo) */
    size_t lo = 0, hi = n, below[2];
    for (int level = 0; level < 2; level++) {
        const int sh = level ? 32 - 2 * MASS_BITS : 32 - MASS_BITS;
        memset(mass, 0, MASS_BUCKETS * sizeof(*mass));
        for (size_t i = lo; i < hi; i++)
            mass[key_bucket(&c[i], sh)] += c[i].w;
        uint32_t b = MASS_BUCKETS - 1;
        for (; b > 0 && !mass_reaches(acc + mass[b], goal, strict); b--)
            acc += mass[b];
        size_t p = lo;
        for (size_t i = lo; i < hi; i++)
            if (key_bucket(&c[i], sh) > b)
                cand_swap(&c[p++], &c[i]);
        size_t q = p;
        for (size_t i = p; i < hi; i++)
            if (key_bucket(&c[i], sh) == b)
                cand_swap(&c[q++], &c[i]);
        below[level] = hi;
        lo = p;
        hi = q;
    }
    /* the range left, then (rounding) what lies below it at each level, in rank order */
    const size_t ends[3] = {hi, below[1], below[0]};
    size_t from = lo;
    for (int k = 0; k < 3; k++) {
        qsort(c + from, ends[k] - from, sizeof(*c), cmp_cand);
        for (size_t i = from; i < ends[k]; i++) {
            acc += c[i].w;
            if (mass_reaches(acc, goal, strict))
                return i + 1;
        }
        from = ends[k];
    }
    return n;
}

/* The length of the shortest best-ranked prefix of c[0 .. n) whose weights (c[i].w) reach goal
 * (strict: pass it), as a cumulative scan in rank order finds it; c[count - 1] is the last token
 * of that prefix. In-order input is scanned as it lies (its order is the rank order, or the order
 * the caller wants scanned); otherwise a quickselect on mass (or, past MASS_WIDE entries,
 * histograms: mass_prefix_wide, with mass its scratch) finds the prefix in expected O(n),
 * leaving c[0 .. count - 1) in no particular order. Rounding that keeps the sum short of the
 * goal keeps the whole remaining range. */
static size_t mass_prefix(double *mass, struct sampler_cand *c, size_t n, bool in_order,
                          double goal, bool strict)
{
    if (!in_order && n > MASS_WIDE)
        return mass_prefix_wide(mass, c, n, goal, strict);
    double acc = 0; /* mass of c[0 .. lo) */
    size_t lo = 0, hi = n;
    for (int budget = 64; !in_order && hi - lo > SMALL_RANGE && budget > 0; budget--) {
        size_t p = partition(c, lo, hi);
        double better = 0;
        for (size_t i = lo; i < p; i++)
            better += c[i].w;
        if (mass_reaches(acc + better, goal, strict)) {
            hi = p;
        } else if (mass_reaches(acc + better + c[p].w, goal, strict)) {
            return p + 1;
        } else {
            acc += better + c[p].w;
            lo = p + 1;
        }
    }
    if (!in_order)
        qsort(c + lo, hi - lo, sizeof(*c), cmp_cand);
    for (size_t i = lo; i < hi; i++) {
        acc += c[i].w;
        if (mass_reaches(acc, goal, strict))
            return i + 1;
    }
    return hi;
}

/* Keeps the best-ranked tokens whose softmax mass (before temperature) first reaches top_p,
 * as llama.cpp's cumulative scan over the sorted list does; returns their count (see
 * mass_prefix: sorted input is scanned, otherwise c[0 .. count) is left in no particular
 * order). */
static size_t filter_top_p(struct sampler *s, struct sampler_cand *c, size_t n, bool sorted,
                           float max, float top_p)
{
    double total = 0;
    for (size_t i = 0; i < n; i++)
        total += c[i].w = expf(c[i].logit - max);
    return mass_prefix(s->mass, c, n, sorted, (double)top_p * total, false);
}

/* Keeps the tokens whose probability is at least min_p times the largest, that is
 * logit >= max + ln(min_p), in their order; returns the new count. */
static size_t filter_min_p(struct sampler_cand *c, size_t n, bool sorted, float max, float min_p)
{
    float floor = max + logf(min_p);
    size_t k = 0;
    for (size_t i = 0; i < n; i++) {
        if (c[i].logit >= floor)
            c[k++] = c[i];
        else if (sorted)
            break;
    }
    return k;
}

/* Draws from softmax(logit / temperature) over c[0 .. n) by the inverse CDF at u (in [0, 1)):
 * the first token whose cumulative weight passes u * total, the cumulation running in the
 * order c lies in when in_order, else in rank order. Overwrites the weights. */
static int32_t draw(struct sampler *s, struct sampler_cand *c, size_t n, bool in_order,
                    float max, double u)
{
    float inv_t = 1.0f / s->cfg.temperature;
    double total = 0;
    for (size_t i = 0; i < n; i++)
        total += c[i].w = expf((c[i].logit - max) * inv_t);
    size_t k = mass_prefix(s->mass, c, n, in_order, u * total, true);
    while (k > 1 && c[k - 1].w == 0) /* u fell in the rounding slack: the last token with weight */
        k--;
    return c[k - 1].id;
}

/* ---------------------------------------------------------------------------------------- */
/* Sampling                                                                                  */

static int grow_cand(struct sampler *s, size_t n)
{
    if (n <= s->cap_cand)
        return 0;
    free(s->cand);
    s->cand = malloc(n * sizeof(*s->cand));
    s->cap_cand = s->cand ? n : 0;
    if (!s->cand) {
        log_error("sampler: out of memory for %zu candidates", n);
        return -ENOMEM;
    }
    return 0;
}

/* Picks a token with the penalty set already in s->pen and the uniform u (unused when
 * greedy). */
static int32_t sample_with(struct sampler *s, const float *logits, int32_t n_vocab, double u)
{
    float max;
    if (s->cfg.temperature == 0)
        return pass_argmax(s, logits, n_vocab, &max);
    if (grow_cand(s, (size_t)n_vocab))
        return -ENOMEM;
    struct sampler_cand *c = s->cand;
    size_t n = (size_t)n_vocab;
    bool sorted = s->cfg.top_k > 0 && (size_t)s->cfg.top_k < n;
    bool top_p = s->cfg.top_p > 0 && s->cfg.top_p < 1;
    if (sorted) {
        pass_top_k(s, logits, n_vocab, (size_t)s->cfg.top_k, c);
        n = (size_t)s->cfg.top_k;
        max = c[0].logit;
    } else {
        pass_all(s, logits, n_vocab, c);
        max = c[0].logit;
        for (size_t i = 1; i < n; i++)
            max = c[i].logit > max ? c[i].logit : max;
    }
    if (!isfinite(max))
        return pass_argmax(s, logits, n_vocab, &max); /* nothing finite to draw from */
    if (top_p)
        n = filter_top_p(s, c, n, sorted, max, s->cfg.top_p);
    if (s->cfg.min_p > 0)
        n = filter_min_p(c, n, sorted, max, s->cfg.min_p);
    /* top_p's quickselect leaves no order worth keeping: then the draw runs in rank order, as
     * after top_k; otherwise c is in id order and the draw cumulates in id order */
    return draw(s, c, n, sorted || !top_p, max, u);
}

int32_t sampler_sample(struct sampler *s, const float *logits, int32_t n_vocab)
{
    ASSERT(s && logits && n_vocab > 0);
    collect_penalized(s, s->hist, s->n_hist, n_vocab);
    /* before the logits can matter: one draw per call */
    double u = s->cfg.temperature == 0 ? 0 : rng_uniform(s->rng);
    return sample_with(s, logits, n_vocab, u);
}

int32_t sampler_sample_given(struct sampler *s, const float *logits, int32_t n_vocab, double u,
                             const int32_t *window, size_t n_window)
{
    ASSERT(s && logits && n_vocab > 0 && (window || n_window == 0));
    ASSERT(u >= 0 && u < 1);
    if (s->penalize && n_window > s->cap_pen) {
        int32_t *p = realloc(s->pen, n_window * sizeof(*p));
        if (!p) {
            log_error("sampler: out of memory for a window of %zu tokens", n_window);
            return -ENOMEM;
        }
        s->pen = p;
        s->cap_pen = n_window;
    }
    collect_penalized(s, window, n_window, n_vocab);
    return sample_with(s, logits, n_vocab, u);
}

const struct sampler_config *sampler_get_config(const struct sampler *s)
{
    return &s->cfg;
}

bool sampler_penalizes(const struct sampler *s)
{
    return s->penalize;
}

double sampler_next_uniform(struct sampler *s)
{
    return s->cfg.temperature > 0 ? rng_uniform(s->rng) : 0;
}

size_t sampler_window(const struct sampler *s, int32_t *ids, size_t cap)
{
    for (size_t i = 0; i < s->n_hist && i < cap; i++)
        ids[i] = s->hist[i];
    return s->n_hist;
}
