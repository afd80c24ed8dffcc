// fuzz_safetensors.c: libFuzzer harness of the safetensors reader. Any input
// must either be rejected with a message or parse into tensors that all read
// back within the buffer (ASan/UBSan watch the reads).
#include <stdint.h>
#include <stdlib.h>

#include "ckpt/safetensors.h"

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    StFile f;
    Err err;
    if (st_parse(&f, data, size, &err) != 0) return 0;
    for (int i = 0; i < f.n_tensors; i++) {
        const StTensor *t = &f.tensors[i];
        // At most 4 bytes of fp32 per byte of (2-byte) source data.
        float *out = malloc(2 * (size_t)(t->end - t->begin) + sizeof(float));
        if (!out) break;
        st_read_f32(&f, t->name, t->ndim, t->shape, out, &err);
        free(out);
    }
    st_close(&f);
    return 0;
}
