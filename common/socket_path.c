#include "common/socket_path.h"

#include <stdio.h>
#include <stdlib.h>
#include <unistd.h>

static const char *env_nonempty(const char *name) {
    const char *v = getenv(name);
    return v && *v ? v : NULL;
}

int socket_default_path(char *buf, size_t cap, Err *err) {
    const char *env = env_nonempty("ASTRAID_SOCKET");
    const char *runtime = env_nonempty("XDG_RUNTIME_DIR");
    int n;
    if (env)
        n = snprintf(buf, cap, "%s", env);
    else if (geteuid() == 0)
        n = snprintf(buf, cap, "/run/astraid/astraid.sock");
    else if (runtime)
        n = snprintf(buf, cap, "%s/astraid/astraid.sock", runtime);
    else
        n = snprintf(buf, cap, "/tmp/astraid-%u/astraid.sock", (unsigned)geteuid());
    const char *from = env ? env : runtime ? runtime : "/tmp";
    if (n < 0 || (size_t)n >= cap)
        return err_set(err, "default socket: '%.200s' makes a path longer than %zu bytes", from,
                       cap - 1);
    return 0;
}
