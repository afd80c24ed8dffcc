// The web page of astraid's HTTP listener (web/index.html), compiled into the binary at build
// time (web/web.cmake, web/embed.cmake) so the daemon serves it without reading a file.
#pragma once
#include <stddef.h>

// The bytes of web/index.html (UTF-8), then a NUL that web_index_html_len leaves out.
extern const char web_index_html[];
extern const size_t web_index_html_len;
