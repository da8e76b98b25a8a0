/*
 * why.c - denial tracing: the init names the file accesses the policy refused.
 *
 * Landlock's own audit records (Linux 6.15's audit log) need audit on and a
 * reader with CAP_AUDIT_READ; neither holds for most callers.  So when a
 * policy asks for it (Policy(trace_denials=True), isolate-run --why), the
 * program's seccomp filter sends every path system call to the init as a
 * user notification (isolate/kernel/seccomp/compiler.py).  The init reads
 * the call's arguments, works out what the kernel will decide, records a
 * refusal, and lets the call continue (SECCOMP_USER_NOTIF_FLAG_CONTINUE):
 * it only looks.  Enforcement stays the kernel's: a program that races the
 * look (changes the path in memory, swaps a directory) only misleads its
 * own report, never gains an access.
 *
 * The prediction, for the object the call names (the file for an open,
 * exec or truncate, the parent directory for a create, a remove or a
 * rename), resolved as the program would (from its cwd or dirfd, in the
 * root they share, no magic link followed):
 *   - the path is missing and its deepest existing directory lies on the
 *     built root itself or on a tmpfs of the sandbox's (not on a granted
 *     host tree): "absent" (the policy left it out, or a private /tmp
 *     hides it; a path missing inside a granted tree is no denial, and the
 *     host drops an entry whose path it does not have either);
 *   - a write-class access on a read-only mount: "read-only";
 *   - the sandbox uid's file modes refuse it (faccessat2 as the init,
 *     which holds the program's credentials): "dac";
 *   - Landlock: the rights of the rules on the object and every directory
 *     above it (walked down from the root, through mounts, as Landlock
 *     walks up) lack a handled right the access needs: "landlock".
 * Lookups without an access (stat, access, readlink, chdir) are looked at
 * for the path's absence only.
 * What it does not see: calls on descriptors (ioctl, ftruncate), a second Landlock layer the
 * program adds itself, and REFER across directories.  connect() to a
 * pathname socket is supervise.c's (it records its own refusals).
 *
 * Cost: a round trip to the init and a few lookups per path system call,
 * only when asked for; nothing otherwise (the filter has no such branch).
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <linux/openat2.h>
#include <linux/seccomp.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/stat.h>
#include <sys/statfs.h>
#include <sys/statvfs.h>
#include <linux/magic.h>
#include <sys/syscall.h>
#include <sys/uio.h>
#include <unistd.h>

#include "steps.h"

#ifndef SYS_openat2
#define SYS_openat2 437
#endif
#ifndef SYS_faccessat2
#define SYS_faccessat2 439
#endif
#ifndef AT_EACCESS
#define AT_EACCESS 0x200
#endif

/* Landlock rights (include/uapi/linux/landlock.h). */
#define LL_EXECUTE (1ULL << 0)
#define LL_WRITE_FILE (1ULL << 1)
#define LL_READ_FILE (1ULL << 2)
#define LL_READ_DIR (1ULL << 3)
#define LL_REMOVE_DIR (1ULL << 4)
#define LL_REMOVE_FILE (1ULL << 5)
#define LL_MAKE_CHAR (1ULL << 6)
#define LL_MAKE_DIR (1ULL << 7)
#define LL_MAKE_REG (1ULL << 8)
#define LL_MAKE_SOCK (1ULL << 9)
#define LL_MAKE_FIFO (1ULL << 10)
#define LL_MAKE_BLOCK (1ULL << 11)
#define LL_MAKE_SYM (1ULL << 12)
#define LL_TRUNCATE (1ULL << 14)
/* Rights a read-only mount refuses. */
#define LL_WRITES (LL_WRITE_FILE | LL_REMOVE_DIR | LL_REMOVE_FILE | LL_MAKE_CHAR | LL_MAKE_DIR | LL_MAKE_REG | \
                   LL_MAKE_SOCK | LL_MAKE_FIFO | LL_MAKE_BLOCK | LL_MAKE_SYM | LL_TRUNCATE)

#define MAX_RULES 128

static struct iso_why_report table;
static int stream_fd = -1;
static int active;
static int root_built;
static dev_t root_dev;
static uint64_t handled;
static struct {
    dev_t dev;
    ino_t ino;
    uint64_t access;
} rules[MAX_RULES];
static int n_rules;

/* Each refusal is also written to fd as it happens, without blocking: a
 * host that does not read loses events, never stops the init. */
void iso_why_stream(int fd)
{
    int flags = fd >= 0 ? fcntl(fd, F_GETFL) : -1;
    if (flags >= 0 && fcntl(fd, F_SETFL, flags | O_NONBLOCK) == 0)
        stream_fd = fd;
}

const struct iso_why_report *iso_why_report(void)
{
    return &table;
}

static int hex_value(char c)
{
    if (c >= '0' && c <= '9')
        return c - '0';
    if (c >= 'a' && c <= 'f')
        return c - 'a' + 10;
    return -1;
}

static void add_rule(dev_t dev, ino_t ino, uint64_t access)
{
    if (n_rules < MAX_RULES) {
        rules[n_rules].dev = dev;
        rules[n_rules].ino = ino;
        rules[n_rules].access = access;
        n_rules++;
    }
}

/* "BUILT,HANDLED[,MASK:DEV:INO...][,MASK/HEXPATH...]" (see isolate.h). */
int iso_why_init(const char *spec)
{
    char *end;
    table.magic = ISO_WHY_MAGIC;
    if (spec[0] != '0' && spec[0] != '1')
        return -1;
    root_built = spec[0] == '1';
    if (spec[1] != ',')
        return -1;
    handled = strtoull(spec + 2, &end, 10);
    struct stat st;
    if (stat("/", &st) < 0)
        return -1;
    root_dev = st.st_dev;
    while (*end == ',') {
        uint64_t access = strtoull(end + 1, &end, 10);
        if (*end == ':') {
            unsigned long long dev = strtoull(end + 1, &end, 10);
            if (*end != ':')
                return -1;
            unsigned long long ino = strtoull(end + 1, &end, 10);
            add_rule((dev_t)dev, (ino_t)ino, access);
        } else if (*end == '/') {
            char path[4096];
            size_t n = 0;
            end++;
            while (hex_value(end[0]) >= 0 && hex_value(end[1]) >= 0 && n + 1 < sizeof path) {
                path[n++] = (char)(hex_value(end[0]) * 16 + hex_value(end[1]));
                end += 2;
            }
            path[n] = 0;
            /* A rule the child could not open fails the run before this;
             * one missing here only makes the report stricter. */
            if (stat(path, &st) == 0)
                add_rule(st.st_dev, st.st_ino, access);
        } else {
            return -1;
        }
    }
    if (*end != 0)
        return -1;
    active = 1;
    return 0;
}

/* Both buffers are PATH_MAX long: nothing is cut. */
static void copy(char *dst, const char *src, size_t size)
{
    size_t n = strnlen(src, size - 1);
    memcpy(dst, src, n);
    dst[n] = 0;
}

/* dir "/" name into out, cut at size (a report's path, never looked up). */
static void join(char *out, size_t size, const char *dir, const char *name)
{
    copy(out, dir, size);
    size_t n = strlen(out);
    if (!name || !*name)
        return;
    if (n + 1 < size && (n == 0 || out[n - 1] != '/'))
        out[n++] = '/';
    copy(out + n, name, size - n);
}

static void let_continue(int listener, uint64_t id)
{
    struct seccomp_notif_resp resp;
    memset(&resp, 0, sizeof resp);
    resp.id = id;
    resp.flags = SECCOMP_USER_NOTIF_FLAG_CONTINUE;
    ioctl(listener, SECCOMP_IOCTL_NOTIF_SEND, &resp); /* ENOENT: the call was interrupted */
}

/* A NUL-terminated string of the program's, page by page (a string that
 * ends just before unmapped memory must still be read).  0 on success. */
static int read_string(pid_t pid, uint64_t address, char *buf, size_t size)
{
    size_t got = 0;
    while (got + 1 < size) {
        uint64_t at = address + got;
        size_t chunk = 4096 - (size_t)(at & 4095);
        if (chunk > size - 1 - got)
            chunk = size - 1 - got;
        struct iovec local = {.iov_base = buf + got, .iov_len = chunk};
        struct iovec remote = {.iov_base = (void *)(uintptr_t)at, .iov_len = chunk};
        ssize_t n = process_vm_readv(pid, &local, 1, &remote, 1, 0);
        if (n <= 0)
            return -1;
        if (memchr(buf + got, 0, (size_t)n))
            return 0;
        got += (size_t)n;
    }
    buf[size - 1] = 0;
    return -1; /* longer than PATH_MAX: the kernel refuses it itself */
}

/* /proc/self and /proc/thread-self are the looker's own: name the caller's. */
static void own_proc(pid_t tid, char *path, size_t size)
{
    char rest[4096];
    const char *tail = NULL;
    int thread = 0;
    if (!strncmp(path, "/proc/self", 10) && (path[10] == '/' || path[10] == 0))
        tail = path + 10;
    else if (!strncmp(path, "/proc/thread-self", 17) && (path[17] == '/' || path[17] == 0))
        tail = path + 17, thread = 1;
    if (!tail)
        return;
    copy(rest, tail, sizeof rest);
    char head[64];
    if (thread)
        snprintf(head, sizeof head, "/proc/%d/task/%d", (int)tid, (int)tid);
    else
        snprintf(head, sizeof head, "/proc/%d", (int)tid);
    size_t n = strlen(head);
    if (n + 1 >= size)
        return;
    memcpy(path, head, n);
    copy(path + n, rest, size - n);
}

/* The directory a relative path starts from: the program's cwd or dirfd.
 * AT_FDCWD for an absolute path (the init shares the program's root). */
static int base_dir(pid_t tid, int dirfd, const char *path)
{
    if (path[0] == '/')
        return AT_FDCWD;
    char link[64];
    if (dirfd == AT_FDCWD)
        snprintf(link, sizeof link, "/proc/%d/cwd", (int)tid);
    else
        snprintf(link, sizeof link, "/proc/%d/fd/%d", (int)tid, dirfd);
    return open(link, O_PATH | O_CLOEXEC);
}

static int lookup(int base, const char *path, int follow)
{
    struct open_how how = {.flags = O_PATH | O_CLOEXEC | (follow ? 0 : O_NOFOLLOW),
                           .resolve = RESOLVE_NO_MAGICLINKS};
    return (int)syscall(SYS_openat2, base, path, &how, sizeof how);
}

/* The path of fd in the sandbox's view ("" when unknown). */
static void path_of(int fd, char *buf, size_t size)
{
    char link[64];
    snprintf(link, sizeof link, "/proc/self/fd/%d", fd);
    ssize_t n = readlink(link, buf, size - 1);
    buf[n > 0 ? n : 0] = 0;
}

/* The Landlock rights granted on the object at resolved (an absolute path
 * of the sandbox's view): the rules on it and every directory above it. */
static uint64_t granted(const char *resolved)
{
    uint64_t rights = 0;
    int cur = open("/", O_PATH | O_DIRECTORY | O_CLOEXEC);
    if (cur < 0)
        return ~0ULL; /* cannot tell: say nothing */
    const char *p = resolved;
    for (;;) {
        struct stat st;
        if (fstat(cur, &st) < 0) {
            close(cur);
            return ~0ULL;
        }
        for (int i = 0; i < n_rules; i++)
            if (rules[i].dev == st.st_dev && rules[i].ino == st.st_ino)
                rights |= rules[i].access;
        while (*p == '/')
            p++;
        if (!*p)
            break;
        char name[256];
        size_t len = strcspn(p, "/");
        if (len >= sizeof name) {
            close(cur);
            return ~0ULL;
        }
        memcpy(name, p, len);
        name[len] = 0;
        p += len;
        int next = openat(cur, name, O_PATH | O_NOFOLLOW | O_CLOEXEC);
        close(cur);
        if (next < 0)
            return ~0ULL;
        cur = next;
    }
    close(cur);
    return rights;
}

/* The path of the call being looked at, as the program named it (the
 * lookups use it with /proc/self made the caller's). */
static const char *named_path;

static pid_t caller;

static void send_event(const struct iso_file_denial *d)
{
    struct iso_why_event event;
    memset(&event, 0, sizeof event);
    event.session = (int32_t)getsid(caller);
    event.denial = *d;
    event.denial.count = 1;
    /* One write of less than PIPE_BUF: whole or not at all. */
    if (write(stream_fd, &event, sizeof event) < 0) {
        /* Full (EAGAIN) or nobody reads: the event is lost, the run goes on. */
    }
}

/* The rights granted under each directory, by its path: most calls name a
 * few directories again and again (a library path, an include directory).
 * A directory renamed during the run can leave a stale entry, which only
 * misnames a refusal in the report; it never decides an access. */
#define DIR_CACHE 256
static struct {
    char path[240];
    uint64_t rights;
    int valid;
} dir_cache[DIR_CACHE];

static unsigned int hash_path(const char *path)
{
    unsigned int h = 2166136261u;
    for (; *path; path++)
        h = (h ^ (unsigned char)*path) * 16777619u;
    return h % DIR_CACHE;
}

/* The Landlock rights granted on the object at resolved whose stat is st:
 * its directory's (cached), and the rules on the object itself. */
static uint64_t granted_on(const char *resolved, const struct stat *st)
{
    char dir[4096];
    copy(dir, resolved, sizeof dir);
    char *slash = strrchr(dir, '/');
    if (slash == NULL)
        return ~0ULL;
    if (slash == dir)
        dir[1] = 0;
    else
        *slash = 0;
    uint64_t rights;
    size_t len = strlen(dir);
    unsigned int h = hash_path(dir);
    if (len < sizeof dir_cache[0].path && dir_cache[h].valid && !strcmp(dir_cache[h].path, dir)) {
        rights = dir_cache[h].rights;
    } else {
        rights = granted(dir);
        if (len < sizeof dir_cache[0].path && rights != ~0ULL) {
            memcpy(dir_cache[h].path, dir, len + 1);
            dir_cache[h].rights = rights;
            dir_cache[h].valid = 1;
        }
    }
    if (rights == ~0ULL)
        return rights;
    if (!strcmp(resolved, "/"))
        return rights;
    for (int i = 0; i < n_rules; i++)
        if (rules[i].dev == st->st_dev && rules[i].ino == st->st_ino)
            rights |= rules[i].access;
    return rights;
}

static void record(int nr, int access, int mechanism, const char *looked_up, const char *resolved)
{
    const char *path = named_path ? named_path : looked_up;
    /* A path longer than the field keeps its start only, which names another file (or none): the entry
     * says so, so that no one grants or reports the cut name as the one refused. */
    uint32_t flags = 0;
    if (strlen(path) >= sizeof table.denied[0].path || strlen(resolved) >= sizeof table.denied[0].resolved)
        flags |= ISO_WHY_CUT;
    if (stream_fd >= 0) {
        struct iso_file_denial d;
        memset(&d, 0, sizeof d);
        d.nr = nr;
        d.access = access;
        d.mechanism = mechanism;
        d.flags = flags;
        strncpy(d.path, path, sizeof d.path - 1);
        strncpy(d.resolved, resolved, sizeof d.resolved - 1);
        send_event(&d);
    }
    for (uint32_t i = 0; i < table.n; i++) {
        struct iso_file_denial *d = &table.denied[i];
        if (d->nr == nr && d->access == access && d->mechanism == mechanism && d->flags == flags &&
            !strncmp(d->path, path, sizeof d->path - 1) && !strncmp(d->resolved, resolved, sizeof d->resolved - 1)) {
            d->count++;
            return;
        }
    }
    if (table.n >= sizeof table.denied / sizeof table.denied[0]) {
        table.dropped++;
        return;
    }
    struct iso_file_denial *d = &table.denied[table.n++];
    memset(d, 0, sizeof *d);
    d->nr = nr;
    d->access = access;
    d->mechanism = mechanism;
    d->count = 1;
    d->flags = flags;
    strncpy(d->path, path, sizeof d->path - 1);
    strncpy(d->resolved, resolved, sizeof d->resolved - 1);
}

/* path is missing: a denial only when the built root is what lacks it,
 * that is when its deepest existing directory is on the root's own
 * filesystem (no granted mount holds it). */
static void check_absent(int nr, int access, int base, const char *path)
{
    if (!root_built)
        return;
    char parent[4096];
    copy(parent, path, sizeof parent);
    for (;;) {
        char *slash = strrchr(parent, '/');
        while (slash && slash > parent && slash[1] == 0) { /* trailing slashes */
            *slash = 0;
            slash = strrchr(parent, '/');
        }
        if (slash == NULL) {
            parent[0] = '.';
            parent[1] = 0;
        } else if (slash == parent) {
            parent[1] = 0;
        } else {
            *slash = 0;
        }
        int fd = lookup(base, parent, 1);
        if (fd >= 0) {
            struct stat st;
            char where[4096], resolved[4096];
            struct statfs fs;
            /* The built root and the sandbox's own tmpfs mounts (a private
             * /tmp hides the host's): a granted host tree lacks nothing. */
            int on_root = fstat(fd, &st) == 0 && S_ISDIR(st.st_mode) &&
                          (st.st_dev == root_dev || (fstatfs(fd, &fs) == 0 && fs.f_type == TMPFS_MAGIC));
            path_of(fd, where, sizeof where);
            close(fd);
            if (!on_root || !where[0])
                return;
            /* The rest of the path below the directory that exists. */
            const char *rest = strcmp(parent, ".") ? path + strlen(parent) : path;
            while (*rest == '/')
                rest++;
            join(resolved, sizeof resolved, where, rest);
            record(nr, access, ISO_WHY_ABSENT, path, resolved);
            return;
        }
        if (errno != ENOENT || !strcmp(parent, "/") || !strcmp(parent, "."))
            return;
    }
}

/* path is missing; when it is a link (or a chain of them, as a venv's
 * python) whose target is missing, the target's absence is what to name
 * (an interpreter the policy left out). */
static void check_missing(int nr, int access, int base, const char *path, int follow)
{
    char current[4096], target[4096], joined[4096];
    copy(current, path, sizeof current);
    for (int depth = 0; follow && depth < 8; depth++) {
        int link = lookup(base, current, 0);
        struct stat st;
        if (link < 0)
            break;
        ssize_t n = -1;
        if (fstat(link, &st) == 0 && S_ISLNK(st.st_mode))
            n = readlinkat(link, "", target, sizeof target - 1);
        close(link);
        if (n <= 0)
            break;
        target[n] = 0;
        if (target[0] != '/') { /* relative to the link's directory */
            copy(joined, current, sizeof joined);
            char *slash = strrchr(joined, '/');
            if (slash)
                slash[1] = 0;
            else
                joined[0] = 0;
            size_t len = strlen(joined);
            copy(joined + len, target, sizeof joined - len);
            copy(target, joined, sizeof target);
        }
        copy(current, target, sizeof current);
    }
    check_absent(nr, access, base, current);
}

/* The object exists (fd): which mechanism, if any, refuses the access. */
static void check_object(int nr, int access, int fd, const char *path, const char *leaf, uint64_t rights,
                         int mode)
{
    struct stat st;
    if (fstat(fd, &st) < 0)
        return;
    int special = S_ISCHR(st.st_mode) || S_ISBLK(st.st_mode) || S_ISFIFO(st.st_mode) || S_ISSOCK(st.st_mode);
    if (S_ISDIR(st.st_mode) && (access == ISO_WHY_READ || access == ISO_WHY_WRITE || access == ISO_WHY_EXECUTE ||
                                access == ISO_WHY_TRUNCATE)) {
        if (access != ISO_WHY_READ)
            return; /* EISDIR or EACCES from the kernel whatever the policy */
        rights = (rights & ~LL_READ_FILE) | LL_READ_DIR;
    }
    char resolved[4096], shown[4096];
    path_of(fd, resolved, sizeof resolved);
    if (!resolved[0] || resolved[0] != '/')
        return; /* not reachable from the root (deleted, another mount namespace) */
    /* An entry's directory is checked; the report names the entry. */
    join(shown, sizeof shown, resolved, leaf);
    /* The kernel's order: opening a file asks the modes, then the mount
     * (at the open itself); a change in a directory (and truncate) asks
     * the mount first.  Writing to a device, FIFO or socket node writes no
     * filesystem. */
    int file_first = (access == ISO_WHY_READ || access == ISO_WHY_WRITE || access == ISO_WHY_EXECUTE) &&
                     !(rights & LL_TRUNCATE); /* O_TRUNC asks the mount before the modes */
    int dac = mode && syscall(SYS_faccessat2, fd, "", mode, AT_EACCESS | AT_EMPTY_PATH) < 0 && errno == EACCES;
    struct statvfs vfs;
    int readonly = (rights & LL_WRITES) && !(special && !(rights & ~(LL_WRITE_FILE | LL_READ_FILE))) &&
                   fstatvfs(fd, &vfs) == 0 && (vfs.f_flag & ST_RDONLY);
    if (dac && (file_first || !readonly)) {
        record(nr, access, ISO_WHY_DAC, path, shown);
        return;
    }
    if (readonly) {
        record(nr, access, ISO_WHY_READONLY, path, shown);
        return;
    }
    if ((rights & handled) & ~granted_on(resolved, &st))
        record(nr, access, ISO_WHY_LANDLOCK, path, shown);
}

/* An access to the file at (dirfd, path); follow: the last link too. */
static void check_file(pid_t tid, int nr, int access, int dirfd, uint64_t address, uint64_t rights, int mode,
                       int follow, int creat_flags)
{
    char named[4096], path[4096];
    if (read_string(tid, address, named, sizeof named) < 0 || !named[0])
        return;
    copy(path, named, sizeof path);
    own_proc(tid, path, sizeof path);
    named_path = named;
    int base = base_dir(tid, dirfd, path);
    if (base < 0 && base != AT_FDCWD)
        return;
    int fd = lookup(base, path, follow);
    if (fd >= 0) {
        if (!((creat_flags & O_CREAT) && (creat_flags & O_EXCL))) /* EEXIST, whatever the policy */
            check_object(nr, access, fd, path, NULL, rights, mode);
        close(fd);
    } else if (errno == ENOENT && (creat_flags & O_CREAT)) {
        /* A new file: the right to make it in its directory. */
        char dir[4096];
        copy(dir, path, sizeof dir);
        char *slash = strrchr(dir, '/');
        if (slash == dir)
            dir[1] = 0;
        else if (slash)
            *slash = 0;
        else
            snprintf(dir, sizeof dir, ".");
        int parent = lookup(base, dir, 1);
        if (parent >= 0) {
            check_object(nr, ISO_WHY_CREATE, parent, path, slash ? path + (slash - dir) + 1 : path, LL_MAKE_REG,
                         W_OK | X_OK);
            close(parent);
        } else if (errno == ENOENT) {
            check_absent(nr, ISO_WHY_CREATE, base, path);
        }
    } else if (errno == ENOENT) {
        check_missing(nr, access, base, path, follow);
    }
    if (base >= 0)
        close(base);
}

/* A change in the directory holding (dirfd, path): make, remove, rename. */
static void check_entry(pid_t tid, int nr, int access, int dirfd, uint64_t address, uint64_t rights)
{
    char named[4096], path[4096], dir[4096];
    if (read_string(tid, address, named, sizeof named) < 0 || !named[0])
        return;
    copy(path, named, sizeof path);
    own_proc(tid, path, sizeof path);
    named_path = named;
    int base = base_dir(tid, dirfd, path);
    if (base < 0 && base != AT_FDCWD)
        return;
    copy(dir, path, sizeof dir);
    size_t len = strlen(dir);
    while (len > 1 && dir[len - 1] == '/')
        dir[--len] = 0;
    char *slash = strrchr(dir, '/');
    if (slash == dir)
        dir[1] = 0;
    else if (slash)
        *slash = 0;
    else
        snprintf(dir, sizeof dir, ".");
    if (rights & (LL_REMOVE_FILE | LL_REMOVE_DIR)) {
        /* Which kind of entry goes: what the kernel checks. */
        struct stat st;
        int fd = lookup(base, path, 0);
        if (fd < 0) {
            if (base >= 0)
                close(base);
            return; /* nothing to remove: ENOENT whatever the policy */
        }
        if (fstat(fd, &st) == 0 && access == ISO_WHY_RENAME)
            rights = S_ISDIR(st.st_mode) ? LL_REMOVE_DIR : LL_REMOVE_FILE;
        close(fd);
    }
    int parent = lookup(base, dir, 1);
    if (parent >= 0) {
        check_object(nr, access, parent, path, slash ? path + (slash - dir) + 1 : path, rights, W_OK | X_OK);
        close(parent);
    } else if (errno == ENOENT) {
        check_absent(nr, access, base, path);
    }
    if (base >= 0)
        close(base);
}

/* A lookup without an access (stat, access, readlink, chdir): only the
 * built root's lack of the path is a refusal to name. */
static void check_lookup(pid_t tid, int nr, int dirfd, uint64_t address, int follow)
{
    char named[4096], path[4096];
    if (read_string(tid, address, named, sizeof named) < 0 || !named[0])
        return;
    copy(path, named, sizeof path);
    own_proc(tid, path, sizeof path);
    named_path = named;
    int base = base_dir(tid, dirfd, path);
    if (base < 0 && base != AT_FDCWD)
        return;
    int fd = lookup(base, path, follow);
    if (fd >= 0)
        close(fd);
    else if (errno == ENOENT)
        check_missing(nr, ISO_WHY_LOOKUP, base, path, follow);
    if (base >= 0)
        close(base);
}

static uint64_t open_rights(int flags)
{
    uint64_t rights = 0;
    int acc = flags & O_ACCMODE;
    if (acc == O_RDONLY || acc == O_RDWR)
        rights |= LL_READ_FILE;
    if (acc == O_WRONLY || acc == O_RDWR)
        rights |= LL_WRITE_FILE;
    if ((flags & O_TRUNC) && acc != O_RDONLY)
        rights |= LL_TRUNCATE;
    return rights;
}

static void check_open(pid_t tid, int nr, int dirfd, uint64_t address, int flags)
{
    if (flags & O_PATH)
        return; /* no access: Landlock and the modes check none */
    uint64_t rights = open_rights(flags);
    int acc = flags & O_ACCMODE;
    int access = (rights & LL_WRITE_FILE) ? ISO_WHY_WRITE : ISO_WHY_READ;
    int mode = (acc == O_RDONLY ? R_OK : 0) | (acc == O_WRONLY ? W_OK : 0) | (acc == O_RDWR ? R_OK | W_OK : 0);
    check_file(tid, nr, access, dirfd, address, rights, mode, !(flags & O_NOFOLLOW), flags);
}

static uint64_t make_right(unsigned int mode)
{
    switch (mode & S_IFMT) {
    case S_IFCHR:
        return LL_MAKE_CHAR;
    case S_IFBLK:
        return LL_MAKE_BLOCK;
    case S_IFIFO:
        return LL_MAKE_FIFO;
    case S_IFSOCK:
        return LL_MAKE_SOCK;
    default:
        return LL_MAKE_REG;
    }
}

static void examine(const struct seccomp_notif *req)
{
    pid_t tid = (pid_t)req->pid;
    int nr = req->data.nr;
    const __u64 *a = req->data.args;
    caller = tid;
    int cwd = AT_FDCWD;
    table.seen++;
    switch (nr) {
#ifdef SYS_open
    case SYS_open:
        check_open(tid, nr, cwd, a[0], (int)a[1]);
        return;
#endif
#ifdef SYS_creat
    case SYS_creat:
        check_open(tid, nr, cwd, a[0], O_CREAT | O_WRONLY | O_TRUNC);
        return;
#endif
    case SYS_openat:
        check_open(tid, nr, (int)a[0], a[1], (int)a[2]);
        return;
    case SYS_openat2: {
        struct open_how how;
        struct iovec local = {.iov_base = &how, .iov_len = sizeof how};
        struct iovec remote = {.iov_base = (void *)(uintptr_t)a[2], .iov_len = sizeof how};
        if (a[3] >= sizeof how && process_vm_readv(tid, &local, 1, &remote, 1, 0) == (ssize_t)sizeof how)
            check_open(tid, nr, (int)a[0], a[1], (int)how.flags);
        return;
    }
    case SYS_execve:
        check_file(tid, nr, ISO_WHY_EXECUTE, cwd, a[0], LL_EXECUTE | LL_READ_FILE, X_OK, 1, 0);
        return;
    case SYS_execveat:
        if (!(a[4] & AT_EMPTY_PATH))
            check_file(tid, nr, ISO_WHY_EXECUTE, (int)a[0], a[1], LL_EXECUTE | LL_READ_FILE, X_OK,
                       !(a[4] & AT_SYMLINK_NOFOLLOW), 0);
        return;
    case SYS_truncate:
        check_file(tid, nr, ISO_WHY_TRUNCATE, cwd, a[0], LL_TRUNCATE | LL_WRITE_FILE, W_OK, 1, 0);
        return;
#ifdef SYS_mkdir
    case SYS_mkdir:
        check_entry(tid, nr, ISO_WHY_CREATE, cwd, a[0], LL_MAKE_DIR);
        return;
#endif
    case SYS_mkdirat:
        check_entry(tid, nr, ISO_WHY_CREATE, (int)a[0], a[1], LL_MAKE_DIR);
        return;
#ifdef SYS_mknod
    case SYS_mknod:
        check_entry(tid, nr, ISO_WHY_CREATE, cwd, a[0], make_right((unsigned int)a[1]));
        return;
#endif
    case SYS_mknodat:
        check_entry(tid, nr, ISO_WHY_CREATE, (int)a[0], a[1], make_right((unsigned int)a[2]));
        return;
#ifdef SYS_symlink
    case SYS_symlink:
        check_entry(tid, nr, ISO_WHY_CREATE, cwd, a[1], LL_MAKE_SYM);
        return;
#endif
    case SYS_symlinkat:
        check_entry(tid, nr, ISO_WHY_CREATE, (int)a[1], a[2], LL_MAKE_SYM);
        return;
#ifdef SYS_link
    case SYS_link:
        check_entry(tid, nr, ISO_WHY_CREATE, cwd, a[1], LL_MAKE_REG);
        return;
#endif
    case SYS_linkat:
        check_entry(tid, nr, ISO_WHY_CREATE, (int)a[2], a[3], LL_MAKE_REG);
        return;
#ifdef SYS_unlink
    case SYS_unlink:
        check_entry(tid, nr, ISO_WHY_REMOVE, cwd, a[0], LL_REMOVE_FILE);
        return;
#endif
#ifdef SYS_rmdir
    case SYS_rmdir:
        check_entry(tid, nr, ISO_WHY_REMOVE, cwd, a[0], LL_REMOVE_DIR);
        return;
#endif
    case SYS_unlinkat:
        check_entry(tid, nr, ISO_WHY_REMOVE, (int)a[0], a[1], (a[2] & AT_REMOVEDIR) ? LL_REMOVE_DIR : LL_REMOVE_FILE);
        return;
#ifdef SYS_rename
    case SYS_rename:
        check_entry(tid, nr, ISO_WHY_RENAME, cwd, a[0], LL_REMOVE_FILE);
        check_entry(tid, nr, ISO_WHY_RENAME, cwd, a[1], LL_MAKE_REG);
        return;
#endif
#ifdef SYS_renameat
    case SYS_renameat:
#endif
    case SYS_renameat2:
        check_entry(tid, nr, ISO_WHY_RENAME, (int)a[0], a[1], LL_REMOVE_FILE);
        check_entry(tid, nr, ISO_WHY_RENAME, (int)a[2], a[3], LL_MAKE_REG);
        return;
#ifdef SYS_stat
    case SYS_stat:
        check_lookup(tid, nr, cwd, a[0], 1);
        return;
#endif
#ifdef SYS_lstat
    case SYS_lstat:
        check_lookup(tid, nr, cwd, a[0], 0);
        return;
#endif
#ifdef SYS_access
    case SYS_access:
        check_lookup(tid, nr, cwd, a[0], 1);
        return;
#endif
#ifdef SYS_readlink
    case SYS_readlink:
        check_lookup(tid, nr, cwd, a[0], 0);
        return;
#endif
    case SYS_chdir:
        check_lookup(tid, nr, cwd, a[0], 1);
        return;
    case SYS_newfstatat:
        check_lookup(tid, nr, (int)a[0], a[1], !(a[3] & AT_SYMLINK_NOFOLLOW));
        return;
    case SYS_statx:
        check_lookup(tid, nr, (int)a[0], a[1], !(a[2] & AT_SYMLINK_NOFOLLOW));
        return;
    case SYS_faccessat:
    case SYS_faccessat2:
        check_lookup(tid, nr, (int)a[0], a[1], 1);
        return;
    case SYS_readlinkat:
        check_lookup(tid, nr, (int)a[0], a[1], 0);
        return;
    default:
        table.seen--;
        return;
    }
}

/* Whether the notification is one of ours; when it is, it is let continue. */
int iso_why_notification(int listener, const struct seccomp_notif *req)
{
    if (!active)
        return 0;
    switch (req->data.nr) {
#ifdef SYS_open
    case SYS_open:
#endif
#ifdef SYS_creat
    case SYS_creat:
#endif
#ifdef SYS_mkdir
    case SYS_mkdir:
#endif
#ifdef SYS_mknod
    case SYS_mknod:
#endif
#ifdef SYS_symlink
    case SYS_symlink:
#endif
#ifdef SYS_link
    case SYS_link:
#endif
#ifdef SYS_unlink
    case SYS_unlink:
#endif
#ifdef SYS_rmdir
    case SYS_rmdir:
#endif
#ifdef SYS_rename
    case SYS_rename:
#endif
#ifdef SYS_renameat
    case SYS_renameat:
#endif
#ifdef SYS_stat
    case SYS_stat:
#endif
#ifdef SYS_lstat
    case SYS_lstat:
#endif
#ifdef SYS_access
    case SYS_access:
#endif
#ifdef SYS_readlink
    case SYS_readlink:
#endif
    case SYS_chdir:
    case SYS_newfstatat:
    case SYS_statx:
    case SYS_faccessat:
    case SYS_faccessat2:
    case SYS_readlinkat:
    case SYS_openat:
    case SYS_openat2:
    case SYS_execve:
    case SYS_execveat:
    case SYS_truncate:
    case SYS_mkdirat:
    case SYS_mknodat:
    case SYS_symlinkat:
    case SYS_linkat:
    case SYS_unlinkat:
    case SYS_renameat2:
        break;
    default:
        return 0;
    }
    /* Looked at while the call waits: its arguments are still the ones
     * the kernel will use (unless the program changes them meanwhile,
     * which only misleads its own report). */
    examine(req);
    named_path = NULL;
    let_continue(listener, req->id);
    return 1;
}
