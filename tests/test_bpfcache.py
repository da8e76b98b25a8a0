"""The per-user cache of compiled filters: used only when nobody else could have written it."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from isolate import _bpfcache, seccomp


@pytest.fixture
def cache(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    return tmp_path / "isolate" / "seccomp"


def test_round_trip_gives_the_same_program(cache: Path) -> None:
    compiled = seccomp.compile_filter("default", notify=True)
    assert compiled is not None
    key = _bpfcache.key("default", (True, False, False))
    assert key
    _bpfcache.store(key, compiled)
    loaded = _bpfcache.load(key)
    assert loaded is not None
    assert (loaded.bpf, dict(loaded.notify_errnos), loaded.notify_default_errno, loaded.profile, loaded.notify) == (
        compiled.bpf, dict(compiled.notify_errnos), compiled.notify_default_errno, compiled.profile, compiled.notify)
    assert os.stat(cache).st_mode & 0o777 == 0o700


def test_keys_depend_on_flags_and_profile_content(tmp_path: Path) -> None:
    profile = tmp_path / "p.json"
    profile.write_text('{"defaultAction": "SCMP_ACT_ALLOW"}')
    first = _bpfcache.key(str(profile), (False, False, False))
    assert first != _bpfcache.key(str(profile), (True, False, False))
    profile.write_text('{"defaultAction": "SCMP_ACT_ERRNO"}')
    assert first != _bpfcache.key(str(profile), (False, False, False))
    assert _bpfcache.key(str(tmp_path / "missing.json"), (False, False, False)) is None


def test_an_entry_others_could_write_is_ignored(cache: Path) -> None:
    compiled = seccomp.compile_filter("strict")
    key = _bpfcache.key("strict", (False, False, False))
    assert compiled is not None and key
    _bpfcache.store(key, compiled)
    entry = cache / (key + ".json")
    os.chmod(entry, 0o666)
    assert _bpfcache.load(key) is None
    os.chmod(entry, 0o600)
    os.chmod(cache, 0o777)
    assert _bpfcache.load(key) is None


def test_a_symlinked_entry_is_ignored(cache: Path, tmp_path: Path) -> None:
    compiled = seccomp.compile_filter("strict")
    key = _bpfcache.key("strict", (False, False, False))
    assert compiled is not None and key
    _bpfcache.store(key, compiled)
    entry = cache / (key + ".json")
    elsewhere = tmp_path / "elsewhere.json"
    entry.rename(elsewhere)
    entry.symlink_to(elsewhere)
    assert _bpfcache.load(key) is None
