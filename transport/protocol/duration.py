"""Durations as Go writes them (``"100ms"``, ``"1m30s"``), plus days (``"7d"``).

The broker's flags (``actors.runtime.flags``) and its HTTP API (``/topic/config``'s
``retention_time``) read them the same way.
"""

from __future__ import annotations

import math
import re

__all__ = ["format_duration", "parse_duration"]

_UNITS = {
    "ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0,
    "d": 86400.0,
}  # fmt: skip
_PART = r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h|d)"
_GO_DURATION = re.compile(rf"([+-]?)((?:{_PART})+)")
_GO_PART = re.compile(_PART)
_NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?")


def parse_duration(value: object) -> float:
    """Seconds from a Go duration (``"1m30s"``, ``"100ms"``; ours adds days, ``"7d"``) or a
    plain number of seconds."""
    if isinstance(value, bool):
        msg = f"{value!r} is not a duration"
        raise ValueError(msg)
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip()
        if _NUMBER.fullmatch(text):
            seconds = float(text)
        elif m := _GO_DURATION.fullmatch(text):
            seconds = sum(float(n) * _UNITS[u] for n, u in _GO_PART.findall(m.group(2)))
            if m.group(1) == "-":
                seconds = -seconds
        else:
            msg = f'{value!r} is not a duration (examples: "100ms", "2s", "1m30s", "1h", 2.5)'
            raise ValueError(msg)
    else:
        msg = f"{value!r} is not a duration"
        raise ValueError(msg)
    if not math.isfinite(seconds):
        msg = f"{value!r} is not a finite duration"
        raise ValueError(msg)
    return seconds


def format_duration(seconds: float) -> str:
    """A short Go-style spelling of ``seconds``: ``0.1 -> "100ms"``, ``90 -> "1m30s"``."""
    if seconds < 0:
        return "-" + format_duration(-seconds)
    if seconds == 0:
        return "0s"
    if seconds < 1:
        ms = seconds * 1000
        return f"{ms:g}ms" if ms >= 1 else f"{seconds * 1e6:g}us"
    whole = int(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    secs_f = secs + (seconds - whole)
    parts = [f"{hours}h" if hours else "", f"{minutes}m" if minutes else ""]
    parts.append(f"{secs_f:g}s" if secs_f else "")
    return "".join(parts)
