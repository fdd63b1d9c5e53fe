"""The disk-queue actor: owns one topic's or channel's storage, off its owner's thread.

A topic ``T`` owns ``diskqueue:T``; a channel ``T/C`` owns ``diskqueue:T/C``
(placement keeps them in the owner's process, so the messages between them
are in-process inbox puts).  The actor holds a `storage.DiskQueue` in
ack-position mode -- a message leaves the disk only when its owner acks it
-- and a `storage.DelayedStore` of deferred messages: a channel's, and a
topic's DPUBs kept while it has no channel, with their due times.  The store
exists only while it holds something (created by the first `DqDefer`,
removed when closed empty).  `#ephemeral` owners get a `storage.NullQueue`
and no delayed store.  A topic with retention (#21) also has its *history*
(`storage.History`): ``DqRetain`` appends what it published and trims by its
policy, ``DqTrim`` trims alone (the topic's timer, so an idle topic's history
ages too); neither opens the queue.

Messages are applied in the order they arrive, which is what the channel's
effects ordering relies on (a delayed-store add before the ack that releases
the same message from the disk queue).

A write may carry *confirms*: ``(actor, token)`` pairs told ``Stored(token)``
once the write is durable -- in the OS after ``put_many`` returns, and with
``--sync-every=1`` also fsynced.  For the latter the actor does *group
commit*: it syncs only when its inbox is empty, so every write that queued up
behind one fsync shares it, and then confirms them all.  A failed write
(disk full, a failed fsync) is confirmed with ``E_PUB_FAILED`` instead, its
text saying which (:func:`refusal`).

An idle queue lets go of its files: after ``--queue-idle-close`` (10 s) without a
message, with nothing read-but-unacked, nothing waiting for an fsync and no
deferred message, the actor closes its `DiskQueue` (and delayed store) -- its
fds, maps, ring and SQLite memory -- and reopens them on the next message,
recovering from the files as after any restart.  A broker with 10,000 mostly
idle topics holds the files of the busy ones only (nsqd keeps idle queues in
memory the same way).
"""

from __future__ import annotations

import errno
import logging
import operator
import os
import shutil
import time
from collections.abc import Callable
from typing import Any

from actors.broker import health
from actors.broker.messages import Stored
from actors.broker.nsq_message import (
    MAX_TAG_LENGTH,
    guid_time_ns,
    is_ephemeral,
    record_id,
    record_timestamp,
)
from actors.broker.options import BrokerOptions
from actors.runtime.actor import Actor, no_spawn
from storage import DelayedStore, DiskFailedError, DiskQueue, NullQueue, StorageError
from storage.delayed import SUFFIX as DELAYED_SUFFIX
from storage.history import History, history_path
from transport.mailbox.envelope import message
from transport.protocol.validation import DISK_FAILED, DISK_FULL

log = logging.getLogger(__name__)

#: NSQ's message header (timestamp, attempts, id) stored before each body.
MESSAGE_HEADER = 26
RECORD_OVERHEAD = MESSAGE_HEADER + 2 + MAX_TAG_LENGTH
"""The most a record adds to a body: NSQ's header, and a topic's tag (tag_record)."""

_NO_SPACE = frozenset({errno.ENOSPC, errno.EDQUOT})
FIND_INLINE_BYTES = 1 << 20
"""A lookup that must summarise more of its queue than this runs off the worker's
dispatcher thread (`DiskQueueActor._find`)."""


def refusal(e: Exception) -> tuple[str, str, bool]:
    """The answer to a publish the storage could not take: ``E_PUB_FAILED`` whose text
    says whether the disk is full (it resumes by itself once space returns) or failed
    (an fsync error: the queue takes nothing until a restart), with the cause."""
    if isinstance(e, DiskFailedError):
        what = f"{DISK_FAILED}, the queue takes no writes until the broker restarts"
    elif isinstance(e, OSError) and e.errno in _NO_SPACE:
        what = DISK_FULL
    else:
        what = "the write failed"
    return ("E_PUB_FAILED", f"PUB failed: {what} - {e}", False)


@message
class DqOpen:
    """Ask: open (or report on) the storage. Reply: `(depth, deferred entries)`.

    `rewind`: the owner (re)started and lost its in-flight state, so every
    message read but not acked is offered again (the queue reopens at its floor).
    """

    rewind: bool = False


@no_spawn
@message
class DqIdle:
    """To itself, ``--queue-idle-close`` after a message: close the files if still idle."""


@message
class DqReopened:
    """To the owner: this disk-queue actor (re)started; re-sync with `DqOpen`."""


@message
class DqPut:
    """Append messages (NSQ-encoded) to the disk queue."""

    messages: list[bytes]
    confirms: tuple[tuple[str, int], ...] = ()
    """`(actor, token)` pairs told `Stored(token)` once the write is durable."""


@message
class DqRead:
    """Read up to `limit` messages; the reply is a `DqMessages` told to `reply_to`."""

    limit: int
    reply_to: str


@no_spawn
@message
class DqMessages:
    """Messages read from disk: `(position, encoded)` pairs (told to the owner)."""

    items: list[tuple[int, bytes]]
    depth: int
    again: int = 0
    """How many of the first items were handed out before the queue last closed or
    crashed (`DiskQueue.read_before`): delivering them again is another attempt."""


@message
class DqWriteFailed:
    """To the owner: a `DqPut` of `count` messages failed (disk full); nothing was written."""

    count: int
    error: str


@message
class DqAck:
    """Finished messages: their disk positions can go."""

    positions: list[int]


@message
class DqDefer:
    """Keep messages in the delayed store: `(due_ns, message id, encoded)`."""

    entries: list[tuple[int, bytes, bytes]]
    confirms: tuple[tuple[str, int], ...] = ()
    """As for `DqPut`."""


@message
class DqUndefer:
    """Finished deferred messages: remove them from the delayed store."""

    ids: list[bytes]


@message
class DqEmpty:
    """Drop everything stored (queue and delayed store)."""


@message
class DqDelete:
    """Remove every file (the next message opens a fresh, empty queue)."""


@message
class DqStats:
    """Ask: the storage's stats dict."""


@message
class DqRetain:
    """A topic with retention: append its published records to its history, then trim
    it by the policy (``max_age_ns`` / ``max_bytes``, 0: no limit of that kind) at
    ``now_ns``."""

    records: list[bytes]
    now_ns: int
    max_age_ns: int
    max_bytes: int
    confirms: tuple[tuple[str, int], ...] = ()
    """As for `DqPut`."""
    created_ns: int = 0
    """If this creates the history: the time from which it is whole (0: the topic's
    birth, it had retention from the start)."""


@message
class DqTrim:
    """Trim the history by the policy (as `DqRetain`, appending nothing); with both
    limits 0 (retention turned off), delete it."""

    now_ns: int
    max_age_ns: int
    max_bytes: int


@message
class DqHistoryStats:
    """Ask: the history's ``retained_bytes`` and ``oldest_retained_timestamp`` (ns)."""


@message
class DqHistoryFind:
    """Ask: where a rewind starts -- at the first record published at or after
    `since_ns`, or (`message_id`, 16 hex bytes) at that message.  Reply: ``(start,
    end, complete_from)``: positions, and the time from which the history is whole;
    None when there is no history or the message is not in it."""

    since_ns: int
    message_id: bytes = b""


@message
class DqHistoryRead:
    """Read up to `limit` history records from `position`, before `end`; the answer, a
    `DqHistoryBatch` for `channel`, is told to `reply_to`."""

    position: int
    end: int
    limit: int
    reply_to: str
    channel: str


@no_spawn
@message
class DqHistoryBatch:
    """History records for a channel's rewind, and the position after them."""

    channel: str
    records: list[bytes]
    next: int


@message
class DqFind:
    """Ask: where the message `message_id` (16 hex bytes) is in this storage.  Reply:
    ``(queued, retained)``: ``(record, read)`` if the queue still holds it (`read`:
    handed out to the owner and not acked yet), and its record in the history (a
    topic's, with retention); None for either where it is not."""

    message_id: bytes


def queue_name(owner: str) -> str:
    """File-name stem of an owner's queue: `T` for a topic, `T:C` for a channel (nsqd)."""
    return owner.replace("/", ":")


class DiskQueueActor(Actor):
    """See the module docstring; named ``diskqueue:<topic>`` or ``diskqueue:<topic>/<channel>``."""

    def __init__(self, name: str, options: BrokerOptions,
                 clock: Callable[[], float] = time.monotonic) -> None:
        super().__init__(name)
        self.options = options
        self.owner = name.partition(":")[2]
        self.is_channel = "/" in self.owner
        self.queue: DiskQueue | NullQueue | None = None
        self.delayed: DelayedStore | None = None
        self.history: History | None = None
        self.closed_history_stats: dict[str, int] | None = None  # as it was closed idle
        # channel -> (position, when): where a rewind reads next; trims keep from there
        self.rewind_floors: dict[str, tuple[int, float]] = {}
        self.group_commit = options.sync_every == 1
        self.unsynced: list[tuple[str, int]] = []
        self.commits = 0
        self.clock = clock
        self.last_used = clock()
        self.idle_timer = False
        self.failed_writes = 0  # in a row: logged once, when it starts and when it ends

    def on_start(self) -> None:
        # The files open on the first message that needs them (a `DqOpen` after a
        # clean close needs none).  After a crash of this actor its owner's idea of
        # the queue (reads in progress, depth) is stale: tell it to re-sync.
        if self.restart_count:
            self.tell(f"{'channel' if self.is_channel else 'topic'}:{self.owner}",
                      DqReopened())

    @property
    def ephemeral(self) -> bool:
        # As in nsqd, a channel is ephemeral by its own name, whatever its topic's.
        return is_ephemeral(self.owner.rpartition("/")[2])

    def _open(self) -> None:
        o = self.options
        stem = queue_name(self.owner)
        if self.ephemeral:
            self.queue = NullQueue(stem, max_msg_size=o.max_msg_size + RECORD_OVERHEAD)
            return
        os.makedirs(o.data_path, exist_ok=True)
        queue = DiskQueue(stem, o.data_path, max_bytes_per_file=o.max_bytes_per_file,
                          max_msg_size=o.max_msg_size + RECORD_OVERHEAD,
                          # with --sync-every=1 this actor syncs itself (group commit)
                          sync_every=10**9 if self.group_commit else o.sync_every,
                          sync_timeout=o.sync_timeout,
                          ack_mode=True, cache_low_watermark=o.cache_low_watermark,
                          cache_high_watermark=o.cache_high_watermark)
        # A queue that failed earlier in this process's life stays failed when reopened
        # (after an actor restart): its files may lack pages the kernel dropped.
        queue.failed = health.failed_queue(stem)
        if os.path.exists(self._delayed_path()):
            try:
                self.delayed = DelayedStore(o.data_path, name=stem)
            except BaseException:
                queue.close(sync=False)  # the next message opens both again
                raise
        self.queue = queue

    def _delayed_path(self) -> str:
        return os.path.join(self.options.data_path, queue_name(self.owner) + DELAYED_SUFFIX)

    def _delayed_store(self) -> DelayedStore:
        """The owner's delayed store, created by its first deferred message."""
        if self.delayed is None:
            self.delayed = DelayedStore(self.options.data_path, name=queue_name(self.owner))
        return self.delayed

    def _closed_answer(self) -> tuple[int, list[Any]] | None:
        """`DqOpen`'s answer for files closed cleanly, read without opening them (None:
        open to know).  A boot of 10,000 idle topics opens none of their 30,000 queues."""
        if self.ephemeral:
            return 0, []
        if os.path.exists(self._delayed_path()):
            return None  # deferred messages to load (an empty store is deleted on close)
        depth = DiskQueue.closed_depth(queue_name(self.owner), self.options.data_path)
        return None if depth is None else (depth, [])

    def on_stop(self) -> None:
        self._close()

    def on_failure(self, *exc_info: Any) -> None:
        """This instance crashed: let go of its files as a crash would, so the next
        instance can open them (SQLite's lock on the delayed store, the queue's maps
        and fds).  No fsync and no clean-close record: the next open recovers by
        scanning, since this instance's idea of its files may be what failed."""
        queue, delayed, self.queue, self.delayed = self.queue, self.delayed, None, None
        history, self.history = self.history, None
        try:
            if queue is not None:
                queue.close(sync=False)
            if history is not None:
                history.close(sync=False)
        except Exception:
            log.exception("%s: releasing the queue after a crash failed", self.name)
        try:
            if delayed is not None:
                delayed.close()
        except Exception:
            log.exception("%s: releasing the delayed store after a crash failed", self.name)

    def _close(self, *, sync: bool = True) -> None:
        if self.queue is not None:
            self.queue.close(sync=sync)
        if self.history is not None:  # (synced even when the queue need not be: it may
            self.closed_history_stats = self.history.stats()  # have writes the queue has
            self.history.close()  # not, at DqOpen's release)
        if self.delayed is not None:
            if self.delayed.depth():
                self.delayed.close()
            else:  # nothing deferred: no file, so the next open need not read one
                self.delayed.delete()

    def on_receive(self, msg: Any) -> Any:
        try:
            return self._handle(msg)
        finally:
            # Group commit: fsync and confirm the writes waiting for it once nothing is
            # queued behind -- after every message, those answered early (DqOpen, DqIdle,
            # DqStats) too: one of them queued behind a write must not leave that write's
            # publish unanswered until some later write comes (the first durable
            # publish to a new topic waited 10 s for it).
            if self.unsynced and self.actor_inbox.qsize() == 0:
                self._commit()

    def _handle(self, msg: Any) -> Any:
        if type(msg) is DqIdle:
            self._idle()
            return None
        if type(msg) in _HISTORY:
            self.last_used = self.clock()
            return self._retain(msg)
        if type(msg) is DqFind:
            return self._find(msg.message_id)
        if type(msg) is DqStats and self.queue is None:  # (an operator's look: not a use)
            depth = 0 if self.ephemeral else DiskQueue.closed_depth(
                queue_name(self.owner), self.options.data_path)
            return {"name": queue_name(self.owner), "closed": True, "depth": depth}
        self.last_used = self.clock()
        self._arm_idle_timer()
        opened = self.queue is None
        if opened:  # closed while idle, or deleted and the name in use again
            if type(msg) is DqOpen and (answer := self._closed_answer()) is not None:
                return answer
            self._open()
        q = self.queue
        assert q is not None
        match msg:
            case DqPut(messages=messages, confirms=confirms):
                if not self._write(lambda: q.put_many(messages), confirms):
                    owner = f"{'channel' if self.is_channel else 'topic'}:{self.owner}"
                    self.tell(owner, DqWriteFailed(len(messages), "disk full or failing"))
            case DqRead(limit=limit, reply_to=reply_to):
                items = q.read_many(limit)
                again = 0
                if items and isinstance(q, DiskQueue) and q.read_before(items[0][0]):
                    again = sum(1 for p, _ in items if q.read_before(p))
                self.tell(reply_to, DqMessages(items, q.depth(), again))
            case DqAck(positions=positions):
                q.ack_many(positions)
            case DqDefer(entries=entries, confirms=confirms):
                if isinstance(q, DiskQueue):
                    delayed = self._delayed_store()
                    self._write(lambda: delayed.add_many(entries), confirms)
                else:
                    self._write(lambda: 0, confirms)
            case DqUndefer(ids=ids):
                if self.delayed is not None:
                    self.delayed.remove_many(ids)
            case DqOpen(rewind=rewind):
                if rewind and q.pending():
                    # Reopen: what was handed out and not acked is unread again.  The
                    # delayed store closes too (SQLite holds one lock per file: a second
                    # open beside it failed, "database is locked"), and nothing stays
                    # referenced if the open fails (the next message opens again).
                    self._close()
                    self.queue, self.delayed = None, None
                    self._open()
                    q = self.queue
                    assert q is not None
                deferred = self.delayed.entries() if self.delayed is not None else []
                # Un-acked messages of an earlier life are readable again: depth counts them.
                answer = q.depth() + q.pending(), deferred
                # Owners ask this when they start, all at once at a broker's boot: a queue
                # that is not in use lets go of its files at once rather than when idle, so
                # 10,000 topics booting do not hold 130,000 files open together.  One
                # opened (recovered: not closed cleanly) for this question alone has
                # written nothing since: it closes inline without an fsync, and so
                # without the clean-close record, to be scanned again at its next open
                # (0.3 ms; its four fsyncs took 1-4 ms, 29 s for 30,000 queues).
                self._release(sync=not opened)
                return answer
            case DqEmpty():
                q.empty()
                if self.delayed is not None:
                    self.delayed.empty()
            case DqDelete():
                q.delete()
                if self.delayed is not None:
                    self.delayed.delete()
                if self.history is not None:
                    self.history.delete()
                else:
                    shutil.rmtree(history_path(self.options.data_path, queue_name(self.owner)),
                                  ignore_errors=True)
                self.queue, self.delayed, self.history = None, None, None
                self.closed_history_stats = None
                self.stop()  # nothing left to own; a reused name starts afresh
            case DqStats():
                stats = q.stats()
                if "chunks" in stats:  # msgpack maps need str keys
                    stats["chunks"] = {str(k): v for k, v in stats["chunks"].items()}
                stats["group_commits"] = self.commits
                if self.delayed is not None:
                    stats["delayed"] = len(self.delayed)
                return stats
            case _:
                log.warning("%s: unexpected message %r", self.name, msg)
        return None

    def _retain(self, msg: DqRetain | DqTrim | DqHistoryStats) -> Any:
        """The history's messages (it opens on the first; the queue stays as it is)."""
        path = history_path(self.options.data_path, queue_name(self.owner))
        if self.history is None:
            if type(msg) is DqHistoryStats and self.closed_history_stats is not None:
                return self.closed_history_stats  # (closed while idle: nothing changed)
            if type(msg) is not DqRetain and not os.path.isdir(path):
                if type(msg) is DqHistoryRead:  # (deleted meanwhile: the rewind ends)
                    self.tell(msg.reply_to, DqHistoryBatch(msg.channel, [], msg.end))
                return {"retained_bytes": 0, "oldest_retained_timestamp": 0} \
                    if type(msg) is DqHistoryStats else None
            self._arm_idle_timer()
            self.history = _open_history(path, self.options,
                                         msg.created_ns if type(msg) is DqRetain else 0)
            self.closed_history_stats = None
        history = self.history
        match msg:
            case DqRetain(records=records, confirms=confirms):
                # a chunk spans a tenth of the age limit at most, so that age trims in steps
                history.max_chunk_age_ns = msg.max_age_ns // 10
                self._write(lambda: history.append(records), confirms)
                history.trim(now_ns=msg.now_ns, max_age_ns=msg.max_age_ns,
                             max_bytes=msg.max_bytes, keep_from=self._rewind_floor())
            case DqTrim(now_ns=now_ns, max_age_ns=max_age_ns, max_bytes=max_bytes):
                if max_age_ns or max_bytes:
                    history.trim(now_ns=now_ns, max_age_ns=max_age_ns, max_bytes=max_bytes,
                                 keep_from=self._rewind_floor())
                else:  # retention turned off: what was kept goes
                    history.delete()
                    self.history = None
                    self.closed_history_stats = None
            case DqHistoryStats():
                return history.stats()
            case DqHistoryFind(since_ns=since_ns, message_id=message_id):
                if message_id:
                    found = history.find_id(message_id, record_id, guid_time_ns(message_id),
                                            walk=self._dead_letters())
                    if found is None:
                        return None
                    start = found[0]
                else:
                    start = history.seek(since_ns)
                return start, history.end(), history.complete_from or 0
            case DqHistoryRead(position=position, end=end, limit=limit, reply_to=reply_to,
                               channel=channel):
                items, nxt = history.read(position, limit, end)
                if items and nxt < end:  # (what it reads next is not trimmed meanwhile)
                    self.rewind_floors[channel] = (nxt, self.clock())
                else:
                    self.rewind_floors.pop(channel, None)
                self.tell(reply_to, DqHistoryBatch(channel, [r for _, r in items],
                                                   nxt if items else end))
        return None

    def _find(self, message_id: bytes) -> tuple[Any, bytes | None]:
        """DqFind: a lookup opens what it must read, as any use does (and the idle
        timer closes it again); a queue closed empty is not opened.  One that must
        first summarise more than `FIND_INLINE_BYTES` of its queue (the first in a large
        backlog reads it all) runs on the node's I/O pool, so the worker's other
        actors go on meanwhile (this actor parks); the others, in about a tenth of a
        millisecond, here (the hop to the pool and back costs milliseconds)."""
        queue: DiskQueue | None = None
        name = queue_name(self.owner)
        if not self.ephemeral and (self.queue is not None  # (closed: 0 if empty, None: unknown)
                                   or DiskQueue.closed_depth(name, self.options.data_path) != 0):
            self.last_used = self.clock()
            self._arm_idle_timer()
            if self.queue is None:
                self._open()
            assert isinstance(self.queue, DiskQueue)
            queue = self.queue
        if not self.is_channel and self.history is None and os.path.isdir(
                path := history_path(self.options.data_path, name)):
            self._arm_idle_timer()
            self.history = _open_history(path, self.options, 0)
            self.closed_history_stats = None
        history = None if self.is_channel else self.history
        if queue is None and history is None:
            return None, None
        # (a channel's messages are never tagged: their ids by a slice, in C)
        key_of = _message_key if self.is_channel else record_id
        walk = self._dead_letters()
        if walk or (queue is not None and queue.unsummarised() > FIND_INLINE_BYTES):
            return self.blocking(_find_in, queue, history, message_id, key_of, walk)
        return _find_in(queue, history, message_id, key_of, walk)

    def _dead_letters(self) -> bool:
        """Whether this is a dead-letter topic's storage (`<topic>.dead`, or the one
        ``--dead-letter-topic`` names): its history is in the order messages failed."""
        return not self.is_channel and (self.owner.endswith(".dead")
                                        or self.owner == self.options.dead_letter_topic)

    def _rewind_floor(self) -> int | None:
        """The oldest position a rewind still reads from (one that has not read for a
        minute is forgotten: its topic gave it up, or will read again from there)."""
        now = self.clock()
        live = [p for p, when in self.rewind_floors.values() if now - when < 60.0]
        return min(live) if live else None

    def _arm_idle_timer(self) -> None:
        if not self.idle_timer and self.options.queue_idle_close:
            self.idle_timer = True
            self.tell_later(self.options.queue_idle_close, DqIdle())

    def _write(self, write: Any, confirms: Any) -> bool:
        """Do a write; confirm it now, or (group commit) at the next fsync. False if it failed."""
        try:
            write()
        except (StorageError, OSError) as e:  # (a full disk, a failed sync at sync_every)
            if not self.failed_writes:
                log.error("%s: write failed: %s (the next failures are counted, not logged, "
                          "until a write succeeds)", self.name, e)
            self.failed_writes += 1
            self._note_failure()
            for actor, token in confirms:
                self.tell(actor, Stored(token, refusal(e)))
            return False
        if self.failed_writes:
            log.warning("%s: writes succeed again, after %d failed", self.name,
                        self.failed_writes)
            self.failed_writes = 0
        if self.group_commit and not self.ephemeral:
            self.unsynced.extend(tuple(c) for c in confirms)
            return True
        for actor, token in confirms:
            self.tell(actor, Stored(token))
        return True

    def _note_failure(self) -> None:
        """If the queue failed for good (an fsync error), tell `/ping` for this process's life."""
        q = self.queue
        if isinstance(q, DiskQueue) and q.failed:
            health.record_failed_queue(q.name, q.failed)

    def _idle(self) -> None:
        """Close the files if nothing happened for a while and nothing is pending."""
        self.idle_timer = False
        if self.queue is None and self.history is None:
            return
        quiet = self.clock() - self.last_used
        if quiet < self.options.queue_idle_close:
            self.idle_timer = True
            self.tell_later(self.options.queue_idle_close - quiet, DqIdle())
            return
        if self._release():
            log.debug("%s: idle for %.0fs, closed its files", self.name, quiet)

    def _release(self, *, sync: bool = True) -> bool:
        """Close the files unless something needs them open; True if closed.

        `sync=False`: nothing was written since they were opened, so let go of
        them without an fsync (see `DiskQueue.close`).
        """
        q, delayed = self.queue, self.delayed
        if (not self.options.queue_idle_close or isinstance(q, NullQueue)
                or (q is None and self.history is None) or (q is not None and q.pending())
                or self.unsynced or (delayed is not None and delayed.depth())):
            return False  # in use (in flight, unsynced, deferred) or memory-only: keep it open
        if sync:
            # On the I/O pool: a close syncs (fsync), and this actor's dispatcher thread
            # runs the others meanwhile; messages for this actor wait, then reopen.
            self.blocking(self._close)
        else:
            self._close(sync=False)
        self.queue, self.delayed, self.history = None, None, None
        return True

    @staticmethod
    def _sync(queue: DiskQueue | NullQueue | None, delayed: DelayedStore | None,
              history: History | None) -> None:
        if queue is not None:
            queue.sync()
        if delayed is not None:
            delayed.sync()
        if history is not None:
            history.sync()

    def _commit(self) -> None:
        """fsync once for every write that queued up, then confirm them all."""
        confirms, self.unsynced = self.unsynced, []
        error = None
        try:
            # On the node's I/O pool: this actor parks for the fsync while its
            # dispatcher thread runs the others, and the writes that arrive
            # meanwhile queue up for the next commit.
            self.blocking(self._sync, self.queue, self.delayed, self.history)
        except (StorageError, OSError) as e:
            log.error("%s: fsync failed: %s", self.name, e)
            self._note_failure()
            error = refusal(e)
        self.commits += 1
        for actor, token in confirms:
            self.tell(actor, Stored(token, error))


def _find_in(queue: DiskQueue | None, history: History | None, message_id: bytes,
             key_of: Callable[[bytes], bytes],
             walk: bool) -> tuple[tuple[bytes, bool] | None, bytes | None]:
    """`DqFind`'s answer from a queue's summaries and a history's index (`walk`: see
    `History.find_id`)."""
    queued = None if queue is None else queue.find(message_id, key_of)
    retained = None
    if history is not None:
        found = history.find_id(message_id, record_id, guid_time_ns(message_id), walk=walk)
        retained = None if found is None else found[1]
    return queued, retained


_message_key = operator.itemgetter(slice(10, 26))
"""The id of a message in a channel's queue (NSQ-encoded)."""

_HISTORY = (DqRetain, DqTrim, DqHistoryStats, DqHistoryFind, DqHistoryRead)


def _open_history(path: str, options: BrokerOptions, created_ns: int) -> History:
    """A topic's history, in chunks of ``--max-bytes-per-file`` (`created_ns`: from when
    it is whole, if it is created now)."""
    return History(path, chunk_bytes=options.max_bytes_per_file,
                   max_record=options.max_msg_size + RECORD_OVERHEAD,
                   timestamp=record_timestamp, sync_timeout=options.sync_timeout,
                   created_ns=created_ns, key=_id_key)


def _id_key(record: bytes) -> int:
    """A record's message id as a number: ids grow as a topic publishes."""
    return int(record_id(record), 16)
