"""Image references, normalized as Docker does: ``python:3.12`` is ``docker.io/library/python:3.12``."""

from __future__ import annotations

import re
from dataclasses import dataclass

from ..model.errors import PolicyError

DEFAULT_REGISTRY = "docker.io"
DEFAULT_TAG = "latest"
_COMPONENT = re.compile(r"^[a-z0-9]+(?:(?:[._]|__|-+)[a-z0-9]+)*$")
_TAG = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,127}$")
_DIGEST = re.compile(r"^sha256:[0-9a-f]{64}$")
_HOST = re.compile(r"^(?:[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?(?:\.[A-Za-z0-9](?:[A-Za-z0-9-]*[A-Za-z0-9])?)*"
                   r"|\[[0-9A-Fa-f:.]+\])(?::[0-9]{1,5})?$")


@dataclass(frozen=True)
class Reference:
    """A parsed reference: registry host, repository, and a tag or a digest (or both)."""

    registry: str
    repository: str
    tag: str | None = None
    digest: str | None = None

    @classmethod
    def parse(cls, text: str) -> Reference:
        if not isinstance(text, str) or not text or len(text) > 4096 or text != text.strip():
            raise PolicyError(f"image {text!r}: not an image reference (NAME[:TAG][@sha256:DIGEST])", "image")
        rest, digest = text, None
        if "@" in rest:
            rest, digest = rest.split("@", 1)
            if not _DIGEST.match(digest):
                raise PolicyError(f"image {text!r}: the digest must be sha256: and 64 lowercase hex digits", "image")
        tag = None
        slash = rest.rfind("/")
        colon = rest.rfind(":")
        if colon > slash:
            rest, tag = rest[:colon], rest[colon + 1:]
            if not _TAG.match(tag):
                raise PolicyError(f"image {text!r}: {tag!r} is not a valid tag", "image")
        first, _, remainder = rest.partition("/")
        if remainder and ("." in first or ":" in first or first == "localhost" or first.startswith("[")):
            registry, path = first, remainder
            if not _HOST.match(registry):
                raise PolicyError(f"image {text!r}: {registry!r} is not a registry host", "image")
        else:
            registry, path = DEFAULT_REGISTRY, rest
        if registry in ("index.docker.io", "registry-1.docker.io"):
            registry = DEFAULT_REGISTRY
        if registry == DEFAULT_REGISTRY and "/" not in path:
            path = "library/" + path
        if not path or not all(_COMPONENT.match(part) for part in path.split("/")):
            raise PolicyError(f"image {text!r}: the repository must be lowercase letters, digits and separators",
                              "image")
        if tag is None and digest is None:
            tag = DEFAULT_TAG
        return cls(registry, path, tag, digest)

    @property
    def name(self) -> str:
        return f"{self.registry}/{self.repository}"

    def __str__(self) -> str:
        return self.name + (f":{self.tag}" if self.tag else "") + (f"@{self.digest}" if self.digest else "")

    @property
    def reference(self) -> str:
        """What the registry's manifest endpoint takes: the digest when there is one, else the tag."""
        return self.digest or self.tag or DEFAULT_TAG
