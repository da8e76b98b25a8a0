"""Workspace(mode="overlay"): the source as an overlayfs's read-only lower layer in a kept native sandbox.

Real kernel, as root and as uid 65534 (tests/run-all.sh): the source is never written while the
program writes, deletes and renames; diff reads the changes back from the upper layer; commit writes
them with a copy workspace's guarantees; where the overlay cannot be mounted, a clear refusal.
"""

from __future__ import annotations

import hashlib
import os
import stat
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import ISOLATE_RUN, NAMESPACES_WHY, ROOT, policy

import isolate
from isolate import Sandbox, Workspace

pytestmark = pytest.mark.skipif(bool(NAMESPACES_WHY), reason=NAMESPACES_WHY or "")


def sandbox_policy(**changes: object) -> isolate.Policy:
    return policy(write=(), **changes)


@pytest.fixture
def source(workdir: str) -> str:
    root = Path(workdir) / "project"
    for d in ("src", "docs/old", "pkg/inner", "empty"):
        (root / d).mkdir(parents=True)
    (root / "src" / "main.py").write_text("print('hello')\n")
    (root / "src" / "util.py").write_text("u = 1\n")
    (root / "README").write_text("readme\n")
    (root / "docs" / "old" / "a.txt").write_text("old a\n")
    (root / "docs" / "old" / "b.txt").write_text("old b\n")
    (root / "docs" / "index").write_text("index\n")
    (root / "pkg" / "inner" / "mod.py").write_text("m = 1\n")
    (root / "link").symlink_to("src/main.py")
    for path in root.rglob("*"):
        if not path.is_symlink():
            path.chmod(0o755 if path.is_dir() else 0o644)
    root.chmod(0o755)
    return str(root)


def snapshot(root: str) -> dict[str, tuple[int, int, int, str]]:
    """Every node under root: mode, inode, mtime and content (or link text): any write shows."""
    out = {}
    for dirpath, dirnames, filenames in os.walk(root):
        for name in dirnames + filenames:
            path = os.path.join(dirpath, name)
            info = os.lstat(path)
            if stat.S_ISREG(info.st_mode):
                what = hashlib.sha256(Path(path).read_bytes()).hexdigest()
            elif stat.S_ISLNK(info.st_mode):
                what = os.readlink(path)
            else:
                what = ""
            out[os.path.relpath(path, root)] = (info.st_mode, info.st_ino, info.st_mtime_ns, what)
    info = os.lstat(root)
    out["."] = (info.st_mode, info.st_ino, info.st_mtime_ns, "")
    return out


@pytest.fixture
def box(source: str) -> Iterator[Sandbox]:
    with Sandbox(sandbox_policy(), workspace=Workspace(source, mode="overlay")) as sandbox:
        yield sandbox


# What the program does: write, append, delete a file, rename a file and a directory, replace a
# directory (rm -r then mkdir with other content), make new directories.
CHANGES = ("echo changed > src/main.py && echo more >> README && rm src/util.py && mv docs/index docs/INDEX"
           " && mv pkg pkg2 && rm -r docs/old && mkdir docs/old && echo new > docs/old/a.txt"
           " && mkdir -p new/deep && echo n > new/deep/file && rmdir empty")


def test_source_is_never_written_and_diff_lists_the_changes(box: Sandbox, source: str) -> None:
    before = snapshot(source)
    result = box.exec(CHANGES)
    assert result.returncode == 0, result.stderr
    assert box.exec("cat src/main.py docs/old/a.txt; ls docs/old; test -e src/util.py || echo gone").stdout == \
        "changed\nnew\na.txt\ngone\n"
    box.write_file("written.txt", "by write_file\n")
    box.remove("link")
    assert snapshot(source) == before  # not one byte, mode, inode or time of the source changed
    changes = box.diff()
    assert sorted(changes.added) == ["docs/INDEX", "new", "new/deep", "new/deep/file", "pkg2", "pkg2/inner",
                                     "pkg2/inner/mod.py", "written.txt"]
    # docs/old/a.txt was deleted and made again with other content: modified; b.txt, gone with the old
    # directory, is deleted; the source's own docs/old is still a directory, so it is not listed itself.
    assert sorted(changes.modified) == ["README", "docs/old/a.txt", "src/main.py"]
    assert sorted(changes.deleted) == ["docs/index", "docs/old/b.txt", "empty", "link", "pkg", "src/util.py"]
    assert changes.refused == {}


def test_a_file_replaced_by_a_directory_and_back(box: Sandbox, source: str) -> None:
    box.exec("rm README && mkdir README && echo inside > README/x && rm -r src && echo file > src")
    changes = box.diff()
    assert sorted(changes.added) == ["README/x"]
    assert sorted(changes.modified) == ["README", "src"]
    assert sorted(changes.deleted) == ["src/main.py", "src/util.py"]
    assert Path(source, "README").read_text() == "readme\n" and Path(source, "src").is_dir()


def test_commit_writes_back_and_another_directory(box: Sandbox, source: str, workdir: str) -> None:
    assert box.exec(CHANGES).returncode == 0
    other = Path(workdir) / "other"
    other.mkdir()
    written = box.commit(other)
    assert "src/main.py" in written.added and not written.deleted
    assert (other / "src" / "main.py").read_text() == "changed\n" and not (other / "src" / "util.py").exists()
    assert (other / "docs" / "old" / "a.txt").read_text() == "new\n" and not (other / "docs" / "old" / "b.txt").exists()
    assert os.readlink(other / "link") == "src/main.py"
    box.commit()
    assert Path(source, "src", "main.py").read_text() == "changed\n"
    assert Path(source, "README").read_text() == "readme\nmore\n"
    assert not Path(source, "src", "util.py").exists() and not Path(source, "empty").exists()
    assert not Path(source, "pkg").exists() and Path(source, "pkg2", "inner", "mod.py").read_text() == "m = 1\n"
    assert sorted(os.listdir(Path(source, "docs", "old"))) == ["a.txt"]
    assert Path(source, "new", "deep", "file").read_text() == "n\n"
    assert not box.diff()  # the source now is what the program sees
    assert box.exec("cat src/main.py").stdout == "changed\n"


def test_hard_links_of_the_source_and_of_the_program(source: str, workdir: str) -> None:
    os.link(Path(source, "README"), Path(source, "README.again"))
    with Sandbox(sandbox_policy(), workspace=Workspace(source, mode="overlay")) as sb:
        assert not sb.diff()  # the source's own links are no change, and nothing refused
        sb.exec("head -c 100000 /dev/zero > big && ln big big2 && ln big big3")
        changes = sb.diff()
        assert changes.added == ["big"] and set(changes.refused) == {"big2", "big3"}
        other = Path(workdir) / "other"
        other.mkdir()
        sb.commit(other)
        assert (other / "README.again").read_text() == "readme\n" and (other / "big").stat().st_size == 100000
        assert not (other / "big2").exists()


@pytest.mark.skipif(not ROOT, reason="a root caller's source owned by another user")
def test_a_root_callers_program_owns_a_users_source(source: str) -> None:
    for path in [Path(source), *Path(source).rglob("*")]:
        os.lchown(path, 1000, 1000)
    with Sandbox(sandbox_policy(), workspace=Workspace(source, mode="overlay")) as sb:
        result = sb.exec("echo x >> README && echo y > src/new && stat -c '%u %U' README . && id -u")
        assert result.returncode == 0, result.stderr
        assert result.stdout == "65534 nobody\n65534 nobody\n65534\n"
        assert sorted(sb.diff().added) == ["src/new"] and sb.diff().modified == ["README"]
        assert os.stat(Path(source, "README")).st_uid == 1000 and Path(source, "README").read_text() == "readme\n"


def test_commit_refuses_planted_links_and_strips_setid(box: Sandbox, source: str, workdir: str) -> None:
    secret = Path(workdir) / "host-secret"
    secret.write_text("host only\n")
    result = box.exec(f"ln -s {secret} abs-link; ln -s ../../outside rel-out; ln -s src/main.py inside-link; "
                      "mkfifo pipe; echo x > tool; chmod 4755 tool || chmod 755 tool; "
                      "chmod 2755 src/main.py || chmod 755 src/main.py")
    assert result.returncode == 0, result.stderr
    # The program replaces a directory of the source by a link to the host's secret place.
    box.exec(f"rm -rf src && ln -s {workdir} src")
    changes = box.commit()
    assert set(changes.refused) == {"abs-link", "rel-out", "pipe", "src"}
    assert not Path(source, "abs-link").exists() and not Path(source, "rel-out").is_symlink()
    assert not Path(source, "pipe").exists()
    assert Path(source, "src").is_dir() and not Path(source, "src").is_symlink()  # left as it was
    assert os.readlink(Path(source, "inside-link")) == "src/main.py"
    mode = os.stat(Path(source, "tool")).st_mode
    assert stat.S_IMODE(mode) & 0o7000 == 0 and stat.S_IMODE(mode) & 0o111
    assert secret.read_text() == "host only\n"
    assert sorted(os.listdir(workdir)) == ["host-secret", "project"]


def test_commit_through_a_planted_target_link_is_refused(box: Sandbox, workdir: str) -> None:
    box.exec("echo in > src/added")
    target = Path(workdir) / "out"
    target.mkdir()
    elsewhere = Path(workdir) / "elsewhere"
    elsewhere.mkdir()
    os.symlink(elsewhere, target / "src")  # a link where the workspace has a directory
    box.commit(target)
    assert (target / "src").is_dir() and not (target / "src").is_symlink()
    assert (target / "src" / "added").read_text() == "in\n"
    assert list(elsewhere.iterdir()) == []
    assert box._impl is not None
    for inside in ("overlay/upper", "overlay/work", "overlay"):
        with pytest.raises(isolate.IsolationError, match="inside the sandbox's own workspace"):
            box.commit(os.path.join(box._impl.paths.data, inside))


def test_the_program_reaches_neither_layer(box: Sandbox, source: str) -> None:
    mounts = box.exec("cat /proc/self/mountinfo").stdout
    line = next(m for m in mounts.splitlines() if " /workspace " in m)
    assert " - overlay " in line and "userxattr" in line
    assert "isolate-overlay" not in box.exec("ls -a /").stdout  # the staging points left with the staging root
    assert box.exec(f"ls {source}").returncode != 0  # the source itself is not in the sandbox
    assert box.enforced["workspace"]["mode"] == "overlay"


def test_overlay_files_leave_with_the_sandbox(source: str) -> None:
    sb = Sandbox(sandbox_policy(), workspace=Workspace(source, mode="overlay")).start()
    assert sb._impl is not None
    data = sb._impl.paths.data
    sb.exec("echo x > new && rm README")
    assert os.path.isdir(os.path.join(data, "overlay", "upper"))
    sb.close()
    assert not os.path.exists(data)


def test_refused_where_an_overlay_cannot_be_mounted(source: str) -> None:
    with pytest.raises(isolate.UnsupportedError, match=r"overlay.*namespaces=False"):
        Sandbox(policy(namespaces=False), workspace=Workspace(source, mode="overlay")).start()
    with pytest.raises(isolate.PolicyError, match="exclude"):
        Workspace(source, mode="overlay", exclude=(".git",))
    with pytest.raises(isolate.PolicyError, match="needs a source"):
        Workspace(mode="overlay")


def test_refused_when_the_source_cannot_be_a_layer() -> None:
    # /dev: a devtmpfs with other file systems mounted inside (pts, shm). A root caller is refused in the
    # parent (devtmpfs takes no idmapped mount, which gives the program the source's files); another
    # caller by the kernel, in the child (a lower layer with mounts locked to the user namespace).
    with pytest.raises(isolate.UnsupportedError, match=r"workspace mode overlay: .*mode='copy'") as refused:
        Sandbox(sandbox_policy(), workspace=Workspace("/dev", mode="overlay")).start()
    message = str(refused.value)
    assert "\n" not in message
    assert ("idmapped mount" in message) if ROOT else ("mounted inside it" in message), message


@pytest.mark.skipif(not ROOT, reason="mounts an overlayfs on the host to hold the state directory")
def test_refused_when_the_state_directory_is_on_overlayfs(source: str, workdir: str,
                                                          monkeypatch: pytest.MonkeyPatch) -> None:
    base = Path(workdir) / "ovl"
    for d in ("lower", "upper", "work", "merged"):
        (base / d).mkdir(parents=True)
    subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                    f"lowerdir={base}/lower,upperdir={base}/upper,workdir={base}/work", str(base / "merged")],
                   check=True)
    try:
        monkeypatch.setenv("ISOLATE_STATE_DIR", str(base / "merged" / "state"))
        with pytest.raises(isolate.UnsupportedError, match=r"overlayfs.*mode='copy'"):
            Sandbox(sandbox_policy(), workspace=Workspace(source, mode="overlay")).start()
    finally:
        subprocess.run(["umount", "-l", str(base / "merged")], check=True)


def test_a_directory_the_program_made_unreadable_leaves_with_the_sandbox(source: str) -> None:
    # (A caller who is not root cannot list a mode-000 directory it owns: removal must open it up first.
    # Copy mode had the same leak; overlayfs's own work directory is such a directory.)
    for mode in ("copy", "overlay"):
        sb = Sandbox(sandbox_policy(), workspace=Workspace(source, mode=mode)).start()
        assert sb._impl is not None
        data = sb._impl.paths.data
        assert sb.exec("mkdir -p locked/in && echo x > locked/in/f && chmod 000 locked/in locked").returncode == 0
        sb.close()
        assert not os.path.exists(data), mode


@pytest.mark.skipif(not ROOT, reason="mounts overlayfs on the host to hold the source")
def test_refused_when_the_kernel_refuses_the_mount(workdir: str) -> None:
    # A source on an overlayfs over an overlayfs: a third one over it exceeds the kernel's stacking depth,
    # which only the mount itself, in the child, finds out. (The source belongs to the program's uid: no
    # idmapped layer, which an overlayfs would refuse in the parent already.)
    base = Path(workdir)
    for d in ("l1", "u1", "w1", "m1", "u2", "w2", "m2"):
        (base / d).mkdir()
    (base / "l1" / "project").mkdir()
    os.chown(base / "l1" / "project", 65534, 65534)
    mounted = []
    try:
        for lower, upper, work, point in (("l1", "u1", "w1", "m1"), ("m1", "u2", "w2", "m2")):
            subprocess.run(["mount", "-t", "overlay", "overlay", "-o",
                            f"lowerdir={base / lower},upperdir={base / upper},workdir={base / work}",
                            str(base / point)], check=True)
            mounted.insert(0, base / point)
        with pytest.raises(isolate.UnsupportedError, match=r"mount-overlay.*stacking depth.*mode='copy'"):
            Sandbox(sandbox_policy(), workspace=Workspace(str(base / "m2" / "project"), mode="overlay")).start()
    finally:
        for point in mounted:
            subprocess.run(["umount", "-l", str(point)], check=True)


def test_refused_when_the_state_directory_lies_inside_the_source(source: str,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    # As with an overlay over one's home, whose ~/.local/state holds the upper layer.
    monkeypatch.setenv("ISOLATE_STATE_DIR", os.path.join(source, ".state"))
    with pytest.raises(isolate.UnsupportedError, match=r"state directory .* lies inside the source"):
        Sandbox(sandbox_policy(), workspace=Workspace(source, mode="overlay")).start()
    assert not os.path.exists(os.path.join(source, ".state"))  # refused before anything was made


def test_named_overlay_sandbox_is_attached_and_diffed(source: str) -> None:
    name = f"ov{os.getpid()}-{time.monotonic_ns() % 100000}"
    sb = Sandbox(sandbox_policy(), workspace=Workspace(source, mode="overlay"), name=name).start()
    try:
        sb.exec("echo again > README")
        sb.detach()
        again = Sandbox.attach(name)
        assert again.workspace.mode == "overlay"
        assert again.diff().modified == ["README"]
    finally:
        sb.close()


def test_cli_overlay_create_diff_commit(source: str) -> None:
    name = f"oc{os.getpid()}-{time.monotonic_ns() % 100000}"

    def cli(*args: str) -> subprocess.CompletedProcess[str]:
        return subprocess.run([ISOLATE_RUN, "sandbox", *args], capture_output=True,
                              text=True, timeout=60)

    created = cli("create", name, "--workspace", source, "--mode", "overlay")
    assert created.returncode == 0, created.stderr
    try:
        assert cli("exec", name, "--", "sh", "-c", "echo more >> README && rm src/util.py").returncode == 0
        assert Path(source, "README").read_text() == "readme\n"
        assert sorted(cli("diff", name).stdout.splitlines()) == ["D src/util.py", "M README"]
        assert cli("commit", name).returncode == 0
        assert Path(source, "README").read_text() == "readme\nmore\n" and not Path(source, "src", "util.py").exists()
    finally:
        assert cli("rm", name).returncode == 0
    refused = cli("create", name + "x", "--workspace", source, "--mode", "overlay", "--no-namespaces")
    assert refused.returncode == 125 and "overlay" in refused.stderr and len(refused.stderr.splitlines()) == 1
