"""Egress by name, the native backend's side: plan the listeners, hand them to the mediator.

The sandbox keeps a network namespace of its own with only its loopback; the
first child makes the mediator's listening sockets inside it (csrc/net.c)
and sends them over a unix socket made here for each run. ``start_mediator``
receives them and starts ``isolate.egress.Mediator`` in this process. The
program finds the mediator three ways: the proxy variables set here, the DNS
server that /etc/resolv.conf (bound over the host's) names, and the
listeners on every allowed port for programs that connect by themselves.
"""

from __future__ import annotations

import array
import ipaddress
import json
import os
import socket
import subprocess
import sys
from typing import TYPE_CHECKING, Any

from ...kernel import fdwait
from ...kernel.places import runtime_dir
from ...model import egress_rules
from ...model.errors import SetupError
from ...model.files import write_all

if TYPE_CHECKING:
    from ...egress.mediator import Mediator
    from ...model.policy import Egress

#: The sandbox's /etc/resolv.conf: isolate's DNS only (no search domain: a
#: short name must not turn into a host's internal one). The mediator answers
#: at once (a refusal too); the resolver asks again every 2 s, five times, so
#: that a mediator starved by a loaded host (50 lookups at once in a VM under
#: emulation gave up after 2 x 2 s) still answers before the program gives up.
RESOLV_CONF = f"nameserver {egress_rules.DNS_ADDRESS}\noptions timeout:2 attempts:5\n"
HOSTS = "127.0.0.1\tlocalhost\n::1\tlocalhost ip6-localhost ip6-loopback\n"
#: How long a named sandbox's mediator process may take to start serving.
MEDIATOR_START_TIMEOUT = 30.0
PROXY_URL = f"http://{egress_rules.PROXY_ADDRESS}:{egress_rules.PROXY_PORT}"


def plan_listeners(plan: Any, egress: Egress, keep: list[Any], enforced: dict[str, Any]) -> None:
    """The static part: which ports the first child listens on, and what the report says."""
    from ..._core import ffi

    rules = egress.rules()
    ports = ffi.new("uint16_t[]", list(rules.ports))
    keep.append(ports)
    plan.egress_ports = ports
    plan.n_egress_ports = len(rules.ports)
    plan.egress_dns_address = int(ipaddress.IPv4Address(egress_rules.DNS_ADDRESS))
    enforced["network"] = "netns-egress"
    enforced["egress"] = {
        "allow": list(egress.hosts),
        "add_hosts": list(egress.add_hosts),
        "resolver": egress.resolver or "host",
        "private_addresses": "allowed" if egress.allow_private else "refused",
        "mediator": {"dns": f"{egress_rules.DNS_ADDRESS}:53", "proxy": PROXY_URL.removeprefix("http://"),
                     "ports": list(rules.ports)},
    }


def supervise_mode(network: str, egress: Egress | None, sendto_nr: int, sendmsg_nr: int, sendmmsg_nr: int) -> str:
    """The init's connect() supervisor mode (csrc/supervise.c): under egress, the mediator's block,
    the numbers of sendto, sendmsg and sendmmsg (a sendto() naming a destination, and every sendmsg()
    and sendmmsg(), are looked at too) and the listened ports."""
    if egress is None:
        return "n" if network == "none" else "l"
    block = egress_rules.BLOCK
    ports = ":".join(str(p) for p in egress.rules().ports)
    return f"e:{int(block.network_address)}/{block.prefixlen}/{sendto_nr}/{sendmsg_nr}/{sendmmsg_nr}:{ports}"


def _generated(name: str, text: str) -> str:
    """A file of isolate's own in the caller's private runtime directory, rewritten when it differs."""
    directory = os.path.join(runtime_dir(), "egress")
    try:
        os.mkdir(directory, 0o755)
    except FileExistsError:
        pass
    info = os.lstat(directory)
    if not os.path.isdir(directory) or os.path.islink(directory) or info.st_uid != os.geteuid():
        raise SetupError(f"{directory} is not a directory of this user's; remove it")
    path = os.path.join(directory, name)
    data = text.encode()
    try:
        fd = os.open(path, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        try:
            if os.read(fd, len(data) + 1) == data:
                return path
        finally:
            os.close(fd)
    except OSError:
        pass
    temporary = f"{path}.{os.getpid()}"
    fd = os.open(temporary, os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_NOFOLLOW | os.O_CLOEXEC, 0o644)
    try:
        write_all(fd, data)
        os.fchmod(fd, 0o644)
    finally:
        os.close(fd)
    os.replace(temporary, path)
    return path


def name_files() -> list[tuple[str, str]]:
    """(host file, path inside): isolate's resolv.conf and hosts, over the host's.

    Bound where the host's own file really is (/etc/resolv.conf is often a
    link into /run), or at /etc when the host has none.
    """
    out = []
    for name, text in (("resolv.conf", RESOLV_CONF), ("hosts", HOSTS)):
        target = os.path.realpath("/etc/" + name)
        if not os.path.isfile(target):
            target = "/etc/" + name
        out.append((_generated(name, text), target))
    return out


def proxy_environment() -> dict[str, str]:
    """The variables that send pip, curl, git, npm, urllib and requests through the mediator's proxy."""
    no_proxy = "localhost,127.0.0.1,::1"
    return {"http_proxy": PROXY_URL, "https_proxy": PROXY_URL, "HTTP_PROXY": PROXY_URL, "HTTPS_PROXY": PROXY_URL,
            "no_proxy": no_proxy, "NO_PROXY": no_proxy}


def channel() -> tuple[socket.socket, int]:
    """The per-run unix socket: (the host's end, the child's descriptor)."""
    host_end, child_end = socket.socketpair(socket.AF_UNIX, socket.SOCK_SEQPACKET | socket.SOCK_CLOEXEC)
    return host_end, child_end.detach()


def receive_listeners(host_end: socket.socket, count: int) -> list[socket.socket]:
    """The listeners the first child sent (the DNS socket first), once it has exec'd."""
    fds = array.array("i")
    host_end.setblocking(False)
    try:
        data, ancillary, flags, _ = host_end.recvmsg(1, socket.CMSG_SPACE(count * fds.itemsize))
    except BlockingIOError:
        raise SetupError("egress: the sandbox sent no listeners to the mediator") from None
    finally:
        host_end.close()
    for level, kind, payload in ancillary:
        if level == socket.SOL_SOCKET and kind == socket.SCM_RIGHTS:
            fds.frombytes(payload[: len(payload) - len(payload) % fds.itemsize])
    sockets = [socket.socket(fileno=fd) for fd in fds]
    if len(sockets) != count or flags & socket.MSG_CTRUNC or data != bytes([count]):
        for sock in sockets:
            sock.close()
        raise SetupError(f"egress: the sandbox sent {len(sockets)} listeners, {count} expected")
    return sockets


def start_mediator(egress: Egress, host_end: socket.socket) -> Mediator:
    """Receive the run's listeners and start its mediator (threads of this process)."""
    from ...egress.mediator import Mediator

    rules = egress.rules()
    sockets = receive_listeners(host_end, 1 + len(rules.ports))
    mediator = Mediator(rules, sockets[0], sockets[1:])
    mediator.start()
    return mediator


def _control_listener(path: str) -> socket.socket:
    """The mediator process's query listener at ``path`` (in the private runtime directory, 0600)."""
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
    try:
        try:
            os.unlink(path)
        except FileNotFoundError:
            pass
        sock.bind(path)
        os.chmod(path, 0o600)
        sock.listen(8)
    except OSError as exc:
        sock.close()
        raise SetupError(f"egress: the mediator's control socket {path}: {exc.strerror}") from None
    return sock


def start_mediator_process(egress: Egress, host_end: socket.socket, init_pid: int,
                           control: str | None = None) -> tuple[subprocess.Popen[bytes], socket.socket]:
    """The same, as a process of its own that outlives this one (a named sandbox): ``python -m
    isolate.egress``, in a session of its own, ending when the sandbox's init does (a pidfd). Also
    returns a socket on which this process may ask for its summary (``summary`` lines) or change its
    allow-list (``rules`` lines); ``control``: a path where it listens for more such sockets (a later
    process of this user finds it there by the sandbox's name: ``MediatorControl``)."""
    from ...egress import rules_to_json

    rules = egress.rules()
    sockets = receive_listeners(host_end, 1 + len(rules.ports))
    rules_r, rules_w = os.pipe2(os.O_CLOEXEC)
    ready_r, ready_w = os.pipe2(os.O_CLOEXEC)
    pidfd = -1
    query, theirs = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    listener = None
    try:
        pidfd = os.pidfd_open(init_pid)
        fds = [rules_r, ready_w, pidfd, theirs.fileno()] + [sock.fileno() for sock in sockets]
        argv = [sys.executable, "-I", "-m", "isolate.egress", "--rules-fd", str(rules_r), "--pidfd", str(pidfd),
                "--ready-fd", str(ready_w), "--query-fd", str(theirs.fileno()),
                "--dns-fd", str(sockets[0].fileno())]
        if control is not None:
            listener = _control_listener(control)
            fds.append(listener.fileno())
            argv += ["--query-listen-fd", str(listener.fileno())]
        for sock in sockets[1:]:
            argv += ["--listen-fd", str(sock.fileno())]
        process = subprocess.Popen(argv, pass_fds=fds, start_new_session=True, stdin=subprocess.DEVNULL,
                                   stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd="/",
                                   env={"PATH": os.defpath})
        os.close(rules_r)
        rules_r = -1
        os.close(ready_w)
        ready_w = -1
        try:
            write_all(rules_w, rules_to_json(rules).encode())
        except BrokenPipeError:
            pass  # it is gone already: said below
        os.close(rules_w)
        rules_w = -1
        # Never a named sandbox whose egress silently does not work: the mediator says it serves.
        served = ready_r in fdwait.ready([ready_r], timeout=MEDIATOR_START_TIMEOUT)
        if not served or os.read(ready_r, 16) != b"ready\n":
            process.kill()
            status = process.wait()
            raise SetupError(f"egress: the mediator process ({sys.executable} -I -m isolate.egress) did not start "
                             f"(status {status}); run it by hand to see why")
    except BaseException:
        query.close()
        raise
    finally:
        theirs.close()
        if listener is not None:
            listener.close()
        for fd in (rules_w, ready_r, ready_w):
            if fd >= 0:
                os.close(fd)
        if rules_r >= 0:
            os.close(rules_r)
        if pidfd >= 0:
            os.close(pidfd)
        for sock in sockets:
            sock.close()
    return process, query


class MediatorControl:
    """A named sandbox's mediator process, reached at its control socket by any process of its user (a
    restarted server): the in-process ``Mediator``'s ``update_rules`` and ``summary``, asked over it."""

    def __init__(self, path: str) -> None:
        self.path = path

    def _ask(self, line: bytes) -> dict[str, Any] | None:
        sock = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM | socket.SOCK_CLOEXEC)
        try:
            sock.settimeout(5.0)
            sock.connect(self.path)
            return ask(sock, line)
        except OSError:
            return None
        finally:
            sock.close()

    def listening(self) -> bool:
        return self._ask(b"summary") is not None

    def summary(self) -> dict[str, Any]:
        return self._ask(b"summary") or {}

    def update_rules(self, rules: Any) -> int:
        """Serve ``rules`` (isolate.model.egress_rules.EgressRules) from now on; how many connections it closed
        (PolicyError when the mediator refuses them, SetupError when it does not answer)."""
        from ...egress import rules_to_json
        from ...model.errors import PolicyError

        answer = self._ask(b"rules " + rules_to_json(rules).encode())
        if answer is None:
            raise SetupError("egress: the sandbox's mediator process does not answer (it ended?)")
        if "error" in answer:
            raise PolicyError(str(answer["error"]), "network")
        closed = answer.get("closed")
        return closed if isinstance(closed, int) else 0


def ask_summary(query: socket.socket, timeout: float = 5.0) -> dict[str, Any] | None:
    """A mediator process's summary, asked on its query socket (None when it does not answer)."""
    return ask(query, b"summary", timeout)


def ask(query: socket.socket, line: bytes, timeout: float = 5.0) -> dict[str, Any] | None:
    """A line sent on a mediator process's query socket, and its answer (None when it does not answer)."""
    try:
        query.settimeout(timeout)
        query.sendall(line + b"\n")
        data = b""
        while not data.endswith(b"\n"):
            chunk = query.recv(1 << 20)
            if not chunk or len(data) > 64 << 20:
                return None
            data += chunk
        answer = json.loads(data)
    except (OSError, ValueError):
        return None
    return answer if isinstance(answer, dict) else None


def summary_delta(before: dict[str, Any], after: dict[str, Any]) -> dict[str, Any]:
    """What a summary gained since an earlier one (egress per command): each entry with the count it gained,
    and what ``dropped`` (entries past the summary's cap) and ``errors`` gained."""
    out: dict[str, Any] = {}
    for key in ("allowed", "denied", "failed"):
        earlier: dict[str, int] = {}
        for entry in before.get(key, []) if isinstance(before.get(key), list) else []:
            if isinstance(entry, dict):
                earlier[_entry_key(entry)] = int(entry.get("count") or 0)
        gained = []
        for entry in after.get(key, []) if isinstance(after.get(key), list) else []:
            if isinstance(entry, dict):
                count = int(entry.get("count") or 0) - earlier.get(_entry_key(entry), 0)
                if count > 0:
                    gained.append({**entry, "count": count})
        if gained or key != "failed":
            out[key] = gained
    for key in ("dropped", "errors"):  # counts: what the summary could not name, and internal errors
        try:
            count = int(after.get(key) or 0) - int(before.get(key) or 0)
        except (TypeError, ValueError):
            continue
        if count > 0:
            out[key] = count
    return out


def _entry_key(entry: dict[str, Any]) -> str:
    return json.dumps({k: v for k, v in entry.items() if k != "count"}, sort_keys=True, default=str)


def connect_denial(mediator: Mediator, address: ipaddress.IPv4Address | ipaddress.IPv6Address, port: int,
                   count: int) -> dict[str, Any]:
    """A connect() the init refused under egress, as a report entry."""
    if isinstance(address, ipaddress.IPv6Address) and address.ipv4_mapped is not None:
        address = address.ipv4_mapped
    name = mediator.address_name(str(address)) if address in egress_rules.BLOCK else None
    if name is not None:
        return {"mechanism": "egress", "host": name, "port": port, "count": count,
                "reason": f"port {port} is not allowed for {name} (allow {name}:{port})"}
    if address in egress_rules.BLOCK:
        return {"mechanism": "egress", "address": str(address), "port": port, "count": count,
                "reason": "no name has this address"}
    return {"mechanism": "egress", "address": str(address), "port": port, "count": count,
            "reason": "an address, not a name: only allowed names are reachable "
                      "(name it with --add-host NAME:IP and allow NAME)"}


def finish(mediator: Mediator, report: Any) -> None:
    """Stop the run's mediator and put what it saw into the report."""
    mediator.close()
    summary = mediator.summary()
    refused = [dict(entry) for entry in report.denied if entry.get("mechanism") == "egress"]
    for entry in summary.get("denied", []):
        report.denied.append({"mechanism": "egress", **entry})
    for entry in refused:
        entry.pop("mechanism", None)
    report.egress = {"allowed": list(summary.get("allowed", [])),
                     "denied": list(summary.get("denied", [])) + refused}
