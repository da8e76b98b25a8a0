/*
 * landlock.c - filesystem, network and scope restrictions with Landlock.
 *
 * The parent computes, for the ABI this kernel offers, which rights are
 * handled and which paths get which rights (isolate/kernel/landlock.py).  The child
 * opens each path as it sees it (inside its new root, where binds keep the
 * host's inodes), adds the rules and restricts itself.  The kernel headers
 * of older distributions lack the newer ABIs, so the structures are spelled
 * out here with the kernel's layout.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <fcntl.h>
#include <stddef.h>
#include <sys/syscall.h>
#include <unistd.h>

#include "steps.h"

#ifndef SYS_landlock_create_ruleset
#define SYS_landlock_create_ruleset 444
#define SYS_landlock_add_rule 445
#define SYS_landlock_restrict_self 446
#endif

#define ISO_LANDLOCK_CREATE_RULESET_VERSION (1U << 0)
#define ISO_LANDLOCK_RULE_PATH_BENEATH 1

/* struct landlock_ruleset_attr, as of ABI 6 */
struct iso_ruleset_attr {
    uint64_t handled_access_fs;
    uint64_t handled_access_net;
    uint64_t scoped;
};

/* struct landlock_path_beneath_attr (packed in the kernel's uapi) */
struct iso_path_beneath_attr {
    uint64_t allowed_access;
    int32_t parent_fd;
} __attribute__((packed));

int iso_landlock_abi(void)
{
    long abi = syscall(SYS_landlock_create_ruleset, NULL, 0, ISO_LANDLOCK_CREATE_RULESET_VERSION);
    return abi < 0 ? 0 : (int)abi;
}

static int restrict_with(const struct iso_ruleset_attr *attr, int abi, const struct iso_landlock_rule *rules,
                         int n_rules, int *index)
{
    /* An older kernel rejects fields it does not know: pass only its part. */
    size_t size = abi >= 6 ? sizeof *attr
                  : abi >= 4 ? offsetof(struct iso_ruleset_attr, scoped)
                             : offsetof(struct iso_ruleset_attr, handled_access_net);
    int ruleset = (int)syscall(SYS_landlock_create_ruleset, attr, size, 0);
    if (ruleset < 0)
        return ISO_STEP_LANDLOCK;
    for (int i = 0; i < n_rules; i++) {
        int fd = rules[i].fd >= 0 ? rules[i].fd : open(rules[i].path, O_PATH | O_CLOEXEC);
        if (fd < 0) {
            *index = i;
            goto fail;
        }
        struct iso_path_beneath_attr beneath = {
            .allowed_access = rules[i].access,
            .parent_fd = fd,
        };
        long rc = syscall(SYS_landlock_add_rule, ruleset, ISO_LANDLOCK_RULE_PATH_BENEATH, &beneath, 0);
        int saved = errno;
        if (rules[i].fd < 0)
            close(fd);
        if (rc < 0) {
            errno = saved;
            *index = i;
            goto fail;
        }
    }
    if (syscall(SYS_landlock_restrict_self, ruleset, 0) < 0)
        goto fail;
    close(ruleset);
    return 0;
fail:;
    int saved = errno;
    close(ruleset);
    errno = saved;
    return ISO_STEP_LANDLOCK;
}

int iso_landlock_apply(const struct iso_plan *plan, int *index)
{
    if (plan->landlock_abi <= 0)
        return 0;
    struct iso_ruleset_attr attr = {
        .handled_access_fs = plan->landlock_handled_fs,
        .handled_access_net = plan->landlock_handled_net,
        .scoped = plan->landlock_scoped,
    };
    return restrict_with(&attr, plan->landlock_abi, plan->landlock_rules, plan->n_landlock_rules, index);
}

/* For the init: every filesystem right of ABI 1 handled, no rule granted.
 * (ABI 1's rights are enough: the init opens no file after its exec.) */
int iso_landlock_deny_all(void)
{
    int abi = iso_landlock_abi();
    if (abi <= 0)
        return 0;
    struct iso_ruleset_attr attr = {.handled_access_fs = (1ULL << 13) - 1};
    int index = -1;
    return restrict_with(&attr, 1, NULL, 0, &index);
}
