"""The backlog alarm (#20, EQueue's): a channel whose depth reaches --backlog-alarm-depth
(or its topic's own setting, POST /topic/config) says so in /stats and /metrics, logs,
and POSTs each firing and clearing to --backlog-alarm-webhook."""

from __future__ import annotations

import json

import pytest

from actors.broker import Broker
from actors.broker.options import OptionsError, parse_options
from tests.broker.conftest import broker_options
from tests.broker.test_broker_actors import wait_for
from tests.broker.test_http_broker import call, error_of, stats
from tests.transport.http.test_webhook import Receiver

pytestmark = pytest.mark.timeout(90)


def _channel(broker: Broker, topic: str) -> dict:
    (t,) = stats(broker, f"&topic={topic}")["topics"]
    (c,) = t["channels"]
    return c


def _metric(broker: Broker, topic: str, channel: str) -> str:
    _, raw = call(broker, "GET", "/metrics")
    prefix = f'nsq_channel_backlog_alarm{{topic="{topic}",channel="{channel}"}} '
    (line,) = [x for x in raw.decode().splitlines() if x.startswith(prefix)]
    return line.removeprefix(prefix)


def test_the_alarm_fires_at_the_depth_clears_below_it_and_tells_the_webhook(tmp_path):
    hook = Receiver([500])  # the first POST fails: the broker tries it again
    try:
        with Broker(broker_options(tmp_path / "data", workers=2, backlog_alarm_depth=3,
                                   backlog_alarm_webhook=hook.url)) as b:
            assert call(b, "POST", "/topic/create?topic=orders")[0] == 200
            assert call(b, "POST", "/channel/create?topic=orders&channel=audit")[0] == 200
            b.publish("orders", [b"1", b"2"])
            wait_for(lambda: _channel(b, "orders")["depth"] == 2, what="depth 2")
            assert _channel(b, "orders")["backlog_alarm"] is False
            assert _metric(b, "orders", "audit") == "0"
            # When the depth reaches the threshold
            b.publish("orders", [b"3"])
            wait_for(lambda: _channel(b, "orders")["backlog_alarm"], what="the alarm")
            assert _channel(b, "orders")["backlog_alarm_depth"] == 3
            assert _metric(b, "orders", "audit") == "1"
            hook.wait(lambda: len(hook.accepted) == 1, "the firing event")
            fired = hook.accepted[0]
            assert {k: fired[k] for k in ("topic", "channel", "depth", "threshold", "alarm")} \
                == {"topic": "orders", "channel": "audit", "depth": 3, "threshold": 3,
                    "alarm": True}
            assert isinstance(fired["ts"], int)
            # Then more messages do not fire it again; emptying the channel clears it
            b.publish("orders", [b"4"])
            assert call(b, "POST", "/channel/empty?topic=orders&channel=audit")[0] == 200
            wait_for(lambda: not _channel(b, "orders")["backlog_alarm"], what="cleared")
            hook.wait(lambda: len(hook.accepted) == 2, "the clearing event")
            cleared = hook.accepted[1]
            assert (cleared["alarm"], cleared["depth"], cleared["threshold"]) == (False, 0, 3)
            assert hook.tries == 3
    finally:
        hook.server.shutdown()


def test_a_topic_has_its_own_threshold_kept_across_restarts(tmp_path):
    data = tmp_path / "data"
    with Broker(broker_options(data, backlog_alarm_depth=2)) as b:
        assert call(b, "POST", "/topic/create?topic=t")[0] == 200
        assert call(b, "POST", "/channel/create?topic=t&channel=c")[0] == 200
        status, raw = call(b, "GET", "/topic/config?topic=t")
        assert (status, json.loads(raw)) == (
            200, {"topic": "t", "backlog_alarm_depth": 2, "retention_time": "0s",
                  "retention_bytes": 0, "defaults": ["backlog_alarm_depth", "retention_bytes",
                                                     "retention_time"]})
        b.publish("t", [b"1", b"2"])
        wait_for(lambda: _channel(b, "t")["backlog_alarm"], what="the alarm at 2")
        # a higher threshold for this topic clears it at once
        status, raw = call(b, "POST", "/topic/config?topic=t&backlog_alarm_depth=5")
        assert (status, json.loads(raw)["backlog_alarm_depth"]) == (200, 5)
        wait_for(lambda: not _channel(b, "t")["backlog_alarm"], what="cleared at 5")
    with Broker(broker_options(data, backlog_alarm_depth=2)) as b:
        status, raw = call(b, "GET", "/topic/config?topic=t")
        assert json.loads(raw) == {"topic": "t", "backlog_alarm_depth": 5, "retention_time": "0s",
                                   "retention_bytes": 0,
                                   "defaults": ["retention_bytes", "retention_time"]}
        wait_for(lambda: _channel(b, "t")["backlog_alarm_depth"] == 5, what="restored")
        assert _channel(b, "t")["backlog_alarm"] is False
        # 0 turns it off for this topic; "default" goes back to the flag
        assert call(b, "POST", "/topic/config?topic=t&backlog_alarm_depth=0")[0] == 200
        status, raw = call(b, "POST", "/topic/config?topic=t&backlog_alarm_depth=default")
        assert json.loads(raw) == {"topic": "t", "backlog_alarm_depth": 2, "retention_time": "0s",
                  "retention_bytes": 0, "defaults": ["backlog_alarm_depth", "retention_bytes",
                                                     "retention_time"]}
        wait_for(lambda: _channel(b, "t")["backlog_alarm"], what="the alarm at 2 again")
        # bad requests get nsqd-style answers and change nothing
        for path, answer in [
            ("/topic/config?topic=nope", (404, "TOPIC_NOT_FOUND")),
            ("/topic/config?topic=bad!name", (400, "INVALID_TOPIC")),
            ("/topic/config", (400, "MISSING_ARG_TOPIC")),
        ]:
            status, raw = call(b, "GET", path)
            assert (status, error_of(raw)) == answer, path
        for query, answer in [
            ("&backlog_alarm_depth=-1", (400, "INVALID_ARG_BACKLOG_ALARM_DEPTH")),
            ("&backlog_alarm_depth=lots", (400, "INVALID_ARG_BACKLOG_ALARM_DEPTH")),
            ("", (400, "MISSING_ARG_SETTING")),
        ]:
            status, raw = call(b, "POST", f"/topic/config?topic=t{query}")
            assert (status, error_of(raw)) == answer, query
        assert _channel(b, "t")["backlog_alarm_depth"] == 2


@pytest.mark.parametrize(("flags", "error"), [
    (["--backlog-alarm-depth=-1"], "backlog_alarm_depth: must be >= 0"),
    (["--backlog-alarm-webhook=ftp://x"], "must be an http:// or https:// URL"),
])
def test_bad_alarm_flags_are_refused_with_a_sentence(flags, error):
    with pytest.raises(OptionsError, match=error):
        parse_options(flags)
