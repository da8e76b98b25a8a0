"""The engine: the SDK client for ``DOCKER_HOST``, what the engine supports, its errors, the image check."""

from __future__ import annotations

import contextlib
import os
import threading
from collections.abc import Iterator
from dataclasses import dataclass
from typing import Any

from ...model.errors import IsolationError, SetupError, UnsupportedError
from ...model.forks import fork_safe

#: Environment variable naming the image used when a policy names none.
IMAGE_ENV = "ISOLATE_DOCKER_IMAGE"
#: Seconds an engine request may take before it counts as unanswered.
ENGINE_TIMEOUT = 60.0


# --------------------------------------------------------------------------
# The engine


_client_lock = fork_safe(threading.Lock())
_clients: dict[tuple[str, ...], Any] = {}
_engines: dict[int, EngineInfo] = {}


def _env_key() -> tuple[str, ...]:
    return tuple(os.environ.get(name, "") for name in ("DOCKER_HOST", "DOCKER_TLS_VERIFY", "DOCKER_CERT_PATH"))


def engine_address() -> str:
    """Where the engine is looked for: ``$DOCKER_HOST`` or the default unix socket."""
    return os.environ.get("DOCKER_HOST") or "unix:///var/run/docker.sock"


def client() -> Any:
    """The ``docker.DockerClient`` for the current ``DOCKER_HOST``, made once per process.

    Raises ``UnsupportedError`` when the SDK is missing or no engine answers.
    """
    try:
        import docker
    except ImportError:
        raise UnsupportedError(
            "the docker backend needs the Python package 'docker'; install it (pip install docker)"
        ) from None
    key = _env_key()
    with _client_lock:
        found = _clients.get(key)
        if found is not None:
            return found
        try:
            made = docker.from_env(timeout=int(ENGINE_TIMEOUT))
            made.api.ping()
        except Exception as exc:  # the SDK raises DockerException, requests errors, OSError
            raise UnsupportedError(
                f"no Docker engine answers at {engine_address()} ({_short(exc)}); "
                "start dockerd or point DOCKER_HOST at a running engine"
            ) from None
        _clients[key] = made
        return made


@dataclass(frozen=True)
class EngineInfo:
    """What the engine says it can do (from ``/version`` and ``/info``)."""

    version: str
    api_version: str
    init: bool
    seccomp: bool
    memory_limit: bool
    swap_limit: bool
    pids_limit: bool
    cpu_cfs: bool
    cgroup_version: str


def engine_info(docker_client: Any | None = None) -> EngineInfo:
    """The capabilities of the engine, asked once per client."""
    cl = docker_client if docker_client is not None else client()
    found = _engines.get(id(cl))
    if found is not None:
        return found
    with _engine_errors("ask the engine what it supports"):
        version = cl.api.version()
        info = cl.api.info()
    options = " ".join(info.get("SecurityOptions") or [])
    made = EngineInfo(
        version=str(version.get("Version", "?")),
        api_version=str(version.get("ApiVersion", "?")),
        init=bool(info.get("InitBinary")),
        seccomp="seccomp" in options,
        memory_limit=bool(info.get("MemoryLimit")),
        swap_limit=bool(info.get("SwapLimit")),
        pids_limit=bool(info.get("PidsLimit")),
        cpu_cfs=bool(info.get("CpuCfsQuota")),
        cgroup_version=str(info.get("CgroupVersion", "1")),
    )
    _engines[id(cl)] = made
    return made


def available() -> tuple[bool, str]:
    """(True, "Docker Engine 20.10.24, API 1.41 at unix:///...") or (False, the reason)."""
    try:
        info = engine_info()
    except IsolationError as exc:
        return False, str(exc)
    return True, f"Docker Engine {info.version}, API {info.api_version} at {engine_address()}"


def _short(exc: BaseException) -> str:
    text = str(getattr(exc, "explanation", None) or exc).strip().splitlines()
    return text[0] if text else type(exc).__name__


@contextlib.contextmanager
def _engine_errors(step: str) -> Iterator[None]:
    """Turn SDK and transport errors into isolate errors naming ``step``."""
    try:
        yield
    except IsolationError:
        raise
    except Exception as exc:
        import docker.errors
        import requests.exceptions

        if isinstance(exc, docker.errors.ImageNotFound):
            raise UnsupportedError(
                f"docker: cannot {step}: the image is not in the engine and isolate never pulls ({_short(exc)}); "
                "build or pull it first, or choose another with --image / ISOLATE_DOCKER_IMAGE"
            ) from None
        if isinstance(exc, (requests.exceptions.ConnectionError, ConnectionError)):
            raise UnsupportedError(
                f"docker: cannot {step}: the engine at {engine_address()} stopped answering ({_short(exc)}); "
                "check that dockerd is running"
            ) from None
        if isinstance(exc, docker.errors.APIError):
            raise SetupError(f"docker: cannot {step}: {_short(exc)}", step="docker", detail=step) from None
        if isinstance(exc, (docker.errors.DockerException, requests.exceptions.RequestException, OSError)):
            raise SetupError(f"docker: cannot {step}: {_short(exc)}", step="docker", detail=step) from None
        raise


_images_seen: set[tuple[int, str]] = set()


def check_image(image: str, docker_client: Any | None = None) -> None:
    """Raise ``UnsupportedError`` unless ``image`` is in the engine (nothing is ever pulled)."""
    cl = docker_client if docker_client is not None else client()
    if (id(cl), image) in _images_seen:
        return
    import docker.errors

    try:
        cl.api.inspect_image(image)
    except docker.errors.NotFound:
        raise UnsupportedError(
            f"docker: the image {image!r} is not in the engine at {engine_address()} and isolate never pulls; "
            f"`docker pull {image}` (or build it), or choose another with --image / {IMAGE_ENV}"
        ) from None
    except Exception as exc:
        with _engine_errors(f"look up the image {image}"):
            raise exc
    _images_seen.add((id(cl), image))

