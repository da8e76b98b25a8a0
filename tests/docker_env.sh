#!/usr/bin/env bash
# Prepare a Docker engine and the local test image for tests/test_docker.py.
#
# Idempotent: installs docker.io and busybox-static when missing (root only),
# starts dockerd in the background when no engine answers, and builds the image
# isolate-test:busybox from busybox-static's binary (nothing is pulled).
# When the engine cannot be had, it says why and exits 0: the Docker tests then
# skip with that reason. dockerd is left running on purpose.
set -uo pipefail

IMAGE="${ISOLATE_TEST_IMAGE:-isolate-test:busybox}"
LOG="${ISOLATE_DOCKERD_LOG:-/tmp/isolate-dockerd.log}"

say() { echo "docker_env: $*" >&2; }

engine_answers() { command -v docker >/dev/null 2>&1 && timeout 10 docker info >/dev/null 2>&1; }

have_root() { [ "$(id -u)" = 0 ]; }

busybox_static() {
    local path
    path="$(command -v busybox 2>/dev/null || true)"
    [ -n "$path" ] || return 1
    case "$(LC_ALL=C ldd "$path" 2>&1 || true)" in
    *"not a dynamic executable"*) echo "$path" ;;
    *) return 1 ;;
    esac
}

install_packages() {
    local missing=()
    command -v dockerd >/dev/null 2>&1 || missing+=(docker.io)
    busybox_static >/dev/null || missing+=(busybox-static)
    [ ${#missing[@]} -eq 0 ] && return 0
    if ! have_root; then
        say "missing ${missing[*]} and not root; cannot install them"
        return 1
    fi
    say "installing ${missing[*]}"
    export DEBIAN_FRONTEND=noninteractive
    apt-get update -qq >/dev/null 2>&1 || say "apt-get update failed; trying the install anyway"
    apt-get install -y -qq "${missing[@]}" >/dev/null 2>&1 || { say "apt-get install ${missing[*]} failed"; return 1; }
}

start_engine() {
    engine_answers && return 0
    if ! have_root; then
        say "no Docker engine answers and only root can start dockerd here"
        return 1
    fi
    command -v dockerd >/dev/null 2>&1 || { say "dockerd is not installed"; return 1; }
    say "starting dockerd (log: $LOG)"
    setsid nohup dockerd --iptables=false --ip-masq=false --bridge=none </dev/null >>"$LOG" 2>&1 &
    local i
    for i in $(seq 1 300); do
        engine_answers && return 0
        sleep 0.1
    done
    say "dockerd did not answer within 30 s; see $LOG"
    return 1
}

build_image() {
    if docker image inspect "$IMAGE" >/dev/null 2>&1; then
        return 0
    fi
    local busybox
    busybox="$(busybox_static)" || { say "no statically linked busybox (apt-get install busybox-static)"; return 1; }
    local root
    root="$(mktemp -d)"
    trap 'rm -rf "$root"' RETURN
    mkdir -p "$root"/{bin,sbin,usr/bin,usr/sbin,etc,tmp,proc,sys,dev,work,home,root,var/tmp}
    chmod 1777 "$root/tmp" "$root/var/tmp"
    cp "$busybox" "$root/bin/busybox"
    local applet
    for applet in $("$root/bin/busybox" --list); do
        [ "$applet" = busybox ] || ln -sf busybox "$root/bin/$applet"
    done
    printf 'root:x:0:0:root:/root:/bin/sh\nnobody:x:65534:65534:nobody:/nonexistent:/bin/sh\n' >"$root/etc/passwd"
    printf 'root:x:0:\nnogroup:x:65534:\n' >"$root/etc/group"
    say "building $IMAGE"
    tar -C "$root" --numeric-owner --owner=0 --group=0 -c . |
        docker import -c 'CMD ["/bin/sh"]' -c 'ENV PATH=/usr/sbin:/usr/bin:/sbin:/bin' - "$IMAGE" >/dev/null ||
        { say "docker import failed"; return 1; }
    if ! docker run --rm --network none "$IMAGE" sh -c 'echo ok' >/dev/null 2>&1; then
        say "the image $IMAGE does not run; removing it"
        docker image rm -f "$IMAGE" >/dev/null 2>&1
        return 1
    fi
}

install_packages && start_engine && build_image && say "ready: $(docker version --format '{{.Server.Version}}') with $IMAGE"
exit 0
