/*
 * net.c - the network namespace's loopback, and egress listeners.
 *
 * A fresh network namespace holds only "lo", down.  network="loopback"
 * brings it up, which needs no netlink: the classic interface ioctl does.
 *
 * Egress by name keeps that namespace (no route leaves it) and adds a way
 * out that only the host's mediator controls: sockets made here, inside the
 * namespace, and handed to the mediator, which runs in the host's.  A
 * socket belongs to the namespace it was made in, wherever its descriptor
 * goes, so the mediator accepts the program's connections on the sandbox's
 * loopback and opens its own towards the host's network.  Made by the first
 * child, which still holds every capability of the sandbox's user
 * namespace (the ports below 1024 need CAP_NET_BIND_SERVICE there), before
 * any Landlock or seccomp rule exists.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <net/if.h>
#include <netinet/in.h>
#include <sched.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include "steps.h"

/* A network namespace costs its maker about 0.3 ms (the kernel sets up
 * every protocol's per-namespace state); made here, by a thread of the
 * parent ahead of a run, it is not on the run's path (iso_plan.netns_fd).
 * unshare() and setns() of CLONE_NEWNET act on the calling thread alone. */
int iso_make_netns(void)
{
    int back = open("/proc/thread-self/ns/net", O_RDONLY | O_CLOEXEC);
    if (back < 0)
        return -1;
    if (unshare(CLONE_NEWNET) < 0) {
        int saved = errno;
        close(back);
        errno = saved;
        return -1;
    }
    int fd = open("/proc/thread-self/ns/net", O_RDONLY | O_CLOEXEC);
    int saved = errno;
    if (setns(back, CLONE_NEWNET) < 0) {
        saved = errno;
        close(back);
        if (fd >= 0)
            close(fd);
        errno = saved;
        return -2;
    }
    close(back);
    errno = saved;
    return fd;
}

int iso_loopback_up(void)
{
    int sock = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (sock < 0)
        return ISO_STEP_LOOPBACK;
    struct ifreq req;
    memset(&req, 0, sizeof req);
    strncpy(req.ifr_name, "lo", IFNAMSIZ - 1);
    if (ioctl(sock, SIOCGIFFLAGS, &req) < 0)
        goto fail;
    req.ifr_flags |= IFF_UP | IFF_RUNNING;
    if (ioctl(sock, SIOCSIFFLAGS, &req) < 0)
        goto fail;
    close(sock);
    return 0;
fail:;
    int saved = errno;
    close(sock);
    errno = saved;
    return ISO_STEP_LOOPBACK;
}

/* The DNS server's UDP socket, a listener on each of at most 64 allow-list
 * ports (egress_rules.MAX_PORTS), and the two the mediator always has: DNS
 * over TCP (53) and the proxy (3128), unless the allow-list names them. */
#define ISO_EGRESS_MAX_FDS (1 + 64 + 2)

static int egress_socket(int type, uint32_t address, uint16_t port)
{
    int sock = socket(AF_INET, type | SOCK_CLOEXEC, 0);
    if (sock < 0)
        return -1;
    struct sockaddr_in sin;
    memset(&sin, 0, sizeof sin);
    sin.sin_family = AF_INET;
    sin.sin_addr.s_addr = htonl(address);
    sin.sin_port = htons(port);
    /* No SO_REUSEADDR: the namespace is fresh, nothing holds these ports,
     * and without it nothing the program binds later can share them. */
    if (bind(sock, (struct sockaddr *)&sin, sizeof sin) < 0 ||
        (type == SOCK_STREAM && listen(sock, SOMAXCONN) < 0)) {
        int saved = errno;
        close(sock);
        errno = saved;
        return -1;
    }
    return sock;
}

int iso_egress_listen(const struct iso_plan *plan)
{
    int fds[ISO_EGRESS_MAX_FDS];
    int n = 0, i;
    union {
        char buf[CMSG_SPACE(sizeof fds)];
        struct cmsghdr align;
    } control;

    if (plan->n_egress_ports < 0 || plan->n_egress_ports > ISO_EGRESS_MAX_FDS - 1) {
        errno = EINVAL;
        return ISO_STEP_EGRESS;
    }
    fds[n] = egress_socket(SOCK_DGRAM, plan->egress_dns_address, 53);
    if (fds[n] < 0)
        goto fail;
    n++;
    for (i = 0; i < plan->n_egress_ports; i++) {
        fds[n] = egress_socket(SOCK_STREAM, INADDR_ANY, plan->egress_ports[i]);
        if (fds[n] < 0)
            goto fail;
        n++;
    }
    /* One packet: the count as data (a SEQPACKET message needs a byte of
     * it), every descriptor in its SCM_RIGHTS. */
    unsigned char count = (unsigned char)n;
    struct iovec iov = {.iov_base = &count, .iov_len = 1};
    struct msghdr msg;
    memset(&msg, 0, sizeof msg);
    memset(&control, 0, sizeof control);
    msg.msg_iov = &iov;
    msg.msg_iovlen = 1;
    msg.msg_control = control.buf;
    msg.msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)n);
    struct cmsghdr *cmsg = CMSG_FIRSTHDR(&msg);
    cmsg->cmsg_level = SOL_SOCKET;
    cmsg->cmsg_type = SCM_RIGHTS;
    cmsg->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)n);
    memcpy(CMSG_DATA(cmsg), fds, sizeof(int) * (size_t)n);
    ssize_t sent;
    do {
        sent = sendmsg(plan->egress_fd, &msg, MSG_NOSIGNAL);
    } while (sent < 0 && errno == EINTR);
    if (sent != 1)
        goto fail;
    /* The mediator holds them now; none may reach the program. */
    for (i = 0; i < n; i++)
        close(fds[i]);
    close(plan->egress_fd);
    return 0;
fail:;
    int saved = errno;
    for (i = 0; i < n; i++)
        close(fds[i]);
    errno = saved;
    return ISO_STEP_EGRESS;
}
