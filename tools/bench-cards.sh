#!/bin/bash
# bench-cards: one card against two (issue 6's runs for docs/experiments.md). Each named run is
# one `lamina bench` with its own devices, budgets, layer split and hand-off, a timing dump
# (--timings) and its per-worker summary (tools/plot_timings.py). Prints one markdown table of
# prompt and generation tok/s (median and spread of REPS) and the summaries; leaves the dumps
# in OUT/NAME.jsonl and all of them packed in OUT/dumps.tar.gz (plot them where matplotlib is).
#
# usage: tools/bench-cards.sh MODEL.gguf [BIN_DIR]
# environment (defaults in brackets):
#   RUNS [every run below, in this order]  N_PROMPT [256]  N_GEN [64]  REPS [2]
#   PARALLEL [unset: N concurrent sequences in every run (lamina bench --parallel N)]
#   OUT [/tmp/lamina-bench-cards]  RUN_TIMEOUT [240] seconds per run
#   C0, C1 [cuda:0, cuda:1]: the two devices (cpu to try the flow without a GPU)
# Runs (name: devices, --device-mem, --layers, --handoff); "-" leaves the option out. A name
# ending in -any is the run without that suffix plus --experts-home any (two-8G-any,
# two-8G16G-any: a card's room left holds experts of the other card's layers):
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 2

run_args() {
    case $1 in
    one-unl) echo "$C0 - - -" ;;
    two-unl) echo "$C0,$C1 - - zmq" ;;
    two-unl-nccl) echo "$C0,$C1 - - nccl" ;;
    one-8G) echo "$C0 8G - -" ;;
    two-8G) echo "$C0,$C1 8G,8G - zmq" ;;
    two-8G-nccl) echo "$C0,$C1 8G,8G - nccl" ;;
    one-16G) echo "$C0 16G - -" ;;
    two-16G) echo "$C0,$C1 16G,16G - zmq" ;;
    two-8G16G) echo "$C0,$C1 8G,16G - zmq" ;;
    two-8G16G-split24) echo "$C0,$C1 8G,16G 0-23,24-47 zmq" ;;
    two-8G16G-split16) echo "$C0,$C1 8G,16G 0-15,16-47 zmq" ;;
    two-8G16G-split32) echo "$C0,$C1 8G,16G 0-31,32-47 zmq" ;;
    *) return 1 ;;
    esac
}
ALL="one-unl two-unl two-unl-nccl one-8G two-8G two-8G-nccl one-16G two-16G two-8G16G
two-8G16G-split24 two-8G16G-split16 two-8G16G-split32 two-8G-any two-8G16G-any"

MODEL=${1:-}
[ -n "$MODEL" ] && [ -f "$MODEL" ] || {
    echo "usage: tools/bench-cards.sh MODEL.gguf [BIN_DIR] (see the header)" >&2
    exit 2
}
BIN=${2:-$([ -x .devbin/lamina ] && echo .devbin || echo build)}
L=$BIN/lamina
[ -x "$L" ] && [ -x "$BIN/lamina-worker" ] || { echo "bench-cards: no lamina in $BIN" >&2; exit 2; }
RUNS=${RUNS:-$ALL}
N_PROMPT=${N_PROMPT:-256}
N_GEN=${N_GEN:-64}
REPS=${REPS:-2}
OUT=${OUT:-/tmp/lamina-bench-cards}
RUN_TIMEOUT=${RUN_TIMEOUT:-240}
C0=${C0:-cuda:0}
C1=${C1:-cuda:1}
mkdir -p "$OUT"
export NCCL_NVLS_ENABLE=0

field() { grep -o "\"$1\":[0-9.]*" "$2" | tail -1 | cut -d: -f2; }

table=$OUT/cards.md
{
    echo "| run | devices | budget | layers | hand-off | sequences | pp$N_PROMPT tok/s | tg$N_GEN tok/s (all sequences) | tg per sequence | load s |"
    echo "|---|---|---|---|---|---|---|---|---|---|"
} >"$table"
: >"$OUT/summaries.md"
for name in $RUNS; do
    base=$name par=${PARALLEL:-}
    if [[ $name =~ ^(.*)-p([0-9]+)$ ]]; then
        base=${BASH_REMATCH[1]} par=${BASH_REMATCH[2]}
    fi
    home=range
    if [[ $base =~ ^(.*)-any$ ]]; then
        base=${BASH_REMATCH[1]} home=any
    fi
    read -r dev mem layers handoff <<<"$(run_args "$base")" || {
        echo "bench-cards: unknown run $name" >&2
        continue
    }
    [ -n "$dev" ] || { echo "bench-cards: unknown run $name" >&2; continue; }
    args=(-m "$MODEL" -p "$N_PROMPT" -n "$N_GEN" -r "$REPS" --devices "$dev" --json --no-membw
        --timings "$OUT/$name.jsonl")
    [ "$mem" = - ] || args+=(--device-mem "$mem")
    [ "$layers" = - ] || args+=(--layers "$layers")
    [ "$handoff" = - ] || args+=(--handoff "$handoff")
    [ -z "$par" ] || args+=(--parallel "$par")
    [ "$home" = range ] || args+=(--experts-home "$home")
    rm -f "$OUT/$name.jsonl"
    t0=$(date +%s.%N)
    LAMINA_LOG=info timeout "$RUN_TIMEOUT" "$L" bench "${args[@]}" >"$OUT/$name.out" 2>"$OUT/$name.err"
    rc=$?
    t1=$(date +%s.%N)
    # load time: the first log line to the last worker's "loaded"
    load=$(awk '/ info: / && !s { split($1, a, ":"); s = a[1] * 3600 + a[2] * 60 + a[3] }
        / loaded: / { split($1, a, ":"); e = a[1] * 3600 + a[2] * 60 + a[3] }
        END { if (s && e) printf "%.1f", e - s; else printf "?" }' "$OUT/$name.err")
    if [ $rc -ne 0 ]; then
        why=$(grep -m2 "error" "$OUT/$name.err" | sed 's/.*error: //' | tr '\n' ' ')
        echo "| $name | $dev | $mem | $layers | $handoff | ${par:-1} | failed (rc $rc): $why | | | |" >>"$table"
    else
        pp=$(field pp_tps "$OUT/$name.out") pps=$(field pp_spread "$OUT/$name.out")
        tg=$(field tg_tps "$OUT/$name.out") tgs=$(field tg_spread "$OUT/$name.out")
        tq=$(field tg_seq_tps "$OUT/$name.out")
        echo "| $name | $dev | $mem | $layers | $handoff | ${par:-1} | $pp +- $pps | $tg +- $tgs | ${tq:-$tg} | $load |" >>"$table"
    fi
    {
        echo "#### $name ($(awk -v a="$t0" -v b="$t1" 'BEGIN { printf "%.0f", b - a }') s)"
        grep -h "\[place\] device [0-9]* ([^)]*): \(layers\|holds\)\|worker [0-9]*: layers\|hand-off worker\|worker [0-9]*: holds\|forwarded expert requests" "$OUT/$name.err" |
            sed 's/^.*info: //' | sort -u
        [ -s "$OUT/$name.jsonl" ] && python3 tools/plot_timings.py "$OUT/$name.jsonl" 2>&1
        echo
    } >>"$OUT/summaries.md"
    tail -n 1 "$table"
done
(cd "$OUT" && tar -czf dumps.tar.gz ./*.jsonl ./*.err 2>/dev/null)
cat "$table"
