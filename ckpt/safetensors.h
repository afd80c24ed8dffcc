// safetensors.h: reader and writer of the safetensors format
// (8-byte little-endian header length N, N bytes of JSON header, then the data).
//
// The reader validates everything before any tensor is used: header length
// within the file, JSON well formed, every entry with a known dtype, a shape
// whose element count times the dtype size equals end-begin, offsets inside the
// data area, and no two tensors overlapping.
#pragma once
#include <stddef.h>
#include <stdint.h>

#include "common/dtype.h"
#include "common/error.h"

#define ST_MAX_DIMS 8

typedef struct {
    char *name;
    DType dtype;
    int ndim;
    int64_t shape[ST_MAX_DIMS];
    uint64_t begin, end;  // byte offsets into the data area of its file
    const uint8_t *bytes; // its data (begin..end of its file's data area)
    const char *file;     // a sharded set's: the name of the file holding it; else NULL
} StTensor;

typedef struct StFile {
    StTensor *tensors; // sorted by name
    int n_tensors;
    const uint8_t *data; // start of the data area (one file)
    size_t data_len;
    void *map; // mmap of the whole file (or NULL for st_parse on a caller buffer)
    size_t map_len;
    // A sharded set (ckpt/shards.h): the files whose tensors `tensors` lists and their names (in
    // the order the index first names them), owned; else NULL.
    struct StFile *files;
    char **file_names;
    int n_files;
} StFile;

// Opens and validates path (mmap). Errors are prefixed with the path.
int st_open(StFile *f, const char *path, Err *err);
// Validates a buffer already in memory (used by st_open and the fuzz harness).
// The buffer must outlive f.
int st_parse(StFile *f, const uint8_t *buf, size_t len, Err *err);
// Closes a file or a set (its files too).
void st_close(StFile *f);

const StTensor *st_find(const StFile *f, const char *name);

// "[2, 3]": a shape as messages print it, truncated to cap.
void st_format_shape(char *out, size_t cap, int ndim, const int64_t *shape);

// Copies tensor `name` into out as fp32, converting from bf16/f16/f32; fails
// with a message naming the tensor when it is missing or its shape differs
// from the expected (ndim, shape).
int st_read_f32(const StFile *f, const char *name, int ndim, const int64_t *shape, float *out,
                Err *err);

typedef struct {
    const char *name;
    int ndim;
    int64_t shape[ST_MAX_DIMS];
    const float *data; // fp32 source; converted to the file dtype on write
    // NULL: data is host memory. Else data is elsewhere (a GPU) and fetch copies `bytes`
    // from it into host memory, chunk by chunk (a backend's download).
    void (*fetch)(void *host, const void *src, size_t bytes);
} StWriteTensor;

// Writes tensors (sorted by name in the header, like the Python writer) in
// dtype DT_F32 or DT_BF16 (round to nearest even), fsynced. Plain write: use it
// inside a temporary checkpoint directory, or via a temp name + rename.
int st_write(const char *path, const StWriteTensor *tensors, int n, DType dtype, Err *err);
