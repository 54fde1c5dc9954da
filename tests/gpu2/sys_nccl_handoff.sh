#!/bin/sh
# Two-GPU system test of the NCCL hand-off (make test-gpu2; two CUDA devices of one host):
#   1. lamina run on a small gen-model qwen3next model (MODEL=FILE to use another) with
#      --devices cuda:0,cuda:1 and --handoff nccl, with --handoff zmq, and with one card
#      (--devices cuda:0): byte-identical --dump-logits and the same greedy text. The prompt is
#      three prefill steps (-b 8) and generation crosses the pair token by token; the nccl
#      run logs the pair, its timing lines say handoff_via nccl and count the bytes sent;
#      [measure] lines give the mean decode step time of both hand-offs;
#   2. kill -9 of either worker in the middle of an NCCL run: the coordinator names it, exits
#      non-zero within 5 s, and no worker process and no shm segment is left.
# On a machine with fewer than two GPUs it says so and exits 2 (NCCL cannot join two ranks of
# one device, so there is nothing to test there).
set -u
BUILD=${BUILD:-build}
L=$BUILD/lamina
T=$(mktemp -d /tmp/lamina-gpu2-XXXXXX)
. tests/lib/sys.sh
export NCCL_NVLS_ENABLE=0 # the machines' owners require NVLink multicast off
export LAMINA_LOG=${LAMINA_LOG:-warn}

cleanup() { rm -rf "$T"; }
trap cleanup EXIT

gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU ')
if [ "${gpus:-0}" -lt 2 ]; then
    echo "sys_nccl_handoff: needs 2 GPUs of one host, found ${gpus:-0}: not run (NCCL cannot" \
        "join two ranks of one device; run make test-gpu2 on a two-GPU machine)"
    exit 2
fi
# libnccl.so.2 from the loader's path, the CUDA toolkit, or else the nvidia-nccl pip wheel
if [ -z "${LAMINA_NCCL_LIB:-}" ] && ! ldconfig -p 2>/dev/null | grep -q 'libnccl.so.2 ' &&
    [ ! -e /usr/local/cuda/lib64/libnccl.so.2 ]; then
    lib=$(python3 -c 'import os, nvidia.nccl as n; print(os.path.join(list(n.__path__)[0], "lib", "libnccl.so.2"))' 2>/dev/null)
    if [ -n "$lib" ] && [ -e "$lib" ]; then
        export LAMINA_NCCL_LIB=$lib
        echo "using $lib"
    fi
fi

# Mean coordinator step time (ms) of the one-token steps in a timing dump.
decode_ms() {
    python3 -c '
import json, sys
v = [r["ms"]["step"] for r in map(json.loads, open(sys.argv[1])) if r.get("coordinator") and r.get("tokens") == 1]
print("%.3f ms over %d steps" % (sum(v) / len(v), len(v)) if v else "no steps")' "$1"
}

model=${MODEL:-$T/next.gguf}
if [ -z "${MODEL:-}" ]; then
    $L gen-model --arch qwen3next --shape tiny --type q8_0 --seed 11 -o "$model" >/dev/null 2>&1 ||
        { echo "FAIL: gen-model"; exit 1; }
fi

# 1. nccl, zmq and one card in-process: the same bits
ids=5,17,99,3,250,42,7,7,301,12,64,128,9,33,2,71,18,40,6,11
common="-m $model --prompt-ids $ids -n 24 --greedy -b 8 --no-echo"
$L run $common --devices cuda:0 --dump-logits "$T/ref.npy" >"$T/ref.txt" 2>"$T/ref.err" ||
    fail "--devices cuda:0: $(tail -n 2 "$T/ref.err")"
for mode in nccl zmq; do
    LAMINA_LOG=info $L run $common --devices cuda:0,cuda:1 --handoff $mode \
        --dump-logits "$T/$mode.npy" --timings "$T/$mode.jsonl" >"$T/$mode.txt" 2>"$T/$mode.err"
    rc=$?
    if [ $rc -ne 0 ]; then
        fail "--handoff $mode: rc $rc: $(grep error "$T/$mode.err" | head -3)"
        continue
    fi
    echo "[measure] --handoff $mode: decode step $(decode_ms "$T/$mode.jsonl")"
done
if [ -s "$T/nccl.npy" ]; then
    grep -q "hand-off worker 0 -> 1: nccl (cuda:0 -> cuda:1)" "$T/nccl.err" &&
        grep -q "nccl worker 0 -> 1: joined as rank 1" "$T/nccl.err" &&
        grep -q '"worker":0,.*"handoff_via":"nccl"' "$T/nccl.jsonl" &&
        ! grep '"worker":0,' "$T/nccl.jsonl" | grep -q '"nccl":0}' &&
        ok "--handoff nccl: pair joined, every step of worker 0 sent its rows over NCCL" ||
        fail "--handoff nccl: not used as logged: $(grep -i 'nccl\|hand-off' "$T/nccl.err" | head -3)"
    python3 tools/plot_timings.py "$T/nccl.jsonl" | sed -n '3,4p'
fi
if [ -s "$T/nccl.npy" ] && cmp -s "$T/nccl.npy" "$T/zmq.npy" && cmp -s "$T/nccl.txt" "$T/zmq.txt"; then
    ok "--handoff nccl and zmq: logits byte-identical, same text"
else
    fail "--handoff nccl and zmq differ (the transport changed the bits)"
fi
if [ -s "$T/nccl.npy" ] && cmp -s "$T/nccl.npy" "$T/ref.npy" && cmp -s "$T/nccl.txt" "$T/ref.txt"; then
    ok "two cards over NCCL and one card (--devices cuda:0): logits byte-identical, same text"
else
    fail "two cards over NCCL differ from one card (--devices cuda:0)"
fi

# 2. kill -9 of a worker while the pair is busy
for victim_index in 1 0; do
    $L run -m "$model" -p hello -n 200000 -c 200000 --ignore-eos --devices cuda:0,cuda:1 \
        --handoff nccl >/dev/null 2>"$T/long.err" &
    cpid=$!
    i=0
    while [ $i -lt 300 ] && [ "$(pgrep -P $cpid -f lamina-worker | wc -l)" -lt 2 ]; do
        sleep 0.1; i=$((i + 1))
    done
    sleep 3 # loaded, joined and generating
    victim=$(pgrep -P $cpid -f "lamina-worker .*--index $victim_index\$")
    if [ -z "$victim" ] || ! kill -0 $cpid 2>/dev/null; then
        fail "kill -9 worker $victim_index: the run did not get going: $(grep error "$T/long.err" | head -2)"
        kill -9 $cpid 2>/dev/null; wait $cpid 2>/dev/null
        continue
    fi
    t0=$(date +%s.%N)
    kill -9 "$victim"
    wait $cpid; rc=$?
    dt=$(awk -v a="$t0" -v b="$(date +%s.%N)" 'BEGIN { printf "%.2f", b - a }')
    if [ $rc -ne 0 ] && grep -q "worker $victim_index (pid $victim.*killed by signal 9" "$T/long.err" &&
        awk -v d="$dt" 'BEGIN { exit !(d < 5) }'; then
        ok "kill -9 worker $victim_index during an NCCL run: named, exit $rc after ${dt}s"
    else
        fail "kill -9 worker $victim_index: rc $rc after ${dt}s: $(grep error "$T/long.err" | head -3)"
    fi
    check_clean "kill -9 worker $victim_index" $cpid
done

echo "sys_nccl_handoff: $fails failure(s)"
[ $fails -eq 0 ]
