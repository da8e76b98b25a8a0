#!/usr/bin/env bash
# The suite in a throw-away VM: Linux 6.1, Landlock ABI 2, cgroup v2 (shared/vm beside the checkout).
# One boot serves both callers (tests/vm/guest-suite.sh): pytest runs in the guest as root and as
# uid 65534 side by side, each in a fresh cgroup delegated to it, with its own HOME and TMPDIR.
# Nothing is built under emulation (compiling the C core and byte-compiling the packages take minutes
# there): the venv is made here, with Debian's python3 (the guest's Python 3.11 and glibc), at a path
# the guest copies it back to, so that its scripts and byte code are valid there as they are.
#
# Usage: tests/vm-full.sh [--all] [--out DIR] [run.sh options, e.g. --no-landlock]
#   default  the host-sensitive tests (pytest -m host: those whose outcome depends on the kernel,
#            cgroups or Landlock; tests/conftest.py names the others), as CI runs them
#   --all    every test of the suite (the integrations' extras are not installed in the guest:
#            their tests skip and say why)
#   --out    where results/ go (pytest output, junit XML, quick start; default /tmp/isolate-vm)
#   PYTEST_ARGS in the environment: more pytest arguments (e.g. "-k monitor"), split at spaces;
#   PYTEST_K: a -k expression taken whole (e.g. "test_way or test_runtime_dir")
# Exit status: 0 when both callers' runs passed.
set -euo pipefail
cd "$(dirname "$0")/.."
VM="${ISOLATE_VM:-$(cd .. && pwd)/shared/vm}"
OUT=/tmp/isolate-vm MARK=host RUN_OPTS=()
while [ $# -gt 0 ]; do
    case "$1" in
        --all) MARK="" ;;
        --out) OUT="$2"; shift ;;
        *) RUN_OPTS+=("$1") ;;
    esac
    shift
done
[ -x "$VM/run.sh" ] || { echo "vm-full: no $VM/run.sh (set ISOLATE_VM to shared/vm)" >&2; exit 2; }
[ -x /usr/bin/python3 ] || { echo "vm-full: needs Debian's /usr/bin/python3 (python3-venv) to build the guest's venv" >&2; exit 2; }
work="$(mktemp -d "${TMPDIR:-/tmp}/isolate-vm.XXXXXX")"
trap 'rm -rf "$work"' EXIT
mkdir "$work/src"
git ls-files -z | xargs -0 cp --parents -t "$work/src"
cp tests/vm/guest-suite.sh "$work/"
t0=$(date +%s)
/usr/bin/python3 -m venv "$work/venv"
"$work/venv/bin/pip" install -q "$work/src" pytest > "$work/build.log" 2>&1 || { tail -n 30 "$work/build.log"; exit 1; }
# The guest takes the tree and the venv as one archive: a copy of their thousands of files over the 9p share,
# file by file under emulation, took seven minutes; the archive, one sequential read, takes seconds.
tar -C "$work" -cf "$work/payload.tar" src venv
echo "-- the guest's venv, built here: $(( $(date +%s) - t0 )) s"
set +e
"$VM/run.sh" --share "$work" --cgroup delegated --mem 4096 --timeout 3000 "${RUN_OPTS[@]}" -- \
    env MARK="$MARK" VENV="$work/venv" PYTEST_ARGS="${PYTEST_ARGS:-}" PYTEST_K="${PYTEST_K:-}" bash ./guest-suite.sh > "$work/console.txt" 2>&1
rc=$?
set -e
rm -rf "$OUT"; mkdir -p "$OUT"
cp -r "$work/results/." "$OUT/" 2>/dev/null || true
cp "$work/console.txt" "$OUT/"
grep -E '^(== |-- )' "$work/console.txt" || tail -n 40 "$work/console.txt"
# On failure: the guest's end of the run without the skips (what failed, its assertion lines, its exit).
[ "$rc" = 0 ] || grep -v '^SKIPPED' "$work/console.txt" | tail -n 120
echo "vm-full: results in $OUT (exit $rc)"
exit "$rc"
