// test_topk: engine/topk.h's topk_torch_cpu on rows read from stdin, for tests/test_topk.py
// to compare with torch.topk.
//
//   test_topk [MODE] < CASES > INDICES
//
// CASES is a sequence of records, native-endian: int32 E, int32 k, int32 rows, then rows * E
// float32 values; for each record, rows * k int32 indices are written. MODE picks the path:
// `torch` (default) is topk_torch_cpu; `partial` always takes torch's partial_sort path and
// `nth` always its nth_element + sort path, so the test can show that torch switches between
// them exactly at k * 64 <= E.
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include "engine/topk.h"

enum { MODE_TORCH, MODE_PARTIAL, MODE_NTH };

// One of torch's two paths, forced, for the threshold check.
static void topk_forced(const float *vals, int E, int k, int mode, TopkPair *scratch,
                        int32_t *idx) {
    topk_select_path(vals, E, k, mode == MODE_PARTIAL, scratch, idx);
}

// One record: its rows through the chosen path. 0 on success, -1 at the end of the input.
static int run_record(int mode) {
    int32_t head[3];
    size_t got = fread(head, sizeof(int32_t), 3, stdin);
    if (got == 0 && feof(stdin)) return -1;
    int E = head[0], k = head[1], rows = head[2];
    if (got != 3 || E < 1 || k < 1 || k > E || rows < 0) {
        fprintf(stderr, "test_topk: bad record header\n");
        exit(2);
    }
    float *vals = malloc(sizeof(float) * (size_t)E);
    TopkPair *scratch = malloc(sizeof(TopkPair) * (size_t)E);
    int32_t *idx = malloc(sizeof(int32_t) * (size_t)k);
    if (!vals || !scratch || !idx) exit(2);
    for (int r = 0; r < rows; r++) {
        if (fread(vals, sizeof(float), (size_t)E, stdin) != (size_t)E) {
            fprintf(stderr, "test_topk: short row\n");
            exit(2);
        }
        if (mode == MODE_TORCH)
            topk_torch_cpu(vals, E, k, scratch, idx);
        else
            topk_forced(vals, E, k, mode, scratch, idx);
        fwrite(idx, sizeof(int32_t), (size_t)k, stdout);
    }
    free(vals);
    free(scratch);
    free(idx);
    return 0;
}

int main(int argc, char **argv) {
    int mode = MODE_TORCH;
    if (argc > 1 && !strcmp(argv[1], "partial"))
        mode = MODE_PARTIAL;
    else if (argc > 1 && !strcmp(argv[1], "nth"))
        mode = MODE_NTH;
    else if (argc > 1 && strcmp(argv[1], "torch")) {
        fprintf(stderr, "usage: test_topk [torch|partial|nth] < cases > indices\n");
        return 2;
    }
    while (run_record(mode) == 0) {
    }
    return fflush(stdout) ? 1 : 0;
}
