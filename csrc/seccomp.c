/*
 * seccomp.c - install the filter the parent compiled (isolate/kernel/seccomp.py).
 *
 * One seccomp() call, the last step before exec: everything the setup
 * itself needs has been done by then.  With a listener, denials come to the
 * init as notifications so that the report can name them.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <linux/filter.h>
#include <linux/seccomp.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "steps.h"

#ifndef SECCOMP_FILTER_FLAG_NEW_LISTENER
#define SECCOMP_FILTER_FLAG_NEW_LISTENER (1UL << 3)
#endif

int iso_seccomp_apply(const struct iso_plan *plan, int *listener)
{
    *listener = -1;
    if (plan->seccomp_filter == NULL || plan->seccomp_len <= 0)
        return 0;
    struct sock_fprog prog = {
        .len = (unsigned short)plan->seccomp_len,
        .filter = (struct sock_filter *)plan->seccomp_filter,
    };
    unsigned long flags = plan->seccomp_notify ? SECCOMP_FILTER_FLAG_NEW_LISTENER : 0;
    long rc = syscall(SYS_seccomp, SECCOMP_SET_MODE_FILTER, flags, &prog);
    if (rc < 0)
        return ISO_STEP_SECCOMP;
    if (plan->seccomp_notify)
        *listener = (int)rc;
    return 0;
}
