"""``python -m benchmarks.code_contexts [--rounds N] [--cells M]``: the server's code contexts, per language.

For each language whose toolchain this host has (python, java, typescript,
javascript, go), the same context code (``isolate.server.code.CodeContext``)
runs its driver two ways, interleaved in the same rounds:

- ``sandboxed``: inside a kept ``isolate.Sandbox`` (the default policy), as
  ``isolate-run serve`` runs it;
- ``host``: the same driver, the same protocol, started by ``subprocess`` on
  the host with no sandbox: what the language's own start costs anyway.

Figures: ``start`` (the context made and its first cell answered: what a
client waits for its first result), and ``cell`` (a trivial cell in a warm
context; for go a whole build and run). Printed as JSON (milliseconds, with
the sandboxed/host ratio of the medians), the latest kept in
``benchmarks/results/code_contexts.json``; nothing is asserted.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
from collections.abc import Callable, Mapping, Sequence
from typing import Any

from ._stats import summary_ms

#: A trivial cell per language, and the tool its context needs on this host.
CELLS = {
    "python": ("python3", "1 + 1"),
    "java": ("java", "1 + 1"),
    "typescript": ("node", "const n: number = 1; n + 1"),
    "javascript": ("node", "1 + 1"),
    "go": ("go", "package main\nfunc main() {}"),
}


#: The host's run gets the sandbox's environment: the same PATH, so the same python3 and node (not a
#: version manager's shims), and a home of its own.
HOST_ENV = {"PATH": "/usr/local/sbin:/usr/local/bin:/usr/sbin:/usr/bin:/sbin:/bin", "LANG": "C.UTF-8",
            "HOME": os.environ.get("HOME", "/root")}


class _HostProcess:
    """What a code context uses of a sandbox's process, for a process started on the host."""

    def __init__(self, argv: Sequence[str], env: Mapping[str, str], fd3: int | None, stdin: int | None) -> None:
        keep = (fd3, 3) if fd3 is not None else ()

        def descriptor_3() -> None:
            if fd3 is not None:
                os.dup2(fd3, 3)

        self._popen = subprocess.Popen(list(argv), env={**HOST_ENV, **env},
                                       stdin=subprocess.PIPE if stdin is None else stdin,
                                       stdout=subprocess.PIPE, stderr=subprocess.PIPE, pass_fds=keep,
                                       preexec_fn=descriptor_3, start_new_session=True)
        assert self._popen.stdout and self._popen.stderr
        self.stdout_fd, self.stderr_fd = self._popen.stdout.fileno(), self._popen.stderr.fileno()

    def write(self, data: str | bytes) -> None:
        assert self._popen.stdin
        self._popen.stdin.write(data.encode() if isinstance(data, str) else data)
        self._popen.stdin.flush()

    def close_stdin(self) -> None:
        assert self._popen.stdin
        self._popen.stdin.close()

    def wait(self, timeout: float | None = None) -> int:
        return self._popen.wait(timeout)

    def poll(self) -> int | None:
        return self._popen.poll()

    def signal(self, sig: int, descendants: bool = False) -> None:
        os.killpg(self._popen.pid, sig) if descendants else self._popen.send_signal(sig)

    def kill(self) -> None:
        try:
            os.killpg(self._popen.pid, 9)
        except ProcessLookupError:
            pass

    def close(self) -> None:
        self.kill()
        self._popen.wait()
        for stream in (self._popen.stdin, self._popen.stdout, self._popen.stderr):
            if stream is not None:
                stream.close()


class _Host:
    """What a code context uses of a sandbox (spawn, exec), on the host (the benchmark has no bash context,
    the one that would want a shell)."""

    def spawn(self, argv: Sequence[str], env: Mapping[str, str] | None = None,
              fd3: int | None = None, stdin: int | None = None) -> _HostProcess:
        return _HostProcess(argv, env or {}, fd3, stdin)

    def exec(self, argv: Sequence[str]) -> subprocess.CompletedProcess[bytes]:
        return subprocess.run(list(argv), capture_output=True, env=HOST_ENV)


def _answer(context: Any, code: str) -> None:
    done: list[Any] = []
    context.run(code, lambda kind, value: done.append(value) if kind == "done" else None)
    if not done or done[0]["error"] is not None:
        raise RuntimeError(f"{context.language}: {code!r} gave {done}")


def run(rounds: int, cells: int, log: Callable[[str], None], languages: Sequence[str] = tuple(CELLS)) -> dict[str, Any]:
    import isolate
    from isolate.server.code import CodeContext

    results: dict[str, Any] = {"rounds": rounds, "cells": cells}
    with isolate.Sandbox() as box:
        places: dict[str, Any] = {"sandboxed": box, "host": _Host()}
        for language in languages:
            tool, code = CELLS[language]
            if shutil.which(tool) is None:
                log(f"{language}: no {tool} on this host, skipped")
                continue
            starts: dict[str, list[float]] = {name: [] for name in places}
            runs: dict[str, list[float]] = {name: [] for name in places}
            for i in range(rounds):
                names = list(places)
                for name in names[i % 2:] + names[:i % 2]:
                    started = time.perf_counter()
                    context = CodeContext(places[name], language)
                    try:
                        _answer(context, code)
                        starts[name].append(time.perf_counter() - started)
                        if i == 0:  # the warm cells, in the first round's contexts
                            for _ in range(cells if language != "go" else max(1, cells // 10)):
                                started = time.perf_counter()
                                _answer(context, code)
                                runs[name].append(time.perf_counter() - started)
                    finally:
                        context.close()
            figures: dict[str, Any] = {}
            for what, samples in (("start", starts), ("cell", runs)):
                for name in places:
                    figures[f"{what}-{name}"] = summary_ms(samples[name])
                figures[f"{what}-ratio"] = round(figures[f"{what}-sandboxed"]["median_ms"]
                                                 / figures[f"{what}-host"]["median_ms"], 2)
            results[language] = figures
            log(f"{language}: start {figures['start-sandboxed']['median_ms']} ms sandboxed, "
                f"{figures['start-host']['median_ms']} ms on the host (x{figures['start-ratio']}); "
                f"cell {figures['cell-sandboxed']['median_ms']} ms (x{figures['cell-ratio']})")
    return results


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.code_contexts",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=5, help="contexts made per language and place (default 5)")
    parser.add_argument("--cells", type=int, default=50, help="warm cells per language and place (default 50; "
                        "go a tenth of it)")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.cells < 1:
        parser.error("--rounds and --cells must be at least 1")
    results = run(args.rounds, args.cells, lambda m: print(m, file=sys.stderr, flush=True))
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
