astrai_py_test(parallel test_parallel.py)
astrai_py_test(parallel_signals test_parallel_signals.py)
astrai_py_test(pipeline test_pipeline.py)
