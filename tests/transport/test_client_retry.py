"""The Producer against a scripted broker: only unanswered requests are sent again."""

from __future__ import annotations

import threading

import msgpack
import pytest
import zmq

from transport.client import Producer, PublishError
from transport.protocol import commands as pc
from transport.protocol.validation import ProtocolError
from transport.zmq.codec import encode_error, encode_ok, parse_request

pytestmark = pytest.mark.timeout(30)


class ScriptedBroker:
    """A ROUTER that answers each MPUB unless `ignore(attempt_no, bodies)` says not to."""

    def __init__(self, ignore, identified: dict | None = None, knows_pmpub: bool = True) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.ROUTER)
        self.sock.setsockopt(zmq.LINGER, 0)
        self.endpoint = f"tcp://127.0.0.1:{self.sock.bind_to_random_port('tcp://127.0.0.1')}"
        self.ignore = ignore
        self.identified = identified or {}  # the IDENTIFY answer (default: no packing)
        self.knows_pmpub = knows_pmpub
        self.received: list[tuple[bytes, ...]] = []
        self.names: list[bytes] = []  # the publishes' command names
        self.stop = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.stop.is_set():
            if not self.sock.poll(20):
                continue
            rid, *frames = self.sock.recv_multipart()
            request = parse_request(frames)
            if isinstance(request.command, pc.Identify):
                self.sock.send_multipart([rid, *encode_ok(request.corr,
                                                          msgpack.packb(self.identified))])
                continue
            name = next(f for f in frames if not f.startswith(b"#"))
            self.names.append(name)
            if name == b"PMPUB" and not self.knows_pmpub:  # (as a broker without it)
                self.identified = {}  # (and so it answers the next IDENTIFY)
                self.sock.send_multipart([rid, *encode_error(
                    request.corr, ProtocolError("E_INVALID", "invalid command PMPUB"))])
                continue
            bodies = request.command.bodies if isinstance(request.command, pc.Mpub) else ()
            self.received.append(bodies)
            if not self.ignore(len(self.received), bodies):
                self.sock.send_multipart([rid, *encode_ok(request.corr)])

    def close(self) -> None:
        self.stop.set()
        self.thread.join(5)
        self.sock.close()
        self.ctx.term()


def test_a_retry_resends_only_what_was_not_acknowledged():
    # The first round: batches a, b, c; b's answer never comes.
    broker = ScriptedBroker(lambda n, bodies: n == 2)
    try:
        with Producer(broker.endpoint, timeout=0.3, max_attempts=2) as p:
            p.publish_batch("t", [b"a", b"b", b"c"], batch_size=1)
            assert p.retried == 1
        assert broker.received == [(b"a",), (b"b",), (b"c",), (b"b",)]
    finally:
        broker.close()


def test_retry_for_keeps_trying_past_max_attempts_then_raises():
    broker = ScriptedBroker(lambda n, bodies: True)  # never answers
    try:
        with Producer(broker.endpoint, timeout=0.1, max_attempts=1, max_backoff=0.1,
                      retry_for=1.0) as p:
            with pytest.raises(PublishError, match="no broker acknowledged"):
                p.multi_publish("t", [b"x"])
            assert p.retried >= 3  # max_attempts alone would have allowed one
        assert len(broker.received) >= 3
    finally:
        broker.close()


def test_publish_batch_splits_by_count_and_by_bytes():
    broker = ScriptedBroker(lambda n, bodies: False)
    try:
        with Producer(broker.endpoint, timeout=2) as p:
            p.publish_batch("t", [b"x"] * 5, batch_size=2)
            # 4 + (4 + 10) * 3 = 46 bytes would pass 40: two messages, then the rest
            p.publish_batch("t", [b"y" * 10] * 5, batch_size=100, max_bytes=40)
            p.publish_batch("t", [b"z" * 100], max_bytes=40)  # one oversized body still goes
        assert [len(b) for b in broker.received] == [2, 2, 1, 2, 2, 1, 1]
    finally:
        broker.close()


def test_a_pmpub_an_older_broker_behind_the_endpoint_refuses_goes_again_as_mpub():
    # Given a broker that said it packs, then (swapped behind the endpoint) does not know
    # PMPUB: the refusal is fatal there, and every PMPUB after it would be refused too
    broker = ScriptedBroker(lambda n, bodies: False, {"packed_messages": True,
                                                      "max_body_size": 1 << 20},
                            knows_pmpub=False)
    try:
        with Producer(broker.endpoint, timeout=2) as p:
            p.publish_batch("t", [b"a", b"b"], batch_size=1)  # (before the answer: MPUB)
            assert p._brokers[0].packed
            # When the next batches go packed, Then they are sent again as MPUB, once
            p.publish_batch("t", [b"c", b"d"], batch_size=1)
            p.publish_batch("t", [b"e"], batch_size=1)
        assert broker.names == [b"MPUB", b"MPUB", b"PMPUB", b"PMPUB", b"MPUB", b"MPUB",
                                b"MPUB"]
        assert sorted(b for bodies in broker.received for b in bodies) == \
            [b"a", b"b", b"c", b"d", b"e"]  # (each once: the refused PMPUBs stored none)
    finally:
        broker.close()


def test_a_pmpub_over_the_brokers_max_body_size_goes_as_mpub():
    # a frame over --max-body-size would be dropped by ZeroMQ without an answer; as
    # MPUB the broker refuses it with E_BAD_BODY
    broker = ScriptedBroker(lambda n, bodies: False, {"packed_messages": True,
                                                      "max_body_size": 100})
    try:
        with Producer(broker.endpoint, timeout=2) as p:
            p.publish("t", b"x")  # (the IDENTIFY answer)
            p.multi_publish("t", [b"y" * 40, b"z" * 40])  # 4 + 2 x 44 = 92: packed
            p.multi_publish("t", [b"y" * 50, b"z" * 50])  # 108: not
        assert broker.names == [b"PUB", b"PMPUB", b"MPUB"]
    finally:
        broker.close()
