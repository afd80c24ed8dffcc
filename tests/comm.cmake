# Collectives (comm/): the shm backend with forked ranks, and the nccl backend's
# error paths on a machine without a GPU.
astrai_c_test(test_comm_shm ${CMAKE_SOURCE_DIR}/tests/test_comm_shm.c)
set_tests_properties(test_comm_shm PROPERTIES TIMEOUT 300)
astrai_c_test(test_comm_nccl ${CMAKE_SOURCE_DIR}/tests/test_comm_nccl.c)
# The gloo and hier backends with forked ranks on 127.0.0.1 (built when libgloo-dev is found).
if(ASTRAI_HAVE_GLOO)
  foreach(t test_comm_gloo test_comm_hier)
    astrai_c_test(${t} ${CMAKE_SOURCE_DIR}/tests/${t}.c)
    set_tests_properties(${t} PROPERTIES TIMEOUT 300)
  endforeach()
endif()
