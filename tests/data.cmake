# Datasets: bin shards, windows, sampler, astrai-data (owner: data).
astrai_c_test(test_dataset tests/test_dataset.c)
astrai_c_test(test_sampler tests/test_sampler.c)
astrai_py_test(test_astrai_data test_astrai_data.py)
astrai_c_test(test_records tests/test_records.c)
# Chat templates (data/chat_template.h): refusals in C, renderings against transformers.
astrai_c_test(test_chat_template tests/test_chat_template.c)
add_executable(chat_render tests/chat_render.c)
target_link_libraries(chat_render PRIVATE astrai_core)
astrai_c_test(test_tokenizer tests/test_tokenizer.c)
