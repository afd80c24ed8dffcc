// json.h: cJSON's allocations under astrai's out-of-memory policy (common/error.h).
//
// cJSON answers a failed allocation as it answers malformed text (cJSON_Parse* returns NULL),
// and cJSON_Add* drops the member it could not allocate. json_init, called first by every
// binary's main, installs allocation hooks that note each failure of the calling thread, so
// that a parse that returned NULL for want of memory is reported as out of memory
// (err_resource), not as bad input, and a tree built short is known to be.
#pragma once
#include <stdbool.h>

#include "common/error.h"

// Installs the hooks (cJSON_InitHooks); before any other cJSON call.
void json_init(void);

// Whether the latest cJSON allocation of this thread failed; clears the note. Asked right
// after a cJSON_Parse* of a non-empty buffer that returned NULL: such a parse allocates its
// root item before it reads, so one that met malformed text leaves a successful allocation
// last, and one that ran out of memory makes none after the failed one. (An empty buffer
// allocates nothing: the note would be an older one's.)
bool json_out_of_memory(void);

// How many cJSON allocations of this thread failed so far. A tree built with cJSON_Add*
// silently lacks each member whose allocation failed: a count that moved while it was built
// says so.
unsigned long json_failures(void);

struct cJSON;
// Reads and parses the JSON file at path into *root (cJSON_Delete it): 0, or -1 with err
// "PATH: out of memory" (err_resource), "PATH: not valid JSON", or fs_read_file's error.
int json_read_file(const char *path, struct cJSON **root, Err *err);
