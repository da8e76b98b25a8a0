"""isolate-run: flags, exit statuses, reports, profiles, doctor. Every case runs the real CLI."""

from __future__ import annotations

import json
import os
import subprocess

import pytest
from conftest import ISOLATE_RUN, PYTHON, ROOT, skip_unless_runnable

from isolate.kernel import landlock

CLI = [ISOLATE_RUN]


def cli(*args: str, cwd: str, **kwargs: object) -> subprocess.CompletedProcess[str]:
    skip_unless_runnable(args)
    return subprocess.run([*CLI, *args], cwd=cwd, capture_output=True, text=True, timeout=60, **kwargs)  # type: ignore[call-overload]


def one_line(stderr: str) -> str:
    lines = stderr.strip().splitlines()
    assert len(lines) == 1, stderr
    assert "Traceback" not in stderr
    assert "unexpected" not in stderr  # the catch-all's line: what no check of isolate's saw
    return lines[0]


@pytest.mark.parametrize(
    ("flags", "needle"),
    [
        (["--memory", "64Q"], "limits.memory"),
        (["--cpu", "-1"], "cpu"),
        (["--wall", "soon"], "wall"),
        (["--pids", "many"], "pids"),
        (["--nofile", "0"], "open_files"),
        (["--fsize", "1X"], "file_size"),
        (["--net", "wifi"], "--net"),
        (["--ro", "/does/not/exist"], "read"),
        (["--rw", "/does/not/exist"], "write"),
        (["--tmpfs", "relative"], "tmpfs"),
        (["--env", "NOEQUALS"], "--env"),
        (["--seccomp", "/no/such/profile.json"], "seccomp"),
        (["--profile", "/no/such/profile.toml"], "profile"),
        (["--backend", "vm"], "--backend"),
        (["--uid", "zero"], "--uid"),
        (["--uid", "0"], "uid"),
        (["--net", "host", "--allow-host", "example.org"], "--allow-host"),
        (["--chdir", "relative"], "cwd"),
        (["--bogus"], "unrecognized"),
        # Below a floor: refused, never run and killed at once (--memory 0.5 ran and died with 137).
        (["--memory", "0.5"], "limits.memory"),
        (["--memory", "64K"], "at least 1M"),
        (["--nofile", "3"], "at least 16"),
        (["--wall", "0"], "wall"),
        (["--wall", "0.001"], "at least 0.01"),
        (["--cpu", "1e-9"], "limits.cpu_seconds"),
        (["--cpus", "0.001"], "limits.cpus"),
        (["--pids", "0"], "limits.pids"),
        (["--wall", "nan"], "wall"),
        (["--cpu", "inf"], "cpu"),
        (["--memory", "1e400"], "limits.memory"),
        # Every inside path in its canonical form before the checks ("//" passed them, then crashed the mount
        # planner with a RecursionError; "/proc/" and "/dev/." were taken and mounted under the sandbox's own).
        (["--tmpfs", "//"], "tmpfs: '//' (that is /) cannot be a tmpfs"),
        (["--tmpfs", "/proc/"], "(that is /proc) cannot be a tmpfs"),
        (["--tmpfs", "/dev/."], "(that is /dev) cannot be a tmpfs"),
        (["--tmpfs", "//proc/sys"], "(that is /proc/sys) cannot be a tmpfs"),
        (["--bind", "/tmp://proc"], "binds: '//proc' (that is /proc) cannot be a mount point"),
        (["--ro-bind", "/tmp:/dev/../proc"], "(that is /proc) cannot be a mount point"),
        (["--home", "//dev"], "home: '//dev' (that is /dev) cannot be the home"),
        # Numbers in ASCII digits only, each within what the kernel takes.
        (["--nofile", "\u00b2\u00b2\u00b2"], "limits.open_files"),          # a ValueError traceback
        (["--nofile", "\u0661\u0662\u0668"], "limits.open_files"),          # was taken as 128
        (["--wall", "\u0661\u0662"], "limits.wall_seconds"),
        (["--memory", "\u0661\u0662M"], "limits.memory"),
        (["--cpu", "1_0"], "limits.cpu_seconds"),
        (["--uid", "\u0661\u0662\u0668"], "--uid"),
        (["--uid", "+5"], "--uid"),
        (["--pids", "9" * 5000], "limits.pids"),                       # past int()'s own 4,300 digits
        (["--pids", "2147483647"], "at most 4194304"),                   # blamed the cgroups
        (["--cpus", "1e9"], "at most 8192"),                             # blamed the cgroups
        (["--allow-host", "\u212aelvin.example"], "not an ASCII name"),   # KELVIN SIGN: taken as "kelvin"
        # Paths are bytes: one that is not UTF-8 is named in the message (an UnicodeDecodeError named none).
        (["--chdir", "/tmp/\udcffabsent"], "chdir: /tmp/"),
        (["--ro", "/tmp/\udcffabsent"], "read: '/tmp/"),
        # An empty value (a script's unset variable) was taken for no option at all: --image "" ran on the host's
        # root, --report "" wrote no report, --profile "" dropped the profile.
        *[([option, ""], f"{option}: an empty value") for option in
          ("--image", "--report", "--profile", "--seccomp", "--chdir", "--home", "--image-store", "--dns")],
        (["--image="], "--image: an empty value"),
    ],
)
def test_bad_input_exits_125_with_one_line_and_runs_nothing(workdir: str, flags: list[str], needle: str) -> None:
    result = cli(*flags, "--", "touch", "marker", cwd=workdir)
    assert result.returncode == 125
    assert needle in one_line(result.stderr)
    assert not os.path.exists(os.path.join(workdir, "marker"))


def test_bad_profile_file(workdir: str) -> None:
    for text in ('read = [\n', 'reed = ["/usr"]\n', '[limits]\nmemory = "-1M"\n', 'tmpfs = ["//"]\n',
                 'tmpfs = ["/proc/"]\n', '[limits]\nopen_files = "\u0661\u0662\u0668"\n',
                 'read = ' + '[' * 5000 + ']' * 5000 + '\n'):                # a RecursionError traceback
        path = os.path.join(workdir, "p.toml")
        with open(path, "w") as handle:
            handle.write(text)
        result = cli("--profile", path, "--", "touch", "marker", cwd=workdir)
        assert result.returncode == 125
        one_line(result.stderr)
        assert not os.path.exists(os.path.join(workdir, "marker"))


def test_no_command(workdir: str) -> None:
    result = cli(cwd=workdir)
    assert result.returncode == 125
    assert "no command" in one_line(result.stderr)


def test_exit_statuses(workdir: str) -> None:
    assert cli("sh", "-c", "exit 7", cwd=workdir).returncode == 7
    assert cli("sh", "-c", "kill -USR1 $$", cwd=workdir).returncode == 128 + 10
    missing = cli("no-such-command-xyz", cwd=workdir)
    assert missing.returncode == 127 and "not found" in one_line(missing.stderr)
    script = os.path.join(workdir, "noexec.sh")
    with open(script, "w") as handle:
        handle.write("#!/bin/sh\n")
    os.chmod(script, 0o644)
    cannot = cli(script, cwd=workdir)
    assert cannot.returncode == 126
    one_line(cannot.stderr)


def test_defaults_confine(workdir: str) -> None:
    result = cli("sh", "-c", "echo ok > here.txt && cat here.txt; touch /etc/x 2>/dev/null || echo etc-ro; "
                 "ls /home; cat /proc/net/dev | tail -n +3 | cut -d: -f1 | tr -d ' '",
                 cwd=workdir)
    # /home holds only the program's private home, none of the host's.
    assert result.stdout.split() == ["ok", "etc-ro", "sandbox", "lo"], result.stderr


def test_report_file(workdir: str) -> None:
    report = os.path.join(workdir, "r.json")
    result = cli("--report", report, "--", "sh", "-c", "exit 3", cwd=workdir)
    assert result.returncode == 3
    data = json.load(open(report))
    assert data["status"] == "exited" and data["exit_code"] == 3
    assert data["backend"] == "native"
    assert "landlock" in data["enforced"] and "namespaces" in data["enforced"]
    for key in ("wall_seconds", "cpu_seconds", "max_rss_bytes", "denied", "signal"):
        assert key in data


def test_setup_error_report(workdir: str) -> None:
    report = os.path.join(workdir, "r.json")
    result = cli("--report", report, "--memory", "bad", "--", "true", cwd=workdir)
    assert result.returncode == 125
    assert json.load(open(report))["status"] == "setup-error"


def test_report_never_through_a_symlink(workdir: str, tmp_path_factory: pytest.TempPathFactory) -> None:
    target = tmp_path_factory.mktemp("victim") / "precious"
    target.write_text("keep me")
    link = os.path.join(workdir, "r.json")
    os.symlink(target, link)
    result = cli("--report", link, "--", "true", cwd=workdir)
    assert result.returncode == 125
    assert "symbolic link" in one_line(result.stderr)
    assert target.read_text() == "keep me"
    fifo = os.path.join(workdir, "fifo")
    os.mkfifo(fifo)
    result = cli("--report", fifo, "--", "true", cwd=workdir)
    assert result.returncode == 125
    assert "regular file" in one_line(result.stderr)


@pytest.mark.parametrize("move", ["rm -rf out", "mv out kept"])
def test_report_directory_replaced_by_a_link_during_the_run(
    workdir: str, tmp_path_factory: pytest.TempPathFactory, move: str
) -> None:
    # The program owns the cwd: while it runs it swaps the report's directory
    # for a link to a directory it cannot even see. isolate-run (often root)
    # must not create or truncate anything there afterwards.
    victim = tmp_path_factory.mktemp("victim")
    os.chmod(victim, 0o777)
    os.mkdir(os.path.join(workdir, "out"))
    result = cli("--report", "out/report.json", "--", "sh", "-c", f"{move} && ln -s {victim} out", cwd=workdir)
    assert os.listdir(victim) == []
    if move.startswith("mv"):
        # The directory held open from the start is where the report goes.
        assert result.returncode == 0, result.stderr
        assert json.load(open(os.path.join(workdir, "kept", "report.json")))["status"] == "ok"
    else:
        assert result.returncode == 125
        assert "--report out/report.json" in one_line(result.stderr)


@pytest.mark.parametrize("plant", ["mkfifo out/report.json", "ln -s /etc/passwd out/report.json"])
def test_report_name_replaced_during_the_run(workdir: str, plant: str) -> None:
    # A FIFO must not block isolate-run and a link must not be followed: the
    # report replaces whatever the program left at the name.
    os.mkdir(os.path.join(workdir, "out"))
    result = cli("--report", "out/report.json", "--", "sh", "-c", plant, cwd=workdir)
    assert result.returncode == 0, result.stderr
    path = os.path.join(workdir, "out", "report.json")
    assert not os.path.islink(path)
    assert json.load(open(path))["status"] == "ok"
    assert not [n for n in os.listdir(os.path.join(workdir, "out")) if n.endswith(".tmp")]


def test_explain_runs_nothing(workdir: str) -> None:
    result = cli("--explain", "--memory", "64M", "--", "touch", "marker", cwd=workdir)
    assert result.returncode in (0, 125)
    if result.returncode == 0:
        assert "landlock" in result.stdout and "namespaces" in result.stdout
    assert not os.path.exists(os.path.join(workdir, "marker"))


def test_profile_and_flags(workdir: str) -> None:
    path = os.path.join(workdir, "p.toml")
    with open(path, "w") as handle:
        handle.write('network = "loopback"\nenv = {GREETING = "hi"}\n[limits]\nopen_files = 64\n')
    result = cli("--profile", path, "--env", "OTHER=2", "--", "sh", "-c",
                 'echo $GREETING $OTHER; ulimit -n; cat /proc/net/dev | grep -c lo', cwd=workdir)
    assert result.stdout.split() == ["hi", "2", "64", "1"], result.stderr


def test_env_flags(workdir: str) -> None:
    result = cli("--env", "A=1", "--keep-env", "ISOLATE_KEEP", "--", "env", cwd=workdir,
                 env={**os.environ, "ISOLATE_KEEP": "k", "ISOLATE_DROP": "d"})
    env = dict(line.split("=", 1) for line in result.stdout.splitlines())
    assert env["A"] == "1" and env["ISOLATE_KEEP"] == "k" and "ISOLATE_DROP" not in env


def test_no_defaults(workdir: str) -> None:
    result = cli("--no-defaults", "--ro", os.path.dirname(PYTHON), "--ro", "/usr", "--", PYTHON, "-I", "-S", "-c",
                 "import os; print(sorted(os.listdir('/')))", cwd="/tmp")
    assert "etc" not in result.stdout, result.stderr


def test_best_effort_warns(workdir: str) -> None:
    # Egress by name needs a network namespace: without namespaces it is refused, or warned about.
    result = cli("--best-effort", "--no-namespaces", "--no-defaults", "--ro", "/usr", "--allow-host",
                 "example.org:443", "--", "true", cwd=workdir)
    assert result.returncode == 0
    assert "warning" in result.stderr and "egress" in result.stderr
    refused = cli("--no-namespaces", "--no-defaults", "--ro", "/usr", "--allow-host", "example.org:443",
                  "--backend", "native", "--", "true", cwd=workdir)
    assert refused.returncode == 125


def test_version_and_doctor(workdir: str) -> None:
    version = cli("--version", cwd=workdir)
    assert version.returncode == 0 and version.stdout.startswith("isolate-run ")
    doctor = cli("doctor", cwd=workdir)
    assert doctor.returncode == 0 and "landlock" in doctor.stdout
    data = json.loads(cli("doctor", "--json", cwd=workdir).stdout)
    checks = {c["mechanism"]: c for c in data["checks"]}
    assert checks["landlock"]["available"] == bool(landlock.abi()) and checks["sandbox"]["available"], checks
    # Egress by name works wherever a namespaced sandbox does.
    assert checks["egress"]["available"] == checks["user-namespaces"]["available"], checks["egress"]


_ = ROOT


@pytest.mark.skipif(not ROOT, reason="the idmapped default cwd makes a system path writable only for a root caller")
@pytest.mark.parametrize("cwd", ["/etc", "/etc/ssl", "/usr/share", "/proc"])
def test_root_default_writable_cwd_refused_under_system_paths(cwd: str) -> None:
    # cd /etc && isolate-run ...: the default "cwd writable" would hand the
    # program /etc, owned by it through the idmapped mount.
    probe = os.path.join(cwd, "isolate-probe")
    try:
        result = cli("--", "sh", "-c", "touch isolate-probe", cwd=cwd)
        assert not os.path.exists(probe)
    finally:
        if os.path.exists(probe):
            os.unlink(probe)
    assert result.returncode == 125
    assert "is a system path" in one_line(result.stderr) and "--rw" in result.stderr


@pytest.mark.skipif(not ROOT, reason="writes a system path as root")
def test_root_explicit_grant_of_a_system_cwd_still_works(tmp_path_factory: pytest.TempPathFactory) -> None:
    # The explicit --rw is the caller's choice (and wins over the default read of /etc).
    probe = "/etc/isolate-test-probe"
    try:
        result = cli("--rw", "/etc", "--", "sh", "-c", f"touch {probe}", cwd="/etc")
        assert result.returncode == 0, result.stderr
        assert os.path.exists(probe)
    finally:
        if os.path.exists(probe):
            os.unlink(probe)


@pytest.mark.parametrize("flag", ["--profile", "--seccomp"])
def test_a_fifo_planted_as_a_profile_does_not_hang(workdir: str, flag: str) -> None:
    # An earlier sandbox could leave a FIFO where a profile is looked for:
    # isolate-run must refuse it at once, not block reading it.
    fifo = os.path.join(workdir, "profile")
    os.mkfifo(fifo)
    result = cli(flag, fifo, "--", "true", cwd=workdir)
    assert result.returncode == 125
    assert "regular file" in one_line(result.stderr) or "profile file" in result.stderr


def test_an_rlimit_above_the_callers_hard_limit_is_named(workdir: str) -> None:
    # The sandbox can only lower a hard limit: the kernel's EPERM blamed "sandbox setup failed at rlimit".
    import resource

    def lower() -> None:
        resource.setrlimit(resource.RLIMIT_NOFILE, (1024, 1024))

    result = cli("--nofile", "2048", "--", "touch", "marker", cwd=workdir, preexec_fn=lower)
    assert result.returncode == 125
    assert "limits.open_files: 2048 is above this process's own hard limit, 1024" in one_line(result.stderr)
    assert not os.path.exists(os.path.join(workdir, "marker"))
    result = cli("--nofile", "1024", "--", "sh", "-c", "ulimit -n", cwd=workdir, preexec_fn=lower)
    assert (result.returncode, result.stdout.strip()) == (0, "1024"), result.stderr



def test_sandbox_create_refuses_an_empty_value_in_one_line(workdir: str) -> None:
    result = cli("sandbox", "create", "isolate-test-empty-image", "--image", "", cwd=workdir)
    assert result.returncode == 125
    assert "--image: an empty value" in one_line(result.stderr)
