#!/bin/sh
# lamina bench: the markdown table and the --json line, in-process and on two
# CPU workers, on a gen-model tiny model; and its refusal of bad arguments.
# Repetitions on two workers with every expert resident (each repetition
# resets the sequence: the reset must reach worker 1 before the next
# repetition's first step, which it once did not).
set -u
BUILD=${BUILD:-build}
L=$BUILD/lamina
T=$(mktemp -d /tmp/lamina-bench-XXXXXX)
trap 'rm -rf "$T"' EXIT
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }
export LAMINA_LOG=warn
$L gen-model --arch qwen3next --shape tiny --type q8_0 --seed 5 -o "$T/m.gguf" >/dev/null 2>&1 ||
    fail "gen-model"
for mode in "--inproc" "--devices cpu,cpu --resident 50%"; do
    # shellcheck disable=SC2086
    $L bench -m "$T/m.gguf" -p 32 -n 8 -r 3 --no-membw $mode >"$T/table.txt" 2>"$T/err" ||
        fail "bench $mode: $(tail -1 "$T/err")"
    grep -q "| pp32 | " "$T/table.txt" && grep -q "| tg8 | " "$T/table.txt" ||
        fail "bench $mode: table rows missing"
    # the model column names the file's mixture (general.file_type 7) as llama-bench does
    grep -q "^| qwen3next 4 layers Q8_0 | " "$T/table.txt" ||
        fail "bench $mode: model column: $(grep -m1 'layers' "$T/table.txt")"
    # shellcheck disable=SC2086
    $L bench -m "$T/m.gguf" -p 32 -n 8 -r 3 --no-membw --json $mode >"$T/json.txt" 2>"$T/err" ||
        fail "bench --json $mode"
    tail -1 "$T/json.txt" | python3 -c '
import json, sys
d = json.loads(sys.stdin.read())
assert d["pp"] == 32 and d["tg"] == 8 and d["reps"] == 3, d
assert d["pp_tps"] > 0 and d["tg_tps"] > 0 and d["pp_spread"] >= 0, d
assert d["bytes_per_token"] > 0 and d["arch"] == "qwen3next", d
print("json ok:", d["backend"], round(d["pp_tps"]), "pp tok/s,", round(d["tg_tps"]), "tg tok/s")
' || fail "bench --json $mode: bad JSON line: $(tail -1 "$T/json.txt")"
done
# a warm-up of each test before the reps (their figures logged at info)
LAMINA_LOG=info $L bench -m "$T/m.gguf" -p 16 -n 4 -r 3 --no-membw --inproc >/dev/null \
    2>"$T/err" || fail "bench with LAMINA_LOG=info: $(tail -1 "$T/err")"
grep -Eq "bench warm-up: pp [1-9][0-9.]* tok/s, tg [1-9][0-9.]* tok/s" "$T/err" ||
    fail "no warm-up of both tests: $(grep -m1 'warm-up' "$T/err")"
[ "$(grep -c 'bench rep [1-3] of 3: pp [1-9]' "$T/err")" = 3 ] || fail "not 3 reps logged"
for i in 1 2 3 4; do
    $L bench -m "$T/m.gguf" -p 16 -n 8 -r 5 --no-membw --devices cpu,cpu >/dev/null 2>"$T/err" ||
        fail "bench on cpu,cpu, run $i of 4: $(grep -m1 error "$T/err")"
done
# -d: the tests at a depth (a prefilled context), labelled as llama-bench does
$L bench -m "$T/m.gguf" -p 16 -n 8 -d 40 -r 2 --no-membw --inproc >"$T/table.txt" 2>"$T/err" ||
    fail "bench -d 40: $(tail -1 "$T/err")"
grep -q "| pp16 @ d40 | " "$T/table.txt" && grep -q "| tg8 @ d40 | " "$T/table.txt" ||
    fail "bench -d 40: table rows missing"
$L bench -m "$T/m.gguf" -p 0 -n 8 -d 40 -r 2 --no-membw --inproc --json >"$T/json.txt" \
    2>"$T/err" || fail "bench -d 40 --json"
tail -1 "$T/json.txt" | python3 -c '
import json, sys
d = json.loads(sys.stdin.read())
assert d["depth"] == 40 and d["tg"] == 8 and d["tg_tps"] > 0, d
' || fail "bench -d 40 --json: bad JSON line: $(tail -1 "$T/json.txt")"
$L bench -m "$T/m.gguf" -p 0 -n 2 -d 4100 -r 1 --no-membw --inproc >/dev/null 2>"$T/err" ||
    fail "bench -d 4100: $(tail -1 "$T/err")"
grep -q "trained context of 4096" "$T/err" || fail "no warning past the trained context"
$L bench -m "$T/m.gguf" -d 8 --parallel 2 --devices cpu >/dev/null 2>"$T/err" &&
    fail "-d with --parallel accepted"
grep -q "n-depth" "$T/err" || fail "no message for -d with --parallel"
$L bench -m "$T/m.gguf" -p 0 -n 0 >/dev/null 2>"$T/err" && fail "-p 0 -n 0 accepted"
grep -q "nothing to measure" "$T/err" || fail "no message for -p 0 -n 0"
$L bench -m "$T/m.gguf" --backend cuda:0 >/dev/null 2>"$T/err" && fail "--backend without --inproc accepted"
$L bench -m "$T/nope.gguf" -r 1 >/dev/null 2>&1 && fail "missing model accepted"
echo "test_bench: $fails failure(s)"
[ $fails -eq 0 ]
