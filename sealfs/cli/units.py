"""Sizes, durations and times: parsed as the command line takes them, shown as it shows them."""

from __future__ import annotations

import math
import re
import time

from sealfs.errors import ConfigError

_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([kmgt]?)i?b?\s*$", re.IGNORECASE)
_FACTOR = {"": 1, "k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}


def parse_size(text: str) -> int:
    """'512M', '2G', '1048576' -> bytes (binary units). Raises ConfigError."""
    match = _SIZE.match(text)
    if not match:
        raise ConfigError(f"invalid size {text!r}: use a number with an optional K, M, G or T")
    return int(float(match.group(1)) * _FACTOR[match.group(2).lower()])


def format_size(n: float) -> str:
    # Up to EiB: a sparse file may be as large as FUSE allows (2^63 - 1 bytes), and a
    # status line read "8388624.0 TiB".
    for unit in ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "EiB"):
        if abs(n) < 1024 or unit == "EiB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.1f} {unit}"
        n /= 1024
    raise AssertionError("unreachable")


def seconds(value: float, option: str, *, zero: bool = False, minimum: float = 0.0) -> float:
    """value, if it is a finite number of seconds, at least minimum: NaN passed a
    `<= 0` check and wedged the mount (a timer of NaN seconds fails inside the commit
    loop)."""
    if not math.isfinite(value) or value < 0 or (value == 0 and not zero):
        limit = "non-negative" if zero else "positive"
        raise ConfigError(f"{option} must be a {limit} number of seconds, not {value:g}")
    if value < minimum:
        raise ConfigError(f"{option} must be at least {minimum:g} seconds, not {value:g}")
    return value


def format_time(at_ns: int) -> str:
    """A time in nanoseconds since the epoch, local, as every line and table shows one."""
    try:
        return time.strftime("%Y-%m-%d %H:%M:%S", time.localtime(at_ns / 1e9))
    except (OverflowError, OSError, ValueError):  # a time no clock shows: an edited record
        return "at an unknown time"
