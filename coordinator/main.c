/*
 * lamina: the coordinator process and the command line.
 *
 *   lamina run -m FILE (-p TEXT | -f FILE | --prompt-ids 1,2,3) [-n N] [sampler] ...
 *   lamina tokenize -m FILE (-p TEXT | -f FILE) [--ids] [--no-special]
 *   lamina inspect FILE
 *   lamina gen-model --arch A --shape S [--layers N] --type T [--heat zipf:S] [--seed N] -o FILE
 *
 * main() owns the process-wide state: it parses one config per command,
 * validates it once, and hands it to the module that does the work.
 */
#include <errno.h>
#include <limits.h>
#include <signal.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "common/log.h"
#include "coordinator/bench.h"
#include "coordinator/generate.h"
#include "coordinator/perplexity.h"
#include "coordinator/planner.h"
#include "model/gguf.h"
#include "model/inspect.h"
#include "model/synth.h"
#include "model/tokenizer.h"

#define LAMINA_VERSION "0.1.0"

static const char usage[] =
    "usage: lamina COMMAND [options]\n"
    "\n"
    "commands:\n"
    "  run        generate text from a prompt\n"
    "  tokenize   print the tokens of a text\n"
    "  inspect    print a GGUF file's architecture, hyper-parameters and tensors\n"
    "  gen-model  write a synthetic model of a real architecture and shape\n"
    "  bench      prompt and generation throughput (llama-bench's job)\n"
    "  perplexity measure perplexity on a text file (llama-perplexity's method)\n"
    "  plan       print the placement plan for devices and budgets (reads no weights)\n"
    "\n"
    "lamina run -m FILE (-p TEXT | -f FILE | --prompt-ids 1,2,3) [options]\n"
    "  -n, --n-predict N       tokens to generate (default 128)\n"
    "  -t, --threads N         compute threads (default: physical cores)\n"
    "  -c, --ctx N             context size (default: min(model's, 4096))\n"
    "  -b, --batch N           prefill tokens per pass (default 256)\n"
    "  --kv-type f16|f32       KV cache type (default f16)\n"
    "  --temp X                temperature (default 0.8; 0 = greedy)\n"
    "  --greedy                same as --temp 0\n"
    "  --top-k N               (default 40; 0 = off)\n"
    "  --top-p X               (default 0.95; 1 = off)\n"
    "  --min-p X               (default 0.05; 0 = off)\n"
    "  --repeat-penalty X      (default 1.0 = off)\n"
    "  --presence-penalty X    (default 0.0 = off)\n"
    "  --repeat-last-n N       tokens the penalties look back (default 64)\n"
    "  --seed N                sampler seed (default 42)\n"
    "  --ignore-eos            keep generating past end-of-generation tokens\n"
    "  --no-special            do not turn special-token texts in the prompt into their ids\n"
    "  --no-echo               do not print the prompt\n"
    "  --dump-logits OUT.npy   write float32 logits of every prompt position\n"
    "  --record-heat OUT.json  count the router's picks per layer and expert (with --inproc)\n"
    "                          and write them as a heat file for --heat\n"
    "  --prompt-cache FILE     keep the state after the prompt in FILE; a later prompt that\n"
    "                          starts with the same tokens continues from it (llama.cpp's)\n"
    "  --prompt-cache-ro       use the prompt cache but do not update it\n"
    "  --backend cuda:N|cpu    with --inproc: run every layer on this worker backend\n"
    "  --devices LIST          one worker per entry, e.g. cpu,cpu or cuda:0,cuda:1\n"
    "                          (default: cpu); GPUs are numbered in PCI bus order\n"
    "  --gpus LIST             same as --devices cuda:LIST, e.g. --gpus 0,1\n"
    "  --inproc                run every layer in this process (no workers)\n"
    "  --layers auto|LIST      layer ranges per worker, e.g. 0-19,20-39 (default auto)\n"
    "  --resident SPEC         without a placement plan: experts each worker holds: all,\n"
    "                          none, fit or P%% (default all); the rest run on the\n"
    "                          coordinator's CPU pool\n"
    "  --place SPEC            placement plan: auto (default when --device-mem is given),\n"
    "                          off, or a list like lmhead=0,dnproj=0:0-19,experts=all\n"
    "  --heat FILE             expert heat profile (heat.json) for the plan\n"
    "  --experts-home range|any  routed experts only on the worker that owns their layer\n"
    "                          (default), or also in other workers' room left, served to\n"
    "                          the owner through the coordinator (needs a placement plan)\n"
    "  --device-mem SIZE[,..]  memory budget per worker, e.g. 6G or 512M,1G\n"
    "  --timings FILE          JSON lines of per-worker, per-step stage timings\n"
    "  --listen tcp://H:P      bind on TCP with CURVE and wait for lamina-worker processes\n"
    "  --worker-threads N      compute threads per worker (default: cores / workers)\n"
    "  --hang-timeout S        a worker making no progress for S seconds has failed (30)\n"
    "  --handoff zmq|nccl|auto hidden states between consecutive workers: ZeroMQ (default),\n"
    "                          NCCL between workers on different CUDA devices of this host\n"
    "                          (refused where there are none), or auto: NCCL where it can\n"
    "  --sample-on worker|coordinator  where a step's token is picked when no logits are\n"
    "                          needed here: the last worker sends only the token (default)\n"
    "                          or its logits (the same text either way)\n"
    "\n"
    "lamina tokenize -m FILE (-p TEXT | -f FILE) [--ids] [--no-special]\n"
    "lamina inspect FILE\n"
    "lamina bench -m FILE [-p 512] [-n 128] [-d 0] [-r 5] [--threads N] [--json] [--no-membw]\n"
    "             [--inproc [--backend cuda:N] | --devices LIST ...: the worker options of run]\n"
    "             [--parallel N [--dump-tokens FILE]] [--seed N]\n"
    "  -d, --n-depth N         each test starts with N random tokens already in the context\n"
    "                          (their prefill not timed; llama-bench's -d): \"tg128 @ d4096\"\n"
    "  --parallel N            N sequences (1..64) in flight through the workers at once: each\n"
    "                          prefills -p random ids (its own: seed + its index), then\n"
    "                          generates -n tokens greedily; total and per-sequence tok/s\n"
    "  --dump-tokens FILE      with --parallel: each sequence's tokens of the last rep\n"
    "  --seed N                seed of the random ids (default 1234)\n"
    "lamina perplexity -m FILE -f TEXT [-c 512] [--chunks N] [--threads N] [--record-heat OUT.json]\n"
    "lamina gen-model --arch qwen3moe|qwen3next|qwen35moe --shape tiny|30b-a3b|35b-a3b|80b-a3b\n"
    "                 [--layers N] --type T [--heat zipf:S] [--seed N] [--threads N] -o FILE\n"
    "  --type T                f32, f16, bf16, q8_0, q4_0, q4_1, q5_0, q5_1, q4_k, q5_k, q6_k,\n"
    "                          or q4_k_m, q5_k_m: llama-quantize's mixtures (Q6_K lm head, and\n"
    "                          value-like and ffn_down matrices in about half of the layers)\n"
    "lamina plan -m FILE --device-mem SIZE[,..] [--devices LIST] [--heat FILE] [--place SPEC]\n"
    "            [--layers auto|LIST] [-c N] [--kv-type f16|f32] [-b N] [--margin PCT]\n"
    "            [--device-bw GB/s[,..]] [--path-bw GB/s[,..]] [--host-bw GB/s]\n"
    "            [--dense-miss] [--explain] [--each-expert] [--probe auto|off|FIGURES]\n"
    "            [--experts-home range|any]\n"
    "  --place auto|off|LIST   e.g. lmhead=0,dnproj=0:0-19+1:20-39,experts=all (pieces: lmhead,\n"
    "                          attn, dnproj, proj, shexp, experts; targets: all, none, auto,\n"
    "                          DEV or DEV:N-M joined by +; see coordinator/planner.h)\n"
    "  --heat FILE             per-layer expert routing counts (JSON, like heat.json)\n"
    "  --device-bw, --path-bw  each device's memory and host-path read bandwidth (default:\n"
    "                          the host's, measured unless --host-bw is given)\n"
    "  --explain               print the [place] line of every decision before the table\n"
    "\n"
    "environment: LAMINA_LOG=error|warn|info|debug (default info)\n";

struct cli {
    int argc;
    char **argv;
    int i;            /* next argument */
    const char *cmd;  /* command name, for messages */
};

static int cli_fail(const struct cli *c, const char *fmt, const char *arg)
{
    fprintf(stderr, "lamina %s: ", c->cmd);
    fprintf(stderr, fmt, arg);
    fprintf(stderr, "\n(run 'lamina --help' for usage)\n");
    return -EINVAL;
}

/* The value after option argv[i-1]. */
static int cli_value(struct cli *c, const char **out)
{
    if (c->i >= c->argc)
        return cli_fail(c, "option %s needs a value", c->argv[c->i - 1]);
    *out = c->argv[c->i++];
    return 0;
}

static int cli_long(struct cli *c, long long lo, long long hi, long long *out)
{
    const char *v;
    if (cli_value(c, &v))
        return -EINVAL;
    char *end;
    errno = 0;
    long long x = strtoll(v, &end, 10);
    if (errno || end == v || *end || x < lo || x > hi)
        return cli_fail(c, "bad integer value '%s'", v);
    *out = x;
    return 0;
}

static int cli_int(struct cli *c, long long lo, long long hi, int *out)
{
    long long x;
    if (cli_long(c, lo, hi, &x))
        return -EINVAL;
    *out = (int)x;
    return 0;
}

static int cli_float(struct cli *c, double lo, double hi, float *out)
{
    const char *v;
    if (cli_value(c, &v))
        return -EINVAL;
    char *end;
    double x = strtod(v, &end);
    if (end == v || *end || !(x >= lo && x <= hi))
        return cli_fail(c, "bad number '%s'", v);
    *out = (float)x;
    return 0;
}

static char *cli_read_file(struct cli *c, const char *path)
{
    FILE *f = fopen(path, "rb");
    if (!f) {
        fprintf(stderr, "lamina %s: cannot read %s: %s\n", c->cmd, path, strerror(errno));
        return NULL;
    }
    size_t cap = 1 << 16, len = 0;
    char *buf = malloc(cap);
    size_t got;
    while (buf && (got = fread(buf + len, 1, cap - len - 1, f)) > 0) {
        len += got;
        if (cap - len - 1 == 0) {
            char *nb = realloc(buf, cap * 2);
            if (!nb) {
                free(buf);
                buf = NULL;
            }
            buf = nb;
            cap *= 2;
        }
    }
    fclose(f);
    if (buf)
        buf[len] = 0;
    return buf;
}

/* Parses "1,2,3" into a malloc'd id list. */
static int cli_parse_ids(struct cli *c, const char *s, int32_t **ids, uint32_t *n)
{
    size_t cap = 16;
    *ids = malloc(cap * sizeof(int32_t));
    *n = 0;
    while (*ids && *s) {
        char *end;
        errno = 0;
        long v = strtol(s, &end, 10);
        if (errno || end == s || v < 0 || v > INT32_MAX || (*end && *end != ','))
            return cli_fail(c, "bad --prompt-ids list near '%s'", s);
        if (*n == cap) {
            int32_t *p = realloc(*ids, (cap *= 2) * sizeof(int32_t));
            if (!p)
                return -ENOMEM;
            *ids = p;
        }
        (*ids)[(*n)++] = (int32_t)v;
        s = *end ? end + 1 : end;
    }
    return *ids ? 0 : -ENOMEM;
}

struct run_opts {
    struct generate_config g;
    struct cluster_config cl;
    char names[CLUSTER_MAX_WORKERS][16]; /* backend names of --devices */
    bool inproc;
    const char *prompt_file;
    char *prompt_buf;       /* owned: file contents */
    int32_t *ids;           /* owned: --prompt-ids */
};

/* "6G", "512M", "1048576" -> bytes. */
static int cli_size(const char *s, uint64_t *out)
{
    char *end;
    errno = 0;
    double v = strtod(s, &end);
    if (errno || end == s || v < 0)
        return -EINVAL;
    double mul = 1;
    if (*end == 'K' || *end == 'k')
        mul = 1024.0, end++;
    else if (*end == 'M' || *end == 'm')
        mul = 1048576.0, end++;
    else if (*end == 'G' || *end == 'g')
        mul = 1073741824.0, end++;
    else if (*end == 'T' || *end == 't')
        mul = 1099511627776.0, end++;
    if (*end == 'i' || *end == 'B')
        end += *end == 'i' && end[1] == 'B' ? 2 : 1;
    if (*end)
        return -EINVAL;
    *out = (uint64_t)(v * mul);
    return 0;
}

/* "cpu", "cuda", "cuda:N" (N < 64) name a device; "cuda" only in CUDA builds. */
static bool main_device_ok(const char *t)
{
    if (!strcmp(t, "cpu"))
        return true;
#ifdef LAMINA_CUDA
    if (!strcmp(t, "cuda"))
        return true;
    char *end;
    if (!strncmp(t, "cuda:", 5)) {
        long v = strtol(t + 5, &end, 10);
        return end != t + 5 && !*end && v >= 0 && v < 64;
    }
#endif
    return false;
}

static const char *main_device_name(const char *t, char *buf, size_t cap)
{
    snprintf(buf, cap, "%s", strcmp(t, "cuda") ? t : "cuda:0");
    return buf;
}

static int run_parse_cluster(struct cli *c, const char *a, struct run_opts *o, bool *hit)
{
    if (!strcmp(a, "--gpus")) { /* --gpus 0,1 is --devices cuda:0,cuda:1 */
        const char *v;
        if (cli_value(c, &v))
            return -EINVAL;
        int n = 0;
        for (const char *p = v; *p && n < CLUSTER_MAX_WORKERS; n++) {
            char *end;
            long g = strtol(p, &end, 10);
            if (end == p || g < 0 || g > 63 || (*end && *end != ','))
                return cli_fail(c, "bad --gpus list '%s' (e.g. 0,1)", v);
            snprintf(o->names[n], sizeof(o->names[n]), "cuda:%ld", g);
            if (!main_device_ok(o->names[n]))
                return cli_fail(c, "--gpus: CUDA is not available in this build (%s)", v);
            o->cl.backends[n] = o->names[n];
            p = *end ? end + 1 : end;
        }
        o->cl.n_workers = n;
        *hit = true;
        return n ? 0 : cli_fail(c, "empty --gpus list%s", "");
    }
    struct cluster_config *cl = &o->cl;
    const char *v;
    *hit = true;
    if (!strcmp(a, "--inproc"))
        return o->inproc = true, 0;
    if (!strcmp(a, "--devices") || !strcmp(a, "--device-mem")) {
        if (cli_value(c, &v))
            return -EINVAL;
        bool mem = !strcmp(a, "--device-mem");
        int n = 0;
        char *copy = strdup(v), *save = NULL;
        for (char *t = strtok_r(copy, ",", &save); t; t = strtok_r(NULL, ",", &save)) {
            if (n == CLUSTER_MAX_WORKERS) {
                free(copy);
                return cli_fail(c, "at most 64 devices, not '%s'", v);
            }
            int rc = 0; /* the messages name t, inside copy: freed after them */
            if (mem && cli_size(t, &cl->device_mem[n]))
                rc = cli_fail(c, "bad size '%s' (use e.g. 6G or 512M)", t);
            else if (!mem && !main_device_ok(t))
                rc = cli_fail(c, "device '%s' is not available in this build (use cpu, or "
                                 "cuda:N where built with CUDA)", t);
            if (rc) {
                free(copy);
                return rc;
            }
            if (!mem)
                cl->backends[n] = main_device_name(t, o->names[n], sizeof(o->names[n]));
            n++;
        }
        free(copy);
        if (!mem)
            cl->n_workers = n;
        else
            for (int i = n; i < CLUSTER_MAX_WORKERS; i++) /* one size for all */
                cl->device_mem[i] = n == 1 ? cl->device_mem[0] : 0;
        return n ? 0 : cli_fail(c, "empty list for %s", a);
    }
    if (!strcmp(a, "--layers"))
        return cli_value(c, &cl->layers);
    if (!strcmp(a, "--resident"))
        return cli_value(c, &cl->resident);
    if (!strcmp(a, "--place"))
        return cli_value(c, &cl->place);
    if (!strcmp(a, "--heat"))
        return cli_value(c, &cl->heat_path);
    if (!strcmp(a, "--experts-home")) {
        if (cli_value(c, &cl->experts_home))
            return -EINVAL;
        if (strcmp(cl->experts_home, "range") && strcmp(cl->experts_home, "any"))
            return cli_fail(c, "--experts-home '%s' must be range or any", cl->experts_home);
        return 0;
    }
    if (!strcmp(a, "--timings"))
        return cli_value(c, &cl->timings_path);
    if (!strcmp(a, "--listen")) {
        cl->spawn = false;
        return cli_value(c, &cl->listen);
    }
    if (!strcmp(a, "--worker-threads"))
        return cli_int(c, 1, 1024, &cl->worker_threads);
    if (!strcmp(a, "--handoff")) {
        if (cli_value(c, &cl->handoff))
            return -EINVAL;
        if (strcmp(cl->handoff, "zmq") && strcmp(cl->handoff, "nccl") &&
            strcmp(cl->handoff, "auto"))
            return cli_fail(c, "--handoff '%s' must be zmq, nccl or auto", cl->handoff);
        return 0;
    }
    if (!strcmp(a, "--sample-on")) {
        const char *where;
        if (cli_value(c, &where))
            return -EINVAL;
        if (strcmp(where, "worker") && strcmp(where, "coordinator"))
            return cli_fail(c, "--sample-on '%s' must be worker or coordinator", where);
        cl->coordinator_samples = !strcmp(where, "coordinator");
        return 0;
    }
    if (!strcmp(a, "--hang-timeout")) {
        float t;
        if (cli_float(c, 0.1, 86400, &t))
            return -EINVAL;
        cl->hang_timeout_s = t;
        return 0;
    }
    *hit = false;
    return 0;
}

/* Fills in the cluster defaults of a run or bench: one cpu worker, residency. */
static void main_cluster_defaults(struct run_opts *o)
{
    if (o->cl.n_workers == 0) {
        o->cl.n_workers = 1;
        o->cl.backends[0] = "cpu";
    }
    /* with budgets (or --place) the planner decides; else every expert is resident */
}

static int run_parse_sampler(struct cli *c, const char *a, struct sampler_config *s, bool *hit)
{
    *hit = true;
    long long seed;
    if (!strcmp(a, "--temp"))
        return cli_float(c, 0, 100, &s->temperature);
    if (!strcmp(a, "--greedy")) {
        s->temperature = 0;
        return 0;
    }
    if (!strcmp(a, "--top-k"))
        return cli_int(c, 0, INT32_MAX, &s->top_k);
    if (!strcmp(a, "--top-p"))
        return cli_float(c, 0, 1, &s->top_p);
    if (!strcmp(a, "--min-p"))
        return cli_float(c, 0, 1, &s->min_p);
    if (!strcmp(a, "--repeat-penalty"))
        return cli_float(c, 0, 100, &s->repeat_penalty);
    if (!strcmp(a, "--presence-penalty"))
        return cli_float(c, -100, 100, &s->presence_penalty);
    if (!strcmp(a, "--repeat-last-n"))
        return cli_int(c, 0, INT32_MAX, &s->penalty_last_n);
    if (!strcmp(a, "--seed")) {
        if (cli_long(c, 0, LLONG_MAX, &seed))
            return -EINVAL;
        s->seed = (uint64_t)seed;
        return 0;
    }
    *hit = false;
    return 0;
}

static int run_parse_one(struct cli *c, const char *a, struct run_opts *o)
{
    struct generate_config *g = &o->g;
    const char *v;
    int x;
    if (!strcmp(a, "-m") || !strcmp(a, "--model"))
        return cli_value(c, &g->model_path);
    if (!strcmp(a, "-p") || !strcmp(a, "--prompt"))
        return cli_value(c, &g->prompt);
    if (!strcmp(a, "-f") || !strcmp(a, "--file"))
        return cli_value(c, &o->prompt_file);
    if (!strcmp(a, "--prompt-ids"))
        return cli_value(c, &v) ? -EINVAL : cli_parse_ids(c, v, &o->ids, &g->n_prompt_ids);
    if (!strcmp(a, "-n") || !strcmp(a, "--n-predict"))
        return cli_int(c, 0, INT32_MAX, &g->n_predict);
    if (!strcmp(a, "-t") || !strcmp(a, "--threads"))
        return cli_int(c, 1, 1024, &g->n_threads);
    if (!strcmp(a, "-c") || !strcmp(a, "--ctx"))
        return cli_int(c, 1, 1 << 24, &x) ? -EINVAL : (g->n_ctx = (uint32_t)x, 0);
    if (!strcmp(a, "-b") || !strcmp(a, "--batch"))
        return cli_int(c, 1, 65536, &x) ? -EINVAL : (g->n_batch = (uint32_t)x, 0);
    if (!strcmp(a, "--kv-type")) {
        if (cli_value(c, &v))
            return -EINVAL;
        if (strcmp(v, "f16") && strcmp(v, "f32"))
            return cli_fail(c, "--kv-type must be f16 or f32, not '%s'", v);
        g->kv_f16 = !strcmp(v, "f16");
        return 0;
    }
    if (!strcmp(a, "--ignore-eos"))
        return g->ignore_eos = true, 0;
    if (!strcmp(a, "--no-special"))
        return g->parse_special = false, 0;
    if (!strcmp(a, "--no-echo"))
        return g->echo_prompt = false, 0;
    if (!strcmp(a, "--dump-logits"))
        return cli_value(c, &g->dump_logits);
    if (!strcmp(a, "--record-heat"))
        return cli_value(c, &g->record_heat);
    if (!strcmp(a, "--prompt-cache"))
        return cli_value(c, &g->prompt_cache);
    if (!strcmp(a, "--prompt-cache-ro"))
        return g->prompt_cache_ro = true, 0;
    if (!strcmp(a, "--backend"))
        return cli_value(c, &g->backend);
    bool hit;
    int rc = run_parse_sampler(c, a, &g->sampler, &hit);
    if (!hit)
        rc = run_parse_cluster(c, a, o, &hit);
    return hit ? rc : cli_fail(c, "unknown option %s", a);
}

/* The live cluster, for the signal handler (the one mutable global, here in main.c). */
static struct cluster *volatile main_cluster;

static void main_on_signal(int sig)
{
    (void)sig;
    struct cluster *c = main_cluster;
    if (c) {
        cluster_interrupt(c); /* the step loop ends, then everything is cleaned up */
        return;
    }
    signal(sig, SIG_DFL); /* nothing to clean up yet (a half-made segment is removed as stale) */
    raise(sig);
}

static void run_on_cluster(struct cluster *c)
{
    main_cluster = c;
}

static void main_install_signals(void)
{
    struct sigaction sa = {0};
    sa.sa_handler = main_on_signal;
    sigemptyset(&sa.sa_mask);
    sigaction(SIGINT, &sa, NULL);
    sigaction(SIGTERM, &sa, NULL);
    signal(SIGPIPE, SIG_IGN);
}

static int cmd_run(struct cli *c)
{
    main_install_signals();
    struct run_opts o = {.cl = {.spawn = true},.g = {.n_predict = 128, .kv_f16 = true, .parse_special = true,
                               .echo_prompt = true, .out = stdout,
                               .sampler = {.temperature = 0.8f, .top_k = 40, .top_p = 0.95f,
                                           .min_p = 0.05f, .repeat_penalty = 1.0f,
                                           .penalty_last_n = 64, .seed = 42}}};
    int rc = 0;
    while (c->i < c->argc && !rc)
        rc = run_parse_one(c, c->argv[c->i++], &o);
    int sources = !!o.g.prompt + !!o.prompt_file + !!o.ids;
    if (!rc && !o.g.model_path)
        rc = cli_fail(c, "%s", "no model: give -m FILE");
    if (!rc && sources != 1)
        rc = cli_fail(c, "%s", "give exactly one of -p TEXT, -f FILE, --prompt-ids LIST");
    if (!rc && o.prompt_file) {
        o.prompt_buf = cli_read_file(c, o.prompt_file);
        o.g.prompt = o.prompt_buf;
        rc = o.prompt_buf ? 0 : -EIO;
    }
    o.g.prompt_ids = o.ids;
    if (!rc && o.inproc && o.cl.experts_home && !strcmp(o.cl.experts_home, "any"))
        rc = cli_fail(c, "%s", "--experts-home any places experts on other workers: it has no "
                      "--inproc form (use --devices)");
    if (!rc && o.g.prompt_cache_ro && !o.g.prompt_cache)
        rc = cli_fail(c, "%s", "--prompt-cache-ro needs --prompt-cache FILE");
    if (!rc && o.g.prompt_cache && o.g.dump_logits)
        rc = cli_fail(c, "%s", "--dump-logits writes every prompt position's logits, which a "
                      "prompt cache does not keep: use one or the other");
    if (!rc && o.g.backend && !o.inproc)
        rc = cli_fail(c, "%s", "--backend runs every layer in this process: give --inproc "
                      "(workers take --devices)");
    if (!o.inproc) {
        main_cluster_defaults(&o);
        o.g.cluster = &o.cl;
        o.g.on_cluster = run_on_cluster;
    }
    struct generate_stats st;
    if (!rc)
        rc = generate_run(&o.g, &st);
    if (!rc)
        fprintf(stderr,
                "[stats] load %.2f s | prompt %u tok (%u cached), %.1f tok/s | generation %u "
                "tok, %.1f tok/s | peak RSS %.1f MiB\n",
                st.load_s, st.n_prompt, st.n_cached,
                st.prompt_s > 0 ? (st.n_prompt - st.n_cached) / st.prompt_s : 0.0,
                st.n_gen, st.gen_s > 0 ? st.n_gen / st.gen_s : 0.0, st.peak_rss_kb / 1024.0);
    free(o.prompt_buf);
    free(o.ids);
    return rc;
}

static int cmd_tokenize(struct cli *c)
{
    const char *model = NULL, *text = NULL, *file = NULL;
    bool ids_only = false, special = true;
    int rc = 0;
    while (c->i < c->argc && !rc) {
        const char *a = c->argv[c->i++];
        if (!strcmp(a, "-m") || !strcmp(a, "--model"))
            rc = cli_value(c, &model);
        else if (!strcmp(a, "-p") || !strcmp(a, "--prompt"))
            rc = cli_value(c, &text);
        else if (!strcmp(a, "-f") || !strcmp(a, "--file"))
            rc = cli_value(c, &file);
        else if (!strcmp(a, "--ids"))
            ids_only = true;
        else if (!strcmp(a, "--no-special"))
            special = false;
        else
            rc = cli_fail(c, "unknown option %s", a);
    }
    if (!rc && (!model || !!text + !!file != 1))
        rc = cli_fail(c, "%s", "give -m FILE and exactly one of -p TEXT, -f FILE");
    if (rc)
        return rc;
    char *buf = file ? cli_read_file(c, file) : NULL;
    if (file && !buf)
        return -EIO;
    struct gguf_config gc = {.path = model};
    struct gguf *g = gguf_open(&gc);
    struct tokenizer_config tc = {.gguf = g};
    struct tokenizer *tok = g ? tokenizer_create(&tc) : NULL;
    int32_t *ids = NULL;
    size_t n = 0;
    const char *t = file ? buf : text;
    rc = tok ? tokenizer_encode(tok, t, strlen(t), special, &ids, &n) : -EINVAL;
    for (size_t i = 0; !rc && !ids_only && i < n; i++) {
        char piece[512];
        size_t len;
        tokenizer_token_bytes(tok, ids[i], piece, sizeof(piece), &len);
        printf("%6d -> '%.*s'\n", ids[i], (int)(len < sizeof(piece) ? len : sizeof(piece)), piece);
    }
    if (!rc && ids_only) {
        putchar('[');
        for (size_t i = 0; i < n; i++)
            printf("%s%d", i ? ", " : "", ids[i]);
        puts("]");
    }
    free(ids);
    tokenizer_destroy(tok);
    gguf_close(g);
    free(buf);
    return rc;
}

static int cmd_inspect(struct cli *c)
{
    if (c->i != c->argc - 1)
        return cli_fail(c, "%s", "give exactly one GGUF file");
    struct gguf_config gc = {.path = c->argv[c->i]};
    struct gguf *g = gguf_open(&gc);
    if (!g)
        return -EINVAL;
    int rc = inspect_print(g, stdout);
    gguf_close(g);
    return rc;
}

static int cmd_gen_model(struct cli *c)
{
    struct synth_report rep;
    struct synth_config sc = {.type = 0, .seed = 1, .progress = true, .heat_measure = true,
                              .report = &rep};
    const char *type = NULL, *heat = NULL;
    int rc = 0, x;
    long long seed;
    while (c->i < c->argc && !rc) {
        const char *a = c->argv[c->i++];
        if (!strcmp(a, "--arch"))
            rc = cli_value(c, &sc.arch);
        else if (!strcmp(a, "--shape"))
            rc = cli_value(c, &sc.shape);
        else if (!strcmp(a, "--layers"))
            rc = cli_int(c, 1, 4096, &x) ? -EINVAL : (sc.layers = (uint32_t)x, 0);
        else if (!strcmp(a, "--type"))
            rc = cli_value(c, &type);
        else if (!strcmp(a, "--heat"))
            rc = cli_value(c, &heat);
        else if (!strcmp(a, "--seed"))
            rc = cli_long(c, 0, LLONG_MAX, &seed) ? -EINVAL : (sc.seed = (uint64_t)seed, 0);
        else if (!strcmp(a, "--threads"))
            rc = cli_int(c, 1, 1024, &x) ? -EINVAL : (sc.threads = (uint32_t)x, 0);
        else if (!strcmp(a, "--exact"))
            sc.exact = true;
        else if (!strcmp(a, "-o") || !strcmp(a, "--output"))
            rc = cli_value(c, &sc.path);
        else
            rc = cli_fail(c, "unknown option %s", a);
    }
    if (!rc && (!sc.arch || !sc.shape || !type || !sc.path))
        rc = cli_fail(c, "%s", "give --arch, --shape, --type and -o FILE");
    if (!rc && synth_parse_type(type, &sc.type, &sc.k_m))
        rc = -EINVAL;
    if (!rc && heat && synth_parse_heat(heat, &sc.heat))
        rc = -EINVAL;
    if (!rc)
        rc = synth_write(&sc);
    if (rc)
        return rc;
    printf("wrote %s: %.1f MiB, %llu tensors, %.2f B parameters in %.1f s (%.0f MB/s)\n", sc.path,
           rep.bytes / 1048576.0, (unsigned long long)rep.n_tensors, rep.n_params / 1e9,
           rep.seconds, rep.mb_per_s);
    printf("expert popularity: %s\n", rep.heat.summary);
    return 0;
}

static int cmd_perplexity(struct cli *c)
{
    struct perplexity_config pc = {.n_ctx = 512, .print_chunks = true};
    int rc = 0, x;
    while (c->i < c->argc && !rc) {
        const char *a = c->argv[c->i++];
        if (!strcmp(a, "-m") || !strcmp(a, "--model"))
            rc = cli_value(c, &pc.model_path);
        else if (!strcmp(a, "-f") || !strcmp(a, "--file"))
            rc = cli_value(c, &pc.text_path);
        else if (!strcmp(a, "-c") || !strcmp(a, "--ctx"))
            rc = cli_int(c, 4, 1 << 20, &x) ? -EINVAL : (pc.n_ctx = (uint32_t)x, 0);
        else if (!strcmp(a, "--chunks"))
            rc = cli_int(c, 1, 1 << 30, &x) ? -EINVAL : (pc.max_chunks = (uint32_t)x, 0);
        else if (!strcmp(a, "-t") || !strcmp(a, "--threads"))
            rc = cli_int(c, 1, 1024, &pc.n_threads);
        else if (!strcmp(a, "--record-heat"))
            rc = cli_value(c, &pc.record_heat);
        else
            rc = cli_fail(c, "unknown option %s", a);
    }
    if (!rc && (!pc.model_path || !pc.text_path))
        rc = cli_fail(c, "%s", "give -m FILE and -f TEXT");
    struct perplexity_result r;
    rc = rc ? rc : perplexity_run(&pc, &r);
    if (!rc)
        printf("Final estimate: PPL = %.4f +/- %.4f (%u chunks of %u, %llu tokens scored, %.1f s)\n",
               r.ppl, r.ppl_err, r.n_chunks, pc.n_ctx, (unsigned long long)r.n_scored, r.seconds);
    return rc;
}

static void run_on_cluster(struct cluster *c);
static void main_install_signals(void);

static void run_on_cluster(struct cluster *c);
static void main_install_signals(void);

static int cmd_bench(struct cli *c)
{
    main_install_signals();
    struct bench_config bc = {.n_prompt = 512, .n_gen = 128, .reps = 5, .n_batch = 512,
                              .kv_f16 = true, .membw = true, .seed = 1234};
    struct run_opts o = {.cl = {.spawn = true}};
    bool hit;
    int rc = 0, x;
    long long seed;
    while (c->i < c->argc && !rc) {
        const char *a = c->argv[c->i++];
        if (!strcmp(a, "-m") || !strcmp(a, "--model"))
            rc = cli_value(c, &bc.model_path);
        else if (!strcmp(a, "-p") || !strcmp(a, "--n-prompt"))
            rc = cli_int(c, 0, 1 << 20, &x) ? -EINVAL : (bc.n_prompt = (uint32_t)x, 0);
        else if (!strcmp(a, "-n") || !strcmp(a, "--n-gen"))
            rc = cli_int(c, 0, 1 << 20, &x) ? -EINVAL : (bc.n_gen = (uint32_t)x, 0);
        else if (!strcmp(a, "-d") || !strcmp(a, "--n-depth"))
            rc = cli_int(c, 0, 1 << 20, &x) ? -EINVAL : (bc.n_depth = (uint32_t)x, 0);
        else if (!strcmp(a, "-r") || !strcmp(a, "--reps"))
            rc = cli_int(c, 1, 1000, &x) ? -EINVAL : (bc.reps = (uint32_t)x, 0);
        else if (!strcmp(a, "-b") || !strcmp(a, "--batch"))
            rc = cli_int(c, 1, 65536, &x) ? -EINVAL : (bc.n_batch = (uint32_t)x, 0);
        else if (!strcmp(a, "-t") || !strcmp(a, "--threads"))
            rc = cli_int(c, 1, 1024, &bc.n_threads);
        else if (!strcmp(a, "--json"))
            bc.json = true;
        else if (!strcmp(a, "--no-membw"))
            bc.membw = false;
        else if (!strcmp(a, "--backend"))
            rc = cli_value(c, &bc.backend);
        else if (!strcmp(a, "--parallel"))
            rc = cli_int(c, 1, CLUSTER_SEQ_MAX, &x) ? -EINVAL : (bc.parallel = (uint32_t)x, 0);
        else if (!strcmp(a, "--dump-tokens"))
            rc = cli_value(c, &bc.dump_tokens);
        else if (!strcmp(a, "--seed"))
            rc = cli_long(c, 0, LLONG_MAX, &seed) ? -EINVAL : (bc.seed = (uint64_t)seed, 0);
        else if ((rc = run_parse_cluster(c, a, &o, &hit)) == 0 && !hit)
            rc = cli_fail(c, "unknown option %s", a);
    }
    if (!rc && bc.backend && !o.inproc)
        rc = cli_fail(c, "%s", "--backend runs every layer in this process: add --inproc");
    if (!rc && o.inproc && o.cl.experts_home && !strcmp(o.cl.experts_home, "any"))
        rc = cli_fail(c, "%s", "--experts-home any places experts on other workers: it has no "
                      "--inproc form (use --devices)");
    if (!rc && bc.parallel && o.inproc)
        rc = cli_fail(c, "%s", "--parallel runs several sequences through the workers' "
                      "pipeline: it has no --inproc form (use --devices)");
    if (!rc && bc.n_depth && bc.parallel)
        rc = cli_fail(c, "%s", "-d (--n-depth) measures one sequence at a depth: it has no "
                      "--parallel form yet");
    if (!rc && bc.dump_tokens && !bc.parallel)
        rc = cli_fail(c, "%s", "--dump-tokens writes the tokens of --parallel sequences");
    if (!rc && bc.backend && !main_device_ok(bc.backend))
        rc = cli_fail(c, "backend '%s' is not available in this build", bc.backend);
    if (!rc && !o.inproc) {
        main_cluster_defaults(&o);
        bc.cluster = &o.cl;
        bc.on_cluster = run_on_cluster;
    }
    if (!rc && !bc.model_path)
        rc = cli_fail(c, "%s", "give -m FILE");
    if (!rc && bc.n_prompt == 0 && bc.n_gen == 0)
        rc = cli_fail(c, "%s", "nothing to measure: -p and -n are both 0");
    return rc ? rc : bench_run(&bc);
}

/* lamina plan: the placement plan from the GGUF header and small vectors only. */
static int cmd_plan(struct cli *c)
{
    struct planner_config pc = {.kv_f16 = true};
    const char *model = NULL, *devices = "cpu", *mems = NULL, *bws = NULL, *paths = NULL;
    const char *heat = NULL, *kv = "f16", *probe = NULL;
    bool explain = false, each = false;
    float f;
    int rc = 0, x;
    while (c->i < c->argc && !rc) {
        const char *a = c->argv[c->i++];
        if (!strcmp(a, "-m") || !strcmp(a, "--model"))
            rc = cli_value(c, &model);
        else if (!strcmp(a, "--devices"))
            rc = cli_value(c, &devices);
        else if (!strcmp(a, "--device-mem"))
            rc = cli_value(c, &mems);
        else if (!strcmp(a, "--device-bw"))
            rc = cli_value(c, &bws);
        else if (!strcmp(a, "--path-bw"))
            rc = cli_value(c, &paths);
        else if (!strcmp(a, "--host-bw"))
            rc = cli_float(c, 0.001, 1e6, &f) ? -EINVAL : (pc.host_bw = f * 1e9, 0);
        else if (!strcmp(a, "--heat"))
            rc = cli_value(c, &heat);
        else if (!strcmp(a, "--place"))
            rc = cli_value(c, &pc.place);
        else if (!strcmp(a, "--experts-home"))
            rc = cli_value(c, &pc.experts_home);
        else if (!strcmp(a, "--layers"))
            rc = cli_value(c, &pc.layers);
        else if (!strcmp(a, "-c") || !strcmp(a, "--ctx"))
            rc = cli_int(c, 1, 1 << 24, &x) ? -EINVAL : (pc.n_ctx = (uint32_t)x, 0);
        else if (!strcmp(a, "-b") || !strcmp(a, "--batch"))
            rc = cli_int(c, 1, 65536, &x) ? -EINVAL : (pc.max_batch = (uint32_t)x, 0);
        else if (!strcmp(a, "--kv-type"))
            rc = cli_value(c, &kv);
        else if (!strcmp(a, "--margin"))
            rc = cli_float(c, 0, 49, &f) ? -EINVAL
                                         : (pc.margin_frac = f > 0 ? f / 100.0 : -1.0, 0);
        else if (!strcmp(a, "--dense-miss"))
            pc.dense_miss_ratio = true;
        else if (!strcmp(a, "--probe"))
            rc = cli_value(c, &probe);
        else if (!strcmp(a, "--explain"))
            explain = true;
        else if (!strcmp(a, "--each-expert"))
            explain = each = true;
        else
            rc = cli_fail(c, "unknown option %s", a);
    }
    if (!rc && (!model || !mems))
        rc = cli_fail(c, "%s", "give -m FILE and --device-mem SIZE[,SIZE...]");
    if (!rc && strcmp(kv, "f16") && strcmp(kv, "f32"))
        rc = cli_fail(c, "--kv-type must be f16 or f32, not '%s'", kv);
    pc.kv_f16 = !strcmp(kv, "f16");
    char names[PLANNER_MAX_DEVICES][PLANNER_NAME_MAX];
    rc = rc ? rc : planner_parse_devices(&pc, names, devices, mems, bws, paths);
    struct gguf_config gc = {.path = model};
    struct gguf *g = rc ? NULL : gguf_open(&gc);
    struct arch_config ac = {.gguf = g};
    struct arch_model *m = g ? arch_load(&ac) : NULL;
    struct planner_heat *h = NULL;
    struct planner_plan *p = NULL;
    rc = rc ? rc : m ? 0 : -EINVAL;
    rc = rc || !heat ? rc : planner_heat_load(heat, &h);
    pc.model = m;
    if (!rc && probe) /* the devices' own speeds (cards of this host), figures, or "off" */
        rc = planner_probe_devices(&pc, probe, 0, true);
    else if (!rc && pc.host_bw == 0)
        pc.host_bw = planner_probe_host_bandwidth(0);
    pc.heat = h;
    rc = rc ? rc : planner_build(&pc, &p);
    if (!rc && explain)
        planner_print_decisions(p, stdout, each);
    if (!rc)
        planner_print_table(p, stdout);
    planner_plan_destroy(p);
    planner_heat_destroy(h);
    arch_free(m);
    gguf_close(g);
    return rc;
}

int main(int argc, char **argv)
{
    log_init("coord", -1);
    if (argc < 2 || !strcmp(argv[1], "-h") || !strcmp(argv[1], "--help") ||
        !strcmp(argv[1], "help")) {
        fputs(usage, argc < 2 ? stderr : stdout);
        return argc < 2 ? 2 : 0;
    }
    if (!strcmp(argv[1], "--version")) {
        puts("lamina " LAMINA_VERSION);
        return 0;
    }
    struct cli c = {.argc = argc, .argv = argv, .i = 2, .cmd = argv[1]};
    int rc;
    if (!strcmp(argv[1], "run"))
        rc = cmd_run(&c);
    else if (!strcmp(argv[1], "tokenize"))
        rc = cmd_tokenize(&c);
    else if (!strcmp(argv[1], "inspect"))
        rc = cmd_inspect(&c);
    else if (!strcmp(argv[1], "bench"))
        rc = cmd_bench(&c);
    else if (!strcmp(argv[1], "perplexity"))
        rc = cmd_perplexity(&c);
    else if (!strcmp(argv[1], "gen-model"))
        rc = cmd_gen_model(&c);
    else if (!strcmp(argv[1], "plan"))
        rc = cmd_plan(&c);
    else {
        fprintf(stderr, "lamina: unknown command '%s'\n\n%s", argv[1], usage);
        return 2;
    }
    return rc ? 1 : 0;
}
