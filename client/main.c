// main.c: astraictl, the command-line client of astraid (docs/astraictl.md).
#include <errno.h>
#include <getopt.h>
#include <signal.h>
#include <stdlib.h>
#include <string.h>

#include "client/client.h"

static void usage(FILE *out) {
    fprintf(out,
            "usage: astraictl [global options] COMMAND [args]\n\n"
            "commands:\n"
            "  submit FILE.json [--wait|--follow]  validate and submit a job\n"
            "  list [--state S]                    jobs as a table\n"
            "  status [JOB]                        one job's details (no JOB: list)\n"
            "  pause JOB | resume JOB | checkpoint JOB | cancel JOB\n"
            "  rm JOB                              remove a finished job (its checkpoints stay)\n"
            "  logs JOB [--rank R] [--tail N] [-f] stderr of a rank (-f: follow)\n"
            "  watch [JOB]                         live progress (step, loss, tok/s, ETA)\n"
            "  daemon                              daemon.info\n\n"
            "global options:\n"
            "  --socket PATH       Unix socket (else $ASTRAID_SOCKET, else the default)\n"
            "  --host HOST:PORT    TCP instead, with --token-file F (bearer token)\n"
            "  --json              raw result JSON (one line per push for watch/logs -f)\n"
            "  --timeout S         seconds for connecting and for each reply (default 30)\n\n"
            "exit codes: 0 ok, 1 the daemon returned an error, 2 bad usage or invalid job file,\n"
            "            3 cannot connect (or no reply), 4 submit --wait: job failed/cancelled\n");
}

static int parse_long(const char *flag, const char *text, long min, long *out) {
    char *end;
    errno = 0;
    *out = strtol(text, &end, 10);
    if (errno || end == text || *end || *out < min) {
        fprintf(stderr, "astraictl: %s: '%s' is not an integer >= %ld\n", flag, text, min);
        return -1;
    }
    return 0;
}

static int parse_timeout(const char *text, double *out) {
    char *end;
    *out = strtod(text, &end);
    if (end == text || *end || !(*out > 0 && *out <= 1e6)) {
        fprintf(stderr, "astraictl: --timeout: '%s' is not a number of seconds in (0, 1e6]\n",
                text);
        return -1;
    }
    return 0;
}

enum { O_SOCKET = 256, O_HOST, O_TOKEN, O_JSON, O_TIMEOUT, O_WAIT, O_STATE, O_RANK, O_TAIL };

static const struct option LONG_OPTIONS[] = {
    {"socket", required_argument, 0, O_SOCKET},
    {"host", required_argument, 0, O_HOST},
    {"token-file", required_argument, 0, O_TOKEN},
    {"json", no_argument, 0, O_JSON},
    {"timeout", required_argument, 0, O_TIMEOUT},
    {"wait", no_argument, 0, O_WAIT},
    {"follow", no_argument, 0, 'f'},
    {"state", required_argument, 0, O_STATE},
    {"rank", required_argument, 0, O_RANK},
    {"tail", required_argument, 0, O_TAIL},
    {"help", no_argument, 0, 'h'},
    {0, 0, 0, 0},
};

// Returns -1 on bad usage, 1 for --help, 0 otherwise.
static int parse_options(int argc, char **argv, Options *o) {
    int opt;
    opterr = 0;
    while ((opt = getopt_long(argc, argv, "fh", LONG_OPTIONS, NULL)) != -1) {
        switch (opt) {
        case O_SOCKET:
            o->socket_path = optarg;
            break;
        case O_HOST:
            o->host = optarg;
            break;
        case O_TOKEN:
            o->token_file = optarg;
            break;
        case O_JSON:
            o->json = true;
            break;
        case O_TIMEOUT:
            if (parse_timeout(optarg, &o->timeout_s)) return -1;
            break;
        case O_WAIT:
            o->wait = true, o->given |= OPT_WAIT;
            break;
        case 'f':
            o->follow = true, o->given |= OPT_FOLLOW;
            break;
        case O_STATE:
            o->state = optarg, o->given |= OPT_STATE;
            break;
        case O_RANK:
            if (parse_long("--rank", optarg, 0, &o->rank)) return -1;
            o->given |= OPT_RANK;
            break;
        case O_TAIL:
            if (parse_long("--tail", optarg, 0, &o->tail)) return -1;
            o->given |= OPT_TAIL;
            break;
        case 'h':
            return 1;
        default:
            fprintf(stderr, "astraictl: unknown or incomplete option '%s'\n", argv[optind - 1]);
            return -1;
        }
    }
    if (o->host && o->socket_path) {
        fprintf(stderr, "astraictl: --socket and --host exclude each other\n");
        return -1;
    }
    return 0;
}

int main(int argc, char **argv) {
    signal(SIGPIPE, SIG_IGN);
    Options o = {.timeout_s = 30, .rank = -1, .tail = -1};
    int parsed = parse_options(argc, argv, &o);
    if (parsed > 0) {
        usage(stdout);
        return EXIT_OK;
    }
    if (parsed < 0 || optind >= argc) {
        if (parsed == 0) fprintf(stderr, "astraictl: missing command\n");
        usage(stderr);
        return EXIT_USAGE;
    }
    return run_command(argv[optind], argc - optind - 1, argv + optind + 1, &o);
}
