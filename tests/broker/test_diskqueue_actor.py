"""The disk-queue actor's files: opened only when needed, let go of when idle."""

from __future__ import annotations

import os

import pytest

from actors.broker.diskqueue import DiskQueueActor, DqDefer, DqOpen, DqPut, DqUndefer
from actors.broker.options import BrokerOptions
from storage import DiskQueue

pytestmark = pytest.mark.timeout(30)

MESSAGE = b"\x00" * 26 + b"body"


def _actor(tmp_path, name: str = "diskqueue:t/c") -> DiskQueueActor:
    # queue_idle_close=0: no timers (no node here); the test closes with on_stop
    return DiskQueueActor(name, BrokerOptions(data_path=str(tmp_path), queue_idle_close=0))


def _delayed_file(tmp_path) -> str:
    return os.path.join(tmp_path, "t:c.delayed.sqlite3")


def test_a_queue_closed_cleanly_answers_its_owner_at_boot_without_opening_a_file(
        tmp_path, monkeypatch):
    # Given a channel's queue with three messages, closed cleanly, that never deferred one
    a = _actor(tmp_path)
    a.on_receive(DqPut([MESSAGE] * 3))
    a.on_stop()
    assert not os.path.exists(_delayed_file(tmp_path))  # no delayed store was ever needed

    # When a new life of the actor is asked by its restarted owner
    def refuse(*_args, **_kwargs):
        raise AssertionError("opened the queue")

    monkeypatch.setattr(DiskQueue, "__init__", refuse)
    b = _actor(tmp_path)
    b.on_start()
    # Then it answers from the files' record, opening nothing
    assert b.on_receive(DqOpen(rewind=True)) == (3, [])
    assert b.queue is None


def test_deferred_messages_keep_their_store_and_an_emptied_store_goes_away(tmp_path):
    # Given a channel that deferred a message, then closed
    a = _actor(tmp_path)
    a.on_receive(DqPut([MESSAGE]))
    entry = (123, b"0123456789abcdef", MESSAGE)
    a.on_receive(DqDefer([entry]))
    a.on_stop()
    assert os.path.exists(_delayed_file(tmp_path))
    # When a new life is asked: the store is read (its entries go back to the owner)
    b = _actor(tmp_path)
    assert b.on_receive(DqOpen(rewind=True)) == (1, [entry])
    # And once the deferred message is finished, closing removes the empty store
    b.on_receive(DqUndefer([entry[1]]))
    b.on_stop()
    assert not os.path.exists(_delayed_file(tmp_path))
    c = _actor(tmp_path)
    assert c.on_receive(DqOpen()) == (1, [])
    assert c.queue is None


def test_an_ephemeral_channel_has_no_files(tmp_path):
    a = _actor(tmp_path, "diskqueue:t/c#ephemeral")
    assert a.on_receive(DqOpen()) == (0, [])
    a.on_receive(DqPut([MESSAGE]))
    a.on_stop()
    assert os.listdir(tmp_path) == []
