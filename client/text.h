// text.h: text from the daemon made safe to show (docs/astraictl.md, "Text from the
// daemon"): UTF-8 decoding shared by the terminal and the SVG, and the escaped form of a
// string for a terminal. Pure functions, no I/O.
#pragma once
#include <stddef.h>
#include <stdint.h>

// The code point of the UTF-8 sequence at p (NUL-terminated) and its length; 0 when it is
// not valid UTF-8: rpc_utf8_decode's rule (proto/rpc.h), the one astraid sends by.
size_t utf8_decode(const unsigned char *p, uint32_t *cp);

// text with every character a terminal would act on written as an escape, so that it can
// neither move the cursor nor start a control sequence: a C0 control (newline and tab
// included) or DEL as \xHH, a C1 control (U+0080..U+009F) as \u00HH, each byte of invalid
// UTF-8 as \xHH. A malloc'd string, NULL when out of memory.
char *text_for_terminal(const char *text);
