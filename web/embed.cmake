# cmake -DIN=web/index.html -DOUT=index_html.c -P web/embed.cmake: writes IN's bytes as the C
# array web_index_html (web/web.h). Run at build time by web/web.cmake.
file(READ "${IN}" hex HEX)
string(LENGTH "${hex}" nhex)
math(EXPR len "${nhex} / 2")
# 16 bytes a line, each byte a character constant: '\x3c',
string(REPEAT "[0-9a-f]" 32 line)
string(REGEX REPLACE "(${line})" "\\1\n" hex "${hex}")
string(REGEX REPLACE "([0-9a-f][0-9a-f])" "'\\\\x\\1'," bytes "${hex}")
file(WRITE "${OUT}" "/* Generated from ${IN} by web/embed.cmake; do not edit. */
#include \"web/web.h\"

const char web_index_html[] = {
${bytes}
0};
const size_t web_index_html_len = ${len};
")
