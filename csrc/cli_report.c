/*
 * cli_report.c - the JSON report, as isolate/model/report.py writes it, and where it goes (report.ReportTarget).
 */
#define _GNU_SOURCE
#include "cli.h"

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
void json_string(struct buf *b, const char *text, size_t len)
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
void escape_path(struct buf *b, const char *text, size_t len)
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
void py_float(struct buf *b, double x)
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
void fill(struct buf *b, const char *template, const char *marker, const char *value, size_t value_len,
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

int report_open(struct report_target *t, const char *path, const char *cwd)
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

int report_write(struct report_target *t, const struct buf *data)
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
