"""IDENTIFY: validating a client's features and negotiating the reply (nsqd 1.x).

Theory of operation
-------------------
A client may IDENTIFY once, before SUB, with a map of features (JSON on NSQ
V2, msgpack on ZeroMQ).  :func:`identify_settings` checks every key the way
nsqd's ``clientV2.Identify`` does, in nsqd's order, and returns the
:class:`IdentifySettings` the broker applies to the connection (heartbeat
interval, message timeout, sample rate, ...).  Values nsqd treats specially:

* ``heartbeat_interval``: ``0`` (or absent) keeps the default (half the
  client timeout), ``-1`` disables heartbeats, else ``1000..max``;
* ``output_buffer_size``: ``0`` default, ``-1`` no buffering, else ``64..max``;
* ``output_buffer_timeout``: ``0`` default, ``-1`` none, else ``min..max``;
* ``msg_timeout``: ``0`` default, else ``1000..max_msg_timeout``;
* ``sample_rate``: ``0..99`` (0 means every message).

A value of the wrong JSON type fails as Go's decoder fails
(``IDENTIFY failed to decode JSON body``); unknown keys are ignored.

:func:`negotiate_identify` adds nsqd's ``feature_negotiation`` reply: the
JSON map nsqd 1.x sends, with TLS, snappy and deflate as the server offers
them, and AUTH answered as nsqd answers with it disabled (``false``).  Without
``feature_negotiation`` the reply is a plain ``OK`` (``None`` here).
Pure functions: no sockets, no clock.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from transport.mailbox.envelope import frozen
from transport.protocol.validation import Limits, ProtocolError

__all__ = [
    "DEFAULT_OUTPUT_BUFFER_SIZE",
    "DEFAULT_OUTPUT_BUFFER_TIMEOUT",
    "IdentifySettings",
    "ServerInfo",
    "identify_settings",
    "negotiate_identify",
]

DEFAULT_OUTPUT_BUFFER_SIZE = 16 * 1024
"""nsqd's default per-client write buffer."""
DEFAULT_OUTPUT_BUFFER_TIMEOUT = 250
"""nsqd's default flush interval in ms."""


@frozen(slots=True)
class ServerInfo:
    """What the broker says about itself in an IDENTIFY reply."""

    version: str = "1.2.1"
    """Reported as ``version``; NSQ clients compare it with nsqd's versions."""
    auth_required: bool = False
    """Whether AUTH is required (we have no auth server yet)."""
    max_deflate_level: int = 6
    """nsqd's ``--max-deflate-level`` default, reported even with deflate off."""
    tls_v1: bool = False
    """TLS is offered: a client asking for ``tls_v1`` upgrades after the reply."""
    deflate: bool = False
    """Deflate is offered (nsqd's ``--deflate``)."""
    snappy: bool = False
    """Snappy is offered (nsqd's ``--snappy``)."""


@frozen(slots=True)
class IdentifySettings:
    """The connection's settings after IDENTIFY (durations in ms)."""

    client_id: str = ""
    hostname: str = ""
    user_agent: str = ""
    heartbeat_interval: int = 30_000
    """0 means heartbeats are disabled."""
    msg_timeout: int = 60_000
    sample_rate: int = 0
    output_buffer_size: int = DEFAULT_OUTPUT_BUFFER_SIZE
    output_buffer_timeout: int = DEFAULT_OUTPUT_BUFFER_TIMEOUT
    """0 means flush after every write."""
    feature_negotiation: bool = False
    tls_v1: bool = False
    """The client asked for TLS."""
    deflate: bool = False
    """The client asked for deflate ..."""
    deflate_level: int = 0
    """... at this level (0: the default, 6)."""
    snappy: bool = False
    """The client asked for snappy."""
    packed_messages: bool = False
    """ZeroMQ only: deliveries packed in one frame (docs/PROTOCOL.md 1.5)."""

    @classmethod
    def defaults(cls, limits: Limits) -> IdentifySettings:
        """What a connection that never sends IDENTIFY gets."""
        return cls(heartbeat_interval=limits.client_timeout // 2, msg_timeout=limits.msg_timeout)


_STR_KEYS = ("client_id", "hostname", "user_agent")
_INT_KEYS = (
    "heartbeat_interval", "output_buffer_size", "output_buffer_timeout",
    "sample_rate", "msg_timeout", "deflate_level",
)  # fmt: skip
_BOOL_KEYS = ("feature_negotiation", "tls_v1", "deflate", "snappy")
_INT32 = 2**31


def _bad(text: str) -> ProtocolError:
    return ProtocolError("E_BAD_BODY", f"IDENTIFY {text}")


def _typed(data: Mapping[str, Any], encoding: str) -> dict[str, Any]:
    """Known keys with Go's types; a wrong type fails like ``json.Unmarshal``."""
    if not isinstance(data, Mapping):
        raise _bad(f"failed to decode {encoding} body")
    out: dict[str, Any] = {}
    for key, kinds in ((_STR_KEYS, str), (_INT_KEYS, int), (_BOOL_KEYS, bool)):
        for name in key:
            value = data.get(name)
            if value is None:  # absent, or JSON null: Go keeps the zero value
                continue
            wrong = not isinstance(value, kinds) or (kinds is int and isinstance(value, bool))
            if wrong or (kinds is int and not -_INT32 <= value < _INT32):
                raise _bad(f"failed to decode {encoding} body")
            out[name] = value
    return out


def identify_settings(
    data: Mapping[str, Any],
    limits: Limits,
    *,
    allow_no_heartbeats: bool = True,
    encoding: str = "JSON",
) -> IdentifySettings:
    """Validate a client's IDENTIFY map; ``E_BAD_BODY`` names the first bad value.

    ``allow_no_heartbeats=False`` refuses ``heartbeat_interval: -1`` (the
    ZeroMQ protocol, where silence is the only sign of a dead client);
    ``encoding`` names the body's format in the type-error sentence.
    """
    d = _typed(data, encoding)
    base = IdentifySettings.defaults(limits)

    heartbeat = d.get("heartbeat_interval", 0)
    if heartbeat == -1 and allow_no_heartbeats:
        heartbeat = 0
    elif heartbeat == 0:
        heartbeat = base.heartbeat_interval
    elif not 1000 <= heartbeat <= limits.max_heartbeat_interval:
        raise _bad(f"heartbeat interval ({heartbeat}) is invalid")

    buffer_timeout = d.get("output_buffer_timeout", 0)
    if buffer_timeout == -1:
        buffer_timeout = 0
    elif buffer_timeout == 0:
        buffer_timeout = base.output_buffer_timeout
    elif not limits.min_output_buffer_timeout <= buffer_timeout <= limits.max_output_buffer_timeout:
        raise _bad(f"output buffer timeout ({buffer_timeout}) is invalid")

    buffer_size = d.get("output_buffer_size", 0)
    if buffer_size == -1:
        buffer_size, buffer_timeout = 1, 0
    elif buffer_size == 0:
        buffer_size = base.output_buffer_size
    elif not 64 <= buffer_size <= limits.max_output_buffer_size:
        raise _bad(f"output buffer size ({buffer_size}) is invalid")

    sample_rate = d.get("sample_rate", 0)
    if not 0 <= sample_rate <= 99:
        raise _bad(f"sample rate ({sample_rate}) is invalid")

    msg_timeout = d.get("msg_timeout", 0)
    if msg_timeout == 0:
        msg_timeout = base.msg_timeout
    elif not 1000 <= msg_timeout <= limits.max_msg_timeout:
        raise _bad(f"msg timeout ({msg_timeout}) is invalid")

    return IdentifySettings(
        client_id=d.get("client_id", ""),
        hostname=d.get("hostname", ""),
        user_agent=d.get("user_agent", ""),
        heartbeat_interval=heartbeat,
        msg_timeout=msg_timeout,
        sample_rate=sample_rate,
        output_buffer_size=buffer_size,
        output_buffer_timeout=buffer_timeout,
        feature_negotiation=d.get("feature_negotiation", False),
        tls_v1=d.get("tls_v1", False),
        deflate=d.get("deflate", False),
        deflate_level=d.get("deflate_level", 0),
        snappy=d.get("snappy", False),
    )


def negotiate_identify(
    data: Mapping[str, Any], limits: Limits, server: ServerInfo | None = None
) -> tuple[dict[str, Any] | None, IdentifySettings]:
    """``(reply, settings)`` for NSQ V2: nsqd 1.x's reply map, or ``None`` for plain ``OK``.

    ``tls_v1``, ``deflate`` and ``snappy`` are ``true`` when the client asked and
    the server offers them (the socket loop then upgrades the connection in that
    order, as nsqd does); ``deflate_level`` is the client's (6 when it gave none)
    capped at ``max_deflate_level``.  Asking for deflate *and* snappy where both
    are offered is nsqd's fatal ``E_IDENTIFY_FAILED``.
    """
    server = server or ServerInfo()
    settings = identify_settings(data, limits)
    if not settings.feature_negotiation:
        return None, settings
    deflate = settings.deflate and server.deflate
    snappy = settings.snappy and server.snappy
    if deflate and snappy:
        raise ProtocolError("E_IDENTIFY_FAILED", "cannot enable both deflate and snappy "
                            "compression", fatal=True)
    level = settings.deflate_level if deflate and settings.deflate_level > 0 else 6
    reply = {
        "max_rdy_count": limits.max_rdy_count,
        "version": server.version,
        "max_msg_timeout": limits.max_msg_timeout,
        "msg_timeout": settings.msg_timeout,
        "tls_v1": settings.tls_v1 and server.tls_v1,
        "deflate": deflate,
        "deflate_level": min(level, server.max_deflate_level),
        "max_deflate_level": server.max_deflate_level,
        "snappy": snappy,
        "sample_rate": settings.sample_rate,
        "auth_required": server.auth_required,
        "output_buffer_size": settings.output_buffer_size,
        "output_buffer_timeout": settings.output_buffer_timeout,
    }
    return reply, settings
