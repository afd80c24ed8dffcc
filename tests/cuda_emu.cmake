# test_cuda_emu: the CUDA kernels of engine/cuda/ run on the CPU, so their logic is tested
# on machines without a GPU (tests/cuda_emu/). Each emulated file is generated at build time
# from the real .cu by tests/cuda_emu/gen.py (it rewrites only the <<<...>>> launch syntax,
# extern __shared__ declarations and the asm statements of the PTX instructions it knows)
# and compiled as C++ with tests/cuda_emu/emu.h force-included; the test compares every op
# with the CPU reference kernels (engine/cpu/), in fp32, bf16 and fp16, and attention with a
# float64 attention of its own.
#
# Emulated: embedding, rmsnorm, rope, elementwise, cross_entropy, preference, optim, moe and
# attention (its tensor-core kernels too: ldmatrix, mma.sync and cp.async emulated from the
# PTX ISA, tests/cuda_emu/mma.cpp and emu.cpp). Not: matmul.cu (cuBLASLt), context.cu and
# backend.cu (runtime plumbing).
#
# Needs a C++20 compiler, <ucontext.h> and Python 3; not nvcc or the CUDA toolkit. Not in
# the sanitizer build: its C objects are clang's, and ASan does not follow the emulator's
# swapcontext fibers.
if(ASTRAI_SANITIZE)
  message(STATUS "test_cuda_emu: not built (sanitizer build)")
  return()
endif()
include(CheckLanguage)
check_language(CXX)
if(NOT CMAKE_CXX_COMPILER)
  message(STATUS "test_cuda_emu: not built (no C++ compiler)")
  return()
endif()
enable_language(CXX)
find_package(Python3 COMPONENTS Interpreter QUIET)
include(CheckIncludeFileCXX)
check_include_file_cxx(ucontext.h ASTRAI_HAVE_UCONTEXT_H)
if(NOT "cxx_std_20" IN_LIST CMAKE_CXX_COMPILE_FEATURES OR NOT ASTRAI_HAVE_UCONTEXT_H
   OR NOT Python3_Interpreter_FOUND)
  message(STATUS "test_cuda_emu: not built (it needs C++20, <ucontext.h> and Python 3)")
  return()
endif()

set(_emu_src ${CMAKE_SOURCE_DIR}/tests/cuda_emu)
set(_emu_gen ${CMAKE_BINARY_DIR}/cuda_emu)
set(_emu_generated "")
foreach(f embedding rmsnorm rope elementwise cross_entropy preference optim attention moe)
  set(_out ${_emu_gen}/${f}.emu.cpp)
  add_custom_command(OUTPUT ${_out}
    COMMAND ${Python3_EXECUTABLE} ${_emu_src}/gen.py ${CMAKE_SOURCE_DIR}/engine/cuda/${f}.cu ${_out}
    DEPENDS ${CMAKE_SOURCE_DIR}/engine/cuda/${f}.cu ${_emu_src}/gen.py
    COMMENT "Generating the CPU emulation of engine/cuda/${f}.cu"
    VERBATIM)
  list(APPEND _emu_generated ${_out})
endforeach()

add_executable(test_cuda_emu ${_emu_src}/test_cuda_emu.cpp ${_emu_src}/emu.cpp
  ${_emu_src}/mma.cpp ${_emu_src}/context_stub.cpp ${_emu_generated})
set_target_properties(test_cuda_emu PROPERTIES CXX_STANDARD 20 CXX_STANDARD_REQUIRED ON
  CXX_EXTENSIONS OFF)
# The stub <cuda_runtime.h>, <cuda_bf16.h>, <cuda_fp16.h> come before any system copy of the
# toolkit's.
target_include_directories(test_cuda_emu BEFORE PRIVATE ${_emu_src}/stub_include)
target_include_directories(test_cuda_emu PRIVATE ${CMAKE_SOURCE_DIR})
# The kernels: emu.h first; FMA contraction as nvcc's default (--fmad=true), so a sum that
# relies on unfused arithmetic must say so with the _rn intrinsics, as on the GPU; `#pragma
# unroll` is nvcc's.
set_source_files_properties(${_emu_generated} PROPERTIES
  COMPILE_OPTIONS "-include;${_emu_src}/emu.h;-ffp-contract=fast;-Wno-unknown-pragmas")
# The rest (the test, the CPU reference it calls) rounds every operation.
set_source_files_properties(${_emu_src}/test_cuda_emu.cpp PROPERTIES
  COMPILE_OPTIONS "-ffp-contract=off")
# GCC compiles the ISO C of engine/cpu/ without FMA contraction (clang contracts within
# expressions): only then are AdamW's bits the CPU's.
target_compile_definitions(test_cuda_emu PRIVATE
  ASTRAI_CPU_NO_FMA=$<IF:$<C_COMPILER_ID:GNU>,1,0>)
target_link_libraries(test_cuda_emu PRIVATE astrai_core)
add_test(NAME test_cuda_emu COMMAND test_cuda_emu)
set_tests_properties(test_cuda_emu PROPERTIES TIMEOUT 300)
