"""The policy model and its parsers: pure data, no kernel."""

from __future__ import annotations

import dataclasses
import os

import pytest

from isolate import Egress, Limits, Policy, PolicyError
from isolate.model.units import format_size, parse_seconds, parse_size


@pytest.mark.parametrize(
    ("text", "expected"),
    [("512", 512), ("1K", 1024), ("64M", 64 << 20), ("1.5G", 3 << 29), ("2g", 2 << 30), ("10MiB", 10 << 20),
     ("3kb", 3072), ("1T", 1 << 40), (4096, 4096)],
)
def test_sizes(text: object, expected: int) -> None:
    assert parse_size(text, "x") == expected


@pytest.mark.parametrize("text", ["", "-1M", "12Q", "M", "1.2.3", "ib", "0", True, None, [1]])
def test_bad_sizes_name_the_field(text: object) -> None:
    with pytest.raises(PolicyError) as info:
        parse_size(text, "limits.memory")
    assert info.value.field == "limits.memory"
    assert "limits.memory" in str(info.value)


def test_seconds() -> None:
    assert parse_seconds("0.5", "t") == 0.5
    assert parse_seconds(2, "t") == 2.0
    for bad in ("-1", "abc", "0", "inf", "nan"):
        with pytest.raises(PolicyError):
            parse_seconds(bad, "t")


def test_format_size_round_trip() -> None:
    for size in (1, 1024, 64 << 20, 3 << 29, 12345):
        assert parse_size(format_size(size), "x") == size


def test_limits_normalised() -> None:
    limits = Limits(memory="64M", cpu_seconds="1.5", pids="16", file_size="1K")
    assert limits.memory == 64 << 20
    assert limits.cpu_seconds == 1.5
    assert limits.pids == 16
    assert limits.file_size == 1024


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"read": ["/does/not/exist"]}, "read"),
        ({"write": ["/does/not/exist"]}, "write"),
        ({"tmpfs": ["relative"]}, "tmpfs"),
        ({"tmpfs": ["/proc"]}, "tmpfs"),
        ({"network": "wifi"}, "network"),
        ({"seccomp": "/no/such/profile.json"}, "seccomp"),
        ({"limits": {"memory": "-5M"}}, "limits.memory"),
        ({"limits": {"wall_seconds": 0}}, "limits.wall_seconds"),
        ({"limits": {"bogus": 1}}, "limits.bogus"),
        ({"uid": 0}, "uid"),
        ({"uid": -3}, "uid"),
        ({"backend": "vm"}, "backend"),
        ({"env": {"A=B": "x"}}, "env"),
        ({"read": ["/usr"], "write": ["/usr"]}, "write"),
        ({"cwd": "relative/dir"}, "cwd"),
    ],
)
def test_bad_policies_name_the_field(changes: dict[str, object], field: str) -> None:
    with pytest.raises(PolicyError) as info:
        Policy(**changes)  # type: ignore[arg-type]
    assert info.value.field == field


def test_unknown_field_in_profile() -> None:
    with pytest.raises(PolicyError) as info:
        Policy.from_toml('reed = ["/usr"]\n')
    assert info.value.field == "reed"
    assert "unknown field" in str(info.value)


def test_bad_toml_names_the_file() -> None:
    with pytest.raises(PolicyError, match=r"prof\.toml"):
        Policy.from_toml("read = [", "prof.toml")


def test_toml_round_trip(tmp_path: object) -> None:
    original = Policy(
        read=["/usr", "/etc"], write=["/tmp"], tmpfs=["/var/tmp"], network="loopback",
        limits=Limits(memory="256M", cpu_seconds=5, wall_seconds=10, pids=64, open_files=256, file_size="64M"),
        seccomp="strict", env={"A": "1"}, keep_env=["PATH"],
    )
    path = os.path.join(str(tmp_path), "p.toml")
    original.save(path)
    loaded = Policy.load(path)
    assert loaded == original
    assert loaded.config_hash() == original.config_hash()


def test_egress_round_trip() -> None:
    policy = Policy(network=Egress(("example.org:443",)))
    assert Policy.from_toml(policy.to_toml()).network == Egress(("example.org:443",))
    with pytest.raises(PolicyError):
        Egress(("host:99999",))


def test_policy_is_frozen_and_hashable() -> None:
    policy = Policy(env={"A": "1"})
    with pytest.raises(dataclasses.FrozenInstanceError):
        policy.read = ()  # type: ignore[misc]
    with pytest.raises(TypeError):
        policy.env["B"] = "2"  # type: ignore[index]
    assert hash(policy) == hash(Policy(env={"A": "1"}))


def test_config_hash_changes_with_policy() -> None:
    assert Policy().config_hash() != Policy(network="loopback").config_hash()


@pytest.mark.parametrize(
    ("limits", "field"),
    [({"cpus": 0.001}, "limits.cpus"), ({"cpus": "0.000000001"}, "limits.cpus"),
     ({"wall_seconds": 1e300}, "limits.wall_seconds"), ({"cpu_seconds": "1e20"}, "limits.cpu_seconds"),
     ({"memory": "1e30G"}, "limits.memory"), ({"file_size": 2**64}, "limits.file_size"),
     ({"pids": 2**40}, "limits.pids"), ({"open_files": str(2**63)}, "limits.open_files"),
     ({"memory": float("nan")}, "limits.memory"), ({"wall_seconds": float("inf")}, "limits.wall_seconds")],
)
def test_limits_that_would_wrap_or_truncate_to_off_are_refused(limits: dict[str, object], field: str) -> None:
    # 0 or a wrapped value means "no limit" somewhere on the way to the kernel
    # (NanoCpus 0, a CFS quota under the kernel's minimum, an overflowing
    # 64-bit count): such a limit is refused, never silently weakened.
    with pytest.raises(PolicyError) as info:
        Limits(**limits)  # type: ignore[arg-type]
    assert info.value.field == field


@pytest.mark.parametrize(
    ("limits", "field"),
    [({"memory": "0.5"}, "limits.memory"), ({"memory": "1023K"}, "limits.memory"),
     ({"tmpfs_size": 1}, "limits.tmpfs_size"), ({"open_files": 15}, "limits.open_files"),
     ({"wall_seconds": 0.009}, "limits.wall_seconds"), ({"cpu_seconds": "1e-6"}, "limits.cpu_seconds"),
     ({"pids": 0}, "limits.pids"), ({"file_size": 0}, "limits.file_size"), ({"wall_seconds": 0}, "limits.wall_seconds"),
     ({"memory": -1}, "limits.memory"), ({"cpu_seconds": float("nan")}, "limits.cpu_seconds")],
)
def test_limits_below_their_floor_are_refused(limits: dict[str, object], field: str) -> None:
    # Below these nothing can run: such a limit would start the program only to kill it at once,
    # which reads like the program's own failure. The floors are the least that runs `true`.
    with pytest.raises(PolicyError) as info:
        Limits(**limits)  # type: ignore[arg-type]
    assert info.value.field == field
    floors = Limits(memory="1M", tmpfs_size="4K", open_files=16, wall_seconds=0.01, cpu_seconds=0.01, pids=1)
    assert floors.memory == 1 << 20 and floors.open_files == 16


def test_fractions_round_up_never_to_nothing() -> None:
    from isolate.model.units import milliseconds_up

    assert parse_size("0.5", "x") == 1
    assert milliseconds_up(0.0004) == 1 and milliseconds_up(1e-12) == 1 and milliseconds_up(1.0001) == 1001
    assert Limits(cpus=0.01).cpus == 0.01


def test_egress_grammar() -> None:
    egress = Egress(("PyPI.org.", "*.github.com:443", "db.test:5432"), add_hosts={"db.test": "127.0.0.1"},
                    resolver="[::1]:5353", allow_private=True)
    assert egress.hosts == ("pypi.org", "*.github.com:443", "db.test:5432")
    rules = egress.rules()
    assert rules.ports_of("pypi.org") == {80, 443}  # no port: the web's two
    assert rules.ports_of("api.github.com") == {443} and rules.ports_of("a.b.github.com") == {443}
    assert not rules.ports_of("github.com")  # *.DOMAIN is the names below it
    assert rules.static_address("db.test") == "127.0.0.1" and rules.resolver == ("::1", 5353)
    assert set(rules.ports) == {53, 80, 443, 3128, 5432}
    assert Policy.from_toml(Policy(network=egress).to_toml()).network == egress
    for hosts, kwargs, needle in (
        (("1.2.3.4",), {}, "--add-host"),                      # an address is not a name
        (("[::1]:80",), {}, "--add-host"),
        (("*.com",), {}, "top-level"),
        (("a.test:0",), {}, "port"),
        (("a.test:http",), {}, "port"),
        (("bad name",), {}, "host name"),
        (("a.test",), {"add_hosts": ("b.test:127.0.0.1",)}, "not allowed"),
        (("a.test",), {"add_hosts": ("a.test:nowhere",)}, "not an IP"),
        (("a.test",), {"resolver": "8.8.8.8:99999"}, "port"),
        (("a.test",), {"allow_private": "yes"}, "true or false"),
        (tuple(f"a.test:{p}" for p in range(1000, 1070)), {}, "ports"),
    ):
        with pytest.raises(PolicyError, match=needle):
            Egress(hosts, **kwargs)


@pytest.mark.parametrize(
    ("changes", "field"),
    [
        ({"tmpfs": ["//"]}, "tmpfs"),
        ({"tmpfs": ["/proc/"]}, "tmpfs"),
        ({"tmpfs": ["/dev/."]}, "tmpfs"),
        ({"tmpfs": ["//dev/shm"]}, "tmpfs"),
        ({"binds": ["/tmp://proc"]}, "binds"),
        ({"binds": ["/tmp:/tmp/../dev"]}, "binds"),
        ({"home": "//dev"}, "home"),
        ({"home": "///"}, "home"),
    ],
)
def test_inside_paths_are_checked_in_their_canonical_form(changes: dict[str, object], field: str) -> None:
    # os.path.normpath keeps a leading "//": "//proc" passed the checks against /proc, and "//" made
    # the mount planner recurse for ever.
    with pytest.raises(PolicyError) as info:
        Policy(**changes)  # type: ignore[arg-type]
    assert info.value.field == field


def test_inside_paths_are_kept_canonical() -> None:
    from isolate.model.workspace import Workspace

    policy = Policy(tmpfs=["/tmp/", "//var//tmp", "/tmp"], home="//home/./me/", cwd="//work/../work",
                    binds=["/tmp://mnt/x/"])
    assert policy.tmpfs == ("/tmp", "/var/tmp")
    assert (policy.home, policy.cwd, policy.binds[0].target) == ("/home/me", "/work", "/mnt/x")
    assert Workspace(target="//ws/").target == "/ws"
    with pytest.raises(PolicyError):
        Workspace(target="//proc")


def test_a_deep_inside_path_is_planned_without_recursion() -> None:
    from isolate.kernel.mounts import plan_root

    deep = "/d" * 1500   # within PATH_MAX; ensure_dir recursed once per component
    steps = plan_root([], [], [deep], "mode=1777").steps
    assert steps[-1 - next(i for i, s in enumerate(reversed(steps)) if s.target == deep)].target == deep


@pytest.mark.parametrize("text", ["\u00b2\u00b2\u00b2", "\u0661\u0662\u0668", "1_000", "+5", "\uff15", "9" * 5000,
                                  "12\u3000"])
def test_numbers_are_ascii_digits_only(text: str) -> None:
    # str.isdigit took superscripts (then int() raised ValueError) and other scripts' digits (taken as numbers).
    for field, value in (("pids", text), ("open_files", text), ("wall_seconds", text), ("cpus", text),
                         ("memory", text + "M")):
        with pytest.raises(PolicyError) as info:
            Limits(**{field: value})
        assert info.value.field == f"limits.{field}"


def test_limits_within_what_the_kernel_takes() -> None:
    assert Limits(pids=" 64 ", cpus="2e0", wall_seconds="5s").pids == 64
    assert Limits(pids=4 * 1024 * 1024).pids == 4 * 1024 * 1024
    for field, value in (("pids", 4 * 1024 * 1024 + 1), ("pids", 2**31 - 1), ("cpus", 1e9), ("cpus", "8193")):
        with pytest.raises(PolicyError, match="too large"):
            Limits(**{field: value})


def test_a_profile_nested_past_the_recursion_limit_is_a_policy_error() -> None:
    with pytest.raises(PolicyError, match="nested deeper"):
        Policy.from_toml("read = " + "[" * 5000 + "]" * 5000 + "\n")


def test_a_name_is_ascii_before_it_is_lowered() -> None:
    # "\u212a" (KELVIN SIGN) lowers to ASCII "k": the name given is not the name allowed.
    for name in ("\u212aelvin.example", "\u3000pypi.org", "pypi.org:\u0664\u0664\u0663"):
        with pytest.raises(PolicyError):
            Egress([name])


@pytest.mark.parametrize("data", [[["read", "/usr"]], "read", 5, None, [("a", 1), ("b", 2)]])
def test_from_dict_of_what_is_no_table_is_a_policy_error(data: object) -> None:
    # A list of pairs became a dict (and an unknown field), a string a ValueError, a number a TypeError.
    with pytest.raises(PolicyError, match="a policy is a table of fields"):
        Policy.from_dict(data)  # type: ignore[arg-type]
