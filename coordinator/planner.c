/*
 * planner: layer ranges, value model, fill, heat profiles and the plan's
 * explanation (see planner.h).
 */
#include "coordinator/planner.h"

#include <ctype.h>
#include <errno.h>
#include <math.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <time.h>
#include <unistd.h>

#include "common/check.h"
#include "common/log.h"
#include "kernels/cpu/threadpool.h"
#include "model/quant.h"
#include "worker/probe.h"

#define PL_MAX_SELS 256              /* "+"-joined selections in one place item */
#define PL_HEAT_MAX_FILE (64u << 20) /* largest heat file read */
#define PL_HEAT_MAX_DEPTH 64         /* JSON nesting skipped in ignored values */
#define PL_HEAT_MAX_DIM 65536        /* layers or experts in a heat profile */

/* ---- sizes ---- */

static uint64_t pl_mat(const struct arch_matrix *m)
{
    return m->data ? (uint64_t)m->mat_bytes : 0;
}

uint64_t planner_proj_bytes(const struct arch_layer *ly)
{
    const struct arch_matrix *ms[] = {&ly->wq,  &ly->wk,   &ly->wv,    &ly->wo,
                                      &ly->wqkv, &ly->wz,  &ly->win,   &ly->wba,
                                      &ly->wbeta, &ly->walpha, &ly->wout, &ly->router};
    uint64_t b = 0;
    for (size_t i = 0; i < sizeof(ms) / sizeof(ms[0]); i++)
        b += pl_mat(ms[i]);
    return b;
}

uint64_t planner_shexp_bytes(const struct arch_layer *ly)
{
    return pl_mat(&ly->gate_sh) + pl_mat(&ly->up_sh) + pl_mat(&ly->down_sh);
}

uint64_t planner_expert_bytes(const struct arch_layer *ly)
{
    if (ly->gate_exps.data)
        return pl_mat(&ly->gate_exps) + pl_mat(&ly->up_exps) + pl_mat(&ly->down_exps);
    return pl_mat(&ly->gate_up_exps) + pl_mat(&ly->down_exps);
}

uint64_t planner_layer_read_bytes(const struct arch_model *m, uint32_t l)
{
    const struct arch_layer *ly = &m->layers[l];
    return planner_proj_bytes(ly) + planner_shexp_bytes(ly) +
           (uint64_t)m->hp.n_expert_used * planner_expert_bytes(ly);
}

uint64_t planner_kv_bytes(const struct arch_model *m, uint32_t layer, uint32_t n_ctx, bool kv_f16)
{
    const struct arch_hparams *hp = &m->hp;
    if (m->layers[layer].recurrent)
        return 0;
    return 2ull * n_ctx * hp->n_head_kv * hp->head_dim * (kv_f16 ? 2 : 4);
}

uint64_t planner_state_bytes(const struct arch_model *m, uint32_t layer)
{
    const struct arch_hparams *hp = &m->hp;
    if (!m->layers[layer].recurrent)
        return 0;
    return ((uint64_t)arch_conv_dim(hp) * (hp->ssm_conv - 1) +
            (uint64_t)hp->ssm_nv * hp->ssm_dv * hp->ssm_dk) * 4;
}

uint64_t planner_scratch_cpu(const struct arch_model *m, uint32_t max_batch)
{
    return (uint64_t)(max_batch ? max_batch : PLANNER_BATCH_DEFAULT) * m->hp.n_embd *
           (m->hp.n_expert_used * 2 + 16) * 4;
}

/* Bytes one token reads in layer l (the split's cost). */
static uint64_t pl_layer_cost(const struct arch_model *m, uint32_t l)
{
    return planner_layer_read_bytes(m, l) + planner_state_bytes(m, l);
}

/* "12.5 MiB" into buf. */
static const char *pl_size(char *buf, size_t len, uint64_t b)
{
    if (b < 1024)
        snprintf(buf, len, "%llu B", (unsigned long long)b);
    else if (b < (1ull << 20))
        snprintf(buf, len, "%.1f KiB", b / 1024.0);
    else if (b < (1ull << 30))
        snprintf(buf, len, "%.1f MiB", b / 1048576.0);
    else
        snprintf(buf, len, "%.2f GiB", b / 1073741824.0);
    return buf;
}

#define PL_SZ(b) pl_size((char[32]){0}, 32, (b))

/* ---- the place spec ---- */

enum pl_slot { PL_LMHEAD, PL_ATTN, PL_DNPROJ, PL_SHEXP, PL_EXPERTS, PL_NSLOT };

enum pl_target {
    PL_T_UNNAMED = 0, /* not in the list: host memory */
    PL_T_ALL,
    PL_T_NONE,
    PL_T_AUTO,
    PL_T_SEL,
};

struct pl_sel {
    int dev;
    bool ranged;      /* DEV:N-M; else every layer DEV owns */
    uint32_t l0, l1;  /* inclusive */
};

struct pl_item {
    enum pl_target t;
    char token[96];   /* the item as written, for messages */
    struct pl_sel *sel;
    int n_sel;
};

struct pl_place {
    enum planner_mode mode;
    struct pl_item item[PL_NSLOT];
};

static const char *const pl_slot_names[PL_NSLOT] = {"lmhead", "attn", "dnproj", "shexp",
                                                    "experts"};

static void pl_place_free(struct pl_place *pp)
{
    for (int s = 0; s < PL_NSLOT; s++)
        free(pp->item[s].sel);
}

static int pl_bad(const char *spec, const char *token, const char *why)
{
    log_error("--place '%s': '%s': %s", spec, token, why);
    return -EINVAL;
}

/* Decimal number without sign at *p, at most max; advances *p. */
static bool pl_num(const char **p, uint64_t max, uint64_t *out)
{
    const char *s = *p;
    uint64_t v = 0;
    if (*s < '0' || *s > '9')
        return false;
    while (*s >= '0' && *s <= '9') {
        v = v * 10 + (uint64_t)(*s++ - '0');
        if (v > max)
            return false;
    }
    *p = s;
    *out = v;
    return true;
}

/* One "DEV[:N[-M]]". */
static int pl_parse_sel(const char *spec, const char *tok, const char *s, int n_dev,
                        uint32_t n_layer, struct pl_sel *out)
{
    uint64_t d, a, b;
    const char *p = s;
    if (!pl_num(&p, 1u << 20, &d))
        return pl_bad(spec, tok, "expected all, none, auto or a device index like 0 or 0:0-19");
    if (d >= (uint64_t)n_dev) {
        char why[96];
        snprintf(why, sizeof(why), "device %llu does not exist (%d device%s)",
                 (unsigned long long)d, n_dev, n_dev == 1 ? "" : "s");
        return pl_bad(spec, tok, why);
    }
    *out = (struct pl_sel){.dev = (int)d};
    if (!*p)
        return 0;
    if (*p++ != ':' || !pl_num(&p, UINT32_MAX, &a))
        return pl_bad(spec, tok, "expected DEV:N or DEV:N-M (layers, inclusive)");
    b = a;
    if (*p == '-' && (++p, !pl_num(&p, UINT32_MAX, &b)))
        return pl_bad(spec, tok, "expected a last layer after '-'");
    if (*p)
        return pl_bad(spec, tok, "unexpected characters after the layer range");
    if (b < a || b >= n_layer) {
        char why[96];
        snprintf(why, sizeof(why), "layers %llu-%llu are not a range within 0-%u",
                 (unsigned long long)a, (unsigned long long)b, n_layer - 1);
        return pl_bad(spec, tok, why);
    }
    out->ranged = true;
    out->l0 = (uint32_t)a;
    out->l1 = (uint32_t)b;
    return 0;
}

/* The target of one item into it. */
static int pl_parse_target(const char *spec, const char *tok, char *t, int n_dev,
                           uint32_t n_layer, struct pl_item *it)
{
    if (!strcmp(t, "all") || !strcmp(t, "none") || !strcmp(t, "auto")) {
        it->t = t[0] == 'a' ? (t[1] == 'l' ? PL_T_ALL : PL_T_AUTO) : PL_T_NONE;
        return 0;
    }
    const size_t n = strlen(t);
    if (!n || t[0] == '+' || t[n - 1] == '+' || strstr(t, "++"))
        return pl_bad(spec, tok, "empty selection");
    it->t = PL_T_SEL;
    it->sel = calloc(PL_MAX_SELS, sizeof(*it->sel));
    if (!it->sel)
        return -ENOMEM;
    char *save = NULL;
    for (char *s = strtok_r(t, "+", &save); s; s = strtok_r(NULL, "+", &save)) {
        if (it->n_sel == PL_MAX_SELS)
            return pl_bad(spec, tok, "too many '+' selections");
        int rc = pl_parse_sel(spec, tok, s, n_dev, n_layer, &it->sel[it->n_sel]);
        if (rc)
            return rc;
        it->n_sel++;
    }
    return 0;
}

static int pl_parse_item(const char *spec, char *tok, int n_dev, uint32_t n_layer,
                         struct pl_place *pp)
{
    char shown[96];
    snprintf(shown, sizeof(shown), "%s", tok);
    char *eq = strchr(tok, '=');
    if (!eq)
        return pl_bad(spec, shown, "expected PIECE=TARGET (pieces: lmhead, attn, dnproj, proj, "
                                   "shexp, experts)");
    *eq = 0;
    int slots[2] = {-1, -1};
    if (!strcmp(tok, "proj")) {
        slots[0] = PL_ATTN;
        slots[1] = PL_DNPROJ;
    }
    for (int s = 0; s < PL_NSLOT && slots[0] < 0; s++)
        if (!strcmp(tok, pl_slot_names[s]))
            slots[0] = s;
    if (slots[0] < 0)
        return pl_bad(spec, shown, "unknown piece (lmhead, attn, dnproj, proj, shexp, experts)");
    for (int k = 0; k < 2 && slots[k] >= 0; k++)
        if (pp->item[slots[k]].token[0])
            return pl_bad(spec, shown, "this piece is already named by an earlier item");
    struct pl_item *it = &pp->item[slots[0]];
    snprintf(it->token, sizeof(it->token), "%s", shown);
    int rc = pl_parse_target(spec, shown, eq + 1, n_dev, n_layer, it);
    if (rc)
        return rc;
    if (slots[0] == PL_LMHEAD && it->t == PL_T_SEL && (it->n_sel > 1 || it->sel[0].ranged))
        return pl_bad(spec, shown, "the lm head takes one device index, all, none or auto");
    if (slots[1] >= 0) {
        struct pl_item *o = &pp->item[slots[1]];
        *o = *it;
        o->sel = NULL;
        if (it->n_sel) {
            o->sel = malloc(it->n_sel * sizeof(*o->sel));
            if (!o->sel)
                return -ENOMEM;
            memcpy(o->sel, it->sel, it->n_sel * sizeof(*o->sel));
        }
    }
    return 0;
}

static int pl_parse_place(const char *spec, int n_dev, uint32_t n_layer, struct pl_place *pp)
{
    memset(pp, 0, sizeof(*pp));
    if (!spec || !*spec || !strcmp(spec, "auto")) {
        pp->mode = PLANNER_MODE_AUTO;
        return 0;
    }
    if (!strcmp(spec, "off")) {
        pp->mode = PLANNER_MODE_OFF;
        return 0;
    }
    pp->mode = PLANNER_MODE_LIST;
    size_t n = strlen(spec);
    if (spec[0] == ',' || spec[n - 1] == ',' || strstr(spec, ",,"))
        return pl_bad(spec, ",", "empty item");
    char *copy = strdup(spec), *save = NULL;
    if (!copy)
        return -ENOMEM;
    int rc = 0;
    for (char *t = strtok_r(copy, ",", &save); t && !rc; t = strtok_r(NULL, ",", &save))
        rc = pl_parse_item(spec, t, n_dev, n_layer, pp);
    free(copy);
    return rc;
}

/* ---- the build context ---- */

struct pl_build {
    const struct planner_config *cfg;
    const struct arch_model *m;
    struct planner_plan *p;
    struct pl_place place;
    int *pin;           /* per layer: device named by the place list, or -1 */
    char **pin_tok;     /* per layer: the token that pinned it */
    double *prob;       /* n_layer x n_expert routing probabilities */
    size_t cap_pieces;
};

static int pl_push(struct pl_build *b, const struct planner_piece *pc)
{
    struct planner_plan *p = b->p;
    if (p->n_pieces == b->cap_pieces) {
        size_t cap = b->cap_pieces ? 2 * b->cap_pieces : 256;
        struct planner_piece *np = realloc(p->pieces, cap * sizeof(*np));
        if (!np)
            return -ENOMEM;
        p->pieces = np;
        b->cap_pieces = cap;
    }
    p->pieces[p->n_pieces++] = *pc;
    return 0;
}

/* ---- checks and routing probabilities ---- */

static int pl_check_config(const struct planner_config *cfg)
{
    if (!cfg->model || cfg->n_devices < 1 || cfg->n_devices > PLANNER_MAX_DEVICES) {
        log_error("planner: %d devices (1..%d) and a model are needed", cfg->n_devices,
                  PLANNER_MAX_DEVICES);
        return -EINVAL;
    }
    if (!(cfg->host_bw >= 0 && isfinite(cfg->host_bw)) || cfg->margin_frac >= 0.5 ||
        isnan(cfg->margin_frac)) {
        log_error("planner: host bandwidth %g B/s and margin %g must be >= 0 and < 0.5",
                  cfg->host_bw, cfg->margin_frac);
        return -EINVAL;
    }
    for (int i = 0; i < cfg->n_devices; i++) {
        const struct planner_device *d = &cfg->devices[i];
        const char *nm = d->name ? d->name : "?";
        if (!d->budget) {
            log_error("device %d (%s): memory budget unknown: give --device-mem", i, nm);
            return -EINVAL;
        }
        if (!(d->mem_bw >= 0 && isfinite(d->mem_bw)) ||
            !(d->host_path_bw >= 0 && isfinite(d->host_path_bw))) {
            log_error("device %d (%s): bandwidths must be finite and >= 0 (memory %g, host path "
                      "%g B/s)", i, nm, d->mem_bw, d->host_path_bw);
            return -EINVAL;
        }
    }
    if (cfg->experts_home && strcmp(cfg->experts_home, "range") &&
        strcmp(cfg->experts_home, "any")) {
        log_error("--experts-home '%s' must be range or any", cfg->experts_home);
        return -EINVAL;
    }
    const struct arch_hparams *hp = &cfg->model->hp;
    if (hp->n_layer < (uint32_t)cfg->n_devices) {
        log_error("%d devices for %u layers: every device needs at least one layer",
                  cfg->n_devices, hp->n_layer);
        return -EINVAL;
    }
    return 0;
}

static int pl_probabilities(struct pl_build *b)
{
    const struct arch_hparams *hp = &b->m->hp;
    const struct planner_heat *h = b->cfg->heat;
    const uint32_t L = hp->n_layer, E = hp->n_expert, K = hp->n_expert_used;
    b->prob = malloc((size_t)L * E * sizeof(double));
    if (!b->prob)
        return -ENOMEM;
    if (h && (h->n_layer != L || h->n_expert != E)) {
        log_error("heat profile has %u layers x %u experts; the model has %u x %u", h->n_layer,
                  h->n_expert, L, E);
        return -EINVAL;
    }
    for (uint32_t l = 0; l < L; l++) {
        uint64_t sum = 0;
        for (uint32_t e = 0; h && e < E; e++)
            sum += h->counts[(size_t)l * E + e];
        if (h && (h->tokens ? sum > h->tokens * K : sum == 0)) {
            log_error("heat profile: layer %u has %llu routes in %llu tokens; at most top_k = %u "
                      "per token and at least one are possible", l, (unsigned long long)sum,
                      (unsigned long long)h->tokens, K);
            return -EINVAL;
        }
        for (uint32_t e = 0; e < E; e++) {
            double p = (double)K / E;
            if (h)
                p = h->tokens ? (double)h->counts[(size_t)l * E + e] / h->tokens
                              : (double)h->counts[(size_t)l * E + e] * K / sum;
            b->prob[(size_t)l * E + e] = p;
        }
    }
    b->p->heat = h != NULL;
    return 0;
}

/* ---- layer ranges ---- */

/* Layers named with DEV:N-M pin those layers (of the piece's kind) to DEV. */
static int pl_pins(struct pl_build *b)
{
    const uint32_t L = b->m->hp.n_layer;
    b->pin = malloc(L * sizeof(int));
    b->pin_tok = calloc(L, sizeof(char *));
    if (!b->pin || !b->pin_tok)
        return -ENOMEM;
    for (uint32_t l = 0; l < L; l++)
        b->pin[l] = -1;
    for (int s = PL_ATTN; s < PL_NSLOT; s++) {
        struct pl_item *it = &b->place.item[s];
        for (int k = 0; k < it->n_sel; k++) {
            const struct pl_sel *sl = &it->sel[k];
            for (uint32_t l = sl->l0; sl->ranged && l <= sl->l1; l++) {
                const struct arch_layer *ly = &b->m->layers[l];
                if ((s == PL_ATTN && ly->recurrent) || (s == PL_DNPROJ && !ly->recurrent) ||
                    (s == PL_SHEXP && !planner_shexp_bytes(ly)))
                    continue;
                if (b->pin[l] >= 0 && b->pin[l] != sl->dev) {
                    char why[160];
                    snprintf(why, sizeof(why), "layer %u is also named for device %d by '%s'",
                             l, b->pin[l], b->pin_tok[l]);
                    return pl_bad(b->cfg->place, it->token, why);
                }
                b->pin[l] = sl->dev;
                b->pin_tok[l] = it->token;
            }
        }
    }
    return 0;
}

static int pl_split_list(struct pl_build *b, const char *spec)
{
    struct planner_plan *p = b->p;
    const uint32_t L = p->n_layer;
    const char *s = spec;
    uint64_t next = 0, a, z;
    for (int i = 0; i < p->n_devices; i++) {
        const bool last = i + 1 == p->n_devices;
        if (!pl_num(&s, UINT32_MAX, &a) || *s++ != '-' || !pl_num(&s, UINT32_MAX, &z) ||
            *s != (last ? '\0' : ',') || a != next || z < a || z >= L)
            goto bad;
        p->dev[i].layer_begin = (uint32_t)a;
        p->dev[i].layer_end = (uint32_t)z + 1;
        next = z + 1;
        s += !last;
    }
    if (next != L)
        goto bad;
    for (uint32_t l = 0; l < L; l++) {
        int d = 0;
        while (l >= p->dev[d].layer_end)
            d++;
        if (b->pin[l] >= 0 && b->pin[l] != d) {
            log_error("--place '%s': '%s' names layer %u for device %d, but --layers %s gives it "
                      "to device %d", b->cfg->place, b->pin_tok[l], l, b->pin[l], spec, d);
            return -EINVAL;
        }
    }
    return 0;
bad:
    log_error("--layers '%s' must list %d contiguous ranges covering layers 0-%u, like 0-3,4-7",
              spec, p->n_devices, L - 1);
    return -EINVAL;
}

/* Minimax split by dynamic programming over (devices, layers); pins restrict
 * which ranges a device may take. */
static int pl_split_auto(struct pl_build *b)
{
    struct planner_plan *p = b->p;
    const int D = p->n_devices;
    const uint32_t L = p->n_layer;
    uint64_t *pre = calloc(L + 1, sizeof(*pre));
    double *f = malloc((size_t)(D + 1) * (L + 1) * sizeof(double));
    uint32_t *arg = calloc((size_t)(D + 1) * (L + 1), sizeof(uint32_t));
    int rc = pre && f && arg ? 0 : -ENOMEM;
    for (uint32_t l = 0; !rc && l < L; l++)
        pre[l + 1] = pre[l] + pl_layer_cost(b->m, l);
    for (size_t i = 0; !rc && i < (size_t)(D + 1) * (L + 1); i++)
        f[i] = INFINITY;
    if (!rc)
        f[0] = 0;
    for (int i = 0; !rc && i < D; i++) {
        const double bw = p->dev[i].mem_bw;
        for (uint32_t l = 1; l <= L; l++) {
            /* device i takes [k, l): scan k down until a layer pinned elsewhere */
            uint32_t lo = l;
            while (lo > 0 && (b->pin[lo - 1] < 0 || b->pin[lo - 1] == i))
                lo--;
            double best = INFINITY;
            uint32_t bk = 0;
            for (uint32_t k = lo; k < l; k++) {
                double prev = f[(size_t)i * (L + 1) + k];
                double t = (double)(pre[l] - pre[k]) / bw;
                double v = prev > t ? prev : t;
                if (v < best) {
                    best = v;
                    bk = k;
                }
            }
            f[(size_t)(i + 1) * (L + 1) + l] = best;
            arg[(size_t)(i + 1) * (L + 1) + l] = bk;
        }
    }
    if (!rc && isinf(f[(size_t)D * (L + 1) + L])) {
        log_error("--place '%s': the layers it names cannot be split into %d contiguous ranges "
                  "in device order", b->cfg->place, D);
        rc = -EINVAL;
    }
    for (int i = D, l = (int)L; !rc && i > 0; i--) {
        p->dev[i - 1].layer_end = (uint32_t)l;
        l = (int)arg[(size_t)i * (L + 1) + l];
        p->dev[i - 1].layer_begin = (uint32_t)l;
    }
    free(pre);
    free(f);
    free(arg);
    return rc;
}

static int pl_split(struct pl_build *b)
{
    const char *spec = b->cfg->layers;
    int rc = spec && *spec && strcmp(spec, "auto") ? pl_split_list(b, spec) : pl_split_auto(b);
    if (rc)
        return rc;
    struct planner_plan *p = b->p;
    for (int i = 0; i < p->n_devices; i++) {
        struct planner_device_plan *d = &p->dev[i];
        d->range_bytes = 0;
        for (uint32_t l = d->layer_begin; l < d->layer_end; l++) {
            d->range_bytes += pl_layer_cost(b->m, l);
            p->layers[l].device = i;
        }
        d->range_ms = 1e3 * (double)d->range_bytes / d->mem_bw;
    }
    return 0;
}

/* ---- mandatory charges ---- */

static int pl_mandatory(struct pl_build *b)
{
    struct planner_plan *p = b->p;
    const struct planner_config *cfg = b->cfg;
    for (int i = 0; i < p->n_devices; i++) {
        struct planner_device_plan *d = &p->dev[i];
        for (uint32_t l = d->layer_begin; l < d->layer_end; l++) {
            d->kv += planner_kv_bytes(b->m, l, p->n_ctx, p->kv_f16) * p->n_seq;
            d->state += planner_state_bytes(b->m, l) * p->n_seq;
        }
        d->scratch = cfg->devices[i].scratch ? cfg->devices[i].scratch
                                             : planner_scratch_cpu(b->m, cfg->max_batch);
        double mf = cfg->margin_frac == 0 ? PLANNER_MARGIN_DEFAULT
                                          : (cfg->margin_frac < 0 ? 0 : cfg->margin_frac);
        d->margin = (uint64_t)(d->budget * mf);
        const uint64_t need = d->margin + d->scratch + d->kv + d->state;
        if (need > d->budget) {
            log_error("device %d (%s): budget %s is too small for layers %u-%u: KV cache %s + "
                      "DeltaNet state %s + scratch %s + margin %s = %s", i, d->name,
                      PL_SZ(d->budget), d->layer_begin, d->layer_end - 1, PL_SZ(d->kv),
                      PL_SZ(d->state), PL_SZ(d->scratch), PL_SZ(d->margin), PL_SZ(need));
            return -ENOSPC;
        }
        d->room = d->free = d->budget - need;
        const uint64_t before = d->budget - d->margin - d->scratch;
        struct planner_piece kv = {.kind = PLANNER_KIND_KV, .device = i, .layer = PLANNER_NO_LAYER,
                                   .bytes = d->kv, .placed = true, .why = PLANNER_WHY_MANDATORY,
                                   .room_before = before, .room_after = before - d->kv};
        struct planner_piece st = kv;
        st.kind = PLANNER_KIND_STATE;
        st.bytes = d->state;
        st.room_before = kv.room_after;
        st.room_after = d->room;
        if ((d->kv && pl_push(b, &kv)) || (d->state && pl_push(b, &st)))
            return -ENOMEM;
    }
    return 0;
}

/* ---- candidates ---- */

enum pl_disp { PL_D_HOST, PL_D_LISTED, PL_D_AUTO };

struct pl_cand {
    enum planner_kind kind;
    int dev;                /* -1: any (lm head offered to the fill) */
    uint32_t layer, expert;
    uint64_t bytes;
    double value;
    enum pl_disp disp;
};

/* Disposition and device of a piece under the place spec. */
static enum pl_disp pl_disposition(const struct pl_build *b, int slot, uint32_t layer, int *dev)
{
    const struct planner_plan *p = b->p;
    const struct pl_item *it = &b->place.item[slot];
    const int owner = layer == PLANNER_NO_LAYER ? p->n_devices - 1 : p->layers[layer].device;
    *dev = layer == PLANNER_NO_LAYER ? -1 : owner;
    if (slot != PL_EXPERTS && b->cfg->devices[owner].holds_trunk) {
        *dev = owner; /* the backend holds it anyway: charge it where it is */
        return PL_D_LISTED;
    }
    if (b->place.mode == PLANNER_MODE_AUTO)
        return PL_D_AUTO;
    if (b->place.mode == PLANNER_MODE_OFF)
        return PL_D_HOST;
    switch (it->t) {
    case PL_T_ALL:
        *dev = owner;
        return PL_D_LISTED;
    case PL_T_AUTO:
        return PL_D_AUTO;
    case PL_T_SEL:
        for (int k = 0; k < it->n_sel; k++) {
            const struct pl_sel *s = &it->sel[k];
            if (layer == PLANNER_NO_LAYER) {
                *dev = s->dev;
                return PL_D_LISTED;
            }
            if (s->ranged ? (layer >= s->l0 && layer <= s->l1) : s->dev == owner) {
                *dev = owner; /* == s->dev: pins were honoured by the split */
                return PL_D_LISTED;
            }
        }
        return PL_D_HOST;
    default:
        return PL_D_HOST;
    }
}

static int pl_cands(struct pl_build *b, struct pl_cand **out, size_t *n_out)
{
    const struct arch_model *m = b->m;
    const struct planner_plan *p = b->p;
    const uint32_t L = p->n_layer, E = p->n_expert;
    size_t cap = 1 + (size_t)L * (2 + E), n = 0;
    struct pl_cand *c = malloc(cap * sizeof(*c));
    if (!c)
        return -ENOMEM;
    const bool dm = b->cfg->dense_miss_ratio;
    int dev;
    enum pl_disp ds = pl_disposition(b, PL_LMHEAD, PLANNER_NO_LAYER, &dev);
    c[n++] = (struct pl_cand){.kind = PLANNER_KIND_LMHEAD, .dev = dev, .layer = PLANNER_NO_LAYER,
                              .bytes = pl_mat(&m->output),
                              .value = dm ? p->dev[p->n_devices - 1].miss_ratio : 1, .disp = ds};
    for (uint32_t l = 0; l < L; l++) {
        const struct arch_layer *ly = &m->layers[l];
        const double ratio = p->dev[p->layers[l].device].miss_ratio, dense = dm ? ratio : 1;
        ds = pl_disposition(b, ly->recurrent ? PL_DNPROJ : PL_ATTN, l, &dev);
        c[n++] = (struct pl_cand){.kind = PLANNER_KIND_PROJ, .dev = dev, .layer = l,
                                  .bytes = planner_proj_bytes(ly), .value = dense, .disp = ds};
        if (planner_shexp_bytes(ly)) {
            ds = pl_disposition(b, PL_SHEXP, l, &dev);
            c[n++] = (struct pl_cand){.kind = PLANNER_KIND_SHEXP, .dev = dev, .layer = l,
                                      .bytes = planner_shexp_bytes(ly), .value = dense,
                                      .disp = ds};
        }
        ds = pl_disposition(b, PL_EXPERTS, l, &dev);
        for (uint32_t e = 0; e < E; e++)
            c[n++] = (struct pl_cand){.kind = PLANNER_KIND_EXPERT, .dev = dev, .layer = l,
                                      .expert = e, .bytes = planner_expert_bytes(ly),
                                      .value = b->prob[(size_t)l * E + e] * ratio, .disp = ds};
    }
    *out = c;
    *n_out = n;
    return 0;
}

/* Records a placement (or not) of candidate c on device d. */
static int pl_decide(struct pl_build *b, const struct pl_cand *c, int d, bool placed,
                     enum planner_why why)
{
    struct planner_plan *p = b->p;
    struct planner_piece pc = {.kind = c->kind, .device = d, .layer = c->layer,
                               .expert = c->expert, .bytes = c->bytes, .value = c->value,
                               .placed = placed, .why = why};
    if (d >= 0) {
        struct planner_device_plan *dv = &p->dev[d];
        pc.room_before = dv->free;
        if (placed) {
            ASSERT(c->bytes <= dv->free);
            dv->free -= c->bytes;
            if (c->kind == PLANNER_KIND_EXPERT) {
                struct planner_layer_plan *lp = &p->layers[c->layer];
                dv->experts += c->bytes;
                dv->n_experts++;
                lp->resident[c->expert / 8] |= (uint8_t)(1u << (c->expert % 8));
                lp->n_resident++;
                lp->holder[c->expert] = (int16_t)d;
            } else {
                dv->trunk += c->bytes;
                if (c->kind == PLANNER_KIND_LMHEAD) {
                    dv->lmhead = true;
                    p->lmhead_device = d;
                } else if (c->kind == PLANNER_KIND_PROJ) {
                    p->layers[c->layer].proj = true;
                } else {
                    p->layers[c->layer].shexp = true;
                }
            }
        }
        pc.room_after = dv->free;
    }
    return pl_push(b, &pc);
}

/* Listed pieces: checked against each device's room as a whole, then charged. */
static int pl_listed(struct pl_build *b, const struct pl_cand *c, size_t n)
{
    struct planner_plan *p = b->p;
    uint64_t want[PLANNER_MAX_DEVICES] = {0};
    for (size_t i = 0; i < n; i++)
        if (c[i].disp == PL_D_LISTED)
            want[c[i].dev] += c[i].bytes;
    for (int d = 0; d < p->n_devices; d++) {
        if (want[d] > p->dev[d].room) {
            log_error("--place '%s': device %d (%s) cannot hold the listed pieces%s: they need "
                      "%s (%llu bytes), its room is %s (budget %s - KV %s - state %s - scratch "
                      "%s - margin %s)", b->cfg->place ? b->cfg->place : "auto", d,
                      p->dev[d].name,
                      b->cfg->devices[d].holds_trunk ? " (its backend holds the projections, "
                                                       "shared experts and lm head)" : "",
                      PL_SZ(want[d]),
                      (unsigned long long)want[d], PL_SZ(p->dev[d].room), PL_SZ(p->dev[d].budget),
                      PL_SZ(p->dev[d].kv), PL_SZ(p->dev[d].state), PL_SZ(p->dev[d].scratch),
                      PL_SZ(p->dev[d].margin));
            return -ENOSPC;
        }
    }
    int rc = 0;
    for (size_t i = 0; i < n && !rc; i++)
        if (c[i].disp == PL_D_LISTED)
            rc = pl_decide(b, &c[i], c[i].dev, true, PLANNER_WHY_LISTED);
    return rc;
}

static int pl_cand_cmp(const void *pa, const void *pb)
{
    const struct pl_cand *a = pa, *b = pb;
    if (a->value != b->value)
        return a->value > b->value ? -1 : 1;
    if (a->kind != b->kind)
        return (int)a->kind - (int)b->kind;
    if (a->kind == PLANNER_KIND_EXPERT && a->expert != b->expert)
        return a->expert < b->expert ? -1 : 1;
    if (a->layer != b->layer)
        return a->layer < b->layer ? -1 : 1;
    return 0;
}

/* The device with the most room; with `only`, among those whose cursor is
 * inside the group. Ties: the lowest index. */
static int pl_roomiest(const struct planner_plan *p, const size_t *cur, size_t end)
{
    int best = -1;
    for (int d = 0; d < p->n_devices; d++)
        if ((!cur || cur[d] < end) && (best < 0 || p->dev[d].free > p->dev[best].free))
            best = d;
    return best;
}

/* One group of equal value: the device with the most room takes its next
 * piece, until the group is done. */
static int pl_fill_group(struct pl_build *b, struct pl_cand *c, size_t i0, size_t i1)
{
    struct planner_plan *p = b->p;
    size_t cur[PLANNER_MAX_DEVICES];
    int rc = 0;
    for (size_t i = i0; i < i1 && !rc; i++) {
        if (c[i].dev >= 0)
            continue;
        int d = pl_roomiest(p, NULL, 0);
        bool fits = c[i].bytes <= p->dev[d].free;
        rc = pl_decide(b, &c[i], d, fits, fits ? PLANNER_WHY_VALUE : PLANNER_WHY_NO_ROOM);
    }
    for (int d = 0; d < p->n_devices; d++) {
        cur[d] = i0;
        while (cur[d] < i1 && c[cur[d]].dev != d)
            cur[d]++;
    }
    for (int d; !rc && (d = pl_roomiest(p, cur, i1)) >= 0;) {
        const struct pl_cand *x = &c[cur[d]];
        bool fits = x->bytes <= p->dev[d].free;
        rc = pl_decide(b, x, d, fits, fits ? PLANNER_WHY_VALUE : PLANNER_WHY_NO_ROOM);
        do
            cur[d]++;
        while (cur[d] < i1 && c[cur[d]].dev != d);
    }
    return rc;
}

static int pl_fill_auto(struct pl_build *b, struct pl_cand *c, size_t n)
{
    size_t m = 0;
    for (size_t i = 0; i < n; i++)
        if (c[i].disp == PL_D_AUTO)
            c[m++] = c[i];
    qsort(c, m, sizeof(*c), pl_cand_cmp);
    int rc = 0;
    for (size_t i = 0, j; i < m && !rc; i = j) {
        for (j = i + 1; j < m && c[j].value == c[i].value;)
            j++;
        rc = pl_fill_group(b, c, i, j);
    }
    return rc;
}

/* --place off: k experts in every layer of a device, rotated by layer. */
static int pl_fill_off(struct pl_build *b, const struct pl_cand *c, size_t n)
{
    struct planner_plan *p = b->p;
    const uint32_t E = p->n_expert;
    uint64_t k[PLANNER_MAX_DEVICES];
    for (int d = 0; d < p->n_devices; d++) {
        uint64_t one = 0;
        for (uint32_t l = p->dev[d].layer_begin; l < p->dev[d].layer_end; l++)
            one += planner_expert_bytes(&b->m->layers[l]);
        k[d] = one ? p->dev[d].free / one : E;
        k[d] = k[d] > E ? E : k[d];
    }
    int rc = 0;
    for (size_t i = 0; i < n && !rc; i++) {
        if (c[i].disp == PL_D_LISTED)
            continue; /* held by its backend, charged by pl_listed */
        if (c[i].kind != PLANNER_KIND_EXPERT) {
            rc = pl_decide(b, &c[i], c[i].dev, false, PLANNER_WHY_OFF);
            continue;
        }
        const int d = p->layers[c[i].layer].device;
        const uint32_t j = (c[i].expert + E - c[i].layer % E) % E; /* e = (j + l) % E */
        const bool on = j < k[d];
        rc = pl_decide(b, &c[i], d, on, on ? PLANNER_WHY_OFF_FILL : PLANNER_WHY_NO_ROOM);
    }
    return rc;
}

/* Step 5 (planner.h): experts left in host memory for want of room, most valuable first,
 * each to the non-owner device with the most room left that it fits. */
static int pl_fill_foreign(struct pl_build *b)
{
    struct planner_plan *p = b->p;
    size_t n = 0;
    for (size_t i = 0; i < p->n_pieces; i++)
        n += p->pieces[i].kind == PLANNER_KIND_EXPERT && p->pieces[i].why == PLANNER_WHY_NO_ROOM;
    if (!n || p->n_devices < 2)
        return 0;
    struct pl_cand *c = malloc(n * sizeof(*c));
    if (!c)
        return -ENOMEM;
    const uint32_t E = p->n_expert;
    n = 0;
    for (size_t i = 0; i < p->n_pieces; i++) {
        const struct planner_piece *x = &p->pieces[i];
        if (x->kind != PLANNER_KIND_EXPERT || x->why != PLANNER_WHY_NO_ROOM)
            continue;
        /* value before the holder's ratio: p x discount; the holder's ratio is applied when
         * a device is picked (equal for every device of one kind) */
        c[n++] = (struct pl_cand){.kind = PLANNER_KIND_EXPERT, .dev = -1, .layer = x->layer,
                                  .expert = x->expert, .bytes = x->bytes,
                                  .value = b->prob[(size_t)x->layer * E + x->expert] *
                                           PLANNER_FOREIGN_DISCOUNT,
                                  .disp = PL_D_AUTO};
    }
    qsort(c, n, sizeof(*c), pl_cand_cmp);
    int rc = 0;
    for (size_t i = 0; i < n && !rc; i++) {
        struct planner_layer_plan *lp = &p->layers[c[i].layer];
        int best = -1;
        for (int d = 0; d < p->n_devices; d++)
            if (d != lp->device && c[i].bytes <= p->dev[d].free &&
                (best < 0 || p->dev[d].free > p->dev[best].free))
                best = d;
        if (best < 0)
            continue;
        struct planner_device_plan *dv = &p->dev[best];
        struct planner_piece pc = {.kind = PLANNER_KIND_EXPERT, .device = best,
                                   .layer = c[i].layer, .expert = c[i].expert,
                                   .bytes = c[i].bytes, .value = c[i].value * dv->miss_ratio,
                                   .placed = true, .why = PLANNER_WHY_FOREIGN,
                                   .room_before = dv->free};
        dv->free -= c[i].bytes;
        dv->foreign += c[i].bytes;
        dv->n_foreign++;
        lp->holder[c[i].expert] = (int16_t)best;
        lp->n_foreign++;
        pc.room_after = dv->free;
        rc = pl_push(b, &pc);
    }
    free(c);
    return rc;
}

/* The marginal expert of a trunk piece x. Placed by value: the best expert
 * left out of its device with a value <= x's (what its room would have held;
 * equal values come after trunk pieces). Listed: the best expert left out.
 * Left out for room: the worst expert placed with a value > x's (what kept
 * its room). Returns the index of that expert's decision, or -1. */
static long pl_marginal_of(const struct planner_plan *p, const struct planner_piece *x)
{
    long best = -1;
    for (size_t i = 0; i < p->n_pieces; i++) {
        const struct planner_piece *e = &p->pieces[i];
        if (e->kind != PLANNER_KIND_EXPERT || e->device != x->device ||
            e->why == PLANNER_WHY_FOREIGN)
            continue;
        bool cand = x->why == PLANNER_WHY_NO_ROOM ? e->placed && e->value > x->value
                    : x->why == PLANNER_WHY_LISTED ? !e->placed
                                                    : !e->placed && e->value <= x->value;
        if (!cand)
            continue;
        const double bv = best < 0 ? 0 : p->pieces[best].value;
        if (best < 0 || (x->why == PLANNER_WHY_NO_ROOM ? e->value < bv : e->value > bv))
            best = (long)i;
    }
    return best;
}

static void pl_marginals(struct planner_plan *p)
{
    for (size_t i = 0; i < p->n_pieces; i++) {
        struct planner_piece *x = &p->pieces[i];
        if (x->kind > PLANNER_KIND_SHEXP || x->device < 0 ||
            (x->why != PLANNER_WHY_VALUE && x->why != PLANNER_WHY_LISTED &&
             x->why != PLANNER_WHY_NO_ROOM))
            continue;
        long j = pl_marginal_of(p, x);
        if (j < 0)
            continue;
        x->has_marginal = true;
        x->marginal_layer = p->pieces[j].layer;
        x->marginal_expert = p->pieces[j].expert;
        x->marginal_value = p->pieces[j].value;
    }
}

/* ---- planner_build ---- */

static int pl_init_plan(struct pl_build *b)
{
    const struct planner_config *cfg = b->cfg;
    const struct arch_hparams *hp = &b->m->hp;
    struct planner_plan *p = calloc(1, sizeof(*p));
    if (!p)
        return -ENOMEM;
    b->p = p;
    p->n_layer = hp->n_layer;
    p->n_expert = hp->n_expert;
    p->top_k = hp->n_expert_used;
    p->host_bw = cfg->host_bw > 0 ? cfg->host_bw : PLANNER_HOST_BW_DEFAULT;
    p->n_ctx = cfg->n_ctx ? cfg->n_ctx : PLANNER_CTX_DEFAULT;
    p->n_seq = cfg->n_seq ? cfg->n_seq : 1;
    p->kv_f16 = cfg->kv_f16;
    p->n_devices = cfg->n_devices;
    p->lmhead_device = -1;
    p->lmhead_bytes = pl_mat(&b->m->output);
    snprintf(p->place, sizeof(p->place), "%s", cfg->place && *cfg->place ? cfg->place : "auto");
    p->experts_any = cfg->experts_home && !strcmp(cfg->experts_home, "any");
    for (int i = 0; i < p->n_devices; i++) {
        const struct planner_device *in = &cfg->devices[i];
        struct planner_device_plan *d = &p->dev[i];
        snprintf(d->name, sizeof(d->name), "%s", in->name ? in->name : "cpu");
        d->budget = in->budget;
        d->mem_bw = in->mem_bw > 0 ? in->mem_bw : p->host_bw;
        d->host_path_bw = in->host_path_bw > 0 ? in->host_path_bw : p->host_bw;
        double miss = d->host_path_bw < p->host_bw ? d->host_path_bw : p->host_bw;
        d->miss_ratio = d->mem_bw / miss;
    }
    p->layers = calloc(p->n_layer, sizeof(*p->layers));
    if (!p->layers)
        return -ENOMEM;
    for (uint32_t l = 0; l < p->n_layer; l++) {
        struct planner_layer_plan *lp = &p->layers[l];
        const struct arch_layer *ly = &b->m->layers[l];
        lp->recurrent = ly->recurrent;
        lp->proj_bytes = planner_proj_bytes(ly);
        lp->shexp_bytes = planner_shexp_bytes(ly);
        lp->expert_bytes = planner_expert_bytes(ly);
        lp->resident = calloc((p->n_expert + 7) / 8 + 1, 1);
        lp->holder = malloc((p->n_expert ? p->n_expert : 1) * sizeof(*lp->holder));
        if (!lp->resident || !lp->holder)
            return -ENOMEM;
        for (uint32_t e = 0; e < p->n_expert; e++)
            lp->holder[e] = PLANNER_HOST;
    }
    return 0;
}

static int pl_place_pieces(struct pl_build *b)
{
    struct pl_cand *c = NULL;
    size_t n = 0;
    int rc = pl_cands(b, &c, &n);
    rc = rc ? rc : pl_listed(b, c, n); /* with off: only what a backend holds anyway */
    if (!rc && b->place.mode == PLANNER_MODE_OFF)
        rc = pl_fill_off(b, c, n);
    for (size_t i = 0; !rc && b->place.mode == PLANNER_MODE_LIST && i < n; i++)
        if (c[i].disp == PL_D_HOST)
            rc = pl_decide(b, &c[i], c[i].dev, false, PLANNER_WHY_UNLISTED);
    if (!rc && b->place.mode != PLANNER_MODE_OFF)
        rc = pl_fill_auto(b, c, n);
    free(c);
    if (!rc && b->p->experts_any)
        rc = pl_fill_foreign(b);
    return rc;
}

int planner_build(const struct planner_config *cfg, struct planner_plan **out)
{
    *out = NULL;
    int rc = pl_check_config(cfg);
    if (rc)
        return rc;
    struct pl_build b = {.cfg = cfg, .m = cfg->model};
    rc = pl_init_plan(&b);
    rc = rc ? rc : pl_parse_place(cfg->place, cfg->n_devices, cfg->model->hp.n_layer, &b.place);
    if (b.p)
        b.p->mode = b.place.mode;
    rc = rc ? rc : pl_probabilities(&b);
    rc = rc ? rc : pl_pins(&b);
    rc = rc ? rc : pl_split(&b);
    rc = rc ? rc : pl_mandatory(&b);
    rc = rc ? rc : pl_place_pieces(&b);
    if (!rc)
        pl_marginals(b.p);
    pl_place_free(&b.place);
    free(b.pin);
    free(b.pin_tok);
    free(b.prob);
    if (rc) {
        planner_plan_destroy(b.p);
        return rc;
    }
    *out = b.p;
    return 0;
}

void planner_plan_destroy(struct planner_plan *p)
{
    if (!p)
        return;
    for (uint32_t l = 0; p->layers && l < p->n_layer; l++) {
        free(p->layers[l].resident);
        free(p->layers[l].holder);
    }
    free(p->layers);
    free(p->pieces);
    free(p);
}

const uint8_t *planner_bitmap(const struct planner_plan *p, uint32_t layer)
{
    ASSERT(layer < p->n_layer);
    return p->layers[layer].resident;
}

int planner_holder(const struct planner_plan *p, uint32_t layer, uint32_t expert)
{
    ASSERT(layer < p->n_layer && expert < p->n_expert);
    return p->layers[layer].holder[expert];
}

/* ---- explanation ---- */

static const char *pl_kind_name(enum planner_kind k)
{
    static const char *const names[] = {"lm head", "projections", "shared expert",
                                        "routed expert", "KV cache", "DeltaNet state"};
    return (unsigned)k < sizeof(names) / sizeof(names[0]) ? names[k] : "?";
}

static const char *pl_why_name(enum planner_why w)
{
    static const char *const names[] = {"mandatory", "listed", "by value", "no room",
                                        "not listed", "--place off", "--place off fill",
                                        "foreign"};
    return (unsigned)w < sizeof(names) / sizeof(names[0]) ? names[w] : "?";
}

static void pl_print_device(const struct planner_plan *p, int i, FILE *out)
{
    const struct planner_device_plan *d = &p->dev[i];
    fprintf(out, "[place] device %d (%s): layers %u-%u, budget %s, margin %s, scratch %s; memory "
            "%.1f GB/s, host path %.1f GB/s, host %.1f GB/s, miss ratio %.2f; range reads %s per "
            "token, %.3f ms\n", i, d->name, d->layer_begin, d->layer_end - 1, PL_SZ(d->budget),
            PL_SZ(d->margin), PL_SZ(d->scratch), d->mem_bw / 1e9, d->host_path_bw / 1e9,
            p->host_bw / 1e9, d->miss_ratio, PL_SZ(d->range_bytes), d->range_ms);
}

static void pl_print_piece(const struct planner_plan *p, const struct planner_piece *x, FILE *out)
{
    char where[48] = "lm head";
    if (x->kind == PLANNER_KIND_EXPERT)
        snprintf(where, sizeof(where), "expert %u of layer %u", x->expert, x->layer);
    else if (x->layer != PLANNER_NO_LAYER)
        snprintf(where, sizeof(where), "%s of layer %u",
                 x->kind == PLANNER_KIND_PROJ ? (p->layers[x->layer].recurrent ? "DeltaNet proj"
                                                                               : "attention proj")
                                              : "shared expert", x->layer);
    else if (x->kind != PLANNER_KIND_LMHEAD)
        snprintf(where, sizeof(where), "%s", pl_kind_name(x->kind));
    fprintf(out, "[place] ");
    if (x->device >= 0)
        fprintf(out, "device %d (%s): ", x->device, p->dev[x->device].name);
    else
        fprintf(out, "no device: ");
    if (x->why == PLANNER_WHY_MANDATORY) {
        fprintf(out, "%s %s, mandatory; room %s -> %s\n", where, PL_SZ(x->bytes),
                PL_SZ(x->room_before), PL_SZ(x->room_after));
        return;
    }
    fprintf(out, "%s %s, value %.3f/B -> %s (%s)", where, PL_SZ(x->bytes), x->value,
            x->placed ? "device" : "host", pl_why_name(x->why));
    if (x->has_marginal)
        fprintf(out, "; %s expert %u of layer %u, value %.3f/B", x->placed ? "displaces"
                                                                           : "room kept by",
                x->marginal_expert, x->marginal_layer, x->marginal_value);
    if (x->device >= 0)
        fprintf(out, "; room %s -> %s", PL_SZ(x->room_before), PL_SZ(x->room_after));
    fputc('\n', out);
}

/* Routed experts of one layer in one line. */
static void pl_print_layer_experts(const struct planner_plan *p, uint32_t l, FILE *out)
{
    uint32_t held = 0, best_out = 0;
    double vmax = -1, vmin = INFINITY, vout = -1;
    uint64_t bytes = 0;
    int dev = p->layers[l].device;
    for (size_t i = 0; i < p->n_pieces; i++) {
        const struct planner_piece *x = &p->pieces[i];
        if (x->kind != PLANNER_KIND_EXPERT || x->layer != l || x->why == PLANNER_WHY_FOREIGN)
            continue;
        if (x->placed) {
            held++;
            bytes += x->bytes;
            vmax = x->value > vmax ? x->value : vmax;
            vmin = x->value < vmin ? x->value : vmin;
        } else if (x->value > vout && p->layers[l].holder[x->expert] == PLANNER_HOST) {
            vout = x->value;
            best_out = x->expert;
        }
    }
    fprintf(out, "[place] device %d (%s): layer %u: %u of %u routed experts held, %s", dev,
            p->dev[dev].name, l, held, p->n_expert, PL_SZ(bytes));
    if (held)
        fprintf(out, ", values %.3f..%.3f/B", vmax, vmin);
    if (vout >= 0)
        fprintf(out, "; best left out: expert %u, value %.3f/B", best_out, vout);
    fputc('\n', out);
    if (!p->layers[l].n_foreign)
        return;
    for (int d = 0; d < p->n_devices; d++) { /* --experts-home any: held elsewhere */
        uint32_t k = 0;
        double fmax = -1, fmin = INFINITY;
        for (size_t i = 0; i < p->n_pieces; i++) {
            const struct planner_piece *x = &p->pieces[i];
            if (x->why != PLANNER_WHY_FOREIGN || x->layer != l || x->device != d)
                continue;
            k++;
            fmax = x->value > fmax ? x->value : fmax;
            fmin = x->value < fmin ? x->value : fmin;
        }
        if (k)
            fprintf(out, "[place] device %d (%s): layer %u: %u foreign routed experts held for "
                    "device %d, %s, values %.3f..%.3f/B (p x miss ratio x %.2f: the extra hop)\n",
                    d, p->dev[d].name, l, k, dev, PL_SZ((uint64_t)k * p->layers[l].expert_bytes),
                    fmax, fmin, PLANNER_FOREIGN_DISCOUNT);
    }
}

void planner_print_decisions(const struct planner_plan *p, FILE *out, bool each_expert)
{
    for (int i = 0; i < p->n_devices; i++)
        pl_print_device(p, i, out);
    for (size_t i = 0; i < p->n_pieces; i++)
        if (each_expert || p->pieces[i].kind != PLANNER_KIND_EXPERT)
            pl_print_piece(p, &p->pieces[i], out);
    for (uint32_t l = 0; !each_expert && l < p->n_layer; l++)
        pl_print_layer_experts(p, l, out);
    for (int i = 0; i < p->n_devices; i++) {
        const struct planner_device_plan *d = &p->dev[i];
        fprintf(out, "[place] device %d (%s): holds %s of trunk%s and %u routed experts (%s); "
                "%s of its %s room left\n", i, d->name, PL_SZ(d->trunk),
                d->lmhead ? " (lm head included)" : "", d->n_experts, PL_SZ(d->experts),
                PL_SZ(d->free), PL_SZ(d->room));
        if (p->experts_any)
            fprintf(out, "[place] device %d (%s): holds %u foreign routed experts (%s) of other "
                    "devices' layers (--experts-home any: value p x miss ratio x %.2f for the "
                    "extra hop)\n", i, d->name, d->n_foreign, PL_SZ(d->foreign),
                    PLANNER_FOREIGN_DISCOUNT);
    }
}

static const char *pl_mode_name(enum planner_mode m)
{
    return m == PLANNER_MODE_AUTO ? "auto" : m == PLANNER_MODE_OFF ? "off" : "list";
}

void planner_print_table(const struct planner_plan *p, FILE *out)
{
    fprintf(out, "plan: %u layers, %u routed experts (top %u), routing %s, place %s (%s), ctx %u "
            "(%s KV) x %u sequence%s, host %.1f GB/s\n\n", p->n_layer, p->n_expert, p->top_k,
            p->heat ? "from the heat profile" : "uniform (top_k / n_expert)", p->place,
            pl_mode_name(p->mode), p->n_ctx, p->kv_f16 ? "f16" : "f32", p->n_seq,
            p->n_seq == 1 ? "" : "s", p->host_bw / 1e9);
    fprintf(out, "%-3s %-10s %-9s %10s %10s %10s %10s %10s %10s %12s %6s %10s %8s %6s %9s\n",
            "dev", "name", "layers", "budget", "margin", "scratch", "KV", "state", "trunk",
            "experts", "n", "free", "GB/s", "miss", "ms/token");
    for (int i = 0; i < p->n_devices; i++) {
        const struct planner_device_plan *d = &p->dev[i];
        char range[24];
        snprintf(range, sizeof(range), "%u-%u", d->layer_begin, d->layer_end - 1);
        fprintf(out, "%-3d %-10s %-9s %10s %10s %10s %10s %10s %10s %12s %6u %10s %8.1f %6.2f "
                "%9.3f\n", i, d->name, range, PL_SZ(d->budget), PL_SZ(d->margin),
                PL_SZ(d->scratch), PL_SZ(d->kv), PL_SZ(d->state), PL_SZ(d->trunk),
                PL_SZ(d->experts), d->n_experts, PL_SZ(d->free), d->mem_bw / 1e9,
                d->miss_ratio, d->range_ms);
    }
    for (int i = 0; p->experts_any && i < p->n_devices; i++)
        fprintf(out, "foreign: device %d (%s) holds %u routed experts (%s) of other devices' "
                "layers\n", i, p->dev[i].name, p->dev[i].n_foreign, PL_SZ(p->dev[i].foreign));
    if (p->lmhead_device >= 0)
        fprintf(out, "\nlm head: %s on device %d (%s)\n\n", PL_SZ(p->lmhead_bytes),
                p->lmhead_device, p->dev[p->lmhead_device].name);
    else
        fprintf(out, "\nlm head: %s in host memory\n\n", PL_SZ(p->lmhead_bytes));
    fprintf(out, "%-5s %-3s %-9s %10s %-6s %10s %-6s %10s %9s %10s\n", "layer", "dev", "kind",
            "proj", "where", "shexp", "where", "expert", "held", "bytes");
    for (uint32_t l = 0; l < p->n_layer; l++) {
        const struct planner_layer_plan *lp = &p->layers[l];
        char held[24];
        snprintf(held, sizeof(held), "%u/%u", lp->n_resident, p->n_expert);
        fprintf(out, "%-5u %-3d %-9s %10s %-6s %10s %-6s %10s %9s %10s\n", l, lp->device,
                lp->recurrent ? "deltanet" : "attention", PL_SZ(lp->proj_bytes),
                lp->proj ? "device" : "host", PL_SZ(lp->shexp_bytes),
                !lp->shexp_bytes ? "-" : lp->shexp ? "device" : "host", PL_SZ(lp->expert_bytes),
                held, PL_SZ((uint64_t)lp->n_resident * lp->expert_bytes));
        for (int d = 0; lp->n_foreign && d < p->n_devices; d++) {
            uint32_t k = 0;
            for (uint32_t e = 0; e < p->n_expert; e++)
                k += lp->holder[e] == d && d != lp->device;
            if (k)
                fprintf(out, "      foreign: %u experts of layer %u on device %d (%s)\n", k, l,
                        d, p->dev[d].name);
        }
    }
}

/* ---- heat profiles ---- */

struct pl_json {
    const char *s;       /* text */
    size_t n, i;         /* length, position */
    const char *what;    /* source, for messages */
};

static int pl_json_fail(const struct pl_json *j, const char *expected)
{
    if (j->i >= j->n)
        log_error("heat profile %s: unexpected end at byte %zu: expected %s", j->what, j->i,
                  expected);
    else
        log_error("heat profile %s: byte %zu ('%c'): expected %s", j->what, j->i,
                  j->s[j->i] >= 32 && j->s[j->i] < 127 ? j->s[j->i] : '?', expected);
    return -EINVAL;
}

static void pl_json_ws(struct pl_json *j)
{
    while (j->i < j->n && (j->s[j->i] == ' ' || j->s[j->i] == '\t' || j->s[j->i] == '\n' ||
                           j->s[j->i] == '\r'))
        j->i++;
}

static bool pl_json_eat(struct pl_json *j, char c)
{
    pl_json_ws(j);
    if (j->i < j->n && j->s[j->i] == c) {
        j->i++;
        return true;
    }
    return false;
}

/* A string; its raw bytes (escapes kept) are s[*b, *e). */
static int pl_json_string(struct pl_json *j, size_t *b, size_t *e)
{
    if (!pl_json_eat(j, '"'))
        return pl_json_fail(j, "a string");
    *b = j->i;
    while (j->i < j->n && j->s[j->i] != '"') {
        unsigned char c = (unsigned char)j->s[j->i];
        if (c < 32)
            return pl_json_fail(j, "a closing quote (control character in string)");
        j->i += c == '\\' ? 2 : 1;
    }
    if (j->i >= j->n)
        return pl_json_fail(j, "a closing quote");
    *e = j->i++;
    return 0;
}

static bool pl_json_digit(const struct pl_json *j)
{
    return j->i < j->n && j->s[j->i] >= '0' && j->s[j->i] <= '9';
}

static int pl_json_number(struct pl_json *j)
{
    const size_t start = j->i;
    j->i += j->i < j->n && j->s[j->i] == '-';
    if (!pl_json_digit(j))
        return pl_json_fail(j, "a digit");
    while (pl_json_digit(j))
        j->i++;
    if (j->i < j->n && j->s[j->i] == '.') {
        j->i++;
        if (!pl_json_digit(j))
            return pl_json_fail(j, "a digit after '.'");
        while (pl_json_digit(j))
            j->i++;
    }
    if (j->i < j->n && (j->s[j->i] == 'e' || j->s[j->i] == 'E')) {
        j->i++;
        j->i += j->i < j->n && (j->s[j->i] == '+' || j->s[j->i] == '-');
        if (!pl_json_digit(j))
            return pl_json_fail(j, "an exponent");
        while (pl_json_digit(j))
            j->i++;
    }
    return j->i > start ? 0 : pl_json_fail(j, "a number");
}

/* Any value, checked and skipped. */
static int pl_json_skip(struct pl_json *j, int depth)
{
    if (depth > PL_HEAT_MAX_DEPTH)
        return pl_json_fail(j, "less nesting");
    pl_json_ws(j);
    if (j->i >= j->n)
        return pl_json_fail(j, "a value");
    const char c = j->s[j->i];
    size_t b, e;
    if (c == '"')
        return pl_json_string(j, &b, &e);
    if (c == '{' || c == '[') {
        const char close = c == '{' ? '}' : ']';
        j->i++;
        if (pl_json_eat(j, close))
            return 0;
        do {
            if (c == '{' && (pl_json_string(j, &b, &e) ||
                             (!pl_json_eat(j, ':') && pl_json_fail(j, "':'"))))
                return -EINVAL;
            if (pl_json_skip(j, depth + 1))
                return -EINVAL;
        } while (pl_json_eat(j, ','));
        return pl_json_eat(j, close) ? 0 : pl_json_fail(j, c == '{' ? "',' or '}'" : "',' or ']'");
    }
    static const char *const words[] = {"true", "false", "null"};
    for (int w = 0; w < 3; w++) {
        size_t len = strlen(words[w]);
        if (j->n - j->i >= len && !memcmp(j->s + j->i, words[w], len)) {
            j->i += len;
            return 0;
        }
    }
    return pl_json_number(j);
}

/* A non-negative integer count (no sign, fraction or exponent). */
static int pl_json_count(struct pl_json *j, uint64_t *out)
{
    pl_json_ws(j);
    uint64_t v = 0;
    if (!pl_json_digit(j))
        return pl_json_fail(j, "a non-negative integer count");
    while (pl_json_digit(j)) {
        v = v * 10 + (uint64_t)(j->s[j->i++] - '0');
        if (v > (1ull << 53))
            return pl_json_fail(j, "a count below 2^53");
    }
    if (j->i < j->n && (j->s[j->i] == '.' || j->s[j->i] == 'e' || j->s[j->i] == 'E'))
        return pl_json_fail(j, "an integer count (no fraction or exponent)");
    *out = v;
    return 0;
}

/* Stores v at counts[idx], growing the array (idx is at most its length). */
static int pl_heat_push(struct planner_heat *h, size_t *cap, size_t idx, uint64_t v)
{
    if (idx == *cap) {
        size_t nc = *cap ? *cap * 2 : 1024;
        uint64_t *p = realloc(h->counts, nc * sizeof(*p));
        if (!p)
            return -ENOMEM;
        h->counts = p;
        *cap = nc;
    }
    h->counts[idx] = v;
    return 0;
}

/* One layer's row: "[c0, c1, ...]"; the first row fixes n_expert. */
static int pl_heat_row(struct pl_json *j, struct planner_heat *h, size_t *cap)
{
    if (!pl_json_eat(j, '['))
        return pl_json_fail(j, "'[' opening a layer's expert counts");
    const uint32_t limit = h->n_layer ? h->n_expert : PL_HEAT_MAX_DIM;
    const size_t base = (size_t)h->n_layer * h->n_expert;
    uint32_t n = 0;
    do {
        uint64_t v = 0;
        if (pl_json_count(j, &v))
            return -EINVAL;
        if (n == limit) {
            log_error("heat profile %s: layer %u has more than %u experts (byte %zu)", j->what,
                      h->n_layer, limit, j->i);
            return -EINVAL;
        }
        int rc = pl_heat_push(h, cap, base + n, v);
        if (rc)
            return rc;
        n++;
    } while (pl_json_eat(j, ','));
    if (!pl_json_eat(j, ']'))
        return pl_json_fail(j, "',' or ']' in a layer's expert counts");
    if (h->n_layer && n != h->n_expert) {
        log_error("heat profile %s: layer %u has %u experts, layer 0 has %u", j->what,
                  h->n_layer, n, h->n_expert);
        return -EINVAL;
    }
    h->n_expert = n;
    h->n_layer++;
    return 0;
}

static int pl_heat_matrix(struct pl_json *j, struct planner_heat *h)
{
    size_t cap = 0;
    if (!pl_json_eat(j, '['))
        return pl_json_fail(j, "'[' opening the per-layer arrays of the heat key");
    do {
        if (h->n_layer == PL_HEAT_MAX_DIM) {
            log_error("heat profile %s: more than %u layers", j->what, PL_HEAT_MAX_DIM);
            return -EINVAL;
        }
        int rc = pl_heat_row(j, h, &cap);
        if (rc)
            return rc;
    } while (pl_json_eat(j, ','));
    return pl_json_eat(j, ']') ? 0 : pl_json_fail(j, "',' or ']' after a layer");
}

/* Tokens from a key ending in "_N_tokens"; 0 otherwise. */
static uint64_t pl_heat_key_tokens(const char *k, size_t len)
{
    static const char suffix[] = "_tokens";
    const size_t sl = sizeof(suffix) - 1;
    if (len <= sl || memcmp(k + len - sl, suffix, sl))
        return 0;
    size_t e = len - sl, b = e;
    while (b > 0 && k[b - 1] >= '0' && k[b - 1] <= '9')
        b--;
    if (b == e || b == 0 || k[b - 1] != '_' || e - b > 15)
        return 0;
    uint64_t v = 0;
    for (size_t i = b; i < e; i++)
        v = v * 10 + (uint64_t)(k[i] - '0');
    return v;
}

static int pl_heat_check(const struct pl_json *j, const struct planner_heat *h)
{
    for (uint32_t l = 0; h->tokens && l < h->n_layer; l++)
        for (uint32_t e = 0; e < h->n_expert; e++)
            if (h->counts[(size_t)l * h->n_expert + e] > h->tokens) {
                log_error("heat profile %s: layer %u expert %u was chosen %llu times in %llu "
                          "tokens", j->what, l, e,
                          (unsigned long long)h->counts[(size_t)l * h->n_expert + e],
                          (unsigned long long)h->tokens);
                return -EINVAL;
            }
    return 0;
}

static int pl_heat_object(struct pl_json *j, struct planner_heat *h)
{
    bool found = false;
    if (!pl_json_eat(j, '{'))
        return pl_json_fail(j, "'{' opening the heat profile object");
    if (!pl_json_eat(j, '}')) {
        do {
            size_t kb, ke;
            if (pl_json_string(j, &kb, &ke))
                return -EINVAL;
            if (!pl_json_eat(j, ':'))
                return pl_json_fail(j, "':' after a key");
            const bool heat = ke - kb >= 4 && !memcmp(j->s + kb, "heat", 4);
            if (heat && found) {
                log_error("heat profile %s: a second key starting with \"heat\" at byte %zu",
                          j->what, kb);
                return -EINVAL;
            }
            int rc = heat ? pl_heat_matrix(j, h) : pl_json_skip(j, 1);
            if (rc)
                return rc;
            if (heat)
                h->tokens = pl_heat_key_tokens(j->s + kb, ke - kb);
            found |= heat;
        } while (pl_json_eat(j, ','));
        if (!pl_json_eat(j, '}'))
            return pl_json_fail(j, "',' or '}'");
    }
    pl_json_ws(j);
    if (j->i != j->n)
        return pl_json_fail(j, "the end of the file after the object");
    if (!found) {
        log_error("heat profile %s: no key starting with \"heat\" holding per-layer arrays of "
                  "expert counts", j->what);
        return -EINVAL;
    }
    return pl_heat_check(j, h);
}

int planner_heat_parse(const char *text, size_t len, const char *what,
                       struct planner_heat **out)
{
    *out = NULL;
    struct planner_heat *h = calloc(1, sizeof(*h));
    if (!h)
        return -ENOMEM;
    struct pl_json j = {.s = text, .n = len, .what = what ? what : "(memory)"};
    int rc = pl_heat_object(&j, h);
    if (rc) {
        planner_heat_destroy(h);
        return rc;
    }
    *out = h;
    return 0;
}

int planner_heat_save(const char *path, const struct planner_heat *h, const char *label)
{
    char tmp[4096], key[96];
    if (snprintf(tmp, sizeof(tmp), "%s.tmp", path) >= (int)sizeof(tmp)) {
        log_error("heat profile %s: path too long", path);
        return -EIO;
    }
    size_t kl = 0;
    for (const char *c = label && *label ? label : "run"; *c && kl < 48; c++, kl++)
        key[kl] = (isalnum((unsigned char)*c) || *c == '-') ? *c : '-';
    key[kl] = '\0';
    FILE *f = fopen(tmp, "w");
    if (!f) {
        log_error("heat profile %s: cannot write %s: %s", path, tmp, strerror(errno));
        return -EIO;
    }
    fprintf(f, "{\"heat_%s_%llu_tokens\": [", key, (unsigned long long)h->tokens);
    for (uint32_t l = 0; l < h->n_layer; l++) {
        fputs(l ? ",\n [" : "\n [", f);
        for (uint32_t e = 0; e < h->n_expert; e++)
            fprintf(f, e ? ", %llu" : "%llu",
                    (unsigned long long)h->counts[(size_t)l * h->n_expert + e]);
        fputc(']', f);
    }
    fputs("]}\n", f);
    const bool ok = !ferror(f);
    if (fclose(f) || !ok || rename(tmp, path)) {
        log_error("heat profile %s: writing failed: %s", path, strerror(errno));
        unlink(tmp);
        return -EIO;
    }
    return 0;
}

int planner_heat_load(const char *path, struct planner_heat **out)
{
    *out = NULL;
    FILE *f = fopen(path, "rb");
    if (!f) {
        log_error("cannot read heat profile %s: %s", path, strerror(errno));
        return -EIO;
    }
    char *buf = malloc(PL_HEAT_MAX_FILE + 1);
    size_t n = buf ? fread(buf, 1, PL_HEAT_MAX_FILE + 1, f) : 0;
    int rc = !buf ? -ENOMEM : ferror(f) ? -EIO : n > PL_HEAT_MAX_FILE ? -EFBIG : 0;
    fclose(f);
    if (rc == -EIO || rc == -EFBIG)
        log_error("cannot read heat profile %s: %s", path,
                  rc == -EIO ? "read error" : "larger than 64 MiB");
    if (!rc)
        rc = planner_heat_parse(buf, n, path, out);
    free(buf);
    return rc;
}

void planner_heat_destroy(struct planner_heat *h)
{
    if (!h)
        return;
    free(h->counts);
    free(h);
}

/* ---- measurements and command-line helpers ---- */

struct pl_probe {
    const uint64_t *buf;
    size_t words_per_task;
    uint64_t sink[256];
};

static void pl_probe_task(void *ctx, int64_t t, int thread)
{
    struct pl_probe *pr = ctx;
    const uint64_t *p = pr->buf + (size_t)t * pr->words_per_task;
    uint64_t s0 = 0, s1 = 0, s2 = 0, s3 = 0;
    for (size_t i = 0; i < pr->words_per_task; i += 4) {
        s0 += p[i];
        s1 += p[i + 1];
        s2 += p[i + 2];
        s3 += p[i + 3];
    }
    pr->sink[thread & 255] += s0 ^ s1 ^ s2 ^ s3;
}

static double pl_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

double planner_probe_host_bandwidth(int threads)
{
    const int64_t tasks = 64;
    struct pl_probe pr = {.words_per_task = PLANNER_PROBE_BYTES / 8 / tasks};
    uint64_t *buf = aligned_alloc(64, PLANNER_PROBE_BYTES);
    if (!buf) {
        log_error("host bandwidth probe: cannot allocate %u MiB", PLANNER_PROBE_BYTES >> 20);
        return 0;
    }
    memset(buf, 1, PLANNER_PROBE_BYTES);
    pr.buf = buf;
    struct threadpool_config tc = {.n_threads = threads, .pin = false};
    struct threadpool *pool = threads == 1 ? NULL : threadpool_create(&tc);
    double best = 0;
    for (int r = 0; r < 3; r++) {
        double t0 = pl_now();
        if (pool)
            threadpool_run(pool, pl_probe_task, &pr, tasks);
        for (int64_t t = 0; !pool && t < tasks; t++)
            pl_probe_task(&pr, t, 0);
        double bw = PLANNER_PROBE_BYTES / (pl_now() - t0);
        best = bw > best ? bw : best;
    }
    threadpool_destroy(pool);
    free(buf);
    return pr.sink[0] == 42 ? best * (1 + 1e-15) : best; /* keeps the reads */
}

/* "6G", "512M", "1048576" (binary units) -> bytes. */
static int pl_parse_size(const char *s, uint64_t *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || !(v >= 0) || isinf(v))
        return -EINVAL;
    const char *units = "KMGT";
    const char *u = *end ? strchr(units, *end & ~0x20) : NULL;
    double mul = 1;
    if (u && *end) {
        for (const char *k = units; k <= u; k++)
            mul *= 1024;
        end++;
        end += (*end == 'i' && end[1] == 'B') ? 2 : *end == 'B';
    }
    if (*end || v * mul >= 1.8e19)
        return -EINVAL;
    *out = (uint64_t)(v * mul);
    return 0;
}

/* Splits list into at most cap comma-separated tokens in buf; returns the count or -1. */
static int pl_split_list_tokens(const char *list, char *buf, size_t len, char **tok, int cap)
{
    if (snprintf(buf, len, "%s", list) >= (int)len || !*buf || buf[0] == ',' ||
        buf[strlen(buf) - 1] == ',' || strstr(buf, ",,"))
        return -1;
    int n = 0;
    char *save = NULL;
    for (char *t = strtok_r(buf, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
        if (n == cap)
            return -1;
        tok[n++] = t;
    }
    return n;
}

/* GB/s list into per-device bytes/s (one value for all, or one per device). */
static int pl_parse_bws(const char *list, const char *what, int n_dev, double *out, size_t stride)
{
    char buf[4096], *tok[PLANNER_MAX_DEVICES];
    int n = pl_split_list_tokens(list, buf, sizeof(buf), tok, PLANNER_MAX_DEVICES);
    if (n != 1 && n != n_dev) {
        log_error("%s '%s': give one value or one per device (%d)", what, list, n_dev);
        return -EINVAL;
    }
    for (int i = 0; i < n_dev; i++) {
        char *end;
        double v = strtod(tok[n == 1 ? 0 : i], &end);
        if (end == tok[n == 1 ? 0 : i] || *end || !(v > 0) || isinf(v)) {
            log_error("%s '%s': '%s' is not a positive number of GB/s", what, list,
                      tok[n == 1 ? 0 : i]);
            return -EINVAL;
        }
        *(double *)((char *)out + i * stride) = v * 1e9;
    }
    return 0;
}

/* ---- device probes ---- */

/* Figures a probe spec states for one name. */
struct pl_fig {
    char name[PLANNER_NAME_MAX];
    double gemv, h2d;        /* bytes/s; h2d 0 when not stated */
};

/* The matrix type of the probes' GEMV: the model's routed experts'. */
static uint32_t pl_probe_type(const struct arch_model *m)
{
    for (uint32_t l = 0; m && l < m->hp.n_layer; l++) {
        const struct arch_layer *ly = &m->layers[l];
        if (ly->gate_exps.data || ly->gate_up_exps.data)
            return ly->gate_exps.data ? ly->gate_exps.type : ly->gate_up_exps.type;
    }
    return QUANT_TYPE_Q4_0;
}

static bool pl_is_device(const struct planner_config *cfg, const char *name)
{
    for (int i = 0; i < cfg->n_devices; i++)
        if (!strcmp(cfg->devices[i].name, name))
            return true;
    return false;
}

/* One "DEV=G[:H]" token into f. */
static int pl_parse_fig(const struct planner_config *cfg, const char *spec, char *tok,
                        struct pl_fig *f)
{
    char whole[128];
    snprintf(whole, sizeof(whole), "%s", tok);
    char *eq = strrchr(tok, '=');
    if (!eq || eq == tok || (size_t)(eq - tok) >= PLANNER_NAME_MAX)
        goto bad;
    *eq = 0;
    char *end, *end2 = NULL;
    f->gemv = strtod(eq + 1, &end) * 1e9;
    const bool h2d = *end == ':';
    f->h2d = h2d ? strtod(end + 1, &end2) * 1e9 : 0;
    if (end == eq + 1 || !(f->gemv > 0) || isinf(f->gemv) || (!h2d && *end) ||
        (h2d && (end2 == end + 1 || *end2 || !(f->h2d > 0) || isinf(f->h2d))))
        goto bad;
    if (!strcmp(tok, "cpu") && h2d) {
        log_error("probe figures '%s': cpu takes one figure (its GEMV GB/s), not '%s'", spec,
                  eq + 1);
        return -EINVAL;
    }
    if (strcmp(tok, "cpu") && !pl_is_device(cfg, tok)) {
        log_error("probe figures '%s': '%s' is not one of the devices", spec, tok);
        return -EINVAL;
    }
    snprintf(f->name, sizeof(f->name), "%s", tok);
    return 0;
bad:
    log_error("probe figures '%s': bad figure '%s' (use DEV=GEMV[:H2D] in GB/s, e.g. "
              "cuda:0=3400:53)", spec, whole);
    return -EINVAL;
}

/* Parses a list of figures into figs; returns their count or a negative errno. */
static int pl_parse_figs(const struct planner_config *cfg, const char *spec, struct pl_fig *figs)
{
    char buf[4096], *tok[PLANNER_MAX_DEVICES + 1];
    int n = pl_split_list_tokens(spec, buf, sizeof(buf), tok, PLANNER_MAX_DEVICES + 1);
    if (n < 1) {
        log_error("probe figures '%s': give auto, off or DEV=GEMV[:H2D],... (GB/s)", spec);
        return -EINVAL;
    }
    for (int i = 0; i < n; i++) {
        int rc = pl_parse_fig(cfg, spec, tok[i], &figs[i]);
        if (rc)
            return rc;
        for (int j = 0; j < i; j++)
            if (!strcmp(figs[j].name, figs[i].name)) {
                log_error("probe figures '%s': %s is named twice", spec, figs[i].name);
                return -EINVAL;
            }
    }
    return n;
}

static const struct pl_fig *pl_find_fig(const struct pl_fig *figs, int n, const char *name)
{
    for (int i = 0; i < n; i++)
        if (!strcmp(figs[i].name, name))
            return &figs[i];
    return NULL;
}

/* host_bw: given, stated or probed. */
static int pl_probe_host(struct planner_config *cfg, const struct pl_fig *f, int threads,
                         uint32_t type)
{
    if (cfg->host_bw > 0) {
        log_info("[probe] device cpu: gemv %.1f GB/s (given)", cfg->host_bw / 1e9);
        return 0;
    }
    if (f) {
        cfg->host_bw = f->gemv;
        log_info("[probe] device cpu: gemv %.1f GB/s (stated)", cfg->host_bw / 1e9);
        return 0;
    }
    struct probe_result r;
    int rc = probe_cpu(threads, type, &r);
    if (rc)
        return rc;
    cfg->host_bw = r.gemv_bw;
    log_info("[probe] device cpu: gemv %.1f GB/s (%s, %d threads, %u MiB, %.0f ms)",
             r.gemv_bw / 1e9, quant_type_name(r.type), r.threads, PROBE_CPU_BYTES >> 20, r.ms);
    return 0;
}

/* Device i (the first of its name): stated, given, probed, or defaults. */
static int pl_probe_one(struct planner_config *cfg, int i, const struct pl_fig *f, bool local,
                        uint32_t type)
{
    struct planner_device *d = &cfg->devices[i];
    if (f) {
        d->mem_bw = d->mem_bw > 0 ? d->mem_bw : f->gemv;
        d->host_path_bw = d->host_path_bw > 0 ? d->host_path_bw : f->h2d;
        log_info("[probe] device %s: gemv %.1f GB/s, h2d %.1f GB/s (stated)", d->name,
                 d->mem_bw / 1e9, (d->host_path_bw > 0 ? d->host_path_bw : cfg->host_bw) / 1e9);
        return 0;
    }
    if (d->mem_bw > 0 && d->host_path_bw > 0) {
        log_info("[probe] device %s: gemv %.1f GB/s, h2d %.1f GB/s (given)", d->name,
                 d->mem_bw / 1e9, d->host_path_bw / 1e9);
        return 0;
    }
    if (strncmp(d->name, "cuda:", 5) || !local) {
        log_info("[probe] device %s: not probed (%s): default figures", d->name,
                 local ? "not cpu or cuda:N" : "its worker runs elsewhere");
        return 0;
    }
    struct probe_result r;
    int rc = probe_device(d->name, 0, type, &r);
    if (rc)
        return rc;
    d->mem_bw = d->mem_bw > 0 ? d->mem_bw : r.gemv_bw;
    d->host_path_bw = d->host_path_bw > 0 ? d->host_path_bw : r.h2d_bw;
    log_info("[probe] device %s: gemv %.1f GB/s, h2d %.1f GB/s (%s, %u MiB; copy %u MiB; "
             "%.1f of %.1f GiB free; %.0f ms)", d->name, r.gemv_bw / 1e9, r.h2d_bw / 1e9,
             quant_type_name(r.type), PROBE_GPU_BYTES >> 20, PROBE_COPY_BYTES >> 20,
             r.mem_free / 1073741824.0, r.mem_total / 1073741824.0, r.ms);
    return 0;
}

static bool pl_probe_close(const struct planner_device *a, const struct planner_device *b)
{
    const double s = PLANNER_PROBE_SAME;
    return fabs(a->mem_bw - b->mem_bw) <= s * fmax(a->mem_bw, b->mem_bw) &&
           fabs(a->host_path_bw - b->host_path_bw) <= s * fmax(a->host_path_bw, b->host_path_bw);
}

/* Probed cards whose figures are within PLANNER_PROBE_SAME of the first of
 * a group take the group's mean, so that probe noise does not move a layer
 * between equal cards from one start to the next. */
static void pl_probe_snap(struct planner_config *cfg, const bool *probed)
{
    bool grouped[PLANNER_MAX_DEVICES] = {0};
    for (int i = 0; i < cfg->n_devices; i++) {
        if (!probed[i] || grouped[i])
            continue;
        bool in[PLANNER_MAX_DEVICES] = {0};
        double gemv = 0, h2d = 0;
        int n = 0;
        for (int j = i; j < cfg->n_devices; j++)
            if (probed[j] && !grouped[j] && pl_probe_close(&cfg->devices[i], &cfg->devices[j])) {
                in[j] = grouped[j] = true;
                gemv += cfg->devices[j].mem_bw;
                h2d += cfg->devices[j].host_path_bw;
                n++;
            }
        for (int j = i; j < cfg->n_devices && n > 1; j++) {
            if (!in[j])
                continue;
            cfg->devices[j].mem_bw = gemv / n;
            cfg->devices[j].host_path_bw = h2d / n;
            log_info("[probe] device %s: gemv %.1f GB/s, h2d %.1f GB/s (the mean of %d cards "
                     "within %.0f%%)", cfg->devices[j].name, gemv / n / 1e9, h2d / n / 1e9, n,
                     100 * PLANNER_PROBE_SAME);
        }
    }
}

int planner_probe_devices(struct planner_config *cfg, const char *spec, int threads, bool local)
{
    if (spec && !strcmp(spec, "off")) {
        log_info("[probe] off: default figures (host %.1f GB/s)",
                 (cfg->host_bw > 0 ? cfg->host_bw : PLANNER_HOST_BW_DEFAULT) / 1e9);
        return 0;
    }
    struct pl_fig figs[PLANNER_MAX_DEVICES + 1];
    int n = 0;
    if (spec && *spec && strcmp(spec, "auto"))
        n = pl_parse_figs(cfg, spec, figs);
    if (n < 0)
        return n;
    const uint32_t type = pl_probe_type(cfg->model);
    int rc = pl_probe_host(cfg, pl_find_fig(figs, n, "cpu"), threads, type);
    bool probed[PLANNER_MAX_DEVICES] = {0};
    int first[PLANNER_MAX_DEVICES];
    for (int i = 0; i < cfg->n_devices && !rc; i++) {
        struct planner_device *d = &cfg->devices[i];
        for (first[i] = 0; strcmp(cfg->devices[first[i]].name, d->name);)
            first[i]++;
        if (first[i] < i || !strcmp(d->name, "cpu"))
            continue;
        const struct pl_fig *f = pl_find_fig(figs, n, d->name);
        const bool zero = d->mem_bw == 0 && d->host_path_bw == 0;
        rc = pl_probe_one(cfg, i, f, local, type);
        probed[i] = !rc && !f && zero && d->mem_bw > 0;
    }
    if (rc)
        return rc;
    pl_probe_snap(cfg, probed);
    for (int i = 0; i < cfg->n_devices; i++) { /* more workers on one device: its figures */
        cfg->devices[i].mem_bw = cfg->devices[first[i]].mem_bw;
        cfg->devices[i].host_path_bw = cfg->devices[first[i]].host_path_bw;
    }
    return 0;
}

int planner_parse_devices(struct planner_config *cfg, char store[][PLANNER_NAME_MAX],
                          const char *names, const char *mems, const char *mem_bws,
                          const char *path_bws)
{
    char buf[4096], *tok[PLANNER_MAX_DEVICES];
    int n = names ? pl_split_list_tokens(names, buf, sizeof(buf), tok, PLANNER_MAX_DEVICES) : -1;
    if (n < 1) {
        log_error("--devices '%s': give 1 to %d comma-separated names like cpu,cpu",
                  names ? names : "", PLANNER_MAX_DEVICES);
        return -EINVAL;
    }
    for (int i = 0; i < n; i++) {
        size_t len = strlen(tok[i]);
        if (len >= PLANNER_NAME_MAX || strspn(tok[i], "abcdefghijklmnopqrstuvwxyzABCDEFGHIJKLMNO"
                                                       "PQRSTUVWXYZ0123456789:_.-") != len) {
            log_error("--devices '%s': bad device name '%s'", names, tok[i]);
            return -EINVAL;
        }
        memcpy(store[i], tok[i], len + 1);
        cfg->devices[i] = (struct planner_device){.name = store[i],
                                                  .holds_trunk = !strncmp(store[i], "cuda", 4)};
    }
    cfg->n_devices = n;
    char mbuf[4096], *mtok[PLANNER_MAX_DEVICES];
    int nm = mems ? pl_split_list_tokens(mems, mbuf, sizeof(mbuf), mtok, PLANNER_MAX_DEVICES) : 0;
    if (mems && nm != 1 && nm != n) {
        log_error("--device-mem '%s': give one size or one per device (%d)", mems, n);
        return -EINVAL;
    }
    for (int i = 0; i < n && nm > 0; i++) {
        const char *t = mtok[nm == 1 ? 0 : i];
        if (pl_parse_size(t, &cfg->devices[i].budget)) {
            log_error("--device-mem '%s': bad size '%s' (use e.g. 6G or 512M)", mems, t);
            return -EINVAL;
        }
    }
    const size_t stride = sizeof(cfg->devices[0]);
    if (mem_bws && pl_parse_bws(mem_bws, "--device-bw", n, &cfg->devices[0].mem_bw, stride))
        return -EINVAL;
    if (path_bws &&
        pl_parse_bws(path_bws, "--path-bw", n, &cfg->devices[0].host_path_bw, stride))
        return -EINVAL;
    return 0;
}
