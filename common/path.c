#include "common/path.h"

#include <stdio.h>

int path_join(char *out, size_t cap, const char *dir, const char *name, Err *err) {
    int n = snprintf(out, cap, "%s/%s", dir, name);
    if (n < 0 || (size_t)n >= cap) return err_set(err, "%s/%s: path too long", dir, name);
    return 0;
}
