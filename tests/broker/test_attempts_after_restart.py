"""A message delivered and not FINed before the broker died counts that delivery (#16)."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import pytest

from tests.broker.test_broker_actors import wait_for
from tests.chaos.harness import BrokerProcess
from transport.client import Consumer, Message, Producer

pytestmark = pytest.mark.timeout(120)


def _read_mark_written(data: Path) -> bool:
    """The channel's disk queue has recorded reads past its floor (what the restart uses)."""
    for meta in data.rglob("*meta.dat"):
        try:
            m = json.loads(meta.read_bytes())
        except (OSError, ValueError):
            continue
        if m.get("read", 0) > m.get("cursor", 0):
            return True
    return False


def _take(broker: BrokerProcess, n: int, publish: list[bytes] = ()) -> tuple[Consumer, list]:
    """Subscribe (then publish `publish`) and take `n` messages without FINing them."""
    got: list[Message] = []
    enough = threading.Event()

    def held(m: Message) -> None:
        got.append(m)
        if len(got) >= n:
            enough.set()

    consumer = Consumer("again", "c", held, [broker.zmq_endpoint], auto_finish=False,
                        max_in_flight=100)
    consumer.start()
    if publish:
        wait_for(lambda: any(c["channel_name"] == "c"
                          for t in broker.stats("again")["topics"] or []
                          for c in t["channels"] or []), 30, "the subscription")
        with Producer(broker.zmq_endpoint) as p:
            p.publish_batch("again", list(publish))
    assert enough.wait(30), f"got {len(got)} of {n}"
    return consumer, got


def test_a_message_in_flight_when_the_broker_is_killed_comes_back_as_attempt_2(tmp_path):
    # Given a broker whose messages all go through the disk (the harness: mem-queue 0),
    # a message timeout far longer than the test (no timeout can count an attempt), and
    # three messages delivered to a consumer that never FINs them
    args = ("--msg-timeout", "10m", "--sync-timeout", "100ms")
    broker = BrokerProcess(tmp_path / "data", tmp_path / "broker.log", args)
    broker.start()
    try:
        consumer, first = _take(broker, 3, [b"one", b"two", b"three"])
        assert [m.attempts for m in first] == [1, 1, 1]
        # (the channel's queue has written down how far it read: the barrier for the kill)
        wait_for(lambda: _read_mark_written(tmp_path / "data"), 30, "the read mark")
        consumer.close()
        # When the whole broker is killed and started again
        broker.kill_all()
        broker.start()
        # Then the three come again, each showing the delivery before the kill
        consumer, again = _take(broker, 3)
        consumer.close()
        assert sorted(m.body for m in again) == [b"one", b"three", b"two"]
        assert [m.attempts for m in again] == [2, 2, 2]
    finally:
        broker.stop()
