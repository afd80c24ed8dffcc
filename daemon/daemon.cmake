# astraid: the training service (daemon/*.c) and its systemd units (systemd/).
pkg_check_modules(LIBUV REQUIRED IMPORTED_TARGET libuv)
pkg_check_modules(MHD REQUIRED IMPORTED_TARGET libmicrohttpd) # the HTTP listener (http.c)
# The daemon layer (CMakeLists.txt's layers); its main() is tools/astraid/main.c, as every
# binary's is tools/<binary>/main.c.
astrai_layer(daemon DIRS daemon DEPS engine ckpt model comm proto ranks common web
  EXTERNAL PkgConfig::LIBUV PkgConfig::MHD PkgConfig::SQLITE3 ${CMAKE_DL_LIBS})
add_executable(astraid ${CMAKE_SOURCE_DIR}/tools/astraid/main.c)
target_link_libraries(astraid PRIVATE astrai_daemon)
# astraid uses none of the training libraries the engine layer carries (BLAS, oneDNN, OpenMP,
# CUDA): linked only where referenced, whatever the compiler driver's default
# (test_daemon_protocol).
target_link_options(astraid PRIVATE LINKER:--as-needed)
install(TARGETS astraid RUNTIME DESTINATION bin)

# Units go where systemd looks for packaged ones (override with -DASTRAI_SYSTEMD_DIR=...).
include(GNUInstallDirs)
set(ASTRAI_SYSTEMD_DIR "${CMAKE_INSTALL_PREFIX}/lib/systemd" CACHE PATH
  "root of the systemd unit directories (system/, sysusers.d/, tmpfiles.d/)")
# The unit in the tree names /usr/local/bin/astraid; the installed one the real prefix.
file(READ ${CMAKE_SOURCE_DIR}/systemd/astraid.service _unit)
string(REPLACE "/usr/local/bin/astraid" "${CMAKE_INSTALL_FULL_BINDIR}/astraid" _unit "${_unit}")
file(WRITE ${CMAKE_BINARY_DIR}/systemd/astraid.service "${_unit}")
install(FILES ${CMAKE_BINARY_DIR}/systemd/astraid.service ${CMAKE_SOURCE_DIR}/systemd/astraid.socket
  DESTINATION ${ASTRAI_SYSTEMD_DIR}/system)
install(FILES ${CMAKE_SOURCE_DIR}/systemd/astraid.sysusers.conf
  DESTINATION ${ASTRAI_SYSTEMD_DIR}/../sysusers.d RENAME astraid.conf)
install(FILES ${CMAKE_SOURCE_DIR}/systemd/astraid.tmpfiles.conf
  DESTINATION ${ASTRAI_SYSTEMD_DIR}/../tmpfiles.d RENAME astraid.conf)
