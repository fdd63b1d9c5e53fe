"""The disk-queue actor's files: opened only when needed, let go of when idle."""

from __future__ import annotations

import os

import pytest
from pykka._envelope import Envelope

from actors.broker.diskqueue import (
    DiskQueueActor,
    DqDefer,
    DqIdle,
    DqOpen,
    DqPut,
    DqRead,
    DqStats,
    DqUndefer,
)
from actors.broker.messages import Stored
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


def _idle_closing_actor(tmp_path, monkeypatch) -> DiskQueueActor:
    a = DiskQueueActor("diskqueue:t/c", BrokerOptions(data_path=str(tmp_path)))
    monkeypatch.setattr(a, "tell_later", lambda *_args: None)  # no node: no timers
    monkeypatch.setattr(a, "blocking", lambda f, *args: f(*args))  # nor an I/O pool
    return a


def test_a_queue_recovered_only_to_answer_its_owner_lets_go_without_an_fsync(
        tmp_path, monkeypatch):
    # Given a channel's queue written and never closed (its broker killed -9)
    q = DiskQueue("t:c", tmp_path, ack_mode=True)
    q.put_many([MESSAGE] * 3)
    # When a new life of its actor is asked by its restarted owner
    syncs: list[int] = []
    a = _idle_closing_actor(tmp_path, monkeypatch)
    with monkeypatch.context() as m:
        for name in ("fsync", "fdatasync"):
            m.setattr(os, name, syncs.append)
        answer = a.on_receive(DqOpen(rewind=True))
    # Then it answers from a scan of the files and lets go of them at once, with no
    # fsync and so no record of a clean close: the next life scans them again
    assert answer == (3, [])
    assert a.queue is None
    assert syncs == []
    assert DiskQueue.closed_depth("t:c", tmp_path) is None
    assert _idle_closing_actor(tmp_path, monkeypatch).on_receive(DqOpen()) == (3, [])


@pytest.mark.parametrize("behind", [DqOpen(), DqIdle(), DqStats()],
                         ids=lambda m: type(m).__name__)
def test_a_durable_write_is_confirmed_when_a_message_answered_early_is_queued_behind_it(
        tmp_path, behind):
    # Given a disk queue doing group commit (--sync-every=1)
    a = DiskQueueActor("diskqueue:t", BrokerOptions(data_path=str(tmp_path), sync_every=1,
                                                    mem_queue_size=0, queue_idle_close=0))
    told: list[tuple[str, object]] = []
    a.tell = lambda name, msg: told.append((name, msg))  # type: ignore[method-assign]
    # When a publish's write arrives with another message already queued behind it
    a.actor_inbox.put(Envelope(behind))
    a.on_receive(DqPut([MESSAGE], (("topic:t", 1),)))
    assert told == []  # the fsync waits for what is queued behind
    a.on_receive(a.actor_inbox.get().message)
    # Then handling that message, and nothing after it, confirms the write
    assert ("topic:t", Stored(1)) in told
    a.on_stop()


def test_a_queue_never_created_answers_its_owner_without_creating_a_file(tmp_path):
    # A topic whose channels took every message has no queue files; each boot asks
    a = _actor(tmp_path, "diskqueue:t")
    assert a.on_receive(DqOpen()) == (0, [])
    assert a.queue is None
    assert os.listdir(tmp_path) == []


def test_a_queue_whose_fsync_failed_refuses_publishes_and_reports_itself_to_ping(
        tmp_path, monkeypatch):
    import errno

    from actors.broker import health
    from actors.broker.messages import Alive
    from actors.broker.scanner import ScannerActor
    from storage import chunk as chunk_mod

    monkeypatch.setattr(health, "_failed_queues", {})
    # Given a durable queue (group commit) on a disk that fails fdatasync with EIO
    options = BrokerOptions(data_path=str(tmp_path), sync_every=1, mem_queue_size=0,
                            queue_idle_close=0)
    a = DiskQueueActor("diskqueue:t", options)
    told: list[tuple[str, object]] = []
    a.tell = lambda name, msg: told.append((name, msg))  # type: ignore[method-assign]
    a.on_receive(DqPut([MESSAGE], (("topic:t", 1),)))
    assert told == [("topic:t", Stored(1))]

    def eio(_fd: int) -> None:
        raise OSError(errno.EIO, "Input/output error")

    monkeypatch.setattr(chunk_mod.os, "fdatasync", eio)
    # When a publish is written and its fsync fails
    told.clear()
    a.on_receive(DqPut([MESSAGE], (("topic:t", 2),)))
    # Then it is refused, and so is every later one, even once the disk answers again
    ((_, refused),) = [m for m in told if isinstance(m[1], Stored)]
    assert refused.token == 2
    assert refused.error[0] == "E_PUB_FAILED"
    assert refused.error[1].startswith("PUB failed: disk failed, the queue takes no writes")
    assert "Input/output error" in refused.error[1]
    failed = health._failed_queues
    monkeypatch.undo()  # the disk works again
    monkeypatch.setattr(health, "_failed_queues", failed)
    assert list(failed) == ["t"]
    told.clear()
    a.on_receive(DqPut([MESSAGE], (("topic:t", 3),)))
    assert [m.error[0] for _, m in told if isinstance(m, Stored)] == ["E_PUB_FAILED"]
    # And its worker's scanner reports it to /ping for the process's life, a new life
    # of the actor (reopening the files) included
    scanner = ScannerActor("scanner:0", options)
    assert "Input/output error" in scanner.on_receive(Alive())[0]["t"]
    a.on_stop()
    b = DiskQueueActor("diskqueue:t", options)
    b.tell = lambda name, msg: told.append((name, msg))  # type: ignore[method-assign]
    told.clear()
    b.on_receive(DqPut([MESSAGE], (("topic:t", 4),)))
    assert [m.error[0] for _, m in told if isinstance(m, Stored)] == ["E_PUB_FAILED"]
    b.on_stop()


def test_a_run_of_failed_writes_is_logged_once_when_it_starts_and_once_when_it_ends(
        tmp_path, monkeypatch, caplog):
    from storage import DiskFullError

    a = _actor(tmp_path)
    a.tell = lambda name, msg: None  # type: ignore[method-assign]
    real = DiskQueue.put_many

    def full(self: DiskQueue, messages: object) -> None:
        raise DiskFullError(28, "no space left")

    monkeypatch.setattr(DiskQueue, "put_many", full)
    with caplog.at_level("WARNING", logger="actors.broker.diskqueue"):
        for _ in range(3):
            a.on_receive(DqPut([MESSAGE], (("topic:t", 1),)))
        monkeypatch.setattr(DiskQueue, "put_many", real)
        a.on_receive(DqPut([MESSAGE], (("topic:t", 2),)))
    lines = [r.getMessage() for r in caplog.records]
    assert len(lines) == 2
    assert "write failed" in lines[0]
    assert "succeed again, after 3 failed" in lines[1]
    a.on_stop()


def test_a_publish_refused_by_a_full_disk_says_the_disk_is_full(tmp_path, monkeypatch):
    import errno

    from storage import DiskFullError

    a = _actor(tmp_path)
    told: list[tuple[str, object]] = []
    a.tell = lambda name, msg: told.append((name, msg))  # type: ignore[method-assign]

    def full(self: DiskQueue, messages: object) -> None:
        raise DiskFullError(errno.ENOSPC, "no space left to create /d/t.00002.dat")

    monkeypatch.setattr(DiskQueue, "put_many", full)
    a.on_receive(DqPut([MESSAGE], (("topic:t", 1),)))
    ((_, refused),) = [m for m in told if isinstance(m[1], Stored)]
    assert refused.error == (
        "E_PUB_FAILED",
        "PUB failed: disk full - [Errno 28] no space left to create /d/t.00002.dat", False)
    a.on_stop()


def test_a_restarted_owner_rewinds_a_queue_with_a_delayed_store_open(tmp_path, monkeypatch):
    # Given a channel's queue with a deferred message (its delayed store open) and two
    # messages handed out and not acked
    a = _actor(tmp_path)
    told = []
    monkeypatch.setattr(a, "tell", lambda to, msg: told.append((to, msg)))
    a.on_receive(DqPut([MESSAGE] * 2))
    entry = (123, b"0123456789abcdef", MESSAGE)
    a.on_receive(DqDefer([entry]))
    a.on_receive(DqRead(10, "channel:t/c"))
    assert len(told[-1][1].items) == 2
    # When the channel restarts and asks to rewind (this reopened the queue beside the
    # open store: "database is locked", and the channel crashed in a loop)
    answer = a.on_receive(DqOpen(rewind=True))
    # Then both messages are unread again and the deferred one comes back
    assert answer == (2, [entry])
    a.on_receive(DqRead(10, "channel:t/c"))
    assert len(told[-1][1].items) == 2
    a.on_stop()
