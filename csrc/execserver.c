/*
 * execserver.c - a kept sandbox's program: commands and file operations,
 * performed from inside.
 *
 *   isolate-exec-server LISTEN_FD|/SOCKET/PATH PEER_UID IDLE_MS [TTL_MS]
 *
 * The init executable runs this when its argv[0] is "isolate-exec-server".
 * The program child of a kept sandbox execs it (plan->program_fd) after every
 * step a program gets: it holds the program's ids, no capability, the
 * sandbox's mounts, rlimits, Landlock domain and seccomp filter, and so does
 * everything it starts.  Nothing needs to exist inside the sandbox.
 *
 * LISTEN_FD is a SOCK_SEQPACKET socket the host bound in a directory only
 * its user can enter (the program never sees that path).  Each connection
 * is checked once, when accepted: the peer must be outside the sandbox's
 * PID namespace (SO_PEERCRED gives pid 0 then) and have PEER_UID, the
 * caller's uid as this user namespace sees it.  The program can connect to
 * nothing of the host's, but a process of the sandbox that somehow held a
 * socket to here would still be refused.
 *
 * On a connection, the host sends requests (struct iso_xs_request):
 *   - file operations (OPEN, STAT, MKDIR, READDIR...) are answered here, in
 *     order, with the program's credentials and view: a path resolves as
 *     the program's would, inside its root, through its mounts and links,
 *     so nothing the program planted can lead outside its own view.  Files
 *     are opened O_NONBLOCK (a planted FIFO cannot hang the server) and the
 *     descriptor goes back to the host, which checks its type and reads or
 *     writes it itself;
 *   - EXEC hands the connection to a new monitor process, which starts the
 *     command, reports STARTED, then EXITED with its status and usage.  The
 *     monitor is a subreaper: whatever the command starts and leaves (a
 *     setsid daemon included) becomes its child, so a timeout, a SIGKILL
 *     from the host or the host hanging up ends the command's whole tree
 *     and nothing else.  When the command exits by itself, what it left in
 *     the background goes on running, as on any machine.
 * With IDLE_MS > 0 the server exits after that long without a connection
 * or a running command; its exit ends the sandbox (the init then ends the
 * PID namespace).  With TTL_MS > 0 it exits that long after it started,
 * whatever runs.
 *
 * In a container (the Docker backend of a kept sandbox) nothing can hand
 * the server a descriptor: the first argument is then an absolute path,
 * where the server binds and listens itself (mode 0600), in a directory
 * the host made for it and bound into the container.  The server is the
 * container's main process, its PID 1: orphans come to it, so it counts
 * its monitors by pid, not by every child it reaps.  The host checks from
 * its side that the listener is that process (a process of the container
 * could otherwise unlink the socket and listen in its place).
 */
#define _GNU_SOURCE
#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/timerfd.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "steps.h"

#ifndef SYS_close_range
#define SYS_close_range 436
#endif
#ifndef SYS_renameat2
#define SYS_renameat2 316
#endif

#define MAX_CLIENTS 64
/* Commands running at once (each has a monitor process). */
#define MAX_MONITORS 4096
#define MAX_STRINGS 16384
/* Descriptors one request may carry (see struct request). */
#define MAX_FDS 6

/* One request as received: the header, its strings, its descriptors. */
struct request {
    struct iso_xs_request head;
    char **strings; /* inline_strings, or (ISO_XS_F_STRINGS_FD) a monitor's own mapping */
    /* The conversation (ISO_XS_F_CONVERSATION), the strings' memfd
     * (ISO_XS_F_STRINGS_FD), stdin, stdout, stderr, and the command's
     * descriptor 3 if one came. */
    int fds[MAX_FDS];
    int n_fds;
};

static char message[ISO_XS_MAX_MESSAGE + 8];
static char *inline_strings[MAX_STRINGS + 1];
static struct request current = {.strings = inline_strings};
/* The bytes of the packet in `message` (a spare monitor is handed them as they came). */
static size_t current_len;

static void close_fds(struct request *req)
{
    for (int i = 0; i < req->n_fds; i++)
        close(req->fds[i]);
    req->n_fds = 0;
}

/* Receive one packet into `current`.  Returns 1 on a request, 0 when the
 * peer hung up, -1 on a malformed packet (its descriptors are closed). */
static int receive_flags(int conn, int flags);

static int receive(int conn)
{
    return receive_flags(conn, 0);
}

/* receive() with recvmsg flags; with MSG_DONTWAIT, -2 when no packet is
 * there yet. */
static int receive_flags(int conn, int flags)
{
    union {
        char buf[CMSG_SPACE(sizeof(int) * MAX_FDS)];
        struct cmsghdr align;
    } control;
    struct iovec iov = {.iov_base = message, .iov_len = ISO_XS_MAX_MESSAGE};
    struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control.buf,
                         .msg_controllen = sizeof control.buf};
    ssize_t n;
    do {
        n = recvmsg(conn, &msg, MSG_CMSG_CLOEXEC | flags);
    } while (n < 0 && errno == EINTR);
    current.n_fds = 0;
    if (n < 0 && (errno == EAGAIN || errno == EWOULDBLOCK) && (flags & MSG_DONTWAIT))
        return -2;
    current_len = n > 0 ? (size_t)n : 0;
    for (struct cmsghdr *c = CMSG_FIRSTHDR(&msg); c; c = CMSG_NXTHDR(&msg, c)) {
        if (c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS)
            continue;
        size_t count = (c->cmsg_len - CMSG_LEN(0)) / sizeof(int);
        for (size_t i = 0; i < count; i++) {
            int fd;
            memcpy(&fd, CMSG_DATA(c) + i * sizeof(int), sizeof fd);
            if (current.n_fds < MAX_FDS)
                current.fds[current.n_fds++] = fd;
            else
                close(fd);
        }
    }
    if (n <= 0) {
        close_fds(&current);
        return 0;
    }
    if ((msg.msg_flags & (MSG_TRUNC | MSG_CTRUNC)) || (size_t)n < sizeof current.head)
        goto malformed;
    memcpy(&current.head, message, sizeof current.head);
    current.strings = inline_strings;
    if (current.head.magic != ISO_XS_MAGIC || current.head.n_argv > current.head.n_strings)
        goto malformed;
    if (current.head.op == ISO_XS_EXEC && (current.head.flags & ISO_XS_F_STRINGS_FD)) {
        /* The strings come in a memfd, which the monitor reads: nothing
         * else may be in the packet, and the memfd must have come. */
        if ((size_t)n != sizeof current.head || current.n_fds < 1 ||
            current.head.n_strings > ISO_XS_MAX_FD_STRINGS)
            goto malformed;
        return 1;
    }
    if (current.head.n_strings > MAX_STRINGS)
        goto malformed;
    /* Every string must end inside the packet. */
    message[n] = 0;
    char *p = message + sizeof current.head, *end = message + n;
    for (uint32_t i = 0; i < current.head.n_strings; i++) {
        char *nul = memchr(p, 0, (size_t)(end - p));
        if (!nul)
            goto malformed;
        current.strings[i] = p;
        p = nul + 1;
    }
    current.strings[current.head.n_strings] = NULL;
    return 1;
malformed:
    close_fds(&current);
    return -1;
}

static int send_reply(int conn, const struct iso_xs_reply *reply, const void *extra, size_t extra_len, int fd)
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

static void reply_kind(int conn, uint32_t kind, int err)
{
    struct iso_xs_reply reply = {.magic = ISO_XS_MAGIC, .kind = kind, .err = err};
    send_reply(conn, &reply, NULL, 0, -1);
}

static void fill_stat(struct iso_xs_stat *out, const struct stat *st)
{
    out->mode = st->st_mode;
    out->uid = st->st_uid;
    out->gid = st->st_gid;
    out->nlink = (uint32_t)st->st_nlink;
    out->size = st->st_size;
    out->mtime_ns = (int64_t)st->st_mtim.tv_sec * 1000000000 + st->st_mtim.tv_nsec;
    out->ino = st->st_ino;
    out->dev = st->st_dev;
}

/* --- file operations ------------------------------------------------------ */

static void do_readdir(int conn, const char *path)
{
    int fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NONBLOCK);
    DIR *dir = fd < 0 ? NULL : fdopendir(fd);
    if (!dir) {
        int err = errno;
        if (fd >= 0)
            close(fd);
        reply_kind(conn, ISO_XS_ERROR, err);
        return;
    }
    static char batch[ISO_XS_MAX_MESSAGE];
    size_t used = 0;
    uint32_t count = 0;
    struct iso_xs_reply reply = {.magic = ISO_XS_MAGIC, .kind = ISO_XS_ENTRIES};
    struct dirent *entry;
    for (;;) {
        errno = 0;
        entry = readdir(dir);
        if (!entry && errno) {
            int err = errno;
            closedir(dir);
            reply_kind(conn, ISO_XS_ERROR, err);
            return;
        }
        size_t name_len = entry ? strlen(entry->d_name) : 0;
        size_t need = (sizeof(struct iso_xs_dirent) + name_len + 1 + 7) & ~(size_t)7;
        if (count && (!entry || used + need > sizeof batch - sizeof reply)) {
            reply.count = count;
            if (send_reply(conn, &reply, batch, used, -1) < 0)
                break;
            used = 0;
            count = 0;
        }
        if (!entry)
            break;
        if (!strcmp(entry->d_name, ".") || !strcmp(entry->d_name, ".."))
            continue;
        struct iso_xs_dirent *out = (struct iso_xs_dirent *)(batch + used);
        memset(out, 0, need);
        struct stat st;
        /* An entry that vanished meanwhile is listed with mode 0. */
        if (fstatat(dirfd(dir), entry->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0)
            fill_stat(&out->st, &st);
        out->name_len = (uint32_t)name_len;
        memcpy((char *)(out + 1), entry->d_name, name_len + 1);
        used += need;
        count++;
    }
    closedir(dir);
    reply_kind(conn, ISO_XS_END, 0);
}

/* The flags the host may ask open() for; the server adds its own. */
#define OPEN_FLAGS (O_ACCMODE | O_CREAT | O_EXCL | O_TRUNC | O_APPEND | O_DIRECTORY | O_NOFOLLOW)

static void do_file_op(int conn, const struct request *req)
{
    const struct iso_xs_request *h = &req->head;
    const char *path = h->n_strings > 0 ? req->strings[0] : NULL;
    const char *other = h->n_strings > 1 ? req->strings[1] : NULL;
    struct iso_xs_reply reply = {.magic = ISO_XS_MAGIC, .kind = ISO_XS_OK};
    struct stat st;
    int rc = -1, fd = -1;
    if (h->op == ISO_XS_PING) {
        reply.pid = getpid();
        send_reply(conn, &reply, NULL, 0, -1);
        return;
    }
    if (!path || !path[0] || ((h->op == ISO_XS_RENAME) && (!other || !other[0]))) {
        reply_kind(conn, ISO_XS_ERROR, EINVAL);
        return;
    }
    switch (h->op) {
    case ISO_XS_OPEN:
        fd = open(path, (h->flags & OPEN_FLAGS) | O_CLOEXEC | O_NOCTTY | O_NONBLOCK, (mode_t)(h->mode & 07777));
        rc = fd < 0 ? -1 : fstat(fd, &st);
        if (rc == 0)
            fill_stat(&reply.st, &st);
        break;
    case ISO_XS_STAT:
    case ISO_XS_LSTAT:
        rc = h->op == ISO_XS_STAT ? stat(path, &st) : lstat(path, &st);
        if (rc == 0)
            fill_stat(&reply.st, &st);
        break;
    case ISO_XS_MKDIR:
        rc = mkdir(path, (mode_t)(h->mode & 07777));
        break;
    case ISO_XS_UNLINK:
        rc = unlink(path);
        break;
    case ISO_XS_RMDIR:
        rc = rmdir(path);
        break;
    case ISO_XS_RENAME:
        rc = (int)syscall(SYS_renameat2, AT_FDCWD, path, AT_FDCWD, other, (unsigned int)h->flags);
        break;
    case ISO_XS_READDIR:
        do_readdir(conn, path);
        return;
    default:
        errno = EINVAL;
    }
    if (rc < 0) {
        int err = errno;
        if (fd >= 0)
            close(fd);
        reply_kind(conn, ISO_XS_ERROR, err);
        return;
    }
    send_reply(conn, &reply, NULL, 0, fd);
    if (fd >= 0)
        close(fd);
}

/* --- commands ------------------------------------------------------------- */

static long long now_ms(void);

static pid_t command;
static int command_reaped;
static int command_status;
static int children_fd = -1; /* /proc/self/task/TID/children of the monitor */
/* The usage of what this monitor reaped for its command: each child's (wait4 gives a child's own and
 * that of what it reaped in turn).  RUSAGE_CHILDREN would count every earlier command of a monitor
 * that serves again (see spare_main). */
static int64_t usage_user_usec, usage_system_usec, usage_maxrss_kib;

static void account(const struct rusage *ru)
{
    usage_user_usec += (int64_t)ru->ru_utime.tv_sec * 1000000 + ru->ru_utime.tv_usec;
    usage_system_usec += (int64_t)ru->ru_stime.tv_sec * 1000000 + ru->ru_stime.tv_usec;
    if (ru->ru_maxrss > usage_maxrss_kib)
        usage_maxrss_kib = ru->ru_maxrss;
}

/* Reap children without blocking; note the command's status. */
static void reap_some(void)
{
    int wstatus;
    pid_t pid;
    struct rusage ru;
    while ((pid = wait4(-1, &wstatus, WNOHANG, &ru)) > 0) {
        account(&ru);
        if (pid == command) {
            command_status = wstatus;
            command_reaped = 1;
        }
    }
}

/* End the command's whole tree: its group, then, round after round, every
 * child of this subreaper (the orphans each round makes come here), each
 * killed one reaped.  A killed process forks no more, so the rounds end. */
static void kill_tree(void)
{
    char buf[4096];
    kill(-command, SIGKILL);
    kill(command, SIGKILL);
    for (int round = 0; round < 100000 && children_fd >= 0; round++) {
        ssize_t n = pread(children_fd, buf, sizeof buf - 1, 0);
        if (n <= 0)
            break;
        buf[n] = 0;
        for (char *p = buf; *p;) {
            char *end;
            long pid = strtol(p, &end, 10);
            if (end == p)
                break;
            kill((pid_t)pid, SIGKILL);
            int wstatus;
            pid_t got;
            struct rusage ru;
            while ((got = wait4((pid_t)pid, &wstatus, 0, &ru)) < 0 && errno == EINTR)
                ;
            if (got > 0)
                account(&ru);
            if (got == command) {
                command_status = wstatus;
                command_reaped = 1;
            }
            p = end;
            while (*p == ' ' || *p == '\n')
                p++;
        }
    }
    if (children_fd < 0 && !command_reaped) {
        /* Without /proc only the group and the command can be named. */
        struct rusage ru;
        pid_t got;
        while ((got = wait4(command, &command_status, 0, &ru)) < 0 && errno == EINTR)
            ;
        if (got > 0)
            account(&ru);
        command_reaped = 1;
    }
}

/* Send sig to every process below pid (not pid itself), depth first. */
static void signal_below(pid_t pid, int sig, int depth)
{
    char path[64], buf[4096];
    if (depth > 64)
        return;
    snprintf(path, sizeof path, "/proc/%d/task/%d/children", (int)pid, (int)pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return;
    ssize_t n = read(fd, buf, sizeof buf - 1);
    close(fd);
    if (n <= 0)
        return;
    buf[n] = 0;
    for (char *p = buf; *p;) {
        char *end;
        long child = strtol(p, &end, 10);
        if (end == p)
            break;
        /* The command is the monitor's child too: it is below it, not "below the command". */
        if ((pid_t)child != command) {
            signal_below((pid_t)child, sig, depth + 1);
            kill((pid_t)child, sig);
        }
        p = end;
        while (*p == ' ' || *p == '\n')
            p++;
    }
}

static void do_signal(int sig, int flags)
{
    if (sig == SIGKILL && !(flags & ISO_XS_F_DESCENDANTS)) {
        kill_tree();
        return;
    }
    if (flags & ISO_XS_F_DESCENDANTS) {
        signal_below(command, sig, 0);
        signal_below(getpid(), sig, 0); /* orphans the command left here */
        return;
    }
    kill(-command, sig); /* the command leads its own group */
}

/* ISO_XS_F_STRINGS_FD: the strings from the request's first descriptor,
 * which is then closed and dropped from its list.  The monitor maps its own
 * copy (no static buffer could hold the kernel's limit), checks that it
 * holds exactly n_strings strings, each ending inside, and points
 * req->strings at them.  0, or an errno. */
static int load_strings(struct request *req)
{
    int fd = req->fds[0];
    memmove(req->fds, req->fds + 1, sizeof(int) * (size_t)(req->n_fds - 1));
    req->n_fds--;
    struct stat st;
    int err = 0;
    if (fstat(fd, &st) < 0) {
        err = errno;
    } else if (!S_ISREG(st.st_mode) || st.st_size <= 0 || st.st_size > ISO_XS_MAX_STRINGS_BYTES) {
        err = E2BIG;
    }
    size_t size = err ? 0 : (size_t)st.st_size;
    size_t n = req->head.n_strings;
    char *text = MAP_FAILED;
    char **strings = MAP_FAILED;
    if (!err) {
        /* One more byte, always 0: a last string without its NUL ends there and is refused below. */
        text = mmap(NULL, size + 1, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        strings = mmap(NULL, (n + 1) * sizeof(char *), PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (text == MAP_FAILED || strings == MAP_FAILED)
            err = ENOMEM;
    }
    for (size_t done = 0; !err && done < size;) {
        ssize_t got = pread(fd, text + done, size - done, (off_t)done);
        if (got < 0 && errno == EINTR)
            continue;
        if (got <= 0)
            err = got < 0 ? errno : EIO;
        else
            done += (size_t)got;
    }
    close(fd);
    char *p = text, *end = text + size;
    for (size_t i = 0; !err && i < n; i++) {
        char *nul = p < end ? memchr(p, 0, (size_t)(end - p)) : NULL;
        if (!nul) {
            err = EINVAL;
            break;
        }
        strings[i] = p;
        p = nul + 1;
    }
    if (!err && p != end)
        err = EINVAL; /* more than n_strings strings: the counts are the host's word, and must agree */
    if (err)
        return err;
    strings[n] = NULL;
    req->strings = strings;
    return 0;
}

/* The command's child: session, terminal, stdio, cwd, exec.  argv is the
 * monitor's NULL-terminated copy of the request's. */
static void start_command(const struct request *req, char **argv, int err_fd)
{
    const struct iso_xs_request *h = &req->head;
    sigset_t none;
    sigemptyset(&none);
    struct iso_failure failure = {.step = ISO_STEP_SETSID, .index = -1};
    /* The server ignores SIGPIPE; a command gets the default back. */
    if (signal(SIGPIPE, SIG_DFL) == SIG_ERR || sigprocmask(SIG_SETMASK, &none, NULL) < 0 || setsid() < 0)
        goto fail;
    failure.step = ISO_STEP_STDIO;
    if ((h->flags & ISO_XS_F_PTY) && ioctl(req->fds[0], TIOCSCTTY, 0) < 0)
        goto fail;
    /* A fourth descriptor is the command's 3 (a persistent shell's status
     * channel).  It and the error pipe are first moved out of the way of
     * the numbers they are about to take. */
    int extra = req->n_fds == 4 ? fcntl(req->fds[3], F_DUPFD_CLOEXEC, 10) : -1;
    if (req->n_fds == 4 && (extra < 0 || (err_fd <= 3 && (err_fd = fcntl(err_fd, F_DUPFD_CLOEXEC, 10)) < 0)))
        goto fail;
    for (int i = 0; i < 3; i++)
        if (dup2(req->fds[i], i) < 0)
            goto fail;
    if (extra >= 0 && dup2(extra, 3) < 0)
        goto fail;
    int keep = extra >= 0 ? 4 : 3;
    if (err_fd > keep)
        syscall(SYS_close_range, (unsigned int)keep, (unsigned int)err_fd - 1, 0);
    syscall(SYS_close_range, (unsigned int)err_fd + 1, ~0U, 0);
    failure.step = ISO_STEP_CHDIR;
    const char *cwd = req->strings[0];
    if (cwd[0] && chdir(cwd) < 0)
        goto fail;
    char *const *envp = req->strings + 1 + h->n_argv;
    const char *search = NULL;
    for (char *const *e = envp; *e; e++)
        if (!strncmp(*e, "PATH=", 5))
            search = *e + 5;
    struct iso_plan plan;
    memset(&plan, 0, sizeof plan);
    plan.program_fd = -1;
    plan.file = argv[0];
    plan.search_path = search ? search : "/usr/local/bin:/usr/bin:/bin";
    plan.argv = argv;
    plan.envp = envp;
    failure.step = iso_exec_program(&plan, 0);
fail:
    failure.err = errno;
    if (write(err_fd, &failure, sizeof failure) < 0) {
        /* The monitor is gone: nobody to tell. */
    }
    _exit(127);
}

static void send_exited(int conn, int reason)
{
    struct iso_xs_reply reply = {.magic = ISO_XS_MAGIC, .kind = ISO_XS_EXITED, .pid = command,
                                 .wait_status = command_status, .reason = reason,
                                 .user_usec = usage_user_usec, .system_usec = usage_system_usec,
                                 .maxrss_kib = usage_maxrss_kib};
    send_reply(conn, &reply, NULL, 0, -1);
}

/* What a monitor sets up before it starts its command: it becomes a
 * subreaper, opens its list of children, its SIGCHLD signalfd and the
 * command's error pipe.  A spare monitor does this while it waits, off the
 * path of the command it will start.  An error is kept in monitor_err and
 * answered to the command's request. */
static int monitor_sigfd = -1;
/* A waiting monitor's socket to the server (spare_main); -1 in one forked for one command. */
static int monitor_chan = -1;
static int monitor_err_pipe[2] = {-1, -1};
static int monitor_err;

static void monitor_prepare(void)
{
    if (prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) < 0) {
        monitor_err = errno;
        return;
    }
    char path[64];
    snprintf(path, sizeof path, "/proc/self/task/%d/children", (int)getpid());
    children_fd = open(path, O_RDONLY | O_CLOEXEC); /* optional: without it kill_tree names fewer */
    sigset_t mask;
    sigemptyset(&mask);
    sigaddset(&mask, SIGCHLD);
    monitor_sigfd = signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
    if (monitor_sigfd < 0 || pipe2(monitor_err_pipe, O_CLOEXEC) < 0)
        monitor_err = errno;
}

/* 1 when this process has no child at all, alive or not yet reaped (none is reaped here). */
static int childless(void)
{
    siginfo_t info;
    memset(&info, 0, sizeof info);
    return waitid(P_ALL, 0, &info, WEXITED | WNOHANG | WNOWAIT) < 0 && errno == ECHILD;
}

/* A monitor: owns conn and one command, until the command has ended.
 * Returns (conn closed) only when this process may serve another command
 * (see spare_main): its command exited by itself, leaving nothing running
 * below it, so that whatever it reaps or kills from now on is the next
 * command's.  Otherwise it exits. */
static void monitor(int conn, struct request *req)
{
    const struct iso_xs_request *h = &req->head;
    int64_t timeout_ms = h->timeout_ms; /* req is `current`, which the loop below reuses */
    int late_started = (h->flags & ISO_XS_F_LATE_STARTED) != 0;
    /* A terminal's master and a strings mapping are not undone here: such a command's monitor exits. */
    int may_serve_again = !(h->flags & (ISO_XS_F_PTY | ISO_XS_F_STRINGS_FD));
    command = 0;
    command_reaped = 0;
    command_status = 0;
    usage_user_usec = usage_system_usec = usage_maxrss_kib = 0;
    if (h->flags & ISO_XS_F_STRINGS_FD) {
        int err = load_strings(req);
        if (err) {
            reply_kind(conn, ISO_XS_ERROR, err);
            _exit(0);
        }
    }
    /* stdin, stdout and stderr unless the command gets a terminal, then
     * optionally the command's descriptor 3. */
    int stdio_fds = (h->flags & ISO_XS_F_PTY) ? 0 : 3;
    if ((req->n_fds != stdio_fds && req->n_fds != stdio_fds + 1) || h->n_argv < 1 || h->n_strings < h->n_argv + 1) {
        reply_kind(conn, ISO_XS_ERROR, EINVAL);
        _exit(0);
    }
    /* A terminal is made here, in the sandbox's own devpts, so that the
     * command's tty has a name inside (ttyname, `tty`, ssh and sudo need
     * one); the host gets the master side with STARTED. */
    int master = -1;
    if (h->flags & ISO_XS_F_PTY) {
        int unlock = 0;
        master = open("/dev/ptmx", O_RDWR | O_NOCTTY | O_CLOEXEC);
        if (master < 0 || ioctl(master, TIOCSPTLCK, &unlock) < 0) {
            reply_kind(conn, ISO_XS_ERROR, errno);
            _exit(0);
        }
        /* TIOCGPTPEER (4.13): the slave from the master, not from a path. */
        int slave = ioctl(master, TIOCGPTPEER, O_RDWR | O_NOCTTY | O_CLOEXEC);
        if (slave < 0) {
            reply_kind(conn, ISO_XS_ERROR, errno);
            _exit(0);
        }
        if (req->n_fds == 1)
            req->fds[3] = req->fds[0];
        req->fds[0] = slave;
        req->fds[1] = fcntl(slave, F_DUPFD_CLOEXEC, 0);
        req->fds[2] = fcntl(slave, F_DUPFD_CLOEXEC, 0);
        req->n_fds += 3;
        if (req->fds[1] < 0 || req->fds[2] < 0) {
            reply_kind(conn, ISO_XS_ERROR, errno);
            _exit(0);
        }
    }
    if (monitor_sigfd < 0 && !monitor_err)
        monitor_prepare();
    if (monitor_err) {
        reply_kind(conn, ISO_XS_ERROR, monitor_err);
        _exit(0);
    }
    int sigfd = monitor_sigfd;
    int err_pipe[2] = {monitor_err_pipe[0], monitor_err_pipe[1]};
    /* argv ends where the environment begins: copied out, NULL-terminated,
     * here (the vfork child allocates nothing). */
    static char *inline_argv[MAX_STRINGS + 1];
    char **argv = inline_argv;
    if (h->n_argv > MAX_STRINGS) {
        argv = mmap(NULL, ((size_t)h->n_argv + 1) * sizeof(char *), PROT_READ | PROT_WRITE,
                    MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (argv == MAP_FAILED) {
            reply_kind(conn, ISO_XS_ERROR, ENOMEM);
            _exit(0);
        }
    }
    memcpy(argv, req->strings + 1, sizeof(char *) * h->n_argv);
    argv[h->n_argv] = NULL;
    /* vfork: the child only sets up its session, stdio and cwd, then execs
     * (or reports and _exits), so nothing of this process need be copied. */
    command = vfork();
    if (command < 0) {
        reply_kind(conn, ISO_XS_ERROR, errno);
        _exit(0);
    }
    if (command == 0) {
        close(err_pipe[0]);
        start_command(req, argv, err_pipe[1]);
    }
    close(err_pipe[1]);
    monitor_err_pipe[1] = -1;
    close_fds(req);
    struct iso_failure failure;
    ssize_t got;
    do {
        got = read(err_pipe[0], &failure, sizeof failure);
    } while (got < 0 && errno == EINTR);
    close(err_pipe[0]);
    monitor_err_pipe[0] = -1;
    if (got == (ssize_t)sizeof failure) {
        while (waitpid(command, NULL, 0) < 0 && errno == EINTR)
            ;
        struct iso_xs_reply reply = {.magic = ISO_XS_MAGIC, .kind = ISO_XS_ERROR, .err = failure.err,
                                     .step = failure.step};
        send_reply(conn, &reply, NULL, 0, -1);
        _exit(0);
    }
    struct iso_xs_reply started = {.magic = ISO_XS_MAGIC, .kind = ISO_XS_STARTED, .pid = command};
    /* ISO_XS_F_LATE_STARTED (never with a terminal, whose master goes with STARTED): most commands
     * are short, and their EXITED, which carries the pid, says that they started; STARTED then
     * would only wake the host once more.  One that outlasts ISO_XS_STARTED_AFTER_MS gets it then,
     * well within the host's wait for it. */
    long long started_due = -1;
    if (late_started && master < 0) {
        started_due = now_ms() + ISO_XS_STARTED_AFTER_MS;
    } else {
        send_reply(conn, &started, NULL, 0, master);
        if (master >= 0)
            close(master); /* the host holds it now; the command's side stays open in the command */
    }

    int timer = -1;
    if (timeout_ms > 0) {
        timer = timerfd_create(CLOCK_MONOTONIC, TFD_CLOEXEC);
        struct itimerspec when = {
            .it_value = {.tv_sec = timeout_ms / 1000, .tv_nsec = (timeout_ms % 1000) * 1000000}};
        if (timer < 0 || timerfd_settime(timer, 0, &when, NULL) < 0) {
            kill_tree();
            send_exited(conn, ISO_XS_REASON_KILLED);
            _exit(0);
        }
    }
    int reason = ISO_XS_REASON_EXITED;
    reap_some();
    while (!command_reaped) {
        struct pollfd fds[3] = {{.fd = sigfd, .events = POLLIN}, {.fd = conn, .events = POLLIN},
                                {.fd = timer, .events = POLLIN}};
        int wait_ms = -1;
        if (started_due >= 0) {
            long long left = started_due - now_ms();
            if (left <= 0) {
                send_reply(conn, &started, NULL, 0, -1);
                started_due = -1;
                continue;
            }
            wait_ms = (int)left;
        }
        if (poll(fds, 3, wait_ms) < 0) {
            if (errno == EINTR)
                continue;
            kill_tree();
            reason = ISO_XS_REASON_KILLED;
            break;
        }
        if (fds[0].revents & POLLIN) {
            struct signalfd_siginfo info;
            while (read(sigfd, &info, sizeof info) == (ssize_t)sizeof info)
                ;
            reap_some();
        }
        if (fds[2].revents & POLLIN) {
            reason = ISO_XS_REASON_TIMEOUT;
            kill_tree();
        }
        if (fds[1].revents & (POLLIN | POLLHUP | POLLERR)) {
            int r = receive(conn);
            if (r == 0) {
                /* The host hung up: nobody waits for this command any more. */
                reason = ISO_XS_REASON_KILLED;
                kill_tree();
                _exit(0);
            }
            if (r > 0 && current.head.op == ISO_XS_SIGNAL) {
                if (current.head.mode == SIGKILL && !(current.head.flags & ISO_XS_F_DESCENDANTS))
                    reason = ISO_XS_REASON_KILLED;
                do_signal(current.head.mode, current.head.flags);
            }
            if (r > 0)
                close_fds(&current);
        }
    }
    if (reason != ISO_XS_REASON_EXITED)
        kill_tree(); /* the last round: anything forked meanwhile */
    /* Serving again is decided, and said to the server (spare_main's
     * socket), before EXITED: the host's next command, sent once it has
     * EXITED, then finds this monitor waiting rather than none, and
     * waits in the socket until this one is done here.  With its command
     * reaped and no child at all, nothing of this command can appear
     * below this process any more. */
    int again = reason == ISO_XS_REASON_EXITED && may_serve_again && monitor_chan >= 0 && childless() &&
                write(monitor_chan, "", 1) == 1;
    send_exited(conn, reason);
    /* A request that crossed the end (a kill sent as the command exited)
     * is read and dropped: a unix socket closed with unread data resets
     * its peer, which is then told that error before the EXITED above. */
    int r;
    while ((r = receive_flags(conn, MSG_DONTWAIT)) != 0 && r != -2) /* MSG_DONTWAIT: no fcntl pair */
        close_fds(&current);
    if (!again)
        _exit(0); /* what the command left goes to the sandbox's init with this process's end */
    if (timer >= 0)
        close(timer);
    close(conn);
}

/* --- the server ----------------------------------------------------------- */

static int peer_allowed(int conn, uid_t peer_uid)
{
    struct ucred cred;
    socklen_t len = sizeof cred;
    if (getsockopt(conn, SOL_SOCKET, SO_PEERCRED, &cred, &len) < 0)
        return 0;
    /* pid 0: the peer is not in this PID namespace (nor below it). */
    return cred.pid == 0 && cred.uid == peer_uid;
}

/* A listening socket at path (the container case): the old socket, left
 * by an earlier start of the same container, is replaced. */
static int listen_at(const char *path)
{
    struct sockaddr_un addr = {.sun_family = AF_UNIX};
    size_t len = strlen(path);
    if (len >= sizeof addr.sun_path) {
        errno = ENAMETOOLONG;
        return -1;
    }
    memcpy(addr.sun_path, path, len + 1);
    int fd = socket(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0);
    if (fd < 0)
        return -1;
    if (unlink(path) < 0 && errno != ENOENT) {
        close(fd);
        return -1;
    }
    mode_t old = umask(0177);
    int rc = bind(fd, (struct sockaddr *)&addr, sizeof addr);
    umask(old);
    if (rc < 0 || listen(fd, 64) < 0) {
        close(fd);
        return -1;
    }
    return fd;
}

/* The server's state: its listener, SIGCHLD signalfd and connections. */
static int listener = -1, server_sigfd = -1;
static int clients[MAX_CLIENTS];
static int n_clients, running;

/* The server's monitors: those running a command, and (with SPARE) those
 * waiting for one.  chan is the server's end of a socketpair to the
 * monitor; -1 for one forked without (no spares wanted). */
struct monitor_ref {
    pid_t pid;
    int chan;
};
static struct monitor_ref monitors[MAX_MONITORS];
static int n_monitors;
/* Waiting monitors kept at most: two serve commands run one after the
 * other and a second one beside, with no fork; more would only hold
 * processes (and memory) of the sandbox. */
#define MAX_IDLE 2
static struct monitor_ref idle[MAX_IDLE];
static int n_idle;

static int find_ref(const struct monitor_ref *list, int n, pid_t pid)
{
    for (int i = 0; i < n; i++)
        if (list[i].pid == pid)
            return i;
    return -1;
}

static int is_monitor(pid_t pid)
{
    return find_ref(monitors, n_monitors, pid) >= 0 || find_ref(idle, n_idle, pid) >= 0;
}

/* Drop list[i] (its chan closed). */
static void drop_ref(struct monitor_ref *list, int *n, int i)
{
    if (list[i].chan >= 0)
        close(list[i].chan);
    list[i] = list[--*n];
}

/* pid has ended: 1 when it was running a command (now forgotten), 0 for a
 * waiting monitor (forgotten too) or an orphan. */
static int forget_monitor(pid_t pid)
{
    int i = find_ref(idle, n_idle, pid);
    if (i >= 0) {
        drop_ref(idle, &n_idle, i);
        return 0;
    }
    i = find_ref(monitors, n_monitors, pid);
    if (i < 0)
        return 0;
    drop_ref(monitors, &n_monitors, i);
    return 1;
}

/* --- waiting monitors -------------------------------------------------------
 *
 * fork() of the server and the monitor's own set-up cost a command's start
 * about as much as its exec, and the monitor's exit and reaping as much
 * again.  With SPARE set, the server keeps a monitor forked and prepared
 * ahead, waiting on a socketpair: an EXEC request is handed to it as it
 * came (the connection, then the packet with its descriptors).  When its
 * command has exited by itself and left no process behind (the monitor has
 * no child at all), the monitor says so on the socketpair and waits for the
 * next one: a command that follows another costs no fork.  One that
 * leaves processes behind, times out, is killed, or has a terminal ends its
 * monitor as before (what it left goes to the sandbox's init).
 *
 * A waiting monitor is a process of the sandbox like any monitor (it counts
 * towards a process limit: the host asks for no spare when the policy has
 * one).  One that is gone (a process of the sandbox, same uid, can kill it)
 * is seen when the hand-over fails: the server then starts another. */
static int spares_wanted;

static void spare_main(int chan)
{
    monitor_prepare();
    monitor_chan = chan;
    for (;;) {
        char byte;
        struct iovec iov = {.iov_base = &byte, .iov_len = 1};
        union {
            char buf[CMSG_SPACE(sizeof(int))];
            struct cmsghdr align;
        } control;
        struct msghdr msg = {.msg_iov = &iov, .msg_iovlen = 1, .msg_control = control.buf,
                             .msg_controllen = sizeof control.buf};
        ssize_t n;
        do {
            n = recvmsg(chan, &msg, MSG_CMSG_CLOEXEC);
        } while (n < 0 && errno == EINTR);
        struct cmsghdr *c = n > 0 ? CMSG_FIRSTHDR(&msg) : NULL;
        if (!c || c->cmsg_level != SOL_SOCKET || c->cmsg_type != SCM_RIGHTS ||
            c->cmsg_len != CMSG_LEN(sizeof(int)))
            _exit(0); /* the server is gone, keeps enough waiting, or did not hand a connection */
        int conn;
        memcpy(&conn, CMSG_DATA(c), sizeof conn);
        int r = receive(chan);
        /* Taken: from here on this process answers conn.  Until the server
         * reads this byte it keeps the request, and starts the command itself
         * if this process ends first (it was killed). */
        if (write(chan, "", 1) != 1)
            _exit(0);
        if (r <= 0 || current.head.op != ISO_XS_EXEC) {
            close_fds(&current);
            reply_kind(conn, ISO_XS_ERROR, EPROTO);
            _exit(0);
        }
        monitor(conn, &current); /* returns only when this process may serve again (it told the server) */
        /* The next command's error pipe; without one, the server's next hand-over fails and it starts
         * another monitor. */
        if (pipe2(monitor_err_pipe, O_CLOEXEC) < 0)
            _exit(0);
    }
}

/* In a child of the server: close what only the server may hold (the
 * listener, its signalfd, the other connections, the other monitors'
 * sockets), all but keep. */
static void close_server_fds(int keep)
{
    close(listener);
    close(server_sigfd);
    for (int j = 0; j < n_clients; j++)
        if (clients[j] != keep)
            close(clients[j]);
    for (int j = 0; j < n_idle; j++)
        close(idle[j].chan);
    for (int j = 0; j < n_monitors; j++)
        if (monitors[j].chan >= 0)
            close(monitors[j].chan);
}

/* Fork a waiting monitor into idle[]; without one (fork failed), monitors
 * are forked per command. */
static void make_spare(void)
{
    int pair[2];
    if (n_idle >= MAX_IDLE || socketpair(AF_UNIX, SOCK_SEQPACKET | SOCK_CLOEXEC, 0, pair) < 0)
        return;
    pid_t pid = fork();
    if (pid == 0) {
        close(pair[0]);
        close_server_fds(-1);
        spare_main(pair[1]);
    }
    close(pair[1]);
    if (pid < 0) {
        close(pair[0]);
        return;
    }
    idle[n_idle++] = (struct monitor_ref){.pid = pid, .chan = pair[0]};
}

static int send_fds(int fd, const void *data, size_t len, const int *fds, int n_fds)
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

/* Wait for the monitor's word that it took the request: 1, or 0 when it
 * ended first (or did not answer in 10 s: it is then killed).  One stopped
 * meanwhile is continued, as the main loop continues monitors. */
static int spare_took_it(struct monitor_ref m)
{
    for (int round = 0; round < 1000; round++) {
        struct pollfd p = {.fd = m.chan, .events = POLLIN};
        int n = poll(&p, 1, 10);
        if (n < 0 && errno != EINTR)
            break;
        if (n > 0) {
            char byte;
            ssize_t got;
            do {
                got = read(m.chan, &byte, 1);
            } while (got < 0 && errno == EINTR);
            return got == 1;
        }
        int wstatus;
        if (waitpid(m.pid, &wstatus, WNOHANG | WUNTRACED) == m.pid && WIFSTOPPED(wstatus))
            kill(m.pid, SIGCONT);
    }
    kill(m.pid, SIGKILL);
    return 0;
}

/* Hand conn and `current` to a waiting monitor: it (now the caller's), or
 * pid -1 (none, or each ended before it took the request, which is then
 * still the server's). */
static struct monitor_ref hand_to_spare(int conn)
{
    while (n_idle > 0) {
        struct monitor_ref m = idle[--n_idle];
        char byte = 0;
        if (send_fds(m.chan, &byte, 1, &conn, 1) == 0 &&
            send_fds(m.chan, message, current_len, current.fds, current.n_fds) == 0 && spare_took_it(m))
            return m;
        kill(m.pid, SIGKILL); /* it must not answer conn: another one does */
        close(m.chan);
    }
    return (struct monitor_ref){.pid = -1, .chan = -1};
}

/* A running monitor's word on its socket: it is waiting again (kept, or
 * let go when enough wait), or it has ended (its socket hung up). */
static void monitor_spoke(pid_t pid)
{
    int i = find_ref(monitors, n_monitors, pid);
    if (i < 0)
        return;
    char byte;
    ssize_t got;
    do {
        got = read(monitors[i].chan, &byte, 1);
    } while (got < 0 && errno == EINTR);
    if (got != 1) {
        close(monitors[i].chan); /* its end comes as SIGCHLD */
        monitors[i].chan = -1;
        return;
    }
    if (n_idle < MAX_IDLE) {
        idle[n_idle++] = monitors[i];
        monitors[i] = monitors[--n_monitors];
    } else {
        drop_ref(monitors, &n_monitors, i); /* its recvmsg sees the hang-up: it exits */
    }
    running--;
}

/* Whether a running monitor may come back to wait (then none is forked ahead). */
static int one_may_come_back(void)
{
    for (int i = 0; i < n_monitors; i++)
        if (monitors[i].chan >= 0)
            return 1;
    return 0;
}

static long long now_ms(void)
{
    struct timespec t;
    /* CLOCK_MONOTONIC is always there; were it not, time would stand still (no idle end, a late STARTED
     * never sent: EXITED still says that the command started). */
    if (clock_gettime(CLOCK_MONOTONIC, &t) < 0)
        return 0;
    return (long long)t.tv_sec * 1000 + t.tv_nsec / 1000000;
}


/* Answer the request just received on conn (r: what receive() returned).
 * 1 when conn is done with here (an EXEC handed it to a monitor, or the
 * peer hung up): the caller drops it from the clients. */
static int serve(int conn, int r)
{
    if (r == 0)
        return 1;
    if (r < 0) {
        reply_kind(conn, ISO_XS_ERROR, EPROTO);
        return 0;
    }
    if (current.head.op != ISO_XS_EXEC) {
        do_file_op(conn, &current);
        close_fds(&current);
        return 0;
    }
    /* The command's conversation: this connection, or (ISO_XS_F_CONVERSATION)
     * the socket that came first, which is then taken off the request's
     * descriptors; this connection goes on with its file operations. */
    int conv = conn;
    if (current.head.flags & ISO_XS_F_CONVERSATION) {
        int type = 0;
        socklen_t len = sizeof type;
        if (current.n_fds < 1 || getsockopt(current.fds[0], SOL_SOCKET, SO_TYPE, &type, &len) < 0 ||
            type != SOCK_SEQPACKET) {
            close_fds(&current);
            reply_kind(conn, ISO_XS_ERROR, EPROTO); /* the host reads no reply here: it ends this connection */
            return 1;
        }
        conv = current.fds[0];
        memmove(current.fds, current.fds + 1, sizeof(int) * (size_t)(current.n_fds - 1));
        current.n_fds--;
    }
    struct monitor_ref m = {.pid = -1, .chan = -1};
    if (n_monitors < MAX_MONITORS) {
        m = hand_to_spare(conv);
        if (m.pid < 0 && spares_wanted) {
            /* None waiting (another command runs): one forked now, which may
             * then wait for the next command in its turn. */
            make_spare();
            m = hand_to_spare(conv);
        }
        if (m.pid < 0)
            m.pid = fork();
    } else {
        errno = EAGAIN;
    }
    if (m.pid == 0) {
        close_server_fds(conv);
        if (conv != conn)
            close(conn); /* not among the clients yet when it was just accepted */
        monitor(conv, &current);
        _exit(0); /* forked for this command alone */
    }
    if (m.pid < 0) {
        reply_kind(conv, ISO_XS_ERROR, errno);
    } else {
        monitors[n_monitors++] = m;
        running++;
    }
    close_fds(&current);
    if (conv != conn) {
        close(conv); /* the monitor has it */
        return 0;
    }
    return 1;
}

int iso_exec_server_main(int argc, char **argv)
{
    if (argc < 4)
        return 125;
    uid_t peer_uid = (uid_t)strtoul(argv[2], NULL, 10);
    long long idle_ms = atoll(argv[3]);
    long long ttl_ms = argc > 4 ? atoll(argv[4]) : 0;
    spares_wanted = argc > 5 && atoi(argv[5]) == 1;
    long long started = now_ms();
    listener = argv[1][0] == '/' ? listen_at(argv[1]) : atoi(argv[1]);
    if (listener < 0)
        return 125;
    /* Not dumpable: a process of the sandbox, same uid, cannot ptrace this
     * one or take its descriptors (the host's connections among them). */
    if (prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) < 0)
        return 125;
    signal(SIGPIPE, SIG_IGN);
    sigset_t mask;
    sigemptyset(&mask);
    sigaddset(&mask, SIGCHLD);
    if (sigprocmask(SIG_BLOCK, &mask, NULL) < 0)
        return 125;
    int sigfd = server_sigfd = signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
    if (sigfd < 0 || fcntl(listener, F_SETFD, FD_CLOEXEC) < 0)
        return 125;

    long long idle_since = now_ms();
    for (;;) {
        /* One waiting ahead of the next command, unless a running one will come back to wait. */
        if (spares_wanted && n_idle == 0 && !one_may_come_back() && n_monitors < MAX_MONITORS - 1)
            make_spare();
        /* The listener, the signalfd, the connections, then the running monitors' sockets. */
        static struct pollfd fds[2 + MAX_CLIENTS + MAX_MONITORS];
        static pid_t speakers[MAX_MONITORS];
        fds[0] = (struct pollfd){.fd = n_clients < MAX_CLIENTS ? listener : -1, .events = POLLIN};
        fds[1] = (struct pollfd){.fd = sigfd, .events = POLLIN};
        for (int i = 0; i < n_clients; i++)
            fds[2 + i] = (struct pollfd){.fd = clients[i], .events = POLLIN};
        int n_speakers = 0;
        for (int i = 0; i < n_monitors; i++) {
            if (monitors[i].chan < 0)
                continue;
            fds[2 + n_clients + n_speakers] = (struct pollfd){.fd = monitors[i].chan, .events = POLLIN};
            speakers[n_speakers++] = monitors[i].pid;
        }
        int first_speaker = 2 + n_clients;
        /* The nearest end: idleness (when nothing runs) or the ttl. */
        int bounded = 0;
        long long left = 0;
        if (idle_ms > 0 && n_clients == 0 && running == 0) {
            left = idle_since + idle_ms - now_ms();
            bounded = 1;
        }
        if (ttl_ms > 0) {
            long long ttl_left = started + ttl_ms - now_ms();
            if (!bounded || ttl_left < left)
                left = ttl_left;
            bounded = 1;
        }
        int wait_ms = -1;
        if (bounded) {
            if (left <= 0)
                return 0;
            wait_ms = left > 1000000 ? 1000000 : (int)left;
        }
        int ready = poll(fds, (nfds_t)(first_speaker + n_speakers), wait_ms);
        if (ready < 0) {
            if (errno == EINTR)
                continue;
            return 125;
        }
        if (fds[1].revents & POLLIN) {
            struct signalfd_siginfo info;
            while (read(sigfd, &info, sizeof info) == (ssize_t)sizeof info)
                ;
            /* A command shares the monitor's uid and Landlock domain, so it
             * can SIGSTOP its monitor, which would then enforce neither its
             * timeout nor a kill: a stopped monitor is continued at once. */
            int wstatus;
            pid_t child;
            while ((child = waitpid(-1, &wstatus, WNOHANG | WUNTRACED)) > 0) {
                if (WIFSTOPPED(wstatus)) {
                    if (is_monitor(child)) /* an orphan of the program may stay stopped */
                        kill(child, SIGCONT);
                } else if (forget_monitor(child)) { /* a waiting one killed: the next is forked before the next poll */
                    running--;
                }
            }
            if (running < 0)
                running = 0;
            if (running == 0)
                idle_since = now_ms();
        }
        /* Before the new requests: a monitor waiting again takes the next command. */
        for (int i = 0; ready > 0 && i < n_speakers; i++) {
            if (fds[first_speaker + i].revents) {
                monitor_spoke(speakers[i]);
                if (running == 0)
                    idle_since = now_ms();
            }
        }
        int polled = ready > 0 ? n_clients : 0;
        if (fds[0].revents & POLLIN) {
            int conn = accept4(listener, NULL, NULL, SOCK_CLOEXEC);
            if (conn >= 0 && !peer_allowed(conn, peer_uid)) {
                close(conn);
                conn = -1;
            }
            if (conn >= 0) {
                /* The host sends its request right after it connects: it
                 * is usually there already, and is answered without
                 * another round of poll. */
                int r = receive_flags(conn, MSG_DONTWAIT);
                if (r == -2 || !serve(conn, r))
                    clients[n_clients++] = conn;
                else
                    close(conn);
            }
        }
        /* The clients polled this round, last first: a dropped one is
         * replaced by the last, which was either seen already or is the
         * one just accepted (not polled yet: its fds entry is not looked at). */
        for (int i = polled - 1; i >= 0; i--) {
            if (fds[2 + i].fd != clients[i] || !fds[2 + i].revents)
                continue;
            int conn = clients[i];
            int drop = serve(conn, receive(conn));
            if (drop) {
                close(conn);
                clients[i] = clients[--n_clients];
            }
        }
        if (n_clients > 0 || running > 0)
            idle_since = now_ms();
    }
}
