"""End-to-end processing latency (#20, nsqd's --e2e-processing-latency-percentile): what
/stats and /metrics report for a channel and its topic, in nsqd's shape (checked beside
the real nsqd where its binary is)."""

from __future__ import annotations

import json
import time

import pytest

from actors.broker import Broker
from actors.broker.options import OptionsError, parse_options
from tests.broker.conftest import broker_options
from tests.broker.test_http_broker import call, stats
from tests.broker.tls_kit import Client
from tests.lookupd.conftest import Http, free_port, nsq_binary, processes  # noqa: F401
from tests.runtime.conftest import wait_until
from transport.protocol import commands as pc

pytestmark = pytest.mark.timeout(90)


def _consume(address: str, topic: str, n: int, hold: float = 0.0) -> None:
    """Subscribe, take `n` messages, hold them `hold` seconds, FIN them."""
    c = Client(address)
    try:
        c.send(pc.Sub(topic, "c"))
        assert c.frames(1)
        c.send(pc.Rdy(n))
        got: list = []
        while len(got) < n:
            got.extend(f for f in c.frames(1) if isinstance(f, pc.Message))
        time.sleep(hold)
        for m in got:
            c.send(pc.Fin((m.id,)))
        c.send(pc.Nop())
    finally:
        c.close()


def test_percentiles_of_the_time_from_publish_to_fin_per_channel_and_topic(tmp_path):
    opts = broker_options(tmp_path / "data", workers=2,
                          e2e_processing_latency_percentile=(0.5, 0.99))
    with Broker(opts) as b:
        assert call(b, "POST", "/topic/create?topic=lat")[0] == 200
        assert call(b, "POST", "/channel/create?topic=lat&channel=c")[0] == 200
        b.publish("lat", [b"m%d" % i for i in range(20)])
        _consume(b.tcp_address, "lat", 20, hold=0.2)  # each one FINed >= 200 ms after

        def channel() -> dict:
            (t,) = stats(b, "&topic=lat")["topics"]
            return t

        topic = wait_until(lambda: (t := channel())["channels"][0][
            "e2e_processing_latency"]["count"] == 20 and t, what="20 FINs counted")
        e2e = topic["channels"][0]["e2e_processing_latency"]
        assert [p["quantile"] for p in e2e["percentiles"]] == [0.5, 0.99]
        assert all(200_000_000 <= p["value"] < 30_000_000_000 for p in e2e["percentiles"])
        assert "_e2e_samples" not in topic["channels"][0]
        assert topic["e2e_processing_latency"]["count"] == 20  # the topic merges its channels
        assert [p["quantile"] for p in topic["e2e_processing_latency"]["percentiles"]] \
            == [0.5, 0.99]
        _, raw = call(b, "GET", "/metrics")
        lines = raw.decode().splitlines()
        assert "# TYPE nsq_channel_e2e_processing_latency_seconds summary" in lines
        assert 'nsq_channel_e2e_processing_latency_seconds_count{topic="lat",channel="c"} 20' \
            in lines
        (p99,) = [x for x in lines if x.startswith(
            'nsq_channel_e2e_processing_latency_seconds{topic="lat",channel="c",'
            'quantile="0.99"} ')]
        assert 0.2 <= float(p99.rpartition(" ")[2]) < 30
        assert 'nsq_topic_e2e_processing_latency_seconds_count{topic="lat"} 20' in lines


def test_without_percentiles_nothing_is_sampled_and_the_shape_is_nsqds_null(tmp_path):
    with Broker(broker_options(tmp_path / "data")) as b:
        b.publish("plain", [b"x"])
        assert call(b, "POST", "/channel/create?topic=plain&channel=c")[0] == 200
        (t,) = stats(b, "&topic=plain")["topics"]
        assert t["e2e_processing_latency"] == {"count": 0, "percentiles": None}
        assert t["channels"][0]["e2e_processing_latency"] == {"count": 0, "percentiles": None}
        _, raw = call(b, "GET", "/metrics")
        assert b"e2e_processing_latency" not in raw


def test_the_shape_is_nsqds(tmp_path, processes):  # noqa: F811 - the fixture
    nsqd = nsq_binary("nsqd")
    http_port = free_port()
    processes([nsqd, f"--data-path={tmp_path}", "--tcp-address=127.0.0.1:0",
               f"--http-address=127.0.0.1:{http_port}",
               "--e2e-processing-latency-percentile=0.99"], tmp_path / "nsqd.log")
    web = Http(f"127.0.0.1:{http_port}")
    wait_until(web.up, what="nsqd")
    assert web.call("POST", "/topic/create?topic=t")[0] == 200
    assert web.call("POST", "/channel/create?topic=t&channel=c")[0] == 200
    theirs = web.json("/stats?format=json&topic=t")["topics"][0]
    opts = broker_options(tmp_path / "ours", e2e_processing_latency_percentile=(0.99,))
    with Broker(opts) as b:
        assert call(b, "POST", "/topic/create?topic=t")[0] == 200
        assert call(b, "POST", "/channel/create?topic=t&channel=c")[0] == 200
        ours = stats(b, "&topic=t")["topics"][0]
    for a, o in ((theirs, ours), (theirs["channels"][0], ours["channels"][0])):
        assert json.dumps(a["e2e_processing_latency"], sort_keys=True) == \
            json.dumps(o["e2e_processing_latency"], sort_keys=True)



@pytest.mark.parametrize(("flags", "error"), [
    (["--e2e-processing-latency-percentile=1.5"], "must be in (0, 1]"),
    (["--e2e-processing-latency-percentile=0"], "must be in (0, 1]"),
    (["--e2e-processing-latency-window-time=0s"], "must be a positive duration"),
])
def test_bad_e2e_flags_are_refused_with_a_sentence(flags, error):
    with pytest.raises(OptionsError, match=error.replace("(", r"\(").replace("]", r"\]")):
        parse_options(flags)
