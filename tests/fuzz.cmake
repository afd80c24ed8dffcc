# libFuzzer harnesses (tests/fuzz/), built only with ASTRAI_FUZZ=ON and clang:
#   CC=clang cmake -S . -B build-fuzz -DASTRAI_SANITIZE=ON -DASTRAI_FUZZ=ON
# Each runs for a bounded time as a ctest test, starting from the seeds in
# tests/fuzz/corpus/<name>/ (and the dictionary tests/fuzz/<name>.dict when there is one);
# new inputs go to <build>/fuzz_corpus/<name>/. A longer run by hand:
#   build-fuzz/fuzz_rpc -runs=1000000 build-fuzz/fuzz_corpus/rpc tests/fuzz/corpus/rpc
if(ASTRAI_FUZZ)
  if(NOT CMAKE_C_COMPILER_ID MATCHES "Clang")
    message(FATAL_ERROR "ASTRAI_FUZZ needs clang (CC=clang cmake ...), not ${CMAKE_C_COMPILER_ID}")
  endif()
  # Coverage instrumentation for the code under test; libFuzzer's main only in the harnesses.
  get_property(_layers GLOBAL PROPERTY ASTRAI_LAYERS)
  foreach(layer ${_layers})
    target_compile_options(astrai_${layer} PRIVATE -fsanitize=fuzzer-no-link)
  endforeach()
  foreach(name safetensors meta rpc job_spec config)
    add_executable(fuzz_${name} ${CMAKE_CURRENT_LIST_DIR}/fuzz/fuzz_${name}.c)
    target_link_libraries(fuzz_${name} PRIVATE astrai_core)
    target_compile_options(fuzz_${name} PRIVATE -fsanitize=fuzzer,address,undefined)
    target_link_options(fuzz_${name} PRIVATE -fsanitize=fuzzer,address,undefined)
    set(_work ${CMAKE_BINARY_DIR}/fuzz_corpus/${name})
    file(MAKE_DIRECTORY ${_work})
    set(_dict ${CMAKE_CURRENT_LIST_DIR}/fuzz/${name}.dict)
    set(_dict_arg)
    if(EXISTS ${_dict})
      set(_dict_arg -dict=${_dict})
    endif()
    add_test(NAME fuzz_${name}
      COMMAND fuzz_${name} -max_total_time=20 -rss_limit_mb=2048 ${_dict_arg} ${_work}
              ${CMAKE_CURRENT_LIST_DIR}/fuzz/corpus/${name})
  endforeach()
  # The config file's parser is astraid's (daemon/config.c; daemon.h includes uv.h).
  target_sources(fuzz_config PRIVATE ${CMAKE_SOURCE_DIR}/daemon/config.c)
  target_link_libraries(fuzz_config PRIVATE PkgConfig::LIBUV)
endif()
