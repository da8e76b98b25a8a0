/*
 * cli.c - the native `isolate-run`: replay a plan the Python side compiled.
 *
 * Python stays the one place where a policy means something: it parses the
 * options, resolves and checks paths, compiles seccomp and builds the
 * struct iso_plan (isolate/cliplan.py).  It writes that plan, with every
 * premise it rests on, into a per-user cache; this program looks the plan up
 * by its key (the option arguments, the working directory, the ids and the
 * environment), re-checks each premise, reopens each descriptor the plan uses
 * at the number it had (checking it is the same inode), runs the plan with
 * the same iso_spawn() as the Python package, waits, writes the report and
 * exits with the program's status.
 *
 * Whatever it does not know (a miss, a subcommand, an option outside its
 * table, a stale or foreign plan, a setup that failed before the program ran)
 * it hands over: it execs the interpreter recorded at build time on
 * isolate.cliplan.handover_main, which either writes the plan and execs this
 * program back (ISOLATE_RUN_REPLAY=1) or runs the command itself
 * (ISOLATE_RUN_NO_CACHE=1, so that the two never loop).
 */
#define _GNU_SOURCE
#include <arpa/inet.h>
#include <errno.h>
#include <fcntl.h>
#include <limits.h>
#include <poll.h>
#include <signal.h>
#include <stdarg.h>
#include <stdint.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/resource.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/types.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "isolate.h"

#ifndef ISO_CLI_PYTHON
#define ISO_CLI_PYTHON "/usr/bin/python3"
#endif

#define ENV_BINARY "ISOLATE_RUN_BINARY"
#define ENV_NO_CACHE "ISOLATE_RUN_NO_CACHE"
#define ENV_REPLAY "ISOLATE_RUN_REPLAY"
#define ENV_TRACE "ISOLATE_RUN_TRACE"  /* set: say on stderr whether the plan was replayed, and why not */
#define MAGIC "ISOPLAN2"
#define KEY_PREFIX "isolate-run plan v2"
#define DEFAULT_PATH "/usr/local/bin:/usr/bin:/bin"
#define MAX_PLAN_BYTES (16 << 20)
#define TERM_GRACE_MS 2000
#define NULL_LEN 0xFFFFFFFFu

extern char **environ;

static char **g_argv;
static int g_replay;   /* exec'd back by the Python side after it wrote the plan */
static int g_trace;

/* Why a plan is not replayed (with ISOLATE_RUN_TRACE set); returns 0 for the callers' convenience. */
static int miss(const char *why, const char *what)
{
    if (g_trace)
        fprintf(stderr, "isolate-run: trace: not replayed: %s%s%s\n", why, what ? ": " : "", what ? what : "");
    return 0;
}

/* ---------------------------------------------------------------- handover */

static const char BOOT[] =
    "import sys\n"
    "if sys.path and sys.path[0] == '': del sys.path[0]\n" /* never import from the working directory */
    "from isolate.cliplan import handover_main\n"
    "sys.exit(handover_main())\n";

/* Run the Python CLI in this process's place.  no_cache: it must run the
 * command itself (this program could not replay what it planned, or a setup
 * failed before the program ran, and Python says exactly why). */
static void __attribute__((noreturn)) handover(int no_cache, const char *why)
{
    miss(why, NULL);
    char self[PATH_MAX];
    ssize_t n = readlink("/proc/self/exe", self, sizeof self - 1);
    if (n > 0) {
        self[n] = '\0';
        if (setenv(ENV_BINARY, self, 1) < 0)
            no_cache = 1;
    } else {
        no_cache = 1;
    }
    if (g_trace && setenv(ENV_TRACE, "1", 1) < 0)
        no_cache = 1;
    if ((no_cache || g_replay) && setenv(ENV_NO_CACHE, "1", 1) < 0) {
        fprintf(stderr, "isolate-run: cannot hand over to the Python side: %s\n", strerror(errno));
        _exit(125);
    }
    int argc = 0;
    while (g_argv[argc])
        argc++;
    char **args = calloc((size_t)argc + 4, sizeof *args);
    if (!args) {
        fprintf(stderr, "isolate-run: out of memory\n");
        _exit(125);
    }
    args[0] = ISO_CLI_PYTHON;
    args[1] = "-c";
    args[2] = (char *)BOOT;
    for (int i = 1; i < argc; i++)
        args[2 + i] = g_argv[i];
    execv(ISO_CLI_PYTHON, args);
    int err = errno;
    /* The interpreter the package was built with is gone: the one beside this program, then PATH's. */
    char beside[PATH_MAX + 16];
    if (n > 0) {
        char *slash = strrchr(self, '/');
        if (slash) {
            snprintf(beside, sizeof beside, "%.*s/python3", (int)(slash - self), self);
            args[0] = beside;
            execv(beside, args);
        }
    }
    args[0] = "python3";
    execvp("python3", args);
    fprintf(stderr, "isolate-run: cannot start the Python side (%s: %s); reinstall isolate\n", ISO_CLI_PYTHON,
            strerror(err));
    _exit(125);
}

/* ------------------------------------------------------------ small helpers */

struct buf {
    char *data;
    size_t len, cap;
};

static void buf_add(struct buf *b, const void *data, size_t len)
{
    if (b->len + len + 1 > b->cap) {
        size_t cap = b->cap ? b->cap : 4096;
        while (cap < b->len + len + 1)
            cap *= 2;
        char *grown = realloc(b->data, cap);
        if (!grown) {
            fprintf(stderr, "isolate-run: out of memory\n");
            _exit(125);
        }
        b->data = grown;
        b->cap = cap;
    }
    memcpy(b->data + b->len, data, len);
    b->len += len;
    b->data[b->len] = '\0';
}

static void buf_str(struct buf *b, const char *s) { buf_add(b, s, strlen(s)); }

static void buf_fmt(struct buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
static void buf_fmt(struct buf *b, const char *fmt, ...)
{
    char tmp[256];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n > 0)
        buf_add(b, tmp, (size_t)n < sizeof tmp ? (size_t)n : sizeof tmp - 1);
}

static int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* posixpath.normpath of an absolute path (or of cwd joined with a relative one). */
static void normpath(const char *cwd, const char *path, char *out, size_t size)
{
    char joined[2 * PATH_MAX + 2];
    if (path[0] == '/')
        snprintf(joined, sizeof joined, "%s", path);
    else
        snprintf(joined, sizeof joined, "%s/%s", cwd, path);
    size_t o = 0;
    /* normpath keeps exactly two leading slashes (POSIX leaves their meaning open). */
    if (joined[0] == '/' && joined[1] == '/' && joined[2] != '/')
        out[o++] = '/';
    out[o++] = '/';
    size_t root = o;
    const char *p = joined;
    while (*p) {
        while (*p == '/')
            p++;
        const char *start = p;
        while (*p && *p != '/')
            p++;
        size_t len = (size_t)(p - start);
        if (len == 0 || (len == 1 && start[0] == '.'))
            continue;
        if (len == 2 && start[0] == '.' && start[1] == '.') {
            if (o > root) {
                while (o > root && out[o - 1] != '/')
                    o--;
                if (o > root)
                    o--;
            }
            continue;
        }
        if (o + len + 2 >= size)
            break;
        if (o > root)
            out[o++] = '/';
        memcpy(out + o, start, len);
        o += len;
    }
    out[o] = '\0';
}

static int is_inside(const char *path, char **granted, uint32_t n)
{
    for (uint32_t i = 0; i < n; i++) {
        const char *g = granted[i];
        size_t len = strlen(g);
        while (len > 0 && g[len - 1] == '/')
            len--;
        if (strcmp(path, g) == 0)
            return 1;
        if (strncmp(path, g, len) == 0 && path[len] == '/')
            return 1;
    }
    return 0;
}

/* environment.which: the first executable regular file named program in search_path. */
static int which(const char *program, const char *search_path, char *out, size_t size)
{
    const char *p = search_path;
    while (1) {
        const char *end = strchr(p, ':');
        size_t len = end ? (size_t)(end - p) : strlen(p);
        if (len > 0 && p[0] == '/' && len < PATH_MAX) {
            if (p[len - 1] == '/')
                snprintf(out, size, "%.*s%s", (int)len, p, program);
            else
                snprintf(out, size, "%.*s/%s", (int)len, p, program);
            struct stat st;
            if (stat(out, &st) == 0 && S_ISREG(st.st_mode) && access(out, X_OK) == 0)
                return 1;
        }
        if (!end)
            return 0;
        p = end + 1;
    }
}

/* SHA-256 (FIPS 180-4) of the key: the plan holds the digest, never the caller's environment. */
static const uint32_t SHA_K[64] = {
    0x428a2f98, 0x71374491, 0xb5c0fbcf, 0xe9b5dba5, 0x3956c25b, 0x59f111f1, 0x923f82a4, 0xab1c5ed5,
    0xd807aa98, 0x12835b01, 0x243185be, 0x550c7dc3, 0x72be5d74, 0x80deb1fe, 0x9bdc06a7, 0xc19bf174,
    0xe49b69c1, 0xefbe4786, 0x0fc19dc6, 0x240ca1cc, 0x2de92c6f, 0x4a7484aa, 0x5cb0a9dc, 0x76f988da,
    0x983e5152, 0xa831c66d, 0xb00327c8, 0xbf597fc7, 0xc6e00bf3, 0xd5a79147, 0x06ca6351, 0x14292967,
    0x27b70a85, 0x2e1b2138, 0x4d2c6dfc, 0x53380d13, 0x650a7354, 0x766a0abb, 0x81c2c92e, 0x92722c85,
    0xa2bfe8a1, 0xa81a664b, 0xc24b8b70, 0xc76c51a3, 0xd192e819, 0xd6990624, 0xf40e3585, 0x106aa070,
    0x19a4c116, 0x1e376c08, 0x2748774c, 0x34b0bcb5, 0x391c0cb3, 0x4ed8aa4a, 0x5b9cca4f, 0x682e6ff3,
    0x748f82ee, 0x78a5636f, 0x84c87814, 0x8cc70208, 0x90befffa, 0xa4506ceb, 0xbef9a3f7, 0xc67178f2};

#define ROTR(x, n) (((x) >> (n)) | ((x) << (32 - (n))))

static void sha256_block(uint32_t h[8], const unsigned char *block)
{
    uint32_t w[64];
    for (int i = 0; i < 16; i++)
        w[i] = (uint32_t)block[4 * i] << 24 | (uint32_t)block[4 * i + 1] << 16 | (uint32_t)block[4 * i + 2] << 8 |
               (uint32_t)block[4 * i + 3];
    for (int i = 16; i < 64; i++) {
        uint32_t s0 = ROTR(w[i - 15], 7) ^ ROTR(w[i - 15], 18) ^ (w[i - 15] >> 3);
        uint32_t s1 = ROTR(w[i - 2], 17) ^ ROTR(w[i - 2], 19) ^ (w[i - 2] >> 10);
        w[i] = w[i - 16] + s0 + w[i - 7] + s1;
    }
    uint32_t a = h[0], b = h[1], c = h[2], d = h[3], e = h[4], f = h[5], g = h[6], k = h[7];
    for (int i = 0; i < 64; i++) {
        uint32_t t1 = k + (ROTR(e, 6) ^ ROTR(e, 11) ^ ROTR(e, 25)) + ((e & f) ^ (~e & g)) + SHA_K[i] + w[i];
        uint32_t t2 = (ROTR(a, 2) ^ ROTR(a, 13) ^ ROTR(a, 22)) + ((a & b) ^ (a & c) ^ (b & c));
        k = g;
        g = f;
        f = e;
        e = d + t1;
        d = c;
        c = b;
        b = a;
        a = t1 + t2;
    }
    h[0] += a;
    h[1] += b;
    h[2] += c;
    h[3] += d;
    h[4] += e;
    h[5] += f;
    h[6] += g;
    h[7] += k;
}

static void sha256(const unsigned char *data, size_t len, unsigned char out[32])
{
    uint32_t h[8] = {0x6a09e667, 0xbb67ae85, 0x3c6ef372, 0xa54ff53a, 0x510e527f, 0x9b05688c, 0x1f83d9ab, 0x5be0cd19};
    size_t done = 0;
    for (; len - done >= 64; done += 64)
        sha256_block(h, data + done);
    unsigned char tail[128];
    size_t rest = len - done;
    memset(tail, 0, sizeof tail);
    memcpy(tail, data + done, rest);
    tail[rest] = 0x80;
    size_t blocks = rest + 9 > 64 ? 2 : 1;
    uint64_t bits = (uint64_t)len * 8;
    for (int i = 0; i < 8; i++)
        tail[blocks * 64 - 1 - i] = (unsigned char)(bits >> (8 * i));
    for (size_t i = 0; i < blocks; i++)
        sha256_block(h, tail + 64 * i);
    for (int i = 0; i < 8; i++) {
        out[4 * i] = (unsigned char)(h[i] >> 24);
        out[4 * i + 1] = (unsigned char)(h[i] >> 16);
        out[4 * i + 2] = (unsigned char)(h[i] >> 8);
        out[4 * i + 3] = (unsigned char)h[i];
    }
}

static int cmp_strings(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Read a whole small file; -1 when it cannot be read. */
static ssize_t read_file(const char *path, char *out, size_t size, int nofollow)
{
    int fd = open(path, O_RDONLY | O_CLOEXEC | O_NONBLOCK | (nofollow ? O_NOFOLLOW : 0));
    if (fd < 0)
        return -1;
    size_t got = 0;
    while (got < size) {
        ssize_t n = read(fd, out + got, size - got);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0) {
            close(fd);
            return -1;
        }
        if (n == 0)
            break;
        got += (size_t)n;
    }
    close(fd);
    return (ssize_t)got;
}

/* --------------------------------------------------------- the plan reader */

struct reader {
    const unsigned char *p, *end;
    int bad;
};

static const void *take(struct reader *r, size_t n)
{
    if (r->bad || (size_t)(r->end - r->p) < n) {
        r->bad = 1;
        return NULL;
    }
    const void *at = r->p;
    r->p += n;
    return at;
}

static uint32_t r_u32(struct reader *r)
{
    uint32_t v = 0;
    const void *at = take(r, 4);
    if (at)
        memcpy(&v, at, 4);
    return v;
}

static int32_t r_i32(struct reader *r) { return (int32_t)r_u32(r); }

static uint64_t r_u64(struct reader *r)
{
    uint64_t v = 0;
    const void *at = take(r, 8);
    if (at)
        memcpy(&v, at, 8);
    return v;
}

static int64_t r_i64(struct reader *r) { return (int64_t)r_u64(r); }

/* Bytes followed by a NUL inside the buffer; NULL for the NULL length (or a bad plan). */
static const char *r_data(struct reader *r, uint32_t *len_out)
{
    uint32_t len = r_u32(r);
    if (len_out)
        *len_out = 0;
    if (r->bad || len == NULL_LEN)
        return NULL;
    const char *at = take(r, (size_t)len + 1);
    if (!at || at[len] != '\0') {
        r->bad = 1;
        return NULL;
    }
    if (len_out)
        *len_out = len;
    return at;
}

/* A count of entries, each at least min_size bytes: never more than the rest of the plan holds. */
static uint32_t r_count(struct reader *r, size_t min_size)
{
    uint32_t n = r_u32(r);
    if ((size_t)(r->end - r->p) / min_size < n)
        r->bad = 1;
    return r->bad ? 0 : n;
}

/* ------------------------------------------------------ options and the key */

static const char *const VALUE_OPTIONS[] = {
    "--ro", "--rw", "--bind", "--ro-bind", "--tmpfs", "--chdir", "--home", "--home-file", "--net", "--unix-socket",
    "--memory", "--cpu", "--cpus", "--wall", "--pids", "--nofile", "--fsize", "--tmpfs-size", "--seccomp", "--env",
    "--keep-env", "--backend", "--image", "--profile", "--uid", "--gid", "--report", NULL};
static const char *const FLAG_OPTIONS[] = {"--no-defaults", "--no-namespaces", "--best-effort", NULL};

static int in_table(const char *const *table, const char *name, size_t len)
{
    for (int i = 0; table[i]; i++)
        if (strlen(table[i]) == len && strncmp(table[i], name, len) == 0)
            return 1;
    return 0;
}

struct args {
    int command;            /* index of the command's first argument */
    const char *report;     /* --report's value, or NULL */
    struct buf key_args;    /* the option arguments, --report aside, each NUL-terminated */
};

/* Split argv as isolate.cli's parser does, for the options this program knows; 0: hand over. */
static int split_args(int argc, char **argv, struct args *a)
{
    int i = 1;
    memset(a, 0, sizeof *a);
    while (i < argc) {
        const char *arg = argv[i];
        if (strcmp(arg, "--") == 0) {
            i++;
            break;
        }
        if (arg[0] != '-' || arg[1] == '\0')
            break;
        if (arg[1] != '-')
            return 0; /* -h and friends */
        const char *eq = strchr(arg, '=');
        size_t name_len = eq ? (size_t)(eq - arg) : strlen(arg);
        if (in_table(FLAG_OPTIONS, arg, name_len) && !eq) {
            buf_add(&a->key_args, arg, strlen(arg) + 1);
            i++;
            continue;
        }
        if (!in_table(VALUE_OPTIONS, arg, name_len))
            return 0;
        const char *value;
        int used;
        if (eq) {
            value = eq + 1;
            used = 1;
        } else {
            if (i + 1 >= argc || argv[i + 1][0] == '-')
                return 0; /* argparse's own rules for such values: its message */
            value = argv[i + 1];
            used = 2;
        }
        if (name_len == 8 && strncmp(arg, "--report", 8) == 0) {
            a->report = value;
        } else {
            for (int k = 0; k < used; k++)
                buf_add(&a->key_args, argv[i + k], strlen(argv[i + k]) + 1);
        }
        i += used;
    }
    if (i >= argc || strcmp(argv[i], "--") == 0)
        return 0; /* no command, or "-- --": isolate.cli's rules */
    a->command = i;
    return 1;
}

static int build_key(struct buf *key, const char *cwd, const struct args *a)
{
    buf_add(key, KEY_PREFIX, sizeof KEY_PREFIX); /* with its NUL */
    buf_fmt(key, "%u %u %u %u", (unsigned)getuid(), (unsigned)geteuid(), (unsigned)getgid(), (unsigned)getegid());
    buf_add(key, "", 1);
    buf_add(key, cwd, strlen(cwd) + 1);
    buf_add(key, "argv", 5);
    buf_add(key, a->key_args.data ? a->key_args.data : "", a->key_args.len);
    buf_add(key, "env", 4);
    size_t n = 0;
    while (environ[n])
        n++;
    char **sorted = calloc(n + 1, sizeof *sorted);
    if (!sorted)
        return 0;
    for (size_t i = 0; i < n; i++) {
        const char *eq = strchr(environ[i], '=');
        if (!eq || eq == environ[i]) {
            free(sorted);
            return 0; /* Python's os.environ would not show it as is */
        }
        sorted[i] = environ[i];
    }
    /* What a shell changes between commands and isolate never reads (cliplan.SHELL_NOISE): left out. */
    size_t kept = 0;
    for (size_t i = 0; i < n; i++)
        if (strncmp(sorted[i], "_=", 2) != 0 && strncmp(sorted[i], "OLDPWD=", 7) != 0 &&
            strncmp(sorted[i], "SHLVL=", 6) != 0)
            sorted[kept++] = sorted[i];
    n = kept;
    qsort(sorted, n, sizeof *sorted, cmp_strings);
    for (size_t i = 0; i < n; i++) {
        if (i > 0) {
            const char *a_eq = strchr(sorted[i - 1], '='), *b_eq = strchr(sorted[i], '=');
            if (a_eq - sorted[i - 1] == b_eq - sorted[i] && strncmp(sorted[i - 1], sorted[i], (size_t)(a_eq - sorted[i - 1])) == 0) {
                free(sorted);
                return 0; /* a name twice */
            }
        }
        buf_add(key, sorted[i], strlen(sorted[i]) + 1);
    }
    free(sorted);
    return 1;
}

/* registry.runtime_dir(create=False), then "cli". */
static int private_dir(const char *path)
{
    struct stat st;
    return lstat(path, &st) == 0 && S_ISDIR(st.st_mode) && st.st_uid == geteuid() && !(st.st_mode & 077);
}

static int cache_dir(char *out, size_t size)
{
    uid_t uid = geteuid();
    struct stat st;
    char runtime[PATH_MAX];
    const char *xdg = getenv("XDG_RUNTIME_DIR");
    if (uid == 0 && stat("/run", &st) == 0 && S_ISDIR(st.st_mode))
        snprintf(runtime, sizeof runtime, "/run/isolate");
    else if (xdg && xdg[0] == '/' && strlen(xdg) < PATH_MAX - 16 && private_dir(xdg))
        snprintf(runtime, sizeof runtime, "%s/isolate", xdg);
    else
        snprintf(runtime, sizeof runtime, "/tmp/isolate-%u", (unsigned)uid);
    /* Every level private to the caller: nobody else can have put a plan there. */
    if (!private_dir(runtime))
        return 0;
    int n = snprintf(out, size, "%s/cli", runtime);
    return n > 0 && (size_t)n < size && private_dir(out);
}

/* The plan file of this key, checked: a regular file of the caller's, writable by nobody else. */
static unsigned char *load_plan(const char *dir, const unsigned char digest[32], size_t *len_out)
{
    char path[PATH_MAX + 32];
    int at = snprintf(path, sizeof path, "%s/", dir);
    if (at <= 0 || (size_t)at + 22 >= sizeof path)
        return NULL;
    for (int i = 0; i < 8; i++)
        at += snprintf(path + at, sizeof path - (size_t)at, "%02x", digest[i]);
    snprintf(path + at, sizeof path - (size_t)at, ".plan");
    int fd = open(path, O_RDONLY | O_NOFOLLOW | O_CLOEXEC | O_NONBLOCK);
    if (fd < 0)
        return NULL;
    struct stat st;
    if (fstat(fd, &st) < 0 || !S_ISREG(st.st_mode) || st.st_uid != geteuid() || (st.st_mode & 022) ||
        st.st_nlink != 1 || st.st_size <= 0 || st.st_size > MAX_PLAN_BYTES) {
        close(fd);
        return NULL;
    }
    unsigned char *data = malloc((size_t)st.st_size);
    size_t got = 0;
    while (data && got < (size_t)st.st_size) {
        ssize_t n = read(fd, data + got, (size_t)st.st_size - got);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            break;
        got += (size_t)n;
    }
    close(fd);
    if (!data || got != (size_t)st.st_size) {
        free(data);
        return NULL;
    }
    *len_out = got;
    return data;
}

/* ------------------------------------------------------------ the replay */

struct fd_entry {
    int32_t fd;
    const char *path;
    uint32_t ifmt;
    uint64_t dev, ino;
    int opened;
};

struct replay {
    struct iso_plan plan;
    struct iso_mount *mounts;
    struct iso_rlimit *rlimits;
    struct iso_landlock_rule *rules;
    char **envp;
    struct fd_entry *fds;
    uint32_t n_fds;
    char **granted;
    uint32_t n_granted;
    uint32_t program_uid, program_gid;
    uint32_t *idmap;
    uint32_t n_idmap;
    /* the report */
    const char *report_mid, *report_tail;
    char **warnings;
    uint32_t n_warnings;
    const char *msg_timeout, *msg_cpu, *msg_fsize;
    const char *hint_net, *hint_unix, *hint_dgram;
    int32_t *name_nrs;
    const char **names;
    uint32_t n_names;
};

static int same_time(const struct stat *st, int64_t mtime_ns)
{
    return (int64_t)st->st_mtim.tv_sec * 1000000000 + st->st_mtim.tv_nsec == mtime_ns;
}

/* Parse the plan and check every premise it records; 0: stale, foreign or malformed. */
static int parse_plan(struct reader *r, const unsigned char digest[32], struct replay *rp)
{
    const char *magic = take(r, 8);
    if (!magic || memcmp(magic, MAGIC, 8) != 0)
        return miss("stale or malformed plan", "check at cli.c:575");
    uint32_t len;
    const char *stored = r_data(r, &len);
    if (!stored || len != 32 || memcmp(stored, digest, 32) != 0)
        return miss("stale or malformed plan", "check at cli.c:579");

    /* This program, and every file of the package that wrote the plan. */
    struct stat st;
    uint64_t dev = r_u64(r), ino = r_u64(r);
    int64_t size = r_i64(r), mtime = r_i64(r);
    if (r->bad || stat("/proc/self/exe", &st) < 0 || st.st_dev != dev || st.st_ino != ino || st.st_size != size ||
        !same_time(&st, mtime))
        return miss("stale or malformed plan", "check at cli.c:587");
    uint32_t n = r_count(r, 20);
    for (uint32_t i = 0; i < n; i++) {
        const char *path = r_data(r, NULL);
        size = r_i64(r);
        mtime = r_i64(r);
        if (!path || stat(path, &st) < 0 || st.st_size != size || !same_time(&st, mtime))
            return miss("stale or malformed plan", "check at cli.c:594");
    }
    /* Host facts. */
    n = r_count(r, 8);
    for (uint32_t i = 0; i < n; i++) {
        const char *path = r_data(r, NULL);
        uint32_t want_len;
        const char *want = r_data(r, &want_len);
        if (!path)
            return miss("stale or malformed plan", "check at cli.c:603");
        char now[4097];
        ssize_t got = read_file(path, now, 4096, 0);
        if ((got < 0) != (want == NULL))
            return miss("stale or malformed plan", "check at cli.c:607");
        if (want && ((size_t)got != want_len || memcmp(now, want, want_len) != 0))
            return miss("stale or malformed plan", "check at cli.c:609");
    }
    /* Profile and seccomp files: the same contents. */
    n = r_count(r, 8);
    for (uint32_t i = 0; i < n; i++) {
        const char *path = r_data(r, NULL);
        uint32_t want_len;
        const char *want = r_data(r, &want_len);
        if (!path || !want)
            return miss("stale or malformed plan", "check at cli.c:618");
        char *now = malloc((size_t)want_len + 1);
        ssize_t got = now ? read_file(path, now, (size_t)want_len + 1, 0) : -1;
        int same = got == (ssize_t)want_len && memcmp(now, want, want_len) == 0;
        free(now);
        if (!same)
            return miss("stale or malformed plan", "check at cli.c:624");
    }
    /* Every path the policy names: the same inode, or still absent. */
    n = r_count(r, 24);
    for (uint32_t i = 0; i < n; i++) {
        const char *path = r_data(r, NULL);
        uint32_t present = r_u32(r);
        dev = r_u64(r);
        ino = r_u64(r);
        if (!path)
            return miss("stale or malformed plan", "check at cli.c:634");
        int found = stat(path, &st) == 0;
        if (found != (present != 0) || (found && (st.st_dev != dev || st.st_ino != ino)))
            return miss("stale or malformed plan", "check at cli.c:637");
    }
    /* The descriptors (opened and checked later, in place). */
    n = r_count(r, 32);
    rp->fds = calloc(n ? n : 1, sizeof *rp->fds);
    if (!rp->fds)
        return miss("stale or malformed plan", "check at cli.c:643");
    rp->n_fds = n;
    for (uint32_t i = 0; i < n; i++) {
        struct fd_entry *e = &rp->fds[i];
        e->fd = r_i32(r);
        e->path = r_data(r, NULL);
        e->ifmt = r_u32(r);
        e->dev = r_u64(r);
        e->ino = r_u64(r);
        if (!e->path || e->fd <= 2 || e->fd > 65535)
            return miss("stale or malformed plan", "check at cli.c:653");
    }
    n = r_count(r, 5);
    rp->granted = calloc(n ? n : 1, sizeof *rp->granted);
    if (!rp->granted)
        return miss("stale or malformed plan", "check at cli.c:658");
    rp->n_granted = n;
    for (uint32_t i = 0; i < n; i++)
        if (!(rp->granted[i] = (char *)r_data(r, NULL)))
            return miss("stale or malformed plan", "check at cli.c:662");

    /* The plan itself. */
    struct iso_plan *p = &rp->plan;
    memset(p, 0, sizeof *p);
    p->clone_flags = r_i32(r);
    p->uid_map = r_data(r, NULL);
    p->gid_map = r_data(r, NULL);
    p->setgroups_deny = r_i32(r);
    p->staging = r_data(r, NULL);
    n = r_count(r, 32);
    rp->mounts = calloc(n ? n : 1, sizeof *rp->mounts);
    if (!rp->mounts)
        return miss("stale or malformed plan", "check at cli.c:675");
    for (uint32_t i = 0; i < n; i++) {
        struct iso_mount *m = &rp->mounts[i];
        m->kind = r_i32(r);
        m->flags = r_i32(r);
        m->fd = r_i32(r);
        m->mode = r_i32(r);
        m->source = r_data(r, NULL);
        m->target = r_data(r, NULL);
        m->upper = r_data(r, NULL);
        m->work = r_data(r, NULL);
    }
    p->mounts = rp->mounts;
    p->n_mounts = (int32_t)n;
    p->hostname = r_data(r, NULL);
    p->loopback_up = r_i32(r);
    p->new_session = r_i32(r);
    p->die_with_parent = r_i32(r);
    p->cwd = r_data(r, NULL);
    n = r_count(r, 20);
    rp->rlimits = calloc(n ? n : 1, sizeof *rp->rlimits);
    if (!rp->rlimits)
        return miss("stale or malformed plan", "check at cli.c:697");
    for (uint32_t i = 0; i < n; i++) {
        rp->rlimits[i].resource = r_i32(r);
        rp->rlimits[i].soft = r_u64(r);
        rp->rlimits[i].hard = r_u64(r);
    }
    p->rlimits = rp->rlimits;
    p->n_rlimits = (int32_t)n;
    p->set_ids = (int32_t)r_i64(r);
    p->uid = (uint32_t)r_i64(r);
    p->gid = (uint32_t)r_i64(r);
    p->clear_groups = (int32_t)r_i64(r);
    p->drop_caps = (int32_t)r_i64(r);
    p->no_new_privs = (int32_t)r_i64(r);
    p->landlock_abi = (int32_t)r_i64(r);
    p->landlock_handled_fs = r_u64(r);
    p->landlock_handled_net = r_u64(r);
    p->landlock_scoped = r_u64(r);
    n = r_count(r, 16);
    rp->rules = calloc(n ? n : 1, sizeof *rp->rules);
    if (!rp->rules)
        return miss("stale or malformed plan", "check at cli.c:718");
    for (uint32_t i = 0; i < n; i++) {
        rp->rules[i].path = r_data(r, NULL);
        rp->rules[i].access = r_u64(r);
        rp->rules[i].fd = r_i32(r);
    }
    p->landlock_rules = rp->rules;
    p->n_landlock_rules = (int32_t)n;
    uint32_t filter_len;
    const char *filter = r_data(r, &filter_len);
    p->seccomp_len = r_i32(r);
    if (filter && ((uint32_t)p->seccomp_len * 8u != filter_len || p->seccomp_len <= 0 || p->seccomp_len > 65535))
        return miss("stale or malformed plan", "check at cli.c:730");
    if (filter) {
        /* struct sock_filter wants its alignment: a copy of its own. */
        void *copy = malloc(filter_len);
        if (!copy)
            return miss("stale or malformed plan", "check at cli.c:735");
        memcpy(copy, filter, filter_len);
        p->seccomp_filter = copy;
    } else {
        p->seccomp_len = 0;
    }
    p->seccomp_notify = r_i32(r);
    p->seccomp_errnos = r_data(r, NULL);
    n = r_count(r, 5);
    rp->envp = calloc((size_t)n + 1, sizeof *rp->envp);
    if (!rp->envp)
        return miss("stale or malformed plan", "check at cli.c:746");
    for (uint32_t i = 0; i < n; i++)
        if (!(rp->envp[i] = (char *)r_data(r, NULL)))
            return miss("stale or malformed plan", "check at cli.c:749");
    p->envp = rp->envp;
    p->search_path = r_data(r, NULL);
    p->init_fd = r_i32(r);
    p->wall_ms = r_i64(r);
    p->supervise = r_data(r, NULL);
    rp->program_uid = r_u32(r);
    rp->program_gid = r_u32(r);
    n = r_count(r, 4);
    rp->idmap = calloc(n ? n : 1, sizeof *rp->idmap);
    if (!rp->idmap)
        return miss("stale or malformed plan", "check at cli.c:760");
    rp->n_idmap = n;
    for (uint32_t i = 0; i < n; i++) {
        rp->idmap[i] = r_u32(r);
        if (rp->idmap[i] >= (uint32_t)p->n_mounts || rp->mounts[rp->idmap[i]].kind != ISO_MOUNT_MOVE ||
            !rp->mounts[rp->idmap[i]].source)
            return miss("stale or malformed plan", "check at cli.c:766");
    }

    /* The report's fixed parts and the messages. */
    rp->report_mid = r_data(r, NULL);
    rp->report_tail = r_data(r, NULL);
    n = r_count(r, 5);
    rp->warnings = calloc(n ? n : 1, sizeof *rp->warnings);
    if (!rp->warnings)
        return miss("stale or malformed plan", "check at cli.c:775");
    rp->n_warnings = n;
    for (uint32_t i = 0; i < n; i++)
        if (!(rp->warnings[i] = (char *)r_data(r, NULL)))
            return miss("stale or malformed plan", "check at cli.c:779");
    rp->msg_timeout = r_data(r, NULL);
    rp->msg_cpu = r_data(r, NULL);
    rp->msg_fsize = r_data(r, NULL);
    rp->hint_net = r_data(r, NULL);
    rp->hint_unix = r_data(r, NULL);
    rp->hint_dgram = r_data(r, NULL);
    n = r_count(r, 9);
    rp->name_nrs = calloc(n ? n : 1, sizeof *rp->name_nrs);
    rp->names = calloc(n ? n : 1, sizeof *rp->names);
    if (!rp->name_nrs || !rp->names)
        return miss("stale or malformed plan", "check at cli.c:790");
    rp->n_names = n;
    for (uint32_t i = 0; i < n; i++) {
        rp->name_nrs[i] = r_i32(r);
        if (!(rp->names[i] = r_data(r, NULL)))
            return miss("stale or malformed plan", "check at cli.c:795");
    }
    if (r->bad || r->p != r->end || !rp->report_mid || !rp->report_tail || !p->search_path)
        return miss("stale or malformed plan", "check at cli.c:798");

    /* Every descriptor number the plan uses is in the table. */
    for (int32_t i = 0; i < p->n_mounts; i++) {
        int fd = rp->mounts[i].fd;
        const char *src = rp->mounts[i].source;
        if (rp->mounts[i].kind == ISO_MOUNT_MOVE && src && strncmp(src, "/proc/self/fd/", 14) == 0)
            fd = atoi(src + 14);
        else if (fd < 0)
            continue;
        int found = 0;
        for (uint32_t k = 0; k < rp->n_fds; k++)
            found |= rp->fds[k].fd == fd;
        if (!found)
            return miss("stale or malformed plan", "check at cli.c:812");
    }
    return 1;
}

/* Reopen each descriptor by its path at the number the plan uses, and check it is the same inode. */
static int place_fds(struct replay *rp)
{
    int base = 3;
    for (uint32_t i = 0; i < rp->n_fds; i++)
        if (rp->fds[i].fd >= base)
            base = rp->fds[i].fd + 1;
    int *high = calloc(rp->n_fds ? rp->n_fds : 1, sizeof *high);
    if (!high)
        return 0;
    uint32_t opened = 0;
    int ok = 1;
    for (; opened < rp->n_fds; opened++) {
        struct fd_entry *e = &rp->fds[opened];
        int fd = open(e->path, O_PATH | O_NOFOLLOW | O_CLOEXEC);
        struct stat st;
        if (fd < 0) {
            ok = 0;
            break;
        }
        if (fstat(fd, &st) < 0 || (uint32_t)(st.st_mode & S_IFMT) != e->ifmt || st.st_dev != e->dev ||
            st.st_ino != e->ino) {
            close(fd);
            ok = 0;
            break;
        }
        high[opened] = fcntl(fd, F_DUPFD_CLOEXEC, base);
        close(fd);
        if (high[opened] < 0) {
            ok = 0;
            break;
        }
    }
    for (uint32_t i = 0; i < opened; i++) {
        if (ok && dup3(high[i], rp->fds[i].fd, O_CLOEXEC) < 0)
            ok = 0;
        close(high[i]);
    }
    free(high);
    return ok;
}

/* ------------------------------------------------------------- the report */

/* The next code point of UTF-8 text, invalid bytes as U+FFFD (maximal subparts, as Python decodes). */
static uint32_t utf8_next(const unsigned char *s, size_t len, size_t *used)
{
    unsigned char b = s[0];
    uint32_t cp;
    int need;
    unsigned char lo = 0x80, hi = 0xbf;
    if (b < 0x80) {
        *used = 1;
        return b;
    } else if (b >= 0xc2 && b <= 0xdf) {
        need = 1;
        cp = b & 0x1f;
    } else if (b >= 0xe0 && b <= 0xef) {
        need = 2;
        cp = b & 0x0f;
        if (b == 0xe0)
            lo = 0xa0;
        if (b == 0xed)
            hi = 0x9f;
    } else if (b >= 0xf0 && b <= 0xf4) {
        need = 3;
        cp = b & 0x07;
        if (b == 0xf0)
            lo = 0x90;
        if (b == 0xf4)
            hi = 0x8f;
    } else {
        *used = 1;
        return 0xfffd;
    }
    size_t i = 1;
    for (; i <= (size_t)need; i++) {
        if (i >= len || s[i] < lo || s[i] > hi) {
            *used = i;
            return 0xfffd;
        }
        cp = (cp << 6) | (s[i] & 0x3f);
        lo = 0x80;
        hi = 0xbf;
    }
    *used = i;
    return cp;
}

/* json.dumps of a string (ensure_ascii). */
static void json_string(struct buf *b, const char *text, size_t len)
{
    const unsigned char *s = (const unsigned char *)text;
    buf_add(b, "\"", 1);
    for (size_t i = 0; i < len;) {
        size_t used;
        uint32_t cp = utf8_next(s + i, len - i, &used);
        i += used;
        switch (cp) {
        case '"': buf_str(b, "\\\""); break;
        case '\\': buf_str(b, "\\\\"); break;
        case '\n': buf_str(b, "\\n"); break;
        case '\r': buf_str(b, "\\r"); break;
        case '\t': buf_str(b, "\\t"); break;
        case '\b': buf_str(b, "\\b"); break;
        case '\f': buf_str(b, "\\f"); break;
        default:
            if (cp >= 0x20 && cp < 0x7f) {
                char c = (char)cp;
                buf_add(b, &c, 1);
            } else if (cp < 0x10000) {
                buf_fmt(b, "\\u%04x", cp);
            } else {
                cp -= 0x10000;
                buf_fmt(b, "\\u%04x\\u%04x", 0xd800 + (cp >> 10), 0xdc00 + (cp & 0x3ff));
            }
        }
    }
    buf_add(b, "\"", 1);
}

/* str.isprintable, for the characters a terminal could take as control: the others pass. */
static int printable(uint32_t cp)
{
    if (cp < 0x20 || cp == 0x7f || (cp >= 0x80 && cp <= 0xa0) || cp == 0xad || cp == 0x1680 || cp == 0x180e)
        return 0;
    if ((cp >= 0x2000 && cp <= 0x200f) || (cp >= 0x2028 && cp <= 0x202f) || (cp >= 0x205f && cp <= 0x206f))
        return 0;
    if (cp == 0x3000 || cp == 0xfeff || (cp >= 0xfff9 && cp <= 0xfffb) || (cp >= 0xe000 && cp <= 0xf8ff) ||
        cp >= 0xf0000)
        return 0;
    return 1;
}

/* The path as the denial hint shows it: what is not printable as \xNN (cli.denial_hints). */
static void escape_path(struct buf *b, const char *text, size_t len)
{
    const unsigned char *s = (const unsigned char *)text;
    for (size_t i = 0; i < len;) {
        size_t used;
        uint32_t cp = utf8_next(s + i, len - i, &used);
        if (printable(cp)) {
            if (cp == 0xfffd && !(used == 3 && s[i] == 0xef))
                buf_str(b, "\xef\xbf\xbd");
            else
                buf_add(b, s + i, used);
        } else {
            buf_fmt(b, "\\x%02x", cp);
        }
        i += used;
    }
}

/* repr() of a float, as json.dumps writes it. */
static void py_float(struct buf *b, double x)
{
    char text[48];
    int p;
    for (p = 1; p <= 17; p++) {
        snprintf(text, sizeof text, "%.*e", p - 1, x);
        if (strtod(text, NULL) == x)
            break;
    }
    char *e = strchr(text, 'e');
    if (!e) {
        buf_str(b, text);
        return;
    }
    int exp = atoi(e + 1);
    char digits[24];
    int nd = 0;
    const char *c = text;
    if (*c == '-') {
        buf_add(b, "-", 1);
        c++;
    }
    for (; c < e; c++)
        if (*c >= '0' && *c <= '9' && nd < 23)
            digits[nd++] = *c;
    while (nd > 1 && digits[nd - 1] == '0')
        nd--;
    if (exp >= -4 && exp < 16) {
        if (exp >= 0) {
            for (int i = 0; i <= exp; i++)
                buf_add(b, i < nd ? &digits[i] : "0", 1);
            buf_add(b, ".", 1);
            if (nd > exp + 1)
                buf_add(b, digits + exp + 1, (size_t)(nd - exp - 1));
            else
                buf_add(b, "0", 1);
        } else {
            buf_str(b, "0.");
            for (int i = 0; i < -exp - 1; i++)
                buf_add(b, "0", 1);
            buf_add(b, digits, (size_t)nd);
        }
    } else {
        buf_add(b, digits, 1);
        if (nd > 1) {
            buf_add(b, ".", 1);
            buf_add(b, digits + 1, (size_t)(nd - 1));
        }
        buf_fmt(b, "e%c%02d", exp < 0 ? '-' : '+', exp < 0 ? -exp : exp);
    }
}

/* Replace each "@X@" marker of a template. */
static void fill(struct buf *b, const char *template, const char *marker, const char *value, size_t value_len,
                 const char *marker2, const char *value2)
{
    const char *p = template;
    while (*p) {
        const char *m1 = strstr(p, marker);
        const char *m2 = marker2 ? strstr(p, marker2) : NULL;
        const char *m = m1 && (!m2 || m1 < m2) ? m1 : m2;
        if (!m) {
            buf_str(b, p);
            break;
        }
        buf_add(b, p, (size_t)(m - p));
        if (m == m1) {
            buf_add(b, value, value_len);
            p = m + strlen(marker);
        } else {
            buf_str(b, value2);
            p = m + strlen(marker2);
        }
    }
}

/* The report target: the directory opened before the run, the file written beside it and renamed
 * over the name (report.ReportTarget); any doubt at opening hands over to Python's message. */
struct report_target {
    int dir_fd;
    char name[NAME_MAX + 1];
    const char *path;
};

static int report_open(struct report_target *t, const char *path, const char *cwd)
{
    char absolute[PATH_MAX * 2 + 2];
    normpath(cwd, path, absolute, sizeof absolute);
    char *slash = strrchr(absolute, '/');
    if (!slash || !slash[1] || strlen(slash + 1) > NAME_MAX)
        return 0;
    snprintf(t->name, sizeof t->name, "%s", slash + 1);
    if (slash == absolute)
        slash[1] = '\0';
    else
        *slash = '\0';
    t->path = path;
    t->dir_fd = open(absolute, O_RDONLY | O_DIRECTORY | O_CLOEXEC);
    if (t->dir_fd < 0)
        return 0;
    struct stat st;
    if (fstatat(t->dir_fd, t->name, &st, AT_SYMLINK_NOFOLLOW) == 0) {
        if (!S_ISREG(st.st_mode)) {
            close(t->dir_fd);
            return 0;
        }
    } else if (errno != ENOENT) {
        close(t->dir_fd);
        return 0;
    }
    return 1;
}

static int report_write(struct report_target *t, const struct buf *data)
{
    char temporary[NAME_MAX + 64];
    int fd = -1, err = 0;
    for (int attempt = 0; attempt < 100; attempt++) {
        snprintf(temporary, sizeof temporary, ".%s.%d.%d.tmp", t->name, (int)getpid(), attempt);
        fd = openat(t->dir_fd, temporary, O_WRONLY | O_CREAT | O_EXCL | O_NOFOLLOW | O_CLOEXEC, 0644);
        if (fd >= 0 || errno != EEXIST)
            break;
    }
    if (fd < 0) {
        err = errno;
        if (err == EEXIST)
            fprintf(stderr, "isolate-run: --report %s: cannot create a temporary file beside it\n", t->path);
        else
            fprintf(stderr, "isolate-run: --report %s: cannot write it: %s\n", t->path, strerror(err));
        return 0;
    }
    size_t done = 0;
    while (done < data->len) {
        ssize_t n = write(fd, data->data + done, data->len - done);
        if (n < 0 && errno == EINTR)
            continue;
        if (n < 0) {
            err = errno;
            break;
        }
        done += (size_t)n;
    }
    if (close(fd) < 0 && !err)
        err = errno;
    if (!err && renameat(t->dir_fd, temporary, t->dir_fd, t->name) < 0)
        err = errno;
    if (err) {
        unlinkat(t->dir_fd, temporary, 0);
        fprintf(stderr, "isolate-run: --report %s: cannot write it: %s\n", t->path, strerror(err));
        return 0;
    }
    return 1;
}

/* ------------------------------------------------------------ signals */

static int sig_pipe[2] = {-1, -1};

static void on_signal(int sig)
{
    int saved = errno;
    unsigned char c = (unsigned char)sig;
    ssize_t ignored = write(sig_pipe[1], &c, 1);
    (void)ignored; /* a full pipe already holds enough to wake the loop */
    errno = saved;
}

static const int FORWARDED[] = {SIGINT, SIGTERM, SIGHUP, SIGQUIT, SIGUSR1, SIGUSR2};

/* ------------------------------------------------------------- main */

int main(int argc, char **argv)
{
    g_argv = argv;
    /* As the Python CLI: a closed stderr is an error to survive, not a death (the sandbox's
     * processes get default dispositions back: iso_signals_reset). */
    if (signal(SIGPIPE, SIG_IGN) == SIG_ERR)
        return 125;
    g_replay = getenv(ENV_REPLAY) != NULL;
    g_trace = getenv(ENV_TRACE) != NULL;
    /* The markers are between this program and the Python side: never a key, never passed on. */
    unsetenv(ENV_REPLAY);
    unsetenv(ENV_NO_CACHE);
    unsetenv(ENV_BINARY);
    unsetenv(ENV_TRACE);
    if (argc < 2)
        handover(0, "no arguments");

    struct args a;
    if (!split_args(argc, argv, &a))
        handover(0, "an option or form this program leaves to isolate.cli");
    char cwd[PATH_MAX];
    if (!getcwd(cwd, sizeof cwd))
        handover(0, "no working directory");
    struct buf key = {0};
    if (!build_key(&key, cwd, &a))
        handover(0, "an environment isolate.cli would read otherwise");
    char dir[PATH_MAX];
    if (!cache_dir(dir, sizeof dir))
        handover(0, "no private cache directory");
    unsigned char digest[32];
    sha256((const unsigned char *)key.data, key.len, digest);
    size_t plan_len = 0;
    unsigned char *plan_data = load_plan(dir, digest, &plan_len);
    if (!plan_data)
        handover(0, "no plan for these options here");
    struct reader r = {plan_data, plan_data + plan_len, 0};
    struct replay rp;
    memset(&rp, 0, sizeof rp);
    if (!parse_plan(&r, digest, &rp))
        handover(0, "the plan's premises changed");

    /* The command: one that cli's check would refuse (found on the host outside the grants) is Python's
     * to explain. */
    const char *program = argv[a.command];
    char found[PATH_MAX * 2 + 2], inside[PATH_MAX * 2 + 2];
    if (strchr(program, '/')) {
        normpath(cwd, program, found, sizeof found);
        struct stat st;
        if (stat(found, &st) == 0 && !is_inside(found, rp.granted, rp.n_granted)) {
            char *real = realpath(found, NULL);
            int ok = real && is_inside(real, rp.granted, rp.n_granted);
            free(real);
            if (!ok)
                handover(0, "the command is outside the grants (isolate.cli explains)");
        }
    } else {
        const char *host_path = getenv("PATH");
        int has_inside = which(program, rp.plan.search_path, inside, sizeof inside);
        if (which(program, host_path ? host_path : DEFAULT_PATH, found, sizeof found) &&
            (!has_inside || strcmp(found, inside) != 0)) {
            char normal[PATH_MAX * 2 + 2];
            normpath("/", found, normal, sizeof normal);
            if (!is_inside(normal, rp.granted, rp.n_granted))
                handover(0, "the command is outside the grants (isolate.cli explains)");
        }
    }

    /* The descriptors first, at their numbers; then the report's directory (a free number: no clash). */
    if (!place_fds(&rp))
        handover(0, "a granted path is not the inode the plan holds");
    struct report_target target = {.dir_fd = -1};
    if (a.report && !report_open(&target, a.report, cwd))
        handover(0, "--report needs isolate.cli's check");

    /* A root caller's writable trees: idmapped now (attaching one consumes it). */
    int userns_fd = -1;
    int *tree_fds = calloc(rp.n_idmap ? rp.n_idmap : 1, sizeof *tree_fds);
    if (!tree_fds)
        handover(1, "out of memory");
    if (rp.n_idmap) {
        userns_fd = iso_make_idmap_userns(rp.program_uid, rp.program_gid);
        if (userns_fd < 0)
            handover(1, "no idmapped user namespace");
        for (uint32_t i = 0; i < rp.n_idmap; i++) {
            struct iso_mount *m = &rp.mounts[rp.idmap[i]];
            tree_fds[i] = iso_open_idmapped_tree(m->source, userns_fd);
            if (tree_fds[i] < 0)
                handover(1, "an idmapped tree cannot be opened");
            m->fd = tree_fds[i];
        }
    }

    int status_pipe[2];
    if (pipe2(status_pipe, O_CLOEXEC) < 0 || pipe2(sig_pipe, O_CLOEXEC | O_NONBLOCK) < 0)
        handover(1, "no pipe");
    struct iso_plan *plan = &rp.plan;
    for (int i = 0; i < 8; i++)
        plan->cgroup_procs_fds[i] = -1;
    plan->idmap_userns_fd = -1;
    plan->program_fd = -1;
    plan->egress_fd = -1; /* egress by name is never replayed: its mediator is Python's */
    plan->stdio[0] = plan->stdio[1] = plan->stdio[2] = -1;
    static const int32_t no_fds[1] = {-1};
    plan->keep_fds = no_fds;
    plan->n_keep_fds = 0;
    plan->file = program;
    plan->argv = &argv[a.command];
    plan->status_fd = status_pipe[1];

    /* The handlers before the spawn: a signal that comes as soon as the program runs is forwarded,
     * not the death of this process. (iso_spawn blocks every signal around clone, and the sandbox's
     * processes reset every disposition: no handler of this process ever runs in them.) */
    struct sigaction action;
    memset(&action, 0, sizeof action);
    action.sa_handler = on_signal;
    sigemptyset(&action.sa_mask);
    for (size_t i = 0; i < sizeof FORWARDED / sizeof FORWARDED[0]; i++)
        if (sigaction(FORWARDED[i], &action, NULL) < 0)
            handover(1, "signal handlers");

    struct iso_failure failure;
    int64_t started = now_ns();
    if (g_trace)
        fprintf(stderr, "isolate-run: trace: replaying the cached plan\n");
    int pid = iso_spawn(plan, &failure);
    close(status_pipe[1]);
    for (uint32_t i = 0; i < rp.n_idmap; i++)
        close(tree_fds[i]);
    if (userns_fd >= 0)
        close(userns_fd);
    if (pid < 0) {
        /* Nothing ran: Python prepares it again and names the cause exactly (isolate.cli's messages). */
        close(status_pipe[0]);
        if (target.dir_fd >= 0)
            close(target.dir_fd);
        handover(1, "the setup failed before the program ran (isolate.cli names the cause)");
    }
    for (uint32_t i = 0; i < rp.n_warnings; i++)
        fprintf(stderr, "%s\n", rp.warnings[i]);


    /* Wait for the init's report, forwarding signals; after SIGTERM/SIGHUP a grace period, then SIGKILL. */
    int64_t kill_at = 0;
    struct pollfd fds[2] = {{.fd = status_pipe[0], .events = POLLIN}, {.fd = sig_pipe[0], .events = POLLIN}};
    for (;;) {
        int timeout = -1;
        if (kill_at) {
            int64_t left = (kill_at - now_ns()) / 1000000;
            timeout = left < 0 ? 0 : (int)left + 1;
        }
        int ready = poll(fds, 2, timeout);
        if (ready < 0 && errno != EINTR) {
            fprintf(stderr, "isolate-run: waiting for the sandbox failed: %s\n", strerror(errno));
            kill(pid, SIGKILL);
            break;
        }
        unsigned char sigs[64];
        ssize_t n;
        while ((n = read(sig_pipe[0], sigs, sizeof sigs)) > 0) {
            for (ssize_t i = 0; i < n; i++) {
                kill(pid, sigs[i]); /* ESRCH: it is ending anyway */
                if ((sigs[i] == SIGTERM || sigs[i] == SIGHUP) && !kill_at)
                    kill_at = now_ns() + (int64_t)TERM_GRACE_MS * 1000000;
            }
        }
        if (kill_at && now_ns() >= kill_at) {
            kill(pid, SIGKILL);
            kill_at = 0;
        }
        if (ready > 0 && (fds[0].revents & (POLLIN | POLLHUP | POLLERR)))
            break;
    }
    struct iso_status status;
    size_t got = 0;
    while (got < sizeof status) {
        ssize_t n = read(status_pipe[0], (char *)&status + got, sizeof status - got);
        if (n < 0 && errno == EINTR)
            continue;
        if (n <= 0)
            break;
        got += (size_t)n;
    }
    close(status_pipe[0]);
    int have_status = got == sizeof status && status.magic == ISO_STATUS_MAGIC;
    int64_t ended = now_ns();
    int wait_status = 0, timed_out = 0;
    int64_t user_us = 0, system_us = 0, rss = 0;
    if (have_status) {
        wait_status = status.wait_status;
        timed_out = status.reason == ISO_REASON_TIMEOUT;
        user_us = status.user_usec;
        system_us = status.system_usec;
        rss = status.maxrss_kib * 1024;
    } else {
        /* No report: the init itself was killed; its own status and usage stand in. */
        struct rusage usage;
        memset(&usage, 0, sizeof usage);
        pid_t w;
        do {
            w = wait4(pid, &wait_status, 0, &usage);
        } while (w < 0 && errno == EINTR);
        if (w < 0)
            wait_status = 0;
        ended = now_ns();
        user_us = (int64_t)usage.ru_utime.tv_sec * 1000000 + usage.ru_utime.tv_usec;
        system_us = (int64_t)usage.ru_stime.tv_sec * 1000000 + usage.ru_stime.tv_usec;
        rss = (int64_t)usage.ru_maxrss * 1024;
    }
    int returncode;
    if (WIFSIGNALED(wait_status))
        returncode = -WTERMSIG(wait_status);
    else if (WIFEXITED(wait_status))
        returncode = WEXITSTATUS(wait_status);
    else
        returncode = 0;

    /* report.status_for */
    const char *state;
    if (returncode >= 0)
        state = returncode == 0 ? "ok" : "exited";
    else if (-returncode == SIGXCPU)
        state = "cpu";
    else if (-returncode == SIGXFSZ)
        state = "file-size";
    else
        state = "signaled";
    if (timed_out)
        state = "timeout";

    /* The denials, as the report lists them. */
    struct buf denied = {0};
    struct buf hints = {0};
    int hinted_net = 0, hinted_unix = 0;
    int n_entries = 0;
    if (have_status) {
        for (uint32_t i = 0; i < status.n_denied && i < 64; i++) {
            const char *name = NULL;
            char fallback[32];
            for (uint32_t k = 0; k < rp.n_names; k++)
                if (rp.name_nrs[k] == status.denied[i].nr)
                    name = rp.names[k];
            if (!name) {
                snprintf(fallback, sizeof fallback, "syscall_%d", status.denied[i].nr);
                name = fallback;
            }
            buf_str(&denied, n_entries++ ? ",\n    {\n" : "[\n    {\n");
            buf_str(&denied, "      \"mechanism\": \"seccomp\",\n      \"syscall\": ");
            json_string(&denied, name, strlen(name));
            buf_fmt(&denied, ",\n      \"nr\": %d,\n      \"count\": %u\n    }", status.denied[i].nr,
                    status.denied[i].count);
        }
        uint32_t n_net = status.n_net_denied < 16 ? status.n_net_denied : 16;
        for (uint32_t i = 0; i < n_net; i++) {
            const struct iso_net_denial *d = &status.net_denied[i];
            if (d->kind == ISO_NET_DENIAL_UNIX) {
                size_t len = strnlen(d->path, sizeof d->path);
                buf_str(&denied, n_entries++ ? ",\n    {\n" : "[\n    {\n");
                buf_str(&denied, "      \"mechanism\": \"unix-socket\",\n      \"path\": ");
                json_string(&denied, d->path, len);
                buf_fmt(&denied, ",\n      \"count\": %u\n    }", d->count);
                if (!hinted_unix && rp.hint_unix) {
                    struct buf shown = {0};
                    escape_path(&shown, d->path, len);
                    fill(&hints, rp.hint_unix, "@S@", shown.data ? shown.data : "", shown.len, NULL, NULL);
                    buf_add(&hints, "\n", 1);
                    free(shown.data);
                    hinted_unix = 1;
                }
            } else if (d->kind == ISO_NET_DENIAL_INET) {
                char address[INET6_ADDRSTRLEN + 2], where[INET6_ADDRSTRLEN + 4], port[16];
                if (!inet_ntop(d->family == AF_INET ? AF_INET : AF_INET6, d->address, address, sizeof address))
                    snprintf(address, sizeof address, "?");
                buf_str(&denied, n_entries++ ? ",\n    {\n" : "[\n    {\n");
                buf_fmt(&denied, "      \"mechanism\": \"network\",\n      \"address\": \"%s\",\n      \"port\": %d,\n"
                        "      \"count\": %u\n    }", address, d->port, d->count);
                if (!hinted_net && rp.hint_net) {
                    snprintf(where, sizeof where, strchr(address, ':') ? "[%s]" : "%s", address);
                    snprintf(port, sizeof port, "%d", d->port);
                    fill(&hints, rp.hint_net, "@H@", where, strlen(where), "@P@", port);
                    buf_add(&hints, "\n", 1);
                    hinted_net = 1;
                }
            } else if (d->kind == ISO_NET_DENIAL_DGRAM) {
                buf_str(&denied, n_entries++ ? ",\n    {\n" : "[\n    {\n");
                /* popen.net_denials' entry */
                buf_fmt(&denied, "      \"mechanism\": \"unix-socket\",\n      \"syscall\": \"socket\",\n"
                        "      \"type\": \"datagram\",\n      \"reason\": \"AF_UNIX datagram sockets name their peer on "
                        "each send\",\n      \"count\": %u\n    }", d->count);
                if (!hinted_unix && rp.hint_dgram) {
                    buf_str(&hints, rp.hint_dgram);
                    buf_add(&hints, "\n", 1);
                    hinted_unix = 1;
                }
            }
        }
        if (status.net_denied_dropped) {
            buf_str(&denied, n_entries++ ? ",\n    {\n" : "[\n    {\n");
            buf_fmt(&denied, "      \"mechanism\": \"network\",\n      \"more\": %u\n    }", status.net_denied_dropped);
        }
    }
    if (n_entries)
        buf_str(&denied, "\n  ]");
    else
        buf_str(&denied, "[]");

    /* cli._say_limit, then the denial hints of a failed run. */
    const char *limit = NULL;
    if (strcmp(state, "timeout") == 0)
        limit = rp.msg_timeout;
    else if (strcmp(state, "cpu") == 0)
        limit = rp.msg_cpu;
    else if (strcmp(state, "file-size") == 0)
        limit = rp.msg_fsize;
    if (limit)
        fprintf(stderr, "%s\n", limit);
    if (returncode != 0 && hints.len)
        fputs(hints.data, stderr);

    int exit_status = returncode < 0 ? 128 - returncode : returncode;
    if (target.dir_fd >= 0) {
        struct buf out = {0};
        buf_fmt(&out, "{\n  \"status\": \"%s\",\n  \"exit_code\": ", state);
        if (returncode >= 0)
            buf_fmt(&out, "%d", returncode);
        else
            buf_str(&out, "null");
        buf_str(&out, ",\n  \"signal\": ");
        if (returncode < 0)
            buf_fmt(&out, "%d", -returncode);
        else
            buf_str(&out, "null");
        double wall = (double)((ended - started + 500) / 1000) / 1e6;
        buf_str(&out, ",\n  \"wall_seconds\": ");
        py_float(&out, wall);
        buf_str(&out, ",\n  \"cpu_seconds\": ");
        py_float(&out, (double)(user_us + system_us) / 1e6);
        buf_str(&out, ",\n  \"user_seconds\": ");
        py_float(&out, (double)user_us / 1e6);
        buf_str(&out, ",\n  \"system_seconds\": ");
        py_float(&out, (double)system_us / 1e6);
        buf_fmt(&out, ",\n  \"max_rss_bytes\": %lld,\n  \"oom_kills\": 0,\n", (long long)rss);
        buf_str(&out, rp.report_mid);
        buf_add(&out, denied.data, denied.len);
        buf_str(&out, rp.report_tail);
        if (!report_write(&target, &out))
            exit_status = 125;
        close(target.dir_fd);
    }
    fflush(stderr);
    return exit_status;
}
