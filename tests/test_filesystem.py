"""Filesystem confinement: the mount namespace's built root and Landlock, on the real kernel."""

from __future__ import annotations

import os
import pwd
import subprocess

import pytest
from conftest import ROOT, not_granted_top, policy, py, python_read, root_only

import isolate
from isolate.kernel import landlock

PROBE = """
import errno, os, sys
def attempt(what, fn):
    try:
        fn()
        print(what, "ok")
    except OSError as e:
        print(what, errno.errorcode[e.errno])
for spec in sys.argv[1:]:
    op, path = spec.split(":", 1)
    if op == "read":
        attempt(spec, lambda: open(path).read())
    elif op == "write":
        attempt(spec, lambda: open(path, "w").write("x"))
    elif op == "list":
        attempt(spec, lambda: os.listdir(path))
"""


def probe(pol: isolate.Policy, *specs: str, cwd: str | None = None) -> dict[str, str]:
    result = isolate.run([*py(PROBE), *specs], policy=pol, capture_output=True, text=True, cwd=cwd)
    assert result.returncode == 0, result.stderr
    return dict(line.rsplit(" ", 1) for line in result.stdout.splitlines())


@pytest.fixture
def outside(tmp_path_factory: pytest.TempPathFactory) -> str:
    path = tmp_path_factory.mktemp("outside")
    secret = path / "secret.txt"
    secret.write_text("secret")
    os.chmod(path, 0o755)
    os.chmod(secret, 0o644)
    return str(path)


@pytest.mark.parametrize("namespaces", [True, False], ids=["namespaces+landlock", "landlock-only"])
def test_granted_paths_work_and_others_do_not(workdir: str, outside: str, namespaces: bool) -> None:
    if not namespaces:
        os.chmod(workdir, 0o777)  # no idmapped mount without namespaces: a root caller's program is 65534
    pol = policy(write=[workdir], namespaces=namespaces, tmpfs=() if not namespaces else ("/tmp",))
    out = probe(
        pol,
        f"write:{workdir}/new.txt",
        f"read:{workdir}/new.txt",
        "read:/etc/hostname",
        f"read:{outside}/secret.txt",
        f"write:{outside}/planted.txt",
        "write:/etc/isolate-test-planted",
        cwd=workdir,
    )
    assert out[f"write:{workdir}/new.txt"] == "ok"
    assert out[f"read:{workdir}/new.txt"] == "ok"
    assert out["read:/etc/hostname"] == "ok"
    # Landlock alone answers EACCES; with namespaces the path does not even exist inside.
    denied = {"EACCES"} if not namespaces else {"ENOENT"}
    assert out[f"read:{outside}/secret.txt"] in denied
    assert out[f"write:{outside}/planted.txt"] in denied
    assert out["write:/etc/isolate-test-planted"] in ({"EACCES"} if not namespaces else {"EROFS", "EACCES"})
    assert not os.path.exists(os.path.join(outside, "planted.txt"))
    assert not os.path.exists("/etc/isolate-test-planted")


@pytest.mark.parametrize("namespaces", [True, False], ids=["namespaces+landlock", "landlock-only"])
def test_symlink_in_workspace_does_not_open_outside_file(workdir: str, outside: str, namespaces: bool) -> None:
    os.symlink(os.path.join(outside, "secret.txt"), os.path.join(workdir, "link"))
    if not namespaces:
        os.chmod(workdir, 0o777)  # without an idmapped mount a root caller's program (65534) must be able to write it
    pol = policy(write=[workdir], namespaces=namespaces, tmpfs=() if not namespaces else ("/tmp",))
    out = probe(pol, f"read:{workdir}/link", cwd=workdir)
    assert out[f"read:{workdir}/link"] in ("EACCES", "ENOENT")


def test_landlock_alone_denies_a_read_outside(workdir: str, outside: str) -> None:
    os.chmod(workdir, 0o777)
    # The same path that the mount namespace hides, refused by Landlock's own rule.
    pol = policy(write=[workdir], namespaces=False, tmpfs=())
    out = probe(pol, f"list:{outside}", cwd=workdir)
    assert out[f"list:{outside}"] == "EACCES"


def test_root_has_only_granted_paths(workdir: str) -> None:
    result = isolate.run(["ls", "/"], policy=policy(write=[workdir]), capture_output=True, text=True, cwd=workdir)
    names = set(result.stdout.split())
    assert {"usr", "etc", "proc", "dev", "tmp"} <= names
    # What no grant brings in is absent, wherever the checkout and its venv live (/root, /home/USER).
    hidden = not_granted_top(workdir)
    assert len(hidden) >= 5 and not names & hidden, (names, hidden)
    # /home holds the private home only (the host's homes are not visible).
    listed = isolate.run(["ls", "-A", "/home"], policy=policy(write=[workdir]), capture_output=True, text=True,
                         cwd=workdir)
    under_home = {p.split("/")[2] for p in (*python_read(), workdir, os.path.realpath(workdir))
                  if p.startswith("/home/")}
    assert set(listed.stdout.split()) == {"sandbox"} | under_home, listed.stdout


def test_host_symlinks_come_out_right(workdir: str) -> None:
    result = isolate.run(["sh", "-c", "readlink /lib; ls /lib/ >/dev/null && echo listed"],
                         policy=policy(write=[workdir]), capture_output=True, text=True, cwd=workdir)
    if os.path.islink("/lib"):
        assert result.stdout.splitlines()[0] == os.readlink("/lib")
    assert "listed" in result.stdout


def test_private_tmp_and_readonly_root(workdir: str) -> None:
    marker = f"/tmp/isolate-private-{os.getpid()}"
    result = isolate.run(["sh", "-c", f"echo x > {marker} && cat {marker}; touch /newfile"],
                         policy=policy(write=[workdir]), capture_output=True, text=True, cwd=workdir)
    assert result.stdout.strip() == "x"
    assert "Read-only file system" in result.stderr or "Permission denied" in result.stderr
    assert not os.path.exists(marker)


@root_only
def test_root_caller_program_cannot_read_root_only_files(workdir: str) -> None:
    # /etc is granted read-only by default; a 0600 root file inside it stays unreadable.
    result = isolate.run(["sh", "-c", "id -u; cat /etc/shadow"], policy=policy(write=[workdir]),
                         capture_output=True, text=True, cwd=workdir)
    assert result.stdout.split()[0] == "65534"
    assert result.returncode != 0
    assert "Permission denied" in result.stderr


@root_only
def test_root_only_file_in_granted_dir_stays_unreadable(workdir: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    granted = tmp_path_factory.mktemp("granted")
    os.chmod(granted, 0o755)
    secret = granted / "key"
    secret.write_text("root only")
    os.chmod(secret, 0o600)
    out = probe(policy(read=[*policy().read, str(granted)], write=[workdir]), f"read:{secret}", cwd=workdir)
    assert out[f"read:{secret}"] == "EACCES"


def test_files_created_are_owned_by_the_caller(workdir: str) -> None:
    isolate.run(["sh", "-c", "echo hi > made.txt; mkdir made.d"], policy=policy(write=[workdir]), cwd=workdir,
                check=True)
    for name in ("made.txt", "made.d"):
        info = os.stat(os.path.join(workdir, name))
        assert (info.st_uid, info.st_gid) == (os.geteuid(), os.getegid())


@root_only
def test_root_caller_program_owns_the_workspace(workdir: str) -> None:
    # The caller's files appear as the program's own through the idmapped mount.
    with open(os.path.join(workdir, "callers.txt"), "w") as handle:
        handle.write("x")
    result = isolate.run(["sh", "-c", "stat -c %u callers.txt; echo more >> callers.txt && echo appended"],
                         policy=policy(write=[workdir]), capture_output=True, text=True, cwd=workdir)
    assert result.stdout.split() == ["65534", "appended"]
    assert pwd.getpwuid(os.stat(os.path.join(workdir, "callers.txt")).st_uid).pw_uid == 0


def test_cwd_outside_grants_is_a_setup_error(outside: str) -> None:
    with pytest.raises(isolate.SetupError) as info:
        isolate.run(["true"], policy=policy(write=()), cwd=outside)
    assert info.value.step == "chdir"
    assert "chdir" in str(info.value)


def test_missing_command_raises_not_found(workdir: str) -> None:
    with pytest.raises(isolate.CommandNotFoundError):
        isolate.run(["definitely-not-a-command-xyz"], policy=policy(write=[workdir]), cwd=workdir)
    with pytest.raises(FileNotFoundError):  # subprocess's own exception type still matches
        isolate.run(["/nonexistent/bin"], policy=policy(write=[workdir]), cwd=workdir)


def test_not_executable_raises(workdir: str) -> None:
    script = os.path.join(workdir, "script.sh")
    with open(script, "w") as handle:
        handle.write("#!/bin/sh\necho hi\n")
    os.chmod(script, 0o644)
    with pytest.raises(isolate.CommandNotExecutableError):
        isolate.run([script], policy=policy(write=[workdir]), cwd=workdir)


def test_report_names_mechanisms(workdir: str) -> None:
    result = isolate.run(["true"], policy=policy(write=[workdir]), cwd=workdir)
    enforced = result.report.enforced
    assert enforced["landlock"] == (landlock.abi() or None)  # the mount namespace alone where there is none
    assert "mnt" in enforced["namespaces"] and "user" in enforced["namespaces"]
    assert enforced["no_new_privs"] is True
    assert result.report.status == "ok"
    assert result.report.backend == "native"


def test_subprocess_compatible_result(workdir: str) -> None:
    result = isolate.run(["sh", "-c", "cat; echo err >&2; exit 3"], policy=policy(write=[workdir]), cwd=workdir,
                         input=b"data", capture_output=True)
    assert isinstance(result, subprocess.CompletedProcess)
    assert (result.returncode, result.stdout, result.stderr) == (3, b"data", b"err\n")
    assert result.report.status == "exited" and result.report.exit_code == 3
    with pytest.raises(subprocess.CalledProcessError):
        isolate.run(["false"], policy=policy(write=[workdir]), cwd=workdir, check=True)


_ = ROOT


def test_a_planted_symlink_cannot_redirect_a_later_grant(workdir: str, outside: str) -> None:
    # Run 1 may write the workspace: it leaves a link to somewhere it was never granted.
    isolate.run(["ln", "-s", outside, "out"], policy=policy(write=[workdir]), cwd=workdir, check=True)
    # Run 2 grants what looks like a directory of the workspace: refused, naming the real path.
    with pytest.raises(isolate.PolicyError) as info:
        isolate.run(["touch", "out/planted"], policy=policy(write=[os.path.join(workdir, "out")]), cwd=workdir)
    assert info.value.field == "write" and outside in str(info.value)
    assert not os.path.exists(os.path.join(outside, "planted"))


def test_granting_root_through_a_link_is_refused(workdir: str) -> None:
    os.symlink("/", os.path.join(workdir, "root-link"))
    os.chmod(workdir, 0o755)
    with pytest.raises(isolate.PolicyError):
        isolate.run(["true"], policy=policy(read=[*policy().read, os.path.join(workdir, "root-link")]), cwd=workdir)


@pytest.mark.parametrize("path", ["/tmp", "/dev/shm"])
def test_private_tmpfs_is_bounded_by_default_and_settable(workdir: str, path: str) -> None:
    # Unbounded, each private tmpfs could take half of RAM in unswappable pages.
    probe = py(f"import os; s = os.statvfs({path!r}); print(s.f_blocks * s.f_frsize)")
    default = isolate.run(probe, policy=policy(write=[workdir]), cwd=workdir, capture_output=True, text=True)
    expected = isolate.model.policy.DEFAULT_TMPFS_SIZE if path == "/tmp" else isolate.model.policy.DEFAULT_SHM_SIZE
    assert int(default.stdout) == expected, default.stderr
    fill = py(
        "import errno\n"
        f"f = open({path!r} + '/fill', 'wb')\n"
        "try:\n"
        "    [f.write(b'x' * 65536) or f.flush() for _ in range(64)]\n"
        "except OSError as e:\n"
        "    print('ENOSPC' if e.errno == errno.ENOSPC else e)\n"
    )
    small = policy(write=[workdir], limits=isolate.Limits(tmpfs_size="1M"))
    result = isolate.run(fill, policy=small, cwd=workdir, capture_output=True, text=True)
    assert result.stdout.strip() == "ENOSPC", result.stderr



def test_var_holds_a_private_writable_var_tmp_and_nothing_of_the_hosts(workdir: str) -> None:
    # Programs and test suites `cd /var` and write /var/tmp (the OpenSandbox e2e tests do): /var exists,
    # with a private tmpfs at /var/tmp as at /tmp; nothing of the host's /var (logs, package state, its
    # own /var/tmp) is shown unless granted.
    leftover = os.path.join("/var/tmp", f"isolate-test-{os.getpid()}")
    with open(leftover, "w"):
        pass
    try:
        script = ("cd /var && ls -A /var && ls -A /var/tmp | wc -l && echo written > /var/tmp/f && cat /var/tmp/f && "
                  "stat -c %a /var/tmp && { touch /var/x 2>/dev/null && echo var-writable || echo var-read-only; }")
        first = isolate.run(["sh", "-c", script], policy=policy(write=[workdir]), cwd=workdir, capture_output=True,
                            text=True)
        assert first.returncode == 0, first.stderr
        assert first.stdout.split() == ["tmp", "0", "written", "1777", "var-read-only"]
        again = isolate.run(["ls", "-A", "/var/tmp"], policy=policy(write=[workdir]), cwd=workdir,
                            capture_output=True, text=True)
        assert again.stdout == ""  # private to each run
        with isolate.Sandbox(policy(write=())) as sb:  # one kept sandbox: shared by its commands, as /tmp is
            assert sb.exec(["sh", "-c", "echo kept > /var/tmp/k"]).returncode == 0
            assert sb.exec(["cat", "/var/tmp/k"]).stdout == "kept\n"
        assert not os.path.exists("/var/tmp/k")
    finally:
        os.unlink(leftover)
