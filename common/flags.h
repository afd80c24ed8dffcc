// flags.h: the one command-line flag parser of every binary. Each binary describes its
// flags in a table; this module parses argv against it and prints the usage from it.
//
// Forms: "--name VALUE" and "--name=VALUE" for a flag that takes a value, "--name" for a
// switch (and "--no-name" when it is negatable), "-c" for a flag with a short name. '-' and
// '_' are the same in names ("--max_restarts" is "--max-restarts"). "--" ends the flags;
// "-" alone is an argument. An unknown flag is an error naming it and the nearest valid one,
// unless the table has a FLAG_UNKNOWN entry, which takes it.
#pragma once
#include <stdbool.h>
#include <stddef.h>
#include <stdio.h>

#include "common/error.h"

typedef enum {
    FLAG_STRING,  // takes a value: *(const char **)target = the argv string
    FLAG_SWITCH,  // takes no value: *(bool *)target = true ("--no-name": false, if negatable)
    FLAG_PARSED,  // takes a value, handed to parse()
    FLAG_UNKNOWN, // no name of its own: parse() gets every long flag that no other entry
                  // names, as "name" or "name=value" (without "--"), to accept or refuse
} FlagKind;

typedef struct Flag Flag;
struct Flag {
    const char *name; // "out": --out
    FlagKind kind;
    void *target;
    // FLAG_PARSED: stores value into f->target (f->data: what else it needs); err names f.
    int (*parse)(const Flag *f, const char *value, Err *err);
    const void *data;
    const char *help;       // the usage line; NULL: not listed
    const char *value_name; // "PATH" in "--socket PATH" (default "VALUE")
    char short_name;        // 'f': -f; 0: none
    bool negatable;         // FLAG_SWITCH, value_optional: --no-name sets false
    // FLAG_PARSED: "--name" alone hands parse() "true" (and "--no-name", when negatable,
    // "false") instead of taking the next argument; a value comes as "--name=VALUE" only.
    bool value_optional;
};

// Parses argv[0..argc) (no program name) against flags[0..n). The arguments that are not
// flags are moved, in order, to the front of argv and counted in *n_args, and a NULL follows
// them (argv[argc] is NULL already when nothing moved); with n_args NULL an argument is an
// error. On error, err names the flag or argument at fault.
int flags_parse(const Flag *flags, size_t n, int argc, char **argv, int *n_args, Err *err);

// A FLAG_PARSED parser: a non-negative decimal integer (a seed) into *(uint64_t *)f->target; else
// an error naming the flag and the value.
int flags_parse_u64(const Flag *f, const char *value, Err *err);

// Whether argv[0..argc) asks for help (-h, --help) before any "--".
bool flags_want_help(int argc, char **argv);

// One line per listed flag: "  --name VALUE   help" (value_name, aligned).
void flags_usage(FILE *out, const Flag *flags, size_t n);

// The name nearest to `name` (edit distance) in a table of n entries of `stride` bytes
// whose first member is their name (a const char *): a Flag, another binary's key table.
// NULL when none is near enough to be a likely typo.
const char *flags_nearest(const char *name, const void *table, size_t n, size_t stride);
