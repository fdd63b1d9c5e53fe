"""nsqd's statsd push (``--statsd-address``): the ``statsd:push`` actor, on the gateway.

Every ``--statsd-interval`` it reads every topic's stats (the asks ``/stats``
makes) and sends nsqd 1.3's lines for them (transport.statsd): per topic
``topic.T.message_count`` and ``message_bytes`` (counters: the increase
since the last push), ``depth``, ``backend_depth`` and
``e2e_processing_latency_<P>`` (gauges); per channel
``topic.T.channel.C.message_count``, ``requeue_count``, ``timeout_count``
(counters), ``depth``, ``backend_depth``, ``in_flight_count``,
``deferred_count``, ``clients`` and ``e2e_processing_latency_<P>``
(gauges).  With ``--statsd-mem-stats`` (on, as in nsqd) it adds nsqd's
``mem.*`` names with what Python has for them, over the broker's processes
where a figure is per process: ``mem.heap_in_use_bytes`` is the resident
memory of them all, ``mem.heap_objects`` the objects the gateway's garbage
collector tracks, ``mem.gc_runs`` its collections since the last push and
``mem.gc_pause_usec_{100,99,95}`` the percentiles of its last 256 pauses;
``mem.heap_idle_bytes``, ``mem.heap_released_bytes`` and
``mem.next_gc_bytes`` (Go's allocator) are sent as 0, so a dashboard made
for nsqd finds every name.  A push that fails is logged; the next one comes
on time.
"""

from __future__ import annotations

import gc
import logging
import time
from collections import deque
from typing import Any

from actors.broker.gateway import GatewayFacade, ListenerInfo
from actors.broker.nsq_message import is_ephemeral
from actors.broker.options import BrokerOptions, run_dir_for
from actors.runtime.actor import Actor
from actors.runtime.control import ControlClient
from transport import statsd
from transport.mailbox.envelope import message

log = logging.getLogger(__name__)

NAME = "statsd:push"


def statsd_names(options: BrokerOptions) -> list[str]:
    """The statsd actor of a broker with these options (none without an address)."""
    return [NAME] if options.statsd_address else []


@message
class StatsdTick:
    """Push now (and schedule the next push)."""


_TOPIC_COUNTERS = ("message_count", "message_bytes")
_TOPIC_GAUGES = ("depth", "backend_depth")
_CHANNEL_COUNTERS = ("message_count", "requeue_count", "timeout_count")
_CHANNEL_GAUGES = (("depth", "depth"), ("backend_depth", "backend_depth"),
                   ("in_flight_count", "in_flight_count"),
                   ("deferred_count", "deferred_count"), ("clients", "client_count"))


class StatsdActor(Actor):
    """See the module docstring."""

    def __init__(self, name: str, options: BrokerOptions) -> None:
        super().__init__(name)
        self.options = options
        self.prefix: str | None = None
        self.last: dict[tuple[str, str], dict[str, int]] = {}  # (topic, channel) -> counters
        self.gc_runs = self._gc_runs()
        self.pauses: deque[float] = deque(maxlen=256)  # seconds, the gateway's last GCs
        self._gc_started = 0.0

    # -- lifecycle --------------------------------------------------------------

    def on_start(self) -> None:
        gc.callbacks.append(self._on_gc)
        self.tell_later(self.options.statsd_interval, StatsdTick())

    def on_stop(self) -> None:
        if self._on_gc in gc.callbacks:
            gc.callbacks.remove(self._on_gc)

    def _on_gc(self, phase: str, _info: dict[str, Any]) -> None:
        if phase == "start":
            self._gc_started = time.perf_counter()
        elif self._gc_started:
            self.pauses.append(time.perf_counter() - self._gc_started)

    @staticmethod
    def _gc_runs() -> int:
        return sum(s["collections"] for s in gc.get_stats())

    def on_receive(self, msg: Any) -> Any:
        if isinstance(msg, StatsdTick):
            try:
                self.push()
            except Exception:  # logged; the next push comes on time
                log.exception("STATSD: push to %s failed", self.options.statsd_address)
            self.tell_later(self.options.statsd_interval, StatsdTick())
        return None

    # -- a push -------------------------------------------------------------------

    def push(self) -> None:
        o = self.options
        if self.prefix is None:
            port = o.broadcast_http_port or int(self.ask("listener:http", ListenerInfo(),
                                                         timeout=5)["port"])
            self.prefix = statsd.prefix_for(o.statsd_prefix, o.broadcast_address, port)
        batch = statsd.Batch(self.prefix, o.statsd_udp_packet_size)
        seen: dict[tuple[str, str], dict[str, int]] = {}
        topics, silent = GatewayFacade(o).topics(None, None, include_clients=False)
        for topic in topics:
            t = str(topic.get("topic_name", ""))
            if o.statsd_exclude_ephemeral and is_ephemeral(t):
                continue
            self._counters(batch, f"topic.{t}", (t, ""), topic, _TOPIC_COUNTERS, seen=seen)
            for key in _TOPIC_GAUGES:
                batch.gauge(f"topic.{t}.{key}", int(topic.get(key) or 0))
            _e2e(batch, f"topic.{t}", topic)
            for channel in topic.get("channels") or ():
                c = str(channel.get("channel_name", ""))
                if o.statsd_exclude_ephemeral and is_ephemeral(c):
                    continue
                stat = f"topic.{t}.channel.{c}"
                self._counters(batch, stat, (t, c), channel, _CHANNEL_COUNTERS, seen=seen)
                for name, key in _CHANNEL_GAUGES:
                    batch.gauge(f"{stat}.{name}", int(channel.get(key) or 0))
                _e2e(batch, stat, channel)
        # A worker that did not answer (restarting) keeps its topics' last figures: when
        # it answers again, each counter goes on from them, not from zero.
        self.last = {**self.last, **seen} if silent else seen
        if o.statsd_mem_stats:
            self._mem(batch)
        packets = batch.finish()
        self.blocking(statsd.send, o.statsd_address, packets)
        log.info("STATSD: pushed %d packets to %s", len(packets), o.statsd_address)

    def _counters(self, batch: statsd.Batch, stat: str, key: tuple[str, str],
                  stats: dict[str, Any], names: tuple[str, ...], *,
                  seen: dict[tuple[str, str], dict[str, int]]) -> None:
        """nsqd's counters: the increase since the last push (all of it for a new one)."""
        before = self.last.get(key, {})
        now = {name: int(stats.get(name) or 0) for name in names}
        for name in names:
            batch.incr(f"{stat}.{name}", now[name] - before.get(name, 0))
        seen[key] = now

    def _mem(self, batch: statsd.Batch) -> None:
        rss = self.blocking(_resident_bytes, self.options)
        pauses = sorted(self.pauses)
        runs = self._gc_runs()
        batch.gauge("mem.heap_objects", len(gc.get_objects()))
        batch.gauge("mem.heap_idle_bytes", 0)
        batch.gauge("mem.heap_in_use_bytes", rss)
        batch.gauge("mem.heap_released_bytes", 0)
        for p in (100, 99, 95):
            batch.gauge(f"mem.gc_pause_usec_{p}", int(_percentile(p, pauses) * 1e6))
        batch.gauge("mem.next_gc_bytes", 0)
        batch.incr("mem.gc_runs", runs - self.gc_runs)
        self.gc_runs = runs


def _e2e(batch: statsd.Batch, stat: str, stats: dict[str, Any]) -> None:
    e2e = stats.get("e2e_processing_latency") or {}
    for p in e2e.get("percentiles") or ():
        batch.gauge(f"{stat}.e2e_processing_latency_{p['quantile'] * 100:.0f}",
                    int(p["value"]))


def _percentile(perc: float, ordered: list[float]) -> float:
    """nsqd's percentile(): the value at floor(perc% of n + 0.5), the last at most."""
    if not ordered:
        return 0.0
    return ordered[min(int(perc / 100 * len(ordered) + 0.5), len(ordered) - 1)]


def _resident_bytes(options: BrokerOptions) -> int:
    """The resident memory of every process of the broker (the supervisor's list)."""
    import psutil  # noqa: PLC0415 - only with --statsd-address, not in every start

    with ControlClient(run_dir_for(options.data_path), timeout=2.0) as ctl:
        pids = [p.pid for p in ctl.ps() if p.alive and p.pid]
    total = 0
    for pid in pids:
        try:
            total += psutil.Process(pid).memory_info().rss
        except psutil.Error:
            continue
    return total
