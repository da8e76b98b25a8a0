"""isolate.ray.transfer: the tars between the caller's machine and a node, against trees and tars made to
harm (a sandboxed program controls what a commit packs; a tar is unpacked on the caller's machine)."""

from __future__ import annotations

import io
import os
import tarfile
from pathlib import Path

import pytest

pytest.importorskip("ray", reason="ray is not installed: pip install '.[ray]'")

import isolate
from isolate.ray.transfer import pack_tree, unpack_tree


def _tar(*members: tuple[str, bytes, str, bytes]) -> bytes:
    buffer = io.BytesIO()
    with tarfile.open(fileobj=buffer, mode="w", format=tarfile.PAX_FORMAT) as archive:
        for name, kind, link, data in members:
            info = tarfile.TarInfo(name)
            info.type, info.linkname, info.mode, info.size = kind, link, 0o4755, len(data)
            archive.addfile(info, io.BytesIO(data))
    return buffer.getvalue()


def test_unpack_writes_nothing_outside_nor_through_a_link(tmp_path: Path) -> None:
    victim = tmp_path / "victim"
    victim.mkdir()
    harmful = [
        _tar(("../out", tarfile.REGTYPE, "", b"x")),
        _tar(("a", tarfile.SYMTYPE, str(victim), b""), ("a/out", tarfile.REGTYPE, "", b"x")),
        _tar(("b", tarfile.SYMTYPE, str(victim / "out"), b""), ("b", tarfile.REGTYPE, "", b"x")),
        _tar(("c", tarfile.DIRTYPE, "", b""), ("c", tarfile.SYMTYPE, str(victim), b""),
             ("c/out", tarfile.REGTYPE, "", b"x")),
        _tar(("d", tarfile.SYMTYPE, "..", b""), ("d/out", tarfile.REGTYPE, "", b"x")),
    ]
    for number, data in enumerate(harmful):
        into = tmp_path / f"into{number}"
        into.mkdir()
        with pytest.raises(OSError):
            unpack_tree(data, str(into))
    into = tmp_path / "kinds"
    into.mkdir()
    unpack_tree(_tar(("/abs", tarfile.REGTYPE, "", b"x"), ("h", tarfile.LNKTYPE, "/etc/passwd", b""),
                     ("dev", tarfile.CHRTYPE, "", b""), ("fifo", tarfile.FIFOTYPE, "", b"")), str(into))
    assert sorted(os.listdir(into)) == ["abs"] and (into / "abs").stat().st_mode & 0o7777 == 0o755
    assert os.listdir(victim) == [] and not (tmp_path / "out").exists()


def test_pack_refuses_a_tree_past_its_limit_before_reading_it(tmp_path: Path) -> None:
    # A sparse file costs the program's disk nothing; in a tar (no holes, in memory) it cost all of its size.
    (tmp_path / "small").write_bytes(b"x" * 100)
    with open(tmp_path / "big", "wb") as handle:
        handle.truncate(1 << 40)
    with pytest.raises(isolate.IsolationError, match=r"big: 1099511627776\)"):
        pack_tree(str(tmp_path), limit=1 << 30)
    os.unlink(tmp_path / "big")
    into = tmp_path / "into"
    data = pack_tree(str(tmp_path), limit=1 << 30)
    into.mkdir()
    unpack_tree(data, str(into))
    assert (into / "small").read_bytes() == b"x" * 100
