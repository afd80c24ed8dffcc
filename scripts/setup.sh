#!/bin/sh
# Installs astrai's dependencies from Debian packages (idempotent).
#   scripts/setup.sh        what building and running needs
#   scripts/setup.sh test   also what the tests need (clang + sanitizer runtimes and libFuzzer,
#                           PyTorch for the numerical reference, systemd-analyze, Prometheus
#                           and headless Chromium for the metrics and web page tests, a
#                           one-host Slurm cluster for the slurm executor's)
set -eu
PKGS="build-essential cmake pkg-config libomp-dev libopenblas-dev libopenblas-openmp-dev \
libcjson-dev libyaml-dev libsqlite3-dev libuv1-dev libmicrohttpd-dev sqlite3 libdnnl-dev"
if [ "${1:-}" = test ]; then
    PKGS="$PKGS clang libclang-rt-14-dev systemd python3 python3-torch python3-numpy \
prometheus chromium slurmctld slurmd slurm-client munge"
fi
missing=""
for p in $PKGS; do
    dpkg-query -W -f='${Status}' "$p" 2>/dev/null | grep -q "install ok installed" || missing="$missing $p"
done
if [ -n "$missing" ]; then
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq
    # shellcheck disable=SC2086
    apt-get install -y -qq --no-install-recommends $missing
fi
