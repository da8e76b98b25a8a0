/*
 * init.c - the sandbox's PID 1: a separate, statically linked executable.
 *
 *   isolate-init PROGRAM_PID STATUS_FD LISTENER_FD WALL_MS [NR:ERRNO,... [SUPERVISE [PARENT_PID [KEEP_RUNNING [WHY [WHY_FD]]]]]]
 *   isolate-exec-server ...   (a kept sandbox's program: see execserver.c)
 *
 * The first child of a sandbox execs this once the program is running.  It
 *   - reaps every process that ends in the namespace (orphans come to it);
 *   - forwards the usual signals to the program (a PID 1 without a handler
 *     would ignore them);
 *   - kills everything when the wall clock runs out;
 *   - answers seccomp notifications with the errno the filter stands for,
 *     counting each denied system call;
 *   - with WHY (denial tracing, why.c), looks at each path system call,
 *     records those the policy refuses and lets every one continue;
 *   - when the program ends, writes struct iso_status (and, with WHY,
 *     struct iso_why_report after it) to STATUS_FD and exits
 *     with the program's status (128+N for a signal).  Its exit ends the PID
 *     namespace: the kernel kills whatever is left, daemons included;
 *   - without a PID namespace (PARENT_PID > 0), watches the caller through a
 *     pidfd and, when it dies, kills the program's whole tree (its group and
 *     every orphan, which come to this subreaper) before exiting.
 * It is itself confined: no capabilities, no_new_privs (set before its
 * exec), not dumpable, and a Landlock domain that allows no file access.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stdio.h>
#include <linux/seccomp.h>
#include <poll.h>
#include <signal.h>
#include <stdint.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/syscall.h>
#include <sys/timerfd.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "steps.h"

#ifndef SYS_close_range
#define SYS_close_range 436
#endif

static const int forwarded[] = {SIGHUP, SIGINT, SIGQUIT, SIGTERM, SIGUSR1, SIGUSR2, SIGWINCH, SIGCONT, SIGALRM};

static struct iso_status status;
static struct {
    int nr;
    int err;
} errno_table[512];
static int n_errno_table;

static void parse_errno_table(const char *text)
{
    /* "nr:errno,nr:errno" */
    while (text && *text && n_errno_table < (int)(sizeof errno_table / sizeof errno_table[0])) {
        char *end;
        long nr = strtol(text, &end, 10);
        if (*end != ':')
            return;
        long err = strtol(end + 1, &end, 10);
        errno_table[n_errno_table].nr = (int)nr;
        errno_table[n_errno_table].err = (int)err;
        n_errno_table++;
        if (*end != ',')
            return;
        text = end + 1;
    }
}

static int errno_for(int nr)
{
    int fallback = EPERM;
    for (int i = 0; i < n_errno_table; i++) {
        if (errno_table[i].nr == nr)
            return errno_table[i].err;
        if (errno_table[i].nr == -1) /* the profile's default action */
            fallback = errno_table[i].err;
    }
    return fallback;
}

static void count_denial(int nr)
{
    for (uint32_t i = 0; i < status.n_denied; i++) {
        if (status.denied[i].nr == nr) {
            status.denied[i].count++;
            return;
        }
    }
    if (status.n_denied < sizeof status.denied / sizeof status.denied[0]) {
        status.denied[status.n_denied].nr = nr;
        status.denied[status.n_denied].count = 1;
        status.n_denied++;
    }
}

static void answer_notification(int listener)
{
    struct seccomp_notif req;
    struct seccomp_notif_resp resp;
    memset(&req, 0, sizeof req);
    if (ioctl(listener, SECCOMP_IOCTL_NOTIF_RECV, &req) < 0)
        return; /* ENOENT: the caller died meanwhile */
    if (iso_supervise_notification(listener, &req))
        return; /* a connect() the init performs itself (supervise.c) */
    if (iso_why_notification(listener, &req))
        return; /* a path system call, looked at and let continue (why.c) */
    count_denial(req.data.nr);
    memset(&resp, 0, sizeof resp);
    resp.id = req.id;
    resp.error = -errno_for(req.data.nr);
    resp.val = 0;
    resp.flags = 0;
    ioctl(listener, SECCOMP_IOCTL_NOTIF_SEND, &resp);
}

/* Without a PID namespace the init is a subreaper: every orphan of the
 * program's tree becomes its child.  /proc/self/task/TID/children, opened
 * before the init's Landlock domain closed the filesystem, lists them. */
static int children_fd = -1;
/* The program's wait status is recorded wherever it is reaped: the sweep
 * below may reap it before the main loop's reap() sees it. */
static pid_t program_pid;
static int program_reaped;

/* Kill every child, reap exactly those killed (a blocking wait on any child
 * could hang on a grandchild that was just reparented here and is still
 * alive), and start over: each round takes the orphans the last one made,
 * until no child is left.  A killed process forks no more, so the rounds
 * end; the cap only bounds a pathological case. */
static void kill_children(void)
{
    char buf[4096];
    for (int round = 0; round < 100000; round++) {
        ssize_t n = pread(children_fd, buf, sizeof buf - 1, 0);
        if (n <= 0)
            return;
        /* A full buffer may end inside a pid: "12345" cut to "12" would
         * kill some other process.  The rest comes in a later round. */
        if (n == (ssize_t)sizeof buf - 1)
            while (n > 0 && buf[n - 1] != ' ' && buf[n - 1] != '\n')
                n--;
        buf[n] = 0;
        for (char *p = buf; *p;) {
            char *end;
            long pid = strtol(p, &end, 10);
            if (end == p)
                break;
            kill((pid_t)pid, SIGKILL);
            p = end;
            while (*p == ' ' || *p == '\n')
                p++;
        }
        for (char *p = buf; *p;) {
            char *end;
            long pid = strtol(p, &end, 10);
            if (end == p)
                break;
            int wstatus;
            pid_t got;
            while ((got = waitpid((pid_t)pid, &wstatus, 0)) < 0 && errno == EINTR)
                ;
            if (got > 0 && got == program_pid) {
                status.wait_status = wstatus;
                program_reaped = 1;
            }
            p = end;
            while (*p == ' ' || *p == '\n')
                p++;
        }
    }
}

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
/* Sent at the parent's death when pidfd_open is missing (before Linux 5.3). */
#define PARENT_GONE_SIGNAL SIGPWR

/* Watch the caller (our parent) without a PID namespace.  Returns a pidfd
 * that polls readable once it has died, or -1 with *gone set if it is gone
 * already; on kernels without pidfd_open, a parent-death signal the
 * signalfd reads instead.  getppid() afterwards closes the race with a
 * parent that died before the watch began: we would have been reparented. */
static int watch_parent(pid_t parent, int *gone)
{
    int fd = (int)syscall(SYS_pidfd_open, parent, 0);
    if (fd < 0 && prctl(PR_SET_PDEATHSIG, PARENT_GONE_SIGNAL, 0, 0, 0) < 0)
        *gone = 1; /* cannot watch it: do not outlive it unswept */
    if (getppid() != parent)
        *gone = 1;
    return fd;
}

/* Close every descriptor but those in keep[] (-1 entries ignored), gap by
 * gap.  (Before Linux 5.9 close_range fails and the leftovers merely stay
 * open in this process; the program never sees them.) */
static void close_all_but(int a, int b, int c, int d)
{
    int keep[4] = {a, b, c, d};
    for (int i = 1; i < 4; i++) /* insertion sort: four entries */
        for (int j = i; j > 0 && keep[j] < keep[j - 1]; j--) {
            int t = keep[j];
            keep[j] = keep[j - 1];
            keep[j - 1] = t;
        }
    unsigned int lo = 0;
    for (int i = 0; i < 4; i++) {
        if (keep[i] < 0)
            continue;
        if ((unsigned int)keep[i] > lo)
            syscall(SYS_close_range, lo, (unsigned int)keep[i] - 1, 0);
        lo = (unsigned int)keep[i] + 1;
    }
    syscall(SYS_close_range, lo, ~0U, 0);
}

/* A kept sandbox's program is its exec server, which shares its uid with
 * every command: a command could SIGSTOP it, and every later request would
 * hang.  The init cannot be stopped from inside its PID namespace, so it
 * continues the server whenever it stops. */
static int keep_program_running;
/* Held by the host's pause (ISO_SIGNAL_HOLD, ended by ISO_SIGNAL_RELEASE): the program stays stopped. */
static int program_held;

/* Reap every child that has ended; 1 when the program was among them. */
static int reap(pid_t program)
{
    int wstatus, found = 0;
    pid_t pid;
    while ((pid = waitpid(-1, &wstatus, WNOHANG | (keep_program_running ? WUNTRACED : 0))) > 0) {
        if (WIFSTOPPED(wstatus)) {
            if (pid == program && !program_held && kill(program, SIGCONT) < 0) {
                /* It ended meanwhile: its exit is reaped in a later round. */
            }
            continue;
        }
        if (pid == program) {
            status.wait_status = wstatus;
            found = 1;
        }
    }
    return found;
}

static void kill_everything(pid_t program, int pid_namespace)
{
    if (pid_namespace) {
        kill(-1, SIGKILL); /* every process of the namespace but this one */
        return;
    }
    kill(-program, SIGKILL); /* the program's process group */
    kill(program, SIGKILL);
    if (children_fd >= 0)
        kill_children(); /* and whatever left the group (setsid daemons) */
}

/* The report may exceed PIPE_BUF: every byte, or as many as the reader takes. */
static void write_all(int fd, const void *data, size_t size)
{
    const char *p = data;
    while (size > 0) {
        ssize_t n = write(fd, p, size);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            return;
        p += n;
        size -= (size_t)n;
    }
}

int main(int argc, char **argv)
{
    /* The same executable is a kept sandbox's program (execserver.c); a
     * container runs it by its path (/.isolate/isolate-exec-server), so the
     * last component of argv[0] decides. */
    const char *role = argc > 0 ? strrchr(argv[0], '/') : NULL;
    role = role ? role + 1 : (argc > 0 ? argv[0] : "");
    if (!strcmp(role, "isolate-exec-server"))
        return iso_exec_server_main(argc, argv);
    if (argc < 5)
        return 125;
    pid_t program = (pid_t)atoi(argv[1]);
    program_pid = program;
    int status_fd = atoi(argv[2]);
    int listener = atoi(argv[3]);
    long long wall_ms = atoll(argv[4]);
    if (argc > 5)
        parse_errno_table(argv[5]);
    /* Supervised connect(): a spec it cannot read fails the run closed. */
    int supervising = argc > 6 && argv[6][0];
    if (supervising && iso_supervise_init(argv[6], &status) < 0)
        return 125;
    /* PARENT_PID, or "pidfd:N": a pidfd of the caller's process that the
     * caller opened for us (PID 1 of a new PID namespace cannot name its
     * parent by pid). */
    pid_t parent = 0;
    int inherited_parent_fd = -1;
    if (argc > 7 && !strncmp(argv[7], "pidfd:", 6))
        inherited_parent_fd = atoi(argv[7] + 6);
    else if (argc > 7)
        parent = (pid_t)atoi(argv[7]);
    keep_program_running = argc > 8 && !strcmp(argv[8], "1");
    /* Denial tracing: a spec it cannot read fails the run, as asked for. */
    int why = argc > 9 && argv[9][0];
    if (why && iso_why_init(argv[9]) < 0)
        return 125;
    int why_stream = why && argc > 10 ? atoi(argv[10]) : -1;
    if (why_stream >= 0)
        iso_why_stream(why_stream);
    int pid_namespace = getpid() == 1;

    /* Only our own descriptors: the program's stdio must not stay open
     * here, or a reader of its pipes would wait for this process too, and
     * nothing passed on to the program (pass_fds) belongs to the init. */
    close_all_but(status_fd, listener, inherited_parent_fd, why_stream);
    if (prctl(PR_SET_DUMPABLE, 0, 0, 0, 0) < 0)
        return 125;
    if (!pid_namespace) {
        if (prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) < 0)
            return 125;
        char path[64];
        snprintf(path, sizeof path, "/proc/self/task/%d/children", (int)getpid());
        children_fd = open(path, O_RDONLY | O_CLOEXEC);
    }

    sigset_t mask;
    sigemptyset(&mask);
    sigaddset(&mask, SIGCHLD);
    if (keep_program_running) {
        sigaddset(&mask, ISO_SIGNAL_HOLD);
        sigaddset(&mask, ISO_SIGNAL_RELEASE);
    }
    if (parent > 0)
        sigaddset(&mask, PARENT_GONE_SIGNAL);
    for (size_t i = 0; i < sizeof forwarded / sizeof forwarded[0]; i++)
        sigaddset(&mask, forwarded[i]);
    if (sigprocmask(SIG_BLOCK, &mask, NULL) < 0)
        return 125;
    int sigfd = signalfd(-1, &mask, SFD_CLOEXEC | SFD_NONBLOCK);
    if (sigfd < 0)
        return 125;
    int timer = -1;
    if (wall_ms > 0) {
        timer = timerfd_create(CLOCK_MONOTONIC, TFD_CLOEXEC);
        struct itimerspec when = {.it_value = {.tv_sec = wall_ms / 1000, .tv_nsec = (wall_ms % 1000) * 1000000}};
        if (timer < 0 || timerfd_settime(timer, 0, &when, NULL) < 0)
            return 125;
    }
    int parent_fd = inherited_parent_fd, parent_gone = 0;
    if (parent > 0)
        parent_fd = watch_parent(parent, &parent_gone);
    /* A parent-death signal set before the exec follows the caller's
     * *thread* that forked us; with a pidfd watching the caller's process it
     * would only end a sandbox whose starting thread ended (a pool's, an
     * executor's).  A pidfd that polls readable at once: the caller is gone. */
    if (parent_fd >= 0 && prctl(PR_SET_PDEATHSIG, 0, 0, 0, 0) < 0)
        return 125;
    /* No file access from here on.  A supervisor needs its hands on the
     * program (pidfd_getfd, process_vm_readv, /proc/PID/cwd, the program's
     * paths): a Landlock domain made now would be a sibling of the
     * program's, and Landlock refuses ptrace-class access across domains. */
    if (!supervising && !why && iso_landlock_deny_all())
        return 125;

    status.magic = ISO_STATUS_MAGIC;
    status.reason = ISO_REASON_EXITED;
    int done = 0;
    /* The program may have ended before SIGCHLD was blocked (the pre-exec
     * path): look once before waiting for the signal. */
    done = reap(program);
    while (!done) {
        if (parent_gone) {
            /* No one is left to wait for the run: end it now, whole. */
            kill_everything(program, pid_namespace);
            parent_gone = 0;
            if (parent_fd >= 0)
                close(parent_fd);
            parent_fd = -1;
            if (program_reaped)
                break;
        }
        struct pollfd fds[4] = {
            {.fd = sigfd, .events = POLLIN},
            {.fd = timer, .events = POLLIN},
            {.fd = listener, .events = POLLIN},
            {.fd = parent_fd, .events = POLLIN},
        };
        int ready = poll(fds, 4, -1);
        if (ready < 0) {
            if (errno == EINTR)
                continue;
            kill_everything(program, pid_namespace);
            return 125;
        }
        if (fds[3].revents & (POLLIN | POLLHUP | POLLERR))
            parent_gone = 1;
        if (fds[2].revents & POLLIN)
            answer_notification(listener);
        if (fds[2].revents & (POLLHUP | POLLERR | POLLNVAL))
            listener = -1; /* the filter's last user is gone */
        if (fds[1].revents & POLLIN) {
            uint64_t expirations;
            if (read(timer, &expirations, sizeof expirations) < 0) {
                /* Nothing to recover: the deadline has passed either way. */
            }
            status.reason = ISO_REASON_TIMEOUT;
            kill_everything(program, pid_namespace);
            close(timer);
            timer = -1;
            if (program_reaped)
                break;
        }
        if (fds[0].revents & POLLIN) {
            /* Every pending signal at once: the signalfd hands them out by
             * number, so the SIGCHLD of a stop comes before a hold the host
             * queued ahead of that stop.  Holds are applied first, so the
             * stop is not undone. */
            struct signalfd_siginfo batch[32];
            ssize_t got;
            while ((got = read(sigfd, batch, sizeof batch)) >= (ssize_t)sizeof batch[0]) {
                size_t n = (size_t)got / sizeof batch[0];
                int reap_now = 0;
                for (size_t i = 0; i < n; i++) {
                    /* Only the host's: with a PID namespace the kernel
                     * writes a kill()'s sender pid (SI_USER), 0 only for a
                     * sender outside it; a sigqueue's (SI_QUEUE) the sender
                     * writes itself.  Without one, the program could as
                     * well stop this process itself. */
                    int sig = (int)batch[i].ssi_signo;
                    int host = !pid_namespace || (batch[i].ssi_code == SI_USER && batch[i].ssi_pid == 0);
                    if ((sig == ISO_SIGNAL_HOLD || sig == ISO_SIGNAL_RELEASE) && host)
                        program_held = sig == ISO_SIGNAL_HOLD;
                }
                for (size_t i = 0; i < n; i++) {
                    int sig = (int)batch[i].ssi_signo;
                    if (parent > 0 && sig == PARENT_GONE_SIGNAL && getppid() != parent)
                        parent_gone = 1;
                    else if (sig == SIGCHLD)
                        reap_now = 1;
                    else if (sig != ISO_SIGNAL_HOLD && sig != ISO_SIGNAL_RELEASE && sig != PARENT_GONE_SIGNAL)
                        kill(program, sig);
                }
                if (reap_now)
                    done |= reap(program);
            }
        }
    }
    kill_everything(program, pid_namespace);
    /* Reap what the kill left, so the tree is gone and its usage counted
     * before the parent hears of the end. */
    while (waitpid(-1, NULL, 0) > 0 || errno == EINTR)
        ;
    struct rusage usage;
    if (getrusage(RUSAGE_CHILDREN, &usage) == 0) {
        status.user_usec = (int64_t)usage.ru_utime.tv_sec * 1000000 + usage.ru_utime.tv_usec;
        status.system_usec = (int64_t)usage.ru_stime.tv_sec * 1000000 + usage.ru_stime.tv_usec;
        status.maxrss_kib = usage.ru_maxrss;
    }
    if (status_fd >= 0) {
        write_all(status_fd, &status, sizeof status);
        if (why)
            write_all(status_fd, iso_why_report(), sizeof(struct iso_why_report));
    }
    if (WIFEXITED(status.wait_status))
        return WEXITSTATUS(status.wait_status);
    return 128 + WTERMSIG(status.wait_status);
}
