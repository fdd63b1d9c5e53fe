"""NSQ messages: the byte encoding, message ids and topic/channel names.

Theory of operation
-------------------
A message exists as bytes almost everywhere: the topic stores them, the
diskqueue frames them, the channel delivers them, and the NSQ TCP protocol
puts them in a message frame unchanged.  The encoding is nsqd's own::

    offset  size  field
    0       8     timestamp, big-endian int64, nanoseconds since the epoch
    8       2     attempts, big-endian uint16 (which delivery this is, from 1)
    10      16    message id, 16 ASCII hex characters
    26      n     body

A message at rest carries the ``attempts`` number its *next* delivery will
show: 1 when it is published (:data:`FIRST_ATTEMPT`).  A delivery hands the
stored bytes out unchanged, and only a message that comes back (REQ, a
timeout, its client gone) is rewritten with one more (:func:`next_attempt`),
so the hot path never copies a message and never decodes its body.
:func:`decode_message` exists for tests, tools and the rare code path that
needs every field.

Message ids come from a :class:`GuidFactory` per broker (nsqd ``guid.go``, a
Twitter-snowflake layout): a 64-bit integer made of a millisecond timestamp
(high 42 bits), the node id (10 bits) and a per-millisecond sequence
(low 12 bits), written as 16 lowercase hex characters.  The factory never
reads a clock: the caller passes ``now_ms``.  It keeps a *logical* millisecond
that never goes backwards:

* a clock that steps back (NTP, VM migration) does not make nsqd-style
  ``ErrTimeBackwards`` errors: ids keep using the last logical millisecond;
* when 4096 ids were issued in one millisecond, nsqd returns
  ``ErrSequenceExpired`` and its caller retries; we instead borrow the next
  millisecond (``logical_ms + 1``, sequence 0).  Under sustained load beyond
  4 million ids per second the logical clock runs ahead of the real one and
  catches up when the load drops.

Either way every id is strictly greater than the previous one, so a factory
never issues a duplicate.  Brokers with different node ids never collide.

Topic and channel names follow NSQ (``internal/protocol/names.go``): 1 to 64
characters from ``[.a-zA-Z0-9_-]``, optionally ending in ``#ephemeral``.
"""

from __future__ import annotations

import re
import struct
from collections.abc import Sequence
from typing import NamedTuple

from transport.protocol.validation import valid_tag

__all__ = [
    "EPHEMERAL_SUFFIX",
    "FIRST_ATTEMPT",
    "HEADER_SIZE",
    "MAX_ATTEMPTS",
    "MAX_NAME_LENGTH",
    "MAX_NODE_ID",
    "MAX_TAG_LENGTH",
    "MSG_ID_LENGTH",
    "GuidFactory",
    "Message",
    "MessageDecodeError",
    "attempts_of",
    "decode_message",
    "encode_message",
    "guid_parts",
    "has_tagged",
    "is_ephemeral",
    "is_valid_channel_name",
    "is_valid_name",
    "is_valid_tag",
    "is_valid_topic_name",
    "message_id",
    "next_attempt",
    "tag_record",
    "timestamp_of",
    "untag_record",
    "with_attempts",
]

MSG_ID_LENGTH = 16
"""Length of a message id: 16 ASCII hex characters (nsqd ``MsgIDLength``)."""
HEADER_SIZE = 8 + 2 + MSG_ID_LENGTH
"""Bytes before the body: timestamp, attempts, id (nsqd ``minValidMsgLength``)."""
MAX_ATTEMPTS = 0xFFFF
"""Largest attempts count the 2-byte field holds."""
MAX_NAME_LENGTH = 64
"""Longest valid topic or channel name."""

_HEAD = struct.Struct(">qH")  # timestamp, attempts
_ATTEMPTS = struct.Struct(">H")
_ID_END = HEADER_SIZE
_ID_START = HEADER_SIZE - MSG_ID_LENGTH


class MessageDecodeError(ValueError):
    """Bytes too short to be an NSQ-encoded message."""


class Message(NamedTuple):
    """A decoded message; the broker normally handles the encoded bytes instead."""

    id: bytes
    """16 ASCII hex bytes."""
    timestamp: int
    """Nanoseconds since the epoch when the message was published."""
    attempts: int
    """How many times the message has been delivered."""
    body: bytes
    """The payload as published."""

    def encode(self) -> bytes:
        """The NSQ encoding of this message."""
        return encode_message(self.id, self.timestamp, self.attempts, self.body)


def encode_message(msg_id: bytes, timestamp_ns: int, attempts: int, body: bytes) -> bytes:
    """Encode a message as ``[8B timestamp][2B attempts][16B id][body]``.

    ``msg_id`` must be 16 bytes (a :class:`GuidFactory` id); ``attempts`` must fit
    in 16 bits (``struct.error`` otherwise).
    """
    if len(msg_id) != MSG_ID_LENGTH:
        msg = f"message id must be {MSG_ID_LENGTH} bytes, got {len(msg_id)}"
        raise ValueError(msg)
    return _HEAD.pack(timestamp_ns, attempts) + msg_id + body


FIRST_ATTEMPT = 1
"""The attempts field of a message as published: what its first delivery shows."""


def next_attempt(encoded: bytes) -> bytes:
    """``encoded`` with one more attempt (kept at 65535 once there), for a message that
    comes back to be delivered again."""
    return with_attempts(encoded, min(attempts_of(encoded) + 1, MAX_ATTEMPTS))


def decode_message(data: bytes | bytearray | memoryview) -> Message:
    """Decode every field of an encoded message (the body is a copy)."""
    if len(data) < HEADER_SIZE:
        msg = f"an NSQ message needs at least {HEADER_SIZE} bytes, got {len(data)}"
        raise MessageDecodeError(msg)
    timestamp, attempts = _HEAD.unpack_from(data, 0)
    return Message(bytes(data[_ID_START:_ID_END]), timestamp, attempts, bytes(data[_ID_END:]))


def with_attempts(encoded: bytes, attempts: int) -> bytes:
    """Return ``encoded`` with its attempts field replaced (one copy, body untouched)."""
    return encoded[:8] + _ATTEMPTS.pack(attempts) + encoded[10:]


def message_id(encoded: bytes) -> bytes:
    """The 16-byte id of an encoded message."""
    return encoded[_ID_START:_ID_END]


def attempts_of(encoded: bytes) -> int:
    """The attempts count of an encoded message."""
    return (encoded[8] << 8) | encoded[9]


def timestamp_of(encoded: bytes) -> int:
    """The timestamp (ns) of an encoded message."""
    return _HEAD.unpack_from(encoded, 0)[0]


# ---------------------------------------------------------------------------
# Message ids

_NODE_ID_BITS = 10
_SEQUENCE_BITS = 12
_TIMESTAMP_BITS = 64 - _NODE_ID_BITS - _SEQUENCE_BITS
_SEQUENCE_MASK = (1 << _SEQUENCE_BITS) - 1
_TIMESTAMP_SHIFT = _NODE_ID_BITS + _SEQUENCE_BITS
_MAX_TIMESTAMP = (1 << _TIMESTAMP_BITS) - 1
MAX_NODE_ID = (1 << _NODE_ID_BITS) - 1
_SEQ_HEX = [b"%03x" % i for i in range(_SEQUENCE_MASK + 1)]  # an id's last 3 hex digits


class GuidFactory:
    """Issues unique, increasing 16-hex-character message ids for one node.

    ``new_guid(now_ms)`` / ``new_guids(now_ms, n)`` take the caller's wall
    clock in milliseconds.  Not thread-safe: one owner (an actor) per factory.
    """

    __slots__ = ("_last_ms", "_node_bits", "_sequence", "node_id")

    def __init__(self, node_id: int) -> None:
        if not 0 <= node_id <= MAX_NODE_ID:
            msg = f"node id must be in [0, {MAX_NODE_ID}], got {node_id}"
            raise ValueError(msg)
        self.node_id = node_id
        self._node_bits = node_id << _SEQUENCE_BITS
        self._last_ms = -1  # logical millisecond of the last id
        self._sequence = _SEQUENCE_MASK  # last sequence used within _last_ms

    def _reserve(self, now_ms: int, n: int) -> tuple[int, int]:
        """Reserve up to ``n`` consecutive ids in one millisecond: ``(first id, count)``."""
        if now_ms > self._last_ms:
            self._last_ms, first = now_ms, 0
        elif self._sequence < _SEQUENCE_MASK:
            first = self._sequence + 1  # same ms (or clock went back): continue the sequence
        else:
            self._last_ms, first = self._last_ms + 1, 0  # sequence exhausted: borrow next ms
        if self._last_ms > _MAX_TIMESTAMP:
            msg = f"timestamp {self._last_ms} ms does not fit in {_TIMESTAMP_BITS} bits"
            raise ValueError(msg)
        count = min(n, _SEQUENCE_MASK + 1 - first)
        self._sequence = first + count - 1
        return (self._last_ms << _TIMESTAMP_SHIFT) | self._node_bits | first, count

    def new_guid_int(self, now_ms: int) -> int:
        """The next id as a 64-bit integer."""
        return self._reserve(now_ms, 1)[0]

    def new_guid(self, now_ms: int) -> bytes:
        """The next id as 16 lowercase hex ASCII bytes."""
        return b"%016x" % self._reserve(now_ms, 1)[0]

    def new_guids(self, now_ms: int, n: int) -> list[bytes]:
        """``n`` increasing ids at once (ids within one millisecond are consecutive integers)."""
        out: list[bytes] = []
        while len(out) < n:
            first, count = self._reserve(now_ms, n - len(out))
            out.extend([b"%016x" % v for v in range(first, first + count)])
        return out

    def encode_batch(self, timestamp_ns: int, bodies: list[bytes]) -> list[bytes]:
        """Give each body a new id and encode it: one timestamp, :data:`FIRST_ATTEMPT`.

        The publish hot path.  Ids reserved together differ only in their low 12
        bits, the last three hex digits, so each message is the run's shared
        head (timestamp, attempts, first 13 id digits) + a 3-digit suffix from a
        table + its body: no per-message formatting.
        """
        out: list[bytes] = []
        done, n = 0, len(bodies)
        while done < n:
            first, count = self._reserve(timestamp_ns // 1_000_000, n - done)
            head = _HEAD.pack(timestamp_ns, FIRST_ATTEMPT) + b"%013x" % (first >> _SEQUENCE_BITS)
            seq = first & _SEQUENCE_MASK
            out += [head + suffix + body for suffix, body in
                    zip(_SEQ_HEX[seq : seq + count], bodies[done : done + count],
                        strict=True)]
            done += count
        return out


def guid_parts(guid: bytes) -> tuple[int, int, int]:
    """Split a hex id into ``(timestamp_ms, node_id, sequence)`` (for tools and tests)."""
    value = int(guid, 16)
    return (
        value >> _TIMESTAMP_SHIFT,
        (value >> _SEQUENCE_BITS) & MAX_NODE_ID,
        value & _SEQUENCE_MASK,
    )


# ---------------------------------------------------------------------------
# Names

EPHEMERAL_SUFFIX = "#ephemeral"
_NAME_RE = re.compile(r"[.a-zA-Z0-9_-]+(?:#ephemeral)?")


def is_valid_name(name: str | bytes) -> bool:
    """NSQ's rule for topic and channel names (1-64 chars, optional ``#ephemeral``)."""
    if isinstance(name, bytes | bytearray):
        try:
            name = name.decode("ascii")
        except UnicodeDecodeError:
            return False
    if not isinstance(name, str) or not 1 <= len(name) <= MAX_NAME_LENGTH:
        return False
    return _NAME_RE.fullmatch(name) is not None


def is_valid_topic_name(name: str | bytes) -> bool:
    """True if ``name`` may name a topic."""
    return is_valid_name(name)


def is_valid_channel_name(name: str | bytes) -> bool:
    """True if ``name`` may name a channel."""
    return is_valid_name(name)


def is_ephemeral(name: str) -> bool:
    """True for ``#ephemeral`` topics and channels (memory only, deleted when unused)."""
    return name.endswith(EPHEMERAL_SUFFIX)


# ----------------------------------------------------------------------------- tags

MAX_TAG_LENGTH = 64
_TAG_MARK = 0xFF
"""First byte of a tagged record.  An encoded message starts with its timestamp in
nanoseconds, big-endian: its first byte is below 0x80 until the year 2262."""


def is_valid_tag(tag: str) -> bool:
    """A tag is 1-64 of ``a-z A-Z 0-9 . _ - :`` (transport.protocol.validation)."""
    return isinstance(tag, str) and tag.isascii() and valid_tag(tag.encode("ascii"))


def tag_record(encoded: bytes, tag: str) -> bytes:
    """What a topic keeps (in memory and in its disk queue) for a tagged message:
    0xFF, the tag's length, the tag, then the message as NSQ encodes it."""
    raw = tag.encode("ascii")
    return b"\xff" + bytes((len(raw),)) + raw + encoded


def untag_record(record: bytes) -> tuple[bytes, str]:
    """`(encoded message, tag)` of a record a topic keeps ('' for an untagged one)."""
    if record[0] != _TAG_MARK:
        return record, ""
    n = record[1]
    return record[2 + n:], record[2:2 + n].decode("ascii")


def record_id(record: bytes) -> bytes:
    """The message id (16 hex bytes) of a record a topic keeps, tagged or not."""
    start = 2 + record[1] if record[0] == _TAG_MARK else 0
    return record[start + 10:start + 26]


def guid_time_ns(message_id: bytes) -> int:
    """The time (ns, to the millisecond) in a message id this broker made."""
    return (int(message_id, 16) >> _TIMESTAMP_SHIFT) * 1_000_000


def record_timestamp(record: bytes) -> int:
    """The publish time (ns) of a record a topic keeps, tagged or not."""
    start = 2 + record[1] if record[0] == _TAG_MARK else 0
    return int.from_bytes(record[start:start + 8], "big")


def has_tagged(records: Sequence[bytes]) -> bool:
    """True if any of `records` carries a tag."""
    return any(r[0] == _TAG_MARK for r in records)
