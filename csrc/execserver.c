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
 *     the background goes on running, as on any machine.  A detached
 *     command (ISO_XS_F_DETACHED) outlives its host's hanging up, and its
 *     monitor then stays the subreaper of what it left until all of it has
 *     ended (counted as running meanwhile): the host ends all of it from
 *     outside, as the monitor's descendants.
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
 *
 * The parts, behind execserver.h: xs_wire.c (packets), xs_files.c (file
 * operations), xs_monitor.c (a command's monitor), xs_keep.c (descriptors
 * the host leaves here across its own restart); this file is the server
 * (its loop, its connections, its waiting monitors).
 */

#define _GNU_SOURCE
#include "execserver.h"

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
    xs_monitor_prepare();
    xs_monitor_chan = chan;
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
        int r = xs_receive(chan);
        /* Taken: from here on this process answers conn.  Until the server
         * reads this byte it keeps the request, and starts the command itself
         * if this process ends first (it was killed). */
        if (write(chan, "", 1) != 1)
            _exit(0);
        if (r <= 0 || xs_current.head.op != ISO_XS_EXEC) {
            xs_close_fds(&xs_current);
            xs_reply_kind(conn, ISO_XS_ERROR, EPROTO);
            _exit(0);
        }
        xs_monitor(conn, &xs_current); /* returns only when this process may serve again (it told the server) */
        /* The next command's error pipe; without one, the server's next hand-over fails and it starts
         * another monitor. */
        if (pipe2(xs_monitor_err_pipe, O_CLOEXEC) < 0)
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
    xs_keep_close_all(); /* a monitor holding a shell's far ends would outlive its use of them */
}

#ifndef SYS_close_range
#define SYS_close_range 436
#endif

/* In a waiting monitor just forked: close every descriptor but stdio and
 * its channel.  It may be forked in the middle of a request (serve(), none
 * waiting), when this process holds that request's descriptors: its
 * conversation, the command's pipes, a passed socket.  A monitor lives on
 * from command to command, and a copy of those would keep them open for
 * ever (a pipe or socket whose far end never sees its end).  Before Linux
 * 5.9 (no close_range) each is closed in turn up to the descriptor limit. */
static void spare_close_others(int chan)
{
    if (chan > 3 && syscall(SYS_close_range, 3U, (unsigned int)chan - 1, 0) < 0)
        for (int fd = 3; fd < chan; fd++)
            close(fd);
    if (syscall(SYS_close_range, (unsigned int)chan + 1, ~0U, 0) < 0) {
        struct rlimit most;
        rlim_t end = getrlimit(RLIMIT_NOFILE, &most) == 0 && most.rlim_cur != RLIM_INFINITY &&
                             most.rlim_cur < (1U << 20) ? most.rlim_cur : 4096;
        for (rlim_t fd = (rlim_t)chan + 1; fd < end; fd++)
            close((int)fd);
    }
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
        spare_close_others(pair[1]);
        spare_main(pair[1]);
    }
    close(pair[1]);
    if (pid < 0) {
        close(pair[0]);
        return;
    }
    idle[n_idle++] = (struct monitor_ref){.pid = pid, .chan = pair[0]};
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
        if (xs_send_fds(m.chan, &byte, 1, &conn, 1) == 0 &&
            xs_send_fds(m.chan, xs_message, xs_current_len, xs_current.fds, xs_current.n_fds) == 0 && spare_took_it(m))
            return m;
        kill(m.pid, SIGKILL); /* it must not answer conn: another one does */
        close(m.chan);
    }
    return (struct monitor_ref){.pid = -1, .chan = -1};
}

/* What monitors[i] said on its socket, read with flags (MSG_DONTWAIT:
 * perhaps nothing yet, then 0): it is waiting again (kept, or let go when
 * enough wait), or it has ended (its socket hung up).  1 when it spoke. */
static int monitor_spoke_at(int i, int flags)
{
    char byte;
    ssize_t got;
    do {
        got = recv(monitors[i].chan, &byte, 1, flags);
    } while (got < 0 && errno == EINTR);
    if (got < 0 && (flags & MSG_DONTWAIT) && (errno == EAGAIN || errno == EWOULDBLOCK))
        return 0;
    if (got != 1) {
        close(monitors[i].chan); /* its end comes as SIGCHLD */
        monitors[i].chan = -1;
        return 1;
    }
    if (n_idle < MAX_IDLE) {
        idle[n_idle++] = monitors[i];
        monitors[i] = monitors[--n_monitors];
    } else {
        drop_ref(monitors, &n_monitors, i); /* its recvmsg sees the hang-up: it exits */
    }
    running--;
    return 1;
}

static void monitor_spoke(pid_t pid)
{
    int i = find_ref(monitors, n_monitors, pid);
    if (i >= 0)
        monitor_spoke_at(i, 0);
}

/* The running monitors' words that came meanwhile, read without waiting.
 * While a host is connected the server does not poll their sockets (see
 * the main loop): a monitor says it waits again just before its EXITED,
 * and the host's next command is what needs it, so the word is read then,
 * with that request, and costs the server no wake-up of its own.  Last
 * first: one that spoke is replaced by the last, seen already. */
static void collect_spoken(void)
{
    for (int i = n_monitors - 1; i >= 0; i--)
        if (monitors[i].chan >= 0)
            monitor_spoke_at(i, MSG_DONTWAIT);
}

/* Whether a running monitor may come back to wait (then none is forked ahead). */
static int one_may_come_back(void)
{
    for (int i = 0; i < n_monitors; i++)
        if (monitors[i].chan >= 0)
            return 1;
    return 0;
}

/* Answer the request just received on conn (r: what xs_receive() returned).
 * 1 when conn is done with here (an EXEC handed it to a monitor, or the
 * peer hung up): the caller drops it from the clients. */
static int serve(int conn, int r)
{
    if (r == 0)
        return 1;
    if (r < 0) {
        xs_reply_kind(conn, ISO_XS_ERROR, EPROTO);
        return 0;
    }
    if (xs_current.head.op == ISO_XS_KEEP || xs_current.head.op == ISO_XS_TAKE) {
        xs_keep_op(conn, &xs_current);
        xs_close_fds(&xs_current);
        return 0;
    }
    if (xs_current.head.op != ISO_XS_EXEC) {
        xs_file_op(conn, &xs_current);
        xs_close_fds(&xs_current);
        return 0;
    }
    /* The command's conversation: this connection, or (ISO_XS_F_CONVERSATION)
     * the socket that came first, which is then taken off the request's
     * descriptors; this connection goes on with its file operations. */
    int conv = conn;
    if (xs_current.head.flags & ISO_XS_F_CONVERSATION) {
        int type = 0;
        socklen_t len = sizeof type;
        if (xs_current.n_fds < 1 || getsockopt(xs_current.fds[0], SOL_SOCKET, SO_TYPE, &type, &len) < 0 ||
            type != SOCK_SEQPACKET) {
            xs_close_fds(&xs_current);
            xs_reply_kind(conn, ISO_XS_ERROR, EPROTO); /* the host reads no reply here: it ends this connection */
            return 1;
        }
        conv = xs_current.fds[0];
        memmove(xs_current.fds, xs_current.fds + 1, sizeof(int) * (size_t)(xs_current.n_fds - 1));
        xs_current.n_fds--;
        if ((xs_current.head.flags & ISO_XS_F_STRINGS_FD) && xs_current.n_fds < 1) {
            /* wire.c's check that the memfd came counted the conversation */
            xs_close_fds(&xs_current);
            xs_reply_kind(conv, ISO_XS_ERROR, EPROTO);
            close(conv);
            return 0;
        }
    }
    struct monitor_ref m = {.pid = -1, .chan = -1};
    if (n_idle == 0 || n_monitors >= MAX_MONITORS) /* the monitors that wait again, not yet read */
        collect_spoken();
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
        xs_monitor(conv, &xs_current);
        _exit(0); /* forked for this command alone */
    }
    if (m.pid < 0) {
        xs_reply_kind(conv, ISO_XS_ERROR, errno);
    } else {
        monitors[n_monitors++] = m;
        running++;
    }
    xs_close_fds(&xs_current);
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
    long long started = xs_now_ms();
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

    long long idle_since = xs_now_ms();
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
        /* The running monitors' words wake the server only while no host
         * is connected (they then start the idle time); with one connected,
         * its next command reads them (collect_spoken).  Not under a pids
         * limit (no spares): there a monitor past the idle ones must exit as
         * soon as it is done, not count against the limit until the next
         * command.  A hang-up (a detached monitor that will not come back to
         * wait) is always seen: poll reports it whatever was asked. */
        int n_speakers = 0;
        for (int i = 0; i < n_monitors; i++) {
            if (monitors[i].chan < 0)
                continue;
            fds[2 + n_clients + n_speakers] = (struct pollfd){.fd = monitors[i].chan,
                                                              .events = n_clients == 0 || !spares_wanted ? POLLIN : 0};
            speakers[n_speakers++] = monitors[i].pid;
        }
        int first_speaker = 2 + n_clients;
        /* The nearest end: idleness (when nothing runs) or the ttl. */
        int bounded = 0;
        long long left = 0;
        if (idle_ms > 0 && n_clients == 0 && running == 0) {
            left = idle_since + idle_ms - xs_now_ms();
            bounded = 1;
        }
        if (ttl_ms > 0) {
            long long ttl_left = started + ttl_ms - xs_now_ms();
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
                idle_since = xs_now_ms();
        }
        /* Before the new requests: a monitor waiting again takes the next command. */
        for (int i = 0; ready > 0 && i < n_speakers; i++) {
            if (fds[first_speaker + i].revents) {
                monitor_spoke(speakers[i]);
                if (running == 0)
                    idle_since = xs_now_ms();
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
                int r = xs_receive_flags(conn, MSG_DONTWAIT);
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
            int drop = serve(conn, xs_receive(conn));
            if (drop) {
                close(conn);
                clients[i] = clients[--n_clients];
            }
        }
        if (n_clients > 0 || running > 0)
            idle_since = xs_now_ms();
    }
}
