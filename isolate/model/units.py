"""Parsers for the sizes and durations that policies and flags accept."""

from __future__ import annotations

import math
import re

from .errors import PolicyError

# Numbers are ASCII digits only: str.isdigit, int() and float() take other scripts' digits ("\u0661\u0662\u0668"
# is 128 to int()), superscripts ("\u00b2" passes isdigit, then int() raises) and underscores ("1_000").
_SIZE = re.compile(r"[ \t]*([0-9]+(?:\.[0-9]*)?|\.[0-9]+)[ \t]*([kmgt]?)(i?b)?[ \t]*", re.IGNORECASE | re.ASCII)
_WHOLE = re.compile(r"[ \t]*([0-9]+)[ \t]*", re.ASCII)
_DECIMAL = re.compile(r"[ \t]*((?:[0-9]+(?:\.[0-9]*)?|\.[0-9]+)(?:e[+-]?[0-9]+)?)s?[ \t]*", re.IGNORECASE | re.ASCII)
#: More digits than any bound here has: refused before int() (which refuses past 4,300 digits itself).
_MAX_DIGITS = 40
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
        match = _SIZE.fullmatch(value) if len(value) <= _MAX_DIGITS else None
        if not match or (match.group(3) and match.group(3).lower() == "ib" and not match.group(2)):
            raise PolicyError(
                f"{field}: {value!r} is not a size; write bytes or a number with K, M, G or T (e.g. 64M, 1.5G)",
                field,
            )
        number = float(match.group(1))
        power = _POWERS[match.group(2).lower()]
    else:
        raise PolicyError(f"{field}: expected a size such as 64M, got {type(value).__name__}", field)
    if not math.isfinite(number):
        raise PolicyError(f"{field}: {value!r} is not a size", field)
    if number < 0:
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


def parse_seconds(value: object, field: str, minimum: float = MIN_SECONDS, why: str = "",
                  maximum: float = MAX_SECONDS, why_max: str = " seconds, 100 years") -> float:
    """Seconds from an int, a float or a string of ASCII digits (``1.5``, ``2e3``, ``5s``); finite, from
    ``minimum`` to ``maximum`` (``why``, ``why_max`` say why)."""
    if isinstance(value, bool):
        raise PolicyError(f"{field}: expected seconds, got {value!r}", field)
    if isinstance(value, (int, float)):
        seconds = float(value)
    elif isinstance(value, str):
        match = _DECIMAL.fullmatch(value) if len(value) <= _MAX_DIGITS else None
        if match is None:
            raise PolicyError(f"{field}: {value!r} is not a number of seconds (e.g. 5 or 0.5)", field)
        seconds = float(match.group(1))
    else:
        raise PolicyError(f"{field}: expected seconds, got {type(value).__name__}", field)
    if not math.isfinite(seconds) or seconds <= 0:
        raise PolicyError(f"{field}: seconds must be a positive number, got {value!r}", field)
    if seconds > maximum:
        raise PolicyError(f"{field}: {value!r} is too large (at most {maximum:.0f}{why_max})", field)
    if seconds < minimum:
        why = why or ", the millisecond the clocks count in"
        raise PolicyError(f"{field}: {value!r} is too short (at least {minimum:g} seconds{why})", field)
    return seconds


def milliseconds_up(seconds: float) -> int:
    """Whole milliseconds for a positive duration, rounded up: a limit is never 0 ("none")."""
    return max(1, math.ceil(seconds * 1000)) if seconds > 0 else 0


def parse_count(value: object, field: str, minimum: int = 1, why: str = "", maximum: int = MAX_COUNT,
                why_max: str = "") -> int:
    """A whole number from an int or a string of ASCII digits, from ``minimum`` to ``maximum`` (``why``,
    ``why_max`` say why)."""
    if isinstance(value, bool):
        raise PolicyError(f"{field}: expected a whole number, got {value!r}", field)
    if isinstance(value, int):
        count = value
    elif isinstance(value, str) and len(value) <= _MAX_DIGITS and (match := _WHOLE.fullmatch(value)):
        count = int(match.group(1))
    else:
        raise PolicyError(f"{field}: expected a positive whole number, got {value!r}", field)
    if count <= 0:
        raise PolicyError(f"{field}: must be a positive whole number, got {value!r}", field)
    if count > maximum:
        raise PolicyError(f"{field}: {value!r} is too large (at most {maximum}{why_max})", field)
    if count < minimum:
        raise PolicyError(f"{field}: {value!r} is too small (at least {minimum}{why})", field)
    return count


def whole_number(text: str) -> int:
    """A whole number written in ASCII digits, for argparse's ``type=`` (its message names the function):
    ``int()`` takes other scripts' digits, signs, spaces and underscores."""
    match = _WHOLE.fullmatch(text) if len(text) <= _MAX_DIGITS else None
    if match is None:
        raise ValueError(text)
    return int(match.group(1))


def format_size(size: int) -> str:
    """The shortest exact spelling of ``size`` with a 1024-power suffix."""
    for suffix, power in (("T", 4), ("G", 3), ("M", 2), ("K", 1)):
        unit = 1024**power
        if size % unit == 0:
            return f"{size // unit}{suffix}"
    return str(size)
