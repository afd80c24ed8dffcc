# astraid end to end: a real daemon on its real socket, real astrai-train ranks, tiny models.
include(${CMAKE_CURRENT_LIST_DIR}/common.cmake)
foreach(t jobs pause restart failures bad_input systemd)
  astrai_py_test(daemon_${t} test_daemon_${t}.py)
  set_tests_properties(daemon_${t} PROPERTIES TIMEOUT 300 LABELS daemon)
endforeach()
