#!/bin/sh
# sys_experts_any: --experts-home any on two CPU workers with budgets where worker 1 has room
# to spare (coordinator/planner.h step 5). For a gen-model tiny qwen3next and qwen3moe:
#   1. logits (--dump-logits) and text byte-identical between --inproc, --experts-home range
#      and --experts-home any; worker 1 holds foreign experts and serves forwarded requests
#      (counted in the timing lines' "served" rows and in the coordinator's log line); with a
#      budget that leaves some of worker 0's experts to the CPU pool, both serve a step;
#   2. three sequences in flight (bench --parallel 3, --place off so that each worker both
#      misses experts of its own layers and holds one of the other's): the same tokens both
#      ways, requests served; how many were answered inside a worker's own expert wait is
#      printed (a race, so not required);
#   3. no lamina-worker process and no /dev/shm segment of the coordinator left;
#   4. refusals: a bad --experts-home value (run and plan), any without a placement plan or
#      with --inproc;
#   5. kill -9 of the worker holding foreign experts while it serves: an error naming worker 1,
#      a non-zero exit, nothing left.
set -u
BUILD=${BUILD:-build}
L=$BUILD/lamina
T=$(mktemp -d /tmp/lamina-any-XXXXXX)
. tests/lib/sys.sh
export LAMINA_LOG=warn LAMINA_PROBE=off

cleanup() { rm -rf "$T"; }
trap cleanup EXIT

# Sum of the "$2" expert rows of worker $3 in timing file $1.
rows_of() {
    python3 - "$1" "$2" "$3" <<'PY'
import json, sys
n = 0
for line in open(sys.argv[1]):
    j = json.loads(line)
    if j.get("worker") == int(sys.argv[3]):
        n += j["experts"].get(sys.argv[2], 0)
print(n)
PY
}

for a in qwen3next qwen3moe; do
    $L gen-model --arch $a --shape tiny --type q8_0 --seed 5 -o "$T/$a.gguf" >/dev/null 2>&1 ||
        fail "gen-model $a"
done

# 1. identity and serving; "mixed": worker 0 keeps some experts on the CPU pool as well
for spec in "qwen3next 250K,2M peer" "qwen3moe 300K,2M peer" "qwen3next 250K,450K mixed"; do
    set -- $spec
    common="-m $T/$1.gguf --prompt-ids 5,17,99,3,250,42,7,7,301,12 -n 8 --greedy -b 32 -c 256 --no-echo"
    $L run $common --inproc --dump-logits "$T/ref.npy" >"$T/ref.txt" 2>"$T/err" ||
        { fail "$1 inproc: $(tail -1 "$T/err")"; continue; }
    $L run $common --devices cpu,cpu --device-mem $2 --experts-home range \
        --dump-logits "$T/range.npy" >"$T/range.txt" 2>"$T/err" ||
        { fail "$1 range: $(tail -1 "$T/err")"; continue; }
    LAMINA_LOG=info $L run $common --devices cpu,cpu --device-mem $2 --experts-home any \
        --dump-logits "$T/any.npy" --timings "$T/any.jsonl" >"$T/any.txt" 2>"$T/any.err" &
    pid=$!
    wait $pid
    rc=$?
    check_clean "$1 any" $pid
    [ $rc -eq 0 ] || { fail "$1 any: rc $rc $(grep error "$T/any.err" | head -1)"; continue; }
    if cmp -s "$T/ref.npy" "$T/range.npy" && cmp -s "$T/ref.npy" "$T/any.npy" &&
        cmp -s "$T/ref.txt" "$T/range.txt" && cmp -s "$T/ref.txt" "$T/any.txt"; then
        ok "$1 --device-mem $2: logits and text byte-identical (inproc, range, any)"
    else
        fail "$1 --device-mem $2: any or range differs from --inproc"
    fi
    held=$(grep -o 'loaded: [0-9]* experts resident ([0-9]* of them foreign)' "$T/any.err" |
        sed -n 's/.*(\([0-9]*\) of them foreign)/\1/p' | sort -n | tail -1)
    served=$(rows_of "$T/any.jsonl" served 1)
    cpu0=$(rows_of "$T/any.jsonl" cpu 0)
    reqs=$(sed -n 's/.*worker 1 served \([0-9]*\) forwarded expert requests.*/\1/p' "$T/any.err" | head -1)
    echo "[measure] $1 --device-mem $2 --experts-home any: worker 1 holds ${held:-0} foreign experts, served ${reqs:-0} forwarded requests, $served of worker 0's $cpu0 remote rows"
    if [ "${held:-0}" -gt 0 ] && [ "${reqs:-0}" -gt 0 ] && [ "$served" -gt 0 ]; then
        ok "$1: worker 1 holds $held foreign experts and served $reqs requests ($served rows)"
    else
        fail "$1: no foreign experts served (held ${held:-0}, requests ${reqs:-0}, rows $served)"
    fi
    if [ "$3" = mixed ]; then
        [ "$cpu0" -gt "$served" ] && ok "$1 mixed: the CPU pool ran $((cpu0 - served)) rows too" ||
            fail "$1 mixed: every remote row went to the peer ($served of $cpu0)"
    else
        [ "$cpu0" -eq "$served" ] && ok "$1: every remote row of worker 0 went to worker 1" ||
            fail "$1: $served of $cpu0 remote rows went to worker 1"
    fi
done

# 2. several sequences in flight
for h in range any; do
    LAMINA_LOG=info $L bench -m "$T/qwen3next.gguf" -p 16 -n 8 -r 1 --devices cpu,cpu \
        --device-mem 250K,250K --place off -b 32 --parallel 3 --dump-tokens "$T/tok-$h.txt" \
        --experts-home $h \
        --no-membw >"$T/bench-$h.out" 2>"$T/bench-$h.err" ||
        fail "bench --parallel 3 --experts-home $h: $(grep error "$T/bench-$h.err" | head -1)"
done
reqs=$(sed -n 's/.*coord.*worker [01] served \([0-9]*\) forwarded expert requests.*/\1/p' \
    "$T/bench-any.err" | awk '{s += $1} END {print s + 0}')
waiting=$(sed -n 's/.*, \([0-9]*\) of them while waiting for its own.*/\1/p' "$T/bench-any.err" |
    awk '{s += $1} END {print s + 0}')
echo "[measure] bench --parallel 3 --place off --experts-home any: $waiting of $reqs forwarded requests answered inside a worker's own expert wait"
if [ -s "$T/tok-any.txt" ] && cmp -s "$T/tok-range.txt" "$T/tok-any.txt" && [ "${reqs:-0}" -gt 0 ]; then
    ok "bench --parallel 3: the same tokens with range and any, $reqs requests served"
    echo "[measure] bench --parallel 3 --experts-home any: worker 1 served $reqs forwarded requests"
else
    fail "bench --parallel 3: tokens differ or nothing served (${reqs:-0})"
fi

# 4. refusals
common="-m $T/qwen3next.gguf --prompt-ids 5,17 -n 2 --greedy --no-echo --devices cpu,cpu"
$L run $common --device-mem 300K,2M --experts-home everywhere >/dev/null 2>"$T/err"
[ $? -ne 0 ] && grep -q "experts-home 'everywhere' must be range or any" "$T/err" &&
    ok "run --experts-home everywhere refused" || fail "bad value: $(cat "$T/err" | head -2)"
$L plan -m "$T/qwen3next.gguf" --devices cpu,cpu --device-mem 300K,2M --experts-home all \
    --probe off >/dev/null 2>"$T/err"
[ $? -ne 0 ] && grep -q "experts-home 'all' must be range or any" "$T/err" &&
    ok "plan --experts-home all refused" || fail "plan bad value: $(cat "$T/err" | head -2)"
$L run -m "$T/qwen3next.gguf" --prompt-ids 5,17 -n 2 --inproc --experts-home any >/dev/null 2>"$T/err"
[ $? -ne 0 ] && grep -q "no --inproc form" "$T/err" && ok "--inproc --experts-home any refused" ||
    fail "inproc any: $(cat "$T/err" | head -2)"
$L run $common --resident 50% --experts-home any >/dev/null 2>"$T/err"
[ $? -ne 0 ] && grep -q "needs a placement plan" "$T/err" &&
    ok "--experts-home any without a plan refused" || fail "no plan: $(cat "$T/err" | head -2)"
$L plan -m "$T/qwen3next.gguf" --devices cpu,cpu --device-mem 250K,2M -b 32 -c 256 \
    --experts-home any --probe off >"$T/plan.txt" 2>/dev/null
grep -q "foreign: device 1 (cpu) holds [1-9][0-9]* routed experts" "$T/plan.txt" &&
    ok "lamina plan prints the foreign holdings" || fail "plan: no foreign line"

# 5. the holder dies while it serves (bench repetitions keep requests coming)
LAMINA_LOG=info $L bench -m "$T/qwen3next.gguf" -p 16 -n 64 -r 200 --devices cpu,cpu \
    --device-mem 250K,2M -b 32 --experts-home any --no-membw >/dev/null 2>"$T/kill.err" &
pid=$!
w1=
for i in $(seq 1 100); do
    w1=$(pgrep -P $pid -f -- "--index 1" | head -1)
    [ -n "$w1" ] && grep -q "loaded:.*foreign" "$T/kill.err" && break
    sleep 0.1
done
sleep 0.5
if [ -n "$w1" ]; then
    kill -9 "$w1"
    t0=$(date +%s.%N)
    wait $pid
    rc=$?
    secs=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.2f", b - a }')
    check_clean "kill -9 of the holder" $pid
    if [ $rc -ne 0 ] && grep -q "error: worker 1 " "$T/kill.err"; then
        ok "kill -9 of worker 1 while serving: '$(grep -m1 'error: worker 1 ' "$T/kill.err" | sed 's/.*error: //')', exit $rc after $secs s"
        echo "[measure] kill -9 of the foreign-expert holder: coordinator exit $rc after $secs s"
    else
        fail "kill -9 of worker 1: rc $rc, $(grep error "$T/kill.err" | head -2)"
    fi
else
    kill -9 $pid 2>/dev/null
    wait $pid
    fail "kill -9 of worker 1: no worker 1 found"
fi

[ $fails -eq 0 ] || { echo "$fails failure(s)"; exit 1; }
echo "all ok"
