"""The ZeroMQ protocol end to end: the Python client library against a running broker."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import msgpack
import pytest
import zmq

from actors.broker import Broker
from tests.broker.conftest import broker_options
from tests.broker.test_broker_actors import wait_for
from transport import client as client_module
from transport.client import BrokerRefused, Consumer, Delivery, Message, Producer, PublishError
from transport.protocol import commands as pc
from transport.zmq.codec import Messages, PackedMessages, encode_request, parse_reply

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def broker(tmp_path_factory) -> Iterator[Broker]:
    data = tmp_path_factory.mktemp("zmq") / "data"
    b = Broker(broker_options(data, workers=2, queue_scan_interval=0.02)).start()
    yield b
    b.stop()


class Collector:
    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.lock = threading.Lock()

    def __call__(self, m: Message) -> None:
        with self.lock:
            self.bodies.append(m.body)


def test_what_a_producer_publishes_a_consumer_receives(broker):
    got = Collector()
    with Consumer("zt", "c", got, broker.zmq_endpoint, max_in_flight=50) as _, \
            Producer(broker.zmq_endpoint) as p:
        wait_for(lambda: broker.topic_stats("zt")["channels"], what="channel")
        p.publish("zt", b"one")
        p.multi_publish("zt", [b"two", b"three"])
        p.publish_batch("zt", [b"b%d" % i for i in range(500)], batch_size=100)
        p.deferred_publish("zt", 100, b"later")
        wait_for(lambda: len(got.bodies) == 504, what="504 messages")
    assert sorted(got.bodies) == sorted([b"one", b"two", b"three", b"later",
                                         *(b"b%d" % i for i in range(500))])
    stats = broker.topic_stats("zt")["channels"][0]
    assert stats["in_flight_count"] == 0
    assert stats["depth"] == 0


def test_a_consumer_with_more_in_flight_than_one_rdy_opens_several_sessions(broker):
    # 10,000 in flight is over nsqd's largest RDY (2,500): four sessions to the broker,
    # each at most 2,500, whatever order they come up in (the first up must not ask
    # for everything: the broker refuses and closes it)
    got = Collector()
    with Consumer("many", "c", got, broker.zmq_endpoint, max_in_flight=10_000,
                  connections_per_broker=4) as consumer, Producer(broker.zmq_endpoint) as p:
        wait_for(lambda: broker.topic_stats("many")["channels"], what="channel")
        p.publish_batch("many", [b"m%d" % i for i in range(3000)], batch_size=500)
        wait_for(lambda: len(got.bodies) == 3000, what="every message")
        assert sorted(s.rdy for s in consumer.sessions.values()) == [2500] * 4
        # and the four sessions are served by one thread, the consumer's I/O thread
        assert [t.name for t in threading.enumerate() if t.name.startswith("consumer-")] \
            == ["consumer-many/c"]


@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_a_consumer_whose_io_thread_died_still_closes(broker):
    # Given a handler that raises what no handler should (not an Exception: it ends
    # the I/O thread)
    class Boom(BaseException):
        pass

    def handler(m: Message) -> None:
        raise Boom

    with Producer(broker.zmq_endpoint) as p:
        p.publish("boom", b"x")
    consumer = Consumer("boom", "c", handler, broker.zmq_endpoint,
                        connections_per_broker=3).start()
    consumer.io_thread.join(30)
    assert not consumer.io_thread.is_alive()
    # Then its sockets were closed as it ended: close() returns (Context.term() would
    # wait for ever on a socket left open)
    assert all(s.sock is None for s in consumer.sessions.values())
    consumer.close()


def test_a_consumer_closing_requeues_what_it_holds_to_no_session_of_its_own(broker):
    # Given a consumer with four sessions holding 3,000 messages unfinished
    held: list[Delivery] = []
    everything = threading.Event()

    def hold(delivery: Delivery) -> None:
        held.append(delivery)  # (the I/O thread is the only caller)
        if sum(map(len, held)) == 3000:
            everything.set()

    first = Consumer("closing", "c", hold, broker.zmq_endpoint, max_in_flight=10_000,
                     connections_per_broker=4, auto_finish=False, batches=True).start()
    with Producer(broker.zmq_endpoint) as p:
        wait_for(lambda: broker.topic_stats("closing")["channels"], what="channel")
        p.publish_batch("closing", [b"m%d" % i for i in range(3000)], batch_size=500)
    assert everything.wait(30)
    assert {a for d in held for a in d.attempts} == {1}
    # When it closes, giving them back
    first.close(requeue=lambda: held)
    # Then every session had said CLS before the REQs went: no sibling took a message
    # back (a second attempt, given back as it closed), so the next consumer gets each
    # at its second attempt, and at once (a DEALER's close cannot be seen: without the
    # REQs they would wait for the broker to drop the silent sessions, 10 s)
    attempts: list[int] = []
    with Consumer("closing", "c", lambda m: attempts.append(m.attempts), broker.zmq_endpoint,
                  max_in_flight=3000):
        wait_for(lambda: len(attempts) == 3000, timeout=5, what="every message again")
    assert set(attempts) == {2}


def test_a_refused_publish_raises_with_nsqds_code(broker):
    with Producer(broker.zmq_endpoint) as p, pytest.raises(BrokerRefused) as e:
        p.publish("bad topic!", b"x")
    assert e.value.code == "E_BAD_TOPIC"


def test_a_failing_handler_gets_the_message_again(broker):
    attempts: list[int] = []

    def flaky(m: Message) -> None:
        attempts.append(m.attempts)
        if m.attempts == 1:
            raise RuntimeError("not yet")

    with Consumer("flaky", "c", flaky, broker.zmq_endpoint, max_requeue_delay_ms=50) as _, \
            Producer(broker.zmq_endpoint) as p:
        wait_for(lambda: broker.topic_stats("flaky")["channels"], what="channel")
        p.publish("flaky", b"x")
        wait_for(lambda: attempts == [1, 2], what="a second delivery")


def test_a_batch_handler_gets_each_deliverys_messages_at_once_and_a_failure_requeues_them_all(
        broker):
    # Given a consumer whose handler takes deliveries, and fails the first one of each
    calls: list[Delivery] = []
    seen: dict[bytes, list[int]] = {}
    done = threading.Event()

    def handler(delivery: Delivery) -> None:
        calls.append(delivery)
        for body, attempts in zip(delivery.bodies, delivery.attempts, strict=True):
            seen.setdefault(body, []).append(attempts)
        if all(attempts[-1] == 2 for attempts in seen.values()) and len(seen) == 300:
            done.set()
        if 1 in delivery.attempts:
            raise RuntimeError("not yet")

    with Producer(broker.zmq_endpoint) as p:
        p.publish_batch("batched", [b"x%d" % i for i in range(300)], batch_size=300)
    with Consumer("batched", "c", handler, broker.zmq_endpoint, batches=True,
                  max_in_flight=1000, max_requeue_delay_ms=50) as consumer:
        # When it runs, Then every message came twice (the failed lists were requeued,
        # each message of them), in lists of more than one
        assert done.wait(30)
        assert consumer.handled >= 300
    assert all(attempts[:2] == [1, 2] for attempts in seen.values())
    assert max(map(len, calls)) > 1
    # (the second deliveries were FINed: nothing is left in flight or queued)
    stats = broker.topic_stats("batched")["channels"][0]
    assert (stats["in_flight_count"], stats["depth"]) == (0, 0)


def test_a_silent_session_is_dropped_and_its_messages_go_to_another_consumer(broker):
    # Given a raw session that takes a message and then never speaks again
    ctx = zmq.Context()
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(broker.zmq_endpoint)
    try:
        raw.send_multipart(encode_request(pc.Identify({"heartbeat_interval": 1000}), b"#1"))
        raw.send_multipart(encode_request(pc.Sub("silent", "c"), b"#2"))
        raw.send_multipart(encode_request(pc.Rdy(10)))
        wait_for(lambda: broker.topic_stats("silent")["channels"], what="channel")
        with Producer(broker.zmq_endpoint) as p:
            p.publish("silent", b"held")
        deadline = time.monotonic() + 10
        held = None
        while held is None and time.monotonic() < deadline:
            if raw.poll(100):
                reply = parse_reply(raw.recv_multipart())
                if isinstance(reply, Messages):
                    held = reply.messages[0]
        assert held is not None
        # When it stays silent for two heartbeat intervals, a new consumer gets the message
        got = Collector()
        with Consumer("silent", "c", got, broker.zmq_endpoint):
            wait_for(lambda: got.bodies == [b"held"], timeout=15, what="redelivery")
    finally:
        raw.close(linger=0)
        ctx.term()


def _raw_session(ctx: zmq.Context, endpoint: str, topic: str, channel: str,
                 identify: dict) -> zmq.Socket:
    raw = ctx.socket(zmq.DEALER)
    raw.setsockopt(zmq.LINGER, 0)
    raw.connect(endpoint)
    raw.send_multipart(encode_request(pc.Identify(identify), b"#1"))
    raw.send_multipart(encode_request(pc.Sub(topic, channel), b"#2"))
    raw.send_multipart(encode_request(pc.Rdy(100)))
    return raw


def _deliveries(raw: zmq.Socket, count: int) -> tuple[list, set[type]]:
    """`count` messages as (id, timestamp, attempts, body), and the reply kinds they came in."""
    got: list = []
    kinds: set[type] = set()
    deadline = time.monotonic() + 10
    while len(got) < count and time.monotonic() < deadline:
        if raw.poll(100):
            reply = parse_reply(raw.recv_multipart())
            if isinstance(reply, Messages | PackedMessages):
                kinds.add(type(reply))
                got += [tuple(m) for m in (reply.columns.messages() if isinstance(
                    reply, PackedMessages) else reply.messages)]
    return got, kinds


def test_a_session_that_asks_gets_its_messages_packed_and_fins_them_in_one_frame(broker):
    # Given two sessions on two channels of a topic, one asking for packed messages
    ctx = zmq.Context()
    packed = _raw_session(ctx, broker.zmq_endpoint, "packed", "p", {"packed_messages": True})
    plain = _raw_session(ctx, broker.zmq_endpoint, "packed", "q", {})
    try:
        replies = [parse_reply(s.recv_multipart()) for s in (packed, plain)]
        assert [msgpack.unpackb(r.payload)["packed_messages"] for r in replies] == [True, False]
        wait_for(lambda: len(broker.topic_stats("packed")["channels"]) == 2, what="channels")
        # When 50 messages are published
        bodies = [b"m%d" % i for i in range(50)]
        with Producer(broker.zmq_endpoint) as p:
            p.multi_publish("packed", bodies)
        # Then both sessions get them, each in the form it asked for
        got_packed, kinds_packed = _deliveries(packed, 50)
        got_plain, kinds_plain = _deliveries(plain, 50)
        assert (kinds_packed, kinds_plain) == ({PackedMessages}, {Messages})
        assert sorted(m[3] for m in got_packed) == sorted(m[3] for m in got_plain) \
            == sorted(bodies)
        assert all(m[2] == 1 for m in got_packed)
        # And one FIN frame holding every id finishes them all
        packed.send_multipart([b"FIN", b"".join(m[0] for m in got_packed)])

        def in_flight(channel: str) -> int:
            stats = broker.topic_stats("packed")["channels"]
            return next(c["in_flight_count"] for c in stats if c["channel_name"] == channel)
        wait_for(lambda: in_flight("p") == 0, what="every message FINed")
        assert in_flight("q") == 50
    finally:
        packed.close(linger=0)
        plain.close(linger=0)
        ctx.term()


def test_a_producer_publishes_packed_once_the_broker_says_it_can(broker, monkeypatch):
    sent: list[bytes] = []
    send_frames = client_module.send_frames

    def recording(sock, frames):
        sent.append(next(f for f in frames if not f.startswith(b"#")))
        send_frames(sock, frames)
    monkeypatch.setattr(client_module, "send_frames", recording)
    got = Collector()
    with Consumer("pm", "c", got, broker.zmq_endpoint) as _, \
            Producer(broker.zmq_endpoint) as p:
        wait_for(lambda: broker.topic_stats("pm")["channels"], what="channel")
        # the first requests go before the broker's IDENTIFY answer: as MPUB
        p.publish_batch("pm", [b"a%d" % i for i in range(300)], batch_size=100)
        assert p._brokers[0].packed
        p.publish_batch("pm", [b"b%d" % i for i in range(300)], batch_size=100)
        p.multi_publish("pm", [b"t1", b"t2"], tag="red")
        wait_for(lambda: len(got.bodies) == 602, what="every message")
    assert sorted(got.bodies) == sorted([*(b"a%d" % i for i in range(300)),
                                         *(b"b%d" % i for i in range(300)), b"t1", b"t2"])
    published = [name for name in sent if name.endswith(b"PUB")]
    assert published == [b"MPUB"] * 3 + [b"PMPUB"] * 3 + [b"TPMPUB"]


def test_a_producer_skips_a_dead_broker_and_fails_loudly_when_all_are_dead(broker):
    dead = "tcp://127.0.0.1:9"  # discard port: nothing answers
    with Producer([dead, broker.zmq_endpoint], timeout=0.5) as p:
        for i in range(4):
            p.publish("rr", b"%d" % i)
        assert p.retried >= 1
    with Producer(dead, timeout=0.2, max_attempts=2) as p, pytest.raises(PublishError):
        p.publish("rr", b"lost?")


def test_touch_keeps_a_long_running_message_from_timing_out(broker):
    # A handler that works for 2.5 s on a message with a 1 s timeout, touching it as it goes.
    attempts: list[int] = []
    done = threading.Event()

    def slow(m: Message) -> None:
        attempts.append(m.attempts)
        for _ in range(5):
            time.sleep(0.5)  # the "work" (this is the handler, not test synchronisation)
            m.touch()
        done.set()

    with Consumer("slow", "c", slow, broker.zmq_endpoint, msg_timeout_ms=1000) as _, \
            Producer(broker.zmq_endpoint) as p:
        wait_for(lambda: broker.topic_stats("slow")["channels"], what="channel")
        p.publish("slow", b"long job")
        assert done.wait(20)
        wait_for(lambda: broker.topic_stats("slow")["channels"][0]["in_flight_count"] == 0,
                 what="finished")
    assert attempts == [1]
    assert broker.topic_stats("slow")["channels"][0]["timeout_count"] == 0


def test_a_consumer_subscribes_again_as_soon_as_the_gateway_comes_back(tmp_path):
    # Given a consumer with a long heartbeat (silence alone would take 2 minutes to notice),
    # on fixed ports (a gateway restarted on port 0 would pick other ones)
    from tests.broker.test_process_lifecycle import free_port

    b = Broker(broker_options(tmp_path / "data", mem_queue_size=0,
                              zmq_address=f"tcp://127.0.0.1:{free_port()}",
                              tcp_address=f"127.0.0.1:{free_port()}",
                              http_address=f"127.0.0.1:{free_port()}")).start()
    got = Collector()
    try:
        with Consumer("back", "c", got, b.zmq_endpoint, heartbeat_interval_ms=60_000) as _, \
                Producer(b.zmq_endpoint) as p:
            wait_for(lambda: b.topic_stats("back")["channels"]
                     and b.topic_stats("back")["channels"][0]["client_count"] == 1,
                     what="the subscription")
            p.publish("back", b"before")
            wait_for(lambda: got.bodies == [b"before"], what="the first message")
            # When the gateway (which held the session) is killed and restarted
            (gateway,) = [x for x in b.supervisor.ps() if x.name == "gateway"]
            import os
            import signal

            os.kill(gateway.pid, signal.SIGKILL)
            wait_for(lambda: any(x.name == "gateway" and x.alive and x.pid != gateway.pid
                                 for x in b.supervisor.ps()), 30, "the gateway back")
            # Then the consumer's session starts afresh at once (its DEALER saw the
            # disconnect): a message published now arrives well before two heartbeats
            p.publish("back", b"after")
            wait_for(lambda: b"after" in got.bodies, 30, "the message after the restart")
            # (and it went to this consumer, not to the producer's new session: client
            # names are unique to the gateway's life, ZeroMQ routing ids repeat)
    finally:
        b.stop()
