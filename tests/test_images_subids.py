"""An image's ``User`` for a regular caller: its subordinate ids (/etc/subuid) mapped through newuidmap, or one uid.

The caller with a range is a system user every Debian has (irc, uid 39: newuidmap wants the caller's name), run
by the root suite through setpriv with a line of its own added to /etc/subuid and /etc/subgid and removed after,
under a lock. The parser of those files is tested on text.
"""

from __future__ import annotations

import contextlib
import fcntl
import json
import os
import shutil
import subprocess
import sys
import tempfile
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import imagekit as kit
import pytest
from conftest import NAMESPACES_WHY, ROOT

from isolate.kernel import subids

CALLER = 39  # irc (Debian's base-passwd)
LINE = f"{CALLER}:300000:65536\n"
LOCK = "/run/lock/isolate-test-subids.lock"


def test_malformed_empty_huge_and_overlapping_lines_are_skipped() -> None:
    text = "\n".join([
        "1000", "1000:x:10", "1000:5:", "1000:-5:10", "1000:+5:10", "1000:\uff15:10",  # malformed, not ASCII digits
        "1000: 100000:10", " 1000:100000:10",  # spaces: the helpers may read them otherwise
        "1000:100000:0",  # no id at all
        "1000:0:65536",  # the host's uid 0
        "1000:4294967290:10",  # past the kernel's last id
        "1000:99999999999:1",  # past 32 bits
        "1000:900:200",  # holds the caller's own uid (mapped as 0 inside)
        "alice:200000:99999999",  # the first good one, cut to MAX_COUNT
        "1000:300000:65536",
    ])
    assert subids.parse(text, 1000, "alice", 1000) == subids.Range(200000, subids.MAX_COUNT)
    assert subids.parse(text, 1000, None, 1000) == subids.Range(300000, 65536)
    assert subids.parse(text, 1001, "bob", 1001) is None
    assert subids.parse("1000:1:65536\n", 1000, None, 70000) == subids.Range(1, 65536)
    assert subids.find(0, 0) == "root writes its maps itself"


@contextlib.contextmanager
def _no_subordinate_line() -> Iterator[None]:
    """The block run with no range for uid 39, under the lock (another run's _subordinate_line waits meanwhile)."""
    os.makedirs(os.path.dirname(LOCK), exist_ok=True)
    with open(LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        with open(subids.SUBUID) if os.path.exists(subids.SUBUID) else contextlib.nullcontext() as handle:
            if handle is not None and any(line.split(":")[0] in ("irc", str(CALLER)) for line in handle):
                pytest.skip("this host gives uid 39 a subordinate range")
        yield


@contextlib.contextmanager
def _subordinate_line() -> Iterator[None]:
    """LINE in /etc/subuid and /etc/subgid while the block runs; the files as they were after (other lines kept)."""
    os.makedirs(os.path.dirname(LOCK), exist_ok=True)
    with open(LOCK, "a") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        made = [path for path in (subids.SUBUID, subids.SUBGID) if not os.path.exists(path)]
        try:
            for path in (subids.SUBUID, subids.SUBGID):
                with open(path, "a") as handle:
                    handle.write(LINE)
            yield
        finally:
            for path in (subids.SUBUID, subids.SUBGID):
                if path in made:
                    os.unlink(path)
                    continue
                with open(path, "r+") as handle:
                    kept = [line for line in handle.readlines() if line != LINE]
                    handle.seek(0)
                    handle.truncate()
                    handle.writelines(kept)


_SCRIPT = """
import json, sys, isolate
from isolate.image import Image, Store
from isolate.kernel import subids
if len(sys.argv) > 3:
    subids.HELPER_DIRS = (sys.argv[3],)
from isolate.cli import doctor
doctor_said = doctor._subids()
policy = isolate.Policy(image="owned:1", backend="native")
try:
    Image.load(sys.argv[1], store=Store(sys.argv[2]))
    result = isolate.run(["sh", "-c", "id -u; id -g; stat -c %u /srv/owned"], policy=policy, capture_output=True,
                         text=True, timeout=60)
except isolate.IsolationError as error:
    print(json.dumps({"rc": 125, "out": "", "err": str(error), "report": {}, "doctor": doctor_said}))
    sys.exit()
with isolate.Sandbox(policy, image_upper="tmpfs") as box:
    kept = box.exec(["id", "-u"]).stdout
disk = ""
try:
    with isolate.Sandbox(policy, image_upper="disk") as box:
        disk = box.exec(["id", "-u"]).stdout
except isolate.IsolationError as error:
    disk = str(error)
print(json.dumps({"rc": result.returncode, "out": result.stdout, "err": result.stderr, "disk": disk, "kept": kept,
                  "doctor": doctor_said, "report": {"enforced": result.report.enforced}}))
"""


def _layout(directory: str, user: str) -> str:
    extra = kit.layer([{"name": "etc/passwd", "data": b"root:x:0:0::/:/bin/sh\nwww-data:x:33:33::/:/bin/sh\n"},
                       {"name": "srv", "type": "dir"}, {"name": "srv/owned", "data": b"x\n", "pax": {"uid": "33"}}])
    path = os.path.join(directory, "layout")
    kit.oci_layout(path, [kit.busybox_layer(), extra], ref="owned:1", User=user, Env=["PATH=/bin"])
    return path


def _run_as_caller(user: str = "www-data", helpers: str | None = None,
                   owners: str | None = "subids") -> dict[str, Any]:
    work = tempfile.mkdtemp(prefix="isolate-subids-")
    try:
        os.chmod(work, 0o755)
        layout = _layout(work, user)
        store = os.path.join(work, "store")
        state = os.path.join(work, "state")
        for path in (store, state):
            os.mkdir(path, 0o700)
            os.chown(path, CALLER, CALLER)
        if helpers:
            for name in ("newuidmap", "newgidmap"):  # set-user-id root, as found, but they refuse every range
                shutil.copy("/bin/false", os.path.join(helpers, name))
                os.chmod(os.path.join(helpers, name), 0o4755)
        command = ["setpriv", f"--reuid={CALLER}", f"--regid={CALLER}", "--clear-groups", sys.executable, "-c",
                   _SCRIPT, layout, store, *([helpers] if helpers else [])]
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8", "ISOLATE_IMAGE_STORE": store,
               "ISOLATE_STATE_DIR": state, **({"ISOLATE_IMAGE_OWNERS": owners} if owners else {})}
        done = subprocess.run(command, capture_output=True, text=True, timeout=120, cwd="/tmp", env=env)
        assert done.returncode == 0, done.stderr
        result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
        return result
    finally:
        subprocess.run(["rm", "-rf", "--one-file-system", work], check=False)


needs_root = pytest.mark.skipif(not ROOT or bool(NAMESPACES_WHY) or not os.path.exists("/bin/busybox")
                                or subids.helper("newuidmap") is None or shutil.which("setpriv") is None,
                                reason="root (to add a subordinate range for uid 39), namespaces, busybox-static, "
                                "newuidmap (apt-get install uidmap) and setpriv")


@needs_root
@pytest.mark.parametrize("owners", [None, "subids"])
def test_a_caller_with_a_range_runs_the_images_user_through_newuidmap(owners: str | None) -> None:
    with _subordinate_line():
        result = _run_as_caller(owners=owners)
    assert result["rc"] == 0, result["err"]
    uid, gid, owner = result["out"].split()
    assert (uid, gid) == ("33", "33")  # the image's User, not the caller's 39
    enforced = result["report"]["enforced"]
    assert enforced["image_user"] == "www-data"
    if owners:
        # Asked to, the store keeps the image's owners through the caller's range: www-data's file is 33's.
        assert owner == "33"
        assert "image_owners" not in enforced  # every owner kept: nothing to say
    else:
        # By default a regular user's store holds that user's files only: the caller's, root inside ...
        assert owner == "0"
        # ... and the report says so, and how to keep them.
        assert "33:0 x1" in enforced["image_owners"] and "root's: the program (uid 33)" in enforced["image_owners"]
        assert "ISOLATE_IMAGE_OWNERS=subids" in enforced["image_owners"]
    assert result["doctor"] == [True, "an image's User runs as that user: " + enforced["id_map"]]
    assert result["kept"] == "33\n"  # a kept sandbox's exec server takes the caller, root inside, as its peer
    # An upper layer on disk would hold files of a subordinate id: refused (the caller could not remove them).
    assert "whose files in an upper layer on disk" in result["disk"] and "image_upper='tmpfs'" in result["disk"]
    assert enforced["id_map"].startswith("newuidmap/newgidmap (subordinate ids): 0 is the caller, uids 1-65536 are "
                                         "300000-365535")


@needs_root
def test_without_a_range_the_caller_runs_as_itself_and_the_report_says_why() -> None:
    with _no_subordinate_line():
        result = _run_as_caller()
    assert result["rc"] == 0, result["err"]
    assert result["out"].split()[:2] == [str(CALLER), str(CALLER)]
    note = result["report"]["enforced"]["image_user"]
    assert not result["doctor"][0] and "no usable range in /etc/subuid and /etc/subgid" in result["doctor"][1]
    assert "not applied: the program runs as uid 39" in note and "/etc/subuid" in note and "usermod" in note
    owners = result["report"]["enforced"]["image_owners"]
    assert "33:0 x1" in owners and "uid 39's, the program's own" in owners


@needs_root
def test_a_user_past_the_callers_range_is_refused_in_one_line() -> None:
    with _subordinate_line():
        result = _run_as_caller(user="70000")
    assert result["rc"] == 125, result
    assert "past the caller's 65536 subordinate uids (/etc/subuid): add a larger range" in result["err"]


@needs_root
def test_a_helper_that_refuses_the_range_fails_the_run_in_one_line_naming_it() -> None:
    helpers = tempfile.mkdtemp(prefix="isolate-subids-helpers-")
    try:
        os.chmod(helpers, 0o755)
        with _subordinate_line():
            result = _run_as_caller(helpers=helpers)
    finally:
        shutil.rmtree(helpers)
    assert result["rc"] == 125, result
    # Refused where the image's layers are unpacked, their owners kept through the range (isolate/image/mapped.py).
    assert f"{helpers}/newuidmap or {helpers}/newgidmap refused the caller's subordinate ids" in result["err"]
    assert "\n" not in result["err"]


def test_a_helper_not_set_user_id_root_is_no_helper(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(subids, "HELPER_DIRS", (str(tmp_path / "missing"), str(tmp_path)))
    assert subids.helper("newuidmap") is None  # missing
    shutil.copy("/bin/true", tmp_path / "newuidmap")
    os.chmod(tmp_path / "newuidmap", 0o755)
    assert subids.helper("newuidmap") is None  # not set-user-id
    os.chmod(tmp_path / "newuidmap", 0o4755)
    assert subids.helper("newuidmap") == (str(tmp_path / "newuidmap") if os.geteuid() == 0 else None)  # root's only


_OWNERS_SCRIPT = """
import json, os, sys, isolate
from isolate.image import Image, Store
store = Store(sys.argv[2])
image = Image.load(sys.argv[1], store=store)
policy = isolate.Policy(image="owners:1", backend="native")
result = isolate.run(["sh", "-c", "stat -c '%u %g' /etc /srv/pg /srv/pg/data /srv/far /opt/app/new; ls /opt/app; "
                      "test -e /srv/gone || echo gone"], policy=policy, capture_output=True, text=True, timeout=60)
layers = os.path.join(sys.argv[2], "layers")
on_disk = {}
for name in os.listdir(layers):
    place = os.path.join(layers, name, "root", "srv", "pg", "data")
    if os.path.lexists(place):
        info = os.lstat(place)
        on_disk = {"uid": info.st_uid, "gid": info.st_gid}
from isolate.cli.image import _record
inspected = _record(image)["owners"]
try:
    with isolate.Sandbox(policy, image_upper="disk"):
        disk = ""
except isolate.IsolationError as error:
    disk = str(error)
from isolate.image.push import export_layer
import tarfile
blob = export_layer(image, image.layers[1])
with tarfile.open(blob.path) as tar:
    exported = {m.name: [m.uid, m.gid] for m in tar.getmembers()}
os.unlink(blob.path)
image.remove()
os.environ["ISOLATE_IMAGE_OWNERS"] = "caller"  # asks new layers to keep no owner: not to leave the kept ones
removed = Image.prune(store=Store(sys.argv[2]))
owned_gone = all(d in removed and not os.path.lexists(store.layer_dir(d)) for d in image.layers[1:])
left = [os.listdir(os.path.join(sys.argv[2], p)) for p in ("layers", "tmp")]
# The busybox layer is kept while any sandbox on the machine stands on its digest (store.layers_in_use).
left[0] = [name for name in left[0] if name != image.layers[0].removeprefix("sha256:")]
print(json.dumps({"rc": result.returncode, "out": result.stdout, "err": result.stderr, "disk": on_disk,
                  "enforced": result.report.enforced, "exported": exported, "inspected": inspected, "disk_upper": disk,
                  "owned_gone": owned_gone, "left": left}))
"""


def _owners_as_caller(**extra_env: str) -> dict[str, Any]:
    """The caller loads an image whose layer gives root's /etc, uid 100's /srv/pg and a file past its range,
    runs stat in a sandbox of it, exports the layer, then removes the image and prunes the store."""
    work = tempfile.mkdtemp(prefix="isolate-owners-")
    try:
        os.chmod(work, 0o755)
        extra = kit.layer([{"name": "etc", "type": "dir"}, {"name": "etc/passwd", "data": b"root:x:0:0::/:/bin/sh\n"},
                           {"name": "srv", "type": "dir"},
                           {"name": "srv/pg", "type": "dir", "pax": {"uid": "100", "gid": "100"}},
                           {"name": "srv/pg/data", "data": b"x\n", "mode": 0o600, "pax": {"uid": "100", "gid": "100"}},
                           {"name": "srv/far", "data": b"y\n", "pax": {"uid": "70000", "gid": "70000"}},
                           {"name": "srv/gone", "data": b"z\n"},
                           {"name": "opt/app", "type": "dir", "pax": {"uid": "100", "gid": "100"}},
                           {"name": "opt/app/old", "data": b"o\n", "pax": {"uid": "100", "gid": "100"}}])
        # A whiteout, and an opaque directory of uid 100 (an xattr set on a subordinate id's directory).
        top = kit.layer([{"name": "srv/.wh.gone"},
                         {"name": "opt/app", "type": "dir", "pax": {"uid": "100", "gid": "100"}},
                         {"name": "opt/app/.wh..wh..opq"},
                         {"name": "opt/app/new", "data": b"n\n", "pax": {"uid": "100", "gid": "100"}}])
        layout = os.path.join(work, "layout")
        kit.oci_layout(layout, [kit.busybox_layer(), extra, top], ref="owners:1", Env=["PATH=/bin"])
        store, state = os.path.join(work, "store"), os.path.join(work, "state")
        for path in (store, state):
            os.mkdir(path, 0o700)
            os.chown(path, CALLER, CALLER)
        command = ["setpriv", f"--reuid={CALLER}", f"--regid={CALLER}", "--clear-groups", sys.executable, "-c",
                   _OWNERS_SCRIPT, layout, store]
        env = {"PATH": "/usr/local/bin:/usr/bin:/bin", "HOME": "/tmp", "LANG": "C.UTF-8", "ISOLATE_IMAGE_STORE": store,
               "ISOLATE_STATE_DIR": state, **extra_env}
        done = subprocess.run(command, capture_output=True, text=True, timeout=180, cwd="/tmp", env=env)
        assert done.returncode == 0, done.stderr
        result: dict[str, Any] = json.loads(done.stdout.splitlines()[-1])
        return result
    finally:
        subprocess.run(["rm", "-rf", "--one-file-system", work], check=False)


@needs_root
def test_a_caller_with_a_range_keeps_the_images_owners_and_removes_them() -> None:
    with _subordinate_line():
        result = _owners_as_caller(ISOLATE_IMAGE_OWNERS="subids")
    assert result["rc"] == 0, result["err"]
    # Inside: root's /etc is root's, uid 100's files are 100's; the owner past the range (70000) is root's.
    assert result["out"].split("\n") == ["0 0", "100 100", "100 100", "0 0", "100 100", "new", "gone", ""]
    # On disk: uid 100 is the subordinate id 300000 + 100 - 1.
    assert result["disk"] == {"uid": 300099, "gid": 300099}
    enforced = result["enforced"]
    assert enforced["id_map"].startswith("newuidmap/newgidmap (subordinate ids)")
    assert enforced["user"] == {"uid": 0, "gid": 0}
    assert "but for 1 entries whose owner is past them" in enforced["image_owners"]
    assert result["inspected"] == {"kept": True, "other_than_root": {"100:100": 6, "70000:70000": 1}}
    # An upper layer on disk (commit_image, a build's RUN) would hold subordinate ids' files: refused, in one line.
    assert "the sandbox maps the caller's subordinate ids" in result["disk_upper"] and "\n" not in result["disk_upper"]
    # Exported again (image push), its owners are the image's, not the host's.
    assert result["exported"]["srv/pg/data"] == [100, 100] and result["exported"]["etc"] == [0, 0]
    # Removed and pruned by the caller: nothing left, though its files were subordinate ids'.
    assert result["owned_gone"] and result["left"] == [[], []]


@needs_root
@pytest.mark.parametrize("how", ["no range", "a range, by default", "ISOLATE_IMAGE_OWNERS=caller"])
def test_without_a_range_or_asked_not_to_the_store_keeps_no_owner_and_says_so(how: str) -> None:
    if how == "no range":
        with _no_subordinate_line():
            result = _owners_as_caller(ISOLATE_IMAGE_OWNERS="subids")
    elif how == "a range, by default":  # opt-in: a build's RUN (an upper layer on disk) must keep working
        with _subordinate_line():
            result = _owners_as_caller()
    else:
        with _subordinate_line():
            result = _owners_as_caller(ISOLATE_IMAGE_OWNERS="caller")
    assert result["rc"] == 0, result["err"]
    # Every file the caller's, the run a user namespace of one uid (the image has no User to map a range for).
    assert result["out"].split("\n") == ["39 39"] * 5 + ["new", "gone", ""]
    assert result["disk"] == {"uid": CALLER, "gid": CALLER}
    assert result["enforced"]["image_owners"].startswith("not kept (a regular user's store holds that user's files")
    assert "100:100 x6" in result["enforced"]["image_owners"]
    assert result["inspected"]["kept"] is False and result["disk_upper"] == ""  # an upper layer on disk is fine
    assert result["exported"]["srv/pg/data"] == [0, 0]  # written as root's, what the store holds
    assert result["owned_gone"] and result["left"] == [[], []]
