# bench_comm: shm all_reduce bus bandwidth and all_to_all bandwidth (2 forked ranks) against
# this machine's memcpy bandwidth, measured in the same run (bench/README.md); with
# `--backend gloo --rank R --world W --master A:P`, one rank of a gloo all_reduce bench
# (bench/bench_multihost.py runs one per namespaced host). Not a ctest test.
add_executable(bench_comm ${CMAKE_SOURCE_DIR}/bench/bench_comm.c)
target_link_libraries(bench_comm PRIVATE astrai_core)
# bench_comm_hier_rank: one rank of bench/bench_comm_hier.py (gloo vs hier all_reduce across
# namespaced hosts); shares the tests' file exchange.
if(ASTRAI_HAVE_GLOO)
  add_executable(bench_comm_hier_rank ${CMAKE_SOURCE_DIR}/bench/comm_hier_rank.c)
  target_include_directories(bench_comm_hier_rank PRIVATE ${CMAKE_SOURCE_DIR}/tests)
  target_link_libraries(bench_comm_hier_rank PRIVATE astrai_core)
endif()
