#!/bin/bash
# guest-suite.sh -- runs INSIDE the VM (tests/vm-full.sh shares a folder holding src/, wheels/ and this
# script, and runs it there as root). One boot serves both callers:
#   1. one install: the venv tests/vm-full.sh built on the host (nothing is compiled under
#      emulation), unpacked from its archive at the path it was built at, readable by every user;
#   2. the README's quick start as root and as uid 65534;
#   3. pytest as root and as uid 65534, side by side, each in a fresh cgroup of its own (delegated as
#      systemd's Delegate=yes would, to that user), with its own HOME and TMPDIR, so that neither run
#      sees the other's cgroups or state.
# Environment: CALLERS ("root 65534"), MARK ("host": the host-sensitive tests; "" for all of them),
# PYTEST_ARGS (more pytest arguments, split at spaces), PYTEST_K (a -k expression, taken whole: "a or b").
# Results (pytest output, junit XML, quick start) land in results/ of the shared folder. Exit status:
# 0 when every caller's pytest passed.
set -u
SHARE="$(pwd)"
R="$SHARE/results"; mkdir -p "$R"
CALLERS="${CALLERS:-root 65534}" MARK="${MARK-host}"
SRC=/opt/isolate-src CG=/sys/fs/cgroup/vm.slice
stamp() { echo "== $* ($(date +%T), uptime $(cut -d' ' -f1 /proc/uptime)s)"; }

stamp "the tree and the venv built on the host, unpacked at their own paths"
V="${VENV:?VENV: the host path of the venv tests/vm-full.sh built}"
unpacked="$(mktemp -d /opt/payload.XXXXXX)"
tar -C "$unpacked" -xf "$SHARE/payload.tar" || exit 1
rm -rf "$SRC" "$V"; mkdir -p "$(dirname "$V")"
mv "$unpacked/src" "$SRC" && mv "$unpacked/venv" "$V" && rmdir "$unpacked" || exit 1
chmod -R a+rX "$SRC" "$V"; chmod 755 "$(dirname "$V")"

# run_as WHO CMD...: CMD as that caller, with a minimal environment of its own.
run_as() {
    local who="$1"; shift
    local home="/tmp/home-$who" tmp="/tmp/tmp-$who"
    mkdir -p "$home" "$tmp"; chmod 755 "$home" "$tmp"
    # ISOLATE_TESTS_SHARED_INSTALL: both callers' suites run from this one install at once, so no test may
    # change the install's own files (a module's time makes the other suite's cached plans stale).
    local env=(env -i "PATH=$V/bin:/usr/local/bin:/usr/bin:/bin" "HOME=$home" "TMPDIR=$tmp" LANG=C.UTF-8
               ISOLATE_TESTS_SHARED_INSTALL=1)
    if [ "$who" = root ]; then
        "${env[@]}" "$@"
    else
        chown "$who:$who" "$home" "$tmp"
        setpriv --reuid="$who" --regid="$who" --clear-groups "${env[@]}" "$@"
    fi
}

for who in $CALLERS; do
    stamp "README quick start as $who"
    (cd /tmp && run_as "$who" isolate-run -- sh -c 'id; ls /; cat /etc/shadow || echo denied'; echo "[exit $?]") \
        2>&1 | tee "$R/quickstart-$who.txt"
done

# suite WHO: pytest as WHO in a fresh cgroup delegated to WHO.
suite() {
    local who="$1" cg="$CG/pytest-$1.service"
    mkdir "$cg" && setfattr -n trusted.delegate -v 1 "$cg" || return 1
    [ "$who" = root ] || chown "$who" "$cg" "$cg"/cgroup.{procs,threads,subtree_control}
    local args=(-p no:cacheprovider "$SRC/tests" -q -rfEs --junitxml="/tmp/junit-$who.xml")
    [ -n "$MARK" ] && args+=(-m "$MARK")
    [ -n "${PYTEST_K:-}" ] && args+=(-k "$PYTEST_K")
    # shellcheck disable=SC2086
    (echo "$BASHPID" > "$cg/cgroup.procs" && cd /tmp && run_as "$who" "$V/bin/python" -m pytest "${args[@]}" ${PYTEST_ARGS:-}) \
        > "$R/pytest-$who.txt" 2>&1
    echo "[exit $?]" >> "$R/pytest-$who.txt"
    cp "/tmp/junit-$who.xml" "$R/" 2>/dev/null
}
stamp "pytest ${MARK:+-m $MARK }as: $CALLERS"
for who in $CALLERS; do suite "$who" & done
wait
status=0
for who in $CALLERS; do
    echo "-- pytest as $who: $(grep -E '(passed|failed|error)' "$R/pytest-$who.txt" | tail -n 1)"
    # On failure: what failed and why (the short summary lists the skips first, which can fill a tail).
    grep -qx '\[exit 0\]' "$R/pytest-$who.txt" || {
        grep -E '^(FAILED|ERROR) |^E  ' "$R/pytest-$who.txt" | head -n 60; tail -n 3 "$R/pytest-$who.txt"; status=1; }
done
stamp "done"
exit $status
