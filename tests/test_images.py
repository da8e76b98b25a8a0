"""Images: a policy naming an image is run from that image, or refused; never run on the host's root."""

from __future__ import annotations

import json
import os
import stat
import subprocess
import tarfile
import threading
from pathlib import Path
from typing import Any

import imagekit as kit
import pytest
from conftest import ISOLATE_RUN, skip_unless_runnable

import isolate
from isolate.image import BadImageError, Image, Reference, Store
from isolate.oneshot import runs


def test_an_image_not_in_the_store_is_refused_never_run_on_the_hosts_root(tmp_path: Path,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ISOLATE_IMAGE_STORE", str(tmp_path / "empty"))
    policy = isolate.Policy(image="debian:12", backend="native")
    with pytest.raises(isolate.IsolationError, match="not in the image store"):
        isolate.run(["cat", "/etc/os-release"], policy=policy, capture_output=True)


def test_best_effort_does_not_drop_the_image() -> None:
    policy = isolate.Policy(image="debian:12", backend="native", best_effort=True, namespaces=False)
    with pytest.raises(isolate.UnsupportedError, match="image: an image's root needs namespaces"):
        isolate.run(["true"], policy=policy)


def test_auto_without_namespaces_never_runs_an_image_on_the_hosts_root() -> None:
    policy = isolate.Policy(image="debian:12", best_effort=True, namespaces=False)
    try:
        backend = runs.choose_backend(policy)
    except isolate.UnsupportedError as exc:
        assert "image: " in str(exc)  # no Docker here: refused, naming the image as the cause
    else:
        assert backend == "docker"


def test_the_cli_refuses_an_image_it_cannot_run_with_one_line(tmp_path: Path) -> None:
    args = ["--backend", "native", "--no-namespaces", "--image", "debian:12", "--", "cat", "/etc/os-release"]
    skip_unless_runnable(args)
    env = dict(os.environ, ISOLATE_RUN_TRACE="1", ISOLATE_IMAGE_STORE=str(tmp_path / "s"))
    for _ in range(2):  # the second run must not replay a plan the first one cached
        result = subprocess.run([ISOLATE_RUN, *args], capture_output=True, text=True, timeout=60, env=env)
        assert result.returncode == 125, result.stderr
        assert "PRETTY_NAME" not in result.stdout
        errors = [line for line in result.stderr.splitlines() if "trace:" not in line]
        assert len(errors) == 1 and "--backend docker" in errors[0], result.stderr
        assert "replaying the cached plan" not in result.stderr


# -- the store: references, loading, sharing, refusing ------------------------------------------------


@pytest.mark.parametrize(("text", "expected"), [
    ("python:3.12", "docker.io/library/python:3.12"),
    ("debian", "docker.io/library/debian:latest"),
    ("user/app", "docker.io/user/app:latest"),
    ("index.docker.io/library/busybox:1", "docker.io/library/busybox:1"),
    ("localhost:5000/a/b:c", "localhost:5000/a/b:c"),
    ("127.0.0.1:5000/x", "127.0.0.1:5000/x:latest"),
    ("ghcr.io/o/r@sha256:" + "a" * 64, "ghcr.io/o/r@sha256:" + "a" * 64),
    ("r:t@sha256:" + "b" * 64, "docker.io/library/r:t@sha256:" + "b" * 64),
])
def test_references_are_normalized_as_docker_does(text: str, expected: str) -> None:
    assert str(Reference.parse(text)) == expected


@pytest.mark.parametrize("text", ["", "UPPER/case", "a@sha256:short", "a:b:c", "a//b", " a"])
def test_bad_references_are_refused(text: str) -> None:
    with pytest.raises(isolate.PolicyError):
        Reference.parse(text)


@pytest.fixture
def store(tmp_path: Path) -> Store:
    return Store(tmp_path / "store")


def layer_dirs(store: Store) -> list[str]:
    return sorted(os.listdir(os.path.join(store.path, "layers")))


def test_an_oci_layout_loads_with_whiteouts_opaque_dirs_hard_links_and_no_set_id(tmp_path: Path,
                                                                              store: Store) -> None:
    base = kit.layer([{"name": "etc", "type": "dir"}, {"name": "etc/gone", "data": b"x"},
                      {"name": "opt", "type": "dir"}, {"name": "opt/old", "data": b"o"},
                      {"name": "bin", "type": "dir"}, {"name": "bin/su", "data": b"#!", "mode": 0o4755},
                      {"name": "bin/two", "type": "hard", "target": "bin/su"}])
    top = kit.layer([{"name": "etc/.wh.gone"}, {"name": "opt", "type": "dir"}, {"name": "opt/.wh..wh..opq"},
                     {"name": "opt/new", "data": b"n"}])
    kit.oci_layout(str(tmp_path / "oci"), [base, top], ref="demo:2", Env=["A=1"], Cmd=["sh"])
    image = Image.load(tmp_path / "oci", store=store)
    assert image.reference == "docker.io/library/demo:2"
    assert image.config.environment() == {"A": "1"} and image.config.command() == ["sh"]
    top_dir, base_dir = image.lower_dirs()
    whiteout = os.lstat(os.path.join(top_dir, "etc/gone"))
    assert stat.S_ISCHR(whiteout.st_mode) and whiteout.st_rdev == 0
    assert os.getxattr(os.path.join(top_dir, "opt"), "user.overlay.opaque") == b"y"
    su = os.lstat(os.path.join(base_dir, "bin/su"))
    assert not su.st_mode & (stat.S_ISUID | stat.S_ISGID) and su.st_mode & 0o777 == 0o755
    assert os.lstat(os.path.join(base_dir, "bin/two")).st_ino == su.st_ino
    info = os.stat(store.path)
    assert info.st_uid == os.geteuid() and stat.S_IMODE(info.st_mode) == 0o700
    assert [i.reference for i in Image.list(store)] == ["docker.io/library/demo:2"]


def test_a_layer_two_images_share_is_kept_and_unpacked_once(tmp_path: Path, store: Store) -> None:
    shared = kit.layer([{"name": "shared", "data": b"s" * 1000}])
    kit.oci_layout(str(tmp_path / "a"), [shared, kit.layer([{"name": "a", "data": b"a"}])], ref="a:1")
    kit.oci_layout(str(tmp_path / "b"), [shared, kit.layer([{"name": "b", "data": b"b"}])], ref="b:1")
    a = Image.load(tmp_path / "a", store=store)
    inode = os.stat(a.lower_dirs()[-1]).st_ino
    b = Image.load(tmp_path / "b", store=store)
    assert a.layers[0] == b.layers[0] and os.stat(b.lower_dirs()[-1]).st_ino == inode
    assert len(layer_dirs(store)) == 3
    a.remove()
    assert Image.prune(store) == [a.layers[1]]
    assert len(layer_dirs(store)) == 2 and [i.reference for i in Image.list(store)] == ["docker.io/library/b:1"]
    b.remove()
    Image.prune(store)
    assert layer_dirs(store) == []


def test_concurrent_loads_of_one_layer_unpack_it_once(tmp_path: Path, store: Store) -> None:
    raw = kit.gz(kit.layer([{"name": "f", "data": b"x" * 100000}]))
    opened = []

    def opener() -> Any:
        import io

        opened.append(1)
        return io.BytesIO(raw)

    errors: list[BaseException] = []

    def worker() -> None:
        try:
            Store(store.path).ensure_layer(kit.digest(raw), opener, diff_id=None, what="layer")
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    threads = [threading.Thread(target=worker) for _ in range(6)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert not errors and len(opened) == 1 and len(layer_dirs(store)) == 1


def test_a_blob_that_does_not_match_its_digest_keeps_nothing(tmp_path: Path, store: Store) -> None:
    layout = tmp_path / "oci"
    kit.oci_layout(str(layout), [kit.layer([{"name": "f", "data": b"good"}])])
    manifest = json.loads((layout / "index.json").read_text())["manifests"][0]["digest"]
    layer_digest = json.loads((layout / "blobs/sha256" / manifest[7:]).read_bytes())["layers"][0]["digest"]
    (layout / "blobs/sha256" / layer_digest[7:]).write_bytes(kit.gz(kit.layer([{"name": "f", "data": b"evil"}])))
    with pytest.raises(BadImageError, match="does not match its digest"):
        Image.load(layout, store=store)
    assert layer_dirs(store) == [] and os.listdir(os.path.join(store.path, "tmp")) == []
    assert Image.list(store) == []


def test_a_layout_whose_files_are_a_fifo_or_a_device_is_refused_not_read_for_ever(tmp_path: Path,
                                                                                  store: Store) -> None:
    # A blob that is a FIFO hung the load; a docker-save directory's layer /dev/zero (through a linked
    # directory) was hashed for ever.
    manifest = kit.oci_layout(str(tmp_path / "oci"), [kit.layer([{"name": "f", "data": b"x"}])])
    blob = tmp_path / "oci" / "blobs" / "sha256" / manifest[7:]
    os.unlink(blob)
    os.mkfifo(blob)
    with pytest.raises(BadImageError, match="not a regular file"):
        Image.load(tmp_path / "oci", store=store)
    saved = tmp_path / "saved"
    saved.mkdir()
    config = kit.config_for([])
    (saved / "config.json").write_bytes(config)
    (saved / "manifest.json").write_text(json.dumps([{"Config": "config.json", "Layers": ["dev/zero"]}]))
    (saved / "dev").mkdir()
    os.mkfifo(saved / "dev" / "zero")  # a linked /dev: test_a_layout_whose_directories_are_links_elsewhere_is_refused
    with pytest.raises(BadImageError, match="not a regular file"):
        Image.load(saved, store=store)


def test_a_layout_whose_directories_are_links_elsewhere_is_refused(tmp_path: Path, store: Store) -> None:
    # A layout's "blobs" (or a docker-save directory's layer directory) linked elsewhere: the host read, as the
    # image's blobs, whatever files lay there that the digests named (a root caller's: any file of the host), and
    # /dev/zero through a linked /dev for ever. Nothing on the way to a file of the layout is followed.
    kit.oci_layout(str(tmp_path / "elsewhere"), [kit.layer([{"name": "secret", "data": b"the host's\n"}])])
    layout = tmp_path / "oci"
    layout.mkdir()
    for name in ("index.json", "oci-layout"):
        (layout / name).write_bytes((tmp_path / "elsewhere" / name).read_bytes())
    os.symlink(tmp_path / "elsewhere" / "blobs", layout / "blobs")
    with pytest.raises(BadImageError, match="a link or no directory on the way"):
        Image.load(layout, store=store)
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "config.json").write_bytes(kit.config_for([]))
    (saved / "manifest.json").write_text(json.dumps([{"Config": "config.json", "Layers": ["dev/zero"]}]))
    os.symlink("/dev", saved / "dev")
    with pytest.raises(BadImageError, match="a link or no directory on the way"):
        Image.load(saved, store=store)


def test_a_docker_save_archive_loads(tmp_path: Path, store: Store) -> None:
    kit.docker_archive(str(tmp_path / "saved.tar"), [kit.layer([{"name": "hello", "data": b"hi"}])],
                       WorkingDir="/w", User="1000", Entrypoint=["/bin/sh", "-c"])
    image = Image.load(tmp_path / "saved.tar", store=store)
    assert image.reference == "docker.io/library/saved:1"
    assert (image.config.working_dir, image.config.user) == ("/w", "1000")
    assert open(os.path.join(image.lower_dirs()[0], "hello"), "rb").read() == b"hi"
    assert Image.get("saved:1", store) == image and Image.get(image.short_id, store) == image


def test_an_oci_layout_in_a_tar_loads(tmp_path: Path, store: Store) -> None:
    kit.oci_layout(str(tmp_path / "oci"), [kit.layer([{"name": "x", "data": b"1"}])], compress=False)
    with tarfile.open(tmp_path / "oci.tar", "w") as tar:
        tar.add(tmp_path / "oci", arcname=".")
    assert Image.load(tmp_path / "oci.tar", store=store).reference == "docker.io/library/test:1"


def test_a_store_another_user_could_write_is_refused(tmp_path: Path) -> None:
    path = tmp_path / "open"
    path.mkdir(mode=0o777)
    os.chmod(path, 0o777)
    with pytest.raises(isolate.IsolationError, match="never shared"):
        Image.list(Store(path))


def _as_nobody(*command: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", "--clear-groups", *command],
                          capture_output=True, text=True, timeout=30)


@pytest.mark.parametrize("mode", [0o777, 0o775])
def test_a_store_under_a_directory_others_could_write_is_refused(mode: int, tmp_path: Path) -> None:
    # The store itself was checked (0700, the caller's), the way to it not: a user who could write its parent
    # could rename it away and put their own in its place, and the store object, checked once, used theirs.
    parent = tmp_path / "shared"
    parent.mkdir()
    os.chmod(parent, mode)
    with pytest.raises(isolate.IsolationError, match="another user could rename it and put their own in its place"):
        Image.list(Store(parent / "store"))


def test_the_store_is_checked_at_each_use_not_once(tmp_path: Path) -> None:
    parent = tmp_path / "mine"
    parent.mkdir(mode=0o755)
    store = Store(parent / "store")
    assert Image.list(store) == []
    os.chmod(parent, 0o777)  # now others could swap it: the next use says so
    with pytest.raises(isolate.IsolationError, match="writable by others"):
        store.get_blob("sha256:" + "0" * 64, "blob")
    with pytest.raises(isolate.IsolationError, match="writable by others"):
        store.layer_dir("sha256:" + "0" * 64)


@pytest.mark.skipif(os.geteuid() != 0, reason="needs a root caller to act as another user")
def test_another_user_cannot_swap_a_store_under_a_sticky_directory_and_the_store_there_is_kept(
        workdir: str) -> None:
    # Why the check of the way is sound, and once per use enough: under a sticky directory (/tmp) only the
    # entry's owner or root may rename it; under one writable by others and not sticky anyone may, and such a
    # store is refused before any use.
    base = Path(workdir)  # a way 65534 may walk
    sticky = base / "sticky"
    sticky.mkdir()
    os.chmod(sticky, 0o1777)
    store = Store(sticky / "store")
    assert Image.list(store) == []
    swap = _as_nobody("mv", str(sticky / "store"), str(sticky / "theirs"))
    assert swap.returncode != 0 and "not permitted" in swap.stderr, swap
    assert Image.list(store) == []
    open_dir = base / "open"
    open_dir.mkdir()
    os.chmod(open_dir, 0o777)
    os.mkdir(open_dir / "store", 0o700)
    swap = _as_nobody("mv", str(open_dir / "store"), str(open_dir / "theirs"))
    assert swap.returncode == 0, swap  # the swap this refusal is about
    with pytest.raises(isolate.IsolationError, match="writable by others"):
        Image.list(Store(open_dir / "store"))


BAD_LAYERS: dict[str, tuple[list[list[dict[str, Any]]], str]] = {
    "absolute": ([[{"name": "/etc/passwd", "data": b"x"}]], "absolute name"),
    "dotdot": ([[{"name": "a/../../x", "data": b"x"}]], "climbs out"),
    "through-link": ([[{"name": "l", "type": "link", "target": "/etc"}, {"name": "l/x", "data": b"x"}]],
                     "written through 'l'"),
    # A directory written in (its descriptor kept open by the unpack) replaced by a link later in its layer: what
    # follows goes through the link, refused, not into the directory removed.
    "dir-replaced-by-link": ([[{"name": "d", "type": "dir"}, {"name": "d/a", "data": b"x"},
                               {"name": "d", "type": "link", "target": "/etc"}, {"name": "d/x", "data": b"x"}]],
                             "written through 'd'"),
    "earlier-layer-link": ([[{"name": "l", "type": "link", "target": "/etc"}], [{"name": "l/x", "data": b"x"}]],
                           "a link an earlier layer planted"),
    "hard-link-out": ([[{"name": "h", "type": "hard", "target": "etc/shadow"}]], "no file of this layer"),
    "device": ([[{"name": "null", "type": "chr"}]], "device node"),
    "capability": ([[{"name": "ping", "data": b"x", "xattrs": {"security.capability": "\x01"}}]],
                   "security.capability"),
    "trusted": ([[{"name": "d", "type": "dir", "xattrs": {"trusted.overlay.opaque": "y"}}]], "trusted."),
    "too-large": ([[{"name": "big", "size": 3 << 20}]], "max_image_size"),
    # A file replaced by a link later in its layer: a hard link to its name was a second link, unseen by the
    # check of links across layers.
    "hard-link-to-a-replaced-file": ([[{"name": "a", "data": b"x"}, {"name": "a", "type": "link", "target": "/etc"},
                                       {"name": "d", "type": "hard", "target": "a"}], [{"name": "d/x", "data": b"x"}]],
                                     "is a hard link to 'a'"),
    # Header numbers nothing takes: ValueError and OverflowError escaped the loader.
    "mtime-nan": ([[{"name": "f", "data": b"x", "pax": {"mtime": "nan"}}]], "a header's value"),
    "mtime-past-time_t": ([[{"name": "f", "data": b"x", "pax": {"mtime": "1e400"}}]], "a header's value"),
    "sparse-map-cut": ([[{"name": "f", "data": b"x", "pax": {"GNU.sparse.major": "1", "GNU.sparse.minor": "0",
                                                             "GNU.sparse.name": "f", "GNU.sparse.realsize": "9"}}]],
                       "a header's value"),
}


@pytest.mark.parametrize("case", sorted(BAD_LAYERS))
def test_each_bad_layer_is_refused_with_its_reason_and_nothing_kept(case: str, tmp_path: Path) -> None:
    layers, reason = BAD_LAYERS[case]
    store = Store(tmp_path / "store", max_image_size=2 << 20)
    kit.oci_layout(str(tmp_path / "oci"), [kit.layer(entries) for entries in layers])
    with pytest.raises(BadImageError) as caught:
        Image.load(tmp_path / "oci", store=store)
    message = str(caught.value)
    assert reason in message and "\n" not in message, message
    assert Image.list(store) == [] and os.listdir(os.path.join(store.path, "tmp")) == []
    assert not os.path.exists("/etc/x") and not os.path.exists(str(tmp_path / "x"))


@pytest.mark.host_independent  # the host's unpacker counting (25 s per caller under the VM's emulation)
def test_a_decompression_bomb_is_refused_while_it_expands(tmp_path: Path) -> None:
    bomb = kit.layer([{"name": "zeros", "size": 64 << 20}])
    compressed = kit.gz(bomb)
    assert len(compressed) < (1 << 20)
    store = Store(tmp_path / "store", max_image_size=8 << 20)
    kit.oci_layout(str(tmp_path / "oci"), [bomb])
    with pytest.raises(BadImageError, match="max_image_size"):
        Image.load(tmp_path / "oci", store=store)
    assert layer_dirs(store) == []


def test_an_endless_blob_after_a_small_layer_is_refused_at_max_image_size(tmp_path: Path) -> None:
    # gzip takes zero bytes after its stream as padding: the blob was read for ever (a registry's endless
    # answer), the bound on the decompressed stream never reached.
    import io

    raw = kit.gz(kit.layer([{"name": "f", "data": b"x"}]))

    class Endless(io.RawIOBase):
        def __init__(self) -> None:
            self.head, self.sent = raw, 0

        def readable(self) -> bool:
            return True

        def readinto(self, buffer: Any) -> int:
            data, self.head = (self.head[:len(buffer)], self.head[len(buffer):]) if self.head else (
                bytes(len(buffer)), b"")
            self.sent += len(data)
            assert self.sent < 64 << 20, "read on past any bound"
            buffer[:len(data)] = data
            return len(data)

    store = Store(tmp_path / "store", max_image_size=1 << 20)
    with pytest.raises(BadImageError, match="past max_image_size"):
        store.ensure_layer(kit.digest(raw), Endless, diff_id=None, what="layer")
    assert layer_dirs(store) == []


def test_zstd_and_uncompressed_layers_load(tmp_path: Path, store: Store) -> None:
    zstandard = pytest.importorskip("zstandard")
    plain = kit.layer([{"name": "plain", "data": b"p"}])
    packed = kit.layer([{"name": "packed", "data": b"z"}])
    layout = tmp_path / "oci"
    kit.oci_layout(str(layout), [plain, packed], compress=False)
    # Re-write the second layer zstd-compressed, the manifest pointing at it (the config's diff id stays).
    index = json.loads((layout / "index.json").read_text())
    manifest_path = layout / "blobs/sha256" / index["manifests"][0]["digest"][7:]
    manifest = json.loads(manifest_path.read_bytes())
    blob = zstandard.ZstdCompressor().compress(packed)
    (layout / "blobs/sha256" / kit.digest(blob)[7:]).write_bytes(blob)
    manifest["layers"][1] = {"mediaType": "application/vnd.oci.image.layer.v1.tar+zstd", "digest": kit.digest(blob),
                             "size": len(blob)}
    data = json.dumps(manifest).encode()
    (layout / "blobs/sha256" / kit.digest(data)[7:]).write_bytes(data)
    index["manifests"][0].update(digest=kit.digest(data), size=len(data))
    (layout / "index.json").write_text(json.dumps(index))
    image = Image.load(layout, store=store)
    top, bottom = image.lower_dirs()
    assert os.listdir(top) == ["packed"] and os.listdir(bottom) == ["plain"]


def test_a_huge_extended_header_is_refused_before_it_is_read(tmp_path: Path, store: Store) -> None:
    import io

    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        info = tarfile.TarInfo("f")
        info.pax_headers = {"comment": "x" * (2 << 20)}
        tar.addfile(info, io.BytesIO(b""))
    kit.oci_layout(str(tmp_path / "oci"), [out.getvalue()])
    with pytest.raises(BadImageError, match="extended tar header"):
        Image.load(tmp_path / "oci", store=store)


def test_work_left_by_a_dead_process_is_cleared_and_a_running_ones_kept(tmp_path: Path) -> None:
    store = Store(tmp_path / "store")
    Image.list(store)  # made
    dead = subprocess.Popen(["true"])
    dead.wait()
    tmp = os.path.join(store.path, "tmp")
    os.makedirs(os.path.join(tmp, f"layer-{'a' * 64}-{dead.pid}-1", "root"))
    os.makedirs(os.path.join(tmp, f"layer-{'b' * 64}-{os.getpid()}-1", "root"))
    os.utime(os.path.join(tmp, f"layer-{'b' * 64}-{os.getpid()}-1"), (0, 0))  # old, and still in use
    Image.list(Store(store.path))
    assert os.listdir(tmp) == [f"layer-{'b' * 64}-{os.getpid()}-1"]


def test_the_image_class_is_isolates() -> None:
    assert isolate.Image is Image and "Image" in isolate.__all__


def test_a_name_an_archive_chose_reaches_the_terminal_on_one_line_and_inert(tmp_path: Path) -> None:
    # A docker-save directory's layer name (any string) was printed as it came: a newline broke the one line, an
    # escape sequence reached the user's terminal.
    saved = tmp_path / "saved"
    saved.mkdir()
    (saved / "config.json").write_bytes(kit.config_for([]))
    (saved / "manifest.json").write_text(json.dumps([{"Config": "config.json", "Layers": ["a\n\x1b[2Jb"]}]))
    env = dict(os.environ, ISOLATE_IMAGE_STORE=str(tmp_path / "store"))
    result = subprocess.run([ISOLATE_RUN, "image", "load", str(saved)], capture_output=True, text=True, timeout=60,
                            env=env)
    assert result.returncode == 125
    assert result.stderr.count("\n") == 1 and "\x1b" not in result.stderr and "\\x1b[2Jb" in result.stderr


def test_a_config_value_of_another_type_or_with_a_nul_is_refused_not_dropped() -> None:
    """Before: an Env entry that was not a text was dropped, and a WorkingDir or an Env value with a NUL was cut
    there when the sandbox started: the sandbox ran other than the image said. Docker refuses both."""
    from isolate.image import BadImageError, ImageConfig

    good = ImageConfig.from_json({"config": {"Env": ["A=1"], "WorkingDir": "/w", "User": "app", "Entrypoint": None,
                                             "Cmd": ["sh"]}})
    assert good.environment() == {"A": "1"} and good.command() == ["sh"] and good.working_dir == "/w"
    assert ImageConfig.from_json({}) == ImageConfig()
    for name, bad in (("Env", ["A=1", 5]), ("Env", ["A=1\0B=2"]), ("Env", "A=1"), ("WorkingDir", "/w\0/x"),
                      ("WorkingDir", 7), ("User", ["0"]), ("User", "app\0"), ("Cmd", [["sh"]]), ("Entrypoint", {})):
        with pytest.raises(BadImageError, match=f"config: {name}: expected"):
            ImageConfig.from_json({"config": {name: bad}})


# What is no archive is refused at once, in one line: a FIFO hung the load (opened, waiting for a writer),
# "" was an unexpected ValueError of tarfile's, and a file that is no tar listed each compression tried.
@pytest.mark.parametrize("what", ["fifo", "empty name", "not a tar", "absent"])
def test_what_is_no_archive_is_refused_in_one_line(tmp_path: Path, what: str) -> None:
    path = {"fifo": str(tmp_path / "fifo"), "empty name": "", "not a tar": str(tmp_path / "text"),
            "absent": str(tmp_path / "absent")}[what]
    if what == "fifo":
        os.mkfifo(path)
    elif what == "not a tar":
        Path(path).write_text("hello\n" * 100)
    try:
        done = subprocess.run([ISOLATE_RUN, "image", "--image-store", str(tmp_path / "store"), "load", path],
                              capture_output=True, text=True, timeout=60)
    except subprocess.TimeoutExpired:
        pytest.fail(f"image load of a {what} hung")
    assert done.returncode == 125 and len(done.stderr.splitlines()) == 1, done.stderr
    assert "unexpected" not in done.stderr and "Traceback" not in done.stderr


@pytest.mark.parametrize("form", ["docker", "oci"])
def test_an_image_of_more_layers_than_any_runs_is_refused_before_they_are_read(form: str, tmp_path: Path) -> None:
    # A 4 MiB manifest names 50,000 layers: a docker save archive's one layer file named so often was hashed whole
    # each time (a gigabyte each) before the config's diff ids were counted, a load that never ended.
    from isolate.image.archive import MAX_LAYERS

    raw = kit.layer([{"name": "f", "data": b"x"}])
    layers = [raw] * (MAX_LAYERS + 1)
    if form == "docker":
        kit.docker_archive(str(tmp_path / "image.tar"), layers)
        path = tmp_path / "image.tar"
    else:
        kit.oci_layout(str(tmp_path / "oci"), layers)
        path = tmp_path / "oci"
    with pytest.raises(BadImageError, match=f"{MAX_LAYERS + 1} layers, past the {MAX_LAYERS}"):
        Image.load(path, store=Store(tmp_path / "store"))
    # Within the bound, the same layer many times over loads.
    small = [raw] * 40
    kit.docker_archive(str(tmp_path / "ok.tar"), small, tag="ok:1")
    assert len(Image.load(tmp_path / "ok.tar", store=Store(tmp_path / "store")).layers) == 40


def test_a_sparse_file_in_an_image_archive_is_refused_before_it_is_read(tmp_path: Path) -> None:
    # A docker save archive's layer file is hashed whole; as a sparse member (GNU sparse 1.0 in pax), its size is
    # the map's word: an archive of 20 KB was read as a petabyte of zeros, a load that never ended.
    import io

    from conftest import finishes

    raw = kit.layer([{"name": "f", "data": b"x"}])
    path = tmp_path / "image.tar"
    with tarfile.open(path, "w", format=tarfile.PAX_FORMAT) as tar:
        sparse_map = b"1\n0\n%d\n" % len(raw)
        data = sparse_map + bytes(-len(sparse_map) % tarfile.BLOCKSIZE) + raw
        info = tarfile.TarInfo("l0/layer.tar")
        info.size = len(data)
        info.pax_headers = {"GNU.sparse.major": "1", "GNU.sparse.minor": "0", "GNU.sparse.name": "l0/layer.tar",
                            "GNU.sparse.realsize": str(1 << 50)}
        tar.addfile(info, io.BytesIO(data))
        for name, content in (("config.json", kit.config_for([raw])),
                              ("manifest.json", json.dumps([{"Config": "config.json", "RepoTags": ["sparse:1"],
                                                             "Layers": ["l0/layer.tar"]}]).encode())):
            member = tarfile.TarInfo(name)
            member.size = len(content)
            tar.addfile(member, io.BytesIO(content))
    assert path.stat().st_size < 64 << 10
    done, outcome = finishes(lambda: Image.load(path, store=Store(tmp_path / "store")), 30)
    assert done, "the load of an archive with a sparse layer file did not end"
    assert isinstance(outcome, BadImageError) and "sparse" in str(outcome), outcome


def test_json_nested_past_the_parsers_stack_is_a_refusal_not_a_recursion_error(tmp_path: Path,
                                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    # json's decoder raises RecursionError (no ValueError) for arrays nested past the interpreter's stack: a docker
    # save archive's manifest.json, an OCI index, a Dockerfile's JSON form and a registry auth file (in a home a
    # sandbox may write) ended a load, build or pull in it (the CLI: "unexpected RecursionError").
    from isolate.image.registry import credentials

    deep = "[" * 100_000 + "]" * 100_000
    (tmp_path / "save").mkdir()
    (tmp_path / "save" / "manifest.json").write_text(deep)
    (tmp_path / "oci").mkdir()
    (tmp_path / "oci" / "index.json").write_text('{"manifests": ' + deep + "}")
    (tmp_path / "oci" / "oci-layout").write_text("{}")
    for path in ("save", "oci"):
        with pytest.raises(BadImageError, match="not valid JSON"):
            Image.load(tmp_path / path, store=Store(tmp_path / "store"))
    auth = tmp_path / "auth.json"
    auth.write_text('{"auths": ' + deep + "}")
    monkeypatch.setenv("REGISTRY_AUTH_FILE", str(auth))
    monkeypatch.setenv("DOCKER_CONFIG", str(tmp_path / "none"))
    monkeypatch.setenv("HOME", str(tmp_path))
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)
    assert credentials("127.0.0.1:5000") is None
    pytest.importorskip("dockerfile_parse", reason="Dockerfiles need the images extra: pip install 'isolate[images]'")
    from isolate.image.dockerfile import DockerfileError

    (tmp_path / "ctx").mkdir()
    (tmp_path / "ctx" / "Dockerfile").write_text("FROM scratch\nCMD " + deep + "\n")
    with pytest.raises(DockerfileError, match="nested too deep"):
        Image.from_dockerfile(tmp_path / "ctx" / "Dockerfile", tmp_path / "ctx", store=Store(tmp_path / "store"))


# An option given an empty value (a script's unset variable) was taken for one not given: push --to "" pushed to
# the image's own name, build -t "" kept the image under a made-up one, --image-store "" used the default store.
@pytest.mark.parametrize("args", [["push", "x:1", "--to", ""], ["build", ".", "-t", ""], ["build", ".", "--target", ""],
                                  ["pull", "x:1", "--cert-dir", ""], ["--image-store", "", "ls"]])
def test_an_image_option_given_an_empty_value_is_refused_in_one_line(args: list[str], tmp_path: Path) -> None:
    env = {**os.environ, "ISOLATE_IMAGE_STORE": str(tmp_path / "store")}
    done = subprocess.run([ISOLATE_RUN, "image", *args], capture_output=True, text=True, timeout=60, cwd=tmp_path,
                          env=env)
    assert done.returncode == 125 and len(done.stderr.splitlines()) == 1, done.stderr
    assert "an empty value" in done.stderr and "Traceback" not in done.stderr
