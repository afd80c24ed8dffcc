// fuzz_config.c: libFuzzer harness of astraid's config file parser (daemon/config.c).
// Any text is either refused with a message naming the file (once), or applied; applied
// numbers lie in their option's range, and a second application of the same text
// (as astraid's flags re-set what the file set) frees what the first one set
// (LeakSanitizer watches).
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "daemon/daemon.h"

#define PATH "astraid.json"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

static void check_ranges(const Config *c) {
    for (size_t i = 0; i < CONFIG_N_OPTIONS; i++) {
        const ConfigOption *o = &CONFIG_OPTIONS[i];
        const char *field = (const char *)c + o->offset;
        double v = o->type == OPT_LONG     ? (double)*(const long *)field
                   : o->type == OPT_DOUBLE ? *(const double *)field
                                           : o->lo;
        // 0 is the value of an option the text did not set (the Config starts zeroed).
        if (v != 0 && (!isfinite(v) || v < o->lo || v > o->hi)) abort();
    }
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    Config c = {0};
    Err err = {0};
    for (int pass = 0; pass < 2; pass++) {
        if (config_apply_json(&c, (const char *)data, size, PATH, &err)) {
            size_t n = strlen(PATH ": ");
            if (strncmp(err.msg, PATH ": ", n) || !strncmp(err.msg + n, PATH ": ", n)) abort();
            break;
        }
        check_ranges(&c);
    }
    config_free(&c);
    return 0;
}
