# The helpers every binary shares: the flag parser (common/flags) and the growable buffer
# (common/buf).
include(${CMAKE_CURRENT_LIST_DIR}/common.cmake)
astrai_c_test(test_flags tests/test_flags.c)
