"""A full disk (#22): publishes are refused, never acknowledged, consumers keep draining,
and publishing resumes by itself when space returns -- on the rig, which answers
ENOSPC to whatever needs new space while its control file exists."""

from __future__ import annotations

import http.client
import json
import threading
import time

import psutil
import pytest

from tests.power.rig import BrokerProcess, Tcp, VolatileMount, consume
from tests.power.volatile_fs import FULL_CONTROL
from transport.client import ClientError, Producer
from transport.nsq.client_codec import ErrorFrame, Response
from transport.protocol import commands as pc

pytestmark = pytest.mark.timeout(180)


def _depth(b: BrokerProcess) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", b.http, timeout=10)
    conn.request("GET", "/stats?format=json&topic=t")
    channel = json.loads(conn.getresponse().read())["topics"][0]["channels"][0]
    return int(channel["depth"]) + int(channel["in_flight_count"])


def _http(b: BrokerProcess, method: str, path: str, body: bytes | None = None,
          ) -> tuple[int, bytes]:
    conn = http.client.HTTPConnection("127.0.0.1", b.http, timeout=10)
    conn.request(method, path, body)
    response = conn.getresponse()
    return response.status, response.read()


def _ping(b: BrokerProcess) -> bytes:
    return _http(b, "GET", "/ping")[1]


def test_a_full_disk_refuses_publishes_lets_consumers_drain_and_recovers_by_itself(
        fs: VolatileMount, broker: BrokerProcess) -> None:
    full = fs.backing / FULL_CONTROL
    acked: list[bytes] = []
    got: set[bytes] = set()
    try:
        broker.start()
        broker.create(("t",), ("c",))
        pub = Tcp(broker.tcp)
        events = pub.events()

        def publish(n: int) -> object:
            body = b"%05d" % n + b"x" * 995
            pub.send(pc.Pub("t", body))
            answer = next(events)
            if answer == Response(b"OK"):
                acked.append(body)
            return answer

        for n in range(20):
            assert publish(n) == Response(b"OK")
        assert broker.proc is not None
        processes = {p.pid for p in psutil.Process(broker.proc.pid).children(recursive=True)}
        # Given a disk that has just filled up
        full.write_text("")
        # When publishing goes on (the queue needs a new chunk within 20 messages)
        answers = [publish(n) for n in range(20, 80)]
        refused = [a for a in answers if isinstance(a, ErrorFrame)]
        # Then publishes are refused with an error that says the disk is full, on every
        # protocol, and /ping and /metrics say so too
        assert refused, "nothing was refused on a full disk"
        assert refused[0].error.code == "E_PUB_FAILED"
        assert str(refused[0].error).startswith("E_PUB_FAILED PUB failed: disk full - ")
        status, answer = _http(broker, "POST", "/pub?topic=t", b"h" * 1000)
        assert status == 507
        assert json.loads(answer)["message"] == "DISK_FULL"
        assert "disk full" in json.loads(answer)["detail"]
        with Producer(f"tcp://127.0.0.1:{broker.zmq}", timeout=10, max_attempts=1) as p, \
                pytest.raises(ClientError, match="E_PUB_FAILED PUB failed: disk full"):
            p.publish("t", b"z" * 1000)
        assert _ping(broker).startswith(b"NOK - PUB failed: disk full")
        assert b"\nnsq_disk_full 1\n" in _http(broker, "GET", "/metrics")[1]
        # And a consumer drains every acknowledged message meanwhile
        stop = threading.Event()
        consume(broker.tcp, "t", "c", got.add, stop, idle=3.0)
        assert set(acked) <= got
        # (with no process restarted: a crash loop would have escalated to its node)
        assert {p.pid for p in psutil.Process(broker.proc.pid).children(recursive=True)} \
            == processes
        # And once space returns, publishing resumes by itself
        full.unlink()
        assert publish(1000) == Response(b"OK")
        assert _ping(broker) == b"OK"
        # And nothing acknowledged and not consumed is lost across a restart
        broker.kill9()
        broker.start()
        deadline = time.monotonic() + 30
        while _depth(broker) < 1 and time.monotonic() < deadline:  # (recovered, not yet read)
            time.sleep(0.1)
        consume(broker.tcp, "t", "c", got.add, stop, idle=5.0)
        assert set(acked) <= got
    finally:
        full.unlink(missing_ok=True)
