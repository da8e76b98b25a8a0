/*
 * supervise.c - the init performs connect() on the program's behalf.
 *
 * Under network "none", "loopback" or egress by name, on kernels whose Landlock cannot
 * govern the lookup of pathname unix sockets (before ABI 9), the program's
 * seccomp filter sends every connect() it would allow to the init as a user
 * notification (isolate/kernel/seccomp.py, "supervised connect").  Letting the call
 * continue after looking at its address would be a race: the program can
 * change the address in memory, the socket behind the descriptor or the
 * path on disk between the check and the kernel's own lookup.  So the init
 * never lets a connect() continue; it does the connect itself:
 *   - takes the program's socket with pidfd_getfd (the same open file),
 *   - reads the address once with process_vm_readv into its own memory,
 *   - for a pathname AF_UNIX address, opens the path as the program would
 *     (from its cwd or the root they share) with O_PATH, following no magic
 *     link of /proc, and decides on the inode it got: allowed when the
 *     inode is one of the sockets the parent named (unix_sockets=), or when
 *     it lies on a writable mount (the write grants and the sandbox's own
 *     tmpfs mounts; every read grant is a read-only bind);
 *   - connects the program's socket to "/proc/self/fd/N" of that O_PATH
 *     descriptor, which the kernel follows to exactly the inode checked;
 *   - answers the notification with the result.
 * Other families: under "none" an AF_INET/AF_INET6 destination is answered
 * ENETUNREACH and recorded, and so is every address off the loopback under
 * "loopback" and egress; under egress, the mediator's block on a port it
 * does not listen on is answered ECONNREFUSED and recorded, so that the
 * report names what was tried.  Anything else is connected with the copied
 * address.  A blocking socket is connected by a short-lived thread, so that
 * the init's loop (wall clock, reaping) never waits on a peer.
 * Under egress, sendto() naming an address and every sendmsg() and
 * sendmmsg() come here too, only to be looked at: a destination the
 * namespace cannot reach is recorded and answered ENETUNREACH (what the
 * kernel says), anything else continues to the kernel.
 * AF_UNIX datagram sockets name their peer on every sendmsg(), behind a
 * pointer the filter cannot read, so their creation is sent here too and
 * refused (EACCES).  Whatever cannot be checked is refused (EACCES).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/openat2.h>
#include <linux/seccomp.h>
#include <netinet/in.h>
#include <pthread.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/statvfs.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <sys/un.h>
#include <unistd.h>

#include "steps.h"

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef SYS_pidfd_getfd
#define SYS_pidfd_getfd 438
#endif
#ifndef SYS_openat2
#define SYS_openat2 437
#endif
#ifndef PIDFD_THREAD
#define PIDFD_THREAD O_EXCL
#endif
#ifndef SECCOMP_IOCTL_NOTIF_ID_VALID
#define SECCOMP_IOCTL_NOTIF_ID_VALID _IOW('!', 2, __u64)
#endif

#define MAX_ALLOWED 64

static int mode;          /* 'n' none, 'l' loopback, 'e' egress, 0 off */
/* Egress: the block the mediator answers on, and its listening ports. */
static uint32_t egress_net, egress_mask;
/* At most 64 allow-list ports (egress_rules.MAX_PORTS), DNS's and the proxy's. */
static uint16_t egress_ports[64 + 2];
static int n_egress_ports;
static int nr_connect = -1, nr_socket = -1, nr_socketpair = -1, nr_sendto = -1, nr_sendmsg = -1, nr_sendmmsg = -1;
static struct {
    dev_t dev;
    ino_t ino;
} allowed[MAX_ALLOWED];
static int n_allowed;
static struct iso_status *report;

/* "MODE,CONNECT,SOCKET,SOCKETPAIR[,DEV:INO...]" from the parent; MODE is
 * n, l, or "e:NET/PREFIX/SENDTO/SENDMSG/SENDMMSG:PORT:PORT..." (egress; NET
 * an IPv4 number, SENDTO the number of sendto, whose calls naming an address
 * come here, SENDMSG and SENDMMSG those of sendmsg and sendmmsg, whose every
 * call comes here). */
int iso_supervise_init(const char *spec, struct iso_status *status)
{
    report = status;
    if (spec == NULL || (spec[0] != 'n' && spec[0] != 'l' && spec[0] != 'e'))
        return -1;
    char *p = (char *)spec + 1, *end;
    if (spec[0] == 'e') {
        if (*p != ':')
            return -1;
        unsigned long net = strtoul(p + 1, &end, 10);
        if (*end != '/')
            return -1;
        unsigned long prefix = strtoul(end + 1, &end, 10);
        if (prefix < 1 || prefix > 32 || net > 0xffffffffUL || *end != '/')
            return -1;
        nr_sendto = (int)strtol(end + 1, &end, 10);
        if (*end != '/')
            return -1;
        nr_sendmsg = (int)strtol(end + 1, &end, 10);
        if (*end != '/')
            return -1;
        nr_sendmmsg = (int)strtol(end + 1, &end, 10);
        egress_mask = (uint32_t)(0xffffffffUL << (32 - prefix));
        egress_net = (uint32_t)net & egress_mask;
        while (*end == ':' && n_egress_ports < (int)(sizeof egress_ports / sizeof egress_ports[0])) {
            unsigned long port = strtoul(end + 1, &end, 10);
            if (port == 0 || port > 65535)
                return -1;
            egress_ports[n_egress_ports++] = (uint16_t)port;
        }
        p = end;
    }
    if (*p != ',')
        return -1;
    p++;
    nr_connect = (int)strtol(p, &end, 10);
    if (*end != ',')
        return -1;
    nr_socket = (int)strtol(end + 1, &end, 10);
    if (*end != ',')
        return -1;
    nr_socketpair = (int)strtol(end + 1, &end, 10);
    while (*end == ',' && n_allowed < MAX_ALLOWED) {
        unsigned long long dev = strtoull(end + 1, &end, 10);
        if (*end != ':')
            return -1;
        unsigned long long ino = strtoull(end + 1, &end, 10);
        allowed[n_allowed].dev = (dev_t)dev;
        allowed[n_allowed].ino = (ino_t)ino;
        n_allowed++;
    }
    if (*end != 0)
        return -1;
    mode = spec[0];
    return 0;
}

static void record(int kind, int family, const void *address, int port, const char *path)
{
    uint32_t n = report->n_net_denied;
    for (uint32_t i = 0; i < n; i++) {
        struct iso_net_denial *d = &report->net_denied[i];
        if (d->kind != kind || d->family != family || d->port != port)
            continue;
        if (address && memcmp(d->address, address, family == AF_INET ? 4 : 16) != 0)
            continue;
        if (path && strncmp(d->path, path, sizeof d->path) != 0)
            continue;
        d->count++;
        return;
    }
    if (n >= sizeof report->net_denied / sizeof report->net_denied[0]) {
        report->net_denied_dropped++;
        return;
    }
    struct iso_net_denial *d = &report->net_denied[n];
    memset(d, 0, sizeof *d);
    d->kind = kind;
    d->family = family;
    d->port = port;
    d->count = 1;
    if (address)
        memcpy(d->address, address, family == AF_INET ? 4 : 16);
    if (path) {
        strncpy(d->path, path, sizeof d->path - 1);
    }
    report->n_net_denied = n + 1;
}

/* The thread group (process) of thread tid, from /proc/TID/status; -1 if unknown. */
static pid_t thread_group_of(pid_t tid)
{
    char path[64], buf[512];
    snprintf(path, sizeof path, "/proc/%d/status", (int)tid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return -1;
    buf[n] = 0;
    char *line = strstr(buf, "\nTgid:");
    return line ? (pid_t)strtol(line + 6, NULL, 10) : -1;
}

static void answer(int listener, uint64_t id, int err)
{
    struct seccomp_notif_resp resp;
    memset(&resp, 0, sizeof resp);
    resp.id = id;
    resp.error = err ? -err : 0;
    resp.val = 0;
    ioctl(listener, SECCOMP_IOCTL_NOTIF_SEND, &resp); /* ENOENT: the call was interrupted */
}

/* Let the call go on: the kernel (the network namespace) decides. */
static void let_continue(int listener, uint64_t id)
{
    struct seccomp_notif_resp resp;
    memset(&resp, 0, sizeof resp);
    resp.id = id;
    resp.flags = SECCOMP_USER_NOTIF_FLAG_CONTINUE;
    ioctl(listener, SECCOMP_IOCTL_NOTIF_SEND, &resp); /* ENOENT: the call was interrupted */
}

/* A pathname socket is allowed when it is named in the allow-list or lies
 * on a writable mount.  fd is an O_PATH descriptor of the resolved path. */
static int path_allowed(int fd, int *err)
{
    struct stat st;
    if (fstat(fd, &st) < 0) {
        *err = EACCES;
        return 0;
    }
    if (!S_ISSOCK(st.st_mode)) {
        *err = ECONNREFUSED; /* what connect() says of a file that is no socket */
        return 0;
    }
    for (int i = 0; i < n_allowed; i++)
        if (allowed[i].dev == st.st_dev && allowed[i].ino == st.st_ino)
            return 1;
    struct statvfs vfs;
    if (fstatvfs(fd, &vfs) < 0 || (vfs.f_flag & ST_RDONLY)) {
        *err = EACCES;
        return 0;
    }
    return 1;
}

/* Open the socket path as the program sees it; -1 with *err set. */
static int open_program_path(pid_t tid, const char *path, int *err)
{
    int dirfd = -1;
    if (path[0] != '/') {
        char cwd[64];
        snprintf(cwd, sizeof cwd, "/proc/%d/cwd", (int)tid);
        dirfd = open(cwd, O_PATH | O_DIRECTORY | O_CLOEXEC);
        if (dirfd < 0) {
            *err = EACCES;
            return -1;
        }
    }
    /* The init and the program share their root (the sandbox's; the
     * program holds no capability to chroot).  No magic link: "/proc/self"
     * would be the init's own. */
    struct open_how how = {.flags = O_PATH | O_CLOEXEC, .resolve = RESOLVE_NO_MAGICLINKS};
    int fd = (int)syscall(SYS_openat2, dirfd >= 0 ? dirfd : AT_FDCWD, path, &how, sizeof how);
    int saved = errno;
    if (dirfd >= 0)
        close(dirfd);
    if (fd < 0) {
        /* As connect() would say it: a missing path is ENOENT, a loop
         * ELOOP; whatever this lookup refuses and the kernel's might not
         * (a magic link) is refused. */
        *err = (saved == ENOENT || saved == ENOTDIR || saved == ENAMETOOLONG || saved == EACCES) ? saved : EACCES;
        return -1;
    }
    return fd;
}

/* A blocking connect, done by a thread of its own: it owns the socket and
 * the O_PATH descriptor, answers the notification and ends. */
struct connect_job {
    int listener;
    uint64_t id;
    int sock;
    int target;
    socklen_t len;
    struct sockaddr_storage addr;
};

static void *connect_thread(void *arg)
{
    struct connect_job *job = arg;
    int rc = connect(job->sock, (struct sockaddr *)&job->addr, job->len) < 0 ? errno : 0;
    answer(job->listener, job->id, rc);
    close(job->sock);
    if (job->target >= 0)
        close(job->target);
    free(job);
    return NULL;
}

/* Connect *sock to addr.  A non-blocking socket is connected here; a
 * blocking one by a detached thread (a peer with a full backlog would
 * otherwise stop the init's loop: the wall clock, the reaping), which then
 * owns *sock and *target (set to -1 here) and answers.  Returns 1 when the
 * thread answers, else 0 with *err set. */
static int do_connect(int listener, uint64_t id, int *sock, int *target, const struct sockaddr *addr,
                      socklen_t len, int *err)
{
    int flags = fcntl(*sock, F_GETFL);
    if (flags < 0) {
        *err = EBADF;
        return 0;
    }
    if (flags & O_NONBLOCK) {
        *err = connect(*sock, addr, len) < 0 ? errno : 0;
        return 0;
    }
    struct connect_job *job = malloc(sizeof *job);
    if (job == NULL) {
        *err = ENOMEM;
        return 0;
    }
    job->listener = listener;
    job->id = id;
    job->sock = *sock;
    job->target = *target;
    job->len = len;
    memcpy(&job->addr, addr, len);
    pthread_attr_t attr;
    pthread_t thread;
    int rc = pthread_attr_init(&attr);
    if (rc == 0) {
        /* Errors of these two only leave the defaults (joinable threads
         * that are never joined keep a little memory; a larger stack). */
        (void)pthread_attr_setdetachstate(&attr, PTHREAD_CREATE_DETACHED);
        (void)pthread_attr_setstacksize(&attr, 64 * 1024);
        rc = pthread_create(&thread, &attr, connect_thread, job);
        pthread_attr_destroy(&attr);
    }
    if (rc != 0) {
        free(job);
        *err = rc == ENOMEM ? ENOMEM : EAGAIN;
        return 0;
    }
    *sock = -1;
    *target = -1;
    return 1;
}

static int egress_port(uint16_t port)
{
    for (int i = 0; i < n_egress_ports; i++)
        if (egress_ports[i] == port)
            return 1;
    return 0;
}

/* What an IPv4 destination gets: 0 (go on) or the error to answer. */
static int inet4_verdict(uint32_t a, uint16_t port)
{
    if (mode == 'n')
        return ENETUNREACH;
    if (!((a >> 24) == 127 || a == 0))
        return ENETUNREACH; /* no route leaves the namespace: said here, and recorded */
    if (mode == 'e' && (a & egress_mask) == egress_net && !egress_port(port))
        return ECONNREFUSED; /* a name's address, on a port no rule allows */
    return 0;
}

/* Whether an AF_INET/AF_INET6 destination lies outside what the network
 * namespace offers: everything under "none", all but the loopback addresses
 * under "loopback" and "egress" (the kernel would say ENETUNREACH too), and
 * under "egress" the mediator's addresses on a port it does not answer on
 * (ECONNREFUSED, which the kernel would say; recorded so that the report
 * names the destination).  Returns 0 or the error. */
static int unreachable(const struct sockaddr_storage *copy, int addrlen)
{
    if (copy->ss_family == AF_INET && addrlen >= (int)sizeof(struct sockaddr_in)) {
        const struct sockaddr_in *in = (const struct sockaddr_in *)copy;
        return inet4_verdict(ntohl(in->sin_addr.s_addr), ntohs(in->sin_port));
    }
    if (copy->ss_family == AF_INET6 && addrlen >= (int)sizeof(struct sockaddr_in6)) {
        const struct sockaddr_in6 *in6 = (const struct sockaddr_in6 *)copy;
        const struct in6_addr *a = &in6->sin6_addr;
        if (mode == 'n')
            return ENETUNREACH;
        if (IN6_IS_ADDR_LOOPBACK(a) || IN6_IS_ADDR_UNSPECIFIED(a))
            return 0;
        if (IN6_IS_ADDR_V4MAPPED(a)) {
            uint32_t v4 = ((uint32_t)a->s6_addr[12] << 24) | ((uint32_t)a->s6_addr[13] << 16) |
                          ((uint32_t)a->s6_addr[14] << 8) | a->s6_addr[15];
            return inet4_verdict(v4, ntohs(in6->sin6_port));
        }
        return ENETUNREACH;
    }
    return 0; /* AF_UNSPEC (disconnect) and short addresses: the kernel answers */
}

static void record_inet(const struct sockaddr_storage *copy)
{
    if (copy->ss_family == AF_INET) {
        const struct sockaddr_in *in = (const struct sockaddr_in *)copy;
        record(ISO_NET_DENIAL_INET, AF_INET, &in->sin_addr, ntohs(in->sin_port), NULL);
    } else {
        const struct sockaddr_in6 *in6 = (const struct sockaddr_in6 *)copy;
        record(ISO_NET_DENIAL_INET, AF_INET6, &in6->sin6_addr, ntohs(in6->sin6_port), NULL);
    }
}

/* sendto() naming a destination, under egress.  The network namespace
 * decides (no route leaves it); this only says it at once and records an
 * address off the loopback, so the report can name UDP that was tried.
 * Nothing is decided on the copy: the call goes on, or fails as the kernel
 * would fail it, so a program that changes the address meanwhile gains
 * nothing. */
static int sendto_notification(int listener, const struct seccomp_notif *req)
{
    struct sockaddr_storage copy;
    memset(&copy, 0, sizeof copy);
    uint64_t user_addr = req->data.args[4];
    int addrlen = (int)(uint32_t)req->data.args[5];
    int verdict = 0;
    if (addrlen > 0 && (size_t)addrlen <= sizeof copy) {
        struct iovec local = {.iov_base = &copy, .iov_len = (size_t)addrlen};
        struct iovec remote = {.iov_base = (void *)(uintptr_t)user_addr, .iov_len = (size_t)addrlen};
        if (process_vm_readv((pid_t)req->pid, &local, 1, &remote, 1, 0) == addrlen &&
            (copy.ss_family == AF_INET || copy.ss_family == AF_INET6))
            verdict = unreachable(&copy, addrlen) == ENETUNREACH ? ENETUNREACH : 0;
    }
    if (verdict) {
        record_inet(&copy);
        answer(listener, req->id, verdict);
        return 1;
    }
    let_continue(listener, req->id);
    return 1;
}

/* Whether the msg_name of a msghdr the program holds names an AF_INET or
 * AF_INET6 destination off what the namespace reaches (ENETUNREACH); then
 * *copy holds it.  msg_namelen is clamped to a sockaddr_storage, as the
 * kernel clamps it; a negative one is left to the kernel (EINVAL), and so
 * is a name that cannot be read (EFAULT). */
static int name_unreachable(pid_t pid, const struct msghdr *msg, struct sockaddr_storage *copy)
{
    int namelen = (int)msg->msg_namelen;
    if (msg->msg_name == NULL || namelen <= 0)
        return 0; /* no address: the socket's peer, the kernel's business */
    if ((size_t)namelen > sizeof *copy)
        namelen = (int)sizeof *copy;
    memset(copy, 0, sizeof *copy);
    struct iovec local = {.iov_base = copy, .iov_len = (size_t)namelen};
    struct iovec remote = {.iov_base = msg->msg_name, .iov_len = (size_t)namelen};
    if (process_vm_readv(pid, &local, 1, &remote, 1, 0) != namelen)
        return 0;
    if (copy->ss_family != AF_INET && copy->ss_family != AF_INET6)
        return 0;
    return unreachable(copy, namelen) == ENETUNREACH;
}

/* sendmsg() under egress: its destination (msg_name) lies behind a pointer
 * the filter cannot follow, so every call comes here.  As for sendto(), the
 * copy only says at once what the namespace would say, and records it:
 * the call continues, or fails with the kernel's own ENETUNREACH, so a
 * program that changes the address meanwhile only refuses itself. */
static int sendmsg_notification(int listener, const struct seccomp_notif *req)
{
    struct msghdr msg;
    struct sockaddr_storage copy;
    struct iovec local = {.iov_base = &msg, .iov_len = sizeof msg};
    struct iovec remote = {.iov_base = (void *)(uintptr_t)req->data.args[1], .iov_len = sizeof msg};
    if (process_vm_readv((pid_t)req->pid, &local, 1, &remote, 1, 0) == (ssize_t)sizeof msg &&
        name_unreachable((pid_t)req->pid, &msg, &copy)) {
        record_inet(&copy);
        answer(listener, req->id, ENETUNREACH);
        return 1;
    }
    let_continue(listener, req->id);
    return 1;
}

/* The entries of one sendmmsg() read here: the kernel takes up to
 * UIO_MAXIOV (1024), but the init reads into its stack (it does not
 * allocate), 64 entries of 64 bytes.  A destination past them is refused
 * by the namespace all the same, only not recorded. */
#define SENDMMSG_READ 64

/* sendmmsg() under egress.  The kernel sends the entries in order and stops
 * at the first that fails; it returns an error only when that is the first
 * (nothing sent), else the count sent.  So:
 *   - the first entry unreachable: answered ENETUNREACH and recorded, which
 *     is what the kernel would answer (it would send nothing either);
 *   - a later one: recorded, and the call continues; the kernel sends those
 *     before it and fails there.  Answering an error would hide datagrams
 *     the kernel sends, and answering a count would mean sending them here.
 * Only the first unreachable entry is recorded, as the kernel tries no
 * entry after it (a program that sends the rest again comes back here).
 * An entry before it may fail of its own (no address on an unconnected
 * socket, a message too long): then the kernel never tried the one
 * recorded, which the program still meant to send.  Whatever is decided on
 * the copy is a refusal the kernel would make too, never a permission: a
 * program that races it only refuses itself. */
static int sendmmsg_notification(int listener, const struct seccomp_notif *req)
{
    struct mmsghdr entries[SENDMMSG_READ];
    struct sockaddr_storage copy;
    unsigned int vlen = (unsigned int)req->data.args[2];
    size_t want = (vlen < SENDMMSG_READ ? vlen : SENDMMSG_READ) * sizeof entries[0];
    ssize_t got = 0;
    if (want > 0) {
        struct iovec local = {.iov_base = entries, .iov_len = want};
        struct iovec remote = {.iov_base = (void *)(uintptr_t)req->data.args[1], .iov_len = want};
        /* A partial read (the vector ends in unmapped memory) leaves the
         * entries read whole; the kernel fails at the first it cannot read. */
        got = process_vm_readv((pid_t)req->pid, &local, 1, &remote, 1, 0);
    }
    size_t n = got > 0 ? (size_t)got / sizeof entries[0] : 0;
    for (size_t i = 0; i < n; i++) {
        if (!name_unreachable((pid_t)req->pid, &entries[i].msg_hdr, &copy))
            continue;
        record_inet(&copy);
        if (i == 0) {
            answer(listener, req->id, ENETUNREACH);
            return 1;
        }
        break;
    }
    let_continue(listener, req->id);
    return 1;
}

/* Whether the notification is one of ours; when it is, it is answered. */
int iso_supervise_notification(int listener, const struct seccomp_notif *req)
{
    if (!mode)
        return 0;
    int nr = req->data.nr;
    if (nr == nr_socket || nr == nr_socketpair) {
        int type = (int)(req->data.args[1] & 0xf);
        if ((int)(uint32_t)req->data.args[0] != AF_UNIX || type == SOCK_STREAM || type == SOCK_SEQPACKET)
            return 0; /* a denial of the profile's own, answered from its table */
        record(ISO_NET_DENIAL_DGRAM, AF_UNIX, NULL, 0, NULL);
        answer(listener, req->id, EACCES);
        return 1;
    }
    if (nr == nr_sendto && mode == 'e')
        return sendto_notification(listener, req);
    if (nr == nr_sendmsg && mode == 'e')
        return sendmsg_notification(listener, req);
    if (nr == nr_sendmmsg && mode == 'e')
        return sendmmsg_notification(listener, req);
    if (nr != nr_connect)
        return 0;

    int err = EACCES;
    int pidfd = -1, sock = -1, target = -1;
    pid_t tid = (pid_t)req->pid;
    int fd_arg = (int)(uint32_t)req->data.args[0];
    uint64_t user_addr = req->data.args[1];
    int addrlen = (int)(uint32_t)req->data.args[2];
    struct sockaddr_storage copy;
    memset(&copy, 0, sizeof copy);

    if (addrlen < 0 || (size_t)addrlen > sizeof copy) {
        err = EINVAL; /* as the kernel says it */
        goto out;
    }
    pidfd = (int)syscall(SYS_pidfd_open, tid, PIDFD_THREAD);
    if (pidfd < 0 && errno == EINVAL) {
        /* Before Linux 6.9 a pidfd names a thread-group leader only; the
         * descriptor table is the whole group's, so its leader's will do.
         * (Checked below: the call still waiting means tid, hence its
         * group, is alive and the same.) */
        pid_t group = thread_group_of(tid);
        pidfd = group > 0 ? (int)syscall(SYS_pidfd_open, group, 0) : -1;
    }
    if (pidfd < 0)
        goto out;
    /* The pid named the caller only if its call is still waiting. */
    uint64_t id = req->id;
    if (ioctl(listener, SECCOMP_IOCTL_NOTIF_ID_VALID, &id) < 0) {
        close(pidfd);
        return 1;
    }
    sock = (int)syscall(SYS_pidfd_getfd, pidfd, fd_arg, 0);
    if (sock < 0) {
        /* EBADF: no such descriptor; EPERM: not dumpable, or no ptrace
         * access: refused either way. */
        err = errno == EBADF ? EBADF : EACCES;
        goto out;
    }
    if (addrlen > 0) {
        struct iovec local = {.iov_base = &copy, .iov_len = (size_t)addrlen};
        struct iovec remote = {.iov_base = (void *)(uintptr_t)user_addr, .iov_len = (size_t)addrlen};
        ssize_t got = process_vm_readv(tid, &local, 1, &remote, 1, 0);
        if (got != addrlen) {
            err = got < 0 && errno == EFAULT ? EFAULT : EACCES;
            goto out;
        }
    }
    int domain = 0;
    socklen_t optlen = sizeof domain;
    if (getsockopt(sock, SOL_SOCKET, SO_DOMAIN, &domain, &optlen) < 0) {
        err = errno == ENOTSOCK ? ENOTSOCK : EACCES;
        goto out;
    }
    if (domain == AF_UNIX && copy.ss_family == AF_UNIX && addrlen > (int)offsetof(struct sockaddr_un, sun_path) &&
        ((struct sockaddr_un *)&copy)->sun_path[0] != 0) {
        /* A pathname: the kernel reads it up to addrlen or the first NUL. */
        char path[sizeof((struct sockaddr_un *)0)->sun_path + 1];
        size_t n = (size_t)addrlen - offsetof(struct sockaddr_un, sun_path);
        memcpy(path, ((struct sockaddr_un *)&copy)->sun_path, n);
        path[n] = 0;
        target = open_program_path(tid, path, &err);
        if (target < 0 || !path_allowed(target, &err)) {
            if (err == EACCES)
                record(ISO_NET_DENIAL_UNIX, AF_UNIX, NULL, 0, path);
            goto out;
        }
        struct sockaddr_un via = {.sun_family = AF_UNIX};
        snprintf(via.sun_path, sizeof via.sun_path, "/proc/self/fd/%d", target);
        if (do_connect(listener, req->id, &sock, &target, (struct sockaddr *)&via, sizeof via, &err))
            goto handed_over;
        goto out;
    }
    /* Abstract and unnamed unix addresses live in the sandbox's own network
     * namespace; other families are the network namespace's business, and
     * an address it cannot reach is answered (and recorded) here. */
    int verdict = (domain == AF_INET || domain == AF_INET6) ? unreachable(&copy, addrlen) : 0;
    if (verdict) {
        record_inet(&copy);
        err = verdict;
        goto out;
    }
    if (do_connect(listener, req->id, &sock, &target, (struct sockaddr *)&copy, (socklen_t)addrlen, &err))
        goto handed_over;
out:
    answer(listener, req->id, err);
handed_over:
    if (target >= 0)
        close(target);
    if (sock >= 0)
        close(sock);
    if (pidfd >= 0)
        close(pidfd);
    return 1;
}
