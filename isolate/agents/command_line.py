"""``wrap``: the ``isolate-run`` command line that runs argv under a policy."""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Sequence
from typing import Any

from ..model.errors import PolicyError
from ..model.policy import DEFAULT_HOME, DEFAULT_KEEP_ENV, DEFAULT_READ, DEFAULT_TMPFS, DEFAULT_WRITE, Egress, Policy

# -- wrap: the isolate-run command line of a policy ----------------------------------------------------------

_LIMIT_FLAGS = (("memory", "--memory"), ("cpu_seconds", "--cpu"), ("cpus", "--cpus"), ("wall_seconds", "--wall"),
                ("pids", "--pids"), ("open_files", "--nofile"), ("file_size", "--fsize"),
                ("tmpfs_size", "--tmpfs-size"))


def _number(value: float) -> str:
    if isinstance(value, int) or (float(value).is_integer() and abs(value) < 1e15):
        return str(int(value))  # --wall=60, not --wall=60.0 (read back as the same number)
    return repr(float(value))


def wrap(argv: Sequence[str], policy: Policy | None = None, *,
         program: Sequence[str] = ("isolate-run",)) -> list[str]:
    """The ``isolate-run`` command line that runs argv under policy.

    Every field is written as its flag (``--flag=value``, so a value may
    start with '-'), and the flags are read back with isolate-run's own
    parser: a field that no flag can express (``new_session=False``,
    ``die_with_parent=False``, a default ``keep_env`` or ``tmpfs`` entry
    dropped, an empty ``Egress``, a bind whose path holds ':', a read-only
    bind over a writable one, which isolate-run would mount in the other order) raises
    ``PolicyError`` naming it, never dropped. Relative paths stay relative:
    run the line in the directory the policy is meant for. ``program`` is
    the command that is isolate-run (e.g. ``[sys.executable, "-m", "isolate.cli"]``).
    """
    policy = policy if policy is not None else Policy()
    if not isinstance(policy, Policy):
        raise TypeError("policy must be an isolate.Policy")
    if isinstance(argv, (str, bytes)):
        raise TypeError("argv must be a list of arguments, not one string")
    command = [os.fsdecode(a) for a in argv]
    if not command:
        raise PolicyError("command: nothing to run; give a command", "command")
    flags = _flags(policy)
    _check_round_trip(policy, flags)
    return [*program, *flags, "--", *command]


def _flags(policy: Policy) -> list[str]:
    default = Policy()
    for name in ("new_session", "die_with_parent"):
        if getattr(policy, name) != getattr(default, name):
            raise PolicyError(f"{name}={getattr(policy, name)!r}: isolate-run has no flag for it; run the command "
                              "with isolate.run or a Sandbox instead", name)
    flags: list[str] = []
    if policy.read != DEFAULT_READ or policy.write != DEFAULT_WRITE:
        flags.append("--no-defaults")
        flags += [f"--ro={p}" for p in policy.read]
        flags += [f"--rw={p}" for p in policy.write]
    flags += [f"--tmpfs={p}" for p in policy.tmpfs if p not in DEFAULT_TMPFS]
    if isinstance(policy.network, Egress):
        flags += [f"--allow-host={h}" for h in policy.network.hosts]
        flags += [f"--add-host={h}" for h in policy.network.add_hosts]
        if policy.network.resolver:
            flags.append(f"--dns={policy.network.resolver}")
        if policy.network.allow_private:
            flags.append("--allow-private")
    elif policy.network != "none":
        flags.append(f"--net={policy.network}")
    flags += [f"--unix-socket={p}" for p in policy.unix_sockets]
    for name, flag in _LIMIT_FLAGS:
        value = policy.limits.value(name)
        if value is not None:
            flags.append(f"{flag}={_number(value)}")
    if policy.seccomp != "default":
        flags.append(f"--seccomp={policy.seccomp}")
    flags += [f"--env={k}={v}" for k, v in policy.env.items()]
    flags += [f"--keep-env={n}" for n in policy.keep_env if n not in DEFAULT_KEEP_ENV]
    if policy.home != DEFAULT_HOME:
        flags.append(f"--home={policy.home if policy.home is not None else 'none'}")
    flags += [f"--home-file={f}" for f in policy.home_files]
    if policy.cwd is not None:
        flags.append(f"--chdir={policy.cwd}")
    for name in ("uid", "gid"):
        if getattr(policy, name) is not None:
            flags.append(f"--{name}={getattr(policy, name)}")
    if not policy.namespaces:
        flags.append("--no-namespaces")
    if policy.best_effort:
        flags.append("--best-effort")
    if policy.trace_denials == "lookups":
        raise PolicyError("trace_denials='lookups': isolate-run has no flag for it (isolate-run learn uses it); "
                          "use trace_denials=True (--why)", "trace_denials")
    if policy.trace_denials:
        flags.append("--why")
    if policy.backend != "auto":
        flags.append(f"--backend={policy.backend}")
    if policy.image is not None:
        flags.append(f"--image={policy.image}")
    # isolate-run orders its --bind mounts before its --ro-bind ones (_comparable says when that matters).
    flags += [f"--bind={m.source}:{m.target}" for m in policy.binds if m.mode == "rw"]
    flags += [f"--ro-bind={m.source}:{m.target}" for m in policy.binds if m.mode == "ro"]
    return flags


def _comparable(policy: Policy) -> dict[str, Any]:
    """The fields, with what isolate-run resolves at once (bind sources, the cwd) resolved alike on both sides."""
    out = {f.name: getattr(policy, f.name) for f in dataclasses.fields(policy)}
    binds = [(os.path.abspath(os.path.expanduser(m.source)), m.target, m.mode) for m in policy.binds]
    targets = [b[1] for b in binds]
    if not any(t != u and t.startswith(u.rstrip("/") + "/") for t in targets for u in targets):
        binds.sort(key=lambda b: b[1])  # no mount lies under another: their order changes nothing
    out["binds"] = tuple(binds)
    out["cwd"] = os.path.abspath(policy.cwd) if policy.cwd is not None else None
    return out


def _check_round_trip(policy: Policy, flags: list[str]) -> None:
    from ..cli.flags import CliError, build_parser, policy_from_args

    try:
        back = policy_from_args(build_parser().parse_args([*flags, "--", "true"]))
    except (CliError, PolicyError) as exc:
        field_name = getattr(exc, "field", None) or "policy"
        raise PolicyError(f"{field_name}: isolate-run cannot express this policy ({exc})", field_name) from None
    want, got = _comparable(policy), _comparable(back)
    for name, value in want.items():
        if got[name] != value:
            raise PolicyError(f"{name}: isolate-run has no flag that gives {value!r} (its flags give {got[name]!r}); "
                              "run the command with isolate.run or a Sandbox instead", name)
