"""Sandboxes whose root is an image (the native backend): a busybox-static scratch image built here."""

from __future__ import annotations

import json
import os
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import imagekit as kit
import pytest
from conftest import ISOLATE_RUN, NAMESPACES_WHY, ROOT

import isolate
from isolate.image import Image, Store
from isolate.kernel import subids

pytestmark = pytest.mark.skipif(bool(NAMESPACES_WHY) or not os.path.exists("/bin/busybox"),
                                reason=NAMESPACES_WHY or "busybox-static is not installed")

REF = "docker.io/library/scratchbox:1"


def _load(tmp: Path, name: str, extra: list[dict[str, Any]] | None = None, **config: Any) -> Image:
    layers = [kit.busybox_layer()]
    if extra:
        layers.append(kit.layer(extra))
    kit.oci_layout(str(tmp / name), layers, ref=name, **config)
    return Image.load(tmp / name, store=Store(os.environ["ISOLATE_IMAGE_STORE"]))


@pytest.fixture(scope="module")
def store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    tmp = tmp_path_factory.mktemp("images")
    path = str(tmp / "store")
    with kit.store_env(path):
        _load(tmp, "scratchbox:1", [{"name": "data", "type": "dir", "mode": 0o777},
                                    {"name": "usr", "type": "dir", "mode": 0o755},
                                    {"name": "usr/share", "type": "dir", "mode": 0o755},
                                    {"name": "usr/share/marker", "data": b"image's own\n"}],
              Env=["PATH=/bin", "FROM_IMAGE=yes", "OVERRIDDEN=image"], Cmd=["sh", "-c", "echo from-cmd"],
              WorkingDir="/data")
        _load(tmp, "entry:1", Entrypoint=["/bin/echo", "entry"], Cmd=["default"])
        _load(tmp, "user:1", [{"name": "etc/passwd", "data": b"root:x:0:0::/:/bin/sh\napp:x:1234:4321::/:/bin/sh\n"}],
              User="app")
        _load(tmp, "bigid:1", User="99999999999999999999999")
        _load(tmp, "biggid:1", User="0:4294967295")
        _load(tmp, "linked:1", [{"name": "home", "type": "link", "target": "/oldroot/etc"}])
        _load(tmp, "layered:1", [{"name": "etc", "type": "dir"}, {"name": "etc/.wh..wh..opq"},
                                 {"name": "etc/only", "data": b"top\n"}, {"name": "bin/.wh.ls"},
                                 {"name": "bin/cat3", "data": b"x"},
                                 {"name": "bin/cat2", "type": "hard", "target": "bin/cat3"}])
        yield path


def run(store: str, command: list[str], image: str = REF, **policy: Any) -> subprocess.CompletedProcess[str]:
    fields: dict[str, Any] = {"image": image, "backend": "native"}
    fields.update(policy)
    return isolate.run(command, policy=isolate.Policy(**fields), capture_output=True, text=True, timeout=60)


def test_the_root_is_the_images_and_the_hosts_usr_is_absent(store: str, workdir: str) -> None:
    result = run(store, ["sh", "-c", "cat /etc/os-release /usr/share/marker; ls /usr; test -e /usr/bin/python3 "
                         "|| echo no-host-python"], cwd=workdir, write=[workdir])
    assert result.returncode == 0, result.stderr
    assert result.stdout.split("\n")[:2] == ["NAME=busybox-scratch", "image's own"]
    assert "no-host-python" in result.stdout and "bin" not in result.stdout.split()


def test_the_images_env_applies_under_the_policys(store: str) -> None:
    result = run(store, ["env"], env={"OVERRIDDEN": "policy"})
    env = dict(line.split("=", 1) for line in result.stdout.splitlines() if "=" in line)
    assert (env["FROM_IMAGE"], env["OVERRIDDEN"], env["PATH"]) == ("yes", "policy", "/bin")


def test_writes_to_the_root_land_in_a_private_upper_layer_gone_at_the_end(store: str) -> None:
    first = run(store, ["sh", "-c", "echo mine > /data/file && cat /data/file && mkdir /data/d"])
    assert first.returncode == 0 and first.stdout == "mine\n", first.stderr
    again = run(store, ["ls", "-a", "/data"])
    assert again.stdout.split() == [".", ".."]
    image = Image.get(REF)
    assert not any(os.listdir(os.path.join(d, "data")) for d in image.lower_dirs()
                   if os.path.isdir(os.path.join(d, "data")))


def test_two_sandboxes_of_one_image_do_not_see_each_others_writes(store: str) -> None:
    policy = isolate.Policy(image=REF, backend="native")
    with isolate.Sandbox(policy=policy) as a, isolate.Sandbox(policy=policy) as b:
        assert a.exec(["sh", "-c", "echo a > /data/a"]).returncode == 0
        assert b.exec(["sh", "-c", "echo b > /data/b"]).returncode == 0
        assert a.exec(["ls", "/data"]).stdout.split() == ["a"]
        assert b.exec(["ls", "/data"]).stdout.split() == ["b"]


def test_cmd_runs_when_no_command_is_given_and_the_working_dir_applies(store: str) -> None:
    assert run(store, []).stdout == "from-cmd\n"
    assert run(store, ["pwd"], write=[]).stdout == "/data\n"
    assert run(store, [], image="entry:1").stdout == "entry default\n"
    assert run(store, ["given"], image="entry:1").stdout == "entry given\n"


def test_the_images_user_applies_for_a_root_caller(store: str) -> None:
    if ROOT:
        from isolate.backends.native import imageroot
        from isolate.kernel import privateids

        ids = privateids.cached()
        layers = os.path.dirname(os.path.dirname(Image.get("user:1").lower_dirs()[0]))
        why = ids if isinstance(ids, str) else imageroot._layers_idmap_problem(layers, ids)
        if why:  # never the host's uid 1234: refused (test_images_private_ids.py)
            with pytest.raises(isolate.UnsupportedError, match="would run as a real host user"):
                run(store, ["id"], image="user:1")
            return
    result = run(store, ["id"], image="user:1")
    assert result.returncode == 0, result.stderr
    if ROOT:
        assert "uid=1234" in result.stdout and "gid=4321" in result.stdout  # isolate's private range's (its test)
    elif isinstance(subids.find(os.geteuid(), os.getegid()), subids.SubIds):
        assert "uid=1234" in result.stdout and "gid=4321" in result.stdout  # the caller's range (newuidmap)
    else:
        assert f"uid={os.getuid()}" in result.stdout  # one uid: the caller's own


def test_an_images_user_id_past_the_kernels_range_is_refused_not_an_overflow(store: str) -> None:
    for image in ("bigid:1", "biggid:1"):
        with pytest.raises(isolate.PolicyError, match="not a number from 0 to 4294967294"):
            run(store, ["true"], image=image)


def test_prune_keeps_the_layers_a_running_sandbox_stands_on(store: str, tmp_path: Path) -> None:
    # image rm, then prune, removed the layers under a running sandbox: its root emptied.
    # A layer of its own: the same layer under another caller's running sandbox (the suite as uid 65534, side
    # by side) is kept too, as prune cannot tell whose store a mount came from.
    _load(tmp_path, "inuse:1", [{"name": "marker", "data": b"still here\n"},
                                {"name": "caller", "data": f"{os.getpid()} {time.time()}\n".encode()}])
    policy = isolate.Policy(image="inuse:1", backend="native")
    with isolate.Sandbox(policy=policy) as box:
        image = Image.get("inuse:1")
        image.remove()
        removed = Image.prune(image.store)
        assert image.layers[-1] not in removed, removed
        assert box.exec(["cat", "/marker"]).stdout == "still here\n"
    assert image.layers[-1] in Image.prune(image.store)


def test_a_mount_through_a_link_of_the_image_is_refused(store: str) -> None:
    with pytest.raises(isolate.UnsupportedError, match="/home is a link in the image"):
        run(store, ["true"], image="linked:1")
    assert not os.path.exists("/etc/isolate-test-never")


def test_isolate_run_takes_an_image_and_replays_its_plan(store: str, workdir: str) -> None:
    env = dict(os.environ, ISOLATE_RUN_TRACE="1")
    for _ in range(2):
        result = subprocess.run([ISOLATE_RUN, "--image", "scratchbox:1", "--", "cat", "/etc/os-release"],
                                cwd=workdir, capture_output=True, text=True, timeout=60, env=env)
        assert result.returncode == 0 and result.stdout == "NAME=busybox-scratch\n", result.stderr
    from isolate.backends.native.imageroot import upper_limits

    # Before Linux 6.6 an image run's upper layer is on disk, made for each run: Python runs it, no plan replays it.
    assert ("not replayed" if upper_limits() else "replaying the cached plan") in result.stderr, result.stderr
    missing = subprocess.run([ISOLATE_RUN, "--image", "nothere:1", "--", "true"], cwd=workdir,
                             capture_output=True, text=True, timeout=60)
    assert missing.returncode == 125 and "not in the image store" in missing.stderr
    assert len(missing.stderr.strip().splitlines()) == 1


def test_whiteouts_and_opaque_directories_hide_what_lower_layers_hold(store: str) -> None:
    result = run(store, ["sh", "-c", "ls /etc; test -e /bin/ls || echo no-ls; stat -c %h /bin/cat2"],
                 image="layered:1")
    assert result.stdout.split() == ["only", "no-ls", "2"], result.stderr


def test_explain_names_the_image_not_the_hosts_system(store: str, workdir: str) -> None:
    result = subprocess.run([ISOLATE_RUN, "--explain", "--image", "scratchbox:1", "--", "sh"], cwd=workdir,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert f"-> {REF}" in result.stdout and "command sh -> /bin/sh (in the image)" in result.stdout
    assert "read  /usr" not in result.stdout


def test_a_grant_holding_the_image_store_shows_it_empty(store: str, tmp_path: Path) -> None:
    assert os.listdir(store)
    parent = os.path.dirname(store)
    for image in (REF, None):
        fields: dict[str, Any] = {"read": ["/usr", "/bin", "/lib", "/lib64"]} if image is None else {}
        result = isolate.run(["ls", "-A", store], policy=isolate.Policy(image=image, backend="native",
                                                                          write=[parent], **fields),
                             capture_output=True, text=True, cwd=parent)
        assert result.returncode == 0 and result.stdout == "", (result.stdout, result.stderr)
    with pytest.raises(isolate.PolicyError, match="lies in isolate's image store"):
        run(store, ["true"], write=[os.path.join(store, "layers")])


def test_snapshots_and_forks_of_an_image_sandboxs_tmpfs_upper_are_refused_not_partial(store: str) -> None:
    # Its root's writes are in a tmpfs of its own (the default from Linux 6.6): a snapshot would lose them. On
    # disk they are kept (tests/test_images_snapshots.py).
    with isolate.Sandbox(policy=isolate.Policy(image=REF, backend="native"), image_upper="tmpfs") as box:
        box.exec(["sh", "-c", "echo kept > /data/f"])
        with pytest.raises(isolate.UnsupportedError, match="image_upper='disk'"):
            box.snapshot()
        with pytest.raises(isolate.UnsupportedError, match="image_upper='disk'"):
            box.fork()


def test_an_images_root_is_read_from_the_store_once_while_its_record_and_layers_stay(
        store: str, monkeypatch: pytest.MonkeyPatch) -> None:
    # Every kept sandbox a regular caller starts asks for its image (imageroot.caller_inside): each read the
    # store's record again, and listed the layers' top levels (2-3 ms of a create + first exec as uid 65534).
    from isolate.backends.native import imageroot

    policy = isolate.Policy(image="entry:1", backend="native")
    first = imageroot.load(policy)
    reads: list[str] = []
    record = Store.record
    monkeypatch.setattr(Store, "record", lambda self, ref: reads.append(ref) or record(self, ref))
    assert imageroot.load(policy) is first and imageroot.caller_inside(policy) == os.geteuid()
    assert reads == []


def test_a_name_loaded_again_is_the_new_image_in_the_next_sandbox(store: str, tmp_path: Path) -> None:
    for number in (1, 2):
        kit.oci_layout(str(tmp_path / f"v{number}"), [kit.busybox_layer(), kit.layer(
            [{"name": "version", "data": f"{number}\n".encode()}])], ref="again:1", Env=["PATH=/bin"])
        Image.load(tmp_path / f"v{number}", store=Store(store))
        with isolate.Sandbox(policy=isolate.Policy(image="again:1", backend="native")) as box:
            assert box.exec(["cat", "/version"], text=True).stdout == f"{number}\n"


def test_a_name_loaded_again_with_another_config_on_its_records_old_inode_is_the_new_config(
        store: str, tmp_path: Path, workdir: str) -> None:
    # Each load writes the name's record anew, renamed over the old one; ext4 gives the next new file the inode
    # number just freed, so after two loads the record had the number it had at the last run. The same layers
    # with another Env (or User, Cmd): the cached plans (Python's and isolate-run's) rested on that number and ran
    # the old config. The loads alternate until the number comes back (it does at once here; never on tmpfs).
    layer = kit.busybox_layer()
    for name in "ABC":
        kit.oci_layout(str(tmp_path / name), [layer], ref="config:1", Env=["PATH=/bin", f"VERSION={name}"])
    record = Store(store)._record_path(str(isolate.image.Reference.parse("config:1")))
    policy = isolate.Policy(image="config:1", backend="native")
    env = dict(os.environ, ISOLATE_RUN_TRACE="1")

    def both() -> tuple[str, str]:
        api = isolate.run(["sh", "-c", "echo $VERSION"], policy=policy, capture_output=True, text=True, timeout=60)
        cli = subprocess.run([ISOLATE_RUN, "--image", "config:1", "--", "sh", "-c", "echo $VERSION"], cwd=workdir,
                             capture_output=True, text=True, timeout=60, env=env)
        assert api.returncode == 0 and cli.returncode == 0, (api.stderr, cli.stderr)
        return api.stdout.strip(), cli.stdout.strip()

    Image.load(tmp_path / "A", store=Store(store))
    assert both() == ("A", "A") and both() == ("A", "A")  # the second run replays
    for turn in range(6):  # two loads a turn: B C, A B, C A ... (each turn ends on another name)
        inode = os.stat(record).st_ino
        for name in ("ABC" * 5)[2 * turn + 1: 2 * turn + 3]:
            Image.load(tmp_path / name, store=Store(store))
        assert both() == (name, name), (turn, "the record's inode came back:", inode == os.stat(record).st_ino)


def test_owners_a_regular_users_store_does_not_keep_are_said_by_the_sandbox_and_inspect(
        store: str, tmp_path: Path) -> None:
    app = {"uid": "1000", "gid": "1000"}
    _load(tmp_path, "owned:1", [{"name": "etc", "type": "dir"},
                                {"name": "etc/secret", "data": b"root's\n", "mode": 0o600},
                                {"name": "app", "type": "dir", "pax": app},
                                {"name": "app/note", "data": b"app's\n", "mode": 0o600, "pax": app}])
    result = run(store, ["sh", "-c", "stat -c '%u %a' /app/note /etc/secret; cat /app/note /etc/secret"],
                 image="owned:1")
    said = result.report.enforced.get("image_owners")
    inspected = json.loads(subprocess.run([ISOLATE_RUN, "image", "inspect", "owned:1"], capture_output=True,
                                          text=True, timeout=60, check=True).stdout)["owners"]
    if os.geteuid() == 0:  # kept (uid 1000 unmapped inside: the overflow id); the program, 65534, reads neither
        assert said is None and inspected == {"kept": True, "other_than_root": {"1000:1000": 2}}
        assert result.stdout.splitlines()[:2] == ["65534 600", "0 600"], result.stderr
        assert "Permission denied" in result.stderr
    else:  # every file is the caller's, and the program is the caller: it reads both, and it is said
        me = os.geteuid()
        assert inspected == {"kept": False, "other_than_root": {"1000:1000": 2}}
        assert result.stdout.splitlines() == [f"{me} 600", f"{me} 600", "app's", "root's"], result.stderr
        assert said is not None and "not kept" in said and "1000:1000 x2" in said and f"uid {me}'s" in said


def test_an_image_naming_one_layer_twice_runs_as_docker_stacks_it(store: str, tmp_path: Path) -> None:
    # buildkit's empty layer is often named several times in one image: overlayfs refuses a directory twice
    # (ELOOP, "too many levels of symbolic links" at mount-overlay), so it is laid once, where it is topmost.
    again = kit.layer([{"name": "data", "type": "dir", "mode": 0o777}, {"name": "data/f", "data": b"again\n"}])
    between = kit.layer([{"name": "data", "type": "dir", "mode": 0o777}, {"name": "data/f", "data": b"between\n"},
                         {"name": "data/g", "data": b"kept\n"}])
    kit.oci_layout(str(tmp_path / "twice"), [kit.busybox_layer(), again, between, again], ref="twice:1")
    image = Image.load(tmp_path / "twice", store=Store(store))
    result = isolate.run(["cat", "/data/f", "/data/g"], policy=isolate.Policy(image="twice:1"), capture_output=True,
                         text=True)
    assert (result.returncode, result.stdout) == (0, "again\nkept\n"), result.stderr
    assert len(image.layers) == 4 and len(image.lower_dirs()) == 3


def test_the_images_root_never_shows_the_hosts_files_through_dotdot(store: str, workdir: str,
                                                                      tmp_path: Path) -> None:
    # The image's root read on the host (image/view.py) joined each name to a layer's path: "..", which an image's
    # PATH or WorkingDir (its author's) may hold, walked up out of the store onto the host's files. --explain
    # said a host file was the image's command, and read_file read /etc/shadow.
    from isolate.image import view

    image = _load(tmp_path, "dotdot:1", Env=["PATH=" + "/.." * 40 + "/etc"])
    assert view.kind(image.lower_dirs(), "../" * 40 + "etc/passwd") is None
    assert view.read_file(image.lower_dirs(), "../" * 40 + "etc/passwd") is None
    result = subprocess.run([ISOLATE_RUN, "--explain", "--image", "dotdot:1", "--", "passwd"], cwd=workdir,
                            capture_output=True, text=True, timeout=60)
    assert result.returncode == 0, result.stderr
    assert "command passwd -> not found in the image" in result.stdout, result.stdout
