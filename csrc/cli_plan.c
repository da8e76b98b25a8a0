/*
 * cli_plan.c - reading a cached plan file and checking every premise it rests on before a replay.
 */
#define _GNU_SOURCE
#include "cli.h"

/* --------------------------------------------------------- the plan reader */

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

uint32_t r_u32(struct reader *r)
{
    uint32_t v = 0;
    const void *at = take(r, 4);
    if (at)
        memcpy(&v, at, 4);
    return v;
}

int32_t r_i32(struct reader *r) { return (int32_t)r_u32(r); }

uint64_t r_u64(struct reader *r)
{
    uint64_t v = 0;
    const void *at = take(r, 8);
    if (at)
        memcpy(&v, at, 8);
    return v;
}

int64_t r_i64(struct reader *r) { return (int64_t)r_u64(r); }

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
uint32_t r_count(struct reader *r, size_t min_size)
{
    uint32_t n = r_u32(r);
    if ((size_t)(r->end - r->p) / min_size < n)
        r->bad = 1;
    return r->bad ? 0 : n;
}


/* ------------------------------------------------------------ the replay */

static int same_time(const struct stat *st, int64_t mtime_ns)
{
    return (int64_t)st->st_mtim.tv_sec * 1000000000 + st->st_mtim.tv_nsec == mtime_ns;
}

/* Parse the plan and check every premise it records; 0: stale, foreign or malformed. */
int parse_plan(struct reader *r, const unsigned char digest[32], struct replay *rp)
{
    const char *magic = take(r, 8);
    if (!magic || memcmp(magic, MAGIC, 8) != 0)
        return miss("stale or malformed plan", "check at cli.c:575");
    uint32_t len;
    const char *stored = r_data(r, &len);
    if (!stored || len != 32 || memcmp(stored, digest, 32) != 0)
        return miss("stale or malformed plan", "check at cli.c:579");

    /* This program, and the package's files that made the plan (and their directories). */
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
    rp->layers_idmap = r_u32(r);
    rp->layers_uid_map = r_data(r, NULL);
    rp->layers_gid_map = r_data(r, NULL);
    if (rp->layers_idmap != UINT32_MAX &&
        (rp->layers_idmap >= (uint32_t)p->n_mounts || rp->mounts[rp->layers_idmap].kind != ISO_MOUNT_BIND ||
         rp->mounts[rp->layers_idmap].fd < 0 || !rp->layers_uid_map || !rp->layers_gid_map))
        return miss("stale or malformed plan", "check of the image layers' idmap");

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
    rp->lease_store = r_data(r, NULL);
    rp->lease_body = r_data(r, NULL);
    if (!rp->lease_store != !rp->lease_body)
        return miss("stale or malformed plan", "check at cli.c:797");
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
int place_fds(struct replay *rp)
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
