#!/bin/sh
# Installs the Debian packages lamina builds and tests with; as root, or
# through sudo when it is there. Safe to run again. The CUDA toolkit is not a Debian package
# here: when nvcc is on PATH or in /usr/local/cuda, `make` also builds the
# CUDA kernels; without it the CPU engine builds and runs alone.
set -eu
PKGS="build-essential pkg-config libpcre2-dev libzmq3-dev libprotobuf-c-dev protobuf-c-compiler
      python3 python3-numpy python3-matplotlib bc procps util-linux"
missing=""
for p in $PKGS; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -z "$missing" ]; then
    echo "install-deps: all packages present"
    exit 0
fi
if [ "$(id -u)" -ne 0 ]; then
    if command -v sudo >/dev/null 2>&1; then
        exec sudo sh "$0" "$@"
    fi
    echo "install-deps: need root to install:$missing (run as root)" >&2
    exit 1
fi
export DEBIAN_FRONTEND=noninteractive
apt-get update -qq
# shellcheck disable=SC2086
apt-get install -y -qq --no-install-recommends $missing
echo "install-deps: installed$missing"
