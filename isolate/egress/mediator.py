"""The mediator: the sandbox's only way out, on the host's side.

It receives the listening sockets made inside the sandbox's network
namespace (the DNS server's UDP socket, and a TCP listener on every port of
the plan) and serves them from threads of the host process:

- a DNS query for an allowed name is resolved for real, and answered with
  the name's own fake address (``127.77.1.0`` and above); a denied name is
  NXDOMAIN;
- a connection is dispatched on its local address: the DNS server's
  (DNS over TCP), the proxy's (CONNECT and plain HTTP), a name's fake
  address (relayed to that name when the port is allowed) or anything else
  (reset at once, and recorded as denied).

Every destination is checked against the rules here, and the mediator
connects only to the real addresses of allowed names. No connection thread
can take the others down: each has its own timeouts, and its errors end it
alone.
"""

from __future__ import annotations

import errno
import ipaddress
import itertools
import resource
import selectors
import socket
import struct
import threading
import time
from collections.abc import Sequence
from typing import Any

from ..model.egress_rules import (
    BLOCK,
    DNS_ADDRESS,
    DNS_PORT,
    FIRST_NAME_ADDRESS,
    PROXY_ADDRESS,
    PROXY_PORT,
    EgressRules,
    normalize_name,
)
from ..model.errors import PolicyError
from . import dns, http
from .relay import relay
from .vault import MAX_FORM_BODY, Vault, form_may_override, form_overrides
from .workers import Workers

#: How long a proxy client has to send its request head, and a DNS-over-TCP client its query.
HEAD_TIMEOUT = 10.0
#: How long a connection to an allowed name may take (over all its addresses).
CONNECT_TIMEOUT = 10.0
#: How long a request body may stall.
BODY_IDLE_TIMEOUT = 120.0
#: Sockets open at once (a relayed connection counts its two ends); beyond, a new connection is
#: reset (and counted as denied).
MAX_CONNECTIONS = 1024
#: Descriptors one connection may hold at worst: the client's socket, the upstream one, and the
#: relay's two pipes (relay.py). Reserved when it is accepted, from the process's budget below.
FDS_PER_CONNECTION = 6
#: The share of the process's descriptor limit (RLIMIT_NOFILE, soft) that all of its mediators
#: together may hold: the rest stays the host process's (its files, its other sandboxes), whatever
#: a program inside does. Beyond it a new connection is reset, and counted as denied.
FD_SHARE = 0.5
#: The descriptors each started mediator is guaranteed from that share (16 connections), or an equal
#: part of it when there are too many mediators for that.
RESERVE = 16 * FDS_PER_CONNECTION
#: The most of that share one mediator may hold.
MAX_SHARE = 0.75
#: DNS queries over UDP answered at once; beyond, a query is dropped (the client asks again).
MAX_DNS_WORKERS = 64
#: Distinct entries kept in each list of the summary; the others are counted.
MAX_SUMMARY_ENTRIES = 512
_LAST_NAME_ADDRESS = int(BLOCK.broadcast_address)

NOT_ALLOWED = "not allowed"
#: The reason of a refused name that is none (not ASCII, a bad label, an address in a DNS question).
NOT_A_NAME = "not a host name"
#: Of a name that is none, the report keeps this many characters (the program chose them, and their length).
MAX_SHOWN_NAME = 255


class _DescriptorBudget:
    """The descriptors this process's mediators hold, bounded by a share of RLIMIT_NOFILE, fairly.

    One budget for the whole process: the mediators of a server's many sandboxes
    share it, and a sandbox that opens connections without end runs into this
    bound, not into EMFILE in the host process's own work. Each started
    mediator is guaranteed an equal part of it (up to RESERVE descriptors):
    what one takes beyond its part comes only from what no other mediator is
    guaranteed and holds unused, and never more than MAX_SHARE of the budget,
    so that a sandbox that floods its mediator with connections leaves room
    for the others, those started later included (before, it took it all).
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[int, int] = {}   # by mediator (id), for each started one

    @staticmethod
    def limit() -> int:
        soft = resource.getrlimit(resource.RLIMIT_NOFILE)[0]
        if soft == resource.RLIM_INFINITY or soft <= 0:
            soft = 1 << 20
        return int(soft * FD_SHARE)

    def join(self, key: int) -> None:
        with self._lock:
            self._held.setdefault(key, 0)

    def leave(self, key: int) -> None:
        with self._lock:
            self._held.pop(key, None)

    def take(self, key: int, n: int) -> bool:
        limit = self.limit()
        with self._lock:
            reserve = min(RESERVE, limit // max(1, len(self._held)))
            held = sum(self._held.values())
            promised = sum(max(0, reserve - h) for k, h in self._held.items() if k != key)
            mine = self._held.get(key, 0)
            if held + n > limit:
                return False
            if mine + n > reserve and (held + n + promised > limit or mine + n > int(limit * MAX_SHARE)):
                return False  # beyond its own part: only from what no one else is promised, up to MAX_SHARE
            self._held[key] = self._held.get(key, 0) + n
            return True

    def give(self, key: int, n: int) -> None:
        with self._lock:
            if key in self._held:
                self._held[key] = max(0, self._held[key] - n)


_budget = _DescriptorBudget()
_keys = itertools.count()


class _Denied(Exception):
    """A destination the rules refuse: the summary's reason and the proxy's answer."""

    def __init__(self, reason: str, status: int, message: str) -> None:
        super().__init__(reason)
        self.reason = reason
        self.status = status
        self.message = message


def _reset(sock: socket.socket) -> None:
    """Close with an RST, so the client fails at once (ECONNRESET), not after a timeout."""
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    except OSError:
        pass
    sock.close()


def _plain_address(address: str) -> str:
    try:
        ip = ipaddress.ip_address(address.partition("%")[0])
    except ValueError:
        return address
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        return str(ip.ipv4_mapped)
    return str(ip)


class Mediator:
    """Serves the sandbox's DNS, proxy and transparent listeners; see the module's text.

    ``dns_port`` and ``proxy_port`` are the ports the DNS server and the proxy
    are recognised on (the plan's, unless a test binds others).
    """

    def __init__(self, rules: EgressRules, dns_udp: socket.socket, listeners: Sequence[socket.socket], *,
                 dns_port: int = DNS_PORT, proxy_port: int = PROXY_PORT,
                 connect_timeout: float = CONNECT_TIMEOUT, head_timeout: float = HEAD_TIMEOUT) -> None:
        self.rules = rules
        self._initial = rules  # what update_rules may not go beyond
        self.resolver = dns.Resolver(rules)
        self._udp = dns_udp
        self._listeners = list(listeners)
        self._dns_port = dns_port
        self._proxy_port = proxy_port
        self.connect_timeout = connect_timeout
        self.head_timeout = head_timeout
        self._lock = threading.Lock()
        self._closed = False
        self._started = False
        self._names: dict[str, str] = {}        # name -> fake address
        self._addresses: dict[str, str] = {}    # fake address -> name
        self._next_address = int(FIRST_NAME_ADDRESS)
        self._sockets: set[socket.socket] = set()
        # Relayed connections by their upstream socket: (name, port, the sandbox's end, upstream).
        self._active: dict[int, tuple[str, int, socket.socket, socket.socket]] = {}
        self._workers = Workers("isolate-egress-conn")
        self._key = next(_keys)  # its account in the process's descriptor budget
        self._dns_slots = threading.BoundedSemaphore(MAX_DNS_WORKERS)
        self._allowed: dict[tuple[str, int], int] = {}
        self._denied: dict[tuple[str, str, int | None, str], int] = {}
        self._failed: dict[tuple[str, str, int | None, str], int] = {}
        self._dropped = 0
        self._errors = 0
        #: The credential vault whose headers go into this sandbox's plain-HTTP requests (vault.py).
        self.vault: Vault | None = None
        self._wake_r, self._wake_w = socket.socketpair()
        self._accept_thread: threading.Thread | None = None

    # --- life ------------------------------------------------------------------------------------

    def start(self) -> Mediator:
        with self._lock:
            if self._started or self._closed:
                raise RuntimeError("the mediator was started already")
            self._started = True
        for sock in [self._udp, *self._listeners]:
            sock.setblocking(False)
        _budget.join(self._key)
        self._accept_thread = threading.Thread(target=self._accept_loop, daemon=True, name="isolate-egress")
        self._accept_thread.start()
        return self

    def close(self, timeout: float = 5.0) -> None:
        """Stop serving, end every connection, and wait (at most ``timeout`` s) for the threads."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            sockets = list(self._sockets)
        try:
            self._wake_w.send(b"x")
        except OSError:
            pass
        if self._accept_thread is not None and self._accept_thread is not threading.current_thread():
            self._accept_thread.join(timeout)
        for sock in sockets:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        deadline = time.monotonic() + timeout
        while self._workers.busy() and time.monotonic() < deadline:
            time.sleep(0.01)
            with self._lock:   # an upstream connection opened in the meantime
                sockets = list(self._sockets)
            for sock in sockets:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        self._workers.close(max(0.0, deadline - time.monotonic()))
        for sock in [self._udp, *self._listeners, self._wake_r, self._wake_w]:
            sock.close()
        _budget.leave(self._key)

    def __enter__(self) -> Mediator:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    def update_rules(self, rules: EgressRules) -> int:
        """Serve another allow-list from now on; close the open connections it no longer allows.

        Only the host rules may change: the listeners inside were made for the
        ports of the allow-list at start (a rule on another port is refused);
        the static hosts are some of those at start, and the resolver and
        allow_private stay. Returns how many connections were closed.
        """
        listened = set(self._initial.ports)
        extra = sorted(set(rules.ports) - listened)
        if extra:
            raise PolicyError(f"port {extra[0]}: the sandbox listens only on the ports of its allow-list at start "
                              f"({', '.join(str(p) for p in sorted(listened))}); start another sandbox for this one",
                              "network")
        if not set(rules.static_hosts) <= set(self._initial.static_hosts) or \
                (rules.resolver, rules.allow_private) != (self._initial.resolver, self._initial.allow_private):
            raise PolicyError("only the allowed hosts of a running sandbox can change (not its add_hosts, "
                              "resolver or allow_private)", "network")
        with self._lock:
            # Under the lock that _track takes: a connection is either tracked now (and looked at
            # below) or checked against the new rules when it is.
            self.rules = rules
            self.resolver.rules = rules
            doomed = [(conn, upstream) for name, port, conn, upstream in self._active.values()
                      if not rules.allows(name, port)]
        for pair in doomed:
            for sock in pair:
                try:
                    sock.shutdown(socket.SHUT_RDWR)
                except OSError:
                    pass
        return len(doomed)

    def _track(self, name: str, port: int, conn: socket.socket, upstream: socket.socket) -> bool:
        """Count a relayed connection as open to name:port; False if the rules no longer allow it."""
        with self._lock:
            if not self.rules.allows(name, port):
                return False
            self._active[id(upstream)] = (name, port, conn, upstream)
            return True

    def _untrack(self, upstream: socket.socket) -> None:
        with self._lock:
            self._active.pop(id(upstream), None)

    # --- the report --------------------------------------------------------------------------------

    def address_name(self, address: str) -> str | None:
        """The name a fake address stands for (None: no name has it)."""
        with self._lock:
            return self._addresses.get(_plain_address(address))

    def summary(self) -> dict[str, Any]:
        """What the sandbox reached and tried: a new dict, safe to call from any thread.

        ``allowed``: ``{host, port, count}`` per connection relayed (proxy or transparent).
        ``denied``: ``{host or address, port, count, reason}``; ``port`` None for a DNS
        query. Only when non-empty: ``failed`` (allowed, but the name does not resolve or
        does not answer; same shape), ``dropped`` (entries beyond MAX_SUMMARY_ENTRIES per
        list, counted, not kept), ``errors`` (connections ended by an internal error).
        """
        with self._lock:
            allowed = [{"host": host, "port": port, "count": count}
                       for (host, port), count in sorted(self._allowed.items())]
            denied = [{kind: target, "port": port, "count": count, "reason": reason}
                      for (kind, target, port, reason), count in
                      sorted(self._denied.items(), key=lambda item: (item[0][1], item[0][2] or 0, item[0][3]))]
            out: dict[str, Any] = {"allowed": allowed, "denied": denied}
            if self._failed:   # allowed, but the name does not resolve or does not answer
                out["failed"] = [{kind: target, "port": port, "count": count, "reason": reason}
                                 for (kind, target, port, reason), count in
                                 sorted(self._failed.items(), key=lambda item: (item[0][1], item[0][2] or 0))]
            if self._dropped:
                out["dropped"] = self._dropped
            if self._errors:
                out["errors"] = self._errors
        return out

    def _count_allowed(self, host: str, port: int) -> None:
        with self._lock:
            key = (host, port)
            if key in self._allowed:
                self._allowed[key] += 1
            elif len(self._allowed) < MAX_SUMMARY_ENTRIES:
                self._allowed[key] = 1
            else:
                self._dropped += 1

    def _count_denied(self, kind: str, target: str, port: int | None, reason: str,
                      table: dict[tuple[str, str, int | None, str], int] | None = None) -> None:
        with self._lock:
            counts = self._denied if table is None else table
            key = (kind, target, port, reason)
            if key in counts:
                counts[key] += 1
            elif len(counts) < MAX_SUMMARY_ENTRIES:
                counts[key] = 1
            else:
                self._dropped += 1

    def _count_failed(self, name: str, port: int | None, reason: str) -> None:
        self._count_denied("host", name, port, reason, self._failed)

    # --- names -------------------------------------------------------------------------------------

    def _address_of(self, name: str) -> str | None:
        """The name's fake address, given on first use (None when the block is used up)."""
        with self._lock:
            address = self._names.get(name)
            if address is None:
                if self._next_address > _LAST_NAME_ADDRESS:
                    return None
                address = str(ipaddress.IPv4Address(self._next_address))
                self._next_address += 1
                self._names[name] = address
                self._addresses[address] = name
            return address

    def answer_dns(self, data: bytes) -> bytes | None:
        """The answer to one DNS message (None: no answer at all)."""
        try:
            query = dns.parse_query(data)
        except dns.DNSError:
            return dns.error_response(data, dns.FORMERR)
        if (query.flags >> 11) & 0xF != 0:
            return dns.error_response(data, dns.NOTIMP)
        if query.qclass != dns.CLASS_IN:
            return dns.build_response(query, dns.REFUSED)
        try:
            name = normalize_name(query.name, "dns")
        except PolicyError:
            self._count_denied("host", query.name[:MAX_SHOWN_NAME], None, NOT_A_NAME)
            return dns.build_response(query, dns.NXDOMAIN)
        if not self.rules.ports_of(name):
            self._count_denied("host", name, None, NOT_ALLOWED)
            return dns.build_response(query, dns.NXDOMAIN)
        resolution = self.resolver.resolve(name)
        if not resolution.addresses:
            if resolution.refused:
                self._count_denied("host", name, None, resolution.error)
            else:
                self._count_failed(name, None, resolution.error)
            return dns.build_response(query, dns.NXDOMAIN)
        address = self._address_of(name)
        if address is None:
            self._count_denied("host", name, None, "the sandbox's block of name addresses is used up")
            return dns.build_response(query, dns.SERVFAIL)
        if query.qtype == dns.TYPE_A:
            return dns.build_response(query, dns.NOERROR, (address,))
        return dns.build_response(query, dns.NOERROR)   # AAAA and the rest: no data (IPv4 it is)

    # --- threads ------------------------------------------------------------------------------------

    def _spawn(self, target: Any, *args: Any) -> bool:
        if self._closed:
            return False
        return self._workers.submit(self._guarded, target, *args)

    def _guarded(self, target: Any, *args: Any) -> None:
        try:
            target(*args)
        except Exception:
            with self._lock:
                self._errors += 1

    def _accept_loop(self) -> None:
        selector = selectors.DefaultSelector()
        try:
            selector.register(self._wake_r, selectors.EVENT_READ)
            selector.register(self._udp, selectors.EVENT_READ)
            for listener in self._listeners:
                selector.register(listener, selectors.EVENT_READ)
            while not self._closed:
                for key, _ in selector.select():
                    if self._closed:
                        return
                    sock = key.fileobj
                    if sock is self._udp:
                        self._read_udp()
                    elif sock is not self._wake_r:
                        assert isinstance(sock, socket.socket)
                        self._accept(sock)
        except Exception:
            with self._lock:
                self._errors += 1
        finally:
            selector.close()

    def _read_udp(self) -> None:
        for _ in range(64):   # a burst, then back to the listeners
            try:
                data, peer = self._udp.recvfrom(65535)
            except (BlockingIOError, InterruptedError):
                return
            except OSError:
                return
            if not self._dns_slots.acquire(blocking=False):
                continue   # too many at once: drop it, the client asks again
            if not self._spawn(self._serve_udp, data, peer):
                self._dns_slots.release()

    def _serve_udp(self, data: bytes, peer: Any) -> None:
        try:
            reply = self.answer_dns(data)
            if reply is not None:
                try:
                    self._udp.sendto(reply, peer)
                except OSError:
                    pass
        finally:
            self._dns_slots.release()

    def _accept(self, listener: socket.socket) -> None:
        for _ in range(64):
            try:
                conn, _ = listener.accept()
            except (BlockingIOError, InterruptedError):
                return
            except OSError as exc:
                if exc.errno in (errno.EMFILE, errno.ENFILE, errno.ENOBUFS, errno.ENOMEM):
                    # The connection stays queued and the listener readable: pause rather than spin.
                    with self._lock:
                        self._errors += 1
                    time.sleep(0.05)
                return
            with self._lock:
                full = len(self._sockets) >= MAX_CONNECTIONS or self._closed
            if full:
                self._count_denied("address", "(any)", None, f"more than {MAX_CONNECTIONS} connections at once")
                _reset(conn)
                continue
            if not _budget.take(self._key, FDS_PER_CONNECTION):
                self._count_denied("address", "(any)", None, "the host process's share of descriptors is in "
                                   "use (RLIMIT_NOFILE)")
                _reset(conn)
                continue
            with self._lock:
                self._sockets.add(conn)
            if not self._spawn(self._serve, conn):
                self._forget(conn)
                _budget.give(self._key, FDS_PER_CONNECTION)
                _reset(conn)

    def _forget(self, sock: socket.socket) -> None:
        with self._lock:
            self._sockets.discard(sock)

    # --- connections ----------------------------------------------------------------------------------

    def _serve(self, conn: socket.socket) -> None:
        reset = True
        try:
            conn.setblocking(True)
            local = conn.getsockname()
            address, port = _plain_address(str(local[0])), int(local[1])
            if address == DNS_ADDRESS and port == self._dns_port:
                self._serve_dns_tcp(conn)
                reset = False
            elif address == PROXY_ADDRESS and port == self._proxy_port:
                reset = self._serve_http(conn)
            else:
                reset = self._serve_transparent(conn, address, port)
        finally:
            self._forget(conn)
            if reset:
                _reset(conn)
            else:
                conn.close()
            _budget.give(self._key, FDS_PER_CONNECTION)

    def _serve_dns_tcp(self, conn: socket.socket) -> None:
        while not self._closed:
            conn.settimeout(self.head_timeout)
            try:
                length = struct.unpack("!H", _recv_exact(conn, 2))[0]
                message = _recv_exact(conn, length)
            except (OSError, EOFError):
                return
            reply = self.answer_dns(message)
            if reply is None:
                return
            conn.sendall(struct.pack("!H", len(reply)) + reply)

    def _check(self, host: str, port: int) -> str:
        """The allowed name for ``host`` (a name, or one of our fake addresses); _Denied otherwise."""
        try:
            ipaddress.ip_address(host)
        except ValueError:
            pass
        else:
            name = self.address_name(host)
            if name is None:
                reason = "an address, not an allowed name"
                self._count_denied("address", _plain_address(host), port, reason)
                raise _Denied(reason, 403, f"isolate: {host} is an address, not a name; name it with "
                                           f"--add-host NAME:{host} (add_hosts) and allow NAME")
            host = name
        try:
            name = normalize_name(host, "proxy")
        except PolicyError as exc:
            self._count_denied("host", host[:MAX_SHOWN_NAME], port, NOT_A_NAME)
            raise _Denied(NOT_A_NAME, 400, f"isolate: {exc}") from None
        ports = self.rules.ports_of(name)
        if port not in ports:
            reason = NOT_ALLOWED if not ports else "port not allowed"
            self._count_denied("host", name, port, reason)
            raise _Denied(reason, 403, f"isolate: {name}:{port} is not on the allow-list; allow it with "
                                       f"--allow-host {name}:{port} (isolate.Egress([\"{name}:{port}\"]))")
        return name

    def _connect(self, name: str, port: int) -> socket.socket:
        """A connection to an allowed name's real address; _Denied (with the proxy's status) otherwise."""
        resolution = self.resolver.resolve(name)
        if not resolution.addresses:
            if resolution.refused:
                self._count_denied("host", name, port, resolution.error)
                raise _Denied(resolution.error, 403, f"isolate: {resolution.error}")
            self._count_failed(name, port, resolution.error)
            raise _Denied(resolution.error, 502, f"isolate: {resolution.error}")
        deadline = time.monotonic() + self.connect_timeout
        failure = "no address"
        for address in resolution.addresses:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                break
            family = socket.AF_INET6 if ":" in address else socket.AF_INET
            upstream = socket.socket(family, socket.SOCK_STREAM)
            with self._lock:
                if self._closed:
                    upstream.close()
                    raise _Denied("closing", 502, "isolate: the sandbox is closing")
                self._sockets.add(upstream)
            try:
                upstream.settimeout(remaining)
                upstream.connect((address, port))
                upstream.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
                return upstream
            except OSError as exc:
                failure = f"{address}:{port}: {exc.strerror or exc}"
                self._forget(upstream)
                upstream.close()
        self._count_failed(name, port, f"cannot connect: {failure}")
        raise _Denied(failure, 502, f"isolate: cannot connect to {name}:{port} ({failure})")

    def _serve_transparent(self, conn: socket.socket, address: str, port: int) -> bool:
        name = self.address_name(address)
        if name is None:
            self._count_denied("address", address, port, "an address, not an allowed name")
            return True
        if not self.rules.allows(name, port):
            self._count_denied("host", name, port, NOT_ALLOWED if not self.rules.ports_of(name)
                               else "port not allowed")
            return True
        vault = self.vault
        if vault is not None and vault.binds(name, port):
            return self._serve_http(conn, (name, port))
        try:
            upstream = self._connect(name, port)
        except _Denied:
            return True
        self._count_allowed(name, port)
        try:
            if not self._track(name, port, conn, upstream):
                return True  # its rule was removed meanwhile
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            relay(conn, upstream, self._workers.submit)
        finally:
            self._untrack(upstream)
            self._forget(upstream)
            upstream.close()
        return False

    def _serve_http(self, conn: socket.socket, bound: tuple[str, int] | None = None) -> bool:
        """One request; False when the connection may close normally. Proxied (CONNECT, or plain HTTP), or,
        with ``bound``, plain HTTP sent straight to a name:port a vault binding covers (read, to inject)."""
        try:
            head, rest = http.read_head(conn, self.head_timeout)
            request = http.parse_head(head)
            framing: tuple[str, int] | None = None
            path = ""
            if bound is not None:
                name, port = bound
                path = http.origin_target(request)
                framing = http.body_framing(request)
            elif request.method == "CONNECT":
                host, port = http.split_authority(request.target, None)
                name = self._check(host, port)
            else:
                host, port, path = http.absolute_target(request)
                framing = http.body_framing(request)
                name = self._check(host, port)
            upstream = self._connect(name, port)
        except OSError:  # the client left, or a socket failed
            return True
        except http.HTTPError as exc:
            _send_quietly(conn, http.response(exc.status, f"isolate: {exc.reason}"))
            return False
        except _Denied as exc:
            _send_quietly(conn, http.response(exc.status, exc.message))
            return False
        self._count_allowed(name, port)
        if framing is not None:
            return self._forward_request(conn, upstream, name, port, request, path, rest, framing)
        try:
            if not self._track(name, port, conn, upstream):
                _send_quietly(conn, http.response(403, f"isolate: {name}:{port} is no longer on the allow-list"))
                return False
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            conn.sendall(b"HTTP/1.1 200 Connection established\r\n\r\n")
            if rest:
                upstream.sendall(rest)
            relay(conn, upstream, self._workers.submit)
            return False
        except OSError:
            return True
        finally:
            self._untrack(upstream)
            self._forget(upstream)
            upstream.close()

    def _forward_request(self, conn: socket.socket, upstream: socket.socket, name: str, port: int,
                         request: http.Request, path: str, rest: bytes, framing: tuple[str, int]) -> bool:
        """One plain-HTTP request to name:port, with the vault's headers where a binding matches it."""
        try:
            if not self._track(name, port, conn, upstream):
                _send_quietly(conn, http.response(403, f"isolate: {name}:{port} is no longer on the allow-list"))
                return False
            conn.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            vault = self.vault
            names = [header for header, _ in request.headers]
            inject = vault.headers_for("http", name, port, request.method, path, names) if vault is not None else []
            body = http.BodyReader(conn, rest, BODY_IDLE_TIMEOUT)
            form = bytearray()
            if inject and form_may_override(request.method, request.headers) and \
                    vault is not None and vault.override_widens("http", name, port, path, names, inject):
                # A form a framework may take another method from (``_method``), to a request the bindings
                # do not allow: read whole before injecting.
                kind, length = framing
                if kind == "chunked" or length > MAX_FORM_BODY:
                    inject = []
                else:
                    while len(form) < length:
                        form += body.take(length - len(form))
                    framing = ("length", 0)  # the body is read: forwarded below, after the head
                    if form_overrides(form):
                        inject = []
            host_header = name if port == 80 else f"{name}:{port}"
            upstream.sendall(http.forward_head(request, host_header, path, inject) + bytes(form))
            return self._relay_one_request(conn, upstream, body, framing, trailers=not inject)
        except OSError:
            return True
        finally:
            self._untrack(upstream)
            self._forget(upstream)
            upstream.close()

    def _relay_one_request(self, conn: socket.socket, upstream: socket.socket, body: http.BodyReader,
                           framing: tuple[str, int], trailers: bool = True) -> bool:
        """The request's body up, the whole response down; nothing the client sends after is forwarded."""
        down_done = threading.Event()

        def down() -> None:
            try:
                upstream.settimeout(None)
                conn.sendall(http.close_response_head(upstream))
                while True:
                    data = upstream.recv(1 << 20)
                    if not data:
                        break
                    conn.sendall(data)
                conn.shutdown(socket.SHUT_WR)
            except OSError:
                for sock in (conn, upstream):
                    try:
                        sock.shutdown(socket.SHUT_RDWR)
                    except OSError:
                        pass
            finally:
                down_done.set()

        thread = threading.Thread(target=down, daemon=True, name="isolate-egress-http")
        thread.start()
        try:
            http.copy_body(body, framing, upstream, trailers)
        except (OSError, http.HTTPError):
            try:
                upstream.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass
        thread.join()
        _drain(conn)
        return False


def _send_quietly(sock: socket.socket, data: bytes) -> None:
    try:
        sock.settimeout(5.0)
        sock.sendall(data)
        sock.shutdown(socket.SHUT_WR)
    except OSError:
        return
    _drain(sock)


def _drain(sock: socket.socket) -> None:
    """Read what the client still sends, for a moment, before closing.

    Closing a socket with unread input resets the connection, and the client
    then loses the answer it has not read yet. What is read here (a request
    body, a second request) goes nowhere.
    """
    deadline = time.monotonic() + 1.0
    try:
        for _ in range(64):
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                return
            sock.settimeout(remaining)
            if not sock.recv(65536):
                return
    except OSError:
        pass


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise EOFError
        data += chunk
    return bytes(data)
