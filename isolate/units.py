"""Parsers for the sizes and durations that policies and flags accept."""

from __future__ import annotations

import math
import re

from .errors import PolicyError

_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)
_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}


def parse_size(value: object, field: str) -> int:
    """Bytes from ``value``: an int, or a string such as ``"64M"``, ``"1.5G"``, ``"512KiB"``.

    Suffixes are powers of 1024 and case-insensitive; a trailing ``B`` or
    ``iB`` is allowed. Raises ``PolicyError`` naming ``field``.
    """
    if isinstance(value, bool):
        raise PolicyError(f"{field}: expected a size such as 64M, got {value!r}", field)
    if isinstance(value, int):
        number = float(value)
        power = 0
    elif isinstance(value, float):
        number, power = value, 0
    elif isinstance(value, str):
        match = _SIZE.match(value)
        if not match or (match.group(3) and match.group(3).lower() == "ib" and not match.group(2)):
            raise PolicyError(
                f"{field}: {value!r} is not a size; write bytes or a number with K, M, G or T (e.g. 64M, 1.5G)",
                field,
            )
        number = float(match.group(1))
        power = _POWERS[match.group(2).lower()]
    else:
        raise PolicyError(f"{field}: expected a size such as 64M, got {type(value).__name__}", field)
    if not math.isfinite(number) or number < 0:
        raise PolicyError(f"{field}: a size cannot be negative ({value!r})", field)
    size = int(number * (1024**power))
    if size <= 0:
        raise PolicyError(f"{field}: a size must be more than zero bytes ({value!r})", field)
    return size


def parse_seconds(value: object, field: str) -> float:
    """Seconds from an int, a float or a numeric string; must be positive and finite."""
    if isinstance(value, bool):
        raise PolicyError(f"{field}: expected seconds, got {value!r}", field)
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        try:
            seconds = float(value.strip().removesuffix("s"))
        except ValueError:
            raise PolicyError(f"{field}: {value!r} is not a number of seconds (e.g. 5 or 0.5)", field) from None
    else:
        raise PolicyError(f"{field}: expected seconds, got {type(value).__name__}", field)
    if not math.isfinite(seconds) or seconds <= 0:
        raise PolicyError(f"{field}: seconds must be a positive number, got {value!r}", field)
    return seconds


def parse_count(value: object, field: str) -> int:
    """A positive whole number from an int or a numeric string."""
    if isinstance(value, bool):
        raise PolicyError(f"{field}: expected a whole number, got {value!r}", field)
    if isinstance(value, int):
        count = value
    elif isinstance(value, str) and value.strip().isdigit():
        count = int(value.strip())
    else:
        raise PolicyError(f"{field}: expected a positive whole number, got {value!r}", field)
    if count <= 0:
        raise PolicyError(f"{field}: must be a positive whole number, got {value!r}", field)
    return count


def format_size(size: int) -> str:
    """The shortest exact spelling of ``size`` with a 1024-power suffix."""
    for suffix, power in (("T", 4), ("G", 3), ("M", 2), ("K", 1)):
        unit = 1024**power
        if size % unit == 0:
            return f"{size // unit}{suffix}"
    return str(size)
