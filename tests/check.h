// check.h: the tiny assertion layer of the C tests. A failed CHECK prints the
// expression with file:line and makes the test exit non-zero at the end.
#pragma once
#include <math.h>
#include <stdio.h>
#include <stdlib.h>

static int check_failures = 0;

#define CHECK(cond)                                                                                \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "%s:%d: CHECK failed: %s\n", __FILE__, __LINE__, #cond);               \
            check_failures++;                                                                      \
        }                                                                                          \
    } while (0)

#define CHECK_MSG(cond, ...)                                                                       \
    do {                                                                                           \
        if (!(cond)) {                                                                             \
            fprintf(stderr, "%s:%d: CHECK failed: %s: ", __FILE__, __LINE__, #cond);               \
            fprintf(stderr, __VA_ARGS__);                                                          \
            fputc('\n', stderr);                                                                   \
            check_failures++;                                                                      \
        }                                                                                          \
    } while (0)

#define CHECK_NEAR(a, b, rel)                                                                      \
    CHECK_MSG(fabs((double)(a) - (double)(b)) <= (rel)*fmax(1e-30, fabs((double)(b))),             \
              "%.9g vs %.9g", (double)(a), (double)(b))

#define CHECK_DONE()                                                                               \
    do {                                                                                           \
        if (check_failures) {                                                                      \
            fprintf(stderr, "%d check(s) failed\n", check_failures);                               \
            return 1;                                                                              \
        }                                                                                          \
        return 0;                                                                                  \
    } while (0)
