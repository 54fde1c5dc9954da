#!/bin/sh
# sys_prompt_cache_cuda (GPU): the prompt cache (lamina run --prompt-cache) through CUDA
# workers, whose DeltaNet state lives on the card with a host copy that is canonical for
# snapshots (worker/backend_cuda.c): a save pulls what the card is ahead on, a load writes
# the host copy and the next GPU step pushes it. On tiny gen-model qwen3next files:
#   - q8_0, on --devices cuda:0, cuda:0,cuda:0 and --inproc --backend cuda:0: an 8-token
#     prefix written, then the 24-token prompt continuing from it, gives the tokens of the
#     run without a cache (-b 8: the same passes); the same prompt again (nothing run, the
#     first token from the stored logits) too; the files of the three paths are the same
#     bytes;
#   - f32 (the CPU and GPU paths agree on greedy tokens there, sys_mixed_workers): a prefix
#     written by a CPU worker and continued by a GPU worker (a host-made state pushed to the
#     card), and one written by a GPU worker and continued by a CPU worker (the card's state
#     pulled), give the GPU's and the CPU's tokens of the whole prompt;
#   - no shm segment is left.
# Needs a CUDA device. BUILD: the folder with lamina and lamina-worker.
set -u
B=${BUILD:-build}
T=$(mktemp -d /tmp/lamina-pc-cuda.XXXXXX)
trap 'rm -rf "$T"' EXIT INT TERM
fail=0
export LAMINA_LOG=info
check() { # what, condition result
    if [ "$2" = 0 ]; then echo "ok   $1"; else echo "FAIL $1"; fail=1; fi
}
PRE=11,42,7,300,5,19,88,2
ALL=$PRE,64,9,13,250,77,31,4,120,6,99,18,45,3,210,17,56
# run MODEL TAG [args]: greedy, 16 tokens, -b 8; stdout to $T/TAG.out, stderr to $T/TAG.err
run() {
    m=$1; tag=$2; shift 2
    "$B/lamina" run -m "$m" -n 16 -b 8 --greedy --no-echo "$@" >"$T/$tag.out" 2>"$T/$tag.err"
}
for type in q8_0 f32; do
    m=$T/m-$type.gguf
    "$B/lamina" gen-model --arch qwen3next --shape tiny --type $type --seed 31 -o "$m" \
        >"$T/gen.log" 2>&1 || { cat "$T/gen.log"; exit 1; }
done
m=$T/m-q8_0.gguf
for where in "1g --devices cuda:0" "2g --devices cuda:0,cuda:0" "in --inproc --backend cuda:0"; do
    set -- $where
    w=$1
    shift
    run "$m" "$w-ref" --prompt-ids $ALL "$@"
    check "q8_0 $w: reference run" $?
    rm -f "$T/pc.bin"
    run "$m" "$w-pre" --prompt-ids $PRE -n 0 --prompt-cache "$T/pc.bin" "$@"
    check "q8_0 $w: the prefix written" $?
    run "$m" "$w-ext" --prompt-ids $ALL --prompt-cache "$T/pc.bin" "$@" &&
        grep -q "8 of the prompt's 24 tokens loaded" "$T/$w-ext.err"
    check "q8_0 $w: the prefix loaded" $?
    cmp -s "$T/$w-ref.out" "$T/$w-ext.out"
    check "q8_0 $w: prefix from the cache + the rest = the whole prompt" $?
    run "$m" "$w-full" --prompt-ids $ALL --prompt-cache "$T/pc.bin" "$@" &&
        grep -q "prompt 24 tok (24 cached)" "$T/$w-full.err"
    check "q8_0 $w: the whole prompt loaded" $?
    cmp -s "$T/$w-ref.out" "$T/$w-full.out"
    check "q8_0 $w: whole prompt from the cache = the whole prompt" $?
    cp "$T/pc.bin" "$T/pc-$w.bin"
done
cmp -s "$T/pc-1g.bin" "$T/pc-2g.bin" && cmp -s "$T/pc-1g.bin" "$T/pc-in.bin"
check "q8_0: one GPU worker, two and --inproc write the same bytes" $?
cmp -s "$T/1g-ref.out" "$T/2g-ref.out"
check "q8_0: one GPU worker = two (tokens)" $?

# f32: across the backends
m=$T/m-f32.gguf
run "$m" g-ref --prompt-ids $ALL --devices cuda:0
check "f32: GPU reference" $?
run "$m" c-ref --prompt-ids $ALL --devices cpu
check "f32: CPU reference" $?
cmp -s "$T/g-ref.out" "$T/c-ref.out"
check "f32: the CPU and GPU references agree" $?
for pair in "cpu cuda:0 g-ref" "cuda:0 cpu c-ref"; do
    set -- $pair
    rm -f "$T/pc.bin"
    run "$m" "x-$1" --prompt-ids $PRE -n 0 --prompt-cache "$T/pc.bin" --devices "$1"
    check "f32: prefix written on $1" $?
    run "$m" "x-$1-$2" --prompt-ids $ALL --prompt-cache "$T/pc.bin" --devices "$2" &&
        grep -q "8 of the prompt's 24 tokens loaded" "$T/x-$1-$2.err"
    check "f32: prefix of $1 loaded on $2" $?
    cmp -s "$T/$3.out" "$T/x-$1-$2.out"
    check "f32: $1's prefix continued on $2 = $2's whole prompt" $?
done
leftover=$(ls /dev/shm 2>/dev/null | grep -c lamina)
[ "$leftover" = 0 ]
check "no shm segment left" $?
exit $fail
