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
and CPU count in ``resolved``).
"""

from __future__ import annotations

import argparse
import dataclasses
import difflib
import hashlib
import math
import os
import re
import socket
import sys
import tempfile
import tomllib
import zlib
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from actors.broker.nsq_message import MAX_ATTEMPTS, MAX_NODE_ID, is_valid_topic_name

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

LOG_LEVELS = ("debug", "info", "warn", "error", "fatal")
"""Accepted ``--log-level`` values (nsqd's; ``warning`` is read as ``warn``)."""


class OptionsError(ValueError):
    """An option has a bad value, or the config file is unreadable; ``option`` names it."""

    def __init__(self, message: str, option: str | None = None) -> None:
        super().__init__(message)
        self.option = option


def _opt(default: Any, kind: str, help_text: str) -> Any:
    return field(default=default, metadata={"kind": kind, "help": help_text})


@dataclass(frozen=True)
class BrokerOptions:
    """Every option of ``python -m actors.broker``; see each field's ``help``."""

    # -- basic (nsqd) ---------------------------------------------------------
    data_path: str = _opt("data", "str", "directory for durable queues and metadata")
    tcp_address: str = _opt("127.0.0.1:4150", "address", "<addr>:<port> for NSQ TCP clients")
    http_address: str = _opt("127.0.0.1:4151", "address", "<addr>:<port> for HTTP clients")
    broadcast_address: str | None = _opt(
        None, "str?", "address registered with lookupd (default: the hostname)"
    )
    node_id: int | None = _opt(
        None, "int?", "unique part of message ids, in [0,1024) (default: hash of the hostname)"
    )
    log_level: str = _opt("info", "log_level", "log verbosity: " + ", ".join(LOG_LEVELS))
    # -- diskqueue (nsqd) -------------------------------------------------------
    mem_queue_size: int = _opt(10000, "int", "messages kept in memory per topic/channel")
    max_bytes_per_file: int = _opt(104857600, "int", "bytes per diskqueue chunk file")
    sync_every: int = _opt(2500, "int", "messages per diskqueue fsync")
    sync_timeout: float = _opt(2.0, "duration", "longest time between diskqueue fsyncs")
    # -- queue scanning (nsqd) -------------------------------------------------
    queue_scan_interval: float = _opt(0.1, "duration", "time between in-flight/deferred sweeps")
    queue_scan_refresh_interval: float = _opt(
        5.0, "duration", "time between resizes of the scanner pool"
    )
    queue_scan_selection_count: int = _opt(20, "int", "channels examined per sweep")
    queue_scan_worker_pool_max: int = _opt(4, "int", "most concurrent scanners")
    queue_scan_dirty_percent: float = _opt(
        0.25, "float", "fraction of dirty channels that makes a sweep repeat at once"
    )
    # -- messages and commands (nsqd) ---------------------------------------------
    msg_timeout: float = _opt(
        60.0, "duration", "default time before an unfinished message is requeued"
    )
    max_msg_timeout: float = _opt(900.0, "duration", "longest message timeout a client may ask")
    max_msg_size: int = _opt(1048576, "int", "largest message body in bytes")
    max_body_size: int = _opt(5242880, "int", "largest command body (MPUB) in bytes")
    max_req_timeout: float = _opt(3600.0, "duration", "longest REQ/DPUB delay")
    client_timeout: float = _opt(60.0, "duration", "idle time before a client is disconnected")
    # -- client-overridable limits (nsqd) -------------------------------------------
    max_heartbeat_interval: float = _opt(
        60.0, "duration", "longest heartbeat interval a client may ask"
    )
    max_rdy_count: int = _opt(2500, "int", "largest RDY count a client may send")
    max_output_buffer_size: int = _opt(65536, "int", "largest output buffer a client may ask")
    max_output_buffer_timeout: float = _opt(
        30.0, "duration", "longest output buffer timeout a client may ask"
    )
    # -- ours -------------------------------------------------------------------
    zmq_address: str = _opt("tcp://127.0.0.1:4153", "zmq_address", "ZeroMQ endpoint for clients")
    workers: int | None = _opt(None, "int?", "worker processes (default: the CPU count)")
    queue_idle_close: float = _opt(
        10.0, "duration", "idle time after which a disk queue closes its files (0: never)"
    )
    cache_low_watermark: float = _opt(
        40.0, "float", "used-memory percent below which chunks stay cached"
    )
    cache_high_watermark: float = _opt(
        75.0, "float", "used-memory percent above which no chunk is cached"
    )
    max_attempts: int = _opt(0, "int", "deliveries before a message is dead-lettered (0: off)")
    dead_letter_topic: str = _opt("", "str", 'dead-letter topic (default: "<topic>.dead")')
    shutdown_timeout: float = _opt(10.0, "duration", "longest orderly shutdown")
    debug_hooks: bool = _opt(False, "bool", "enable debug-only operations (chaos tests)")

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


FIELDS: dict[str, dataclasses.Field[Any]] = {f.name: f for f in dataclasses.fields(BrokerOptions)}


# ---------------------------------------------------------------------------
# Durations

_UNITS = {
    "ns": 1e-9, "us": 1e-6, "µs": 1e-6, "μs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0
}  # fmt: skip
_PART = r"(\d+(?:\.\d*)?|\.\d+)(ns|us|µs|μs|ms|s|m|h)"
_GO_DURATION = re.compile(rf"([+-]?)((?:{_PART})+)")
_GO_PART = re.compile(_PART)
_NUMBER = re.compile(r"[+-]?(\d+(\.\d*)?|\.\d+)([eE][+-]?\d+)?")


def parse_duration(value: object) -> float:
    """Seconds from a Go duration (``"1m30s"``, ``"100ms"``) or a plain number of seconds."""
    if isinstance(value, bool):
        msg = f"{value!r} is not a duration"
        raise ValueError(msg)
    if isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip()
        if _NUMBER.fullmatch(text):
            seconds = float(text)
        elif m := _GO_DURATION.fullmatch(text):
            seconds = sum(float(n) * _UNITS[u] for n, u in _GO_PART.findall(m.group(2)))
            if m.group(1) == "-":
                seconds = -seconds
        else:
            msg = f'{value!r} is not a duration (examples: "100ms", "2s", "1m30s", "1h", 2.5)'
            raise ValueError(msg)
    else:
        msg = f"{value!r} is not a duration"
        raise ValueError(msg)
    if not math.isfinite(seconds):
        msg = f"{value!r} is not a finite duration"
        raise ValueError(msg)
    return seconds


def format_duration(seconds: float) -> str:
    """A short Go-style spelling of ``seconds``: ``0.1 -> "100ms"``, ``90 -> "1m30s"``."""
    if seconds < 0:
        return "-" + format_duration(-seconds)
    if seconds == 0:
        return "0s"
    if seconds < 1:
        ms = seconds * 1000
        return f"{ms:g}ms" if ms >= 1 else f"{seconds * 1e6:g}us"
    whole = int(seconds)
    hours, rest = divmod(whole, 3600)
    minutes, secs = divmod(rest, 60)
    secs_f = secs + (seconds - whole)
    parts = [f"{hours}h" if hours else "", f"{minutes}m" if minutes else ""]
    parts.append(f"{secs_f:g}s" if secs_f else "")
    return "".join(parts)


def to_ns(seconds: float) -> int:
    """Seconds (an option value) as int nanoseconds (queue priorities, timestamps)."""
    return round(seconds * 1_000_000_000)


def default_node_id(hostname: str | None = None) -> int:
    """nsqd's default node id: CRC-32 (IEEE) of the MD5 of the hostname, modulo 1024."""
    name = socket.gethostname() if hostname is None else hostname
    digest = hashlib.md5(name.encode(), usedforsecurity=False).digest()
    return zlib.crc32(digest) % (MAX_NODE_ID + 1)


# ---------------------------------------------------------------------------
# Conversion of raw values (config file or command line) to field types


def _convert(name: str, raw: object, label: str | None = None) -> object:
    """`raw` as option `name`'s type; errors name it as `label` (default: its flag)."""
    kind = FIELDS[name].metadata["kind"]
    try:
        if kind.endswith("?"):
            if raw is None or raw == "":
                return None
            kind = kind[:-1]
        if kind == "duration":
            return parse_duration(raw)
        if kind == "int":
            if isinstance(raw, bool) or not isinstance(raw, int | str):
                raise ValueError
            return int(raw)
        if kind == "float":
            if isinstance(raw, bool) or not isinstance(raw, int | float | str):
                raise ValueError
            return float(raw)
        if kind == "bool":
            if isinstance(raw, bool):
                return raw
            text = str(raw).strip().lower()
            if text in {"true", "1", "yes", "on"}:
                return True
            if text in {"false", "0", "no", "off"}:
                return False
            raise ValueError
        if kind == "log_level":
            level = str(raw).strip().lower()
            return "warn" if level == "warning" else level
        if not isinstance(raw, str):
            raise ValueError
        return raw
    except ValueError as e:
        expected = {"int": "an integer", "float": "a number", "bool": "true or false"}
        what = expected.get(kind, "a duration" if kind == "duration" else "a string")
        msg = f"{label or '--' + name.replace('_', '-')} must be {what}, got {raw!r}"
        raise OptionsError(msg, name) from e


def _normalise_keys(mapping: Mapping[str, object], source: str) -> dict[str, object]:
    out: dict[str, object] = {}
    for key, value in mapping.items():
        name = key.replace("-", "_")
        if name not in FIELDS:
            close = difflib.get_close_matches(name, FIELDS, n=1)
            hint = f" (did you mean {close[0]!r}?)" if close else ""
            msg = f"unknown option {key!r} in {source}{hint}"
            raise OptionsError(msg, key)
        if name in out:
            msg = f"option {name} is given twice in {source} (as {name!r} and with dashes)"
            raise OptionsError(msg, name)
        out[name] = _convert(name, value, name)  # (a config file's key)
    return out


def load_config(path: str | os.PathLike[str]) -> dict[str, object]:
    """Read a TOML config file into ``{field name: converted value}``."""
    source = f"config file {os.fspath(path)}"
    try:
        with Path(path).open("rb") as f:
            data = tomllib.load(f)
    except FileNotFoundError as e:
        msg = f"{source} does not exist"
        raise OptionsError(msg, "config") from e
    except tomllib.TOMLDecodeError as e:
        msg = f"{source} is not valid TOML: {e}"
        raise OptionsError(msg, "config") from e
    except OSError as e:
        msg = f"{source} cannot be read: {e.strerror or e}"
        raise OptionsError(msg, "config") from e
    return _normalise_keys(data, source)


# ---------------------------------------------------------------------------
# Command line


class _VersionAction(argparse.Action):
    """``--version``: looks the installed version up only when asked."""

    def __init__(self, option_strings: Sequence[str], dest: str, **kwargs: Any) -> None:
        kwargs.update(nargs=0, default=argparse.SUPPRESS)
        super().__init__(option_strings, dest, **kwargs)

    def __call__(self, parser: argparse.ArgumentParser, *_args: Any, **_kwargs: Any) -> None:
        from importlib.metadata import PackageNotFoundError, version  # noqa: PLC0415

        try:
            text = version("zmqnsq")
        except PackageNotFoundError:
            text = "unknown"
        sys.stdout.write(f"{parser.prog} {text}\n")
        parser.exit()


def _default_text(f: dataclasses.Field[Any]) -> str:
    default: Any = f.default
    if default is None or "(default" in f.metadata["help"]:  # (the help says it better)
        return ""
    if f.metadata["kind"] == "duration":
        return f" (default {format_duration(default)})"
    return f" (default {default!r})" if isinstance(default, str) else f" (default {default})"


_METAVARS = {
    "str": "TEXT",
    "address": "HOST:PORT",
    "zmq_address": "ENDPOINT",
    "log_level": "LEVEL",
    "int": "N",
    "float": "X",
    "duration": "DURATION",
}


def build_parser(prog: str = "python -m actors.broker") -> argparse.ArgumentParser:
    """The command-line parser; absent flags are absent from the namespace (no defaults)."""
    parser = argparse.ArgumentParser(
        prog=prog,
        description="A durable NSQ-style message broker.",
        argument_default=argparse.SUPPRESS,
    )
    parser.add_argument("--version", action=_VersionAction, help="print the version and exit")
    parser.add_argument(
        "--config", metavar="FILE", help="TOML file with the same keys as the flags"
    )
    for f in dataclasses.fields(BrokerOptions):
        flag = "--" + f.name.replace("_", "-")
        help_text = f.metadata["help"] + _default_text(f)
        if f.metadata["kind"] == "bool":
            parser.add_argument(
                flag, dest=f.name, action=argparse.BooleanOptionalAction, help=help_text
            )
        else:
            metavar = _METAVARS[f.metadata["kind"].rstrip("?")]
            parser.add_argument(flag, dest=f.name, metavar=metavar, help=help_text)
    return parser


def parse_options(argv: Sequence[str] | None = None) -> BrokerOptions:
    """Merge defaults, then ``--config FILE``, then flags; validate and resolve the result.

    ``argparse`` exits on unknown flags and ``--help``/``--version``; a bad
    value raises :class:`OptionsError`.
    """
    namespace = vars(build_parser().parse_args(argv))
    config_path = namespace.pop("config", None)
    values: dict[str, Any] = {}
    if config_path is not None:
        values.update(load_config(config_path))
    values.update({name: _convert(name, raw) for name, raw in namespace.items()})
    return BrokerOptions(**values).resolved()


# ---------------------------------------------------------------------------
# Validation


def _fail(name: str, problem: str) -> OptionsError:
    return OptionsError(f"invalid option {name}: {problem}", name)


def _check_host_port(name: str, value: str) -> None:
    host, sep, port = value.rpartition(":")
    ok = (
        bool(sep)
        and port.isdigit()
        and int(port) <= 65535
        and (":" not in host or (host.startswith("[") and host.endswith("]")))
    )
    if not ok:
        raise _fail(name, f'expected "<host>:<port>" (e.g. "127.0.0.1:4150"), got {value!r}')


def _check_zmq_address(name: str, value: str) -> None:
    scheme, sep, rest = value.partition("://")
    if not sep or scheme not in {"tcp", "ipc", "inproc"} or not rest:
        expected = '"tcp://<host>:<port>", "ipc://<path>" or "inproc://<name>"'
        raise _fail(name, f"expected {expected}, got {value!r}")
    if scheme == "tcp":
        host, colon, port = rest.rpartition(":")
        if not colon or not host or not (port == "*" or (port.isdigit() and int(port) <= 65535)):
            raise _fail(name, f'expected "tcp://<host>:<port>", got {value!r}')


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
        _check_host_port(name, getattr(o, name))
    _check_zmq_address("zmq_address", o.zmq_address)
    if not o.data_path:
        raise _fail("data_path", "must not be empty")
    if o.node_id is not None and not 0 <= o.node_id <= MAX_NODE_ID:
        raise _fail("node_id", f"must be in [0, {MAX_NODE_ID + 1}), got {o.node_id}")
    if o.log_level not in LOG_LEVELS:
        raise _fail("log_level", f"must be one of {', '.join(LOG_LEVELS)}, got {o.log_level!r}")
    for name in _POSITIVE_SIZES:
        if getattr(o, name) < 1:
            raise _fail(name, f"must be positive, got {getattr(o, name)}")
    if o.mem_queue_size < 0:
        raise _fail("mem_queue_size", f"must be >= 0, got {o.mem_queue_size}")
    for name in _POSITIVE_DURATIONS:
        if getattr(o, name) <= 0:
            raise _fail(name, f"must be a positive duration, got {d(getattr(o, name))}")
    if o.msg_timeout < 0.001:
        raise _fail("msg_timeout", f"must be at least 1ms, got {d(o.msg_timeout)}")
    if o.max_msg_timeout < o.msg_timeout:
        raise _fail(
            "max_msg_timeout",
            f"must be >= msg_timeout ({d(o.msg_timeout)}), got {d(o.max_msg_timeout)}",
        )
    if o.max_req_timeout < 0:
        raise _fail("max_req_timeout", f"must not be negative, got {d(o.max_req_timeout)}")
    if not 0 <= o.queue_scan_dirty_percent <= 1:
        raise _fail(
            "queue_scan_dirty_percent", f"must be in [0, 1], got {o.queue_scan_dirty_percent}"
        )
    if o.workers is not None and o.workers < 1:
        raise _fail("workers", f"must be >= 1, got {o.workers}")
    low, high = o.cache_low_watermark, o.cache_high_watermark
    if not 0 <= low <= 100:
        raise _fail("cache_low_watermark", f"must be a percentage in [0, 100], got {low}")
    if not 0 <= high <= 100:
        raise _fail("cache_high_watermark", f"must be a percentage in [0, 100], got {high}")
    if low > high:
        raise _fail("cache_low_watermark", f"must be <= cache_high_watermark ({high}), got {low}")
    if not 0 <= o.max_attempts <= MAX_ATTEMPTS:
        raise _fail(
            "max_attempts", f"must be in [0, {MAX_ATTEMPTS}] (0: off), got {o.max_attempts}"
        )
    if o.dead_letter_topic and not is_valid_topic_name(o.dead_letter_topic):
        raise _fail("dead_letter_topic", f"{o.dead_letter_topic!r} is not a valid topic name")


def run_dir_for(data_path: str) -> str:
    """Where the broker's ipc sockets go: ``<data>/run`` if short enough, else under /tmp.

    Unix socket paths are limited to about 100 bytes.
    """
    candidate = os.path.join(os.path.abspath(data_path), "run")
    if len(candidate) + 24 <= 100:
        return candidate
    digest = hashlib.sha256(os.path.abspath(data_path).encode()).hexdigest()[:12]
    return os.path.join(tempfile.gettempdir(), f"zmqnsq-{digest}")
