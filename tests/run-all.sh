#!/usr/bin/env bash
# The whole suite, as the README's test command runs it:
#   1. lint and type-check the package (ruff, mypy); csrc/ is compiled with
#      -Wall -Wextra -Werror by the install that precedes this script;
#   2. pytest as the current user (root on CI: root-only tests run);
#   3. when run as root, the suite again as an unprivileged user (uid 65534)
#      from a copy of the tree and a venv that user can read, because most
#      users are not root and namespaces, Landlock and cgroups behave
#      differently for them;
#   4. the benchmark harness in --quick mode, so that it never rots (its
#      figures are not asserted).
# Exit status: non-zero if any step fails.
set -euo pipefail
cd "$(dirname "$0")/.."
PYTHON="${PYTHON:-python3}"
status=0

echo "== ruff and mypy"
"$PYTHON" -m ruff check isolate/ tests/ benchmarks/ || status=1
"$PYTHON" -m mypy || status=1

echo "== pytest as $(id -un) (uid $(id -u))"
"$PYTHON" -m pytest -p no:cacheprovider tests/ || status=1

if [ "$(id -u)" = 0 ] && [ "${ISOLATE_SKIP_UNPRIVILEGED:-0}" != 1 ]; then
    echo "== pytest as uid 65534"
    if ! command -v setpriv >/dev/null || [ ! -x /usr/bin/python3 ]; then
        echo "the unprivileged run needs setpriv (util-linux) and /usr/bin/python3 with venv" >&2
        status=1
    else
        work="$(mktemp -d /tmp/isolate-unprivileged.XXXXXX)"
        trap 'rm -rf "$work"' EXIT
        mkdir "$work/src"
        # A clean copy of the tree (no build products of the root install).
        git ls-files -z | xargs -0 -I{} cp --parents {} "$work/src/" 2>/dev/null || cp -r . "$work/src"
        /usr/bin/python3 -m venv "$work/venv"
        "$work/venv/bin/pip" install -q "$work/src[test,inspect,mcp,smolagents,llm-sandbox,server,server-test]"
        chmod -R a+rX "$work"
        (cd /tmp && setpriv --reuid=65534 --regid=65534 --clear-groups \
            env -i PATH=/usr/local/bin:/usr/bin:/bin HOME=/tmp LANG=C.UTF-8 \
            "$work/venv/bin/python" -m pytest -p no:cacheprovider "$work/src/tests") || status=1
    fi
fi

echo "== benchmarks --quick"
"$PYTHON" -m benchmarks --quick || status=1
exit $status
