// fuzz_rpc.c: libFuzzer harness of what astraid runs on every byte a client sends
// (daemon/server.c on_read, daemon/dispatch.c dispatch_line): the line reader fed in
// chunks, the request parser, and the reply a request gets.
//
// The input is a byte stream. Its first byte seeds the chunk sizes the stream is fed
// in (as reads of a socket would cut it); when that byte is 0xF0 or more, a 0x01 byte in
// the stream stands for RPC_MAX_LINE - 16 spaces (JSON whitespace), so that lines at the
// size limit and over it are reachable (at a cost in speed: one input in 16).
// Checked:
//   - the reader returns exactly the lines a plain split on '\n' gives (a '\r' before
//     the newline dropped), whatever the chunking; a line over RPC_MAX_LINE is
//     reported once as oversized, also when its newline never comes;
//   - every reply (result, error, "no such method") is one line of valid UTF-8 that
//     parses as a JSON-RPC 2.0 object carrying the request's id as it was sent.
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>

#include <cjson/cJSON.h>

#include "proto/rpc.h"

#define BLOB_BYTE 0x01
#define BLOB_LEN (RPC_MAX_LINE - 16)
#define MAX_BLOBS 2 // enough for an oversized line; bounds an input's time

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size);

// The stream with every 0x01 (up to max_blobs of them) expanded; malloc'd. (memchr and
// memset rather than byte loops: the harness's own compares are instrumented too.)
static char *expand(const uint8_t *data, size_t size, size_t max_blobs, size_t *out_len) {
    char *out = malloc(size + max_blobs * BLOB_LEN + 1);
    if (!out) abort();
    size_t n = 0, blobs = 0;
    while (size) {
        const uint8_t *blob = blobs < max_blobs ? memchr(data, BLOB_BYTE, size) : NULL;
        size_t plain = blob ? (size_t)(blob - data) : size;
        memcpy(out + n, data, plain);
        n += plain;
        data += plain;
        size -= plain;
        if (blob) {
            memset(out + n, ' ', BLOB_LEN);
            n += BLOB_LEN;
            blobs++;
            data++;
            size--;
        }
    }
    *out_len = n;
    return out;
}

// The lines of a plain split, the model the reader must match: each is (begin, len,
// oversized). An unterminated tail counts only when it is already oversized.
typedef struct {
    size_t begin, len;
    int oversized;
} Line;

static Line *split_lines(const char *s, size_t n, size_t *count) {
    size_t cap = 16, k = 0;
    Line *lines = malloc(cap * sizeof *lines);
    if (!lines) abort();
    for (size_t begin = 0; begin <= n;) {
        const char *nl = memchr(s + begin, '\n', n - begin);
        size_t len = nl ? (size_t)(nl - s) - begin : n - begin;
        if (len && s[begin + len - 1] == '\r') len--;
        if (nl || len > RPC_MAX_LINE) {
            if (k == cap && !(lines = realloc(lines, (cap *= 2) * sizeof *lines))) abort();
            lines[k++] = (Line){begin, len, len > RPC_MAX_LINE};
        }
        if (!nl) break;
        begin = (size_t)(nl - s) + 1;
    }
    *count = k;
    return lines;
}

// A reply line: newline-terminated, no other newline, valid UTF-8, a JSON-RPC 2.0
// object whose id equals `id` (JSON null when id is NULL).
static void check_reply(char *reply, const cJSON *id) {
    if (!reply) abort(); // out of memory is not expected at these sizes
    size_t n = strlen(reply);
    if (n < 2 || reply[n - 1] != '\n' || memchr(reply, '\n', n - 1)) abort();
    if (!rpc_utf8_valid(reply, n)) abort();
    cJSON *msg = cJSON_ParseWithLength(reply, n);
    if (!cJSON_IsObject(msg)) abort();
    const cJSON *version = cJSON_GetObjectItemCaseSensitive(msg, "jsonrpc");
    if (!cJSON_IsString(version) || strcmp(version->valuestring, "2.0")) abort();
    const cJSON *got = cJSON_GetObjectItemCaseSensitive(msg, "id");
    if (!got) abort();
    if (id ? !cJSON_Compare(got, id, 1) : !cJSON_IsNull(got)) abort();
    cJSON_Delete(msg);
    free(reply);
}

// What dispatch_line answers, less the methods' own work: a parse error, a result,
// or "no such method" naming the method.
static void handle_line(const char *line, size_t len) {
    RpcRequest req;
    int code = 0;
    Err err = {0};
    if (rpc_parse_request(&req, line, len, &code, &err)) {
        if (code != RPC_PARSE_ERROR && code != RPC_INVALID_REQUEST && code != RPC_INVALID_PARAMS &&
            code != RPC_INTERNAL_ERROR)
            abort();
        check_reply(rpc_error(req.id, code, err.msg, NULL), req.id);
    } else {
        if (!req.method || !cJSON_IsObject(req.params)) abort();
        check_reply(rpc_result(req.id, cJSON_Duplicate(req.params, 1)), req.id);
        err_set(&err, "no such method: %s", req.method);
        check_reply(rpc_error(req.id, RPC_METHOD_NOT_FOUND, err.msg, NULL), req.id);
    }
    rpc_request_free(&req);
}

int LLVMFuzzerTestOneInput(const uint8_t *data, size_t size) {
    if (size == 0) return 0;
    uint32_t seed = data[0] * 2654435761u + 1;
    size_t n;
    char *stream = expand(data + 1, size - 1, data[0] >= 0xF0 ? MAX_BLOBS : 0, &n);
    size_t n_lines, next = 0;
    Line *want = split_lines(stream, n, &n_lines);

    RpcReader r;
    rpc_reader_init(&r);
    for (size_t off = 0; off < n;) {
        // Chunks of 1 byte to 64 KiB, as reads cut a stream.
        seed = seed * 1103515245u + 12345u;
        size_t chunk = (size_t)1 << (seed >> 16) % 17;
        chunk += (seed >> 8) % chunk;
        if (chunk > n - off) chunk = n - off;
        if (rpc_reader_feed(&r, stream + off, chunk)) abort();
        off += chunk;
        char *line;
        size_t len;
        int kind;
        while ((kind = rpc_reader_next(&r, &line, &len)) != RPC_LINE_NONE) {
            if (next == n_lines) abort(); // a line the split does not have
            const Line *w = &want[next++];
            if ((kind == RPC_LINE_OVERSIZED) != w->oversized) abort();
            if (kind == RPC_LINE_OVERSIZED) continue;
            if (len != w->len || memcmp(line, stream + w->begin, len) || line[len]) abort();
            handle_line(line, len);
        }
    }
    if (next != n_lines) abort(); // a line the reader lost
    rpc_reader_free(&r);
    free(want);
    free(stream);
    return 0;
}
