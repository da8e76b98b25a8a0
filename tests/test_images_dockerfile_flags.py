"""Dockerfile flags: COPY/ADD ``--chown`` and ``--chmod`` (names from the image's own /etc/passwd and
/etc/group, never through a link), ``RUN --mount=type=cache`` (kept between builds, never in the image),
bad values and other flags refused naming the line."""

from __future__ import annotations

import gzip
import io
import os
import subprocess
import tarfile
from collections.abc import Iterator
from pathlib import Path

import imagekit as kit
import pytest
from conftest import ISOLATE_RUN, NAMESPACES_WHY

import isolate
from isolate.image import Image, Store
from isolate.image.context import _copy_layer
from isolate.image.dockerfile import DockerfileError

pytestmark = pytest.mark.skipif(bool(NAMESPACES_WHY) or not os.path.exists("/bin/busybox"),
                                reason=NAMESPACES_WHY or "busybox-static is not installed")
pytest.importorskip("dockerfile_parse")

# app is 65534, the one id besides root a sandbox maps (its program's): its files show as its own there, and
# every id the sandbox does not map shows as the overflow id, 65534 too; the layer test checks the numbers.
PASSWD = b"root:x:0:0:root:/root:/bin/sh\napp:x:65534:65534::/home/app:/bin/sh\n"
GROUP = b"root:x:0:\nstaff:x:3456:app\napp:x:65534:\n"

DOCKERFILE = """\
FROM base:1
ARG OWNER=app
COPY --chown=${OWNER} --chmod=0640 a.txt /data/a.txt
COPY --chown=app:staff src/ /data/src/
COPY --chown=77:88 --chmod=750 run.sh /data/
ADD --chown=1:staff bundle.tar /data/bundle/
ADD --chmod=600 notes.txt /data/notes.txt
COPY a.txt /data/plain.txt
"""
CHECK = ("stat -c '%n %u:%g %a' /data /data/a.txt /data/src /data/src/b.txt /data/run.sh /data/bundle/inside.txt "
         "/data/notes.txt /data/plain.txt")
SEEN = "65534:65534"  # app's, or unmapped ids (77, 88, 1, 3456)
EXPECTED = {"/data": (SEEN, "755"), "/data/a.txt": (SEEN, "640"), "/data/src": (SEEN, "755"),
            "/data/src/b.txt": (SEEN, "644"), "/data/run.sh": (SEEN, "750"),
            "/data/bundle/inside.txt": (SEEN, "644"), "/data/notes.txt": ("0:0", "600"),
            "/data/plain.txt": ("0:0", "644")}


def _base(tmp_path: Path, extra: list[dict[str, object]]) -> Store:
    store = Store(tmp_path / "store")
    kit.oci_layout(str(tmp_path / "base"), [kit.busybox_layer(extra)], ref="base:1", Env=["PATH=/bin"])
    Image.load(tmp_path / "base", store=store)
    return store


@pytest.fixture(scope="module")
def context(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """One store and context for the module (each test writes its own Dockerfile): the base image is made once."""
    tmp_path = tmp_path_factory.mktemp("flags")
    os.chmod(tmp_path, 0o755)
    with kit.store_env(str(tmp_path / "store")):
        _base(tmp_path, [{"name": "etc/passwd", "data": PASSWD}, {"name": "etc/group", "data": GROUP}])
        ctx = tmp_path / "ctx"
        (ctx / "src").mkdir(parents=True)
        for name, data, mode in (("a.txt", "a\n", 0o644), ("src/b.txt", "b\n", 0o644), ("run.sh", "echo\n", 0o644),
                                 ("notes.txt", "n\n", 0o644)):
            (ctx / name).write_text(data)
            os.chmod(ctx / name, mode)
        os.chmod(ctx / "src", 0o755)
        with tarfile.open(ctx / "bundle.tar", "w") as tar:
            info = tarfile.TarInfo("inside.txt")
            info.size, info.mode, info.uid = 3, 0o644, 4321
            tar.addfile(info, io.BytesIO(b"in\n"))
        yield ctx


def _build(ctx: Path, text: str, ref: str = "flags:1") -> Image:
    (ctx / "Dockerfile").write_text(text)
    return Image.from_dockerfile(ctx / "Dockerfile", ctx, reference=ref)


def test_chown_and_chmod_are_what_a_sandbox_of_the_image_sees(context: Path) -> None:
    image = _build(context, DOCKERFILE)
    with isolate.Sandbox(policy=isolate.Policy(image=image.reference, backend="native")) as box:
        done = box.exec(["sh", "-c", CHECK])
    assert done.returncode == 0, done.stderr
    seen = {line.split()[0]: tuple(line.split()[1:]) for line in done.stdout.splitlines()}
    for path, (owner, mode) in EXPECTED.items():
        assert seen[path][1] == mode, (path, seen[path])
        # A regular user's store holds that user's files only (unpack.py): owners show for a root caller.
        if os.geteuid() == 0:
            assert seen[path][0] == owner, (path, seen[path])


def test_chown_is_in_the_layer_for_every_caller(context: Path) -> None:
    """What the layer carries (the owners a root caller's store, a registry and Docker see), root or not."""
    base = Image.get("base:1")
    out = str(context.parent / "layer.tar.gz")
    _copy_layer(str(context), ["src/"], "/data/src/", "COPY", [], ("app", "staff"), 0o700)(base, out)
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(Path(out).read_bytes()))) as tar:
        found = {m.name: (m.uid, m.gid, m.mode) for m in tar.getmembers()}
    assert found == {"data": (65534, 3456, 0o755), "data/src": (65534, 3456, 0o755),
                     "data/src/b.txt": (65534, 3456, 0o700)}
    _copy_layer(str(context), ["run.sh"], "/run.sh", "COPY", [], ("77", "88"), None)(base, out + "2")
    with tarfile.open(fileobj=io.BytesIO(gzip.decompress(Path(out + "2").read_bytes()))) as tar:
        assert [(m.name, m.uid, m.gid, m.mode) for m in tar.getmembers()] == [("run.sh", 77, 88, 0o644)]


@pytest.mark.parametrize("instruction, why", [
    ("COPY --chown=nobody a.txt /x", "no user 'nobody' in the image's /etc/passwd"),
    ("COPY --chown=app:wheel a.txt /x", "no group 'wheel' in the image's /etc/group"),
    ("COPY --chown= a.txt /x", "no user given"),
    ("ADD --chown=app: a.txt /x", "no group given"),
    ("COPY --chown=4294967295 a.txt /x", "past 4294967294"),
    ("COPY --chown=a/b a.txt /x", "neither a user name nor a number"),
    ("COPY --chmod=u+x a.txt /x", "not an octal mode"),
    ("ADD --chmod=99 a.txt /x", "not an octal mode"),
    ("COPY --chmod=4755 a.txt /x", "set-user-id and set-group-id bits are refused"),
    ("COPY --link a.txt /x", "the flag --link is not supported"),
    ("RUN --mount=type=bind,target=/x echo hi", "--mount=type=bind: not supported"),
    ("RUN --mount=target=/x echo hi", "--mount=type=bind: not supported"),
    ("RUN --mount=type=secret,id=token echo hi", "--mount=type=secret: not supported"),
    ("RUN --mount=type=cache,target=/x,uid=1 echo hi", "the option 'uid' is not supported"),
    ("RUN --mount=type=cache,target=/x,sharing=locked echo hi", "sharing=locked is not supported"),
    ("RUN --mount=type=cache,id=x echo hi", "target '' is not an absolute path"),
    ("RUN --mount=type=cache,target=/ echo hi", "target '/' is not an absolute path below /"),
    ("RUN --network=none echo hi", "the flag --network is not supported"),
    ("RUN --security=insecure echo hi", "the flag --security is not supported"),
])
def test_a_bad_flag_is_one_line_naming_the_instruction_and_its_line(context: Path, instruction: str,
                                                                     why: str) -> None:
    with pytest.raises(DockerfileError) as caught:
        _build(context, f"FROM base:1\n\n{instruction}\n")
    name = instruction.split()[0]
    assert str(caught.value).startswith(f"Dockerfile:3: {name}"), str(caught.value)
    assert why in str(caught.value) and "\n" not in str(caught.value), str(caught.value)
    if not instruction.startswith(("COPY --chown=nobody", "RUN --mount=type=bind")):
        return  # the CLI's line and exit status: two cases (each a process, slow in the emulated VM)
    done = subprocess.run([ISOLATE_RUN, "image", "build", "-t", "bad:1", str(context)], capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == 125 and why in done.stderr and "Traceback" not in done.stderr, done.stderr
    # The steps' progress aside, one line: the error's, naming the line.
    errors = [line for line in done.stderr.splitlines() if not line.startswith(("step ", "  "))]
    assert len(errors) == 1 and errors[0].startswith(f"isolate-run image: Dockerfile:3: {name}"), done.stderr


@pytest.mark.parametrize("planted", ["passwd", "etc"])
def test_account_files_are_never_read_through_a_link(tmp_path: Path, planted: str) -> None:
    """/etc/passwd (or /etc) a link to the host's: the host's accounts never name an owner."""
    link = ({"name": "etc/passwd", "type": "link", "target": "/etc/passwd"} if planted == "passwd"
            else {"name": "etc", "type": "link", "target": "/etc"})
    with kit.store_env(str(tmp_path / "store")):
        layer = kit.busybox_layer() if planted == "passwd" else None
        if layer is None:  # /etc itself a link: a busybox image without its etc directory
            entries = [{"name": "bin", "type": "dir"}, {"name": "bin/sh", "type": "link", "target": "busybox"}]
            kit.oci_layout(str(tmp_path / "base"), [kit.layer([*entries, link])], ref="base:1", Env=["PATH=/bin"])
            Image.load(tmp_path / "base", store=Store(tmp_path / "store"))
        else:
            _base(tmp_path, [link])
        ctx = tmp_path / "ctx"
        ctx.mkdir()
        (ctx / "a.txt").write_text("a\n")
        with pytest.raises(DockerfileError, match="no user 'root' in the image's /etc/passwd"):
            _build(ctx, "FROM base:1\nCOPY --chown=root a.txt /x\n")


CACHED = """\
FROM base:1
ARG ROUND
RUN --mount=type=cache,target=/etc/cache echo "$ROUND" >> /etc/cache/log && wc -l < /etc/cache/log > /etc/count
RUN --mount=type=cache,id=other,target=/etc/cache,ro test ! -e /etc/cache/log && cp /etc/count /etc/count2
"""


def test_a_cache_mount_is_kept_between_builds_and_never_in_the_image(context: Path, tmp_path: Path,
                                                                      monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ISOLATE_STATE_DIR", str(tmp_path / "state"))  # where the caches are kept
    (context / "Dockerfile").write_text(CACHED)
    counts = []
    for round_ in ("1", "2"):  # each round's ARG a step of its own: nothing from the step cache
        image = Image.from_dockerfile(context / "Dockerfile", context, reference=f"cached:{round_}",
                                      build_args={"ROUND": round_})
        with isolate.Sandbox(policy=isolate.Policy(image=image.reference, backend="native")) as box:
            done = box.exec(["sh", "-c", "cat /etc/count /etc/count2; ls -A /etc/cache 2>/dev/null | wc -l"])
        assert done.returncode == 0, done.stderr
        counts.append(done.stdout.split())
    # The second build's RUN saw the first one's line; another id is another directory; the image holds none.
    assert counts == [["1", "1", "0"], ["2", "2", "0"]]


def test_a_cache_mount_is_never_made_through_a_link_of_the_image(tmp_path: Path,
                                                                 monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("ISOLATE_STATE_DIR", str(tmp_path / "state"))
    planted = tmp_path / "host-side"
    planted.mkdir()
    with kit.store_env(str(tmp_path / "store")):
        _base(tmp_path, [{"name": "etc/lnk", "type": "link", "target": str(planted)}])
        ctx = tmp_path / "ctx"
        ctx.mkdir()
        with pytest.raises(isolate.IsolationError, match="a mount is never made through an image's link"):
            _build(ctx, "FROM base:1\nRUN --mount=type=cache,target=/etc/lnk/zz true\n")
    assert not os.listdir(planted)
