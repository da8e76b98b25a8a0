"""isolate.ray across nodes: snapshots that move between the nodes of a real local cluster
(``ray.cluster_utils.Cluster``: a head and two workers, each node with a state directory of its own, so a
snapshot of one node is not seen by another unless it was shipped there).

Forks spread over the nodes and hold their parent's files; a snapshot of one node restores and starts
sandboxes on another, shipped once per node; forks on two nodes merge; the node holding a snapshot dies
before it arrived: ``SandboxLostError``, and nothing kept. A bundle damaged or made to harm is refused whole.
"""

from __future__ import annotations

import io
import os
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import NAMESPACES_WHY, python_read, ray_cluster

import isolate
from isolate.kept import bundles

ray = pytest.importorskip("ray", reason="ray is not installed: pip install '.[ray]'")
cluster_utils = pytest.importorskip("ray.cluster_utils")
import isolate.ray as iray  # noqa: E402  (after the skip: it imports ray)

pytestmark = pytest.mark.skipif(bool(NAMESPACES_WHY), reason=NAMESPACES_WHY or "")


def box_policy() -> isolate.Policy:
    return isolate.Policy(read=python_read(), write=())


def _snapshot_dirs(state: str) -> list[str]:
    where = os.path.join(state, "snapshots")
    return sorted(os.listdir(where)) if os.path.isdir(where) else []


@pytest.fixture(scope="module")
def cluster() -> Iterator[Any]:
    temp = tempfile.mkdtemp(prefix="iray-nodes-")
    # Not in Ray's temporary directory, which Ray makes writable by everyone (a store there, in a node's state
    # directory, is refused).
    kept = tempfile.mkdtemp(prefix="iray-nodes-state-")
    states = [os.path.join(kept, f"state-{i}") for i in range(3)]
    for state in states:
        os.mkdir(state, 0o700)
    c, c.workers = ray_cluster(
        {"num_cpus": 1, "temp_dir": temp, "resources": {"n0": 1}, "env_vars": {"ISOLATE_STATE_DIR": states[0]}},
        [{"num_cpus": 1, "resources": {f"n{i}": 1}, "env_vars": {"ISOLATE_STATE_DIR": states[i]}} for i in (1, 2)])
    ray.init(address=c.address, logging_level="ERROR", log_to_driver=False)
    c.wait_for_nodes()
    c.states = dict(zip([c.head_node.node_id, *(w.node_id for w in c.workers)], states, strict=True))
    alive = [states[0], states[1]]  # the head and the worker no test kills
    try:
        yield c
    finally:
        iray.shutdown()
        ray.shutdown()
        c.shutdown()
        # Every fork point and every shipped copy went with the hosts (a killed node's state aside).
        assert [_snapshot_dirs(s) for s in alive] == [[], []]
        for directory in (kept, temp):
            subprocess.run(["rm", "-rf", "--one-file-system", directory], check=False)


def _received(node_id: str) -> int:
    from isolate.ray.placement import Hosts

    return int(ray.get(Hosts.get().actor(node_id).layers_received.remote()))


def test_forks_spread_over_the_nodes_and_a_snapshot_moves_once_per_node(cluster: Any, tmp_path: Path) -> None:
    source = tmp_path / "repo"
    (source / "pkg").mkdir(parents=True)
    (source / "pkg" / "a.py").write_text("a = 1\n")
    (source / "gone.txt").write_text("deleted in the parent\n")
    for path in [source, *source.rglob("*")]:
        path.chmod(0o755 if path.is_dir() else 0o644)
    workspace = isolate.Workspace(str(source), mode="overlay")
    home = cluster.head_node.node_id
    with iray.Sandbox(box_policy(), workspace=workspace, node_id=home) as parent:
        parent.exec("echo 2 > pkg/b.py; rm gone.txt; echo kept > /tmp/t")
        # The node's copy of a shipped source is shared by the sandboxes given that source: never written.
        with pytest.raises(isolate.PolicyError, match="shipped from the caller"):
            parent.commit(on_node=True)
        before = {node: _received(node) for node in cluster.states}
        t0 = time.monotonic()
        forks = parent.fork(4)
        took = time.monotonic() - t0
        try:
            nodes = [f.node_id for f in forks]
            assert set(nodes) == set(cluster.states), nodes  # every node, the parent's too
            for fork in forks:
                assert fork.exec("cat pkg/a.py pkg/b.py /tmp/t; ls").stdout == "a = 1\n2\nkept\npkg\n"
            # Each other node fetched the fork point once, whatever number of forks it got.
            assert {n: _received(n) - before[n] for n in cluster.states} == {
                n: 0 if n == home else 1 for n in cluster.states}
            print(f"fork(4) over 3 nodes: {took * 1000:.0f} ms")
            # A snapshot of one node restores a sandbox of another, and starts one there.
            snap = parent.snapshot()
            other = next(f for f in forks if f.node_id != home)
            other.write_file("pkg/b.py", "fork's\n")
            other.restore(snap, ahead=True)
            assert other.read_file("pkg/b.py") == "2\n" and other.read_file("/tmp/t") == "kept\n"
            other.write_file("pkg/b.py", "again\n")
            other.restore(snap)  # the spare started ahead on that node, swapped in
            assert other.read_file("pkg/b.py") == "2\n" and other.read_file("/tmp/t") == "kept\n"
            with iray.Sandbox(box_policy(), snapshot=snap, node_id=other.node_id) as started:
                assert started.read_file("pkg/b.py") == "2\n" and not started.exists("gone.txt")
            with pytest.raises(isolate.PolicyError, match="snapshot"):
                iray.Sandbox.create_many(2, box_policy(), snapshot=snap)  # never dropped silently
            assert _received(other.node_id) - before[other.node_id] == 2  # the fork point, then this snapshot
            assert snap.digest is not None and snap.digest.startswith("sha256:")
            # Sandboxes started from a snapshot held by one node go there first, but do not all pile up there.
            only_home = parent.snapshot()
            started_from: list[Any] = []
            try:
                for _ in range(3):
                    started_from.append(iray.Sandbox(box_policy(), snapshot=only_home).start())
                assert started_from[0].node_id == home
                assert {b.node_id for b in started_from} != {home}, [b.node_id for b in started_from]
                assert all(b.read_file("pkg/b.py") == "2\n" for b in started_from)
            finally:
                for box in started_from:
                    box.close()
                only_home.remove()
            copies = len(_snapshot_dirs(cluster.states[other.node_id]))
            snap.remove()  # there, and its copy here
            assert len(_snapshot_dirs(cluster.states[other.node_id])) == copies - 1
        finally:
            for fork in forks:
                fork.close()
    # A pool's sandbox forks the same way: its workspace's source goes with its forks to their nodes (a fork
    # over the pool's own copy of the source would lose its files when the pool is closed).
    pool = iray.SandboxPool(box_policy(), size=1, workspace=workspace, node_id=home)
    try:
        with pool.acquire(timeout=30) as pooled:
            pooled.exec("rm gone.txt")
            (away,) = pooled.fork(1)
    finally:
        pool.close()
    try:
        assert away.node_id != home and away.exec("ls; cat pkg/a.py").stdout == "pkg\na = 1\n"
    finally:
        away.close()


def test_merge_of_forks_on_two_nodes(cluster: Any) -> None:
    with iray.Sandbox(box_policy(), node_id=cluster.head_node.node_id) as parent:
        parent.write_file("notes.txt", "one\ntwo\nthree\nfour\nfive\n")
        a, b = parent.fork(2)  # the least used nodes
        try:
            assert a.node_id != b.node_id
            a.replace_text("notes.txt", "one", "ONE")
            a.write_file("from-a.txt", "a")
            b.replace_text("notes.txt", "five", "FIVE")
            b.write_file("from-b.txt", "b")
            result = isolate.merge([b, a])  # merged on b's node (away): a's files shipped there
            assert result.clean and set(result.merged) == {"notes.txt", "from-a.txt", "from-b.txt"}
            merged = result.sandbox
            assert merged is not None and merged.node_id == b.node_id
            try:
                assert merged.read_file("notes.txt") == "ONE\ntwo\nthree\nfour\nFIVE\n"
                assert merged.read_file("from-a.txt") + merged.read_file("from-b.txt") == "ab"
            finally:
                merged.close()
                assert result.snapshot is not None
                result.snapshot.remove()
            # A conflict refused on the merging node comes back as itself, its conflicts listed.
            b.replace_text("notes.txt", "one", "uno")  # a made it ONE
            with pytest.raises(isolate.MergeConflictError) as refused:
                isolate.merge([a, b], on_conflict="refuse")
            assert [(c.path, c.kind) for c in refused.value.result.conflicts] == [("notes.txt", "text")]
        finally:
            a.close()
            b.close()


def test_a_snapshot_of_an_image_sandbox_moves_with_its_root_layer(cluster: Any, tmp_path: Path) -> None:
    """The root's changes of a sandbox of an image (its upper layer on disk) go with its snapshot to another
    node, which holds the same image: a sandbox started there has them (before: refused, "does not move
    between nodes yet")."""
    import imagekit as kit

    from isolate.image import Image, Store
    from isolate.kernel.overlay import xattr_problem

    home, away = cluster.head_node.node_id, cluster.workers[0].node_id
    why = xattr_problem(cluster.states[home], cluster.states[home])
    if why:
        pytest.skip(f"image_upper='disk' is refused here: {why}")
    kit.oci_layout(str(tmp_path / "base"), [kit.busybox_layer([{"name": "data", "type": "dir", "mode": 0o777}])],
                   ref="raysnap:1", Env=["PATH=/bin"])
    for state in (cluster.states[home], cluster.states[away]):  # each node's own store holds the image
        image = Image.load(tmp_path / "base", store=Store(os.path.join(state, "images")))
    policy = isolate.Policy(image=image.reference)
    with iray.Sandbox(policy, node_id=home, image_upper="disk") as parent:
        parent.exec("echo changed > /data/root.txt; echo ws > /workspace/ws.txt")
        snap = parent.snapshot()
        try:
            with iray.Sandbox(policy, snapshot=snap, node_id=away) as moved:
                assert moved.exec("cat /data/root.txt /workspace/ws.txt").stdout == "changed\nws\n"
        finally:
            snap.remove()


def _bundle(**members: bytes) -> tuple[bytes, str]:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for name, data in members.items():
            info = tarfile.TarInfo(name.replace("_", "."))
            info.size = len(data)
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue(), bundles.digest_of(buffer.getvalue())


def test_a_damaged_or_harmful_bundle_is_kept_whole_or_not_at_all(tmp_path: Path,
                                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ISOLATE_STATE_DIR", str(tmp_path / "state"))
    meta = b'{"kind": "tree", "root": [493, 0, 0], "id": "x", "origin": null, "areas": [], ' \
           b'"workspace": {"source": null, "target": "/workspace", "mode": "copy", "exclude": []}}'
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w") as archive:
        ok = tarfile.TarInfo("ok.txt")
        ok.size = 2
        archive.addfile(ok, io.BytesIO(b"ok"))
        device = tarfile.TarInfo("dev")
        device.type = tarfile.CHRTYPE
        device.devmajor, device.devminor = 1, 3  # /dev/null's numbers
        archive.addfile(device)
    data, digest = _bundle(snapshot_json=meta, data_tar=layer.getvalue())
    with pytest.raises(isolate.IsolationError, match="do not match their digest"):
        bundles.load(data[:-1] + b"!", digest)
    with pytest.raises(isolate.IsolationError, match="device node"):
        bundles.load(data, digest)
    assert _snapshot_dirs(str(tmp_path / "state")) == []  # the half-made snapshot was removed
    assert isolate.Snapshot.list() == []
    # A description whose root is cut short or names an owner no kernel takes: refused in one line, never an
    # IndexError or OverflowError.
    for root in (b"[493]", b"[493, -1, 0]", b"[493, 0, 4294967296]"):
        data, digest = _bundle(snapshot_json=meta.replace(b"[493, 0, 0]", root), data_tar=b"")
        with pytest.raises(isolate.IsolationError, match="its description is not one isolate writes"):
            bundles.load(data, digest)
    assert _snapshot_dirs(str(tmp_path / "state")) == []


def test_a_bundles_description_with_numbers_out_of_range_is_refused(tmp_path: Path,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    # The root's owner and mode come from the description: an owner past 32 bits raised OverflowError (no
    # IsolationError, the caller's handlers missed it), -1 left the owner unchanged for a root caller.
    monkeypatch.setenv("ISOLATE_STATE_DIR", str(tmp_path / "state"))
    layer = io.BytesIO()
    with tarfile.open(fileobj=layer, mode="w"):
        pass
    for root in ("[493, 1099511627776, 0]", "[493, 0, -1]", "[-1, 0, 0]", "[493, 0]", '["x", 0, 0]'):
        meta = (f'{{"kind": "tree", "root": {root}, "id": "x", "origin": null, "areas": [], '
                '"workspace": {"source": null, "target": "/workspace", "mode": "copy", "exclude": []}}').encode()
        data, digest = _bundle(snapshot_json=meta, data_tar=layer.getvalue())
        with pytest.raises(isolate.IsolationError, match="description is not one isolate writes"):
            bundles.load(data, digest)
    assert _snapshot_dirs(str(tmp_path / "state")) == []
    assert isolate.Snapshot.list() == []


def test_the_node_holding_a_snapshot_dies_before_it_arrived(cluster: Any) -> None:
    doomed, home = cluster.workers[1], cluster.head_node.node_id
    source = iray.Sandbox(box_policy(), node_id=doomed.node_id).start()
    target = iray.Sandbox(box_policy(), node_id=home).start()
    try:
        source.write_file("f.txt", "x")
        snap = source.snapshot()
        snap.layer_for(cluster.workers[0].node_id)  # put in the object store by its node (shipped nowhere yet)
        held = _snapshot_dirs(cluster.states[home])
        cluster.remove_node(doomed, allow_graceful=False)
        with pytest.raises(isolate.SandboxLostError) as lost:
            target.restore(snap)
        assert lost.value.node_id == doomed.node_id and doomed.node_id in str(lost.value)
        assert _snapshot_dirs(cluster.states[home]) == held  # no half layer
        assert not target.exists("f.txt")  # not restored, and the target goes on
        assert target.exec(["true"]).returncode == 0
    finally:
        source.close()
        target.close()


def test_a_node_holding_the_layers_wins_a_tie_and_one_more_then_the_least_used_does() -> None:
    from isolate.ray.placement import HOLDER_CREDIT, rank

    assert HOLDER_CREDIT == 1
    assert rank(["a", "b", "c"], {}, prefer=["c"]) == ["c", "a", "b"]
    assert rank(["a", "b", "c"], {"c": 1}, prefer=["c"])[0] == "c"
    assert rank(["a", "b", "c"], {"c": 2, "a": 1}, prefer=["c"]) == ["b", "c", "a"]
    assert rank(["a", "b"], {"a": 3, "b": 1}) == ["b", "a"]
