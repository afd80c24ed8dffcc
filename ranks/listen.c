// listen.c: the listening socket of a rendezvous (ranks.h): rank 0 serves the meeting on
// it, bound by its supervisor before any rank starts (a local launch, astraid) or by
// itself (an external launch).
#include <arpa/inet.h>
#include <errno.h>
#include <netdb.h>
#include <netinet/in.h>
#include <stdio.h>
#include <string.h>
#include <sys/socket.h>
#include <unistd.h>

#include "ranks/ranks.h"

// A listening socket bound to sa; -1 with errno set on failure.
static int open_listener(const struct sockaddr *sa, socklen_t sl, int *fd_out) {
    int fd = socket(sa->sa_family, SOCK_STREAM | SOCK_CLOEXEC, 0);
    if (fd < 0) return -1;
    int one = 1, zero = 0;
    setsockopt(fd, SOL_SOCKET, SO_REUSEADDR, &one, sizeof one);
    if (sa->sa_family == AF_INET6) // the IPv6 wildcard takes IPv4 connections too
        setsockopt(fd, IPPROTO_IPV6, IPV6_V6ONLY, &zero, sizeof zero);
    if (bind(fd, sa, sl) || listen(fd, SOMAXCONN)) {
        int e = errno;
        close(fd);
        errno = e;
        return -1;
    }
    *fd_out = fd;
    return 0;
}

// Every address: the dual-stack IPv6 wildcard, or the IPv4 one on a kernel without IPv6.
static int listen_any(int port, int *fd_out) {
    struct sockaddr_in6 in6 = {.sin6_family = AF_INET6, .sin6_port = htons((uint16_t)port)};
    in6.sin6_addr = in6addr_any;
    if (open_listener((struct sockaddr *)&in6, sizeof in6, fd_out) == 0) return 0;
    if (errno != EAFNOSUPPORT) return -1;
    struct sockaddr_in in = {.sin_family = AF_INET, .sin_port = htons((uint16_t)port)};
    in.sin_addr.s_addr = htonl(INADDR_ANY);
    return open_listener((struct sockaddr *)&in, sizeof in, fd_out);
}

// The first address of host that can be bound. A port in use stops the search: the ranks,
// trying host's addresses in the same order, could reach the other program there.
static int listen_host(const char *host, int port, int *fd_out, char *why, size_t cap) {
    char service[16];
    snprintf(service, sizeof service, "%d", port);
    struct addrinfo hints = {.ai_socktype = SOCK_STREAM, .ai_flags = AI_NUMERICSERV}, *res;
    int gai = getaddrinfo(host, service, &hints, &res);
    if (gai) {
        snprintf(why, cap, "%s", gai_strerror(gai));
        return -1;
    }
    int rc = -1;
    snprintf(why, cap, "no address");
    for (struct addrinfo *ai = res; ai && rc; ai = ai->ai_next) {
        rc = open_listener(ai->ai_addr, ai->ai_addrlen, fd_out);
        if (rc) snprintf(why, cap, "%s", strerror(errno));
        if (rc && errno == EADDRINUSE) break;
    }
    freeaddrinfo(res);
    return rc;
}

int ranks_listen(const char *host, int port, int *fd_out, int *port_out, Err *err) {
    int fd = -1, rc;
    char why[256];
    if (host)
        rc = listen_host(host, port, &fd, why, sizeof why);
    else if ((rc = listen_any(port, &fd)))
        snprintf(why, sizeof why, "%s", strerror(errno));
    if (rc && port == 0)
        return err_set(err, "rendezvous: cannot listen on %s (any port): %s", host ? host : "*",
                       why);
    if (rc)
        return err_set(err, "rendezvous: cannot listen on %s:%d: %s", host ? host : "*", port, why);
    struct sockaddr_storage sa;
    socklen_t sl = sizeof sa;
    getsockname(fd, (struct sockaddr *)&sa, &sl);
    if (port_out)
        *port_out = ntohs(sa.ss_family == AF_INET6 ? ((struct sockaddr_in6 *)&sa)->sin6_port
                                                   : ((struct sockaddr_in *)&sa)->sin_port);
    *fd_out = fd;
    return 0;
}
