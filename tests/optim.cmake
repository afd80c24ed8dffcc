# Tests of the optimizers, gradient clipping and LR schedules (engine/optim.c, engine/schedule.c).

# Helper programs driven by the Python reference tests.
foreach(helper optim_step schedule_factors)
  add_executable(${helper} ${CMAKE_SOURCE_DIR}/tests/${helper}.c)
  target_link_libraries(${helper} PRIVATE astrai_core)
endforeach()

astrai_py_test(test_optim_ref test_optim_ref.py)
astrai_py_test(test_schedule test_schedule.py)
set_tests_properties(test_optim_ref test_schedule PROPERTIES TIMEOUT 120)
