"""The one walk down from a directory descriptor (isolate.kernel.beneath): openat2, and its fallback.

Every case is asked of both: the kernel's walk (openat2 with RESOLVE_BENEATH |
RESOLVE_NO_SYMLINKS | RESOLVE_NO_MAGICLINKS) and the walk component by
component that stands in for it where openat2 is missing; they must give the
same answer (the same inode, or the same errno naming the same part of the
path). A seccomp filter that refuses openat2 (ENOSYS, EPERM) must send the
walk to the fallback with the same answers.
"""

from __future__ import annotations

import ast
import errno
import os
import stat
import subprocess
import sys
import time
from collections.abc import Iterator

import pytest

from isolate.kernel import beneath
from isolate.kernel.beneath import DIR_OPEN, open_beneath, parent_beneath, walk_components

FILE = os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC
NOFOLLOW = FILE | os.O_NOFOLLOW
LINK = os.O_PATH | os.O_NOFOLLOW | os.O_CLOEXEC


@pytest.fixture
def tree(tmp_path: object) -> Iterator[int]:
    """root/: d/e/f (a file), links at every depth, FIFOs at two depths; the root's descriptor."""
    root = str(tmp_path)
    os.makedirs(os.path.join(root, "d", "e"))
    for path in ("d/e/f", "file"):
        with open(os.path.join(root, path), "w") as handle:
            handle.write("x")
    os.symlink("d", os.path.join(root, "top"))               # depth 1, inside
    os.symlink("e", os.path.join(root, "d", "mid"))          # depth 2, inside
    os.symlink("f", os.path.join(root, "d", "e", "last"))    # depth 3, at the end
    os.symlink("/etc", os.path.join(root, "d", "e", "abs"))  # absolute, out
    os.symlink("../..", os.path.join(root, "d", "up"))       # relative, out
    os.mkfifo(os.path.join(root, "fifo"))
    os.mkfifo(os.path.join(root, "d", "e", "fifo"))
    fd = os.open(root, DIR_OPEN)
    yield fd
    os.close(fd)


def _answer(walk: object, dir_fd: int, path: str, flags: int, same_mount: bool = False) -> tuple[object, ...]:
    try:
        fd = walk(dir_fd, path, flags, same_mount=same_mount)  # type: ignore[operator]
    except OSError as exc:
        return "refused", errno.errorcode.get(exc.errno or 0), exc.filename
    info = os.fstat(fd)
    os.close(fd)
    return "opened", info.st_dev, info.st_ino, stat.S_IFMT(info.st_mode)


def _ino(dir_fd: int, path: str) -> tuple[object, ...]:
    info = os.stat(path, dir_fd=dir_fd, follow_symlinks=False)
    return "opened", info.st_dev, info.st_ino, stat.S_IFMT(info.st_mode)


CASES = [
    # (path, flags, expected: "=PATH" (that inode), or (errno name, the path as far as the refused part))
    ("d", DIR_OPEN, "=d"),
    ("d/e", DIR_OPEN, "=d/e"),
    ("d/e/f", FILE, "=d/e/f"),
    ("./d//e/./f", FILE, "=d/e/f"),
    ("d/e/", DIR_OPEN, "=d/e"),
    ("d/e/f/", FILE, ("ENOTDIR", "d/e/f")),
    (".", DIR_OPEN, "=."),
    ("d/..", DIR_OPEN, "=."),
    ("d/e/../../d/e/f", FILE, "=d/e/f"),
    ("", DIR_OPEN, ("ENOENT", "")),
    ("missing", FILE, ("ENOENT", "missing")),
    ("d/missing/f", FILE, ("ENOENT", "d/missing")),
    # links at every depth, each refused where it lies
    ("top", DIR_OPEN, ("ELOOP", "top")),
    ("top/e/f", FILE, ("ELOOP", "top")),
    ("d/mid/f", FILE, ("ELOOP", "d/mid")),
    ("d/e/last", FILE, ("ELOOP", "d/e/last")),
    ("d/e/last", NOFOLLOW, ("ELOOP", "d/e/last")),
    ("d/e/last", LINK, "=d/e/last"),                  # O_PATH | O_NOFOLLOW: the link itself
    ("d/e/abs/passwd", FILE, ("ELOOP", "d/e/abs")),
    ("d/up/etc", DIR_OPEN, ("ELOOP", "d/up")),
    ("d/e/last", DIR_OPEN, ("ELOOP", "d/e/last")),
    ("top", DIR_OPEN | os.O_NOFOLLOW, ("ENOTDIR", "top")),  # open(2): O_DIRECTORY | O_NOFOLLOW on a link
    # '..' and absolute paths: never above the start
    ("..", DIR_OPEN, ("EXDEV", "..")),
    ("d/../..", DIR_OPEN, ("EXDEV", "d/../..")),
    ("d/e/../../../etc", DIR_OPEN, ("EXDEV", "d/e/../../..")),
    ("/etc", DIR_OPEN, ("EXDEV", "/etc")),
    ("/", DIR_OPEN, ("EXDEV", "/")),
    # FIFOs: never waited on by the walk; one on the way is no directory
    ("fifo", FILE, "=fifo"),
    ("fifo/x", FILE, ("ENOTDIR", "fifo")),
    ("d/e/fifo/x", FILE, ("ENOTDIR", "d/e/fifo")),
    ("fifo", DIR_OPEN, ("ENOTDIR", "fifo")),
    ("file/x", FILE, ("ENOTDIR", "file")),
    # a NUL byte never reaches the kernel (a C string would end there)
    ("d\0/etc", DIR_OPEN, ("EINVAL", "d\\0/etc")),
]


@pytest.mark.parametrize(("path", "flags", "expected"), CASES, ids=[repr(c[0]) + f"-{i}" for i, c in enumerate(CASES)])
def test_the_walk_gives_each_answer(tree: int, path: str, flags: int, expected: object) -> None:
    want = _ino(tree, expected[1:]) if isinstance(expected, str) else ("refused", *expected)
    assert _answer(open_beneath, tree, path, flags) == want
    assert _answer(walk_components, tree, path, flags) == want


def test_openat2_is_what_answers_here(tree: int) -> None:
    # The kernel's walk is the one under test above: openat2 is there (5.6 and later) and not refused.
    assert beneath._openat2_answers(tree)
    assert beneath._openat2_works(tree)


def test_devices_are_opened_as_the_flags_say_and_no_directory_on_the_way() -> None:
    dev = os.open("/dev", DIR_OPEN)
    try:
        for walk in (open_beneath, walk_components):
            assert _answer(walk, dev, "null/x", FILE) == ("refused", "ENOTDIR", "null")
            fd = walk(dev, "null", FILE)
            try:
                assert stat.S_ISCHR(os.fstat(fd).st_mode)
            finally:
                os.close(fd)
    finally:
        os.close(dev)


def test_a_mount_point_is_crossed_only_without_same_mount() -> None:
    slash = os.open("/", DIR_OPEN)
    try:
        proc = os.open("/proc", DIR_OPEN)
        try:
            assert beneath._mount_of(slash) != beneath._mount_of(proc)
        finally:
            os.close(proc)
        for walk in (open_beneath, walk_components):
            assert _answer(walk, slash, "proc", DIR_OPEN)[0] == "opened"
            assert _answer(walk, slash, "proc", DIR_OPEN, same_mount=True) == ("refused", "EXDEV", "proc")
            assert _answer(walk, slash, "proc/sys", DIR_OPEN, same_mount=True) == ("refused", "EXDEV", "proc")
            assert _answer(walk, slash, "proc/..", DIR_OPEN, same_mount=True) == ("refused", "EXDEV", "proc")
            assert _answer(walk, slash, "etc/..", DIR_OPEN, same_mount=True)[0] == "opened"
    finally:
        os.close(slash)


def test_a_magic_link_is_not_followed() -> None:
    # /proc/self/fd/N is a "magic" link: followed, it would reach the descriptor's file wherever it lies.
    proc = os.open("/proc", DIR_OPEN)
    try:
        for walk in (open_beneath, walk_components):
            assert _answer(walk, proc, f"thread-self/fd/{proc}", DIR_OPEN)[1] == "ELOOP"
            assert _answer(walk, proc, f"{os.getpid()}/fd/{proc}", DIR_OPEN)[1] == "ELOOP"
            assert _answer(walk, proc, f"{os.getpid()}/cwd/x", DIR_OPEN)[1] == "ELOOP"
    finally:
        os.close(proc)


def test_parent_beneath_gives_the_directory_and_the_last_name(tree: int) -> None:
    fd, last = parent_beneath(tree, "d/e/f")
    try:
        assert last == "f" and os.fstat(fd).st_ino == os.stat("d/e", dir_fd=tree).st_ino
    finally:
        os.close(fd)
    fd, last = parent_beneath(tree, "file")
    try:
        assert last == "file" and os.fstat(fd).st_ino == os.fstat(tree).st_ino
    finally:
        os.close(fd)
    for path, err in (("top/e/f", errno.ELOOP), ("/etc/passwd", errno.EXDEV), ("../x", errno.EXDEV),
                      ("d/..", errno.EINVAL), ("", errno.EINVAL), ("d/x\0", errno.EINVAL)):
        with pytest.raises(OSError) as info:
            parent_beneath(tree, path)
        assert info.value.errno == err, path


def test_a_file_is_made_with_o_creat(tree: int) -> None:
    for walk, name in ((open_beneath, "made-1"), (walk_components, "made-2")):
        fd = walk(tree, f"d/e/{name}", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        os.close(fd)
        assert stat.S_IMODE(os.stat(f"d/e/{name}", dir_fd=tree).st_mode) == 0o600
        with pytest.raises(FileExistsError):
            walk(tree, f"d/e/{name}", os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC, 0o600)
        with pytest.raises(OSError) as info:  # O_CREAT through a link on the way makes nothing
            walk(tree, f"d/mid/{name}-x", os.O_WRONLY | os.O_CREAT | os.O_CLOEXEC, 0o600)
        assert info.value.errno == errno.ELOOP



def test_make_beneath_makes_what_is_missing_and_nothing_through_a_link(tree: int) -> None:
    from isolate.kernel.beneath import make_beneath

    fd = make_beneath(tree, "d/e/new/newer", 0o750)
    try:
        assert os.fstat(fd).st_ino == os.stat("d/e/new/newer", dir_fd=tree).st_ino
        assert stat.S_IMODE(os.stat("d/e/new", dir_fd=tree).st_mode) == 0o750 & ~_umask()
    finally:
        os.close(fd)
    os.close(make_beneath(tree, "d/e"))  # there already: opened
    for path, err in (("d/mid/x/y", errno.ELOOP), ("top/x", errno.ELOOP), ("fifo/x", errno.ENOTDIR),
                      ("../x", errno.EXDEV), ("d/../../x", errno.EXDEV), ("/tmp/x", errno.EXDEV)):
        with pytest.raises(OSError) as info:
            make_beneath(tree, path)
        assert info.value.errno == err, path
    assert not os.path.lexists(os.path.join(os.readlink(f"/proc/self/fd/{tree}"), "d", "e", "x"))
    slash = os.open("/", DIR_OPEN)
    try:  # same_mount: a mount point on the way is no place to make anything
        with pytest.raises(OSError) as info:
            make_beneath(slash, "proc/isolate-test", same_mount=True)
        assert info.value.errno == errno.EXDEV
    finally:
        os.close(slash)


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask

# -- openat2 refused by a seccomp filter: the fallback answers ----------------------------------------------

_SECCOMP_CHILD = r"""
import ctypes, errno, os, struct, sys
err = int(sys.argv[1])
# BPF: openat2 (437 on x86_64 and aarch64 alike) -> SECCOMP_RET_ERRNO | err; anything else allowed.
ins = [(0x20, 0, 0, 0), (0x15, 0, 1, 437), (0x06, 0, 0, 0x00050000 | err), (0x06, 0, 0, 0x7FFF0000)]
prog = b"".join(struct.pack("HBBI", *i) for i in ins)
buf = ctypes.create_string_buffer(prog)
fprog = struct.pack("HxxxxxxP", len(ins), ctypes.addressof(buf))
libc = ctypes.CDLL(None, use_errno=True)
from isolate.kernel import beneath
root = os.open(sys.argv[2], os.O_RDONLY | os.O_DIRECTORY)
if sys.argv[3] == "known":  # openat2 answered before the filter came: refused later, the walk takes over
    os.close(beneath.open_beneath(root, "d"))
    assert beneath._OPENAT2[0] is True
ul = ctypes.c_ulong
assert libc.prctl(38, ul(1), ul(0), ul(0), ul(0)) == 0  # PR_SET_NO_NEW_PRIVS
fbuf = ctypes.create_string_buffer(fprog)
assert libc.prctl(22, ul(2), ctypes.c_void_p(ctypes.addressof(fbuf)), ul(0), ul(0)) == 0, ctypes.get_errno()
out = []
for path in ("d/e/f", "top/e/f", "d/e/last", "../x", "fifo/x", "d/missing"):
    try:
        fd = beneath.open_beneath(root, path, os.O_RDONLY | os.O_NONBLOCK)
        out.append(("opened", os.fstat(fd).st_ino))
    except OSError as exc:
        out.append(("refused", errno.errorcode[exc.errno], exc.filename))
print(repr((beneath._OPENAT2[0], out)))
"""


@pytest.mark.parametrize("when", ["known", "first"])
@pytest.mark.parametrize("refusal", [errno.ENOSYS, errno.EPERM])
def test_openat2_refused_by_seccomp_falls_back_to_the_same_answers(tree: int, refusal: int, when: str) -> None:
    if os.uname().machine not in ("x86_64", "aarch64"):
        pytest.skip("the filter names openat2 by its number on x86_64 and aarch64")
    root = os.readlink(f"/proc/self/fd/{tree}")
    done = subprocess.run([sys.executable, "-c", _SECCOMP_CHILD, str(refusal), root, when], capture_output=True,
                          text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr
    used_openat2, answers = ast.literal_eval(done.stdout)
    assert used_openat2 is False  # it learnt openat2 is refused, and walked
    expected = []
    for path in ("d/e/f", "top/e/f", "d/e/last", "../x", "fifo/x", "d/missing"):
        got = _answer(open_beneath, tree, path, os.O_RDONLY | os.O_NONBLOCK)
        expected.append(("opened", got[2]) if got[0] == "opened" else got)
    assert answers == expected


def test_isolate_no_openat2_takes_the_walk(tree: int) -> None:
    root = os.readlink(f"/proc/self/fd/{tree}")
    code = ("import os, sys; from isolate.kernel import beneath; r = os.open(sys.argv[1], os.O_RDONLY); "
            "os.close(beneath.open_beneath(r, 'd/e/f', os.O_RDONLY));\n"
            "os.close(beneath.make_beneath(r, 'd/e/made/here'));\n"
            "try: beneath.open_beneath(r, 'd/mid/f', os.O_RDONLY)\n"
            "except OSError as e: print(beneath._OPENAT2[0], e.errno, e.filename)")
    done = subprocess.run([sys.executable, "-c", code, root], capture_output=True, text=True, timeout=60,
                          env={**os.environ, "ISOLATE_NO_OPENAT2": "1"}, check=False)
    assert done.returncode == 0, done.stderr
    assert done.stdout.split() == ["False", str(errno.ELOOP), "d/mid"]
    assert os.path.isdir(os.path.join(root, "d", "e", "made", "here"))


# -- the callers: where one walk was weaker than the others, the stronger answer is now every caller's ------


def test_a_build_context_source_with_a_nul_byte_is_a_dockerfile_error(tree: int) -> None:
    pytest.importorskip("dockerfile_parse")
    from isolate.image.build import DockerfileError
    from isolate.image.context import open_beneath as source_beneath

    # A C string ends at the NUL: the old walk let os.open's ValueError through, no DockerfileError.
    for source in ("d\0/e/f", "d/e/f\0"):
        with pytest.raises(DockerfileError, match="NUL"):
            source_beneath(tree, source, "COPY")


def test_a_data_directory_is_never_walked_out_of_the_state_directory(tmp_path: object,
                                                                     monkeypatch: pytest.MonkeyPatch) -> None:
    from isolate.backends.native.datadir import open_base

    monkeypatch.setenv("ISOLATE_STATE_DIR", str(tmp_path))
    os.makedirs(os.path.join(str(tmp_path), "sandboxes", "k", "overlay", "base"))
    os.close(open_base("k"))
    # '..' went up from sandboxes/ (any directory of the state directory's parent could be reached so).
    for key, parts in (("..", ()), ("k", ("..", "..", "..")), ("k/../..", ("sandboxes",))):
        with pytest.raises(OSError) as info:
            os.close(open_base(key, parts))
        assert info.value.errno == errno.EXDEV, (key, parts)


@pytest.mark.skipif(os.geteuid() != 0, reason="root: a link owned by another user than its directory's")
def test_a_protected_link_is_a_link_to_the_callers_too() -> None:
    """Linux 6.1 refuses a link in a sticky directory of everyone's, owned by another than the directory's
    owner and the caller (fs.protected_symlinks), with EACCES before RESOLVE_NO_SYMLINKS's ELOOP: the callers
    took the link for a refusal (ci6: a snapshot's archive with a link in /tmp failed to unpack in the VM)."""
    with open("/proc/sys/fs/protected_symlinks") as handle:
        if handle.read().strip() != "1":
            pytest.skip("this host does not protect links in sticky directories (fs.protected_symlinks)")
    import tempfile

    top = tempfile.mkdtemp()
    try:
        os.chmod(top, 0o1777)
        os.symlink("/etc", os.path.join(top, "lnk"))
        os.chown(os.path.join(top, "lnk"), 1000, 1000, follow_symlinks=False)
        fd = os.open(top, DIR_OPEN)
        try:
            for path in ("lnk", "lnk/passwd"):
                with pytest.raises(OSError) as raised:
                    os.close(open_beneath(fd, path, os.O_RDONLY))
                assert raised.value.errno == errno.ELOOP, (path, raised.value)
        finally:
            os.close(fd)
    finally:
        subprocess.run(["rm", "-rf", top], check=False)


_RENAMER = """
import os, sys
a, b = sys.argv[1] + "/a", sys.argv[1] + "/b"
while True:
    os.rename(a, b)
    os.rename(b, a)
"""


def test_openat2_giving_eagain_every_try_falls_back_to_the_walk(tmp_path: object,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    """openat2 says EAGAIN when any rename (the kernel's rename_lock) came while a '..' was walked: a path of
    many '..' under a process renaming in a loop meets one at each of csrc's tries, for real, and the walk
    answers instead, with the same directory."""
    from isolate._core import ffi, lib

    root = str(tmp_path)
    os.makedirs(os.path.join(root, "d"))
    os.makedirs(os.path.join(root, "storm", "a"))
    path = "d/../" * 800 + "d"  # a long walk: a rename lands in it nearly always
    fallbacks: list[str] = []
    real_walk = beneath.walk_components

    def walk(*args: object, **kwargs: object) -> int:
        fallbacks.append(str(args[1]))
        return real_walk(*args, **kwargs)  # type: ignore[arg-type]

    monkeypatch.setattr(beneath, "walk_components", walk)
    fd = os.open(root, DIR_OPEN)
    renamer = subprocess.Popen([sys.executable, "-c", _RENAMER, os.path.join(root, "storm")])
    try:
        want = os.stat(os.path.join(root, "d")).st_ino
        kernel_eagain = 0
        until = time.monotonic() + 10
        while not fallbacks and time.monotonic() < until:
            raw = lib.iso_open_beneath(fd, os.fsencode(path), DIR_OPEN, 0, 0)
            if raw >= 0:
                os.close(raw)
            elif ffi.errno == errno.EAGAIN:
                kernel_eagain += 1
            got = open_beneath(fd, path)
            try:
                assert os.fstat(got).st_ino == want
            finally:
                os.close(got)
    finally:
        renamer.kill()
        renamer.wait()
        os.close(fd)
    if not fallbacks:
        pytest.skip(f"openat2 never gave EAGAIN at every try here in 10 s ({kernel_eagain} times to csrc's own call)")
    assert fallbacks[0] == path and beneath._OPENAT2[0] is True  # EAGAIN is no missing openat2


def test_open_directory_walks_beneath_its_first_directory_and_follows_no_link_there(tmp_path: object) -> None:
    from isolate.kernel.links import open_directory
    from isolate.model.errors import PolicyError

    root = str(tmp_path)
    os.makedirs(os.path.join(root, "a", "b"))
    os.symlink("b", os.path.join(root, "a", "link"))
    with open(os.path.join(root, "a", "file"), "w"):
        pass
    fd = open_directory(os.path.join(root, "a", "b"))
    try:
        assert os.fstat(fd).st_ino == os.stat(os.path.join(root, "a", "b")).st_ino
    finally:
        os.close(fd)
    for bad, part in (("a/link", "link"), ("a/link/c", "link"), ("a/file/c", "file")):
        with pytest.raises(PolicyError, match=f": {part} on the way is a link"):
            open_directory(os.path.join(root, bad), create=True)
    with pytest.raises(PolicyError, match=r"'\.\.' on the way"):
        open_directory(os.path.join(root, "a", "..", "a"))
    with pytest.raises(FileNotFoundError):
        open_directory(os.path.join(root, "a", "new", "deeper"))
    os.close(open_directory(os.path.join(root, "a", "new", "deeper"), create=True))
    assert stat.S_IMODE(os.stat(os.path.join(root, "a", "new")).st_mode) == 0o700 & ~_umask()
    assert not os.path.exists(os.path.join(root, "a", "b", "c"))


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
