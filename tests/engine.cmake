# Tests of the model engine (engine/config.c, engine/model.c, engine/cpu/).
astrai_c_test(test_config tests/test_config.c)

# model_dump: a test program (not a test) that the PyTorch reference test drives.
add_executable(model_dump tests/model_dump.c)
target_link_libraries(model_dump PRIVATE astrai_core)
astrai_py_test(test_model_ref test_model_ref.py)
