#!/bin/sh
# sys_shm_small: shm_create on a /dev/shm too small for the expert segment
# fails up front with "need X bytes in /dev/shm, it has Y free" and a normal
# exit (no SIGBUS), leaves no segment behind, and succeeds on a tmpfs that is
# large enough (the segment of the qwen3next q8_0 fixture is 50 MiB).
#
# The tmpfs is mounted over /dev/shm in a private mount namespace
# (`unshare -m`, or `unshare -r -m` through a user namespace when not root),
# so the host's /dev/shm is never touched. Where neither works, the test falls
# back to RLIMIT_FSIZE (`ulimit -f`), which shm_create checks up front in the
# same way; SHM_SMALL_MODE=rlimit forces that fallback.
# Runs $BUILD/tests/test_shm --create-helper (exit 0 created, 2 refused for
# lack of room with the message, 1 anything else).
BIN="${BUILD:-build}/tests/test_shm"
export BIN

fail() { echo "FAIL: $*"; exit 1; }

# Runs the helper; sets rc and out (stdout and stderr together).
run_helper() {
    out=$("$BIN" --create-helper 2>&1)
    rc=$?
    echo "$out" | grep -E 'helper:|error' | sed 's/^/    /'
}

# Inside the private mount namespace: one too-small tmpfs, one large enough.
inside() {
    mount -t tmpfs -o size=1m,mode=1777 tmpfs /dev/shm || fail "cannot mount a 1 MiB tmpfs"
    run_helper
    [ $rc -lt 128 ] || fail "helper died of signal $((rc - 128)) on a 1 MiB /dev/shm"
    [ $rc -eq 2 ] || fail "helper exit $rc on a 1 MiB /dev/shm, expected 2"
    echo "$out" | grep -q 'need [0-9]* bytes in /dev/shm, it has [0-9]* free' ||
        fail "no 'need X bytes in /dev/shm, it has Y free' message"
    [ -z "$(ls -A /dev/shm)" ] || fail "left in /dev/shm: $(ls -A /dev/shm)"
    echo "ok: 1 MiB tmpfs refused up front, nothing left"
    msg=$(echo "$out" | grep -o 'need [0-9]* bytes in /dev/shm, it has [0-9]* free' | head -n 1)
    echo "[measure] shm on a 1 MiB tmpfs: refused, $msg"
    umount /dev/shm || fail "umount"

    mount -t tmpfs -o size=64m,mode=1777 tmpfs /dev/shm || fail "cannot mount a 64 MiB tmpfs"
    run_helper
    [ $rc -eq 0 ] || fail "helper exit $rc on a 64 MiB /dev/shm, expected 0"
    [ -z "$(ls -A /dev/shm)" ] || fail "left in /dev/shm: $(ls -A /dev/shm)"
    echo "ok: 64 MiB tmpfs holds the segment, destroy left nothing"
    echo "[measure] shm on a 64 MiB tmpfs: created and removed, nothing left"
    umount /dev/shm
    exit 0
}

if [ "$1" = "--inside" ]; then
    inside
fi

[ -x "$BIN" ] || fail "missing $BIN (build it with make)"

if [ "${SHM_SMALL_MODE:-}" != rlimit ]; then
    for ns in "unshare -m --propagation private" "unshare -r -m --propagation private"; do
        if $ns true 2>/dev/null; then
            echo "mode: $ns"
            $ns sh "$0" --inside
            exit $?
        fi
    done
fi

echo "mode: RLIMIT_FSIZE fallback (no private mount namespace here)"
# 1024 blocks is at most 1 MiB whatever the shell's block size for -f.
out=$( (ulimit -f 1024 && "$BIN" --create-helper) 2>&1 )
rc=$?
echo "$out" | grep -E 'helper:|error' | sed 's/^/    /'
[ $rc -lt 128 ] || fail "helper died of signal $((rc - 128))"
[ $rc -eq 2 ] || fail "helper exit $rc under ulimit -f, expected 2"
echo "$out" | grep -q 'need [0-9]* bytes in /dev/shm' || fail "no 'need X bytes' message"
name=$(echo "$out" | grep -o '/lamina-[0-9]*-[0-9a-f]*-[0-9]*' | head -n 1)
[ -n "$name" ] || fail "no segment name in the message"
[ ! -e "/dev/shm$name" ] || fail "/dev/shm$name left behind"
echo "ok: refused up front under ulimit -f, $name not left"
echo "[measure] shm under ulimit -f (no mount namespace here): refused up front, nothing left"
exit 0
