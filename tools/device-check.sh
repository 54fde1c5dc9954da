#!/bin/bash
# device-check: everything lamina does on the GPU machine, in one script.
#
# Here (a machine with nvcc, libzmq and protobuf-c):
#   tools/device-check.sh stage
#     builds everything (make all), copies the binaries into .devbin/, the
#     Debian packages of libzmq, protobuf-c and their dependencies into
#     .devdebs/ (the GPU machine lacks them), and the conformance fixtures into
#     .fixtures/. All three are ignored by git (.git/info/exclude) and travel
#     with the device call's `carry`.
# There (the device call runs it from the repository root; logs go to $OUT):
#   tools/device-check.sh run [tests] [bench] [llama]
#     tests  run every GPU test (what `make test-gpu` runs) from .devbin/
#     bench  write an 80b-a3b-shaped q4_0 model (lamina gen-model) and run
#            `lamina bench` on it, fully resident on the GPU
#     llama  build llama.cpp from .peer/llama.cpp (a copy of its public source
#            made by hand, never committed) in the background into .peerbuild/,
#            and run llama-bench -ngl 99 on the same file once it is built
# The last lines printed are a short summary table.
set -u -o pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-/tmp/lamina-device-out}
mkdir -p "$OUT"

stage() {
    make -j"$(nproc)" all || exit 1
    rm -rf .devbin && mkdir -p .devbin/tests/gpu .devbin/tools
    cp build/lamina build/lamina-worker .devbin/
    cp build/tests/gpu/test_* .devbin/tests/gpu/ 2>/dev/null
    rm -f .devbin/tests/gpu/*.o .devbin/tests/gpu/*.d
    cp build/tools/bench_ipc .devbin/tools/ 2>/dev/null
    mkdir -p .devdebs
    if ! ls .devdebs/libzmq5_*.deb >/dev/null 2>&1; then
        (cd .devdebs && apt-get download libzmq5 libsodium23 libpgm-5.3-0 libnorm1 \
            libprotobuf-c1 libbsd0 libmd0 libgssapi-krb5-2 libkrb5-3 libk5crypto3 \
            libkrb5support0 libcom-err2 libkeyutils1 libpcre2-8-0)
    fi
    FX=${LAMINA_FIXTURES:-../shared/fixtures}
    rm -rf .fixtures && mkdir -p .fixtures/conformance
    cp "$FX/conformance/refs.json" .fixtures/conformance/
    for a in qwen3moe qwen3next qwen35moe; do
        mkdir -p .fixtures/conformance/$a
        cp "$FX/conformance/$a/$a-f32.gguf" "$FX/conformance/$a/ref_logits.npy" \
            .fixtures/conformance/$a/
    done
    for d in .devbin .devdebs .fixtures; do
        grep -qx "/$d/" .git/info/exclude || echo "/$d/" >>.git/info/exclude
    done
    du -sh .devbin .devdebs .fixtures
}

libs() {
    mkdir -p /tmp/devlib
    for f in .devdebs/*.deb; do dpkg -x "$f" /tmp/devlib; done
    export LD_LIBRARY_PATH=/tmp/devlib/usr/lib/x86_64-linux-gnu:/tmp/devlib/lib/x86_64-linux-gnu${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    export LAMINA_FIXTURES=$ROOT/.fixtures
    export NCCL_NVLS_ENABLE=0
}

llama_build() {
    [ -x .peerbuild/bin/llama-bench ] && return 0
    [ -d .peer/llama.cpp ] || { echo "llama: no .peer/llama.cpp"; return 1; }
    setsid bash -c "cmake -S .peer/llama.cpp -B .peerbuild -DGGML_CUDA=ON \
        -DCMAKE_CUDA_ARCHITECTURES=90 -DCMAKE_BUILD_TYPE=Release -DLLAMA_CURL=OFF \
        -DLLAMA_BUILD_TESTS=OFF -DLLAMA_BUILD_EXAMPLES=OFF -DLLAMA_BUILD_SERVER=OFF \
        >$ROOT/.peerbuild.log 2>&1 && cmake --build .peerbuild -j 14 --target llama-bench \
        >>$ROOT/.peerbuild.log 2>&1; echo done >>$ROOT/.peerbuild.log" </dev/null &
}

tests() {
    nvidia-smi >"$OUT/nvidia-smi.txt" 2>&1
    local pass=0 fail=0
    .devbin/tools/bench_ipc -n 10000 2>&1 | tee "$OUT/bench-ipc.txt"
    for t in .devbin/tests/gpu/test_*; do
        [ -x "$t" ] || continue
        n=$(basename "$t")
        if timeout 240 "$t" >"$OUT/$n.log" 2>&1; then
            pass=$((pass + 1)); echo "PASS $n"
        else
            fail=$((fail + 1)); echo "FAIL $n"; tail -n 15 "$OUT/$n.log"
        fi
        grep '^\[measure\]' "$OUT/$n.log" | sed 's/^/    /' | head -40
    done
    echo "gpu tests: $pass passed, $fail failed"
}

bench() {
    local m=.models/q3n-80b-q4_0.gguf
    mkdir -p .models
    grep -qx "/.models/" .git/info/exclude 2>/dev/null || true
    [ -f $m ] || .devbin/lamina gen-model --arch qwen3next --shape 80b-a3b --type q4_0 \
        --seed 1 --threads 14 -o $m 2>&1 | tail -2
    df -h /dev/shm >"$OUT/shm.txt" 2>&1
    .devbin/lamina bench -m $m -p 512 -n 128 -r 5 --inproc --backend cuda:0 --no-membw 2>&1 |
        tee "$OUT/bench-lamina.txt" | grep -v " info: "
    LAMINA_LOG=info .devbin/lamina run -m $m -p "The quick brown fox" -n 32 --inproc 2>&1 |
        tail -3 >"$OUT/run-cpu.txt"
}

llama_bench() {
    local m=.models/q3n-80b-q4_0.gguf i=0
    while ! grep -q '^done' .peerbuild.log 2>/dev/null && [ $i -lt 300 ]; do sleep 2; i=$((i + 1)); done
    cp .peerbuild.log "$OUT/llama-build.log" 2>/dev/null
    [ -x .peerbuild/bin/llama-bench ] || { echo "llama-bench not built"; tail -5 .peerbuild.log; return 1; }
    .peerbuild/bin/llama-bench -m $m -ngl 99 -p 512 -n 128 -r 3 2>&1 | tee "$OUT/bench-llama.txt"
}

case "${1:-}" in
stage) stage ;;
run)
    shift
    libs
    for step in "$@"; do [ "$step" = llama ] && llama_build; done
    for step in "$@"; do
        case $step in
        tests) tests ;;
        bench) bench ;;
        llama) llama_bench ;;
        *) echo "device-check: unknown step $step" ;;
        esac
    done
    ;;
*)
    echo "usage: tools/device-check.sh stage | run [tests] [bench] [llama]" >&2
    exit 2
    ;;
esac
