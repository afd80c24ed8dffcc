#!/bin/bash
# fetch-debs.sh: downloads (apt-get download, no install) the Debian packages that building
# astrai needs and the bare GPU machine lacks, into .gpu-debs/ at the repository root
# (git-ignored), for tests/gpu/run.sh to unpack there with dpkg -x. Run it here, on a
# networked Debian 12 machine; idempotent: a package whose current version is already there
# is not fetched again, and older versions of it are removed.
#
#   bash tests/gpu/fetch-debs.sh
#
# What the build finds (CMakeLists.txt, daemon/daemon.cmake) and scripts/setup.sh installs:
#   sqlite3, libcjson, libuv,  pkg-config modules          -> the -dev packages + runtimes
#   yaml-0.1, libpcre2-8,
#   libutf8proc (tokenizers)
#   OpenBLAS (OpenMP build)    cblas.h + libopenblas.so    -> libopenblas*-openmp + metas
#   pkg-config itself          the GPU image may lack it   -> pkgconf (+ its library)
#   OpenBLAS's runtime deps    libgfortran5, libquadmath0, libgomp1 (run.sh unpacks them
#                              only where the machine has no such library)
# Not fetched: compilers, cmake, CUDA, NCCL (the GPU image has them; run.sh checks), and
# libomp-dev (clang's OpenMP: the GPU build uses gcc's libgomp).
set -euo pipefail

ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
DEST=$ROOT/.gpu-debs
PKGS="libcjson-dev libcjson1 libsqlite3-dev libsqlite3-0 libuv1-dev libuv1 libyaml-dev libyaml-0-2
libopenblas-dev libopenblas0 libopenblas-openmp-dev libopenblas0-openmp
libgfortran5 libquadmath0 libgomp1 pkgconf pkgconf-bin libpkgconf3 pkg-config
libpcre2-dev libpcre2-8-0 libpcre2-16-0 libpcre2-32-0 libpcre2-posix3 libutf8proc-dev libutf8proc2"

mkdir -p "$DEST"
cd "$DEST"

# apt's lists are needed to know the candidate versions; fetch them once if they are absent.
if ! apt-cache show --no-all-versions libcjson-dev >/dev/null 2>&1; then
    apt-get update -qq
fi

arch=$(dpkg --print-architecture)
# As root, download as root: apt's _apt user may not write into this folder.
sandbox=()
if [ "$(id -u)" = 0 ]; then sandbox=(-o APT::Sandbox::User=root); fi
fetched=0
for p in $PKGS; do
    ver=$(apt-cache show --no-all-versions "$p" | sed -n 's/^Version: //p' | head -n1)
    [ -n "$ver" ] || { echo "fetch-debs: no candidate version for $p" >&2; exit 1; }
    pkg_arch=$(apt-cache show --no-all-versions "$p" | sed -n 's/^Architecture: //p' | head -n1)
    # apt-get download's file name: the epoch's ':' is written %3a.
    file="${p}_${ver//:/%3a}_${pkg_arch:-$arch}.deb"
    for old in "${p}"_*.deb; do
        [ -e "$old" ] && [ "$old" != "$file" ] && rm -f -- "$old"
    done
    if [ ! -s "$file" ]; then
        apt-get download -qq "${sandbox[@]}" "$p=$ver"
        fetched=$((fetched + 1))
    fi
    [ -s "$file" ] || { echo "fetch-debs: $file missing after apt-get download" >&2; exit 1; }
done

n=$(ls -1 "$DEST"/*.deb | wc -l)
size=$(du -ch "$DEST"/*.deb | tail -n1 | cut -f1)
echo "fetch-debs: $n packages in $DEST ($size; fetched $fetched now)"
