"""Tags (#21): a message may carry one; a channel may take only some tags."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from actors.broker import Broker
from actors.broker.errors import BrokerError
from tests.broker.conftest import broker_options
from tests.broker.test_broker_actors import kill_worker, wait_for
from tests.broker.test_http_broker import call, stats
from tests.broker.test_zmq_broker import Collector
from transport.client import BrokerRefused, Consumer, Producer
from transport.nsq.client_codec import encode_command
from transport.protocol import commands as pc

pytestmark = pytest.mark.timeout(90)


@pytest.fixture
def broker(tmp_path) -> Iterator[Broker]:
    b = Broker(broker_options(tmp_path / "data", queue_scan_interval=0.02)).start()
    yield b
    b.stop()


def _depths(b: Broker, topic: str) -> dict[str, int]:
    return {c["channel_name"]: c["depth"] for c in b.topic_stats(topic)["channels"]}


def _tags(b: Broker, topic: str) -> dict[str, list[str]]:
    return {c["channel_name"]: list(c["tags"]) for c in b.topic_stats(topic)["channels"]}


def _publish_mixed(b: Broker, topic: str) -> None:
    b.publish(topic, [b"r1", b"r2"], tag="red")
    b.publish(topic, [b"b1"], tag="blue")
    b.publish(topic, [b"plain"])


def test_a_channel_takes_the_tags_of_its_filter_and_one_without_takes_everything(broker):
    # Given channels filtering for red, for red and blue, and none
    broker.topic_command("t", "hello")
    assert broker.channel_tags("t", "reds", ["red"], create=True) == ["red"]
    assert broker.channel_tags("t", "both", ["red", "blue"], create=True) == ["blue", "red"]
    broker.topic_command("t", "create_channel", "all")
    # When tagged and untagged messages are published
    _publish_mixed(broker, "t")
    # Then each channel's depth counts only what it will deliver
    assert _depths(broker, "t") == {"reds": 2, "both": 3, "all": 4}
    assert _tags(broker, "t") == {"reds": ["red"], "both": ["blue", "red"], "all": []}
    # and a consumer of a filtered channel receives exactly those, unchanged
    got = Collector()
    with Consumer("t", "both", got, broker.zmq_endpoint):
        wait_for(lambda: len(got.bodies) == 3, what="the channel's three messages")
    assert sorted(got.bodies) == [b"b1", b"r1", b"r2"]


def test_a_backlog_kept_by_the_topic_is_filtered_when_a_channel_appears(tmp_path):
    # Given a topic with no channel keeping tagged messages, some in memory, some on disk
    b = Broker(broker_options(tmp_path / "data", mem_queue_size=2)).start()
    try:
        b.topic_command("t", "hello")
        _publish_mixed(b, "t")
        _publish_mixed(b, "t")
        assert b.topic_stats("t")["depth"] == 8
        # When a channel filtering for blue appears
        b.channel_tags("t", "blues", ["blue"], create=True)
        # Then it takes only the blue ones; the topic has handed on everything
        wait_for(lambda: _depths(b, "t") == {"blues": 2}, what="the blue backlog")
        assert b.topic_stats("t")["depth"] == 0
    finally:
        b.stop()


def test_a_filter_is_kept_across_a_restart_and_applies_to_what_was_kept_on_disk(tmp_path):
    data = tmp_path / "data"
    b = Broker(broker_options(data)).start()
    try:
        b.topic_command("t", "hello")
        b.channel_tags("t", "reds", ["red"], create=True)
        b.topic_command("t", "pause")  # (the topic keeps what is published)
        _publish_mixed(b, "t")
    finally:
        b.stop()
    # When the broker starts again and the topic is unpaused
    b = Broker(broker_options(data)).start()
    try:
        assert b.channel_tags("t", "reds") == ["red"]
        b.topic_command("t", "unpause")
        # Then the channel takes the red messages kept through the restart, and only them
        wait_for(lambda: _depths(b, "t") == {"reds": 2}, what="the red messages")
        # and a filter set to nothing takes everything again
        assert b.channel_tags("t", "reds", []) == []
        _publish_mixed(b, "t")
        assert _depths(b, "t") == {"reds": 6}
    finally:
        b.stop()


def test_durable_publishes_no_channel_takes_are_answered_and_deferred_ones_filtered(tmp_path):
    b = Broker(broker_options(tmp_path / "data", mem_queue_size=0)).start()
    try:
        b.topic_command("t", "hello")
        b.channel_tags("t", "reds", ["red"], create=True)
        b.channel_tags("t", "blues", ["blue"], create=True)
        # When a message neither channel takes is published (answered after fsync: no
        # write is awaited for it), and a deferred red one
        b.publish("t", [b"green"], tag="green", timeout=5)
        b.publish("t", [b"later"], defer_ms=60_000, tag="red")
        # Then nothing is queued for either, and the red channel defers the red message
        stats = {c["channel_name"]: c for c in b.topic_stats("t")["channels"]}
        assert (stats["reds"]["depth"], stats["reds"]["deferred_count"]) == (0, 1)
        assert (stats["blues"]["depth"], stats["blues"]["deferred_count"]) == (0, 0)
    finally:
        b.stop()


@pytest.mark.parametrize("tag", ["has space", "a,b", "x" * 65, "é"])
def test_a_bad_tag_is_refused_with_a_sentence_and_nothing_is_published(broker, tag):
    broker.topic_command("t", "hello")
    broker.topic_command("t", "create_channel", "all")
    with pytest.raises(BrokerError) as e:
        broker.publish("t", [b"x"], tag=tag)
    assert e.value.code == "E_INVALID"
    assert "bad tag" in str(e.value)
    with pytest.raises(BrokerError) as e:
        broker.channel_tags("t", "all", [tag])
    assert e.value.code == "E_INVALID"
    assert _depths(broker, "t") == {"all": 0}
    assert _tags(broker, "t") == {"all": []}


def test_a_filter_of_a_channel_or_topic_that_does_not_exist_is_not_found(broker):
    with pytest.raises(BrokerError) as e:
        broker.channel_tags("nope", "c", ["red"])
    assert e.value.code == "E_TOPIC_NOT_FOUND"
    broker.topic_command("t", "hello")
    with pytest.raises(BrokerError) as e:
        broker.channel_tags("t", "c", ["red"])
    assert e.value.code == "E_CHANNEL_NOT_FOUND"


def test_over_http_tags_are_published_filters_set_and_stats_show_them(broker):
    # Given a topic with a channel created with a filter over HTTP, and one without
    assert call(broker, "POST", "/topic/create?topic=h")[0] == 200
    assert call(broker, "POST", "/channel/create?topic=h&channel=reds&tags=red")[0] == 200
    assert call(broker, "POST", "/channel/create?topic=h&channel=all")[0] == 200
    # When tagged messages are published by /pub and /mpub, and an untagged one
    assert call(broker, "POST", "/pub?topic=h&tag=red", b"r1")[0] == 200
    assert call(broker, "POST", "/mpub?topic=h&tag=blue", b"b1\nb2")[0] == 200
    assert call(broker, "POST", "/pub?topic=h", b"plain")[0] == 200
    # Then /stats shows each channel's depth and filter
    (topic,) = stats(broker, "&topic=h")["topics"]
    assert {c["channel_name"]: (c["depth"], c["tags"]) for c in topic["channels"]} == \
        {"reds": (1, ["red"]), "all": (4, [])}
    # and /channel/config reads and changes the filter, kept in the topic's metadata
    status, body = call(broker, "POST", "/channel/config?topic=h&channel=all&tags=blue,green")
    assert (status, json.loads(body)["tags"]) == (200, ["blue", "green"])
    assert json.loads(call(broker, "GET", "/channel/config?topic=h&channel=all")[1]) == \
        {"topic": "h", "channel": "all", "tags": ["blue", "green"]}
    with open(f"{broker.options.data_path}/h.topic.json", encoding="utf-8") as f:
        meta = json.load(f)
    assert {c: {k: v for k, v in entry.items() if k != "since"}  # (when it was created)
            for c, entry in meta["channels"].items()} == {
        "all": {"paused": False, "tags": ["blue", "green"]},
        "reds": {"paused": False, "tags": ["red"]}}
    # and an unknown channel or topic is a 404, a bad tag a 400
    assert call(broker, "GET", "/channel/config?topic=h&channel=nope") == \
        (404, b'{"message":"CHANNEL_NOT_FOUND"}')
    assert call(broker, "POST", "/channel/config?topic=none&channel=c&tags=a")[0] == 404
    assert call(broker, "POST", "/pub?topic=h&tag=a%2Cb", b"x") == \
        (400, b'{"message":"INVALID_TAG"}')


def test_over_zeromq_a_producer_publishes_tagged_messages_a_filtered_consumer_receives(broker):
    # Given a channel taking only eu messages, and a consumer on it
    broker.topic_command("z", "hello")
    broker.channel_tags("z", "eu", ["eu"], create=True)
    got = Collector()
    with Consumer("z", "eu", got, broker.zmq_endpoint) as _, Producer(broker.zmq_endpoint) as p:
        # When a producer publishes with and without tags (TPUB, TMPUB, TDPUB, PUB)
        p.publish("z", b"e1", tag="eu")
        p.publish("z", b"u1", tag="us")
        p.multi_publish("z", [b"e2", b"e3"], tag="eu")
        p.publish_batch("z", [b"e%d" % i for i in range(4, 10)], batch_size=2, tag="eu")
        p.deferred_publish("z", 10, b"e10", tag="eu")
        p.publish("z", b"plain")
        # Then the consumer receives the eu ones only
        wait_for(lambda: len(got.bodies) == 10, what="the ten eu messages")
        assert sorted(got.bodies) == sorted([b"e%d" % i for i in range(1, 11)])
        # and a bad tag is refused with a sentence (as nsqd refuses a bad PUB); the
        # producer goes on publishing
        with pytest.raises(BrokerRefused, match="TPUB bad tag"):
            p.publish("z", b"x", tag="a b")
        p.publish("z", b"e11", tag="eu")
        wait_for(lambda: len(got.bodies) == 11, what="the next eu message")


def test_an_nsq_tcp_client_cannot_send_a_tag():
    with pytest.raises(ValueError, match="NSQ TCP cannot carry a tag"):
        encode_command(pc.Pub("t", b"x", "red"))


def test_a_tagged_message_of_the_largest_size_is_kept_on_disk_by_the_topic(tmp_path):
    # Given a topic with no channel that keeps everything on disk
    data = tmp_path / "data"
    b = Broker(broker_options(data, mem_queue_size=0, max_msg_size=1000)).start()
    try:
        b.topic_command("t", "hello")
        # When the largest body is published with the longest tag (a record 66 bytes
        # over the body's limit, and NSQ's header)
        b.publish("t", [b"x" * 1000], tag="t" * 64)
        b.publish("t", [b"y" * 1000])
        # Then both are kept, and reach a channel that takes that tag, unwrapped
        b.channel_tags("t", "c", ["t" * 64], create=True)
        wait_for(lambda: _depths(b, "t") == {"c": 1}, what="the tagged message")
        got = Collector()
        with Consumer("t", "c", got, b.zmq_endpoint):
            wait_for(lambda: got.bodies == [b"x" * 1000], what="its delivery")
    finally:
        b.stop()


def test_a_bad_filter_in_metadata_is_ignored_with_a_warning_not_a_channel_starved(tmp_path):
    data = tmp_path / "data"
    b = Broker(broker_options(data)).start()
    try:
        b.topic_command("t", "hello")
        b.channel_tags("t", "c", ["red"], create=True)
    finally:
        b.stop()
    # Given metadata whose filter was damaged by hand
    path = data / "t.topic.json"
    meta = json.loads(path.read_text())
    meta["channels"]["c"]["tags"] = ["bad tag"]
    path.write_text(json.dumps(meta))
    b = Broker(broker_options(data)).start()
    try:
        # Then the channel has no filter (it takes everything), as it says
        assert b.channel_tags("t", "c") == []
        _publish_mixed(b, "t")
        assert _depths(b, "t") == {"c": 4}
    finally:
        b.stop()


def test_an_ephemeral_channel_keeps_its_filter_when_a_worker_restart_revives_it(broker):
    # Given an ephemeral channel with a filter, and a consumer on it
    broker.topic_command("e", "hello")
    broker.channel_tags("e", "reds#ephemeral", ["red"], create=True)
    got = Collector()
    with Consumer("e", "reds#ephemeral", got, broker.zmq_endpoint):
        wait_for(lambda: _depths(broker, "e") == {"reds#ephemeral": 0}, what="the channel")
        # When the worker is killed: the topic comes back from its metadata, and the
        # consumer's subscription revives the ephemeral channel
        kill_worker(broker)
        wait_for(lambda: "reds#ephemeral" in _depths(broker, "e"), timeout=20,
                 what="the channel revived")
        # Then it still takes only red
        assert broker.channel_tags("e", "reds#ephemeral") == ["red"]
        _publish_mixed(broker, "e")
        wait_for(lambda: sorted(got.bodies) == [b"r1", b"r2"], what="the red messages")
