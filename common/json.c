#include "common/json.h"

#include <cjson/cJSON.h>
#include <stdlib.h>

#include "common/fsutil.h"

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

int json_read_file(const char *path, cJSON **root, Err *err) {
    char *text;
    size_t len;
    *root = NULL;
    if (fs_read_file(path, &text, &len, err)) return -1;
    *root = cJSON_ParseWithLength(text, len);
    free(text);
    if (*root) return 0;
    return len && json_out_of_memory() ? err_resource(err, "%s: out of memory", path)
                                       : err_set(err, "%s: not valid JSON", path);
}
