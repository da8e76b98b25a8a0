/*
 * cli.h - the native isolate-run's own parts (not the cffi surface: that is isolate.h).
 *
 * cli.c: the options, the key, the cache, handing over to Python, signals and main;
 * cli_util.c: the trace (miss), growing buffers, paths, SHA-256, files; cli_plan.c: reading a plan
 * file and checking its premises (the replay); cli_report.c: the JSON report and
 * where it is written.
 *
 * The calls go one way: cli.c calls the other three, cli_plan.c and cli_report.c
 * call only cli_util.c, and cli_util.c calls none of them (tests/test_csrc_layers.py
 * fails on a file that calls back into one that calls it).
 */
#ifndef ISOLATE_CLI_H
#define ISOLATE_CLI_H

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
#include <sys/file.h>
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
#define MAGIC "ISOPLAN3"
#define KEY_PREFIX "isolate-run plan v2"
#define DEFAULT_PATH "/usr/local/bin:/usr/bin:/bin"
#define MAX_PLAN_BYTES (16 << 20)
#define TERM_GRACE_MS 2000
#define NULL_LEN 0xFFFFFFFFu

extern char **environ;

struct buf {
    char *data;
    size_t len, cap;
};

struct reader {
    const unsigned char *p, *end;
    int bad;
};

struct args {
    int command;            /* index of the command's first argument */
    const char *report;     /* --report's value, or NULL */
    struct buf key_args;    /* the option arguments, --report aside, each NUL-terminated */
};

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
    /* An image User's layers: the bind at this index becomes an idmapped tree of these maps (none: UINT32_MAX). */
    uint32_t layers_idmap;
    const char *layers_uid_map, *layers_gid_map;
    /* the report */
    const char *report_mid, *report_tail;
    char **warnings;
    uint32_t n_warnings;
    const char *msg_timeout, *msg_cpu, *msg_fsize;
    const char *hint_net, *hint_unix, *hint_dgram;
    int32_t *name_nrs;
    const char **names;
    uint32_t n_names;
    /* An image's sandbox: the store holding its layers and the lease's lines, the layer directories
     * (isolate/image/leases.py); NULL for a sandbox of the host's root. */
    const char *lease_store, *lease_body;
};

/* The report target: the directory opened before the run, the file written beside it and renamed
 * over the name (report.ReportTarget); any doubt at opening hands over to Python's message. */
struct report_target {
    int dir_fd;
    char name[NAME_MAX + 1];
    const char *path;
};

/* cli.c: main, and nothing the other parts may call */

/* cli_util.c: the bottom layer, calling none of the others */
extern int g_trace;  /* set by main from ISOLATE_RUN_TRACE */
int miss(const char *why, const char *what);
void buf_add(struct buf *b, const void *data, size_t len);
void buf_str(struct buf *b, const char *s);
void buf_fmt(struct buf *b, const char *fmt, ...) __attribute__((format(printf, 2, 3)));
int64_t now_ns(void);
void normpath(const char *cwd, const char *path, char *out, size_t size);
int is_inside(const char *path, char **granted, uint32_t n);
int which(const char *program, const char *search_path, char *out, size_t size);
void sha256(const unsigned char *data, size_t len, unsigned char out[32]);
int cmp_strings(const void *a, const void *b);
ssize_t read_file(const char *path, char *out, size_t size, int nofollow);

/* cli_plan.c */
uint32_t r_u32(struct reader *r);
int32_t r_i32(struct reader *r);
uint64_t r_u64(struct reader *r);
int64_t r_i64(struct reader *r);
uint32_t r_count(struct reader *r, size_t min_size);
int parse_plan(struct reader *r, const unsigned char digest[32], struct replay *rp);
int place_fds(struct replay *rp);

/* cli_report.c */
void json_string(struct buf *b, const char *text, size_t len);
void escape_path(struct buf *b, const char *text, size_t len);
void py_float(struct buf *b, double x);
void fill(struct buf *b, const char *template, const char *marker, const char *value, size_t value_len, const char *marker2, const char *value2);
int report_open(struct report_target *t, const char *path, const char *cwd);
int report_write(struct report_target *t, const struct buf *data);

#endif
