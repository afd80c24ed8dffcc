// env.c: the environment of a rank of a local launch (ranks.h).
#include <stdarg.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <unistd.h>

#include "ranks/ranks.h"

extern char **environ;

// Variables the supervisor sets for its ranks; inherited values of these are dropped.
static const char *const RANK_ENV[] = {"RANK",
                                       "WORLD_SIZE",
                                       "LOCAL_RANK",
                                       "LOCAL_WORLD_SIZE",
                                       "MASTER_ADDR",
                                       "MASTER_PORT",
                                       "ASTRAI_LAUNCHED",
                                       "ASTRAI_SHM_NAME",
                                       "ASTRAI_LAUNCHER_PID",
                                       "ASTRAI_RENDEZVOUS_FD",
                                       "ASTRAI_RENDEZVOUS_PORT",
                                       "TORCHELASTIC_USE_AGENT_STORE",
                                       NULL};
#define RANK_ENV_SET 10 // the first ten are set (the fd only for rank 0)

static int is_rank_env(const char *entry) {
    for (const char *const *v = RANK_ENV; *v; v++) {
        size_t n = strlen(*v);
        if (!strncmp(entry, *v, n) && entry[n] == '=') return 1;
    }
    return 0;
}

void ranks_free_env(char **env) {
    if (!env) return;
    for (char **e = env; *e; e++)
        free(*e);
    free(env);
}

// Appends one formatted entry; on failure the slot stays NULL (the end for ranks_free_env).
static int env_add(char **env, size_t *k, const char *fmt, ...) {
    va_list ap;
    va_start(ap, fmt);
    int rc = vasprintf(&env[*k], fmt, ap);
    va_end(ap);
    if (rc < 0) {
        env[*k] = NULL;
        return -1;
    }
    (*k)++;
    return 0;
}

// 1 if entry ("NAME=value") sets one of the variables of extra (NULL-terminated, may be NULL).
static int overridden(const char *entry, const char *const *extra) {
    for (; extra && *extra; extra++) {
        const char *eq = strchr(*extra, '=');
        size_t n = eq ? (size_t)(eq - *extra) : strlen(*extra);
        if (!strncmp(entry, *extra, n) && entry[n] == '=') return 1;
    }
    return 0;
}

char **ranks_env(const RanksLaunch *l, int rank) {
    size_t n = 0, k = 0, n_extra = 0;
    while (environ[n])
        n++;
    while (l->extra && l->extra[n_extra])
        n_extra++;
    char **env = calloc(n + RANK_ENV_SET + n_extra + 1, sizeof *env);
    if (!env) return NULL;
    int rc = 0;
    for (size_t i = 0; i < n && !rc; i++)
        if (!is_rank_env(environ[i]) && !overridden(environ[i], l->extra))
            rc = env_add(env, &k, "%s", environ[i]);
    for (size_t i = 0; i < n_extra && !rc; i++)
        rc = env_add(env, &k, "%s", l->extra[i]);
    const char *master = l->master_addr && l->master_addr[0] ? l->master_addr : "127.0.0.1";
    int local_world = l->local_world > 0 ? l->local_world : l->world_size;
    if (rc || env_add(env, &k, "RANK=%d", l->rank_base + rank) ||
        env_add(env, &k, "WORLD_SIZE=%d", l->world_size) ||
        env_add(env, &k, "LOCAL_RANK=%d", rank) ||
        env_add(env, &k, "LOCAL_WORLD_SIZE=%d", local_world) ||
        env_add(env, &k, "MASTER_ADDR=%s", master) || env_add(env, &k, "MASTER_PORT=%d", l->port) ||
        env_add(env, &k, "ASTRAI_LAUNCHED=1") ||
        env_add(env, &k, "ASTRAI_SHM_NAME=%s", l->shm_name) ||
        env_add(env, &k, "ASTRAI_LAUNCHER_PID=%d", (int)getpid()) ||
        (rank == 0 && l->listen_fd >= 0 &&
         env_add(env, &k, "ASTRAI_RENDEZVOUS_FD=%d", l->listen_fd))) {
        ranks_free_env(env);
        return NULL;
    }
    return env;
}
