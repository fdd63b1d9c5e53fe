"""Misbehaving consumers cost other consumers nothing (issue 6: faults beyond crashes)."""

from __future__ import annotations

import threading
from collections.abc import Iterator

import pytest

from actors.broker import Broker
from tests.broker.conftest import broker_options
from tests.broker.test_broker_actors import wait_for
from tests.broker.test_nsq_tcp_broker import Conn
from transport.client import Consumer, Message, Producer
from transport.protocol import commands as pc

pytestmark = pytest.mark.timeout(120)


@pytest.fixture(scope="module")
def broker(tmp_path_factory) -> Iterator[Broker]:
    b = Broker(broker_options(tmp_path_factory.mktemp("abuse2") / "data", mem_queue_size=0,
                              queue_scan_interval=0.02)).start()
    yield b
    b.stop()


class Collect:
    def __init__(self) -> None:
        self.bodies: set[bytes] = set()
        self.lock = threading.Lock()

    def __call__(self, m: Message) -> None:
        with self.lock:
            self.bodies.add(m.body)


def test_a_consumer_that_never_finishes_costs_the_others_nothing(broker):
    # Given a consumer that takes messages and never FINs them (1 s timeout)
    hoarder = Conn(broker)
    hoarder.send(pc.Identify({"msg_timeout": 1000}))
    hoarder.send(pc.Sub("hoard", "c"))
    hoarder.send(pc.Rdy(10))
    wait_for(lambda: broker.topic_stats("hoard")["channels"], what="channel")
    got = Collect()
    try:
        with Consumer("hoard", "c", got, broker.zmq_endpoint, max_in_flight=100), \
                Producer(broker.zmq_endpoint) as p:
            # When messages are published
            p.multi_publish("hoard", [b"h%d" % i for i in range(50)])
            # Then the well-behaved consumer gets every one of them in the end
            wait_for(lambda: len(got.bodies) == 50, timeout=60,
                     what="all 50 at the good consumer")
    finally:
        hoarder.close()
    assert got.bodies == {b"h%d" % i for i in range(50)}


def test_a_consumer_that_disconnects_mid_batch_has_its_messages_redelivered_at_once(broker):
    # Given a consumer holding 20 messages in flight (60 s timeout)
    leaver = Conn(broker)
    leaver.send(pc.Identify({"msg_timeout": 60000}))
    leaver.send(pc.Sub("leave", "c"))
    leaver.send(pc.Rdy(20))
    wait_for(lambda: broker.topic_stats("leave")["channels"], what="channel")
    with Producer(broker.zmq_endpoint) as p:
        p.multi_publish("leave", [b"l%d" % i for i in range(20)])
    held = []
    while len(held) < 20:
        held.extend(f for f in leaver.frames(1) if isinstance(f, pc.Message))
    # When it disconnects without FIN
    leaver.close()
    # Then another consumer gets all 20 long before their 60 s timeout
    got = Collect()
    with Consumer("leave", "c", got, broker.zmq_endpoint, max_in_flight=50):
        wait_for(lambda: len(got.bodies) == 20, timeout=20, what="the 20 held messages")
    assert got.bodies == {m.body for m in held}
    stats = broker.topic_stats("leave")["channels"][0]
    assert stats["timeout_count"] == 0
