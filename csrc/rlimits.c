/*
 * rlimits.c - per-process resource limits, applied in the child.
 *
 * The parent decides which limits apply (RLIMIT_CORE 0 always, so a crash
 * leaves no core file of sandbox memory behind); the child only sets them,
 * in two passes: every limit but RLIMIT_NOFILE, then RLIMIT_NOFILE.
 */
#define _GNU_SOURCE
#include <sys/resource.h>

#include "steps.h"

int iso_rlimits_apply(const struct iso_plan *plan, int *index, int only_nofile)
{
    for (int i = 0; i < plan->n_rlimits; i++) {
        /* RLIMIT_NOFILE goes last, once the inherited descriptors are
         * closed: the setup's own opens (Landlock rules) must still fit. */
        if ((plan->rlimits[i].resource == RLIMIT_NOFILE) != (only_nofile != 0))
            continue;
        struct rlimit lim = {
            .rlim_cur = plan->rlimits[i].soft,
            .rlim_max = plan->rlimits[i].hard,
        };
        if (setrlimit(plan->rlimits[i].resource, &lim) < 0) {
            *index = i;
            return ISO_STEP_RLIMIT;
        }
    }
    return 0;
}
