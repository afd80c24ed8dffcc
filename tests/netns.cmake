# Test "hosts" as network namespaces (tests/netns_util.py) for the multi-host tests; exit 77
# (skipped, with the reason) where namespaces cannot be made (not root, no ip/unshare/nsenter).
include(${CMAKE_CURRENT_LIST_DIR}/common.cmake)
astrai_py_test(netns_util test_netns_util.py)
set_tests_properties(netns_util PROPERTIES TIMEOUT 120 SKIP_RETURN_CODE 77)
