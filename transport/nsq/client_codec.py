"""The client's half of NSQ's TCP protocol V2, sans-IO: commands to bytes, bytes to frames.

Theory of operation
-------------------
:class:`ClientConnection` is the inverse of
:class:`transport.nsq.codec.ServerConnection`, for the Python client library
and the tests: :meth:`~ClientConnection.send` turns a command into the bytes
to write (the ``"  V2"`` magic goes out with the first one), and
:meth:`~ClientConnection.receive_data` / :meth:`~ClientConnection.next_event`
turn what the broker wrote into events, one frame each:

* a response frame is :class:`Response` (``OK``, ``CLOSE_WAIT``, IDENTIFY's
  JSON), except ``_heartbeat_`` which is :class:`Heartbeat` (answer NOP);
* an error frame is :class:`ErrorFrame` (its ``error.fatal`` follows nsqd:
  only ``E_FIN_FAILED``, ``E_REQ_FAILED`` and ``E_TOUCH_FAILED`` leave the
  connection open);
* a message frame is a decoded :class:`Message`.

Frames are ``[4B size][4B type][data]``; a size beyond ``max_frame_size`` is
refused before its data is buffered.  A stream that is not valid V2 yields a
fatal ``ProtocolError("E_BAD_PROTOCOL", ...)`` and then only ``CLOSED``.
"""

from __future__ import annotations

import json
import struct

from transport.mailbox.envelope import frozen
from transport.nsq.codec import (
    CLOSED,
    FRAME_TYPE_ERROR,
    FRAME_TYPE_MESSAGE,
    FRAME_TYPE_RESPONSE,
    MAGIC,
    NEED_DATA,
    Sentinel,
)
from transport.protocol.commands import (
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
    Sub,
    Touch,
    decode_message,
)
from transport.protocol.validation import ProtocolError

__all__ = ["ClientConnection", "ClientEvent", "ErrorFrame", "Response", "encode_command"]

_FRAME_HEAD = struct.Struct(">ii")
_SIZE = struct.Struct(">i")


@frozen(slots=True)
class Response:
    """A response frame other than a heartbeat: ``OK``, ``CLOSE_WAIT``, IDENTIFY's JSON."""

    data: bytes


@frozen(slots=True)
class ErrorFrame:
    """An error frame; ``error.fatal`` says whether the broker closes the connection."""

    error: ProtocolError


def _line(*parts: bytes | str) -> bytes:
    return b" ".join(p.encode() if isinstance(p, str) else p for p in parts) + b"\n"


def _sized(body: bytes) -> bytes:
    return _SIZE.pack(len(body)) + body


def encode_command(command: Command) -> bytes:
    """The V2 bytes of one command (a :class:`Fin` of several ids becomes several lines).

    ValueError for a tagged publish: NSQ V2 has no place for a tag (#21)."""
    if getattr(command, "tag", ""):
        raise ValueError("NSQ TCP cannot carry a tag: publish tagged messages over "
                         "ZeroMQ (TPUB) or HTTP (/pub?tag=)")
    match command:
        case Pub(topic, body):
            return _line(b"PUB", topic) + _sized(body)
        case Mpub(topic, bodies):
            payload = b"".join([_SIZE.pack(len(bodies)), *[_sized(b) for b in bodies]])
            return _line(b"MPUB", topic) + _sized(payload)
        case Dpub(topic, delay_ms, body):
            return _line(b"DPUB", topic, str(delay_ms)) + _sized(body)
        case Fin(ids):
            return b"".join([_line(b"FIN", i) for i in ids])
        case Rdy(count):
            return _line(b"RDY", str(count))
        case Req(msg_id, delay_ms):
            return _line(b"REQ", msg_id, str(delay_ms))
        case Touch(msg_id):
            return _line(b"TOUCH", msg_id)
        case Sub(topic, channel):
            return _line(b"SUB", topic, channel)
        case Identify(data):
            return b"IDENTIFY\n" + _sized(json.dumps(dict(data), separators=(",", ":")).encode())
        case Auth(secret):
            return b"AUTH\n" + _sized(secret)
        case Cls():
            return b"CLS\n"
        case Nop():
            return b"NOP\n"
    msg = f"not a command: {command!r}"
    raise TypeError(msg)


ClientEvent = Response | Heartbeat | ErrorFrame | Message | ProtocolError | Sentinel


class ClientConnection:
    """The client's half: :meth:`send` commands, feed bytes, take frames as events.

    A malformed stream from the broker is returned as a fatal
    ``ProtocolError("E_BAD_PROTOCOL", ...)``, after which only :data:`CLOSED`.
    """

    def __init__(self, max_frame_size: int = 16 * 1024 * 1024) -> None:
        self.max_frame_size = max_frame_size
        self._buf = bytearray()
        self._pos = 0
        self._sent_magic = False
        self._closed = False
        self._eof = False

    def send(self, command: Command) -> bytes:
        """Bytes to write for ``command`` (preceded by the magic the first time)."""
        data = encode_command(command)
        if not self._sent_magic:
            self._sent_magic = True
            return MAGIC + data
        return data

    def receive_data(self, data: bytes) -> None:
        """Buffer bytes read from the broker; ``b""`` means it closed the connection."""
        if self._closed:
            return
        if not data:
            self._eof = True
            return
        if self._pos:
            del self._buf[: self._pos]
            self._pos = 0
        self._buf += data

    def next_event(self) -> ClientEvent:
        """The next frame as an event, :data:`NEED_DATA` or :data:`CLOSED`."""
        if self._closed:
            return CLOSED
        event = self._parse()
        if isinstance(event, ProtocolError) or (event is NEED_DATA and self._eof):
            self._closed = True
            self._buf = bytearray()
            self._pos = 0
            return CLOSED if event is NEED_DATA else event
        return event

    def _parse(self) -> ClientEvent:
        buf, pos = self._buf, self._pos
        if len(buf) - pos < 8:
            return NEED_DATA
        size, frame_type = _FRAME_HEAD.unpack_from(buf, pos)
        if size < 4 or size > self.max_frame_size:
            return ProtocolError("E_BAD_PROTOCOL", f"frame size {size} out of range")
        end = pos + 4 + size
        if len(buf) < end:
            return NEED_DATA
        data = bytes(buf[pos + 8 : end])
        self._pos = end
        if frame_type == FRAME_TYPE_RESPONSE:
            return Heartbeat() if data == b"_heartbeat_" else Response(data)
        if frame_type == FRAME_TYPE_ERROR:
            return ErrorFrame(ProtocolError.from_payload(data))
        if frame_type == FRAME_TYPE_MESSAGE:
            try:
                return decode_message(data)
            except ValueError as e:
                return ProtocolError("E_BAD_PROTOCOL", str(e))
        return ProtocolError("E_BAD_PROTOCOL", f"unknown frame type {frame_type}")
