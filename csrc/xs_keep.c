/*
 * xs_keep.c - descriptors the host leaves with the exec server, to take
 * again after its own restart (see execserver.c).
 *
 * A persistent shell's pipes and status channel have their far ends in the
 * host's process: when that process ends (an upgrade, a crash, a kill -9 of
 * `isolate-run serve`), the shell reads the end of its input and exits.  A
 * host that wants the shell to outlive it hands copies of its ends here
 * (KEEP): the server, a process of the sandbox that the sandbox's own
 * processes cannot ptrace or take descriptors from (it is not dumpable, and
 * the default filter refuses pidfd_getfd), holds them, so the shell never
 * sees its input end; the next host takes copies back (TAKE), one at a time,
 * and carries on.  What is held is the host's word alone: only the host's
 * connections reach here (execserver.c checks each peer), nothing here
 * reads or writes the descriptors, and a command never inherits them (they
 * are close-on-exec, and the monitors close them at their fork).
 */
#define _GNU_SOURCE
#include "execserver.h"

/* Keys held at once, and descriptors per key. */
#define MAX_KEPT 64
#define KEPT_FDS 3
#define KEY_MAX 64

struct kept {
    char key[KEY_MAX + 1];
    int fds[KEPT_FDS];
    int n_fds;
    int32_t note;
};

static struct kept kept[MAX_KEPT];
static int n_kept;

static int find_key(const char *key)
{
    for (int i = 0; i < n_kept; i++)
        if (!strcmp(kept[i].key, key))
            return i;
    return -1;
}

static void let_go(int i)
{
    for (int j = 0; j < kept[i].n_fds; j++)
        close(kept[i].fds[j]);
    kept[i] = kept[--n_kept];
}

/* Whether what key i holds serves no one any more: its first descriptor is
 * the write end of a pipe (a shell's input) whose readers have all gone
 * (poll says POLLERR), its shell ended.  A host that could not let go of a
 * key (the sandbox was paused, the host was killed in between) leaves it
 * so; a full table lets those go first. */
static int ended(int i)
{
    struct pollfd p = {.fd = kept[i].fds[0], .events = 0};
    return poll(&p, 1, 0) == 1 && (p.revents & (POLLERR | POLLNVAL));
}

void xs_keep_close_all(void)
{
    for (int i = 0; i < n_kept; i++)
        for (int j = 0; j < kept[i].n_fds; j++)
            close(kept[i].fds[j]);
    n_kept = 0;
}

/* The lowest descriptor number a kept one may not take: half the server's
 * open-files limit (the sandbox's).  The other half stays for its own work
 * (its conversations, a command's descriptors in flight, the socket pair of
 * each monitor it forks): under a low limit a sandbox keeps fewer shells
 * (EMFILE), never an exec server that cannot start a command (a request
 * whose descriptors find no room is lost, and a monitor that cannot be
 * forked ends the sandbox). */
static int kept_ceiling(void)
{
    struct rlimit most;
    if (getrlimit(RLIMIT_NOFILE, &most) < 0 || most.rlim_cur == RLIM_INFINITY || most.rlim_cur > (1U << 20))
        return 1 << 19;
    return (int)(most.rlim_cur / 2);
}

static int keep(const struct request *req, const char *key)
{
    int i = find_key(key);
    if (req->n_fds == 0) {
        if (i < 0)
            return -ENOENT;
        let_go(i);
        return 0;
    }
    if (req->n_fds > KEPT_FDS)
        return -EINVAL;
    struct kept next = {.n_fds = 0, .note = req->head.mode};
    memcpy(next.key, key, strlen(key) + 1);
    /* Copies of the request's descriptors: those are closed after the
     * request, as every request's are. */
    int ceiling = kept_ceiling();
    for (int j = 0; j < req->n_fds; j++) {
        int fd = fcntl(req->fds[j], F_DUPFD_CLOEXEC, 3);
        if (fd >= ceiling) {
            close(fd);
            fd = -1;
            errno = EMFILE;
        }
        if (fd < 0) {
            int err = errno;
            for (int k = 0; k < next.n_fds; k++)
                close(next.fds[k]);
            return -err;
        }
        next.fds[next.n_fds++] = fd;
    }
    if (i >= 0) {
        for (int j = 0; j < kept[i].n_fds; j++)
            close(kept[i].fds[j]);
        kept[i] = next;
        return 0;
    }
    for (int j = n_kept - 1; n_kept >= MAX_KEPT && j >= 0; j--)
        if (ended(j))
            let_go(j);
    if (n_kept < MAX_KEPT) {
        kept[n_kept++] = next;
    } else {
        for (int k = 0; k < next.n_fds; k++)
            close(next.fds[k]);
        return -ENOSPC;
    }
    return 0;
}

void xs_keep_op(int conn, const struct request *req)
{
    const char *key = req->head.n_strings > 0 ? req->strings[0] : NULL;
    if (!key || !key[0] || strlen(key) > KEY_MAX) {
        xs_reply_kind(conn, ISO_XS_ERROR, EINVAL);
        return;
    }
    if (req->head.op == ISO_XS_KEEP) {
        int rc = keep(req, key);
        xs_reply_kind(conn, rc < 0 ? ISO_XS_ERROR : ISO_XS_OK, rc < 0 ? -rc : 0);
        return;
    }
    int i = find_key(key);
    if (i < 0 || req->head.mode < 0 || req->head.mode >= kept[i].n_fds) {
        xs_reply_kind(conn, ISO_XS_ERROR, i < 0 ? ENOENT : EINVAL);
        return;
    }
    struct iso_xs_reply reply = {.magic = ISO_XS_MAGIC, .kind = ISO_XS_OK, .pid = kept[i].note};
    xs_send_reply(conn, &reply, NULL, 0, kept[i].fds[req->head.mode]);
}
