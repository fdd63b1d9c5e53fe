"""The pure state machine of a channel: queueing, RDY, in-flight, deferred, requeue.

Theory of operation
-------------------
A channel holds NSQ-encoded messages (``actors.broker.nsq_message``) and hands each one
to one of its subscribed clients.  It keeps:

* ``ready``: messages waiting for a client, oldest first (a
  :class:`ReadyQueue`).  Each carries a
  *handle* saying where the message is durable: ``None`` (memory only),
  a disk-queue position (``int >= 0``: the channel's disk queue runs in
  ack-position mode, so the message stays on disk until it is finished) or
  ``DELAYED`` (kept in the channel's persistent delayed store by id).
* ``disk_depth``: messages in the disk queue not yet read into ``ready``;
  reads are asked for in batches when ``ready`` runs dry.
* ``in_flight``: delivered and not yet finished, by message id, with the
  client and a deadline (``now + the client's msg timeout``).
* ``deferred``: messages due later (DPUB, REQ with a delay), by id.
* ``clients``: subscribed clients, each with its RDY count and in-flight
  count; a client is *ready* while ``in_flight < rdy``.

Nothing here does I/O, reads a clock or logs.  Methods take ``now`` (wall
clock nanoseconds: deferred due times are persisted) and record what the
actor must do in :class:`Effects`: messages to deliver per client, to write
to disk, positions to ack, entries for the delayed store, disk reads to
request, messages for the dead-letter topic.  The actor applies the effects
in order (a delayed-store add is always applied before the ack that releases
the same message from the disk queue, so a crash between them duplicates
rather than loses).

Delivery (``pump``) picks a random ready client for every message -- nsqd's
load balancing inside a channel.  When exactly one client is ready, that
choice is made once for the whole run of messages it has room for, which go
out as one slice.  A message is stored with the attempts number its next
delivery shows (``actors.broker.nsq_message``), so a delivery sends the bytes as
they are, and a message that comes back (REQ, timeout, client gone) is
rewritten with one attempt more.  A message whose next delivery would exceed
``max_attempts`` goes to the dead-letter topic instead.
"""

from __future__ import annotations

import itertools
import operator
import random
from dataclasses import dataclass, field
from typing import Any

from actors.broker.e2e import LatencyWindow
from actors.broker.errors import BrokerError, fin_failed, invalid, req_failed, touch_failed
from actors.broker.nsq_message import FIRST_ATTEMPT, message_id, next_attempt, with_attempts
from actors.broker.pqueue import DeferredQueue, InFlightQueue

DELAYED = -1
"""Handle of a message kept in the persistent delayed store (by message id)."""

_NOT_HELD = object()

MIN_SHARE = 128
"""The fewest messages a client is given in one run when several share what is ready
(unless it has less room, or less is ready): split evenly over 40 clients, a read of
512 went out as runs of 13, and every run is a frame and a FIN frame."""
ROOMY_SHARE = 5
"""Where an even share of what is ready falls under `MIN_SHARE`, a client takes up to a
fifth of its RDY instead (at least `MIN_SHARE`): a drain's 40 sessions of RDY 2500 took
a read of 4,096 as 32 runs of 128, and take it as 8 of 500.  Every run costs a frame
and its handling on each side."""

Handle = int | None


@dataclass
class ClientState:
    """One subscribed client, as the channel sees it."""

    name: str
    msg_timeout_ns: int
    rdy: int = 0
    in_flight: int = 0
    delivered: int = 0
    finished: int = 0
    requeued: int = 0
    timed_out: int = 0
    info: dict[str, Any] | None = None  # what the client said of itself (for /stats)
    rdy_seen: bool = False  # it has sent a RDY (a client just subscribed sends one next)

    @property
    def ready(self) -> bool:
        return self.in_flight < self.rdy


# An in-flight entry is a plain tuple (it is created for every delivery):
# (encoded bytes as delivered, durability handle, client name).
InFlight = tuple[bytes, Handle, str]
ENCODED, HANDLE, CLIENT = 0, 1, 2
_COMPACT_AT = 4096
_ID_OF = operator.itemgetter(slice(10, 26))


class ReadyQueue:
    """Messages waiting for a client, oldest first: ``(handle, encoded)`` pairs.

    Two parallel lists and a head index, so a batch goes in with two
    ``extend`` calls and a run goes out as two slices (:meth:`take`), instead
    of one tuple and one deque operation per message.  Taken slots are
    dropped once they are the larger part of the lists.
    """

    __slots__ = ("_handles", "_head", "_msgs")

    def __init__(self) -> None:
        self._handles: list[Handle] = []
        self._msgs: list[bytes] = []
        self._head = 0

    def __len__(self) -> int:
        return len(self._msgs) - self._head

    def __iter__(self) -> Any:
        return zip(self._handles[self._head :], self._msgs[self._head :], strict=True)

    def extend_memory(self, messages: list[bytes]) -> None:
        """Messages that live only in memory (handle ``None``)."""
        self._msgs += messages
        self._handles += [None] * len(messages)

    def extend(self, items: list[tuple[Handle, bytes]]) -> None:
        """``(handle, encoded)`` pairs, e.g. a batch read from the disk queue."""
        if items:
            handles, msgs = zip(*items, strict=True)
            self._handles += handles
            self._msgs += msgs

    def append(self, handle: Handle, encoded: bytes) -> None:
        self._handles.append(handle)
        self._msgs.append(encoded)

    def appendleft(self, handle: Handle, encoded: bytes) -> None:
        if self._head:
            self._head -= 1
            self._handles[self._head] = handle
            self._msgs[self._head] = encoded
        else:
            self._handles.insert(0, handle)
            self._msgs.insert(0, encoded)

    def popleft(self) -> tuple[Handle, bytes]:
        head = self._head
        if head >= len(self._msgs):
            raise IndexError("pop from an empty ReadyQueue")
        pair = self._handles[head], self._msgs[head]
        self._head = head + 1
        if head >= _COMPACT_AT:
            self._compact()
        return pair

    def take(self, n: int) -> tuple[list[Handle], list[bytes]]:
        """The oldest ``n`` (or fewer) as ``(handles, messages)``."""
        head = self._head
        end = head + n
        handles, msgs = self._handles[head:end], self._msgs[head:end]
        self._head = min(end, len(self._msgs))
        if self._head >= _COMPACT_AT:
            self._compact()
        return handles, msgs

    def clear(self) -> None:
        self._handles, self._msgs, self._head = [], [], 0

    def find(self, msg_id: bytes) -> bytes | None:
        """The waiting message whose id is `msg_id`, or None (a walk: at most the memory
        queue's size, plus a read batch)."""
        msgs = self._msgs
        try:  # (the walk in C: the ids as a map of slices, searched by indexOf)
            i = operator.indexOf(map(_ID_OF, itertools.islice(msgs, self._head, None)), msg_id)
        except ValueError:
            return None
        return msgs[self._head + i]

    def _compact(self) -> None:
        head = self._head
        if head == len(self._msgs):
            self.clear()
        elif 2 * head >= len(self._msgs):
            del self._handles[:head]
            del self._msgs[:head]
            self._head = 0


@dataclass
class Effects:
    """What the channel actor must do after a state change, in this order."""

    deliveries: dict[str, list[bytes]] = field(default_factory=dict)
    disk_put: list[bytes] = field(default_factory=list)
    delayed_add: list[tuple[int, bytes, bytes]] = field(default_factory=list)  # due, id, msg
    disk_ack: list[int] = field(default_factory=list)
    delayed_remove: list[bytes] = field(default_factory=list)
    disk_read: int = 0
    dead_letters: list[bytes] = field(default_factory=list)
    dropped: int = 0

    def __bool__(self) -> bool:
        return bool(self.deliveries or self.disk_put or self.delayed_add or self.disk_ack
                    or self.delayed_remove or self.disk_read or self.dead_letters)


@dataclass
class ChannelStats:
    message_count: int = 0
    requeue_count: int = 0
    timeout_count: int = 0
    dead_letter_count: int = 0
    dropped_count: int = 0


class ChannelState:
    """See the module docstring."""

    def __init__(self, *, mem_queue_size: int, durable: bool, max_rdy_count: int = 2500,
                 max_attempts: int = 0, read_batch: int = 512,
                 rng: random.Random | None = None) -> None:
        self.mem_queue_size = mem_queue_size
        self.durable = durable
        self.max_rdy_count = max_rdy_count
        self.max_attempts = max_attempts
        self.read_batch = read_batch
        self.rng = rng or random.Random()
        self.ready = ReadyQueue()
        self.disk_depth = 0
        self.reading = False
        # Messages sent to the disk queue since the last read was asked for: they queue
        # behind that read there, so its answer's depth does not count them yet.
        self.put_since_read = 0
        # Set when the disk queue reopened: what it had handed out is unread again, so
        # reads may bring copies of messages still in flight or deferred here.
        self.reread = False
        self.in_flight: InFlightQueue = InFlightQueue()
        self.deferred: DeferredQueue = DeferredQueue()
        self.clients: dict[str, ClientState] = {}
        self.paused = False
        self.stats = ChannelStats()
        self.effects = Effects()
        self.e2e: LatencyWindow | None = None  # FINs' end-to-end latency, when asked for

    # ------------------------------------------------------------------ intake

    def take_effects(self) -> Effects:
        effects, self.effects = self.effects, Effects()
        return effects

    def depth(self) -> int:
        """Messages waiting for a client (memory + disk), as nsqd reports it."""
        return len(self.ready) + self.disk_depth

    def put(self, messages: list[bytes]) -> None:
        """New messages from the topic: memory while there is room, then disk."""
        self.stats.message_count += len(messages)
        room = self.mem_queue_size - len(self.ready)
        if not self.durable:
            # An ephemeral channel has no disk, but what its clients can take now is
            # handed over, not dropped: nsqd's unbuffered memoryMsgChan (with
            # --mem-queue-size=0) gives a message to a waiting messagePump, and a client
            # just subscribed -- its RDY is on its way, in the same packet as its SUB --
            # counts as ready for the most it may ask, and so does the first client of a
            # channel that has none yet (the backlog a topic hands a new channel at once
            # may come before the SUB that created it: nsq_tail finds it on nsqd).
            room += sum(max(0, c.rdy - c.in_flight) if c.rdy_seen else self.max_rdy_count
                        for c in self.clients.values()) if self.clients \
                else self.max_rdy_count
        if self.disk_depth == 0 and not self.reading and room >= len(messages):
            self.ready.extend_memory(messages)
            return
        keep = max(0, room) if self.disk_depth == 0 and not self.reading else 0
        if keep:
            self.ready.extend_memory(messages[:keep])
            messages = messages[keep:]
        if self.durable:
            self.effects.disk_put.extend(messages)
            self.disk_depth += len(messages)
            self.put_since_read += len(messages)
        else:  # ephemeral: no disk behind the memory buffer
            self.stats.dropped_count += len(messages)
            self.effects.dropped += len(messages)

    def put_deferred(self, items: list[tuple[bytes, int]]) -> None:
        """Messages published with a delay: `(encoded, due_ns)`."""
        self.stats.message_count += len(items)
        for encoded, due in items:
            self._defer(encoded, None, due)

    def from_disk(self, items: list[tuple[int, bytes]], depth: int, again: int = 0) -> None:
        """A batch read from the disk queue: `(position, encoded)`, and the queue's unread
        count when it read them.  That count, plus what was sent to it after the read was
        asked for, is the disk depth: counting down by what came back would drift after
        a restart, and "nothing came back, so empty" would forget writes queued behind
        the read (their messages then stayed on disk, unread, until the next restart).
        The first `again` items were handed out before a crash or a restart (not FINed):
        their next delivery shows one attempt more, as a timeout's would."""
        self.reading = False
        self.disk_depth = depth + self.put_since_read
        if again:
            items = [(h, next_attempt(m)) for h, m in items[:again]] + items[again:]
        if self.reread:
            items = self._not_held(items)
        self.ready.extend(items)

    def disk_reopened(self, depth: int) -> None:
        """The disk queue restarted and counts `depth` unread: what it had handed out is
        unread again and comes back by later reads, so the copies waiting in ``ready``
        go (they would be delivered twice) and reads are checked against what is in
        flight or deferred until nothing is."""
        kept = [(h, m) for h, m in self.ready if h is None or h == DELAYED]
        if len(kept) != len(self.ready):
            self.ready.clear()
            self.ready.extend(kept)
        self.disk_depth = depth
        self.reading = False
        self.reread = True

    def _not_held(self, items: list[tuple[int, bytes]]) -> list[tuple[int, bytes]]:
        """`items` less the messages held here already (by id).  A copy at another place
        than the held one's on disk (another position, the delayed store) is acked: the
        held copy is what stays; one held only in memory leaves the disk copy un-acked,
        so a crash before that copy is finished delivers it again rather than lose it."""
        if not (self.in_flight or self.deferred):
            self.reread = False
            return items
        out = []
        for position, encoded in items:
            msg_id = encoded[10:26]
            held = self.in_flight.get(msg_id)
            handle = held[HANDLE] if held is not None else (
                self.deferred.get(msg_id, (None, _NOT_HELD))[1])
            if handle is _NOT_HELD:
                out.append((position, encoded))
            elif handle is not None and handle != position:
                self.effects.disk_ack.append(position)
        return out

    def restore(self, disk_depth: int, deferred: list[tuple[int, bytes, bytes]]) -> None:
        """State found in storage at start: disk depth and delayed-store entries."""
        self.disk_depth = disk_depth
        for due, msg_id, encoded in deferred:
            if msg_id not in self.deferred:
                self.deferred.push(msg_id, due, (encoded, DELAYED))

    # ----------------------------------------------------------------- clients

    def subscribe(self, client: str, msg_timeout_ns: int,
                  info: dict[str, Any] | None = None) -> None:
        state = self.clients.setdefault(client, ClientState(client, msg_timeout_ns))
        if info is not None:
            state.info = info

    def set_rdy(self, client: str, count: int) -> None:
        if not 0 <= count <= self.max_rdy_count:
            raise invalid(f"RDY count {count} out of range 0-{self.max_rdy_count}")
        state = self.clients.get(client)
        if state is None:
            raise invalid("cannot RDY in current state")
        state.rdy = count
        state.rdy_seen = True

    def unsubscribe(self, client: str) -> None:
        """A client left: its in-flight messages go back to the front of the queue at once."""
        if self.clients.pop(client, None) is None:
            return
        back = [msg_id for msg_id in list(self.in_flight)
                if self.in_flight.get(msg_id)[CLIENT] == client]
        for msg_id in reversed(back):
            item = self.in_flight.remove(msg_id)
            self.ready.appendleft(item[HANDLE], next_attempt(item[ENCODED]))
            self.stats.requeue_count += 1

    # -------------------------------------------------------- client commands

    def _owned(self, client: str, msg_id: bytes, error: Any) -> InFlight:
        item = self.in_flight.get(msg_id)
        if item is None or item[CLIENT] != client:
            raise error(msg_id)
        return item

    def finish(self, client: str, msg_ids: list[bytes]) -> list[BrokerError]:
        """FIN: returns one non-fatal E_FIN_FAILED per id that was not in flight for `client`."""
        msgs, handles, failed = self.in_flight.remove_owned(msg_ids, client)
        if self.e2e is not None and msgs:
            self.e2e.add_encoded(msgs)
        # _release, inlined (every FINed message): disk positions acked, delayed ids
        # removed; a run read from disk has only positions, taken as they are (in C)
        try:  # (min of None and ints, or of Nones, is refused)
            positions_only = not handles or min(handles) > DELAYED
        except TypeError:
            positions_only = False
        if positions_only:
            self.effects.disk_ack += handles
        else:
            acks = self.effects.disk_ack
            for encoded, handle in zip(msgs, handles, strict=True):
                if handle is None:
                    continue
                if handle == DELAYED:
                    self.effects.delayed_remove.append(encoded[10:26])
                else:
                    acks.append(handle)
        state = self.clients.get(client)
        if state is not None:
            state.in_flight -= len(msgs)
            state.finished += len(msgs)
        return [fin_failed(msg_id) for msg_id in failed]

    def requeue(self, client: str, msg_id: bytes, delay_ns: int, now: int) -> None:
        """REQ: back of the queue now (delay 0) or deferred by `delay_ns`."""
        self._owned(client, msg_id, req_failed)
        item = self.in_flight.remove(msg_id)
        state = self.clients.get(client)
        if state is not None:
            state.in_flight -= 1
            state.requeued += 1
        self.stats.requeue_count += 1
        encoded = next_attempt(item[ENCODED])
        if delay_ns <= 0:
            self.ready.append(item[HANDLE], encoded)
        else:
            self._defer(encoded, item[HANDLE], now + delay_ns)

    def touch(self, client: str, msg_id: bytes, now: int) -> None:
        """TOUCH: the message's timeout starts again."""
        self._owned(client, msg_id, touch_failed)
        state = self.clients[client]
        self.in_flight.update(msg_id, now + state.msg_timeout_ns)

    # ------------------------------------------------------------------- time

    def process(self, now: int) -> bool:
        """nsqd's processInFlightQueue + processDeferredQueue; True if any work was due."""
        dirty = False
        for msg_id, item in self.in_flight.pop_expired(now):
            dirty = True
            self.stats.timeout_count += 1
            self.stats.requeue_count += 1
            state = self.clients.get(item[CLIENT])
            if state is not None:
                state.in_flight -= 1
                state.timed_out += 1
            self.ready.append(item[HANDLE], next_attempt(item[ENCODED]))
            del msg_id
        for _msg_id, (encoded, handle) in self.deferred.pop_due(now):
            dirty = True
            self.ready.append(handle, encoded)
        return dirty

    # --------------------------------------------------------------- delivery

    def pump(self, now: int) -> None:
        """Deliver ready messages to random ready clients; ask for disk reads.

        The hottest code of the broker.  Each ready client, in a random order,
        takes its share of the ready messages (an equal part, but at least
        ``MIN_SHARE``, or up to a fifth of its RDY where an equal part is less; at most
        its room) as one run, with no per-message choice;
        with ``max_attempts`` every message is looked at (dead letters), one random
        pick each.
        """
        if self.paused:
            return
        if self.ready:
            ready_clients = [c for c in self.clients.values() if c.in_flight < c.rdy]
            if self.max_attempts:
                self._deliver_each(ready_clients, now)
            elif len(ready_clients) == 1:
                self._deliver_run(ready_clients[0], now, len(self.ready))
            elif ready_clients:
                self._deliver_shares(ready_clients, now)
        if not self.ready and self.disk_depth and not self.reading and self.durable:
            # Read only for clients with room (as nsqd's messagePump): a backlog nobody
            # consumes stays on disk, and its queue may close its files.  As much as
            # they have room for, within [read_batch, 8 x read_batch]: fewer round trips
            # to the disk queue and bigger deliveries when many clients wait.
            room = sum(c.rdy - c.in_flight for c in self.clients.values()
                       if c.in_flight < c.rdy)
            if room:
                self.reading = True
                self.put_since_read = 0
                self.effects.disk_read = min(max(room, self.read_batch), 8 * self.read_batch)

    def _deliver_shares(self, ready_clients: list[ClientState], now: int) -> None:
        """Several ready clients: in a random order, each takes an equal share of what is
        ready (at most its room) as one run; where that share is under ``MIN_SHARE``,
        up to a fifth of its RDY (`ROOMY_SHARE`, at least ``MIN_SHARE``, and the rest if
        less than that would be left), so a read smaller than ``MIN_SHARE`` x clients
        goes to the first few in the shuffle; passes repeat while messages and room
        remain (the clients that filled up have left the list)."""
        ready = self.ready
        while ready and ready_clients:
            self.rng.shuffle(ready_clients)
            left = len(ready_clients)
            for client in ready_clients:
                share = -(-len(ready) // left)
                if share < MIN_SHARE:
                    share = max(client.rdy // ROOMY_SHARE, MIN_SHARE)
                    if len(ready) - share < MIN_SHARE:
                        share = len(ready)  # (the rest: no sliver left for another)
                self._deliver_run(client, now, share)
                left -= 1
                if not ready:
                    return
            ready_clients = [c for c in ready_clients if c.in_flight < c.rdy]

    def _deliver_run(self, client: ClientState, now: int, limit: int) -> None:
        """Up to ``limit`` messages (at most what `client` has room for), as one run."""
        handles, msgs = self.ready.take(min(limit, client.rdy - client.in_flight))
        name = client.name
        # (the run keeps msgs: the delivery gets a copy, since it may grow)
        self.in_flight.push_run(list(map(_ID_OF, msgs)), now + client.msg_timeout_ns,
                                name, msgs, handles)
        client.in_flight += len(msgs)
        client.delivered += len(msgs)
        out = self.effects.deliveries.get(name)
        if out is None:
            self.effects.deliveries[name] = msgs[:]
        else:
            out += msgs

    def _deliver_each(self, ready_clients: list[ClientState], now: int) -> None:
        """A random ready client for every message; dead letters past ``max_attempts``.

        What each client got in this pass becomes one in-flight run (one deadline)."""
        ready = self.ready
        popleft = ready.popleft
        got: dict[str, tuple[ClientState, list[bytes], list[Handle]]] = {}
        rand = self.rng.random
        max_attempts = self.max_attempts
        while ready_clients and ready:
            handle, encoded = popleft()
            if max_attempts and (encoded[8] << 8) | encoded[9] > max_attempts:
                # Same id, timestamp and body; attempts start again on the dead-letter topic.
                self.effects.dead_letters.append(with_attempts(encoded, FIRST_ATTEMPT))
                self.stats.dead_letter_count += 1
                self._release(handle, encoded[10:26])
                continue
            n = len(ready_clients)
            i = 0 if n == 1 else int(rand() * n)
            client = ready_clients[i]
            mine = got.get(client.name)
            if mine is None:
                mine = got[client.name] = (client, [], [])
            mine[1].append(encoded)
            mine[2].append(handle)
            client.in_flight += 1
            if client.in_flight >= client.rdy:
                ready_clients[i] = ready_clients[-1]
                ready_clients.pop()
        deliveries = self.effects.deliveries
        for name, (client, msgs, handles) in got.items():
            client.delivered += len(msgs)
            self.in_flight.push_run(list(map(_ID_OF, msgs)), now + client.msg_timeout_ns,
                                    name, msgs, handles)
            out = deliveries.get(name)
            if out is None:
                deliveries[name] = msgs[:]
            else:
                out += msgs

    # ---------------------------------------------------------------- helpers

    def _defer(self, encoded: bytes, handle: Handle, due: int) -> None:
        msg_id = message_id(encoded)
        held = self.deferred.get(msg_id)
        if held is not None:  # a second copy (read again after a restart): one stays
            if handle is not None and handle != held[1]:
                self._release(handle, msg_id)
            return
        if self.durable and handle != DELAYED:
            self.effects.delayed_add.append((due, msg_id, encoded))
            if handle is not None:
                self.effects.disk_ack.append(handle)
            handle = DELAYED
        elif handle == DELAYED:  # still in the store: record the new due time
            self.effects.delayed_add.append((due, msg_id, encoded))
        self.deferred.push(msg_id, due, (encoded, handle))

    def _release(self, handle: Handle, msg_id: bytes) -> None:
        if handle is None:
            return
        if handle == DELAYED:
            self.effects.delayed_remove.append(msg_id)
        else:
            self.effects.disk_ack.append(handle)

    def empty(self) -> None:
        """Drop every queued and deferred message (nsqd's channel empty)."""
        for handle, _encoded in self.ready:
            if handle is not None and handle != DELAYED:
                self.effects.disk_ack.append(handle)
        self.ready.clear()
        for _msg_id, (encoded, handle) in self.deferred.pop_due(2**63):
            self._release(handle, message_id(encoded))
        self.disk_depth = 0
        self.reading = False

    def find(self, msg_id: bytes, *, waiting: bool = True) -> dict[str, Any] | None:
        """Where the message `msg_id` is in memory: ``{"state": "in_flight", "message",
        "client", "deadline"}``, ``{"state": "deferred", "message", "due"}`` or (unless not
        `waiting`: the walk of the ready queue is left out) ``{"state": "queued",
        "message"}`` (the encoded message as held); or None."""
        item = self.in_flight.get(msg_id)
        if item is not None:
            return {"state": "in_flight", "message": item[ENCODED], "client": item[CLIENT],
                    "deadline": self.in_flight.deadline_of(msg_id)}
        held = self.deferred.get(msg_id)
        if held is not None:
            return {"state": "deferred", "message": held[0], "due": self.deferred.due_of(msg_id)}
        encoded = self.ready.find(msg_id) if waiting else None
        return None if encoded is None else {"state": "queued", "message": encoded}

    def memory_only(self) -> list[bytes]:
        """Messages that exist only in memory (what a clean shutdown writes to disk)."""
        out = [m for h, m in self.ready if h is None]
        out.extend(next_attempt(self.in_flight.get(i)[ENCODED]) for i in self.in_flight
                   if self.in_flight.get(i)[HANDLE] is None)
        return out

    def client_stats(self) -> list[dict[str, object]]:
        """nsqd 1.3's client entries (`client_entry`), plus ours: `client` (the actor)
        and `timeout_count`."""
        return [{**client_entry(c.info or {}, state=3, ready=c.rdy, in_flight=c.in_flight,
                                messages=c.delivered, finished=c.finished,
                                requeued=c.requeued),
                 "client": c.name, "timeout_count": c.timed_out}
                for c in self.clients.values()]


def client_entry(info: dict[str, Any], *, state: int, ready: int = 0, in_flight: int = 0,
                 messages: int = 0, finished: int = 0, requeued: int = 0) -> dict[str, object]:
    """A client in nsqd 1.3's /stats shape, field for field and type for type, from what
    the client said of itself (`info`), with the TLS version, cipher suite and
    compression IDENTIFY switched on.  (nsqd's states: 3 subscribed, 0 for a producer
    that never subscribed.)"""
    return {
        "client_id": str(info.get("client_id", "")),
        "hostname": str(info.get("hostname", "")),
        "version": str(info.get("version", "V2")),
        "remote_address": str(info.get("remote_address", "")),
        "state": state,
        "ready_count": ready, "in_flight_count": in_flight, "message_count": messages,
        "finish_count": finished, "requeue_count": requeued,
        "connect_ts": int(info.get("connect_ts", 0)),
        "sample_rate": int(info.get("sample_rate", 0)),
        "deflate": bool(info.get("deflate")), "snappy": bool(info.get("snappy")),
        "user_agent": str(info.get("user_agent", "")),
        "tls": bool(info.get("tls_version")),
        "tls_cipher_suite": str(info.get("tls_cipher_suite", "")),
        "tls_version": str(info.get("tls_version", "")),
        "tls_negotiated_protocol": "", "tls_negotiated_protocol_is_mutual": False,
    }
