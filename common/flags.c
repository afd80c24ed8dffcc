// flags.c: command-line flags from a table (flags.h).
#include "common/flags.h"

#include <errno.h>
#include <stddef.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>

#define NAME_MAX_LEN 64

_Static_assert(offsetof(Flag, name) == 0, "flags_nearest reads the name first");

// Levenshtein distance, for "did you mean" suggestions (SIZE_MAX past 63 characters).
static size_t edit_distance(const char *a, const char *b) {
    size_t la = strlen(a), lb = strlen(b);
    if (la > 63 || lb > 63) return SIZE_MAX;
    size_t row[64];
    for (size_t j = 0; j <= lb; j++)
        row[j] = j;
    for (size_t i = 1; i <= la; i++) {
        size_t diag = row[0];
        row[0] = i;
        for (size_t j = 1; j <= lb; j++) {
            size_t up = row[j];
            size_t sub = diag + (a[i - 1] != b[j - 1]);
            size_t best = up + 1 < row[j - 1] + 1 ? up + 1 : row[j - 1] + 1;
            row[j] = sub < best ? sub : best;
            diag = up;
        }
    }
    return row[lb];
}

const char *flags_nearest(const char *name, const void *table, size_t n, size_t stride) {
    const char *best = NULL;
    size_t best_d = SIZE_MAX;
    for (size_t i = 0; i < n; i++) {
        const char *candidate;
        memcpy(&candidate, (const char *)table + i * stride, sizeof candidate);
        size_t d = edit_distance(name, candidate);
        if (d < best_d) best_d = d, best = candidate;
    }
    return best && best_d <= strlen(name) / 2 + 1 ? best : NULL;
}

// Names equal up to '-' vs '_'; `len` characters of a against all of b.
static bool same_name(const char *a, size_t len, const char *b) {
    size_t i = 0;
    for (; i < len && b[i]; i++)
        if (a[i] != b[i] && !((a[i] == '-' || a[i] == '_') && (b[i] == '-' || b[i] == '_')))
            return false;
    return i == len && !b[i];
}

static const Flag *find(const Flag *flags, size_t n, const char *name, size_t len) {
    for (size_t i = 0; i < n; i++)
        if (flags[i].kind != FLAG_UNKNOWN && same_name(name, len, flags[i].name)) return &flags[i];
    return NULL;
}

static int unknown(const Flag *flags, size_t n, const char *arg, size_t len, Err *err) {
    for (size_t i = 0; i < n; i++)
        if (flags[i].kind == FLAG_UNKNOWN) return flags[i].parse(&flags[i], arg, err);
    char name[NAME_MAX_LEN];
    snprintf(name, sizeof name, "%.*s", (int)(len < sizeof name ? len : sizeof name - 1), arg);
    const char *near = flags_nearest(name, flags, n, sizeof *flags);
    if (near) return err_set(err, "unknown flag '--%s' (did you mean '--%s'?)", name, near);
    return err_set(err, "unknown flag '--%s'", name);
}

static int set_value(const Flag *f, const char *value, Err *err) {
    if (f->kind == FLAG_STRING) {
        *(const char **)f->target = value;
        return 0;
    }
    return f->parse(f, value, err);
}

// argv[*i] is "--..." : parses it (and its value, advancing *i).
static int long_flag(const Flag *flags, size_t n, int argc, char **argv, int *i, Err *err) {
    const char *arg = argv[*i] + 2, *eq = strchr(arg, '=');
    size_t len = eq ? (size_t)(eq - arg) : strlen(arg);
    const Flag *f = find(flags, n, arg, len);
    bool negated = false;
    if (!f && !eq && len > 3 && same_name(arg, 3, "no-")) {
        f = find(flags, n, arg + 3, len - 3);
        negated = f && f->negatable && (f->kind == FLAG_SWITCH || f->value_optional);
        if (!negated) f = NULL;
    }
    if (!f) return unknown(flags, n, arg, len, err);
    if (f->kind == FLAG_SWITCH) {
        if (eq) return err_set(err, "--%s takes no value (got '%s')", f->name, eq + 1);
        *(bool *)f->target = !negated;
        return 0;
    }
    if (eq) return set_value(f, eq + 1, err);
    if (f->value_optional) return f->parse(f, negated ? "false" : "true", err);
    if (*i + 1 >= argc) return err_set(err, "--%s needs a value", f->name);
    return set_value(f, argv[++*i], err);
}

// argv[*i] is "-x": a short name.
static int short_flag(const Flag *flags, size_t n, int argc, char **argv, int *i, Err *err) {
    const char *arg = argv[*i];
    for (size_t k = 0; k < n && !arg[2]; k++) {
        const Flag *f = &flags[k];
        if (f->short_name != arg[1]) continue;
        if (f->kind == FLAG_SWITCH) {
            *(bool *)f->target = true;
            return 0;
        }
        if (f->value_optional) return f->parse(f, "true", err);
        if (*i + 1 >= argc) return err_set(err, "%s needs a value", arg);
        return set_value(f, argv[++*i], err);
    }
    return err_set(err, "unknown flag '%s'", arg);
}

int flags_parse(const Flag *flags, size_t n, int argc, char **argv, int *n_args, Err *err) {
    int kept = 0, rc = 0;
    bool only_args = false;
    for (int i = 0; i < argc && !rc; i++) {
        const char *a = argv[i];
        if (!only_args && !strcmp(a, "--"))
            only_args = true;
        else if (!only_args && a[0] == '-' && a[1] == '-')
            rc = long_flag(flags, n, argc, argv, &i, err);
        else if (!only_args && a[0] == '-' && a[1])
            rc = short_flag(flags, n, argc, argv, &i, err);
        else if (!n_args)
            rc = err_set(err, "unexpected argument '%s'", a);
        else
            argv[kept++] = argv[i];
    }
    if (n_args && kept < argc) argv[kept] = NULL; // the arguments end like argv does
    if (n_args) *n_args = kept;
    return rc;
}

bool flags_want_help(int argc, char **argv) {
    for (int i = 0; i < argc && strcmp(argv[i], "--"); i++)
        if (!strcmp(argv[i], "-h") || !strcmp(argv[i], "--help")) return true;
    return false;
}

void flags_usage(FILE *out, const Flag *flags, size_t n) {
    for (size_t i = 0; i < n; i++) {
        const Flag *f = &flags[i];
        if (!f->help) continue;
        char left[NAME_MAX_LEN * 2];
        const char *value = f->kind == FLAG_SWITCH ? "" : f->value_name ? f->value_name : "VALUE";
        // " VALUE", or "[=VALUE]" when the value is optional
        const char *before = !*value ? "" : f->value_optional ? "[=" : " ";
        const char *after = *value && f->value_optional ? "]" : "";
        if (f->short_name)
            snprintf(left, sizeof left, "-%c, --%s%s%s%s", f->short_name, f->name, before, value,
                     after);
        else
            snprintf(left, sizeof left, "--%s%s%s%s", f->name, before, value, after);
        fprintf(out, "  %-22s %s\n", left, f->help);
    }
}

int flags_parse_u64(const Flag *f, const char *value, Err *err) {
    char *end;
    errno = 0;
    unsigned long long v = strtoull(value, &end, 10);
    if (*value == '\0' || *value == '-' || *end != '\0' || errno)
        return err_set(err, "--%s '%s' is not a non-negative integer", f->name, value);
    *(uint64_t *)f->target = v;
    return 0;
}
