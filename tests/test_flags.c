// The flag parser every binary uses (common/flags.h): the forms of a flag, arguments kept
// in order, errors naming the flag and its nearest valid name, the usage from the table;
// and the growable buffer (common/buf.h).
#include <stdbool.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#include "check.h"
#include "common/buf.h"
#include "common/flags.h"

typedef struct {
    const char *out;
    bool force, json;
    long count;
} Opts;

static int parse_count(const Flag *f, const char *value, Err *err) {
    char *end;
    long v = strtol(value, &end, 10);
    if (end == value || *end || v < 0) return err_set(err, "--%s: '%s' is bad", f->name, value);
    *(long *)f->target = v;
    return 0;
}

#define N_FLAGS 4
static void table(Opts *o, Flag f[N_FLAGS]) {
    const Flag t[N_FLAGS] = {
        {.name = "out",
         .kind = FLAG_STRING,
         .target = &o->out,
         .value_name = "DIR",
         .help = "where to write"},
        {.name = "force",
         .kind = FLAG_SWITCH,
         .target = &o->force,
         .short_name = 'f',
         .negatable = true,
         .help = "replace"},
        {.name = "json", .kind = FLAG_SWITCH, .target = &o->json},
        {.name = "max_count",
         .kind = FLAG_PARSED,
         .target = &o->count,
         .parse = parse_count,
         .help = "how many"},
    };
    memcpy(f, t, sizeof t);
}

// Parses a NULL-terminated list; returns flags_parse's result, args in argv order.
static int parse(Opts *o, const char **list, int *n_args, char ***args, Err *err) {
    static char *argv[16];
    int argc = 0;
    for (; list[argc]; argc++)
        argv[argc] = (char *)list[argc];
    argv[argc] = NULL;
    Flag f[N_FLAGS];
    *o = (Opts){.count = -1};
    table(o, f);
    *args = argv;
    return flags_parse(f, N_FLAGS, argc, argv, n_args, err);
}

static void test_forms(void) {
    Opts o;
    Err err = {0};
    int n = 0;
    char **args;
    const char *a1[] = {"x", "--out", "d1", "--max_count=3", "-f", "y", "--json", NULL};
    CHECK(parse(&o, a1, &n, &args, &err) == 0);
    CHECK(o.out && !strcmp(o.out, "d1") && o.count == 3 && o.force && o.json);
    CHECK(n == 2 && !strcmp(args[0], "x") && !strcmp(args[1], "y") && !args[2]);

    const char *a2[] = {"--out=a=b", "--max-count", "7", "--force", "--no-force", NULL};
    CHECK(parse(&o, a2, &n, &args, &err) == 0);
    CHECK(!strcmp(o.out, "a=b") && o.count == 7 && !o.force && n == 0); // '-' is '_'

    const char *a3[] = {"--json", "--", "--out", "-", NULL}; // after "--": arguments
    CHECK(parse(&o, a3, &n, &args, &err) == 0);
    CHECK(o.json && !o.out && n == 2 && !strcmp(args[0], "--out") && !strcmp(args[1], "-"));
}

static void expect_error(const char **list, int with_args, const char *want) {
    Opts o;
    Err err = {0};
    int n;
    char **args;
    int rc = parse(&o, list, with_args ? &n : NULL, &args, &err);
    CHECK_MSG(rc == -1 && strstr(err.msg, want), "rc %d, '%s' (want '%s')", rc, err.msg, want);
}

// Without arguments allowed, argv stays as it was (a second pass reads it again).
static void test_argv_untouched(void) {
    Opts o = {0};
    Flag f[N_FLAGS];
    table(&o, f);
    char *argv[] = {"--json", "--out", "d", NULL};
    Err err = {0};
    CHECK(flags_parse(f, N_FLAGS, 3, argv, NULL, &err) == 0);
    CHECK(flags_parse(f, N_FLAGS, 3, argv, NULL, &err) == 0);
    CHECK(!strcmp(argv[0], "--json") && !strcmp(argv[1], "--out") && !strcmp(argv[2], "d"));
}

static void test_errors(void) {
    const char *unknown[] = {"--jsno", NULL};
    expect_error(unknown, 1, "unknown flag '--jsno' (did you mean '--json'?)");
    const char *far[] = {"--zzzzzzzzzz", NULL};
    expect_error(far, 1, "unknown flag '--zzzzzzzzzz'");
    const char *missing[] = {"--out", NULL};
    expect_error(missing, 1, "--out needs a value");
    const char *bad[] = {"--max_count=x", NULL};
    expect_error(bad, 1, "--max_count: 'x' is bad");
    const char *valued[] = {"--json=1", NULL};
    expect_error(valued, 1, "--json takes no value");
    const char *not_neg[] = {"--no-json", NULL}; // json is not negatable
    expect_error(not_neg, 1, "unknown flag '--no-json'");
    const char *short_unknown[] = {"-q", NULL};
    expect_error(short_unknown, 1, "unknown flag '-q'");
    const char *positional[] = {"stray", NULL};
    expect_error(positional, 0, "unexpected argument 'stray'");
    CHECK(flags_nearest("max_cont", (Flag[]){{.name = "max_count"}, {.name = "out"}}, 2,
                        sizeof(Flag)) != NULL);
}

static void test_help_and_usage(void) {
    char *h[] = {"a", "-h"}, *after[] = {"--", "--help"}, *none[] = {"--json"};
    CHECK(flags_want_help(2, h) && !flags_want_help(2, after) && !flags_want_help(1, none));
    Opts o;
    Flag f[N_FLAGS];
    table(&o, f);
    char text[1024] = {0};
    FILE *mem = fmemopen(text, sizeof text - 1, "w");
    flags_usage(mem, f, N_FLAGS);
    fclose(mem);
    CHECK_MSG(strstr(text, "--out DIR") && strstr(text, "where to write") &&
                  strstr(text, "-f, --force") && strstr(text, "--max_count VALUE") &&
                  !strstr(text, "--json"), // no help: not listed
              "%s", text);
}

// A FLAG_PARSED with value_optional: "--name" alone is "true", "--no-name" "false", a value
// only with '='; and a FLAG_UNKNOWN entry that takes every other long flag.
static int record(const Flag *f, const char *value, Err *err) {
    (void)err;
    snprintf(f->target, 64, "%s", value);
    return 0;
}

static int refuse(const Flag *f, const char *arg, Err *err) {
    (void)f;
    return err_set(err, "no key '%s'", arg);
}

static void test_optional_value_and_unknown(void) {
    char strict[64];
    Flag f[] = {{.name = "strict",
                 .kind = FLAG_PARSED,
                 .target = strict,
                 .parse = record,
                 .short_name = 's',
                 .negatable = true,
                 .value_optional = true,
                 .help = "be strict"},
                {.name = "other", .kind = FLAG_UNKNOWN, .parse = refuse}};
    const char *cases[][2] = {{"--strict", "true"},
                              {"--no-strict", "false"},
                              {"--strict=off", "off"},
                              {"-s", "true"},
                              {"--strict=", ""}};
    for (size_t i = 0; i < sizeof cases / sizeof *cases; i++) {
        char *argv[] = {(char *)cases[i][0], "x", NULL};
        int n;
        Err err = {0};
        strict[0] = '?';
        CHECK_MSG(flags_parse(f, 2, 2, argv, &n, &err) == 0 && !strcmp(strict, cases[i][1]) &&
                      n == 1 && !strcmp(argv[0], "x"), // the next argument is not its value
                  "%s: '%s' %s", cases[i][0], strict, err.msg);
    }
    const char *unknown[][2] = {{"--stric=1", "no key 'stric=1'"},
                                {"--no-other", "no key 'no-other'"},
                                {"--other", "no key 'other'"}}; // no name of its own
    for (size_t i = 0; i < sizeof unknown / sizeof *unknown; i++) {
        char *argv[] = {(char *)unknown[i][0], NULL};
        Err err = {0};
        CHECK_MSG(flags_parse(f, 2, 1, argv, NULL, &err) == -1 && !strcmp(err.msg, unknown[i][1]),
                  "%s: '%s'", unknown[i][0], err.msg);
    }
    char text[256] = {0};
    FILE *mem = fmemopen(text, sizeof text - 1, "w");
    flags_usage(mem, f, 2);
    fclose(mem);
    CHECK_MSG(strstr(text, "-s, --strict[=VALUE]") && !strstr(text, "other"), "%s", text);
}

static void test_buf(void) {
    Buf b = {0};
    char expect[5000];
    for (int i = 0; i < 5000; i++) {
        expect[i] = (char)('a' + i % 26);
        CHECK(buf_append(&b, &expect[i], 1) == 0);
    }
    CHECK(b.len == 5000 && b.cap > 5000 && !memcmp(b.data, expect, 5000) && b.data[5000] == 0);
    size_t cap = b.cap;
    CHECK(buf_append(&b, "", 0) == 0 && b.cap == cap && b.len == 5000);
    char *taken = buf_take(&b);
    CHECK(taken && !b.data && !b.len && !b.cap);
    free(taken);

    int *arr = NULL;
    size_t arr_cap = 0, grows = 0;
    for (size_t i = 0; i < 10000; i++) {
        size_t before = arr_cap;
        CHECK(buf_reserve(&arr, &arr_cap, i + 1, sizeof *arr) == 0);
        grows += arr_cap != before;
        arr[i] = (int)i;
    }
    CHECK(arr_cap >= 10000 && grows <= 12); // doubling: O(log n) reallocations
    long sum = 0;
    for (size_t i = 0; i < 10000; i++)
        sum += arr[i];
    CHECK(sum == 10000L * 9999 / 2);
    size_t before = arr_cap;
    CHECK(buf_reserve(&arr, &arr_cap, SIZE_MAX / 2, sizeof *arr) == -1 && arr_cap == before);
    free(arr);
    buf_free(&b);
}

int main(void) {
    test_forms();
    test_errors();
    test_argv_untouched();
    test_help_and_usage();
    test_optional_value_and_unknown();
    test_buf();
    CHECK_DONE();
}
