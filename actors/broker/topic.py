"""The topic actor: `topic:<name>` -- ids, fan-out, buffering, metadata.

A publish gets NSQ message ids (one GUID factory per topic, as nsqd has),
a nanosecond timestamp and attempts 1 (what its first delivery shows), and is
encoded once.  Then:

* with channels and not paused, the batch is copied to every channel as
  one ``ChannelPut`` mailbox message each (fan-out in batches);
* otherwise it is kept: in memory up to ``--mem-queue-size`` messages, the
  rest in the topic's disk queue (``diskqueue:<topic>``); an ``#ephemeral``
  topic drops (and counts) what does not fit in memory.

Publishes are gathered: the PUBs and MPUBs a topic takes in one run of its
inbox (from any number of clients) are checked one by one as they come, then
encoded and routed together when the run ends (``on_batch_end``) or before
any other message, so a burst of single-message PUBs costs one fan-out, and
with ``--mem-queue-size=0`` one disk write and one fsync per channel (group
commit); each is answered when that write is confirmed.

When a channel appears or the topic is unpaused, what was kept is drained to
the channels: memory first, then the disk queue in batches, each batch acked
on the topic's queue once it has been handed to every channel.

Tags (#21): a publish may carry a tag, and a channel a tag filter (kept in the
metadata with the channel).  The topic keeps a tagged message as a tagged record
(``nsq_message.tag_record``) in memory and in its disk queue, and at fan-out
hands each channel only what its filter takes, without the tag; when no message
is tagged and no channel filters, fan-out is as it was.

Retention (#21): with ``--retention-time`` / ``--retention-bytes`` (or the
topic's own ``retention_time`` / ``retention_bytes`` settings, ``TopicConfig``)
the topic also has every publish appended to its history (``DqRetain`` to its
disk-queue actor, as records, tags kept; ``storage.history``), which trims it
by the policy as it writes, and on a timer (``RetentionTick``) so an idle
topic's history ages too.  With ``--mem-queue-size=0`` a publish is answered
once the history has it too.  Turning retention off deletes the history.

The topic owns its metadata file ``<data>/<topic>.topic.json`` (paused flag,
channels with their paused flags and tag filters, settings), rewritten
atomically on every change and read at start, when the topic re-creates its
channels.  Ephemeral topics keep no metadata.
"""

from __future__ import annotations

import contextlib
import itertools
import json
import logging
import os
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

from actors.broker.diskqueue import (
    DqAck,
    DqDefer,
    DqDelete,
    DqEmpty,
    DqFind,
    DqHistoryBatch,
    DqHistoryFind,
    DqHistoryRead,
    DqHistoryStats,
    DqMessages,
    DqOpen,
    DqPut,
    DqRead,
    DqReopened,
    DqRetain,
    DqStats,
    DqTrim,
    DqUndefer,
    DqWriteFailed,
    queue_name,
)
from actors.broker.e2e import E2E_SAMPLES
from actors.broker.e2e import result as e2e_result
from actors.broker.errors import (
    BrokerError,
    bad_body,
    bad_channel,
    bad_message,
    bad_topic,
    invalid,
    message_too_big,
)
from actors.broker.lookup import ChannelsOf, announce, lookup_names
from actors.broker.messages import (
    FIND_TIMEOUT,
    GATHER_MAX,
    ChannelCommand,
    ChannelConfig,
    ChannelFind,
    ChannelGone,
    ChannelPut,
    ChannelPutDeferred,
    ChannelRewind,
    ChannelStats,
    ChannelTags,
    ChannelUp,
    Publish,
    PublishDone,
    PublishEncoded,
    RetentionTick,
    Stored,
    TopicCommand,
    TopicConfig,
    TopicFind,
    TopicStats,
)
from actors.broker.nsq_message import (
    GuidFactory,
    has_tagged,
    is_ephemeral,
    is_valid_channel_name,
    is_valid_tag,
    is_valid_topic_name,
    record_id,
    tag_record,
    untag_record,
)
from actors.broker.options import BrokerOptions, format_duration, to_ns
from actors.runtime.actor import Actor
from storage.history import history_path
from storage.meta import write_atomic
from transport.protocol.validation import TAG_RULE

log = logging.getLogger(__name__)

META_SUFFIX = ".topic.json"
READ_BATCH = 512
REWIND_BATCH = 4096
"""History records a rewind queues at a time (its progress is written to the metadata
after each)."""


def topic_meta_path(data_path: str, topic: str) -> str:
    return os.path.join(data_path, topic + META_SUFFIX)


def topics_on_disk(data_path: str) -> list[str]:
    """Names of the topics whose metadata is in `data_path` (for the broker's boot)."""
    try:
        entries = os.listdir(data_path)
    except FileNotFoundError:
        return []
    return sorted(e[: -len(META_SUFFIX)] for e in entries
                  if e.endswith(META_SUFFIX) and is_valid_topic_name(e[: -len(META_SUFFIX)]))


@dataclass
class _Publisher:
    """Who waits for a publish's answer: a client actor told `PublishDone(corr)`, or
    an asker (the HTTP API) through its deferred reply handle."""

    reply_to: str
    corr: int
    handle: Any = None


@dataclass
class _Waiting:
    """Publishes (or a drained batch) waiting for their writes to be confirmed."""

    outstanding: int
    publishers: list[_Publisher] = field(default_factory=list)
    drained: list[int] | None = None  # positions to ack on the topic's own queue
    error: tuple[str, str, bool] | None = None
    rewound: tuple[str, int] | None = None  # a rewind's batch: (channel, messages)


@dataclass
class _Rewind:
    """A channel's rewind in progress: history positions `next` up to `end`, `queued`
    messages so far, and its asker's reply handle (None after a restart)."""

    next: int
    end: int
    queued: int = 0
    waiter: Any = None


_PROGRESS = ("topic", "deferred", "queued", "in_flight", "consumed")
"""A message's states, least advanced first (``GET /message``'s top-level ``state`` is
the least advanced over its channels)."""


def _channel_entry(found: dict[str, Any]) -> dict[str, Any]:
    """A channel's `ChannelFind` answer as ``GET /message`` shows it: ``attempts`` is how
    many times this channel has delivered it (a message in flight shows the number of
    its delivery; one at rest, the number its next one will show)."""
    attempts = int.from_bytes(found["message"][8:10], "big")
    entry: dict[str, Any] = {"state": found["state"],
                             "attempts": attempts if found["state"] == "in_flight"
                             else attempts - 1}
    if found["state"] == "in_flight":
        entry.update(client_id=found["client_id"], client=found["client"],
                     deadline=int(found["deadline"]))
    elif found["state"] == "deferred":
        entry["due"] = int(found["due"])
    return entry


def _delayed_entries(items: list[tuple[bytes, int]]) -> list[tuple[int, bytes, bytes]]:
    """`(record, due)` pairs as delayed-store entries `(due, message id, record)`."""
    return [(due, _message_id(m), m) for m, due in items]


def _records(encoded: list[bytes], tags: list[str] | None) -> list[bytes]:
    """What the topic keeps of just-encoded messages: tagged records where tagged."""
    if tags is None:
        return encoded
    return [tag_record(m, t) if t else m for m, t in zip(encoded, tags, strict=True)]


def _message_id(record: bytes) -> bytes:
    return untag_record(record)[0][10:26]


def _read_filter(channel: str, tags: Any) -> frozenset[str] | None:
    """A channel's filter as its metadata has it; None (no filter, with a warning) for
    anything but a list of good tags: a channel is never left taking nothing."""
    if tags is None or tags == []:
        return None
    if not isinstance(tags, list) or not all(is_valid_tag(t) for t in tags):
        log.warning("ignoring a bad tag filter of channel %s in metadata: %r", channel, tags)
        return None
    return frozenset(tags)


def _checked_tags(tags: Sequence[str]) -> frozenset[str]:
    bad = [t for t in tags if not is_valid_tag(t)]
    if bad:
        raise invalid(f"bad tag {bad[0]!r} ({TAG_RULE})")
    return frozenset(tags)


TOPIC_SETTINGS = {"backlog_alarm_depth": (int,), "retention_time": (int, float),
                  "retention_bytes": (int,)}
"""A topic's own settings (``TopicConfig``), each a number >= 0 of these types
(``retention_time`` in seconds); absent, the broker's flag of the same name holds."""


def _checked_config(config: dict[str, Any], *, strict: bool = False) -> dict[str, Any]:
    """A topic's settings as kept in its metadata: known keys with good values (`strict`:
    anything else is E_INVALID; otherwise, reading a file, it is dropped with a warning)."""
    out: dict[str, Any] = {}
    for key, value in config.items():
        kinds = TOPIC_SETTINGS.get(key, ())
        good = type(value) in kinds and 0 <= value < float("inf")  # (NaN is neither)
        if good:
            out[key] = value
        elif strict:
            raise invalid(f"bad topic setting {key}={value!r}")
        else:
            log.warning("ignoring a bad topic setting in metadata: %s=%r", key, value)
    return out


class TopicActor(Actor):
    """See the module docstring."""

    def __init__(self, name: str, options: BrokerOptions, clock: Any = time.time_ns) -> None:
        super().__init__(name)
        self.options = options
        self.clock = clock
        self.topic = name.partition(":")[2]
        self.valid = is_valid_topic_name(self.topic)
        self.ephemeral = is_ephemeral(self.topic)
        self.dq = f"diskqueue:{self.topic}"
        self.meta_path = topic_meta_path(options.data_path, self.topic)
        self.history_path = history_path(options.data_path, queue_name(self.topic))
        self.ticking = 0  # the generation of the RetentionTick on its way (0: none)
        self._generations = itertools.count(1)
        self.guids = GuidFactory(options.node_id)
        # --mem-queue-size=0: a publish is answered only when it is on disk everywhere
        self.durable_ack = options.mem_queue_size == 0 and not self.ephemeral
        self._tokens = itertools.count(1)
        self.waiting: dict[int, _Waiting] = {}
        # Publishes accepted during this run, fanned out together at its end
        # (on_batch_end): one encode, one ChannelPut per channel and, when durable,
        # one disk write and fsync for all of them (group commit across clients).
        self.gathered: list[bytes] = []
        self.gathered_tags: list[str] | None = None  # one per gathered body, once one has
        self.gathered_bytes = 0
        self.gathered_by: list[_Publisher] = []
        self.deleted = False
        self._reset()

    def _reset(self) -> None:
        self.channels: dict[str, bool] = {}  # channel -> paused
        self.filters: dict[str, frozenset[str]] = {}  # channel -> the tags it takes
        # channel -> from when (ns) it takes what is published: what came before went to
        # the channels of then (0: it took what the topic held, or it is older than this)
        self.since: dict[str, int] = {}
        self.paused = False
        self.config: dict[str, Any] = {}  # this topic's own settings (TopicConfig)
        self.memory: deque[bytes] = deque()
        self.deferred: list[tuple[bytes, int]] = []  # DPUB while there is no channel
        self.deferred_on_disk = False  # they are in the disk-queue actor's delayed store
        self.disk_depth = 0
        self.reading = False
        self.put_since_read = 0  # written since the last read was asked for (behind it)
        self.message_count = 0
        self.message_bytes = 0
        self.dropped = 0
        self.exists = False
        self.rewinds: dict[str, _Rewind] = {}  # channel -> its rewind in progress
        self.history_since = 0  # from when its history is whole (0: the topic's birth)

    # ---------------------------------------------------------------- lifecycle

    def on_start(self) -> None:
        if not self.valid:
            return
        meta = self._read_meta()
        if meta is not None:
            self._mark_exists()
            self.paused = bool(meta.get("paused", False))
            self.config = _checked_config(meta.get("config") or {})
            self.channels = {c: bool(v.get("paused", False))
                             for c, v in meta.get("channels", {}).items()
                             if is_valid_channel_name(c)}
            self.filters = {c: f for c, v in meta.get("channels", {}).items()
                            if c in self.channels and (f := _read_filter(c, v.get("tags")))}
            self.since = {c: v["since"] for c, v in meta.get("channels", {}).items()
                          if c in self.channels and type(v.get("since")) is int}
            # (an ephemeral channel is not kept, but its filter is, for a client that
            # still holds a subscription to revive it after a worker restart)
            self.filters.update(
                (c, f) for c, tags in (meta.get("ephemeral_tags") or {}).items()
                if is_ephemeral(c) and is_valid_channel_name(c) and (f := _read_filter(c, tags)))
            self.history_since = int(meta.get("history_since") or 0)
            # rewinds a crash or a stop interrupted: they go on from where they were
            self.rewinds = {c: _Rewind(*r) for c, r in (meta.get("rewinds") or {}).items()
                            if c in self.channels and isinstance(r, list) and len(r) == 3
                            and all(type(v) is int for v in r)}
        if self.exists and not self.ephemeral:  # (a topic not created yet has no queue)
            depth, deferred = self.ask(self.dq, DqOpen(), timeout=30)
            self.disk_depth = depth
            # DPUBs kept while the topic had no channel, with their due times
            self.deferred = [(m, due) for due, _id, m in deferred]
            self.deferred_on_disk = bool(self.deferred)
        for channel, paused in self.channels.items():
            announce(self, self.options, self.topic, channel)
            self._channel(channel, "hello")
            if paused:
                self._channel(channel, "pause")
        if self.exists:
            age, size = self._retention()
            if (age or size) and meta is not None and not os.path.isdir(self.history_path):
                # retention (newly, or again) on for a topic that published without it
                self.history_since = self.clock()
                self._write_meta()
            self._arm_retention()
        for channel in self.rewinds:
            self._rewind_next(channel)
        self._drain()

    def on_stop(self) -> None:
        self._publish_gathered()
        if self.ephemeral:
            return
        if self.memory:
            self.tell(self.dq, DqPut(list(self.memory)))
            log.info("%s: wrote %d memory-only messages to disk at shutdown", self.name,
                     len(self.memory))
        if self.deferred and not self.deferred_on_disk:  # kept with their due times
            self.tell(self.dq, DqDefer(_delayed_entries(self.deferred)))

    def _read_meta(self) -> dict[str, Any] | None:
        if self.ephemeral:
            return None
        try:
            with open(self.meta_path, "rb") as f:
                return json.load(f)
        except FileNotFoundError:
            return None
        except ValueError:
            log.warning("%s: metadata %s is unreadable; starting without it",
                        self.name, self.meta_path)
            return None

    def _mark_exists(self) -> None:
        if not self.exists:
            self.exists = True
            announce(self, self.options, self.topic)

    def _add_channel(self, channel: str) -> None:
        """A new channel (created, subscribed, or revived): kept and announced."""
        self.channels[channel] = False
        held = self.memory or self.disk_depth or self.deferred
        self.since[channel] = 0 if held else self.clock()
        announce(self, self.options, self.topic, channel)

    def _in_meta(self, channel: str) -> bool:
        """Whether the metadata file says anything of `channel`: an ephemeral channel is
        in it only by its tags."""
        return not is_ephemeral(channel) or channel in self.filters

    def _write_meta_for(self, channel: str) -> None:
        """`channel` came or changed: write the metadata if it holds the channel (10,000
        consumers on ephemeral channels of one topic wrote all of its channels 10,000
        times, and the topic's answers to their SUBs came after 10 s)."""
        if self._in_meta(channel):
            self._write_meta()
        else:
            self._mark_exists()

    def _write_meta(self) -> None:
        self._mark_exists()
        if self.ephemeral:
            return
        os.makedirs(self.options.data_path, exist_ok=True)
        # (nsqd keeps ephemeral channels out of its metadata: they end with their clients)
        meta: dict[str, Any] = {
            "version": 1, "paused": self.paused,
            "channels": {c: {"paused": p, **({"tags": sorted(self.filters[c])}
                                             if c in self.filters else {}),
                             **({"since": self.since[c]} if self.since.get(c) else {})}
                         for c, p in sorted(self.channels.items()) if not is_ephemeral(c)}}
        if self.config:
            meta["config"] = self.config
        if self.history_since:
            meta["history_since"] = self.history_since
        rewinds = {c: [r.next, r.end, r.queued] for c, r in sorted(self.rewinds.items())
                   if not is_ephemeral(c)}
        if rewinds:
            meta["rewinds"] = rewinds
        ephemeral = {c: sorted(f) for c, f in sorted(self.filters.items()) if is_ephemeral(c)}
        if ephemeral:
            meta["ephemeral_tags"] = ephemeral
        write_atomic(self.meta_path, json.dumps(meta, sort_keys=True).encode() + b"\n")

    # ----------------------------------------------------------------- messages

    def on_receive(self, msg: Any) -> Any:
        if type(msg) is Publish and not msg.defer_ms:
            reply = self._gather(msg)
        else:
            self._publish_gathered()  # what came before this message is routed first
            reply = self._on_receive(msg)
        if not self.exists and (not self.ephemeral or self.deleted) and not self.waiting:
            # Only a name (a bad one, asked about, deleted): nothing to keep.  Unless a
            # message is already waiting, which may create the topic (then it stays).
            self.stop_if_idle()
        return reply

    def _on_receive(self, msg: Any) -> Any:
        match msg:
            case Publish(bodies=bodies, defer_ms=defer_ms, reply_to=reply_to, corr=corr,
                         tag=tag):
                # a DPUB (a PUB or MPUB is gathered: on_receive, _gather)
                token = next(self._tokens) if self.durable_ack else 0
                expected = 0
                try:
                    size = self._check(bodies, defer_ms, tag)
                    expected = self._publish(list(bodies), size, defer_ms, token,
                                             [tag] * len(bodies) if tag else None)
                    result = None
                except BrokerError as e:
                    result = e.to_wire()
                if expected:  # answered by _stored() when every write is confirmed
                    self.waiting[token] = _Waiting(expected, [self._publisher(reply_to, corr)])
                    return None
                if not reply_to:
                    return result
                self.tell(reply_to, PublishDone(corr, result))
            case Stored(token=token, error=error):
                self._stored(token, error)
            case PublishEncoded(messages=messages):
                self._ensure_exists()
                self.message_count += len(messages)
                # (in the history at the time they come here: it is kept in that order,
                # and a dead letter carries the time it was first published elsewhere)
                stamp = self.clock().to_bytes(8, "big")
                self._retain([stamp + m[8:] for m in messages], None)
                self._route(list(messages))
            case RetentionTick(generation=generation):
                if generation != self.ticking:
                    return None  # (the policy changed since: a newer tick is coming)
                self.ticking = 0
                age, size = self._retention()
                if age or size:
                    self.tell(self.dq, DqTrim(self.clock(), age, size))
                    self._arm_retention()
            case DqMessages(items=items, depth=depth):
                self._from_disk(items, depth)
            case DqReopened():
                if not self.ephemeral and self.valid:
                    depth, _ = self.ask(self.dq, DqOpen(), timeout=30)
                    self.disk_depth = depth
                    self.reading = False
                    self._drain()
            case DqWriteFailed(count=count):
                self.disk_depth = max(0, self.disk_depth - count)  # never reached the disk
            case ChannelUp(channel=channel, revive=revive):
                if channel not in self.channels:
                    if not (revive and is_valid_channel_name(channel)):
                        return None  # a deleted channel's late start: it stays deleted
                    self._add_channel(channel)
                    self._write_meta_for(channel)
                self.tell(self._channel_name(channel), self._channel_config())
                self._drain()
            case ChannelGone(channel=channel):
                self._delete_channel(channel)
            case ChannelRewind(channel=channel, since_ns=since_ns, message_id=message_id,
                               create=create, tags=tags):
                try:
                    return self._rewind(channel, since_ns, message_id, create, tags)
                except BrokerError as e:
                    return e.to_wire()
            case DqHistoryBatch(channel=channel, records=records, next=nxt):
                self._rewind_batch(channel, records, nxt)
            case TopicCommand(command=command, arg=arg):
                return self._guard(lambda: self._command(command, arg))
            case ChannelTags(channel=channel, tags=tags, create=create):
                try:
                    return self._channel_tags(channel, tags, create=create)
                except BrokerError as e:
                    return e.to_wire()
            case TopicConfig(values=values):
                try:
                    return self._configure(values)
                except BrokerError as e:
                    return e.to_wire()
            case TopicFind(message_id=message_id):
                try:
                    return self._find(message_id)
                except BrokerError as e:
                    return e.to_wire()
            case TopicStats(include_clients=include_clients, existing_only=existing_only,
                            include_storage=storage):
                if existing_only and not self.exists:
                    return None
                return self._stats(include_clients, storage)
            case _:
                log.warning("%s: unexpected message %r", self.name, msg)
        return None

    def _guard(self, action: Any) -> Any:
        try:
            action()
        except BrokerError as e:
            return e.to_wire()
        return None

    def _ensure_exists(self) -> None:
        if not self.valid:
            raise bad_topic(self.topic)
        if not self.exists:
            self._write_meta()
            self._channels_elsewhere()

    def _channels_elsewhere(self) -> None:
        """A topic just created takes the channels the cluster's lookup daemons know for
        it (not ephemeral ones) before its first message, as nsqd does, so consumers
        subscribed on other brokers miss nothing published here."""
        names = lookup_names(self.options)
        if not names:
            return
        known: set[str] = set()
        for reply in self.ask_many([(n, ChannelsOf(self.topic)) for n in names],
                                   timeout=5.0):
            if isinstance(reply, list | tuple):  # (an exception: that daemon cannot say)
                known.update(reply)
        new = sorted(c for c in known
                     if c not in self.channels and is_valid_channel_name(c)
                     and not is_ephemeral(c))
        for channel in new:
            self._add_channel(channel)
            self._channel(channel, "hello")
        if new:
            log.info("%s: created channels %s known to the lookup daemons", self.name, new)
            self._write_meta()

    # ------------------------------------------------------------------ publish

    def on_batch_end(self) -> None:
        self._publish_gathered()

    def _publisher(self, reply_to: str, corr: int) -> _Publisher:
        """The publish being handled: answered by telling `reply_to`, or, asked, later
        through its reply handle."""
        return _Publisher(reply_to, corr, None if reply_to else self.defer_reply())

    def _gather(self, msg: Publish) -> Any:
        """A PUB or MPUB: checked now (a refusal is answered at once), kept for the
        run's fan-out."""
        try:
            self.gathered_bytes += self._check(msg.bodies, 0, msg.tag)
        except BrokerError as e:
            if not msg.reply_to:
                return e.to_wire()  # the asker's reply
            self.tell(msg.reply_to, PublishDone(msg.corr, e.to_wire()))
            return None
        if msg.tag and self.gathered_tags is None:
            self.gathered_tags = [""] * len(self.gathered)
        if self.gathered_tags is not None:
            self.gathered_tags.extend([msg.tag] * len(msg.bodies))
        self.gathered.extend(msg.bodies)
        self.gathered_by.append(self._publisher(msg.reply_to, msg.corr))
        if len(self.gathered) >= GATHER_MAX:
            self._publish_gathered()
        return None

    def _publish_gathered(self) -> None:
        """Encode and route the publishes gathered in this run as one, and answer them
        (now, or when durable once their one write is confirmed everywhere)."""
        if not self.gathered_by:
            return
        bodies, size, publishers = self.gathered, self.gathered_bytes, self.gathered_by
        tags = self.gathered_tags
        self.gathered, self.gathered_bytes, self.gathered_by = [], 0, []
        self.gathered_tags = None
        token = next(self._tokens) if self.durable_ack else 0
        error = None
        expected = 0
        try:
            expected = self._publish(bodies, size, 0, token, tags)
        except BrokerError as e:  # (checked when gathered: not expected)
            error = e.to_wire()
        if expected:  # answered by _stored() when every write is confirmed
            self.waiting[token] = _Waiting(expected, publishers)
        else:
            self._answer(publishers, error)

    def _answer(self, publishers: list[_Publisher], error: tuple[str, str, bool] | None) -> None:
        """PublishDone to each client actor (one envelope per client), or the asker's reply."""
        by_client: dict[str, list[PublishDone]] = {}
        for p in publishers:
            if p.reply_to:
                by_client.setdefault(p.reply_to, []).append(PublishDone(p.corr, error))
            elif p.handle is not None:
                p.handle.set(error)
        for client, dones in by_client.items():
            self.tell_many(client, dones)

    def _check(self, bodies: Sequence[bytes], defer_ms: int, tag: str = "") -> int:
        """Refuse a publish nsqd would refuse, with its error; creates the topic.
        Returns the bodies' size in bytes."""
        o = self.options
        verb = "DPUB" if defer_ms else ("MPUB" if len(bodies) > 1 else "PUB")
        if not self.valid:
            raise bad_topic(self.topic, verb)
        if tag and not is_valid_tag(tag):
            raise invalid(f"{verb} bad tag {tag!r} ({TAG_RULE})")
        if not bodies:
            raise bad_body(f"{verb} invalid message count 0")
        sizes = list(map(len, bodies))
        if min(sizes) == 0:
            raise bad_message(f"{verb} invalid message body size 0")
        if max(sizes) > o.max_msg_size:
            first = next(n for n in sizes if n > o.max_msg_size)
            raise message_too_big(first, o.max_msg_size, verb)
        max_defer_ms = int(o.max_req_timeout * 1000)
        if not 0 <= defer_ms <= max_defer_ms:
            raise invalid(f"DPUB timeout {defer_ms} out of range 0-{max_defer_ms}")
        self._ensure_exists()
        return sum(sizes)

    def _publish(self, bodies: list[bytes], size: int, defer_ms: int, token: int = 0,
                 tags: list[str] | None = None) -> int:
        """Encode and hand on checked bodies (`size` bytes, `tags` one per body or None);
        returns how many confirmations to await."""
        now = self.clock()
        encoded = self.guids.encode_batch(now, bodies)
        self.message_count += len(encoded)
        self.message_bytes += size
        confirm = (self.name, token) if token else None
        retained = self._retain(_records(encoded, tags), confirm)
        if defer_ms:
            due = now + defer_ms * 1_000_000
            items = [(m, due) for m in _records(encoded, tags)]
            if self.channels:
                sent = self._fanout_deferred(items, confirm)
                return sent + retained if confirm else 0
            self.deferred.extend(items)
            if not confirm:
                return 0
            # durable and no channel yet: answered once in the delayed store, due time kept
            self.deferred_on_disk = True
            self.tell(self.dq, DqDefer(_delayed_entries(items), (confirm,)))
            return 1 + retained
        return self._route(encoded, confirm, tags) + retained

    # ---------------------------------------------------------------- retention

    def _retention(self) -> tuple[int, int]:
        """This topic's retention: `(max age ns, max bytes)`; `(0, 0)` is off."""
        if self.ephemeral:
            return 0, 0
        seconds = self.config.get("retention_time", self.options.retention_time)
        return to_ns(seconds), int(self.config.get("retention_bytes",
                                                   self.options.retention_bytes))

    def _retain(self, records: list[bytes], confirm: tuple[str, int] | None) -> int:
        """Append just-published records to the history if retention is on; returns
        the confirmations to await (1 when durable)."""
        age, size = self._retention()
        if not (age or size):
            return 0
        self.tell(self.dq, DqRetain(records, self.clock(), age, size,
                                    (confirm,) if confirm else (), self.history_since))
        return 1 if confirm else 0

    def _arm_retention(self, *, changed: bool = False) -> None:
        """With retention on, keep a `RetentionTick` coming (every tenth of the age
        limit, from 1 s to 60 s; `changed`: a new one at the new pace); with it off,
        delete a history left from when it was on."""
        age, size = self._retention()
        if age or size:
            if changed or not self.ticking:
                self.ticking = next(self._generations)
                self.tell_later(min(60.0, max(1.0, age / 1e10)) if age else 60.0,
                                RetentionTick(self.ticking))
        elif not self.ephemeral and os.path.isdir(self.history_path):
            self.tell(self.dq, DqTrim(self.clock(), 0, 0))

    def _route(self, encoded: list[bytes], confirm: tuple[str, int] | None = None,
               tags: list[str] | None = None) -> int:
        """Fan out (`tags`: one per message, or None), or keep in memory / on disk (as
        tagged records); returns the confirmations to await."""
        if self.channels and not self.paused and not self.memory and not self.disk_depth:
            sent = self._fanout_live(encoded, tags, confirm)
            return sent if confirm else 0
        encoded = _records(encoded, tags)
        room = max(0, self.options.mem_queue_size - len(self.memory))
        if not self.disk_depth:
            self.memory.extend(encoded[:room])
            encoded = encoded[room:]
        if not encoded:
            return 0
        if self.ephemeral:
            self.dropped += len(encoded)
            return 0
        self.tell(self.dq, DqPut(encoded, (confirm,) if confirm else ()))
        self.disk_depth += len(encoded)
        self.put_since_read += len(encoded)
        return 1 if confirm else 0

    def _fanout_live(self, encoded: list[bytes], tags: list[str] | None,
                     confirm: tuple[str, int] | None) -> int:
        """`_fanout` of messages just published: their tags are at hand, not in records."""
        if not self.filters:
            for channel in self.channels:
                self.tell(self._channel_name(channel), ChannelPut(encoded, confirm))
            return len(self.channels)
        sent = 0
        for channel in self.channels:
            wanted = self.filters.get(channel)
            messages = encoded if wanted is None else [] if tags is None else \
                [m for m, t in zip(encoded, tags, strict=True) if t in wanted]
            if messages:
                self.tell(self._channel_name(channel), ChannelPut(messages, confirm))
                sent += 1
        return sent

    def _fanout(self, records: list[bytes], confirm: tuple[str, int] | None = None,
                tagged: bool | None = None) -> int:
        """ChannelPut to every channel of what it takes; returns how many were sent.
        `tagged`: whether any record carries a tag (None: look)."""
        if tagged is None:
            tagged = has_tagged(records)
        if not tagged and not self.filters:  # (the path of a broker that has no tags)
            for channel in self.channels:
                self.tell(self._channel_name(channel), ChannelPut(records, confirm))
            return len(self.channels)
        pairs = [untag_record(r) for r in records]
        every = [m for m, _ in pairs]
        sent = 0
        for channel in self.channels:
            wanted = self.filters.get(channel)
            messages = every if wanted is None else [m for m, t in pairs if t in wanted]
            if messages:
                self.tell(self._channel_name(channel), ChannelPut(messages, confirm))
                sent += 1
        return sent

    def _fanout_deferred(self, items: list[tuple[bytes, int]],
                         confirm: tuple[str, int] | None = None) -> int:
        """ChannelPutDeferred, as `_fanout`, of `(record, due)` pairs."""
        if not self.filters and not has_tagged([m for m, _ in items]):
            for channel in self.channels:
                self.tell(self._channel_name(channel), ChannelPutDeferred(items, confirm))
            return len(self.channels)
        triples = [(*untag_record(m), due) for m, due in items]
        sent = 0
        for channel in self.channels:
            wanted = self.filters.get(channel)
            mine = [(m, due) for m, t, due in triples if wanted is None or t in wanted]
            if mine:
                self.tell(self._channel_name(channel), ChannelPutDeferred(mine, confirm))
                sent += 1
        return sent

    def _stored(self, token: int, error: tuple[str, str, bool] | None) -> None:
        """A write confirmed: answer the publish (or ack the drained batch) after the last."""
        w = self.waiting.get(token)
        if w is None:
            return
        w.outstanding -= 1
        w.error = w.error or (tuple(error) if error else None)
        if w.outstanding > 0:
            return
        del self.waiting[token]
        if w.rewound is not None:
            self._rewind_stored(*w.rewound, w.error)
        elif w.drained is not None:
            if w.error is None:
                self.tell(self.dq, DqAck(w.drained))
        else:
            self._answer(w.publishers, w.error)

    def _drain(self) -> None:
        """Hand what was kept to the channels (when there are channels and no pause)."""
        if not self.channels or self.paused:
            return
        if self.deferred:
            self._fanout_deferred(self.deferred)
            if self.deferred_on_disk:  # (the channels keep them now)
                self.tell(self.dq, DqUndefer([_message_id(m) for m, _ in self.deferred]))
            self.deferred, self.deferred_on_disk = [], False
        if self.memory:
            batch = list(self.memory)
            self.memory.clear()
            self._fanout(batch)
        if self.disk_depth and not self.reading:
            self.reading = True
            self.put_since_read = 0
            self.tell(self.dq, DqRead(READ_BATCH, self.name))

    def _from_disk(self, items: list[tuple[int, bytes]], depth: int) -> None:
        # The queue's unread count at the read, plus what was written behind the read
        # (as the channel counts it: "nothing came back, so empty" forgot those writes)
        self.reading = False
        self.disk_depth = depth + self.put_since_read
        if not items:
            return
        if self.channels and not self.paused:
            if self.durable_ack:  # ack the topic's queue only when the channels have them
                token = next(self._tokens)
                drained = [p for p, _ in items]
                sent = self._fanout([m for _, m in items], (self.name, token))
                if sent:
                    self.waiting[token] = _Waiting(sent, drained=drained)
                else:  # (no channel takes any of them: their tags are filtered out)
                    self.tell(self.dq, DqAck(drained))
            else:
                self._fanout([m for _, m in items])
                self.tell(self.dq, DqAck([p for p, _ in items]))
            self._drain()
        else:  # paused (or channels gone) meanwhile: leave them on disk for later
            self.disk_depth += len(items)
            self.put_since_read += len(items)
            self.tell(self.dq, DqAck([p for p, _ in items]))
            self.tell(self.dq, DqPut([m for _, m in items]))

    # ------------------------------------------------------------------- replay

    def _rewind(self, channel: str, since_ns: int, message_id: str, create: bool = False,
                tags: Sequence[str] | None = None) -> Any:
        """ChannelRewind: find where it starts in the history, keep it in the metadata
        (so that a crash does not stop it halfway), then feed the channel in batches;
        answered when every batch is queued.  With `create`, a new channel (filtered
        by `tags`) is made once the history is known to hold all of it."""
        if not self.exists:
            raise BrokerError(f"topic {self.topic} not found", code="E_TOPIC_NOT_FOUND")
        new = create and channel not in self.channels
        if new:
            if not is_valid_channel_name(channel):
                raise bad_channel(channel, "CREATE_CHANNEL")
            wanted = _checked_tags(tags) if tags else None
        elif channel not in self.channels:
            raise BrokerError(f"channel {channel} not found", code="E_CHANNEL_NOT_FOUND")
        if channel in self.rewinds:
            raise BrokerError(f"channel {channel} is being rewound already",
                              code="E_REWIND_IN_PROGRESS", fatal=False)
        found = None if self.ephemeral else self.ask(
            self.dq, DqHistoryFind(since_ns, message_id.encode()), timeout=30)
        if found is None:
            what = f"message {message_id}" if message_id else "no history"
            raise BrokerError(f"{what}: not retained", code="E_NOT_RETAINED", fatal=False)
        start, end, complete_from = found
        if not message_id and since_ns < complete_from:
            raise BrokerError(f"the history is whole only from {complete_from} ns",
                              code="E_NOT_RETAINED", fatal=False)
        if new:
            self._create_from(channel, wanted)
        if start >= end:
            return {"messages": 0}
        self.rewinds[channel] = _Rewind(start, end, 0, self.defer_reply())
        self._write_meta()  # (answered or not, it now happens: a restart goes on with it)
        self._rewind_next(channel)
        return None

    def _create_from(self, channel: str, wanted: frozenset[str] | None) -> None:
        """A channel that starts from a point of the history.  If it is the topic's first,
        what the topic held for want of a channel is not handed to it, as nsqd's first
        channel would take it: what of that is from the point on comes from the history,
        the rest is before it.  (With nobody else to take it, it is dropped: deferred
        ones too, which the history replays at once.)"""
        if not self.channels and (self.memory or self.disk_depth or self.deferred):
            log.info("%s: channel %s starts from the history: the %d messages held for "
                     "want of a channel are not handed to it", self.name, channel,
                     len(self.memory) + self.disk_depth + len(self.deferred))
            self.memory.clear()
            if self.disk_depth or self.deferred_on_disk:
                self.tell(self.dq, DqEmpty())
            self.disk_depth = self.put_since_read = 0
            self.deferred, self.deferred_on_disk = [], False
        if wanted:
            self.filters[channel] = wanted
        self._command("create_channel", channel)
        self._write_meta()

    def _rewind_next(self, channel: str) -> None:
        r = self.rewinds[channel]
        if r.next < r.end:
            self.tell(self.dq, DqHistoryRead(r.next, r.end, REWIND_BATCH, self.name, channel))
            return
        del self.rewinds[channel]
        self._write_meta()
        if r.waiter is not None:
            r.waiter.set({"messages": r.queued})

    def _rewind_batch(self, channel: str, records: list[bytes], nxt: int) -> None:
        """Records of a rewind, read from the history: to the channel (those its filter
        takes, untagged, each with a new id: the originals may still be queued or in
        flight there), confirmed before the rewind moves on."""
        r = self.rewinds.get(channel)
        if r is None:  # (deleted meanwhile)
            return
        r.next = nxt if records else r.end
        wanted = self.filters.get(channel)
        kept = [(m, t) for m, t in map(untag_record, records) if wanted is None or t in wanted]
        if not kept:
            self._rewind_next(channel)
            return
        ids = self.guids.new_guids(self.clock() // 1_000_000, len(kept))
        messages = [m[:10] + i + m[26:] for (m, _), i in zip(kept, ids, strict=True)]
        token = next(self._tokens)
        self.waiting[token] = _Waiting(1, rewound=(channel, len(messages)))
        self.tell(self._channel_name(channel), ChannelPut(messages, (self.name, token)))

    def _rewind_stored(self, channel: str, count: int,
                       error: tuple[str, str, bool] | None) -> None:
        r = self.rewinds.get(channel)
        if r is None:
            return
        if error is not None:  # (the channel's disk refused them): the rewind stops
            del self.rewinds[channel]
            self._write_meta()
            log.warning("%s: rewind of %s stopped: %s", self.name, channel, error[1])
            if r.waiter is not None:
                r.waiter.set(tuple(error))
            return
        r.queued += count
        self._write_meta()  # its progress, so that a restart does not queue these again
        self._rewind_next(channel)

    # ------------------------------------------------------------------- lookup

    def _find(self, message_id: bytes) -> dict[str, Any]:
        """TopicFind: the topic's memory, then, in one round of asks, each channel and
        the disk-queue actor (the topic's queue and its history, each by its index)."""
        if not self.exists:
            raise BrokerError(f"topic {self.topic} not found", code="E_TOPIC_NOT_FOUND")
        held = next((r for r in itertools.chain(self.memory, (m for m, _ in self.deferred))
                     if record_id(r) == message_id), None)
        names = sorted(self.channels)
        asks = [(self._channel_name(c), ChannelFind(message_id)) for c in names]
        if not self.ephemeral:
            asks.append((self.dq, DqFind(message_id)))
        replies = self.ask_many(asks, timeout=FIND_TIMEOUT)
        storage = (None, None) if self.ephemeral else replies.pop()
        if isinstance(storage, Exception):
            raise storage
        queued, retained = storage
        if held is None and queued is not None:
            record, read = queued
            # Read from the topic's queue and not acked: on its way here (a read in
            # progress), or handed to the channels, which then say where it is.
            if not read or self.reading:
                held = record
        found = [r for r in replies if isinstance(r, dict)]
        record = held or retained or (found[0]["message"] if found else None)
        if record is None:
            raise BrokerError(f"message {message_id.decode()} not found in topic {self.topic}",
                              code="E_MESSAGE_NOT_FOUND", fatal=False)
        encoded, tag = untag_record(record)
        timestamp = int.from_bytes(encoded[:8], "big")
        known_tag = held is not None or retained is not None  # (channels keep no tags)
        channels: dict[str, dict[str, Any]] = {}
        for c, reply in zip(names, replies, strict=True):
            wanted = self.filters.get(c)
            if isinstance(reply, Exception):
                channels[c] = {"state": "unknown", "error": str(reply)}
            elif reply is not None:
                channels[c] = _channel_entry(reply)
            elif known_tag and wanted is not None and tag not in wanted:
                channels[c] = {"state": "not_delivered", "reason": "its tag filter"}
            elif timestamp < self.since.get(c, 0):
                channels[c] = {"state": "not_delivered",
                               "reason": "the channel was created after it"}
            else:
                channels[c] = {"state": "topic" if held is not None else "consumed"}
        states = [e["state"] for e in channels.values() if e["state"] in _PROGRESS]
        if states:
            state = min(states, key=_PROGRESS.index)
        elif held is not None:
            state = "topic"
        elif channels and all(e["state"] == "not_delivered" for e in channels.values()):
            state = "not_delivered"  # (no channel of the topic takes it)
        else:
            state = "consumed"  # (by channels deleted since, or there is none)
        counts = [e["attempts"] for e in channels.values() if "attempts" in e]
        return {"id": message_id.decode(), "timestamp": timestamp,
                "attempts": max(counts) if counts else 0 if held is not None else None,
                "body": encoded[26:], "tag": tag if known_tag else None, "state": state,
                "channels": channels}

    # ----------------------------------------------------------------- commands

    def _channel_name(self, channel: str) -> str:
        return f"channel:{self.topic}/{channel}"

    def _channel(self, channel: str, command: str) -> None:
        self.tell(self._channel_name(channel), ChannelCommand(command))

    def _command(self, command: str, arg: str) -> None:
        # "subscribe" (a client's SUB) creates the topic too; "create_channel" (HTTP's
        # /channel/create) needs it to exist, as nsqd's GetExistingTopic.
        if not self.exists and command not in {"hello", "subscribe"}:
            raise BrokerError(f"topic {self.topic} not found", code="E_TOPIC_NOT_FOUND")
        if command in {"create_channel", "subscribe", "delete_channel", "pause_channel",
                       "unpause_channel", "empty_channel"} and not is_valid_channel_name(arg):
            raise bad_channel(arg, "SUB" if command == "subscribe" else command.upper())
        if command == "hello":
            if not self.valid:
                raise bad_topic(self.topic, "CREATE")
            self._ensure_exists()
        elif command in {"create_channel", "subscribe"}:
            if not self.valid:
                raise bad_topic(self.topic, "SUB")
            self._ensure_exists()
            if arg not in self.channels:
                self._add_channel(arg)
                self._write_meta_for(arg)
            self._channel(arg, "hello")
            self._drain()
        elif command == "delete_channel":
            if arg not in self.channels:
                raise BrokerError(f"channel {arg} not found", code="E_CHANNEL_NOT_FOUND")
            self._delete_channel(arg)
        elif command in {"pause_channel", "unpause_channel"}:
            if arg not in self.channels:
                raise BrokerError(f"channel {arg} not found", code="E_CHANNEL_NOT_FOUND")
            self.channels[arg] = command == "pause_channel"
            self._write_meta()
            self._channel(arg, command.partition("_")[0])
        elif command == "empty_channel":
            if arg not in self.channels:
                raise BrokerError(f"channel {arg} not found", code="E_CHANNEL_NOT_FOUND")
            self._channel(arg, "empty")
        elif command in {"pause", "unpause"}:
            self._ensure_exists()
            self.paused = command == "pause"
            self._write_meta()
            self._drain()
        elif command == "empty":
            self.memory.clear()
            self.deferred.clear()
            self.deferred_on_disk = False
            self.disk_depth = 0
            self.tell(self.dq, DqEmpty())
        elif command == "delete":
            self._delete_topic()
        else:
            raise invalid(f"unknown topic command {command}")

    def _channel_config(self) -> ChannelConfig:
        depth = self.config.get("backlog_alarm_depth", self.options.backlog_alarm_depth)
        return ChannelConfig(int(depth))

    def _configure(self, values: dict[str, Any] | None) -> dict[str, Any]:
        """TopicConfig: set (a value of None: back to the broker's default), then answer
        the effective settings."""
        if not self.exists:
            raise BrokerError(f"topic {self.topic} not found", code="E_TOPIC_NOT_FOUND")
        if values:
            was_on = any(self._retention())
            config = dict(self.config)
            for key, value in values.items():
                if value is None:
                    config.pop(key, None)
                else:
                    config[key] = value
            self.config = _checked_config(config, strict=True)
            if any(self._retention()) and not was_on:  # its history begins now
                self.history_since = self.clock()
            self._write_meta()
            update = self._channel_config()
            for channel in self.channels:
                self.tell(self._channel_name(channel), update)
            age, size = self._retention()
            if age or size:  # a lower limit applies at once
                self.tell(self.dq, DqTrim(self.clock(), age, size))
            self._arm_retention(changed=True)
        age, size = self._retention()
        return {"topic": self.topic,
                "backlog_alarm_depth": self._channel_config().backlog_alarm_depth,
                "retention_time": format_duration(age / 1e9), "retention_bytes": size,
                "defaults": sorted(k for k in TOPIC_SETTINGS if k not in self.config)}

    def _channel_tags(self, channel: str, tags: Sequence[str] | None, *,
                      create: bool) -> dict[str, Any]:
        """ChannelTags: set (or only read) a channel's tag filter."""
        if not is_valid_channel_name(channel):
            raise bad_channel(channel, "CREATE_CHANNEL" if create else "CHANNEL_CONFIG")
        wanted = _checked_tags(tags) if tags is not None else None
        if not self.exists:  # (as /channel/create: nsqd's GetExistingTopic)
            raise BrokerError(f"topic {self.topic} not found", code="E_TOPIC_NOT_FOUND")
        if channel not in self.channels and not create:
            raise BrokerError(f"channel {channel} not found", code="E_CHANNEL_NOT_FOUND")
        changed = wanted is not None and wanted != self.filters.get(channel, frozenset())
        if changed:  # (before a new channel takes the topic's backlog: filtered too)
            if wanted:
                self.filters[channel] = wanted
            else:
                self.filters.pop(channel, None)
        if create:
            self._command("create_channel", channel)
        if changed:
            self._write_meta()
        return {"topic": self.topic, "channel": channel,
                "tags": sorted(self.filters.get(channel, ()))}

    def _delete_channel(self, channel: str) -> None:
        listed = self._in_meta(channel)
        self.filters.pop(channel, None)
        self.since.pop(channel, None)
        rewind = self.rewinds.pop(channel, None)
        if rewind is not None and rewind.waiter is not None:
            rewind.waiter.set(BrokerError(f"channel {channel} was deleted during its rewind",
                                          code="E_CHANNEL_NOT_FOUND").to_wire())
        if self.channels.pop(channel, None) is None:
            return
        announce(self, self.options, self.topic, channel, gone=True)
        self._channel(channel, "delete")
        if listed:
            self._write_meta()
        if self.ephemeral and not self.channels:
            self._delete_topic()

    def _delete_topic(self) -> None:
        for channel in list(self.channels):
            announce(self, self.options, self.topic, channel, gone=True)
            self._channel(channel, "delete")
        if self.exists:
            announce(self, self.options, self.topic, gone=True)
        if not self.ephemeral:
            self.tell(self.dq, DqDelete())
        with contextlib.suppress(FileNotFoundError):
            os.unlink(self.meta_path)
        for channel, rewind in self.rewinds.items():
            if rewind.waiter is not None:
                rewind.waiter.set(BrokerError(f"topic {self.topic} was deleted during the "
                                              f"rewind of {channel}",
                                              code="E_TOPIC_NOT_FOUND").to_wire())
        self._reset()
        self.deleted = True  # (on_receive then stops the actor if nothing else waits)

    def _stats(self, include_clients: bool, include_storage: bool = False) -> dict[str, Any]:
        names = sorted(self.channels)
        age, size = self._retention()
        retaining = bool(age or size)
        replies = self.ask_many([*((self._channel_name(c),
                                    ChannelStats(include_clients, include_storage))
                                   for c in names),
                                 *([(self.dq, DqHistoryStats())] if retaining else [])],
                                timeout=5)
        history = replies.pop() if retaining else {}
        if not isinstance(history, dict):  # (an exception: the history cannot say now)
            history = {}
        channels = [{"channel_name": c, "error": str(r)} if isinstance(r, Exception) else r
                    for c, r in zip(names, replies, strict=True)]
        for c, entry in zip(names, channels, strict=True):
            entry["tags"] = sorted(self.filters.get(c, ()))
        e2e = self._e2e(channels)
        return {
            "topic_name": self.topic,
            "depth": len(self.memory) + self.disk_depth,
            "backend_depth": self.disk_depth,
            "message_count": self.message_count,
            "message_bytes": self.message_bytes,
            "dropped_count": self.dropped,
            "deferred_count": len(self.deferred),
            "paused": self.paused,
            "retained_bytes": history.get("retained_bytes", 0),
            "oldest_retained_timestamp": history.get("oldest_retained_timestamp", 0),
            "channels": channels,
            **e2e,
            **({"storage": self.ask(self.dq, DqStats(), timeout=5)}
               if include_storage and not self.ephemeral else {}),
        }

    def _e2e(self, channels: list[dict[str, Any]]) -> dict[str, Any]:
        """The topic's end-to-end latency, from its channels' samples (each channel's
        are removed from its entry), as nsqd merges its channels' streams."""
        quantiles = self.options.e2e_processing_latency_percentile
        count, samples = 0, []
        for c in channels:
            n, s = c.pop(E2E_SAMPLES, None) or (0, [])
            count += n
            samples.extend((v, w) for v, w in s)
        if not quantiles:
            return {}
        return {"e2e_processing_latency": e2e_result(quantiles, count, samples)}
