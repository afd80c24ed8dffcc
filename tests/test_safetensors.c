// test_safetensors.c: the safetensors reader rejects every malformed header with
// a message naming the problem; f32/bf16 round trips; header bytes as the
// Python writer makes them.
//
// Also a helper for tests/test_safetensors_py.py (the Python side of the checks):
//   test_safetensors --write-sample DIR   writes sample_f32/sample_bf16.safetensors
//   test_safetensors --dump FILE          prints "name shape v0 v1 ..." per tensor
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "check.h"
#include "ckpt/safetensors.h"
#include "common/half.h"

// ---------------------------------------------------------------- helpers

// A file image: 8-byte length of `header`, the header, then data_len bytes of 0x11.
static uint8_t *make_image(const char *header, size_t data_len, size_t *len) {
    size_t h = strlen(header);
    *len = 8 + h + data_len;
    uint8_t *buf = malloc(*len);
    for (int i = 0; i < 8; i++)
        buf[i] = (uint8_t)((uint64_t)h >> (8 * i));
    memcpy(buf + 8, header, h);
    memset(buf + 8 + h, 0x11, data_len);
    return buf;
}

// Parses the image of header + data and checks that it fails with `want` in the message.
static void expect_reject(const char *header, size_t data_len, const char *want) {
    size_t len;
    uint8_t *buf = make_image(header, data_len, &len);
    StFile f;
    Err err = {0};
    int rc = st_parse(&f, buf, len, &err);
    CHECK_MSG(rc == -1, "accepted %s", header);
    CHECK_MSG(strstr(err.msg, want) != NULL, "message '%s' lacks '%s' (header %s)", err.msg, want,
              header);
    free(buf);
}

static void expect_accept(const char *header, size_t data_len, int n_tensors) {
    size_t len;
    uint8_t *buf = make_image(header, data_len, &len);
    StFile f;
    Err err = {0};
    int rc = st_parse(&f, buf, len, &err);
    CHECK_MSG(rc == 0, "rejected %s: %s", header, err.msg);
    if (rc == 0) {
        CHECK(f.n_tensors == n_tensors);
        st_close(&f);
    }
    free(buf);
}

static uint32_t bits_of(float f) {
    uint32_t b;
    memcpy(&b, &f, sizeof b);
    return b;
}

static float float_of(uint32_t b) {
    float f;
    memcpy(&f, &b, sizeof f);
    return f;
}

// ---------------------------------------------------------------- reader errors

static void test_prefix_errors(void) {
    StFile f;
    Err err = {0};
    uint8_t tiny[5] = {1, 0, 0, 0, 0};
    CHECK(st_parse(&f, tiny, sizeof tiny, &err) == -1);
    CHECK_MSG(strstr(err.msg, "shorter than the 8-byte") != NULL, "%s", err.msg);

    uint8_t past[12] = {100, 0, 0, 0, 0, 0, 0, 0, '{', '}', ' ', ' '};
    CHECK(st_parse(&f, past, sizeof past, &err) == -1);
    CHECK_MSG(strstr(err.msg, "header length 100 runs past the end") != NULL, "%s", err.msg);

    uint8_t huge[16] = {0, 0, 0, 0, 0, 0, 0, 0x40, '{', '}'};
    CHECK(st_parse(&f, huge, sizeof huge, &err) == -1);
    CHECK_MSG(strstr(err.msg, "absurdly large") != NULL, "%s", err.msg);
}

static void test_header_errors(void) {
    expect_reject("{\"a\": {", 0, "not valid JSON");
    expect_reject("[1, 2]", 0, "not an object");
    expect_reject("{} x", 0, "data after the JSON object");
    expect_reject("{\"a\": 3}", 0, "tensor 'a': entry is not an object");
    expect_reject("{\"a\": {\"shape\": [1], \"data_offsets\": [0, 4]}}", 4,
                  "tensor 'a': missing \"dtype\"");
    expect_reject("{\"a\": {\"dtype\": \"F32\", \"data_offsets\": [0, 4]}}", 4,
                  "tensor 'a': missing \"shape\"");
    expect_reject("{\"a\": {\"dtype\": \"F32\", \"shape\": [1]}}", 4,
                  "tensor 'a': missing \"data_offsets\"");
    expect_reject("{\"a\": {\"dtype\": \"F64\", \"shape\": [1], \"data_offsets\": [0, 8]}}", 8,
                  "tensor 'a': unknown dtype 'F64'");
    expect_reject("{\"a\": {\"dtype\": 32, \"shape\": [1], \"data_offsets\": [0, 4]}}", 4,
                  "tensor 'a': \"dtype\" is not a string");
    expect_reject("{\"a\": {\"dtype\": \"F32\", \"shape\": [-1], \"data_offsets\": [0, 4]}}", 4,
                  "tensor 'a': shape entry 0 is not a non-negative integer");
    expect_reject("{\"a\": {\"dtype\": \"F32\", \"shape\": [2, 1.5], \"data_offsets\": [0, 12]}}",
                  12, "tensor 'a': shape entry 1 is not a non-negative integer");
    expect_reject("{\"a\": {\"dtype\": \"F32\", \"shape\": \"2\", \"data_offsets\": [0, 8]}}", 8,
                  "tensor 'a': \"shape\" is not an array");
    expect_reject("{\"a\": {\"dtype\": \"F32\", \"shape\": [1,1,1,1,1,1,1,1,1], "
                  "\"data_offsets\": [0, 4]}}",
                  4, "tensor 'a': 9 dimensions");
    expect_reject("{\"a\": {\"dtype\": \"F32\", \"shape\": [2, 3], \"data_offsets\": [0, 20]}}", 24,
                  "tensor 'a': shape and dtype F32 need 24 bytes but data_offsets [0, 20]");
    expect_reject("{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [8, 4]}}", 8,
                  "tensor 'a': data_offsets begin 8 > end 4");
    expect_reject("{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0]}}", 8,
                  "tensor 'a': \"data_offsets\" is not [begin, end]");
    expect_reject("{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [-4, 0]}}", 8,
                  "tensor 'a': \"data_offsets\" is not [begin, end]");
    expect_reject("{\"a\": {\"dtype\": \"BF16\", \"shape\": [4], \"data_offsets\": [4, 12]}}", 10,
                  "tensor 'a': ends at byte 12 past the data size 10");
    expect_reject("{\"a\": {\"dtype\": \"U8\", \"shape\": [1099511627776, 1099511627776, "
                  "1099511627776], \"data_offsets\": [0, 4]}}",
                  4, "tensor 'a': element count overflows");
    expect_reject("{\"a\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [0, 8]},"
                  " \"b\": {\"dtype\": \"F32\", \"shape\": [2], \"data_offsets\": [4, 12]}}",
                  12, "tensors 'a' and 'b' overlap");
    expect_reject("{\"a\": {\"dtype\": \"F32\", \"shape\": [4], \"data_offsets\": [0, 16]},"
                  " \"b\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [4, 8]}}",
                  16, "overlap");
    expect_reject("{\"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]},"
                  " \"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [4, 8]}}",
                  8, "tensor 'a' appears twice");
}

static void test_header_accepts(void) {
    // __metadata__ is skipped; empty tensors own no bytes and overlap nothing.
    expect_accept("{\"__metadata__\": {\"format\": \"pt\"},"
                  " \"a\": {\"dtype\": \"F32\", \"shape\": [1], \"data_offsets\": [0, 4]}}   ",
                  4, 1);
    expect_accept("{\"a\": {\"dtype\": \"F32\", \"shape\": [0], \"data_offsets\": [0, 0]},"
                  " \"b\": {\"dtype\": \"I64\", \"shape\": [], \"data_offsets\": [0, 8]},"
                  " \"c\": {\"dtype\": \"F16\", \"shape\": [2, 0], \"data_offsets\": [8, 8]}}",
                  8, 3);
    expect_accept("{}", 0, 0);
}

static void test_open_errors(void) {
    StFile f;
    Err err = {0};
    CHECK(st_open(&f, "no/such/file.safetensors", &err) == -1);
    CHECK_MSG(strstr(err.msg, "no/such/file.safetensors: cannot open: No such file") != NULL, "%s",
              err.msg);

    const char *path = "st_short.safetensors";
    FILE *fp = fopen(path, "wb");
    fwrite("\x02\0\0", 1, 3, fp);
    fclose(fp);
    CHECK(st_open(&f, path, &err) == -1);
    CHECK_MSG(strstr(err.msg, "st_short.safetensors: file is 3 bytes") != NULL, "%s", err.msg);

    // Parse errors are prefixed with the path and name the tensor.
    size_t len;
    uint8_t *img = make_image("{\"w\": {\"dtype\": \"F32\", \"shape\": [3], "
                              "\"data_offsets\": [0, 12]}}",
                              8, &len);
    fp = fopen(path, "wb");
    fwrite(img, 1, len, fp);
    fclose(fp);
    free(img);
    CHECK(st_open(&f, path, &err) == -1);
    CHECK_MSG(strstr(err.msg, "st_short.safetensors: tensor 'w': ends at byte 12") != NULL, "%s",
              err.msg);
    unlink(path);
}

// ---------------------------------------------------------------- conversions

static void test_bf16_rounding(void) {
    // Ties go to the even bf16 mantissa; anything above a tie rounds up.
    CHECK(f32_to_bf16(float_of(0x3F808000)) == 0x3F80);
    CHECK(f32_to_bf16(float_of(0x3F818000)) == 0x3F82);
    CHECK(f32_to_bf16(float_of(0x3F808001)) == 0x3F81);
    CHECK(f32_to_bf16(float_of(0x3F807FFF)) == 0x3F80);
    CHECK(f32_to_bf16(float_of(0xBF818000)) == 0xBF82);
    CHECK(f32_to_bf16(1.0f) == 0x3F80);
    CHECK(f32_to_bf16(INFINITY) == 0x7F80);
    CHECK(f32_to_bf16(-INFINITY) == 0xFF80);
    // The largest finite float rounds up to infinity (as torch does).
    CHECK(f32_to_bf16(float_of(0x7F7FFFFF)) == 0x7F80);
    // A NaN whose payload is only in the low half must not become infinity.
    CHECK(isnan(bf16_to_f32(f32_to_bf16(float_of(0x7F800001)))));
    CHECK(isnan(bf16_to_f32(f32_to_bf16(float_of(0xFFC00000)))));
    CHECK(bf16_to_f32(0x4049) == float_of(0x40490000));
}

static void test_f16_conversion(void) {
    CHECK(f16_to_f32(0x3C00) == 1.0f);
    CHECK(f16_to_f32(0xC000) == -2.0f);
    CHECK(f16_to_f32(0x7BFF) == 65504.0f);
    CHECK(f16_to_f32(0x0001) == ldexpf(1.0f, -24));
    CHECK(f16_to_f32(0x03FF) == ldexpf(1023.0f, -24));
    CHECK(f16_to_f32(0x0400) == ldexpf(1.0f, -14));
    CHECK(f16_to_f32(0x3555) == 1365.0f / 4096.0f);
    CHECK(f16_to_f32(0x7C00) == INFINITY);
    CHECK(f16_to_f32(0xFC00) == -INFINITY);
    CHECK(isnan(f16_to_f32(0x7E00)));
    CHECK(bits_of(f16_to_f32(0x8000)) == 0x80000000u);
}

// ---------------------------------------------------------------- round trips

static float sample_value(int tensor, size_t i) {
    return (float)((double)tensor * 0.37 + (double)i * 0.01137 - 0.5) * (i % 3 ? 1.0f : -3.0f);
}

enum { N_SAMPLE = 4 };

// Four tensors given out of name order: a matrix, a vector, a scalar, an empty one.
static void sample_tensors(StWriteTensor *t, float *store) {
    static const char *names[N_SAMPLE] = {"layers.0.mlp.up.weight", "norm.weight", "scalar",
                                          "empty"};
    static const int ndims[N_SAMPLE] = {2, 1, 0, 2};
    static const int64_t shapes[N_SAMPLE][2] = {{5, 7}, {7, 0}, {0, 0}, {3, 0}};
    for (int k = 0; k < N_SAMPLE; k++) {
        t[k] = (StWriteTensor){.name = names[k], .ndim = ndims[k], .data = store + 64 * k};
        memcpy(t[k].shape, shapes[k], sizeof shapes[k]);
        for (size_t i = 0; i < 64; i++)
            store[64 * k + i] = sample_value(k, i);
    }
}

static size_t numel(const StWriteTensor *t) {
    size_t n = 1;
    for (int d = 0; d < t->ndim; d++)
        n *= (size_t)t->shape[d];
    return n;
}

static void check_round_trip(DType dtype, const char *path) {
    float store[64 * N_SAMPLE];
    StWriteTensor t[N_SAMPLE];
    sample_tensors(t, store);
    Err err = {0};
    CHECK_MSG(st_write(path, t, N_SAMPLE, dtype, &err) == 0, "%s", err.msg);
    StFile f;
    if (st_open(&f, path, &err) != 0) {
        CHECK_MSG(0, "%s", err.msg);
        return;
    }
    CHECK(f.n_tensors == N_SAMPLE);
    for (int k = 0; k < N_SAMPLE; k++) {
        float out[64];
        CHECK_MSG(st_read_f32(&f, t[k].name, t[k].ndim, t[k].shape, out, &err) == 0, "%s", err.msg);
        const StTensor *st = st_find(&f, t[k].name);
        CHECK(st && st->dtype == dtype);
        for (size_t i = 0; i < numel(&t[k]); i++) {
            float want = dtype == DT_F32 ? t[k].data[i] : bf16_to_f32(f32_to_bf16(t[k].data[i]));
            CHECK_MSG(bits_of(out[i]) == bits_of(want), "%s[%zu]: %g vs %g", t[k].name, i, out[i],
                      want);
        }
    }
    st_close(&f);
}

static void test_round_trips(void) {
    check_round_trip(DT_F32, "st_rt_f32.safetensors");
    check_round_trip(DT_BF16, "st_rt_bf16.safetensors");
    unlink("st_rt_f32.safetensors");
    unlink("st_rt_bf16.safetensors");
}

// The header is the Python writer's: compact JSON, keys sorted, offsets packed in
// that order, spaces up to a multiple of 8.
static void test_header_bytes(void) {
    const float a[2] = {1, 2}, b[3] = {3, 4, 5};
    StWriteTensor t[2] = {{.name = "b", .ndim = 1, .shape = {3}, .data = b},
                          {.name = "a", .ndim = 2, .shape = {1, 2}, .data = a}};
    Err err = {0};
    const char *path = "st_header.safetensors";
    CHECK_MSG(st_write(path, t, 2, DT_BF16, &err) == 0, "%s", err.msg);
    const char *want = "{\"a\":{\"dtype\":\"BF16\",\"shape\":[1,2],\"data_offsets\":[0,4]},"
                       "\"b\":{\"dtype\":\"BF16\",\"shape\":[3],\"data_offsets\":[4,10]}}";
    size_t padded = (strlen(want) + 7) / 8 * 8;
    uint8_t buf[512];
    FILE *fp = fopen(path, "rb");
    size_t got = fp ? fread(buf, 1, sizeof buf, fp) : 0;
    if (fp) fclose(fp);
    CHECK(got == 8 + padded + 10);
    CHECK(buf[0] == padded && buf[1] == 0 && buf[7] == 0);
    CHECK(memcmp(buf + 8, want, strlen(want)) == 0);
    for (size_t i = strlen(want); i < padded; i++)
        CHECK(buf[8 + i] == ' ');
    // bf16 of 1.0 is 0x3F80, stored little-endian.
    CHECK(buf[8 + padded] == 0x80 && buf[8 + padded + 1] == 0x3F);
    unlink(path);
}

static void test_read_errors(void) {
    const float v[6] = {0};
    StWriteTensor t = {.name = "w", .ndim = 2, .shape = {2, 3}, .data = v};
    Err err = {0};
    const char *path = "st_read_err.safetensors";
    CHECK(st_write(path, &t, 1, DT_F32, &err) == 0);
    StFile f;
    if (st_open(&f, path, &err) != 0) {
        CHECK_MSG(0, "%s", err.msg);
        return;
    }
    float out[6];
    CHECK(st_read_f32(&f, "nope", 2, t.shape, out, &err) == -1);
    CHECK_MSG(strstr(err.msg, "tensor 'nope' not found") != NULL, "%s", err.msg);
    int64_t wrong[2] = {3, 2};
    CHECK(st_read_f32(&f, "w", 2, wrong, out, &err) == -1);
    CHECK_MSG(strstr(err.msg, "tensor 'w' has shape [2, 3], expected [3, 2]") != NULL, "%s",
              err.msg);
    CHECK(st_read_f32(&f, "w", 1, wrong, out, &err) == -1);
    CHECK_MSG(strstr(err.msg, "expected [3]") != NULL, "%s", err.msg);
    st_close(&f);
    unlink(path);

    // An integer tensor cannot be read as floats.
    size_t len;
    uint8_t *img = make_image("{\"ids\": {\"dtype\": \"I32\", \"shape\": [2], "
                              "\"data_offsets\": [0, 8]}}",
                              8, &len);
    CHECK(st_parse(&f, img, len, &err) == 0);
    int64_t two = 2;
    CHECK(st_read_f32(&f, "ids", 1, &two, out, &err) == -1);
    CHECK_MSG(strstr(err.msg, "tensor 'ids' has dtype I32, not a float type") != NULL, "%s",
              err.msg);
    st_close(&f);
    free(img);
}

static void test_write_errors(void) {
    const float v[2] = {0};
    StWriteTensor t[2] = {{.name = "x", .ndim = 1, .shape = {2}, .data = v},
                          {.name = "x", .ndim = 1, .shape = {2}, .data = v}};
    Err err = {0};
    CHECK(st_write("st_dup.safetensors", t, 2, DT_F32, &err) == -1);
    CHECK_MSG(strstr(err.msg, "st_dup.safetensors: tensor 'x' given twice") != NULL, "%s", err.msg);
    CHECK(st_write("st_dup.safetensors", t, 1, DT_I32, &err) == -1);
    CHECK_MSG(strstr(err.msg, "can only write F32 or BF16, not I32") != NULL, "%s", err.msg);
    CHECK(st_write("no/such/dir/x.safetensors", t, 1, DT_F32, &err) == -1);
    CHECK_MSG(strstr(err.msg, "no/such/dir/x.safetensors: cannot create") != NULL, "%s", err.msg);
    CHECK(access("st_dup.safetensors", F_OK) != 0);
}

// ---------------------------------------------------------------- helper modes

static int write_sample(const char *dir) {
    float store[64 * N_SAMPLE];
    StWriteTensor t[N_SAMPLE];
    sample_tensors(t, store);
    // Values around rounding ties and specials, for the bf16 comparison with torch.
    static const uint32_t specials[] = {0x3F808000, 0x3F818000, 0x3F808001, 0x7F800001,
                                        0x7F7FFFFF, 0xFF800000, 0x00000001, 0x80000000};
    for (size_t i = 0; i < sizeof specials / sizeof specials[0]; i++)
        store[i] = float_of(specials[i]);
    const struct {
        const char *file;
        DType dtype;
    } outs[] = {{"sample_f32.safetensors", DT_F32}, {"sample_bf16.safetensors", DT_BF16}};
    for (int o = 0; o < 2; o++) {
        char path[4096];
        snprintf(path, sizeof path, "%s/%s", dir, outs[o].file);
        Err err = {0};
        if (st_write(path, t, N_SAMPLE, outs[o].dtype, &err) != 0) {
            fprintf(stderr, "%s\n", err.msg);
            return 1;
        }
    }
    return 0;
}

static int dump(const char *path) {
    StFile f;
    Err err = {0};
    if (st_open(&f, path, &err) != 0) {
        fprintf(stderr, "%s\n", err.msg);
        return 2;
    }
    for (int k = 0; k < f.n_tensors; k++) {
        const StTensor *t = &f.tensors[k];
        size_t n = 1;
        printf("%s [", t->name);
        for (int d = 0; d < t->ndim; d++) {
            printf("%s%lld", d ? "," : "", (long long)t->shape[d]);
            n *= (size_t)t->shape[d];
        }
        printf("]");
        float *out = malloc(n * sizeof *out + 1);
        if (st_read_f32(&f, t->name, t->ndim, t->shape, out, &err) != 0) {
            fprintf(stderr, "%s\n", err.msg);
            return 2;
        }
        for (size_t i = 0; i < n; i++)
            printf(" %08x", bits_of(out[i]));
        printf("\n");
        free(out);
    }
    st_close(&f);
    return 0;
}

int main(int argc, char **argv) {
    if (argc == 3 && strcmp(argv[1], "--write-sample") == 0) return write_sample(argv[2]);
    if (argc == 3 && strcmp(argv[1], "--dump") == 0) return dump(argv[2]);
    test_prefix_errors();
    test_header_errors();
    test_header_accepts();
    test_open_errors();
    test_bf16_rounding();
    test_f16_conversion();
    test_round_trips();
    test_header_bytes();
    test_read_errors();
    test_write_errors();
    CHECK_DONE();
}
