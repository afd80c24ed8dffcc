#include "common/json.h"

#include <cjson/cJSON.h>
#include <stdlib.h>

static _Thread_local bool last_failed;
static _Thread_local unsigned long failures;

static void *noted_malloc(size_t size) {
    void *p = malloc(size);
    last_failed = !p;
    failures += !p;
    return p;
}

void json_init(void) {
    cJSON_Hooks hooks = {.malloc_fn = noted_malloc, .free_fn = free};
    cJSON_InitHooks(&hooks);
}

unsigned long json_failures(void) {
    return failures;
}

bool json_out_of_memory(void) {
    bool failed = last_failed;
    last_failed = false;
    return failed;
}
