// rpc.c: NDJSON framing, JSON-RPC 2.0 envelope parsing and serialisation (rpc.h).
#include "proto/rpc.h"

#include <cjson/cJSON.h>
#include <math.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "common/buf.h"
#include "common/json.h"

// ---------------------------------------------------------------- line reader

void rpc_reader_init(RpcReader *r) {
    memset(r, 0, sizeof *r);
}

void rpc_reader_free(RpcReader *r) {
    free(r->buf);
    rpc_reader_init(r);
}

// Moves the bytes not yet returned as lines to the front of buf. Called when appending,
// never between the lines of one read: moving the rest down after each line would cost
// quadratic time in the lines buffered. An emptied buffer grown past RPC_READER_KEEP (by
// a long line, a burst of requests) is given back.
static void reader_compact(RpcReader *r) {
    if (r->start == r->len) {
        r->start = r->len = r->scanned = 0;
        if (r->cap > RPC_READER_KEEP) {
            free(r->buf);
            r->buf = NULL;
            r->cap = 0;
        }
        return;
    }
    if (!r->start) return;
    memmove(r->buf, r->buf + r->start, r->len - r->start);
    r->len -= r->start;
    r->scanned -= r->start;
    r->start = 0;
}

static int reader_append(RpcReader *r, const char *data, size_t len) {
    if (buf_reserve(&r->buf, &r->cap, r->len + len + 1, 1)) return -1;
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

size_t rpc_reader_pending(const RpcReader *r) {
    return r->len - r->start;
}

// A line's length without its newline and an optional '\r' before it.
static size_t content_len(const char *line, size_t len) {
    return len && line[len - 1] == '\r' ? len - 1 : len;
}

int rpc_reader_next(RpcReader *r, char **line, size_t *len) {
    if (r->start == r->len) reader_compact(r); // nothing to move: only resets (and frees)
    if (!r->buf) return RPC_LINE_NONE;
    char *nl = r->len > r->scanned ? memchr(r->buf + r->scanned, '\n', r->len - r->scanned) : NULL;
    char *begin = r->buf + r->start;
    if (!nl) {
        r->scanned = r->len;
        // Unterminated so far: report once it is certain the line cannot fit.
        if (content_len(begin, r->len - r->start) <= RPC_MAX_LINE) return RPC_LINE_NONE;
        r->start = r->len = r->scanned = 0;
        r->skipping = 1;
        return RPC_LINE_OVERSIZED;
    }
    size_t n = content_len(begin, (size_t)(nl - begin));
    r->start = r->scanned = (size_t)(nl - r->buf) + 1;
    if (n > RPC_MAX_LINE) return RPC_LINE_OVERSIZED;
    begin[n] = '\0';
    *line = begin;
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

size_t rpc_utf8_decode(const unsigned char *s, size_t len, uint32_t *cp) {
    int n = utf8_seq_len(s[0]);
    if (!n || (size_t)n > len) return 0;
    uint32_t c = n == 1 ? s[0] : s[0] & (0x7F >> n);
    for (int k = 1; k < n; k++) {
        if ((s[k] & 0xC0) != 0x80) return 0;
        c = c << 6 | (s[k] & 0x3F);
    }
    static const uint32_t min_cp[5] = {0, 0, 0x80, 0x800, 0x10000};
    if (c < min_cp[n] || c > 0x10FFFF || (c >= 0xD800 && c <= 0xDFFF)) return 0;
    *cp = c;
    return (size_t)n;
}

// Length of the well-formed sequence at s[0..len), 0 when s does not start with one.
static size_t utf8_seq(const unsigned char *s, size_t len) {
    uint32_t cp;
    return rpc_utf8_decode(s, len, &cp);
}

// Offset of the first byte that starts no well-formed sequence; len when there is none.
static size_t utf8_valid_prefix(const char *str, size_t len) {
    const unsigned char *s = (const unsigned char *)str;
    size_t i = 0, n;
    while (i < len && (n = utf8_seq(s + i, len - i)))
        i += n;
    return i;
}

int rpc_utf8_valid(const char *s, size_t len) {
    return utf8_valid_prefix(s, len) == len;
}

char *rpc_utf8_sanitize(char *text) {
    size_t len = strlen(text), good = utf8_valid_prefix(text, len);
    if (good == len) return text;
    // Each bad byte becomes the 3 bytes of U+FFFD.
    char *out = malloc(good + 3 * (len - good) + 1);
    if (!out) {
        free(text);
        return NULL;
    }
    memcpy(out, text, good);
    size_t o = good;
    const unsigned char *s = (const unsigned char *)text;
    for (size_t i = good, n; i < len; i += n ? n : 1) {
        n = utf8_seq(s + i, len - i);
        if (n) {
            memcpy(out + o, s + i, n);
            o += n;
        } else {
            memcpy(out + o, "\xEF\xBF\xBD", 3);
            o += 3;
        }
    }
    out[o] = '\0';
    free(text);
    return out;
}

// ---------------------------------------------------------------- requests

static int valid_id(const cJSON *id) {
    return cJSON_IsNumber(id) || cJSON_IsString(id) || cJSON_IsNull(id);
}

// An internal error is the daemon's (out of memory), any other the request's.
static int fail(int *code, int value, Err *err, const char *msg) {
    *code = value;
    return value == RPC_INTERNAL_ERROR ? err_resource(err, "%s", msg) : err_set(err, "%s", msg);
}

static int parse_json(RpcRequest *req, const char *line, size_t len, int *code, Err *err) {
    if (!rpc_utf8_valid(line, len)) {
        *code = RPC_PARSE_ERROR;
        return err_set(err, "invalid UTF-8 at byte %zu", utf8_valid_prefix(line, len));
    }
    const char *end = NULL;
    req->root = cJSON_ParseWithLengthOpts(line, len, &end, 0);
    if (!req->root && len && json_out_of_memory())
        return fail(code, RPC_INTERNAL_ERROR, err, "out of memory parsing the request");
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

// What one pass over a line cJSON accepted finds that cJSON lets through: a raw control
// character (below U+0020) inside a string, or outside strings one that is not JSON
// whitespace (cJSON skips every byte up to the space), both forbidden by RFC 8259; and a
// \u0000 escape, which cJSON decodes into a C string that ends there (a method
// "daemon.info\u0000x" would run daemon.info, a key "job\u0000x" would be "job"). Also
// the text of one top-level member's value, the id, so that a reply echoes it as sent.
typedef struct {
    long control_at, nul_at; // byte offsets, -1 when there is none
    const char *member;      // the value's text, NULL when not found
    size_t member_len;
} Lexed;

static int is_json_space(char c) {
    return c == ' ' || c == '\t' || c == '\r' || c == '\n';
}

// member: the index of the top-level member whose value text is wanted (-1: none).
static void lex(const char *s, size_t len, int member, Lexed *out) {
    *out = (Lexed){-1, -1, NULL, 0};
    int depth = 0, in_string = 0, members = -1; // members: top-level ':' seen, less one
    const char *begin = NULL;
    for (size_t i = 0; i < len; i++) {
        unsigned char c = (unsigned char)s[i];
        if (c < 0x20 && (in_string || !is_json_space((char)c)) && out->control_at < 0)
            out->control_at = (long)i;
        if (in_string) {
            if (c == '\\' && i + 5 < len && !memcmp(s + i + 1, "u0000", 5) && out->nul_at < 0)
                out->nul_at = (long)i;
            if (c == '\\')
                i++; // the escaped character (a 'u' is followed by hex digits only)
            else if (c == '"')
                in_string = 0;
            continue;
        }
        if (c == '"') {
            in_string = 1;
            continue;
        }
        if (depth == 1 && begin && !out->member && (c == ',' || c == '}')) {
            out->member = begin;
            out->member_len = (size_t)(s + i - begin);
        }
        if (c == '{' || c == '[')
            depth++;
        else if (c == '}' || c == ']')
            depth--;
        else if (c == ':' && depth == 1 && ++members == member)
            begin = s + i + 1;
    }
    while (out->member && out->member_len && is_json_space(out->member[0]))
        out->member++, out->member_len--;
    while (out->member && out->member_len && is_json_space(out->member[out->member_len - 1]))
        out->member_len--;
}

// What lex found that cJSON let through, as an error naming its byte offset: -1 (err set)
// when there is any, else 0.
static int lexed_error(const Lexed *lx, const char *s, Err *err) {
    if (lx->control_at >= 0)
        return err_set(err, "invalid JSON at byte %ld: raw control character 0x%02x",
                       lx->control_at, (unsigned char)s[lx->control_at]);
    if (lx->nul_at >= 0)
        return err_set(err, "\\u0000 at byte %ld: astraid takes no NUL characters in strings",
                       lx->nul_at);
    return 0;
}

int json_text_check(const char *text, size_t len, Err *err) {
    Lexed lx;
    lex(text, len, -1, &lx);
    return lexed_error(&lx, text, err);
}

// Position of item among the top-level members of root, -1 when absent.
static int member_index(const cJSON *root, const cJSON *item) {
    int i = 0;
    for (const cJSON *m = cJSON_IsObject(root) ? root->child : NULL; m; m = m->next, i++)
        if (m == item) return i;
    return -1;
}

// RFC 8259 §6: -? (0 | [1-9][0-9]*) (. [0-9]+)? ([eE] [+-]? [0-9]+)? (cJSON also takes
// "+1", "01", "1.", which a reply must not echo).
static int json_number_text(const char *s, size_t n) {
    size_t i = 0;
    if (i < n && s[i] == '-') i++;
    if (i < n && s[i] == '0')
        i++;
    else if (i < n && s[i] >= '1' && s[i] <= '9')
        while (i < n && s[i] >= '0' && s[i] <= '9')
            i++;
    else
        return 0;
    if (i < n && s[i] == '.') {
        size_t digits = ++i;
        while (i < n && s[i] >= '0' && s[i] <= '9')
            i++;
        if (i == digits) return 0;
    }
    if (i < n && (s[i] == 'e' || s[i] == 'E')) {
        i++;
        if (i < n && (s[i] == '+' || s[i] == '-')) i++;
        size_t digits = i;
        while (i < n && s[i] >= '0' && s[i] <= '9')
            i++;
        if (i == digits) return 0;
    }
    return i == n;
}

// A number id keeps its text (in valuestring, which cJSON leaves NULL for numbers), so
// that the reply echoes 12345678901234567890 or 1.50 as sent, not as a double prints.
// A number no double holds (1e999) is refused: no reply could carry it faithfully.
static int keep_id_text(cJSON *id, const Lexed *lx, int *code, Err *err) {
    int shown = lx->member_len > 64 ? 64 : (int)lx->member_len; // of the text, in messages
    const char *text = lx->member ? lx->member : "";
    if (!isfinite(id->valuedouble)) {
        *code = RPC_INVALID_REQUEST;
        return err_set(err, "id %.*s is not a finite number", shown, text);
    }
    if (!lx->member || !json_number_text(lx->member, lx->member_len)) {
        *code = RPC_PARSE_ERROR;
        return err_set(err, "invalid JSON: id %.*s is not a JSON number", shown, text);
    }
    id->valuestring = strndup(lx->member, lx->member_len);
    return id->valuestring ? 0 : fail(code, RPC_INTERNAL_ERROR, err, "out of memory");
}

static int check_envelope(RpcRequest *req, const Lexed *lx, int *code, Err *err) {
    cJSON *root = req->root;
    if (!cJSON_IsObject(root))
        return fail(code, RPC_INVALID_REQUEST, err, "request must be a JSON object");
    cJSON *id = cJSON_GetObjectItemCaseSensitive(root, "id");
    if (id && !valid_id(id))
        return fail(code, RPC_INVALID_REQUEST, err, "id must be a number, a string or null");
    if (cJSON_IsNumber(id) && keep_id_text(id, lx, code, err)) return -1;
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
    Lexed lx;
    lex(line, len, member_index(req->root, cJSON_GetObjectItemCaseSensitive(req->root, "id")), &lx);
    // Refused before the envelope is read: with NULs about, "id" may not be the id.
    if (lexed_error(&lx, line, err)) {
        *code = lx.control_at >= 0 ? RPC_PARSE_ERROR : RPC_INVALID_REQUEST;
        return -1;
    }
    if (check_envelope(req, &lx, code, err)) {
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
// Invalid UTF-8 in a string (a rank's output, a file name, a message cut short) becomes
// U+FFFD, so that every line astraid sends is valid UTF-8 JSON.
static char *finish_line(cJSON *msg) {
    char *text = msg ? cJSON_PrintUnformatted(msg) : NULL;
    cJSON_Delete(msg);
    if (text) text = rpc_utf8_sanitize(text);
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
        // A number id is echoed as its text (rpc_parse_request kept it in valuestring).
        cJSON *copy = !id                                     ? cJSON_CreateNull()
                      : cJSON_IsNumber(id) && id->valuestring ? cJSON_CreateRaw(id->valuestring)
                                                              : cJSON_Duplicate(id, 1);
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
