#!/bin/sh
# System test of tools/plot_timings.py on a real timing dump:
#   1. a tiny generated qwen3next model, `lamina run --devices cpu,cpu --timings`
#      writes a dump (one JSON line per worker per step);
#   2. the script exits 0, writes a PNG (magic bytes, > 20 KB) and prints a
#      summary whose per-worker steps, tokens and total ms equal what the dump
#      holds (counted here with grep/awk, not with the script's parser) and whose
#      steps equal the table `lamina run` printed;
#   3. a copy with a garbage line, a blank line and a non-worker line gives the
#      same steps and counts the garbage as 1 unparsable line;
#   4. an empty and a missing dump fail with a clear message.
# Skips (exit 0) only when no python3 with matplotlib is found.
# ok() and fail() always return 0, so "A && ok || fail" is an if-then-else here.
# shellcheck disable=SC2015
set -u
BUILD=${BUILD:-build}
L=$BUILD/lamina
SCRIPT=tools/plot_timings.py
fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }
ok() { echo "ok: $*"; }

PY=
for p in python3 /usr/bin/python3; do
    if command -v "$p" >/dev/null 2>&1 && "$p" -c 'import matplotlib' 2>/dev/null; then
        PY=$p
        break
    fi
done
if [ -z "$PY" ]; then
    echo "skipped: python3-matplotlib missing (sudo sh tools/install-deps.sh installs it)"
    exit 0
fi
echo "using $PY ($("$PY" -c 'import matplotlib; print("matplotlib", matplotlib.__version__)'))"

T=$(mktemp -d /tmp/lamina-plot-XXXXXX)
trap 'rm -rf "$T"' EXIT

# 1. a real dump
if ! $L gen-model --arch qwen3next --shape tiny --type q8_0 -o "$T/tiny.gguf" >"$T/gen.log" 2>&1; then
    fail "gen-model: $(tail -1 "$T/gen.log")"
    exit 1
fi
if ! LAMINA_LOG=info $L run -m "$T/tiny.gguf" -p hello -n 64 --devices cpu,cpu --resident 50% \
        --no-echo --timings "$T/t.jsonl" >"$T/run.out" 2>"$T/run.err"; then
    fail "lamina run --timings: $(grep -m1 error "$T/run.err")"
    exit 1
fi
lines=$(wc -l <"$T/t.jsonl")
[ "$lines" -gt 0 ] && ok "lamina run wrote $lines timing lines" || fail "empty dump"

# 2. plot and summary
if "$PY" $SCRIPT "$T/t.jsonl" -o "$T/t.png" --title "sys_plot_timings" >"$T/sum.txt" 2>"$T/sum.err"; then
    ok "plot_timings exits 0"
else
    fail "plot_timings failed: $(cat "$T/sum.err")"
fi
if [ -f "$T/t.png" ]; then
    magic=$(od -An -tx1 -N8 "$T/t.png" | tr -d ' \n')
    [ "$magic" = 89504e470d0a1a0a ] && ok "PNG magic bytes" || fail "not a PNG: $magic"
    size=$(wc -c <"$T/t.png")
    [ "$size" -gt 20000 ] && ok "PNG is $size bytes" || fail "PNG only $size bytes"
    echo "[measure] timing plot of a 2-worker, 64-token run: $size bytes"
else
    fail "no PNG written"
fi

# Column $2 of the summary row of worker $1 in file $3 ("| w | device | layers | steps | tokens
# | total ms |" for the script, "| w | layers | steps | tokens | total ms |" for lamina run).
col() { awk -F'|' -v w="$1" -v c="$2" '$2 + 0 == w && $2 ~ /^ *[0-9]+ *$/ { gsub(/ /, "", $c); print $c }' "$3"; }

rows=$(grep -c '^| [0-9]' "$T/sum.txt")
[ "$rows" -eq 2 ] && ok "summary has 2 worker rows" || fail "summary has $rows worker rows"
for w in 0 1; do
    steps=$(grep -c "\"worker\":$w," "$T/t.jsonl")
    tokens=$(grep "\"worker\":$w," "$T/t.jsonl" | sed 's/.*"tokens":\([0-9]*\).*/\1/' |
             awk '{ s += $1 } END { print s + 0 }')
    total=$(grep "\"worker\":$w," "$T/t.jsonl" | sed 's/.*"total":\([0-9.]*\).*/\1/' |
            awk '{ s += $1 } END { printf "%.1f", s }')
    s_steps=$(col $w 5 "$T/sum.txt"); s_tokens=$(col $w 6 "$T/sum.txt"); s_total=$(col $w 7 "$T/sum.txt")
    l_steps=$(col $w 4 "$T/run.err")
    [ "$steps" -gt 0 ] || fail "worker $w: no lines in the dump"
    [ "$s_steps" = "$steps" ] && ok "worker $w: summary steps $s_steps = dump lines $steps" ||
        fail "worker $w: summary steps '$s_steps' != dump lines $steps"
    [ "$s_tokens" = "$tokens" ] && ok "worker $w: summary tokens $s_tokens = dump sum $tokens" ||
        fail "worker $w: summary tokens '$s_tokens' != dump sum $tokens"
    # the script sums unrounded values, awk the 3-decimal ones: equal to 0.1 ms
    if awk -v a="$s_total" -v b="$total" 'BEGIN { d = a - b; exit !(a != "" && d < 0.11 && d > -0.11) }'; then
        ok "worker $w: summary total $s_total ms = dump sum $total ms"
    else
        fail "worker $w: summary total '$s_total' ms != dump sum $total ms"
    fi
    [ "$l_steps" = "$s_steps" ] && ok "worker $w: steps match lamina run's table ($l_steps)" ||
        fail "worker $w: lamina run's table says '$l_steps' steps, summary '$s_steps'"
done

# 3. tolerance of bad lines
{ echo 'not json {'; cat "$T/t.jsonl"; echo; echo '{"coordinator":0,"ms":{"embed":0.1}}'; } >"$T/bad.jsonl"
if "$PY" $SCRIPT "$T/bad.jsonl" >"$T/bad.txt" 2>"$T/bad.err"; then
    [ "$(col 0 5 "$T/bad.txt")" = "$(col 0 5 "$T/sum.txt")" ] &&
        [ "$(col 1 5 "$T/bad.txt")" = "$(col 1 5 "$T/sum.txt")" ] &&
        ok "garbage, blank and coordinator lines leave the step counts unchanged" ||
        fail "step counts changed by bad lines"
    n_other=$(( $(grep -c '"coordinator"' "$T/t.jsonl") + 1 )) # the run's own + the injected one
    grep -q " $n_other other records, 1 unparsable, 1 blank" "$T/bad.txt" &&
        ok "bad lines counted: $(tail -1 "$T/bad.txt")" || fail "counts line: $(tail -1 "$T/bad.txt")"
else
    fail "plot_timings failed on a dump with a bad line: $(cat "$T/bad.err")"
fi

# 4. empty and missing dumps
: >"$T/empty.jsonl"
if "$PY" $SCRIPT "$T/empty.jsonl" -o "$T/e.png" >/dev/null 2>"$T/e.err"; then
    fail "empty dump accepted"
else
    grep -q "empty" "$T/e.err" && ok "empty dump: $(cat "$T/e.err")" || fail "empty dump message: $(cat "$T/e.err")"
fi
[ ! -e "$T/e.png" ] || fail "a PNG was written for an empty dump"
if "$PY" $SCRIPT "$T/missing.jsonl" -o "$T/m.png" >/dev/null 2>"$T/m.err"; then
    fail "missing dump accepted"
else
    grep -q "No such file" "$T/m.err" && ok "missing dump: $(cat "$T/m.err")" || fail "missing dump message: $(cat "$T/m.err")"
fi

echo "sys_plot_timings: $fails failure(s)"
[ $fails -eq 0 ]
