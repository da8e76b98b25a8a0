/*
 * isolate.h - the whole surface of isolate's C core.
 *
 * The Python package reads this file as cffi's cdef (preprocessor lines are
 * dropped first), so it holds only plain declarations.  Everything a child
 * needs between fork and exec is prepared by the parent into a struct
 * iso_plan; the child walks the plan with system calls only: it allocates
 * nothing and touches no Python object.
 *
 * Order of the steps in the child (see spawn.c):
 *   user namespace and id maps (written by the parent), other namespaces,
 *   mounts and pivot_root, hostname and loopback, rlimits and cgroup (joined
 *   by the parent before the child goes on), supplementary groups and ids,
 *   capabilities, no_new_privs, Landlock, file descriptors, seccomp last, exec.
 */
#ifndef ISOLATE_H
#define ISOLATE_H

#include <stdint.h>

/* The steps of the setup; a failing one reaches the parent as an
 * iso_failure {step, errno, index} through the error pipe. */
enum iso_step {
    ISO_STEP_NONE = 0,
    ISO_STEP_CLONE = 1,
    ISO_STEP_USERNS_MAP = 2,
    ISO_STEP_CGROUP = 3,
    ISO_STEP_WAIT_PARENT = 4,
    ISO_STEP_SIGNALS = 5,
    ISO_STEP_SETSID = 6,
    ISO_STEP_PDEATHSIG = 7,
    ISO_STEP_MOUNT_PRIVATE = 8,
    ISO_STEP_MOUNT_STAGING = 9,
    ISO_STEP_MOUNT_DIR = 10,
    ISO_STEP_MOUNT_BIND = 11,
    ISO_STEP_MOUNT_TMPFS = 12,
    ISO_STEP_MOUNT_PROC = 13,
    ISO_STEP_MOUNT_DEVPTS = 14,
    ISO_STEP_MOUNT_SYMLINK = 15,
    ISO_STEP_MOUNT_MOVE = 16,
    ISO_STEP_MOUNT_READONLY = 17,
    ISO_STEP_PIVOT_ROOT = 18,
    ISO_STEP_HOSTNAME = 19,
    ISO_STEP_LOOPBACK = 20,
    ISO_STEP_FORK = 21,
    ISO_STEP_STDIO = 22,
    ISO_STEP_CHDIR = 23,
    ISO_STEP_RLIMIT = 24,
    ISO_STEP_SETGROUPS = 25,
    ISO_STEP_SETGID = 26,
    ISO_STEP_SETUID = 27,
    ISO_STEP_CAPABILITIES = 28,
    ISO_STEP_NO_NEW_PRIVS = 29,
    ISO_STEP_LANDLOCK = 30,
    ISO_STEP_CLOSE_FDS = 31,
    ISO_STEP_SECCOMP = 32,
    ISO_STEP_EXEC = 33,
    ISO_STEP_INIT = 34,
    ISO_STEP_UNSHARE = 35,
    ISO_STEP_IDMAP = 36,
    ISO_STEP_MOUNT_OVERLAY = 37,
    ISO_STEP_EGRESS = 38
};

/* What the error pipe carries when a step fails. */
struct iso_failure {
    int32_t step;   /* enum iso_step */
    int32_t err;    /* errno */
    int32_t index;  /* which mount, rlimit or rule, or -1 */
};

enum iso_mount_kind {
    ISO_MOUNT_DIR = 1,       /* mkdir target */
    ISO_MOUNT_BIND = 2,      /* bind source (a host path) at target */
    ISO_MOUNT_TMPFS = 3,     /* a fresh tmpfs at target, options in source */
    ISO_MOUNT_PROC = 4,      /* proc of the sandbox's own PID namespace */
    ISO_MOUNT_DEVPTS = 5,    /* a private devpts instance */
    ISO_MOUNT_SYMLINK = 6,   /* a symlink at target pointing to source */
    ISO_MOUNT_MOVE = 7,      /* attach the detached mount fd at target */
    ISO_MOUNT_FILE = 8,      /* create an empty file at target (a mount point) */
    ISO_MOUNT_OVERLAY = 9    /* an overlayfs at target: source is the lower layer,
                              * upper and work its writable layers (all three
                              * mounted in this namespace already); fd is the
                              * upper directory the parent opened, checked */
};

/* Mount flags of struct iso_mount. */
enum iso_mount_flag {
    ISO_MOUNT_F_READONLY = 1,    /* read-only, nosuid, nodev, recursively */
    ISO_MOUNT_F_NOEXEC = 2,
    ISO_MOUNT_F_KEEP_DEV = 4,    /* do not add nodev (device node binds) */
    ISO_MOUNT_F_IMAGE_ROOT = 8   /* an overlay that is the sandbox's root: an image's (writable: its upper
                                  * layer is a private tmpfs) */
};

/* One mount step, every path prepared by the parent:
 *   source: the host path as seen from the staging root ("/oldroot/usr"),
 *           tmpfs options, or a symlink's target;
 *   target: the place in the new root as seen while building it ("/newroot/usr"). */
struct iso_mount {
    int32_t kind;
    int32_t flags;
    int32_t fd;
    int32_t mode;
    const char *source;
    const char *target;
    const char *upper;   /* ISO_MOUNT_OVERLAY only: the upper and work directories */
    const char *work;
};

struct iso_rlimit {
    int32_t resource;
    uint64_t soft;
    uint64_t hard;
};

/* One Landlock rule: the rights under a directory or on a file, given as a
 * descriptor the parent opened (host paths: the parent may traverse what the
 * program may not) or as a path the child opens (what only the sandbox has). */
struct iso_landlock_rule {
    const char *path;
    uint64_t access;
    int32_t fd;
};

struct iso_plan {
    /* Namespaces: CLONE_NEW* flags for clone(); 0 runs in the caller's. */
    int32_t clone_flags;
    /* User namespace id maps, written by the parent ("inside outside count\n"). */
    const char *uid_map;
    const char *gid_map;
    int32_t setgroups_deny;
    /* Set-id helpers (newuidmap, newgidmap: Debian's uidmap) that write the
     * maps instead, for a regular caller's subordinate ranges (/etc/subuid,
     * /etc/subgid), which it may not write itself; NULL writes directly. */
    const char *newuidmap;
    const char *newgidmap;
    /* Files the parent writes the child's pid into (cgroup.procs), -1 ends. */
    int32_t cgroup_procs_fds[8];

    /* Mounts (needs CLONE_NEWNS): staging dir, steps, then pivot_root. */
    const char *staging;           /* an existing host dir to stage on ("/tmp") */
    const struct iso_mount *mounts;
    int32_t n_mounts;
    const char *hostname;          /* NULL keeps it */
    int32_t idmap_userns_fd;       /* pre-exec hook: open ISO_MOUNT_MOVE trees itself */
    int32_t loopback_up;

    /* Process. */
    int32_t new_session;
    int32_t die_with_parent;       /* PR_SET_PDEATHSIG(SIGKILL) */
    const char *cwd;               /* inside the sandbox; NULL keeps it */
    const struct iso_rlimit *rlimits;
    int32_t n_rlimits;
    int32_t set_ids;               /* switch to uid/gid below */
    uint32_t uid;
    uint32_t gid;
    int32_t clear_groups;          /* setgroups(0, NULL) */
    int32_t drop_caps;
    int32_t no_new_privs;

    /* Landlock: handled rights, rules, scopes; abi 0 skips it. */
    int32_t landlock_abi;
    uint64_t landlock_handled_fs;
    uint64_t landlock_handled_net;
    uint64_t landlock_scoped;
    const struct iso_landlock_rule *landlock_rules;
    int32_t n_landlock_rules;

    /* seccomp: a compiled struct sock_filter[] (len instructions), installed last. */
    const void *seccomp_filter;
    int32_t seccomp_len;
    int32_t seccomp_notify;        /* ask for a listener and hand it to the init */
    const char *seccomp_errnos;    /* "nr:errno,..." the init answers notifications with */

    /* Descriptors: stdio for the program (-1 keeps), and the ones it keeps. */
    int32_t stdio[3];
    const int32_t *keep_fds;       /* sorted ascending */
    int32_t n_keep_fds;

    /* The program: a name searched in search_path (PATH inside), or a path;
     * or, when program_fd >= 0, that executable (execveat, argv as given). */
    int32_t program_fd;
    const char *file;
    const char *search_path;
    char *const *argv;
    char *const *envp;

    /* The init (a small static executable) and its arguments. */
    int32_t init_fd;               /* O_PATH descriptor of the init binary; -1: no init */
    int32_t status_fd;             /* the init writes struct iso_status here */
    long long wall_ms;             /* 0: none; the parent rounds a limit up, never to 0 */

    /* Supervised connect() (supervise.c): NULL, or the init's spec
     * "MODE,NR_CONNECT,NR_SOCKET,NR_SOCKETPAIR[,DEV:INO...]" (MODE n or l). */
    const char *supervise;

    /* Egress by name (net.c): the sandbox's own network namespace keeps no
     * route out; the host's mediator answers on listeners made inside it.
     * egress_fd: a unix socket to the mediator, or -1.  Once the loopback is
     * up, the first child makes a UDP socket at egress_dns_address:53 and a
     * TCP listener on every one of egress_ports (any address), sends them
     * all in one message on egress_fd and closes its copies. */
    int32_t egress_fd;
    uint32_t egress_dns_address;   /* IPv4, host byte order */
    const uint16_t *egress_ports;
    int32_t n_egress_ports;

    /* Denial tracing (why.c): NULL, or the init's spec
     * "BUILT,HANDLED_FS[,MASK:DEV:INO...][,MASK/HEXPATH...]": whether the
     * root is built, the Landlock rights handled, and each rule's rights on
     * an inode the parent named or a path the init opens inside.  The
     * filter then sends the path system calls to the init, which looks
     * (never decides) and lets each continue. */
    const char *why;
    /* With why: a pipe the init writes each refusal to as it happens
     * (struct iso_why_event), for a kept sandbox's per-command reports;
     * -1 for none. */
    int32_t why_stream_fd;
    /* A network namespace made ahead of the run (iso_make_netns), > 2, or 0
     * for none: the parent joins it around the clone, whose flags then lack
     * CLONE_NEWNET, so that the sandbox is born in it (one that cannot be
     * joined: the clone makes one, as with CLONE_NEWNET). */
    int32_t netns_fd;
    /* The signals (bit N-1 for signal N) the program keeps ignored where the
     * caller ignores them at the spawn, as exec would; every other
     * disposition goes back to default.  isolate.run and isolate-run give
     * ISO_IGNORED_KEPT (nohup's SIGHUP, a background job's SIGINT stay
     * ignored); 0 resets them all (a kept sandbox's server). */
    uint64_t keep_ignored;
};

/* Every signal but SIGPIPE (13) and SIGXFSZ (25), which Python and
 * isolate-run ignore for themselves: subprocess's restore_signals. */
#define ISO_IGNORED_KEPT 0xfffffffffeffefff

/* What the init reports when the program ended: wait status, why, denials. */
enum iso_reason {
    ISO_REASON_EXITED = 0,
    ISO_REASON_TIMEOUT = 1
};

struct iso_denial {
    int32_t nr;
    uint32_t count;
};

/* A connect() the supervisor refused (supervise.c). */
enum iso_net_denial_kind {
    ISO_NET_DENIAL_UNIX = 1,       /* a pathname unix socket outside the grants */
    ISO_NET_DENIAL_INET = 2,       /* an address the network mode does not reach */
    ISO_NET_DENIAL_DGRAM = 3       /* an AF_UNIX datagram socket (socket/socketpair) */
};

struct iso_net_denial {
    int32_t kind;
    int32_t family;
    int32_t port;
    uint32_t count;
    uint8_t address[16];
    char path[112];                /* as the program gave it, NUL-terminated */
};

struct iso_status {
    uint32_t magic;                /* ISO_STATUS_MAGIC */
    int32_t wait_status;
    int32_t reason;
    uint32_t n_denied;
    int64_t user_usec;             /* the whole tree's, every process reaped */
    int64_t system_usec;
    int64_t maxrss_kib;            /* the largest process's peak */
    struct iso_denial denied[64];
    uint32_t n_net_denied;
    uint32_t net_denied_dropped;   /* distinct denials beyond the table */
    struct iso_net_denial net_denied[16];
};

#define ISO_STATUS_MAGIC 0x150a7e01

/* A file access the init predicts the kernel refused (why.c). */
enum iso_why_access {
    ISO_WHY_READ = 1,
    ISO_WHY_WRITE = 2,
    ISO_WHY_EXECUTE = 3,
    ISO_WHY_CREATE = 4,
    ISO_WHY_REMOVE = 5,
    ISO_WHY_RENAME = 6,
    ISO_WHY_TRUNCATE = 7,
    ISO_WHY_LOOKUP = 8             /* stat, access, readlink, chdir: only a path's absence */
};

enum iso_why_mechanism {
    ISO_WHY_LANDLOCK = 1,          /* no rule grants the right */
    ISO_WHY_ABSENT = 2,            /* the built root has no such path */
    ISO_WHY_READONLY = 3,          /* a read-only mount */
    ISO_WHY_DAC = 4                /* file modes, as the sandbox's uid */
};

struct iso_file_denial {
    int32_t nr;                    /* the system call */
    int32_t access;                /* enum iso_why_access */
    int32_t mechanism;             /* enum iso_why_mechanism */
    uint32_t count;
    uint32_t flags;                /* ISO_WHY_CUT */
    char path[256];                /* as the program named it (its start: see ISO_WHY_CUT) */
    char resolved[256];            /* in the sandbox's view */
};

/* path or resolved was longer than its field, which holds its start only:
 * a different name, never to be granted or shown as the one refused. */
#define ISO_WHY_CUT 1

/* Written after struct iso_status when the plan traces denials. */
struct iso_why_report {
    uint32_t magic;                /* ISO_WHY_MAGIC */
    uint32_t n;
    uint32_t dropped;              /* distinct denials beyond the table */
    uint32_t seen;                 /* path calls looked at */
    struct iso_file_denial denied[48];
};

#define ISO_WHY_MAGIC 0x150a7e02

/* One refusal as it happens, on the plan's why_stream_fd: the session of
 * the process that made the call (a kept sandbox's command leads its own). */
struct iso_why_event {
    int32_t session;
    int32_t pad;
    struct iso_file_denial denial;
};

/* The sixth argument of the execveat() that starts the program: the kernel
 * ignores it, the denial-tracing filter lets that one exec through without
 * asking the init (which is not running yet). */
#define ISO_EXEC_MARK 0x15a7e0e5

/* --- the exec server (execserver.c) --------------------------------------
 *
 * A kept sandbox's program is the init executable run under the name
 * "isolate-exec-server": confined exactly as any program of the sandbox, it
 * starts commands and performs file operations for the host.  The host made
 * the listening SOCK_SEQPACKET socket; every message is one packet that
 * starts with struct iso_xs_request (host to sandbox) or struct iso_xs_reply
 * (sandbox to host), followed by the op's strings or entries.  Descriptors
 * travel as SCM_RIGHTS: the command's stdin, stdout, stderr with EXEC, the
 * opened file with OPEN's reply. */
enum iso_xs_op {
    ISO_XS_EXEC = 1,      /* strings: cwd, argv (n_argv), environment */
    ISO_XS_SIGNAL = 2,    /* on an EXEC's connection: mode is the signal */
    ISO_XS_OPEN = 3,      /* strings: path; flags: open(2) flags; mode */
    ISO_XS_STAT = 4,      /* strings: path */
    ISO_XS_LSTAT = 5,
    ISO_XS_MKDIR = 6,     /* strings: path; mode */
    ISO_XS_UNLINK = 7,
    ISO_XS_RMDIR = 8,
    ISO_XS_RENAME = 9,    /* strings: from, to */
    ISO_XS_READDIR = 10,  /* strings: path; replies ENTRIES..., then END */
    ISO_XS_PING = 11,     /* replies OK with the server's pid */
    ISO_XS_KEEP = 12,     /* strings: key; the request's descriptors (1 to 3) are held by the server
                             under key, with mode as the host's note, in place of any held there;
                             none: what key held is let go (xs_keep.c) */
    ISO_XS_TAKE = 13      /* strings: key; mode: an index; replies OK with a copy of that descriptor
                             of key's and the note as pid (the server keeps its own) */
};

enum iso_xs_flag {
    ISO_XS_F_PTY = 1,          /* EXEC: no stdio sent; the monitor makes a terminal, STARTED carries its master */
    ISO_XS_F_DESCENDANTS = 2,  /* SIGNAL: every process the command started, not itself */
    ISO_XS_F_STRINGS_FD = 4,   /* EXEC: the strings are not in the packet but in the first descriptor
                                  (a memfd), for what one packet cannot hold (argv and environment
                                  up to the kernel's own limit) */
    ISO_XS_F_LATE_STARTED = 8, /* EXEC: STARTED only once the command has run ISO_XS_STARTED_AFTER_MS;
                                  one that ends sooner gets EXITED alone (it carries the pid): a
                                  short command costs the host one wake-up, not two */
    ISO_XS_F_CONVERSATION = 16, /* EXEC on a file connection: the first descriptor is the command's own
                                  conversation (one end of a socketpair the host made), which the
                                  monitor answers on, instead of the connection the request came on:
                                  no connect, accept and wake-up of the server for it */
    ISO_XS_F_DETACHED = 32     /* EXEC: the host hanging up ends nothing, and once the command has
                                  ended the monitor stays the subreaper of what it left (double forks
                                  and sessions of their own included) until all of it has ended: the
                                  host finds them all below the monitor (a kept sandbox's background
                                  commands, which outlive their server) */
};

enum iso_xs_kind {
    ISO_XS_OK = 1,
    ISO_XS_ERROR = 2,          /* err is the errno; step says which for EXEC */
    ISO_XS_STARTED = 3,        /* pid */
    ISO_XS_EXITED = 4,         /* wait_status, reason, usage */
    ISO_XS_ENTRIES = 5,        /* count entries follow */
    ISO_XS_END = 6
};

enum iso_xs_reason {
    ISO_XS_REASON_EXITED = 0,
    ISO_XS_REASON_TIMEOUT = 1,
    ISO_XS_REASON_KILLED = 2,      /* the host asked (SIGKILL), or hung up */
    ISO_XS_REASON_SHUTDOWN = 3     /* the server ended meanwhile */
};

struct iso_xs_request {
    uint32_t magic;
    uint32_t op;
    int32_t flags;
    int32_t mode;
    int64_t timeout_ms;
    uint32_t n_strings;
    uint32_t n_argv;
};

struct iso_xs_stat {
    uint32_t mode;
    uint32_t uid;
    uint32_t gid;
    uint32_t nlink;
    int64_t size;
    int64_t mtime_ns;
    uint64_t ino;
    uint64_t dev;
};

struct iso_xs_reply {
    uint32_t magic;
    uint32_t kind;
    int32_t err;
    int32_t step;
    int32_t pid;
    int32_t wait_status;
    int32_t reason;
    uint32_t count;
    int64_t user_usec;
    int64_t system_usec;
    int64_t maxrss_kib;
    struct iso_xs_stat st;
};

/* ENTRIES: count times this, then the name (name_len bytes and a NUL),
 * padded to a multiple of 8. */
struct iso_xs_dirent {
    struct iso_xs_stat st;
    uint32_t name_len;
    uint32_t pad;
};

#define ISO_XS_MAGIC 0x15a7e5e1
#define ISO_XS_MAX_MESSAGE 196608
/* ISO_XS_F_STRINGS_FD: at most this many bytes and strings.  execve's own
 * limit on argv and environment is at most 6 MiB (3/4 of the 8 MiB stack
 * cap), so this never refuses what a kernel would run. */
#define ISO_XS_MAX_STRINGS_BYTES 16777216
#define ISO_XS_MAX_FD_STRINGS 4194304
/* ISO_XS_F_LATE_STARTED: well inside the host's wait for a start (protocol.REPLY_TIMEOUT, 30 s). */
#define ISO_XS_STARTED_AFTER_MS 1000

/* --- parent side -------------------------------------------------------- */

/* Start the sandbox (fast path: clone(CLONE_VM) from a thread that does not
 * fork the parent's memory), write its id maps and cgroup membership, and
 * wait until the program is exec'd.  Returns the pid of the sandbox's first
 * process (the init), or -1 with *failure filled in. */
int iso_spawn(const struct iso_plan *plan, struct iso_failure *failure);

/* The pre-exec hook: called in the child of a fork (subprocess's
 * preexec_fn).  Returns 0 in the process that goes on to exec the program;
 * on failure returns -1 with *failure filled in.  May fork. */
/* parent_pid: the caller (whose death ends the run's whole tree when there
 * is no PID namespace), or 0. */
int iso_preexec(const struct iso_plan *plan, int parent_pid, struct iso_failure *failure);

/* The highest Landlock ABI this kernel offers, 0 when it has none. */
int iso_landlock_abi(void);

/* A user namespace whose map is "0 outside_uid 1" / "0 outside_gid 1", for
 * idmapped mounts; returns its fd or -1 (errno set).  Needs privilege. */
int iso_make_idmap_userns(uint32_t outside_uid, uint32_t outside_gid);

/* The same with the map "inside_uid outside_uid 1" (and gids): an idmapped
 * mount made with it shows inside_uid's files as outside_uid's. */
int iso_make_idmap_userns_of(uint32_t inside_uid, uint32_t inside_gid, uint32_t outside_uid, uint32_t outside_gid);

/* The same with whole maps, as /proc/PID/uid_map takes them ("INSIDE OUTSIDE COUNT" lines, at most a page):
 * an idmapped mount made with "0 0 1\n1 B+1 N" shows ids 1..N as B+1..B+N, root as root. */
int iso_make_userns_maps(const char *uid_map, const char *gid_map);

/* A fresh network namespace (only "lo", down), made in the calling thread,
 * which then goes back to the one it was in; returns its fd, or -1 (errno
 * set: it needs CAP_SYS_ADMIN), or -2 when the thread could not go back
 * (it is left in the new namespace: use it for nothing else). */
int iso_make_netns(void);

/* A detached recursive clone of path with the idmap of userns_fd applied;
 * returns a mount fd or -1 (errno set). */
int iso_open_idmapped_tree(const char *path, int userns_fd);

/* A kept sandbox's init continues its exec server whenever it stops (a
 * command shares its uid and could stop it).  A pause by the host must stop
 * it and leave the init running (the init ends the sandbox when its caller
 * dies; stopped, it left a stopped sandbox behind for good): the host first
 * sends ISO_SIGNAL_HOLD to the init, and ISO_SIGNAL_RELEASE once it has
 * continued everything.  Sent with kill(): the kernel writes the sender's
 * pid as the init sees it (SI_USER), 0 only for a sender outside its PID
 * namespace; a sender inside cannot forge that (rt_sigqueueinfo lets it
 * write any si_pid, but not si_code SI_USER).  Pending together, the init
 * reads them by number (the hold first); the host waits for a release to
 * be taken before it may send another hold.  (glibc's SIGRTMIN is 34;
 * these are SIGRTMIN + 6 and + 7.) */
#define ISO_SIGNAL_HOLD 40
#define ISO_SIGNAL_RELEASE 41

/* Send ISO_SIGNAL_HOLD (hold 1) or ISO_SIGNAL_RELEASE (hold 0) to process
 * `pid`; 0, or -1 with errno set. */
int iso_hold_exec_server(int pid, int hold);

/* Open path below dir_fd as openat2(2) does with RESOLVE_BENEATH |
 * RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS, and RESOLVE_NO_XDEV when
 * same_mount (beneath.c): no link followed anywhere, nothing above dir_fd
 * (an absolute path, a ".." out: EXDEV).  flags are open(2)'s, mode counts
 * with O_CREAT only.  Returns the descriptor, or -1 with errno set: ENOSYS
 * (or EPERM from a seccomp filter) where openat2 is missing; EAGAIN after
 * ISO_BENEATH_TRIES tries that each met a rename or mount racing a "..". */
#define ISO_BENEATH_TRIES 16
int iso_open_beneath(int dir_fd, const char *path, int flags, uint32_t mode, int same_mount);

/* Probes for `isolate-run doctor`: 0 when the mechanism works, else an errno. */
int iso_probe_userns(void);

#endif
