/*
 * xs_wire.c - the exec server's packets: requests received (checked: every
 * string ends inside, at most MAX_FDS descriptors), replies and hand-overs sent.
 */
#define _GNU_SOURCE
#include "execserver.h"

char xs_message[ISO_XS_MAX_MESSAGE + 8];
static char *inline_strings[MAX_STRINGS + 1];
struct request xs_current = {.strings = inline_strings};
/* The bytes of the packet in `message` (a spare monitor is handed them as they came). */
size_t xs_current_len;

void xs_close_fds(struct request *req)
{
    for (int i = 0; i < req->n_fds; i++)
        close(req->fds[i]);
    req->n_fds = 0;
}

int xs_receive(int conn)
{
    return xs_receive_flags(conn, 0);
}

/* xs_receive() with recvmsg flags; with MSG_DONTWAIT, -2 when no packet is
 * there yet. */
int xs_receive_flags(int conn, int flags)
{
    union {
        char buf[CMSG_SPACE(sizeof(int) * MAX_FDS)];
        struct cmsghdr align;
    } control;
    struct iovec iov = {.iov_base = xs_message, .iov_len = ISO_XS_MAX_MESSAGE};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control.buf,
                         .msg_controllen = sizeof control.buf};
    ssize_t n;
    do {
        n = recvmsg(conn, &msg, MSG_CMSG_CLOEXEC | flags);
    } while (n < 0 && errno == EINTR);
    xs_current.n_fds = 0;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) && (flags & MSG_DONTWAIT))
        return -2;
    xs_current_len = n > 0 ? (size_t)n : 0;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
            continue;
        size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < count; i++) {
            int fd;
            memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
            if (xs_current.n_fds < MAX_FDS)
                xs_current.fds[xs_current.n_fds++] = fd;
            else
                close(fd);
        }
    }
    if (n <= 0) {
        xs_close_fds(&xs_current);
        return 0;
    }
    if ((msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) || (size_t)n < sizeof xs_current.head)
        goto malformed;
    memcpy(&xs_current.head, xs_message, sizeof xs_current.head);
    xs_current.strings = inline_strings;
    if (xs_current.head.magic != ISO_XS_MAGIC || xs_current.head.n_argv > xs_current.head.n_strings)
        goto malformed;
    if (xs_current.head.op == ISO_XS_EXEC && (xs_current.head.flags & ISO_XS_F_STRINGS_FD)) {
        /* The strings come in a memfd, which the monitor reads: nothing
         * else may be in the packet, and the memfd must have come. */
        if ((size_t)n != sizeof xs_current.head || xs_current.n_fds < 1 ||
            xs_current.head.n_strings > ISO_XS_MAX_FD_STRINGS)
            goto malformed;
        return 1;
    }
    if (xs_current.head.n_strings > MAX_STRINGS)
        goto malformed;
    /* Every string must end inside the packet. */
    xs_message[n] = 0;
    char *p = xs_message + sizeof xs_current.head, *end = xs_message + n;
    for (uint32_t i = 0; i < xs_current.head.n_strings; i++) {
        char *nul = memchr(p, 0, (size_t)(end - p));
        if (!nul)
            goto malformed;
        xs_current.strings[i] = p;
        p = nul + 1;
    }
    xs_current.strings[xs_current.head.n_strings] = NULL;
    return 1;
malformed:
    xs_close_fds(&xs_current);
    return -1;
}

int xs_send_reply(int conn, const struct iso_xs_reply *reply, const void *extra, size_t extra_len, int fd)
{
    struct iovec iov[2] = {{.iov_base = (void *)reply, .iov_len = sizeof *reply},
                           {.iov_base = (void *)extra, .iov_len = extra_len}};
    union {
        char buf[CMSG_SPACE(sizeof(int))];
        struct cmsghdr align;
    } control;
    struct msghdr msg = {.msg_iov = iov, .msg_iovlen = extra_len ? 2 : 1};
    if (fd >= 0) {
        memset(&control, 0, sizeof control);
        msg.msg_control = control.buf;
        msg.msg_controllen = sizeof control.buf;
        struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int));
        memcpy(CMSG_DATA(c), &fd, sizeof fd);
    }
    ssize_t n;
    do {
        n = sendmsg(conn, &msg, MSG_NOSIGNAL);
    } while (n < 0 && errno == EINTR);
    return n < 0 ? -1 : 0;
}

void xs_reply_kind(int conn, uint32_t kind, int err)
{
    struct iso_xs_reply reply = {.magic = ISO_XS_MAGIC, .kind = kind, .err = err};
    xs_send_reply(conn, &reply, NULL, 0, -1);
}

int xs_send_fds(int fd, const void *data, size_t len, const int *fds, int n_fds)
{
    struct iovec iov = {.iov_base = (void *)data, .iov_len = len};
    union {
        char buf[CMSG_SPACE(sizeof(int) * MAX_FDS)];
        struct cmsghdr align;
    } control;
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1};
    if (n_fds > 0) {
        memset(&control, 0, sizeof control);
        msg.msg_control = control.buf;
        msg.msg_controllen = CMSG_SPACE(sizeof(int) * (size_t)n_fds);
        struct cmsghdr *c = CMSG_FIRSTHDR(&msg);
        c->cmsg_level = SOL_SOCKET;
        c->cmsg_type = SCM_RIGHTS;
        c->cmsg_len = CMSG_LEN(sizeof(int) * (size_t)n_fds);
        memcpy(CMSG_DATA(c), fds, sizeof(int) * (size_t)n_fds);
    }
    ssize_t n;
    do {
        n = sendmsg(fd, &msg, MSG_NOSIGNAL | MSG_DONTWAIT);
    } while (n < 0 && errno == EINTR);
    return n == (ssize_t)len ? 0 : -1;
}

long long xs_now_ms(void)
{
    struct timespec t;
    /* CLOCK_MONOTONIC is always there; were it not, time would stand still (no idle end, a late STARTED
     * never sent: EXITED still says that the command started). */
    if (clock_gettime(CLOCK_MONOTONIC, &t) < 0)
        return 0;
    return (long long)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}
