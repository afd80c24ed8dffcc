# Supervising the ranks of a job (ranks/): the exit policy both supervisors share, a rank's
# environment, the rendezvous listener, comm's shm segment names.
include(${CMAKE_CURRENT_LIST_DIR}/common.cmake)
astrai_c_test(test_ranks tests/test_ranks.c)
