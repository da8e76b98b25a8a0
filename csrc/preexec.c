/*
 * preexec.c - the same confinement for plain subprocess (preexec_fn).
 *
 * subprocess has already forked the whole Python parent (H) and will exec
 * the program in whatever process returns from the hook.  With namespaces:
 *   H creates a user namespace with unshare(); the maps are written from
 *     the parent namespace by a CLONE_VM helper started before unshare;
 *   H unshares the other namespaces, sets the hostname and loopback;
 *   H forks Y1, the first process of the new PID namespace, and becomes a
 *     relay (the init binary in relay mode): subprocess waits for H;
 *   Y1 builds the root and pivots (it must: proc can only be mounted from
 *     inside the PID namespace, before the host's root is detached), forks
 *     Y2 and execs the init;
 *   Y2 takes the program's last steps and returns 0: subprocess execs.
 * Without namespaces but with die_with_parent, H forks the program and
 * becomes the init (a subreaper that watches the caller, see init.c), so
 * that the caller's death ends the program's daemons too.
 * Every fork here copies the Python process: this path costs what fork
 * costs, which is why isolate.run uses spawn.c instead.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <sched.h>
#include <signal.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "steps.h"

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif
#ifndef AT_EMPTY_PATH
#define AT_EMPTY_PATH 0x1000
#endif

struct map_writer {
    const struct iso_plan *plan;
    int go_fd;
    int go_write_fd;
    int target;
    volatile int err;
};

/* Runs in the parent user namespace, sharing H's memory, until H has its
 * new namespace: then writes H's maps with the parent's privileges. */
static int map_writer_main(void *arg)
{
    struct map_writer *w = arg;
    char go;
    close(w->go_write_fd); /* so that H giving up reads as end of file */
    ssize_t n;
    do {
        n = read(w->go_fd, &go, 1);
    } while (n < 0 && errno == EINTR);
    if (n != 1) {
        w->err = n == 0 ? EPIPE : errno;
        _exit(1);
    }
    if (iso_write_id_maps(w->target, w->plan) < 0) {
        w->err = errno;
        _exit(1);
    }
    _exit(0);
}

static int unshare_user(const struct iso_plan *plan)
{
    /* The set-id map helpers are run by a parent that waits for them; this
     * hook's writer shares the program's memory (the plan never asks). */
    if (plan->newuidmap || plan->newgidmap) {
        errno = ENOTSUP;
        return -1;
    }
    int pipefd[2];
    if (pipe2(pipefd, O_CLOEXEC) < 0)
        return -1;
    const size_t size = 64 * 1024;
    char *stack = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK, -1, 0);
    if (stack == MAP_FAILED)
        return -1;
    struct map_writer *w = (struct map_writer *)stack;
    w->plan = plan;
    w->go_fd = pipefd[0];
    w->go_write_fd = pipefd[1];
    w->target = getpid();
    w->err = 0;
    sigset_t all, old;
    sigfillset(&all);
    sigprocmask(SIG_SETMASK, &all, &old);
    int helper = clone(map_writer_main, stack + size, CLONE_VM | SIGCHLD, w);
    sigprocmask(SIG_SETMASK, &old, NULL);
    if (helper < 0) {
        int saved = errno;
        close(pipefd[0]);
        close(pipefd[1]);
        munmap(stack, size);
        errno = saved;
        return -1;
    }
    int rc = unshare(CLONE_NEWUSER);
    int saved = errno;
    if (rc == 0 && write(pipefd[1], "g", 1) != 1)
        saved = errno;
    close(pipefd[1]);
    close(pipefd[0]);
    int wstatus = 0;
    while (waitpid(helper, &wstatus, 0) < 0 && errno == EINTR)
        ;
    if (rc < 0) {
        errno = saved;
        return -1;
    }
    if (!WIFEXITED(wstatus) || WEXITSTATUS(wstatus) != 0) {
        errno = w->err ? w->err : EPERM;
        return -1;
    }
    munmap(stack, size);
    return 0;
}

/* The relay (H) watches the caller as a process: its parent-death signal
 * fires when the caller's *thread* that forked it ends, and a sandbox started
 * from a worker thread (a pool's, asyncio's) would die with that thread.
 * Given the caller's pid, the init replaces the signal by a pidfd watch. */
static void exec_init(const struct iso_plan *plan, int child, int relay, int parent_pid)
{
    char pid_arg[16], wall_arg[32], parent_arg[16];
    snprintf(pid_arg, sizeof pid_arg, "%d", child);
    snprintf(wall_arg, sizeof wall_arg, "%lld", relay ? 0LL : plan->wall_ms);
    snprintf(parent_arg, sizeof parent_arg, "%d", relay && plan->die_with_parent ? parent_pid : 0);
    char *argv[] = {"isolate-init", pid_arg, "-1", "-1", wall_arg, "", "", parent_arg, NULL};
    char *envp[] = {NULL};
    syscall(SYS_execveat, plan->init_fd, "", argv, envp, AT_EMPTY_PATH);
}

static int fail(struct iso_failure *failure, int step, int index)
{
    failure->step = step;
    failure->err = errno;
    failure->index = index;
    return -1;
}

/* The program's own steps, shared by both shapes of the hook. */
static int program_steps(const struct iso_plan *plan, struct iso_failure *failure, const char *cwd)
{
    int index = -1, step;
    if (cwd && chdir(cwd) < 0)
        return fail(failure, ISO_STEP_CHDIR, -1);
    if ((step = iso_rlimits_apply(plan, &index, 0)))
        return fail(failure, step, index);
    if ((step = iso_creds_apply(plan)))
        return fail(failure, step, -1);
    if (plan->die_with_parent && (step = iso_die_with_parent()))
        return fail(failure, step, -1);
    if (plan->no_new_privs && (step = iso_no_new_privs()))
        return fail(failure, step, -1);
    if ((step = iso_landlock_apply(plan, &index)))
        return fail(failure, step, index);
    /* subprocess closes the inherited descriptors after the hook; an
     * inherited one numbered above the limit stays usable until then. */
    if ((step = iso_rlimits_apply(plan, &index, 1)))
        return fail(failure, step, index);
    int listener;
    if ((step = iso_seccomp_apply(plan, &listener)))
        return fail(failure, step, -1);
    /* subprocess called with env=None execs with this process's environ:
     * make it the policy's (prepared by the parent), not the caller's, so
     * no secret of the parent reaches the program.  An explicit env= is
     * passed to execve by subprocess and is not affected. */
    if (plan->envp)
        environ = (char **)plan->envp;
    return 0;
}

/* No namespaces: H forks the program (Y) and execs the init, which
 * subprocess then waits for: it forwards signals, reaps the orphans as a
 * subreaper and, when the caller dies, kills the whole tree.  A failure of
 * Y's steps reaches subprocess through its error pipe (Y shares it); the
 * init then reports Y's exit. */
static int watched_program(const struct iso_plan *plan, int parent_pid, struct iso_failure *failure)
{
    int step;
    /* A subreaper before the program exists: the program's orphans must
     * come to the init even before it has exec'd (see spawn.c). */
    if (prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) < 0)
        return fail(failure, ISO_STEP_INIT, -1);
    pid_t program = fork();
    if (program < 0)
        return fail(failure, ISO_STEP_FORK, -1);
    if (program == 0) {
        /* The group the init kills first (setsid above made H its leader). */
        if (setpgid(0, 0) < 0)
            return fail(failure, ISO_STEP_SETSID, -1);
        return program_steps(plan, failure, plan->cwd);
    }
    if ((step = iso_creds_apply(plan)))
        return fail(failure, step, -1);
    if ((step = iso_no_new_privs()))
        return fail(failure, step, -1);
    char pid_arg[16], wall_arg[32], parent_arg[16];
    snprintf(pid_arg, sizeof pid_arg, "%d", program);
    snprintf(wall_arg, sizeof wall_arg, "%lld", plan->wall_ms);
    snprintf(parent_arg, sizeof parent_arg, "%d", parent_pid);
    /* No errno table, no supervisor (preexec_fn has none), the caller to watch. */
    char *argv[] = {"isolate-init", pid_arg, "-1", "-1", wall_arg, "", "", parent_arg, NULL};
    char *envp[] = {NULL};
    syscall(SYS_execveat, plan->init_fd, "", argv, envp, AT_EMPTY_PATH);
    return fail(failure, ISO_STEP_INIT, -1);
}

int iso_preexec(const struct iso_plan *plan, int parent_pid, struct iso_failure *failure)
{
    int index = -1, step;
    failure->step = ISO_STEP_NONE;
    failure->err = 0;
    failure->index = -1;

    if (plan->new_session && setsid() < 0 && errno != EPERM)
        return fail(failure, ISO_STEP_SETSID, -1);
    if (plan->clone_flags == 0 && plan->die_with_parent && parent_pid > 0)
        return watched_program(plan, parent_pid, failure);
    if (plan->clone_flags == 0)
        return program_steps(plan, failure, plan->cwd);

    /* The program keeps the working directory subprocess gave it, seen
     * through the new root (where the policy must have bound it). */
    char cwd[PATH_MAX];
    const char *program_cwd = plan->cwd;
    if (!program_cwd) {
        if (!getcwd(cwd, sizeof cwd))
            return fail(failure, ISO_STEP_CHDIR, -1);
        program_cwd = cwd;
    }
    /* Idmapped trees are consumed by the mount that attaches them, so a
     * hook that may run many times opens them here, while it still has the
     * caller's privilege (this process is a private copy of the plan). */
    for (int i = 0; i < plan->n_mounts; i++) {
        struct iso_mount *m = (struct iso_mount *)&plan->mounts[i];
        if (m->kind == ISO_MOUNT_MOVE && m->fd < 0) {
            m->fd = iso_open_idmapped_tree(m->source, plan->idmap_userns_fd);
            if (m->fd < 0)
                return fail(failure, ISO_STEP_IDMAP, i);
        }
    }
    if ((plan->clone_flags & CLONE_NEWUSER) && unshare_user(plan) < 0)
        return fail(failure, ISO_STEP_USERNS_MAP, -1);
    if (unshare(plan->clone_flags & ~CLONE_NEWUSER) < 0)
        return fail(failure, ISO_STEP_UNSHARE, -1);
    if (plan->hostname && sethostname(plan->hostname, strlen(plan->hostname)) < 0)
        return fail(failure, ISO_STEP_HOSTNAME, -1);
    if (plan->loopback_up && (step = iso_loopback_up()))
        return fail(failure, step, -1);

    /* Y1 must die with H, but the parent-death signal it sets is cleared by
     * its change of credentials and set again only after it: H killed in
     * that gap (a subprocess timeout, on a slow host) left Y1 and the
     * program running.  A pidfd of H, inherited by Y1, tells it afterwards
     * whether H has already ended.  Kernels before 5.3 have none: they keep
     * the gap. */
    int relay_fd = (int)syscall(SYS_pidfd_open, getpid(), 0);
    pid_t first = fork();
    if (first < 0)
        return fail(failure, ISO_STEP_FORK, -1);
    if (first > 0) {
        if (relay_fd >= 0)
            close(relay_fd);
        /* H: relay the program's end to subprocess, which waits for us.
         * The relay holds the new namespace's capabilities: drop them too. */
        if ((step = iso_creds_apply(plan)))
            return fail(failure, step, -1);
        /* After the ids: a change of credentials clears the parent-death
         * signal (set before, a root caller's relay outlived its caller and
         * so did PID 1 of the namespace).  A caller that died before this
         * point is seen as a new parent. */
        if (plan->die_with_parent && iso_die_with_parent())
            return fail(failure, ISO_STEP_PDEATHSIG, -1);
        if (plan->die_with_parent && parent_pid > 0 && getppid() != parent_pid) {
            errno = ESRCH;
            return fail(failure, ISO_STEP_PDEATHSIG, -1);
        }
        if ((step = iso_no_new_privs()))
            return fail(failure, step, -1);
        exec_init(plan, first, 1, parent_pid);
        return fail(failure, ISO_STEP_INIT, -1);
    }
    /* Y1: PID 1 of the new namespace.  It dies with the relay, whatever
     * kills it (a subprocess timeout kills only the process it knows); set
     * now for the setup, and again once its ids are final (a change of
     * credentials clears it). */
    if (prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) < 0)
        return fail(failure, ISO_STEP_PDEATHSIG, -1);
    if ((plan->clone_flags & CLONE_NEWNS) && (step = iso_mounts_apply(plan, &index)))
        return fail(failure, step, index);
    pid_t program = fork();
    if (program < 0)
        return fail(failure, ISO_STEP_FORK, -1);
    if (program == 0)
        return program_steps(plan, failure, program_cwd);
    if ((step = iso_creds_apply(plan)))
        return fail(failure, step, -1);
    if ((step = iso_die_with_parent()))
        return fail(failure, step, -1);
    if (relay_fd >= 0) {
        /* The signal is armed again: H ending from now on kills us; H
         * already ended reads as the pidfd being readable.  Our end takes
         * the program's (PID 1's end kills the namespace). */
        struct pollfd ended = {.fd = relay_fd, .events = POLLIN};
        int ready;
        do {
            ready = poll(&ended, 1, 0);
        } while (ready < 0 && errno == EINTR);
        if (ready > 0)
            _exit(127);
        close(relay_fd);
    }
    if ((step = iso_no_new_privs()))
        return fail(failure, step, -1);
    exec_init(plan, program, 0, 0);
    return fail(failure, ISO_STEP_INIT, -1);
}
