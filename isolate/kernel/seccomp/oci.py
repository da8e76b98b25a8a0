"""A Docker/OCI seccomp JSON profile parsed into rules: every key checked, every name resolved or
refused with its place, ``includes``/``excludes`` decided for this host.
"""

from __future__ import annotations

import errno as errno_mod
import json
import os
from dataclasses import dataclass
from typing import Any

from ...model.errors import PolicyError, UnsupportedError
from ...model.files import read_input_file
from .abi import (
    _ACTIONS,
    _ARCH_NAMES,
    _ARG_KEYS,
    _ENTRY_KEYS,
    _FILTER_KEYS,
    _FLAGS,
    _OPS,
    _SCMP_ARCHES,
    _TOP_KEYS,
    MAX_ERRNO,
    RET_ALLOW,
    RET_ERRNO,
    RET_KILL_PROCESS,
    RET_KILL_THREAD,
    RET_LOG,
    RET_TRACE,
    RET_TRAP,
)
from .binding import _guess_native_arch, _native_arch, _resolve

# --------------------------------------------------------------------------
# parsing a profile


@dataclass(frozen=True)
class _Cond:
    index: int
    op: int
    a: int
    b: int


@dataclass(frozen=True)
class _Rule:
    nr: int
    name: str
    action: int
    conds: tuple[_Cond, ...]
    place: str


@dataclass(frozen=True)
class _Parsed:
    default: int
    rules: tuple[_Rule, ...]


def _err(source: str, place: str, message: str) -> PolicyError:
    where = f"{source}: {place}: " if place else f"{source}: "
    return PolicyError(where + message, "seccomp")


def _int(value: object, source: str, place: str, low: int, high: int) -> int:
    if isinstance(value, bool) or not isinstance(value, int) or not low <= value <= high:
        raise _err(source, place, f"expected an integer from {low} to {high}, got {json.dumps(value)}")
    return value


def _str_list(value: object, source: str, place: str) -> list[str]:
    if value is None:
        return []
    if not isinstance(value, list) or not all(isinstance(item, str) for item in value):
        raise _err(source, place, "expected a list of strings")
    return value


def _check_keys(value: object, allowed: frozenset[str], source: str, place: str) -> dict[str, Any]:
    if not isinstance(value, dict):
        raise _err(source, place, f"expected an object, got {type(value).__name__}")
    for key in value:
        if key not in allowed:
            raise _err(source, place, f'unknown key "{key}"; known keys are {", ".join(sorted(allowed))}')
    return value


def _action(name: object, errno_ret: object, source: str, place: str, errno_place: str) -> int:
    if name not in _ACTIONS:
        raise _err(source, place, f"unknown action {json.dumps(name)}; known actions are {', '.join(_ACTIONS)}")
    if name == "SCMP_ACT_NOTIFY":
        raise UnsupportedError(
            f"{source}: {place}: SCMP_ACT_NOTIFY needs a listener process, which isolate does not provide; "
            "use SCMP_ACT_ERRNO (isolate reports denied calls itself)"
        )
    if errno_ret is not None and name not in ("SCMP_ACT_ERRNO", "SCMP_ACT_TRACE"):
        raise _err(source, errno_place, f"errnoRet goes with SCMP_ACT_ERRNO or SCMP_ACT_TRACE, not with {name}")
    data = errno_mod.EPERM if errno_ret is None else _int(errno_ret, source, errno_place, 0, MAX_ERRNO)
    if name == "SCMP_ACT_ERRNO":
        return RET_ERRNO | data
    if name == "SCMP_ACT_TRACE":
        return RET_TRACE | data
    return {
        "SCMP_ACT_KILL": RET_KILL_THREAD,
        "SCMP_ACT_KILL_THREAD": RET_KILL_THREAD,
        "SCMP_ACT_KILL_PROCESS": RET_KILL_PROCESS,
        "SCMP_ACT_TRAP": RET_TRAP,
        "SCMP_ACT_LOG": RET_LOG,
        "SCMP_ACT_ALLOW": RET_ALLOW,
    }[str(name)]


def _kernel_version() -> tuple[int, ...]:
    numbers = []
    for part in os.uname().release.split("-")[0].split("."):
        digits = "".join(ch for ch in part if ch.isdigit())
        if not digits:
            break
        numbers.append(int(digits))
    return tuple(numbers)


def _applies(entry: dict[str, Any], source: str, place: str, resolve: bool = True) -> bool:
    """Evaluate Docker's includes/excludes: no capabilities, the native arch, the running kernel."""
    native = _ARCH_NAMES.get(_native_arch() if resolve else _guess_native_arch(), ("", frozenset()))[1]
    applies = True
    for key in ("includes", "excludes"):
        if key not in entry:
            continue
        where = f"{place}.{key}"
        spec = _check_keys(entry[key], _FILTER_KEYS, source, where)
        caps = _str_list(spec.get("caps"), source, f"{where}.caps")
        arches = _str_list(spec.get("arches"), source, f"{where}.arches")
        min_kernel = spec.get("minKernel")
        if min_kernel is not None and key == "excludes":
            raise _err(source, f"{where}.minKernel", "minKernel is only meaningful in includes")
        if key == "includes":
            if caps or (arches and not native & set(arches)):
                applies = False
            if min_kernel is not None:
                parts = min_kernel.split(".") if isinstance(min_kernel, str) else []
                if not parts or len(parts) > 3 or not all(part.isdigit() for part in parts):
                    raise _err(
                        source, f"{where}.minKernel", f'expected a version such as "4.8", got {json.dumps(min_kernel)}'
                    )
                if _kernel_version() < tuple(int(part) for part in parts):
                    applies = False
        elif native & set(arches):
            applies = False
    return applies


def _parse(data: object, source: str, resolve: bool = True) -> _Parsed:
    """Validate a Docker/OCI profile and turn it into rules for the native architecture.

    With ``resolve=False`` (no libseccomp here) only the shape is checked and no rule is returned.
    """
    top = _check_keys(data, _TOP_KEYS, source, "")
    if "defaultAction" not in top:
        raise _err(source, "", "defaultAction is missing (for example \"SCMP_ACT_ERRNO\")")
    default = _action(top["defaultAction"], top.get("defaultErrnoRet"), source, "defaultAction", "defaultErrnoRet")
    for i, arch in enumerate(_str_list(top.get("architectures"), source, "architectures")):
        if arch not in _SCMP_ARCHES:
            raise _err(source, f"architectures[{i}]", f"unknown architecture {json.dumps(arch)}")
    arch_map = top.get("archMap") or []
    if not isinstance(arch_map, list):
        raise _err(source, "archMap", "expected a list")
    for i, item in enumerate(arch_map):
        item = _check_keys(item, frozenset({"architecture", "subArchitectures"}), source, f"archMap[{i}]")
        arches: list[object] = [item.get("architecture")]
        arches += _str_list(item.get("subArchitectures"), source, f"archMap[{i}]")
        for mapped in arches:
            if mapped not in _SCMP_ARCHES:
                raise _err(source, f"archMap[{i}]", f"unknown architecture {json.dumps(mapped)}")
    for i, flag in enumerate(_str_list(top.get("flags"), source, "flags")):
        if flag not in _FLAGS:
            raise _err(source, f"flags[{i}]", f"unknown flag {json.dumps(flag)}")
    if top.get("listenerPath"):
        raise UnsupportedError(
            f"{source}: listenerPath: isolate does not forward seccomp notifications to another agent; "
            "remove listenerPath and SCMP_ACT_NOTIFY"
        )
    entries = top.get("syscalls") or []
    if not isinstance(entries, list):
        raise _err(source, "syscalls", "expected a list")

    rules: list[_Rule] = []
    for i, raw in enumerate(entries):
        place = f"syscalls[{i}]"
        entry = _check_keys(raw, _ENTRY_KEYS, source, place)
        if "action" not in entry:
            raise _err(source, place, "action is missing")
        action = _action(entry["action"], entry.get("errnoRet"), source, f"{place}.action", f"{place}.errnoRet")
        if "names" in entry and "name" in entry:
            raise _err(source, place, "give names or name, not both")
        names: list[str]
        if "name" in entry:
            single = entry["name"]
            if not isinstance(single, str):
                raise _err(source, f"{place}.name", "expected a string")
            names, places = [single], [f"{place}.name"]
        else:
            names = _str_list(entry.get("names"), source, f"{place}.names")
            places = [f"{place}.names[{j}]" for j in range(len(names))]
        if not names:
            raise _err(source, place, "names is missing or empty")
        conds = _parse_args(entry.get("args"), source, f"{place}.args")
        if not _applies(entry, source, place, resolve) or not resolve:
            continue
        for name, where in zip(names, places, strict=True):
            nr = _resolve(name)
            if nr == -1:
                raise _err(source, where, f'unknown system call "{name}"')
            if nr < 0:
                continue  # known, but not a system call of this architecture
            rules.append(_Rule(nr, name, action, conds, where))
    return _Parsed(default, _normalise(rules, default, source))


def _parse_args(raw: object, source: str, place: str) -> tuple[_Cond, ...]:
    if raw is None:
        return ()
    if not isinstance(raw, list):
        raise _err(source, place, "expected a list")
    if len(raw) > 6:
        raise _err(source, place, "a system call has at most 6 arguments")
    conds: list[_Cond] = []
    seen: dict[int, int] = {}
    for k, item in enumerate(raw):
        where = f"{place}[{k}]"
        arg = _check_keys(item, _ARG_KEYS, source, where)
        for key in ("index", "value", "op"):
            if key not in arg:
                raise _err(source, where, f"{key} is missing")
        index = _int(arg["index"], source, f"{where}.index", 0, 5)
        value = _int(arg["value"], source, f"{where}.value", 0, 2**64 - 1)
        value_two = _int(arg.get("valueTwo", 0), source, f"{where}.valueTwo", 0, 2**64 - 1)
        op = arg["op"]
        if op not in _OPS:
            known = ", ".join(_OPS)
            raise _err(source, f"{where}.op", f"unknown operator {json.dumps(op)}; known operators are {known}")
        if index in seen:
            raise _err(
                source, where,
                f"a second condition on argument {index} (first in {place}[{seen[index]}]): libseccomp cannot "
                "combine them in one rule; write one entry per condition (conditions of separate entries are ORed)",
            )
        seen[index] = k
        conds.append(_Cond(index, _OPS[str(op)], value, value_two))
    return tuple(conds)


def _normalise(rules: list[_Rule], default: int, source: str) -> tuple[_Rule, ...]:
    """Apply libseccomp's combination rules explicitly, refusing the cases where it would drop a rule."""
    # A rule whose action is the default action changes nothing (libseccomp refuses it, runc skips it).
    rules = [rule for rule in rules if rule.action != default]
    unconditional: dict[int, _Rule] = {}
    for rule in rules:
        if not rule.conds:
            first = unconditional.setdefault(rule.nr, rule)
            if first.action != rule.action:
                raise _err(source, rule.place, f"{rule.name} already has another action at {first.place}; "
                           "a system call can have only one unconditional action")
    out: list[_Rule] = []
    by_conds: dict[tuple[int, tuple[_Cond, ...]], _Rule] = {}
    for rule in rules:
        uncond = unconditional.get(rule.nr)
        if uncond is not None:
            if rule.conds and rule.action != uncond.action:
                raise _err(source, rule.place, f"this conditional rule for {rule.name} would never apply: "
                           f"{uncond.place} decides every {rule.name} call")
            if rule is not uncond:
                continue
        else:
            same = by_conds.setdefault((rule.nr, rule.conds), rule)
            if same is not rule:
                if same.action != rule.action:
                    raise _err(source, rule.place, f"{rule.name} has the same conditions with another action "
                               f"at {same.place}")
                continue
        out.append(rule)
    return tuple(out)


def _read_profile_file(path: str) -> tuple[str, bytes]:
    try:
        content = read_input_file(path)
    except OSError as exc:
        raise PolicyError(
            f"seccomp: cannot read the profile {path!r}: {exc.strerror}; give default, strict, none or a JSON file",
            "seccomp",
        ) from None
    except ValueError as exc:
        raise PolicyError(f"seccomp: {exc}; not a seccomp profile", "seccomp") from None
    return path, content


def _load_json(content: bytes, source: str) -> object:
    try:
        return json.loads(content.decode("utf-8"))
    except UnicodeDecodeError:
        raise PolicyError(f"{source}: not UTF-8 text; a seccomp profile is JSON", "seccomp") from None
    except json.JSONDecodeError as exc:
        raise PolicyError(
            f"{source}: not valid JSON: {exc.msg} at line {exc.lineno}, column {exc.colno}", "seccomp"
        ) from None
    except RecursionError:  # json descends once per nested array or object
        raise PolicyError(f"{source}: nested deeper than a seccomp profile is", "seccomp") from None
