/*
 * steps.h - the child-side steps shared by the C files of the core.
 *
 * Not part of the cffi surface: these run in a child between fork and exec
 * (or in the init) and must never be called in the Python process.  Each
 * returns 0 on success or the enum iso_step that failed, with errno set.
 */
#ifndef ISOLATE_STEPS_H
#define ISOLATE_STEPS_H

#include "isolate.h"

/* mounts.c: build the new root from plan->mounts and pivot into it. */
int iso_mounts_apply(const struct iso_plan *plan, int *index);

/* net.c: bring the loopback interface of a fresh network namespace up. */
int iso_loopback_up(void);
int iso_egress_listen(const struct iso_plan *plan);

/* rlimits.c */
int iso_rlimits_apply(const struct iso_plan *plan, int *index, int only_nofile);

/* caps.c: drop the bounding set and lock securebits while CAP_SETPCAP is
 * held, switch ids, then clear every remaining set; no_new_privs. */
int iso_creds_apply(const struct iso_plan *plan);
int iso_no_new_privs(void);

/* landlock.c */
int iso_landlock_apply(const struct iso_plan *plan, int *index);
int iso_landlock_deny_all(void);

/* seccomp.c: install the compiled filter; *listener gets the notification
 * fd when plan->seccomp_notify. */
int iso_seccomp_apply(const struct iso_plan *plan, int *listener);

/* process.c */
int iso_signals_reset(uint64_t *ignored);
int iso_signals_ignore(uint64_t ignored);
int iso_signals_unblock(void);
int iso_stdio_apply(const struct iso_plan *plan);
int iso_close_fds(const struct iso_plan *plan, const int *extra_keep, int n_extra);
int iso_die_with_parent(void);
int iso_exec_program(const struct iso_plan *plan, long mark);

/* userns.c (parent side): setgroups, uid_map and gid_map of a child. */
int iso_write_id_maps(int pid, const struct iso_plan *plan);

/* supervise.c (linked into the init): connect() performed by the init. */
struct seccomp_notif;
int iso_supervise_init(const char *spec, struct iso_status *status);
int iso_supervise_notification(int listener, const struct seccomp_notif *req);

/* why.c (linked into the init): file denials, looked at and let continue. */
int iso_why_init(const char *spec);
int iso_why_notification(int listener, const struct seccomp_notif *req);
const struct iso_why_report *iso_why_report(void);
void iso_why_stream(int fd);

/* execserver.c (linked into the init): a kept sandbox's program. */
int iso_exec_server_main(int argc, char **argv);

/* spawn.c: the shared tail of both paths (fast spawn and pre-exec hook). */
void iso_report(int fd, int step, int err, int index);

#endif
