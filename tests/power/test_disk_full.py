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
from transport.nsq.client_codec import ErrorFrame, Response
from transport.protocol import commands as pc

pytestmark = pytest.mark.timeout(180)


def _depth(b: BrokerProcess) -> int:
    conn = http.client.HTTPConnection("127.0.0.1", b.http, timeout=10)
    conn.request("GET", "/stats?format=json&topic=t")
    channel = json.loads(conn.getresponse().read())["topics"][0]["channels"][0]
    return int(channel["depth"]) + int(channel["in_flight_count"])


def _ping(b: BrokerProcess) -> bytes:
    conn = http.client.HTTPConnection("127.0.0.1", b.http, timeout=10)
    conn.request("GET", "/ping")
    return conn.getresponse().read()


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
        # Then publishes are refused with a clear error and /ping says why
        assert refused, "nothing was refused on a full disk"
        assert refused[0].error.code == "E_PUB_FAILED"
        assert "space" in str(refused[0].error).lower() or "full" in str(refused[0].error)
        assert _ping(broker).startswith(b"NOK - ")
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
