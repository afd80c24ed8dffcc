# GPU tests: the CUDA backend's ops against the CPU backend (test_gpu_ops) and the nccl
# backend's collectives at world size 1 (test_comm_nccl_gpu). Both exit 77, which ctest
# reports as SKIPPED with the reason printed, where no GPU is visible or CUDA/NCCL was not
# built; tests/gpu/run.sh runs them on a GPU machine.
include(${CMAKE_CURRENT_LIST_DIR}/common.cmake)
astrai_c_test(test_gpu_ops ${CMAKE_SOURCE_DIR}/tests/test_gpu_ops.c)
set_tests_properties(test_gpu_ops PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT 300 LABELS gpu)
astrai_c_test(test_comm_nccl_gpu ${CMAKE_SOURCE_DIR}/tests/test_comm_nccl_gpu.c)
set_tests_properties(test_comm_nccl_gpu PROPERTIES SKIP_RETURN_CODE 77 TIMEOUT 120 LABELS gpu)
