"""Egress by name: the allow-list's grammar and the sandbox's address plan.

Pure data, imported by the policy model; nothing here opens a socket.

An allow-list entry is ``NAME``, ``NAME:PORT``, ``*.DOMAIN`` or
``*.DOMAIN:PORT``. Without a port, 80 and 443 are allowed (the web: package
indexes, APIs, git over HTTPS); any other port is named. ``*.github.com``
matches every name below github.com at any depth, not github.com itself.
Addresses are not names: to reach an address, name it with ``add_hosts``
(``--add-host NAME:IP``) and allow the name.

Inside the sandbox's own network namespace, isolate's mediator answers on
loopback addresses of the block ``127.77.0.0/16``:

- ``127.77.0.53`` port 53 (UDP and TCP): the DNS server; /etc/resolv.conf
  names it. An allowed name resolves to an address of its own in
  ``127.77.1.0`` and above, a denied one to NXDOMAIN.
- ``127.77.0.1`` port 3128: an HTTP proxy (CONNECT, and plain HTTP);
  ``http_proxy``/``https_proxy`` point at it.
- every other port of the allow-list, on every address: a connection to a
  name's address and an allowed port is relayed to that name (the
  transparent path, for programs that ignore proxy variables).
"""

from __future__ import annotations

import ipaddress
import re
import socket
from dataclasses import dataclass

from .errors import PolicyError

#: The loopback block the mediator answers on inside the sandbox.
BLOCK = ipaddress.IPv4Network("127.77.0.0/16")
DNS_ADDRESS = "127.77.0.53"
DNS_PORT = 53
PROXY_ADDRESS = "127.77.0.1"
PROXY_PORT = 3128
#: The first address handed to a name; names get consecutive addresses from here.
FIRST_NAME_ADDRESS = ipaddress.IPv4Address("127.77.1.0")
#: Ports allowed when an entry names none.
DEFAULT_PORTS: tuple[int, ...] = (80, 443)
#: Every allowed port is a listening socket inside the sandbox: a bound on them.
MAX_PORTS = 64
MAX_ENTRIES = 256

_LABEL = re.compile(r"^(?!-)[a-z0-9_-]{1,63}(?<!-)$")
#: An interface name after an IPv6 address's "%" (IFNAMSIZ - 1 at most, as the kernel's).
_SCOPE = re.compile(r"^[A-Za-z0-9_.-]{1,15}$")


def parse_port(text: str) -> int | None:
    """A port written in ASCII digits, 1 to 65535; None otherwise.

    ``str.isdigit`` is not enough: it accepts "\u00b2" (superscript two), which
    ``int`` then refuses with a ValueError, and other scripts' digits.
    """
    if not text.isascii() or not text.isdigit() or len(text) > 5:
        return None
    port = int(text)
    return port if 0 < port < 65536 else None


def _numeric_host(name: str) -> bool:
    """Whether the C resolver would read ``name`` as an IPv4 address ("127.1", "0x7f000001", "2130706433")."""
    try:
        socket.inet_aton(name)
    except OSError:
        return False
    return True


def normalize_name(text: str, what: str) -> str:
    """A DNS name in lower case without the final dot; PolicyError if it is none."""
    # ASCII before anything else: str.lower() makes "k" of the KELVIN SIGN (U+212A) and str.strip() drops
    # other scripts' spaces, so a name checked after them is not the name that was given.
    if not text.isascii():
        raise PolicyError(f"{what}: {text!r} is not an ASCII name; give its IDNA form (xn--...)", "network")
    name = text.strip().lower().rstrip(".")
    if not name or len(name) > 253 or not all(_LABEL.fullmatch(label) for label in name.split(".")):
        raise PolicyError(f"{what}: {text!r} is not a host name", "network")
    try:
        ipaddress.ip_address(name)
    except ValueError:
        if not _numeric_host(name):
            return name
    raise PolicyError(f"{what}: {text!r} is an address, not a name; name it with --add-host NAME:{name} "
                      "(add_hosts={NAME: ADDRESS}) and allow NAME", "network")


@dataclass(frozen=True)
class HostRule:
    """One allow-list entry: a name (or ``*.`` suffix) and its ports."""

    pattern: str                 # "pypi.org" or "*.github.com"
    ports: tuple[int, ...]

    @property
    def wildcard(self) -> bool:
        return self.pattern.startswith("*.")

    def matches(self, name: str) -> bool:
        if self.wildcard:
            return name.endswith(self.pattern[1:])
        return name == self.pattern

    def __str__(self) -> str:
        return self.pattern if len(self.ports) != 1 else f"{self.pattern}:{self.ports[0]}"


def parse_host_rule(text: str) -> HostRule:
    """``NAME[:PORT]`` or ``*.DOMAIN[:PORT]``; PolicyError naming the entry otherwise."""
    if not isinstance(text, str):
        raise PolicyError(f"network: expected HOST[:PORT] strings, got {type(text).__name__}", "network")
    if not text.isascii():  # before strip(), which drops other scripts' spaces
        raise PolicyError(f"network: {text!r} is not an ASCII name; give its IDNA form (xn--...)", "network")
    host, sep, port_text = text.strip().rpartition(":")
    if not sep:
        host, port_text = text.strip(), ""
    if "[" in host or ":" in host:
        raise PolicyError(f"network: {text!r} is an address, not a name; name it with --add-host NAME:IP and "
                          "allow NAME", "network")
    if sep and parse_port(port_text) is None:
        raise PolicyError(f"network: {text!r}: the port must be a number from 1 to 65535", "network")
    wildcard = host.startswith("*.")
    name = normalize_name(host[2:] if wildcard else host, "network")
    if wildcard and "." not in name:
        raise PolicyError(f"network: {text!r} would allow a whole top-level domain; name a domain under it",
                          "network")
    ports = (int(port_text),) if sep else DEFAULT_PORTS
    return HostRule(("*." if wildcard else "") + name, ports)


def parse_static_host(text: str) -> tuple[str, str]:
    """``NAME:IP`` (as Docker's --add-host; an IPv6 address may be bracketed)."""
    name, sep, address = text.partition(":")
    if not sep:
        raise PolicyError(f"network: --add-host {text!r} is not NAME:IP", "network")
    return normalize_name(name, "add_hosts"), parse_address(address.strip("[]"), f"add_hosts: {name}")


def parse_address(text: str, what: str) -> str:
    try:
        address = ipaddress.ip_address(text.strip())
    except ValueError:
        raise PolicyError(f"{what}: {text!r} is not an IP address", "network") from None
    # ipaddress takes any text after "%" as the scope (control characters included): only an interface name.
    scope = getattr(address, "scope_id", None)
    if scope is not None and not _SCOPE.fullmatch(scope):
        raise PolicyError(f"{what}: {text!r}: the part after % must be an interface name", "network")
    return str(address)


def parse_resolver(text: str) -> tuple[str, int]:
    """``IP`` or ``IP:PORT`` (``[IPv6]:PORT``): the DNS server the mediator asks."""
    text = text.strip()
    address, port = text, 53
    port_text: str | None = None
    if text.startswith("["):
        address, _, rest = text[1:].partition("]")
        if rest:
            if not rest.startswith(":"):
                raise PolicyError(f"network: resolver {text!r} is not IP[:PORT]", "network")
            port_text = rest[1:]
    elif text.count(":") == 1:
        address, _, port_text = text.partition(":")
    if port_text is not None:
        parsed = parse_port(port_text)
        if parsed is None:
            raise PolicyError(f"network: resolver {text!r}: the port must be a number from 1 to 65535", "network")
        port = parsed
    return parse_address(address, "network: resolver"), port


#: IPv6 prefixes that carry an IPv4 address in their last 32 bits, which a host or its network
#: turns into that IPv4 address: the well-known NAT64 prefix (RFC 6052; a DNS64/NAT64 network
#: reaches 64:ff9b::a00:5 at 10.0.0.5) and IPv4-translated addresses (SIIT, RFC 2765).
_EMBEDDING = (ipaddress.IPv6Network("64:ff9b::/96"), ipaddress.IPv6Network("::ffff:0:0:0/96"))
#: Global unicast IPv6 (RFC 4291): everything outside it (IPv4-compatible ::/96, site-local
#: fec0::/10, the local-use NAT64 prefix 64:ff9b:1::/48, unique local, link-local) is not public.
_GLOBAL_UNICAST = ipaddress.IPv6Network("2000::/3")


def is_public(address: str) -> bool:
    """Whether DNS may hand this address out for an allowed name (the rebinding guard).

    An IPv6 address that stands for an IPv4 one (mapped, NAT64, SIIT, 6to4) is
    judged by that IPv4 address: Python's ``is_global`` alone calls
    64:ff9b::a00:5 global, and a NAT64 network translates it to 10.0.0.5.
    """
    ip = ipaddress.ip_address(address.partition("%")[0])
    if isinstance(ip, ipaddress.IPv6Address):
        if ip.ipv4_mapped is not None:
            return is_public(str(ip.ipv4_mapped))
        if any(ip in net for net in _EMBEDDING):
            return is_public(str(ipaddress.IPv4Address(int(ip) & 0xFFFFFFFF)))
        if ip.sixtofour is not None:
            return is_public(str(ip.sixtofour))
        if ip not in _GLOBAL_UNICAST:
            return False
    return ip.is_global and not ip.is_multicast


@dataclass(frozen=True)
class EgressRules:
    """The allow-list, compiled: what the mediator and the listeners need."""

    rules: tuple[HostRule, ...]
    static_hosts: tuple[tuple[str, str], ...]     # (name, address), from add_hosts
    resolver: tuple[str, int] | None               # None: the host's own resolver
    allow_private: bool

    def ports_of(self, name: str) -> frozenset[int]:
        """The ports ``name`` may be reached on (empty: the name is not allowed)."""
        ports: set[int] = set()
        for rule in self.rules:
            if rule.matches(name):
                ports.update(rule.ports)
        return frozenset(ports)

    def allows(self, name: str, port: int) -> bool:
        return port in self.ports_of(name)

    def static_address(self, name: str) -> str | None:
        addresses = self.static_addresses(name)
        return addresses[0] if addresses else None

    def static_addresses(self, name: str) -> tuple[str, ...]:
        """Every address add_hosts gives ``name`` (as /etc/hosts lines: each is tried in turn)."""
        return tuple(address for static, address in self.static_hosts if static == name)

    @property
    def ports(self) -> tuple[int, ...]:
        """Every port a listener inside answers on: the allow-list's, DNS's and the proxy's."""
        ports = {DNS_PORT, PROXY_PORT}
        for rule in self.rules:
            ports.update(rule.ports)
        return tuple(sorted(ports))
