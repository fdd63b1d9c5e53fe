"""Lookup by id (#21): ``GET /message?topic=T&id=ID`` finds a message in the topic, in
each channel (queued in memory or on disk, in flight, deferred) and in the history,
without a walk of any of them."""

from __future__ import annotations

import base64
import json
import time
from pathlib import Path
from typing import Any

import pytest

from actors.broker import Broker
from actors.broker.errors import BrokerError
from actors.broker.nsq_message import record_id
from storage.chunk import iter_messages
from tests.broker.conftest import broker_options
from tests.broker.test_broker_actors import kill_worker, wait_for
from tests.broker.test_http_broker import call
from tests.broker.test_retention import dead_letter, dead_letter_broker
from transport.client import Consumer, Message

pytestmark = pytest.mark.timeout(90)


def lookup(b: Broker, topic: str, message_id: bytes | str) -> tuple[int, dict[str, Any]]:
    if isinstance(message_id, bytes):
        message_id = message_id.decode()
    status, raw = call(b, "GET", f"/message?topic={topic}&id={message_id}")
    return status, json.loads(raw)


def ids_in(path: Path) -> list[bytes]:
    """The message ids in a history directory or a queue's chunk files, in file order."""
    files = sorted(path.iterdir()) if path.is_dir() else \
        sorted(path.parent.glob(f"{path.name}.diskqueue.0*.dat"))
    return [record_id(r) for f in files if f.suffix == ".dat" for _, r in iter_messages(str(f))]


def body_of(answer: dict[str, Any]) -> bytes:
    return base64.b64decode(answer["body"])


def test_a_message_is_found_in_the_topic_then_in_each_state_of_its_channels(tmp_path):
    data = tmp_path / "data"
    b = Broker(broker_options(data, retention_bytes=10_000_000, mem_queue_size=2)).start()
    try:
        b.topic_command("t", "hello")
        # Given messages the topic holds for want of a channel: in memory, on its disk
        # queue (beyond --mem-queue-size=2) and a DPUB it keeps with its due time
        b.publish("t", [b"m0", b"m1", b"m2", b"m3"], tag="red")
        b.publish("t", [b"later"], defer_ms=600_000)
        ids = wait_for(lambda: len(got := ids_in(data / "t.history")) == 5 and got,
                       what="five in the history")
        before = time.time_ns()
        for i, body in ((0, b"m0"), (3, b"m3"), (4, b"later")):
            status, answer = lookup(b, "t", ids[i])
            assert status == 200
            assert answer["state"] == "topic"
            assert (answer["id"], body_of(answer), answer["attempts"], answer["channels"]) == (
                ids[i].decode(), body, 0, {})
            assert answer["timestamp"] < before
        assert lookup(b, "t", ids[0])[1]["tag"] == "red"
        assert lookup(b, "t", ids[4])[1]["tag"] == ""
        # When a channel takes them (and a filtered one that does not take red)
        b.topic_command("t", "create_channel", "c")
        b.channel_tags("t", "blue", ["blue"], create=True)
        wait_for(lambda: lookup(b, "t", ids[3])[1]["state"] != "topic", what="fanned out")
        # Then each is queued there (memory or disk) and the DPUB is deferred, due later
        for i in range(4):
            status, answer = lookup(b, "t", ids[i])
            assert (status, answer["state"]) == (200, "queued")
            assert answer["channels"] == {
                "blue": {"state": "not_delivered", "reason": "its tag filter"},
                "c": {"state": "queued", "attempts": 0}}
        deferred = lookup(b, "t", ids[4])[1]
        assert deferred["state"] == "deferred"
        assert deferred["channels"]["c"]["due"] > time.time_ns() + 500 * 10**9
        assert deferred["channels"]["blue"] == {"state": "not_delivered",
                                                "reason": "its tag filter"}
        # When a consumer holds m0 without finishing it: in flight, with its client
        held: list[Message] = []
        with Consumer("t", "c", held.append, b.zmq_endpoint, max_in_flight=1,
                      auto_finish=False, client_id="looker") as consumer:
            wait_for(lambda: held, what="a delivery")
            assert held[0].id == ids[0]
            answer = lookup(b, "t", ids[0])[1]
            channel = answer["channels"]["c"]
            assert (answer["state"], answer["attempts"]) == ("in_flight", 1)
            assert (channel["state"], channel["client_id"], channel["attempts"]) == (
                "in_flight", "looker", 1)
            assert channel["deadline"] > time.time_ns() + 30 * 10**9
            # and once it is requeued with a delay: deferred, with its delivery counted
            held[0].requeue(60_000)
            wait_for(lambda: lookup(b, "t", ids[0])[1]["state"] == "deferred",
                     what="requeued")
            assert lookup(b, "t", ids[0])[1]["channels"]["c"]["attempts"] == 1
            # When the next one is FINed: consumed, its record kept by retention
            wait_for(lambda: len(held) == 2, what="the next delivery")
            held[1].finish()
            wait_for(lambda: lookup(b, "t", ids[1])[1]["state"] == "consumed",
                     what="FINed")
            consumer.close()
        answer = lookup(b, "t", ids[1])[1]
        assert (answer["attempts"], body_of(answer), answer["tag"]) == (None, b"m1", "red")
        assert answer["channels"]["c"] == {"state": "consumed"}
        # A channel created now did not receive what was published before it
        b.topic_command("t", "create_channel", "new")
        assert lookup(b, "t", ids[1])[1]["channels"]["new"] == {
            "state": "not_delivered", "reason": "the channel was created after it"}
    finally:
        b.stop()


def test_without_retention_a_message_is_found_while_some_channel_holds_it(tmp_path):
    data = tmp_path / "data"
    b = Broker(broker_options(data, mem_queue_size=5)).start()
    try:
        b.topic_command("t", "hello")
        b.topic_command("t", "create_channel", "c")
        # Given 200 messages in a channel: 5 in memory, the rest in its disk queue
        b.publish("t", [b"%03d" % i for i in range(200)], tag="red")
        ids = wait_for(lambda: len(got := ids_in(data / "t:c")) == 195 and got,
                       what="195 on the channel's disk")
        # Then one on the disk is queued there, its tag not known (channels keep none)
        answer = lookup(b, "t", ids[100])[1]
        assert (answer["state"], body_of(answer), answer["tag"]) == ("queued", b"105", None)
        assert answer["channels"] == {"c": {"state": "queued", "attempts": 0}}
        # and still after a crash of the worker (its disk queue is read again)
        kill_worker(b)
        wait_for(lambda: lookup(b, "t", ids[100])[0] == 200, what="the worker back")
        assert lookup(b, "t", ids[100])[1]["state"] == "queued"
        # When every message is consumed (those on disk: the five in the worker's
        # memory went with it, as nsqd's would), there is nothing left to find
        seen: list[bytes] = []
        with Consumer("t", "c", lambda m: seen.append(m.body), b.zmq_endpoint):
            wait_for(lambda: set(seen) >= {b"%03d" % i for i in range(5, 200)},
                     what="the 195 on disk")
        wait_for(lambda: lookup(b, "t", ids[100])[0] == 404, what="gone")
        assert lookup(b, "t", ids[100])[1] == {"message": "MESSAGE_NOT_FOUND"}
    finally:
        b.stop()


def test_a_dead_letter_is_found_in_its_dead_letter_topic_under_its_own_id(tmp_path):
    b = dead_letter_broker(tmp_path, "dlq")
    try:
        dead_id = dead_letter(b, b"poison")
        # Given the dead letter: its topic no longer holds it (consumed: dead-lettered)
        original = lookup(b, "orders", dead_id)[1]
        assert (original["state"], original["channels"]) == ("consumed",
                                                             {"c": {"state": "consumed"}})
        # Then its dead-letter topic has it under the same id, queued, attempts anew
        dead = lookup(b, "orders.dead", dead_id)[1]
        assert (dead["state"], body_of(dead), dead["channels"]) == (
            "queued", b"poison", {"dlq": {"state": "queued", "attempts": 0}})
        # and, consumed there, still finds it in that topic's history
        with Consumer("orders.dead", "dlq", lambda m: None, b.zmq_endpoint):
            wait_for(lambda: lookup(b, "orders.dead", dead_id)[1]["state"] == "consumed",
                     what="the dead letter consumed")
        # and a rewind from its id replays it there
        assert b.channel_rewind("orders.dead", "dlq", message_id=dead_id.decode()) == 1
    finally:
        b.stop()


def test_a_lookup_says_what_is_wrong_with_its_question(tmp_path):
    b = Broker(broker_options(tmp_path / "data")).start()
    try:
        b.publish("t", [b"m"])
        assert lookup(b, "t", "0123456789abcdef") == (404, {"message": "MESSAGE_NOT_FOUND"})
        assert lookup(b, "nope", "0123456789abcdef") == (404, {"message": "TOPIC_NOT_FOUND"})
        assert lookup(b, "bad!name", "0123456789abcdef") == (400, {"message": "INVALID_TOPIC"})
        for bad in ("0123", "0123456789abcdeg", "0123456789abcdef0", ""):
            assert lookup(b, "t", bad) == (400, {"message": "INVALID_ARG_ID"})
        status, raw = call(b, "GET", "/message?topic=t")
        assert (status, json.loads(raw)) == (400, {"message": "MISSING_ARG_ID"})
        status, raw = call(b, "GET", "/message?id=0123456789abcdef")
        assert (status, json.loads(raw)) == (400, {"message": "MISSING_ARG_TOPIC"})
        # an id in capitals is the same id; the embedding API answers the same
        b.topic_command("t", "create_channel", "c")
        b.publish("t", [b"n"])
        held: list[Message] = []
        with Consumer("t", "c", held.append, b.zmq_endpoint, auto_finish=False):
            wait_for(lambda: held, what="a delivery")
            status, answer = lookup(b, "t", held[0].id.decode().upper())
            assert (status, answer["id"], answer["state"]) == (
                200, held[0].id.decode(), "in_flight")
            assert b.message("t", held[0].id.decode())["body"] == held[0].body
        with pytest.raises(BrokerError) as refused:
            b.message("t", "0123456789abcdef")
        assert refused.value.code == "E_MESSAGE_NOT_FOUND"
    finally:
        b.stop()
