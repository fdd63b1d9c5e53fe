"""In-flight and deferred priority queues of a channel (pure: ``now`` is passed in).

Theory of operation
-------------------
nsqd's channel keeps two priority queues, both swept by the queue scanner
(``processInFlightQueue(t)`` / ``processDeferredQueue(t)``):

* the **in-flight queue**: delivered, not yet finished messages, ordered by the
  deadline after which they are requeued (FIN removes, REQ removes, TOUCH
  moves the deadline later, the sweep pops everything that has expired);
* the **deferred queue**: messages waiting for their due time (DPUB, REQ with
  a delay); the sweep pops everything that is due.

Both are :class:`KeyedHeap` s: a binary heap (``heapq``, in C) of entries
``[priority, sequence, key, item]`` plus a dict ``key -> entry``.

*Priorities* are plain numbers compared with ``<=``; the broker uses **int
nanoseconds** (like NSQ's ``time.Now().UnixNano()`` and like
:mod:`storage.delayed`), e.g. ``deadline = now_ns + timeout_ns``.  The queues
never read a clock; do not mix units within one queue.

*Ties* are broken by the sequence number, so entries with equal priorities pop
in insertion order; an ``update`` counts as a fresh insertion.

*Removal is lazy.*  ``remove`` (FIN, by far the most frequent operation) only
drops the key from the dict and turns the heap entry into a tombstone, in
O(1); ``update`` (TOUCH) tombstones the old entry and pushes a new one, in
O(log n).  Tombstones are discarded when they reach the top of the heap, and
when they outnumber the live entries the heap is rebuilt without them
(``heapify``, O(n)), checked after every remove, update and pop.  A rebuild
happens only after at least half the heap became tombstones since the
previous one, so its cost is amortised O(1) per removal, and the heap never
holds more than twice the live entries (plus a small constant).
The alternative, nsq's heap with an index stored in every entry, makes
``remove`` O(log n) *in Python* (sift loops are interpreted); lazy deletion
keeps every sift inside ``heapq``'s C code.

*Runs.*  A channel delivers a run of messages to one client with one
deadline; :meth:`InFlightQueue.push_run` gives such a run a single heap
entry.  In its *dict form* it is ``[priority, sequence, RUN, members,
size]``, whose *members* are a dict ``key -> item`` of its live messages,
in order; the index maps each member's key to the run itself.  Building
that form is a dict build and a dict update in C, not a heap entry or a
Python object per message; removing a member deletes it from both dicts.
(A run is pushed in the cheaper form of "Runs kept as lists" below, and
turned into this one when it has to be.)  A run's members
share their owner (what one client got in one delivery pass), so a FIN of
a stretch of one run checks the owner once and pops the stretch in C.  A
run whose members are all gone becomes a tombstone itself, and one mostly
gone (its members fewer than a quarter of `size`, how many it held when
last built) is rebuilt with only them, since a dict keeps its table when
keys leave: a run never holds on to much more than its live members.  A popped run yields its
members in order; ties between runs and single entries of equal priority
still go by sequence, i.e. insertion order.

*Runs kept as lists.*  That dict form still costs two dict inserts a
message at the push and two deletes at the FIN, a third of a channel's
work when a consumer keeps up.  So the in-flight queue keeps a run as it
was delivered: ``[deadline, sequence, LIST, None, 0, ids, messages,
handles, owner, lo]``, three lists it owns and the position ``lo`` of its
first live member, and it lists each owner's runs in delivery order.  A
consumer FINs what it got in the order it got it, so a FIN's ids are
mostly the next members of one of its owner's oldest runs: such a stretch
is checked by comparing a slice of the FIN with a slice of the run's ids,
taken by slicing, and ``lo`` moves past it (the lists are cut once more
than half is gone).  Pushing a run does nothing per message, nor does
finishing it in order.  Anything else (an id out of that order, one of
another owner, ``get``, ``remove``, ``update``, ``in``, a sweep that finds
a deadline due) first turns every run kept as lists into the dict form and
indexes it, which is what the push would have cost; each run is turned at
most once, and later runs are kept as lists again.

Pops return the earliest entries first: ``pop_expired(now)`` returns every
entry whose priority is ``<= now`` (nsq's ``PeekAndShift`` loop), optionally
at most ``limit`` of them.  Not thread-safe: a queue has one owner (an actor).
"""

from __future__ import annotations

import heapq
import itertools
import operator
from collections import deque
from collections.abc import Hashable, Iterable, Iterator
from itertools import repeat
from typing import Any, Generic, TypeVar

__all__ = ["DeferredQueue", "DuplicateIdError", "InFlightQueue", "KeyedHeap"]

T = TypeVar("T")

_DEAD: Any = object()  # key of a tombstoned heap entry
_RUN: Any = object()  # key of a run's heap entry (see "Runs"; its item: the members)
_PRIORITY, _SEQ, _KEY, _ITEM = 0, 1, 2, 3
_SIZE = 4  # a run's member count when its members dict was built
_COMPACT_MIN = 64  # heaps (and runs) smaller than this are never rebuilt
_MISSING: Any = object()
# An in-flight run kept as lists (see "Runs kept as lists"): [deadline, seq, _LIST,
# None, 0, ids, messages, handles, owner, lo], its live members those from `lo` on.
_LIST: Any = object()
_IDS, _MSGS, _HANDLES, _RUN_OWNER, _LO = 5, 6, 7, 8, 9
_HELD_BY = 2  # where an in-flight item (message, handle, owner) names its owner
_MESSAGE_OF, _HANDLE_OF = operator.itemgetter(0), operator.itemgetter(1)


class DuplicateIdError(ValueError):
    """The id is already in the queue (nsqd: "ID already in flight")."""


class KeyedHeap(Generic[T]):
    """A min-heap of items keyed by id, with O(1) removal and O(log n) re-prioritisation."""

    __slots__ = ("_heap", "_index", "_seq")

    def __init__(self) -> None:
        self._heap: list[list[Any]] = []
        self._index: dict[Hashable, list[Any]] = {}
        self._seq = itertools.count()

    # -- mutation -------------------------------------------------------------

    def push(self, msg_id: Hashable, priority: float, item: T) -> None:
        """Add ``item`` under ``msg_id``; :class:`DuplicateIdError` if it is already queued."""
        if msg_id in self._index:
            msg = f"id {msg_id!r} is already queued"
            raise DuplicateIdError(msg)
        entry = [priority, next(self._seq), msg_id, item]
        self._index[msg_id] = entry
        heapq.heappush(self._heap, entry)

    def remove(self, msg_id: Hashable) -> T:
        """Remove ``msg_id`` and return its item; ``KeyError`` if absent.  O(1)."""
        item = _detach(self._index.pop(msg_id), msg_id)
        heap = self._heap
        if len(heap) > _COMPACT_MIN and len(heap) > 2 * len(self._index):
            self._compact()
        return item

    def update(self, msg_id: Hashable, priority: float, item: T = _MISSING) -> None:
        """Move ``msg_id`` to a new priority, optionally replacing its item; ``KeyError`` if absent.

        The entry goes behind existing entries of equal priority.
        """
        was = _detach(self._index[msg_id], msg_id)
        entry = [priority, next(self._seq), msg_id, was if item is _MISSING else item]
        self._index[msg_id] = entry
        heapq.heappush(self._heap, entry)
        if len(self._heap) > _COMPACT_MIN and len(self._heap) > 2 * len(self._index):
            self._compact()

    def pop_until(self, now: float, limit: int | None = None) -> list[tuple[Any, T]]:
        """Pop each ``(msg_id, item)`` with priority ``<= now``, earliest first, up to ``limit``."""
        heap = self._heap
        index = self._index
        out: list[tuple[Any, T]] = []
        if limit is None:
            limit = len(index)
        heappop = heapq.heappop
        while heap and len(out) < limit and heap[0][_PRIORITY] <= now:
            entry = heap[0]
            key = entry[_KEY]
            if key is _RUN:
                self._pop_run(entry, limit - len(out), out)
                continue
            heappop(heap)
            if key is _DEAD:
                continue
            del index[key]
            out.append((key, entry[_ITEM]))
        if len(heap) > _COMPACT_MIN and len(heap) > 2 * len(index):
            self._compact()
        return out

    def _pop_run(self, run: list[Any], room: int, out: list[tuple[Any, T]]) -> None:
        """Take up to `room` live members of `run` (the heap's top) into `out`; the run
        leaves the heap once it has none left."""
        index = self._index
        members = run[_ITEM]
        if room < len(members):
            take = list(itertools.islice(members.items(), room))
            for key, _ in take:
                del members[key]
            _member_gone(run)
        else:
            take = list(members.items())
            heapq.heappop(self._heap)
            run[_KEY], run[_ITEM] = _DEAD, None
        for key, _ in take:
            del index[key]
        out += take

    def drain(self) -> list[tuple[Any, T]]:
        """Remove and return every ``(key, item)``, earliest first."""
        live = sorted(((e[_PRIORITY], e[_SEQ], i, key, item)
                       for e in self._heap if e[_KEY] is not _DEAD
                       for i, (key, item) in enumerate(_entry_items(e))),
                      key=lambda t: t[:3])
        self.clear()
        return [(key, item) for *_, key, item in live]

    def clear(self) -> None:
        """Forget every entry."""
        self._heap.clear()
        self._index.clear()

    def _compact(self) -> None:
        self._heap = [e for e in self._heap if e[_KEY] is not _DEAD]
        heapq.heapify(self._heap)

    # -- queries ----------------------------------------------------------------

    def peek(self) -> float | None:
        """The earliest priority, or ``None`` when empty."""
        heap = self._heap
        while heap and heap[0][_KEY] is _DEAD:
            heapq.heappop(heap)
        return heap[0][_PRIORITY] if heap else None

    def get(self, msg_id: Hashable, default: Any = None) -> T | Any:
        """The item under ``msg_id``, or ``default``."""
        entry = self._index.get(msg_id)
        return default if entry is None else _item(entry, msg_id)

    def priority_of(self, msg_id: Hashable) -> float:
        """The priority of ``msg_id``; ``KeyError`` if absent."""
        return self._index[msg_id][_PRIORITY]

    def items(self) -> list[tuple[Any, float, T]]:
        """A snapshot of ``(key, priority, item)`` in insertion/update order."""
        return [(k, e[_PRIORITY], _item(e, k)) for k, e in self._index.items()]

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, key: object) -> bool:
        return key in self._index

    def __iter__(self) -> Iterator[Any]:
        """Iterate over a snapshot of the keys, so the queue may change meanwhile."""
        return iter(list(self._index))

    def __repr__(self) -> str:
        return f"<{type(self).__name__} len={len(self)} next={self.peek()!r}>"


def _item(entry: list[Any], key: Any) -> Any:
    """The item of `key`, whose index entry is `entry` (a run, or its own)."""
    return entry[_ITEM][key] if entry[_KEY] is _RUN else entry[_ITEM]


def _entry_items(entry: list[Any]) -> Iterable[tuple[Any, Any]]:
    """A live heap entry's ``(key, item)`` s: a run's members, or the entry's own."""
    return entry[_ITEM].items() if entry[_KEY] is _RUN else ((entry[_KEY], entry[_ITEM]),)


def _detach(entry: list[Any], key: Any) -> Any:
    """Take `key` (whose index entry is `entry`) out of the heap: its item."""
    if entry[_KEY] is _RUN:
        item = entry[_ITEM].pop(key)
        _member_gone(entry)
        return item
    item = entry[_ITEM]
    entry[_KEY] = _DEAD
    entry[_ITEM] = None
    return item


def _member_gone(run: list[Any]) -> None:
    """Members of `run` left: a tombstone once none is left, rebuilt once mostly gone."""
    members = run[_ITEM]
    if not members:
        run[_KEY], run[_ITEM] = _DEAD, None
    elif len(members) * 4 < run[_SIZE] and run[_SIZE] > _COMPACT_MIN:
        run[_ITEM] = dict(members)
        run[_SIZE] = len(members)


class InFlightQueue(KeyedHeap[T]):
    """Delivered messages by message id, ordered by their timeout deadline (int ns).

    Items are tuples ``(message, handle, owner)``, ``owner`` naming the client that
    holds the message.  The two batch methods serve a channel's hot path with one call
    instead of one per message: :meth:`push_run` (a run delivered to one client) and
    :meth:`remove_owned` (a FIN of many ids); see "Runs kept as lists" above.
    """

    __slots__ = ("_lazy", "_lazy_count")

    def __init__(self) -> None:
        super().__init__()
        self._lazy: dict[Any, deque[list[Any]]] = {}  # owner -> its list runs, in order
        self._lazy_count = 0  # live members of list runs (not in the index)

    def push_run(self, msg_ids: list[Any], deadline: float, owner: Any,
                 msgs: list[Any], handles: list[Any]) -> None:
        """``push`` of ids not in flight, delivered together to `owner` with one deadline,
        as one run whose items are ``(msgs[i], handles[i], owner)``.  The run keeps the
        three lists (it owns them from now on); nothing is done per message."""
        if msg_ids:
            run = [deadline, next(self._seq), _LIST, None, 0, msg_ids, msgs, handles, owner, 0]
            runs = self._lazy.get(owner)
            if runs is None:
                self._lazy[owner] = deque((run,))
            else:
                runs.append(run)
            self._lazy_count += len(msg_ids)
            heapq.heappush(self._heap, run)

    def remove_owned(self, msg_ids: list[Any], owner: Any
                     ) -> tuple[list[Any], list[Any], list[Any]]:
        """Remove the ids held by ``owner``: ``(their messages, their handles, the ids
        that were not held by it)``, in the order named.

        A FIN names the messages of a delivery in the order they came, so the ids mostly
        form stretches of a run's next members: such a stretch is checked by comparing
        list slices and taken by slicing, in C.  Any other id first turns every run into
        its dict form and is then looked up by the index."""
        msgs: list[Any] = []
        handles: list[Any] = []
        n = len(msg_ids)
        at = 0
        runs = self._lazy.get(owner)
        while runs and at < n:
            msg_id = msg_ids[at]
            for run in itertools.islice(runs, 4):  # (the oldest, most likely)
                if run[_IDS][run[_LO]] == msg_id:
                    break
            else:
                break
            ids, lo = run[_IDS], run[_LO]
            k = min(n - at, len(ids) - lo)
            if at == 0 and lo == 0 and k == n == len(ids):
                same = msg_ids == ids
            else:
                same = msg_ids[at : at + k] == ids[lo : lo + k]
            if not same:  # where the stretch ends (its first id matched)
                k = list(map(operator.eq, msg_ids[at : at + k], ids[lo : lo + k])).index(False)
            end = lo + k
            msgs += run[_MSGS][lo:end]
            handles += run[_HANDLES][lo:end]
            at += k
            self._lazy_count -= k
            if end == len(ids):
                run[_KEY] = _DEAD
                del run[_IDS:]
                if runs[0] is run:
                    runs.popleft()
                else:
                    runs.remove(run)
            elif end > _COMPACT_MIN and 2 * end > len(ids):  # let go of what was taken
                del run[_IDS][:end], run[_MSGS][:end], run[_HANDLES][:end]
                run[_LO] = 0
            else:
                run[_LO] = end
        if runs is not None and not runs:
            del self._lazy[owner]
        failed: list[Any] = []
        if at < n:
            self._by_index(msg_ids[at:] if at else msg_ids, owner, msgs, handles, failed)
        heap = self._heap
        if len(heap) > _COMPACT_MIN and len(heap) > 2 * (len(self._index) + self._lazy_count):
            self._compact()
        return msgs, handles, failed

    def _by_index(self, msg_ids: list[Any], owner: Any, msgs: list[Any],
                  handles: list[Any], failed: list[Any]) -> None:
        """`remove_owned` of ids looked up in the index, every run in its dict form."""
        self._to_dicts()
        index = self._index
        n = len(msg_ids)
        at = 0
        while at < n:
            msg_id = msg_ids[at]
            entry = index.get(msg_id)
            if entry is None:
                failed.append(msg_id)
                at += 1
                continue
            if entry[_KEY] is not _RUN:
                item = entry[_ITEM]
                if item[_HELD_BY] != owner:
                    failed.append(msg_id)
                else:
                    msgs.append(item[0])
                    handles.append(item[1])
                    entry[_KEY] = _DEAD
                    entry[_ITEM] = None
                    del index[msg_id]
                at += 1
                continue
            members = entry[_ITEM]
            item = members[msg_id]
            if item[_HELD_BY] != owner:
                failed.append(msg_id)
                at += 1
                continue
            end = at + 1
            if end == n or msg_ids[end] not in members:  # on its own
                del members[msg_id]
                del index[msg_id]
                msgs.append(item[0])
                handles.append(item[1])
                if not len(members) & 63:
                    _member_gone(entry)
                at = end
                continue
            # the stretch from `at` whose ids are members of this run, looked at in
            # chunks that double (so a short stretch costs a short look)
            end, step = end + 1, 16
            while end < n:
                inside = list(map(members.__contains__, msg_ids[end : end + step]))
                if not all(inside):
                    end += inside.index(False)
                    break
                end += len(inside)
                step *= 2
            ids = msg_ids[at:end]
            at = end
            before = len(members)
            items = list(map(members.pop, ids, repeat(None)))
            deque(map(index.pop, ids, repeat(None)), maxlen=0)
            if before - len(members) != len(ids):  # an id named twice: the first took it
                failed += [i for i, item in zip(ids, items, strict=True) if item is None]
                items = [item for item in items if item is not None]
            msgs += map(_MESSAGE_OF, items)
            handles += map(_HANDLE_OF, items)
            _member_gone(entry)

    def _to_dicts(self) -> None:
        """Every run kept as lists becomes a run of the dict form, in the index (each run
        at most once: its cost is what indexing it at its push would have been)."""
        if not self._lazy_count:
            return
        index = self._index
        for runs in self._lazy.values():
            for run in runs:
                lo, owner = run[_LO], run[_RUN_OWNER]
                ids = run[_IDS][lo:]
                items = zip(run[_MSGS][lo:], run[_HANDLES][lo:], repeat(owner), strict=False)
                members = dict(zip(ids, items, strict=True))
                del run[_IDS:]
                run[_KEY], run[_ITEM], run[_SIZE] = _RUN, members, len(members)
                index.update(zip(ids, repeat(run)))
        self._lazy.clear()
        self._lazy_count = 0

    # -- what needs every id in the index ------------------------------------------

    def push(self, msg_id: Hashable, priority: float, item: T) -> None:
        self._to_dicts()
        super().push(msg_id, priority, item)

    def remove(self, msg_id: Hashable) -> T:
        self._to_dicts()
        return super().remove(msg_id)

    def update(self, msg_id: Hashable, priority: float, item: T = _MISSING) -> None:
        self._to_dicts()
        super().update(msg_id, priority, item)

    def pop_until(self, now: float, limit: int | None = None) -> list[tuple[Any, T]]:
        if self._lazy_count:
            due = self.peek()
            if due is None or due > now:  # (a sweep that finds nothing due changes nothing)
                return []
            self._to_dicts()
        return super().pop_until(now, limit)

    def drain(self) -> list[tuple[Any, T]]:
        self._to_dicts()
        return super().drain()

    def clear(self) -> None:
        super().clear()
        self._lazy.clear()
        self._lazy_count = 0

    def get(self, msg_id: Hashable, default: Any = None) -> T | Any:
        self._to_dicts()
        return super().get(msg_id, default)

    def priority_of(self, msg_id: Hashable) -> float:
        self._to_dicts()
        return super().priority_of(msg_id)

    def items(self) -> list[tuple[Any, float, T]]:
        self._to_dicts()
        return super().items()

    def __len__(self) -> int:
        return len(self._index) + self._lazy_count

    def __contains__(self, key: object) -> bool:
        self._to_dicts()
        return key in self._index

    def __iter__(self) -> Iterator[Any]:
        self._to_dicts()
        return super().__iter__()

    # -- nsqd's names ---------------------------------------------------------------

    def pop_expired(self, now: float, limit: int | None = None) -> list[tuple[Any, T]]:
        """Pop the messages whose deadline is ``<= now``, earliest first (timeouts to requeue)."""
        return self.pop_until(now, limit)

    def peek_deadline(self) -> float | None:
        """The earliest deadline, or ``None`` when nothing is in flight."""
        return self.peek()

    def deadline_of(self, msg_id: Hashable) -> float:
        """The deadline of ``msg_id``; ``KeyError`` if it is not in flight."""
        return self.priority_of(msg_id)


class DeferredQueue(KeyedHeap[T]):
    """Deferred messages by message id, ordered by due time (int ns)."""

    __slots__ = ()

    def pop_due(self, now: float, limit: int | None = None) -> list[tuple[Any, T]]:
        """Pop the messages due at ``now`` (due time ``<= now``), earliest first."""
        return self.pop_until(now, limit)

    def peek_due(self) -> float | None:
        """The earliest due time, or ``None`` when nothing is deferred."""
        return self.peek()

    def due_of(self, msg_id: Hashable) -> float:
        """The due time of ``msg_id``; ``KeyError`` if it is not deferred."""
        return self.priority_of(msg_id)
