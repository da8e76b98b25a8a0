"""The OpenSandbox Python SDK against ``isolate-run serve``: a sandbox per request, no container.

What it shows
    ``isolate-run serve`` (the ``server`` extra) started as a subprocess on a free
    port of 127.0.0.1 with an API key of our own; the OpenSandbox SDK
    (``pip install opensandbox``, the ``server-test`` extra) creates a sandbox
    through it, runs commands and reads their output, writes and reads a file,
    then kills the sandbox; the server is stopped at the end. Each sandbox is an
    ``isolate.Sandbox`` (the image name ``default`` is isolate's default policy:
    the host's system paths read-only, no network, an unprivileged uid).

    The SDK asks for 1 CPU and 2 GiB by default, which the server enforces with
    a cgroup; where this user has none it may write, the example says so and
    starts the server with ``--best-effort`` (the sandbox is then made without
    those limits, and its status says what is not enforced).

How to run
    pip install 'isolate[server]' opensandbox
    python examples/opensandbox_client.py  # Linux; root or not; isolate-run on PATH or beside python

It ends with "killed: the server holds no sandbox".
"""

from __future__ import annotations

import atexit
import json
import os
import secrets
import shutil
import socket
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from datetime import timedelta

from opensandbox import SandboxSync
from opensandbox.config import ConnectionConfigSync

import isolate


def isolate_run() -> str:
    """The isolate-run command: PATH's, else the one beside this interpreter (a venv not activated)."""
    beside = os.path.join(os.path.dirname(sys.executable), "isolate-run")
    found = shutil.which("isolate-run") or (beside if os.access(beside, os.X_OK) else None)
    if not found:
        sys.exit("isolate-run is not installed: pip install 'isolate[server]'")
    return found


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def limits_enforceable() -> bool:
    """Whether this user can enforce the SDK's default limits: a cgroup it may write."""
    try:
        with isolate.Sandbox(isolate.Policy(limits=isolate.Limits(memory="2G", cpus=1.0), backend="native")):
            return True
    except isolate.UnsupportedError:
        return False


def list_sandboxes(domain: str, key: str) -> list[dict[str, object]]:
    """The lifecycle API's GET /v1/sandboxes (plain HTTP with the API key header)."""
    request = urllib.request.Request(f"http://{domain}/v1/sandboxes", headers={"OPEN-SANDBOX-API-KEY": key})
    with urllib.request.urlopen(request, timeout=10) as response:
        return list(json.load(response)["items"])


def start_server(domain: str, key: str) -> subprocess.Popen[str]:
    # A throw-away server: a state directory of its own, and its sandboxes end with it.
    state = tempfile.mkdtemp(prefix="opensandbox-example-")
    atexit.register(shutil.rmtree, state, True)
    # The key goes in the environment: a command line is every local user's to read (ps).
    args = [isolate_run(), "serve", "--listen", domain, "--state-dir", state, "--end-on-exit"]
    if not limits_enforceable():
        print("no cgroup this user may write: serving with --best-effort (the SDK's 1 CPU / 2 GiB not enforced)")
        args.append("--best-effort")
    server = subprocess.Popen(args, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              env={**os.environ, "ISOLATE_API_KEY": key})
    assert server.stdout is not None
    print(server.stdout.readline().strip())  # "isolate-run serve: http://127.0.0.1:PORT (images: default)"
    # Wait until it answers (or give up at once if it exited); each wait is on the server process itself.
    for _ in range(300):
        try:
            list_sandboxes(domain, key)
            return server
        except (ConnectionError, urllib.error.URLError):
            try:
                server.wait(timeout=0.1)
            except subprocess.TimeoutExpired:
                continue
            break
    server.kill()
    sys.exit(f"the server did not start: {server.communicate()[0]}")


def main() -> int:
    domain, key = f"127.0.0.1:{free_port()}", secrets.token_urlsafe(24)
    server = start_server(domain, key)
    try:
        config = ConnectionConfigSync(domain=domain, api_key=key, request_timeout=timedelta(seconds=30),
                                      disable_metrics=True)
        sandbox = SandboxSync.create("default", connection_config=config, env={"GREETING": "hello"},
                                     metadata={"example": "opensandbox_client"})
        try:
            print("created", sandbox.id, "state:", sandbox.get_info().status.state)
            execution = sandbox.commands.run("echo $GREETING from $(id -un), uid $(id -u); pwd")
            stdout = [line.text for line in execution.logs.stdout]
            print("stdout:", stdout)

            sandbox.files.write_file("notes/todo.txt", "written through the SDK\n")
            read_back = sandbox.files.read_file("notes/todo.txt")
            print("read back:", read_back.strip())
            failing = sandbox.commands.run("cat /etc/shadow")
            print("cat /etc/shadow: exit", failing.error.value if failing.error else 0,
                  [line.text for line in failing.logs.stderr])
            network = sandbox.commands.run("python3 -c \"import socket; socket.create_connection(('1.1.1.1', 80))\""
                                           " 2>&1 | tail -n 1")
            print("network:", [line.text for line in network.logs.stdout])
        finally:
            sandbox.kill()
            sandbox.close()
        if not stdout or not stdout[0].startswith("hello from") or read_back != "written through the SDK\n":
            return 1
        left = list_sandboxes(domain, key)
        print("killed: the server holds no sandbox" if not left else f"still held: {left}")
        return 0 if not left else 1
    finally:
        server.terminate()
        try:
            server.communicate(timeout=20)
        except subprocess.TimeoutExpired:
            server.kill()
            server.communicate()


if __name__ == "__main__":
    sys.exit(main())
