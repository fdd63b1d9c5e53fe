"""The channel actor: `channel:<topic>/<channel>`, a thin shell around `ChannelState`.

Every message it receives changes the pure :class:`~actors.broker.channel_state.ChannelState`;
then one delivery pass (``pump``) runs, and its effects become messages:
deliveries to client actors (one batch per client), writes, reads, acks and
delayed-store updates to the channel's disk-queue actor, dead letters to the
dead-letter topic.  For the frequent messages (puts, FINs, RDYs, disk reads)
the pass waits for the end of the run (``on_batch_end``), or for the next
message of another kind, so a run of them costs one pass, one ``Deliver`` per
client and one disk write, however many there were.  In-flight timeouts and deferred messages
are processed when the worker's scanner sends ``Scan(now)`` (nsqd's
queueScanLoop, as messages).

At start the channel asks its disk-queue actor what storage holds (depth,
deferred messages with their due times), registers with its worker's scanner
and tells its topic it exists (so a channel created by a SUB is recorded in
the topic's metadata).  At an orderly stop, messages that live only in
memory are written to disk, so a clean stop loses nothing.
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any

from actors.broker.channel_state import ChannelState, Effects
from actors.broker.diskqueue import (
    DqAck,
    DqDefer,
    DqDelete,
    DqEmpty,
    DqFind,
    DqMessages,
    DqOpen,
    DqPut,
    DqRead,
    DqReopened,
    DqStats,
    DqUndefer,
    DqWriteFailed,
)
from actors.broker.e2e import E2E_SAMPLES, LatencyWindow
from actors.broker.errors import BrokerError
from actors.broker.messages import (
    FIND_TIMEOUT,
    ChannelCommand,
    ChannelConfig,
    ChannelFind,
    ChannelGone,
    ChannelPut,
    ChannelPutDeferred,
    ChannelStats,
    ChannelUp,
    ClientError,
    Deliver,
    Fin,
    PublishEncoded,
    Rdy,
    Req,
    Scan,
    ScanDone,
    ScanRegister,
    ScanUnregister,
    Stored,
    Sub,
    Touch,
    Unsub,
)
from actors.broker.nsq_message import is_ephemeral
from actors.broker.options import BrokerOptions
from actors.runtime.actor import Actor
from actors.runtime.placement import Placement
from transport.http.webhook import webhook_for

log = logging.getLogger(__name__)

_PASS_AT_RUN_END = frozenset({ChannelPut, ChannelPutDeferred, DqMessages, Fin, Rdy})
"""The frequent messages: their delivery pass (and effects) wait for the run's end, so
a run of FINs and puts costs one pass and one delivery per client, not one each."""


def scanner_for(topic: str, workers: int) -> str:
    """Name of the scanner on the worker that hosts `topic`'s family."""
    node = Placement(workers).node_for(f"topic:{topic}")
    return f"scanner:{node.rpartition('-')[2]}"


class ChannelActor(Actor):
    """See the module docstring."""

    def __init__(self, name: str, options: BrokerOptions, clock: Any = time.time_ns) -> None:
        super().__init__(name)
        self.options = options
        self.clock = clock
        self.key = name.partition(":")[2]  # "topic/channel"
        self.topic, _, self.channel = self.key.partition("/")
        self.dq = f"diskqueue:{self.key}"
        self.durable = not is_ephemeral(self.channel)
        self.deleted = False
        self.state = self._new_state()
        self.put_confirms: list[tuple[str, int]] = []
        self.defer_confirms: list[tuple[str, int]] = []
        self.swept = False  # registered with the scanner (it has work to expire)
        self.alarm_depth = options.backlog_alarm_depth  # (the topic's, by ChannelConfig)
        self.alarm = False  # the backlog alarm is firing: depth >= alarm_depth > 0
        self.pass_due = False  # messages of this run changed the state: pass at its end

    def _new_state(self) -> ChannelState:
        o = self.options
        state = ChannelState(mem_queue_size=o.mem_queue_size, durable=self.durable,
                             max_rdy_count=o.max_rdy_count, max_attempts=o.max_attempts,
                             rng=random.Random())
        if o.e2e_processing_latency_percentile:  # (off by default, as in nsqd)
            state.e2e = LatencyWindow(o.e2e_processing_latency_percentile,
                                      int(o.e2e_processing_latency_window_time * 1e9),
                                      clock=self.clock)
        return state

    # ---------------------------------------------------------------- lifecycle

    def on_start(self) -> None:
        # rewind: a restarted channel lost its in-flight list; offer those messages again
        depth, deferred = self.ask(self.dq, DqOpen(rewind=True), timeout=30)
        self.state.restore(depth if self.durable else 0, [tuple(e) for e in deferred])
        self.tell(f"topic:{self.topic}", ChannelUp(self.channel))
        self._after()

    def on_stop(self) -> None:
        if self.pass_due:
            self._after()  # (the run's acks and writes reach the disk-queue actor)
        if self.deleted or not self.durable:
            return
        kept = self.state.memory_only()
        if kept:
            self.tell(self.dq, DqPut(kept))
            log.info("%s: wrote %d memory-only messages to disk at shutdown", self.name, len(kept))

    # ----------------------------------------------------------------- messages

    def on_batch_end(self) -> None:
        if self.pass_due:
            self._after()

    def on_receive(self, msg: Any) -> Any:
        if type(msg) in _PASS_AT_RUN_END:  # one delivery pass for the whole run (on_batch_end)
            return self._change(msg)
        if self.pass_due:
            self._after()  # what came before this message takes effect first
        reply = self._change(msg)
        if self.pass_due:
            self._after()
        return reply

    def _change(self, msg: Any) -> Any:
        s = self.state
        match msg:
            case ChannelPut(messages=messages, confirm=confirm):
                s.put(list(messages))
                self._confirm_when_written(confirm, s.effects.disk_put, self.put_confirms)
            case ChannelPutDeferred(items=items, confirm=confirm):
                s.put_deferred([(m, due) for m, due in items])
                self._confirm_when_written(confirm, s.effects.delayed_add,
                                           self.defer_confirms)
            case DqMessages(items=items, depth=depth, again=again):
                s.from_disk(items, depth, again)
            case DqWriteFailed(count=count):
                s.disk_depth = max(0, s.disk_depth - count)  # those never reached the disk
            case Sub(client=client, msg_timeout_ms=timeout_ms, info=info):
                s.subscribe(client, timeout_ms * 1_000_000, info)
            case Rdy(client=client, count=count, msg_timeout_ms=timeout_ms):
                if timeout_ms and client not in s.clients:
                    s.subscribe(client, timeout_ms * 1_000_000)  # re-learned after a restart
                    # (its topic may have lost this channel too: an ephemeral one, a worker
                    # restart) -- the topic takes it back while a client still holds it
                    self.tell(f"topic:{self.topic}", ChannelUp(self.channel, revive=True))
                self._guard(client, lambda: s.set_rdy(client, count))
            case DqReopened():
                if self.durable and not self.deleted:
                    depth, _ = self.ask(self.dq, DqOpen(), timeout=30)
                    s.disk_reopened(depth)
            case Fin(client=client, ids=ids):
                for error in s.finish(client, list(ids)):
                    self.tell(client, ClientError(error.to_wire()))
            case Req(client=client, id=msg_id, delay_ms=delay_ms):
                self._guard(client, lambda: s.requeue(client, msg_id, delay_ms * 1_000_000,
                                                      self.clock()))
            case Touch(client=client, id=msg_id):
                self._guard(client, lambda: s.touch(client, msg_id, self.clock()))
            case Unsub(client=client):
                s.unsubscribe(client)
                if not s.clients and not self.durable and not self.deleted:
                    self.tell(f"topic:{self.topic}", ChannelGone(self.channel))
            case Scan(now_ns=now, reply_to=reply_to):
                dirty = s.process(now)
                self._after()
                idle = not (s.in_flight or s.deferred)
                if idle:
                    self.swept = False
                self.tell(reply_to, ScanDone(self.key, dirty, idle))
                return None
            case ChannelCommand(command=command):
                return self._command(command)
            case ChannelConfig(backlog_alarm_depth=depth):
                self.alarm_depth = depth
                self._check_alarm()
                return None
            case ChannelStats(include_clients=include_clients, include_storage=storage):
                return self._stats(include_clients, storage)
            case ChannelFind(message_id=message_id):
                return self._find(message_id)
            case _:
                log.warning("%s: unexpected message %r", self.name, msg)
                return None
        self.pass_due = True
        return None

    def _confirm_when_written(self, confirm: Any, writes: list[Any],
                              pending: list[tuple[str, int]]) -> None:
        """The topic waits for `confirm`: attach it to this message's disk write, or,
        when nothing had to be written (memory, ephemeral, deleted), confirm now."""
        if confirm is None:
            return
        if writes and not self.deleted:
            pending.append(tuple(confirm))
        else:
            self.tell(confirm[0], Stored(confirm[1]))

    def _guard(self, client: str, action: Any) -> None:
        try:
            action()
        except BrokerError as e:
            self.tell(client, ClientError(e.to_wire()))

    def _command(self, command: str) -> Any:
        s = self.state
        if command == "pause":
            s.paused = True
        elif command == "unpause":
            s.paused = False
        elif command == "empty":
            s.empty()
            self._apply(s.take_effects())
            self.tell(self.dq, DqEmpty())
        elif command == "delete":
            if self.alarm:  # a deleted channel has no backlog: say so once
                self.alarm_depth = 0
                self._check_alarm()
            self.deleted = True
            for client in list(s.clients):
                self.tell(client, ClientError(("E_INVALID", f"channel {self.key} was deleted",
                                               True)))
            if self.swept:
                self.swept = False
                self.tell(scanner_for(self.topic, self.options.workers),
                          ScanUnregister(self.key))
            self.tell(self.dq, DqDelete())
            self.state = self._new_state()
            self.stop()  # a reused name creates a fresh channel
            return True
        elif command == "hello":
            if self.deleted:  # the name is in use again: start afresh
                self.deleted = False
                self.on_start()
            return True
        else:
            raise ValueError(f"unknown channel command {command!r}")
        self._after()
        return True

    # ------------------------------------------------------------------ effects

    def _after(self) -> None:
        self.pass_due = False
        if self.deleted:
            return
        s = self.state
        s.pump(self.clock())
        fx = s.take_effects()
        if fx:
            self._apply(fx)
        if not self.swept and (s.in_flight or s.deferred):
            self.swept = True  # until a Scan finds it idle again
            self.tell(scanner_for(self.topic, self.options.workers), ScanRegister(self.key))
        if self.alarm_depth or self.alarm:
            self._check_alarm()

    def _check_alarm(self) -> None:
        """The backlog alarm (EQueue's): it fires when the depth reaches `alarm_depth`
        and clears when it falls below; each change is logged once and, with
        ``--backlog-alarm-webhook``, POSTed (transport.http.webhook, never waited for)."""
        depth = self.state.depth()
        firing = bool(self.alarm_depth) and depth >= self.alarm_depth
        if firing == self.alarm:
            return
        self.alarm = firing
        if firing:
            log.warning("%s: backlog alarm: depth %d reached %d", self.name, depth,
                        self.alarm_depth)
        else:
            log.info("%s: backlog alarm cleared: depth %d (alarm at %s)", self.name, depth,
                     self.alarm_depth or "off")
        url = self.options.backlog_alarm_webhook
        if url:
            webhook_for(url).post({"topic": self.topic, "channel": self.channel,
                                   "depth": depth, "threshold": self.alarm_depth,
                                   "alarm": firing, "ts": self.clock()})

    def _apply(self, fx: Effects) -> None:
        dq = self.dq
        if fx.disk_put:
            self.tell(dq, DqPut(fx.disk_put, tuple(self.put_confirms)))
            self.put_confirms = []
        if fx.delayed_add:
            self.tell(dq, DqDefer(fx.delayed_add, tuple(self.defer_confirms)))
            self.defer_confirms = []
        if fx.disk_ack:
            self.tell(dq, DqAck(fx.disk_ack))
        if fx.delayed_remove:
            self.tell(dq, DqUndefer(fx.delayed_remove))
        if fx.disk_read:
            self.tell(dq, DqRead(fx.disk_read, self.name))
        for client, messages in fx.deliveries.items():
            self.tell(client, Deliver(self.key, messages))
        if fx.dead_letters:
            dead = self.options.dead_letter_topic_for(self.topic)
            self.tell(f"topic:{dead}", PublishEncoded(fx.dead_letters))

    def _find(self, message_id: bytes) -> dict[str, Any] | None:
        """ChannelFind: in flight or deferred (by id), then the disk queue (by its
        summaries: what it holds is queued, read into memory or on its way here or
        not), then the walk of the memory queue for a message that lives only there."""
        s = self.state
        found = s.find(message_id, waiting=False)
        if found is None and self.durable and not self.deleted:
            queued, _ = self.ask(self.dq, DqFind(message_id), timeout=FIND_TIMEOUT)
            if queued is not None:
                return {"state": "queued", "message": queued[0]}
        if found is None:
            found = s.find(message_id)
        if found is not None and found["state"] == "in_flight":
            client = s.clients.get(found["client"])
            found["client_id"] = str(((client.info if client else None) or {})
                                     .get("client_id", ""))
        return found

    def _stats(self, include_clients: bool, include_storage: bool = False) -> dict[str, Any]:
        s = self.state
        out: dict[str, Any] = {
            "channel_name": self.channel,
            "depth": s.depth(),
            "backend_depth": s.disk_depth,
            "in_flight_count": len(s.in_flight),
            "deferred_count": len(s.deferred),
            "message_count": s.stats.message_count,
            "requeue_count": s.stats.requeue_count,
            "timeout_count": s.stats.timeout_count,
            "dead_letter_count": s.stats.dead_letter_count,
            "dropped_count": s.stats.dropped_count,
            "client_count": len(s.clients),
            "paused": s.paused,
            "backlog_alarm": self.alarm,
            "backlog_alarm_depth": self.alarm_depth,
        }
        if s.e2e is not None:
            out["e2e_processing_latency"] = s.e2e.result()
            out[E2E_SAMPLES] = s.e2e.weighted()  # for the topic's figures (it drops them)
        if include_clients:
            out["clients"] = s.client_stats()
        if include_storage and self.durable:
            out["storage"] = self.ask(self.dq, DqStats(), timeout=5)
        return out

