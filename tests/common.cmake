# Shared helpers for the test files tests/*.cmake (one file per area).
set(ASTRAI_PYTHON /usr/bin/python3 CACHE FILEPATH "Python with torch (Debian python3-torch)")
set(ASTRAI_HF_PYTHON ${CMAKE_SOURCE_DIR}/.venv-hf/bin/python CACHE FILEPATH
    "Python with torch, transformers and tokenizers (the venv scripts/setup.sh test makes)")

# astrai_c_test(NAME SOURCES...): a C test program linked to the core, run by ctest.
function(astrai_c_test name)
  add_executable(${name} ${ARGN})
  target_link_libraries(${name} PRIVATE astrai_core)
  target_include_directories(${name} PRIVATE ${CMAKE_SOURCE_DIR}/tests)
  add_test(NAME ${name} COMMAND ${name} WORKING_DIRECTORY ${CMAKE_CURRENT_BINARY_DIR})
endfunction()

# astrai_py_test(NAME SCRIPT [ARGS...]): a Python test (PyTorch reference), given the
# build directory in $ASTRAI_BUILD so it finds the binaries.
function(astrai_py_test name script)
  add_test(NAME ${name} COMMAND ${ASTRAI_PYTHON} ${CMAKE_SOURCE_DIR}/tests/${script} ${ARGN})
  astrai_py_test_env(${name})
endfunction()

# astrai_hf_test(NAME SCRIPT [ARGS...]): the same with the Hugging Face peers
# (transformers, tokenizers) importable.
function(astrai_hf_test name script)
  add_test(NAME ${name} COMMAND ${ASTRAI_HF_PYTHON} ${CMAKE_SOURCE_DIR}/tests/${script} ${ARGN})
  astrai_py_test_env(${name})
endfunction()

function(astrai_py_test_env name)
  set_tests_properties(${name} PROPERTIES
    ENVIRONMENT "ASTRAI_BUILD=${CMAKE_BINARY_DIR};ASTRAI_SRC=${CMAKE_SOURCE_DIR};PYTHONPATH=${CMAKE_SOURCE_DIR}/tests;ASTRAI_SANITIZED=$<BOOL:${ASTRAI_SANITIZE}>")
endfunction()
