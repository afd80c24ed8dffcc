# astraictl's pieces that need no daemon: the charts of `plot` (client/plot.c, with the
# UTF-8 decoding of client/text.c).
include(${CMAKE_CURRENT_LIST_DIR}/common.cmake)
astrai_c_test(test_plot ${CMAKE_CURRENT_LIST_DIR}/test_plot.c ${CMAKE_SOURCE_DIR}/client/plot.c
             ${CMAKE_SOURCE_DIR}/client/text.c)
