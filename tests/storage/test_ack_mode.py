"""Ack-position mode: a message leaves the queue only when it is acked."""

from __future__ import annotations

import pytest

from storage import StorageError
from storage import diskqueue as dq_mod
from tests.storage.conftest import chunk_files


def test_read_hands_out_positions_and_ack_finishes_them_in_any_order(open_queue):
    q = open_queue(ack_mode=True)
    q.put_many([b"a", b"b", b"c"])
    recs = q.read_many(3)
    assert [m for _, m in recs] == [b"a", b"b", b"c"]
    assert q.depth() == 0
    assert q.pending() == 3
    assert q.ack(recs[2][0]) is True
    assert q.ack(recs[0][0]) is True
    assert q.pending() == 1


def test_acking_an_unknown_or_already_acked_position_returns_false(open_queue):
    q = open_queue(ack_mode=True)
    q.put(b"x")
    pos, _ = q.read()
    assert q.ack(pos + 12345) is False
    assert q.ack(pos) is True
    assert q.ack(pos) is False
    assert q.ack_many([pos, pos + 1]) == 0


def test_ack_is_refused_outside_ack_mode(open_queue):
    q = open_queue()
    q.put(b"x")
    pos, _ = q.read()
    with pytest.raises(StorageError, match="not in ack mode"):
        q.ack(pos)


def test_after_reopen_every_unacked_message_is_readable_again_and_acked_ones_are_not(open_queue):
    # Given messages read in several chunks, some acked out of order
    q = open_queue(ack_mode=True, max_bytes_per_file=256)
    msgs = [b"m%03d" % i for i in range(60)]
    q.put_many(msgs[:20])
    for m in msgs[20:]:
        q.put(m)
    recs = q.read_many(50)
    acked = {p for i, (p, _) in enumerate(recs) if i % 3 != 1}
    assert q.ack_many(acked) == len(acked)
    # When the queue is closed and reopened
    q.close()
    q = open_queue(ack_mode=True, max_bytes_per_file=256)
    # Then the unacked and the never-read messages come back, in order, and nothing else
    expected = [m for i, m in enumerate(msgs[:50]) if i % 3 == 1] + msgs[50:]
    assert q.depth() == len(expected)
    again = q.read_many(1000)
    assert [m for _, m in again] == expected
    assert q.depth() == 0


def test_a_get_in_ack_mode_acks_at_once(open_queue):
    q = open_queue(ack_mode=True)
    q.put_many([b"a", b"b"])
    assert q.get() == b"a"
    assert q.get_many(5) == [b"b"]
    assert q.pending() == 0
    q.close()
    q = open_queue(ack_mode=True)
    assert q.depth() == 0


def test_a_chunk_is_deleted_only_when_every_message_in_it_is_acked(open_queue, tmp_path):
    q = open_queue(ack_mode=True, max_bytes_per_file=200)
    for i in range(30):
        q.put(b"%02d" % i + b"-" * 20)
    files_before = len(chunk_files(tmp_path))
    recs = q.read_many(30)
    # Everything read, the first message still pending: no chunk may go.
    q.ack_many([p for p, _ in recs[1:]])
    assert len(chunk_files(tmp_path)) == files_before
    # Acking it lets every fully acked chunk go.
    q.ack(recs[0][0])
    assert len(chunk_files(tmp_path)) == 1


def test_the_ack_journal_is_compacted_and_still_correct_after_reopen(open_queue, monkeypatch,
                                                                     tmp_path):
    monkeypatch.setattr(dq_mod, "JOURNAL_COMPACT_MIN", 10)
    q = open_queue(ack_mode=True)
    q.put_many([b"%03d" % i for i in range(100)])
    recs = q.read_many(100)
    for pos, _ in recs[:60]:  # in order: the floor follows, nothing needs remembering
        q.ack(pos)
    journal = tmp_path / "q.diskqueue.acks.dat"
    assert journal.stat().st_size < 16 * 11  # rewritten, not only appended
    q.ack_many([p for p, _ in recs[61:]])
    q.close()
    q = open_queue(ack_mode=True)
    assert [m for _, m in q.read_many(100)] == [b"060"]


def test_a_crash_after_acks_loses_no_unacked_message(open_queue):
    # A "crash": the queue object is dropped without close(); its files are reopened.
    q = open_queue(ack_mode=True)
    q.put_many([b"a", b"b", b"c", b"d"])
    recs = q.read_many(4)
    q.ack(recs[1][0])
    q.ack(recs[3][0])
    q2 = open_queue("q", ack_mode=True)
    assert [m for _, m in q2.read_many(10)] == [b"a", b"c"]


def test_empty_in_ack_mode_drops_pending_messages_too(open_queue):
    q = open_queue(ack_mode=True)
    q.put_many([b"a", b"b"])
    q.read()
    q.empty()
    assert q.pending() == 0
    assert q.depth() == 0
    q.close()
    q = open_queue(ack_mode=True)
    assert q.read() is None


@pytest.mark.parametrize("seed", range(12))
def test_a_cleanly_closed_queue_tells_the_depth_a_reopen_will_find_without_opening(
        open_queue, tmp_path, seed):
    import random

    rng = random.Random(seed)
    # Given a queue with puts across chunks, reads, and acks in any order
    q = open_queue(ack_mode=True, max_bytes_per_file=300)
    read: list[int] = []
    for _ in range(rng.randrange(5, 40)):
        op = rng.random()
        if op < 0.5:
            q.put_many([b"m%04d" % rng.randrange(10_000) for _ in range(rng.randrange(1, 6))])
        elif op < 0.8:
            read.extend(p for p, _ in q.read_many(rng.randrange(1, 6)))
        elif read:
            q.ack_many([read.pop(rng.randrange(len(read))) for _ in range(min(3, len(read)))])
    # When it is closed
    q.close()
    told = dq_mod.DiskQueue.closed_depth("q", tmp_path)
    # Then the depth it tells is what a reopen finds (un-acked messages read again)
    q = open_queue(ack_mode=True, max_bytes_per_file=300)
    assert told is not None
    assert told == q.depth()
    q.close()


def test_a_queue_used_since_its_close_or_never_closed_tells_nothing(open_queue, tmp_path):
    closed_depth = dq_mod.DiskQueue.closed_depth
    # Never created: empty, and nothing to open; open but never closed: unknown
    assert closed_depth("q", tmp_path) == 0
    assert list(tmp_path.iterdir()) == []
    q = open_queue(ack_mode=True)
    q.put_many([b"a", b"b"])
    assert closed_depth("q", tmp_path) is None
    q.close()
    assert closed_depth("q", tmp_path) == 2
    # A put after a reopen grows the last chunk: unknown until the next close
    q = open_queue(ack_mode=True)
    assert closed_depth("q", tmp_path) == 2  # opened only: the files are as they were
    q.put(b"c")
    assert closed_depth("q", tmp_path) is None
    q.close()
    assert closed_depth("q", tmp_path) == 3
    # An ack grows the journal: unknown (a kill -9 now must not be answered from the record)
    q = open_queue(ack_mode=True)
    pos, _ = q.read()
    q.ack(pos)
    assert closed_depth("q", tmp_path) is None
    q.close()
    assert closed_depth("q", tmp_path) == 2
    # A damaged record is no answer either
    meta = tmp_path / "q.diskqueue.meta.dat"
    meta.write_text(meta.read_text().replace('"depth": 2', '"depth": "two"'))
    assert closed_depth("q", tmp_path) is None


def test_a_close_without_sync_lets_go_of_the_files_without_an_fsync_or_a_close_record(
        open_queue, tmp_path, monkeypatch):
    # Given a queue never closed cleanly (written, then its process killed)
    q = open_queue(ack_mode=True, max_bytes_per_file=300)
    q.put_many([b"m%03d" % i for i in range(40)])
    pos, _ = q.read()
    q.ack(pos)
    # When it is reopened, to learn its depth, and closed without a sync
    q = open_queue(ack_mode=True, max_bytes_per_file=300)
    depth = q.depth()
    syncs: list[int] = []
    for name in ("fsync", "fdatasync"):
        monkeypatch.setattr(dq_mod.os, name, syncs.append, raising=True)
    q.close(sync=False)
    monkeypatch.undo()
    # Then nothing was synced, no clean close is recorded, and a reopen finds it all
    assert syncs == []
    assert dq_mod.DiskQueue.closed_depth("q", tmp_path) is None
    with pytest.raises(StorageError):
        q.put(b"late")
    q = open_queue(ack_mode=True, max_bytes_per_file=300)
    assert depth == q.depth() == 39
    assert [m for _, m in q.read_many(100)] == [b"m%03d" % i for i in range(1, 40)]
    q.close()


def test_a_reopened_queue_says_which_records_it_had_handed_out_before(open_queue):
    # Given records read (handed out) and not all acked, the read position synced,
    # then more put and never read
    q = open_queue(ack_mode=True)
    q.put_many([b"a", b"b", b"c"])
    recs = q.read_many(3)
    q.ack(recs[1][0])
    q.sync()
    q.put_many([b"d", b"e"])
    # When the queue "crashes" (dropped without close) and is opened again
    q2 = open_queue("q", ack_mode=True)
    again = q2.read_many(10)
    # Then the records handed out before are known as such, and the others are not
    assert [(m, q2.read_before(p)) for p, m in again] == [
        (b"a", True), (b"c", True), (b"d", False), (b"e", False)]
    # And a clean close keeps that knowledge for what is still not acked
    q2.ack(again[0][0])
    q2.close()
    q3 = open_queue("q", ack_mode=True)
    assert [(m, q3.read_before(p)) for p, m in q3.read_many(10)] == [
        (b"c", True), (b"d", True), (b"e", True)]


def test_reads_after_the_last_metadata_write_are_not_known_after_a_crash(open_queue):
    q = open_queue(ack_mode=True)
    q.put_many([b"a", b"b"])
    q.read_many(1)
    q.sync()
    q.read_many(1)  # no sync after this read: the crash forgets it
    q2 = open_queue("q", ack_mode=True)
    assert [(m, q2.read_before(p)) for p, m in q2.read_many(10)] == [
        (b"a", True), (b"b", False)]


def test_syncs_rewrite_the_metadata_once_per_sync_timeout_and_a_crash_still_skips_every_ack(
        open_queue, clock, syncer, monkeypatch):
    writes: list[dict] = []
    real = dq_mod.write_json
    monkeypatch.setattr(dq_mod, "write_json", lambda path, obj: (writes.append(obj),
                                                                 real(path, obj)))
    q = open_queue(ack_mode=True, sync_every=1, sync_timeout=2.0)

    def step(body: bytes, *, ack: bool = True) -> None:
        q.put(body)  # (syncs: sync_every=1)
        ((pos, _),) = q.read_many(1)
        if ack:
            q.ack(pos)
        q.sync()
        clock.advance(0.1)

    # Given a queue that syncs after every put, with a consumer acking as it goes
    step(b"m0")
    written = len(writes)
    for i in range(1, 10):
        step(b"m%d" % i, ack=i != 5)
    # Then its 18 syncs within sync_timeout of the first did not rewrite the metadata
    assert len(writes) == written
    # And the timed sync records the floor as it is now
    syncer.fire()
    assert len(writes) == written + 1
    # And a sync a sync_timeout later writes it again
    clock.advance(2.0)
    step(b"m10")
    assert len(writes) == written + 2
    # When the queue "crashes" (no close) after more acks that no metadata records
    step(b"m11")
    step(b"m12", ack=False)
    assert len(writes) == written + 2
    q2 = open_queue("q", ack_mode=True)
    # Then exactly the unacked messages come back: the journal covers the older floor
    assert [m for _, m in q2.read_many(100)] == [b"m5", b"m12"]


def test_what_was_acked_before_a_reopen_and_read_past_stays_acked_through_a_compaction(
        open_queue, monkeypatch):
    # Given a queue whose message 20 was acked in an earlier life
    monkeypatch.setattr(dq_mod, "JOURNAL_COMPACT_MIN", 8)
    q = open_queue(ack_mode=True)
    q.put_many([b"%02d" % i for i in range(30)])
    recs = q.read_many(30)
    q.ack(recs[20][0])
    q.close()
    # When the reopened queue reads past it (skipping it) and its consumer acks the first
    # fifteen one by one, the journal compacted on the way, then it is reopened again
    q = open_queue(ack_mode=True)
    recs = q.read_many(30)
    assert b"20" not in [m for _, m in recs]
    for pos, _ in recs[:15]:
        q.ack(pos)
    q.close()
    # Then message 20 is still acked: not delivered a third time
    q = open_queue(ack_mode=True)
    assert [m for _, m in q.read_many(30)] == [b"%02d" % i for i in range(15, 30) if i != 20]


def test_find_says_a_message_acked_before_a_reopen_and_read_past_is_gone(open_queue):
    q = open_queue(ack_mode=True)
    q.put_many([b"%08d" % i for i in range(5)])
    recs = q.read_many(5)
    q.ack_many([recs[3][0], recs[4][0]])
    q.close()
    q = open_queue(ack_mode=True)
    assert len(q.read_many(3)) == 3
    assert q.read_many(5) == []  # (steps over 3 and 4, acked before)
    assert q.find(b"00000003", lambda m: m[:8]) is None
    assert q.find(b"00000002", lambda m: m[:8]) == (b"00000002", True)
