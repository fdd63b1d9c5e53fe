"""Scale without threads: thousands of connections and topics on one broker (counts, not times).

The figures that matter (10,000 connections, 10,000 topics, nsqd beside us)
are measured by ``bench/scale_bench.py``; these tests hold the *shape* at a
size the suite can afford: every connection answered, threads per process
bounded whatever the load, fds growing with connections and files only, and
nothing left behind when the load goes.
"""

from __future__ import annotations

import contextlib
import http.client
import json
import os
import selectors
import signal
import socket
import time
from collections.abc import Iterator

import psutil
import pytest
import zmq

from actors.broker import Broker
from tests.broker.conftest import broker_options
from tests.broker.test_broker_actors import wait_for
from transport.nsq.client_codec import ClientConnection, ErrorFrame, Response
from transport.nsq.codec import CLOSED, NEED_DATA
from transport.protocol import commands as pc
from transport.protocol.validation import ProtocolError

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]

MAX_THREADS = 64
"""The issue's bound on threads per process, whatever the load."""


def _children() -> dict[str, psutil.Process]:
    """The broker's node processes (the test process is its supervisor: they are the
    children of its fork server, see actors.runtime.forkserver), and the server, by pid."""
    return {str(p.pid): p for p in psutil.Process().children(recursive=True)
            if "forkserver" in " ".join(p.cmdline())}


def _gateway(broker: Broker) -> psutil.Process:
    (info,) = [p for p in broker.supervisor.ps() if p.name == "gateway"]
    assert info.pid is not None
    return psutil.Process(info.pid)


def _max_threads() -> int:
    return max([psutil.Process().num_threads(), *(p.num_threads() for p in _children().values())])


class Subscribers:
    """NSQ V2 consumers on one selector, each driven by our sans-IO client codec:
    SUB, count OKs, answer heartbeats."""

    def __init__(self, address: str) -> None:
        host, port = address.rsplit(":", 1)
        self.address = (host, int(port))
        self.sel = selectors.DefaultSelector()
        self.codecs: dict[socket.socket, ClientConnection] = {}
        self.ok = 0
        self.errors: list[str] = []
        self.closed_by_broker = 0

    def open(self, topic: str, channel: str) -> None:
        s = socket.create_connection(self.address, timeout=30)
        codec = ClientConnection()
        s.sendall(codec.send(pc.Sub(topic, channel)))
        s.setblocking(False)
        self.codecs[s] = codec
        self.sel.register(s, selectors.EVENT_READ)

    def pump_until(self, done: int, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while self.ok + len(self.errors) < done and time.monotonic() < deadline:
            for key, _ in self.sel.select(0.2):
                s: socket.socket = key.fileobj  # type: ignore[assignment]
                codec = self.codecs[s]
                codec.receive_data(s.recv(65536))
                while (event := codec.next_event()) is not NEED_DATA:
                    if event is CLOSED or isinstance(event, ProtocolError):
                        self.closed_by_broker += 1
                        self._drop(s)
                        break
                    if isinstance(event, Response) and event.data == b"OK":
                        self.ok += 1
                    elif isinstance(event, pc.Heartbeat):
                        s.sendall(codec.send(pc.Nop()))
                    elif isinstance(event, ErrorFrame):
                        self.errors.append(str(event.error))

    def _drop(self, s: socket.socket) -> None:
        self.sel.unregister(s)
        del self.codecs[s]
        s.close()

    def close(self) -> None:
        for s in list(self.codecs):
            self._drop(s)
        self.sel.close()


@pytest.fixture
def broker(tmp_path) -> Iterator[Broker]:
    b = Broker(broker_options(tmp_path / "data", workers=2)).start()
    yield b
    b.stop()


def _client_actors(broker: Broker) -> int:
    return sum(1 for a in broker.supervisor.actors() if a.name.startswith("client:"))


def test_three_thousand_subscribers_are_served_on_a_bounded_number_of_threads(broker):
    gateway = _gateway(broker)
    fds_idle = gateway.num_fds()
    subs = Subscribers(broker.tcp_address)
    ctx = zmq.Context()
    dealers = []
    try:
        # Given 3,000 NSQ TCP consumers and 300 ZeroMQ sessions, each on its own
        # ephemeral channel
        for i in range(3_000):
            subs.open("scale", f"c{i}#ephemeral")
            if i % 200 == 199:
                subs.pump_until(i + 1, 30)
        subs.pump_until(3_000, 60)
        for i in range(300):
            d = ctx.socket(zmq.DEALER)
            d.setsockopt(zmq.LINGER, 0)
            d.connect(broker.zmq_endpoint)
            d.send_multipart([b"SUB", b"scale", f"z{i}#ephemeral".encode()])
            dealers.append(d)
        answers = [d.recv_multipart() for d in dealers if d.poll(30_000)]
        # Then every one is answered OK
        assert (subs.ok, subs.errors, subs.closed_by_broker) == (3_000, [], 0)
        assert [a[0] for a in answers] == [b"OK"] * 300
        # And no process has more than a bounded number of threads: actors hold none
        assert _max_threads() <= MAX_THREADS
        # And the gateway's fds grew with the connections, not with actors x nodes
        assert gateway.num_fds() - fds_idle <= 3_000 + 300 + 100
        assert _client_actors(broker) == 3_300
    finally:
        subs.close()
        for d in dealers:
            d.close(0)
        ctx.term()
    # When they all leave, Then their actors and fds go with them
    # (ZeroMQ sessions end by missing heartbeats, not by a TCP close: not awaited here)
    wait_for(lambda: _client_actors(broker) <= 300, 60, "the TCP clients' actors to stop")
    assert gateway.num_fds() <= fds_idle + 50
    assert _max_threads() <= MAX_THREADS


def _assert_all_topics(conn: http.client.HTTPConnection, n: int, *, check: bool = True) -> bool:
    """/stats shows `n` topics, each with two channels holding one message."""
    conn.request("GET", "/stats?format=json")
    response = conn.getresponse()
    body = response.read()
    if response.status != 200 and not check:
        return False
    assert response.status == 200, body[:200]
    topics = {t["topic_name"]: t for t in json.loads(body)["topics"]}
    ok = (len(topics) == n and all(len(t["channels"]) == 2 for t in topics.values())
          and all(c["depth"] == 1 for t in topics.values() for c in t["channels"]))
    assert ok or not check, (len(topics), list(topics.values())[:2])
    return ok


@pytest.fixture
def durable_broker(tmp_path) -> Iterator[Broker]:
    """Messages on disk (``--mem-queue-size=0``), so they are still there after a kill."""
    b = Broker(broker_options(tmp_path / "data", workers=2, mem_queue_size=0)).start()
    yield b
    b.stop()


def test_two_thousand_topics_with_channels_are_created_and_come_back_after_a_kill(
        durable_broker):
    broker = durable_broker
    conn = http.client.HTTPConnection("127.0.0.1", broker.http_port, timeout=60)
    failures: list[str] = []

    def post(path: str, body: bytes = b"") -> None:
        conn.request("POST", path, body=body)
        response = conn.getresponse()
        data = response.read()
        if response.status != 200:
            failures.append(f"{path}: {response.status} {data[:80]!r}")

    try:
        # Given 2,000 topics, each with two channels and one message
        for i in range(2_000):
            post(f"/topic/create?topic=t{i}")
            post(f"/channel/create?topic=t{i}&channel=a")
            post(f"/channel/create?topic=t{i}&channel=b")
            post(f"/pub?topic=t{i}", b"hello")
        # Then none failed, and threads stayed bounded
        assert failures[:3] == []
        assert _max_threads() <= MAX_THREADS
        # And every topic reports both channels with the message
        _assert_all_topics(conn, 2_000)
        # When both workers are killed -9 and restarted by the supervisor
        killed = {p.name: p.pid for p in broker.supervisor.ps() if p.role == "worker"}
        for pid in killed.values():
            os.kill(pid, signal.SIGKILL)
        wait_for(lambda: all(p.alive and p.pid != killed[p.name]
                             for p in broker.supervisor.ps() if p.role == "worker"),
                 60, "both workers restarted")
        # Then every topic comes back with both channels and its message, no actor
        # crashed while 6,000 of them started at once, and the queues were not left open
        wait_for(lambda: _assert_all_topics(conn, 2_000, check=False), 120, "every topic back")
        _assert_all_topics(conn, 2_000)
        assert [a.name for a in broker.supervisor.actors(timeout=10) if a.restarts] == []
        workers = [psutil.Process(p.pid) for p in broker.supervisor.ps() if p.role == "worker"]
        assert all(w.num_fds() < 200 for w in workers), [w.num_fds() for w in workers]
    finally:
        with contextlib.suppress(Exception):
            conn.close()
