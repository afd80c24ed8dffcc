// path.h: building file paths without silent truncation.
#pragma once
#include <stddef.h>

#include "common/error.h"

// out = dir + "/" + name; fails (naming both) when it does not fit in cap bytes.
int path_join(char *out, size_t cap, const char *dir, const char *name, Err *err);
