"""isolate.ray: the same sandboxes on a real multi-node Ray cluster (``ray.cluster_utils.Cluster``).

Three nodes on this machine (a head and two workers, each its own raylet and
object store), one more that cannot host sandboxes (its isolate state
directory is a file); as root and as uid 65534. The sandboxes are native
isolate sandboxes on their nodes; what is tested here is the cluster's part:
placement, every method through the node's actor, refusals, a node's death,
and that nothing is left behind. (The confinement itself is the rest of the
suite's, which the VM runs on other kernels; this file runs on the host only.)
"""

from __future__ import annotations

import os
import shlex
import signal
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
from conftest import NAMESPACES_WHY, python_read, ray_cluster

import isolate
from isolate.backends.native.named import sweep_unnamed
from isolate.kernel.places import state_dir

ray = pytest.importorskip("ray", reason="ray is not installed: pip install '.[ray]'")
cluster_utils = pytest.importorskip("ray.cluster_utils")
import isolate.ray as iray  # noqa: E402  (after the skip: it imports ray)

pytestmark = pytest.mark.skipif(bool(NAMESPACES_WHY), reason=NAMESPACES_WHY or "")


def box_policy() -> isolate.Policy:
    return isolate.Policy(read=python_read(), write=())


#: The inits of every sandbox the tests started on the cluster's nodes (all on this machine).
STARTED: set[int] = set()


#: The host actors' pids: an unnamed sandbox's data directory is named after its creator's.
CREATORS: set[int] = set()


def remember(*boxes: Any) -> None:
    for box in boxes:
        init = box.processes()[0]["pid"]
        STARTED.add(init)
        CREATORS.add(psutil.Process(init).ppid())


def _alive(pids: set[int]) -> set[int]:
    alive = set()
    for pid in pids:
        try:
            if psutil.Process(pid).status() != psutil.STATUS_ZOMBIE:
                alive.add(pid)
        except psutil.NoSuchProcess:
            pass
    return alive


def _data_dirs() -> set[str]:
    """The data directories of the sandboxes the host actors made (other runs of this user may have some)."""
    where = os.path.join(state_dir(), "sandboxes")
    names = os.listdir(where) if os.path.isdir(where) else []
    return {n for n in names if any(n.startswith(f"anon-{pid}-") for pid in CREATORS)}


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    temp = tempfile.mkdtemp(prefix="iray-")
    bad_state = Path(temp) / "not-a-directory"
    bad_state.write_text("")
    # The nodes' image store: this module's own (a pull by a node lands there, not in the user's store), not in
    # Ray's temporary directory, which Ray makes writable by everyone (a store there is refused).
    images = tempfile.mkdtemp(prefix="iray-images-")
    store = {"ISOLATE_IMAGE_STORE": os.path.join(images, "store")}
    # Two workers, and a node whose isolate cannot keep any state: it refuses every sandbox, with its reason.
    c, (*workers, broken) = ray_cluster({"num_cpus": 1, "temp_dir": temp, "env_vars": store}, [
        *[{"num_cpus": 1, "resources": {"worker": 1}, "env_vars": store}] * 2,
        {"num_cpus": 1, "resources": {"broken": 1}, "env_vars": {"ISOLATE_STATE_DIR": str(bad_state)}}])
    ray.init(address=c.address, logging_level="ERROR", log_to_driver=False)
    c.wait_for_nodes()
    c.workers, c.broken = workers, broken
    try:
        yield c
    finally:
        iray.shutdown()
        ray.shutdown()
        c.shutdown()
        # Nothing of the sandboxes outlives the cluster: no process, no data directory on any node.
        deadline = time.monotonic() + 10
        while _alive(STARTED) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(STARTED), "sandboxes outlived the cluster"
        # A node killed with its actor leaves its sandboxes' directories; the next host on that machine
        # (or `isolate-run sandbox prune`) sweeps them, as this does.
        sweep_unnamed()
        assert not _data_dirs(), "sandbox data directories were left behind"
        for directory in (images, temp):
            subprocess.run(["rm", "-rf", "--one-file-system", directory], check=False)


def test_rays_address_file_is_this_runs_own(cluster: Any) -> None:
    # Not the machine's /tmp/ray: after Ray ran there as root, the uid 65534 half of run-all.sh ended in
    # PermissionError on /tmp/ray/ray_current_cluster (and a plain ray.init() may find another run's cluster).
    from ray._common.utils import get_ray_address_file

    assert os.environ.get("RAY_TMPDIR"), "Ray's files would go to the machine's shared /tmp/ray"
    address_file = get_ray_address_file(None)
    own = os.path.realpath(os.environ["RAY_TMPDIR"])
    assert os.path.realpath(address_file).startswith(own + "/") and os.path.exists(address_file), address_file
    info = os.stat(own)
    assert (info.st_uid, info.st_mode & 0o077) == (os.geteuid(), 0), own   # private to this run's caller


def test_sandboxes_spread_over_the_nodes_and_a_refusing_node_is_skipped(cluster: Any) -> None:
    boxes = iray.Sandbox.create_many(2, box_policy(), resources={"worker": 1})
    spread = iray.Sandbox.create_many(8, box_policy())  # the broken node refuses its share: the others take it
    try:
        assert {box.node_id for box in boxes} == {w.node_id for w in cluster.workers}
        assert all(box.exec(["true"]).returncode == 0 for box in boxes)
        good = {n["NodeID"] for n in ray.nodes() if n["Alive"]} - {cluster.broken.node_id}
        assert {box.node_id for box in spread} == good and len(good) == 3
        remember(*boxes, *spread)
        assert len({box.processes()[0]["pid"] for box in spread}) == 8
    finally:
        for box in boxes:
            box.close()
        for box in spread:
            box.close()


def test_a_node_that_cannot_host_refuses_with_its_reason(cluster: Any) -> None:
    with pytest.raises(isolate.IsolationError) as refused:
        iray.Sandbox(box_policy(), node_id=cluster.broken.node_id).start()
    assert cluster.broken.node_id in str(refused.value) and "not-a-directory is not a directory" in str(refused.value)
    # Without the pin, placement goes on to a node that can.
    placed = []
    for _ in range(4):
        box = iray.Sandbox(box_policy()).start()
        placed.append(box)
    try:
        assert cluster.broken.node_id not in {box.node_id for box in placed}
        remember(*placed)
    finally:
        for box in placed:
            box.close()


def test_every_sandbox_method_works_remotely(cluster: Any, tmp_path: Path) -> None:
    source = tmp_path / "repo"
    (source / "src").mkdir(parents=True)
    (source / "src" / "a.py").write_text("x = 1\n")
    (source / "skip.me").write_text("no\n")
    for path in [source, *source.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    workspace = isolate.Workspace(str(source), exclude=("skip.me",))
    with iray.Sandbox(box_policy(), workspace=workspace, resources={"worker": 1}) as sb:
        assert sb.node_id in {w.node_id for w in cluster.workers}
        remember(sb)
        assert sb.enforced
        result = sb.exec(["sh", "-c", "cat src/a.py; ls; echo err >&2; exit 3"])
        assert (result.returncode, result.stdout, result.stderr) == (3, "x = 1\nsrc\n", "err\n")
        assert result.report.status == "exited"
        assert sb.exec("cat", input="piped").stdout == "piped"
        assert sb.exec(["sleep", "5"], timeout=0.5).timed_out
        # Files: the same methods, the same exceptions; 3 MiB through the object store.
        big = os.urandom(3 << 20)
        sb.write_file("big.bin", big)
        assert sb.read_file("big.bin", text=False) == big
        sb.write_file("notes.txt", "one two")
        assert sb.replace_text("notes.txt", "two", "three") == 1
        assert sb.read_file("notes.txt") == "one three"
        sb.mkdir("d/e")
        sb.move("notes.txt", "d/e/notes.txt")
        assert sb.exists("d/e/notes.txt") and not sb.exists("notes.txt")
        assert sb.glob("**/*.txt") == ["d/e/notes.txt"]
        assert [m.path for m in sb.grep("three")] == ["d/e/notes.txt"]
        assert {e.path for e in sb.list_dir(".")} >= {"src", "d", "big.bin"}
        assert sb.stat("big.bin").size == 3 << 20
        with pytest.raises(FileNotFoundError):
            sb.read_file("missing")
        with pytest.raises(isolate.PolicyError, match="timeout"):
            sb.exec(["true"], timeout=float("nan"))
        sb.remove("d", recursive=True)
        assert not sb.exists("d")
        sb.remove("big.bin")
        # upload and download act on this machine's files.
        (tmp_path / "up").mkdir()
        (tmp_path / "up" / "f").write_text("uploaded")
        sb.upload(tmp_path / "up", "up")
        sb.download("up/f", tmp_path / "down")
        assert (tmp_path / "down").read_text() == "uploaded"
        # A streamed command, a shell and a Python that persist.
        proc = sb.spawn(["sh", "-c", "for i in 1 2 3; do echo line$i; sleep 0.1; done; read x; echo got$x"])
        lines = [proc.stdout.readline() for _ in range(3)]
        assert lines == [b"line1\n", b"line2\n", b"line3\n"]
        proc.write("42\n")
        proc.close_stdin()
        assert proc.stdout.read() == b"got42\n"
        assert proc.wait(10) == 0 and proc.returncode == 0
        proc.close()
        slow = sb.spawn(["sleep", "30"])
        with pytest.raises(subprocess.TimeoutExpired):
            slow.wait(0.3)
        slow.kill()
        assert slow.wait(10) != 0
        slow.close()
        shell = sb.shell()
        shell.run("cd src && export V=7")
        assert shell.run("pwd; echo $V")[0].split() == ["/workspace/src", "7"]
        python = sb.python()
        python.run("n = 20")
        assert python.run("n * 2").value == "40"
        # A snapshot, a fork (placed as a new sandbox is: a node with the resources asked for) and a restore.
        sb.write_file("state.txt", "before")
        snap = sb.snapshot()
        (fork,) = sb.fork(1)
        try:
            remember(fork)
            assert fork.node_id in {w.node_id for w in cluster.workers} and fork.read_file("state.txt") == "before"
            fork.write_file("state.txt", "fork's")
        finally:
            fork.close()
        sb.write_file("state.txt", "after")
        sb.restore(snap, ahead=True)  # the next restore to it started on the node
        assert sb.read_file("state.txt") == "before"
        sb.write_file("state.txt", "again")
        sb.restore(snap)  # the spare swapped in
        assert sb.read_file("state.txt") == "before"
        snap.remove()
        with pytest.raises(isolate.IsolationError):
            snap.remove()  # gone from the node
        sb.remove("state.txt")
        with pytest.raises(isolate.UnsupportedError, match="processes"):
            sb.fork(1, processes=True)
        # pause and resume, the processes on the node.
        assert sb.pause() in ("cgroup-freezer", "sigstop")
        sb.resume()
        assert sb.processes()[0]["name"] == "isolate-init"
        # diff, and commit to this machine (the source) and on the node.
        sb.write_file("src/new.py", "y = 2\n")
        assert set(sb.diff().added) == {"src/new.py", "up", "up/f"}
        changes = sb.commit()
        assert "src/new.py" in changes.added and (source / "src" / "new.py").read_text() == "y = 2\n"
        assert (source / "skip.me").exists() and not sb.exists("skip.me")  # excluded stays out
        node_dir = tempfile.mkdtemp(dir=tmp_path)
        os.chmod(node_dir, 0o755)
        assert "src/new.py" in sb.commit(node_dir, on_node=True).added  # the same machine here
    with pytest.raises(isolate.IsolationError, match="not running"):
        sb.exec(["true"])


def test_a_pool_over_the_cluster_and_a_node_that_dies(cluster: Any) -> None:
    doomed = cluster.workers[1]
    pool = iray.SandboxPool(box_policy(), size=3, resources={"worker": 1})
    try:
        assert sorted(pool.nodes) == sorted(w.node_id for w in cluster.workers)
        boxes = pool.acquire_many(2)
        assert {b.node_id for b in boxes} == set(pool.nodes)
        victim = next(b for b in boxes if b.node_id == doomed.node_id)
        survivor = next(b for b in boxes if b.node_id != doomed.node_id)
        inits = {p["pid"] for p in victim.processes()}
        remember(*boxes)
        raised: list[BaseException] = []
        started = threading.Event()

        def long_exec() -> None:
            started.set()
            try:
                victim.exec(["sleep", "60"])
            except BaseException as exc:
                raised.append(exc)

        thread = threading.Thread(target=long_exec)
        thread.start()
        started.wait()
        time.sleep(0.5)
        t0 = time.monotonic()
        cluster.remove_node(doomed, allow_graceful=False)
        thread.join(30)
        assert raised and isinstance(raised[0], isolate.SandboxLostError), raised
        assert time.monotonic() - t0 <= 5.0, "the loss was named too late"
        assert raised[0].node_id == doomed.node_id and doomed.node_id in str(raised[0])
        with pytest.raises(isolate.SandboxLostError):
            victim.read_file("x")
        victim.close()  # quietly
        # The node's sandboxes died with its actor: no init left of them.
        deadline = time.monotonic() + 10
        while any(psutil.pid_exists(pid) for pid in inits) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not any(psutil.pid_exists(pid) for pid in inits)
        # The pool goes on with the survivor, which takes the whole size.
        more = [pool.acquire(timeout=30) for _ in range(3)]
        assert {b.node_id for b in more} == {survivor.node_id}
        assert pool.nodes == [survivor.node_id]
        for box in [*more, survivor]:
            box.close()
        deadline = time.monotonic() + 30
        while pool.stats["warm"] < 3 and time.monotonic() < deadline:
            time.sleep(0.1)
        assert pool.stats == {"warm": 3, "in_use": 0, "starting": 0}
    finally:
        pool.close()


def test_a_clients_sandboxes_end_with_the_client(cluster: Any) -> None:
    script = (
        "import ray, isolate, isolate.ray, sys\n"
        f"ray.init(address={cluster.address!r}, logging_level='ERROR', log_to_driver=False)\n"
        f"sb = isolate.ray.Sandbox(isolate.Policy(read={python_read()!r}, write=()), resources={{'worker': 1}})\n"
        "sb.start(); print(sb.processes()[0]['pid'], flush=True); sys.stdin.read()\n"
    )
    client = subprocess.Popen([sys.executable, "-c", script], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True, start_new_session=True)
    try:
        assert client.stdout is not None
        init = int(client.stdout.readline())
        assert psutil.pid_exists(init)
    finally:
        os.killpg(client.pid, signal.SIGKILL)
        client.wait()
    deadline = time.monotonic() + 30
    while psutil.pid_exists(init) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not psutil.pid_exists(init), "the sandbox outlived its client"


def test_bad_input_is_refused_before_anything_starts(cluster: Any) -> None:
    for kwargs, match in (({"name": "x"}, "unnamed"), ({"node_id": ""}, "node_id"),
                          ({"resources": {"worker": -1}}, "resources"), ({"workspace_on": "moon"}, "workspace_on")):
        with pytest.raises(isolate.PolicyError, match=match):
            iray.Sandbox(box_policy(), **kwargs)
    with pytest.raises(isolate.PolicyError, match="empty workspaces"):
        iray.Sandbox.create_many(2, box_policy(), workspace=isolate.Workspace())  # never dropped silently
    with pytest.raises(isolate.UnsupportedError, match="no alive node"):
        iray.Sandbox(box_policy(), resources={"gpu-that-is-not-there": 1}).start()
    with pytest.raises(isolate.PolicyError, match="size"):
        iray.SandboxPool(box_policy(), size=-1)


SPREAD_OVER_NODES = '''
import os, re
from opensandbox import SandboxSync
from opensandbox.config import ConnectionConfigSync

config = ConnectionConfigSync(domain=os.environ["OPEN_SANDBOX_DOMAIN"], api_key=os.environ["OPEN_SANDBOX_API_KEY"])
boxes = [SandboxSync.create("ubuntu", connection_config=config) for _ in range(3)]
try:
    for box in boxes:
        said = box.commands.run("echo hi from $(hostname)").logs.stdout[0].text
        print(said.split()[0], re.search("on Ray node ([0-9a-f]+)", box.get_info().status.message)[1])
finally:
    for box in boxes:
        box.destroy()
'''


# A Python code context in each sandbox (the code-interpreter SDK): the node of each drives its interpreter.
CODE_ON_NODES = '''
import os, re
from code_interpreter import CodeInterpreterSync
from code_interpreter.models.code import SupportedLanguage
from opensandbox import SandboxSync
from opensandbox.config import ConnectionConfigSync

config = ConnectionConfigSync(domain=os.environ["OPEN_SANDBOX_DOMAIN"], api_key=os.environ["OPEN_SANDBOX_API_KEY"])
boxes = [SandboxSync.create("ubuntu", connection_config=config) for _ in range(3)]
try:
    for box in boxes:
        codes = CodeInterpreterSync.create(sandbox=box, skip_health_check=True).codes
        context = codes.create_context(SupportedLanguage.PYTHON)
        codes.run("x = 6", context=context)  # the namespace stays between cells
        run = codes.run("print('cell', flush=True)\\nx * 7", context=context)
        failed = codes.run("1 / 0", context=context).error
        node = re.search("on Ray node ([0-9a-f]+)", box.get_info().status.message)[1]
        print(node, [m.text.strip() for m in run.logs.stdout], [r.text for r in run.result], failed.name)
finally:
    for box in boxes:
        box.destroy()
'''


def test_the_opensandbox_server_over_the_cluster(cluster: Any) -> None:
    """`isolate-run serve --ray ADDRESS`: the SDK's hello world, unchanged, sandboxes on several nodes, and code
    contexts in sandboxes of nodes other than the server's."""
    pytest.importorskip("starlette", reason="the server extra is not installed: pip install 'isolate[server]'")
    pytest.importorskip("opensandbox", reason="the SDK is not installed: pip install 'isolate[server-test]'")
    import test_server as base

    extra = () if base.limits_enforceable() else ("--best-effort",)
    server = base.Server("--ray", cluster.address, *extra)
    try:
        assert base.run_example(server, base.sdk_readme(base.HELLO_ASYNC, server)) == "Hello Sandbox!\n"
        lines = base.run_example(server, SPREAD_OVER_NODES).split()
        said, nodes = lines[0::2], set(lines[1::2])
        assert said == ["hi"] * 3
        alive = {n["NodeID"] for n in ray.nodes() if n["Alive"]}
        assert len(nodes) >= 2 and nodes <= alive - {cluster.broken.node_id}
        pytest.importorskip("code_interpreter", reason="the code-interpreter SDK is missing: pip install "
                            "'isolate[server-test]'")
        ran = [line.split(" ", 1) for line in base.run_example(server, CODE_ON_NODES).splitlines()]
        assert [said for _, said in ran] == ["['cell'] ['42'] ZeroDivisionError"] * 3
        workers = {worker.node_id for worker in cluster.workers}
        assert {node for node, _ in ran} & workers, "no context ran on a worker node"
        assert server.call("GET", "/v1/sandboxes")[1]["items"] == []
        left = _snapshots_through_the_server(server)
    finally:
        server.stop()
    with pytest.raises(isolate.IsolationError):  # the server's end removed it from its node
        isolate.Snapshot.get(left)
    server = base.Server("--ray", cluster.address, "--profile", "default", *extra)  # any image reference
    try:
        _image_sandbox_on_a_node(server)
    finally:
        server.stop()


def _snapshots_through_the_server(server: Any) -> str:
    """A snapshot through the server's API is taken on its sandbox's node, and sandboxes created from it (on
    the node that holds it, or another that fetches it) have its files (before: refused, 400 UNSUPPORTED, by a
    server over --ray). Returns the id of one left for the server's end to remove."""
    import test_server as base

    source = base._create(server, timeout=120)["id"]
    base.run_command(server, source, "echo kept > /workspace/note")
    status, snap = server.call("POST", f"/v1/sandboxes/{source}/snapshots", {"name": "moved"})
    assert status == 202, snap
    assert server.call("GET", f"/v1/snapshots/{snap['id']}")[1]["name"] == "moved"
    made = []
    for _ in range(2):
        status, body = server.call("POST", "/v1/sandboxes", {"snapshotId": snap["id"], "timeout": 120})
        assert status == 202, body
        made.append(body["id"])
        assert base.run_command(server, body["id"], "cat /workspace/note").strip() == "kept"
    assert server.call("DELETE", f"/v1/snapshots/{snap['id']}")[0] == 204
    assert server.call("GET", f"/v1/snapshots/{snap['id']}")[0] == 404
    status, left = server.call("POST", f"/v1/sandboxes/{source}/snapshots", {})
    assert status == 202, left
    for sandbox_id in [source, *made]:
        assert server.call("DELETE", f"/v1/sandboxes/{sandbox_id}")[0] == 204
    return str(left["id"])


# A web app inside the sandbox: a page that sets a cookie for the whole site, and a POST answered with the
# sha256 of its body (a large body crosses the relay both ways).
WEB_APP = r"""
import hashlib, http.server
class App(http.server.BaseHTTPRequestHandler):
    def answer(self, out):
        self.send_response(200)
        self.send_header("Content-Length", str(len(out)))
        self.send_header("Set-Cookie", "seen=1; Path=/; Domain=example.org")
        self.send_header("Clear-Site-Data", '"*"')
        self.end_headers()
        self.wfile.write(out)
    def do_GET(self):
        self.answer(b"page " + self.path.encode() + b" from " + open("/etc/hostname", "rb").read().strip())
    def do_POST(self):
        body = self.rfile.read(int(self.headers["Content-Length"]))
        self.answer(hashlib.sha256(body).hexdigest().encode() * 4000)
    def log_message(self, *args):
        pass
http.server.HTTPServer(("127.0.0.1", 8000), App).serve_forever()
"""


def test_a_sandboxs_own_port_on_another_node_through_the_server(cluster: Any) -> None:
    """`serve --ray`: a web app in a sandbox on a worker node is reached through the server's port route (the
    node's host relays the bytes over the direct route), with the port route's token and origin isolation."""
    pytest.importorskip("starlette", reason="the server extra is not installed: pip install 'isolate[server]'")
    httpx = pytest.importorskip("httpx", reason="httpx is not installed: pip install 'isolate[server-test]'")
    import hashlib

    import test_server as base

    extra = () if base.limits_enforceable() else ("--best-effort",)
    server = base.Server("--ray", cluster.address, *extra)
    workers = {worker.node_id for worker in cluster.workers}
    try:
        made, sandbox_id = [], None
        while sandbox_id is None and len(made) < 4:  # placement spreads: one of the first few is on a worker
            status, body = server.call("POST", "/v1/sandboxes", {"image": {"uri": "ubuntu"}, "timeout": 120,
                                                                 "networkPolicy": {"defaultAction": "deny"}})
            assert status == 202, body
            made.append(body["id"])
            message = server.call("GET", f"/v1/sandboxes/{body['id']}")[1]["status"]["message"]
            if message.rsplit("on Ray node ", 1)[-1] in workers:
                sandbox_id = body["id"]
        assert sandbox_id is not None, "no sandbox was placed on a worker node"
        prefix, headers = base._endpoint(server, sandbox_id)
        status, answer = server.call("POST", prefix + "/command", {"command": "python3 -c " + shlex.quote(WEB_APP),
                                                                   "background": True}, key=None, headers=headers)
        assert status == 200, answer
        status, body = server.call("GET", f"/v1/sandboxes/{sandbox_id}/endpoints/8000")
        assert status == 200, body
        url, token = f"http://{body['endpoint']}", body["headers"]
        deadline = time.monotonic() + 20
        while True:
            r = httpx.get(url + "/index.html?x=1", headers=token, timeout=30)
            if r.status_code != 502 or time.monotonic() > deadline:
                break
            time.sleep(0.05)
        hostname = base.run_command(server, sandbox_id, "cat /etc/hostname").strip()
        assert (r.status_code, r.text) == (200, f"page /index.html?x=1 from {hostname}"), r.text
        # The port route's origin isolation holds for a remote app as for a local one.
        assert r.headers["content-security-policy"].startswith("sandbox ")
        assert r.headers["set-cookie"] == f"seen=1; Path=/sandboxes/{sandbox_id}/port/8000"
        assert "clear-site-data" not in r.headers
        big = os.urandom(3 << 20)
        r = httpx.post(url + "/", content=big, headers=token, timeout=60)
        assert (r.status_code, r.text) == (200, hashlib.sha256(big).hexdigest() * 4000)
        # A wrong token, another port's, or none: refused before anything reaches the node.
        assert httpx.get(url + "/", headers={"OpenSandbox-Secure-Access": "0" * 64}).status_code == 401
        other = server.call("GET", f"/v1/sandboxes/{sandbox_id}/endpoints/8001")[1]
        assert httpx.get(url + "/", headers=other["headers"]).status_code == 401
        assert httpx.get(url + "/").status_code == 401
        # A port nothing listens on, on that node: named as on one machine.
        r = httpx.get(f"http://{other['endpoint']}/", headers=other["headers"])
        assert (r.status_code, r.json()["code"]) == (502, "PORT_NOT_LISTENING"), r.text
        for made_id in made:
            server.call("DELETE", f"/v1/sandboxes/{made_id}")
        assert httpx.get(url + "/", headers=token).status_code == 401  # gone with its sandbox
    finally:
        server.stop()


def _image_sandbox_on_a_node(server: Any) -> None:
    """An image of a registry that asks for a login: the node the sandbox is placed on pulls it with the
    create's image.auth (before, serve --ray refused every image reference)."""
    import shutil

    import imagekit as kit
    import test_server as base
    from test_server_images import PASSWORD, USER, _bcrypt

    registry, skopeo = shutil.which("docker-registry"), shutil.which("skopeo")
    if registry is None or skopeo is None:
        return  # the images suites say why (apt-get install docker-registry skopeo)
    tmp = Path(tempfile.mkdtemp(prefix="iray-registry-"))
    try:
        (tmp / "htpasswd").write_text(f"{USER}:{_bcrypt(PASSWORD)}\n")
        with kit.loopback_registry(str(tmp), registry, htpasswd=str(tmp / "htpasswd")) as address:
            kit.oci_layout(str(tmp / "busybox"), [kit.busybox_layer()], ref="1", Env=["PATH=/bin"])
            kit.push(skopeo, f"{tmp / 'busybox'}:1", f"{address}/tests/busybox:1", str(tmp),
                     ["--dest-creds", f"{USER}:{PASSWORD}"])
            image = {"uri": f"{address}/tests/busybox:1"}
            status, body = server.call("POST", "/v1/sandboxes", {"image": image, "timeout": 120,
                                                                 "entrypoint": ["tail", "-f", "/dev/null"],
                                                                 "resourceLimits": {}})
            assert status == 400 and body["code"] == "IMAGE_PULL_FAILED", body  # no login: the node says why
            status, body = server.call("POST", "/v1/sandboxes", {
                "image": {**image, "auth": {"username": USER, "password": PASSWORD}}, "timeout": 120,
                "entrypoint": ["tail", "-f", "/dev/null"], "resourceLimits": {}})
            assert status == 202, body
            sandbox_id = body["id"]
            try:
                said = base.run_command(server, sandbox_id, "cat /etc/os-release; test -e /bin/busybox && echo busybox")
                assert said.split() == ["NAME=busybox-scratch", "busybox"]
            finally:
                server.call("DELETE", f"/v1/sandboxes/{sandbox_id}")
    finally:
        shutil.rmtree(tmp, ignore_errors=True)
