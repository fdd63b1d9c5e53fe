"""What both client protocols share: errors, limits, commands and their validation.

Theory of operation
-------------------
The broker speaks two client protocols, NSQ's TCP protocol V2
(:mod:`transport.nsq.codec`) and our ZeroMQ protocol
(:mod:`transport.zmq.codec`).  They differ only in framing: V2 is a byte
stream of text lines and length-prefixed bodies, ZeroMQ a multipart message
per request.  Everything after framing is the same and lives here, once:

* **Commands** are the small frozen dataclasses of
  :mod:`transport.protocol.commands` (:class:`Pub`, :class:`Sub`, ...).
* **Errors** are :class:`ProtocolError`: nsqd's machine ``code``
  (``E_BAD_TOPIC``), a human ``text`` and a ``fatal`` flag.  Decoders
  *return* them as events rather than raising them, so one bad command never
  unwinds a socket loop.  The validation helpers below raise them; the
  decoders catch and return.  As in nsqd every error is fatal except
  ``E_FIN_FAILED``, ``E_REQ_FAILED`` and ``E_TOUCH_FAILED``.
* **Limits** are one frozen :class:`Limits` passed in by the caller (this
  package must not import ``actors``, where the broker's options live; see
  :meth:`Limits.from_options`).  Durations are integer milliseconds, the
  unit clients see on the wire.
* **Validation helpers** (:func:`check_topic`, :func:`check_message_size`,
  :func:`split_mpub_body`, ...) hold nsqd's rules and sentences, so a
  malformed PUB gets the same answer on either protocol.
* **Connection state** (:class:`ConnectionState`) is nsqd's
  ``stateInit -> stateSubscribed -> stateClosing`` machine: which commands a
  connection may send when, as a pure class with no I/O.

Nothing here touches a socket, a clock or a logger.
"""

from __future__ import annotations

import re
import struct
from datetime import datetime
from enum import Enum
from typing import Any

from transport.mailbox.envelope import frozen
from transport.protocol.commands import MSG_ID_LENGTH, Cls, Command, Identify, Sub

__all__ = [
    "DISK_FAILED",
    "DISK_FULL",
    "NON_FATAL_CODES",
    "ConnectionState",
    "Limits",
    "ProtocolError",
    "State",
    "check_body_size",
    "check_channel",
    "check_delay",
    "check_message_size",
    "check_mpub_count",
    "check_rdy",
    "check_tag",
    "check_topic",
    "go_quote",
    "invalid",
    "invalid_command",
    "parse_decimal",
    "parse_from",
    "parse_msg_id",
    "split_mpub_body",
    "split_mpub_view",
    "states_allowing",
    "valid_name",
    "valid_tag",
]

DISK_FULL = "disk full"
"""In the text of a publish refused because the disk has no space left
(``E_PUB_FAILED PUB failed: disk full - ...``); HTTP answers it 507 ``DISK_FULL``."""

DISK_FAILED = "disk failed"
"""In the text of a publish refused because the queue's disk failed an fsync (the
queue takes no writes until a restart); HTTP answers it 503 ``DISK_FAILED``."""

NON_FATAL_CODES = frozenset({"E_FIN_FAILED", "E_REQ_FAILED", "E_TOUCH_FAILED",
                             "E_NOT_RETAINED", "E_REWIND_IN_PROGRESS"})
"""Codes after which the connection stays open; every other error closes it."""


class ProtocolError(Exception):
    """A client broke the protocol, or the broker refused a command.

    ``code`` is nsqd's (``E_INVALID``, ``E_BAD_BODY``, ...), ``text`` the
    human sentence, ``fatal`` whether the connection is closed after the
    error is sent (by default: unless ``code`` is in :data:`NON_FATAL_CODES`).
    ``(code, text, fatal)`` is the same triple as ``actors.broker.errors``'s
    ``BrokerError.to_wire()``, so the broker converts either way.
    """

    def __init__(self, code: str, text: str = "", *, fatal: bool | None = None) -> None:
        super().__init__(code, text)
        self.code = code
        self.text = text
        self.fatal = code not in NON_FATAL_CODES if fatal is None else fatal

    def __str__(self) -> str:
        return f"{self.code} {self.text}" if self.text else self.code

    def __repr__(self) -> str:
        return f"ProtocolError({self.code!r}, {self.text!r}, fatal={self.fatal})"

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, ProtocolError):
            return NotImplemented
        return self.to_wire() == other.to_wire()

    def __hash__(self) -> int:
        return hash(self.to_wire())

    def to_wire(self) -> tuple[str, str, bool]:
        """``(code, text, fatal)`` in plain types."""
        return (self.code, self.text, self.fatal)

    def payload(self) -> bytes:
        """What an error frame carries: ``b"E_CODE text"`` (just the code if no text)."""
        return str(self).encode("utf-8", "replace")

    @classmethod
    def from_payload(cls, payload: bytes) -> ProtocolError:
        """Parse an error frame's ``b"E_CODE text"`` (fatality follows the code)."""
        code, _, text = payload.decode("utf-8", "replace").partition(" ")
        return cls(code, text)


def invalid(text: str) -> ProtocolError:
    """A fatal ``E_INVALID`` with ``text``."""
    return ProtocolError("E_INVALID", text)


def invalid_command(name: bytes) -> ProtocolError:
    """``E_INVALID invalid command NAME`` (fatal, as in nsqd 1.x)."""
    return invalid(f"invalid command {name[:100].decode('utf-8', 'replace')}")


# ---------------------------------------------------------------------------
# Limits


@frozen(slots=True)
class Limits:
    """The broker's limits that the codecs enforce (nsqd's flags; durations in ms)."""

    max_msg_size: int = 1048576
    """Largest message body (``--max-msg-size``)."""
    max_body_size: int = 5242880
    """Largest command body: MPUB batch, IDENTIFY, AUTH (``--max-body-size``)."""
    max_rdy_count: int = 2500
    """Largest RDY a client may send (``--max-rdy-count``)."""
    max_req_timeout: int = 3_600_000
    """Longest REQ / DPUB delay in ms (``--max-req-timeout``)."""
    msg_timeout: int = 60_000
    """Default in-flight timeout in ms (``--msg-timeout``)."""
    max_msg_timeout: int = 900_000
    """Longest in-flight timeout a client may ask in ms (``--max-msg-timeout``)."""
    client_timeout: int = 60_000
    """Default heartbeat interval is half of this (``--client-timeout``)."""
    max_heartbeat_interval: int = 60_000
    """Longest heartbeat interval a client may ask in ms (``--max-heartbeat-interval``)."""
    max_output_buffer_size: int = 65536
    """Largest output buffer a client may ask (``--max-output-buffer-size``)."""
    max_output_buffer_timeout: int = 30_000
    """Longest output buffer timeout a client may ask in ms."""
    min_output_buffer_timeout: int = 25
    """Shortest output buffer timeout a client may ask in ms (nsqd's default)."""
    max_line_size: int = 4096
    """Longest V2 command line; nsqd's buffered reader gives up at its buffer size."""

    @classmethod
    def from_options(cls, options: Any) -> Limits:
        """Build limits from an object with the broker's option names (seconds as floats)."""

        def ms(seconds: float) -> int:
            return round(seconds * 1000)

        return cls(
            max_msg_size=options.max_msg_size,
            max_body_size=options.max_body_size,
            max_rdy_count=options.max_rdy_count,
            max_req_timeout=ms(options.max_req_timeout),
            msg_timeout=ms(options.msg_timeout),
            max_msg_timeout=ms(options.max_msg_timeout),
            client_timeout=ms(options.client_timeout),
            max_heartbeat_interval=ms(options.max_heartbeat_interval),
            max_output_buffer_size=options.max_output_buffer_size,
            max_output_buffer_timeout=ms(options.max_output_buffer_timeout),
        )


# ---------------------------------------------------------------------------
# Validation: nsqd's rules and sentences, raised as ProtocolError


_NAME_RE = re.compile(rb"[.a-zA-Z0-9_-]{1,64}")
_EPHEMERAL = b"#ephemeral"


def go_quote(raw: bytes, limit: int = 100) -> str:
    """Quote bytes the way Go's ``%q`` does for ASCII (others as ``\\xNN``), cut at ``limit``."""
    out = ['"']
    for byte in raw[:limit]:
        ch = chr(byte)
        if ch in '"\\':
            out.append("\\" + ch)
        elif 0x20 <= byte < 0x7F:
            out.append(ch)
        else:
            out.append({"\n": "\\n", "\r": "\\r", "\t": "\\t"}.get(ch, f"\\x{byte:02x}"))
    out.append('"' if len(raw) <= limit else '"...')
    return "".join(out)


def valid_name(name: bytes) -> bool:
    """NSQ's rule for topic and channel names: 1-64 of ``[.a-zA-Z0-9_-]``, then
    ``#ephemeral`` optionally (counted in the 64)."""
    if len(name) > 64:
        return False
    if name.endswith(_EPHEMERAL):
        name = name[: -len(_EPHEMERAL)]
    return _NAME_RE.fullmatch(name) is not None


def check_topic(name: bytes, command: str) -> str:
    """The topic name as text, or ``E_BAD_TOPIC``: 1-64 of ``[.a-zA-Z0-9_-]``, ``#ephemeral``."""
    if not valid_name(name):
        raise ProtocolError("E_BAD_TOPIC", f"{command} topic name {go_quote(name)} is not valid")
    return name.decode("ascii")


def check_channel(name: bytes, command: str) -> str:
    """The channel name as text, or ``E_BAD_CHANNEL`` (same rule as topics)."""
    if not valid_name(name):
        msg = f"{command} channel name {go_quote(name)} is not valid"
        raise ProtocolError("E_BAD_CHANNEL", msg)
    return name.decode("ascii")


_TAG_RE = re.compile(rb"[.a-zA-Z0-9_:-]{1,64}")
TAG_RULE = "1-64 of a-z A-Z 0-9 . _ - :"


def valid_tag(tag: bytes) -> bool:
    """A message's tag (#21): 1-64 of ``[.a-zA-Z0-9_:-]`` (no comma: a channel's filter
    is a comma list of tags)."""
    return _TAG_RE.fullmatch(tag) is not None


def check_tag(tag: bytes, command: str) -> str:
    """The tag as text, or ``E_INVALID`` with a sentence."""
    if not valid_tag(tag):
        raise ProtocolError("E_INVALID", f"{command} bad tag {go_quote(tag)} ({TAG_RULE})")
    return tag.decode("ascii")


def parse_decimal(raw: bytes, command: str, what: str) -> int:
    """A non-negative decimal (digits only, like nsqd's ``ByteToBase10``) or ``E_INVALID``.

    Unlike nsqd an empty field is refused, and more than 18 digits cannot
    overflow into a small number.
    """
    if not raw or len(raw) > 18 or not raw.isdigit():
        raise invalid(f"{command} could not parse {what} {raw[:40].decode('latin-1')}")
    return int(raw)


def check_rdy(count: int, limits: Limits) -> int:
    """``count`` if within ``0..max_rdy_count``; out of range is fatal as in nsqd."""
    if count > limits.max_rdy_count:
        raise invalid(f"RDY count {count} out of range 0-{limits.max_rdy_count}")
    return count


def check_delay(delay_ms: int, command: str, limits: Limits) -> int:
    """``delay_ms`` if within ``0..max_req_timeout`` (REQ and DPUB)."""
    if delay_ms > limits.max_req_timeout:
        msg = f"{command} timeout {delay_ms} out of range 0-{limits.max_req_timeout}"
        raise invalid(msg)
    return delay_ms


def parse_msg_id(raw: bytes, command: str) -> bytes:
    """A message id must be exactly 16 bytes (nsqd checks the length only)."""
    if len(raw) != MSG_ID_LENGTH:
        raise invalid(f"{command} Invalid Message ID {go_quote(raw, 40)}")
    return raw


def check_message_size(size: int, command: str, limits: Limits, index: int | None = None) -> None:
    """One message body: ``1..max_msg_size`` bytes, else ``E_BAD_MESSAGE``."""
    if size <= 0:
        which = "message" if index is None else f"message({index})"
        raise ProtocolError("E_BAD_MESSAGE", f"{command} invalid {which} body size {size}")
    if size > limits.max_msg_size:
        msg = f"{command} message too big {size} > {limits.max_msg_size}"
        raise ProtocolError("E_BAD_MESSAGE", msg)


def check_body_size(size: int, command: str, limits: Limits) -> None:
    """A command body (MPUB, IDENTIFY, AUTH): ``1..max_body_size`` bytes, else ``E_BAD_BODY``."""
    if size > limits.max_body_size:
        msg = f"{command} body too big {size} > {limits.max_body_size}"
        raise ProtocolError("E_BAD_BODY", msg)
    if size <= 0:
        raise ProtocolError("E_BAD_BODY", f"{command} invalid body size {size}")


def check_mpub_count(count: int, limits: Limits) -> None:
    """At least one message, and no more than could fit in ``max_body_size`` (as nsqd)."""
    if count <= 0 or count > (limits.max_body_size - 4) // 5:
        raise ProtocolError("E_BAD_BODY", f"MPUB invalid message count {count}")


_SIZE = struct.Struct(">i")
_USIZE = struct.Struct(">I")


def split_mpub_body(body: bytes, limits: Limits) -> tuple[bytes, ...]:
    """Split V2's MPUB body ``[4B count]([4B size][bytes])*`` into message bodies.

    The messages must fill the body exactly; nsqd reads them off the stream,
    so a body whose declared size disagrees with its messages desynchronises
    it, while we answer ``E_BAD_BODY``.

    A gateway splits every published message here, so the loop does only the
    splitting and the checks run once over the result; a body that fails them
    is split again by :func:`_split_mpub_checked`, which names the first fault
    with nsqd's code and sentence.
    """
    bodies = _split_mpub(body, limits)
    return tuple(bodies) if bodies is not None else _split_mpub_checked(body, limits)


def split_mpub_view(view: memoryview, limits: Limits) -> tuple[memoryview, ...] | None:
    """:func:`split_mpub_body` of a body in memory no one writes to any more (a read
    buffer its decoder let go of): the messages as read-only views of it, nothing
    copied; None for a body the checked split must refuse (from bytes).

    Each message is copied once, later, where it is encoded with its id and
    timestamp (``bytes + view``).  Copying each out first cost another copy and
    allocation a message: at 200 messages of 1 KiB, NSQ's bench clients' PUB+SUB
    ran ~13 % faster without it."""
    bodies = _split_mpub(view.toreadonly(), limits)
    return tuple(bodies) if bodies is not None else None


def _split_mpub(body: bytes | memoryview, limits: Limits) -> list[Any] | None:
    """The messages of an MPUB body as slices of it; None unless all is well."""
    end = len(body)
    if end < 4:
        return None
    (count,) = _SIZE.unpack_from(body, 0)
    if not 0 < count <= (limits.max_body_size - 4) // 5:
        return None
    unpack, bodies, pos = _USIZE.unpack_from, [], 4
    append = bodies.append
    try:
        for _ in range(count):
            nxt = pos + 4 + unpack(body, pos)[0]
            append(body[pos + 4 : nxt])
            pos = nxt
    except struct.error:  # a size field past the end: let the checked split say so
        return None
    # Sizes read unsigned only ever move pos forward: a zero size leaves an empty
    # body, a negative (huge) or overlong one ends past the end.
    if pos == end and min(map(len, bodies)) > 0 \
            and max(map(len, bodies)) <= limits.max_msg_size:
        return bodies
    return None


def _split_mpub_checked(body: bytes, limits: Limits) -> tuple[bytes, ...]:
    """:func:`split_mpub_body` one check at a time: raises the first fault's error."""
    if len(body) < 4:
        raise ProtocolError("E_BAD_BODY", "MPUB failed to read message count")
    (count,) = _SIZE.unpack_from(body, 0)
    check_mpub_count(count, limits)
    bodies = []
    pos, end = 4, len(body)
    for i in range(count):
        if pos + 4 > end:
            msg = f"MPUB body size {end} too small for message({i}) body size"
            raise ProtocolError("E_BAD_BODY", msg)
        (size,) = _SIZE.unpack_from(body, pos)
        check_message_size(size, "MPUB", limits, i)
        pos += 4
        if pos + size > end:
            msg = f"MPUB body size {end} too small for message({i}) of {size} bytes"
            raise ProtocolError("E_BAD_BODY", msg)
        bodies.append(body[pos : pos + size])
        pos += size
    if pos != end:
        msg = f"MPUB body size {end} does not match its {count} messages ({pos} bytes)"
        raise ProtocolError("E_BAD_BODY", msg)
    return tuple(bodies)


# ---------------------------------------------------------------------------
# Connection state (nsqd's stateInit / stateSubscribed / stateClosing)


class State(Enum):
    """Where a connection is in its life."""

    INIT = "init"
    """Connected (and maybe identified); may IDENTIFY, AUTH, SUB and publish."""
    SUBSCRIBED = "subscribed"
    """Subscribed to one channel; may RDY, FIN, REQ, TOUCH, CLS and publish."""
    CLOSING = "closing"
    """Sent CLS; may still FIN/REQ/TOUCH what it holds; RDY is ignored."""


def states_allowing(name: str) -> frozenset[State]:
    """The states in which command ``name`` is allowed (all of them if unrestricted)."""
    return _ALLOWED.get(name, frozenset(State))


_ALLOWED: dict[str, frozenset[State]] = {
    "IDENTIFY": frozenset({State.INIT}),
    "AUTH": frozenset({State.INIT}),
    "SUB": frozenset({State.INIT}),
    "RDY": frozenset({State.SUBSCRIBED}),
    "FIN": frozenset({State.SUBSCRIBED, State.CLOSING}),
    "REQ": frozenset({State.SUBSCRIBED, State.CLOSING}),
    "TOUCH": frozenset({State.SUBSCRIBED, State.CLOSING}),
    "CLS": frozenset({State.SUBSCRIBED}),
}


class ConnectionState:
    """Which commands a connection may send now; pure, one per connection.

    Decoders call :meth:`admit` with the command name *before* parsing its
    arguments (nsqd's order: ``RDY`` before ``SUB`` is a state error whatever
    its count), then :meth:`apply` with the parsed command.  PUB, MPUB, DPUB
    and NOP are allowed in every state.
    """

    __slots__ = ("heartbeats", "state")

    def __init__(self) -> None:
        self.state = State.INIT
        self.heartbeats = True
        """False once IDENTIFY disabled heartbeats (then SUB is refused, as in nsqd)."""

    def admit(self, name: str) -> bool:
        """True if allowed, False if to be ignored (RDY after CLS); raises ``E_INVALID``."""
        if name == "RDY" and self.state is State.CLOSING:
            return False
        allowed = _ALLOWED.get(name)
        if allowed is not None and self.state not in allowed:
            raise invalid(f"cannot {name} in current state")
        if name == "SUB" and not self.heartbeats:
            raise invalid("cannot SUB with heartbeats disabled")
        return True

    def apply(self, command: Command) -> None:
        """Move on after a command was accepted."""
        if isinstance(command, Sub):
            self.state = State.SUBSCRIBED
        elif isinstance(command, Cls):
            self.state = State.CLOSING
        elif isinstance(command, Identify) and command.settings is not None:
            self.heartbeats = command.settings.heartbeat_interval > 0


def parse_message_id(raw: str) -> str | None:
    """A message id as clients receive it (exactly 16 hex characters), lower-cased;
    None for anything else."""
    if len(raw) == 16 and all(c in "0123456789abcdefABCDEF" for c in raw):
        return raw.lower()
    return None


def parse_from(raw: str) -> tuple[int, str]:
    """A rewind's ``from``: ``(since_ns, "")`` for an RFC 3339 time or unix milliseconds
    (any all-digit value but a message id), ``(0, id)`` for a message id (exactly 16
    hex characters, as clients receive it); ValueError for anything else."""
    message_id = parse_message_id(raw)
    if message_id is not None:
        return 0, message_id
    if raw.isdigit() and len(raw) <= 18:
        return int(raw) * 1_000_000, ""
    text = raw[:-1] + "+00:00" if raw[-1:] in "zZ" and raw else raw
    when = datetime.fromisoformat(text)  # (raises ValueError)
    if when.tzinfo is None or "T" not in text.upper():
        msg = f"{raw!r} is not an RFC 3339 time (with its offset)"
        raise ValueError(msg)
    return round(when.timestamp() * 1_000_000) * 1000, ""
