#!/bin/bash
# run.sh: everything a GPU machine must check for astrai, in one call (issue 7 §6). Runs ON
# the GPU machine (one H200, nvcc 13, cmake, python3 with torch; no Debian -dev packages, no
# network), from any directory, within a hard budget of ~8 minutes:
#   1. unpacks .gpu-debs/*.deb (tests/gpu/fetch-debs.sh, run beforehand on a networked
#      machine) with dpkg -x into .gpu-prefix/, and builds with CUDA into build-gpu/;
#   2. test_gpu_ops        per-op conformance, CUDA against the CPU backend, + determinism, in
#                          fp32, bf16 and fp16 (+ fp16 overflow to inf); its per-dtype lines
#                          go to the summary, and a pass without fp16 results fails;
#   3. test_comm_nccl_gpu  NCCL at world size 1 through the rendezvous, every collective,
#                          the abort path, comm_split;
#      test_model_stage    pipeline stages chained on the GPU give the whole model's loss and
#                          gradients (bf16 and fp32);
#   4. tests/gpu/train_checks.py  loss curves vs the CPU, determinism, GPU->CPU->GPU
#                          checkpoints, exact --resume, SIGTERM, --gradient_checkpointing,
#                          DPO/GRPO, the Hugging Face families' features (--group dense);
#      train_checks.py --group moe  MLA and DeepSeekMoE: mla+mlp, gqa+moe and mla+moe models,
#                          cuda (fp32, bf16, fp16) vs cpu, expert loads, determinism,
#                          --gradient_checkpointing (a part of its own, so that the dense
#                          checks cannot use up its time);
#   5. bench/bench_gpu.py  tokens/s, MFU, peak memory, side by side with PyTorch.
# Each part runs under `timeout`; a failed part does not stop the others. The report goes to
# $OUT/gpu-report/ (OUT: set by the device tool; default ./gpu-report), 8 files at most:
#   summary.txt build.log tests.log ops.json train.log train.json bench.log bench.json
# Exit 0 when every part passed, 1 otherwise (a test that SKIPs on the GPU machine fails).
#
# Environment: ASTRAI_GPU_BUDGET_S (total seconds, default 470), ASTRAI_GPU_CUDA_ARCH
# (default 90a), ASTRAI_GPU_BENCH_ARGS (extra bench_gpu.py flags, e.g. "--configs 125m").
set -euo pipefail

T0=$SECONDS
BUDGET=${ASTRAI_GPU_BUDGET_S:-470}
ROOT=$(cd "$(dirname "${BASH_SOURCE[0]}")/../.." && pwd)
cd "$ROOT"
DEBS=$ROOT/.gpu-debs
PREFIX=$ROOT/.gpu-prefix      # the -dev packages and their runtimes
FALLBACK=$PREFIX/fallback     # runtimes unpacked only where the machine lacks them
BUILD=$ROOT/build-gpu
LIBDIR=usr/lib/x86_64-linux-gnu

say() { echo "$*" | tee -a "$SUMMARY"; }

# Seconds a part may run: at most $1, leaving $2 for the parts after it.
limit() {
    local left=$((BUDGET - (SECONDS - T0) - $2))
    if ((left > $1)); then left=$1; fi
    echo "$left"
}

# part NAME SECONDS LOG CMD...: CMD under timeout, its output appended to LOG; one summary
# line. Returns CMD's status.
part() {
    local name=$1 t=$2 logf=$3 rc=0 start=$SECONDS
    shift 3
    if ((t < 10)); then
        say "FAIL $name: no time left in the ${BUDGET}s budget"
        FAILED=$((FAILED + 1))
        return 1
    fi
    echo "==== $name (timeout ${t}s): $*" >>"$logf"
    timeout --kill-after=10 "$t" "$@" >>"$logf" 2>&1 || rc=$?
    local secs=$((SECONDS - start)) where
    where="see $(basename "$logf")"
    case $rc in
    0) say "PASS $name (${secs}s)" ;;
    124 | 137) say "FAIL $name: timed out after ${t}s ($where)" ;;
    77) say "FAIL $name: skipped on the GPU machine: $(grep SKIPPED "$logf" | tail -n1 || true)" ;;
    *) say "FAIL $name: exit $rc after ${secs}s ($where)" ;;
    esac
    if ((rc == 0)); then PASSED=$((PASSED + 1)); else FAILED=$((FAILED + 1)); fi
    return "$rc"
}

# ---------------------------------------------------------------- 1. prefix and build
have_lib() { # whether the machine's loader finds soname $1
    ldconfig -p 2>/dev/null | grep -q "[[:space:]]$1 " ||
        [ -e "/usr/lib/x86_64-linux-gnu/$1" ] || [ -e "/lib/x86_64-linux-gnu/$1" ]
}

extract() { # extract DEB DIR: dpkg -x, or ar + tar where dpkg is missing
    if command -v dpkg-deb >/dev/null; then
        dpkg-deb -x "$1" "$2"
    else
        local tmp
        tmp=$(mktemp -d)
        (cd "$tmp" && ar x "$1" && tar -xf data.tar.* -C "$2")
        rm -rf "$tmp"
    fi
}

unpack() {
    if ! ls "$DEBS"/*.deb >/dev/null 2>&1; then
        echo "no .deb files in $DEBS: run tests/gpu/fetch-debs.sh on a networked machine and" \
            "name .gpu-debs in the device call's carry"
        return 1
    fi
    local stamp
    stamp=$(ls -l "$DEBS"/*.deb | md5sum | cut -d' ' -f1)
    if [ -f "$PREFIX/.stamp" ] && [ "$(cat "$PREFIX/.stamp")" = "$stamp" ]; then
        echo "prefix: $PREFIX is up to date"
        return 0
    fi
    rm -rf "$PREFIX"
    mkdir -p "$PREFIX" "$FALLBACK"
    local deb pkg so dest
    for deb in "$DEBS"/*.deb; do
        pkg=$(basename "$deb")
        pkg=${pkg%%_*}
        dest=$PREFIX
        case $pkg in
        libgomp1) so=libgomp.so.1 ;;
        libgfortran5) so=libgfortran.so.5 ;;
        libquadmath0) so=libquadmath.so.0 ;;
        *) so="" ;;
        esac
        if [ -n "$so" ]; then
            if have_lib "$so"; then
                echo "prefix: $pkg not needed (the machine has $so)"
                continue
            fi
            dest=$FALLBACK
        fi
        extract "$deb" "$dest"
        echo "prefix: $pkg -> ${dest#"$ROOT"/}"
    done
    # The .pc files name /usr: point them at the prefix.
    local pc
    for pc in "$PREFIX/$LIBDIR"/pkgconfig/*.pc "$PREFIX"/usr/share/pkgconfig/*.pc; do
        [ -f "$pc" ] || continue
        sed -i -E "s#^(prefix|exec_prefix|libdir|includedir)=/usr#\1=$PREFIX/usr#" "$pc"
    done
    # pkgconf needs its library: a wrapper that finds it (only used without a pkg-config).
    mkdir -p "$PREFIX/bin"
    cat >"$PREFIX/bin/pkg-config" <<EOF
#!/bin/sh
LD_LIBRARY_PATH="$PREFIX/$LIBDIR\${LD_LIBRARY_PATH:+:\$LD_LIBRARY_PATH}" exec "$PREFIX/usr/bin/pkgconf" "\$@"
EOF
    chmod +x "$PREFIX/bin/pkg-config"
    echo "$stamp" >"$PREFIX/.stamp"
}

# NCCL: the toolkit's or the system's, else the one in python3's nvidia-nccl wheel.
NCCL_ARGS=()
find_nccl() {
    local inc lib sp h
    for pair in /usr/local/cuda/include:/usr/local/cuda/lib64 \
        /usr/include:/usr/lib/x86_64-linux-gnu; do
        inc=${pair%%:*}
        lib=$(ls "${pair#*:}"/libnccl.so "${pair#*:}"/libnccl.so.2 2>/dev/null | head -n1 || true)
        if [ -f "$inc/nccl.h" ] && [ -n "$lib" ]; then
            NCCL_ARGS=(-DNCCL_INCLUDE="$inc" -DNCCL_LIB="$lib")
            return 0
        fi
    done
    for sp in $(python3 -c 'import site; print("\n".join(site.getsitepackages()))' 2>/dev/null); do
        h=$(find "$sp/nvidia" -maxdepth 4 -name nccl.h 2>/dev/null | head -n1 || true)
        [ -n "$h" ] || continue
        inc=$(dirname "$h")
        lib=$(find "$(dirname "$inc")" -maxdepth 2 -name 'libnccl.so*' 2>/dev/null | head -n1 || true)
        if [ -n "$lib" ]; then
            NCCL_ARGS=(-DNCCL_INCLUDE="$inc" -DNCCL_LIB="$lib")
            return 0
        fi
    done
    echo "NCCL not found (nccl.h + libnccl in /usr/local/cuda, /usr or python3's nvidia wheels)"
    return 1
}

build() {
    unpack
    find_nccl
    echo "nccl: ${NCCL_ARGS[*]}"
    if ! command -v nvcc >/dev/null && [ -x /usr/local/cuda/bin/nvcc ]; then
        export PATH=/usr/local/cuda/bin:$PATH
    fi
    local pkgconf gen=()
    pkgconf=$(command -v pkg-config || echo "$PREFIX/bin/pkg-config")
    command -v ninja >/dev/null && gen=(-G Ninja)
    # Only the prefix's .pc files: never a machine's own sqlite3.pc with our libraries.
    export PKG_CONFIG_LIBDIR=$PREFIX/$LIBDIR/pkgconfig:$PREFIX/usr/share/pkgconfig
    export PKG_CONFIG_PATH=
    # OpenBLAS: CMakeLists.txt looks for the OpenMP build under /usr only; name it here.
    cmake -S "$ROOT" -B "$BUILD" "${gen[@]}" -DCMAKE_BUILD_TYPE=Release \
        -DASTRAI_CUDA=ON -DCMAKE_CUDA_ARCHITECTURES="${ASTRAI_GPU_CUDA_ARCH:-90a}" \
        -DCMAKE_PREFIX_PATH="$PREFIX/usr" -DPKG_CONFIG_EXECUTABLE="$pkgconf" \
        -DOPENBLAS_OPENMP_LIB="$PREFIX/$LIBDIR/openblas-openmp/libopenblas.so" \
        -DCBLAS_OPENMP_INCLUDE_DIR="$PREFIX/usr/include/x86_64-linux-gnu/openblas-openmp" \
        -DASTRAI_PYTHON="$(command -v python3)" "${NCCL_ARGS[@]}"
    cmake --build "$BUILD" -j "$(nproc)" --target astrai-train astrai-model astrai-data \
        test_gpu_ops test_comm_nccl_gpu test_model_stage
}

# run.sh --build-step: step 1 alone (run.sh runs itself so that `timeout` can bound it).
if [ "${1:-}" = --build-step ]; then
    build
    exit 0
fi

REPORT=${OUT:-.}/gpu-report
mkdir -p "$REPORT"
REPORT=$(cd "$REPORT" && pwd)
rm -f "$REPORT"/*
SUMMARY=$REPORT/summary.txt
PASSED=0
FAILED=0

# ---------------------------------------------------------------- the machine
{
    echo "astrai GPU checks, $(date -u '+%Y-%m-%d %H:%M:%S UTC'), budget ${BUDGET}s"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 || true
    (nvcc --version 2>/dev/null || /usr/local/cuda/bin/nvcc --version 2>&1) | tail -n1 || true
    cmake --version 2>&1 | head -n1 || true
    python3 -c 'import torch; print("torch", torch.__version__, "cuda", torch.version.cuda)' \
        2>&1 | tail -n1 || true
} >>"$SUMMARY"

# Seconds kept for the parts after each: ops 60 (three dtypes), comm 15, train 90, train_moe
# 40, bench 60.
BUILT=0
if part build "$(limit 240 265)" "$REPORT/build.log" bash "$ROOT/tests/gpu/run.sh" --build-step
then
    BUILT=1
fi

# The binaries find the prefix's libraries through their RUNPATH; the fallback runtimes
# (OpenBLAS's own dependencies) through the loader path.
RUNENV=(env PYTHONUNBUFFERED=1)
if [ -d "$FALLBACK/$LIBDIR" ]; then
    RUNENV+=("LD_LIBRARY_PATH=$FALLBACK/$LIBDIR${LD_LIBRARY_PATH:+:$LD_LIBRARY_PATH}")
fi

# ---------------------------------------------------------------- 2-5. the checks
if ((BUILT)); then
    ops_rc=0
    part test_gpu_ops "$(limit 120 205)" "$REPORT/tests.log" \
        "${RUNENV[@]}" ASTRAI_GPU_REPORT_DIR="$REPORT" "$BUILD/test_gpu_ops" || ops_rc=$?
    # One line per dtype ("test_gpu_ops: fp16: 0 of 112 checks failed"). A pass with no fp16
    # line would be fp16 not checked at all (a dtype list or a backend that dropped it).
    grep -E '^test_gpu_ops: (fp32|bf16|fp16): ' "$REPORT/tests.log" | sed 's/^/     /' |
        tee -a "$SUMMARY" || true
    if ((ops_rc == 0)) && ! grep -q '^test_gpu_ops: fp16: ' "$REPORT/tests.log"; then
        say "FAIL test_gpu_ops: no fp16 results (see tests.log)"
        PASSED=$((PASSED - 1))
        FAILED=$((FAILED + 1))
    fi
    part test_comm_nccl_gpu "$(limit 45 190)" "$REPORT/tests.log" \
        "${RUNENV[@]}" "$BUILD/test_comm_nccl_gpu" || true
    part test_model_stage "$(limit 30 190)" "$REPORT/tests.log" \
        "${RUNENV[@]}" "$BUILD/test_model_stage" || true
    # The Python parts get a time limit 15 s inside their timeout, to stop cleanly and
    # still write their JSON.
    t=$(limit 180 100)
    part train_checks "$t" "$REPORT/train.log" "${RUNENV[@]}" python3 \
        tests/gpu/train_checks.py --build "$BUILD" --report "$REPORT" --group dense \
        --time-limit $((t > 30 ? t - 15 : t / 2)) || true
    # Into the same train.log, and train.json's key "moe" (the report's 8 files at most).
    t=$(limit 90 60)
    part train_moe "$t" "$REPORT/train.log" "${RUNENV[@]}" python3 \
        tests/gpu/train_checks.py --build "$BUILD" --report "$REPORT" --group moe \
        --time-limit $((t > 30 ? t - 15 : t / 2)) || true
    t=$(limit 240 0)
    # shellcheck disable=SC2086 # ASTRAI_GPU_BENCH_ARGS: flags, split on purpose
    part bench_gpu "$t" "$REPORT/bench.log" "${RUNENV[@]}" python3 bench/bench_gpu.py \
        --build "$BUILD" --json "$REPORT/bench.json" --time-limit $((t > 30 ? t - 15 : t / 2)) \
        ${ASTRAI_GPU_BENCH_ARGS:-} || true
else
    for name in test_gpu_ops test_comm_nccl_gpu test_model_stage train_checks train_moe \
        bench_gpu; do
        say "FAIL $name: not run (the build failed; see build.log)"
        FAILED=$((FAILED + 1))
    done
fi

# ---------------------------------------------------------------- summary
# (The PASS/FAIL lines of the parts are in summary.txt and on stdout already.)
{
    echo
    echo "---- details"
    grep -hE '^test_gpu_ops:|^test_comm_nccl_gpu:|^test_model_stage:|FAIL' "$REPORT/tests.log" 2>/dev/null |
        head -n 60 || true
    grep -hE '^(PASS|FAIL) ' "$REPORT/train.log" 2>/dev/null | head -n 60 || true
    grep -hE '^bench_gpu' "$REPORT/bench.log" 2>/dev/null | tail -n 6 || true
    echo
    echo "wall time $((SECONDS - T0))s of ${BUDGET}s"
    echo "$PASSED passed, $FAILED failed"
} | tee -a "$SUMMARY"
((FAILED == 0))
