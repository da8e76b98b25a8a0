/*
 * xs_monitor.c - a command's monitor: starts it (vfork, then only
 * async-signal-safe steps to the exec), enforces its timeout, passes on
 * signals, reaps its tree and reports its end (see execserver.c).
 */
#define _GNU_SOURCE
#include "execserver.h"

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

/* Set when reap_some's last wait4 said ECHILD: no child at all, alive or
 * not yet reaped.  Nothing can become this subreaper's child after that
 * (every living descendant has a living parent below it, or is its child),
 * so it stays true; childless() need not ask again. */
static int no_child_left;

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
    no_child_left = pid < 0 && errno == ECHILD;
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
    if (req->n_fds < 1)
        return EINVAL;
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
    xs_send_reply(conn, &reply, NULL, 0, -1);
}

/* What a monitor sets up before it starts its command: it becomes a
 * subreaper, opens its list of children, its SIGCHLD signalfd and the
 * command's error pipe.  A spare monitor does this while it waits, off the
 * path of the command it will start.  An error is kept in monitor_err and
 * answered to the command's request. */
static int monitor_sigfd = -1;
/* A waiting monitor's socket to the server (spare_main); -1 in one forked for one command. */
int xs_monitor_chan = -1;
int xs_monitor_err_pipe[2] = {-1, -1};
static int monitor_err;

void xs_monitor_prepare(void)
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
    if (monitor_sigfd < 0 || pipe2(xs_monitor_err_pipe, O_CLOEXEC) < 0)
        monitor_err = errno;
}

/* 1 when this process has no child at all, alive or not yet reaped (none is reaped here). */
static int childless(void)
{
    if (no_child_left)
        return 1;
    siginfo_t info;
    memset(&info, 0, sizeof info);
    return waitid(P_ALL, 0, &info, WEXITED | WNOHANG | WNOWAIT) < 0 && errno == ECHILD;
}

/* ISO_XS_F_DETACHED, the command ended by itself: what it left, whatever
 * it did with sessions, groups and double forks, is below this subreaper
 * (an orphan comes to the nearest living one), where the host finds and
 * ends it; it is reaped here until none is left.  A blocking wait4 needs
 * no signal (SIGCHLD stays blocked), and ECHILD says nothing is left. */
static void reap_what_it_left(void)
{
    for (;;) {
        int wstatus;
        struct rusage ru;
        if (wait4(-1, &wstatus, 0, &ru) < 0) {
            if (errno == EINTR)
                continue;
            return; /* ECHILD: all of it has ended */
        }
    }
}

/* A monitor: owns conn and one command, until the command has ended.
 * Returns (conn closed) only when this process may serve another command
 * (see spare_main): its command exited by itself, leaving nothing running
 * below it, so that whatever it reaps or kills from now on is the next
 * command's.  Otherwise it exits. */
void xs_monitor(int conn, struct request *req)
{
    const struct iso_xs_request *h = &req->head;
    int64_t timeout_ms = h->timeout_ms; /* req is `current`, which the loop below reuses */
    int late_started = (h->flags & ISO_XS_F_LATE_STARTED) != 0;
    /* The host hanging up ends nothing; the monitor outlives the command (reap_what_it_left). */
    int detached = (h->flags & ISO_XS_F_DETACHED) != 0;
    /* A terminal's master and a strings mapping are not undone here: such a command's monitor exits.
     * A detached one's stays with what its command left. */
    int may_serve_again = !(h->flags & (ISO_XS_F_PTY | ISO_XS_F_STRINGS_FD | ISO_XS_F_DETACHED));
    command = 0;
    command_reaped = 0;
    command_status = 0;
    no_child_left = 0;
    usage_user_usec = usage_system_usec = usage_maxrss_kib = 0;
    if (h->flags & ISO_XS_F_STRINGS_FD) {
        int err = load_strings(req);
        if (err) {
            xs_reply_kind(conn, ISO_XS_ERROR, err);
            _exit(0);
        }
    }
    /* stdin, stdout and stderr unless the command gets a terminal, then
     * optionally the command's descriptor 3. */
    int stdio_fds = (h->flags & ISO_XS_F_PTY) ? 0 : 3;
    if ((req->n_fds != stdio_fds && req->n_fds != stdio_fds + 1) || h->n_argv < 1 || h->n_strings < h->n_argv + 1) {
        xs_reply_kind(conn, ISO_XS_ERROR, EINVAL);
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
            xs_reply_kind(conn, ISO_XS_ERROR, errno);
            _exit(0);
        }
        /* TIOCGPTPEER (4.13): the slave from the master, not from a path. */
        int slave = ioctl(master, TIOCGPTPEER, O_RDWR | O_NOCTTY | O_CLOEXEC);
        if (slave < 0) {
            xs_reply_kind(conn, ISO_XS_ERROR, errno);
            _exit(0);
        }
        if (req->n_fds == 1)
            req->fds[3] = req->fds[0];
        req->fds[0] = slave;
        req->fds[1] = fcntl(slave, F_DUPFD_CLOEXEC, 0);
        req->fds[2] = fcntl(slave, F_DUPFD_CLOEXEC, 0);
        req->n_fds += 3;
        if (req->fds[1] < 0 || req->fds[2] < 0) {
            xs_reply_kind(conn, ISO_XS_ERROR, errno);
            _exit(0);
        }
    }
    if (monitor_sigfd < 0 && !monitor_err)
        xs_monitor_prepare();
    if (monitor_err) {
        xs_reply_kind(conn, ISO_XS_ERROR, monitor_err);
        _exit(0);
    }
    int sigfd = monitor_sigfd;
    int err_pipe[2] = {xs_monitor_err_pipe[0], xs_monitor_err_pipe[1]};
    /* argv ends where the environment begins: copied out, NULL-terminated,
     * here (the vfork child allocates nothing). */
    static char *inline_argv[MAX_STRINGS + 1];
    char **argv = inline_argv;
    if (h->n_argv > MAX_STRINGS) {
        argv = mmap(NULL, ((size_t)h->n_argv + 1) * sizeof(char *), PROT_READ | PROT_WRITE,
                    MAP_PRIVATE | MAP_ANONYMOUS, -1, 0);
        if (argv == MAP_FAILED) {
            xs_reply_kind(conn, ISO_XS_ERROR, ENOMEM);
            _exit(0);
        }
    }
    memcpy(argv, req->strings + 1, sizeof(char *) * h->n_argv);
    argv[h->n_argv] = NULL;
    /* vfork: the child only sets up its session, stdio and cwd, then execs
     * (or reports and _exits), so nothing of this process need be copied. */
    command = vfork();
    if (command < 0) {
        xs_reply_kind(conn, ISO_XS_ERROR, errno);
        _exit(0);
    }
    if (command == 0) {
        close(err_pipe[0]);
        start_command(req, argv, err_pipe[1]);
    }
    close(err_pipe[1]);
    xs_monitor_err_pipe[1] = -1;
    /* The command's stdout and stderr (pipes of the host's, mostly) stay
     * open here until its EXITED is sent: their hang-up, which the
     * command's exit gives the host's poll before the monitor has reaped
     * it, would wake the host once more per command for nothing (all the
     * command wrote is in the pipes by then; the host drains them after
     * EXITED).  Its stdin and descriptor 3 are closed now, as before: a
     * writer to its stdin sees its end when it ends. */
    int held[2] = {-1, -1};
    if (!(h->flags & ISO_XS_F_PTY)) {
        held[0] = req->fds[1];
        held[1] = req->fds[2];
        req->fds[1] = req->fds[3]; /* the command's 3, if it has one (n_fds 4) */
        req->n_fds -= 2;
    }
    xs_close_fds(req);
    struct iso_failure failure;
    ssize_t got;
    do {
        got = read(err_pipe[0], &failure, sizeof failure);
    } while (got < 0 && errno == EINTR);
    close(err_pipe[0]);
    xs_monitor_err_pipe[0] = -1;
    if (got == (ssize_t)sizeof failure) {
        while (waitpid(command, NULL, 0) < 0 && errno == EINTR)
            ;
        struct iso_xs_reply reply = {.magic = ISO_XS_MAGIC, .kind = ISO_XS_ERROR, .err = failure.err,
                                     .step = failure.step};
        xs_send_reply(conn, &reply, NULL, 0, -1);
        _exit(0);
    }
    struct iso_xs_reply started = {.magic = ISO_XS_MAGIC, .kind = ISO_XS_STARTED, .pid = command};
    /* ISO_XS_F_LATE_STARTED (never with a terminal, whose master goes with STARTED): most commands
     * are short, and their EXITED, which carries the pid, says that they started; STARTED then
     * would only wake the host once more.  One that outlasts ISO_XS_STARTED_AFTER_MS gets it then,
     * well within the host's wait for it. */
    long long started_due = -1;
    if (late_started && master < 0) {
        started_due = xs_now_ms() + ISO_XS_STARTED_AFTER_MS;
    } else {
        xs_send_reply(conn, &started, NULL, 0, master);
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
    int host_gone = 0; /* detached: its host hung up (set after the vfork: not one it could clobber) */
    reap_some();
    while (!command_reaped) {
        struct pollfd fds[3] = {{.fd = sigfd, .events = POLLIN}, {.fd = host_gone ? -1 : conn, .events = POLLIN},
                                {.fd = timer, .events = POLLIN}};
        int wait_ms = -1;
        if (started_due >= 0) {
            long long left = started_due - xs_now_ms();
            if (left <= 0) {
                xs_send_reply(conn, &started, NULL, 0, -1);
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
            /* One read takes every pending SIGCHLD (one is pending at most: it is not queued). */
            struct signalfd_siginfo info[4];
            if (read(sigfd, info, sizeof info) < 0 && errno != EAGAIN && errno != EINTR) {
                /* Nothing to do: the wait4s below reap whatever has ended. */
            }
            reap_some();
        }
        if (fds[2].revents & POLLIN) {
            reason = ISO_XS_REASON_TIMEOUT;
            kill_tree();
        }
        if (fds[1].revents & (POLLIN | POLLHUP | POLLERR)) {
            int r = xs_receive(conn);
            if (r == 0 && detached) {
                /* Its host (a server) may end before it: the command runs on, its timeout still holds. */
                host_gone = 1;
            } else if (r == 0) {
                /* The host hung up: nobody waits for this command any more. */
                reason = ISO_XS_REASON_KILLED;
                kill_tree();
                _exit(0);
            }
            if (r > 0 && xs_current.head.op == ISO_XS_SIGNAL) {
                if (xs_current.head.mode == SIGKILL && !(xs_current.head.flags & ISO_XS_F_DESCENDANTS))
                    reason = ISO_XS_REASON_KILLED;
                do_signal(xs_current.head.mode, xs_current.head.flags);
            }
            if (r > 0)
                xs_close_fds(&xs_current);
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
    int again = reason == ISO_XS_REASON_EXITED && may_serve_again && xs_monitor_chan >= 0 && childless() &&
                write(xs_monitor_chan, "", 1) == 1;
    send_exited(conn, reason); /* to a host gone: EPIPE, nobody to tell */
    for (int i = 0; i < 2; i++)
        if (held[i] >= 0)
            close(held[i]);
    /* A request that crossed the end (a kill sent as the command exited)
     * is read and dropped: a unix socket closed with unread data resets
     * its peer, which is then told that error before the EXITED above. */
    int r;
    while ((r = xs_receive_flags(conn, MSG_DONTWAIT)) != 0 && r != -2) /* MSG_DONTWAIT: no fcntl pair */
        xs_close_fds(&xs_current);
    if (detached && reason == ISO_XS_REASON_EXITED) {
        close(conn);
        /* A waiting monitor's socket closed: the server learns that this one will not come back to wait,
         * and forks the next ahead (one_may_come_back), rather than once per command while this one lives. */
        if (xs_monitor_chan >= 0) {
            close(xs_monitor_chan);
            xs_monitor_chan = -1;
        }
        reap_what_it_left();
        _exit(0);
    }
    if (!again)
        _exit(0); /* what the command left goes to the sandbox's init with this process's end */
    if (timer >= 0)
        close(timer);
    close(conn);
}
