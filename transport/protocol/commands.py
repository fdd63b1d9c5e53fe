"""The client commands and broker events both client protocols share.

Theory of operation
-------------------
NSQ V2 (:mod:`transport.nsq.codec`) and our ZeroMQ protocol
(:mod:`transport.zmq.codec`) frame the same commands differently.  Both
decoders produce these small frozen dataclasses and both client encoders
consume them, so the broker handles one set of types whatever the wire
(dispatch with ``match``).  Names and ids stay as the wire had them: topic
and channel names as ``str`` (ASCII, already validated), message ids and
bodies as ``bytes`` (a large MPUB's bodies as read-only ``memoryview`` s of
the read buffer its decoder let go of: bytes-like, copied once where they
are encoded).

:class:`Fin` carries a tuple of ids: one per V2 line, any number per
ZeroMQ request, so the broker's FIN path is batched either way.  Delivered
messages are decoded into :class:`Message` on the client side only; the
broker sends NSQ's message encoding (``[8B ns timestamp][2B attempts][16B hex
id][body]``) as stored, without decoding it.
"""

from __future__ import annotations

import struct
from collections.abc import Mapping
from dataclasses import field
from typing import Any, NamedTuple, Protocol

from transport.mailbox.envelope import frozen

__all__ = [
    "HEADER_SIZE",
    "MSG_ID_LENGTH",
    "Auth",
    "Cls",
    "Command",
    "Dpub",
    "Fin",
    "Handler",
    "Heartbeat",
    "Identify",
    "Message",
    "Mpub",
    "Nop",
    "Pub",
    "Rdy",
    "Req",
    "Sub",
    "Touch",
    "decode_message",
]

MSG_ID_LENGTH = 16
"""A message id is 16 ASCII hex characters (nsqd ``MsgIDLength``)."""
HEADER_SIZE = 8 + 2 + MSG_ID_LENGTH
"""Bytes of an encoded message before its body: timestamp, attempts, id."""


@frozen(slots=True)
class Identify:
    """IDENTIFY: the client's features; decoders add the negotiated outcome."""

    data: Mapping[str, Any] = field(hash=False)
    """The client's map as sent (JSON on V2, msgpack on ZeroMQ)."""
    settings: Any = field(default=None, compare=False, hash=False)
    """``transport.protocol.identify.IdentifySettings`` the broker applies (set by decoders)."""
    reply: Mapping[str, Any] | None = field(default=None, compare=False, hash=False)
    """The negotiated map to send back; ``None`` means a plain ``OK`` (set by decoders)."""


@frozen(slots=True)
class Auth:
    """AUTH: a secret for the auth server."""

    secret: bytes


@frozen(slots=True)
class Sub:
    """SUB: subscribe this connection to ``channel`` of ``topic``."""

    topic: str
    channel: str


@frozen(slots=True)
class Pub:
    """PUB: publish one message (TPUB over ZeroMQ: with a tag, #21)."""

    topic: str
    body: bytes
    tag: str = ""


@frozen(slots=True)
class Mpub:
    """MPUB: publish several messages atomically (all or none are queued); TMPUB
    over ZeroMQ, with a tag."""

    topic: str
    bodies: tuple[bytes, ...]  # (a client's may be a codec.SizedBodies: sent as it is;
    # a decoder's may be read-only views: the module docstring)
    tag: str = ""


@frozen(slots=True)
class Pubs:
    """PUBs that came one after the other in one read, to one topic: not a command
    of the wire, but how a socket loop hands them on together (each is answered on
    its own; they are stored together, as an MPUB's messages are)."""

    topic: str
    bodies: tuple[bytes, ...]


@frozen(slots=True)
class Dpub:
    """DPUB: publish one message that becomes visible after ``delay_ms``; TDPUB over
    ZeroMQ, with a tag."""

    topic: str
    delay_ms: int
    body: bytes
    tag: str = ""


@frozen(slots=True)
class Rdy:
    """RDY: how many messages the client accepts in flight at once."""

    count: int


@frozen(slots=True)
class Fin:
    """FIN: the client is done with these in-flight messages (one on V2, many on ZeroMQ)."""

    ids: tuple[bytes, ...]


@frozen(slots=True)
class Req:
    """REQ: put an in-flight message back, visible again after ``delay_ms``."""

    id: bytes
    delay_ms: int


@frozen(slots=True)
class Touch:
    """TOUCH: reset the in-flight timeout of a message."""

    id: bytes


@frozen(slots=True)
class Cls:
    """CLS: stop sending messages; the broker answers ``CLOSE_WAIT``."""


@frozen(slots=True)
class Nop:
    """NOP: no answer; answers a heartbeat (and, on ZeroMQ, is the client's heartbeat)."""


@frozen(slots=True)
class Rewind:
    """REWIND (ZeroMQ, #21): queue again on ``channel`` of ``topic`` what its history kept
    from ``since_ns`` on, or from the message ``message_id`` (16 hex characters) on."""

    topic: str
    channel: str
    since_ns: int
    message_id: str = ""


Command = (Identify | Auth | Sub | Pub | Mpub | Dpub | Rdy | Fin | Req | Touch | Cls | Nop
           | Rewind)
"""Every client command."""


@frozen(slots=True)
class Heartbeat:
    """The broker checks the client is alive; answer with NOP."""


class Message(NamedTuple):
    """A delivered message, decoded from NSQ's ``[8B ts][2B attempts][16B id][body]``."""

    id: bytes
    """16 ASCII hex bytes; FIN/REQ/TOUCH take it back."""
    timestamp: int
    """Nanoseconds since the epoch when it was published."""
    attempts: int
    """Deliveries so far, this one included."""
    body: bytes


_MESSAGE_HEAD = struct.Struct(">qH")


def decode_message(data: bytes) -> Message:
    """Decode an NSQ-encoded message; ``ValueError`` if shorter than the header."""
    if len(data) < HEADER_SIZE:
        msg = f"an NSQ message needs at least {HEADER_SIZE} bytes, got {len(data)}"
        raise ValueError(msg)
    timestamp, attempts = _MESSAGE_HEAD.unpack_from(data, 0)
    return Message(data[10:HEADER_SIZE], timestamp, attempts, data[HEADER_SIZE:])


class Handler(Protocol):
    """The broker side of the loop (called on the loop's thread: must not block long).

    ``on_heartbeat`` is called every time a session is sent a heartbeat.
    """

    def on_command(self, session: str, corr: bytes | None, command: Command) -> None: ...

    def on_close(self, session: str) -> None: ...

    def on_heartbeat(self, session: str) -> None:
        """A heartbeat was just sent to ``session`` (the broker refreshes leases on it)."""
