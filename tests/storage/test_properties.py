"""Property tests: random operation sequences against an in-memory model."""

from __future__ import annotations

import shutil
import tempfile
from collections import deque

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, precondition, rule

from storage import DiskQueue
from storage import diskqueue as dq_mod
from tests.storage.conftest import FakeMemory, ManualSyncer

messages = st.binary(min_size=0, max_size=300)
SETTINGS = settings(max_examples=60, stateful_step_count=40, deadline=None, derandomize=True,
                    suppress_health_check=[HealthCheck.too_slow])


class PlainQueueModel(RuleBasedStateMachine):
    """put / put_many / get / get_many / reopen / empty behave like a deque."""

    def __init__(self) -> None:
        super().__init__()
        self.dir = tempfile.mkdtemp(prefix="dqprop")
        self.model: deque[bytes] = deque()
        self.low_memory = FakeMemory(10)
        self.q = self._open()

    def _open(self) -> DiskQueue:
        return DiskQueue("p", self.dir, max_bytes_per_file=512, ring_size=8,
                         syncer=ManualSyncer(), memory_probe=self.low_memory)

    @rule(m=messages)
    def put(self, m: bytes) -> None:
        self.q.put(m)
        self.model.append(m)

    @rule(ms=st.lists(messages, max_size=30))
    def put_many(self, ms: list[bytes]) -> None:
        self.q.put_many(ms)
        self.model.extend(ms)

    @rule()
    def get(self) -> None:
        expected = self.model.popleft() if self.model else None
        assert self.q.get() == expected

    @rule(n=st.integers(1, 50))
    def get_many(self, n: int) -> None:
        expected = [self.model.popleft() for _ in range(min(n, len(self.model)))]
        assert self.q.get_many(n) == expected

    @rule()
    def reopen(self) -> None:
        self.q.close()
        self.q = self._open()

    @rule(percent=st.sampled_from([10, 50, 90]))
    def memory_pressure(self, percent: int) -> None:
        self.low_memory.percent = percent

    @precondition(lambda self: len(self.model) < 5)
    @rule()
    def empty(self) -> None:
        self.q.empty()
        self.model.clear()

    @invariant()
    def depth_matches(self) -> None:
        assert self.q.depth() == len(self.model)

    def teardown(self) -> None:
        self.q.close()
        shutil.rmtree(self.dir)


class AckQueueModel(RuleBasedStateMachine):
    """In ack mode, a reopen (after a close or a crash) brings back exactly the unacked
    messages, in order, with the ack journal compacted often on the way."""

    def __init__(self) -> None:
        super().__init__()
        self.compact_min, dq_mod.JOURNAL_COMPACT_MIN = dq_mod.JOURNAL_COMPACT_MIN, 4
        self.crashed: list[DiskQueue] = []  # (dropped, not closed: closed at the end)
        self.dir = tempfile.mkdtemp(prefix="dqack")
        self.unread: list[tuple[int, bytes]] = []  # (seq, payload) not handed out
        self.pending: dict[int, tuple[int, bytes]] = {}  # position -> (seq, payload), read order
        self.acked: set[int] = set()
        self.seq = 0
        self.q = self._open()

    def _open(self) -> DiskQueue:
        return DiskQueue("a", self.dir, max_bytes_per_file=400, ack_mode=True, ring_size=4,
                         syncer=ManualSyncer(), memory_probe=FakeMemory(10))

    def _add(self, ms: list[bytes]) -> None:
        for m in ms:
            self.unread.append((self.seq, m))
            self.seq += 1

    @rule(m=messages)
    def put(self, m: bytes) -> None:
        self.q.put(m)
        self._add([m])

    @rule(ms=st.lists(messages, max_size=20))
    def put_many(self, ms: list[bytes]) -> None:
        self.q.put_many(ms)
        self._add(ms)

    @rule(n=st.integers(1, 20))
    def read(self, n: int) -> None:
        got = self.q.read_many(n)
        expected, self.unread = self.unread[:n], self.unread[n:]
        assert [m for _, m in got] == [m for _, m in expected]
        for (pos, _), item in zip(got, expected, strict=True):
            self.pending[pos] = item

    @rule(data=st.data())
    def ack_some(self, data: st.DataObject) -> None:
        if not self.pending:
            return
        chosen = data.draw(st.lists(st.sampled_from(sorted(self.pending)), unique=True))
        assert self.q.ack_many(chosen) == len(chosen)
        for p in chosen:
            del self.pending[p]
        self.acked.update(chosen)

    @rule(n=st.integers(1, 20), again=st.booleans())
    def ack_oldest(self, n: int, again: bool) -> None:
        """The n oldest pending in read order (a consumer FINing a batch), perhaps with
        an already-acked position at the end, which counts nothing."""
        chosen = list(self.pending)[:n]
        extra = [min(self.acked)] if again and self.acked else []
        assert self.q.ack_many(chosen + extra) == len(chosen)
        for p in chosen:
            del self.pending[p]
        self.acked.update(chosen)

    @rule(crash=st.booleans())
    def reopen(self, crash: bool) -> None:
        if crash:  # what the OS has (every write and ack returned) is what a reopen finds
            self.crashed.append(self.q)
        else:
            self.q.close()
        self.q = self._open()
        self.unread = sorted([*self.pending.values(), *self.unread])
        self.pending.clear()

    @invariant()
    def counts_match(self) -> None:
        assert self.q.depth() == len(self.unread)
        assert self.q.pending() == len(self.pending)

    def teardown(self) -> None:
        dq_mod.JOURNAL_COMPACT_MIN = self.compact_min
        for q in [*self.crashed, self.q]:
            q.close()
        shutil.rmtree(self.dir)


TestPlainQueue = PlainQueueModel.TestCase
TestPlainQueue.settings = SETTINGS
TestAckQueue = AckQueueModel.TestCase
TestAckQueue.settings = SETTINGS


@st.composite
def _runs_and_acks(draw: st.DrawFn) -> tuple[list[list[int]], list[list[int]]]:
    """Runs of ascending positions (gaps between and within them), and ack lists: stretches
    of consecutive handed-out positions (across runs too), shuffled picks, repeats and
    positions never handed out."""
    runs, at = [], draw(st.integers(0, 5))
    for _ in range(draw(st.integers(1, 8))):
        run = []
        for _ in range(draw(st.integers(1, 12))):
            at += draw(st.integers(1, 3))
            run.append(at)
        runs.append(run)
        at += draw(st.integers(1, 5))
    every = [p for run in runs for p in run]
    acks = []
    for _ in range(draw(st.integers(0, 10))):
        kind = draw(st.sampled_from(["stretch", "picks", "strangers"]))
        if kind == "stretch":
            i = draw(st.integers(0, len(every) - 1))
            acks.append(every[i : i + draw(st.integers(1, 30))])
        elif kind == "picks":
            acks.append(draw(st.lists(st.sampled_from(every), max_size=15)))
        else:
            acks.append(draw(st.lists(st.integers(0, at + 5), max_size=5)))
    return runs, acks


@given(_runs_and_acks(), st.data())
@settings(max_examples=300, deadline=None, derandomize=True)
def test_runs_ack_as_a_set_of_pending_positions_would(case, data) -> None:
    """`_Runs` (ack mode's bookkeeping by runs and stretches) against a set: what each ack
    finishes, what stays pending, the floor, and the positions acked above it."""
    runs, acks = case
    model = dq_mod._Runs()
    pending: set[int] = set()
    base_of: dict[int, int] = {}
    order: list[int] = []
    for run in runs:
        skipped = data.draw(st.booleans()) and len(runs) > 1 and bool(order)
        model.add(list(run), 100 + run[0], pending=not skipped)
        if not skipped:
            pending.update(run)
        order += run
        base_of.update({p: 100 + run[0] + i for i, p in enumerate(run)})
    live = list(order)  # from the floor on, in read order
    for ack in acks:
        expected = []
        for p in ack:
            if p in pending:
                pending.discard(p)
                expected.append(p)
        assert model.ack(list(ack)) == expected
        while live and live[0] not in pending:
            live.pop(0)
        assert model.pending == len(pending)
        assert model.floor() == ((live[0], base_of[live[0]]) if live else None)
        assert model.total - model.pending == len([p for p in live if p not in pending])
        assert model.acked_early() == [p for p in live if p not in pending]
        assert all(model.is_pending(p) == (p in pending) for p in [*order, -1, order[-1] + 1])
    assert bool(model) == bool(live)
