/*
 * test_planner: the placement planner (issue 5) on the small trained
 * qwen3next fixture (8 layers, 32 experts, top 4, shared expert) and the
 * qwen3moe conformance fixture (no shared expert), with small fake budgets:
 * fits / too big, heat both ways with and without a heat profile, room nobody
 * would use, explicit lists (obeyed, charged, errors naming the token), off,
 * the bandwidth-balanced split against an independent brute force, ties to
 * the device with most room, nothing movable, heat.json parsing (the fixture,
 * malformed variants, every truncation, byte flips), the printed explanation,
 * and a sample plan of the 80b-a3b shape built from its sizes alone.
 */
#include <errno.h>
#include <math.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "common/log.h"
#include "coordinator/planner.h"
#include "model/arch.h"
#include "model/gguf.h"
#include "model/quant.h"
#include "tests/check.h"
#include "tests/fixture.h"

#define SMALL "small-model/qwen3next-small-q8_0.gguf"
#define HEAT "small-model/heat.json"
#define MOE "conformance/qwen3moe/qwen3moe-q8_0.gguf"
#define HOST_BW 10e9

struct tmodel {
    struct gguf *g;
    struct arch_model *m;
};

static int tmodel_open(struct tmodel *tm, const char *rel)
{
    char path[512];
    struct gguf_config gc = {.path = test_fixture(path, sizeof(path), rel)};
    tm->g = gguf_open(&gc);
    struct arch_config ac = {.gguf = tm->g};
    tm->m = tm->g ? arch_load(&ac) : NULL;
    return tm->m ? 0 : -1;
}

static void tmodel_close(struct tmodel *tm)
{
    arch_free(tm->m);
    gguf_close(tm->g);
}

/* One CPU-like device of the given budget, no margin, host 10 GB/s. */
static struct planner_config base_cfg(const struct arch_model *m, uint64_t budget)
{
    struct planner_config c = {.model = m, .n_devices = 1, .host_bw = HOST_BW, .n_ctx = 256,
                               .kv_f16 = true, .max_batch = 16,
                               .margin_frac = PLANNER_MARGIN_NONE};
    c.devices[0] = (struct planner_device){.name = "cpu", .budget = budget};
    return c;
}

/* Sizes the plan reports, from a generous one-device plan. */
struct sizes {
    uint64_t mandatory;  /* scratch + KV + state */
    uint64_t lmhead, trunk, expert, experts_all;
    uint64_t smallest_trunk;
};

static struct sizes sizes_of(const struct arch_model *m)
{
    struct sizes s = {0};
    struct planner_config c = base_cfg(m, 1ull << 40);
    struct planner_plan *p = NULL;
    int rc = planner_build(&c, &p);
    CHECK(rc == 0, "generous plan: %d", rc);
    if (rc)
        return s;
    s.mandatory = p->dev[0].scratch + p->dev[0].kv + p->dev[0].state;
    s.lmhead = p->lmhead_bytes;
    s.trunk = s.smallest_trunk = s.lmhead;
    s.expert = p->layers[0].expert_bytes;
    for (uint32_t l = 0; l < p->n_layer; l++) {
        const struct planner_layer_plan *lp = &p->layers[l];
        s.trunk += lp->proj_bytes + lp->shexp_bytes;
        s.experts_all += (uint64_t)p->n_expert * lp->expert_bytes;
        s.smallest_trunk = lp->proj_bytes < s.smallest_trunk ? lp->proj_bytes : s.smallest_trunk;
        if (lp->shexp_bytes && lp->shexp_bytes < s.smallest_trunk)
            s.smallest_trunk = lp->shexp_bytes;
        CHECK(lp->expert_bytes == s.expert, "layer %u expert bytes %llu", l,
              (unsigned long long)lp->expert_bytes);
    }
    CHECK(p->dev[0].trunk == s.trunk && p->dev[0].experts == s.experts_all,
          "a generous budget holds everything: trunk %llu/%llu experts %llu/%llu",
          (unsigned long long)p->dev[0].trunk, (unsigned long long)s.trunk,
          (unsigned long long)p->dev[0].experts, (unsigned long long)s.experts_all);
    planner_plan_destroy(p);
    return s;
}

static const struct planner_piece *find_piece(const struct planner_plan *p,
                                              enum planner_kind k, uint32_t layer, uint32_t e)
{
    for (size_t i = 0; i < p->n_pieces; i++) {
        const struct planner_piece *x = &p->pieces[i];
        if (x->kind == k && (k == PLANNER_KIND_LMHEAD || x->layer == layer) &&
            (k != PLANNER_KIND_EXPERT || x->expert == e))
            return x;
    }
    return NULL;
}

static bool bit(const uint8_t *bm, uint32_t e)
{
    return (bm[e / 8] >> (e % 8)) & 1;
}

/* Every plan must account exactly: room = trunk + experts + free, and the
 * bitmaps agree with the counts. */
static void check_accounting(const struct planner_plan *p, const char *what)
{
    for (int d = 0; d < p->n_devices; d++) {
        const struct planner_device_plan *dv = &p->dev[d];
        CHECK(dv->room == dv->trunk + dv->experts + dv->foreign + dv->free, "%s: device %d "
              "room %llu != %llu + %llu + %llu + %llu", what, d, (unsigned long long)dv->room,
              (unsigned long long)dv->trunk, (unsigned long long)dv->experts,
              (unsigned long long)dv->foreign, (unsigned long long)dv->free);
        uint64_t fb = 0;
        uint32_t fn = 0;
        for (uint32_t l = 0; l < p->n_layer; l++)
            for (uint32_t e = 0; e < p->n_expert; e++)
                if (planner_holder(p, l, e) == d && p->layers[l].device != d) {
                    fb += p->layers[l].expert_bytes;
                    fn++;
                }
        CHECK(fb == dv->foreign && fn == dv->n_foreign, "%s: device %d foreign %llu/%llu "
              "(%u/%u)", what, d, (unsigned long long)fb, (unsigned long long)dv->foreign, fn,
              dv->n_foreign);
        CHECK(dv->budget == dv->room + dv->margin + dv->scratch + dv->kv + dv->state,
              "%s: device %d budget does not add up", what, d);
        uint64_t eb = 0, tb = dv->lmhead ? p->lmhead_bytes : 0;
        uint32_t n = 0;
        for (uint32_t l = dv->layer_begin; l < dv->layer_end; l++) {
            const struct planner_layer_plan *lp = &p->layers[l];
            uint32_t bits = 0;
            for (uint32_t e = 0; e < p->n_expert; e++)
                bits += bit(planner_bitmap(p, l), e);
            CHECK(bits == lp->n_resident, "%s: layer %u bitmap %u != %u", what, l, bits,
                  lp->n_resident);
            CHECK(lp->device == d, "%s: layer %u owner %d != %d", what, l, lp->device, d);
            for (uint32_t e = 0; e < p->n_expert; e++) {
                const int h = planner_holder(p, l, e);
                CHECK(bit(planner_bitmap(p, l), e) == (h == d) &&
                      (h == PLANNER_HOST || h == d || p->experts_any),
                      "%s: layer %u expert %u holder %d, resident %d", what, l, e, h,
                      bit(planner_bitmap(p, l), e));
            }
            eb += (uint64_t)bits * lp->expert_bytes;
            n += bits;
            tb += (lp->proj ? lp->proj_bytes : 0) + (lp->shexp ? lp->shexp_bytes : 0);
        }
        CHECK(eb == dv->experts && n == dv->n_experts && tb == dv->trunk,
              "%s: device %d charged experts %llu/%llu (%u/%u) trunk %llu/%llu", what, d,
              (unsigned long long)eb, (unsigned long long)dv->experts, n, dv->n_experts,
              (unsigned long long)tb, (unsigned long long)dv->trunk);
    }
}

static struct planner_plan *build_ok(const struct planner_config *c, const char *what)
{
    struct planner_plan *p = NULL;
    int rc = planner_build(c, &p);
    CHECK(rc == 0 && p, "%s: planner_build %d (%s)", what, rc, log_last_error());
    if (p)
        check_accounting(p, what);
    return p;
}

static int build_err(const struct planner_config *c, const char *needle, const char *what)
{
    struct planner_plan *p = NULL;
    log_set_level(LOG_LEVEL_ERROR + 0);
    int rc = planner_build(c, &p);
    CHECK(rc != 0 && !p, "%s: expected a failure, got %d", what, rc);
    const char *msg = log_last_error();
    CHECK(msg && strstr(msg, needle), "%s: message '%s' lacks '%s'", what, msg ? msg : "",
          needle);
    planner_plan_destroy(p);
    return rc;
}

/* ---- heat profiles ---- */

/* planner_heat_save writes what planner_heat_load reads back, and a path that
 * cannot be written fails cleanly (nothing left behind). */
static void test_heat_save(void)
{
    char path[512];
    struct planner_heat *h = NULL;
    int rc = planner_heat_load(test_fixture(path, sizeof(path), HEAT), &h);
    CHECK(rc == 0 && h, "heat.json: %d", rc);
    if (!h)
        return;
    char out[] = "/tmp/lamina-heat-XXXXXX";
    const int fd = mkstemp(out);
    CHECK(fd >= 0, "temp file");
    if (fd >= 0)
        close(fd);
    rc = planner_heat_save(out, h, "my run/1");
    struct planner_heat *back = NULL;
    rc = rc ? rc : planner_heat_load(out, &back);
    CHECK(rc == 0 && back && back->n_layer == h->n_layer && back->n_expert == h->n_expert &&
              back->tokens == h->tokens &&
              !memcmp(back->counts, h->counts,
                      (size_t)h->n_layer * h->n_expert * sizeof(uint64_t)),
          "saved heat reads back the same (%d)", rc);
    char tmp[600];
    snprintf(tmp, sizeof(tmp), "%s.tmp", out);
    CHECK(access(tmp, F_OK) != 0, "no .tmp left after a save");
    unlink(out);
    log_set_level(LOG_LEVEL_ERROR);
    rc = planner_heat_save("/nonexistent-dir/heat.json", h, "x");
    log_set_level(LOG_LEVEL_WARN);
    CHECK(rc == -EIO && strstr(log_last_error(), "/nonexistent-dir/heat.json"),
          "an unwritable path fails naming it: %d '%s'", rc, log_last_error());
    MEASURE("heat save: %ux%u counts of %llu tokens round-trip through planner_heat_load",
            h->n_layer, h->n_expert, (unsigned long long)h->tokens);
    planner_heat_destroy(back);
    planner_heat_destroy(h);
}

static void test_heat_fixture(const struct arch_model *m)
{
    char path[512];
    struct planner_heat *h = NULL;
    int rc = planner_heat_load(test_fixture(path, sizeof(path), HEAT), &h);
    CHECK(rc == 0 && h, "heat.json: %d", rc);
    if (!h)
        return;
    CHECK(h->n_layer == 8 && h->n_expert == 32 && h->tokens == 2048, "shape %ux%u, %llu tokens",
          h->n_layer, h->n_expert, (unsigned long long)h->tokens);
    CHECK(h->counts[0] == 289 && h->counts[31] == 18 && h->counts[7 * 32 + 31] == 112 &&
          h->counts[3 * 32 + 13] == 1698, "counts %llu %llu %llu %llu",
          (unsigned long long)h->counts[0], (unsigned long long)h->counts[31],
          (unsigned long long)h->counts[7 * 32 + 31], (unsigned long long)h->counts[3 * 32 + 13]);
    for (uint32_t l = 0; l < 8; l++) {
        uint64_t s = 0;
        for (uint32_t e = 0; e < 32; e++)
            s += h->counts[l * 32 + e];
        CHECK(s == 2048 * 4, "layer %u routes %llu", l, (unsigned long long)s);
    }
    /* values in a plan: p = count / tokens, times the miss ratio (here 3) */
    struct planner_config c = base_cfg(m, 1ull << 30);
    c.heat = h;
    c.devices[0].mem_bw = 3 * HOST_BW;
    struct planner_plan *p = build_ok(&c, "fixture heat");
    const struct planner_piece *x = p ? find_piece(p, PLANNER_KIND_EXPERT, 3, 13) : NULL;
    CHECK(x && fabs(x->value - 3.0 * 1698 / 2048) < 1e-12, "value of expert 13 of layer 3: %g",
          x ? x->value : -1);
    x = p ? find_piece(p, PLANNER_KIND_EXPERT, 0, 23) : NULL;
    CHECK(x && x->value == 0, "never-chosen expert value %g", x ? x->value : -1);
    CHECK(p && p->heat, "plan says heat");
    planner_plan_destroy(p);
    MEASURE("heat.json: 8 layers x 32 experts over 2048 tokens; hottest expert 13 of layer 3, "
            "p = %.3f", 1698 / 2048.0);
    /* a profile of another shape is refused by the planner */
    struct planner_heat *small = NULL;
    const char *t = "{\"heat_eval_4_tokens\": [[1, 2, 3], [3, 2, 1]]}";
    CHECK(planner_heat_parse(t, strlen(t), "mem", &small) == 0, "3-expert profile parses");
    c.heat = small;
    build_err(&c, "heat profile has 2 layers x 3 experts", "heat of another shape");
    planner_heat_destroy(small);
    planner_heat_destroy(h);
}

static void test_heat_malformed(void)
{
    static const struct {
        const char *text, *needle;
    } bad[] = {
        {"", "unexpected end"},
        {"   ", "unexpected end"},
        {"[]", "'{'"},
        {"{}", "no key starting with \"heat\""},
        {"{\"steps\": 3}", "no key starting with \"heat\""},
        {"{\"heat_x\": [[1,2],[3]]}", "layer 1 has 1 experts, layer 0 has 2"},
        {"{\"heat_x\": [[1,2],[3,4,5]]}", "layer 1 has more than 2 experts"},
        {"{\"heat_x\": [[1,-2]]}", "non-negative integer"},
        {"{\"heat_x\": [[1,2.5]]}", "no fraction"},
        {"{\"heat_x\": [[1,2e3]]}", "no fraction"},
        {"{\"heat_x\": [[1,2]", "unexpected end"},
        {"{\"heat_x\": [[1,2]]} x", "end of the file"},
        {"{\"heat_x\": 5}", "'[' opening the per-layer"},
        {"{\"heat_x\": [5]}", "'[' opening a layer"},
        {"{\"heat_x\": []}", "'[' opening a layer"},
        {"{\"heat_x\": [[]]}", "non-negative integer"},
        {"{\"heat_x\": [[1,,2]]}", "non-negative integer"},
        {"{\"heat_x\": [[1 2]]}", "',' or ']'"},
        {"{\"heat_a\": [[1]], \"heat_b\": [[1]]}", "second key"},
        {"{\"heat_eval_10_tokens\": [[11, 1]]}", "chosen 11 times in 10 tokens"},
        {"{\"heat_x\": [[1]], \"z\": tru}", "a digit"},
        {"{\"heat_x\": [[1]], \"z\": \"open}", "closing quote"},
        {"{\"heat_x\" [[1]]}", "':'"},
        {"{heat_x: [[1]]}", "a string"},
        {"{\"heat_x\": [[99999999999999999999]]}", "below 2^53"},
        {"{\"heat_x\": [[1]],}", "a string"},
    };
    log_set_level(LOG_LEVEL_ERROR);
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        struct planner_heat *h = (struct planner_heat *)1;
        int rc = planner_heat_parse(bad[i].text, strlen(bad[i].text), "bad.json", &h);
        const char *msg = log_last_error();
        CHECK(rc == -EINVAL && h == NULL, "'%s' accepted (%d)", bad[i].text, rc);
        CHECK(msg && strstr(msg, bad[i].needle) && strstr(msg, "bad.json"),
              "'%s': message '%s' lacks '%s'", bad[i].text, msg ? msg : "", bad[i].needle);
    }
    /* deep nesting in an ignored key */
    char deep[400];
    size_t n = 0;
    n += (size_t)snprintf(deep, sizeof(deep), "{\"x\": ");
    for (int i = 0; i < 100; i++)
        deep[n++] = '[';
    deep[n] = 0;
    struct planner_heat *h = NULL;
    CHECK(planner_heat_parse(deep, n, "deep", &h) == -EINVAL && strstr(log_last_error(),
          "less nesting"), "deep nesting: %s", log_last_error());
    /* ignored values of every kind, escapes, no token count in the key */
    const char *ok = " {\"note\": {\"a\": [1, -2.5e-3, {\"b\": null}], \"c\": \"x\\\"y\\\\\", "
                     "\"d\": true, \"e\": false}, \"heat\": [[3, 1], [0, 4]], \"steps\": 12} \n";
    CHECK(planner_heat_parse(ok, strlen(ok), "ok", &h) == 0 && h, "valid variant: %s",
          log_last_error());
    CHECK(h && h->n_layer == 2 && h->n_expert == 2 && h->tokens == 0 && h->counts[3] == 4,
          "valid variant content");
    planner_heat_destroy(h);
    CHECK(planner_heat_load("/nonexistent/heat.json", &h) == -EIO && !h, "missing file");
}

/* Every truncation of the fixture is refused; random byte flips never crash. */
static void test_heat_fuzz(void)
{
    char path[512];
    size_t len;
    char *text = fixture_read_all(test_fixture(path, sizeof(path), HEAT), &len);
    CHECK(text != NULL, "read heat.json");
    if (!text)
        return;
    while (len && (text[len - 1] == '\n' || text[len - 1] == ' '))
        len--;
    int accepted = 0;
    for (size_t cut = 0; cut < len; cut++) {
        struct planner_heat *h = NULL;
        if (planner_heat_parse(text, cut, "cut", &h) == 0)
            accepted++;
        planner_heat_destroy(h);
    }
    CHECK(accepted == 0, "%d truncations accepted", accepted);
    uint64_t rng = 12345;
    int ok = 0;
    for (int it = 0; it < 3000; it++) {
        char *mut = malloc(len);
        if (!mut)
            break;
        memcpy(mut, text, len);
        for (int k = 0; k < 3; k++) {
            rng = rng * 6364136223846793005ull + 1442695040888963407ull;
            mut[(rng >> 33) % len] = (char)(rng >> 17);
        }
        struct planner_heat *h = NULL;
        if (planner_heat_parse(mut, len, "fuzz", &h) == 0) {
            ok++;
            CHECK(h->n_layer >= 1 && h->n_expert >= 1, "accepted profile has a shape");
        }
        planner_heat_destroy(h);
        free(mut);
    }
    MEASURE("heat parser: %zu truncations refused, %d of 3000 3-byte mutations still valid", len,
            ok);
    free(text);
}

/* ---- the Done-means bullets ---- */

/* Fits: placed, and the experts' room shrinks by exactly the placed bytes. */
static void test_fits(const struct arch_model *m, const struct sizes *s)
{
    const uint64_t room = s->lmhead + 40 * s->expert + s->expert / 2;
    struct planner_config c = base_cfg(m, s->mandatory + room);
    c.place = "experts=auto";
    struct planner_plan *a = build_ok(&c, "experts only");
    c.place = "lmhead=0,experts=auto";
    struct planner_plan *b = build_ok(&c, "lm head listed");
    if (a && b) {
        CHECK(a->dev[0].room == room && b->dev[0].room == room, "room %llu",
              (unsigned long long)a->dev[0].room);
        CHECK(a->lmhead_device == -1 && b->lmhead_device == 0 && b->dev[0].trunk == s->lmhead,
              "lm head placed and charged: %d %llu", b->lmhead_device,
              (unsigned long long)b->dev[0].trunk);
        CHECK(b->dev[0].experts + b->dev[0].free + s->lmhead ==
              a->dev[0].experts + a->dev[0].free, "expert room shrank by exactly the lm head");
        CHECK(a->dev[0].n_experts == room / s->expert &&
              b->dev[0].n_experts == (room - s->lmhead) / s->expert, "experts %u and %u",
              a->dev[0].n_experts, b->dev[0].n_experts);
    }
    planner_plan_destroy(a);
    planner_plan_destroy(b);
    /* the same by value: at miss ratio 1 the trunk (value 1) precedes every expert (p <= 1) */
    c = base_cfg(m, s->mandatory + s->trunk + 10 * s->expert + 7);
    struct planner_plan *p = build_ok(&c, "auto fits");
    if (p) {
        CHECK(p->dev[0].trunk == s->trunk && p->dev[0].n_experts == 10 && p->dev[0].free == 7,
              "trunk %llu of %llu, %u experts, %llu free", (unsigned long long)p->dev[0].trunk,
              (unsigned long long)s->trunk, p->dev[0].n_experts,
              (unsigned long long)p->dev[0].free);
        const struct planner_piece *x = find_piece(p, PLANNER_KIND_LMHEAD, 0, 0);
        CHECK(x && x->placed && x->why == PLANNER_WHY_VALUE && x->room_before - x->room_after ==
              s->lmhead && x->has_marginal, "lm head decision");
        MEASURE("fits: room %llu B = trunk %llu + 10 experts x %llu + 7 free",
                (unsigned long long)p->dev[0].room, (unsigned long long)s->trunk,
                (unsigned long long)s->expert);
    }
    planner_plan_destroy(p);
}

/* Too big: a piece larger than the room left stays in host memory; smaller ones still go. */
static void test_too_big(const struct arch_model *m, const struct sizes *s)
{
    struct planner_config c = base_cfg(m, s->mandatory + s->lmhead - 1);
    struct planner_plan *p = build_ok(&c, "too big");
    if (!p)
        return;
    const struct planner_piece *x = find_piece(p, PLANNER_KIND_LMHEAD, 0, 0);
    CHECK(p->lmhead_device == -1 && x && !x->placed && x->why == PLANNER_WHY_NO_ROOM &&
          x->room_before == s->lmhead - 1 && x->room_after == s->lmhead - 1,
          "lm head stays on the host");
    CHECK(p->dev[0].trunk > 0 && p->dev[0].free < s->smallest_trunk, "smaller trunk pieces "
          "fill the room: trunk %llu, free %llu", (unsigned long long)p->dev[0].trunk,
          (unsigned long long)p->dev[0].free);
    planner_plan_destroy(p);
}

/* Heat profile with a hot (count c0 of N = 1000) expert 0 in layer 0, others at 100. */
static struct planner_heat *heat_one_hot(uint32_t L, uint32_t E, int c0)
{
    static char t[1 << 16];
    size_t n = (size_t)snprintf(t, sizeof(t), "{\"heat_probe_1000_tokens\": [");
    for (uint32_t l = 0; l < L && n < sizeof(t); l++) {
        n += (size_t)snprintf(t + n, sizeof(t) - n, "[");
        for (uint32_t e = 0; e < E && n < sizeof(t); e++)
            n += (size_t)snprintf(t + n, sizeof(t) - n, "%d%s", l == 0 && e == 0 ? c0 : 100,
                                  e + 1 < E ? ", " : "]");
        if (n < sizeof(t))
            n += (size_t)snprintf(t + n, sizeof(t) - n, "%s", l + 1 < L ? ", " : "]}");
    }
    struct planner_heat *h = NULL;
    int rc = n < sizeof(t) ? planner_heat_parse(t, n, "hot", &h) : -1;
    CHECK(rc == 0, "hot profile parses: %s", log_last_error());
    return h;
}

/* Heat both ways: at miss ratio 2 an expert with p = 0.6 (value 1.2) keeps
 * its room against the trunk; with p = 0.4 (value 0.8) it yields it. */
static void test_heat_both_ways(const struct arch_model *m, const struct sizes *s)
{
    const uint32_t L = m->hp.n_layer, E = m->hp.n_expert;
    for (int hot = 1; hot >= 0; hot--) {
        struct planner_heat *h = heat_one_hot(L, E, hot ? 600 : 400);
        struct planner_config c = base_cfg(m, s->mandatory + s->trunk + s->expert - 1);
        c.heat = h;
        c.devices[0].mem_bw = 2 * HOST_BW;
        struct planner_plan *p = h ? build_ok(&c, hot ? "hot" : "cold") : NULL;
        if (!p) {
            planner_heat_destroy(h);
            continue;
        }
        const struct planner_piece *ex = find_piece(p, PLANNER_KIND_EXPERT, 0, 0);
        CHECK(ex && fabs(ex->value - (hot ? 1.2 : 0.8)) < 1e-12, "marginal expert value %g",
              ex ? ex->value : -1);
        int trunk_out = 0;
        const struct planner_piece *left = NULL, *lm = find_piece(p, PLANNER_KIND_LMHEAD, 0, 0);
        for (size_t i = 0; i < p->n_pieces; i++)
            if (p->pieces[i].kind <= PLANNER_KIND_SHEXP && !p->pieces[i].placed) {
                trunk_out++;
                left = &p->pieces[i];
            }
        if (hot) {
            size_t first = 0;
            while (first < p->n_pieces && p->pieces[first].why == PLANNER_WHY_MANDATORY)
                first++;
            CHECK(ex && ex->placed && ex == &p->pieces[first], "the hot expert goes first and "
                  "keeps its room");
            CHECK(trunk_out == 1 && left && left->has_marginal && left->marginal_layer == 0 &&
                  left->marginal_expert == 0 && fabs(left->marginal_value - 1.2) < 1e-12,
                  "one trunk piece yields to expert 0 of layer 0 (%d out)", trunk_out);
            CHECK(p->dev[0].trunk + (left ? left->bytes : 0) == s->trunk, "trunk charged");
        } else {
            CHECK(ex && !ex->placed && p->dev[0].n_experts == 0, "the cold expert yields");
            CHECK(trunk_out == 0 && p->dev[0].trunk == s->trunk, "the whole trunk is placed");
            CHECK(lm && lm->has_marginal && lm->marginal_layer == 0 && lm->marginal_expert == 0 &&
                  fabs(lm->marginal_value - 0.8) < 1e-12, "the lm head displaced expert 0/0");
        }
        MEASURE("heat %s: expert 0/0 value %.2f -> %s; trunk %llu of %llu B placed",
                hot ? "hot" : "cold", ex ? ex->value : -1.0,
                ex && ex->placed ? "kept" : "yielded", (unsigned long long)p->dev[0].trunk,
                (unsigned long long)s->trunk);
        planner_plan_destroy(p);
        planner_heat_destroy(h);
    }
}

/* The same without a heat file: p = top_k / n_expert = 1/8 here; at miss
 * ratio 10 (value 1.25) experts go first, at ratio 2 (0.25) the trunk does. */
static void test_uniform_both_ways(const struct arch_model *m, const struct sizes *s)
{
    const uint64_t room = s->trunk + 3 * s->expert - 1;
    for (int hot = 1; hot >= 0; hot--) {
        struct planner_config c = base_cfg(m, s->mandatory + room);
        c.devices[0].mem_bw = (hot ? 10 : 2) * HOST_BW;
        struct planner_plan *p = build_ok(&c, hot ? "uniform hot" : "uniform cold");
        if (!p)
            continue;
        const struct planner_piece *ex = find_piece(p, PLANNER_KIND_EXPERT, 5, 7);
        CHECK(ex && fabs(ex->value - (hot ? 1.25 : 0.25)) < 1e-12, "uniform value %g",
              ex ? ex->value : -1);
        if (hot) {
            CHECK(p->dev[0].n_experts == room / s->expert, "experts first: %u of room for %llu",
                  p->dev[0].n_experts, (unsigned long long)(room / s->expert));
            CHECK(p->dev[0].trunk < s->trunk, "the trunk yields");
            /* equally valued experts spread over the layers: expert ids first */
            CHECK(p->layers[0].n_resident >= p->layers[7].n_resident &&
                  p->layers[0].n_resident <= p->layers[7].n_resident + 1, "spread %u vs %u",
                  p->layers[0].n_resident, p->layers[7].n_resident);
        } else {
            CHECK(p->dev[0].trunk == s->trunk && p->dev[0].n_experts == 2,
                  "trunk first, then 2 experts: %u", p->dev[0].n_experts);
        }
        MEASURE("no heat, miss ratio %d: %u experts, trunk %llu of %llu B", hot ? 10 : 2,
                p->dev[0].n_experts, (unsigned long long)p->dev[0].trunk,
                (unsigned long long)s->trunk);
        planner_plan_destroy(p);
    }
    /* dense_miss_ratio: at any ratio the trunk precedes uniform experts */
    struct planner_config c = base_cfg(m, s->mandatory + room);
    c.devices[0].mem_bw = 10 * HOST_BW;
    c.dense_miss_ratio = true;
    struct planner_plan *p = build_ok(&c, "dense at miss ratio");
    CHECK(p && p->dev[0].trunk == s->trunk && p->dev[0].n_experts == 2,
          "dense_miss_ratio: trunk first");
    planner_plan_destroy(p);
}

/* Room nobody would use goes to the trunk: every expert outranks it, all fit,
 * and the leftover takes trunk pieces. */
static void test_leftover_to_trunk(const struct arch_model *m, const struct sizes *s)
{
    struct planner_config c = base_cfg(m, s->mandatory + s->experts_all + s->lmhead + 1);
    c.devices[0].mem_bw = 10 * HOST_BW;
    struct planner_plan *p = build_ok(&c, "leftover");
    if (!p)
        return;
    CHECK(p->dev[0].experts == s->experts_all, "every expert placed");
    CHECK(p->lmhead_device == 0 && p->dev[0].trunk == s->lmhead && p->dev[0].free == 1,
          "the leftover went to the lm head: trunk %llu free %llu",
          (unsigned long long)p->dev[0].trunk, (unsigned long long)p->dev[0].free);
    planner_plan_destroy(p);
}

/* Explicit list: obeyed (pins the split) and charged; errors name the token. */
static void test_list(const struct arch_model *m, const struct sizes *s)
{
    struct planner_config c = base_cfg(m, 1ull << 30);
    c.n_devices = 2;
    c.devices[1] = c.devices[0];
    c.devices[1].mem_bw = 8 * HOST_BW; /* auto alone would give device 1 most layers */
    c.place = "lmhead=0,dnproj=0:0-2+1:4-6,experts=all";
    struct planner_plan *p = build_ok(&c, "list");
    if (p) {
        CHECK(p->dev[0].layer_begin == 0 && (p->dev[0].layer_end == 3 ||
              p->dev[0].layer_end == 4), "pins honoured: device 0 has %u-%u",
              p->dev[0].layer_begin, p->dev[0].layer_end - 1);
        uint64_t t0 = s->lmhead, t1 = 0;
        for (uint32_t l = 0; l < p->n_layer; l++) {
            const struct planner_layer_plan *lp = &p->layers[l];
            CHECK(lp->proj == lp->recurrent && !lp->shexp, "layer %u: proj %d shexp %d", l,
                  lp->proj, lp->shexp);
            CHECK(lp->n_resident == p->n_expert, "layer %u: all experts", l);
            if (lp->proj)
                *(lp->device ? &t1 : &t0) += lp->proj_bytes;
        }
        CHECK(p->lmhead_device == 0 && p->dev[0].trunk == t0 && p->dev[1].trunk == t1,
              "charged %llu/%llu and %llu/%llu", (unsigned long long)p->dev[0].trunk,
              (unsigned long long)t0, (unsigned long long)p->dev[1].trunk,
              (unsigned long long)t1);
        const struct planner_piece *x = find_piece(p, PLANNER_KIND_PROJ, 3, 0);
        CHECK(x && !x->placed && x->why == PLANNER_WHY_UNLISTED, "attention proj not listed");
    }
    planner_plan_destroy(p);
    /* the same list with explicit ranges that contradict it */
    c.layers = "0-4,5-7";
    build_err(&c, "'dnproj=0:0-2+1:4-6' names layer 4 for device 1", "pin against --layers");
    c.layers = "0-3,4-7";
    struct planner_plan *q = build_ok(&c, "list with matching ranges");
    planner_plan_destroy(q);
    c.layers = NULL;
    /* a list that cannot fit names the device and the bytes */
    c.devices[1].budget = s->mandatory + s->experts_all / 4;
    build_err(&c, "device 1 (cpu) cannot hold the listed pieces", "list too big");
    c.devices[1].budget = 1ull << 30;
    /* auto for the rest, listed pieces first */
    c.place = "shexp=all,experts=auto,lmhead=auto";
    c.devices[0].budget = c.devices[1].budget = s->mandatory + s->trunk / 2;
    q = build_ok(&c, "shexp listed, rest auto");
    for (uint32_t l = 0; q && l < q->n_layer; l++)
        CHECK(q->layers[l].shexp && !q->layers[l].proj, "layer %u: shexp listed, proj not", l);
    planner_plan_destroy(q);
    static const struct {
        const char *spec, *needle;
    } bad[] = {
        {"lmhead", "'lmhead': expected PIECE=TARGET"},
        {"foo=0", "'foo=0': unknown piece"},
        {"lmhead=5", "'lmhead=5': device 5 does not exist"},
        {"dnproj=0:3-1", "'dnproj=0:3-1': layers 3-1"},
        {"dnproj=0:0-99", "'dnproj=0:0-99': layers 0-99"},
        {"experts=all,experts=none", "'experts=none': this piece is already named"},
        {"proj=0,dnproj=1", "'dnproj=1': this piece is already named"},
        {"dnproj=0:0-2+1:1-4", "layer 1 is also named for device 0"},
        {"lmhead=0:1-2", "'lmhead=0:1-2': the lm head takes one device"},
        {"experts=0+", "'experts=0+': empty selection"},
        {"experts=", "'experts=': empty selection"},
        {",lmhead=0", "empty item"},
        {"attn=x", "'attn=x': expected all, none, auto or a device"},
        {"attn=0:1x", "'attn=0:1x': unexpected characters"},
        {"dnproj=1:0-1+0:4-5", "cannot be split into 2 contiguous ranges"},
    };
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        c.place = bad[i].spec;
        CHECK(build_err(&c, bad[i].needle, bad[i].spec) == -EINVAL, "%s: -EINVAL", bad[i].spec);
    }
    c.place = NULL;
    c.layers = "0-3,5-7";
    build_err(&c, "--layers '0-3,5-7' must list 2 contiguous ranges", "gap in --layers");
    c.layers = "0-3,4-7,";
    build_err(&c, "must list 2 contiguous ranges", "trailing comma in --layers");
}

/* off: no trunk piece is placed; k experts in every layer, rotated ids. */
/* A device whose backend holds the trunk anyway (the CUDA backend): the
 * projections, shared experts and lm head are charged to it whatever the
 * spec; with off the experts fill the rest, k per layer; a budget without
 * room for the trunk fails naming the reason. */
static void test_holds_trunk(const struct arch_model *m, const struct sizes *s)
{
    const uint32_t L = m->hp.n_layer;
    static const char *const specs[] = {"off", "auto",
                                        "lmhead=none,proj=none,shexp=none,experts=auto"};
    for (size_t i = 0; i < sizeof(specs) / sizeof(specs[0]); i++) {
        struct planner_config c = base_cfg(m, s->mandatory + s->trunk + 3ull * L * s->expert + 5);
        c.devices[0].name = "cuda:0";
        c.devices[0].holds_trunk = true;
        c.place = specs[i];
        struct planner_plan *p = build_ok(&c, specs[i]);
        if (!p)
            continue;
        bool all = p->lmhead_device == 0;
        for (uint32_t l = 0; l < L; l++)
            all &= p->layers[l].proj && (p->layers[l].shexp || !p->layers[l].shexp_bytes) &&
                   (i || p->layers[l].n_resident == 3);
        CHECK(all && p->dev[0].trunk == s->trunk && p->dev[0].experts == 3ull * L * s->expert,
              "%s with a backend that holds the trunk: trunk %llu of %llu, experts %llu of %llu",
              specs[i], (unsigned long long)p->dev[0].trunk, (unsigned long long)s->trunk,
              (unsigned long long)p->dev[0].experts, 3ull * L * s->expert);
        planner_plan_destroy(p);
    }
    struct planner_config c = base_cfg(m, s->mandatory + s->trunk - 1);
    c.devices[0].holds_trunk = true;
    c.place = "off";
    struct planner_plan *p = NULL;
    log_set_level(LOG_LEVEL_ERROR);
    const int rc = planner_build(&c, &p);
    log_set_level(LOG_LEVEL_WARN);
    CHECK(rc == -ENOSPC && !p && strstr(log_last_error(), "its backend holds"),
          "a budget one byte short of the held trunk: rc %d, '%s'", rc, log_last_error());
    MEASURE("backend that holds the trunk: off/auto/experts-only lists all charge the %llu B "
            "trunk and fill the rest with experts; one byte short fails",
            (unsigned long long)s->trunk);
}

static void test_off(const struct arch_model *m, const struct sizes *s)
{
    const uint32_t L = m->hp.n_layer, E = m->hp.n_expert;
    struct planner_config c = base_cfg(m, s->mandatory + s->trunk + 5ull * L * s->expert + 3);
    c.place = "off";
    struct planner_plan *p = build_ok(&c, "off");
    if (!p)
        return;
    const uint32_t k = (uint32_t)((s->trunk + 5ull * L * s->expert + 3) / (L * s->expert));
    CHECK(p->lmhead_device == -1 && p->dev[0].trunk == 0, "off places no trunk");
    for (uint32_t l = 0; l < L; l++) {
        CHECK(!p->layers[l].proj && !p->layers[l].shexp && p->layers[l].n_resident == k,
              "layer %u: %u experts (want %u)", l, p->layers[l].n_resident, k);
        for (uint32_t j = 0; j < E; j++)
            CHECK(bit(planner_bitmap(p, l), (j + l) % E) == (j < k), "layer %u rotated id %u", l,
                  j);
    }
    const struct planner_piece *x = find_piece(p, PLANNER_KIND_PROJ, 2, 0);
    CHECK(x && !x->placed && x->why == PLANNER_WHY_OFF, "proj decision says off");
    MEASURE("off: 0 trunk bytes, %u experts per layer (%llu B); auto with the same budget "
            "places the %llu B trunk", k, (unsigned long long)p->dev[0].experts,
            (unsigned long long)s->trunk);
    planner_plan_destroy(p);
}

/* Bytes per token of a layer, written out independently of the planner. */
static uint64_t layer_cost(const struct arch_model *m, uint32_t l)
{
    const struct arch_layer *ly = &m->layers[l];
    const struct arch_matrix *ms[] = {&ly->wq, &ly->wk, &ly->wv, &ly->wo, &ly->wqkv, &ly->wz,
                                      &ly->win, &ly->wba, &ly->wbeta, &ly->walpha, &ly->wout,
                                      &ly->router, &ly->gate_sh, &ly->up_sh, &ly->down_sh};
    uint64_t b = 0;
    for (size_t i = 0; i < sizeof(ms) / sizeof(ms[0]); i++)
        b += ms[i]->data ? ms[i]->mat_bytes : 0;
    uint64_t ex = ly->down_exps.mat_bytes + (ly->gate_exps.data ? ly->gate_exps.mat_bytes +
                                             ly->up_exps.mat_bytes : ly->gate_up_exps.mat_bytes);
    b += ex * m->hp.n_expert_used;
    if (ly->recurrent) {
        const struct arch_hparams *hp = &m->hp;
        uint64_t conv = 2ull * hp->ssm_nk * hp->ssm_dk + (uint64_t)hp->ssm_nv * hp->ssm_dv;
        b += (conv * (hp->ssm_conv - 1) + (uint64_t)hp->ssm_nv * hp->ssm_dv * hp->ssm_dk) * 4;
    }
    return b;
}

/* Two devices of different budgets and speeds get the minimax split. */
static void test_split(const struct arch_model *m)
{
    const uint32_t L = m->hp.n_layer;
    const double bws[][3] = {{30e9, 10e9, 0}, {10e9, 30e9, 0}, {10e9, 10e9, 0},
                             {10e9, 70e9, 0}, {50e9, 20e9, 10e9}};
    for (size_t t = 0; t < sizeof(bws) / sizeof(bws[0]); t++) {
        const int D = bws[t][2] > 0 ? 3 : 2;
        struct planner_config c = base_cfg(m, 64ull << 20);
        c.n_devices = D;
        for (int d = 0; d < D; d++) {
            c.devices[d] = c.devices[0];
            c.devices[d].budget = (64ull >> d) << 20;
            c.devices[d].mem_bw = bws[t][d];
        }
        struct planner_plan *p = build_ok(&c, "split");
        if (!p)
            continue;
        /* brute force over every boundary pair */
        double best = INFINITY;
        uint32_t b1 = 0;
        for (uint32_t x = 1; x < L; x++)
            for (uint32_t y = D == 3 ? x + 1 : L; y <= L - (D == 3) && (D == 3 || y == L); y++) {
                uint64_t part[3] = {0};
                for (uint32_t l = 0; l < L; l++)
                    part[l < x ? 0 : l < y ? 1 : 2] += layer_cost(m, l);
                double mx = 0;
                for (int d = 0; d < D; d++) {
                    double tm = (double)part[d] / bws[t][d];
                    mx = tm > mx ? tm : mx;
                }
                if (mx < best) {
                    best = mx;
                    b1 = x;
                }
            }
        double got = 0;
        for (int d = 0; d < D; d++) {
            uint64_t bytes = 0;
            for (uint32_t l = p->dev[d].layer_begin; l < p->dev[d].layer_end; l++)
                bytes += layer_cost(m, l);
            CHECK(bytes == p->dev[d].range_bytes, "range bytes of device %d", d);
            double tm = (double)bytes / bws[t][d];
            got = tm > got ? tm : got;
        }
        CHECK(got == best, "case %zu: max time %g, brute force %g", t, got, best);
        if (D == 2)
            CHECK(p->dev[0].layer_end == b1, "case %zu: boundary %u, brute force %u", t,
                  p->dev[0].layer_end, b1);
        char third[48] = "";
        if (D == 3)
            snprintf(third, sizeof(third), ", device 2 (%.0f GB/s) %u-%u", bws[t][2] / 1e9,
                     p->dev[2].layer_begin, p->dev[2].layer_end - 1);
        MEASURE("split at %.0f/%.0f GB/s: device 0 layers %u-%u, device 1 %u-%u%s; slowest "
                "range %.3f ms (brute force agrees)", bws[t][0] / 1e9, bws[t][1] / 1e9,
                p->dev[0].layer_begin, p->dev[0].layer_end - 1, p->dev[1].layer_begin,
                p->dev[1].layer_end - 1, third, best * 1e3);
        planner_plan_destroy(p);
    }
}

/* Equal value: the lm head goes to the device with the most room. */
static void test_most_room(const struct arch_model *m, const struct sizes *s)
{
    for (int big = 0; big < 2; big++) {
        struct planner_config c = base_cfg(m, 0);
        c.n_devices = 2;
        c.devices[1] = c.devices[0];
        c.devices[big].budget = 64ull << 20;
        c.devices[1 - big].budget = s->mandatory + s->lmhead * 2;
        struct planner_plan *p = build_ok(&c, "most room");
        CHECK(p && p->lmhead_device == big, "lm head on device %d, want %d",
              p ? p->lmhead_device : -2, big);
        planner_plan_destroy(p);
    }
}

/* --experts-home: range (or NULL) gives the same plan as before; any puts the
 * experts the small device leaves in host memory into the big device's room
 * left, most valuable first, within its budget; a bad value is refused. */
static void test_experts_any(const struct arch_model *m, const struct sizes *s)
{
    struct planner_config c = base_cfg(m, 0);
    c.n_devices = 2;
    c.devices[1] = c.devices[0];
    c.layers = "0-3,4-7";
    c.devices[0].budget = s->mandatory + s->trunk + 8 * s->expert; /* most experts on host */
    c.devices[1].budget = 64ull << 20;                            /* room to spare */
    struct planner_plan *r0 = build_ok(&c, "home default");
    c.experts_home = "range";
    struct planner_plan *r1 = build_ok(&c, "home range");
    c.experts_home = "any";
    struct planner_plan *a = build_ok(&c, "home any");
    if (!r0 || !r1 || !a)
        goto out;
    CHECK(r0->n_pieces == r1->n_pieces &&
          !memcmp(r0->pieces, r1->pieces, r0->n_pieces * sizeof(*r0->pieces)) &&
          !memcmp(r0->dev, r1->dev, sizeof(r0->dev)), "range: the same plan as the default");
    CHECK(!r1->experts_any && r1->dev[1].n_foreign == 0 && r1->dev[0].n_foreign == 0,
          "range: no foreign experts");
    uint32_t host0 = 0; /* experts of device 0's layers left on the host by range */
    for (uint32_t l = 0; l < 4; l++)
        host0 += a->n_expert - r1->layers[l].n_resident;
    CHECK(host0 > 0, "device 0 leaves experts on the host (%u)", host0);
    CHECK(a->dev[1].n_foreign == host0 && a->dev[0].n_foreign == 0,
          "any: device 1 holds all %u of them (holds %u; device 0 %u)", host0,
          a->dev[1].n_foreign, a->dev[0].n_foreign);
    CHECK(a->dev[1].free == r1->dev[1].free - a->dev[1].foreign &&
          a->dev[1].foreign == (uint64_t)host0 * s->expert,
          "any: device 1's room left pays for them");
    for (uint32_t l = 0; l < a->n_layer; l++) {
        CHECK(!memcmp(planner_bitmap(a, l), planner_bitmap(r1, l), (a->n_expert + 7) / 8),
              "any: layer %u own residency unchanged", l);
        for (uint32_t e = 0; e < a->n_expert && l < 4; e++)
            CHECK(planner_holder(a, l, e) == (bit(planner_bitmap(a, l), e) ? 0 : 1),
                  "any: layer %u expert %u held by %d", l, e, planner_holder(a, l, e));
    }
    const struct planner_piece *f = NULL;
    for (size_t i = 0; i < a->n_pieces && !f; i++)
        if (a->pieces[i].why == PLANNER_WHY_FOREIGN)
            f = &a->pieces[i];
    CHECK(f && f->device == 1 && f->placed && f->layer < 4 &&
          fabs(f->value - (double)a->top_k / a->n_expert * a->dev[1].miss_ratio *
                          PLANNER_FOREIGN_DISCOUNT) < 1e-9, "any: a foreign decision on "
          "device 1 valued p x ratio x discount");
    /* the budget bounds it: room for 5 foreign experts only */
    const uint64_t room1 = r1->dev[1].budget - r1->dev[1].free + 5 * s->expert + s->expert / 2;
    c.devices[1].budget = room1;
    planner_plan_destroy(a);
    a = build_ok(&c, "home any, tight");
    CHECK(a && a->dev[1].n_foreign == 5 && a->dev[1].free < s->expert,
          "any, tight: 5 foreign experts (%u), %llu B left", a ? a->dev[1].n_foreign : 0,
          a ? (unsigned long long)a->dev[1].free : 0ull);
    if (a) {
        char *buf = NULL;
        size_t len = 0;
        FILE *mf = open_memstream(&buf, &len);
        planner_print_table(a, mf);
        planner_print_decisions(a, mf, false);
        fclose(mf);
        CHECK(buf && strstr(buf, "foreign: device 1 (cpu) holds 5 routed experts") &&
              strstr(buf, "foreign routed experts held for device 0") &&
              strstr(buf, "(foreign)") == NULL, "any: the table and [place] lines name the "
              "foreign holdings");
        free(buf);
    }
    c.experts_home = "everywhere";
    build_err(&c, "--experts-home 'everywhere' must be range or any", "home bad");
out:
    planner_plan_destroy(r0);
    planner_plan_destroy(r1);
    planner_plan_destroy(a);
}

/* Nothing movable: the plan is a no-op, not an error; mandatory overflow is. */
static void test_nothing(const struct arch_model *m, const struct sizes *s)
{
    struct planner_config c = base_cfg(m, s->mandatory);
    struct planner_plan *p = build_ok(&c, "no room");
    if (p) {
        CHECK(p->dev[0].room == 0 && p->dev[0].trunk == 0 && p->dev[0].experts == 0 &&
              p->lmhead_device == -1, "nothing placed");
        for (size_t i = 0; i < p->n_pieces; i++)
            CHECK(p->pieces[i].why == PLANNER_WHY_MANDATORY ||
                  (!p->pieces[i].placed && p->pieces[i].why == PLANNER_WHY_NO_ROOM),
                  "piece %zu: %d", i, p->pieces[i].why);
    }
    planner_plan_destroy(p);
    c = base_cfg(m, 1ull << 30);
    c.place = "experts=none";
    p = build_ok(&c, "list places nothing");
    CHECK(p && p->dev[0].trunk == 0 && p->dev[0].experts == 0 &&
          p->dev[0].free == p->dev[0].room, "empty list is a no-op");
    planner_plan_destroy(p);
    c = base_cfg(m, s->mandatory - 1);
    CHECK(build_err(&c, "device 0 (cpu): budget", "mandatory overflow") == -ENOSPC, "ENOSPC");
    c = base_cfg(m, 0);
    build_err(&c, "device 0 (cpu): memory budget unknown", "budget 0");
    c = base_cfg(m, 1ull << 30);
    c.n_devices = 9;
    for (int d = 1; d < 9; d++)
        c.devices[d] = c.devices[0];
    build_err(&c, "9 devices for 8 layers", "more devices than layers");
    /* default margin: 2 % of the budget */
    c = base_cfg(m, 100ull << 20);
    c.margin_frac = 0;
    p = build_ok(&c, "default margin");
    CHECK(p && p->dev[0].margin == (uint64_t)((100ull << 20) * PLANNER_MARGIN_DEFAULT),
          "default margin %llu", p ? (unsigned long long)p->dev[0].margin : 0ull);
    planner_plan_destroy(p);
}

/* A model without shared experts (qwen3moe): pieces and accounting still hold. */
static void test_qwen3moe(const struct arch_model *m)
{
    struct sizes s = sizes_of(m);
    struct planner_config c = base_cfg(m, s.mandatory + s.trunk + 3 * s.expert);
    c.place = "shexp=all,proj=all,lmhead=all,experts=auto";
    struct planner_plan *p = build_ok(&c, "qwen3moe list");
    CHECK(p && p->dev[0].trunk == s.trunk && p->dev[0].n_experts == 3, "qwen3moe charged");
    for (uint32_t l = 0; p && l < p->n_layer; l++)
        CHECK(p->layers[l].shexp_bytes == 0 && !p->layers[l].shexp, "no shared expert");
    planner_plan_destroy(p);
}

/* The explanation: [place] lines and the table. */
static void test_print(const struct arch_model *m, const struct sizes *s)
{
    char path[512];
    struct planner_heat *h = NULL;
    planner_heat_load(test_fixture(path, sizeof(path), HEAT), &h);
    struct planner_config c = base_cfg(m, s->mandatory + s->trunk / 2 + 100 * s->expert);
    c.n_devices = 2;
    c.devices[1] = c.devices[0];
    c.devices[1].name = "cpu1";
    c.devices[0].mem_bw = 3 * HOST_BW;
    c.heat = h;
    struct planner_plan *p = build_ok(&c, "print");
    char *buf = NULL;
    size_t len = 0;
    FILE *f = open_memstream(&buf, &len);
    if (p && f) {
        planner_print_decisions(p, f, false);
        planner_print_table(p, f);
        fclose(f);
        int lines = 0;
        for (char *q = buf; (q = strstr(q, "[place]")); q++)
            lines++;
        CHECK(lines >= 2 + 2 * 8 + 1 + 8 && strstr(buf, "displaces expert") &&
              strstr(buf, "DeltaNet state") && strstr(buf, "best left out") &&
              strstr(buf, "deltanet") && strstr(buf, "cpu1"), "explanation:\n%s", buf);
        fputs(buf, stdout);
        MEASURE("explanation of a 2-device plan: %d [place] lines, %zu bytes", lines, len);
    }
    free(buf);
    planner_plan_destroy(p);
    planner_heat_destroy(h);
}

/* ---- the 80b-a3b shape, from sizes alone ---- */

struct fake {
    struct arch_model m;
    struct arch_layer layers[48];
};

static void fake_mat(struct arch_matrix *a, uint32_t type, uint64_t n_in, uint64_t n_out)
{
    static const uint8_t dummy = 0;
    a->data = &dummy;
    a->type = type;
    a->n_in = n_in;
    a->n_out = n_out;
    a->n_mat = 1;
    a->row_bytes = quant_row_size(type, n_in);
    a->mat_bytes = n_out * a->row_bytes;
}

/* Qwen3-Next-80B-A3B at Q4_K (lm head Q6_K, router F32): hidden 2048, 48
 * layers (every 4th attention), 512 experts of 512, top 10, shared expert 512. */
static void fake_80b(struct fake *f)
{
    memset(f, 0, sizeof(*f));
    struct arch_hparams *hp = &f->m.hp;
    *hp = (struct arch_hparams){.kind = ARCH_KIND_QWEN3NEXT, .arch_name = "qwen3next",
                                .n_layer = 48, .n_embd = 2048, .n_vocab = 151936, .n_head = 16,
                                .n_head_kv = 2, .head_dim = 256, .attn_gated = true,
                                .n_expert = 512, .n_expert_used = 10, .n_ff_exp = 512,
                                .n_ff_shexp = 512, .ssm_conv = 4, .ssm_dk = 128, .ssm_dv = 128,
                                .ssm_nk = 16, .ssm_nv = 32, .full_attn_interval = 4};
    const uint32_t Q4 = QUANT_TYPE_Q4_K;
    fake_mat(&f->m.output, QUANT_TYPE_Q6_K, 2048, 151936);
    fake_mat(&f->m.tok_embd, Q4, 2048, 151936);
    f->m.layers = f->layers;
    for (int l = 0; l < 48; l++) {
        struct arch_layer *ly = &f->layers[l];
        ly->recurrent = l % 4 != 3;
        if (ly->recurrent) {
            fake_mat(&ly->wqkv, Q4, 2048, 2 * 16 * 128 + 32 * 128);
            fake_mat(&ly->wz, Q4, 2048, 32 * 128);
            fake_mat(&ly->wba, Q4, 2048, 64);
            fake_mat(&ly->wout, Q4, 4096, 2048);
        } else {
            fake_mat(&ly->wq, Q4, 2048, 16 * 256 * 2);
            fake_mat(&ly->wk, Q4, 2048, 512);
            fake_mat(&ly->wv, Q4, 2048, 512);
            fake_mat(&ly->wo, Q4, 4096, 2048);
        }
        fake_mat(&ly->router, QUANT_TYPE_F32, 2048, 512);
        fake_mat(&ly->gate_exps, Q4, 2048, 512);
        fake_mat(&ly->up_exps, Q4, 2048, 512);
        fake_mat(&ly->down_exps, Q4, 512, 2048);
        fake_mat(&ly->gate_sh, Q4, 2048, 512);
        fake_mat(&ly->up_sh, Q4, 2048, 512);
        fake_mat(&ly->down_sh, Q4, 512, 2048);
    }
}

/* A Zipf(0.8) heat profile over 10000 tokens, ranks permuted per layer. */
static struct planner_heat *zipf_heat(uint32_t L, uint32_t E, uint32_t K)
{
    struct planner_heat *h = calloc(1, sizeof(*h));
    h->n_layer = L;
    h->n_expert = E;
    h->tokens = 10000;
    h->counts = calloc((size_t)L * E, sizeof(uint64_t));
    double z = 0;
    for (uint32_t r = 0; r < E; r++)
        z += pow(r + 1, -0.8);
    for (uint32_t l = 0; l < L; l++)
        for (uint32_t r = 0; r < E; r++) {
            double p = K * pow(r + 1, -0.8) / z;
            p = p > 0.9 ? 0.9 : p;
            h->counts[(size_t)l * E + (r * 263 + l * 31) % E] = (uint64_t)(p * 10000);
        }
    return h;
}

static void test_80b_sample(void)
{
    static struct fake f;
    fake_80b(&f);
    struct planner_heat *h = zipf_heat(48, 512, 10);
    /* one H200 at 8 GiB: HBM 4.8 TB/s, PCIe 5 x16 55 GB/s, host DRAM 200 GB/s, ctx 32k */
    struct planner_config c = {.model = &f.m, .n_devices = 1, .host_bw = 200e9, .n_ctx = 32768,
                               .kv_f16 = true, .max_batch = 256, .heat = h};
    c.devices[0] = (struct planner_device){.name = "h200", .budget = 8ull << 30,
                                           .mem_bw = 4.8e12, .host_path_bw = 55e9};
    for (int dm = 0; dm < 2; dm++) {
        c.dense_miss_ratio = dm;
        struct planner_plan *p = build_ok(&c, "80b-a3b");
        if (!p)
            continue;
        if (dm) {
            planner_print_decisions(p, stdout, false);
            planner_print_table(p, stdout);
        }
        const struct planner_device_plan *d = &p->dev[0];
        MEASURE("80b-a3b Q4_K on one H200 at 8 GiB, ctx 32k, %s: KV %.0f MiB, state %.0f MiB, "
                "trunk %.0f MiB%s, %u experts (%.2f GiB, %.1f%% of %u), free %.0f MiB",
                dm ? "dense at miss ratio" : "dense value 1 (issue)", d->kv / 1048576.0,
                d->state / 1048576.0, d->trunk / 1048576.0, d->lmhead ? " incl. lm head" : "",
                d->n_experts, d->experts / 1073741824.0, 100.0 * d->n_experts / (48 * 512),
                48 * 512, d->free / 1048576.0);
        planner_plan_destroy(p);
    }
    /* two unequal cards: H200 16 GiB and a 0.96 TB/s card at 8 GiB */
    c.n_devices = 2;
    c.dense_miss_ratio = true;
    c.devices[0].budget = 16ull << 30;
    c.devices[1] = (struct planner_device){.name = "l40s", .budget = 8ull << 30,
                                           .mem_bw = 0.96e12, .host_path_bw = 27e9};
    struct planner_plan *p = build_ok(&c, "80b-a3b two cards");
    if (p) {
        planner_print_table(p, stdout);
        MEASURE("80b-a3b on H200 16G + L40S 8G: layers %u-%u / %u-%u, %.3f / %.3f ms per "
                "range, experts %u / %u", p->dev[0].layer_begin, p->dev[0].layer_end - 1,
                p->dev[1].layer_begin, p->dev[1].layer_end - 1, p->dev[0].range_ms,
                p->dev[1].range_ms, p->dev[0].n_experts, p->dev[1].n_experts);
    }
    planner_plan_destroy(p);
    planner_heat_destroy(h);
}

static void test_parse_devices(void)
{
    struct planner_config c = {0};
    char store[PLANNER_MAX_DEVICES][PLANNER_NAME_MAX];
    int rc = planner_parse_devices(&c, store, "cpu,cuda:1", "8G,512M", "3350,1000", "55");
    CHECK(rc == 0 && c.n_devices == 2 && !strcmp(c.devices[1].name, "cuda:1") &&
          c.devices[0].budget == (8ull << 30) && c.devices[1].budget == (512ull << 20) &&
          c.devices[0].mem_bw == 3350e9 && c.devices[1].host_path_bw == 55e9,
          "device lists parsed");
    rc = planner_parse_devices(&c, store, "cpu,cpu", "6GiB", NULL, NULL);
    CHECK(rc == 0 && c.devices[1].budget == (6ull << 30) && c.devices[1].mem_bw == 0,
          "one size for all");
    log_set_level(LOG_LEVEL_ERROR);
    CHECK(planner_parse_devices(&c, store, "cpu,cpu", "6G,7G,8G", NULL, NULL) == -EINVAL &&
          strstr(log_last_error(), "one size or one per device"), "size count");
    CHECK(planner_parse_devices(&c, store, "cpu", "6Q", NULL, NULL) == -EINVAL &&
          strstr(log_last_error(), "'6Q'"), "bad size");
    CHECK(planner_parse_devices(&c, store, "cpu,,cpu", "6G", NULL, NULL) == -EINVAL, "empty");
    CHECK(planner_parse_devices(&c, store, "cpu", "6G", "-3", NULL) == -EINVAL &&
          strstr(log_last_error(), "'-3'"), "bad bandwidth");
}

/* Probe figures (planner_probe_devices): stated figures give the same plan as
 * figures set directly, a slower card gets fewer layers, given figures stay,
 * off sets nothing, bad specs are refused naming the token; auto probes the
 * host and leaves devices it cannot probe here at their defaults. */
static void test_probe_figures(const struct arch_model *m)
{
    struct planner_config direct = base_cfg(m, 64ull << 20);
    direct.n_devices = 2;
    direct.devices[0] = (struct planner_device){.name = "g0", .budget = 4ull << 20,
                                                .mem_bw = 3000e9, .host_path_bw = 50e9};
    direct.devices[1] = (struct planner_device){.name = "g1", .budget = 3ull << 20,
                                                .mem_bw = 1000e9, .host_path_bw = 25e9};
    direct.host_bw = 20e9;
    struct planner_config stated = direct;
    stated.host_bw = 0;
    for (int d = 0; d < 2; d++)
        stated.devices[d].mem_bw = stated.devices[d].host_path_bw = 0;
    int rc = planner_probe_devices(&stated, "cpu=20,g0=3000:50,g1=1000:25", 0, true);
    CHECK(rc == 0 && stated.host_bw == 20e9 && stated.devices[0].mem_bw == 3000e9 &&
          stated.devices[0].host_path_bw == 50e9 && stated.devices[1].mem_bw == 1000e9 &&
          stated.devices[1].host_path_bw == 25e9, "stated figures set (rc %d)", rc);
    struct planner_plan *a = build_ok(&direct, "probe direct");
    struct planner_plan *b = build_ok(&stated, "probe stated");
    for (int d = 0; a && b && d < 2; d++)
        CHECK(a->dev[d].layer_begin == b->dev[d].layer_begin &&
              a->dev[d].layer_end == b->dev[d].layer_end &&
              a->dev[d].n_experts == b->dev[d].n_experts && a->dev[d].trunk == b->dev[d].trunk &&
              a->dev[d].miss_ratio == b->dev[d].miss_ratio, "device %d: same plan", d);
    if (b) {
        CHECK(b->dev[0].miss_ratio == 150.0 && b->dev[1].miss_ratio == 50.0,
              "miss ratios %g %g (gemv / min(h2d, host))", b->dev[0].miss_ratio,
              b->dev[1].miss_ratio);
        CHECK(b->dev[1].layer_end - b->dev[1].layer_begin <
                  b->dev[0].layer_end - b->dev[0].layer_begin,
              "the slower card has fewer layers (%u-%u, %u-%u)", b->dev[0].layer_begin,
              b->dev[0].layer_end - 1, b->dev[1].layer_begin, b->dev[1].layer_end - 1);
        MEASURE("probe figures 3000/50 and 1000/25 GB/s, host 20: layers %u-%u / %u-%u, "
                "miss ratios %.0f / %.0f, experts %u / %u", b->dev[0].layer_begin,
                b->dev[0].layer_end - 1, b->dev[1].layer_begin, b->dev[1].layer_end - 1,
                b->dev[0].miss_ratio, b->dev[1].miss_ratio, b->dev[0].n_experts,
                b->dev[1].n_experts);
    }
    planner_plan_destroy(a);
    planner_plan_destroy(b);

    struct planner_config c = stated; /* given figures stay; G alone leaves the path */
    c.devices[1].mem_bw = c.devices[1].host_path_bw = 0;
    rc = planner_probe_devices(&c, "g0=1:1,g1=700", 0, true);
    CHECK(rc == 0 && c.devices[0].mem_bw == 3000e9 && c.devices[0].host_path_bw == 50e9 &&
          c.devices[1].mem_bw == 700e9 && c.devices[1].host_path_bw == 0 && c.host_bw == 20e9,
          "given figures kept, G alone sets mem_bw only");
    c = base_cfg(m, 1ull << 20);
    c.n_devices = 2;
    c.devices[0].name = c.devices[1].name = "g0";
    c.host_bw = 0;
    rc = planner_probe_devices(&c, "off", 0, true);
    CHECK(rc == 0 && c.host_bw == 0 && c.devices[0].mem_bw == 0, "off sets nothing");
    rc = planner_probe_devices(&c, "g0=100:10,cpu=5", 0, true);
    CHECK(rc == 0 && c.devices[1].mem_bw == 100e9 && c.devices[1].host_path_bw == 10e9 &&
          c.host_bw == 5e9, "a second worker on a device takes its figures");
    const char *bad[] = {"g9=10", "g0=abc", "g0=10:", "g0=:5", "cpu=10:5", "g0=1,g0=2", ",",
                         "=5", "g0=10x", "g0=-1", "g0=5:0", "g0"};
    const char *why[] = {"'g9' is not one of", "'g0=abc'", "'g0=10:'", "'g0=:5'",
                         "cpu takes one figure", "named twice", "give auto, off", "'=5'",
                         "'g0=10x'", "'g0=-1'", "'g0=5:0'", "'g0'"};
    for (size_t i = 0; i < sizeof(bad) / sizeof(bad[0]); i++) {
        c.host_bw = 1e9;
        rc = planner_probe_devices(&c, bad[i], 0, true);
        CHECK(rc == -EINVAL && strstr(log_last_error(), why[i]), "spec '%s': rc %d, '%s'",
              bad[i], rc, log_last_error());
    }
    c = base_cfg(m, 1ull << 20);
    c.n_devices = 3;
    c.devices[1].name = "cuda:3";
    c.devices[2].name = "g0";
    c.host_bw = 0;
    rc = planner_probe_devices(&c, NULL, 1, false);
    CHECK(rc == 0 && c.host_bw > 1e8 && c.devices[0].mem_bw == 0 && c.devices[1].mem_bw == 0 &&
          c.devices[2].mem_bw == 0, "auto: host probed (%g B/s), remote card and unknown name "
          "left at defaults", c.host_bw);
    MEASURE("probe of the host for the plan (one thread, %s GEMV): %.1f GB/s",
            quant_type_name(m->layers[0].gate_exps.data ? m->layers[0].gate_exps.type
                                                        : m->layers[0].gate_up_exps.type),
            c.host_bw / 1e9);
}

int main(void)
{
    log_init("test", -1);
    struct tmodel small, moe;
    if (tmodel_open(&small, SMALL) || tmodel_open(&moe, MOE)) {
        CHECK(0, "cannot open the fixtures");
        return test_main_result("test_planner");
    }
    log_set_level(LOG_LEVEL_ERROR);
    struct sizes s = sizes_of(small.m);
    MEASURE("small model: trunk %llu B (lm head %llu), expert %llu B, all experts %llu B, "
            "KV+state+scratch %llu B", (unsigned long long)s.trunk, (unsigned long long)s.lmhead,
            (unsigned long long)s.expert, (unsigned long long)s.experts_all,
            (unsigned long long)s.mandatory);
    test_heat_fixture(small.m);
    test_heat_save();
    test_heat_malformed();
    test_heat_fuzz();
    test_fits(small.m, &s);
    test_too_big(small.m, &s);
    test_heat_both_ways(small.m, &s);
    test_uniform_both_ways(small.m, &s);
    test_leftover_to_trunk(small.m, &s);
    test_list(small.m, &s);
    test_off(small.m, &s);
    test_holds_trunk(small.m, &s);
    test_split(small.m);
    test_most_room(small.m, &s);
    test_nothing(small.m, &s);
    test_experts_any(small.m, &s);
    test_qwen3moe(moe.m);
    test_print(small.m, &s);
    test_parse_devices();
    test_probe_figures(small.m);
    test_80b_sample();
    double bw = planner_probe_host_bandwidth(1);
    CHECK(bw > 1e8, "host bandwidth probe: %g B/s", bw);
    MEASURE("host read bandwidth probe (one thread, %u MiB): %.1f GB/s",
            PLANNER_PROBE_BYTES >> 20, bw / 1e9);
    tmodel_close(&small);
    tmodel_close(&moe);
    return test_main_result("test_planner");
}
