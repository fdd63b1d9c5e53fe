"""NSQ's TCP protocol V2 as a sans-IO codec: bytes in, commands out; frames out as bytes.

Theory of operation
-------------------
**Server side.**  :class:`ServerConnection` is fed whatever the socket read
(:meth:`~ServerConnection.receive_data`) and asked for one event at a time
(:meth:`~ServerConnection.next_event`), as in h11.  An event is a command
from :mod:`transport.protocol.commands` (:class:`Pub`, :class:`Sub`, ...), a
:class:`ProtocolError` (returned, never raised), :data:`NEED_DATA` (feed more
bytes) or :data:`CLOSED` (after a fatal error or end of input).  The stream
is nsqd's::

    "  V2"                                   4-byte magic, once
    NAME[ PARAM]*\\n                         a command line (\\r\\n tolerated)
    [4-byte big-endian size][size bytes]     after IDENTIFY, AUTH, PUB, MPUB, DPUB

The decoder is a small machine over one buffer: ``MAGIC -> LINE -> (SIZE ->
BODY ->) LINE ...``.  A line is checked (name, state, parameter count, topic,
numbers) as soon as its ``\\n`` arrives, and a declared body size as soon as
its four bytes arrive, so an oversized body is refused *before* it is
buffered and a line longer than :attr:`Limits.max_line_size` is refused
without waiting for its end.  Bytes after an event stay buffered for the next.
Partial input works at any split, down to one byte at a time.

The connection's nsqd state (init, subscribed, closing) is tracked by a
:class:`ConnectionState`: RDY before SUB or SUB twice is ``E_INVALID cannot
X in current state``; RDY after CLS becomes a :class:`Nop`.  IDENTIFY is
validated and negotiated here (:func:`transport.protocol.identify.negotiate_identify`),
so the :class:`Identify` event carries the settings to apply and the reply to
send (:func:`encode_identify_response`).

Every error the decoder finds is fatal, as in nsqd: after returning it the
connection answers only :data:`CLOSED`.  The broker's own errors (``E_FIN_FAILED``
...) go out through :meth:`ServerConnection.send_error`, which closes the
decoder only for fatal ones.

**Frames** (broker to client) are ``[4B size][4B type][data]`` where size
counts the type and data; type 0 is a response (``OK``, ``_heartbeat_``,
``CLOSE_WAIT``, IDENTIFY's JSON), 1 an error (``E_CODE text``), 2 a message
(NSQ's message encoding, sent unchanged).

**Client side** is :mod:`transport.nsq.client_codec` (``ClientConnection``).
"""

from __future__ import annotations

import json
import struct
from collections.abc import Callable, Iterable
from enum import Enum, auto

from transport.protocol.commands import (
    Auth,
    Cls,
    Command,
    Dpub,
    Fin,
    Identify,
    Mpub,
    Nop,
    Pub,
    Rdy,
    Req,
    Sub,
    Touch,
)
from transport.protocol.identify import IdentifySettings, ServerInfo, negotiate_identify
from transport.protocol.validation import (
    ConnectionState,
    Limits,
    ProtocolError,
    check_body_size,
    check_channel,
    check_delay,
    check_message_size,
    check_rdy,
    check_topic,
    invalid,
    invalid_command,
    parse_decimal,
    parse_msg_id,
    split_mpub_body,
    split_mpub_view,
    states_allowing,
)

__all__ = [
    "CLOSED",
    "CLOSE_WAIT_FRAME",
    "FRAME_TYPE_ERROR",
    "FRAME_TYPE_MESSAGE",
    "FRAME_TYPE_RESPONSE",
    "HEARTBEAT_FRAME",
    "MAGIC",
    "NEED_DATA",
    "OK_FRAME",
    "PUBLISHES",
    "Sentinel",
    "ServerConnection",
    "encode_error",
    "encode_frame",
    "encode_identify_response",
    "encode_message",
    "encode_messages",
    "encode_response",
]

MAGIC = b"  V2"
_FIN_STATES = states_allowing("FIN")
PUBLISHES = (Pub, Mpub, Dpub)
"""The commands that publish (the first of them may hand a connection over)."""
_FIN_LINE = 21
"""``FIN <16-byte id>\\n``: a consumer sends one of these lines per message."""
_FIN_MARKS = ((0, b"F"), (1, b"I"), (2, b"N"), (3, b" "), (20, b"\n"))
"""The bytes every FIN line has at these offsets (its id may hold any 16)."""
_FIN_CHUNK = 256
_FIN_IDS: dict[int, struct.Struct] = {}
"""By `n`: the struct that reads the ids of `n` FIN lines in one call (made when first
needed: all of them at import took 1.5 ms)."""
FRAME_TYPE_RESPONSE = 0
FRAME_TYPE_ERROR = 1
FRAME_TYPE_MESSAGE = 2

_SPLIT_IN_PLACE = 64 * 1024
"""An MPUB body of at least this many bytes is split into views of the read buffer,
which the decoder lets go of (`split_mpub_view`); a smaller one is copied out and split
into bytes, which is faster for it."""


class Sentinel(Enum):
    """The two non-events: more bytes needed, or the connection is over."""

    NEED_DATA = auto()
    CLOSED = auto()


NEED_DATA = Sentinel.NEED_DATA
"""Not enough bytes for the next event: call ``receive_data`` again."""
CLOSED = Sentinel.CLOSED
"""The peer is done (fatal error or end of input): close the socket."""

_FRAME_HEAD = struct.Struct(">ii")
_FRAME_EXTRA = 4  # a frame's size counts its type
_SIZE = struct.Struct(">i")


# ---------------------------------------------------------------------------
# Frames (broker -> client)


def encode_frame(frame_type: int, data: bytes) -> bytes:
    """``[4B size][4B type][data]`` with size = 4 + len(data)."""
    return _FRAME_HEAD.pack(len(data) + 4, frame_type) + data


def encode_response(data: bytes = b"OK") -> bytes:
    """A response frame (type 0)."""
    return encode_frame(FRAME_TYPE_RESPONSE, data)


def encode_error(error: ProtocolError) -> bytes:
    """An error frame (type 1) carrying ``E_CODE text``."""
    return encode_frame(FRAME_TYPE_ERROR, error.payload())


def encode_message(encoded: bytes) -> bytes:
    """A message frame (type 2) around an NSQ-encoded message."""
    return encode_frame(FRAME_TYPE_MESSAGE, encoded)


def encode_messages(messages: Iterable[bytes]) -> bytes:
    """Many message frames in one buffer, for one write.

    Heads and messages interleaved in one join: each message is copied once
    (``head + m`` first would copy it twice; 3x slower at 1 KiB).  The heads are
    looked up by size, :data:`_MESSAGE_HEADS` (83 against 183 ns a message at 100 B
    where each was packed).
    """
    messages = list(messages)
    parts: list[bytes] = [b""] * (2 * len(messages))
    parts[::2] = map(_MESSAGE_HEADS.__getitem__, map(len, messages))
    parts[1::2] = messages
    return b"".join(parts)


class _Heads(dict[int, bytes]):
    """A message frame's 8-byte head by the size of the message it frames, made when
    first asked for (up to 4,096 sizes kept: a topic's messages have few)."""

    def __missing__(self, size: int) -> bytes:
        if len(self) >= 4096:
            self.clear()
        head = self[size] = _FRAME_HEAD.pack(size + _FRAME_EXTRA, FRAME_TYPE_MESSAGE)
        return head


_MESSAGE_HEADS = _Heads()


def encode_identify_response(event: Identify) -> bytes:
    """The answer to IDENTIFY: nsqd's JSON map, or ``OK`` without feature negotiation."""
    if event.reply is None:
        return OK_FRAME
    return encode_response(json.dumps(event.reply, separators=(",", ":")).encode())


OK_FRAME = encode_response(b"OK")
HEARTBEAT_FRAME = encode_response(b"_heartbeat_")
CLOSE_WAIT_FRAME = encode_response(b"CLOSE_WAIT")


# ---------------------------------------------------------------------------
# Server side: bytes -> commands


class _Phase(Enum):
    MAGIC = auto()
    LINE = auto()
    SIZE = auto()
    BODY = auto()
    CLOSED = auto()


Event = Command | ProtocolError | Sentinel


class ServerConnection:
    """One client connection's decoder and nsqd state; see the module docstring."""

    def __init__(self, limits: Limits | None = None, server: ServerInfo | None = None) -> None:
        self.limits = limits or Limits()
        self.server = server or ServerInfo()
        self.state = ConnectionState()
        self.settings = IdentifySettings.defaults(self.limits)
        """The connection's settings; replaced when IDENTIFY succeeds."""
        self._buf = bytearray()
        self._pos = 0  # start of unconsumed bytes
        self._scan = 0  # where the search for "\n" resumes
        self.tls_required = False
        """Every command but IDENTIFY is refused (fatally) until ``tls`` is set."""
        self.tls = False
        """The connection was upgraded to TLS (set by the socket loop)."""
        self.pause_at_publish = False
        """:meth:`next_events` stops after a PUB, MPUB or DPUB too (set by a socket loop
        that may hand the connection to its topic's process)."""
        self._phase = _Phase.MAGIC
        self._eof = False
        # the body command being read: its name, topic and delay
        self._body_name = ""
        self._topic = ""
        self._delay = 0
        self._body_size = 0

    @property
    def closed(self) -> bool:
        """True once a fatal error was returned or sent."""
        return self._phase is _Phase.CLOSED

    def receive_data(self, data: bytes) -> None:
        """Buffer bytes read from the socket; ``b""`` means the client closed its side."""
        if self._phase is _Phase.CLOSED:
            return
        if not data:
            self._eof = True
            return
        if self._pos:
            del self._buf[: self._pos]
            self._scan -= self._pos
            self._pos = 0
        self._buf += data

    def next_event(self) -> Event:
        """The next command, a ``ProtocolError``, :data:`NEED_DATA` or :data:`CLOSED`."""
        if self._phase is _Phase.CLOSED:
            return CLOSED
        try:
            event = self._parse()
        except ProtocolError as e:
            if e.fatal:
                self._close()
            return e
        if event is NEED_DATA and self._eof:
            self._close()
            return CLOSED
        return event

    def next_events(self) -> list[Command | ProtocolError]:
        """Every event the buffered bytes hold (stops after a fatal error, after a SUB,
        and after a publish while :attr:`pause_at_publish` is set: the bytes after it
        stay buffered until the next call, so a socket loop may hand the connection over
        to another process with them, :meth:`take_buffered`).

        Runs of well-formed ``FIN <id>`` lines -- a consumer acking a batch,
        the commonest traffic there is -- come out as one :class:`Fin` with
        all their ids, read by a fast path; anything unusual in a FIN line
        goes through the general parser and gets its exact error.
        """
        events: list[Command | ProtocolError] = []
        fin_states = _FIN_STATES
        while True:
            if self._phase is _Phase.LINE and self.state.state in fin_states:
                ids = self._fast_fins()
                if ids:
                    events.append(Fin(tuple(ids)))
            event = self.next_event()
            if isinstance(event, Sentinel):
                return events
            events.append(event)
            if type(event) is Sub or (self.pause_at_publish and type(event) in PUBLISHES):
                return events

    def _fast_fins(self) -> list[bytes]:
        """Take consecutive ``FIN <16-byte id>\\n`` lines; stop at anything else.

        The per-line work is in C: lines are 21 bytes, so the bytes at each fixed
        offset of the whole lines buffered are a strided slice, and the run is as
        long as the shortest stretch of right bytes at its start; then a `struct`
        reads every id of the run (two regular expressions took 1.7x as long a FIN,
        the read included).
        """
        buf, pos = self._buf, self._pos
        lines = (len(buf) - pos) // _FIN_LINE
        if not lines or buf[pos : pos + 4] != b"FIN ":
            return []
        end = pos + lines * _FIN_LINE
        for offset, mark in _FIN_MARKS:
            column = buf[pos + offset : end : _FIN_LINE]
            lines = min(lines, len(column) - len(column.lstrip(mark)))
        ids: list[bytes] = []
        for at in range(0, lines, _FIN_CHUNK):
            n = min(_FIN_CHUNK, lines - at)
            reader = _FIN_IDS.get(n)
            if reader is None:
                reader = _FIN_IDS[n] = struct.Struct("<" + "4x16sx" * n)
            ids += reader.unpack_from(buf, pos + at * _FIN_LINE)
        self._pos = self._scan = pos + lines * _FIN_LINE
        return ids

    @classmethod
    def resumed(cls, limits: Limits, server: ServerInfo, settings: IdentifySettings,
                buffered: bytes, *, subscribed: bool = True) -> ServerConnection:
        """A connection that another process decoded up to and including its SUB or a
        publish (the hand-off of a connection, transport.nsq.handoff): past the magic,
        subscribed or not, with that connection's IDENTIFY settings and its unparsed
        bytes."""
        conn = cls(limits, server)
        conn.settings = settings
        conn.state.heartbeats = settings.heartbeat_interval > 0
        if subscribed:
            conn.state.apply(Sub("", ""))
        conn._phase = _Phase.LINE
        conn._buf += buffered
        return conn

    def take_buffered(self) -> bytes:
        """The bytes received and not yet parsed, removed from this decoder (at a command
        boundary: read after :meth:`next_events` returned a SUB)."""
        data = bytes(self._buf[self._pos :])
        self.discard_buffered()
        return data

    def discard_buffered(self) -> None:
        """Drop the bytes received and not yet parsed: the connection's transport changes
        under them (TLS after IDENTIFY; nsqd's reader is replaced the same way)."""
        del self._buf[: len(self._buf)]
        self._pos = self._scan = 0

    def send_error(self, error: ProtocolError) -> bytes:
        """Encode an error frame; a fatal one also stops the decoder."""
        if error.fatal:
            self._close()
        return encode_error(error)

    def _close(self) -> None:
        self._phase = _Phase.CLOSED
        self._buf = bytearray()
        self._pos = self._scan = 0

    # -- the machine ----------------------------------------------------------

    def _parse(self) -> Command | Sentinel:
        buf = self._buf
        while True:
            phase = self._phase
            if phase is _Phase.LINE:
                nl = buf.find(b"\n", self._scan)
                if nl < 0 or nl - self._pos > self.limits.max_line_size:
                    if len(buf) - self._pos > self.limits.max_line_size:
                        msg = f"command line too long (more than {self.limits.max_line_size} bytes)"
                        raise invalid(msg)
                    self._scan = len(buf)
                    return NEED_DATA
                end = nl - 1 if nl > self._pos and buf[nl - 1] == 0x0D else nl
                params = bytes(buf[self._pos : end]).split(b" ")
                self._pos = self._scan = nl + 1
                if self.tls_required and not self.tls and params[0] != b"IDENTIFY":
                    name = params[0].decode("utf-8", "replace")
                    msg = f"cannot {name} in current state (TLS required)"
                    raise ProtocolError("E_INVALID", msg, fatal=True)
                handler = _LINE_HANDLERS.get(params[0])
                if handler is None:
                    raise invalid_command(params[0])
                command = handler(self, params)
                if command is not None:
                    return command
            elif phase is _Phase.SIZE:
                if len(buf) - self._pos < 4:
                    return NEED_DATA
                (size,) = _SIZE.unpack_from(buf, self._pos)
                self._pos += 4
                _SIZE_CHECKS[self._body_name](size, self._body_name, self.limits)
                self._body_size = size
                self._phase = _Phase.BODY
            elif phase is _Phase.BODY:
                start, end = self._pos, self._pos + self._body_size
                if len(buf) < end:
                    return NEED_DATA
                self._pos = self._scan = end
                self._phase = _Phase.LINE
                if self._body_size >= _SPLIT_IN_PLACE and self._body_name == "MPUB":
                    body = self._let_go(start, end)
                    bodies = split_mpub_view(body, self.limits)
                    if bodies is not None:
                        return Mpub(self._topic, bodies)
                    return self._finish_body(body.tobytes())  # (which names the fault)
                return self._finish_body(bytes(buf[start:end]))
            elif phase is _Phase.MAGIC:
                if len(buf) - self._pos < 4:
                    return NEED_DATA
                magic = bytes(buf[self._pos : self._pos + 4])
                self._pos = self._scan = self._pos + 4
                if magic != MAGIC:
                    raise ProtocolError("E_BAD_PROTOCOL")
                self._phase = _Phase.LINE
            else:  # pragma: no cover - CLOSED is handled by next_event
                return CLOSED

    def _let_go(self, start: int, end: int) -> memoryview:
        """Bytes `start`:`end` of the buffer (all parsed), as a view of memory this
        decoder will not write to again: the buffer itself, the bytes after them moved
        to a new one, where those are the fewer; else a copy."""
        buf = self._buf
        if len(buf) - end > end - start:
            with memoryview(buf) as view, view[start:end] as part:
                return memoryview(part.tobytes())
        self._buf = buf[end:]
        self._pos = self._scan = 0
        return memoryview(buf)[start:end]

    def _expect_body(self, name: str, topic: str = "", delay: int = 0) -> None:
        self._body_name, self._topic, self._delay = name, topic, delay
        self._phase = _Phase.SIZE

    def _finish_body(self, body: bytes) -> Command:
        name = self._body_name
        if name == "PUB":
            return Pub(self._topic, body)
        if name == "MPUB":
            return Mpub(self._topic, split_mpub_body(body, self.limits))
        if name == "DPUB":
            return Dpub(self._topic, self._delay, body)
        if name == "AUTH":
            return Auth(body)
        return self._identify(body)

    def _identify(self, body: bytes) -> Identify:
        try:
            data = json.loads(body)
        except (ValueError, RecursionError) as e:
            msg = "IDENTIFY failed to decode JSON body"
            raise ProtocolError("E_BAD_BODY", msg) from e
        reply, settings = negotiate_identify(data, self.limits, self.server)
        event = Identify(data, settings, reply)
        self.settings = settings
        self.state.apply(event)
        return event

    # -- one method per command line; None means "a body follows" ------------

    def _on_identify(self, _params: list[bytes]) -> None:
        self.state.admit("IDENTIFY")
        self._expect_body("IDENTIFY")

    def _on_auth(self, params: list[bytes]) -> None:
        self.state.admit("AUTH")
        if len(params) != 1:
            raise invalid("AUTH invalid number of parameters")
        self._expect_body("AUTH")

    def _on_sub(self, params: list[bytes]) -> Command:
        self.state.admit("SUB")
        if len(params) < 3:
            raise invalid("SUB insufficient number of parameters")
        command = Sub(check_topic(params[1], "SUB"), check_channel(params[2], "SUB"))
        self.state.apply(command)
        return command

    def _on_rdy(self, params: list[bytes]) -> Command:
        if not self.state.admit("RDY"):
            return Nop()  # RDY after CLS: ignored, as nsqd does
        count = 1 if len(params) == 1 else parse_decimal(params[1], "RDY", "count")
        return Rdy(check_rdy(count, self.limits))

    def _on_fin(self, params: list[bytes]) -> Command:
        self.state.admit("FIN")
        if len(params) < 2:
            raise invalid("FIN insufficient number of params")
        return Fin((parse_msg_id(params[1], "FIN"),))

    def _on_req(self, params: list[bytes]) -> Command:
        self.state.admit("REQ")
        if len(params) < 3:
            raise invalid("REQ insufficient number of params")
        msg_id = parse_msg_id(params[1], "REQ")
        delay = parse_decimal(params[2], "REQ", "timeout")
        return Req(msg_id, check_delay(delay, "REQ", self.limits))

    def _on_touch(self, params: list[bytes]) -> Command:
        self.state.admit("TOUCH")
        if len(params) < 2:
            raise invalid("TOUCH insufficient number of params")
        return Touch(parse_msg_id(params[1], "TOUCH"))

    def _on_cls(self, _params: list[bytes]) -> Command:
        self.state.admit("CLS")
        command = Cls()
        self.state.apply(command)
        return command

    def _on_nop(self, _params: list[bytes]) -> Command:
        return Nop()

    def _on_pub(self, params: list[bytes]) -> None:
        if len(params) < 2:
            raise invalid("PUB insufficient number of parameters")
        self._expect_body("PUB", check_topic(params[1], "PUB"))

    def _on_mpub(self, params: list[bytes]) -> None:
        if len(params) < 2:
            raise invalid("MPUB insufficient number of parameters")
        self._expect_body("MPUB", check_topic(params[1], "MPUB"))

    def _on_dpub(self, params: list[bytes]) -> None:
        if len(params) < 3:
            raise invalid("DPUB insufficient number of parameters")
        topic = check_topic(params[1], "DPUB")
        delay = check_delay(parse_decimal(params[2], "DPUB", "timeout"), "DPUB", self.limits)
        self._expect_body("DPUB", topic, delay)


_LINE_HANDLERS: dict[bytes, Callable[[ServerConnection, list[bytes]], Command | None]] = {
    b"PUB": ServerConnection._on_pub,
    b"MPUB": ServerConnection._on_mpub,
    b"DPUB": ServerConnection._on_dpub,
    b"FIN": ServerConnection._on_fin,
    b"RDY": ServerConnection._on_rdy,
    b"REQ": ServerConnection._on_req,
    b"TOUCH": ServerConnection._on_touch,
    b"NOP": ServerConnection._on_nop,
    b"SUB": ServerConnection._on_sub,
    b"CLS": ServerConnection._on_cls,
    b"IDENTIFY": ServerConnection._on_identify,
    b"AUTH": ServerConnection._on_auth,
}
_SIZE_CHECKS: dict[str, Callable[[int, str, Limits], None]] = {
    "PUB": check_message_size,
    "DPUB": check_message_size,
    "MPUB": check_body_size,
    "IDENTIFY": check_body_size,
    "AUTH": check_body_size,
}
