"""llm-sandbox's SandboxSession with backend="isolate": its own session, handlers and checks, over isolate."""

from __future__ import annotations

import os
import time
from pathlib import Path

import pytest
from conftest import NAMESPACES_WHY, policy

llm_sandbox = pytest.importorskip("llm_sandbox",
                                  reason="llm-sandbox is not installed (pip install 'isolate[llm-sandbox]')")

from llm_sandbox import SandboxSession, get_backend  # noqa: E402
from llm_sandbox.exceptions import (  # noqa: E402
    CommandFailedError,
    LibraryInstallationNotSupportedError,
    SandboxTimeoutError,
)
from llm_sandbox.security import RestrictedModule, SecurityIssueSeverity, SecurityPolicy  # noqa: E402

import isolate.integrations.llm_sandbox as adapter  # noqa: E402
from isolate import Sandbox  # noqa: E402

pytestmark = pytest.mark.skipif(bool(NAMESPACES_WHY), reason=NAMESPACES_WHY or "")


def test_the_backend_is_registered_under_its_name() -> None:
    definition = get_backend("isolate")
    assert definition.factory is adapter._factory and definition.capabilities.platforms == ("linux",)
    adapter._register()  # importing twice (a reload) is not an error


def test_a_session_runs_code_in_the_sandbox(workdir: str) -> None:
    with SandboxSession(backend="isolate", lang="python", policy=policy(write=())) as session:
        result = session.run("import os, sys\nprint(os.getcwd(), os.getuid())\nprint('to err', file=sys.stderr)")
        assert result.exit_code == 0, result
        cwd, uid = result.stdout.split()
        assert cwd == "/sandbox" and uid == "65534" and result.stderr == "to err\n"
        # Each run is a new process (llm-sandbox's semantics); files persist in the workdir.
        session.run("open('kept.txt', 'w').write('kept')")
        assert session.run("print(open('kept.txt').read())").stdout == "kept\n"
        failed = session.run("raise SystemExit(3)")
        assert failed.exit_code == 3
        # Nothing of the host's home, and no network, by default.
        probe = session.run("import socket\ntry:\n    socket.create_connection(('1.1.1.1', 53), timeout=2)\n"
                            "    print('net')\nexcept OSError:\n    print('no net')")
        assert probe.stdout == "no net\n", probe
        assert session.execute_command("ls /root").exit_code != 0
        # Files both ways.
        src = Path(workdir) / "in.txt"
        src.write_text("from the host\n")
        session.copy_to_runtime(str(src), "/sandbox/data/in.txt")
        assert session.run("print(open('data/in.txt').read(), end='')").stdout == "from the host\n"
        session.execute_command("mkdir -p out/sub && echo a > out/a.txt && echo b > out/sub/b.txt "
                                "&& ln -s /etc/passwd out/link")
        session.copy_from_runtime("/sandbox/out", os.path.join(workdir, "out"))
        assert (Path(workdir) / "out" / "a.txt").read_text() == "a\n"
        assert (Path(workdir) / "out" / "sub" / "b.txt").read_text() == "b\n"
        assert not (Path(workdir) / "out" / "link").exists()  # a link is not followed out of the sandbox
    assert not session.is_open


def test_a_run_past_its_timeout_is_ended_by_the_sandbox() -> None:
    with SandboxSession(backend="isolate", policy=policy(write=())) as session:
        started = time.monotonic()
        with pytest.raises(SandboxTimeoutError):
            session.run("import subprocess, time\nsubprocess.Popen(['sleep', '300'])\ntime.sleep(300)", timeout=1)
        assert time.monotonic() - started < 20
        assert "sleep 300" not in session.execute_command("ps -eo args 2>/dev/null || cat /proc/*/cmdline").stdout
        assert session.run("print('next')").stdout == "next\n"


def test_llm_sandbox_security_policy_applies() -> None:
    guard = SecurityPolicy(severity_threshold=SecurityIssueSeverity.MEDIUM,
                           restricted_modules=[RestrictedModule(name="ctypes", description="native code",
                                                                severity=SecurityIssueSeverity.HIGH)])
    with SandboxSession(backend="isolate", policy=policy(write=()), security_policy=guard) as session:
        safe, violations = session.is_safe("import ctypes")
        assert not safe and violations


def test_attach_to_a_named_sandbox_and_refuse_container_options() -> None:
    name = f"llm-sandbox-test-{os.getpid()}"
    with Sandbox(policy(write=()), name=name) as box:
        try:
            box.write_file("/tmp/hello", "named\n")
            with SandboxSession(backend="isolate", container_id=name) as session:
                assert session.execute_command("cat /tmp/hello").stdout == "named\n"
                assert session.run("import os; print(os.getcwd())").stdout == "/workspace\n"
            assert box.exec("cat /tmp/hello").stdout == "named\n"  # detached, not closed
        finally:
            box.close()
    with pytest.raises(ValueError, match="dockerfile"):
        SandboxSession(backend="isolate", dockerfile="Dockerfile")
    assert SandboxSession(backend="isolate", image="python:3.12").policy.image == "python:3.12"


def test_environment_setup_makes_a_virtualenv_and_a_library_that_cannot_install_raises() -> None:
    with SandboxSession(backend="isolate", policy=policy(write=()), skip_environment_setup=False) as session:
        where = session.run("import sys\nprint(sys.prefix)")
        assert where.stdout == "/sandbox/.sandbox-venv\n", where
        # No network under this policy: pip cannot install, and that is an error, not a silent pass.
        with pytest.raises(CommandFailedError, match="isolate-no-such-package"):
            session.run("print(1)", libraries=["isolate-no-such-package"])
    with SandboxSession(backend="isolate", policy=policy(write=())) as session, \
            pytest.raises(LibraryInstallationNotSupportedError):
        session.run("print(1)", libraries=["six"])
