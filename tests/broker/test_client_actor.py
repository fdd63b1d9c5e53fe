"""The client actor's own rules, driven directly with a fake clock (no runtime needed)."""

from __future__ import annotations

from typing import Any

import pytest

from actors.broker.client import PUBLISH_TIMEOUT, ClientActor, ClientPub, ClientTick
from actors.broker.messages import PublishDone
from tests.broker.conftest import broker_options

pytestmark = pytest.mark.timeout(10)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


@pytest.fixture
def client(tmp_path) -> tuple[ClientActor, Clock, list[Any]]:
    clock, sent = Clock(), []
    actor = ClientActor("client:c", broker_options(tmp_path / "data"), clock=clock)
    actor.tell = lambda name, message: sent.append((name, message))  # type: ignore[method-assign]
    actor.tell_many = lambda name, messages: sent.append((name, list(messages)))  # type: ignore[method-assign]
    return actor, clock, sent


def test_publishes_are_answered_in_request_order(client):
    actor, _, sent = client
    actor.on_receive(ClientPub("a", [b"1"], corr=b"#1"))
    actor.on_receive(ClientPub("b", [b"2"], corr=b"#2"))
    actor.on_batch_end()
    assert [name for name, _ in sent] == ["topic:a", "topic:b"]
    actor.on_receive(PublishDone(2, None))
    assert list(actor.outbox) == []  # #2 waits for #1
    actor.on_receive(PublishDone(1, None))
    assert list(actor.outbox) == [("ok", b"#1"), ("ok", b"#2")]


def test_pubs_gathered_from_one_read_are_each_answered_and_a_storage_failure_each_refused(
        client):
    actor, _, sent = client
    # Given three PUBs of one read, gathered (answers=3), between an MPUB and a PUB
    actor.on_receive(ClientPub("a", [b"m1", b"m2"], corr=b"#1"))
    actor.on_receive(ClientPub("a", [b"1", b"2", b"3"], corr=b"#2", answers=3))
    actor.on_receive(ClientPub("a", [b"4"], corr=b"#3"))
    actor.on_batch_end()
    (_, publishes), = sent
    assert [p.bodies for p in publishes] == [[b"m1", b"m2"], [b"1", b"2", b"3"], [b"4"]]
    # When all are stored, Then five answers, in order, and the topic counts six messages
    actor.on_receive(PublishDone(3, None))
    actor.on_receive(PublishDone(2, None))
    actor.on_receive(PublishDone(1, None))
    assert list(actor.outbox) == [("ok", b"#1"), ("ok", b"#2"), ("ok", b"#2"), ("ok", b"#2"),
                                  ("ok", b"#3")]
    assert actor.pub_counts == {"a": 6}
    # And when gathered PUBs fail in storage (E_PUB_FAILED is not fatal), each is refused
    actor.outbox.clear()
    actor.on_receive(ClientPub("a", [b"5", b"6"], corr=b"#4", answers=2))
    actor.on_batch_end()
    actor.on_receive(PublishDone(4, ("E_PUB_FAILED", "PUB failed: disk full", False)))
    assert [(kind, wire[0]) for kind, wire in actor.outbox] == [("error", "E_PUB_FAILED")] * 2
    assert not actor.closed


def test_the_publishes_of_one_run_reach_each_topic_as_one_envelope_before_later_commands(
        client):
    actor, _, sent = client
    # Given three publishes handled in one run of the inbox, two of them to one topic
    actor.on_receive(ClientPub("a", [b"1"], corr=b"#1"))
    actor.on_receive(ClientPub("b", [b"2"], corr=b"#2"))
    actor.on_receive(ClientPub("a", [b"3", b"4"], corr=b"#3"))
    assert sent == []  # (gathered until the run ends)
    # When the run ends, Then each topic is told its publishes in order, in one envelope
    actor.on_batch_end()
    assert [(name, [(p.bodies, p.corr) for p in ps]) for name, ps in sent] == [
        ("topic:a", [([b"1"], 1), ([b"3", b"4"], 3)]), ("topic:b", [([b"2"], 2)])]
    # And a command after a publish (here a tick) sends the publish first
    sent.clear()
    actor.on_receive(ClientPub("c", [b"5"], corr=b"#4"))
    actor.on_receive(ClientTick())
    assert [name for name, _ in sent] == ["topic:c"]


def test_a_publish_its_topic_never_answers_fails_and_closes_instead_of_blocking(client):
    actor, clock, _ = client
    actor.on_receive(ClientPub("lost", [b"1"], corr=b"#1"))
    actor.on_receive(ClientPub("lost", [b"2"], corr=b"#2"))
    clock.now += PUBLISH_TIMEOUT - 1
    actor.on_receive(ClientTick())
    assert list(actor.outbox) == []
    clock.now += 2
    actor.on_receive(ClientTick())
    (kind, (code, text, fatal)), = actor.outbox
    assert (kind, code, fatal) == ("error", "E_PUB_FAILED", True)
    assert "no answer from the topic" in text
    assert actor.closed
    actor.outbox.clear()
    actor.on_receive(PublishDone(1, None))  # the answer comes back after all: ignored
    actor.on_receive(PublishDone(2, None))
    assert list(actor.outbox) == []
