"""Envelope codec: bytes in, messages out; no sockets (sans-IO)."""

from __future__ import annotations

import pickle
import zlib
from concurrent.futures import ThreadPoolExecutor
from dataclasses import KW_ONLY, FrozenInstanceError, asdict, dataclass, field, fields, replace
from typing import NamedTuple

import msgpack
import pytest

from transport.mailbox.envelope import (
    ASK,
    REPLY_OK,
    TELL,
    CodecError,
    MessageRegistry,
    frozen,
    message,
    registry,
)


@message
@dataclass(frozen=True)
class Put:
    """A plain frozen dataclass message."""

    seq: int
    """Sequence number."""
    body: bytes
    """Payload."""


@message
@dataclass(frozen=True, slots=True)
class Slotted:
    """A slots dataclass message."""

    key: str
    """Key."""
    values: tuple[int, ...]
    """Values (decoded as a tuple)."""


@message
class Point(NamedTuple):
    """A NamedTuple message."""

    x: int
    y: int


@message
@dataclass(frozen=True)
class Empty:
    """A message without fields."""


@message
@dataclass(frozen=True)
class Wrapper:
    """A message with a registered message inside a field."""

    inner: Put
    """Nested message."""


def roundtrip(messages: list[object], kind: int = TELL) -> list[object]:
    data = registry.encode(kind, "topic:t", "worker-0", messages)
    envelope = registry.decode(data)
    assert (envelope.kind, envelope.dest, envelope.sender) == (kind, "topic:t", "worker-0")
    return list(envelope.messages)


def test_a_homogeneous_batch_round_trips_in_order() -> None:
    batch = [Put(i, b"x" * 100) for i in range(100)]
    assert roundtrip(batch) == batch


def test_every_kind_of_message_class_round_trips() -> None:
    batch = [Slotted("k", (1, 2)), Point(1, 2), Empty(), Put(1, b"")]
    decoded = roundtrip(batch)
    assert decoded == batch
    assert [type(m) for m in decoded] == [Slotted, Point, Empty, Put]


def test_a_mixed_batch_keeps_its_order_across_class_runs() -> None:
    batch = [Put(1, b"a"), Put(2, b"b"), Point(0, 0), Put(3, b"c"), "raw", 7, Empty()]
    assert roundtrip(batch) == batch


def test_msgpack_native_values_travel_as_raw_messages() -> None:
    assert roundtrip(["ping", 3, None, {"a": 1}]) == ["ping", 3, None, {"a": 1}]


def test_decoded_arrays_are_tuples_so_messages_stay_immutable() -> None:
    (decoded,) = roundtrip([Slotted("k", (1, 2, 3))])
    assert isinstance(decoded, Slotted)
    assert decoded.values == (1, 2, 3)


def test_a_registered_message_nested_in_a_field_round_trips() -> None:
    assert roundtrip([Wrapper(Put(5, b"n"))]) == [Wrapper(Put(5, b"n"))]


def test_large_envelopes_from_many_threads_and_a_pack_inside_a_pack_round_trip() -> None:
    # Given a registry whose packing calls back into Python (a nested message), and
    # there encodes another envelope on the same thread (as a signal handler could)
    reg = MessageRegistry()
    for cls in (Put, Wrapper):
        reg.register(cls)
    inner: list[bytes] = []
    outer_default = reg._default

    def default(obj: object) -> object:
        inner.append(reg.encode(TELL, "topic:inner", "w", [Put(2, b"i" * 70_000)]))
        return outer_default(obj)

    reg._default = default  # type: ignore[method-assign]
    big = [Put(i, bytes([i]) * 1024) for i in range(200)]
    data = reg.encode(TELL, "topic:t", "gateway", [*big, Wrapper(Put(1, b"n"))])
    # Then both come back whole
    assert list(reg.decode(data).messages) == [*big, Wrapper(Put(1, b"n"))]
    assert list(reg.decode(inner[0]).messages) == [Put(2, b"i" * 70_000)]

    # And envelopes packed at once on several threads (each its own packer) too
    def pack(n: int) -> bytes:
        return registry.encode(TELL, f"topic:{n}", "gateway",
                               [Put(j, bytes([n]) * (512 + n)) for j in range(300)])

    with ThreadPoolExecutor(4) as pool:
        packed = list(pool.map(pack, range(16)))
    for n, data in enumerate(packed):
        envelope = registry.decode(data)
        assert envelope.dest == f"topic:{n}"
        assert list(envelope.messages) == [Put(j, bytes([n]) * (512 + n)) for j in range(300)]


def test_ask_and_reply_headers_round_trip() -> None:
    data = registry.encode(
        ASK, "client:1", "gateway", [Point(1, 2)], reply_to="ext-1", request_id=9
    )
    envelope = registry.decode(data)
    assert (envelope.reply_to, envelope.request_id) == ("ext-1", 9)
    reply = registry.decode(registry.encode(REPLY_OK, "", "w", [(Point(3, 4), "ok")], request_id=9))
    assert reply.messages == [(Point(3, 4), "ok")]


def test_an_unknown_tag_is_an_error_that_keeps_the_header() -> None:
    # Given an envelope whose message class the receiver never registered
    other = MessageRegistry()
    other.register(Put, tag=12345)
    data = other.encode(ASK, "topic:t", "w", [Put(1, b"")], reply_to="ext-9", request_id=4)
    # When it is decoded with the process registry, Then the error names the header
    with pytest.raises(CodecError) as info:
        registry.decode(data)
    assert info.value.envelope is not None
    assert (info.value.envelope.reply_to, info.value.envelope.request_id) == ("ext-9", 4)


@pytest.mark.parametrize("cut", [1, 5, 20])
def test_truncated_bytes_are_a_codec_error(cut: int) -> None:
    data = registry.encode(TELL, "topic:t", "w", [Put(1, b"abc")])
    with pytest.raises(CodecError):
        registry.decode(data[:-cut])


def test_trailing_bytes_are_a_codec_error() -> None:
    data = registry.encode(TELL, "topic:t", "w", [Put(1, b"abc")])
    with pytest.raises(CodecError):
        registry.decode(data + b"\x00")


def test_garbage_is_a_codec_error() -> None:
    with pytest.raises(CodecError):
        registry.decode(msgpack.packb([1, 2]))


def test_tags_derive_from_the_qualified_name_not_registration_order() -> None:
    first, second = MessageRegistry(), MessageRegistry()
    first.register(Put)
    first.register(Point)
    second.register(Point)
    second.register(Put)
    data = first.encode(TELL, "d", "s", [Put(1, b""), Point(1, 1)])
    assert second.decode(data).messages == [Put(1, b""), Point(1, 1)]
    tag = zlib.crc32(f"{Put.__module__}.{Put.__qualname__}".encode()) & 0x7FFFFFFF
    assert msgpack.unpackb(data)[5][0][0] == tag


def test_a_tag_collision_between_different_classes_is_rejected() -> None:
    local = MessageRegistry()
    local.register(Put, tag=77)
    with pytest.raises(ValueError, match="already used"):
        local.register(Point, tag=77)


def test_an_unregistered_object_cannot_be_encoded() -> None:
    class Unregistered:
        pass

    with pytest.raises(TypeError, match="register"):
        registry.encode(TELL, "d", "s", [Unregistered()])


# ---------------------------------------------------------------------------
# @message on a plain class: a frozen dataclass made without dataclasses' codegen


@message
class Made:
    """A message class declared with @message alone."""

    key: str
    items: list[int] = field(default_factory=list)
    n: int = 3


@frozen(slots=True)
class SlotsMade:
    key: str
    values: tuple[int, ...] = ()


def test_a_plain_class_becomes_what_a_frozen_dataclass_would_be() -> None:
    @dataclass(frozen=True)
    class Reference:
        key: str
        items: list[int] = field(default_factory=list)
        n: int = 3

    made, ref = Made("k"), Reference("k")
    assert repr(made) == "Made(key='k', items=[], n=3)"
    assert repr(ref).endswith(".Reference(key='k', items=[], n=3)")  # (the same shape)
    assert [f.name for f in fields(made)] == [f.name for f in fields(ref)]
    assert Made.__match_args__ == Reference.__match_args__ == ("key", "items", "n")
    assert made == Made("k", [], 3) != Made("k", [1])
    assert made != ref  # (another class, as dataclasses compare)
    assert made.items is not Made("k").items  # a fresh list from the factory each time
    assert hash(Made("k", (1,), 2)) == hash(Made("k", (1,), 2))  # type: ignore[arg-type]
    with pytest.raises(TypeError, match="unhashable"):
        hash(made)  # (a list field, as a frozen dataclass's hash would)
    with pytest.raises(FrozenInstanceError):
        made.key = "other"  # type: ignore[misc]
    with pytest.raises(FrozenInstanceError):
        del made.n  # type: ignore[misc]
    assert replace(made, n=4) == Made("k", [], 4)
    assert asdict(made) == {"key": "k", "items": [], "n": 3}
    assert pickle.loads(pickle.dumps(made)) == made  # noqa: S301 - its own bytes
    assert roundtrip([made, Made("j", [2], 5)]) == [Made("k", (), 3), Made("j", (2,), 5)]  # type: ignore[arg-type]
    match made:
        case Made(key, n=n):
            assert (key, n) == ("k", 3)
        case _:
            pytest.fail("no match")


def test_fields_left_out_of_compare_or_hash_are_left_out_as_dataclasses_leave_them() -> None:
    @frozen(slots=True)
    class Cmd:
        data: dict = field(hash=False)
        settings: object = field(default=None, compare=False, hash=False)
        n: int = 0

    a, b = Cmd({}, settings=1, n=2), Cmd({}, settings=None, n=2)
    assert a == b
    assert a != Cmd({}, n=3)
    assert hash(Cmd((), n=2)) == hash(Cmd((), settings=[], n=2))  # type: ignore[arg-type]
    assert not hasattr(a, "__dict__")
    assert Cmd.__slots__ == ("data", "settings", "n")
    with pytest.raises(FrozenInstanceError):
        a.n = 1  # type: ignore[misc]
    slotted = SlotsMade("k", (1, 2))
    assert pickle.loads(pickle.dumps(slotted)) == slotted  # noqa: S301 - its own bytes


def test_post_init_runs_and_unusual_fields_fall_back_to_dataclasses() -> None:
    seen: list[int] = []

    @message
    class Checked:
        value: int

        def __post_init__(self) -> None:
            seen.append(self.value)

    @message
    class KeywordOnly:
        a: int
        _: KW_ONLY
        b: int = 2

    assert Checked(5).value == 5
    assert seen == [5]
    assert KeywordOnly(1, b=3) == KeywordOnly(1, b=3)
    with pytest.raises(TypeError):
        KeywordOnly(1, 3)  # type: ignore[misc]
    with pytest.raises(FrozenInstanceError):
        KeywordOnly(1).a = 2  # type: ignore[misc]
