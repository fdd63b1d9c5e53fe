"""DiskQueue: FIFO, batches, limits, rotation, reopen, sync, empty, delete, stats."""

from __future__ import annotations

import errno
import os
import threading

import pytest

from storage import DiskFullError, DiskQueue, MessageSizeError, QueueClosedError, StorageError
from storage import chunk as chunk_mod
from tests.storage.conftest import chunk_files, drain


def test_messages_come_out_in_the_order_they_were_put(open_queue):
    q = open_queue()
    for i in range(100):
        q.put(b"m%d" % i)
    q.put_many([b"b%d" % i for i in range(50)])
    assert q.depth() == 150
    assert drain(q) == [b"m%d" % i for i in range(100)] + [b"b%d" % i for i in range(50)]
    assert q.depth() == 0


def test_get_on_an_empty_queue_returns_none_at_once(open_queue):
    assert open_queue().get() is None


def test_get_with_a_timeout_returns_none_when_nothing_arrives(open_queue):
    assert open_queue().get(timeout=0.01) is None


def test_a_waiting_get_returns_the_message_a_writer_puts(open_queue):
    q = open_queue()
    waiting = threading.Event()
    got: list[bytes | None] = []

    def reader() -> None:
        waiting.set()
        got.append(q.get(timeout=None))

    t = threading.Thread(target=reader)
    t.start()
    waiting.wait(5)
    q.put(b"hello")
    t.join(5)
    assert got == [b"hello"]


def test_close_wakes_a_reader_waiting_forever(open_queue):
    q = open_queue()
    errors: list[BaseException] = []
    started = threading.Event()

    def reader() -> None:
        started.set()
        try:
            q.get(timeout=None)
        except QueueClosedError as e:
            errors.append(e)

    t = threading.Thread(target=reader)
    t.start()
    started.wait(5)
    # The reader may or may not be inside wait() yet; close() must wake it either way.
    q.close()
    t.join(5)
    assert not t.is_alive()


def test_empty_messages_are_stored_and_returned(open_queue):
    q = open_queue()
    q.put(b"")
    q.put_many([b"", b"x", b""])
    assert drain(q) == [b"", b"", b"x", b""]


def test_a_message_outside_the_size_limits_is_rejected_with_its_size_and_the_bounds(open_queue):
    q = open_queue(min_msg_size=2, max_msg_size=10)
    with pytest.raises(MessageSizeError) as e:
        q.put(b"x" * 11)
    assert isinstance(e.value, ValueError)
    assert "11" in str(e.value)
    assert "[2, 10]" in str(e.value)
    with pytest.raises(MessageSizeError):
        q.put(b"x")
    assert q.depth() == 0


def test_a_batch_with_one_bad_message_writes_nothing(open_queue, tmp_path):
    q = open_queue(max_msg_size=10)
    q.put(b"before")
    size_before = os.path.getsize(tmp_path / chunk_files(tmp_path)[0])
    with pytest.raises(MessageSizeError):
        q.put_many([b"ok", b"x" * 11, b"ok"])
    assert q.depth() == 1
    assert q.stats()["chunks"][1]["messages"] == 1
    assert os.path.getsize(tmp_path / chunk_files(tmp_path)[0]) == size_before
    assert drain(q) == [b"before"]


def test_an_empty_batch_is_a_no_op(open_queue):
    q = open_queue()
    q.put_many([])
    assert q.depth() == 0


def test_using_a_closed_queue_raises_queue_closed(open_queue):
    q = open_queue()
    q.close()
    for call in (lambda: q.put(b"x"), lambda: q.put_many([b"x"]), q.get, q.sync, q.empty):
        with pytest.raises(QueueClosedError):
            call()
    assert issubclass(QueueClosedError, StorageError)


def test_a_deleted_queue_raises_queue_closed_and_leaves_no_files(open_queue, tmp_path):
    q = open_queue()
    q.put_many([b"x"] * 10)
    q.delete()
    with pytest.raises(QueueClosedError):
        q.put(b"x")
    assert os.listdir(tmp_path) == []


def test_fifo_holds_across_file_rotation_and_consumed_files_are_deleted(open_queue, tmp_path):
    q = open_queue(max_bytes_per_file=1024)
    msgs = [b"%05d" % i + b"." * 50 for i in range(200)]
    for m in msgs[:100]:
        q.put(m)
    q.put_many(msgs[100:150])
    for m in msgs[150:]:
        q.put(m)
    assert len(chunk_files(tmp_path)) > 5
    assert drain(q) == msgs
    # Only the chunk still being written remains.
    assert len(chunk_files(tmp_path)) == 1


def test_fifo_and_depth_hold_across_close_and_reopen(open_queue):
    q = open_queue(max_bytes_per_file=1024)
    msgs = [b"%05d" % i for i in range(300)]
    q.put_many(msgs[:100])
    for m in msgs[100:]:
        q.put(m)
    assert [q.get() for _ in range(120)] == msgs[:120]
    q.close()
    q = open_queue(max_bytes_per_file=1024)
    assert q.depth() == 180
    assert drain(q) == msgs[120:]
    q.close()
    q = open_queue(max_bytes_per_file=1024)
    assert q.depth() == 0
    assert q.get() is None


def test_reopen_in_the_middle_of_a_batch_resumes_after_the_last_message_read(open_queue):
    q = open_queue()
    q.put_many([b"a", b"b", b"c", b"d"])
    assert q.get() == b"a"
    assert q.get() == b"b"
    q.close()
    q = open_queue()
    assert q.depth() == 2
    assert drain(q) == [b"c", b"d"]


@pytest.mark.parametrize("first", [b"", b"x"])
def test_a_queue_reopened_after_everything_was_read_serves_later_appends_intact(
        open_queue, first):
    # Given a queue whose reader caught up with the writer before it was closed (the saved
    # read position is "just after the last message of the chunk still being written")
    q = open_queue(max_bytes_per_file=512, ring_size=8)
    q.put(first)
    assert q.get() == first
    q.close()
    q = open_queue(max_bytes_per_file=512, ring_size=8)
    # When new messages are put, the first is read straight from the ring, and later
    # puts overwrite the ring slots of the rest before they are read
    batch = [b"b%d" % i for i in range(8)]
    q.put(b"a")
    q.put_many(batch)
    assert q.get() == b"a"
    q.put(b"c")
    # Then the rest come back from the chunk file whole and in order, none is taken
    # for corrupt, and the queue ends empty
    assert drain(q) == [*batch, b"c"]
    assert q.depth() == 0
    assert q.stats()["corruptions"] == 0


def test_a_message_larger_than_a_chunk_gets_a_chunk_of_its_own(open_queue):
    q = open_queue(max_bytes_per_file=256, max_msg_size=10_000)
    q.put(b"small")
    q.put(b"L" * 5000)
    q.put_many([b"M" * 3000, b"N" * 3000])
    q.put(b"after")
    assert drain(q) == [b"small", b"L" * 5000, b"M" * 3000, b"N" * 3000, b"after"]


def test_a_huge_batch_is_split_into_several_frames_and_stays_in_order(open_queue, monkeypatch):
    from storage import diskqueue

    monkeypatch.setattr(diskqueue, "MAX_FRAME_BODY", 1000)
    q = open_queue(max_bytes_per_file=4096)
    msgs = [b"%04d" % i + b"x" * 40 for i in range(500)]
    q.put_many(msgs)
    assert q.depth() == 500
    q.close()
    q = open_queue(max_bytes_per_file=4096)
    assert drain(q) == msgs


def test_get_many_returns_up_to_the_limit_in_order(open_queue):
    q = open_queue()
    q.put_many([b"%d" % i for i in range(10)])
    assert q.get_many(4) == [b"0", b"1", b"2", b"3"]
    assert q.get_many(100) == [b"%d" % i for i in range(4, 10)]
    assert q.get_many(5) == []


def test_sync_makes_the_read_position_durable(open_queue, tmp_path):
    q = open_queue()
    q.put_many([b"1", b"2", b"3"])
    q.get()
    q.sync()
    meta = (tmp_path / "q.diskqueue.meta.dat").read_text()
    assert '"index": 1' in meta


def test_every_sync_every_puts_the_queue_syncs_itself(open_queue):
    q = open_queue(sync_every=10)
    for _ in range(25):
        q.put(b"x")
    assert q.stats()["syncs"] == 2


def test_a_write_schedules_a_timed_sync_after_sync_timeout(open_queue, syncer):
    q = open_queue(sync_timeout=0.5)
    q.put(b"x")
    q.put(b"y")
    assert [(s[0], s[1]) for s in syncer.scheduled] == [(q, 0.5)]
    assert syncer.fire() == 1
    assert q.stats()["syncs"] == 1
    q.put(b"z")
    assert len(syncer.scheduled) == 1


def test_the_background_syncer_syncs_a_dirty_queue(tmp_path):
    # The real process-wide syncer thread, with a short timeout.
    q = DiskQueue("real", tmp_path, sync_timeout=0.01)
    try:
        q.put(b"x")
        deadline = 200
        while q.stats()["syncs"] == 0 and deadline:
            threading.Event().wait(0.01)
            deadline -= 1
        assert q.stats()["syncs"] >= 1
    finally:
        q.close()


def test_empty_discards_everything_and_the_queue_stays_usable(open_queue, tmp_path):
    q = open_queue(max_bytes_per_file=512)
    q.put_many([b"x" * 30] * 50)
    q.get()
    q.empty()
    assert q.depth() == 0
    assert q.get() is None
    assert len(chunk_files(tmp_path)) == 1
    q.put(b"after")
    q.close()
    q = open_queue(max_bytes_per_file=512)
    assert drain(q) == [b"after"]


def test_stats_report_chunks_cache_bytes_and_depth(open_queue):
    q = open_queue(max_bytes_per_file=1024)
    q.put_many([b"a" * 100] * 5)
    for _ in range(10):
        q.put(b"b" * 100)
    q.get()
    s = q.stats()
    assert s["depth"] == 14
    assert s["bytes_written"] == 1500
    assert s["bytes_read"] > 0
    assert {"hits", "misses", "admitted", "rejected", "evicted", "cached_bytes"} <= set(s["cache"])
    assert sum(c["writes"] for c in s["chunks"].values()) == 15
    assert s["chunks"][s["read_chunk"]]["reads"] >= 1
    for key in ("corruptions", "torn_tails", "ring_hits", "syncs", "bad_files"):
        assert key in s


def test_reads_of_fresh_messages_are_served_by_the_ring(open_queue):
    q = open_queue()
    q.put(b"fresh")
    q.put_many([b"a", b"b"])
    assert drain(q) == [b"fresh", b"a", b"b"]
    assert q.stats()["ring_hits"] == 2
    assert q.stats()["cache"]["misses"] == 0


def test_reads_after_reopen_come_from_the_chunk_files(open_queue):
    q = open_queue()
    q.put_many([b"a", b"b"])
    q.close()
    q = open_queue()
    assert drain(q) == [b"a", b"b"]
    assert q.stats()["ring_hits"] == 0
    assert q.stats()["cache"]["misses"] == 1


def test_one_writer_thread_and_one_reader_thread_keep_fifo(open_queue):
    q = open_queue(max_bytes_per_file=64 * 1024)
    n = 20_000
    got: list[bytes] = []

    def writer() -> None:
        for i in range(0, n, 100):
            if i % 200:
                q.put_many([b"%06d" % j for j in range(i, i + 100)])
            else:
                for j in range(i, i + 100):
                    q.put(b"%06d" % j)

    def reader() -> None:
        while len(got) < n:
            batch = q.get_many(64, timeout=5)
            assert batch, "reader starved"
            got.extend(batch)

    threads = [threading.Thread(target=writer), threading.Thread(target=reader)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(30)
    assert got == [b"%06d" % j for j in range(n)]


def test_a_full_disk_raises_disk_full_and_writes_nothing(open_queue, monkeypatch):
    q = open_queue(max_bytes_per_file=1 << 20)
    q.put(b"x" * 100)
    real = os.posix_fallocate

    def full(fd: int, offset: int, length: int) -> None:
        raise OSError(errno.ENOSPC, "No space left on device")

    monkeypatch.setattr(chunk_mod.os, "posix_fallocate", full)
    with pytest.raises(DiskFullError) as e:
        q.put_many([b"y" * 1000] * 200)  # needs the chunk to grow
    assert e.value.errno == errno.ENOSPC
    assert q.depth() == 1
    monkeypatch.setattr(chunk_mod.os, "posix_fallocate", real)
    q.put(b"z")
    assert drain(q) == [b"x" * 100, b"z"]


def test_invalid_queue_names_are_refused(tmp_path):
    for bad in ("", "a/b", "a\x00b"):
        with pytest.raises(ValueError, match="invalid queue name"):
            DiskQueue(bad, tmp_path)


def test_the_demo_writes_outside_the_brokers_data_directory(tmp_path, monkeypatch, capsys):
    from storage.__main__ import main

    monkeypatch.chdir(tmp_path)
    monkeypatch.setenv("TMPDIR", str(tmp_path / "tmp"))
    (tmp_path / "tmp").mkdir()
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", None)  # (re-read TMPDIR)
    assert main(["--messages", "400"]) == 0
    assert not (tmp_path / "data").exists()
    assert list((tmp_path / "tmp" / "storage-demo").glob("demo.diskqueue.*"))
    assert "opened queue 'demo'" in capsys.readouterr().out
