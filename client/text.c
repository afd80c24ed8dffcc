// text.c: UTF-8 decoding and the terminal-safe form of daemon text (text.h).
#include "client/text.h"

#include <stdio.h>
#include <stdlib.h>
#include <string.h>

size_t utf8_decode(const unsigned char *p, uint32_t *cp) {
    static const uint32_t min_cp[5] = {0, 0, 0x80, 0x800, 0x10000}; // below: overlong
    size_t len = p[0] < 0x80 ? 1 : (p[0] & 0xE0) == 0xC0 ? 2 : (p[0] & 0xF0) == 0xE0 ? 3 : 4;
    if (p[0] >= 0x80 && ((p[0] & 0xC0) == 0x80 || p[0] > 0xF4)) return 0;
    *cp = len == 1 ? p[0] : p[0] & (0x7F >> len);
    for (size_t i = 1; i < len; i++) { // stops at a NUL: it is no continuation byte
        if ((p[i] & 0xC0) != 0x80) return 0;
        *cp = *cp << 6 | (p[i] & 0x3F);
    }
    if (*cp < min_cp[len] || *cp > 0x10FFFF || (*cp >= 0xD800 && *cp <= 0xDFFF)) return 0;
    return len;
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
