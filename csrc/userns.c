/*
 * userns.c - user namespace id maps, written by the parent.
 *
 * A child in a new user namespace may map only its own euid, and only
 * after giving up setgroups.  A root caller must map the program to an
 * unprivileged uid (65534 unless asked otherwise) and keep setgroups so the
 * child can drop root's supplementary groups: only a process outside the
 * namespace, holding CAP_SETUID there, may write such maps.  So the parent
 * writes them while the child waits on a pipe.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <sched.h>
#include <signal.h>
#include <spawn.h>
#include <stdint.h>
#include <stdio.h>
#include <string.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <sys/wait.h>
#include <unistd.h>

#include "steps.h"

static int write_file_at_pid(int pid, const char *name, const char *text)
{
    char path[64];
    snprintf(path, sizeof path, "/proc/%d/%s", pid, name);
    int fd = open(path, O_WRONLY | O_CLOEXEC);
    if (fd < 0)
        return -1;
    size_t len = strlen(text);
    ssize_t n = write(fd, text, len);
    int saved = errno;
    close(fd);
    if (n != (ssize_t)len) {
        errno = n < 0 ? saved : EIO;
        return -1;
    }
    return 0;
}

/* Maps at most this many lines long, and so many bytes: the plan's are two
 * lines (the caller's own id, then its subordinate range). */
#define MAP_HELPER_LINES 4
#define MAP_HELPER_TEXT 256

/* Run a set-id map helper (newuidmap PID INSIDE OUTSIDE COUNT ...) for the
 * map text given, and wait for it: it checks the ranges against
 * /etc/subuid itself, as root, and writes them where this caller may not.
 * Runs in the parent (never in a child sharing its memory) with every
 * signal blocked: the helper gets them back, default and unblocked. */
static int run_map_helper(const char *helper, int pid, const char *map)
{
    char text[MAP_HELPER_TEXT], pid_text[16];
    char *argv[2 + 3 * MAP_HELPER_LINES + 1];
    size_t len = strlen(map);
    if (len >= sizeof text) {
        errno = E2BIG;
        return -1;
    }
    memcpy(text, map, len + 1);
    snprintf(pid_text, sizeof pid_text, "%d", pid);
    int argc = 0;
    argv[argc++] = (char *)helper;
    argv[argc++] = pid_text;
    for (char *save = NULL, *word = strtok_r(text, " \n", &save); word; word = strtok_r(NULL, " \n", &save)) {
        if (argc >= 2 + 3 * MAP_HELPER_LINES) {
            errno = E2BIG;
            return -1;
        }
        argv[argc++] = word;
    }
    argv[argc] = NULL;
    if ((argc - 2) % 3 != 0 || argc == 2) {
        errno = EINVAL;
        return -1;
    }
    posix_spawnattr_t attr;
    int err = posix_spawnattr_init(&attr);
    if (err) {
        errno = err;
        return -1;
    }
    sigset_t none, all;
    sigemptyset(&none);
    sigfillset(&all);
    err = posix_spawnattr_setflags(&attr, POSIX_SPAWN_SETSIGMASK | POSIX_SPAWN_SETSIGDEF);
    if (!err)
        err = posix_spawnattr_setsigmask(&attr, &none);
    if (!err)
        err = posix_spawnattr_setsigdefault(&attr, &all);
    char *envp[] = {"PATH=/usr/sbin:/usr/bin:/sbin:/bin", NULL};
    int helper_pid = -1;
    if (!err)
        err = posix_spawn(&helper_pid, helper, NULL, &attr, argv, envp);
    posix_spawnattr_destroy(&attr);
    if (err) {
        errno = err;
        return -1;
    }
    int status;
    while (waitpid(helper_pid, &status, 0) < 0) {
        if (errno != EINTR)
            return -1;
    }
    if (!WIFEXITED(status) || WEXITSTATUS(status) != 0) {
        /* The helper said why on standard error; the kernel's word is EPERM. */
        errno = EPERM;
        return -1;
    }
    return 0;
}

int iso_write_id_maps(int pid, const struct iso_plan *plan)
{
    if (plan->newuidmap && plan->newgidmap) {
        /* newgidmap leaves setgroups allowed where the range maps the
         * caller's own group, so the child can drop the supplementary
         * groups (clear_groups); it is never written here. */
        if (run_map_helper(plan->newuidmap, pid, plan->uid_map) < 0)
            return -1;
        return run_map_helper(plan->newgidmap, pid, plan->gid_map);
    }
    if (plan->setgroups_deny && write_file_at_pid(pid, "setgroups", "deny") < 0)
        return -1;
    if (write_file_at_pid(pid, "uid_map", plan->uid_map) < 0)
        return -1;
    if (write_file_at_pid(pid, "gid_map", plan->gid_map) < 0)
        return -1;
    return 0;
}

static int idle_child(void *arg)
{
    /* Wait to be killed: the parent only needs this namespace to exist.  Killed with the parent too: a
     * parent that dies between the clone and its kill (a signal during a sandbox's start, SIGKILL from a
     * supervisor) left this process paused for ever, holding the parent's descriptors (its stdout: a
     * reader waited for ever too).  Checked once more after: the parent may be gone already. */
    pid_t parent = (pid_t)(intptr_t)arg;
    if (prctl(PR_SET_PDEATHSIG, SIGKILL, 0, 0, 0) < 0 || getppid() != parent)
        _exit(0);
    for (;;)
        pause();
    return 0;
}

int iso_make_idmap_userns(uint32_t outside_uid, uint32_t outside_gid)
{
    return iso_make_idmap_userns_of(0, 0, outside_uid, outside_gid);
}

int iso_make_idmap_userns_of(uint32_t inside_uid, uint32_t inside_gid, uint32_t outside_uid, uint32_t outside_gid)
{
    char uid_map[48], gid_map[48];
    snprintf(uid_map, sizeof uid_map, "%u %u 1\n", inside_uid, outside_uid);
    snprintf(gid_map, sizeof gid_map, "%u %u 1\n", inside_gid, outside_gid);
    return iso_make_userns_maps(uid_map, gid_map);
}

int iso_make_userns_maps(const char *uid_map, const char *gid_map)
{
    const size_t stack_size = 64 * 1024;
    char *stack = mmap(NULL, stack_size, PROT_READ | PROT_WRITE, MAP_PRIVATE | MAP_ANONYMOUS | MAP_STACK, -1, 0);
    if (stack == MAP_FAILED)
        return -1;
    /* The child shares this memory: no handler of the parent may run in it,
     * so it starts (and stays, until SIGKILL) with every signal blocked. */
    sigset_t all, old;
    sigfillset(&all);
    pthread_sigmask(SIG_SETMASK, &all, &old);
    int pid = clone(idle_child, stack + stack_size, CLONE_VM | CLONE_NEWUSER | SIGCHLD, (void *)(intptr_t)getpid());
    pthread_sigmask(SIG_SETMASK, &old, NULL);
    if (pid < 0) {
        int saved = errno;
        munmap(stack, stack_size);
        errno = saved;
        return -1;
    }
    char path[64];
    int fd = -1;
    /* Nothing will ever run in this namespace; "deny" lets an unprivileged
     * caller (the doctor's probe) write its gid_map too. */
    if (write_file_at_pid(pid, "setgroups", "deny") == 0 && write_file_at_pid(pid, "uid_map", uid_map) == 0 &&
        write_file_at_pid(pid, "gid_map", gid_map) == 0) {
        snprintf(path, sizeof path, "/proc/%d/ns/user", pid);
        fd = open(path, O_RDONLY | O_CLOEXEC);
    }
    int saved = errno;
    kill(pid, SIGKILL);
    while (waitpid(pid, NULL, 0) < 0 && errno == EINTR)
        ;
    munmap(stack, stack_size);
    errno = saved;
    return fd;
}

int iso_probe_userns(void)
{
    int fd = iso_make_idmap_userns((uint32_t)geteuid(), (uint32_t)getegid());
    if (fd < 0)
        return errno ? errno : EPERM;
    close(fd);
    return 0;
}
