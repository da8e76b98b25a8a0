/*
 * process.c - signals, descriptors, parent death and exec, for the child.
 *
 * Everything here runs between fork (or clone) and exec: system calls only,
 * no allocation, buffers on the stack.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <signal.h>
#include <stdint.h>
#include <string.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "steps.h"

#ifndef SYS_close_range
#define SYS_close_range 436
#endif
#ifndef AT_EMPTY_PATH
#define AT_EMPTY_PATH 0x1000
#endif

/* Handlers installed by the parent (Python's among them) are addresses in
 * its memory; the child must not run them: every disposition goes back to
 * default.  *ignored gets the signals that were ignored (bit N-1 for signal
 * N), for the program child to ignore again (iso_signals_ignore). */
int iso_signals_reset(uint64_t *ignored)
{
    struct sigaction action, old;
    memset(&action, 0, sizeof action);
    action.sa_handler = SIG_DFL;
    *ignored = 0;
    for (int sig = 1; sig < _NSIG; sig++) {
        if (sig == SIGKILL || sig == SIGSTOP)
            continue;
        /* EINVAL for the signals glibc reserves for itself: nothing to reset. */
        if (sigaction(sig, &action, &old) < 0) {
            if (errno != EINVAL)
                return ISO_STEP_SIGNALS;
            continue;
        }
        if (old.sa_handler == SIG_IGN && sig <= 64)
            *ignored |= 1ULL << (sig - 1);
    }
    return 0;
}

/* The caller's ignored signals the plan keeps (plan->keep_ignored), ignored
 * again: exec keeps SIG_IGN, and so does the sandbox. */
int iso_signals_ignore(uint64_t ignored)
{
    struct sigaction action;
    memset(&action, 0, sizeof action);
    action.sa_handler = SIG_IGN;
    for (int sig = 1; sig <= 64 && ignored; sig++) {
        if (!(ignored & (1ULL << (sig - 1))))
            continue;
        ignored &= ~(1ULL << (sig - 1));
        if (sigaction(sig, &action, NULL) < 0 && errno != EINVAL)
            return ISO_STEP_SIGNALS;
    }
    return 0;
}

int iso_signals_unblock(void)
{
    sigset_t none;
    sigemptyset(&none);
    if (sigprocmask(SIG_SETMASK, &none, NULL) < 0)
        return ISO_STEP_SIGNALS;
    return 0;
}

/* Put the program's stdio in place.  A source that is itself 0..2 may be
 * overwritten by an earlier dup2, so every source is first moved above 2. */
int iso_stdio_apply(const struct iso_plan *plan)
{
    int moved[3];
    for (int i = 0; i < 3; i++) {
        moved[i] = plan->stdio[i];
        if (moved[i] >= 0 && moved[i] < 3 && moved[i] != i) {
            moved[i] = fcntl(moved[i], F_DUPFD_CLOEXEC, 3);
            if (moved[i] < 0)
                return ISO_STEP_STDIO;
        }
    }
    for (int i = 0; i < 3; i++) {
        if (moved[i] < 0)
            continue;
        if (moved[i] == i) {
            /* Already in place: only make sure exec keeps it. */
            if (fcntl(i, F_SETFD, 0) < 0)
                return ISO_STEP_STDIO;
        } else if (dup2(moved[i], i) < 0) {
            return ISO_STEP_STDIO;
        }
    }
    return 0;
}

static int close_range_fallback(unsigned int lo, unsigned int hi)
{
    struct rlimit lim;
    if (getrlimit(RLIMIT_NOFILE, &lim) < 0)
        return -1;
    unsigned int end = lim.rlim_max == RLIM_INFINITY || lim.rlim_max > (1u << 20) ? (1u << 20) : (unsigned)lim.rlim_max;
    if (hi > end)
        hi = end;
    for (unsigned int fd = lo; fd <= hi && fd < end; fd++)
        close((int)fd);
    return 0;
}

static int close_between(unsigned int lo, unsigned int hi)
{
    if (lo > hi)
        return 0;
    if (syscall(SYS_close_range, lo, hi, 0) == 0)
        return 0;
    if (errno != ENOSYS)
        return -1;
    return close_range_fallback(lo, hi);
}

/* Close every descriptor above 2 but the program's pass_fds (made
 * inheritable) and the setup's own (close-on-exec, so exec drops them). */
int iso_close_fds(const struct iso_plan *plan, const int *extra_keep, int n_extra)
{
    int keep[80];
    int n = 0;
    for (int i = 0; i < plan->n_keep_fds && n < 64; i++) {
        if (fcntl(plan->keep_fds[i], F_SETFD, 0) < 0)
            return ISO_STEP_CLOSE_FDS;
        keep[n++] = plan->keep_fds[i];
    }
    for (int i = 0; i < n_extra && n < 80; i++)
        if (extra_keep[i] > 2)
            keep[n++] = extra_keep[i];
    /* Insertion sort: a handful of entries. */
    for (int i = 1; i < n; i++) {
        int v = keep[i], j = i - 1;
        while (j >= 0 && keep[j] > v) {
            keep[j + 1] = keep[j];
            j--;
        }
        keep[j + 1] = v;
    }
    unsigned int lo = 3;
    for (int i = 0; i < n; i++) {
        if ((unsigned)keep[i] < lo)
            continue;
        if (close_between(lo, (unsigned)keep[i] - 1) < 0)
            return ISO_STEP_CLOSE_FDS;
        lo = (unsigned)keep[i] + 1;
    }
    if (close_between(lo, ~0u) < 0)
        return ISO_STEP_CLOSE_FDS;
    return 0;
}

/* The parent-death signal is cleared whenever credentials change, so it is
 * set after the ids are final. */
int iso_hold_exec_server(int pid, int hold)
{
    /* kill(), not sigqueue(): only for SI_USER does the kernel write the
     * sender's pid itself (0 for us, outside the init's PID namespace),
     * which is what the init trusts. */
    return kill((pid_t)pid, hold ? ISO_SIGNAL_HOLD : ISO_SIGNAL_RELEASE);
}

int iso_die_with_parent(void)
{
    if (prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) < 0)
        return ISO_STEP_PDEATHSIG;
    return 0;
}

/* execveat with the sixth argument set to mark: the kernel ignores it, a
 * denial-tracing filter lets a marked exec through unasked (see
 * ISO_EXEC_MARK).  A program that marks its own execs only hides them from
 * the report: what it may execute is Landlock's to say either way. */
static void exec_at(int dirfd, const char *path, char *const *argv, char *const *envp, int flags, long mark)
{
    syscall(SYS_execveat, dirfd, path, argv, envp, flags, mark);
}

/* execve, searching plan->search_path (the sandbox's PATH) for a bare name
 * the way execvp does, but without allocating.  Returns only on failure,
 * with errno: EACCES if some candidate was found but not executable.
 * mark: ISO_EXEC_MARK for the sandbox's first program, 0 for a command
 * (which denial tracing looks at). */
int iso_exec_program(const struct iso_plan *plan, long mark)
{
    if (plan->program_fd >= 0) {
        exec_at(plan->program_fd, "", plan->argv, plan->envp, AT_EMPTY_PATH, mark);
        return ISO_STEP_EXEC;
    }
    const char *file = plan->file;
    if (strchr(file, '/') != NULL || plan->search_path == NULL) {
        exec_at(AT_FDCWD, file, plan->argv, plan->envp, 0, mark);
        return ISO_STEP_EXEC;
    }
    char candidate[PATH_MAX];
    size_t file_len = strlen(file);
    int saw_eacces = 0;
    const char *p = plan->search_path;
    for (;;) {
        const char *end = strchr(p, ':');
        size_t dir_len = end ? (size_t)(end - p) : strlen(p);
        if (dir_len == 0) {
            candidate[0] = '.';
            dir_len = 1;
        } else if (dir_len < sizeof candidate) {
            memcpy(candidate, p, dir_len);
        }
        if (dir_len + 1 + file_len < sizeof candidate) {
            candidate[dir_len] = '/';
            memcpy(candidate + dir_len + 1, file, file_len + 1);
            exec_at(AT_FDCWD, candidate, plan->argv, plan->envp, 0, mark);
            if (errno == EACCES)
                saw_eacces = 1;
            else if (errno != ENOENT && errno != ENOTDIR && errno != ELOOP && errno != ENAMETOOLONG)
                return ISO_STEP_EXEC; /* ENOEXEC, E2BIG...: report it as is */
        }
        if (!end)
            break;
        p = end + 1;
    }
    errno = saw_eacces ? EACCES : ENOENT;
    return ISO_STEP_EXEC;
}
