"""The policy model: what a sandbox may do, as frozen, validated dataclasses.

A ``Policy`` is pure data. Building one validates every field and raises
``PolicyError`` naming the field at fault; nothing touches the kernel until a
backend prepares the policy for a run.
"""

from __future__ import annotations

import dataclasses
import hashlib
import json
import os
import sys
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from . import egress_rules
from .errors import PolicyError
from .files import read_input_file
from .paths import inside_path, mount_point
from .units import format_size, parse_count, parse_seconds, parse_size

#: Read-only system paths granted unless ``--no-defaults`` (missing ones are skipped).
DEFAULT_READ: tuple[str, ...] = ("/usr", "/bin", "/sbin", "/lib", "/lib64", "/etc")
#: Writable by default: the working directory of the run.
DEFAULT_WRITE: tuple[str, ...] = (".",)
#: Fresh private tmpfs mounts by default: /tmp, and /var/tmp (programs and test suites expect /var and a
#: writable /var/tmp; nothing else of the host's /var is shown unless granted).
DEFAULT_TMPFS: tuple[str, ...] = ("/tmp", "/var/tmp")
#: Sizes of the private tmpfs mounts when neither limits.tmpfs_size nor limits.memory is set.
DEFAULT_TMPFS_SIZE = 1 << 30
DEFAULT_SHM_SIZE = 64 << 20
#: The program's home: a private, writable, empty directory, and HOME points at it.
DEFAULT_HOME = "/home/sandbox"
#: The variables passed through from the caller by default (SPEC: a minimal environment).
DEFAULT_KEEP_ENV: tuple[str, ...] = ("PATH", "HOME", "LANG", "TERM")

NETWORK_MODES = ("none", "loopback", "host")
SECCOMP_MODES = ("default", "strict", "none")
BACKENDS = ("auto", "native", "docker")


@dataclass(frozen=True)
class Egress:
    """A filtered network: only the allowed names and ports are reachable.

    ``hosts``: ``NAME``, ``NAME:PORT``, ``*.DOMAIN[:PORT]`` (no port: 80 and
    443). ``add_hosts``: static names, ``{NAME: IP}`` or ``("NAME:IP", ...)``
    (Docker's ``--add-host``); such a name is reached at that address, loopback
    included, once the allow-list allows it. ``resolver``: ``IP[:PORT]`` of the
    DNS server isolate asks (default: the host's own resolver).
    ``allow_private``: let a name that DNS resolves to a loopback, private or
    link-local address be reached (off: the DNS-rebinding guard refuses it).
    """

    hosts: tuple[str, ...] = ()
    add_hosts: Mapping[str, str] | tuple[str, ...] = ()
    resolver: str | None = None
    allow_private: bool = False

    def __post_init__(self) -> None:
        hosts = _str_tuple(self.hosts, "network")
        if len(hosts) > egress_rules.MAX_ENTRIES:
            raise PolicyError(f"network: {len(hosts)} allow-list entries; at most {egress_rules.MAX_ENTRIES}",
                              "network")
        rules = tuple(egress_rules.parse_host_rule(host) for host in hosts)
        ports = {port for rule in rules for port in rule.ports}
        if len(ports) > egress_rules.MAX_PORTS:
            raise PolicyError(f"network: the allow-list names {len(ports)} ports; at most "
                              f"{egress_rules.MAX_PORTS} (each is a listener inside)", "network")
        static = self.add_hosts
        pairs = ([f"{k}:{v}" for k, v in static.items()] if isinstance(static, Mapping)
                 else list(_str_tuple(static, "add_hosts")))
        if len(pairs) > egress_rules.MAX_ENTRIES:
            raise PolicyError(f"add_hosts: {len(pairs)} names; at most {egress_rules.MAX_ENTRIES}", "add_hosts")
        add_hosts = tuple(sorted({f"{n}:{a}" for n, a in map(egress_rules.parse_static_host, pairs)}))
        for entry in add_hosts:
            name = entry.partition(":")[0]
            if not any(rule.matches(name) for rule in rules):
                raise PolicyError(f"add_hosts: {name!r} is named but not allowed; allow it too "
                                  f"(--allow-host {name}:PORT)", "add_hosts")
        if self.resolver is not None:
            if not isinstance(self.resolver, str):
                raise PolicyError("network: resolver must be a string IP[:PORT]", "network")
            egress_rules.parse_resolver(self.resolver)
        if not isinstance(self.allow_private, bool):
            raise PolicyError("network: allow_private must be true or false", "network")
        object.__setattr__(self, "hosts", tuple(str(rule) for rule in rules))
        object.__setattr__(self, "add_hosts", add_hosts)

    def rules(self) -> egress_rules.EgressRules:
        """The allow-list compiled for the mediator."""
        return egress_rules.EgressRules(
            rules=tuple(egress_rules.parse_host_rule(host) for host in self.hosts),
            static_hosts=tuple(egress_rules.parse_static_host(entry) for entry in self.add_hosts),
            resolver=egress_rules.parse_resolver(self.resolver) if self.resolver else None,
            allow_private=self.allow_private,
        )

    def to_dict(self) -> dict[str, Any]:
        out: dict[str, Any] = {"egress": list(self.hosts)}
        if self.add_hosts:
            out["add_hosts"] = list(self.add_hosts)
        if self.resolver:
            out["resolver"] = self.resolver
        if self.allow_private:
            out["allow_private"] = True
        return out


#: The floors of the limits (see Limits.__post_init__).
MIN_MEMORY = 1024 * 1024
MIN_TMPFS_SIZE = 4096
MIN_LIMIT_SECONDS = 0.01
MIN_OPEN_FILES = 16
#: The ceilings the kernel itself has, so that a value past them is refused here, naming it, rather
#: than by a cgroup file as an error of the cgroups: pids.max takes at most PID_MAX_LIMIT (4M on
#: 64-bit); Linux is built for at most 8192 CPUs (NR_CPUS), and more bandwidth than CPUs is no limit.
MAX_PIDS = 4 * 1024 * 1024
MAX_CPUS = 8192


@dataclass(frozen=True)
class Limits:
    """Resource limits. Sizes take K/M/G/T suffixes, times are seconds.

    ``memory``, ``pids`` and ``cpu_seconds`` cover the whole process tree where
    a cgroup can enforce them; ``open_files`` and ``file_size`` are per-process
    rlimits by nature.
    """

    memory: int | str | None = None
    cpu_seconds: float | str | None = None
    wall_seconds: float | str | None = None
    pids: int | str | None = None
    open_files: int | str | None = None
    file_size: int | str | None = None
    cpus: float | str | None = None
    #: The size of each private tmpfs (/tmp, tmpfs=, the home, /dev/shm); see tmpfs_sizes().
    tmpfs_size: int | str | None = None

    def __post_init__(self) -> None:
        # Each limit has a floor below which nothing could run, so that bad input is refused before
        # anything starts instead of killing the program at once and looking like its own failure.
        parsers: dict[str, Callable[[object, str], object]] = {
            "memory": lambda v, f: parse_size(v, f, MIN_MEMORY, ": the dynamic loader and the C library alone "
                                              "take more, and so does the sandbox's setup"),
            "file_size": parse_size,
            "tmpfs_size": lambda v, f: parse_size(v, f, MIN_TMPFS_SIZE, ": one page"),
            "cpu_seconds": lambda v, f: parse_seconds(v, f, MIN_LIMIT_SECONDS, ": the watchdog's poll"),
            "wall_seconds": lambda v, f: parse_seconds(v, f, MIN_LIMIT_SECONDS, ": less is gone before the "
                                                       "program has started"),
            "cpus": lambda v, f: parse_seconds(v, f, maximum=MAX_CPUS, why_max=" CPUs, the most a Linux kernel "
                                               "is built for"),
            "pids": lambda v, f: parse_count(v, f, maximum=MAX_PIDS, why_max=", the kernel's PID_MAX_LIMIT"),
            "open_files": lambda v, f: parse_count(v, f, MIN_OPEN_FILES, ": the standard streams and the "
                                                   "sandbox's own descriptors while it starts"),
        }
        for name, parse in parsers.items():
            value = getattr(self, name)
            if value is not None:
                object.__setattr__(self, name, parse(value, f"limits.{name}"))
        # CFS bandwidth below 1/100 of a CPU is refused by the kernel (a quota
        # under 1 ms per 100 ms period) and read as "no limit" by Docker
        # (NanoCpus truncated to 0): refuse it rather than round it either way.
        if self.cpus is not None and float(self.cpus) < 0.01:
            raise PolicyError(f"limits.cpus: at least 0.01 CPU, got {self.cpus!r}", "limits.cpus")

    def tmpfs_sizes(self) -> tuple[int, int]:
        """Bytes of each private tmpfs and of /dev/shm.

        A tmpfs holds its pages in memory (unswappable without swap) until the
        run ends, so none is unbounded: ``tmpfs_size`` when given, else the
        memory limit (the pages are charged to the run's cgroup anyway), else
        DEFAULT_TMPFS_SIZE for /tmp and the like and DEFAULT_SHM_SIZE (Docker's
        default) for /dev/shm.
        """
        for name in ("tmpfs_size", "memory"):
            value = getattr(self, name)
            if value is not None:
                return int(value), int(value)
        return DEFAULT_TMPFS_SIZE, DEFAULT_SHM_SIZE

    def value(self, name: str) -> float | None:
        """A limit as a number (fields are normalised when the Limits is built)."""
        value = getattr(self, name)
        if value is None:
            return None
        assert isinstance(value, (int, float))
        return value

    def to_dict(self) -> dict[str, Any]:
        """The limits that are set, sizes spelled with suffixes."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if value is None:
                continue
            out[f.name] = format_size(value) if f.name in ("memory", "file_size", "tmpfs_size") else value
        return out


def _str_tuple(value: object, name: str) -> tuple[str, ...]:
    if isinstance(value, (str, bytes, os.PathLike)):
        value = [value]
    if not isinstance(value, Iterable):
        raise PolicyError(f"{name}: expected a list of paths or names, got {type(value).__name__}", name)
    out = []
    for item in value:
        if isinstance(item, os.PathLike):
            item = os.fspath(item)
        if isinstance(item, bytes):
            item = os.fsdecode(item)
        if not isinstance(item, str) or not item or "\0" in item:
            raise PolicyError(f"{name}: {item!r} is not a usable path or name", name)
        out.append(item)
    return tuple(out)


#: Makes policy.preexec_fn's hook; set by the isolate package (the model itself runs nothing).
PREEXEC_FACTORY: Callable[[Policy], Callable[[], None]] | None = None


@dataclass(frozen=True)
class Mount:
    """A host path shown at another path inside the sandbox (bubblewrap's ``--bind SRC DST``).

    ``source`` is a host path (relative ones are resolved against each run's
    working directory, like ``read``/``write``); ``target`` is an absolute path
    inside; ``mode`` is "ro" or "rw". The TOML and CLI spelling is
    ``"SRC:DST"`` or ``"SRC:DST:ro"``.
    """

    source: str
    target: str
    mode: str = "ro"

    def __post_init__(self) -> None:
        source = os.fsdecode(os.fspath(self.source)) if isinstance(self.source, (bytes, os.PathLike)) else self.source
        if not isinstance(source, str) or not source or "\0" in source:
            raise PolicyError(f"binds: {self.source!r} is not a usable host path", "binds")
        target = mount_point(self.target, "binds", "a mount point")
        if self.mode not in ("ro", "rw"):
            raise PolicyError(f"binds: mode {self.mode!r} is not ro or rw", "binds")
        object.__setattr__(self, "source", source)
        object.__setattr__(self, "target", target)

    @classmethod
    def parse(cls, text: str, mode: str | None = None) -> Mount:
        """``SRC:DST`` or ``SRC:DST:ro|rw`` (``mode`` given by the caller wins over a missing suffix)."""
        parts = text.split(":")
        if len(parts) == 3 and parts[2] in ("ro", "rw"):
            return cls(parts[0], parts[1], parts[2])
        if len(parts) != 2 or not parts[0] or not parts[1]:
            raise PolicyError(f"binds: {text!r} is not SRC:DST (or SRC:DST:ro, SRC:DST:rw)", "binds")
        return cls(parts[0], parts[1], mode or "ro")

    def __str__(self) -> str:
        return f"{self.source}:{self.target}:{self.mode}"


def _mount_tuple(value: object) -> tuple[Mount, ...]:
    if isinstance(value, (str, Mount)):
        value = [value]
    if not isinstance(value, Iterable):
        raise PolicyError("binds: expected a list of isolate.Mount or \"SRC:DST[:ro|rw]\"", "binds")
    out = []
    for item in value:
        if isinstance(item, str):
            item = Mount.parse(item)
        elif isinstance(item, Mapping):
            item = _from_mapping(Mount, item, "binds.")
        if not isinstance(item, Mount):
            raise PolicyError(f"binds: {item!r} is not an isolate.Mount", "binds")
        out.append(item)
    targets = [m.target for m in out]
    for target in targets:
        if targets.count(target) > 1:
            raise PolicyError(f"binds: {target} is the target of two mounts", "binds")
    return tuple(out)


@dataclass(frozen=True)
class Policy:
    """What a sandboxed program may do.

    Every field has the safe default of ``isolate-run`` with no options; a field
    that is given replaces its default (``read=["/usr"]`` grants only /usr).
    Relative paths are resolved against the working directory of each run.
    """

    read: tuple[str, ...] = DEFAULT_READ
    write: tuple[str, ...] = DEFAULT_WRITE
    tmpfs: tuple[str, ...] = DEFAULT_TMPFS
    network: str | Egress = "none"
    limits: Limits = field(default_factory=Limits)
    seccomp: str = "default"
    env: Mapping[str, str] = field(default_factory=dict)
    keep_env: tuple[str, ...] = DEFAULT_KEEP_ENV
    home: str | None = DEFAULT_HOME
    home_files: tuple[str, ...] = ()
    cwd: str | None = None
    uid: int | None = None
    gid: int | None = None
    namespaces: bool = True
    new_session: bool = True
    die_with_parent: bool = True
    best_effort: bool = False
    backend: str = "auto"
    image: str | None = None
    #: Unix sockets the program may connect to although they lie outside its
    #: write grants (a host daemon's socket: docker.sock, a D-Bus bus ...).
    unix_sockets: tuple[str, ...] = ()
    #: Host paths shown at other paths inside (isolate.Mount): --bind SRC:DST.
    binds: tuple[Mount, ...] = ()
    #: Name every file access the policy refused in ``report.denied`` (isolate-run --why): the init
    #: looks at each path system call (and lets it continue), at a cost per call; off costs nothing.
    #: ``"lookups"`` also names the absent paths of stat, access, readlink and chdir (more calls to
    #: look at: what ``isolate-run learn`` uses).
    trace_denials: bool | str = False

    def __post_init__(self) -> None:
        set_ = object.__setattr__
        set_(self, "binds", _mount_tuple(self.binds))
        for bind in self.binds:
            if not os.path.exists(bind.source):
                raise PolicyError(f"binds: {bind.source!r} does not exist; create it or drop the mount", "binds")
        if self.binds and not self.namespaces:
            raise PolicyError("binds: showing a path at another place needs a mount namespace (namespaces=True)",
                              "binds")
        for name in ("read", "write", "tmpfs", "keep_env", "unix_sockets", "home_files"):
            set_(self, name, _str_tuple(getattr(self, name), name))
        # One canonical form each ("/tmp/" and "/tmp" are one mount), in the order given.
        set_(self, "tmpfs", tuple(dict.fromkeys(mount_point(p, "tmpfs", "a tmpfs") for p in self.tmpfs)))
        self._check_paths_exist()
        for name in self.keep_env:
            if "=" in name:
                raise PolicyError(f"keep_env: {name!r} is a variable name, without '='", "keep_env")

        network = self.network
        if isinstance(network, (list, tuple)):
            network = Egress(tuple(network))
        if isinstance(network, str):
            if network not in NETWORK_MODES:
                raise PolicyError(
                    f"network: {network!r} is not one of {', '.join(NETWORK_MODES)} (or isolate.Egress([...]))",
                    "network",
                )
        elif not isinstance(network, Egress):
            raise PolicyError(f"network: expected a mode or isolate.Egress, got {type(network).__name__}", "network")
        set_(self, "network", network)

        limits = self.limits
        if isinstance(limits, Mapping):
            limits = _from_mapping(Limits, limits, "limits.")
        if not isinstance(limits, Limits):
            raise PolicyError(f"limits: expected isolate.Limits, got {type(limits).__name__}", "limits")
        set_(self, "limits", limits)

        seccomp = self.seccomp
        if isinstance(seccomp, os.PathLike):
            seccomp = os.fspath(seccomp)
        if not isinstance(seccomp, str) or not seccomp:
            raise PolicyError("seccomp: expected default, strict, none or the path of a JSON profile", "seccomp")
        if seccomp not in SECCOMP_MODES and not os.path.isfile(seccomp):
            raise PolicyError(
                f"seccomp: {seccomp!r} is neither default, strict, none nor an existing JSON profile file", "seccomp"
            )
        set_(self, "seccomp", seccomp)

        env = self.env
        if not isinstance(env, Mapping):
            raise PolicyError("env: expected a mapping of NAME to VALUE", "env")
        for key, value in env.items():
            if not isinstance(key, str) or not key or "=" in key or "\0" in key:
                raise PolicyError(f"env: {key!r} is not a variable name", "env")
            if not isinstance(value, str) or "\0" in value:
                raise PolicyError(f"env: the value of {key} must be a string without NUL bytes", "env")
        set_(self, "env", _FrozenEnv(env))

        if self.home in ("none", ""):
            set_(self, "home", None)  # the TOML spelling of "no home"
        if self.home is not None:
            if not isinstance(self.home, str) or not self.home.startswith("/"):
                raise PolicyError(f"home: {self.home!r} must be an absolute path inside the sandbox (or none)", "home")
            set_(self, "home", mount_point(self.home, "home", "the home"))
        elif self.home_files:
            raise PolicyError("home_files: there is no home to put them in (home is none)", "home_files")
        for name in self.home_files:
            base = os.path.basename(os.path.normpath(name))
            if base in ("", ".", "..", "/"):
                raise PolicyError(f"home_files: {name!r} names no file", "home_files")
        if self.cwd is not None:
            set_(self, "cwd", inside_path(self.cwd, "cwd"))
        for name in ("uid", "gid"):
            value = getattr(self, name)
            if value is not None and (
                isinstance(value, bool) or not isinstance(value, int) or not 0 <= value < 2**32 - 1
            ):
                raise PolicyError(f"{name}: {value!r} is not a valid id", name)
        for name in ("uid", "gid"):
            if getattr(self, name) == 0:
                raise PolicyError(f"{name}: the sandboxed program never runs as root; choose another id", name)
        if not (isinstance(self.trace_denials, bool) or self.trace_denials == "lookups"):
            raise PolicyError("trace_denials: expected true, false or \"lookups\"", "trace_denials")
        for name in ("namespaces", "new_session", "die_with_parent", "best_effort"):
            if not isinstance(getattr(self, name), bool):
                raise PolicyError(f"{name}: expected true or false", name)
        if self.backend not in BACKENDS:
            raise PolicyError(f"backend: {self.backend!r} is not one of {', '.join(BACKENDS)}", "backend")
        if self.image is not None and (not isinstance(self.image, str) or not self.image):
            raise PolicyError("image: expected an image name", "image")
        self._check_contradictions()

    def _check_paths_exist(self) -> None:
        for name in ("read", "write", "unix_sockets"):
            for path in getattr(self, name):
                if path in DEFAULT_READ and getattr(self, name) == DEFAULT_READ:
                    continue
                if not os.path.exists(path):
                    raise PolicyError(f"{name}: {path!r} does not exist; create it or drop it from the policy", name)

    def _check_contradictions(self) -> None:
        # A default read-only path that is also asked for writable gives way to
        # the explicit grant (isolate-run --rw /etc); two explicit lists that
        # disagree are a contradiction.
        granted = {os.path.abspath(p) for p in self.read} & {os.path.abspath(p) for p in self.write}
        if granted and self.read != DEFAULT_READ:
            path = sorted(granted)[0]
            raise PolicyError(f"read/write: {path} is both read-only and writable; list it once", "write")
        if not self.namespaces and self.tmpfs and self.tmpfs != DEFAULT_TMPFS:
            raise PolicyError("tmpfs: a private tmpfs needs namespaces=True", "tmpfs")

    # -- conversions -----------------------------------------------------

    def replace(self, **changes: Any) -> Policy:
        """A copy with ``changes`` applied (and validated)."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """The policy as plain data, in the shape of a TOML profile."""
        out: dict[str, Any] = {}
        for f in dataclasses.fields(self):
            value = getattr(self, f.name)
            if f.name == "limits":
                value = value.to_dict()
            elif f.name == "network" and isinstance(value, Egress):
                value = value.to_dict()
            elif f.name == "env":
                value = dict(value)
            elif f.name == "binds":
                value = [str(m) for m in value]
            elif isinstance(value, tuple):
                value = list(value)
            elif f.name == "home" and value is None:
                value = "none"
            elif f.name == "trace_denials" and not value:
                continue  # the default, left out so that existing profiles and hashes stay as they were
            if value is None:
                continue
            out[f.name] = value
        return out

    def config_hash(self) -> str:
        """sha256 of the normalised policy: equal policies hash alike."""
        blob = json.dumps(self.to_dict(), sort_keys=True, separators=(",", ":"))
        return hashlib.sha256(blob.encode()).hexdigest()

    @classmethod
    def from_dict(cls, data: Mapping[str, Any]) -> Policy:
        """A policy from plain data (a parsed TOML profile); unknown fields raise ``PolicyError``."""
        if not isinstance(data, Mapping):  # JSON's list or string where a table of fields belongs
            raise PolicyError(f"a policy is a table of fields (read, write, limits ...), not a {type(data).__name__}")
        data = dict(data)
        network = data.get("network")
        if isinstance(network, Mapping):
            known = {"egress", "add_hosts", "resolver", "allow_private"}
            if "egress" not in network or set(network) - known:
                raise PolicyError("network: a table holds egress = [\"HOST[:PORT]\", ...] and optionally "
                                  "add_hosts, resolver, allow_private", "network")
            # As given: Egress checks the types (a bare string is one entry, never its characters).
            data["network"] = Egress(network["egress"], add_hosts=network.get("add_hosts", ()),
                                     resolver=network.get("resolver"),
                                     allow_private=network.get("allow_private", False))
        policy: Policy = _from_mapping(cls, data, "")
        return policy

    @classmethod
    def from_toml(cls, text: str, source: str = "<policy>") -> Policy:
        """Parse a TOML profile; syntax errors raise ``PolicyError`` naming ``source``."""
        if sys.version_info >= (3, 11):
            import tomllib
        else:  # pragma: no cover - exercised on 3.10 only
            import tomli as tomllib
        try:
            data = tomllib.loads(text)
        except tomllib.TOMLDecodeError as exc:
            raise PolicyError(f"{source}: not valid TOML: {exc}") from None
        except RecursionError:  # tomllib descends once per nested array or inline table
            raise PolicyError(f"{source}: nested deeper than a policy is; not a profile") from None
        return cls.from_dict(data)

    @classmethod
    def load(cls, path: str | os.PathLike[str]) -> Policy:
        """Read a TOML profile from ``path``."""
        try:
            text = read_input_file(path).decode("utf-8")
        except OSError as exc:
            raise PolicyError(f"profile {os.fspath(path)!r}: cannot read it: {exc.strerror}") from None
        except UnicodeDecodeError:
            raise PolicyError(f"profile {os.fspath(path)!r}: not UTF-8 text") from None
        except ValueError as exc:  # larger than any profile
            raise PolicyError(f"profile {exc}") from None
        return cls.from_toml(text, os.fspath(path))

    def to_toml(self) -> str:
        """The policy as a TOML profile that ``Policy.from_toml`` reads back equal."""
        import tomli_w

        return tomli_w.dumps(self.to_dict())

    def save(self, path: str | os.PathLike[str]) -> None:
        """Write the policy to ``path`` as TOML."""
        with open(path, "w", encoding="utf-8") as handle:
            handle.write(self.to_toml())

    # -- the pre-exec hook -------------------------------------------------

    @property
    def preexec_fn(self) -> Callable[[], None]:
        """A hook for ``subprocess``: ``subprocess.run(cmd, preexec_fn=policy.preexec_fn)``.

        It confines the child of ``subprocess`` as ``isolate.run`` would, but
        ``preexec_fn`` makes Python fork the whole parent (about 2 ms from a
        small parent, 20 ms more per GiB the parent holds), and with namespaces
        the hook forks twice more so that a small init runs as PID 1. Plain
        ``subprocess`` gets no report and no tree-wide limits: prefer
        ``isolate.run``/``isolate.Popen``, whose cost does not grow with the
        parent. The policy is prepared (paths resolved, filters compiled) when
        this property is read, in the parent.
        """
        if PREEXEC_FACTORY is None:  # pragma: no cover - the package sets it on import
            raise RuntimeError("isolate.model.policy was loaded without the isolate package")
        return PREEXEC_FACTORY(self)


class _FrozenEnv(dict):  # type: ignore[type-arg]
    """A read-only dict, so that a frozen policy stays frozen and hashable."""

    def _readonly(self, *args: object, **kwargs: object) -> None:
        raise TypeError("a policy's env is read-only; use policy.replace(env=...)")

    __setitem__ = __delitem__ = clear = pop = popitem = setdefault = update = _readonly  # type: ignore[assignment]

    def __hash__(self) -> int:  # type: ignore[override]
        return hash(tuple(sorted(self.items())))


def _from_mapping(cls: Any, data: Mapping[str, Any], prefix: str) -> Any:
    names = {f.name for f in dataclasses.fields(cls)}
    for key in data:
        if key not in names:
            raise PolicyError(
                f"{prefix}{key}: unknown field; known fields are {', '.join(sorted(names))}", f"{prefix}{key}"
            )
    try:
        return cls(**data)
    except TypeError as exc:  # pragma: no cover - guarded by the names check
        raise PolicyError(str(exc)) from None


