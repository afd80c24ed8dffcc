// rpc.h: the wire protocol of astraid (docs/design.md §3): newline-delimited JSON-RPC 2.0
// over a Unix stream socket (and optionally TCP).
//
//   request:  {"jsonrpc":"2.0","id":7,"method":"submit","params":{...}}\n
//   reply:    {"jsonrpc":"2.0","id":7,"result":{...}}\n
//             {"jsonrpc":"2.0","id":7,"error":{"code":-32602,"message":"...","data":{...}}}\n
//   push:     {"jsonrpc":"2.0","method":"progress","params":JOB}\n   (no id)
#pragma once
#include <stddef.h>
#include <stdint.h>

#include "common/error.h"

typedef struct cJSON cJSON;

#define RPC_MAX_LINE (1u << 20) // 1 MiB: longer lines are answered with an error

// Standard JSON-RPC codes.
#define RPC_PARSE_ERROR -32700
#define RPC_INVALID_REQUEST -32600
#define RPC_METHOD_NOT_FOUND -32601
#define RPC_INVALID_PARAMS -32602
#define RPC_INTERNAL_ERROR -32603
// astraid's own codes (-32000 ... -32099).
#define RPC_NO_SUCH_JOB -32001
#define RPC_BAD_STATE -32002 // the verb does not apply to the job's state
#define RPC_UNAUTHORIZED -32003
#define RPC_BUSY -32004 // too many connections / requests
#define RPC_LINE_TOO_LONG -32005
#define RPC_FORBIDDEN -32006 // a verb on another user's job (docs/protocol.md "Who may act")

// Line splitter for a byte stream: feed bytes as they arrive, take complete lines.
// A line longer than RPC_MAX_LINE is reported once (rpc_reader_next returns
// RPC_LINE_OVERSIZED) and its remaining bytes are skipped up to the next newline.
typedef struct {
    char *buf;
    size_t len, cap;
    int skipping;   // inside an oversized line
    size_t start;   // first byte of buf not yet returned as a line
    size_t scanned; // buf[start..scanned) holds no newline
} RpcReader;

enum { RPC_LINE_NONE = 0, RPC_LINE_OK = 1, RPC_LINE_OVERSIZED = 2 };

#define RPC_READER_KEEP (64u << 10) // a larger buffer is freed once it holds nothing

void rpc_reader_init(RpcReader *r);
void rpc_reader_free(RpcReader *r);
// Appends bytes; -1 when out of memory.
int rpc_reader_feed(RpcReader *r, const char *data, size_t len);
// Bytes fed and not yet returned as lines (complete lines waiting, and a partial one).
size_t rpc_reader_pending(const RpcReader *r);
// Takes the next complete line (without the newline, NUL-terminated, valid until the
// next call) into *line. Returns RPC_LINE_NONE when no complete line is buffered.
int rpc_reader_next(RpcReader *r, char **line, size_t *len);

// A parsed request. id is NULL for a notification; params is an object (an empty one
// when absent). The request owns the JSON tree.
typedef struct {
    cJSON *root;
    const cJSON *id;
    const char *method;
    const cJSON *params;
} RpcRequest;

// Parses one line. On failure returns -1 with *code (RPC_PARSE_ERROR for bad JSON or
// bad UTF-8, RPC_INVALID_REQUEST for a wrong envelope) and a message in err; req->id
// is kept when it could be read, so the error reply can carry it. Params that are an
// array get RPC_INVALID_PARAMS (every method takes named params). Call
// rpc_request_free after success and failure alike.
// Stricter than cJSON where JSON is: a raw control character (U+0000..U+001F) in a
// string, or one other than whitespace between tokens, is RPC_PARSE_ERROR. A string
// holding U+0000 (\u0000) is RPC_INVALID_REQUEST: C strings would end there, so that
// "daemon.info\u0000x" would name daemon.info. An id that is a number keeps its text
// as sent in req->id->valuestring (the reply echoes that text); a number no double
// holds (1e999) is RPC_INVALID_REQUEST.
int rpc_parse_request(RpcRequest *req, const char *line, size_t len, int *code, Err *err);
void rpc_request_free(RpcRequest *req);

// The same check for any JSON text cJSON accepted (a config file): -1 with err naming the
// byte offset of a raw control character or of a \u0000 escape in a string, else 0.
int json_text_check(const char *text, size_t len, Err *err);

// Serialised messages, newline-terminated, malloc'd, valid UTF-8 (rpc_utf8_sanitize).
// `id` may be NULL (JSON null); a number id with a valuestring is written as that text.
// rpc_result takes ownership of result; rpc_error of data (may be NULL).
char *rpc_result(const cJSON *id, cJSON *result);
char *rpc_error(const cJSON *id, int code, const char *message, cJSON *data);
char *rpc_push(const char *method, cJSON *params);
// A client request line; takes ownership of params (may be NULL).
char *rpc_request(long id, const char *method, cJSON *params);

// The code point of the well-formed UTF-8 sequence at s[0..len) in *cp, and its length; 0
// when s does not start with one (a bad lead or continuation byte, a sequence cut by len,
// an overlong form, a surrogate, above U+10FFFF).
size_t rpc_utf8_decode(const unsigned char *s, size_t len, uint32_t *cp);
// 1 if s[0..len) is valid UTF-8.
int rpc_utf8_valid(const char *s, size_t len);
// text (malloc'd, NUL-terminated) with every byte that starts no well-formed UTF-8
// sequence replaced by U+FFFD: text itself when it is valid, else a new string (text is
// freed); NULL when out of memory. Every line astraid sends passes through it.
char *rpc_utf8_sanitize(char *text);
