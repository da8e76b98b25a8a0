"""The Docker backend, against a real engine.

The engine and the image come from tests/docker_env.sh (dockerd with
--bridge=none, and isolate-test:busybox imported from busybox-static). Where no
engine answers or the image is missing, the engine tests skip saying so; the
mapping, parser and registry tests run everywhere.
"""

from __future__ import annotations

import dataclasses
import io
import json
import os
import shutil
import signal
import subprocess
import sys
import tarfile
import textwrap
import time
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from conftest import ISOLATE_RUN

from isolate.backends import docker as backend
from isolate.backends.docker.sandbox import DockerSandbox as Sandbox
from isolate.backends.docker.sandbox import list_sandboxes, prune
from isolate.backends.registry import Registry, SandboxRecord
from isolate.cli.sandbox import sandbox_main as cli_main
from isolate.model.errors import CommandNotExecutableError, CommandNotFoundError, PolicyError, UnsupportedError
from isolate.model.policy import Egress, Limits, Policy

IMAGE = os.environ.get("ISOLATE_TEST_IMAGE", "isolate-test:busybox")
ROOT = os.geteuid() == 0
REPO = str(Path(__file__).resolve().parent.parent)


def _engine_state() -> tuple[bool, str]:
    try:
        usable, why = backend.available()
    except Exception as exc:  # the SDK missing, or anything else: say so in the skip
        return False, f"{type(exc).__name__}: {exc}"
    if not usable:
        return False, why
    try:
        backend.check_image(IMAGE)
    except Exception as exc:
        return False, f"{exc} (run tests/docker_env.sh)"
    return True, why


ENGINE_OK, ENGINE_WHY = _engine_state()
engine = pytest.mark.skipif(not ENGINE_OK, reason=f"no usable Docker engine: {ENGINE_WHY}")

# ---------------------------------------------------------------------------
# helpers


def pol(**changes: Any) -> Policy:
    """A policy on the test image with no host paths unless asked."""
    changes.setdefault("read", [])
    changes.setdefault("write", [])
    changes.setdefault("network", "loopback")  # Docker cannot enforce "none" (its lo is always up)
    return Policy(image=IMAGE, **changes)


def sh(script: str, policy: Policy, **kwargs: Any) -> subprocess.CompletedProcess[Any]:
    kwargs.setdefault("capture_output", True)
    kwargs.setdefault("text", True)
    kwargs.setdefault("stdin", subprocess.DEVNULL)
    return backend.run(["sh", "-c", script], policy=policy, **kwargs)


def shared_dir(path: Path, mode: int) -> Path:
    """A directory the program (65534 when we are root) can use once bound (its parents inside are the engine's)."""
    path.mkdir(parents=True, exist_ok=True)
    path.chmod(mode)
    return path


def isolate_containers() -> list[dict[str, Any]]:
    return backend.list_containers()


def volume_names() -> set[str]:
    return {v["Name"] for v in (backend.client().api.volumes().get("Volumes") or [])}


@pytest.fixture
def registry(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Registry:
    monkeypatch.setenv("ISOLATE_STATE_DIR", str(tmp_path / "state"))
    return Registry()


@pytest.fixture(scope="module")
def cleanup() -> Iterator[None]:
    """Remove whatever the engine tests of this module leave (they should leave nothing)."""
    yield
    if ENGINE_OK:
        for container in isolate_containers():
            name = ((container.get("Labels") or {}).get(backend.LABEL_NAME)) or ""
            if name.startswith(f"pytest-{os.getpid()}-"):
                backend.remove_container(container["Id"])


def sandbox_name(request: pytest.FixtureRequest) -> str:
    return f"pytest-{os.getpid()}-{request.node.name[:30].replace('[', '-').replace(']', '')}"


# ---------------------------------------------------------------------------
# the mapping (no engine needed)


def test_default_policy_mapping(tmp_path: Path) -> None:
    spec = backend.build_spec(Policy(seccomp="none", network="loopback"), cwd=tmp_path,
                              environ={"PATH": "/bin", "SECRET": "x"})
    assert spec.mounts == (backend.BindMount(str(tmp_path.resolve()), str(tmp_path), False),)  # cwd rw, no /usr...
    assert spec.working_dir == str(tmp_path)
    assert spec.tmpfs == ("/tmp", "/var/tmp", "/home/sandbox")  # the private home, as with the native backend
    assert spec.network_mode == "none"
    assert "no-new-privileges:true" in spec.security_opt
    assert "seccomp=unconfined" in spec.security_opt
    assert dict(spec.environment) == {"PATH": "/bin", "HOME": "/home/sandbox"}
    expected_uid = 65534 if ROOT else os.geteuid()
    assert (spec.uid, spec.gid) == (expected_uid, 65534 if ROOT else os.getegid())
    assert spec.image == (os.environ.get(backend.IMAGE_ENV) or backend.DEFAULT_IMAGE)
    assert spec.enforced["capabilities"] == "dropped" and spec.enforced["network"] == "loopback"
    labels = spec.labels("run")
    assert labels[backend.LABEL] == "1"
    assert labels[backend.LABEL_CONFIG_HASH] == Policy(seccomp="none", network="loopback").config_hash()


def test_host_config_options(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    pytest.importorskip("docker")
    (tmp_path / "ro").mkdir()
    (tmp_path / "rw").mkdir()
    monkeypatch.chdir(tmp_path)
    policy = Policy(
        seccomp="none",
        network="loopback",
        read=["/usr", "ro"],
        write=["rw"],
        tmpfs=["/tmp", "/scratch"],
        limits=Limits(memory="64M", pids=32, cpus=0.5, open_files=64, file_size="1M", cpu_seconds=2.5),
    )
    spec = backend.build_spec(policy, cwd=tmp_path)
    config = spec.host_config()
    assert config["read_only"] is True
    assert config["cap_drop"] == ["ALL"]
    assert config["network_mode"] == "none"
    assert config["mem_limit"] == config["memswap_limit"] == 64 * 1024 * 1024
    assert config["pids_limit"] == 32
    assert config["nano_cpus"] == 500_000_000
    assert set(config["tmpfs"]) == {"/tmp", "/scratch", "/home/sandbox"}
    assert all("exec" in options.split(",") for options in config["tmpfs"].values())
    mounts = {m["Target"]: m for m in config["mounts"]}
    assert set(mounts) == {str(tmp_path / "ro"), str(tmp_path / "rw")}  # /usr comes from the image
    assert mounts[str(tmp_path / "ro")]["ReadOnly"] is True
    assert mounts[str(tmp_path / "rw")]["ReadOnly"] is False
    ulimits = {u["Name"]: (u["Soft"], u["Hard"]) for u in config["ulimits"]}
    assert ulimits == {"nofile": (64, 64), "fsize": (1024 * 1024, 1024 * 1024), "cpu": (3, 4)}


def test_seccomp_profile_file_is_handed_over(tmp_path: Path) -> None:
    profile = {"defaultAction": "SCMP_ACT_ALLOW", "syscalls": [{"names": ["mkdir"], "action": "SCMP_ACT_ERRNO"}]}
    path = tmp_path / "profile.json"
    path.write_text(json.dumps(profile))
    option, reported = backend.seccomp_option(str(path))
    assert option.startswith("seccomp=")
    assert json.loads(option.removeprefix("seccomp="))["syscalls"][0]["names"] == ["mkdir"]
    assert reported == str(path)
    assert backend.seccomp_option("none") == ("seccomp=unconfined", "none")


def test_default_seccomp_is_the_policy_profile() -> None:
    seccomp = pytest.importorskip("isolate.kernel.seccomp")
    option, reported = backend.seccomp_option("default")
    assert reported == "default"
    assert json.loads(option.removeprefix("seccomp=")) == json.loads(json.dumps(seccomp.oci_profile("default")))


def test_egress_is_refused_or_warned() -> None:
    policy = Policy(seccomp="none", write=[], network=Egress(("example.org:443",)))
    assert backend.unsupported_reasons(policy).keys() == {"network"}
    with pytest.raises(UnsupportedError, match="network"):
        backend.build_spec(policy)
    spec = backend.build_spec(policy.replace(best_effort=True))
    assert spec.network_mode == "none"  # best effort closes the network, never opens the host's
    assert any("network" in w for w in spec.warnings)


def test_network_none_is_the_default_and_refuses_sockets() -> None:
    # The default policy (network none) used to be refused: a container's lo is always up. Now the
    # container's seccomp profile refuses socket() for every family but AF_UNIX, whatever the profile.
    for mode in ("none", "default", "strict"):
        policy = Policy(seccomp=mode, write=[])
        assert "network" not in backend.unsupported_reasons(policy)
        spec = backend.build_spec(policy)
        assert spec.network_mode == "none"
        assert not [w for w in spec.warnings if "network" in w]
        assert spec.enforced["network"] == "netns-loopback+seccomp-sockets"
        option = next(o for o in spec.security_opt if o.startswith("seccomp="))
        profile = json.loads(option[len("seccomp="):])
        socket_rules = [r for r in profile["syscalls"] if "socket" in r["names"]]
        assert all(r["action"] != "SCMP_ACT_ALLOW" or r["args"][0]["valueTwo"] == 1 for r in socket_rules), mode
        if profile["defaultAction"] == "SCMP_ACT_ALLOW":
            assert {"index": 0, "value": 1, "op": "SCMP_CMP_NE"} in [a for r in socket_rules for a in r["args"]]
    assert backend.build_spec(Policy(seccomp="none", write=[], network="loopback")).security_opt.count(
        "seccomp=unconfined") == 1


def test_kept_server_guard_refuses_unix_stream_and_dgram_but_not_seqpacket(tmp_path: Path) -> None:
    # A kept Sandbox's exec server makes its own listening socket (nothing can hand one into a container):
    # under the unix socket guard, socket(AF_UNIX) stays refused for stream and datagram types only.
    shown = tmp_path / "ro"
    shown.mkdir()
    for server in (False, True):
        spec = backend.build_spec(Policy(seccomp="default", write=[], read=[str(shown)]), server_socket=server)
        option = next(o for o in spec.security_opt if o.startswith("seccomp="))
        profile = json.loads(option[len("seccomp="):])
        guards = [r for r in profile["syscalls"] if r["names"] == ["socket"] and r["action"] == "SCMP_ACT_ERRNO"
                  and any(a.get("valueTwo") == 1 and a["index"] == 0 for a in r.get("args", []))]
        types = sorted(a["valueTwo"] for r in guards for a in r.get("args", []) if a["index"] == 1)
        if server:
            assert types == [1, 2, 3] and len(guards) == 3, guards
            assert spec.enforced["unix_sockets"] == "seccomp-no-unix-sockets-but-seqpacket"
        else:
            assert types == [] and len(guards) == 1, guards
            assert spec.enforced["unix_sockets"] == "seccomp-no-unix-sockets"


def test_binds_are_mounted_at_their_target_through_the_grant_resolver(tmp_path: Path) -> None:
    # Policy.binds (isolate.Mount) were ignored by this backend: a host path asked for was silently absent.
    from isolate.model.policy import Mount

    shown = tmp_path / "shown"
    shown.mkdir()
    spec = backend.build_spec(Policy(write=[], binds=[Mount(str(shown), "/elsewhere", "rw"),
                                                      Mount(str(shown), "/again")]))
    assert {(m.source, m.target, m.read_only) for m in spec.mounts} >= {
        (str(shown.resolve()), "/elsewhere", False), (str(shown.resolve()), "/again", True)}
    assert spec.enforced["binds"] == {"ro": ["/again"], "rw": ["/elsewhere"]}
    with pytest.raises(PolicyError, match="does not exist"):
        backend.build_spec(Policy(write=[], binds=[Mount(str(tmp_path / "missing"), "/x")]))


def test_network_sockets_rule_never_widens_a_profile() -> None:
    from isolate.kernel import seccomp

    deny_all = {"defaultAction": "SCMP_ACT_ERRNO", "syscalls": [{"names": ["read"], "action": "SCMP_ACT_ALLOW"}]}
    assert seccomp.without_network_sockets(deny_all) == deny_all
    inet_only = {"defaultAction": "SCMP_ACT_ERRNO", "syscalls": [
        {"names": ["socket", "read"], "action": "SCMP_ACT_ALLOW", "args": [{"index": 0, "value": 2,
                                                                          "op": "SCMP_CMP_EQ"}]}]}
    out = seccomp.without_network_sockets(inet_only)
    assert out["syscalls"] == [{"names": ["read"], "action": "SCMP_ACT_ALLOW",
                                "args": [{"index": 0, "value": 2, "op": "SCMP_CMP_EQ"}]}]
    anything = {"defaultAction": "SCMP_ACT_ERRNO", "syscalls": [{"names": ["socket"], "action": "SCMP_ACT_ALLOW"}]}
    rules = seccomp.without_network_sockets(anything)["syscalls"]
    assert rules == [{"names": ["socket"], "action": "SCMP_ACT_ALLOW", "comment": "network none: AF_UNIX only",
                      "args": [{"index": 0, "value": 0xFFFFFFFF, "valueTwo": 1, "op": "SCMP_CMP_MASKED_EQ"}]}]


def test_engine_without_memory_cgroup_refuses() -> None:
    weak = backend.EngineInfo("x", "1.41", True, True, False, False, False, False, "1")
    policy = Policy(seccomp="none", network="loopback", write=[], limits=Limits(memory="64M", pids=5))
    with pytest.raises(UnsupportedError, match=r"limits\.memory"):
        backend.build_spec(policy, engine=weak)
    assert set(backend.unsupported_reasons(policy, weak)) == {"limits.memory", "limits.pids"}


def test_relative_paths_resolve_against_the_run_cwd(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    (tmp_path / "data").mkdir()
    (tmp_path / "elsewhere").mkdir()
    monkeypatch.chdir(tmp_path)
    policy = Policy(seccomp="none", network="loopback", read=["data"], write=[])
    spec = backend.build_spec(policy, cwd=tmp_path)
    assert spec.mounts == (backend.BindMount(str((tmp_path / "data").resolve()), str(tmp_path / "data"), True),)
    with pytest.raises(PolicyError, match="does not exist"):
        backend.build_spec(policy, cwd=tmp_path / "elsewhere")


def test_spec_hash_follows_the_container_not_the_environment(tmp_path: Path) -> None:
    policy = Policy(seccomp="none", network="loopback", write=[])
    first = backend.build_spec(policy, cwd=tmp_path, environ={"PATH": "/a"})
    again = backend.build_spec(policy, cwd=tmp_path, environ={"PATH": "/b"})
    assert first.spec_hash() == again.spec_hash()
    assert backend.build_spec(policy.replace(limits=Limits(pids=9)), cwd=tmp_path).spec_hash() != first.spec_hash()
    assert backend.build_spec(policy, cwd=tmp_path, image="other:tag").spec_hash() != first.spec_hash()


def test_demux_splits_frames_across_reads() -> None:
    demux = backend._Demux()
    data = b"\x01\x00\x00\x00\x00\x00\x00\x03out" + b"\x02\x00\x00\x00\x00\x00\x00\x04err!"
    assert demux.feed(data[:5]) == []
    assert demux.feed(data[5:13]) == [(1, b"out")]
    assert demux.feed(data[13:]) == [(2, b"err!")]


def test_failure_messages_are_held_even_in_pieces() -> None:
    sink = backend._Sink("capture")
    holder = backend._Holder(backend._TINI_HOLD, sink)
    for piece in (b"[FATAL ", b"tini (7)] ", b"exec nope failed: No such file or directory\n"):
        holder.feed(piece)
    holder.finish()
    assert holder.held is not None and b"nope" in holder.held and sink.value() == b""

    for output in (b"[FATAL but not tini\n", b"plain output\n", b"[FATAL tini (7)] something else\n"):
        sink = backend._Sink("capture")
        holder = backend._Holder(backend._TINI_HOLD, sink)
        holder.feed(output[:3])
        holder.feed(output[3:])
        holder.feed(b"more\n")
        holder.finish()
        assert holder.held is None and sink.value() == output + b"more\n"


def test_exit_codes_are_read_as_signals_only_when_known() -> None:
    spec = backend.build_spec(Policy(seccomp="none", network="loopback", write=[],
                                     limits=Limits(cpu_seconds=1, file_size="1M")))
    monitor = backend._Monitor(None, "x", None, lambda: None)
    plain = backend._Outcome()
    assert backend._classify(3, oom=False, outcome=plain, spec=spec, monitor=monitor) == (3, None)
    assert backend._classify(139, oom=False, outcome=plain, spec=spec, monitor=monitor) == (139, None)
    assert backend._classify(128 + 24, oom=False, outcome=plain, spec=spec, monitor=monitor) == (-24, None)
    assert backend._classify(128 + 25, oom=False, outcome=plain, spec=spec, monitor=monitor) == (-25, None)
    assert backend._classify(137, oom=True, outcome=plain, spec=spec, monitor=monitor) == (-9, "memory")
    killed = backend._Outcome(killed_for="wall")
    assert backend._classify(137, oom=False, outcome=killed, spec=spec, monitor=monitor) == (-9, "timeout")


def test_registry_records_and_forgets(registry: Registry) -> None:
    rec = SandboxRecord("unix:///x", "box", "abc", "h1", "s1", "img", 100.0, 100.0)
    registry.record(rec)
    assert registry.get("unix:///x", "box") == rec
    registry.touch("unix:///x", "box", 250.0)
    assert registry.get("unix:///x", "box") == SandboxRecord("unix:///x", "box", "abc", "h1", "s1", "img", 100.0, 250.0)
    assert registry.all("unix:///other") == []
    assert registry.forget("unix:///x", "box") is True
    assert registry.get("unix:///x", "box") is None
    assert oct(os.stat(os.path.dirname(registry.path)).st_mode & 0o777) == "0o700"


def test_cli_usage_errors_are_one_line_and_125(capsys: pytest.CaptureFixture[str]) -> None:
    assert cli_main(["frobnicate"]) == 125
    assert cli_main(["prune", "--idle", "soon"]) == 125
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 2 and all(line.startswith("isolate-run sandbox: ") for line in err)


def test_sandbox_names_are_checked() -> None:
    with pytest.raises(PolicyError, match="sandbox name"):
        Sandbox(Policy(seccomp="none", network="loopback"), name="../etc")
    with pytest.raises(UnsupportedError, match="docker backend"):
        Sandbox(Policy(seccomp="none", network="loopback"), backend="native", name="x")


# ---------------------------------------------------------------------------
# one-shot runs in a real engine


@engine
def test_available_names_the_engine() -> None:
    usable, why = backend.available()
    assert usable and "Docker Engine" in why


@engine
def test_output_capture_and_exit_code(cleanup: None) -> None:
    result = sh("echo out; echo err >&2; exit 42", pol())
    assert (result.returncode, result.stdout, result.stderr) == (42, "out\n", "err\n")
    report = result.report
    assert (report.status, report.exit_code, report.backend) == ("exited", 42, "docker")
    assert report.enforced["seccomp"] == "default"
    assert report.enforced["capabilities"] == "dropped"
    assert report.wall_seconds > 0
    assert sh("true", pol()).report.status == "ok"


@engine
def test_stderr_to_stdout_and_binary_input(cleanup: None) -> None:
    data = bytes(range(256)) * 1000
    result = backend.run(["cat"], policy=pol(), input=data, capture_output=True)
    assert result.stdout == data
    merged = backend.run(
        ["sh", "-c", "echo a; echo b >&2"], policy=pol(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    )
    assert sorted(merged.stdout.split()) == ["a", "b"] and merged.stderr is None


@engine
def test_stdin_from_a_file(tmp_path: Path, cleanup: None) -> None:
    source = tmp_path / "in.txt"
    source.write_text("line one\nline two\n")
    with open(source, "rb") as handle:
        result = backend.run(["wc", "-l"], policy=pol(), stdin=handle, capture_output=True, text=True)
    assert result.stdout.strip() == "2"


@engine
def test_stdout_passes_through_to_our_fd(capfd: pytest.CaptureFixture[str], cleanup: None) -> None:
    result = backend.run(["sh", "-c", "echo to-fd1; echo to-fd2 >&2"], policy=pol(), stdin=subprocess.DEVNULL)
    assert result.stdout is None and result.stderr is None
    out, err = capfd.readouterr()
    assert out == "to-fd1\n" and err == "to-fd2\n"


@engine
def test_default_stdin_and_stdout_pass_through_a_caller_process(cleanup: None) -> None:
    code = textwrap.dedent(
        f"""
        from isolate.backends import docker
        from isolate.model.policy import Policy
        p = Policy(image={IMAGE!r}, read=[], write=[], network='loopback')
        r = docker.run(["sh", "-c", "tr a-z A-Z; exit 7"], policy=p)
        raise SystemExit(0 if r.returncode == 7 and r.stdout is None else 1)
        """
    )
    env = dict(os.environ, PYTHONPATH=REPO)
    done = subprocess.run([sys.executable, "-c", code], input=b"piped text\n", capture_output=True, env=env, timeout=60)
    assert done.returncode == 0, done.stderr
    assert done.stdout == b"PIPED TEXT\n"


@engine
def test_command_not_found_and_not_executable(cleanup: None) -> None:
    with pytest.raises(CommandNotFoundError, match="no-such-program"):
        backend.run(["no-such-program"], policy=pol(), stdin=subprocess.DEVNULL)
    with pytest.raises(CommandNotExecutableError):
        backend.run(["/etc/passwd"], policy=pol(), stdin=subprocess.DEVNULL)


@engine
def test_without_init_the_runtime_reports_missing_commands(cleanup: None) -> None:
    spec = dataclasses.replace(backend.prepare(pol()), init=False)  # an engine without docker-init
    with pytest.raises(CommandNotFoundError, match="no-such-program"):
        backend.run(["no-such-program"], policy=pol(), spec=spec, stdin=subprocess.DEVNULL)
    with pytest.raises(CommandNotExecutableError):
        backend.run(["/etc/passwd"], policy=pol(), spec=spec, stdin=subprocess.DEVNULL)
    assert backend.run(["true"], policy=pol(), spec=spec, stdin=subprocess.DEVNULL).returncode == 0


@engine
def test_check_raises_called_process_error(cleanup: None) -> None:
    with pytest.raises(subprocess.CalledProcessError) as caught:
        sh("echo partial; exit 3", pol(), check=True)
    assert caught.value.returncode == 3 and caught.value.output == "partial\n"


@engine
def test_timeout_raises_and_removes_the_container(cleanup: None) -> None:
    before = {c["Id"] for c in isolate_containers()}
    started = time.monotonic()
    with pytest.raises(subprocess.TimeoutExpired) as caught:
        sh("echo early; sleep 60", pol(), timeout=1.0)
    assert time.monotonic() - started < 30
    assert caught.value.output == "early\n"
    assert {c["Id"] for c in isolate_containers()} <= before


@engine
def test_wall_limit_kills_with_status_timeout(cleanup: None) -> None:
    result = sh("sleep 60", pol(limits=Limits(wall_seconds=1)))
    assert result.returncode == -signal.SIGKILL
    assert result.report.status == "timeout"
    assert 0.5 < result.report.wall_seconds < 30


@engine
def test_memory_limit_kills_with_status_memory(cleanup: None) -> None:
    # tail keeps the whole (newline-free) input as its last line: it grows past the limit
    result = sh("head -c 300m /dev/zero | tail", pol(limits=Limits(memory="64M", wall_seconds=60)))
    assert result.report.status == "memory", (result.returncode, result.stderr)
    assert result.returncode == -signal.SIGKILL
    assert result.report.oom_kills == 1
    assert result.report.enforced["memory"] == "docker-cgroup"


@engine
def test_pids_limit_holds(cleanup: None) -> None:
    script = "cat /sys/fs/cgroup/pids/pids.max 2>/dev/null; for i in $(seq 1 30); do sleep 5 & done; echo spawned"
    result = sh(script, pol(limits=Limits(pids=8, wall_seconds=30)))
    assert "can't fork" in result.stderr or "Resource temporarily unavailable" in result.stderr, result.stderr
    assert result.report.enforced["pids"] == "docker-cgroup"


@engine
def test_cpu_seconds_limit_reports_cpu(cleanup: None) -> None:
    result = sh("while :; do :; done", pol(limits=Limits(cpu_seconds=1, wall_seconds=60)))
    assert result.report.status == "cpu", (result.returncode, result.stderr)
    assert result.returncode in (-signal.SIGXCPU, -signal.SIGKILL)


@engine
def test_file_size_limit_reports_file_size(cleanup: None) -> None:
    result = sh("head -c 2097152 /dev/zero > /tmp/big", pol(limits=Limits(file_size="1M", wall_seconds=30)))
    assert result.report.status == "file-size", (result.returncode, result.stderr)
    assert result.returncode == -signal.SIGXFSZ


@engine
def test_open_files_and_cpus_reach_the_container(cleanup: None) -> None:
    script = "ulimit -n; cat /sys/fs/cgroup/cpu/cpu.cfs_quota_us /sys/fs/cgroup/cpu/cpu.cfs_period_us"
    result = sh(script, pol(limits=Limits(open_files=77, cpus=0.5)))
    nofile, quota, period = result.stdout.split()
    assert nofile == "77"
    assert int(quota) * 2 == int(period)


@engine
def test_no_network_has_only_lo(cleanup: None) -> None:
    for mode in ("loopback",):
        result = sh("ls /sys/class/net; cat /proc/net/dev", pol(network=mode))
        lines = result.stdout.split("\n")
        assert lines[0] == "lo"
        devices = [line.split(":")[0].strip() for line in lines[1:] if ":" in line]
        assert devices == ["lo"], (mode, result.stdout)
        assert result.report.enforced["network"] == "loopback"  # Docker's none keeps a private lo up
    flags = sh("cat /sys/class/net/lo/flags", pol(network="loopback")).stdout.strip()
    assert int(flags, 16) & 0x1  # IFF_UP


@engine
def test_default_network_none_runs_and_has_no_usable_socket(cleanup: None) -> None:
    result = sh("cat /proc/net/dev | tail -n +3 | cut -d: -f1; nc 127.0.0.1 80 </dev/null; echo nc=$?",
                pol(network="none"))
    assert result.stdout.split() == ["lo", "nc=1"], result.stdout + result.stderr
    assert "socket: Operation not permitted" in result.stderr
    assert result.report.enforced["network"] == "netns-loopback+seccomp-sockets"
    cli = subprocess.run([ISOLATE_RUN, "--backend", "docker", "--image", IMAGE, "--", "true"],
                         capture_output=True, text=True, timeout=120, cwd="/tmp")
    assert cli.returncode == 0, cli.stderr


@engine
def test_home_is_private_and_writable_as_native(cleanup: None, tmp_path: Any) -> None:
    shared = tmp_path / "gitconfig"
    shared.write_text("[user]\n\tname = Docker Test\n")
    shared.chmod(0o644)
    os.chmod(tmp_path, 0o755)
    result = sh('echo "$HOME"; touch ~/made && ls -A ~; cat ~/gitconfig',
                pol(home_files=[str(shared)]))
    assert result.returncode == 0, result.stderr
    assert result.stdout.split()[:3] == ["/home/sandbox", "gitconfig", "made"], result.stdout
    assert "Docker Test" in result.stdout
    assert result.report.enforced["home"]["files"] == ["/home/sandbox/gitconfig"]


@engine
def test_host_network_is_the_hosts(cleanup: None) -> None:
    result = sh("ls /sys/class/net", pol(network="host"))
    assert sorted(result.stdout.split()) == sorted(os.listdir("/sys/class/net"))


@engine
def test_root_is_read_only_and_tmp_is_private(cleanup: None) -> None:
    result = sh("touch /x; echo data > /tmp/f && cat /tmp/f; cat /etc/passwd", pol())
    assert "Read-only file system" in result.stderr
    assert result.stdout.startswith("data\n")
    assert "nobody" in result.stdout  # the image's /etc, not the host's
    with open("/etc/passwd") as handle:
        assert result.stdout.removeprefix("data\n") != handle.read()


@engine
def test_no_capabilities_no_new_privileges_and_seccomp(cleanup: None) -> None:
    result = sh("grep -E '^(CapEff|CapBnd|CapPrm|NoNewPrivs|Seccomp):' /proc/self/status", pol())
    fields = dict(line.split(":\t") for line in result.stdout.strip().split("\n"))
    assert int(fields["CapEff"], 16) == int(fields["CapBnd"], 16) == int(fields["CapPrm"], 16) == 0
    assert fields["NoNewPrivs"] == "1"
    assert fields["Seccomp"] == "2"
    unconfined = sh("grep '^Seccomp:' /proc/self/status", pol(seccomp="none"))
    assert unconfined.stdout.split() == ["Seccomp:", "0"]
    assert unconfined.report.enforced["seccomp"] == "none"


@engine
def test_seccomp_profile_file_is_enforced(tmp_path: Path, cleanup: None) -> None:
    profile = {
        "defaultAction": "SCMP_ACT_ALLOW",
        "syscalls": [{"names": ["mkdir", "mkdirat"], "action": "SCMP_ACT_ERRNO", "errnoRet": 1}],
    }
    path = tmp_path / "deny-mkdir.json"
    path.write_text(json.dumps(profile))
    result = sh("mkdir /tmp/d && echo made", pol(seccomp=str(path)))
    assert result.returncode != 0 and "made" not in result.stdout
    assert "Operation not permitted" in result.stderr
    assert sh("mkdir /tmp/d && echo made", pol(seccomp="none")).stdout == "made\n"


@engine
def test_bind_mounts_read_only_and_writable(tmp_path: Path, cleanup: None) -> None:
    ro = shared_dir(tmp_path / "ro", 0o755)
    rw = shared_dir(tmp_path / "rw", 0o777)
    (ro / "hello").write_text("from host\n")
    (ro / "hello").chmod(0o644)
    script = f"cat {ro}/hello; touch {ro}/nope; echo made > {rw}/new; ls {tmp_path}"
    result = sh(script, pol(read=[str(ro)], write=[str(rw)]))
    assert result.stdout.startswith("from host\n")
    assert "Read-only file system" in result.stderr
    assert (rw / "new").read_text() == "made\n"
    assert not (ro / "nope").exists()
    assert sorted(result.stdout.split()[2:]) == ["ro", "rw"]  # siblings are not bound
    uid = 65534 if ROOT else os.geteuid()
    assert (rw / "new").stat().st_uid == uid
    binds = result.report.enforced["binds"]
    assert binds == {"ro": [str(ro)], "rw": [str(rw)]}


@engine
def test_relative_write_and_working_directory(tmp_path: Path, monkeypatch: pytest.MonkeyPatch, cleanup: None) -> None:
    monkeypatch.chdir("/")
    work = shared_dir(tmp_path / "work", 0o777)
    os.chdir(tmp_path)  # the policy checks relative paths where it is made
    result = sh("pwd; echo x > work/out", pol(write=["work"]), cwd=tmp_path)
    assert result.stdout == f"{tmp_path}\n"
    assert (work / "out").read_text() == "x\n"
    inside = sh("pwd", pol(write=[str(work)], cwd=str(work)), cwd=tmp_path)
    assert inside.stdout == f"{work}\n"


@engine
def test_environment_is_minimal(monkeypatch: pytest.MonkeyPatch, cleanup: None) -> None:
    monkeypatch.setenv("ISOLATE_KEEP_ME", "kept")
    monkeypatch.setenv("ISOLATE_SECRET", "leak")
    policy = pol(keep_env=["ISOLATE_KEEP_ME"], env={"GIVEN": "1"})
    names = dict(line.split("=", 1) for line in sh("env", policy).stdout.splitlines() if "=" in line)
    assert names["ISOLATE_KEEP_ME"] == "kept" and names["GIVEN"] == "1"
    assert "ISOLATE_SECRET" not in names


@engine
def test_who_the_program_is(cleanup: None) -> None:
    ids = sh("id -u; id -g", pol()).stdout.split()
    assert ids == ([str(65534)] * 2 if ROOT else [str(os.geteuid()), str(os.getegid())])
    assert sh("id -u; id -g", pol(uid=1234, gid=4321)).stdout.split() == ["1234", "4321"]


@engine
def test_death_of_the_caller_removes_the_container(tmp_path: Path, cleanup: None) -> None:
    marker = f"pytest-orphan-{os.getpid()}"
    code = textwrap.dedent(
        f"""
        from isolate.backends import docker
        from isolate.model.policy import Policy
        p = Policy(image={IMAGE!r}, read=[], write=[], network='loopback', env={{"M": {marker!r}}})
        docker.run(["sleep", "300"], policy=p,
                   stdin=-3)
        """
    )
    child = subprocess.Popen([sys.executable, "-c", code], env=dict(os.environ, PYTHONPATH=REPO))

    def ours() -> list[str]:
        found = []
        for container in isolate_containers():
            info = backend.client().api.inspect_container(container["Id"])
            if f"M={marker}" in (info["Config"].get("Env") or []):
                found.append(container["Id"])
        return found

    deadline = time.monotonic() + 60
    while not ours():
        assert child.poll() is None and time.monotonic() < deadline, "the run never started its container"
        time.sleep(0.2)
    child.kill()
    child.wait()
    deadline = time.monotonic() + 60
    while ours():
        assert time.monotonic() < deadline, "the container outlived its caller"
        time.sleep(0.2)


# ---------------------------------------------------------------------------
# kept sandboxes


@engine
def test_kept_sandbox_reuses_and_recreates(registry: Registry, request: pytest.FixtureRequest, cleanup: None) -> None:
    name = sandbox_name(request)
    policy = pol()
    first = Sandbox(policy, name=name)
    try:
        first.start()
        assert first.last_action == "created"
        assert first.run(["sh", "-c", "echo kept > /tmp/state"], stdin=subprocess.DEVNULL).returncode == 0
        again = Sandbox(policy, name=name)
        again.start()
        assert again.last_action == "reused" and again.container_id == first.container_id
        result = again.run(["cat", "/tmp/state"], capture_output=True, text=True, stdin=subprocess.DEVNULL)
        assert result.stdout == "kept\n"
        assert result.report.backend == "docker"
        record = registry.get(backend.engine_address(), name)
        assert record is not None and record.config_hash == policy.config_hash()

        changed = Sandbox(policy.replace(limits=Limits(pids=16)), name=name)
        changed.start()
        assert changed.last_action == "recreated" and changed.container_id != first.container_id
        gone = changed.run(["cat", "/tmp/state"], capture_output=True, text=True, stdin=subprocess.DEVNULL)
        assert gone.returncode != 0
        record = registry.get(backend.engine_address(), name)
        assert record is not None and record.config_hash == changed.policy.config_hash()
        info = backend.client().api.inspect_container(changed.container_id)
        assert info["Config"]["Labels"][backend.LABEL_CONFIG_HASH] == changed.policy.config_hash()
        assert info["HostConfig"]["PidsLimit"] == 16
    finally:
        first.remove()
    assert registry.get(backend.engine_address(), name) is None
    assert not [c for c in isolate_containers() if c["Labels"].get(backend.LABEL_NAME) == name]


@engine
def test_kept_sandbox_exec_io_limits_and_errors(
    registry: Registry, request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch, cleanup: None
) -> None:
    monkeypatch.setenv("ISOLATE_KEEP_ME", "kept")
    policy = pol(limits=Limits(memory="64M"), env={"GIVEN": "1"}, keep_env=["ISOLATE_KEEP_ME"])
    box = Sandbox(policy, name=sandbox_name(request))
    try:
        env = box.run(["env"], capture_output=True, text=True, stdin=subprocess.DEVNULL).stdout.splitlines()
        assert "GIVEN=1" in env and "ISOLATE_KEEP_ME=kept" in env
        assert "HOME=/home/sandbox" in env  # the container's private home, not the caller's HOME
        result = box.run(["sh", "-c", "tr a-z A-Z; echo e >&2; exit 5"], input="abc\n", capture_output=True, text=True)
        assert (result.returncode, result.stdout, result.stderr) == (5, "ABC\n", "e\n")
        assert result.report.status == "exited"
        seccomp = box.run(["grep", "^Seccomp:", "/proc/self/status"], capture_output=True, text=True, stdin=-3)
        assert seccomp.stdout.split() == ["Seccomp:", "2"]
        with pytest.raises(CommandNotFoundError):
            box.run(["no-such-program"], stdin=subprocess.DEVNULL)
        with pytest.raises(subprocess.TimeoutExpired):
            box.run(["sleep", "60"], timeout=1.0, stdin=subprocess.DEVNULL)
        after = box.run(["echo", "back"], capture_output=True, text=True, stdin=subprocess.DEVNULL)
        assert after.stdout == "back\n" and box.last_action == "restarted"
        oom = box.run(["sh", "-c", "head -c 300m /dev/zero | tail"], capture_output=True, stdin=subprocess.DEVNULL)
        assert oom.report.status == "memory", (oom.returncode, oom.stderr)
        assert oom.report.oom_kills >= 1
        in_dir = box.run(["pwd"], cwd="/tmp", capture_output=True, text=True, stdin=subprocess.DEVNULL)
        assert in_dir.stdout == "/tmp\n"
    finally:
        box.remove()


@engine
def test_image_without_sleep_cannot_keep_a_sandbox(
    registry: Registry, request: pytest.FixtureRequest, cleanup: None
) -> None:
    busybox = shutil.which("busybox")
    if busybox is None:
        pytest.skip("no busybox binary on the host to build the sleep-less image from")
    blob = io.BytesIO()
    with tarfile.open(fileobj=blob, mode="w") as tar:
        tar.add(busybox, arcname="bin/busybox")
        link = tarfile.TarInfo("bin/sh")
        link.type, link.linkname = tarfile.SYMTYPE, "busybox"
        tar.addfile(link)
    tag = f"isolate-test:nosleep-{os.getpid()}"
    api = backend.client().api
    api.import_image_from_data(blob.getvalue(), repository=tag.split(":")[0], tag=tag.split(":")[1])
    box = Sandbox(pol(), name=sandbox_name(request), image=tag)
    try:
        with pytest.raises(UnsupportedError, match="sleep"):
            box.run(["sh", "-c", "true"], stdin=subprocess.DEVNULL)
    finally:
        box.remove()
        api.remove_image(tag, force=True)


@engine
def test_unnamed_sandbox_is_removed_on_close(registry: Registry, cleanup: None) -> None:
    with Sandbox(pol()) as box:
        container_id = box.container_id
        assert box.run(["true"], stdin=subprocess.DEVNULL).returncode == 0
    assert container_id not in {c["Id"] for c in isolate_containers()}
    assert registry.get(backend.engine_address(), box.name) is None


@engine
def test_prune_list_and_rm(
    registry: Registry, request: pytest.FixtureRequest, capsys: pytest.CaptureFixture[str], cleanup: None
) -> None:
    base = sandbox_name(request)
    idle, fresh, listed = f"{base}-idle", f"{base}-fresh", f"{base}-rm"
    for name in (idle, fresh, listed):
        Sandbox(pol(), name=name).start()
    try:
        registry.touch(backend.engine_address(), idle, time.time() - 3600)
        names = {entry.record.name: entry.state for entry in list_sandboxes()}
        assert names[idle] == names[fresh] == names[listed] == "running"

        removed = dict(prune(idle=600, age=None))
        assert idle in removed and fresh not in removed and listed not in removed
        assert registry.get(backend.engine_address(), idle) is None

        capsys.readouterr()
        assert cli_main(["sandbox", "list"]) == 0
        out = capsys.readouterr().out
        assert fresh in out and listed in out and idle not in out

        assert cli_main(["rm", listed]) == 0
        assert cli_main(["rm", listed]) == 125
        assert "no such sandbox" in capsys.readouterr().err

        backend.remove_container(backend.kept_container_name(fresh))  # the registry now holds a dead record
        assert cli_main(["prune", "--idle", "3600"]) == 0
        assert f"removed {fresh} (container gone)" in capsys.readouterr().out
        assert registry.all(backend.engine_address()) == []
    finally:
        for name in (idle, fresh, listed):
            backend.remove_container(backend.kept_container_name(name))


@engine
def test_prune_spares_other_registries_and_removes_leftover_runs(
    registry: Registry, tmp_path: Path, request: pytest.FixtureRequest, cleanup: None
) -> None:
    other = Registry(str(tmp_path / "other" / "sandboxes.sqlite3"))
    name = sandbox_name(request)
    Sandbox(pol(), name=name, registry=other).start()
    api = backend.client().api
    spec = backend.build_spec(pol())
    leftover = api.create_container(
        image=IMAGE,
        command=["true"],
        labels=spec.labels("run"),
        host_config=api.create_host_config(**spec.host_config()),
    )["Id"]  # what a process killed between create and remove would leave
    try:
        api.start(leftover)
        api.wait(leftover)
        entries = {entry.record.name: entry for entry in list_sandboxes()}
        assert entries[name].registered is False and entries[name].state == "running"
        assert leftover not in backend.ended_runs(older_than=60.0)  # it just ended
        removed = dict(prune(idle=0, age=0, now=time.time() + 120))
        assert name not in removed
        assert removed[leftover[:12]] == "leftover one-shot container"
        assert leftover not in {c["Id"] for c in isolate_containers()}
    finally:
        backend.remove_container(leftover)
        backend.remove_container(backend.kept_container_name(name))


@engine
def test_nothing_left_behind(tmp_path: Path, cleanup: None) -> None:
    containers = {c["Id"] for c in isolate_containers()}
    volumes = volume_names()
    sh("echo hi > /tmp/x", pol())
    with pytest.raises(subprocess.TimeoutExpired):
        sh("sleep 30", pol(), timeout=0.5)
    with pytest.raises(CommandNotFoundError):
        backend.run(["no-such-program"], policy=pol(), stdin=subprocess.DEVNULL)
    sh("head -c 300m /dev/zero | tail", pol(limits=Limits(memory="64M")))
    assert {c["Id"] for c in isolate_containers()} == containers
    assert volume_names() == volumes


@pytest.mark.parametrize("kind", ["read", "write"])
def test_a_link_planted_in_a_grant_is_refused_as_natively(tmp_path: Path, kind: str) -> None:
    # A program that could write the workspace in an earlier run left
    # ws/data -> /elsewhere; a later grant of ws/data must not bind /elsewhere.
    elsewhere = tmp_path / "elsewhere"
    elsewhere.mkdir()
    ws = tmp_path / "ws"
    ws.mkdir()
    (ws / "data").symlink_to(elsewhere)
    policy = pol(**{kind: [str(ws / "data")]})
    with pytest.raises(PolicyError, match="goes through the symlink") as info:
        backend.build_spec(policy, cwd=ws)
    assert str(elsewhere) in str(info.value)


def test_a_grant_swapped_after_it_was_checked_is_refused(tmp_path: Path) -> None:
    # Between the policy's resolution and the container's creation the
    # directory is replaced by a link (or another directory): never bind it.
    data = shared_dir(tmp_path / "data", 0o755)
    spec = backend.build_spec(pol(read=[str(data)]), cwd=tmp_path)
    spec.host_config()  # unchanged: fine
    data.rename(tmp_path / "moved")
    (tmp_path / "elsewhere").mkdir()
    data.symlink_to(tmp_path / "elsewhere")
    with pytest.raises(PolicyError, match=r"symlink|changed since"):
        spec.host_config()
    data.unlink()
    data.mkdir()  # another directory at the same path: another inode
    with pytest.raises(PolicyError, match="changed since"):
        spec.host_config()


@engine
def test_run_refuses_a_planted_link_with_the_engine(tmp_path: Path, cleanup: None) -> None:
    secret = shared_dir(tmp_path / "secret", 0o755)
    (secret / "key").write_text("do not read")
    ws = shared_dir(tmp_path / "ws", 0o777)
    (ws / "data").symlink_to(secret)
    with pytest.raises(PolicyError, match="symlink"):
        sh("cat data/key", pol(read=[str(ws / "data")]), cwd=ws)


def test_tmpfs_sizes_reach_the_container(tmp_path: Path) -> None:
    pytest.importorskip("docker")
    spec = backend.build_spec(pol(tmpfs=["/tmp"]), cwd=tmp_path)
    config = spec.host_config()
    assert "size=1073741824" in config["tmpfs"]["/tmp"].split(",") and config["shm_size"] == 64 << 20
    spec = backend.build_spec(pol(tmpfs=["/tmp"], limits=Limits(tmpfs_size="8M")), cwd=tmp_path)
    config = spec.host_config()
    assert "size=8388608" in config["tmpfs"]["/tmp"].split(",") and config["shm_size"] == 8 << 20



def _as_regular_engine_user(code: str, home: Path) -> subprocess.CompletedProcess[str]:
    """code run as uid 65534 in the Docker socket's group (a regular user of the engine), by the system's
    Python with a copy of isolate and its dependencies (this test's own interpreter may live where 65534
    cannot go, e.g. under /root)."""
    import importlib

    site = home / "site"
    site.mkdir(parents=True)
    for name in ("isolate", "cffi", "_cffi_backend", "pycparser", "docker", "requests", "urllib3", "idna",
                 "certifi", "charset_normalizer", "psutil", "pyseccomp", "tomli_w"):
        where = Path(importlib.import_module(name).__file__ or "")
        if where.name == "__init__.py":
            shutil.copytree(where.parent, site / where.parent.name, ignore=shutil.ignore_patterns("__pycache__"))
        else:
            shutil.copy2(where, site / where.name)
    for path in [home, *home.rglob("*")]:
        path.chmod(0o755 if path.is_dir() or os.access(path, os.X_OK) else 0o644)
    os.chown(home, 65534, 65534)
    group = os.stat("/var/run/docker.sock").st_gid
    return subprocess.run(["setpriv", "--reuid=65534", "--regid=65534", f"--groups={group}", "env", "-i",
                           "PATH=/usr/bin:/bin", f"HOME={home}", f"PYTHONPATH={site}", "/usr/bin/python3", "-c", code],
                          cwd=home, capture_output=True, text=True, timeout=120)


def _system_python_matches() -> bool:
    try:
        out = subprocess.run(["/usr/bin/python3", "-c", "import sys; print(sys.version_info[:2])"],
                             capture_output=True, text=True, timeout=30).stdout.strip()
    except OSError:
        return False
    return out == str(sys.version_info[:2])


@engine
@pytest.mark.skipif(os.geteuid() != 0 or not shutil.which("setpriv"), reason="becomes a regular user of the engine")
def test_a_regular_users_host_network_container_never_gets_the_runtime_directory() -> None:
    # A regular user's runtime directory (without XDG_RUNTIME_DIR: /tmp/isolate-UID) holds its kept
    # sandboxes' sockets; a container on the host network with /tmp granted could connect() to them. The
    # grant is refused for such a caller (noticed, never tested as one before).
    if not _system_python_matches():
        pytest.skip("the system's python3 is another version than this test's (the C core is built for it)")
    code = textwrap.dedent(f"""
        import isolate
        base = dict(backend="docker", image={IMAGE!r}, network="host", write=())
        print(isolate.run(["echo", "ran"], policy=isolate.Policy(read=(), **base), capture_output=True,
                          text=True).stdout, end="")
        try:
            isolate.run(["true"], policy=isolate.Policy(read=("/tmp",), **base))
            print("granted")
        except isolate.PolicyError as exc:
            print("refused:", exc)
    """)
    import tempfile

    with tempfile.TemporaryDirectory(prefix="isolate-engine-user-") as top:  # pytest's own is root's, 0700
        os.chmod(top, 0o755)
        done = _as_regular_engine_user(code, Path(top) / "home")
    assert done.returncode == 0, done.stderr[-2000:]
    assert done.stdout.startswith("ran\n"), done.stdout
    assert "refused: read: /tmp holds isolate's runtime directory /tmp/isolate-65534" in done.stdout, done.stdout
