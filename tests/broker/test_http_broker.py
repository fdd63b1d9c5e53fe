"""nsqd's HTTP API served by a running broker (gateway listener + facade + actors)."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator
from typing import Any

import pytest

from actors.broker import Broker
from actors.broker.client import ClientRdy, ClientSub, ClientTake
from actors.broker.nsq_message import decode_message
from tests.broker.conftest import broker_options
from tests.broker.test_broker_actors import wait_for

pytestmark = pytest.mark.timeout(90)


@pytest.fixture(scope="module")
def broker(tmp_path_factory) -> Iterator[Broker]:
    data = tmp_path_factory.mktemp("http") / "data"
    b = Broker(broker_options(data, workers=2, max_msg_size=1000)).start()
    yield b
    b.stop()


def call(broker: Broker, method: str, path: str, body: bytes | None = None) -> tuple[int, bytes]:
    req = urllib.request.Request(f"http://127.0.0.1:{broker.http_port}{path}", data=body,
                                 method=method)
    try:
        with urllib.request.urlopen(req, timeout=10) as resp:  # noqa: S310 - loopback only
            return resp.status, resp.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def error_of(raw: bytes) -> str:
    return json.loads(raw)["message"]


def stats(broker: Broker, query: str = "") -> dict[str, Any]:
    status, raw = call(broker, "GET", f"/stats?format=json{query}")
    assert status == 200
    return json.loads(raw)


def test_ping_answers_ok(broker):
    assert call(broker, "GET", "/ping") == (200, b"OK")


def test_info_names_the_ports(broker):
    status, raw = call(broker, "GET", "/info")
    info = json.loads(raw)
    assert status == 200
    assert info["http_port"] == broker.http_port
    assert "version" in info


def test_pub_and_mpub_reach_a_subscribed_consumer(broker):
    sup = broker.supervisor
    # (nsqd: a channel needs its topic first)
    assert call(broker, "POST", "/channel/create?topic=web&channel=c")[0] == 404
    assert call(broker, "POST", "/topic/create?topic=web")[0] == 200
    assert call(broker, "POST", "/channel/create?topic=web&channel=c")[0] == 200
    sup.tell("client:httpc", ClientSub("web", "c"))
    sup.tell("client:httpc", ClientRdy(100))
    assert call(broker, "POST", "/pub?topic=web", b"one") == (200, b"OK")
    assert call(broker, "POST", "/mpub?topic=web", b"two\nthree\n")[0] == 200
    binary = (b"\x00\x00\x00\x02" + b"\x00\x00\x00\x04four" + b"\x00\x00\x00\x04five")
    assert call(broker, "POST", "/mpub?topic=web&binary=true", binary)[0] == 200
    got: list[bytes] = []

    def five() -> bool:
        got.extend(e[2] for e in sup.ask("client:httpc", ClientTake(), timeout=5))
        return len(got) >= 5
    wait_for(five, what="five messages")
    assert sorted(decode_message(m).body for m in got) == sorted(
        [b"one", b"two", b"three", b"four", b"five"])


def test_bad_publishes_get_nsqd_error_names(broker):
    status, raw = call(broker, "POST", "/pub", b"x")
    assert (status, error_of(raw)) == (400, "MISSING_ARG_TOPIC")
    status, raw = call(broker, "POST", "/pub?topic=bad!name", b"x")
    assert (status, error_of(raw)) == (400, "INVALID_TOPIC")
    status, raw = call(broker, "POST", "/pub?topic=t", b"")
    assert (status, error_of(raw)) == (400, "MSG_EMPTY")
    status, raw = call(broker, "POST", "/pub?topic=t", b"x" * 1001)
    assert (status, error_of(raw)) == (413, "MSG_TOO_BIG")
    status, raw = call(broker, "POST", "/pub?topic=t&defer=-5", b"x")
    assert (status, error_of(raw)) == (400, "INVALID_DEFER")
    assert call(broker, "GET", "/ping") == (200, b"OK")  # and the broker carries on


def test_topic_and_channel_admin_endpoints_change_what_stats_shows(broker):
    assert call(broker, "POST", "/topic/create?topic=admin")[0] == 200
    assert call(broker, "POST", "/channel/create?topic=admin&channel=a")[0] == 200
    wait_for(lambda: stats(broker, "&topic=admin")["topics"], what="topic in stats")
    assert call(broker, "POST", "/channel/pause?topic=admin&channel=a")[0] == 200
    wait_for(lambda: stats(broker, "&topic=admin")["topics"][0]["channels"][0]["paused"],
             what="paused channel")
    assert call(broker, "POST", "/topic/pause?topic=admin")[0] == 200
    assert stats(broker, "&topic=admin")["topics"][0]["paused"] is True
    assert call(broker, "POST", "/pub?topic=admin", b"kept")[0] == 200
    assert stats(broker, "&topic=admin")["topics"][0]["depth"] == 1
    assert call(broker, "POST", "/topic/empty?topic=admin")[0] == 200
    assert stats(broker, "&topic=admin")["topics"][0]["depth"] == 0
    status, raw = call(broker, "POST", "/channel/delete?topic=admin&channel=nope")
    assert (status, error_of(raw)) == (404, "CHANNEL_NOT_FOUND")
    assert call(broker, "POST", "/topic/delete?topic=admin")[0] == 200
    wait_for(lambda: not stats(broker, "&topic=admin")["topics"], what="topic gone")
    status, raw = call(broker, "POST", "/topic/delete?topic=admin")
    assert (status, error_of(raw)) == (404, "TOPIC_NOT_FOUND")


def test_stats_in_text_and_metrics_in_prometheus_format(broker):
    assert call(broker, "POST", "/pub?topic=metrics_t", b"m")[0] == 200
    status, text = call(broker, "GET", "/stats?format=text")
    assert status == 200
    assert b"metrics_t" in text
    status, metrics = call(broker, "GET", "/metrics")
    assert status == 200
    assert b"# TYPE" in metrics
    assert b'topic="metrics_t"' in metrics


def test_unknown_paths_are_not_found(broker):
    status, raw = call(broker, "GET", "/nope")
    assert (status, error_of(raw)) == (404, "NOT_FOUND")
