"""Messages between the broker's actors (topic, channel, client, scanner).

Small frozen dataclasses registered with the envelope codec, grouped by the
actor that receives them.  They live in one module because the broker's
actors message each other in both directions (a topic fans out to its
channels; a channel tells its topic it exists), and per-actor modules would
import each other.  Disk-queue messages are in `actors.broker.diskqueue`.
"""

from __future__ import annotations

from typing import Any

from actors.runtime.actor import no_spawn
from transport.mailbox.envelope import message

# --------------------------------------------------------------- to a channel

@message
class ChannelPut:
    """New messages from the topic (NSQ-encoded)."""

    messages: list[bytes]
    confirm: tuple[str, int] | None = None
    """`(topic actor, token)`: tell it `Stored(token)` once the messages are on disk."""


@message
class ChannelPutDeferred:
    """Deferred messages from the topic: `(encoded, due_ns)`."""

    items: list[tuple[bytes, int]]
    confirm: tuple[str, int] | None = None
    """As for `ChannelPut`: confirmed once they are in the delayed store."""


@message
class Sub:
    """A client subscribes with its message timeout, and what /stats shows of it."""

    client: str
    msg_timeout_ms: int
    info: dict[str, Any] | None = None


@message
class Rdy:
    """A client's RDY count; also its periodic lease refresh (a channel that restarted
    and lost its subscriptions re-learns the client from it)."""

    client: str
    count: int
    msg_timeout_ms: int = 0


@message
class Fin:
    """A client finished these messages (ids as 16 hex bytes)."""

    client: str
    ids: list[bytes]


@message
class Req:
    """A client requeues a message, now (0) or after `delay_ms`."""

    client: str
    id: bytes
    delay_ms: int


@message
class Touch:
    """A client needs more time for a message."""

    client: str
    id: bytes


@message
class Unsub:
    """A client left (CLS, disconnect, heartbeat timeout)."""

    client: str


@no_spawn
@message
class Scan:
    """From the scanner: process in-flight and deferred work due at `now_ns`."""

    now_ns: int
    reply_to: str


@message
class ChannelCommand:
    """Operator command: `pause`, `unpause`, `empty`, `delete`, `hello` (ensure started)."""

    command: str


@message
class ChannelStats:
    """Ask: this channel's stats (nsqd's /stats shape); `include_storage` adds its disk
    queue's (``storage``: chunks with their messages, reads, writes, cache state)."""

    include_clients: bool = True
    include_storage: bool = False


@message
class ChannelFind:
    """Ask: where the message `message_id` (16 hex bytes) is in this channel (#21).
    Reply: None if the channel does not hold it, else ``{"state": "queued" |
    "in_flight" | "deferred", "message": <encoded as held>}``, with ``client``,
    ``client_id`` and ``deadline`` (ns) in flight, ``due`` (ns) deferred."""

    message_id: bytes


@no_spawn
@message
class Deliver:
    """To a client actor: messages to send, from `channel` (`topic/channel`)."""

    channel: str
    messages: list[bytes]

    def bounce(self, client: str) -> tuple[str, Any]:
        """The client actor is gone (its gateway restarted): the channel drops it and
        puts what it had in flight back at once."""
        return f"channel:{self.channel}", Unsub(client)


@no_spawn
@message
class ClientError:
    """To a client actor: an error to send it (`BrokerError.to_wire()`)."""

    error: tuple[str, str, bool]



# ----------------------------------------------------------------- to a topic


@message
class Publish:
    """Publish bodies (PUB is one body, MPUB many), deferred by `defer_ms` if > 0.

    As an ask, the reply is None or a `BrokerError.to_wire()` tuple.
    """

    bodies: list[bytes]
    defer_ms: int = 0
    reply_to: str = ""
    """If set, the result is told to this actor as `PublishDone(corr, ...)` instead."""
    corr: int = 0
    tag: str = ""
    """The messages' tag ('' for none): channels with a tag filter take only theirs."""


GATHER_MAX = 1024
"""Messages a client actor (per run) or a topic (per fan-out) gathers from several
publishes before it sends them on without waiting for its run to end: bursts of
single PUBs are joined, and a run of MPUBs stays in batches of this order."""


@no_spawn
@message
class PublishDone:
    """To a client actor: the result of its `Publish` number `corr` (None = OK)."""

    corr: int
    error: tuple[str, str, bool] | None


@no_spawn
@message
class RetentionTick:
    """To a topic itself, on a timer: trim its history by its retention policy (a tick
    of an earlier `generation` is stale: the policy changed since)."""

    generation: int


@message
class Stored:
    """To a topic: the write it asked for with `token` is done (error None) or failed."""

    token: int
    error: tuple[str, str, bool] | None = None


@message
class PublishEncoded:
    """Already encoded messages (dead letters keep their id, timestamp and attempts)."""

    messages: list[bytes]


@no_spawn
@message
class ChannelUp:
    """A channel of this topic started.  `revive`: it was re-created by a client that
    still holds a subscription (a lease `Rdy` after a worker restart), so the topic
    takes it back; otherwise an unknown channel is ignored (a deleted one's late
    start must not bring it back)."""

    channel: str
    revive: bool = False


@message
class ChannelConfig:
    """The topic's settings for its channels, told after each `ChannelUp` and on every
    change: the depth at which a channel's backlog alarm fires (0: off)."""

    backlog_alarm_depth: int


@message
class TopicConfig:
    """Ask: set the topic's own settings (`values`: ``backlog_alarm_depth``,
    ``retention_time`` in seconds, ``retention_bytes``, each a number >= 0, or None to
    go back to the broker's flag), kept in its metadata file; with no values, only read
    them.  Reply: ``{"topic", "backlog_alarm_depth", "retention_time" (a duration
    string), "retention_bytes", "defaults"}`` (the effective values, and which of them
    are the broker's flags), or a `BrokerError.to_wire()` tuple (``E_TOPIC_NOT_FOUND``,
    ``E_INVALID``)."""

    values: dict[str, Any] | None = None


@message
class ChannelRewind:
    """Ask: queue again on `channel` every retained message published at or after
    `since_ns` -- or, with `message_id` (16 hex characters), that message and the
    ones after it -- in publish order (#21).  Reply, once they are all queued:
    ``{"messages": N}``, or a `BrokerError.to_wire()` tuple (``E_TOPIC_NOT_FOUND``,
    ``E_CHANNEL_NOT_FOUND``, ``E_NOT_RETAINED``, ``E_REWIND_IN_PROGRESS``)."""

    channel: str
    since_ns: int = 0
    message_id: str = ""
    create: bool = False
    """Create the channel (with the tag filter `tags`, if given) if it does not exist:
    it then starts from there, and does not take what the topic held meanwhile."""
    tags: tuple[str, ...] | None = None


@message
class ChannelTags:
    """Ask the topic: set channel `channel`'s tag filter (`tags`: the tags it takes;
    empty: every message, as without a filter), creating the channel first if
    `create`; with `tags` None, only read it.  Kept in the topic's metadata.  Reply:
    ``{"topic", "channel", "tags": [...]}``, or a `BrokerError.to_wire()` tuple."""

    channel: str
    tags: tuple[str, ...] | None = None
    create: bool = False


@message
class ChannelGone:
    """An #ephemeral channel lost its last client: delete it."""

    channel: str


@message
class TopicCommand:
    """Ask: `pause`, `unpause`, `empty`, `delete`, `create_channel`, `delete_channel`,
    `pause_channel`, `unpause_channel`, `empty_channel`, `hello` (create the topic),
    `subscribe` (a SUB: create the topic and the channel); `arg` is the channel name.
    Every command but `hello` and `subscribe` needs the topic to exist.

    Reply: None, or a `BrokerError.to_wire()` tuple.
    """

    command: str
    arg: str = ""


FIND_TIMEOUT = 60.0
"""How long a lookup by id waits at each step: the first lookup in a disk queue with a
backlog of millions reads it once (docs/STORAGE.md, "Finding a message")."""


@message
class TopicFind:
    """Ask: the message `message_id` (16 hex bytes), wherever this topic, its channels
    and its history hold it (#21), as ``GET /message`` answers it: ``{"id",
    "timestamp", "attempts", "body" (bytes), "tag", "state", "channels": {name:
    {"state", ...}}}``; or a `BrokerError.to_wire()` tuple (``E_TOPIC_NOT_FOUND``,
    ``E_MESSAGE_NOT_FOUND``)."""

    message_id: bytes


@message
class TopicStats:
    """Ask: the topic's stats with its channels' (nsqd's /stats shape)."""

    include_clients: bool = True
    existing_only: bool = False
    """None instead of stats if the topic does not exist (the actor is only a name:
    asked about, or deleted)."""
    include_storage: bool = False
    """Add each disk queue's stats (``storage``), the topic's and its channels'."""


# ---------------------------------------------------------------- to a scanner


@message
class ScanRegister:
    """A channel (`topic/channel`) on this worker has work in flight or deferred: sweep it."""

    channel: str


@message
class ScanUnregister:
    """A channel was deleted."""

    channel: str


@message
class ScanDone:
    """A channel's answer to `Scan`: whether it had expired work, and whether it has
    nothing in flight or deferred any more (`idle`: it leaves the sweep)."""

    channel: str
    dirty: bool
    idle: bool = False


@message
class Alive:
    """Ask a scanner: answered by its worker's dispatcher -- `/ping`'s probe of the
    path from the gateway to the worker's actors -- with the worker's failed queues
    (``{queue: why}``) and its last publish's outcome (``(when, why)``), see
    `actors.broker.health`."""


@message
class Swept:
    """Ask a scanner: the channels it sweeps now (those with work in flight or deferred)."""


@message
class Tick:
    """The scanner's own timer: time for a sweep (ignored unless `epoch` is the instance's)."""

    epoch: int = 0


# ----------------------------------------------------------- to a client actor
# (Deliver and ClientError above are sent by channels to client actors.)
