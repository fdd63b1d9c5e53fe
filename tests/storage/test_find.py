"""`DiskQueue.find`: a message still in the queue, found by a key without a walk of
the whole queue (#21's lookup by id: a channel's backlog, a topic's queue)."""

from __future__ import annotations

import random
import shutil
import tempfile

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from storage import DiskQueue, QueueClosedError
from storage import diskqueue as dq_mod
from storage.chunk import BATCH_FLAG, batch_body, messages_holding
from tests.storage.conftest import FakeMemory, ManualSyncer, chunk_files

pytestmark = pytest.mark.timeout(60)


def key(message: bytes) -> bytes:
    return message[:8]


def msg(n: int, body: bytes = b"x" * 40) -> bytes:
    return b"%08d" % n + body


def test_messages_holding_yields_the_messages_of_a_frame_that_hold_the_needle():
    msgs = [b"aa", b"xneedle", b"bb", b"needle", b"", b"ne", b"edle", b"needleneedle"]
    body = batch_body(msgs)
    field = BATCH_FLAG | len(body)
    assert list(messages_holding(field, body, b"needle")) == [
        (1, b"xneedle"), (3, b"needle"), (7, b"needleneedle")]  # (not "ne" + "edle")
    assert list(messages_holding(field, body, b"zz")) == []
    assert list(messages_holding(len(b"a needle"), b"a needle", b"needle")) == [
        (0, b"a needle")]
    # bytes of the lengths' table are not a message's
    table = batch_body([b"\x07" * 7])
    assert list(messages_holding(BATCH_FLAG | len(table), table, b"\x07\x00")) == []


def test_a_message_is_found_while_unread_and_while_read_but_not_acked(open_queue):
    q = open_queue(ack_mode=True)
    q.put_many([msg(i) for i in range(100)])
    q.put(msg(100))
    assert q.find(b"00000042", key) == (msg(42), False)
    assert q.find(b"00000100", key) == (msg(100), False)
    assert q.find(b"00000101", key) is None
    got = q.read_many(50)
    assert q.find(b"00000042", key) == (msg(42), True)
    assert q.find(b"00000077", key) == (msg(77), False)
    # acked in order (the floor moves past it) and out of order (acked early)
    q.ack_many([p for p, _ in got[:10]])
    q.ack(got[42][0])
    assert q.find(b"00000005", key) is None
    assert q.find(b"00000042", key) is None
    assert q.find(b"00000041", key) == (msg(41), True)


def test_what_was_written_after_a_lookup_is_found_by_the_next(open_queue):
    q = open_queue(ack_mode=True)
    q.put_many([msg(i) for i in range(10)])
    assert q.find(b"00000011", key) is None
    q.put_many([msg(i) for i in range(10, 20)])
    assert q.find(b"00000011", key) == (msg(11), False)


def test_lookups_read_only_the_entries_whose_key_range_holds_the_key(open_queue, monkeypatch):
    monkeypatch.setattr(dq_mod, "FIND_SPAN", 1024)
    q = open_queue(ack_mode=True, max_bytes_per_file=64 * 1024)
    for i in range(0, 5000, 50):
        q.put_many([msg(j) for j in range(i, i + 50)])
    assert len(chunk_files(q.data_path)) > 3
    assert q.find(b"00004999", key) == (msg(4999), False)
    entries = sum(len(s.starts) for s in q._summaries.values())
    assert entries == 100  # (one per frame: each spans more than FIND_SPAN)
    decoded = []
    real = q._find_in
    monkeypatch.setattr(q, "_find_in", lambda *a: decoded.append(a[1]) or real(*a))
    for n in random.Random(7).sample(range(5000), 50):
        assert q.find(b"%08d" % n, key) == (msg(n), False)
    assert len(decoded) == 50  # one entry read per lookup: keys in order, one range each


def test_keys_out_of_order_are_found_too(open_queue):
    q = open_queue(ack_mode=True)
    q.put_many([msg(i) for i in range(100, 200)])
    q.put_many([msg(5), msg(300), msg(7)])  # (a channel writing back what it held)
    for n in (5, 7, 150, 300):
        assert q.find(b"%08d" % n, key) == (msg(n), False)
    assert q.find(b"00000006", key) is None


def test_after_a_reopen_what_was_read_and_not_acked_is_unread_and_what_was_acked_is_gone(
        tmp_path, syncer, memory):
    q = DiskQueue("q", tmp_path, ack_mode=True, syncer=syncer, memory_probe=memory)
    q.put_many([msg(i) for i in range(20)])
    got = q.read_many(10)
    q.ack_many([got[3][0], got[6][0]])
    assert q.find(b"00000003", key) is None
    q.close()
    q = DiskQueue("q", tmp_path, ack_mode=True, syncer=syncer, memory_probe=memory)
    try:
        assert q.find(b"00000003", key) is None
        assert q.find(b"00000006", key) is None
        assert q.find(b"00000004", key) == (msg(4), False)
        assert q.find(b"00000015", key) == (msg(15), False)
    finally:
        q.close()


def test_chunks_deleted_take_their_summaries_with_them(open_queue):
    q = open_queue(ack_mode=True, max_bytes_per_file=4096)
    for i in range(0, 400, 20):
        q.put_many([msg(j) for j in range(i, i + 20)])
    assert q.find(b"00000001", key) is not None
    first = min(q._summaries)
    while (got := q.read_many(100)):
        q.ack_many([p for p, _ in got])
    assert first not in q._summaries
    assert q.find(b"00000001", key) is None
    assert q.find(b"00000399", key) is None
    q.put(msg(400))
    assert q.find(b"00000400", key) == (msg(400), False)


def test_find_after_empty_and_on_a_closed_queue(open_queue):
    q = open_queue(ack_mode=True)
    q.put_many([msg(i) for i in range(10)])
    assert q.find(b"00000001", key) is not None
    q.empty()
    assert q.find(b"00000001", key) is None
    q.put(msg(1))
    assert q.find(b"00000001", key) == (msg(1), False)
    q.close()
    with pytest.raises(QueueClosedError):
        q.find(b"00000001", key)


def test_a_plain_queue_finds_only_what_is_unread(open_queue):
    q = open_queue()
    q.put_many([msg(i) for i in range(10)])
    assert [q.get() for _ in range(3)] == [msg(0), msg(1), msg(2)]
    assert q.find(b"00000002", key) is None
    assert q.find(b"00000003", key) == (msg(3), False)


class FindModel(RuleBasedStateMachine):
    """find() against a model of which keys are unread, read (pending) or gone, through
    puts (some keys out of order), reads, acks in any order, reopens and small chunks."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="dqfind")
        self.syncer, self.memory = ManualSyncer(), FakeMemory(10)
        self.q = self._open()
        self.next = 0
        self.used: set[int] = set()
        self.state: dict[bytes, str] = {}  # key -> "unread" | "read" | "gone"
        self.positions: dict[int, bytes] = {}  # pending position -> key

    def _open(self) -> DiskQueue:
        return DiskQueue("q", self.dir, ack_mode=True, max_bytes_per_file=2048,
                         syncer=self.syncer, memory_probe=self.memory)

    def _new(self, back: int) -> bytes:
        self.next += 1
        n = self.next * 10
        if back and (self.next - back) * 10 + 5 not in self.used:
            n = (self.next - back) * 10 + 5  # (a key below many already written)
        self.used.add(n)
        return msg(n, b"y" * (n % 37))

    @rule(count=st.integers(1, 30), back=st.integers(0, 60))
    def put_many(self, count: int, back: int) -> None:
        batch = [self._new(back if i == 0 else 0) for i in range(count)]
        self.q.put_many(batch)
        for m in batch:
            self.state[key(m)] = "unread"

    @rule()
    def put_one(self) -> None:
        m = self._new(0)
        self.q.put(m)
        self.state[key(m)] = "unread"

    @rule(limit=st.integers(1, 25))
    def read(self, limit: int) -> None:
        for position, m in self.q.read_many(limit):
            self.state[key(m)] = "read"
            self.positions[position] = key(m)

    @rule(data=st.data())
    def ack_some(self, data: st.DataObject) -> None:
        if not self.positions:
            return
        chosen = data.draw(st.lists(st.sampled_from(sorted(self.positions)), unique=True,
                                    max_size=10))
        self.q.ack_many(chosen)
        for position in chosen:
            self.state[self.positions.pop(position)] = "gone"

    @rule()
    def reopen(self) -> None:
        self.q.close()
        self.q = self._open()
        for k in self.positions.values():
            self.state[k] = "unread"
        self.positions.clear()

    @rule(data=st.data())
    def find(self, data: st.DataObject) -> None:
        if not self.state:
            return
        k = data.draw(st.sampled_from(sorted(self.state)))
        found = self.q.find(k, key)
        expected = self.state[k]
        if expected == "gone":
            assert found is None
        else:
            assert found is not None
            assert key(found[0]) == k
            assert found[1] == (expected == "read")

    @invariant()
    def a_key_never_written_is_not_found(self) -> None:
        assert self.q.find(b"99999999", key) is None

    def teardown(self) -> None:
        self.q.close()
        shutil.rmtree(self.dir, ignore_errors=True)


TestFindModel = FindModel.TestCase
TestFindModel.settings = settings(max_examples=40, stateful_step_count=40, deadline=None,
                                  derandomize=True,
                                  suppress_health_check=[HealthCheck.too_slow])
