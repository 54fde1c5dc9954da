#!/usr/bin/env python3
"""Plots and summarizes a lamina timing dump (`lamina run --timings FILE`).

The dump holds one JSON object per line per worker per step (docs/timings.md
describes every key). This script reads it, prints a per-worker summary table
(steps, tokens, milliseconds per stage, experts by path, bytes moved) and,
with -o, draws a PNG with two panels (the hand-off times, "handoff" and
"handoff_in", overlap the stages, so they are columns of the table only):

  (a) a timeline: one row per worker; each step is a segment as long as its
      "total" milliseconds, split by stage, laid end to end in the order the
      worker sent them, so the x axis is (approximately) wall-clock time from
      the worker's first step;
  (b) one stacked bar per worker of its total milliseconds per stage.

Time a step spent outside the named stages (norms, residual adds, the expert
combine, copies) is drawn as "other" = total - sum(stages) when positive.
Long dumps are drawn in groups of consecutive steps (at most --segments per
worker); the lengths along time stay exact.

Lines that are not JSON objects, or objects without a non-negative integer
"worker", are skipped and counted; missing or non-numeric values read as 0.
Exit status: 0 on success, 1 for a missing, unreadable or empty dump (or one
with no worker line), 2 for bad arguments or matplotlib missing when -o asks
for a plot.
"""

import argparse
import json
import math
import sys

STAGES = ["attn", "deltanet", "router", "experts_gpu", "experts_page_in",
          "experts_cpu_wait", "shared_expert", "send", "recv_wait"]
OTHER = "other"
PATHS = ["hit", "paged", "in_place", "cpu"]
BYTES = ["h2d", "nccl"]
# Hand-off to the next worker and NCCL receive from the previous one (ms): not stages, since
# they overlap them ("handoff" over ZeroMQ is the "send" stage; over NCCL it runs inside the
# layers' stream, as does "handoff_in").
HANDOFF = ["handoff", "handoff_in"]

# One fixed colour per stage so that figures compare across runs.
COLORS = {
    "attn": "#1f77b4", "deltanet": "#17becf", "router": "#9467bd",
    "experts_gpu": "#2ca02c", "experts_page_in": "#bcbd22",
    "experts_cpu_wait": "#d62728", "shared_expert": "#8c564b",
    "send": "#ff7f0e", "recv_wait": "#e0e0e0", OTHER: "#7f7f7f",
}


def num(obj, key):
    """obj[key] as a finite float >= 0, or 0.0 when missing or not such a number."""
    if not isinstance(obj, dict):
        return 0.0
    v = obj.get(key)
    if isinstance(v, bool) or not isinstance(v, (int, float)):
        return 0.0
    v = float(v)
    return v if math.isfinite(v) and v >= 0.0 else 0.0


class Worker:
    """Everything read about one worker: its steps in dump order and their sums."""

    def __init__(self, index):
        self.index = index
        self.device = "?"
        self.layers = None
        self.steps = []          # per step: dict stage -> ms (OTHER included), "total"
        self.tokens = 0
        self.ms = dict.fromkeys(STAGES + [OTHER, "total"], 0.0)
        self.experts = dict.fromkeys(PATHS, 0)
        self.bytes = dict.fromkeys(BYTES, 0)
        self.handoff = dict.fromkeys(HANDOFF, 0.0)
        self.via = "-"           # "nccl", "zmq" or "none" (last worker), as last reported

    def add(self, rec):
        if isinstance(rec.get("device"), str):
            self.device = rec["device"]
        if isinstance(rec.get("handoff_via"), str):
            self.via = rec["handoff_via"]
        lay = rec.get("layers")
        if (isinstance(lay, list) and len(lay) == 2 and
                all(isinstance(x, int) and not isinstance(x, bool) for x in lay)):
            self.layers = (lay[0], lay[1])
        self.tokens += int(num(rec, "tokens"))
        ms = rec.get("ms")
        step = {s: num(ms, s) for s in STAGES}
        named = sum(step.values())
        total = num(ms, "total")
        if total <= 0.0:
            total = named        # a line without "total": its stages are all we know
        step[OTHER] = max(total - named, 0.0)
        step["total"] = max(total, named)
        for k, v in step.items():
            self.ms[k] += v
        self.steps.append(step)
        for p in PATHS:
            self.experts[p] += int(num(rec.get("experts"), p))
        for b in BYTES:
            self.bytes[b] += int(num(rec.get("bytes"), b))
        for h in HANDOFF:
            self.handoff[h] += num(ms, h)

    def label(self):
        lay = "" if self.layers is None else " L%d-%d" % (self.layers[0], self.layers[1] - 1)
        return "w%d %s%s" % (self.index, self.device, lay)


def read_dump(path):
    """Returns (workers sorted by index, counts dict). Raises OSError."""
    workers = {}
    counts = {"lines": 0, "blank": 0, "unparsable": 0, "not_worker": 0, "records": 0}
    with open(path, "r", encoding="utf-8", errors="replace") as f:
        for line in f:
            counts["lines"] += 1
            line = line.strip()
            if not line:
                counts["blank"] += 1
                continue
            try:
                rec = json.loads(line)
            except ValueError:
                counts["unparsable"] += 1
                continue
            if not isinstance(rec, dict):
                counts["unparsable"] += 1
                continue
            w = rec.get("worker")
            if "worker" not in rec:
                counts["not_worker"] += 1    # e.g. the coordinator's own lines
                continue
            if isinstance(w, bool) or not isinstance(w, int) or w < 0 or w > 1 << 20:
                counts["unparsable"] += 1
                continue
            workers.setdefault(w, Worker(w)).add(rec)
            counts["records"] += 1
    return [workers[k] for k in sorted(workers)], counts


def print_summary(workers, counts, out):
    """Prints the per-worker table (Markdown, like `lamina run`'s own summary)."""
    short = {"experts_gpu": "experts", "experts_page_in": "page in",
             "experts_cpu_wait": "cpu wait", "shared_expert": "shared",
             "recv_wait": "recv wait"}
    cols = ["worker", "device", "layers", "steps", "tokens", "total ms"]
    cols += [short.get(s, s) for s in STAGES] + [OTHER]
    cols += ["experts hit/paged/in_place/cpu", "h2d MiB", "nccl MiB"]
    cols += ["handoff via", "handoff ms", "handoff in ms"]
    text = (0, 1, 2, len(cols) - 6, len(cols) - 3)
    out.write("| " + " | ".join(cols) + " |\n")
    out.write("|" + "|".join("---" if i in text else "---:"
                             for i in range(len(cols))) + "|\n")
    for w in workers:
        lay = "?" if w.layers is None else "%d-%d" % (w.layers[0], w.layers[1] - 1)
        row = [str(w.index), w.device, lay, str(len(w.steps)), str(w.tokens),
               "%.1f" % w.ms["total"]]
        row += ["%.1f" % w.ms[s] for s in STAGES + [OTHER]]
        row += ["/".join(str(w.experts[p]) for p in PATHS)]
        row += ["%.1f" % (w.bytes[b] / 1048576.0) for b in BYTES]
        row += [w.via] + ["%.1f" % w.handoff[h] for h in HANDOFF]
        out.write("| " + " | ".join(row) + " |\n")
    out.write("%d lines: %d worker records, %d other records, %d unparsable, %d blank\n" %
              (counts["lines"], counts["records"], counts["not_worker"],
               counts["unparsable"], counts["blank"]))


def grouped(steps, max_segments):
    """Consecutive steps summed into at most max_segments groups."""
    if len(steps) <= max_segments:
        return steps
    per = -(-len(steps) // max_segments)
    out = []
    for i in range(0, len(steps), per):
        g = {}
        for st in steps[i:i + per]:
            for k, v in st.items():
                g[k] = g.get(k, 0.0) + v
        out.append(g)
    return out


def plot(workers, path, title, max_segments):
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.patches import Patch

    stages = STAGES + [OTHER]
    n = len(workers)
    fig, (ax_t, ax_b) = plt.subplots(
        2, 1, figsize=(12, 2.2 + 0.9 * n + 3.5),
        gridspec_kw={"height_ratios": [0.6 + 0.6 * n, 3.0]})

    # (a) timeline
    most = 0
    for row, w in enumerate(workers):
        segs = grouped(w.steps, max_segments)
        most = max(most, len(segs))
        spans = {s: [] for s in stages}
        t = 0.0
        for seg in segs:
            x = t
            for s in stages:
                if seg[s] > 0.0:
                    spans[s].append((x, seg[s]))
                    x += seg[s]
            t += seg["total"]
        for s in stages:
            if spans[s]:
                ax_t.broken_barh(spans[s], (row - 0.4, 0.8), facecolors=COLORS[s],
                                 linewidth=0)
        # step (or group) boundaries as thin ticks, while they stay legible
        if len(segs) <= 60:
            t, edges = 0.0, []
            for seg in segs:
                t += seg["total"]
                edges.append(t)
            ax_t.vlines(edges, row - 0.4, row + 0.4, colors="black", linewidth=0.3)
    ax_t.set_yticks(range(n))
    ax_t.set_yticklabels([w.label() for w in workers])
    ax_t.set_ylim(n - 0.5, -0.5)
    ax_t.set_xlim(left=0.0)
    ax_t.set_xlabel("time from the worker's first step (ms, sum of step totals)")
    sub = "(a) timeline, one segment per step"
    if most > 0 and any(len(w.steps) > max_segments for w in workers):
        sub = "(a) timeline, consecutive steps grouped (%d segments per worker at most)" % (
            max_segments)
    ax_t.set_title(sub, fontsize=10, loc="left")
    ax_t.grid(axis="x", alpha=0.3)

    # (b) stacked totals
    xs = list(range(n))
    bottom = [0.0] * n
    for s in stages:
        vals = [w.ms[s] for w in workers]
        if not any(vals):
            continue
        ax_b.bar(xs, vals, bottom=bottom, color=COLORS[s], width=0.6, edgecolor="none")
        bottom = [b + v for b, v in zip(bottom, vals)]
    for x, w in zip(xs, workers):
        ax_b.annotate("%.1f ms\n%d steps, %d tok" % (w.ms["total"], len(w.steps), w.tokens),
                      (x, bottom[x]), ha="center", va="bottom", fontsize=8,
                      xytext=(0, 2), textcoords="offset points")
    ax_b.set_xticks(xs)
    ax_b.set_xticklabels([w.label() for w in workers])
    ax_b.set_ylabel("ms (all steps)")
    ax_b.set_ylim(0, max(bottom + [1e-3]) * 1.18)
    ax_b.set_title("(b) total time per stage", fontsize=10, loc="left")
    ax_b.grid(axis="y", alpha=0.3)

    handles = [Patch(facecolor=COLORS[s], label=s) for s in stages]
    fig.suptitle(title, y=0.995, fontsize=12)
    fig.legend(handles=handles, loc="upper center", ncol=10, fontsize=8.5, frameon=False,
               bbox_to_anchor=(0.5, 0.965), handlelength=1.2, columnspacing=1.0)
    fig.tight_layout(rect=(0, 0, 1, 0.93))
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv):
    ap = argparse.ArgumentParser(
        description="Summarize a lamina --timings dump and plot it per worker.")
    ap.add_argument("dump", help="JSON-lines file written by lamina run --timings")
    ap.add_argument("-o", "--output", help="PNG to write (without it: summary only)")
    ap.add_argument("--title", help="figure title (default: the dump's file name)")
    ap.add_argument("--segments", type=int, default=200,
                    help="most timeline segments per worker before steps are grouped "
                         "(default 200, a few pixels each)")
    args = ap.parse_args(argv)
    if args.segments < 1:
        ap.error("--segments must be at least 1")

    try:
        workers, counts = read_dump(args.dump)
    except OSError as e:
        print("plot_timings: cannot read %s: %s" % (args.dump, e.strerror or e),
              file=sys.stderr)
        return 1
    if counts["lines"] == counts["blank"]:
        print("plot_timings: %s is empty (no timing lines)" % args.dump, file=sys.stderr)
        return 1
    if not workers:
        print("plot_timings: %s has no worker timing lines (%d lines: %d unparsable, "
              "%d without a \"worker\" key)" % (args.dump, counts["lines"],
                                                counts["unparsable"], counts["not_worker"]),
              file=sys.stderr)
        return 1
    print_summary(workers, counts, sys.stdout)
    if counts["unparsable"]:
        print("plot_timings: skipped %d unparsable line(s) in %s" %
              (counts["unparsable"], args.dump), file=sys.stderr)
    if not args.output:
        return 0
    try:
        import matplotlib  # noqa: F401
    except ImportError:
        print("plot_timings: python3-matplotlib missing (install it: sudo sh "
              "tools/install-deps.sh)", file=sys.stderr)
        return 2
    try:
        plot(workers, args.output, args.title or args.dump, args.segments)
    except OSError as e:
        print("plot_timings: cannot write %s: %s" % (args.output, e.strerror or e),
              file=sys.stderr)
        return 1
    print("wrote %s" % args.output)
    return 0


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
