# Out of memory at each allocation of astrai-train's and astraid's start paths
# (tests/test_out_of_memory.py), injected by an LD_PRELOAD library (tests/fail_alloc.c).
# Not in the sanitizer build: ASan's runtime replaces malloc inside the binaries, so a
# preloaded malloc is never called (and ASan insists on being first in the library list).
include(${CMAKE_CURRENT_LIST_DIR}/common.cmake)
if(NOT ASTRAI_SANITIZE)
  add_library(fail_alloc SHARED ${CMAKE_CURRENT_LIST_DIR}/fail_alloc.c)
  set_target_properties(fail_alloc PROPERTIES LIBRARY_OUTPUT_DIRECTORY ${CMAKE_BINARY_DIR}
    C_VISIBILITY_PRESET hidden)
  target_link_libraries(fail_alloc PRIVATE ${CMAKE_DL_LIBS})
  astrai_py_test(out_of_memory test_out_of_memory.py)
  set_tests_properties(out_of_memory PROPERTIES TIMEOUT 600 LABELS "daemon;faults")
endif()
