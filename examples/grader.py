"""A code judge: run untrusted submissions under limits and give each a verdict from its report.

What it shows
    ``isolate.run`` as a grader uses it: each submission is a Python program fed
    the test's input on stdin, run with a CPU-time and wall-clock limit, a memory
    limit and a limit on processes, no network, and no writable host path. The
    verdict is read from ``result.report``: ``status`` names the limit that ended
    the run (``cpu``, ``timeout``, ``memory``), ``limits_reached`` a limit that was
    hit without ending it (``pids``), ``denied`` what was refused (``network``).

    Memory and process limits hold over the whole process tree through a cgroup.
    Where the caller has no cgroup it may write (often the case for a user who is
    not root), the judge says so and runs with ``best_effort=True``: per-process
    rlimits instead, and the verdict comes from how the program failed.

How to run
    python examples/grader.py              # Linux, isolate installed; root or not

It prints one verdict per submission and ends with "all verdicts as expected".
"""

from __future__ import annotations

import sys

import isolate

#: The system's interpreter, granted by the default policy (a venv's or pyenv's python3 is not).
PYTHON = "/usr/bin/python3"

TEST_INPUT, TEST_OUTPUT = "2 3\n", "5"

#: name: (source, the verdict it should get)
SUBMISSIONS = {
    "correct": ("a, b = map(int, input().split())\nprint(a + b)\n", "accepted"),
    "infinite-loop": ("while True:\n    pass\n", "time limit exceeded"),
    "memory-hog": ("blocks = []\nwhile True:\n    blocks.append(bytearray(10**7))\n", "memory limit exceeded"),
    "fork-bomb": ("import os\nwhile True:\n    os.fork()\n", "process limit exceeded"),
    "phones-home": ("import socket\nsocket.create_connection(('1.1.1.1', 80), timeout=5)\nprint(5)\n",
                    "network refused"),
}

LIMITS = isolate.Limits(cpu_seconds=1, wall_seconds=3, memory="64M", pids=16, file_size="1M")
#: Nothing writable but a private /tmp, which is also where it runs; no network (the default); the native
#: backend, never a container.
POLICY = isolate.Policy(write=(), cwd="/tmp", limits=LIMITS, backend="native")


def verdict(result: isolate.CompletedProcess) -> str:
    report = result.report
    if report.status in ("cpu", "timeout"):
        return "time limit exceeded"
    if report.status == "memory" or "MemoryError" in result.stderr:
        return "memory limit exceeded"
    if "pids" in report.limits_reached or "BlockingIOError" in result.stderr:
        return "process limit exceeded"
    if any(d["mechanism"] in ("network", "egress") for d in report.denied):
        return "network refused"
    if report.status != "ok":
        return f"runtime error ({report.status}, exit {report.exit_code}, signal {report.signal_name})"
    return "accepted" if result.stdout.strip() == TEST_OUTPUT else "wrong answer"


def judge(policy: isolate.Policy, source: str) -> isolate.CompletedProcess:
    return isolate.run([PYTHON, "-c", source], policy=policy, input=TEST_INPUT,
                       capture_output=True, text=True)


def main() -> int:
    policy = POLICY
    try:
        probe = judge(policy, "pass")
    except isolate.UnsupportedError:
        print("no cgroup this process may write: per-process rlimits instead (best_effort=True)")
        policy = policy.replace(best_effort=True)
        probe = judge(policy, "pass")
    print("limits enforced by:", {k: probe.report.enforced[k] for k in ("cpu_seconds", "memory", "pids")})

    wrong = 0
    for name, (source, expected) in SUBMISSIONS.items():
        result = judge(policy, source)
        got = verdict(result)
        report = result.report
        print(f"{name:14} {got:24} status={report.status} wall={report.wall_seconds:.2f}s "
              f"cpu={report.cpu_seconds:.2f}s rss={report.max_rss_bytes >> 20}M "
              f"limits_reached={report.limits_reached} denied={[d['mechanism'] for d in report.denied]}")
        wrong += got != expected
    print("all verdicts as expected" if not wrong else f"{wrong} verdicts differ from what was expected")
    return 1 if wrong else 0


if __name__ == "__main__":
    sys.exit(main())
