# The bf16 and fp16 CPU backends (engine/cpu/lowp.c, gemm.c) against the fp32 one: on the
# GEMM path this CPU takes (oneDNN where it has bf16/fp16 instructions) and on the portable
# one; their converters against numpy's float16 and torch's bfloat16, and two runs bit for bit.
astrai_c_test(test_cpu_lowp tests/test_cpu_lowp.c)
target_link_libraries(test_cpu_lowp PRIVATE m)
add_test(NAME test_cpu_lowp_portable COMMAND test_cpu_lowp)
set_tests_properties(test_cpu_lowp_portable PROPERTIES ENVIRONMENT ASTRAI_CPU_GEMM=portable)
astrai_py_test(cpu_lowp test_cpu_lowp.py)
