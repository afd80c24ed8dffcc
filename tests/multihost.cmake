# Ranks on several hosts: network namespaces made by the test (tests/netns_util.py), the
# torchrun-style launch, Gloo between hosts (skipped, exit 77, where namespaces cannot be made).
astrai_py_test(multihost test_multihost.py)
set_tests_properties(multihost PROPERTIES TIMEOUT 900 SKIP_RETURN_CODE 77)
