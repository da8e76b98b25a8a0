/*
 * net.c - the network namespace's loopback.
 *
 * A fresh network namespace holds only "lo", down.  network="loopback"
 * brings it up, which needs no netlink: the classic interface ioctl does.
 */
#define _GNU_SOURCE
#include <errno.h>
#include <net/if.h>
#include <string.h>
#include <sys/ioctl.h>
#include <sys/socket.h>
#include <unistd.h>

#include "steps.h"

int iso_loopback_up(void)
{
    int sock = socket(AF_INET, SOCK_DGRAM | SOCK_CLOEXEC, 0);
    if (sock < 0)
        return ISO_STEP_LOOPBACK;
    struct ifreq req;
    memset(&req, 0, sizeof req);
    strncpy(req.ifr_name, "lo", IFNAMSIZ - 1);
    if (ioctl(sock, SIOCGIFFLAGS, &req) < 0)
        goto fail;
    req.ifr_flags |= IFF_UP | IFF_RUNNING;
    if (ioctl(sock, SIOCSIFFLAGS, &req) < 0)
        goto fail;
    close(sock);
    return 0;
fail:;
    int saved = errno;
    close(sock);
    errno = saved;
    return ISO_STEP_LOOPBACK;
}
