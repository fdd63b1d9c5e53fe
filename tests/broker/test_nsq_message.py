"""NSQ message encoding, message ids and names (actors.broker.nsq_message): bytes in, values out."""

from __future__ import annotations

import struct

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from actors.broker.nsq_message import (
    FIRST_ATTEMPT,
    HEADER_SIZE,
    MAX_NODE_ID,
    GuidFactory,
    Message,
    MessageDecodeError,
    attempts_of,
    decode_message,
    encode_message,
    guid_parts,
    is_ephemeral,
    is_valid_channel_name,
    is_valid_topic_name,
    message_id,
    next_attempt,
    timestamp_of,
    with_attempts,
)

ID = b"0123456789abcdef"
TS = 1_700_000_000_123_456_789

# -- encoding -------------------------------------------------------------------


def test_encoding_matches_nsqs_layout_byte_for_byte() -> None:
    data = encode_message(ID, TS, 3, b"hello")
    assert data == struct.pack(">qH", TS, 3) + ID + b"hello"
    assert len(data) == HEADER_SIZE + 5


def test_decode_returns_every_field_of_an_encoded_message() -> None:
    decoded = decode_message(encode_message(ID, TS, 7, b"body"))
    assert decoded == Message(id=ID, timestamp=TS, attempts=7, body=b"body")


def test_message_with_an_empty_body_round_trips() -> None:
    assert decode_message(encode_message(ID, TS, 0, b"")).body == b""


def test_decode_accepts_memoryview_and_bytearray() -> None:
    data = encode_message(ID, TS, 1, b"x")
    assert (
        decode_message(bytearray(data)) == decode_message(memoryview(data)) == decode_message(data)
    )


@pytest.mark.parametrize("size", [0, 1, HEADER_SIZE - 1])
def test_decoding_short_input_raises_a_value_error_naming_the_sizes(size: int) -> None:
    with pytest.raises(MessageDecodeError, match=f"at least {HEADER_SIZE} bytes, got {size}"):
        decode_message(b"x" * size)
    assert issubclass(MessageDecodeError, ValueError)


def test_encoding_rejects_an_id_that_is_not_16_bytes() -> None:
    with pytest.raises(ValueError, match="16 bytes"):
        encode_message(b"short", TS, 0, b"")


def test_with_attempts_rewrites_only_the_attempts_field() -> None:
    data = encode_message(ID, TS, 1, b"payload")
    again = with_attempts(data, 65535)
    assert len(again) == len(data)
    assert decode_message(again) == Message(ID, TS, 65535, b"payload")
    assert attempts_of(again) == 65535


def test_accessors_read_fields_without_decoding_the_body() -> None:
    data = encode_message(ID, -5, 258, b"b")
    assert message_id(data) == ID
    assert attempts_of(data) == 258
    assert timestamp_of(data) == -5


def test_a_message_can_encode_itself() -> None:
    msg = Message(ID, TS, 2, b"z")
    assert msg.encode() == encode_message(ID, TS, 2, b"z")


@settings(max_examples=200, deadline=None)
@given(
    ts=st.integers(-(2**63), 2**63 - 1),
    attempts=st.integers(0, 0xFFFF),
    body=st.binary(max_size=64),
)
def test_any_message_round_trips_through_encode_and_decode(
    ts: int, attempts: int, body: bytes
) -> None:
    assert decode_message(encode_message(ID, ts, attempts, body)) == (ID, ts, attempts, body)


# -- guids ------------------------------------------------------------------------


def test_guid_is_16_lowercase_hex_bytes_with_timestamp_node_and_sequence() -> None:
    guid = GuidFactory(node_id=5).new_guid(1000)
    assert len(guid) == 16
    assert guid == guid.lower()
    int(guid, 16)
    assert guid_parts(guid) == (1000, 5, 0)


def test_guids_within_one_millisecond_count_the_sequence_up() -> None:
    f = GuidFactory(1)
    ids = [f.new_guid(42) for _ in range(3)]
    assert [guid_parts(i)[2] for i in ids] == [0, 1, 2]


def test_a_new_millisecond_resets_the_sequence() -> None:
    f = GuidFactory(1)
    f.new_guid(42)
    f.new_guid(42)
    assert guid_parts(f.new_guid(43)) == (43, 1, 0)


def test_sequence_rollover_borrows_the_next_millisecond_instead_of_failing() -> None:
    # Given 4096 ids already issued in millisecond 10
    f = GuidFactory(3)
    ids = [f.new_guid(10) for _ in range(4096)]
    # When one more is asked for in the same millisecond
    extra = f.new_guid(10)
    # Then it is issued in millisecond 11 with sequence 0, and stays unique and ordered
    assert guid_parts(ids[-1]) == (10, 3, 4095)
    assert guid_parts(extra) == (11, 3, 0)
    # And a real clock reaching 11 continues after the borrowed ids
    assert guid_parts(f.new_guid(11)) == (11, 3, 1)


def test_a_clock_that_moves_backwards_never_produces_a_duplicate_or_smaller_id() -> None:
    f = GuidFactory(7)
    a = f.new_guid(5000)
    b = f.new_guid(4000)  # clock stepped back one second
    c = f.new_guid(4001)
    assert a < b < c
    assert guid_parts(b)[0] == 5000


def test_ids_stay_strictly_increasing_over_any_sequence_of_clock_readings() -> None:
    f = GuidFactory(MAX_NODE_ID)
    clock = [7, 7, 3, 9, 9, 9, 1, 12] * 600
    ids = [f.new_guid(t) for t in clock]
    assert ids == sorted(set(ids))


def test_batch_of_guids_equals_the_same_number_of_single_calls() -> None:
    single = GuidFactory(9)
    batch = GuidFactory(9)
    expected = [single.new_guid(77) for _ in range(10_000)]
    assert batch.new_guids(77, 10_000) == expected
    assert len(set(expected)) == 10_000


def test_batches_continue_where_the_previous_call_stopped() -> None:
    f = GuidFactory(0)
    first = f.new_guids(100, 5)
    second = f.new_guids(100, 5)
    assert first[-1] < second[0]
    assert f.new_guids(100, 0) == []


def test_factories_with_different_node_ids_never_collide() -> None:
    a = GuidFactory(1).new_guids(500, 5000)
    b = GuidFactory(2).new_guids(500, 5000)
    assert not set(a) & set(b)


@pytest.mark.parametrize("node_id", [-1, MAX_NODE_ID + 1])
def test_node_id_outside_ten_bits_is_rejected(node_id: int) -> None:
    with pytest.raises(ValueError, match="node id"):
        GuidFactory(node_id)


def test_a_timestamp_beyond_42_bits_is_rejected() -> None:
    with pytest.raises(ValueError, match="42 bits"):
        GuidFactory(0).new_guid(2**42)


def test_guid_of_a_realistic_clock_is_usable_as_a_message_id() -> None:
    guid = GuidFactory(617).new_guid(1_700_000_000_000)
    assert message_id(encode_message(guid, TS, 1, b"")) == guid


# -- names --------------------------------------------------------------------------


@pytest.mark.parametrize(
    "name",
    [
        "a",
        "test",
        "with.dots",
        "under_score",
        "dash-ed",
        "Z9",
        "x" * 64,
        "t#ephemeral",
        "a" * 54 + "#ephemeral",
        b"bytes_ok",
    ],
)
def test_valid_topic_and_channel_names_are_accepted(name: str | bytes) -> None:
    assert is_valid_topic_name(name)
    assert is_valid_channel_name(name)


@pytest.mark.parametrize(
    "name",
    [
        "",
        "x" * 65,
        "a" * 55 + "#ephemeral",
        "has space",
        "slash/",
        "colon:",
        "#ephemeral",
        "a#ephemeralx",
        "a#other",
        "ümlaut",
        "new\nline",
        "trailing\n",
        b"\xff",
        None,
        5,
    ],
)
def test_invalid_topic_and_channel_names_are_rejected(name: object) -> None:
    assert not is_valid_topic_name(name)  # type: ignore[arg-type]
    assert not is_valid_channel_name(name)  # type: ignore[arg-type]


def test_ephemeral_names_are_recognised_by_their_suffix() -> None:
    assert is_ephemeral("foo#ephemeral")
    assert not is_ephemeral("foo")
    assert not is_ephemeral("foo#ephemeral.dead")


@pytest.mark.parametrize(("start_ms", "n"), [(5, 3), (5, 4096), (5, 9000)])
def test_encode_batch_matches_new_guids_and_encoding_each_message(start_ms: int, n: int):
    # Given two factories in the same state, one half-way through a millisecond
    a, b = GuidFactory(9), GuidFactory(9)
    a.new_guids(start_ms, 1000)
    b.new_guids(start_ms, 1000)
    bodies = [b"body-%d" % i for i in range(n)]
    ts = start_ms * 1_000_000 + 17
    # When one encodes a batch and the other makes the ids one by one
    batch = a.encode_batch(ts, bodies)
    ids = b.new_guids(start_ms, n)
    # Then the messages are the same: the same ids, one timestamp, FIRST_ATTEMPT attempts
    assert batch == [encode_message(i, ts, FIRST_ATTEMPT, body)
                     for i, body in zip(ids, bodies, strict=True)]


def test_next_attempt_adds_one_and_stops_at_the_field_limit():
    data = encode_message(ID, TS, 1, b"x")
    assert attempts_of(next_attempt(data)) == 2
    assert next_attempt(data)[10:] == data[10:]
    assert attempts_of(next_attempt(encode_message(ID, TS, 0xFFFF, b"x"))) == 0xFFFF
