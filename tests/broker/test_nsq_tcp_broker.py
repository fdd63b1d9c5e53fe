"""NSQ TCP protocol V2 against a running broker: our codec's client and the real pynsq."""

from __future__ import annotations

import socket
import struct
from collections.abc import Iterator

import pytest

from actors.broker import Broker
from tests.broker.conftest import broker_options
from tests.broker.test_broker_actors import wait_for
from tests.broker.tls_kit import Client
from transport.nsq.client_codec import Response
from transport.protocol import commands as pc

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def broker(tmp_path_factory) -> Iterator[Broker]:
    data = tmp_path_factory.mktemp("tcp") / "data"
    b = Broker(broker_options(data, workers=2, max_msg_size=1000)).start()
    yield b
    b.stop()


def Conn(broker: Broker) -> Client:
    """A blocking NSQ V2 client built on our sans-IO client codec."""
    return Client(broker.tcp_address)


def test_pub_sub_fin_over_nsq_tcp(broker):
    pub = Conn(broker)
    sub = Conn(broker)
    try:
        sub.send(pc.Sub("tcp_t", "c"))
        assert sub.frames(1)
        sub.send(pc.Rdy(10))
        wait_for(lambda: broker.topic_stats("tcp_t")["channels"], what="channel")
        pub.send(pc.Pub("tcp_t", b"hello"))
        pub.send(pc.Mpub("tcp_t", (b"a", b"b")))
        assert len(pub.frames(2)) == 2
        got = []
        while len(got) < 3:
            got.extend(f for f in sub.frames(1) if isinstance(f, pc.Message))
        assert sorted(m.body for m in got) == [b"a", b"b", b"hello"]
        for m in got:
            sub.send(pc.Fin((m.id,)))
        wait_for(lambda: broker.topic_stats("tcp_t")["channels"][0]["in_flight_count"] == 0,
                 what="all finished")
    finally:
        pub.close()
        sub.close()


def test_large_mpubs_in_one_write_arrive_whole(broker):
    # Given a subscriber, and two MPUBs of 100 messages of 1,000 B (each over 64 KiB:
    # split into views of the read buffer) and a PUB, written at once
    pub, sub = Conn(broker), Conn(broker)
    try:
        sub.send(pc.Sub("tcp_big", "c"))
        assert sub.frames(1)
        sub.send(pc.Rdy(500))
        wait_for(lambda: broker.topic_stats("tcp_big")["channels"], what="channel")
        first = [bytes([i]) * 1000 for i in range(100)]
        second = [bytes([i]) * 999 + b"!" for i in range(100)]
        pub.sock.sendall(pub.codec.send(pc.Mpub("tcp_big", tuple(first)))
                         + pub.codec.send(pc.Mpub("tcp_big", tuple(second)))
                         + pub.codec.send(pc.Pub("tcp_big", b"after")))
        assert pub.frames(3) == [Response(b"OK")] * 3
        # Then the subscriber gets every message as it was published
        got: list[pc.Message] = []
        while len(got) < 201:
            got.extend(f for f in sub.frames(1) if isinstance(f, pc.Message))
        assert sorted(m.body for m in got) == sorted([*first, *second, b"after"])
        sub.send(pc.Fin(tuple(m.id for m in got)))
    finally:
        pub.close()
        sub.close()


def test_bad_input_gets_an_error_frame_and_fatal_ones_close_the_connection(broker):
    c = Conn(broker)
    try:
        c.send(pc.Pub("bad$topic", b"x"))
        (err,) = c.frames(1)
        assert "E_BAD_TOPIC" in str(err)
        assert c.sock.recv(10) == b""  # closed by the broker
    finally:
        c.close()
    # A garbage stream gets E_BAD_PROTOCOL and a close; others are unaffected.
    host, port = broker.tcp_address.rsplit(":", 1)
    raw = socket.create_connection((host, int(port)), timeout=10)
    raw.sendall(b"GARBAGE\n")
    data = raw.recv(1024)
    _size, kind = struct.unpack(">ii", data[:8])
    assert kind == 1
    assert b"E_BAD_PROTOCOL" in data
    raw.close()
    ok = Conn(broker)
    try:
        ok.send(pc.Pub("still_fine", b"x"))
        assert ok.frames(1)
    finally:
        ok.close()


def test_the_real_pynsq_reader_and_writer_work_unchanged(broker):
    nsq = pytest.importorskip("nsq")
    import tornado.ioloop

    host, port = broker.tcp_address.rsplit(":", 1)
    addr = f"{host}:{port}"
    received: list[bytes] = []
    loop = tornado.ioloop.IOLoop.current()

    def handler(message) -> bool:
        received.append(message.body)
        if len(received) == 3:
            loop.stop()
        return True

    reader = nsq.Reader(topic="pynsq_t", channel="c", message_handler=handler,
                        nsqd_tcp_addresses=[addr], max_in_flight=10, heartbeat_interval=5)
    writer = nsq.Writer([addr])
    published: list = []

    def publish() -> None:
        def done(conn, data) -> None:
            published.append(data)
        writer.pub("pynsq_t", b"w1", callback=done)
        writer.mpub("pynsq_t", [b"w2", b"w3"], callback=done)

    loop.call_later(1.0, publish)
    loop.call_later(20.0, loop.stop)
    loop.start()
    reader.close()
    for conn in list(writer.conns.values()):  # pynsq's Writer has no close()
        conn.close()
    assert sorted(received) == [b"w1", b"w2", b"w3"]
    assert all(d == b"OK" for d in published), published


# nsqd 1.3.0's client entry in /stats (measured beside it): every field and its type
NSQD_CLIENT_FIELDS = {
    "client_id": str, "hostname": str, "version": str, "remote_address": str, "state": int,
    "ready_count": int, "in_flight_count": int, "message_count": int, "finish_count": int,
    "requeue_count": int, "connect_ts": int, "sample_rate": int, "deflate": bool,
    "snappy": bool, "user_agent": str, "tls": bool, "tls_cipher_suite": str,
    "tls_version": str, "tls_negotiated_protocol": str,
    "tls_negotiated_protocol_is_mutual": bool,
}


def test_stats_show_a_consumer_with_every_field_nsqd_reports(broker):
    sub = Conn(broker)
    try:
        sub.send(pc.Identify({"client_id": "billing-7", "hostname": "box.example",
                              "user_agent": "pynsq/0.9.1", "sample_rate": 0}))
        assert sub.frames(1)
        sub.send(pc.Sub("stats_fields", "c"))
        assert sub.frames(1)
        sub.send(pc.Rdy(5))
        wait_for(lambda: broker.topic_stats("stats_fields")["channels"][0]["clients"]
                 and broker.topic_stats("stats_fields")["channels"][0]["clients"][0][
                     "ready_count"] == 5, what="the client in stats")
        (client,) = broker.topic_stats("stats_fields")["channels"][0]["clients"]
        for field, kind in NSQD_CLIENT_FIELDS.items():
            assert type(client[field]) is kind, (field, client.get(field))
        local = sub.sock.getsockname()
        assert client["client_id"] == "billing-7"
        assert client["hostname"] == "box.example"
        assert client["user_agent"] == "pynsq/0.9.1"
        assert client["remote_address"] == f"{local[0]}:{local[1]}"
        assert (client["version"], client["state"]) == ("V2", 3)
        assert client["connect_ts"] > 1_700_000_000
    finally:
        sub.close()


def test_stats_list_the_connections_that_published_as_nsqd_producers(broker):
    import json
    import urllib.request

    pub = Conn(broker)
    try:
        pub.send(pc.Identify({"client_id": "orders-writer"}))
        assert pub.frames(1)
        pub.send(pc.Mpub("prod_a", (b"1", b"2", b"3")))
        pub.send(pc.Pub("prod_b", b"x"))
        assert len(pub.frames(2)) == 2

        def stats(query: str = "") -> dict:
            url = f"http://127.0.0.1:{broker.http_port}/stats?format=json{query}"
            with urllib.request.urlopen(url, timeout=10) as r:
                return json.loads(r.read())

        (producer,) = [p for p in stats()["producers"] if p["client_id"] == "orders-writer"]
        for field, kind in NSQD_CLIENT_FIELDS.items():
            assert type(producer[field]) is kind, field
        assert producer["pub_counts"] == [{"topic": "prod_a", "count": 3},
                                          {"topic": "prod_b", "count": 1}]
        (only_b,) = [p for p in stats("&topic=prod_b")["producers"]
                     if p["client_id"] == "orders-writer"]
        assert only_b["pub_counts"] == [{"topic": "prod_b", "count": 1}]
        assert stats("&include_clients=false")["producers"] is None
    finally:
        pub.close()
