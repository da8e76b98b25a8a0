"""Dockerfiles built by isolate's builder: multi-stage, the instructions agents' environments use, refusals."""

from __future__ import annotations

import contextlib
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
from isolate.image.build import Stats
from isolate.image.dockerfile import DockerfileError

pytestmark = pytest.mark.skipif(bool(NAMESPACES_WHY) or not os.path.exists("/bin/busybox"),
                                reason=NAMESPACES_WHY or "busybox-static is not installed")
pytest.importorskip("dockerfile_parse")

DOCKERFILE = """\
# a comment
ARG BASE=base:1
FROM ${BASE} AS builder
ARG GREETING=hi
WORKDIR /work
COPY src/ ./src/
RUN ["sh", "-c", "test ! -e src/secret.txt && cat src/a.txt > out.txt && echo $GREETING >> out.txt"]
RUN mkdir /out \\
 && cp out.txt /out/result

FROM base:1
SHELL ["/bin/sh", "-c"]
ENV APP_HOME=/app MODE=test
LABEL org.example.name="demo app" version=1
EXPOSE 8080/tcp 53/udp
USER 0
COPY --from=builder /out/result ${APP_HOME}/result
ADD bundle.tar.gz /app/bundle/
ADD notes.txt /app/
COPY . /app/ctx/
COPY src/*.txt notes.txt /app/txt/
WORKDIR ${APP_HOME}
ENTRYPOINT ["sh", "-c"]
CMD ["test ! -e ctx/src/secret.txt && cat result bundle/inside.txt notes.txt && ls ctx txt && echo $MODE"]
"""


@pytest.fixture()
def context(tmp_path: Path) -> Iterator[Path]:
    with kit.store_env(str(tmp_path / "store")):
        extra = [{"name": "app", "type": "dir", "mode": 0o777}]
        kit.oci_layout(str(tmp_path / "base"), [kit.busybox_layer(extra)], ref="base:1", Env=["PATH=/bin"])
        Image.load(tmp_path / "base", store=Store(tmp_path / "store"))
        ctx = tmp_path / "ctx"
        (ctx / "src").mkdir(parents=True)
        (ctx / "src" / "a.txt").write_text("from-builder\n")
        (ctx / "src" / "secret.txt").write_text("never copied\n")
        (ctx / "notes.txt").write_text("notes\n")
        (ctx / "debug.log").write_text("ignored\n")
        (ctx / "keep.log").write_text("kept\n")
        (ctx / ".dockerignore").write_text("# ignored files\nsrc/secret.txt\n*.log\n!keep.log\nDockerfile\n")
        with tarfile.open(ctx / "bundle.tar.gz", "w:gz") as tar:
            data = b"inside\n"
            info = tarfile.TarInfo("./inside.txt")
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))
        (ctx / "Dockerfile").write_text(DOCKERFILE)
        yield ctx


def test_a_multi_stage_dockerfile_builds_an_image_whose_sandbox_runs_its_cmd(context: Path, tmp_path: Path) -> None:
    stats = Stats()
    try:
        image = Image.from_dockerfile(context / "Dockerfile", context, reference="app:1",
                                      build_args={"GREETING": "hey"}, stats=stats)
    except isolate.UnsupportedError as exc:  # an upper layer the host cannot read back, or no idmapped mount
        pytest.skip(f"this host builds no image: {exc}")
    assert stats.ran == 2
    assert image.config.entrypoint == ("sh", "-c") and image.config.working_dir == "/app"
    assert "MODE=test" in image.config.env and image.config.user == "0"
    result = isolate.run([], policy=isolate.Policy(image="app:1", backend="native", write=()),
                         capture_output=True, text=True, timeout=60)
    assert result.stdout == ("from-builder\nhey\ninside\nnotes\nctx:\nbundle.tar.gz\nkeep.log\nnotes.txt\nsrc\n\n"
                             "txt:\na.txt\nnotes.txt\ntest\n"), (
        result.stdout + result.stderr)
    # Unchanged, built again: nothing runs, the same image.
    again = Stats()
    assert Image.from_dockerfile(context / "Dockerfile", context, build_args={"GREETING": "hey"}, stats=again).id \
        == image.id
    assert again.ran == 0 and again.cached > 0
    # Another network for the RUN steps is another step: they run again, with it.
    other = Stats()
    Image.from_dockerfile(context / "Dockerfile", context, build_args={"GREETING": "hey"}, stats=other,
                          network="loopback")
    assert other.ran == 2
    # The CLI builds it too (cached), and names its image.
    built = subprocess.run([ISOLATE_RUN, "image", "build", "-q", "-t", "app:2", "--build-arg", "GREETING=hey",
                            str(context)], capture_output=True, text=True, timeout=120)
    assert built.returncode == 0 and built.stdout.startswith("built docker.io/library/app:2"), built.stderr
    assert Image.get("app:2").id == image.id


def test_an_unsupported_instruction_names_itself_and_its_line(tmp_path: Path) -> None:
    # Refused while the file is read: nothing is pulled, built or run.
    for instruction in ["HEALTHCHECK NONE", "ONBUILD RUN true", "STOPSIGNAL 9", "VOLUME /data", "MAINTAINER x"]:
        (tmp_path / "Dockerfile").write_text(f"FROM base:1\nRUN true \\\n  && true\n{instruction}\n")
        with pytest.raises(DockerfileError, match=rf"^Dockerfile:4: {instruction.split()[0]}: not supported"):
            Image.from_dockerfile(tmp_path / "Dockerfile", tmp_path, store=Store(tmp_path / "store"))
    cli = subprocess.run([ISOLATE_RUN, "image", "build", "--image-store", str(tmp_path / "store"), str(tmp_path)],
                         capture_output=True, text=True, timeout=60)
    assert cli.returncode == 125 and len(cli.stderr.strip().splitlines()) == 1, cli.stderr
    assert "Dockerfile:4: MAINTAINER: not supported" in cli.stderr


def test_a_damaged_archive_or_a_dockerfile_not_utf8_is_one_line_and_125(context: Path, tmp_path: Path) -> None:
    # Neither is a traceback (nor the CLI's "unexpected ..., please report it"): the Dockerfile's mistake, named.
    (context / "broken.tar.gz").write_bytes(b"\x1f\x8b" + b"not gzip" * 64)
    (context / "Dockerfile").write_text("FROM base:1\nADD broken.tar.gz /app/\n")
    with pytest.raises(DockerfileError, match=r"broken\.tar\.gz: not a valid tar archive"):
        Image.from_dockerfile(context / "Dockerfile", context)
    (context / "Dockerfile").write_bytes(b"FROM base:1\nCOPY \xff\xfe /app/\n")
    with pytest.raises(DockerfileError, match="not UTF-8 text"):
        Image.from_dockerfile(context / "Dockerfile", context)
    cli = subprocess.run([ISOLATE_RUN, "image", "build", "-q", "--image-store", str(tmp_path / "store"), str(context)],
                         capture_output=True, text=True, timeout=60)
    assert cli.returncode == 125 and len(cli.stderr.strip().splitlines()) == 1, cli.stderr
    assert "not UTF-8 text" in cli.stderr


def test_sources_never_leave_the_context(context: Path, tmp_path: Path) -> None:
    (tmp_path / "outside").write_text("host secret\n")
    (context / "to-host").symlink_to("/etc")
    (context / "host-file").symlink_to(tmp_path / "outside")
    for line, why in [("COPY ../outside /app/", "leads out of the context"),
                      ("COPY to-host/passwd /app/", "goes through 'to-host'"),
                      ("ADD https://example.com/x /app/", "a URL")]:
        (context / "Dockerfile").write_text(f"FROM base:1\n{line}\n")
        with pytest.raises(DockerfileError, match=why):
            Image.from_dockerfile(context / "Dockerfile", context)
    # An archive's entry named as a whiteout would delete a file of the image: refused.
    with tarfile.open(context / "evil.tar", "w") as tar:
        tar.addfile(tarfile.TarInfo("bin/.wh.sh"))
    (context / "Dockerfile").write_text("FROM base:1\nADD evil.tar /\n")
    with pytest.raises(DockerfileError, match="whiteout"):
        Image.from_dockerfile(context / "Dockerfile", context)
    # A link that is itself a source is copied as the link, never followed.
    (context / "Dockerfile").write_text("FROM base:1\nCOPY host-file /app/host-file\n")
    image = Image.from_dockerfile(context / "Dockerfile", context)
    top = image.lower_dirs()[0]
    assert os.readlink(os.path.join(top, "app", "host-file")) == str(tmp_path / "outside")


def test_a_fifo_or_device_in_the_context_never_hangs_the_build(context: Path) -> None:
    # The context may be a directory a sandbox wrote: its Dockerfile and .dockerignore may be FIFOs (an open for
    # reading waits for a writer forever) or a link to a device. Each is refused by name, nothing waits.
    import threading

    def built(dockerfile: Path) -> BaseException | None:
        caught: list[BaseException | None] = [None]

        def run() -> None:
            try:
                Image.from_dockerfile(dockerfile, context)
            except BaseException as exc:  # handed to the test
                caught[0] = exc

        thread = threading.Thread(target=run, daemon=True)
        thread.start()
        thread.join(20)
        if thread.is_alive():
            # Unblock the open it hangs in (a writer that goes away at once), then fail.
            for fifo in (context / ".dockerignore", context / "Dockerfile.fifo"):
                with contextlib.suppress(OSError):
                    os.close(os.open(fifo, os.O_WRONLY | os.O_NONBLOCK))
            thread.join(5)
            pytest.fail(f"the build of {dockerfile.name} hangs on a FIFO of the context")
        return caught[0]

    os.unlink(context / ".dockerignore")
    os.mkfifo(context / ".dockerignore")
    (context / "Dockerfile").write_text("FROM base:1\nCOPY notes.txt /app/\n")
    error = built(context / "Dockerfile")
    assert isinstance(error, DockerfileError) and ".dockerignore" in str(error), error
    os.unlink(context / ".dockerignore")
    os.mkfifo(context / "Dockerfile.fifo")
    error = built(context / "Dockerfile.fifo")
    assert isinstance(error, DockerfileError) and "not a regular file" in str(error), error
    (context / "Dockerfile.dev").symlink_to("/dev/zero")
    error = built(context / "Dockerfile.dev")
    assert isinstance(error, DockerfileError) and "not a regular file" in str(error), error


def test_a_dockerignore_pattern_never_backtracks_for_ever(context: Path) -> None:
    # Each "**" was "(?:.*/)?" of one regular expression: a dozen of them (the context may be a directory a sandbox
    # wrote) backtracked through every way to share a path 30 directories deep out, and the build never ended.
    from conftest import finishes

    deep = context.joinpath(*["d"] * 30)
    deep.mkdir(parents=True)
    (deep / "f").write_text("deep\n")
    (context / ".dockerignore").write_text("/".join(["**"] * 6 + ["*", "**"] * 6) + "/x\nsrc/secret.txt\n")
    (context / "Dockerfile").write_text("FROM base:1\nCOPY . /app/\n")
    done, outcome = finishes(lambda: Image.from_dockerfile(context / "Dockerfile", context), 60)
    assert done, "the build's .dockerignore matching did not end"
    assert isinstance(outcome, Image), outcome
    top = outcome.lower_dirs()[0]
    assert os.path.exists(os.path.join(top, "app", *["d"] * 30, "f"))
    assert not os.path.exists(os.path.join(top, "app", "src", "secret.txt"))
    # A pattern deeper than any walk is refused in one line.
    (context / ".dockerignore").write_text("/".join(["a"] * 300) + "\n")
    with pytest.raises(DockerfileError, match="a pattern of 300 names"):
        Image.from_dockerfile(context / "Dockerfile", context)
