"""``python -m benchmarks.opensandbox [--rounds N] [--no-docker]``: from create to the first command's output.

Through the OpenSandbox SDK (``opensandbox``, synchronous client) against
``isolate-run serve`` on a free loopback port: ``SandboxSync.create`` (which
waits for the endpoints and a ping), then ``commands.run("echo hi")`` until
its output is in hand. Two variants, interleaved in the same rounds:

- ``sdk-default-limits``: the SDK's default ``resource`` (1 CPU, 2 GiB), so a
  cgroup is made for each sandbox (where the caller may; else --best-effort);
- ``sdk-no-limits``: ``resource={"gpu": "0"}`` (no CPU or memory limit, no cgroup);
- ``sdk-pooled``: the SDK's default create against a second server started with
  ``--warm 2``, whose creates of that shape take a fresh sandbox it started beforehand;
- ``sdk-from-snapshot``: ``SandboxSync.create(snapshot_id=...)`` of a snapshot of a
  sandbox that wrote a few small files (workspace and /tmp), default limits.

For reference, the same two steps through isolate's Docker backend directly
(``isolate.Sandbox(backend="docker")``, no HTTP: the server takes native
profiles only), when an engine and the test image answer. The latest figures
are kept in ``benchmarks/results/opensandbox.json``. Deleting a sandbox is not timed. Figures are printed
as JSON (median, p99, mean, min, max in milliseconds); nothing is asserted.
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import shutil
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable
from typing import Any

from ._stats import summary_ms

KEY = "bench-key-" + "0123456789abcdef"
DOCKER_IMAGE = "isolate-test:busybox"
START_SECONDS = 120


def _free_port() -> int:
    """A loopback port free now (another may take it before the server binds it: _server tries again)."""
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _listening(pid: int, port: int) -> bool:
    """Whether process ``pid`` itself listens on ``port`` (a connection could reach another's listener there)."""
    import psutil

    try:
        process = psutil.Process(pid)
        found = process.net_connections("tcp") if hasattr(process, "net_connections") else process.connections("tcp")
    except psutil.Error:
        return False
    return any(c.status == psutil.CONN_LISTEN and c.laddr and c.laddr.port == port for c in found)


def _server(best_effort: bool, *extra: str, log: Any = None) -> tuple[subprocess.Popen[bytes], str]:
    """The server on a free loopback port; its standard error goes to ``log`` (a file) when given, else is
    read only if it does not start.

    The port is picked free, then released for the server to bind: another process may take it meanwhile (a
    listener, or a loopback connection's local port), the longer the server takes to start. So the server is
    taken as started once it listens there itself, not when a connection is accepted (another's listener would
    accept it), and a server that could not bind is started again on another port (three tries)."""
    errors = log if log is not None else tempfile.TemporaryFile()
    for attempt in range(3):
        port = _free_port()
        domain = f"127.0.0.1:{port}"
        # A state directory of its own (a server holds one at a time), and its sandboxes end with it.
        state = tempfile.mkdtemp(prefix="isolate-bench-serve-")
        atexit.register(shutil.rmtree, state, True)
        cmd = [sys.executable, "-m", "isolate.cli", "serve", "--listen", domain, "--api-key", KEY,
               "--image", "bench=default", "--state-dir", state, "--end-on-exit",
               *(["--best-effort"] if best_effort else []), *extra]
        errors.seek(0)
        errors.truncate()
        proc = subprocess.Popen(cmd, stdout=subprocess.DEVNULL, stderr=errors)
        # A server that exits is reported at once; one still starting is waited for: it imports the server and
        # starts its --warm pool before it listens, 3 s on a quiet 2-core host, 12 to 14 s at a load of 12 to 16
        # (as uid 65534), which CI's (the VM's emulation beside two suites) may double. This deadline is for a
        # server that hangs.
        deadline = time.monotonic() + START_SECONDS
        while not _listening(proc.pid, port):
            exited = proc.poll()
            if exited is None and time.monotonic() < deadline:
                time.sleep(0.05)
                continue
            if exited is None:  # not left running: it ends its sandboxes (--end-on-exit) on SIGTERM
                proc.terminate()
                try:
                    proc.wait(30)
                except subprocess.TimeoutExpired:
                    proc.kill()
                    proc.wait()
            errors.seek(0)
            said = errors.read().decode(errors="replace").strip()[-500:]
            if exited is not None and "address already in use" in said and attempt < 2:
                break  # the port was taken meanwhile: another
            if log is None:
                errors.close()
            how = f"exit status {exited}" if exited is not None else f"not listening after {START_SECONDS} s"
            raise RuntimeError(f"isolate-run serve did not start ({how}): {said or 'no message'}")
        else:
            if log is None:
                errors.close()
            return proc, domain
    raise AssertionError("unreachable: the third try returns or raises")


def _limits_enforceable() -> bool:
    import isolate

    try:
        with isolate.Sandbox(isolate.Policy(limits=isolate.Limits(memory="2G", cpus=1.0))):
            return True
    except isolate.UnsupportedError:
        return False


def _sdk_round(config: Any, resource: dict[str, str] | None, snapshot_id: str | None = None) -> float:
    from opensandbox import SandboxSync

    started = time.perf_counter()
    if snapshot_id is not None:
        box = SandboxSync.create(snapshot_id=snapshot_id, connection_config=config, resource=resource)
    else:
        box = SandboxSync.create("bench", connection_config=config, resource=resource)
    try:
        out = box.commands.run("echo hi")
        elapsed = time.perf_counter() - started
        if [m.text for m in out.logs.stdout] != ["hi"]:
            raise RuntimeError(f"unexpected output {out.logs.stdout!r}")
    finally:
        box.kill()
    return elapsed


def _docker_round() -> float:
    import isolate

    started = time.perf_counter()
    box = isolate.Sandbox(isolate.Policy(image=DOCKER_IMAGE, backend="docker", write=()), backend="docker")
    box.start()
    try:
        out = box.exec(["echo", "hi"])
        elapsed = time.perf_counter() - started
        if out.stdout != "hi\n":
            raise RuntimeError(f"unexpected output {out.stdout!r}")
    finally:
        box.close()
    return elapsed


def _docker_reason() -> str | None:
    try:
        _docker_round()
    except Exception as exc:  # no engine, no image, no permission: say why, measure the rest
        return f"{type(exc).__name__}: {exc}"[:300]
    return None


def run(rounds: int, docker: bool, log: Callable[[str], None]) -> dict[str, Any]:
    import httpx
    from opensandbox.config import ConnectionConfigSync

    os.environ["OPENSANDBOX_DISABLE_METRICS"] = "1"
    enforceable = _limits_enforceable()
    proc, domain = _server(best_effort=not enforceable)
    pooled_proc, pooled_domain = _server(not enforceable, "--warm", "2")
    results: dict[str, Any] = {"rounds": rounds, "limits": "enforced (cgroup)" if enforceable
                               else "best effort (no cgroup for this user)"}
    snapshot_id = None
    try:
        def connect(where: str) -> Any:
            return ConnectionConfigSync(domain=where, api_key=KEY,
                                        transport=httpx.HTTPTransport(limits=httpx.Limits(max_connections=20)))

        config, pooled = connect(domain), connect(pooled_domain)
        _sdk_round(config, None)  # warm-up: imports, first connection
        _sdk_round(pooled, None)
        snapshot_id = _snapshot(config)
        variants: dict[str, Callable[[], float]] = {
            "sdk-default-limits": lambda: _sdk_round(config, None),
            "sdk-no-limits": lambda: _sdk_round(config, {"gpu": "0"}),
            "sdk-pooled": lambda: _sdk_round(pooled, None),
            "sdk-from-snapshot": lambda: _sdk_round(config, None, snapshot_id),
        }
        reason = _docker_reason() if docker else "left out (--no-docker)"
        if reason is None:
            variants["docker-backend-direct"] = _docker_round
        else:
            results["docker-backend-direct"] = {"skipped": reason}
        times: dict[str, list[float]] = {name: [] for name in variants}
        for i in range(rounds):
            names = list(variants)
            for name in names[i % len(names):] + names[:i % len(names)]:
                times[name].append(variants[name]())
        for name, values in times.items():
            results[name] = summary_ms(values)
            log(f"{name}: median {results[name]['median_ms']} ms")
    finally:
        if snapshot_id is not None:
            _delete_snapshot(domain, snapshot_id)
        for server in (proc, pooled_proc):
            server.terminate()
            server.wait(30)
    return results


def _snapshot(config: Any) -> str:
    """A snapshot of a sandbox that wrote a few small files (the sandbox is deleted, the snapshot kept)."""
    from opensandbox import SandboxSync

    box = SandboxSync.create("bench", connection_config=config)
    try:
        for i in range(5):
            box.files.write_file(f"/workspace/file{i}.txt", f"file {i}\n" * 100)
        box.files.write_file("/tmp/scratch.txt", "scratch\n")
        return str(box.create_snapshot(name="bench").id)
    finally:
        box.kill()


def _delete_snapshot(domain: str, snapshot_id: str) -> None:
    import httpx

    httpx.delete(f"http://{domain}/v1/snapshots/{snapshot_id}", headers={"OPEN-SANDBOX-API-KEY": KEY}, timeout=30)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m benchmarks.opensandbox", description=__doc__.split("\n\n")[0])
    parser.add_argument("--rounds", type=int, default=20, help="rounds of each variant (default 20)")
    parser.add_argument("--no-docker", action="store_true", help="leave the Docker backend out")
    args = parser.parse_args(argv)
    results = run(args.rounds, not args.no_docker, lambda m: print(m, file=sys.stderr, flush=True))
    print(json.dumps(results, indent=2))
    return 0


if __name__ == "__main__":
    sys.exit(main())
