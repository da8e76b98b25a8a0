/*
 * xs_files.c - the exec server's file operations, performed with the
 * program's credentials and view (see execserver.c).
 */
#define _GNU_SOURCE
#include "execserver.h"

static void fill_stat(struct iso_xs_stat *out, const struct stat *st)
{
    out->mode = st->st_mode;
    out->uid = st->st_uid;
    out->gid = st->st_gid;
    out->nlink = (uint32_t)st->st_nlink;
    out->size = st->st_size;
    out->mtime_ns = (int64_t)st->st_mtim.tv_sec * 1000000000 + st->st_mtim.tv_nsec;
    out->ino = st->st_ino;
    out->dev = st->st_dev;
}

static void do_readdir(int conn, const char *path)
{
    int fd = open(path, O_RDONLY | O_DIRECTORY | O_CLOEXEC | O_NONBLOCK);
    DIR *dir = fd < 0 ? NULL : fdopendir(fd);
    if (!dir) {
        int err = errno;
        if (fd >= 0)
            close(fd);
        xs_reply_kind(conn, ISO_XS_ERROR, err);
        return;
    }
    static char batch[ISO_XS_MAX_MESSAGE];
    size_t used = 0;
    uint32_t count = 0;
    struct iso_xs_reply reply = {.magic = ISO_XS_MAGIC, .kind = ISO_XS_ENTRIES};
    struct dirent *entry;
    for (;;) {
        errno = 0;
        entry = readdir(dir);
        if (!entry && errno) {
            int err = errno;
            closedir(dir);
            xs_reply_kind(conn, ISO_XS_ERROR, err);
            return;
        }
        size_t name_len = entry ? strlen(entry->d_name) : 0;
        size_t need = (sizeof(struct iso_xs_dirent) + name_len + 1 + 7) & ~(size_t)7;
        if (count && (!entry || used + need > sizeof batch - sizeof reply)) {
            reply.count = count;
            if (xs_send_reply(conn, &reply, batch, used, -1) < 0)
                break;
            used = 0;
            count = 0;
        }
        if (!entry)
            break;
        if (!strcmp(entry->d_name, ".") || !strcmp(entry->d_name, ".."))
            continue;
        struct iso_xs_dirent *out = (struct iso_xs_dirent *)(batch + used);
        memset(out, 0, need);
        struct stat st;
        /* An entry that vanished meanwhile is listed with mode 0. */
        if (fstatat(dirfd(dir), entry->d_name, &st, AT_SYMLINK_NOFOLLOW) == 0)
            fill_stat(&out->st, &st);
        out->name_len = (uint32_t)name_len;
        memcpy((char *)(out + 1), entry->d_name, name_len + 1);
        used += need;
        count++;
    }
    closedir(dir);
    xs_reply_kind(conn, ISO_XS_END, 0);
}

/* The flags the host may ask open() for; the server adds its own. */
#define OPEN_FLAGS (O_ACCMODE | O_CREAT | O_EXCL | O_TRUNC | O_APPEND | O_DIRECTORY | O_NOFOLLOW)

void xs_file_op(int conn, const struct request *req)
{
    const struct iso_xs_request *h = &req->head;
    const char *path = h->n_strings > 0 ? req->strings[0] : NULL;
    const char *other = h->n_strings > 1 ? req->strings[1] : NULL;
    struct iso_xs_reply reply = {.magic = ISO_XS_MAGIC, .kind = ISO_XS_OK};
    struct stat st;
    int rc = -1, fd = -1;
    if (h->op == ISO_XS_PING) {
        reply.pid = getpid();
        xs_send_reply(conn, &reply, NULL, 0, -1);
        return;
    }
    if (!path || !path[0] || ((h->op == ISO_XS_RENAME) && (!other || !other[0]))) {
        xs_reply_kind(conn, ISO_XS_ERROR, EINVAL);
        return;
    }
    switch (h->op) {
    case ISO_XS_OPEN:
        fd = open(path, (h->flags & OPEN_FLAGS) | O_CLOEXEC | O_NOCTTY | O_NONBLOCK, (mode_t)(h->mode & 07777));
        rc = fd < 0 ? -1 : fstat(fd, &st);
        if (rc == 0)
            fill_stat(&reply.st, &st);
        break;
    case ISO_XS_STAT:
    case ISO_XS_LSTAT:
        rc = h->op == ISO_XS_STAT ? stat(path, &st) : lstat(path, &st);
        if (rc == 0)
            fill_stat(&reply.st, &st);
        break;
    case ISO_XS_MKDIR:
        rc = mkdir(path, (mode_t)(h->mode & 07777));
        break;
    case ISO_XS_UNLINK:
        rc = unlink(path);
        break;
    case ISO_XS_RMDIR:
        rc = rmdir(path);
        break;
    case ISO_XS_RENAME:
        rc = (int)syscall(SYS_renameat2, AT_FDCWD, path, AT_FDCWD, other, (unsigned int)h->flags);
        break;
    case ISO_XS_READDIR:
        do_readdir(conn, path);
        return;
    default:
        errno = EINVAL;
    }
    if (rc < 0) {
        int err = errno;
        if (fd >= 0)
            close(fd);
        xs_reply_kind(conn, ISO_XS_ERROR, err);
        return;
    }
    xs_send_reply(conn, &reply, NULL, 0, fd);
    if (fd >= 0)
        close(fd);
}
