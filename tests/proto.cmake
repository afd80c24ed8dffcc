# proto/: wire protocol (rpc.c), job spec validator (job_spec.c), and astraictl.
astrai_c_test(test_rpc tests/test_rpc.c)
astrai_c_test(test_job_spec tests/test_job_spec.c)
astrai_py_test(test_astraictl test_astraictl.py)
