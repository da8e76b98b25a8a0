/*
 * beneath.c - a path opened below a directory descriptor by the kernel's own walk.
 *
 * openat2(2) with RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS
 * (and RESOLVE_NO_XDEV when asked): no symbolic link is followed anywhere on
 * the way, and neither an absolute path nor a ".." reaches above dir_fd.
 * The component-by-component walk that stands in for it where the kernel
 * lacks openat2 is isolate/kernel/beneath.py's.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/openat2.h>
#include <stdint.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "isolate.h"

#ifndef SYS_openat2
#define SYS_openat2 437
#endif

int iso_open_beneath(int dir_fd, const char *path, int flags, uint32_t mode, int same_mount)
{
    struct open_how how = {
        .flags = (uint64_t)(unsigned int)flags,
        /* openat2 refuses a mode that is not used (EINVAL) */
        .mode = ((flags & O_CREAT) || (flags & O_TMPFILE) == O_TMPFILE) ? mode : 0,
        .resolve = RESOLVE_BENEATH | RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS
                   | (same_mount ? RESOLVE_NO_XDEV : 0),
    };
    /* EAGAIN: a rename or a mount raced a ".." and the kernel could not be
     * sure it stayed below dir_fd; the man page says to try again.  Bounded:
     * a caller that still meets it walks component by component instead. */
    for (int tries = 0; tries < ISO_BENEATH_TRIES; tries++) {
        long fd = syscall(SYS_openat2, dir_fd, path, &how, sizeof how);
        if (fd >= 0)
            return (int)fd;
        if (errno != EAGAIN)
            return -1;
    }
    return -1;
}
