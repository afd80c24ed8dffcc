# Tests of the model engine (model/config.c, engine/model.c, engine/cpu/).
astrai_c_test(test_config tests/test_config.c)

# model_dump: a test program (not a test) that the PyTorch reference test drives.
add_executable(model_dump tests/model_dump.c)
target_link_libraries(model_dump PRIVATE astrai_core)
astrai_py_test(test_model_ref test_model_ref.py)
# MoE routing edge cases (one expert for all, none for one, ties, top-k = E) and 10-step curves.
astrai_py_test(test_moe_ref test_moe_ref.py)

# The CUDA attention kernels' tiling schedule replayed on the CPU against a naive attention:
# the logic of engine/cuda/attention.cu checked where no GPU runs.
astrai_c_test(test_attention_tiling tests/test_attention_tiling.c)
target_link_libraries(test_attention_tiling PRIVATE m)

# pref_dump: one DPO/GRPO micro-batch through the engine, driven by test_pref_ref.py.
add_executable(pref_dump tests/pref_dump.c)
target_link_libraries(pref_dump PRIVATE astrai_core)

# A model cut into pipeline stages computes the whole model's loss and gradients.
astrai_c_test(test_model_stage tests/test_model_stage.c)

# engine/topk.h against torch.topk: test_topk is the program that test_topk.py drives.
add_executable(test_topk tests/test_topk.c)
target_include_directories(test_topk PRIVATE ${CMAKE_SOURCE_DIR})
astrai_py_test(test_topk test_topk.py)

# engine/sample.h: each strategy against a direct implementation, greedy, determinism and
# chi-square tests of the draws; `test_sample dump` is what test_sample.py compares with torch.
astrai_c_test(test_sample tests/test_sample.c)
astrai_py_test(test_sample_torch test_sample.py)

# attention_decode over a KV cache gives attention_fwd's rows bit for bit (CPU).
astrai_c_test(test_attention_decode tests/test_attention_decode.c)

# What generation refuses (no attention_decode, a pipeline stage, expert parallelism, bad
# options), by name; it leaves NEFTune and the expert loads alone.
astrai_c_test(test_generate tests/test_generate.c)

# gen_dump: engine/generate.h on prompts, driven by test_generate_ref.py (greedy against the
# PyTorch reference, with and without the KV cache, batches against single prompts, seeds).
add_executable(gen_dump tests/gen_dump.c)
target_link_libraries(gen_dump PRIVATE astrai_core)
astrai_py_test(test_generate_ref test_generate_ref.py)
# Sampled generation's token frequencies (first token, and second given the first) against
# AstrAI's sampling over the reference's logits: chi-square at alpha 1e-4 per test, fixed seeds.
astrai_py_test(test_generate_stats test_generate_stats.py)
# astrai-generate: its JSON lines against gen_dump (text, jsonl with a chat template, seeds)
# and its refusals.
if(TARGET astrai-generate)
  astrai_py_test(test_astrai_generate test_astrai_generate.py)
endif()
