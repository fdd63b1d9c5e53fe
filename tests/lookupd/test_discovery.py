"""Three brokers and two lookup daemons on loopback: consumers find every broker through
the lookups, keep consuming when one is killed -9 and take it back when it returns
(nothing acknowledged lost), pick up a new broker, survive a lookup daemon's death;
producers fail over; pynsq's Reader finds our brokers through our lookupd."""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from pathlib import Path

import pytest

from actors.lookupd import Lookupd, LookupdOptions
from tests.chaos.harness import BrokerProcess
from tests.lookupd.conftest import Http, free_port, nsq_binary, wait_until
from transport.client import Consumer, Message, Producer, PublishError, lookup

pytestmark = pytest.mark.timeout(180)


@pytest.fixture
def lookupds(lookupd: Lookupd) -> Iterator[list[Lookupd]]:
    """Two lookup daemons (the `lookupd` fixture's and one more)."""
    other = Lookupd(LookupdOptions(tcp_address=f"127.0.0.1:{free_port()}",
                                   http_address=f"127.0.0.1:{free_port()}",
                                   broadcast_address="127.0.0.1", debug_hooks=True,
                                   log_level="warn")).start()
    yield [lookupd, other]
    other.stop()


@pytest.fixture
def start_broker(tmp_path: Path, lookupds: list[Lookupd]) -> Iterator[object]:
    started: list[BrokerProcess] = []

    def start(name: str) -> BrokerProcess:
        args: list[str] = ["--broadcast-address", "127.0.0.1", "--workers", "1"]
        for d in lookupds:
            args += ["--lookupd-tcp-address", d.tcp_address]
        b = BrokerProcess(tmp_path / name, tmp_path / f"{name}.log", tuple(args))
        b.start()
        started.append(b)
        return b

    yield start
    for b in started:
        with contextlib.suppress(Exception):
            b.kill_all()


def _listed(d: Lookupd, topic: str) -> set[int]:
    """The ZeroMQ ports of the brokers `d` lists for `topic`."""
    try:
        return {int(p["zmq_port"]) for p in lookup(d.http_address, topic)}
    except OSError:
        return set()


def test_consumers_find_every_broker_keep_going_when_one_dies_and_take_it_back(
        lookupds: list[Lookupd], start_broker) -> None:
    brokers = [start_broker(f"b{i}") for i in range(3)]
    for b in brokers:
        with Producer(b.zmq_endpoint) as p:
            p.multi_publish("t", [b"%d-start-%d" % (b.zmq, n) for n in range(10)])
    ports = {b.zmq for b in brokers}
    for d in lookupds:
        wait_until(lambda d=d: _listed(d, "t") == ports, what="every broker in both lookups")
    got: set[bytes] = set()
    lock = threading.Lock()

    def handle(m: Message) -> None:
        with lock:
            got.add(m.body)

    consumer = Consumer("t", "c", handle, lookupd_http_addresses=[d.http_address for d in
                                                                   lookupds],
                        lookupd_poll_interval=0.5, max_in_flight=30).start()
    try:
        # Then it consumes from all three
        wait_until(lambda: len(got) == 30, timeout=30, what="every broker's backlog")
        # When one broker is killed -9 with a backlog it acknowledged
        victim = brokers[1]
        with Producer(victim.zmq_endpoint) as p:
            consumer.pause()  # (so the backlog is certainly there when it dies)
            p.multi_publish("t", [b"backlog-%d" % n for n in range(20)])
        victim.kill_all()
        consumer.resume()
        # Then the lookups drop it, and the others' messages keep coming
        for d in lookupds:
            wait_until(lambda d=d: victim.zmq not in _listed(d, "t"), what="the dead broker to go")
        with Producer(brokers[0].zmq_endpoint) as p:
            p.multi_publish("t", [b"after-%d" % n for n in range(10)])
        wait_until(lambda: {b"after-%d" % n for n in range(10)} <= got, timeout=30,
                   what="the live brokers' messages")
        # And once it is back it registers again and its backlog drains: nothing lost
        victim.start()
        wait_until(lambda: victim.zmq in _listed(lookupds[0], "t"), timeout=30,
                   what="the broker back in the lookup")
        wait_until(lambda: {b"backlog-%d" % n for n in range(20)} <= got, timeout=60,
                   what="the killed broker's backlog")
    finally:
        consumer.close()


def test_a_running_consumer_picks_up_a_new_broker(lookupds: list[Lookupd],
                                                  start_broker) -> None:
    first = start_broker("b0")
    with Producer(first.zmq_endpoint) as p:
        p.publish("t", b"one")
    got: list[bytes] = []
    consumer = Consumer("t", "c", lambda m: got.append(m.body),
                        lookupd_http_addresses=[lookupds[0].http_address],
                        lookupd_poll_interval=0.5).start()
    try:
        wait_until(lambda: got == [b"one"], timeout=30, what="the first broker's message")
        second = start_broker("b1")
        with Producer(second.zmq_endpoint) as p:
            p.publish("t", b"two")
        wait_until(lambda: sorted(got) == [b"one", b"two"], timeout=30,
                   what="the new broker's message")
    finally:
        consumer.close()


def test_a_lookup_daemon_dies_the_other_answers_and_the_restarted_one_is_refilled(
        lookupds: list[Lookupd], start_broker) -> None:
    b = start_broker("b0")
    with Producer(b.zmq_endpoint) as p:
        p.publish("t", b"x")
    first, second = lookupds
    wait_until(lambda: _listed(first, "t") == {b.zmq}, what="the registration")
    got: list[bytes] = []
    consumer = Consumer("t", "c", lambda m: got.append(m.body),
                        lookupd_http_addresses=[first.http_address, second.http_address],
                        lookupd_poll_interval=0.3).start()
    try:
        wait_until(lambda: got == [b"x"], timeout=30, what="the message")
        # When one lookup daemon's process is killed -9
        assert first.supervisor is not None
        (gateway,) = [p for p in first.supervisor.ps() if p.name == "gateway"]
        os.kill(gateway.pid, signal.SIGKILL)
        # Then the other still answers, and the consumer keeps its broker
        assert _listed(second, "t") == {b.zmq}
        with Producer(b.zmq_endpoint) as p:
            p.publish("t", b"y")
        wait_until(lambda: got == [b"x", b"y"], timeout=30, what="a message meanwhile")
        # And the restarted daemon is told everything again by the broker
        wait_until(lambda: _listed(first, "t") == {b.zmq}, timeout=30,
                   what="the restarted lookup daemon refilled")
        assert Http(first.http_address).json("/channels?topic=t") == {"channels": ["c"]}
    finally:
        consumer.close()


def test_a_producer_with_several_brokers_fails_over_and_loses_nothing(
        lookupds: list[Lookupd], start_broker) -> None:
    brokers = [start_broker(f"b{i}") for i in range(3)]
    acked: list[bytes] = []
    refused: list[bytes] = []
    with Producer([b.zmq_endpoint for b in brokers], timeout=2, max_attempts=3) as p:
        for n in range(200):
            if n == 50:
                brokers[1].kill_all()  # under load
            body = b"m-%d" % n
            try:
                p.publish("t", body)
                acked.append(body)
            except PublishError:
                refused.append(body)
    assert len(acked) == 200, f"refused {refused}"  # two brokers were always up
    got: set[bytes] = set()
    brokers[1].start()
    consumer = Consumer("t", "c", lambda m: got.add(m.body),
                        lookupd_http_addresses=[lookupds[0].http_address],
                        lookupd_poll_interval=0.5).start()
    try:
        wait_until(lambda: set(acked) <= got, timeout=60, what="every acknowledged message")
    finally:
        consumer.close()


_PYNSQ_READ = """
import json, sys
import nsq, tornado.ioloop
lookupd, topic, count = sys.argv[1], sys.argv[2], int(sys.argv[3])
received = []
loop = tornado.ioloop.IOLoop.current()
def handler(message):
    received.append(message.body.decode())
    if len(received) == count:
        loop.stop()
    return True
reader = nsq.Reader(topic=topic, channel="c", message_handler=handler,
                    lookupd_http_addresses=["http://" + lookupd], lookupd_poll_interval=1,
                    max_in_flight=10)
loop.call_later(30.0, loop.stop)
loop.start()
reader.close()
print(json.dumps(sorted(received)))
"""


def test_pynsq_reader_finds_our_brokers_through_our_lookupd(
        lookupds: list[Lookupd], start_broker) -> None:
    # (in a fresh interpreter: tornado's loop and HTTP client are per-process singletons)
    pytest.importorskip("nsq")
    brokers = [start_broker(f"b{i}") for i in range(2)]
    for b in brokers:
        with Producer(b.zmq_endpoint) as p:
            p.publish("pyt", b"from-%d" % b.zmq)
    wait_until(lambda: len(_listed(lookupds[0], "pyt")) == 2, what="both brokers")
    done = subprocess.run([sys.executable, "-c", _PYNSQ_READ, lookupds[0].http_address, "pyt",
                           "2"], capture_output=True, text=True, timeout=60, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert json.loads(done.stdout) == sorted(f"from-{b.zmq}" for b in brokers)


def test_go_nsq_finds_our_brokers_through_our_lookupd(lookupds: list[Lookupd],
                                                      start_broker) -> None:
    # nsq_tail (NSQ v1.3.0) consumes with go-nsq's ConnectToNSQLookupd, which needs
    # /lookup's X-NSQ-Content-Type header to read the body
    nsq_tail = nsq_binary("nsq_tail")
    brokers = [start_broker(f"b{i}") for i in range(2)]
    for b in brokers:
        with Producer(b.zmq_endpoint) as p:
            p.multi_publish("gt", [b"go-%d-%d" % (b.zmq, n) for n in range(2)])
    wait_until(lambda: len(_listed(lookupds[0], "gt")) == 2, what="both brokers")
    done = subprocess.run([nsq_tail, f"--lookupd-http-address={lookupds[0].http_address}",
                           "--topic=gt", "-n", "4"], capture_output=True, text=True,
                          timeout=60, check=False)
    assert done.returncode == 0, done.stderr[-2000:]
    assert sorted(done.stdout.split()) == sorted(f"go-{b.zmq}-{n}" for b in brokers
                                                 for n in range(2))
