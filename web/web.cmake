# astrai_web: web/index.html as a C array (web/web.h), generated at build time so a change to
# the page rebuilds the library and the daemon linking it.
set(ASTRAI_WEB_C ${CMAKE_BINARY_DIR}/web/index_html.c)
add_custom_command(OUTPUT ${ASTRAI_WEB_C}
  COMMAND ${CMAKE_COMMAND} -DIN=${CMAKE_SOURCE_DIR}/web/index.html -DOUT=${ASTRAI_WEB_C}
    -P ${CMAKE_SOURCE_DIR}/web/embed.cmake
  DEPENDS ${CMAKE_SOURCE_DIR}/web/index.html ${CMAKE_SOURCE_DIR}/web/embed.cmake
  COMMENT "Embedding web/index.html")
add_library(astrai_web STATIC ${ASTRAI_WEB_C})
target_include_directories(astrai_web PUBLIC ${CMAKE_SOURCE_DIR})
