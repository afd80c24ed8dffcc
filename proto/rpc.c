// rpc.c: NDJSON framing, JSON-RPC 2.0 envelope parsing and serialisation (rpc.h).
#include "proto/rpc.h"

#include <cjson/cJSON.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

// ---------------------------------------------------------------- line reader

void rpc_reader_init(RpcReader *r) {
    memset(r, 0, sizeof *r);
}

void rpc_reader_free(RpcReader *r) {
    free(r->buf);
    rpc_reader_init(r);
}

// Drops the bytes already returned as lines, so buf starts with pending bytes.
static void reader_compact(RpcReader *r) {
    if (!r->start) return;
    memmove(r->buf, r->buf + r->start, r->len - r->start);
    r->len -= r->start;
    r->scanned -= r->start;
    r->start = 0;
}

static int reader_append(RpcReader *r, const char *data, size_t len) {
    if (r->len + len + 1 > r->cap) {
        size_t cap = r->cap ? r->cap : 4096;
        while (cap < r->len + len + 1)
            cap *= 2;
        char *buf = realloc(r->buf, cap);
        if (!buf) return -1;
        r->buf = buf;
        r->cap = cap;
    }
    memcpy(r->buf + r->len, data, len);
    r->len += len;
    return 0;
}

int rpc_reader_feed(RpcReader *r, const char *data, size_t len) {
    if (r->skipping) { // the rest of an oversized line is dropped up to its newline
        const char *nl = memchr(data, '\n', len);
        if (!nl) return 0;
        r->skipping = 0;
        len -= (size_t)(nl + 1 - data);
        data = nl + 1;
    }
    reader_compact(r);
    return reader_append(r, data, len);
}

// A line's length without its newline and an optional '\r' before it.
static size_t content_len(const char *line, size_t len) {
    return len && line[len - 1] == '\r' ? len - 1 : len;
}

int rpc_reader_next(RpcReader *r, char **line, size_t *len) {
    reader_compact(r);
    char *nl = r->len > r->scanned ? memchr(r->buf + r->scanned, '\n', r->len - r->scanned) : NULL;
    if (!nl) {
        r->scanned = r->len;
        // Unterminated so far: report once it is certain the line cannot fit.
        if (content_len(r->buf, r->len) <= RPC_MAX_LINE) return RPC_LINE_NONE;
        r->len = r->scanned = 0;
        r->skipping = 1;
        return RPC_LINE_OVERSIZED;
    }
    size_t n = content_len(r->buf, (size_t)(nl - r->buf));
    r->start = r->scanned = (size_t)(nl - r->buf) + 1;
    if (n > RPC_MAX_LINE) return RPC_LINE_OVERSIZED;
    r->buf[n] = '\0';
    *line = r->buf;
    *len = n;
    return RPC_LINE_OK;
}

// ---------------------------------------------------------------- UTF-8

// Length of the sequence led by byte b, 0 for a byte that cannot lead one.
static int utf8_seq_len(unsigned char b) {
    if (b < 0x80) return 1;
    if (b >= 0xC2 && b <= 0xDF) return 2; // C0, C1 only lead overlong forms
    if (b >= 0xE0 && b <= 0xEF) return 3;
    if (b >= 0xF0 && b <= 0xF4) return 4; // F5.. would exceed U+10FFFF
    return 0;
}

int rpc_utf8_valid(const char *str, size_t len) {
    const unsigned char *s = (const unsigned char *)str;
    size_t i = 0;
    while (i < len) {
        int n = utf8_seq_len(s[i]);
        if (!n || i + (size_t)n > len) return 0;
        uint32_t cp = n == 1 ? s[i] : s[i] & (0x7F >> n);
        for (int k = 1; k < n; k++) {
            if ((s[i + k] & 0xC0) != 0x80) return 0;
            cp = cp << 6 | (s[i + k] & 0x3F);
        }
        static const uint32_t min_cp[5] = {0, 0, 0x80, 0x800, 0x10000};
        if (cp < min_cp[n] || cp > 0x10FFFF || (cp >= 0xD800 && cp <= 0xDFFF)) return 0;
        i += (size_t)n;
    }
    return 1;
}

// Offset of the first invalid byte, for the error message.
static size_t utf8_error_offset(const char *s, size_t len) {
    size_t good = 0;
    for (size_t end = 1; end <= len; end++)
        if (rpc_utf8_valid(s + good, end - good))
            good = end;
        else if (end - good >= 4)
            break;
    return good;
}

// ---------------------------------------------------------------- requests

static int valid_id(const cJSON *id) {
    return cJSON_IsNumber(id) || cJSON_IsString(id) || cJSON_IsNull(id);
}

static int fail(int *code, int value, Err *err, const char *msg) {
    *code = value;
    return err_set(err, "%s", msg);
}

static int parse_json(RpcRequest *req, const char *line, size_t len, int *code, Err *err) {
    if (!rpc_utf8_valid(line, len)) {
        *code = RPC_PARSE_ERROR;
        return err_set(err, "invalid UTF-8 at byte %zu", utf8_error_offset(line, len));
    }
    const char *end = NULL;
    req->root = cJSON_ParseWithLengthOpts(line, len, &end, 0);
    while (req->root && end < line + len && strchr(" \t\r\n", *end) && *end)
        end++;
    if (!req->root || end != line + len) {
        *code = RPC_PARSE_ERROR;
        const char *at = req->root ? end : cJSON_GetErrorPtr();
        size_t off = at && at >= line && at <= line + len ? (size_t)(at - line) : 0;
        return err_set(err, "invalid JSON at byte %zu", off);
    }
    return 0;
}

static int check_envelope(RpcRequest *req, int *code, Err *err) {
    cJSON *root = req->root;
    if (!cJSON_IsObject(root))
        return fail(code, RPC_INVALID_REQUEST, err, "request must be a JSON object");
    const cJSON *id = cJSON_GetObjectItemCaseSensitive(root, "id");
    if (id && !valid_id(id))
        return fail(code, RPC_INVALID_REQUEST, err, "id must be a number, a string or null");
    req->id = id;
    const cJSON *version = cJSON_GetObjectItemCaseSensitive(root, "jsonrpc");
    if (!cJSON_IsString(version) || strcmp(version->valuestring, "2.0"))
        return fail(code, RPC_INVALID_REQUEST, err, "jsonrpc must be \"2.0\"");
    const cJSON *method = cJSON_GetObjectItemCaseSensitive(root, "method");
    if (!cJSON_IsString(method))
        return fail(code, RPC_INVALID_REQUEST, err, "method must be a string");
    req->method = method->valuestring;
    cJSON *params = cJSON_GetObjectItemCaseSensitive(root, "params");
    if (!params) {
        params = cJSON_AddObjectToObject(root, "params");
        if (!params) return fail(code, RPC_INTERNAL_ERROR, err, "out of memory");
    }
    if (cJSON_IsArray(params))
        return fail(code, RPC_INVALID_PARAMS, err, "params must be an object (named parameters)");
    if (!cJSON_IsObject(params))
        return fail(code, RPC_INVALID_REQUEST, err, "params must be an object");
    req->params = params;
    return 0;
}

int rpc_parse_request(RpcRequest *req, const char *line, size_t len, int *code, Err *err) {
    memset(req, 0, sizeof *req);
    if (parse_json(req, line, len, code, err)) return -1;
    if (check_envelope(req, code, err)) {
        req->method = NULL;
        req->params = NULL;
        return -1;
    }
    return 0;
}

void rpc_request_free(RpcRequest *req) {
    cJSON_Delete(req->root);
    memset(req, 0, sizeof *req);
}

// ---------------------------------------------------------------- serialisation

// Prints msg as one line with its newline and frees it; NULL when out of memory.
static char *finish_line(cJSON *msg) {
    char *text = msg ? cJSON_PrintUnformatted(msg) : NULL;
    cJSON_Delete(msg);
    if (!text) return NULL;
    size_t n = strlen(text);
    char *line = realloc(text, n + 2);
    if (!line) {
        free(text);
        return NULL;
    }
    line[n] = '\n';
    line[n + 1] = '\0';
    return line;
}

// {"jsonrpc":"2.0"} plus the id (JSON null when id is NULL) unless with_id is 0.
static cJSON *envelope(const cJSON *id, int with_id) {
    cJSON *msg = cJSON_CreateObject();
    if (!msg || !cJSON_AddStringToObject(msg, "jsonrpc", "2.0")) goto fail;
    if (with_id) {
        cJSON *copy = id ? cJSON_Duplicate(id, 1) : cJSON_CreateNull();
        if (!copy) goto fail;
        cJSON_AddItemToObject(msg, "id", copy);
    }
    return msg;
fail:
    cJSON_Delete(msg);
    return NULL;
}

// Adds item (owned; JSON null when NULL) under key; frees item when msg is NULL.
static cJSON *add_owned(cJSON *msg, const char *key, cJSON *item) {
    if (!item) item = cJSON_CreateNull();
    if (!msg || !item) {
        cJSON_Delete(item);
        cJSON_Delete(msg);
        return NULL;
    }
    cJSON_AddItemToObject(msg, key, item);
    return msg;
}

char *rpc_result(const cJSON *id, cJSON *result) {
    return finish_line(add_owned(envelope(id, 1), "result", result));
}

char *rpc_error(const cJSON *id, int code, const char *message, cJSON *data) {
    cJSON *error = cJSON_CreateObject();
    if (error) {
        cJSON_AddNumberToObject(error, "code", code);
        cJSON_AddStringToObject(error, "message", message);
        if (data) cJSON_AddItemToObject(error, "data", data);
        data = NULL;
    }
    cJSON_Delete(data);
    return finish_line(add_owned(envelope(id, 1), "error", error));
}

char *rpc_push(const char *method, cJSON *params) {
    cJSON *msg = envelope(NULL, 0);
    if (msg) cJSON_AddStringToObject(msg, "method", method);
    return finish_line(add_owned(msg, "params", params ? params : cJSON_CreateObject()));
}

char *rpc_request(long id, const char *method, cJSON *params) {
    cJSON *msg = envelope(NULL, 0);
    if (msg) {
        cJSON_AddNumberToObject(msg, "id", (double)id);
        cJSON_AddStringToObject(msg, "method", method);
    }
    return finish_line(add_owned(msg, "params", params ? params : cJSON_CreateObject()));
}
