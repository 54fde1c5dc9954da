#!/bin/sh
# Several sequences in flight through the workers (lamina bench --parallel N, CPU backend):
#   1. on tiny qwen3next (DeltaNet and attention layers) and qwen3moe (attention only) models,
#      with one and two CPU workers and a small --device-mem so that experts go to the
#      coordinator's CPU pool, N = 1, 2 and 3 sequences in flight give every sequence the
#      same tokens as that sequence run alone (sequence s of seed S is sequence 0 of seed
#      S + s), sampled on the last worker; with --sample-on coordinator also the same logits
#      bytes (an FNV-1a hash of all of them);
#   2. the CPU pool served requests, the timing dump names every sequence on every worker
#      line and tools/plot_timings.py draws it;
#   3. refusals: --parallel with --inproc, 0 or 65 sequences, --dump-tokens without
#      --parallel; a budget that fits one sequence's KV and state but not three refuses three
#      with the sizes;
#   4. nothing left behind: no worker process, no /dev/shm segment.
set -u
BUILD=${BUILD:-build}
L=$BUILD/lamina
T=$(mktemp -d /tmp/lamina-par-XXXXXX)
trap 'rm -rf "$T"' EXIT
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }
ok() { echo "ok: $*"; }
export LAMINA_LOG=warn

$L gen-model --arch qwen3next --shape tiny --type q8_0 --seed 5 -o "$T/next.gguf" >/dev/null 2>&1 ||
    fail "gen-model qwen3next"
$L gen-model --arch qwen3moe --shape tiny --type q8_0 --seed 6 -o "$T/moe.gguf" >/dev/null 2>&1 ||
    fail "gen-model qwen3moe"

# bench MODEL DEVICES MEM N SEED OUT [extra]: the dump of a parallel run (last rep)
bench() {
    m=$1; dev=$2; mem=$3; n=$4; seed=$5; out=$6; shift 6
    # shellcheck disable=SC2068
    $L bench -m "$m" -p 13 -n 6 -r 1 -b 8 --no-membw --devices "$dev" --device-mem "$mem" \
        --parallel "$n" --seed "$seed" --dump-tokens "$out" $@ >"$out.table" 2>"$out.err" &
    pid=$!
    echo $pid >>"$T/pids"
    wait $pid
}

# 1. each sequence in flight with others = alone
for model in next moe; do
    for spec in "cpu 300K" "cpu,cpu 200K"; do
        set -- $spec
        dev=$1; mem=$2
        tag="$model --devices $dev --device-mem $mem"
        for s in 0 1 2; do
            bench "$T/$model.gguf" "$dev" "$mem" 1 $((1234 + s)) "$T/alone$s" ||
                fail "$tag alone seed $((1234 + s)): $(grep error "$T/alone$s.err" | head -1)"
        done
        cp "$T/alone0" "$T/$model-$dev.alone0"
        grep -q "CPU expert pool: [0-9.]* ms busy, [1-9][0-9]* rows" "$T/alone0.table" ||
            fail "$tag: the CPU pool served no rows ($(grep 'CPU expert pool' "$T/alone0.table"))"
        for n in 1 2 3; do
            if ! bench "$T/$model.gguf" "$dev" "$mem" $n 1234 "$T/par$n"; then
                fail "$tag --parallel $n: $(grep error "$T/par$n.err" | head -1)"
                continue
            fi
            same=1
            for s in $(seq 0 $((n - 1))); do
                a=$(sed -n 's/^seq 0: //p' "$T/alone$s")
                b=$(sed -n "s/^seq $s: //p" "$T/par$n")
                [ -n "$a" ] && [ "$a" = "$b" ] || { same=0; fail "$tag --parallel $n seq $s: '$b', alone '$a'"; }
            done
            [ $same = 1 ] && ok "$tag --parallel $n: every sequence as alone ($(sed -n 's/^seq 0: //p' "$T/par$n"))"
        done
    done
done

# 1b. logits bytes with the coordinator sampling
for s in 0 1; do
    bench "$T/next.gguf" cpu,cpu 200K 1 $((1234 + s)) "$T/lalone$s" --sample-on coordinator ||
        fail "logits alone $s: $(grep error "$T/lalone$s.err" | head -1)"
done
if bench "$T/next.gguf" cpu,cpu 200K 2 1234 "$T/lpar" --sample-on coordinator \
    --timings "$T/timings.jsonl"; then
    a0=$(sed -n 's/^seq 0: //p' "$T/lalone0"); a1=$(sed -n 's/^seq 0: //p' "$T/lalone1")
    b0=$(sed -n 's/^seq 0: //p' "$T/lpar"); b1=$(sed -n 's/^seq 1: //p' "$T/lpar")
    w0=$(sed -n 's/^seq 0: //p' "$T/next-cpu,cpu.alone0")
    if echo "$a0" | grep -q logits && [ "$a0" = "$b0" ] && [ "$a1" = "$b1" ] &&
        [ "${a0% logits*}" = "$w0" ]; then
        ok "--sample-on coordinator --parallel 2: same logits bytes and tokens as alone"
    else
        fail "--sample-on coordinator: '$b0' / '$b1' vs alone '$a0' / '$a1' (worker-sampled '$w0')"
    fi
    # 2. the timing dump: every worker line of a step names its sequence, both appear
    python3 - "$T/timings.jsonl" <<'EOF' || fail "timing dump: sequences not named"
import json, sys
rows = [json.loads(l) for l in open(sys.argv[1])]
workers = [r for r in rows if "worker" in r]
seqs = {r["seq"] for r in workers}
assert seqs == {0, 1}, seqs
by_step = {}
for r in rows:
    by_step.setdefault(r["step"], set()).add(r["seq"])
assert all(len(v) == 1 for v in by_step.values()), "a step with two sequences"
assert {r["worker"] for r in workers} == {0, 1}
print("timing dump: %d worker lines, sequences %s" % (len(workers), sorted(seqs)))
EOF
    if python3 -c 'import matplotlib' 2>/dev/null; then
        python3 tools/plot_timings.py "$T/timings.jsonl" -o "$T/plot.png" >"$T/plot.out" 2>&1 &&
            [ -s "$T/plot.png" ] && ok "plot_timings.py draws the parallel dump" ||
            fail "plot_timings.py: $(tail -1 "$T/plot.out")"
    else
        python3 tools/plot_timings.py "$T/timings.jsonl" >"$T/plot.out" 2>&1 &&
            ok "plot_timings.py summarizes the parallel dump (no matplotlib here for -o)" ||
            fail "plot_timings.py: $(tail -1 "$T/plot.out")"
    fi
else
    fail "--sample-on coordinator --parallel 2: $(grep error "$T/lpar.err" | head -1)"
fi

# 3. refusals
$L bench -m "$T/next.gguf" --inproc --parallel 2 >/dev/null 2>"$T/err" &&
    fail "--parallel with --inproc accepted"
grep -q "no --inproc form" "$T/err" || fail "no message for --parallel --inproc: $(tail -1 "$T/err")"
for n in 0 65; do
    $L bench -m "$T/next.gguf" --devices cpu --parallel $n >/dev/null 2>"$T/err" &&
        fail "--parallel $n accepted"
done
$L bench -m "$T/next.gguf" --devices cpu --dump-tokens "$T/x" >/dev/null 2>&1 &&
    fail "--dump-tokens without --parallel accepted"
# the budget: one sequence fits, three do not (each slot's KV cache and state is charged)
$L bench -m "$T/next.gguf" -p 2000 -n 4 -r 1 -b 8 --no-membw --devices cpu --device-mem 800K \
    --resident all --parallel 1 >/dev/null 2>"$T/err1"
rc1=$?
$L bench -m "$T/next.gguf" -p 2000 -n 4 -r 1 -b 8 --no-membw --devices cpu --device-mem 800K \
    --resident all --parallel 3 >/dev/null 2>"$T/err3"
rc3=$?
if [ $rc1 -eq 0 ] && [ $rc3 -ne 0 ] && grep -q "KV and state" "$T/err3"; then
    ok "budget: one sequence fits 800K, three are refused ($(grep -o 'KV and state [0-9.]* MiB' "$T/err3"))"
else
    fail "budget: one sequence rc $rc1 ($(grep error "$T/err1" | head -1)), three rc $rc3"
fi

# 4. nothing left
sleep 0.3
for pid in $(cat "$T/pids"); do
    left=$(pgrep -f "lamina-worker --connect ipc://.*/lamina-$pid-" | tr '\n' ' ')
    [ -z "$left" ] || fail "coordinator $pid: lamina-worker processes left: $left"
    ls /dev/shm 2>/dev/null | grep -q "^lamina-$pid-" && fail "coordinator $pid: shm segment left"
done
ok "no worker process or shm segment left by $(wc -l <"$T/pids") runs"

echo "sys_parallel: $fails failure(s)"
[ $fails -eq 0 ]
