"""The topic actor gathers the publishes of one run: driven directly (no runtime needed)."""

from __future__ import annotations

from typing import Any

import pytest

from actors.broker.messages import GATHER_MAX, ChannelPut, Publish, PublishDone, Stored
from actors.broker.topic import TopicActor
from tests.broker.conftest import broker_options

pytestmark = pytest.mark.timeout(10)


def topic(tmp_path, **options: Any) -> tuple[TopicActor, list[tuple[str, Any]]]:
    actor = TopicActor("topic:t", broker_options(tmp_path / "data", node_id=1, **options),
                       clock=lambda: 1_700_000_000_000_000_000)
    sent: list[tuple[str, Any]] = []
    actor.tell = lambda name, message: sent.append((name, message))  # type: ignore[method-assign]
    actor.tell_many = lambda name, messages: sent.extend(  # type: ignore[method-assign]
        (name, m) for m in messages)
    actor.channels = {"c1": False, "c2": False}
    return actor, sent


def test_durable_publishes_of_one_run_share_one_write_and_are_answered_when_it_is_confirmed(
        tmp_path):
    actor, sent = topic(tmp_path, mem_queue_size=0)
    # Given three publishes from two clients in one run, one of them refused
    actor.on_receive(Publish([b"1"], 0, "client:x", 1))
    actor.on_receive(Publish([b""], 0, "client:y", 1))
    actor.on_receive(Publish([b"2", b"3"], 0, "client:y", 2))
    # Then the refusal is answered at once, alone, with nsqd's error
    ((name, done),) = sent
    assert name == "client:y"
    assert done.corr == 1
    assert done.error[0] == "E_BAD_MESSAGE"
    sent.clear()
    # When the run ends, Then each channel gets one ChannelPut of all three messages
    actor.on_batch_end()
    puts = [(name, m) for name, m in sent if isinstance(m, ChannelPut)]
    assert [name for name, _ in puts] == ["channel:t/c1", "channel:t/c2"]
    assert all(len(m.messages) == 3 and m.messages[0][26:] == b"1" for _, m in puts)
    assert [m.messages[2][26:] for _, m in puts] == [b"3", b"3"]
    confirm = puts[0][1].confirm
    assert confirm is not None
    assert all(m.confirm == confirm for _, m in puts)
    assert not [m for _, m in sent if isinstance(m, PublishDone)]
    # And they are answered only when both channels confirm the write
    sent.clear()
    actor.on_receive(Stored(confirm[1]))
    assert sent == []
    actor.on_receive(Stored(confirm[1]))
    assert sorted((name, m.corr, m.error) for name, m in sent) == [
        ("client:x", 1, None), ("client:y", 2, None)]


def test_a_failed_write_fails_every_publish_that_shared_it(tmp_path):
    actor, sent = topic(tmp_path, mem_queue_size=0)
    actor.on_receive(Publish([b"1"], 0, "client:x", 1))
    actor.on_receive(Publish([b"2"], 0, "client:y", 7))
    actor.on_batch_end()
    token = next(m for _, m in sent if isinstance(m, ChannelPut)).confirm[1]
    sent.clear()
    error = ("E_PUB_FAILED", "PUB failed: disk full", False)
    actor.on_receive(Stored(token))
    actor.on_receive(Stored(token, error))
    assert sorted((name, m.corr, m.error) for name, m in sent) == [
        ("client:x", 1, error), ("client:y", 7, error)]


def test_another_message_routes_what_was_gathered_before_it(tmp_path):
    actor, sent = topic(tmp_path)  # (in memory: answered as soon as routed)
    actor.on_receive(Publish([b"1"], 0, "client:x", 1))
    assert sent == []
    # When a message that is not gathered comes next (a DPUB)
    actor.on_receive(Publish([b"2"], 5_000, "client:x", 2))
    # Then the gathered PUB was routed and answered before the DPUB was handled
    assert [(name, type(m).__name__, getattr(m, "corr", None)) for name, m in sent] == [
        ("channel:t/c1", "ChannelPut", None), ("channel:t/c2", "ChannelPut", None),
        ("client:x", "PublishDone", 1),
        ("channel:t/c1", "ChannelPutDeferred", None), ("channel:t/c2", "ChannelPutDeferred", None),
        ("client:x", "PublishDone", 2)]


def test_a_long_run_of_publishes_is_routed_in_batches_of_about_gather_max(tmp_path):
    actor, sent = topic(tmp_path)

    def sizes() -> list[int]:
        return [len(m.messages) for name, m in sent if name == "channel:t/c1"]

    # Given MPUBs of 200 arriving in one long run
    for corr in range(1, 12):
        actor.on_receive(Publish([b"m"] * 200, 0, "client:x", corr))
    # Then a fan-out went out once GATHER_MAX messages were gathered, not only at the end
    assert GATHER_MAX == 1024
    assert sizes() == [1200]
    actor.on_batch_end()
    assert sizes() == [1200, 1000]
    assert sorted(m.corr for name, m in sent if name == "client:x") == list(range(1, 12))


def test_tagged_and_untagged_publishes_of_one_run_reach_the_channels_their_tags_say(tmp_path):
    # Given a channel taking red, one taking blue and one without a filter
    actor, sent = topic(tmp_path, mem_queue_size=0)
    actor.channels = {"reds": False, "blues": False, "all": False}
    actor.filters = {"reds": frozenset({"red"}), "blues": frozenset({"blue"})}
    # When one run gathers an untagged publish, a red one and a blue one (durable)
    actor.on_receive(Publish([b"u1"], 0, "client:x", 1))
    actor.on_receive(Publish([b"r1", b"r2"], 0, "client:x", 2, "red"))
    actor.on_receive(Publish([b"b1"], 0, "client:y", 1, "blue"))
    actor.on_batch_end()
    # Then each channel gets one ChannelPut of what it takes, untagged as NSQ encodes it
    puts = {name: [m[26:] for m in msg.messages] for name, msg in sent
            if isinstance(msg, ChannelPut)}
    assert puts == {"channel:t/reds": [b"r1", b"r2"], "channel:t/blues": [b"b1"],
                    "channel:t/all": [b"u1", b"r1", b"r2", b"b1"]}
    # and the publishes are answered once the three writes are confirmed
    (confirm,) = {msg.confirm for _, msg in sent if isinstance(msg, ChannelPut)}
    sent.clear()
    for _ in range(3):
        actor.on_receive(Stored(confirm[1]))
    assert sorted((name, m.corr) for name, m in sent) == [
        ("client:x", 1), ("client:x", 2), ("client:y", 1)]
