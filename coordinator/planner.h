/*
 * planner: the placement plan, i.e. which device runs which layers and which
 * pieces of the model each device holds in its own memory (issue 5;
 * architecture.md, "Memory tiers and placement"). The coordinator builds it
 * once at start from sizes alone (no tensor data is read) and hands each
 * worker its layer range and residency bitmaps.
 *
 * Pieces. Mandatory, per device: the KV cache of its attention layers and the
 * DeltaNet state of its recurrent layers (n_seq sequences of n_ctx positions),
 * plus its scratch and a margin. Movable: the output projection ("lmhead",
 * may go to any device), per layer the attention or DeltaNet projections with
 * the router ("proj": wq wk wv wo | wqkv wz win wba wbeta walpha wout, and
 * ffn_gate_inp), per layer the shared expert ("shexp": its three matrices),
 * and every routed expert of every layer (gate+up+down, one expert's rows).
 * Sizes are the matrices' bytes as stored; small f32 vectors (norms, conv
 * taps, ssm_a, the shared-expert gate) are not charged (the margin covers
 * them). A piece of a layer can only go to the device that owns the layer.
 *
 * Algorithm (planner_build):
 *  1. Layer ranges first. "auto": contiguous ranges in device order, each at
 *     least one layer, minimizing the largest expected time per token of a
 *     range, time = bytes read per token of the range / the device's memory
 *     bandwidth; bytes read per token of a layer = proj + shexp + top_k x one
 *     routed expert + (recurrent layers) one sequence's DeltaNet state (KV
 *     reads grow with the position and are left out; the lm head belongs to
 *     no range). Ties: the smallest last boundary, then recursively. Layers
 *     that an explicit --place list names for a device are pinned to it.
 *     An explicit list of ranges ("0-19,20-39") is taken as given.
 *  2. Mandatory charges: room = budget - margin - scratch - KV - state; a
 *     device whose room is negative fails the plan (-ENOSPC, the message names
 *     the device and every byte count).
 *  3. Value per byte = memory traffic saved per token per byte of device
 *     memory: 1 for lmhead, proj and shexp (read by every token); for routed
 *     expert e of layer l: p(l,e) x miss ratio, with p from the heat profile
 *     (else top_k / n_expert) and miss ratio = mem_bw / min(host_path_bw,
 *     host_bw) of the device that owns the layer.
 *     Note: a dense piece left in host memory is read over the same slow
 *     path, so with GPU figures (miss ratio ~90) the literal model ranks every
 *     expert with p > 1/ratio above the trunk. cfg->dense_miss_ratio values
 *     dense pieces at 1 x miss ratio instead (trunk first, heat orders the
 *     experts); on the CPU backend (ratio 1) both models agree.
 *  4. Fill: pieces in order of value (highest first); at equal value the
 *     device with the most room goes first (the lm head goes to the device
 *     with the most room), then lmhead, proj, shexp, routed experts, then for
 *     trunk pieces the lower layer, for experts the lower expert id and then
 *     the lower layer (so that equally valued experts spread over the layers).
 *     A piece that fits its device's remaining room is placed and charged;
 *     one that does not stays in host memory and the fill goes on with the
 *     next (smaller pieces may still fit).
 *  5. Foreign experts (cfg->experts_home "any"; "range", the default, stops
 *     after 4 and gives the same plan as before the option existed). Every
 *     routed expert the fill left in host memory for want of room (why
 *     NO_ROOM, also --place off's) is offered to the other devices' room
 *     left: highest value first, each to the device other than its layer's
 *     owner with the most room left that it fits (ties: the lowest index).
 *     Value of expert e of layer l held by device d for its owner o:
 *     p(l,e) x miss ratio(d) x PLANNER_FOREIGN_DISCOUNT. The discount states
 *     the extra hop: a foreign hit still travels o -> coordinator -> d ->
 *     coordinator -> o, the hop a CPU-pool miss takes plus one more, so it
 *     saves only the weight read (device d's memory instead of host DRAM),
 *     not the transfer; the room it takes is room the fill left idle, so
 *     any value above 0 is worth it, and the value orders the offers and
 *     is printed. The decision's why is FOREIGN; the layer's holder table
 *     records d.
 *
 * Place spec (cfg->place):
 *     spec   := "auto" | "off" | item ("," item)*
 *     item   := piece "=" target
 *     piece  := "lmhead" | "attn" | "dnproj" | "proj" | "shexp" | "experts"
 *     target := "all" | "none" | "auto" | sel ("+" sel)*
 *     sel    := DEV [":" N ["-" M]]          (decimal; layers N..M inclusive)
 *  - auto (also NULL or ""): every movable piece is offered to the fill.
 *  - off: experts only, as before placement existed: no lmhead, proj or
 *    shexp is placed (they stay in host memory); each device holds the same
 *    number k of routed experts in every layer of its range, the largest k
 *    that fits its room, experts (j + layer) % n_expert for j < k (the
 *    stopgap's choice; heat is not used).
 *  - a list: attn = projections of attention layers, dnproj = of DeltaNet
 *    layers, proj = both (naming proj and attn/dnproj is an error, as is
 *    naming any piece twice). Target all = every such piece on the device that
 *    owns its layer (lmhead: the last device); none = in host memory; auto =
 *    offered to the fill after the listed pieces are charged; DEV = the
 *    pieces of every layer DEV owns (lmhead: on DEV); DEV:N-M = the pieces of
 *    layers N..M on DEV, pinning those layers to DEV (with --layers auto the
 *    split honours the pins; with explicit ranges a pin outside DEV's range is
 *    an error). Pieces the list does not name stay in host memory. Listed
 *    pieces are placed as written and charged first; a device whose listed
 *    pieces exceed its room fails the plan (-ENOSPC naming the device and the
 *    bytes). A malformed spec fails with -EINVAL naming the offending token.
 *
 * Threading: planner functions are reentrant; a plan is read-only after
 * planner_build and may be shared by threads. Logging: errors once, where
 * found; the [place] lines are printed only by planner_print_decisions.
 */
#ifndef COORDINATOR_PLANNER_H
#define COORDINATOR_PLANNER_H

#include <stdbool.h>
#include <stdint.h>
#include <stdio.h>

#include "model/arch.h"

#define PLANNER_MAX_DEVICES 64          /* devices in one plan */
#define PLANNER_NAME_MAX 32             /* bytes of a device label, NUL included */
#define PLANNER_MARGIN_DEFAULT 0.02     /* share of each budget kept free when margin_frac is 0 */
#define PLANNER_MARGIN_NONE (-1.0)      /* margin_frac value for no margin */
#define PLANNER_HOST_BW_DEFAULT 20e9    /* bytes/s assumed for host DRAM when host_bw is 0 */
#define PLANNER_CTX_DEFAULT 4096        /* KV positions when n_ctx is 0 */
#define PLANNER_BATCH_DEFAULT 256       /* tokens per step when max_batch is 0 */
#define PLANNER_PROBE_BYTES (256u << 20) /* buffer the host bandwidth probe reads */
#define PLANNER_NO_LAYER UINT32_MAX     /* layer of pieces that belong to no layer */
#define PLANNER_PROBE_SAME 0.05         /* probed cards this close (share) take their mean */
#define PLANNER_FOREIGN_DISCOUNT 0.5    /* value share of a foreign expert (step 5 above) */
#define PLANNER_HOST (-1)               /* holder of an expert left in host memory */

enum planner_kind {
    PLANNER_KIND_LMHEAD = 0,  /* output projection */
    PLANNER_KIND_PROJ = 1,    /* attention or DeltaNet projections + router of a layer */
    PLANNER_KIND_SHEXP = 2,   /* shared expert of a layer */
    PLANNER_KIND_EXPERT = 3,  /* one routed expert of a layer */
    PLANNER_KIND_KV = 4,      /* KV cache of a device's attention layers (mandatory) */
    PLANNER_KIND_STATE = 5,   /* DeltaNet state of a device's recurrent layers (mandatory) */
};

/* Why a piece ended where it did. */
enum planner_why {
    PLANNER_WHY_MANDATORY = 0, /* KV or state: always on its device */
    PLANNER_WHY_LISTED = 1,    /* named for this device by the place list */
    PLANNER_WHY_VALUE = 2,     /* placed by the value fill */
    PLANNER_WHY_NO_ROOM = 3,   /* offered, but larger than the device's remaining room */
    PLANNER_WHY_UNLISTED = 4,  /* the place list leaves it in host memory */
    PLANNER_WHY_OFF = 5,       /* --place off: trunk stays in host memory */
    PLANNER_WHY_OFF_FILL = 6,  /* --place off: one of the k experts of every layer */
    PLANNER_WHY_FOREIGN = 7,   /* --experts-home any: held by a device that does not own its
                                  layer, in the room the fill left */
};

enum planner_mode {
    PLANNER_MODE_AUTO = 0,
    PLANNER_MODE_OFF = 1,
    PLANNER_MODE_LIST = 2,
};

/* Routing counts of a heat profile: per layer, per expert, how often the
 * expert was among the top_k of a token. */
struct planner_heat {
    uint32_t n_layer, n_expert;
    uint64_t tokens;         /* tokens the counts come from (from the key name); 0 unknown */
    uint64_t *counts;        /* n_layer x n_expert, row-major; owned */
};

/* One device as the planner sees it. */
struct planner_device {
    const char *name;        /* label ("cpu", "cuda:0"); borrowed for planner_build */
    uint64_t budget;         /* bytes of device memory; 0 = unknown: planner_build fails */
    double mem_bw;           /* bytes/s read from its own memory; 0 = host_bw (CPU backend) */
    double host_path_bw;     /* bytes/s it reads host memory at; 0 = host_bw (CPU backend) */
    uint64_t scratch;        /* bytes of work buffers; 0 = planner_scratch_cpu() */
    bool holds_trunk;        /* its backend keeps the projections and shared experts of its
                                layers (and, on the last device, the lm head) in its memory
                                whatever the spec (the CUDA backend): they are placed there
                                as listed pieces, and a budget they do not fit fails */
};

struct planner_config {
    const struct arch_model *model;   /* borrowed for planner_build */
    int n_devices;                    /* 1..PLANNER_MAX_DEVICES */
    struct planner_device devices[PLANNER_MAX_DEVICES];
    double host_bw;                   /* host DRAM read bytes/s; 0 = PLANNER_HOST_BW_DEFAULT */
    const struct planner_heat *heat;  /* borrowed; NULL: p = top_k / n_expert */
    const char *place;                /* place spec (see above); NULL = "auto" */
    const char *layers;               /* "auto" (NULL) or ranges "0-19,20-39" */
    uint32_t n_ctx;                   /* KV positions per sequence; 0 = PLANNER_CTX_DEFAULT */
    bool kv_f16;                      /* f16 KV cache (else f32) */
    uint32_t max_batch;               /* tokens per step (scratch); 0 = PLANNER_BATCH_DEFAULT */
    uint32_t n_seq;                   /* sequences with their own KV and state; 0 = 1 */
    double margin_frac;               /* share of each budget kept free, < 0.5; 0 = default
                                         PLANNER_MARGIN_DEFAULT; < 0 = none */
    bool dense_miss_ratio;            /* value lmhead/proj/shexp at 1 x the owner's miss ratio
                                         (the lm head: the last device's) instead of 1; see
                                         the note on the value model above */
    const char *experts_home;         /* "range" (NULL): routed experts only on the device
                                         that owns their layer; "any": room left holds
                                         experts of other devices' layers (step 5) */
};

/* One decision, in the order the planner made them. */
struct planner_piece {
    enum planner_kind kind;
    int device;              /* device it was offered to or placed on; -1: none (lmhead) */
    uint32_t layer;          /* its layer; PLANNER_NO_LAYER for lmhead, KV, state */
    uint32_t expert;         /* routed expert id; 0 otherwise */
    uint64_t bytes;          /* size */
    double value;            /* traffic saved per token per byte; 0 for mandatory pieces */
    bool placed;             /* held in the device's memory */
    enum planner_why why;
    uint64_t room_before;    /* device room left before the decision (after for mandatory) */
    uint64_t room_after;     /* and after it */
    /* Trunk pieces: the marginal routed expert of the same device. Placed by
     * value: the best expert left out whose value is <= this piece's (what
     * its room would have held); listed: the best expert left out; left out
     * for room: the worst expert placed whose value is > this piece's (what
     * kept its room). has_marginal is false when there is none. */
    bool has_marginal;
    uint32_t marginal_layer, marginal_expert;
    double marginal_value;
};

struct planner_device_plan {
    char name[PLANNER_NAME_MAX];
    uint32_t layer_begin, layer_end;  /* range [begin, end) */
    uint64_t budget, margin, scratch; /* bytes */
    uint64_t kv, state;               /* mandatory bytes */
    uint64_t room;                    /* budget - margin - scratch - kv - state */
    uint64_t trunk;                   /* bytes of lmhead, proj and shexp placed here */
    uint64_t experts;                 /* bytes of routed experts placed here */
    uint32_t n_experts;               /* routed experts placed here, of its own layers */
    uint64_t foreign;                 /* bytes of experts of other devices' layers held here */
    uint32_t n_foreign;               /* those experts */
    uint64_t free;                    /* room - trunk - experts - foreign */
    bool lmhead;                      /* holds the output projection */
    double mem_bw, host_path_bw;      /* bytes/s, defaults resolved */
    double miss_ratio;                /* mem_bw / min(host_path_bw, host_bw) */
    uint64_t range_bytes;             /* bytes read per token over its range (split cost) */
    double range_ms;                  /* range_bytes / mem_bw, in ms */
};

struct planner_layer_plan {
    int device;                       /* owner */
    bool recurrent;                   /* DeltaNet layer, else attention */
    uint64_t proj_bytes, shexp_bytes; /* sizes (shexp 0 when absent) */
    uint64_t expert_bytes;            /* one routed expert */
    bool proj, shexp;                 /* placed on the owner */
    uint8_t *resident;                /* (n_expert + 7) / 8 bytes, bit e: expert e placed */
    uint32_t n_resident;              /* bits set */
    int16_t *holder;                  /* n_expert entries: device holding expert e (the owner
                                         when resident, another device when foreign), or
                                         PLANNER_HOST */
    uint32_t n_foreign;               /* experts of this layer held by other devices */
};

struct planner_plan {
    enum planner_mode mode;
    bool heat;                        /* probabilities from a heat profile */
    uint32_t n_layer, n_expert, top_k;
    double host_bw;                   /* bytes/s, default resolved */
    uint32_t n_ctx, n_seq;
    bool kv_f16;
    int n_devices;
    struct planner_device_plan dev[PLANNER_MAX_DEVICES];
    struct planner_layer_plan *layers;/* n_layer entries */
    int lmhead_device;                /* -1: host memory */
    uint64_t lmhead_bytes;
    struct planner_piece *pieces;     /* decisions, in order */
    size_t n_pieces;
    char place[256];                  /* the spec, for the table */
    bool experts_any;                 /* --experts-home any */
};

/* ---- building a plan ---- */

/* Builds the plan. Returns 0 and an owned plan in *out (planner_plan_destroy),
 * or after one error line: -EINVAL (bad config, spec, ranges or heat shape:
 * the message names the token or field), -ENOSPC (a device's mandatory or
 * listed pieces do not fit: it names the device and the bytes), -ENOMEM.
 * Reads only sizes and hyper-parameters of cfg->model, never tensor data. */
int planner_build(const struct planner_config *cfg, struct planner_plan **out);

/* Frees a plan; accepts NULL. */
void planner_plan_destroy(struct planner_plan *p);

/* Per model layer: its residency bitmap (the wire LoadPlan's), borrowed from
 * the plan; ASSERTs layer < n_layer. */
const uint8_t *planner_bitmap(const struct planner_plan *p, uint32_t layer);

/* Device holding expert e of layer l (own or foreign), or PLANNER_HOST; ASSERTs bounds. */
int planner_holder(const struct planner_plan *p, uint32_t layer, uint32_t expert);

/* ---- explanation ---- */

/* One "[place]" line per decision: device lines (range, budget, bandwidths),
 * mandatory charges, every trunk piece (size, value per byte, where it went,
 * the marginal expert it displaced and its value, room before and after) and
 * routed experts one line per layer (count, bytes, value range, best one left
 * out), or one line per expert when each_expert. */
void planner_print_decisions(const struct planner_plan *p, FILE *out, bool each_expert);

/* The whole plan as tables: one row per device, one row per layer. */
void planner_print_table(const struct planner_plan *p, FILE *out);

/* ---- sizes (shared with backends and tests) ---- */

uint64_t planner_proj_bytes(const struct arch_layer *ly);
uint64_t planner_shexp_bytes(const struct arch_layer *ly);
uint64_t planner_expert_bytes(const struct arch_layer *ly);
/* Weight bytes one decoded token reads in layer l: projections, router,
 * shared expert and top_k routed experts (the layer split's cost model). */
uint64_t planner_layer_read_bytes(const struct arch_model *m, uint32_t l);
/* One sequence's KV cache of an attention layer (0 for a recurrent one). */
uint64_t planner_kv_bytes(const struct arch_model *m, uint32_t layer, uint32_t n_ctx, bool kv_f16);
/* One sequence's DeltaNet conv and recurrent state of a layer (0 for attention). */
uint64_t planner_state_bytes(const struct arch_model *m, uint32_t layer);
/* The CPU backend's scratch: max_batch x n_embd x (2 top_k + 16) floats. */
uint64_t planner_scratch_cpu(const struct arch_model *m, uint32_t max_batch);

/* ---- heat profiles ---- */

/* Parses a heat profile: a JSON object with one key starting with "heat"
 * whose value is an array (layers) of arrays (experts) of non-negative
 * integer counts, every row the same length; a key ending in "_N_tokens"
 * ("heat_eval_2048_tokens") gives the token count N, and then every count
 * must be <= N. Other keys may hold any JSON value and are ignored. Returns
 * 0 and an owned profile, or -EINVAL after one error line naming `what` (a
 * path, for messages), the byte offset and what was expected; -ENOMEM. */
int planner_heat_parse(const char *text, size_t len, const char *what,
                       struct planner_heat **out);

/* Reads and parses a heat file (at most 64 MiB). Returns as planner_heat_parse,
 * or -EIO / -EFBIG when the file cannot be read. */
int planner_heat_load(const char *path, struct planner_heat **out);

void planner_heat_destroy(struct planner_heat *h);

/* Writes h as a heat file that planner_heat_load reads back: one key
 * "heat_<label>_<tokens>_tokens" (label: letters, digits and '-', else
 * replaced by '-'; tokens h->tokens) holding n_layer arrays of n_expert
 * counts. Written to PATH.tmp and renamed over PATH, so a reader never sees
 * half a file. Returns 0, or -EIO (logged, naming the path). */
int planner_heat_save(const char *path, const struct planner_heat *h, const char *label);

/* ---- measurements and command-line helpers ---- */

/* Host read bandwidth in bytes/s: the best of three passes over a
 * PLANNER_PROBE_BYTES buffer, on one thread (or threads cores, <= 0: all
 * physical cores). Returns 0 when the buffer cannot be allocated (logged). */
double planner_probe_host_bandwidth(int threads);

/* Device speeds for the plan (worker/probe.h): fills cfg->host_bw and each
 * device's mem_bw and host_path_bw that are still 0 (figures given by the
 * caller stay), from probes or from stated figures, and logs one "[probe]"
 * line per distinct device name (info level). cfg->n_devices, the names and
 * cfg->model (for the GEMV's matrix type: its routed experts' type) must be
 * set. Spec:
 *     spec := "auto" | "off" | fig ("," fig)*        (NULL or "": auto)
 *     fig  := DEV "=" GEMV [":" H2D]                 (GB/s, decimal, > 0)
 *  - auto: the host is probed (CPU GEMV on `threads` threads, <= 0: one per
 *    physical core): host_bw, which "cpu" devices also take (their fields
 *    stay 0 and resolve to host_bw). Every "cuda:N" device is probed once
 *    when `local` (its worker runs on this host): mem_bw = its GEMV rate,
 *    host_path_bw = its pinned copy rate; when not local it keeps the
 *    defaults, and its line says so. Other names keep the defaults. Probed
 *    cards whose two figures are both within PLANNER_PROBE_SAME of each
 *    other take their means (equal cards get equal layers on every start).
 *  - off: nothing is measured or set; every figure is its default, so the
 *    plan does not depend on the machine (tests).
 *  - a list states figures: "cpu=G" is host_bw; "DEV=G:H" sets mem_bw = G
 *    and host_path_bw = H of every device named DEV ("DEV=G": mem_bw only,
 *    the path keeps its default). What the list does not name is probed as
 *    with auto.
 * Returns 0; -EINVAL (logged, naming the token) for a malformed figure or a
 * name that is neither cpu nor a device of cfg; a probe's error (-ENODEV,
 * -ENOMEM, -EIO: logged by the probe). Blocks for the probes (about 0.3 s
 * per device after the CUDA context exists); see worker/probe.h for the
 * process rules of a CUDA probe. */
int planner_probe_devices(struct planner_config *cfg, const char *spec, int threads, bool local);

/* Fills cfg->n_devices and cfg->devices from comma lists: names (required,
 * e.g. "cpu,cpu"), budgets ("8G,16G" or one size for all: K/M/G/T, binary),
 * memory and host-path bandwidths in GB/s ("3350,1000" or one for all;
 * NULL: defaults). Names are copied into `store` and cfg->devices[i].name
 * points there (the caller keeps store as long as cfg). Returns 0 or -EINVAL
 * after an error naming the bad token. */
int planner_parse_devices(struct planner_config *cfg, char store[][PLANNER_NAME_MAX],
                          const char *names, const char *mems, const char *mem_bws,
                          const char *path_bws);

#endif
