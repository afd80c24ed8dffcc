// safetensors.c: validating mmap reader and fsynced writer of the safetensors
// format, byte-compatible with the Python `safetensors` writer.
#include "ckpt/safetensors.h"

#include <cjson/cJSON.h>
#include <errno.h>
#include <fcntl.h>
#include <math.h>
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/stat.h>
#include <unistd.h>

#include "common/buf.h"
#include "common/fsutil.h"
#include "common/half.h"
#include "common/json.h"

// The Python implementation refuses headers above 100 MB; so do we.
#define ST_MAX_HEADER_LEN 100000000ull
// Integers in JSON arrive as doubles: beyond 2^53 they are no longer exact.
#define ST_MAX_JSON_INT 9007199254740992.0

// ---------------------------------------------------------------- header validation

static uint64_t read_le64(const uint8_t *p) {
    uint64_t v = 0;
    for (int i = 7; i >= 0; i--)
        v = (v << 8) | p[i];
    return v;
}

// A JSON number that is a non-negative integer exactly representable; else -1.
static int json_uint(const cJSON *item, uint64_t *out) {
    if (!cJSON_IsNumber(item)) return -1;
    double d = item->valuedouble;
    if (!(d >= 0) || d > ST_MAX_JSON_INT || d != floor(d)) return -1;
    *out = (uint64_t)d;
    return 0;
}

// A dtype as safetensors headers name it.
static const char *st_name(DType t) {
    return dtype_info(t)->safetensors;
}

static int parse_dtype(StTensor *t, const cJSON *entry, Err *err) {
    const cJSON *dt = cJSON_GetObjectItemCaseSensitive(entry, "dtype");
    if (!dt) return err_set(err, "tensor '%s': missing \"dtype\"", t->name);
    if (!cJSON_IsString(dt)) return err_set(err, "tensor '%s': \"dtype\" is not a string", t->name);
    if (!dtype_from_name(dt->valuestring, 0, &t->dtype)) return 0;
    return err_set(
        err, "tensor '%s': unknown dtype '%.40s' (known: F32 BF16 F16 I64 I32 I16 I8 U8 BOOL)",
        t->name, dt->valuestring);
}

static int parse_shape(StTensor *t, const cJSON *entry, Err *err) {
    const cJSON *shape = cJSON_GetObjectItemCaseSensitive(entry, "shape");
    if (!shape) return err_set(err, "tensor '%s': missing \"shape\"", t->name);
    if (!cJSON_IsArray(shape))
        return err_set(err, "tensor '%s': \"shape\" is not an array", t->name);
    int ndim = cJSON_GetArraySize(shape);
    if (ndim > ST_MAX_DIMS)
        return err_set(err, "tensor '%s': %d dimensions, at most %d supported", t->name, ndim,
                       ST_MAX_DIMS);
    t->ndim = 0;
    const cJSON *dim;
    cJSON_ArrayForEach(dim, shape) {
        uint64_t v;
        if (json_uint(dim, &v) != 0)
            return err_set(err, "tensor '%s': shape entry %d is not a non-negative integer",
                           t->name, t->ndim);
        t->shape[t->ndim++] = (int64_t)v;
    }
    return 0;
}

static int parse_offsets(StTensor *t, const cJSON *entry, Err *err) {
    const cJSON *offs = cJSON_GetObjectItemCaseSensitive(entry, "data_offsets");
    if (!offs) return err_set(err, "tensor '%s': missing \"data_offsets\"", t->name);
    if (!cJSON_IsArray(offs) || cJSON_GetArraySize(offs) != 2 ||
        json_uint(cJSON_GetArrayItem(offs, 0), &t->begin) != 0 ||
        json_uint(cJSON_GetArrayItem(offs, 1), &t->end) != 0)
        return err_set(err,
                       "tensor '%s': \"data_offsets\" is not [begin, end] of non-negative "
                       "integers",
                       t->name);
    return 0;
}

// Checks that the byte range matches the shape and lies inside the data area.
static int check_extent(const StTensor *t, size_t data_len, Err *err) {
    if (t->begin > t->end)
        return err_set(err, "tensor '%s': data_offsets begin %llu > end %llu", t->name,
                       (unsigned long long)t->begin, (unsigned long long)t->end);
    uint64_t bytes = dtype_size(t->dtype);
    for (int i = 0; i < t->ndim; i++) {
        if (__builtin_mul_overflow(bytes, (uint64_t)t->shape[i], &bytes))
            return err_set(err, "tensor '%s': element count overflows", t->name);
    }
    if (bytes != t->end - t->begin)
        return err_set(err,
                       "tensor '%s': shape and dtype %s need %llu bytes but data_offsets [%llu, "
                       "%llu] span %llu",
                       t->name, st_name(t->dtype), (unsigned long long)bytes,
                       (unsigned long long)t->begin, (unsigned long long)t->end,
                       (unsigned long long)(t->end - t->begin));
    if (t->end > data_len)
        return err_set(err, "tensor '%s': ends at byte %llu past the data size %zu", t->name,
                       (unsigned long long)t->end, data_len);
    return 0;
}

static int parse_entry(StTensor *t, const cJSON *entry, size_t data_len, Err *err) {
    if (!cJSON_IsObject(entry)) return err_set(err, "tensor '%s': entry is not an object", t->name);
    if (parse_dtype(t, entry, err) || parse_shape(t, entry, err) || parse_offsets(t, entry, err))
        return -1;
    return check_extent(t, data_len, err);
}

static int cmp_by_name(const void *a, const void *b) {
    return strcmp(((const StTensor *)a)->name, ((const StTensor *)b)->name);
}

static int cmp_by_begin(const void *a, const void *b) {
    const StTensor *x = *(const StTensor *const *)a, *y = *(const StTensor *const *)b;
    if (x->begin != y->begin) return x->begin < y->begin ? -1 : 1;
    return (x->end > y->end) - (x->end < y->end);
}

// Tensors are sorted by name: equal neighbours are duplicates (cJSON keeps both).
static int check_duplicates(const StFile *f, Err *err) {
    for (int i = 1; i < f->n_tensors; i++)
        if (strcmp(f->tensors[i - 1].name, f->tensors[i].name) == 0)
            return err_set(err, "tensor '%s' appears twice in the header", f->tensors[i].name);
    return 0;
}

// No byte of the data area may belong to two tensors (empty tensors own no bytes).
static int check_overlaps(const StFile *f, Err *err) {
    const StTensor **by_begin = malloc((size_t)f->n_tensors * sizeof *by_begin + 1);
    if (!by_begin) return err_resource(err, "out of memory sorting %d tensors", f->n_tensors);
    for (int i = 0; i < f->n_tensors; i++)
        by_begin[i] = &f->tensors[i];
    qsort(by_begin, (size_t)f->n_tensors, sizeof *by_begin, cmp_by_begin);
    const StTensor *reach = NULL; // the tensor reaching furthest so far
    int rc = 0;
    for (int i = 0; i < f->n_tensors && rc == 0; i++) {
        const StTensor *t = by_begin[i];
        if (t->begin == t->end) continue;
        if (reach && t->begin < reach->end)
            rc = err_set(err, "tensors '%s' and '%s' overlap (bytes %llu..%llu and %llu..%llu)",
                         reach->name, t->name, (unsigned long long)reach->begin,
                         (unsigned long long)reach->end, (unsigned long long)t->begin,
                         (unsigned long long)t->end);
        if (!reach || t->end > reach->end) reach = t;
    }
    free(by_begin);
    return rc;
}

static int parse_tensors(StFile *f, const cJSON *root, Err *err) {
    int n = cJSON_GetArraySize(root);
    f->tensors = calloc((size_t)n + 1, sizeof *f->tensors);
    if (!f->tensors) return err_resource(err, "out of memory for %d tensors", n);
    const cJSON *entry;
    cJSON_ArrayForEach(entry, root) {
        if (strcmp(entry->string, "__metadata__") == 0) continue; // free-form strings: unused
        StTensor *t = &f->tensors[f->n_tensors];
        t->name = strdup(entry->string);
        if (!t->name) return err_resource(err, "tensor '%s': out of memory", entry->string);
        f->n_tensors++;
        if (parse_entry(t, entry, f->data_len, err) != 0) return -1;
    }
    qsort(f->tensors, (size_t)f->n_tensors, sizeof *f->tensors, cmp_by_name);
    for (int i = 0; i < f->n_tensors; i++)
        f->tensors[i].bytes = f->data + f->tensors[i].begin;
    if (check_duplicates(f, err) != 0) return -1;
    return check_overlaps(f, err);
}

// Reads the length prefix; on success *hlen is the header length.
static int check_prefix(const uint8_t *buf, size_t len, uint64_t *hlen, Err *err) {
    if (len < 8)
        return err_set(err, "file is %zu bytes, shorter than the 8-byte header length", len);
    *hlen = read_le64(buf);
    if (*hlen > ST_MAX_HEADER_LEN)
        return err_set(err,
                       "header length %llu is absurdly large (limit %llu): not a "
                       "safetensors file?",
                       (unsigned long long)*hlen, ST_MAX_HEADER_LEN);
    if (*hlen > len - 8)
        return err_set(err, "header length %llu runs past the end of the file (%zu bytes)",
                       (unsigned long long)*hlen, len);
    return 0;
}

static int parse_header_json(const char *json, size_t n, cJSON **root, Err *err) {
    const char *end = NULL;
    *root = cJSON_ParseWithLengthOpts(json, n, &end, 0);
    if (!*root && n && json_out_of_memory())
        return err_resource(err, "out of memory parsing the %zu-byte header", n);
    if (!*root) {
        size_t at = end ? (size_t)(end - json) : 0;
        return err_set(err, "header is not valid JSON (near byte %zu of %zu)", at, n);
    }
    // Only padding may follow the object (the Python writer pads with spaces).
    for (const char *p = end; p < json + n; p++) {
        if (*p != ' ' && *p != '\t' && *p != '\n' && *p != '\r')
            return err_set(err, "header has data after the JSON object at byte %zu",
                           (size_t)(p - json));
    }
    if (!cJSON_IsObject(*root)) return err_set(err, "header JSON is not an object");
    return 0;
}

int st_parse(StFile *f, const uint8_t *buf, size_t len, Err *err) {
    memset(f, 0, sizeof *f);
    uint64_t hlen = 0;
    if (check_prefix(buf, len, &hlen, err) != 0) return -1;
    f->data = buf + 8 + hlen;
    f->data_len = len - 8 - (size_t)hlen;
    cJSON *root = NULL;
    int rc = parse_header_json((const char *)buf + 8, (size_t)hlen, &root, err);
    if (rc == 0) rc = parse_tensors(f, root, err);
    cJSON_Delete(root);
    if (rc != 0) st_close(f);
    return rc;
}

int st_open(StFile *f, const char *path, Err *err) {
    memset(f, 0, sizeof *f);
    struct stat st;
    int fd = fs_open_regular(path, &st, err);
    if (fd < 0) return -1;
    size_t len = (size_t)st.st_size;
    if (len < 8) {
        close(fd);
        return err_set(err, "%s: file is %zu bytes, shorter than the 8-byte header length", path,
                       len);
    }
    void *map = mmap(NULL, len, PROT_READ, MAP_PRIVATE, fd, 0);
    int map_errno = errno;
    close(fd);
    if (map == MAP_FAILED) return err_errno(err, map_errno, "%s: mmap failed", path);
    if (st_parse(f, map, len, err) != 0) {
        munmap(map, len);
        return err_prefix(err, "%s", path);
    }
    f->map = map;
    f->map_len = len;
    return 0;
}

void st_close(StFile *f) {
    for (int i = 0; i < f->n_tensors; i++)
        free(f->tensors[i].name);
    free(f->tensors);
    if (f->map) munmap(f->map, f->map_len);
    for (int i = 0; i < f->n_files; i++) {
        st_close(&f->files[i]);
        free(f->file_names[i]);
    }
    free(f->files);
    free(f->file_names);
    memset(f, 0, sizeof *f);
}

const StTensor *st_find(const StFile *f, const char *name) {
    StTensor key = {.name = (char *)name};
    return bsearch(&key, f->tensors, (size_t)f->n_tensors, sizeof *f->tensors, cmp_by_name);
}

// ---------------------------------------------------------------- reading tensors

void st_format_shape(char *out, size_t cap, int ndim, const int64_t *shape) {
    size_t used = (size_t)snprintf(out, cap, "[");
    for (int i = 0; i < ndim && used < cap; i++)
        used +=
            (size_t)snprintf(out + used, cap - used, "%s%lld", i ? ", " : "", (long long)shape[i]);
    if (used < cap) snprintf(out + used, cap - used, "]");
}

static int same_shape(const StTensor *t, int ndim, const int64_t *shape) {
    if (t->ndim != ndim) return 0;
    for (int i = 0; i < ndim; i++)
        if (t->shape[i] != shape[i]) return 0;
    return 1;
}

int st_read_f32(const StFile *f, const char *name, int ndim, const int64_t *shape, float *out,
                Err *err) {
    const StTensor *t = st_find(f, name);
    if (!t) return err_set(err, "tensor '%s' not found", name);
    if (!same_shape(t, ndim, shape)) {
        char got[160], want[160];
        st_format_shape(got, sizeof got, t->ndim, t->shape);
        st_format_shape(want, sizeof want, ndim, shape);
        return err_set(err, "tensor '%s' has shape %s, expected %s", name, got, want);
    }
    const uint8_t *src = t->bytes;
    size_t n = (size_t)(t->end - t->begin) / dtype_size(t->dtype);
    switch (t->dtype) {
    case DT_F32:
        memcpy(out, src, n * sizeof(float));
        return 0;
    case DT_BF16:
    case DT_F16:
        for (size_t i = 0; i < n; i++) {
            uint16_t h = (uint16_t)(src[2 * i] | (src[2 * i + 1] << 8));
            out[i] = t->dtype == DT_BF16 ? bf16_to_f32(h) : f16_to_f32(h);
        }
        return 0;
    default:
        return err_set(err, "tensor '%s' has dtype %s, not a float type", name, st_name(t->dtype));
    }
}

// ---------------------------------------------------------------- writing

static int sb_printf(Buf *sb, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static int sb_printf(Buf *sb, const char *fmt, ...) {
    char tmp[256];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n < 0 || (size_t)n >= sizeof tmp) return -1;
    return buf_append(sb, tmp, (size_t)n);
}

// JSON string literal of s, escaped as serde_json does.
static int sb_json_string(Buf *sb, const char *s) {
    int rc = buf_append(sb, "\"", 1);
    for (const unsigned char *p = (const unsigned char *)s; *p && rc == 0; p++) {
        if (*p == '"' || *p == '\\')
            rc = sb_printf(sb, "\\%c", *p);
        else if (*p < 0x20)
            rc = sb_printf(sb, "\\u%04x", *p);
        else
            rc = buf_append(sb, (const char *)p, 1);
    }
    return rc ? rc : buf_append(sb, "\"", 1);
}

static uint64_t numel_of(const StWriteTensor *t) {
    uint64_t n = 1;
    for (int i = 0; i < t->ndim; i++)
        n *= (uint64_t)t->shape[i];
    return n;
}

static int cmp_write_by_name(const void *a, const void *b) {
    return strcmp((*(const StWriteTensor *const *)a)->name,
                  (*(const StWriteTensor *const *)b)->name);
}

// The header {"name":{"dtype":..,"shape":[..],"data_offsets":[b,e]},..} with tensors
// in `order`, padded with spaces to a multiple of 8 like the Python writer.
static int build_header(Buf *sb, const StWriteTensor *const *order, int n, DType dtype) {
    int rc = buf_append(sb, "{", 1);
    uint64_t offset = 0;
    for (int i = 0; i < n && rc == 0; i++) {
        const StWriteTensor *t = order[i];
        uint64_t bytes = numel_of(t) * dtype_size(dtype);
        if (i) rc |= buf_append(sb, ",", 1);
        rc |= sb_json_string(sb, t->name);
        rc |= sb_printf(sb, ":{\"dtype\":\"%s\",\"shape\":[", st_name(dtype));
        for (int d = 0; d < t->ndim; d++)
            rc |= sb_printf(sb, "%s%lld", d ? "," : "", (long long)t->shape[d]);
        rc |= sb_printf(sb, "],\"data_offsets\":[%llu,%llu]}", (unsigned long long)offset,
                        (unsigned long long)(offset + bytes));
        offset += bytes;
    }
    rc |= buf_append(sb, "}", 1);
    while (rc == 0 && sb->len % 8 != 0)
        rc = buf_append(sb, " ", 1);
    return rc;
}

// Host floats staged at a time: a tensor held elsewhere (fetch) comes over in chunks.
enum { STAGE_FLOATS = 1 << 18 };

static int write_floats(FILE *fp, const float *src, size_t n, DType dtype) {
    if (dtype == DT_F32) return fwrite(src, sizeof(float), n, fp) == n ? 0 : -1;
    enum { CHUNK = 8192 };
    uint8_t buf[2 * CHUNK];
    for (size_t i = 0; i < n; i += CHUNK) {
        size_t m = n - i < CHUNK ? n - i : CHUNK;
        for (size_t j = 0; j < m; j++) {
            uint16_t h = f32_to_bf16(src[i + j]);
            buf[2 * j] = (uint8_t)(h & 0xFF);
            buf[2 * j + 1] = (uint8_t)(h >> 8);
        }
        if (fwrite(buf, 2, m, fp) != m) return -1;
    }
    return 0;
}

static int write_tensor_data(FILE *fp, const StWriteTensor *t, DType dtype, float *stage) {
    uint64_t n = numel_of(t);
    if (!t->fetch) return write_floats(fp, t->data, (size_t)n, dtype);
    for (uint64_t i = 0; i < n; i += STAGE_FLOATS) {
        size_t m = n - i < STAGE_FLOATS ? (size_t)(n - i) : STAGE_FLOATS;
        t->fetch(stage, t->data + i, m * sizeof(float));
        if (write_floats(fp, stage, m, dtype)) return -1;
    }
    return 0;
}

static int check_write_args(const StWriteTensor *const *order, int n, DType dtype, Err *err) {
    if (dtype != DT_F32 && dtype != DT_BF16)
        return err_set(err, "can only write F32 or BF16, not %s", st_name(dtype));
    for (int i = 0; i < n; i++) {
        const StWriteTensor *t = order[i];
        if (t->ndim < 0 || t->ndim > ST_MAX_DIMS)
            return err_set(err, "tensor '%s': %d dimensions", t->name, t->ndim);
        for (int d = 0; d < t->ndim; d++)
            if (t->shape[d] < 0)
                return err_set(err, "tensor '%s': negative dimension %lld", t->name,
                               (long long)t->shape[d]);
        if (i > 0 && strcmp(order[i - 1]->name, t->name) == 0)
            return err_set(err, "tensor '%s' given twice", t->name);
    }
    return 0;
}

static int write_file(const char *path, const Buf *header, const StWriteTensor *const *order, int n,
                      DType dtype, Err *err) {
    float *stage = malloc(STAGE_FLOATS * sizeof *stage);
    if (!stage) return err_resource(err, "%s: out of memory for the staging buffer", path);
    FILE *fp = fopen(path, "wb");
    if (!fp) {
        free(stage);
        return err_errno(err, errno, "%s: cannot create", path);
    }
    uint8_t prefix[8];
    for (int i = 0; i < 8; i++)
        prefix[i] = (uint8_t)((uint64_t)header->len >> (8 * i));
    int rc =
        fwrite(prefix, 1, 8, fp) == 8 && fwrite(header->data, 1, header->len, fp) == header->len
            ? 0
            : -1;
    for (int i = 0; i < n && rc == 0; i++)
        rc = write_tensor_data(fp, order[i], dtype, stage);
    free(stage);
    if (rc == 0 && (fflush(fp) != 0 || fsync(fileno(fp)) != 0)) rc = -1;
    int e = errno;
    if (fclose(fp) != 0 && rc == 0) {
        rc = -1;
        e = errno;
    }
    if (rc != 0) return err_errno(err, e, "%s: write failed", path);
    return 0;
}

int st_write(const char *path, const StWriteTensor *tensors, int n, DType dtype, Err *err) {
    const StWriteTensor **order = malloc(((size_t)n + 1) * sizeof *order);
    if (!order) return err_resource(err, "%s: out of memory", path);
    for (int i = 0; i < n; i++)
        order[i] = &tensors[i];
    qsort(order, (size_t)n, sizeof *order, cmp_write_by_name);
    Buf header = {0};
    int rc = check_write_args(order, n, dtype, err);
    if (rc != 0) {
        err_prefix(err, "%s", path);
    } else if (build_header(&header, order, n, dtype) != 0) {
        rc = err_resource(err, "%s: out of memory for the header", path);
    } else {
        rc = write_file(path, &header, order, n, dtype, err);
    }
    buf_free(&header);
    free(order);
    return rc;
}
