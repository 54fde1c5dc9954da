#!/bin/bash
# device-check: everything lamina does on the GPU machine, in one script.
#
# Here (a machine with nvcc, libzmq and protobuf-c):
#   PACK=.devpack-NAME.tar.xz AS_SM=NN TESTS="..." tools/device-check.sh stage-tests
#     only the GPU tests (and bench_ipc) into the pack named (5-11 MB a
#     pack), the fixtures once into .devpack-fix.tar.xz: several packs for one
#     call, e.g. the sm_86 and sm_75 paths' tests and a stage-bin pack for the
#     benchmarks (PACK=.devpack-bin.tar.xz), run with use= steps (below)
#   tools/device-check.sh stage-bin
#     the same, but packs only .devbin/lamina and .devbin/lamina-worker (3-4 MB):
#     for calls that run benchmarks only (bench, place, cards, llama) and must
#     also carry .peerpack.tar.xz under the call's 64 MiB limit
#   tools/device-check.sh stage
#     builds the binaries and GPU tests, copies them into .devbin/, the
#     Debian packages of libzmq, protobuf-c and their dependencies into
#     .devdebs/ (the GPU machine lacks them), and the conformance fixtures into
#     .fixtures/, and packs .devbin and .fixtures into .devpack.tar.xz. All
#     are ignored by git (.git/info/exclude); the call carries
#     .devpack.tar.xz and .devdebs (run unpacks the pack).
#     BASE_BIN=PATH also packs that lamina as .devbin/lamina-base, for an A/B in
#     one call: BENCH_VARIANTS=";LAMINA_BIN=.devbin/lamina-base" (see bench).
#     AS_SM=NN (75, 86, 89) builds the device code for the virtual architecture
#     compute_NN into sm_90 code (build-dev-smNN) and records NN in the pack: run
#     then sets LAMINA_CUDA_AS_SM=NN (kernels/cuda/caps.h), and the H200 runs the
#     code paths of an sm_NN card (Turing, Ampere, Ada), host decisions and the
#     card's shared memory limit included, e.g. `AS_SM=75 tools/device-check.sh
#     stage` then `run tests`.
# There (the device call runs it from the repository root; logs go to $OUT):
#   tools/device-check.sh run [tests] [bench] [profile] [llama]
#     tests    run every GPU test (what `make test-gpu` runs) from .devbin/
#     bench    write an 80b-a3b-shaped q4_0 model (lamina gen-model; BENCH_TYPE=q4_k
#              or another gen-model --type for that type, BENCH_ARCH and BENCH_SHAPE
#              for another architecture and shape, e.g. qwen3moe 30b-a3b) and run
#              `lamina bench` on it, fully resident on the GPU (BENCH_DEPTH=N:
#              also tg128 with N tokens already in the context, here and in llama;
#              BENCH_DEPTH_P=512: pp512 at that depth too)
#     profile  the same model with LAMINA_CUDA_PROFILE=1: kernels one by one,
#              time per kernel kind (decode and prefill) in $OUT/profile.txt
#     place    the placement benchmark (tools/bench-place.sh) at PLACE_BUDGETS
#     cards    one card against two (tools/bench-cards.sh, issue 6; two GPUs)
#     ncu      Nsight Compute over the decode graph's kernels ($OUT/ncu.csv)
#     trace    the decode graph's timeline kernel by kernel (tools/cuda/graph_trace, CUPTI)
#     use=PACK unpack that pack over .devbin (its tests and its AS_SM replace
#              the ones before) for the steps after it, e.g. `run use=.devpack-86.tar.xz
#              tests use=.devpack-75.tar.xz tests use=.devpack-bin.tar.xz bench`
#              (carry the packs, .devpack-fix.tar.xz and .devdebs)
#     llama    run llama-bench -ngl 99 on the same file (one card), from
#              .peerbuild/bin/llama-bench: llama.cpp built by hand from its
#              public source (nothing here builds it), either on that machine
#              or elsewhere and carried as .peerpack.tar.xz (unpacked here)
# Staging builds for sm_90 only (BUILD=build-dev) and strips the binaries, so
# that the call's carry stays under its size limit.
# The last lines printed are a short summary table.
set -u -o pipefail
cd "$(dirname "$0")/.."
ROOT=$PWD
OUT=${OUT:-/tmp/lamina-device-out}
mkdir -p "$OUT"

stage() {
    local B=build-dev
    local what=${1:-all}
    local archs="-gencode=arch=compute_90,code=sm_90"
    if [ -n "${AS_SM:-}" ]; then
        B=build-dev-sm$AS_SM
        archs="-gencode=arch=compute_$AS_SM,code=sm_90"
    fi
    local gpu_tests
    gpu_tests=$(ls tests/gpu/test_*.c | sed "s|^tests/gpu/\(.*\)\.c$|$B/tests/gpu/\1|")
    # TESTS="test_a test_b" (as for run): only those tests in the pack, which must stay
    # under the call's 64 MiB carry
    if [ -n "${TESTS:-}" ]; then
        gpu_tests=$(for t in $TESTS; do
            [ -f "tests/gpu/$t.c" ] && echo "$B/tests/gpu/$t"; done)
    fi
    [ "$what" = bin ] && gpu_tests=""
    local bins="$B/lamina $B/lamina-worker"
    [ "$what" = tests ] && bins=""
    # shellcheck disable=SC2086
    make -j"$(nproc)" BUILD=$B CUDA_ARCHS="$archs" \
        $bins $B/tools/bench_ipc $gpu_tests || exit 1
    rm -rf .devbin && mkdir -p .devbin/tests/gpu .devbin/tools .devbin/lib
    # shellcheck disable=SC2086
    [ -z "$bins" ] || cp $bins .devbin/
    [ -z "${AS_SM:-}" ] || echo "$AS_SM" >.devbin/as_sm
    # shellcheck disable=SC2086
    [ -z "$gpu_tests" ] || cp $gpu_tests .devbin/tests/gpu/
    cp $B/tools/bench_ipc .devbin/tools/ 2>/dev/null
    # BASE_BIN=PATH: a baseline lamina built elsewhere (e.g. from another commit), as
    # .devbin/lamina-base for bench variants with LAMINA_BIN
    [ -z "${BASE_BIN:-}" ] || cp "$BASE_BIN" .devbin/lamina-base || exit 1
    # tools/cuda/graph_trace where CUPTI is here, with NVIDIA's libcupti (the machine's
    # toolkit may lack it)
    CUDA_HOME=$(dirname "$(dirname "$(command -v nvcc || echo /usr/local/cuda/bin/nvcc)")")
    if [ "$what" = all ] && [ -f "$CUDA_HOME/include/cupti.h" ]; then
        make -j"$(nproc)" BUILD=$B CUDA_ARCHS="$archs" \
            $B/tools/graph_trace && cp $B/tools/graph_trace .devbin/tools/ &&
            cp -L "$CUDA_HOME"/lib64/libcupti.so.* .devbin/lib/ 2>/dev/null
    fi
    strip .devbin/lamina* .devbin/tests/gpu/* .devbin/tools/* 2>/dev/null
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
    grep -qx "/.devpack.tar.xz" .git/info/exclude || echo "/.devpack.tar.xz" >>.git/info/exclude
    grep -qx "/.devpack-\*.tar.xz" .git/info/exclude || echo "/.devpack-*.tar.xz" >>.git/info/exclude
    # one compressed file for the carry (its limit is 64 MiB; the CUDA fat
    # binaries and f32 fixtures shrink about 3x); PACK=NAME writes it there
    local pack=${PACK:-.devpack.tar.xz}
    case $what in
    bin) tar -cf - .devbin/lamina .devbin/lamina-worker $([ -f .devbin/as_sm ] && echo .devbin/as_sm) \
            $([ -f .devbin/lamina-base ] && echo .devbin/lamina-base) |
            xz -T2 -6 >"$pack" ;;
    tests) tar -cf - .devbin | xz -T2 -6 >"$pack"
        tar -cf - .fixtures | xz -T2 -6 >.devpack-fix.tar.xz ;;
    *) tar -cf - .devbin .fixtures | xz -T2 -6 >"$pack" ;;
    esac
    du -sh .devbin .devdebs .fixtures "$pack"
    # the call carries at most 64 MiB in all (the pack, .devdebs and any peer pack)
    local carry
    carry=$(du -cb "$pack" .devdebs | tail -1 | cut -f1)
    if [ "$carry" -gt $((64 * 1024 * 1024)) ]; then
        echo "device-check: $pack and .devdebs come to $((carry / 1048576)) MiB," \
            "past the call's 64 MiB carry: stage again with TESTS=\"...\" (fewer tests)"
    fi
}

# Unpacks pack $1 over .devbin (its tests and its as_sm replace those there)
# and sets LAMINA_CUDA_AS_SM from it, or unsets it.
use_pack() {
    rm -rf .devbin/as_sm .devbin/tests # a machine kept warm may hold an earlier call's
    tar -xJf "$1" || { echo "device-check: cannot unpack $1"; exit 1; }
    # the architecture .devbin/lamina was built for, where this pack brought it (the sys
    # tests run it with the tests' LAMINA_CUDA_AS_SM, which must be the same)
    if tar -tJf "$1" | grep -x '.devbin/lamina' >/dev/null; then # not -q: pipefail, SIGPIPE
        cat .devbin/as_sm 2>/dev/null >.devbin/lamina.as_sm || echo 90 >.devbin/lamina.as_sm
    fi
    if [ -f .devbin/as_sm ]; then
        export LAMINA_CUDA_AS_SM
        LAMINA_CUDA_AS_SM=$(cat .devbin/as_sm)
        echo "device-check: binaries for compute_$LAMINA_CUDA_AS_SM, LAMINA_CUDA_AS_SM=$LAMINA_CUDA_AS_SM"
    else
        unset LAMINA_CUDA_AS_SM
    fi
}

libs() {
    [ ! -f .devpack.tar.xz ] || use_pack .devpack.tar.xz
    # the fixtures of stage-tests packs, once
    if [ -f .devpack-fix.tar.xz ] && [ ! -d .fixtures ]; then
        tar -xJf .devpack-fix.tar.xz || echo "device-check: cannot unpack .devpack-fix.tar.xz"
    fi
    # .peerpack.tar.xz: .peerbuild/bin/llama-bench, built by hand elsewhere and carried (never
    # committed; nothing here builds it)
    if [ -f .peerpack.tar.xz ] && [ ! -x .peerbuild/bin/llama-bench ]; then
        tar -xJf .peerpack.tar.xz || echo "device-check: cannot unpack .peerpack.tar.xz"
    fi
    mkdir -p /tmp/devlib
    for f in .devdebs/*.deb; do dpkg -x "$f" /tmp/devlib; done
    export LD_LIBRARY_PATH=/tmp/devlib/usr/lib/x86_64-linux-gnu:/tmp/devlib/lib/x86_64-linux-gnu:$ROOT/.devbin/lib${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}
    export LAMINA_FIXTURES=$ROOT/.fixtures
    export NCCL_NVLS_ENABLE=0
}

# The call brings back few files: every test's log goes into tests.log,
# machine facts into machine.txt.
tests() {
    { nvidia-smi; nvidia-smi topo -m; df -h /dev/shm; .devbin/tools/bench_ipc -n 10000; } >>"$OUT/machine.txt" 2>&1
    local pass=0 fail=0 log=/tmp/devcheck-test.log
    for t in .devbin/tests/gpu/test_*; do
        [ -x "$t" ] || continue
        n=$(basename "$t")
        # TESTS="test_a test_b" runs only those
        [ -z "${TESTS:-}" ] || [[ " $TESTS " == *" $n "* ]] || continue
        if timeout "${TEST_TIMEOUT:-240}" "$t" >$log 2>&1; then
            pass=$((pass + 1)); echo "PASS $n"
        else
            fail=$((fail + 1)); echo "FAIL $n"; tail -n 15 $log
        fi
        { echo "==== $n"; cat $log; } >>"$OUT/tests.log"
        grep '^\[measure\]' $log | sed 's/^/    /' | head -40
    done
    # tests/gpu2: two GPUs of one host (make test-gpu2); they exit 2 on fewer
    local skip=0 rc
    for t in tests/gpu/sys_*.sh tests/gpu2/sys_*.sh; do
        [ -f "$t" ] || continue
        n=$(basename "$t" .sh)
        [ -z "${TESTS:-}" ] || [[ " $TESTS " == *" $n "* ]] || continue
        if [ ! -x .devbin/lamina ]; then # a stage-tests pack: no binaries to run
            skip=$((skip + 1)); echo "SKIP $n: no .devbin/lamina in this pack"; continue
        fi
        if [ -f .devbin/lamina.as_sm ] &&
            [ "$(cat .devbin/lamina.as_sm)" != "${LAMINA_CUDA_AS_SM:-90}" ]; then
            skip=$((skip + 1))
            echo "SKIP $n: .devbin/lamina is built for compute_$(cat .devbin/lamina.as_sm), the tests for compute_${LAMINA_CUDA_AS_SM:-90}"
            continue
        fi
        BUILD=.devbin timeout 300 sh "$t" >$log 2>&1
        rc=$?
        if [ $rc -eq 0 ]; then
            pass=$((pass + 1)); echo "PASS $n"
        elif [ $rc -eq 2 ] && [[ $t == tests/gpu2/* ]]; then
            skip=$((skip + 1)); echo "SKIP $n: $(tail -n 1 $log)"
        else
            fail=$((fail + 1)); echo "FAIL $n"; tail -n 15 $log
        fi
        { echo "==== $n"; cat $log; } >>"$OUT/tests.log"
        grep -E '^\[measure\]|^FAIL' $log | sed 's/^/    /' | head -20
    done
    echo "gpu tests: $pass passed, $fail failed, $skip skipped (fewer than 2 GPUs, or no binaries)"
}

# The model of bench, profile, trace, ncu, cards and llama, written once into $m (the
# caller's local): BENCH_TYPE (default q4_0, or any type of gen-model's --type, e.g. q4_k)
# picks its weight type, BENCH_ARCH and BENCH_SHAPE (default qwen3next 80b-a3b; e.g.
# qwen3moe 30b-a3b, qwen35moe 35b-a3b) its architecture and shape. The disk holds one such
# file (17-45 GB), so a model of another type or shape is removed first.
bench_model() {
    local t=${BENCH_TYPE:-q4_0} a=${BENCH_ARCH:-qwen3next} s=${BENCH_SHAPE:-80b-a3b} f
    m=.models/q3n-80b-$t.gguf
    [ "$a/$s" = qwen3next/80b-a3b ] || m=.models/$a-$s-$t.gguf
    mkdir -p .models
    [ -f "$m" ] && return 0
    for f in .models/*.gguf; do
        [ -f "$f" ] && [ "$f" != "$m" ] && rm -f "$f"
    done
    .devbin/lamina gen-model --arch "$a" --shape "$s" --type "$t" \
        --seed 1 --threads "$(nproc)" -o "$m" 2>&1 | tail -2
}

# BENCH_VARIANTS: environment settings separated by ';' (e.g. "LAMINA_CUDA_PDL=0;
# LAMINA_CUDA_FUSE=0"), each one more bench run after the default one. A variant's
# LAMINA_BIN=PATH runs that binary instead of .devbin/lamina (a baseline staged with
# BASE_BIN, as .devbin/lamina-base: the same call's A/B).
bench() {
    local m v bin
    bench_model
    { echo; [ -z "${BENCH_VARIANTS:-}" ] || echo "$BENCH_VARIANTS" | tr ';' '\n'; } |
        while read -r v; do
            echo "== lamina bench ${v:-(default)}"
            bin=$(echo "$v" | sed -n 's/.*LAMINA_BIN=\([^ ]*\).*/\1/p')
            # shellcheck disable=SC2086
            env $v LAMINA_LOG=info "${bin:-.devbin/lamina}" bench -m $m -p 512 -n 128 -r 5 --inproc \
                --backend cuda:0 2>&1 </dev/null | tee -a "$OUT/bench-lamina.txt" |
                grep -v " info: "
            [ -z "${BENCH_DEPTH:-}" ] ||
                env $v LAMINA_LOG=info "${bin:-.devbin/lamina}" bench -m $m \
                    -p "${BENCH_DEPTH_P:-0}" -n 128 -d "$BENCH_DEPTH" \
                    -r 5 --inproc --backend cuda:0 --no-membw 2>&1 </dev/null |
                    tee -a "$OUT/bench-lamina.txt" | grep -E "tg128|pp[0-9]"
        done
}

# Placement benchmark (issue 5): tools/bench-place.sh at the budgets in
# PLACE_BUDGETS (default 8G), llama-bench --n-cpu-moe where a binary is there.
# PLACE_ZIPF=S: a model whose routing is skewed (gen-model --heat zipf:S, in
# place of the uniform one: the disk holds one 42 GB file), its heat recorded
# by `lamina run --inproc --record-heat` over PLACE_HEAT_TOKENS generated
# tokens (default 128) and given to every plan (auto can only beat off when
# experts differ in value). PLACE_SHAPE (default 80b-a3b) and BIN (default
# .devbin) let the flow run elsewhere (e.g. DEVICE=cpu on a small shape).
place() {
    local shape=${PLACE_SHAPE:-80b-a3b} bin=${BIN:-.devbin} m heat=""
    m=.models/q3n-${shape}-q4_0${PLACE_ZIPF:+-zipf$PLACE_ZIPF}.gguf
    mkdir -p .models
    if [ ! -f "$m" ]; then
        [ -n "${PLACE_ZIPF:-}" ] && rm -f .models/q3n-"${shape}"-q4_0.gguf
        "$bin"/lamina gen-model --arch qwen3next --shape "$shape" --type q4_0 --seed 1 \
            ${PLACE_ZIPF:+--heat zipf:$PLACE_ZIPF} --threads "$(nproc)" -o "$m" 2>&1 | tail -2
    fi
    if [ -n "${PLACE_ZIPF:-}" ]; then
        heat=$OUT/heat-zipf$PLACE_ZIPF.json
        "$bin"/lamina run -m "$m" -p "The quick brown fox" -n "${PLACE_HEAT_TOKENS:-128}" \
            --ignore-eos --inproc --record-heat "$heat" >/dev/null 2>"$OUT/heat.log" ||
            { echo "place: recording the heat failed"; tail -3 "$OUT/heat.log"; return 1; }
    fi
    [ "${DEVICE:-cuda:0}" = cpu ] || "$bin"/lamina-worker --probe cuda:0 | tee -a "$OUT/machine.txt"
    OUT=$OUT/place BUDGETS="${PLACE_BUDGETS:-8G}" HEAT=$heat \
        LLAMA_BENCH=$([ -x .peerbuild/bin/llama-bench ] && echo "$ROOT/.peerbuild/bin/llama-bench") \
        tools/bench-place.sh "$m" "$bin"
}

# Issue 6's runs (tools/bench-cards.sh): one card against two on the 80b-a3b q4_0 model at
# CARDS_RUNS (default: all of bench-cards.sh's runs); the table, the per-worker summaries and the
# timing dumps (dumps.tar.gz) come back in $OUT.
cards() {
    local m
    bench_model
    OUT=/tmp/cards RUNS="${CARDS_RUNS:-}" tools/bench-cards.sh $m .devbin
    cp /tmp/cards/cards.md /tmp/cards/summaries.md /tmp/cards/dumps.tar.gz "$OUT"/
}

# The decode graph's timeline, kernel by kernel (tools/cuda/graph_trace: CUPTI's records, the
# GPU machine has no Nsight Systems): $OUT/trace.txt and every record in $OUT/trace.csv.
# TRACE_N decode steps (default 16) after a prompt of TRACE_P tokens (default 32);
# TRACE_VARIANTS: environment settings separated by ';', each one more trace (trace-N.txt).
trace() {
    local m v i=0
    bench_model
    [ -x .devbin/tools/graph_trace ] || { echo "trace: no .devbin/tools/graph_trace"; return 1; }
    { echo; [ -z "${TRACE_VARIANTS:-}" ] || echo "$TRACE_VARIANTS" | tr ';' '\n'; } |
        while read -r v; do
            local f=trace${i#0}
            [ "$i" = 0 ] && f=trace
            echo "== graph_trace ${v:-(default)}"
            # shellcheck disable=SC2086
            env $v .devbin/tools/graph_trace -m $m -n "${TRACE_N:-16}" -p "${TRACE_P:-32}" \
                -o "$OUT/$f.csv" \
                >"$OUT/$f.txt" 2>"$OUT/$f.err" </dev/null ||
                { echo "trace: failed"; tail -5 "$OUT/$f.err"; }
            head -3 "$OUT/$f.txt"
            sed -n '/^by kernel/,$p' "$OUT/$f.txt" | head -24
            gzip -f "$OUT/$f.csv"
            # a call brings back at most 8 files: no empty ones
            [ -s "$OUT/$f.err" ] || rm -f "$OUT/$f.err"
            i=$((i + 1))
        done
}

profile() {
    local m
    bench_model
    LAMINA_CUDA_PROFILE=1 LAMINA_LOG=info .devbin/lamina bench -m $m -p 512 -n 16 -r 3 \
        --inproc --backend cuda:0 --no-membw >"$OUT/profile.txt" 2>&1
    grep -A40 "cuda profile" "$OUT/profile.txt" | sed 's/^.*info: //' | head -60
}

# Nsight Compute over the decode graph's kernel nodes (one by one, serialized, cold caches):
# per-kernel time, DRAM bytes, grid and registers in $OUT/ncu.csv; NCU_COUNT launches
# (default 1400: three decode steps of the 80b model), NCU_N generated tokens, NCU_SKIP
# launches (of those NCU_KERNELS names) skipped first.
ncu_step() {
    local m ncu
    ncu=$(command -v ncu || ls /opt/nvidia/nsight-compute/*/ncu 2>/dev/null | head -1)
    [ -n "$ncu" ] || { echo "ncu: not found"; return 1; }
    bench_model
    if [ -n "${NCU_SECTIONS:-}" ]; then
        # NCU_SECTIONS="WarpStateStats SchedulerStats ...": those sections' pages as text
        # for the kernels NCU_KERNELS names (a regex; default every kernel); NCU_DETAILS=all
        # prints their tables in full (the stall reasons)
        # NCU_PAGE=source: the SourceCounters section's samples SASS line by SASS line
        # (where the warps stall), sampled every 32 cycles, as CSV in $OUT/ncu-source.csv
        local sec=() s f="$OUT/ncu.txt"
        for s in $NCU_SECTIONS; do sec+=(--section "$s"); done
        if [ "${NCU_PAGE:-}" = source ]; then
            sec+=(--page source --print-source sass --csv --warp-sampling-interval 0)
            f="$OUT/ncu-source.csv"
        fi
        timeout 500 "$ncu" --graph-profiling node --clock-control none --cache-control none \
            --launch-count "${NCU_COUNT:-12}" ${NCU_SKIP:+--launch-skip "$NCU_SKIP"} \
            ${NCU_KERNELS:+--kernel-name "regex:$NCU_KERNELS"} \
            ${NCU_DETAILS:+--print-details "$NCU_DETAILS"} \
            "${sec[@]}" .devbin/lamina bench -m $m -p 0 -n "${NCU_N:-3}" -r 1 --inproc \
            --backend cuda:0 --no-membw >"$f" 2>"$OUT/ncu.err"
        echo "ncu: rc $? $(wc -l <"$f") lines"; tail -3 "$OUT/ncu.err"
        return
    fi
    timeout 500 "$ncu" --graph-profiling node --clock-control none --csv --page raw \
        --launch-count "${NCU_COUNT:-1400}" --metrics \
        gpu__time_duration.sum,dram__bytes_read.sum,launch__grid_size,launch__block_size,launch__registers_per_thread,launch__waves_per_multiprocessor \
        .devbin/lamina bench -m $m -p 0 -n "${NCU_N:-3}" -r 1 --inproc --backend cuda:0 \
        --no-membw >"$OUT/ncu.csv" 2>"$OUT/ncu.err"
    echo "ncu: rc $? $(wc -l <"$OUT/ncu.csv") lines"; tail -3 "$OUT/ncu.err"
}

llama_bench() {
    local m
    bench_model
    [ -x .peerbuild/bin/llama-bench ] || { echo "llama: no .peerbuild/bin/llama-bench"; return 1; }
    # one card, as lamina's bench: llama.cpp splits over every visible GPU by default
    CUDA_VISIBLE_DEVICES=0 .peerbuild/bin/llama-bench -m $m -ngl 99 -p 512 -n 128 -r 3 2>&1 |
        tee "$OUT/bench-llama.txt"
    [ -z "${BENCH_DEPTH:-}" ] ||
        CUDA_VISIBLE_DEVICES=0 .peerbuild/bin/llama-bench -m $m -ngl 99 \
            -p "${BENCH_DEPTH_P:-0}" -n 128 -d "$BENCH_DEPTH" -r 3 2>&1 |
            tee -a "$OUT/bench-llama.txt"
}

case "${1:-}" in
stage) stage ;;
stage-bin) stage bin ;;
stage-tests) stage tests ;;
run)
    shift
    libs
    for step in "$@"; do
        case $step in
        tests) tests ;;
        bench) bench ;;
        profile) profile ;;
        place) place ;;
        cards) cards ;;
        llama) llama_bench ;;
        ncu) ncu_step ;;
        trace) trace ;;
        use=*) use_pack "${step#use=}" ;;
        *) echo "device-check: unknown step $step" ;;
        esac
    done
    ;;
*)
    echo "usage: tools/device-check.sh stage | stage-bin | stage-tests | run [use=PACK] [tests] [bench] [profile] [place] [cards] [llama] [ncu] [trace] ..." >&2
    exit 2
    ;;
esac
