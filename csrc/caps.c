/*
 * caps.c - credentials: groups, ids, capabilities, no_new_privs.
 *
 * The order matters.  Dropping the bounding set and locking securebits need
 * CAP_SETPCAP, so they come first, while the child still holds the
 * capabilities of its fresh user namespace.  Then the groups and ids are
 * switched, and whatever capabilities survive the switch are cleared from
 * every set, so that exec can give none back.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <grp.h>
#include <linux/capability.h>
#include <linux/securebits.h>
#include <sys/prctl.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "steps.h"

#ifndef PR_CAP_AMBIENT
#define PR_CAP_AMBIENT 47
#define PR_CAP_AMBIENT_CLEAR_ALL 4
#endif

static int holds_setpcap(void)
{
    struct __user_cap_header_struct header = {_LINUX_CAPABILITY_VERSION_3, 0};
    struct __user_cap_data_struct data[2];
    if (syscall(SYS_capget, &header, data) < 0)
        return 0;
    return (data[0].effective & (1u << CAP_SETPCAP)) != 0;
}

static int drop_bounding_set(void)
{
    for (int cap = 0; cap < 64; cap++) {
        /* PR_CAPBSET_READ says where the kernel's capabilities end (EINVAL
         * past the last), without relying on errno after a failed drop. */
        if (prctl(PR_CAPBSET_READ, cap, 0, 0, 0) < 0)
            return 0;
        if (prctl(PR_CAPBSET_DROP, cap, 0, 0, 0) < 0)
            return -1;
    }
    return 0;
}

int iso_creds_apply(const struct iso_plan *plan)
{
    /* Without CAP_SETPCAP (an unprivileged caller with no user namespace)
     * the bounding set cannot shrink; such a caller holds no capability and
     * no_new_privs stops exec from granting one, so that is not fatal. */
    if (plan->drop_caps && holds_setpcap()) {
        if (drop_bounding_set() < 0)
            return ISO_STEP_CAPABILITIES;
        /* uid 0 never regains capabilities through exec, even if the
         * program finds a way to become uid 0 inside its namespace. */
        unsigned long bits = SECBIT_NOROOT | SECBIT_NOROOT_LOCKED | SECBIT_NO_SETUID_FIXUP |
                             SECBIT_NO_SETUID_FIXUP_LOCKED | SECBIT_KEEP_CAPS_LOCKED;
        if (prctl(PR_SET_SECUREBITS, bits, 0, 0, 0) < 0)
            return ISO_STEP_CAPABILITIES;
    }
    /* Supplementary groups of a root caller would give the program the
     * group rights of root (gid 0 and friends) on host files. */
    /* Raw system calls, not glibc's wrappers: in a multithreaded process
     * glibc applies setgroups/setres[ug]id to every thread it knows by
     * signalling them, and a CLONE_VM child would reach the parent's. */
    if (plan->clear_groups && syscall(SYS_setgroups, 0, NULL) < 0)
        return ISO_STEP_SETGROUPS;
    if (plan->set_ids) {
        if (syscall(SYS_setresgid, plan->gid, plan->gid, plan->gid) < 0)
            return ISO_STEP_SETGID;
        if (syscall(SYS_setresuid, plan->uid, plan->uid, plan->uid) < 0)
            return ISO_STEP_SETUID;
    }
    if (plan->drop_caps) {
        if (prctl(PR_CAP_AMBIENT, PR_CAP_AMBIENT_CLEAR_ALL, 0, 0, 0) < 0 && errno != EINVAL)
            return ISO_STEP_CAPABILITIES;
        struct __user_cap_header_struct header = {_LINUX_CAPABILITY_VERSION_3, 0};
        struct __user_cap_data_struct data[2] = {{0, 0, 0}, {0, 0, 0}};
        if (syscall(SYS_capset, &header, data) < 0)
            return ISO_STEP_CAPABILITIES;
    }
    return 0;
}

int iso_no_new_privs(void)
{
    if (prctl(PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) < 0)
        return ISO_STEP_NO_NEW_PRIVS;
    return 0;
}
