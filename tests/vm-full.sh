#!/usr/bin/env bash
# The suite in a throw-away VM: Linux 6.1, Landlock ABI 2, cgroup v2 (shared/vm beside the checkout).
# One boot serves both callers (tests/vm/guest-suite.sh): isolate is built here once, as a wheel for
# the guest's Python, then pytest runs in the guest as root and as uid 65534 side by side, each in a
# fresh cgroup delegated to it, with its own HOME and TMPDIR.
#
# Usage: tests/vm-full.sh [--all] [--out DIR] [run.sh options, e.g. --no-landlock]
#   default  the host-sensitive tests (pytest -m host: those whose outcome depends on the kernel,
#            cgroups or Landlock; tests/conftest.py names the others), as CI runs them
#   --all    every test of the suite (the integrations' extras are not installed in the guest:
#            their tests skip and say why)
#   --out    where results/ go (pytest output, junit XML, quick start; default /tmp/isolate-vm)
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
work="$(mktemp -d "${TMPDIR:-/tmp}/isolate-vm.XXXXXX")"
trap 'rm -rf "$work"' EXIT
mkdir "$work/src" "$work/wheels"
git ls-files -z | xargs -0 cp --parents -t "$work/src"
cp tests/vm/guest-suite.sh "$work/"
# The guest is Debian 12 (Python 3.11, glibc 2.36): Debian's python3 here builds the same ABI, at
# native speed (under emulation the C core takes minutes to compile).
/usr/bin/python3 -m venv "$work/build"
"$work/build/bin/pip" -q wheel --no-deps -w "$work/wheels" "$work/src" > "$work/build.log" 2>&1 \
    || { tail -n 30 "$work/build.log"; exit 1; }
set +e
"$VM/run.sh" --share "$work" --cgroup delegated --mem 4096 --timeout 3000 "${RUN_OPTS[@]}" -- \
    env MARK="$MARK" bash ./guest-suite.sh > "$work/console.txt" 2>&1
rc=$?
set -e
rm -rf "$OUT"; mkdir -p "$OUT"
cp -r "$work/results/." "$OUT/" 2>/dev/null || true
cp "$work/console.txt" "$OUT/"
grep -E '^(== |-- )' "$work/console.txt" || tail -n 40 "$work/console.txt"
[ "$rc" = 0 ] || tail -n 60 "$work/console.txt"
echo "vm-full: results in $OUT (exit $rc)"
exit "$rc"
