"""Parsers for the sizes and durations that policies and flags accept."""

from __future__ import annotations

import math
import re

from .errors import PolicyError

_SIZE = re.compile(r"^\s*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*([kmgt]?)(i?b)?\s*$", re.IGNORECASE)
_POWERS = {"": 0, "k": 1, "m": 2, "g": 3, "t": 4}

# Upper bounds, so that no value wraps or overflows on its way to the kernel
# (rlimits and cgroup files take 64-bit numbers, the init's clock a signed
# 64-bit count of milliseconds; RLIM_INFINITY is all ones).
MAX_SIZE = 2**62
MAX_SECONDS = 100 * 365 * 24 * 3600.0
MAX_COUNT = 2**31 - 1
#: Lower bounds: a duration shorter than the millisecond every clock isolate arms counts in is not
#: one it can keep (the limits set their own, larger, floors).
MIN_SECONDS = 0.001


def parse_size(value: object, field: str, minimum: int = 1, why: str = "") -> int:
    """Bytes from ``value``: an int, or a string such as ``"64M"``, ``"1.5G"``, ``"512KiB"``.

    Suffixes are powers of 1024 and case-insensitive; a trailing ``B`` or
    ``iB`` is allowed. At least ``minimum`` bytes (``why`` says why, in the
    message). Raises ``PolicyError`` naming ``field``.
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
    exact = number * (1024**power)
    size = math.ceil(exact) if math.isfinite(exact) else MAX_SIZE + 1
    if size <= 0:
        raise PolicyError(f"{field}: a size must be more than zero bytes ({value!r})", field)
    if size > MAX_SIZE:
        raise PolicyError(f"{field}: {value!r} is too large (at most {format_size(MAX_SIZE)})", field)
    if size < minimum:
        raise PolicyError(f"{field}: {value!r} is too small (at least {format_size(minimum)}{why})", field)
    return size


def parse_seconds(value: object, field: str, minimum: float = MIN_SECONDS, why: str = "") -> float:
    """Seconds from an int, a float or a numeric string; finite, at least ``minimum`` (``why`` says why)."""
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
    if seconds > MAX_SECONDS:
        raise PolicyError(f"{field}: {value!r} is too long (at most {MAX_SECONDS:.0f} seconds, 100 years)", field)
    if seconds < minimum:
        why = why or ", the millisecond the clocks count in"
        raise PolicyError(f"{field}: {value!r} is too short (at least {minimum:g} seconds{why})", field)
    return seconds


def milliseconds_up(seconds: float) -> int:
    """Whole milliseconds for a positive duration, rounded up: a limit is never 0 ("none")."""
    return max(1, math.ceil(seconds * 1000)) if seconds > 0 else 0


def parse_count(value: object, field: str, minimum: int = 1, why: str = "") -> int:
    """A whole number from an int or a numeric string, at least ``minimum`` (``why`` says why)."""
    if isinstance(value, bool):
        raise PolicyError(f"{field}: expected a whole number, got {value!r}", field)
    if isinstance(value, int):
        count = value
    elif isinstance(value, str) and value.strip().isascii() and value.strip().isdigit():
        count = int(value.strip())
    else:
        raise PolicyError(f"{field}: expected a positive whole number, got {value!r}", field)
    if count <= 0:
        raise PolicyError(f"{field}: must be a positive whole number, got {value!r}", field)
    if count > MAX_COUNT:
        raise PolicyError(f"{field}: {value!r} is too large (at most {MAX_COUNT})", field)
    if count < minimum:
        raise PolicyError(f"{field}: {value!r} is too small (at least {minimum}{why})", field)
    return count


def format_size(size: int) -> str:
    """The shortest exact spelling of ``size`` with a 1024-power suffix."""
    for suffix, power in (("T", 4), ("G", 3), ("M", 2), ("K", 1)):
        unit = 1024**power
        if size % unit == 0:
            return f"{size // unit}{suffix}"
    return str(size)
