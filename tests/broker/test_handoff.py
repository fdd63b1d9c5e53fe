"""A plain NSQ TCP connection that subscribes is handed to the worker that holds its channel
(docs/ARCHITECTURE.md, "Subscribed connections"): the client sees the same protocol, in
the same order; a connection the gateway cannot hand over stays there, working."""

from __future__ import annotations

import glob
import json
import os
import signal
import urllib.request
from collections.abc import Iterator

import pytest

from actors.broker import Broker
from actors.broker.options import run_dir_for
from actors.runtime.placement import Placement
from tests.broker.conftest import broker_options
from tests.broker.test_broker_actors import wait_for
from tests.broker.tls_kit import Client
from transport.nsq.client_codec import Response
from transport.protocol import commands as pc

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def broker(tmp_path) -> Iterator[Broker]:
    b = Broker(broker_options(tmp_path / "data", workers=2)).start()
    yield b
    b.stop()


def _stats(broker: Broker) -> dict:
    url = f"http://127.0.0.1:{broker.http_port}/stats?format=json"
    with urllib.request.urlopen(url, timeout=10) as r:
        return json.load(r)


def _clients(broker: Broker) -> dict[str, str]:
    """Client actor name -> its node."""
    return {a.name: a.node for a in broker.supervisor.actors() if a.name.startswith("client:")}


def test_a_subscribed_connection_is_served_by_its_channels_worker_in_order(broker):
    topic = "handed"
    worker = Placement(2).node_for(f"topic:{topic}")
    c = Client(broker.tcp_address)
    try:
        c.identify(user_agent="handoff-test/1", msg_timeout=1000)
        # A publish, then the SUB and a RDY, in one write: the PUB's OK comes from the
        # gateway before the SUB's from the worker, and the message after both.
        c.sock.sendall(c.codec.send(pc.Pub(topic, b"before"))
                       + c.codec.send(pc.Sub(topic, "c")) + c.codec.send(pc.Rdy(10)))
        assert c.frames(2) == [Response(b"OK"), Response(b"OK")]
        (first,) = c.frames(1)
        assert first.body == b"before"
        names = _clients(broker)
        assert list(names.values()) == [worker], names
        assert next(iter(names)).startswith(f"client:w{worker.rpartition('-')[2]}.")
        stats = _stats(broker)
        (channel,) = stats["topics"][0]["channels"]
        (client,) = channel["clients"]
        assert client["user_agent"] == "handoff-test/1"
        assert client["remote_address"] == "{}:{}".format(*c.sock.getsockname())
        # what the connection published before it was handed over still counts
        (producer,) = stats["producers"]
        assert producer["pub_counts"] == [{"topic": topic, "count": 1}]
        broker.publish(topic, [b"after"])
        (second,) = c.frames(1)
        assert second.body == b"after"
        c.send(pc.Fin((first.id,)))
        c.send(pc.Fin((second.id,)))
        wait_for(lambda: broker.topic_stats(topic)["channels"][0]["in_flight_count"] == 0,
                 what="both finished on the worker")
        # the msg_timeout IDENTIFY asked for came along: an unFINed message times out
        broker.publish(topic, [b"late"])
        (late,) = c.frames(1)
        (again,) = c.frames(1)  # redelivered after 1 s
        assert again.id == late.id
        assert again.attempts == 2
        c.send(pc.Fin((again.id,)))
        c.send(pc.Cls())
        assert c.frames(1) == [Response(b"CLOSE_WAIT")]
    finally:
        c.close()
    wait_for(lambda: not _clients(broker), what="the worker's client actor to stop")
    assert broker.topic_stats(topic)["channels"][0]["client_count"] == 0


def test_a_connection_that_cannot_be_handed_over_stays_on_the_gateway(broker):
    for path in glob.glob(os.path.join(run_dir_for(broker.options.data_path), "handoff-*")):
        os.unlink(path)  # as if every worker were restarting
    c = Client(broker.tcp_address)
    try:
        c.send(pc.Sub("stays", "c"))
        assert c.frames(1) == [Response(b"OK")]
        c.send(pc.Rdy(1))
        broker.publish("stays", [b"m"])
        (m,) = c.frames(1)
        assert m.body == b"m"
        assert list(_clients(broker).values()) == ["gateway"]
        c.send(pc.Fin((m.id,)))
        wait_for(lambda: broker.topic_stats("stays")["channels"][0]["in_flight_count"] == 0,
                 what="finished on the gateway")
    finally:
        c.close()


def test_a_bad_sub_is_refused_by_the_worker_as_the_gateway_would(broker):
    c = Client(broker.tcp_address)
    try:
        c.send(pc.Sub("fine", "c"))
        assert c.frames(1) == [Response(b"OK")]
        c.send(pc.Sub("fine", "d"))  # twice: nsqd's fatal state error, then the close
        (error,) = c.frames(1)
        assert "E_INVALID" in str(error)
        assert "cannot SUB in current state" in str(error)
        assert c.closed_by_peer()
    finally:
        c.close()
    wait_for(lambda: not _clients(broker), what="the client actor to stop")


def test_a_publishing_connection_is_served_by_its_topics_worker_in_order(broker):
    placement = Placement(2)
    topic = "published"
    worker = placement.node_for(f"topic:{topic}")
    other = next(t for t in (f"elsewhere{i}" for i in range(100))
                 if placement.node_for(f"topic:{t}") != worker)
    c = Client(broker.tcp_address)
    try:
        c.identify(user_agent="pub-handoff/1")
        # A pipeline in one write: the first PUB offers the connection to its topic's
        # worker; its OK comes from the gateway, the others' from the worker, in order,
        # one of them from a topic on the other worker.
        c.sock.sendall(c.codec.send(pc.Pub(topic, b"1"))
                       + c.codec.send(pc.Mpub(topic, (b"2", b"3")))
                       + c.codec.send(pc.Pub(other, b"4"))
                       + c.codec.send(pc.Pub(topic, b"5")))
        assert c.frames(4) == [Response(b"OK")] * 4
        names = _clients(broker)
        assert list(names.values()) == [worker], names
        assert broker.topic_stats(topic)["message_count"] == 4
        assert broker.topic_stats(other)["message_count"] == 1
        (producer,) = _stats(broker)["producers"]
        assert producer["user_agent"] == "pub-handoff/1"
        assert sorted((p["topic"], p["count"]) for p in producer["pub_counts"]) \
            == [(other, 1), (topic, 4)]
        # a publisher that was handed over may still subscribe, here to a channel of a
        # topic on the other worker: the worker's client actor reads it from there
        c.send(pc.Sub(other, "c"))
        assert c.frames(1) == [Response(b"OK")]
        c.send(pc.Rdy(1))
        (m,) = c.frames(1)
        assert m.body == b"4"
        c.send(pc.Fin((m.id,)))
        wait_for(lambda: broker.topic_stats(other)["channels"][0]["in_flight_count"] == 0,
                 what="finished from the other worker")
    finally:
        c.close()
    wait_for(lambda: not _clients(broker), what="the worker's client actor to stop")


def test_a_publisher_handed_over_may_still_identify_and_is_answered_as_by_the_gateway(broker):
    features = {"deflate": True, "deflate_level": 6, "snappy": False}
    first = Client(broker.tcp_address)
    try:
        on_gateway = first.identify(**features)  # (before any publish: on the gateway)
    finally:
        first.close()
    c = Client(broker.tcp_address)
    try:
        c.send(pc.Pub("identified", b"x"))
        assert c.frames(1) == [Response(b"OK")]
        wait_for(lambda: list(_clients(broker).values()) == [
            Placement(2).node_for("topic:identified")], what="the hand-off")
        answer = c.identify(**features)  # nsqd allows IDENTIFY until SUB
        assert answer == on_gateway
        assert answer["deflate"] is True
    finally:
        c.close()


def test_a_publisher_handed_over_loses_its_connection_with_its_worker_and_can_come_back(
        broker):
    topic = "doomed"
    worker = Placement(2).node_for(f"topic:{topic}")
    c = Client(broker.tcp_address)
    try:
        c.send(pc.Pub(topic, b"before"))
        assert c.frames(1) == [Response(b"OK")]
        wait_for(lambda: list(_clients(broker).values()) == [worker], what="the hand-off")
        (process,) = [p for p in broker.supervisor.ps() if p.name == worker]
        os.kill(process.pid, signal.SIGKILL)
        # at once, not after a publish timeout: the socket lived in that process
        assert c.closed_by_peer()
    finally:
        c.close()
    wait_for(lambda: any(p.name == worker and p.alive and p.pid != process.pid
                         for p in broker.supervisor.ps()), 30, "the worker back")
    again = Client(broker.tcp_address)
    try:
        again.send(pc.Pub(topic, b"after"))
        assert again.frames(1) == [Response(b"OK")]
    finally:
        again.close()
