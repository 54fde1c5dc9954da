#!/bin/sh
# sys_mixed_workers (GPU): a CPU worker followed by a GPU worker gives the
# same tokens as two GPU workers (sharing one card over ZeroMQ) and as one
# GPU worker, on a small gen-model qwen3next file.
#  - f32: every path computes in f32 on both backends, so greedy tokens must
#    agree across cpu,cuda:0 / cuda:0,cuda:0 / cuda:0 / cpu,cpu and the prompt
#    logits within 1e-3.
#  - both types: the shared expert run as pair k of the routed decode products
#    (the default) gives the tokens of its own graph branch (LAMINA_CUDA_SHPAIR=0),
#    and for q8_0 (int8 decode kernels) the logits byte for byte.
#  - both types: two GPU workers give one GPU worker's tokens and its logits
#    byte for byte (a range's first layer normalises h with cuda_rmsnorm_wide,
#    the same bits as the fused combine + norm of one range). Q8_0 against a
#    CPU worker: the arithmetic
#    differs by design: the CPU rounds activations to int8 for every Q8_0
#    product, the GPU's prefill products of rows shorter than 256 (this
#    file's n_embd is 64) take f32 activations, and a random tiny model
#    amplifies that rounding; the difference is printed, not held to a bound.
# Needs a CUDA device. BUILD: the folder with lamina and lamina-worker.
set -u
B=${BUILD:-build}
T=$(mktemp -d /tmp/lamina-mixed.XXXXXX)
trap 'rm -rf "$T"' EXIT INT TERM
fail=0
check() { # what, condition result
    if [ "$2" = 0 ]; then echo "ok   $1"; else echo "FAIL $1"; fail=1; fi
}
for type in f32 q8_0; do
    m=$T/m-$type.gguf
    "$B/lamina" gen-model --arch qwen3next --shape tiny --type $type --seed 11 -o "$m" \
        >"$T/gen.log" 2>&1 || { cat "$T/gen.log"; exit 1; }
    for devs in cpu,cuda:0 cuda:0,cuda:0 cuda:0 cpu,cpu; do
        tag=$(echo "$devs" | tr ':,' '-_')
        "$B/lamina" run -m "$m" -p "The quick brown fox jumps over" -n 32 --greedy \
            --devices "$devs" --dump-logits "$T/$type-$tag.npy" >"$T/$type-$tag.txt" \
            2>"$T/$type-$tag.err"
        check "$type run on $devs" $?
    done
    if [ $type = f32 ]; then
        for devs in cuda-0_cuda-0 cuda-0 cpu_cpu; do
            cmp -s "$T/$type-cpu_cuda-0.txt" "$T/$type-$devs.txt"
            check "$type tokens: cpu,cuda:0 = $devs" $?
        done
    fi
    cmp -s "$T/$type-cuda-0.txt" "$T/$type-cuda-0_cuda-0.txt"
    check "$type tokens: cuda:0 = cuda:0,cuda:0" $?
    cmp -s "$T/$type-cuda-0.npy" "$T/$type-cuda-0_cuda-0.npy"
    check "$type logits: cuda:0 = cuda:0,cuda:0 byte for byte" $?
    # prompt logits of the mixed run against two GPU workers
    python3 - "$T/$type-cpu_cuda-0.npy" "$T/$type-cuda-0_cuda-0.npy" "$type" <<'PY'
import sys
import numpy as np
a, b = np.load(sys.argv[1]), np.load(sys.argv[2])
d = float(np.max(np.abs(a - b))) if a.shape == b.shape else float("inf")
same = int((a.argmax(1) == b.argmax(1)).sum()) if a.shape == b.shape else -1
print("[measure] %s prompt logits, cpu,cuda:0 vs cuda:0,cuda:0: max |diff| %.3g (max |logit| "
      "%.3g), arg-max equal at %d of %d positions" % (sys.argv[3], d, float(np.abs(b).max()),
                                                     same, len(b)))
sys.exit(0 if sys.argv[3] != "f32" or d <= 1e-3 else 1)
PY
    check "$type prompt logits (f32: within 1e-3)" $?
    # the shared expert as its own graph branch (LAMINA_CUDA_SHPAIR=0) instead of pair k of
    # the routed decode products: q8_0 takes the int8 decode kernels, whose rows do not
    # depend on the pair count (the same bits); f32 the f32 kernels (the same tokens)
    LAMINA_CUDA_SHPAIR=0 "$B/lamina" run -m "$m" -p "The quick brown fox jumps over" -n 32 \
        --greedy --devices cuda:0 --dump-logits "$T/$type-nopair.npy" >"$T/$type-nopair.txt" \
        2>"$T/$type-nopair.err"
    check "$type run on cuda:0 with LAMINA_CUDA_SHPAIR=0" $?
    cmp -s "$T/$type-cuda-0.txt" "$T/$type-nopair.txt"
    check "$type tokens: shared expert as a pair = as a branch" $?
    if [ $type = q8_0 ]; then
        cmp -s "$T/$type-cuda-0.npy" "$T/$type-nopair.npy"
        check "$type logits: shared expert as a pair = as a branch, byte for byte" $?
    fi
done
leftover=$(ls /dev/shm 2>/dev/null | grep -c lamina)
[ "$leftover" = 0 ]
check "no shm segment left" $?
exit $fail
