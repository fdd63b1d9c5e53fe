"""In-flight and deferred priority queues (actors.broker.pqueue) with plain numbers for time."""

from __future__ import annotations

import random
import sys

import pytest
from hypothesis import HealthCheck, settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, invariant, rule

from actors.broker.pqueue import DeferredQueue, DuplicateIdError, InFlightQueue, KeyedHeap


def filled(*entries: tuple[str, int]) -> InFlightQueue[str]:
    q: InFlightQueue[str] = InFlightQueue()
    for msg_id, deadline in entries:
        q.push(msg_id, deadline, f"item-{msg_id}")
    return q


# -- in-flight queue --------------------------------------------------------------


def test_expired_messages_pop_earliest_deadline_first() -> None:
    q = filled(("c", 30), ("a", 10), ("b", 20))
    assert q.pop_expired(100) == [("a", "item-a"), ("b", "item-b"), ("c", "item-c")]
    assert len(q) == 0


def test_pop_expired_takes_only_deadlines_at_or_before_now() -> None:
    q = filled(("a", 10), ("b", 20), ("c", 21))
    assert [i for i, _ in q.pop_expired(20)] == ["a", "b"]
    assert q.pop_expired(20) == []
    assert q.peek_deadline() == 21
    assert "c" in q


def test_pop_expired_stops_at_the_limit_and_leaves_the_rest() -> None:
    q = filled(*((str(i), i) for i in range(10)))
    assert [i for i, _ in q.pop_expired(100, limit=3)] == ["0", "1", "2"]
    assert [i for i, _ in q.pop_expired(100, limit=0)] == []
    assert len(q) == 7


def test_equal_deadlines_pop_in_insertion_order() -> None:
    q = filled(("x", 5), ("a", 5), ("m", 5), ("b", 5))
    assert [i for i, _ in q.pop_expired(5)] == ["x", "a", "m", "b"]


def test_touch_moves_a_message_later_behind_equal_deadlines() -> None:
    # Given a and b due at 10 and c at 20
    q = filled(("a", 10), ("b", 10), ("c", 20))
    # When a is touched to 20
    q.update("a", 20)
    # Then b expires alone at 10, and a comes after c at 20
    assert [i for i, _ in q.pop_expired(10)] == ["b"]
    assert q.deadline_of("a") == 20
    assert q.pop_expired(20) == [("c", "item-c"), ("a", "item-a")]


def test_update_can_replace_the_item() -> None:
    q = filled(("a", 10))
    q.update("a", 11, "new")
    assert q.get("a") == "new"
    assert q.pop_expired(11) == [("a", "new")]


def test_remove_from_the_middle_returns_its_item_and_keeps_order() -> None:
    q = filled(("a", 1), ("b", 2), ("c", 3), ("d", 4))
    assert q.remove("c") == "item-c"
    assert "c" not in q
    assert len(q) == 3
    assert [i for i, _ in q.pop_expired(10)] == ["a", "b", "d"]


def test_removing_the_head_changes_the_next_deadline() -> None:
    q = filled(("a", 1), ("b", 2))
    q.remove("a")
    assert q.peek_deadline() == 2


def test_remove_and_update_of_an_unknown_id_raise_key_error() -> None:
    q = filled(("a", 1))
    with pytest.raises(KeyError):
        q.remove("zz")
    with pytest.raises(KeyError):
        q.update("zz", 5)
    q.remove("a")
    with pytest.raises(KeyError):
        q.remove("a")


def test_pushing_an_id_already_in_flight_is_refused() -> None:
    q = filled(("a", 1))
    with pytest.raises(DuplicateIdError, match="already queued"):
        q.push("a", 2, "other")
    assert q.get("a") == "item-a"


def test_an_id_can_be_pushed_again_after_it_left() -> None:
    q = filled(("a", 1))
    q.pop_expired(1)
    q.push("a", 5, "again")
    assert q.pop_expired(5) == [("a", "again")]


def test_empty_queue_has_no_deadline_and_pops_nothing() -> None:
    q: InFlightQueue[str] = InFlightQueue()
    assert q.peek_deadline() is None
    assert q.pop_expired(10**18) == []
    assert len(q) == 0
    assert not q


def test_get_returns_the_item_or_a_default() -> None:
    q = filled(("a", 1))
    assert q.get("a") == "item-a"
    assert q.get("b") is None
    assert q.get("b", "dflt") == "dflt"


def test_iteration_yields_ids_and_tolerates_removal_meanwhile() -> None:
    q = filled(("a", 3), ("b", 1), ("c", 2))
    seen = []
    for msg_id in q:
        seen.append(msg_id)
        q.remove(msg_id)
    assert sorted(seen) == ["a", "b", "c"]
    assert len(q) == 0


def test_items_lists_id_deadline_and_item() -> None:
    q = filled(("a", 3), ("b", 1))
    assert sorted(q.items()) == [("a", 3, "item-a"), ("b", 1, "item-b")]


def test_drain_empties_the_queue_earliest_first() -> None:
    q = filled(("a", 3), ("b", 1), ("c", 2))
    q.remove("c")
    assert q.drain() == [("b", "item-b"), ("a", "item-a")]
    assert len(q) == 0
    assert q.peek_deadline() is None


def test_float_and_nanosecond_deadlines_both_work() -> None:
    q: InFlightQueue[int] = InFlightQueue()
    q.push(b"f", 1.5, 1)
    q.push(b"n", 1_000_000_000, 2)
    assert q.pop_expired(2) == [(b"f", 1)]


def test_many_removals_keep_the_heap_small() -> None:
    # Given 10 000 messages in flight, all but 10 finished
    q: InFlightQueue[int] = InFlightQueue()
    for i in range(10_000):
        q.push(i, i, i)
    for i in range(10, 10_000):
        q.remove(i)
    # Then tombstones were compacted away and the survivors are intact
    assert len(q._heap) <= 2 * len(q) + 64
    assert [i for i, _ in q.pop_expired(10**9)] == list(range(10))


def test_repeated_touches_do_not_grow_the_heap_without_bound() -> None:
    q = filled(("a", 0), ("b", 0))
    for t in range(1, 5000):
        q.update("a", t)
    assert len(q._heap) <= 2 * len(q) + 64
    assert q.pop_expired(10**9) == [("b", "item-b"), ("a", "item-a")]


def test_repr_shows_size_and_next_deadline() -> None:
    assert repr(filled(("a", 7))) == "<InFlightQueue len=1 next=7>"


# -- deferred queue -----------------------------------------------------------------


def test_deferred_messages_pop_when_due_in_due_order() -> None:
    q: DeferredQueue[bytes] = DeferredQueue()
    q.push(b"late", 300, b"L")
    q.push(b"soon", 100, b"S")
    q.push(b"mid", 200, b"M")
    assert q.peek_due() == 100
    assert q.pop_due(99) == []
    assert q.pop_due(200) == [(b"soon", b"S"), (b"mid", b"M")]
    assert q.due_of(b"late") == 300
    assert q.pop_due(1000, limit=5) == [(b"late", b"L")]
    assert q.peek_due() is None


def test_deferred_message_can_be_removed_before_it_is_due() -> None:
    q: DeferredQueue[str] = DeferredQueue()
    q.push("a", 5, "A")
    q.push("b", 6, "B")
    assert q.remove("a") == "A"
    assert "a" not in q
    assert len(q) == 1
    assert q.pop_due(10) == [("b", "B")]


# -- model-based: random operation sequences ------------------------------------------


class KeyedHeapModel(RuleBasedStateMachine):
    """push / remove / update / pop_until behave like a dict sorted by (priority, seq)."""

    def __init__(self) -> None:
        super().__init__()
        self.q: KeyedHeap[int] = KeyedHeap()
        self.model: dict[int, tuple[int, int, int]] = {}  # id -> (priority, seq, item)
        self.seq = 0

    def _stamp(self) -> int:
        self.seq += 1
        return self.seq

    @rule(msg_id=st.integers(0, 40), priority=st.integers(0, 30), item=st.integers())
    def push(self, msg_id: int, priority: int, item: int) -> None:
        if msg_id in self.model:
            with pytest.raises(DuplicateIdError):
                self.q.push(msg_id, priority, item)
        else:
            self.q.push(msg_id, priority, item)
            self.model[msg_id] = (priority, self._stamp(), item)

    @rule(msg_id=st.integers(0, 40))
    def remove(self, msg_id: int) -> None:
        if msg_id in self.model:
            assert self.q.remove(msg_id) == self.model.pop(msg_id)[2]
        else:
            with pytest.raises(KeyError):
                self.q.remove(msg_id)

    @rule(msg_id=st.integers(0, 40), priority=st.integers(0, 30))
    def update(self, msg_id: int, priority: int) -> None:
        if msg_id in self.model:
            self.q.update(msg_id, priority)
            self.model[msg_id] = (priority, self._stamp(), self.model[msg_id][2])
        else:
            with pytest.raises(KeyError):
                self.q.update(msg_id, priority)

    @rule(now=st.integers(-1, 32), limit=st.one_of(st.none(), st.integers(0, 5)))
    def pop_until(self, now: int, limit: int | None) -> None:
        due = sorted((p, s, k, i) for k, (p, s, i) in self.model.items() if p <= now)
        if limit is not None:
            due = due[:limit]
        expected = [(k, i) for _, _, k, i in due]
        assert self.q.pop_until(now, limit) == expected
        for k, _ in expected:
            del self.model[k]

    @invariant()
    def agrees_with_the_model(self) -> None:
        assert len(self.q) == len(self.model)
        assert len(self.q._heap) <= 2 * len(self.model) + 64
        assert set(self.q) == set(self.model)
        expected_peek = min((p for p, _, _ in self.model.values()), default=None)
        assert self.q.peek() == expected_peek


KeyedHeapModel.TestCase.settings = settings(
    max_examples=50,
    stateful_step_count=50,
    deadline=None,
    derandomize=True,
    suppress_health_check=[HealthCheck.too_slow],
)
test_keyed_heap_matches_a_sorted_dict_model = KeyedHeapModel.TestCase


def test_long_random_sequence_matches_a_simple_model() -> None:
    # Enough operations to trigger compaction many times (the stateful test stays small)
    rng = random.Random(1234)
    q: InFlightQueue[int] = InFlightQueue()
    model: dict[int, tuple[int, int]] = {}
    seq = 0
    now = 0
    for _ in range(50_000):
        op = rng.random()
        msg_id = rng.randrange(2000)
        if op < 0.4:
            if msg_id not in model:
                seq += 1
                d = now + rng.randrange(100)
                q.push(msg_id, d, msg_id)
                model[msg_id] = (d, seq)
        elif op < 0.7:
            if msg_id in model:
                q.remove(msg_id)
                del model[msg_id]
        elif op < 0.9:
            if msg_id in model:
                seq += 1
                d = now + rng.randrange(100)
                q.update(msg_id, d)
                model[msg_id] = (d, seq)
        else:
            now += rng.randrange(10)
            expected = sorted((v, k) for k, v in model.items() if v[0] <= now)
            assert [k for k, _ in q.pop_expired(now)] == [k for _, k in expected]
            for _, k in expected:
                del model[k]
        assert len(q) == len(model)
        assert len(q._heap) <= 2 * len(q) + 64


def test_push_run_and_remove_owned_serve_a_channels_batches():
    q: InFlightQueue = InFlightQueue()
    q.push_run([b"a"], 30, "c1", ["ma"], [1])
    q.push_run([b"b", b"c"], 10, "c2", ["mb", "mc"], [2, None])
    q.push_run([b"c2"], 20, "c1", ["mc2"], [-1])
    assert len(q) == 4
    assert q.remove_owned([b"a", b"b", b"zz"], "c1") == (["ma"], [1], [b"b", b"zz"])
    assert q.remove_owned([b"b", b"c"], "c2") == (["mb", "mc"], [2, None], [])
    assert q.pop_expired(100) == [(b"c2", ("mc2", -1, "c1"))]


def test_a_fin_in_delivery_order_and_one_out_of_it_take_the_same_messages() -> None:
    # Given two runs to one client, FINed as they came (across both runs), then one id
    # out of order (which turns the runs into their dict form) and one named twice
    q: InFlightQueue = InFlightQueue()
    q.push_run([1, 2, 3], 10, "c", ["m1", "m2", "m3"], [11, 12, 13])
    q.push_run([4, 5, 6], 20, "c", ["m4", "m5", "m6"], [14, 15, 16])
    assert q.remove_owned([1, 2, 3, 4], "c") == (["m1", "m2", "m3", "m4"], [11, 12, 13, 14], [])
    assert q.remove_owned([6, 6, 1], "c") == (["m6"], [16], [6, 1])
    # Then what is left is still in flight, under its run's deadline
    assert len(q) == 1
    assert 5 in q
    assert q.deadline_of(5) == 20
    assert q.pop_expired(19) == []
    assert q.pop_expired(20) == [(5, ("m5", 15, "c"))]


def test_runs_mixed_with_single_entries_match_a_simple_model() -> None:
    # Given a long random mix of runs (one deadline and one owner for many ids), single
    # pushes, FINs of many ids (remove_owned) as clients make them (their oldest in
    # delivery order), as stretches and at random, lookups (which turn every run into
    # its dict form), removes, TOUCHes (update) and sweeps with and without a limit
    rng = random.Random(99)
    q: InFlightQueue[tuple[str, int, str]] = InFlightQueue()
    model: dict[int, tuple[int, int, str]] = {}  # id -> (deadline, order, owner)
    delivered: dict[str, list[int]] = {"a": [], "b": []}  # each owner's ids in order
    order = 0
    now = 0
    next_id = 0
    for _ in range(20_000):
        op = rng.random()
        if op < 0.15:
            owner = rng.choice("ab")
            ids = list(range(next_id, next_id + rng.randrange(1, 300)))
            next_id = ids[-1] + 1
            d = now + rng.randrange(100)
            q.push_run(ids, d, owner, [f"m{i}" for i in ids], [i if i % 7 else None for i in ids])
            delivered[owner] += ids
            for i in ids:
                order += 1
                model[i] = (d, order, owner)
        elif op < 0.2:
            order += 1
            d = now + rng.randrange(100)
            q.push(next_id, d, (f"m{next_id}", next_id if next_id % 7 else None, "a"))
            delivered["a"].append(next_id)
            model[next_id] = (d, order, "a")
            next_id += 1
        elif op < 0.55 and model:
            owner = rng.choice("ab")
            kind = rng.random()
            if kind < 0.5:  # as a consumer FINs: its oldest, in delivery order
                mine = [i for i in delivered[owner] if i in model]
                skip = rng.choice([0, 0, 0, 1, 5])
                ids = mine[skip : skip + rng.randrange(1, 700)]
            elif kind < 0.75:  # a stretch of ids, any owner's
                keys = sorted(model)
                start = rng.randrange(len(keys))
                ids = keys[start : start + rng.randrange(1, 400)]
            else:
                ids = rng.sample(sorted(model), min(len(model), rng.randrange(1, 400)))
            if ids and rng.random() < 0.2:  # an id named twice, and one never in flight
                ids.insert(rng.randrange(len(ids) + 1), rng.choice(ids))
                ids.insert(rng.randrange(len(ids) + 1), -1)
            msgs, handles, failed = q.remove_owned(ids, owner)
            mine, others, gone = [], [], set()
            for i in ids:
                if i in model and model[i][2] == owner and i not in gone:
                    mine.append(i)
                    gone.add(i)
                else:
                    others.append(i)
            assert msgs == [f"m{i}" for i in mine]
            assert handles == [i if i % 7 else None for i in mine]
            assert failed == others
            for i in mine:
                del model[i]
        elif op < 0.6 and model:
            i = rng.choice(sorted(model))
            assert q.get(i) == (f"m{i}", i if i % 7 else None, model[i][2])
            assert q.deadline_of(i) == model[i][0]
        elif op < 0.7 and model:
            i = rng.choice(sorted(model))
            assert q.remove(i) == (f"m{i}", i if i % 7 else None, model.pop(i)[2])
        elif op < 0.8 and model:
            i = rng.choice(sorted(model))
            order += 1
            d = now + rng.randrange(100)
            q.update(i, d)
            model[i] = (d, order, model[i][2])
        else:
            now += rng.randrange(20)
            limit = rng.choice([None, 1, 7, 150])
            due = sorted((v[0], v[1], k) for k, v in model.items() if v[0] <= now)
            if limit is not None:
                due = due[:limit]
            # Then sweeps pop the same ids, earliest deadline first, ties in insertion order
            assert [k for k, _ in q.pop_expired(now, limit)] == [k for _, _, k in due]
            for _, _, k in due:
                del model[k]
        assert len(q) == len(model)
        assert len(q._heap) <= 2 * len(q) + 64
    # And a drain gives what is left in the same order
    rest = sorted((v[0], v[1], k) for k, v in model.items())
    assert [k for k, _ in q.drain()] == [k for _, _, k in rest]


@pytest.mark.parametrize("form", ["lists", "dict"])
def test_a_run_mostly_finished_lets_go_of_what_its_members_held(form: str) -> None:
    # Given a run of 2,000 messages of which a client FINs all but one, as they come;
    # kept as lists, or in its dict form (a lookup turns every run into it)
    q: InFlightQueue[tuple[str, int, str]] = InFlightQueue()
    ids = list(range(2000))
    q.push_run(list(ids), 10, "c", [f"m{i}" for i in ids], list(ids))
    if form == "dict":
        assert q.get(0) == ("m0", 0, "c")

    def held() -> int:
        run = q._heap[0]
        return sum(map(sys.getsizeof, run[3:] if form == "dict" else run[5:8]))

    full = held()
    for k in range(0, 1999, 50):
        q.remove_owned(ids[k:min(k + 50, 1999)], "c")
    # Then the run takes little room (a dict keeps its table as keys leave, a list its
    # room: rebuilt, or cut), and the one left times out as before
    assert held() * 16 < full
    assert q.pop_expired(10) == [(1999, ("m1999", 1999, "c"))]
    assert len(q) == 0
