#!/bin/sh
# Runs each test binary given, then the shell tests tests/sys_*.sh, and ends
# with one "N passed, N failed" line. Each test's output goes to
# $BUILD/tests/logs/NAME.log and is printed when it fails.
BUILD=${BUILD:-build}
mkdir -p "$BUILD/tests/logs"
pass=0; fail=0; failed=""
for t in "$@" ${SYS_GLOB:-tests/sys_*.sh tests/test_*.sh}; do
    [ -e "$t" ] || continue
    name=$(basename "$t" .sh)
    log="$BUILD/tests/logs/$name.log"
    start=$(date +%s)
    case "$t" in
        *.sh) BUILD="$BUILD" sh "$t" >"$log" 2>&1 ;;
        *) "$t" >"$log" 2>&1 ;;
    esac
    rc=$?
    secs=$(( $(date +%s) - start ))
    if [ $rc -eq 0 ]; then
        pass=$((pass + 1)); echo "PASS $name (${secs}s)"
        grep '^\[measure\]' "$log" | sed 's/^/    /'
    else
        fail=$((fail + 1)); failed="$failed $name"; echo "FAIL $name (rc=$rc, ${secs}s)"
        tail -n 40 "$log" | sed 's/^/    /'
    fi
done
[ -n "$failed" ] && echo "failed:$failed"
echo "$pass passed, $fail failed"
[ $fail -eq 0 ]
