"""nsqlookupd's TCP protocol V1 as a sans-IO codec, both sides.

Theory of operation
-------------------
A broker (nsqd, or ours) keeps one connection to each lookup daemon and
announces what it has on it.  The stream from the broker is::

    "  V1"                                        4-byte magic, once
    NAME[ PARAM]*\\n                              a command line
    [4-byte big-endian size][JSON]                after IDENTIFY only

with four commands: ``IDENTIFY`` (the body says who the broker is),
``REGISTER topic [channel]``, ``UNREGISTER topic [channel]`` and ``PING``.
A line is trimmed of surrounding whitespace and split on single spaces, as
nsqlookupd does (so ``REGISTER  t`` has an empty topic); names are
case-sensitive and extra parameters are ignored.

Every answer is ``[4-byte big-endian size][data]`` -- no frame type, unlike
V2 -- holding ``OK``, IDENTIFY's JSON, or an error ``E_CODE text``.  Every
error is fatal: the daemon writes it and closes the connection.

**Server side** (:class:`LookupServerConnection`, the lookup daemon) is fed
bytes and asked for events, as h11 is: :class:`Identify`, :class:`Register`,
:class:`Unregister`, :class:`Ping`, a :class:`ProtocolError` (then only
:data:`CLOSED`), :data:`NEED_DATA` or :data:`CLOSED`.  It checks what
nsqlookupd checks, in its order and with its texts (IDENTIFY first and once,
parameter count, names, IDENTIFY's JSON and required fields), and, unlike
nsqlookupd 1.3, bounds what it buffers: a line longer than
:data:`MAX_LINE` and an IDENTIFY body size that is negative or over
:data:`MAX_IDENTIFY_BODY` are refused (nsqlookupd panics on a negative size).

**Client side** (:class:`LookupClientConnection`, the broker's peer) encodes
commands and decodes answers into :class:`Answer` (``ok``, ``error``,
``json()``).
"""

from __future__ import annotations

import json
import struct
from dataclasses import field
from typing import Any

from transport.mailbox.envelope import frozen
from transport.nsq.codec import CLOSED, NEED_DATA, Sentinel
from transport.protocol.validation import ProtocolError, valid_name

__all__ = [
    "CLOSED",
    "MAGIC",
    "MAX_IDENTIFY_BODY",
    "MAX_LINE",
    "NEED_DATA",
    "Answer",
    "Identify",
    "LookupClientConnection",
    "LookupServerConnection",
    "Ping",
    "Register",
    "Unregister",
    "encode_answer",
    "encode_error",
]

MAGIC = b"  V1"
MAX_LINE = 4096
"""Longest command line taken (REGISTER with two 64-byte names is ~140 bytes)."""
MAX_IDENTIFY_BODY = 1 << 20
"""Largest IDENTIFY body taken (nsqd's is ~100 bytes)."""

_SIZE = struct.Struct(">i")
_REQUIRED = ("broadcast_address", "tcp_port", "http_port", "version")
_STRINGS = ("hostname", "broadcast_address", "version", "remote_address")
_INTS = ("tcp_port", "http_port")


@frozen
class Identify:
    """``IDENTIFY``: who the broker is (fields checked, keys lower-cased)."""

    broadcast_address: str
    tcp_port: int
    http_port: int
    version: str
    hostname: str = ""
    extra: dict[str, Any] = field(default_factory=dict)
    """Fields nsqlookupd does not know (ours: ``zmq_port``), kept to pass on."""


@frozen
class Register:
    """``REGISTER topic [channel]``; ``channel`` is ``""`` for the topic alone."""

    topic: str
    channel: str = ""


@frozen
class Unregister:
    """``UNREGISTER topic [channel]``."""

    topic: str
    channel: str = ""


@frozen
class Ping:
    """``PING``: the broker is alive."""


Command = Identify | Register | Unregister | Ping
Event = Command | ProtocolError | Sentinel


def encode_answer(data: bytes = b"OK") -> bytes:
    """``[4B size][data]``: OK, IDENTIFY's JSON."""
    return _SIZE.pack(len(data)) + data


def encode_error(error: ProtocolError) -> bytes:
    """``[4B size][E_CODE text]`` (the connection is closed after it)."""
    return encode_answer(error.payload())


def _name(raw: bytes, command: str, what: str) -> str:
    """A topic or channel name, or nsqlookupd's ``E_BAD_TOPIC`` / ``E_BAD_CHANNEL``."""
    if not valid_name(raw):
        text = raw.decode("utf-8", "replace")
        raise ProtocolError(f"E_BAD_{what.upper()}",
                            f"{command} {what} name '{text}' is not valid", fatal=True)
    return raw.decode("ascii")


def _bad_body(text: str) -> ProtocolError:
    return ProtocolError("E_BAD_BODY", f"IDENTIFY {text}", fatal=True)


def decode_identify(body: bytes) -> Identify:
    """IDENTIFY's JSON as nsqlookupd reads it: keys in any case, strict types, four
    fields required; raises ``E_BAD_BODY``."""
    try:
        raw = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise _bad_body("failed to decode JSON body") from None
    if raw is None:
        raw = {}
    if not isinstance(raw, dict):
        raise _bad_body("failed to decode JSON body")
    fields: dict[str, Any] = {"hostname": "", "broadcast_address": "", "version": "",
                              "tcp_port": 0, "http_port": 0}
    extra: dict[str, Any] = {}
    for key, value in raw.items():
        name = key.lower()
        if name in _STRINGS:
            if value is not None and not isinstance(value, str):
                raise _bad_body("failed to decode JSON body")
            if name != "remote_address":  # (the daemon knows the real one)
                fields[name] = value or ""
        elif name in _INTS:
            if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
                raise _bad_body("failed to decode JSON body")
            fields[name] = value or 0
        else:
            extra[key] = value
    if not all(fields[name] for name in _REQUIRED):
        raise _bad_body("missing fields")
    return Identify(fields["broadcast_address"], fields["tcp_port"], fields["http_port"],
                    fields["version"], fields["hostname"], extra)


class LookupServerConnection:
    """One broker's connection to the lookup daemon: its decoder and state."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._magic = False
        self._closed = False
        self._eof = False
        self._body_size: int | None = None  # reading IDENTIFY's body of this size
        self.identified = False
        """True once an IDENTIFY was returned (REGISTER and UNREGISTER need it)."""

    @property
    def closed(self) -> bool:
        return self._closed

    def receive_data(self, data: bytes) -> None:
        """Bytes read from the socket; ``b""`` means the broker closed its side."""
        if self._closed:
            return
        if not data:
            self._eof = True
            return
        self._buf += data

    def next_event(self) -> Event:
        """The next command, a (fatal) ``ProtocolError``, NEED_DATA or CLOSED."""
        if self._closed:
            return CLOSED
        try:
            event = self._parse()
        except ProtocolError as e:
            self._closed = True
            return e
        if event is NEED_DATA and self._eof:
            self._closed = True
            return CLOSED
        return event

    def _parse(self) -> Event:
        buf = self._buf
        if not self._magic:
            if len(buf) < 4:
                return NEED_DATA
            magic = bytes(buf[:4])
            del buf[:4]
            if magic != MAGIC:
                raise ProtocolError("E_BAD_PROTOCOL", "", fatal=True)
            self._magic = True
        if self._body_size is not None:
            return self._identify_body()
        end = buf.find(b"\n", 0, MAX_LINE + 1)
        if end < 0:
            if len(buf) > MAX_LINE:
                raise ProtocolError("E_INVALID", f"command line longer than {MAX_LINE} bytes",
                                    fatal=True)
            return NEED_DATA
        line = bytes(buf[:end]).strip()
        del buf[: end + 1]
        name, *params = line.split(b" ")
        match name:
            case b"PING":
                return Ping()
            case b"IDENTIFY":
                if self.identified:
                    raise ProtocolError("E_INVALID", "cannot IDENTIFY again", fatal=True)
                self._body_size = -1
                return self._identify_body()
            case b"REGISTER" | b"UNREGISTER":
                command = name.decode()
                if not self.identified:
                    raise ProtocolError("E_INVALID", "client must IDENTIFY", fatal=True)
                if not params:
                    raise ProtocolError("E_INVALID",
                                        f"{command} insufficient number of params", fatal=True)
                topic = _name(params[0], command, "topic")
                channel = _name(params[1], command, "channel") if len(params) > 1 \
                    and params[1] else ""
                return Register(topic, channel) if command == "REGISTER" \
                    else Unregister(topic, channel)
        text = name.decode("utf-8", "replace")
        raise ProtocolError("E_INVALID", f"invalid command {text}", fatal=True)

    def _identify_body(self) -> Event:
        buf = self._buf
        if self._body_size == -1:
            if len(buf) < 4:
                if self._eof:
                    raise _bad_body("failed to read body size")
                return NEED_DATA
            (size,) = _SIZE.unpack_from(buf)
            del buf[:4]
            if size < 0 or size > MAX_IDENTIFY_BODY:
                raise _bad_body(f"invalid body size {size}")
            self._body_size = size
        size = self._body_size
        assert size is not None
        if len(buf) < size:
            if self._eof:
                raise _bad_body("failed to read body")
            return NEED_DATA
        body = bytes(buf[:size])
        del buf[:size]
        self._body_size = None
        identify = decode_identify(body)
        self.identified = True
        return identify


# ---------------------------------------------------------------------------
# Client side (the broker's peer)


@frozen
class Answer:
    """One answer of the lookup daemon (V1 has no frame type: errors are ``E_*`` text)."""

    data: bytes

    @property
    def ok(self) -> bool:
        return not self.data.startswith(b"E_")

    @property
    def error(self) -> ProtocolError | None:
        return None if self.ok else ProtocolError.from_payload(self.data)

    def json(self) -> Any:
        return json.loads(self.data)


class LookupClientConnection:
    """The broker's side: commands to bytes (the magic first), bytes to answers."""

    def __init__(self) -> None:
        self._buf = bytearray()
        self._sent_magic = False
        self._eof = False

    def send(self, command: Command) -> bytes:
        out = b""
        if not self._sent_magic:
            out, self._sent_magic = MAGIC, True
        match command:
            case Identify():
                body = {"broadcast_address": command.broadcast_address,
                        "hostname": command.hostname, "http_port": command.http_port,
                        "tcp_port": command.tcp_port, "version": command.version,
                        **command.extra}
                data = json.dumps(body, sort_keys=True, separators=(",", ":")).encode()
                return out + b"IDENTIFY\n" + _SIZE.pack(len(data)) + data
            case Register(topic=topic, channel=channel):
                return out + _line(b"REGISTER", topic, channel)
            case Unregister(topic=topic, channel=channel):
                return out + _line(b"UNREGISTER", topic, channel)
            case Ping():
                return out + b"PING\n"
        raise TypeError(f"not a lookup command: {command!r}")

    def receive_data(self, data: bytes) -> None:
        if not data:
            self._eof = True
        self._buf += data

    def next_event(self) -> Answer | Sentinel:
        buf = self._buf
        if len(buf) >= 4:
            (size,) = _SIZE.unpack_from(buf)
            if size < 0:
                return CLOSED
            if len(buf) >= 4 + size:
                data = bytes(buf[4:4 + size])
                del buf[:4 + size]
                return Answer(data)
        return CLOSED if self._eof else NEED_DATA


def _line(name: bytes, topic: str, channel: str) -> bytes:
    parts = [name, topic.encode()]
    if channel:
        parts.append(channel.encode())
    return b" ".join(parts) + b"\n"
