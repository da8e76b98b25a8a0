"""Spawn latency of ``/bin/true``: isolate's entry points and the peers, interleaved.

Two worker processes do the measuring: one small, one that has written to
every page of a 1 GiB bytearray (so a fork has 1 GiB of page tables to copy).
The coordinator hands out rounds alternately to each, one at a time, so they
never compete for the CPU; in a round a worker starts every variant once, in
an order rotated from round to round. Machine drift (other load, frequency)
thus hits every variant and both parents alike. The slow Docker variants take
part in an evenly spread subset of the rounds.

Run as ``python -m benchmarks.spawn --worker``, this module is a worker: it
reads its configuration and then one command per line on stdin, and answers
one JSON line per command.
"""

from __future__ import annotations

import json
import os
import select
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import IO, Any

from ._stats import summary_ms

TRUE = "/bin/true"
#: A start that takes longer than this is a hang: the process tree is killed and the run counts as a failure.
#: (The CLI takes about 4 s in an emulated VM; a hang is still told apart.)
TIMEOUT = 30.0
DOCKER_TIMEOUT = 60.0
#: A variant is dropped from a parent's remaining rounds once it has failed MAX_FAILURES times, or
#: MIN_FAILURES times in more than FAILURE_RATE of its runs (each hang costs TIMEOUT seconds).
MIN_FAILURES = 3
FAILURE_RATE = 0.10
MAX_FAILURES = 10
PROBES = 3


@dataclass(frozen=True)
class Variant:
    key: str
    label: str
    kind: str  # "baseline" | "isolate" | "peer"
    slow: bool = False


VARIANTS: tuple[Variant, ...] = (
    Variant("subprocess", "subprocess.run (no sandbox)", "baseline"),
    Variant("python", "python -c pass (interpreter start-up, reference)", "baseline"),
    Variant("isolate.run", "isolate.run, default policy", "isolate"),
    Variant("isolate.run/ll", "isolate.run, Landlock+seccomp+rlimits only", "isolate"),
    Variant("preexec", "subprocess + policy.preexec_fn, default policy", "isolate"),
    Variant("preexec/ll", "subprocess + preexec_fn, Landlock+seccomp+rlimits only", "isolate"),
    Variant("cli", "isolate-run CLI, default policy (whole process)", "isolate"),
    Variant("cli/ll", "isolate-run --no-namespaces (whole process)", "isolate"),
    Variant("bwrap", "bwrap --unshare-all", "peer"),
    Variant("unshare", "unshare -Urnpf --mount-proc", "peer"),
    Variant("firejail", "firejail --noprofile --net=none", "peer"),
    Variant("nsjail", "nsjail -Mo", "peer"),
    Variant("docker-run", "docker run --rm", "peer", slow=True),
    Variant("isolate-docker", "isolate Docker backend, one-shot", "isolate", slow=True),
    Variant("sandbox-exec", "isolate.Sandbox (native), exec in a kept sandbox", "isolate"),
    Variant("isolate-sandbox", "isolate.Sandbox (Docker), exec in a kept container", "isolate", slow=True),
)
BY_KEY = {v.key: v for v in VARIANTS}
PARENTS = (("small", 0), ("1GiB", 1024))


# --------------------------------------------------------------------------
# The worker


class _Worker:
    def __init__(self, config: dict[str, Any]) -> None:
        self.config = config
        self.hold: bytearray | None = None
        self.runners: dict[str, Callable[[], None]] = {}
        self.skipped: dict[str, str] = {}
        self.cleanups: list[Callable[[], None]] = []
        self.failures: dict[str, int] = {}
        self.attempts: dict[str, int] = {}
        self.probe_failures: dict[str, list[str]] = {}
        self.watchdog = _Watchdog()
        self.watchdog.start()

    def hold_memory(self, mib: int) -> None:
        if mib <= 0:
            return
        size = mib << 20
        self.hold = bytearray(size)
        page = os.sysconf("SC_PAGE_SIZE")
        self.hold[::page] = b"\x01" * (size // page)  # write one byte per page: every page is resident

    def build(self, keys: Sequence[str]) -> None:
        import isolate

        default = isolate.Policy()
        landlock_only = isolate.Policy(namespaces=False, tmpfs=(), write=())
        quiet: dict[str, Any] = {"stdin": subprocess.DEVNULL, "stdout": subprocess.DEVNULL}
        peers: dict[str, list[str]] = self.config.get("peers", {})
        cli: list[str] = self.config["cli"]
        image: str = self.config.get("image", "")

        def check(code: int, what: str) -> None:
            if code != 0:
                raise RuntimeError(f"{what} exited {code}")

        def plain() -> None:
            check(subprocess.run([TRUE], **quiet).returncode, "subprocess.run")

        def isolate_run(policy: isolate.Policy) -> Callable[[], None]:
            def go() -> None:
                check(isolate.run([TRUE], policy=policy, **quiet).returncode, "isolate.run")

            return go

        def preexec(policy: isolate.Policy) -> Callable[[], None]:
            def go() -> None:
                # As users write it: the property prepares the hook on each read.
                check(subprocess.run([TRUE], preexec_fn=policy.preexec_fn, **quiet).returncode, "preexec_fn")

            return go

        def command(argv: list[str]) -> Callable[[], None]:
            def go() -> None:
                check(subprocess.run(argv, stderr=subprocess.DEVNULL, **quiet).returncode, argv[0])

            return go

        makers: dict[str, Callable[[], Callable[[], None]]] = {
            "subprocess": lambda: plain,
            "python": lambda: command([sys.executable, "-c", "pass"]),
            "isolate.run": lambda: isolate_run(default),
            "isolate.run/ll": lambda: isolate_run(landlock_only),
            "preexec": lambda: preexec(default),
            "preexec/ll": lambda: preexec(landlock_only),
            "cli": lambda: command([*cli, "--", TRUE]),
            "cli/ll": lambda: command([*cli, "--no-namespaces", "--", TRUE]),
            "isolate-docker": lambda: self._docker_one_shot(isolate, image),
            "isolate-sandbox": lambda: self._docker_sandbox(isolate, image),
            "sandbox-exec": lambda: self._native_sandbox(isolate),
        }
        for key in peers:
            makers[key] = (lambda argv: lambda: command(argv))(list(peers[key]))
        for key in keys:
            if key not in makers:
                self.skipped[key] = "no runner for this variant"
                continue
            # Probes, which warm up too (page cache, the engine's image layers): kept if one succeeds;
            # failed probes count as failures.
            failures: list[str] = []
            runner = None
            try:
                runner = makers[key]()
                for _ in range(PROBES):
                    try:
                        self.timed(key, runner)
                    except Exception as exc:
                        failures.append(_describe(exc))
            except Exception as exc:
                failures.append(_describe(exc))
            if runner is None or len(failures) >= PROBES:
                self.skipped[key] = failures[-1] if failures else "no runner"
                continue
            self.runners[key] = runner
            self.attempts[key] = PROBES
            self.failures[key] = len(failures)
            if failures:
                self.probe_failures[key] = failures

    def _docker_one_shot(self, isolate: Any, image: str) -> Callable[[], None]:
        from isolate.backends import docker

        usable, reason = docker.available()
        if not usable:
            raise RuntimeError(reason)
        # Docker cannot offer network "none" (a container's lo is always up): "loopback" is what
        # docker run --network none gives.
        policy = isolate.Policy(backend="docker", image=image, network="loopback")

        def go() -> None:
            done = isolate.run([TRUE], policy=policy, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL)
            if done.returncode != 0:
                raise RuntimeError(f"docker backend exited {done.returncode}")

        return go

    def _docker_sandbox(self, isolate: Any, image: str) -> Callable[[], None]:
        sandbox = isolate.Sandbox(isolate.Policy(image=image, network="loopback"), backend="docker")
        sandbox.start()
        self.cleanups.append(sandbox.close)

        def go() -> None:
            done = sandbox.exec([TRUE])
            if done.returncode != 0:
                raise RuntimeError(f"Sandbox.exec exited {done.returncode}")

        return go

    def _native_sandbox(self, isolate: Any) -> Callable[[], None]:
        sandbox = isolate.Sandbox(isolate.Policy(write=()))
        sandbox.start()
        self.cleanups.append(sandbox.close)

        def go() -> None:
            done = sandbox.exec([TRUE])
            if done.returncode != 0:
                raise RuntimeError(f"Sandbox.exec exited {done.returncode}")

        return go

    def round(self, keys: Sequence[str]) -> dict[str, Any]:
        times: dict[str, float] = {}
        errors: dict[str, str] = {}
        dropped: list[str] = []
        for key in keys:
            runner = self.runners.get(key)
            if runner is None:
                continue
            self.attempts[key] = self.attempts.get(key, 0) + 1
            try:
                times[key] = self.timed(key, runner)
            except Exception as exc:
                errors[key] = _describe(exc)
                failed = self.failures[key] = self.failures.get(key, 0) + 1
                if failed >= MAX_FAILURES or (failed >= MIN_FAILURES and failed > FAILURE_RATE * self.attempts[key]):
                    del self.runners[key]
                    dropped.append(key)
        return {"t": times, "err": errors, "dropped": dropped}

    def timed(self, key: str, runner: Callable[[], None]) -> float:
        """Seconds that one run of ``runner`` took; raises when it failed or hung."""
        limit = DOCKER_TIMEOUT if BY_KEY[key].slow else TIMEOUT
        watchdog = self.watchdog
        watchdog.fired = False
        watchdog.deadline = time.monotonic() + limit
        start = time.perf_counter()
        try:
            runner()
        except Exception:
            if watchdog.fired:
                raise TimeoutError(f"hung: no exit after {limit:.0f} s; the process tree was killed") from None
            raise
        finally:
            watchdog.deadline = None
        elapsed = time.perf_counter() - start
        if watchdog.fired:
            raise TimeoutError(f"hung: no exit after {limit:.0f} s; the process tree was killed")
        return elapsed

    def close(self) -> None:
        for cleanup in self.cleanups:
            try:
                cleanup()
            except Exception as exc:
                print(f"benchmarks worker: cleanup failed: {exc}", file=sys.stderr)


class _Watchdog(threading.Thread):
    """Kills the worker's new descendants when a start hangs, without touching the timed path.

    The measured call sets ``deadline`` and clears it afterwards (two attribute
    writes); no timeout is passed to subprocess, whose waits with a timeout
    poll with sleeps and would distort what is measured.
    """

    def __init__(self) -> None:
        super().__init__(name="benchmarks-watchdog", daemon=True)
        self.deadline: float | None = None
        self.fired = False
        self.exempt: set[int] = set()

    def exempt_current_children(self) -> None:
        import psutil

        self.exempt = {p.pid for p in psutil.Process().children(recursive=True)}

    def run(self) -> None:
        import psutil

        while True:
            time.sleep(0.25)
            deadline = self.deadline
            if deadline is None or time.monotonic() < deadline:
                continue
            self.fired = True
            self.deadline = None
            try:
                family = psutil.Process().children(recursive=True)
            except psutil.Error:
                continue
            for proc in family:
                if proc.pid in self.exempt:
                    continue
                try:
                    proc.kill()  # SIGKILL from the parent namespace reaches a sandbox's init too
                except psutil.Error:
                    pass


def _describe(exc: BaseException) -> str:
    text = str(exc).splitlines()[0] if str(exc) else ""
    return f"{type(exc).__name__}: {text}"[:300]


def _rss_mib() -> float:
    with open("/proc/self/status", encoding="ascii") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return round(int(line.split()[1]) / 1024, 1)
    return 0.0


def worker_main() -> int:
    # The protocol gets its own descriptor; fd 1 goes to /dev/null so that no child can write into it.
    out: IO[str] = os.fdopen(os.dup(1), "w", buffering=1)
    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, 1)
    os.close(devnull)
    config = json.loads(sys.stdin.readline())
    os.chdir(config["cwd"])
    worker = _Worker(config)
    worker.hold_memory(int(config.get("hold_mib", 0)))
    worker.watchdog.exempt_current_children()  # none yet; Docker's helper is exempted after the build
    worker.build(config["variants"])
    worker.watchdog.exempt_current_children()
    hello = {"ready": True, "skipped": worker.skipped, "rss_mib": _rss_mib(), "probe_failures": worker.probe_failures}
    out.write(json.dumps(hello) + "\n")
    try:
        for line in sys.stdin:
            command = json.loads(line)
            if command.get("quit"):
                break
            out.write(json.dumps(worker.round(command["run"])) + "\n")
    finally:
        worker.close()
    return 0


# --------------------------------------------------------------------------
# The coordinator


class _Handle:
    def __init__(self, name: str, hold_mib: int, config: dict[str, Any]) -> None:
        self.name = name
        package_root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = dict(os.environ)
        env["PYTHONPATH"] = package_root + (os.pathsep + env["PYTHONPATH"] if env.get("PYTHONPATH") else "")
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "benchmarks.spawn", "--worker"],
            stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True, env=env, cwd=package_root,
        )  # fmt: skip
        self.send({**config, "hold_mib": hold_mib})
        hello = self.receive()
        self.skipped: dict[str, str] = hello.get("skipped", {})
        self.rss_mib: float = hello.get("rss_mib", 0.0)
        self.probe_failures: dict[str, list[str]] = hello.get("probe_failures", {})

    def send(self, message: dict[str, Any]) -> None:
        assert self.proc.stdin is not None
        self.proc.stdin.write(json.dumps(message) + "\n")
        self.proc.stdin.flush()

    def receive(self, timeout: float = 600.0) -> dict[str, Any]:
        assert self.proc.stdout is not None
        ready, _, _ = select.select([self.proc.stdout], [], [], timeout)
        if not ready:
            self.proc.kill()
            raise RuntimeError(f"the {self.name} spawn worker gave no answer in {timeout:.0f} s; it was killed")
        line = self.proc.stdout.readline()
        if not line:
            code = self.proc.wait()
            raise RuntimeError(f"the {self.name} spawn worker ended early (exit {code}); see its stderr above")
        answer: dict[str, Any] = json.loads(line)
        return answer

    def close(self) -> None:
        try:
            self.send({"quit": True})
        except (BrokenPipeError, ValueError):
            pass
        try:
            self.proc.wait(timeout=120)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def _slow_round(r: int, rounds: int, runs: int) -> bool:
    """True in exactly ``runs`` of ``rounds`` rounds, spread evenly."""
    if runs >= rounds:
        return True
    return (r * runs) // rounds != ((r + 1) * runs) // rounds


def measure(
    keys: Sequence[str],
    peers: dict[str, list[str]],
    *,
    rounds: int,
    slow_runs: int,
    workdir: str,
    cli: list[str],
    image: str,
    log: Callable[[str], None],
) -> dict[str, Any]:
    """Interleaved spawn latency of ``keys`` from both parents: per parent and variant, a summary in ms."""
    config = {"variants": list(keys), "peers": peers, "cli": cli, "image": image, "cwd": workdir}
    handles: list[_Handle] = []
    samples: dict[str, dict[str, list[float]]] = {}
    errors: dict[str, dict[str, list[str]]] = {}
    dropped: dict[str, dict[str, int]] = {}
    try:
        for name, mib in PARENTS:
            log(f"spawn: starting the {name} parent" + (f" (writing {mib} MiB)" if mib else ""))
            handles.append(_Handle(name, mib, config))
        usable = [k for k in keys if any(k not in h.skipped for h in handles)]
        fast = [k for k in usable if not BY_KEY[k].slow]
        slow = [k for k in usable if BY_KEY[k].slow]
        for h in handles:
            samples[h.name] = {k: [] for k in usable}
            errors[h.name] = {k: list(h.probe_failures.get(k, [])) for k in usable}
            dropped[h.name] = {}
        started = time.monotonic()
        for r in range(rounds):
            order = fast + (slow if _slow_round(r, rounds, slow_runs) else [])
            shift = r % len(order) if order else 0
            order = order[shift:] + order[:shift]
            for h in handles if r % 2 == 0 else reversed(handles):
                h.send({"run": order})
                answer = h.receive()
                for k, t in answer["t"].items():
                    samples[h.name][k].append(t)
                for k, e in answer["err"].items():
                    errors[h.name][k].append(e)
                for k in answer.get("dropped", []):
                    dropped[h.name][k] = r + 1
                    log(f"spawn: {k} dropped in the {h.name} parent after {len(errors[h.name][k])} failures: "
                        f"{errors[h.name][k][0]}")
            if rounds >= 10 and (r + 1) % max(1, rounds // 10) == 0:
                log(f"spawn: round {r + 1}/{rounds} ({time.monotonic() - started:.0f} s)")
    finally:
        for h in handles:
            h.close()
    result: dict[str, Any] = {"parents": {}, "rounds": rounds, "slow_runs": min(slow_runs, rounds)}
    for h in handles:
        per: dict[str, Any] = {"rss_mib": h.rss_mib, "variants": {}}
        for k in keys:
            variant = BY_KEY[k]
            entry: dict[str, Any] = {"label": variant.label, "kind": variant.kind}
            reason = h.skipped.get(k)
            if reason:
                entry["skipped"] = reason
            else:
                entry.update(summary_ms(samples[h.name][k]))
                if errors[h.name][k]:
                    entry["failures"] = len(errors[h.name][k])
                    entry["first_failure"] = errors[h.name][k][0]
                if k in dropped[h.name]:
                    entry["dropped_in_round"] = dropped[h.name][k]
            per["variants"][k] = entry
        result["parents"][h.name] = per
    return result


if __name__ == "__main__":
    if sys.argv[1:] == ["--worker"]:
        raise SystemExit(worker_main())
    print("usage: python -m benchmarks.spawn --worker (started by python -m benchmarks)", file=sys.stderr)
    raise SystemExit(2)
