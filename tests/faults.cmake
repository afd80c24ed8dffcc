# The fault matrix (tests/faults/fault_matrix.py): kill -9, outside SIGTERM, ENOSPC and
# read-only directories (tmpfs mounts: root only, else skipped), damaged astraid.db, each
# followed by the checks for lost or half checkpoints, orphans, /dev/shm leftovers, state and
# final weights. ctest runs its short mode; the long mode is run by hand:
#   ASTRAI_BUILD=build tests/faults/fault_matrix.py --count 120
include(${CMAKE_CURRENT_LIST_DIR}/common.cmake)
astrai_py_test(faults_short faults/fault_matrix.py --short)
set_tests_properties(faults_short PROPERTIES TIMEOUT 600 LABELS "daemon;faults" RUN_SERIAL TRUE)
