/*
 * cli_util.c - the trace, growing buffers, paths, SHA-256 (FIPS 180-4) and small file reads for isolate-run.
 */
#define _GNU_SOURCE
#include "cli.h"

/* ------------------------------------------------------------------ trace */

/* The trace lives here, below both cli.c and cli_plan.c: the plan reader says why it refuses a plan
 * without calling back up into main's file (no file of the CLI calls one that calls it back). */
int g_trace;

/* Why a plan is not replayed (with ISOLATE_RUN_TRACE set); returns 0 for the callers' convenience. */
int miss(const char *why, const char *what)
{
    if (g_trace)
        fprintf(stderr, "isolate-run: trace: not replayed: %s%s%s\n", why, what ? ": " : "", what ? what : "");
    return 0;
}

/* ------------------------------------------------------------ small helpers */

void buf_add(struct buf *b, const void *data, size_t len)
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

void buf_str(struct buf *b, const char *s) { buf_add(b, s, strlen(s)); }

void buf_fmt(struct buf *b, const char *fmt, ...)
{
    char tmp[256];
    va_list ap;
    va_start(ap, fmt);
    int n = vsnprintf(tmp, sizeof tmp, fmt, ap);
    va_end(ap);
    if (n > 0)
        buf_add(b, tmp, (size_t)n < sizeof tmp ? (size_t)n : sizeof tmp - 1);
}

int64_t now_ns(void)
{
    struct timespec ts;
    clock_gettime(CLOCK_MONOTONIC, &ts);
    return (int64_t)ts.tv_sec * 1000000000 + ts.tv_nsec;
}

/* posixpath.normpath of an absolute path (or of cwd joined with a relative one). */
void normpath(const char *cwd, const char *path, char *out, size_t size)
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

int is_inside(const char *path, char **granted, uint32_t n)
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
int which(const char *program, const char *search_path, char *out, size_t size)
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

void sha256(const unsigned char *data, size_t len, unsigned char out[32])
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

int cmp_strings(const void *a, const void *b)
{
    return strcmp(*(char *const *)a, *(char *const *)b);
}

/* Read a whole small file; -1 when it cannot be read. */
ssize_t read_file(const char *path, char *out, size_t size, int nofollow)
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
