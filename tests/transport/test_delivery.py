"""A batch consumer's deliveries: columns that stay aligned, answers that reach the broker."""

from __future__ import annotations

import struct
from types import SimpleNamespace
from typing import Any

import pytest
import zmq
from hypothesis import given
from hypothesis import strategies as st

from transport.client import Delivery, _Session
from transport.protocol import commands as pc
from transport.zmq.codec import (
    columns_of,
    encode_packed_messages,
    encode_request,
    unpack_columns,
)

pytestmark = pytest.mark.timeout(60)


class _Socket:
    """What a session's FINs and other requests were sent as, request by request."""

    def __init__(self) -> None:
        self.requests: list[list[bytes]] = []
        self._frames: list[bytes] = []

    def send(self, frame: bytes, flags: int = 0) -> None:
        self._frames.append(frame)
        if not flags & zmq.SNDMORE:
            self.requests.append(self._frames)
            self._frames = []


def _session(packed: bool = True, fins_per_frame: int = 5000) -> Any:
    consumer = SimpleNamespace(woken=True, io_ident=None, io_thread=None, wake=lambda: None)
    session = _Session(consumer, "tcp://b", 0)  # type: ignore[arg-type]
    session.sock = _Socket()  # type: ignore[assignment]
    session.packed, session.fins_per_frame = packed, fins_per_frame
    return session


def _delivery(session: Any, n: int, first: int = 0) -> Delivery:
    """As the broker packs them (the bodies not split until asked for)."""
    frames = encode_packed_messages([struct.pack(">qH", 1000 + i, i % 7 + 1) + b"%016d" % i
                                     + _body(i) for i in range(first, first + n)])
    return Delivery.of(unpack_columns(frames[1:]), session)


def _body(i: int) -> bytes:
    return b"body-%d" % i + b"\n" * (i % 3 == 0)  # (some with a line feed)


@given(st.integers(1, 40), st.data())
def test_a_split_or_a_selection_keeps_each_messages_timestamp_and_attempts_with_it(
        n: int, data: st.DataObject) -> None:
    d = _delivery(None, n)
    at = data.draw(st.integers(0, n))
    if data.draw(st.booleans()):
        assert len(d.bodies) == n  # (split before the delivery is, or not)
    head, tail = d.split(at)
    assert all(part is not d for part in (head, tail))  # (held and answered instead of it)
    picked = data.draw(st.lists(st.integers(0, n - 1), unique=True))
    for part, indices in ((head, range(at)), (tail, range(at, n)),
                          (d.select(picked), picked)):
        assert part.ids == [b"%016d" % i for i in indices]
        assert part.bodies == [_body(i) for i in indices]
        assert part.lines == b"\n".join(_body(i) for i in indices)
        assert part.sizes == b"".join(struct.pack(">I", len(_body(i))) for i in indices)
        assert part.timestamps == [1000 + i for i in indices]
        assert part.attempts == [i % 7 + 1 for i in indices]


def test_a_finished_delivery_is_one_fin_frame_and_a_second_answer_sends_nothing() -> None:
    session = _session()
    d = _delivery(session, 3)
    d.finish()
    d.finish()
    d.requeue()
    session._flush()
    assert session.sock.requests == [[b"FIN", b"".join(d.ids)]]


def test_fins_of_many_deliveries_are_cut_at_the_brokers_frame_size_and_none_is_lost() -> None:
    # Given deliveries of 7, 1 and 12 messages, and a broker that takes 5 ids a FIN frame
    session = _session(fins_per_frame=5)
    deliveries = [_delivery(session, 7), _delivery(session, 1, 7), _delivery(session, 12, 8)]
    for d in deliveries:
        d.finish()
    session._flush()
    # Then every FIN frame holds at most 5 whole ids, and together they hold each id once
    frames = [frame for name, frame in session.sock.requests]
    assert {len(f) for f in frames} <= {16 * k for k in range(1, 6)}
    assert b"".join(frames) == b"".join(b"".join(d.ids) for d in deliveries)


def test_to_a_broker_that_does_not_pack_fins_go_as_an_id_a_frame() -> None:
    session = _session(packed=False)
    d = _delivery(session, 3)
    d.finish()
    session._flush()
    assert session.sock.requests == [encode_request(pc.Fin(tuple(d.ids)))]


def test_requeue_and_touch_answer_each_message_and_an_empty_part_answers_nothing() -> None:
    session = _session()
    d = _delivery(session, 2)
    d.touch()
    d.requeue(250)
    empty, _ = d.split(0)
    empty.finish()
    empty.touch()
    session._flush()
    assert session.sock.requests == [
        encode_request(pc.Touch(d.ids[0])), encode_request(pc.Touch(d.ids[1])),
        encode_request(pc.Req(d.ids[0], 250)), encode_request(pc.Req(d.ids[1], 250))]


def test_a_delivery_from_message_frames_has_the_columns_of_a_packed_one() -> None:
    messages = [(b"%016d" % i, -i, 65535 - i, b"x" * i) for i in range(3)]
    d = Delivery.of(columns_of(messages), None)  # type: ignore[arg-type]
    assert (d.ids, d.timestamps, d.attempts, d.bodies) == \
        tuple(map(list, zip(*messages, strict=True)))
    assert d.headers == b"".join(struct.pack(">qH", ts, a) + i for i, ts, a, _ in messages)
