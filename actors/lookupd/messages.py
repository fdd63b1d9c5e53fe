"""Messages between the lookup daemon's actors (listener, peers, registry).

Small frozen dataclasses registered with the envelope codec, grouped by the
actor that receives them.
"""

from __future__ import annotations

from typing import Any

from actors.runtime.actor import no_spawn
from transport.mailbox.envelope import message

# ------------------------------------------------- to a peer (one broker's connection)


@message
class PeerIdentify:
    """The broker's IDENTIFY, checked by the codec: nsqlookupd's fields, and ours."""

    broadcast_address: str
    tcp_port: int
    http_port: int
    version: str
    hostname: str = ""
    extra: dict[str, Any] | None = None
    """IDENTIFY fields nsqlookupd does not know (ours: ``zmq_port``)."""


@message
class PeerRegister:
    """``REGISTER topic [channel]``."""

    topic: str
    channel: str = ""


@message
class PeerUnregister:
    """``UNREGISTER topic [channel]``."""

    topic: str
    channel: str = ""


@message
class PeerPing:
    """``PING``."""


@no_spawn
@message
class PeerGone:
    """The broker's connection closed: withdraw everything it announced, then stop."""


@no_spawn
@message
class Reannounce:
    """To the listener, then to each peer: tell the registry again what you announced
    (the registry restarted after a crash and lost it)."""


# -------------------------------------------------------------------- to the registry


@message
class Identified:
    """A broker identified itself on connection ``info["id"]`` (its remote address)."""

    info: dict[str, Any]


@message
class Registered:
    """Connection `peer` announced `topic` (and `channel`, if not empty)."""

    peer: str
    topic: str
    channel: str = ""


@message
class Unregistered:
    """Connection `peer` withdrew `channel` of `topic`, or the topic and its channels."""

    peer: str
    topic: str
    channel: str = ""


@message
class Pinged:
    """Connection `peer` is alive."""

    peer: str


@message
class Left:
    """Connection `peer` closed."""

    peer: str


@message
class Query:
    """Ask: one of the HTTP API's reads or changes (``what``: ``lookup``, ``topics``,
    ``channels``, ``nodes``, ``debug``, ``topic_create``, ``topic_delete``,
    ``channel_create``, ``channel_delete``, ``tombstone``); the reply is its answer."""

    what: str
    topic: str = ""
    channel: str = ""
    node: str = ""


# -------------------------------------------------------------------- to the listener


@message
class ListenerInfo:
    """Ask: ``{"tcp_port", "http_port", "error"}`` (bound ports; error if one failed)."""
