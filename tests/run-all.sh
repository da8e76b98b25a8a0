#!/usr/bin/env bash
# The whole suite, as the README's test command runs it:
#   1. lint and type-check the package (ruff, mypy); csrc/ is compiled with
#      -Wall -Wextra -Werror by the install that precedes this script;
#   2. the documentation site (docs/, mkdocs.yml) built with warnings as errors, into a
#      directory that is thrown away: a broken link or anchor, a page left out of the nav, an
#      API name that no longer resolves or a CLI option the reference cannot read fails it;
#   3. pytest as the current user (root on CI: root-only tests run);
#   4. when run as root, the suite again as an unprivileged user (uid 65534)
#      from a copy of the tree and a venv that user can read, because most
#      users are not root and namespaces, Landlock and cgroups behave
#      differently for them. The two runs go side by side: each caller has
#      its own runtime directory, registry, plan cache and cgroups, and the
#      tests mostly wait on sandboxes, so two runs take little longer than one;
#   5. the benchmark harness in --quick mode, so that it never rots (its
#      figures are not asserted).
# Each phase prints its duration, each pytest run its summary. Exit status:
# non-zero if any step fails.
set -uo pipefail
cd "$(dirname "$0")/.." || exit 2
PYTHON="${PYTHON:-python3}"
LOGS="$(mktemp -d /tmp/isolate-suite.XXXXXX)"
chmod 755 "$LOGS"
status=0

# phase NAME CMD...: run CMD under a header, then print how long it took and how it ended.
phase() {
    local name="$1" t0 rc; shift
    t0=$(date +%s)
    echo "== $name"
    "$@"; rc=$?
    echo "-- $name: $(( $(date +%s) - t0 )) s, exit $rc"
    [ "$rc" = 0 ] || status=1
}

lint() { "$PYTHON" -m ruff check isolate/ tests/ benchmarks/ docs/ && "$PYTHON" -m mypy; }

# The documentation: the docs extra installs mkdocs; without it the phase fails.
docs() {
    if ! "$PYTHON" -m mkdocs --version >/dev/null 2>&1; then
        echo "mkdocs is missing: install the docs extra (pip install -e '.[docs]')" >&2
        return 1
    fi
    NO_MKDOCS_2_WARNING=1 "$PYTHON" -m mkdocs build --strict -d "$LOGS/site"
}

# A clean copy of the tree (no build products of the root install) and a venv uid 65534 can read.
prepare_unprivileged() {
    if ! command -v setpriv >/dev/null || [ ! -x /usr/bin/python3 ]; then
        echo "the unprivileged run needs setpriv (util-linux) and /usr/bin/python3 with venv" >&2
        return 1
    fi
    mkdir "$work/src"
    git ls-files -z | xargs -0 -I{} cp --parents {} "$work/src/" 2>/dev/null || cp -r . "$work/src"
    /usr/bin/python3 -m venv "$work/venv" &&
        "$work/venv/bin/pip" install -q "$work/src[test,inspect,mcp,smolagents,llm-sandbox,server,server-test,deploy-test,ray,images]" &&
        chmod -R a+rX "$work"
}

# suite WHO LOG: pytest as WHO (the current user, or 65534), its output into LOG; then its summary.
suite() {
    local who="$1" log="$2" t0 rc
    t0=$(date +%s)
    # Each run's temporary directories in a directory of its own (--basetemp), never in the user's shared
    # /tmp/pytest-of-USER, whose older runs pytest removes at the end: what anything else left there (a tree
    # deeper than Python's recursion limit) ended a whole suite in a RecursionError.
    local temp
    temp="$(mktemp -d /tmp/isolate-pytest.XXXXXX)"
    if [ "$who" = current ]; then
        "$PYTHON" -m pytest -p no:cacheprovider --basetemp "$temp/t" tests/ > "$log" 2>&1
    else
        chown 65534:65534 "$temp"
        (cd /tmp && setpriv --reuid=65534 --regid=65534 --clear-groups \
            env -i PATH=/usr/local/bin:/usr/bin:/bin HOME=/tmp LANG=C.UTF-8 \
            "$work/venv/bin/python" -m pytest -p no:cacheprovider --basetemp "$temp/t" "$work/src/tests") \
            > "$log" 2>&1
    fi
    rc=$?
    echo "$rc" > "$log.rc"
    echo "$(( $(date +%s) - t0 ))" > "$log.seconds"
}

# show NAME LOG: the run's failures and summary (its whole output when it failed).
show() {
    local name="$1" log="$2" rc
    rc="$(cat "$log.rc" 2>/dev/null || echo 1)"
    if [ "$rc" = 0 ]; then
        grep -E '^(SKIPPED|XFAIL|XPASS)' "$log" | head -n 40
    else
        cat "$log"
    fi
    echo "-- $name: $(tail -n 1 "$log") ($(cat "$log.seconds" 2>/dev/null) s, exit $rc)"
    [ "$rc" = 0 ] || status=1
}

unprivileged=0
if [ "$(id -u)" = 0 ] && [ "${ISOLATE_SKIP_UNPRIVILEGED:-0}" != 1 ]; then
    unprivileged=1
    work="$(mktemp -d /tmp/isolate-unprivileged.XXXXXX)"
    trap 'rm -rf "$work" "$LOGS"' EXIT
    # Its install goes on while ruff and mypy run.
    prepare_unprivileged > "$LOGS/prepare.log" 2>&1 &
    prepare_pid=$!
else
    trap 'rm -rf "$LOGS"' EXIT
fi

phase "ruff and mypy" lint
phase "documentation (mkdocs build --strict)" docs

both() {
    suite current "$LOGS/current.log" &
    local current_pid=$!
    if [ "$unprivileged" = 1 ]; then
        if wait "$prepare_pid"; then
            suite 65534 "$LOGS/65534.log"
        else
            cat "$LOGS/prepare.log"; echo 1 > "$LOGS/65534.log.rc"; echo "preparing the unprivileged run failed" > "$LOGS/65534.log"
        fi
    fi
    wait "$current_pid"
    show "pytest as $(id -un) (uid $(id -u))" "$LOGS/current.log"
    [ "$unprivileged" = 0 ] || show "pytest as uid 65534" "$LOGS/65534.log"
    [ "$status" = 0 ]
}
phase "pytest as $(id -un)$([ "$unprivileged" = 1 ] && echo " and as uid 65534, side by side")" both

phase "benchmarks --quick" "$PYTHON" -m benchmarks --quick
exit $status
