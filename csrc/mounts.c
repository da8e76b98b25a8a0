/*
 * mounts.c - the sandbox's own root, built from nothing.
 *
 * In its new mount namespace the child:
 *   1. makes every mount private, so nothing it does propagates to the host;
 *   2. mounts a staging tmpfs on plan->staging and pivots into it, which puts
 *      the host's root at /oldroot (a source under the staging directory,
 *      such as /tmp/work, stays reachable there);
 *   3. mounts an empty tmpfs at /newroot and walks plan->mounts: directories,
 *      binds of host paths (read-only ones made read-only recursively with
 *      mount_setattr, which keeps the locked flags a user namespace may not
 *      clear), tmpfs, proc, devpts, symlinks, and idmapped trees the parent
 *      prepared;
 *      and overlays (an overlayfs whose layers earlier steps mounted at
 *      staging points, see mount_overlay);
 *   4. pivots into /newroot, detaches the staging root and the host's root
 *      beneath it, and makes "/" itself read-only.
 * After this nothing of the host is reachable but what was bound.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <stdio.h>
#include <fcntl.h>
#include <linux/mount.h>
#include <sys/mount.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "steps.h"

#ifndef SYS_mount_setattr
#define SYS_mount_setattr 442
#endif
#ifndef SYS_move_mount
#define SYS_move_mount 429
#endif
#ifndef SYS_open_tree
#define SYS_open_tree 428
#endif
#ifndef MOUNT_ATTR_IDMAP
#define MOUNT_ATTR_IDMAP 0x00100000
#endif
#ifndef SYS_fsopen
#define SYS_fsopen 430
#endif
#ifndef SYS_fsconfig
#define SYS_fsconfig 431
#endif
#ifndef SYS_fsmount
#define SYS_fsmount 432
#endif

static int pivot_root(const char *new_root, const char *put_old)
{
    return (int)syscall(SYS_pivot_root, new_root, put_old);
}

static int set_attr(const char *path, unsigned int flags, uint64_t attr_set)
{
    struct mount_attr attr = {.attr_set = attr_set};
    return (int)syscall(SYS_mount_setattr, AT_FDCWD, path, flags, &attr, sizeof attr);
}

static int fs_set(int fs, unsigned int cmd, const char *key, const char *value)
{
    return (int)syscall(SYS_fsconfig, fs, cmd, key, value, 0);
}

/* An overlayfs at m->target over layers earlier steps mounted in this
 * namespace (the kernel takes a layer only from the mounter's own mount
 * namespace, so the parent's descriptors cannot be given directly): lower
 * m->source, upper m->upper, work m->work.  Mounted inside the sandbox's user
 * namespace (unprivileged since Linux 5.11): "userxattr" keeps its metadata in
 * user.overlay.* xattrs, and implies no redirects and no metacopy, so the
 * upper layer holds whole files, whiteouts and opaque directories only, which
 * is what the host reads back (isolate/kernel/overlay.py).  The new mount API only
 * (Linux 5.2, older than any kernel with unprivileged overlayfs). */
static int mount_overlay(const struct iso_mount *m)
{
    /* The upper directory must be the one the parent made and opened, not
     * something planted in the state directory since (an image's upper layer
     * is a tmpfs this child mounted itself: no descriptor). */
    if (m->fd >= 0) {
        struct stat opened, found;
        if (fstat(m->fd, &opened) < 0 || fstatat(AT_FDCWD, m->upper, &found, AT_SYMLINK_NOFOLLOW) < 0)
            return ISO_STEP_MOUNT_OVERLAY;
        if (opened.st_dev != found.st_dev || opened.st_ino != found.st_ino) {
            errno = ESTALE;
            return ISO_STEP_MOUNT_OVERLAY;
        }
    }
    if (m->flags & ISO_MOUNT_F_IMAGE_ROOT) {
        /* An image has many layers: fsconfig takes 256 bytes per value (one
         * lowerdir+ per layer is Linux 6.8), mount(2) a page of options.
         * "volatile" (Linux 5.10): no sync of the upper layer's file system
         * when the sandbox's namespace ends (a kept sandbox's upper layer is
         * a disk directory: each end synced the whole disk, 7 ms); the upper
         * layer is never mounted again, so a crash loses nothing kept. */
        char options[4096];
        int n = snprintf(options, sizeof options,
                         "lowerdir=%s,upperdir=%s,workdir=%s,userxattr,index=off,metacopy=off,volatile", m->source,
                         m->upper, m->work);
        if (n < 0 || (size_t)n >= sizeof options) {
            errno = E2BIG;
            return ISO_STEP_MOUNT_OVERLAY;
        }
        if (mount("overlay", m->target, "overlay", MS_NOSUID | MS_NODEV, options) < 0)
            return ISO_STEP_MOUNT_OVERLAY;
        return 0;
    }
    int fs = (int)syscall(SYS_fsopen, "overlay", FSOPEN_CLOEXEC);
    if (fs < 0)
        return ISO_STEP_MOUNT_OVERLAY;
    int saved;
    if (fs_set(fs, FSCONFIG_SET_STRING, "lowerdir", m->source) < 0 ||
        fs_set(fs, FSCONFIG_SET_STRING, "upperdir", m->upper) < 0 ||
        fs_set(fs, FSCONFIG_SET_STRING, "workdir", m->work) < 0 ||
        fs_set(fs, FSCONFIG_SET_FLAG, "userxattr", NULL) < 0 ||
        /* Said explicitly, whatever the kernel's defaults: the upper layer
         * must hold each changed file whole, and nothing else. */
        fs_set(fs, FSCONFIG_SET_STRING, "index", "off") < 0 ||
        fs_set(fs, FSCONFIG_SET_STRING, "metacopy", "off") < 0 ||
        fs_set(fs, FSCONFIG_CMD_CREATE, NULL, NULL) < 0)
        goto fail;
    int mnt = (int)syscall(SYS_fsmount, fs, FSMOUNT_CLOEXEC, MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV);
    if (mnt < 0)
        goto fail;
    close(fs);
    if (syscall(SYS_move_mount, mnt, "", AT_FDCWD, m->target, MOVE_MOUNT_F_EMPTY_PATH) < 0) {
        saved = errno;
        close(mnt);
        errno = saved;
        return ISO_STEP_MOUNT_OVERLAY;
    }
    close(mnt);
    return 0;
fail:
    saved = errno;
    close(fs);
    errno = saved;
    return ISO_STEP_MOUNT_OVERLAY;
}

static int apply_one(const struct iso_mount *m)
{
    switch (m->kind) {
    case ISO_MOUNT_DIR:
        if (mkdir(m->target, (mode_t)m->mode) < 0 && errno != EEXIST)
            return ISO_STEP_MOUNT_DIR;
        return 0;
    case ISO_MOUNT_FILE: {
        int fd = open(m->target, O_WRONLY | O_CREAT | O_CLOEXEC | O_NOFOLLOW, (mode_t)m->mode);
        if (fd < 0 && errno != EEXIST)
            return ISO_STEP_MOUNT_DIR;
        if (fd >= 0)
            close(fd);
        return 0;
    }
    case ISO_MOUNT_SYMLINK:
        if (symlink(m->source, m->target) < 0 && errno != EEXIST)
            return ISO_STEP_MOUNT_SYMLINK;
        return 0;
    case ISO_MOUNT_TMPFS:
        if (mount("tmpfs", m->target, "tmpfs", MS_NOSUID | MS_NODEV, m->source) < 0)
            return ISO_STEP_MOUNT_TMPFS;
        break;
    case ISO_MOUNT_PROC:
        /* Read-only: no program writes the sandbox's /proc (Landlock grants it
         * read only), and a rule granting writes on the root of an image
         * (which Landlock applies to every mount under it) must not reach
         * /proc/sysrq-trigger, /proc/sys or the processes' own files: the
         * mount refuses what the rule would let through. */
        if (mount("proc", m->target, "proc", MS_NOSUID | MS_NODEV | MS_NOEXEC | MS_RDONLY, NULL) < 0)
            return ISO_STEP_MOUNT_PROC;
        return 0;
    case ISO_MOUNT_DEVPTS:
        if (mount("devpts", m->target, "devpts", MS_NOSUID | MS_NOEXEC, "newinstance,ptmxmode=0666,mode=0620") < 0)
            return ISO_STEP_MOUNT_DEVPTS;
        return 0;
    case ISO_MOUNT_BIND:
        if (mount(m->source, m->target, NULL, MS_BIND | MS_REC, NULL) < 0)
            return ISO_STEP_MOUNT_BIND;
        /* The parent resolved and opened this path (m->fd); what got bound
         * must be that inode, not whatever the path names by now (a bind
         * source must be in this mount namespace, so it cannot be the
         * parent's descriptor itself). */
        if (m->fd >= 0) {
            struct stat opened, bound;
            if (fstat(m->fd, &opened) < 0 || stat(m->target, &bound) < 0)
                return ISO_STEP_MOUNT_BIND;
            if (opened.st_dev != bound.st_dev || opened.st_ino != bound.st_ino) {
                errno = ESTALE;
                return ISO_STEP_MOUNT_BIND;
            }
        }
        break;
    case ISO_MOUNT_OVERLAY: {
        int step = mount_overlay(m);
        if (step)
            return step;
        break;
    }
    case ISO_MOUNT_MOVE:
        if (syscall(SYS_move_mount, m->fd, "", AT_FDCWD, m->target, MOVE_MOUNT_F_EMPTY_PATH) < 0)
            return ISO_STEP_MOUNT_MOVE;
        close(m->fd);
        break;
    default:
        errno = EINVAL;
        return ISO_STEP_MOUNT_DIR;
    }
    /* A tmpfs already has nosuid and nodev from mount(); a device node's
     * bind needs neither (it is not executable, and must keep its device). */
    if ((m->kind == ISO_MOUNT_TMPFS || (m->flags & ISO_MOUNT_F_KEEP_DEV)) &&
        !(m->flags & (ISO_MOUNT_F_READONLY | ISO_MOUNT_F_NOEXEC)))
        return 0;
    /* Binds and moved trees: never setuid; read-only if asked. */
    uint64_t attr = MOUNT_ATTR_NOSUID;
    if (!(m->flags & ISO_MOUNT_F_KEEP_DEV))
        attr |= MOUNT_ATTR_NODEV;
    if (m->flags & ISO_MOUNT_F_READONLY)
        attr |= MOUNT_ATTR_RDONLY;
    if (m->flags & ISO_MOUNT_F_NOEXEC)
        attr |= MOUNT_ATTR_NOEXEC;
    if (set_attr(m->target, AT_RECURSIVE, attr) < 0)
        return ISO_STEP_MOUNT_READONLY;
    return 0;
}

static int build_root(const struct iso_plan *plan, int *index);

/* The root's directories and files get the modes the plan gives them, not
 * those the caller's umask leaves: with a umask of 077, /var would be made
 * 0700 and a program that is not root there could not reach /var/tmp. The
 * caller's umask comes back before the program runs (it is theirs to pass). */
int iso_mounts_apply(const struct iso_plan *plan, int *index)
{
    mode_t caller_umask = umask(0); /* umask cannot fail */
    int step = build_root(plan, index);
    umask(caller_umask);
    return step;
}

static int build_root(const struct iso_plan *plan, int *index)
{
    if (mount(NULL, "/", NULL, MS_REC | MS_PRIVATE, NULL) < 0)
        return ISO_STEP_MOUNT_PRIVATE;
    if (mount("tmpfs", plan->staging, "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755") < 0)
        return ISO_STEP_MOUNT_STAGING;
    if (chdir(plan->staging) < 0 || mkdir("newroot", 0755) < 0 || mkdir("oldroot", 0755) < 0)
        return ISO_STEP_MOUNT_STAGING;
    if (pivot_root(".", "oldroot") < 0)
        return ISO_STEP_PIVOT_ROOT;
    if (chdir("/") < 0)
        return ISO_STEP_PIVOT_ROOT;
    if (mount("tmpfs", "/newroot", "tmpfs", MS_NOSUID | MS_NODEV, "mode=0755") < 0)
        return ISO_STEP_MOUNT_STAGING;

    for (int i = 0; i < plan->n_mounts; i++) {
        int step = apply_one(&plan->mounts[i]);
        if (step) {
            *index = i;
            return step;
        }
    }

    /* pivot_root(".", ".") stacks the old root on top of the new one;
     * detaching "." then removes it together with /oldroot beneath it. */
    if (chdir("/newroot") < 0 || pivot_root(".", ".") < 0)
        return ISO_STEP_PIVOT_ROOT;
    if (umount2(".", MNT_DETACH) < 0 || chdir("/") < 0)
        return ISO_STEP_PIVOT_ROOT;
    /* The root is read-only, unless it is an image's: its writes land in
     * the upper layer, a tmpfs of this namespace, gone with it. */
    uint64_t root_attr = MOUNT_ATTR_RDONLY | MOUNT_ATTR_NOSUID | MOUNT_ATTR_NODEV;
    for (int i = 0; i < plan->n_mounts; i++)
        if (plan->mounts[i].kind == ISO_MOUNT_OVERLAY && (plan->mounts[i].flags & ISO_MOUNT_F_IMAGE_ROOT))
            root_attr &= ~(uint64_t)MOUNT_ATTR_RDONLY;
    if (set_attr("/", 0, root_attr) < 0)
        return ISO_STEP_MOUNT_READONLY;
    return 0;
}

/* Parent side, for a root caller: a detached copy of path whose ids are
 * shifted by the user namespace userns_fd, so that the program (an
 * unprivileged uid) owns what the caller owns there, and what it creates is
 * owned by the caller on disk. */
static int open_idmapped(const char *path, int userns_fd, unsigned int recursive)
{
    int tree = (int)syscall(SYS_open_tree, AT_FDCWD, path, OPEN_TREE_CLONE | OPEN_TREE_CLOEXEC | recursive);
    if (tree < 0)
        return -1;
    struct mount_attr attr = {.attr_set = MOUNT_ATTR_IDMAP, .userns_fd = (uint64_t)userns_fd};
    if (syscall(SYS_mount_setattr, tree, "", AT_EMPTY_PATH | recursive, &attr, sizeof attr) < 0) {
        int saved = errno;
        close(tree);
        errno = saved;
        return -1;
    }
    return tree;
}

int iso_open_idmapped_tree(const char *path, int userns_fd)
{
    int tree = open_idmapped(path, userns_fd, AT_RECURSIVE);
    /* A submount on a filesystem without idmap support refuses the whole
     * tree (EINVAL); the top mount alone may still take it. */
    if (tree < 0 && errno == EINVAL)
        tree = open_idmapped(path, userns_fd, 0);
    return tree;
}
