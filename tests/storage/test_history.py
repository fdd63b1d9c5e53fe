"""A topic's history (storage.history): appended in chunk files, trimmed by whole chunks
by age or size, recovered after a crash."""

from __future__ import annotations

import os
import shutil
import struct
import tempfile
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from storage.chunk import HEADER_SIZE, iter_messages
from storage.errors import QueueClosedError
from storage.history import History, history_path
from storage.syncer import Syncer
from tests.storage.conftest import ManualSyncer

pytestmark = pytest.mark.timeout(30)

SECOND = 1_000_000_000


def record(ts_ns: int, body: bytes = b"x" * 100) -> bytes:
    """A record whose first 8 bytes are its timestamp (as an NSQ message's)."""
    return struct.pack(">Q", ts_ns) + body


def timestamp(r: bytes) -> int:
    return int.from_bytes(r[:8], "big")


def open_history(path: Path, chunk_bytes: int = 4096, **kw: object) -> History:
    return History(str(path), chunk_bytes=chunk_bytes, max_record=1 << 20,
                   timestamp=timestamp, syncer=Syncer(), **kw)  # type: ignore[arg-type]


def files(path: Path) -> list[str]:
    """The chunk files."""
    return sorted(p.name for p in path.iterdir() if p.suffix == ".dat")


def test_appends_are_counted_and_rotate_into_chunks(tmp_path: Path) -> None:
    h = open_history(tmp_path / "t.history")
    for i in range(100):  # 100 x (108 + 16) bytes: several 4 KiB chunks
        h.append([record(SECOND + i)])
    stats = h.stats()
    assert stats["retained_messages"] == 100
    assert stats["oldest_retained_timestamp"] == SECOND
    assert stats["chunks"] == len(files(tmp_path / "t.history")) > 2
    assert stats["retained_bytes"] == sum(
        (tmp_path / "t.history" / f).stat().st_size for f in files(tmp_path / "t.history")
        if f != files(tmp_path / "t.history")[-1]) + h._chunks[-1].size
    h.close()


def test_trim_by_size_deletes_oldest_chunks_but_never_the_one_being_written(
        tmp_path: Path) -> None:
    h = open_history(tmp_path / "t.history")
    for i in range(200):
        h.append([record(SECOND + i)])
    before = h.stats()
    deleted = h.trim(now_ns=0, max_bytes=10_000)
    after = h.stats()
    assert deleted == before["chunks"] - after["chunks"] > 0
    assert after["retained_bytes"] <= 10_000
    # the newest messages stay: the oldest retained one is later than before
    assert after["oldest_retained_timestamp"] > SECOND
    assert after["retained_messages"] < 200
    # with a limit below one chunk, the chunk being written stays all the same
    h.trim(now_ns=0, max_bytes=1)
    assert h.stats()["chunks"] == 1
    assert len(files(tmp_path / "t.history")) == 1
    h.close()


def test_trim_by_age_deletes_a_chunk_once_all_of_it_is_older_than_the_limit(
        tmp_path: Path) -> None:
    h = open_history(tmp_path / "t.history", chunk_bytes=1 << 20, max_chunk_age_ns=10 * SECOND)
    # three chunks: messages at 0-9 s, 10-19 s, 20-25 s (rotated by age)
    for s in range(26):
        h.append([record(s * SECOND)])
    assert h.stats()["chunks"] == 3
    # at 25 s with 10 s of retention: the first chunk (0-9 s) is all older than 15 s;
    # the second's last message (19 s) is not
    assert h.trim(now_ns=25 * SECOND, max_age_ns=10 * SECOND) == 1
    assert h.stats()["oldest_retained_timestamp"] == 10 * SECOND
    assert h.trim(now_ns=25 * SECOND, max_age_ns=10 * SECOND) == 0
    # later, the second goes; the one being written never does
    assert h.trim(now_ns=10**6 * SECOND, max_age_ns=10 * SECOND) == 1
    assert h.stats() | {"deleted_chunks": 0} == {
        "retained_bytes": h._chunks[0].size, "retained_messages": 6,
        "oldest_retained_timestamp": 20 * SECOND, "chunks": 1, "deleted_chunks": 0}
    h.close()


def test_a_reopened_history_goes_on_where_it_was_and_remembers_trims(tmp_path: Path) -> None:
    path = tmp_path / "t.history"
    h = open_history(path)
    for i in range(100):
        h.append([record(SECOND + i, b"%03d" % i)])
    h.trim(now_ns=0, max_bytes=5000)
    kept = h.stats()
    h.close()
    with pytest.raises(QueueClosedError):
        h.append([record(0)])
    h = open_history(path)
    assert h.stats() | {"deleted_chunks": 0} == kept | {"deleted_chunks": 0}
    h.append([record(SECOND + 100)])
    assert h.stats()["retained_messages"] == kept["retained_messages"] + 1
    h.close()


def test_a_torn_tail_is_cut_and_appending_goes_on_after_the_last_whole_frame(
        tmp_path: Path) -> None:
    path = tmp_path / "t.history"
    h = open_history(path, chunk_bytes=1 << 20)
    h.append([record(1), record(2)])
    h.append([record(3)])
    h.sync()
    last = path / files(path)[-1]
    size = h._chunks[-1].size
    h._writer.map.close()  # (a crash: nothing more happens through it)
    os.close(h._writer._fd)
    # an append cut short: a frame header promising 1,000 bytes, and 10 of them
    with open(last, "r+b") as f:
        f.seek(size)
        f.write(struct.pack("<II", 1000, 0) + b"y" * 10)
    h = open_history(path, chunk_bytes=1 << 20)
    assert h.stats()["retained_messages"] == 3
    h.append([record(4)])
    h.close()
    h = open_history(path, chunk_bytes=1 << 20)
    assert h.stats()["retained_messages"] == 4
    assert not list(path.glob("*.bad"))
    h.close()


def test_a_chunk_with_a_damaged_header_is_moved_aside(tmp_path: Path) -> None:
    path = tmp_path / "t.history"
    h = open_history(path)
    for i in range(100):
        h.append([record(SECOND + i)])
    chunks = h.stats()["chunks"]
    h.close()
    first = path / files(path)[0]
    with open(first, "r+b") as f:
        f.write(b"XXXX")
    assert HEADER_SIZE > 4
    h = open_history(path)
    assert h.stats()["chunks"] == chunks - 1
    assert (path / (first.name + ".bad")).exists()
    h.close()


def test_delete_removes_the_directory(tmp_path: Path) -> None:
    path = Path(history_path(str(tmp_path), "t"))
    h = open_history(path)
    h.append([record(1)])
    h.delete()
    assert not path.exists()


def test_read_gives_records_in_order_from_any_position_across_chunks(tmp_path: Path) -> None:
    h = open_history(tmp_path / "t.history", chunk_bytes=2048)
    records = [record(SECOND + i, b"%03d" % i) for i in range(300)]
    for i in range(0, 300, 7):
        h.append(records[i:i + 7])
    assert h.stats()["chunks"] > 2
    got, position = [], h.oldest()
    while True:
        items, position = h.read(position, 50)
        if not items:
            break
        got.extend(items)
    assert [r for _, r in got] == records
    assert [p for p, _ in got] == sorted(p for p, _ in got)
    assert position == h.end()
    # from the middle of a batch frame, and up to an end position
    middle = got[100][0]
    items, _ = h.read(middle, 1000, end=got[200][0])
    assert [r for _, r in items] == records[100:200]
    h.close()


def test_seek_finds_the_first_record_at_or_after_a_time_and_find_id_a_message(
        tmp_path: Path) -> None:
    h = open_history(tmp_path / "t.history", chunk_bytes=2048)
    # ids: the record's last 3 bytes; times: one batch of 5 per second
    for s in range(40):
        h.append([record(s * SECOND, b"%03d" % (s * 5 + i)) for i in range(5)])

    def at(position: int) -> bytes:
        return h.read(position, 1)[0][0][1]

    assert at(h.seek(0)) == record(0, b"000")
    assert at(h.seek(17 * SECOND)) == record(17 * SECOND, b"085")
    assert at(h.seek(17 * SECOND + 1)) == record(18 * SECOND, b"090")
    assert h.seek(41 * SECOND) == h.end()

    def id_of(r: bytes) -> bytes:
        return r[-3:]

    found = h.find_id(b"123", id_of, 24 * SECOND)
    assert found is not None
    assert at(found[0]) == found[1] == record(24 * SECOND, b"123")
    assert h.find_id(b"999", id_of, 24 * SECOND) is None
    h.close()


def test_find_id_walks_on_for_a_record_that_came_long_after_the_time_in_its_id(
        tmp_path: Path) -> None:
    # A dead-letter topic's history: records come when they failed, with old ids
    h = open_history(tmp_path / "t.history", chunk_bytes=2048)
    for s in range(40):
        h.append([record(s * SECOND, b"%03d" % (900 + s))])
    h.append([record(41 * SECOND, b"007")])  # (its id says: published at 2 s)

    def id_of(r: bytes) -> bytes:
        return r[-3:]

    assert h.find_id(b"007", id_of, 2 * SECOND) is None
    found = h.find_id(b"007", id_of, 2 * SECOND, walk=True)
    assert found is not None
    assert found[1] == record(41 * SECOND, b"007")
    assert h.find_id(b"008", id_of, 2 * SECOND, walk=True) is None
    h.close()


def test_complete_from_says_since_when_the_history_is_whole(tmp_path: Path) -> None:
    path = tmp_path / "t.history"
    h = open_history(path, created_ns=5 * SECOND)
    assert h.complete_from == 5 * SECOND
    for i in range(100):
        h.append([record(10 * SECOND + i)])
    h.trim(now_ns=0, max_bytes=5000)
    oldest = h.stats()["oldest_retained_timestamp"]
    assert h.complete_from == oldest + 1 > 10 * SECOND
    h.close()
    assert open_history(path).complete_from == oldest + 1  # (kept in history.json)
    assert open_history(tmp_path / "new.history").complete_from == 0


# ---------------------------------------------------------------------------
# Against a model: whatever is appended and trimmed, the history is a suffix of what
# was appended, keeps all that its policy keeps, and deletes what it may not keep.


class HistoryModel(RuleBasedStateMachine):
    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="histprop")) / "t.history"
        self.appended: list[bytes] = []
        self.now = SECOND
        self.sized = False  # a size limit was applied: it may delete young messages
        self.h = self._open()

    def _open(self) -> History:
        return History(str(self.dir), chunk_bytes=1024, max_record=1 << 20,
                       timestamp=timestamp, syncer=ManualSyncer(), max_chunk_age_ns=5 * SECOND)

    def kept(self) -> list[bytes]:
        out: list[bytes] = []
        for name in files(self.dir):
            out.extend(m for _, m in iter_messages(str(self.dir / name)))
        return out

    @rule(n=st.integers(1, 20), size=st.integers(0, 200), step=st.integers(0, 3 * SECOND))
    def append(self, n: int, size: int, step: int) -> None:
        self.now += step
        batch = [record(self.now, bytes([i % 256]) * size) for i in range(n)]
        self.h.append(batch)
        self.appended.extend(batch)

    @rule(age=st.sampled_from([0, SECOND, 5 * SECOND, 30 * SECOND]),
          size=st.sampled_from([0, 500, 3000, 10_000]))
    def trim(self, age: int, size: int) -> None:
        self.h.trim(now_ns=self.now, max_age_ns=age, max_bytes=size)
        stats = self.h.stats()
        chunks = self.h._chunks
        if len(chunks) > 1:  # what the policy keeps: the oldest chunk is still needed
            assert not size or stats["retained_bytes"] <= size
            assert not age or self.h._first_ns(chunks[1]) >= self.now - age
        self.sized = self.sized or bool(size)
        if age and not self.sized:  # nothing younger than the age limit went
            young = [r for r in self.appended if timestamp(r) >= self.now - age]
            assert not young or self.kept()[-len(young):] == young

    @rule()
    def reopen(self) -> None:
        before = self.h.stats()
        self.h.close()
        self.h = self._open()
        assert self.h.stats() | {"deleted_chunks": 0} == before | {"deleted_chunks": 0}

    @invariant()
    def a_suffix_of_what_was_appended(self) -> None:
        kept = self.kept()
        assert kept == self.appended[len(self.appended) - len(kept):]
        stats = self.h.stats()
        assert stats["retained_messages"] == len(kept)
        assert stats["oldest_retained_timestamp"] == (timestamp(kept[0]) if kept else 0)

    def teardown(self) -> None:
        self.h.close()
        shutil.rmtree(self.dir.parent, ignore_errors=True)


HistoryModel.TestCase.settings = settings(max_examples=40, stateful_step_count=30,
                                          deadline=None, derandomize=True,
                                          suppress_health_check=[HealthCheck.too_slow])
test_history_against_a_model = HistoryModel.TestCase


def test_trim_keeps_what_a_reader_still_has_to_read(tmp_path: Path) -> None:
    h = open_history(tmp_path / "t.history", chunk_bytes=2048)
    for i in range(200):
        h.append([record(SECOND + i, b"%03d" % i)])
    items, _ = h.read(h.oldest(), 150)
    reading = items[-1][0]  # a rewind that has read 150 and goes on from here
    chunks = h.stats()["chunks"]
    h.trim(now_ns=0, max_bytes=1, keep_from=reading)
    assert h.read(reading, 1)[0][0] == items[-1]  # still there
    assert h.stats()["chunks"] < chunks  # (older chunks went)
    h.trim(now_ns=0, max_bytes=1)
    assert h.stats()["chunks"] == 1
    h.close()


def test_a_clean_close_spares_the_next_open_its_walk_and_a_crash_does_not(
        tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    path = tmp_path / "t.history"
    h = open_history(path, chunk_bytes=1 << 20)
    h.append([record(SECOND + i) for i in range(100)])
    h.close()
    walked: list[str] = []
    import storage.history as module

    real_scan = module.scan
    monkeypatch.setattr(module, "scan", lambda p, m: walked.append(p) or real_scan(p, m))
    h = open_history(path, chunk_bytes=1 << 20)
    assert (walked, h.stats()["retained_messages"]) == ([], 100)
    h.append([record(SECOND + 100)])
    h.sync()
    h._writer.map.close()  # (a crash: no clean close this time)
    os.close(h._writer._fd)
    h = open_history(path, chunk_bytes=1 << 20)  # the record was used once: walked now
    assert len(walked) == 1
    assert h.stats()["retained_messages"] == 101
    h.close()


def test_find_key_finds_a_record_by_a_binary_search_of_chunks_and_their_indexes(
        tmp_path: Path) -> None:
    path = tmp_path / "t.history"

    def key(r: bytes) -> int:
        return int(r[8:16])

    def rec(n: int) -> bytes:
        return struct.pack(">Q", SECOND + n) + b"%08d" % n + b"x" * 200

    h = History(str(path), chunk_bytes=256 * 1024, max_record=1 << 20, timestamp=timestamp,
                syncer=Syncer(), key=key)
    n = 0
    for size in [1, 7, 200, 3, 50] * 40:  # frames of several sizes, many chunks
        h.append([rec(i) for i in range(n, n + size)])
        n += size
    assert h.stats()["chunks"] > 3

    def found(k: int) -> bytes | None:
        hit = h.find_key(k, lambda r: key(r) == k)
        if hit is None:
            return None
        assert h.read(hit[0], 1)[0][0][1] == hit[1]
        return hit[1]

    for k in (0, 1, 7, 999, n // 2, n - 1):  # (indexes kept as appended)
        assert found(k) == rec(k)
    assert found(n) is None
    h.close()
    h = History(str(path), chunk_bytes=256 * 1024, max_record=1 << 20, timestamp=timestamp,
                syncer=Syncer(), key=key)
    for k in (0, 5, 1234, n - 1):  # (indexes built by a walk of each chunk)
        assert found(k) == rec(k)
    h.close()
