/*
 * spawn.c - start a sandbox without copying the parent.
 *
 * fork() from a large Python process copies its page tables (about 20 ms
 * per GiB).  Instead the parent clone()s with CLONE_VM: the child runs on a
 * stack of its own inside the parent's memory, touching nothing but that
 * stack and the read-only plan, until it execs.
 *
 *   parent ──clone(CLONE_VM | CLONE_NEW*)──> first child (PID 1 inside)
 *     writes the child's id maps, says "go";
 *   first child: session, mounts, pivot_root, hostname, loopback, then
 *     clone(CLONE_VM | CLONE_VFORK | CLONE_FILES) ──> program child:
 *       its cgroups, stdio, chdir, rlimits, ids, capabilities, no_new_privs, Landlock,
 *       descriptors, seccomp, exec;
 *     once the program child has exec'd, the first child gives up its
 *     credentials too and execs the init (a small static binary, opened by
 *     the parent), which reaps, forwards signals, enforces the wall clock,
 *     answers seccomp notifications and reports the program's end.
 *
 * Failures travel through a close-on-exec pipe as struct iso_failure; end
 * of file on it means both execs happened.  The parent blocks every signal
 * around clone() so that no handler of the parent runs in the child.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
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

#ifndef AT_EMPTY_PATH
#define AT_EMPTY_PATH 0x1000
#endif

#ifndef SYS_pidfd_open
#define SYS_pidfd_open 434
#endif

#define ISO_STACK_SIZE (256 * 1024)

/* Shared by the parent and both children; lives at the bottom of the
 * children's stack mapping, so it outlives iso_spawn()'s own frame. */
struct spawn_ctx {
    const struct iso_plan *plan;
    int err_fd;
    int err_read_fd;    /* the parent's ends, closed first thing in the child, */
    int sync_write_fd;  /* so that a parent that gives up is seen as end of file */
    int sync_fd;
    int listener_fd;
    pid_t parent_pid;   /* the caller's process, which the init watches without a PID namespace */
    int parent_pidfd;   /* with one: a pidfd of the caller's process (-1: none; see first_main) */
    volatile int program_failed;
    /* The program child's failure, left here (it shares this memory) for the first child to report: the
     * program child's own write would go through the profile's seccomp filter, and a profile that refuses
     * write (or kills on it) made a failed start an exit 127 with nothing said. */
    struct iso_failure program_failure;
    char *program_stack_top;
    uint64_t ignored;   /* the caller's ignored signals the program keeps ignored (plan->keep_ignored) */
};

void iso_report(int fd, int step, int err, int index)
{
    struct iso_failure failure = {.step = step, .err = err, .index = index};
    ssize_t n;
    do {
        /* Marked: a seccomp profile that denies write answers it plainly instead of asking the init,
         * which is not running yet (see ISO_EXEC_MARK); the kernel ignores the extra arguments. */
        n = syscall(SYS_write, fd, &failure, sizeof failure, 0L, 0L, (long)ISO_EXEC_MARK);
    } while (n < 0 && errno == EINTR);
    /* If the parent is gone there is no one left to tell. */
}

/* The program child: the last steps, in the order the header describes. */
static int program_main(void *arg)
{
    struct spawn_ctx *ctx = arg;
    const struct iso_plan *plan = ctx->plan;
    int index = -1;
    int step;

    /* Join the run's cgroups first, from here and not from the parent.  The
     * first child shares the caller's memory (CLONE_VM) until it execs the
     * init, and the OOM killer kills every process that shares its victim's
     * memory: with the first child in the run's memory cgroup, a program
     * that reached its limit early (or a limit too small for the setup)
     * could have the caller killed, a Python process or a server holding
     * other sandboxes.  This child is a vfork child, which the OOM killer
     * never picks, and from its exec on it has a memory of its own; the
     * first child and the init stay outside the limits.  Writing "0" moves
     * the writer; the kernel checks the descriptor's opener, the parent
     * (Linux 5.16, and the stable kernels the fix went back to). */
    for (int i = 0; i < 8 && plan->cgroup_procs_fds[i] >= 0; i++) {
        if (write(plan->cgroup_procs_fds[i], "0", 1) != 1) {
            index = i;
            step = ISO_STEP_CGROUP;
            goto fail;
        }
    }
    if ((step = iso_stdio_apply(plan)))
        goto fail;
    if (plan->cwd && chdir(plan->cwd) < 0) {
        step = ISO_STEP_CHDIR;
        goto fail;
    }
    if (!(plan->clone_flags & CLONE_NEWPID) && setpgid(0, 0) < 0) {
        /* Without a PID namespace the init ends the program's group. */
        step = ISO_STEP_SETSID;
        goto fail;
    }
    if ((step = iso_rlimits_apply(plan, &index, 0)))
        goto fail;
    if ((step = iso_creds_apply(plan)))
        goto fail;
    if (plan->die_with_parent && (step = iso_die_with_parent()))
        goto fail;
    if (plan->no_new_privs && (step = iso_no_new_privs()))
        goto fail;
    if ((step = iso_landlock_apply(plan, &index)))
        goto fail;
    {
        /* The setup's descriptors are close-on-exec; they must survive
         * until exec (the error pipe reports exec itself). */
        /* program_fd is a kept sandbox's program (the init binary again):
         * usually the very descriptor init_fd is, but nothing promises it. */
        int keep[] = {ctx->err_fd,        plan->status_fd,  plan->init_fd, plan->why ? plan->why_stream_fd : -1,
                      ctx->parent_pidfd, plan->program_fd};
        if ((step = iso_close_fds(plan, keep, 6)))
            goto fail;
    }
    if ((step = iso_rlimits_apply(plan, &index, 1)))
        goto fail;
    if (ctx->ignored && (step = iso_signals_ignore(ctx->ignored)))
        goto fail;
    if ((step = iso_signals_unblock()))
        goto fail;
    if ((step = iso_seccomp_apply(plan, &ctx->listener_fd)))
        goto fail;
    step = iso_exec_program(plan, ISO_EXEC_MARK);
fail:
    ctx->program_failure.step = step;
    ctx->program_failure.err = errno;
    ctx->program_failure.index = index;
    ctx->program_failed = 1;
    _exit(127);
}

static int first_main(void *arg)
{
    struct spawn_ctx *ctx = arg;
    const struct iso_plan *plan = ctx->plan;
    int index = -1;
    int step = 0;
    char go;
    ssize_t n;

    close(ctx->sync_write_fd);
    close(ctx->err_read_fd);
    /* The init's dispositions are all default (it must never ignore SIGCHLD, say); the program child's
     * ignored ones are set again in it. */
    uint64_t ignored;
    if ((step = iso_signals_reset(&ignored)))
        goto fail;
    ctx->ignored = ignored & plan->keep_ignored;
    do {
        n = read(ctx->sync_fd, &go, 1);
    } while (n < 0 && errno == EINTR);
    if (n != 1) {
        /* The parent could not write the maps and closed the pipe. */
        if (n == 0)
            errno = EPIPE;
        step = ISO_STEP_WAIT_PARENT;
        goto fail;
    }
    close(ctx->sync_fd);
    /* The setup runs in the namespace's root group (a raw call, as caps.c's): the caller's own group already,
     * but where an image User's private range maps the inside's 0 past the host's (kernel/privateids.py),
     * so that what the setup makes (mount points, the upper layer's directories) is root's group inside. */
    if (plan->set_ids && (plan->clone_flags & CLONE_NEWUSER) && syscall(SYS_setresgid, 0, 0, 0) < 0) {
        step = ISO_STEP_SETGID;
        goto fail;
    }
    if (plan->new_session && setsid() < 0) {
        step = ISO_STEP_SETSID;
        goto fail;
    }
    if ((plan->clone_flags & CLONE_NEWNS) && (step = iso_mounts_apply(plan, &index)))
        goto fail;
    if (plan->hostname && sethostname(plan->hostname, strlen(plan->hostname)) < 0) {
        step = ISO_STEP_HOSTNAME;
        goto fail;
    }
    if (plan->loopback_up && (step = iso_loopback_up()))
        goto fail;
    /* n_egress_ports too: a plan zeroed by someone who never heard of egress
     * (egress_fd 0) must not send anything down descriptor 0. */
    if (plan->egress_fd >= 0 && plan->n_egress_ports > 0 && (step = iso_egress_listen(plan)))
        goto fail;

    /* Without a PID namespace the init sweeps the tree as a subreaper; it
     * must be one before the program runs.  Set later (by the init itself),
     * a daemon the program double-forked while this process was still on
     * its way to the init's exec went to the host's init and outlived the
     * run (seen under load).  The attribute survives exec. */
    if (!(plan->clone_flags & CLONE_NEWPID) && prctl(PR_SET_CHILD_SUBREAPER, 1, 0, 0, 0) < 0) {
        step = ISO_STEP_INIT;
        goto fail;
    }
    int program = clone(program_main, ctx->program_stack_top, CLONE_VM | CLONE_VFORK | CLONE_FILES | SIGCHLD, ctx);
    if (program < 0) {
        step = ISO_STEP_FORK;
        goto fail;
    }
    if (ctx->program_failed) {
        /* Said from here, which no seccomp filter confines (the program child's filter is its own). */
        iso_report(ctx->err_fd, ctx->program_failure.step, ctx->program_failure.err, ctx->program_failure.index);
        _exit(127);
    }

    /* Become the init.  It holds the same credentials as the program, no
     * capability, and lets only its own descriptors through exec. */
    if ((step = iso_creds_apply(plan)))
        goto fail_kill;
    /* In a PID namespace the init's death ends every process in it.  It
     * watches the caller's process through the pidfd the caller opened for
     * it; a parent-death signal would follow the caller's thread that
     * cloned us, and a sandbox started from a worker thread would die with
     * that thread.  Only where pidfd_open is missing (before Linux 5.3) is
     * the signal the watch.  Without a PID namespace the init must outlive
     * its parent long enough to sweep the tree: it watches the parent by
     * pid (see init.c) instead of being killed with it. */
    if (plan->die_with_parent && (plan->clone_flags & CLONE_NEWPID) && ctx->parent_pidfd < 0 &&
        (step = iso_die_with_parent()))
        goto fail_kill;
    if (ctx->parent_pidfd >= 0 && fcntl(ctx->parent_pidfd, F_SETFD, 0) < 0) {
        step = ISO_STEP_PDEATHSIG;
        goto fail_kill;
    }
    if ((step = iso_no_new_privs()))
        goto fail_kill;
    int why_stream = plan->why && plan->why_stream_fd >= 0 ? plan->why_stream_fd : -1;
    if ((why_stream >= 0 && fcntl(why_stream, F_SETFD, 0) < 0) || fcntl(plan->status_fd, F_SETFD, 0) < 0 ||
        (ctx->listener_fd >= 0 && fcntl(ctx->listener_fd, F_SETFD, 0) < 0)) {
        step = ISO_STEP_INIT;
        goto fail_kill;
    }
    {
        char pid_arg[16], status_arg[16], listener_arg[16], wall_arg[32], stream_arg[16];
        snprintf(stream_arg, sizeof stream_arg, "%d", why_stream);
        snprintf(pid_arg, sizeof pid_arg, "%d", program);
        snprintf(status_arg, sizeof status_arg, "%d", plan->status_fd);
        snprintf(listener_arg, sizeof listener_arg, "%d", ctx->listener_fd);
        snprintf(wall_arg, sizeof wall_arg, "%lld", plan->wall_ms);
        char parent_arg[32];
        int watch = plan->die_with_parent && !(plan->clone_flags & CLONE_NEWPID);
        if (ctx->parent_pidfd >= 0)
            snprintf(parent_arg, sizeof parent_arg, "pidfd:%d", ctx->parent_pidfd);
        else
            snprintf(parent_arg, sizeof parent_arg, "%d", watch ? (int)ctx->parent_pid : 0);
        char *errnos = plan->seccomp_errnos ? (char *)plan->seccomp_errnos : "";
        char *supervise = plan->supervise ? (char *)plan->supervise : "";
        /* A kept sandbox's exec server (run through program_fd) must never stay stopped: see init.c. */
        char *keep_running = plan->program_fd >= 0 ? "1" : "0";
        char *why = plan->why ? (char *)plan->why : "";
        char *argv[] = {"isolate-init", pid_arg, status_arg, listener_arg, wall_arg, errnos, supervise, parent_arg,
                        keep_running, why, stream_arg, NULL};
        char *envp[] = {NULL};
        syscall(SYS_execveat, plan->init_fd, "", argv, envp, AT_EMPTY_PATH);
    }
    step = ISO_STEP_INIT;
fail_kill:;
    int saved = errno;
    kill(program, SIGKILL);
    errno = saved;
fail:
    iso_report(ctx->err_fd, step, errno, index);
    _exit(125);
}

int iso_spawn(const struct iso_plan *plan, struct iso_failure *failure)
{
    int err_pipe[2], sync_pipe[2];
    failure->step = ISO_STEP_NONE;
    failure->err = 0;
    failure->index = -1;

    if (pipe2(err_pipe, O_CLOEXEC) < 0) {
        failure->step = ISO_STEP_CLONE;
        failure->err = errno;
        return -1;
    }
    if (pipe2(sync_pipe, O_CLOEXEC) < 0) {
        failure->step = ISO_STEP_CLONE;
        failure->err = errno;
        close(err_pipe[0]);
        close(err_pipe[1]);
        return -1;
    }
    /* [ctx | guard | program stack | guard | first child's stack], stacks
     * growing down; an overflow faults on a guard page instead of silently
     * writing into the other region. */
    size_t page = (size_t)sysconf(_SC_PAGESIZE);
    size_t size = 3 * page + 2 * ISO_STACK_SIZE;
    char *mem = mmap(NULL, size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK, -1, 0);
    if (mem == MAP_FAILED) {
        failure->step = ISO_STEP_CLONE;
        failure->err = errno;
        close(err_pipe[0]);
        close(err_pipe[1]);
        close(sync_pipe[0]);
        close(sync_pipe[1]);
        return -1;
    }
    if (mprotect(mem + page, page, PROT_NONE) < 0 || mprotect(mem + 2 * page + ISO_STACK_SIZE, page, PROT_NONE) < 0) {
        failure->step = ISO_STEP_CLONE;
        failure->err = errno;
        munmap(mem, size);
        close(err_pipe[0]);
        close(err_pipe[1]);
        close(sync_pipe[0]);
        close(sync_pipe[1]);
        return -1;
    }
    struct spawn_ctx *ctx = (struct spawn_ctx *)mem;
    ctx->plan = plan;
    ctx->err_fd = err_pipe[1];
    ctx->err_read_fd = err_pipe[0];
    ctx->sync_write_fd = sync_pipe[1];
    ctx->sync_fd = sync_pipe[0];
    ctx->listener_fd = -1;
    ctx->parent_pid = getpid();
    /* A failure leaves -1: the init then falls back on the parent-death signal. */
    ctx->parent_pidfd = plan->die_with_parent && (plan->clone_flags & CLONE_NEWPID)
                            ? (int)syscall(SYS_pidfd_open, ctx->parent_pid, 0)
                            : -1;
    ctx->program_failed = 0;
    ctx->program_stack_top = mem + 2 * page + ISO_STACK_SIZE;

    /* Every signal stays blocked in this thread until the children are done
     * with the shared memory: no handler may run in a child, and no EINTR
     * may cut the parent's reads short while a child shares its errno. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    /* A network namespace made ahead of the run (iso_make_netns): this
     * thread joins it for the clone, so that the child is born in it, and
     * goes back at once (the plan's flags lack CLONE_NEWNET then).  If it
     * cannot be joined, the clone makes one, as without it. */
    int flags = plan->clone_flags, netns_back = -1;
    if (plan->netns_fd > 0 && !(flags & CLONE_NEWNET)) {
        netns_back = open("/proc/thread-self/ns/net", O_RDONLY | O_CLOEXEC);
        if (netns_back >= 0 && setns(plan->netns_fd, CLONE_NEWNET) < 0) {
            close(netns_back);
            netns_back = -1;
        }
        if (netns_back < 0)
            flags |= CLONE_NEWNET;
    }
    int pid = clone(first_main, mem + size, CLONE_VM | flags | SIGCHLD, ctx);
    int clone_errno = errno;
    if (netns_back >= 0) {
        if (setns(netns_back, CLONE_NEWNET) < 0 && pid >= 0) {
            /* This thread is left in the sandbox's namespace, which has no
             * way out: the run fails, and so will this thread's sockets. */
            clone_errno = errno;
            kill(pid, SIGKILL);
            while (waitpid(pid, NULL, 0) < 0 && errno == EINTR)
                ;
            pid = -1;
        }
        close(netns_back);
    }
    close(err_pipe[1]);
    close(sync_pipe[0]);
    if (ctx->parent_pidfd >= 0)
        close(ctx->parent_pidfd); /* the child has its own copy (no CLONE_FILES) */

    if (pid < 0) {
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        failure->step = ISO_STEP_CLONE;
        failure->err = clone_errno;
        close(err_pipe[0]);
        close(sync_pipe[1]);
        munmap(mem, size);
        return -1;
    }

    if ((plan->clone_flags & CLONE_NEWUSER) && iso_write_id_maps(pid, plan) < 0) {
        failure->step = ISO_STEP_USERNS_MAP;
        failure->err = errno;
    }
    /* The first child is not put in the run's cgroups: the program child
     * joins them itself (program_main says why). */
    if (failure->step == ISO_STEP_NONE) {
        ssize_t w;
        do {
            w = write(sync_pipe[1], "g", 1);
        } while (w < 0 && errno == EINTR);
        if (w != 1) {
            failure->step = ISO_STEP_WAIT_PARENT;
            failure->err = w < 0 ? errno : EPIPE;
        }
    }
    /* Closing without "go" makes the child fail at WAIT_PARENT and exit. */
    close(sync_pipe[1]);

    struct iso_failure reported;
    size_t got = 0;
    while (got < sizeof reported) {
        ssize_t n = read(err_pipe[0], (char *)&reported + got, sizeof reported - got);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            break;
        got += (size_t)n;
    }
    close(err_pipe[0]);
    if (got == sizeof reported && failure->step == ISO_STEP_NONE)
        *failure = reported;

    if (failure->step != ISO_STEP_NONE) {
        /* Make sure it ends, and reap it before freeing its stack. */
        kill(pid, SIGKILL);
        while (waitpid(pid, NULL, 0) < 0 && errno == EINTR)
            ;
        munmap(mem, size);
        pthread_sigmask(SIG_SETMASK, &old, NULL);
        return -1;
    }
    /* End of file: both children have exec'd, none uses this memory now. */
    munmap(mem, size);
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    return pid;
}
