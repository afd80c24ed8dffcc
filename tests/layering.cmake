# The layers (CMakeLists.txt) as the build enforces them: every layer check links, and a unit
# of the ckpt layer that calls up into engine and train does not (tests/layering/).
add_library(astrai_layer_violation STATIC EXCLUDE_FROM_ALL
  ${CMAKE_CURRENT_LIST_DIR}/layering/ckpt_calls_up.c)
target_include_directories(astrai_layer_violation PRIVATE ${CMAKE_SOURCE_DIR})
get_target_property(_ckpt_deps astrai_ckpt INTERFACE_LINK_LIBRARIES)
target_link_libraries(astrai_layer_violation PUBLIC ${_ckpt_deps})
astrai_layer_check(layer_violation)
set_target_properties(layer_check_layer_violation PROPERTIES EXCLUDE_FROM_ALL TRUE)
get_property(_layers GLOBAL PROPERTY ASTRAI_LAYERS)
string(REPLACE ";" "," _layers "${_layers}")
astrai_py_test(layering test_layering.py ${_layers})
