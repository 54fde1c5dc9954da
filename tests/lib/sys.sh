# Shared by the shell system tests (sourced from the repository root: `. tests/lib/sys.sh`):
# fail/ok count and print outcomes into $fails, and check_clean asserts that a coordinator left
# nothing behind.

fails=0
fail() { echo "FAIL: $*"; fails=$((fails + 1)); }
ok() { echo "ok: $*"; }

# check_clean WHAT PID: no worker of coordinator PID (its runtime directory is in the
# endpoint) and no shm segment of PID is left; leftover workers are killed.
check_clean() {
    sleep 0.2
    left=$(pgrep -f "lamina-worker --connect ipc://.*/lamina-$2-" | tr '\n' ' ')
    if [ -n "$left" ]; then
        fail "$1: lamina-worker processes left: $left"
        kill -9 $left 2>/dev/null
    fi
    if ls /dev/shm 2>/dev/null | grep -q "^lamina-$2-"; then
        fail "$1: shm segment of pid $2 left: $(ls /dev/shm | grep "^lamina-$2-")"
    fi
}
