# Benchmarks (not ctest tests: they take minutes and their numbers depend on the machine).
# bench_sgemm_peak: the sgemm "peak" bench/bench_train.py measures MFU against.
add_executable(bench_sgemm_peak ${CMAKE_SOURCE_DIR}/bench/sgemm_peak.c)
target_link_libraries(bench_sgemm_peak PRIVATE astrai_core)
# bench_status_latency: C clients of astraid's `status` for bench/bench_daemon.py.
add_executable(bench_status_latency ${CMAKE_SOURCE_DIR}/bench/status_latency.c)
find_package(Threads REQUIRED)
target_link_libraries(bench_status_latency PRIVATE Threads::Threads)
