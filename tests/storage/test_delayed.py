"""Tests for storage.delayed.DelayedStore: ordering, replacement, durability, corruption."""

from __future__ import annotations

import logging
import os
import random
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
from pathlib import Path

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from storage.delayed import SUFFIX, DelayedStore
from storage.errors import QueueClosedError, StorageError

REPO_ROOT = Path(__file__).resolve().parents[2]
EVERYTHING = 2**62  # a "now" after every due time used here


def mid(i: int) -> bytes:
    """A 16-byte NSQ-style hex message id."""
    return f"{i:016x}".encode()


def pop_all(ds: DelayedStore) -> list[tuple[int, bytes, bytes]]:
    out: list[tuple[int, bytes, bytes]] = []
    while batch := ds.pop_due(EVERYTHING, 100):
        out.extend(batch)
    return out


def crash_image(ds: DelayedStore, where: Path) -> Path:
    """Copy an open store's files as they are in the OS: what a kill -9 would leave."""
    where.mkdir(parents=True, exist_ok=True)
    for suffix in ("", "-wal"):
        src = Path(str(ds.path) + suffix)
        if src.exists():
            shutil.copyfile(src, where / (src.name))
    return where / ds.path.name


@pytest.fixture
def store(tmp_path: Path):
    ds = DelayedStore(tmp_path, name="orders")
    yield ds
    ds.close()


# ---------------------------------------------------------------- ordering and API


def test_pop_due_returns_entries_ordered_by_due_time_then_message_id(store: DelayedStore) -> None:
    store.add(30, mid(1), b"c")
    store.add(10, mid(9), b"b")
    store.add(10, mid(2), b"a")
    store.add_many([(20, mid(5), b"x"), (-5, mid(7), b"neg")])

    assert store.pop_due(EVERYTHING, 10) == [
        (-5, mid(7), b"neg"),
        (10, mid(2), b"a"),
        (10, mid(9), b"b"),
        (20, mid(5), b"x"),
        (30, mid(1), b"c"),
    ]


def test_pop_due_returns_nothing_that_is_not_yet_due(store: DelayedStore) -> None:
    store.add_many([(100, mid(1), b"a"), (200, mid(2), b"b"), (201, mid(3), b"c")])

    assert store.pop_due(99, 10) == []
    assert store.pop_due(200, 10) == [(100, mid(1), b"a"), (200, mid(2), b"b")]
    assert len(store) == 1
    assert store.next_due() == 201


def test_pop_due_returns_at_most_limit_entries_and_keeps_the_rest(store: DelayedStore) -> None:
    store.add_many([(i, mid(i), b"p%d" % i) for i in range(10)])

    first = store.pop_due(EVERYTHING, 3)
    second = store.pop_due(EVERYTHING, 3)

    assert [e[0] for e in first] == [0, 1, 2]
    assert [e[0] for e in second] == [3, 4, 5]
    assert len(store) == 4
    assert store.pop_due(EVERYTHING, 0) == []
    assert len(store) == 4


def test_remove_deletes_an_entry_and_tells_whether_it_existed(store: DelayedStore) -> None:
    store.add_many([(1, mid(1), b"a"), (2, mid(2), b"b")])

    assert store.remove(mid(1)) is True
    assert store.remove(mid(1)) is False
    assert store.remove(mid(99)) is False
    assert len(store) == 1
    assert pop_all(store) == [(2, mid(2), b"b")]


def test_adding_an_id_that_is_already_stored_replaces_its_due_time_and_payload(
    store: DelayedStore,
) -> None:
    store.add(50, mid(1), b"old")
    store.add(5, mid(1), b"new")
    store.add(5, mid(1), b"newer")  # same key (due, id): replaced too

    assert len(store) == 1
    assert store.next_due() == 5
    assert pop_all(store) == [(5, mid(1), b"newer")]
    assert store.stats()["replaced"] == 2


def test_add_many_replaces_duplicates_so_the_last_occurrence_wins(store: DelayedStore) -> None:
    store.add(1, mid(1), b"stored")

    store.add_many([(9, mid(1), b"first"), (3, mid(2), b"x"), (7, mid(1), b"last")])

    assert len(store) == 2
    assert pop_all(store) == [(3, mid(2), b"x"), (7, mid(1), b"last")]


def test_add_many_rejects_a_batch_with_one_bad_entry_without_writing_any(
    store: DelayedStore,
) -> None:
    with pytest.raises(TypeError):
        store.add_many([(1, mid(1), b"ok"), ("soon", mid(2), b"bad")])
    with pytest.raises(ValueError, match="64-bit"):
        store.add_many([(1, mid(1), b"ok"), (2**63, mid(2), b"bad")])

    assert len(store) == 0
    assert store.add_many([]) == 0


@pytest.mark.parametrize(
    ("due", "message_id", "payload", "error"),
    [
        (1.5, b"id", b"", TypeError),
        (True, b"id", b"", TypeError),
        (1, "id", b"", TypeError),
        (1, b"", b"", ValueError),
        (1, b"id", "text", TypeError),
        (-(2**63) - 1, b"id", b"", ValueError),
    ],
)
def test_add_rejects_entries_that_are_not_int_bytes_bytes(
    store: DelayedStore, due: object, message_id: object, payload: object, error: type
) -> None:
    with pytest.raises(error):
        store.add(due, message_id, payload)  # type: ignore[arg-type]
    assert len(store) == 0


def test_add_accepts_bytearray_and_memoryview_and_returns_bytes(store: DelayedStore) -> None:
    store.add(1, bytearray(b"id-1"), memoryview(b"payload"))

    assert store.pop_due(1, 1) == [(1, b"id-1", b"payload")]


def test_next_due_is_the_earliest_due_time_or_none_when_empty(store: DelayedStore) -> None:
    assert store.next_due() is None
    store.add_many([(300, mid(1), b""), (100, mid(2), b""), (200, mid(3), b"")])
    assert store.next_due() == 100
    store.remove(mid(2))
    assert store.next_due() == 200


def test_empty_removes_every_entry(store: DelayedStore) -> None:
    store.add_many([(i, mid(i), b"") for i in range(50)])

    store.empty()

    assert len(store) == 0
    assert store.next_due() is None
    assert store.pop_due(EVERYTHING, 10) == []


def test_stats_count_adds_pops_removes_and_replacements(store: DelayedStore) -> None:
    store.add_many([(i, mid(i), b"") for i in range(5)])
    store.add(0, mid(0), b"again")
    store.remove(mid(4))
    store.pop_due(EVERYTHING, 2)

    stats = store.stats()

    assert stats["adds"] == 6
    assert stats["replaced"] == 1
    assert stats["removes"] == 1
    assert stats["pops"] == 2
    assert stats["depth"] == 2
    assert stats["corrupt_files"] == 0
    assert stats["corrupt_entries"] == 0
    assert stats["file_bytes"] > 0


def test_store_may_be_called_from_a_thread_other_than_its_creator(store: DelayedStore) -> None:
    errors: list[BaseException] = []

    def work() -> None:
        try:
            store.add(1, mid(1), b"from a thread")
        except BaseException as exc:  # pragma: no cover - reported below
            errors.append(exc)

    t = threading.Thread(target=work)
    t.start()
    t.join(timeout=10)

    assert errors == []
    assert store.pop_due(1, 1) == [(1, mid(1), b"from a thread")]


# ---------------------------------------------------------------- files and lifecycle


def test_entries_survive_close_and_reopen(tmp_path: Path) -> None:
    # Given a store with entries, some popped and some removed
    ds = DelayedStore(tmp_path, name="orders")
    ds.add_many([(i % 7, mid(i), b"p%d" % i) for i in range(100)])
    popped = ds.pop_due(0, 5)
    ds.remove(mid(50))
    expected = sorted(
        (i % 7, mid(i), b"p%d" % i)
        for i in range(100)
        if i != 50 and (i % 7, mid(i), b"p%d" % i) not in popped
    )
    ds.close()

    # When it is opened again
    reopened = DelayedStore(tmp_path, name="orders")

    # Then everything not popped or removed is there, in order
    assert len(reopened) == 94
    assert reopened.next_due() == expected[0][0]
    assert pop_all(reopened) == expected
    reopened.close()


def test_a_directory_holds_one_file_per_store_name(tmp_path: Path) -> None:
    a = DelayedStore(tmp_path, name="orders")
    b = DelayedStore(tmp_path, name="payments")
    a.add(1, mid(1), b"a")

    assert len(b) == 0
    assert a.path == tmp_path / f"orders{SUFFIX}"
    assert (tmp_path / f"payments{SUFFIX}").exists()
    a.close()
    b.close()


def test_a_path_that_is_not_a_directory_is_used_as_the_file(tmp_path: Path) -> None:
    path = tmp_path / "sub" / "my.db"
    with DelayedStore(path) as ds:
        ds.add(1, mid(1), b"x")
    assert path.is_file()
    with DelayedStore(path) as ds:
        assert len(ds) == 1


def test_a_second_open_of_a_store_in_use_is_refused(store: DelayedStore) -> None:
    store.add(1, mid(1), b"x")

    with pytest.raises(StorageError, match="cannot open"):
        DelayedStore(store.path)

    assert len(store) == 1


def test_sync_checkpoints_every_entry_into_the_database_file(
    store: DelayedStore, tmp_path: Path
) -> None:
    # Given entries added and synced
    store.add_many([(i, mid(i), b"p") for i in range(20)])
    store.sync()

    # When only the database file (no WAL) is copied and opened
    copy = tmp_path / "copy" / store.path.name
    copy.parent.mkdir()
    shutil.copyfile(store.path, copy)

    # Then every entry is in it
    with DelayedStore(copy) as ds:
        assert len(ds) == 20
    assert store.stats()["syncs"] == 1


def test_delete_removes_the_files_and_closes_the_store(tmp_path: Path) -> None:
    ds = DelayedStore(tmp_path, name="orders")
    ds.add(1, mid(1), b"x")

    ds.delete()

    assert list(tmp_path.iterdir()) == []
    with pytest.raises(QueueClosedError):
        ds.add(2, mid(2), b"y")
    assert len(DelayedStore(tmp_path, name="orders")) == 0


CALLS = {
    "add": lambda ds: ds.add(1, b"id", b""),
    "add_many": lambda ds: ds.add_many([(1, b"id", b"")]),
    "add_many_empty": lambda ds: ds.add_many([]),
    "pop_due": lambda ds: ds.pop_due(1, 1),
    "pop_due_limit_0": lambda ds: ds.pop_due(1, 0),
    "remove": lambda ds: ds.remove(b"id"),
    "next_due": lambda ds: ds.next_due(),
    "len": len,
    "sync": lambda ds: ds.sync(),
    "empty": lambda ds: ds.empty(),
}


@pytest.mark.parametrize("name", list(CALLS))
def test_every_call_after_close_raises_queue_closed_error(tmp_path: Path, name: str) -> None:
    ds = DelayedStore(tmp_path, name="orders")
    ds.close()
    ds.close()  # idempotent

    with pytest.raises(QueueClosedError, match="closed"):
        CALLS[name](ds)
    assert ds.stats()["closed"] is True


# ---------------------------------------------------------------- crashes


WRITER = r"""
import sys
from storage.delayed import DelayedStore

path, start = sys.argv[1], int(sys.argv[2])
ds = DelayedStore(path)
i = start
while i < start + 1_000_000:
    if i % 2:
        ds.add((i * 7919) % 1000, b"%016x" % i, b"payload-%d" % i)
        acked = [i]
    else:
        batch = [((j * 7919) % 1000, b"%016x" % j, b"payload-%d" % j) for j in range(i, i + 5)]
        ds.add_many(batch)
        acked = list(range(i, i + 5))
    sys.stdout.write("".join("%d\n" % j for j in acked))
    sys.stdout.flush()
    i = acked[-1] + 1
"""


def run_writer_until_acks(path: Path, start: int, acks: int) -> list[int]:
    """Run WRITER, read ``acks`` acknowledged ids, SIGKILL it; return the ids read."""
    env = {**os.environ, "PYTHONPATH": str(REPO_ROOT)}
    proc = subprocess.Popen(
        [sys.executable, "-c", WRITER, str(path), str(start)],
        stdout=subprocess.PIPE,
        env=env,
        cwd=REPO_ROOT,
    )
    acked: list[int] = []
    try:
        assert proc.stdout is not None
        while len(acked) < acks:
            line = proc.stdout.readline()
            assert line, f"writer exited early with {proc.wait()}"
            acked.append(int(line))
    finally:
        proc.send_signal(signal.SIGKILL)
        proc.wait(timeout=30)
        if proc.stdout is not None:
            proc.stdout.close()
    assert proc.returncode == -signal.SIGKILL
    return acked


def test_every_add_that_returned_survives_kill_9_of_the_writer(tmp_path: Path) -> None:
    path = tmp_path / "orders.db"
    start = 0
    for acks in (1, 40, 400):
        # Given a writer killed with SIGKILL after `acks` acknowledged adds
        acked = run_writer_until_acks(path, start, acks)

        # When the store is reopened
        with DelayedStore(path) as ds:
            found = {m: (due, payload) for due, m, payload in pop_all(ds)}
            stats = ds.stats()

        # Then every acknowledged entry is there, unaltered
        for i in acked:
            assert found[b"%016x" % i] == ((i * 7919) % 1000, b"payload-%d" % i)
        assert stats["corrupt_files"] == 0
        start = max(int(m, 16) for m in found) + 1


def test_a_torn_wal_tail_loses_only_the_last_commit(store: DelayedStore, tmp_path: Path) -> None:
    # Given a crash image (kill -9) of a store after ten single adds
    for i in range(10):
        store.add(i, mid(i), b"p%d" % i)
    image = crash_image(store, tmp_path / "crash")
    wal = Path(str(image) + "-wal")
    assert wal.stat().st_size > 0

    # When the last WAL frame is torn (a power loss in the middle of a write)
    with wal.open("r+b") as f:
        f.truncate(wal.stat().st_size - 100)

    # Then the store opens with the first nine adds
    with DelayedStore(image) as ds:
        assert pop_all(ds) == [(i, mid(i), b"p%d" % i) for i in range(9)]


def test_garbage_appended_to_the_wal_is_ignored(store: DelayedStore, tmp_path: Path) -> None:
    store.add_many([(i, mid(i), b"p%d" % i) for i in range(10)])
    image = crash_image(store, tmp_path / "crash")
    with Path(str(image) + "-wal").open("ab") as f:
        f.write(random.Random(0).randbytes(5000))

    with DelayedStore(image) as ds:
        assert pop_all(ds) == [(i, mid(i), b"p%d" % i) for i in range(10)]
        assert ds.stats()["corrupt_files"] == 0


def test_garbage_appended_to_the_database_file_is_ignored(tmp_path: Path) -> None:
    with DelayedStore(tmp_path, name="orders") as ds:
        ds.add_many([(i, mid(i), b"p%d" % i) for i in range(10)])
        path = ds.path
    with path.open("ab") as f:
        f.write(random.Random(0).randbytes(5000))

    with DelayedStore(path) as ds:
        assert pop_all(ds) == [(i, mid(i), b"p%d" % i) for i in range(10)]


# ---------------------------------------------------------------- corruption


def test_a_file_that_is_not_a_database_is_moved_aside_and_the_store_starts_empty(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    path = tmp_path / f"orders{SUFFIX}"
    path.write_bytes(random.Random(1).randbytes(10_000))

    with caplog.at_level(logging.WARNING, logger="storage.delayed"):
        ds = DelayedStore(tmp_path, name="orders")

    stats = ds.stats()
    assert len(ds) == 0
    assert stats["corrupt_files"] == 1
    assert stats["bad_files"] == [str(path) + ".bad"]
    assert Path(str(path) + ".bad").read_bytes() == random.Random(1).randbytes(10_000)
    assert "damaged" in caplog.text
    ds.add(1, mid(1), b"works")
    assert len(ds) == 1
    ds.close()


def test_a_flipped_byte_in_a_payload_drops_only_that_entry_when_popped(
    tmp_path: Path, caplog: pytest.LogCaptureFixture
) -> None:
    # Given a closed store whose file has one byte flipped inside one payload
    with DelayedStore(tmp_path, name="orders") as ds:
        ds.add_many([(i, mid(i), b"payload-%03d-" % i + b"x" * 50) for i in range(100)])
        path = ds.path
    data = bytearray(path.read_bytes())
    at = data.index(b"payload-042-") + 5
    data[at] ^= 0xFF
    path.write_bytes(bytes(data))

    # When it is reopened and everything is popped
    with caplog.at_level(logging.WARNING, logger="storage.delayed"):
        ds = DelayedStore(path)
        popped = pop_all(ds)

    # Then the damaged entry is reported and not returned; the others are intact
    assert [e[1] for e in popped] == [mid(i) for i in range(100) if i != 42]
    assert all(p == b"payload-%03d-" % d + b"x" * 50 for d, _, p in popped)
    assert ds.stats()["corrupt_entries"] == 1
    assert "CRC mismatch" in caplog.text
    assert len(ds) == 0
    ds.close()


@pytest.mark.parametrize("where", [2, 3, 5], ids=["half", "third", "fifth"])
def test_a_damaged_page_is_quarantined_and_the_readable_entries_are_salvaged(
    tmp_path: Path, caplog: pytest.LogCaptureFixture, where: int
) -> None:
    # Given a store of 5,000 entries whose file has one page overwritten with garbage
    entries = {mid(i): (i * 13 % 5000, b"payload-%d" % i + b"." * 80) for i in range(5000)}
    with DelayedStore(tmp_path, name="orders") as ds:
        ds.add_many([(due, m, p) for m, (due, p) in entries.items()])
        path = ds.path
    page_size = 4096
    pages = path.stat().st_size // page_size
    with path.open("r+b") as f:
        f.seek((pages // where) * page_size)  # a leaf of the table or of the id index
        f.write(random.Random(2).randbytes(page_size))

    # When it is reopened
    with caplog.at_level(logging.WARNING, logger="storage.delayed"):
        ds = DelayedStore(path)

    # Then the open succeeds, the damaged file is kept as .bad, and what could be
    # read was salvaged unaltered: at most a few pages' worth of entries are lost
    stats = ds.stats()
    assert stats["corrupt_files"] == 1
    assert Path(stats["bad_files"][0]).exists()
    assert "damaged" in caplog.text
    salvaged = pop_all(ds)
    assert len(salvaged) == stats["salvaged_entries"]
    assert len(salvaged) >= 5000 - 200
    for due, m, payload in salvaged:
        assert entries[m] == (due, payload)
    assert salvaged == sorted(salvaged)
    ds.close()

    # And the repaired store opens cleanly afterwards
    with DelayedStore(path) as again:
        assert again.stats()["corrupt_files"] == 0


def test_a_database_of_another_application_is_refused_and_left_alone(tmp_path: Path) -> None:
    import sqlite3

    path = tmp_path / "other.db"
    conn = sqlite3.connect(path)
    conn.execute("CREATE TABLE t (x)")
    conn.commit()
    conn.close()
    before = path.read_bytes()

    with pytest.raises(StorageError, match="not a delayed store"):
        DelayedStore(path)

    assert path.read_bytes() == before
    assert not Path(str(path) + ".bad").exists()


# ---------------------------------------------------------------- model-based property test


class DelayedStoreMachine(RuleBasedStateMachine):
    """Random add / add_many / pop_due / remove / reopen against a dict model."""

    ids = st.integers(0, 15).map(mid)
    dues = st.integers(-3, 20)
    payloads = st.binary(max_size=12)

    def __init__(self) -> None:
        super().__init__()
        self.dir = Path(tempfile.mkdtemp(prefix="delayed-model-"))
        self.ds = DelayedStore(self.dir, name="model")
        self.model: dict[bytes, tuple[int, bytes]] = {}

    @rule(due=dues, message_id=ids, payload=payloads)
    def add(self, due: int, message_id: bytes, payload: bytes) -> None:
        self.ds.add(due, message_id, payload)
        self.model[message_id] = (due, payload)

    @rule(batch=st.lists(st.tuples(dues, ids, payloads), max_size=8))
    def add_many(self, batch: list[tuple[int, bytes, bytes]]) -> None:
        self.ds.add_many(batch)
        for due, message_id, payload in batch:
            self.model[message_id] = (due, payload)

    @rule(now=st.integers(-5, 25), limit=st.integers(0, 6))
    def pop_due(self, now: int, limit: int) -> None:
        due_now = sorted((d, m, p) for m, (d, p) in self.model.items() if d <= now)
        expected = due_now[:limit]
        assert self.ds.pop_due(now, limit) == expected
        for _, m, _ in expected:
            del self.model[m]

    @rule(message_id=ids)
    def remove(self, message_id: bytes) -> None:
        assert self.ds.remove(message_id) is (self.model.pop(message_id, None) is not None)

    @rule()
    def reopen(self) -> None:
        self.ds.close()
        self.ds = DelayedStore(self.dir, name="model")

    @precondition(lambda self: len(self.model) > 0)
    @rule()
    def sync(self) -> None:
        self.ds.sync()

    @invariant()
    def length_and_next_due_match_the_model(self) -> None:
        assert len(self.ds) == len(self.model)
        expected = min((d for d, _ in self.model.values()), default=None)
        assert self.ds.next_due() == expected

    def teardown(self) -> None:
        self.ds.close()
        shutil.rmtree(self.dir, ignore_errors=True)


DelayedStoreMachine.TestCase.settings = settings(
    max_examples=60,
    stateful_step_count=30,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
test_delayed_store_behaves_like_an_ordered_dict_model = DelayedStoreMachine.TestCase


def test_entries_lists_everything_in_order_without_removing_it(store: DelayedStore) -> None:
    store.add_many([(30, b"c" * 16, b"3"), (10, b"a" * 16, b"1"), (20, b"b" * 16, b"2")])
    assert store.entries() == [(10, b"a" * 16, b"1"), (20, b"b" * 16, b"2"),
                               (30, b"c" * 16, b"3")]
    assert len(store) == 3


def test_remove_many_removes_in_one_call_and_counts_what_existed(store: DelayedStore) -> None:
    store.add_many([(1, b"a" * 16, b"1"), (2, b"b" * 16, b"2")])
    assert store.remove_many([b"a" * 16, b"z" * 16]) == 1
    assert store.remove_many([]) == 0
    assert [e[1] for e in store.entries()] == [b"b" * 16]
    assert len(store) == 1
