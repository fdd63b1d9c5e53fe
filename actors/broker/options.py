"""The broker's options: one frozen dataclass, nsqd's flag names and defaults.

Theory of operation
-------------------
:class:`BrokerOptions` lists every knob with its default and help text (the
field ``metadata``); the command-line parser is generated from the fields, so
a new option is one new field.  Names follow nsqd (``nsqd/options.go``):
field ``mem_queue_size`` is flag ``--mem-queue-size`` and config key
``mem_queue_size`` or ``mem-queue-size``.  Our additions (``--zmq-address``,
``--workers``, ``--cache-*-watermark``, ``--max-attempts``,
``--dead-letter-topic``, ...) use the same scheme.

Values come from three layers, later ones winning::

    field defaults  <  --config FILE (TOML)  <  command-line flags

:func:`parse_options` merges them, converts every value (:func:`parse_duration`
for durations), validates the result (``__post_init__``) and
:meth:`BrokerOptions.resolved` fills the machine-dependent defaults:
``node_id`` (nsqd's hash of the hostname), ``broadcast_address`` (the
hostname) and ``workers`` (the CPU count), which are ``None`` in a freshly
constructed instance.  Any bad value raises :class:`OptionsError` (a
``ValueError``) whose sentence names the option.

Durations are float **seconds** everywhere in the options; they are written
like Go durations (``"100ms"``, ``"2s"``, ``"1m30s"``, ``"15m"``, ``"1h"``) or
as plain numbers of seconds.  Priority queues and message timestamps count
int nanoseconds: convert with :func:`to_ns`.

The only I/O here is reading the config file (and looking up the hostname
and CPU count in ``resolved``).  The machinery that turns an options
dataclass into flags and reads config files is :mod:`actors.runtime.flags`,
shared with the lookup daemon.
"""

from __future__ import annotations

import dataclasses
import os
import socket
import tempfile
import zlib
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from actors.broker.nsq_message import MAX_ATTEMPTS, MAX_NODE_ID, is_valid_topic_name
from actors.runtime import flags
from actors.runtime.flags import (
    LOG_LEVELS,
    OptionsError,
    check_host_port,
    fail,
    format_duration,
    opt,
    parse_duration,
)
from transport import tls

if TYPE_CHECKING:
    import argparse

__all__ = [
    "BrokerOptions",
    "OptionsError",
    "build_parser",
    "default_node_id",
    "format_duration",
    "load_config",
    "parse_duration",
    "parse_options",
    "to_ns",
]

@dataclass(frozen=True)
class BrokerOptions:
    """Every option of ``python -m actors.broker``; see each field's ``help``."""

    # -- basic (nsqd) ---------------------------------------------------------
    data_path: str = opt("data", "str", "directory for durable queues and metadata")
    tcp_address: str = opt("127.0.0.1:4150", "address", "<addr>:<port> for NSQ TCP clients")
    http_address: str = opt("127.0.0.1:4151", "address", "<addr>:<port> for HTTP clients")
    https_address: str = opt("", "str", "<addr>:<port> for HTTPS clients (needs --tls-cert)")
    broadcast_address: str | None = opt(
        None, "str?", "address registered with lookupd (default: the hostname)"
    )
    broadcast_tcp_port: int = opt(
        0, "int", "TCP port registered with lookupd (default: the bound --tcp-address port)")
    broadcast_http_port: int = opt(
        0, "int", "HTTP port registered with lookupd (default: the bound --http-address port)")
    lookupd_tcp_address: tuple[str, ...] = opt(
        (), "address[]", "lookupd TCP address to register with")
    node_id: int | None = opt(
        None, "int?", "unique part of message ids, in [0,1024) (default: hash of the hostname)"
    )
    log_level: str = opt("info", "log_level", "log verbosity: " + ", ".join(LOG_LEVELS))
    # -- diskqueue (nsqd) -------------------------------------------------------
    mem_queue_size: int = opt(10000, "int", "messages kept in memory per topic/channel")
    max_bytes_per_file: int = opt(104857600, "int", "bytes per diskqueue chunk file")
    sync_every: int = opt(2500, "int", "messages per diskqueue fsync")
    sync_timeout: float = opt(2.0, "duration", "longest time between diskqueue fsyncs")
    # -- queue scanning (nsqd) -------------------------------------------------
    queue_scan_interval: float = opt(0.1, "duration", "time between in-flight/deferred sweeps")
    queue_scan_refresh_interval: float = opt(
        5.0, "duration", "time between resizes of the scanner pool"
    )
    queue_scan_selection_count: int = opt(20, "int", "channels examined per sweep")
    queue_scan_worker_pool_max: int = opt(4, "int", "most concurrent scanners")
    queue_scan_dirty_percent: float = opt(
        0.25, "float", "fraction of dirty channels that makes a sweep repeat at once"
    )
    # -- messages and commands (nsqd) ---------------------------------------------
    msg_timeout: float = opt(
        60.0, "duration", "default time before an unfinished message is requeued"
    )
    max_msg_timeout: float = opt(900.0, "duration", "longest message timeout a client may ask")
    max_msg_size: int = opt(1048576, "int", "largest message body in bytes")
    max_body_size: int = opt(5242880, "int", "largest command body (MPUB) in bytes")
    max_req_timeout: float = opt(3600.0, "duration", "longest REQ/DPUB delay")
    client_timeout: float = opt(60.0, "duration", "idle time before a client is disconnected")
    # -- client-overridable limits (nsqd) -------------------------------------------
    max_heartbeat_interval: float = opt(
        60.0, "duration", "longest heartbeat interval a client may ask"
    )
    max_rdy_count: int = opt(2500, "int", "largest RDY count a client may send")
    max_output_buffer_size: int = opt(65536, "int", "largest output buffer a client may ask")
    max_output_buffer_timeout: float = opt(
        30.0, "duration", "longest output buffer timeout a client may ask"
    )
    # -- ours -------------------------------------------------------------------
    # -- TLS (nsqd's flags; transport/tls.py) -----------------------------------
    tls_cert: str = opt("", "str", "path to the certificate file (PEM)")
    tls_key: str = opt("", "str", "path to the key file (PEM)")
    tls_root_ca_file: str = opt("", "str", "path to the CA file client certificates are "
                                "checked against (default: the system's)")
    tls_client_auth_policy: str = opt("", "str", "client certificates: require or "
                                      "require-verify (both verify here; sets --tls-required)")
    tls_required: str = opt("false", "str", "require TLS for client connections: true, "
                            "false, or tcp-https (NSQ TCP only)")
    tls_min_version: str = opt("tls1.2", "str", "lowest TLS version: tls1.0, tls1.1, "
                               "tls1.2, tls1.3")
    # -- AUTH (nsqd's flags; transport/auth.py) -----------------------------------
    auth_http_address: tuple[str, ...] = opt(
        (), "str[]", "auth server (<addr>:<port> or a full URL) to check AUTH secrets with")
    auth_http_request_method: str = opt("get", "str", "how to ask the auth server: get or post")
    # -- CURVE on the ZeroMQ listener (transport/zmq/curve.py) -----------------------
    zmq_curve_secret_key: str = opt("", "str", "ZeroMQ CURVE secret certificate (made, "
                                    "with its public one beside it, if missing)")
    zmq_curve_allow: str = opt("", "str", "directory of clients' public certificates, or "
                               "a file of Z85 public keys, let in (default: any key)")
    # -- compression (nsqd's flags) ------------------------------------------------
    deflate: bool = opt(True, "bool", "let NSQ TCP clients negotiate deflate")
    max_deflate_level: int = opt(6, "int", "highest deflate level a client may ask (1-9)")
    snappy: bool = opt(True, "bool", "let NSQ TCP clients negotiate snappy")
    zmq_address: str = opt("tcp://127.0.0.1:4153", "zmq_address", "ZeroMQ endpoint for clients")
    workers: int | None = opt(None, "int?", "worker processes (default: the CPU count)")
    queue_idle_close: float = opt(
        10.0, "duration", "idle time after which a disk queue closes its files (0: never)"
    )
    cache_low_watermark: float = opt(
        40.0, "float", "used-memory percent below which chunks stay cached"
    )
    cache_high_watermark: float = opt(
        75.0, "float", "used-memory percent above which no chunk is cached"
    )
    max_attempts: int = opt(0, "int", "deliveries before a message is dead-lettered (0: off)")
    e2e_processing_latency_percentile: tuple[float, ...] = opt(
        (), "float[]", "message processing time percentile to keep, e.g. 0.99 (repeatable; "
        "none: off, nsqd's default)")
    e2e_processing_latency_window_time: float = opt(
        600.0, "duration", "time over which the percentiles are taken (nsqd's, 10m)")
    statsd_address: str = opt("", "str", "UDP <addr>:<port> of a statsd daemon to push "
                              "stats to (nsqd's)")
    statsd_prefix: str = opt("nsq.%s", "str", "prefix of the keys sent to statsd (%%s: the "
                             "broadcast address and HTTP port)")
    statsd_interval: float = opt(60.0, "duration", "time between pushes to statsd")
    statsd_mem_stats: bool = opt(True, "bool", "send memory and GC figures to statsd")
    statsd_udp_packet_size: int = opt(508, "int", "largest statsd UDP packet in bytes")
    statsd_exclude_ephemeral: bool = opt(False, "bool", "send nothing to statsd for "
                                         "ephemeral topics and channels")
    backlog_alarm_depth: int = opt(
        0, "int", "channel depth at which its backlog alarm fires (0: off; per topic: "
        "POST /topic/config?topic=T&backlog_alarm_depth=N)")
    backlog_alarm_webhook: str = opt(
        "", "str", "URL each backlog alarm's firing and clearing is POSTed to (JSON)")
    retention_time: float = opt(
        0.0, "duration", "how long each topic keeps what it published, after fan-out (e.g. "
        "7d, 36h; 0: no age limit; per topic: POST /topic/config?topic=T&retention_time=7d)")
    retention_bytes: int = opt(
        0, "int", "most bytes of history each topic keeps (0: no size limit; either limit "
        "turns retention on; per topic: POST /topic/config?topic=T&retention_bytes=N)")
    dead_letter_topic: str = opt("", "str", 'dead-letter topic (default: "<topic>.dead")')
    shutdown_timeout: float = opt(10.0, "duration", "longest orderly shutdown")
    debug_hooks: bool = opt(False, "bool", "enable debug-only operations (chaos tests)")

    def __post_init__(self) -> None:
        _validate(self)

    def resolved(self) -> BrokerOptions:
        """A copy with ``node_id``, ``broadcast_address`` and ``workers`` filled in."""
        changes: dict[str, Any] = {}
        if self.node_id is None:
            changes["node_id"] = default_node_id()
        if self.broadcast_address is None:
            changes["broadcast_address"] = socket.gethostname()
        if self.workers is None:
            changes["workers"] = os.cpu_count() or 1
        return dataclasses.replace(self, **changes) if changes else self

    def replace(self, **changes: Any) -> BrokerOptions:
        """A validated copy with ``changes`` applied."""
        return dataclasses.replace(self, **changes)

    def to_dict(self) -> dict[str, Any]:
        """Every option as plain JSON/msgpack types (durations in seconds)."""
        return dataclasses.asdict(self)

    @property
    def tls_mode(self) -> str:
        """``false``, ``true`` or ``tcp-https``: nsqd's rule, a client-certificate policy
        turns ``false`` into ``true``."""
        mode = tls.required_mode(self.tls_required) or "false"
        return "true" if mode == "false" and self.tls_client_auth_policy else mode

    def dead_letter_topic_for(self, topic: str) -> str:
        """Where messages of ``topic`` go after ``max_attempts`` deliveries.

        ``dead_letter_topic`` if set, else ``<topic>.dead``; an ephemeral
        topic's dead letters are ephemeral too (``<base>.dead#ephemeral``), and
        the base is shortened so the name stays within 64 characters.
        """
        if self.dead_letter_topic:
            return self.dead_letter_topic
        suffix = ".dead"
        base, ephemeral = topic, ""
        if topic.endswith("#ephemeral"):
            base, ephemeral = topic[: -len("#ephemeral")], "#ephemeral"
        return base[: 64 - len(suffix) - len(ephemeral)] + suffix + ephemeral


# ---------------------------------------------------------------------------
# Command line and config file (the generic machinery is actors.runtime.flags)


def build_parser(prog: str = "python -m actors.broker") -> argparse.ArgumentParser:
    """The broker's command line; absent flags are absent from the namespace."""
    return flags.build_parser(BrokerOptions, prog, "A durable NSQ-style message broker.")


def load_config(path: str | os.PathLike[str]) -> dict[str, object]:
    """Read a TOML config file into ``{field name: converted value}``."""
    return flags.load_config(BrokerOptions, path)


def parse_options(argv: Sequence[str] | None = None) -> BrokerOptions:
    """Merge defaults, then ``--config FILE``, then flags; validate and resolve the result.

    ``argparse`` exits on unknown flags and ``--help``/``--version``; a bad
    value raises :class:`OptionsError`.
    """
    return BrokerOptions(**flags.parse_flags(BrokerOptions, build_parser(), argv)).resolved()


def to_ns(seconds: float) -> int:
    """Seconds (an option value) as int nanoseconds (queue priorities, timestamps)."""
    return round(seconds * 1_000_000_000)


def default_node_id(hostname: str | None = None) -> int:
    """nsqd's default node id: CRC-32 (IEEE) of the MD5 of the hostname, modulo 1024."""
    name = socket.gethostname() if hostname is None else hostname
    import hashlib  # noqa: PLC0415 - (OpenSSL's, 3 ms: the nodes never need it)

    digest = hashlib.md5(name.encode(), usedforsecurity=False).digest()
    return zlib.crc32(digest) % (MAX_NODE_ID + 1)


# ---------------------------------------------------------------------------
# Validation


def _check_zmq_address(name: str, value: str) -> None:
    scheme, sep, rest = value.partition("://")
    if not sep or scheme not in {"tcp", "ipc", "inproc"} or not rest:
        expected = '"tcp://<host>:<port>", "ipc://<path>" or "inproc://<name>"'
        raise fail(name, f"expected {expected}, got {value!r}")
    if scheme == "tcp":
        host, colon, port = rest.rpartition(":")
        if not colon or not host or not (port == "*" or (port.isdigit() and int(port) <= 65535)):
            raise fail(name, f'expected "tcp://<host>:<port>", got {value!r}')


_POSITIVE_SIZES = (
    "max_bytes_per_file", "sync_every", "max_msg_size", "max_body_size", "max_rdy_count",
    "max_output_buffer_size", "queue_scan_selection_count", "queue_scan_worker_pool_max",
)  # fmt: skip
_POSITIVE_DURATIONS = (
    "sync_timeout", "queue_scan_interval", "queue_scan_refresh_interval", "client_timeout",
    "max_heartbeat_interval", "max_output_buffer_timeout", "shutdown_timeout",
)  # fmt: skip


def _validate(o: BrokerOptions) -> None:
    d = format_duration
    for name in ("tcp_address", "http_address"):
        check_host_port(name, getattr(o, name))
    for address in o.lookupd_tcp_address:
        check_host_port("lookupd_tcp_address", address)
    for name in ("broadcast_tcp_port", "broadcast_http_port"):
        if not 0 <= getattr(o, name) <= 65535:
            raise fail(name, f"must be a port in [0, 65535] (0: the bound one), got "
                             f"{getattr(o, name)}")
    _check_zmq_address("zmq_address", o.zmq_address)
    if o.https_address:
        check_host_port("https_address", o.https_address)
        if not o.tls_cert:
            raise fail("https_address", "needs --tls-cert and --tls-key")
    if o.zmq_curve_allow and not o.zmq_curve_secret_key:
        raise fail("zmq_curve_allow", "needs --zmq-curve-secret-key")
    if o.auth_http_request_method not in {"get", "post"}:
        raise fail("auth_http_request_method",
                   f"must be get or post, got {o.auth_http_request_method!r}")
    if not 1 <= o.max_deflate_level <= 9:
        raise fail("max_deflate_level", f"must be in [1, 9], got {o.max_deflate_level}")
    why = tls.check(o.tls_cert, o.tls_key, root_ca=o.tls_root_ca_file,
                    policy=o.tls_client_auth_policy, min_version=o.tls_min_version,
                    required=o.tls_required)
    if why is not None:
        raise OptionsError(why)
    if not o.data_path:
        raise fail("data_path", "must not be empty")
    if o.node_id is not None and not 0 <= o.node_id <= MAX_NODE_ID:
        raise fail("node_id", f"must be in [0, {MAX_NODE_ID + 1}), got {o.node_id}")
    if o.log_level not in LOG_LEVELS:
        raise fail("log_level", f"must be one of {', '.join(LOG_LEVELS)}, got {o.log_level!r}")
    for name in _POSITIVE_SIZES:
        if getattr(o, name) < 1:
            raise fail(name, f"must be positive, got {getattr(o, name)}")
    if o.mem_queue_size < 0:
        raise fail("mem_queue_size", f"must be >= 0, got {o.mem_queue_size}")
    for name in _POSITIVE_DURATIONS:
        if getattr(o, name) <= 0:
            raise fail(name, f"must be a positive duration, got {d(getattr(o, name))}")
    if o.msg_timeout < 0.001:
        raise fail("msg_timeout", f"must be at least 1ms, got {d(o.msg_timeout)}")
    if o.max_msg_timeout < o.msg_timeout:
        raise fail(
            "max_msg_timeout",
            f"must be >= msg_timeout ({d(o.msg_timeout)}), got {d(o.max_msg_timeout)}",
        )
    if o.max_req_timeout < 0:
        raise fail("max_req_timeout", f"must not be negative, got {d(o.max_req_timeout)}")
    if o.retention_time < 0:
        raise fail("retention_time", f"must not be negative, got {d(o.retention_time)}")
    if o.retention_bytes < 0:
        raise fail("retention_bytes", f"must be >= 0, got {o.retention_bytes}")
    if not 0 <= o.queue_scan_dirty_percent <= 1:
        raise fail(
            "queue_scan_dirty_percent", f"must be in [0, 1], got {o.queue_scan_dirty_percent}"
        )
    if o.workers is not None and o.workers < 1:
        raise fail("workers", f"must be >= 1, got {o.workers}")
    low, high = o.cache_low_watermark, o.cache_high_watermark
    if not 0 <= low <= 100:
        raise fail("cache_low_watermark", f"must be a percentage in [0, 100], got {low}")
    if not 0 <= high <= 100:
        raise fail("cache_high_watermark", f"must be a percentage in [0, 100], got {high}")
    if low > high:
        raise fail("cache_low_watermark", f"must be <= cache_high_watermark ({high}), got {low}")
    if not 0 <= o.max_attempts <= MAX_ATTEMPTS:
        raise fail(
            "max_attempts", f"must be in [0, {MAX_ATTEMPTS}] (0: off), got {o.max_attempts}"
        )
    for p in o.e2e_processing_latency_percentile:
        if not 0 < p <= 1:
            raise fail("e2e_processing_latency_percentile", f"must be in (0, 1], got {p}")
    if o.e2e_processing_latency_window_time <= 0:
        raise fail("e2e_processing_latency_window_time",
                   f"must be a positive duration, got {d(o.e2e_processing_latency_window_time)}")
    if o.statsd_address:
        check_host_port("statsd_address", o.statsd_address)
    if o.statsd_interval <= 0:
        raise fail("statsd_interval", f"must be a positive duration, got {d(o.statsd_interval)}")
    if o.statsd_udp_packet_size < 64:
        raise fail("statsd_udp_packet_size", f"must be at least 64, got {o.statsd_udp_packet_size}")
    if o.backlog_alarm_depth < 0:
        raise fail("backlog_alarm_depth", f"must be >= 0 (0: off), got {o.backlog_alarm_depth}")
    if o.backlog_alarm_webhook and not o.backlog_alarm_webhook.startswith(
            ("http://", "https://")):
        raise fail("backlog_alarm_webhook",
                   f"must be an http:// or https:// URL, got {o.backlog_alarm_webhook!r}")
    if o.dead_letter_topic and not is_valid_topic_name(o.dead_letter_topic):
        raise fail("dead_letter_topic", f"{o.dead_letter_topic!r} is not a valid topic name")


def run_dir_for(data_path: str) -> str:
    """Where the broker's ipc sockets go: ``<data>/run`` if short enough, else under /tmp.

    Unix socket paths are limited to about 100 bytes.
    """
    candidate = os.path.join(os.path.abspath(data_path), "run")
    if len(candidate) + 24 <= 100:
        return candidate
    import hashlib  # noqa: PLC0415

    digest = hashlib.sha256(os.path.abspath(data_path).encode()).hexdigest()[:12]
    return os.path.join(tempfile.gettempdir(), f"zmqnsq-{digest}")
