"""Our native ZeroMQ client protocol as a sans-IO codec: frames in, commands out.

Theory of operation
-------------------
A client's DEALER talks to the broker's ROUTER; ``docs/PROTOCOL.md`` is the
full specification.  ZeroMQ already delivers whole multipart messages, so
there is no stream state: a request is one multipart message and
:func:`parse_request` turns its frames (after the ROUTER's identity frame)
into a :class:`Request` ``(corr, command)``::

    [#corr]  NAME  arg ...          e.g.  b"#7" b"PUB" b"orders" b"{...}"

* **Correlation frame.**  If the first frame starts with ``#`` (0x23) it is
  the client's correlation frame, 1..256 bytes chosen by the client, and the
  broker echoes it unchanged as the first frame of its OK or ERROR reply to
  that request.  Command names are upper-case letters, so the two never
  collide; a client that does not pipeline omits it.
* **Arguments** are one frame each: names and ids as ASCII, numbers as ASCII
  decimal, bodies as raw bytes, IDENTIFY's map as msgpack.  FIN takes any
  number of ids (a frame may hold several, one after the other), MPUB any
  number of bodies (PMPUB: all of them in one frame, as NSQ V2's MPUB body).

Validation is :mod:`transport.protocol.validation`'s, shared with NSQ V2, so a
request gets the same code, sentence and fatality on either protocol.  When
the caller passes the sender's :class:`ConnectionState`, the same state rules
apply (``RDY`` before ``SUB`` is fatal; ``RDY`` after ``CLS`` becomes a
:class:`Nop`).  Errors are *returned* in the :class:`Request`, never raised.

Replies (broker to client) are lists of frames:

* ``[#corr] OK [payload]`` to IDENTIFY (payload: msgpack map), SUB, PUB,
  MPUB, DPUB and CLS (payload ``CLOSE_WAIT``);
* ``[#corr] ERROR code text`` (fatal unless the code is ``E_FIN_FAILED``,
  ``E_REQ_FAILED`` or ``E_TOUCH_FAILED``);
* ``MESSAGE m1 m2 ...``: one or more deliveries batched in one multipart
  message, each frame NSQ's message encoding; or, to a session that asked
  for ``packed_messages`` in IDENTIFY, ``MESSAGES headers sizes lines``: the
  same messages as columns (each one's 26-byte header, each body's size in 4
  bytes big-endian, and the bodies with a line feed between two);
* ``HEARTBEAT``.

:func:`encode_request` and :func:`parse_reply` are the client's inverses.
"""

from __future__ import annotations

import dataclasses
import operator
import struct
from collections.abc import Callable, Iterable, Iterator, Sequence
from typing import Any, NamedTuple

import msgpack

from transport.mailbox.envelope import frozen
from transport.protocol.commands import (
    HEADER_SIZE,
    MSG_ID_LENGTH,
    Auth,
    Cls,
    Command,
    Dpub,
    Fin,
    Heartbeat,
    Identify,
    Message,
    Mpub,
    Nop,
    Pub,
    Rdy,
    Req,
    Rewind,
    Sub,
    Touch,
    decode_message,
)
from transport.protocol.identify import IdentifySettings, ServerInfo, identify_settings
from transport.protocol.validation import (
    ConnectionState,
    Limits,
    ProtocolError,
    check_body_size,
    check_channel,
    check_delay,
    check_message_size,
    check_mpub_count,
    check_rdy,
    check_tag,
    check_topic,
    invalid,
    invalid_command,
    parse_decimal,
    parse_from,
    parse_msg_id,
    split_mpub_body,
)

__all__ = [
    "CORR_MARKER",
    "MAX_CORR_SIZE",
    "PROTOCOL_VERSION",
    "Columns",
    "ErrorReply",
    "Messages",
    "Ok",
    "PackedMessages",
    "Reply",
    "Request",
    "SizedBodies",
    "encode_error",
    "encode_heartbeat",
    "encode_identify_reply",
    "encode_messages",
    "encode_ok",
    "encode_packed_messages",
    "encode_request",
    "identify_reply",
    "mpub_body_size",
    "pack_bodies",
    "parse_reply",
    "parse_request",
    "sized",
    "unpack_columns",
]

PROTOCOL_VERSION = 1
"""Sent as ``protocol_version`` in the IDENTIFY reply."""
CORR_MARKER = b"#"
"""First byte of a correlation frame."""
MAX_CORR_SIZE = 256
"""Longest correlation frame, marker included."""
_SIZE = struct.Struct(">I")
_HEADER = struct.Struct(">qH16s")  # a message's timestamp, attempts and id (1.6)
_READERS: dict[tuple[str, int], struct.Struct] = {}
"""By (item, k) for k = 0..12: the struct that reads an item's field 2**k times (`_fields`;
made when first needed, since the largest takes a quarter of a millisecond)."""

_DEFAULT_LIMITS = Limits()
_DEFAULT_SERVER = ServerInfo()


class Request(NamedTuple):
    """A parsed request: the correlation frame to echo and the command (or its error)."""

    corr: bytes | None
    """The ``#...`` frame as received, or None."""
    command: Command | ProtocolError


# ---------------------------------------------------------------------------
# Broker side: frames -> Request


def _arity(args: Sequence[bytes], name: str, n: int, *, at_least: bool = False) -> None:
    if len(args) < n:
        raise invalid(f"{name} insufficient number of parameters")
    if len(args) > n and not at_least:
        raise invalid(f"{name} too many parameters")


def identify_reply(
    settings: IdentifySettings, limits: Limits, server: ServerInfo
) -> dict[str, Any]:
    """The map the broker answers IDENTIFY with (all durations in ms)."""
    return {
        "protocol_version": PROTOCOL_VERSION,
        "version": server.version,
        "max_rdy_count": limits.max_rdy_count,
        "max_msg_timeout": limits.max_msg_timeout,
        "msg_timeout": settings.msg_timeout,
        "heartbeat_interval": settings.heartbeat_interval,
        "sample_rate": settings.sample_rate,
        "max_msg_size": limits.max_msg_size,
        "max_body_size": limits.max_body_size,
        "max_req_timeout": limits.max_req_timeout,
        "auth_required": server.auth_required,
        "packed_messages": settings.packed_messages,
    }


def _identify(args: Sequence[bytes], limits: Limits, server: ServerInfo) -> Command:
    _arity(args, "IDENTIFY", 1)
    check_body_size(len(args[0]), "IDENTIFY", limits)
    try:
        data = msgpack.unpackb(args[0], raw=False)
    except (ValueError, TypeError, RecursionError, msgpack.UnpackException) as e:
        raise ProtocolError("E_BAD_BODY", "IDENTIFY failed to decode msgpack body") from e
    settings = identify_settings(data, limits, allow_no_heartbeats=False, encoding="msgpack")
    packed = data.get("packed_messages", False) if isinstance(data, dict) else False
    if not isinstance(packed, bool):
        raise ProtocolError("E_BAD_BODY", "IDENTIFY failed to decode msgpack body")
    if packed:
        settings = dataclasses.replace(settings, packed_messages=True)
    return Identify(data, settings, identify_reply(settings, limits, server))


def _auth(args: Sequence[bytes], limits: Limits, _server: ServerInfo) -> Command:
    if len(args) != 1:  # (nsqd's words for AUTH, not the other commands')
        raise invalid("AUTH invalid number of parameters")
    check_body_size(len(args[0]), "AUTH", limits)
    return Auth(args[0])


def _sub(args: Sequence[bytes], _limits: Limits, _server: ServerInfo) -> Command:
    _arity(args, "SUB", 2)
    return Sub(check_topic(args[0], "SUB"), check_channel(args[1], "SUB"))


def _pub(args: Sequence[bytes], limits: Limits, _server: ServerInfo, tag: str = "",
         name: str = "PUB") -> Command:
    _arity(args, name, 2)
    topic = check_topic(args[0], name)
    check_message_size(len(args[1]), name, limits)
    return Pub(topic, args[1], tag)


def _mpub(args: Sequence[bytes], limits: Limits, _server: ServerInfo, tag: str = "",
          name: str = "MPUB") -> Command:
    _arity(args, name, 2, at_least=True)
    topic = check_topic(args[0], name)
    bodies = tuple(args[1:])
    check_mpub_count(len(bodies), limits)
    check_body_size(mpub_body_size(bodies), name, limits)
    for i, body in enumerate(bodies):
        check_message_size(len(body), name, limits, i)
    return Mpub(topic, bodies, tag)


def _pmpub(args: Sequence[bytes], limits: Limits, _server: ServerInfo, tag: str = "",
           name: str = "PMPUB") -> Command:
    """MPUB with its bodies packed in one frame as NSQ V2's MPUB body (one frame to send
    and receive, not one a message), checked as nsqd checks that body."""
    _arity(args, name, 2)
    topic = check_topic(args[0], name)
    check_body_size(len(args[1]), "MPUB", limits)  # (the body's errors are MPUB's, as nsqd's)
    return Mpub(topic, split_mpub_body(args[1], limits), tag)


class SizedBodies(Sequence[bytes]):
    """Message bodies kept as NSQ V2's MPUB body keeps them, each after its size (4-byte
    big-endian), without the count in front: what a Spark worker is handed for rows of
    text is in that form already (transport/spark.py), so a PMPUB sends them without an
    object made a body.  Split into bodies only if asked for one (an MPUB of frames).
    ``number`` is how many (``len``; ``count`` stays Sequence's)."""

    __slots__ = ("_split", "data", "number")

    def __init__(self, number: int, data: bytes) -> None:
        self.number = number
        self.data = data
        self._split: list[bytes] | None = None

    @classmethod
    def join(cls, parts: Sequence[SizedBodies]) -> SizedBodies:
        if len(parts) == 1:
            return parts[0]
        return cls(sum(p.number for p in parts), b"".join([p.data for p in parts]))

    def take(self, most: int, room: int) -> tuple[SizedBodies, SizedBodies]:
        """The first bodies, at most `most` of them, that fit in `room` bytes (sizes
        included; maybe none), and the rest: one walk over their sizes."""
        if self.number <= most and len(self.data) <= room:
            return self, _NONE
        size, data, pos, n = _SIZE.unpack_from, self.data, 0, 0
        while n < min(most, self.number):
            end = pos + 4 + size(data, pos)[0]
            if end > room:
                break
            pos, n = end, n + 1
        return SizedBodies(n, data[:pos]), SizedBodies(self.number - n, data[pos:])

    def _bodies(self) -> list[bytes]:
        if self._split is None:
            size, data = _SIZE.unpack_from, self.data
            out, pos = [], 0
            while pos < len(data):
                (n,) = size(data, pos)
                out.append(data[pos + 4:pos + 4 + n])
                pos += 4 + n
            if len(out) != self.number or pos != len(data):
                msg = f"{len(data)} bytes do not hold {self.number} sized bodies"
                raise ValueError(msg)
            self._split = out
        return self._split

    def __len__(self) -> int:
        return self.number

    def __getitem__(self, i: Any) -> Any:
        return self._bodies()[i]

    def __iter__(self) -> Iterator[bytes]:
        return iter(self._bodies())


_NONE = SizedBodies(0, b"")


def pack_bodies(bodies: Sequence[bytes]) -> bytes:
    """NSQ V2's MPUB body, PMPUB's last frame: the count, then each body after its size
    (4-byte big-endian integers)."""
    if isinstance(bodies, SizedBodies):
        return _SIZE.pack(bodies.number) + bodies.data
    return sized(bodies, _SIZE.pack(len(bodies)))


def mpub_body_size(bodies: Sequence[bytes]) -> int:
    """The size of `bodies` as NSQ V2's MPUB body (what ``--max-body-size`` limits: an
    MPUB's frames, or a PMPUB's one)."""
    if isinstance(bodies, SizedBodies):
        return 4 + len(bodies.data)
    return 4 + 4 * len(bodies) + sum(map(len, bodies))


def sized(items: Sequence[bytes], head: bytes = b"") -> bytes:
    """`head`, then each item after its size (4 bytes, big-endian), in one join."""
    size = _SIZE.pack
    parts: list[bytes] = [b""] * (2 * len(items) + 1)
    parts[0] = head
    parts[1::2] = [size(len(m)) for m in items]
    parts[2::2] = items
    return b"".join(parts)


def _dpub(args: Sequence[bytes], limits: Limits, _server: ServerInfo, tag: str = "",
          name: str = "DPUB") -> Command:
    _arity(args, name, 3)
    topic = check_topic(args[0], name)
    delay = check_delay(parse_decimal(args[1], name, "timeout"), name, limits)
    check_message_size(len(args[2]), name, limits)
    return Dpub(topic, delay, args[2], tag)


def _tagged(name: str, untagged: Callable[..., Command], n: int, *, at_least: bool = False
            ) -> Callable[[Sequence[bytes], Limits, ServerInfo], Command]:
    """TPUB, TMPUB, TDPUB (#21): the untagged command's arguments with the tag second
    (``TPUB topic tag body``); `n` arguments (at least, for TMPUB)."""

    def parse(args: Sequence[bytes], limits: Limits, server: ServerInfo) -> Command:
        _arity(args, name, n, at_least=at_least)
        check_topic(args[0], name)  # (in the order of the frames, as nsqd checks)
        tag = check_tag(args[1], name)
        return untagged([args[0], *args[2:]], limits, server, tag, name)

    return parse


def _rewind(args: Sequence[bytes], _limits: Limits, _server: ServerInfo) -> Command:
    _arity(args, "REWIND", 3)
    topic, channel = check_topic(args[0], "REWIND"), check_channel(args[1], "REWIND")
    try:
        since_ns, message_id = parse_from(args[2].decode("ascii"))
    except (ValueError, UnicodeDecodeError):
        raise invalid(f"REWIND bad from {args[2][:64]!r} (an RFC 3339 time, unix "
                      f"milliseconds, or a message id of 16 hex characters)") from None
    return Rewind(topic, channel, since_ns, message_id)


def _rdy(args: Sequence[bytes], limits: Limits, _server: ServerInfo) -> Command:
    _arity(args, "RDY", 1)
    return Rdy(check_rdy(parse_decimal(args[0], "RDY", "count"), limits))


def _fin(args: Sequence[bytes], _limits: Limits, _server: ServerInfo) -> Command:
    _arity(args, "FIN", 1, at_least=True)
    if all(len(a) == MSG_ID_LENGTH for a in args):
        return Fin(tuple(args))
    ids: list[bytes] = []
    for frame in args:  # a frame may hold several ids, one after the other
        if len(frame) <= MSG_ID_LENGTH:
            ids.append(parse_msg_id(frame, "FIN"))  # (nsqd's words for a short one)
        elif len(frame) % MSG_ID_LENGTH:
            raise invalid(f"FIN {len(frame)} bytes of message ids is not a multiple of "
                          f"{MSG_ID_LENGTH}")
        else:
            ids += _split_ids(frame)
    return Fin(tuple(ids))


def _split_ids(frame: bytes) -> list[bytes]:
    """The message ids one after the other in `frame` (a multiple of their length)."""
    return _fields(frame, f"{MSG_ID_LENGTH}s", MSG_ID_LENGTH)


def _fields(frame: bytes, item: str, size: int) -> list[bytes]:
    """A field of each `size`-byte item one after the other in `frame` (`item` its
    struct format: ``16s`` an id, ``10x16s`` a header's id), read by at most 13 cached
    structs, one per bit of their number: in C, where a slice each cost ~7 times as
    much."""
    n = len(frame) // size
    out: list[bytes] = []
    at = 0
    for k in range(min(n.bit_length(), 13) - 1, -1, -1):
        reader = _READERS.get((item, k))
        if reader is None:
            reader = _READERS[item, k] = struct.Struct(item * (1 << k))
        while n >= 1 << k:
            out += reader.unpack_from(frame, at)
            at += reader.size
            n -= 1 << k
    return out


def _req(args: Sequence[bytes], limits: Limits, _server: ServerInfo) -> Command:
    _arity(args, "REQ", 2)
    msg_id = parse_msg_id(args[0], "REQ")
    return Req(msg_id, check_delay(parse_decimal(args[1], "REQ", "timeout"), "REQ", limits))


def _touch(args: Sequence[bytes], _limits: Limits, _server: ServerInfo) -> Command:
    _arity(args, "TOUCH", 1)
    return Touch(parse_msg_id(args[0], "TOUCH"))


def _cls(args: Sequence[bytes], _limits: Limits, _server: ServerInfo) -> Command:
    _arity(args, "CLS", 0)
    return Cls()


def _nop(args: Sequence[bytes], _limits: Limits, _server: ServerInfo) -> Command:
    _arity(args, "NOP", 0)
    return Nop()


_HANDLERS: dict[bytes, Callable[[Sequence[bytes], Limits, ServerInfo], Command]] = {
    b"PUB": _pub,
    b"MPUB": _mpub,
    b"DPUB": _dpub,
    b"TPUB": _tagged("TPUB", _pub, 3),
    b"TMPUB": _tagged("TMPUB", _mpub, 3, at_least=True),
    b"TDPUB": _tagged("TDPUB", _dpub, 4),
    b"PMPUB": _pmpub,
    b"TPMPUB": _tagged("TPMPUB", _pmpub, 3),
    b"FIN": _fin,
    b"RDY": _rdy,
    b"REQ": _req,
    b"TOUCH": _touch,
    b"NOP": _nop,
    b"SUB": _sub,
    b"CLS": _cls,
    b"IDENTIFY": _identify,
    b"AUTH": _auth,
    b"REWIND": _rewind,
}


def parse_request(
    frames: Sequence[bytes],
    limits: Limits = _DEFAULT_LIMITS,
    state: ConnectionState | None = None,
    server: ServerInfo = _DEFAULT_SERVER,
) -> Request:
    """Parse one request's frames (without the ROUTER identity) into ``(corr, command)``.

    With ``state`` the connection rules are enforced and ``state`` advances
    (SUB, CLS, IDENTIFY); without it the frames are only validated.
    """
    corr = None
    if frames and frames[0][:1] == CORR_MARKER:
        corr, frames = frames[0], frames[1:]
        if len(corr) > MAX_CORR_SIZE:
            msg = f"correlation frame too long ({len(corr)} > {MAX_CORR_SIZE} bytes)"
            return Request(None, invalid(msg))
    if not frames:
        return Request(corr, invalid("missing command frame"))
    handler = _HANDLERS.get(frames[0])
    if handler is None:
        return Request(corr, invalid_command(frames[0]))
    name = frames[0].decode("ascii")
    try:
        if state is not None and not state.admit(name):
            return Request(corr, Nop())  # RDY after CLS: ignored
        command = handler(frames[1:], limits, server)
    except ProtocolError as e:
        return Request(corr, e)
    if state is not None:
        state.apply(command)
    return Request(corr, command)


def encode_ok(corr: bytes | None = None, payload: bytes | None = None) -> list[bytes]:
    """``[corr] OK [payload]``."""
    frames = [] if corr is None else [corr]
    frames.append(b"OK")
    if payload is not None:
        frames.append(payload)
    return frames


def encode_identify_reply(corr: bytes | None, event: Identify) -> list[bytes]:
    """``[corr] OK <msgpack map>`` answering an IDENTIFY parsed by :func:`parse_request`."""
    return encode_ok(corr, msgpack.packb(event.reply))


def encode_error(corr: bytes | None, error: ProtocolError) -> list[bytes]:
    """``[corr] ERROR code text``."""
    frames = [] if corr is None else [corr]
    frames += [b"ERROR", error.code.encode(), error.text.encode("utf-8", "replace")]
    return frames


def encode_messages(messages: Sequence[bytes]) -> list[bytes]:
    """``MESSAGE m1 m2 ...``: NSQ-encoded messages batched in one multipart message."""
    return [b"MESSAGE", *messages]



def encode_packed_messages(messages: Sequence[bytes]) -> list[bytes]:
    """``MESSAGES headers sizes lines``: the same messages as columns (a session that
    asked for ``packed_messages``: four frames to send and receive, not one a message;
    a reader of JSON lines takes the bodies as they come, docs/PROTOCOL.md 1.5)."""
    bodies = list(map(_BODY, messages))  # (sliced by map: no bytecode a message)
    return [b"MESSAGES", b"".join(map(_HEAD, messages)), _sizes_of(bodies),
            b"\n".join(bodies)]


_HEAD = operator.itemgetter(slice(HEADER_SIZE))
_BODY = operator.itemgetter(slice(HEADER_SIZE, None))


_HEARTBEAT = [b"HEARTBEAT"]


def encode_heartbeat() -> list[bytes]:
    """``HEARTBEAT``: the client answers NOP (any request proves it alive)."""
    return list(_HEARTBEAT)


# ---------------------------------------------------------------------------
# Client side: Command -> frames, frames -> Reply


def encode_request(command: Command, corr: bytes | None = None, *,
                   packed: bool = False) -> list[bytes]:
    """The frames of a request; ``corr`` must start with ``#`` if given.  With `packed`
    (a broker whose IDENTIFY reply says ``packed_messages``), MPUB goes as PMPUB."""
    if corr is not None and (corr[:1] != CORR_MARKER or len(corr) > MAX_CORR_SIZE):
        msg = f"a correlation frame is b'#' plus up to {MAX_CORR_SIZE - 1} bytes, got {corr!r}"
        raise ValueError(msg)
    frames = [] if corr is None else [corr]
    match command:
        case Pub(topic, body, ""):
            frames += [b"PUB", topic.encode(), body]
        case Pub(topic, body, tag):
            frames += [b"TPUB", topic.encode(), tag.encode(), body]
        case Mpub(topic, bodies, "") if packed:
            frames += [b"PMPUB", topic.encode(), pack_bodies(bodies)]
        case Mpub(topic, bodies, tag) if packed:
            frames += [b"TPMPUB", topic.encode(), tag.encode(), pack_bodies(bodies)]
        case Mpub(topic, bodies, ""):
            frames += [b"MPUB", topic.encode(), *bodies]
        case Mpub(topic, bodies, tag):
            frames += [b"TMPUB", topic.encode(), tag.encode(), *bodies]
        case Dpub(topic, delay_ms, body, ""):
            frames += [b"DPUB", topic.encode(), b"%d" % delay_ms, body]
        case Dpub(topic, delay_ms, body, tag):
            frames += [b"TDPUB", topic.encode(), tag.encode(), b"%d" % delay_ms, body]
        case Fin(ids):
            frames += [b"FIN", *ids]
        case Rdy(count):
            frames += [b"RDY", b"%d" % count]
        case Req(msg_id, delay_ms):
            frames += [b"REQ", msg_id, b"%d" % delay_ms]
        case Touch(msg_id):
            frames += [b"TOUCH", msg_id]
        case Sub(topic, channel):
            frames += [b"SUB", topic.encode(), channel.encode()]
        case Identify(data):
            frames += [b"IDENTIFY", msgpack.packb(dict(data))]
        case Auth(secret):
            frames += [b"AUTH", secret]
        case Cls():
            frames.append(b"CLS")
        case Nop():
            frames.append(b"NOP")
        case Rewind(topic, channel, since_ns, message_id):
            start = message_id.encode() if message_id else b"%d" % (since_ns // 1_000_000)
            frames += [b"REWIND", topic.encode(), channel.encode(), start]
        case _:
            msg = f"not a ZeroMQ protocol command: {command!r}"
            raise TypeError(msg)
    return frames


@frozen(slots=True)
class Ok:
    """``OK``: the request with this correlation frame succeeded."""

    corr: bytes | None
    payload: bytes | None = None
    """IDENTIFY's msgpack map, CLS's ``CLOSE_WAIT``, else None."""


@frozen(slots=True)
class ErrorReply:
    """``ERROR``: the request failed; ``error.fatal`` means the session was reset."""

    corr: bytes | None
    error: ProtocolError


@frozen(slots=True)
class Messages:
    """One or more deliveries."""

    messages: tuple[Message, ...]


class Columns:
    """A ``MESSAGES`` frame's messages as columns, with no object made a message (what a
    consumer that answers a frame's messages together keeps): the ids, each message's
    26-byte header, the bodies' sizes and the bodies joined by line feeds, as the frame
    carries them (docs/PROTOCOL.md 1.5).  The bodies are split only when asked for;
    a reader of JSON lines takes ``lines`` as they are."""

    __slots__ = ("_bodies", "headers", "ids", "lines", "sizes")

    def __init__(self, ids: list[bytes], headers: bytes, sizes: bytes, lines: bytes,
                 bodies: list[bytes] | None = None) -> None:
        self.ids = ids
        self.headers = headers
        """Each message's timestamp, attempts and id, 26 bytes a message (1.6)."""
        self.sizes = sizes
        """Each body's size, 4 bytes big-endian a message."""
        self.lines = lines
        """The bodies, one after the other with a line feed between two."""
        self._bodies = bodies

    @classmethod
    def from_bodies(cls, headers: bytes, bodies: list[bytes]) -> Columns:
        """Columns of messages whose headers and bodies are known."""
        return cls(_ids_in(headers), headers, _sizes_of(bodies), b"\n".join(bodies), bodies)

    def _like(self, ids: list[bytes], headers: bytes, sizes: bytes, lines: bytes,
              bodies: list[bytes] | None) -> Any:
        return Columns(ids, headers, sizes, lines, bodies)

    def __len__(self) -> int:
        return len(self.ids)

    def __eq__(self, other: object) -> bool:
        return isinstance(other, Columns) and (self.headers, self.sizes, self.lines) == (
            other.headers, other.sizes, other.lines)

    __hash__ = None  # type: ignore[assignment]

    @property
    def bodies(self) -> list[bytes]:
        bodies = self._bodies
        if bodies is None:
            bodies = self._bodies = _split_lines(self.lines, self.sizes)
        return bodies

    @property
    def timestamps(self) -> list[int]:
        return [ts for ts, _, _ in _HEADER.iter_unpack(self.headers)]

    @property
    def attempts(self) -> list[int]:
        return [attempts for _, attempts, _ in _HEADER.iter_unpack(self.headers)]

    def split(self, n: int) -> tuple[Any, Any]:
        """Its first `n` messages and the rest (each a new one, either may be empty)."""
        n = max(0, min(n, len(self.ids)))
        lines = self.lines
        if n == 0 or n == len(self.ids):
            first, rest = (b"", lines) if n == 0 else (lines, b"")
        else:  # (the nth line feed, just past the nth body, goes with neither)
            cut = sum(struct.unpack_from(f">{n}I", self.sizes)) + n
            first, rest = lines[:cut - 1], lines[cut:]
        bodies = self._bodies
        h, s = HEADER_SIZE * n, 4 * n
        return (self._like(self.ids[:n], self.headers[:h], self.sizes[:s], first,
                           None if bodies is None else bodies[:n]),
                self._like(self.ids[n:], self.headers[h:], self.sizes[s:], rest,
                           None if bodies is None else bodies[n:]))

    def select(self, indices: Iterable[int]) -> Any:
        """Its messages at `indices`, in that order."""
        at = list(indices)
        bodies, headers = self.bodies, self.headers
        picked = [bodies[i] for i in at]
        return self._like([self.ids[i] for i in at],
                          b"".join([headers[HEADER_SIZE * i:HEADER_SIZE * (i + 1)] for i in at]),
                          _sizes_of(picked), b"\n".join(picked), picked)

    def messages(self) -> list[tuple[bytes, int, int, bytes]]:
        """Its messages as ``(id, timestamp, attempts, body)``."""
        return [(i, ts, attempts, body) for (ts, attempts, i), body
                in zip(_HEADER.iter_unpack(self.headers), self.bodies, strict=True)]


def _ids_in(headers: bytes) -> list[bytes]:
    return _fields(headers, f"10x{MSG_ID_LENGTH}s", HEADER_SIZE)


def _sizes_of(bodies: Sequence[bytes]) -> bytes:
    return struct.pack(f">{len(bodies)}I", *map(len, bodies))


def _split_lines(lines: bytes, sizes: bytes) -> list[bytes]:
    """The bodies `lines` joins, by their `sizes` (checked by `unpack_columns`)."""
    n = len(sizes) // 4
    lengths = struct.unpack(f">{n}I", sizes)
    if lines.count(b"\n") == n - 1:  # (no body holds a line feed: split in C)
        bodies = lines.split(b"\n")
        if tuple(map(len, bodies)) == lengths:
            return bodies
    bodies, pos = [], 0
    for size in lengths:
        bodies.append(lines[pos:pos + size])
        pos += size + 1
    return bodies


def unpack_columns(frames: Sequence[bytes]) -> Columns:
    """A ``MESSAGES`` reply's frames after its kind (headers, sizes, lines) as `Columns`;
    ValueError if they do not describe the same messages."""
    if len(frames) != 3:
        raise ValueError(f"{len(frames)} frames, not headers, sizes and lines")
    headers, sizes, lines = frames
    n, rest = divmod(len(headers), HEADER_SIZE)
    if not n or rest or len(sizes) != 4 * n:
        raise ValueError(f"{len(headers)} bytes of headers and {len(sizes)} of sizes "
                         "are not those of the same messages")
    if sum(struct.unpack(f">{n}I", sizes)) + n - 1 != len(lines):
        raise ValueError(f"{len(lines)} bytes of lines are not {n} bodies of those sizes")
    return Columns(_ids_in(headers), headers, sizes, lines)


def columns_of(messages: Sequence[tuple[bytes, int, int, bytes]]) -> Columns:
    """Messages as ``(id, timestamp, attempts, body)`` (a ``MESSAGE`` reply's) as `Columns`."""
    return Columns.from_bodies(b"".join([_HEADER.pack(m[1], m[2], m[0]) for m in messages]),
                               [m[3] for m in messages])


@frozen(slots=True)
class PackedMessages:
    """``MESSAGES``: one or more deliveries as columns (see :func:`unpack_columns`)."""

    columns: Columns


Reply = Ok | ErrorReply | Messages | PackedMessages | Heartbeat


def parse_reply(frames: Sequence[bytes]) -> Reply | ProtocolError:
    """Parse a broker reply; a malformed one is a ``ProtocolError`` (``E_BAD_PROTOCOL``)."""
    corr = None
    if frames and frames[0][:1] == CORR_MARKER:
        corr, frames = frames[0], frames[1:]
    kind = frames[0] if frames else b""
    if kind == b"OK" and len(frames) <= 2:
        return Ok(corr, frames[1] if len(frames) == 2 else None)
    if kind == b"ERROR" and len(frames) == 3:
        code = frames[1].decode("utf-8", "replace")
        return ErrorReply(corr, ProtocolError(code, frames[2].decode("utf-8", "replace")))
    if corr is None and kind == b"MESSAGE" and len(frames) >= 2:
        try:
            return Messages(tuple(decode_message(m) for m in frames[1:]))
        except ValueError as e:
            return ProtocolError("E_BAD_PROTOCOL", f"bad MESSAGE frame: {e}")
    if corr is None and kind == b"MESSAGES":
        try:
            return PackedMessages(unpack_columns(frames[1:]))
        except ValueError as e:
            return ProtocolError("E_BAD_PROTOCOL", f"bad MESSAGES frame: {e}")
    if corr is None and kind == b"HEARTBEAT" and len(frames) == 1:
        return Heartbeat()
    shown = [f[:20] for f in frames[:4]]
    return ProtocolError("E_BAD_PROTOCOL", f"unexpected reply {shown!r}")
