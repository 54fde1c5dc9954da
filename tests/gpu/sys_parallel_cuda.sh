#!/bin/sh
# sys_parallel_cuda (GPU): several sequences in flight through CUDA workers (lamina bench
# --parallel N) give every sequence the same tokens as that sequence run alone (sequence s of
# seed S is sequence 0 of seed S + s): each slot has its own KV cache, DeltaNet state and
# decode graph (captured at the slot's first decode step). On tiny gen-model files, q8_0:
#   - qwen3next (DeltaNet and attention) and qwen3moe (attention only);
#   - --devices cuda:0 and cuda:0,cuda:0 (ZeroMQ hand-off), --parallel 2 and 3, tokens
#     sampled on the last worker; with --sample-on coordinator also the logits bytes (FNV-1a);
#   - --resident 50% so that half the experts go to the coordinator's CPU pool (the
#     layers then run one by one, not as a graph), as well as all experts resident (graphs);
#   - with 2 or more GPUs (nvidia-smi -L): cuda:0,cuda:1 with --handoff nccl as well (NCCL
#     sends and receives of a pair match in the order the steps run).
# Prints [measure] lines with total and per-sequence generation tok/s of each N.
# Needs a CUDA device. BUILD: the folder with lamina and lamina-worker.
set -u
B=${BUILD:-build}
T=$(mktemp -d /tmp/lamina-par-cuda.XXXXXX)
trap 'rm -rf "$T"' EXIT INT TERM
fail=0
export LAMINA_LOG=warn
check() { # what, condition result
    if [ "$2" = 0 ]; then echo "ok   $1"; else echo "FAIL $1"; fail=1; fi
}
gpus=$(nvidia-smi -L 2>/dev/null | grep -c '^GPU')
# bench MODEL N SEED OUT [options]: the dump of the last rep and the --json line
bench() {
    m=$1; n=$2; seed=$3; out=$4; shift 4
    # shellcheck disable=SC2068
    "$B/lamina" bench -m "$m" -p 37 -n 24 -r 3 -b 16 --no-membw --json --parallel "$n" \
        --seed "$seed" --dump-tokens "$out" $@ >"$out.json" 2>"$out.err"
}
for arch in qwen3next qwen3moe; do
    m=$T/$arch.gguf
    "$B/lamina" gen-model --arch $arch --shape tiny --type q8_0 --seed 11 -o "$m" \
        >"$T/gen.log" 2>&1 || { cat "$T/gen.log"; exit 1; }
    set -- "--devices cuda:0" "--devices cuda:0,cuda:0" "--devices cuda:0,cuda:0 --resident 50%" \
        "--devices cuda:0 --sample-on coordinator"
    [ "$gpus" -ge 2 ] && set -- "$@" "--devices cuda:0,cuda:1 --handoff nccl"
    for opts in "$@"; do
        tag="$arch $opts"
        ok=0
        for s in 0 1 2; do
            bench "$m" 1 $((100 + s)) "$T/alone$s" $opts || ok=1
        done
        check "$tag: alone runs ($(grep -h error "$T"/alone?.err | head -1))" $ok
        for n in 2 3; do
            bench "$m" $n 100 "$T/par$n" $opts
            rc=$?
            for s in $(seq 0 $((n - 1))); do
                a=$(sed -n 's/^seq 0: //p' "$T/alone$s")
                b=$(sed -n "s/^seq $s: //p" "$T/par$n")
                [ $rc = 0 ] && [ -n "$a" ] && [ "$a" = "$b" ]
                check "$tag --parallel $n: sequence $s as alone" $?
            done
            python3 - "$T/par$n.json" "$tag" <<'PY'
import json, sys
d = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
print("[measure] %s --parallel %d: tg %.1f tok/s total (+- %.1f), %.1f per sequence; pp %.1f "
      "total" % (sys.argv[2], d["parallel"], d["tg_tps"], d["tg_spread"], d["tg_seq_tps"],
                 d["pp_tps"]))
PY
        done
        python3 - "$T/alone0.json" "$tag" <<'PY'
import json, sys
d = json.loads(open(sys.argv[1]).read().strip().splitlines()[-1])
print("[measure] %s --parallel 1: tg %.1f tok/s" % (sys.argv[2], d["tg_tps"]))
PY
    done
done
leftover=$(ls /dev/shm 2>/dev/null | grep -c lamina)
[ "$leftover" = 0 ]
check "no shm segment left" $?
exit $fail
