"""The console's options: nsqadmin 1.3's flags where they apply, on loopback.

``python -m actors.admin --help`` lists them; a TOML ``--config`` file takes the
same keys, flags override it (:mod:`actors.runtime.flags`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from actors.runtime import flags
from actors.runtime.flags import LOG_LEVELS, check_host_port, fail, opt

__all__ = ["AdminOptions", "parse_options"]


@dataclass(frozen=True)
class AdminOptions:
    """Every option of ``python -m actors.admin``; see each field's ``help``."""

    http_address: str = opt("127.0.0.1:4171", "address", "<addr>:<port> of the web console")
    lookupd_http_address: tuple[str, ...] = opt(
        (), "address[]", "lookup daemon HTTP <addr>:<port> (repeatable)")
    nsqd_http_address: tuple[str, ...] = opt(
        (), "address[]", "broker HTTP <addr>:<port>, for brokers without a lookup daemon "
        "(repeatable)")
    base_path: str = opt("/", "str", "URL path the console is served under (behind a proxy)")
    log_level: str = opt("info", "log_level", "log verbosity: " + ", ".join(LOG_LEVELS))
    http_timeout: float = opt(5.0, "duration", "longest wait for a broker or lookup daemon")

    def __post_init__(self) -> None:
        check_host_port("http_address", self.http_address)
        for name in ("lookupd_http_address", "nsqd_http_address"):
            for address in getattr(self, name):
                check_host_port(name, address)
        if not self.lookupd_http_address and not self.nsqd_http_address:
            raise fail("lookupd_http_address",
                       "--lookupd-http-address or --nsqd-http-address required")
        if self.lookupd_http_address and self.nsqd_http_address:
            raise fail("nsqd_http_address",
                       "use --lookupd-http-address or --nsqd-http-address, not both")
        if not self.base_path.startswith("/"):
            raise fail("base_path", f"must start with /, got {self.base_path!r}")
        if self.log_level not in LOG_LEVELS:
            raise fail("log_level",
                       f"must be one of {', '.join(LOG_LEVELS)}, got {self.log_level!r}")
        if self.http_timeout <= 0:
            raise fail("http_timeout", "must be a positive duration")

    @property
    def prefix(self) -> str:
        """The base path without its trailing slash ("" for /)."""
        return self.base_path.rstrip("/")

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


def build_parser(prog: str = "python -m actors.admin") -> Any:
    return flags.build_parser(
        AdminOptions, prog,
        "The web console: see and steer brokers and lookup daemons through their HTTP "
        "APIs (nsqadmin's role; works against nsqd and nsqlookupd too).")


def parse_options(argv: Sequence[str] | None = None) -> AdminOptions:
    """Defaults < ``--config FILE`` < flags, validated."""
    return AdminOptions(**flags.parse_flags(AdminOptions, build_parser(), argv))
