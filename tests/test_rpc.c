// test_rpc.c: proto/rpc.c: line reader, UTF-8 validation, envelope parsing, serialisation.
#include <cjson/cJSON.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "proto/rpc.h"

// Takes the next line and checks its kind and (for a line) its text.
static void expect_line(RpcReader *r, int kind, const char *text) {
    char *line = NULL;
    size_t len = 0;
    int got = rpc_reader_next(r, &line, &len);
    CHECK_MSG(got == kind, "kind %d, expected %d", got, kind);
    if (got == RPC_LINE_OK && text) {
        CHECK_MSG(len == strlen(text) && !strcmp(line, text), "line '%s', expected '%s'", line,
                  text);
    }
}

static void test_reader_lines(void) {
    RpcReader r;
    rpc_reader_init(&r);
    expect_line(&r, RPC_LINE_NONE, NULL);
    const char *data = "{\"a\":1}\r\n\nxyz\nparti";
    CHECK(rpc_reader_feed(&r, data, strlen(data)) == 0);
    expect_line(&r, RPC_LINE_OK, "{\"a\":1}"); // CRLF: \r dropped
    expect_line(&r, RPC_LINE_OK, "");
    expect_line(&r, RPC_LINE_OK, "xyz");
    expect_line(&r, RPC_LINE_NONE, NULL);
    CHECK(rpc_reader_feed(&r, "al\n", 3) == 0);
    expect_line(&r, RPC_LINE_OK, "partial");
    expect_line(&r, RPC_LINE_NONE, NULL);
    rpc_reader_free(&r);
}

// Byte by byte, with a next() after every byte as an event loop would do.
static void test_reader_byte_by_byte(void) {
    RpcReader r;
    rpc_reader_init(&r);
    const char *data = "one\r\ntwo\nthree\n";
    const char *want[] = {"one", "two", "three"};
    int seen = 0;
    for (size_t i = 0; data[i]; i++) {
        CHECK(rpc_reader_feed(&r, data + i, 1) == 0);
        char *line;
        size_t len;
        int got = rpc_reader_next(&r, &line, &len);
        if (got == RPC_LINE_OK) {
            CHECK(seen < 3 && !strcmp(line, want[seen]));
            seen++;
        } else
            CHECK(got == RPC_LINE_NONE);
    }
    CHECK(seen == 3);
    rpc_reader_free(&r);
}

// An oversized line fed in chunks is reported once, skipped to its newline, and the
// next line is intact; memory stays bounded by the limit.
static void test_reader_oversized_chunks(void) {
    RpcReader r;
    rpc_reader_init(&r);
    char *chunk = malloc(65536);
    memset(chunk, 'x', 65536);
    int reports = 0;
    for (int i = 0; i < 40; i++) { // 2.5 MiB without a newline
        CHECK(rpc_reader_feed(&r, chunk, 65536) == 0);
        char *line;
        size_t len;
        int got;
        while ((got = rpc_reader_next(&r, &line, &len)) != RPC_LINE_NONE)
            reports += got == RPC_LINE_OVERSIZED;
        CHECK(r.len <= RPC_MAX_LINE + 65536);
    }
    CHECK(reports == 1);
    CHECK(rpc_reader_feed(&r, "xx\nnext\n", 8) == 0);
    expect_line(&r, RPC_LINE_OK, "next");
    expect_line(&r, RPC_LINE_NONE, NULL);
    free(chunk);
    rpc_reader_free(&r);
}

// A complete oversized line in one feed, and the limit itself: exactly RPC_MAX_LINE
// bytes (plus \r\n) is accepted, one more is not.
static void test_reader_limit(void) {
    RpcReader r;
    rpc_reader_init(&r);
    size_t n = RPC_MAX_LINE + 3;
    char *big = malloc(n);
    memset(big, 'y', n);
    big[RPC_MAX_LINE] = '\r';
    big[RPC_MAX_LINE + 1] = '\n';
    CHECK(rpc_reader_feed(&r, big, RPC_MAX_LINE + 2) == 0);
    char *line;
    size_t len = 0;
    CHECK(rpc_reader_next(&r, &line, &len) == RPC_LINE_OK && len == RPC_MAX_LINE);
    big[RPC_MAX_LINE] = 'y';
    big[RPC_MAX_LINE + 1] = '\n';
    CHECK(rpc_reader_feed(&r, big, RPC_MAX_LINE + 2) == 0);
    CHECK(rpc_reader_feed(&r, "ok\n", 3) == 0);
    expect_line(&r, RPC_LINE_OVERSIZED, NULL);
    expect_line(&r, RPC_LINE_OK, "ok");
    // Unterminated: exactly the limit plus a '\r' is still possibly valid.
    big[RPC_MAX_LINE] = '\r';
    CHECK(rpc_reader_feed(&r, big, RPC_MAX_LINE + 1) == 0);
    expect_line(&r, RPC_LINE_NONE, NULL);
    CHECK(rpc_reader_feed(&r, "\n", 1) == 0);
    CHECK(rpc_reader_next(&r, &line, &len) == RPC_LINE_OK && len == RPC_MAX_LINE);
    free(big);
    rpc_reader_free(&r);
}

// A buffer grown by a long line is given back once the line is taken (hundreds of
// connections must not each keep megabytes).
static void test_reader_gives_back(void) {
    RpcReader r;
    rpc_reader_init(&r);
    size_t n = 512 * 1024;
    char *big = malloc(n + 1);
    memset(big, 'z', n);
    big[n] = '\n';
    CHECK(rpc_reader_feed(&r, big, n + 1) == 0);
    CHECK(r.cap > n);
    char *line;
    size_t len;
    CHECK(rpc_reader_next(&r, &line, &len) == RPC_LINE_OK && len == n);
    expect_line(&r, RPC_LINE_NONE, NULL);
    CHECK_MSG(r.cap <= RPC_READER_KEEP, "cap %zu after the line was taken", r.cap);
    CHECK(rpc_reader_feed(&r, "{}\n", 3) == 0);
    expect_line(&r, RPC_LINE_OK, "{}");
    free(big);
    rpc_reader_free(&r);
}

static void test_utf8(void) {
    struct {
        const char *s;
        int valid;
    } cases[] = {
        {"plain ascii", 1},
        {"caf\xC3\xA9", 1},
        {"\xE2\x82\xAC", 1},     // €
        {"\xF0\x9F\x98\x80", 1}, // U+1F600
        {"\xF4\x8F\xBF\xBF", 1}, // U+10FFFF
        {"\xED\x9F\xBF", 1},     // U+D7FF
        {"\xEE\x80\x80", 1},     // U+E000
        {"\xC0\xAF", 0},         // overlong '/'
        {"\xC1\xBF", 0},         // overlong
        {"\xE0\x80\xAF", 0},     // overlong 3-byte
        {"\xF0\x80\x80\xAF", 0}, // overlong 4-byte
        {"\xED\xA0\x80", 0},     // U+D800 surrogate
        {"\xED\xBF\xBF", 0},     // U+DFFF surrogate
        {"\xF4\x90\x80\x80", 0}, // U+110000
        {"\xF5\x80\x80\x80", 0}, // lead byte beyond range
        {"\x80", 0},             // stray continuation
        {"\xC3", 0},             // truncated
        {"\xE2\x82", 0},         // truncated
        {"\xC3\x28", 0},         // bad continuation
        {"\xFF", 0},
    };
    for (size_t i = 0; i < sizeof cases / sizeof cases[0]; i++)
        CHECK_MSG(rpc_utf8_valid(cases[i].s, strlen(cases[i].s)) == cases[i].valid, "case %zu", i);
    CHECK(rpc_utf8_valid("a\0b", 3) == 1); // NUL is valid UTF-8 (JSON rejects it)
}

// Parses text and checks the outcome: code 0 for success.
static void expect_parse(const char *text, int want_code, const char *want_msg) {
    RpcRequest req;
    Err err = {0};
    int code = 0;
    int rc = rpc_parse_request(&req, text, strlen(text), &code, &err);
    CHECK_MSG(want_code ? rc == -1 && code == want_code : rc == 0, "'%s': rc %d code %d (%s)", text,
              rc, code, err.msg);
    if (want_msg) CHECK_MSG(strstr(err.msg, want_msg) != NULL, "'%s': message '%s'", text, err.msg);
    rpc_request_free(&req);
}

static void test_parse_errors(void) {
    expect_parse("{\"jsonrpc\":\"2.0\",\"method\":", RPC_PARSE_ERROR, "invalid JSON");
    expect_parse("{} {}", RPC_PARSE_ERROR, "invalid JSON at byte 3");
    expect_parse("{\"jsonrpc\":\"2.0\",\"method\":\"x\xC0\xAF\"}", RPC_PARSE_ERROR,
                 "invalid UTF-8 at byte 28");
    expect_parse("[1,2]", RPC_INVALID_REQUEST, "JSON object");
    expect_parse("{\"method\":\"list\",\"id\":1}", RPC_INVALID_REQUEST, "jsonrpc");
    expect_parse("{\"jsonrpc\":2.0,\"method\":\"list\"}", RPC_INVALID_REQUEST, "jsonrpc");
    expect_parse("{\"jsonrpc\":\"1.0\",\"method\":\"list\"}", RPC_INVALID_REQUEST, "jsonrpc");
    expect_parse("{\"jsonrpc\":\"2.0\",\"id\":1}", RPC_INVALID_REQUEST, "method");
    expect_parse("{\"jsonrpc\":\"2.0\",\"method\":5}", RPC_INVALID_REQUEST, "method");
    expect_parse("{\"jsonrpc\":\"2.0\",\"method\":\"list\",\"id\":[1]}", RPC_INVALID_REQUEST, "id");
    expect_parse("{\"jsonrpc\":\"2.0\",\"method\":\"list\",\"id\":{}}", RPC_INVALID_REQUEST, "id");
    expect_parse("{\"jsonrpc\":\"2.0\",\"method\":\"list\",\"params\":[1]}", RPC_INVALID_PARAMS,
                 "params");
    expect_parse("{\"jsonrpc\":\"2.0\",\"method\":\"list\",\"params\":3}", RPC_INVALID_REQUEST,
                 "params");
    expect_parse("{\"jsonrpc\":\"2.0\",\"method\":\"list\"}\r\n ", 0, NULL); // trailing space ok
}

static void expect_text(char *got, const char *want) {
    CHECK_MSG(got && !strcmp(got, want), "got '%s', expected '%s'", got ? got : "(null)", want);
    free(got);
}

// What cJSON lets through and JSON or astraid does not.
static void test_parse_strict(void) {
    // Raw control characters: in a string, and between tokens (only space, tab, CR, LF
    // are whitespace).
    expect_parse("{\"jsonrpc\":\"2.0\",\"method\":\"li\x01st\"}", RPC_PARSE_ERROR, "byte 29");
    expect_parse("{\"jsonrpc\":\"2.0\",\"method\":\"list\",\"params\":{\"name\":\"a\tb\"}}",
                 RPC_PARSE_ERROR, "control character 0x09");
    expect_parse("{\"jsonrpc\":\"2.0\",\x0c\"method\":\"list\"}", RPC_PARSE_ERROR, "byte 17");
    expect_parse("{\"jsonrpc\":\"2.0\",\t\"method\":\"list\"}", 0, NULL);
    RpcRequest req;
    Err err;
    int code;
    const char nul_in_raw[] = "{\"jsonrpc\":\"2.0\",\"method\":\"list\0\"}";
    CHECK(rpc_parse_request(&req, nul_in_raw, sizeof nul_in_raw - 1, &code, &err) == -1 &&
          code == RPC_PARSE_ERROR);
    rpc_request_free(&req);
    // A NUL escape would cut the C string: the method must not become "daemon.info", the
    // key not "job". An escaped backslash before u0000 is no NUL.
    expect_parse("{\"jsonrpc\":\"2.0\",\"id\":1,\"method\":\"daemon.info\\u0000xyz\"}",
                 RPC_INVALID_REQUEST, "\\u0000");
    expect_parse("{\"jsonrpc\":\"2.0\",\"method\":\"status\",\"params\":{\"job\\u0000x\":1}}",
                 RPC_INVALID_REQUEST, "NUL");
    expect_parse("{\"jsonrpc\":\"2.0\",\"method\":\"list\",\"params\":{\"a\":\"\\\\u0000\"}}", 0,
                 NULL);
    // cJSON's looser numbers ("+1", "01") cannot be echoed as a JSON id.
    expect_parse("{\"jsonrpc\":\"2.0\",\"id\":01,\"method\":\"list\"}", RPC_PARSE_ERROR, "01");
    // An id no double holds: refused, and the reply's id is null.
    const char *inf = "{\"jsonrpc\":\"2.0\",\"id\":1e999,\"method\":\"daemon.info\"}";
    CHECK(rpc_parse_request(&req, inf, strlen(inf), &code, &err) == -1 &&
          code == RPC_INVALID_REQUEST && strstr(err.msg, "1e999"));
    expect_text(rpc_error(req.id, code, err.msg, NULL),
                "{\"jsonrpc\":\"2.0\",\"id\":null,\"error\":{\"code\":-32600,\"message\":\"id "
                "1e999 is not a finite number\"}}\n");
    rpc_request_free(&req);
}

// A number id is echoed as it was sent, digits a double would lose included.
static void test_id_echo(void) {
    const char *ids[] = {"7", "12345678901234567890123", "-0", "1.50", "2E+3", "0.1"};
    for (size_t i = 0; i < sizeof ids / sizeof *ids; i++) {
        char text[200], want[200];
        snprintf(text, sizeof text, "{\"id\" : %s , \"jsonrpc\":\"2.0\",\"method\":\"list\"}",
                 ids[i]);
        RpcRequest req;
        Err err;
        int code;
        CHECK_MSG(rpc_parse_request(&req, text, strlen(text), &code, &err) == 0, "%s: %s", text,
                  err.msg);
        snprintf(want, sizeof want, "{\"jsonrpc\":\"2.0\",\"id\":%s,\"result\":{}}\n", ids[i]);
        expect_text(rpc_result(req.id, cJSON_CreateObject()), want);
        snprintf(want, sizeof want,
                 "{\"jsonrpc\":\"2.0\",\"id\":%s,\"error\":{\"code\":-32601,\"message\":\"x\"}}\n",
                 ids[i]);
        expect_text(rpc_error(req.id, RPC_METHOD_NOT_FOUND, "x", NULL), want);
        rpc_request_free(&req);
    }
    // The id member is found among nested values and strings holding ':' and ','.
    const char *text = "{\"params\":{\"a\":[1,{\"id\":2}],\"b\":\"x:,}\"},\"jsonrpc\":\"2.0\","
                       "\"method\":\"list\",\"id\":99999999999999999999}";
    RpcRequest req;
    Err err;
    int code;
    CHECK(rpc_parse_request(&req, text, strlen(text), &code, &err) == 0);
    expect_text(rpc_result(req.id, NULL),
                "{\"jsonrpc\":\"2.0\",\"id\":99999999999999999999,\"result\":null}\n");
    rpc_request_free(&req);
}

// Every message is valid UTF-8: bad bytes from rank output or file names become U+FFFD.
static void test_sanitize(void) {
    char *s = strdup("ok caf\xC3\xA9");
    char *same = s;
    CHECK((s = rpc_utf8_sanitize(s)) == same); // valid: the string itself
    free(s);
    s = rpc_utf8_sanitize(strdup("a\xFF"
                                 "b\xC3(\xED\xA0\x80\xE2\x82"));
    CHECK_MSG(s && !strcmp(s, "a\xEF\xBF\xBD"
                              "b\xEF\xBF\xBD(\xEF\xBF\xBD\xEF\xBF\xBD\xEF\xBF\xBD"
                              "\xEF\xBF\xBD\xEF\xBF\xBD"),
              "got '%s'", s ? s : "(null)");
    CHECK(s && rpc_utf8_valid(s, strlen(s)));
    free(s);
    cJSON *p = cJSON_CreateObject();
    cJSON_AddStringToObject(p, "line", "file \xFF\xFE.bin: bad");
    char *line = rpc_push("log", p);
    CHECK(line && rpc_utf8_valid(line, strlen(line)));
    CHECK(line && strstr(line, "\"file \xEF\xBF\xBD\xEF\xBF\xBD.bin: bad\""));
    free(line);
    // A message cut inside a multi-byte character (a truncated error text).
    line = rpc_error(NULL, RPC_INTERNAL_ERROR, "caf\xC3", NULL);
    CHECK(line && rpc_utf8_valid(line, strlen(line)) && strstr(line, "caf\xEF\xBF\xBD\""));
    free(line);
}

static void test_parse_ok(void) {
    const char *text =
        "{\"jsonrpc\":\"2.0\",\"id\":7,\"method\":\"status\",\"params\":{\"job\":3}}";
    RpcRequest req;
    Err err;
    int code = 0;
    CHECK(rpc_parse_request(&req, text, strlen(text), &code, &err) == 0);
    CHECK(req.method && !strcmp(req.method, "status"));
    CHECK(cJSON_IsNumber(req.id) && req.id->valuedouble == 7);
    CHECK(cJSON_GetObjectItem(req.params, "job")->valuedouble == 3);
    rpc_request_free(&req);
    // Notification: no id; absent params become {}; string and null ids are kept.
    text = "{\"jsonrpc\":\"2.0\",\"method\":\"list\"}";
    CHECK(rpc_parse_request(&req, text, strlen(text), &code, &err) == 0);
    CHECK(req.id == NULL && cJSON_IsObject(req.params) && !req.params->child);
    rpc_request_free(&req);
    text = "{\"jsonrpc\":\"2.0\",\"method\":\"list\",\"id\":\"a\"}";
    CHECK(rpc_parse_request(&req, text, strlen(text), &code, &err) == 0);
    CHECK(cJSON_IsString(req.id) && !strcmp(req.id->valuestring, "a"));
    rpc_request_free(&req);
    text = "{\"jsonrpc\":\"2.0\",\"method\":\"list\",\"id\":null}";
    CHECK(rpc_parse_request(&req, text, strlen(text), &code, &err) == 0);
    CHECK(cJSON_IsNull(req.id));
    rpc_request_free(&req);
    // The id survives an envelope error, for the error reply.
    text = "{\"jsonrpc\":\"1.0\",\"method\":\"list\",\"id\":9}";
    CHECK(rpc_parse_request(&req, text, strlen(text), &code, &err) == -1);
    CHECK(cJSON_IsNumber(req.id) && req.id->valuedouble == 9);
    rpc_request_free(&req);
}

static void test_serialise(void) {
    cJSON *id = cJSON_CreateNumber(7);
    cJSON *result = cJSON_CreateObject();
    cJSON_AddStringToObject(result, "state", "queued\n\"x\"");
    expect_text(rpc_result(id, result),
                "{\"jsonrpc\":\"2.0\",\"id\":7,\"result\":{\"state\":\"queued\\n\\\"x\\\"\"}}\n");
    expect_text(rpc_result(NULL, NULL), "{\"jsonrpc\":\"2.0\",\"id\":null,\"result\":null}\n");
    cJSON *data = cJSON_CreateObject();
    cJSON_AddStringToObject(data, "state", "completed");
    expect_text(rpc_error(id, RPC_BAD_STATE, "job 2 is completed", data),
                "{\"jsonrpc\":\"2.0\",\"id\":7,\"error\":{\"code\":-32002,\"message\":\"job 2 is "
                "completed\",\"data\":{\"state\":\"completed\"}}}\n");
    expect_text(
        rpc_error(NULL, RPC_PARSE_ERROR, "bad", NULL),
        "{\"jsonrpc\":\"2.0\",\"id\":null,\"error\":{\"code\":-32700,\"message\":\"bad\"}}\n");
    cJSON *params = cJSON_CreateObject();
    cJSON_AddNumberToObject(params, "job", 3);
    expect_text(rpc_push("progress", params),
                "{\"jsonrpc\":\"2.0\",\"method\":\"progress\",\"params\":{\"job\":3}}\n");
    expect_text(rpc_request(12, "list", NULL),
                "{\"jsonrpc\":\"2.0\",\"id\":12,\"method\":\"list\",\"params\":{}}\n");
    // A serialised request parses back with the same fields, UTF-8 intact.
    params = cJSON_CreateObject();
    cJSON_AddStringToObject(params, "name", "caf\xC3\xA9");
    char *line = rpc_request(5, "submit", params);
    RpcRequest req;
    Err err;
    int code;
    CHECK(line && strchr(line, '\n') == line + strlen(line) - 1); // one line
    CHECK(rpc_parse_request(&req, line, strlen(line) - 1, &code, &err) == 0);
    CHECK(!strcmp(req.method, "submit") && req.id->valuedouble == 5);
    CHECK(!strcmp(cJSON_GetObjectItem(req.params, "name")->valuestring, "caf\xC3\xA9"));
    rpc_request_free(&req);
    free(line);
    cJSON_Delete(id);
}

int main(void) {
    test_reader_lines();
    test_reader_byte_by_byte();
    test_reader_oversized_chunks();
    test_reader_limit();
    test_reader_gives_back();
    test_utf8();
    test_parse_errors();
    test_parse_strict();
    test_id_echo();
    test_sanitize();
    test_parse_ok();
    test_serialise();
    CHECK_DONE();
}
