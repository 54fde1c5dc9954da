#!/bin/sh
# lamina plan --probe: stated figures are used and logged, "off" gives a plan
# that does not depend on the machine (two runs print the same table), and a
# malformed figure is refused naming it.
set -u
BUILD=${BUILD:-build}
L=$BUILD/lamina
FX=${LAMINA_FIXTURES:-../shared/fixtures}
M=$FX/small-model/qwen3next-small-q8_0.gguf
T=$(mktemp -d /tmp/lamina-plan-XXXXXX)
trap 'rm -rf "$T"' EXIT
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }
LAMINA_LOG=info $L plan -m "$M" --device-mem 40M --probe cpu=20 >"$T/a.txt" 2>"$T/a.err" ||
    fail "plan --probe cpu=20: $(tail -1 "$T/a.err")"
grep -q "\[probe\] device cpu: gemv 20.0 GB/s (stated)" "$T/a.err" ||
    fail "the stated figure is not logged: $(grep probe "$T/a.err")"
grep -q "lm head" "$T/a.txt" || fail "no plan table"
for i in 1 2; do
    $L plan -m "$M" --devices cpu,cpu --device-mem 20M,30M --probe off >"$T/off$i.txt" \
        2>"$T/off.err" || fail "plan --probe off: $(tail -1 "$T/off.err")"
done
cmp -s "$T/off1.txt" "$T/off2.txt" || fail "--probe off: two runs differ"
if $L plan -m "$M" --device-mem 40M --probe cpu=fast >/dev/null 2>"$T/bad.err"; then
    fail "a malformed probe figure was accepted"
else
    grep -q "cpu=fast" "$T/bad.err" || fail "refusal does not name the figure: $(tail -1 "$T/bad.err")"
fi
[ $fails = 0 ] && echo "test_plan_cli: all checks passed"
exit $fails
