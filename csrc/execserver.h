/*
 * execserver.h - the parts of the exec server (a kept sandbox's program,
 * see execserver.c): its wire (xs_wire.c), its file operations
 * (xs_files.c), its command monitors (xs_monitor.c) and the descriptors it
 * keeps for the host (xs_keep.c).  Internal to the
 * init executable; the cffi surface is isolate.h alone.
 */
#ifndef ISO_EXECSERVER_H
#define ISO_EXECSERVER_H

#include <dirent.h>
#include <errno.h>
#include <fcntl.h>
#include <poll.h>
#include <signal.h>
#include <stddef.h>
#include <stdio.h>
#include <stdlib.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/mman.h>
#include <sys/prctl.h>
#include <sys/resource.h>
#include <sys/signalfd.h>
#include <sys/socket.h>
#include <sys/stat.h>
#include <sys/syscall.h>
#include <sys/timerfd.h>
#include <sys/un.h>
#include <sys/wait.h>
#include <time.h>
#include <unistd.h>

#include "steps.h"

#ifndef SYS_close_range
#define SYS_close_range 436
#endif
#ifndef SYS_renameat2
#define SYS_renameat2 316
#endif

#define MAX_CLIENTS 64
/* Commands running at once (each has a monitor process). */
#define MAX_MONITORS 4096
#define MAX_STRINGS 16384
/* Descriptors one request may carry (see struct request). */
#define MAX_FDS 6

/* One request as received: the header, its strings, its descriptors. */
struct request {
    struct iso_xs_request head;
    char **strings; /* inline_strings, or (ISO_XS_F_STRINGS_FD) a monitor's own mapping */
    /* The conversation (ISO_XS_F_CONVERSATION), the strings' memfd
     * (ISO_XS_F_STRINGS_FD), stdin, stdout, stderr, and the command's
     * descriptor 3 if one came. */
    int fds[MAX_FDS];
    int n_fds;
};

/* --- the wire (xs_wire.c) --------------------------------------------------- */

/* The packet last received, its length, and the request parsed from it
 * (a waiting monitor is handed the packet as it came). */
extern char xs_message[ISO_XS_MAX_MESSAGE + 8];
extern size_t xs_current_len;
extern struct request xs_current;

void xs_close_fds(struct request *req);
/* Receive one packet into xs_current.  Returns 1 on a request, 0 when the
 * peer hung up, -1 on a malformed packet (its descriptors are closed);
 * with MSG_DONTWAIT in flags, -2 when no packet is there yet. */
int xs_receive_flags(int conn, int flags);
int xs_receive(int conn);
int xs_send_reply(int conn, const struct iso_xs_reply *reply, const void *extra, size_t extra_len, int fd);
void xs_reply_kind(int conn, uint32_t kind, int err);
/* One packet with up to MAX_FDS descriptors, without blocking: 0, or -1. */
int xs_send_fds(int fd, const void *data, size_t len, const int *fds, int n_fds);
long long xs_now_ms(void);

/* --- file operations (xs_files.c) ------------------------------------------ */

/* Answer a file operation (or PING) on conn, as the program would do it. */
void xs_file_op(int conn, const struct request *req);

/* --- descriptors kept for the host (xs_keep.c) ------------------------------ */

/* Answer KEEP or TAKE on conn (the request's own descriptors stay the caller's to close). */
void xs_keep_op(int conn, const struct request *req);
/* In a child of the server: close every descriptor held for the host. */
void xs_keep_close_all(void);

/* --- commands (xs_monitor.c) ------------------------------------------------ */

/* A waiting monitor's socket to the server; -1 in one forked for one command. */
extern int xs_monitor_chan;
/* The next command's error pipe (a waiting monitor makes it ahead). */
extern int xs_monitor_err_pipe[2];
void xs_monitor_prepare(void);
/* Start req's command and answer for it on conn until it has ended;
 * returns only when this process may serve another command. */
void xs_monitor(int conn, struct request *req);

#endif
