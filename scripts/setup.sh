#!/bin/sh
# Installs astrai's build and test dependencies from Debian packages (idempotent).
set -eu
PKGS="build-essential cmake pkg-config clang libclang-rt-14-dev libomp-dev \
libopenblas-dev libopenblas-openmp-dev libcjson-dev libsqlite3-dev libuv1-dev sqlite3 systemd \
python3 python3-torch python3-numpy"
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
