"""NullQueue: the ephemeral backend keeps nothing and says so."""

from __future__ import annotations

import pytest

from storage import MessageSizeError, NullQueue, QueueClosedError


def test_a_null_queue_accepts_messages_counts_them_and_stays_empty():
    q = NullQueue("eph#ephemeral", max_msg_size=10)
    q.put(b"a")
    q.put_many([b"b", b"c"])
    assert q.depth() == 0
    assert q.get() is None
    assert q.read_many(5) == []
    assert q.stats()["dropped"] == 3
    assert q.stats()["dropped_bytes"] == 3


def test_a_null_queue_validates_sizes_like_a_disk_queue():
    q = NullQueue("e", max_msg_size=2)
    with pytest.raises(MessageSizeError):
        q.put_many([b"ok", b"too long"])
    assert q.stats()["dropped"] == 0


def test_a_closed_null_queue_refuses_use_and_wakes_waiting_readers():
    q = NullQueue("e")
    q.close()
    with pytest.raises(QueueClosedError):
        q.put(b"x")
    with pytest.raises(QueueClosedError):
        q.get(timeout=None)
