/*
 * backend_cuda: the worker backend that runs its layer range on one NVIDIA
 * GPU (see backend.h). It computes what worker/forward.c computes, layer for
 * layer, through the extern "C" launchers of kernels/cuda/{matvec,ops,
 * deltanet}.h only, on one CUDA stream; calls come from the worker's thread.
 *
 * Device: index LAMINA_CUDA_DEVICE (default 0) in PCI bus order (init sets
 * CUDA_DEVICE_ORDER=PCI_BUS_ID, which takes effect only if no CUDA call was
 * made in the process before).
 *
 * Memory (all charged to cfg->device_mem; 0 = the card's free memory minus
 * CB_MEM_MARGIN; a plan that does not fit is refused with each part's size):
 *   trunk: one buffer with every matrix of the range as stored (projections,
 *     router, shared expert) and the f32 vectors (norms, conv taps, ssm_a,
 *     dt bias, shared-expert gate). Two matrices are stored with their rows
 *     permuted so that no unpack kernel is needed: legacy ssm_in becomes
 *     [q | k | v | z] (one product into the conv input, one into z) and
 *     ssm_ba becomes [beta rows | alpha rows]. Shared gate and up are stored
 *     back to back (one 2*Fs-row product) when their types agree;
 *   experts: per layer one buffer with the resident experts (copied from
 *     cfg->expert_src, the shm segment, or the model file), and per layer a
 *     device table of n_expert pointers for gate (or gate_up), up and down,
 *     NULL where the expert is not resident;
 *   state: per sequence slot (cfg->n_seq of them, back to back), the DeltaNet
 *     conv and delta states (zeroed by reset) and the KV cache (f16 when
 *     cfg->kv_f16); use_seq points the layers' state views at a slot;
 *   scratch: activations for max_batch tokens;
 *   output head: the output norm and lm head are uploaded on the first
 *     logits() call (only the last worker makes one), with logits scratch
 *     for CB_LOGIT_ROWS rows; they are charged to the budget then, and a
 *     budget they do not fit fails that call with -ENOMEM. One row's lm head
 *     normalises h itself (cuda_matvec_norm, the same bits; LAMINA_CUDA_FUSE=0:
 *     the norm a launch of its own, as for several rows).
 *
 * A layers() call uploads h, enqueues every layer and downloads h; a host
 * sync happens only at the end, and in a layer where some expert of the
 * range is not resident: there the expert ids and the normalised ffn input
 * are downloaded, the non-resident (token, slot) pairs grouped by expert as
 * forward.c's fw_route groups its remote ones (experts ascending, tokens
 * ascending), sent through cfg->remote.submit, the GPU's own experts and the
 * shared expert enqueued, the replies collected and uploaded into the expert
 * output rows of their pairs, then combined.
 *
 * Decode steps (n = 1) of a range whose experts are all resident run as one
 * CUDA graph, captured at the first decode step and replayed unchanged after:
 * the position reaches the kernels through a device word (c->d_pos, uploaded
 * before each replay), the attention decode is sized for the whole context
 * (cuda_attention_decode_at: its splits follow from the position on the
 * device, workspace preallocated), so nothing captured depends on the step.
 * A graph bakes the state pointers in: each sequence slot has its own two
 * (CB_G_FUSED below fused_below, CB_G_SPLIT past it), each captured at that
 * slot's first decode step that takes it.
 * Kernels per token (logged once; for the 48-layer 80b-a3b Qwen3-Next 364
 * a decode step past fused_below and 340 below it as graph_trace counted
 * them, docs/perf.md): per
 * attention layer the q|k|v product (one launch where the three share a row
 * format, stacked in the trunk), the fused q/k norm + rope + KV store
 * (cuda_attn_prep), attention and its split combine, the output product (at
 * positions below fused_below the three in one launch where it takes the
 * shape, cuda_attention_decode_fused: faster on an H200 at an empty context,
 * slower at 4096 positions, docs/perf.md; so each slot has two decode graphs,
 * CB_G_FUSED and CB_G_SPLIT); per
 * DeltaNet layer the qkv|z|beta|alpha product (stacked likewise), conv and
 * heads in one launch (cuda_deltanet_conv_heads; LAMINA_CUDA_FUSE=0: two),
 * output (LAMINA_CUDA_DN_IN=1: on sm_90 with Q4_0 or Q8_0 input rows the
 * product, conv and heads in one launch, cuda_deltanet_in_conv_heads, a
 * cluster per key head computing the rows its heads read: the same bits,
 * slower on an H200 so far, docs/perf.md; LAMINA_CUDA_DN_IN=tail: the same
 * launch without clusters, cuda_deltanet_in_tail, each value head's conv +
 * heads run in a block of it once the rows the head reads are in: the
 * same bits, 40 % slower on an H200, docs/perf.md);
 * then add+norm, router, top-k, routed gate|up (one 2F-row product when
 * gate and up share a row format: they sit back to back per expert),
 * routed down with the SiLU gate inside (int8 path), and the MoE combine
 * fused with the next layer's attention norm (only the first layer of the
 * range normalises h itself). The int8 decode products keep their
 * activation rounding off the path after their PDL waits: the gate/up
 * product rounds its input (written two launches back) before its wait
 * (LAMINA_CUDA_X_EARLY=0: after), and the early combine also writes
 * the next layer's input rounded (c->xq), which that layer's q|k|v or
 * DeltaNet input product copies (cuda_mvq_xq; LAMINA_CUDA_XQ=0: each block
 * rounds xa): the same bits either way. Conv + heads also write y rounded
 * (c->yq, cuda_deltanet_conv_heads_yq), and the DeltaNet output product
 * (with its add+norm tail) copies it on the int8 kernels (cuda_mvq_xq_tail)
 * where its row of nv * dv would otherwise have gone to the f32 kernels
 * (cuda_mvq_pays); the attention's combine does the same for the attention
 * output product (cuda_attention_decode_at_xq); LAMINA_CUDA_YQ=0 takes both
 * back. The shared expert (gate|up, down) runs on a side stream, a
 * parallel branch of the graph between a fork after add+norm and a join
 * before the combine. LAMINA_CUDA_GRAPHS=0 launches one by one
 * (diagnostics); LAMINA_CUDA_PROFILE=1 does too, with an event before every
 * kernel, and fini() logs time per kernel kind for decode and prefill.
 *
 * Prefill (n > 1): products of Q4_0/Q8_0/Q4_K/Q5_K weights on int8 tensor
 * cores (cuda_mmq, cuda_mmq_experts grouping the pairs by expert on the
 * device; LAMINA_CUDA_MMQ=0 turns them off), F32 weights through the tiled
 * f32 product, other types through the CUDA-core matmul; DeltaNet heads in
 * the chunked form (cuda_deltanet_heads_chunked, tf32 tensor cores).
 *
 * Hand-off (cfg->handoff, NCCL between GPU workers): the pass takes its
 * input rows from recv() into c->h and gives its output rows to send()
 * instead of the host copies.
 *
 * A failed CUDA call or launch is logged and returns -EIO; the backend then
 * refuses every later call (style.md habit 8: the worker exits).
 * DeltaNet state: the host copy is canonical for snapshots (state_save / state_load, the
 * prompt cache) and for any step taken on the host; each slot's copy (pinned, the device's
 * layout) is allocated when first needed, so a backend that never snapshots holds none.
 * Per slot and DeltaNet layer two flags say where the state is current: CB_DN_FRESH, the
 * device copy is (no host write since the last push); CB_DN_AHEAD, the device copy is newer
 * than the host's (a GPU step since the last pull). A snapshot or a host step pulls the
 * layers that are ahead first; a GPU step after a host write (state_load) pushes the layers
 * that are not fresh first, on the stream before its kernels; reset() zeroes the device copy
 * (fresh, ahead). A failing GPU step pulls what the card holds (logged, best effort: a
 * poisoned context may refuse the copy) and the backend refuses later calls, snapshots
 * included, since that state is part of a step. KV rows have no host copy: a snapshot reads
 * rows 0 .. pos-1 of each attention layer off the card and a load writes them back.
 * Stage timings: remote_wait (host time in collect) and the row and token
 * counters are always kept. With cfg->stage_times (the worker's
 * LAMINA_CUDA_STAGE_TIMES=1) each layer's GPU stages are timed too, between
 * CUDA events (timing enabled, 2 x layers x CB_STAGES of them made at init):
 * the mixer (the first layer's norm, attention or DeltaNet, add + ffn norm)
 * into attn or deltanet, router product and top-k into router, the routed
 * experts held here into experts (main stream), and the shared expert on the
 * stream it runs on (the side stream, between the fork and the join) into
 * shared_expert; the combine stays untimed ("other", as on the cpu backend).
 * The shared expert overlaps router and experts, so the five sums may exceed
 * the step's wall time; the main-stream ones never do. A prefill records
 * the events eagerly; a decode graph captured with them holds one
 * event-record node each (cudaEventRecordExternal), which every replay
 * records again. The slots' graphs share the events: a pass reads them
 * (cudaEventElapsedTime, after its final synchronisation) before the next
 * pass, of whatever slot, records them again, as passes never overlap. A
 * failure of any of this logs once and turns stage timings off, never the
 * step: a capture that fails with the events is retried without them. Off,
 * no event exists and nothing is recorded or captured (the graph is the
 * same). The profile mode times every kernel instead (below).
 */
#ifdef LAMINA_CUDA

#include <errno.h>
#include <math.h>
#include <stdlib.h>
#include <string.h>
#include <time.h>

#include <cuda_runtime.h>

#include "common/check.h"
#include "common/log.h"
#include "common/stats.h"
#include "kernels/cuda/caps.h"
#include "kernels/cuda/deltanet.h"
#include "kernels/cuda/matvec.h"
#include "kernels/cuda/mmq.h"
#include "kernels/cuda/mvq.h"
#include "kernels/cuda/ops.h"
#include "kernels/cuda/tail.h"
#include "model/quant.h"
#include "worker/backend.h"

#define CB_MEM_MARGIN (512ull << 20) /* bytes left free when the budget is the card's */
#define CB_ALIGN 256                  /* alignment of every device sub-buffer */
/* Product tails (LAMINA_CUDA_TAIL: "0" none, "1" or "all" (norm, topk, combine), or a
 * comma list of "norm", "topk", "combine", "cols", "rows"; by default norm and topk: on an
 * H200 they gained 2.1 % and 3.0 % of decode alone and 6.2 % together, the one-block
 * combine tail lost 9 %, cols neither gained nor lost; docs/perf.md). cols: the combine
 * split over the down product's grid columns and each layer's norm inside its input
 * product (combine wins over cols where both are asked for). rows: the down product and
 * the combine as one launch cut by output rows (cuda_moe_down_combine; no counter), the
 * norm inside the next input product as with cols; where it cannot run (experts off the
 * card, the shared expert on the side stream, kernels skipped) cols or the combine launch
 * serve. */
#define CB_DN_FRESH 1u /* the device copy of a layer's DeltaNet state is current */
#define CB_DN_AHEAD 2u /* the device copy is newer than the host copy */
#define CB_TAIL_NORM 1u
#define CB_TAIL_TOPK 2u
#define CB_TAIL_COMBINE 4u
#define CB_TAIL_COLS 8u
#define CB_TAIL_ROWS 16u
#define CB_LOGIT_ROWS 16              /* rows of logits per output-head pass */
#define CB_PROF_MAX 4096              /* kernels per profiled pass, at most */
#define CB_PROF_ROWS 48               /* distinct labels in the profile */

/* The timed stages of a layer (cfg->stage_times). */
enum cb_stage {
    CB_STAGE_MIXER,   /* first norm, attention or DeltaNet, add + ffn norm */
    CB_STAGE_ROUTER,  /* router product and top-k */
    CB_STAGE_EXPERTS, /* routed experts held here */
    CB_STAGE_SHARED,  /* shared expert (on the side stream when forked) */
    CB_STAGES
};

/* A slot's decode graphs: the attention decode of every attention layer in one launch
 * (cuda_attention_decode_fused: at positions below fused_below) or as prep, decode and
 * split merge (at and past it). The one launch decoded 1.3 % (H200) and 2.3 % (H100)
 * faster at an empty context; eagerly, against the three launches with the decode on
 * tensor cores (the default), 12.9 against 16.7 us at position 100 and 18.4 against
 * 17.4 at 640 (docs/perf.md, thirty-sixth session): the crossing near 500. */
enum cb_graph { CB_G_FUSED, CB_G_SPLIT, CB_GRAPHS };
#define CB_FUSED_BELOW 512u           /* fused_below's default */

/* A weight matrix in device memory (possibly a row range of a larger one). */
struct cb_mat {
    const void *d;      /* first row, device */
    uint32_t type;      /* enum quant_type */
    size_t row_bytes;
    uint64_t n_in;      /* row length */
    uint64_t n_out;     /* rows */
};

/* One layer of the range on the device. */
struct cb_layer {
    const struct arch_layer *ly;      /* the model's layer (types, shapes, expert stacks) */
    const float *attn_norm, *ffn_norm; /* n_embd */
    /* attention */
    struct cb_mat wq, wk, wv, wo;
    struct cb_mat wqkv1;              /* wq|wk|wv back to back (n_out 0: types differ) */
    struct cb_mat wqk;                /* else wq|wk where those two share a row format (a _K_M
                                         file's layers whose attn_v is Q6_K) */
    const float *q_norm, *k_norm;     /* head_dim */
    void *kc, *vc;                    /* KV cache, n_ctx rows of kv_dim (f16 or f32) */
    /* gated DeltaNet */
    struct cb_mat qkv, z, beta, alpha, out;
    struct cb_mat dn1;                /* qkv|z|beta|alpha back to back (n_out 0: not) */
    struct cb_mat zba;                /* else z|beta|alpha back to back where they share a
                                         row format (a _K_M file's layers whose qkv is Q6_K) */
    const float *conv, *ssm_a, *dt_bias, *ssm_norm;
    float *conv_st, *ssm_st;          /* conv_dim x (K-1); nv x dv x dk */
    /* experts */
    struct cb_mat router;
    const float *router_t;            /* the F32 router transposed (n_embd rows of n_expert),
                                       * where the output product takes it (rt_t_on) */
    bool sh, sh_fused;                /* shared expert present; gate|up stored as one */
    bool gu_fused;                    /* routed gate and up of an expert are one 2F-row matrix */
    struct cb_mat sh_gu, sh_up, sh_down; /* sh_gu is gate (2*Fs rows when fused) */
    const float *shexp_gate;          /* n_embd or NULL */
    bool shpair;                      /* decode: the shared expert runs as pair k of the
                                       * routed products (expert id n_expert in the tables) */
    void *experts;                    /* resident experts (owned cudaMalloc) */
    const void *const *tab_gate, *const *tab_up, *const *tab_down; /* device, n_expert each
                                       * (n_expert + 1 in a range layer: the shared expert) */
    uint8_t *resident;                /* host, n_expert flags */
    uint32_t n_resident;
};

struct backend_cuda {
    const struct arch_model *m;
    const struct arch_hparams *hp;
    struct backend_config cfg;        /* copy; pointers borrowed as backend.h says */
    struct backend *b;
    cudaStream_t stream;
    cudaStream_t side;                /* the shared expert's branch */
    cudaEvent_t ev_fork, ev_join;
    int device;
    uint32_t l0, l1, B, n_ctx, pos;
    struct cb_layer *layers;          /* l1 - l0 entries */
    bool all_resident;                /* every expert of the range is on the device */
    bool failed;                      /* a CUDA error happened: refuse every call */
    uint64_t budget;                  /* bytes this backend may hold */
    /* device buffers (owned) */
    uint8_t *trunk, *state, *scratch, *tables;
    size_t trunk_off, trunk_size, state_size, scratch_size, tables_size;
    bool no_pad;                      /* cb_put leaves no gap after a piece (stacks) */
    size_t dn_state_bytes;            /* the DeltaNet part at the start of a slot's state */
    size_t slot_bytes;                /* one slot's state; state_size is n_seq of them */
    uint32_t n_seq, seq;              /* sequence slots; the one the views point at */
    uint32_t *slot_pos;               /* per slot: next position (pos is the current's) */
    uint8_t **host_dn;                /* per slot: pinned host copy of its DeltaNet state
                                       * (dn_state_bytes, the device's layout), or NULL */
    uint8_t *dn_flags;                /* per slot and layer of the range: CB_DN_* */
    cudaGraphExec_t *slot_gexec;      /* per slot: its CB_GRAPHS decode graphs (gexec: the
                                       * current slot's) */
    uint32_t pass_rows;               /* the last pass: rows, whether a graph ran it, and the */
    bool pass_graph;                  /* launch count before it (cb_pass_done) */
    uint64_t pass_launches0;
    /* scratch views, B rows each */
    float *h, *xa, *mix, *q, *kx, *vx, *att, *qkv, *u, *z, *beta, *alpha, *y;
    float *rl, *w, *gu, *act, *Y, *sg, *sact, *so;
    float *dec;                       /* one token's fused q|k|v or qkv|z|beta|alpha */
    float *attn_ws;                   /* decode attention workspace (graph-stable) */
    size_t attn_ws_bytes;
    uint32_t *d_pos, *h_pos;          /* the decode position: device word, pinned host word */
    void *dn_work, *mmq_work;         /* chunked DeltaNet prefill; int8 prefill products */
    void *mmq_side;                   /* the int8 products' scratch of the side stream */
    size_t dn_work_bytes, mmq_work_bytes, mmq_side_bytes;
    bool mmq;                         /* prefill products on int8 tensor cores (LAMINA_CUDA_MMQ;
                                       * sm_80 and later) */
    bool chunked;                     /* chunked DeltaNet prefill (sm_80 and later) */
    bool fuse;                        /* decode: fused conv + DeltaNet heads (LAMINA_CUDA_FUSE) */
    bool dn_in;                       /* decode: the DeltaNet input product fused with them
                                       * too (LAMINA_CUDA_DN_IN=1) */
    bool dn_tail;                     /* the same, conv + heads as the product's tails
                                       * (LAMINA_CUDA_DN_IN=tail) */
    unsigned tails;                   /* decode: CB_TAIL_* as product tails
                                       * (kernels/cuda/tail.h; LAMINA_CUDA_TAIL) */
    unsigned int *tail_ctr;           /* the main stream's tail counter (scratch, zeroed) */
    unsigned int *col_ctr;            /* CUDA_TAIL_COLS_MAX counters of COMBINE_COLS tails */
    unsigned long long *probe;        /* LAMINA_CUDA_PROBE=1: the decode router's marks
                                       * (cuda_norm_in.probe), CUDA_PROBE_BLOCKS x
                                       * CUDA_PROBE_SLOTS a layer; reported at the end */
    unsigned long long *probe_mvq;    /* and the int8 products' (cuda_mvq_probe_next),
                                       * CB_PQ_N x CUDA_PROBE_MVQ_BLOCKS x CUDA_PROBE_SLOTS
                                       * a layer */
    uint32_t probe_l;                 /* the layer being enqueued */
    bool ids_poll;                    /* LAMINA_CUDA_IDS_POLL: the router's top-k tail marks
                                       * the ids it will pick and the decode gate/up
                                       * product's blocks poll them before their PDL wait,
                                       * asking for their expert's weights once picked */
    bool topk_rounds;                 /* LAMINA_CUDA_TOPK_ROUNDS=1: the top-k tail picks by k
                                       * rounds, not by counting places (the same picks) */
    bool topk_softmax;                /* LAMINA_CUDA_TOPK_SOFTMAX=1: the top-k tail by the full
                                       * softmax first (a baseline for measurements; weights
                                       * within an ulp or two) */
    int32_t *d_argmax;                /* greedy ids of the head's rows (CB_LOGIT_ROWS) */
    const char *skip;                 /* LAMINA_CUDA_SKIP: labels of decode kernels not launched
                                       * (timing experiments; the outputs are wrong) */
    bool decoding;                    /* the layers being enqueued are a one-token step */
    bool prefetch;                    /* decode: gate/up asks for the down experts in L2
                                       * (LAMINA_CUDA_PF) */
    bool pf_after;                    /* ... each block after its own rows, not before them
                                       * (LAMINA_CUDA_PF=before: before) */
    bool early;                       /* decode: the down product reads the router's ids and
                                       * its weights, the combine its gate's input, before
                                       * their PDL waits (LAMINA_CUDA_EARLY) */
    bool x_early;                     /* decode: the gate/up product rounds its activations
                                       * (written two launches back) before its PDL wait
                                       * (LAMINA_CUDA_X_EARLY; with early) */
    bool xq_on;                       /* decode: the combine also writes the next layer's input
                                       * rounded for the int8 products (LAMINA_CUDA_XQ) */
    bool xq_ready;                    /* xq holds the input of the layer being enqueued */
    int8_t *xq;                       /* one row rounded as cuda_mvq_xq reads it */
    bool yq_on;                       /* decode: conv + heads, and the attention's combine,
                                       * also write their output rounded for the output
                                       * product (LAMINA_CUDA_YQ) */
    int8_t *yq;                       /* that row (nv * dv or n_head * hd), as
                                       * cuda_mvq_xq_tail reads it */
    bool gq_on;                       /* decode: the gate/up product also writes the down
                                       * product's input rounded (LAMINA_CUDA_GQ) */
    int8_t *gq;                       /* those rows, one a pair (cuda_mvq_experts_prefetch_gq) */
    bool gs_on;                       /* decode with nin: the router's launch sums the shared
                                       * expert's gate for the combine (LAMINA_CUDA_GS) */
    float *gs;                        /* that gate (one float: one token) */
    int32_t *ids;
    int32_t *ids_dec;                 /* decode with the shared pair: k + 1 ids, the last n_expert */
    bool shpair_on;                   /* LAMINA_CUDA_SHPAIR: the shared expert as pair k */
    bool norm_in_on;                  /* LAMINA_CUDA_NORM_IN: the residual add + norm after
                                       * a decode mixer formed by its consumers (cb_norm_in) */
    bool rt_on;                       /* LAMINA_CUDA_OUT_ROUTER=1: with nin, the mixer's output
                                       * product and the router in one launch
                                       * (cuda_mvq_xq_router; cb_out_router) */
    bool rt_t_on;                     /* ... reading its columns from a transposed copy of
                                       * each router (LAMINA_CUDA_RT_T, default on) */
    const struct cb_layer *rt_layer;  /* the layer whose output product may take its router */
    uint32_t rt_l;
    bool rt_done;                     /* ... and took it: cb_moe launches no router */
    float *rt_part;                   /* the clusters' logit sums (scratch) */
    size_t rt_part_floats;
    bool parts_on;                    /* LAMINA_CUDA_MMQ_PARTS: a prefill's stacked input
                                       * products in one launch (cb_mm_parts) */
    bool glu_on;                      /* LAMINA_CUDA_MMQ_GLU: a prefill's SiLU gate in the
                                       * expert down product's rounding, its grouping reused */
    /* output head, uploaded on the first logits() call */
    uint8_t *head;
    float *out_norm, *logits;
    struct cb_mat output;
    /* pinned host buffers and remote grouping */
    float *h_h, *h_xa, *h_xr, *h_yr;
    int32_t *h_ids;
    uint32_t *cnt, *first, *grp_expert, *grp_count, *row_pair; /* [E] x 4, [B*k] */
    void **cp_dst;
    const void **cp_src;
    size_t *cp_size;
    /* decode graphs: one per CB_G_* form, each captured at the first decode step that
     * takes it, replayed after */
    bool graphs;
    cudaGraphExec_t gexec[CB_GRAPHS];
    uint64_t graph_kernels[CB_GRAPHS]; /* kernels in each graph */
    uint64_t graph_expert_rows;       /* stats.expert_rows of one replay (counted at capture) */
    /* the attention decode in one launch (cuda_attention_decode_fused) at positions below
     * this (LAMINA_CUDA_ATTN_FUSED_BELOW; UINT32_MAX with LAMINA_CUDA_ATTN_FUSED=1, 0 with
     * =0), the three launches at and past it; attn_fused: the pass being enqueued's choice;
     * fused_seen: a layer of the pass took the one launch (none did: no layer's shape
     * or the device takes it, and fused_below becomes 0, one decode graph) */
    uint32_t fused_below;
    bool attn_fused, fused_seen;
    /* profile (LAMINA_CUDA_PROFILE=1): an event before each kernel */
    bool prof;
    bool prof_warm[2];                /* [decode, prefill]: a first pass was left out */
    uint32_t prof_n;
    cudaEvent_t prof_ev[CB_PROF_MAX + 1];
    const char *prof_label[CB_PROF_MAX];
    struct cb_prof_row {
        const char *label;
        double ms;
        uint64_t calls;
    } prof_rows[2][CB_PROF_ROWS];     /* [decode, prefill] */
    uint64_t graph_steps;             /* decode steps run as a graph */
    double graph_capture_s;           /* host time capturing and instantiating graphs */
    uint64_t launches;                /* kernels enqueued so far */
    bool launches_logged;
    struct forward_stats stats;
    /* stage timings (cfg->stage_times): events [layer - l0][stage][begin, end] */
    cudaEvent_t *st_ev;               /* 2 x (l1 - l0) x CB_STAGES, timing enabled; or NULL */
    bool st_on;                       /* recording; cleared for good after a failure */
    bool capturing;                   /* a decode graph is being captured: record as nodes */
    /* foreign experts (cfg->foreign, --experts-home any): layers outside the range, each
     * with its experts, device address tables and host flags as a range layer has; served
     * by cb_serve with buffers of its own (a request may come while a pass of this range
     * waits for its remote experts, its scratch in use) */
    struct cb_layer *flayers;         /* n_flayers entries */
    uint32_t *flayer_of;              /* n_flayers model layer numbers */
    uint32_t n_flayers;
    uint8_t *ftables, *fbuf;          /* device: address tables; ids, X, gate|up, act, Y */
    size_t ftables_size, fbuf_size;
    int32_t *fids, *h_fids;           /* device / pinned: the expert of each row */
    float *fx, *fgu, *fact, *fy;
};

static double cb_now(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return ts.tv_sec + ts.tv_nsec * 1e-9;
}

static int cb_check(cudaError_t e, const char *what, const char *file, int line)
{
    if (e == cudaSuccess)
        return 0;
    log_write(LOG_LEVEL_ERROR, file, line, "%s failed: %s", what, cudaGetErrorString(e));
    return -EIO;
}

#define CUDA_CHECK(expr) cb_check((expr), #expr, __FILE__, __LINE__)

static bool cb_is_resident(const struct backend_config *cfg, uint32_t l, uint32_t e)
{
    return !cfg->resident || (cfg->resident[l] && (cfg->resident[l][e / 8] >> (e % 8)) & 1);
}

static size_t cb_align(size_t x)
{
    return (x + CB_ALIGN - 1) / CB_ALIGN * CB_ALIGN;
}

static uint64_t cb_expert_bytes(const struct arch_layer *ly)
{
    if (ly->gate_exps.data)
        return ly->gate_exps.mat_bytes + ly->up_exps.mat_bytes + ly->down_exps.mat_bytes;
    return ly->gate_up_exps.mat_bytes + ly->down_exps.mat_bytes;
}

/* ---- trunk upload (two passes: sizing with c->trunk NULL, then copying) ---- */

/* Reserves bytes in the trunk and copies src there (pass 2); returns the device address. */
static const void *cb_put(struct backend_cuda *c, const void *src, size_t bytes, int *rc)
{
    const size_t off = c->trunk_off;
    c->trunk_off = c->no_pad ? off + bytes : cb_align(off + bytes);
    if (!c->trunk || *rc || !bytes)
        return NULL;
    *rc = CUDA_CHECK(cudaMemcpy(c->trunk + off, src, bytes, cudaMemcpyHostToDevice));
    return c->trunk + off;
}

static const float *cb_put_vec(struct backend_cuda *c, const float *v, size_t n, int *rc)
{
    return v ? cb_put(c, v, n * sizeof(float), rc) : NULL;
}

static struct cb_mat cb_view(const struct arch_matrix *m, const void *d, uint64_t row0,
                             uint64_t rows)
{
    return (struct cb_mat){.d = d ? (const uint8_t *)d + row0 * m->row_bytes : NULL,
                           .type = m->type, .row_bytes = m->row_bytes, .n_in = m->n_in,
                           .n_out = rows};
}

static struct cb_mat cb_put_mat(struct backend_cuda *c, const struct arch_matrix *m, int *rc)
{
    return cb_view(m, cb_put(c, m->data, m->mat_bytes, rc), 0, m->n_out);
}

/* Uploads the rows src_row[0..n) of m in that order as one matrix. */
static const void *cb_put_rows(struct backend_cuda *c, const struct arch_matrix *m,
                               const uint32_t *src_row, uint64_t n, int *rc)
{
    if (!c->trunk || *rc)
        return cb_put(c, NULL, n * m->row_bytes, rc);
    uint8_t *tmp = malloc(n * m->row_bytes);
    if (!tmp) {
        log_error("out of memory permuting %s", m->name);
        *rc = -ENOMEM;
        return NULL;
    }
    for (uint64_t r = 0; r < n; r++)
        memcpy(tmp + r * m->row_bytes, m->data + (size_t)src_row[r] * m->row_bytes,
               m->row_bytes);
    const void *d = cb_put(c, tmp, n * m->row_bytes, rc);
    free(tmp);
    return d;
}

/* Legacy ssm_in (nk groups of [q dk | k dk | v r*dv | z r*dv]) as [q | k | v | z]. */
static void cb_put_ssm_in(struct backend_cuda *c, struct cb_layer *L, int *rc)
{
    const struct arch_hparams *hp = c->hp;
    const struct arch_matrix *m = &L->ly->win;
    const uint32_t dk = hp->ssm_dk, nk = hp->ssm_nk, rdv = hp->ssm_nv / nk * hp->ssm_dv;
    const uint32_t gsz = 2 * dk + 2 * rdv, cd = arch_conv_dim(hp);
    uint32_t *rows = malloc(m->n_out * sizeof(uint32_t)), n = 0;
    if (!rows) {
        *rc = -ENOMEM;
        return;
    }
    const uint32_t part_off[4] = {0, dk, 2 * dk, 2 * dk + rdv}, part_len[4] = {dk, dk, rdv, rdv};
    for (int part = 0; part < 4; part++)
        for (uint32_t g = 0; g < nk; g++)
            for (uint32_t i = 0; i < part_len[part]; i++)
                rows[n++] = g * gsz + part_off[part] + i;
    ASSERT(n == m->n_out);
    const void *d = cb_put_rows(c, m, rows, n, rc);
    free(rows);
    L->qkv = cb_view(m, d, 0, cd);
    L->z = cb_view(m, d, cd, m->n_out - cd);
}

/* ssm_ba (per key group r betas then r alphas) as [beta of every head | alpha ...]. */
static void cb_put_ssm_ba(struct backend_cuda *c, struct cb_layer *L, int *rc)
{
    const struct arch_matrix *m = &L->ly->wba;
    const uint32_t nv = c->hp->ssm_nv, r = nv / c->hp->ssm_nk;
    uint32_t *rows = malloc(2 * nv * sizeof(uint32_t));
    if (!rows) {
        *rc = -ENOMEM;
        return;
    }
    for (uint32_t h = 0; h < nv; h++) {
        rows[h] = h / r * 2 * r + h % r;
        rows[nv + h] = h / r * 2 * r + r + h % r;
    }
    const void *d = cb_put_rows(c, m, rows, 2 * nv, rc);
    free(rows);
    L->beta = cb_view(m, d, 0, nv);
    L->alpha = cb_view(m, d, nv, nv);
}

/* True when the matrices share a type and row format: uploaded back to back
 * they form one matrix (one decode product instead of n). */
static bool cb_stackable(const struct arch_matrix *const *m, int n)
{
    for (int i = 1; i < n; i++)
        if (m[i]->type != m[0]->type || m[i]->row_bytes != m[0]->row_bytes ||
            m[i]->n_in != m[0]->n_in)
            return false;
    return true;
}

/* Starts (or ends) a stack: pieces put in between follow each other with
 * no gap; the end re-aligns. */
static void cb_stack(struct backend_cuda *c, bool on)
{
    c->no_pad = on;
    if (!on)
        c->trunk_off = cb_align(c->trunk_off);
}

static void cb_put_attn(struct backend_cuda *c, struct cb_layer *L, int *rc)
{
    const struct arch_layer *ly = L->ly;
    const struct arch_matrix *qkv[] = {&ly->wq, &ly->wk, &ly->wv};
    const bool stack = cb_stackable(qkv, 3), qk = !stack && cb_stackable(qkv, 2);
    cb_stack(c, stack || qk);
    L->wq = cb_put_mat(c, &ly->wq, rc);
    L->wk = cb_put_mat(c, &ly->wk, rc);
    cb_stack(c, stack);
    L->wv = cb_put_mat(c, &ly->wv, rc);
    cb_stack(c, false);
    L->wqkv1 = (struct cb_mat){0};
    L->wqk = (struct cb_mat){0};
    if (stack)
        L->wqkv1 = cb_view(&ly->wq, L->wq.d, 0, ly->wq.n_out + ly->wk.n_out + ly->wv.n_out);
    if (qk)
        L->wqk = cb_view(&ly->wq, L->wq.d, 0, ly->wq.n_out + ly->wk.n_out);
    L->wo = cb_put_mat(c, &ly->wo, rc);
    L->q_norm = cb_put_vec(c, ly->q_norm, c->hp->head_dim, rc);
    L->k_norm = cb_put_vec(c, ly->k_norm, c->hp->head_dim, rc);
}

static void cb_put_ssm(struct backend_cuda *c, struct cb_layer *L, int *rc)
{
    const struct arch_hparams *hp = c->hp;
    const struct arch_layer *ly = L->ly;
    /* qkv | z | beta | alpha back to back when all four share a row format, else
     * z | beta | alpha where those three do */
    const struct arch_matrix *in[] = {ly->wqkv.data ? &ly->wqkv : &ly->win,
                                      ly->wqkv.data ? &ly->wz : &ly->win,
                                      ly->wba.data ? &ly->wba : &ly->wbeta,
                                      ly->wba.data ? &ly->wba : &ly->walpha};
    const bool stack = cb_stackable(in, 4);
    const bool zba = !stack && ly->wqkv.data && cb_stackable(in + 1, 3);
    cb_stack(c, stack);
    if (ly->wqkv.data) {
        L->qkv = cb_put_mat(c, &ly->wqkv, rc);
        if (zba)
            cb_stack(c, true);
        L->z = cb_put_mat(c, &ly->wz, rc);
    } else {
        cb_put_ssm_in(c, L, rc);
    }
    if (ly->wba.data) {
        cb_put_ssm_ba(c, L, rc);
    } else {
        L->beta = cb_put_mat(c, &ly->wbeta, rc);
        L->alpha = cb_put_mat(c, &ly->walpha, rc);
    }
    cb_stack(c, false);
    L->dn1 = (struct cb_mat){0};
    L->zba = (struct cb_mat){0};
    if (stack)
        L->dn1 = cb_view(in[0], L->qkv.d, 0,
                         L->qkv.n_out + L->z.n_out + L->beta.n_out + L->alpha.n_out);
    if (zba)
        L->zba = cb_view(in[1], L->z.d, 0, L->z.n_out + L->beta.n_out + L->alpha.n_out);
    L->out = cb_put_mat(c, &ly->wout, rc);
    L->conv = cb_put_vec(c, ly->conv, (size_t)arch_conv_dim(hp) * hp->ssm_conv, rc);
    L->ssm_a = cb_put_vec(c, ly->ssm_a, hp->ssm_nv, rc);
    L->dt_bias = cb_put_vec(c, ly->dt_bias, hp->ssm_nv, rc);
    L->ssm_norm = cb_put_vec(c, ly->ssm_norm, hp->ssm_dv, rc);
}

/* An F32 matrix transposed (n_in rows of n_out floats): the router's columns for the output
 * product's launch (cuda_mvq_xq_router's d_rwt). */
static const float *cb_put_transposed(struct backend_cuda *c, const struct arch_matrix *m,
                                      int *rc)
{
    const size_t bytes = (size_t)m->n_in * m->n_out * sizeof(float);
    if (!c->trunk || *rc)
        return cb_put(c, NULL, bytes, rc);
    float *tmp = malloc(bytes);
    if (!tmp) {
        log_error("out of memory transposing %s", m->name);
        *rc = -ENOMEM;
        return NULL;
    }
    for (uint64_t r = 0; r < m->n_out; r++) {
        const float *row = (const float *)(m->data + (size_t)r * m->row_bytes);
        for (uint64_t j = 0; j < m->n_in; j++)
            tmp[j * m->n_out + r] = row[j];
    }
    const float *d = cb_put(c, tmp, bytes, rc);
    free(tmp);
    return d;
}

static void cb_put_ffn(struct backend_cuda *c, struct cb_layer *L, int *rc)
{
    const struct arch_layer *ly = L->ly;
    L->router = cb_put_mat(c, &ly->router, rc);
    L->router_t = NULL;
    if (c->rt_on && c->rt_t_on && ly->router.data && ly->router.type == QUANT_TYPE_F32 &&
        ly->router.row_bytes == ly->router.n_in * sizeof(float))
        L->router_t = cb_put_transposed(c, &ly->router, rc);
    L->sh = ly->gate_sh.data != NULL;
    if (!L->sh)
        return;
    L->sh_fused =
        ly->gate_sh.type == ly->up_sh.type && ly->gate_sh.row_bytes == ly->up_sh.row_bytes;
    if (L->sh_fused) {
        /* gate and up back to back: one matrix of 2*Fs rows (no alignment gap) */
        const size_t gb = ly->gate_sh.mat_bytes;
        const size_t off = c->trunk_off;
        c->trunk_off = cb_align(off + gb + ly->up_sh.mat_bytes);
        if (c->trunk && !*rc) {
            *rc = CUDA_CHECK(cudaMemcpy(c->trunk + off, ly->gate_sh.data, gb,
                                        cudaMemcpyHostToDevice));
            *rc = *rc ? *rc : CUDA_CHECK(cudaMemcpy(c->trunk + off + gb, ly->up_sh.data,
                                                    ly->up_sh.mat_bytes, cudaMemcpyHostToDevice));
        }
        L->sh_gu = cb_view(&ly->gate_sh, c->trunk ? c->trunk + off : NULL, 0,
                           2 * ly->gate_sh.n_out);
    } else {
        L->sh_gu = cb_put_mat(c, &ly->gate_sh, rc);
        L->sh_up = cb_put_mat(c, &ly->up_sh, rc);
    }
    L->sh_down = cb_put_mat(c, &ly->down_sh, rc);
    L->shexp_gate = cb_put_vec(c, ly->shexp_gate, c->hp->n_embd, rc);
}

/* Every trunk tensor of the range; sizing pass when c->trunk is NULL. */
static int cb_put_trunk(struct backend_cuda *c)
{
    int rc = 0;
    c->trunk_off = 0;
    for (uint32_t i = 0; i < c->l1 - c->l0 && !rc; i++) {
        struct cb_layer *L = &c->layers[i];
        L->attn_norm = cb_put_vec(c, L->ly->attn_norm, c->hp->n_embd, &rc);
        L->ffn_norm = cb_put_vec(c, L->ly->ffn_norm, c->hp->n_embd, &rc);
        if (L->ly->recurrent)
            cb_put_ssm(c, L, &rc);
        else
            cb_put_attn(c, L, &rc);
        cb_put_ffn(c, L, &rc);
    }
    return rc;
}

/* ---- plan: sizes, types, budget ---- */

static bool cb_type_ok(const struct arch_matrix *m, uint32_t l)
{
    if (!m->data || cuda_matvec_supports(m->type))
        return true;
    log_error("layer %u tensor %s: type %s is not supported by the CUDA kernels", l, m->name,
              quant_type_name(m->type));
    return false;
}

static bool cb_types_ok(const struct backend_cuda *c)
{
    bool ok = true;
    for (uint32_t l = c->l0; l < c->l1; l++) {
        const struct arch_layer *ly = &c->m->layers[l];
        const struct arch_matrix *ms[] = {
            &ly->wq, &ly->wk, &ly->wv, &ly->wo, &ly->wqkv, &ly->wz, &ly->win, &ly->wba,
            &ly->wbeta, &ly->walpha, &ly->wout, &ly->router, &ly->gate_exps, &ly->up_exps,
            &ly->down_exps, &ly->gate_up_exps, &ly->gate_sh, &ly->up_sh, &ly->down_sh};
        for (size_t i = 0; i < sizeof(ms) / sizeof(ms[0]); i++)
            ok &= cb_type_ok(ms[i], l);
    }
    return ok;
}

static bool cb_shapes_ok(const struct backend_cuda *c)
{
    const struct arch_hparams *hp = c->hp;
    bool any_rec = false;
    for (uint32_t l = c->l0; l < c->l1; l++)
        any_rec |= c->m->layers[l].recurrent;
    if (any_rec && (hp->ssm_conv == 0 || hp->ssm_conv > 8)) {
        log_error("DeltaNet conv of %u taps: the CUDA kernel takes 1 to 8", hp->ssm_conv);
        return false;
    }
    return true;
}

static size_t cb_kv_bytes(const struct backend_cuda *c)
{
    return (size_t)c->n_ctx * c->hp->n_head_kv * c->hp->head_dim * (c->cfg.kv_f16 ? 2 : 4);
}

static size_t cb_dn_bytes(const struct arch_hparams *hp, size_t *conv_bytes)
{
    *conv_bytes = cb_align((size_t)arch_conv_dim(hp) * (hp->ssm_conv - 1) * sizeof(float));
    return *conv_bytes + cb_align((size_t)hp->ssm_nv * hp->ssm_dv * hp->ssm_dk * sizeof(float));
}

static void cb_plan_state(struct backend_cuda *c)
{
    size_t conv_bytes, dn = 0, kv = 0;
    for (uint32_t l = c->l0; l < c->l1; l++) {
        if (c->m->layers[l].recurrent)
            dn += cb_dn_bytes(c->hp, &conv_bytes);
        else
            kv += 2 * cb_align(cb_kv_bytes(c));
    }
    c->dn_state_bytes = dn;
    c->slot_bytes = dn + kv;
    c->state_size = c->slot_bytes * c->n_seq;
}

/* Takes the next sub-buffer of `floats` 4-byte elements from the scratch. */
static void *cb_take(struct backend_cuda *c, size_t *off, size_t floats)
{
    void *p = c->scratch ? c->scratch + *off : NULL;
    *off = cb_align(*off + floats * sizeof(float));
    return p;
}

/* Scratch views in one buffer: sizing pass when c->scratch is NULL. */
static void cb_carve_scratch(struct backend_cuda *c)
{
    const struct arch_hparams *hp = c->hp;
    const size_t B = c->B, n = hp->n_embd, hd = hp->head_dim, k = hp->n_expert_used;
    const size_t q_out = (size_t)hp->n_head * hd * (hp->attn_gated ? 2 : 1);
    const size_t kvd = (size_t)hp->n_head_kv * hd, F = hp->n_ff_exp, Fs = hp->n_ff_shexp;
    const size_t cd = hp->kind == ARCH_KIND_QWEN3MOE ? 0 : arch_conv_dim(hp);
    const size_t vd = (size_t)hp->ssm_nv * hp->ssm_dv, nv = hp->ssm_nv;
    size_t off = 0;
    c->h = cb_take(c, &off, B * n);
    c->xa = cb_take(c, &off, B * n);
    c->mix = cb_take(c, &off, B * n);
    c->q = cb_take(c, &off, B * q_out);
    c->kx = cb_take(c, &off, B * kvd);
    c->vx = cb_take(c, &off, B * kvd);
    c->att = cb_take(c, &off, B * hp->n_head * hd);
    c->qkv = cb_take(c, &off, B * cd);
    c->u = cb_take(c, &off, B * cd);
    c->z = cb_take(c, &off, B * vd);
    c->beta = cb_take(c, &off, B * nv);
    c->alpha = cb_take(c, &off, B * nv);
    c->y = cb_take(c, &off, B * vd);
    c->rl = cb_take(c, &off, B * hp->n_expert);
    /* pair rows: B * k, and at least k + 1 (one token with the shared pair) */
    const size_t P = B * k > k + 1 ? B * k : k + 1;
    c->ids = cb_take(c, &off, B * k);
    c->ids_dec = cb_take(c, &off, k + 1);
    c->w = cb_take(c, &off, B * k);
    c->gu = cb_take(c, &off, P * 2 * F);
    c->act = cb_take(c, &off, P * F);
    c->Y = cb_take(c, &off, P * n);
    c->sg = cb_take(c, &off, B * 2 * Fs);
    c->sact = cb_take(c, &off, B * Fs);
    c->so = cb_take(c, &off, B * n);
    const size_t qkv1 = q_out + 2 * kvd, dn1 = cd + vd + 2 * nv;
    c->dec = cb_take(c, &off, qkv1 > dn1 ? qkv1 : dn1);
    c->xq = cb_take(c, &off, cuda_mvq_xq_bytes(n) / sizeof(float) + 1);
    /* the DeltaNet output product's row (nv * dv) or the attention's (n_head * hd) */
    const size_t yqn = ((vd > hp->n_head * hd ? vd : hp->n_head * hd) + 31) / 32 * 32;
    c->yq = cb_take(c, &off, cuda_mvq_xq_bytes(yqn) / sizeof(float) + 1);
    c->gq = cb_take(c, &off, (k + 1) * cuda_mvq_xq_bytes((F + 31) / 32 * 32) / sizeof(float) + 1);
    c->gs = cb_take(c, &off, 1);
    c->rt_part_floats = cuda_mvq_router_part_floats(n, hp->n_expert);
    c->rt_part = cb_take(c, &off, c->rt_part_floats);
    c->attn_ws_bytes = cuda_attention_decode_ws_bytes(hp->n_head, hp->n_head_kv, (uint32_t)hd,
                                                      c->n_ctx);
    const size_t afw = cuda_attention_fused_ws_bytes(hp->n_head, hp->n_head_kv, (uint32_t)hd,
                                                     c->n_ctx);
    c->attn_ws_bytes = afw > c->attn_ws_bytes ? afw : c->attn_ws_bytes;
    c->attn_ws = cb_take(c, &off, c->attn_ws_bytes / sizeof(float) + 1);
    c->d_pos = cb_take(c, &off, 1);
    c->tail_ctr = cb_take(c, &off, 1);
    c->col_ctr = cb_take(c, &off, CUDA_TAIL_COLS_MAX);
    c->d_argmax = cb_take(c, &off, CB_LOGIT_ROWS);
    c->dn_work_bytes = 0;
    for (uint32_t l = c->l0; l < c->l1 && c->chunked; l++)
        if (c->m->layers[l].recurrent)
            c->dn_work_bytes = cuda_deltanet_work_bytes(hp->ssm_nv, hp->ssm_dk, hp->ssm_dv,
                                                        (uint32_t)B);
    c->dn_work = c->dn_work_bytes ? cb_take(c, &off, c->dn_work_bytes / sizeof(float) + 1) : NULL;
    /* int8 activations of the widest prefill product input, or of the expert pairs */
    size_t widest = n > q_out ? n : q_out;
    widest = widest > vd ? widest : vd;
    widest = widest > (size_t)hp->n_head * hd ? widest : (size_t)hp->n_head * hd;
    widest = widest > F ? widest : F;
    widest = widest > Fs ? widest : Fs;
    const size_t dense = cuda_mmq_work_bytes(widest, (uint32_t)B);
    const size_t pairs = cuda_mmq_experts_work_bytes(n > F ? n : F, (uint32_t)(B * k),
                                                     hp->n_expert);
    c->mmq_work_bytes = c->mmq && B > 1 ? (dense > pairs ? dense : pairs) : 0;
    c->mmq_work = c->mmq_work_bytes ? cb_take(c, &off, c->mmq_work_bytes / sizeof(float) + 1)
                                    : NULL;
    /* the shared expert's products run on the side stream beside the routed
     * ones: their own scratch */
    const size_t side = cuda_mmq_work_bytes(n > Fs ? n : Fs, (uint32_t)B);
    c->mmq_side_bytes = c->mmq && B > 1 && Fs ? side : 0;
    c->mmq_side = c->mmq_side_bytes ? cb_take(c, &off, c->mmq_side_bytes / sizeof(float) + 1)
                                    : NULL;
    c->scratch_size = off;
}

static int cb_check_budget(struct backend_cuda *c, uint64_t experts)
{
    const struct backend_config *cfg = &c->cfg;
    c->budget = cfg->device_mem;
    if (!c->budget) {
        size_t free_b = 0, total_b = 0;
        if (CUDA_CHECK(cudaMemGetInfo(&free_b, &total_b)))
            return -EIO;
        c->budget = free_b > CB_MEM_MARGIN ? free_b - CB_MEM_MARGIN : 0;
    }
    const uint64_t trunk = c->trunk_size + c->tables_size;
    const uint64_t total = experts + trunk + c->state_size + c->scratch_size;
    if (total <= c->budget)
        return 0;
    log_error("device memory budget of %.1f MiB is too small for layers %u-%u: resident experts "
              "%.1f MiB + trunk %.1f MiB + KV and state %.1f MiB + scratch %.1f MiB = %.1f MiB",
              c->budget / 1048576.0, c->l0, c->l1 - 1, experts / 1048576.0, trunk / 1048576.0,
              c->state_size / 1048576.0, c->scratch_size / 1048576.0, total / 1048576.0);
    return -ENOMEM;
}

/* ---- device allocation and uploads ---- */

static int cb_malloc(void *p, size_t bytes, const char *what)
{
    if (!bytes) {
        *(void **)p = NULL;
        return 0;
    }
    cudaError_t e = cudaMalloc((void **)p, bytes);
    if (e == cudaSuccess)
        return 0;
    log_error("cannot allocate %.1f MiB of device memory for %s: %s", bytes / 1048576.0, what,
              cudaGetErrorString(e));
    return -ENOMEM;
}

static int cb_host_alloc(void *p, size_t bytes)
{
    if (!bytes) {
        *(void **)p = NULL;
        return 0;
    }
    return CUDA_CHECK(cudaMallocHost((void **)p, bytes)) ? -ENOMEM : 0;
}

/* Copies layer l's resident experts into one buffer and fills its host tables. */
static int cb_upload_experts(struct backend_cuda *c, uint32_t l, struct cb_layer *L,
                             const void **tg, const void **tu, const void **td)
{
    const struct arch_layer *ly = L->ly;
    const uint32_t E = c->hp->n_expert;
    const bool fused = !ly->gate_exps.data;
    const size_t gb = fused ? ly->gate_up_exps.mat_bytes : ly->gate_exps.mat_bytes;
    const size_t ub = fused ? 0 : ly->up_exps.mat_bytes, db = ly->down_exps.mat_bytes;
    /* gate and up go back to back: with one row format they are one 2F-row matrix */
    L->gu_fused = !fused && ly->gate_exps.type == ly->up_exps.type &&
                  ly->gate_exps.row_bytes == ly->up_exps.row_bytes;
    if (cb_malloc(&L->experts, (size_t)L->n_resident * cb_expert_bytes(ly), "resident experts"))
        return -ENOMEM;
    uint8_t *p = L->experts;
    for (uint32_t e = 0; e < E; e++) {
        tg[e] = tu[e] = td[e] = NULL;
        if (!L->resident[e])
            continue;
        const struct expert_ref src = c->cfg.expert_src && c->cfg.expert_src[l]
                                          ? c->cfg.expert_src[l][e]
                                          : expert_exec_model_ref(ly, e);
        int rc = CUDA_CHECK(cudaMemcpy(p, src.gate, gb, cudaMemcpyHostToDevice));
        tg[e] = p, p += gb;
        if (!rc && ub)
            rc = CUDA_CHECK(cudaMemcpy(p, src.up, ub, cudaMemcpyHostToDevice));
        tu[e] = ub ? p : NULL, p += ub;
        rc = rc ? rc : CUDA_CHECK(cudaMemcpy(p, src.down, db, cudaMemcpyHostToDevice));
        td[e] = p, p += db;
        if (rc)
            return rc;
        c->b->resident_experts++;
    }
    return 0;
}

/* Foreign layers (cfg->foreign): their flags, expert bytes, tables and serve buffers. */
static int cb_plan_foreign(struct backend_cuda *c, uint64_t *bytes)
{
    const uint32_t E = c->hp->n_expert, L = c->hp->n_layer;
    *bytes = 0;
    for (uint32_t l = 0; c->cfg.foreign && l < L; l++)
        c->n_flayers += (l < c->l0 || l >= c->l1) && c->cfg.foreign[l];
    if (!c->n_flayers)
        return 0;
    c->flayers = calloc(c->n_flayers, sizeof(*c->flayers));
    c->flayer_of = calloc(c->n_flayers, sizeof(*c->flayer_of));
    if (!c->flayers || !c->flayer_of)
        return -ENOMEM;
    uint32_t i = 0;
    for (uint32_t l = 0; l < L; l++) {
        if ((l >= c->l0 && l < c->l1) || !c->cfg.foreign[l])
            continue;
        struct cb_layer *F = &c->flayers[i];
        c->flayer_of[i++] = l;
        F->ly = &c->m->layers[l];
        F->resident = calloc(E, 1);
        if (!F->resident)
            return -ENOMEM;
        for (uint32_t e = 0; e < E; e++) {
            F->resident[e] = (c->cfg.foreign[l][e / 8] >> (e % 8)) & 1;
            F->n_resident += F->resident[e];
        }
        *bytes += (uint64_t)F->n_resident * cb_expert_bytes(F->ly);
    }
    const size_t P = (size_t)c->B * c->hp->n_expert_used, n = c->hp->n_embd;
    const size_t Ff = c->hp->n_ff_exp;
    c->ftables_size = cb_align((size_t)3 * E * c->n_flayers * sizeof(void *));
    c->fbuf_size = cb_align(P * sizeof(int32_t)) + cb_align(P * n * sizeof(float)) * 2 +
                   cb_align(P * 2 * Ff * sizeof(float)) + cb_align(P * Ff * sizeof(float));
    *bytes += c->ftables_size + c->fbuf_size;
    c->b->serve_max_rows = (uint32_t)P;
    return 0;
}

/* Uploads the foreign experts and carves the serve buffers. */
static int cb_upload_foreign(struct backend_cuda *c)
{
    const uint32_t E = c->hp->n_expert;
    if (!c->n_flayers)
        return 0;
    const void **host = calloc((size_t)3 * E * c->n_flayers, sizeof(void *));
    int rc = host ? 0 : -ENOMEM;
    rc = rc ? rc : cb_malloc(&c->ftables, c->ftables_size, "foreign expert tables");
    rc = rc ? rc : cb_malloc(&c->fbuf, c->fbuf_size, "foreign expert buffers");
    rc = rc ? rc : cb_host_alloc(&c->h_fids, (size_t)c->B * c->hp->n_expert_used *
                                                 sizeof(int32_t));
    for (uint32_t i = 0; i < c->n_flayers && !rc; i++) {
        const uint32_t before = c->b->resident_experts;
        const void **t = host + (size_t)3 * E * i;
        rc = cb_upload_experts(c, c->flayer_of[i], &c->flayers[i], t, t + E, t + 2 * E);
        c->b->foreign_experts += c->b->resident_experts - before;
        const void *const *d = (const void *const *)c->ftables + (size_t)3 * E * i;
        c->flayers[i].tab_gate = d;
        c->flayers[i].tab_up = d + E;
        c->flayers[i].tab_down = d + 2 * E;
    }
    if (!rc)
        rc = CUDA_CHECK(cudaMemcpy(c->ftables, host, (size_t)3 * E * c->n_flayers *
                                   sizeof(void *), cudaMemcpyHostToDevice));
    free(host);
    if (rc)
        return rc;
    const size_t P = (size_t)c->B * c->hp->n_expert_used, n = c->hp->n_embd;
    const size_t Ff = c->hp->n_ff_exp;
    uint8_t *p = c->fbuf;
    c->fids = (int32_t *)p, p += cb_align(P * sizeof(int32_t));
    c->fx = (float *)p, p += cb_align(P * n * sizeof(float));
    c->fy = (float *)p, p += cb_align(P * n * sizeof(float));
    c->fgu = (float *)p, p += cb_align(P * 2 * Ff * sizeof(float));
    c->fact = (float *)p;
    return 0;
}

/* Whether layer L's shared expert can run as pair k of the decode expert
 * products: its gate|up one 2Fs-row matrix and its down matrix in the row
 * formats of the routed ones (one 2F-row gate|up per expert), Fs = F. The
 * decode kernels compute every row the same way whatever the pair count
 * (kernels/cuda/mvq.cu), so for their types the bits do not change. */
static bool cb_shpair_ok(const struct backend_cuda *c, const struct cb_layer *L)
{
    const struct arch_layer *ly = L->ly;
    const struct arch_matrix *g = ly->gate_exps.data ? &ly->gate_exps : &ly->gate_up_exps;
    return L->sh && L->sh_fused && c->hp->n_ff_shexp == c->hp->n_ff_exp &&
           (!ly->gate_exps.data || L->gu_fused) && L->sh_gu.type == g->type &&
           L->sh_gu.row_bytes == g->row_bytes && L->sh_down.type == ly->down_exps.type &&
           L->sh_down.row_bytes == ly->down_exps.row_bytes;
}

/* Experts of every layer, and the device tables of their addresses. */
static int cb_upload_all_experts(struct backend_cuda *c)
{
    const uint32_t E = c->hp->n_expert, nl = c->l1 - c->l0, T = E + 1;
    const void **host = calloc((size_t)3 * T * nl, sizeof(void *));
    if (!host || cb_malloc(&c->tables, c->tables_size, "expert tables")) {
        free(host);
        return -ENOMEM;
    }
    int rc = 0;
    for (uint32_t i = 0; i < nl && !rc; i++) {
        struct cb_layer *L = &c->layers[i];
        const void **t = host + (size_t)3 * T * i;
        rc = cb_upload_experts(c, c->l0 + i, L, t, t + T, t + 2 * T);
        /* entry E: the shared expert, where it can run as one more pair */
        L->shpair = cb_shpair_ok(c, L);
        t[E] = L->shpair ? L->sh_gu.d : NULL;
        t[T + E] = NULL;
        t[2 * T + E] = L->shpair ? L->sh_down.d : NULL;
        const void *const *d = (const void *const *)c->tables + (size_t)3 * T * i;
        L->tab_gate = d;
        L->tab_up = d + T;
        L->tab_down = d + 2 * T;
    }
    if (!rc)
        rc = CUDA_CHECK(cudaMemcpy(c->tables, host, (size_t)3 * T * nl * sizeof(void *),
                                   cudaMemcpyHostToDevice));
    free(host);
    return rc;
}

/* State views of slot seq: all its DeltaNet states first (reset zeroes that
 * prefix), then its KV. */
static void cb_point_slot(struct backend_cuda *c, uint32_t seq)
{
    const size_t base = (size_t)seq * c->slot_bytes;
    size_t conv_bytes, dn = base, kv = base + c->dn_state_bytes;
    for (uint32_t i = 0; i < c->l1 - c->l0; i++) {
        struct cb_layer *L = &c->layers[i];
        if (L->ly->recurrent) {
            const size_t bytes = cb_dn_bytes(c->hp, &conv_bytes);
            L->conv_st = (float *)(c->state + dn);
            L->ssm_st = (float *)(c->state + dn + conv_bytes);
            dn += bytes;
        } else {
            L->kc = c->state + kv;
            L->vc = c->state + kv + cb_align(cb_kv_bytes(c));
            kv += 2 * cb_align(cb_kv_bytes(c));
        }
    }
}

static int cb_alloc_state(struct backend_cuda *c)
{
    if (cb_malloc(&c->state, c->state_size, "KV cache and DeltaNet state"))
        return -ENOMEM;
    c->slot_pos = calloc(c->n_seq, sizeof(*c->slot_pos));
    c->slot_gexec = calloc((size_t)c->n_seq * CB_GRAPHS, sizeof(*c->slot_gexec));
    c->host_dn = calloc(c->n_seq, sizeof(*c->host_dn));
    c->dn_flags = malloc((size_t)c->n_seq * (c->l1 - c->l0));
    if (!c->slot_pos || !c->slot_gexec || !c->host_dn || !c->dn_flags)
        return -ENOMEM;
    memset(c->dn_flags, CB_DN_FRESH | CB_DN_AHEAD, (size_t)c->n_seq * (c->l1 - c->l0));
    cb_point_slot(c, 0);
    return c->state_size ? CUDA_CHECK(cudaMemset(c->state, 0, c->state_size)) : 0;
}

static int cb_alloc_host(struct backend_cuda *c)
{
    const size_t B = c->B, n = c->hp->n_embd, k = c->hp->n_expert_used, E = c->hp->n_expert;
    int rc = cb_host_alloc(&c->h_h, B * n * sizeof(float));
    rc = rc ? rc : cb_host_alloc(&c->h_pos, sizeof(uint32_t));
    if (!c->all_resident) {
        rc = rc ? rc : cb_host_alloc(&c->h_xa, B * n * sizeof(float));
        rc = rc ? rc : cb_host_alloc(&c->h_xr, B * k * n * sizeof(float));
        rc = rc ? rc : cb_host_alloc(&c->h_yr, B * k * n * sizeof(float));
        rc = rc ? rc : cb_host_alloc(&c->h_ids, B * k * sizeof(int32_t));
    }
    if (rc)
        return rc;
    c->cnt = calloc(4 * E + B * k, sizeof(uint32_t));
    c->cp_dst = calloc(B * k, sizeof(void *));
    c->cp_src = calloc(B * k, sizeof(void *));
    c->cp_size = calloc(B * k, sizeof(size_t));
    if (!c->cnt || !c->cp_dst || !c->cp_src || !c->cp_size)
        return -ENOMEM;
    c->first = c->cnt + E;
    c->grp_expert = c->first + E;
    c->grp_count = c->grp_expert + E;
    c->row_pair = c->grp_count + E;
    return 0;
}

/* ---- profile (LAMINA_CUDA_PROFILE=1) ---- */

/* Turns the profile off for good after a failed event call, logging why
 * once, and clears the error so that the next launch's check does not take
 * it for its own (a profile never fails a step). */
static void cb_prof_off(struct backend_cuda *c, const char *what, cudaError_t e)
{
    (void)cudaGetLastError();
    if (!c->prof)
        return;
    c->prof = false;
    log_warn("cuda layers %u-%u: profile off: %s failed: %s", c->l0, c->l1 - 1, what,
             cudaGetErrorString(e));
}

/* Records an event before the kernel `label` is enqueued (profile only). */
static void cb_mark(struct backend_cuda *c, const char *label)
{
    if (!c->prof || c->prof_n >= CB_PROF_MAX)
        return;
    const cudaError_t e = cudaEventRecord(c->prof_ev[c->prof_n], c->stream);
    if (e != cudaSuccess) {
        cb_prof_off(c, "cudaEventRecord", e);
        return;
    }
    c->prof_label[c->prof_n++] = label;
}

/* Records the event that ends the last marked kernel (profile only): after
 * the layers of a pass, again after a head enqueued behind them (the head's
 * first mark takes that slot). */
static void cb_prof_close(struct backend_cuda *c)
{
    if (!c->prof || !c->prof_n)
        return;
    const cudaError_t e = cudaEventRecord(c->prof_ev[c->prof_n], c->stream);
    if (e != cudaSuccess)
        cb_prof_off(c, "cudaEventRecord", e);
}

/* After the pass's sync: adds the time between consecutive events to the
 * rows of their labels. The first pass of each kind is left out: it pays
 * the kernels' loading on first use (CUDA's lazy module loading). */
static void cb_prof_collect(struct backend_cuda *c, bool decode)
{
    if (!c->prof || !c->prof_n)
        return;
    cudaError_t e = cudaEventSynchronize(c->prof_ev[c->prof_n]);
    if (e != cudaSuccess) {
        cb_prof_off(c, "cudaEventSynchronize", e);
        return;
    }
    if (!c->prof_warm[decode ? 0 : 1]) {
        c->prof_warm[decode ? 0 : 1] = true;
        c->prof_n = 0;
        return;
    }
    struct cb_prof_row *rows = c->prof_rows[decode ? 0 : 1];
    for (uint32_t i = 0; i < c->prof_n; i++) {
        float ms = 0.0f;
        e = cudaEventElapsedTime(&ms, c->prof_ev[i], c->prof_ev[i + 1]);
        if (e != cudaSuccess) {
            cb_prof_off(c, "cudaEventElapsedTime", e);
            return;
        }
        for (int r = 0; r < CB_PROF_ROWS; r++) {
            if (rows[r].label && strcmp(rows[r].label, c->prof_label[i]))
                continue;
            rows[r].label = c->prof_label[i];
            rows[r].ms += ms;
            rows[r].calls++;
            break;
        }
    }
    c->prof_n = 0;
}

static void cb_prof_report(const struct backend_cuda *c)
{
    for (int d = 0; c->prof && d < 2; d++) {
        double total = 0.0;
        for (int r = 0; r < CB_PROF_ROWS && c->prof_rows[d][r].label; r++)
            total += c->prof_rows[d][r].ms;
        if (total <= 0.0)
            continue;
        log_info("cuda profile (%s, layers %u-%u, kernels one by one, event to event, the "
                 "first pass left out):",
                 d ? "prefill" : "decode", c->l0, c->l1 - 1);
        for (int r = 0; r < CB_PROF_ROWS && c->prof_rows[d][r].label; r++) {
            const struct cb_prof_row *p = &c->prof_rows[d][r];
            log_info("  %-14s %10.3f ms %5.1f %%  %8llu calls  %8.2f us/call", p->label, p->ms,
                     100.0 * p->ms / total, (unsigned long long)p->calls,
                     1e3 * p->ms / (double)p->calls);
        }
    }
}

/* ---- stage timings (cfg->stage_times) ---- */

/* Turns stage timings off for good, logging why once. */
static void cb_stage_off(struct backend_cuda *c, const char *what, cudaError_t e)
{
    if (!c->st_on)
        return;
    c->st_on = false;
    log_warn("cuda layers %u-%u: stage timings off: %s failed: %s", c->l0, c->l1 - 1, what,
             cudaGetErrorString(e));
}

static cudaEvent_t cb_stage_ev(const struct backend_cuda *c, uint32_t l, enum cb_stage s,
                               int end)
{
    return c->st_ev[((size_t)(l - c->l0) * CB_STAGES + s) * 2 + end];
}

/* Records the begin (end 0) or end (1) of stage s of layer l on `stream`; in a
 * capture as an event-record node of the graph. */
static void cb_stage_mark(struct backend_cuda *c, uint32_t l, enum cb_stage s, int end,
                          cudaStream_t stream)
{
    if (!c->st_on)
        return;
    const unsigned flags = c->capturing ? cudaEventRecordExternal : cudaEventRecordDefault;
    const cudaError_t e = cudaEventRecordWithFlags(cb_stage_ev(c, l, s, end), stream, flags);
    if (e != cudaSuccess)
        cb_stage_off(c, "cudaEventRecordWithFlags", e);
}

/* After a pass's final synchronisation: adds the GPU time of every stage the
 * pass recorded (every stage of every layer; the shared expert's where there
 * is one) to the stats. Nothing is added when a query fails. */
static void cb_stage_collect(struct backend_cuda *c)
{
    if (!c->st_on)
        return;
    double ms[CB_STAGES + 1] = {0}; /* the last: the mixer of attention layers */
    for (uint32_t l = c->l0; l < c->l1; l++) {
        const struct cb_layer *L = &c->layers[l - c->l0];
        for (int s = 0; s < CB_STAGES; s++) {
            if (s == CB_STAGE_SHARED && !L->sh)
                continue;
            float t = 0.0f;
            const cudaError_t e = cudaEventElapsedTime(&t, cb_stage_ev(c, l, s, 0),
                                                       cb_stage_ev(c, l, s, 1));
            if (e != cudaSuccess) {
                cb_stage_off(c, "cudaEventElapsedTime", e);
                return;
            }
            ms[s == CB_STAGE_MIXER && !L->ly->recurrent ? CB_STAGES : s] += t;
        }
    }
    c->stats.deltanet += 1e-3 * ms[CB_STAGE_MIXER];
    c->stats.attn += 1e-3 * ms[CB_STAGES];
    c->stats.router += 1e-3 * ms[CB_STAGE_ROUTER];
    c->stats.experts += 1e-3 * ms[CB_STAGE_EXPERTS];
    c->stats.shared_expert += 1e-3 * ms[CB_STAGE_SHARED];
}

/* ---- the layer pass ---- */

/* Whether LAMINA_CUDA_SKIP names this decode kernel's label (a comma list). */
static bool cb_skip(const struct backend_cuda *c, const char *label)
{
    if (!c->skip || !c->decoding)
        return false;
    const size_t n = strlen(label);
    for (const char *p = c->skip; (p = strstr(p, label)) != NULL; p += n)
        if ((p == c->skip || p[-1] == ',') && (p[n] == ',' || p[n] == '\0'))
            return true;
    return false;
}

/* A kernel launch: marks it for the profile, counts it, passes its result;
 * nothing (0) for a label LAMINA_CUDA_SKIP names. */
#define CB_K(c, label, call)                                                                     \
    (cb_skip((c), (label)) ? 0 : (cb_mark((c), (label)), (c)->launches++, (call)))

/* Takes back the last CB_K whose launcher declined (-ENOTSUP: nothing enqueued). */
static void cb_unlaunch(struct backend_cuda *c)
{
    c->launches--;
    if (c->prof && c->prof_n)
        c->prof_n--;
}

/* The int8 decode products that LAMINA_CUDA_PROBE=1 marks (cuda_mvq_probe_next). */
enum { CB_PQ_IN, CB_PQ_OUT, CB_PQ_GATE_UP, CB_PQ_DOWN, CB_PQ_N };

/* Points the next int8 product's marks at kind q of the layer being enqueued (a decode
 * step with the probe on), or at none (q < 0: after the launch). */
static void cb_probe_next(const struct backend_cuda *c, int q)
{
    if (!c->probe_mvq || !c->decoding)
        return;
    const size_t per = (size_t)CUDA_PROBE_MVQ_BLOCKS * CUDA_PROBE_SLOTS;
    cuda_mvq_probe_next(q < 0 ? NULL
                              : c->probe_mvq + ((size_t)(c->probe_l - c->l0) * CB_PQ_N + q) * per);
}

static int cb_mm(struct backend_cuda *c, const char *label, const struct cb_mat *w,
                 const float *X, size_t ldx, uint32_t S, float *Y, size_t ldy)
{
    void *work = c->stream == c->side ? c->mmq_side : c->mmq_work;
    if (S > 1 && work) {
        const int rc = CB_K(c, label, cuda_mmq(w->type, w->d, w->row_bytes, w->n_out, w->n_in, X,
                                               ldx, S, Y, ldy, work, c->stream));
        if (rc != -ENOTSUP)
            return rc;
        cb_unlaunch(c); /* not launched: the CUDA-core product below instead */
    }
    if (S == 1)
        return CB_K(c, label, cuda_matvec(w->type, w->d, w->row_bytes, w->n_out, w->n_in, X, Y,
                                          c->stream));
    return CB_K(c, label, cuda_matmul(w->type, w->d, w->row_bytes, w->n_out, w->n_in, X, ldx, S,
                                      Y, ldy, c->stream));
}

/* A prefill product of S rows of c->xa over the stacked matrix w (its row
 * ranges the parts, in order) in one int8 launch, each part's outputs to its
 * own buffer: the bits of a cb_mm of each. -ENOTSUP (nothing launched) where
 * that launch does not take it; the caller then runs the parts apart. */
static int cb_mm_parts(struct backend_cuda *c, const char *label, const struct cb_mat *w,
                       uint32_t S, const struct cuda_mmq_part *p, uint32_t n_parts)
{
    void *work = c->stream == c->side ? c->mmq_side : c->mmq_work;
    if (S < 2 || !work || !w->n_out || !c->parts_on)
        return -ENOTSUP;
    const int rc = CB_K(c, label, cuda_mmq_parts(w->type, w->d, w->row_bytes, w->n_in, c->xa,
                                                 w->n_in, S, p, n_parts, work, c->stream));
    if (rc == -ENOTSUP)
        cb_unlaunch(c);
    return rc;
}

/* The decode input product of a layer (one row of c->xa): from the rows the
 * previous layer's combine rounded (c->xq) where they are there and the
 * int8 product takes it, else cb_mm: the same bits either way. beside: the
 * second of a layer's two input products (z|beta|alpha after qkv, v after
 * q|k), whose launch before it (the first) reads c->xq, which the combine
 * wrote before it, and never this product's Y: it runs beside the first and
 * waits for it only at its end (cuda_mvq_xq_beside), not with the early reads
 * off nor with launches skipped (the first may be one of them). */
static int cb_mm_in(struct backend_cuda *c, const char *label, const struct cb_mat *w, float *Y,
                    bool beside)
{
    if (c->xq_ready) {
        cb_probe_next(c, CB_PQ_IN);
        const int rc =
            CB_K(c, label,
                 beside && c->early && !c->skip
                     ? cuda_mvq_xq_beside(w->type, w->d, w->row_bytes, w->n_out, w->n_in, c->xq,
                                          Y, c->stream)
                     : cuda_mvq_xq(w->type, w->d, w->row_bytes, w->n_out, w->n_in, c->xq, Y,
                                   c->stream));
        cb_probe_next(c, -1);
        if (rc != -ENOTSUP)
            return rc;
        cb_unlaunch(c);
    }
    return cb_mm(c, label, w, c->xa, w->n_in, 1, Y, 0);
}

/* A decode product (one row) followed by a tail in its last block
 * (kernels/cuda/tail.h); t NULL: cb_mm. */
static int cb_mm_tail(struct backend_cuda *c, const char *label, const struct cb_mat *w,
                      const float *X, float *Y, const struct cuda_tail *t)
{
    if (!t)
        return cb_mm(c, label, w, X, w->n_in, 1, Y, w->n_out);
    return CB_K(c, label, cuda_matvec_tail(w->type, w->d, w->row_bytes, w->n_out, w->n_in, X, Y,
                                           t, c->stream));
}

/* A decode product over the row X that its producer also rounded into xq
 * (cuda_deltanet_conv_heads_yq), with tail t or none: the int8 kernels
 * copy xq whatever the row's length (cuda_mvq_xq_tail), else cb_mm_tail
 * over X. */
static int cb_out_router(struct backend_cuda *c, const char *label, const struct cb_mat *w,
                         const int8_t *xq, float *Y);

static int cb_mm_yq(struct backend_cuda *c, const char *label, const struct cb_mat *w,
                    const int8_t *xq, const float *X, float *Y, const struct cuda_tail *t)
{
    if (c->rt_layer && !t && Y == c->mix) { /* the router in this launch, where it takes it */
        const int rc = cb_out_router(c, label, w, xq, Y);
        if (rc != -ENOTSUP)
            return rc;
    }
    cb_probe_next(c, CB_PQ_OUT);
    const int rc = CB_K(c, label, cuda_mvq_xq_tail(w->type, w->d, w->row_bytes, w->n_out,
                                                   w->n_in, xq, Y, t, c->stream));
    cb_probe_next(c, -1);
    if (rc != -ENOTSUP)
        return rc;
    cb_unlaunch(c);
    return cb_mm_tail(c, label, w, X, Y, t);
}

/* A layer's decode input product over rmsnorm(c->h) * norm_w, the norm in
 * the product (cb_in_norm said it takes it). */
static int cb_mm_norm(struct backend_cuda *c, const char *label, const struct cb_mat *w,
                      const float *norm_w, float *Y)
{
    return CB_K(c, label, cuda_matvec_norm(w->type, w->d, w->row_bytes, w->n_out, w->n_in, c->h,
                                           norm_w, c->hp->eps, Y, c->stream));
}

/* Whether layer L's decode input is one stacked product that normalises h
 * itself (cuda_matvec_norm), or two (qkv, then z|beta|alpha: L->zba; q|k, then
 * v: L->wqk), so that no norm launch comes before it. */
static bool cb_in_norm(const struct cb_layer *L)
{
    if (L->ly->recurrent && L->zba.n_out)
        return cuda_matvec_norm_ok(L->qkv.type, L->qkv.n_out, L->qkv.n_in) &&
               cuda_matvec_norm_ok(L->zba.type, L->zba.n_out, L->zba.n_in);
    if (!L->ly->recurrent && L->wqk.n_out)
        return cuda_matvec_norm_ok(L->wqk.type, L->wqk.n_out, L->wqk.n_in) &&
               cuda_matvec_norm_ok(L->wv.type, L->wv.n_out, L->wv.n_in);
    const struct cb_mat *m = L->ly->recurrent ? &L->dn1 : &L->wqkv1;
    return m->n_out && cuda_matvec_norm_ok(m->type, m->n_out, m->n_in);
}

/* The residual add + norm after layer L's mixer as the tail of its output
 * product (decode with tails on), else NULL (cuda_add_rmsnorm after it). */
static const struct cuda_tail *cb_norm_tail(struct backend_cuda *c, const struct cb_layer *L,
                                            uint32_t S, struct cuda_tail *t)
{
    if (S != 1 || !(c->tails & CB_TAIL_NORM))
        return NULL;
    *t = (struct cuda_tail){.kind = CUDA_TAIL_ADD_NORM, .counter = c->tail_ctr,
                            .n = c->hp->n_embd, .eps = c->hp->eps, .h = c->h,
                            .norm_w = L->ffn_norm, .out = c->xa};
    return t;
}

/* Whether layer L's residual add + norm after its mixer is formed by its consumers
 * (tail.h's cuda_norm_in) instead of the output product's tail: one token, every expert
 * here, the shared expert pair k of the routed products (or none), the router an F32
 * product with the top-k tail that cuda_matvec_tail_norm_in takes, and the combine the early
 * one (the only one that adds the mixer's output into h). The router forms the row from h
 * and the mixer's output and writes it to xa (the shared expert's gate reads it) and, rounded,
 * to xq (the gate/up product copies it instead of rounding xa), and the combine adds the
 * output into h: the same bits as the tail. cols: the layers' combines leave h to the input
 * products. */
static bool cb_norm_in(const struct backend_cuda *c, const struct cb_layer *L, uint32_t S,
                       bool cols)
{
    const struct arch_hparams *hp = c->hp;
    const bool local = L->n_resident == hp->n_expert;
    const bool shpair = local && L->shpair && c->shpair_on && !(c->tails & CB_TAIL_COMBINE);
    return S == 1 && c->norm_in_on && !cols && !(c->tails & CB_TAIL_COMBINE) &&
           (c->tails & CB_TAIL_TOPK) && c->early && !c->skip && local && (!L->sh || shpair) &&
           L->router.n_out && (uintptr_t)L->router.d % 16 == 0 &&
           cuda_matvec_norm_in_ok(L->router.type, L->router.n_out, L->router.n_in,
                                  L->router.row_bytes);
}

/* Layer L's decode attention over q at the device position (two kernels:
 * the splits and their combine, both counted), its output also rounded into
 * *aq where *aq is not NULL and the launch takes it; where it does not, the
 * plain launch and *aq = NULL. */
static int cb_attention_decode(struct backend_cuda *c, const struct cb_layer *L, const float *q,
                               int8_t **aq)
{
    const struct arch_hparams *hp = c->hp;
    const uint32_t hd = hp->head_dim;
    const size_t g = hp->attn_gated ? 2 : 1;
    for (;;) {
        const int rc = CB_K(c, "attn.core", cuda_attention_decode_at_xq(
                                                q, g * hd, L->kc, L->vc, c->cfg.kv_f16,
                                                hp->n_head, hp->n_head_kv, hd, c->d_pos,
                                                c->n_ctx, hp->attn_scale, hp->attn_gated,
                                                c->att, *aq, c->attn_ws, c->attn_ws_bytes,
                                                c->stream));
        if (rc == -ENOTSUP && *aq) {
            cb_unlaunch(c); /* not launched: the plain attention */
            *aq = NULL;
            continue;
        }
        if (!rc && !cb_skip(c, "attn.core"))
            c->launches++; /* the decode's second kernel: its split combine */
        return rc;
    }
}

/* Attention mixer. Decode: one product for q|k|v when the three share a type
 * (into c->dec), the fused norm/rope/store, and attention at the position in
 * device memory (so the graph never changes). */
static int cb_attention(struct backend_cuda *c, const struct cb_layer *L, uint32_t S,
                        uint32_t pos0, const struct cuda_tail *tail, bool raw)
{
    const struct arch_hparams *hp = c->hp;
    const uint32_t hd = hp->head_dim, nh = hp->n_head, nkv = hp->n_head_kv;
    const size_t n = hp->n_embd, kvd = (size_t)nkv * hd, g = hp->attn_gated ? 2 : 1;
    const size_t q_out = nh * hd * g;
    float *q = c->q, *kx = c->kx, *vx = c->vx;
    int rc;
    /* decode: q, k and v back to back in c->dec (one product, or q|k and v) */
    const bool dec = S == 1 && (L->wqkv1.n_out || L->wqk.n_out);
    if (dec) {
        q = c->dec, kx = c->dec + q_out, vx = c->dec + q_out + kvd;
        if (L->wqkv1.n_out) {
            rc = raw ? cb_mm_norm(c, "attn.qkv", &L->wqkv1, L->attn_norm, c->dec)
                     : cb_mm_in(c, "attn.qkv", &L->wqkv1, c->dec, false);
        } else {
            rc = raw ? cb_mm_norm(c, "attn.qk", &L->wqk, L->attn_norm, q)
                     : cb_mm_in(c, "attn.qk", &L->wqk, q, false);
            rc = rc ? rc
                    : raw ? cb_mm_norm(c, "attn.v", &L->wv, L->attn_norm, vx)
                          : cb_mm_in(c, "attn.v", &L->wv, vx, true);
        }
    } else {
        const struct cuda_mmq_part p[] = {{q, q_out, q_out}, {kx, kvd, kvd}, {vx, kvd, kvd}};
        rc = cb_mm_parts(c, "attn.qkv", &L->wqkv1, S, p, 3);
        /* else q|k in one launch where they are stacked, then v */
        const bool apart = rc == -ENOTSUP;
        if (apart)
            rc = cb_mm_parts(c, "attn.qk", &L->wqk, S, p, 2);
        if (apart && rc == -ENOTSUP) {
            rc = cb_mm(c, "attn.q", &L->wq, c->xa, n, S, q, q_out);
            rc = rc ? rc : cb_mm(c, "attn.k", &L->wk, c->xa, n, S, kx, kvd);
        }
        if (apart)
            rc = rc ? rc : cb_mm(c, "attn.v", &L->wv, c->xa, n, S, vx, kvd);
    }
    if (!rc && dec && c->attn_fused) {
        /* prep, attention and its split merge in one launch where the pass asks for it
         * (c->attn_fused: a position below fused_below) and it takes them, the output
         * also rounded for the output product where that takes it (cb_mm_yq) */
        int8_t *aq = c->yq_on && cuda_mvq_xq_ok(L->wo.type, L->wo.n_out, L->wo.n_in) ? c->yq
                                                                                     : NULL;
        rc = CB_K(c, "attn.fused",
                  cuda_attention_decode_fused(q, g * hd, kx, vx, L->q_norm, L->k_norm, hp->eps,
                                              hp->n_rot, hp->rope_base, L->kc, L->vc,
                                              c->cfg.kv_f16, nh, nkv, hd, c->d_pos, c->n_ctx,
                                              hp->attn_scale, hp->attn_gated, c->att, aq,
                                              c->attn_ws, c->attn_ws_bytes, c->stream));
        if (rc != -ENOTSUP) {
            c->fused_seen |= rc == 0;
            if (aq)
                return rc ? rc : cb_mm_yq(c, "attn.out", &L->wo, aq, c->att, c->mix, tail);
            if (tail)
                return rc ? rc : cb_mm_tail(c, "attn.out", &L->wo, c->att, c->mix, tail);
            return rc ? rc : cb_mm(c, "attn.out", &L->wo, c->att, (size_t)nh * hd, S, c->mix, n);
        }
        cb_unlaunch(c); /* not launched: prep, attention and merge apart */
        rc = 0;
    }
    const uint32_t *d_pos = S == 1 ? c->d_pos : NULL;
    rc = rc ? rc : CB_K(c, "attn.prep", cuda_attn_prep(q, q_out, g * hd, nh, kx, vx, kvd, nkv, hd,
                                                      L->q_norm, L->k_norm, hp->eps, hp->n_rot,
                                                      hp->rope_base, L->kc, L->vc,
                                                      c->cfg.kv_f16, S, pos0, d_pos, c->stream));
    if (S == 1) {
        /* the output also rounded for the output product where it takes it (cb_mm_yq) */
        int8_t *aq = c->yq_on && cuda_mvq_xq_ok(L->wo.type, L->wo.n_out, L->wo.n_in) ? c->yq
                                                                                     : NULL;
        rc = rc ? rc : cb_attention_decode(c, L, q, &aq);
        if (aq)
            return rc ? rc : cb_mm_yq(c, "attn.out", &L->wo, aq, c->att, c->mix, tail);
    } else {
        rc = rc ? rc : CB_K(c, "attn.core", cuda_attention(q, q_out, g * hd, L->kc, L->vc,
                                                          c->cfg.kv_f16, nh, nkv, hd, S, pos0,
                                                          hp->attn_scale, hp->attn_gated,
                                                          c->att, c->stream));
    }
    if (tail)
        return rc ? rc : cb_mm_tail(c, "attn.out", &L->wo, c->att, c->mix, tail);
    return rc ? rc : cb_mm(c, "attn.out", &L->wo, c->att, (size_t)nh * hd, S, c->mix, n);
}

/* Layer L's decode conv + heads in one launch over the step's qkv, beta,
 * alpha and z, y also rounded into *yq where *yq is not NULL and the launch
 * takes it; where it does not, the plain launch and *yq = NULL. early: the
 * step's input product was launched just before it, so the layer's states
 * were written two or more launches back (cuda_deltanet_conv_heads_yq). */
static int cb_conv_heads(struct backend_cuda *c, const struct cb_layer *L, const float *qkv,
                         const float *beta, const float *alpha, const float *z, int8_t **yq,
                         bool early)
{
    const struct arch_hparams *hp = c->hp;
    for (;;) {
        const int rc = CB_K(c, "dn.conv_heads", cuda_deltanet_conv_heads_yq(
                                                    L->conv_st, L->conv, hp->ssm_conv, qkv,
                                                    L->ssm_st, beta, alpha, L->ssm_a,
                                                    L->dt_bias, z, L->ssm_norm, c->y, *yq,
                                                    hp->ssm_nk, hp->ssm_nv, hp->ssm_dk,
                                                    hp->ssm_dv, hp->ssm_tiled, hp->eps,
                                                    early, c->stream));
        if (rc != -ENOTSUP || !*yq)
            return rc;
        cb_unlaunch(c); /* not launched: the plain conv + heads */
        *yq = NULL;
    }
}

/* A DeltaNet layer's decode output product over c->y (from the rounded y in
 * c->yq where yq is set), with tail t or none. */
static int cb_dn_out(struct backend_cuda *c, const struct cb_layer *L, const int8_t *yq,
                     const struct cuda_tail *t)
{
    if (yq)
        return cb_mm_yq(c, "dn.out", &L->out, yq, c->y, c->mix, t);
    if (t)
        return cb_mm_tail(c, "dn.out", &L->out, c->y, c->mix, t);
    return cb_mm(c, "dn.out", &L->out, c->y, L->out.n_in, 1, c->mix, c->hp->n_embd);
}

static int cb_deltanet(struct backend_cuda *c, const struct cb_layer *L, uint32_t S,
                       const struct cuda_tail *tail, bool raw)
{
    const struct arch_hparams *hp = c->hp;
    const size_t n = hp->n_embd, cd = arch_conv_dim(hp), nv = hp->ssm_nv;
    const size_t vd = nv * hp->ssm_dv;
    float *qkv = c->qkv, *z = c->z, *beta = c->beta, *alpha = c->alpha;
    int rc;
    if (S == 1 && L->dn1.n_out && !raw && c->fuse && c->dn_in) {
        /* the input product, conv and heads in one launch where it takes them */
        const struct cb_mat *w = &L->dn1;
        rc = CB_K(c, "dn.in_heads",
                  cuda_deltanet_in_conv_heads(w->type, w->d, w->row_bytes, (uint32_t)n, c->xa,
                                              c->dec, L->conv_st, L->conv, hp->ssm_conv,
                                              L->ssm_st, L->ssm_a, L->dt_bias, L->ssm_norm, c->y,
                                              hp->ssm_nk, hp->ssm_nv, hp->ssm_dk, hp->ssm_dv,
                                              hp->ssm_tiled, hp->eps, c->stream));
        if (rc != -ENOTSUP)
            return rc ? rc : cb_dn_out(c, L, NULL, tail);
        cb_unlaunch(c); /* not launched: the product, then conv and heads */
    }
    if (S == 1 && L->dn1.n_out && !raw && c->fuse && c->dn_tail) {
        /* the input product with each value head's conv + heads in a block of the same
         * launch; y also rounded where the output product takes it (cb_mm_yq) */
        const struct cb_mat *w = &L->dn1;
        int8_t *yq = c->yq_on && cuda_mvq_xq_ok(L->out.type, L->out.n_out, L->out.n_in)
                         ? c->yq
                         : NULL;
        for (;;) {
            rc = CB_K(c, "dn.in_tail",
                      cuda_deltanet_in_tail(w->type, w->d, w->row_bytes, (uint32_t)n, c->xa,
                                            c->xq_ready ? c->xq : NULL, c->dec, L->conv_st,
                                            L->conv, hp->ssm_conv, L->ssm_st, L->ssm_a,
                                            L->dt_bias, L->ssm_norm, c->y, yq, hp->ssm_nk,
                                            hp->ssm_nv, hp->ssm_dk, hp->ssm_dv, hp->ssm_tiled,
                                            hp->eps, c->stream));
            if (rc != -ENOTSUP || !yq)
                break;
            cb_unlaunch(c); /* perhaps only the rounded y: without it */
            yq = NULL;
        }
        if (rc != -ENOTSUP)
            return rc ? rc : cb_dn_out(c, L, yq, tail);
        cb_unlaunch(c); /* not launched: the product, then conv and heads */
    }
    const uint64_t before = c->launches;
    if (S == 1 && L->dn1.n_out) {
        qkv = c->dec, z = c->dec + cd, beta = z + vd, alpha = beta + nv;
        rc = raw ? cb_mm_norm(c, "dn.in", &L->dn1, L->attn_norm, c->dec)
                 : cb_mm_in(c, "dn.in", &L->dn1, c->dec, false);
    } else if (S == 1 && L->zba.n_out) { /* qkv, then z|beta|alpha after it */
        qkv = c->dec, z = c->dec + cd, beta = z + vd, alpha = beta + nv;
        rc = raw ? cb_mm_norm(c, "dn.qkv", &L->qkv, L->attn_norm, qkv)
                 : cb_mm_in(c, "dn.qkv", &L->qkv, qkv, false);
        rc = rc ? rc
                : raw ? cb_mm_norm(c, "dn.zba", &L->zba, L->attn_norm, z)
                      : cb_mm_in(c, "dn.zba", &L->zba, z, true);
    } else {
        const struct cuda_mmq_part p[] = {
            {qkv, cd, cd}, {z, vd, vd}, {beta, nv, nv}, {alpha, nv, nv}};
        rc = cb_mm_parts(c, "dn.in", &L->dn1, S, p, 4);
        /* else qkv, then z|beta|alpha in one launch where they are stacked */
        const bool apart = rc == -ENOTSUP;
        if (apart)
            rc = cb_mm(c, "dn.qkv", &L->qkv, c->xa, n, S, qkv, cd);
        if (apart && !rc)
            rc = cb_mm_parts(c, "dn.zba", &L->zba, S, p + 1, 3);
        if (apart && rc == -ENOTSUP) {
            rc = cb_mm(c, "dn.z", &L->z, c->xa, n, S, z, vd);
            rc = rc ? rc : cb_mm(c, "dn.beta", &L->beta, c->xa, n, S, beta, nv);
            rc = rc ? rc : cb_mm(c, "dn.alpha", &L->alpha, c->xa, n, S, alpha, nv);
        }
    }
    if (S == 1 && c->fuse) { /* conv and heads in one launch */
        /* y also rounded for the output product where it takes it (cb_mm_yq) */
        int8_t *yq = c->yq_on && cuda_mvq_xq_ok(L->out.type, L->out.n_out, L->out.n_in)
                         ? c->yq
                         : NULL;
        rc = rc ? rc : cb_conv_heads(c, L, qkv, beta, alpha, z, &yq, c->launches > before);
        return rc ? rc : cb_dn_out(c, L, yq, tail);
    }
    rc = rc ? rc : CB_K(c, "dn.conv", cuda_deltanet_conv(L->conv_st, L->conv, hp->ssm_conv, qkv,
                                                        c->u, (uint32_t)cd, S, c->stream));
    if (S > 1 && c->dn_work)
        rc = rc ? rc : CB_K(c, "dn.heads", cuda_deltanet_heads_chunked(
                                              L->ssm_st, c->u, beta, alpha, L->ssm_a, L->dt_bias,
                                              z, L->ssm_norm, c->y, hp->ssm_nk, hp->ssm_nv,
                                              hp->ssm_dk, hp->ssm_dv, hp->ssm_tiled, S, hp->eps,
                                              c->dn_work, c->dn_work_bytes, c->stream));
    else
        rc = rc ? rc : CB_K(c, "dn.heads", cuda_deltanet_heads(L->ssm_st, c->u, beta, alpha,
                                                              L->ssm_a, L->dt_bias, z,
                                                              L->ssm_norm, c->y, hp->ssm_nk,
                                                              hp->ssm_nv, hp->ssm_dk, hp->ssm_dv,
                                                              hp->ssm_tiled, S, hp->eps,
                                                              c->stream));
    if (tail)
        return rc ? rc : cb_mm_tail(c, "dn.out", &L->out, c->y, c->mix, tail);
    return rc ? rc : cb_mm(c, "dn.out", &L->out, c->y, vd, S, c->mix, n);
}

/* The pairs of one MoE block: their count, their expert ids (device) and
 * the activation rows' divisor (pair / x_div = token). */
struct cb_pairs {
    uint32_t P, x_div;
    int32_t *ids;
    bool prefill; /* several tokens: the int8 tensor-core products may take them */
};

/* One routed-expert product over the pairs: int8 tensor cores for a
 * prefill where the type allows, else the matvec kernels. x_div: of X's
 * rows (1: a row per pair). *grouped (where not NULL): whether the int8
 * launch ran, leaving the pairs' grouping in c->mmq_work. */
static int cb_experts_mm(struct backend_cuda *c, const char *label, const struct arch_matrix *m,
                         const void *const *tab, uint64_t rows, uint64_t n,
                         const struct cb_pairs *pr, const float *X, size_t ldx, uint32_t x_div,
                         float *Y, size_t ldy, bool *grouped)
{
    if (grouped)
        *grouped = false;
    if (pr->prefill && c->mmq_work) {
        const int rc = CB_K(c, label, cuda_mmq_experts(m->type, tab, c->hp->n_expert,
                                                       m->row_bytes, rows, n, pr->ids, pr->P, X,
                                                       ldx, x_div, Y, ldy, c->mmq_work,
                                                       c->mmq_work_bytes, c->stream));
        if (grouped)
            *grouped = rc == 0;
        if (rc != -ENOTSUP)
            return rc;
        cb_unlaunch(c);
    }
    return CB_K(c, label, cuda_matvec_experts(m->type, tab, m->row_bytes, rows, n, pr->ids, pr->P,
                                              X, ldx, x_div, Y, ldy, c->stream));
}

/* Routed experts held here (pairs of non-resident experts are skipped).
 * combine: the layer's combine as the tail of the down product (one token;
 * the shared expert's output ready before); rows: the down product and the
 * combine as one launch (cuda_moe_down_combine: one token, every expert
 * here, the shared expert pair k or none, early reads allowed), h left
 * unnormalised; *combined tells whether either ran (not where the kernels
 * cannot take it). */
static int cb_local_experts(struct backend_cuda *c, const struct cb_layer *L, uint32_t S,
                            const struct cb_pairs *pr, const struct cuda_tail *combine,
                            bool rows, const int8_t *xq, bool *combined)
{
    const struct arch_layer *ly = L->ly;
    const size_t n = c->hp->n_embd, F = c->hp->n_ff_exp;
    const uint32_t P = pr->P;
    bool gq = false;      /* c->gq holds the down product's input */
    bool grouped = false; /* c->mmq_work holds the pairs' grouping (the int8 gate/up) */
    int rc;
    if (!ly->gate_exps.data || L->gu_fused) {
        /* one 2F-row matrix per expert: the stacked gate_up, or gate and up
         * uploaded back to back with one row format */
        const struct arch_matrix *g = ly->gate_exps.data ? &ly->gate_exps : &ly->gate_up_exps;
        rc = -ENOTSUP;
        /* with the down product's input rounded where it takes it (not with kernels
         * skipped: the down product would read what no launch wrote) */
        const bool gq_ok = c->gq_on && !c->skip && cuda_mvq_xq_ok(ly->down_exps.type, n, F);
        for (int form = gq_ok ? 0 : 1;
             form < 2 && S == 1 && c->prefetch && cuda_mvq_pays(n, 2 * F) && rc == -ENOTSUP;
             form++) { /* the down experts into L2 */
            cb_probe_next(c, CB_PQ_GATE_UP);
            rc = CB_K(c, "moe.gate_up", cuda_mvq_experts_prefetch_gq(
                                            g->type, L->tab_gate, g->row_bytes, 2 * F, n, pr->ids,
                                            P, c->xa, n, pr->x_div, c->gu, 2 * F, L->tab_down,
                                            ly->down_exps.mat_bytes, c->hp->n_expert + 1,
                                            c->early && !c->skip && c->x_early, xq,
                                            c->ids_poll && (c->tails & CB_TAIL_TOPK),
                                            c->pf_after, form ? NULL : c->gq, c->stream));
            cb_probe_next(c, -1);
            gq = rc == 0 && !form;
            if (rc == -ENOTSUP)
                cb_unlaunch(c);
        }
        if (rc == -ENOTSUP)
            rc = cb_experts_mm(c, "moe.gate_up", g, L->tab_gate, 2 * F, n, pr, c->xa, n,
                               pr->x_div, c->gu, 2 * F, &grouped);
    } else {
        const struct arch_matrix *g = &ly->gate_exps, *u = &ly->up_exps;
        rc = cb_experts_mm(c, "moe.gate", g, L->tab_gate, F, n, pr, c->xa, n, pr->x_div, c->gu,
                           2 * F, NULL);
        rc = rc ? rc : cb_experts_mm(c, "moe.up", u, L->tab_up, F, n, pr, c->xa, n, pr->x_div,
                                     c->gu + F, 2 * F, &grouped);
    }
    if (rc)
        return rc;
    const struct arch_matrix *d = &ly->down_exps;
    *combined = false;
    /* the router's ids are two launches back (the gate/up product between):
     * the down product may read them, its weights and the combine's gate
     * input before its wait (not with kernels skipped) */
    const uint32_t early = c->early && !c->skip ? (uint32_t)c->hp->n_expert + 1 : 0;
    if (S == 1 && rows && early) {
        const uint32_t k = (uint32_t)c->hp->n_expert_used;
        rc = CB_K(c, "moe.down_combine",
                  cuda_moe_down_combine(d->type, L->tab_down, early, d->row_bytes, n, F, pr->ids,
                                        P, k, c->gu, 2 * F, c->w,
                                        P > k ? L->shexp_gate : NULL, c->xa, c->h, NULL,
                                        c->stream));
        *combined = rc == 0;
        if (rc != -ENOTSUP)
            return rc;
        cb_unlaunch(c);
    }
    if (S == 1) { /* the SiLU gate inside, the combine after where it is a tail: one launch */
        cb_probe_next(c, CB_PQ_DOWN);
        rc = gq ? CB_K(c, "moe.down",
                       cuda_mvq_experts_xq_tail(d->type, L->tab_down, d->row_bytes, n, F, pr->ids,
                                                early, P, c->gq, c->Y, combine, c->stream))
                : CB_K(c, "moe.down",
                       cuda_mvq_experts_glu_tail(d->type, L->tab_down, d->row_bytes, n, F,
                                                 pr->ids, early, P, c->gu, 2 * F, true, c->Y,
                                                 combine, c->stream));
        cb_probe_next(c, -1);
        *combined = rc == 0 && combine;
        if (rc != -ENOTSUP)
            return rc;
        cb_unlaunch(c);
    }
    if (pr->prefill && c->mmq_work && c->glu_on) {
        /* the SiLU gate in the product's rounding of its input, the grouping of the gate/up
         * product's (the tables of a layer have the same entries NULL: its resident experts) */
        rc = CB_K(c, "moe.down", cuda_mmq_experts_glu(d->type, L->tab_down, c->hp->n_expert,
                                                      d->row_bytes, n, F, pr->ids, P, c->gu,
                                                      2 * F, grouped, c->Y, n, c->mmq_work,
                                                      c->mmq_work_bytes, c->stream));
        if (rc != -ENOTSUP)
            return rc;
        cb_unlaunch(c);
    }
    rc = CB_K(c, "moe.silu", cuda_silu_mul(c->gu, (uint32_t)F, P, c->act, c->stream));
    return rc ? rc : cb_experts_mm(c, "moe.down", d, L->tab_down, n, F, pr, c->act, F, 1, c->Y,
                                   n, NULL);
}

static int cb_shared_expert(struct backend_cuda *c, const struct cb_layer *L, uint32_t S)
{
    const size_t n = c->hp->n_embd, Fs = c->hp->n_ff_shexp;
    int rc = cb_mm(c, "sh.gate_up", &L->sh_gu, c->xa, n, S, c->sg, 2 * Fs);
    if (!rc && !L->sh_fused)
        rc = cb_mm(c, "sh.up", &L->sh_up, c->xa, n, S, c->sg + Fs, 2 * Fs);
    if (!rc && S == 1) { /* the SiLU gate inside the down product */
        const struct cb_mat *d = &L->sh_down;
        rc = CB_K(c, "sh.down", cuda_mvq_glu(d->type, d->d, d->row_bytes, d->n_out, d->n_in,
                                             c->sg, true, c->so, c->stream));
        if (rc != -ENOTSUP)
            return rc;
        cb_unlaunch(c);
        rc = 0;
    }
    rc = rc ? rc : CB_K(c, "sh.silu", cuda_silu_mul(c->sg, (uint32_t)Fs, S, c->sact, c->stream));
    return rc ? rc : cb_mm(c, "sh.down", &L->sh_down, c->sact, Fs, S, c->so, n);
}

/* Groups the non-resident pairs as fw_route does (experts ascending, then
 * tokens) and gathers their input rows into h_xr. Returns the row count. */
static uint32_t cb_group_remote(struct backend_cuda *c, const struct cb_layer *L, uint32_t S,
                                uint32_t *n_groups)
{
    const uint32_t E = c->hp->n_expert, k = c->hp->n_expert_used;
    const size_t n = c->hp->n_embd;
    memset(c->cnt, 0, E * sizeof(uint32_t));
    for (uint32_t p = 0; p < S * k; p++)
        c->cnt[c->h_ids[p]]++;
    uint32_t rows = 0, g = 0;
    for (uint32_t e = 0; e < E; e++) {
        if (!c->cnt[e] || L->resident[e])
            continue;
        c->grp_expert[g] = e;
        c->grp_count[g++] = c->cnt[e];
        c->first[e] = rows;
        rows += c->cnt[e];
    }
    memset(c->cnt, 0, E * sizeof(uint32_t));
    for (uint32_t p = 0; p < S * k; p++) {
        const uint32_t e = (uint32_t)c->h_ids[p];
        if (L->resident[e])
            continue;
        const uint32_t a = c->first[e] + c->cnt[e]++;
        c->row_pair[a] = p;
        memcpy(c->h_xr + a * n, c->h_xa + (size_t)(p / k) * n, n * sizeof(float));
    }
    *n_groups = g;
    return rows;
}

/* Uploads the collected rows into the expert output rows of their pairs. */
static int cb_scatter_remote(struct backend_cuda *c, uint32_t rows)
{
    const size_t n = c->hp->n_embd;
    for (uint32_t a = 0; a < rows; a++) {
        c->cp_dst[a] = c->Y + (size_t)c->row_pair[a] * n;
        c->cp_src[a] = c->h_yr + (size_t)a * n;
        c->cp_size[a] = n * sizeof(float);
    }
    struct cudaMemcpyAttributes attr = {.srcAccessOrder = cudaMemcpySrcAccessOrderStream};
    size_t attr_idx = 0;
    return CUDA_CHECK(cudaMemcpyBatchAsync(c->cp_dst, c->cp_src, c->cp_size, rows, &attr,
                                           &attr_idx, 1, c->stream));
}

/* The MoE block of a layer with non-resident experts: host round trip. */
static int cb_moe_remote(struct backend_cuda *c, const struct cb_layer *L, uint32_t l, uint32_t S)
{
    const size_t n = c->hp->n_embd, k = c->hp->n_expert_used;
    int rc = CUDA_CHECK(cudaMemcpyAsync(c->h_ids, c->ids, S * k * sizeof(int32_t),
                                        cudaMemcpyDeviceToHost, c->stream));
    rc = rc ? rc : CUDA_CHECK(cudaMemcpyAsync(c->h_xa, c->xa, S * n * sizeof(float),
                                              cudaMemcpyDeviceToHost, c->stream));
    rc = rc ? rc : CUDA_CHECK(cudaStreamSynchronize(c->stream));
    if (rc)
        return rc;
    uint32_t n_groups = 0;
    const uint32_t rows = cb_group_remote(c, L, S, &n_groups);
    if (rows) {
        if (!c->cfg.remote.submit || !c->cfg.remote.collect) {
            log_error("layer %u: %u experts are not resident and no remote pool is set", l,
                      n_groups);
            return -EINVAL;
        }
        rc = c->cfg.remote.submit(c->cfg.remote.ctx, l, c->grp_expert, c->grp_count, n_groups,
                                  c->h_xr, rows);
    }
    cb_stage_mark(c, l, CB_STAGE_EXPERTS, 0, c->stream);
    bool combined;
    const struct cb_pairs pr = {.P = (uint32_t)(S * k), .x_div = (uint32_t)k, .ids = c->ids,
                                .prefill = S > 1};
    rc = rc ? rc : cb_local_experts(c, L, S, &pr, NULL, false, NULL, &combined);
    cb_stage_mark(c, l, CB_STAGE_EXPERTS, 1, c->stream);
    if (!rc && L->sh) {
        cb_stage_mark(c, l, CB_STAGE_SHARED, 0, c->stream);
        rc = cb_shared_expert(c, L, S);
        cb_stage_mark(c, l, CB_STAGE_SHARED, 1, c->stream);
    }
    const double t0 = cb_now();
    if (!rc && rows)
        rc = c->cfg.remote.collect(c->cfg.remote.ctx, l, c->h_yr, rows);
    c->stats.remote_wait += cb_now() - t0;
    if (!rc && rows)
        rc = cb_scatter_remote(c, rows);
    c->stats.remote_rows += rows;
    c->stats.expert_rows += S * k - rows;
    return rc;
}

/* The MoE block of layer l; next_norm: the next layer's attention norm,
 * applied to h into c->xa by the same launch as the combine (NULL: none).
 * cols (decode): h left unnormalised (next_norm then NULL: the next input
 * product norms), the combine as one launch with the down product where
 * CB_TAIL_ROWS asks for it and it runs, else as COMBINE_COLS tails of the
 * down product where CB_TAIL_COLS asks and it takes them. */
/* Whether layer L's decode MoE runs the shared expert as pair k of the routed products
 * (its output row k of Y): one token, every expert here, its matrices allow it and the
 * combine is no tail. */
static bool cb_shpair(const struct backend_cuda *c, const struct cb_layer *L, uint32_t S)
{
    return S == 1 && L->n_resident == c->hp->n_expert && L->shpair && c->shpair_on &&
           !(c->tails & CB_TAIL_COMBINE);
}

/* The decode router's arguments of layer L (l its index) where the row is formed from h
 * and the mixer's output (nin: cb_norm_in): that row (*ni, with the shared expert's gate
 * where the combine reads it from gs) and the top-k tail (*tk) into ids. */
static void cb_router_args(struct backend_cuda *c, const struct cb_layer *L, uint32_t l,
                           bool nin, int32_t *ids, struct cuda_norm_in *ni, struct cuda_tail *tk)
{
    const struct arch_hparams *hp = c->hp;
    const bool gs = nin && c->gs_on && L->sh && L->shexp_gate;
    *ni = (struct cuda_norm_in){
        .h = c->h, .add = c->mix, .w = L->ffn_norm, .eps = hp->eps,
        .gate = gs ? L->shexp_gate : NULL, .gs = gs ? c->gs : NULL,
        .probe = c->probe ? c->probe + (size_t)(l - c->l0) * CUDA_PROBE_BLOCKS * CUDA_PROBE_SLOTS
                          : NULL};
    *tk = (struct cuda_tail){.kind = CUDA_TAIL_TOPK, .counter = c->tail_ctr,
                             .k = hp->n_expert_used, .ids = ids, .w = c->w,
                             .mark_ids = c->ids_poll, .topk_rounds = c->topk_rounds,
                             .topk_softmax = c->topk_softmax};
}

/* Layer c->rt_layer's decode output product (xq the mixer's output rounded) with the
 * router in the same launch (cuda_mvq_xq_router): what the product and cb_moe's router
 * launch would write, the logits summed in another order. -ENOTSUP (nothing launched,
 * counted back) where it does not take them. */
static int cb_out_router(struct backend_cuda *c, const char *label, const struct cb_mat *w,
                         const int8_t *xq, float *Y)
{
    const struct cb_layer *L = c->rt_layer;
    const struct cb_mat *r = &L->router;
    struct cuda_norm_in ni;
    struct cuda_tail tk;
    cb_router_args(c, L, c->rt_l, true, cb_shpair(c, L, 1) ? c->ids_dec : c->ids, &ni, &tk);
    const int rc = CB_K(c, label, cuda_mvq_xq_router(w->type, w->d, w->row_bytes, w->n_out,
                                                     w->n_in, xq, Y, r->d, r->row_bytes,
                                                     L->router_t, (uint32_t)r->n_out, &ni,
                                                     c->xa, c->xq,
                                                     c->rl, c->rt_part, c->rt_part_floats, &tk,
                                                     c->stream));
    if (rc == -ENOTSUP)
        cb_unlaunch(c);
    c->rt_done = rc == 0;
    return rc;
}

static int cb_moe(struct backend_cuda *c, const struct cb_layer *L, uint32_t l, uint32_t S,
                  const float *next_norm, bool cols, bool nin)
{
    const struct arch_hparams *hp = c->hp;
    const size_t n = hp->n_embd, k = hp->n_expert_used;
    const bool local = L->n_resident == hp->n_expert;
    const bool shpair = cb_shpair(c, L, S);
    /* else the shared expert runs beside the router and routed experts on
     * the side stream (a parallel branch of the graph); not when profiling */
    const bool fork = local && L->sh && !shpair && !c->prof;
    const struct cb_pairs pr = {.P = (uint32_t)(S * k + shpair),
                                .x_div = (uint32_t)(shpair ? k + 1 : k),
                                .ids = shpair ? c->ids_dec : c->ids, .prefill = S > 1};
    float *so = shpair ? c->Y + k * n : c->so;
    int rc = 0;
    if (fork) {
        rc = CUDA_CHECK(cudaEventRecord(c->ev_fork, c->stream));
        rc = rc ? rc : CUDA_CHECK(cudaStreamWaitEvent(c->side, c->ev_fork, 0));
        cudaStream_t main_stream = c->stream;
        c->stream = c->side;
        if (!rc)
            cb_stage_mark(c, l, CB_STAGE_SHARED, 0, c->side);
        rc = rc ? rc : cb_shared_expert(c, L, S);
        if (!rc)
            cb_stage_mark(c, l, CB_STAGE_SHARED, 1, c->side);
        c->stream = main_stream;
        rc = rc ? rc : CUDA_CHECK(cudaEventRecord(c->ev_join, c->side));
    }
    /* decode with tails: top-k in the router product, the combine (and the
     * next norm) in the down product */
    const bool topk_tail = S == 1 && (c->tails & CB_TAIL_TOPK);
    const bool rows = cols && (c->tails & CB_TAIL_ROWS) && local && (!L->sh || shpair);
    const bool tails = S == 1 && ((c->tails & CB_TAIL_COMBINE) ||
                                  (cols && (c->tails & CB_TAIL_COLS))); /* the combine's */
    if (!rc)
        cb_stage_mark(c, l, CB_STAGE_ROUTER, 0, c->stream);
    /* nin (cb_norm_in): h + the mixer's output, normalised, formed by the router's blocks
     * and written to xa and, rounded, to xq (the gate/up product copies it); the combine
     * adds the output into h */
    /* and with the shared expert's gate summed by a block of its own (the combine reads
     * it: gs); nin's combine is cuda_moe_combine_early_mix's */
    const bool gs = nin && c->gs_on && L->sh && L->shexp_gate;
    struct cuda_norm_in ni;
    struct cuda_tail tk;
    cb_router_args(c, L, l, nin, pr.ids, &ni, &tk);
    if (topk_tail && nin && c->rt_done) {
        /* the output product's launch ran the router (cb_out_router) */
    } else if (topk_tail) {
        const struct cb_mat *r = &L->router;
        rc = rc ? rc
             : nin ? CB_K(c, "moe.router", cuda_matvec_tail_norm_in(r->type, r->d, r->row_bytes,
                                                                    r->n_out, r->n_in, &ni, c->xa,
                                                                    c->xq, c->rl, &tk, c->stream))
                   : cb_mm_tail(c, "moe.router", &L->router, c->xa, c->rl, &tk);
    } else {
        rc = rc ? rc : cb_mm(c, "moe.router", &L->router, c->xa, n, S, c->rl, hp->n_expert);
        rc = rc ? rc : CB_K(c, "moe.topk", cuda_router_topk(c->rl, hp->n_expert, (uint32_t)k, S,
                                                           pr.ids, c->w, c->stream));
    }
    if (rc)
        return rc;
    cb_stage_mark(c, l, CB_STAGE_ROUTER, 1, c->stream);
    bool combined = false, shared_done = false;
    if (local) {
        /* with a combine tail the shared expert's output must be there before
         * the down product: join its branch (or run it) first */
        const bool one_block = c->tails & CB_TAIL_COMBINE;
        struct cuda_tail tc = {.kind = one_block ? CUDA_TAIL_COMBINE : CUDA_TAIL_COMBINE_COLS,
                               .counter = one_block ? c->tail_ctr : c->col_ctr,
                               .n = (uint32_t)n, .eps = hp->eps, .h = c->h,
                               .norm_w = one_block ? next_norm : NULL,
                               .out = c->xa, .k = (uint32_t)k, .w = c->w,
                               .so = L->sh ? so : NULL, .shexp_gate = L->shexp_gate,
                               .f = c->xa};
        if (shpair) {
            shared_done = true; /* pair k of the products below */
        } else if (tails && L->sh && fork) {
            rc = CUDA_CHECK(cudaStreamWaitEvent(c->stream, c->ev_join, 0));
            shared_done = true;
        } else if (tails && L->sh) {
            cb_stage_mark(c, l, CB_STAGE_SHARED, 0, c->stream);
            rc = cb_shared_expert(c, L, S);
            if (!rc)
                cb_stage_mark(c, l, CB_STAGE_SHARED, 1, c->stream);
            shared_done = true;
        }
        if (!rc)
            cb_stage_mark(c, l, CB_STAGE_EXPERTS, 0, c->stream);
        rc = rc ? rc : cb_local_experts(c, L, S, &pr, tails ? &tc : NULL, rows,
                                        nin ? c->xq : NULL, &combined);
        if (!rc)
            cb_stage_mark(c, l, CB_STAGE_EXPERTS, 1, c->stream);
        if (!rc && L->sh && fork && !shared_done) {
            rc = CUDA_CHECK(cudaStreamWaitEvent(c->stream, c->ev_join, 0));
        } else if (!rc && L->sh && !shared_done) {
            cb_stage_mark(c, l, CB_STAGE_SHARED, 0, c->stream);
            rc = cb_shared_expert(c, L, S);
            if (!rc)
                cb_stage_mark(c, l, CB_STAGE_SHARED, 1, c->stream);
        }
        c->stats.expert_rows += S * k;
    } else {
        rc = cb_moe_remote(c, L, l, S);
    }
    if (rc || combined)
        return rc;
    /* decode: xa (the gate's input) is the router's input, launches back */
    if (S == 1 && local && c->early && !c->skip) {
        /* and the next layer's input rounded for its int8 product */
        int8_t *xq = c->xq_on && next_norm && cuda_moe_combine_xq_ok((uint32_t)n, (uint32_t)k)
                         ? c->xq
                         : NULL;
        rc = CB_K(c, "moe.combine", cuda_moe_combine_early_mix(
                                        c->h, nin ? c->mix : NULL, c->Y, c->w, (uint32_t)k,
                                        L->sh ? so : NULL, L->shexp_gate, c->xa, (uint32_t)n, S,
                                        next_norm, hp->eps, next_norm ? c->xa : NULL, xq,
                                        gs ? c->gs : NULL, c->stream));
        c->xq_ready = rc == 0 && xq;
        return rc;
    }
    if (next_norm)
        return CB_K(c, "moe.combine", cuda_moe_combine_norm(
                                          c->h, c->Y, c->w, (uint32_t)k, L->sh ? so : NULL,
                                          L->shexp_gate, c->xa, (uint32_t)n, S, next_norm,
                                          hp->eps, c->xa, c->stream));
    return CB_K(c, "moe.combine", cuda_moe_combine(c->h, c->Y, c->w, (uint32_t)k,
                                                   L->sh ? so : NULL, L->shexp_gate, c->xa,
                                                   (uint32_t)n, S, c->stream));
}

/* Enqueues every layer of the range over S rows of c->h at positions pos0... */
static int cb_enqueue_layers(struct backend_cuda *c, uint32_t S, uint32_t pos0)
{
    const struct arch_hparams *hp = c->hp;
    const uint32_t n = hp->n_embd;
    c->decoding = S == 1;
    c->xq_ready = false; /* the first layer's input comes from the norm launch */
    /* decode with cols or rows: the combines leave h alone and each layer's
     * input product normalises it (or a norm launch before it) */
    const bool cols = S == 1 && (c->tails & (CB_TAIL_COLS | CB_TAIL_ROWS)) &&
                      !(c->tails & CB_TAIL_COMBINE);
    for (uint32_t l = c->l0; l < c->l1; l++) {
        const struct cb_layer *L = &c->layers[l - c->l0];
        c->probe_l = l;
        cb_stage_mark(c, l, CB_STAGE_MIXER, 0, c->stream);
        /* the first layer normalises h; the others got c->xa from the
         * previous layer's combine, the same bits (cuda_rmsnorm_wide) */
        const bool raw = cols && cb_in_norm(L);
        int rc = raw || (l > c->l0 && !cols)
                     ? 0
                     : CB_K(c, "norm", cuda_rmsnorm_wide(c->xa, c->h, L->attn_norm, n, S,
                                                         hp->eps, c->stream));
        struct cuda_tail tn;
        const bool nin = cb_norm_in(c, L, S, cols);
        /* the output product may run the router (cb_out_router; not with the probe's marks) */
        c->rt_layer = nin && c->rt_on && !c->probe ? L : NULL;
        c->rt_l = l;
        c->rt_done = false;
        const struct cuda_tail *tail = nin ? NULL : cb_norm_tail(c, L, S, &tn);
        if (!rc)
            rc = L->ly->recurrent ? cb_deltanet(c, L, S, tail, raw)
                                  : cb_attention(c, L, S, pos0, tail, raw);
        c->xq_ready = false; /* the layer's input product took it, or not */
        c->rt_layer = NULL;
        if (!tail && !nin)
            rc = rc ? rc : CB_K(c, "add_norm", cuda_add_rmsnorm(c->h, c->mix, c->xa, L->ffn_norm,
                                                                n, S, hp->eps, c->stream));
        if (!rc)
            cb_stage_mark(c, l, CB_STAGE_MIXER, 1, c->stream);
        rc = rc ? rc : cb_moe(c, L, l, S, !cols && l + 1 < c->l1 ? L[1].attn_norm : NULL, cols,
                              nin);
        if (rc)
            return rc;
        if (c->cfg.progress)
            __atomic_add_fetch(c->cfg.progress, 1, __ATOMIC_RELAXED);
    }
    return 0;
}

/* The kernel nodes of a captured graph into *n (what a replay runs,
 * whatever the launchers' own counts say). */
static int cb_graph_kernel_nodes(cudaGraph_t graph, uint64_t *n)
{
    size_t nn = 0;
    *n = 0;
    int rc = CUDA_CHECK(cudaGraphGetNodes(graph, NULL, &nn));
    if (rc || nn == 0)
        return rc;
    cudaGraphNode_t *nodes = malloc(nn * sizeof(*nodes));
    if (!nodes)
        return -ENOMEM;
    rc = CUDA_CHECK(cudaGraphGetNodes(graph, nodes, &nn));
    for (size_t i = 0; i < nn && !rc; i++) {
        enum cudaGraphNodeType t;
        rc = CUDA_CHECK(cudaGraphNodeGetType(nodes[i], &t));
        *n += !rc && t == cudaGraphNodeTypeKernel;
    }
    free(nodes);
    return rc;
}

/* Captures one decode step of the layers in form g (the pass's c->attn_fused)
 * into c->gexec[g] (NULL on failure; the counters the capture bumped are then
 * taken back). The graph's kernel nodes are its count of kernels
 * (c->graph_kernels[g], what each replay adds to c->launches); where the
 * launchers' counts (CB_K) say otherwise, a warning. */
static int cb_capture(struct backend_cuda *c, enum cb_graph g)
{
    cudaGraph_t graph = NULL;
    const double t0 = cb_now();
    const uint64_t k0 = c->launches, rows0 = c->stats.expert_rows;
    int rc = CUDA_CHECK(cudaStreamBeginCapture(c->stream, cudaStreamCaptureModeThreadLocal));
    if (rc)
        return rc;
    c->capturing = true;
    rc = cb_enqueue_layers(c, 1, 0);
    c->capturing = false;
    const int rc_end = CUDA_CHECK(cudaStreamEndCapture(c->stream, &graph));
    rc = rc ? rc : rc_end;
    uint64_t nodes = 0;
    rc = rc ? rc : cb_graph_kernel_nodes(graph, &nodes);
    rc = rc ? rc : CUDA_CHECK(cudaGraphInstantiate(&c->gexec[g], graph, 0));
    if (graph)
        cudaGraphDestroy(graph);
    c->graph_capture_s += cb_now() - t0;
    if (!rc && nodes != c->launches - k0)
        log_warn("cuda layers %u-%u: the decode graph holds %llu kernels where the launchers "
                 "counted %llu; counting the graph's", c->l0, c->l1 - 1,
                 (unsigned long long)nodes, (unsigned long long)(c->launches - k0));
    c->graph_kernels[g] = nodes;
    c->launches = k0 + nodes;
    c->graph_expert_rows = c->stats.expert_rows - rows0;
    if (rc) {
        c->gexec[g] = NULL;
        c->launches = k0;
        c->stats.expert_rows = rows0;
    }
    return rc;
}

/* No layer of a pass that asked for the attention decode in one launch took it
 * (f32 cache, a head shape the kernel does not take, a device before 8.0): the
 * three launches from the first position on, so that no second decode graph,
 * the same as the first, is captured when the position reaches fused_below. */
static void cb_fused_none(struct backend_cuda *c)
{
    log_debug("cuda layers %u-%u: no layer takes the attention decode in one launch",
              c->l0, c->l1 - 1);
    c->fused_below = 0;
}

/* Decode steps as one CUDA graph: the pass's form (c->attn_fused) captured
 * at the first step that takes it (positions reach the kernels through
 * c->d_pos, so the graph never changes) and replayed after. A capture with
 * stage-timing events that fails is made again without them (diagnostics
 * never fail a step). */
static int cb_graph_step(struct backend_cuda *c)
{
    enum cb_graph g = c->attn_fused ? CB_G_FUSED : CB_G_SPLIT;
    if (!c->gexec[g]) {
        const bool st = c->st_on;
        int rc = cb_capture(c, g);
        if (rc && st) {
            /* cudaGetLastError also clears what the failed capture left */
            cb_stage_off(c, "capturing the decode graph with the events", cudaGetLastError());
            rc = cb_capture(c, g);
        }
        if (rc)
            return rc;
        if (g == CB_G_FUSED && !c->fused_seen) {
            /* the graph is the three launches' form: kept as that one, never a second */
            cb_fused_none(c);
            if (!c->gexec[CB_G_SPLIT]) {
                c->gexec[CB_G_SPLIT] = c->gexec[CB_G_FUSED];
                c->graph_kernels[CB_G_SPLIT] = c->graph_kernels[CB_G_FUSED];
            } else {
                cudaGraphExecDestroy(c->gexec[CB_G_FUSED]);
            }
            c->gexec[CB_G_FUSED] = NULL;
            c->graph_kernels[CB_G_FUSED] = 0;
            g = CB_G_SPLIT;
        }
    } else {
        /* a replay runs what the capture enqueued: count it as the capture did */
        c->launches += c->graph_kernels[g];
        c->stats.expert_rows += c->graph_expert_rows;
        if (c->cfg.progress)
            __atomic_add_fetch(c->cfg.progress, c->l1 - c->l0, __ATOMIC_RELAXED);
    }
    c->graph_steps++;
    return CUDA_CHECK(cudaGraphLaunch(c->gexec[g], c->stream));
}

static void cb_pass_done(struct backend_cuda *c);

/* One pass of S rows: h up (or from the hand-off), the layers, h back (or to the hand-off),
 * synchronised. keep: h stays on the device (c->h) and nothing is synchronised or collected:
 * the caller enqueues more (the head) and then calls cb_pass_done. */
static int cb_pass(struct backend_cuda *c, float *h, uint32_t S, bool keep)
{
    const size_t bytes = (size_t)S * c->hp->n_embd * sizeof(float);
    const uint64_t launches0 = c->launches;
    const struct backend_handoff *ho = &c->cfg.handoff;
    *c->h_pos = c->pos;
    int rc;
    if (ho->recv) {
        rc = ho->recv(ho->ctx, c->h, bytes, c->stream);
    } else {
        memcpy(c->h_h, h, bytes);
        rc = CUDA_CHECK(cudaMemcpyAsync(c->h, c->h_h, bytes, cudaMemcpyHostToDevice, c->stream));
    }
    rc = rc ? rc : CUDA_CHECK(cudaMemcpyAsync(c->d_pos, c->h_pos, sizeof(uint32_t),
                                              cudaMemcpyHostToDevice, c->stream));
    if (rc)
        return rc;
    const bool graph = S == 1 && c->graphs && c->all_resident && !c->prof;
    c->attn_fused = S == 1 && c->pos < c->fused_below;
    c->fused_seen = false;
    rc = graph ? cb_graph_step(c) : cb_enqueue_layers(c, S, c->pos);
    if (!rc && !graph && c->attn_fused && !c->fused_seen)
        cb_fused_none(c);
    if (!rc)
        cb_prof_close(c);
    if (keep && !rc) {
        c->pass_rows = S, c->pass_graph = graph, c->pass_launches0 = launches0;
        return 0;
    }
    if (ho->send)
        rc = rc ? rc : ho->send(ho->ctx, c->h, bytes, c->stream);
    else
        rc = rc ? rc : CUDA_CHECK(cudaMemcpyAsync(c->h_h, c->h, bytes, cudaMemcpyDeviceToHost,
                                                  c->stream));
    rc = rc ? rc : CUDA_CHECK(cudaStreamSynchronize(c->stream));
    if (rc)
        return rc;
    if (!ho->send)
        memcpy(h, c->h_h, bytes);
    c->pass_rows = S, c->pass_graph = graph, c->pass_launches0 = launches0;
    cb_pass_done(c);
    return 0;
}

/* After a pass's work has completed: its timings, position and counters. */
static void cb_pass_done(struct backend_cuda *c)
{
    const uint32_t S = c->pass_rows;
    cb_prof_collect(c, S == 1);
    cb_stage_collect(c);
    c->pos += S;
    c->stats.tokens += S;
    if (S == 1)
        c->stats.step_kernels = c->launches - c->pass_launches0;
    if (S == 1 && !c->launches_logged) {
        c->launches_logged = true;
        log_info("cuda decode step over layers %u-%u: %llu kernels per token%s", c->l0, c->l1 - 1,
                 (unsigned long long)(c->launches - c->pass_launches0),
                 c->pass_graph ? ", launched as one CUDA graph" : ", launched one by one");
    }
}

/* ---- backend ops ---- */

/* ---- the router's marks (LAMINA_CUDA_PROBE=1) ---- */

enum { CB_PR_START, CB_PR_WAITS, CB_PR_ROW, CB_PR_ROW_CY, CB_PR_PROD, CB_PR_PROD_CY, CB_PR_TAIL,
       CB_PR_TAIL_CY, CB_PR_AFTER, CB_PR_N };

/* One layer's figures from its blocks' marks (cuda_norm_in.probe), in us and cycles, and
 * in t the first start, the first wait's return and the tail's end (%globaltimer, ns):
 * false where no block left its marks. */
static bool cb_probe_layer(const unsigned long long *m, double *f, double *scratch,
                           unsigned long long t[3])
{
    unsigned long long s0 = ~0ull, s0x = 0, s1 = ~0ull, s1x = 0, s4x = 0;
    size_t nb = 0, last = 0;
    for (size_t b = 0; b < CUDA_PROBE_BLOCKS; b++) {
        const unsigned long long *p = m + b * CUDA_PROBE_SLOTS;
        if (!p[0] || !p[4])
            continue;
        s0 = p[0] < s0 ? p[0] : s0;
        s0x = p[0] > s0x ? p[0] : s0x;
        s1 = p[1] < s1 ? p[1] : s1;
        s1x = p[1] > s1x ? p[1] : s1x;
        if (p[4] > s4x) {
            s4x = p[4];
            last = b;
        }
        nb++;
    }
    if (!nb)
        return false;
    t[0] = s0;
    t[1] = s1;
    t[2] = s4x;
    f[CB_PR_START] = 1e-3 * (double)(s0x - s0);
    f[CB_PR_WAITS] = 1e-3 * (double)(s1x - s1);
    f[CB_PR_AFTER] = 1e-3 * (double)(s4x - s1);
    const int from[2] = {1, 2}, slot[2] = {CB_PR_ROW, CB_PR_PROD};
    for (int k = 0; k < 2; k++)
        for (int cy = 0; cy < 2; cy++) {
            size_t n = 0;
            for (size_t b = 0; b < CUDA_PROBE_BLOCKS; b++) {
                const unsigned long long *p = m + b * CUDA_PROBE_SLOTS + 8 * cy;
                if (m[b * CUDA_PROBE_SLOTS] && m[b * CUDA_PROBE_SLOTS + 4])
                    scratch[n++] = (double)(p[from[k] + 1] - p[from[k]]) * (cy ? 1.0 : 1e-3);
            }
            f[slot[k] + cy] = stats_median(scratch, n);
        }
    const unsigned long long *p = m + last * CUDA_PROBE_SLOTS;
    f[CB_PR_TAIL] = 1e-3 * (double)(p[4] - p[3]);
    f[CB_PR_TAIL_CY] = (double)(p[12] - p[11]);
    return true;
}

/* The int8 products' figures a layer (cuda_mvq_probe_next's marks), in us: their blocks'
 * starts and waits' spreads, the medians over blocks of the times from a block's wait to
 * its activations, its first tile, its outputs and its end, the last end after the first
 * wait, the first wait after the kernel before's end and the next one's first wait after
 * the last end (NAN where not marked), gate/up's polled ids after the router's tail (median
 * block, last block). */
enum { CB_PQF_START, CB_PQF_WAITS, CB_PQF_X, CB_PQF_DATA, CB_PQF_STORED, CB_PQF_END,
       CB_PQF_SPAN, CB_PQF_PREV, CB_PQF_NEXT, CB_PQF_POLL, CB_PQF_POLL_MAX, CB_PQF_N };

/* Kind q's blocks' figures (f[CB_PQF_START..SPAN], POLL, POLL_MAX against router_end, 0:
 * none) and its first wait and last end in t[0..1]: false where no block left its marks. */
static bool cb_probe_mvq(const unsigned long long *m, unsigned long long router_end, double *f,
                         double *scratch, unsigned long long t[2])
{
    enum { S = CUDA_PROBE_SLOTS };
    unsigned long long s0 = ~0ull, s0x = 0, w0 = ~0ull, w0x = 0, ex = 0, px = 0;
    size_t nb = 0;
    for (size_t b = 0; b < CUDA_PROBE_MVQ_BLOCKS; b++) {
        const unsigned long long *p = m + b * S;
        if (!p[CUDA_PROBE_MVQ_START] || !p[CUDA_PROBE_MVQ_WAITED] || !p[CUDA_PROBE_MVQ_END])
            continue;
        s0 = p[0] < s0 ? p[0] : s0;
        s0x = p[0] > s0x ? p[0] : s0x;
        w0 = p[CUDA_PROBE_MVQ_WAITED] < w0 ? p[CUDA_PROBE_MVQ_WAITED] : w0;
        w0x = p[CUDA_PROBE_MVQ_WAITED] > w0x ? p[CUDA_PROBE_MVQ_WAITED] : w0x;
        ex = p[CUDA_PROBE_MVQ_END] > ex ? p[CUDA_PROBE_MVQ_END] : ex;
        px = p[CUDA_PROBE_MVQ_POLLED] > px ? p[CUDA_PROBE_MVQ_POLLED] : px;
        nb++;
    }
    if (!nb)
        return false;
    t[0] = w0;
    t[1] = ex;
    f[CB_PQF_START] = 1e-3 * (double)(s0x - s0);
    f[CB_PQF_WAITS] = 1e-3 * (double)(w0x - w0);
    f[CB_PQF_SPAN] = 1e-3 * (double)(ex - w0);
    const int to[4] = {CUDA_PROBE_MVQ_X, CUDA_PROBE_MVQ_DATA, CUDA_PROBE_MVQ_STORED,
                       CUDA_PROBE_MVQ_END};
    for (int k = 0; k < 5; k++) {
        size_t n = 0;
        for (size_t b = 0; b < CUDA_PROBE_MVQ_BLOCKS; b++) {
            const unsigned long long *p = m + b * S;
            if (!p[CUDA_PROBE_MVQ_START] || !p[CUDA_PROBE_MVQ_WAITED] || !p[CUDA_PROBE_MVQ_END])
                continue;
            if (k < 4 && p[to[k]] >= p[CUDA_PROBE_MVQ_WAITED])
                scratch[n++] = 1e-3 * (double)(p[to[k]] - p[CUDA_PROBE_MVQ_WAITED]);
            else if (k == 4 && router_end && p[CUDA_PROBE_MVQ_POLLED])
                scratch[n++] = 1e-3 * ((double)p[CUDA_PROBE_MVQ_POLLED] - (double)router_end);
        }
        f[k < 4 ? CB_PQF_X + k : CB_PQF_POLL] = n ? stats_median(scratch, n) : NAN;
    }
    f[CB_PQF_POLL_MAX] = router_end && px ? 1e-3 * ((double)px - (double)router_end) : NAN;
    return true;
}

/* Logs the medians over the layers of each kind of the int8 products' figures (cb_probe_mvq)
 * of the last decode step; rt: the router's first start, first wait and tail end a layer
 * (0: none). */
static void cb_probe_mvq_report(struct backend_cuda *c, const unsigned long long *rt)
{
    static const char *const names[CB_PQ_N] = {"input product", "output product",
                                               "gate/up product", "down product"};
    const uint32_t nl = c->l1 - c->l0;
    const size_t per = (size_t)CUDA_PROBE_MVQ_BLOCKS * CUDA_PROBE_SLOTS;
    unsigned long long *m = malloc(nl * CB_PQ_N * per * sizeof(*m));
    double *f = malloc((size_t)nl * CB_PQ_N * CB_PQF_N * sizeof(*f));
    /* scratch for a kind's blocks, then for the layers' figures */
    double *col = malloc((nl > CUDA_PROBE_MVQ_BLOCKS ? nl : CUDA_PROBE_MVQ_BLOCKS) * sizeof(*col));
    if (!m || !f || !col || CUDA_CHECK(cudaMemcpy(m, c->probe_mvq, nl * CB_PQ_N * per * sizeof(*m),
                                                  cudaMemcpyDeviceToHost)))
        goto out;
    for (uint32_t i = 0; i < nl; i++) {
        unsigned long long t[CB_PQ_N][2];
        bool ok[CB_PQ_N];
        double *fi = f + (size_t)i * CB_PQ_N * CB_PQF_N;
        for (int q = 0; q < CB_PQ_N; q++) {
            double *fq = fi + q * CB_PQF_N;
            ok[q] = cb_probe_mvq(m + ((size_t)i * CB_PQ_N + q) * per,
                                 q == CB_PQ_GATE_UP ? rt[3 * i + 2] : 0, fq, col, t[q]);
            fq[CB_PQF_PREV] = fq[CB_PQF_NEXT] = NAN;
            if (!ok[q])
                fq[CB_PQF_START] = NAN; /* no marks: left out below */
        }
        /* the chain: output -> router -> gate/up -> down */
        if (ok[CB_PQ_OUT] && rt[3 * i + 1])
            fi[CB_PQ_OUT * CB_PQF_N + CB_PQF_NEXT] =
                1e-3 * ((double)rt[3 * i + 1] - (double)t[CB_PQ_OUT][1]);
        if (ok[CB_PQ_GATE_UP] && rt[3 * i + 2])
            fi[CB_PQ_GATE_UP * CB_PQF_N + CB_PQF_PREV] =
                1e-3 * ((double)t[CB_PQ_GATE_UP][0] - (double)rt[3 * i + 2]);
        if (ok[CB_PQ_GATE_UP] && ok[CB_PQ_DOWN]) {
            const double d = 1e-3 * ((double)t[CB_PQ_DOWN][0] - (double)t[CB_PQ_GATE_UP][1]);
            fi[CB_PQ_GATE_UP * CB_PQF_N + CB_PQF_NEXT] = d;
            fi[CB_PQ_DOWN * CB_PQF_N + CB_PQF_PREV] = d;
        }
    }
    for (int kind = 1; kind >= 0; kind--)
        for (int q = 0; q < CB_PQ_N; q++) {
            double med[CB_PQF_N];
            uint32_t layers = 0; /* of this kind, with marks (START not NAN) */
            for (int k = 0; k < CB_PQF_N; k++) {
                uint32_t n = 0;
                for (uint32_t i = 0; i < nl; i++) {
                    const double *fq = f + ((size_t)i * CB_PQ_N + q) * CB_PQF_N;
                    if (c->m->layers[c->l0 + i].recurrent != (kind == 1) ||
                        isnan(fq[CB_PQF_START]))
                        continue;
                    const double v = fq[k];
                    if (!isnan(v))
                        col[n++] = v;
                }
                med[k] = n ? stats_median(col, n) : NAN;
                if (k == CB_PQF_START)
                    layers = n;
            }
            if (!layers)
                continue;
            log_info("cuda probe, the %s of %s layers (%u, medians; last decode step): blocks "
                     "start over %.2f us, their waits return over %.2f us; after its wait a "
                     "block has its activations in %.2f us, its first tile (tma) in %.2f us, its "
                     "outputs stored in %.2f us, its end in %.2f us; the last end %.2f us after "
                     "the first wait; the first wait %.2f us after the launch before's end, the "
                     "launch after's %.2f us after the last end; ids polled %.2f us after the "
                     "router's tail (the last block %.2f)",
                     names[q], kind ? "DeltaNet" : "attention", layers, med[CB_PQF_START],
                     med[CB_PQF_WAITS], med[CB_PQF_X], med[CB_PQF_DATA], med[CB_PQF_STORED],
                     med[CB_PQF_END], med[CB_PQF_SPAN], med[CB_PQF_PREV], med[CB_PQF_NEXT],
                     med[CB_PQF_POLL], med[CB_PQF_POLL_MAX]);
        }
out:
    free(m);
    free(f);
    free(col);
}

/* Logs the medians over the layers of each kind of the router's figures of the last decode
 * step (the graph's last replay), then the int8 products' (cb_probe_mvq_report), and frees
 * the marks. */
static void cb_probe_report(struct backend_cuda *c)
{
    if (!c->probe)
        return;
    const uint32_t nl = c->l1 - c->l0;
    const size_t per = (size_t)CUDA_PROBE_BLOCKS * CUDA_PROBE_SLOTS;
    unsigned long long *m = malloc(nl * per * sizeof(*m));
    double *f = malloc((size_t)nl * CB_PR_N * sizeof(*f));
    double *col = malloc((nl > CUDA_PROBE_BLOCKS ? nl : CUDA_PROBE_BLOCKS) * sizeof(*col));
    unsigned long long *rt = calloc((size_t)nl * 3, sizeof(*rt));
    if (m && f && col && rt && CUDA_CHECK(cudaMemcpy(m, c->probe, nl * per * sizeof(*m),
                                                          cudaMemcpyDeviceToHost)) == 0)
        for (int kind = 1; kind >= 0; kind--) {
            uint32_t n = 0;
            for (uint32_t l = c->l0; l < c->l1; l++) {
                unsigned long long *t = rt + 3 * (size_t)(l - c->l0);
                if (c->m->layers[l].recurrent != (kind == 1) ||
                    !cb_probe_layer(m + (l - c->l0) * per, f + (size_t)n * CB_PR_N, col, t))
                    continue;
                n++;
                log_debug("cuda probe, the router of layer %u: first start %llu, first wait's "
                          "return %llu, the tail's end %llu (%%globaltimer, ns)", l, t[0], t[1],
                          t[2]);
            }
            if (!n)
                continue;
            double med[CB_PR_N];
            for (int i = 0; i < CB_PR_N; i++) {
                for (uint32_t j = 0; j < n; j++)
                    col[j] = f[(size_t)j * CB_PR_N + i];
                med[i] = stats_median(col, n);
            }
            log_info("cuda probe, the router after %s layers (%u, medians; last decode step): "
                     "blocks start over %.2f us, their waits return over %.2f us; after its "
                     "wait a block forms the row in %.2f us (%.0f cycles), its products in "
                     "%.2f us (%.0f cycles), the last block's tail %.2f us (%.0f cycles); the "
                     "first wait's return to the tail's end %.2f us",
                     kind ? "DeltaNet" : "attention", n, med[CB_PR_START], med[CB_PR_WAITS],
                     med[CB_PR_ROW], med[CB_PR_ROW_CY], med[CB_PR_PROD], med[CB_PR_PROD_CY],
                     med[CB_PR_TAIL], med[CB_PR_TAIL_CY], med[CB_PR_AFTER]);
        }
    if (rt && c->probe_mvq)
        cb_probe_mvq_report(c, rt);
    free(m);
    free(f);
    free(col);
    free(rt);
    cudaFree(c->probe);
    cudaFree(c->probe_mvq);
    c->probe = NULL;
    c->probe_mvq = NULL;
}

static void cb_fini(struct backend *b)
{
    struct backend_cuda *c = b->impl;
    if (!c)
        return;
    if (c->stream)
        cudaStreamSynchronize(c->stream);
    if (c->graph_steps && c->fused_below == UINT32_MAX)
        log_info("cuda layers %u-%u: %llu decode steps replayed a graph of %llu kernels "
                 "(the attention in one launch at every position), captured and "
                 "instantiated in %.1f ms", c->l0, c->l1 - 1, (unsigned long long)c->graph_steps,
                 (unsigned long long)c->graph_kernels[CB_G_FUSED], 1e3 * c->graph_capture_s);
    else if (c->graph_steps)
        log_info("cuda layers %u-%u: %llu decode steps replayed graphs of %llu kernels "
                 "(positions below %u) and %llu kernels (past it; 0: not captured), "
                 "captured and instantiated in %.1f ms", c->l0, c->l1 - 1,
                 (unsigned long long)c->graph_steps,
                 (unsigned long long)c->graph_kernels[CB_G_FUSED], c->fused_below,
                 (unsigned long long)c->graph_kernels[CB_G_SPLIT], 1e3 * c->graph_capture_s);
    cb_prof_report(c);
    cb_probe_report(c);
    for (int i = 0; c->prof && i <= CB_PROF_MAX; i++)
        if (c->prof_ev[i])
            cudaEventDestroy(c->prof_ev[i]);
    for (size_t i = 0; c->st_ev && i < (size_t)2 * (c->l1 - c->l0) * CB_STAGES; i++)
        if (c->st_ev[i])
            cudaEventDestroy(c->st_ev[i]);
    free(c->st_ev);
    if (c->slot_gexec)
        memcpy(c->slot_gexec + (size_t)c->seq * CB_GRAPHS, c->gexec, sizeof(c->gexec));
    for (size_t i = 0; c->slot_gexec && i < (size_t)c->n_seq * CB_GRAPHS; i++)
        if (c->slot_gexec[i])
            cudaGraphExecDestroy(c->slot_gexec[i]);
    for (int g = 0; !c->slot_gexec && g < CB_GRAPHS; g++)
        if (c->gexec[g])
            cudaGraphExecDestroy(c->gexec[g]);
    free(c->slot_pos);
    free(c->slot_gexec);
    for (uint32_t i = 0; c->host_dn && i < c->n_seq; i++)
        cudaFreeHost(c->host_dn[i]);
    free(c->host_dn);
    free(c->dn_flags);
    for (uint32_t i = 0; c->layers && i < c->l1 - c->l0; i++) {
        cudaFree(c->layers[i].experts);
        free(c->layers[i].resident);
    }
    for (uint32_t i = 0; c->flayers && i < c->n_flayers; i++) {
        cudaFree(c->flayers[i].experts);
        free(c->flayers[i].resident);
    }
    free(c->flayers);
    free(c->flayer_of);
    cudaFree(c->ftables);
    cudaFree(c->fbuf);
    cudaFreeHost(c->h_fids);
    void *dev[] = {c->trunk, c->state, c->scratch, c->tables, c->head, c->logits};
    for (size_t i = 0; i < sizeof(dev) / sizeof(dev[0]); i++)
        cudaFree(dev[i]);
    void *pinned[] = {c->h_h, c->h_xa, c->h_xr, c->h_yr, c->h_ids, c->h_pos};
    for (size_t i = 0; i < sizeof(pinned) / sizeof(pinned[0]); i++)
        cudaFreeHost(pinned[i]);
    if (c->ev_fork)
        cudaEventDestroy(c->ev_fork);
    if (c->ev_join)
        cudaEventDestroy(c->ev_join);
    if (c->side)
        cudaStreamDestroy(c->side);
    if (c->stream)
        cudaStreamDestroy(c->stream);
    free(c->layers);
    free(c->cnt);
    free(c->cp_dst);
    free(c->cp_src);
    free(c->cp_size);
    free(c);
    b->impl = NULL;
}

static int cb_select_device(struct backend_cuda *c)
{
    setenv("CUDA_DEVICE_ORDER", "PCI_BUS_ID", 1);
    const char *env = getenv("LAMINA_CUDA_DEVICE");
    char *end = NULL;
    long dev = env && *env ? strtol(env, &end, 10) : 0;
    if (env && *env && (*end || dev < 0 || dev > 1024)) {
        log_error("LAMINA_CUDA_DEVICE='%s' is not a device index", env);
        return -EINVAL;
    }
    int count = 0;
    if (CUDA_CHECK(cudaGetDeviceCount(&count)))
        return -EIO;
    if (dev >= count) {
        log_error("CUDA device %ld requested but %d present", dev, count);
        return -ENODEV;
    }
    c->device = (int)dev;
    if (CUDA_CHECK(cudaSetDevice(c->device)))
        return -EIO;
    /* a card the build has no code for, or a LAMINA_CUDA_AS_SM it cannot
     * honour, fails here, named, rather than at the first launch */
    int cc = 0, optin = 0, major = 0, minor = 0;
    int rc = cuda_caps_get(&cc, &optin);
    if (rc)
        return rc;
    if (CUDA_CHECK(cudaDeviceGetAttribute(&major, cudaDevAttrComputeCapabilityMajor,
                                          c->device)) ||
        CUDA_CHECK(cudaDeviceGetAttribute(&minor, cudaDevAttrComputeCapabilityMinor,
                                          c->device)))
        return -EIO;
    /* the prefill's tensor-core forms: their scratch only where they run */
    c->mmq = c->mmq && cc >= 80;
    c->chunked = cc >= 80;
    const char *as = getenv("LAMINA_CUDA_AS_SM");
    if (as && *as)
        log_warn("LAMINA_CUDA_AS_SM: device %d runs as a card of compute capability %d.%d "
                 "(%d bytes of shared memory a block)",
                 c->device, cc / 10, cc % 10, optin);
    else if (cc < 10 * major + minor)
        log_warn("cuda device %d (compute capability %d.%d) runs this build's code for %d.%d, "
                 "without the later paths (where that code is PTX, the driver compiles it at "
                 "first use: minutes the first time, then cached); build with "
                 "CUDA_ARCHS=\"-gencode=arch=compute_%d%d,code=sm_%d%d\" for the card's own",
                 c->device, major, minor, cc / 10, cc % 10, major, minor, major, minor);
    return 0;
}

/* Residency flags per layer; counts bytes of resident experts. */
static int cb_plan_experts(struct backend_cuda *c, uint64_t *bytes)
{
    const uint32_t E = c->hp->n_expert;
    c->all_resident = true;
    *bytes = 0;
    for (uint32_t l = c->l0; l < c->l1; l++) {
        struct cb_layer *L = &c->layers[l - c->l0];
        L->ly = &c->m->layers[l];
        L->resident = calloc(E, 1);
        if (!L->resident)
            return -ENOMEM;
        for (uint32_t e = 0; e < E; e++) {
            L->resident[e] = cb_is_resident(&c->cfg, l, e);
            L->n_resident += L->resident[e];
        }
        c->all_resident &= L->n_resident == E;
        *bytes += (uint64_t)L->n_resident * cb_expert_bytes(L->ly);
    }
    c->tables_size = cb_align((size_t)3 * (E + 1) * (c->l1 - c->l0) * sizeof(void *));
    return 0;
}

/* The stage-timing events (cfg->stage_times), timing enabled; none when off. */
static int cb_stage_events(struct backend_cuda *c)
{
    if (!c->cfg.stage_times)
        return 0;
    const size_t n = (size_t)2 * (c->l1 - c->l0) * CB_STAGES;
    c->st_ev = calloc(n, sizeof(*c->st_ev));
    if (!c->st_ev)
        return -ENOMEM;
    for (size_t i = 0; i < n; i++)
        if (CUDA_CHECK(cudaEventCreate(&c->st_ev[i])))
            return -EIO;
    c->st_on = true;
    return 0;
}

static int cb_setup(struct backend *b, struct backend_cuda *c)
{
    uint64_t experts = 0, foreign = 0;
    int rc = cb_select_device(c);
    rc = rc ? rc : cb_plan_experts(c, &experts);
    rc = rc ? rc : cb_plan_foreign(c, &foreign);
    if (rc)
        return rc;
    experts += foreign; /* charged like its own: experts, their tables, the serve buffers */
    if (!cb_types_ok(c) || !cb_shapes_ok(c))
        return -EINVAL;
    rc = cb_put_trunk(c); /* sizing pass */
    c->trunk_size = c->trunk_off;
    cb_plan_state(c);
    cb_carve_scratch(c);
    rc = rc ? rc : cb_check_budget(c, experts);
    rc = rc ? rc : CUDA_CHECK(cudaStreamCreateWithFlags(&c->stream, cudaStreamNonBlocking));
    rc = rc ? rc : CUDA_CHECK(cudaStreamCreateWithFlags(&c->side, cudaStreamNonBlocking));
    rc = rc ? rc : CUDA_CHECK(cudaEventCreateWithFlags(&c->ev_fork, cudaEventDisableTiming));
    rc = rc ? rc : CUDA_CHECK(cudaEventCreateWithFlags(&c->ev_join, cudaEventDisableTiming));
    rc = rc ? rc : cb_malloc(&c->trunk, c->trunk_size, "the trunk");
    rc = rc ? rc : cb_put_trunk(c);
    rc = rc ? rc : cb_malloc(&c->scratch, c->scratch_size, "scratch");
    if (!rc)
        cb_carve_scratch(c);
    /* skipped kernels leave their outputs unwritten: start from zeros (valid ids) */
    if (!rc && c->skip)
        rc = CUDA_CHECK(cudaMemset(c->scratch, 0, c->scratch_size));
    rc = rc ? rc : CUDA_CHECK(cudaMemset(c->tail_ctr, 0, sizeof(*c->tail_ctr)));
    rc = rc ? rc : CUDA_CHECK(cudaMemset(c->col_ctr, 0, CUDA_TAIL_COLS_MAX * sizeof(*c->col_ctr)));
    /* LAMINA_CUDA_PROBE=1: the decode router's marks (cuda_norm_in.probe) and the int8
     * products' (cuda_mvq_probe_next), reported at the end; the kernels mark in a diagnostic
     * build only (compiled in, the marks slow the decode with the probe off) */
    const char *pe = getenv("LAMINA_CUDA_PROBE");
    if (!rc && pe && !strcmp(pe, "1") && !cuda_mvq_probe_built())
        log_warn("cuda probe: LAMINA_CUDA_PROBE=1 needs kernels built with their marks "
                 "(make NVCC_DEFS=-DLAMINA_MVQ_PROBE); this build has none, nothing is reported");
    else if (!rc && pe && !strcmp(pe, "1")) {
        const size_t bytes =
            (size_t)(c->l1 - c->l0) * CUDA_PROBE_BLOCKS * CUDA_PROBE_SLOTS * sizeof(*c->probe);
        rc = CUDA_CHECK(cudaMalloc((void **)&c->probe, bytes));
        rc = rc ? rc : CUDA_CHECK(cudaMemset(c->probe, 0, bytes));
        /* the int8 products' marks where the kernels were built with them */
        const size_t qbytes = (size_t)(c->l1 - c->l0) * CB_PQ_N * CUDA_PROBE_MVQ_BLOCKS *
                              CUDA_PROBE_SLOTS * sizeof(*c->probe_mvq);
        rc = rc ? rc : CUDA_CHECK(cudaMalloc((void **)&c->probe_mvq, qbytes));
        rc = rc ? rc : CUDA_CHECK(cudaMemset(c->probe_mvq, 0, qbytes));
    }
    /* the shared pair's id after the router's k (decode; no kernel writes it) */
    const int32_t shared_id = (int32_t)c->hp->n_expert;
    rc = rc ? rc : CUDA_CHECK(cudaMemcpy(c->ids_dec + c->hp->n_expert_used, &shared_id,
                                         sizeof(shared_id), cudaMemcpyHostToDevice));
    rc = rc ? rc : cb_upload_all_experts(c);
    rc = rc ? rc : cb_upload_foreign(c);
    rc = rc ? rc : cb_alloc_state(c);
    rc = rc ? rc : cb_alloc_host(c);
    for (int i = 0; c->prof && !rc && i <= CB_PROF_MAX; i++)
        rc = CUDA_CHECK(cudaEventCreate(&c->prof_ev[i]));
    rc = rc ? rc : cb_stage_events(c);
    if (rc)
        return rc;
    b->mem_used = experts + c->trunk_size + c->tables_size + c->state_size + c->scratch_size;
    return 0;
}

/* The CB_TAIL_* bits LAMINA_CUDA_TAIL asks for (unknown words are logged and ignored). */
static unsigned cb_tail_mask(const char *env)
{
    if (!*env || !strcmp(env, "0"))
        return 0;
    if (!strcmp(env, "1") || !strcmp(env, "all"))
        return CB_TAIL_NORM | CB_TAIL_TOPK | CB_TAIL_COMBINE;
    unsigned mask = 0;
    for (const char *p = env; *p;) {
        const size_t len = strcspn(p, ",");
        if (len == 4 && !strncmp(p, "norm", 4))
            mask |= CB_TAIL_NORM;
        else if (len == 4 && !strncmp(p, "topk", 4))
            mask |= CB_TAIL_TOPK;
        else if (len == 7 && !strncmp(p, "combine", 7))
            mask |= CB_TAIL_COMBINE;
        else if (len == 4 && !strncmp(p, "cols", 4))
            mask |= CB_TAIL_COLS;
        else if (len == 4 && !strncmp(p, "rows", 4))
            mask |= CB_TAIL_ROWS;
        else
            log_warn("LAMINA_CUDA_TAIL: \"%.*s\" is none of norm, topk, combine, cols, rows: "
                     "ignored",
                     (int)len, p);
        p += len + (p[len] == ',');
    }
    return mask;
}

/* The position from which decode steps run the attention as three launches
 * (fused_below): LAMINA_CUDA_ATTN_FUSED=1 never, =0 from the first,
 * otherwise LAMINA_CUDA_ATTN_FUSED_BELOW=N (default CB_FUSED_BELOW). */
static uint32_t cb_fused_below(void)
{
    const char *af = getenv("LAMINA_CUDA_ATTN_FUSED"), *ab = getenv("LAMINA_CUDA_ATTN_FUSED_BELOW");
    if (af && (!strcmp(af, "0") || !strcmp(af, "1")))
        return af[0] == '1' ? UINT32_MAX : 0u;
    if (!ab)
        return CB_FUSED_BELOW;
    char *end = NULL;
    errno = 0;
    const unsigned long long n = strtoull(ab, &end, 10);
    if (!*ab || *end || errno || strchr(ab, '-')) {
        log_warn("LAMINA_CUDA_ATTN_FUSED_BELOW=%s is not a count of positions: %u taken", ab,
                 CB_FUSED_BELOW);
        return CB_FUSED_BELOW;
    }
    return n > UINT32_MAX ? UINT32_MAX : (uint32_t)n;
}

static int cb_init(struct backend *b, const struct backend_config *cfg)
{
    const struct arch_model *m = cfg->model;
    if (cfg->layer_begin >= cfg->layer_end || cfg->layer_end > m->hp.n_layer) {
        log_error("bad layer range %u-%u for a model of %u layers", cfg->layer_begin,
                  cfg->layer_end, m->hp.n_layer);
        return -EINVAL;
    }
    struct backend_cuda *c = calloc(1, sizeof(*c));
    if (!c)
        return -ENOMEM;
    b->impl = c;
    c->b = b;
    c->m = m;
    c->hp = &m->hp;
    c->cfg = *cfg;
    c->l0 = cfg->layer_begin;
    c->l1 = cfg->layer_end;
    c->B = cfg->max_batch ? cfg->max_batch : 256;
    c->n_ctx = cfg->n_ctx ? cfg->n_ctx : 4096;
    c->n_seq = b->n_seq;
    const char *g = getenv("LAMINA_CUDA_GRAPHS"), *pr = getenv("LAMINA_CUDA_PROFILE");
    c->graphs = !(g && !strcmp(g, "0"));
    c->prof = pr && !strcmp(pr, "1");
    const char *mq = getenv("LAMINA_CUDA_MMQ");
    c->mmq = !(mq && !strcmp(mq, "0"));
    const char *fu = getenv("LAMINA_CUDA_FUSE"), *di = getenv("LAMINA_CUDA_DN_IN");
    c->fuse = !(fu && !strcmp(fu, "0"));
    c->dn_in = di && !strcmp(di, "1");
    c->dn_tail = di && !strcmp(di, "tail");
    const char *ta = getenv("LAMINA_CUDA_TAIL");
    c->tails = ta ? cb_tail_mask(ta) : CB_TAIL_NORM | CB_TAIL_TOPK;
    const char *pf = getenv("LAMINA_CUDA_PF");
    c->prefetch = !(pf && !strcmp(pf, "0"));
    c->pf_after = !(pf && !strcmp(pf, "before"));
    const char *early = getenv("LAMINA_CUDA_EARLY");
    c->early = !(early && !strcmp(early, "0"));
    const char *xe = getenv("LAMINA_CUDA_X_EARLY");
    c->x_early = !(xe && !strcmp(xe, "0"));
    const char *xqe = getenv("LAMINA_CUDA_XQ");
    c->xq_on = !(xqe && !strcmp(xqe, "0"));
    const char *yqe = getenv("LAMINA_CUDA_YQ");
    c->yq_on = !(yqe && !strcmp(yqe, "0"));
    const char *gqe = getenv("LAMINA_CUDA_GQ");
    c->gq_on = !(gqe && !strcmp(gqe, "0"));
    const char *gse = getenv("LAMINA_CUDA_GS");
    c->gs_on = !(gse && !strcmp(gse, "0"));
    const char *sp = getenv("LAMINA_CUDA_SHPAIR");
    c->shpair_on = !(sp && !strcmp(sp, "0"));
    const char *ni = getenv("LAMINA_CUDA_NORM_IN");
    c->norm_in_on = !(ni && !strcmp(ni, "0"));
    const char *ort = getenv("LAMINA_CUDA_OUT_ROUTER");
    c->rt_on = ort && !strcmp(ort, "1");
    const char *rtt = getenv("LAMINA_CUDA_RT_T");
    c->rt_t_on = !(rtt && !strcmp(rtt, "0"));
    const char *mp = getenv("LAMINA_CUDA_MMQ_PARTS");
    c->parts_on = !(mp && !strcmp(mp, "0"));
    const char *mg = getenv("LAMINA_CUDA_MMQ_GLU");
    c->glu_on = !(mg && !strcmp(mg, "0"));
    const char *ip = getenv("LAMINA_CUDA_IDS_POLL");
    c->ids_poll = !(ip && !strcmp(ip, "0"));
    const char *tr = getenv("LAMINA_CUDA_TOPK_ROUNDS");
    c->topk_rounds = tr && !strcmp(tr, "1");
    const char *ts = getenv("LAMINA_CUDA_TOPK_SOFTMAX");
    c->topk_softmax = ts && !strcmp(ts, "1");
    c->fused_below = cb_fused_below();
    c->skip = getenv("LAMINA_CUDA_SKIP");
    if (c->skip && !*c->skip)
        c->skip = NULL;
    if (c->skip)
        log_warn("LAMINA_CUDA_SKIP=%s: these decode kernels are not launched; the outputs are "
                 "wrong (for timing experiments only)", c->skip);
    c->layers = calloc(c->l1 - c->l0, sizeof(*c->layers));
    int rc = c->layers ? cb_setup(b, c) : -ENOMEM;
    if (rc) {
        cb_fini(b);
        return rc;
    }
    /* LAMINA_CUDA_OUT_ROUTER: whether each layer's output product takes its router, asked
     * now (the launcher's first answer queries the device, which a graph capture must not
     * be the first to do) */
    for (uint32_t l = c->l0; l < c->l1 && c->rt_on; l++) {
        const struct cb_layer *L = &c->layers[l - c->l0];
        const struct cb_mat *w = L->ly->recurrent ? &L->out : &L->wo;
        const bool ok = w->n_out && L->router.n_out &&
                        cuda_mvq_router_ok(w->type, w->n_out, w->n_in, (uint32_t)L->router.n_out,
                                           L->router.row_bytes);
        log_debug("cuda: layer %u's output product %s its router (LAMINA_CUDA_OUT_ROUTER)", l,
                  ok ? "takes" : "does not take");
    }
    log_info("cuda device %d: layers %u-%u, %u experts resident, %.1f MiB of device memory",
             c->device, c->l0, c->l1 - 1, b->resident_experts, b->mem_used / 1048576.0);
    return 0;
}

/* The slot's position and decode graph come and go with it; the layers'
 * state views point at its buffers. */
static void cb_use_seq(struct backend *b, uint32_t seq)
{
    struct backend_cuda *c = b->impl;
    c->slot_pos[c->seq] = c->pos;
    memcpy(c->slot_gexec + (size_t)c->seq * CB_GRAPHS, c->gexec, sizeof(c->gexec));
    c->seq = seq;
    c->pos = c->slot_pos[seq];
    memcpy(c->gexec, c->slot_gexec + (size_t)seq * CB_GRAPHS, sizeof(c->gexec));
    cb_point_slot(c, seq);
}

static void cb_reset(struct backend *b)
{
    struct backend_cuda *c = b->impl;
    c->pos = 0;
    if (c->failed || !c->dn_state_bytes)
        return;
    if (CUDA_CHECK(cudaMemsetAsync(c->state + (size_t)c->seq * c->slot_bytes, 0,
                                   c->dn_state_bytes, c->stream)) ||
        CUDA_CHECK(cudaStreamSynchronize(c->stream)))
        c->failed = true;
    memset(c->dn_flags + (size_t)c->seq * (c->l1 - c->l0), CB_DN_FRESH | CB_DN_AHEAD,
           c->l1 - c->l0);
}

/* Byte offset of layer i's DeltaNet state in a slot's DeltaNet part (device and host copy
 * alike: cb_point_slot's layout); *conv_bytes: its conv part, padded. */
static size_t cb_dn_offset(const struct backend_cuda *c, uint32_t i, size_t *conv_bytes)
{
    size_t off = 0;
    for (uint32_t j = 0; j < i; j++)
        if (c->layers[j].ly->recurrent)
            off += cb_dn_bytes(c->hp, conv_bytes);
    cb_dn_bytes(c->hp, conv_bytes);
    return off;
}

/* Allocates slot seq's host copy of its DeltaNet state unless it has one. */
static int cb_dn_host(struct backend_cuda *c, uint32_t seq)
{
    if (c->host_dn[seq] || cudaMallocHost((void **)&c->host_dn[seq], c->dn_state_bytes) ==
                               cudaSuccess)
        return 0;
    cudaGetLastError();
    c->host_dn[seq] = NULL;
    log_error("cannot allocate %.1f MiB of pinned host memory for the DeltaNet state of "
              "sequence slot %u", c->dn_state_bytes / 1048576.0, seq);
    return -ENOMEM;
}

/* Pulls (to_host) the DeltaNet layers of slot seq whose device copy is ahead, or pushes
 * (!to_host, enqueued on the stream) those whose device copy is not fresh. The host copy is
 * allocated at the first pull or push. 0, -ENOMEM or -EIO (logged). */
static int cb_dn_sync(struct backend_cuda *c, uint32_t seq, bool to_host)
{
    const uint32_t nl = c->l1 - c->l0;
    uint8_t *flags = c->dn_flags + (size_t)seq * nl;
    const uint8_t *dev = c->state + (size_t)seq * c->slot_bytes;
    int rc = 0;
    for (uint32_t i = 0; i < nl && !rc; i++) {
        if (!c->layers[i].ly->recurrent ||
            (to_host ? !(flags[i] & CB_DN_AHEAD) : (flags[i] & CB_DN_FRESH)))
            continue;
        if (cb_dn_host(c, seq))
            return -ENOMEM;
        size_t conv_bytes;
        const size_t off = cb_dn_offset(c, i, &conv_bytes);
        const size_t bytes = cb_dn_bytes(c->hp, &conv_bytes);
        rc = to_host ? CUDA_CHECK(cudaMemcpyAsync(c->host_dn[seq] + off, dev + off, bytes,
                                                  cudaMemcpyDeviceToHost, c->stream))
                     : CUDA_CHECK(cudaMemcpyAsync((uint8_t *)dev + off, c->host_dn[seq] + off,
                                                  bytes, cudaMemcpyHostToDevice, c->stream));
        flags[i] = to_host ? flags[i] & ~CB_DN_AHEAD : flags[i] | CB_DN_FRESH;
    }
    if (!rc && to_host)
        rc = CUDA_CHECK(cudaStreamSynchronize(c->stream));
    return rc;
}

/* After a GPU step of the current slot: every DeltaNet layer's device copy is ahead. */
static void cb_dn_stepped(struct backend_cuda *c)
{
    const uint32_t nl = c->l1 - c->l0;
    for (uint32_t i = 0; i < nl; i++)
        c->dn_flags[(size_t)c->seq * nl + i] |= CB_DN_AHEAD;
}

/* Whether a step of n rows may run: not after a CUDA error, not past the context. */
static int cb_step_check(const struct backend_cuda *c, uint32_t n)
{
    if (c->failed) {
        log_error("cuda backend refuses work after an earlier CUDA error");
        return -EIO;
    }
    if ((uint64_t)c->pos + n > c->n_ctx) {
        log_error("context full: %u tokens at position %u exceed the context of %u", n, c->pos,
                  c->n_ctx);
        return -ENOSPC;
    }
    return 0;
}

/* A step that failed with rc: the sequence state is now partial (a CUDA error also poisons
 * the context: the backend then refuses every later call); keep what the card holds on the
 * host. Returns rc. */
static int cb_step_failed(struct backend_cuda *c, int rc)
{
    if (c->dn_state_bytes) {
        const int pulled = cb_dn_sync(c, c->seq, true);
        log_error("cuda layers %u-%u: step failed (%d); the DeltaNet state of slot %u %s", c->l0,
                  c->l1 - 1, rc, c->seq,
                  pulled ? "could not be pulled from the card"
                         : "as the card held it is in the host copy");
    }
    c->failed = rc == -EIO;
    return rc;
}

static int cb_layers(struct backend *b, float *h, uint32_t n)
{
    struct backend_cuda *c = b->impl;
    int rc = cb_step_check(c, n);
    if (rc)
        return rc;
    rc = cb_dn_sync(c, c->seq, false);
    if (rc) {
        c->failed = rc == -EIO;
        return rc;
    }
    for (uint32_t s = 0; s < n; s += c->B) {
        const uint32_t S = n - s < c->B ? n - s : c->B;
        rc = cb_pass(c, h + (size_t)s * c->hp->n_embd, S, false);
        cb_dn_stepped(c);
        if (rc)
            return cb_step_failed(c, rc);
    }
    return 0;
}

static uint32_t cb_pos(const struct backend *b)
{
    const struct backend_cuda *c = b->impl;
    return c->pos;
}

/* Copies between a snapshot (forward.h's layout) and the current slot: DeltaNet layers from
 * or to the host copy, KV rows 0 .. pos-1 from or to the card. */
static int cb_state_copy(struct backend_cuda *c, uint8_t *p, uint32_t pos, bool save)
{
    const struct arch_hparams *hp = c->hp;
    const size_t conv = (size_t)arch_conv_dim(hp) * (hp->ssm_conv - 1) * sizeof(float);
    const size_t ssm = (size_t)hp->ssm_nv * hp->ssm_dv * hp->ssm_dk * sizeof(float);
    const size_t kv = (size_t)pos * hp->n_head_kv * hp->head_dim * (c->cfg.kv_f16 ? 2 : 4);
    int rc = 0;
    for (uint32_t i = 0; i < c->l1 - c->l0 && !rc; i++) {
        const struct cb_layer *L = &c->layers[i];
        if (L->ly->recurrent) {
            size_t conv_bytes;
            uint8_t *host = c->host_dn[c->seq] + cb_dn_offset(c, i, &conv_bytes);
            memcpy(save ? p : host, save ? host : p, conv);
            memcpy(save ? p + conv : host + conv_bytes, save ? host + conv_bytes : p + conv, ssm);
            p += conv + ssm;
            continue;
        }
        void *dev[2] = {L->kc, L->vc};
        for (int j = 0; j < 2 && !rc; j++, p += kv)
            rc = kv ? CUDA_CHECK(save ? cudaMemcpy(p, dev[j], kv, cudaMemcpyDeviceToHost)
                                      : cudaMemcpy(dev[j], p, kv, cudaMemcpyHostToDevice))
                    : 0;
    }
    return rc;
}

/* backend_ops.state_save: the host copy is canonical; layers the card is ahead on are
 * pulled first. */
static int cb_state_save(struct backend *b, void *dst)
{
    struct backend_cuda *c = b->impl;
    if (c->failed) {
        log_error("cuda backend refuses a snapshot after an earlier CUDA error");
        return -EIO;
    }
    int rc = cb_dn_sync(c, c->seq, true);
    rc = rc ? rc : cb_state_copy(c, dst, c->pos, true);
    c->failed = rc == -EIO;
    return rc;
}

/* backend_ops.state_load: writes the host copy (the device copy is then stale: the next
 * step pushes it) and the KV rows. */
static int cb_state_load(struct backend *b, const void *src, uint32_t pos)
{
    struct backend_cuda *c = b->impl;
    if (c->failed) {
        log_error("cuda backend refuses a snapshot after an earlier CUDA error");
        return -EIO;
    }
    const uint32_t nl = c->l1 - c->l0;
    int rc = c->dn_state_bytes ? cb_dn_host(c, c->seq) : 0;
    rc = rc ? rc : cb_state_copy(c, (uint8_t *)src, pos, false);
    if (!rc) {
        memset(c->dn_flags + (size_t)c->seq * nl, 0, nl); /* the host copy is current */
        c->pos = pos;
    }
    c->failed = rc == -EIO;
    return rc;
}

/* Rows per output-head pass: the scratch holds B rows of h. */
static uint32_t cb_logit_rows(const struct backend_cuda *c)
{
    return c->B < CB_LOGIT_ROWS ? c->B : CB_LOGIT_ROWS;
}

/* Uploads the output norm and lm head and allocates logits scratch. */
static int cb_load_head(struct backend *b, struct backend_cuda *c)
{
    const struct arch_matrix *o = &c->m->output;
    const size_t n = c->hp->n_embd;
    const size_t head = cb_align(n * sizeof(float)) + cb_align(o->mat_bytes);
    const size_t lg = (size_t)cb_logit_rows(c) * c->hp->n_vocab * sizeof(float);
    if (!cuda_matvec_supports(o->type)) {
        log_error("output tensor %s: type %s is not supported by the CUDA kernels", o->name,
                  quant_type_name(o->type));
        return -EINVAL;
    }
    if (b->mem_used + head + lg > c->budget) {
        log_error("device memory budget of %.1f MiB has no room for the output head: %.1f MiB "
                  "used + head %.1f MiB + logits scratch %.1f MiB", c->budget / 1048576.0,
                  b->mem_used / 1048576.0, head / 1048576.0, lg / 1048576.0);
        return -ENOMEM;
    }
    int rc = cb_malloc(&c->head, head, "the output head");
    rc = rc ? rc : cb_malloc(&c->logits, lg, "logits scratch");
    rc = rc ? rc : CUDA_CHECK(cudaMemcpy(c->head, c->m->output_norm, n * sizeof(float),
                                         cudaMemcpyHostToDevice));
    rc = rc ? rc : CUDA_CHECK(cudaMemcpy(c->head + cb_align(n * sizeof(float)), o->data,
                                         o->mat_bytes, cudaMemcpyHostToDevice));
    if (rc)
        return rc;
    c->out_norm = (float *)c->head;
    c->output = cb_view(o, c->head + cb_align(n * sizeof(float)), 0, o->n_out);
    b->mem_used += head + lg;
    return 0;
}

/* Enqueues the final norm and lm head of S rows of the device buffer d_h (<= the head's
 * logit rows), then either their logits into out (host) or, with ids, only their arg-max
 * (cuda_argmax, the sampler's greedy rule) into ids (host). */
static int cb_head_enqueue(struct backend_cuda *c, const float *d_h, uint32_t S, float *out,
                           int32_t *ids)
{
    const size_t ne = c->hp->n_embd, nvocab = c->hp->n_vocab;
    const struct cb_mat *o = &c->output;
    /* one row with the decode fusions: the lm head normalises it itself, the same bits
     * (cuda_matvec_norm), a launch fewer */
    const bool in_norm = S == 1 && c->fuse && cuda_matvec_norm_ok(o->type, o->n_out, o->n_in);
    int rc;
    if (in_norm) {
        rc = CB_K(c, "head.lm", cuda_matvec_norm(o->type, o->d, o->row_bytes, o->n_out, o->n_in,
                                                 d_h, c->out_norm, c->hp->eps, c->logits,
                                                 c->stream));
    } else {
        rc = CB_K(c, "head.norm", cuda_rmsnorm_wide(c->xa, d_h, c->out_norm, (uint32_t)ne, S,
                                                    c->hp->eps, c->stream));
        rc = rc ? rc : cb_mm(c, "head.lm", o, c->xa, ne, S, c->logits, nvocab);
    }
    if (ids)
        rc = rc ? rc : CB_K(c, "head.argmax", cuda_argmax(c->logits, (uint32_t)nvocab, S,
                                                          c->d_argmax, c->stream));
    if (!rc)
        cb_prof_close(c);
    if (ids) {
        return rc ? rc : CUDA_CHECK(cudaMemcpyAsync(ids, c->d_argmax, S * sizeof(int32_t),
                                                    cudaMemcpyDeviceToHost, c->stream));
    }
    return rc ? rc : CUDA_CHECK(cudaMemcpyAsync(out, c->logits, (size_t)S * nvocab * sizeof(float),
                                                cudaMemcpyDeviceToHost, c->stream));
}

/* Final norm and lm head of n rows; then either the logits into out or, with
 * ids, only their arg-max (cuda_argmax, the sampler's greedy rule). */
static int cb_head(struct backend *b, const float *h, uint32_t n, float *out, int32_t *ids)
{
    struct backend_cuda *c = b->impl;
    const size_t ne = c->hp->n_embd, nvocab = c->hp->n_vocab;
    if (c->failed)
        return -EIO;
    int rc = c->head ? 0 : cb_load_head(b, c);
    const uint32_t R = cb_logit_rows(c);
    for (uint32_t s = 0; s < n && !rc; s += R) {
        const uint32_t S = n - s < R ? n - s : R;
        const size_t bytes = (size_t)S * ne * sizeof(float);
        memcpy(c->h_h, h + (size_t)s * ne, bytes);
        rc = CUDA_CHECK(cudaMemcpyAsync(c->h, c->h_h, bytes, cudaMemcpyHostToDevice, c->stream));
        rc = rc ? rc : cb_head_enqueue(c, c->h, S, ids ? NULL : out + (size_t)s * nvocab,
                                       ids ? ids + s : NULL);
        rc = rc ? rc : CUDA_CHECK(cudaStreamSynchronize(c->stream));
        if (!rc)
            cb_prof_collect(c, n == 1);
    }
    c->failed = rc == -EIO;
    return rc;
}

/* backend_ops.layers_head: layers() over n rows, then the head of the last row from the
 * device copy of h, with one synchronisation at the end: no round trip through the host
 * between the last layer and the head (h is not brought back). Not offered with a send
 * hand-off (its rows leave the card) or before the head fits (-ENOTSUP: the caller runs
 * layers() and the head itself). */
static int cb_layers_head(struct backend *b, float *h, uint32_t n, float *logits, int32_t *id)
{
    struct backend_cuda *c = b->impl;
    if (c->cfg.handoff.send || n == 0)
        return -ENOTSUP;
    int rc = cb_step_check(c, n);
    if (rc)
        return rc;
    rc = c->head ? 0 : cb_load_head(b, c);
    if (rc)
        return rc == -ENOMEM ? -ENOTSUP : rc;
    rc = cb_dn_sync(c, c->seq, false);
    if (!rc)
        cb_dn_stepped(c); /* from here the card's copy is ahead, whatever happens */
    const uint32_t last = (n - 1) / c->B * c->B; /* the last pass's first row */
    for (uint32_t s = 0; s < last && !rc; s += c->B)
        rc = cb_pass(c, h + (size_t)s * c->hp->n_embd, c->B, false);
    const uint32_t S = n - last;
    rc = rc ? rc : cb_pass(c, h + (size_t)last * c->hp->n_embd, S, true);
    rc = rc ? rc : cb_head_enqueue(c, c->h + (size_t)(S - 1) * c->hp->n_embd, 1, logits, id);
    rc = rc ? rc : CUDA_CHECK(cudaStreamSynchronize(c->stream));
    if (!rc) {
        cb_pass_done(c);
        return 0;
    }
    return cb_step_failed(c, rc);
}

static int cb_logits(struct backend *b, const float *h, uint32_t n, float *out)
{
    return cb_head(b, h, n, out, NULL);
}

/* Greedy tokens on the device: 4 bytes a row come back instead of the logits. */
static int cb_argmax(struct backend *b, const float *h, uint32_t n, int32_t *ids)
{
    return cb_head(b, h, n, NULL, ids);
}

static const struct forward_stats *cb_stats(const struct backend *b)
{
    const struct backend_cuda *c = b->impl;
    return &c->stats;
}

/* One product of the foreign experts over the P rows (one input row per pair): int8 tensor
 * cores where the type allows, else the matvec kernels, as cb_experts_mm but on the serve
 * buffers and outside the profile. */
static int cb_foreign_mm(struct backend_cuda *c, const struct arch_matrix *m,
                         const void *const *tab, uint64_t rows, uint64_t n, uint32_t P,
                         const float *X, size_t ldx, float *Y, size_t ldy)
{
    if (P > c->hp->n_expert_used && c->mmq_work) {
        const int rc = cuda_mmq_experts(m->type, tab, c->hp->n_expert, m->row_bytes, rows, n,
                                        c->fids, P, X, ldx, 1, Y, ldy, c->mmq_work,
                                        c->mmq_work_bytes, c->stream);
        if (rc != -ENOTSUP)
            return rc;
    }
    return cuda_matvec_experts(m->type, tab, m->row_bytes, rows, n, c->fids, P, X, ldx, 1, Y,
                               ldy, c->stream);
}

/* backend_ops.serve: rows of another worker's layer through the foreign experts held here,
 * with the routed-expert kernels of the range's own layers; enqueued on the backend's
 * stream (after whatever a waiting pass enqueued) and waited for. */
static int cb_serve(struct backend *b, uint32_t layer, const uint32_t *experts,
                    const uint32_t *counts, uint32_t n_groups, const float *X, float *Y)
{
    struct backend_cuda *c = b->impl;
    if (c->failed)
        return -EIO;
    const struct cb_layer *L = NULL;
    for (uint32_t i = 0; i < c->n_flayers && !L; i++)
        L = c->flayer_of[i] == layer ? &c->flayers[i] : NULL;
    if (!L)
        return -EINVAL;
    const struct arch_layer *ly = L->ly;
    const size_t n = c->hp->n_embd, F = c->hp->n_ff_exp;
    uint32_t P = 0;
    for (uint32_t g = 0; g < n_groups; g++)
        for (uint32_t r = 0; r < counts[g]; r++)
            c->h_fids[P++] = (int32_t)experts[g];
    int rc = CUDA_CHECK(cudaMemcpyAsync(c->fids, c->h_fids, P * sizeof(int32_t),
                                        cudaMemcpyHostToDevice, c->stream));
    rc = rc ? rc : CUDA_CHECK(cudaMemcpyAsync(c->fx, X, P * n * sizeof(float),
                                              cudaMemcpyHostToDevice, c->stream));
    if (!rc && (!ly->gate_exps.data || L->gu_fused)) {
        const struct arch_matrix *g = ly->gate_exps.data ? &ly->gate_exps : &ly->gate_up_exps;
        rc = cb_foreign_mm(c, g, L->tab_gate, 2 * F, n, P, c->fx, n, c->fgu, 2 * F);
    } else if (!rc) {
        rc = cb_foreign_mm(c, &ly->gate_exps, L->tab_gate, F, n, P, c->fx, n, c->fgu, 2 * F);
        rc = rc ? rc : cb_foreign_mm(c, &ly->up_exps, L->tab_up, F, n, P, c->fx, n,
                                     c->fgu + F, 2 * F);
    }
    rc = rc ? rc : cuda_silu_mul(c->fgu, (uint32_t)F, P, c->fact, c->stream);
    rc = rc ? rc : cb_foreign_mm(c, &ly->down_exps, L->tab_down, n, F, P, c->fact, F, c->fy, n);
    rc = rc ? rc : CUDA_CHECK(cudaMemcpyAsync(Y, c->fy, P * n * sizeof(float),
                                              cudaMemcpyDeviceToHost, c->stream));
    rc = rc ? rc : CUDA_CHECK(cudaStreamSynchronize(c->stream));
    c->failed = rc == -EIO;
    return rc;
}

/* Page-locked host memory for what the caller gets back (backend_host_alloc): the head's
 * logits are copied straight into it, not through the driver's staging buffer. NULL where
 * pinning fails (logged at debug level: the caller falls back to malloc). */
static void *cb_host_buf(struct backend *b, size_t bytes)
{
    (void)b;
    void *p = NULL;
    const cudaError_t e = cudaMallocHost(&p, bytes);
    if (e != cudaSuccess) {
        log_debug("no page-locked host buffer of %.1f MiB (%s): plain memory instead",
                  bytes / 1048576.0, cudaGetErrorString(e));
        cudaGetLastError();
        return NULL;
    }
    return p;
}

static void cb_host_buf_free(struct backend *b, void *p)
{
    (void)b;
    CUDA_CHECK(cudaFreeHost(p));
}

const struct backend_ops backend_cuda_ops = {
    .name = "cuda",
    .init = cb_init,
    .fini = cb_fini,
    .use_seq = cb_use_seq,
    .reset = cb_reset,
    .layers = cb_layers,
    .logits = cb_logits,
    .argmax = cb_argmax,
    .stats = cb_stats,
    .serve = cb_serve,
    .layers_head = cb_layers_head,
    .pos = cb_pos,
    .state_save = cb_state_save,
    .state_load = cb_state_load,
    .host_alloc = cb_host_buf,
    .host_free = cb_host_buf_free,
};

#endif /* LAMINA_CUDA */
