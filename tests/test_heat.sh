#!/bin/sh
# Recorded routing heat (--record-heat): perplexity over the small trained
# model's held-out text writes a heat file whose counts match the fixture's
# independently measured heat.json (same 2048 tokens, top-4 of 32 experts in
# 8 layers) for all but a few near-tie routes (measured 2.4 % of routes moved;
# bound 5 %), that `lamina plan --heat` reads; lamina run --inproc records
# top_k picks for every token; a cluster run and an unwritable path are
# refused with a clear message and nothing left behind.
set -u
BUILD=${BUILD:-build}
L=$BUILD/lamina
FX=${LAMINA_FIXTURES:-../shared/fixtures}
T=$(mktemp -d /tmp/lamina-heat-XXXXXX)
trap 'rm -rf "$T"' EXIT
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }
export LAMINA_LOG=warn
SM=$FX/small-model
$L perplexity -m "$SM/qwen3next-small-q8_0.gguf" -f "$SM/eval.txt" -c 512 --chunks 4 \
    --record-heat "$T/heat.json" >"$T/ppl.txt" 2>"$T/err" || fail "perplexity --record-heat: $(tail -1 "$T/err")"
python3 - "$T/heat.json" "$SM/heat.json" <<'PY' || fail "recorded heat against the fixture's"
import json, sys
a, b = json.load(open(sys.argv[1])), json.load(open(sys.argv[2]))
(ka, A), = a.items()
B = next(v for k, v in b.items() if k.startswith("heat"))
assert ka == "heat_recorded_2048_tokens", ka
assert len(A) == len(B) == 8 and all(len(r) == 32 for r in A), "shape"
assert all(sum(r) == 2048 * 4 for r in A), "every layer routes 2048 x 4"
moved = sum(abs(x - y) for ra, rb in zip(A, B) for x, y in zip(ra, rb)) / 2
share = moved / (8 * 2048 * 4)
print("[measure] recorded heat vs fixture heat.json: %d of %d routes moved (%.2f %%)"
      % (moved, 8 * 2048 * 4, 100 * share))
sys.exit(0 if share <= 0.05 else 1)
PY
$L plan -m "$SM/qwen3next-small-q8_0.gguf" --devices cpu --device-mem 40M --heat "$T/heat.json" \
    >"$T/plan.txt" 2>"$T/err" || fail "lamina plan --heat with the recorded file: $(tail -1 "$T/err")"
$L gen-model --arch qwen3moe --shape tiny --type q8_0 --seed 3 -o "$T/m.gguf" >/dev/null 2>&1 ||
    fail "gen-model"
$L run -m "$T/m.gguf" -p "one two three" -n 5 --greedy --ignore-eos --inproc \
    --record-heat "$T/run.json" >/dev/null 2>"$T/err" || fail "run --record-heat: $(tail -1 "$T/err")"
python3 - "$T/run.json" <<'PY' || fail "run heat: every token counted top_k times per layer"
import json, sys
(k, H), = json.load(open(sys.argv[1])).items()
n = int(k.split("_")[-2])
sums = {sum(r) for r in H}
assert len(sums) == 1 and n > 5, (k, sums)
print("[measure] lamina run --record-heat: %d tokens, %d picks per layer" % (n, sums.pop()))
PY
if $L run -m "$T/m.gguf" -p "one" -n 2 --devices cpu --record-heat "$T/no.json" >/dev/null \
    2>"$T/err"; then
    fail "a cluster run with --record-heat was accepted"
else
    grep -q "record-heat counts the routing of the in-process" "$T/err" ||
        fail "cluster refusal message: $(tail -1 "$T/err")"
    [ ! -e "$T/no.json" ] || fail "a refused run wrote a heat file"
fi
if $L run -m "$T/m.gguf" -p "one" -n 2 --inproc --record-heat /nonexistent-dir/h.json >/dev/null \
    2>"$T/err"; then
    fail "an unwritable --record-heat path was accepted"
else
    grep -q "/nonexistent-dir/h.json" "$T/err" || fail "unwritable path message: $(tail -1 "$T/err")"
fi
[ "$(ls /dev/shm | grep -c lamina)" = 0 ] || fail "shm left behind"
[ $fails = 0 ] && echo "test_heat: all checks passed"
exit $fails
