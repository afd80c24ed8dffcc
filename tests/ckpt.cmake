# Files on disk: safetensors, atomic checkpoint directories, meta.json, astrai-model.
# The glob includes ckpt.cmake before common.cmake: load the helpers first.
include(${CMAKE_CURRENT_LIST_DIR}/common.cmake)
astrai_c_test(test_safetensors tests/test_safetensors.c)
astrai_c_test(test_checkpoint tests/test_checkpoint.c)
astrai_py_test(test_safetensors_py test_safetensors_py.py)
if(TARGET astrai-model)
  astrai_py_test(test_astrai_model test_astrai_model.py)
endif()
