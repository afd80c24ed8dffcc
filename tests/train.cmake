# astrai-train end to end: against the PyTorch reference, resume, accumulation, bad input,
# real text.
astrai_py_test(train_ref test_train_ref.py)
astrai_py_test(train_resume test_train_resume.py)
# Checkpoint retention: --checkpoint_keep_last / --checkpoint_keep_best.
astrai_py_test(ckpt_retention test_ckpt_retention.py)
# astrai-train-seams: astrai-train with the tests' seams compiled in (train/test_seam.h), for the
# tests that reach into a run (loss_scale's overflow on one rank, ckpt_async's held write).
get_target_property(_train_src astrai_train SOURCES)
get_target_property(_train_deps astrai_train INTERFACE_LINK_LIBRARIES)
add_library(astrai_train_seams STATIC ${_train_src})
target_compile_definitions(astrai_train_seams PRIVATE ASTRAI_TEST_SEAMS)
target_include_directories(astrai_train_seams PUBLIC ${CMAKE_SOURCE_DIR})
target_link_libraries(astrai_train_seams PUBLIC ${_train_deps})
add_executable(astrai-train-seams ${CMAKE_SOURCE_DIR}/tools/astrai-train/main.c)
target_link_libraries(astrai-train-seams PRIVATE astrai_train_seams)
# --async_checkpoint: rank 0 writes in the background; the same files, training goes on.
astrai_py_test(ckpt_async test_ckpt_async.py)
astrai_py_test(ckpt_sharded test_ckpt_sharded.py)
# --loss_scale: GradScaler's rule against the reference, resume mid-back-off, one rank overflowing.
astrai_py_test(loss_scale test_loss_scale.py)
# bf16 and fp16 on the CPU against the reference scheme; ddp/fsdp, reruns, both GEMM paths, fp16 scaling.
astrai_py_test(train_lowp test_train_lowp.py)
astrai_py_test(train_accum test_train_accum.py)
astrai_py_test(train_text test_train_text.py)
astrai_py_test(train_errors test_train_errors.py)
astrai_py_test(train_signals test_train_signals.py)
# Once-per-job lines from rank 0 alone, under srun's, torchrun's and our own launcher's variables.
astrai_py_test(train_once test_train_once.py)
astrai_py_test(train_flags test_train_flags.py)
astrai_py_test(train_astrai_dir test_train_astrai_dir.py)
astrai_py_test(train_devices test_train_devices.py)
astrai_py_test(train_astrai_resume test_train_astrai_resume.py)
astrai_c_test(test_metrics tests/test_metrics.c)
astrai_py_test(train_val test_train_val.py)
# DPO and GRPO: the losses and gradients (tests/pref_dump) and training runs against the
# PyTorch reference (tests/ref/pref.py).
astrai_py_test(pref_ref test_pref_ref.py)
astrai_py_test(train_pref test_train_pref.py)
# online_grpo / online_dpo: rollouts, the reward command and endpoint, faults (issue 32).
astrai_py_test(train_online test_train_online.py)
astrai_py_test(train_neftune test_train_neftune.py)
# The pipeline schedules (1F1B, GPipe) as a unit: orders, no deadlock, held activations (issue 19).
astrai_c_test(test_pp_schedule tests/test_pp_schedule.c)
# The pipeline's split of the blocks into stages against every split there is.
astrai_c_test(test_pipeline_partition tests/test_pipeline_partition.c)
# An objective table alone (a toy objective) through the one step function (train/step.h): the
# order of its calls, the gradients against the model's own, evaluation, a reference, a failure.
astrai_c_test(test_objective tests/test_objective.c)
# Samples during training (--sample_interval): progress.db rows = astrai-generate on each step's
# checkpoint, one rank and fsdp; resume; bad input.
astrai_py_test(train_samples test_train_samples.py)
