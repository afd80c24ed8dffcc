# astraictl: the client of astraid (client/*.c), installed with the other binaries.
file(GLOB ASTRAICTL_SOURCES CONFIGURE_DEPENDS ${CMAKE_SOURCE_DIR}/client/*.c)
add_executable(astraictl ${ASTRAICTL_SOURCES} ${CMAKE_SOURCE_DIR}/tools/astraictl/main.c)
target_link_libraries(astraictl PRIVATE astrai_core)
install(TARGETS astraictl RUNTIME DESTINATION bin)
