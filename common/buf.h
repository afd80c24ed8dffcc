// buf.h: the one growable buffer: a byte buffer to append to, and the growth of any
// array held as (pointer, capacity). Capacity doubles, so n appends cost O(n).
#pragma once
#include <stddef.h>

// Makes room for `need` items of `elem` bytes in the array *pp (pp: the address of the
// array's pointer, of any type) of *cap items: at least doubles *cap (16 items at first).
// 0, or -1 when out of memory (then the array and *cap are untouched).
int buf_reserve(void *pp, size_t *cap, size_t need, size_t elem);

// Bytes, NUL-terminated after len once anything was appended. {0} is an empty buffer.
typedef struct {
    char *data;
    size_t len, cap;
} Buf;

// Appends n bytes: 0, or -1 when out of memory (b unchanged).
int buf_append(Buf *b, const void *data, size_t n);
// Appends printf's output: 0, or -1 when out of memory (b unchanged).
int buf_printf(Buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
// Takes the bytes (NULL when none were appended; the caller frees them); b is empty again.
char *buf_take(Buf *b);
void buf_free(Buf *b);
