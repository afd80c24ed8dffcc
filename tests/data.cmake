# Datasets: bin shards, windows, sampler, astrai-data (owner: data).
astrai_c_test(test_dataset tests/test_dataset.c)
astrai_c_test(test_sampler tests/test_sampler.c)
astrai_py_test(test_astrai_data test_astrai_data.py)
astrai_c_test(test_records tests/test_records.c)
