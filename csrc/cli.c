/*
 * cli.c - the native `isolate-run`: replay a plan the Python side compiled.
 *
 * Python stays the one place where a policy means something: it parses the
 * options, resolves and checks paths, compiles seccomp and builds the
 * struct iso_plan (isolate/cli/plan.py).  It writes that plan, with every
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
 * isolate.cli.plan.handover_main, which either writes the plan and execs this
 * program back (ISOLATE_RUN_REPLAY=1) or runs the command itself
 * (ISOLATE_RUN_NO_CACHE=1, so that the two never loop).
 */
#define _GNU_SOURCE
#include "cli.h"

/* Static, as everything of this file but main: the other parts of the CLI are below it and never
 * call back up (a refusal deep in the plan reader returns 0 and main hands over). */
static char **g_argv;
static int g_replay;   /* exec'd back by the Python side after it wrote the plan */

/* ------------------------------------------------------------ signals */

/* From the first instruction of main to the end of the run, the signals a caller sends to stop a run (or for
 * the program) are caught into this pipe: before the program runs, any of them ends the run unstarted
 * (stop_if_signalled, exit 128+N); once it runs, the wait loop forwards them.  Before, they were caught only
 * from just before the spawn: one that came earlier killed this process in the middle of its start-up (an
 * idmapped user namespace's helper process was left behind), and one that came between the handlers and a
 * handover to the Python side was dropped with the pipe, and the Python side started the program anyway. */
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
static const char *const FORWARDED_NAMES[] = {"SIGINT", "SIGTERM", "SIGHUP", "SIGQUIT", "SIGUSR1", "SIGUSR2"};

static void forwarded_set(sigset_t *set)
{
    sigemptyset(set);
    for (size_t i = 0; i < sizeof FORWARDED / sizeof FORWARDED[0]; i++)
        sigaddset(set, FORWARDED[i]);
}

/* The handlers, then the signals unblocked: the Python side blocks them before it execs this program back
 * (isolate/cli/startup.py), so one sent meanwhile is pending here and comes now.  A signal ignored when this
 * program started stays ignored, as shells and nohup expect (exec keeps SIG_IGN): never caught, never
 * forwarded, never the end of a start, and the program starts with it ignored (plan->keep_ignored); one
 * pending is dropped as it is unblocked.  0: done. */
static int catch_signals(void)
{
    if (pipe2(sig_pipe, O_CLOEXEC | O_NONBLOCK) < 0)
        return -1;
    struct sigaction action, old;
    memset(&action, 0, sizeof action);
    action.sa_handler = on_signal;
    sigemptyset(&action.sa_mask);
    for (size_t i = 0; i < sizeof FORWARDED / sizeof FORWARDED[0]; i++) {
        if (sigaction(FORWARDED[i], NULL, &old) < 0)
            return -1;
        if (old.sa_handler != SIG_IGN && sigaction(FORWARDED[i], &action, NULL) < 0)
            return -1;
    }
    sigset_t set;
    forwarded_set(&set);
    return sigprocmask(SIG_UNBLOCK, &set, NULL);
}

/* The pipe above every descriptor the plan puts at its own number (place_fds would take its numbers over).
 * 0: done. */
static int lift_sig_pipe(const struct replay *rp)
{
    int above = 3;
    for (uint32_t i = 0; i < rp->n_fds; i++)
        if (rp->fds[i].fd >= above)
            above = rp->fds[i].fd + 1;
    for (int k = 0; k < 2; k++) {
        if (sig_pipe[k] >= above)
            continue;
        int lifted = fcntl(sig_pipe[k], F_DUPFD_CLOEXEC, above);
        if (lifted < 0)
            return -1;
        int old = sig_pipe[k];
        sig_pipe[k] = lifted; /* a handler running meanwhile writes to the same pipe through either */
        close(old);
    }
    return 0;
}

/* A signal came before the program ran: the run ends here, unstarted, as the program's death of it would
 * have ended it (128+N). */
static void stop_if_signalled(void)
{
    unsigned char sig = 0;
    if (sig_pipe[0] < 0 || read(sig_pipe[0], &sig, 1) != 1)
        return;
    const char *name = "a signal";
    for (size_t i = 0; i < sizeof FORWARDED / sizeof FORWARDED[0]; i++)
        if (FORWARDED[i] == sig)
            name = FORWARDED_NAMES[i];
    fprintf(stderr, "isolate-run: %s before the program started: nothing was run\n", name);
    fflush(stderr);
    _exit(128 + sig);
}

/* ---------------------------------------------------------------- handover */

static const char BOOT[] =
    "import signal, sys\n"
    "if sys.path and sys.path[0] == '': del sys.path[0]\n" /* never import from the working directory */
    /* The signals this program blocked before the exec: recorded from the first line, unblocked, and looked
     * at before the run starts (isolate/cli/startup.py). */
    "early = []\n"
    "for name in ('SIGINT', 'SIGTERM', 'SIGHUP', 'SIGQUIT', 'SIGUSR1', 'SIGUSR2'):\n"
    "    if signal.getsignal(getattr(signal, name)) != signal.SIG_IGN:\n" /* ignored at the start: it stays so */
    "        signal.signal(getattr(signal, name), lambda number, _frame: early.append(number))\n"
    "signal.pthread_sigmask(signal.SIG_UNBLOCK, [signal.SIGINT, signal.SIGTERM, signal.SIGHUP, signal.SIGQUIT,"
    " signal.SIGUSR1, signal.SIGUSR2])\n"
    "from isolate.cli.plan import handover_main\n"
    "sys.exit(handover_main(early))\n";

/* Run the Python CLI in this process's place.  no_cache: it must run the
 * command itself (this program could not replay what it planned, or a setup
 * failed before the program ran, and Python says exactly why). */
static void __attribute__((noreturn)) handover(int no_cache, const char *why)
{
    stop_if_signalled();
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
    /* From here to the Python side's own handlers, a signal waits (blocked, pending across exec): never
     * the interpreter's death in the middle of its start-up, nor a KeyboardInterrupt's traceback. */
    sigset_t set;
    forwarded_set(&set);
    if (sigprocmask(SIG_BLOCK, &set, NULL) < 0) {
        fprintf(stderr, "isolate-run: cannot hand over to the Python side: %s\n", strerror(errno));
        _exit(125);
    }
    stop_if_signalled(); /* one that came just before the block */
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

/* ------------------------------------------------------ options and the key */

static const char *const VALUE_OPTIONS[] = {
    "--ro", "--rw", "--bind", "--ro-bind", "--tmpfs", "--chdir", "--home", "--home-file", "--net", "--unix-socket",
    "--memory", "--cpu", "--cpus", "--wall", "--pids", "--nofile", "--fsize", "--tmpfs-size", "--seccomp", "--env",
    "--keep-env", "--backend", "--image", "--image-store", "--profile", "--uid", "--gid", "--report", NULL};
static const char *const FLAG_OPTIONS[] = {"--no-defaults", "--no-namespaces", "--best-effort", NULL};

static int in_table(const char *const *table, const char *name, size_t len)
{
    for (int i = 0; table[i]; i++)
        if (strlen(table[i]) == len && strncmp(table[i], name, len) == 0)
            return 1;
    return 0;
}

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
        if (value[0] == '\0')
            return 0; /* an empty value: isolate.cli refuses it (a plan cached before that must not run it) */
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

/* places.py's stand-in for a /tmp/isolate-UID another user took: the state directory's link "runtime-dir",
 * when it names TAKEN.SUFFIX, a private directory of the caller's (only the caller can have made one).  The
 * state directory as places.state_dir finds it; where this program cannot tell (a relative path), none: the
 * Python side then runs.  1: found, in out. */
static int stand_in(const char *taken, char *out, size_t size)
{
    const char *explicit = getenv("ISOLATE_STATE_DIR"), *xdg = getenv("XDG_STATE_HOME"), *home = getenv("HOME");
    char link[PATH_MAX];
    int n = -1;
    if (explicit && explicit[0])
        n = explicit[0] == '/' ? snprintf(link, sizeof link, "%s/runtime-dir", explicit) : -1;
    else if (xdg && xdg[0] == '/')
        n = snprintf(link, sizeof link, "%s/isolate/runtime-dir", xdg);
    else if (home && home[0] == '/')
        n = snprintf(link, sizeof link, "%s/.local/state/isolate/runtime-dir", home);
    if (n <= 0 || (size_t)n >= sizeof link)
        return 0;
    ssize_t len = readlink(link, out, size - 1);
    if (len <= 0)
        return 0;
    out[len] = '\0';
    size_t at = strlen(taken);
    if ((size_t)len <= at + 1 || strncmp(out, taken, at) != 0 || out[at] != '.')
        return 0;
    for (const char *c = out + at + 1; *c; c++)
        if (!((*c >= 'a' && *c <= 'z') || (*c >= 'A' && *c <= 'Z') || (*c >= '0' && *c <= '9') || *c == '_'))
            return 0;
    return private_dir(out);
}

static int cache_dir(char *out, size_t size)
{
    uid_t uid = geteuid();
    struct stat st;
    char runtime[PATH_MAX];
    const char *xdg = getenv("XDG_RUNTIME_DIR");
    int in_tmp = 0;
    if (uid == 0 && stat("/run", &st) == 0 && S_ISDIR(st.st_mode))
        snprintf(runtime, sizeof runtime, "/run/isolate");
    else if (xdg && xdg[0] == '/' && strlen(xdg) < PATH_MAX - 16 && private_dir(xdg))
        snprintf(runtime, sizeof runtime, "%s/isolate", xdg);
    else
        in_tmp = snprintf(runtime, sizeof runtime, "/tmp/isolate-%u", (unsigned)uid) > 0;
    /* Every level private to the caller: nobody else can have put a plan there. */
    if (!private_dir(runtime)) {
        char moved[PATH_MAX];
        if (!in_tmp || lstat(runtime, &st) < 0 || st.st_uid == uid || !stand_in(runtime, moved, sizeof moved))
            return 0;
        memcpy(runtime, moved, sizeof runtime);
    }
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

/* ------------------------------------------------------------- main */

/* The store's lock (locks/store) held shared, once every layer directory the lease names (one a line)
 * still holds its index.json; -1 otherwise. */
static int lease_begin(const char *store, const char *body)
{
    char path[PATH_MAX];
    if (snprintf(path, sizeof path, "%s/locks/store", store) >= (int)sizeof path)
        return -1;
    int fd = open(path, O_RDWR | O_CREAT | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0)
        return -1;
    int rc;
    while ((rc = flock(fd, LOCK_SH)) < 0 && errno == EINTR)
        ;
    if (rc < 0) {
        close(fd);
        return -1;
    }
    for (const char *line = body; *line;) {
        const char *end = strchr(line, '\n');
        size_t len = end ? (size_t)(end - line) : strlen(line);
        struct stat st;
        if (len + sizeof "/index.json" > sizeof path ||
            snprintf(path, sizeof path, "%.*s/index.json", (int)len, line) < 0 || lstat(path, &st) < 0 ||
            !S_ISREG(st.st_mode)) {
            close(fd);
            return -1;
        }
        line += len + (end ? 1 : 0);
    }
    return fd;
}

/* The lease of sandbox `pid` (leases/PID-START~NS, START its start time in /proc/PID/stat, NS the inode of
 * this PID namespace), its path in
 * out; 0 with errno set when it cannot be written.  A process already gone needs none (out stays ""). */
static int lease_write(const char *store, const char *body, int pid, char *out, size_t size)
{
    char path[64], data[1024];
    snprintf(path, sizeof path, "/proc/%d/stat", pid);
    int fd = open(path, O_RDONLY | O_CLOEXEC);
    if (fd < 0)
        return 1;
    ssize_t n = read(fd, data, sizeof data - 1);
    close(fd);
    if (n <= 0)
        return 1;
    data[n] = '\0';
    /* Field 22; the name (field 2, in parentheses) may hold anything: count from the last ')'. */
    char *p = strrchr(data, ')');
    for (int field = 2; p && field < 22; field++)
        p = strchr(p + 1, ' ');
    if (!p) {
        errno = EINVAL;
        return 0;
    }
    unsigned long long start = strtoull(p + 1, NULL, 10);
    if (snprintf(out, size, "%s/leases", store) >= (int)size) {
        errno = ENAMETOOLONG;
        return 0;
    }
    if (mkdir(out, 0700) < 0 && errno != EEXIST)
        return 0;
    /* The PID namespace the pid is a number of: a pruner of another one (a container sharing the store) cannot
     * tell whether it runs, so it keeps the lease (isolate/image/leases.py). */
    struct stat ns;
    if (stat("/proc/self/ns/pid", &ns) < 0)
        return 0;
    if (snprintf(out, size, "%s/leases/%d-%llu~%llu", store, pid, start, (unsigned long long)ns.st_ino) >=
        (int)size) {
        errno = ENAMETOOLONG;
        return 0;
    }
    fd = open(out, O_WRONLY | O_CREAT | O_TRUNC | O_NOFOLLOW | O_CLOEXEC, 0600);
    if (fd < 0)
        return 0;
    size_t len = strlen(body), done = 0;
    while (done < len) {
        ssize_t w = write(fd, body + done, len - done);
        if (w < 0 && errno == EINTR)
            continue;
        if (w <= 0) {
            int saved = errno;
            close(fd);
            unlink(out);
            errno = w < 0 ? saved : EIO;
            return 0;
        }
        done += (size_t)w;
    }
    close(fd);
    return 1;
}

int main(int argc, char **argv)
{
    g_argv = argv;
    /* As the Python CLI: a closed stderr is an error to survive, not a death (the sandbox's
     * processes get default dispositions back: iso_signals_reset). */
    if (signal(SIGPIPE, SIG_IGN) == SIG_ERR)
        return 125;
    if (catch_signals() < 0) {
        fprintf(stderr, "isolate-run: cannot catch signals: %s\n", strerror(errno));
        return 125;
    }
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
    if (lift_sig_pipe(&rp) < 0)
        handover(1, "no descriptor for the signal pipe");
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
    /* An image User's layers, through an idmapped tree of isolate's private range (imageroot.idmapped_layers):
     * the store's directory the plan's bind holds (placed and checked above), made now, consumed by the child. */
    int layers_userns = -1, layers_tree = -1;
    if (rp.layers_idmap != UINT32_MAX) {
        struct iso_mount *m = &rp.mounts[rp.layers_idmap];
        char path[64];
        snprintf(path, sizeof path, "/proc/self/fd/%d", m->fd);
        layers_userns = iso_make_userns_maps(rp.layers_uid_map, rp.layers_gid_map);
        if (layers_userns < 0)
            handover(1, "no user namespace of isolate's private id range");
        layers_tree = iso_open_idmapped_tree(path, layers_userns);
        if (layers_tree < 0)
            handover(1, "the image's layers cannot be idmapped");
        m->kind = ISO_MOUNT_MOVE;
        m->fd = layers_tree;
    }

    int status_pipe[2];
    if (pipe2(status_pipe, O_CLOEXEC) < 0)
        handover(1, "no pipe");
    struct iso_plan *plan = &rp.plan;
    for (int i = 0; i < 8; i++)
        plan->cgroup_procs_fds[i] = -1;
    plan->idmap_userns_fd = -1;
    plan->program_fd = -1;
    plan->egress_fd = -1; /* egress by name is never replayed: its mediator is Python's */
    plan->why_stream_fd = -1; /* nor denial tracing: why is never carried */
    plan->stdio[0] = plan->stdio[1] = plan->stdio[2] = -1;
    static const int32_t no_fds[1] = {-1};
    plan->keep_fds = no_fds;
    plan->n_keep_fds = 0;
    plan->file = program;
    plan->argv = &argv[a.command];
    plan->keep_ignored = ISO_IGNORED_KEPT; /* the caller's SIG_IGN, as isolate.run keeps it */
    plan->status_fd = status_pipe[1];

    /* An image's sandbox: the store's lock held shared from the check that its layers are there to its
     * lease written, as isolate/image/leases.py does (prune holds it exclusively). */
    int store_lock = -1;
    if (rp.lease_store) {
        store_lock = lease_begin(rp.lease_store, rp.lease_body);
        if (store_lock < 0)
            handover(1, "a layer of the image is gone, or the store's lock cannot be had (isolate.cli says)");
    }

    struct iso_failure failure;
    int64_t started = now_ns();
    if (g_trace)
        fprintf(stderr, "isolate-run: trace: replaying the cached plan\n");
    /* The last look before the start: one that comes during the spawn (iso_spawn blocks every signal around
     * clone, and the sandbox's processes reset every disposition: no handler of this process ever runs in
     * them) is pending in the init, which forwards it to the program. */
    stop_if_signalled();
    int pid = iso_spawn(plan, &failure);
    char lease[PATH_MAX];
    lease[0] = '\0';
    if (store_lock >= 0) {
        if (pid >= 0 && !lease_write(rp.lease_store, rp.lease_body, pid, lease, sizeof lease)) {
            /* No lease, no run: prune could take the layers from under it. */
            fprintf(stderr, "isolate-run: image: cannot write the sandbox's lease in the image store %s: %s\n",
                    rp.lease_store, strerror(errno));
            kill(pid, SIGKILL);
            while (waitpid(pid, NULL, 0) < 0 && errno == EINTR)
                ;
            _exit(125);
        }
        close(store_lock);
    }
    close(status_pipe[1]);
    for (uint32_t i = 0; i < rp.n_idmap; i++)
        close(tree_fds[i]);
    if (userns_fd >= 0)
        close(userns_fd);
    if (layers_tree >= 0)
        close(layers_tree);
    if (layers_userns >= 0)
        close(layers_userns);
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

    if (lease[0])
        unlink(lease); /* the sandbox has ended: its layers are free to prune */
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
