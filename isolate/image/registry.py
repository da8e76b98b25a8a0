"""Pulling from a registry that speaks the OCI distribution API: isolate's own small client.

Why its own, over the standard library's ``http.client``: the whole protocol
isolate needs is four requests (a manifest, a token, a blob, a redirect), and
what matters is control of each: a redirect to another host must never carry
the credentials (``urllib`` keeps the Authorization header across hosts), a
manifest past a few MiB is refused before it is read, a blob streams straight
into the layer's unpacking with its digest checked at the end (store.py). No
dependency is added to isolate for it; ``skopeo`` or ``oras`` would be a
process and a binary more on every host, for less control.

- References normalized as Docker does (reference.py); ``docker.io`` is
  served by ``registry-1.docker.io``.
- HTTPS, verified with the system's CAs (``SSL_CERT_FILE`` names others) and
  the registry's own, found as docker and podman find them: ``cert_dir=``
  (``--cert-dir``: its ``*.crt``), else the first of
  ``~/.config/containers/certs.d/HOST:PORT``, ``/etc/containers/certs.d/HOST:PORT``
  and ``/etc/docker/certs.d/HOST:PORT`` that exists (``*.crt``: CAs; a
  ``NAME.cert`` with its ``NAME.key``: a client certificate). A certificate
  not trusted is refused with one line naming the problem and where a CA
  goes; verification is never turned off, and a registry that speaks TLS is
  never tried again over plain HTTP. Plain HTTP only to a loopback registry
  or one named insecure (``insecure=True``, ``$ISOLATE_INSECURE_REGISTRIES``,
  comma-separated) that does not speak TLS.
- Auth: anonymous first; on 401 the challenge decides: ``Basic`` with the
  credentials found, or ``Bearer`` (a token from the realm, asked with them).
  Credentials come from ``$REGISTRY_AUTH_FILE``, the containers auth files
  (``$XDG_RUNTIME_DIR/containers/auth.json``,
  ``~/.config/containers/auth.json``) and ``$DOCKER_CONFIG/config.json``
  (``~/.docker/config.json``): ``auths``, then ``credHelpers`` /
  ``credsStore`` (``docker-credential-NAME get``), as docker and podman read
  them.
- Indexes and manifest lists: the host's platform is chosen.
- Layers download in parallel (four at a time: budget.PARALLEL, for the
  whole process), each streamed into its unpacking; one a store already
  holds is not fetched.
"""

from __future__ import annotations

import base64
import http.client
import io
import ipaddress
import json
import os
import re
import shutil
import socket
import ssl
import stat
import subprocess
import threading
import time
import urllib.parse
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any

from ..model.errors import IsolationError
from ..model.files import read_input_file
from .archive import INDEX_TYPES, Found, check_layer_count, choose_manifest, parse_json
from .budget import PARALLEL
from .reference import DEFAULT_REGISTRY, Reference
from .store import MAX_METADATA_SIZE, verify
from .unpack import BadImageError

INSECURE_ENV = "ISOLATE_INSECURE_REGISTRIES"
MANIFEST_TYPES = ", ".join((
    "application/vnd.oci.image.index.v1+json", "application/vnd.oci.image.manifest.v1+json",
    "application/vnd.docker.distribution.manifest.list.v2+json",
    "application/vnd.docker.distribution.manifest.v2+json"))
TIMEOUT = 60.0
#: The least an answer's body brings in each TIMEOUT seconds (a registry slower than that is taken for gone), and
#: the most its status and headers may take, all of them: each read waits TIMEOUT at most, and a registry that
#: sent a byte now and then (a token, a manifest, a layer, a header line) held a pull for ever.
MIN_PACE = 16 << 10
HEADERS_DEADLINE = 2 * TIMEOUT
MAX_REDIRECTS = 5
_CHALLENGE = re.compile(r'(\w+)="([^"]*)"')
#: Where docker and podman look for a registry's CAs and client certificates (HOST:PORT under each), after
#: the user's own ~/.config/containers/certs.d (containers-certs.d(5), docker's "Verify repository client
#: certificates").
SYSTEM_CERT_DIRS = ("/etc/containers/certs.d", "/etc/docker/certs.d")
#: What OpenSSL says when the peer of a TLS handshake does not speak TLS (a plain HTTP server): only then may a
#: registry allowed plain HTTP be tried over it.
_NOT_TLS = frozenset({"WRONG_VERSION_NUMBER", "UNKNOWN_PROTOCOL", "HTTP_REQUEST", "PACKET_LENGTH_TOO_LONG",
                      "UNEXPECTED_EOF_WHILE_READING", "RECORD_LAYER_FAILURE"})


class RegistryError(IsolationError):
    """A registry refused, or could not be reached: the message says which and why."""


def _host_only(netloc: str) -> str:
    host = netloc.rsplit("@", 1)[-1]
    if host.startswith("["):
        return host[1:host.index("]")]
    return host.rsplit(":", 1)[0] if host.count(":") == 1 else host


def is_loopback(host: str) -> bool:
    name = _host_only(host)
    if name == "localhost":
        return True
    try:
        return ipaddress.ip_address(name).is_loopback
    except ValueError:
        return False


# -- credentials -----------------------------------------------------------------------------------


def _auth_files() -> list[str]:
    files = []
    if os.environ.get("REGISTRY_AUTH_FILE"):
        files.append(os.environ["REGISTRY_AUTH_FILE"])
    runtime = os.environ.get("XDG_RUNTIME_DIR")
    if runtime:
        files.append(os.path.join(runtime, "containers", "auth.json"))
    files.append(os.path.expanduser("~/.config/containers/auth.json"))
    files.append(os.path.join(os.environ.get("DOCKER_CONFIG") or os.path.expanduser("~/.docker"), "config.json"))
    return files


def _keys(registry: str) -> list[str]:
    keys = [registry, f"https://{registry}", f"http://{registry}"]
    if registry == DEFAULT_REGISTRY:
        keys += ["https://index.docker.io/v1/", "index.docker.io", "registry-1.docker.io"]
    return keys


def credentials(registry: str) -> tuple[str, str] | None:
    """(user, secret) for registry, as docker and podman find them; None: anonymous."""
    for path in _auth_files():
        try:
            # Non-blocking, a regular file only, bounded: a FIFO planted in a home a sandbox could write never
            # hangs a pull.
            config = json.loads(read_input_file(path))
        except (OSError, ValueError, RecursionError):  # RecursionError: nested too deep for the parser
            continue
        if not isinstance(config, dict):
            continue
        auths = config.get("auths") if isinstance(config.get("auths"), dict) else {}
        for key in _keys(registry):
            entry = auths.get(key) if auths else None
            if isinstance(entry, dict) and isinstance(entry.get("auth"), str) and entry["auth"]:
                try:
                    user, _, secret = base64.b64decode(entry["auth"]).decode().partition(":")
                except (ValueError, UnicodeDecodeError):
                    continue
                return user, secret
        helpers = config.get("credHelpers") if isinstance(config.get("credHelpers"), dict) else {}
        helper = (helpers or {}).get(registry) or config.get("credsStore")
        if isinstance(helper, str) and helper:
            found = _helper(helper, registry)
            if found:
                return found
    return None


def _helper(name: str, registry: str) -> tuple[str, str] | None:
    program = shutil.which(f"docker-credential-{name}")
    if program is None or not re.match(r"^[A-Za-z0-9_.-]+$", name):
        return None
    for server in _keys(registry):
        try:
            result = subprocess.run([program, "get"], input=server, capture_output=True, text=True, timeout=30)
        except (OSError, subprocess.TimeoutExpired):
            return None
        if result.returncode == 0:
            try:
                data = json.loads(result.stdout)
                return str(data["Username"]), str(data["Secret"])
            except (ValueError, KeyError, TypeError, RecursionError):
                return None
    return None


# -- TLS ---------------------------------------------------------------------------------------------------


_SAFE_HOST = re.compile(r"^[A-Za-z0-9\[][A-Za-z0-9.:\[\]-]*$")


def cert_dirs(host: str) -> list[str]:
    """The per-host directories docker and podman read for ``host`` (HOST[:PORT]), in their order."""
    if not _SAFE_HOST.match(host):
        return []
    homes = [os.path.join(os.path.expanduser("~"), ".config", "containers", "certs.d")]
    return [os.path.join(base, host) for base in (*homes, *SYSTEM_CERT_DIRS)]


def tls_context(host: str, cert_dir: str | None = None) -> tuple[ssl.SSLContext, str | None]:
    """A verifying TLS context for ``host``: the system's CAs, and those of ``cert_dir`` or of the first of
    ``cert_dirs(host)`` that exists (that directory, or None)."""
    context = ssl.create_default_context()
    directory = cert_dir or next((d for d in cert_dirs(host) if os.path.isdir(d)), None)
    if directory is None:
        return context, None
    try:
        names = sorted(os.listdir(directory))
    except OSError as exc:
        raise RegistryError(f"registry {host}: its certificates directory {directory}: "
                            f"{exc.strerror or exc}") from None
    for name in names:
        path = os.path.join(directory, name)
        try:
            if name.endswith(".crt"):
                data = read_input_file(path)
                context.load_verify_locations(cadata=data.decode("ascii") if data.lstrip().startswith(b"-----")
                                              else data)
            elif name.endswith(".cert"):
                key = path[:-len(".cert")] + ".key"
                if not os.path.lexists(key):
                    raise RegistryError(f"registry {host}: the client certificate {path} has no key {key}")
                with _regular(path) as cert_fd, _regular(key) as key_fd:
                    context.load_cert_chain(f"/proc/self/fd/{cert_fd}", f"/proc/self/fd/{key_fd}")
        except (ssl.SSLError, OSError, ValueError) as exc:
            problem = getattr(exc, "reason", None) or getattr(exc, "strerror", None) or exc
            named = getattr(exc, "filename", None) or path
            raise RegistryError(f"registry {host}: {named}: not a certificate or key it can use ({problem})") from None
    return context, directory


@contextmanager
def _regular(path: str) -> Iterator[int]:
    """A descriptor of the regular file at path, opened without blocking (a FIFO never hangs the pull)."""
    fd = os.open(path, os.O_RDONLY | os.O_NONBLOCK | os.O_CLOEXEC | os.O_NOCTTY)
    try:
        if not stat.S_ISREG(os.fstat(fd).st_mode):
            raise OSError(0, "not a regular file", path)
        yield fd
    finally:
        os.close(fd)


class _TLSFailed(ConnectionError):
    """A TLS handshake failed with a peer that speaks TLS: never a reason to try plain HTTP."""


# -- HTTP --------------------------------------------------------------------------------------------


class _Deadline:
    """Shuts a connection's socket down when its answer's head has not come within HEADERS_DEADLINE of start():
    the read waiting on it ends (``fired`` then says why)."""

    def __init__(self, connection: http.client.HTTPConnection) -> None:
        self.connection = connection
        self.fired = False
        self.timer: threading.Timer | None = None

    def start(self) -> None:
        if self.timer is None:
            self.timer = threading.Timer(HEADERS_DEADLINE, self._fire)
            self.timer.daemon = True
            self.timer.start()

    def _fire(self) -> None:
        self.fired = True
        sock = self.connection.sock
        if sock is not None:
            try:
                sock.shutdown(socket.SHUT_RDWR)
            except OSError:
                pass

    def cancel(self) -> None:
        if self.timer is not None:
            self.timer.cancel()


class _Pace:
    """Bytes moved in windows of TIMEOUT seconds, each of which must move at least MIN_PACE: the bound of a
    pull's answer and of a push's body alike."""

    def __init__(self) -> None:
        self.window = time.monotonic()
        self.moved = 0

    def slow(self, more: int = 0) -> str | None:
        """Counts ``more`` bytes; at a window's end, how slow it was if too slow (else None, a new window)."""
        self.moved += more
        now = time.monotonic()
        if now - self.window < TIMEOUT:
            return None
        if self.moved < MIN_PACE:
            return f"{self.moved} bytes in {now - self.window:.0f} s, less than {MIN_PACE} in {TIMEOUT:.0f}"
        self.window, self.moved = now, 0
        return None


class _Paced(io.RawIOBase):
    """An answer's body, read as it comes: at least MIN_PACE bytes in each TIMEOUT seconds, and a read that
    waited TIMEOUT for nothing, is a RegistryError (not a pull held for ever, nor a raw TimeoutError)."""

    def __init__(self, response: http.client.HTTPResponse, registry: str) -> None:
        super().__init__()
        self.response, self.registry = response, registry
        self.pace = _Pace()

    def readable(self) -> bool:
        return True

    def readinto(self, buffer: Any) -> int:
        """Fills ``buffer`` as the body comes (0: its end), its pace checked after each piece."""
        view = memoryview(buffer).cast("B")
        filled = 0
        while filled < len(view):
            try:
                got = self.response.readinto1(view[filled:])
            except (OSError, http.client.HTTPException) as exc:
                raise RegistryError(f"registry {self.registry}: its answer broke off ({exc or type(exc).__name__})") \
                    from None
            if not got:
                break
            filled += got
            slow = self.pace.slow(got)
            if slow:
                raise RegistryError(f"registry {self.registry}: its answer came at {slow}: given up")
        return filled

    def close(self) -> None:
        self.response.close()
        super().close()


class _SlowUpload(ConnectionError):
    """A request's body the registry took in at less than MIN_PACE bytes in TIMEOUT seconds."""


class _PacedBody:
    """A request's body (bytes, or a file read from where it is), handed to ``http.client`` a block at a time:
    each block goes out with one ``sendall`` bounded by the socket's TIMEOUT, and the registry must take in
    at least MIN_PACE bytes in each TIMEOUT seconds (the pull's pace, _Paced), else _SlowUpload. Without it a
    registry that read a few bytes now and then held a push for ever: each ``sendall`` was bounded, the whole
    body was not."""

    BLOCK = 8 << 10  # well under MIN_PACE: a block that cannot go out within TIMEOUT is the registry gone

    def __init__(self, body: Any) -> None:
        self.raw = io.BytesIO(bytes(body)) if isinstance(body, (bytes, bytearray, memoryview)) else body
        self.pace = _Pace()

    def read(self, size: int = -1) -> bytes:
        # Called for the next block once the last one was taken in (sendall returned): the pace so far.
        slow = self.pace.slow()
        if slow:
            raise _SlowUpload(f"it took the request's body in at {slow}: given up")
        data: bytes = self.raw.read(self.BLOCK if size < 0 else min(size, self.BLOCK))
        self.pace.moved += len(data)
        return data


@dataclass
class _Response:
    status: int
    headers: http.client.HTTPMessage
    body: _Paced
    connection: http.client.HTTPConnection
    netloc: str = ""  # who answered (after redirects): a challenge counts only from the registry's own host

    def read_all(self, limit: int, what: str) -> bytes:
        length = self.headers.get("Content-Length")
        if length and length.isdigit() and int(length) > limit:
            raise BadImageError(f"{what}: {length} bytes, past {limit}: refused")
        data = bytearray()
        chunk = bytearray(64 << 10)
        while len(data) <= limit and (count := self.body.readinto(chunk)):
            data += chunk[:count]
        if len(data) > limit:
            raise BadImageError(f"{what}: past {limit} bytes: refused")
        return bytes(data)

    def close(self) -> None:
        self.connection.close()


@dataclass
class Client:
    """One registry: its address, scheme, and the authorization it earned."""

    registry: str
    insecure: bool = False
    host: str = ""
    scheme: str = "https"
    auth: str | None = None  # the Authorization header for this registry's own host
    #: (user, secret) given by the caller (a create request's image.auth): used instead of the auth files.
    login: tuple[str, str] | None = field(default=None, repr=False)
    #: A directory of CAs (``*.crt``) and client certificates for this registry, instead of the certs.d ones.
    cert_dir: str | None = None
    _lock: threading.Lock = field(default_factory=threading.Lock)
    _scheme_known: bool = False
    _tls: tuple[ssl.SSLContext, str | None] | None = None
    _tls_lock: threading.Lock = field(default_factory=threading.Lock)  # _lock is held while the scheme is probed

    def __post_init__(self) -> None:
        self.host = "registry-1.docker.io" if self.registry == DEFAULT_REGISTRY else self.registry
        named = {h.strip() for h in os.environ.get(INSECURE_ENV, "").split(",") if h.strip()}
        self.plain_allowed = self.insecure or is_loopback(self.host) or self.host in named

    def _context(self) -> ssl.SSLContext:
        """The registry's TLS context (its certs.d, as docker and podman take it), for every host of the pull."""
        with self._tls_lock:
            if self._tls is None:
                self._tls = tls_context(self.host, self.cert_dir)
            return self._tls[0]

    def _connect(self, scheme: str, netloc: str) -> http.client.HTTPConnection:
        if scheme == "https":
            return http.client.HTTPSConnection(netloc, timeout=TIMEOUT, context=self._context())
        return http.client.HTTPConnection(netloc, timeout=TIMEOUT)

    def _untrusted(self, netloc: str, exc: ssl.SSLCertVerificationError) -> RegistryError:
        assert self._tls is not None
        read = self._tls[1]
        if read is not None:
            where = f"neither the CAs of {read} nor the system's verify it"
        else:
            places = cert_dirs(self.host)
            where = (f"its CA goes in {places[0]}/ca.crt, {places[1]}/ or {places[2]}/ (as for podman and docker), "
                     "or give it with --cert-dir DIR" if places else "give its CA with --cert-dir DIR")
        problem = (exc.verify_message or exc.reason or "certificate verify failed").strip()
        return RegistryError(f"registry {self.registry}: the TLS certificate of {netloc} is not trusted "
                             f"({problem}): {where}")

    def _send(self, url: str, headers: dict[str, str], method: str = "GET", body: Any = None) -> _Response:
        parts = urllib.parse.urlsplit(url)
        if parts.scheme not in ("http", "https"):
            raise RegistryError(f"registry {self.registry}: a redirect to {parts.scheme}: refused")
        if parts.scheme == "http" and not (self.plain_allowed and parts.netloc == self.host) \
                and not is_loopback(parts.netloc):
            raise RegistryError(f"registry {self.registry}: plain HTTP to {parts.netloc} refused (only loopback or "
                                f"a registry named insecure: --insecure, {INSECURE_ENV})")
        connection = self._connect(parts.scheme, parts.netloc)
        path = parts.path + (f"?{parts.query}" if parts.query else "")
        late = _Deadline(connection)
        try:
            if body is None:
                late.start()  # the handshake and the request, then the answer's head: bounded together
            paced = None if body is None else _PacedBody(body)
            connection.request(method, path or "/", body=paced, headers={"User-Agent": "isolate", **headers})
            late.start()  # an upload's body may take long: only the answer's head then
            response = connection.getresponse()
            late.cancel()
            if late.fired:  # the head read to its end by the shutdown: not the registry's answer
                raise ConnectionError("its answer's head came too late")
        except ssl.SSLCertVerificationError as exc:
            connection.close()
            raise self._untrusted(parts.netloc, exc) from None
        except ssl.SSLError as exc:
            connection.close()
            kind = ConnectionError if exc.reason in _NOT_TLS or isinstance(exc, ssl.SSLEOFError) else _TLSFailed
            problem = str(exc.reason or exc)
            if "ALERT" in problem and "CERTIFICATE" in problem:
                # The server's alert: it wants a client certificate, or refused the one it was given.
                problem = (f"{problem}: it refused this client's certificate, or wants one (NAME.cert and NAME.key "
                           f"beside the CA: --cert-dir, or the registry's certs.d directory)")
            raise kind(f"{parts.scheme}://{parts.netloc}: TLS: {problem}") from exc
        except (OSError, http.client.HTTPException) as exc:
            connection.close()
            if late.fired:
                raise ConnectionError(f"{parts.scheme}://{parts.netloc}: no answer within {HEADERS_DEADLINE:.0f} s "
                                      "(its status and headers): given up") from None
            raise ConnectionError(f"{parts.scheme}://{parts.netloc}: {exc}") from exc
        finally:
            late.cancel()
        return _Response(response.status, response.headers, _Paced(response, self.registry), connection,
                         parts.netloc)

    def get(self, path: str, headers: dict[str, str] | None = None, scope: str = "") -> _Response:
        """GET path of the registry, with its authorization; redirects followed, the credentials only ever
        sent to the registry's own host."""
        headers = dict(headers or {})
        url = self._base() + path
        for attempt in range(2):
            response = self._follow(url, headers)
            if response.status != 401 or attempt:
                break
            own = urllib.parse.urlsplit(url).netloc
            if response.netloc != own:
                # A host the registry redirected to asks for credentials: its challenge would name the realm
                # the registry's credentials go to. Never answered.
                response.close()
                raise RegistryError(f"registry {self.registry}: {response.netloc}, where it redirected {path}, "
                                    "asks for credentials: never sent to another host")
            challenge = response.headers.get("WWW-Authenticate", "")
            response.close()
            self._authenticate(challenge, scope)
        if response.status == 401:
            response.close()
            raise RegistryError(f"registry {self.registry}: unauthorized for {path} (credentials from "
                                "docker/podman login, e.g. ~/.docker/config.json)")
        return response

    def send(self, method: str, url: str, headers: dict[str, str] | None = None, body: Any = None,
             scope: str = "") -> _Response:
        """One request that is not a GET (a push's HEAD, POST, PUT, PATCH) to ``url`` (a path of the registry, or
        an upload's location): no redirect followed, the authorization sent only to the registry's own host, a
        401 answered once (``body``: bytes, or a file the retry reads again from where it was)."""
        url = urllib.parse.urljoin(self._base() + "/", url)
        own = urllib.parse.urlsplit(self._base()).netloc
        start = body.tell() if hasattr(body, "tell") else None
        for attempt in range(2):
            sent = dict(headers or {})
            if self.auth and urllib.parse.urlsplit(url).netloc == own:
                sent["Authorization"] = self.auth
            try:
                response = self._send(url, sent, method, body)
            except ConnectionError as exc:
                raise RegistryError(f"registry {self.registry}: {exc.args[0]}") from None
            if response.status != 401 or attempt:
                break
            if response.netloc != own:
                response.close()
                raise RegistryError(f"registry {self.registry}: {response.netloc} asks for credentials: never sent "
                                    "to another host")
            challenge = response.headers.get("WWW-Authenticate", "")
            response.close()
            self._authenticate(challenge, scope)
            if start is not None:
                body.seek(start)
        if response.status == 401:
            response.close()
            raise RegistryError(f"registry {self.registry}: unauthorized to {method} {urllib.parse.urlsplit(url).path}"
                                " (credentials from docker/podman login, e.g. ~/.docker/config.json)")
        return response

    def _follow(self, url: str, headers: dict[str, str]) -> _Response:
        own = urllib.parse.urlsplit(url).netloc
        for _ in range(MAX_REDIRECTS + 1):
            sent = dict(headers)
            if self.auth and urllib.parse.urlsplit(url).netloc == own:
                sent["Authorization"] = self.auth
            response = self._send(url, sent)
            if response.status not in (301, 302, 303, 307, 308):
                return response
            location = response.headers.get("Location", "")
            response.close()
            if not location:
                raise RegistryError(f"registry {self.registry}: a redirect with no Location")
            url = urllib.parse.urljoin(url, location)
        raise RegistryError(f"registry {self.registry}: more than {MAX_REDIRECTS} redirects")

    def _base(self) -> str:
        with self._lock:
            if not self._scheme_known:
                self.scheme = self._probe()
                self._scheme_known = True
        return f"{self.scheme}://{self.host}"

    def _probe(self) -> str:
        """https, or http where allowed and the registry does not speak TLS (a certificate not trusted, or a
        handshake that failed otherwise, is never a reason to try plain HTTP)."""
        try:
            self._send(f"https://{self.host}/v2/", {}).close()
            return "https"
        except ConnectionError as exc:
            if not self.plain_allowed or isinstance(exc, _TLSFailed):
                raise RegistryError(f"registry {self.registry}: {exc.args[0]}") from None
        try:
            self._send(f"http://{self.host}/v2/", {}).close()
        except ConnectionError as exc:
            raise RegistryError(f"registry {self.registry}: {exc.args[0]}") from None
        return "http"

    def _authenticate(self, challenge: str, scope: str) -> None:
        scheme, _, rest = challenge.partition(" ")
        params = dict(_CHALLENGE.findall(rest))
        found = self.login or credentials(self.registry)
        if scheme.lower() == "basic":
            if found is None:
                raise RegistryError(f"registry {self.registry}: asks for a user and password, and none is "
                                    "known (docker login / podman login)")
            self.auth = "Basic " + base64.b64encode(f"{found[0]}:{found[1]}".encode()).decode()
            return
        if scheme.lower() != "bearer" or "realm" not in params:
            raise RegistryError(f"registry {self.registry}: an authentication this client does not speak "
                                f"({challenge[:80]!r})")
        query = {"service": params.get("service", "")}
        if scope or params.get("scope"):
            query["scope"] = scope or params["scope"]
        realm = params["realm"] + ("&" if "?" in params["realm"] else "?") + urllib.parse.urlencode(query)
        parts = urllib.parse.urlsplit(realm)
        if parts.scheme == "http" and not (is_loopback(parts.netloc) or self.plain_allowed):
            raise RegistryError(f"registry {self.registry}: its token service {parts.netloc} is plain HTTP: "
                                "refused")
        headers = {}
        if found is not None:
            headers["Authorization"] = "Basic " + base64.b64encode(f"{found[0]}:{found[1]}".encode()).decode()
        try:
            response = self._send(realm, headers)
        except ConnectionError as exc:
            raise RegistryError(f"registry {self.registry}: token service: {exc.args[0]}") from None
        try:
            if response.status in (401, 403) and found is not None:
                raise RegistryError(f"registry {self.registry}: the token service refused the credentials for "
                                    f"{self.registry} (HTTP {response.status}; docker/podman login again)")
            if response.status != 200:
                raise RegistryError(f"registry {self.registry}: token service answered {response.status}")
            data = parse_json(response.read_all(1 << 20, "token"), "token")
        finally:
            response.close()
        token = data.get("token") or data.get("access_token")
        if not isinstance(token, str) or not token:
            raise RegistryError(f"registry {self.registry}: the token service gave no token")
        self.auth = f"Bearer {token}"


# -- pulling -------------------------------------------------------------------------------------------


class _RegistrySource:
    """Blobs of one repository, as a loader's source (store.ensure_layer streams each)."""

    parallel = PARALLEL

    def __init__(self, client: Client, repository: str) -> None:
        self.client, self.repository = client, repository
        self.fetched = 0  # bytes of layers read so far
        self.done = 0  # layers read to their end
        self.sizes: dict[str, int] = {}  # each layer's size, as its manifest gives it (for a progress bar)
        self._count = threading.Lock()

    @contextmanager
    def open(self, digest: str) -> Iterator[Any]:
        response = self.blob(digest)
        try:
            yield _Counted(response.body, self)
        finally:
            response.close()
        with self._count:
            self.done += 1

    def blob(self, digest: str) -> _Response:
        try:
            response = self.client.get(f"/v2/{self.repository}/blobs/{digest}",
                                       scope=f"repository:{self.repository}:pull")
        except ConnectionError as exc:
            raise RegistryError(f"registry {self.client.registry}: {exc.args[0]}") from None
        if response.status != 200:
            response.close()
            raise RegistryError(f"registry {self.client.registry}: blob {digest[:19]} of {self.repository}: "
                                f"HTTP {response.status}")
        return response

    def read(self, digest: str, what: str) -> bytes:
        response = self.blob(digest)
        try:
            return verify(response.read_all(MAX_METADATA_SIZE, what), digest, what)
        finally:
            response.close()

    def close(self) -> None:
        pass


class _Counted:
    def __init__(self, body: _Paced, source: _RegistrySource) -> None:
        self.body, self.source = body, source

    def read(self, n: int = -1) -> bytes:
        data = self.body.read(n)
        with self.source._count:
            self.source.fetched += len(data)
        return data

    def __enter__(self) -> _Counted:
        return self

    def __exit__(self, *exc: object) -> None:
        pass


def _manifest(client: Client, ref: Reference, reference: str) -> tuple[bytes, str, dict[str, Any]]:
    """(bytes, digest, parsed) of the manifest ``reference`` (a tag or digest) names."""
    scope = f"repository:{ref.repository}:pull"
    try:
        response = client.get(f"/v2/{ref.repository}/manifests/{reference}", {"Accept": MANIFEST_TYPES}, scope)
    except ConnectionError as exc:
        raise RegistryError(f"registry {ref.registry}: {exc.args[0]}") from None
    try:
        if response.status == 404:
            raise RegistryError(f"image {ref}: the registry has no {reference} of {ref.repository}")
        if response.status != 200:
            raise RegistryError(f"image {ref}: the registry answered HTTP {response.status} for its manifest")
        data = response.read_all(MAX_METADATA_SIZE, f"image {ref}: manifest")
        header_digest = response.headers.get("Docker-Content-Digest")
    finally:
        response.close()
    import hashlib

    digest = "sha256:" + hashlib.sha256(data).hexdigest()
    if reference.startswith("sha256:"):
        verify(data, reference, f"image {ref}: manifest")
    elif header_digest and header_digest.startswith("sha256:") and header_digest != digest:
        raise BadImageError(f"image {ref}: the manifest does not match the digest the registry gives: refused")
    return data, digest, parse_json(data, f"image {ref}: manifest")


def resolve(reference: str, *, insecure: bool = False, login: tuple[str, str] | None = None,
            cert_dir: str | None = None) -> tuple[Found, _RegistrySource]:
    """The image ``reference`` names, as a loader takes it: its manifest and config (verified), and the
    source its layers stream from (Image.pull unpacks them into a store). ``login``: (user, secret) for its
    registry, instead of those the auth files give; ``cert_dir``: its CAs (``*.crt``) and client
    certificate, instead of those of the certs.d directories."""
    ref = Reference.parse(reference)
    client = Client(ref.registry, insecure=insecure, login=login, cert_dir=cert_dir)
    data, digest, manifest = _manifest(client, ref, ref.reference)
    if manifest.get("mediaType") in INDEX_TYPES or ("manifests" in manifest and "layers" not in manifest):
        entry = choose_manifest(manifest, f"image {ref}")
        chosen = entry.get("digest")
        if not isinstance(chosen, str):
            raise BadImageError(f"image {ref}: an index entry with no digest")
        data, digest, manifest = _manifest(client, ref, chosen)
        verify(data, chosen, f"image {ref}: manifest")
    source = _RegistrySource(client, ref.repository)
    config = manifest.get("config")
    layers = manifest.get("layers")
    if not isinstance(config, dict) or not isinstance(config.get("digest"), str) or not isinstance(layers, list):
        raise BadImageError(f"image {ref}: its manifest has no config or no layers")
    check_layer_count(len(layers), f"image {ref}")
    config_data = source.read(config["digest"], f"image {ref}: config")
    found_layers = []
    for layer in layers:
        if not isinstance(layer, dict) or not isinstance(layer.get("digest"), str):
            raise BadImageError(f"image {ref}: a layer with no digest")
        found_layers.append((layer["digest"], layer["digest"]))
        size = layer.get("size")
        if isinstance(size, int) and not isinstance(size, bool) and 0 <= size < 1 << 50:
            source.sizes[layer["digest"]] = size
    return Found(str(ref), data, digest, config_data, config["digest"], found_layers), source


__all__ = ["Client", "RegistryError", "cert_dirs", "credentials", "is_loopback", "resolve", "tls_context"]
