"""The OpenSandbox request and response shapes, and how a create request becomes an isolate policy.

Pure data: nothing here runs anything. Every field of a request is checked
by hand (the API is small) and a request the server cannot honour is
refused with ``ApiError`` (HTTP 400 and the API's ``{"code", "message"}``)
naming the field, rather than half-honoured.
"""

from __future__ import annotations

import dataclasses
import math
import os
import platform
import re
import stat as stat_mod
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

from ..model.errors import IsolationError, PolicyError
from ..model.policy import Limits, Policy

#: The port the SDK asks for to reach a sandbox's execution API, and the egress sidecar's.
EXECD_PORT = 44772
EGRESS_PORT = 18080
#: The entrypoint the SDK sends when the caller gives none: a keep-alive, nothing to run.
KEEPALIVE_ENTRYPOINT = ["tail", "-f", "/dev/null"]
#: The longest timeout (seconds) a create or renew may ask for: 30 days.
MAX_TIMEOUT = 30 * 24 * 3600


class ApiError(Exception):
    """An error answered with the API's shape: ``{"code": ..., "message": ...}`` and an HTTP status."""

    def __init__(self, status: int, code: str, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message

    def __reduce__(self) -> tuple[type[ApiError], tuple[int, str, str]]:
        # As itself through pickle: a code context on a Ray node refuses with it (isolate/ray/host.py).
        return ApiError, (self.status, self.code, self.message)


def bad_request(message: str, code: str = "INVALID_REQUEST") -> ApiError:
    return ApiError(400, code, message)


def iso(ts: float | None) -> str | None:
    """RFC 3339 UTC with milliseconds, as the API writes times."""
    if ts is None:
        return None
    return datetime.fromtimestamp(ts, timezone.utc).isoformat(timespec="milliseconds").replace("+00:00", "Z")


def bounded(value: object, name: str, low: float, high: float, unit: str) -> float:
    """A JSON number of the request within [low, high], compared before any arithmetic: a bool, NaN, an
    infinity or an integer too large for a float is refused (400) with the same message as one out of range."""
    if isinstance(value, bool) or not isinstance(value, (int, float)) or \
            (isinstance(value, float) and not math.isfinite(value)) or not low <= value <= high:
        raise bad_request(f"{name}: expected {unit} from {low:g} to {high:g}")
    return float(value)


def parse_time(value: object, name: str) -> float:
    if not isinstance(value, str) or not value:
        raise bad_request(f"{name}: expected an RFC 3339 time such as 2030-01-01T00:00:00Z")
    try:
        when = datetime.fromisoformat(value.replace("Z", "+00:00").replace("z", "+00:00"))
    except ValueError:
        raise bad_request(f"{name}: {value[:64]!r} is not an RFC 3339 time") from None
    if when.tzinfo is None:
        when = when.replace(tzinfo=timezone.utc)
    return when.timestamp()


# -- Kubernetes quantities (resourceLimits) ------------------------------------------

_QUANTITY = re.compile(r"^([0-9]+(?:\.[0-9]+)?|\.[0-9]+)(Ki|Mi|Gi|Ti|Pi|Ei|k|K|M|G|T|P|E|m)?$")
_BINARY = {"Ki": 1, "Mi": 2, "Gi": 3, "Ti": 4, "Pi": 5, "Ei": 6}
_DECIMAL = {"k": 1, "K": 1, "M": 2, "G": 3, "T": 4, "P": 5, "E": 6}


def quantity(value: object, name: str) -> float:
    """A Kubernetes quantity ("512Mi", "1G", "500m", "2") as a number."""
    if isinstance(value, bool) or not isinstance(value, (str, int, float)):
        raise bad_request(f"{name}: expected a quantity such as \"512Mi\" or \"500m\"")
    text = str(value).strip()
    match = _QUANTITY.fullmatch(text)
    if not match:
        raise bad_request(f"{name}: {text[:32]!r} is not a quantity (e.g. 512Mi, 2Gi, 500m, 1)")
    number, suffix = float(match.group(1)), match.group(2) or ""
    if suffix == "m":
        number /= 1000
    elif suffix in _BINARY:
        number *= 1024 ** _BINARY[suffix]
    elif suffix in _DECIMAL:
        number *= 1000 ** _DECIMAL[suffix]
    if not math.isfinite(number) or number <= 0:
        raise bad_request(f"{name}: {text!r} must be more than zero")
    return number


def limits_from(resource: object, base: Limits) -> Limits:
    """resourceLimits → isolate Limits: memory (bytes, the cgroup's limit) and cpu (CPU bandwidth)."""
    if resource is None:
        return base
    if not isinstance(resource, Mapping):
        raise bad_request("resourceLimits: expected an object such as {\"cpu\": \"1\", \"memory\": \"2Gi\"}")
    changes: dict[str, Any] = {}
    for key, value in resource.items():
        if key == "memory":
            changes["memory"] = math.ceil(quantity(value, "resourceLimits.memory"))
        elif key == "cpu":
            changes["cpus"] = quantity(value, "resourceLimits.cpu")
        elif key in ("gpu", "nvidia.com/gpu") and str(value).strip() == "0":
            continue  # no GPU asked for
        else:
            raise bad_request(f"resourceLimits.{key}: not supported by this server (it maps cpu and memory)")
    try:
        return dataclasses.replace(base, **changes)
    except PolicyError as exc:
        raise bad_request(f"resourceLimits: {exc}") from None


def network_from(policy: object, base: Policy) -> Any:
    """networkPolicy → isolate's network: deny → loopback (its own), deny + allow rules → an allow-list,
    allow → host."""
    if policy is None or policy == {}:
        return base.network
    if not isinstance(policy, Mapping):
        raise bad_request("networkPolicy: expected an object with defaultAction and egress")
    unknown = set(policy) - {"defaultAction", "egress"}
    if unknown:
        raise bad_request(f"networkPolicy: unknown field {sorted(unknown)[0]!r}")
    action = policy.get("defaultAction", "deny")
    rules = policy.get("egress") or []
    if action not in ("allow", "deny"):
        raise bad_request("networkPolicy.defaultAction: expected allow or deny")
    if not isinstance(rules, list):
        raise bad_request("networkPolicy.egress: expected a list of {action, target}")
    allow: list[str] = []
    for i, rule in enumerate(rules):
        if not isinstance(rule, Mapping) or not isinstance(rule.get("target"), str) or \
                rule.get("action") not in ("allow", "deny"):
            raise bad_request(f"networkPolicy.egress[{i}]: expected {{\"action\": allow|deny, \"target\": HOST}}")
        if rule["action"] == "deny":
            if action == "deny":
                continue  # denied anyway
            raise bad_request(f"networkPolicy.egress[{i}]: deny rules under defaultAction allow cannot be "
                              "enforced here (isolate filters by allow-list); use defaultAction deny with allow "
                              "rules")
        allow.append(rule["target"])
    if action == "allow":
        return "host"
    if not allow:
        return "loopback"  # a loopback of its own (what listens in it can be reached by its endpoints), no way out
    # An allow-list: isolate.Egress, enforced where the policy layer supports it (else refused at start).

    try:
        return egress_with(allow, base.network)
    except PolicyError as exc:
        raise bad_request(f"networkPolicy: {exc}") from None


def egress_with(hosts: list[str], profile: object) -> Any:
    """An allow-list of ``hosts`` under a profile's network: its static names (those the hosts allow),
    its resolver and allow_private stay the operator's."""
    from ..model import egress_rules
    from ..model.policy import Egress

    if not isinstance(profile, Egress):
        return Egress(tuple(hosts))
    rules = Egress(tuple(hosts)).rules()
    static = tuple(entry for entry in profile.add_hosts
                   if rules.ports_of(egress_rules.parse_static_host(entry)[0]))
    return Egress(tuple(hosts), add_hosts=static, resolver=profile.resolver, allow_private=profile.allow_private)


@dataclass(frozen=True)
class VolumeSpec:
    """A volume of a create request, its shape checked (isolate.server.volumes checks the host side).

    A host volume names ``host_path``; a named (``pvc``) one names ``claim``, a directory of the server's
    volume store, and ``host_path`` is then its subPath ("" for the whole volume)."""

    name: str
    host_path: str
    mount_path: str
    read_only: bool
    claim: str | None = None
    #: pvc: createIfNotExists, and deleteOnSandboxTermination (of a volume this create made).
    create: bool = True
    delete_on_end: bool = False


@dataclass(frozen=True)
class CreateRequest:
    """A create request, checked and mapped."""

    image: str
    policy: Policy
    timeout: float | None
    metadata: dict[str, str]
    entrypoint: list[str]
    env: dict[str, str] = field(default_factory=dict)
    #: The snapshot (API id) the sandbox starts from, if any.
    snapshot_id: str | None = None
    volumes: tuple[VolumeSpec, ...] = ()
    #: credentialProxy.enabled: the sandbox may be given a credential vault (isolate.egress.vault).
    credential_proxy: bool = False
    #: extensions["access.renew.extend.seconds"]: each access through this server renews the expiry to now
    #: plus this many seconds (OSEP-0009).
    renew_on_access: int | None = None
    #: image.auth: the (username, password) the registry of an image reference is pulled with (never kept).
    image_auth: tuple[str, str] | None = field(default=None, repr=False)


_DNS_LABEL = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?$")
_VOLUME_KINDS = {
    "ossfs": "OSS buckets are not mounted by this server (no ossfs): mount the bucket on the host below a "
             "--volume-root directory and give that as a host volume",
}


def parse_volumes(value: object) -> tuple[VolumeSpec, ...]:
    """The spec's volumes: host ones checked for shape; PVC, OSSFS and other kinds refused with the way out."""
    if value is None:
        return ()
    if not isinstance(value, list):
        raise bad_request("volumes: expected a list of {name, host: {path}, mountPath, readOnly, subPath}")
    out: list[VolumeSpec] = []
    for i, vol in enumerate(value):
        where = f"volumes[{i}]"
        if not isinstance(vol, Mapping):
            raise bad_request(f"{where}: expected an object")
        unknown = sorted(set(vol) - {"name", "host", "pvc", "ossfs", "mountPath", "readOnly", "subPath"})
        if unknown:
            raise bad_request(f"{where}.{unknown[0]}: unknown field of Volume")
        name = vol.get("name")
        if not isinstance(name, str) or len(name) > 63 or not _DNS_LABEL.fullmatch(name):
            raise bad_request(f"{where}.name: expected a DNS label (a-z, 0-9, -; up to 63)")
        if any(v.name == name for v in out):
            raise bad_request(f"{where}.name: {name!r} names two volumes")
        kinds = [k for k in ("host", "pvc", "ossfs") if vol.get(k) is not None]
        if len(kinds) != 1:
            raise bad_request(f"{where}: exactly one of host, pvc, ossfs is expected")
        if kinds[0] == "ossfs":
            raise bad_request(f"{where}.{kinds[0]}: {_VOLUME_KINDS[kinds[0]]}", "VOLUME_NOT_SUPPORTED")
        claim, create, delete_on_end = _claim(vol.get("pvc"), where) if kinds[0] == "pvc" else (None, True, False)
        host = vol.get("host") if claim is None else {"path": "/"}
        if not isinstance(host, Mapping) or set(host) != {"path"} or not isinstance(host["path"], str) or \
                not host["path"].startswith("/") or "\0" in host["path"]:
            raise bad_request(f"{where}.host: expected {{\"path\": ABSOLUTE HOST PATH}}")
        mount_path = vol.get("mountPath")
        if not isinstance(mount_path, str) or not mount_path.startswith("/") or "\0" in mount_path:
            raise bad_request(f"{where}.mountPath: expected an absolute path inside the sandbox")
        read_only = vol.get("readOnly", False)
        if not isinstance(read_only, bool):
            raise bad_request(f"{where}.readOnly: expected true or false")
        path = host["path"]
        sub = vol.get("subPath")
        if sub is not None:
            if not isinstance(sub, str) or sub.startswith("/") or "\0" in sub or ".." in sub.split("/"):
                raise bad_request(f"{where}.subPath: expected a relative path without '..'")
            path = path.rstrip("/") + "/" + sub
        if any(v.mount_path.rstrip("/") == mount_path.rstrip("/") for v in out):
            raise bad_request(f"{where}.mountPath: {mount_path} is the mount path of two volumes")
        if claim is not None:
            path = path.lstrip("/")  # the subPath within the named volume
        out.append(VolumeSpec(name, path, mount_path, read_only, claim, create, delete_on_end))
    return tuple(out)


def _claim(pvc: object, where: str) -> tuple[str, bool, bool]:
    """A pvc volume: its claimName (a DNS label: one directory name of the volume store) and flags."""
    known = {"claimName", "createIfNotExists", "deleteOnSandboxTermination", "storageClass", "storage", "accessModes"}
    if not isinstance(pvc, Mapping) or set(pvc) - known:
        raise bad_request(f"{where}.pvc: expected {{\"claimName\": NAME, ...}} ({', '.join(sorted(known))})")
    claim = pvc.get("claimName")
    if not isinstance(claim, str) or len(claim) > 253 or not _DNS_LABEL.fullmatch(claim):
        raise bad_request(f"{where}.pvc.claimName: expected a DNS label (a-z, 0-9, -)")
    flags = [pvc.get("createIfNotExists", True), pvc.get("deleteOnSandboxTermination", False)]
    if not all(isinstance(flag, bool) for flag in flags):
        raise bad_request(f"{where}.pvc: createIfNotExists and deleteOnSandboxTermination are true or false")
    # storageClass, storage and accessModes are Kubernetes' provisioning hints, ignored for a named volume
    # that is a directory (as the spec has Docker ignore them).
    return claim, bool(flags[0]), bool(flags[1])


def _str_map(value: object, name: str) -> dict[str, str]:
    if value is None:
        return {}
    if not isinstance(value, Mapping) or not all(isinstance(k, str) and isinstance(v, str)
                                                  for k, v in value.items()):
        raise bad_request(f"{name}: expected an object of string values")
    return dict(value)


# Kubernetes label rules, which the spec puts on metadata: a name (63 characters at most, alphanumeric
# at both ends, -_. inside), optionally after a DNS subdomain prefix and a slash; values likewise (or empty).
_LABEL_NAME = re.compile(r"^[A-Za-z0-9]([-A-Za-z0-9_.]*[A-Za-z0-9])?$")
_DNS_SUBDOMAIN = re.compile(r"^[a-z0-9]([-a-z0-9]*[a-z0-9])?(\.[a-z0-9]([-a-z0-9]*[a-z0-9])?)*$")


def check_metadata(metadata: Mapping[str, object]) -> None:
    """Refuse (400 INVALID_METADATA_LABEL) a key or value the spec's label rules do not allow."""
    for key, value in metadata.items():
        if key.startswith("opensandbox.io/"):
            raise bad_request(f"metadata.{key}: keys under opensandbox.io/ are reserved", "INVALID_METADATA_LABEL")
        prefix, slash, name = key.rpartition("/")
        if not (len(name) <= 63 and _LABEL_NAME.fullmatch(name)
                and (not slash or (len(prefix) <= 253 and _DNS_SUBDOMAIN.fullmatch(prefix)))):
            raise bad_request(f"metadata: key {key[:80]!r} is not a label name (up to 63 of A-Z a-z 0-9 - _ ., "
                              "alphanumeric at both ends, optionally after a DNS subdomain and /)",
                              "INVALID_METADATA_LABEL")
        if value is not None and not (isinstance(value, str) and len(value) <= 63
                                      and (value == "" or _LABEL_NAME.fullmatch(value))):
            raise bad_request(f"metadata.{key}: value {str(value)[:80]!r} is not a label value (up to 63 of "
                              "A-Z a-z 0-9 - _ ., alphanumeric at both ends)", "INVALID_METADATA_LABEL")


def _empty(value: object) -> bool:
    return value is None or value == {} or value == [] or value is False


#: OSEP-0009's extension, and the bounds it gives it (5 minutes to a day).
RENEW_ON_ACCESS = "access.renew.extend.seconds"
RENEW_ON_ACCESS_RANGE = (300, 86400)


def parse_extensions(value: object) -> int | None:
    """The create request's extensions: renew-on-access (seconds) or None; any other key is refused."""
    if value is None or value == {}:
        return None
    if not isinstance(value, Mapping) or not all(isinstance(v, str) for v in value.values()):
        raise bad_request("extensions: expected an object of string values")
    unknown = sorted(set(value) - {RENEW_ON_ACCESS})
    if unknown:
        raise bad_request(f"extensions.{unknown[0][:80]}: not an extension this server knows (it knows "
                          f"{RENEW_ON_ACCESS})")
    text = value.get(RENEW_ON_ACCESS)
    if text is None:
        return None
    low, high = RENEW_ON_ACCESS_RANGE
    if not (text.isascii() and text.isdigit() and low <= int(text) <= high):
        raise bad_request(f"extensions.{RENEW_ON_ACCESS}: expected whole seconds from {low} to {high}, as a string")
    return int(text)


def parse_create(body: object, profiles: Mapping[str, Policy], any_image: Policy | None,
                 snapshot_image: Callable[[str], str] | None = None) -> CreateRequest:
    """Map a CreateSandboxRequest onto a policy; refuse what cannot be honoured.

    ``snapshot_image`` gives the image a snapshot's sandbox had (its profile is the new sandbox's), or
    raises ApiError when there is no such snapshot; without it, snapshotId is refused."""
    if not isinstance(body, Mapping):
        raise bad_request("the body must be a JSON object (CreateSandboxRequest)")
    known = {"image", "snapshotId", "templateId", "platform", "timeout", "resourceLimits", "resourceRequests", "env",
             "metadata", "entrypoint", "networkPolicy", "credentialProxy", "secureAccess", "volumes", "extensions",
             "lifecycle"}
    unknown = sorted(set(body) - known)
    if unknown:
        raise bad_request(f"{unknown[0]}: unknown field of CreateSandboxRequest")
    if body.get("templateId") is not None:
        raise bad_request("templateId: templates are not supported by this server; give image (or snapshotId)")
    for name in ("lifecycle", "resourceRequests"):
        if not _empty(body.get(name)):
            raise bad_request(f"{name}: not supported by this server")
    renew_on_access = parse_extensions(body.get("extensions"))
    credential = body.get("credentialProxy")
    if credential is not None and (not isinstance(credential, Mapping) or set(credential) - {"enabled"}
                                   or not isinstance(credential.get("enabled", False), bool)):
        raise bad_request("credentialProxy: expected {\"enabled\": true|false}")
    credential_proxy = bool(credential and credential.get("enabled"))
    plat = body.get("platform")
    if plat is not None:
        arch = {"x86_64": "amd64", "aarch64": "arm64"}.get(platform.machine(), platform.machine())
        if not isinstance(plat, Mapping) or plat.get("os") != "linux" or plat.get("arch") != arch:
            raise bad_request(f"platform: this server runs linux/{arch} only")
    image = body.get("image")
    snapshot_id = body.get("snapshotId")
    if snapshot_id is not None:
        if image is not None:
            raise bad_request("image, snapshotId: give exactly one startup source")
        if not isinstance(snapshot_id, str) or not snapshot_id:
            raise bad_request("snapshotId: expected a snapshot's id (GET /v1/snapshots)")
        if snapshot_image is None:
            raise bad_request("snapshotId: snapshots are not served here")
        uri = snapshot_image(snapshot_id)
    image_auth = None
    if snapshot_id is None:
        if not isinstance(image, Mapping) or not isinstance(image.get("uri"), str) or not image["uri"]:
            raise bad_request("image: expected {\"uri\": NAME}; a policy profile's name, or an image reference "
                              "(with --profile)")
        uri = image["uri"]
        image_auth = _image_auth(image.get("auth"))
        if image_auth is not None and uri in profiles:
            raise bad_request(f"image.auth: {uri[:80]!r} names a policy profile of this server, not an image of a "
                              "registry")
    base = profiles.get(uri, any_image)
    if base is None:
        names = ", ".join(sorted(profiles)) or "none"
        raise bad_request(f"image {uri[:80]!r}: this server maps image names to isolate policy profiles and has "
                          f"none by that name (it has: {names}); start it with --image {uri[:40]}=PROFILE.toml, or "
                          "--profile FILE to run any image reference under that policy", "IMAGE_NOT_SUPPORTED")
    if uri not in profiles:
        # Any other name is an image reference: the sandbox's root is that image (pulled into this server's
        # image store when it is not there), natively, under the --profile policy; a snapshot's sandbox's
        # image (its root layer lies over it).
        from ..image import Reference

        try:
            uri = str(Reference.parse(uri))
        except IsolationError as exc:
            raise bad_request(f"image {uri[:80]!r}: {exc}", "IMAGE_NOT_SUPPORTED") from None
        base = base.replace(image=uri)
    timeout = body.get("timeout")
    if timeout is not None:
        # An integer is compared as one: a 400-digit timeout must not reach float() (OverflowError).
        timeout = bounded(timeout, "timeout", 0, MAX_TIMEOUT, "seconds (or null for no expiry)")
        if timeout == 0:
            raise bad_request(f"timeout: expected seconds more than 0 and at most {MAX_TIMEOUT} (or null for no "
                              "expiry)")
    env = _str_map(body.get("env"), "env")
    metadata = _str_map(body.get("metadata"), "metadata")
    check_metadata(metadata)
    entrypoint = body.get("entrypoint", KEEPALIVE_ENTRYPOINT)
    if entrypoint is None:
        entrypoint = KEEPALIVE_ENTRYPOINT
    if not isinstance(entrypoint, list) or not entrypoint or not all(isinstance(a, str) for a in entrypoint) \
            or not entrypoint[0]:
        raise bad_request("entrypoint: expected a non-empty list of strings, the first a program (not empty)")
    try:
        policy = base.replace(limits=limits_from(body.get("resourceLimits"), base.limits),
                              network=network_from(body.get("networkPolicy"), base),
                              env={**base.env, **env})
    except PolicyError as exc:
        raise bad_request(str(exc)) from None
    if credential_proxy and not hasattr(policy.network, "hosts"):
        raise bad_request("credentialProxy: the vault's credentials are added by isolate's egress mediator, which a "
                          "sandbox goes through only with an allow-list: give networkPolicy {\"defaultAction\": "
                          "\"deny\", \"egress\": [{\"action\": \"allow\", \"target\": HOST}]} for the hosts "
                          "its bindings name")
    return CreateRequest(uri, policy, timeout, metadata, list(entrypoint), env, snapshot_id,
                         parse_volumes(body.get("volumes")), credential_proxy, renew_on_access, image_auth)


def _image_auth(value: object) -> tuple[str, str] | None:
    """image.auth: {"username", "password"} for the image's registry (ImageSpec's auth), or None."""
    if value is None or value == {}:
        return None
    if not isinstance(value, Mapping) or set(value) - {"username", "password"} or not all(
            isinstance(value.get(k), str) and value.get(k) for k in ("username", "password")):
        raise bad_request("image.auth: expected {\"username\": USER, \"password\": SECRET}")
    username, password = str(value["username"]), str(value["password"])
    if len(username) > 1024 or len(password) > 16384 or ":" in username:
        raise bad_request("image.auth: a username of at most 1024 characters without ':', a password of at most "
                          "16384")
    return username, password


# -- files ------------------------------------------------------------------------------

def octal_mode(value: object, name: str, default: int) -> int:
    """The API's mode: octal digits written as a decimal number (755 means 0o755)."""
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise bad_request(f"{name}: expected octal digits such as 644 or 755")
    digits = str(value)
    if any(c not in "01234567" for c in digits) or len(digits) > 4:
        raise bad_request(f"{name}: {value} is not a mode in octal digits (e.g. 644, 755)")
    return int(digits, 8)


def mode_digits(mode: int) -> int:
    return int(f"{stat_mod.S_IMODE(mode):o}")


def file_type(mode: int) -> str:
    if stat_mod.S_ISREG(mode):
        return "file"
    if stat_mod.S_ISDIR(mode):
        return "directory"
    if stat_mod.S_ISLNK(mode):
        return "symlink"
    return "other"


def name_of(uid: int, kind: str) -> str:
    import grp
    import pwd

    try:
        return pwd.getpwuid(uid).pw_name if kind == "user" else grp.getgrgid(uid).gr_name
    except (KeyError, OverflowError):
        return str(uid)


def file_info(path: str, mode: int, size: int, mtime_ns: int, uid: int | None = None,
              gid: int | None = None) -> dict[str, Any]:
    when = iso(mtime_ns / 1e9)
    return {"path": path, "type": file_type(mode), "size": size, "modified_at": when, "created_at": when,
            "owner": name_of(uid, "user") if uid is not None else "", "group": name_of(gid, "group") if gid is not None
            else "", "mode": mode_digits(mode)}


def absolute(path: str, workdir: str) -> str:
    return path if path.startswith("/") else os.path.normpath(os.path.join(workdir, path))
