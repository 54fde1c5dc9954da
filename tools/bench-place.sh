#!/bin/bash
# bench-place: generation speed of placement plans on one GPU under memory budgets (issue 5's
# benchmark for docs/perf.md). For each budget it runs `lamina bench` (generation only) with one
# CUDA worker and --device-mem BUDGET under these plans:
#   auto          --place auto (the planner decides; --heat when HEAT is given)
#   off           --place off (experts only, the same count in every layer)
#   trunk+auto    lmhead=0,proj=all,shexp=all,experts=auto: every trunk piece listed first, the
#                 room left to the experts by value (hottest first with a heat profile)
#   experts-only  lmhead=none,proj=none,shexp=none,experts=auto: the trunk stays in host memory
#   trunk-only    lmhead=0,proj=all,shexp=all,experts=none: like llama.cpp with every expert
#                 on the CPU
# and prints one markdown table of tg tok/s (median and spread of REPS), experts resident and
# trunk placed per plan, with auto's ratio to off and to the best list. The device's [probe]
# line of the auto run is printed too, and `lamina plan` with those figures writes the whole
# auto plan to OUT/plan-BUDGET.txt.
#
# When LLAMA_BENCH names an existing llama-bench binary (this script never downloads or builds
# llama.cpp), it also runs llama-bench -ngl 99 --n-cpu-moe N on the same file for a few N per
# budget: N_min, the fewest layers whose experts must stay on the CPU for the rest of the file
# plus LLAMA_OVERHEAD (KV and compute buffers, default 1.5 GiB) to fit the budget (sizes from
# `lamina inspect`), then N_min+2 and N_min+4. Each run's peak VRAM is sampled with nvidia-smi
# (less what was in use before it); runs over the budget are marked and not counted, and the
# best of the rest is reported.
#
# usage: tools/bench-place.sh MODEL.gguf [BIN_DIR]
#   BIN_DIR holds lamina and lamina-worker (default: .devbin if present, else build)
# environment (defaults in brackets):
#   BUDGETS ["6G 8G 16G"]  DEVICE [cuda:0]  N_GEN [128]  REPS [3]  HEAT [none]
#   OUT [/tmp/lamina-bench-place]  RUN_TIMEOUT [420] seconds per run  PLANS [all five, by name]
#   LLAMA_BENCH [unset]  LLAMA_OVERHEAD [1.5G]  LAMINA_PROBE [unset: probe; see planner.h]
# One lamina run copies every expert to /dev/shm and loads the model: on the 80b-a3b file that
# is tens of seconds, so one budget per call (BUDGETS=8G) fits a 10-minute device command.
set -u -o pipefail
cd "$(dirname "$0")/.." || exit 2

MODEL=${1:-}
[ -n "$MODEL" ] && [ -f "$MODEL" ] || {
    echo "usage: tools/bench-place.sh MODEL.gguf [BIN_DIR] (see the header)" >&2
    exit 2
}
BIN=${2:-$([ -x .devbin/lamina ] && echo .devbin || echo build)}
L=$BIN/lamina
[ -x "$L" ] && [ -x "$BIN/lamina-worker" ] || { echo "bench-place: no lamina in $BIN" >&2; exit 2; }
BUDGETS=${BUDGETS:-6G 8G 16G}
DEVICE=${DEVICE:-cuda:0}
N_GEN=${N_GEN:-128}
REPS=${REPS:-3}
HEAT=${HEAT:-}
OUT=${OUT:-/tmp/lamina-bench-place}
RUN_TIMEOUT=${RUN_TIMEOUT:-420}
PLANS=${PLANS:-auto off trunk+auto experts-only trunk-only}
mkdir -p "$OUT"

place_of() {
    case $1 in
    auto) echo auto ;;
    off) echo off ;;
    trunk+auto) echo "lmhead=0,proj=all,shexp=all,experts=auto" ;;
    experts-only) echo "lmhead=none,proj=none,shexp=none,experts=auto" ;;
    trunk-only) echo "lmhead=0,proj=all,shexp=all,experts=none" ;;
    *) return 1 ;;
    esac
}

# "6G" -> bytes (binary units, as lamina reads them).
bytes_of() {
    local v=${1%[KkMmGgTt]} u=${1: -1}
    case $u in
    K | k) awk -v v="$v" 'BEGIN { printf "%.0f", v * 1024 }' ;;
    M | m) awk -v v="$v" 'BEGIN { printf "%.0f", v * 1048576 }' ;;
    G | g) awk -v v="$v" 'BEGIN { printf "%.0f", v * 1073741824 }' ;;
    T | t) awk -v v="$v" 'BEGIN { printf "%.0f", v * 1099511627776 }' ;;
    *) echo "$1" ;;
    esac | sed 's/\..*//'
}

# One lamina bench run; prints "tps spread experts trunk_mib" or "error: WHY".
run_lamina() { # budget plan
    local log=$OUT/lamina-$1-$2 place
    place=$(place_of "$2") || { echo "error: unknown plan $2"; return; }
    LAMINA_LOG=info timeout -s KILL "$RUN_TIMEOUT" "$L" bench -m "$MODEL" -p 0 -n "$N_GEN" \
        -r "$REPS" --devices "$DEVICE" --device-mem "$1" --place "$place" \
        ${HEAT:+--heat "$HEAT"} --json --no-membw >"$log.out" 2>"$log.err"
    local rc=$?
    local tps spread experts trunk
    tps=$(grep -o '"tg_tps":[0-9.]*' "$log.out" | tail -1 | cut -d: -f2)
    spread=$(grep -o '"tg_spread":[0-9.]*' "$log.out" | tail -1 | cut -d: -f2)
    experts=$(grep -o 'worker 0: layers [0-9-]*, [0-9]* experts resident' "$log.err" | head -1 |
        awk '{print $5}')
    trunk=$(grep -o '[0-9.]* MiB trunk placed' "$log.err" | head -1 | awk '{print $1}')
    if [ $rc -ne 0 ] || [ -z "$tps" ]; then
        echo "error: rc $rc: $(grep -m1 ' error: ' "$log.err" | sed 's/.* error: //' | cut -c1-120)"
        return
    fi
    echo "$tps $spread ${experts:-?} ${trunk:-?}"
}

# Per-layer routed-expert bytes (layer 0's stacks), file bytes and layer count of the model.
model_sizes() {
    "$L" inspect "$MODEL" >"$OUT/inspect.txt" 2>&1 || return 1
    FILE_BYTES=$(head -1 "$OUT/inspect.txt" | grep -o '([0-9]* bytes)' | tr -dc 0-9)
    N_LAYER=$(grep -m1 '\.block_count ' "$OUT/inspect.txt" | awk '{print $3}')
    EXP_BYTES=$(awk '$2 ~ /^blk\.0\.ffn_(gate|up|down|gate_up)_exps\.weight$/ {s += $(NF-1)}
        END {print s + 0}' "$OUT/inspect.txt")
    [ -n "$FILE_BYTES" ] && [ -n "$N_LAYER" ] && [ "$EXP_BYTES" -gt 0 ]
}

ratio() { # numerator denominator decimals [scale]: scale * numerator / denominator
    awk -v a="$1" -v b="$2" -v d="$3" -v k="${4:-1}" 'BEGIN { printf ("%." d "f"), k * a / b }'
}

gpu_index() { echo "${DEVICE#cuda:}"; }

vram_used_mib() {
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i "$(gpu_index)" |
        head -1 | tr -dc 0-9
}

# One llama-bench run; prints "tps spread peak_mib" or "error: WHY".
run_llama() { # n_cpu_moe
    local log=$OUT/llama-ncmoe-$1 base
    base=$(vram_used_mib)
    nvidia-smi --query-gpu=memory.used --format=csv,noheader,nounits -i "$(gpu_index)" \
        -lms 200 >"$log.vram" 2>/dev/null &
    local smi=$!
    CUDA_VISIBLE_DEVICES=$(gpu_index) timeout -s KILL "$RUN_TIMEOUT" "$LLAMA_BENCH" -m "$MODEL" \
        -ngl 99 --n-cpu-moe "$1" -p 0 -n "$N_GEN" -r "$REPS" -o json >"$log.out" 2>"$log.err"
    local rc=$?
    kill "$smi" 2>/dev/null
    wait "$smi" 2>/dev/null
    local tps spread peak
    tps=$(grep -o '"avg_ts": [0-9.e+-]*' "$log.out" | tail -1 | awk '{print $2}')
    spread=$(grep -o '"stddev_ts": [0-9.e+-]*' "$log.out" | tail -1 | awk '{print $2}')
    peak=$(sort -n "$log.vram" | tail -1 | tr -dc 0-9)
    if [ $rc -ne 0 ] || [ -z "$tps" ]; then
        echo "error: rc $rc: $(tail -1 "$log.err" | cut -c1-120)"
        return
    fi
    echo "$tps ${spread:-0} $(( ${peak:-0} - ${base:-0} ))"
}

# llama-bench at one budget: a few N from the size estimate; appends the table rows to
# $OUT/llama-rows-BUDGET and sets LLAMA_BEST, LLAMA_BEST_N (call it outside a subshell).
llama_at() { # budget
    local b over nmin n res tps peak best="" bestn=""
    b=$(bytes_of "$1")
    over=$(bytes_of "${LLAMA_OVERHEAD:-1.5G}")
    nmin=$(( (FILE_BYTES + over - b + EXP_BYTES - 1) / EXP_BYTES ))
    [ $nmin -lt 0 ] && nmin=0
    [ $nmin -gt "$N_LAYER" ] && nmin=$N_LAYER
    local rows=$OUT/llama-rows-$1 spread over_budget
    : >"$rows"
    for n in $nmin $((nmin + 2)) $((nmin + 4)); do
        [ $n -gt "$N_LAYER" ] && continue
        res=$(run_llama $n)
        case $res in
        error:*) echo "| $1 | llama.cpp --n-cpu-moe $n | $res | | | |" >>"$rows" ;;
        *)
            read -r tps spread peak <<<"$res"
            over_budget=$(( peak * 1048576 > b ))
            echo "| $1 | llama.cpp --n-cpu-moe $n | $tps | $spread | | peak VRAM $peak MiB$(
                [ $over_budget = 1 ] && echo ', over the budget: not counted') |" >>"$rows"
            if [ $over_budget = 0 ] && { [ -z "$best" ] ||
                awk -v a="$tps" -v b="$best" 'BEGIN { exit !(a > b) }'; }; then
                best=$tps; bestn=$n
            fi
            ;;
        esac
    done
    LLAMA_BEST=$best
    LLAMA_BEST_N=$bestn
}

# The auto plan's table with the figures the auto run measured.
plan_table() { # budget
    local err=$OUT/lamina-$1-auto.err bw path host
    host=$(grep -o "\[probe\] device cpu: gemv [0-9.]*" "$err" | head -1 | awk '{print $NF}')
    bw=$(grep -o "\[probe\] device $DEVICE: gemv [0-9.]*" "$err" | head -1 | awk '{print $NF}')
    path=$(grep -o "\[probe\] device $DEVICE: gemv [0-9.]* GB/s, h2d [0-9.]*" "$err" | head -1 |
        awk '{print $NF}')
    "$L" plan -m "$MODEL" --devices "$DEVICE" --device-mem "$1" --dense-miss --explain \
        -c $((N_GEN + 1)) -b 512 \
        ${bw:+--device-bw "$bw"} ${path:+--path-bw "$path"} ${host:+--host-bw "$host"} \
        ${HEAT:+--heat "$HEAT"} \
        >"$OUT/plan-$1.txt" 2>&1
}

main() {
    local rows="" summary="" b p res
    if [ -n "${LLAMA_BENCH:-}" ] && ! [ -x "$LLAMA_BENCH" ]; then
        echo "bench-place: LLAMA_BENCH=$LLAMA_BENCH is not an executable: skipping llama.cpp"
        LLAMA_BENCH=""
    fi
    if [ -n "${LLAMA_BENCH:-}" ] && ! model_sizes; then
        echo "bench-place: cannot read the model's sizes: skipping llama.cpp"
        LLAMA_BENCH=""
    fi
    for b in $BUDGETS; do
        local auto="" off="" best_list="" best_name=""
        for p in $PLANS; do
            res=$(run_lamina "$b" "$p")
            case $res in
            error:*) rows+="| $b | $p | $res | | | |"$'\n' ;;
            *)
                local tps spread experts trunk
                read -r tps spread experts trunk <<<"$res"
                rows+="| $b | $p | $tps | $spread | $experts | $trunk |"$'\n'
                case $p in
                auto) auto=$tps ;;
                off) off=$tps ;;
                *)
                    if [ -z "$best_list" ] || awk -v a="$tps" -v b="$best_list" 'BEGIN { exit !(a > b) }'; then
                        best_list=$tps; best_name=$p
                    fi
                    ;;
                esac
                ;;
            esac
            [ "$p" = auto ] && grep -o '\[probe\].*' "$OUT/lamina-$b-auto.err" | sed 's/^/    /'
        done
        [ -f "$OUT/lamina-$b-auto.err" ] && plan_table "$b"
        local line="$b: auto ${auto:-?} tok/s"
        [ -n "$auto" ] && [ -n "$off" ] && line+=", $(ratio "$auto" "$off" 2)x off"
        [ -n "$auto" ] && [ -n "$best_list" ] &&
            line+=", $(ratio "$auto" "$best_list" 1 100)% of the best list ($best_name)"
        if [ -n "${LLAMA_BENCH:-}" ]; then
            llama_at "$b"
            rows+=$(cat "$OUT/llama-rows-$b")$'\n'
            [ -n "$LLAMA_BEST" ] && [ -n "$auto" ] &&
                line+=", llama.cpp best $LLAMA_BEST tok/s (--n-cpu-moe $LLAMA_BEST_N): auto at $(
                    ratio "$auto" "$LLAMA_BEST" 2)x"
        fi
        summary+="$line"$'\n'
    done
    echo
    echo "model $(basename "$MODEL"), device $DEVICE, tg$N_GEN, median of $REPS${HEAT:+, heat $HEAT}"
    echo
    echo "| budget | plan | tg tok/s | +- | experts resident | trunk placed MiB |"
    echo "|---|---|---:|---:|---:|---:|"
    printf '%s' "$rows"
    echo
    printf '%s' "$summary"
    echo "logs and plans: $OUT"
}

main | tee "$OUT/bench-place.md"
