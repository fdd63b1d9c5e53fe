"""Renderings of a stats snapshot: Prometheus text (``/metrics``) and nsqd's text ``/stats``.

Theory of operation
-------------------
The broker already computes everything worth scraping for ``/stats``: per
topic and per channel depths and counters, and our extras, the processes of
the pool and the actors on them.  :func:`render_metrics` turns one such stats
snapshot (the dict :meth:`transport.http.api.BrokerFacade.stats` returns)
into Prometheus' text format 0.0.4, so ``/metrics`` needs no state of its own
and no second source of truth:

* **Counters, not rates.**  ``message_count``, ``requeue_count``,
  ``timeout_count``, ... grow for the life of the owning actor and are
  exported as ``*_total`` counters; Prometheus derives rates with
  ``rate()`` and handles the resets a restarted actor causes.  Depths,
  in-flight and deferred counts are gauges.
* **Families are declared up front** (the tables below), each with its
  ``# HELP`` and ``# TYPE`` lines written once before its samples, as the
  format requires; a family whose field no topic, channel, process or actor
  carries is still declared, with no samples, so the output's shape does not
  depend on the broker's state.
* **Missing or non-numeric fields are skipped**, sample by sample: the facade
  may add or omit fields (an older broker, a channel whose stats timed out)
  without breaking the exposition.  Booleans become 0/1.
* **Labels are escaped** (backslash, double quote, newline) and help text
  too (backslash, newline).  Topic and channel names cannot contain these,
  but actor and process names come from elsewhere.

Per-client series are deliberately absent: client ids churn with every
connection and would explode the number of series.

Written by hand rather than with ``prometheus_client``: the format is a
dozen lines of rules, the input is a plain dict snapshot rather than live
metric objects, and it keeps the broker free of another dependency.

:func:`format_stats_text` renders the same snapshot in nsqd's human
``/stats`` layout (its column widths, ``*P`` for paused), followed by our
processes and actors; the current time is passed in for the uptime.

Nothing here touches a socket, a clock or a logger.
"""

from __future__ import annotations

import datetime
import math
import platform
from collections.abc import Iterable, Mapping
from typing import Any, NamedTuple

from transport.protocol.validation import DISK_FAILED, DISK_FULL

__all__ = [
    "ACTOR_FAMILIES",
    "CHANNEL_FAMILIES",
    "CONTENT_TYPE",
    "PROCESS_FAMILIES",
    "TOPIC_FAMILIES",
    "Family",
    "escape_help",
    "escape_label_value",
    "format_stats_text",
    "format_value",
    "render_metrics",
]

CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"
"""What Prometheus expects for the text format."""


class Family(NamedTuple):
    """One metric family fed by one field of a stats entry."""

    name: str
    """The metric name (counters end in ``_total``)."""
    type: str
    """``gauge`` or ``counter``."""
    help: str
    """The ``# HELP`` text."""
    keys: tuple[str, ...]
    """Stats fields to read, first present wins (``depth`` or ``mailbox_depth``)."""


def _family(name: str, kind: str, text: str, *keys: str) -> Family:
    return Family(name, kind, text, keys)


TOPIC_FAMILIES: tuple[Family, ...] = (
    _family("nsq_topic_depth", "gauge",
            "Messages held by the topic (memory and disk) not yet given to channels.", "depth"),
    _family("nsq_topic_backend_depth", "gauge",
            "Messages of the topic held on disk.", "backend_depth"),
    _family("nsq_topic_deferred", "gauge",
            "Deferred messages held by the topic until a channel exists.", "deferred_count"),
    _family("nsq_topic_paused", "gauge",
            "1 if the topic is paused, else 0.", "paused"),
    _family("nsq_topic_messages_total", "counter",
            "Messages published to the topic.", "message_count"),
    _family("nsq_topic_message_bytes_total", "counter",
            "Bytes of message bodies published to the topic.", "message_bytes"),
    _family("nsq_topic_dropped_total", "counter",
            "Messages the topic dropped (ephemeral topic over its memory queue).",
            "dropped_count"),
    _family("nsq_topic_retained_bytes", "gauge",
            "Bytes of the topic's history kept by its retention policy (0: retention off).",
            "retained_bytes"),
)
"""Per topic, labelled ``topic``."""

CHANNEL_FAMILIES: tuple[Family, ...] = (
    _family("nsq_channel_depth", "gauge",
            "Messages queued in the channel (memory and disk), not in flight.", "depth"),
    _family("nsq_channel_backend_depth", "gauge",
            "Messages of the channel queued on disk.", "backend_depth"),
    _family("nsq_channel_in_flight", "gauge",
            "Messages sent to a client and not yet finished, requeued or timed out.",
            "in_flight_count"),
    _family("nsq_channel_deferred", "gauge",
            "Messages waiting for their defer or requeue delay to pass.", "deferred_count"),
    _family("nsq_channel_clients", "gauge",
            "Clients subscribed to the channel.", "client_count"),
    _family("nsq_channel_paused", "gauge",
            "1 if the channel is paused, else 0.", "paused"),
    _family("nsq_channel_backlog_alarm", "gauge",
            "1 while the channel's depth is at or above its backlog alarm depth, else 0.",
            "backlog_alarm"),
    _family("nsq_channel_messages_total", "counter",
            "Messages the channel received from its topic.", "message_count"),
    _family("nsq_channel_requeued_total", "counter",
            "Messages requeued by clients (REQ).", "requeue_count"),
    _family("nsq_channel_timed_out_total", "counter",
            "In-flight messages requeued because their timeout passed.", "timeout_count"),
    _family("nsq_channel_dead_lettered_total", "counter",
            "Messages sent to the dead-letter topic after too many attempts.",
            "dead_letter_count"),
    _family("nsq_channel_dropped_total", "counter",
            "Messages the channel dropped (ephemeral channel over its memory queue).",
            "dropped_count"),
)
"""Per channel, labelled ``topic`` and ``channel``."""

TOPIC_E2E = _family("nsq_topic_e2e_processing_latency_seconds", "summary",
                    "Time from publish to FIN of the topic's messages over the window "
                    "(--e2e-processing-latency-percentile).")
CHANNEL_E2E = _family("nsq_channel_e2e_processing_latency_seconds", "summary",
                      "Time from publish to FIN of the channel's messages over the window "
                      "(--e2e-processing-latency-percentile).")


def _e2e_text(stats: Mapping[str, Any]) -> str:
    """nsqd's ``e2e%:`` column: each percentile's value in its units (stringy's
    NanoSecondToHuman), comma-separated; empty without percentiles."""
    e2e = stats.get("e2e_processing_latency")
    if not isinstance(e2e, Mapping):
        return ""
    out = []
    for p in e2e.get("percentiles") or ():
        v = float(_number(p.get("value")) or 0) if isinstance(p, Mapping) else 0.0
        for limit, unit in ((1e9, "s"), (1e6, "ms"), (1e3, "us")):
            if v > limit:
                out.append(f"{v / limit:.1f}{unit}")
                break
        else:
            out.append(f"{v:.1f}ns")
    return ", ".join(out)


def _e2e(out: _Exposition, family: Family, labels: Mapping[str, str],
         stats: Mapping[str, Any]) -> None:
    """nsqd's ``e2e_processing_latency`` (ns) as a summary in seconds, when it has
    percentiles (none unless the broker was asked for them)."""
    e2e = stats.get("e2e_processing_latency")
    if not isinstance(e2e, Mapping) or not e2e.get("percentiles"):
        return
    out.declare((family,))
    for p in e2e["percentiles"]:
        if isinstance(p, Mapping):
            out.sample(family, {**labels, "quantile": format_value(p.get("quantile", 0))},
                       (_number(p.get("value")) or 0) / 1e9)
    out.sample(family, labels, _number(e2e.get("count")) or 0, suffix="_count")

PROCESS_FAMILIES: tuple[Family, ...] = (
    _family("nsq_process_up", "gauge",
            "1 if the broker process is running, else 0.", "alive"),
    _family("nsq_process_restarts_total", "counter",
            "Times the supervisor restarted the process.", "restarts"),
    _family("nsq_process_resident_memory_bytes", "gauge",
            "Resident memory of the process.", "rss_bytes", "rss"),
    _family("nsq_process_cpu_seconds_total", "counter",
            "CPU time (user and system) used by the process.", "cpu_seconds"),
    _family("nsq_process_threads", "gauge",
            "Threads of the process.", "num_threads", "threads"),
    _family("nsq_process_open_fds", "gauge",
            "Open file descriptors of the process.", "open_fds", "num_fds"),
)
"""Per process of the pool, labelled ``process`` and ``role``."""

ACTOR_FAMILIES: tuple[Family, ...] = (
    _family("nsq_actors", "gauge",
            "Actors of this kind on the node.", "count"),
    _family("nsq_actors_up", "gauge",
            "Actors of this kind on the node that are running.", "alive"),
    _family("nsq_actor_mailbox_depth", "gauge",
            "Messages waiting in the mailboxes of the actors of this kind.",
            "mailbox_depth", "depth"),
    _family("nsq_actor_messages_handled_total", "counter",
            "Messages the actors of this kind handled.", "handled"),
    _family("nsq_actor_restarts_total", "counter",
            "Times actors of this kind were restarted after raising.", "restarts"),
)
"""Per kind of actor (``topic``, ``channel``, ``diskqueue``, ``client``, ...), labelled
``kind`` and ``node``: bounded, whatever the number of topics and clients."""

_BROKER_FAMILIES: tuple[Family, ...] = (
    _family("nsq_healthy", "gauge",
            "1 if the broker is healthy (GET /ping answers OK), else 0.", "healthy"),
    _family("nsq_start_time_seconds", "gauge",
            "When the broker started, in seconds since the epoch.", "start_time"),
    _family("nsq_topics", "gauge", "Topics on the broker.", "topics"),
    _family("nsq_disk_full", "gauge",
            "1 while publishes are refused because the disk has no space left (they "
            "resume by themselves once space returns), else 0.", "disk_full"),
    _family("nsq_disk_failed", "gauge",
            "1 if a queue failed an fsync and takes no writes until the broker restarts "
            "(GET /ping names it), else 0.", "disk_failed"),
    _family("nsq_build_info", "gauge", "Always 1; the version is a label.", "build_info"),
)


def escape_label_value(value: str) -> str:
    """A label value as the text format wants it: ``\\``, ``"`` and newline escaped."""
    return value.replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def escape_help(text: str) -> str:
    """Help text as the text format wants it: ``\\`` and newline escaped."""
    return text.replace("\\", "\\\\").replace("\n", "\\n")


def format_value(value: float) -> str:
    """A sample value: integers exactly, floats by ``repr``, ``+Inf``/``-Inf``/``NaN``."""
    if isinstance(value, int):
        return str(value)
    if math.isnan(value):
        return "NaN"
    if math.isinf(value):
        return "+Inf" if value > 0 else "-Inf"
    if value.is_integer() and abs(value) < 2**53:
        return str(int(value))
    return repr(value)


def _number(value: Any) -> float | None:
    """``value`` as a sample value, or None if it is not a number (bools count as 0/1)."""
    if isinstance(value, bool):
        return int(value)
    if isinstance(value, int | float):
        return value
    return None


class _Exposition:
    """Families in declaration order, each with its samples."""

    def __init__(self) -> None:
        self._families: dict[str, tuple[Family, list[str]]] = {}

    def declare(self, families: Iterable[Family]) -> None:
        for family in families:
            self._families.setdefault(family.name, (family, []))

    def sample(self, family: Family, labels: Mapping[str, str], value: float,
               suffix: str = "") -> None:
        name = family.name + suffix
        if labels:
            text = ",".join(f'{k}="{escape_label_value(v)}"' for k, v in labels.items())
            line = f"{name}{{{text}}} {format_value(value)}"
        else:
            line = f"{name} {format_value(value)}"
        self._families[family.name][1].append(line)

    def entry(self, families: Iterable[Family], labels: Mapping[str, str],
              stats: Mapping[str, Any]) -> None:
        """One sample per family whose field ``stats`` carries as a number."""
        for family in families:
            for key in family.keys:
                if key in stats:
                    value = _number(stats[key])
                    if value is not None:
                        self.sample(family, labels, value)
                    break

    def render(self) -> str:
        out: list[str] = []
        for family, lines in self._families.values():
            out.append(f"# HELP {family.name} {escape_help(family.help)}")
            out.append(f"# TYPE {family.name} {family.type}")
            out.extend(lines)
        return "\n".join(out) + "\n"


def _text(value: Any) -> str:
    return "" if value is None else str(value)


def render_metrics(stats: Mapping[str, Any], *, health: str | None = None,
                   version: str = "") -> str:
    """The text exposition of one stats snapshot.

    ``stats`` has the shape of :meth:`BrokerFacade.stats` (``topics`` with
    their ``channels``, ``start_time``, ``processes``, ``actors``);
    ``health`` is :meth:`BrokerFacade.health`'s answer (None when healthy).
    """
    out = _Exposition()
    for families in (_BROKER_FAMILIES, TOPIC_FAMILIES, CHANNEL_FAMILIES,
                     PROCESS_FAMILIES, ACTOR_FAMILIES):
        out.declare(families)
    topics = [t for t in stats.get("topics") or () if isinstance(t, Mapping)]
    broker = {"healthy": health is None, "start_time": stats.get("start_time"),
              "topics": len(topics), "disk_full": DISK_FULL in (health or ""),
              "disk_failed": DISK_FAILED in (health or "")}
    out.entry(_BROKER_FAMILIES[:-1], {}, broker)
    out.sample(_BROKER_FAMILIES[-1], {"version": version}, 1)

    for topic in topics:
        name = _text(topic.get("topic_name"))
        out.entry(TOPIC_FAMILIES, {"topic": name}, topic)
        _e2e(out, TOPIC_E2E, {"topic": name}, topic)
        for channel in topic.get("channels") or ():
            if not isinstance(channel, Mapping):
                continue
            entry = channel
            if "client_count" not in channel and isinstance(channel.get("clients"), list):
                entry = {**channel, "client_count": len(channel["clients"])}
            labels = {"topic": name, "channel": _text(channel.get("channel_name"))}
            out.entry(CHANNEL_FAMILIES, labels, entry)
            _e2e(out, CHANNEL_E2E, labels, channel)

    for process in stats.get("processes") or ():
        if isinstance(process, Mapping):
            labels = {"process": _text(process.get("name")), "role": _text(process.get("role"))}
            out.entry(PROCESS_FAMILIES, labels, process)

    for actor in stats.get("actors") or ():
        if isinstance(actor, Mapping):
            labels = {"kind": _text(actor.get("kind")), "node": _text(actor.get("node"))}
            out.entry(ACTOR_FAMILIES, labels, actor)
    return out.render()


# ---------------------------------------------------------------------------
# Text stats (nsqd's printStats layout)


def _num(stats: Mapping[str, Any], key: str, default: float = 0) -> float:
    """A numeric field for the text layout; missing or non-numeric shows ``default``."""
    value = _number(stats.get(key))
    return default if value is None else value


def _go_duration(seconds: float) -> str:
    """Whole seconds the way Go prints a ``time.Duration`` (``1h2m3s``, ``45s``)."""
    total = max(0, int(seconds))
    hours, rest = divmod(total, 3600)
    minutes, secs = divmod(rest, 60)
    if hours:
        return f"{hours}h{minutes}m{secs}s"
    if minutes:
        return f"{minutes}m{secs}s"
    return f"{secs}s"


def _rfc3339(timestamp: float) -> str:
    text = datetime.datetime.fromtimestamp(timestamp).astimezone().isoformat(timespec="seconds")
    return text.removesuffix("+00:00") + "Z" if text.endswith("+00:00") else text


def _client_line(c: Mapping[str, Any], now: float) -> str:
    port = str(c.get("remote_address", "")).rpartition(":")[2]
    name = c.get("client_id") or c.get("client") or c.get("hostname") or ""
    ident = f"{name}:{port}" if port else str(name)
    connect_ts = _number(c.get("connect_ts"))
    connected = "?" if connect_ts is None else _go_duration(now - connect_ts)
    return (f"        [{c.get('version', 'V2')} {ident:<21}] state: {_num(c, 'state', 3)} "
            f"inflt: {_num(c, 'in_flight_count'):<4} rdy: {_num(c, 'ready_count'):<4} "
            f"fin: {_num(c, 'finish_count'):<8} re-q: {_num(c, 'requeue_count'):<8} "
            f"msgs: {_num(c, 'message_count'):<8} connected: {connected}")


def format_stats_text(stats: Mapping[str, Any], health: str, version: str, now: float) -> str:
    """nsqd's text ``/stats`` (its column layout), plus our processes and actors."""
    start = _number(stats.get("start_time")) or now
    lines = [f"nsqd v{version} (zmqnsq, python {platform.python_version()})",
             f"start_time {_rfc3339(start)}", f"uptime {_go_duration(now - start)}",
             "", f"Health: {health}", ""]
    topics = stats.get("topics") or []
    lines.append("Topics:" if topics else "Topics: None")
    for t in topics:
        mark = "*P " if t.get("paused") else "   "
        lines.append("")
        lines.append(f"{mark}[{t.get('topic_name', '')!s:<15}] depth: {_num(t, 'depth'):<5} "
                     f"be-depth: {_num(t, 'backend_depth'):<5} "
                     f"msgs: {_num(t, 'message_count'):<8} e2e%: {_e2e_text(t)}")
        for c in t.get("channels") or ():
            mark = "   *P " if c.get("paused") else "      "
            lines.append(
                f"{mark}[{c.get('channel_name', '')!s:<25}] depth: {_num(c, 'depth'):<5} "
                f"be-depth: {_num(c, 'backend_depth'):<5} "
                f"inflt: {_num(c, 'in_flight_count'):<4} def: {_num(c, 'deferred_count'):<4} "
                f"re-q: {_num(c, 'requeue_count'):<5} timeout: {_num(c, 'timeout_count'):<5} "
                f"msgs: {_num(c, 'message_count'):<8} e2e%: {_e2e_text(c)}")
            lines.extend(_client_line(client, now) for client in c.get("clients") or ())
    lines += ["", "Producers: None"]
    processes = stats.get("processes") or []
    if processes:
        lines += ["", "Processes:"]
        lines.extend(f"   [{p.get('name', '')!s:<15}] pid: {p.get('pid')} "
                     f"alive: {p.get('alive')} restarts: {_num(p, 'restarts')}"
                     for p in processes)
    actors = stats.get("actors") or []
    if actors:
        lines += ["", "Actors:"]
        lines.extend(f"   [{a.get('kind', '')!s:<10}] node: {a.get('node', '')!s:<9} "
                     f"count: {_num(a, 'count'):<6} alive: {_num(a, 'alive'):<6} "
                     f"mailbox: {_num(a, 'mailbox_depth', _num(a, 'depth'))} "
                     f"handled: {_num(a, 'handled')} restarts: {_num(a, 'restarts')}"
                     for a in actors)
    return "\n".join(lines) + "\n"
