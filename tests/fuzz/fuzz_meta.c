// fuzz_meta.c: libFuzzer harness of the meta.json parser; what parses must
// serialise and parse again to the same values.
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "ckpt/meta.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    char *text = malloc(size + 1);
    if (!text) return 0;
    memcpy(text, data, size);
    text[size] = '\0';
    CkptMeta m;
    Err err;
    if (meta_parse(&m, text, "fuzz", &err) == 0) {
        char *again = meta_to_json(&m);
        CkptMeta back;
        if (again && meta_parse(&back, again, "fuzz-again", &err) == 0) {
            if (back.epoch != m.epoch || back.consumed_samples != m.consumed_samples ||
                back.step != m.step || strcmp(back.timestamp, m.timestamp) != 0)
                abort();
            meta_free(&back);
        }
        free(again);
        meta_free(&m);
    }
    free(text);
    return 0;
}
