"""Mailboxes, actor slots and restart intensity, in one process (no child processes)."""

from __future__ import annotations

import queue
import threading
import time
from typing import Any

import pytest
from pykka import ThreadingFuture
from pykka._envelope import Envelope

from actors.runtime import Actor, MailboxFull, RuntimeOptions
from actors.runtime.inbox import Batch, Mailbox
from actors.runtime.node import Node, NodeSpec
from actors.runtime.slot import ActorSlot, RestartIntensity
from tests.runtime.conftest import wait_until
from tests.runtime.helpers import Boom, GetLog, Recorder, Seq, Whoami


def ask(slot: ActorSlot, message: Any, timeout: float = 5.0) -> Any:
    future: ThreadingFuture[Any] = ThreadingFuture()
    slot.mailbox.put(Envelope(message, reply_to=future))
    return future.get(timeout=timeout)


def make_slot(escalated: list[str], max_restarts: int = 5) -> ActorSlot:
    slot = ActorSlot(
        "rec:unit",
        Recorder,
        100,
        intensity=RestartIntensity(max_restarts, 60.0),
        escalate=escalated.append,
    )
    slot.start()
    return slot


def stop(slot: ActorSlot) -> None:
    slot.request_stop()
    assert slot.join(5)


def test_mailbox_depth_counts_messages_not_envelopes() -> None:
    mailbox = Mailbox(10)
    mailbox.put(Envelope(Batch([1, 2, 3])))
    mailbox.put(Envelope(4))
    assert mailbox.depth == 4
    assert mailbox.get().message.messages == [1, 2, 3]
    assert mailbox.depth == 1


def test_a_full_mailbox_refuses_a_put_after_the_timeout() -> None:
    mailbox = Mailbox(2)
    mailbox.put(Envelope(Batch([1, 2])))
    started = time.monotonic()
    with pytest.raises(queue.Full):
        mailbox.put(Envelope(3), timeout=0.05)
    assert time.monotonic() - started >= 0.05


def test_forced_and_front_puts_ignore_the_bound_and_keep_their_place() -> None:
    mailbox = Mailbox(1)
    mailbox.put(Envelope("second"))
    mailbox.put_force(Envelope("third"))
    mailbox.put_front(Envelope("first"))
    assert [mailbox.get().message for _ in range(3)] == ["first", "second", "third"]


def test_restart_intensity_allows_max_restarts_per_window() -> None:
    intensity = RestartIntensity(max_restarts=2, window=10.0)
    assert intensity.allow(0.0)
    assert intensity.allow(1.0)
    assert not intensity.allow(2.0)
    assert intensity.allow(10.5)  # the restart at 0.0 left the window


def test_a_crashed_actor_is_replaced_and_gets_the_rest_of_its_batch() -> None:
    # Given an actor whose batch contains a poisonous message in the middle
    escalated: list[str] = []
    slot = make_slot(escalated)
    first_instance = ask(slot, Whoami())[2]
    slot.mailbox.put(Envelope(Batch([Seq(1), Boom(), Seq(2), Seq(3)])))
    # When it has handled everything queued behind the batch
    log = ask(slot, GetLog())
    # Then a fresh instance (empty state) handled the tail, in order
    assert log == (2, 3)
    assert ask(slot, Whoami())[2] != first_instance
    assert slot.restarts == 1
    assert slot.handled == 7  # Whoami, 4 batch messages, GetLog, Whoami
    assert escalated == []
    stop(slot)


class Gatherer(Actor):
    """Keeps what it is told until its run ends (as a topic gathers publishes)."""

    def __init__(self, name: str) -> None:
        super().__init__(name)
        self.held: list[Any] = []
        self.runs: list[list[Any]] = []

    def on_receive(self, message: Any) -> Any:
        if message == "runs":
            return list(self.runs)
        if message == "fail at the end":
            self.held.append(Boom())
            return None
        self.held.append(message)
        return None

    def on_batch_end(self) -> None:
        if any(type(m) is Boom for m in self.held):
            raise RuntimeError("boom at the end of the run")
        if self.held:
            self.runs.append(self.held)
            self.held = []


def test_on_batch_end_runs_after_each_run_of_messages_and_raising_there_is_a_crash() -> None:
    escalated: list[str] = []
    slot = ActorSlot("gather:unit", Gatherer, 100, intensity=RestartIntensity(5, 60.0),
                     escalate=escalated.append, throughput=3)
    # Given five messages and a question queued before the slot runs, with runs of three
    slot.mailbox.put(Envelope(Batch([1, 2, 3, 4, 5])))
    answer: ThreadingFuture[Any] = ThreadingFuture()
    slot.mailbox.put(Envelope("runs", reply_to=answer))
    slot.start()
    # Then the question, handled in the second run, saw the end of the first only
    assert answer.get(timeout=5) == [[1, 2, 3]]
    # And that run ended after it, holding the other two
    assert ask(slot, "runs") == [[1, 2, 3], [4, 5]]
    # When its on_batch_end raises, Then it is replaced like a crash in on_receive
    slot.mailbox.put(Envelope("fail at the end"))
    wait_until(lambda: slot.restarts == 1, what="the restart")
    assert ask(slot, "runs") == []  # (a fresh instance)
    assert escalated == []
    stop(slot)


def test_a_failing_ask_is_returned_to_the_asker_without_a_restart() -> None:
    slot = make_slot([])
    with pytest.raises(RuntimeError, match="boom"):
        ask(slot, Boom())
    assert slot.restarts == 0
    stop(slot)


def test_exceeding_the_restart_intensity_escalates() -> None:
    escalated: list[str] = []
    slot = make_slot(escalated, max_restarts=2)
    for _ in range(3):
        slot.mailbox.put(Envelope(Boom()))
    assert slot.join(5), "the slot thread ends when it escalates"
    assert escalated == ["rec:unit"]
    assert slot.restarts == 2


class Blocker(Actor):
    """Blocks on every message until the test opens the gate."""

    gate = threading.Event()

    def on_receive(self, message: Any) -> Any:
        Blocker.gate.wait(10)
        return message


def test_a_local_tell_into_a_full_mailbox_raises_mailbox_full(run_dir: str) -> None:
    # Given a node whose actor is stuck on its first message and a 3-message mailbox
    Blocker.gate.clear()
    options = RuntimeOptions(workers=1, mailbox_size=3, send_timeout=0.2)
    node = Node(NodeSpec("worker-0", run_dir, options, {"block": Blocker}))
    endpoint = node.endpoint
    try:
        endpoint.tell("block:x", 0)
        (slot,) = node._slots.values()
        deadline = time.monotonic() + 5
        while slot.mailbox.depth and time.monotonic() < deadline:
            time.sleep(0.01)
        for i in range(1, 4):
            endpoint.tell("block:x", i)
        # When one more message is told, Then the sender waits send_timeout and gets an error
        started = time.monotonic()
        with pytest.raises(MailboxFull):
            endpoint.tell("block:x", 4)
        assert 0.2 <= time.monotonic() - started < 2.0
        assert slot.mailbox.depth == 3
        # And once the actor catches up, every accepted message was handled
        Blocker.gate.set()
        assert endpoint.ask("block:x", "barrier", timeout=5) == "barrier"
        assert slot.handled == 5
    finally:
        Blocker.gate.set()
        assert node.shutdown(time.monotonic() + 5)
