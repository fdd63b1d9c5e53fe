"""The lookup daemon's options: nsqlookupd 1.3's flags, names and defaults (on loopback).

``python -m actors.lookupd --help`` lists them; a TOML ``--config`` file takes
the same keys (``tcp_address`` or ``tcp-address``), flags override it
(:mod:`actors.runtime.flags`).
"""

from __future__ import annotations

import dataclasses
import socket
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from actors.runtime import flags
from actors.runtime.flags import LOG_LEVELS, check_host_port, fail, format_duration, opt

__all__ = ["LookupdOptions", "parse_options"]


@dataclass(frozen=True)
class LookupdOptions:
    """Every option of ``python -m actors.lookupd``; see each field's ``help``."""

    tcp_address: str = opt("127.0.0.1:4160", "address", "<addr>:<port> for brokers (TCP V1)")
    http_address: str = opt("127.0.0.1:4161", "address", "<addr>:<port> for HTTP clients")
    broadcast_address: str | None = opt(
        None, "str?", "address of this lookupd node (default: the hostname)")
    inactive_producer_timeout: float = opt(
        300.0, "duration", "how long a broker stays listed since its last PING")
    tombstone_lifetime: float = opt(
        45.0, "duration", "how long a tombstoned broker stays hidden from a topic's lookups")
    log_level: str = opt("info", "log_level", "log verbosity: " + ", ".join(LOG_LEVELS))
    shutdown_timeout: float = opt(5.0, "duration", "longest orderly shutdown")
    debug_hooks: bool = opt(False, "bool", "enable debug-only operations (chaos tests)")

    def __post_init__(self) -> None:
        for name in ("tcp_address", "http_address"):
            check_host_port(name, getattr(self, name))
        if self.log_level not in LOG_LEVELS:
            raise fail("log_level",
                       f"must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        for name in ("inactive_producer_timeout", "tombstone_lifetime", "shutdown_timeout"):
            if getattr(self, name) <= 0:
                raise fail(name, f"must be a positive duration, got "
                                 f"{format_duration(getattr(self, name))}")
        if self.broadcast_address is not None and not self.broadcast_address:
            raise fail("broadcast_address", "must not be empty")

    def resolved(self) -> LookupdOptions:
        """A copy with ``broadcast_address`` filled in (the hostname)."""
        if self.broadcast_address is None:
            return dataclasses.replace(self, broadcast_address=socket.gethostname())
        return self

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def build_parser(prog: str = "python -m actors.lookupd") -> Any:
    return flags.build_parser(
        LookupdOptions, prog,
        "The lookup daemon: brokers announce their topics and channels here, and "
        "consumers ask where a topic lives (nsqlookupd's protocols).")


def parse_options(argv: Sequence[str] | None = None) -> LookupdOptions:
    """Defaults < ``--config FILE`` < flags, validated and resolved."""
    return LookupdOptions(**flags.parse_flags(LookupdOptions, build_parser(), argv)).resolved()

