"""The credential vault: secrets the mediator adds to a sandbox's outgoing plain-HTTP requests.

A credential is a named secret; a binding says which requests get which
credentials, as which headers (``bearer``: ``Authorization: Bearer V``;
``basic``: ``Authorization: Basic V``, V already base64; ``apiKey``: a
header of its name; ``customHeaders``: several). The values live in the
host process only: the sandbox never sees them, the vault's state lists
names and revisions, never values, and nothing here logs or reports them.

Only plain HTTP is injected. A CONNECTed or transparent TLS connection stays
end to end: adding a header to it would mean terminating the sandbox's TLS
with a certificate authority it trusts (upstream's design, a MITM), which
isolate does not do; a binding for ``https`` is refused, saying so.

A request is injected when its scheme, port, host, method and path all match
a binding. Its host is the name the mediator connects to (the allow-listed
name, never the request's Host header, which is rewritten to it), so a
credential goes only to the hosts its binding names. A request an origin
server may read as another is not injected: a path with dot segments, an
empty segment (``//``, merged by many servers), a ``;`` (a path parameter:
Tomcat reads ``/a/..;/b`` as ``/b``), a fragment, a backslash, a control,
space or non-ASCII character, a malformed escape (``%u002e``) or an escape
of a character that servers decode and then route on (``%2e``, ``%2f``,
``%5c``, ``%3b``, ``%25`` (a double encoding), ``%00``, ``%c0``...); a
method that is not an ASCII token; a request carrying a header (or a query
parameter, ``_method``) that frameworks read as another method or path
(``X-HTTP-Method-Override``, ``X-Original-URL``..., any spelling with ``_``).
A POST whose body frameworks read as a form (url-encoded, multipart, or no
type, as Rack reads one), where an override to another method would reach a
request the bindings do not allow, is read whole first, up to
``MAX_FORM_BODY``: one that names ``_method`` or such a header anywhere, a
larger one and a chunked one are not injected (``form_overrides``).
The sandbox's own headers of an injected name are removed, so it cannot add
a second value.

The vault is changed as a whole (a revision at a time, under a lock) and read
as an immutable table, so the mediator's threads never see half a change.
"""

from __future__ import annotations

import fnmatch
import re
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any
from urllib.parse import unquote

from ..model.errors import IsolationError

#: At most this many credentials and bindings, and this long a value: a vault is a handful of tokens.
MAX_CREDENTIALS = 256
MAX_BINDINGS = 256
MAX_VALUE = 16 * 1024
MAX_NAME = 253
#: A header name (RFC 9110 token), as the spec's pattern.
_TOKEN = re.compile(r"^[A-Za-z0-9!#$%&'*+\-.^_`|~]+$")
#: A method (a token) and a host name or leftmost-label wildcard.
_HOST = re.compile(r"^(\*\.)?([a-z0-9]([-a-z0-9]*[a-z0-9])?\.)*[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
#: Headers whose value decides how a request is framed or routed: a binding may not set them.
_RESERVED = frozenset({"host", "content-length", "transfer-encoding", "connection", "keep-alive", "te", "trailer",
                       "upgrade", "proxy-authorization", "proxy-connection", "expect"})
_DEFAULT_METHODS = ("GET", "POST", "PUT", "PATCH", "DELETE")
_DEFAULT_PORTS = {"http": 80, "https": 443}
_AUTH_TYPES = ("bearer", "basic", "apiKey", "customHeaders")


class VaultError(IsolationError):
    """A vault request refused: ``kind`` is "invalid" (400), "missing" (404) or "conflict" (409)."""

    def __init__(self, kind: str, message: str) -> None:
        super().__init__(message)
        self.kind = kind


@dataclass(frozen=True)
class Credential:
    name: str
    value: str = field(repr=False)
    revision: int


@dataclass(frozen=True)
class Binding:
    name: str
    revision: int
    schemes: tuple[str, ...]
    ports: tuple[int, ...]
    hosts: tuple[str, ...]
    methods: tuple[str, ...]
    paths: tuple[str, ...]
    auth_type: str
    api_key_name: str | None
    #: (header name, credential name), in order.
    headers: tuple[tuple[str, str], ...]

    def matches(self, scheme: str, host: str, port: int, method: str, path: str) -> bool:
        return (scheme in self.schemes and port in self.ports and method.upper() in self.methods
                and any(_host_matches(pattern, host) for pattern in self.hosts)
                and any(fnmatch.fnmatchcase(path, pattern) for pattern in self.paths))


def _host_matches(pattern: str, host: str) -> bool:
    if pattern.startswith("*."):
        label, _, rest = host.partition(".")
        return bool(label) and rest == pattern[2:]
    return host == pattern


#: What a path may hold literally (RFC 3986 pchar and "/", without ";": a path parameter, which servers strip).
_PATH_CHARS = re.compile(r"[A-Za-z0-9\-._~!$&'()*+,=:@/%]*")
#: Escapes a server may decode before it routes, reading another path: ".", "/", "\\", ";", "?", "#", "%" (a
#: double encoding), a control, and the lead bytes of overlong UTF-8 forms of those ("%c0%ae" is "." to some).
_UNSAFE_ESCAPES = frozenset({0x2E, 0x2F, 0x5C, 0x3B, 0x3F, 0x23, 0x25, 0x7F, 0xC0, 0xC1, *range(0x20)})
_ESCAPE = re.compile(r"%(.{0,2})", re.S)
#: Request headers frameworks read as the request's method or path (a binding's method or path would be moot).
_OVERRIDES = frozenset({"x-http-method-override", "x-http-method", "x-method-override", "x-original-url",
                        "x-rewrite-url", "x-original-uri", "x-override-url"})


def _spelled(name: str) -> str:
    """A header or parameter name as servers compare it: lower case, "_" as "-" (CGI's HTTP_X_...)."""
    return name.lower().replace("_", "-")


def _overriding_query(query: str) -> bool:
    """Whether the query names a method override (Rails', Laravel's ``_method``, or a header's name)."""
    for item in query.split("&"):
        name = _spelled(unquote(item.partition("=")[0]))
        if name in _OVERRIDES or name == "-method":
            return True
    return False


#: Bodies whose fields frameworks read as the method (Rack's MethodOverride and Symfony take ``_method`` from a
#: POST's form, url-encoded or multipart): the mediator reads such a body before it injects.
FORM_TYPES = frozenset({"application/x-www-form-urlencoded", "multipart/form-data"})
#: The methods an override can name that do more than the POST it rides on may (read, replace, delete).
OVERRIDE_METHODS = ("GET", "PUT", "PATCH", "DELETE")
#: The largest form body read before injecting; a larger or chunked one is not injected.
MAX_FORM_BODY = 1 << 20


def form_may_override(method: str, headers: Sequence[tuple[str, str]]) -> bool:
    """Whether the request's body is a form a framework may take another method from (a POST's form)."""
    if method != "POST":
        return False
    types = [value.split(";", 1)[0].strip().lower() for name, value in headers if name.lower() == "content-type"]
    return len(types) != 1 or types[0] in FORM_TYPES  # none, or two (servers take either): as a form


def form_overrides(body: bytes | bytearray) -> bool:
    """Whether a form body may name a method override: ``_method`` or an override header's name anywhere in it,
    in any case, "_" or "-", once or twice percent-encoded (not only as a field's name: a multipart part's
    name, a nested key ``a[_method]``, all count)."""
    text = body.decode("latin-1")
    for _ in range(3):
        text = unquote(text.replace("+", " "), encoding="latin-1")
    spelled = _spelled(text)
    return "-method" in spelled or any(name in spelled for name in _OVERRIDES)


def _ambiguous(path: str) -> bool:
    """A path an origin server may read as another (see the module's text): never injected."""
    if not _PATH_CHARS.fullmatch(path):
        return True   # ";", "#", "\\", controls, spaces, non-ASCII...
    for escape in _ESCAPE.finditer(path):
        digits = escape[1]
        if len(digits) != 2 or not all(c in "0123456789abcdefABCDEF" for c in digits) or \
                int(digits, 16) in _UNSAFE_ESCAPES:
            return True
    segments = path.split("/")
    if segments[0] != "" or any(segment in (".", "..") for segment in segments):
        return True
    return any(segment == "" for segment in segments[1:-1])   # "//": many servers merge it


def _text(value: object, what: str, *, most: int = MAX_NAME) -> str:
    if not isinstance(value, str) or not value.strip():
        raise VaultError("invalid", f"{what}: expected a non-empty string")
    if len(value) > most:
        raise VaultError("invalid", f"{what}: longer than {most} characters")
    return value


def _header_value(value: object, what: str) -> str:
    text = _text(value, what, most=MAX_VALUE)
    # A CR or LF would end the header and start another (a request smuggled by the vault itself).
    if any((ord(c) < 0x20 and c != "\t") or ord(c) == 0x7F or ord(c) > 0xFF for c in text):
        raise VaultError("invalid", f"{what}: a header value cannot hold control characters or characters "
                                    "beyond Latin-1")
    return text


def _list(value: object, what: str, most: int = 64) -> list[Any]:
    if not isinstance(value, list) or len(value) > most:
        raise VaultError("invalid", f"{what}: expected a list (at most {most} entries)")
    return value


def _fields(obj: object, what: str, allowed: set[str], required: set[str]) -> Mapping[str, Any]:
    if not isinstance(obj, Mapping):
        raise VaultError("invalid", f"{what}: expected an object")
    unknown = sorted(set(obj) - allowed)
    if unknown:
        raise VaultError("invalid", f"{what}.{unknown[0]}: unknown field")
    for name in sorted(required):
        if obj.get(name) is None:
            raise VaultError("invalid", f"{what}.{name}: required")
    return obj


def parse_credential(obj: object, what: str, revision: int) -> Credential:
    body = _fields(obj, what, {"name", "source"}, {"name", "source"})
    name = _text(body["name"], f"{what}.name")
    source = _fields(body["source"], f"{what}.source", {"type", "value"}, {"value"})
    if source.get("type", "inline") != "inline":
        raise VaultError("invalid", f"{what}.source.type: only inline credentials are served here")
    return Credential(name, _header_value(source["value"], f"{what} ({name}): its value"), revision)


def parse_binding(obj: object, what: str, revision: int) -> Binding:
    body = _fields(obj, what, {"name", "match", "auth"}, {"name", "match", "auth"})
    name = _text(body["name"], f"{what}.name")
    where = f"{what} ({name})"
    match = _fields(body["match"], f"{where}.match", {"schemes", "ports", "hosts", "methods", "paths"}, {"hosts"})
    schemes = tuple(_list(match.get("schemes") or ["https"], f"{where}.match.schemes"))
    for scheme in schemes:
        if scheme == "https":
            raise VaultError("invalid", f"{where}.match.schemes: https is not injected here: isolate does not "
                                        "intercept the sandbox's TLS (it stays end to end); bind the plain http "
                                        "endpoint, or give the program its credential another way")
        if scheme != "http":
            raise VaultError("invalid", f"{where}.match.schemes: expected http")
    ports: list[int] = []
    for port in _list(match.get("ports") or [_DEFAULT_PORTS[s] for s in schemes], f"{where}.match.ports"):
        if isinstance(port, bool) or not isinstance(port, int) or not 0 < port < 65536:
            raise VaultError("invalid", f"{where}.match.ports: {port!r} is not a port")
        ports.append(port)
    hosts: list[str] = []
    for host in _list(match["hosts"], f"{where}.match.hosts"):
        text = _text(host, f"{where}.match.hosts").lower().rstrip(".")
        if not _HOST.fullmatch(text):
            raise VaultError("invalid", f"{where}.match.hosts: {host!r} is not a host name or *.name")
        hosts.append(text)
    if not hosts:
        raise VaultError("invalid", f"{where}.match.hosts: at least one host")
    methods = [_text(m, f"{where}.match.methods").upper()
               for m in _list(match.get("methods") or list(_DEFAULT_METHODS), f"{where}.match.methods")]
    if not all(_TOKEN.fullmatch(m) for m in methods):
        raise VaultError("invalid", f"{where}.match.methods: not an HTTP method")
    paths = [_text(p, f"{where}.match.paths", most=2048) for p in _list(match.get("paths") or ["/*"],
                                                                          f"{where}.match.paths")]
    if not all(p.startswith("/") for p in paths):
        raise VaultError("invalid", f"{where}.match.paths: a path starts with /")
    auth = body["auth"]
    kind = auth.get("type") if isinstance(auth, Mapping) else None
    if kind not in _AUTH_TYPES:
        raise VaultError("invalid", f"{where}.auth.type: expected one of {', '.join(_AUTH_TYPES)} (passthrough "
                                    "and substitutions are not served here)")
    headers: list[tuple[str, str]]
    api_key_name = None
    if kind in ("bearer", "basic"):
        auth = _fields(auth, f"{where}.auth", {"type", "credential"}, {"credential"})
        headers = [("Authorization", _text(auth["credential"], f"{where}.auth.credential"))]
    elif kind == "apiKey":
        auth = _fields(auth, f"{where}.auth", {"type", "name", "credential"}, {"name", "credential"})
        api_key_name = _text(auth["name"], f"{where}.auth.name")
        headers = [(api_key_name, _text(auth["credential"], f"{where}.auth.credential"))]
    else:
        auth = _fields(auth, f"{where}.auth", {"type", "headers"}, {"headers"})
        entries = _list(auth["headers"], f"{where}.auth.headers")
        if not entries:
            raise VaultError("invalid", f"{where}.auth.headers: at least one header")
        headers = []
        for i, entry in enumerate(entries):
            item = _fields(entry, f"{where}.auth.headers[{i}]", {"name", "credential"}, {"name", "credential"})
            headers.append((_text(item["name"], f"{where}.auth.headers[{i}].name"),
                            _text(item["credential"], f"{where}.auth.headers[{i}].credential")))
    for header, _ in headers:
        if not _TOKEN.fullmatch(header):
            raise VaultError("invalid", f"{where}: {header!r} is not a header name")
        if header.lower() in _RESERVED:
            raise VaultError("invalid", f"{where}: the vault does not set {header} (it frames or routes the "
                                        "request)")
    if len({h.lower() for h, _ in headers}) != len(headers):
        raise VaultError("invalid", f"{where}: a header named twice")
    return Binding(name, revision, tuple(schemes), tuple(dict.fromkeys(ports)), tuple(dict.fromkeys(hosts)),
                   tuple(dict.fromkeys(methods)), tuple(dict.fromkeys(paths)), kind, api_key_name, tuple(headers))


@dataclass(frozen=True)
class _Table:
    revision: int
    credentials: Mapping[str, Credential]
    bindings: Mapping[str, Binding]


def _check_references(credentials: Mapping[str, Credential], bindings: Mapping[str, Binding]) -> None:
    if len(credentials) > MAX_CREDENTIALS or len(bindings) > MAX_BINDINGS:
        raise VaultError("invalid", f"at most {MAX_CREDENTIALS} credentials and {MAX_BINDINGS} bindings")
    for binding in bindings.values():
        for _, credential in binding.headers:
            if credential not in credentials:
                raise VaultError("conflict", f"binding {binding.name}: no credential {credential}")


def _named(items: Sequence[Any], what: str) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for item in items:
        if item.name in out:
            raise VaultError("conflict", f"{what} {item.name} is given twice")
        out[item.name] = item
    return out


class Vault:
    """A sandbox's credentials and bindings, a revision at a time; see the module's text."""

    def __init__(self, credentials: object, bindings: object) -> None:
        creds = [parse_credential(c, f"credentials[{i}]", 1)
                 for i, c in enumerate(_list(credentials, "credentials", MAX_CREDENTIALS))]
        binds = [parse_binding(b, f"bindings[{i}]", 1) for i, b in enumerate(_list(bindings, "bindings", MAX_BINDINGS))]
        table = _Table(1, _named(creds, "credential"), _named(binds, "binding"))
        _check_references(table.credentials, table.bindings)
        self._lock = threading.Lock()
        self._table = table

    @property
    def revision(self) -> int:
        return self._table.revision

    def patch(self, body: object) -> None:
        """Apply a CredentialVaultMutationRequest at once, or nothing of it (VaultError)."""
        request = _fields(body, "the request", {"expectedRevision", "credentials", "bindings"}, set())
        with self._lock:
            table = self._table
            expected = request.get("expectedRevision")
            if expected is not None and (isinstance(expected, bool) or not isinstance(expected, int)):
                raise VaultError("invalid", "expectedRevision: expected an integer")
            if expected is not None and expected != table.revision:
                raise VaultError("conflict", f"the vault is at revision {table.revision}, not {expected}")
            revision = table.revision + 1
            credentials = _mutate(dict(table.credentials), request.get("credentials"), "credentials",
                                  lambda obj, what: parse_credential(obj, what, revision))
            bindings = _mutate(dict(table.bindings), request.get("bindings"), "bindings",
                               lambda obj, what: parse_binding(obj, what, revision))
            _check_references(credentials, bindings)
            self._table = _Table(revision, credentials, bindings)

    def headers_for(self, scheme: str, host: str, port: int, method: str, path: str,
                    request_headers: Sequence[str] = ()) -> list[tuple[str, str]]:
        """The headers to add to this request (name, value): those of every binding that matches it.

        ``request_headers``: the names of the request's own headers (one that overrides its method or path
        means no injection)."""
        table = self._table
        target, _, query = path.partition("?")
        if not table.bindings or _ambiguous(target) or not _TOKEN.fullmatch(method) or not method.isascii() or \
                any(_spelled(name) in _OVERRIDES for name in request_headers) or _overriding_query(query):
            return []
        out: list[tuple[str, str]] = []
        for binding in table.bindings.values():
            if binding.matches(scheme, host, port, method, target):
                for header, credential in binding.headers:
                    value = table.credentials[credential].value
                    if binding.auth_type == "bearer":
                        value = "Bearer " + value
                    elif binding.auth_type == "basic":
                        value = "Basic " + value
                    if header.lower() not in {h.lower() for h, _ in out}:
                        out.append((header, value))
        return out

    def override_widens(self, scheme: str, host: str, port: int, path: str, request_headers: Sequence[str],
                        injected: Sequence[tuple[str, str]]) -> bool:
        """Whether a method override (a form's ``_method``) could take this request's credentials where the
        vault would not: some method it can name (``OVERRIDE_METHODS``) would be injected otherwise. When
        the bindings allow them all the same, the form need not be read."""
        return any(self.headers_for(scheme, host, port, method, path, request_headers) != list(injected)
                   for method in OVERRIDE_METHODS)

    def binds(self, host: str, port: int) -> bool:
        """Whether some binding may inject into plain HTTP to host:port (so its requests must be read)."""
        return any("http" in b.schemes and port in b.ports and any(_host_matches(p, host) for p in b.hosts)
                   for b in self._table.bindings.values())

    # --- the sanitized state (names and revisions; never a value) -----------------------------------

    def credentials(self) -> list[dict[str, Any]]:
        return [{"name": c.name, "sourceType": "inline", "revision": c.revision}
                for c in self._table.credentials.values()]

    def credential(self, name: str) -> dict[str, Any]:
        found = self._table.credentials.get(name)
        if found is None:
            raise VaultError("missing", f"no credential {name}")
        return {"name": found.name, "sourceType": "inline", "revision": found.revision}

    def bindings(self) -> list[dict[str, Any]]:
        return [_binding_metadata(b) for b in self._table.bindings.values()]

    def binding(self, name: str) -> dict[str, Any]:
        found = self._table.bindings.get(name)
        if found is None:
            raise VaultError("missing", f"no binding {name}")
        return _binding_metadata(found)

    def state(self) -> dict[str, Any]:
        table = self._table
        return {"revision": table.revision, "credentials": self.credentials(), "bindings": self.bindings()}


def _mutate(current: dict[str, Any], changes: object, what: str, parse: Any) -> dict[str, Any]:
    if changes is None:
        return current
    body = _fields(changes, what, {"add", "replace", "delete"}, set())
    for i, name in enumerate(_list(body.get("delete") or [], f"{what}.delete", MAX_BINDINGS)):
        if not isinstance(name, str) or name not in current:
            raise VaultError("missing", f"{what}.delete[{i}]: no such entry {name!r}")
        del current[name]
    for i, obj in enumerate(_list(body.get("replace") or [], f"{what}.replace", MAX_BINDINGS)):
        item = parse(obj, f"{what}.replace[{i}]")
        if item.name not in current:
            raise VaultError("missing", f"{what}.replace[{i}]: no such entry {item.name!r}")
        current[item.name] = item
    for i, obj in enumerate(_list(body.get("add") or [], f"{what}.add", MAX_BINDINGS)):
        item = parse(obj, f"{what}.add[{i}]")
        if item.name in current:
            raise VaultError("conflict", f"{what}.add[{i}]: {item.name!r} exists (replace it)")
        current[item.name] = item
    return current


def _binding_metadata(binding: Binding) -> dict[str, Any]:
    auth: dict[str, Any] = {"type": binding.auth_type}
    if binding.api_key_name is not None:
        auth["name"] = binding.api_key_name
    return {"name": binding.name, "revision": binding.revision,
            "match": {"schemes": list(binding.schemes), "ports": list(binding.ports), "hosts": list(binding.hosts),
                      "methods": list(binding.methods), "paths": list(binding.paths)},
            "auth": auth}
