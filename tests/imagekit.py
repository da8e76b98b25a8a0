"""Test images built here, with Python's tarfile: layers, OCI layouts and docker save archives."""

from __future__ import annotations

import base64
import contextlib
import gzip
import hashlib
import io
import json
import os
import shutil
import socket
import stat
import subprocess
import tarfile
import tempfile
import time
from collections.abc import Iterator, Sequence
from typing import Any

from isolate.image.archive import host_platform


def digest(data: bytes) -> str:
    return "sha256:" + hashlib.sha256(data).hexdigest()


def layer(entries: list[dict[str, Any]]) -> bytes:
    """A layer's tar: each entry {name, type ('file'|'dir'|'link'|'hard'|'chr'|'fifo'), data, mode, target,
    xattrs, pax, size}."""
    out = io.BytesIO()
    with tarfile.open(fileobj=out, mode="w", format=tarfile.PAX_FORMAT) as tar:
        for entry in entries:
            info = tarfile.TarInfo(entry["name"])
            kind = entry.get("type", "file")
            info.mode = entry.get("mode", 0o755 if kind == "dir" else 0o644)
            info.mtime = 1700000000
            if entry.get("xattrs"):
                info.pax_headers = {f"SCHILY.xattr.{k}": v for k, v in entry["xattrs"].items()}
            if entry.get("pax"):
                info.pax_headers = {**info.pax_headers, **entry["pax"]}  # raw pax records (mtime, uid ...)
            data = entry.get("data", b"")
            if kind == "dir":
                info.type = tarfile.DIRTYPE
            elif kind == "link":
                info.type, info.linkname = tarfile.SYMTYPE, entry["target"]
            elif kind == "hard":
                info.type, info.linkname = tarfile.LNKTYPE, entry["target"]
            elif kind == "chr":
                info.type, info.devmajor, info.devminor = tarfile.CHRTYPE, entry.get("major", 1), entry.get("minor", 3)
            elif kind == "fifo":
                info.type = tarfile.FIFOTYPE
            if kind == "file" and "size" in entry:
                info.size = entry["size"]
                tar.addfile(info, Zeros(entry["size"]))  # type: ignore[arg-type]
            elif kind == "file":
                info.size = len(data)
                tar.addfile(info, io.BytesIO(data))
            else:
                tar.addfile(info)
    return out.getvalue()


class Zeros:
    """A file-like object of n zero bytes (a layer's large file, never held whole)."""

    def __init__(self, n: int) -> None:
        self.left = n

    def read(self, n: int = -1) -> bytes:
        n = self.left if n < 0 else min(n, self.left)
        self.left -= n
        return bytes(n)


def gz(data: bytes) -> bytes:
    return gzip.compress(data, compresslevel=1, mtime=0)


def config_for(layers: list[bytes], **config: Any) -> bytes:
    """An image config: diff ids of the layers given uncompressed."""
    os_, arch = host_platform()
    return json.dumps({"architecture": arch, "os": os_, "config": config,
                       "rootfs": {"type": "layers", "diff_ids": [digest(raw) for raw in layers]}}).encode()


def oci_layout(path: str, layers: list[bytes], *, compress: bool = True, ref: str | None = "test:1",
               config: bytes | None = None, **image_config: Any) -> str:
    """Write an OCI image layout of the layers (uncompressed tars given) at path; its manifest digest."""
    os.makedirs(os.path.join(path, "blobs", "sha256"), exist_ok=True)

    def blob(data: bytes) -> str:
        d = digest(data)
        with open(os.path.join(path, "blobs", "sha256", d[7:]), "wb") as handle:
            handle.write(data)
        return d

    config = config if config is not None else config_for(layers, **image_config)
    blobs = [gz(raw) if compress else raw for raw in layers]
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": blob(config),
                   "size": len(config)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar" + ("+gzip" if compress else ""),
                    "digest": blob(b), "size": len(b)} for b in blobs],
    }).encode()
    manifest_digest = blob(manifest)
    entry: dict[str, Any] = {"mediaType": "application/vnd.oci.image.manifest.v1+json",
                             "digest": manifest_digest, "size": len(manifest)}
    if ref:
        entry["annotations"] = {"org.opencontainers.image.ref.name": ref}
    with open(os.path.join(path, "index.json"), "w") as handle:
        json.dump({"schemaVersion": 2, "manifests": [entry]}, handle)
    with open(os.path.join(path, "oci-layout"), "w") as handle:
        json.dump({"imageLayoutVersion": "1.0.0"}, handle)
    return manifest_digest


def docker_archive(path: str, layers: list[bytes], tag: str = "saved:1", **image_config: Any) -> None:
    """Write a docker save archive (uncompressed layers, as docker writes them)."""
    config = config_for(layers, **image_config)
    with tarfile.open(path, "w") as tar:
        def add(name: str, data: bytes) -> None:
            info = tarfile.TarInfo(name)
            info.size = len(data)
            tar.addfile(info, io.BytesIO(data))

        names = []
        for i, raw in enumerate(layers):
            names.append(f"l{i}/layer.tar")
            add(names[-1], raw)
        add("config.json", config)
        add("manifest.json", json.dumps([{"Config": "config.json", "RepoTags": [tag], "Layers": names}]).encode())


def busybox_layer(extra: Sequence[dict[str, Any]] = ()) -> bytes:
    """A scratch image's one layer: busybox-static as /bin/busybox, with links for a few applets (and the
    entries of extra)."""
    with open("/bin/busybox", "rb") as handle:
        data = handle.read()
    entries: list[dict[str, Any]] = [{"name": "bin", "type": "dir"},
                                     {"name": "bin/busybox", "data": data, "mode": 0o755}]
    for applet in ("sh", "cat", "ls", "echo", "id", "true", "env", "pwd", "touch", "rm", "mkdir", "stat", "test"):
        entries.append({"name": f"bin/{applet}", "type": "link", "target": "busybox"})
    entries += [{"name": "etc", "type": "dir"}, {"name": "etc/os-release", "data": b"NAME=busybox-scratch\n"},
                {"name": "tmp", "type": "dir", "mode": 0o1777}, *extra]
    return layer(entries)


def _openssl(*args: str) -> None:
    subprocess.run(["openssl", *args], check=True, capture_output=True, timeout=30)


def _signed(files: dict[str, str], name: str, subject: str, *extensions: str) -> None:
    """A certificate and key of files' CA (``ca.crt``, ``ca.key``): NAME.crt and NAME.key beside them (EC P-256,
    two days); a CA of its own first, when files has none yet."""
    if not os.path.exists(files["ca.crt"]):
        _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "2",
                 "-keyout", files["ca.key"], "-out", files["ca.crt"], "-subj", "/CN=isolate test CA",
                 "-addext", "basicConstraints=critical,CA:TRUE", "-addext", "keyUsage=critical,keyCertSign,cRLSign")
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "2",
             "-keyout", files[f"{name}.key"], "-out", files[f"{name}.crt"], "-subj", subject,
             "-CA", files["ca.crt"], "-CAkey", files["ca.key"], "-addext", "basicConstraints=critical,CA:FALSE",
             "-addext", "keyUsage=critical,digitalSignature", *extensions)


def _places(directory: str, name: str) -> dict[str, str]:
    return {part: os.path.join(directory, part) for part in ("ca.crt", "ca.key", f"{name}.crt", f"{name}.key")}


def tls_files(directory: str) -> dict[str, str]:
    """A throwaway CA and a server certificate of 127.0.0.1 it signed (EC P-256, two days), made with openssl
    in directory: their paths ({"ca", "cert", "key"})."""
    files = _places(directory, "server")
    _signed(files, "server", "/CN=127.0.0.1", "-addext", "subjectAltName=IP:127.0.0.1",
            "-addext", "extendedKeyUsage=serverAuth")
    return {"ca": files["ca.crt"], "cert": files["server.crt"], "key": files["server.key"], "ca_key": files["ca.key"]}


def client_certificate(files: dict[str, str], directory: str) -> None:
    """A client certificate the CA of files (tls_files) signed, as NAME.cert and NAME.key in directory (the
    certs.d layout docker and podman read), with the CA beside it as ca.crt."""
    os.makedirs(directory, exist_ok=True)
    _openssl("req", "-x509", "-newkey", "ec", "-pkeyopt", "ec_paramgen_curve:P-256", "-nodes", "-days", "2",
             "-keyout", os.path.join(directory, "client.key"), "-out", os.path.join(directory, "client.cert"),
             "-subj", "/CN=isolate test client", "-CA", files["ca"], "-CAkey", files["ca_key"],
             "-addext", "basicConstraints=critical,CA:FALSE", "-addext", "keyUsage=critical,digitalSignature",
             "-addext", "extendedKeyUsage=clientAuth")
    with open(files["ca"], "rb") as source, open(os.path.join(directory, "ca.crt"), "wb") as target:
        target.write(source.read())


def node_tls_files(directory: str, ips: list[str]) -> dict[str, str]:
    """A throwaway CA and one certificate it signed for the addresses ``ips``, good as a server's and as a
    client's (the one certificate Ray's TLS presents both ways: RAY_TLS_SERVER_CERT), made with openssl in
    directory: their paths ({"ca", "cert", "key"})."""
    os.makedirs(directory, exist_ok=True)
    files = _places(directory, "node")
    _signed(files, "node", "/CN=isolate test node",
            "-addext", "subjectAltName=" + ",".join(f"IP:{ip}" for ip in dict.fromkeys(ips)),
            "-addext", "extendedKeyUsage=serverAuth,clientAuth")
    return {"ca": files["ca.crt"], "cert": files["node.crt"], "key": files["node.key"]}


class TokenSigner:
    """A token service's key (RSA, self-signed certificate: the bundle a registry's ``auth: token:`` trusts),
    and JWTs (RS256) signed with it, as the distribution registry verifies them: the key named by its libtrust
    key id in the header's ``kid``."""

    def __init__(self, directory: str) -> None:
        self.key, self.cert = os.path.join(directory, "token.key"), os.path.join(directory, "token.crt")
        _openssl("req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "2", "-keyout", self.key,
                 "-out", self.cert, "-subj", "/CN=isolate test token issuer")
        der = subprocess.run(["openssl", "pkey", "-in", self.key, "-pubout", "-outform", "DER"], check=True,
                             capture_output=True, timeout=30).stdout
        # libtrust's key id: the SHA-256 of the public key's DER (PKIX), its first 240 bits in base32, by 4s.
        encoded = base64.b32encode(hashlib.sha256(der).digest()[:30]).decode().rstrip("=")
        self.kid = ":".join(encoded[i:i + 4] for i in range(0, len(encoded), 4))

    def token(self, claims: dict[str, Any]) -> str:
        def b64(data: bytes) -> str:
            return base64.urlsafe_b64encode(data).decode().rstrip("=")

        header = {"typ": "JWT", "alg": "RS256", "kid": self.kid}
        signing_input = f"{b64(json.dumps(header).encode())}.{b64(json.dumps(claims).encode())}"
        signature = subprocess.run(["openssl", "dgst", "-sha256", "-sign", self.key], input=signing_input.encode(),
                                   check=True, capture_output=True, timeout=30).stdout
        return f"{signing_input}.{b64(signature)}"


def docker_login(home: Any, registry: str, user: str, secret: str, monkeypatch: Any) -> None:
    """A docker login of ``user`` at ``registry`` in a config.json under ``home``, the only auth file read."""
    config = os.path.join(str(home), "docker")
    os.makedirs(config, exist_ok=True)
    with open(os.path.join(config, "config.json"), "w") as handle:
        json.dump({"auths": {registry: {"auth": base64.b64encode(f"{user}:{secret}".encode()).decode()}}}, handle)
    monkeypatch.setenv("DOCKER_CONFIG", config)
    monkeypatch.setenv("HOME", str(home))
    monkeypatch.delenv("REGISTRY_AUTH_FILE", raising=False)
    monkeypatch.delenv("XDG_RUNTIME_DIR", raising=False)


@contextlib.contextmanager
def store_env(path: Any) -> Iterator[str]:
    """ISOLATE_IMAGE_STORE set to ``path`` (the test's own store) while the block runs, as it was after."""
    saved = os.environ.get("ISOLATE_IMAGE_STORE")
    os.environ["ISOLATE_IMAGE_STORE"] = str(path)
    try:
        yield str(path)
    finally:
        if saved is None:
            os.environ.pop("ISOLATE_IMAGE_STORE", None)
        else:
            os.environ["ISOLATE_IMAGE_STORE"] = saved


@contextlib.contextmanager
def loopback_registry(directory: str, registry: str, htpasswd: str | None = None,
                      tls: dict[str, str] | None = None, token: dict[str, str] | None = None) -> Iterator[str]:
    """Debian's docker-registry (registry: its path) keeping its data in directory and serving on a free port
    of 127.0.0.1, with basic auth when htpasswd (a file) is given, HTTPS when tls ({"cert", "key"}: files; a
    client certificate its "ca" signed asked for when tls["clients"] is set), and
    bearer tokens when token ({"realm", "service", "issuer", "rootcertbundle"}); its address while it runs."""
    with socket.socket() as probe:
        probe.bind(("127.0.0.1", 0))
        port = int(probe.getsockname()[1])
    auth = f"auth:\n  htpasswd:\n    realm: tests\n    path: {htpasswd}\n" if htpasswd else ""
    if token:
        auth = "auth:\n  token:\n" + "".join(f"    {key}: {value}\n" for key, value in token.items())
    https = f"  tls:\n    certificate: {tls['cert']}\n    key: {tls['key']}\n" if tls else ""
    if tls and tls.get("clients"):
        https += f"    clientcas:\n      - {tls['ca']}\n"
    config = os.path.join(directory, "registry.yml")
    with open(config, "w") as handle:
        handle.write(f"version: 0.1\nlog:\n  level: error\nstorage:\n  filesystem:\n    rootdirectory: "
                     f"{os.path.join(directory, 'data')}\nhttp:\n  addr: 127.0.0.1:{port}\n{https}{auth}")
    server = subprocess.Popen([registry, "serve", config], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        for _ in range(100):
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                time.sleep(0.05)
        yield f"127.0.0.1:{port}"
    finally:
        server.kill()
        server.wait()


def push(skopeo: str, layout: str, destination: str, work: str, extra: Sequence[str] = (), timeout: float = 60) -> None:
    """skopeo copy of an OCI layout's image (``path:ref``) to ``docker://destination`` over plain HTTP. skopeo
    keeps nothing of the caller's and reads no auth file of the host's (a root podman's /run/containers is
    0700: uid 65534's default there is unreadable)."""
    # --preserve-digests: the blobs as the layout has them. Else skopeo may push, from its blob info cache
    # (root's is machine-wide), another compression of a layer it saw before, and a test of zstd or
    # uncompressed layers silently get gzip ones.
    subprocess.run([skopeo, "copy", "--quiet", "--preserve-digests", *extra, "--dest-tls-verify=false", f"oci:{layout}",
                    f"docker://{destination}"], check=True, capture_output=True, timeout=timeout,
                   env=dict(os.environ, HOME=work, REGISTRY_AUTH_FILE=os.path.join(work, "auth.json")))


#: The Debian 12 + python3 image (mmdebstrap, minbase, without docs, man pages and translations, as Debian's
#: slim images). Built once per CI run at most (.ci/run's image phase: downloading it takes minutes) into a
#: cache keyed by what goes into it, which later runs and the tests reuse.
DEBIAN_SUITE, DEBIAN_PACKAGES, DEBIAN_REF = "bookworm", ("python3",), "debian-python:12"
DEBIAN_CACHE = os.environ.get("ISOLATE_TEST_IMAGE_CACHE", "/var/tmp/isolate-test-images")
#: The host's own apt sources, pasted into the image's (mmdebstrap's default mirror when absent).
DEBIAN_SOURCES = "/etc/apt/sources.list.d/debian.sources"
_DEBIAN_OPTIONS = ("--variant=minbase", "--mode=root", "--skip=output/dev",
                   *(f"--dpkgopt=path-exclude=/usr/share/{d}/*" for d in ("doc", "man", "locale", "info")),
                   "--dpkgopt=path-include=/usr/share/doc/*/copyright")


def debian_why() -> str | None:
    """Why the Debian + python image cannot be built here (None: it can)."""
    if not shutil.which("mmdebstrap"):
        return "mmdebstrap is not installed (.ci/run's apt line installs it)"
    if os.geteuid() != 0:
        return "mmdebstrap builds the image as root only here (.ci/run's image phase builds it)"
    return None


def debian_key() -> str:
    """What the image is made of (mmdebstrap's version, options, suite, packages, apt sources, platform), hashed:
    the cache's key."""
    version = subprocess.run(["mmdebstrap", "--version"], capture_output=True, text=True,
                             timeout=60).stdout.strip() if shutil.which("mmdebstrap") else "?"
    try:
        with open(DEBIAN_SOURCES, "rb") as handle:
            sources = hashlib.sha256(handle.read()).hexdigest()
    except FileNotFoundError:
        sources = "default"
    parts = [version, *_DEBIAN_OPTIONS, DEBIAN_SUITE, *DEBIAN_PACKAGES, sources, *host_platform(), "layout 1"]
    return hashlib.sha256("\n".join(parts).encode()).hexdigest()[:16]


def _safe_cache(path: str) -> bool:
    """Whether a cache directory is root's or the caller's and no one else can write in it (it is in /var/tmp,
    where anyone can make one first)."""
    info = os.lstat(path)
    return stat.S_ISDIR(info.st_mode) and info.st_uid in (0, os.geteuid()) and not info.st_mode & 0o022


def debian_layout(build: bool = True) -> str | None:
    """The Debian + python image's OCI layout (ref DEBIAN_REF) in the cache: built when missing and ``build``
    (and debian_why() is None); None when it is missing and not built."""
    final = os.path.join(DEBIAN_CACHE, f"debian12-python3-{debian_key()}")
    if os.path.isdir(os.path.join(final, "blobs")):
        return final if _safe_cache(DEBIAN_CACHE) and _safe_cache(final) else None
    if not build or debian_why() is not None:
        return None
    os.makedirs(DEBIAN_CACHE, mode=0o755, exist_ok=True)
    if not _safe_cache(DEBIAN_CACHE):
        raise RuntimeError(f"{DEBIAN_CACHE} is writable by others or not root's: not used")
    work = tempfile.mkdtemp(prefix="building-", dir=DEBIAN_CACHE)
    try:
        rootfs = os.path.join(work, "rootfs.tar")
        mirror = [DEBIAN_SOURCES] if os.path.exists(DEBIAN_SOURCES) else []
        subprocess.run(["mmdebstrap", "--quiet", *_DEBIAN_OPTIONS, "--include=" + ",".join(DEBIAN_PACKAGES),
                        DEBIAN_SUITE, rootfs, *mirror], check=True, stdin=subprocess.DEVNULL, timeout=1800,
                       env=dict(os.environ, SOURCE_DATE_EPOCH="1700000000"))
        layout = os.path.join(work, "layout")
        _layout_of_tar(layout, rootfs, ref=DEBIAN_REF, Env=["PATH=/usr/local/sbin:/usr/local/bin:/usr/sbin:"
                                                              "/usr/bin:/sbin:/bin"], Cmd=["python3"])
        os.chmod(layout, 0o755)
        os.rename(layout, final)
        for name in os.listdir(DEBIAN_CACHE):  # those of other inputs: stale
            if name.startswith("debian12-python3-") and name != os.path.basename(final):
                shutil.rmtree(os.path.join(DEBIAN_CACHE, name), ignore_errors=True)
    finally:
        shutil.rmtree(work, ignore_errors=True)
    return final


def _layout_of_tar(path: str, tar_path: str, ref: str, **image_config: Any) -> None:
    """An OCI layout of one layer, a tar file on disk, gzipped (level 1) as it streams through: never held whole
    in memory."""
    blobs = os.path.join(path, "blobs", "sha256")
    os.makedirs(blobs)
    raw_hash, packed_hash, partial = hashlib.sha256(), hashlib.sha256(), os.path.join(blobs, "partial")

    class _Hashed(io.RawIOBase):
        def __init__(self, target: Any) -> None:
            self.target = target

        def writable(self) -> bool:
            return True

        def write(self, data: Any) -> int:
            packed_hash.update(data)
            return int(self.target.write(data))

    with open(tar_path, "rb") as source, open(partial, "wb") as target:
        with gzip.GzipFile(fileobj=_Hashed(target), mode="wb", compresslevel=1, mtime=0) as packer:
            while chunk := source.read(1 << 20):
                raw_hash.update(chunk)
                packer.write(chunk)
    size = os.path.getsize(partial)
    os.rename(partial, os.path.join(blobs, packed_hash.hexdigest()))
    os_, arch = host_platform()
    config = json.dumps({"architecture": arch, "os": os_, "config": image_config,
                         "rootfs": {"type": "layers", "diff_ids": ["sha256:" + raw_hash.hexdigest()]}}).encode()
    with open(os.path.join(blobs, digest(config)[7:]), "wb") as handle:
        handle.write(config)
    manifest = json.dumps({
        "schemaVersion": 2, "mediaType": "application/vnd.oci.image.manifest.v1+json",
        "config": {"mediaType": "application/vnd.oci.image.config.v1+json", "digest": digest(config),
                   "size": len(config)},
        "layers": [{"mediaType": "application/vnd.oci.image.layer.v1.tar+gzip",
                    "digest": "sha256:" + packed_hash.hexdigest(), "size": size}],
    }).encode()
    with open(os.path.join(blobs, digest(manifest)[7:]), "wb") as handle:
        handle.write(manifest)
    with open(os.path.join(path, "index.json"), "w") as handle:
        json.dump({"schemaVersion": 2, "manifests": [{
            "mediaType": "application/vnd.oci.image.manifest.v1+json", "digest": digest(manifest),
            "size": len(manifest), "annotations": {"org.opencontainers.image.ref.name": ref}}]}, handle)
    with open(os.path.join(path, "oci-layout"), "w") as handle:
        json.dump({"imageLayoutVersion": "1.0.0"}, handle)
    for root, dirs, files in os.walk(path):
        for name in dirs + files:
            os.chmod(os.path.join(root, name), 0o755 if name in dirs else 0o644)


if __name__ == "__main__":
    # `PYTHONPATH=. python3 tests/imagekit.py debian`: build the Debian + python image into the cache (CI's
    # image phase), or say why not; prints the layout's path.
    import sys

    if sys.argv[1:] != ["debian"]:
        sys.exit("usage: PYTHONPATH=. python3 tests/imagekit.py debian")
    why = debian_why()
    found = debian_layout(build=why is None)
    if found is None:
        sys.exit(f"the Debian + python image is not built: {why}")
    print(found)
