// buf.c: growable arrays and byte buffers (buf.h).
#include "common/buf.h"

#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

int buf_reserve(void *pp, size_t *cap, size_t need, size_t elem) {
    if (need <= *cap) return 0;
    if (need > SIZE_MAX / elem) return -1;
    size_t grown = *cap ? *cap : 8;
    do // doubles while that stays addressable, else exactly what is needed
        grown = grown <= SIZE_MAX / 2 / elem ? grown * 2 : need;
    while (grown < need);
    void *p;
    memcpy(&p, pp, sizeof p); // the caller's pointer, whatever its type
    p = realloc(p, grown * elem);
    if (!p) return -1;
    memcpy(pp, &p, sizeof p);
    *cap = grown;
    return 0;
}

int buf_append(Buf *b, const void *data, size_t n) {
    if (n > SIZE_MAX - b->len - 1 || buf_reserve(&b->data, &b->cap, b->len + n + 1, 1)) return -1;
    if (n) memcpy(b->data + b->len, data, n);
    b->len += n;
    b->data[b->len] = 0;
    return 0;
}

int buf_printf(Buf *b, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(NULL, 0, fmt, ap);
    va_end(ap);
    if (n < 0 || buf_reserve(&b->data, &b->cap, b->len + (size_t)n + 1, 1)) return -1;
    va_start(ap, fmt);
    vsnprintf(b->data + b->len, (size_t)n + 1, fmt, ap);
    va_end(ap);
    b->len += (size_t)n;
    return 0;
}

char *buf_take(Buf *b) {
    char *data = b->data;
    *b = (Buf){0};
    return data;
}

void buf_free(Buf *b) {
    free(b->data);
    *b = (Buf){0};
}
