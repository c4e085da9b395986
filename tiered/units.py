"""Human-readable sizes ("8GiB", "512MB") and bandwidths ("12GB/s")."""

from __future__ import annotations

import re

_UNITS = {
    "": 1, "b": 1,
    "k": 1000, "kb": 1000, "m": 1000**2, "mb": 1000**2, "g": 1000**3, "gb": 1000**3,
    "t": 1000**4, "tb": 1000**4,
    "ki": 1024, "kib": 1024, "mi": 1024**2, "mib": 1024**2, "gi": 1024**3, "gib": 1024**3,
    "ti": 1024**4, "tib": 1024**4,
}
_SIZE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([a-zA-Z]*)\s*$")


def parse_size(value: object) -> int:
    """Bytes from an int or a string such as "1MiB", "8 GiB", "500MB"; raises ValueError."""
    if isinstance(value, bool):
        raise ValueError(f"expected a size such as '8GiB', got {value!r}")
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f"a size cannot be negative, got {value}")
        return value
    if isinstance(value, str):
        m = _SIZE.match(value)
        if m and m.group(2).lower() in _UNITS:
            n = float(m.group(1)) * _UNITS[m.group(2).lower()]
            if n != int(n):
                raise ValueError(f"size {value!r} is not a whole number of bytes")
            return int(n)
    raise ValueError(f"expected a size such as '8GiB' or '512MB', got {value!r}")


def parse_bandwidth(value: object) -> float:
    """Bytes per second from "12GB/s", "800 MiB/s" or a number of bytes per second."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        if value <= 0:
            raise ValueError(f"a bandwidth must be positive, got {value}")
        return float(value)
    if isinstance(value, str) and value.strip().lower().endswith("/s"):
        n = parse_size(value.strip()[:-2])
        if n <= 0:
            raise ValueError(f"a bandwidth must be positive, got {value!r}")
        return float(n)
    raise ValueError(f"expected a bandwidth such as '12GB/s', got {value!r}")


_SECONDS = {"s": 1, "sec": 1, "min": 60, "m": 60, "h": 3600, "d": 86400}


def parse_duration(value: object) -> float:
    """Seconds from "90s", "30min", "2h", "1d" or a number of seconds."""
    if isinstance(value, (int, float)) and not isinstance(value, bool):
        seconds = float(value)
    elif isinstance(value, str):
        m = re.fullmatch(r"\s*([0-9]+(?:\.[0-9]+)?)\s*([a-z]+)?\s*", value.lower())
        if not m or (m.group(2) or "s") not in _SECONDS:
            raise ValueError(f"expected a duration such as '90s', '30min' or '2h', got {value!r}")
        seconds = float(m.group(1)) * _SECONDS[m.group(2) or "s"]
    else:
        raise ValueError(f"expected a duration such as '90s', '30min' or '2h', got {value!r}")
    if seconds <= 0:
        raise ValueError(f"a duration must be positive, got {value!r}")
    return seconds


def format_size(n: float) -> str:
    """"2.41 GB" style, decimal units as disks and networks quote them."""
    for unit in ("B", "kB", "MB", "GB", "TB"):
        if abs(n) < 1000 or unit == "TB":
            return f"{n:.0f} {unit}" if unit == "B" else f"{n:.2f} {unit}"
        n /= 1000
    raise AssertionError("unreachable")


def format_rate(bytes_per_s: float) -> str:
    return f"{format_size(bytes_per_s)}/s"


def round_up(n: int, multiple: int) -> int:
    return -(-n // multiple) * multiple
