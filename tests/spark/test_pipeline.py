"""Spark -> broker -> Spark through a real broker process, on the shared local[2] session."""

from __future__ import annotations

import decimal
import json
import os
import signal
import sys
import threading
import time
import urllib.request
from collections import deque
from functools import partial
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest
from pyspark.sql import functions as F

from tests.chaos.harness import BrokerProcess
from tests.spark.conftest import start_broker
from transport.client import Consumer, Delivery, Message, Producer, discover
from transport.spark import (
    PartitionPublisher,
    PublishCounters,
    TopicReader,
    _Gathered,
    _Prefetch,
    _whole_objects,
    drain_to_parquet,
    to_json,
)
from transport.zmq.codec import columns_of

pytestmark = pytest.mark.timeout(240)

SCHEMA = "id long, name string"


def _session(endpoint: str | None = None) -> Any:
    """A stand-in for a consumer's session: what a Message's FIN, REQ and TOUCH use."""
    consumer = SimpleNamespace(woken=True, io_ident=None, io_thread=None, wake=lambda: None)
    return SimpleNamespace(fins=deque(), outbox=deque(), endpoint=endpoint, consumer=consumer)


def rows_df(spark: Any, n: int, partitions: int = 4) -> Any:
    return (spark.range(0, n, numPartitions=partitions)
            .withColumn("name", F.concat(F.lit("row-"), F.col("id").cast("string"))))


def read_ids(spark: Any, path: Path) -> list[int]:
    return [r.id for r in spark.read.parquet(str(path)).select("id").collect()]


def wait_until(check: Any, timeout: float, what: str) -> None:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out waiting for {what}")
        time.sleep(0.05)  # poll interval of the condition above


def test_100k_rows_go_through_and_come_back_with_none_lost(spark, broker, tmp_path):
    n = 100_000
    counters = PublishCounters.create(spark.sparkContext)
    # publish(df): Spark's JSON writer makes the messages (the foreachPartition path,
    # Rows serialised in Python, is what the broker-kill test below drives)
    publisher = PartitionPublisher("rows100k", broker.zmq_endpoint, counters=counters)
    publisher.publish(rows_df(spark, n))
    assert counters.values() == {"published": n, "retried": 0, "bad_rows": 0}

    result = drain_to_parquet(spark, "rows100k", "parquet", broker.zmq_endpoint,
                              str(tmp_path / "out"), schema=SCHEMA, idle_timeout=3)
    assert result.rows == n
    assert result.bad == 0
    ids = read_ids(spark, tmp_path / "out")
    assert sorted(ids) == list(range(n))  # every row once: nothing failed, so no duplicates
    row = spark.read.parquet(str(tmp_path / "out")).where("id = 4242").first()
    assert row.name == "row-4242"
    channel = broker.stats("rows100k")["topics"][0]["channels"][0]
    assert channel["depth"] == 0
    assert channel["in_flight_count"] == 0


def gated_json(gate_id: int, blocked: str, resume: str, row: Any) -> bytes:
    """JSON, except that the row `gate_id` says so in file `blocked` and waits for file
    `resume` (a barrier across the Spark worker's process boundary)."""
    if row.id == gate_id:
        Path(blocked).touch()
        deadline = time.monotonic() + 120
        while not Path(resume).exists() and time.monotonic() < deadline:
            time.sleep(0.01)  # poll interval of the barrier file
    return to_json(row)


def test_publish_df_sends_rows_in_mpubs_as_the_jvm_hands_them_and_a_row_too_large_aside(
        spark, broker, tmp_path):
    n = 5000
    df = rows_df(spark, n, partitions=3).withColumn(
        "name", F.when(F.col("id") == 4242, F.lit("x" * 300)).otherwise(F.col("name")))
    counters = PublishCounters.create(spark.sparkContext)
    PartitionPublisher("sized", broker.zmq_endpoint, batch_size=333, max_message_size=200,
                       bad_rows_topic="sized.bad", counters=counters).publish(df)
    assert counters.values() == {"published": n - 1, "retried": 0, "bad_rows": 1}
    result = drain_to_parquet(spark, "sized", "out", broker.zmq_endpoint,
                              str(tmp_path / "out"), schema=SCHEMA, idle_timeout=3)
    assert (result.rows, result.bad) == (n - 1, 0)
    assert sorted(read_ids(spark, tmp_path / "out")) == [i for i in range(n) if i != 4242]
    with TopicReader(spark, "sized.bad", "check", broker.zmq_endpoint,
                     schema="error string, `row` string", idle_timeout=3,
                     batch_timeout=1) as reader:
        reports = []
        for batch in reader.batches():
            reports += batch.df.collect()
            batch.commit()
    assert len(reports) == 1
    assert "over the 200-byte message limit" in reports[0].error
    assert '"id":4242' in reports[0].row


def test_broker_killed_mid_job_the_job_retries_and_every_row_arrives(spark, tmp_path):
    n = 100_000
    broker = start_broker(tmp_path)
    blocked, resume = tmp_path / "blocked", tmp_path / "resume"
    try:
        counters = PublishCounters.create(spark.sparkContext)
        # MPUBs of 500, two in flight: a task publishes every 1,000 rows and waits for the
        # answers; a row of partition 1 holds its task until the test says go on
        publisher = PartitionPublisher(
            "killed", broker.zmq_endpoint, timeout=1.0, retry_for=90, counters=counters,
            batch_size=500, batches_in_flight=2,
            serializer=partial(gated_json, 12_500 + 700, str(blocked), str(resume)))
        failure: list[BaseException] = []

        def job() -> None:
            try:
                rows_df(spark, n, partitions=8).foreachPartition(publisher)
            except BaseException as e:  # reported to the test thread below
                failure.append(e)

        runner = threading.Thread(target=job)
        runner.start()
        # Given a job that cannot finish: one task waits at the gate
        wait_until(blocked.exists, 120, "the job to reach the gate")
        # When the broker freezes, the gated task goes on and publishes into it, and the
        # broker is then killed (kill -9 of the whole tree) and started again
        os.killpg(broker.proc.pid, signal.SIGSTOP)
        resume.touch()
        # The frozen broker answers nothing: within 3 s (3x the publisher's 1 s timeout)
        # the gated task has sent its MPUBs, had no answer, and sent them again.  This is
        # a wait for the publisher's own timeout to pass, not for an event: the MPUBs
        # never reach the frozen broker's socket (ZeroMQ queues them until its handshake
        # completes), and the publisher runs in Spark's Python worker, where no fake
        # clock can be injected.
        time.sleep(3)
        broker.kill_all()
        broker.start()
        runner.join(180)
        # Then the job completes after retries, and every row is there
        assert not runner.is_alive()
        assert not failure, failure
        stats = counters.values()
        assert stats["published"] == n, stats
        assert stats["retried"] > 0, stats

        result = drain_to_parquet(spark, "killed", "parquet", broker.zmq_endpoint,
                                  str(tmp_path / "out"), schema=SCHEMA, idle_timeout=3)
        ids = read_ids(spark, tmp_path / "out")
        assert set(ids) == set(range(n))  # none lost
        print(f"rows {n}, delivered {result.rows}, duplicates {len(ids) - n}, "
              f"retried {stats['retried']}")
    finally:
        broker.stop()


def test_broker_gone_for_good_fails_the_job_loudly(spark, tmp_path):
    broker = start_broker(tmp_path)
    broker.kill_all()
    publisher = PartitionPublisher("gone", broker.zmq_endpoint, timeout=0.3, retry_for=1)
    with pytest.raises(Exception, match="PublishError: no broker acknowledged"):
        rows_df(spark, 1000, partitions=2).foreachPartition(publisher)


def test_bad_rows_are_reported_not_swallowed(spark, broker, tmp_path):
    rows = [{"id": 1}, {"id": 2, "tags": {"a"}}, {"id": 3, "x": decimal.Decimal("NaN")},
            {"id": 4}]
    rdd = spark.sparkContext.parallelize(rows, 2)

    with pytest.raises(Exception,
                       match=r"BadRowError: row [01] of partition [01] cannot be published"):
        rdd.foreachPartition(PartitionPublisher("badrows", broker.zmq_endpoint))

    counters = PublishCounters.create(spark.sparkContext)
    rdd.foreachPartition(PartitionPublisher("badrows2", broker.zmq_endpoint,
                                            bad_rows_topic="badrows2.bad", counters=counters))
    assert counters.values() == {"published": 2, "retried": 0, "bad_rows": 2}
    with TopicReader(spark, "badrows2.bad", "check", broker.zmq_endpoint,
                     schema="partition int, `index` int, error string, `row` string",
                     idle_timeout=3, batch_timeout=1) as reader:
        reports = []
        for batch in reader.batches():
            reports += batch.df.collect()
            batch.commit()
    assert sorted((r["partition"], r["index"]) for r in reports) == [(0, 1), (1, 0)]
    assert any("set value {'a'} cannot be serialised" in r.error for r in reports)
    assert any("NaN is not a finite decimal" in r.error for r in reports)


def test_structured_streaming_sink_publishes_every_row(spark, broker, tmp_path):
    source = tmp_path / "in"
    source.mkdir()
    for f in range(3):
        (source / f"part-{f}.json").write_text(
            "\n".join(json.dumps({"id": f * 100 + i, "name": f"s{f}-{i}"}) for i in range(100)))
    counters = PublishCounters.create(spark.sparkContext)
    publisher = PartitionPublisher("stream", broker.zmq_endpoint, counters=counters)
    query = (spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1).json(str(source))
             .writeStream.foreachBatch(publisher.foreach_batch)
             .option("checkpointLocation", str(tmp_path / "checkpoint"))
             .trigger(availableNow=True).start())
    assert query.awaitTermination(120)
    assert counters.values()["published"] == 300
    drain_to_parquet(spark, "stream", "out", broker.zmq_endpoint, str(tmp_path / "out"),
                     schema=SCHEMA, idle_timeout=3)
    assert sorted(read_ids(spark, tmp_path / "out")) == sorted(
        f * 100 + i for f in range(3) for i in range(100))


def test_a_batch_not_committed_comes_back(spark, broker, tmp_path):
    with Producer(broker.zmq_endpoint) as p:
        p.publish_batch("uncommitted", [json.dumps({"id": i, "name": "x"}).encode()
                                        for i in range(50)])
    with TopicReader(spark, "uncommitted", "c", broker.zmq_endpoint, schema=SCHEMA,
                     idle_timeout=5, batch_timeout=1, metadata=True) as reader:
        first = next(reader.batches())
        assert first.rows == 50
        first_ids = {r._nsq_id for r in first.df.collect()}
        # The job "crashes" before its write committed: the reader closes without commit.
    with TopicReader(spark, "uncommitted", "c", broker.zmq_endpoint, schema=SCHEMA,
                     idle_timeout=5, batch_timeout=1, metadata=True) as reader:
        again = next(reader.batches())
        rows = again.df.collect()
        again.commit()
    assert sorted(r.id for r in rows) == list(range(50))
    assert {r._nsq_attempts for r in rows} == {2}
    assert {r._nsq_id for r in rows} == first_ids


def test_drain_keeps_messages_it_cannot_read_aside(spark, broker, tmp_path):
    bodies = [json.dumps({"id": i, "name": f"n{i}"}).encode() for i in range(20)]
    bodies += [b"not json", b"[1, 2]", json.dumps({"id": "seven", "name": "x"}).encode()]
    with Producer(broker.zmq_endpoint) as p:
        p.publish_batch("mixed", bodies)
    out = tmp_path / "out"
    result = drain_to_parquet(spark, "mixed", "c", broker.zmq_endpoint, str(out),
                              schema=SCHEMA, idle_timeout=3, batch_timeout=1)
    assert (result.rows, result.bad) == (20, 3)
    assert sorted(read_ids(spark, out)) == list(range(20))  # _bad_messages is hidden from readers
    assert not (out / "_staging").exists()  # each batch's staged lines went with it
    bad = spark.read.parquet(str(out / "_bad_messages")).collect()
    assert sorted(b.body for b in bad) == sorted(bodies[20:])
    assert {b.error.split(":")[0] for b in bad} == {"cannot decode", "does not fit the schema"}
    channel = broker.stats("mixed")["topics"][0]["channels"][0]
    assert channel["depth"] == 0
    assert channel["in_flight_count"] == 0


def test_bodies_not_one_whole_json_object_are_bad_and_line_breaks_are_fine(
        spark, broker, tmp_path):
    # Given good bodies, bodies with line breaks, and bodies that are not one whole JSON
    # object (a parser that reads a first value and ignores the rest would take some)
    good = [json.dumps({"id": i, "name": f"n{i}"}).encode() for i in range(10)]
    pretty = json.dumps({"id": 10, "name": "two\nlines"}, indent=2).encode()  # line breaks
    crlf = b'{"id": 11,\r\n "name": "crlf"}'
    bad = [b'{"id": 12}, "name": "spills"',  # a whole object, then more
           b"null", b'{"id": 13, "name": "\xff\xfe"}',  # not UTF-8
           b'{"id": 14, "name": "x"',  # cut short
           json.dumps({"id": 2**70, "name": "too big"}).encode()]
    with Producer(broker.zmq_endpoint) as p:
        p.publish_batch("lines", [*good, pretty, crlf, *bad])
    out = tmp_path / "out"
    result = drain_to_parquet(spark, "lines", "c", broker.zmq_endpoint, str(out),
                              schema=SCHEMA, idle_timeout=3, batch_timeout=1)
    # Then the readable ones are rows (line breaks and all) and the rest are bad, each
    # with its reason
    assert (result.rows, result.bad) == (12, 5)
    rows = {r.id: r.name for r in spark.read.parquet(str(out)).collect()}
    assert rows == {**{i: f"n{i}" for i in range(10)}, 10: "two\nlines", 11: "crlf"}
    reasons = {bytes(b.body): b.error
               for b in spark.read.parquet(str(out / "_bad_messages")).collect()}
    assert set(reasons) == set(bad)
    assert reasons[bad[0]].startswith("cannot decode")
    assert reasons[bad[1]] == "cannot decode: expected an object, got NoneType"
    assert reasons[bad[4]].startswith("does not fit the schema")


@pytest.mark.parametrize(("bodies", "whole"), [
    ([b'{"a": 1}', b'{"b": [1, {"c": null}]}', b" {} "], True),
    ([b'{"a": 1}', b'{"a": 1} {"b": 2}'], False),  # a whole object, then another
    ([b'{"a": 1}', b"[1]"], False),
    ([b'{"a": 1}', b'{"a": NaN}'], False),  # JSON's reader takes it; judged alone
    ([b'{"a": 1}', b'{"a":\n1}'], False),  # a line break: the line is made again
    ([b'{"a": 1}', b'{"a":\r1}'], False),
    ([b'{"a": "x', b'y"}'], False),
], ids=["objects", "two in one", "an array", "NaN", "LF", "CR", "split"])
def test_a_batch_of_whole_json_objects_is_staged_as_it_is(bodies, whole):
    assert _whole_objects(bodies) is whole


def test_a_batch_committed_or_requeued_is_no_longer_held(spark):
    # Given a reader holding two batches' deliveries
    reader = TopicReader(spark, "t", "c", "tcp://127.0.0.1:1", schema=SCHEMA,
                         dedupe_window=10)
    session = _session("tcp://b")
    messages = [Message(b"%016d" % i, json.dumps({"id": i, "name": "x"}).encode(), 0, 1,
                        session) for i in range(4)]
    deliveries = [delivery([m]) for m in messages]
    for d in deliveries:
        reader._delivered(d)
    assert len(reader._held) == 4
    # When one batch is committed and the other requeued
    first = reader._frame(reader._prepare(_Gathered(deliveries[:2])))
    second = reader._frame(reader._prepare(_Gathered(deliveries[2:])))
    first.commit()
    second.requeue()
    # Then the reader holds neither (the keeper would have touched them, and every
    # message it holds is one more object for each full garbage collection), and
    # remembers only the committed one's ids
    assert reader._held == {}
    assert [("tcp://b", b"%016d" % i) in reader._seen for i in range(4)] == \
        [True, True, False, False]
    assert (len(session.fins), len(session.outbox)) == (2, 2)


def test_an_earlier_copy_of_a_message_delivered_again_is_no_longer_held(spark):
    # Given a message delivered, then delivered again (its timeout passed) before the
    # reader gathered it
    reader = TopicReader(spark, "t", "c", "tcp://127.0.0.1:1", schema=SCHEMA,
                         batch_timeout=0.1)
    session = _session("tcp://b")
    first, again, other = (delivery([Message(b"%016d" % i, b'{"id": 1, "name": "x"}', 0,
                                             attempts, session)])
                           for i, attempts in ((1, 1), (1, 2), (2, 1)))
    for d in (first, again, other):
        reader._delivered(d)
    # When a batch is gathered, Then it has the later copy, and the reader holds only
    # what it gathered (the keeper would TOUCH the earlier copy for ever)
    assert reader._gather(1.0).deliveries == [again, other]
    assert sorted(map(id, reader._held.values())) == sorted(map(id, (again, other)))


def test_an_earlier_copy_in_a_delivery_of_several_leaves_the_rest_of_it_held(spark):
    # Given a delivery of 0, 1, 2 and a later one of 1 again (its timeout passed) and 3
    reader = TopicReader(spark, "t", "c", "tcp://127.0.0.1:1", schema=SCHEMA,
                         batch_timeout=0.1, dedupe_window=10)
    session = _session("tcp://b")

    def message(i: int, attempts: int = 1) -> Message:
        return Message(b"%016d" % i, b'{"id": %d, "name": "x"}' % i, 0, attempts, session)

    earlier, later = delivery([message(0), message(1), message(2)]), \
        delivery([message(1, 2), message(3)])
    reader._delivered(earlier)
    reader._delivered(later)
    # When a batch is gathered, Then it holds 0, 2 of the first and all of the second,
    # each once, with the later copy's attempts
    gathered = reader._gather(1.0)
    assert [int(i) for i in gathered.ids] == [0, 2, 1, 3]
    assert gathered.attempts == [1, 1, 2, 1]
    assert earlier not in gathered.deliveries
    assert later in gathered.deliveries
    assert sorted(map(id, reader._held.values())) == sorted(map(id, gathered.deliveries))
    # And committing it FINs those four (the earlier copy of 1 is not answered: the
    # broker took it back when its timeout passed)
    batch = build(reader, gathered)
    assert sorted(r.id for r in batch.df.collect()) == [0, 1, 2, 3]
    batch.commit()
    assert sorted(b"".join(session.fins)[i:i + 16] for i in range(0, 64, 16)) == \
        [b"%016d" % i for i in range(4)]
    assert reader._held == {}


def test_a_cluster_found_through_a_lookup_daemon_takes_and_gives_back_every_row(
        spark, tmp_path):
    from actors.lookupd import Lookupd, LookupdOptions
    from tests.lookupd.conftest import free_port

    # Given two brokers registered with a lookup daemon, and no endpoint known to Spark
    with Lookupd(LookupdOptions(tcp_address=f"127.0.0.1:{free_port()}",
                                http_address=f"127.0.0.1:{free_port()}",
                                broadcast_address="127.0.0.1", log_level="warn")) as lookupd:
        brokers = [BrokerProcess(tmp_path / f"b{i}", tmp_path / f"b{i}.log", extra_args=(
            "--msg-timeout", "60s", "--broadcast-address", "127.0.0.1",
            "--lookupd-tcp-address", lookupd.tcp_address)) for i in range(2)]
        try:
            for b in brokers:
                b.start()
            lookupds = [lookupd.http_address]
            wait_until(lambda: len(discover(lookupds)) == 2, 30, "both brokers")
            # When a DataFrame is published through the lookup daemon
            # (200-row batches, one at a time: each task's 1,000 rows go round-robin)
            PartitionPublisher("cluster", lookupd_http_addresses=lookupds, batch_size=200,
                               batches_in_flight=1).publish(rows_df(spark, 4000, partitions=4))
            # Then both brokers took rows, and the drain reads them all from both
            depths = [b.stats("cluster")["topics"][0]["message_count"] for b in brokers]
            assert sum(depths) == 4000
            assert min(depths) > 0, depths
            # (it stops at the 4,000th row; the idle timeout and a short message timeout
            # are only there for a failure: with idle_timeout=3 a loaded CI machine once
            # ended the drain 400 rows short)
            result = drain_to_parquet(spark, "cluster", "parquet", (), str(tmp_path / "out"),
                                      schema=SCHEMA, max_rows=4000, idle_timeout=30,
                                      msg_timeout_ms=10_000,
                                      lookupd_http_addresses=lookupds)
            assert sorted(read_ids(spark, tmp_path / "out")) == list(range(4000))
            assert result.rows == 4000
        finally:
            for b in brokers:
                b.stop()


def test_one_bad_message_in_a_batch_of_10k_costs_itself_and_names_its_field(
        spark, broker, tmp_path):
    # Given 10,000 messages of which one has a value its column cannot hold (this made
    # the batch be checked row by row through Spark: 155 s, past the message timeout,
    # and the broker delivered the batch again while it was being written)
    bodies = [json.dumps({"id": i, "d": "NaN" if i % 7 == 0 else i / 3}).encode()
              for i in range(10_000)]
    bodies[5_000] = json.dumps({"id": 5_000, "d": "oops"}).encode()
    with Producer(broker.zmq_endpoint) as p:
        p.publish_batch("one-bad", bodies)
    out = tmp_path / "out"
    # When it is drained in one batch
    result = drain_to_parquet(spark, "one-bad", "c", broker.zmq_endpoint, str(out),
                              schema="id long, d double", batch_size=10_000,
                              idle_timeout=3, batch_timeout=2)
    # Then every other row is written once, NaNs included, and the bad one says why
    assert (result.rows, result.bad) == (9_999, 1)
    ids = read_ids(spark, out)
    assert len(ids) == len(set(ids)) == 9_999
    (bad,) = spark.read.parquet(str(out / "_bad_messages")).collect()
    assert "field d: 'oops' is not a number" in bad.error
    nans = spark.read.parquet(str(out)).where("isnan(d)").count()
    assert nans == len(range(0, 10_000, 7))
    channel = broker.stats("one-bad")["topics"][0]["channels"][0]
    assert (channel["timeout_count"], channel["requeue_count"]) == (0, 0)


def test_a_batch_held_longer_than_the_message_timeout_is_kept_by_touching(spark, tmp_path,
                                                                           monkeypatch):
    # Given a broker whose messages time out after 2 s
    broker = BrokerProcess(tmp_path / "data", tmp_path / "broker.log",
                           extra_args=("--msg-timeout", "2s"))
    broker.start()
    try:
        with Producer(broker.zmq_endpoint) as p:
            p.publish_batch("slow", [json.dumps({"id": i, "name": "x"}).encode()
                                     for i in range(50)])
        with TopicReader(spark, "slow", "c", broker.zmq_endpoint, schema=SCHEMA,
                         msg_timeout_ms=2_000, idle_timeout=5, batch_timeout=1) as reader:
            batch = next(reader.batches())
            assert batch.rows == 50
            # When the batch is held until the keeper has touched each message five times
            # (it touches each quarter of the timeout: 1.5 s after the first, and so
            # past the 2 s timeout) before its commit
            touches = []
            touch = Delivery.touch
            monkeypatch.setattr(Delivery, "touch", lambda d: (touches.extend(d.ids), touch(d)))
            wait_until(lambda: len(touches) >= 5 * 50, 30, "five rounds of TOUCH")
            batch.commit()
        # Then nothing timed out and nothing came again
        wait_until(lambda: broker.stats("slow")["topics"][0]["channels"][0]["in_flight_count"]
                   == 0, 10, "the FINs")
        channel = broker.stats("slow")["topics"][0]["channels"][0]
        assert (channel["timeout_count"], channel["depth"]) == (0, 0)
    finally:
        broker.stop()


def delivery(messages: list[Message]) -> Delivery:
    """`messages` (of one session) as the consumer hands them to a reader: one delivery."""
    return Delivery.of(columns_of([(m.id, m.timestamp, m.attempts, m.body)
                                   for m in messages]), messages[0]._session)


def build(reader: TopicReader, messages: list[Message] | _Gathered) -> Any:
    """`messages` (one delivery) or a gather as the reader's next batch, made at once (no
    prefetch thread)."""
    gathered = messages if isinstance(messages, _Gathered) \
        else _Gathered([delivery(messages)])
    return reader._frame(reader._prepare(gathered))


def fins(session: Any) -> int:
    """How many ids `session` has been given to FIN."""
    return sum(len(ids) for ids in session.fins) // 16


def test_a_message_the_reader_committed_is_left_out_when_it_comes_again(spark):
    reader = TopicReader(spark, "t", "c", "tcp://127.0.0.1:1", schema=SCHEMA, dedupe_window=2)
    session = _session()

    def message(i: int) -> Message:
        return Message(b"%016d" % i, json.dumps({"id": i, "name": "x"}).encode(), 0, 1,
                       session)

    first = build(reader, [message(1), message(2)])
    first.commit()
    # a redelivery of 2 (its FIN lost with a broker) beside a new message
    again = build(reader, [message(2), message(3)])
    assert (again.rows, again.duplicates) == (1, 1)
    assert [r.id for r in again.df.collect()] == [3]
    again.commit()
    assert fins(session) == 4  # the duplicate is FINed with its batch
    # the window holds the last two committed (2 and 3): 1 would be written again
    assert build(reader, [message(1), message(3)]).duplicates == 1


def test_the_dedupe_window_remembers_at_least_its_size_and_forgets_the_oldest():
    from transport.spark import _Remembered

    window = _Remembered(1000)
    for start in range(0, 5000, 100):  # batches of 100 keys, 0 .. 4999
        window.add({"b": list(range(start, start + 100))})  # type: ignore[dict-item]
        newest = start + 100
        # every one of the last 1,000 is remembered, and none older than 1,250 back
        assert all(("b", i) in window for i in range(max(0, newest - 1000), newest))
        assert not any(("b", i) in window for i in range(0, max(0, newest - 1250)))
    assert window.isdisjoint({"b": [1], "a": [4999]})  # type: ignore[dict-item]
    assert not window.isdisjoint({"b": [1, 4999]})  # type: ignore[dict-item]
    assert not _Remembered(10)
    assert _Remembered(10).isdisjoint({"b": [1]})  # type: ignore[dict-item]


def _count_prefetches(reader: TopicReader) -> threading.Semaphore:
    """A semaphore released each time the reader's prefetch thread has made a batch."""
    prepared = threading.Semaphore(0)
    prepare_next = reader._prepare_next

    def counted() -> Any:
        try:
            return prepare_next()
        finally:
            prepared.release()
    reader._prepare_next = counted  # type: ignore[method-assign]
    return prepared


def test_the_next_batch_is_made_while_the_caller_holds_this_one_and_deduplicated_after(
        spark):
    # Given a reader (no broker: the test hands it deliveries) with batches of two, and
    # deliveries of 1, 2, a redelivery of 2 (its first copy not yet committed) and 3
    reader = TopicReader(spark, "t", "c", "tcp://127.0.0.1:1", schema=SCHEMA, batch_size=2,
                         batch_timeout=0.2, idle_timeout=None, dedupe_window=10)
    session = _session("tcp://b")

    def message(i: int) -> Message:
        return Message(b"%016d" % i, json.dumps({"id": i, "name": "x"}).encode(), 0, 1,
                       session)

    prepared = _count_prefetches(reader)
    for m in (message(1), message(2), message(2), message(3)):
        reader._delivered(delivery([m]))
    try:
        batches = reader.batches()
        first = next(batches)
        assert sorted(r.id for r in first.df.collect()) == [1, 2]
        # When the caller still holds the first batch, Then the second is made already
        assert prepared.acquire(timeout=30)
        first.commit()
        # And, asked for after the commit, it leaves out the redelivery of 2
        second = next(batches)
        assert (second.rows, second.duplicates) == (1, 1)
        assert [r.id for r in second.df.collect()] == [3]
        second.commit()
        assert fins(session) == 4  # (the duplicate FINed with its batch)
        # And a third is made of what comes next
        reader._delivered(delivery([message(4)]))
        assert prepared.acquire(timeout=30)
    finally:
        # When the reader closes, Then the batch made ready and not yielded is requeued
        reader.close()
    assert [type(c).__name__ for c in session.outbox] == ["Req"]
    assert session.outbox[0].id == b"%016d" % 4


def _observation_listeners(spark: Any) -> int:
    return sum(1 for listener in spark._jsparkSession.listenerManager().listListeners()
               if listener.getClass().getName() == "org.apache.spark.sql.ObservationListener")


def test_a_drains_dataframes_that_never_run_leave_no_query_listener_behind(spark, tmp_path):
    # Given a reader as drain_to_parquet makes it (staged JSON lines, the refused ones
    # observed during the write) and deliveries of 1, 2, a redelivery of 2 and 3
    reader = TopicReader(spark, "t", "c", "tcp://127.0.0.1:1", schema=SCHEMA, batch_size=2,
                         batch_timeout=0.2, idle_timeout=None, dedupe_window=10,
                         staging_path=str(tmp_path / "staging"))
    reader._refused_after_write = True
    session = _session("tcp://b")

    def message(i: int) -> Message:
        return Message(b"%016d" % i, json.dumps({"id": i, "name": "x"}).encode(), 0, 1,
                       session)

    before = _observation_listeners(spark)
    prepared = _count_prefetches(reader)
    for m in (message(1), message(2), message(2), message(3)):
        reader._delivered(delivery([m]))
    try:
        batches = reader.batches()
        for expected in ([1, 2], [3]):  # (the second remade without the redelivery)
            batch = next(batches)
            assert sorted(r.id for r in batch.df.collect()) == expected
            batch._settle()  # (what the drain does after its write)
            batch.commit()
        # and a third made ready, never yielded
        reader._delivered(delivery([message(4)]))
        assert prepared.acquire(timeout=30)
        assert prepared.acquire(timeout=30)
    finally:
        reader.close()
    # Then neither the remade batch's first DataFrame nor the dropped one, which never
    # ran, left its observation's listener registered with the session (the ones that
    # ran unregister theirs as the listener bus tells them the query ended)
    spark.sparkContext._jsc.sc().listenerBus().waitUntilEmpty()
    assert _observation_listeners(spark) == before


def test_a_next_batch_that_cannot_be_staged_is_requeued_and_its_error_raised(
        spark, monkeypatch):
    # Given a reader whose staging fails on its second batch (a full disk), made on the
    # prefetch thread while the first is held
    reader = TopicReader(spark, "t", "c", "tcp://127.0.0.1:1", schema=SCHEMA, batch_size=2,
                         batch_timeout=0.2, idle_timeout=None)
    session = _session("tcp://b")
    for i in range(4):
        reader._delivered(delivery([Message(
            b"%016d" % i, json.dumps({"id": i, "name": "x"}).encode(), 0, 1, session)]))
    assert reader._staging is not None
    write = reader._staging.write
    writes: list[str] = []

    def failing(name: str, blob: bytes) -> str:
        writes.append(name)
        if len(writes) == 2:
            raise OSError(28, "No space left on device")
        return write(name, blob)
    monkeypatch.setattr(reader._staging, "write", failing)
    try:
        batches = reader.batches()
        first = next(batches)
        first.commit()
        # When the next batch is asked for, Then the staging error is raised there
        with pytest.raises(OSError, match="No space left"):
            next(batches)
        # And the second batch's messages went back to the broker, nothing held
        assert [c.id for c in session.outbox] == [b"%016d" % 2, b"%016d" % 3]
    finally:
        reader.close()
    assert len(session.outbox) == 2  # (close found nothing more to requeue)


class _Arrivals:
    """A reader's queue of arrivals (each delivery's messages, or the close's sentinel)
    that says when it has handed out a given message."""

    def __init__(self, watched: bytes) -> None:
        self._queue: Any = __import__("queue").SimpleQueue()
        self.watched = watched
        self.taken = threading.Event()

    def put(self, m: Any) -> None:
        self._queue.put(m)

    def _seen(self, run: Any) -> Any:
        if self.watched in getattr(run, "ids", ()):
            self.taken.set()
        return run

    def get(self, timeout: float | None = None) -> Any:
        return self._seen(self._queue.get(timeout=timeout))

    def get_nowait(self) -> Any:
        return self._seen(self._queue.get_nowait())


def _fake_reader(spark: Any, watched: int, **options: Any) -> tuple[TopicReader, Any]:
    """A reader (no broker) with deliveries 0..3 of a fake session waiting for it."""
    reader = TopicReader(spark, "t", "c", "tcp://127.0.0.1:1", schema=SCHEMA, batch_size=2,
                         **options)
    reader._arrived = _Arrivals(b"%016d" % watched)  # type: ignore[assignment]
    session = _session("tcp://b")
    for i in range(3):
        reader._delivered(delivery([Message(
            b"%016d" % i, json.dumps({"id": i, "name": "x"}).encode(), 0, 1, session)]))
    return reader, session


def test_a_reader_closed_while_its_caller_waits_for_the_next_batch_yields_nothing_more(
        spark, tmp_path, monkeypatch):
    # Given a reader whose first batch (0, 1) was yielded and whose prefetch took 2 and
    # waits for a second message of its batch (batch_timeout 60 s)
    reader, session = _fake_reader(spark, 2, batch_timeout=60, idle_timeout=None,
                                   staging_path=str(tmp_path / "staging"))
    batches = reader.batches()
    next(batches).commit()
    assert reader._arrived.taken.wait(30)  # type: ignore[attr-defined]
    # When the caller asks for the next batch on another thread, and while it waits for
    # the prefetch the reader is closed
    waiting = threading.Event()
    result = _Prefetch.result

    def entered(self: Any) -> Any:
        waiting.set()
        return result(self)
    monkeypatch.setattr(_Prefetch, "result", entered)
    got: list[Any] = []
    asking = threading.Thread(target=lambda: got.extend(batches))
    asking.start()
    assert waiting.wait(30)
    reader.close()
    asking.join(30)
    # Then no batch comes after the close, and 2 went back to the broker
    assert not asking.is_alive()
    assert got == []
    assert [c.id for c in session.outbox] == [b"%016d" % 2]
    assert not (tmp_path / "staging").exists()  # (removed once empty: no staged file left)


def test_an_interrupt_while_waiting_for_the_next_batch_leaves_it_for_the_close(
        spark, tmp_path, monkeypatch):
    # Given a reader whose first batch was yielded and whose next one (2) is made
    reader, session = _fake_reader(spark, 2, batch_timeout=0.2, idle_timeout=None,
                                   staging_path=str(tmp_path / "staging"))
    with reader:
        batches = reader.batches()
        next(batches).commit()
        # When Ctrl-C comes while the caller waits for it
        result = _Prefetch.result

        def interrupted(self: Any) -> Any:
            result(self)
            raise KeyboardInterrupt
        monkeypatch.setattr(_Prefetch, "result", interrupted)
        with pytest.raises(KeyboardInterrupt):
            next(batches)
        monkeypatch.setattr(_Prefetch, "result", result)
    # Then the close (of the `with`) still requeues it and removes its staged file
    assert [c.id for c in session.outbox] == [b"%016d" % 2]
    assert not (tmp_path / "staging").exists()


def test_idle_timeout_counts_from_when_the_caller_asks_not_from_the_last_yield(spark):
    # Given a reader with idle_timeout 0.5 s whose first batch is held longer than that,
    # long enough for the next batch's gather to give up with nothing
    reader, session = _fake_reader(spark, 1, batch_timeout=0.2, idle_timeout=0.5)
    reader._arrived.get(timeout=1)  # (two deliveries left: the first batch takes both)
    prepared = _count_prefetches(reader)
    try:
        batches = reader.batches()
        next(batches).commit()
        assert prepared.acquire(timeout=30)  # (it came back empty after 0.5 s)
        # When a message comes, and then the caller asks for the next batch
        reader._delivered(delivery([Message(b"%016d" % 9, b'{"id": 9, "name": "x"}', 0, 1,
                                            session)]))
        # Then it is a batch (the topic was not idle for 0.5 s since the caller asked)
        assert [r.id for r in next(batches).df.collect()] == [9]
    finally:
        reader.close()


def test_closing_a_reader_wakes_a_batch_waiting_for_its_first_message(spark):
    # Given a reader that waits for ever for a first message (idle_timeout None)
    reader = TopicReader(spark, "t", "c", "tcp://127.0.0.1:1", schema=SCHEMA,
                         idle_timeout=None)
    got: list[Any] = []
    gathering = threading.Event()
    gather = reader._gather

    def entered() -> Any:
        gathering.set()
        return gather()
    reader._gather = entered  # type: ignore[method-assign]
    waiting = threading.Thread(target=lambda: got.extend(reader.batches()))
    waiting.start()
    # When it is closed from another thread while it waits
    assert gathering.wait(30)
    reader.close()
    # Then the wait ends at once with no batch (the test's timeout says otherwise)
    waiting.join()
    assert got == []


@pytest.mark.parametrize("arrow", [False, True], ids=["staged for Spark", "read by Arrow"])
def test_each_row_has_its_own_messages_id_timestamp_and_attempts_across_deliveries(
        spark, arrow):
    # Given a reader with metadata columns and two deliveries, from two brokers, of
    # messages that differ in timestamp and attempts, the second cut by the batch's end
    reader = TopicReader(spark, "t", "c", "tcp://127.0.0.1:1", schema=SCHEMA, batch_size=5,
                         batch_timeout=0.1, metadata=True)
    reader._arrow = arrow
    sessions = [_session("tcp://b0"), _session("tcp://b1")]
    for first, session in ((0, sessions[0]), (3, sessions[1])):
        reader._delivered(delivery([
            Message(b"%016d" % i, json.dumps({"id": i, "name": "x"}).encode(),
                    1_000_000 * i, i + 1, session) for i in range(first, first + 3)]))
    # When a batch is made
    batch = build(reader, reader._gather())
    # Then each row carries its own message's metadata (Arrow's table or Spark's rows)
    rows = batch._framed.table.to_pylist() if arrow else \
        [r.asDict() for r in batch.df.collect()]
    assert (batch._framed.table is not None) is arrow
    assert sorted((r["id"], r["_nsq_id"], r["_nsq_timestamp"], r["_nsq_attempts"])
                  for r in rows) == [(i, f"{i:016d}", 1_000_000 * i, i + 1) for i in range(5)]
    # And the message past the batch waits for the next one, still held
    assert [int(i) for d in reader._left for i in d.ids] == [5]
    assert sum(map(len, reader._held.values())) == 6


def test_a_delivery_larger_than_a_batch_is_split_over_the_batches_in_order(spark):
    # Given a reader of batches of 2 and one delivery of 5 messages
    reader = TopicReader(spark, "t", "c", "tcp://127.0.0.1:1", schema=SCHEMA, batch_size=2,
                         batch_timeout=0.1, idle_timeout=0.1)
    session = _session("tcp://b")
    reader._delivered(delivery([Message(b"%016d" % i, b"{}", 0, 1, session) for i in range(5)]))
    # When it gathers until nothing is left, Then each batch takes the next ones in order
    ids = [[int(i) for i in reader._gather().ids] for _ in range(4)]
    assert ids == [[0, 1], [2, 3], [4], []]


def test_two_brokers_messages_with_the_same_id_are_two_messages(spark):
    # Given two brokers on one host, which share a node id, so each issued the same id
    # in the same millisecond (CI once lost a 200-row MPUB of a drain to this: the
    # reader kept one message per id, and the other broker's was never written)
    reader = TopicReader(spark, "t", "c", "tcp://127.0.0.1:1", schema=SCHEMA,
                         batch_timeout=0.2, dedupe_window=10)
    sessions = [_session(e)
                for e in ("tcp://b0", "tcp://b1")]

    def message(session: Any, i: int) -> Message:
        return Message(b"%016d" % 7, json.dumps({"id": i, "name": "x"}).encode(), 0, 1,
                       session)

    for i, session in enumerate(sessions):
        reader._delivered(delivery([message(session, i)]))
    # When the reader gathers a batch, Then it holds both, and commits both to their brokers
    batch = build(reader, reader._gather())
    assert (batch.rows, batch.duplicates) == (2, 0)
    assert sorted(r.id for r in batch.df.collect()) == [0, 1]
    batch.commit()
    assert [len(s.fins) for s in sessions] == [1, 1]
    # And the dedupe window still knows a redelivery from the same broker
    assert build(reader, [message(sessions[1], 1)]).duplicates == 1


def test_a_local_job_whose_worker_python_lacks_the_package_runs_on_the_drivers(
        spark, broker):
    # Given workers that would run an interpreter without this package (python3 from PATH
    # outside the venv: every task failed with "No module named 'transport'")
    sc = spark.sparkContext
    before = sc.pythonExec
    sc.pythonExec = "/nonexistent/python3"
    try:
        # When a DataFrame is published, Then the job runs on this interpreter instead
        PartitionPublisher("workers", broker.zmq_endpoint).publish(rows_df(spark, 10, 1))
        assert sc.pythonExec == sys.executable
    finally:
        sc.pythonExec = before
    assert broker.stats("workers")["topics"][0]["message_count"] == 10


def test_a_bad_row_stays_out_of_a_batch_queried_for_other_columns(spark, broker):
    # Given a batch with one body whose second column does not fit the schema
    bodies = [json.dumps({"id": i, "d": i / 2}).encode() for i in range(5)]
    bodies.append(json.dumps({"id": 5, "d": "oops"}).encode())
    with Producer(broker.zmq_endpoint) as p:
        p.publish_batch("pruned", bodies)
    with TopicReader(spark, "pruned", "c", broker.zmq_endpoint, schema="id long, d double",
                     idle_timeout=5, batch_timeout=1) as reader:
        batch = next(reader.batches())
        # When only the first column is read (Spark's reader then parses only that)
        ids = sorted(r.id for r in batch.df.select("id").collect())
        batch.commit()
    # Then the bad row is still left out, and reported once
    assert (batch.rows, len(batch.bad)) == (5, 1)
    assert ids == [0, 1, 2, 3, 4]
    assert "field d: 'oops' is not a number" in batch.bad[0].error


def test_a_batch_staged_through_hadoops_file_system_and_removed_after(
        spark, broker, tmp_path, monkeypatch):
    # Given a staging path the driver does not write itself (as HDFS or S3 would be:
    # the file goes through the JVM's Hadoop file system)
    import transport.spark as ts
    monkeypatch.setattr(ts, "_local_path", lambda _path: None)
    staging = tmp_path / "staging"
    with Producer(broker.zmq_endpoint) as p:
        p.publish_batch("hadoop", [json.dumps({"id": i, "name": f"n{i}"}).encode()
                                   for i in range(30)])
    with TopicReader(spark, "hadoop", "c", broker.zmq_endpoint, schema=SCHEMA,
                     idle_timeout=5, batch_timeout=1, staging_path=f"file://{staging}") as reader:
        batches = reader.batches()
        batch = next(batches)
        # Then Spark reads the rows from there while the batch lives
        assert sorted(r.id for r in batch.df.collect()) == list(range(30))
        assert [n for n in os.listdir(staging) if not n.startswith(".")] == ["batch-1.json"]
        batch.commit()
        # and the file goes when the next batch is asked for
        assert next(batches, None) is None
        assert os.listdir(staging) == []


def test_map_keys_that_are_not_strings_come_back_through_the_python_rows(
        spark, broker, tmp_path):
    # Given rows with a map keyed by integers (JSON writes its keys as strings, which
    # Spark's JSON reader cannot turn back into integers)
    schema = "id long, m map<int,string>"
    df = spark.createDataFrame([(1, {1: "a", 2: "b"}), (2, None), (3, {})], schema)
    PartitionPublisher("int-keys", broker.zmq_endpoint).publish(df)
    out = tmp_path / "out"
    result = drain_to_parquet(spark, "int-keys", "c", broker.zmq_endpoint, str(out),
                              schema=schema, idle_timeout=3, batch_timeout=1)
    assert (result.rows, result.bad) == (3, 0)
    got = {r.id: r.m for r in spark.read.parquet(str(out)).collect()}
    assert got == {1: {1: "a", 2: "b"}, 2: None, 3: {}}
    assert not (out / "_staging").exists()


def _stream_once(spark, source, checkpoint, publisher) -> None:
    query = (spark.readStream.schema(SCHEMA).option("maxFilesPerTrigger", 1).json(str(source))
             .writeStream.foreachBatch(publisher.foreach_batch)
             .option("checkpointLocation", str(checkpoint))
             .trigger(availableNow=True).start())
    assert query.awaitTermination(120)


def test_a_replayed_streaming_epoch_is_not_published_again(spark, broker, tmp_path):
    # Given a stream of two files, one epoch each
    source = tmp_path / "in"
    source.mkdir()
    for f in range(2):
        (source / f"part-{f}.json").write_text(
            "\n".join(json.dumps({"id": f * 100 + i, "name": "r"}) for i in range(100)))
    published = {}
    for topic, marked in (("replay-marked", True), ("replay-unmarked", False)):
        checkpoint = tmp_path / topic
        publisher = PartitionPublisher(
            topic, broker.zmq_endpoint,
            epochs_path=str(checkpoint / "published") if marked else None)
        _stream_once(spark, source, checkpoint, publisher)
        # When the query restarts from a checkpoint that had not recorded its last epoch
        # (the driver died after the sink published it, before Spark's commit log)
        for name in ("1", ".1.crc"):
            if (checkpoint / "commits" / name).exists():
                (checkpoint / "commits" / name).unlink()
        _stream_once(spark, source, checkpoint, publisher)
        published[topic] = broker.stats(topic)["topics"][0]["message_count"]
    # Then Spark ran the epoch again, and only the sink without marks published it twice
    assert published == {"replay-marked": 200, "replay-unmarked": 300}


def test_publish_and_drain_with_the_brokers_auth_secret(spark, tmp_path):
    from tests.broker.test_auth import READER, WRITER, AuthServer

    authd = AuthServer()
    authd.grant("spark", WRITER, {**READER, "topic": "^orders", "channels": [".*"]})
    broker = BrokerProcess(tmp_path / "data", tmp_path / "broker.log",
                           extra_args=("--auth-http-address", authd.address))
    broker.start()
    try:
        df = rows_df(spark, 500, partitions=2)
        with pytest.raises(Exception, match="E_AUTH_FIRST"):
            PartitionPublisher("orders_spark", broker.zmq_endpoint, retry_for=1).publish(df)
        publisher = PartitionPublisher("orders_spark", broker.zmq_endpoint,
                                       client_options={"auth_secret": "spark"})
        publisher.publish(df)
        result = drain_to_parquet(spark, "orders_spark", "archive", broker.zmq_endpoint,
                                  str(tmp_path / "out"), schema=df.schema, max_rows=500,
                                  idle_timeout=5, client_options={"auth_secret": "spark"})
        assert result.rows == 500
        assert spark.read.parquet(str(tmp_path / "out")).count() == 500
        with pytest.raises(ValueError, match="unknown client option 'secret'"):
            PartitionPublisher("t", broker.zmq_endpoint, client_options={"secret": "x"})
    finally:
        broker.stop()
        authd.close()


def test_tag_column_tags_each_rows_message_on_both_publish_paths(spark, broker, tmp_path):
    # Given a topic whose channels take the eu rows, the us rows, and everything
    topic = "tagged"
    post = partial(urllib.request.urlopen, timeout=10)
    post(urllib.request.Request(f"http://127.0.0.1:{broker.http}/topic/create?topic={topic}",
                                method="POST")).read()
    for channel, tags in (("eu", "eu"), ("us", "us"), ("all", "")):
        query = f"topic={topic}&channel={channel}" + (f"&tags={tags}" if tags else "")
        post(urllib.request.Request(f"http://127.0.0.1:{broker.http}/channel/create?{query}",
                                    method="POST")).read()
    rows = [{"id": i, "region": ("eu", "us", None)[i % 3]} for i in range(300)]
    df = spark.createDataFrame(rows, "id int, region string").repartition(2)
    publisher = PartitionPublisher(topic, broker.zmq_endpoint, tag_column="region")
    # When the rows are published through Spark's JSON writer and through foreachPartition
    publisher.publish(df)
    df.foreachPartition(publisher)
    # Then each filtered channel has its region's rows, twice, and the third channel all
    depths = {c["channel_name"]: c["depth"]
              for c in broker.stats(topic)["topics"][0]["channels"]}
    assert depths == {"eu": 200, "us": 200, "all": 600}
    # and a tag_column that is not a column, or a bad tag, is refused with a sentence
    with pytest.raises(ValueError, match="tag_column 'nope' is not a column"):
        PartitionPublisher(topic, broker.zmq_endpoint, tag_column="nope").publish(df)
    bad = spark.createDataFrame([{"id": 1, "region": "a b"}], "id int, region string")
    with pytest.raises(Exception, match=r"bad tag 'a b' in column region"):
        PartitionPublisher(topic, broker.zmq_endpoint, tag_column="region").publish(bad)


def test_a_drain_from_a_time_rebuilds_a_table_from_the_topics_history(spark, broker, tmp_path):
    # Given a topic keeping its history (retention turned on now: whole from now)
    def post(path: str) -> None:
        req = urllib.request.Request(f"http://127.0.0.1:{broker.http}{path}", method="POST")
        with urllib.request.urlopen(req, timeout=10) as r:  # noqa: S310 - loopback http
            r.read()

    post("/topic/create?topic=history")
    post("/channel/create?topic=history&channel=live")  # (its consumers took them)
    post("/topic/config?topic=history&retention_bytes=100000000")
    bodies = [json.dumps({"id": i, "name": f"n{i}"}).encode() for i in range(50)]
    with Producer(broker.zmq_endpoint) as p:
        p.publish_batch("history", bodies)
    # (the id of the first, from the live channel's consumer: where the rebuild starts)
    seen: dict[bytes, bytes] = {}
    done = threading.Event()

    def take(m: Message) -> None:
        seen[m.body] = m.id
        if len(seen) == len(bodies):
            done.set()

    with Consumer("history", "live", take, broker.zmq_endpoint):
        assert done.wait(30)
    first_id = seen[bodies[0]].decode()
    # When a drain on a channel that did not exist then starts from that time
    out = tmp_path / "rebuilt"
    result = drain_to_parquet(spark, "history", "rebuild", broker.zmq_endpoint, str(out),
                              schema=SCHEMA, idle_timeout=3, batch_timeout=1, from_=first_id)
    # Then the table has every row published since
    assert (result.rewound, result.rows) == (50, 50)
    assert sorted(read_ids(spark, out)) == list(range(50))


def _zip_rereads(zip_dir: str) -> Any:
    """In a Spark task: after the publisher's first call, how many times a zip archive
    on sys.path has its directory read by each ``importlib.invalidate_caches()``."""
    import importlib
    import zipfile
    import zipimport

    from transport.spark import _zip_directories_reread_only_when_changed

    _zip_directories_reread_only_when_changed()
    archive = os.path.join(zip_dir, "mods.zip")
    with zipfile.ZipFile(archive, "w") as z:
        z.writestr("zipped_mod_a.py", "X = 1\n")
    sys.path.insert(0, archive)
    reads = []
    original = zipimport._read_directory

    def counting(path: str) -> Any:
        reads.append(path)
        return original(path)

    zipimport._read_directory = counting
    try:
        importlib.import_module("zipped_mod_a")
        counts = []
        for change in (False, False, True, False):
            if change:  # the archive changes (a larger file): read again, once
                with zipfile.ZipFile(archive, "a") as z:
                    z.writestr("zipped_mod_b.py", "Y = 2\n")
            reads.clear()
            importlib.invalidate_caches()
            counts.append(reads.count(archive))
        importlib.import_module("zipped_mod_b")  # (what was read again is seen)
    finally:
        zipimport._read_directory = original
        sys.path.remove(archive)
    yield counts


def test_a_python_worker_rereads_a_zip_on_its_path_only_when_it_changed(spark, tmp_path):
    counts = spark.sparkContext.parallelize([0], 1).mapPartitions(
        lambda _: _zip_rereads(str(tmp_path))).collect()
    assert counts == [[1, 0, 1, 0]]
