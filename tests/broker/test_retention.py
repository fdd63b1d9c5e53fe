"""Retention (#21): a topic keeps what it published in its history, trimmed by whole
chunks by age or size; off by default; set per topic over HTTP and kept across restarts."""

from __future__ import annotations

import contextlib
import json
import os
import random
import threading
import time
from pathlib import Path
from typing import Any

import pytest

from actors.broker import Broker
from storage.chunk import HEADER_SIZE, iter_messages, make_position
from storage.history import History
from tests.broker.conftest import broker_options
from tests.broker.test_broker_actors import kill_worker, wait_for
from tests.broker.test_http_broker import call
from transport.client import BrokerRefused, Consumer, Message, Producer

pytestmark = pytest.mark.timeout(90)

BODY = b"x" * 1000


def _topic(b: Broker, topic: str) -> dict[str, Any]:
    return b.topic_stats(topic)


def _history_files(data: Path, topic: str) -> list[str]:
    path = data / f"{topic}.history"
    return sorted(n for n in os.listdir(path) if n.endswith(".dat")) if path.is_dir() else []


def _publish(b: Broker, topic: str, batches: int, per_batch: int = 50) -> None:
    for i in range(batches):
        b.publish(topic, [b"%04d-%03d" % (i, j) + BODY for j in range(per_batch)])


def _config(b: Broker, query: str, method: str = "POST") -> tuple[int, dict[str, Any]]:
    status, raw = call(b, method, f"/topic/config?{query}")
    return status, json.loads(raw)


def test_retention_is_off_by_default_and_keeps_no_history(tmp_path):
    b = Broker(broker_options(tmp_path / "data")).start()
    try:
        _publish(b, "t", 3)
        stats = _topic(b, "t")
        assert (stats["retained_bytes"], stats["oldest_retained_timestamp"]) == (0, 0)
        assert _config(b, "topic=t", "GET") == (200, {
            "topic": "t", "backlog_alarm_depth": 0, "retention_time": "0s",
            "retention_bytes": 0,
            "defaults": ["backlog_alarm_depth", "retention_bytes", "retention_time"]})
        assert not (tmp_path / "data" / "t.history").exists()
    finally:
        b.stop()


def test_retention_by_size_trims_whole_chunks_and_never_what_a_channel_has_not_consumed(
        tmp_path):
    data = tmp_path / "data"
    # Given a broker keeping 200 KB of each topic's history, in 64 KiB chunks
    b = Broker(broker_options(data, retention_bytes=200_000,
                              max_bytes_per_file=65_536)).start()
    try:
        b.topic_command("t", "hello")
        b.topic_command("t", "create_channel", "slow")
        # When 1,000 messages of 1 KB (1 MB) are published
        _publish(b, "t", 20)
        # Then the history keeps the newest ones, up to the limit, in whole chunks
        stats = _topic(b, "t")
        assert stats["oldest_retained_timestamp"] > 0
        assert 65_536 < stats["retained_bytes"] <= 200_000
        assert len(_history_files(data, "t")) <= 4
        # (the chunk being written has room reserved beyond its data, at most a chunk)
        on_disk = sum((data / "t.history" / f).stat().st_size for f in _history_files(data, "t"))
        assert stats["retained_bytes"] <= on_disk <= stats["retained_bytes"] + 65_536
        # and the channel, which consumed nothing, still holds every message
        assert stats["channels"][0]["depth"] == 1000
    finally:
        b.stop()


def test_retention_by_age_set_per_topic_trims_what_is_older(tmp_path):
    data = tmp_path / "data"
    b = Broker(broker_options(data, max_bytes_per_file=1 << 20)).start()
    try:
        b.topic_command("t", "hello")
        # Given a topic keeping an hour of history (chunks of 6 minutes at most)
        assert _config(b, "topic=t&retention_time=1h")[1]["retention_time"] == "1h"
        _publish(b, "t", 5)
        kept = _topic(b, "t")
        assert kept["retained_bytes"] > 0
        assert len(_history_files(data, "t")) == 1
        # When the limit drops to 1 ms, nothing goes yet: the one chunk is being written
        status, answer = _config(b, "topic=t&retention_time=1ms")
        assert (status, answer["retention_time"], answer["defaults"]) == (
            200, "1ms", ["backlog_alarm_depth", "retention_bytes"])
        assert len(_history_files(data, "t")) == 1
        # Then the next publish starts a chunk (a chunk spans a tenth of the limit at
        # most), and the topic's timer (every second here) deletes the older one
        _publish(b, "t", 1)
        wait_for(lambda: len(_history_files(data, "t")) == 1
                 and _topic(b, "t")["oldest_retained_timestamp"]
                 > kept["oldest_retained_timestamp"], what="the older chunk deleted")
        # and what is kept stays one or two chunks as publishing goes on
        _publish(b, "t", 3)
        wait_for(lambda: len(_history_files(data, "t")) <= 2, what="the older chunks gone")
    finally:
        b.stop()


def test_topic_settings_survive_a_restart_and_off_deletes_the_history(tmp_path):
    data = tmp_path / "data"
    b = Broker(broker_options(data)).start()
    try:
        b.topic_command("t", "hello")
        assert _config(b, "topic=t&retention_bytes=1000000&retention_time=7d")[0] == 200
        _publish(b, "t", 2)
        before = _topic(b, "t")["retained_bytes"]
        assert before > 100_000
    finally:
        b.stop()
    b = Broker(broker_options(data)).start()
    try:
        assert _config(b, "topic=t", "GET")[0] == 200
        _, answer = _config(b, "topic=t", "GET")
        assert (answer["retention_time"], answer["retention_bytes"]) == ("168h", 1_000_000)
        assert _topic(b, "t")["retained_bytes"] == before
        _publish(b, "t", 1)
        assert _topic(b, "t")["retained_bytes"] > before
        # Turning retention off deletes what was kept
        _config(b, "topic=t&retention_bytes=0&retention_time=0")
        wait_for(lambda: not (data / "t.history").exists(), what="the history deleted")
        assert _topic(b, "t")["retained_bytes"] == 0
    finally:
        b.stop()


def test_bad_settings_are_refused_with_nsq_style_codes(tmp_path):
    b = Broker(broker_options(tmp_path / "data")).start()
    try:
        b.topic_command("t", "hello")
        for query, code in [("retention_time=7x", "INVALID_ARG_RETENTION_TIME"),
                            ("retention_time=-1s", "INVALID_ARG_RETENTION_TIME"),
                            ("retention_bytes=-5", "INVALID_ARG_RETENTION_BYTES"),
                            ("retention_bytes=1e9", "INVALID_ARG_RETENTION_BYTES")]:
            assert _config(b, f"topic=t&{query}") == (400, {"message": code})
        assert _config(b, "topic=nope&retention_time=1h") == (
            404, {"message": "TOPIC_NOT_FOUND"})
    finally:
        b.stop()


def test_a_durable_publish_is_answered_once_the_history_has_it(tmp_path):
    data = tmp_path / "data"
    b = Broker(broker_options(data, mem_queue_size=0, sync_every=1,
                              retention_bytes=10_000_000)).start()
    try:
        b.publish("t", [b"one"])
        assert _topic(b, "t")["retained_bytes"] > 0  # no wait: it is in before the answer
        b.publish("t", [b"two"], defer_ms=1000)
        assert _topic(b, "t")["retained_bytes"] > 0
    finally:
        b.stop()


def test_deleting_a_topic_deletes_its_history(tmp_path):
    data = tmp_path / "data"
    b = Broker(broker_options(data, retention_bytes=10_000_000)).start()
    try:
        _publish(b, "t", 1)
        wait_for((data / "t.history").is_dir, what="the history")
        b.topic_command("t", "delete")
        wait_for(lambda: not (data / "t.history").exists(), what="the history deleted")
    finally:
        b.stop()


def test_an_ephemeral_topic_keeps_no_history(tmp_path):
    data = tmp_path / "data"
    b = Broker(broker_options(data, retention_bytes=10_000_000)).start()
    try:
        b.topic_command("e#ephemeral", "hello")
        b.topic_command("e#ephemeral", "create_channel", "c")
        _publish(b, "e#ephemeral", 1)
        assert _topic(b, "e#ephemeral")["retained_bytes"] == 0
        assert not any(n.endswith(".history") for n in os.listdir(data))
    finally:
        b.stop()


def test_what_a_durable_publish_acknowledged_is_in_the_history_after_a_worker_kill(tmp_path):
    data = tmp_path / "data"
    b = Broker(broker_options(data, mem_queue_size=0, sync_every=1,
                              retention_bytes=100_000_000)).start()
    try:
        # Given 20 acknowledged durable publishes to a topic with retention
        for i in range(20):
            b.publish("t", [b"m%02d" % i])
        # When its worker is killed (kill -9: nothing flushed on the way out)
        kill_worker(b)
        # Then the history has every one, and goes on after them
        b.publish("t", [b"after"])
        wait_for(lambda: _topic(b, "t")["retained_bytes"] > 0, what="the history")
    finally:
        b.stop()
    bodies = [m[26:] for name in _history_files(data, "t")
              for _, m in iter_messages(str(data / "t.history" / name))]
    assert bodies == [b"m%02d" % i for i in range(20)] + [b"after"]


# ---------------------------------------------------------------------------
# Replay: POST /channel/rewind?topic=T&channel=C&from=X


def _rewind(b: Broker, query: str) -> tuple[int, dict[str, Any]]:
    status, raw = call(b, "POST", f"/channel/rewind?{query}")
    return status, json.loads(raw)


class Collector:
    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.ids: list[bytes] = []

    def __call__(self, m: Message) -> None:
        self.bodies.append(m.body)
        self.ids.append(m.id)


def _drain(b: Broker, topic: str, channel: str, n: int) -> list[bytes]:
    """The next `n` messages of the channel, FINed (their bodies, in delivery order)."""
    got = Collector()
    with Consumer(topic, channel, got, b.zmq_endpoint):
        wait_for(lambda: len(got.bodies) >= n, what=f"{n} messages")
    return list(got.bodies)


def test_a_rewound_channel_receives_again_what_was_published_from_a_time_or_an_id(tmp_path):
    b = Broker(broker_options(tmp_path / "data", retention_bytes=10_000_000)).start()
    try:
        b.topic_command("t", "hello")
        b.topic_command("t", "create_channel", "c")
        for i in range(5):
            b.publish("t", [b"a%d" % i])
        b.publish("t", [b"b%d" % i for i in range(5)])
        first_ms = int(_topic(b, "t")["oldest_retained_timestamp"]) // 1_000_000
        # Given a consumer that has consumed (and FINed) all ten
        assert sorted(_drain(b, "t", "c", 10)) == sorted(
            [b"a%d" % i for i in range(5)] + [b"b%d" % i for i in range(5)])
        wait_for(lambda: _topic(b, "t")["channels"][0]["depth"] == 0, what="FINed")
        # When the channel is rewound to the start (unix ms before the first message)
        status, answer = _rewind(b, f"topic=t&channel=c&from={first_ms - 1000}")
        # Then it receives all ten again, in publish order
        assert (status, answer) == (200, {"messages": 10})
        again = _drain(b, "t", "c", 10)
        assert again == [b"a%d" % i for i in range(5)] + [b"b%d" % i for i in range(5)]
        # and from a message id: that message and the ones after it
        got = Collector()
        b.publish("t", [b"c0", b"c1", b"c2"])
        with Consumer("t", "c", got, b.zmq_endpoint):
            wait_for(lambda: len(got.bodies) == 3, what="three more")
        ids = list(got.ids)
        status, answer = _rewind(b, f"topic=t&channel=c&from={ids[1].decode()}")
        assert (status, answer) == (200, {"messages": 2})
        assert _drain(b, "t", "c", 2) == [b"c1", b"c2"]
    finally:
        b.stop()


def test_rewind_errors_say_what_is_wrong(tmp_path):
    b = Broker(broker_options(tmp_path / "data")).start()
    try:
        b.topic_command("t", "hello")
        b.topic_command("t", "create_channel", "c")
        b.publish("t", [b"m"])
        # retention off: nothing retained
        assert _rewind(b, "topic=t&channel=c&from=0") == (409, {"message": "E_NOT_RETAINED"})
        assert _rewind(b, "topic=t&channel=c") == (400, {"message": "MISSING_ARG_FROM"})
        for bad in ("yesterday", "2026-11-27", "12ab", "2026-11-27T10:00:00"):
            assert _rewind(b, f"topic=t&channel=c&from={bad}") == (
                400, {"message": "INVALID_ARG_FROM"})
        assert _rewind(b, "topic=t&channel=nope&from=0") == (
            404, {"message": "CHANNEL_NOT_FOUND"})
        assert _rewind(b, "topic=nope&channel=c&from=0") == (404, {"message": "TOPIC_NOT_FOUND"})
        # retention turned on now: the history is whole from now only
        _config(b, "topic=t&retention_bytes=1000000")
        b.publish("t", [b"kept"])
        assert _rewind(b, "topic=t&channel=c&from=0") == (409, {"message": "E_NOT_RETAINED"})
        assert _rewind(b, "topic=t&channel=c&from=2030-01-01T00:00:00Z") == (
            200, {"messages": 0})
        assert _rewind(b, "topic=t&channel=c&from=00000000000000ff") == (
            409, {"message": "E_NOT_RETAINED"})
    finally:
        b.stop()


def test_a_filtered_channel_is_rewound_with_what_its_filter_takes(tmp_path):
    b = Broker(broker_options(tmp_path / "data", retention_bytes=10_000_000)).start()
    try:
        b.topic_command("t", "hello")
        assert b.channel_tags("t", "reds", ["red"], create=True) == ["red"]
        b.publish("t", [b"r1"], tag="red")
        b.publish("t", [b"b1"], tag="blue")
        b.publish("t", [b"r2", b"r3"], tag="red")
        assert sorted(_drain(b, "t", "reds", 3)) == [b"r1", b"r2", b"r3"]
        assert b.channel_rewind("t", "reds", 0) == 3
        assert _drain(b, "t", "reds", 3) == [b"r1", b"r2", b"r3"]
    finally:
        b.stop()


def test_a_rewind_kept_in_the_metadata_goes_on_after_a_restart(tmp_path):
    data = tmp_path / "data"
    b = Broker(broker_options(data, retention_bytes=10_000_000)).start()
    try:
        b.topic_command("t", "hello")
        b.topic_command("t", "create_channel", "c")
        _publish(b, "t", 4, per_batch=500)  # 2,000 messages
        end = int(_topic(b, "t")["retained_bytes"])
        assert end > 0
    finally:
        b.stop()
    # Given a rewind from the start that a crash interrupted after its first batch
    # (written into the metadata as the topic does: next position, end, queued)
    meta_path = data / "t.topic.json"
    meta = json.loads(meta_path.read_text())
    first_chunk = sorted(_history_files(data, "t"))[0]
    number = int(first_chunk[:-4])
    h = History(str(data / "t.history"), chunk_bytes=1 << 30, max_record=1 << 20,
                timestamp=lambda r: 0)
    items, after_first = h.read(make_position(number, HEADER_SIZE), 512)
    stop = h.end()
    h.close()
    assert len(items) == 512
    meta["rewinds"] = {"c": [after_first, stop, 512]}  # (as after a batch of 512)
    meta_path.write_text(json.dumps(meta))
    # When the broker starts again
    b = Broker(broker_options(data, retention_bytes=10_000_000)).start()
    try:
        # Then the rest of it is queued (the 2,000 of before, and 1,488 again), and the
        # metadata no longer holds it
        wait_for(lambda: _topic(b, "t")["channels"][0]["depth"] == 2000 + 1488,
                 what="the rest of the rewind")
        wait_for(lambda: "rewinds" not in json.loads(meta_path.read_text()),
                 what="the rewind done")
    finally:
        b.stop()


def test_a_channel_created_from_a_time_starts_with_what_was_published_since(tmp_path):
    b = Broker(broker_options(tmp_path / "data", retention_bytes=10_000_000)).start()
    try:
        b.topic_command("t", "hello")
        b.topic_command("t", "create_channel", "first")
        b.publish("t", [b"old1", b"old2"])
        # a channel created later from the start gets what was published before it
        status, raw = call(b, "POST", "/channel/create?topic=t&channel=late&from=0")
        assert (status, json.loads(raw)) == (200, {"messages": 2})
        assert _drain(b, "t", "late", 2) == [b"old1", b"old2"]
        # from=now: only what is published next (nsqd's new channel)
        assert call(b, "POST", "/channel/create?topic=t&channel=fresh&from=now") == (200, b"")
        b.publish("t", [b"new"])
        assert _drain(b, "t", "fresh", 1) == [b"new"]
        assert call(b, "POST", "/channel/create?topic=t&channel=x&from=soon")[0] == 400
    finally:
        b.stop()


def test_a_rewind_killed_halfway_completes_after_the_restart(tmp_path):
    """kill -9 of the topic's worker in the middle of a rewind: after the restart the
    channel holds every message of it (at least once), and the rewind is done."""
    data = tmp_path / "data"
    b = Broker(broker_options(data, retention_bytes=1_000_000_000, mem_queue_size=0,
                              sync_every=1)).start()
    meta_path = data / "t.topic.json"
    try:
        b.topic_command("t", "hello")
        b.topic_command("t", "create_channel", "c")
        total = 60_000
        for i in range(0, total, 5000):
            b.publish("t", [b"%06d" % n for n in range(i, i + 5000)])
        assert _topic(b, "t")["channels"][0]["depth"] == total
        # Given a rewind of all of it under way (its first batches queued)
        def rewind() -> None:
            with contextlib.suppress(OSError):  # (its worker is killed: it may time out)
                call(b, "POST", "/channel/rewind?topic=t&channel=c&from=0")

        rewinding = threading.Thread(target=rewind, daemon=True)
        rewinding.start()

        def progress() -> int:
            rewinds = json.loads(meta_path.read_text()).get("rewinds") or {}
            return rewinds["c"][2] if "c" in rewinds else -1

        wait_for(lambda: progress() > 0, what="the rewind under way")
        assert progress() < total  # (halfway, not done)
        # When the worker is killed
        kill_worker(b)
        # Then the rewind goes on to its end: the channel has every message twice (once
        # more for a batch queued just before the kill, at most)
        wait_for(lambda: "rewinds" not in json.loads(meta_path.read_text()), timeout=30,
                 what="the rewind done")
        depth = _topic(b, "t")["channels"][0]["depth"]
        assert 2 * total <= depth <= 2 * total + 4096
    finally:
        b.stop()


def test_rewind_over_zeromq_answers_how_many_and_refusals_keep_the_session(tmp_path):
    b = Broker(broker_options(tmp_path / "data", retention_bytes=10_000_000)).start()
    try:
        b.topic_command("t", "hello")
        b.topic_command("t", "create_channel", "c")
        b.publish("t", [b"x1", b"x2"])
        assert sorted(_drain(b, "t", "c", 2)) == [b"x1", b"x2"]
        with Producer(b.zmq_endpoint) as p:
            assert p.rewind("t", "c", 0) == 2
            assert p.rewind("t", "c", "2030-01-01T00:00:00+00:00") == 0
            with pytest.raises(BrokerRefused, match="E_NOT_RETAINED"):
                p.rewind("t", "c", "00000000000000ff")
            p.publish("t", b"x3")  # (the refusal was not fatal: publishing goes on)
        assert _drain(b, "t", "c", 3) == [b"x1", b"x2", b"x3"]
    finally:
        b.stop()


def dead_letter_broker(tmp_path: Path, *dead_channels: str) -> Broker:
    """A broker keeping history, whose messages go to the dead-letter topic after one
    delivery (max_attempts 1): topic ``orders`` with channel ``c``, and ``orders.dead``
    with `dead_channels`."""
    b = Broker(broker_options(tmp_path / "data", retention_bytes=10_000_000,
                              max_attempts=1)).start()
    b.topic_command("orders", "hello")
    b.topic_command("orders", "create_channel", "c")
    b.topic_command("orders.dead", "hello")
    for channel in dead_channels:
        b.topic_command("orders.dead", "create_channel", channel)
    return b


def dead_letter(b: Broker, body: bytes) -> bytes:
    """Publish `body` to ``orders`` and refuse it (REQ) until it is a dead letter; its id."""
    b.publish("orders", [body])
    refused: list[bytes] = []

    def refuse(m: Message) -> None:
        refused.append(m.id)
        m.requeue(0)  # (max_attempts 1: its next delivery would be the second)

    before = _topic(b, "orders.dead")["message_count"]
    with Consumer("orders", "c", refuse, b.zmq_endpoint):
        wait_for(lambda: _topic(b, "orders.dead")["message_count"] == before + 1,
                 what="the dead letter")
    return refused[0]


def test_a_dead_letter_enters_its_topics_history_at_the_time_it_comes(tmp_path):
    b = dead_letter_broker(tmp_path)
    try:
        started = time.time_ns()
        dead_letter(b, b"poison")
        published = _topic(b, "orders")["oldest_retained_timestamp"]
        assert published >= started
        # its history keeps it in the order it came, not at its first publish's time
        wait_for(lambda: _topic(b, "orders.dead")["oldest_retained_timestamp"] > published,
                 what="the dead letter in its topic's history")
    finally:
        b.stop()


def test_a_first_channel_created_from_x_does_not_also_take_what_the_topic_held(tmp_path):
    b = Broker(broker_options(tmp_path / "data", retention_bytes=10_000_000,
                              mem_queue_size=2)).start()
    try:
        # Given a topic without channels holding 5 messages (memory and disk)
        b.topic_command("t", "hello")
        b.publish("t", [b"h%d" % i for i in range(5)])
        assert _topic(b, "t")["depth"] == 5
        # When its first channel is created from the start, filtered
        status, raw = call(b, "POST", "/channel/create?topic=t&channel=c&from=0&tags=")
        # Then it receives each message once, from the history; the topic holds nothing
        assert (status, json.loads(raw)) == (200, {"messages": 5})
        assert _drain(b, "t", "c", 5) == [b"h%d" % i for i in range(5)]
        wait_for(lambda: _topic(b, "t")["depth"] == 0, what="nothing held")
        assert _topic(b, "t")["channels"][0]["depth"] == 0
        # and over ZeroMQ, on a topic that has a channel: the new one starts from there
        b.publish("t", [b"later"])
        with Producer(b.zmq_endpoint) as p:
            assert p.rewind("t", "fresh", 0) == 6
        assert _drain(b, "t", "fresh", 6) == [b"h%d" % i for i in range(5)] + [b"later"]
    finally:
        b.stop()


@pytest.mark.parametrize("seed", range(6))
def test_publish_consume_and_rewind_against_a_model(tmp_path, seed):
    """Random runs of publishes, consumption (every message FINed) and rewinds by time or
    by message id: each rewind queues exactly the history from its point on, and each
    consumption receives exactly what the model says is queued, no more, no less."""
    rng = random.Random(seed)
    b = Broker(broker_options(tmp_path / "data", retention_bytes=100_000_000,
                              mem_queue_size=rng.choice([0, 7, 10_000]))).start()
    try:
        b.topic_command("t", "hello")
        b.topic_command("t", "create_channel", "c")
        published: list[bytes] = []  # bodies, in publish order
        ids: dict[bytes, bytes] = {}  # body -> its id (once a consumer has seen it)
        queued: list[bytes] = []  # what the channel holds, by the model
        for step in range(24):
            op = rng.choice(["publish", "publish", "consume", "rewind"])
            if op == "publish":
                bodies = [b"s%d-%d" % (step, i) for i in range(rng.randint(1, 30))]
                b.publish("t", bodies)
                published += bodies
                queued += bodies
            elif op == "consume":
                got, n = Collector(), len(queued)
                with Consumer("t", "c", got, b.zmq_endpoint):
                    wait_for(lambda got=got, n=n: len(got.bodies) >= n, what=f"{n} messages")
                    wait_for(lambda: _topic(b, "t")["channels"][0]["in_flight_count"] == 0,
                             what="all FINed")
                assert sorted(got.bodies) == sorted(queued)
                ids.update((body, i) for body, i in zip(got.bodies, got.ids, strict=True)
                           if body not in ids)
                queued = []
            elif published:
                k = rng.randrange(len(published))
                if published[k] in ids and rng.random() < 0.7:  # by id, else from the start
                    start = ids[published[k]].decode()
                else:
                    start, k = "0", 0
                status, answer = _rewind(b, f"topic=t&channel=c&from={start}")
                assert (status, answer) == (200, {"messages": len(published) - k})
                queued += published[k:]
        assert _topic(b, "t")["channels"][0]["depth"] == len(queued)
    finally:
        b.stop()
