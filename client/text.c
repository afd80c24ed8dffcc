// text.c: UTF-8 decoding and the terminal-safe form of daemon text (text.h).
#include "client/text.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "proto/rpc.h"

size_t utf8_decode(const unsigned char *p, uint32_t *cp) {
    return rpc_utf8_decode(p, strnlen((const char *)p, 4), cp); // a NUL continues nothing
}

// Writes the character at p (or its escape) to out, which has room for 7 bytes; returns
// the bytes of text it took.
static size_t put_safe_char(const unsigned char *p, char *out) {
    uint32_t cp = 0;
    size_t len = utf8_decode(p, &cp);
    if (!len || cp < 0x20 || cp == 0x7F)
        snprintf(out, 7, "\\x%02x", p[0]);
    else if (cp >= 0x80 && cp <= 0x9F)
        snprintf(out, 7, "\\u%04x", (unsigned)cp);
    else {
        memcpy(out, p, len);
        out[len] = '\0';
    }
    return len ? len : 1;
}

char *text_for_terminal(const char *text) {
    char *safe = malloc(strlen(text) * 4 + 1); // an escape is at most 4 bytes a byte
    if (!safe) return NULL;
    char *end = safe;
    for (const unsigned char *p = (const unsigned char *)text; *p;) {
        p += put_safe_char(p, end);
        end += strlen(end);
    }
    *end = '\0';
    return safe;
}
