"""Egress by name to a local package index: the sandbox reaches one name, and nothing else.

What it shows
    A "simple" package index (one tiny wheel) served by ``http.server`` in a thread
    on the host's 127.0.0.1, and a kept sandbox whose network is
    ``isolate.Egress(("index.test:PORT",), add_hosts={"index.test": "127.0.0.1"})``:
    the name ``index.test`` is allowed and mapped to the host's loopback (a local
    service: ``add_hosts`` says where the name is; the name must be allowed too).
    Inside, ``index.test`` resolves to an address of isolate's mediator, which
    relays to the host; the sandbox itself has no route out. The program fetches
    the index with urllib and installs the wheel with pip (both through the
    proxy variables isolate sets), imports it, then tries pypi.org, which is
    refused at once. Each command's ``report.egress`` lists what was reached and
    what was refused.

How to run
    python examples/egress_index.py        # Linux, isolate installed; root or not; no internet needed

It ends with "refused: pypi.org:443 (not allowed)".
"""

from __future__ import annotations

import functools
import http.server
import os
import sys
import tempfile
import threading
import zipfile
from typing import Any

import isolate

HOST = "index.test"


def make_index(root: str) -> None:
    """A PEP 503 index at root/simple/ with one pure-Python wheel, tinyhello 1.0."""
    os.makedirs(os.path.join(root, "packages"))
    wheel = os.path.join(root, "packages", "tinyhello-1.0-py3-none-any.whl")
    with zipfile.ZipFile(wheel, "w") as z:
        z.writestr("tinyhello/__init__.py", "def greet():\n    return 'hello from the local index'\n")
        z.writestr("tinyhello-1.0.dist-info/METADATA", "Metadata-Version: 2.1\nName: tinyhello\nVersion: 1.0\n")
        z.writestr("tinyhello-1.0.dist-info/WHEEL",
                   "Wheel-Version: 1.0\nGenerator: example\nRoot-Is-Purelib: true\nTag: py3-none-any\n")
        z.writestr("tinyhello-1.0.dist-info/RECORD", "")
    os.makedirs(os.path.join(root, "simple", "tinyhello"))
    with open(os.path.join(root, "simple", "tinyhello", "index.html"), "w") as handle:
        handle.write('<a href="../../packages/tinyhello-1.0-py3-none-any.whl">tinyhello-1.0-py3-none-any.whl</a>\n')


class QuietHandler(http.server.SimpleHTTPRequestHandler):
    def log_message(self, format: str, *args: object) -> None:
        pass


def show(what: str, result: Any) -> None:
    """A command's exit status and the names its report says it reached (Sandbox.exec's result)."""
    egress = result.report.egress or {}
    print(f"{what}: exit {result.returncode}; reached {[(e['host'], e['port']) for e in egress.get('allowed', [])]}")


def main() -> int:
    with tempfile.TemporaryDirectory(prefix="egress-index-") as root:
        make_index(root)
        server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), functools.partial(QuietHandler, directory=root))
        port = server.server_address[1]
        threading.Thread(target=server.serve_forever, daemon=True).start()
        index = f"http://{HOST}:{port}/simple/"
        print("index on the host at", f"http://127.0.0.1:{port}/simple/", "known inside as", index)

        egress = isolate.Egress((f"{HOST}:{port}",), add_hosts={HOST: "127.0.0.1"})
        policy = isolate.Policy(network=egress, write=())
        try:
            with isolate.Sandbox(policy) as sb:
                # 1. Plain urllib: the proxy variables (http_proxy, https_proxy) lead through the mediator.
                page = sb.exec(["python3", "-c", f"import urllib.request; print(urllib.request.urlopen("
                                f"'{index}tinyhello/', timeout=30).read().decode().strip())"])
                show("urllib", page)
                print("  ", page.stdout.strip() or page.stderr.strip().splitlines()[-1])

                # 2. pip, where the system's python3 has it: install into the workspace, then import.
                has_pip = "import importlib.util, sys; sys.exit(importlib.util.find_spec('pip') is None)"
                if sb.exec(["python3", "-c", has_pip]).returncode == 0:
                    pip = sb.exec(["python3", "-m", "pip", "install", "-q", "--no-cache-dir",
                                   "--disable-pip-version-check", "--target", "site", "--index-url", index,
                                   "--trusted-host", HOST, "tinyhello"])
                    show("pip install", pip)
                    used = sb.exec(["python3", "-c", "import tinyhello; print(tinyhello.greet())"],
                                   env={"PYTHONPATH": "site"})
                    print("  ", used.stdout.strip() or used.stderr.strip())
                    if used.returncode != 0:
                        return 1
                else:
                    print("pip: the system's python3 has no pip here; skipped")

                # 3. Any other name is refused at once (the proxy answers 403; DNS says NXDOMAIN).
                other = sb.exec(["python3", "-c", "import urllib.request\n"
                                 "urllib.request.urlopen('https://pypi.org/simple/', timeout=30)"])
                print("pypi.org: exit", other.returncode, "-", other.stderr.strip().splitlines()[-1])
                refused = (other.report.egress or {}).get("denied", [])
                for entry in refused:
                    print(f"refused: {entry.get('host') or entry.get('address')}:{entry['port']} ({entry['reason']})")
                return 0 if page.returncode == 0 and refused else 1
        finally:
            server.shutdown()
            server.server_close()


if __name__ == "__main__":
    sys.exit(main())
