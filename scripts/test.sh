#!/bin/sh
# Sets up and runs every test: the suite built with gcc (Release), then the same
# suite built with clang under AddressSanitizer + UndefinedBehaviorSanitizer, with
# the libFuzzer harnesses run for a bounded time.
set -eu
cd "$(dirname "$0")/.."
./scripts/setup.sh test
jobs=$(nproc)

cmake -S . -B build -DCMAKE_BUILD_TYPE=Release
cmake --build build -j"$jobs"
ctest --test-dir build --output-on-failure

CC=clang cmake -S . -B build-asan -DCMAKE_BUILD_TYPE=RelWithDebInfo -DASTRAI_SANITIZE=ON -DASTRAI_FUZZ=ON
cmake --build build-asan -j"$jobs"
ASAN_OPTIONS=detect_leaks=1:abort_on_error=1 UBSAN_OPTIONS=print_stacktrace=1:halt_on_error=1 \
    ctest --test-dir build-asan --output-on-failure
