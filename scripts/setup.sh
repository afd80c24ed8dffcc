#!/bin/sh
# Installs astrai's dependencies from Debian packages (idempotent).
#   scripts/setup.sh        what building and running needs
#   scripts/setup.sh test   also what the tests need (clang + sanitizer runtimes and libFuzzer,
#                           PyTorch for the numerical reference, systemd-analyze, Prometheus
#                           and headless Chromium for the metrics and web page tests, a
#                           one-host Slurm cluster for the slurm executor's, gdb for the hang
#                           watchdog's stacks, iproute2 for the network-namespace hosts), and the venv
#                           .venv-hf (Debian's torch plus transformers and tokenizers from PyPI,
#                           pinned in tests/requirements-hf.txt) for the Hugging Face tests
set -eu
PKGS="build-essential cmake pkg-config libomp-dev libgloo-dev libopenblas-dev libopenblas-openmp-dev \
libcjson-dev libyaml-dev libsqlite3-dev libuv1-dev libmicrohttpd-dev sqlite3 libdnnl-dev \
libpcre2-dev libutf8proc-dev"
if [ "${1:-}" = test ]; then
    PKGS="$PKGS clang libclang-rt-14-dev systemd python3 python3-venv python3-torch python3-numpy \
prometheus chromium slurmctld slurmd slurm-client munge gdb iproute2"
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

# The Hugging Face peers run on Debian's torch: a venv that sees the system packages, with the
# pinned PyPI set installed once (the stamp records which requirements it holds).
if [ "${1:-}" = test ]; then
    root=$(cd "$(dirname "$0")/.." && pwd)
    venv="$root/.venv-hf" req="$root/tests/requirements-hf.txt"
    if ! cmp -s "$req" "$venv/requirements.stamp" 2>/dev/null; then
        rm -rf "$venv"
        /usr/bin/python3 -m venv --system-site-packages "$venv"
        "$venv/bin/pip" install -q --disable-pip-version-check --no-deps -r "$req"
        cp "$req" "$venv/requirements.stamp"
    fi
fi
