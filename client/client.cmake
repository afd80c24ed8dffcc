# astraictl: the client of astraid (client/*.c), installed with the other binaries.
astrai_layer(client DIRS client DEPS proto common)
add_executable(astraictl ${CMAKE_SOURCE_DIR}/tools/astraictl/main.c)
target_link_libraries(astraictl PRIVATE astrai_client)
install(TARGETS astraictl RUNTIME DESTINATION bin)
