// job_log.c: a job's output lines (its ranks' stderr, docs/protocol.md "logs"). While a job
// can still run, its last JOB_LOG_LINES lines (all ranks) are kept in a ring, and pushed to
// the clients following them as they come; a final job's lines are read back from its
// run<N>-rank<R>.log files.
#include <fcntl.h>
#include <limits.h>
#include <stdlib.h>
#include <string.h>
#include <sys/stat.h>
#include <unistd.h>

#include <cjson/cJSON.h>

#include "daemon/daemon.h"

#define LOG_TAIL_BYTES (128 * 1024) // of output in a logs reply: far below the 1 MiB line limit

void job_add_log(Job *j, int rank, const char *text, size_t len) {
    char *line = strndup(text, len);
    if (!line) return;
    server_push_log(j, rank, line);
    // A final job (a cancel's last lines) has no ring: its lines are in its log files.
    if (!j->log && (job_is_final(j->state) || !(j->log = calloc(JOB_LOG_LINES, sizeof *j->log)))) {
        free(line);
        return;
    }
    int slot = (j->log_start + j->log_len) % JOB_LOG_LINES;
    if (j->log_len == JOB_LOG_LINES) {
        free(j->log[j->log_start].text);
        j->log_start = (j->log_start + 1) % JOB_LOG_LINES;
    } else {
        j->log_len++;
    }
    j->log[slot].rank = rank;
    j->log[slot].text = line;
}

void job_drop_log(Job *j) {
    for (int i = 0; j->log && i < j->log_len; i++)
        free(j->log[(j->log_start + i) % JOB_LOG_LINES].text);
    free(j->log);
    j->log = NULL;
    j->log_start = j->log_len = 0;
}

// The ring's last lines of rank (*left of them at most, within *budget bytes) in front
// of `lines`.
static void ring_tail(const Job *j, int rank, long *left, size_t *budget, cJSON *lines) {
    for (int k = j->log_len - 1; k >= 0 && *left > 0; k--) {
        const LogLine *l = &j->log[(j->log_start + k) % JOB_LOG_LINES];
        size_t n = strlen(l->text) + 1;
        if (l->rank != rank) continue;
        if (n > *budget) break;
        *budget -= n;
        --*left;
        cJSON_InsertItemInArray(lines, 0, cJSON_CreateString(l->text));
    }
}

// The same from the end of a log file. Empty lines are skipped (the ring never holds
// them); a line that began before the bytes the budget allowed is left out.
static void file_tail(const char *path, long *left, size_t *budget, cJSON *lines) {
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0) return;
    struct stat st;
    size_t size = fstat(fd, &st) ? 0 : (size_t)st.st_size, take = size < *budget ? size : *budget;
    char *buf = malloc(take + 1);
    ssize_t got = buf && take ? pread(fd, buf, take, (off_t)(size - take)) : 0;
    close(fd);
    size_t end = got > 0 ? (size_t)got : 0;
    *budget -= end;
    while (end > 0 && *left > 0) {
        size_t start = end;
        while (start > 0 && buf[start - 1] != '\n')
            start--;
        if (start == 0 && (size_t)got < size) break; // it began before what was read
        buf[end] = 0;
        if (start < end) {
            cJSON_InsertItemInArray(lines, 0, cJSON_CreateString(buf + start));
            --*left;
        }
        end = start ? start - 1 : 0;
    }
    free(buf);
}

cJSON *job_log_tail(const Job *j, int rank, long tail) {
    cJSON *lines = cJSON_CreateArray();
    size_t budget = LOG_TAIL_BYTES;
    if (j->log) {
        ring_tail(j, rank, &tail, &budget, lines);
        return lines;
    }
    char dir[PATH_MAX], path[PATH_MAX + 64];
    if (job_run_dir(j, dir, sizeof dir)) return lines;
    for (long run = j->runs; run >= 1 && tail > 0 && budget > 0; run--) {
        if (!job_log_path(dir, run, rank, path, sizeof path))
            file_tail(path, &tail, &budget, lines);
    }
    return lines;
}
