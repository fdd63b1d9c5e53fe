"""Testing an application against a real broker with the zmqnsq pytest plugin
(installed with the package: nothing to configure).  docs/TESTING.md explains it."""

from __future__ import annotations

import threading

import nsq  # pynsq, the NSQ client many Python applications use
import tornado.ioloop

from transport.client import Consumer


def test_publish_and_consume_with_transport_client(zmqnsq_broker):
    zmqnsq_broker.producer.multi_publish("orders", [b"one", b"two"])
    got: list[bytes] = []
    done = threading.Event()

    def handler(message) -> None:
        got.append(message.body)
        if len(got) == 2:
            done.set()

    consumer = Consumer("orders", "billing", handler, zmqnsq_broker.zmq_address).start()
    try:
        assert done.wait(10)
    finally:
        consumer.close()
    assert sorted(got) == [b"one", b"two"]
    channel = zmqnsq_broker.stats("orders")["topics"][0]["channels"][0]
    assert channel["channel_name"] == "billing"


def test_publish_and_consume_with_pynsq(zmqnsq_broker):
    loop = tornado.ioloop.IOLoop.current()
    writer = nsq.Writer([zmqnsq_broker.tcp_address])
    got: list[bytes] = []

    def publish() -> None:
        writer.pub("events", b"hello", lambda conn, data: None)

    def handler(message) -> bool:
        got.append(message.body)
        loop.stop()
        return True

    reader = nsq.Reader(topic="events", channel="audit", message_handler=handler,
                        nsqd_tcp_addresses=[zmqnsq_broker.tcp_address])
    loop.call_later(0.5, publish)
    timeout = loop.call_later(10, loop.stop)
    loop.start()
    loop.remove_timeout(timeout)
    reader.close()
    assert got == [b"hello"]


def test_a_durable_broker_of_its_own(zmqnsq_broker_factory):
    durable = zmqnsq_broker_factory(mem_queue_size=0)
    durable.producer.publish("kept", b"on disk before the OK")
    assert durable.stats("kept")["topics"][0]["message_count"] == 1
