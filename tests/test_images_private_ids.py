"""A root caller's image User runs in isolate's private id range (kernel/privateids.py), never as a real host user:
its ids inside are the image's, its files show the owners the image gives them, and on the host it is no account."""

from __future__ import annotations

import json
import os
import pwd
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import imagekit as kit
import pytest
from conftest import NAMESPACES_WHY, ROOT

import isolate
from isolate.image import Image, Store
from isolate.kernel import privateids, subids

pytestmark = pytest.mark.skipif(bool(NAMESPACES_WHY) or not os.path.exists("/bin/busybox"),
                                reason=NAMESPACES_WHY or "busybox-static is not installed")
root_only = pytest.mark.skipif(not ROOT, reason="a root caller's image users (a regular one's are its own ids)")

PASSWD = b"root:x:0:0::/root:/bin/sh\napp:x:1000:1000::/home/app:/bin/sh\n"
HOME = [{"name": "etc/passwd", "data": PASSWD, "mode": 0o644},
        {"name": "root", "type": "dir", "mode": 0o700},
        {"name": "home", "type": "dir"},
        {"name": "home/app", "type": "dir", "mode": 0o700, "pax": {"uid": "1000", "gid": "1000"}},
        {"name": "home/app/notes", "data": b"app's own\n", "mode": 0o600, "pax": {"uid": "1000", "gid": "1000"}}]


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("private-ids")
    path = str(tmp / "store")
    with kit.store_env(path):
        for ref, user in (("named:1", "app"), ("numbered:1", "1000")):
            kit.oci_layout(str(tmp / ref), [kit.busybox_layer(), kit.layer(HOME)], ref=ref, User=user,
                           Env=["PATH=/bin"])
            Image.load(tmp / ref, store=Store(path))
        # An image user in root's group, as images made for arbitrary uids are: root's group shares a directory.
        grouped = [{"name": "etc/passwd", "data": b"root:x:0:0::/:/bin/sh\nocp:x:1001:0::/srv:/bin/sh\n"},
                   {"name": "srv", "type": "dir", "mode": 0o770},
                   {"name": "srv/shared", "data": b"group's\n", "mode": 0o660}]
        kit.oci_layout(str(tmp / "grouped"), [kit.busybox_layer(), kit.layer(grouped)], ref="grouped:1", User="ocp",
                       Env=["PATH=/bin"])
        Image.load(tmp / "grouped", store=Store(path))
        yield path


def _idmap_why() -> str | None:
    """Why this host's store cannot show the image's layers through the private range (tmpfs before Linux 6.3)."""
    from isolate.backends.native import imageroot

    ids = privateids.cached()
    if not isinstance(ids, privateids.PrivateIds):
        return ids
    return imageroot._layers_idmap_problem(os.path.dirname(os.path.dirname(Image.get("named:1").lower_dirs()[0])),
                                           ids)


@pytest.fixture()
def ranged(store: str) -> str:
    """The store, where a root caller's image users can run in the private range here (else skipped)."""
    why = _idmap_why()
    if why:
        pytest.skip(f"no private range here: {why}")
    return store


def run(command: list[str], image: str = "named:1", **fields: Any) -> Any:
    policy = isolate.Policy(image=image, backend="native", **fields)
    return isolate.run(command, policy=policy, capture_output=True, text=True, timeout=60)


def _host_ids_of(box: isolate.Sandbox) -> tuple[int, int]:
    """The host uid and gid of a process the sandbox runs (a sleep the test finds by its unusual argument)."""
    seconds = f"{20 + time.monotonic_ns() % 1000 / 1000:.3f}"
    started = box.exec(["sh", "-c", f"sleep {seconds} > /dev/null 2>&1 & echo started"])
    assert started.returncode == 0, started.stderr
    try:
        out = subprocess.run(["ps", "-eo", "uid=,gid=,args="], capture_output=True, text=True, check=True).stdout
        found = [line.split()[:2] for line in out.splitlines() if line.split()[2:] == ["sleep", seconds]]
        assert found, out
        return int(found[0][0]), int(found[0][1])
    finally:
        box.exec(["sh", "-c", f"pkill -f 'sleep {seconds}' || true"])


@root_only
@pytest.mark.parametrize("image", ["named:1", "numbered:1"])
def test_an_images_user_is_its_id_inside_and_no_host_users_outside(ranged: str, image: str) -> None:
    with isolate.Sandbox(isolate.Policy(image=image, backend="native")) as box:
        inside = box.exec(["sh", "-c", "id -u; id -g; cat /proc/self/uid_map"])
        assert inside.returncode == 0, inside.stderr
        assert inside.stdout.split()[:2] == ["1000", "1000"]
        uid, gid = _host_ids_of(box)
        user = box.enforced["user"]
    host_users = {entry.pw_uid for entry in pwd.getpwall()}
    assert uid not in (0, 1000, 65534) and uid not in host_users, uid
    assert gid not in (0, 1000, 65534), gid
    ids = privateids.cached()
    assert isinstance(ids, privateids.PrivateIds)
    assert (uid, gid) == (ids.host_uid(1000), ids.host_gid(1000)) == (user["uid"], user["gid"])
    assert user["inside"] == {"uid": 1000, "gid": 1000}


@root_only
def test_the_images_files_show_their_owners_and_the_user_writes_only_its_own(ranged: str) -> None:
    result = run(["sh", "-c", "ls -lnd / /etc/passwd /root /home/app /home/app/notes | awk '{print $3, $4, $NF}'; "
                  "cat /home/app/notes; echo more >> /home/app/notes && echo new > /home/app/made && "
                  "ls -ln /home/app/made | awk '{print $3, $4}'; "
                  "echo x >> /etc/passwd 2>/dev/null || echo no-passwd; ls /root 2>/dev/null || echo no-root"])
    assert result.returncode == 0, result.stderr
    # Before Linux 6.6 the private upper layer is a directory on disk, given to the program (overlayfs copies up as
    # it, imageroot.plan_host_upper), and the root of an overlay shows its upper layer's root: the sandbox's own
    # "/" is then the program's, as a default 65534 program's is there. A tmpfs upper layer's root is root's.
    from isolate.backends.native import imageroot

    top = "1000 1000 /" if imageroot.upper_limits() else "0 0 /"
    assert result.stdout.splitlines() == [top, "0 0 /etc/passwd", "1000 1000 /home/app",
                                          "1000 1000 /home/app/notes", "0 0 /root", "app's own", "1000 1000",
                                          "no-passwd", "no-root"]
    # The writes landed in the private upper layer: the image's layer is as it was.
    image = Image.get("named:1")
    notes = [os.path.join(d, "home", "app", "notes") for d in image.lower_dirs()]
    assert [open(p, "rb").read() for p in notes if os.path.exists(p)] == [b"app's own\n"]


@root_only
def test_a_host_users_file_under_a_read_grant_is_not_the_image_users(ranged: str, tmp_path: Path) -> None:
    shared = tmp_path / "shared"
    shared.mkdir(mode=0o755)
    os.chmod(shared, 0o755)
    private, public = shared / "private", shared / "public"
    private.write_text("host user 1000's\n")
    public.write_text("anyone's\n")
    for path, mode in ((private, 0o600), (public, 0o644)):
        os.chown(path, 1000, 1000)
        os.chmod(path, mode)
    os.chmod(tmp_path, 0o755)
    result = run(["sh", "-c", f"cat {public}; cat {private} 2>/dev/null || echo refused; "
                  f"ls -ln {private} | awk '{{print $3}}'"], read=[str(shared)])
    assert result.returncode == 0, result.stderr
    assert result.stdout.splitlines() == ["anyone's", "refused", "65534"]  # 1000 of the host is no one inside


@root_only
def test_an_image_user_in_roots_group_is_no_host_root_group(ranged: str, tmp_path: Path) -> None:
    host = tmp_path / "host"
    host.mkdir(mode=0o755)
    os.chmod(tmp_path, 0o755)
    os.chmod(host, 0o755)
    (host / "root-group").write_text("root's group's\n")
    os.chmod(host / "root-group", 0o640)  # root:root on the host
    with isolate.Sandbox(isolate.Policy(image="grouped:1", backend="native", read=[str(host)])) as box:
        inside = box.exec(["sh", "-c", f"id -u; id -g; cat /srv/shared; echo more >> /srv/shared && echo wrote; "
                           f"cat {host}/root-group 2>/dev/null || echo refused"])
        assert inside.stdout.splitlines() == ["1001", "0", "group's", "wrote", "refused"], inside.stderr
        uid, gid = _host_ids_of(box)
    assert gid != 0 and uid != 1001, (uid, gid)


@root_only
def test_a_write_grant_stays_the_callers_and_the_home_tmpfs_the_programs(ranged: str, tmp_path: Path) -> None:
    work = tmp_path / "work"
    work.mkdir()
    result = run(["sh", "-c", f"echo hi > {work}/made && ls -lnd {work} $HOME | awk '{{print $3}}' && id -u"],
                 write=[str(work)])
    assert result.returncode == 0, result.stderr
    assert result.stdout.split() == ["1000", "1000", "1000"]  # the grant is shown as the program's
    info = os.stat(work / "made")
    assert (info.st_uid, info.st_gid) == (0, 0)  # the caller's on disk


@root_only
def test_isolate_run_runs_it_in_the_range_too(ranged: str, tmp_path: Path) -> None:
    from conftest import ISOLATE_RUN

    from isolate.backends.native.imageroot import upper_limits

    report = tmp_path / "report.json"
    env = dict(os.environ, ISOLATE_RUN_TRACE="1")
    for _ in range(2):  # the second replays the cached plan (the binary idmaps the layers itself)
        done = subprocess.run([ISOLATE_RUN, "--image", "named:1", "--report", str(report), "--", "sh", "-c",
                               "id -u; ls -ln /home | grep ' app$' | awk '{print $3}'"],
                              capture_output=True, text=True, timeout=60, cwd=tmp_path, env=env)
        assert done.returncode == 0, done.stderr
        assert done.stdout == "1000\n1000\n"
        assert json.loads(report.read_text())["enforced"]["user"]["uid"] != 1000
    assert ("not replayed" if upper_limits() else "replaying the cached plan") in done.stderr, done.stderr


def _files(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, subuid: str, subgid: str, passwd: str = "") -> None:
    """/etc/subuid, /etc/subgid and /etc/passwd as the range's finder reads them (the host's are left alone)."""
    for name, text, module, attr in (("subuid", subuid, subids, "SUBUID"), ("subgid", subgid, subids, "SUBGID"),
                                     ("passwd", passwd, privateids, "PASSWD")):
        path = tmp_path / name
        path.write_text(text)
        monkeypatch.setattr(module, attr, str(path))


@root_only
def test_an_isolate_line_in_subuid_gives_the_range(ranged: str, tmp_path: Path,
                                                   monkeypatch: pytest.MonkeyPatch) -> None:
    _files(tmp_path, monkeypatch, "someone:100000:65536\nisolate:300000:65536\n", "isolate:400000:65536\n")
    with isolate.Sandbox(isolate.Policy(image="named:1", backend="native", env={"CASE": "subuid"})) as box:
        assert box.exec(["id", "-u"]).stdout == "1000\n"
        assert _host_ids_of(box) == (300000 + 1000, 400000 + 1000)  # the image's id N is START + N


@root_only
@pytest.mark.parametrize("case", ["short", "clash", "passwd"])
def test_a_range_that_is_not_isolates_alone_is_refused_or_65534_for_best_effort(
        store: str, tmp_path: Path, monkeypatch: pytest.MonkeyPatch, case: str) -> None:
    start = privateids.DEFAULT_START
    subuid, passwd = {"short": ("isolate:300000:1000\n", ""), "clash": (f"someone:{start + 5000}:10\n", ""),
                      "passwd": ("", f"svc:x:{start + 7}:0::/:/bin/sh\n")}[case]
    _files(tmp_path, monkeypatch, subuid, "", passwd)
    with pytest.raises(isolate.UnsupportedError, match=r"real host user.*private id range"):
        run(["id", "-u"], env={"CASE": case})
    result = run(["id", "-u"], env={"CASE": case + "-best"}, best_effort=True)
    assert result.returncode == 0 and result.stdout == "65534\n", result.stderr
    assert "not applied" in result.report.enforced["image_user"]


def test_a_regular_callers_image_user_is_unchanged(store: str) -> None:
    if ROOT:
        pytest.skip("a regular caller's path")
    result = run(["id", "-u"])
    assert result.returncode == 0, result.stderr
    ranges = subids.find(os.geteuid(), os.getegid())
    assert result.stdout == ("1000\n" if isinstance(ranges, subids.SubIds) else f"{os.geteuid()}\n")
    assert "private_range" not in result.report.enforced["user"]


def _disk_upper_why() -> str | None:
    from isolate.kernel.overlay import xattr_problem
    from isolate.kernel.places import state_dir

    os.makedirs(state_dir(), exist_ok=True)
    return xattr_problem(state_dir(), state_dir())


@root_only
def test_commit_image_and_a_builds_user_step_keep_the_images_ids_not_the_ranges(ranged: str) -> None:
    if _disk_upper_why():
        pytest.skip(f"image_upper='disk' is refused here: {_disk_upper_why()}")
    with isolate.Sandbox(isolate.Policy(image="named:1", backend="native"), image_upper="disk") as box:
        made = box.exec(["sh", "-c", "echo kept > /home/app/kept"])
        assert made.returncode == 0, made.stderr
        committed = box.commit_image("committed-app:1")
    info = os.stat(os.path.join(committed.lower_dirs()[0], "home", "app", "kept"))
    assert (info.st_uid, info.st_gid) == (1000, 1000)
    # A build's RUN under the image's User: that user, as Docker's, owning what it makes and nothing of root's.
    built = Image.get("named:1").run("echo built > /home/app/built && (touch /etc/x 2>/dev/null || echo no-etc) "
                                     "> /home/app/etc").build("built-app:1")
    top = built.lower_dirs()[0]
    info = os.stat(os.path.join(top, "home", "app", "built"))
    assert (info.st_uid, info.st_gid) == (1000, 1000)
    with open(os.path.join(top, "home", "app", "etc"), encoding="utf-8") as handle:
        assert handle.read() == "no-etc\n"
    assert not os.path.exists(os.path.join(top, "etc", "x"))


@root_only
def test_a_snapshot_and_a_fork_of_an_image_users_sandbox_keep_its_files_its_own(ranged: str) -> None:
    if _disk_upper_why():
        pytest.skip(f"image_upper='disk' is refused here: {_disk_upper_why()}")
    with isolate.Sandbox(isolate.Policy(image="named:1", backend="native"), image_upper="disk") as box:
        assert box.exec(["sh", "-c", "echo one > /home/app/kept"]).returncode == 0
        snap = box.snapshot()
        try:
            assert box.exec(["sh", "-c", "echo two > /home/app/kept"]).returncode == 0
            box.restore(snap)
            (fork,) = box.fork(1)
            with fork:
                for sandbox in (box, fork):
                    shown = sandbox.exec(["sh", "-c", "cat /home/app/kept; ls -ln /home/app/kept | "
                                          "awk '{print $3, $4}'; echo three >> /home/app/kept && id -u"])
                    assert shown.stdout.splitlines() == ["one", "1000 1000", "1000"], shown.stderr
        finally:
            snap.remove()


@root_only
def test_preexec_fn_refuses_an_images_user_or_runs_65534_for_best_effort(store: str) -> None:
    with pytest.raises(isolate.UnsupportedError, match="preexec_fn has no parent"):
        subprocess.run(["true"], preexec_fn=isolate.Policy(image="named:1", backend="native").preexec_fn, timeout=60)
    policy = isolate.Policy(image="named:1", backend="native", best_effort=True)
    done = subprocess.run(["id", "-u"], preexec_fn=policy.preexec_fn, capture_output=True, text=True, timeout=60)
    assert (done.returncode, done.stdout) == (0, "65534\n"), done.stderr


@root_only
def test_a_store_that_takes_no_idmapped_mount_refuses_an_images_user_or_runs_65534(store: str) -> None:
    why = _idmap_why()
    if not why:
        pytest.skip("this host's store takes an idmapped mount (the private range works: the tests above)")
    with pytest.raises(isolate.UnsupportedError, match="would run as a real host user"):
        run(["id", "-u"])
    result = run(["id", "-u"], best_effort=True)
    assert (result.returncode, result.stdout) == (0, "65534\n"), result.stderr


@root_only
def test_doctor_names_the_range_or_why_there_is_none(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    from isolate.cli import doctor

    _files(tmp_path, monkeypatch, "isolate:300000:65536\n", "isolate:400000:65536\n")
    ok, said = doctor._subids()
    assert ok and "host 300001-365535" in said and "host 400000-465535" in said, said
    _files(tmp_path, monkeypatch, "isolate:300000:10\n", "")
    ok, said = doctor._subids()
    assert not ok and "fewer than 65536" in said, said


def test_the_name_services_accounts_are_known_and_the_ranges_ids_are_not() -> None:
    assert privateids.known_account(0, 0) == "uid 0 is the user root"
    base = privateids.DEFAULT_START
    assert privateids.known_account(base + 1000, base + 1000) is None
