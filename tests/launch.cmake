# Launching ranks: launch detection from the environment, the local launcher (real
# processes and signals), the TCP rendezvous of externally launched ranks.
include(${CMAKE_CURRENT_LIST_DIR}/common.cmake)
add_executable(launch_probe tests/launch_probe.c)
target_link_libraries(launch_probe PRIVATE astrai_core)
astrai_c_test(test_launch_detect tests/test_launch_detect.c)
astrai_py_test(launch_local test_launch.py)
astrai_py_test(launch_rendezvous test_rendezvous.py)
