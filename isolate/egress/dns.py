"""DNS messages: the few the mediator reads and writes, and the real lookups behind them.

The mediator's DNS server answers one question per query (as every stub
resolver asks). It parses a query strictly (a malformed one gets FORMERR or
nothing), and builds answers itself: an allowed name's A record is its fake
address, never its real one. The real addresses are looked up here too:
``add_hosts`` first, else the resolver the policy names (asked over UDP,
then TCP when the answer is truncated), else the host's own resolver.
"""

from __future__ import annotations

import ipaddress
import os
import socket
import struct
import threading
import time
from dataclasses import dataclass

from ..model.egress_rules import EgressRules, is_public

TYPE_A = 1
TYPE_CNAME = 5
TYPE_AAAA = 28
CLASS_IN = 1

NOERROR = 0
FORMERR = 1
SERVFAIL = 2
NXDOMAIN = 3
NOTIMP = 4
REFUSED = 5

#: TTL of the fake addresses the mediator hands out: short, so that a program asks again soon.
ANSWER_TTL = 5
#: Real addresses are kept at most this long (and at least MIN_CACHE), whatever the TTL says.
MAX_CACHE = 60.0
MIN_CACHE = 5.0
#: How long a failed lookup is remembered.
NEGATIVE_CACHE = 5.0
#: A bound on the names whose real addresses are kept.
MAX_CACHED_NAMES = 4096
UPSTREAM_TIMEOUT = 2.0
UPSTREAM_TRIES = 2


class DNSError(Exception):
    """A message that is not a well-formed DNS message of the kind expected."""


@dataclass(frozen=True)
class Query:
    id: int
    flags: int
    name: str            # lower case, no final dot
    qtype: int
    qclass: int
    question: bytes      # the question section as received, echoed in the answer

    @property
    def recursion_desired(self) -> bool:
        return bool(self.flags & 0x0100)


def _read_name(data: bytes, offset: int) -> tuple[str, int]:
    """The name at ``offset`` (following compression pointers) and the offset after it."""
    labels: list[str] = []
    end = -1
    jumps = 0
    total = 0
    while True:
        if offset >= len(data):
            raise DNSError("name runs past the message")
        length = data[offset]
        if length & 0xC0 == 0xC0:
            if offset + 1 >= len(data):
                raise DNSError("truncated compression pointer")
            if end < 0:
                end = offset + 2
            jumps += 1
            if jumps > 32:
                raise DNSError("compression loop")
            offset = ((length & 0x3F) << 8) | data[offset + 1]
            continue
        if length & 0xC0:
            raise DNSError("unknown label type")
        offset += 1
        if length == 0:
            break
        label = data[offset:offset + length]
        if len(label) != length:
            raise DNSError("label runs past the message")
        total += length + 1
        if total > 255:
            raise DNSError("name too long")
        if b"." in label:
            # "a.b" as one label is not the name a.b: checking one and resolving the other is a bypass.
            raise DNSError("a dot inside a label")
        labels.append(label.decode("ascii", "replace").lower())
        offset += length
    return ".".join(labels), (end if end >= 0 else offset)


def encode_name(name: str) -> bytes:
    out = bytearray()
    for label in name.rstrip(".").split("."):
        raw = label.encode("ascii")
        if not 0 < len(raw) < 64:
            raise DNSError(f"bad label in {name!r}")
        out += bytes((len(raw),)) + raw
    return bytes(out + b"\0")


def parse_query(data: bytes) -> Query:
    """A standard query with exactly one question; DNSError otherwise."""
    if len(data) < 12:
        raise DNSError("shorter than a header")
    ident, flags, qdcount = struct.unpack_from("!HHH", data)
    if flags & 0x8000:
        raise DNSError("a response, not a query")
    if qdcount != 1:
        raise DNSError(f"{qdcount} questions")
    name, end = _read_name(data, 12)
    if end + 4 > len(data):
        raise DNSError("question runs past the message")
    qtype, qclass = struct.unpack_from("!HH", data, end)
    return Query(ident, flags, name, qtype, qclass, data[12:end + 4])


def error_response(data: bytes, rcode: int) -> bytes | None:
    """A header-only answer to a message we cannot parse (None when not even its id is there)."""
    if len(data) < 12:
        return None
    ident, flags = struct.unpack_from("!HH", data)
    if flags & 0x8000:
        return None  # never answer a response (a reflection loop)
    return struct.pack("!HHHHHH", ident, 0x8000 | (flags & 0x7900) | 0x0080 | rcode, 0, 0, 0, 0)


def build_response(query: Query, rcode: int, addresses: tuple[str, ...] = (), ttl: int = ANSWER_TTL) -> bytes:
    """The answer to ``query``: ``addresses`` as A records of the question's name."""
    # QR, opcode 0, AA, the client's RD, RA, the rcode.
    flags = 0x8000 | 0x0400 | (query.flags & 0x0100) | 0x0080 | rcode
    out = bytearray(struct.pack("!HHHHHH", query.id, flags, 1, len(addresses), 0, 0))
    out += query.question
    for address in addresses:
        # 0xC00C: a pointer to the question's name, right after the header.
        out += struct.pack("!HHHIH", 0xC00C, TYPE_A, CLASS_IN, ttl, 4) + socket.inet_aton(address)
    return bytes(out)


def build_query(ident: int, name: str, qtype: int) -> bytes:
    return struct.pack("!HHHHHH", ident, 0x0100, 1, 0, 0, 0) + encode_name(name) + struct.pack("!HH", qtype, CLASS_IN)


@dataclass(frozen=True)
class Answer:
    rcode: int
    truncated: bool
    records: tuple[tuple[str, int], ...]   # (address, ttl) of the A and AAAA records for the name


def parse_response(data: bytes, ident: int, name: str, qtype: int) -> Answer:
    """A resolver's answer to our query for ``name``: its A/AAAA records, CNAME chains followed."""
    if len(data) < 12:
        raise DNSError("shorter than a header")
    got_id, flags, qdcount, ancount = struct.unpack_from("!HHHH", data)
    if got_id != ident or not flags & 0x8000:
        raise DNSError("not the answer to our query")
    truncated = bool(flags & 0x0200)
    name = name.lower().rstrip(".")
    offset = 12
    for _ in range(qdcount):
        qname, offset = _read_name(data, offset)
        offset += 4
        if qname != name:
            raise DNSError("answer to another question")
    owners = {name}
    found: list[tuple[str, str, int]] = []
    cnames: list[tuple[str, str]] = []
    for _ in range(ancount):
        if truncated and offset >= len(data):
            break
        owner, offset = _read_name(data, offset)
        if offset + 10 > len(data):
            raise DNSError("record runs past the message")
        rtype, rclass, ttl, rdlength = struct.unpack_from("!HHIH", data, offset)
        offset += 10
        rdata = data[offset:offset + rdlength]
        if len(rdata) != rdlength:
            raise DNSError("record data runs past the message")
        if rclass == CLASS_IN:
            if rtype == TYPE_CNAME:
                target, _ = _read_name(data, offset)
                cnames.append((owner, target))
            elif rtype == qtype == TYPE_A and rdlength == 4:
                found.append((owner, socket.inet_ntop(socket.AF_INET, rdata), ttl))
            elif rtype == qtype == TYPE_AAAA and rdlength == 16:
                found.append((owner, socket.inet_ntop(socket.AF_INET6, rdata), ttl))
        offset += rdlength
    for _ in range(len(cnames)):   # a chain, in whatever order the records came
        for owner, target in cnames:
            if owner in owners:
                owners.add(target)
    return Answer(flags & 0x000F, truncated,
                  tuple((address, ttl) for owner, address, ttl in found if owner in owners))


# --- real lookups ------------------------------------------------------------------------------


@dataclass(frozen=True)
class Resolution:
    """What a name resolves to for the sandbox: addresses to connect to, or why none."""

    addresses: tuple[str, ...] = ()
    error: str = ""          # "" when addresses are given
    refused: bool = False    # True: a policy refusal (the rebinding guard), not a lookup failure


def _kind(address: str) -> str:
    ip = ipaddress.ip_address(address)
    if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
        ip = ip.ipv4_mapped
    if ip.is_loopback:
        return "a loopback address"
    if ip.is_link_local:
        return "a link-local address"
    if ip.is_private:
        return "a private address"
    return "not a public address"


class Resolver:
    """Real lookups for allowed names, with a small cache."""

    def __init__(self, rules: EgressRules, *, timeout: float = UPSTREAM_TIMEOUT) -> None:
        self.rules = rules
        self.timeout = timeout
        self._lock = threading.Lock()
        self._cache: dict[str, tuple[float, Resolution]] = {}

    def resolve(self, name: str) -> Resolution:
        static = self.rules.static_addresses(name)
        if static:
            return Resolution(static)
        now = time.monotonic()
        with self._lock:
            cached = self._cache.get(name)
            if cached is not None and cached[0] > now:
                return cached[1]
        resolution, ttl = self._lookup(name)
        with self._lock:
            if len(self._cache) >= MAX_CACHED_NAMES:
                for key in [k for k, (expiry, _) in self._cache.items() if expiry <= now] or list(self._cache)[:1]:
                    del self._cache[key]
            self._cache[name] = (time.monotonic() + ttl, resolution)
        return resolution

    def _lookup(self, name: str) -> tuple[Resolution, float]:
        try:
            if self.rules.resolver is not None:
                records = self._ask_upstream(name)
            else:
                records = self._ask_host(name)
        except OSError as exc:
            return Resolution(error=f"{name} does not resolve ({exc.strerror or exc})"), NEGATIVE_CACHE
        except DNSError as exc:
            return Resolution(error=f"{name} does not resolve (bad answer from the resolver: {exc})"), NEGATIVE_CACHE
        if not records:
            return Resolution(error=f"{name} does not resolve"), NEGATIVE_CACHE
        ttl = min(MAX_CACHE, max(MIN_CACHE, float(min(ttl for _, ttl in records))))
        addresses = tuple(dict.fromkeys(address for address, _ in records))
        if self.rules.allow_private:
            return Resolution(addresses), ttl
        public = tuple(address for address in addresses if is_public(address))
        if public:
            return Resolution(public), ttl
        first = addresses[0]
        return Resolution(error=f"{name} resolves to {first}, {_kind(first)}; allow_private=True / "
                                f"--allow-private lets it through", refused=True), ttl

    def _ask_host(self, name: str) -> list[tuple[str, int]]:
        try:
            infos = socket.getaddrinfo(name, None, type=socket.SOCK_STREAM)
        except socket.gaierror as exc:
            if exc.errno in (socket.EAI_NONAME, getattr(socket, "EAI_NODATA", socket.EAI_NONAME)):
                return []
            raise OSError(exc.errno, exc.strerror) from None
        # getaddrinfo gives no TTL: keep the answer the shortest time.
        ipv4 = [str(info[4][0]) for info in infos if info[0] == socket.AF_INET]
        ipv6 = [str(info[4][0]).partition("%")[0] for info in infos if info[0] == socket.AF_INET6]
        return [(address, int(MIN_CACHE)) for address in ipv4 + ipv6]

    def _ask_upstream(self, name: str) -> list[tuple[str, int]]:
        assert self.rules.resolver is not None
        server = self.rules.resolver
        records: list[tuple[str, int]] = []
        failures: list[str] = []
        names_exist = False
        for qtype in (TYPE_A, TYPE_AAAA):
            try:
                answer = self._query(server, name, qtype)
            except (OSError, DNSError) as exc:
                failures.append(str(exc) or type(exc).__name__)
                continue
            if answer.rcode == NOERROR:
                names_exist = True
                records.extend(answer.records)
            elif answer.rcode != NXDOMAIN:
                failures.append(f"rcode {answer.rcode}")
        if not records and not names_exist and len(failures) == 2:
            raise OSError(0, f"resolver {server[0]}:{server[1]}: {failures[0]}")
        return records

    def _query(self, server: tuple[str, int], name: str, qtype: int) -> Answer:
        family = socket.AF_INET6 if ":" in server[0] else socket.AF_INET
        ident = int.from_bytes(os.urandom(2), "big")
        message = build_query(ident, name, qtype)
        with socket.socket(family, socket.SOCK_DGRAM) as udp:
            udp.settimeout(self.timeout)
            udp.connect(server)   # a connected socket takes datagrams from the server only
            answer: Answer | None = None
            for _ in range(UPSTREAM_TRIES):
                udp.send(message)
                deadline = time.monotonic() + self.timeout
                try:
                    while answer is None:
                        udp.settimeout(max(0.01, deadline - time.monotonic()))
                        data = udp.recv(65535)
                        try:
                            answer = parse_response(data, ident, name, qtype)
                        except DNSError:
                            continue   # someone else's datagram, or garbage: wait for ours
                except TimeoutError:
                    continue
                break
        if answer is None:
            raise OSError(0, "no answer")
        if not answer.truncated:
            return answer
        with socket.create_connection(server, timeout=self.timeout) as tcp:
            tcp.sendall(struct.pack("!H", len(message)) + message)
            length = struct.unpack("!H", _recv_exact(tcp, 2))[0]
            return parse_response(_recv_exact(tcp, length), ident, name, qtype)


def _recv_exact(sock: socket.socket, n: int) -> bytes:
    data = bytearray()
    while len(data) < n:
        chunk = sock.recv(n - len(data))
        if not chunk:
            raise OSError(0, "connection closed")
        data += chunk
    return bytes(data)
