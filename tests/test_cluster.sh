#!/bin/sh
# System tests of the coordinator + workers (real processes, CPU backend):
#   1. logits byte-identical to --inproc and the same greedy text, for every
#      conformance fixture and a gen-model tiny model, with 1, 2 and 3 workers
#      and placements that keep some experts in worker memory and send the
#      rest to the coordinator's CPU pool; device probes logged, stated
#      figures (LAMINA_PROBE) give identical plans;
#   2. kill -9 of a worker: error naming it within 2 s, non-zero exit, no
#      process and no /dev/shm segment left;
#   3. a stopped (hung) worker: reported as not answering, same cleanup;
#   4. an injected step failure in worker 1: reported, non-zero exit;
#   5. kill -9 of the coordinator: workers gone within 10 s, next run clean;
#   6. SIGINT: clean exit, nothing left;
#   7. tcp:// with CURVE and hand-started workers: same logits as ipc;
#   8. bad command lines: clear errors;
#   9. NCCL hand-off, CPU side: --handoff nccl refused on CPU workers, on two workers of one
#      card and where libnccl.so.2 cannot be loaded; --handoff auto falls back to ZeroMQ with
#      a log line saying why, with logits byte-identical to --inproc; timing lines name it;
#  10. sampling on the last worker: the same text as --inproc and --sample-on coordinator
#      (filters, penalties, greedy; 1-3 workers), fewer bytes sent by the last worker.
set -u
BUILD=${BUILD:-build}
L=$BUILD/lamina
W=$BUILD/lamina-worker
FX=${LAMINA_FIXTURES:-../shared/fixtures}
T=$(mktemp -d /tmp/lamina-sys-XXXXXX)
. tests/lib/sys.sh
export LAMINA_LOG=warn

cleanup() { rm -rf "$T"; }
trap cleanup EXIT

ids_of() { python3 -c "import json,sys;print(','.join(map(str,json.load(open('$FX/conformance/refs.json'))['$1']['prompt_ids'])))"; }

# 1. identity
$L gen-model --arch qwen35moe --shape tiny --type q4_0 --seed 3 -o "$T/tiny.gguf" >/dev/null 2>&1 ||
    fail "gen-model tiny"
for m in qwen3moe/qwen3moe-q8_0 qwen3next/qwen3next-f32 qwen35moe/qwen35moe-q8_0 tiny; do
    if [ "$m" = tiny ]; then
        file=$T/tiny.gguf; ids=5,17,99,3,250,42,7,7,301,12,64,128
    else
        file=$FX/conformance/$m.gguf; ids=$(ids_of "$(dirname $m)")
    fi
    common="-m $file --prompt-ids $ids -n 12 --greedy -b 32 --no-echo"
    $L run $common --inproc --dump-logits "$T/ref.npy" >"$T/ref.txt" 2>"$T/err" ||
        { fail "$m inproc: $(tail -1 $T/err)"; continue; }
    for spec in "cpu 30%" "cpu,cpu 50%" "cpu,cpu,cpu 25%" "cpu,cpu none" "cpu,cpu,cpu all"; do
        set -- $spec
        $L run $common --devices "$1" --resident "$2" --dump-logits "$T/out.npy" >"$T/out.txt" 2>"$T/err" ||
            { fail "$m --devices $1 --resident $2: $(tail -1 $T/err)"; continue; }
        if cmp -s "$T/ref.npy" "$T/out.npy" && cmp -s "$T/ref.txt" "$T/out.txt"; then
            ok "$m --devices $1 --resident $2: logits byte-identical, same text"
        else
            fail "$m --devices $1 --resident $2: differs from --inproc"
        fi
    done
done

# 1b. every placement plan gives the same tokens (placement changes speed, never results)
m=qwen3next/qwen3next-f32
ids=$(ids_of qwen3next)
common="-m $FX/conformance/$m.gguf --prompt-ids $ids -n 8 --greedy -b 32 --no-echo"
$L run $common --inproc --dump-logits "$T/ref.npy" >"$T/ref.txt" 2>/dev/null
for spec in "cpu,cpu 3M,4M auto" "cpu,cpu 3M,4M off" "cpu,cpu 3M,4M lmhead=1,experts=none" \
    "cpu 8M auto" "cpu,cpu,cpu 3M,3M,6M auto"; do
    set -- $spec
    $L run $common --devices "$1" --device-mem "$2" --place "$3" --heat "$FX/small-model/heat.json" \
        --dump-logits "$T/out.npy" >"$T/out.txt" 2>"$T/err"
    rc=$?
    if [ $rc -ne 0 ] && grep -q "heat profile has" "$T/err"; then
        $L run $common --devices "$1" --device-mem "$2" --place "$3" \
            --dump-logits "$T/out.npy" >"$T/out.txt" 2>"$T/err"
        rc=$?
    fi
    if [ $rc -eq 0 ] && cmp -s "$T/ref.npy" "$T/out.npy" && cmp -s "$T/ref.txt" "$T/out.txt"; then
        ok "plan --devices $1 --device-mem $2 --place $3: same logits and text as --inproc"
    else
        fail "plan --devices $1 --device-mem $2 --place $3: rc $rc $(grep error "$T/err" | head -1)"
    fi
done

# 1c. device probes: one [probe] line per device; stated figures (LAMINA_PROBE) give the same
# plan on every run and machine; on CPU devices (miss ratio 1) measured figures change no decision
plan_of() { # probe spec, output file: the [place] lines and the workers' plans of a run
    LAMINA_PROBE=$1 LAMINA_LOG=info $L run $common --devices cpu,cpu --device-mem 3M,4M \
        --place auto >/dev/null 2>"$2.err"
    rc=$?
    grep -o '\[place\].*' "$2.err" >"$2"
    grep -o 'worker [0-9]: layers.*' "$2.err" >"$2.workers"
    return $rc
}
plan_of auto "$T/plan.auto" && grep -q '\[probe\] device cpu: gemv [0-9.]* GB/s (.*threads' "$T/plan.auto.err" &&
    ok "probe: $(grep -o '\[probe\].*' "$T/plan.auto.err")" || fail "probe: $(grep error "$T/plan.auto.err" | head -1)"
plan_of cpu=20 "$T/plan.a" && plan_of cpu=20 "$T/plan.b" && plan_of off "$T/plan.off"
if [ -s "$T/plan.a" ] && cmp -s "$T/plan.a" "$T/plan.b" && cmp -s "$T/plan.a" "$T/plan.off" &&
    cmp -s "$T/plan.a.workers" "$T/plan.auto.workers" &&
    grep -q '\[probe\] device cpu: gemv 20.0 GB/s (stated)' "$T/plan.a.err"; then
    ok "probe figures stated: identical plans; measured figures: the same decisions"
else
    fail "probe figures: plans differ: $(diff "$T/plan.a" "$T/plan.off" | head -2) $(diff "$T/plan.a.workers" "$T/plan.auto.workers" | head -2)"
fi
fig=$($W --probe cpu 2>"$T/err" | grep -o 'LAMINA_PROBE figure: cpu=[0-9.]*$' | cut -d' ' -f3)
if [ -n "$fig" ] && plan_of "$fig" "$T/plan.w" && cmp -s "$T/plan.a.workers" "$T/plan.w.workers"; then
    ok "lamina-worker --probe cpu: $fig, usable as LAMINA_PROBE"
else
    fail "lamina-worker --probe cpu: '$fig' $(tail -1 "$T/err")"
fi
LAMINA_PROBE=cuda:0=10 $L run $common --devices cpu,cpu --device-mem 3M,4M >/dev/null 2>"$T/err"
[ $? -ne 0 ] && grep -q "'cuda:0' is not one of the devices" "$T/err" &&
    ok "bad LAMINA_PROBE rejected" || fail "bad LAMINA_PROBE: $(grep error "$T/err" | head -1)"

# A long generation to disturb: tiny model, big context.
long_run() { # sets cpid (not in a subshell: the test must be able to wait for it)
    $L run -m "$T/tiny.gguf" -p "hello" -n 200000 -c 200000 --ignore-eos --devices cpu,cpu \
        --resident 50% "$@" >/dev/null 2>"$T/long.err" &
    cpid=$!
}

workers_of() { pgrep -P "$1" -f lamina-worker | tr '\n' ' '; }

wait_workers() { # coordinator pid: wait until 2 workers run
    i=0
    while [ $i -lt 100 ]; do
        [ "$(workers_of "$1" | wc -w)" -ge 2 ] && return 0
        sleep 0.1; i=$((i + 1))
    done
    return 1
}

# 2. kill -9 of a worker
long_run
if wait_workers "$cpid"; then
    sleep 1
    victim=$(workers_of "$cpid" | awk '{print $2}')
    t0=$(date +%s.%N)
    kill -9 "$victim"
    wait "$cpid"; rc=$?
    dt=$(echo "$(date +%s.%N) - $t0" | bc)
    if [ $rc -ne 0 ] && grep -q "worker 1 (pid $victim.*killed by signal 9" "$T/long.err" &&
        [ "$(echo "$dt < 2.5" | bc)" = 1 ]; then
        ok "kill -9 worker: named in the error, exit $rc after ${dt}s"
    else
        fail "kill -9 worker: rc $rc after ${dt}s: $(grep error "$T/long.err" | head -2)"
    fi
else
    fail "workers did not start"; kill -9 "$cpid" 2>/dev/null; wait "$cpid" 2>/dev/null
fi
check_clean "kill -9 worker" "$cpid"

# 3. a stopped worker
long_run
if wait_workers "$cpid"; then
    sleep 1
    victim=$(workers_of "$cpid" | awk '{print $1}')
    t0=$(date +%s.%N)
    kill -STOP "$victim"
    wait "$cpid"; rc=$?
    dt=$(echo "$(date +%s.%N) - $t0" | bc)
    if [ $rc -ne 0 ] && grep -q "worker 0 (pid $victim) stopped answering" "$T/long.err" &&
        [ "$(echo "$dt < 5" | bc)" = 1 ]; then
        ok "stopped worker: reported after ${dt}s"
    else
        fail "stopped worker: rc $rc after ${dt}s: $(grep error "$T/long.err" | head -2)"
    fi
fi
check_clean "stopped worker" "$cpid"

# 4. injected failure
LAMINA_FAIL=1:step:5 $L run -m "$T/tiny.gguf" -p "hello" -n 20 --devices cpu,cpu >/dev/null 2>"$T/err"
rc=$?
if [ $rc -ne 0 ] && grep -q "worker 1 failed in step" "$T/err"; then
    ok "injected step failure: reported, exit $rc"
else
    fail "injected step failure: rc $rc: $(grep error "$T/err" | head -2)"
fi

# 5. kill -9 of the coordinator
long_run
if wait_workers "$cpid"; then
    ws=$(workers_of "$cpid")
    kill -9 "$cpid"; wait "$cpid" 2>/dev/null
    i=0
    while [ $i -lt 100 ] && for p in $ws; do kill -0 "$p" 2>/dev/null && break; done; do
        alive=0; for p in $ws; do kill -0 "$p" 2>/dev/null && alive=1; done
        [ $alive = 0 ] && break
        sleep 0.1; i=$((i + 1))
    done
    alive=0; for p in $ws; do kill -0 "$p" 2>/dev/null && alive=1; done
    [ $alive = 0 ] && ok "kill -9 coordinator: workers gone within $((i / 10)) s" ||
        fail "kill -9 coordinator: workers still alive after 10 s"
    LAMINA_LOG=info $L run -m "$T/tiny.gguf" -p "hi" -n 4 --devices cpu >/dev/null 2>"$T/err"
    if [ $? -eq 0 ] && ! ls /dev/shm | grep -q "^lamina-$cpid-"; then
        ok "next run after a dead coordinator: clean ($(grep -c 'dead coordinator' "$T/err") stale item(s) removed)"
    else
        fail "next run after a dead coordinator"
    fi
fi
check_clean "kill -9 coordinator" "$cpid"

# 6. SIGINT
long_run
if wait_workers "$cpid"; then
    sleep 0.5
    kill -INT "$cpid"
    wait "$cpid"; rc=$?
    [ $rc -ne 0 ] && ok "SIGINT: exit $rc" || fail "SIGINT: exit 0"
fi
check_clean "SIGINT" "$cpid"

# 7. tcp with CURVE, workers started by hand
port=$((20000 + $$ % 20000))
ids=5,17,99,3,250,42,7,7,301,12,64,128
$L run -m "$T/tiny.gguf" --prompt-ids $ids -n 6 --greedy --no-echo --inproc --dump-logits "$T/ref.npy" >"$T/ref.txt" 2>/dev/null
LAMINA_LOG=info $L run -m "$T/tiny.gguf" --prompt-ids $ids -n 6 --greedy --no-echo --devices cpu,cpu \
    --resident 50% --listen "tcp://127.0.0.1:$port" --dump-logits "$T/out.npy" >"$T/out.txt" 2>"$T/tcp.err" &
cpid=$!
i=0
while [ $i -lt 100 ] && ! grep -q -- "--server-key" "$T/tcp.err"; do sleep 0.1; i=$((i + 1)); done
key=$(grep -o -- "--server-key [^ ]*" "$T/tcp.err" | head -1 | awk '{print $2}')
if [ -n "$key" ]; then
    timeout -s KILL 60 $W --connect "tcp://127.0.0.1:$port" --index 0 --server-key "$key" 2>"$T/w0.err" &
    w0=$!
    timeout -s KILL 60 $W --connect "tcp://127.0.0.1:$port" --index 1 --server-key "$key" 2>"$T/w1.err" &
    w1=$!
    wait "$cpid"; rc=$?
    wait "$w0" "$w1"
    if [ $rc -eq 0 ] && cmp -s "$T/ref.npy" "$T/out.npy" && cmp -s "$T/ref.txt" "$T/out.txt"; then
        ok "tcp + CURVE with hand-started workers: same logits and text as in-process"
    else
        fail "tcp: rc $rc: $(grep error "$T/tcp.err" "$T/w0.err" | head -3)"
    fi
else
    fail "tcp: coordinator printed no server key: $(tail -2 "$T/tcp.err")"; kill -9 "$cpid"
fi
check_clean "tcp" "$cpid"

# 8. bad command lines
$L run -m "$T/tiny.gguf" -p hi --devices gpu9 >/dev/null 2>"$T/err" ||
    grep -q "not available" "$T/err" && ok "unknown device rejected" || fail "unknown device"
$L run -m "$T/tiny.gguf" -p hi --devices cpu,cpu --layers 0-1,3-3 >/dev/null 2>"$T/err"
[ $? -ne 0 ] && grep -q "contiguous ranges" "$T/err" && ok "bad --layers rejected" || fail "bad --layers"
$L run -m "$T/tiny.gguf" -p hi --devices cpu --device-mem 1K --resident all >/dev/null 2>"$T/err"
[ $? -ne 0 ] && grep -q "budget" "$T/err" && ok "too small --device-mem rejected" || fail "device-mem: $(grep error "$T/err" | head -1)"
check_clean "bad command lines" "$$"

# 9. NCCL hand-off, CPU side (the GPU side is tests/gpu2/sys_nccl_handoff.sh)
ids=5,17,99,3,250,42,7,7,301,12,64,128
one="-m $T/tiny.gguf --prompt-ids $ids -n 6 --greedy --no-echo"
$L run $one --inproc --dump-logits "$T/ref9.npy" >"$T/ref9.txt" 2>/dev/null
# a worker's timing line of the last step arriving after the step's result (worker 0 sends
# its line after handing the step on): the coordinator waits for it before the file closes
$L run -m "$T/tiny.gguf" -p "hello" -n 6 --devices cpu,cpu --timings "$T/late0.jsonl" \
    >/dev/null 2>"$T/err"
nlate=$(grep -c '"worker":0,' "$T/late0.jsonl")
LAMINA_FAIL=0:late:$nlate $L run -m "$T/tiny.gguf" -p "hello" -n 6 --devices cpu,cpu \
    --timings "$T/late.jsonl" >/dev/null 2>"$T/err"
rc=$?
n0=$(grep -c '"worker":0,' "$T/late.jsonl")
n1=$(grep -c '"worker":1,' "$T/late.jsonl")
if [ $rc -eq 0 ] && [ "$nlate" -gt 0 ] && grep -q "injected delay of step $nlate's timing line" "$T/err" &&
    [ "$n0" -eq "$nlate" ] && [ "$n1" -eq "$nlate" ]; then
    ok "a worker's last timing line 0.3 s behind the result: all $n0 lines of both workers kept"
else
    fail "late timing line: rc $rc, worker 0 $n0 and worker 1 $n1 lines of $nlate steps"
fi
$L run $one --devices cpu,cpu --handoff nccl >/dev/null 2>"$T/err"
[ $? -ne 0 ] && grep -q "handoff nccl needs two consecutive workers on different CUDA devices.*run on cpu and cpu" "$T/err" &&
    ok "--handoff nccl on CPU workers refused: $(grep -o 'handoff nccl needs.*' "$T/err")" ||
    fail "--handoff nccl on CPU workers: $(grep error "$T/err" | head -1)"
$L run $one --devices cpu,cpu --handoff udp >/dev/null 2>"$T/err"
[ $? -ne 0 ] && grep -q "must be zmq, nccl or auto" "$T/err" && ok "bad --handoff rejected" ||
    fail "bad --handoff: $(head -1 "$T/err")"
for mode in zmq auto; do
    LAMINA_LOG=info $L run $one --devices cpu,cpu --resident 50% --handoff $mode --dump-logits "$T/out9.npy" \
        --timings "$T/t9.jsonl" >"$T/out9.txt" 2>"$T/err"
    rc=$?
    said=yes
    [ $mode = auto ] && ! grep -q "hand-off: zmq (auto: workers 0 and 1 run on cpu and cpu)" "$T/err" && said=no
    if [ $rc -eq 0 ] && [ $said = yes ] && cmp -s "$T/ref9.npy" "$T/out9.npy" &&
        cmp -s "$T/ref9.txt" "$T/out9.txt" && grep -q '"worker":0,.*"handoff_via":"zmq",.*"handoff":' "$T/t9.jsonl" &&
        grep -q '"worker":1,.*"handoff_via":"none"' "$T/t9.jsonl"; then
        ok "--handoff $mode on CPU workers: ZeroMQ, logits byte-identical to --inproc"
    else
        fail "--handoff $mode on CPU workers: rc $rc, said $said: $(grep error "$T/err" | head -1)"
    fi
done
# CUDA workers (CUDA builds): the coordinator decides before it starts any worker, so this runs
# without a GPU; a missing library is simulated with LAMINA_NCCL_LIB
if ! $L run $one --devices cuda:0 --handoff zmq 2>&1 | grep -q "not available in this build"; then
    nolib=$T/none/libnccl.so.2
    LAMINA_NCCL_LIB=$nolib LAMINA_LOG=info $L run $one --devices cuda:0,cuda:1 --handoff nccl >/dev/null 2>"$T/err"
    [ $? -ne 0 ] && grep -q "handoff nccl: NCCL cannot be loaded" "$T/err" && grep -q "tried $nolib" "$T/err" &&
        ! grep -q "started worker" "$T/err" &&
        ok "--handoff nccl without libnccl.so.2: refused before any worker starts" ||
        fail "--handoff nccl without libnccl: $(grep error "$T/err" | head -2)"
    LAMINA_NCCL_LIB=$nolib LAMINA_LOG=info timeout -s KILL 120 $L run $one --devices cuda:0,cuda:1 --handoff auto \
        >/dev/null 2>"$T/err"
    grep -q "hand-off: zmq (auto: libnccl.so.2 cannot be loaded" "$T/err" &&
        ok "--handoff auto without libnccl.so.2: falls back to ZeroMQ, logged" ||
        fail "--handoff auto without libnccl: $(grep -i 'hand-off\|error' "$T/err" | head -2)"
    $L run $one --devices cuda:0,cuda:0 --handoff nccl >/dev/null 2>"$T/err"
    [ $? -ne 0 ] && grep -q "cannot join two ranks of one device" "$T/err" &&
        ok "--handoff nccl on one card refused" || fail "--handoff nccl on one card: $(grep error "$T/err" | head -1)"
else
    echo "skip: CUDA workers (this build has no CUDA)"
fi
check_clean "handoff" "$$"

# 10. sampling on the last worker (--sample-on worker, the default): with a seed, the same text
# as --inproc (which samples here) and as --sample-on coordinator, for filters, penalties and
# greedy, with 1, 2 and 3 workers; --dump-logits (logits needed here) unchanged; the last
# worker's timing lines show no logits sent in decode steps, and fewer bytes in all
bytes_sent() { # the last worker's bytes.sent: total, and in one-token steps
    python3 -c "
import json,sys
ls=[json.loads(l) for l in open('$1') if '\"worker\"' in l]
last=max(l['worker'] for l in ls)
ls=[l for l in ls if l['worker']==last]
print(sum(l['bytes']['sent'] for l in ls), sum(l['bytes']['sent'] for l in ls if l['tokens']==1))"
}
for m in tiny qwen3next/qwen3next-f32; do
    if [ "$m" = tiny ]; then
        file=$T/tiny.gguf; ids=5,17,99,3,250,42,7,7,301,12,64,128
    else
        file=$FX/conformance/$m.gguf; ids=$(ids_of "$(dirname $m)")
    fi
    for smp in "--seed 11 --temp 0.8 --top-k 40 --top-p 0.9" \
        "--seed 5 --temp 0.7 --top-k 0 --top-p 1 --min-p 0.02 --repeat-penalty 1.3 --presence-penalty 0.2 --repeat-last-n 16" \
        "--greedy --repeat-penalty 1.2"; do
        common="-m $file --prompt-ids $ids -n 16 --ignore-eos -b 32 --no-echo $smp"
        $L run $common --inproc >"$T/ref.txt" 2>"$T/err" || { fail "$m inproc $smp: $(tail -1 $T/err)"; continue; }
        for dev in cpu cpu,cpu cpu,cpu,cpu; do
            $L run $common --devices $dev --timings "$T/tw.jsonl" >"$T/w.txt" 2>"$T/err" &&
                $L run $common --devices $dev --sample-on coordinator --timings "$T/tc.jsonl" \
                    >"$T/c.txt" 2>>"$T/err" || { fail "$m $dev $smp: $(tail -1 $T/err)"; continue; }
            set -- $(bytes_sent "$T/tw.jsonl") $(bytes_sent "$T/tc.jsonl")
            if cmp -s "$T/ref.txt" "$T/w.txt" && cmp -s "$T/ref.txt" "$T/c.txt" && [ "$2" = 0 ] &&
                [ "$4" -gt 0 ] && [ "$1" -lt "$3" ]; then
                ok "$m $dev $smp: same text as --inproc both ways; last worker sent $1 bytes (coordinator sampling: $3)"
            else
                fail "$m $dev $smp: worker/coordinator sampling vs --inproc differ, or bytes sent $1 ($2 in decode) vs $3 ($4)"
            fi
        done
    done
    common="-m $file --prompt-ids $ids -n 8 --ignore-eos -b 32 --no-echo --seed 3 --temp 0.9"
    $L run $common --inproc --dump-logits "$T/ref.npy" >"$T/ref.txt" 2>/dev/null
    $L run $common --devices cpu,cpu --dump-logits "$T/out.npy" >"$T/out.txt" 2>"$T/err"
    cmp -s "$T/ref.npy" "$T/out.npy" && cmp -s "$T/ref.txt" "$T/out.txt" &&
        ok "$m sampled run with --dump-logits: logits byte-identical, same text" ||
        fail "$m sampled run with --dump-logits differs from --inproc: $(tail -1 $T/err)"
done
$L run -m "$T/tiny.gguf" --prompt-ids 1,2 -n 2 --sample-on gpu >/dev/null 2>"$T/err"
[ $? -ne 0 ] && grep -q "worker or coordinator" "$T/err" && ok "--sample-on gpu refused" ||
    fail "--sample-on gpu: $(tail -1 $T/err)"
check_clean "sample-on" "$$"

echo "test_cluster: $fails failure(s)"
[ $fails -eq 0 ]
