"""nsqd 1.x's HTTP API as an application (:mod:`transport.http.web`) over an injected broker facade.

Theory of operation
-------------------
``transport`` must not import ``actors``, so the web app never sees a topic
or channel actor.  It talks to a :class:`BrokerFacade` (a
:class:`typing.Protocol`): ``publish``, ``topic_command``, ``stats``,
``health`` and ``info``.  The gateway implements the facade on top of the
broker's actors; tests implement it with a recording fake.

The app owns nothing but HTTP: parsing the query, bounding and splitting
bodies, validating names, and turning the facade's answers and
:class:`~transport.protocol.validation.ProtocolError` codes into nsqd's status
codes and ``{"message": "CODE"}`` bodies (``_PUB_ERRORS``,
``_COMMAND_ERRORS``).  The order of checks follows nsqd's handlers, so the
same bad request gets the same first complaint (``/pub``: too big, empty,
topic, defer).

Facade calls block (an actor ask crosses processes), so every one runs on an
executor (:func:`transport.http.base.call`): the :class:`HttpServer`'s own
bounded pool, or the loop's default one for a bare :func:`make_app`.  The
event loop only parses and answers.  Bodies are read through :func:`_read_bounded`,
which stops one byte past the limit, so a client cannot make the server
buffer more than ``max_msg_size`` (``/pub``) or ``max_body_size``
(``/mpub``) whatever it sends or claims in ``Content-Length``.

:class:`HttpServer` runs the app on its own thread and event loop (the
gateway process has its own ZeroMQ loops; :class:`transport.http.base.AppServer`).

Responses follow nsqd's two decorators: ``/ping`` is plain text (``OK`` or
``NOK - reason`` with 500); every other endpoint is nsqd's "V1" style
(:mod:`transport.http.base`): ``X-NSQ-Content-Type: nsq; version=1.0``, JSON
bodies for data and errors, raw text for ``OK`` and the text stats.
``/metrics`` (ours) is Prometheus text; both it and the text stats are
rendered by :mod:`transport.http.metrics` from the one facade stats snapshot.  See ``docs/HTTP.md``.
"""

from __future__ import annotations

import asyncio
import base64
import functools
import logging
import re
import ssl
import time
from collections.abc import Awaitable, Callable, Mapping, Sequence
from concurrent.futures import Executor
from typing import Any, Protocol, TypeVar

from transport.http import web
from transport.http.base import (
    EXECUTOR,
    AppServer,
    HttpError,
    call,
    errors,
    v1,
    v1_error,
)
from transport.http.metrics import CONTENT_TYPE as METRICS_CONTENT_TYPE
from transport.http.metrics import format_stats_text, render_metrics
from transport.protocol.duration import parse_duration
from transport.protocol.validation import (
    DISK_FAILED,
    DISK_FULL,
    Limits,
    ProtocolError,
    check_channel,
    check_message_size,
    check_mpub_count,
    check_topic,
    parse_from,
    parse_message_id,
    valid_tag,
)
from transport.tls import peer_details

__all__ = ["BrokerFacade", "HttpError", "HttpServer", "make_app", "split_binary_mpub"]

logger = logging.getLogger(__name__)

_T = TypeVar("_T")


class BrokerFacade(Protocol):
    """What the HTTP API needs from the broker; every method may block.

    Errors are :class:`ProtocolError` (or anything with a string ``.code``
    and ``.text``, such as ``actors.broker.errors.BrokerError``) with nsqd's TCP
    codes; anything else becomes a 500 ``INTERNAL_ERROR``.
    """

    def publish(self, topic: str, bodies: list[bytes], defer_ms: int = 0, tag: str = "") -> None:
        """Queue ``bodies`` on ``topic`` (created if needed), all or none, tagged
        with ``tag`` if it is not empty.

        Raises ``E_BAD_TOPIC``, ``E_BAD_MESSAGE`` (empty or too big),
        ``E_BAD_BODY``, ``E_INVALID`` (defer out of range), ``E_PUB_FAILED``
        (exiting, disk full).
        """
        ...

    def topic_command(self, topic: str, command: str, channel: str = "") -> None:
        """``create``, ``delete``, ``empty``, ``pause``, ``unpause`` a topic, or
        ``create_channel``, ``delete_channel``, ``empty_channel``,
        ``pause_channel``, ``unpause_channel`` one of its channels.

        Raises ``E_BAD_TOPIC``, ``E_BAD_CHANNEL``, ``E_TOPIC_NOT_FOUND``,
        ``E_CHANNEL_NOT_FOUND``.
        """
        ...

    def channel_tags(self, topic: str, channel: str, tags: list[str] | None,
                     create: bool = False) -> dict[str, Any]:
        """Set a channel's tag filter (``[]``: none; created first if ``create``), or
        with ``tags`` None read it: ``{"topic", "channel", "tags": [...]}``.  Raises
        ``E_TOPIC_NOT_FOUND``, ``E_CHANNEL_NOT_FOUND``, ``E_INVALID``."""
        ...

    def channel_rewind(self, topic: str, channel: str, since_ns: int = 0,
                       message_id: str = "", *, create: bool = False,
                       tags: list[str] | None = None) -> dict[str, Any]:
        """Queue again on the channel the retained messages published at or after
        `since_ns` (or from the message `message_id`): ``{"messages": N}``; with
        `create`, a new channel (filtered by `tags`) starts there.  Raises
        ``E_TOPIC_NOT_FOUND``, ``E_CHANNEL_NOT_FOUND``, ``E_NOT_RETAINED``,
        ``E_REWIND_IN_PROGRESS``."""
        ...

    def message(self, topic: str, message_id: str) -> dict[str, Any]:
        """Where the message `message_id` (16 lower-case hex characters) is (#21): ``{"id",
        "timestamp", "attempts", "body" (bytes), "tag", "state", "channels"}`` (see
        docs/HTTP.md).  Raises ``E_TOPIC_NOT_FOUND``, ``E_MESSAGE_NOT_FOUND``."""
        ...

    def topic_config(self, topic: str, values: dict[str, Any] | None) -> dict[str, Any]:
        """Set a topic's own settings (``backlog_alarm_depth`` and ``retention_bytes``:
        ints >= 0, ``retention_time``: seconds >= 0; None for the broker's flag) and
        answer the effective ones (``{"topic", "backlog_alarm_depth", "retention_time"
        (a duration), "retention_bytes", "defaults"}``).  Raises ``E_TOPIC_NOT_FOUND``."""
        ...

    def stats(self, topic: str | None, channel: str | None, include_clients: bool,
              include_storage: bool = False) -> dict[str, Any]:
        """nsqd's stats: ``{"topics": [...], "start_time": int, "processes": [...],
        "actors": [...], ...}``; each topic has ``topic_name``, ``depth``,
        ``backend_depth``, ``message_count``, ``message_bytes``, ``paused`` and
        ``channels`` (``channel_name``, ``depth``, ``backend_depth``,
        ``in_flight_count``, ``deferred_count``, ``message_count``,
        ``requeue_count``, ``timeout_count``, ``client_count``, ``paused``,
        ``clients``).  Extra keys are passed through to ``/stats`` JSON.
        """
        ...

    def health(self) -> str | None:
        """None when healthy, else why not (``/ping`` answers ``NOK - <reason>``)."""
        ...

    def info(self) -> dict[str, Any]:
        """``version``, ``broadcast_address``, ``hostname``, ``http_port``,
        ``tcp_port``, ``start_time`` (nsqd's ``/info``)."""
        ...



FACADE = web.AppKey("facade", BrokerFacade)
LIMITS = web.AppKey("limits", Limits)
CLOCK: web.AppKey[Callable[[], float]] = web.AppKey("clock")
HTTP_PORT = web.AppKey("http_port", list[int])
"""One-item list, filled by :class:`HttpServer` once bound (``/info``'s ``http_port``)."""

_BOOL_PARAMS = {"true": True, "1": True, "false": False, "0": False}
_DECIMAL = re.compile(r"[+-]?[0-9]{1,18}")
_READ_CHUNK = 65536

# ProtocolError code -> (status, nsqd's HTTP message) for /pub and /mpub.  Size
# errors depend on the text ("too big" or empty); PUB failures are 503 EXITING
# as in nsqd, whose topic.PutMessage error (exiting or a failed disk write)
# always maps there -- but a full disk is 507 DISK_FULL and a failed one 503
# DISK_FAILED, each with the refusal's sentence as "detail" (_storage_error).
_PUB_ERRORS: dict[str, tuple[int, str]] = {
    "E_BAD_TOPIC": (400, "INVALID_TOPIC"),
    "E_INVALID": (400, "INVALID_DEFER"),
    "E_PUB_FAILED": (503, "EXITING"),
    "E_MPUB_FAILED": (503, "EXITING"),
    "E_DPUB_FAILED": (503, "EXITING"),
}
_COMMAND_ERRORS: dict[str, tuple[int, str]] = {
    "E_BAD_TOPIC": (400, "INVALID_TOPIC"),
    "E_BAD_CHANNEL": (400, "INVALID_CHANNEL"),
    "E_TOPIC_NOT_FOUND": (404, "TOPIC_NOT_FOUND"),
    "E_CHANNEL_NOT_FOUND": (404, "CHANNEL_NOT_FOUND"),
    "E_NOT_RETAINED": (409, "E_NOT_RETAINED"),
    "E_REWIND_IN_PROGRESS": (409, "E_REWIND_IN_PROGRESS"),
    "E_MESSAGE_NOT_FOUND": (404, "MESSAGE_NOT_FOUND"),
}


# ---------------------------------------------------------------------------
# Responses


# ---------------------------------------------------------------------------
# Helpers


def _error_code(exc: BaseException) -> tuple[str, str] | None:
    """``(code, text)`` of a protocol-style error, None for anything else."""
    code = getattr(exc, "code", None)
    if isinstance(exc, ProtocolError) or isinstance(code, str):
        return str(code), str(getattr(exc, "text", ""))
    return None


def _map_error(exc: Exception, table: Mapping[str, tuple[int, str]], what: str) -> HttpError:
    """The :class:`HttpError` for a facade error (500 ``INTERNAL_ERROR`` if unknown)."""
    pair = _error_code(exc)
    if pair is not None:
        code, text = pair
        if code in _PUB_FAILURES and (refused := _storage_error(text)) is not None:
            logger.warning("HTTP %s failed: %s %s", what, code, text)
            return refused
        if code in table:
            status, message = table[code]
            if status >= 500:
                logger.warning("HTTP %s failed: %s %s", what, code, text)
            return HttpError(status, message)
        too_big = "too big" in text
        if code == "E_BAD_MESSAGE":
            return HttpError(413, "MSG_TOO_BIG") if too_big else HttpError(400, "MSG_EMPTY")
        if code == "E_BAD_BODY":
            return HttpError(413, "BODY_TOO_BIG") if too_big else HttpError(400, "BAD_BODY")
    logger.error("HTTP %s failed: %r", what, exc)
    return HttpError(500, "INTERNAL_ERROR")


_PUB_FAILURES = frozenset({"E_PUB_FAILED", "E_MPUB_FAILED", "E_DPUB_FAILED"})


def _storage_error(text: str) -> HttpError | None:
    """507 DISK_FULL or 503 DISK_FAILED for a publish the disk refused, else None."""
    if DISK_FULL in text:
        return HttpError(507, "DISK_FULL", text)
    if DISK_FAILED in text:
        return HttpError(503, "DISK_FAILED", text)
    return None


async def _read_bounded(request: web.Request, limit: int) -> bytes | None:
    """The request body, or None if it is longer than ``limit`` (reading stops there)."""
    length = request.content_length
    if length is not None and length > limit:
        return None
    buf = bytearray()
    while True:
        chunk = await request.content.read(min(_READ_CHUNK, limit + 1 - len(buf)))
        if not chunk:
            return bytes(buf)
        buf += chunk
        if len(buf) > limit:
            return None


def _topic_arg(request: web.Request,
               invalid: tuple[int, str] = (400, "INVALID_TOPIC")) -> str:
    """The ``topic`` query argument, validated (nsqd's first value wins); `invalid` is
    the answer to a bad name, which nsqd words differently by endpoint."""
    if "topic" not in request.query:
        raise HttpError(400, "MISSING_ARG_TOPIC")
    try:
        return check_topic(request.query["topic"].encode("utf-8"), "HTTP")
    except ProtocolError:
        raise HttpError(*invalid) from None


def _channel_arg(request: web.Request,
                 invalid: tuple[int, str] = (400, "INVALID_CHANNEL")) -> str:
    if "channel" not in request.query:
        raise HttpError(400, "MISSING_ARG_CHANNEL")
    try:
        return check_channel(request.query["channel"].encode("utf-8"), "HTTP")
    except ProtocolError:
        raise HttpError(*invalid) from None


# nsqd 1.3's answers to a bad name, by endpoint (measured beside it): /channel/*
# check both names (INVALID_ARG_*); /topic/delete, pause and unpause look the topic
# up without checking the name (TOPIC_NOT_FOUND); /topic/create, empty and /pub
# say INVALID_TOPIC.
_BAD_TOPIC_BY_COMMAND = {"delete": (404, "TOPIC_NOT_FOUND"), "pause": (404, "TOPIC_NOT_FOUND"),
                         "unpause": (404, "TOPIC_NOT_FOUND")}


def _tag_arg(request: web.Request) -> str:
    """``tag``: the messages' tag (#21), '' without one; 400 ``INVALID_TAG`` if bad."""
    raw = request.query.get("tag")
    if raw is None:
        return ""
    if not raw.isascii() or not valid_tag(raw.encode("ascii")):
        raise HttpError(400, "INVALID_TAG")
    return raw


def _tags_arg(request: web.Request) -> list[str] | None:
    """``tags``: a channel's filter, a comma list (``tags=`` for none); None if absent."""
    raw = request.query.get("tags")
    if raw is None:
        return None
    tags = [t for t in raw.split(",") if t]
    if not all(t.isascii() and valid_tag(t.encode("ascii")) for t in tags):
        raise HttpError(400, "INVALID_ARG_TAGS")
    return tags


def _defer_arg(request: web.Request, limits: Limits) -> int:
    """``defer`` in ms: a decimal within ``0..max_req_timeout`` (nsqd's ``INVALID_DEFER``)."""
    raw = request.query.get("defer")
    if raw is None:
        return 0
    if not _DECIMAL.fullmatch(raw):
        raise HttpError(400, "INVALID_DEFER")
    value = int(raw)
    if value < 0 or value > limits.max_req_timeout:
        raise HttpError(400, "INVALID_DEFER")
    return value


def split_binary_mpub(body: bytes, limits: Limits) -> list[bytes]:
    """``[4B count]([4B size][body])*`` into bodies; ``ProtocolError`` as nsqd's ``readMPUB``.

    ``E_BAD_BODY`` for a missing or impossible count and for bytes left over
    after the last message (nsqd ignores those); ``E_BAD_MESSAGE`` for a
    missing, non-positive or too-big size and for a truncated message.
    """
    if len(body) < 4:
        raise ProtocolError("E_BAD_BODY", "MPUB failed to read message count")
    count = int.from_bytes(body[:4], "big", signed=True)
    check_mpub_count(count, limits)
    bodies: list[bytes] = []
    pos, end = 4, len(body)
    for i in range(count):
        if pos + 4 > end:
            raise ProtocolError("E_BAD_MESSAGE", f"MPUB failed to read message({i}) body size")
        size = int.from_bytes(body[pos : pos + 4], "big", signed=True)
        check_message_size(size, "MPUB", limits, i)
        pos += 4
        if pos + size > end:
            raise ProtocolError("E_BAD_MESSAGE", "MPUB failed to read message body")
        bodies.append(body[pos : pos + size])
        pos += size
    if pos != end:
        msg = f"MPUB body has {end - pos} bytes after its {count} messages"
        raise ProtocolError("E_BAD_BODY", msg)
    return bodies


def _split_lines(body: bytes, limits: Limits) -> list[bytes]:
    """Newline-separated messages; empty lines are skipped as in nsqd."""
    bodies = [line for line in body.split(b"\n") if line]
    if any(len(line) > limits.max_msg_size for line in bodies):
        raise HttpError(413, "MSG_TOO_BIG")
    return bodies


# ---------------------------------------------------------------------------
# Handlers


async def _ping(request: web.Request) -> web.Response:
    reason = await call(request, request.app[FACADE].health)
    if reason is None:
        return web.Response(text="OK")
    return web.Response(status=500, text=f"NOK - {reason}")


async def _info(request: web.Request) -> web.Response:
    info = dict(await call(request, request.app[FACADE].info))
    bound = request.app[HTTP_PORT]
    if bound and not info.get("http_port"):
        info["http_port"] = bound[0]
    return v1(info)


async def _pub(request: web.Request) -> web.Response:
    limits = request.app[LIMITS]
    body = await _read_bounded(request, limits.max_msg_size)
    if body is None:
        raise HttpError(413, "MSG_TOO_BIG")
    if not body:
        raise HttpError(400, "MSG_EMPTY")
    topic = _topic_arg(request)
    defer_ms = _defer_arg(request, limits)
    tag = _tag_arg(request)
    try:
        await call(request, request.app[FACADE].publish, topic, [body], defer_ms, tag)
    except Exception as e:
        raise _map_error(e, _PUB_ERRORS, "PUB") from e
    return v1("OK")


async def _mpub(request: web.Request) -> web.Response:
    limits = request.app[LIMITS]
    if request.content_length is not None and request.content_length > limits.max_body_size:
        raise HttpError(413, "BODY_TOO_BIG")
    topic = _topic_arg(request)
    tag = _tag_arg(request)
    body = await _read_bounded(request, limits.max_body_size)
    if body is None:
        raise HttpError(413, "BODY_TOO_BIG")
    binary = request.query.get("binary")
    if binary is not None and _BOOL_PARAMS.get(binary.lower(), True):
        try:
            bodies = split_binary_mpub(body, limits)
        except ProtocolError as e:
            raise HttpError(413, e.code.removeprefix("E_")) from None
    else:
        bodies = _split_lines(body, limits)
    if not bodies:
        return v1("OK")  # nsqd: a body of empty lines publishes nothing and succeeds
    try:
        await call(request, request.app[FACADE].publish, topic, bodies, 0, tag)
    except Exception as e:
        raise _map_error(e, _PUB_ERRORS, "MPUB") from e
    return v1("OK")


_Handler = Callable[[web.Request], Awaitable[web.Response]]


def _command_handler(command: str, *, channel: bool) -> _Handler:
    async def handler(request: web.Request) -> web.Response:
        if channel:
            topic = _topic_arg(request, (400, "INVALID_ARG_TOPIC"))
            channel_name = _channel_arg(request, (400, "INVALID_ARG_CHANNEL"))
        else:
            topic = _topic_arg(request, _BAD_TOPIC_BY_COMMAND.get(command, (400, "INVALID_TOPIC")))
            channel_name = ""
        facade = request.app[FACADE]
        tags = _tags_arg(request) if command == "create_channel" else None
        start = _from_arg(request) if command == "create_channel" else None
        try:
            if start is not None:  # (#21: a channel that starts from X, filtered at once)
                rewind = functools.partial(facade.channel_rewind, create=True, tags=tags)
                return v1(await call(request, rewind, topic, channel_name, *start, slow=True))
            if tags is not None:  # (created with its filter at once: no message slips by)
                await call(request, facade.channel_tags, topic, channel_name, tags, True)
            else:
                await call(request, facade.topic_command, topic, command, channel_name)
        except Exception as e:
            raise _map_error(e, _COMMAND_ERRORS, f"{request.path}") from e
        return v1()

    handler.__name__ = f"_{command}"
    return handler


TOPIC_SETTINGS = ("backlog_alarm_depth", "retention_time", "retention_bytes")
"""What ``/topic/config`` sets: a decimal >= 0 (``retention_time``: a duration, ``7d``,
``36h``, ``0``), or ``default`` (the broker's flag)."""


def _setting(request: web.Request, key: str) -> float | None:
    raw = request.query[key]
    if raw == "default":
        return None
    if key == "retention_time":
        try:
            seconds = parse_duration(raw)
        except ValueError:
            seconds = -1.0
        if seconds >= 0:
            return seconds
    elif raw.isdigit() and len(raw) <= 18:
        return int(raw)
    raise HttpError(400, f"INVALID_ARG_{key.upper()}")


async def _topic_config(request: web.Request) -> web.Response:
    """``GET /topic/config?topic=T``: the topic's effective settings; ``POST`` with
    ``backlog_alarm_depth=N``, ``retention_time=7d``, ``retention_bytes=N`` (each may be
    ``default``) sets them, kept across restarts."""
    topic = _topic_arg(request)
    values = None
    if request.method == "POST":
        values = {key: _setting(request, key) for key in TOPIC_SETTINGS if key in request.query}
        if not values:
            raise HttpError(400, "MISSING_ARG_SETTING")
    try:
        reply = await call(request, request.app[FACADE].topic_config, topic, values)
    except Exception as e:
        raise _map_error(e, _COMMAND_ERRORS, request.path) from e
    return v1(reply)


async def _channel_config(request: web.Request) -> web.Response:
    """``GET /channel/config?topic=T&channel=C``: the channel's tag filter; ``POST`` with
    ``tags=a,b`` (``tags=`` for none) sets it, kept across restarts."""
    topic = _topic_arg(request, (400, "INVALID_ARG_TOPIC"))
    channel = _channel_arg(request, (400, "INVALID_ARG_CHANNEL"))
    tags = None
    if request.method == "POST":
        tags = _tags_arg(request)
        if tags is None:
            raise HttpError(400, "MISSING_ARG_SETTING")
    try:
        reply = await call(request, request.app[FACADE].channel_tags, topic, channel, tags)
    except Exception as e:
        raise _map_error(e, _COMMAND_ERRORS, request.path) from e
    return v1(reply)


def _from_arg(request: web.Request) -> tuple[int, str] | None:
    """``from`` of ``/channel/create``: ``(since_ns, message id)``, or None when absent or
    ``now`` (a new channel starts with what is published next, as nsqd's)."""
    raw = request.query.get("from")
    if raw is None or raw == "now":
        return None
    try:
        return parse_from(raw)
    except ValueError:
        raise HttpError(400, "INVALID_ARG_FROM") from None


async def _channel_rewind(request: web.Request) -> web.Response:
    """``POST /channel/rewind?topic=T&channel=C&from=X``: the channel receives again every
    retained message published at or after X (#21); answers ``{"messages": N}``."""
    topic = _topic_arg(request)
    channel = _channel_arg(request)
    if "from" not in request.query:
        raise HttpError(400, "MISSING_ARG_FROM")
    try:
        since_ns, message_id = parse_from(request.query["from"])
    except ValueError:
        raise HttpError(400, "INVALID_ARG_FROM") from None
    try:
        reply = await call(request, request.app[FACADE].channel_rewind, topic, channel,
                           since_ns, message_id, slow=True)
    except Exception as e:
        raise _map_error(e, _COMMAND_ERRORS, request.path) from e
    return v1(reply)


async def _message(request: web.Request) -> web.Response:
    """``GET /message?topic=T&id=ID``: where that message is, in the topic, each of its
    channels and its history (#21), with its body in base64."""
    topic = _topic_arg(request)
    if "id" not in request.query:
        raise HttpError(400, "MISSING_ARG_ID")
    message_id = parse_message_id(request.query["id"])
    if message_id is None:
        raise HttpError(400, "INVALID_ARG_ID")
    try:
        reply = await call(request, request.app[FACADE].message, topic, message_id,
                           slow=True)
    except Exception as e:
        raise _map_error(e, _COMMAND_ERRORS, request.path) from e
    return v1({**reply, "body": base64.b64encode(reply["body"]).decode("ascii")})


_NO_E2E = {"count": 0, "percentiles": None}


def _collect_stats(facade: BrokerFacade, topic: str | None, channel: str | None,
                   include_clients: bool, include_storage: bool = False,
                   ) -> tuple[dict[str, Any], str | None, str]:
    """Stats filtered as nsqd filters them, health and version (one executor job)."""
    stats = dict(facade.stats(topic, channel, include_clients, include_storage))
    health = facade.health()
    version = stats.get("version") or facade.info().get("version", "")
    topics = []
    for t in stats.get("topics") or ():
        if topic and t.get("topic_name") != topic:
            continue
        channels = [c for c in t.get("channels") or ()
                    if not (topic and channel) or c.get("channel_name") == channel]
        if not include_clients:  # keep the count, drop the list (nsqd: null)
            channels = [{**c, "client_count": c.get("client_count", len(c.get("clients") or ())),
                         "clients": None} for c in channels]
        # nsqd's shape: end-to-end latency is not sampled yet (nsqd's own default)
        channels = [{"e2e_processing_latency": _NO_E2E, **c} for c in channels]
        topics.append({"e2e_processing_latency": _NO_E2E, **t, "channels": channels})
    stats["topics"] = topics if topics or not topic else None  # nsqd: null when ?topic=
    # names none
    return stats, health, str(version)


async def _stats(request: web.Request) -> web.Response:
    q = request.query
    include_clients = _BOOL_PARAMS.get(q.get("include_clients", ""), True)
    include_storage = _BOOL_PARAMS.get(q.get("include_storage", ""), False)
    facade, now = request.app[FACADE], request.app[CLOCK]

    def work() -> str | dict[str, Any]:
        stats, health, version = _collect_stats(
            facade, q.get("topic") or None, q.get("channel") or None, include_clients,
            include_storage)
        health_text = "OK" if health is None else f"NOK - {health}"
        if q.get("format") != "json":
            return format_stats_text(stats, health_text, version, now())
        out: dict[str, Any] = {"version": version, "health": health_text,
                               "start_time": stats.get("start_time", 0), "producers": []}
        out.update(stats)  # nsqd's keys first, then everything the facade adds
        out["health"] = health_text  # always from health(), in nsqd's "NOK - reason" form
        return out

    return v1(await call(request, work))


async def _metrics(request: web.Request) -> web.Response:
    facade = request.app[FACADE]

    def work() -> str:
        stats, health, version = _collect_stats(facade, None, None, False)
        return render_metrics(stats, health=health, version=version)

    text = await call(request, work)
    return web.Response(body=text.encode(), headers={"Content-Type": METRICS_CONTENT_TYPE})


# ---------------------------------------------------------------------------
# The app and its server


def make_app(facade: BrokerFacade, limits: Limits | None = None, *,
             executor: Executor | None = None,
             clock: Callable[[], float] = time.time) -> web.Application:
    """The nsqd HTTP API over ``facade``.

    ``executor`` runs the blocking facade calls (None: the loop's default
    executor); ``clock`` gives wall-clock seconds for the text stats' uptime.
    """
    app = web.Application(middlewares=[errors])
    app[FACADE] = facade
    app[LIMITS] = limits or Limits()
    if executor is not None:
        app[EXECUTOR] = executor
    app[CLOCK] = clock
    app[HTTP_PORT] = []
    get = functools.partial(app.router.add_get, allow_head=False)
    get("/ping", _ping)
    get("/info", _info)
    get("/stats", _stats)
    get("/metrics", _metrics)
    get("/message", _message)
    get("/topic/config", _topic_config)
    app.router.add_post("/topic/config", _topic_config)
    get("/channel/config", _channel_config)
    app.router.add_post("/channel/config", _channel_config)
    app.router.add_post("/channel/rewind", _channel_rewind)
    app.router.add_post("/pub", _pub)
    app.router.add_post("/mpub", _mpub)
    for command in ("create", "delete", "empty", "pause", "unpause"):
        app.router.add_post(f"/topic/{command}", _command_handler(command, channel=False))
        app.router.add_post(f"/channel/{command}",
                            _command_handler(f"{command}_channel", channel=True))
    return app


def auth_middleware(addresses: Sequence[str], method: str, *, https: bool) -> Any:
    """With ``--auth-http-address``: every POST (publishing, and each topic and channel
    action) needs ``Authorization: Bearer <secret>``, which the auth servers judge as they
    judge NSQ's AUTH (transport.auth): ``publish`` on the topic for ``/pub``, ``/mpub``
    and ``/topic/*``, ``subscribe`` on the topic and channel for ``/channel/*``.  nsqd
    1.3 leaves HTTP open beside an authenticated TCP port; this closes that.  Answers:
    401 ``AUTH_REQUIRED`` without a secret, 403 ``AUTH_FAILED`` when the servers refuse
    it (or cannot be asked), 403 ``UNAUTHORIZED`` when it may not do this.  An answer is
    kept for its TTL per secret, client address and certificate name.  GETs (``/ping``,
    ``/info``, ``/stats``, ``/metrics``) stay open."""
    import aiohttp  # noqa: PLC0415

    from transport.auth import AuthError, AuthState, query_any  # noqa: PLC0415

    cache: dict[tuple[str, str, str], AuthState] = {}
    sessions: list[aiohttp.ClientSession] = []

    @web.middleware
    async def auth(request: web.Request, handler: Any) -> web.StreamResponse:
        if request.method != "POST":
            return await handler(request)
        scheme, _, secret = request.headers.get("Authorization", "").partition(" ")
        secret = secret.strip()
        if scheme.lower() != "bearer" or not secret:
            return v1_error(401, "AUTH_REQUIRED", {"WWW-Authenticate": 'Bearer realm="nsq"'})
        transport = request.transport
        peer = transport.get_extra_info("peername") if transport is not None else None
        ip = str(peer[0]) if peer else ""
        tls_object = transport.get_extra_info("ssl_object") if transport is not None else None
        common_name = peer_details(tls_object).get("tls_common_name", "")
        loop = asyncio.get_running_loop()
        key = (secret, ip, common_name)
        state = cache.get(key)
        if state is None or state.expires <= loop.time():
            if not sessions:
                sessions.append(aiohttp.ClientSession())
            try:
                state = await query_any(sessions[0], addresses, method, remote_ip=ip, tls=https,
                                        secret=secret, common_name=common_name,
                                        clock=loop.time)
            except AuthError as e:
                logger.warning("HTTP %s from %s: AUTH failed %s", request.path, ip, e)
                cache.pop(key, None)
                return v1_error(403, "AUTH_FAILED")
            if len(cache) >= 10_000:
                cache.clear()
            cache[key] = state
        channel = request.query.get("channel", "") if request.path.startswith("/channel/") \
            else ""
        if not state.allows(request.query.get("topic", ""), channel):
            return v1_error(403, "UNAUTHORIZED")
        return await handler(request)

    async def close(_app: web.Application) -> None:
        for session in sessions:
            await session.close()

    return auth, close


class HttpServer(AppServer):
    """Serves :func:`make_app` over `facade` on its own thread (:class:`AppServer`).

    With ``ssl_context`` it serves HTTPS.  ``tls_required_https_port`` (a function
    giving the HTTPS port) makes a plain server answer every request as nsqd does
    with ``--tls-required=true``: 403 ``{"message": "TLS_REQUIRED", "https_port": N}``.
    """

    def __init__(self, facade: BrokerFacade, limits: Limits | None = None,
                 host: str = "127.0.0.1", port: int = 4151, *, max_workers: int = 8,
                 shutdown_timeout: float = 2.0, ssl_context: ssl.SSLContext | None = None,
                 tls_required_https_port: Callable[[], int] | None = None,
                 auth: tuple[Sequence[str], str] | None = None) -> None:
        self.facade = facade
        self.limits = limits or Limits()
        self.tls_required_https_port = tls_required_https_port
        self.auth = auth  # (auth server addresses, request method): see auth_middleware
        super().__init__(self._app, host, port, max_workers=max_workers,
                         shutdown_timeout=shutdown_timeout, ssl_context=ssl_context,
                         name="https-api" if ssl_context is not None else "http-api")

    def _app(self, executor: Executor, port: int) -> web.Application:
        app = make_app(self.facade, self.limits, executor=executor)
        app[HTTP_PORT].append(port)
        if self.auth is not None:
            check, close = auth_middleware(*self.auth, https=self.ssl_context is not None)
            app.middlewares.insert(0, check)
            app.on_cleanup.append(close)
        https_port = self.tls_required_https_port
        if https_port is not None:
            @web.middleware
            async def tls_required(request: web.Request, handler: Any) -> web.StreamResponse:
                return web.Response(
                    status=403, content_type="application/json", charset="utf-8",
                    headers={"X-NSQ-Content-Type": "nsq; version=1.0"},
                    text=f'{{"message": "TLS_REQUIRED", "https_port": {https_port()}}}')
            app.middlewares.insert(0, tls_required)
        return app
