astrai_py_test(parallel test_parallel.py)
