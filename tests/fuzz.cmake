# libFuzzer harnesses (tests/fuzz/), built only with ASTRAI_FUZZ=ON and clang:
#   CC=clang cmake -S . -B build-fuzz -DASTRAI_SANITIZE=ON -DASTRAI_FUZZ=ON
# Each runs for a bounded time as a ctest test, starting from the seeds in
# tests/fuzz/corpus/<name>/; new inputs go to <build>/fuzz_corpus/<name>/.
if(ASTRAI_FUZZ)
  if(NOT CMAKE_C_COMPILER_ID MATCHES "Clang")
    message(FATAL_ERROR "ASTRAI_FUZZ needs clang (CC=clang cmake ...), not ${CMAKE_C_COMPILER_ID}")
  endif()
  # Coverage instrumentation for the code under test; libFuzzer's main only in the harnesses.
  target_compile_options(astrai_core PRIVATE -fsanitize=fuzzer-no-link)
  foreach(name safetensors meta)
    add_executable(fuzz_${name} ${CMAKE_CURRENT_LIST_DIR}/fuzz/fuzz_${name}.c)
    target_link_libraries(fuzz_${name} PRIVATE astrai_core)
    target_compile_options(fuzz_${name} PRIVATE -fsanitize=fuzzer,address,undefined)
    target_link_options(fuzz_${name} PRIVATE -fsanitize=fuzzer,address,undefined)
    set(_work ${CMAKE_BINARY_DIR}/fuzz_corpus/${name})
    file(MAKE_DIRECTORY ${_work})
    add_test(NAME fuzz_${name}
      COMMAND fuzz_${name} -max_total_time=20 -rss_limit_mb=2048 ${_work}
              ${CMAKE_CURRENT_LIST_DIR}/fuzz/corpus/${name})
  endforeach()
endif()
