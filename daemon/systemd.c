// systemd.c: the two systemd protocols astraid speaks, written directly (no
// libsystemd): sd_notify datagrams to $NOTIFY_SOCKET (a path, or "@name" for an
// abstract socket) and socket activation ($LISTEN_PID, $LISTEN_FDS from fd 3,
// $LISTEN_FDNAMES). Both sets of variables are taken out of the environment so the
// ranks astraid spawns do not inherit them.
#include <fcntl.h>
#include <stdarg.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/socket.h>
#include <sys/un.h>
#include <unistd.h>

#include "daemon/daemon.h"

#define SD_LISTEN_FDS_START 3

static struct sockaddr_un notify_addr;
static socklen_t notify_len; // 0: no NOTIFY_SOCKET
static int listen_fd = -1;

static void take_notify_socket(void) {
    const char *path = getenv("NOTIFY_SOCKET");
    size_t n = path ? strlen(path) : 0;
    if (n < 2 || n >= sizeof notify_addr.sun_path || (path[0] != '/' && path[0] != '@')) return;
    notify_addr.sun_family = AF_UNIX;
    memcpy(notify_addr.sun_path, path, n);
    if (path[0] == '@') notify_addr.sun_path[0] = 0; // abstract namespace
    notify_len = (socklen_t)(offsetof(struct sockaddr_un, sun_path) + n + (path[0] == '/'));
}

static int is_unix_stream_listener(int fd) {
    int type = 0, listening = 0;
    socklen_t len = sizeof type;
    struct sockaddr_storage ss;
    socklen_t alen = sizeof ss;
    if (getsockopt(fd, SOL_SOCKET, SO_TYPE, &type, &len) || type != SOCK_STREAM) return 0;
    len = sizeof listening;
    if (getsockopt(fd, SOL_SOCKET, SO_ACCEPTCONN, &listening, &len) || !listening) return 0;
    return getsockname(fd, (struct sockaddr *)&ss, &alen) == 0 && ss.ss_family == AF_UNIX;
}

// The first passed unix stream listener is the control socket; others are closed.
static void take_listen_fds(void) {
    const char *pid = getenv("LISTEN_PID"), *fds = getenv("LISTEN_FDS");
    if (!pid || !fds || atol(pid) != (long)getpid()) return;
    int n = atoi(fds);
    for (int fd = SD_LISTEN_FDS_START; fd < SD_LISTEN_FDS_START + n; fd++) {
        fcntl(fd, F_SETFD, FD_CLOEXEC);
        if (listen_fd < 0 && is_unix_stream_listener(fd))
            listen_fd = fd;
        else {
            log_warn("socket activation: fd %d is not a unix stream listener; closed", fd);
            close(fd);
        }
    }
}

void sd_init(void) {
    take_notify_socket();
    take_listen_fds();
    unsetenv("NOTIFY_SOCKET");
    unsetenv("LISTEN_PID");
    unsetenv("LISTEN_FDS");
    unsetenv("LISTEN_FDNAMES");
}

int sd_listen_fd(void) {
    return listen_fd;
}

void systemd_notify(const char *fmt, ...) {
    if (!notify_len) return;
    char msg[1024];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(msg, sizeof msg, fmt, ap);
    va_end(ap);
    if (n < 0) return;
    int fd = socket(AF_UNIX, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return;
    size_t len = (size_t)n < sizeof msg ? (size_t)n : sizeof msg - 1;
    if (sendto(fd, msg, len, MSG_NOSIGNAL, (struct sockaddr *)&notify_addr, notify_len) < 0)
        log_debug("sd_notify: sendto NOTIFY_SOCKET failed");
    close(fd);
}
