// main.c: astraictl, the command-line client of astraid (docs/astraictl.md).
#include <errno.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>

#include "client/client.h"
#include "common/flags.h"
#include "common/json.h"

static int parse_count(const Flag *f, const char *text, Err *err) {
    char *end;
    errno = 0;
    long v = strtol(text, &end, 10);
    if (errno || end == text || *end || v < 0)
        return err_set(err, "--%s: '%s' is not an integer >= 0", f->name, text);
    *(long *)f->target = v;
    return 0;
}

static int parse_timeout(const Flag *f, const char *text, Err *err) {
    char *end;
    double v = strtod(text, &end);
    if (end == text || *end || !(v > 0 && v <= 1e6))
        return err_set(err, "--%s: '%s' is not a number of seconds in (0, 1e6]", f->name, text);
    *(double *)f->target = v;
    return 0;
}

// The flags of astraictl, global and of the commands alike (they may stand anywhere).
#define N_FLAGS 18
static void flag_table(Options *o, bool *help, Flag flags[N_FLAGS]) {
    const Flag table[N_FLAGS] = {
        {.name = "socket",
         .kind = FLAG_STRING,
         .target = &o->socket_path,
         .value_name = "PATH",
         .help = "Unix socket (else $ASTRAID_SOCKET, else the default)"},
        {.name = "host",
         .kind = FLAG_STRING,
         .target = &o->host,
         .value_name = "HOST:PORT",
         .help = "TCP instead, with --token-file F (bearer token)"},
        {.name = "token-file", .kind = FLAG_STRING, .target = &o->token_file, .value_name = "F"},
        {.name = "json",
         .kind = FLAG_SWITCH,
         .target = &o->json,
         .help = "raw result JSON (one line per push for watch/logs -f)"},
        {.name = "timeout",
         .kind = FLAG_PARSED,
         .target = &o->timeout_s,
         .parse = parse_timeout,
         .value_name = "S",
         .help = "seconds for connecting and for each reply (default 30)"},
        {.name = "reconnect-timeout",
         .kind = FLAG_PARSED,
         .target = &o->reconnect_s,
         .parse = parse_count,
         .value_name = "S",
         .help = "seconds watch, logs -f, plot --follow and --wait retry a lost connection "
                 "(default: no limit; 0: none)"},
        {.name = "wait", .kind = FLAG_SWITCH, .target = &o->wait},
        {.name = "follow", .kind = FLAG_SWITCH, .target = &o->follow, .short_name = 'f'},
        {.name = "state", .kind = FLAG_STRING, .target = &o->state},
        {.name = "rank", .kind = FLAG_PARSED, .target = &o->rank, .parse = parse_count},
        {.name = "tail", .kind = FLAG_PARSED, .target = &o->tail, .parse = parse_count},
        {.name = "metric", .kind = FLAG_STRING, .target = &o->metric},
        {.name = "svg", .kind = FLAG_STRING, .target = &o->svg},
        {.name = "width", .kind = FLAG_PARSED, .target = &o->width, .parse = parse_count},
        {.name = "height", .kind = FLAG_PARSED, .target = &o->height, .parse = parse_count},
        {.name = "step", .kind = FLAG_PARSED, .target = &o->step, .parse = parse_count},
        {.name = "all", .kind = FLAG_SWITCH, .target = &o->all},
        {.name = "help", .kind = FLAG_SWITCH, .target = help, .short_name = 'h'},
    };
    memcpy(flags, table, sizeof table);
}

static void usage(FILE *out, const Flag *flags) {
    fprintf(out, "usage: astraictl [global options] COMMAND [args]\n\n"
                 "commands:\n");
    commands_usage(out);
    fprintf(out, "\nglobal options:\n");
    flags_usage(out, flags, N_FLAGS);
    fprintf(out, "\nexit codes: 0 ok, 1 the daemon returned an error, 2 bad usage or invalid job "
                 "file,\n"
                 "            3 cannot connect (or no reply), 4 submit --wait: job "
                 "failed/cancelled\n");
}

// The command options given (their OPT_* bits): set ones differ from their defaults.
static unsigned given_options(const Options *o) {
    return (o->wait ? OPT_WAIT : 0) | (o->follow ? OPT_FOLLOW : 0) | (o->state ? OPT_STATE : 0) |
           (o->rank >= 0 ? OPT_RANK : 0) | (o->tail >= 0 ? OPT_TAIL : 0) |
           (o->metric ? OPT_METRIC : 0) | (o->svg ? OPT_SVG : 0) | (o->width >= 0 ? OPT_WIDTH : 0) |
           (o->height >= 0 ? OPT_HEIGHT : 0) | (o->step >= 0 ? OPT_STEP : 0) |
           (o->all ? OPT_ALL : 0);
}

int main(int argc, char **argv) {
    json_init();
    signal(SIGPIPE, SIG_IGN);
    Options o = {.timeout_s = 30,
                 .reconnect_s = -1,
                 .rank = -1,
                 .tail = -1,
                 .width = -1,
                 .height = -1,
                 .step = -1};
    bool help = false;
    Flag flags[N_FLAGS];
    flag_table(&o, &help, flags);
    Err err = {0};
    int n_args = 0;
    if (flags_parse(flags, N_FLAGS, argc - 1, argv + 1, &n_args, &err)) {
        fprintf(stderr, "astraictl: %s\n", err.msg);
        usage(stderr, flags);
        return EXIT_USAGE;
    }
    if (help) {
        usage(stdout, flags);
        return EXIT_OK;
    }
    o.given = given_options(&o);
    if (o.host && o.socket_path) {
        fprintf(stderr, "astraictl: --socket and --host exclude each other\n");
        usage(stderr, flags);
        return EXIT_USAGE;
    }
    if (n_args == 0) {
        fprintf(stderr, "astraictl: missing command\n");
        usage(stderr, flags);
        return EXIT_USAGE;
    }
    return run_command(argv[1], n_args - 1, argv + 2, &o);
}
